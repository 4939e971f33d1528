//! Borrowed views of one (layer, kv head) for attention kernels.

use half::f16;
use weight_cache::GgmlType;
use weight_cache::quant::{BlockQ4_0, QK, decode_sub_block};

/// Up to two contiguous runs of `[row][head_dim]` elements, in position order: all rows of
/// `[0]`, then all rows of `[1]` (empty unless the ring wrapped).
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum KvSlices<'a> {
    /// `f32` storage.
    F32([&'a [f32]; 2]),
    /// `f16` storage.
    F16([&'a [f16]; 2]),
    /// `q8_0` storage ([`KvDtype::Q8_0`](crate::KvDtype::Q8_0)).
    Q8_0([Q8Rows<'a>; 2]),
    /// `q4_0` storage ([`KvDtype::Q4_0`](crate::KvDtype::Q4_0)).
    Q4_0([Q4Rows<'a>; 2]),
}

/// A run of [`KvDtype::Q8_0`](crate::KvDtype::Q8_0) elements: quant `i` is element `i`, scaled
/// by `d[i / 32]` (runs start and end at block boundaries: rows of a multiple of 32).
#[derive(Clone, Copy, PartialEq, Debug, Default)]
pub struct Q8Rows<'a> {
    /// The quants, one per element.
    pub q: &'a [i8],
    /// The scales, one per 32 elements.
    pub d: &'a [f16],
}

impl<'a> Q8Rows<'a> {
    /// Elements `r` (whole blocks: `r.start` and `r.end` multiples of 32).
    pub fn slice(self, r: std::ops::Range<usize>) -> Self {
        let block = crate::Q8_0_BLOCK;
        debug_assert!(r.start.is_multiple_of(block) && r.end.is_multiple_of(block));
        Self {
            q: &self.q[r.clone()],
            d: &self.d[r.start / block..r.end / block],
        }
    }

    /// Element `i` as `f32` (`d * q`, exact in `f32`), or `None` past the end.
    pub fn get(&self, i: usize) -> Option<f32> {
        let q = *self.q.get(i)?;
        Some(self.d[i / crate::Q8_0_BLOCK].to_f32() * f32::from(q))
    }
}

/// A run of [`KvDtype::Q4_0`](crate::KvDtype::Q4_0) elements: llama.cpp's `block_q4_0`s, block
/// `b` holding elements `32b..32b + 32` (runs start and end at block boundaries: rows of a
/// multiple of 32). Element `32b + i` is `d * (q - 8)` with `q` the low nibble of `qs[i]` for
/// `i < 16`, the high nibble of `qs[i - 16]` otherwise.
#[derive(Clone, Copy, PartialEq, Debug, Default)]
pub struct Q4Rows<'a> {
    /// The blocks, one per 32 elements.
    pub blocks: &'a [BlockQ4_0],
}

impl<'a> Q4Rows<'a> {
    /// Elements in the run.
    pub fn len(&self) -> usize {
        self.blocks.len() * QK
    }

    /// `true` when the run has no elements.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Elements `r` (whole blocks: `r.start` and `r.end` multiples of 32).
    pub fn slice(self, r: std::ops::Range<usize>) -> Self {
        debug_assert!(r.start.is_multiple_of(QK) && r.end.is_multiple_of(QK));
        Self {
            blocks: &self.blocks[r.start / QK..r.end / QK],
        }
    }

    /// Element `i` as `f32` (`d * (q - 8)`, exact in `f32`, decoded by weight-cache's
    /// dequantizer), or `None` past the end.
    pub fn get(&self, i: usize) -> Option<f32> {
        let block = self.blocks.get(i / QK)?;
        let mut q = [0u8; QK];
        let map = decode_sub_block(GgmlType::Q4_0, bytemuck::bytes_of(block), 0, &mut q);
        Some(map.weight(&q, i % QK))
    }
}

impl KvSlices<'_> {
    /// Total elements in both runs.
    pub fn len(&self) -> usize {
        match self {
            Self::F32([a, b]) => a.len() + b.len(),
            Self::F16([a, b]) => a.len() + b.len(),
            Self::Q8_0([a, b]) => a.q.len() + b.q.len(),
            Self::Q4_0([a, b]) => a.len() + b.len(),
        }
    }

    /// `true` when both runs are empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element counts of the two runs.
    pub fn part_lens(&self) -> [usize; 2] {
        match self {
            Self::F32([a, b]) => [a.len(), b.len()],
            Self::F16([a, b]) => [a.len(), b.len()],
            Self::Q8_0([a, b]) => [a.q.len(), b.q.len()],
            Self::Q4_0([a, b]) => [a.len(), b.len()],
        }
    }

    /// Element `i` (in position order) widened to `f32`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<f32> {
        match self {
            Self::F32([a, b]) => a.get(i).or_else(|| b.get(i - a.len())).copied(),
            Self::F16([a, b]) => a.get(i).or_else(|| b.get(i - a.len())).map(|x| x.to_f32()),
            Self::Q8_0([a, b]) => a.get(i).or_else(|| b.get(i - a.q.len())),
            Self::Q4_0([a, b]) => a.get(i).or_else(|| b.get(i - a.len())),
        }
    }

    /// Both runs concatenated and widened to `f32` (allocates; for tests and debugging, not
    /// for kernels).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            Self::F32([a, b]) => [*a, *b].concat(),
            Self::F16([a, b]) => a.iter().chain(b.iter()).map(|x| x.to_f32()).collect(),
            Self::Q8_0(runs) => runs
                .iter()
                .flat_map(|r| (0..r.q.len()).filter_map(|i| r.get(i)))
                .collect(),
            Self::Q4_0(runs) => runs
                .iter()
                .flat_map(|r| (0..r.len()).filter_map(|i| r.get(i)))
                .collect(),
        }
    }
}

/// Keys and values of one (layer, kv head), as returned by [`KvRing::view`].
///
/// `len` rows each of `head_dim` elements; row `i` is view index `i` (its absolute position is
/// [`KvRing::position_of`]`(i)`). During a pending chunk the view includes that chunk's rows once
/// the layer was written, so query `i` of the chunk attends to the first `ring.len() + i + 1` rows.
///
/// [`KvRing::view`]: crate::KvRing::view
/// [`KvRing::position_of`]: crate::KvRing::position_of
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct KvView<'a> {
    /// Keys (already rotated by the writer at their absolute position).
    pub keys: KvSlices<'a>,
    /// Values.
    pub values: KvSlices<'a>,
    /// Rows in the view.
    pub len: usize,
}
