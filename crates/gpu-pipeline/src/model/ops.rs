//! The model's small element-wise operations (norms, RoPE, activation split).
//!
//! Each works on one row at a time with a fixed reduction order, so results do not depend on
//! how many rows (tokens) are in the batch.

use std::marker::PhantomData;

use super::{RopeConfig, RopeScaling};

/// Inverse RoPE frequencies `theta^(-2i/n_rot) / freq_factor[i] / linear_factor`, in f64; with
/// `long`, LongRoPE's long factors where the config has them.
pub(super) fn rope_inv_freq(rope: &RopeConfig, long: bool) -> Vec<f64> {
    let half = rope.n_rot / 2;
    let factors = match (&rope.long_freq_factors, long) {
        (Some(l), true) => Some(l),
        _ => rope.freq_factors.as_ref(),
    };
    (0..half)
        .map(|i| {
            let mut f = f64::from(rope.theta).powf(-2.0 * i as f64 / rope.n_rot as f64);
            if let Some(ff) = factors {
                f /= f64::from(ff[i]);
            }
            if let RopeScaling::Linear { factor } = rope.scaling {
                f /= f64::from(factor);
            }
            f
        })
        .collect()
}

/// `out[2i] = m cos(pos * inv[i])`, `out[2i+1] = m sin(pos * inv[i])` (angles in f64; `m` is
/// RoPE's attention factor, 1 for most models).
pub(super) fn rope_cos_sin(inv: &[f64], pos: u64, m: f32, out: &mut [f32]) {
    for (i, f) in inv.iter().enumerate() {
        let a = pos as f64 * f;
        out[2 * i] = a.cos() as f32 * m;
        out[2 * i + 1] = a.sin() as f32 * m;
    }
}

use crate::kernels::multiversion;
pub(super) use crate::kernels::{
    add_rows, gelu_tanh_mul_rows, hadamard_rows, rmsnorm_rows, rope_head, silu_mul_rows,
    softcap_rows, split_residual,
};

multiversion! {
    /// `out = a + b`.
    pub(super) fn add_to(a: &[f32], b: &[f32], out: &mut [f32]) -> () {
        for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
            *o = a + b;
        }
    }
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

    /// Number of rows.
    pub(super) fn len(&self) -> usize {
        self.rows
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

    /// Rows `r` as one slice.
    ///
    /// # Safety
    /// As for [`Self::row`], for every row in `r`.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn rows(&self, r: std::ops::Range<usize>) -> &mut [f32] {
        assert!(
            r.start <= r.end && r.end <= self.rows,
            "rows {r:?} out of {}",
            self.rows
        );
        // SAFETY: in bounds (checked above); the caller guarantees exclusive access.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(r.start * self.width), r.len() * self.width)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RopeLayout;

    #[test]
    fn rope_inv_freq_matches_formula() {
        let cfg = RopeConfig {
            layout: RopeLayout::Normal,
            theta: 10000.0,
            n_rot: 4,
            scaling: RopeScaling::Linear { factor: 2.0 },
            freq_factors: Some(vec![1.0, 4.0]),
            long_freq_factors: Some(vec![2.0, 2.0]),
            original_context: 64,
            attn_factor: 1.0,
        };
        assert!((rope_inv_freq(&cfg, true)[0] - 0.25).abs() < 1e-12);
        let f = rope_inv_freq(&cfg, false);
        assert!((f[0] - 0.5).abs() < 1e-12);
        assert!((f[1] - 0.01 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn silu_matches_formula() {
        let g: Vec<f32> = (-200..=200).map(|i| i as f32 * 0.5).collect();
        let up: Vec<f32> = (0..g.len()).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = g.clone();
        silu_mul_rows(&mut out, &up);
        for ((&o, &g), &u) in out.iter().zip(&g).zip(&up) {
            let want = f64::from(g) / (1.0 + (-f64::from(g)).exp()) * f64::from(u);
            assert!(
                (f64::from(o) - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{g}: {o} vs {want}"
            );
        }
    }

    #[test]
    fn gelu_tanh_and_softcap_match_formulas() {
        let g: Vec<f32> = (-300..=300).map(|i| i as f32 * 0.05).collect();
        let up: Vec<f32> = (0..g.len()).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = g.clone();
        gelu_tanh_mul_rows(&mut out, &up);
        let mut capped = g.clone();
        softcap_rows(&mut capped, 3.0);
        for (i, (&x, &u)) in g.iter().zip(&up).enumerate() {
            let x64 = f64::from(x);
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let want =
                0.5 * x64 * (1.0 + (c * (x64 + 0.044715 * x64.powi(3))).tanh()) * f64::from(u);
            assert!(
                (f64::from(out[i]) - want).abs() <= 2e-6 * want.abs().max(1.0),
                "{x}"
            );
            let want = 3.0 * (x64 / 3.0).tanh();
            assert!(
                (f64::from(capped[i]) - want).abs() <= 1e-6,
                "{x}: {} vs {want}",
                capped[i]
            );
        }
    }

    #[test]
    fn split_residual_block_max_ignores_nan_like_a_float_fold() {
        let mut x = vec![0.5f32; 32];
        x[3] = -2.0;
        x[7] = f32::NAN;
        x[9] = -0.0;
        let mut lo = vec![0.0; 32];
        split_residual(&x, &mut lo);
        // d = 2 / 127: -2 is exactly -127 d, 0.5 is 31.75 d (rounds to 32).
        let d = 2.0f32 / 127.0;
        assert_eq!(lo[3], -2.0 - (-127.0 * d));
        assert_eq!(lo[0], 0.5 - 32.0 * d);
    }

    #[test]
    fn split_residual_is_what_8_bit_quantization_leaves() {
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mut lo = vec![0.0; 96];
        split_residual(&x, &mut lo);
        for b in 0..3 {
            let blk = &x[32 * b..32 * (b + 1)];
            let d = blk.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for i in 32 * b..32 * (b + 1) {
                let q = (x[i] - lo[i]) / d;
                assert!((q - q.round()).abs() < 1e-3 && q.abs() <= 127.5, "{q}");
                assert!(lo[i].abs() <= d / 2.0 * 1.0001, "{} {d}", lo[i]);
            }
        }
    }

    #[test]
    fn rmsnorm_unit() {
        let mut out = [0.0f32; 2];
        rmsnorm_rows(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
    }
}
