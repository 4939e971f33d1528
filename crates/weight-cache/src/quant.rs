//! ggml quantized block layouts, byte-for-byte identical to `ggml-common.h`.
//!
//! Each struct is `#[repr(C)]`, [`bytemuck::Pod`], and its size is checked at compile time. Cast a
//! tensor's bytes with `bytemuck::cast_slice` (tensor data in a GGUF mapping is aligned) or read single
//! blocks with `bytemuck::pod_read_unaligned`. Multi-byte fields are little-endian (as in GGUF files);
//! this crate targets little-endian hosts.
//!
//! Nibble order (Q4_0/Q4_1/Q5_0/Q5_1): byte `j` of `qs` holds weight `j` in its low nibble and weight
//! `j + 16` in its high nibble. For Q5 types, bit `j` of the little-endian `u32` in `qh` is the 5th bit
//! of weight `j`.

use bytemuck::{Pod, Zeroable};
use half::f16;

/// Weights per block of the "legacy" quants (Q4_0 .. Q8_1).
pub const QK: usize = 32;
/// Weights per super-block of the k-quants.
pub const QK_K: usize = 256;
/// Bytes of packed 6-bit scales and mins in a Q4_K/Q5_K super-block.
pub const K_SCALE_SIZE: usize = 12;

/// Q4_0: `w = d * (q - 8)`, q in 0..16.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// 4-bit quants, see the module docs for the nibble order.
    pub qs: [u8; QK / 2],
}

impl BlockQ4_0 {
    /// Quantizes 32 weights as ggml's `quantize_row_q4_0_ref` does: `max` is the weight of
    /// largest magnitude (its sign kept, the first such on ties), `d = max / -8`,
    /// `q = min(15, (i8)(x / d + 8.5))` (truncating), so `max` itself maps to `q = 0` and the
    /// weights span `d * (q - 8)` for q in 0..16. The one copy of the Q4_0 quantizer:
    /// [`quantize`](crate::quantize) and kv-ring's `q4_0` cache call it.
    ///
    /// ```
    /// use weight_cache::quant::BlockQ4_0;
    /// let x: [f32; 32] = std::array::from_fn(|i| i as f32 - 16.0);
    /// let b = BlockQ4_0::quantize(&x);
    /// assert_eq!(b.d.to_f32(), 2.0); // max = -16, d = -16 / -8
    /// assert_eq!(b.qs[0] & 0xF, 0); // -16 = 2 * (0 - 8)
    /// ```
    #[inline]
    pub fn quantize(x: &[f32; QK]) -> Self {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; QK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            // `as i8` saturates (and maps NaN to 0), as C's conversion does for in-range values.
            let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let hi = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
            *q = lo | (hi << 4);
        }
        Self {
            d: f16::from_f32(d),
            qs,
        }
    }
}

/// Q4_1: `w = d * q + m`, q in 0..16.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Minimum (offset).
    pub m: f16,
    /// 4-bit quants.
    pub qs: [u8; QK / 2],
}

/// Q5_0: `w = d * (q - 16)`, q in 0..32.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: f16,
    /// 5th bits, a little-endian `u32`.
    pub qh: [u8; 4],
    /// Low 4 bits.
    pub qs: [u8; QK / 2],
}

/// Q5_1: `w = d * q + m`, q in 0..32.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: f16,
    /// Minimum (offset).
    pub m: f16,
    /// 5th bits, a little-endian `u32`.
    pub qh: [u8; 4],
    /// Low 4 bits.
    pub qs: [u8; QK / 2],
}

/// Q8_0: `w = d * q`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Signed quants.
    pub qs: [i8; QK],
}

impl BlockQ8_0 {
    /// One block quantized as ggml's `quantize_row_q8_0_ref` does: `d = amax / 127`,
    /// `q = round(x / d)` (0 for an all-zero block). The one Q8_0 quantizer: the crate's
    /// [`quantize`](crate::quantize) and kv-ring's q8_0 cache go through it.
    ///
    /// ```
    /// use weight_cache::quant::BlockQ8_0;
    /// let x: [f32; 32] = std::array::from_fn(|i| i as f32 - 16.0);
    /// let b = BlockQ8_0::quantize(&x);
    /// assert!((b.d.to_f32() - 16.0 / 127.0).abs() < 1e-4); // d = amax / 127, as f16
    /// assert_eq!((b.qs[0], b.qs[16], b.qs[31]), (-127, 0, 119));
    /// ```
    #[inline]
    pub fn quantize(x: &[f32; QK]) -> Self {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        // |x * id| <= 127 (+ rounding): in range.
        Self {
            d: f16::from_f32(d),
            qs: std::array::from_fn(|i| (x[i] * id).round() as i8),
        }
    }
}

/// Q8_1 (an activation format): `w = d * q`, `s = d * sum(q)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    /// Scale.
    pub d: f16,
    /// `d * sum(qs)`.
    pub s: f16,
    /// Signed quants.
    pub qs: [i8; QK],
}

/// Q4_K super-block: 8 sub-blocks of 32 weights, `w = d * sc * q - dmin * m` with 6-bit `sc`, `m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    /// Super-block scale for the sub-block scales.
    pub d: f16,
    /// Super-block scale for the sub-block mins.
    pub dmin: f16,
    /// Packed 6-bit scales and mins (see [`scale_min_k4`]).
    pub scales: [u8; K_SCALE_SIZE],
    /// 4-bit quants: 4 groups of 32 bytes, low nibbles first sub-block, high nibbles the next.
    pub qs: [u8; QK_K / 2],
}

/// Q5_K super-block: like [`BlockQ4K`] plus a 5th bit per weight.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    /// Super-block scale for the sub-block scales.
    pub d: f16,
    /// Super-block scale for the sub-block mins.
    pub dmin: f16,
    /// Packed 6-bit scales and mins (see [`scale_min_k4`]).
    pub scales: [u8; K_SCALE_SIZE],
    /// High bits: bit `2i` / `2i+1` of `qh[l]` belong to sub-blocks `2i` / `2i+1`.
    pub qh: [u8; QK_K / 8],
    /// Low 4 bits.
    pub qs: [u8; QK_K / 2],
}

/// Q6_K super-block: 16 sub-blocks of 16 weights, `w = d * sc * (q - 32)` with signed 8-bit `sc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits.
    pub qh: [u8; QK_K / 4],
    /// Sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: f16,
}

/// Q8_K super-block (an activation format).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    /// Scale (f32, unlike the other types).
    pub d: f32,
    /// Signed quants.
    pub qs: [i8; QK_K],
    /// Sums of each group of 16 quants.
    pub bsums: [i16; QK_K / 16],
}

const _: () = assert!(size_of::<BlockQ4_0>() == 18);
const _: () = assert!(size_of::<BlockQ4_1>() == 20);
const _: () = assert!(size_of::<BlockQ5_0>() == 22);
const _: () = assert!(size_of::<BlockQ5_1>() == 24);
const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(size_of::<BlockQ8_1>() == 36);
const _: () = assert!(size_of::<BlockQ4K>() == 144);
const _: () = assert!(size_of::<BlockQ5K>() == 176);
const _: () = assert!(size_of::<BlockQ6K>() == 210);
const _: () = assert!(size_of::<BlockQ8K>() == 292);

/// Sub-block `j` (0..8) scale and min of a Q4_K/Q5_K super-block (ggml's `get_scale_min_k4`).
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q2_K super-block: 16 sub-blocks of 16 weights, `w = d * (sc & 15) * q - dmin * (sc >> 4)`,
/// q in 0..4.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Per 16 weights: 4-bit scale (low nibble) and 4-bit min (high nibble).
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants: weight `128 n + 32 j + l` is bits `2j..2j + 2` of `qs[32 n + l]`.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale for the scales.
    pub d: f16,
    /// Super-block scale for the mins.
    pub dmin: f16,
}

/// Q3_K super-block: 16 sub-blocks of 16 weights, `w = d * (sc - 32) * (q - 4)` with 6-bit `sc`
/// (see [`scale_k3`]), q in 0..8.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High (third) bits: bit `s` of `hmask[l]` belongs to weight `32 s + l`.
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits, in the order of [`BlockQ2K::qs`].
    pub qs: [u8; QK_K / 4],
    /// Packed 6-bit scales.
    pub scales: [u8; K_SCALE_SIZE],
    /// Super-block scale.
    pub d: f16,
}

/// IQ4_NL: `w = d * KVALUES_IQ4NL[q]`, nibble order as Q4_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4NL {
    /// Scale.
    pub d: f16,
    /// 4-bit table indices.
    pub qs: [u8; QK / 2],
}

/// IQ4_XS super-block: 8 sub-blocks of 32 weights, `w = d * (ls - 32) * KVALUES_IQ4NL[q]` with
/// 6-bit `ls` (see [`scale_iq4xs`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4XS {
    /// Super-block scale.
    pub d: f16,
    /// High 2 bits of the sub-block scales (bits `2i..2i + 2` for sub-block `i`).
    pub scales_h: u16,
    /// Low 4 bits of the sub-block scales (nibble `i % 2` of byte `i / 2`).
    pub scales_l: [u8; QK_K / 64],
    /// 4-bit table indices: sub-block `i` is bytes `16 i..16 i + 16`, nibble order as Q4_0.
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(size_of::<BlockQ2K>() == 84);
const _: () = assert!(size_of::<BlockQ3K>() == 110);
const _: () = assert!(size_of::<BlockIQ4NL>() == 18);
const _: () = assert!(size_of::<BlockIQ4XS>() == 136);

/// The non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Scale `i` (0..16) of a Q3_K super-block as the signed value `sc - 32` (-32..32).
#[inline]
pub fn scale_k3(i: usize, q: &[u8; K_SCALE_SIZE]) -> i8 {
    let low = if i < 8 { q[i] & 0xF } else { q[i - 8] >> 4 };
    let high = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Scale of sub-block `i` (0..8) of an IQ4_XS super-block (fields `scales_h`, `scales_l`) as
/// the signed value `ls - 32`.
#[inline]
pub fn scale_iq4xs(i: usize, scales_h: u16, scales_l: &[u8; QK_K / 64]) -> i8 {
    let low = (scales_l[i / 2] >> (4 * (i % 2))) & 0xF;
    let high = ((scales_h >> (2 * i)) & 3) as u8;
    (low | (high << 4)) as i8 - 32
}

/// The affine map of one decoded 32-weight sub-block, shared by [`crate::dequantize`] and the
/// integer kernels of other crates: weight `e` is `scale[e / 16] * (q[e] - offset)`, plus
/// `min[e / 16]` when `min` is present, where `q` are the unsigned quants written by
/// [`decode_sub_block`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SubBlock {
    /// Scale of weights 0..16 and 16..32 (equal for formats with one scale per 32 weights).
    pub scale: [f32; 2],
    /// Subtracted from every unsigned quant.
    pub offset: i32,
    /// Additive term of weights 0..16 and 16..32, for the formats that have one.
    pub min: Option<[f32; 2]>,
}

impl SubBlock {
    /// Whether the two halves have different scales or mins (Q2_K, Q3_K, Q6_K).
    pub fn split(dtype: crate::GgmlType) -> bool {
        use crate::GgmlType as T;
        matches!(dtype, T::Q2_K | T::Q3_K | T::Q6_K)
    }

    /// Weight `e` (0..32) of the sub-block whose quants are `q`, with ggml's dequantization
    /// arithmetic (`scale * (q - offset) [+ min]` in f32, unfused).
    #[inline(always)]
    pub fn weight(&self, q: &[u8; 32], e: usize) -> f32 {
        let v = (i32::from(q[e]) - self.offset) as f32;
        let y = self.scale[e / 16] * v;
        match self.min {
            Some(m) => y + m[e / 16],
            None => y,
        }
    }
}

/// Number of 32-weight sub-blocks per block of `dtype` (0 for types without integer quants).
pub fn sub_blocks_per_block(dtype: crate::GgmlType) -> usize {
    if is_integer_quant(dtype) {
        dtype.block_size() / QK
    } else {
        0
    }
}

/// Whether [`decode_sub_block`] decodes `dtype`.
pub fn is_integer_quant(dtype: crate::GgmlType) -> bool {
    use crate::GgmlType as T;
    matches!(
        dtype,
        T::Q4_0
            | T::Q4_1
            | T::Q5_0
            | T::Q5_1
            | T::Q8_0
            | T::Q2_K
            | T::Q3_K
            | T::Q4_K
            | T::Q5_K
            | T::Q6_K
            | T::IQ4_NL
            | T::IQ4_XS
    )
}

/// A block of type `B` from its bytes (borrowed when aligned, else copied).
#[inline(always)]
fn block<B: Pod>(bytes: &[u8]) -> std::borrow::Cow<'_, B> {
    match bytemuck::try_from_bytes::<B>(&bytes[..size_of::<B>()]) {
        Ok(b) => std::borrow::Cow::Borrowed(b),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_read_unaligned(&bytes[..size_of::<B>()])),
    }
}

/// The 16 + 16 nibbles of `qs` (byte `j`: weight `j` low, `j + 16` high) into `q`.
#[inline(always)]
fn split_nibbles(qs: &[u8], q: &mut [u8; 32]) {
    for j in 0..16 {
        q[j] = qs[j] & 0xF;
        q[j + 16] = qs[j] >> 4;
    }
}

/// Decodes sub-block `sub` (0..[`sub_blocks_per_block`]) of the block `bytes` (at least one
/// block of `dtype`): writes its unsigned quants in weight order into `q` and returns their
/// affine map. Q8_0 quants are stored as `q + 128`, IQ4 table values as `value + 128`.
///
/// # Panics
/// If `dtype` is not an integer-quantized type ([`is_integer_quant`]) or `bytes` is shorter than
/// a block.
#[inline]
pub fn decode_sub_block(
    dtype: crate::GgmlType,
    bytes: &[u8],
    sub: usize,
    q: &mut [u8; 32],
) -> SubBlock {
    use crate::GgmlType as T;
    let single = |scale: f32, offset: i32, min: Option<f32>| SubBlock {
        scale: [scale; 2],
        offset,
        min: min.map(|m| [m; 2]),
    };
    match dtype {
        T::Q4_0 => {
            let b = block::<BlockQ4_0>(bytes);
            split_nibbles(&b.qs, q);
            single(b.d.to_f32(), 8, None)
        }
        T::Q4_1 => {
            let b = block::<BlockQ4_1>(bytes);
            split_nibbles(&b.qs, q);
            single(b.d.to_f32(), 0, Some(b.m.to_f32()))
        }
        T::Q5_0 | T::Q5_1 => {
            let (d, m, qh, qs) = if dtype == T::Q5_0 {
                let b = block::<BlockQ5_0>(bytes);
                (b.d.to_f32(), None, u32::from_le_bytes(b.qh), b.qs)
            } else {
                let b = block::<BlockQ5_1>(bytes);
                let m = Some(b.m.to_f32());
                (b.d.to_f32(), m, u32::from_le_bytes(b.qh), b.qs)
            };
            split_nibbles(&qs, q);
            for (e, v) in q.iter_mut().enumerate() {
                *v |= (((qh >> e) & 1) << 4) as u8;
            }
            single(d, if m.is_some() { 0 } else { 16 }, m)
        }
        T::Q8_0 => {
            let b = block::<BlockQ8_0>(bytes);
            for (v, &s) in q.iter_mut().zip(&b.qs) {
                *v = (s as u8) ^ 0x80;
            }
            single(b.d.to_f32(), 128, None)
        }
        T::IQ4_NL => {
            let b = block::<BlockIQ4NL>(bytes);
            split_nibbles(&b.qs, q);
            for v in q.iter_mut() {
                *v = (KVALUES_IQ4NL[usize::from(*v)] as u8) ^ 0x80;
            }
            single(b.d.to_f32(), 128, None)
        }
        T::IQ4_XS => {
            let b = block::<BlockIQ4XS>(bytes);
            split_nibbles(&b.qs[16 * sub..16 * sub + 16], q);
            for v in q.iter_mut() {
                *v = (KVALUES_IQ4NL[usize::from(*v)] as u8) ^ 0x80;
            }
            single(
                b.d.to_f32() * f32::from(scale_iq4xs(sub, b.scales_h, &b.scales_l)),
                128,
                None,
            )
        }
        T::Q4_K | T::Q5_K => {
            let (d, dmin, scales, low, high) = if dtype == T::Q4_K {
                let b = block::<BlockQ4K>(bytes);
                let low: [u8; 32] = b.qs[32 * (sub / 2)..32 * (sub / 2) + 32]
                    .try_into()
                    .unwrap();
                (b.d, b.dmin, b.scales, low, None)
            } else {
                let b = block::<BlockQ5K>(bytes);
                let low: [u8; 32] = b.qs[32 * (sub / 2)..32 * (sub / 2) + 32]
                    .try_into()
                    .unwrap();
                (b.d, b.dmin, b.scales, low, Some(b.qh))
            };
            let shift = 4 * (sub % 2);
            for (l, v) in q.iter_mut().enumerate() {
                *v = (low[l] >> shift) & 0xF;
                if let Some(qh) = high {
                    *v |= ((qh[l] >> sub) & 1) << 4;
                }
            }
            let (sc, m) = scale_min_k4(sub, &scales);
            single(
                d.to_f32() * f32::from(sc),
                0,
                Some(-(dmin.to_f32() * f32::from(m))),
            )
        }
        T::Q2_K => {
            let b = block::<BlockQ2K>(bytes);
            let (half, shift) = (sub / 4, 2 * (sub % 4));
            for (l, v) in q.iter_mut().enumerate() {
                *v = (b.qs[32 * half + l] >> shift) & 3;
            }
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            let sc = [b.scales[2 * sub], b.scales[2 * sub + 1]];
            SubBlock {
                scale: sc.map(|s| d * f32::from(s & 0xF)),
                offset: 0,
                min: Some(sc.map(|s| -(dmin * f32::from(s >> 4)))),
            }
        }
        T::Q3_K => {
            let b = block::<BlockQ3K>(bytes);
            let (half, shift) = (sub / 4, 2 * (sub % 4));
            for (l, v) in q.iter_mut().enumerate() {
                *v = ((b.qs[32 * half + l] >> shift) & 3) | (((b.hmask[l] >> sub) & 1) << 2);
            }
            let d = b.d.to_f32();
            SubBlock {
                scale: [2 * sub, 2 * sub + 1].map(|i| d * f32::from(scale_k3(i, &b.scales))),
                offset: 4,
                min: None,
            }
        }
        T::Q6_K => {
            let b = block::<BlockQ6K>(bytes);
            let (half, j) = (sub / 4, sub % 4);
            let ql = &b.ql[64 * half..64 * half + 64];
            let qh = &b.qh[32 * half..32 * half + 32];
            for (l, v) in q.iter_mut().enumerate() {
                let lo = ql[l + 32 * (j % 2)];
                let lo = if j < 2 { lo & 0xF } else { lo >> 4 };
                *v = lo | (((qh[l] >> (2 * j)) & 3) << 4);
            }
            let d = b.d.to_f32();
            let sc = |g: usize| d * f32::from(b.scales[g]);
            SubBlock {
                scale: [sc(8 * half + 2 * j), sc(8 * half + 2 * j + 1)],
                offset: 32,
                min: None,
            }
        }
        _ => panic!("{dtype} has no integer quants"),
    }
}
