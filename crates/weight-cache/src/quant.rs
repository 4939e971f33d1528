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
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// 4-bit quants, see the module docs for the nibble order.
    pub qs: [u8; QK / 2],
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
