//! The weight encodings the kernels support. The block layouts, sizes and the scalar decoding of
//! a block are weight-cache's ([`weight_cache::quant`], [`GgmlType`]): one description serves its
//! dequantization and these kernels.

use half::{bf16, f16};
use weight_cache::GgmlType;
pub(crate) use weight_cache::quant::SubBlock as Sub;

/// Internal encoding tag (one per format with a kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fmt {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

impl Fmt {
    pub(crate) fn of(t: GgmlType) -> Option<Self> {
        Some(match t {
            GgmlType::F32 => Self::F32,
            GgmlType::F16 => Self::F16,
            GgmlType::BF16 => Self::BF16,
            GgmlType::Q4_0 => Self::Q4_0,
            GgmlType::Q4_1 => Self::Q4_1,
            GgmlType::Q5_0 => Self::Q5_0,
            GgmlType::Q5_1 => Self::Q5_1,
            GgmlType::Q8_0 => Self::Q8_0,
            GgmlType::Q2_K => Self::Q2K,
            GgmlType::Q3_K => Self::Q3K,
            GgmlType::Q4_K => Self::Q4K,
            GgmlType::Q5_K => Self::Q5K,
            GgmlType::Q6_K => Self::Q6K,
            GgmlType::IQ4_NL => Self::IQ4NL,
            GgmlType::IQ4_XS => Self::IQ4XS,
            _ => return None,
        })
    }

    /// The ggml type.
    pub(crate) fn dtype(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::BF16 => GgmlType::BF16,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q5_0 => GgmlType::Q5_0,
            Self::Q5_1 => GgmlType::Q5_1,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q2K => GgmlType::Q2_K,
            Self::Q3K => GgmlType::Q3_K,
            Self::Q4K => GgmlType::Q4_K,
            Self::Q5K => GgmlType::Q5_K,
            Self::Q6K => GgmlType::Q6_K,
            Self::IQ4NL => GgmlType::IQ4_NL,
            Self::IQ4XS => GgmlType::IQ4_XS,
        }
    }

    pub(crate) fn is_float(self) -> bool {
        matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }

    /// Whether the two 16-element halves of a 32-element sub-block have their own scales (and
    /// mins): the kernels then keep two integer dot products per sub-block.
    pub(crate) fn is_split(self) -> bool {
        Sub::split(self.dtype())
    }

    /// Elements per block.
    pub(crate) fn block_elems(self) -> usize {
        self.dtype().block_size()
    }

    /// Bytes per block.
    pub(crate) fn block_bytes(self) -> usize {
        self.dtype().type_size()
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

/// The unsigned quant values of one 32-element (sub-)block `sb` of a block starting at `b`
/// (`sb` is 0 for the 32-element formats, 0..8 for the 256-element ones), in element order, and
/// their affine map (weight-cache's decoder).
#[inline(always)]
pub(crate) fn decode_sub(fmt: Fmt, b: &[u8], sb: usize, q: &mut [u8; 32]) -> Sub {
    weight_cache::quant::decode_sub_block(fmt.dtype(), b, sb, q)
}

/// Number of 32-element sub-blocks per block.
pub(crate) fn subs_per_block(fmt: Fmt) -> usize {
    fmt.block_elems() / 32
}

/// Scalar dequantization of one encoded row (weight-cache's dequantization, bit for bit).
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
                for (sb, o) in o.chunks_exact_mut(32).enumerate() {
                    let sub = decode_sub(fmt, blk, sb, &mut q);
                    for (e, o) in o.iter_mut().enumerate() {
                        *o = sub.weight(&q, e);
                    }
                }
            }
        }
    }
}
