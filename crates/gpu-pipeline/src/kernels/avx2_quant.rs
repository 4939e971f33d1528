//! AVX2 + FMA + F16C kernels (no AVX-512) for the integer-quantized formats (Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS).
//!
//! The unit of work is the AVX-512 kernels' (see [`super::avx512`]): 4 rows x 4 consecutive
//! 32-element blocks ("a quad") x up to 4 tokens, in two 256-bit halves (blocks 0 and 1, blocks 2
//! and 3), so the activation quads ([`ActQuad`]) are read as they are laid out:
//! - per row and half, the quants of elements 0..16 of the two blocks are one u8 vector, those of
//!   elements 16..32 another;
//! - `vpmaddubsw` + `vpmaddwd` give 8 partial sums of 4 products each; for Q8_0 and IQ4, whose
//!   quants are signed 8-bit (the unsigned `q + 128` would saturate `vpmaddubsw`), the signs are
//!   moved onto the activations first (`|w| * sign(x, w)`), which gives the same exact integer as
//!   the reference's `sum(q * x) - 128 * sum(x)`;
//! - three rounds of `vphaddd` over the 4 rows give the exact integer dot product of block `L` of
//!   row `k` in lane `4L + k` (`L` 0..2 of the first half, 2..4 of the second);
//! - the block scales are applied in f32 with the same FMAs in the same order as the scalar
//!   reference and the AVX-512 kernels (one chain per lane, i.e. per row and block index modulo
//!   4), so every backend gives the same bits.

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::{ActQuad, quads_per_token};
use super::avx512::{
    F_IQ4NL, F_IQ4XS, F_Q2K, F_Q3K, F_Q4_0, F_Q4_1, F_Q4K, F_Q5_0, F_Q5_1, F_Q5K, F_Q6K, F_Q8_0,
    PF_AHEAD, has_min, is_split, offset_shift, prefetch_plan, prefetch_step,
};
use super::format::Fmt;
use super::{RowsOut, WeightMatrix};
use std::mem::offset_of;
use weight_cache::quant::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0,
    BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, KVALUES_IQ4NL,
};

/// Whether the format's quants are decoded as signed bytes (`q - 128`), see the module docs.
const fn is_signed(f: u8) -> bool {
    offset_shift(f) == 7
}

/// One quad of 4 rows, decoded. Index `[k][h]`: row `k`, half `h` (blocks `2h`, `2h + 1`).
#[derive(Clone, Copy)]
struct Quad {
    /// Elements 0..16 of the half's two blocks (block `2h` in the low 128 bits).
    w0: [[__m256i; 2]; 4],
    /// Elements 16..32.
    w1: [[__m256i; 2]; 4],
    /// Weight scale per lane `4L + k` (split formats: of elements 0..16).
    d: [__m256; 2],
    /// Formats with a minimum: the additive term; split formats: the scale of elements 16..32.
    m: [__m256; 2],
    /// Q2_K: the minimums of elements 0..16 and 16..32.
    mins: [[__m256; 2]; 2],
}

/// The scale fields of a quad before conversion, lane `4L + k`.
struct Lanes {
    /// f16 bits of each lane's scale (legacy formats) or its row's super-block scale.
    d: [u16; 16],
    /// f16 bits of each lane's minimum (Q4_1, Q5_1).
    m: [u16; 16],
}

impl Lanes {
    const ZERO: Self = Self {
        d: [0; 16],
        m: [0; 16],
    };
}

/// 8 f16 values to f32.
///
/// # Safety
/// The CPU supports the features enabled here.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x8(v: &[u16]) -> __m256 {
    let v: &[u16; 8] = v.try_into().unwrap_or(&[0; 8]);
    // SAFETY: `v` is 16 readable bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(v.as_ptr().cast()) })
}

/// Both halves of 16 f16 lanes as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x16(v: &[u16; 16]) -> [__m256; 2] {
    [f16x8(&v[..8]), f16x8(&v[8..])]
}

/// The 16 bytes at `p + off` if `valid`, else zeros.
///
/// # Safety
/// When `valid`, `p + off` has 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ld16(p: *const u8, off: usize, valid: bool) -> __m128i {
    if valid {
        // SAFETY: forwarded from the caller.
        unsafe { _mm_loadu_si128(p.add(off).cast()) }
    } else {
        _mm_setzero_si128()
    }
}

/// The little-endian u16 at `p + off`.
///
/// # Safety
/// `p + off` has 2 readable bytes.
#[inline]
unsafe fn u16_at(p: *const u8, off: usize) -> u16 {
    // SAFETY: forwarded from the caller.
    u16::from_le(unsafe { std::ptr::read_unaligned(p.add(off).cast::<u16>()) })
}

/// Low and high nibbles of every byte of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(v: __m256i) -> (__m256i, __m256i) {
    let lo4 = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(v, lo4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), lo4),
    )
}

/// Dword `L` of `g[k]` into lane `4L + k` (`L` 0..2 in the first half, 2..4 in the second).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose4(g: [__m128i; 4]) -> [__m256i; 2] {
    let lo01 = _mm_unpacklo_epi32(g[0], g[1]);
    let lo23 = _mm_unpacklo_epi32(g[2], g[3]);
    let hi01 = _mm_unpackhi_epi32(g[0], g[1]);
    let hi23 = _mm_unpackhi_epi32(g[2], g[3]);
    [
        _mm256_set_m128i(
            _mm_unpackhi_epi64(lo01, lo23),
            _mm_unpacklo_epi64(lo01, lo23),
        ),
        _mm256_set_m128i(
            _mm_unpackhi_epi64(hi01, hi23),
            _mm_unpacklo_epi64(hi01, hi23),
        ),
    ]
}

/// The f16 in bytes `2w, 2w + 1` of dword `j` of each of the 4 rows' `heads` as f32, lane
/// `4L + k` = row `k`'s (the same in both halves).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn row_f16(heads: &[__m128i; 4], j: usize, w: i8) -> __m256 {
    let lo = _mm_unpacklo_epi32(heads[0], heads[1]);
    let lo23 = _mm_unpacklo_epi32(heads[2], heads[3]);
    let hi = _mm_unpackhi_epi32(heads[0], heads[1]);
    let hi23 = _mm_unpackhi_epi32(heads[2], heads[3]);
    // Dword `k` = dword `j` of row `k`.
    let col = match j {
        0 => _mm_unpacklo_epi64(lo, lo23),
        1 => _mm_unpackhi_epi64(lo, lo23),
        2 => _mm_unpacklo_epi64(hi, hi23),
        _ => _mm_unpackhi_epi64(hi, hi23),
    };
    let b = 2 * w;
    let idx = _mm_setr_epi8(
        b,
        b + 1,
        b + 4,
        b + 5,
        b + 8,
        b + 9,
        b + 12,
        b + 13,
        b,
        b + 1,
        b + 4,
        b + 5,
        b + 8,
        b + 9,
        b + 12,
        b + 13,
    );
    _mm256_cvtph_ps(_mm_shuffle_epi8(col, idx))
}

/// `d * v` per lane for the integer lanes `v`, as `d * f32::from(v)` computes it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scaled_v(d: __m256, v: __m256i) -> __m256 {
    _mm256_mul_ps(d, _mm256_cvtepi32_ps(v))
}

/// Q4_K/Q5_K: `d * sc` and `-(dmin * m)` (`scale_min_k4`) of sub-blocks `4hq + L` of the
/// super-blocks at `rowp[k] + at`, lane `4L + k`.
///
/// # Safety
/// Each `rowp[k] + at` has a 16-byte header (d, dmin, 12 scale bytes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kq4_scales(rowp: &[*const u8; 4], at: usize, hq: usize) -> ([__m256; 2], [__m256; 2]) {
    // SAFETY: forwarded from the caller.
    let heads = rowp.map(|p| unsafe { _mm_loadu_si128(p.add(at).cast()) });
    // Dword `L`: scale bytes `q[L], q[L + 4], q[L + 8]` (header bytes 4 + ...).
    let idx = _mm_setr_epi8(4, 8, 12, -1, 5, 9, 13, -1, 6, 10, 14, -1, 7, 11, 15, -1);
    let x = transpose4(heads.map(|h| _mm_shuffle_epi8(h, idx)));
    let bits = |v: __m256i, mask: i32| _mm256_and_si256(v, _mm256_set1_epi32(mask));
    let (d, dmin) = (row_f16(&heads, 0, 0), row_f16(&heads, 0, 1));
    let neg = _mm256_set1_ps(-0.0);
    let one = |x: __m256i| {
        let (sc, m) = if hq == 0 {
            (bits(x, 63), bits(_mm256_srli_epi32::<8>(x), 63))
        } else {
            (
                _mm256_or_si256(
                    bits(_mm256_srli_epi32::<16>(x), 0xF),
                    bits(_mm256_srli_epi32::<2>(x), 0x30),
                ),
                _mm256_or_si256(
                    bits(_mm256_srli_epi32::<20>(x), 0xF),
                    bits(_mm256_srli_epi32::<10>(x), 0x30),
                ),
            )
        };
        (scaled_v(d, sc), _mm256_xor_ps(scaled_v(dmin, m), neg))
    };
    let (a, b) = (one(x[0]), one(x[1]));
    ([a.0, b.0], [a.1, b.1])
}

/// Q6_K: `d * sc` of scales `8hq + 2L` (elements 0..16) and `8hq + 2L + 1` of the super-blocks
/// at `rowp[k] + at`, lane `4L + k`.
///
/// # Safety
/// Each `rowp[k] + at` is a whole Q6_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_scales(rowp: &[*const u8; 4], at: usize, hq: usize) -> ([__m256; 2], [__m256; 2]) {
    let (sc_at, d_at) = (offset_of!(BlockQ6K, scales), offset_of!(BlockQ6K, d));
    // SAFETY: forwarded from the caller (scales, and the 16 bytes ending with d).
    let (scales, tails) = unsafe {
        (
            rowp.map(|p| _mm_loadu_si128(p.add(at + sc_at).cast())),
            rowp.map(|p| _mm_loadu_si128(p.add(at + d_at + 2 - 16).cast())),
        )
    };
    let d = row_f16(&tails, 3, 1);
    let b = 8 * hq as i8;
    // Scale `b + 2L + e` in the top byte of dword `L`, then sign-extended.
    let one = |e: i8| {
        let idx = _mm_setr_epi8(
            -1,
            -1,
            -1,
            b + e,
            -1,
            -1,
            -1,
            b + 2 + e,
            -1,
            -1,
            -1,
            b + 4 + e,
            -1,
            -1,
            -1,
            b + 6 + e,
        );
        transpose4(scales.map(|s| _mm_shuffle_epi8(s, idx)))
            .map(|v| scaled_v(d, _mm256_srai_epi32::<24>(v)))
    };
    (one(0), one(1))
}

/// Q2_K: `d * sc` of elements 0..16 and 16..32, and `-(dmin * m)` of both, of sub-blocks
/// `4hq + L` of the super-blocks at `rowp[k] + at`, lane `4L + k` (scale byte `2(4hq + L) + e`
/// of half `e`: scale in its low nibble, min in its high one).
///
/// # Safety
/// Each `rowp[k] + at` is a whole Q2_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2k_scales(
    rowp: &[*const u8; 4],
    at: usize,
    hq: usize,
) -> ([__m256; 2], [__m256; 2], [[__m256; 2]; 2]) {
    let (sc_at, end) = (offset_of!(BlockQ2K, scales), size_of::<BlockQ2K>());
    // SAFETY: forwarded from the caller (the scales, and the 16 bytes ending the block).
    let (heads, tails) = unsafe {
        (
            rowp.map(|p| _mm_loadu_si128(p.add(at + sc_at).cast())),
            rowp.map(|p| _mm_loadu_si128(p.add(at + end - 16).cast())),
        )
    };
    // d and dmin are the last two words.
    let (d, dmin) = (row_f16(&tails, 3, 0), row_f16(&tails, 3, 1));
    // Dword `L`: scale bytes `8hq + 2L` and `8hq + 2L + 1`.
    let b = 8 * hq as i8;
    let idx = _mm_setr_epi8(
        b,
        b + 1,
        -1,
        -1,
        b + 2,
        b + 3,
        -1,
        -1,
        b + 4,
        b + 5,
        -1,
        -1,
        b + 6,
        b + 7,
        -1,
        -1,
    );
    let x = transpose4(heads.map(|h| _mm_shuffle_epi8(h, idx)));
    let m4 = _mm256_set1_epi32(0xF);
    let nib = |v: __m256i, shift: i32| {
        _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)), m4)
    };
    let neg = _mm256_set1_ps(-0.0);
    let min = |shift: i32| x.map(|v| _mm256_xor_ps(scaled_v(dmin, nib(v, shift)), neg));
    (
        x.map(|v| scaled_v(d, nib(v, 0))),
        x.map(|v| scaled_v(d, nib(v, 8))),
        [min(4), min(12)],
    )
}

/// Q3_K: `d * scale_k3(8hq + 2L + e)` of half `e` of sub-blocks `4hq + L` of the super-blocks at
/// `rowp[k] + at`, lane `4L + k`.
///
/// # Safety
/// Each `rowp[k] + at` is a whole Q3_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3k_scales(rowp: &[*const u8; 4], at: usize, hq: usize) -> ([__m256; 2], [__m256; 2]) {
    // The 16 bytes ending the block: 2 quant bytes, the 12 scale bytes `q`, d.
    let end = size_of::<BlockQ3K>();
    const _: () = assert!(offset_of!(BlockQ3K, scales) + 14 == size_of::<BlockQ3K>());
    // SAFETY: forwarded from the caller.
    let tails = rowp.map(|p| unsafe { _mm_loadu_si128(p.add(at + end - 16).cast()) });
    let d = row_f16(&tails, 3, 1);
    // Dword `L`: `q[2L], q[2L + 1]` (low bits of halves 0, 1), `q[8 + 2(L % 2)]`, `+ 1` (high).
    let idx = _mm_setr_epi8(2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 10, 11, 8, 9, 12, 13);
    let x = transpose4(tails.map(|t| _mm_shuffle_epi8(t, idx)));
    let srl = |v: __m256i, s: usize| _mm256_srl_epi32(v, _mm_cvtsi32_si128(s as i32));
    let mut out = [[_mm256_setzero_ps(); 2]; 2];
    for (e, o) in out.iter_mut().enumerate() {
        for (half, v) in x.into_iter().enumerate() {
            // Sub-blocks `L = 2 half, 2 half + 1`: high bits at `2 (2hq + L / 2)` of byte 2 + e.
            let low = _mm256_and_si256(srl(v, 8 * e + 4 * hq), _mm256_set1_epi32(0xF));
            let high = _mm256_and_si256(
                srl(v, 16 + 8 * e + 2 * (2 * hq + half)),
                _mm256_set1_epi32(3),
            );
            let sc = _mm256_sub_epi32(
                _mm256_or_si256(low, _mm256_slli_epi32::<4>(high)),
                _mm256_set1_epi32(32),
            );
            o[half] = scaled_v(d, sc);
        }
    }
    (out[0], out[1])
}

/// IQ4_XS: `d * scale_iq4xs(4hq + L)` of the super-blocks at `rowp[k] + at`, lane `4L + k`.
///
/// # Safety
/// Each `rowp[k] + at` has a 16-byte header (d, scales_h, scales_l, ...).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4xs_scales(rowp: &[*const u8; 4], at: usize, hq: usize) -> [__m256; 2] {
    // SAFETY: forwarded from the caller.
    let heads = rowp.map(|p| unsafe { _mm_loadu_si128(p.add(at).cast()) });
    let d = row_f16(&heads, 0, 0);
    // Dword `L`: `scales_l[2hq + L / 2]`, then the two bytes of `scales_h`.
    let (l0, l1) = (4 + 2 * hq as i8, 5 + 2 * hq as i8);
    let idx = _mm_setr_epi8(l0, 2, 3, -1, l0, 2, 3, -1, l1, 2, 3, -1, l1, 2, 3, -1);
    let x = transpose4(heads.map(|h| _mm_shuffle_epi8(h, idx)));
    // Lanes 0..4 are even `L` (low nibble), 4..8 odd (high nibble); the high bits of
    // sub-block `4hq + L` are bits `2(4hq + L)` of `scales_h`, at `8 + ..` in the dword.
    let low_shr = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    let h = 8 + 8 * hq as i32;
    [0, 1].map(|half| {
        let v = x[half];
        let hs = h + 4 * half as i32;
        let high_shr = _mm256_setr_epi32(hs, hs, hs, hs, hs + 2, hs + 2, hs + 2, hs + 2);
        let low = _mm256_and_si256(_mm256_srlv_epi32(v, low_shr), _mm256_set1_epi32(0xF));
        let high = _mm256_and_si256(_mm256_srlv_epi32(v, high_shr), _mm256_set1_epi32(3));
        let ls = _mm256_sub_epi32(
            _mm256_or_si256(low, _mm256_slli_epi32::<4>(high)),
            _mm256_set1_epi32(32),
        );
        scaled_v(d, ls)
    })
}

/// `0x10` in the bytes of elements 0..16 of a half (`lo` for its first block, `hi` for its
/// second) whose bit is set in the 16-bit masks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(lo: u16, hi: u16) -> __m256i {
    let v = _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16));
    let spread = _mm256_set_m128i(
        _mm_set_epi64x(0x0101_0101_0101_0101, 0),
        _mm_set_epi64x(0x0101_0101_0101_0101, 0),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let hit = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, spread), bit), bit);
    _mm256_and_si256(hit, _mm256_set1_epi8(0x10))
}

/// Decodes quad `q` (blocks `4q..4q + nvalid`) of the 4 rows at `rowp`.
///
/// # Safety
/// Each `rowp[k]` points at a full encoded row, `q` is a quad of that row and `nvalid` the
/// number of its blocks inside the row (4 for the 256-element formats).
#[inline]
#[allow(clippy::needless_range_loop)] // `k` indexes rows and lanes alike
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode<const F: u8>(rowp: &[*const u8; 4], q: usize, nvalid: usize) -> Quad {
    let z = _mm256_setzero_si256();
    let mut w0 = [[z; 2]; 4];
    let mut w1 = [[z; 2]; 4];
    let mut lanes = Lanes::ZERO;
    // SAFETY (whole body): the loads stay inside the quad's valid blocks of each row.
    unsafe {
        match F {
            F_Q4_0 | F_Q4_1 | F_IQ4NL => {
                let (bs, qs_at) = match F {
                    F_Q4_1 => (size_of::<BlockQ4_1>(), offset_of!(BlockQ4_1, qs)),
                    F_Q4_0 => (size_of::<BlockQ4_0>(), offset_of!(BlockQ4_0, qs)),
                    _ => (size_of::<BlockIQ4NL>(), offset_of!(BlockIQ4NL, qs)),
                };
                let table =
                    _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()));
                for k in 0..4 {
                    let p = rowp[k].add(q * 4 * bs);
                    for h in 0..2 {
                        let (b0, b1) = (2 * h, 2 * h + 1);
                        let v = _mm256_set_m128i(
                            ld16(p, bs * b1 + qs_at, b1 < nvalid),
                            ld16(p, bs * b0 + qs_at, b0 < nvalid),
                        );
                        let (lo, hi) = nibbles(v);
                        if F == F_IQ4NL {
                            w0[k][h] = _mm256_shuffle_epi8(table, lo);
                            w1[k][h] = _mm256_shuffle_epi8(table, hi);
                        } else {
                            (w0[k][h], w1[k][h]) = (lo, hi);
                        }
                    }
                    for l in 0..nvalid {
                        lanes.d[4 * l + k] = u16_at(p, bs * l);
                        if F == F_Q4_1 {
                            lanes.m[4 * l + k] = u16_at(p, bs * l + offset_of!(BlockQ4_1, m));
                        }
                    }
                }
            }
            F_Q8_0 => {
                let (bs, qs_at) = (size_of::<BlockQ8_0>(), offset_of!(BlockQ8_0, qs));
                for k in 0..4 {
                    let p = rowp[k].add(q * 4 * bs);
                    for h in 0..2 {
                        let (b0, b1) = (2 * h, 2 * h + 1);
                        let half = |e: usize| {
                            _mm256_set_m128i(
                                ld16(p, bs * b1 + qs_at + e, b1 < nvalid),
                                ld16(p, bs * b0 + qs_at + e, b0 < nvalid),
                            )
                        };
                        (w0[k][h], w1[k][h]) = (half(0), half(16));
                    }
                    for l in 0..nvalid {
                        lanes.d[4 * l + k] = u16_at(p, bs * l);
                    }
                }
            }
            F_Q5_0 | F_Q5_1 => {
                let (bs, qh_at, qs_at) = if F == F_Q5_0 {
                    let b = size_of::<BlockQ5_0>();
                    (b, offset_of!(BlockQ5_0, qh), offset_of!(BlockQ5_0, qs))
                } else {
                    let b = size_of::<BlockQ5_1>();
                    (b, offset_of!(BlockQ5_1, qh), offset_of!(BlockQ5_1, qs))
                };
                for k in 0..4 {
                    let p = rowp[k].add(q * 4 * bs);
                    let qh = |l: usize| {
                        if l < nvalid {
                            u32::from_le(std::ptr::read_unaligned(p.add(bs * l + qh_at).cast()))
                        } else {
                            0
                        }
                    };
                    for h in 0..2 {
                        let (b0, b1) = (2 * h, 2 * h + 1);
                        let v = _mm256_set_m128i(
                            ld16(p, bs * b1 + qs_at, b1 < nvalid),
                            ld16(p, bs * b0 + qs_at, b0 < nvalid),
                        );
                        let (lo, hi) = nibbles(v);
                        let (qh0, qh1) = (qh(b0), qh(b1));
                        let f0 = fifth_bits(qh0 as u16, qh1 as u16);
                        let f1 = fifth_bits((qh0 >> 16) as u16, (qh1 >> 16) as u16);
                        w0[k][h] = _mm256_or_si256(lo, f0);
                        w1[k][h] = _mm256_or_si256(hi, f1);
                    }
                    for l in 0..nvalid {
                        lanes.d[4 * l + k] = u16_at(p, bs * l);
                        if F == F_Q5_1 {
                            lanes.m[4 * l + k] = u16_at(p, bs * l + offset_of!(BlockQ5_1, m));
                        }
                    }
                }
            }
            F_IQ4XS => {
                // Sub-block `4h' + L` (`h'` = q % 2) is qs bytes `16(4h' + L)..+16`, nibble order
                // as IQ4_NL.
                let (blk, hq) = (q / 2, q % 2);
                let table =
                    _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()));
                for k in 0..4 {
                    let p = rowp[k].add(blk * size_of::<BlockIQ4XS>());
                    for h in 0..2 {
                        let at = offset_of!(BlockIQ4XS, qs) + 64 * hq + 32 * h;
                        let (lo, hi) = nibbles(_mm256_loadu_si256(p.add(at).cast()));
                        w0[k][h] = _mm256_shuffle_epi8(table, lo);
                        w1[k][h] = _mm256_shuffle_epi8(table, hi);
                    }
                }
            }
            F_Q2K | F_Q3K => {
                // Sub-block `4h' + L`: bits `2L..2L + 2` of qs bytes `32h'..+32`; Q3_K adds bit
                // `4h' + L` of hmask byte `e` as the third bit.
                let (blk, hq) = (q / 2, q % 2);
                let (block_bytes, qs_at) = if F == F_Q2K {
                    (size_of::<BlockQ2K>(), offset_of!(BlockQ2K, qs))
                } else {
                    (size_of::<BlockQ3K>(), offset_of!(BlockQ3K, qs))
                };
                let shr = [0, 1]
                    .map(|h| _mm256_set_m128i(_mm_set1_epi32(4 * h + 2), _mm_set1_epi32(4 * h)));
                let bit = |l: i32| 1i8 << (4 * hq as i32 + l);
                let bits = [0, 1].map(|h| {
                    _mm256_set_m128i(_mm_set1_epi8(bit(2 * h + 1)), _mm_set1_epi8(bit(2 * h)))
                });
                let (two, third) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
                for k in 0..4 {
                    let p = rowp[k].add(blk * block_bytes);
                    let bcast = |off: usize| {
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(off).cast()))
                    };
                    let (qa, qb) = (bcast(qs_at + 32 * hq), bcast(qs_at + 32 * hq + 16));
                    for h in 0..2 {
                        // 32-bit shifts by at most 6: the 2 kept bits come from the same byte.
                        let mut e0 = _mm256_and_si256(_mm256_srlv_epi32(qa, shr[h]), two);
                        let mut e1 = _mm256_and_si256(_mm256_srlv_epi32(qb, shr[h]), two);
                        if F == F_Q3K {
                            let at = offset_of!(BlockQ3K, hmask);
                            let set = |hm: __m256i| {
                                let hit = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bits[h]), bits[h]);
                                _mm256_and_si256(hit, third)
                            };
                            e0 = _mm256_or_si256(e0, set(bcast(at)));
                            e1 = _mm256_or_si256(e1, set(bcast(at + 16)));
                        }
                        (w0[k][h], w1[k][h]) = (e0, e1);
                    }
                }
            }
            F_Q4K | F_Q5K => {
                // Sub-block `4h' + L` of the super-block (`h'` = q % 2) is the low (even L) or
                // high nibbles of qs bytes `64h' + 32(L / 2)..+32`; Q5_K's fifth bit is bit
                // `4h' + L` of qh byte `e`.
                let (blk, hq) = (q / 2, q % 2);
                let (block_bytes, qs_at) = if F == F_Q4K {
                    (size_of::<BlockQ4K>(), offset_of!(BlockQ4K, qs))
                } else {
                    (size_of::<BlockQ5K>(), offset_of!(BlockQ5K, qs))
                };
                let bit = |l: i32| 1i8 << (4 * hq as i32 + l);
                let bits = [0, 1].map(|h| {
                    _mm256_set_m128i(_mm_set1_epi8(bit(2 * h + 1)), _mm_set1_epi8(bit(2 * h)))
                });
                let fifth = _mm256_set1_epi8(0x10);
                for k in 0..4 {
                    let p = rowp[k].add(blk * block_bytes);
                    for h in 0..2 {
                        let v = _mm256_loadu_si256(p.add(qs_at + 64 * hq + 32 * h).cast());
                        let (lo, hi) = nibbles(v);
                        let mut e0 = _mm256_permute2x128_si256::<0x20>(lo, hi);
                        let mut e1 = _mm256_permute2x128_si256::<0x31>(lo, hi);
                        if F == F_Q5K {
                            let at = offset_of!(BlockQ5K, qh);
                            let qh0 =
                                _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(at).cast()));
                            let qh1 =
                                _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(at + 16).cast()));
                            let set = |qh: __m256i| {
                                let hit = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bits[h]), bits[h]);
                                _mm256_and_si256(hit, fifth)
                            };
                            e0 = _mm256_or_si256(e0, set(qh0));
                            e1 = _mm256_or_si256(e1, set(qh1));
                        }
                        (w0[k][h], w1[k][h]) = (e0, e1);
                    }
                }
            }
            F_Q6K => {
                // Sub-block `4h' + L`: the low (L < 2) or high nibbles of ql bytes
                // `64h' + 32(L % 2)..+32`, with bits `2L..2L + 2` of qh bytes `32h'..+32` on top.
                let (blk, hq) = (q / 2, q % 2);
                let m30 = _mm256_set1_epi8(0x30);
                // Bits `2L, 2L + 1` of each qh byte moved to bits 4, 5: per 128-bit half
                // (sub-blocks L = 2h, 2h + 1) shifts of the dwords by 4 and 2 left (h = 0) or 0 and
                // 2 right (h = 1), then masked per byte (no bit crosses into the kept ones).
                let high = |v: __m256i, h: usize| {
                    let s = if h == 0 {
                        _mm256_sllv_epi32(v, _mm256_set_m128i(_mm_set1_epi32(2), _mm_set1_epi32(4)))
                    } else {
                        _mm256_srlv_epi32(v, _mm256_set_m128i(_mm_set1_epi32(2), _mm_set1_epi32(0)))
                    };
                    _mm256_and_si256(s, m30)
                };
                for k in 0..4 {
                    let p = rowp[k].add(blk * size_of::<BlockQ6K>());
                    let ql = p.add(offset_of!(BlockQ6K, ql) + 64 * hq);
                    let qh = p.add(offset_of!(BlockQ6K, qh) + 32 * hq);
                    let (lo_a, hi_a) = nibbles(_mm256_loadu_si256(ql.cast()));
                    let (lo_b, hi_b) = nibbles(_mm256_loadu_si256(ql.add(32).cast()));
                    let qh0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(qh.cast()));
                    let qh1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(qh.add(16).cast()));
                    for h in 0..2 {
                        let (a, b) = if h == 0 { (lo_a, lo_b) } else { (hi_a, hi_b) };
                        let e0 = _mm256_permute2x128_si256::<0x20>(a, b);
                        let e1 = _mm256_permute2x128_si256::<0x31>(a, b);
                        w0[k][h] = _mm256_or_si256(e0, high(qh0, h));
                        w1[k][h] = _mm256_or_si256(e1, high(qh1, h));
                    }
                }
            }
            _ => unreachable!(),
        }
    }
    let mut mins = [[_mm256_setzero_ps(); 2]; 2];
    let (d, m) = match F {
        F_Q2K => {
            // SAFETY: the scales, d and dmin are inside the rows' super-block `q / 2`.
            let (d, m, min) = unsafe { q2k_scales(rowp, (q / 2) * size_of::<BlockQ2K>(), q % 2) };
            mins = min;
            (d, m)
        }
        F_IQ4XS => (
            // SAFETY: the header is inside the rows' super-block `q / 2`.
            unsafe { iq4xs_scales(rowp, (q / 2) * size_of::<BlockIQ4XS>(), q % 2) },
            [_mm256_setzero_ps(); 2],
        ),
        F_Q4K | F_Q5K => {
            let block_bytes = if F == F_Q4K {
                size_of::<BlockQ4K>()
            } else {
                size_of::<BlockQ5K>()
            };
            // SAFETY: the headers are inside the rows' super-block `q / 2`.
            unsafe { kq4_scales(rowp, (q / 2) * block_bytes, q % 2) }
        }
        F_Q6K => {
            // SAFETY: the scales and d are inside the rows' super-block `q / 2`.
            unsafe { q6k_scales(rowp, (q / 2) * size_of::<BlockQ6K>(), q % 2) }
        }
        F_Q3K => {
            // SAFETY: the scales and d are inside the rows' super-block `q / 2`.
            unsafe { q3k_scales(rowp, (q / 2) * size_of::<BlockQ3K>(), q % 2) }
        }
        _ => (f16x16(&lanes.d), f16x16(&lanes.m)),
    };
    Quad { w0, w1, d, m, mins }
}

/// 8 sums of 4 products each of the weight bytes `w` and activation bytes `x` (see the module
/// docs for the signed formats).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot4<const F: u8>(w: __m256i, x: __m256i) -> __m256i {
    let p = if is_signed(F) {
        _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
    } else {
        _mm256_maddubs_epi16(w, x)
    };
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// Lane `4L + k` (L 0..2) = sum of the 4 dwords of 128-bit lane `L` of `p[k]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce4(p: [__m256i; 4]) -> __m256i {
    _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]))
}

/// Accumulates the products of one decoded quad with one token's activation quad into `acc`
/// (lane `4L + k` of half `h`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn accumulate<const F: u8>(w: &Quad, a: &ActQuad, acc: [__m256; 2]) -> [__m256; 2] {
    // SAFETY: `ActQuad` is 64-byte aligned; each read is 32 bytes inside one of its fields.
    let ld = |p: *const u8, h: usize| unsafe { _mm256_load_si256(p.add(32 * h).cast()) };
    let shift = _mm_cvtsi32_si128(if is_signed(F) { 0 } else { offset_shift(F) });
    let mut out = acc;
    for h in 0..2 {
        let x0 = ld(a.x0.as_ptr().cast(), h);
        let x1 = ld(a.x1.as_ptr().cast(), h);
        let dx = _mm256_castsi256_ps(ld(a.dx.as_ptr().cast(), h));
        let mut acc = acc[h];
        if is_split(F) {
            let i0 = reduce4([0, 1, 2, 3].map(|k| dot4::<F>(w.w0[k][h], x0)));
            let i1 = reduce4([0, 1, 2, 3].map(|k| dot4::<F>(w.w1[k][h], x1)));
            let sq0 = ld(a.sq0.as_ptr().cast(), h);
            let sq1 = ld(a.sq1.as_ptr().cast(), h);
            let (mut i0, mut i1) = (i0, i1);
            if offset_shift(F) != 0 {
                i0 = _mm256_sub_epi32(i0, _mm256_sll_epi32(sq0, shift));
                i1 = _mm256_sub_epi32(i1, _mm256_sll_epi32(sq1, shift));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(w.d[h], dx), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(w.m[h], dx), acc);
            if has_min(F) {
                let min0 = _mm256_mul_ps(w.mins[0][h], dx);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq0), min0, acc);
                let min1 = _mm256_mul_ps(w.mins[1][h], dx);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq1), min1, acc);
            }
        } else {
            let i = reduce4([0, 1, 2, 3].map(|k| {
                if is_signed(F) {
                    _mm256_add_epi32(dot4::<F>(w.w0[k][h], x0), dot4::<F>(w.w1[k][h], x1))
                } else {
                    // The unsigned quants of the unsplit formats are at most 31 (Q5_*), the
                    // activations at most 127 in magnitude: two `vpmaddubsw` pair sums add
                    // within 4 * 31 * 127 (no i16 overflow), so one `vpmaddwd` serves both
                    // halves, exactly.
                    let p0 = _mm256_maddubs_epi16(w.w0[k][h], x0);
                    let p1 = _mm256_maddubs_epi16(w.w1[k][h], x1);
                    _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1))
                }
            }));
            let i = if offset_shift(F) != 0 && !is_signed(F) {
                _mm256_sub_epi32(i, _mm256_sll_epi32(ld(a.sq.as_ptr().cast(), h), shift))
            } else {
                i
            };
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(w.d[h], dx), acc);
            if has_min(F) {
                let sx = _mm256_castsi256_ps(ld(a.sx.as_ptr().cast(), h));
                acc = _mm256_fmadd_ps(w.m[h], sx, acc);
            }
        }
        out[h] = acc;
    }
    out
}

/// Row sums of an accumulator: element `k` = `(c0 + c2) + (c1 + c3)` over the chains `cL` in
/// lanes `4L + k` (the scalar reference's order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn row_sums(acc: [__m256; 2]) -> [f32; 4] {
    let h = _mm256_add_ps(acc[0], acc[1]);
    let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    let mut out = [0.0f32; 4];
    // SAFETY: `out` has room for 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// Products of 4 rows with `T` tokens (`acts` points at token 0's first quad; tokens are `nq`
/// quads apart).
///
/// # Safety
/// As for [`decode`]; `acts` is valid for `T * nq` quads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const F: u8, const T: usize>(
    rowp: &[*const u8; 4],
    acts: *const ActQuad,
    nq: usize,
    nblocks: usize,
    pf: (*const u8, usize, usize),
) -> [[f32; 4]; T] {
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    for q in 0..nq {
        prefetch_step(pf, q, false);
        let nvalid = (nblocks - 4 * q).min(4);
        // SAFETY: forwarded from the caller.
        let w = unsafe { decode::<F>(rowp, q, nvalid) };
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: `t * nq + q < T * nq`.
            let aq = unsafe { &*acts.add(t * nq + q) };
            *a = accumulate::<F>(&w, aq, *a);
        }
    }
    acc.map(|a| row_sums(a))
}

/// Rows `rows` x all `n` tokens of an integer-quantized matrix in the file layout.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `acts` holds `n` tokens quantized for `w.cols`.
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
    if n >= PANEL_MIN_TOKENS && (!is_split(F) || F == F_Q6K) && !rows.is_empty() {
        return panel_rows::<F>(fmt, w, acts, n, rows, out, vnni);
    }
    let (rb, nq, nblocks) = checked_shape(fmt, w, acts, n, &rows);
    let mut t0 = 0;
    while t0 < n {
        let tn = match n - t0 {
            8.. => 8,
            4..=7 => 4,
            2..=3 => 2,
            _ => 1,
        };
        let ap = acts[t0 * nq..].as_ptr();
        for g in rows.clone().step_by(4) {
            // The first pass over the rows streams them from DRAM: prefetch as the AVX-512
            // kernels do (see `avx512::rows_impl`).
            let pf = if t0 == 0 {
                prefetch_plan(w.data, rb, nq, g, &rows, (PF_AHEAD, false))
            } else {
                (w.data.as_ptr(), 0, 0)
            };
            let rowp = [0, 1, 2, 3].map(|k| {
                let r = (g + k).min(rows.end - 1);
                // SAFETY: `r < w.rows`, so the row lies inside `w.data` (asserted above).
                unsafe { w.data.as_ptr().add(r * rb) }
            });
            let live = (rows.end - g).min(4);
            let mut emit = |t: usize, s: [f32; 4]| out.set_run(t0 + t, g, &s[..live]);
            // SAFETY: the rows are whole encoded rows of `w.cols` columns, `ap` has `tn` tokens.
            unsafe {
                match tn {
                    8 => tile::<F, 8>(&rowp, ap, nq, nblocks, pf)
                        .into_iter()
                        .enumerate()
                        .for_each(|(t, s)| emit(t, s)),
                    4 => tile::<F, 4>(&rowp, ap, nq, nblocks, pf)
                        .into_iter()
                        .enumerate()
                        .for_each(|(t, s)| emit(t, s)),
                    2 => tile::<F, 2>(&rowp, ap, nq, nblocks, pf)
                        .into_iter()
                        .enumerate()
                        .for_each(|(t, s)| emit(t, s)),
                    _ => tile::<F, 1>(&rowp, ap, nq, nblocks, pf)
                        .into_iter()
                        .enumerate()
                        .for_each(|(t, s)| emit(t, s)),
                }
            }
        }
        t0 += tn;
    }
}

/// Row bytes, activation quads per token and 32-element blocks per row of `w`, after checking
/// that `acts` holds `n` tokens and `rows` and the data fit the matrix.
fn checked_shape(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: &Range<usize>,
) -> (usize, usize, usize) {
    let rb = fmt.row_bytes(w.cols);
    let nq = quads_per_token(w.cols);
    assert!(acts.len() >= n * nq && rows.end <= w.rows && w.data.len() >= w.rows * rb);
    (rb, nq, w.cols / 32)
}

/// Smallest token count the 8-row panel kernel is used for (the packing pass is amortized over
/// the tokens; the AVX-512 panel kernel's crossover).
pub(super) const PANEL_MIN_TOKENS: usize = 16;
/// Tokens per panel packing: their activation quads (448 bytes per 128 columns) stay in L2 while
/// the task's panels pass over them.
pub(super) const PANEL_TOKEN_CHUNK: usize = 64;

/// One 32-element block of an 8-row panel: `w[j]` lane `r` holds the quants of elements
/// `4j..4j + 4` of row `r` (as the 4-row kernel decodes them: offset unsigned, or signed for
/// Q8_0/IQ4), then the 8 rows' scales and (formats with a minimum) minimums.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(super) struct PanelBlock {
    pub(super) w: [__m256i; 8],
    pub(super) d: __m256,
    pub(super) m: __m256,
    /// Q2_K (packed weights only): `-(dmin * m)` of elements 0..16 and 16..32.
    pub(super) mins: [__m256; 2],
}

thread_local! {
    static PANEL: std::cell::RefCell<Vec<PanelBlock>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Calls `f` with this thread's panel buffer of `nblocks` blocks.
pub(super) fn with_panel<R>(nblocks: usize, f: impl FnOnce(&mut [PanelBlock]) -> R) -> R {
    PANEL.with(|p| {
        let mut panel = p.borrow_mut();
        if panel.len() < nblocks {
            // SAFETY: all-zero bits are valid vectors.
            let z: PanelBlock = unsafe { std::mem::zeroed() };
            panel.resize(nblocks, z);
        }
        f(&mut panel[..nblocks])
    })
}

/// Many tokens of an unsplit format or Q6_K (split scales, no minimums: two integer sums per
/// block, each with its FMA, as [`accumulate`] does): 8 rows at a time are decoded once per token chunk (two
/// [`decode`] calls per quad, then dword transposes) into a panel whose vectors hold one row
/// per 32-bit lane, and every token's 4 activation bytes are broadcast against it, so no
/// horizontal sums are needed. Each output element gets exactly [`accumulate`]'s float
/// operations in the same order (the exact integer block sum, one FMA by `d_w * d_x`, one FMA
/// by `m_w` and `d_x * sum(q_x)` for the formats with a minimum, chains by block index modulo 4
/// summed as `(c0 + c2) + (c1 + c3)`), so the results are the 4-row kernel's bits.
#[target_feature(enable = "avx2,fma,f16c")]
fn panel_rows<const F: u8>(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
    vnni: Vnni,
) {
    let (rb, nq, nblocks) = checked_shape(fmt, w, acts, n, &rows);
    with_panel(nblocks, |panel| {
        for tc in (0..n).step_by(PANEL_TOKEN_CHUNK) {
            let t_end = (tc + PANEL_TOKEN_CHUNK).min(n);
            for g in rows.clone().step_by(8) {
                // Rows past the task repeat its last row (decoded, not emitted).
                let rowp = |k: usize| {
                    let r = (g + k).min(rows.end - 1);
                    // SAFETY: `r < w.rows`, so the row lies inside `w.data` (asserted above).
                    unsafe { w.data.as_ptr().add(r * rb) }
                };
                let (ra, rbp) = ([0, 1, 2, 3].map(rowp), [4, 5, 6, 7].map(rowp));
                // SAFETY: the rows are whole encoded rows of `w.cols` columns.
                unsafe { pack_panel::<F>(&ra, &rbp, nblocks, panel) };
                let live = (rows.end - g).min(8);
                let panel: &[PanelBlock] = panel;
                token_tiles::<F>(
                    nblocks,
                    |_, b| panel[b],
                    acts,
                    nq,
                    tc..t_end,
                    vnni,
                    |t, v| emit8(out, t, g, live, v),
                );
            }
        }
    });
}

/// Dwords `j` of the 4 vectors, per 128-bit lane: `out[j]` lane `k` (and `4 + k`) is dword `j`
/// of `v[k]`'s low (high) 128 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose_lanes(v: [__m256i; 4]) -> [__m256i; 4] {
    let t0 = _mm256_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm256_unpacklo_epi32(v[2], v[3]);
    let t2 = _mm256_unpackhi_epi32(v[0], v[1]);
    let t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    [
        _mm256_unpacklo_epi64(t0, t1),
        _mm256_unpackhi_epi64(t0, t1),
        _mm256_unpacklo_epi64(t2, t3),
        _mm256_unpackhi_epi64(t2, t3),
    ]
}

/// Rows 0..4 from `a`'s and rows 4..8 from `b`'s 128-bit half `l` (block `2h + l` of a half).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves(a: __m256i, b: __m256i, l: usize) -> __m256i {
    if l == 0 {
        _mm256_permute2x128_si256::<0x20>(a, b)
    } else {
        _mm256_permute2x128_si256::<0x31>(a, b)
    }
}

/// Decodes the 8 rows `ra` (rows 0..4) and `rb` (rows 4..8) into the panel's `nblocks` blocks.
///
/// # Safety
/// As for [`decode`], for every quad of the rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_panel<const F: u8>(
    ra: &[*const u8; 4],
    rb: &[*const u8; 4],
    nblocks: usize,
    panel: &mut [PanelBlock],
) {
    for q in 0..nblocks.div_ceil(4) {
        let nvalid = (nblocks - 4 * q).min(4);
        // SAFETY: forwarded from the caller; `q` is a quad of the rows.
        let (a, b) = unsafe { (decode::<F>(ra, q, nvalid), decode::<F>(rb, q, nvalid)) };
        for h in 0..2 {
            let a0 = transpose_lanes([0, 1, 2, 3].map(|k| a.w0[k][h]));
            let a1 = transpose_lanes([0, 1, 2, 3].map(|k| a.w1[k][h]));
            let b0 = transpose_lanes([0, 1, 2, 3].map(|k| b.w0[k][h]));
            let b1 = transpose_lanes([0, 1, 2, 3].map(|k| b.w1[k][h]));
            for l in 0..2 {
                let bi = 4 * q + 2 * h + l;
                if bi >= nblocks {
                    continue;
                }
                let pb = &mut panel[bi];
                for j in 0..4 {
                    pb.w[j] = halves(a0[j], b0[j], l);
                    pb.w[j + 4] = halves(a1[j], b1[j], l);
                }
                let ps = |x: __m256, y: __m256| {
                    _mm256_castsi256_ps(halves(_mm256_castps_si256(x), _mm256_castps_si256(y), l))
                };
                pb.d = ps(a.d[h], b.d[h]);
                pb.m = ps(a.m[h], b.m[h]);
            }
        }
    }
}

/// [`panel_tile`] over the tokens `tokens` in pairs (then one), calling `emit(token, row sums)`;
/// `block(t0, b)` gives block `b` for the tile starting at token `t0`.
///
/// # Panics
/// If `acts` has fewer than `tokens.end * nq` quads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn token_tiles<const F: u8>(
    nblocks: usize,
    block: impl Fn(usize, usize) -> PanelBlock,
    acts: &[ActQuad],
    nq: usize,
    tokens: Range<usize>,
    vnni: Vnni,
    mut emit: impl FnMut(usize, __m256),
) {
    assert!(acts.len() >= tokens.end * nq && nblocks <= 4 * nq);
    let mut t0 = tokens.start;
    while t0 < tokens.end {
        let ap = acts[t0 * nq..].as_ptr();
        let tile_block = |b: usize| block(t0, b);
        // SAFETY: `ap` has the tile's tokens, `nq` quads each (asserted); `nblocks` fit `nq`;
        // `vnni` is `Some` only where the CPU has AVX-VNNI (its constructor checks).
        unsafe {
            if tokens.end - t0 >= 2 {
                let v = match vnni {
                    Some(_) => panel_tile_vnni::<F, 2>(nblocks, tile_block, ap, nq),
                    None => panel_tile::<F, 2>(nblocks, tile_block, ap, nq),
                };
                emit(t0, v[0]);
                emit(t0 + 1, v[1]);
                t0 += 2;
            } else {
                let v = match vnni {
                    Some(_) => panel_tile_vnni::<F, 1>(nblocks, tile_block, ap, nq),
                    None => panel_tile::<F, 1>(nblocks, tile_block, ap, nq),
                };
                emit(t0, v[0]);
                t0 += 1;
            }
        }
    }
}

/// Proof that the CPU has AVX-VNNI (the VEX-encoded 256-bit `vpdpbusd`): [`panel_tile_vnni`]
/// runs only with one. `None`: the plain AVX2 integer dot products.
pub(crate) type Vnni = Option<HasAvxVnni>;

/// See [`Vnni`]; made only by [`HasAvxVnni::detect`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct HasAvxVnni(());

impl HasAvxVnni {
    /// `Some` if this CPU has AVX-VNNI (and AVX2, FMA, F16C); looked up once per process (the
    /// kernels ask per task).
    pub(crate) fn detect() -> Option<Self> {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        HAS.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
                && is_x86_feature_detected!("avxvnni")
        })
        .then_some(Self(()))
    }
}

/// Stores the first `live` lanes of `v` as rows `r0..r0 + live` of token `t`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn emit8(out: &mut RowsOut<'_>, t: usize, r0: usize, live: usize, v: __m256) {
    let mut o = [0.0f32; 8];
    // SAFETY: `o` has room for 8 floats.
    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
    out.set_run(t, r0, &o[..live]);
}

/// The body of [`panel_tile`] and [`panel_tile_vnni`] (`$vnni`: whether the integer sums use
/// AVX-VNNI's `vpdpbusd`; the same exact integers either way, so the same bits).
macro_rules! panel_tile_body {
    ($vnni:expr, $nblocks:ident, $block:ident, $acts:ident, $nq:ident) => {{
        let (nblocks, block, acts, nq) = ($nblocks, $block, $acts, $nq);
    let ones = _mm256_set1_epi16(1);
    // The signed formats' quants are offset back to u8 (`q + 128`) for `vpdpbusd`, whose sums
    // then subtract `128 * sum(q_x)` as the offset formats do; without AVX-VNNI they stay signed.
    // (A const expression, so that each format's closure below folds it.)
    let shift = _mm_cvtsi32_si128(if is_signed(F) && !$vnni { 0 } else { offset_shift(F) });
    // The unsigned quants of 4-bit formats are at most 15: 8 `vpmaddubsw` pair sums add within
    // 8 * 2 * 15 * 127 in i16. 5-bit ones (at most 31) add 4 at a time.
    let four_bit = matches!(F, F_Q4_0 | F_Q4_1 | F_Q4K);
    // One block `l` of quad `qi` into the chain accumulators `ct` (one per token).
    let step = |qi: usize, l: usize, pb: &PanelBlock, ct: &mut [__m256; T]| {
        let wv = pb.w;
        // The first operand of the dot products: `|w|` (with `sign(x, w)`), or with AVX-VNNI
        // `w + 128`; the unsigned quants as they are.
        let wa = if is_signed(F) {
            wv.map(|v| {
                if $vnni {
                    _mm256_xor_si256(v, _mm256_set1_epi8(-128))
                } else {
                    _mm256_abs_epi8(v)
                }
            })
        } else {
            wv
        };
        for (t, acc) in ct.iter_mut().enumerate() {
            // SAFETY: `t * nq + qi < T * nq`.
            let aq = unsafe { &*acts.add(t * nq + qi) };
            let x = |j: usize| {
                let src = if j < 4 {
                    aq.x0.as_ptr()
                } else {
                    aq.x1.as_ptr()
                };
                // SAFETY: bytes `16l + 4(j % 4)..+ 4` of the 64-byte field.
                _mm256_set1_epi32(unsafe {
                    src.add(16 * l + 4 * (j % 4)).cast::<i32>().read_unaligned()
                })
            };
            if is_split(F) {
                // Q6_K (and packed Q2_K, Q3_K): elements 0..16 (vectors 0..4) and 16..32 have
                // their own scales, in `d` and `m`. Quants of at most 6 bits (at most 63): two
                // pair sums add within 2 * 2 * 63 * 127.
                let half = |j0: usize| {
                    if $vnni {
                        let mut s = _mm256_setzero_si256();
                        for j in j0..j0 + 4 {
                            // SAFETY: AVX-VNNI is enabled where `$vnni` is true.
                            s = unsafe { _mm256_dpbusd_avx_epi32(s, wv[j], x(j)) };
                        }
                        return s;
                    }
                    let pa = _mm256_add_epi16(
                        _mm256_maddubs_epi16(wv[j0], x(j0)),
                        _mm256_maddubs_epi16(wv[j0 + 1], x(j0 + 1)),
                    );
                    let pb = _mm256_add_epi16(
                        _mm256_maddubs_epi16(wv[j0 + 2], x(j0 + 2)),
                        _mm256_maddubs_epi16(wv[j0 + 3], x(j0 + 3)),
                    );
                    _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones))
                };
                // The offset (none for Q2_K: a shift of 0 is no offset, not an offset of 1).
                let sub = |i: __m256i, v: i32| {
                    if offset_shift(F) != 0 {
                        _mm256_sub_epi32(i, _mm256_sll_epi32(_mm256_set1_epi32(v), shift))
                    } else {
                        i
                    }
                };
                let i0 = sub(half(0), aq.sq0[4 * l]);
                let i1 = sub(half(4), aq.sq1[4 * l]);
                let dx = _mm256_set1_ps(aq.dx[4 * l]);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(pb.d, dx), *acc);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(pb.m, dx), *acc);
                if has_min(F) {
                    // Q2_K: per half, `sum(q_x half) * (min_w half * d_x)`.
                    for (min, sq) in pb.mins.iter().zip([aq.sq0[4 * l], aq.sq1[4 * l]]) {
                        let s = _mm256_set1_ps(sq as f32);
                        *acc = _mm256_fmadd_ps(s, _mm256_mul_ps(*min, dx), *acc);
                    }
                }
                continue;
            }
            let i = if $vnni {
                // Exact `i32` sums of the 32 products (of the signed formats offset by
                // `128 * sum(q_x)`, subtracted below), one instruction per 4.
                let mut s = _mm256_setzero_si256();
                for j in 0..8 {
                    let a = if is_signed(F) { wa[j] } else { wv[j] };
                    // SAFETY: AVX-VNNI is enabled where `$vnni` is true.
                    s = unsafe { _mm256_dpbusd_avx_epi32(s, a, x(j)) };
                }
                s
            } else if is_signed(F) {
                let mut s = _mm256_setzero_si256();
                for j in 0..8 {
                    let p = _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(x(j), wv[j]));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                }
                s
            } else if four_bit {
                let mut p = _mm256_setzero_si256();
                for j in 0..8 {
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wv[j], x(j)));
                }
                _mm256_madd_epi16(p, ones)
            } else {
                let (mut p0, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for j in 0..4 {
                    p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(wv[j], x(j)));
                    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(wv[j + 4], x(j + 4)));
                }
                _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones))
            };
            let i = if offset_shift(F) != 0 && (!is_signed(F) || $vnni) {
                _mm256_sub_epi32(i, _mm256_sll_epi32(_mm256_set1_epi32(aq.sq[4 * l]), shift))
            } else {
                i
            };
            let dx = _mm256_set1_ps(aq.dx[4 * l]);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(pb.d, dx), *acc);
            if has_min(F) {
                *acc = _mm256_fmadd_ps(pb.m, _mm256_set1_ps(aq.sx[4 * l]), *acc);
            }
        }
    };
    // The four chains (block index modulo 4) in separate variables, each quad's blocks with
    // constant `l`, so the accumulators stay in registers.
    let z = [_mm256_setzero_ps(); T];
    let (mut c0, mut c1, mut c2, mut c3) = (z, z, z, z);
    let quads = nblocks / 4;
    for qi in 0..quads {
        step(qi, 0, &block(4 * qi), &mut c0);
        step(qi, 1, &block(4 * qi + 1), &mut c1);
        step(qi, 2, &block(4 * qi + 2), &mut c2);
        step(qi, 3, &block(4 * qi + 3), &mut c3);
    }
    for b in 4 * quads..nblocks {
        let c = match b % 4 {
            0 => &mut c0,
            1 => &mut c1,
            _ => &mut c2,
        };
        step(quads, b % 4, &block(b), c);
    }
    std::array::from_fn(|t| _mm256_add_ps(_mm256_add_ps(c0[t], c2[t]), _mm256_add_ps(c1[t], c3[t])))
    }};
}

/// Products of 8 rows with `T` tokens (`acts` at token 0's first quad, tokens `nq` quads apart):
/// the row sums, lane `r` = row `r`. `block(b)` gives the rows' block `b` (`b < nblocks`, in
/// order): from a decoded panel, or straight from a packed matrix.
///
/// # Safety
/// `acts` is valid for `T * nq` quads; `nblocks` is the row length's blocks (`nq` quads' worth).
#[inline]
#[allow(clippy::needless_range_loop)] // `j` indexes the weight vectors and activation dwords alike
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_tile<const F: u8, const T: usize>(
    nblocks: usize,
    block: impl Fn(usize) -> PanelBlock,
    acts: *const ActQuad,
    nq: usize,
) -> [__m256; T] {
    panel_tile_body!(false, nblocks, block, acts, nq)
}

/// [`panel_tile`] with AVX-VNNI: each group of 4 products is one `vpdpbusd` instead of
/// `vpmaddubsw` (and `vpsignb` for the signed formats), a 16-bit add and a `vpmaddwd` share.
///
/// # Safety
/// As for [`panel_tile`], and the CPU has AVX-VNNI.
#[inline]
#[allow(clippy::needless_range_loop)] // `j` indexes the weight vectors and activation dwords alike
#[allow(unused_unsafe)] // the body's `vpdpbusd` calls need `unsafe` only in `panel_tile`
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn panel_tile_vnni<const F: u8, const T: usize>(
    nblocks: usize,
    block: impl Fn(usize) -> PanelBlock,
    acts: *const ActQuad,
    nq: usize,
) -> [__m256; T] {
    panel_tile_body!(true, nblocks, block, acts, nq)
}
