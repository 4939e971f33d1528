//! The budgeted pool that hands out rings.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::ring::KvRing;
use crate::storage::{HostKv, KvStorage};
use crate::{KvError, KvShape, RingMode};

/// A memory budget for the KV caches of many streams, sharing one [`KvShape`], whose rings keep
/// their elements in a [`KvStorage`] `S` (host memory, [`HostKv`], by default; a device buffer
/// type for an executor that keeps KV on its device: [`new_in`](Self::new_in)).
///
/// `KvPool` is `Send + Sync`; share it as `Arc<KvPool>` (what [`KvPool::new`] returns).
///
/// # Allocation design
///
/// Each ring owns one storage of exactly `capacity * shape.bytes_per_token()` bytes (for
/// [`HostKv`], one contiguous host buffer), allocated whole by [`alloc`](Self::alloc), so
/// appending and viewing never allocate. Budget accounting is exact:
/// [`used_bytes`](Self::used_bytes) is the sum of live rings' storage sizes (small fixed per-ring metadata, about a hundred bytes plus one flag per layer,
/// is not counted).
///
/// - **Recycling.** A dropped ring's buffer goes to a free list keyed by size; the next `alloc` of
///   the same capacity pops it (O(1): a lock, a map lookup, a pop; no system call, no page
///   faults, no zeroing: rows are never readable before they are written). Cached buffers count
///   against the budget too, so resident memory (`used + cached`) never exceeds the budget:
///   an `alloc` that needs a fresh buffer first releases cached ones (largest first).
///   [`trim`](Self::trim) releases them all; [`set_recycling`](Self::set_recycling)`(false)`
///   turns the free list off.
/// - **Fresh buffers** come from [`KvStorage::zeroed`]. For [`HostKv`] that is `alloc_zeroed`
///   (`calloc`; large sizes are lazily mapped zero pages), so their cost does not grow with
///   capacity; pages are faulted in on first write. The budget is the guard against OOM: the
///   host allocation itself, like any Rust allocation, aborts if the OS refuses; a storage
///   whose backend refuses (device memory) returns [`KvError::StorageFailed`].
///
/// Shared pages between rings were rejected: a (layer, head) view must stay at most two
/// contiguous slices, which per-ring contiguous storage gives for free (see [`KvRing::fork`]).
pub struct KvPool<S: KvStorage = HostKv> {
    allocator: S::Allocator,
    shape: KvShape,
    bytes_per_token: usize,
    /// Per-layer sliding windows (see [`KvPool::with_layer_windows`]).
    windows: Option<LayerWindows>,
    budget: usize,
    recycle: AtomicBool,
    state: Mutex<PoolState<S>>,
    fresh_allocs: AtomicU64,
    recycled_allocs: AtomicU64,
    rejected_allocs: AtomicU64,
    frees: AtomicU64,
    grows: AtomicU64,
}

/// Sliding-window layers of a pool's rings.
#[derive(Clone, Debug)]
pub(crate) struct LayerWindows {
    /// Per layer: the window (a query sees its own position and the `w - 1` before it).
    pub(crate) windows: Vec<Option<usize>>,
    /// Largest chunk `begin` accepts.
    pub(crate) max_chunk: usize,
}

struct PoolState<S> {
    /// Bytes held by live rings.
    used: usize,
    /// Bytes held by cached free buffers.
    cached: usize,
    live: usize,
    /// Free buffers by size in bytes (one size is one block layout: see `take_storage`).
    free: BTreeMap<usize, Vec<S>>,
}

impl<S> Default for PoolState<S> {
    fn default() -> Self {
        Self {
            used: 0,
            cached: 0,
            live: 0,
            free: BTreeMap::new(),
        }
    }
}

/// Counters of a pool, for metrics.
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PoolStats {
    /// Rings currently alive.
    pub live_rings: usize,
    /// Bytes held by live rings.
    pub used_bytes: usize,
    /// Bytes held by recycled buffers waiting for reuse.
    pub cached_bytes: usize,
    /// Allocations served by a fresh buffer.
    pub fresh_allocs: u64,
    /// Allocations served from the free list.
    pub recycled_allocs: u64,
    /// Allocations refused with [`KvError::OverBudget`].
    pub rejected_allocs: u64,
    /// Rings returned (dropped).
    pub frees: u64,
    /// Successful [`KvRing::grow`] calls.
    pub grows: u64,
}

impl<S: KvStorage> std::fmt::Debug for KvPool<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("shape", &self.shape)
            .field("budget", &self.budget)
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvPool {
    /// A pool for `shape` that never holds more than `budget_bytes` of KV buffers in host
    /// memory.
    ///
    /// Allocates nothing up front. Errors: [`KvError::ZeroDimension`],
    /// [`KvError::ShapeOverflow`].
    pub fn new(shape: KvShape, budget_bytes: usize) -> Result<Arc<Self>, KvError> {
        Self::new_in(shape, budget_bytes, ())
    }

    /// A host pool whose rings keep, for each layer with a sliding window `w`, only the last
    /// `w - 1 + max_chunk` positions; see
    /// [`with_layer_windows_in`](Self::with_layer_windows_in).
    ///
    /// ```
    /// use kv_ring::{KvDtype, KvPool, KvShape, RingMode};
    /// let shape = KvShape::new(2, 1, 4, KvDtype::F32);
    /// // Layer 0 slides over 8 positions, layer 1 sees everything; chunks of up to 4.
    /// let pool = KvPool::with_layer_windows(shape, 1 << 20, vec![Some(8), None], 4)?;
    /// let ring = pool.alloc(1000, RingMode::Strict)?;
    /// // (8 - 1 + 4) rows for layer 0, 1000 for layer 1, instead of 2 x 1000.
    /// assert_eq!(ring.allocated_bytes(), (11 + 1000) * shape.bytes_per_token() / 2);
    /// # Ok::<(), kv_ring::KvError>(())
    /// ```
    pub fn with_layer_windows(
        shape: KvShape,
        budget_bytes: usize,
        windows: Vec<Option<usize>>,
        max_chunk: usize,
    ) -> Result<Arc<Self>, KvError> {
        Self::with_layer_windows_in(shape, budget_bytes, windows, max_chunk, ())
    }
}

impl<S: KvStorage> KvPool<S> {
    /// A pool for `shape` that never holds more than `budget_bytes` of KV buffers, each
    /// allocated by `allocator` ([`KvStorage::zeroed`]).
    ///
    /// Allocates nothing up front. Errors: [`KvError::ZeroDimension`],
    /// [`KvError::HeadDimNotBlockMultiple`], [`KvError::UnsupportedDtype`],
    /// [`KvError::ShapeOverflow`].
    pub fn new_in(
        shape: KvShape,
        budget_bytes: usize,
        allocator: S::Allocator,
    ) -> Result<Arc<Self>, KvError> {
        if shape.n_layers == 0 || shape.n_kv_heads == 0 || shape.head_dim == 0 {
            return Err(KvError::ZeroDimension { shape });
        }
        let block = shape.dtype.block_elems();
        if !shape.head_dim.is_multiple_of(block) {
            return Err(KvError::HeadDimNotBlockMultiple { shape, block });
        }
        if !S::supports(&allocator, shape.dtype) {
            return Err(KvError::UnsupportedDtype { dtype: shape.dtype });
        }
        let Some(bytes_per_token) = shape.checked_bytes_per_token() else {
            return Err(KvError::ShapeOverflow { shape });
        };
        Ok(Arc::new(Self {
            allocator,
            shape,
            bytes_per_token,
            windows: None,
            budget: budget_bytes,
            recycle: AtomicBool::new(true),
            state: Mutex::new(PoolState::default()),
            fresh_allocs: AtomicU64::new(0),
            recycled_allocs: AtomicU64::new(0),
            rejected_allocs: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            grows: AtomicU64::new(0),
        }))
    }

    /// A pool (storage from `allocator`) whose rings keep, for each layer with a sliding window
    /// `w`, only the last `w - 1 + max_chunk` positions (the most a chunk of up to `max_chunk` tokens can attend
    /// to): a ring of capacity `c` holds `min(c, w - 1 + max_chunk)` rows for that layer and
    /// `c` for the others, and costs that much of the budget. `windows` has one entry per
    /// layer. Rings of such a pool are strict ([`RingMode::Strict`]), `begin` refuses chunks
    /// over `max_chunk`, and a window layer's [`KvRing::view`] holds its last rows only
    /// ([`KvRing::layer_len`] of them; position `next_pos() - layer_len(l) + i` at index `i`).
    pub fn with_layer_windows_in(
        shape: KvShape,
        budget_bytes: usize,
        windows: Vec<Option<usize>>,
        max_chunk: usize,
        allocator: S::Allocator,
    ) -> Result<Arc<Self>, KvError> {
        let pool = Self::new_in(shape, budget_bytes, allocator)?;
        if windows.len() != shape.n_layers || max_chunk == 0 || windows.contains(&Some(0)) {
            return Err(KvError::BadLayerWindows {
                layers: windows.len(),
                n_layers: shape.n_layers,
                max_chunk,
            });
        }
        let mut pool = Arc::into_inner(pool).expect("a new pool has one owner");
        if windows.iter().any(Option::is_some) {
            pool.windows = Some(LayerWindows { windows, max_chunk });
        }
        Ok(Arc::new(pool))
    }

    /// The per-layer windows of [`with_layer_windows_in`](Self::with_layer_windows_in), if any layer
    /// has one.
    pub fn layer_windows(&self) -> Option<&[Option<usize>]> {
        self.windows.as_ref().map(|w| &w.windows[..])
    }

    /// The largest chunk a ring of this pool accepts (`None`: no limit but its room).
    pub fn max_chunk(&self) -> Option<usize> {
        self.windows.as_ref().map(|w| w.max_chunk)
    }

    /// Rows each layer of a ring of `capacity` positions keeps (`None` on overflow).
    pub(crate) fn layer_caps(&self, capacity: usize) -> Option<Vec<usize>> {
        let n = self.shape.n_layers;
        Some(match &self.windows {
            None => vec![capacity; n],
            Some(lw) => lw
                .windows
                .iter()
                .map(|w| match w {
                    Some(w) => (w - 1).checked_add(lw.max_chunk).map(|c| c.min(capacity)),
                    None => Some(capacity),
                })
                .collect::<Option<Vec<_>>>()?,
        })
    }

    pub(crate) fn windowed(&self) -> Option<&LayerWindows> {
        self.windows.as_ref()
    }

    /// The shape every ring of this pool has.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// `shape().bytes_per_token()`.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token
    }

    /// Bytes a ring of `capacity_tokens` takes from the budget, or `None` on overflow.
    pub fn ring_bytes(&self, capacity_tokens: usize) -> Option<usize> {
        match &self.windows {
            None => capacity_tokens.checked_mul(self.bytes_per_token),
            Some(_) => {
                let per_layer = self.bytes_per_token / self.shape.n_layers;
                self.layer_caps(capacity_tokens)?
                    .iter()
                    .try_fold(0usize, |a, &c| a.checked_add(c.checked_mul(per_layer)?))
            }
        }
    }

    /// The budget given to [`new`](Self::new).
    pub fn budget_bytes(&self) -> usize {
        self.budget
    }

    /// Bytes held by live rings.
    pub fn used_bytes(&self) -> usize {
        self.lock().used
    }

    /// Bytes held by recycled buffers not in use (included in the budget).
    pub fn cached_bytes(&self) -> usize {
        self.lock().cached
    }

    /// Counters for metrics.
    pub fn stats(&self) -> PoolStats {
        let st = self.lock();
        PoolStats {
            live_rings: st.live,
            used_bytes: st.used,
            cached_bytes: st.cached,
            fresh_allocs: self.fresh_allocs.load(Ordering::Relaxed),
            recycled_allocs: self.recycled_allocs.load(Ordering::Relaxed),
            rejected_allocs: self.rejected_allocs.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            grows: self.grows.load(Ordering::Relaxed),
        }
    }

    /// Turns buffer recycling on (the default) or off. Turning it off does not release cached
    /// buffers; call [`trim`](Self::trim) for that.
    pub fn set_recycling(&self, on: bool) {
        self.recycle.store(on, Ordering::Relaxed);
    }

    /// Releases every cached free buffer to the allocator; returns the bytes released.
    pub fn trim(&self) -> usize {
        let released = {
            let mut st = self.lock();
            st.cached = 0;
            std::mem::take(&mut st.free)
        };
        released
            .values()
            .flatten()
            .map(KvStorage::allocated_bytes)
            .sum()
    }

    /// A ring of `capacity_tokens` positions in `mode`, taking
    /// `capacity_tokens * bytes_per_token()` bytes of the budget until it is dropped.
    ///
    /// O(1): reuses a cached buffer of the same size when there is one, else one zeroed
    /// allocation (see the type docs). Errors: [`KvError::ZeroCapacity`],
    /// [`KvError::WindowedNotStrict`], [`KvError::SinksTooLarge`],
    /// [`KvError::CapacityOverflow`], [`KvError::OverBudget`], [`KvError::StorageFailed`] (the
    /// storage's backend refused; nothing is reserved).
    pub fn alloc(
        self: &Arc<Self>,
        capacity_tokens: usize,
        mode: RingMode,
    ) -> Result<KvRing<S>, KvError> {
        if capacity_tokens == 0 {
            return Err(KvError::ZeroCapacity);
        }
        if self.windows.is_some() && mode != RingMode::Strict {
            return Err(KvError::WindowedNotStrict);
        }
        if let RingMode::Sliding { sinks } = mode
            && sinks >= capacity_tokens
        {
            return Err(KvError::SinksTooLarge {
                sinks,
                capacity: capacity_tokens,
            });
        }
        let storage = self.take_storage(capacity_tokens)?;
        Ok(KvRing::new(
            Arc::clone(self),
            storage,
            capacity_tokens,
            mode,
        ))
    }

    /// Reserves budget for and obtains a buffer of `capacity` tokens.
    fn take_storage(&self, capacity: usize) -> Result<S, KvError> {
        let Some(bytes) = self.ring_bytes(capacity) else {
            return Err(KvError::CapacityOverflow {
                capacity,
                bytes_per_token: self.bytes_per_token,
            });
        };
        let mut to_release = Vec::new();
        {
            let mut st = self.lock();
            if bytes > self.budget - st.used {
                let used = st.used;
                drop(st);
                self.rejected_allocs.fetch_add(1, Ordering::Relaxed);
                return Err(KvError::OverBudget {
                    requested: bytes,
                    used,
                    budget: self.budget,
                });
            }
            st.used += bytes;
            st.live += 1;
            // Rings of one size have one block layout: each layer's rows kept,
            // `min(capacity, window cap)`, never decreases with the capacity, so equal sums
            // mean equal terms.
            if let Some(list) = st.free.get_mut(&bytes) {
                let storage = list.pop();
                if list.is_empty() {
                    st.free.remove(&bytes);
                }
                if let Some(storage) = storage {
                    st.cached -= bytes;
                    drop(st);
                    self.recycled_allocs.fetch_add(1, Ordering::Relaxed);
                    debug_assert_eq!(storage.allocated_bytes(), bytes);
                    return Ok(storage);
                }
            }
            // Fresh buffer: make room by releasing cached buffers, largest first.
            self.evict_cached(&mut st, &mut to_release);
        }
        drop(to_release); // outside the lock: large frees are munmap calls
        self.fresh_allocs.fetch_add(1, Ordering::Relaxed);
        let lens = self
            .block_lens(capacity)
            .expect("ring_bytes did not overflow, so no block length does");
        let storage = S::zeroed(&self.allocator, self.shape.dtype, &lens).inspect_err(|_| {
            let mut st = self.lock();
            st.used -= bytes;
            st.live -= 1;
        })?;
        debug_assert_eq!(storage.allocated_bytes(), bytes);
        Ok(storage)
    }

    /// Elements of each block of a ring of `capacity` positions, in the block order of
    /// [`KvStorage`] (`None` on overflow).
    pub(crate) fn block_lens(&self, capacity: usize) -> Option<Vec<usize>> {
        let (heads, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        let caps = self.layer_caps(capacity)?;
        let mut lens = Vec::with_capacity(caps.len() * heads * 2);
        for cap in caps {
            let len = cap.checked_mul(hd)?;
            lens.extend(std::iter::repeat_n(len, 2 * heads));
        }
        Some(lens)
    }

    /// The allocator the pool's storages come from.
    pub fn allocator(&self) -> &S::Allocator {
        &self.allocator
    }

    /// Gives back `extra` bytes reserved by [`reserve_growth`](Self::reserve_growth) for a
    /// growth whose storage then failed.
    pub(crate) fn unreserve_growth(&self, extra: usize) {
        let mut st = self.lock();
        debug_assert!(st.used >= extra);
        st.used -= extra;
    }

    /// Reserves `extra` more bytes of the budget for a live ring that grows in place
    /// ([`KvRing::grow`]); releases cached free buffers as needed so that resident memory stays
    /// within the budget. Errors: [`KvError::OverBudget`] (nothing reserved).
    pub(crate) fn reserve_growth(&self, extra: usize) -> Result<(), KvError> {
        let mut to_release = Vec::new();
        {
            let mut st = self.lock();
            if extra > self.budget - st.used {
                let used = st.used;
                drop(st);
                self.rejected_allocs.fetch_add(1, Ordering::Relaxed);
                return Err(KvError::OverBudget {
                    requested: extra,
                    used,
                    budget: self.budget,
                });
            }
            st.used += extra;
            self.evict_cached(&mut st, &mut to_release);
        }
        drop(to_release); // outside the lock
        self.grows.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Returns a dropped ring's buffer and its budget.
    pub(crate) fn release(&self, storage: S) {
        let bytes = storage.allocated_bytes();
        self.frees.fetch_add(1, Ordering::Relaxed);
        let keep = self.recycle.load(Ordering::Relaxed);
        let mut st = self.lock();
        debug_assert!(st.used >= bytes && st.live > 0);
        st.used -= bytes;
        st.live -= 1;
        if keep {
            st.cached += bytes;
            st.free.entry(bytes).or_default().push(storage);
        } else {
            drop(st);
            drop(storage);
        }
    }

    /// Moves cached free buffers, largest first, into `to_release` until used plus cached bytes
    /// fit the budget again (the caller frees them outside the lock).
    fn evict_cached(&self, st: &mut PoolState<S>, to_release: &mut Vec<S>) {
        while st.used + st.cached > self.budget {
            let Some(mut entry) = st.free.last_entry() else {
                break;
            };
            let storage = entry.get_mut().pop();
            if entry.get().is_empty() {
                entry.remove();
            }
            if let Some(storage) = storage {
                st.cached -= storage.allocated_bytes();
                to_release.push(storage);
            }
        }
        debug_assert!(st.used + st.cached <= self.budget);
    }

    fn lock(&self) -> MutexGuard<'_, PoolState<S>> {
        // The critical sections run no user code and cannot leave the state inconsistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
