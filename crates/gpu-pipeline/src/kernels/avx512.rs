//! AVX-512 (F/BW/VL/DQ + VNNI + VBMI, with GFNI) kernels for the integer-quantized formats.
//!
//! The unit of work is 4 rows x 4 consecutive 32-element blocks ("a quad") x T tokens:
//! - per row, the quad's quants are gathered with one or two `vpermt2b` into two u8 vectors
//!   `W0` (lane `L` = elements 0..16 of block `L`) and `W1` (elements 16..32), the layout of the
//!   prepared activations ([`ActQuad`]);
//!   (5th / 3rd bits are merged with byte-masked adds, IQ4 code book values looked up with
//!   `vpshufb`, the 2-bit K-quant planes picked per 128-bit lane with one GF(2) affine transform);
//! - `vpdpbusd` multiplies them with the q8 activations, giving 4 partial sums per block (two per
//!   block, of 16 elements each, for Q2_K, Q3_K and Q6_K, whose halves have their own scales);
//! - a 4x4 transpose-and-add turns the 4 rows' partial sums into one vector whose lane `4L + k`
//!   is the exact integer dot product of block `L` of row `k`;
//! - the block scales (weights' and activations') are applied in f32 with one FMA per 16 block
//!   products, into per-token accumulators whose lane `4L + k` belongs to row `k`.
//!
//! Each weight quad is decoded once for up to 8 tokens (prefill and batched decode). Every output
//! element goes through the same operations in the same order whatever the tile, the number of
//! tokens or the row partition, which makes `matmul` batch-invariant.

// The AVX-512 intrinsics are stable since Rust 1.89; the workspace toolchain is 1.95.
#![allow(clippy::incompatible_msrv)]

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::act::{ActBlock, ActQuad, block_scale, quads_per_token};
use super::format::Fmt;
use super::{RowsOut, WeightMatrix};
use std::mem::offset_of;
use weight_cache::quant::{
    BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, KVALUES_IQ4NL,
};

pub(crate) const F_Q4_0: u8 = 0;
pub(crate) const F_Q4_1: u8 = 1;
pub(crate) const F_Q8_0: u8 = 2;
pub(crate) const F_Q4K: u8 = 3;
pub(crate) const F_Q6K: u8 = 4;
pub(crate) const F_Q5_0: u8 = 5;
pub(crate) const F_Q5_1: u8 = 6;
pub(crate) const F_Q2K: u8 = 7;
pub(crate) const F_Q3K: u8 = 8;
pub(crate) const F_Q5K: u8 = 9;
pub(crate) const F_IQ4NL: u8 = 10;
pub(crate) const F_IQ4XS: u8 = 11;

/// `$f::<F>(args)` with `F` the kernel tag of the integer-quantized format `$fmt` (the one
/// mapping from [`Fmt`] to these tags, used by every backend's dispatch); float formats are
/// unreachable (their products take `float_rows`).
macro_rules! by_quant_format {
    ($fmt:expr, $f:ident($($arg:expr),* $(,)?)) => {{
        use $crate::kernels::avx512 as tag;
        use $crate::kernels::format::Fmt;
        match $fmt {
            Fmt::Q4_0 => $f::<{ tag::F_Q4_0 }>($($arg),*),
            Fmt::Q4_1 => $f::<{ tag::F_Q4_1 }>($($arg),*),
            Fmt::Q8_0 => $f::<{ tag::F_Q8_0 }>($($arg),*),
            Fmt::Q5_0 => $f::<{ tag::F_Q5_0 }>($($arg),*),
            Fmt::Q5_1 => $f::<{ tag::F_Q5_1 }>($($arg),*),
            Fmt::Q2K => $f::<{ tag::F_Q2K }>($($arg),*),
            Fmt::Q3K => $f::<{ tag::F_Q3K }>($($arg),*),
            Fmt::Q4K => $f::<{ tag::F_Q4K }>($($arg),*),
            Fmt::Q5K => $f::<{ tag::F_Q5K }>($($arg),*),
            Fmt::Q6K => $f::<{ tag::F_Q6K }>($($arg),*),
            Fmt::IQ4NL => $f::<{ tag::F_IQ4NL }>($($arg),*),
            Fmt::IQ4XS => $f::<{ tag::F_IQ4XS }>($($arg),*),
            Fmt::F32 | Fmt::F16 | Fmt::BF16 => unreachable!("float formats use float_rows"),
        }
    }};
}
pub(crate) use by_quant_format;

/// Whether the two 16-element halves of a block have their own scales (and mins).
pub(crate) const fn is_split(f: u8) -> bool {
    matches!(f, F_Q6K | F_Q3K | F_Q2K)
}

/// Q2_K and Q3_K, decoded a super-block (two quads) at a time ([`decode_k23`]).
const fn is_k23(f: u8) -> bool {
    matches!(f, F_Q2K | F_Q3K)
}

/// Whether the format adds a per-block (split: per-half) minimum.
pub(crate) const fn has_min(f: u8) -> bool {
    matches!(f, F_Q4_1 | F_Q4K | F_Q5_1 | F_Q5K | F_Q2K)
}

/// `log2` of the offset subtracted from the unsigned quants (0: no offset, not an offset of 1).
pub(crate) const fn offset_shift(f: u8) -> i32 {
    match f {
        F_Q3K => 2,
        F_Q4_0 => 3,
        F_Q5_0 => 4,
        F_Q6K => 5,
        F_Q8_0 | F_IQ4NL | F_IQ4XS => 7,
        _ => 0,
    }
}

/// Byte gather of the 16 quant bytes of 4 blocks of `bs` bytes with `hdr` header bytes.
const fn qs_index(bs: usize, hdr: usize) -> [u8; 64] {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = (bs * (i / 16) + hdr + i % 16) as u8;
        i += 1;
    }
    t
}

/// Word gather: word lane `2 * (4L + k)` takes word `stride * L`.
const fn hdr16_index(stride: usize) -> [u16; 32] {
    let mut t = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = (stride * (i / 8)) as u16;
        i += 1;
    }
    t
}

static IDX_Q4_0: [u8; 64] = qs_index(18, 2);
static IDX_Q4_1: [u8; 64] = qs_index(20, 4);
static IDX_Q8_0: [u8; 64] = qs_index(34, 2);
static IDX_Q5_0: [u8; 64] = qs_index(22, 6);
static IDX_Q5_1: [u8; 64] = qs_index(24, 8);
static IDX16_Q5_0: [u16; 32] = hdr16_index(11);
static IDX32_Q5_1: [u32; 16] = [0, 0, 0, 0, 6, 6, 6, 6, 12, 12, 12, 12, 18, 18, 18, 18];
static IDX16_Q4_0: [u16; 32] = hdr16_index(9);
/// Q5_K/Q3_K: byte lane `16L + e` selects bit `4h + L` of a high-bit byte, for quad half `h`.
static Q5K_BIT: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut i = 0;
    while i < 128 {
        t[i / 64][i % 64] = 1 << (4 * (i / 64) + (i % 64) / 16);
        i += 1;
    }
    t
};
/// The IQ4 code book as unsigned bytes (`value + 128`), repeated in each 128-bit lane.
pub(crate) static IQ4_TABLE: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = (KVALUES_IQ4NL[i % 16] as u8) ^ 0x80;
        i += 1;
    }
    t
};
static IDX16_Q8_0: [u16; 32] = hdr16_index(17);
static IDX32_Q4_1: [u32; 16] = [0, 0, 0, 0, 5, 5, 5, 5, 10, 10, 10, 10, 15, 15, 15, 15];
static QIDX_W0_KQ4: [u64; 8] = [0, 1, 8, 9, 4, 5, 12, 13];
static QIDX_W1_KQ4: [u64; 8] = [2, 3, 10, 11, 6, 7, 14, 15];
static QIDX_W0_KQ6: [u64; 8] = [0, 1, 4, 5, 8, 9, 12, 13];
static QIDX_W1_KQ6: [u64; 8] = [2, 3, 6, 7, 10, 11, 14, 15];
static Q6_SHL: [u16; 32] = [
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
];
static Q6_SHR: [u16; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
];

/// The K-quant scale set-up works on the 16-byte headers of the quad's 4 rows loaded side by
/// side (row `k` in 128-bit lane `k`, see [`rows16`]) and gathers, per result lane `j = 4L + k`
/// (block `L` of the quad, row `k`), the header bytes that block's scales are made of into
/// dword `j`. `bytes(j)` gives those bytes' offsets inside row `k`'s header (255: zero).
const fn lane_gather(table: [[u8; 4]; 4]) -> [u8; 64] {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < 16 {
        let (l, k) = (j / 4, j % 4);
        let mut b = 0;
        while b < 4 {
            let off = table[l][b];
            t[4 * j + b] = if off == 255 { 0 } else { (16 * k) as u8 + off };
            b += 1;
        }
        j += 1;
    }
    t
}

/// Byte mask of the gathered bytes that are not 255 (zero) in a [`lane_gather`] table.
const fn lane_gather_mask(table: [[u8; 4]; 4]) -> u64 {
    let mut m = 0u64;
    let mut j = 0;
    while j < 64 {
        if table[j / 16][j % 4] != 255 {
            m |= 1 << j;
        }
        j += 1;
    }
    m
}

/// Word gather of two f16 values per row from the 4 headers of [`rows16`]: word `j < 16` takes
/// word `a` of row `j % 4`'s header, word `16 + j` its word `b`.
const fn f16_pair_index(a: u16, b: u16) -> [u16; 32] {
    let mut t = [0u16; 32];
    let mut j = 0;
    while j < 16 {
        t[j] = 8 * (j % 4) as u16 + a;
        t[16 + j] = 8 * (j % 4) as u16 + b;
        j += 1;
    }
    t
}

/// Q4_K/Q5_K header (d, dmin, 12 scale bytes `q`): block `L` of either quad half gathers
/// `q[L], q[L + 4], q[L + 8]` (see `scale_min_k4`).
const KQ4_SCALE_BYTES: [[u8; 4]; 4] = [
    [4, 8, 12, 255],
    [5, 9, 13, 255],
    [6, 10, 14, 255],
    [7, 11, 15, 255],
];
static KQ4_SCALE_IDX: [u8; 64] = lane_gather(KQ4_SCALE_BYTES);
const KQ4_SCALE_MASK: u64 = lane_gather_mask(KQ4_SCALE_BYTES);
/// Q4_K/Q5_K: d and dmin are header words 0 and 1.
static KQ4_D_IDX: [u16; 32] = f16_pair_index(0, 1);
/// Q2_K: the 16 scale bytes are the header; sub-block `4h + L` is bytes `8h + 2L` (elements
/// 0..16) and `8h + 2L + 1`.
const fn q2k_scale_bytes(h: u8) -> [[u8; 4]; 4] {
    let mut t = [[255u8; 4]; 4];
    let mut l = 0;
    while l < 4 {
        t[l][0] = 8 * h + 2 * l as u8;
        t[l][1] = 8 * h + 2 * l as u8 + 1;
        l += 1;
    }
    t
}
static Q2K_SCALE_IDX: [[u8; 64]; 2] = [
    lane_gather(q2k_scale_bytes(0)),
    lane_gather(q2k_scale_bytes(1)),
];
/// Q2_K: d and dmin are words 6 and 7 of the 16 bytes ending the block.
static Q2K_D_IDX: [u16; 32] = f16_pair_index(6, 7);
/// Q3_K, 16 bytes ending the block (2 quant bytes, 12 scale bytes `q` from byte 2, d): scale
/// `i = 8h + 2L + e` (half `e`) has its low bits in `q[2L + e]` and its high bits in
/// `q[8 + 2(L % 2) + e]` at bit `2(2h + L / 2)` (see `scale_k3`).
const Q3K_SCALE_BYTES: [[u8; 4]; 4] = [
    [2, 3, 10, 11],
    [4, 5, 12, 13],
    [6, 7, 10, 11],
    [8, 9, 12, 13],
];
static Q3K_SCALE_IDX: [u8; 64] = lane_gather(Q3K_SCALE_BYTES);
/// Q3_K: right shifts per lane `4L + k` bringing half 0's (`[0]`) and half 1's high bits down,
/// per quad half `h`.
static Q3K_HIGH_SHR: [[[u32; 16]; 2]; 2] = {
    let mut t = [[[0u32; 16]; 2]; 2];
    let mut i = 0;
    while i < 64 {
        let (h, e, j) = (i / 32, (i / 16) % 2, i % 16);
        t[h][e][j] = (16 + 8 * e + 2 * (2 * h + j / 8)) as u32;
        i += 1;
    }
    t
};
/// Q3_K: d is word 7 of the 16 bytes ending the block.
static Q3K_D_IDX: [u16; 32] = f16_pair_index(7, 7);
/// IQ4_XS header (d, scales_h, scales_l): sub-block `i = 4h + L` gathers `scales_l[i / 2]`
/// and the two bytes of `scales_h`.
const fn iq4xs_scale_bytes(h: u8) -> [[u8; 4]; 4] {
    let mut t = [[255u8; 4]; 4];
    let mut l = 0;
    while l < 4 {
        t[l] = [4 + (4 * h + l as u8) / 2, 2, 3, 255];
        l += 1;
    }
    t
}
static IQ4XS_SCALE_IDX: [[u8; 64]; 2] = [
    lane_gather(iq4xs_scale_bytes(0)),
    lane_gather(iq4xs_scale_bytes(1)),
];
const IQ4XS_SCALE_MASK: u64 = lane_gather_mask(iq4xs_scale_bytes(0));
/// IQ4_XS: right shifts per lane `4L + k` to the low (`[0]`) and high scale bits of sub-block
/// `4h + L`, per quad half `h`.
static IQ4XS_SHR: [[[u32; 16]; 2]; 2] = {
    let mut t = [[[0u32; 16]; 2]; 2];
    let mut i = 0;
    while i < 64 {
        let (h, part, j) = (i / 32, (i / 16) % 2, i % 16);
        let l = j / 4;
        t[h][part][j] = if part == 0 {
            (4 * (l % 2)) as u32
        } else {
            (8 + 2 * (4 * h + l)) as u32
        };
        i += 1;
    }
    t
};
/// IQ4_XS: d is header word 0.
static IQ4XS_D_IDX: [u16; 32] = f16_pair_index(0, 0);
/// Q6_K, 16 scale bytes per row: byte `j < 16` takes scale `8h + 2L` of row `k` (`j = 4L + k`),
/// byte `16 + j` scale `8h + 2L + 1`.
static Q6K_SCALE_IDX: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut i = 0;
    while i < 64 {
        let (h, e, j) = (i / 32, (i / 16) % 2, i % 16);
        t[h][16 * e + j] = (16 * (j % 4) + 8 * h + 2 * (j / 4) + e) as u8;
        i += 1;
    }
    t
};
/// Q6_K: d is word 7 of the 16 bytes ending the block.
static Q6K_D_IDX: [u16; 32] = f16_pair_index(7, 7);

/// A mask of the first `n` bytes (`n` clamped to 0..=64).
#[inline(always)]
fn bmask(n: isize) -> u64 {
    if n <= 0 {
        0
    } else if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// One quad of 4 rows, decoded.
#[derive(Clone, Copy)]
struct WQuad {
    w0: [__m512i; 4],
    w1: [__m512i; 4],
    /// Weight scale per lane `4L + k` (Q6_K: of elements 0..16).
    d: __m512,
    /// Formats with a minimum: additive term per lane; split formats: scale of elements 16..32.
    m: __m512,
    /// Q2_K: the minimums of elements 0..16 and 16..32.
    mins: [__m512; 2],
}

#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn load_idx(t: &[u8; 64]) -> __m512i {
    // SAFETY: `t` is 64 readable bytes.
    unsafe { _mm512_loadu_si512(t.as_ptr().cast()) }
}

/// The 16 bytes at each of `p[0..4]`, `p[k]`'s in 128-bit lane `k`.
///
/// # Safety
/// Each `p[k]` has 16 readable bytes.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn rows16(p: [*const u8; 4]) -> __m512i {
    // SAFETY: forwarded from the caller.
    unsafe {
        let ld = |p: *const u8| _mm_loadu_si128(p.cast());
        let lo = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(ld(p[0])), ld(p[1]));
        let hi = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(ld(p[2])), ld(p[3]));
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

/// Two f16 values per row of the headers `hdr` (see [`rows16`]) as f32, lane `4L + k` = row `k`'s
/// (the same for every `L`): words `idx[0..16]` and `idx[16..32]` (see [`f16_pair_index`]).
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn f16_pair(hdr: __m512i, idx: &[u16; 32]) -> (__m512, __m512) {
    // SAFETY: `idx` is 64 readable bytes.
    let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    let words = _mm512_permutexvar_epi16(idx, hdr);
    (
        _mm512_cvtph_ps(_mm512_castsi512_si256(words)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(words)),
    )
}

/// `d * v` per lane for the integer lanes `v`, as `d * f32::from(v)` computes it.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn scaled(d: __m512, v: __m512i) -> __m512 {
    _mm512_mul_ps(d, _mm512_cvtepi32_ps(v))
}

/// `-(d * v)` per lane, as `-(d * f32::from(v))` computes it.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn neg_scaled(d: __m512, v: __m512i) -> __m512 {
    _mm512_xor_ps(scaled(d, v), _mm512_set1_ps(-0.0))
}

/// Decodes quad `q` (blocks `4q..4q + nvalid`) of the 4 rows at `rowp`.
///
/// # Safety
/// Each `rowp[k]` points at a full encoded row of `w.cols` columns, `q` is a quad of that row and
/// `nvalid` the number of its blocks inside the row.
#[inline]
#[allow(clippy::needless_range_loop)] // `k` indexes rows, outputs and lane masks alike
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn decode<const F: u8>(rowp: &[*const u8; 4], q: usize, nvalid: usize) -> WQuad {
    let z = _mm512_setzero_si512();
    let mut out = WQuad {
        w0: [z; 4],
        w1: [z; 4],
        d: _mm512_setzero_ps(),
        m: _mm512_setzero_ps(),
        mins: [_mm512_setzero_ps(); 2],
    };
    let lo4 = _mm512_set1_epi8(0x0F);
    // SAFETY (whole body): all loads stay inside the quad's bytes of each row (full quads), or
    // are masked to the `nvalid` blocks inside the row (masked-off bytes are not accessed).
    unsafe {
        match F {
            F_Q4_1 => {
                let idx = load_idx(&IDX_Q4_1);
                let hidx = _mm512_loadu_si512(IDX32_Q4_1.as_ptr().cast());
                let mut hdr = z;
                for k in 0..4 {
                    let p = rowp[k].add(q * 80);
                    let (a, b) = if nvalid == 4 {
                        (
                            _mm512_loadu_si512(p.cast()),
                            _mm512_castsi128_si512(_mm_loadu_si128(p.add(64).cast())),
                        )
                    } else {
                        let nb = (nvalid * 20) as isize;
                        (
                            _mm512_maskz_loadu_epi8(bmask(nb), p.cast()),
                            _mm512_maskz_loadu_epi8(bmask(nb - 64), p.add(64).cast()),
                        )
                    };
                    let qs = _mm512_permutex2var_epi8(a, idx, b);
                    out.w0[k] = _mm512_and_si512(qs, lo4);
                    out.w1[k] = _mm512_and_si512(_mm512_srli_epi16(qs, 4), lo4);
                    hdr = _mm512_mask_permutexvar_epi32(hdr, 0x1111 << k, hidx, a);
                }
                out.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
                out.m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)));
            }
            F_Q4_0 | F_IQ4NL => {
                let table = _mm512_loadu_si512(IQ4_TABLE.as_ptr().cast());
                let idx = load_idx(&IDX_Q4_0);
                let hidx = _mm512_loadu_si512(IDX16_Q4_0.as_ptr().cast());
                let mut hdr = z;
                for k in 0..4 {
                    let p = rowp[k].add(q * 72);
                    let (a, b) = if nvalid == 4 {
                        (
                            _mm512_loadu_si512(p.cast()),
                            _mm512_castsi128_si512(_mm_loadl_epi64(p.add(64).cast())),
                        )
                    } else {
                        let nb = (nvalid * 18) as isize;
                        (
                            _mm512_maskz_loadu_epi8(bmask(nb), p.cast()),
                            _mm512_maskz_loadu_epi8(bmask(nb - 64), p.add(64).cast()),
                        )
                    };
                    let qs = _mm512_permutex2var_epi8(a, idx, b);
                    out.w0[k] = _mm512_and_si512(qs, lo4);
                    out.w1[k] = _mm512_and_si512(_mm512_srli_epi16(qs, 4), lo4);
                    if F == F_IQ4NL {
                        // Table indices to code book values (+ 128).
                        out.w0[k] = _mm512_shuffle_epi8(table, out.w0[k]);
                        out.w1[k] = _mm512_shuffle_epi8(table, out.w1[k]);
                    }
                    hdr = _mm512_mask_permutexvar_epi16(hdr, 0x0101_0101u32 << (2 * k), hidx, a);
                }
                out.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
            }
            F_Q5_0 | F_Q5_1 => {
                // Block: f16 d [, f16 m], u32 qh (5th bits), 16 bytes of nibbles.
                let (bs, qh_at) = if F == F_Q5_0 {
                    (size_of::<BlockQ5_0>(), offset_of!(BlockQ5_0, qh))
                } else {
                    (size_of::<BlockQ5_1>(), offset_of!(BlockQ5_1, qh))
                };
                let idx = load_idx(if F == F_Q5_0 { &IDX_Q5_0 } else { &IDX_Q5_1 });
                let hidx = if F == F_Q5_0 {
                    _mm512_loadu_si512(IDX16_Q5_0.as_ptr().cast())
                } else {
                    _mm512_loadu_si512(IDX32_Q5_1.as_ptr().cast())
                };
                let fifth = _mm512_set1_epi8(0x10);
                let mut hdr = z;
                for k in 0..4 {
                    let p = rowp[k].add(q * 4 * bs);
                    let nb = (nvalid * bs) as isize;
                    let (a, b) = (
                        _mm512_maskz_loadu_epi8(bmask(nb), p.cast()),
                        _mm512_maskz_loadu_epi8(bmask(nb - 64), p.add(64).cast()),
                    );
                    let qs = _mm512_permutex2var_epi8(a, idx, b);
                    // Bit `e` of block `L`'s qh is the 5th bit of element `e`: byte `16L + e` of
                    // W0 for e < 16, of W1 for the rest.
                    let (mut high0, mut high1) = (0u64, 0u64);
                    for l in 0..nvalid {
                        let qh = std::ptr::read_unaligned(p.add(l * bs + qh_at).cast::<u32>());
                        let qh = u32::from_le(qh);
                        high0 |= u64::from(qh & 0xFFFF) << (16 * l);
                        high1 |= u64::from(qh >> 16) << (16 * l);
                    }
                    let w0 = _mm512_and_si512(qs, lo4);
                    let w1 = _mm512_and_si512(_mm512_srli_epi16(qs, 4), lo4);
                    out.w0[k] = _mm512_mask_add_epi8(w0, high0, w0, fifth);
                    out.w1[k] = _mm512_mask_add_epi8(w1, high1, w1, fifth);
                    if F == F_Q5_0 {
                        let h = _mm512_permutex2var_epi16(a, hidx, b);
                        hdr = _mm512_mask_mov_epi16(hdr, 0x0101_0101u32 << (2 * k), h);
                    } else {
                        let h = _mm512_permutex2var_epi32(a, hidx, b);
                        hdr = _mm512_mask_mov_epi32(hdr, 0x1111 << k, h);
                    }
                }
                out.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
                if F == F_Q5_1 {
                    out.m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)));
                }
            }
            F_Q2K | F_Q3K => return decode_k23::<F>(rowp, q / 2)[q % 2],
            F_IQ4XS => {
                let (blk, h) = (q / 2, q % 2);
                let table = _mm512_loadu_si512(IQ4_TABLE.as_ptr().cast());
                for k in 0..4 {
                    let p = rowp[k].add(blk * size_of::<BlockIQ4XS>());
                    // Sub-block `4h + L`'s 16 bytes are 128-bit lane `L`.
                    let v = _mm512_loadu_si512(p.add(offset_of!(BlockIQ4XS, qs) + 64 * h).cast());
                    let lo = _mm512_and_si512(v, lo4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    out.w0[k] = _mm512_shuffle_epi8(table, lo);
                    out.w1[k] = _mm512_shuffle_epi8(table, hi);
                }
                // `scale_iq4xs` of sub-blocks `4h + L`, lane `4L + k`, times d.
                let heads = rows16(rowp.map(|r| r.add(blk * size_of::<BlockIQ4XS>())));
                let x = _mm512_maskz_permutexvar_epi8(
                    IQ4XS_SCALE_MASK,
                    load_idx(&IQ4XS_SCALE_IDX[h]),
                    heads,
                );
                let shr = |part: usize| _mm512_loadu_si512(IQ4XS_SHR[h][part].as_ptr().cast());
                let low = _mm512_and_si512(_mm512_srlv_epi32(x, shr(0)), _mm512_set1_epi32(0xF));
                let high = _mm512_and_si512(_mm512_srlv_epi32(x, shr(1)), _mm512_set1_epi32(3));
                let ls = _mm512_sub_epi32(
                    _mm512_or_si512(low, _mm512_slli_epi32::<4>(high)),
                    _mm512_set1_epi32(32),
                );
                let (d, _) = f16_pair(heads, &IQ4XS_D_IDX);
                out.d = scaled(d, ls);
            }
            F_Q8_0 => {
                let idx = load_idx(&IDX_Q8_0);
                let hidx = _mm512_loadu_si512(IDX16_Q8_0.as_ptr().cast());
                let flip = _mm512_set1_epi8(-128);
                let mut hdr = z;
                for k in 0..4 {
                    let p = rowp[k].add(q * 136);
                    let (a, b, c, e) = if nvalid == 4 {
                        (
                            _mm512_loadu_si512(p.cast()),
                            _mm512_loadu_si512(p.add(64).cast()),
                            _mm512_loadu_si512(p.add(16).cast()),
                            _mm512_maskz_loadu_epi8(bmask(56), p.add(80).cast()),
                        )
                    } else {
                        let nb = (nvalid * 34) as isize;
                        (
                            _mm512_maskz_loadu_epi8(bmask(nb), p.cast()),
                            _mm512_maskz_loadu_epi8(bmask(nb - 64), p.add(64).cast()),
                            _mm512_maskz_loadu_epi8(bmask(nb - 16), p.add(16).cast()),
                            _mm512_maskz_loadu_epi8(bmask(nb - 80), p.add(80).cast()),
                        )
                    };
                    let lo = _mm512_permutex2var_epi8(a, idx, b);
                    let hi = _mm512_permutex2var_epi8(c, idx, e);
                    out.w0[k] = _mm512_xor_si512(lo, flip);
                    out.w1[k] = _mm512_xor_si512(hi, flip);
                    let h = _mm512_permutex2var_epi16(a, hidx, b);
                    hdr = _mm512_mask_mov_epi16(hdr, 0x0101_0101u32 << (2 * k), h);
                }
                out.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
            }
            F_Q4K | F_Q5K => {
                let (blk, h) = (q / 2, q % 2);
                let i0 = _mm512_loadu_si512(QIDX_W0_KQ4.as_ptr().cast());
                let i1 = _mm512_loadu_si512(QIDX_W1_KQ4.as_ptr().cast());
                let (block_bytes, qs_at) = if F == F_Q4K {
                    (size_of::<BlockQ4K>(), offset_of!(BlockQ4K, qs))
                } else {
                    (size_of::<BlockQ5K>(), offset_of!(BlockQ5K, qs))
                };
                let bit = _mm512_loadu_si512(Q5K_BIT[h].as_ptr().cast());
                let fifth = _mm512_set1_epi8(0x10);
                for k in 0..4 {
                    let p = rowp[k].add(blk * block_bytes);
                    let v = _mm512_loadu_si512(p.add(qs_at + 64 * h).cast());
                    let lo = _mm512_and_si512(v, lo4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    out.w0[k] = _mm512_permutex2var_epi64(lo, i0, hi);
                    out.w1[k] = _mm512_permutex2var_epi64(lo, i1, hi);
                    if F == F_Q5K {
                        // Bit `4h + L` of high-bit byte `e` (elements 0..16) / `16 + e`.
                        let qh0 = _mm512_broadcast_i32x4(_mm_loadu_si128(p.add(16).cast()));
                        let qh1 = _mm512_broadcast_i32x4(_mm_loadu_si128(p.add(32).cast()));
                        let k0 = _mm512_test_epi8_mask(qh0, bit);
                        let k1 = _mm512_test_epi8_mask(qh1, bit);
                        out.w0[k] = _mm512_mask_add_epi8(out.w0[k], k0, out.w0[k], fifth);
                        out.w1[k] = _mm512_mask_add_epi8(out.w1[k], k1, out.w1[k], fifth);
                    }
                }
                // `scale_min_k4` of sub-blocks `4h + L`, lane `4L + k`: dword bytes
                // `q[L], q[L + 4], q[L + 8]` of the 12 scale bytes `q`.
                let heads = rows16(rowp.map(|r| r.add(blk * block_bytes)));
                let x =
                    _mm512_maskz_permutexvar_epi8(KQ4_SCALE_MASK, load_idx(&KQ4_SCALE_IDX), heads);
                let bits = |v: __m512i, mask: i32| _mm512_and_si512(v, _mm512_set1_epi32(mask));
                let (sc, m) = if h == 0 {
                    (bits(x, 63), bits(_mm512_srli_epi32::<8>(x), 63))
                } else {
                    (
                        _mm512_or_si512(
                            bits(_mm512_srli_epi32::<16>(x), 0xF),
                            bits(_mm512_srli_epi32::<2>(x), 0x30),
                        ),
                        _mm512_or_si512(
                            bits(_mm512_srli_epi32::<20>(x), 0xF),
                            bits(_mm512_srli_epi32::<10>(x), 0x30),
                        ),
                    )
                };
                let (d, dmin) = f16_pair(heads, &KQ4_D_IDX);
                out.d = scaled(d, sc);
                out.m = neg_scaled(dmin, m);
            }
            F_Q6K => {
                let (blk, h) = (q / 2, q % 2);
                let i0 = _mm512_loadu_si512(QIDX_W0_KQ6.as_ptr().cast());
                let i1 = _mm512_loadu_si512(QIDX_W1_KQ6.as_ptr().cast());
                let shl = _mm512_loadu_si512(Q6_SHL.as_ptr().cast());
                let shr = _mm512_loadu_si512(Q6_SHR.as_ptr().cast());
                let m30 = _mm512_set1_epi8(0x30);
                for k in 0..4 {
                    let p = rowp[k].add(blk * 210);
                    let ql = _mm512_loadu_si512(p.add(64 * h).cast());
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h).cast()));
                    let lo = _mm512_and_si512(ql, lo4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4);
                    let hlo = _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30);
                    let hhi = _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30);
                    let qlo = _mm512_or_si512(lo, hlo);
                    let qhi = _mm512_or_si512(hi, hhi);
                    out.w0[k] = _mm512_permutex2var_epi64(qlo, i0, qhi);
                    out.w1[k] = _mm512_permutex2var_epi64(qlo, i1, qhi);
                }
                // Signed scales `8h + 2L` (elements 0..16) and `8h + 2L + 1`, lane `4L + k`.
                let at = |off: usize| rowp.map(|r| r.add(blk * 210 + off));
                let x = _mm512_permutexvar_epi8(load_idx(&Q6K_SCALE_IDX[h]), rows16(at(192)));
                let (d, _) = f16_pair(rows16(at(194)), &Q6K_D_IDX);
                out.d = scaled(d, _mm512_cvtepi8_epi32(_mm512_castsi512_si128(x)));
                out.m = scaled(d, _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32::<1>(x)));
            }
            _ => unreachable!(),
        }
    }
    out
}

/// Q2_K/Q3_K: GF(2) affine matrices, one per 64-bit lane (see `_mm512_gf2p8affine_epi64_epi8`),
/// that move bits `2L` and `2L + 1` of every byte of 128-bit lane `L` to bits 0 and 1 and clear
/// the rest: the 2-bit quants of sub-block `4h + L` in one instruction instead of a shift and a
/// mask.
static K23_PLANE: [u64; 8] = {
    let mut t = [0u64; 8];
    let mut i = 0;
    while i < 8 {
        let l = i / 2;
        // Result bit `j` is the parity of matrix byte `7 - j` and the source byte.
        t[i] = ((1u64 << (2 * l)) << 56) | ((1u64 << (2 * l + 1)) << 48);
        i += 1;
    }
    t
};
/// `0.0 ..= 15.0`: a 4-bit integer to f32 with one `vpermps` (which reads the low 4 index bits
/// only, so the nibble needs no mask), the same value `cvtdq2ps` gives.
pub(crate) static NIBBLE_F32: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
];

/// Decodes both quads (halves `h` = 0, 1) of super-block `blk` of the Q2_K or Q3_K rows at
/// `rowp`, as [`decode`] does one: the header loads and f16 conversions (and Q3_K's high-bit
/// vectors) are shared by the two halves.
///
/// # Safety
/// Each `rowp[k]` points at a full encoded row with a super-block `blk`.
#[inline]
#[allow(clippy::needless_range_loop)] // `k` indexes rows and outputs alike
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn decode_k23<const F: u8>(rowp: &[*const u8; 4], blk: usize) -> [WQuad; 2] {
    let z = _mm512_setzero_si512();
    let zf = _mm512_setzero_ps();
    let mut out = [WQuad {
        w0: [z; 4],
        w1: [z; 4],
        d: zf,
        m: zf,
        mins: [zf; 2],
    }; 2];
    let (block_bytes, qs_at) = if F == F_Q2K {
        (size_of::<BlockQ2K>(), offset_of!(BlockQ2K, qs))
    } else {
        (size_of::<BlockQ3K>(), offset_of!(BlockQ3K, qs))
    };
    // SAFETY (whole body): every load is inside super-block `blk` of each row.
    unsafe {
        // 2-bit quants of sub-block `4h + L`: bits `2L..2L + 2` of qs bytes `32h..32h + 32`;
        // Q3_K adds bit `4h + L` of hmask byte `e` (element `e` of the sub-block) as the third.
        let plane = _mm512_loadu_si512(K23_PLANE.as_ptr().cast());
        let third = _mm512_set1_epi8(4);
        let bit = Q5K_BIT.map(|b| load_idx(&b));
        for k in 0..4 {
            let p = rowp[k].add(blk * block_bytes);
            let bcast = |off: usize| _mm512_broadcast_i32x4(_mm_loadu_si128(p.add(off).cast()));
            let hmask = if F == F_Q3K {
                [bcast(0), bcast(16)]
            } else {
                [z, z]
            };
            for h in 0..2 {
                let mut w0 = _mm512_gf2p8affine_epi64_epi8::<0>(bcast(qs_at + 32 * h), plane);
                let mut w1 = _mm512_gf2p8affine_epi64_epi8::<0>(bcast(qs_at + 32 * h + 16), plane);
                if F == F_Q3K {
                    let k0 = _mm512_test_epi8_mask(hmask[0], bit[h]);
                    let k1 = _mm512_test_epi8_mask(hmask[1], bit[h]);
                    w0 = _mm512_mask_add_epi8(w0, k0, w0, third);
                    w1 = _mm512_mask_add_epi8(w1, k1, w1, third);
                }
                out[h].w0[k] = w0;
                out[h].w1[k] = w1;
            }
        }
        // The scales of sub-blocks `4h + L` of the 4 rows, lane `4L + k`.
        let tail = rowp.map(|r| r.add(blk * block_bytes + block_bytes - 16));
        if F == F_Q3K {
            // Low 4 bits, high 2 bits, minus 32 (`scale_k3`), times d.
            let m4 = _mm512_set1_epi32(0xF);
            let tails = rows16(tail);
            let x = _mm512_permutexvar_epi8(load_idx(&Q3K_SCALE_IDX), tails);
            let (d, _) = f16_pair(tails, &Q3K_D_IDX);
            for h in 0..2 {
                let low = if h == 0 { x } else { _mm512_srli_epi32::<4>(x) };
                let shr = |e: usize| _mm512_loadu_si512(Q3K_HIGH_SHR[h][e].as_ptr().cast());
                let scale = |low: __m512i, e: usize| {
                    let high = _mm512_and_si512(_mm512_srlv_epi32(x, shr(e)), _mm512_set1_epi32(3));
                    let v =
                        _mm512_or_si512(_mm512_and_si512(low, m4), _mm512_slli_epi32::<4>(high));
                    _mm512_sub_epi32(v, _mm512_set1_epi32(32))
                };
                out[h].d = scaled(d, scale(low, 0));
                out[h].m = scaled(d, scale(_mm512_srli_epi32::<8>(low), 1));
            }
        } else {
            // Per half `e`: scale = low nibble of byte `e`, min = its high nibble.
            let heads = rows16(rowp.map(|r| r.add(blk * block_bytes)));
            let (d, dmin) = f16_pair(rows16(tail), &Q2K_D_IDX);
            let nibble_f32 = _mm512_loadu_ps(NIBBLE_F32.as_ptr());
            let neg = _mm512_set1_ps(-0.0);
            for h in 0..2 {
                let x = _mm512_permutexvar_epi8(load_idx(&Q2K_SCALE_IDX[h]), heads);
                let nib = |v: __m512i| _mm512_permutexvar_ps(v, nibble_f32);
                out[h].d = _mm512_mul_ps(d, nib(x));
                out[h].m = _mm512_mul_ps(d, nib(_mm512_srli_epi32::<8>(x)));
                // `-(dmin * m)`, as the reference computes it (also for NaN signs).
                let min = |v: __m512i| _mm512_xor_ps(_mm512_mul_ps(dmin, nib(v)), neg);
                out[h].mins = [
                    min(_mm512_srli_epi32::<4>(x)),
                    min(_mm512_srli_epi32::<12>(x)),
                ];
            }
        }
    }
    out
}

/// Lane `4L + k` = sum of the 4 dwords of 128-bit lane `L` of `p[k]`.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn reduce4(p: [__m512i; 4]) -> __m512i {
    let s01 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(p[0], p[1]),
        _mm512_unpackhi_epi32(p[0], p[1]),
    );
    let s23 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(p[2], p[3]),
        _mm512_unpackhi_epi32(p[2], p[3]),
    );
    _mm512_add_epi32(
        _mm512_unpacklo_epi64(s01, s23),
        _mm512_unpackhi_epi64(s01, s23),
    )
}

/// Accumulates the products of one decoded quad with one token's activation quad.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn accumulate<const F: u8>(w: &WQuad, a: &ActQuad, acc: __m512) -> __m512 {
    // SAFETY: `ActQuad` is 64-byte aligned and its fields are 64 bytes each.
    let ld = |p: *const u8| unsafe { _mm512_load_si512(p.cast()) };
    let x0 = ld(a.x0.as_ptr().cast());
    let x1 = ld(a.x1.as_ptr().cast());
    let dx = _mm512_castsi512_ps(ld(a.dx.as_ptr().cast()));
    let z = _mm512_setzero_si512();
    let shift = _mm_cvtsi32_si128(offset_shift(F));
    if is_split(F) {
        let p0 = [0, 1, 2, 3].map(|k| _mm512_dpbusd_epi32(z, w.w0[k], x0));
        let p1 = [0, 1, 2, 3].map(|k| _mm512_dpbusd_epi32(z, w.w1[k], x1));
        let sq0 = ld(a.sq0.as_ptr().cast());
        let sq1 = ld(a.sq1.as_ptr().cast());
        let (mut i0, mut i1) = (reduce4(p0), reduce4(p1));
        if offset_shift(F) != 0 {
            i0 = _mm512_sub_epi32(i0, _mm512_sll_epi32(sq0, shift));
            i1 = _mm512_sub_epi32(i1, _mm512_sll_epi32(sq1, shift));
        }
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(w.d, dx), acc);
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(w.m, dx), acc);
        if has_min(F) {
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq0), _mm512_mul_ps(w.mins[0], dx), acc);
            return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq1), _mm512_mul_ps(w.mins[1], dx), acc);
        }
        return acc;
    }
    let p =
        [0, 1, 2, 3].map(|k| _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, w.w0[k], x0), w.w1[k], x1));
    let mut r = reduce4(p);
    if offset_shift(F) != 0 {
        r = _mm512_sub_epi32(r, _mm512_sll_epi32(ld(a.sq.as_ptr().cast()), shift));
    }
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), _mm512_mul_ps(w.d, dx), acc);
    if has_min(F) {
        let sx = _mm512_castsi512_ps(ld(a.sx.as_ptr().cast()));
        return _mm512_fmadd_ps(w.m, sx, acc);
    }
    acc
}

/// Row sums of an accumulator: element `k` = sum over `L` of lane `4L + k`, in a fixed order.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn row_sums(acc: __m512) -> [f32; 4] {
    let h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
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
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn tile<const F: u8, const T: usize>(
    rowp: &[*const u8; 4],
    acts: *const ActQuad,
    nq: usize,
    nblocks: usize,
    pf: (*const u8, usize, usize),
) -> [[f32; 4]; T] {
    let mut acc = [_mm512_setzero_ps(); T];
    let prefetch = |q: usize| prefetch_step(pf, q, into_l2(F));
    let mut q = 0;
    while q < nq {
        if is_k23(F) {
            // Both quads of a super-block at once (a K-quant row is whole super-blocks, so `nq`
            // is even), accumulated in the same order as one quad at a time.
            prefetch(q);
            prefetch(q + 1);
            // SAFETY: forwarded from the caller.
            let ws = unsafe { decode_k23::<F>(rowp, q / 2) };
            for (t, a) in acc.iter_mut().enumerate() {
                // SAFETY: `t * nq + q + 1 < T * nq`.
                let aq = unsafe { &*acts.add(t * nq + q) };
                *a = accumulate::<F>(&ws[0], aq, *a);
                // SAFETY: as above.
                let aq = unsafe { &*acts.add(t * nq + q + 1) };
                *a = accumulate::<F>(&ws[1], aq, *a);
            }
            q += 2;
            continue;
        }
        prefetch(q);
        let nvalid = (nblocks - 4 * q).min(4);
        // SAFETY: forwarded from the caller.
        let w = unsafe { decode::<F>(rowp, q, nvalid) };
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: `t * nq + q < T * nq`.
            let aq = unsafe { &*acts.add(t * nq + q) };
            *a = accumulate::<F>(&w, aq, *a);
        }
        q += 1;
    }
    acc.map(|a| row_sums(a))
}

/// Activation bytes per token chunk of the many-token path (stays in a 1 MiB L2 with room for
/// the decoded quads).
const DECODED_CHUNK_BYTES: usize = 256 << 10;

thread_local! {
    /// The decoded quads of one 4-row group (many-token products), reused per thread.
    static DECODED: RefCell<Vec<WQuad>> = const { RefCell::new(Vec::new()) };
}

/// [`tile`] over already decoded quads: the same accumulation, in the same order, per token.
///
/// # Safety
/// `acts` is valid for `T * nq` quads; `decoded` holds the group's `nq` quads.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn tile_decoded<const F: u8, const T: usize>(
    decoded: &[WQuad],
    acts: *const ActQuad,
    nq: usize,
) -> [[f32; 4]; T] {
    let mut acc = [_mm512_setzero_ps(); T];
    for (q, w) in decoded.iter().enumerate().take(nq) {
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: `t * nq + q < T * nq`.
            let aq = unsafe { &*acts.add(t * nq + q) };
            *a = accumulate::<F>(w, aq, *a);
        }
    }
    acc.map(|a| row_sums(a))
}

/// Rows `rows` x all `n` tokens of an integer-quantized matrix.
///
/// # Safety
/// The CPU supports the features enabled here; `acts` holds `n` tokens quantized for `w.cols`.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
pub(crate) unsafe fn quant_rows(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    by_quant_format!(fmt, rows_impl(fmt, w, acts, n, rows, out))
}

#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
fn rows_impl<const F: u8>(
    fmt: Fmt,
    w: WeightMatrix<'_>,
    acts: &[ActQuad],
    n: usize,
    rows: Range<usize>,
    out: &mut RowsOut<'_>,
) {
    let rb = fmt.row_bytes(w.cols);
    let nq = quads_per_token(w.cols);
    let nblocks = w.cols / 32;
    assert!(acts.len() >= n * nq && rows.end <= w.rows && w.data.len() >= w.rows * rb);
    if n > 8 {
        // Many tokens: in chunks of tokens whose activations stay in L2, each 4-row group is
        // decoded once per chunk and its quads reused by every tile of the chunk.
        let chunk = (DECODED_CHUNK_BYTES / (nq * size_of::<ActQuad>())).max(8) / 8 * 8;
        return DECODED.with(|cell| {
            let mut decoded = cell.borrow_mut();
            decoded.clear();
            decoded.reserve(nq);
            for (tc, g) in (0..n)
                .step_by(chunk)
                .flat_map(|tc| rows.clone().step_by(4).map(move |g| (tc, g)))
            {
                let t_end = (tc + chunk).min(n);
                let rowp = [0, 1, 2, 3].map(|k| {
                    let r = (g + k).min(rows.end - 1);
                    // SAFETY: `r < w.rows`, so the row lies inside `w.data` (asserted above).
                    unsafe { w.data.as_ptr().add(r * rb) }
                });
                decoded.clear();
                if is_k23(F) {
                    for blk in 0..nq / 2 {
                        // SAFETY: the rows are whole encoded rows of `w.cols` columns.
                        decoded.extend(unsafe { decode_k23::<F>(&rowp, blk) });
                    }
                } else {
                    for q in 0..nq {
                        let nvalid = (nblocks - 4 * q).min(4);
                        // SAFETY: the rows are whole encoded rows of `w.cols` columns.
                        decoded.push(unsafe { decode::<F>(&rowp, q, nvalid) });
                    }
                }
                let live = (rows.end - g).min(4);
                let mut t0 = tc;
                while t0 < t_end {
                    let ap = acts[t0 * nq..].as_ptr();
                    let mut emit = |t: usize, s: [f32; 4]| out.set_run(t0 + t, g, &s[..live]);
                    // SAFETY: `ap` has at least the tile's tokens, `nq` quads each.
                    let tn = unsafe {
                        match t_end - t0 {
                            8.. => {
                                let sums = tile_decoded::<F, 8>(&decoded, ap, nq);
                                sums.into_iter().enumerate().for_each(|(t, s)| emit(t, s));
                                8
                            }
                            4..=7 => {
                                let sums = tile_decoded::<F, 4>(&decoded, ap, nq);
                                sums.into_iter().enumerate().for_each(|(t, s)| emit(t, s));
                                4
                            }
                            2..=3 => {
                                let sums = tile_decoded::<F, 2>(&decoded, ap, nq);
                                sums.into_iter().enumerate().for_each(|(t, s)| emit(t, s));
                                2
                            }
                            _ => {
                                let sums = tile_decoded::<F, 1>(&decoded, ap, nq);
                                sums.into_iter().enumerate().for_each(|(t, s)| emit(t, s));
                                1
                            }
                        }
                    };
                    t0 += tn;
                }
            }
        });
    }
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
            let pf = if t0 == 0 {
                prefetch_plan(w.data, rb, nq, g, &rows, ahead_groups::<F>(rb))
            } else {
                (w.data.as_ptr(), 0, 0)
            };
            let rowp = [0, 1, 2, 3].map(|k| {
                let r = (g + k).min(rows.end - 1);
                // SAFETY: `r < w.rows`, so the row lies inside `w.data` (asserted above).
                unsafe { w.data.as_ptr().add(r * rb) }
            });
            // SAFETY: the rows are whole encoded rows of `w.cols` columns, `ap` has `tn` tokens.
            let live = (rows.end - g).min(4);
            let mut emit = |t: usize, s: [f32; 4]| out.set_run(t0 + t, g, &s[..live]);
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

/// Scale and quants (elements 0..16, 16..32 as i32 lanes) of the 32-element block at `p`, as
/// [`super::act::quantize_token`] computes them.
///
/// # Safety
/// `p` has 32 readable floats; the CPU supports the features enabled here.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
unsafe fn quant_block(p: *const f32) -> (f32, __m512i, __m512i) {
    // SAFETY: forwarded from the caller.
    let (v0, v1) = unsafe { (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))) };
    // `max_ps(new, m)` returns `m` where `new` is NaN, as `f32::max` ignores NaN; the
    // reduction then sees no NaN.
    let m = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps());
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v1), m));
    let (d, id) = block_scale(amax);
    let idv = _mm512_set1_ps(id);
    // Round to nearest even (the default MXCSR mode), as `round_ties_even` does. NaN products
    // (non-finite activations) become 0, as the scalar `as i8` makes them, instead of the
    // conversion's i32::MIN, which would overflow the blocks' sums.
    let finite = |m: __m512| _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(m, m), m);
    let q0 = _mm512_cvtps_epi32(finite(_mm512_mul_ps(v0, idv)));
    let q1 = _mm512_cvtps_epi32(finite(_mm512_mul_ps(v1, idv)));
    (d, q0, q1)
}

/// AVX-512 version of [`super::act::quantize_token`], producing identical bytes.
///
/// # Safety
/// The CPU supports the features enabled here.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
pub(crate) unsafe fn quantize_token(x: &[f32], acts: &mut [ActQuad]) {
    let nblocks = x.len() / 32;
    // Lane `4L + k` takes element `L`.
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (qi, a) in acts.iter_mut().enumerate() {
        let (mut dv, mut sv) = ([0.0f32; 16], [0.0f32; 16]);
        let (mut s0v, mut s1v) = ([0i32; 16], [0i32; 16]);
        let mut x0 = _mm512_setzero_si512();
        let mut x1 = _mm512_setzero_si512();
        for l in 0..4 {
            let b = 4 * qi + l;
            if b >= nblocks {
                break;
            }
            // SAFETY: block `b` is inside `x` (32 floats).
            let (d, q0, q1) = unsafe { quant_block(x.as_ptr().add(32 * b)) };
            dv[l] = d;
            s0v[l] = _mm512_reduce_add_epi32(q0);
            s1v[l] = _mm512_reduce_add_epi32(q1);
            sv[l] = d * (s0v[l] + s1v[l]) as f32;
            // Bytes 16L..16L + 16 of x0 / x1.
            let m = 0xFFFFu64 << (16 * l);
            x0 = _mm512_mask_mov_epi8(x0, m, _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(q0)));
            x1 = _mm512_mask_mov_epi8(x1, m, _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(q1)));
        }
        // SAFETY: the arrays are 16 elements; `a`'s fields are 64 aligned bytes each.
        unsafe {
            let spr = |v: __m512i| _mm512_permutexvar_epi32(spread, v);
            let ld = |p: *const i32| _mm512_loadu_si512(p.cast());
            let (s0, s1) = (spr(ld(s0v.as_ptr())), spr(ld(s1v.as_ptr())));
            _mm512_store_si512(a.x0.as_mut_ptr().cast(), x0);
            _mm512_store_si512(a.x1.as_mut_ptr().cast(), x1);
            _mm512_store_si512(a.dx.as_mut_ptr().cast(), spr(ld(dv.as_ptr().cast())));
            _mm512_store_si512(a.sx.as_mut_ptr().cast(), spr(ld(sv.as_ptr().cast())));
            _mm512_store_si512(a.sq.as_mut_ptr().cast(), _mm512_add_epi32(s0, s1));
            _mm512_store_si512(a.sq0.as_mut_ptr().cast(), s0);
            _mm512_store_si512(a.sq1.as_mut_ptr().cast(), s1);
        }
    }
}

/// AVX-512 version of [`super::act::quantize_blocks`], producing identical bytes.
///
/// # Safety
/// The CPU supports the features enabled here.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c"
)]
pub(crate) unsafe fn quantize_blocks(x: &[f32], out: &mut [ActBlock]) {
    for (b, o) in out.iter_mut().enumerate().take(x.len() / 32) {
        // SAFETY: block `b` is inside `x` (32 floats).
        let (d, q0, q1) = unsafe { quant_block(x.as_ptr().add(32 * b)) };
        let (b0, b1) = (_mm512_cvtepi32_epi8(q0), _mm512_cvtepi32_epi8(q1));
        // The halves' sums from the bytes: `vpsadbw` of the quants offset by 128 (each in
        // -127..=127) sums 8 at a time; 16 offsets (2048) come off each half.
        let sad = |v: __m128i| {
            let s = _mm_sad_epu8(_mm_xor_si128(v, _mm_set1_epi8(-128)), _mm_setzero_si128());
            (_mm_cvtsi128_si64(s) + _mm_extract_epi64::<1>(s)) as i32 - 2048
        };
        let sum0 = sad(b0);
        let sum = sum0 + sad(b1);
        // SAFETY: each store writes 16 bytes inside the 32-byte `q`.
        unsafe {
            _mm_storeu_si128(o.q.as_mut_ptr().cast(), b0);
            _mm_storeu_si128(o.q.as_mut_ptr().add(16).cast(), b1);
        }
        o.d = d;
        o.sx = d * sum as f32;
        o.sq = sum;
        o.sq0 = sum0;
    }
}

/// The software prefetch of a decode pass (the first over the rows `rows` of `data`, rows of
/// `rb` bytes and `nq` quads), for the 4-row group at `g`: the group `ahead` groups ahead (inside
/// the rows) is the region `(pointer, length, bytes per quad)` that [`tile`] prefetches spread
/// over the group's quads; at the first group, the groups up to that one are prefetched here
/// (into L2 where `into_l2`, else L1). Decode streams the weights from DRAM once, faster than
/// the hardware prefetchers ramp up on each task's rows.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn prefetch_plan(
    data: &[u8],
    rb: usize,
    nq: usize,
    g: usize,
    rows: &Range<usize>,
    (ahead, into_l2): (usize, bool),
) -> (*const u8, usize, usize) {
    let (start, end) = (rows.start, rows.end);
    let pf_start = (g + 4 * ahead).min(end) * rb;
    let pf_end = (g + 4 * ahead + 4).min(end) * rb;
    if g == start {
        let e = (g + 4 * ahead).min(end) * rb;
        for off in ((g + 4) * rb..e).step_by(64) {
            // SAFETY: `off < end * rb <= data.len()`; prefetching has no side effects.
            unsafe { prefetch_line(data.as_ptr().add(off), into_l2) };
        }
    }
    if pf_end <= pf_start {
        return (data.as_ptr(), 0, 0);
    }
    let len = pf_end - pf_start;
    (
        data[pf_start..].as_ptr(),
        len,
        len.div_ceil(nq).next_multiple_of(64),
    )
}

/// Step `q` of a prefetch plan (`(start, len, step)` from [`prefetch_plan`]): the lines of
/// bytes `q * step .. (q + 1) * step` of the region (none past its end), into L2 or L1.
#[inline(always)]
pub(crate) fn prefetch_step((pp, plen, pstep): (*const u8, usize, usize), q: usize, into_l2: bool) {
    let mut off = q * pstep;
    let end = (off + pstep).min(plen);
    while off < end {
        // `off < plen`: inside the prefetch region (and a prefetch has no side effects anyway).
        prefetch_line(pp.wrapping_add(off), into_l2);
        off += 64;
    }
}

/// A software prefetch of the line at `p`, into L2 (`_MM_HINT_T2`) or L1.
#[inline(always)]
fn prefetch_line(p: *const u8, into_l2: bool) {
    // SAFETY: a prefetch is a hint without side effects (any address).
    unsafe {
        if into_l2 {
            _mm_prefetch::<_MM_HINT_T2>(p.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }
    }
}

/// Groups of 4 rows prefetched ahead while decoding (measured best of 1..4 on Zen 4).
pub(crate) const PF_AHEAD: usize = 2;

/// Bytes Q8_0 decode prefetches ahead, into L2. Q8_0 has the fewest operations per byte of
/// the formats, so its 4-row kernel streams fastest and waits most on DRAM: prefetching into
/// L1 two groups ahead left it at 59-68% of the read bandwidth on 2 threads. Measured on Zen 4
/// (2 threads, A/B alternated in one process on a loaded machine, medians of ratios over 3 x
/// 15 rounds, shapes 768x1024, 1536x576, 49152x576, 576x1536): 16 KiB into L2 1.04-1.29x the
/// L1 prefetch, 8 KiB into L2 0.91-1.18x, 32 KiB 0.95-1.22x, 4 KiB into L1 0.86-0.98x. The
/// other formats (Q4_K measured 0.87-0.93x with it) keep the L1 prefetch.
const Q8_0_PF_BYTES: usize = 16 << 10;

/// Whether format `F`'s decode prefetches into L2.
const fn into_l2(f: u8) -> bool {
    f == F_Q8_0
}

/// The prefetch distance (in 4-row groups of `rb`-byte rows) and level of format `F`'s decode.
fn ahead_groups<const F: u8>(rb: usize) -> (usize, bool) {
    if into_l2(F) {
        ((Q8_0_PF_BYTES / (4 * rb).max(1)).max(1), true)
    } else {
        (PF_AHEAD, false)
    }
}

/// Decode (n <= 2) tasks per thread: fewer, longer row runs keep the prefetch streams going;
/// more than one per thread still lets a thread pick up work a descheduled one left.
pub(crate) const DECODE_TASKS_PER_THREAD: usize = 4;
