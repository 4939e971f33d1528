//! AVX2 + FMA + F16C kernels for float weights (F32, F16, BF16) with f32 activations, and the
//! entry point of the integer-quantized ones ([`super::avx2_quant`]).
//!
//! Per (row, token): two 8-lane FMA accumulators over 16-column chunks, a fixed horizontal sum,
//! then the `cols % 16` tail added in column order. The same sequence runs for any number of
//! tokens, so results are batch-invariant.

use std::arch::x86_64::*;
use std::ops::Range;

use super::format::{Fmt, bf16_at, f16_at};
use super::{RowsOut, WeightMatrix};

const F_F32: u8 = 0;
const F_F16: u8 = 1;
const F_BF16: u8 = 2;

/// Rows `rows` x all `n` tokens of a float matrix.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn float_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    match fmt {
        Fmt::F32 => rows_impl::<F_F32>(w, x, n, rows, out),
        Fmt::F16 => rows_impl::<F_F16>(w, x, n, rows, out),
        Fmt::BF16 => rows_impl::<F_BF16>(w, x, n, rows, out),
        _ => unreachable!("quantized formats use quant_rows"),
    }
}

/// Rows `rows` x all `n` tokens of an integer-quantized matrix ([`super::avx2_quant`]): the
/// same operations as the scalar and AVX-512 backends, so the same bits.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quant_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[super::act::ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    // SAFETY: the caller guarantees the features.
    unsafe { super::avx2_quant::quant_rows(fmt, w, acts, n, rows, out) }
}

/// 8 weights of row `p` starting at column `c` as f32.
///
/// # Safety
/// Columns `c..c + 8` are inside the row at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const F: u8>(p: *const u8, c: usize) -> __m256 {
    // SAFETY: forwarded from the caller.
    unsafe {
        match F {
            F_F32 => _mm256_loadu_ps(p.add(4 * c).cast()),
            F_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * c).cast())),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * c).cast())),
                16,
            )),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn rows_impl<const F: u8>(
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    const T: usize = 4;
    let cols = w.cols;
    let esize = if F == F_F32 { 4 } else { 2 };
    let rb = cols * esize;
    let main = cols / 16 * 16;
    assert!(rows.end <= w.rows && w.data.len() >= w.rows * rb && x.len() >= n * cols);
    for r in rows {
        let row = &w.data[r * rb..(r + 1) * rb];
        let p = row.as_ptr();
        for t0 in (0..n).step_by(T) {
            let tn = T.min(n - t0);
            let mut acc = [[_mm256_setzero_ps(); 2]; T];
            for c in (0..main).step_by(16) {
                // SAFETY: `c + 16 <= main <= cols`.
                let (w0, w1) = unsafe { (load8::<F>(p, c), load8::<F>(p, c + 8)) };
                for (t, a) in acc.iter_mut().enumerate().take(tn) {
                    // SAFETY: token `t0 + t < n`, columns `c..c + 16` inside the row of `x`.
                    let (x0, x1) = unsafe {
                        let xp = x.as_ptr().add((t0 + t) * cols + c);
                        (_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8)))
                    };
                    a[0] = _mm256_fmadd_ps(w0, x0, a[0]);
                    a[1] = _mm256_fmadd_ps(w1, x1, a[1]);
                }
            }
            for (t, a) in acc.iter().enumerate().take(tn) {
                let xt = &x[(t0 + t) * cols..(t0 + t + 1) * cols];
                let mut s = hsum(_mm256_add_ps(a[0], a[1]));
                for c in main..cols {
                    let wv = match F {
                        F_F32 => f32::from_le_bytes([
                            row[4 * c],
                            row[4 * c + 1],
                            row[4 * c + 2],
                            row[4 * c + 3],
                        ]),
                        F_F16 => f16_at(row, 2 * c),
                        _ => bf16_at(row, 2 * c),
                    };
                    s += wv * xt[c];
                }
                out.set(t0 + t, r, s);
            }
        }
    }
}
