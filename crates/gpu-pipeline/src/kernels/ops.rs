//! Element-wise and reduction helpers of the transformer forward pass (norms, softmax, SwiGLU,
//! RoPE, attention dot/axpy over f32 or f16 KV rows).
//!
//! Reductions use independent partial sums combined in a fixed tree, so results depend only on
//! the input length (never on threads or batch). The bodies are compiled for AVX-512, for AVX2 +
//! FMA + F16C and for the baseline target from the same code ([`multiversion`]), and the widest
//! the CPU has runs. The model's element-wise steps use these same functions.

use half::f16;

use crate::model::RopeLayout;

/// Errors of the helpers in this module: mismatched slice lengths.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpsError {
    /// Two slices that must be equally long (or in a fixed ratio) are not.
    #[error("{what}: expected {expected} elements, got {actual}")]
    LengthMismatch {
        /// Which argument.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Given length.
        actual: usize,
    },
}

fn check(what: &'static str, expected: usize, actual: usize) -> Result<(), OpsError> {
    if expected == actual {
        Ok(())
    } else {
        Err(OpsError::LengthMismatch {
            what,
            expected,
            actual,
        })
    }
}

/// Whether the CPU has AVX2, FMA and F16C (detected once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Defines `$name` running `$body` compiled for AVX-512 (where the kernels' AVX-512 backend is in
/// use), else for AVX2 + FMA + F16C when available, else as is. It is the same code every time
/// (Rust never contracts or reassociates float operations, and `mul_add` / `round_ties_even` are
/// exactly rounded everywhere), so the results are bit-identical; only the instructions differ.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),*) -> $ret:ty $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")]
                fn wide($($arg: $ty),*) -> $ret { body($($arg),*) }
                #[target_feature(enable = "avx2,fma,f16c")]
                fn fast($($arg: $ty),*) -> $ret { body($($arg),*) }
                if $crate::kernels::has_avx512() {
                    // SAFETY: the AVX-512 backend is in use, so the CPU has these features.
                    return unsafe { wide($($arg),*) };
                }
                if $crate::kernels::has_avx2() {
                    // SAFETY: the features were detected at run time.
                    return unsafe { fast($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Arguments below this get `exp_f(x) = 0` (also keeps `2^n` normal).
pub(crate) const EXP_MIN: f32 = -87.0;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_145_75;
pub(crate) const LN2_LO: f32 = 1.428_606_8e-6;
/// Taylor coefficients 1/k! for k = 7 down to 2 (then 1 and 1).
pub(crate) const EXP_C: [f32; 6] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
];

/// `e^x` for `x <= 0` (relative error ~1e-7); 0 below [`EXP_MIN`] and for NaN. Attention's vector
/// version performs the same operations lane by lane.
#[inline(always)]
pub(crate) fn exp_f(x: f32) -> f32 {
    if x.is_nan() || x < EXP_MIN {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_C[0];
    for c in &EXP_C[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // SAFETY: `n` is not NaN (x is not, and x * LOG2E is finite or -inf only below EXP_MIN) and
    // the clamp keeps it in i32 range; for x in [EXP_MIN, 0] it is in -126..=0 and unchanged. The
    // unchecked conversion lets loops of this function vectorize (a saturating one does not).
    let e = unsafe { n.clamp(-127.0, 127.0).to_int_unchecked::<i32>() };
    p * f32::from_bits(((e + 127) as u32) << 23)
}

multiversion! {
    /// RMSNorm of every `w.len()`-long row of `x` into `out`: the sum of squares in f64, as 8
    /// partial sums (element `i` into sum `i % 8`) added as `((s0+s4)+(s2+s6))+((s1+s5)+(s3+s7))`.
    pub(crate) fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> () {
        let d = w.len();
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let mut s = [0.0f64; 8];
            let mut it = xr.chunks_exact(8);
            for c in &mut it {
                for l in 0..8 {
                    s[l] += f64::from(c[l]) * f64::from(c[l]);
                }
            }
            for (l, &v) in it.remainder().iter().enumerate() {
                s[l] += f64::from(v) * f64::from(v);
            }
            let ss = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
            let inv = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
                *o = v * inv * g;
            }
        }
    }
}

multiversion! {
    /// `gate = silu(gate) * up`, with `silu(g) = g * sigmoid(g)` and the sigmoid from
    /// `e = exp(-|g|)`: `1 / (1 + e)` for `g >= 0`, `e / (1 + e)` below (no overflow).
    pub(crate) fn silu_mul_rows(gate: &mut [f32], up: &[f32]) -> () {
        for (g, &u) in gate.iter_mut().zip(up) {
            let e = exp_f(-g.abs());
            let num = if *g >= 0.0 { 1.0 } else { e };
            *g = *g * (num / (1.0 + e)) * u;
        }
    }
}

/// `tanh(x)` from `t = exp(-2|x|)`: `sign(x) (1 - t) / (1 + t)` (no overflow; relative error
/// ~1e-7 away from 0, absolute ~1e-7 near it).
#[inline(always)]
pub(crate) fn tanh_f(x: f32) -> f32 {
    let t = exp_f(-2.0 * x.abs());
    ((1.0 - t) / (1.0 + t)).copysign(x)
}

multiversion! {
    /// `gate = gelu(gate) * up` with the tanh approximation
    /// `gelu(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))` (Gemma's GeGLU).
    pub(crate) fn gelu_tanh_mul_rows(gate: &mut [f32], up: &[f32]) -> () {
        const S2PI: f32 = 0.797_884_6;
        for (g, &u) in gate.iter_mut().zip(up) {
            let x = *g;
            let t = tanh_f(S2PI * x * (1.0 + 0.044_715 * x * x));
            *g = 0.5 * x * (1.0 + t) * u;
        }
    }
}

multiversion! {
    /// `x = cap * tanh(x / cap)` (Gemma's logit soft-capping).
    pub(crate) fn softcap_rows(x: &mut [f32], cap: f32) -> () {
        let inv = 1.0 / cap;
        for v in x.iter_mut() {
            *v = cap * tanh_f(*v * inv);
        }
    }
}

multiversion! {
    /// The rounding residual of the kernels' 8-bit activation quantization, per 32-element
    /// block: `lo = x - round(x / d) * d` with `d = amax / 127` (`act::block_scale`, as the
    /// activation quantizers compute `d` and the quants), so `x = d * q + lo` with `q` the quants the
    /// kernels multiply.
    pub(crate) fn split_residual(x: &[f32], lo: &mut [f32]) -> () {
        for (xb, lb) in x.chunks(32).zip(lo.chunks_mut(32)) {
            // max |v| on the bit patterns (for non-negative floats the integer order is the
            // float order; NaN counts as 0, as in a float `max` fold from 0): the same value as
            // `fold(0.0, |m, v| m.max(v.abs()))`, as an integer reduction that vectorizes.
            let key = |v: &f32| {
                let b = v.to_bits() & 0x7FFF_FFFF;
                if b > 0x7F80_0000 { 0 } else { b }
            };
            // A whole block as a fixed-size array, so the reduction is unrolled into vectors.
            let bits = match <&[f32; 32]>::try_from(xb) {
                Ok(blk) => blk.iter().map(key).fold(0u32, u32::max),
                Err(_) => xb.iter().map(key).fold(0u32, u32::max),
            };
            let (d, id) = super::act::block_scale(f32::from_bits(bits));
            for (&v, l) in xb.iter().zip(lb.iter_mut()) {
                *l = v - (v * id).round_ties_even() * d;
            }
        }
    }
}

multiversion! {
    /// `y += x` element by element (over the shorter length).
    pub(crate) fn add_rows(y: &mut [f32], x: &[f32]) -> () {
        y.iter_mut().zip(x).for_each(|(a, b)| *a += b);
    }
}

#[inline(always)]
fn tree16(acc: [f32; 16]) -> f32 {
    let mut a = acc;
    for w in [8, 4, 2, 1] {
        for i in 0..w {
            a[i] += a[i + w];
        }
    }
    a[0]
}

multiversion! {
    fn dot_impl(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0.0f32; 16];
        let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for i in 0..16 {
                acc[i] = x[i].mul_add(y[i], acc[i]);
            }
        }
        let mut s = tree16(acc);
        for (x, y) in ra.iter().zip(rb) {
            s = x.mul_add(*y, s);
        }
        s
    }
}

multiversion! {
    fn dot_f16_impl(a: &[f32], b: &[f16]) -> f32 {
        let mut acc = [0.0f32; 16];
        let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            let mut yf = [0.0f32; 16];
            half::slice::HalfFloatSliceExt::convert_to_f32_slice(y, &mut yf);
            for i in 0..16 {
                acc[i] = x[i].mul_add(yf[i], acc[i]);
            }
        }
        let mut s = tree16(acc);
        for (x, y) in ra.iter().zip(rb) {
            s = x.mul_add(y.to_f32(), s);
        }
        s
    }
}

multiversion! {
    fn axpy_impl(y: &mut [f32], a: f32, x: &[f32]) -> () {
        for (yv, xv) in y.iter_mut().zip(x) {
            *yv = a.mul_add(*xv, *yv);
        }
    }
}

multiversion! {
    fn axpy_f16_impl(y: &mut [f32], a: f32, x: &[f16]) -> () {
        let mut cy = y.chunks_exact_mut(16);
        let mut cx = x.chunks_exact(16);
        for (yv, xv) in (&mut cy).zip(&mut cx) {
            let mut xf = [0.0f32; 16];
            half::slice::HalfFloatSliceExt::convert_to_f32_slice(xv, &mut xf);
            for i in 0..16 {
                yv[i] = a.mul_add(xf[i], yv[i]);
            }
        }
        for (yv, xv) in cy.into_remainder().iter_mut().zip(cx.remainder()) {
            *yv = a.mul_add(xv.to_f32(), *yv);
        }
    }
}

/// `sum(a[i] * b[i])`.
pub fn dot(a: &[f32], b: &[f32]) -> Result<f32, OpsError> {
    check("dot: b", a.len(), b.len())?;
    Ok(dot_impl(a, b))
}

/// `sum(a[i] * b[i])` with `b` in f16 (an f16 KV cache row).
pub fn dot_f16(a: &[f32], b: &[f16]) -> Result<f32, OpsError> {
    check("dot_f16: b", a.len(), b.len())?;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2, FMA and F16C were detected at run time; the lengths are equal.
        return Ok(unsafe { f16c::dot(a, b) });
    }
    Ok(dot_f16_impl(a, b))
}

/// `y += a * x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) -> Result<(), OpsError> {
    check("axpy: x", y.len(), x.len())?;
    axpy_impl(y, a, x);
    Ok(())
}

/// `y += a * x` with `x` in f16 (an f16 KV cache row).
pub fn axpy_f16(y: &mut [f32], a: f32, x: &[f16]) -> Result<(), OpsError> {
    check("axpy_f16: x", y.len(), x.len())?;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2, FMA and F16C were detected at run time; the lengths are equal.
        unsafe { f16c::axpy(y, a, x) };
        return Ok(());
    }
    axpy_f16_impl(y, a, x);
    Ok(())
}

/// F16C versions of the f16 KV-row operations: the same lanes, FMAs and reduction tree as the
/// portable code (bit-identical results), with 8 halves converted per instruction instead of a
/// library call per 16-element chunk (which made f16 attention ~20x slower than f32).
#[cfg(target_arch = "x86_64")]
pub(crate) mod f16c {
    use std::arch::x86_64::*;

    use half::f16;

    /// # Safety
    /// AVX2, FMA and F16C are available; `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f16]) -> f32 {
        let n = a.len() / 16 * 16;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (pa, pb) = (a.as_ptr(), b.as_ptr().cast::<u16>());
        let mut i = 0;
        while i < n {
            // SAFETY: `i + 16 <= n <= a.len() == b.len()`: all 16 loads are in bounds.
            unsafe {
                let b0 = _mm256_cvtph_ps(_mm_loadu_si128(pb.add(i).cast()));
                let b1 = _mm256_cvtph_ps(_mm_loadu_si128(pb.add(i + 8).cast()));
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), b0, lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), b1, hi);
            }
            i += 16;
        }
        // tree16: lanes + 8, + 4, + 2, + 1.
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        let mut s = _mm_cvtss_f32(s1);
        for (x, y) in a[n..].iter().zip(&b[n..]) {
            s = x.mul_add(y.to_f32(), s);
        }
        s
    }

    /// # Safety
    /// AVX2, FMA and F16C are available; `y.len() == x.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy(y: &mut [f32], a: f32, x: &[f16]) {
        let n = y.len() / 8 * 8;
        let av = _mm256_set1_ps(a);
        let (py, px) = (y.as_mut_ptr(), x.as_ptr().cast::<u16>());
        let mut i = 0;
        while i < n {
            // SAFETY: `i + 8 <= n <= y.len() == x.len()`.
            unsafe {
                let xv = _mm256_cvtph_ps(_mm_loadu_si128(px.add(i).cast()));
                let yv = _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(py.add(i)));
                _mm256_storeu_ps(py.add(i), yv);
            }
            i += 8;
        }
        for (yv, xv) in y[n..].iter_mut().zip(&x[n..]) {
            *yv = a.mul_add(xv.to_f32(), *yv);
        }
    }
}

/// `y += x` (residual connections).
pub fn add_assign(y: &mut [f32], x: &[f32]) -> Result<(), OpsError> {
    check("add_assign: x", y.len(), x.len())?;
    add_rows(y, x);
    Ok(())
}

/// RMSNorm: `out[i] = x[i] / sqrt(mean(x²) + eps) * weight[i]` (the sum of squares in f64, as
/// ggml does, as 8 partial sums in a fixed order: the model's own norm).
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), OpsError> {
    check("rmsnorm: weight", x.len(), weight.len())?;
    check("rmsnorm: out", x.len(), out.len())?;
    if x.is_empty() {
        return Ok(());
    }
    rmsnorm_rows(x, weight, eps, out);
    Ok(())
}

/// In-place softmax (max-subtracted; the sum in f64). An empty slice is left alone.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if x.is_empty() || max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// SwiGLU: `gate[i] = silu(gate[i]) * up[i]`, `silu(g) = g / (1 + exp(-g))`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) -> Result<(), OpsError> {
    check("silu_mul: up", gate.len(), up.len())?;
    silu_mul_rows(gate, up);
    Ok(())
}

/// RoPE of whole heads in place, with one position's table: `x` holds heads of `head_dim`,
/// `cos_sin` the `n_rot / 2` rotated pairs' `(cos, sin)` interleaved (`n_rot = cos_sin.len() <=
/// head_dim`; dimensions past `n_rot` are left as they are). [`RopeLayout::Normal`] (GPT-J,
/// llama.cpp's `LLAMA_ROPE_TYPE_NORM`) rotates the adjacent pairs `(2i, 2i + 1)`,
/// [`RopeLayout::Neox`] the pairs `(i, i + n_rot / 2)`. The model's forward pass rotates its
/// heads with this function's arithmetic.
///
/// ```
/// use gpu_pipeline::RopeLayout;
/// use gpu_pipeline::kernels::rope;
/// let cos_sin = [0.0, 1.0, 1.0, 0.0]; // pair 0: 90 degrees, pair 1: unchanged
/// let mut head = [1.0, 2.0, 3.0, 4.0];
/// rope(RopeLayout::Normal, &mut head, 4, &cos_sin)?;
/// assert_eq!(head, [-2.0, 1.0, 3.0, 4.0]);
/// # Ok::<(), gpu_pipeline::kernels::OpsError>(())
/// ```
pub fn rope(
    layout: RopeLayout,
    x: &mut [f32],
    head_dim: usize,
    cos_sin: &[f32],
) -> Result<(), OpsError> {
    let n_rot = cos_sin.len();
    if !n_rot.is_multiple_of(2) || n_rot > head_dim {
        return Err(OpsError::LengthMismatch {
            what: "rope: cos_sin (an even length, at most head_dim)",
            expected: head_dim,
            actual: n_rot,
        });
    }
    if head_dim == 0 || !x.len().is_multiple_of(head_dim) {
        return Err(OpsError::LengthMismatch {
            what: "rope: x / head_dim",
            expected: head_dim,
            actual: x.len(),
        });
    }
    for head in x.chunks_exact_mut(head_dim) {
        rope_head(layout, cos_sin, head);
    }
    Ok(())
}

/// [`rope`] of one head, the lengths known to fit (`cos_sin.len()` even, at most `head.len()`).
pub(crate) fn rope_head(layout: RopeLayout, cos_sin: &[f32], head: &mut [f32]) {
    let half = cos_sin.len() / 2;
    match layout {
        RopeLayout::Normal => {
            for i in 0..half {
                let (c, s) = (cos_sin[2 * i], cos_sin[2 * i + 1]);
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = x0 * c - x1 * s;
                head[2 * i + 1] = x0 * s + x1 * c;
            }
        }
        RopeLayout::Neox => {
            for i in 0..half {
                let (c, s) = (cos_sin[2 * i], cos_sin[2 * i + 1]);
                let (x0, x1) = (head[i], head[i + half]);
                head[i] = x0 * c - x1 * s;
                head[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

/// The orthonormal Walsh-Hadamard transform of each `n`-element row of `x` in place
/// (`x <- H x / sqrt(n)`, `n` a power of two). Rows transformed alike keep their dot products
/// (up to rounding), and a row's few large components spread over all of it, which is what a
/// 4-bit key cache quantizes well (llama.cpp's `attn_rot_k` rotates keys and queries so).
pub(crate) fn hadamard_rows(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let scale = 1.0 / (n as f32).sqrt();
    for row in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for block in row.chunks_exact_mut(2 * h) {
                let (lo, hi) = block.split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        for v in row.iter_mut() {
            *v *= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_and_axpy_match_f64() {
        for len in [0usize, 1, 7, 16, 33, 64, 100] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            assert!((f64::from(dot(&a, &b).unwrap()) - want).abs() < 1e-4);
            let bh: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
            let want_h: f64 = a
                .iter()
                .zip(&bh)
                .map(|(x, y)| f64::from(*x) * f64::from(y.to_f32()))
                .sum();
            assert!((f64::from(dot_f16(&a, &bh).unwrap()) - want_h).abs() < 1e-4);
            let mut y = a.clone();
            axpy(&mut y, 0.5, &b).unwrap();
            let mut yh = a.clone();
            axpy_f16(&mut yh, 0.5, &bh).unwrap();
            for i in 0..len {
                assert!((y[i] - (a[i] + 0.5 * b[i])).abs() < 1e-6);
                assert!((yh[i] - (a[i] + 0.5 * bh[i].to_f32())).abs() < 1e-6);
            }
        }
        assert!(dot(&[1.0], &[]).is_err());
    }

    #[test]
    fn f16c_kv_ops_are_bit_identical_to_the_portable_code() {
        for len in [0usize, 1, 7, 8, 15, 16, 17, 31, 64, 65, 100, 128] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let b: Vec<f16> = (0..len)
                .map(|i| f16::from_f32((i as f32 * 0.11).cos() * 7.0))
                .collect();
            // Public entry points (F16C where the CPU has it) against the portable bodies.
            assert_eq!(
                dot_f16(&a, &b).unwrap().to_bits(),
                dot_f16_impl(&a, &b).to_bits(),
                "dot, len {len}"
            );
            let (mut y1, mut y2) = (a.clone(), a.clone());
            axpy_f16(&mut y1, -0.75, &b).unwrap();
            axpy_f16_impl(&mut y2, -0.75, &b);
            assert_eq!(
                y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "axpy, len {len}"
            );
        }
    }

    #[test]
    fn norms_softmax_silu_rope() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let mut out = [0.0; 4];
        rmsnorm(&x, &[1.0, 2.0, 1.0, 1.0], 1e-5, &mut out).unwrap();
        let rms = ((1.0 + 4.0 + 9.0 + 0.25) / 4.0 + 1e-5f64).sqrt();
        assert!((f64::from(out[1]) - (-4.0 / rms)).abs() < 1e-5);
        let mut s = [1.0f32, 2.0, 3.0];
        softmax(&mut s);
        let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|v| v.exp()).collect();
        let z: f64 = e.iter().sum();
        for i in 0..3 {
            assert!((f64::from(s[i]) - e[i] / z).abs() < 1e-6);
        }
        let mut g = [1.0f32, -1.0];
        silu_mul(&mut g, &[2.0, 3.0]).unwrap();
        assert!((g[0] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn hadamard_rows_keep_dot_products_and_spread_an_outlier() {
        let n = 64;
        let a: Vec<f32> = (0..2 * n)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let mut b: Vec<f32> = (0..2 * n)
            .map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.2)
            .collect();
        b[5] = 40.0; // an outlier channel, as keys have
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
        let (mut ha, mut hb) = (a.clone(), b.clone());
        hadamard_rows(&mut ha, n);
        hadamard_rows(&mut hb, n);
        for r in 0..2 {
            let (x, y) = (&a[r * n..][..n], &b[r * n..][..n]);
            let (hx, hy) = (&ha[r * n..][..n], &hb[r * n..][..n]);
            assert!((dot(x, y) - dot(hx, hy)).abs() < 1e-3, "row {r}");
        }
        // The outlier's 40 is spread as 40 / 8 = 5 over every element of its row.
        let max = hb[..n].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max < 6.5, "{max}");
        // Orthonormal: applied twice it is the identity.
        hadamard_rows(&mut hb, n);
        for (x, y) in hb.iter().zip(&b) {
            assert!((x - y).abs() < 1e-4);
        }
    }

    #[test]
    fn rope_rotates_the_pairs_of_its_layout_in_every_head() {
        let (c, sn) = ((0.3f32).cos(), (0.3f32).sin());
        // Two heads of 4; pair 0 turned by 0.3 rad, pair 1 unchanged.
        let cs = [c, sn, 1.0, 0.0];
        let mut h = [1.0f32, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        rope(RopeLayout::Normal, &mut h, 4, &cs).unwrap();
        assert_eq!(h[..4], h[4..]);
        assert!((h[0] - (c - 2.0 * sn)).abs() < 1e-6 && (h[2] - 3.0).abs() < 1e-6);
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope(RopeLayout::Neox, &mut h, 4, &cs).unwrap();
        assert!((h[0] - (c - 3.0 * sn)).abs() < 1e-6 && (h[2] - (sn + 3.0 * c)).abs() < 1e-6);
        // Partial rotation: only the first n_rot = 2 dimensions turn.
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope(RopeLayout::Neox, &mut h, 4, &cs[..2]).unwrap();
        assert_eq!(h[2..], [3.0, 4.0]);
        assert!((h[0] - (c - 2.0 * sn)).abs() < 1e-6);
        assert!(
            rope(RopeLayout::Neox, &mut h, 3, &cs).is_err(),
            "table longer than a head"
        );
        assert!(
            rope(RopeLayout::Neox, &mut h, 4, &cs[..3]).is_err(),
            "odd table"
        );
        assert!(
            rope(RopeLayout::Neox, &mut h[..3], 2, &cs[..2]).is_err(),
            "partial head"
        );
    }
}
