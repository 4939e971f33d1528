//! The Llama-family model graph over a GGUF file, with a batched forward pass.

pub(crate) mod attention;
mod config;
mod ops;
mod source;

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use kv_ring::{KvDtype, KvError, KvRing, KvShape, RingMode};
use weight_cache::{DequantError, GgmlType, Gguf, WeightCache};

use crate::ThreadPool;
use crate::kernels::{self, KernelError, WeightMatrix};

pub use config::{ModelConfig, RopeConfig, RopeLayout, RopeScaling};
pub use source::{GgufSource, SourceTensor, WeightSource};

/// Options of [`Model::load`].
///
/// ```
/// let opts = gpu_pipeline::ModelOptions::default().with_threads(2);
/// assert_eq!(opts.threads, 2);
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// Threads of the model's own [`ThreadPool`]; `0` (default) shares [`ThreadPool::global`].
    pub threads: usize,
    /// Which products get the activation-splitting precision fix (default: `FfnDown`).
    pub activation_split: ActivationSplit,
}

/// The kernels quantize activations to 8 bits per 32-element block before their integer dot
/// products (as llama.cpp does). Splitting the activations into an 8-bit-exact part plus the
/// rounding residual, multiplied as two rows of one product, recovers almost fp32 precision for
/// that product; in decode the weights still stream once, so it costs little time.
///
/// Measured on the default model against the fp32 reference (mean |logit difference| over the
/// fp32 top-8, 10 chat sequences): `Off` 0.221 (llama.cpp: 0.223), `FfnDown` 0.193, `All` 0.001.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationSplit {
    /// Plain 8-bit activations everywhere (fastest; llama.cpp's precision).
    Off,
    /// Split only the MLP down projection, whose SwiGLU inputs have the widest range.
    #[default]
    FfnDown,
    /// Split every product, the output head included (about fp32 precision, ~2x prefill work).
    All,
}

impl ModelOptions {
    /// Sets [`threads`](Self::threads).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }
    /// Sets [`activation_split`](Self::activation_split).
    pub fn with_activation_split(mut self, split: ActivationSplit) -> Self {
        self.activation_split = split;
        self
    }
}

/// Error of [`Model::load`] / [`ModelConfig::from_gguf`].
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `general.architecture` names a model family this graph does not implement.
    #[error("unsupported model architecture {arch:?} (supported: llama, mistral, qwen2)")]
    UnsupportedArchitecture {
        /// The architecture string.
        arch: String,
    },
    /// A required metadata key is absent.
    #[error("GGUF metadata key {key:?} is missing")]
    MissingMetadata {
        /// The key.
        key: String,
    },
    /// A metadata value is out of range or inconsistent.
    #[error("GGUF metadata {key:?} has an invalid value: {value}")]
    InvalidMetadata {
        /// The key.
        key: String,
        /// The value (or the inconsistent values), printed.
        value: String,
    },
    /// `{arch}.rope.scaling.type` is a scaling this graph does not implement (e.g. `yarn`).
    #[error("unsupported RoPE scaling {kind:?} (supported: none, linear)")]
    UnsupportedRopeScaling {
        /// The scaling type string.
        kind: String,
    },
    /// A required tensor is absent.
    #[error("tensor {name:?} is missing from the model file")]
    MissingTensor {
        /// The tensor name.
        name: String,
    },
    /// A tensor's shape does not match the configuration.
    #[error("tensor {tensor:?} has shape {actual:?}, expected {expected:?} (ggml order)")]
    BadShape {
        /// The tensor name.
        tensor: String,
        /// Expected shape, ggml order.
        expected: Vec<u64>,
        /// Shape in the file.
        actual: Vec<u64>,
    },
    /// A tensor's element type has no kernel (or, for norms and the embedding, no dequantizer).
    #[error("tensor {tensor:?} has unsupported dtype {dtype:?}")]
    UnsupportedDtype {
        /// The tensor name.
        tensor: String,
        /// Its element type.
        dtype: GgmlType,
    },
    /// Dequantizing a small tensor (norm weights, biases) failed.
    #[error("cannot dequantize tensor {tensor:?} ({dtype:?}): {source}")]
    Dequantize {
        /// The tensor name.
        tensor: String,
        /// Its element type.
        dtype: GgmlType,
        /// The dequantizer's error.
        #[source]
        source: DequantError,
    },
}

/// Error of [`Model::forward`].
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// A step has no tokens.
    #[error("step {step} has no tokens")]
    EmptyStep {
        /// Index of the step.
        step: usize,
    },
    /// A token id is not below the vocabulary size.
    #[error("step {step}: token id {token} is out of range (vocabulary size {vocab})")]
    TokenOutOfRange {
        /// Index of the step.
        step: usize,
        /// The token id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A ring's pool was made for a different model shape.
    #[error("step {step}: KV ring shape {actual:?} does not match the model's {expected:?}")]
    KvShapeMismatch {
        /// Index of the step.
        step: usize,
        /// What the model needs (dtype aside).
        expected: KvShape,
        /// The ring pool's shape.
        actual: KvShape,
    },
    /// The chunk does not fit in a strict ring (context full), or is larger than a sliding
    /// ring's window. Nothing was computed and no ring was changed.
    #[error(
        "step {step}: {tokens} new tokens do not fit in the KV ring (len {len}, capacity {capacity})"
    )]
    ContextFull {
        /// Index of the step.
        step: usize,
        /// Tokens in the step.
        tokens: usize,
        /// Ring length before the step.
        len: usize,
        /// Ring capacity.
        capacity: usize,
    },
    /// The KV ring refused an operation (e.g. a chunk is already pending on it).
    #[error("step {step}: KV ring error: {source}")]
    Kv {
        /// Index of the step.
        step: usize,
        /// The ring's error.
        #[source]
        source: KvError,
    },
    /// A kernel rejected its operands (an internal shape bug; never expected).
    #[error("kernel error: {0}")]
    Kernel(#[from] KernelError),
}

/// Which logits a [`SeqStep`] wants back.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last token's row (generation).
    Last,
    /// One row per token of the step (scoring, perplexity).
    All,
    /// None (prefill of a chunk that is not the last one).
    None,
}

impl LogitsWanted {
    fn rows(self, n: usize) -> usize {
        match self {
            Self::Last => 1,
            Self::All => n,
            Self::None => 0,
        }
    }
}

/// One sequence's part of a batched [`Model::forward`]: new tokens (a prefill chunk or one
/// decode token) and the sequence's own KV ring.
#[derive(Debug)]
pub struct SeqStep<'a> {
    /// The new tokens, appended at `kv.next_pos()`.
    pub tokens: &'a [u32],
    /// The sequence's cache; the step's K/V are appended and committed.
    pub kv: &'a mut KvRing,
    /// Which logits to return.
    pub logits: LogitsWanted,
}

/// A linear layer's weights: a byte range of the mapping plus its shape.
#[derive(Clone, Debug)]
struct Lin {
    /// Index of the tensor in the GGUF file (for weight-cache touches).
    tensor: usize,
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Range<usize>,
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: Lin,
    wk: Lin,
    wv: Lin,
    wo: Lin,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    w_gate: Lin,
    w_up: Lin,
    w_down: Lin,
}

/// A loaded Llama-family model: configuration, weight locations in the mapping (nothing is
/// copied but the small norm vectors), preallocated scratch space and a thread pool.
///
/// `Send + Sync`; [`forward`](Self::forward) calls are serialized internally (the scratch
/// space is shared), so an engine drives one batched forward at a time.
///
/// ```no_run
/// use std::sync::Arc;
/// use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
/// use kv_ring::{KvDtype, KvPool, RingMode};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let path = weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while mapped.
/// let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path)? });
/// let model = Model::load(gguf, ModelOptions::default())?;
/// let pool = KvPool::new(model.kv_shape(KvDtype::F16), 64 << 20)?;
/// let mut kv = pool.alloc(512, RingMode::Strict)?;
/// let mut logits = Vec::new();
/// let prompt = [1u32, 9690, 198];
/// model.forward(&mut [SeqStep { tokens: &prompt, kv: &mut kv, logits: LogitsWanted::Last }], &mut logits)?;
/// assert_eq!(logits.len(), model.config().vocab_size);
/// # Ok(()) }
/// ```
pub struct Model {
    gguf: Arc<Gguf>,
    cfg: ModelConfig,
    layers: Vec<Layer>,
    embd: Lin,
    output: Lin,
    output_norm: Vec<f32>,
    /// RoPE inverse frequencies (already divided by freq factors and linear scaling).
    inv_freq: Vec<f64>,
    pool: Option<ThreadPool>,
    split: ActivationSplit,
    scratch: Mutex<Scratch>,
    /// Access profiling of the weights (see [`Model::attach_weight_cache`]).
    cache: OnceLock<WeightCache>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// Preallocated per-forward buffers; they grow to the largest batch seen and are then reused.
#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    sel: Vec<f32>,
    hi: Vec<f32>,
    tmp2: Vec<f32>,
    /// cos/sin per token and frequency, interleaved.
    rope: Vec<f32>,
    /// Per-thread attention buffers.
    attn: Vec<Mutex<AttnScratch>>,
    /// Attention query blocks: (step, first token in step, tokens), longest first.
    att_blocks: Vec<(u32, u32, u32)>,
    /// Per step: (first token row, ring length before the step).
    steps: Vec<(usize, usize)>,
    /// The weight cache's current profiling request and the forward calls made in it.
    epoch: Option<(weight_cache::RequestId, u32)>,
}

/// Per-thread attention buffers: the block's query rows, outputs, key counts, and the kernel's
/// scratch.
#[derive(Debug, Default)]
struct AttnScratch {
    q: Vec<f32>,
    o: Vec<f32>,
    n: Vec<usize>,
    f: Vec<f32>,
}

/// Query tokens per attention task (times the GQA group: 48 rows for SmolLM2).
const ATT_BLOCK: usize = 16;

/// Forward calls that count as one request of an attached [`WeightCache`]: its first touch of
/// each tensor in a request asks the kernel (mincore) for residency, so a new request per call
/// would cost a system call per tensor per step.
const PROFILE_EPOCH: u32 = 64;

/// Fewest token rows for which element-wise work is split over the pool.
const PAR_MIN_ROWS: usize = 8;

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

impl Model {
    /// Loads a model from a parsed GGUF file: reads the configuration, checks every tensor's
    /// presence, shape and dtype, and records where the weights are in the mapping.
    pub fn load(gguf: Arc<Gguf>, opts: ModelOptions) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_gguf(&gguf)?;
        let g = &*gguf;
        let (d, hd) = (cfg.n_embd as u64, cfg.head_dim as u64);
        let q_dim = cfg.n_heads as u64 * hd;
        let kv_dim = cfg.n_kv_heads as u64 * hd;
        let ff = cfg.n_ff as u64;
        let embd = lin(g, "token_embd.weight", [d, cfg.vocab_size as u64])?;
        if !embd.dtype.can_dequantize() {
            return Err(ModelError::UnsupportedDtype {
                tensor: "token_embd.weight".into(),
                dtype: embd.dtype,
            });
        }
        let output = match g.tensor("output.weight") {
            Some(_) => lin(g, "output.weight", [d, cfg.vocab_size as u64])?,
            None => embd.clone(),
        };
        check_kernel(g, &output, "output.weight (or tied token_embd.weight)")?;
        let output_norm = vector(g, "output_norm.weight", d)?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let opt_vec = |s: &str, len: u64| -> Result<Option<Vec<f32>>, ModelError> {
                match g.tensor(&n(s)) {
                    Some(_) => vector(g, &n(s), len).map(Some),
                    None => Ok(None),
                }
            };
            layers.push(Layer {
                attn_norm: vector(g, &n("attn_norm.weight"), d)?,
                wq: lin(g, &n("attn_q.weight"), [d, q_dim])?,
                wk: lin(g, &n("attn_k.weight"), [d, kv_dim])?,
                wv: lin(g, &n("attn_v.weight"), [d, kv_dim])?,
                wo: lin(g, &n("attn_output.weight"), [q_dim, d])?,
                bq: opt_vec("attn_q.bias", q_dim)?,
                bk: opt_vec("attn_k.bias", kv_dim)?,
                bv: opt_vec("attn_v.bias", kv_dim)?,
                ffn_norm: vector(g, &n("ffn_norm.weight"), d)?,
                w_gate: lin(g, &n("ffn_gate.weight"), [d, ff])?,
                w_up: lin(g, &n("ffn_up.weight"), [d, ff])?,
                w_down: lin(g, &n("ffn_down.weight"), [ff, d])?,
            });
        }
        let inv_freq = ops::rope_inv_freq(&cfg.rope);
        let pool = (opts.threads > 0).then(|| ThreadPool::new(opts.threads));
        Ok(Self {
            gguf,
            cfg,
            layers,
            embd,
            output,
            output_norm,
            inv_freq,
            pool,
            split: opts.activation_split,
            scratch: Mutex::new(Scratch::default()),
            cache: OnceLock::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The GGUF file the weights live in.
    pub fn gguf(&self) -> &Arc<Gguf> {
        &self.gguf
    }

    /// Records every weight tensor each [`forward`](Self::forward) reads in `cache` (one
    /// [`WeightCache::touch`] per tensor, ~20 ns, and one
    /// [`end_token`](WeightCache::end_token) per call), so its access profile, warm-up plans and
    /// mincore hit rates follow real inference. Every 64 forward calls (batched steps) count as
    /// one request of the cache, so the first touches that ask the kernel for residency stay
    /// rare. Fails, giving `cache` back, when a cache is already attached
    /// or `cache` is over another file.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use gpu_pipeline::{Model, ModelOptions};
    /// use weight_cache::{CacheConfig, Gguf, WeightCache};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // SAFETY: the model file is not modified while mapped.
    /// let gguf = Arc::new(unsafe { Gguf::open(weight_cache::locate_default_model()?)? });
    /// let model = Model::load(gguf.clone(), ModelOptions::default())?;
    /// let cache = WeightCache::new(gguf, CacheConfig::default())?;
    /// model.attach_weight_cache(cache.clone()).expect("same file, first cache");
    /// // ... forward passes ...
    /// println!("weight hit rate {:?}", cache.stats().hit_rate);
    /// # Ok(()) }
    /// ```
    pub fn attach_weight_cache(&self, cache: WeightCache) -> Result<(), WeightCache> {
        if !Arc::ptr_eq(cache.gguf(), &self.gguf) {
            return Err(cache);
        }
        self.cache.set(cache)
    }

    /// The weight cache given to [`attach_weight_cache`](Self::attach_weight_cache).
    pub fn weight_cache(&self) -> Option<&WeightCache> {
        self.cache.get()
    }

    /// The thread pool forward passes run on.
    pub fn pool(&self) -> &ThreadPool {
        self.pool.as_ref().unwrap_or_else(|| ThreadPool::global())
    }

    /// The KV cache geometry of this model, stored as `dtype`.
    pub fn kv_shape(&self, dtype: KvDtype) -> KvShape {
        KvShape::new(
            self.cfg.n_layers,
            self.cfg.n_kv_heads,
            self.cfg.head_dim,
            dtype,
        )
    }

    /// The token ids that end a generation: EOS and, when the file names one, EOT.
    pub fn stop_tokens(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .cfg
            .eos_token_id
            .into_iter()
            .chain(self.cfg.eot_token_id)
            .collect();
        v.dedup();
        v
    }

    fn w(&self, l: &Lin) -> Result<WeightMatrix<'_>, KernelError> {
        WeightMatrix::new(l.dtype, l.rows, l.cols, &self.gguf.bytes()[l.bytes.clone()])
    }

    fn matmul(&self, l: &Lin, x: &[f32], n: usize, y: &mut [f32]) -> Result<(), KernelError> {
        kernels::matmul(
            self.w(l)?,
            &x[..n * l.cols],
            n,
            &mut y[..n * l.rows],
            self.pool(),
        )
    }

    /// Calls `f(rows)` over a partition of `0..n` token rows: in chunks on the pool when there
    /// are enough rows to pay for the hand-off, else here. Row results must not depend on the
    /// partition (every element-wise op here works row by row).
    fn par_rows(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let threads = self.pool().n_threads();
        if threads < 2 || n < PAR_MIN_ROWS {
            return f(0..n);
        }
        let chunk = n.div_ceil(2 * threads);
        self.pool().run(n.div_ceil(chunk), &|t, _| {
            f(t * chunk..((t + 1) * chunk).min(n))
        });
    }

    /// `x += add` (when given), then `h = rmsnorm(x) * w`, row by row in parallel.
    fn residual_norm(&self, x: &mut [f32], add: Option<&[f32]>, w: &[f32], h: &mut [f32]) {
        let d = w.len();
        let (xs, hs) = (ops::SharedRows::new(x, d), ops::SharedRows::new(h, d));
        let eps = self.cfg.rms_eps;
        self.par_rows(xs.len(), &|r| {
            // SAFETY: tasks get disjoint token ranges.
            let (x, h) = unsafe { (xs.rows(r.clone()), hs.rows(r.clone())) };
            if let Some(a) = add {
                ops::add_rows(x, &a[r.start * d..r.end * d]);
            }
            ops::rmsnorm_rows(x, w, eps, h);
        });
    }

    /// `matmul` with the activations split into an 8-bit-exact part and a residual, each
    /// multiplied separately: the kernels' on-the-fly 8-bit activation quantization then costs
    /// almost no precision (about 15 bits instead of 8), for twice the work.
    fn matmul_split(
        &self,
        l: &Lin,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        buf: &mut Vec<f32>,
        tmp: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        // One product over 2n rows [hi; lo]: the weights stream once (decode is bandwidth
        // bound), and row results are batch-invariant, so the sum is too.
        let len = n * l.cols;
        grow(buf, 2 * len);
        grow(tmp, 2 * n * l.rows);
        let (c, o) = (l.cols, l.rows);
        {
            let (h, rest) = buf.split_at_mut(len);
            let (hs, ls) = (
                ops::SharedRows::new(h, c),
                ops::SharedRows::new(&mut rest[..len], c),
            );
            self.par_rows(n, &|r| {
                // SAFETY: tasks get disjoint token ranges.
                let (h, lo) = unsafe { (hs.rows(r.clone()), ls.rows(r.clone())) };
                ops::split_q8(&x[r.start * c..r.end * c], h, lo);
            });
        }
        self.matmul(l, buf, 2 * n, tmp)?;
        let (a, b) = tmp[..2 * n * o].split_at(n * o);
        let ys = ops::SharedRows::new(&mut y[..n * o], o);
        self.par_rows(n, &|r| {
            let (a, b) = (&a[r.start * o..r.end * o], &b[r.start * o..r.end * o]);
            // SAFETY: tasks get disjoint token ranges.
            ops::add_to(a, b, unsafe { ys.rows(r) });
        });
        Ok(())
    }

    /// Runs the model on a batch of sequence steps and appends their logits to `out` (cleared
    /// first): for each step in order, the rows its [`LogitsWanted`] asks for, each
    /// `vocab_size` long.
    ///
    /// All tokens of all steps go through every linear layer as one matrix product (the
    /// weights stream once per call); attention runs per sequence against its own ring. Each
    /// step's K/V are appended to its ring and committed. A row's result does not depend on
    /// the other steps in the batch (bit for bit).
    ///
    /// Validation (empty steps, token ids, ring shapes, context room, pending chunks) happens
    /// before anything is computed; on such an error no ring is changed.
    pub fn forward(
        &self,
        steps: &mut [SeqStep<'_>],
        out: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        let cfg = &self.cfg;
        out.clear();
        if steps.is_empty() {
            return Ok(());
        }
        // ---- validation, before any ring is touched
        for (i, s) in steps.iter().enumerate() {
            let n = s.tokens.len();
            if n == 0 {
                return Err(ForwardError::EmptyStep { step: i });
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ForwardError::TokenOutOfRange {
                    step: i,
                    token: t,
                    vocab: cfg.vocab_size,
                });
            }
            let shape = s.kv.pool().shape();
            let want = self.kv_shape(shape.dtype);
            if shape != want {
                return Err(ForwardError::KvShapeMismatch {
                    step: i,
                    expected: want,
                    actual: shape,
                });
            }
            if s.kv.pending() != 0 {
                return Err(ForwardError::Kv {
                    step: i,
                    source: KvError::ChunkPending {
                        pending: s.kv.pending(),
                    },
                });
            }
            let room = match s.kv.mode() {
                RingMode::Strict => s.kv.capacity() - s.kv.len(),
                RingMode::Sliding { sinks } => s.kv.capacity().saturating_sub(sinks),
            };
            if n > room {
                return Err(ForwardError::ContextFull {
                    step: i,
                    tokens: n,
                    len: s.kv.len(),
                    capacity: s.kv.capacity(),
                });
            }
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        let total: usize = steps.iter().map(|s| s.tokens.len()).sum();
        let (d, hd, nh, nkv) = (cfg.n_embd, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let n_threads = self.pool().n_threads();
        grow(&mut sc.x, total * d);
        grow(&mut sc.h, total * d);
        grow(&mut sc.q, total * qd);
        grow(&mut sc.k, total * kvd);
        grow(&mut sc.v, total * kvd);
        grow(&mut sc.att, total * qd);
        grow(&mut sc.tmp, total * d);
        grow(&mut sc.gate, total * cfg.n_ff);
        grow(&mut sc.up, total * cfg.n_ff);
        grow(&mut sc.rope, total * cfg.rope.n_rot);
        while sc.attn.len() < n_threads {
            sc.attn.push(Mutex::new(AttnScratch::default()));
        }
        sc.steps.clear();

        let touch = self.cache.get().map(|c| {
            let (req, calls) = sc.epoch.get_or_insert_with(|| (c.begin_request(), 0));
            if *calls == PROFILE_EPOCH {
                *req = c.begin_request();
                *calls = 0;
            }
            *calls += 1;
            (c, *req)
        });
        if let Some((c, r)) = touch {
            c.touch(self.embd.tensor, r);
        }

        // ---- begin the chunks (validated above, so these cannot fail for room)
        let mut row = 0usize;
        for (i, s) in steps.iter_mut().enumerate() {
            let n = s.tokens.len();
            s.kv.begin(n)
                .map_err(|source| ForwardError::Kv { step: i, source })?;
            let len_before = s.kv.len();
            let pos0 = s.kv.next_pos();
            sc.steps.push((row, len_before));
            for (j, &t) in s.tokens.iter().enumerate() {
                // embedding row, dequantized on lookup
                let r = t as usize;
                let rb = self.embd.bytes.len() / self.embd.rows;
                let src = &self.gguf.bytes()[self.embd.bytes.start + r * rb..][..rb];
                let dst = &mut sc.x[(row + j) * d..][..d];
                weight_cache::dequantize(self.embd.dtype, src, dst).map_err(|_| {
                    KernelError::UnsupportedDtype {
                        dtype: self.embd.dtype,
                    }
                })?;
                ops::rope_cos_sin(
                    &self.inv_freq,
                    pos0 + j as u64,
                    &mut sc.rope[(row + j) * cfg.rope.n_rot..][..cfg.rope.n_rot],
                );
            }
            row += n;
        }
        sc.att_blocks.clear();
        for (i, s) in steps.iter().enumerate() {
            let n = s.tokens.len() as u32;
            for j0 in (0..n).step_by(ATT_BLOCK) {
                sc.att_blocks
                    .push((i as u32, j0, (n - j0).min(ATT_BLOCK as u32)));
            }
        }
        // Longest first, so the last tasks claimed are short ones.
        let lens = &sc.steps;
        sc.att_blocks
            .sort_by_key(|&(i, j0, tq)| std::cmp::Reverse(lens[i as usize].1 + (j0 + tq) as usize));
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            // attention block (after the previous layer's MLP residual, still in `tmp`)
            let add = (li > 0).then_some(&sc.tmp[..total * d]);
            self.residual_norm(
                &mut sc.x[..total * d],
                add,
                &layer.attn_norm,
                &mut sc.h[..total * d],
            );
            let sp = match self.split {
                ActivationSplit::Off => "",
                ActivationSplit::FfnDown => "d",
                ActivationSplit::All => "qkvogud",
            };
            macro_rules! mm {
                ($c:expr, $w:expr, $x:ident, $y:ident) => {
                    if let Some((c, r)) = touch {
                        c.touch($w.tensor, r);
                    }
                    if sp.contains($c) {
                        self.matmul_split($w, &sc.$x, total, &mut sc.$y, &mut sc.hi, &mut sc.tmp2)?
                    } else {
                        self.matmul($w, &sc.$x, total, &mut sc.$y)?
                    }
                };
            }
            // Products sharing an input run as one group (quantized once, one pool call),
            // unless split for precision.
            macro_rules! mm_group {
                ($x:ident, [$(($c:expr, $w:expr, $y:ident)),+]) => {
                    if $(sp.contains($c))||+ {
                        $(mm!($c, $w, $x, $y);)+
                    } else {
                        if let Some((c, r)) = touch {
                            $(c.touch($w.tensor, r);)+
                        }
                        let ws = [$(self.w($w)?),+];
                        let x = &sc.$x[..total * ws[0].cols];
                        let mut ys = [$(&mut sc.$y[..total * $w.rows]),+];
                        kernels::matmul_many(&ws, x, total, &mut ys, self.pool())?;
                    }
                };
            }
            mm_group!(
                h,
                [
                    ('q', &layer.wq, q),
                    ('k', &layer.wk, k),
                    ('v', &layer.wv, v)
                ]
            );
            for (b, buf, width) in [
                (&layer.bq, &mut sc.q, qd),
                (&layer.bk, &mut sc.k, kvd),
                (&layer.bv, &mut sc.v, kvd),
            ] {
                if let Some(b) = b {
                    for r in buf[..total * width].chunks_exact_mut(width) {
                        r.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                    }
                }
            }
            {
                let qs = ops::SharedRows::new(&mut sc.q[..total * qd], qd);
                let ks = ops::SharedRows::new(&mut sc.k[..total * kvd], kvd);
                let rope = &sc.rope;
                self.par_rows(total, &|r| {
                    for t in r {
                        let cs = &rope[t * cfg.rope.n_rot..][..cfg.rope.n_rot];
                        // SAFETY: tasks get disjoint token ranges.
                        let (q, k) = unsafe { (qs.row(t), ks.row(t)) };
                        for h in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                            ops::rope_apply(cfg.rope.layout, cs, h);
                        }
                    }
                });
            }
            for (i, s) in steps.iter_mut().enumerate() {
                let (r0, _) = sc.steps[i];
                let n = s.tokens.len();
                s.kv.write_layer(
                    li,
                    &sc.k[r0 * kvd..(r0 + n) * kvd],
                    &sc.v[r0 * kvd..(r0 + n) * kvd],
                )
                .map_err(|source| ForwardError::Kv { step: i, source })?;
            }
            let att_out = ops::SharedRows::new(&mut sc.att[..total * qd], hd);
            let q = &sc.q;
            let blocks = &sc.att_blocks;
            let step_info = &sc.steps;
            let scratch = &sc.attn;
            let steps_ref: &[SeqStep<'_>] = steps;
            let group = cfg.gqa_group();
            let err: Mutex<Option<ForwardError>> = Mutex::new(None);
            // One task per (query block, KV head): the group's query heads of up to
            // ATT_BLOCK tokens of one step, against that step's ring.
            self.pool().run(blocks.len() * nkv, &|task, thread| {
                let (b, g) = (task / nkv, task % nkv);
                let (si, j0, tq) = blocks[b];
                let (r0, len_before) = step_info[si as usize];
                let ring = &*steps_ref[si as usize].kv;
                let view = match ring.view(li, g) {
                    Ok(v) => v,
                    Err(source) => {
                        *err.lock().unwrap_or_else(|e| e.into_inner()) = Some(ForwardError::Kv {
                            step: si as usize,
                            source,
                        });
                        return;
                    }
                };
                let mut guard = scratch[thread].lock().unwrap_or_else(|e| e.into_inner());
                let AttnScratch {
                    q: qb,
                    o: ob,
                    n: nb,
                    f,
                } = &mut *guard;
                let rows = tq as usize * group;
                qb.clear();
                nb.clear();
                for j in j0 as usize..(j0 + tq) as usize {
                    let t = r0 + j;
                    for h in g * group..(g + 1) * group {
                        qb.extend_from_slice(&q[t * qd + h * hd..][..hd]);
                        nb.push(len_before + j + 1);
                    }
                }
                ob.resize(rows * hd, 0.0);
                attention::attend_rows(qb, nb, hd, &view, scale, f, &mut ob[..rows * hd]);
                for (i, o) in ob[..rows * hd].chunks_exact(hd).enumerate() {
                    let (j, h) = (j0 as usize + i / group, g * group + i % group);
                    // SAFETY: row (token, head) belongs to this task's block and KV head only.
                    unsafe { att_out.row((r0 + j) * nh + h) }.copy_from_slice(o);
                }
            });
            if let Some(e) = err.into_inner().unwrap_or_else(|e| e.into_inner()) {
                return Err(e);
            }
            mm!('o', &layer.wo, att, tmp);
            // MLP block
            let add = Some(&sc.tmp[..total * d]);
            self.residual_norm(
                &mut sc.x[..total * d],
                add,
                &layer.ffn_norm,
                &mut sc.h[..total * d],
            );
            mm_group!(h, [('g', &layer.w_gate, gate), ('u', &layer.w_up, up)]);
            {
                let nff = cfg.n_ff;
                let gs = ops::SharedRows::new(&mut sc.gate[..total * nff], nff);
                let up = &sc.up;
                self.par_rows(total, &|r| {
                    // SAFETY: tasks get disjoint token ranges.
                    let g = unsafe { gs.rows(r.clone()) };
                    ops::silu_mul_rows(g, &up[r.start * nff..r.end * nff]);
                });
            }
            mm!('d', &layer.w_down, gate, tmp);
        }
        // ---- output head on the wanted rows only
        let n_out: usize = steps.iter().map(|s| s.logits.rows(s.tokens.len())).sum();
        grow(&mut sc.sel, n_out * d);
        let mut o = 0;
        for (i, s) in steps.iter().enumerate() {
            let (r0, _) = sc.steps[i];
            let n = s.tokens.len();
            let rows = match s.logits {
                LogitsWanted::Last => r0 + n - 1..r0 + n,
                LogitsWanted::All => r0..r0 + n,
                LogitsWanted::None => 0..0,
            };
            for r in rows {
                // The last layer's MLP residual, needed only on the rows the head reads.
                ops::add_rows(&mut sc.x[r * d..][..d], &sc.tmp[r * d..][..d]);
                ops::rmsnorm_rows(
                    &sc.x[r * d..][..d],
                    &self.output_norm,
                    cfg.rms_eps,
                    &mut sc.sel[o * d..][..d],
                );
                o += 1;
            }
        }
        for (i, s) in steps.iter_mut().enumerate() {
            s.kv.commit()
                .map_err(|source| ForwardError::Kv { step: i, source })?;
        }
        if let Some((c, r)) = touch {
            if n_out > 0 {
                c.touch(self.output.tensor, r);
            }
            c.end_token();
        }
        if n_out > 0 {
            out.resize(n_out * cfg.vocab_size, 0.0);
            if self.split == ActivationSplit::All {
                self.matmul_split(&self.output, &sc.sel, n_out, out, &mut sc.hi, &mut sc.tmp2)?;
            } else {
                self.matmul(&self.output, &sc.sel, n_out, out)?;
            }
        }
        Ok(())
    }
}

fn lin(g: &Gguf, name: &str, shape: [u64; 2]) -> Result<Lin, ModelError> {
    let t = g
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
    if t.shape != shape {
        return Err(ModelError::BadShape {
            tensor: name.into(),
            expected: shape.to_vec(),
            actual: t.shape.to_vec(),
        });
    }
    let base = g.bytes().as_ptr() as usize;
    let start = (t.data.as_ptr() as usize).wrapping_sub(base);
    let l = Lin {
        tensor: g.tensor_index(name).unwrap_or(usize::MAX),
        dtype: t.dtype,
        rows: shape[1] as usize,
        cols: shape[0] as usize,
        bytes: start..start + t.data.len(),
    };
    if name != "token_embd.weight" {
        check_kernel(g, &l, name)?;
    }
    Ok(l)
}

/// Checks that the kernels accept this matrix (dtype supported, length consistent).
fn check_kernel(g: &Gguf, l: &Lin, name: &str) -> Result<(), ModelError> {
    let data = g.bytes().get(l.bytes.clone()).unwrap_or(&[]);
    match WeightMatrix::new(l.dtype, l.rows, l.cols, data) {
        Ok(_) => Ok(()),
        Err(_) => Err(ModelError::UnsupportedDtype {
            tensor: name.into(),
            dtype: l.dtype,
        }),
    }
}

fn vector(g: &Gguf, name: &str, len: u64) -> Result<Vec<f32>, ModelError> {
    let t = g
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
    if t.n_elements() != len {
        return Err(ModelError::BadShape {
            tensor: name.into(),
            expected: vec![len],
            actual: t.shape.to_vec(),
        });
    }
    t.to_f32().map_err(|source| ModelError::Dequantize {
        tensor: name.into(),
        dtype: t.dtype,
        source,
    })
}
