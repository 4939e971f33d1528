//! One stream's KV cache.

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;

use crate::storage::{HostKv, HostKvStorage, KvBlock, KvBlockMut, KvStorage};
use crate::{KvDtype, KvError, KvPool, KvSlices, KvTensor, KvView, Q8_0_BLOCK, RingMode};

/// One stream's KV cache: a fixed-capacity ring of positions, obtained from a [`KvPool`] and
/// returning its memory there on drop. `Send + Sync`.
///
/// # Appending
///
/// `begin(n)` → `write_layer(layer, k, v)` for every layer (any order, rewrites allowed) →
/// `commit()`. Between `begin` and `commit` a layer's [`view`](Self::view) includes the pending
/// rows once that layer was written, so a prefill chunk's query `i` attends to the first
/// `len() + i + 1` rows of the view (causal). Nothing on this path allocates.
///
/// # Positions and RoPE
///
/// The writer rotates each key at its **absolute position** before writing it: pending token `i`
/// of a chunk has position `next_pos() + i`. `next_pos()` only grows (by `n` at each commit),
/// also in sliding mode after evictions, and so stays the RoPE position of the next token.
/// Keys are never re-rotated, so a query at position `p` sees each cached key at its true
/// distance `p - q`. View index `i` holds position [`position_of(i)`](Self::position_of):
/// `i` for the sinks (`i < sinks`), `i + evicted()` for the rest.
/// (StreamingLLM itself re-assigns positions within the cache, which needs unrotated keys and
/// a re-rotation per step; this crate stores rotated keys as the contract asks. Past the
/// model's trained context, distances to the sinks exceed what the model saw in training.)
///
/// # Modes
///
/// - [`RingMode::Strict`]: `begin` fails with [`KvError::Full`] when `len + n > capacity`.
/// - [`RingMode::Sliding`]: `begin` evicts the oldest non-sink entries as needed, at once, so
///   `len()` drops by the evicted count until `commit`. A chunk that needs eviction must fit in
///   the window (`n <= capacity - sinks`, else [`KvError::ChunkTooLarge`]).
///
/// # Layout
///
/// The elements live in a [`KvStorage`] `S` ([`HostKv`], one host buffer, by default) as one
/// block per (layer, kv head, K or V): `[capacity][head_dim]`. View index `i` lives in slot
/// `(start + i) % capacity`, so every view is at most two slices. The ring does all the slot
/// arithmetic; a host storage ([`HostKvStorage`]) is written and viewed by the ring itself, any
/// other (a device buffer) by its owner at the slots [`layer_slots`](Self::layer_slots) gives.
/// Sinks stay in position order just before the oldest window entry: an evicting `begin(n)`
/// moves the `sinks` rows forward by the evicted count (O(sinks) row copies per layer and head,
/// independent of capacity) and the new rows take the freed slots.
pub struct KvRing<S: KvStorage = HostKv> {
    pool: Arc<KvPool<S>>,
    storage: S,
    capacity: usize,
    mode: RingMode,
    sinks: usize,
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Slot of view index 0.
    start: usize,
    len: usize,
    next_pos: u64,
    in_chunk: bool,
    pending: usize,
    written: Vec<bool>,
    n_written: usize,
    /// Per-layer rows of a pool with sliding-window layers
    /// ([`KvPool::with_layer_windows`]); `None`: every layer holds `len` rows from `start`.
    win: Option<Box<Win>>,
}

/// Per-layer layout and state of a ring whose pool has sliding-window layers: layer `l` keeps
/// `caps[l]` rows, view index 0 in slot `start[l]`,
/// `len[l]` committed rows (the last ones: positions `next_pos - len[l]..next_pos`).
#[derive(Debug, Clone)]
struct Win {
    caps: Vec<usize>,
    start: Vec<usize>,
    len: Vec<usize>,
    max_chunk: usize,
}

impl Win {
    fn new(caps: Vec<usize>, max_chunk: usize) -> Self {
        let n = caps.len();
        Self {
            caps,
            start: vec![0; n],
            len: vec![0; n],
            max_chunk,
        }
    }
}

/// Where one layer's rows sit in its blocks, for a writer or reader of a storage the ring does
/// not access itself (a device buffer): from [`KvRing::layer_slots`].
///
/// Every (head, K or V) block of the layer ([`KvRing::block_index`]) has `rows_kept` slots of
/// `head_dim` elements. View index `i < rows` is in slot `(start + i) % rows_kept`; pending
/// token `i < pending` goes to slot `(start + committed + i) % rows_kept`.
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LayerSlots {
    /// Slots per block of this layer (the ring's capacity, or a window layer's cap).
    pub rows_kept: usize,
    /// Slot of view index 0.
    pub start: usize,
    /// Committed rows of the layer ([`KvRing::layer_len`]).
    pub committed: usize,
    /// Rows a view of the layer has now: `committed`, plus the pending tokens once the layer
    /// was written ([`KvRing::mark_layer_written`]).
    pub rows: usize,
    /// Tokens of the pending chunk (0 outside `begin`..`commit`).
    pub pending: usize,
}

impl LayerSlots {
    /// Slot of view index `i` (also of pending token `i - committed`).
    pub fn slot(&self, i: usize) -> usize {
        (self.start + i) % self.rows_kept
    }
}

impl<S: KvStorage> std::fmt::Debug for KvRing<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRing")
            .field("capacity", &self.capacity)
            .field("mode", &self.mode)
            .field("len", &self.len)
            .field("next_pos", &self.next_pos)
            .field("pending", &self.pending())
            .finish_non_exhaustive()
    }
}

impl<S: KvStorage> KvRing<S> {
    pub(crate) fn new(pool: Arc<KvPool<S>>, storage: S, capacity: usize, mode: RingMode) -> Self {
        let shape = pool.shape();
        let win = pool.windowed().map(|lw| {
            let caps = pool
                .layer_caps(capacity)
                .expect("the pool sized this ring, so its caps do not overflow");
            Box::new(Win::new(caps, lw.max_chunk))
        });
        debug_assert_eq!(Some(storage.allocated_bytes()), pool.ring_bytes(capacity));
        Self {
            win,
            storage,
            capacity,
            mode,
            sinks: mode.sinks(),
            n_layers: shape.n_layers,
            n_kv_heads: shape.n_kv_heads,
            head_dim: shape.head_dim,
            start: 0,
            len: 0,
            next_pos: 0,
            in_chunk: false,
            pending: 0,
            written: vec![false; shape.n_layers],
            n_written: 0,
            pool,
        }
    }

    /// Committed positions currently cached (during a chunk: after `begin`'s evictions, without
    /// the pending tokens).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Committed rows layer `layer` holds: [`len`](Self::len), except for the sliding-window
    /// layers of a [`KvPool::with_layer_windows`] pool, which keep only their last rows (view
    /// index `i` is position `next_pos() - layer_len(layer) + i` there). 0 past the last layer.
    pub fn layer_len(&self, layer: usize) -> usize {
        match &self.win {
            Some(w) => w.len.get(layer).copied().unwrap_or(0),
            None if layer < self.n_layers => self.len,
            None => 0,
        }
    }

    /// `len() == 0`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maximum cached positions.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The ring's mode.
    pub fn mode(&self) -> RingMode {
        self.mode
    }

    /// Absolute position (for RoPE) of the next token appended; the first pending token's
    /// position during a chunk.
    pub fn next_pos(&self) -> u64 {
        self.next_pos
    }

    /// Positions evicted so far (0 in strict mode): `next_pos() - len()`.
    pub fn evicted(&self) -> u64 {
        self.next_pos - self.len as u64
    }

    /// Tokens of the pending chunk (0 outside `begin`..`commit`).
    pub fn pending(&self) -> usize {
        if self.in_chunk { self.pending } else { 0 }
    }

    /// The pool this ring's memory belongs to.
    pub fn pool(&self) -> &Arc<KvPool<S>> {
        &self.pool
    }

    /// Bytes of the ring's buffer, measured from the allocation itself; equals
    /// `capacity() * pool().bytes_per_token()`.
    pub fn allocated_bytes(&self) -> usize {
        self.storage.allocated_bytes()
    }

    /// Absolute position of view index `i` (pending rows included), or `None` past
    /// `len() + pending()`.
    pub fn position_of(&self, i: usize) -> Option<u64> {
        if i >= self.len + self.pending() {
            return None;
        }
        Some(if i < self.sinks {
            i as u64
        } else {
            i as u64 + self.evicted()
        })
    }

    /// Starts appending `n` tokens (a prefill chunk, or 1 for decode).
    ///
    /// Errors (the ring is unchanged): [`KvError::ChunkPending`], [`KvError::Full`] (strict),
    /// [`KvError::ChunkTooLarge`] (sliding).
    pub fn begin(&mut self, n: usize) -> Result<(), KvError> {
        if self.in_chunk {
            return Err(KvError::ChunkPending {
                pending: self.pending,
            });
        }
        if n > self.capacity - self.len {
            match self.mode {
                RingMode::Strict => {
                    return Err(KvError::Full {
                        len: self.len,
                        requested: n,
                        capacity: self.capacity,
                    });
                }
                RingMode::Sliding { sinks } => {
                    let window = self.capacity - sinks;
                    if n > window {
                        return Err(KvError::ChunkTooLarge {
                            requested: n,
                            len: self.len,
                            capacity: self.capacity,
                            window,
                        });
                    }
                    self.evict(self.len + n - self.capacity)?;
                }
            }
        }
        if let Some(w) = &mut self.win {
            if n > w.max_chunk {
                return Err(KvError::ChunkTooLarge {
                    requested: n,
                    len: self.len,
                    capacity: self.capacity,
                    window: w.max_chunk,
                });
            }
            // Window layers drop their oldest rows to make room (a cap is at least the window
            // minus one plus the largest chunk, so every query of the chunk keeps its window).
            for l in 0..w.caps.len() {
                if w.len[l] + n > w.caps[l] {
                    let e = w.len[l] + n - w.caps[l];
                    w.start[l] = (w.start[l] + e) % w.caps[l];
                    w.len[l] -= e;
                }
            }
        }
        self.in_chunk = true;
        self.pending = n;
        self.written.fill(false);
        self.n_written = 0;
        Ok(())
    }

    /// Drops the `e` oldest non-sink entries; moves the sinks forward by `e` slots. A storage
    /// error leaves the sinks partly moved (host storage never fails).
    fn evict(&mut self, e: usize) -> Result<(), KvError> {
        debug_assert!(e > 0 && self.len >= self.sinks + e);
        let (cap, hd, s) = (self.capacity, self.head_dim, self.sinks);
        if s > 0 {
            let (src0, dst0) = (self.start, (self.start + e) % cap);
            // Neither run wraps: one memmove of `s` rows per block.
            let contiguous = src0 + s <= cap && dst0 + s <= cap;
            for b in 0..2 * self.n_layers * self.n_kv_heads {
                if contiguous {
                    self.storage.copy_within(b, src0 * hd, dst0 * hd, s * hd)?;
                    continue;
                }
                // Back to front: a row's destination is the source of a later sink, already moved.
                for i in (0..s).rev() {
                    let src = (src0 + i) % cap;
                    let dst = (src0 + e + i) % cap;
                    self.storage.copy_within(b, src * hd, dst * hd, hd)?;
                }
            }
        }
        self.start = (self.start + e) % cap;
        self.len -= e;
        Ok(())
    }

    /// The storage block of `(layer, head, tensor)`: `(layer * n_kv_heads + head) * 2` plus 0
    /// for K, 1 for V (see [`KvStorage`]).
    pub fn block_index(&self, layer: usize, head: usize, tensor: KvTensor) -> usize {
        let kv = match tensor {
            KvTensor::K => 0,
            KvTensor::V => 1,
        };
        (layer * self.n_kv_heads + head) * 2 + kv
    }

    /// The ring's storage (for its owner's kernels; host rings are read through
    /// [`view`](Self::view)).
    pub fn storage(&self) -> &S {
        &self.storage
    }

    /// The ring's storage, writable: a device writer places the pending rows of a layer at
    /// [`layer_slots`](Self::layer_slots), then calls
    /// [`mark_layer_written`](Self::mark_layer_written).
    pub fn storage_mut(&mut self) -> &mut S {
        &mut self.storage
    }

    /// Where layer `layer`'s rows are (see [`LayerSlots`]).
    ///
    /// Errors: [`KvError::LayerOutOfRange`].
    pub fn layer_slots(&self, layer: usize) -> Result<LayerSlots, KvError> {
        self.check_layer(layer)?;
        let (rows_kept, start, committed) = self.layer_geometry(layer);
        Ok(LayerSlots {
            rows_kept,
            start,
            committed,
            rows: committed + self.pending_rows(layer),
            pending: self.pending(),
        })
    }

    /// Records that the pending rows of `layer` were written into the storage by its owner
    /// (what [`write_layer`](Self::write_layer) does for host storage after copying them):
    /// views include them from now on, and [`commit`](Self::commit) needs every layer marked.
    ///
    /// Errors: [`KvError::NoPendingChunk`], [`KvError::LayerOutOfRange`].
    pub fn mark_layer_written(&mut self, layer: usize) -> Result<(), KvError> {
        if !self.in_chunk {
            return Err(KvError::NoPendingChunk);
        }
        self.check_layer(layer)?;
        if !self.written[layer] {
            self.written[layer] = true;
            self.n_written += 1;
        }
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer >= self.n_layers {
            return Err(KvError::LayerOutOfRange {
                layer,
                n_layers: self.n_layers,
            });
        }
        Ok(())
    }

    /// Pending rows a view of `layer` includes (those of a written layer).
    fn pending_rows(&self, layer: usize) -> usize {
        if self.in_chunk && self.written[layer] {
            self.pending
        } else {
            0
        }
    }

    /// Layer `layer`'s (rows kept, slot of view index 0, committed rows).
    fn layer_geometry(&self, layer: usize) -> (usize, usize, usize) {
        match &self.win {
            Some(w) => (w.caps[layer], w.start[layer], w.len[layer]),
            None => (self.capacity, self.start, self.len),
        }
    }

    /// Finishes the pending chunk: `len += n`, `next_pos += n`.
    ///
    /// Errors (the chunk stays pending; write the missing layers and retry):
    /// [`KvError::NoPendingChunk`], [`KvError::LayerNotWritten`] (a chunk of 0 tokens needs no
    /// writes).
    pub fn commit(&mut self) -> Result<(), KvError> {
        if !self.in_chunk {
            return Err(KvError::NoPendingChunk);
        }
        if self.pending > 0 && self.n_written < self.n_layers {
            let layer = self.written.iter().position(|w| !w).unwrap_or(0);
            return Err(KvError::LayerNotWritten {
                layer,
                pending: self.pending,
            });
        }
        self.len += self.pending;
        self.next_pos += self.pending as u64;
        if let Some(w) = &mut self.win {
            w.len.iter_mut().for_each(|l| *l += self.pending);
        }
        self.in_chunk = false;
        self.pending = 0;
        debug_assert!(self.len <= self.capacity);
        Ok(())
    }

    /// Empties the ring for a new stream (keeps its memory): `len`, `next_pos` back to 0, any
    /// pending chunk dropped.
    pub fn reset(&mut self) {
        if let Some(w) = &mut self.win {
            w.start.fill(0);
            w.len.fill(0);
        }
        self.start = 0;
        self.len = 0;
        self.next_pos = 0;
        self.in_chunk = false;
        self.pending = 0;
    }

    /// Drops the last `n` committed positions (speculative decoding's rejected draft tokens):
    /// `len()` and `next_pos()` go back by `n`, every layer keeps its other rows where they
    /// are, and the next append overwrites the dropped slots. Nothing is copied or freed: only
    /// the ring's bookkeeping changes, so this works for any storage (device rings too).
    ///
    /// A rolled-back ring is the ring as it stood before those positions were appended, with
    /// one exception: positions that appending them **evicted** (a [`RingMode::Sliding`] ring
    /// past its capacity) stay evicted, so the ring then holds fewer than `capacity()` rows.
    ///
    /// Errors (the ring is unchanged): [`KvError::ChunkPending`] (roll back between chunks),
    /// [`KvError::RollbackTooLong`] (`n > len()`), and [`KvError::RollbackEvicted`] when a row
    /// to drop or one the next query needs is no longer cached: a sliding ring that evicted
    /// can drop only its non-sink rows; a window layer of a
    /// [`KvPool::with_layer_windows`] pool must keep the `window - 1` rows before the next
    /// position (those a query there attends to), which holds whenever the rolled-back
    /// positions came from the last chunk.
    ///
    /// ```
    /// use kv_ring::{KvDtype, KvError, KvPool, KvShape, RingMode};
    /// let shape = KvShape::new(2, 1, 4, KvDtype::F32);
    /// let pool = KvPool::new(shape, 64 * shape.bytes_per_token())?;
    /// let mut ring = pool.alloc(16, RingMode::Strict)?;
    /// // Verify a token and 4 drafts in one chunk, then keep 2 of them.
    /// ring.begin(5)?;
    /// ring.write_all_layers(&[1.0; 2 * 5 * 4], &[2.0; 2 * 5 * 4])?;
    /// ring.commit()?;
    /// ring.rollback(2)?;
    /// assert_eq!((ring.len(), ring.next_pos()), (3, 3));
    /// assert_eq!(ring.view(0, 0)?.len, 3);
    /// assert_eq!(ring.rollback(4), Err(KvError::RollbackTooLong { requested: 4, len: 3 }));
    /// # Ok::<(), kv_ring::KvError>(())
    /// ```
    pub fn rollback(&mut self, n: usize) -> Result<(), KvError> {
        if self.in_chunk {
            return Err(KvError::ChunkPending {
                pending: self.pending,
            });
        }
        if n > self.len {
            return Err(KvError::RollbackTooLong {
                requested: n,
                len: self.len,
            });
        }
        // After evictions the ring holds the sinks, then a gap, then the window: only the
        // window's rows are the last positions.
        if self.evicted() > 0 && n > self.len - self.sinks {
            return Err(KvError::RollbackEvicted {
                requested: n,
                max: self.len - self.sinks,
                layer: None,
            });
        }
        let new_len = self.len - n;
        if let (Some(w), Some(lw)) = (&mut self.win, self.pool.windowed()) {
            for (l, window) in lw.windows.iter().enumerate() {
                let Some(window) = *window else { continue };
                // The next query (position `next_pos - n`) attends to the `window - 1` rows
                // before it, or to all of them if there are fewer.
                // A layer holding fewer rows than `len` holds at least `window - 1`.
                if w.len[l].saturating_sub(n) < (window - 1).min(new_len) {
                    return Err(KvError::RollbackEvicted {
                        requested: n,
                        max: w.len[l] + 1 - window,
                        layer: Some(l),
                    });
                }
            }
            w.len.iter_mut().for_each(|l| *l = l.saturating_sub(n));
        }
        self.len = new_len;
        self.next_pos -= n as u64;
        Ok(())
    }

    /// Raises the ring's capacity to `new_capacity` positions in place, keeping every cached
    /// position, its view order and `next_pos`; the extra bytes come from the pool's budget.
    /// A `new_capacity` at or below [`capacity`](Self::capacity) changes nothing.
    ///
    /// This is how an engine reserves KV by what a sequence uses: start at prompt + a chunk and
    /// grow by a chunk when the sequence reaches it (once per chunk, never per step). The cost is
    /// the storage's [`grow_blocks`](KvStorage::grow_blocks) (for [`HostKv`]: one `realloc`,
    /// the old contents moved, usually without a copy for large buffers, plus one `memmove` per
    /// (layer, head, K/V) block to re-space the blocks). A sliding ring whose contents wrap keeps
    /// them wrapped: the run at the end of each block moves to the new end, so views stay at
    /// most two slices. A ring with window layers is copied into a new storage instead.
    ///
    /// Errors (the ring is unchanged): [`KvError::ChunkPending`] (grow between chunks only),
    /// [`KvError::CapacityOverflow`], [`KvError::OverBudget`] (`requested` is the extra bytes),
    /// [`KvError::StorageFailed`] from the storage's allocation. A storage copy that fails
    /// after the allocation (a device error; [`HostKv`] never fails) leaves the capacity and
    /// budget consistent but the cached rows unspecified: reset or drop the ring.
    ///
    /// ```
    /// use kv_ring::{KvDtype, KvPool, KvShape, RingMode};
    /// let shape = KvShape::new(2, 1, 4, KvDtype::F32);
    /// let pool = KvPool::new(shape, 64 * shape.bytes_per_token())?;
    /// let mut ring = pool.alloc(8, RingMode::Strict)?;
    /// ring.begin(8)?;
    /// ring.write_all_layers(&[1.0; 2 * 8 * 4], &[2.0; 2 * 8 * 4])?;
    /// ring.commit()?;
    /// assert!(ring.begin(1).is_err()); // full
    /// ring.grow(16)?;
    /// assert_eq!((ring.capacity(), ring.len()), (16, 8));
    /// assert_eq!(pool.used_bytes(), 16 * shape.bytes_per_token());
    /// ring.begin(1)?; // room again
    /// assert!(ring.grow(100).is_err()); // a pending chunk: grow between chunks
    /// # Ok::<(), kv_ring::KvError>(())
    /// ```
    pub fn grow(&mut self, new_capacity: usize) -> Result<(), KvError> {
        if self.in_chunk {
            return Err(KvError::ChunkPending {
                pending: self.pending,
            });
        }
        if new_capacity <= self.capacity {
            return Ok(());
        }
        let overflow = KvError::CapacityOverflow {
            capacity: new_capacity,
            bytes_per_token: self.pool.bytes_per_token(),
        };
        let Some(new_bytes) = self.pool.ring_bytes(new_capacity) else {
            return Err(overflow);
        };
        if self.win.is_some() {
            return self.grow_windowed(new_capacity, new_bytes, overflow);
        }
        let hd = self.head_dim;
        let blocks = 2 * self.n_layers * self.n_kv_heads;
        let Some(lens) = self.pool.block_lens(new_capacity) else {
            return Err(overflow);
        };
        let extra = new_bytes.saturating_sub(self.storage.allocated_bytes());
        self.pool.reserve_growth(extra)?;
        if let Err(e) = self.storage.grow_blocks(self.pool.allocator(), &lens) {
            self.pool.unreserve_growth(extra);
            return Err(e);
        }
        // Each block kept its slots at its front. Slots [start, capacity) hold view indices
        // 0..; they go to the end of the new block and the wrapped slots [0, start) stay.
        let (cap, start) = (self.capacity, self.start);
        let head = cap - start;
        let new_start = if start == 0 { 0 } else { new_capacity - head };
        if start > 0 {
            for b in 0..blocks {
                self.storage
                    .copy_within(b, start * hd, new_start * hd, head * hd)?;
            }
        }
        self.capacity = new_capacity;
        self.start = new_start;
        Ok(())
    }

    /// A new ring of the same capacity and mode, from the same pool, holding a **copy** of this
    /// ring's first `n` positions (prefix reuse, e.g. a shared system prompt): `len() ==
    /// next_pos() == n`. See [`fork_into`](Self::fork_into).
    pub fn fork(&self, n: usize) -> Result<Self, KvError> {
        self.fork_into(n, self.capacity, self.mode)
    }

    /// Like [`fork`](Self::fork) with another capacity and mode (e.g. a short ring holding a
    /// system prompt, forked into full-context rings).
    ///
    /// The prefix is copied (`n * bytes_per_token` bytes of memcpy), not shared: rings stay
    /// independent and every view stays at most two contiguous slices. Only committed positions
    /// are forked; a pending chunk is ignored.
    ///
    /// Errors: [`KvError::ForkTooLong`] (`n > len()`), [`KvError::ForkEvicted`] (the first `n`
    /// positions are no longer all cached), [`KvError::ForkCapacity`], and those of
    /// [`KvPool::alloc`].
    pub fn fork_into(&self, n: usize, capacity: usize, mode: RingMode) -> Result<Self, KvError> {
        if n > self.len {
            return Err(KvError::ForkTooLong {
                requested: n,
                len: self.len,
            });
        }
        let evicted = self.evicted();
        if evicted > 0 && n > self.sinks {
            return Err(KvError::ForkEvicted {
                requested: n,
                sinks: self.sinks,
                evicted,
            });
        }
        if n > capacity {
            return Err(KvError::ForkCapacity {
                requested: n,
                capacity,
            });
        }
        if self.win.is_some() {
            return self.fork_windowed(n, capacity, mode);
        }
        let mut out = self.pool.alloc(capacity, mode)?;
        let hd = self.head_dim;
        let first = n.min(self.capacity - self.start);
        for b in 0..2 * self.n_layers * self.n_kv_heads {
            out.storage
                .copy_from(b, 0, &self.storage, b, self.start * hd, first * hd)?;
            out.storage
                .copy_from(b, first * hd, &self.storage, b, 0, (n - first) * hd)?;
        }
        out.len = n;
        out.next_pos = n as u64;
        Ok(out)
    }
}

impl<S: KvStorage> KvRing<S> {
    /// [`grow`](Self::grow) of a ring with window layers: a new buffer with the new per-layer
    /// caps, each layer's rows copied in view order (layers whose cap does not change are
    /// copied too: grows happen once per chunk of positions, not per step).
    fn grow_windowed(
        &mut self,
        new_capacity: usize,
        new_bytes: usize,
        overflow: KvError,
    ) -> Result<(), KvError> {
        let (hd, heads) = (self.head_dim, self.n_kv_heads);
        let Some(caps) = self.pool.layer_caps(new_capacity) else {
            return Err(overflow);
        };
        let Some(lens) = self.pool.block_lens(new_capacity) else {
            return Err(overflow);
        };
        let extra = new_bytes.saturating_sub(self.storage.allocated_bytes());
        self.pool.reserve_growth(extra)?;
        let w = self.win.as_ref().expect("windowed ring");
        let nw = Win::new(caps, w.max_chunk);
        let copied = S::zeroed(self.pool.allocator(), self.pool.shape().dtype, &lens).and_then(
            |mut storage| {
                for l in 0..self.n_layers {
                    let (cap, start, len) = (w.caps[l], w.start[l], w.len[l]);
                    let first = len.min(cap - start);
                    for b in l * 2 * heads..(l + 1) * 2 * heads {
                        storage.copy_from(b, 0, &self.storage, b, start * hd, first * hd)?;
                        storage.copy_from(
                            b,
                            first * hd,
                            &self.storage,
                            b,
                            0,
                            (len - first) * hd,
                        )?;
                    }
                }
                Ok(storage)
            },
        );
        let storage = match copied {
            Ok(storage) => storage,
            Err(e) => {
                self.pool.unreserve_growth(extra);
                return Err(e);
            }
        };
        let mut nw = nw;
        nw.len.clone_from(&w.len);
        let old = std::mem::replace(&mut self.storage, storage);
        drop(old); // its bytes stay counted: `used` grew by the difference only
        self.win = Some(Box::new(nw));
        self.capacity = new_capacity;
        Ok(())
    }

    /// [`fork_into`](Self::fork_into) of a ring with window layers: each window layer of the
    /// new ring gets the last rows of the prefix it keeps, which this ring must still hold.
    fn fork_windowed(&self, n: usize, capacity: usize, mode: RingMode) -> Result<Self, KvError> {
        let mut out = self.pool.alloc(capacity, mode)?;
        let (hd, heads) = (self.head_dim, self.n_kv_heads);
        let w = self.win.as_ref().expect("windowed ring");
        // Every layer first (no partial copy on error).
        let mut plan = Vec::with_capacity(self.n_layers);
        for l in 0..self.n_layers {
            let oldest = self.len - w.len[l];
            let k = n.min(out.win.as_ref().expect("same pool").caps[l]);
            if n - k < oldest {
                return Err(KvError::ForkEvicted {
                    requested: n,
                    sinks: 0,
                    evicted: oldest as u64,
                });
            }
            plan.push((n - k - oldest, k));
        }
        let ow = out.win.as_mut().expect("same pool");
        for (l, &(i0, k)) in plan.iter().enumerate() {
            let cap = w.caps[l];
            let s0 = (w.start[l] + i0) % cap;
            let first = k.min(cap - s0);
            for b in l * 2 * heads..(l + 1) * 2 * heads {
                out.storage
                    .copy_from(b, 0, &self.storage, b, s0 * hd, first * hd)?;
                out.storage
                    .copy_from(b, first * hd, &self.storage, b, 0, (k - first) * hd)?;
            }
            ow.len[l] = k;
        }
        out.len = n;
        out.next_pos = n as u64;
        Ok(out)
    }
}

/// Writing and viewing: the ring copies rows into a host storage itself.
impl<S: HostKvStorage> KvRing<S> {
    /// Writes K and V of the pending tokens for one layer. `k` and `v` are
    /// `[pending][n_kv_heads][head_dim]` row-major `f32` (keys already rotated), converted to
    /// the pool's dtype.
    ///
    /// Errors (nothing is written): [`KvError::NoPendingChunk`], [`KvError::LayerOutOfRange`],
    /// [`KvError::SliceLength`], [`KvError::NotInHostMemory`].
    pub fn write_layer(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        if !self.in_chunk {
            return Err(KvError::NoPendingChunk);
        }
        self.check_layer(layer)?;
        let row = self.n_kv_heads * self.head_dim;
        let expected = self.pending * row;
        for (tensor, s) in [(KvTensor::K, k), (KvTensor::V, v)] {
            if s.len() != expected {
                return Err(KvError::SliceLength {
                    tensor,
                    expected,
                    actual: s.len(),
                });
            }
        }
        let hd = self.head_dim;
        let (cap, start, len) = self.layer_geometry(layer);
        let first = start + len;
        for (tensor, src) in [(KvTensor::K, k), (KvTensor::V, v)] {
            for head in 0..self.n_kv_heads {
                let rows = src
                    .chunks_exact(row)
                    .map(|tok| &tok[head * hd..(head + 1) * hd]);
                let block = self.block_index(layer, head, tensor);
                // All of a storage value's blocks are in host memory or none: a `None` comes
                // at the first block, before anything is written.
                match self
                    .storage
                    .block_mut(block)
                    .ok_or(KvError::NotInHostMemory)?
                {
                    KvBlockMut::F32(block) => {
                        for (i, r) in rows.enumerate() {
                            let d = ((first + i) % cap) * hd;
                            block[d..d + hd].copy_from_slice(r);
                        }
                    }
                    KvBlockMut::F16(block) => {
                        for (i, r) in rows.enumerate() {
                            let d = ((first + i) % cap) * hd;
                            block[d..d + hd].convert_from_f32_slice(r);
                        }
                    }
                    KvBlockMut::Q8_0 { q, d: scales } => {
                        let per_row = hd / Q8_0_BLOCK;
                        for (i, r) in rows.enumerate() {
                            let row = (first + i) % cap;
                            KvDtype::quantize_q8_0(
                                r,
                                &mut q[row * hd..(row + 1) * hd],
                                &mut scales[row * per_row..(row + 1) * per_row],
                            );
                        }
                    }
                    KvBlockMut::Q4_0(blocks) => {
                        let per_row = hd / KvDtype::Q4_0.block_elems();
                        for (i, r) in rows.enumerate() {
                            let row = (first + i) % cap;
                            KvDtype::quantize_q4_0(
                                r,
                                &mut blocks[row * per_row..(row + 1) * per_row],
                            );
                        }
                    }
                }
            }
        }
        self.mark_layer_written(layer)?;
        Ok(())
    }

    /// Writes all layers of the pending tokens at once: `k` and `v` are
    /// `[n_layers][pending][n_kv_heads][head_dim]` row-major `f32`.
    ///
    /// Errors as [`write_layer`](Self::write_layer); lengths are checked before anything is
    /// written.
    pub fn write_all_layers(&mut self, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        if !self.in_chunk {
            return Err(KvError::NoPendingChunk);
        }
        let per_layer = self.pending * self.n_kv_heads * self.head_dim;
        let expected = per_layer * self.n_layers;
        for (tensor, s) in [(KvTensor::K, k), (KvTensor::V, v)] {
            if s.len() != expected {
                return Err(KvError::SliceLength {
                    tensor,
                    expected,
                    actual: s.len(),
                });
            }
        }
        if per_layer == 0 {
            for layer in 0..self.n_layers {
                self.write_layer(layer, &[], &[])?;
            }
            return Ok(());
        }
        for (layer, (kl, vl)) in k
            .chunks_exact(per_layer)
            .zip(v.chunks_exact(per_layer))
            .enumerate()
        {
            self.write_layer(layer, kl, vl)?;
        }
        Ok(())
    }

    /// Keys and values of `(layer, head)` in position order: the committed rows, plus the
    /// pending chunk's rows if this layer was written since `begin`. At most two slices each.
    ///
    /// Errors: [`KvError::LayerOutOfRange`], [`KvError::HeadOutOfRange`],
    /// [`KvError::NotInHostMemory`].
    pub fn view(&self, layer: usize, head: usize) -> Result<KvView<'_>, KvError> {
        self.check_layer(layer)?;
        if head >= self.n_kv_heads {
            return Err(KvError::HeadOutOfRange {
                head,
                n_kv_heads: self.n_kv_heads,
            });
        }
        let (cap, start, len) = self.layer_geometry(layer);
        let rows = len + self.pending_rows(layer);
        debug_assert!(rows <= cap && start < cap);
        let hd = self.head_dim;
        let first = rows.min(cap - start);
        let a = start * hd..(start + first) * hd;
        let b = 0..(rows - first) * hd;
        let kb = self.block_index(layer, head, KvTensor::K);
        let vb = self.block_index(layer, head, KvTensor::V);
        let (Some(k), Some(v)) = (self.storage.block(kb), self.storage.block(vb)) else {
            return Err(KvError::NotInHostMemory);
        };
        let (keys, values) = match (k, v) {
            (KvBlock::F32(k), KvBlock::F32(v)) => (
                KvSlices::F32([&k[a.clone()], &k[b.clone()]]),
                KvSlices::F32([&v[a], &v[b]]),
            ),
            (KvBlock::F16(k), KvBlock::F16(v)) => (
                KvSlices::F16([&k[a.clone()], &k[b.clone()]]),
                KvSlices::F16([&v[a], &v[b]]),
            ),
            (KvBlock::Q8_0(k), KvBlock::Q8_0(v)) => {
                // Rows are whole blocks: `hd` is a multiple of 32.
                (
                    KvSlices::Q8_0([k.slice(a.clone()), k.slice(b.clone())]),
                    KvSlices::Q8_0([v.slice(a), v.slice(b)]),
                )
            }
            (KvBlock::Q4_0(k), KvBlock::Q4_0(v)) => (
                KvSlices::Q4_0([k.slice(a.clone()), k.slice(b.clone())]),
                KvSlices::Q4_0([v.slice(a), v.slice(b)]),
            ),
            _ => unreachable!("one storage has one dtype"),
        };
        Ok(KvView {
            keys,
            values,
            len: rows,
        })
    }
}

impl<S: KvStorage> Drop for KvRing<S> {
    fn drop(&mut self) {
        let storage = std::mem::replace(&mut self.storage, S::empty(self.pool.shape().dtype));
        self.pool.release(storage);
    }
}
