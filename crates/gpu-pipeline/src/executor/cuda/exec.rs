//! [`CudaExecutor`]: device state, weight upload/streaming and the forward pass.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut,
    DevicePtrMut, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits, sys,
};
use cudarc::nvrtc::Ptx;
use kv_ring::{KvDtype, KvShape};
use token_stream::Tokenizer;
use weight_cache::{AccessProfile, GgmlType, WeightCache};

use super::super::Executor;
use super::super::plan::{LayerWeights, Placement, PlanOptions, StreamPlan, WeightSpan};
use super::kernels::{self, MM_THREADS, MM_TOKENS, NORM_THREADS};
use super::kv::{DeviceKv, DeviceRing, RingTables, StepError, kv_err};
use super::{CudaError, probe};
use crate::model::device::{DeviceFfn, DeviceGraph, DeviceMoe, DeviceTensor, Routing};
use crate::model::{Activation, ForwardError, LogitsWanted, Model, ModelConfig, SeqStep};
use crate::threadpool::ThreadPool;

/// Alignment of every tensor in device memory.
const ALIGN: u64 = 256;
/// Threads per block of the element-wise kernels.
const EW_THREADS: u32 = 256;

/// How to create a [`CudaExecutor`].
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct CudaOptions {
    /// The device ordinal (0: the first GPU).
    pub device: usize,
    /// Device bytes for the weights; `None`: all resident. Smaller budgets stream the layers
    /// that do not fit (see [`StreamPlan`]).
    pub budget: Option<u64>,
    /// A directory of kernels compiled beforehand (`kernels::ptx_file_name(arch)`, written by
    /// the `cuda_ptx` example): when it holds the device's, NVRTC is not needed (the driver
    /// loads the PTX). `scripts/gpu-check` uses it for machines without the CUDA toolkit.
    pub ptx_dir: Option<PathBuf>,
    /// The model file's access profile (weight-cache's): under a budget, the tensors with the
    /// most touches per byte stay resident first (a mixture of experts' hot experts: each
    /// expert's matrices are tensors of their own to the plan), the rest stream.
    pub profile: Option<AccessProfile>,
}

impl CudaOptions {
    /// Device `ordinal`.
    pub fn with_device(mut self, ordinal: usize) -> Self {
        self.device = ordinal;
        self
    }

    /// A weight budget in bytes.
    pub fn with_budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// A directory of precompiled PTX (see [`CudaOptions::ptx_dir`]).
    pub fn with_ptx_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.ptx_dir = Some(dir.into());
        self
    }

    /// The access profile the weight plan ranks tensors by (see [`CudaOptions::profile`]).
    pub fn with_profile(mut self, profile: AccessProfile) -> Self {
        self.profile = Some(profile);
        self
    }
}

/// What the executor holds on the device, and its streaming so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceStats {
    /// The device's name.
    pub device: String,
    /// The architecture the kernels were compiled for (`sm_90`).
    pub arch: String,
    /// All weight matrices' bytes.
    pub weight_bytes: u64,
    /// Device bytes for the weights: resident tensors plus both slots.
    pub weight_device_bytes: u64,
    /// Bytes uploaded per step (0: everything resident).
    pub streamed_bytes_per_step: u64,
    /// Forward steps run.
    pub steps: u64,
    /// Bytes uploaded by the streaming so far.
    pub uploaded_bytes: u64,
}

/// Runs the forward pass on an NVIDIA GPU. See the [module docs](super) for the design and
/// its status (unverified on hardware until `scripts/gpu-check` passes).
///
/// ```no_run
/// use std::sync::Arc;
/// use gpu_pipeline::executor::{CudaExecutor, CudaOptions, Executor};
/// use gpu_pipeline::{Model, ModelOptions};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let path = weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while it is mapped.
/// let gguf = Arc::new(unsafe { weight_cache::Gguf::open(&path) }?);
/// let model = Arc::new(Model::load(gguf, ModelOptions::default().with_threads(1))?);
/// match CudaExecutor::new(model, CudaOptions::default()) {
///     Ok(exec) => assert!(exec.config().vocab_size > 0),
///     Err(e) => eprintln!("no GPU here: {e}"),
/// }
/// # Ok(()) }
/// ```
pub struct CudaExecutor {
    model: Arc<Model>,
    /// The compute stream: the sequences' KV rings are allocated and used on it.
    kv_stream: Arc<CudaStream>,
    device: Mutex<Device>,
}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Where a weight matrix lives: the resident buffer or a slot, at an offset.
#[derive(Clone, Copy, Debug)]
enum Home {
    Resident(usize),
    Slot(usize, usize),
}

/// One copy of a streamed tensor: source bytes (file, range) to an offset of its slot.
#[derive(Clone, Debug)]
struct Upload {
    file: usize,
    src: Range<usize>,
    dst: usize,
}

/// The weight matrices on the device.
struct Weights {
    resident: CudaSlice<u8>,
    slots: [CudaSlice<u8>; 2],
    staging: [PinnedHostSlice<u8>; 2],
    /// The upload into each slot, recorded on the copy stream.
    ready: [Option<CudaEvent>; 2],
    homes: HashMap<DeviceTensor, (Home, usize)>,
    /// Per layer, its streamed tensors (empty: the layer is resident).
    uploads: Vec<Vec<Upload>>,
    /// The plan's slot size (0 when nothing streams; the slot buffers then hold 1 byte).
    slot_bytes: usize,
}

impl Weights {
    fn view(&self, t: &DeviceTensor) -> CudaView<'_, u8> {
        match self.homes[t] {
            (Home::Resident(o), len) => self.resident.slice(o..o + len),
            (Home::Slot(s, o), len) => self.slots[s].slice(o..o + len),
        }
    }
}

/// The small per-layer vectors.
struct LayerVecs {
    attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    biases: [Option<CudaSlice<f32>>; 4],
    /// Q and K norms, then the attention and MLP post-norms (see `DeviceLayer`).
    norms: [Option<CudaSlice<f32>>; 4],
    /// Qwen2-MoE's shared-expert gate vector.
    shexp_gate: Option<CudaSlice<f32>>,
}

/// The kernels, by name.
struct Kernels {
    matmul: Vec<(GgmlType, CudaFunction)>,
    embed: Vec<(GgmlType, CudaFunction)>,
    named: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    fn get(&self, name: &str) -> &CudaFunction {
        &self.named[name]
    }

    fn of(list: &[(GgmlType, CudaFunction)], dtype: GgmlType) -> &CudaFunction {
        // Checked at construction: every tensor's format has its kernel.
        &list
            .iter()
            .find(|(t, _)| *t == dtype)
            .expect("format checked")
            .1
    }
}

/// Device activations, grown to the largest batch seen.
struct Scratch {
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    tmp: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    sel: CudaSlice<f32>,
    seln: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    cs: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    tokens: CudaSlice<u32>,
    sel_idx: CudaSlice<u32>,
    /// Mixture of experts: router scores, the experts' gathered inputs, gate, up and output
    /// rows (one per slot), the shared expert's output, the gather indices, each slot's row
    /// and weight.
    router: CudaSlice<f32>,
    moe_in: CudaSlice<f32>,
    moe_gate: CudaSlice<f32>,
    moe_up: CudaSlice<f32>,
    moe_out: CudaSlice<f32>,
    shared: CudaSlice<f32>,
    moe_idx: CudaSlice<u32>,
    moe_rows: CudaSlice<u32>,
    moe_w: CudaSlice<f32>,
}

/// Host buffers of one forward.
#[derive(Default)]
struct HostScratch {
    tokens: Vec<u32>,
    cs: Vec<f32>,
    sel_idx: Vec<u32>,
    /// Per step: first token row.
    rows: Vec<usize>,
    /// Mixture of experts: router probabilities, the routing, the gathered rows' tokens.
    probs: Vec<f32>,
    routing: Routing,
    gather: Vec<u32>,
}

/// What does not change during a forward pass.
struct Core {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    kernels: Kernels,
    graph: DeviceGraph,
    vecs: Vec<LayerVecs>,
    output_norm: CudaSlice<f32>,
}

struct Device {
    core: Core,
    weights: Weights,
    s: Scratch,
    hs: HostScratch,
    /// Where each step's rows are in its device ring, per layer.
    rings: RingTables,
    /// Per layer, its attention window.
    windows: Vec<Option<usize>>,
    stats: DeviceStats,
}

fn u32_of(what: &'static str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
}

/// Makes `buf` hold at least `n` elements (its contents are not kept).
fn ensure<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    n: usize,
) -> Result<(), CudaError> {
    if buf.len() < n {
        *buf = stream
            .alloc_zeros(n.max(1))
            .map_err(CudaError::driver("alloc scratch"))?;
    }
    Ok(())
}

/// Copies `host` to the start of `buf` (grown as needed).
fn upload<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    host: &[T],
    buf: &mut CudaSlice<T>,
) -> Result<(), CudaError> {
    ensure(stream, buf, host.len())?;
    if !host.is_empty() {
        stream
            .memcpy_htod(host, &mut buf.slice_mut(0..host.len()))
            .map_err(CudaError::driver("copy to device"))?;
    }
    Ok(())
}

fn elementwise(n: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(EW_THREADS).max(1), 1, 1),
        block_dim: (EW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn blocks(grid: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaExecutor {
    /// Uploads `model`'s weights to GPU `opts.device` (within `opts.budget`) and compiles the
    /// kernels for it. Without a driver, NVRTC or GPU this is a typed error, never a panic.
    pub fn new(model: Arc<Model>, opts: CudaOptions) -> Result<Self, CudaError> {
        probe::driver()?;
        let cfg = model.config();
        let graph = model
            .device_graph()
            .map_err(|feature| CudaError::Unsupported {
                feature: feature.into(),
                arch: cfg.arch.clone(),
            })?;
        let ctx = CudaContext::new(opts.device).map_err(CudaError::driver("create context"))?;
        let major = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(CudaError::driver("compute capability"))?;
        let minor = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(CudaError::driver("compute capability"))?;
        let arch = format!("sm_{major}{minor}");
        let precompiled = opts
            .ptx_dir
            .as_ref()
            .map(|d| d.join(kernels::ptx_file_name(&arch)))
            .filter(|p| p.is_file());
        let ptx = match precompiled {
            Some(path) => match std::fs::read_to_string(&path) {
                Ok(src) => Ptx::from_src(src),
                Err(source) => return Err(CudaError::PtxFile { path, source }),
            },
            None => kernels::compile(&arch)?,
        };
        let module = ctx
            .load_module(ptx)
            .map_err(CudaError::driver("load module"))?;
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(CudaError::driver("load kernel"))
        };
        let mut named = HashMap::new();
        for &name in kernels::KERNEL_NAMES {
            named.insert(name, load(name)?);
        }
        let mut matmul = Vec::new();
        let mut embed = Vec::new();
        let tensors = std::iter::once(&graph.embd)
            .chain(std::iter::once(&graph.output))
            .chain(graph.layers.iter().flat_map(|l| l.matrices()));
        for t in tensors {
            let suffix = kernels::format_suffix(t.dtype).ok_or_else(|| CudaError::Unsupported {
                feature: format!("weights in {:?}", t.dtype),
                arch: cfg.arch.clone(),
            })?;
            u32_of("row bytes", t.bytes.len() / t.rows.max(1))?;
            u32_of("rows", t.rows)?;
            if !matmul.iter().any(|(d, _)| *d == t.dtype) {
                matmul.push((t.dtype, named[format!("matmul_{suffix}").as_str()].clone()));
                embed.push((t.dtype, named[format!("embed_{suffix}").as_str()].clone()));
            }
        }
        let kernels = Kernels {
            matmul,
            embed,
            named,
        };
        let compute = ctx
            .new_stream()
            .map_err(CudaError::driver("create stream"))?;
        let copy = ctx
            .new_stream()
            .map_err(CudaError::driver("create stream"))?;
        let weights = upload_weights(
            &ctx,
            &compute,
            &model,
            &graph,
            opts.budget,
            opts.profile.as_ref(),
        )?;
        let vec_up = |v: &[f32]| {
            compute
                .clone_htod(v)
                .map_err(CudaError::driver("upload norms"))
        };
        let mut vecs = Vec::with_capacity(graph.layers.len());
        for l in &graph.layers {
            let opt = |b: &Option<Vec<f32>>| b.as_deref().map(vec_up).transpose();
            vecs.push(LayerVecs {
                attn_norm: vec_up(&l.attn_norm)?,
                ffn_norm: vec_up(&l.ffn_norm)?,
                biases: [opt(&l.bq)?, opt(&l.bk)?, opt(&l.bv)?, opt(&l.bo)?],
                norms: [
                    opt(&l.q_norm)?,
                    opt(&l.k_norm)?,
                    opt(&l.attn_post_norm)?,
                    opt(&l.ffn_post_norm)?,
                ],
                shexp_gate: match &l.ffn {
                    DeviceFfn::Moe(m) => opt(&m.shared.as_ref().map(|(_, g)| g.clone()))?,
                    DeviceFfn::Dense(_) => None,
                },
            });
        }
        let output_norm = vec_up(&graph.output_norm)?;
        let z32 = || {
            compute
                .alloc_zeros::<f32>(1)
                .map_err(CudaError::driver("alloc scratch"))
        };
        let zu = || {
            compute
                .alloc_zeros::<u32>(1)
                .map_err(CudaError::driver("alloc scratch"))
        };
        let s = Scratch {
            x: z32()?,
            h: z32()?,
            q: z32()?,
            k: z32()?,
            v: z32()?,
            att: z32()?,
            tmp: z32()?,
            gate: z32()?,
            up: z32()?,
            sel: z32()?,
            seln: z32()?,
            logits: z32()?,
            cs: z32()?,
            scores: z32()?,
            tokens: zu()?,
            sel_idx: zu()?,
            router: z32()?,
            moe_in: z32()?,
            moe_gate: z32()?,
            moe_up: z32()?,
            moe_out: z32()?,
            shared: z32()?,
            moe_idx: zu()?,
            moe_rows: zu()?,
            moe_w: z32()?,
        };
        let weight_bytes = std::iter::once(&graph.embd)
            .chain((graph.output != graph.embd).then_some(&graph.output))
            .chain(graph.layers.iter().flat_map(|l| l.matrices()))
            .map(|t| t.bytes.len() as u64)
            .sum();
        let stats = DeviceStats {
            device: ctx.name().unwrap_or_default(),
            arch,
            weight_bytes,
            weight_device_bytes: (weights.resident.len() + 2 * weights.slot_bytes) as u64,
            streamed_bytes_per_step: weights
                .uploads
                .iter()
                .flatten()
                .map(|u| u.src.len() as u64)
                .sum(),
            steps: 0,
            uploaded_bytes: 0,
        };
        let rings = RingTables::new(&compute)?;
        let windows = graph.layers.iter().map(|l| l.window).collect();
        Ok(Self {
            model,
            kv_stream: Arc::clone(&compute),
            device: Mutex::new(Device {
                core: Core {
                    compute,
                    copy,
                    kernels,
                    graph,
                    vecs,
                    output_norm,
                },
                weights,
                s,
                hs: HostScratch::default(),
                rings,
                windows,
                stats,
            }),
        })
    }

    /// What is on the device and the streaming so far.
    pub fn stats(&self) -> DeviceStats {
        self.lock().stats.clone()
    }

    /// The model (its CPU side: configuration, tokenizer data, thread pool).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Device> {
        self.device.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Plans and uploads the weight matrices: resident ones now, streamed ones per step.
fn upload_weights(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    model: &Model,
    graph: &DeviceGraph,
    budget: Option<u64>,
    profile: Option<&AccessProfile>,
) -> Result<Weights, CudaError> {
    // Distinct tensors (a tied output head is the embedding), globals first.
    let mut list: Vec<&DeviceTensor> = Vec::new();
    let mut id_of: HashMap<&DeviceTensor, usize> = HashMap::new();
    let mut global = Vec::new();
    for t in [&graph.embd, &graph.output] {
        if !id_of.contains_key(t) {
            id_of.insert(t, list.len());
            global.push(WeightSpan::new(
                list.len(),
                t.bytes.start as u64,
                t.bytes.len() as u64,
            ));
            list.push(t);
        }
    }
    let mut layers = Vec::with_capacity(graph.layers.len());
    for l in &graph.layers {
        let mut lw = LayerWeights::default();
        for t in l.matrices() {
            if !id_of.contains_key(t) {
                id_of.insert(t, list.len());
                lw.tensors.push(WeightSpan::new(
                    list.len(),
                    t.bytes.start as u64,
                    t.bytes.len() as u64,
                ));
                list.push(t);
            }
        }
        layers.push(lw);
    }
    let everything: u64 = list
        .iter()
        .map(|t| (t.bytes.len() as u64).next_multiple_of(ALIGN))
        .sum::<u64>()
        + 2 * ALIGN;
    let opts = PlanOptions {
        align: ALIGN,
        profile,
    };
    let plan = StreamPlan::new(&global, &layers, budget.unwrap_or(everything), &opts)?;
    let slot_bytes = plan.slot_bytes() as usize;
    // The resident region: every resident tensor's arena range, below the slots or not.
    let mut homes = HashMap::new();
    let mut resident_end = 0usize;
    let mut uploads = vec![Vec::new(); graph.layers.len()];
    let placed = plan.global().iter().map(|p| (None, p)).chain(
        plan.layers()
            .iter()
            .enumerate()
            .flat_map(|(l, lp)| lp.tensors.iter().map(move |p| (Some(l), p))),
    );
    let mut resident_list = Vec::new();
    for (layer, p) in placed {
        let t = list[p.span.id];
        let len = t.bytes.len();
        match (p.placement, layer) {
            (Placement::Resident { offset }, _) => {
                let o = offset as usize;
                homes.insert(t.clone(), (Home::Resident(o), len));
                resident_end = resident_end.max(o + len);
                resident_list.push((t, o));
            }
            (Placement::Streamed { offset }, Some(l)) => {
                let o = offset as usize;
                homes.insert(t.clone(), (Home::Slot(StreamPlan::slot_of(l), o), len));
                uploads[l].push(Upload {
                    file: t.file,
                    src: t.bytes.clone(),
                    dst: o,
                });
            }
            (Placement::Streamed { .. }, None) => unreachable!("globals are resident"),
        }
    }
    let mut resident: CudaSlice<u8> = stream
        .alloc_zeros(resident_end.max(1))
        .map_err(CudaError::driver("alloc weights"))?;
    let src = model.source();
    for (t, o) in resident_list {
        let bytes = &src.file_bytes(t.file)[t.bytes.clone()];
        stream
            .memcpy_htod(bytes, &mut resident.slice_mut(o..o + bytes.len()))
            .map_err(CudaError::driver("upload weights"))?;
    }
    let slot = || {
        stream
            .alloc_zeros::<u8>(slot_bytes.max(1))
            .map_err(CudaError::driver("alloc slots"))
    };
    // SAFETY: `u8` has no invalid values; every byte a streamed tensor reads is written before
    // its upload (padding between tensors is copied but never read).
    let pinned = || {
        unsafe { ctx.alloc_pinned::<u8>(slot_bytes.max(1)) }
            .map_err(CudaError::driver("alloc pinned staging"))
    };
    let weights = Weights {
        resident,
        slots: [slot()?, slot()?],
        staging: [pinned()?, pinned()?],
        ready: [None, None],
        homes,
        uploads,
        slot_bytes,
    };
    stream
        .synchronize()
        .map_err(CudaError::driver("upload weights"))?;
    Ok(weights)
}

/// Starts layer `layer`'s upload into its slot on the copy stream (no-op for a resident layer).
/// The caller has made the copy stream wait until the slot's previous layer is computed.
fn start_upload(
    core: &Core,
    weights: &mut Weights,
    stats: &mut DeviceStats,
    model: &Model,
    layer: usize,
) -> Result<(), CudaError> {
    let ups = &weights.uploads[layer];
    if ups.is_empty() {
        return Ok(());
    }
    let s = StreamPlan::slot_of(layer);
    let used = ups.iter().map(|u| u.dst + u.src.len()).max().unwrap_or(0);
    // The staging buffer's previous upload must be done before the host rewrites it.
    if let Some(e) = &weights.ready[s] {
        e.synchronize().map_err(CudaError::driver("wait upload"))?;
    }
    let staging = weights.staging[s]
        .as_mut_slice()
        .map_err(CudaError::driver("staging"))?;
    let src = model.source();
    for u in ups {
        staging[u.dst..u.dst + u.src.len()].copy_from_slice(&src.file_bytes(u.file)[u.src.clone()]);
        stats.uploaded_bytes += u.src.len() as u64;
    }
    let staged = weights.staging[s]
        .as_slice()
        .map_err(CudaError::driver("staging"))?;
    core.copy
        .memcpy_htod(&staged[..used], &mut weights.slots[s].slice_mut(0..used))
        .map_err(CudaError::driver("stream weights"))?;
    weights.ready[s] = Some(
        core.copy
            .record_event(None)
            .map_err(CudaError::driver("record event"))?,
    );
    Ok(())
}

/// Before computing `layer`: the compute stream waits for its upload.
fn wait_layer(core: &Core, weights: &Weights, layer: usize) -> Result<(), CudaError> {
    if weights.uploads[layer].is_empty() {
        return Ok(());
    }
    if let Some(e) = &weights.ready[StreamPlan::slot_of(layer)] {
        core.compute
            .wait(e)
            .map_err(CudaError::driver("wait upload"))?;
    }
    Ok(())
}

/// After computing `layer`: its slot is free once the compute stream gets there; layer
/// `layer + 2` is then uploaded into it.
fn release_layer(
    core: &Core,
    weights: &mut Weights,
    stats: &mut DeviceStats,
    model: &Model,
    layer: usize,
) -> Result<(), CudaError> {
    let next = layer + 2;
    if next >= weights.uploads.len() || weights.uploads[next].is_empty() {
        return Ok(());
    }
    let done = core
        .compute
        .record_event(None)
        .map_err(CudaError::driver("record event"))?;
    core.copy
        .wait(&done)
        .map_err(CudaError::driver("wait compute"))?;
    start_upload(core, weights, stats, model, next)
}

/// `y[n x rows] = x[n x cols] * t^T`.
fn matmul(
    core: &Core,
    weights: &Weights,
    t: &DeviceTensor,
    x: &CudaSlice<f32>,
    n: usize,
    y: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let (xl, yl) = (x.len(), y.len());
    matmul_view(
        core,
        weights,
        t,
        &x.slice(0..xl),
        n,
        &mut y.slice_mut(0..yl),
    )
}

/// [`matmul`] over views (an expert's rows of the gathered inputs and outputs).
fn matmul_view(
    core: &Core,
    weights: &Weights,
    t: &DeviceTensor,
    x: &CudaView<'_, f32>,
    n: usize,
    y: &mut CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    debug_assert!(x.len() >= n * t.cols && y.len() >= n * t.rows);
    let f = Kernels::of(&core.kernels.matmul, t.dtype);
    let w = weights.view(t);
    let (row_bytes, rows, cols, n32) = (
        (t.bytes.len() / t.rows) as u32,
        t.rows as u32,
        u32_of("cols", t.cols)?,
        u32_of("tokens", n)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (rows, n32.div_ceil(MM_TOKENS), 1),
        block_dim: (MM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = core.compute.launch_builder(f);
    b.arg(&w)
        .arg(&row_bytes)
        .arg(&rows)
        .arg(&cols)
        .arg(x)
        .arg(&n32)
        .arg(y);
    // SAFETY: the arguments match `matmul_*(const u8*, u32, u32, u32, const float*, u32,
    // float*)`; `w` holds `rows` rows of `row_bytes`, `x` at least `n * cols` floats and `y`
    // `n * rows` (both grown by the caller).
    unsafe { b.launch(cfg) }.map_err(CudaError::driver("matmul"))?;
    Ok(())
}

/// `x += y` over `n` floats.
fn add(core: &Core, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
    let n32 = u32_of("elements", n)?;
    let mut b = core.compute.launch_builder(core.kernels.get("add_inplace"));
    b.arg(x).arg(y).arg(&n32);
    // SAFETY: `add_inplace(float*, const float*, u32)`; both hold at least `n` floats.
    unsafe { b.launch(elementwise(n32)) }.map_err(CudaError::driver("add"))?;
    Ok(())
}

/// `x[r] += bias` over `n` floats in rows of `bias.len()`.
fn add_bias(
    core: &Core,
    x: &mut CudaSlice<f32>,
    bias: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let (width, n32) = (bias.len() as u32, u32_of("elements", n)?);
    let mut b = core.compute.launch_builder(core.kernels.get("add_bias"));
    b.arg(x).arg(bias).arg(&width).arg(&n32);
    // SAFETY: `add_bias(float*, const float*, u32, u32)`; `x` holds at least `n` floats.
    unsafe { b.launch(elementwise(n32)) }.map_err(CudaError::driver("add bias"))?;
    Ok(())
}

/// RMSNorm of `rows` rows of `w.len()` floats from `x` into `out`.
fn rmsnorm(
    core: &Core,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    rows: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let d = w.len() as u32;
    let mut b = core.compute.launch_builder(core.kernels.get("rmsnorm"));
    b.arg(x).arg(w).arg(&d).arg(&eps).arg(out);
    // SAFETY: `rmsnorm(const float*, const float*, u32, float, float*)`; `x` and `out` hold
    // at least `rows * d` floats.
    unsafe { b.launch(blocks(u32_of("rows", rows)?, NORM_THREADS)) }
        .map_err(CudaError::driver("rmsnorm"))?;
    Ok(())
}

/// RMSNorm in place of the first `n` floats of `x` in rows of `w.len()` (Q/K norms per head or
/// per row, post-norms): the `rmsnorm` kernel with one pointer as both its input and output,
/// which it allows (every element is read and then written by the same thread, after the row's
/// sum).
fn rmsnorm_in_place(
    core: &Core,
    x: &mut CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    n: usize,
) -> Result<(), CudaError> {
    debug_assert!(x.len() >= n);
    let d = w.len() as u32;
    let rows = u32_of("rows", n / w.len().max(1))?;
    let (ptr, _sync) = x.device_ptr_mut(&core.compute);
    let mut b = core.compute.launch_builder(core.kernels.get("rmsnorm"));
    b.arg(&ptr).arg(w).arg(&d).arg(&eps).arg(&ptr);
    // SAFETY: `rmsnorm(const float*, const float*, u32, float, float*)` with `x`'s device address
    // as both `x` and `out` (64-bit pointers), `rows * d <= n` floats of it.
    unsafe { b.launch(blocks(rows, NORM_THREADS)) }.map_err(CudaError::driver("rmsnorm"))?;
    Ok(())
}

/// RoPE of `rows` rows of `heads` heads with the table rows `cs` (at `cs_offset` floats).
#[allow(clippy::too_many_arguments)]
fn rope(
    core: &Core,
    x: &mut CudaSlice<f32>,
    rows: usize,
    heads: usize,
    hd: usize,
    n_rot: usize,
    cs: CudaView<'_, f32>,
    neox: bool,
) -> Result<(), CudaError> {
    let (h32, hd32, nr32, nx) = (heads as u32, hd as u32, n_rot as u32, u32::from(neox));
    let mut b = core.compute.launch_builder(core.kernels.get("rope"));
    b.arg(x).arg(&h32).arg(&hd32).arg(&nr32).arg(&cs).arg(&nx);
    // SAFETY: `rope(float*, u32, u32, u32, const float*, u32)`; `x` holds `rows * heads * hd`
    // floats and `cs` `rows * n_rot`.
    unsafe { b.launch(blocks(u32_of("rows", rows * heads)?, 64)) }
        .map_err(CudaError::driver("rope"))?;
    Ok(())
}

/// `gate = act(gate) * up` over `n` floats of the views.
fn activate(
    core: &Core,
    cfg: &ModelConfig,
    gate: &mut CudaViewMut<'_, f32>,
    up: &CudaView<'_, f32>,
    n: usize,
) -> Result<(), CudaError> {
    let name = match cfg.activation {
        Activation::Silu => "silu_mul",
        Activation::GeluTanh => "gelu_tanh_mul",
    };
    let n32 = u32_of("elements", n)?;
    let mut b = core.compute.launch_builder(core.kernels.get(name));
    b.arg(gate).arg(up).arg(&n32);
    // SAFETY: `silu_mul` / `gelu_tanh_mul(float*, const float*, u32)` over `n` floats of both.
    unsafe { b.launch(elementwise(n32)) }.map_err(CudaError::driver("activation"))?;
    Ok(())
}

/// A gated MLP over the `total` rows of `sc.h` into `sc.tmp`, or (`shared`: Qwen2-MoE's shared
/// expert) into `sc.shared`; `sc.gate`, `sc.up` as scratch.
fn gated_mlp(
    core: &Core,
    weights: &Weights,
    cfg: &ModelConfig,
    [gate, up, down]: [&DeviceTensor; 3],
    sc: &mut Scratch,
    total: usize,
    shared: bool,
) -> Result<(), CudaError> {
    let (st, inner) = (&core.compute, gate.rows);
    ensure(st, &mut sc.gate, total * inner)?;
    ensure(st, &mut sc.up, total * inner)?;
    matmul(core, weights, gate, &sc.h, total, &mut sc.gate)?;
    matmul(core, weights, up, &sc.h, total, &mut sc.up)?;
    let n = total * inner;
    activate(
        core,
        cfg,
        &mut sc.gate.slice_mut(0..n),
        &sc.up.slice(0..n),
        n,
    )?;
    let out = if shared {
        ensure(st, &mut sc.shared, total * cfg.n_embd)?;
        &mut sc.shared
    } else {
        &mut sc.tmp
    };
    matmul(core, weights, down, &sc.gate, total, out)
}

/// A mixture of experts over the `total` rows of `sc.h` into `sc.tmp` (`model::moe`): the
/// router's scores on the device, copied to the host and routed there exactly as the CPU routes,
/// the slots' rows gathered by expert, each chosen expert's gated MLP over its rows, then each
/// token's weighted sum in rank order; Qwen2-MoE's shared expert added after.
#[allow(clippy::too_many_arguments)]
fn experts(
    core: &Core,
    weights: &Weights,
    cfg: &ModelConfig,
    moe: &DeviceMoe,
    vecs: &LayerVecs,
    sc: &mut Scratch,
    hs: &mut HostScratch,
    total: usize,
) -> Result<(), CudaError> {
    let st = &core.compute;
    let (d, ne, k) = (cfg.n_embd, moe.experts.len(), moe.n_used);
    let slots = total * k;
    let Some(ff) = moe.experts.first().map(|e| e[0].rows) else {
        return Ok(());
    };
    // 1-2: the router's scores, routed on the host.
    ensure(st, &mut sc.router, total * ne)?;
    matmul(core, weights, &moe.router, &sc.h, total, &mut sc.router)?;
    hs.probs.resize(total * ne, 0.0);
    st.memcpy_dtoh(&sc.router.slice(0..total * ne), &mut hs.probs[..])
        .map_err(CudaError::driver("copy router scores"))?;
    st.synchronize().map_err(CudaError::driver("synchronize"))?;
    moe.route(&mut hs.probs, total, &mut hs.routing);
    let r = &hs.routing;
    // 3: each slot's input row (its token's), grouped by expert.
    hs.gather.clear();
    hs.gather
        .extend(r.order[..slots].iter().map(|&slot| slot / k as u32));
    upload(st, &hs.gather, &mut sc.moe_idx)?;
    upload(st, &r.row_of[..slots], &mut sc.moe_rows)?;
    upload(st, &r.weight[..slots], &mut sc.moe_w)?;
    for (buf, n) in [
        (&mut sc.moe_in, slots * d),
        (&mut sc.moe_gate, slots * ff),
        (&mut sc.moe_up, slots * ff),
        (&mut sc.moe_out, slots * d),
    ] {
        ensure(st, buf, n)?;
    }
    {
        let d32 = d as u32;
        let mut b = st.launch_builder(core.kernels.get("gather_rows"));
        b.arg(&sc.h).arg(&sc.moe_idx).arg(&d32).arg(&mut sc.moe_in);
        // SAFETY: `gather_rows(const float*, const u32*, u32, float*)`; the indices are rows of
        // `h` (tokens below `total`); `moe_in` holds `slots * d` floats.
        unsafe { b.launch(blocks(u32_of("slots", slots)?, 256)) }
            .map_err(CudaError::driver("gather"))?;
    }
    for e in 0..ne {
        let (s, n) = (r.start[e], r.start[e + 1] - r.start[e]);
        if n == 0 {
            continue;
        }
        let [gate, up, down] = &moe.experts[e];
        let input = sc.moe_in.slice(s * d..(s + n) * d);
        matmul_view(
            core,
            weights,
            gate,
            &input,
            n,
            &mut sc.moe_gate.slice_mut(s * ff..(s + n) * ff),
        )?;
        matmul_view(
            core,
            weights,
            up,
            &input,
            n,
            &mut sc.moe_up.slice_mut(s * ff..(s + n) * ff),
        )?;
        activate(
            core,
            cfg,
            &mut sc.moe_gate.slice_mut(s * ff..(s + n) * ff),
            &sc.moe_up.slice(s * ff..(s + n) * ff),
            n * ff,
        )?;
        matmul_view(
            core,
            weights,
            down,
            &sc.moe_gate.slice(s * ff..(s + n) * ff),
            n,
            &mut sc.moe_out.slice_mut(s * d..(s + n) * d),
        )?;
    }
    // 4: each token's weighted sum.
    {
        let (k32, d32) = (k as u32, d as u32);
        let mut b = st.launch_builder(core.kernels.get("moe_combine"));
        b.arg(&sc.moe_out)
            .arg(&sc.moe_rows)
            .arg(&sc.moe_w)
            .arg(&k32)
            .arg(&d32)
            .arg(&mut sc.tmp);
        // SAFETY: `moe_combine(const float*, const u32*, const float*, u32, u32, float*)`; the
        // rows are below `slots`, `moe_out` holds `slots * d` floats, `tmp` `total * d`.
        unsafe { b.launch(blocks(u32_of("tokens", total)?, 128)) }
            .map_err(CudaError::driver("combine experts"))?;
    }
    if let (Some(([gate, up, down], _)), Some(g)) = (&moe.shared, &vecs.shexp_gate) {
        gated_mlp(core, weights, cfg, [gate, up, down], sc, total, true)?;
        let d32 = d as u32;
        let mut b = st.launch_builder(core.kernels.get("shared_expert_add"));
        b.arg(&sc.h)
            .arg(g)
            .arg(&sc.shared)
            .arg(&d32)
            .arg(&mut sc.tmp);
        // SAFETY: `shared_expert_add(const float*, const float*, const float*, u32, float*)`;
        // `h`, `shared` and `tmp` hold `total * d` floats, `g` `d`.
        unsafe { b.launch(blocks(u32_of("tokens", total)?, 128)) }
            .map_err(CudaError::driver("shared expert"))?;
    }
    Ok(())
}

impl Executor for CudaExecutor {
    type Kv = DeviceKv;

    /// The compute stream: rings are allocated, written and read in its order.
    fn kv_allocator(&self) -> Arc<CudaStream> {
        Arc::clone(&self.kv_stream)
    }

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
        self.model.weight_cache()
    }

    fn host_pool(&self) -> &ThreadPool {
        self.model.pool()
    }

    fn stop_tokens_with(&self, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
        self.model.stop_tokens_with(tokenizer)
    }

    fn forward(
        &self,
        steps: &mut [SeqStep<'_, DeviceKv>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        self.forward_on(steps, logits)
    }
}

impl CudaExecutor {
    /// [`Executor::forward`] over rings of any storage that holds a [`DeviceKv`] on this
    /// executor's stream (the [`HostedExecutor`](crate::executor::HostedExecutor)'s enum too).
    pub(crate) fn forward_on<S: DeviceRing>(
        &self,
        steps: &mut [SeqStep<'_, S>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        logits.clear();
        if steps.is_empty() {
            return Ok(());
        }
        self.model.validate(steps)?;
        let mut dev = self.lock();
        dev.forward(&self.model, steps, logits)
            .map_err(ForwardError::from)
    }
}

impl From<StepError> for ForwardError {
    fn from(e: StepError) -> Self {
        match e {
            StepError::Device(e) => Self::Device(Box::new(e)),
            StepError::Kv(step, source) => Self::Kv { step, source },
        }
    }
}

impl Device {
    /// One batched step (the stages of `Model::forward`).
    fn forward<S: DeviceRing>(
        &mut self,
        model: &Model,
        steps: &mut [SeqStep<'_, S>],
        out: &mut Vec<f32>,
    ) -> Result<(), StepError> {
        let Self {
            core,
            weights,
            s: sc,
            hs,
            rings,
            windows,
            stats,
        } = self;
        let cfg = model.config();
        let (d, hd, nh, nkv) = (cfg.n_embd, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let (qd, kvd, n_rot) = (nh * hd, nkv * hd, cfg.rope.n_rot);
        let total: usize = steps.iter().map(|s| s.tokens.len()).sum();
        let st = core.compute.clone();
        stats.steps += 1;

        // Stage 1: begin every ring's chunk, embed, RoPE tables for the positions.
        hs.tokens.clear();
        hs.rows.clear();
        hs.cs.clear();
        hs.cs.resize(core.graph.n_ropes * total * n_rot, 0.0);
        let mut row = 0;
        for (i, s) in steps.iter_mut().enumerate() {
            let n = s.tokens.len();
            s.kv.begin(n).map_err(kv_err(i))?;
            let pos0 = s.kv.next_pos();
            hs.rows.push(row);
            hs.tokens.extend_from_slice(s.tokens);
            for j in 0..n {
                for ti in 0..core.graph.n_ropes {
                    model.rope_row(
                        ti,
                        pos0 + j as u64,
                        &mut hs.cs[(ti * total + row + j) * n_rot..][..n_rot],
                    );
                }
            }
            row += n;
        }
        // Where every ring's rows are, per layer, for kv_scatter and attention_ring (the slots
        // stay put until commit).
        rings.build(steps, windows, &st)?;
        for (buf, n) in [
            (&mut sc.x, total * d),
            (&mut sc.h, total * d),
            (&mut sc.tmp, total * d),
            (&mut sc.q, total * qd),
            (&mut sc.att, total * qd),
            (&mut sc.k, total * kvd),
            (&mut sc.v, total * kvd),
            (&mut sc.gate, total * cfg.n_ff),
            (&mut sc.up, total * cfg.n_ff),
        ] {
            ensure(&st, buf, n)?;
        }
        upload(&st, &hs.tokens, &mut sc.tokens)?;
        upload(&st, &hs.cs, &mut sc.cs)?;
        {
            let e = &core.graph.embd;
            let f = Kernels::of(&core.kernels.embed, e.dtype);
            let w = weights.view(e);
            let (row_bytes, cols, scale) = (
                (e.bytes.len() / e.rows) as u32,
                e.cols as u32,
                cfg.embedding_scale,
            );
            let mut b = st.launch_builder(f);
            b.arg(&w)
                .arg(&row_bytes)
                .arg(&cols)
                .arg(&sc.tokens)
                .arg(&scale)
                .arg(&mut sc.x);
            // SAFETY: `embed_*(const u8*, u32, u32, const u32*, float, float*)`; the tokens
            // were validated below the vocabulary; `x` holds `total * d` floats.
            unsafe { b.launch(blocks(u32_of("tokens", total)?, 128)) }
                .map_err(CudaError::driver("embed"))?;
        }
        for l in 0..weights.uploads.len().min(2) {
            start_upload(core, weights, stats, model, l)?;
        }

        for li in 0..core.graph.layers.len() {
            wait_layer(core, weights, li)?;
            let layer = &core.graph.layers[li];
            let vecs = &core.vecs[li];
            // Stage 2: attention block.
            if li > 0 {
                add(core, &mut sc.x, &sc.tmp, total * d)?;
            }
            rmsnorm(core, &sc.x, &vecs.attn_norm, cfg.rms_eps, total, &mut sc.h)?;
            matmul(core, weights, &layer.wq, &sc.h, total, &mut sc.q)?;
            matmul(core, weights, &layer.wk, &sc.h, total, &mut sc.k)?;
            matmul(core, weights, &layer.wv, &sc.h, total, &mut sc.v)?;
            for (bias, buf, width) in [
                (&vecs.biases[0], &mut sc.q, qd),
                (&vecs.biases[1], &mut sc.k, kvd),
                (&vecs.biases[2], &mut sc.v, kvd),
            ] {
                if let Some(b) = bias {
                    add_bias(core, buf, b, total * width)?;
                }
            }
            // Per-head (or whole-row) Q/K norms, in place.
            let eps = cfg.rms_eps;
            if let Some(w) = &vecs.norms[0] {
                rmsnorm_in_place(core, &mut sc.q, w, eps, total * qd)?;
            }
            if let Some(w) = &vecs.norms[1] {
                rmsnorm_in_place(core, &mut sc.k, w, eps, total * kvd)?;
            }
            if let Some((t, layout)) = layer.rope {
                let neox = layout == crate::model::RopeLayout::Neox;
                let table = t * total * n_rot..(t + 1) * total * n_rot;
                rope(
                    core,
                    &mut sc.q,
                    total,
                    nh,
                    hd,
                    n_rot,
                    sc.cs.slice(table.clone()),
                    neox,
                )?;
                rope(
                    core,
                    &mut sc.k,
                    total,
                    nkv,
                    hd,
                    n_rot,
                    sc.cs.slice(table),
                    neox,
                )?;
            }
            // The step's K/V rows into the rings' slots, then attention over the rings in
            // place (no host copy of either).
            rings.scatter(&st, core.kernels.get("kv_scatter"), li, &sc.k, &sc.v, hd)?;
            for (i, s) in steps.iter_mut().enumerate() {
                s.kv.mark_layer_written(li).map_err(kv_err(i))?;
            }
            ensure(&st, &mut sc.scores, total * nh * rings.max_keys())?;
            rings.attend(
                &st,
                core.kernels.get("attention_ring"),
                li,
                &sc.q,
                (nh, hd),
                (cfg.attention_scale, cfg.attn_softcap.unwrap_or(0.0)),
                &mut sc.scores,
                &mut sc.att,
            )?;
            matmul(core, weights, &layer.wo, &sc.att, total, &mut sc.tmp)?;
            if let Some(b) = &vecs.biases[3] {
                add_bias(core, &mut sc.tmp, b, total * d)?;
            }
            if let Some(w) = &vecs.norms[2] {
                rmsnorm_in_place(core, &mut sc.tmp, w, eps, total * d)?;
            }
            // Stage 3: MLP block.
            add(core, &mut sc.x, &sc.tmp, total * d)?;
            rmsnorm(core, &sc.x, &vecs.ffn_norm, cfg.rms_eps, total, &mut sc.h)?;
            match &layer.ffn {
                DeviceFfn::Dense([gate, up, down]) => {
                    gated_mlp(core, weights, cfg, [gate, up, down], sc, total, false)?;
                }
                DeviceFfn::Moe(moe) => {
                    experts(core, weights, cfg, moe, vecs, sc, hs, total)?;
                }
            }
            if let Some(w) = &vecs.norms[3] {
                rmsnorm_in_place(core, &mut sc.tmp, w, eps, total * d)?;
            }
            release_layer(core, weights, stats, model, li)?;
        }

        // Stage 4: last residual, final norm of the wanted rows, commit, output head.
        add(core, &mut sc.x, &sc.tmp, total * d)?;
        hs.sel_idx.clear();
        for (i, s) in steps.iter().enumerate() {
            let (r0, n) = (hs.rows[i], s.tokens.len());
            let rows = match s.logits {
                LogitsWanted::Last => r0 + n - 1..r0 + n,
                LogitsWanted::All => r0..r0 + n,
                LogitsWanted::None => 0..0,
            };
            hs.sel_idx.extend(rows.map(|r| r as u32));
        }
        for (i, s) in steps.iter_mut().enumerate() {
            s.kv.commit().map_err(kv_err(i))?;
        }
        let n_out = hs.sel_idx.len();
        if n_out == 0 {
            st.synchronize().map_err(CudaError::driver("synchronize"))?;
            return Ok(());
        }
        let vocab = cfg.vocab_size;
        ensure(&st, &mut sc.sel, n_out * d)?;
        ensure(&st, &mut sc.seln, n_out * d)?;
        ensure(&st, &mut sc.logits, n_out * vocab)?;
        upload(&st, &hs.sel_idx, &mut sc.sel_idx)?;
        {
            let d32 = d as u32;
            let mut b = st.launch_builder(core.kernels.get("gather_rows"));
            b.arg(&sc.x).arg(&sc.sel_idx).arg(&d32).arg(&mut sc.sel);
            // SAFETY: `gather_rows(const float*, const u32*, u32, float*)`; the indices are rows
            // of `x`; `sel` holds `n_out * d` floats.
            unsafe { b.launch(blocks(u32_of("rows", n_out)?, 256)) }
                .map_err(CudaError::driver("gather"))?;
        }
        rmsnorm(
            core,
            &sc.sel,
            &core.output_norm,
            cfg.rms_eps,
            n_out,
            &mut sc.seln,
        )?;
        matmul(
            core,
            weights,
            &core.graph.output,
            &sc.seln,
            n_out,
            &mut sc.logits,
        )?;
        if let Some(cap) = cfg.final_softcap {
            let n32 = u32_of("logits", n_out * vocab)?;
            let mut b = st.launch_builder(core.kernels.get("softcap"));
            b.arg(&mut sc.logits).arg(&cap).arg(&n32);
            // SAFETY: `softcap(float*, float, u32)` over the logits.
            unsafe { b.launch(elementwise(n32)) }.map_err(CudaError::driver("softcap"))?;
        }
        out.resize(n_out * vocab, 0.0);
        st.memcpy_dtoh(&sc.logits.slice(0..n_out * vocab), &mut out[..])
            .map_err(CudaError::driver("copy logits"))?;
        st.synchronize().map_err(CudaError::driver("synchronize"))?;
        Ok(())
    }
}
