//! AVX-512 VNNI matrix-matrix kernel for many tokens (prefill, batched decode) over the 32-element
//! block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL.
//!
//! A task packs 16 rows at a time ("a panel") into a thread-local buffer: per 32-element block,
//! eight u8 vectors whose lane `r` holds 4 consecutive quants of row `r` (block element `4j..4j+4`
//! in vector `j`), plus the 16 rows' block scales as f32. The panel is then reused for every token:
//! `vpdpbusd` of vector `j` with token `t`'s 4 activation bytes broadcast gives 16 rows' partial
//! sums at once, so no horizontal reductions are needed and each activation load serves 16 rows.
//! The activations come as compact [`ActBlock`]s (one cache line per block and token), and tokens
//! go in chunks of [`TOKEN_CHUNK`] so that a chunk's blocks stay in L2 while the task's panels
//! pass over them. Packing uses plain loads and dword transposes (one gather per block for the
//! 16 rows' scales); the next panel's bytes are prefetched while one is packed.
//!
//! **Same arithmetic as the 4-row kernel.** Each output element is accumulated exactly as in
//! [`super::avx512`]: the exact integer block dot product, converted to f32 and added with one
//! FMA by `d_w * d_x` (then `m_w * d_x * sum(q_x)` for Q4_1 and Q5_1), into one of four f32 chains by block
//! index modulo 4 (in increasing block order), and the chains summed as `(c0 + c2) + (c1 + c3)`.
//! So a token's outputs are bit-identical whichever kernel ran it, which keeps `matmul`
//! batch-invariant when the batch size picks this kernel.

// The AVX-512 intrinsics are stable since Rust 1.89; the workspace toolchain is 1.95.
#![allow(clippy::incompatible_msrv)]

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::offset_of;
use std::ops::Range;

use super::act::ActBlock;
use super::avx512::{
    F_IQ4NL, F_Q4_0, F_Q4_1, F_Q5_0, F_Q5_1, F_Q8_0, IQ4_TABLE, has_min, offset_shift,
};
use super::format::Fmt;
use super::{Layout, RowsOut, WeightMatrix};
use weight_cache::quant::{BlockQ5_0, BlockQ5_1};

/// Rows per panel (one per 32-bit lane of a 512-bit vector).
pub(crate) const PANEL_ROWS: usize = 16;
/// Smallest token count this kernel is used for; fewer tokens use the 4-row kernel, whose weight
/// decoding needs no packing pass (measured crossover on Zen 4).
pub(crate) const PANEL_MIN_TOKENS: usize = 16;

/// Most tokens multiplied per panel packing (see `panel_rows`): 128 tokens of a 1536-column
/// input are 384 KiB of activation blocks, well inside a 1 MiB L2. Measured on Zen 4 (2 threads,
/// Q4_1 1536x576 / 576x1536, Q8_0 4096x576): against 64, 6-20% faster at 100 tokens (one packing
/// instead of two), 3-10% at 200 and 512.
const TOKEN_CHUNK: usize = 128;

/// One packed block of a panel.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct PackedBlock {
    /// `w[j]` lane `r`: the u8 quants of elements `4j..4j + 4` of row `r` (Q8_0 and IQ4_NL:
    /// offset by 128).
    w: [[u8; 64]; 8],
    /// Row scales.
    d: [f32; 16],
    /// Q4_1, Q5_1: row minimums.
    m: [f32; 16],
}

const ZERO_BLOCK: PackedBlock = PackedBlock {
    w: [[0; 64]; 8],
    d: [0.0; 16],
    m: [0.0; 16],
};

thread_local! {
    static PANEL: RefCell<Vec<PackedBlock>> = const { RefCell::new(Vec::new()) };
}

/// Whether this kernel handles `fmt` at `n` tokens.
pub(crate) fn applies(fmt: Fmt, n: usize) -> bool {
    n >= PANEL_MIN_TOKENS
        && matches!(
            fmt,
            Fmt::Q4_0 | Fmt::Q4_1 | Fmt::Q5_0 | Fmt::Q5_1 | Fmt::Q8_0 | Fmt::IQ4NL
        )
}

/// Rows `rows` x all `n` tokens.
///
/// # Safety
/// The CPU supports the features enabled here; `acts` holds `n` tokens quantized for `w.cols`;
/// `fmt` is one of [`applies`]'s formats and is `w`'s format (of a packed matrix: one with a
/// packed layout, its length checked, `rows.start` a multiple of 16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn quant_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActBlock],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    match fmt {
        Fmt::Q4_0 => panel_rows::<F_Q4_0>(fmt, w, acts, n, rows, out),
        Fmt::Q4_1 => panel_rows::<F_Q4_1>(fmt, w, acts, n, rows, out),
        Fmt::Q8_0 => panel_rows::<F_Q8_0>(fmt, w, acts, n, rows, out),
        Fmt::Q5_0 => panel_rows::<F_Q5_0>(fmt, w, acts, n, rows, out),
        Fmt::Q5_1 => panel_rows::<F_Q5_1>(fmt, w, acts, n, rows, out),
        Fmt::IQ4NL => panel_rows::<F_IQ4NL>(fmt, w, acts, n, rows, out),
        _ => unreachable!("panel kernel formats are checked by `applies`"),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn panel_rows<const F: u8>(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActBlock],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    if w.layout == Layout::Rows16 {
        return packed_impl::<F>(fmt, w, acts, n, rows, out);
    }
    let rb = fmt.row_bytes(w.cols);
    let nblocks = w.cols / 32;
    assert!(acts.len() >= n * nblocks && rows.end <= w.rows && w.data.len() >= w.rows * rb);
    assert!(!rows.is_empty() && PANEL_ROWS * rb < i32::MAX as usize);
    let end = rows.end;
    panel_loop::<F>(nblocks, acts, n, rows, out, &mut |g, panel| {
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
            pack::<F>(base.add(r0 * rb), next, offs, rb, panel);
        }
    });
}

/// [`panel_rows`] over a matrix already in the row-interleaved layout of
/// [`super::packed::PackedWeights`] (`rows.start` a multiple of 16): each 16-row group is
/// unpacked into the panel (no gathers or transposes), then multiplied the same way.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn packed_impl<const F: u8>(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActBlock],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    let bb = super::packed::block_bytes(fmt).unwrap_or(0);
    let nblocks = w.cols / 32;
    let gb = nblocks * bb;
    assert!(
        acts.len() >= n * nblocks && rows.end <= w.rows && rows.start.is_multiple_of(PANEL_ROWS)
    );
    assert!(!rows.is_empty() && w.data.len() >= w.rows.div_ceil(PANEL_ROWS) * gb);
    panel_loop::<F>(nblocks, acts, n, rows, out, &mut |g, panel| {
        let group = &w.data[g / PANEL_ROWS * gb..][..gb];
        // SAFETY: `group` holds the group's `nblocks` packed blocks of `bb` bytes.
        unsafe { unpack::<F>(group, bb, panel) };
    });
}

/// Unpacks one packed 16-row group (`panel.len()` blocks of `bb` bytes) into `panel`.
///
/// # Safety
/// `group` holds `panel.len()` packed blocks of `bb` bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack<const F: u8>(group: &[u8], bb: usize, panel: &mut [PackedBlock]) {
    let lo4 = _mm512_set1_epi8(0x0F);
    for (b, pb) in panel.iter_mut().enumerate() {
        let p = group[b * bb..(b + 1) * bb].as_ptr();
        // SAFETY: every load is inside block `b`; the stores fill `pb`'s aligned fields.
        unsafe {
            let at = if F == F_Q8_0 {
                for j in 0..8 {
                    let v = _mm512_loadu_si512(p.add(64 * j).cast());
                    _mm512_store_si512(pb.w[j].as_mut_ptr().cast(), v);
                }
                512
            } else {
                for c in 0..4 {
                    let v = _mm512_loadu_si512(p.add(64 * c).cast());
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    _mm512_store_si512(pb.w[c].as_mut_ptr().cast(), _mm512_and_si512(v, lo4));
                    _mm512_store_si512(pb.w[c + 4].as_mut_ptr().cast(), hi);
                }
                256
            };
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(at).cast()));
            _mm512_store_ps(pb.d.as_mut_ptr(), d);
            if has_min(F) {
                let m = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(at + 32).cast()));
                _mm512_store_ps(pb.m.as_mut_ptr(), m);
            }
        }
    }
}

/// The token and row loops shared by both sources: for each token chunk and each 16-row group
/// `g` of `rows`, `pack(g, panel)` fills the panel, then every tile of the chunk's tokens is
/// multiplied and emitted.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn panel_loop<const F: u8>(
    nblocks: usize,
    acts: &[ActBlock],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
    pack: &mut dyn FnMut(usize, &mut [PackedBlock]),
) {
    PANEL.with(|p| {
        let mut panel = p.borrow_mut();
        if panel.len() < nblocks {
            panel.resize(nblocks, ZERO_BLOCK);
        }
        let panel = &mut panel[..nblocks];
        // Token chunks small enough that their activations stay in L2 while every panel of
        // the task's rows passes over them (a panel is re-packed per chunk).
        // Equal chunks in whole 8-token tiles (a 200-token batch: 104 + 96, not 100 + 100 with
        // a 4-token tail tile each).
        let chunk = n.div_ceil(n.div_ceil(TOKEN_CHUNK)).next_multiple_of(8);
        for tc in (0..n).step_by(chunk) {
            let t_end = (tc + chunk).min(n);
            for g in rows.clone().step_by(PANEL_ROWS) {
                pack(g, panel);
                let live = (rows.end - g).min(PANEL_ROWS);
                let mut emit = |t: usize, v: __m512| {
                    let mut o = [0.0f32; 16];
                    // SAFETY: `o` has room for 16 floats.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
                    out.set_run(t, g, &o[..live]);
                };
                let mut t0 = tc;
                while t0 < t_end {
                    let left = t_end - t0;
                    let ap = acts[t0 * nblocks..].as_ptr();
                    // SAFETY: `ap` has at least the tile's tokens (`left` of them), `nblocks` blocks each.
                    unsafe {
                        if left >= 8 {
                            for (t, v) in tile::<F, 8>(panel, ap, nblocks).into_iter().enumerate() {
                                emit(t0 + t, v);
                            }
                            t0 += 8;
                        } else if left >= 4 {
                            for (t, v) in tile::<F, 4>(panel, ap, nblocks).into_iter().enumerate() {
                                emit(t0 + t, v);
                            }
                            t0 += 4;
                        } else if left >= 2 {
                            for (t, v) in tile::<F, 2>(panel, ap, nblocks).into_iter().enumerate() {
                                emit(t0 + t, v);
                            }
                            t0 += 2;
                        } else {
                            for (t, v) in tile::<F, 1>(panel, ap, nblocks).into_iter().enumerate() {
                                emit(t0 + t, v);
                            }
                            t0 += 1;
                        }
                    }
                }
            }
        }
    });
}

/// Packs the 16 rows at `base + offs[k]` into `panel` (one entry per block), prefetching the
/// first `next.1` rows (at most 16) of `rb` bytes at `next.0`.
///
/// # Safety
/// Each `base + offs[k]` is the start of a full encoded row of `panel.len()` blocks; `next.0` is
/// valid for `next.1 * rb` bytes (prefetches only).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn pack<const F: u8>(
    base: *const u8,
    next: (*const u8, usize),
    offs: [i32; 16],
    rb: usize,
    panel: &mut [PackedBlock],
) {
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
            _mm512_store_ps(pb.d.as_mut_ptr(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
            if has_min(F) {
                let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
                _mm512_store_ps(pb.m.as_mut_ptr(), m);
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

/// Byte mask of the 5th bits: byte `4r + i` is set when bit `first + i` of lane `r` of `qh` is
/// (the layout of a packed vector `w[j]`, whose lane `r` holds 4 consecutive elements of row `r`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
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

/// Outputs of the packed panel for `T` tokens (`acts` at token 0's first block, `nb` blocks per
/// token): one vector of the 16 rows per token.
///
/// # Safety
/// `acts` is valid for `T * nb` blocks; `panel` holds the row length's `nb` blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const F: u8, const T: usize>(
    panel: &[PackedBlock],
    acts: *const ActBlock,
    nb: usize,
) -> [__m512; T] {
    // SAFETY: forwarded.
    let c = |l: usize| unsafe { chain::<F, T>(panel, acts, nb, l) };
    let add = |a: [__m512; T], b: [__m512; T]| std::array::from_fn(|t| _mm512_add_ps(a[t], b[t]));
    let s02 = add(c(0), c(2));
    add(s02, add(c(1), c(3)))
}

/// Chain `l` of [`tile`]: the blocks `l, l + 4, l + 8, ...` accumulated in order.
///
/// # Safety
/// As for [`tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn chain<const F: u8, const T: usize>(
    panel: &[PackedBlock],
    acts: *const ActBlock,
    nb: usize,
    l: usize,
) -> [__m512; T] {
    // SAFETY: `t * nb + b < T * nb` for every `t < T`, block `b < nb`.
    let act = |t: usize, b: usize| unsafe { &*acts.add(t * nb + b) };
    let mut acc = [_mm512_setzero_ps(); T];
    let mut b = l;
    while b < panel.len() {
        let pb = &panel[b];
        let mut isum = [_mm512_setzero_si512(); T];
        for j in 0..8 {
            // SAFETY: `w[j]` is 64 aligned bytes.
            let wj = unsafe { _mm512_load_si512(pb.w[j].as_ptr().cast()) };
            for (t, s) in isum.iter_mut().enumerate() {
                *s = _mm512_dpbusd_epi32(*s, wj, act4(act(t, b), j));
            }
        }
        // SAFETY: `d` and `m` are 16 aligned f32s.
        let (d, m) = unsafe { (_mm512_load_ps(pb.d.as_ptr()), _mm512_load_ps(pb.m.as_ptr())) };
        for (t, c) in acc.iter_mut().enumerate() {
            let a = act(t, b);
            let mut r = isum[t];
            if offset_shift(F) != 0 {
                let offset = _mm512_set1_epi32(a.sq);
                let shift = _mm_cvtsi32_si128(offset_shift(F));
                r = _mm512_sub_epi32(r, _mm512_sll_epi32(offset, shift));
            }
            let s = _mm512_mul_ps(d, _mm512_set1_ps(a.d));
            *c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), s, *c);
            if has_min(F) {
                *c = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx), *c);
            }
        }
        b += 4;
    }
    acc
}
