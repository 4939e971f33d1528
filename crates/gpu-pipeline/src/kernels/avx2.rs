//! AVX2 + FMA + F16C kernels for float weights (F32, F16, BF16) with f32 activations, and the
//! entry point of the integer-quantized ones ([`super::avx2_quant`]).
//!
//! Per (row, token): two 8-lane FMA accumulators over 16-column chunks, a fixed horizontal sum,
//! then the `cols % 16` tail added in column order. The same sequence runs for any number of
//! tokens, so results are batch-invariant. Few tokens (decode) go 4 rows at a time, the next
//! groups' rows prefetched: 4 independent accumulation chains per activation load, and the
//! weights streamed ahead of the hardware prefetchers (one row at a time read 55-65% of the
//! read bandwidth from DRAM); each row's sequence of operations is the same as one at a time.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::{PF_AHEAD, prefetch_plan, prefetch_step};
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

/// `acc`'s horizontal sum plus the `cols % 16` tail of row `row` times `xt`, in column order:
/// one (row, token) result.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn finish<const F: u8>(acc: [__m256; 2], row: &[u8], xt: &[f32], main: usize) -> f32 {
    tail::<F>(hsum(_mm256_add_ps(acc[0], acc[1])), row, xt, main)
}

/// `s` plus the `cols % 16` tail (columns `main..`) of row `row` times `xt`, in column order.
#[inline]
pub(crate) fn tail<const F: u8>(mut s: f32, row: &[u8], xt: &[f32], main: usize) -> f32 {
    for (c, &xc) in xt.iter().enumerate().skip(main) {
        let wv = match F {
            F_F32 => {
                f32::from_le_bytes([row[4 * c], row[4 * c + 1], row[4 * c + 2], row[4 * c + 3]])
            }
            F_F16 => f16_at(row, 2 * c),
            _ => bf16_at(row, 2 * c),
        };
        s += wv * xc;
    }
    s
}

/// Tokens up to which [`rows_impl`] takes the 4-row path (each token streams the group's rows
/// from L1/L2 again, so the weights are read from memory once per group).
pub(crate) const FEW_TOKENS: usize = 2;

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
    let mut rows = rows;
    if n <= FEW_TOKENS && main > 0 {
        let chunks = main / 16;
        let (start, end) = (rows.start, rows.start + (rows.len() / 4) * 4);
        for g in (start..end).step_by(4) {
            let pf = prefetch_plan(w.data, rb, chunks, g, &(start..end), (PF_AHEAD, false));
            let rowp: [*const u8; 4] = std::array::from_fn(|k| w.data[(g + k) * rb..].as_ptr());
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                for i in 0..chunks {
                    let c = 16 * i;
                    if t == 0 {
                        prefetch_step(pf, i, false);
                    }
                    // SAFETY: `c + 16 <= main <= cols`, inside `xt`.
                    let (x0, x1) = unsafe {
                        (
                            _mm256_loadu_ps(xt.as_ptr().add(c)),
                            _mm256_loadu_ps(xt.as_ptr().add(c + 8)),
                        )
                    };
                    for (a, &p) in acc.iter_mut().zip(&rowp) {
                        // SAFETY: columns `c..c + 16` are inside the row at `p` (`g + 3 < end`).
                        let (w0, w1) = unsafe { (load8::<F>(p, c), load8::<F>(p, c + 8)) };
                        a[0] = _mm256_fmadd_ps(w0, x0, a[0]);
                        a[1] = _mm256_fmadd_ps(w1, x1, a[1]);
                    }
                }
                for (k, a) in acc.into_iter().enumerate() {
                    let row = &w.data[(g + k) * rb..(g + k + 1) * rb];
                    out.set(t, g + k, finish::<F>(a, row, xt, main));
                }
            }
        }
        rows = end..rows.end;
    }
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
                out.set(t0 + t, r, finish::<F>(*a, row, xt, main));
            }
        }
    }
}
