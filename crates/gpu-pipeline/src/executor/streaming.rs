//! [`StreamingExecutor`]: the CPU kernels reading their weights only from an arena of a fixed
//! budget, with the layers that do not fit streamed into it per step by an uploader thread.
//!
//! This is the weight-streaming design of a device backend, run on the host so CI can check it:
//! the arena plays the device buffer, the uploader thread the copy engine, the per-layer fence
//! the event a device stream waits on. The model itself is unchanged: it reads every weight
//! through its [`WeightSource`], and the source here answers with slices of the arena. Resident
//! tensors (a [`StreamPlan`]) are copied once; layer `l`'s streamed tensors live in slot
//! `l % 2`, which the uploader fills from the mmap while the model computes layer `l - 1`.
//!
//! The fence: the first time a step asks for layer `l`'s bytes, layer `l - 1` is done (the
//! forward pass runs layer by layer and reads a layer's weights only while computing it), so
//! slot `(l + 1) % 2` is free and the upload of layer `l + 1` may start; the request itself
//! waits until layer `l`'s upload has finished. A request for a layer older than the newest
//! one asked for in the step gets an empty slice (a typed kernel error follows), never bytes
//! being overwritten.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_ring::{HostKv, KvDtype, KvShape};
use token_stream::Tokenizer;
use weight_cache::{AccessProfile, Gguf, WeightCache};

use super::Executor;
use super::plan::{LayerWeights, Placement, PlanError, PlanOptions, StreamPlan, WeightSpan};
use crate::model::{
    ForwardError, GgufSource, Model, ModelConfig, ModelError, ModelOptions, SeqStep, SourceTensor,
    WeightSource,
};
use crate::threadpool::ThreadPool;

/// Arena alignment: every tensor starts on a cache line (the GGUF data section's own alignment
/// is 32).
const ALIGN: u64 = 64;

/// Why a [`StreamingExecutor`] could not be built.
#[derive(Debug, thiserror::Error)]
pub enum StreamingError {
    /// The budget does not fit the minimum working set, or the sizes do not add up.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The model did not load from the arena.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The arena does not fit this machine's address space.
    #[error("arena of {bytes} bytes does not fit the address space")]
    ArenaTooLarge {
        /// The arena's size.
        bytes: u64,
    },
    /// The uploader thread could not be started.
    #[error("cannot start the uploader thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// Counters of the streaming so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Forward steps run.
    pub steps: u64,
    /// Bytes copied into the slots.
    pub uploaded_bytes: u64,
    /// Time the uploader spent copying.
    pub upload_time: Duration,
    /// Time the forward pass waited for an upload.
    pub stall_time: Duration,
}

impl StreamStats {
    /// The fraction of upload time hidden behind compute: `1 - stall / upload` (1 when nothing
    /// was uploaded).
    pub fn overlap(&self) -> f64 {
        let up = self.upload_time.as_secs_f64();
        if up == 0.0 {
            return 1.0;
        }
        (1.0 - self.stall_time.as_secs_f64() / up).clamp(0.0, 1.0)
    }
}

/// One cache line of the arena.
#[repr(C, align(64))]
struct Line([u8; ALIGN as usize]);

/// The "device" memory: a fixed block of exactly the plan's size, written by the uploader and
/// read by the kernels under the fence protocol of the [module docs](self).
struct Arena {
    lines: Box<[UnsafeCell<Line>]>,
}

// SAFETY: writes and reads of one region never overlap in time: resident regions are written
// before the arena is shared, slot regions under the fence (see `ArenaSource::layer_bytes`).
unsafe impl Sync for Arena {}

impl Arena {
    fn new(bytes: u64) -> Result<Self, StreamingError> {
        let lines =
            usize::try_from(bytes / ALIGN).map_err(|_| StreamingError::ArenaTooLarge { bytes })?;
        Ok(Self {
            lines: (0..lines)
                .map(|_| UnsafeCell::new(Line([0; ALIGN as usize])))
                .collect(),
        })
    }

    fn len(&self) -> usize {
        self.lines.len() * ALIGN as usize
    }

    fn base(&self) -> *mut u8 {
        // `UnsafeCell<Line>` has `Line`'s layout, and the lines are contiguous.
        UnsafeCell::raw_get(self.lines.as_ptr()).cast::<u8>()
    }

    /// Copies `src` to `offset`.
    ///
    /// # Safety
    /// No slice of `offset..offset + src.len()` from [`Self::slice`] may be alive.
    unsafe fn write(&self, offset: usize, src: &[u8]) {
        assert!(
            offset
                .checked_add(src.len())
                .is_some_and(|e| e <= self.len())
        );
        // SAFETY: in bounds (checked above); the caller guarantees no reader of the range; `src`
        // is another allocation (the mmap), so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base().add(offset), src.len()) }
    }

    /// The bytes at `offset..offset + len`.
    ///
    /// # Safety
    /// No [`Self::write`] to the range may happen while the slice is alive.
    unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len()));
        // SAFETY: in bounds, initialized (zeroed at construction), and not written while the
        // slice lives (the caller's guarantee).
        unsafe { std::slice::from_raw_parts(self.base().add(offset), len) }
    }
}

/// Where the model finds one tensor: a "file" of the arena source and an offset in it.
#[derive(Clone, Copy, Debug)]
struct Home {
    /// 0: the resident region; `1 + l`: layer `l`'s slot.
    file: usize,
    offset: usize,
}

/// One copy of a streamed tensor: from the mmap to the layer's slot.
#[derive(Clone, Debug)]
struct Upload {
    src: std::ops::Range<usize>,
    dst_in_slot: usize,
}

#[derive(Debug, Default)]
struct Fence {
    in_step: bool,
    /// The newest layer the step asked for.
    current: Option<usize>,
    /// Layers below this may be uploaded.
    allowed: usize,
    next_upload: usize,
    /// The layer whose upload into each slot is complete.
    in_slot: [Option<usize>; 2],
    uploading: bool,
    shutdown: bool,
}

/// The model's weights as the arena sees them.
struct ArenaSource {
    gguf: Arc<Gguf>,
    inner: GgufSource,
    plan: StreamPlan,
    arena: Arena,
    /// Per tensor index of the GGUF file.
    homes: Vec<Home>,
    uploads: Vec<Vec<Upload>>,
    fence: Mutex<Fence>,
    changed: Condvar,
    uploaded_bytes: AtomicU64,
    upload_ns: AtomicU64,
    stall_ns: AtomicU64,
}

impl std::fmt::Debug for ArenaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaSource")
            .field("arena_bytes", &self.arena.len())
            .field("resident_bytes", &self.plan.resident_bytes())
            .field("slot_bytes", &self.plan.slot_bytes())
            .finish_non_exhaustive()
    }
}

/// The layer a tensor belongs to (`blk.<l>.` names), if it is a matrix; vectors (norms, biases)
/// and non-layer tensors are global.
fn layer_of(name: &str, shape: &[u64]) -> Option<usize> {
    if shape.iter().filter(|&&d| d > 1).count() < 2 {
        return None;
    }
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The GGUF file's tensors as planner input: (global, per-layer).
fn weights_of(gguf: &Gguf) -> (Vec<WeightSpan>, Vec<LayerWeights>) {
    let base = gguf.bytes().as_ptr() as usize;
    let mut global = Vec::new();
    let mut layers: Vec<LayerWeights> = Vec::new();
    for t in gguf.tensors() {
        let span = WeightSpan::new(
            t.index,
            (t.data.as_ptr() as usize - base) as u64,
            t.data.len() as u64,
        );
        match layer_of(t.name, t.shape) {
            Some(l) => {
                if layers.len() <= l {
                    layers.resize_with(l + 1, LayerWeights::default);
                }
                layers[l].tensors.push(span);
            }
            None => global.push(span),
        }
    }
    (global, layers)
}

impl Fence {
    /// Whether a layer of the `n` may be uploaded now.
    fn upload_due(&self, n: usize) -> bool {
        self.in_step && self.next_upload < self.allowed.min(n)
    }
}

impl ArenaSource {
    fn new(
        gguf: Arc<Gguf>,
        budget: u64,
        profile: Option<&AccessProfile>,
    ) -> Result<Self, StreamingError> {
        let (global, layers) = weights_of(&gguf);
        let opts = PlanOptions {
            align: ALIGN,
            profile,
        };
        let plan = StreamPlan::new(&global, &layers, budget, &opts)?;
        let arena = Arena::new(plan.arena_bytes())?;
        let bytes = gguf.bytes();
        let mut homes = vec![Home { file: 0, offset: 0 }; gguf.tensor_count()];
        let mut uploads = vec![Vec::new(); plan.layers().len()];
        let placed = plan.global().iter().map(|p| (None, p)).chain(
            plan.layers()
                .iter()
                .enumerate()
                .flat_map(|(l, lp)| lp.tensors.iter().map(move |p| (Some(l), p))),
        );
        for (layer, p) in placed {
            let src = p.span.offset as usize..(p.span.offset + p.span.bytes) as usize;
            match (p.placement, layer) {
                (Placement::Resident { offset }, _) => {
                    // SAFETY: the arena is not shared yet; no slice of it exists.
                    unsafe { arena.write(offset as usize, &bytes[src]) };
                    homes[p.span.id] = Home {
                        file: 0,
                        offset: offset as usize,
                    };
                }
                (Placement::Streamed { offset }, Some(l)) => {
                    homes[p.span.id] = Home {
                        file: 1 + l,
                        offset: offset as usize,
                    };
                    uploads[l].push(Upload {
                        src,
                        dst_in_slot: offset as usize,
                    });
                }
                (Placement::Streamed { .. }, None) => unreachable!("globals are resident"),
            }
        }
        Ok(Self {
            inner: GgufSource(gguf.clone()),
            gguf,
            plan,
            arena,
            homes,
            uploads,
            fence: Mutex::new(Fence::default()),
            changed: Condvar::new(),
            uploaded_bytes: AtomicU64::new(0),
            upload_ns: AtomicU64::new(0),
            stall_ns: AtomicU64::new(0),
        })
    }

    /// The fence state (a panic elsewhere cannot leave it inconsistent: every update is a
    /// plain field write under the lock).
    fn lock(&self) -> MutexGuard<'_, Fence> {
        self.fence.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn slot_range(&self, layer: usize) -> (usize, usize) {
        let slot = StreamPlan::slot_of(layer);
        (
            self.plan.slot_offset(slot) as usize,
            self.plan.slot_bytes() as usize,
        )
    }

    /// Layer `layer`'s slot, once its upload is complete (the fence of the module docs).
    fn layer_bytes(&self, layer: usize) -> &[u8] {
        let (offset, len) = self.slot_range(layer);
        let mut f = self.lock();
        if f.in_step {
            match f.current {
                Some(c) if layer < c => return &[],
                Some(c) if layer == c => {}
                _ => {
                    f.current = Some(layer);
                    f.allowed = layer + 2;
                    self.changed.notify_all();
                }
            }
            let t0 = Instant::now();
            while f.in_slot[StreamPlan::slot_of(layer)] != Some(layer) {
                f = self.changed.wait(f).unwrap_or_else(|e| e.into_inner());
            }
            self.stall_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        // SAFETY: outside a step the uploader is idle (`end_step` waited for it) and writes
        // nothing. Inside a step this slot holds `layer` until the uploader may start layer
        // `layer + 2`, which needs a request for `layer + 1` first; the model reads a layer's
        // weights only while computing it and never goes back, and requests for older layers
        // get the empty slice above.
        unsafe { self.arena.slice(offset, len) }
    }

    fn begin_step(&self) {
        let mut f = self.lock();
        while f.uploading {
            f = self.changed.wait(f).unwrap_or_else(|e| e.into_inner());
        }
        f.in_step = true;
        f.current = None;
        f.allowed = 2;
        f.next_upload = 0;
        f.in_slot = [None, None];
        self.changed.notify_all();
    }

    fn end_step(&self) {
        let mut f = self.lock();
        f.in_step = false;
        while f.uploading {
            f = self.changed.wait(f).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The uploader thread's loop: copy each allowed layer into its slot, in order.
    fn upload_loop(&self) {
        let n = self.uploads.len();
        loop {
            let mut f = self.lock();
            while !(f.shutdown || f.upload_due(n)) {
                f = self.changed.wait(f).unwrap_or_else(|e| e.into_inner());
            }
            if f.shutdown {
                return;
            }
            let layer = f.next_upload;
            f.next_upload += 1;
            f.in_slot[StreamPlan::slot_of(layer)] = None;
            f.uploading = true;
            drop(f);
            let t0 = Instant::now();
            let (slot, _) = self.slot_range(layer);
            let bytes = self.gguf.bytes();
            let mut copied = 0;
            for c in &self.uploads[layer] {
                // SAFETY: `layer < allowed = current + 2`, so the slot's previous layer
                // (`layer - 2`) is older than the newest requested one: the model is done with
                // it (module docs), and its requests now get the empty slice.
                unsafe {
                    self.arena
                        .write(slot + c.dst_in_slot, &bytes[c.src.clone()])
                };
                copied += c.src.len() as u64;
            }
            self.upload_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.uploaded_bytes.fetch_add(copied, Ordering::Relaxed);
            let mut f = self.lock();
            f.in_slot[StreamPlan::slot_of(layer)] = Some(layer);
            f.uploading = false;
            self.changed.notify_all();
        }
    }
}

impl WeightSource for ArenaSource {
    fn get_str(&self, key: &str) -> Option<&str> {
        self.inner.get_str(key)
    }
    fn get_u32(&self, key: &str) -> Option<u32> {
        self.inner.get_u32(key)
    }
    fn get_u32_array(&self, key: &str) -> Option<Vec<u32>> {
        self.inner.get_u32_array(key)
    }
    fn get_f32(&self, key: &str) -> Option<f32> {
        self.inner.get_f32(key)
    }
    fn get_bool(&self, key: &str) -> Option<bool> {
        self.inner.get_bool(key)
    }
    fn get_bool_array(&self, key: &str) -> Option<Vec<bool>> {
        self.inner.get_bool_array(key)
    }
    fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.inner.get_f32_array(key)
    }
    fn tensor(&self, name: &str) -> Option<SourceTensor<'_>> {
        let t = self.inner.tensor(name)?;
        let index = t.gguf_index?;
        let home = *self.homes.get(index)?;
        let len = t.data.len();
        let data = self
            .file_bytes(home.file)
            .get(home.offset..home.offset + len)?;
        Some(SourceTensor {
            data,
            file: home.file,
            ..t
        })
    }
    fn file_bytes(&self, file: usize) -> &[u8] {
        match file {
            0 => {
                // SAFETY: the resident region was written before the arena was shared and is
                // never written again.
                unsafe { self.arena.slice(0, self.plan.resident_bytes() as usize) }
            }
            f if f <= self.uploads.len() => self.layer_bytes(f - 1),
            _ => &[],
        }
    }
    fn model_name(&self) -> Option<String> {
        self.inner.model_name()
    }
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template()
    }
}

/// One step's fence: begun on creation, ended (uploader idle, slots released) on drop, so
/// even a panicking forward pass leaves the arena consistent for the next step.
struct StepFence<'a>(&'a ArenaSource);

impl<'a> StepFence<'a> {
    fn begin(source: &'a ArenaSource) -> Self {
        source.begin_step();
        Self(source)
    }
}

impl Drop for StepFence<'_> {
    fn drop(&mut self) {
        self.0.end_step();
    }
}

/// Runs the CPU kernels with the weights in an arena of at most `budget` bytes, streaming what
/// does not fit (see [`StreamPlan`](super::StreamPlan)).
///
/// ```no_run
/// use std::sync::Arc;
/// use gpu_pipeline::executor::{Executor, StreamingExecutor};
/// use gpu_pipeline::ModelOptions;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // SAFETY: the model file is not modified while mapped.
/// let gguf = Arc::new(unsafe { weight_cache::Gguf::open(weight_cache::locate_default_model()?)? });
/// let budget = StreamingExecutor::weight_bytes(&gguf) * 3 / 10; // 30% of the weights
/// let exec = StreamingExecutor::new(gguf, budget, None, ModelOptions::default())?;
/// assert!(exec.arena_bytes() <= budget);
/// # Ok(()) }
/// ```
pub struct StreamingExecutor {
    model: Arc<Model>,
    source: Arc<ArenaSource>,
    uploader: Option<JoinHandle<()>>,
    steps: AtomicU64,
    /// Held for a whole forward step: the fence has one step's state, so steps never overlap
    /// (concurrent callers take turns; `Model::forward` serializes on its scratch anyway).
    step: Mutex<()>,
}

impl std::fmt::Debug for StreamingExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingExecutor")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl StreamingExecutor {
    /// The bytes of all of `gguf`'s tensors as the arena lays them out (each aligned to 64):
    /// the budget at which nothing streams.
    pub fn weight_bytes(gguf: &Gguf) -> u64 {
        gguf.tensors()
            .map(|t| (t.data.len() as u64).div_ceil(ALIGN) * ALIGN)
            .sum()
    }

    /// Plans `gguf`'s weights into an arena of at most `budget` bytes (hot tensors of
    /// `profile` resident first), copies the resident ones, loads the model over the arena and
    /// starts the uploader thread.
    pub fn new(
        gguf: Arc<Gguf>,
        budget: u64,
        profile: Option<&AccessProfile>,
        opts: ModelOptions,
    ) -> Result<Self, StreamingError> {
        let source = Arc::new(ArenaSource::new(gguf, budget, profile)?);
        // Compute must read the arena: packing would copy the weights out of it at load (and
        // from slots not uploaded yet), so this executor runs the file-layout kernels.
        let opts = opts.with_packing(crate::WeightPacking::Off);
        let model = Arc::new(Model::load_source(source.clone(), opts)?);
        let up = source.clone();
        let uploader = std::thread::Builder::new()
            .name("zerolayer-uploader".into())
            .spawn(move || up.upload_loop())?;
        Ok(Self {
            model,
            source,
            uploader: Some(uploader),
            steps: AtomicU64::new(0),
            step: Mutex::new(()),
        })
    }

    /// The arena's size in bytes (never more than the budget).
    pub fn arena_bytes(&self) -> u64 {
        self.source.arena.len() as u64
    }

    /// The plan the arena follows.
    pub fn plan(&self) -> &StreamPlan {
        &self.source.plan
    }

    /// The streaming counters so far.
    pub fn stats(&self) -> StreamStats {
        let s = &self.source;
        StreamStats {
            steps: self.steps.load(Ordering::Relaxed),
            uploaded_bytes: s.uploaded_bytes.load(Ordering::Relaxed),
            upload_time: Duration::from_nanos(s.upload_ns.load(Ordering::Relaxed)),
            stall_time: Duration::from_nanos(s.stall_ns.load(Ordering::Relaxed)),
        }
    }

    /// The model (its weights read from the arena).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }
}

impl Drop for StreamingExecutor {
    fn drop(&mut self) {
        self.source.lock().shutdown = true;
        self.source.changed.notify_all();
        if let Some(t) = self.uploader.take() {
            let _ = t.join();
        }
    }
}

impl Executor for StreamingExecutor {
    type Kv = HostKv;

    fn kv_allocator(&self) {}

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn kv_shape(&self, dtype: KvDtype) -> KvShape {
        self.model.kv_shape(dtype)
    }

    fn kv_windows(&self) -> Vec<Option<usize>> {
        self.model.kv_windows()
    }

    fn weight_cache(&self) -> Option<&WeightCache> {
        None
    }

    fn host_pool(&self) -> &ThreadPool {
        self.model.pool()
    }

    fn stop_tokens_with(&self, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
        self.model.stop_tokens_with(tokenizer)
    }

    fn forward(
        &self,
        steps: &mut [SeqStep<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        let _step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let fence = self
            .source
            .plan
            .streams()
            .then(|| StepFence::begin(&self.source));
        let r = self.model.forward(steps, logits);
        drop(fence);
        self.steps.fetch_add(1, Ordering::Relaxed);
        r
    }
}
