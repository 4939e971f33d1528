//! The weight encodings the kernels support, and scalar decoding of their ggml blocks.
//!
//! Layouts (ggml-common.h): Q4_0 `{d: f16, qs: [u8; 16]}` (18 B / 32), Q4_1 `{d, m: f16, qs}`
//! (20 B / 32), Q8_0 `{d: f16, qs: [i8; 32]}` (34 B / 32), Q4_K `{d, dmin: f16, scales: [u8; 12],
//! qs: [u8; 128]}` (144 B / 256), Q6_K `{ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16}`
//! (210 B / 256). Nibble order of Q4_0/Q4_1: byte `j` holds element `j` (low) and `j + 16` (high).

use half::{bf16, f16};
use weight_cache::GgmlType;

/// Internal encoding tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fmt {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl Fmt {
    pub(crate) fn of(t: GgmlType) -> Option<Self> {
        Some(match t {
            GgmlType::F32 => Self::F32,
            GgmlType::F16 => Self::F16,
            GgmlType::BF16 => Self::BF16,
            GgmlType::Q4_0 => Self::Q4_0,
            GgmlType::Q4_1 => Self::Q4_1,
            GgmlType::Q8_0 => Self::Q8_0,
            GgmlType::Q4_K => Self::Q4K,
            GgmlType::Q6_K => Self::Q6K,
            _ => return None,
        })
    }

    pub(crate) fn is_float(self) -> bool {
        matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }

    /// Elements per block.
    pub(crate) fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    pub(crate) fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_elems() * self.block_bytes()
    }
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

#[inline(always)]
pub(crate) fn bf16_at(b: &[u8], off: usize) -> f32 {
    bf16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// Q4_K: the 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes.
#[inline(always)]
pub(crate) fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The affine map of a decoded 32-element sub-block: `w[e] = s[e / 16] * (q[e] - c) + m`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sub {
    pub(crate) s: [f32; 2],
    pub(crate) c: i32,
    pub(crate) m: f32,
}

/// The unsigned quant values of one 32-element (sub-)block `sb` of a block starting at `b`
/// (`sb` is 0 for the 32-element formats, 0..8 for the k-quants), in element order, and their
/// affine map.
#[inline(always)]
pub(crate) fn decode_sub(fmt: Fmt, b: &[u8], sb: usize, q: &mut [u8; 32]) -> Sub {
    match fmt {
        Fmt::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                q[j] = b[2 + j] & 0xF;
                q[j + 16] = b[2 + j] >> 4;
            }
            Sub {
                s: [d; 2],
                c: 8,
                m: 0.0,
            }
        }
        Fmt::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for j in 0..16 {
                q[j] = b[4 + j] & 0xF;
                q[j + 16] = b[4 + j] >> 4;
            }
            Sub { s: [d; 2], c: 0, m }
        }
        Fmt::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                q[j] = b[2 + j] ^ 0x80; // q + 128 as unsigned
            }
            Sub {
                s: [d; 2],
                c: 128,
                m: 0.0,
            }
        }
        Fmt::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, m) = q4k_scale_min(sb, &b[4..16]);
            let qs = &b[16 + 32 * (sb / 2)..16 + 32 * (sb / 2) + 32];
            let shift = 4 * (sb % 2);
            for j in 0..32 {
                q[j] = (qs[j] >> shift) & 0xF;
            }
            Sub {
                s: [d * f32::from(sc); 2],
                c: 0,
                m: -(dmin * f32::from(m)),
            }
        }
        Fmt::Q6K => {
            let d = f16_at(b, 208);
            let half = sb / 4;
            let j = sb % 4;
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            for l in 0..32 {
                let lo = if j % 2 == 0 { ql[l] } else { ql[l + 32] };
                let lo = if j < 2 { lo & 0xF } else { lo >> 4 };
                let hi = (qh[l] >> (2 * j)) & 3;
                q[l] = lo | (hi << 4);
            }
            let sc = |g: usize| d * f32::from(b[192 + g] as i8);
            Sub {
                s: [sc(8 * half + 2 * j), sc(8 * half + 2 * j + 1)],
                c: 32,
                m: 0.0,
            }
        }
        Fmt::F32 | Fmt::F16 | Fmt::BF16 => unreachable!("float formats have no quant blocks"),
    }
}

/// Number of 32-element sub-blocks per block.
pub(crate) fn subs_per_block(fmt: Fmt) -> usize {
    fmt.block_elems() / 32
}

/// Scalar dequantization of one encoded row.
pub(crate) fn dequantize_row(fmt: Fmt, row: &[u8], out: &mut [f32]) {
    match fmt {
        Fmt::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Fmt::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(row, 2 * i);
            }
        }
        Fmt::BF16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16_at(row, 2 * i);
            }
        }
        _ => {
            let be = fmt.block_elems();
            let bb = fmt.block_bytes();
            let mut q = [0u8; 32];
            for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                for sb in 0..subs_per_block(fmt) {
                    let sub = decode_sub(fmt, blk, sb, &mut q);
                    for j in 0..32 {
                        let v = f32::from(q[j]) - sub.c as f32;
                        // Same operation order as ggml's dequantize_row_* for each format.
                        o[32 * sb + j] = match fmt {
                            Fmt::Q4_0 | Fmt::Q8_0 => v * sub.s[0],
                            Fmt::Q6K => sub.s[j / 16] * v,
                            _ => sub.s[0] * v + sub.m,
                        };
                    }
                }
            }
        }
    }
}
