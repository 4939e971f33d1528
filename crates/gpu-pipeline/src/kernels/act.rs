//! On-the-fly quantization of f32 activations to 8 bits per 32-element block.
//!
//! Block `b` of a token: `d = max|x| / 127`, `q = round_ties_even(x / d)` (computed as `x * (1/d)`),
//! so `x ≈ d * q`. Blocks are stored four at a time in an [`ActQuad`], laid out for the AVX-512
//! kernels (see there); every backend reads the same bytes, so they all see identical `q` and `d`.

use super::CpuIsa;

/// Four consecutive 32-element activation blocks (`4 * 32` columns) of one token.
///
/// Lane conventions: `x0[16 * L + e]` is element `e` of block `L`, `x1[16 * L + e]` element
/// `16 + e`; the 16-lane vectors hold block `L`'s value in lanes `4 * L .. 4 * L + 4` (broadcast so
/// they line up with the 4-rows-by-4-blocks result lanes of the kernels). Blocks past the end of
/// the row are all zero.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActQuad {
    pub(crate) x0: [i8; 64],
    pub(crate) x1: [i8; 64],
    /// Scale `d`.
    pub(crate) dx: [f32; 16],
    /// `d * sum(q)`.
    pub(crate) sx: [f32; 16],
    /// `sum(q)` over the block.
    pub(crate) sq: [i32; 16],
    /// `sum(q)` over elements 0..16.
    pub(crate) sq0: [i32; 16],
    /// `sum(q)` over elements 16..32.
    pub(crate) sq1: [i32; 16],
}

const _: () = assert!(size_of::<ActQuad>() == 448);

impl ActQuad {
    pub(crate) const ZERO: Self = Self {
        x0: [0; 64],
        x1: [0; 64],
        dx: [0.0; 16],
        sx: [0.0; 16],
        sq: [0; 16],
        sq0: [0; 16],
        sq1: [0; 16],
    };

    /// Element `e` (0..32) of block `l` (0..4).
    #[inline(always)]
    pub(crate) fn q(&self, l: usize, e: usize) -> i8 {
        if e < 16 {
            self.x0[16 * l + e]
        } else {
            self.x1[16 * l + e - 16]
        }
    }
}

/// One 32-element activation block in the compact layout of the panel kernel (one cache line):
/// the same `q`, `d`, `d * sum(q)`, `sum(q)` and `sum(q[0..16])` as the block's entries in an
/// [`ActQuad`].
// Only the x86_64 panel kernel reads these (the scalar quantizer stays as its tested reference).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActBlock {
    /// Elements in order.
    pub(crate) q: [i8; 32],
    /// Scale `d`.
    pub(crate) d: f32,
    /// `d * sum(q)`.
    pub(crate) sx: f32,
    /// `sum(q)`.
    pub(crate) sq: i32,
    /// `sum(q)` over elements 0..16 (the split formats' first half; the second's is `sq - sq0`).
    pub(crate) sq0: i32,
}

const _: () = assert!(size_of::<ActBlock>() == 64);

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl ActBlock {
    pub(crate) const ZERO: Self = Self {
        q: [0; 32],
        d: 0.0,
        sx: 0.0,
        sq: 0,
        sq0: 0,
    };

    /// The activation sum of elements 0..16 (`part` 0), 16..32 (1) or all 32 (2).
    #[inline(always)]
    pub(crate) fn sum(&self, part: usize) -> i32 {
        match part {
            0 => self.sq0,
            1 => self.sq - self.sq0,
            _ => self.sq,
        }
    }

    /// `-(sum(part) << shift)`: where the formats with an offset (`2^shift`, subtracted from
    /// every quant) start their integer dot products, so that the sums come out offset.
    #[inline(always)]
    pub(crate) fn offset_start(&self, part: usize, shift: i32) -> i32 {
        -(self.sum(part) << shift)
    }
}

/// Quantizes `n = x.len() / cols` tokens into `out` (`n * cols / 32` blocks).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn quantize_blocks(backend: CpuIsa, x: &[f32], out: &mut [ActBlock]) {
    match backend {
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx512 => {
            // SAFETY: the caller checked that the AVX-512 backend is available.
            unsafe { super::avx512::quantize_blocks(x, out) }
        }
        _ => {
            for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
                let (d, q, s0, s1) = quant_block(xb);
                o.q = q;
                o.d = d;
                o.sx = d * (s0 + s1) as f32;
                o.sq = s0 + s1;
                o.sq0 = s0;
            }
        }
    }
}

super::multiversion! {
    /// `lo = x - d * q` for the blocks of one or more tokens quantized into `acts`: what their
    /// 8-bit quantization of `x` left, the same values [`super::split_residual`] computes, from
    /// the quants already there.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn block_residual(x: &[f32], acts: &[ActBlock], lo: &mut [f32]) -> () {
        for ((xb, a), lb) in x.chunks_exact(32).zip(acts).zip(lo.chunks_exact_mut(32)) {
            for i in 0..32 {
                lb[i] = xb[i] - f32::from(a.q[i]) * a.d;
            }
        }
    }
}

/// Activation quads per token of `cols` columns.
pub(crate) fn quads_per_token(cols: usize) -> usize {
    cols.div_ceil(128)
}

/// Quantizes `n = x.len() / cols` tokens into `acts` (`n * quads_per_token(cols)` quads).
pub(crate) fn quantize_tokens(backend: CpuIsa, x: &[f32], cols: usize, acts: &mut [ActQuad]) {
    let nq = quads_per_token(cols);
    for (xt, at) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(nq)) {
        match backend {
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx512 => {
                // SAFETY: the caller checked that the AVX-512 backend is available.
                unsafe { super::avx512::quantize_token(xt, at) }
            }
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 | CpuIsa::Avx2Vnni => {
                // SAFETY: the caller checked that the AVX2 backend is available.
                unsafe { quantize_token_avx2(xt, at) }
            }
            _ => quantize_token(xt, at),
        }
    }
}

/// [`quantize_token`] compiled for AVX2 (rounding is `vroundps`, not a libm call; measured
/// 5% of prompt processing on an AVX2-only host).
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_token_avx2(x: &[f32], acts: &mut [ActQuad]) {
    quantize_token(x, acts);
}

/// Scale and reciprocal of a block with maximum magnitude `amax`.
#[inline(always)]
pub(crate) fn block_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// Scale, quants and the sums of quants 0..16 and 16..32 of one 32-element block (the scalar
/// reference of every quantizer).
#[inline(always)]
fn quant_block(blk: &[f32]) -> (f32, [i8; 32], i32, i32) {
    let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (d, id) = block_scale(amax);
    // A plain loop, not `array::from_fn`: its closure is not inlined into the AVX2 caller,
    // and would round with a libm call.
    let mut q = [0i8; 32];
    for (qe, &x) in q.iter_mut().zip(blk) {
        *qe = (x * id).round_ties_even() as i8;
    }
    let sum = |r: std::ops::Range<usize>| q[r].iter().map(|&v| i32::from(v)).sum::<i32>();
    (d, q, sum(0..16), sum(16..32))
}

/// Scalar quantization of one token.
#[inline(always)]
pub(crate) fn quantize_token(x: &[f32], acts: &mut [ActQuad]) {
    for (qi, a) in acts.iter_mut().enumerate() {
        *a = ActQuad::ZERO;
        for l in 0..4 {
            let start = (4 * qi + l) * 32;
            if start >= x.len() {
                break;
            }
            let (d, q, s0, s1) = quant_block(&x[start..start + 32]);
            a.x0[16 * l..16 * l + 16].copy_from_slice(&q[..16]);
            a.x1[16 * l..16 * l + 16].copy_from_slice(&q[16..]);
            for k in 0..4 {
                a.dx[4 * l + k] = d;
                a.sx[4 * l + k] = d * (s0 + s1) as f32;
                a.sq[4 * l + k] = s0 + s1;
                a.sq0[4 * l + k] = s0;
                a.sq1[4 * l + k] = s1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(a: &ActQuad) -> (Vec<i8>, Vec<u32>, Vec<i32>) {
        let x = a.x0.iter().chain(&a.x1).copied().collect();
        let f = a.dx.iter().chain(&a.sx).map(|v| v.to_bits()).collect();
        let i = a.sq.iter().chain(&a.sq0).chain(&a.sq1).copied().collect();
        (x, f, i)
    }

    /// Every backend's quantization writes the same bytes as the scalar one (the kernels rely on
    /// it for cross-kernel bit identity), partial last quads and zero blocks included.
    #[test]
    fn backends_quantize_identically() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for blocks in 1..=21 {
            let cols = 32 * blocks;
            let x: Vec<f32> = (0..cols)
                .map(|i| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let v = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    // One all-zero block, and a wide range of magnitudes.
                    if i / 32 == 1 {
                        0.0
                    } else {
                        v * (1 << (i % 7)) as f32
                    }
                })
                .collect();
            let nq = quads_per_token(cols);
            let mut want = vec![ActQuad::ZERO; nq];
            quantize_token(&x, &mut want);
            for backend in CpuIsa::available() {
                let mut got = vec![ActQuad::ZERO; nq];
                quantize_tokens(backend, &x, cols, &mut got);
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(fields(g), fields(w), "{backend:?} cols {cols}");
                }
                // The compact blocks carry the same values.
                let mut blocks = vec![ActBlock::ZERO; blocks];
                quantize_blocks(backend, &x, &mut blocks);
                for (b, blk) in blocks.iter().enumerate() {
                    let a = &want[b / 4];
                    let l = b % 4;
                    let q: Vec<i8> = (0..32).map(|e| a.q(l, e)).collect();
                    assert_eq!(blk.q.to_vec(), q, "{backend:?} cols {cols} block {b}");
                    assert_eq!(blk.d.to_bits(), a.dx[4 * l].to_bits());
                    assert_eq!(blk.sx.to_bits(), a.sx[4 * l].to_bits());
                    assert_eq!(blk.sq, a.sq[4 * l]);
                    assert_eq!(blk.sq0, a.sq0[4 * l]);
                }
            }
        }
    }
}
