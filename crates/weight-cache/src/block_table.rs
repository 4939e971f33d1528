//! The file cut into fixed-size blocks, mapped to tensors and back.

use std::ops::Range;

use crate::Gguf;

/// Default block size: 64 KiB.
pub const DEFAULT_BLOCK_SIZE: usize = 64 * 1024;

/// Error of [`BlockTable::new`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockTableError {
    /// The block size is not a power of two at least the page size.
    #[error("block size {block_size} must be a power of two >= the page size {page_size}")]
    BadBlockSize {
        /// Requested block size.
        block_size: usize,
        /// The system page size.
        page_size: usize,
    },
}

/// Fixed blocks over a model file: tensor -> block range, block -> tensors.
///
/// ```
/// use weight_cache::{BlockTable, GgmlType, Gguf, GgufBuilder};
/// let g = Gguf::from_bytes(
///     GgufBuilder::new().tensor("t", GgmlType::F32, &[100_000], vec![0; 400_000]).build(),
/// )
/// .unwrap();
/// let table = BlockTable::new(&g, 64 * 1024).unwrap();
/// let blocks = table.tensor_blocks(0);
/// assert_eq!(blocks.len(), 7);
/// assert!(table.tensors_in_block(blocks.start).any(|t| t == 0));
/// ```
#[derive(Debug, Clone)]
pub struct BlockTable {
    block_size: usize,
    shift: u32,
    file_len: usize,
    /// Per tensor (file order): byte range.
    tensor_bytes: Vec<Range<usize>>,
    /// Tensor indices sorted by start offset.
    by_start: Vec<usize>,
}

impl BlockTable {
    /// Cut `gguf`'s file into blocks of `block_size` bytes (a power of two >= the page size).
    pub fn new(gguf: &Gguf, block_size: usize) -> Result<Self, BlockTableError> {
        let page_size = crate::sys::page_size();
        if !block_size.is_power_of_two() || block_size < page_size {
            return Err(BlockTableError::BadBlockSize {
                block_size,
                page_size,
            });
        }
        let tensor_bytes: Vec<Range<usize>> = gguf
            .tensors()
            .map(|t| t.offset as usize..t.offset as usize + t.data.len())
            .collect();
        let mut by_start: Vec<usize> = (0..tensor_bytes.len()).collect();
        by_start.sort_by_key(|&i| (tensor_bytes[i].start, i));
        Ok(Self {
            block_size,
            shift: block_size.trailing_zeros(),
            file_len: gguf.bytes().len(),
            tensor_bytes,
            by_start,
        })
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of blocks covering the file.
    pub fn n_blocks(&self) -> usize {
        self.file_len.div_ceil(self.block_size)
    }

    /// The file bytes of block `block` (the last block may be short).
    pub fn block_bytes(&self, block: usize) -> Range<usize> {
        let start = (block << self.shift).min(self.file_len);
        start..(start + self.block_size).min(self.file_len)
    }

    /// The block holding file byte `offset`.
    pub fn block_of(&self, offset: usize) -> usize {
        offset >> self.shift
    }

    /// Number of tensors.
    pub fn n_tensors(&self) -> usize {
        self.tensor_bytes.len()
    }

    /// File bytes of tensor `index` (empty for an unknown index).
    pub fn tensor_bytes(&self, index: usize) -> Range<usize> {
        self.tensor_bytes.get(index).cloned().unwrap_or(0..0)
    }

    /// Blocks holding tensor `index` (empty for an empty or unknown tensor).
    pub fn tensor_blocks(&self, index: usize) -> Range<usize> {
        match self.tensor_bytes.get(index) {
            Some(r) if !r.is_empty() => self.block_of(r.start)..self.block_of(r.end - 1) + 1,
            _ => 0..0,
        }
    }

    /// Tensors with bytes in block `block`, in offset order.
    pub fn tensors_in_block(&self, block: usize) -> impl Iterator<Item = usize> + '_ {
        let b = self.block_bytes(block);
        // First tensor whose end is past the block start: tensors do not overlap, so ends are
        // sorted like starts.
        let first = self
            .by_start
            .partition_point(|&i| self.tensor_bytes[i].end <= b.start);
        self.by_start[first..]
            .iter()
            .copied()
            .take_while(move |&i| self.tensor_bytes[i].start < b.end)
            .filter(move |&i| !self.tensor_bytes[i].is_empty())
    }
}
