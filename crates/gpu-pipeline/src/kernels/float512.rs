//! AVX-512 kernel for float weights (F32, F16, BF16) over many tokens (prefill, batched decode):
//! register tiles of [`R`] rows x [`T`] tokens, one 16-lane accumulator each.
//!
//! **Same arithmetic as [`super::avx2`].** There, each (row, token) accumulates two 8-lane
//! vectors over the 16-column chunks (columns `c..c + 8` and `c + 8..c + 16`), sums them with a
//! fixed horizontal sum and adds the `cols % 16` tail in column order. Here one 16-lane vector
//! holds both (lanes 0-7 the first, 8-15 the second), each lane gets the same FMA sequence, and
//! the epilogue splits it back into the two halves for the same [`super::avx2::finish`]. So a
//! token's outputs are bit-identical whichever kernel ran it, and `matmul` stays
//! batch-invariant when the token count picks this kernel.
//!
//! The AVX2 loop took one row at a time against 4 tokens with a run-time token count, and ran
//! at 20-30 GFLOP/s per core; a 4 x 4 tile has 16 independent chains, loads each weight vector
//! once per 4 tokens and each activation vector once per 4 rows, and its tails are
//! separate instantiations (no run-time branches in the inner loop).

// The AVX-512 intrinsics are stable since Rust 1.89; the workspace toolchain is 1.95.
#![allow(clippy::incompatible_msrv)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{F_F16, F_F32, by_float_format, finish, float_shape, many_tokens, tail};
use super::format::Fmt;
use super::{RowsOut, WeightMatrix};

/// Rows per register tile.
const R: usize = 4;
/// Tokens per register tile (`R * T` accumulators, `R` weight and `T` activation registers).
const T: usize = 4;
/// Activation bytes per token chunk: the chunk's tokens stay in L2 while the task's rows pass.
const CHUNK_BYTES: usize = 256 << 10;

/// Rows `rows` x all `n` tokens of a float matrix.
///
/// # Safety
/// The CPU supports AVX-512F (and AVX2, FMA, F16C).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
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

/// 16 weights of the row at `p` from column `c`, as f32 (exact conversions).
///
/// # Safety
/// Columns `c..c + 16` are inside the row at `p`.
#[inline(always)]
unsafe fn load16<const F: u8>(p: *const u8, c: usize) -> __m512 {
    // SAFETY: forwarded from the caller; the features are enabled in every caller.
    unsafe {
        match F {
            F_F32 => _mm512_loadu_ps(p.add(4 * c).cast()),
            F_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * c).cast())),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * c).cast())),
                16,
            )),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn rows_impl<const F: u8>(
    w: WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    let (cols, _) = float_shape::<F>(w, x, n, &rows);
    many_tokens(cols, n, rows, R, T, CHUNK_BYTES, |t0, t_end, r, rr| {
        if rr == R {
            tokens::<F, R>(w, x, t0..t_end, r, out);
        } else {
            tokens::<F, 1>(w, x, t0..t_end, r, out);
        }
    });
}

/// Rows `r..r + RR` x tokens `ts`, in tiles of [`T`] tokens (the tail as one smaller tile).
#[inline(always)]
fn tokens<const F: u8, const RR: usize>(
    w: WeightMatrix<'_>,
    x: &[f32],
    ts: Range<usize>,
    r: usize,
    out: &mut RowsOut<'_>,
) {
    let mut t = ts.start;
    while t < ts.end {
        // SAFETY (all arms): the CPU features are enabled in the caller (`rows_impl`); rows
        // `r..r + RR` are rows of `w` and tokens `t..t + TT <= ts.end <= n` are in `x`.
        unsafe {
            match ts.end - t {
                1 => tile::<F, RR, 1>(w, x, t, r, out),
                2 => tile::<F, RR, 2>(w, x, t, r, out),
                3 => tile::<F, RR, 3>(w, x, t, r, out),
                4 => tile::<F, RR, 4>(w, x, t, r, out),
                _ => tile::<F, RR, T>(w, x, t, r, out),
            }
        }
        t += T.min(ts.end - t);
    }
}

/// One register tile: rows `r..r + RR` x tokens `t..t + TT`.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C are available; rows `r..r + RR` are rows of `w` (whose data
/// holds them whole) and `x` holds tokens `t..t + TT` of `w.cols` columns.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tile<const F: u8, const RR: usize, const TT: usize>(
    w: WeightMatrix<'_>,
    x: &[f32],
    t: usize,
    r: usize,
    out: &mut RowsOut<'_>,
) {
    let cols = w.cols;
    let rb = cols * if F == F_F32 { 4 } else { 2 };
    let main = cols / 16 * 16;
    let wp: [*const u8; RR] = std::array::from_fn(|k| w.data[(r + k) * rb..].as_ptr());
    let xp: [*const f32; TT] = std::array::from_fn(|j| x[(t + j) * cols..].as_ptr());
    let mut acc = [[_mm512_setzero_ps(); TT]; RR];
    for c in (0..main).step_by(16) {
        // SAFETY: `c + 16 <= main <= cols`: inside each row and each token's activations.
        let wv: [__m512; RR] = std::array::from_fn(|k| unsafe { load16::<F>(wp[k], c) });
        for j in 0..TT {
            // SAFETY: as above.
            let xv = unsafe { _mm512_loadu_ps(xp[j].add(c)) };
            for k in 0..RR {
                acc[k][j] = _mm512_fmadd_ps(wv[k], xv, acc[k][j]);
            }
        }
    }
    if RR == R && TT == T {
        // All 16 sums at once, lane `4 j + k` = row `r + k`, token `t + j`.
        // SAFETY: `acc` is `R x T` = 16 vectors.
        let sums = reduce16(unsafe { &*acc.as_ptr().cast::<[__m512; 16]>() });
        let mut o = [0.0f32; 16];
        // SAFETY: `o` has room for 16 floats.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), sums) };
        for j in 0..T {
            let xt = &x[(t + j) * cols..(t + j + 1) * cols];
            let v = &mut o[R * j..R * (j + 1)];
            if main < cols {
                for (k, s) in v.iter_mut().enumerate() {
                    *s = tail::<F>(*s, &w.data[(r + k) * rb..(r + k + 1) * rb], xt, main);
                }
            }
            out.set_run(t + j, r, v);
        }
        return;
    }
    for (k, a) in acc.iter().enumerate() {
        let row = &w.data[(r + k) * rb..(r + k + 1) * rb];
        for (j, v) in a.iter().enumerate() {
            let xt = &x[(t + j) * cols..(t + j + 1) * cols];
            let halves = [
                _mm512_castps512_ps256(*v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(*v), 1)),
            ];
            out.set(t + j, r + k, finish::<F>(halves, row, xt, main));
        }
    }
}

/// The horizontal sums of 16 accumulators, each in [`super::avx2::finish`]'s order: with
/// `v = a[0..8] + a[8..16]`, `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`, as a tree of
/// lane shuffles over all 16 at once (IEEE addition is commutative, so each sum is the same
/// bits). Lane `4 c + e` of the result is the sum of `a[4 e + c]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn reduce16(a: &[__m512; 16]) -> __m512 {
    // u = a[0..8] + a[8..16]: pairs of accumulators share a vector (their 256-bit halves).
    let u: [__m512; 8] = std::array::from_fn(|p| {
        let (x, y) = (a[2 * p], a[2 * p + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x, y),
            _mm512_shuffle_f32x4::<0xEE>(x, y),
        )
    });
    // w = u[0..4] + u[4..8]: four accumulators per vector, one per 128-bit lane.
    let w: [__m512; 4] = std::array::from_fn(|q| {
        let (x, y) = (u[2 * q], u[2 * q + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    });
    // z = (w0 + w2, w1 + w3) per accumulator.
    let z: [__m512; 2] = std::array::from_fn(|h| {
        let (x, y) = (w[2 * h], w[2 * h + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    });
    // z0 + z1.
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z[0], z[1]),
        _mm512_shuffle_ps::<0xDD>(z[0], z[1]),
    )
}
