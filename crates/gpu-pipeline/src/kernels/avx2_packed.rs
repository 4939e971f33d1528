//! AVX2 + FMA + F16C kernels for matrices in the row-interleaved layout
//! ([`super::PackedWeights`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K),
//! dispatched from the AVX2 backend for [`super::Layout::Rows16`] matrices.
//!
//! A packed block holds 16 rows' quants as 64-byte vectors, lane `r` (4 bytes) = row `r`; its
//! low 32 bytes are rows 0..8, the high 32 bytes rows 8..16. So one 256-bit load gives 8 rows'
//! quants of 4 elements each, the layout of the AVX2 panel kernel's decoded blocks
//! ([`PanelBlock`]): each broadcast activation dword meets 8 rows at once and no horizontal sums
//! are needed, where the file-layout decode kernel reduces 4 rows horizontally for every block
//! (three `vphaddd` rounds per 8 block sums) and gathers the scales with scalar loads. Decode
//! reads the packed block straight into registers ([`half_block`]) and runs the panel kernel's
//! block step on it ([`panel_tile`]); three tokens and more (Q8_0: sixteen) unpack each half
//! group once into the panel buffer, as the file-layout panel kernel does.
//!
//! **Same arithmetic.** A half block carries exactly what the panel kernel decodes from the file
//! layout (the same quant bytes, scales and minimums), and the step is the same code, so a
//! packed matrix gives the file layout's bits (and those of the 4-row kernel, the scalar
//! reference and the AVX-512 kernels).

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::{ActQuad, quads_per_token};
use super::avx2_quant::{
    PANEL_MIN_TOKENS, PANEL_TOKEN_CHUNK, PanelBlock, Vnni, emit8, token_tiles, with_panel,
};
use super::avx512::{
    F_IQ4NL, F_IQ4XS, F_Q2K, F_Q3K, F_Q4_1, F_Q4K, F_Q5_0, F_Q5_1, F_Q5K, F_Q6K, F_Q8_0,
};
use super::format::Fmt;
use super::packed::{
    GROUP_ROWS, IQ4XS_D, IQ4XS_SH, IQ4XS_SL, Q2K_D, Q2K_DMIN, Q2K_SCALES, Q3K_D, Q3K_SCALES, Q6K_D,
    Q6K_SCALES, block_bytes, iq4xs_scale_at, k45_fields, locate, q3k_scale_at,
};
use super::{RowsOut, WeightMatrix};
use weight_cache::quant::KVALUES_IQ4NL;

/// How far ahead (bytes) decode prefetches the group bytes it streams, into L2 (as the AVX-512
/// packed kernel does).
const PF_AHEAD: usize = 8192;

/// Rows `rows` x all `n` tokens of a packed matrix.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `w` is a packed matrix (checked length) of format `fmt`,
/// one of [`block_bytes`]'s; `acts` holds `n` tokens quantized for `w.cols`; `rows.start` is a
/// multiple of [`GROUP_ROWS`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quant_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
    vnni: Vnni,
) {
    super::avx512::by_quant_format!(fmt, rows_impl(fmt, w, acts, n, rows, out, vnni))
}

/// Rows `8h..8h + 8` of block `b` of the packed group at `group`, as the panel kernel decodes
/// them from the file layout: `w[j]` lane `r` = the quants of elements `4j..4j + 4` (Q4_0, Q4_1,
/// Q5_0, Q5_1 and Q4_K's sub-blocks: nibble bytes `4c..4c + 4` hold elements `4c..` in the low
/// nibbles and `16 + 4c..` in the high ones, Q5's fifth bits OR-ed in from the packed `qh`
/// lane; Q8_0: the packed quants are offset by 128, flipped back to signed), then the scales and
/// minimums (Q4_K: the sub-block's `d * sc` and `-(dmin * m)`; Q6_K: `d * sc` of its two halves,
/// in `d` and `m`; as weight-cache computes them).
///
/// # Safety
/// `group` has whole packed blocks of the format (`bb` bytes each, [`block_bytes`]) up to block
/// `b`; `h < 2`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_block<const F: u8>(group: *const u8, b: usize, bb: usize, h: usize) -> PanelBlock {
    // SAFETY (whole body): every load is inside the block (`64j + 32h + 32 <= 64 * 8`, the
    // scales `16h + 16` bytes into their 32-byte field; Q4_K: inside its super-block, whose
    // fields are laid out in `packed`).
    unsafe {
        let (p, s, sub) = locate::<F>(group, b, bb);
        let ld = |off: usize| _mm256_loadu_si256(p.add(off + 32 * h).cast());
        let f16s = |off: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(off + 16 * h).cast()));
        let mut w = [_mm256_setzero_si256(); 8];
        if F == F_Q8_0 {
            let flip = _mm256_set1_epi8(-128);
            for (j, wj) in w.iter_mut().enumerate() {
                *wj = _mm256_xor_si256(ld(64 * j), flip);
            }
            return PanelBlock {
                w,
                d: f16s(512),
                m: _mm256_setzero_ps(),
                mins: [_mm256_setzero_ps(); 2],
            };
        }
        if matches!(F, F_Q2K | F_Q3K) {
            return k23_half::<F>(p, s, sub, h);
        }
        let lo4 = _mm256_set1_epi8(0x0F);
        for c in 0..4 {
            let v = ld(sub + 64 * c);
            w[c] = _mm256_and_si256(v, lo4);
            w[c + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), lo4);
        }
        if matches!(F, F_IQ4NL | F_IQ4XS) {
            // The signed code-book values by index, as the AVX2 kernels take them.
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()));
            let d = if F == F_IQ4XS {
                // `d * scale_iq4xs(s)` (see `packed::block16`).
                let srl = |v: __m256i, n: usize| _mm256_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
                let and = |v: __m256i, m: i32| _mm256_and_si256(v, _mm256_set1_epi32(m));
                let sl = ld(IQ4XS_SL);
                let sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(IQ4XS_SH + 16 * h).cast()));
                let (lo_at, hi_at) = iq4xs_scale_at(s);
                let low = and(srl(sl, lo_at), 0xF);
                let ls = _mm256_or_si256(low, _mm256_slli_epi32::<4>(and(srl(sh, hi_at), 3)));
                let ls = _mm256_sub_epi32(ls, _mm256_set1_epi32(32));
                _mm256_mul_ps(f16s(IQ4XS_D), _mm256_cvtepi32_ps(ls))
            } else {
                f16s(256)
            };
            return PanelBlock {
                w: w.map(|v| _mm256_shuffle_epi8(table, v)),
                d,
                m: _mm256_setzero_ps(),
                mins: [_mm256_setzero_ps(); 2],
            };
        }
        if matches!(F, F_Q5_0 | F_Q5_1 | F_Q5K) {
            // Vector `j`'s fifth bits sit at bits `8k + j` of the lane (`packed::q5_bit`).
            let (qh, bit4) = (ld(sub + 256), _mm256_set1_epi8(0x10));
            for (j, wj) in w.iter_mut().enumerate() {
                let at = if j <= 4 {
                    _mm256_sll_epi32(qh, _mm_cvtsi32_si128(4 - j as i32))
                } else {
                    _mm256_srl_epi32(qh, _mm_cvtsi32_si128(j as i32 - 4))
                };
                *wj = _mm256_or_si256(*wj, _mm256_and_si256(at, bit4));
            }
        }
        if F == F_Q6K {
            // Vector `j`'s high bits sit at bits `8k + 2(j % 4)` of lane vector `j / 4`
            // (`packed::q6_bit`).
            let (hi, bits45) = ([ld(sub + 256), ld(sub + 320)], _mm256_set1_epi8(0x30));
            for (j, wj) in w.iter_mut().enumerate() {
                let (v, at) = (hi[j / 4], 2 * (j % 4) as i32);
                let v = if at <= 4 {
                    _mm256_sll_epi32(v, _mm_cvtsi32_si128(4 - at))
                } else {
                    _mm256_srl_epi32(v, _mm_cvtsi32_si128(at - 4))
                };
                *wj = _mm256_or_si256(*wj, _mm256_and_si256(v, bits45));
            }
        }
        let (d, m) = match F {
            F_Q6K => {
                // The scales of elements 0..16 and 16..32: signed bytes `2s`, `2s + 1`.
                let v = ld(Q6K_SCALES + 64 * (s / 2));
                let byte = |i: usize| {
                    let up = _mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * i as i32));
                    _mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(up))
                };
                let d = f16s(Q6K_D);
                let i = 2 * (s % 2);
                (_mm256_mul_ps(d, byte(i)), _mm256_mul_ps(d, byte(i + 1)))
            }
            F_Q4K | F_Q5K => {
                let (_, d_at, dmin_at, sc_at) = k45_fields(F == F_Q5K);
                let (sc, mn) = q4k_scale_min(|k| ld(sc_at + 64 * k), s);
                let sign = _mm256_set1_ps(-0.0);
                (
                    _mm256_mul_ps(f16s(d_at), _mm256_cvtepi32_ps(sc)),
                    _mm256_xor_ps(_mm256_mul_ps(f16s(dmin_at), _mm256_cvtepi32_ps(mn)), sign),
                )
            }
            F_Q4_1 => (f16s(256), f16s(288)),
            F_Q5_0 => (f16s(320), _mm256_setzero_ps()),
            F_Q5_1 => (f16s(320), f16s(352)),
            _ => (f16s(256), _mm256_setzero_ps()),
        };
        PanelBlock {
            w,
            d,
            m,
            mins: [_mm256_setzero_ps(); 2],
        }
    }
}

/// [`half_block`] of Q2_K and Q3_K (rows `8h..8h + 8` of sub-block `s`, its quants at `sub` in
/// the packed super-block at `p`), as the AVX-512 `packed::k23_block` decodes all 16 rows.
///
/// # Safety
/// `p` is a whole packed super-block of the format, `s < 8`, `sub` sub-block `s`'s offset, `h < 2`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k23_half<const F: u8>(p: *const u8, s: usize, sub: usize, h: usize) -> PanelBlock {
    // SAFETY (whole body): every load is inside the super-block (fields laid out in `packed`).
    unsafe {
        let ld = |off: usize| _mm256_loadu_si256(p.add(off + 32 * h).cast());
        let f16s = |off: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(off + 16 * h).cast()));
        let srl = |v: __m256i, n: usize| _mm256_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
        let lanes =
            |v: __m256i, n: usize, mask: i32| _mm256_and_si256(srl(v, n), _mm256_set1_epi32(mask));
        let low = [ld(sub), ld(sub + 64)];
        let three = _mm256_set1_epi8(3);
        let mut w: [__m256i; 8] =
            std::array::from_fn(|j| _mm256_and_si256(srl(low[j / 4], 2 * (j % 4)), three));
        if F == F_Q3K {
            let (hi, bit2) = (ld(sub + 128), _mm256_set1_epi8(4));
            for (j, wj) in w.iter_mut().enumerate() {
                let at = if j <= 2 {
                    _mm256_sll_epi32(hi, _mm_cvtsi32_si128(2 - j as i32))
                } else {
                    srl(hi, j - 2)
                };
                *wj = _mm256_or_si256(*wj, _mm256_and_si256(at, bit2));
            }
            let d = f16s(Q3K_D);
            let scale = |i: usize| {
                let (k, lo_at, hi_at) = q3k_scale_at(i);
                let lo = lanes(ld(Q3K_SCALES + 64 * k), lo_at, 0xF);
                let hi = lanes(ld(Q3K_SCALES + 128), hi_at, 3);
                let v = _mm256_or_si256(lo, _mm256_slli_epi32::<4>(hi));
                let v = _mm256_sub_epi32(v, _mm256_set1_epi32(32));
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(v))
            };
            return PanelBlock {
                w,
                d: scale(2 * s),
                m: scale(2 * s + 1),
                mins: [_mm256_setzero_ps(); 2],
            };
        }
        let v = ld(Q2K_SCALES + 64 * (s / 2));
        let at = 16 * (s % 2);
        let (d, dmin) = (f16s(Q2K_D), f16s(Q2K_DMIN));
        let nib = |n: usize| _mm256_cvtepi32_ps(lanes(v, at + n, 0xF));
        let min = |n: usize| _mm256_xor_ps(_mm256_mul_ps(dmin, nib(n)), _mm256_set1_ps(-0.0));
        PanelBlock {
            w,
            d: _mm256_mul_ps(d, nib(0)),
            m: _mm256_mul_ps(d, nib(8)),
            mins: [min(4), min(12)],
        }
    }
}

/// Q4_K sub-block `s`'s 6-bit scale and minimum per lane, from the 3 scale vectors `v(k)`
/// (lane = bytes `4k..4k + 4` of the row's `scales`): ggml's `get_scale_min_k4`, 8 rows at once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_scale_min(v: impl Fn(usize) -> __m256i, s: usize) -> (__m256i, __m256i) {
    let srl = |x: __m256i, n: usize| _mm256_srl_epi32(x, _mm_cvtsi32_si128(n as i32));
    let and = |x: __m256i, m: i32| _mm256_and_si256(x, _mm256_set1_epi32(m));
    if s < 4 {
        (and(srl(v(0), 8 * s), 63), and(srl(v(1), 8 * s), 63))
    } else {
        // Low 4 bits from bytes 8..12, high 2 bits from the top of bytes 0..4 (scale) and
        // 4..8 (minimum).
        let (i, v2) = (s - 4, v(2));
        let sc = _mm256_or_si256(and(srl(v2, 8 * i), 15), and(srl(v(0), 8 * i + 2), 0x30));
        let m = _mm256_or_si256(and(srl(v2, 8 * i + 4), 15), and(srl(v(1), 8 * i + 2), 0x30));
        (sc, m)
    }
}

/// Fewest tokens for which each half group is unpacked once into the panel buffer and the token
/// tiles (2 tokens each) read it there, instead of decoding the packed block again per tile.
/// Measured (1536x1536, 1 thread, `ZEROLAYER_KERNELS=avx2` and `avx2vnni`, 3 and 4 tokens,
/// unpacked vs per tile): Q4_K +13-45%, Q5_0 +19-36%, Q6_K +18-42%, IQ4_NL +11-19%, Q2_K at 4
/// tokens +12-24%; Q8_0, whose decode is a load and an XOR, 8-20% slower, so it keeps the
/// many-token threshold.
const fn panel_min_tokens(f: u8) -> usize {
    if f == F_Q8_0 { PANEL_MIN_TOKENS } else { 3 }
}

/// The halves of the 16-row group at row `g` that hold rows before `end`: `(h, first row,
/// rows)`.
fn live_halves(g: usize, end: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..2)
        .map(move |h| (h, g + 8 * h))
        .take_while(move |&(_, r0)| r0 < end)
        .map(move |(h, r0)| (h, r0, (end - r0).min(8)))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn rows_impl<const F: u8>(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
    vnni: Vnni,
) {
    let bb = block_bytes(fmt).unwrap_or(0);
    let nb = w.cols / 32;
    let nq = quads_per_token(w.cols);
    let gb = nb * bb;
    assert!(
        acts.len() >= n * nq
            && rows.end <= w.rows
            && rows.start.is_multiple_of(GROUP_ROWS)
            && !rows.is_empty()
    );
    assert!(bb > 0 && w.data.len() >= w.rows.div_ceil(GROUP_ROWS) * gb);
    // The task's bytes: prefetches stay inside them.
    let task = &w.data[rows.start / GROUP_ROWS * gb..rows.end.div_ceil(GROUP_ROWS) * gb];
    if n >= panel_min_tokens(F) {
        return panel_rows::<F>(task, bb, nb, nq, acts, n, rows, out, vnni);
    }
    // The streaming prefetch runs `PF_AHEAD` ahead: the task's first bytes up to there are
    // requested at once.
    for off in (0..PF_AHEAD.min(task.len())).step_by(64) {
        // A hint inside `task` (no side effects).
        _mm_prefetch::<_MM_HINT_T2>(task[off..].as_ptr().cast());
    }
    for g in rows.clone().step_by(GROUP_ROWS) {
        let at = (g - rows.start) / GROUP_ROWS * gb;
        let group = task[at..at + gb].as_ptr();
        for (h, r0, live) in live_halves(g, rows.end) {
            // The first pass over the group (rows 0..8, first tokens) streams it from DRAM:
            // prefetch ahead in the task. The second half's bytes share its cache lines.
            let block = |t0: usize, b: usize| {
                if h == 0 && t0 == 0 && b.is_multiple_of(4) {
                    let from = at + b * bb + PF_AHEAD;
                    for off in (from..(from + 4 * bb).min(task.len())).step_by(64) {
                        // A hint inside `task` (no side effects).
                        _mm_prefetch::<_MM_HINT_T2>(task[off..].as_ptr().cast());
                    }
                }
                // SAFETY: block `b < nb` of the group is whole.
                unsafe { half_block::<F>(group, b, bb, h) }
            };
            token_tiles::<F>(nb, block, acts, nq, 0..n, vnni, |t, v| {
                emit8(out, t, r0, live, v)
            });
        }
    }
}

/// Three tokens and more ([`panel_min_tokens`]): each half group is unpacked once per token
/// chunk into the panel buffer (as the file-layout panel kernel decodes its rows), then every
/// token pair runs over it.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
fn panel_rows<const F: u8>(
    task: &[u8],
    bb: usize,
    nb: usize,
    nq: usize,
    acts: &[ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
    vnni: Vnni,
) {
    let gb = nb * bb;
    with_panel(nb, |panel| {
        for tc in (0..n).step_by(PANEL_TOKEN_CHUNK) {
            let t_end = (tc + PANEL_TOKEN_CHUNK).min(n);
            for g in rows.clone().step_by(GROUP_ROWS) {
                let at = (g - rows.start) / GROUP_ROWS * gb;
                let group = task[at..at + gb].as_ptr();
                for (h, r0, live) in live_halves(g, rows.end) {
                    for (b, pb) in panel.iter_mut().enumerate() {
                        // SAFETY: block `b < nb` of the group is whole.
                        *pb = unsafe { half_block::<F>(group, b, bb, h) };
                    }
                    let panel: &[PanelBlock] = panel;
                    token_tiles::<F>(
                        nb,
                        |_, b| panel[b],
                        acts,
                        nq,
                        tc..t_end,
                        vnni,
                        |t, v| emit8(out, t, r0, live, v),
                    );
                }
            }
        }
    });
}
