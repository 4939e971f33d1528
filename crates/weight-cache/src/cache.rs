//! The residency layer: access profiling, warm-up, residency stats and a memory budget over a
//! mapped GGUF file.

use std::cell::RefCell;
use std::io;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sys::{self, Advice};
use crate::{AccessProfile, BlockTable, BlockTableError, DEFAULT_BLOCK_SIZE, Gguf, ProfileError};

/// Default fraction of blocks warmed by [`WarmupStrategy::Deterministic`].
pub const DEFAULT_WARM_FRACTION: f32 = 0.23;

/// How to make weights resident before requests need them.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WarmupStrategy {
    /// Do nothing: pages fault in on first use.
    None,
    /// Prefault every block of the file.
    Full,
    /// The hottest `fraction` of blocks from the loaded profile (or the static heuristic without
    /// one), always in the same order: madvise(WILLNEED), then one read per page; `mlock` pins them.
    Deterministic {
        /// Fraction of the file's blocks to warm (0.23 by default).
        fraction: f32,
        /// mlock the warmed blocks (needs RLIMIT_MEMLOCK; failure is logged, not fatal).
        mlock: bool,
    },
    /// Learn from live touches: every `interval`, warm the hottest `fraction` of blocks that are
    /// not resident, in the background, until the handle is cancelled or dropped.
    Adaptive {
        /// Fraction of blocks kept warm.
        fraction: f32,
        /// Time between re-warm passes.
        interval: Duration,
    },
}

impl WarmupStrategy {
    /// `Deterministic` with the default 23% and no mlock.
    pub fn deterministic() -> Self {
        Self::Deterministic {
            fraction: DEFAULT_WARM_FRACTION,
            mlock: false,
        }
    }
}

/// How [`WeightCache::enforce_budget`] releases cold blocks.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseMode {
    /// MADV_PAGEOUT (Linux >= 5.4; falls back to `DontNeed` where unsupported): reclaim now.
    PageOut,
    /// MADV_DONTNEED plus posix_fadvise(DONTNEED) on the range: unmap and drop from the page cache.
    DontNeed,
    /// MADV_COLD: only deprioritise; the kernel reclaims under pressure (residency may not drop).
    Cold,
}

/// Configuration of a [`WeightCache`].
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Block size (power of two >= page size; default 64 KiB).
    pub block_size: usize,
    /// Resident-bytes budget for [`WeightCache::enforce_budget`] (`None`: unlimited). A soft
    /// target: it holds between enforcement passes while nothing reads the weights, but a decode
    /// step of a dense model reads (nearly) every tensor, so while requests run residency returns
    /// to the working set, up to [`WeightCache::tensor_data_bytes`], whatever the budget.
    pub budget_bytes: Option<usize>,
    /// Check residency (mincore) on every n-th touch of a tensor for the all-touch hit rate
    /// (0 disables sampling; first touches per request are always checked). Default 256.
    pub sample_every: u64,
    /// How cold blocks are released.
    pub release: ReleaseMode,
    /// madvise(MADV_RANDOM) the mapping: a fault reads only its pages, no read-ahead (default
    /// false). For a budget smaller than a mixture of experts: the kernel's read-ahead (up to
    /// the device's `read_ahead_kb`, often megabytes) around a faulted expert pulls neighbouring
    /// cold experts in, which is residency the budget then has to release again.
    pub random_access: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            budget_bytes: None,
            sample_every: 256,
            release: ReleaseMode::PageOut,
            random_access: false,
        }
    }
}

impl CacheConfig {
    /// Set the block size.
    pub fn block_size(mut self, v: usize) -> Self {
        self.block_size = v;
        self
    }
    /// Set the resident-bytes budget.
    pub fn budget_bytes(mut self, v: Option<usize>) -> Self {
        self.budget_bytes = v;
        self
    }
    /// Set the residency sampling period.
    pub fn sample_every(mut self, v: u64) -> Self {
        self.sample_every = v;
        self
    }
    /// Set the release mode.
    pub fn release(mut self, v: ReleaseMode) -> Self {
        self.release = v;
        self
    }
    /// Sets [`random_access`](Self::random_access).
    pub fn random_access(mut self, v: bool) -> Self {
        self.random_access = v;
        self
    }
}

/// Identifies a request for per-request profiling (from [`WeightCache::begin_request`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestId(u64);

/// Counters of a [`WeightCache`], with residency from the kernel (mincore).
#[non_exhaustive]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStats {
    /// Tensor touches recorded.
    pub touches: u64,
    /// Requests begun.
    pub requests: u64,
    /// Tokens (forward steps) recorded.
    pub tokens: u64,
    /// Fraction of checked blocks that were resident, over first touches and sampled touches.
    pub hit_rate: Option<f64>,
    /// Fraction of blocks resident when a request first touched them.
    pub first_touch_hit_rate: Option<f64>,
    /// Blocks checked at first touch.
    pub first_touch_blocks: u64,
    /// Resident bytes of the whole mapping now (page cache residency, from mincore).
    pub resident_bytes: usize,
    /// File size.
    pub file_bytes: usize,
    /// Blocks prefaulted by warm-ups.
    pub blocks_warmed: u64,
    /// Time spent warming.
    pub warm_time: Duration,
    /// Blocks released by budget enforcement.
    pub blocks_released: u64,
    /// Part touches recorded ([`WeightCache::touch_part`]: one expert of a stacked tensor).
    pub part_touches: u64,
    /// Fraction of checked part blocks (an expert's byte range) that were resident, over the
    /// first touch of each part in a request and sampled touches: the expert hit rate.
    pub part_hit_rate: Option<f64>,
    /// Bytes this process read from storage since the cache was made (Linux
    /// `/proc/self/io` `read_bytes`: page-cache misses, mapped or read, warm-ups included);
    /// `None` where the kernel does not account it.
    pub storage_read_bytes: Option<u64>,
}

/// Result of [`WeightCache::enforce_budget`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetReport {
    /// Resident bytes before.
    pub resident_before: usize,
    /// Resident bytes after.
    pub resident_after: usize,
    /// Blocks released.
    pub blocks_released: usize,
}

#[repr(align(64))]
#[derive(Default)]
struct TensorCounters {
    touches: AtomicU64,
    requests: AtomicU64,
    last_request: AtomicU64,
}

struct Inner {
    gguf: Arc<Gguf>,
    table: BlockTable,
    cfg: CacheConfig,
    header_crc: u32,
    tensors: Vec<TensorCounters>,
    /// Per tensor, one counter per part of a stacked (3-D) tensor: `shape[2]` equal matrices
    /// (a mixture of experts' `ffn_*_exps`); empty for other tensors.
    parts: Vec<Box<[TensorCounters]>>,
    part_hits: AtomicU64,
    part_misses: AtomicU64,
    /// `read_bytes` of the process when the cache was made.
    read_base: Option<u64>,
    next_request: AtomicU64,
    n_tokens: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    first_hits: AtomicU64,
    first_misses: AtomicU64,
    blocks_warmed: AtomicU64,
    warm_nanos: AtomicU64,
    blocks_released: AtomicU64,
    base: RwLock<Option<AccessProfile>>,
}

/// Profiling, warm-up, residency stats and budget for a mapped GGUF file. Cheap to clone (an
/// `Arc`), `Send + Sync`.
///
/// ```no_run
/// use std::sync::Arc;
/// use weight_cache::{CacheConfig, Gguf, WarmupStrategy, WeightCache, locate_default_model};
///
/// // SAFETY: the model file is not modified while mapped.
/// let gguf = Arc::new(unsafe { Gguf::open(locate_default_model()?)? });
/// let cache = WeightCache::new(gguf.clone(), CacheConfig::default())?;
/// let _ = cache.load_profile("model.profile"); // a missing/corrupt profile is only a warning
/// let warm = cache.warm(WarmupStrategy::deterministic()); // background thread
/// let req = cache.begin_request();
/// let q = gguf.tensor_index("blk.0.attn_q.weight").unwrap();
/// cache.touch(q, req); // a few nanoseconds; the engine calls it per tensor per step
/// cache.end_token();
/// warm.wait();
/// println!("{:?}", cache.stats());
/// cache.save_profile("model.profile")?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct WeightCache {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for WeightCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightCache")
            .field("gguf", &self.inner.gguf)
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

/// Pause between the drops of [`WeightCache::make_cold`]: long enough for a read-ahead in flight
/// (megabytes from a virtual disk) to land.
const COLD_PAUSE: Duration = Duration::from_millis(25);
/// Most drops [`WeightCache::make_cold`] makes before it returns with what could not be dropped.
const COLD_ROUNDS: usize = 40;

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl WeightCache {
    /// A cache over `gguf` with `cfg`.
    pub fn new(gguf: Arc<Gguf>, cfg: CacheConfig) -> Result<Self, BlockTableError> {
        let table = BlockTable::new(&gguf, cfg.block_size)?;
        let header_crc =
            crc32fast::hash(&gguf.bytes()[..gguf.data_offset().min(gguf.bytes().len())]);
        if cfg.random_access && gguf.backing().is_file_backed() {
            let len = gguf.bytes().len();
            if let Err(e) = sys::advise(gguf.backing(), 0..len, Advice::Random) {
                tracing::warn!("weight-cache: madvise(MADV_RANDOM) failed: {e}");
            }
        }
        let tensors = (0..table.n_tensors())
            .map(|_| TensorCounters::default())
            .collect();
        let parts = (0..table.n_tensors())
            .map(|i| {
                let n = gguf
                    .tensor_at(i)
                    .map_or(0, |t| t.shape.get(2).copied().unwrap_or(0) as usize);
                // A stack of at least two matrices; bounded by the tensor's bytes (a part is
                // at least one byte).
                let n = if n >= 2 && n <= table.tensor_bytes(i).len() {
                    n
                } else {
                    0
                };
                (0..n).map(|_| TensorCounters::default()).collect()
            })
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                gguf,
                table,
                cfg,
                header_crc,
                tensors,
                parts,
                part_hits: AtomicU64::new(0),
                part_misses: AtomicU64::new(0),
                read_base: sys::process_read_bytes(),
                next_request: AtomicU64::new(1),
                n_tokens: AtomicU64::new(0),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                first_hits: AtomicU64::new(0),
                first_misses: AtomicU64::new(0),
                blocks_warmed: AtomicU64::new(0),
                warm_nanos: AtomicU64::new(0),
                blocks_released: AtomicU64::new(0),
                base: RwLock::new(None),
            }),
        })
    }

    /// The file.
    pub fn gguf(&self) -> &Arc<Gguf> {
        &self.inner.gguf
    }

    /// The block table.
    pub fn table(&self) -> &BlockTable {
        &self.inner.table
    }

    /// Start a request: touches with its id count towards per-request statistics.
    pub fn begin_request(&self) -> RequestId {
        RequestId(self.inner.next_request.fetch_add(1, Relaxed))
    }

    /// Record one token (forward step) for per-token statistics.
    pub fn end_token(&self) {
        self.inner.n_tokens.fetch_add(1, Relaxed);
    }

    /// Record that `request` read tensor `index` (file order, [`TensorView::index`]). Costs a few
    /// relaxed atomics; the first touch per request, and every `sample_every`-th touch, also ask
    /// the kernel (mincore) whether the tensor's blocks were resident.
    ///
    /// [`TensorView::index`]: crate::TensorView::index
    #[inline]
    pub fn touch(&self, index: usize, request: RequestId) {
        let Some(c) = self.inner.tensors.get(index) else {
            return;
        };
        let n = c.touches.fetch_add(1, Relaxed);
        if c.last_request.load(Relaxed) != request.0
            && c.last_request.swap(request.0, Relaxed) != request.0
        {
            c.requests.fetch_add(1, Relaxed);
            self.check_residency(index, true);
        } else if self.inner.cfg.sample_every > 0 && n % self.inner.cfg.sample_every == 0 {
            self.check_residency(index, false);
        }
    }

    /// Record that `request` read part `part` of stacked tensor `index`: one of the `shape[2]`
    /// equal matrices of a 3-D tensor (expert `part` of a mixture of experts' `ffn_*_exps`),
    /// whose bytes are the tensor's `part`-th equal slice. Counted for that slice's blocks only,
    /// so the profile, the warm-up order and the budget's release order tell hot experts from
    /// cold ones. The first touch of a part per request, and every `sample_every`-th, ask the
    /// kernel (mincore) whether the part's blocks were resident (the part hit rate). A tensor
    /// that is not a stack, or a part out of range, is ignored.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use weight_cache::{CacheConfig, GgmlType, Gguf, GgufBuilder, WeightCache};
    /// // Four experts of 64 x 256 F32 (64 KiB each, one block each).
    /// let file = GgufBuilder::new()
    ///     .tensor("blk.0.ffn_up_exps.weight", GgmlType::F32, &[256, 64, 4], vec![0; 4 << 16])
    ///     .build();
    /// let cache = WeightCache::new(Arc::new(Gguf::from_bytes(file)?), CacheConfig::default())?;
    /// let req = cache.begin_request();
    /// cache.touch_part(0, 2, req);
    /// let (p, t) = (cache.profile(), cache.table());
    /// // Expert 2's bytes (the third quarter) are hot; expert 0's first bytes are not.
    /// let bytes = t.tensor_bytes(0);
    /// let quarter = bytes.len() / 4;
    /// assert_eq!(p.touches[t.block_of(bytes.start + 2 * quarter + quarter / 2)], 1);
    /// assert_eq!(p.touches[t.block_of(bytes.start)], 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn touch_part(&self, index: usize, part: usize, request: RequestId) {
        let Some(c) = self.inner.parts.get(index).and_then(|p| p.get(part)) else {
            return;
        };
        let n = c.touches.fetch_add(1, Relaxed);
        if c.last_request.load(Relaxed) != request.0
            && c.last_request.swap(request.0, Relaxed) != request.0
        {
            c.requests.fetch_add(1, Relaxed);
            self.check_part_residency(index, part, true);
        } else if self.inner.cfg.sample_every > 0 && n % self.inner.cfg.sample_every == 0 {
            self.check_part_residency(index, part, false);
        }
    }

    /// Parts of tensor `index` ([`touch_part`](Self::touch_part)); 0 when it is not a stack.
    pub fn n_parts(&self, index: usize) -> usize {
        self.inner.parts.get(index).map_or(0, |p| p.len())
    }

    /// The blocks of part `part` of stacked tensor `index`.
    fn part_blocks(&self, index: usize, part: usize) -> Range<usize> {
        let n = self.n_parts(index);
        let r = self.inner.table.tensor_bytes(index);
        if part >= n || r.is_empty() {
            return 0..0;
        }
        let len = r.len();
        let (a, b) = (r.start + part * len / n, r.start + (part + 1) * len / n);
        if a >= b {
            return 0..0;
        }
        let t = &self.inner.table;
        t.block_of(a)..t.block_of(b - 1) + 1
    }

    #[cold]
    fn check_part_residency(&self, index: usize, part: usize, first: bool) {
        let blocks = self.part_blocks(index, part);
        if blocks.is_empty() {
            return;
        }
        let (res, total) = self.resident_blocks_in(blocks);
        let (h, m) = (res as u64, (total - res) as u64);
        self.inner.part_hits.fetch_add(h, Relaxed);
        self.inner.part_misses.fetch_add(m, Relaxed);
        self.inner.hits.fetch_add(h, Relaxed);
        self.inner.misses.fetch_add(m, Relaxed);
        if first {
            self.inner.first_hits.fetch_add(h, Relaxed);
            self.inner.first_misses.fetch_add(m, Relaxed);
        }
    }

    /// [`touch`](Self::touch) by tensor name (a hash lookup more).
    pub fn touch_name(&self, name: &str, request: RequestId) {
        if let Some(i) = self.inner.gguf.tensor_index(name) {
            self.touch(i, request);
        }
    }

    #[cold]
    fn check_residency(&self, index: usize, first: bool) {
        let blocks = self.inner.table.tensor_blocks(index);
        if blocks.is_empty() {
            return;
        }
        let (res, total) = self.resident_blocks_in(blocks);
        let (h, m) = (res as u64, (total - res) as u64);
        self.inner.hits.fetch_add(h, Relaxed);
        self.inner.misses.fetch_add(m, Relaxed);
        if first {
            self.inner.first_hits.fetch_add(h, Relaxed);
            self.inner.first_misses.fetch_add(m, Relaxed);
        }
    }

    /// Residency of each block in `blocks` (true when all its pages are resident).
    fn block_residency(&self, blocks: Range<usize>, out: &mut Vec<bool>) -> io::Result<()> {
        out.clear();
        if blocks.is_empty() {
            return Ok(());
        }
        let t = &self.inner.table;
        let range = t.block_bytes(blocks.start).start..t.block_bytes(blocks.end - 1).end;
        let page = sys::page_size();
        let per_block = t.block_size() / page;
        SCRATCH.with(|s| {
            let mut pages = s.borrow_mut();
            sys::residency(self.inner.gguf.bytes(), range, &mut pages)?;
            for b in 0..blocks.len() {
                let lo = (b * per_block).min(pages.len());
                let hi = ((b + 1) * per_block).min(pages.len());
                out.push(pages[lo..hi].iter().all(|&p| p != 0));
            }
            Ok(())
        })
    }

    fn resident_blocks_in(&self, blocks: Range<usize>) -> (usize, usize) {
        let mut v = Vec::new();
        match self.block_residency(blocks.clone(), &mut v) {
            Ok(()) => (v.iter().filter(|&&r| r).count(), v.len()),
            Err(_) => (0, 0),
        }
    }

    /// Resident bytes of the whole mapping (pages in the page cache, per mincore).
    pub fn resident_bytes(&self) -> io::Result<usize> {
        let bytes = self.inner.gguf.bytes();
        SCRATCH.with(|s| {
            let mut pages = s.borrow_mut();
            sys::residency(bytes, 0..bytes.len(), &mut pages)?;
            let n = pages.iter().filter(|&&p| p != 0).count();
            Ok((n * sys::page_size()).min(bytes.len()))
        })
    }

    /// Bytes of all tensor data in the file (the file minus its header and padding): what a
    /// forward pass of a dense model reads per decode step (all of it when the output layer
    /// shares the token embedding, as SmolLM2's does; the embedding rows of the step's tokens
    /// only, otherwise). A residency budget below this cannot hold while requests run.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use weight_cache::{CacheConfig, GgmlType, Gguf, GgufBuilder, WeightCache};
    /// let file = GgufBuilder::new()
    ///     .tensor("a", GgmlType::F32, &[1000], vec![0; 4000])
    ///     .tensor("b", GgmlType::F32, &[24], vec![0; 96])
    ///     .build();
    /// let cache = WeightCache::new(Arc::new(Gguf::from_bytes(file)?), CacheConfig::default())?;
    /// assert_eq!(cache.tensor_data_bytes(), 4096);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tensor_data_bytes(&self) -> usize {
        let t = &self.inner.table;
        (0..t.n_tensors()).map(|i| t.tensor_bytes(i).len()).sum()
    }

    /// Resident bytes of tensor `index`'s blocks.
    pub fn tensor_resident_bytes(&self, index: usize) -> io::Result<usize> {
        let r = self.inner.table.tensor_bytes(index);
        let len = r.len();
        SCRATCH.with(|s| {
            let mut pages = s.borrow_mut();
            sys::residency(self.inner.gguf.bytes(), r, &mut pages)?;
            let n = pages.iter().filter(|&&p| p != 0).count();
            Ok((n * sys::page_size()).min(len))
        })
    }

    /// Current counters and residency.
    pub fn stats(&self) -> CacheStats {
        let i = &self.inner;
        let rate = |h: u64, m: u64| (h + m > 0).then(|| h as f64 / (h + m) as f64);
        let (fh, fm) = (i.first_hits.load(Relaxed), i.first_misses.load(Relaxed));
        CacheStats {
            touches: i.tensors.iter().map(|c| c.touches.load(Relaxed)).sum(),
            requests: i.next_request.load(Relaxed) - 1,
            tokens: i.n_tokens.load(Relaxed),
            hit_rate: rate(i.hits.load(Relaxed), i.misses.load(Relaxed)),
            first_touch_hit_rate: rate(fh, fm),
            first_touch_blocks: fh + fm,
            resident_bytes: self.resident_bytes().unwrap_or(0),
            file_bytes: i.gguf.bytes().len(),
            blocks_warmed: i.blocks_warmed.load(Relaxed),
            warm_time: Duration::from_nanos(i.warm_nanos.load(Relaxed)),
            blocks_released: i.blocks_released.load(Relaxed),
            part_touches: i
                .parts
                .iter()
                .flat_map(|p| p.iter())
                .map(|c| c.touches.load(Relaxed))
                .sum(),
            part_hit_rate: rate(i.part_hits.load(Relaxed), i.part_misses.load(Relaxed)),
            storage_read_bytes: i
                .read_base
                .and_then(|base| Some(sys::process_read_bytes()?.saturating_sub(base))),
        }
    }

    /// The profile: the loaded profile (if any) plus this session's touches, per block. A tensor
    /// touch counts for every block the tensor spans.
    pub fn profile(&self) -> AccessProfile {
        let i = &self.inner;
        let n = i.table.n_blocks();
        let base = i.base.read().ok().and_then(|b| b.clone());
        let mut p = base.unwrap_or_else(|| AccessProfile {
            block_size: i.table.block_size() as u32,
            file_len: i.gguf.bytes().len() as u64,
            header_crc: i.header_crc,
            n_requests: 0,
            n_tokens: 0,
            touches: vec![0; n],
            requests: vec![0; n],
        });
        p.n_requests += i.next_request.load(Relaxed) - 1;
        p.n_tokens += i.n_tokens.load(Relaxed);
        for (t, c) in i.tensors.iter().enumerate() {
            let (tc, rc) = (c.touches.load(Relaxed), c.requests.load(Relaxed));
            if tc == 0 {
                continue;
            }
            for b in i.table.tensor_blocks(t) {
                p.touches[b] += tc;
                p.requests[b] += rc;
            }
        }
        // Parts count for their own slices' blocks.
        for (t, parts) in i.parts.iter().enumerate() {
            for (part, c) in parts.iter().enumerate() {
                let (tc, rc) = (c.touches.load(Relaxed), c.requests.load(Relaxed));
                if tc == 0 {
                    continue;
                }
                for b in self.part_blocks(t, part) {
                    p.touches[b] += tc;
                    p.requests[b] += rc;
                }
            }
        }
        p
    }

    /// Save [`profile`](Self::profile) to `path`.
    pub fn save_profile(&self, path: impl AsRef<Path>) -> Result<(), ProfileError> {
        self.profile().save(path)
    }

    /// Load a profile saved for this model and block size; it becomes the base that later touches
    /// add to. A missing, corrupt or foreign profile is not used: a warning is logged and the error
    /// returned, and the cache keeps working without it.
    pub fn load_profile(&self, path: impl AsRef<Path>) -> Result<(), ProfileError> {
        let path = path.as_ref();
        let r = AccessProfile::load(path).and_then(|p| self.check_profile(p));
        match r {
            Ok(p) => {
                if let Ok(mut b) = self.inner.base.write() {
                    *b = Some(p);
                }
                Ok(())
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring weight-cache profile");
                Err(e)
            }
        }
    }

    fn check_profile(&self, p: AccessProfile) -> Result<AccessProfile, ProfileError> {
        let i = &self.inner;
        let checks = [
            (
                "block size",
                u64::from(p.block_size),
                i.table.block_size() as u64,
            ),
            ("model file length", p.file_len, i.gguf.bytes().len() as u64),
            (
                "model header crc",
                u64::from(p.header_crc),
                u64::from(i.header_crc),
            ),
            (
                "block count",
                p.touches.len() as u64,
                i.table.n_blocks() as u64,
            ),
        ];
        for (what, found, expected) in checks {
            if found != expected {
                return Err(ProfileError::Foreign {
                    what,
                    found,
                    expected,
                });
            }
        }
        Ok(p)
    }

    /// The blocks a one-shot strategy warms, in warm-up order (pure decision, no I/O).
    ///
    /// `Deterministic` with a profile: the profile's hottest blocks ([`AccessProfile::ranked`]),
    /// `ceil(fraction * n_blocks)` of them. Without touches recorded: the static heuristic: norm
    /// tensors, then token embeddings and output, then layer tensors in layer order (blk.0 first),
    /// each in file order, until the fraction is reached.
    pub fn plan(&self, strategy: WarmupStrategy) -> Vec<usize> {
        let n = self.inner.table.n_blocks();
        match strategy {
            WarmupStrategy::None => Vec::new(),
            WarmupStrategy::Full => (0..n).collect(),
            WarmupStrategy::Deterministic { fraction, .. }
            | WarmupStrategy::Adaptive { fraction, .. } => {
                let want = ((fraction.clamp(0.0, 1.0) as f64) * n as f64).ceil() as usize;
                let p = self.profile();
                let mut ranked = p.ranked();
                if ranked.is_empty() {
                    ranked = self.static_ranking();
                }
                ranked.truncate(want);
                ranked
            }
        }
    }

    /// The static heuristic ranking (see [`plan`](Self::plan)).
    fn static_ranking(&self) -> Vec<usize> {
        let g = &self.inner.gguf;
        let class = |name: &str| -> (u32, u32) {
            if name.contains("norm") {
                (0, 0)
            } else if name.starts_with("token_embd") || name.starts_with("output") {
                (1, 0)
            } else if let Some(rest) = name.strip_prefix("blk.") {
                let layer = rest.split('.').next().and_then(|l| l.parse().ok());
                (2, layer.unwrap_or(u32::MAX))
            } else {
                (3, 0)
            }
        };
        let mut ts: Vec<(u32, u32, usize)> = g
            .tensors()
            .map(|t| {
                let (c, l) = class(t.name);
                (c, l, t.index)
            })
            .collect();
        ts.sort();
        let mut seen = vec![false; self.inner.table.n_blocks()];
        let mut out = Vec::new();
        for (_, _, t) in ts {
            for b in self.inner.table.tensor_blocks(t) {
                if !std::mem::replace(&mut seen[b], true) {
                    out.push(b);
                }
            }
        }
        out
    }

    /// Start a warm-up in a background thread; serving continues meanwhile.
    pub fn warm(&self, strategy: WarmupStrategy) -> WarmupHandle {
        let progress = Arc::new(WarmupProgress::default());
        let cache = self.clone();
        let p = progress.clone();
        let adaptive = matches!(strategy, WarmupStrategy::Adaptive { .. });
        let thread = std::thread::Builder::new()
            .name("weight-cache-warm".into())
            .spawn(move || match strategy {
                WarmupStrategy::Adaptive { interval, .. } => {
                    while !p.cancel.load(Relaxed) {
                        let plan = cache.plan(strategy);
                        let mut res = Vec::new();
                        let cold: Vec<usize> = plan
                            .into_iter()
                            .filter(|&b| {
                                cache.block_residency(b..b + 1, &mut res).is_ok()
                                    && res.first() == Some(&false)
                            })
                            .collect();
                        p.total.fetch_add(cold.len(), Relaxed);
                        cache.warm_blocks(&cold, false, &p);
                        let until = Instant::now() + interval;
                        while !p.cancel.load(Relaxed) && Instant::now() < until {
                            std::thread::sleep(Duration::from_millis(5).min(interval));
                        }
                    }
                    p.finished.store(true, Relaxed);
                }
                _ => {
                    let mlock =
                        matches!(strategy, WarmupStrategy::Deterministic { mlock: true, .. });
                    let plan = cache.plan(strategy);
                    p.total.store(plan.len(), Relaxed);
                    cache.warm_blocks(&plan, mlock, &p);
                    p.finished.store(true, Relaxed);
                }
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "could not start the warm-up thread");
                progress.finished.store(true, Relaxed);
                None
            }
        };
        WarmupHandle {
            progress,
            thread,
            cancel_on_drop: adaptive,
        }
    }

    /// Warm `blocks` in order: madvise(WILLNEED) on all, then read one byte per page.
    fn warm_blocks(&self, blocks: &[usize], mlock: bool, p: &WarmupProgress) {
        let t0 = Instant::now();
        let i = &self.inner;
        let bytes = i.gguf.bytes();
        for &b in blocks {
            let _ = sys::advise(i.gguf.backing(), i.table.block_bytes(b), Advice::WillNeed);
        }
        let page = sys::page_size();
        let mut lock_failed = false;
        for &b in blocks {
            if p.cancel.load(Relaxed) {
                break;
            }
            let r = i.table.block_bytes(b);
            let mut acc = 0u8;
            for off in r.clone().step_by(page) {
                acc = acc.wrapping_add(bytes[off]);
            }
            std::hint::black_box(acc);
            if mlock
                && !lock_failed
                && let Err(e) = sys::lock(bytes, r.clone(), true)
            {
                tracing::warn!(error = %e, "mlock of warmed weights failed; continuing unlocked");
                lock_failed = true;
            }
            p.done.fetch_add(1, Relaxed);
            p.bytes.fetch_add(r.len() as u64, Relaxed);
            i.blocks_warmed.fetch_add(1, Relaxed);
        }
        let dt = t0.elapsed();
        i.warm_nanos.fetch_add(dt.as_nanos() as u64, Relaxed);
        p.nanos.fetch_add(dt.as_nanos() as u64, Relaxed);
    }

    /// If resident bytes exceed the configured budget, release the coldest blocks (by profile;
    /// higher block index first among equals) until they fit, with the configured
    /// [`ReleaseMode`]. Returns what happened (a no-op without a budget or within it).
    ///
    /// One pass, not a limit the kernel enforces: pages released here fault back in (from disk,
    /// after `DontNeed`) the next time a forward pass reads them. With a budget below the per-step
    /// working set ([`tensor_data_bytes`](Self::tensor_data_bytes) for a dense model with tied
    /// embeddings) the budget holds only while idle; calling this between decode steps would
    /// re-read the released weights from disk on every step.
    pub fn enforce_budget(&self) -> io::Result<BudgetReport> {
        let before = self.resident_bytes()?;
        let Some(budget) = self.inner.cfg.budget_bytes else {
            return Ok(BudgetReport {
                resident_before: before,
                resident_after: before,
                blocks_released: 0,
            });
        };
        if before <= budget {
            return Ok(BudgetReport {
                resident_before: before,
                resident_after: before,
                blocks_released: 0,
            });
        }
        let n = self.inner.table.n_blocks();
        let p = self.profile();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| {
            (p.requests[a], p.touches[a])
                .cmp(&(p.requests[b], p.touches[b]))
                .then(b.cmp(&a))
        });
        let mut res = Vec::new();
        self.block_residency(0..n, &mut res)?;
        let mut resident = before;
        let mut released = 0;
        for b in order {
            if resident <= budget {
                break;
            }
            // Count a block as resident if any of its pages is (block_residency needs all).
            let r = self.inner.table.block_bytes(b);
            let r_bytes = self.range_resident_bytes(r.clone())?;
            if r_bytes == 0 && !res[b] {
                continue;
            }
            self.release(r)?;
            resident = resident.saturating_sub(r_bytes);
            released += 1;
        }
        self.inner
            .blocks_released
            .fetch_add(released as u64, Relaxed);
        let after = self.resident_bytes()?;
        tracing::debug!(
            before,
            after,
            released,
            budget,
            "weight-cache budget enforced"
        );
        Ok(BudgetReport {
            resident_before: before,
            resident_after: after,
            blocks_released: released,
        })
    }

    fn range_resident_bytes(&self, r: Range<usize>) -> io::Result<usize> {
        let len = r.len();
        SCRATCH.with(|s| {
            let mut pages = s.borrow_mut();
            sys::residency(self.inner.gguf.bytes(), r, &mut pages)?;
            Ok((pages.iter().filter(|&&p| p != 0).count() * sys::page_size()).min(len))
        })
    }

    /// Release one byte range per the configured mode.
    fn release(&self, r: Range<usize>) -> io::Result<()> {
        let g = &self.inner.gguf;
        let backing = g.backing();
        let _ = sys::lock(g.bytes(), r.clone(), false);
        let dontneed = |r: Range<usize>| -> io::Result<()> {
            sys::advise(backing, r.clone(), Advice::DontNeed)?;
            if let Some(f) = backing.file() {
                // Unmapped by us now, so the page cache can drop it (unless others map it).
                let _ = sys::fadvise_dontneed(f, r);
            }
            Ok(())
        };
        match self.inner.cfg.release {
            ReleaseMode::PageOut => match sys::advise(backing, r.clone(), Advice::PageOut) {
                Ok(()) => {
                    // PAGEOUT skips pages still in active use; finish with DONTNEED.
                    dontneed(r)
                }
                Err(_) => dontneed(r),
            },
            ReleaseMode::DontNeed => dontneed(r),
            ReleaseMode::Cold => sys::advise(backing, r, Advice::Cold),
        }
    }

    /// Make the whole file cold: drop this mapping's pages and ask the page cache to drop the file
    /// (posix_fadvise DONTNEED on this file only; pages other processes map stay). For benches and
    /// tests of cold starts.
    ///
    /// Pages still being read (the rest of a fault's read-around, up to the device's
    /// `read_ahead_kb`, often megabytes, is read after the faulting page returns) are locked and
    /// survive a drop, then land in the page cache. So the drop is repeated, 25 ms apart, until two
    /// checks in a row find no page of the file resident (no read in flight landed in between), for
    /// at most 40 rounds (1 s); pages that stay (another process maps them)
    /// are left as they are.
    pub fn make_cold(&self) -> io::Result<()> {
        let mut clean = 0;
        for _ in 0..COLD_ROUNDS {
            self.drop_file_pages()?;
            if self.inner.gguf.backing().file().is_none() {
                return Ok(());
            }
            std::thread::sleep(COLD_PAUSE);
            clean = if self.resident_bytes()? == 0 {
                clean + 1
            } else {
                0
            };
            if clean == 2 {
                break;
            }
        }
        Ok(())
    }

    /// One drop of every page of the file (see [`make_cold`](Self::make_cold)).
    fn drop_file_pages(&self) -> io::Result<()> {
        let g = &self.inner.gguf;
        let len = g.bytes().len();
        let _ = sys::lock(g.bytes(), 0..len, false);
        sys::advise(g.backing(), 0..len, Advice::DontNeed)?;
        match g.backing().file() {
            Some(f) => sys::fadvise_dontneed(f, 0..len),
            None => Ok(()),
        }
    }
}

/// Progress of a warm-up.
#[derive(Debug, Default)]
pub struct WarmupProgress {
    total: AtomicUsize,
    done: AtomicUsize,
    bytes: AtomicU64,
    nanos: AtomicU64,
    finished: AtomicBool,
    cancel: AtomicBool,
}

impl WarmupProgress {
    /// Blocks planned so far.
    pub fn total_blocks(&self) -> usize {
        self.total.load(Relaxed)
    }
    /// Blocks warmed so far.
    pub fn done_blocks(&self) -> usize {
        self.done.load(Relaxed)
    }
    /// Bytes warmed so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Relaxed)
    }
    /// Time spent warming.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Relaxed))
    }
    /// Whether the warm-up thread has finished.
    pub fn is_finished(&self) -> bool {
        self.finished.load(Relaxed)
    }
}

/// A running warm-up. Dropping it detaches a one-shot warm-up (it completes in the background)
/// and stops an adaptive one.
#[derive(Debug)]
pub struct WarmupHandle {
    progress: Arc<WarmupProgress>,
    thread: Option<JoinHandle<()>>,
    cancel_on_drop: bool,
}

impl WarmupHandle {
    /// Live progress.
    pub fn progress(&self) -> &WarmupProgress {
        &self.progress
    }

    /// Ask the warm-up to stop after the current block.
    pub fn cancel(&self) {
        self.progress.cancel.store(true, Relaxed);
    }

    /// Wait for the warm-up to finish (an adaptive one runs until cancelled: cancel first).
    pub fn wait(mut self) -> Arc<WarmupProgress> {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.progress.clone()
    }
}

impl Drop for WarmupHandle {
    fn drop(&mut self) {
        if self.cancel_on_drop {
            self.cancel();
        }
    }
}
