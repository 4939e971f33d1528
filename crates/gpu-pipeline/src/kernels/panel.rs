//! AVX-512 VNNI matrix-matrix kernel for many tokens (prefill, batched decode) over the
//! integer-quantized formats: the 32-element block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
//! IQ4_NL, and the 256-element K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS.
//!
//! A task packs 16 rows at a time ("a panel") into a thread-local buffer: per 32-element block
//! (of a K-quant: per 32-element sub-block), eight u8 vectors whose lane `r` holds 4 consecutive
//! quants of row `r` (block element `4j..4j+4` in vector `j`), plus the 16 rows' effective block
//! scales as f32 vectors ([`scale_vectors`] of them: the scale, and the minimum of the formats
//! with one; the split formats Q2_K, Q3_K and Q6_K, whose 16-element halves have their own
//! scales (and mins), one vector per half). The panel is then reused for every token: `vpdpbusd`
//! of vector `j` with token `t`'s 4 activation bytes broadcast gives 16 rows' partial sums at
//! once, so no horizontal reductions are needed and each activation load serves 16 rows.
//! Panels go in pairs (a task's last odd panel alone): each broadcast activation word feeds
//! both panels' `vpdpbusd`, which halves the activation loads per instruction.
//! The activations come as compact [`ActBlock`]s (one cache line per block and token), and tokens
//! go in chunks of [`TOKEN_CHUNK`] so that a chunk's blocks stay in L2 while the task's panels
//! pass over them. Packing uses plain loads and dword transposes (a gather or a transposed header
//! per block or super-block for the 16 rows' scales); the next panel's bytes are prefetched while
//! one is packed.
//!
//! **Same arithmetic as the 4-row kernel.** Each output element is accumulated exactly as in
//! [`super::avx512`]: the exact integer block dot product (split formats: one per half, each
//! offset by its own activation sum), converted to f32 and added with one FMA by `d_w * d_x`
//! (split: one FMA per half, with the half's scale), then for the formats with a minimum
//! `m_w * d_x * sum(q_x)` (Q4_1, Q5_1, Q4_K, Q5_K: one FMA of `m_w` by the activations' `d * sum(q)`;
//! Q2_K: one FMA `sum(q_x half) * (m_w half * d_x)` per half), into one of four f32 chains by
//! block index modulo 4 (in increasing block order), and the chains summed as
//! `(c0 + c2) + (c1 + c3)`. The effective scales are computed with the same f32 operations as
//! weight-cache's [`weight_cache::quant::decode_sub_block`] (`d * sc`, `-(dmin * m)`). So a
//! token's outputs are bit-identical whichever kernel ran it, which keeps `matmul`
//! batch-invariant when the batch size picks this kernel.

// The AVX-512 intrinsics are stable since Rust 1.89; the workspace toolchain is 1.95.
#![allow(clippy::incompatible_msrv)]

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::offset_of;
use std::ops::Range;

use super::act::ActBlock;
use super::avx512::{
    F_IQ4NL, F_IQ4XS, F_Q2K, F_Q3K, F_Q4_1, F_Q4K, F_Q5_0, F_Q5_1, F_Q5K, F_Q6K, F_Q8_0, IQ4_TABLE,
    has_min, is_split, offset_shift,
};
use super::format::Fmt;
use super::{Layout, RowsOut, WeightMatrix};
use weight_cache::quant::{BlockQ5_0, BlockQ5_1};

/// Rows per panel (one per 32-bit lane of a 512-bit vector).
pub(crate) const PANEL_ROWS: usize = 16;
/// Smallest token count this kernel is used for; fewer tokens use the 4-row kernel, whose weight
/// decoding needs no packing pass (measured crossover on Zen 4).
pub(crate) const PANEL_MIN_TOKENS: usize = 16;

/// How many blocks ahead [`chain`]'s first chain prefetches each token's activation blocks.
/// A token chunk of a wide matrix does not fit L2 (128 tokens of a 14336-column down projection
/// are 3.6 MiB of blocks), so each tile's blocks come from L3. Q4_K, 512 tokens, the two
/// variants alternating in one process (Zen 4): 4096 x 14336 1.05-1.16x with the prefetch
/// (distances 8-64 all gained; 1 and 2 threads), 2048 x 8192 1.03-1.09x, 8192 x 2048 and
/// 576 x 1536 0.99-1.05x.
const PF_ACTS: usize = 16;

/// Smallest token count for which a packed matrix ([`Layout::Rows16`]) goes through this kernel
/// (which then unpacks each 16-row group into its panel buffer); fewer tokens are multiplied
/// straight from the packed layout in tiles of up to 9 tokens (`packed`), which decodes each
/// block once per tile but needs no unpacking pass. Measured on Zen 4 (2 threads,
/// `examples/step_cost` with both kernels alternating in one process), step time tiles / panel:
/// the default model (Q4_1, Q8_0 head; 576 x 1536) 0.81-0.95 at 16-40 tokens (most 0.82-0.90),
/// 0.92-0.95 for a verification of 8 drafts (an 18-token split-activation down projection),
/// 0.93-0.94 at 64, 0.94-1.02 at 128; the 1.04 GB Q4_K_M (Q4_K, Q6_K; 2048 x 5632)
/// 0.79-0.81 at 18, 0.87-0.92 at 32, 0.94-0.99 at 48, even at 64, and 256-token prompts 15-20%
/// slower with tiles.
pub(crate) const PANEL_MIN_TOKENS_PACKED: usize = 64;

/// Whether a product of `n` tokens with a matrix of `layout` runs this kernel (given a format
/// it [`applies`] to, or a packed matrix).
pub(crate) fn runs(layout: Layout, n: usize) -> bool {
    n >= if layout == Layout::Rows16 {
        PANEL_MIN_TOKENS_PACKED
    } else {
        PANEL_MIN_TOKENS
    }
}

/// Most tokens multiplied per panel packing (see `panel_rows`): 128 tokens of a 1536-column
/// input are 384 KiB of activation blocks, well inside a 1 MiB L2. Measured on Zen 4 (2 threads,
/// Q4_1 1536x576 / 576x1536, Q8_0 4096x576): against 64, 6-20% faster at 100 tokens (one packing
/// instead of two), 3-10% at 200 and 512.
const TOKEN_CHUNK: usize = 128;

/// The quants of one packed block of a panel: `w[j]` lane `r` holds the u8 quants of elements
/// `4j..4j + 4` of row `r` (the formats with an offset: offset by it, as the 4-row kernel's).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Quants {
    w: [[u8; 64]; 8],
}

/// One f32 per row of a panel (a block's scales, minimums, ...).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Lanes([f32; 16]);

/// The f32 vectors per packed block: the 16 rows' scales, then for the formats with a minimum
/// the minimums; the split formats have per-half vectors (scales of elements 0..16 and 16..32,
/// then Q2_K's minimums likewise).
pub(crate) const fn scale_vectors(f: u8) -> usize {
    match (is_split(f), has_min(f)) {
        (false, false) => 1,
        (false, true) | (true, false) => 2,
        (true, true) => 4,
    }
}

/// The most [`scale_vectors`] of any format.
const MAX_SCALE_VECTORS: usize = 4;

/// A task's panel: the packed blocks' quants and their [`scale_vectors`] each (block `b`'s
/// at `scales[v * b..v * (b + 1)]`).
struct Panel {
    quants: Vec<Quants>,
    scales: Vec<Lanes>,
}

thread_local! {
    static PANEL: RefCell<Panel> = const {
        RefCell::new(Panel {
            quants: Vec::new(),
            scales: Vec::new(),
        })
    };
}

/// The formats with an offset subtract `offset * sum(q_x)` from each integer dot product (per
/// half for the split formats). The caller computes it once per product for every token and
/// block ([`fill_offsets`]), negated, and each tile starts its integer sums from it: a
/// broadcast load instead of a shift and a subtraction per block, token and panel, with the
/// same integer result. Which table a format reads: its [`OffsetKey`].
///
/// `out[t * nb + b]` = `[-(sum(q_x half 0) << shift), -(sum(q_x half 1) << shift)]` (split
/// formats) or `[-(sum(q_x) << shift), 0]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct OffsetKey {
    shift: i32,
    split: bool,
}

/// The offset table `fmt` reads in this kernel (`None`: a format without an offset).
pub(crate) fn offset_key(fmt: Fmt) -> Option<OffsetKey> {
    fn key<const F: u8>() -> Option<OffsetKey> {
        (offset_shift(F) != 0).then_some(OffsetKey {
            shift: offset_shift(F),
            split: is_split(F),
        })
    }
    if matches!(fmt, Fmt::F32 | Fmt::F16 | Fmt::BF16) {
        return None;
    }
    super::avx512::by_quant_format!(fmt, key())
}

/// Fills `out` (one entry per block of `acts`) with the offset starts of `key` (see
/// [`OffsetKey`]).
pub(crate) fn fill_offsets(key: OffsetKey, acts: &[ActBlock], out: &mut [[i32; 2]]) {
    let s = key.shift;
    for (o, a) in out.iter_mut().zip(acts) {
        *o = if key.split {
            [a.offset_start(0, s), a.offset_start(1, s)]
        } else {
            [a.offset_start(2, s), 0]
        };
    }
}

/// Whether this kernel handles `fmt` at `n` tokens.
pub(crate) fn applies(fmt: Fmt, n: usize) -> bool {
    n >= PANEL_MIN_TOKENS
        && matches!(
            fmt,
            Fmt::Q4_0
                | Fmt::Q4_1
                | Fmt::Q5_0
                | Fmt::Q5_1
                | Fmt::Q8_0
                | Fmt::IQ4NL
                | Fmt::Q2K
                | Fmt::Q3K
                | Fmt::Q4K
                | Fmt::Q5K
                | Fmt::Q6K
                | Fmt::IQ4XS
        )
}

/// Rows `rows` x all `n` tokens. `offs`: the tokens' offset starts of `fmt`'s [`OffsetKey`]
/// ([`fill_offsets`] over `acts`), empty for a format without an offset.
///
/// # Safety
/// The CPU supports the features enabled here; `acts` holds `n` tokens quantized for `w.cols`;
/// `fmt` is one of [`applies`]'s formats and is `w`'s format (of a packed matrix: one with a
/// packed layout, its length checked, `rows.start` a multiple of 16).
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
pub(crate) unsafe fn quant_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActBlock],
    offs: &[[i32; 2]],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    super::avx512::by_quant_format!(fmt, panel_rows(fmt, w, (acts, offs), n, rows, out))
}

/// A product's activation blocks and their offset starts (see [`quant_rows`]).
type Acts<'a> = (&'a [ActBlock], &'a [[i32; 2]]);

#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn panel_rows<const F: u8>(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: Acts<'_>,
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    if w.layout == Layout::Rows16 {
        return packed_impl::<F>(fmt, w, acts, n, rows, out);
    }
    let rb = fmt.row_bytes(w.cols);
    let nblocks = w.cols / 32;
    assert!(rows.end <= w.rows && w.data.len() >= w.rows * rb);
    assert!(!rows.is_empty() && PANEL_ROWS * rb < i32::MAX as usize);
    let end = rows.end;
    panel_loop::<F>(nblocks, acts, n, rows, out, &mut |g, quants, scales| {
        let r0 = g.min(end - 1);
        // Row offsets from row `r0`; rows past the task repeat its last row (not emitted).
        let offs: [i32; 16] =
            std::array::from_fn(|k| ((g + k).min(end - 1) - r0) as i32 * rb as i32);
        // The next panel (DRAM in decode) is prefetched while this one is packed.
        let next_r0 = (g + PANEL_ROWS).min(end - 1);
        // SAFETY: `r0, next_r0 < w.rows`; the packing reads stay inside rows `r0..end`, the
        // prefetches inside rows `next_r0..end`.
        unsafe {
            let base = w.data.as_ptr();
            let next = (base.add(next_r0 * rb), end - next_r0);
            if fmt.block_elems() == 256 {
                pack_k::<F>(base.add(r0 * rb), next, offs, rb, quants, scales);
            } else {
                pack::<F>(base.add(r0 * rb), next, offs, rb, quants, scales);
            }
        }
    });
}

/// [`panel_rows`] over a matrix already in the row-interleaved layout of
/// [`super::packed::PackedWeights`] (`rows.start` a multiple of 16): each 16-row group is
/// unpacked into the panel (no gathers or transposes), then multiplied the same way.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn packed_impl<const F: u8>(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: Acts<'_>,
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    let bb = super::packed::block_bytes(fmt).unwrap_or(0);
    let nblocks = w.cols / 32;
    let gb = nblocks * bb;
    assert!(rows.end <= w.rows && rows.start.is_multiple_of(PANEL_ROWS));
    assert!(!rows.is_empty() && w.data.len() >= w.rows.div_ceil(PANEL_ROWS) * gb);
    panel_loop::<F>(nblocks, acts, n, rows, out, &mut |g, quants, scales| {
        let group = &w.data[g / PANEL_ROWS * gb..][..gb];
        // SAFETY: `group` holds the group's `nblocks` packed blocks of `bb` bytes.
        unsafe { unpack::<F>(group, bb, quants, scales) };
    });
}

/// Unpacks one packed 16-row group (`quants.len()` blocks of `bb` bytes) into the panel: each
/// block as the decode kernel reads it ([`super::packed::block16`]).
///
/// # Safety
/// `group` holds `quants.len()` packed blocks of `bb` bytes (K-quants: whole super-blocks);
/// `scales` has [`scale_vectors`] entries per block.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn unpack<const F: u8>(
    group: &[u8],
    bb: usize,
    quants: &mut [Quants],
    scales: &mut [Lanes],
) {
    let sv = scale_vectors(F);
    for (b, pb) in quants.iter_mut().enumerate() {
        let sb = &mut scales[sv * b..sv * (b + 1)];
        // SAFETY: block `b` of the group is whole (forwarded); the stores fill `pb`'s aligned
        // fields.
        unsafe {
            let blk = super::packed::block16::<F>(group.as_ptr(), b, bb);
            for (j, wj) in blk.w.iter().enumerate() {
                _mm512_store_si512(pb.w[j].as_mut_ptr().cast(), *wj);
            }
            // `d`, then the minimums (Q4_1, Q5_1, Q4_K) or the split formats' second-half scales: the
            // panel's second scale vector either way.
            _mm512_store_ps(sb[0].0.as_mut_ptr(), blk.d);
            if sv > 1 {
                _mm512_store_ps(sb[1].0.as_mut_ptr(), blk.m);
            }
            if sv > 2 {
                // Q2_K: the halves' minimums.
                _mm512_store_ps(sb[2].0.as_mut_ptr(), blk.mins[0]);
                _mm512_store_ps(sb[3].0.as_mut_ptr(), blk.mins[1]);
            }
        }
    }
}

/// Fills a panel for the 16-row group at a row: its blocks' quants and scale vectors.
type PackFn<'a> = dyn FnMut(usize, &mut [Quants], &mut [Lanes]) + 'a;

/// The token and row loops shared by both sources: for each token chunk and each pair of 16-row
/// groups `g`, `g + 16` of `rows` (a last odd group alone), `pack(g, quants, scales)` fills the
/// panels, then every tile of the chunk's tokens is multiplied and emitted.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn panel_loop<const F: u8>(
    nblocks: usize,
    (acts, offs): Acts<'_>,
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
    pack: &mut PackFn<'_>,
) {
    assert!(acts.len() >= n * nblocks);
    // The tiles read the offset starts without bounds checks.
    assert!(offset_shift(F) == 0 || offs.len() >= n * nblocks);
    PANEL.with(|p| {
        let mut guard = p.borrow_mut();
        let Panel { quants, scales } = &mut *guard;
        if quants.len() < 2 * nblocks {
            quants.resize(2 * nblocks, Quants { w: [[0; 64]; 8] });
            scales.resize(2 * MAX_SCALE_VECTORS * nblocks, Lanes([0.0; 16]));
        }
        let sv = scale_vectors(F);
        let (q0, q1) = quants[..2 * nblocks].split_at_mut(nblocks);
        let (s0, s1) = scales[..2 * sv * nblocks].split_at_mut(sv * nblocks);
        // Token chunks small enough that their activations stay in L2 while every panel of
        // the task's rows passes over them (a panel is re-packed per chunk).
        // Equal chunks in whole 8-token tiles (a 200-token batch: 104 + 96, not 100 + 100 with
        // a 4-token tail tile each).
        let chunk = n.div_ceil(n.div_ceil(TOKEN_CHUNK)).next_multiple_of(8);
        for tc in (0..n).step_by(chunk) {
            let t_end = (tc + chunk).min(n);
            let mut g = rows.start;
            while g < rows.end {
                let pair = g + PANEL_ROWS < rows.end;
                pack(g, q0, s0);
                if pair {
                    pack(g + PANEL_ROWS, q1, s1);
                }
                let mut emit = |p: usize, t: usize, v: __m512| {
                    let r0 = g + p * PANEL_ROWS;
                    let live = (rows.end - r0).min(PANEL_ROWS);
                    let mut o = [0.0f32; 16];
                    // SAFETY: `o` has room for 16 floats.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
                    out.set_run(t, r0, &o[..live]);
                };
                let mut t0 = tc;
                while t0 < t_end {
                    let left = t_end - t0;
                    let ap = acts[t0 * nblocks..].as_ptr();
                    // The tile's offsets (an empty slice for the formats without one).
                    let op = offs[(t0 * nblocks).min(offs.len())..].as_ptr();
                    // SAFETY: `ap` has at least the tile's tokens (`left` of them), `nblocks`
                    // blocks each, and so has `op` for the formats with an offset (the only
                    // ones that read it); the panels hold `nblocks` packed blocks each.
                    let done = unsafe {
                        if pair {
                            let (q, s) = ([&*q0, &*q1], [&*s0, &*s1]);
                            match left {
                                4.. => {
                                    emit_tile(tile::<F, 2, 4>(q, s, ap, op, nblocks), t0, &mut emit)
                                }
                                2.. => {
                                    emit_tile(tile::<F, 2, 2>(q, s, ap, op, nblocks), t0, &mut emit)
                                }
                                _ => {
                                    emit_tile(tile::<F, 2, 1>(q, s, ap, op, nblocks), t0, &mut emit)
                                }
                            }
                        } else {
                            let (q, s) = ([&*q0], [&*s0]);
                            match left {
                                8.. => {
                                    emit_tile(tile::<F, 1, 8>(q, s, ap, op, nblocks), t0, &mut emit)
                                }
                                4.. => {
                                    emit_tile(tile::<F, 1, 4>(q, s, ap, op, nblocks), t0, &mut emit)
                                }
                                2.. => {
                                    emit_tile(tile::<F, 1, 2>(q, s, ap, op, nblocks), t0, &mut emit)
                                }
                                _ => {
                                    emit_tile(tile::<F, 1, 1>(q, s, ap, op, nblocks), t0, &mut emit)
                                }
                            }
                        }
                    };
                    t0 += done;
                }
                g += if pair { 2 * PANEL_ROWS } else { PANEL_ROWS };
            }
        }
    });
}

/// Emits a tile's outputs (panel `p`, token `t0 + t`) and returns its token count.
#[inline(always)]
fn emit_tile<const P: usize, const T: usize>(
    v: [[__m512; T]; P],
    t0: usize,
    emit: &mut impl FnMut(usize, usize, __m512),
) -> usize {
    for (p, vp) in v.into_iter().enumerate() {
        for (t, x) in vp.into_iter().enumerate() {
            emit(p, t0 + t, x);
        }
    }
    T
}

/// Packs the 16 rows at `base + offs[k]` into the panel (one entry of `quants` and one of
/// `scales` per block), prefetching the first `next.1` rows (at most 16) of `rb` bytes at
/// `next.0`.
///
/// # Safety
/// Each `base + offs[k]` is the start of a full encoded row of `quants.len()` blocks of a
/// 32-element format; `next.0` is valid for `next.1 * rb` bytes (prefetches only).
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn pack<const F: u8>(
    base: *const u8,
    next: (*const u8, usize),
    offs: [i32; 16],
    rb: usize,
    quants: &mut [Quants],
    scales: &mut [Lanes],
) {
    let panel = quants;
    // SAFETY: `offs` is 16 i32s.
    let vidx = unsafe { _mm512_loadu_si512(offs.as_ptr().cast()) };
    let lo4 = _mm512_set1_epi8(0x0F);
    let flip = _mm512_set1_epi8(-128);
    // Block bytes, and header bytes before the quants (f16 scale; Q4_1/Q5_1 also an f16
    // minimum; Q5_0/Q5_1 then the u32 of 5th bits).
    let bs = rb / panel.len().max(1);
    let (hdr, qh_at) = match F {
        F_Q4_1 => (4, 0),
        F_Q5_0 => (offset_of!(BlockQ5_0, qs), offset_of!(BlockQ5_0, qh)),
        F_Q5_1 => (offset_of!(BlockQ5_1, qs), offset_of!(BlockQ5_1, qh)),
        _ => (2, 0),
    };
    // SAFETY: the table is 64 readable bytes.
    let table = unsafe { _mm512_loadu_si512(IQ4_TABLE.as_ptr().cast()) };
    let fifth = _mm512_set1_epi8(0x10);
    let next_len = next.1.min(PANEL_ROWS) * rb;
    // Spread the next panel's lines over the blocks: `per` lines per block.
    let per = next_len.div_ceil(64).div_ceil(panel.len().max(1));
    let mut pf = 0usize;
    for (b, pb) in panel.iter_mut().enumerate() {
        for _ in 0..per {
            if pf < next_len {
                // SAFETY: `pf < next_len`; prefetching has no side effects.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(next.0.add(pf).cast()) };
                pf += 64;
            }
        }
        // SAFETY: every load lies inside block `b` of one of the 16 rows.
        unsafe {
            let p = base.add(b * bs);
            let h = _mm512_i32gather_epi32::<1>(vidx, p.cast());
            let sv = scale_vectors(F);
            store(&mut scales[sv * b], f16_lo(h));
            if has_min(F) {
                store(&mut scales[sv * b + 1], f16_lo(_mm512_srli_epi32(h, 16)));
            }
            let q = p.add(hdr);
            if F == F_Q8_0 {
                let lo = transpose16(q, &offs);
                let hi = transpose16(q.add(16), &offs);
                for j in 0..4 {
                    _mm512_store_si512(pb.w[j].as_mut_ptr().cast(), _mm512_xor_si512(lo[j], flip));
                    _mm512_store_si512(
                        pb.w[j + 4].as_mut_ptr().cast(),
                        _mm512_xor_si512(hi[j], flip),
                    );
                }
            } else {
                let qh = if F == F_Q5_0 || F == F_Q5_1 {
                    _mm512_i32gather_epi32::<1>(vidx, p.add(qh_at).cast())
                } else {
                    _mm512_setzero_si512()
                };
                let v = transpose16(q, &offs);
                for (j, vj) in v.into_iter().enumerate() {
                    let mut lo = _mm512_and_si512(vj, lo4);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16(vj, 4), lo4);
                    if F == F_Q5_0 || F == F_Q5_1 {
                        lo = _mm512_mask_add_epi8(lo, fifth_bits(qh, 4 * j as i32), lo, fifth);
                        hi = _mm512_mask_add_epi8(hi, fifth_bits(qh, 16 + 4 * j as i32), hi, fifth);
                    }
                    if F == F_IQ4NL {
                        lo = _mm512_shuffle_epi8(table, lo);
                        hi = _mm512_shuffle_epi8(table, hi);
                    }
                    _mm512_store_si512(pb.w[j].as_mut_ptr().cast(), lo);
                    _mm512_store_si512(pb.w[j + 4].as_mut_ptr().cast(), hi);
                }
            }
        }
    }
}

/// Stores `v` into `dst`.
#[inline(always)]
fn store(dst: &mut Lanes, v: __m512) {
    // SAFETY: `dst` is 16 aligned f32s; AVX-512F is enabled in every caller.
    unsafe { _mm512_store_ps(dst.0.as_mut_ptr(), v) }
}

/// The f16 in the low 16 bits of each dword lane of `v`, as f32.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn f16_lo(v: __m512i) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
}

/// Byte `k` (0..16) of each row, as u32 lanes, from the 16 bytes per row of [`transpose16`].
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn byte_lanes(v: &[__m512i; 4], k: usize) -> __m512i {
    let shifted = _mm512_srl_epi32(v[k / 4], _mm_cvtsi32_si128(8 * (k % 4) as i32));
    _mm512_and_si512(shifted, _mm512_set1_epi32(0xFF))
}

/// `d * v` per lane for the integer lanes `v` (`d * f32::from(v)`, as weight-cache computes a
/// sub-block's scale).
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn scaled(d: __m512, v: __m512i) -> __m512 {
    _mm512_mul_ps(d, _mm512_cvtepi32_ps(v))
}

/// `-(d * v)` per lane, as `-(dmin * f32::from(m))` computes it.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn neg_scaled(d: __m512, v: __m512i) -> __m512 {
    _mm512_xor_ps(scaled(d, v), _mm512_set1_ps(-0.0))
}

/// [`pack`] for the 256-element K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS): each
/// super-block of the 16 rows fills 8 panel blocks, one per 32-element sub-block, with the
/// sub-block's quants as u8 and its effective scales (and minimums) as weight-cache's
/// `decode_sub_block` computes them.
///
/// # Safety
/// Each `base + offs[k]` is the start of a full encoded row of `quants.len() / 8` super-blocks
/// of format `F`; `next.0` is valid for `next.1 * rb` bytes (prefetches only).
#[inline]
#[allow(clippy::needless_range_loop)] // `j` indexes the packed vectors and the sources alike
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn pack_k<const F: u8>(
    base: *const u8,
    next: (*const u8, usize),
    offs: [i32; 16],
    rb: usize,
    quants: &mut [Quants],
    scales: &mut [Lanes],
) {
    // SAFETY: `offs` is 16 i32s.
    let vidx = unsafe { _mm512_loadu_si512(offs.as_ptr().cast()) };
    let nsb = quants.len() / 8;
    let bs = rb / nsb.max(1);
    let sv = scale_vectors(F);
    let lo4 = _mm512_set1_epi8(0x0F);
    let m2 = _mm512_set1_epi8(3);
    let m63 = _mm512_set1_epi32(63);
    let m15 = _mm512_set1_epi32(0xF);
    let m3 = _mm512_set1_epi32(3);
    let k32 = _mm512_set1_epi32(32);
    // SAFETY: the table is 64 readable bytes.
    let table = unsafe { _mm512_loadu_si512(IQ4_TABLE.as_ptr().cast()) };
    let next_len = next.1.min(PANEL_ROWS) * rb;
    let per = next_len.div_ceil(64).div_ceil(nsb.max(1));
    let mut pf = 0usize;
    let srl = |v: __m512i, n: i32| _mm512_srl_epi32(v, _mm_cvtsi32_si128(n));
    for sb in 0..nsb {
        for _ in 0..per {
            if pf < next_len {
                // SAFETY: `pf < next_len`; prefetching has no side effects.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(next.0.add(pf).cast()) };
                pf += 64;
            }
        }
        let qv = &mut quants[8 * sb..8 * sb + 8];
        let sc = &mut scales[8 * sv * sb..8 * sv * (sb + 1)];
        // SAFETY (whole block): every load lies inside super-block `sb` of one of the 16 rows
        // (`transpose16` at `at` reads bytes `at..at + 16`, the gathers a dword).
        unsafe {
            let p = base.add(sb * bs);
            // 32 bytes per row at `at` as 8 vectors: vector `j` lane `r` = bytes `4j..4j + 4`.
            let bytes32 = |at: usize| -> [__m512i; 8] {
                let a = transpose16(p.add(at), &offs);
                let b = transpose16(p.add(at + 16), &offs);
                [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
            };
            let store_w = |q: &mut Quants, j: usize, v: __m512i| {
                _mm512_store_si512(q.w[j].as_mut_ptr().cast(), v);
            };
            match F {
                F_Q4K | F_Q5K => {
                    // d, dmin, then the 12 scale bytes `q` (`scale_min_k4`).
                    let hdr = transpose16(p, &offs);
                    let d = f16_lo(hdr[0]);
                    let dmin = f16_lo(_mm512_srli_epi32(hdr[0], 16));
                    let q = |i: usize| byte_lanes(&hdr, 4 + i);
                    for s in 0..8 {
                        let (scale, min) = if s < 4 {
                            (_mm512_and_si512(q(s), m63), _mm512_and_si512(q(s + 4), m63))
                        } else {
                            let high = |v: __m512i| _mm512_slli_epi32(srl(v, 6), 4);
                            (
                                _mm512_or_si512(_mm512_and_si512(q(s + 4), m15), high(q(s - 4))),
                                _mm512_or_si512(srl(q(s + 4), 4), high(q(s))),
                            )
                        };
                        store(&mut sc[2 * s], scaled(d, scale));
                        store(&mut sc[2 * s + 1], neg_scaled(dmin, min));
                    }
                    let (qs_at, qh) = if F == F_Q5K {
                        (48, bytes32(16))
                    } else {
                        (16, [_mm512_setzero_si512(); 8])
                    };
                    let fifth = _mm512_set1_epi8(0x10);
                    for g in 0..4 {
                        // Bytes `32g..32g + 32`: sub-block `2g` in the low nibbles, `2g + 1`
                        // in the high ones; Q5_K's 5th bits are bits `2g`, `2g + 1` of `qh`.
                        let v = bytes32(qs_at + 32 * g);
                        for j in 0..8 {
                            let mut lo = _mm512_and_si512(v[j], lo4);
                            let mut hi = _mm512_and_si512(_mm512_srli_epi16(v[j], 4), lo4);
                            if F == F_Q5K {
                                let bit = |s: usize| _mm512_set1_epi8(1 << s);
                                let k0 = _mm512_test_epi8_mask(qh[j], bit(2 * g));
                                let k1 = _mm512_test_epi8_mask(qh[j], bit(2 * g + 1));
                                lo = _mm512_mask_add_epi8(lo, k0, lo, fifth);
                                hi = _mm512_mask_add_epi8(hi, k1, hi, fifth);
                            }
                            store_w(&mut qv[2 * g], j, lo);
                            store_w(&mut qv[2 * g + 1], j, hi);
                        }
                    }
                }
                F_Q6K => {
                    // ql (128), qh (64), 16 signed scale bytes, d.
                    let sbytes = transpose16(p.add(192), &offs);
                    let d = f16_lo(_mm512_srli_epi32(
                        _mm512_i32gather_epi32::<1>(vidx, p.add(206).cast()),
                        16,
                    ));
                    for i in 0..16 {
                        // Sign-extend byte `i` of the row's scales.
                        let v = sbytes[i / 4];
                        let sh = _mm_cvtsi32_si128(24 - 8 * (i % 4) as i32);
                        let x = _mm512_srai_epi32(_mm512_sll_epi32(v, sh), 24);
                        store(&mut sc[i], scaled(d, x));
                    }
                    let m30 = _mm512_set1_epi8(0x30);
                    for h in 0..2 {
                        // Sub-block `4h + j`, element `l`: nibble `j / 2` of ql byte
                        // `64h + 32(j % 2) + l`, bits `2j, 2j + 1` of qh byte `32h + l` above.
                        let ql = [bytes32(64 * h), bytes32(64 * h + 32)];
                        let qh = bytes32(128 + 32 * h);
                        for j in 0..4 {
                            for i in 0..8 {
                                let src = ql[j % 2][i];
                                let lo = if j < 2 {
                                    _mm512_and_si512(src, lo4)
                                } else {
                                    _mm512_and_si512(_mm512_srli_epi16(src, 4), lo4)
                                };
                                let high = match j {
                                    0 => _mm512_slli_epi16(qh[i], 4),
                                    1 => _mm512_slli_epi16(qh[i], 2),
                                    2 => qh[i],
                                    _ => _mm512_srli_epi16(qh[i], 2),
                                };
                                let v = _mm512_or_si512(lo, _mm512_and_si512(high, m30));
                                store_w(&mut qv[4 * h + j], i, v);
                            }
                        }
                    }
                }
                F_Q2K => {
                    // 16 scale bytes (scale: low nibble, min: high), qs (64), d, dmin.
                    let sbytes = transpose16(p, &offs);
                    let dd = _mm512_i32gather_epi32::<1>(vidx, p.add(80).cast());
                    let d = f16_lo(dd);
                    let dmin = f16_lo(_mm512_srli_epi32(dd, 16));
                    for s in 0..8 {
                        for e in 0..2 {
                            let x = byte_lanes(&sbytes, 2 * s + e);
                            store(&mut sc[4 * s + e], scaled(d, _mm512_and_si512(x, m15)));
                            store(&mut sc[4 * s + 2 + e], neg_scaled(dmin, srl(x, 4)));
                        }
                    }
                    for h in 0..2 {
                        let v = bytes32(16 + 32 * h);
                        for j in 0..4 {
                            let sh = _mm_cvtsi32_si128(2 * j as i32);
                            for i in 0..8 {
                                let q2 = _mm512_and_si512(_mm512_srl_epi16(v[i], sh), m2);
                                store_w(&mut qv[4 * h + j], i, q2);
                            }
                        }
                    }
                }
                F_Q3K => {
                    // hmask (32), qs (64), 12 scale bytes `q` (`scale_k3`), d: the 16 bytes
                    // ending the block are 2 of qs, the scales, d.
                    let tail = transpose16(p.add(94), &offs);
                    let d = f16_lo(_mm512_srli_epi32(tail[3], 16));
                    let q = |i: usize| byte_lanes(&tail, 2 + i);
                    for i in 0..16 {
                        let low = if i < 8 {
                            _mm512_and_si512(q(i), m15)
                        } else {
                            srl(q(i - 8), 4)
                        };
                        let high = _mm512_and_si512(srl(q(8 + i % 4), 2 * (i / 4) as i32), m3);
                        let v = _mm512_or_si512(low, _mm512_slli_epi32(high, 4));
                        store(&mut sc[i], scaled(d, _mm512_sub_epi32(v, k32)));
                    }
                    let hmask = bytes32(0);
                    let third = _mm512_set1_epi8(4);
                    for h in 0..2 {
                        let v = bytes32(32 + 32 * h);
                        for j in 0..4 {
                            let s = 4 * h + j;
                            let sh = _mm_cvtsi32_si128(2 * j as i32);
                            let bit = _mm512_set1_epi8(1 << s);
                            for i in 0..8 {
                                let q2 = _mm512_and_si512(_mm512_srl_epi16(v[i], sh), m2);
                                let k = _mm512_test_epi8_mask(hmask[i], bit);
                                store_w(&mut qv[s], i, _mm512_mask_add_epi8(q2, k, q2, third));
                            }
                        }
                    }
                }
                F_IQ4XS => {
                    // d, scales_h (u16), scales_l (4 bytes), qs (128): `scale_iq4xs`.
                    let h0 = _mm512_i32gather_epi32::<1>(vidx, p.cast());
                    let sl = _mm512_i32gather_epi32::<1>(vidx, p.add(4).cast());
                    let d = f16_lo(h0);
                    for s in 0..8 {
                        let low =
                            _mm512_and_si512(srl(sl, (8 * (s / 2) + 4 * (s % 2)) as i32), m15);
                        let high = _mm512_and_si512(srl(h0, 16 + 2 * s as i32), m3);
                        let ls =
                            _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), k32);
                        store(&mut sc[s], scaled(d, ls));
                        // Elements 0..16 in the low nibbles of qs `16s..16s + 16`, the rest in
                        // the high ones; code book values + 128.
                        let v = transpose16(p.add(8 + 16 * s), &offs);
                        for (j, vj) in v.into_iter().enumerate() {
                            let lo = _mm512_and_si512(vj, lo4);
                            let hi = _mm512_and_si512(_mm512_srli_epi16(vj, 4), lo4);
                            store_w(&mut qv[s], j, _mm512_shuffle_epi8(table, lo));
                            store_w(&mut qv[s], j + 4, _mm512_shuffle_epi8(table, hi));
                        }
                    }
                }
                _ => unreachable!("not a K-quant"),
            }
        }
    }
}

/// Byte mask of the 5th bits: byte `4r + i` is set when bit `first + i` of lane `r` of `qh` is
/// (the layout of a packed vector `w[j]`, whose lane `r` holds 4 consecutive elements of row `r`).
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn fifth_bits(qh: __m512i, first: i32) -> u64 {
    let nibble = _mm512_and_si512(
        _mm512_srl_epi32(qh, _mm_cvtsi32_si128(first)),
        _mm512_set1_epi32(0xF),
    );
    // The nibble in each of the lane's 4 bytes; byte `i` tests bit `i`.
    let spread = _mm512_mullo_epi32(nibble, _mm512_set1_epi32(0x0101_0101));
    _mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x0804_0201))
}

/// Loads 16 bytes at `p + offs[r]` for the 16 rows and transposes them by dwords: vector `j`
/// lane `r` = bytes `4j..4j + 4` of row `r`.
///
/// # Safety
/// Each `p + offs[r]` has 16 readable bytes.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn transpose16(p: *const u8, offs: &[i32; 16]) -> [__m512i; 4] {
    // Y_g lane 4j + i = Z_g lane 4i + j, where Z_g lane 4i + j = dword j of row 4g + i.
    let t = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let mut y = [_mm512_setzero_si512(); 4];
    for (g, yg) in y.iter_mut().enumerate() {
        // SAFETY: forwarded from the caller.
        let z = unsafe {
            let r0 = p.add(offs[4 * g] as usize).cast::<__m128i>();
            let r1 = p.add(offs[4 * g + 1] as usize).cast::<__m128i>();
            let r2 = p.add(offs[4 * g + 2] as usize).cast::<__m128i>();
            let r3 = p.add(offs[4 * g + 3] as usize).cast::<__m128i>();
            let v = _mm512_castsi128_si512(_mm_loadu_si128(r0));
            let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(r1));
            let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(r2));
            _mm512_inserti32x4::<3>(v, _mm_loadu_si128(r3))
        };
        *yg = _mm512_permutexvar_epi32(t, z);
    }
    // 4 x 4 transpose of 128-bit lanes: out_j lane block g = Y_g lane block j.
    let a = _mm512_shuffle_i32x4::<0x44>(y[0], y[1]);
    let b = _mm512_shuffle_i32x4::<0xEE>(y[0], y[1]);
    let c = _mm512_shuffle_i32x4::<0x44>(y[2], y[3]);
    let d = _mm512_shuffle_i32x4::<0xEE>(y[2], y[3]);
    [
        _mm512_shuffle_i32x4::<0x88>(a, c),
        _mm512_shuffle_i32x4::<0xDD>(a, c),
        _mm512_shuffle_i32x4::<0x88>(b, d),
        _mm512_shuffle_i32x4::<0xDD>(b, d),
    ]
}

/// The 4 activation bytes of elements `4j..4j + 4` of block `a`, broadcast.
#[inline(always)]
fn act4(a: &ActBlock, j: usize) -> __m512i {
    let v = i32::from_le_bytes([
        a.q[4 * j] as u8,
        a.q[4 * j + 1] as u8,
        a.q[4 * j + 2] as u8,
        a.q[4 * j + 3] as u8,
    ]);
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe { _mm512_set1_epi32(v) }
}

/// Outputs of `P` packed panels (16 rows each) for `T` tokens (`acts` at token 0's first block,
/// `nb` blocks per token): per panel, one vector of its 16 rows per token. With two panels each
/// activation broadcast serves two `vpdpbusd` (one load per 2 instead of one per instruction);
/// their 4-token tiles keep the 8 integer and 8 float accumulators in registers (6 tokens spill
/// and measured slower).
///
/// # Safety
/// `acts` is valid for `T * nb` blocks; each `quants[p]` holds the row length's `nb` blocks and
/// `scales[p]` their [`scale_vectors`] each.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn tile<const F: u8, const P: usize, const T: usize>(
    quants: [&[Quants]; P],
    scales: [&[Lanes]; P],
    acts: *const ActBlock,
    offs: *const [i32; 2],
    nb: usize,
) -> [[__m512; T]; P] {
    // SAFETY: forwarded.
    let c = |l: usize| unsafe { chain::<F, P, T>(quants, scales, acts, offs, nb, l) };
    let add = |mut a: [[__m512; T]; P], b: [[__m512; T]; P]| {
        for p in 0..P {
            for t in 0..T {
                a[p][t] = _mm512_add_ps(a[p][t], b[p][t]);
            }
        }
        a
    };
    let s02 = add(c(0), c(2));
    add(s02, add(c(1), c(3)))
}

/// Chain `l` of [`tile`]: the blocks `l, l + 4, l + 8, ...` accumulated in order.
///
/// # Safety
/// As for [`tile`].
#[inline]
#[allow(clippy::needless_range_loop)] // `p`, `t` index the sums, accumulators and inputs alike
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn chain<const F: u8, const P: usize, const T: usize>(
    quants: [&[Quants]; P],
    scales: [&[Lanes]; P],
    acts: *const ActBlock,
    offs: *const [i32; 2],
    nb: usize,
    l: usize,
) -> [[__m512; T]; P] {
    // SAFETY: `t * nb + b < T * nb` for every `t < T`, block `b < nb`.
    let act = |t: usize, b: usize| unsafe { &*acts.add(t * nb + b) };
    // SAFETY: as for `act`; read only for the formats with an offset, whose `offs` has an entry
    // per token and block of the tile.
    let off = |t: usize, b: usize, h: usize| unsafe { (*offs.add(t * nb + b))[h] };
    let sv = scale_vectors(F);
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    let mut b = l;
    while b < nb {
        // The first chain brings the tile's activation blocks `PF_ACTS` ahead into L1, for it
        // and the other three (a wide matrix's token chunk is larger than L2).
        if l == 0 && b + PF_ACTS + 4 <= nb {
            for t in 0..T {
                for k in 0..4 {
                    // SAFETY: `t * nb + b + PF_ACTS + k < T * nb`: inside the tile's blocks;
                    // a prefetch has no side effects.
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T0>(acts.add(t * nb + b + PF_ACTS + k).cast())
                    };
                }
            }
        }
        // SAFETY: each entry is 16 aligned f32s.
        let scale =
            |p: usize, i: usize| unsafe { _mm512_load_ps(scales[p][sv * b + i].0.as_ptr()) };
        // The integer dot products of vectors `js` with each token, offset by its activation
        // sum `part` (see [`ActBlock::sum`]) times the format's offset: the sums start from the
        // negated offset ([`offsets`]; half `part` of a split format, else entry 0). Each is
        // converted to f32 where it is used (converting all first costs registers).
        let dots = |js: Range<usize>, part: usize| -> [[__m512i; T]; P] {
            let mut isum = [[_mm512_setzero_si512(); T]; P];
            if offset_shift(F) != 0 {
                for t in 0..T {
                    let o = _mm512_set1_epi32(off(t, b, part % 2));
                    for sum in &mut isum {
                        sum[t] = o;
                    }
                }
            }
            for j in js {
                let mut w = [_mm512_setzero_si512(); P];
                for (wp, q) in w.iter_mut().zip(quants) {
                    // SAFETY: `w[j]` is 64 aligned bytes.
                    *wp = unsafe { _mm512_load_si512(q[b].w[j].as_ptr().cast()) };
                }
                for t in 0..T {
                    let a = act4(act(t, b), j);
                    for p in 0..P {
                        isum[p][t] = _mm512_dpbusd_epi32(isum[p][t], w[p], a);
                    }
                }
            }
            isum
        };
        if is_split(F) {
            // Per half: its own dot product and scale, then (Q2_K) the halves' minimums.
            for h in 0..2 {
                let r = dots(4 * h..4 * h + 4, h);
                for t in 0..T {
                    let ad = _mm512_set1_ps(act(t, b).d);
                    for p in 0..P {
                        let s = _mm512_mul_ps(scale(p, h), ad);
                        let x = _mm512_cvtepi32_ps(r[p][t]);
                        acc[p][t] = _mm512_fmadd_ps(x, s, acc[p][t]);
                    }
                }
            }
            if has_min(F) {
                for h in 0..2 {
                    for t in 0..T {
                        let a = act(t, b);
                        let ad = _mm512_set1_ps(a.d);
                        let sum = _mm512_set1_ps(a.sum(h) as f32);
                        for p in 0..P {
                            let s = _mm512_mul_ps(scale(p, 2 + h), ad);
                            acc[p][t] = _mm512_fmadd_ps(sum, s, acc[p][t]);
                        }
                    }
                }
            }
        } else {
            let r = dots(0..8, 2);
            for t in 0..T {
                let a = act(t, b);
                let ad = _mm512_set1_ps(a.d);
                for p in 0..P {
                    let s = _mm512_mul_ps(scale(p, 0), ad);
                    let x = _mm512_cvtepi32_ps(r[p][t]);
                    acc[p][t] = _mm512_fmadd_ps(x, s, acc[p][t]);
                    if has_min(F) {
                        acc[p][t] = _mm512_fmadd_ps(scale(p, 1), _mm512_set1_ps(a.sx), acc[p][t]);
                    }
                }
            }
        }
        b += 4;
    }
    acc
}
