//! The crate's error type.

use crate::KvShape;

/// Which of the two cached tensors an error is about.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum KvTensor {
    /// Keys.
    K,
    /// Values.
    V,
}

/// Everything the pool and rings refuse, with the facts needed to act on it.
///
/// No method of this crate panics on API misuse that is reported here; a rejected call leaves
/// the ring or pool unchanged.
#[non_exhaustive]
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum KvError {
    /// [`KvPool::new`](crate::KvPool::new): a dimension of the shape is zero.
    #[error("KV shape {shape:?} has a zero dimension")]
    ZeroDimension {
        /// The rejected shape.
        shape: KvShape,
    },
    /// [`KvPool::new`](crate::KvPool::new): `head_dim` is not a multiple of the dtype's block
    /// ([`KvDtype::block_elems`](crate::KvDtype::block_elems): 32 for `Q8_0` and `Q4_0`).
    #[error("KV shape {shape:?}: head_dim is not a multiple of the {dtype:?} block ({block})", dtype = shape.dtype)]
    HeadDimNotBlockMultiple {
        /// The rejected shape.
        shape: KvShape,
        /// Elements per block of its dtype.
        block: usize,
    },
    /// [`KvPool::new_in`](crate::KvPool::new_in): the storage cannot hold this dtype
    /// ([`KvStorage::supports`](crate::KvStorage::supports)), e.g. `q8_0` or `q4_0` in device
    /// memory.
    #[error("this KV storage cannot hold {dtype:?} elements")]
    UnsupportedDtype {
        /// The refused dtype.
        dtype: crate::KvDtype,
    },
    /// [`KvPool::new`](crate::KvPool::new): bytes per token do not fit in `usize`.
    #[error("KV shape {shape:?}: bytes per token overflow usize")]
    ShapeOverflow {
        /// The rejected shape.
        shape: KvShape,
    },
    /// A ring of capacity 0 was requested.
    #[error("a KV ring needs a capacity of at least one token")]
    ZeroCapacity,
    /// Sliding mode with `sinks >= capacity` leaves no room for the window.
    #[error("sliding ring with {sinks} sinks needs a capacity above {sinks}, got {capacity}")]
    SinksTooLarge {
        /// Requested sink count.
        sinks: usize,
        /// Requested capacity.
        capacity: usize,
    },
    /// `capacity * bytes_per_token` does not fit in `usize`.
    #[error("a ring of {capacity} tokens at {bytes_per_token} B/token overflows usize")]
    CapacityOverflow {
        /// Requested capacity in tokens.
        capacity: usize,
        /// The pool's bytes per token.
        bytes_per_token: usize,
    },
    /// The pool's budget cannot cover the request.
    #[error("KV pool over budget: {requested} B requested, {used} B of {budget} B in use")]
    OverBudget {
        /// Bytes the request needs.
        requested: usize,
        /// Bytes held by live rings at the time of the request.
        used: usize,
        /// The pool's budget in bytes.
        budget: usize,
    },
    /// Strict ring: the append does not fit (context length reached).
    #[error("strict KV ring full: {len} cached + {requested} new > capacity {capacity}")]
    Full {
        /// Cached positions.
        len: usize,
        /// Tokens in the rejected append.
        requested: usize,
        /// Ring capacity.
        capacity: usize,
    },
    /// Sliding ring: a chunk that needs eviction must fit in the window (capacity - sinks),
    /// otherwise it would evict its own tokens.
    #[error(
        "sliding KV ring: chunk of {requested} tokens needs eviction but the window is {window} \
         (len {len}, capacity {capacity})"
    )]
    ChunkTooLarge {
        /// Tokens in the rejected append.
        requested: usize,
        /// Cached positions.
        len: usize,
        /// Ring capacity.
        capacity: usize,
        /// Evictable slots: capacity - sinks.
        window: usize,
    },
    /// [`KvPool::with_layer_windows`](crate::KvPool::with_layer_windows) got a window list
    /// whose length is not the layer count, a window of 0, or a `max_chunk` of 0.
    #[error(
        "layer windows: {layers} entries for {n_layers} layers, max chunk {max_chunk} (windows must be non-zero, max chunk positive)"
    )]
    BadLayerWindows {
        /// Entries given.
        layers: usize,
        /// Layers of the shape.
        n_layers: usize,
        /// The chunk limit given.
        max_chunk: usize,
    },
    /// A pool with per-layer windows hands out strict rings only.
    #[error("a pool with per-layer sliding windows hands out strict rings only")]
    WindowedNotStrict,
    /// `begin` was called while a chunk is pending (call `commit` first).
    #[error("a chunk of {pending} tokens is pending; commit it first")]
    ChunkPending {
        /// Tokens of the pending chunk.
        pending: usize,
    },
    /// `write_layer`/`commit` without a pending chunk (call `begin` first).
    #[error("no pending chunk: call begin() first")]
    NoPendingChunk,
    /// A layer index at or past `n_layers`.
    #[error("layer {layer} out of range (n_layers {n_layers})")]
    LayerOutOfRange {
        /// Requested layer.
        layer: usize,
        /// Layers in the shape.
        n_layers: usize,
    },
    /// A kv-head index at or past `n_kv_heads`.
    #[error("kv head {head} out of range (n_kv_heads {n_kv_heads})")]
    HeadOutOfRange {
        /// Requested head.
        head: usize,
        /// KV heads in the shape.
        n_kv_heads: usize,
    },
    /// A K or V slice passed to a write has the wrong length; nothing was written.
    #[error("{tensor:?} slice has {actual} elements, expected {expected}")]
    SliceLength {
        /// Which slice.
        tensor: KvTensor,
        /// Expected element count.
        expected: usize,
        /// Given element count.
        actual: usize,
    },
    /// `commit` before every layer of the pending chunk was written.
    #[error("commit: layer {layer} of the pending {pending}-token chunk was not written")]
    LayerNotWritten {
        /// First unwritten layer.
        layer: usize,
        /// Tokens of the pending chunk.
        pending: usize,
    },
    /// `fork(n)` with `n` above the committed length.
    #[error("fork of {requested} positions from a ring holding {len}")]
    ForkTooLong {
        /// Requested prefix length.
        requested: usize,
        /// Committed positions in the source ring.
        len: usize,
    },
    /// `fork(n)` of a sliding ring whose first `n` positions were partly evicted.
    #[error(
        "fork of {requested} positions: only the {sinks} sink positions survive after {evicted} \
         evictions"
    )]
    ForkEvicted {
        /// Requested prefix length.
        requested: usize,
        /// Sink positions still cached.
        sinks: usize,
        /// Positions evicted so far.
        evicted: u64,
    },
    /// `fork_into` with a prefix longer than the new ring's capacity.
    #[error("fork of {requested} positions into a ring of capacity {capacity}")]
    ForkCapacity {
        /// Requested prefix length.
        requested: usize,
        /// Capacity of the new ring.
        capacity: usize,
    },
    /// [`KvRing::rollback`](crate::KvRing::rollback) of more positions than are cached.
    #[error("rollback of {requested} positions from a ring holding {len}")]
    RollbackTooLong {
        /// Positions to drop.
        requested: usize,
        /// Committed positions in the ring.
        len: usize,
    },
    /// [`KvRing::rollback`](crate::KvRing::rollback) would drop rows that are no longer
    /// cached, or leave a window layer without the rows its next query attends to.
    #[error(
        "rollback of {requested} positions: at most {max} can be dropped (limited by {})",
        rollback_limit(*.layer)
    )]
    RollbackEvicted {
        /// Positions to drop.
        requested: usize,
        /// The most positions a rollback can drop now, short of emptying the ring (rolling
        /// back every position is always allowed where no position was evicted).
        max: usize,
        /// The window layer that limits it, or `None`: a sliding ring that evicted positions,
        /// whose sinks cannot be dropped.
        layer: Option<usize>,
    },
    /// A [`KvStorage`](crate::KvStorage) backend (a device buffer) failed to allocate or copy;
    /// host storage never does.
    #[error("KV storage {op:?} of {bytes} B failed: {reason}")]
    StorageFailed {
        /// What the storage was doing.
        op: StorageOp,
        /// Bytes involved (allocated, or copied).
        bytes: usize,
        /// The backend's own error, as it displays itself (its types are not this crate's).
        reason: String,
    },
    /// [`KvRing::write_layer`](crate::KvRing::write_layer) or
    /// [`KvRing::view`](crate::KvRing::view) on a ring whose storage keeps its elements on a
    /// device ([`HostKvStorage::block`](crate::HostKvStorage::block) is `None`): such a ring
    /// is written and read by its storage's owner, at
    /// [`KvRing::layer_slots`](crate::KvRing::layer_slots).
    #[error("the KV ring's elements are not in host memory (a device ring)")]
    NotInHostMemory,
}

/// What limits a rollback, for [`KvError::RollbackEvicted`]'s message.
fn rollback_limit(layer: Option<usize>) -> String {
    match layer {
        Some(l) => format!("window layer {l}"),
        None => "evicted positions".to_owned(),
    }
}

/// The [`KvStorage`](crate::KvStorage) operation a [`KvError::StorageFailed`] is about.
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum StorageOp {
    /// [`KvStorage::zeroed`](crate::KvStorage::zeroed).
    Alloc,
    /// [`KvStorage::grow_blocks`](crate::KvStorage::grow_blocks).
    Grow,
    /// [`KvStorage::copy_within`](crate::KvStorage::copy_within) or
    /// [`KvStorage::copy_from`](crate::KvStorage::copy_from).
    Copy,
    /// The storage's owner writing a layer's new rows at
    /// [`KvRing::layer_slots`](crate::KvRing::layer_slots) (a device scatter kernel).
    Write,
}
