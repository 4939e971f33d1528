//! Where a ring's elements live: the [`KvStorage`] trait and its host implementation.
//!
//! The ring keeps all the bookkeeping (positions, slots, eviction, windows); a storage only holds
//! elements. A ring's elements are split into **blocks**, one per (layer, kv head, K or V) in the
//! order `(layer * n_kv_heads + head) * 2 + (0 for K, 1 for V)`; block `b` holds `block_lens[b]`
//! elements (`rows kept by that layer * head_dim`). Every address the ring hands a storage is
//! `(block, element offset inside the block)`, and every run it copies or views lies inside one
//! block, so a storage may place blocks anywhere (one host `Vec`, separate chunks, a device
//! buffer).

use half::f16;

use crate::{BlockQ4_0, KvDtype, KvError, Q4Rows, Q8_0_BLOCK, Q8Rows};

/// The element store of a [`KvRing`](crate::KvRing), allocated by its [`KvPool`](crate::KvPool).
///
/// Implementations: [`HostKv`] (host memory; what the CPU attention reads through
/// [`KvRing::view`](crate::KvRing::view)) and device buffers in executor crates. Host storages
/// that the ring can write and view also implement [`HostKvStorage`]; others are written by
/// their owner at the slots [`KvRing::layer_slots`](crate::KvRing::layer_slots) names.
///
/// Contract (checked for [`HostKv`] and a chunked store in `tests/storage.rs`):
/// - `allocated_bytes` is exact: the pool's budget accounting relies on it being
///   `dtype.bytes_for(sum(block_lens))` after [`zeroed`](Self::zeroed) and
///   [`grow_blocks`](Self::grow_blocks).
/// - Copies move `len` elements as `memmove` would (overlapping runs inside one block are fine).
/// - Nothing here is called on the decode path except through the ring's eviction (sliding
///   rings only); none of the host methods allocates except `zeroed` and `grow_blocks`.
pub trait KvStorage: Sized + Send + Sync + 'static {
    /// What allocates buffers: `()` for host memory, a device context for device buffers.
    /// The pool owns one and passes it to every allocation.
    type Allocator: Send + Sync + 'static;

    /// A buffer of `block_lens.len()` blocks of `block_lens[b]` elements of `dtype`. Contents
    /// are unspecified (the ring never reads a row before writing it); host memory comes
    /// zeroed from `alloc_zeroed`.
    ///
    /// Errors: [`KvError::StorageFailed`] when the backend refuses.
    fn zeroed(
        allocator: &Self::Allocator,
        dtype: KvDtype,
        block_lens: &[usize],
    ) -> Result<Self, KvError>;

    /// Whether buffers from `allocator` can hold `dtype` (every dtype unless a backend says
    /// otherwise; a device backend without `q8_0`/`q4_0` kernels does). Checked when a pool is made,
    /// so an unsupported dtype is an error at start-up, not at the first request.
    fn supports(allocator: &Self::Allocator, dtype: KvDtype) -> bool {
        let _ = (allocator, dtype);
        true
    }

    /// A storage holding nothing (no allocation): the placeholder a dropped ring leaves.
    fn empty(dtype: KvDtype) -> Self;

    /// Bytes actually allocated.
    fn allocated_bytes(&self) -> usize;

    /// Lengthens the blocks to `block_lens` (same count, each at least its old length). Block
    /// `b` keeps its old elements at offsets `0..old_len`; the elements after them are
    /// unspecified. Allocates exactly the new size (no amortized slack escapes the budget).
    ///
    /// Errors: [`KvError::StorageFailed`] (the storage is unchanged).
    fn grow_blocks(
        &mut self,
        allocator: &Self::Allocator,
        block_lens: &[usize],
    ) -> Result<(), KvError>;

    /// Copies elements `src..src + len` of `block` to `dst..dst + len` of the same block
    /// (overlap allowed).
    fn copy_within(
        &mut self,
        block: usize,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<(), KvError>;

    /// Copies `other`'s block `src_block` elements `src..src + len` to this storage's block
    /// `block` at `dst` (same dtype: both come from one pool).
    fn copy_from(
        &mut self,
        block: usize,
        dst: usize,
        other: &Self,
        src_block: usize,
        src: usize,
        len: usize,
    ) -> Result<(), KvError>;
}

/// A [`KvStorage`] whose blocks the ring can read and write as host slices: what
/// [`KvRing::write_layer`](crate::KvRing::write_layer) and [`KvRing::view`](crate::KvRing::view)
/// need.
///
/// A storage whose place is chosen at run time (an executor's enum of a host and a device
/// storage) returns `None` for a value whose elements are not in host memory (for every block
/// of that value, or for none); the ring then reports [`KvError::NotInHostMemory`]. [`HostKv`]
/// always returns `Some`.
pub trait HostKvStorage: KvStorage {
    /// Block `block`'s elements (all `block_lens[block]` of them), or `None` when this value
    /// does not keep them in host memory.
    fn block(&self, block: usize) -> Option<KvBlock<'_>>;

    /// Block `block`'s elements, writable (`None` as for [`block`](Self::block)).
    fn block_mut(&mut self, block: usize) -> Option<KvBlockMut<'_>>;
}

/// One block of a host storage, typed by the pool's dtype.
#[non_exhaustive]
#[derive(Debug)]
pub enum KvBlock<'a> {
    /// `f32` storage.
    F32(&'a [f32]),
    /// `f16` storage.
    F16(&'a [f16]),
    /// `q8_0` storage: the block's quants and its scales (one per 32 elements).
    Q8_0(Q8Rows<'a>),
    /// `q4_0` storage: the block's `block_q4_0`s (one per 32 elements).
    Q4_0(Q4Rows<'a>),
}

/// One writable block of a host storage.
#[non_exhaustive]
#[derive(Debug)]
pub enum KvBlockMut<'a> {
    /// `f32` storage.
    F32(&'a mut [f32]),
    /// `f16` storage.
    F16(&'a mut [f16]),
    /// `q8_0` storage: quants (one per element) and scales (one per 32).
    Q8_0 {
        /// Quants.
        q: &'a mut [i8],
        /// Scales.
        d: &'a mut [f16],
    },
    /// `q4_0` storage: `block_q4_0`s (one per 32 elements).
    Q4_0(&'a mut [BlockQ4_0]),
}

/// Host storage: one contiguous zero-allocated buffer, blocks back to back (the default storage
/// of [`KvRing`](crate::KvRing) and [`KvPool`](crate::KvPool)).
///
/// `F16` is kept as raw `u16` bits so a fresh buffer comes from `alloc_zeroed` (lazily mapped
/// zero pages, no memset) and is viewed as `f16` through `bytemuck`.
#[derive(Debug)]
pub struct HostKv {
    data: HostData,
    /// Block `b` is `data[bounds[b]..bounds[b + 1]]`.
    bounds: Box<[usize]>,
}

#[derive(Debug)]
enum HostData {
    F32(Vec<f32>),
    F16(Vec<u16>),
    /// Quants (one per element) and scale bits (one per [`Q8_0_BLOCK`] elements; every block
    /// bound is a multiple of it).
    Q8_0(Vec<i8>, Vec<u16>),
    /// One `block_q4_0` per 32 elements (from `alloc_zeroed` through `bytemuck::zeroed_vec`).
    Q4_0(Vec<BlockQ4_0>),
}

fn prefix_bounds(block_lens: &[usize]) -> Box<[usize]> {
    std::iter::once(0)
        .chain(block_lens.iter().scan(0usize, |end, &len| {
            *end += len;
            Some(*end)
        }))
        .collect()
}

/// The blocks (`q8_0`: scales; `q4_0`: `block_q4_0`s) of the elements `r` (whole blocks of 32,
/// the same for both).
#[inline]
fn blocks(r: std::ops::Range<usize>) -> std::ops::Range<usize> {
    debug_assert!(r.start.is_multiple_of(Q8_0_BLOCK) && r.end.is_multiple_of(Q8_0_BLOCK));
    r.start / Q8_0_BLOCK..r.end / Q8_0_BLOCK
}

impl HostKv {
    #[inline]
    fn range(&self, block: usize, at: usize, len: usize) -> std::ops::Range<usize> {
        let base = self.bounds[block];
        debug_assert!(base + at + len <= self.bounds[block + 1]);
        base + at..base + at + len
    }
}

impl KvStorage for HostKv {
    type Allocator = ();

    /// `vec![0; n]` uses `alloc_zeroed`, so this costs no memset; pages are faulted in on first
    /// write.
    fn zeroed(_: &(), dtype: KvDtype, block_lens: &[usize]) -> Result<Self, KvError> {
        let bounds = prefix_bounds(block_lens);
        let elems = bounds[bounds.len() - 1];
        let data = match dtype {
            KvDtype::F32 => HostData::F32(vec![0.0; elems]),
            KvDtype::F16 => HostData::F16(vec![0; elems]),
            KvDtype::Q8_0 => HostData::Q8_0(vec![0; elems], vec![0; elems / Q8_0_BLOCK]),
            KvDtype::Q4_0 => HostData::Q4_0(bytemuck::zeroed_vec(blocks(0..elems).len())),
        };
        Ok(Self { data, bounds })
    }

    fn empty(dtype: KvDtype) -> Self {
        let data = match dtype {
            KvDtype::F32 => HostData::F32(Vec::new()),
            KvDtype::F16 => HostData::F16(Vec::new()),
            KvDtype::Q8_0 => HostData::Q8_0(Vec::new(), Vec::new()),
            KvDtype::Q4_0 => HostData::Q4_0(Vec::new()),
        };
        Self {
            data,
            bounds: Box::new([0]),
        }
    }

    /// From the vector's capacity, not its length.
    fn allocated_bytes(&self) -> usize {
        match &self.data {
            HostData::F32(v) => v.capacity() * size_of::<f32>(),
            HostData::F16(v) => v.capacity() * size_of::<u16>(),
            HostData::Q8_0(q, d) => q.capacity() + d.capacity() * size_of::<u16>(),
            HostData::Q4_0(b) => b.capacity() * size_of::<BlockQ4_0>(),
        }
    }

    /// One exact-size reallocation, then one `memmove` per block, last block first (a block only
    /// moves right, so a later block's source is never overwritten before it moves).
    fn grow_blocks(&mut self, _: &(), block_lens: &[usize]) -> Result<(), KvError> {
        assert_eq!(block_lens.len() + 1, self.bounds.len(), "same block count");
        let bounds = prefix_bounds(block_lens);
        fn respace<T: bytemuck::Zeroable + Copy>(v: &mut Vec<T>, old: &[usize], new: &[usize]) {
            let elems = new[new.len() - 1];
            v.reserve_exact(elems.saturating_sub(v.len()));
            v.resize(elems, T::zeroed());
            for b in (0..old.len() - 1).rev() {
                let len = old[b + 1] - old[b];
                debug_assert!(len <= new[b + 1] - new[b], "blocks only grow");
                v.copy_within(old[b]..old[b] + len, new[b]);
            }
        }
        let per_block = |b: &[usize]| -> Vec<usize> { b.iter().map(|&e| e / Q8_0_BLOCK).collect() };
        match &mut self.data {
            HostData::F32(v) => respace(v, &self.bounds, &bounds),
            HostData::F16(v) => respace(v, &self.bounds, &bounds),
            HostData::Q8_0(q, d) => {
                respace(q, &self.bounds, &bounds);
                respace(d, &per_block(&self.bounds), &per_block(&bounds));
            }
            HostData::Q4_0(b) => respace(b, &per_block(&self.bounds), &per_block(&bounds)),
        }
        self.bounds = bounds;
        Ok(())
    }

    #[inline]
    fn copy_within(
        &mut self,
        block: usize,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<(), KvError> {
        let from = self.range(block, src, len);
        let to = self.range(block, dst, len).start;
        match &mut self.data {
            HostData::F32(v) => v.copy_within(from, to),
            HostData::F16(v) => v.copy_within(from, to),
            HostData::Q8_0(q, d) => {
                q.copy_within(from.clone(), to);
                d.copy_within(blocks(from), to / Q8_0_BLOCK);
            }
            HostData::Q4_0(b) => b.copy_within(blocks(from), to / Q8_0_BLOCK),
        }
        Ok(())
    }

    #[inline]
    fn copy_from(
        &mut self,
        block: usize,
        dst: usize,
        other: &Self,
        src_block: usize,
        src: usize,
        len: usize,
    ) -> Result<(), KvError> {
        let to = self.range(block, dst, len);
        let from = other.range(src_block, src, len);
        match (&mut self.data, &other.data) {
            (HostData::F32(d), HostData::F32(s)) => d[to].copy_from_slice(&s[from]),
            (HostData::F16(d), HostData::F16(s)) => d[to].copy_from_slice(&s[from]),
            (HostData::Q8_0(dq, dd), HostData::Q8_0(sq, sd)) => {
                dq[to.clone()].copy_from_slice(&sq[from.clone()]);
                dd[blocks(to)].copy_from_slice(&sd[blocks(from)]);
            }
            (HostData::Q4_0(d), HostData::Q4_0(s)) => {
                d[blocks(to)].copy_from_slice(&s[blocks(from)]);
            }
            _ => unreachable!("rings of one pool share a dtype"),
        }
        Ok(())
    }
}

impl HostKvStorage for HostKv {
    #[inline]
    fn block(&self, block: usize) -> Option<KvBlock<'_>> {
        let r = self.bounds[block]..self.bounds[block + 1];
        Some(match &self.data {
            HostData::F32(v) => KvBlock::F32(&v[r]),
            HostData::F16(v) => KvBlock::F16(bytemuck::cast_slice(&v[r])),
            HostData::Q8_0(q, d) => KvBlock::Q8_0(Q8Rows {
                q: &q[r.clone()],
                d: bytemuck::cast_slice(&d[blocks(r)]),
            }),
            HostData::Q4_0(b) => KvBlock::Q4_0(Q4Rows {
                blocks: &b[blocks(r)],
            }),
        })
    }

    #[inline]
    fn block_mut(&mut self, block: usize) -> Option<KvBlockMut<'_>> {
        let r = self.bounds[block]..self.bounds[block + 1];
        Some(match &mut self.data {
            HostData::F32(v) => KvBlockMut::F32(&mut v[r]),
            HostData::F16(v) => KvBlockMut::F16(bytemuck::cast_slice_mut(&mut v[r])),
            HostData::Q8_0(q, d) => KvBlockMut::Q8_0 {
                q: &mut q[r.clone()],
                d: bytemuck::cast_slice_mut(&mut d[blocks(r)]),
            },
            HostData::Q4_0(b) => KvBlockMut::Q4_0(&mut b[blocks(r)]),
        })
    }
}
