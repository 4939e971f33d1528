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

/// Format codes of the float kernels' const parameter.
pub(crate) const F_F32: u8 = 0;
pub(crate) const F_F16: u8 = 1;
pub(crate) const F_BF16: u8 = 2;

/// `$f::<F>(args)` with `F` the format code of the float format `$fmt` (F32, F16 or BF16).
macro_rules! by_float_format {
    ($fmt:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $fmt {
            Fmt::F32 => $f::<{ $crate::kernels::avx2::F_F32 }>($($arg),*),
            Fmt::F16 => $f::<{ $crate::kernels::avx2::F_F16 }>($($arg),*),
            Fmt::BF16 => $f::<{ $crate::kernels::avx2::F_BF16 }>($($arg),*),
            _ => unreachable!("quantized formats use quant_rows"),
        }
    };
}
pub(crate) use by_float_format;

/// `(cols, row bytes)` of a float matrix of format `F`, its rows `rows` and `n` tokens of `x`
/// checked to be in bounds.
pub(crate) fn float_shape<const F: u8>(
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    rows: &Range<usize>,
) -> (usize, usize) {
    let cols = w.cols;
    let rb = cols * if F == F_F32 { 4 } else { 2 };
    assert!(rows.end <= w.rows && w.data.len() >= w.rows * rb && x.len() >= n * cols);
    (cols, rb)
}

/// The many-token float kernels' loop (AVX2 and AVX-512): token chunks of whole `tile`-token
/// tiles whose activations (`4 * cols` bytes a token) stay within `chunk_bytes`, and in each
/// chunk the rows in groups of `group` (the remainder one at a time):
/// `f(first token, end token, first row, rows in the group)`.
#[inline(always)]
pub(crate) fn many_tokens(
    cols: usize,
    n: usize,
    rows: Range<usize>,
    group: usize,
    tile: usize,
    chunk_bytes: usize,
    mut f: impl FnMut(usize, usize, usize, usize),
) {
    let chunk = (chunk_bytes / (4 * cols).max(1) / tile).max(1) * tile;
    for t0 in (0..n).step_by(chunk) {
        let t_end = t0 + chunk.min(n - t0);
        let mut r = rows.start;
        while r < rows.end {
            let rr = if rows.end - r >= group { group } else { 1 };
            f(t0, t_end, r, rr);
            r += rr;
        }
    }
}

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
    by_float_format!(fmt, rows_impl(w, x, n, rows, out))
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
    vnni: super::avx2_quant::Vnni,
) {
    // SAFETY: the caller guarantees the features (and `vnni` proves AVX-VNNI).
    unsafe { super::avx2_quant::quant_rows(fmt, w, acts, n, rows, out, vnni) }
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
    let (cols, rb) = float_shape::<F>(w, x, n, &rows);
    let main = cols / 16 * 16;
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
    // Many tokens (and rows the 4-row path left): register tiles of `MR` rows x `MT` tokens.
    // (Converting F16/BF16 row groups to f32 first, to take the conversions out of the inner
    // loop, measured no faster.)
    many_tokens(
        cols,
        n,
        rows,
        MR,
        MT,
        MANY_CHUNK_BYTES,
        |t0, t_end, r, rr| {
            let raw: [&[u8]; MR] =
                std::array::from_fn(|k| &w.data[(r + k.min(rr - 1)) * rb..][..rb]);
            let mut t = t0;
            while t < t_end {
                t += tiles::<F>(raw, rr, x, cols, t, t_end, r, out);
            }
        },
    );
}

/// One tile of rows `r..r + rr` (`rr` is `MR` or 1; `wr` their bytes in format `F`) from token
/// `t` (at most `MT` tokens, up to `t_end`); returns the tokens it took.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tiles<const F: u8>(
    wr: [&[u8]; MR],
    rr: usize,
    x: &[f32],
    cols: usize,
    t: usize,
    t_end: usize,
    r: usize,
    out: &mut RowsOut<'_>,
) -> usize {
    let left = t_end - t;
    assert!(x.len() >= (t + left.min(MT)) * cols);
    // SAFETY (all arms): the features are enabled here; each row of `wr` holds `cols` columns
    // of format `F` (sliced by the caller), `x` holds the tile's tokens (asserted).
    unsafe {
        match (rr, left) {
            (MR, 1) => tile::<F, MR, 1>(wr, x, cols, t, r, out),
            (MR, 2) => tile::<F, MR, 2>(wr, x, cols, t, r, out),
            (MR, _) => tile::<F, MR, MT>(wr, x, cols, t, r, out),
            (_, 1) => tile::<F, 1, 1>([wr[0]], x, cols, t, r, out),
            (_, 2) => tile::<F, 1, 2>([wr[0]], x, cols, t, r, out),
            _ => tile::<F, 1, MT>([wr[0]], x, cols, t, r, out),
        }
    }
    left.min(MT)
}

/// Rows per register tile of the many-token path.
const MR: usize = 2;
/// Tokens per register tile: `MR * MT` outputs of two 8-lane accumulators each (12 of the 16
/// registers), `MR` weight and one activation register.
const MT: usize = 3;
/// Activation bytes per token chunk of the many-token path.
const MANY_CHUNK_BYTES: usize = 256 << 10;

/// One register tile of the many-token path: rows `r..r + RR` (bytes `wr`, format `F`) x tokens
/// `t..t + TT`, each output accumulated exactly as the 4-row path does (two 8-lane chains over
/// 16-column chunks, then [`finish`]).
///
/// # Safety
/// AVX2, FMA and F16C are available; each row of `wr` holds `cols` columns of format `F`; `x`
/// holds tokens `t..t + TT` of `cols` columns.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // the indices are the register tile's coordinates
unsafe fn tile<const F: u8, const RR: usize, const TT: usize>(
    wr: [&[u8]; RR],
    x: &[f32],
    cols: usize,
    t: usize,
    r: usize,
    out: &mut RowsOut<'_>,
) {
    let main = cols / 16 * 16;
    let xp: [*const f32; TT] = std::array::from_fn(|j| x[(t + j) * cols..].as_ptr());
    let mut acc = [[[_mm256_setzero_ps(); 2]; TT]; RR];
    for c in (0..main).step_by(16) {
        for h in 0..2 {
            // SAFETY: `c + 16 <= main <= cols`: inside each row and each token's activations.
            let wv: [__m256; RR] =
                std::array::from_fn(|k| unsafe { load8::<F>(wr[k].as_ptr(), c + 8 * h) });
            for j in 0..TT {
                // SAFETY: as above.
                let xv = unsafe { _mm256_loadu_ps(xp[j].add(c + 8 * h)) };
                for k in 0..RR {
                    acc[k][j][h] = _mm256_fmadd_ps(wv[k], xv, acc[k][j][h]);
                }
            }
        }
    }
    for (k, a) in acc.iter().enumerate() {
        for (j, v) in a.iter().enumerate() {
            let xt = &x[(t + j) * cols..(t + j + 1) * cols];
            out.set(t + j, r + k, finish::<F>(*v, wr[k], xt, main));
        }
    }
}
