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

/// AVX2 version of [`quantize_token`], producing identical bytes: a block's maximum magnitude
/// from four 8-lane vectors, its quants by `vcvtps2dq` (round to nearest even, the default
/// MXCSR mode, as `round_ties_even`) and saturating packs (as `as i8`). The scalar loop
/// compiled for AVX2 took 9.7% of the default model's prompt processing on the AVX2 backend
/// (`perf`, Zen 4, `ZEROLAYER_KERNELS=avx2`, 512 tokens, 2 threads).
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_token_avx2(x: &[f32], acts: &mut [ActQuad]) {
    use std::arch::x86_64::*;
    let nblocks = x.len() / 32;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // The packs interleave 128-bit lanes; this puts the 32 bytes back in element order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let hsum = |v: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    };
    for (qi, a) in acts.iter_mut().enumerate() {
        if 4 * qi + 4 > nblocks {
            *a = ActQuad::ZERO;
        }
        for l in 0..4 {
            let b = 4 * qi + l;
            if b >= nblocks {
                break;
            }
            // SAFETY: block `b` is inside `x` (32 floats).
            let v: [__m256; 4] =
                std::array::from_fn(|k| unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * b + 8 * k)) });
            // `max_ps(new, m)` returns `m` where `new` is NaN, as `f32::max` ignores NaN.
            let m = v.iter().fold(_mm256_setzero_ps(), |m, &vk| {
                _mm256_max_ps(_mm256_and_ps(vk, abs_mask), m)
            });
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_movehdup_ps(m));
            let (d, id) = block_scale(_mm_cvtss_f32(m));
            let idv = _mm256_set1_ps(id);
            // NaN products (non-finite activations) become 0, as `as i8` makes them.
            let q = v.map(|vk| {
                let p = _mm256_mul_ps(vk, idv);
                let p = _mm256_and_ps(p, _mm256_cmp_ps::<_CMP_ORD_Q>(p, p));
                _mm256_cvtps_epi32(p)
            });
            let s0 = hsum(_mm256_add_epi32(q[0], q[1]));
            let s1 = hsum(_mm256_add_epi32(q[2], q[3]));
            let bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(
                    _mm256_packs_epi32(q[0], q[1]),
                    _mm256_packs_epi32(q[2], q[3]),
                ),
                order,
            );
            // SAFETY: each store writes 16 bytes inside a 64-byte array.
            unsafe {
                _mm_storeu_si128(
                    a.x0.as_mut_ptr().add(16 * l).cast(),
                    _mm256_castsi256_si128(bytes),
                );
                _mm_storeu_si128(
                    a.x1.as_mut_ptr().add(16 * l).cast(),
                    _mm256_extracti128_si256::<1>(bytes),
                );
            }
            let sx = d * (s0 + s1) as f32;
            for k in 4 * l..4 * l + 4 {
                a.dx[k] = d;
                a.sx[k] = sx;
                a.sq[k] = s0 + s1;
                a.sq0[k] = s0;
                a.sq1[k] = s1;
            }
        }
    }
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
                    // One all-zero block; one whose scale is 1 (maximum 127) with exact
                    // ties to round to even; one with NaNs (ignored by the maximum, quantized
                    // to 0) and a negative zero; one with an infinity; and a wide range of
                    // magnitudes.
                    match (i / 32, i % 32) {
                        (1, _) => 0.0,
                        (2, 0) => -127.0,
                        (2, e) => (e as f32 - 16.0) + 0.5,
                        (3, 5 | 17) => f32::NAN,
                        (3, 6) => -0.0,
                        (5, 9) => f32::NEG_INFINITY,
                        _ => v * (1 << (i % 7)) as f32,
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
