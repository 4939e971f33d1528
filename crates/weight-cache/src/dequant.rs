//! Scalar reference dequantization and quantization, with ggml's semantics
//! (`dequantize_row_*` and `quantize_row_*_ref` in `ggml-quants.c`).
//!
//! These are the format truth, written for clarity; fast kernels live in `gpu-pipeline`.

use half::{bf16, f16};

use crate::GgmlType;
use crate::quant::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, QK, decode_sub_block, is_integer_quant,
};

/// Error of [`dequantize`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DequantError {
    /// The reference dequantizer does not implement this type.
    #[error("dequantizing {dtype} is not supported")]
    Unsupported {
        /// The type.
        dtype: GgmlType,
    },
    /// The number of output values is not a multiple of the type's block size.
    #[error("{n} values of {dtype} is not a multiple of its block size {block_size}")]
    NotBlockMultiple {
        /// The type.
        dtype: GgmlType,
        /// Number of output values requested.
        n: usize,
        /// The type's block size.
        block_size: usize,
    },
    /// The source length does not match the number of output values.
    #[error("{n} values of {dtype} need {expected} source bytes, got {got}")]
    LengthMismatch {
        /// The type.
        dtype: GgmlType,
        /// Number of output values requested.
        n: usize,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
}

/// Error of [`quantize`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantizeError {
    /// The reference quantizer does not implement this type.
    #[error("quantizing to {dtype} is not supported")]
    Unsupported {
        /// The type.
        dtype: GgmlType,
    },
    /// The number of input values is not a multiple of the type's block size.
    #[error("{n} values is not a multiple of the {dtype} block size {block_size}")]
    NotBlockMultiple {
        /// The type.
        dtype: GgmlType,
        /// Number of input values.
        n: usize,
        /// The type's block size.
        block_size: usize,
    },
}

/// Dequantize `dst.len()` values of type `dtype` from `src` (exactly
/// `dtype.row_bytes(dst.len())` bytes) into `dst`, with ggml's reference semantics.
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
/// IQ4_XS.
///
/// ```
/// use weight_cache::{GgmlType, dequantize, quantize};
/// let x: Vec<f32> = (0..32).map(|i| i as f32 / 4.0).collect();
/// let q = quantize(GgmlType::Q8_0, &x).unwrap();
/// let mut y = vec![0.0; 32];
/// dequantize(GgmlType::Q8_0, &q, &mut y).unwrap();
/// // Q8_0 keeps each value within half a step (max |x| / 127 / 2).
/// assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 7.75 / 127.0 / 2.0 + 1e-3));
/// ```
pub fn dequantize(dtype: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), DequantError> {
    if !dtype.can_dequantize() {
        return Err(DequantError::Unsupported { dtype });
    }
    let n = dst.len();
    let block_size = dtype.block_size();
    let expected = dtype.row_bytes(n).ok_or(DequantError::NotBlockMultiple {
        dtype,
        n,
        block_size,
    })?;
    if src.len() != expected {
        return Err(DequantError::LengthMismatch {
            dtype,
            n,
            expected,
            got: src.len(),
        });
    }
    match dtype {
        GgmlType::F32 => {
            for (y, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (y, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ if is_integer_quant(dtype) => {
            // One decoder per format, shared with the kernels (`quant::decode_sub_block`).
            let bytes = dtype.type_size();
            let mut q = [0u8; QK];
            for (b, y) in src
                .chunks_exact(bytes)
                .zip(dst.chunks_exact_mut(block_size))
            {
                for (sub, y) in y.chunks_exact_mut(QK).enumerate() {
                    let map = decode_sub_block(dtype, b, sub, &mut q);
                    for (e, y) in y.iter_mut().enumerate() {
                        *y = map.weight(&q, e);
                    }
                }
            }
        }
        _ => return Err(DequantError::Unsupported { dtype }),
    }
    Ok(())
}

/// Quantize `src` to `dtype` with ggml's reference quantizers (`quantize_row_*_ref`), returning the
/// encoded bytes (`dtype.row_bytes(src.len())` of them).
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. Useful for tests of other crates'
/// kernels.
pub fn quantize(dtype: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    let n = src.len();
    let block_size = dtype.block_size();
    let bytes = dtype.row_bytes(n).ok_or(QuantizeError::NotBlockMultiple {
        dtype,
        n,
        block_size,
    })?;
    let mut out = Vec::with_capacity(bytes);
    match dtype {
        GgmlType::F32 => src.iter().for_each(|v| out.extend(v.to_le_bytes())),
        GgmlType::F16 => src
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => src
            .iter()
            .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            // `row_bytes` checked that `src` is whole blocks.
            for x in src.as_chunks::<QK>().0 {
                out.extend_from_slice(bytemuck::bytes_of(&BlockQ8_0::quantize(x)));
            }
        }
        GgmlType::Q4_0 => {
            // `row_bytes` checked that `src` is whole blocks.
            for x in src.as_chunks::<QK>().0 {
                out.extend_from_slice(bytemuck::bytes_of(&BlockQ4_0::quantize(x)));
            }
        }
        GgmlType::Q5_0 => {
            for x in src.chunks_exact(QK) {
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &v in x {
                    if amax < v.abs() {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let mut qs = [0u8; QK / 2];
                let mut qh = 0u32;
                for j in 0..QK / 2 {
                    let (x0, x1) = (x[j] * id, x[j + QK / 2] * id);
                    let xi0 = ((x0 + 16.5) as i8).min(31) as u8;
                    let xi1 = ((x1 + 16.5) as i8).min(31) as u8;
                    qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
                    qh |= u32::from((xi0 & 0x10) >> 4) << j;
                    qh |= u32::from((xi1 & 0x10) >> 4) << (j + QK / 2);
                }
                let b = BlockQ5_0 {
                    d: f16::from_f32(d),
                    qh: qh.to_le_bytes(),
                    qs,
                };
                out.extend_from_slice(bytemuck::bytes_of(&b));
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let five = dtype == GgmlType::Q5_1;
            for x in src.chunks_exact(QK) {
                let (mut min, mut max) = (f32::MAX, -f32::MAX);
                for &v in x {
                    if v < min {
                        min = v;
                    }
                    if v > max {
                        max = v;
                    }
                }
                let d = (max - min) / if five { 31.0 } else { 15.0 };
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let mut qs = [0u8; QK / 2];
                let mut qh = 0u32;
                for j in 0..QK / 2 {
                    let x0 = (x[j] - min) * id;
                    let x1 = (x[j + QK / 2] - min) * id;
                    if five {
                        let xi0 = (x0 + 0.5) as u8;
                        let xi1 = (x1 + 0.5) as u8;
                        qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
                        qh |= u32::from((xi0 & 0x10) >> 4) << j;
                        qh |= u32::from((xi1 & 0x10) >> 4) << (j + QK / 2);
                    } else {
                        let xi0 = ((x0 + 0.5) as i8).min(15) as u8;
                        let xi1 = ((x1 + 0.5) as i8).min(15) as u8;
                        qs[j] = xi0 | (xi1 << 4);
                    }
                }
                let (d, m) = (f16::from_f32(d), f16::from_f32(min));
                if five {
                    let b = BlockQ5_1 {
                        d,
                        m,
                        qh: qh.to_le_bytes(),
                        qs,
                    };
                    out.extend_from_slice(bytemuck::bytes_of(&b));
                } else {
                    out.extend_from_slice(bytemuck::bytes_of(&BlockQ4_1 { d, m, qs }));
                }
            }
        }
        _ => return Err(QuantizeError::Unsupported { dtype }),
    }
    debug_assert_eq!(out.len(), bytes);
    Ok(out)
}

/// [`quantize`] to Q8_0.
pub fn quantize_q8_0(src: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    quantize(GgmlType::Q8_0, src)
}

/// [`quantize`] to Q4_0.
pub fn quantize_q4_0(src: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    quantize(GgmlType::Q4_0, src)
}

/// [`quantize`] to Q4_1.
pub fn quantize_q4_1(src: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    quantize(GgmlType::Q4_1, src)
}
