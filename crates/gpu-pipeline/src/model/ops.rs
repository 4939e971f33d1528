//! The model's small element-wise operations (norms, RoPE, attention over a KV view).
//!
//! Each works on one row at a time with a fixed reduction order, so results do not depend on
//! how many rows (tokens) are in the batch.

use std::marker::PhantomData;

use kv_ring::{KvSlices, KvView};

use super::{RopeConfig, RopeLayout, RopeScaling};

/// Inverse RoPE frequencies `theta^(-2i/n_rot) / freq_factor[i] / linear_factor`, in f64.
pub(super) fn rope_inv_freq(rope: &RopeConfig) -> Vec<f64> {
    let half = rope.n_rot / 2;
    (0..half)
        .map(|i| {
            let mut f = f64::from(rope.theta).powf(-2.0 * i as f64 / rope.n_rot as f64);
            if let Some(ff) = &rope.freq_factors {
                f /= f64::from(ff[i]);
            }
            if let RopeScaling::Linear { factor } = rope.scaling {
                f /= f64::from(factor);
            }
            f
        })
        .collect()
}

/// `out[2i] = cos(pos * inv[i])`, `out[2i+1] = sin(pos * inv[i])` (angles in f64).
pub(super) fn rope_cos_sin(inv: &[f64], pos: u64, out: &mut [f32]) {
    for (i, f) in inv.iter().enumerate() {
        let a = pos as f64 * f;
        out[2 * i] = a.cos() as f32;
        out[2 * i + 1] = a.sin() as f32;
    }
}

/// Rotates one head in place with the cos/sin table of its position.
pub(super) fn rope_apply(layout: RopeLayout, cs: &[f32], head: &mut [f32]) {
    let half = cs.len() / 2;
    match layout {
        RopeLayout::Normal => {
            for i in 0..half {
                let (c, s) = (cs[2 * i], cs[2 * i + 1]);
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = x0 * c - x1 * s;
                head[2 * i + 1] = x0 * s + x1 * c;
            }
        }
        RopeLayout::Neox => {
            for i in 0..half {
                let (c, s) = (cs[2 * i], cs[2 * i + 1]);
                let (x0, x1) = (head[i], head[i + half]);
                head[i] = x0 * c - x1 * s;
                head[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

/// RMSNorm of every `w.len()`-long row of `x` into `out` (sum of squares in f64).
pub(super) fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let inv = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// Splits `x` into `hi + lo` per 32-element block: `hi` is exactly representable with 8-bit
/// integers and one scale (`amax / 127`), `lo = x - hi` is the rounding residual.
pub(super) fn split_q8(x: &[f32], hi: &mut [f32], lo: &mut [f32]) {
    for ((xb, hb), lb) in x.chunks(32).zip(hi.chunks_mut(32)).zip(lo.chunks_mut(32)) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for ((&v, h), l) in xb.iter().zip(hb.iter_mut()).zip(lb.iter_mut()) {
            *h = (v * id).round() * d;
            *l = v - *h;
        }
    }
}

/// `x += y`.
pub(super) fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// `gate = silu(gate) * up`.
pub(super) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Dot product with 16 independent lanes (fixed order: vectorizes, and is the same for every
/// call with the same length).
#[inline(always)] // into the AVX2-compiled attention too
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    for step in [8, 4, 2, 1] {
        for l in 0..step {
            acc[l] += acc[l + step];
        }
    }
    acc[0] + s
}

#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// Row `j` of `[pos][hd]` storage split in two parts.
#[inline(always)]
fn row2<'a, T>(parts: &[&'a [T]; 2], j: usize, hd: usize) -> &'a [T] {
    let na = parts[0].len() / hd;
    if j < na {
        &parts[0][j * hd..][..hd]
    } else {
        &parts[1][(j - na) * hd..][..hd]
    }
}

/// One query head against the first `n_keys` rows of a KV view: softmax(q·K/√d)·V into `dst`.
/// `scores` has `n_keys` elements of scratch.
///
/// Runs compiled for AVX2 + FMA + F16C when the CPU has them (F16C converting f16 rows 8 at a
/// time), else portably; both do the same float operations in the same order (the arithmetic
/// is written without fused multiply-adds), so the result is bit-identical on every path.
pub(super) fn attend(
    q: &[f32],
    view: &KvView<'_>,
    scale: f32,
    scores: &mut [f32],
    dst: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::has_avx2() {
        // SAFETY: the features were detected at run time.
        return unsafe { attend_avx2(q, view, scale, scores, dst) };
    }
    attend_body(q, view, scale, scores, dst, |src, dst| {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    });
}

/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(
    q: &[f32],
    view: &KvView<'_>,
    scale: f32,
    scores: &mut [f32],
    dst: &mut [f32],
) {
    // SAFETY: this function's caller guarantees the features `f16_to_f32` needs.
    attend_body(q, view, scale, scores, dst, |src, dst| unsafe {
        crate::kernels::f16_to_f32(src, dst)
    })
}

/// Elements of an f16 KV row converted at once.
const SEG: usize = 256;

#[inline(always)]
fn attend_body(
    q: &[f32],
    view: &KvView<'_>,
    scale: f32,
    scores: &mut [f32],
    dst: &mut [f32],
    cvt: impl Fn(&[half::f16], &mut [f32]),
) {
    let hd = q.len();
    let mut tmp = [0.0f32; SEG];
    match view.keys {
        KvSlices::F32(parts) => {
            for (j, s) in scores.iter_mut().enumerate() {
                *s = dot(q, row2(&parts, j, hd)) * scale;
            }
        }
        KvSlices::F16(parts) => {
            for (j, s) in scores.iter_mut().enumerate() {
                let k = row2(&parts, j, hd);
                let mut acc = 0.0f32;
                // Segments are multiples of 16, so the 16-element chunks are the same as
                // chunking the whole row.
                for (qs, ks) in q.chunks(SEG).zip(k.chunks(SEG)) {
                    let t = &mut tmp[..ks.len()];
                    cvt(ks, t);
                    for (qc, tc) in qs.chunks(16).zip(t.chunks(16)) {
                        acc += dot(qc, tc);
                    }
                }
                *s = acc * scale;
            }
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("kv-ring has only F32 and F16 storage"),
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    dst.fill(0.0);
    match view.values {
        KvSlices::F32(parts) => {
            for (j, &p) in scores.iter().enumerate() {
                axpy(p, row2(&parts, j, hd), dst);
            }
        }
        KvSlices::F16(parts) => {
            for (j, &p) in scores.iter().enumerate() {
                let v = row2(&parts, j, hd);
                for (vs, ds) in v.chunks(SEG).zip(dst.chunks_mut(SEG)) {
                    let t = &mut tmp[..vs.len()];
                    cvt(vs, t);
                    axpy(p, t, ds);
                }
            }
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("kv-ring has only F32 and F16 storage"),
    }
    let inv = 1.0 / sum;
    dst.iter_mut().for_each(|y| *y *= inv);
}

/// A mutable buffer of fixed-width rows that pool tasks write disjointly.
pub(super) struct SharedRows<'a> {
    ptr: *mut f32,
    rows: usize,
    width: usize,
    _buf: PhantomData<&'a mut [f32]>,
}

// SAFETY: SharedRows only hands out rows through `row`, whose contract makes every row have a
// single writer at a time; f32 is Send.
unsafe impl Send for SharedRows<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedRows<'_> {}

impl<'a> SharedRows<'a> {
    pub(super) fn new(buf: &'a mut [f32], width: usize) -> Self {
        Self {
            ptr: buf.as_mut_ptr(),
            rows: buf.len() / width,
            width,
            _buf: PhantomData,
        }
    }

    /// Row `i`.
    ///
    /// # Safety
    /// No two live references to the same row may exist (each task writes only its own rows).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn row(&self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "row {i} out of {}", self.rows);
        // SAFETY: in bounds (checked above) of the borrowed buffer, which outlives 'a; the
        // caller guarantees exclusive access to this row.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.width), self.width) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_is_bit_identical_on_every_path_and_dtype_layout() {
        use kv_ring::{KvDtype, KvPool, KvShape, RingMode};
        // head_dim 300 > SEG exercises the segmented conversion; 64 the usual case.
        for (hd, n) in [(64usize, 37usize), (300, 9)] {
            for dtype in [KvDtype::F16, KvDtype::F32] {
                let pool = KvPool::new(KvShape::new(1, 1, hd, dtype), 1 << 22).unwrap();
                // A sliding ring smaller than n wraps, so the view has two parts.
                let mut kv = pool.alloc(n - 3, RingMode::Sliding { sinks: 2 }).unwrap();
                for t in 0..n {
                    let k: Vec<f32> = (0..hd)
                        .map(|i| ((t * hd + i) as f32 * 0.013).sin())
                        .collect();
                    let v: Vec<f32> = (0..hd)
                        .map(|i| ((t * 7 + i) as f32 * 0.029).cos())
                        .collect();
                    kv.begin(1).unwrap();
                    kv.write_layer(0, &k, &v).unwrap();
                    kv.commit().unwrap();
                }
                let view = kv.view(0, 0).unwrap();
                let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.07).cos()).collect();
                let keys = kv.len();
                let (mut s1, mut s2) = (vec![0.0; keys], vec![0.0; keys]);
                let (mut d1, mut d2) = (vec![0.0; hd], vec![0.0; hd]);
                attend(&q, &view, 0.125, &mut s1, &mut d1);
                attend_body(&q, &view, 0.125, &mut s2, &mut d2, |src, dst| {
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = s.to_f32();
                    }
                });
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&d1), bits(&d2), "hd {hd} {dtype:?}");
                assert!(d1.iter().all(|x| x.is_finite()) && d1.iter().any(|&x| x != 0.0));
            }
        }
    }

    #[test]
    fn rope_normal_and_neox_rotate_pairs() {
        let cs = [0.0f32, 1.0, 1.0, 0.0]; // pair 0: 90 degrees, pair 1: identity
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope_apply(RopeLayout::Normal, &cs, &mut h);
        assert_eq!(h, [-2.0, 1.0, 3.0, 4.0]);
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope_apply(RopeLayout::Neox, &cs, &mut h);
        // pairs (h0, h2) rotated 90 degrees, (h1, h3) unchanged
        assert_eq!(h, [-3.0, 2.0, 1.0, 4.0]);
    }

    #[test]
    fn rope_inv_freq_matches_formula() {
        let cfg = RopeConfig {
            layout: RopeLayout::Normal,
            theta: 10000.0,
            n_rot: 4,
            scaling: RopeScaling::Linear { factor: 2.0 },
            freq_factors: Some(vec![1.0, 4.0]),
        };
        let f = rope_inv_freq(&cfg);
        assert!((f[0] - 0.5).abs() < 1e-12);
        assert!((f[1] - 0.01 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn rmsnorm_unit() {
        let mut out = [0.0f32; 2];
        rmsnorm_rows(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.25 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| (i % 5) as f32 - 2.0).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }
}
