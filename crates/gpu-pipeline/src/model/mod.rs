//! The decoder-only transformer graph (Llama, Qwen 2/3, Gemma 2/3, Phi-3, SmolLM3 families, and
//! the mixtures of experts Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) over
//! a [`WeightSource`] (a GGUF file or a Hugging Face directory), with a batched forward pass.

pub(crate) mod attention;
mod config;
#[cfg(feature = "cuda")]
pub(crate) mod device;
pub mod hf;
mod moe;
mod ops;
mod source;

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use kv_ring::{HostKv, HostKvStorage, KvDtype, KvError, KvRing, KvShape, KvStorage, RingMode};
use token_stream::Tokenizer;
use weight_cache::{DequantError, GgmlType, Gguf, WeightCache};

use crate::ThreadPool;
use crate::kernels::{self, KernelError, PackedWeights, WeightMatrix};

pub use config::{
    Activation, LayerConfig, LayerRope, MAX_EXPERTS, ModelConfig, MoeConfig, QkNorm, RopeConfig,
    RopeLayout, RopeScaling, SUPPORTED_ARCHITECTURES,
};
pub use hf::{HfError, HfModel};
use moe::{Ffn, MoeScratch};
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
    /// The context the model will be served at (`0`, default: its trained context). Models
    /// with LongRoPE factors (Phi-3) use the long factors when this exceeds their original
    /// context, as llama.cpp does.
    pub context: usize,
    /// Whether the dense matrices are re-arranged at load for the packed kernels (default:
    /// [`WeightPacking::Auto`]).
    pub packing: WeightPacking,
}

/// Re-arranging the weights at load time ([`PackedWeights`](crate::kernels::PackedWeights)): the
/// dense matrices of every integer-quantized format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants
/// Q2_K to Q6_K, IQ4_NL, IQ4_XS; on AVX-512 and AVX2) are copied once into the row-interleaved
/// layout, which decodes faster per byte (1.1-2x on AVX-512 by format, 1.2-1.5x on AVX2) with
/// bit-identical results; the file's pages of those matrices are then released, so resident
/// memory does not grow. Mixture-of-experts weights and float matrices stay in the file mapping
/// (their residency follows the weight cache's budget).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightPacking {
    /// Pack every matrix the CPU has a packed kernel for.
    #[default]
    Auto,
    /// Compute on the file mapping as it is (weights read in place, nothing copied).
    Off,
}

/// The kernels quantize activations to 8 bits per 32-element block before their integer dot
/// products (as llama.cpp does). Splitting the activations into an 8-bit-exact part plus the
/// rounding residual, multiplied as two rows of one product, recovers almost fp32 precision for
/// that product; in decode the weights still stream once, so it costs little time.
///
/// Measured on the default model against the fp32 reference (mean |logit difference| over the
/// fp32 top-8, 10 chat sequences): `Off` 0.221 (llama.cpp: 0.223), `FfnDown` 0.193, `All` 0.001.
/// What `FfnDown` costs there (engine bench, 2 threads, same run): 100 concurrent requests
/// 459-484 generated tok/s against 630-635 with `Off`, one request's first token 37-44 ms
/// against 28-29 ms, decode 194-200 tok/s against 222. It stays the default for its precision:
/// besides the smaller logit error, with `Off` a random-weight Gemma 3 Q8_0 file misses
/// llama.cpp's top-1 at a decisive gap (`tests/arch_models.rs`), with `FfnDown` nowhere. `Off`
/// is the fast choice (the CLI's `--activation-split off`).
///
/// `FfnDown` splits only down projections in a 32-element format (Q4_0 to Q8_0, IQ4_NL), where
/// llama.cpp quantizes activations per 32 elements as we do. A K-quant down projection (Q2_K to
/// Q6_K, IQ4_XS: a Q4_K_M file's) is not split: llama.cpp multiplies those against activations
/// quantized per 256 elements (`Q8_K`), so our unsplit per-32 activations are already finer
/// than its, and without the split a 1 GB Q4_K_M file prefills 1.29-1.41x faster
/// (`--bench-dense`, pp512, 2 threads, Zen 4: 116-127 tok/s split, 164 not). Measured on
/// llama.cpp's own K-quant files (`tests/quant_models.rs`, perplexity over 510 tokens, distance
/// to the fp32 reference, split -> not split, llama.cpp): Q2_K 1.23% -> 0.98% (0.10%), Q3_K_M
/// 0.53% -> 0.44% (0.56%), Q4_K_M 0.07% -> 0.37% (0.72%), Q5_K_M 0.18% -> 0.19% (1.43%), Q6_K
/// 0.25% -> 0.49% (1.40%), IQ4_XS 0.26% -> 0.45% (1.67%); top-1 equal to llama.cpp's at every
/// decisive position either way. `All` still splits them.
///
/// Only products over integer-quantized weights are split: float weights (F32, F16, BF16)
/// multiply the f32 activations as they are, with nothing to recover.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationSplit {
    /// Plain 8-bit activations everywhere (fastest; llama.cpp's precision).
    Off,
    /// Split only the MLP down projection, whose SwiGLU inputs have the widest range, where its
    /// weights are in a 32-element block format (not the K-quants; see above). The default.
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
    /// Sets [`context`](Self::context).
    pub fn with_context(mut self, context: usize) -> Self {
        self.context = context;
        self
    }
    /// Sets [`packing`](Self::packing).
    pub fn with_packing(mut self, packing: WeightPacking) -> Self {
        self.packing = packing;
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
    #[error(
        "unsupported model architecture {arch:?} (supported: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, smollm3, qwen2moe, qwen3moe, olmoe)"
    )]
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
    /// The expert counts of a mixture-of-experts model are unusable: no experts (where the family
    /// needs them), no expert used per token, more used than there are, or more than
    /// [`MAX_EXPERTS`](config::MAX_EXPERTS).
    #[error(
        "{arch}: expert_count {experts} / expert_used_count {used} (need 1 <= used <= count <= 1024)"
    )]
    ExpertCount {
        /// The architecture.
        arch: String,
        /// `{arch}.expert_count` (0 when absent).
        experts: u32,
        /// `{arch}.expert_used_count` (0 when absent).
        used: u32,
    },
    /// `{arch}.rope.scaling.type` is a scaling this graph does not implement (e.g. `yarn`).
    #[error("unsupported RoPE scaling {kind:?} (supported: none, linear, llama3, longrope)")]
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
    /// Re-arranging a matrix for the packed kernels failed (see [`WeightPacking`]).
    #[error("cannot pack tensor {tensor:?}: {source}")]
    Pack {
        /// The tensor name.
        tensor: String,
        /// The kernels' error.
        #[source]
        source: KernelError,
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
    /// A device executor failed (for the CUDA executor, a `CudaError`: driver error, out of
    /// device memory). The rings may hold the step's pending chunk.
    #[error("device error: {0}")]
    Device(Box<dyn std::error::Error + Send + Sync>),
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
/// decode token) and the sequence's own KV ring, in the executor's storage `S` ([`HostKv`]
/// for the CPU).
#[derive(Debug)]
pub struct SeqStep<'a, S: KvStorage = HostKv> {
    /// The new tokens, appended at `kv.next_pos()`.
    pub tokens: &'a [u32],
    /// The sequence's cache; the step's K/V are appended and committed.
    pub kv: &'a mut KvRing<S>,
    /// Which logits to return.
    pub logits: LogitsWanted,
}

/// A linear layer's weights: a byte range of one of the source's files plus its shape.
#[derive(Clone, Debug)]
struct Lin {
    /// Index of the tensor in the GGUF file (for weight-cache touches; `usize::MAX` when the
    /// source is not a GGUF file).
    tensor: usize,
    /// Which file of the source.
    file: usize,
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Range<usize>,
    /// The matrix re-arranged for the packed kernels, when the model packs it.
    packed: Option<Arc<PackedWeights>>,
}

impl Lin {
    /// Whether the kernels quantize the activations of this matrix's products to 8 bits
    /// (integer-quantized weights; float weights take f32 activations).
    fn quantizes_activations(&self) -> bool {
        kernels::quantizes_activations(self.dtype)
    }

    /// Rows `r` of this matrix (one part of a fused tensor such as `attn_qkv`).
    fn slice_rows(&self, r: Range<usize>) -> Self {
        let rb = self.bytes.len() / self.rows.max(1);
        Self {
            rows: r.len(),
            bytes: self.bytes.start + r.start * rb..self.bytes.start + r.end * rb,
            packed: None,
            ..self.clone()
        }
    }

    /// Records a read of this matrix's file bytes in the attached weight cache, if any. A
    /// packed matrix is computed from the model's own copy, so its file pages are not read and
    /// nothing is recorded.
    fn touch(&self, touch: Touch<'_>) {
        if let Some((cache, r)) = touch
            && self.packed.is_none()
        {
            cache.touch(self.tensor, r);
        }
    }

    /// Packs this matrix (see [`WeightPacking`]) if its format has a packed kernel here, and
    /// releases its file pages.
    fn pack(&mut self, g: &dyn WeightSource, pool: &ThreadPool) -> Result<(), KernelError> {
        if self.packed.is_some() || !PackedWeights::supported(self.dtype) {
            return Ok(());
        }
        let data = g
            .file_bytes(self.file)
            .get(self.bytes.clone())
            .unwrap_or(&[]);
        let w = WeightMatrix::new(self.dtype, self.rows, self.cols, data)?;
        // The file's pages are dropped as packing goes (not at the end), so a large matrix (the
        // output head) is never resident twice: that would set the process's peak RSS.
        // (Pages shared with a neighbouring tensor are dropped too; a later read of the
        // neighbour faults them back in from the page cache.)
        let (file, base) = (self.file, self.bytes.start);
        self.packed = PackedWeights::pack_releasing(w, pool, &mut |r| {
            g.release(file, base + r.start..base + r.end);
        })?
        .map(Arc::new);
        if self.packed.is_some() {
            g.release(self.file, self.bytes.clone());
        }
        Ok(())
    }
}

impl Layer {
    /// The dense matrices (attention, and the MLP unless it is a mixture of experts), named as
    /// in the file (`attn_q`, ...).
    fn dense_mut(&mut self) -> Vec<(&'static str, &mut Lin)> {
        let mut v = vec![
            ("attn_q", &mut self.wq),
            ("attn_k", &mut self.wk),
            ("attn_v", &mut self.wv),
            ("attn_output", &mut self.wo),
        ];
        if let Ffn::Dense(m) = &mut self.ffn {
            v.extend([
                ("ffn_gate", &mut m.gate),
                ("ffn_up", &mut m.up),
                ("ffn_down", &mut m.down),
            ]);
        }
        v
    }
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
    bo: Option<Vec<f32>>,
    /// RMSNorm weights of queries and keys (`head_dim` long per head, or the whole rows').
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    attn_post_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
    ffn_post_norm: Option<Vec<f32>>,
    /// Index into [`Model::ropes`]; `None`: no RoPE in this layer.
    rope: Option<usize>,
    /// Sliding window (keys older than `window` positions are not seen).
    window: Option<usize>,
}

/// A precomputed RoPE: inverse frequencies, attention factor and pairing.
#[derive(Debug)]
struct RopeTable {
    inv_freq: Vec<f64>,
    mscale: f32,
    layout: RopeLayout,
}

/// A weight-cache touch context: the cache and its current request.
type Touch<'a> = Option<(&'a WeightCache, weight_cache::RequestId)>;

/// A loaded decoder-only transformer: configuration, weight locations in the source's mappings
/// (nothing is copied but the small norm vectors), preallocated scratch space and a thread pool.
///
/// The graph is one for every supported family; a family is a [`ModelConfig`] (norm placement,
/// activation, biases, per-layer RoPE and window, soft-caps, scales). The forward pass runs in
/// named stages: embed, then per layer the attention block and the MLP block,
/// then the output head.
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
    src: Arc<dyn WeightSource>,
    cfg: ModelConfig,
    layers: Vec<Layer>,
    embd: Lin,
    output: Lin,
    output_norm: Vec<f32>,
    /// RoPE tables: the global one first, then the local layers' one if any.
    ropes: Vec<RopeTable>,
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
    tmp2: Vec<f32>,
    /// The expert block's buffers.
    moe: MoeScratch,
    /// cos/sin per RoPE table, token and frequency, interleaved (table-major).
    rope: Vec<f32>,
    /// Per-thread attention buffers.
    attn: Vec<Mutex<AttnScratch>>,
    /// Attention query blocks: (step, first token in step, tokens), longest first.
    att_blocks: Vec<(u32, u32, u32)>,
    /// Attention tasks of a layer (before the KV heads): (block, key chunk or all keys, the
    /// block's first row in `att_part`).
    att_tasks: Vec<(u32, u32, usize)>,
    /// The split blocks of a layer's attention: (block, key chunks, first row in `att_part`).
    att_splits: Vec<(usize, usize, usize)>,
    /// Attention rows of split blocks per key chunk: output, then softmax maximum and sum.
    att_part: Vec<f32>,
    /// Per step: (first token row, ring length before the step).
    steps: Vec<(usize, usize)>,
    /// The weight cache's current profiling request and the forward calls made in it.
    epoch: Option<(weight_cache::RequestId, u32)>,
}

/// Per-thread attention buffers: the block's query rows, outputs, key counts, first keys, the
/// kernel's scratch, the rows' softmax statistics and their rows in the block.
#[derive(Debug, Default)]
struct AttnScratch {
    q: Vec<f32>,
    o: Vec<f32>,
    n: Vec<usize>,
    first: Vec<usize>,
    f: Vec<f32>,
    stats: Vec<f32>,
    at: Vec<usize>,
}

/// Query tokens per attention task (times the GQA group: 48 rows for SmolLM2).
const ATT_BLOCK: usize = 16;
/// Query rows per attention task when a forward pass has few (the kernels' row block).
const ATT_SMALL_ROWS: usize = 16;

/// Forward calls that count as one request of an attached [`WeightCache`]: its first touch of
/// each tensor in a request asks the kernel (mincore) for residency, so a new request per call
/// would cost a system call per tensor per step.
const PROFILE_EPOCH: u32 = 64;

/// Fewest token rows for which element-wise work is split over the pool.
const PAR_MIN_ROWS: usize = 8;

/// Makes room for `n` elements (amortized: the capacity at least doubles when it grows).
fn reserve_to<T>(v: &mut Vec<T>, n: usize) {
    if v.capacity() < n {
        v.reserve(n.max(2 * v.capacity()) - v.len());
    }
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// Whether the keys written to `ring` (and the queries attending to them) are first rotated by
/// the orthonormal Hadamard transform of a head ([`ops::hadamard_rows`]): for a q4_0 cache
/// with a power-of-two head dimension. Scores are unchanged (up to rounding) while a key's few
/// large channels spread over the whole head, which 4-bit blocks hold with far less error (on
/// the default model at ctx 4096, perplexity +13.9% over f32 without, as llama.cpp's own q4_0
/// cache with its rotation off; llama.cpp rotates by default, `attn_rot_k`).
fn rotates_keys<S: KvStorage>(ring: &KvRing<S>, hd: usize) -> bool {
    ring.pool().shape().dtype == KvDtype::Q4_0 && hd.is_power_of_two()
}

impl Model {
    /// Loads a model from a parsed GGUF file: reads the configuration, checks every tensor's
    /// presence, shape and dtype, and records where the weights are in the mapping.
    pub fn load(gguf: Arc<Gguf>, opts: ModelOptions) -> Result<Self, ModelError> {
        Self::load_source(Arc::new(GgufSource(gguf)), opts)
    }

    /// Loads a model from any [`WeightSource`] (a GGUF file, a Hugging Face directory): the
    /// configuration, every tensor's presence, shape and dtype are checked here, so a file
    /// that cannot run fails now with the tensor or key named, not at the first request.
    pub fn load_source(src: Arc<dyn WeightSource>, opts: ModelOptions) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_source(&*src)?;
        let g = &*src;
        let (d, hd) = (cfg.n_embd as u64, cfg.head_dim as u64);
        let q_dim = cfg.n_heads as u64 * hd;
        let kv_dim = cfg.n_kv_heads as u64 * hd;
        let ff = cfg.n_ff as u64;
        let off = cfg.norm_weight_offset;
        let norm = |name: &str, len: u64| -> Result<Vec<f32>, ModelError> {
            let mut v = vector(g, name, len)?;
            if off != 0.0 {
                v.iter_mut().for_each(|w| *w += off);
            }
            Ok(v)
        };
        let embd = lin(g, "token_embd.weight", [d, cfg.vocab_size as u64])?;
        if !embd.dtype.can_dequantize() {
            return Err(ModelError::UnsupportedDtype {
                tensor: "token_embd.weight".into(),
                dtype: embd.dtype,
            });
        }
        // Gemma 2 always ties the head to the embedding (llama.cpp does the same).
        let output = match g.tensor("output.weight") {
            Some(_) if cfg.arch != "gemma2" => lin(g, "output.weight", [d, cfg.vocab_size as u64])?,
            _ => embd.clone(),
        };
        check_kernel(g, &output, "output.weight (or tied token_embd.weight)")?;
        let output_norm = norm("output_norm.weight", d)?;
        let mut ropes = Vec::new();
        let served_ctx = if opts.context > 0 {
            opts.context
        } else {
            cfg.context_length
        };
        let mut table = |r: &RopeConfig| {
            ropes.push(RopeTable {
                inv_freq: ops::rope_inv_freq(r, served_ctx > r.original_context),
                mscale: r.attn_factor,
                layout: r.layout,
            });
            ropes.len() - 1
        };
        let global = table(&cfg.rope);
        let local = cfg.rope_local.as_ref().map(&mut table);
        let qk_norm = cfg.qk_norm != QkNorm::Off;
        let qk_width = |full: u64| match cfg.qk_norm {
            QkNorm::Full => full,
            _ => hd,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (l, lc) in cfg.layers.iter().enumerate() {
            let n = |s: &str| format!("blk.{l}.{s}");
            let opt_vec = |s: &str, len: u64| -> Result<Option<Vec<f32>>, ModelError> {
                match g.tensor(&n(s)) {
                    Some(_) => vector(g, &n(s), len).map(Some),
                    None => Ok(None),
                }
            };
            let (qd, kvd) = (q_dim as usize, kv_dim as usize);
            let (wq, wk, wv, bq, bk, bv) = match g.tensor(&n("attn_qkv.weight")) {
                Some(_) => {
                    let f = lin(g, &n("attn_qkv.weight"), [d, q_dim + 2 * kv_dim])?;
                    let b = opt_vec("attn_qkv.bias", q_dim + 2 * kv_dim)?;
                    let part = |r: Range<usize>| b.as_ref().map(|b| b[r].to_vec());
                    (
                        f.slice_rows(0..qd),
                        f.slice_rows(qd..qd + kvd),
                        f.slice_rows(qd + kvd..qd + 2 * kvd),
                        part(0..qd),
                        part(qd..qd + kvd),
                        part(qd + kvd..qd + 2 * kvd),
                    )
                }
                None => (
                    lin(g, &n("attn_q.weight"), [d, q_dim])?,
                    lin(g, &n("attn_k.weight"), [d, kv_dim])?,
                    lin(g, &n("attn_v.weight"), [d, kv_dim])?,
                    opt_vec("attn_q.bias", q_dim)?,
                    opt_vec("attn_k.bias", kv_dim)?,
                    opt_vec("attn_v.bias", kv_dim)?,
                ),
            };
            let req_norm =
                |want: bool, s: &str, len: u64| -> Result<Option<Vec<f32>>, ModelError> {
                    if want {
                        norm(&n(s), len).map(Some)
                    } else {
                        Ok(None)
                    }
                };
            layers.push(Layer {
                attn_norm: norm(&n("attn_norm.weight"), d)?,
                wq,
                wk,
                wv,
                wo: lin(g, &n("attn_output.weight"), [q_dim, d])?,
                bq,
                bk,
                bv,
                bo: opt_vec("attn_output.bias", d)?,
                q_norm: req_norm(qk_norm, "attn_q_norm.weight", qk_width(q_dim))?,
                k_norm: req_norm(qk_norm, "attn_k_norm.weight", qk_width(kv_dim))?,
                attn_post_norm: req_norm(cfg.post_norms, "post_attention_norm.weight", d)?,
                ffn_norm: norm(&n("ffn_norm.weight"), d)?,
                ffn: Ffn::load(g, l, d, ff, cfg.moe.as_ref().filter(|_| lc.experts))?,
                ffn_post_norm: req_norm(cfg.post_norms, "post_ffw_norm.weight", d)?,
                rope: match lc.rope {
                    LayerRope::Global => Some(global),
                    LayerRope::Local => local.or(Some(global)),
                    _ => None,
                },
                window: lc.window,
            });
        }
        let pool = (opts.threads > 0).then(|| ThreadPool::new(opts.threads));
        let (mut output, mut embd) = (output, embd);
        if opts.packing == WeightPacking::Auto {
            let p = pool.as_ref().unwrap_or_else(|| ThreadPool::global());
            let packed = |l: &mut Lin, tensor: String| {
                l.pack(g, p)
                    .map_err(|source| ModelError::Pack { tensor, source })
            };
            for (i, layer) in layers.iter_mut().enumerate() {
                for (name, l) in layer.dense_mut() {
                    packed(l, format!("blk.{i}.{name}.weight"))?;
                }
            }
            packed(&mut output, "output.weight".into())?;
            // A head tied to the embedding: look the embeddings up in the packed copy too, so
            // none of the table's file pages stay resident.
            if output.file == embd.file && output.bytes == embd.bytes {
                embd.packed = output.packed.clone();
            }
        }
        Ok(Self {
            src,
            cfg,
            layers,
            embd,
            output,
            output_norm,
            ropes,
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

    /// Where the weights come from.
    pub fn source(&self) -> &Arc<dyn WeightSource> {
        &self.src
    }

    /// The GGUF file the weights live in, when they come from one.
    pub fn gguf(&self) -> Option<&Arc<Gguf>> {
        self.src.gguf()
    }

    /// Records every weight tensor each [`forward`](Self::forward) reads in `cache` (one
    /// [`WeightCache::touch`] per tensor, ~20 ns, and one
    /// [`end_token`](WeightCache::end_token) per call), so its access profile, warm-up plans and
    /// mincore hit rates follow real inference. Every 64 forward calls (batched steps) count as
    /// one request of the cache, so the first touches that ask the kernel for residency stay
    /// rare. Fails, giving `cache` back, when a cache is already attached, the model does not
    /// come from a GGUF file, or `cache` is over another file.
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
        match self.src.gguf() {
            Some(g) if Arc::ptr_eq(cache.gguf(), g) => self.cache.set(cache),
            _ => Err(cache),
        }
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

    /// The sliding window of each layer (`None`: the layer attends to every cached position):
    /// what [`KvPool::with_layer_windows`](kv_ring::KvPool::with_layer_windows) takes so that
    /// window layers keep only the rows they can still attend to.
    ///
    /// ```no_run
    /// # fn f(model: &gpu_pipeline::Model) -> Result<(), kv_ring::KvError> {
    /// use kv_ring::{KvDtype, KvPool, RingMode};
    /// // Chunks of up to 256 tokens per forward step.
    /// let pool = KvPool::with_layer_windows(model.kv_shape(KvDtype::F16), 1 << 30, model.kv_windows(), 256)?;
    /// let ring = pool.alloc(32_768, RingMode::Strict)?;
    /// # Ok(()) }
    /// ```
    pub fn kv_windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(|l| l.window).collect()
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

    /// The token ids that end a generation with `tokenizer`: [`stop_tokens`](Self::stop_tokens)
    /// and the tokenizer's end-of-generation ids ([`Tokenizer::eog_ids`]: EOT, EOM and the tokens
    /// llama.cpp ends generation on by name, such as `<|im_end|>` when the file's EOS is
    /// `<|endoftext|>`, as Qwen's is), sorted.
    pub fn stop_tokens_with(&self, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
        let mut v = self.stop_tokens();
        v.extend(tokenizer.map_or(&[][..], Tokenizer::eog_ids));
        v.sort_unstable();
        v.dedup();
        v
    }

    fn w<'s>(&'s self, l: &'s Lin) -> Result<WeightMatrix<'s>, KernelError> {
        if let Some(p) = &l.packed {
            return Ok(p.matrix());
        }
        let bytes = self
            .src
            .file_bytes(l.file)
            .get(l.bytes.clone())
            .unwrap_or(&[]);
        WeightMatrix::new(l.dtype, l.rows, l.cols, bytes)
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

    /// `y = rmsnorm(y) * w` in place (`buf` is scratch of the same size): the post-norms of
    /// Gemma's attention and MLP outputs.
    fn norm_in_place(&self, y: &mut [f32], w: &[f32], buf: &mut [f32]) {
        let d = w.len();
        let (ys, bs) = (ops::SharedRows::new(y, d), ops::SharedRows::new(buf, d));
        let eps = self.cfg.rms_eps;
        self.par_rows(ys.len(), &|r| {
            // SAFETY: tasks get disjoint token ranges.
            let (y, b) = unsafe { (ys.rows(r.clone()), bs.rows(r)) };
            ops::rmsnorm_rows(y, w, eps, b);
            y.copy_from_slice(b);
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
        tmp: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        // One product over 2n rows [hi; lo]: the weights stream once (decode is bandwidth
        // bound), and row results are batch-invariant, so the sum is too.
        let o = l.rows;
        grow(tmp, 2 * n * o);
        kernels::matmul_split_parts(
            self.w(l)?,
            &x[..n * l.cols],
            n,
            &mut tmp[..2 * n * o],
            self.pool(),
        )?;
        let (a, b) = tmp[..2 * n * o].split_at(n * o);
        let ys = ops::SharedRows::new(&mut y[..n * o], o);
        self.par_rows(n, &|r| {
            let (a, b) = (&a[r.start * o..r.end * o], &b[r.start * o..r.end * o]);
            // SAFETY: tasks get disjoint token ranges.
            ops::add_to(a, b, unsafe { ys.rows(r) });
        });
        Ok(())
    }

    /// Whether product `c` (one of `qkvogud`: q, k, v, output, gate, up, down) of matrix `w`
    /// gets the activation split. Only integer-quantized weights do: float weights multiply
    /// the f32 activations as they are, so a split would only double the work. `FfnDown`
    /// leaves the K-quant down projections alone (see [`ActivationSplit::FfnDown`]).
    fn split_for(&self, c: char, w: &Lin) -> bool {
        let wanted = match self.split {
            ActivationSplit::Off => false,
            ActivationSplit::FfnDown => c == 'd' && !kernels::has_super_blocks(w.dtype),
            ActivationSplit::All => true,
        };
        wanted && w.quantizes_activations()
    }

    /// One product `y = x · wᵀ` over `n` rows, split for precision when configured.
    #[allow(clippy::too_many_arguments)]
    fn mm(
        &self,
        c: char,
        w: &Lin,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        tmp2: &mut Vec<f32>,
        touch: Touch<'_>,
    ) -> Result<(), KernelError> {
        w.touch(touch);
        if self.split_for(c, w) {
            self.matmul_split(w, x, n, y, tmp2)
        } else {
            self.matmul(w, x, n, y)
        }
    }

    /// Products sharing an input, run as one group (quantized once, one pool call) unless one
    /// of them is split for precision. Fixed-size arrays: the decode path makes no allocation.
    #[allow(clippy::too_many_arguments)]
    fn mm_group<const N: usize>(
        &self,
        ws: [(char, &Lin); N],
        x: &[f32],
        n: usize,
        ys: [&mut [f32]; N],
        tmp2: &mut Vec<f32>,
        touch: Touch<'_>,
    ) -> Result<(), KernelError> {
        if ws.iter().any(|&(c, w)| self.split_for(c, w)) {
            for (&(c, w), y) in ws.iter().zip(ys) {
                self.mm(c, w, x, n, y, tmp2, touch)?;
            }
            return Ok(());
        }
        ws.iter().for_each(|(_, w)| w.touch(touch));
        let mut mats = [self.w(ws[0].1)?; N];
        for (m, (_, w)) in mats.iter_mut().zip(&ws).skip(1) {
            *m = self.w(w)?;
        }
        let x = &x[..n * mats[0].cols];
        let mut i = 0;
        let mut outs = ys.map(|y| {
            let rows = ws[i].1.rows;
            i += 1;
            &mut y[..n * rows]
        });
        kernels::matmul_many(&mats, x, n, &mut outs, self.pool())
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
    ///
    /// Generic over the rings' storage: any [`HostKvStorage`] (monomorphized; the attention
    /// reads host slices through [`KvRing::view`]). A ring whose elements are not in host
    /// memory fails with [`KvError::NotInHostMemory`].
    pub fn forward<S: HostKvStorage>(
        &self,
        steps: &mut [SeqStep<'_, S>],
        out: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        // `out` keeps its allocation and contents until the head sets its length: the head
        // writes every logit, so a batch of the previous size is not zero-filled first (100
        // rows of a 49152-token vocabulary are 19.7 MB per step).
        let r = self.forward_into(steps, out);
        if r.is_err() {
            out.clear();
        }
        r
    }

    /// [`forward`](Self::forward) with `out` set only by the head.
    fn forward_into<S: HostKvStorage>(
        &self,
        steps: &mut [SeqStep<'_, S>],
        out: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        if steps.is_empty() {
            out.clear();
            return Ok(());
        }
        self.validate(steps)?;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        let total: usize = steps.iter().map(|s| s.tokens.len()).sum();
        let max_keys = steps
            .iter()
            .map(|s| s.kv.len() + s.tokens.len())
            .max()
            .unwrap_or(0);
        self.reserve(sc, total, max_keys);
        let touch = self.cache.get().map(|c| {
            let (req, calls) = sc.epoch.get_or_insert_with(|| (c.begin_request(), 0));
            if *calls == PROFILE_EPOCH {
                *req = c.begin_request();
                *calls = 0;
            }
            *calls += 1;
            (c, *req)
        });
        self.embed(steps, sc, touch)?;
        for (li, layer) in self.layers.iter().enumerate() {
            self.attention_block(li, layer, steps, sc, total, touch)?;
            self.mlp_block(layer, sc, total, touch)?;
        }
        self.head(steps, sc, out, touch)
    }

    /// Checks every step before anything is computed or any ring changed.
    pub(crate) fn validate<S: KvStorage>(
        &self,
        steps: &[SeqStep<'_, S>],
    ) -> Result<(), ForwardError> {
        let cfg = &self.cfg;
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
            // A pool whose window layers keep their last rows only takes chunks up to its limit.
            if let Some(mc) = s.kv.pool().max_chunk()
                && n > mc
            {
                return Err(ForwardError::Kv {
                    step: i,
                    source: KvError::ChunkTooLarge {
                        requested: n,
                        len: s.kv.len(),
                        capacity: s.kv.capacity(),
                        window: mc,
                    },
                });
            }
            if n > room {
                return Err(ForwardError::ContextFull {
                    step: i,
                    tokens: n,
                    len: s.kv.len(),
                    capacity: s.kv.capacity(),
                });
            }
        }
        Ok(())
    }

    /// Grows the scratch buffers for `total` token rows.
    /// Grows the scratch buffers for `total` token rows, and every thread's attention buffers
    /// for up to `max_keys` keys (all threads now: which thread runs which attention task is
    /// not fixed, and a thread must not allocate the first time it gets one mid-decode).
    fn reserve(&self, sc: &mut Scratch, total: usize, max_keys: usize) {
        let cfg = &self.cfg;
        let (d, qd, kvd) = (
            cfg.n_embd,
            cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
        );
        grow(&mut sc.x, total * d);
        grow(&mut sc.h, total * d);
        grow(&mut sc.q, total * qd);
        grow(&mut sc.k, total * kvd);
        grow(&mut sc.v, total * kvd);
        grow(&mut sc.att, total * qd);
        grow(&mut sc.tmp, total * d);
        // The MLP's inner width: the dense MLP's, or the larger of an expert's (which runs on
        // at most all tokens at once) and the shared expert's.
        let inner = match &cfg.moe {
            None => cfg.n_ff,
            Some(m) => {
                sc.moe.reserve(m, total, d);
                // Dense layers among the sparse ones (Qwen MoE's `mlp_only_layers`).
                let dense = cfg.layers.iter().any(|l| !l.experts);
                m.n_ff_expert
                    .max(m.n_ff_shared.unwrap_or(0))
                    .max(if dense { cfg.n_ff } else { 0 })
            }
        };
        grow(&mut sc.gate, total * inner);
        grow(&mut sc.up, total * inner);
        grow(&mut sc.rope, self.ropes.len() * total * cfg.rope.n_rot);
        while sc.attn.len() < self.pool().n_threads() {
            sc.attn.push(Mutex::new(AttnScratch::default()));
        }
        let hd = cfg.head_dim;
        let rows = ATT_BLOCK * cfg.gqa_group();
        // The kernels' scratch: per row block, transposed queries and a key row, then scores for
        // up to 16 rows (or `rows`) of `max_keys` rounded up to 16.
        let scores = max_keys.next_multiple_of(16) * rows.max(16);
        let need = [rows * hd, rows * hd, rows, rows, hd * 17 + scores];
        for a in &sc.attn {
            let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
            let AttnScratch {
                q,
                o,
                n,
                first,
                f,
                stats,
                at,
            } = &mut *a;
            reserve_to(stats, 2 * rows);
            reserve_to(at, rows);
            reserve_to(q, need[0]);
            reserve_to(o, need[1]);
            reserve_to(n, need[2]);
            reserve_to(first, need[3]);
            reserve_to(f, need[4]);
        }
    }

    /// Stage 1: begins each step's chunk on its ring, looks up (dequantizes) and scales the
    /// token embeddings into `x`, and fills the RoPE tables for the tokens' positions.
    fn embed<S: KvStorage>(
        &self,
        steps: &mut [SeqStep<'_, S>],
        sc: &mut Scratch,
        touch: Touch<'_>,
    ) -> Result<(), ForwardError> {
        let (d, n_rot) = (self.cfg.n_embd, self.cfg.rope.n_rot);
        let total: usize = steps.iter().map(|s| s.tokens.len()).sum();
        self.embd.touch(touch);
        let bytes = self.src.file_bytes(self.embd.file);
        let rb = self.embd.bytes.len() / self.embd.rows;
        let scale = self.cfg.embedding_scale;
        sc.steps.clear();
        let mut row = 0usize;
        for (i, s) in steps.iter_mut().enumerate() {
            let n = s.tokens.len();
            // Validated before: these cannot fail for room.
            s.kv.begin(n)
                .map_err(|source| ForwardError::Kv { step: i, source })?;
            let len_before = s.kv.len();
            let pos0 = s.kv.next_pos();
            sc.steps.push((row, len_before));
            for (j, &t) in s.tokens.iter().enumerate() {
                let dst = &mut sc.x[(row + j) * d..][..d];
                let unsupported = |_| KernelError::UnsupportedDtype {
                    dtype: self.embd.dtype,
                };
                match &self.embd.packed {
                    Some(p) => p.dequantize_row(t as usize, dst)?,
                    None => {
                        let src = &bytes[self.embd.bytes.start + t as usize * rb..][..rb];
                        weight_cache::dequantize(self.embd.dtype, src, dst).map_err(unsupported)?;
                    }
                }
                if scale != 1.0 {
                    dst.iter_mut().for_each(|v| *v *= scale);
                }
                for (ti, table) in self.ropes.iter().enumerate() {
                    ops::rope_cos_sin(
                        &table.inv_freq,
                        pos0 + j as u64,
                        table.mscale,
                        &mut sc.rope[(ti * total + row + j) * n_rot..][..n_rot],
                    );
                }
            }
            row += n;
        }
        sc.att_blocks.clear();
        // Few blocks (a decode step of a few sequences, a verification of drafts): blocks of
        // `ATT_SMALL_ROWS` rows instead, so that the KV heads of a step make more tasks than
        // there are threads (SmolLM2's 3 KV heads on 2 threads ran a 9-token step as 3 tasks,
        // one thread taking two). A row's result does not depend on the block it is in, and
        // the kernels run blocks of 16 rows anyway, so this changes no bit.
        let group = self.cfg.gqa_group();
        let whole: usize = steps
            .iter()
            .map(|s| s.tokens.len().div_ceil(ATT_BLOCK))
            .sum();
        let tq = if whole * self.cfg.n_kv_heads < 4 * self.pool().n_threads() {
            (ATT_SMALL_ROWS / group).max(1)
        } else {
            ATT_BLOCK
        };
        for (i, s) in steps.iter().enumerate() {
            let n = s.tokens.len() as u32;
            for j0 in (0..n).step_by(tq) {
                sc.att_blocks.push((i as u32, j0, (n - j0).min(tq as u32)));
            }
        }
        // Longest first, so the last tasks claimed are short ones.
        let lens = &sc.steps;
        sc.att_blocks
            .sort_by_key(|&(i, j0, tq)| std::cmp::Reverse(lens[i as usize].1 + (j0 + tq) as usize));
        Ok(())
    }

    /// Stage 2 (per layer): the pending residual (previous MLP output) is added to `x`, then
    /// RMSNorm, Q/K/V (+ biases, per-head Q/K norms, RoPE), K/V appended to each ring,
    /// attention per sequence (window and soft-cap per the layer), the output projection into
    /// `tmp` (post-normed when the family has post-norms).
    fn attention_block<S: HostKvStorage>(
        &self,
        li: usize,
        layer: &Layer,
        steps: &mut [SeqStep<'_, S>],
        sc: &mut Scratch,
        total: usize,
        touch: Touch<'_>,
    ) -> Result<(), ForwardError> {
        let cfg = &self.cfg;
        let (d, hd, nh, nkv) = (cfg.n_embd, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let add = (li > 0).then_some(&sc.tmp[..total * d]);
        self.residual_norm(
            &mut sc.x[..total * d],
            add,
            &layer.attn_norm,
            &mut sc.h[..total * d],
        );
        self.mm_group(
            [('q', &layer.wq), ('k', &layer.wk), ('v', &layer.wv)],
            &sc.h,
            total,
            [&mut sc.q[..], &mut sc.k[..], &mut sc.v[..]],
            &mut sc.tmp2,
            touch,
        )?;
        for (b, buf, width) in [
            (&layer.bq, &mut sc.q, qd),
            (&layer.bk, &mut sc.k, kvd),
            (&layer.bv, &mut sc.v, kvd),
        ] {
            if let Some(b) = b {
                for r in buf[..total * width].chunks_exact_mut(width) {
                    ops::add_rows(r, b);
                }
            }
        }
        {
            let qs = ops::SharedRows::new(&mut sc.q[..total * qd], qd);
            let ks = ops::SharedRows::new(&mut sc.k[..total * kvd], kvd);
            let n_rot = cfg.rope.n_rot;
            let rope = layer.rope.map(|t| {
                (
                    &self.ropes[t],
                    &sc.rope[t * total * n_rot..(t + 1) * total * n_rot],
                )
            });
            let eps = cfg.rms_eps;
            let (qn, kn) = (layer.q_norm.as_deref(), layer.k_norm.as_deref());
            // Keys stored as 4-bit blocks are rotated first, and the queries with them, so the
            // scores are the same (see `rotates_keys`).
            let (step_rows, rings): (&[(usize, usize)], &[SeqStep<'_, S>]) = (&sc.steps, steps);
            let rotated = |t: usize| {
                let si = step_rows.partition_point(|&(r0, _)| r0 <= t) - 1;
                rotates_keys(&*rings[si].kv, hd)
            };
            self.par_rows(total, &|r| {
                // Norm output (one head, or OLMoE's whole row); on the stack up to 4096 elements
                // (no allocation).
                let width = qn.map_or(hd, <[f32]>::len).max(kn.map_or(hd, <[f32]>::len));
                let (mut stack, mut heap) = ([0f32; 4096], Vec::new());
                let buf: &mut [f32] = if width <= stack.len() {
                    &mut stack[..width]
                } else {
                    heap.resize(width, 0.0);
                    &mut heap
                };
                for t in r {
                    // SAFETY: tasks get disjoint token ranges.
                    let (q, k) = unsafe { (qs.row(t), ks.row(t)) };
                    for (heads, w) in [(&mut *q, qn), (&mut *k, kn)] {
                        if let Some(w) = w {
                            // Per head (`w` is head_dim long) or the whole row.
                            for h in heads.chunks_exact_mut(w.len()) {
                                let out = &mut buf[..w.len()];
                                ops::rmsnorm_rows(h, w, eps, out);
                                h.copy_from_slice(out);
                            }
                        }
                    }
                    if let Some((table, cs)) = rope {
                        let cs = &cs[t * n_rot..][..n_rot];
                        for h in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                            ops::rope_head(table.layout, cs, h);
                        }
                    }
                    if rotated(t) {
                        ops::hadamard_rows(q, hd);
                        ops::hadamard_rows(k, hd);
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
        self.attend(li, layer, steps, sc, total)?;
        self.mm(
            'o',
            &layer.wo,
            &sc.att,
            total,
            &mut sc.tmp,
            &mut sc.tmp2,
            touch,
        )?;
        if let Some(b) = &layer.bo {
            for r in sc.tmp[..total * d].chunks_exact_mut(d) {
                ops::add_rows(r, b);
            }
        }
        if let Some(w) = &layer.attn_post_norm {
            self.norm_in_place(&mut sc.tmp[..total * d], w, &mut sc.h[..total * d]);
        }
        Ok(())
    }

    /// Attention of every step's new tokens against its ring (layer `li`), into `att`: one
    /// pool task per (query block, KV head), or, when there are few such tasks (decode of a
    /// few sequences), one per (query block, KV head, chunk of [`attention::KEY_CHUNK`] keys)
    /// for blocks over more keys, merged after in chunk order: the kernel's own chunked
    /// arithmetic, so the result is the same bits either way.
    fn attend<S: HostKvStorage>(
        &self,
        li: usize,
        layer: &Layer,
        steps: &[SeqStep<'_, S>],
        sc: &mut Scratch,
        total: usize,
    ) -> Result<(), ForwardError> {
        let cfg = &self.cfg;
        let (hd, nh, nkv) = (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let qd = nh * hd;
        let group = cfg.gqa_group();
        let (scale, softcap, window) = (cfg.attention_scale, cfg.attn_softcap, layer.window);
        // Row (token j of the step, whose ring held `before` rows): its keys `first..n`.
        let keys_of = |before: usize, j: usize| {
            let n = before + j + 1;
            (window.map_or(0, |w| n.saturating_sub(w)), n)
        };
        // The tasks: (block, chunk or WHOLE), times nkv; split blocks' partial rows from `base`.
        const WHOLE: u32 = u32::MAX;
        let threads = self.pool().n_threads();
        let split = threads > 1 && sc.att_blocks.len() * nkv < 4 * threads;
        let mut tasks = std::mem::take(&mut sc.att_tasks);
        let mut bases = std::mem::take(&mut sc.att_splits);
        bases.clear();
        tasks.clear();
        let mut partial_rows = 0;
        for (b, &(si, j0, tq)) in sc.att_blocks.iter().enumerate() {
            let (f, n) = keys_of(steps[si as usize].kv.layer_len(li), (j0 + tq) as usize - 1);
            let chunks = (n - f).div_ceil(attention::KEY_CHUNK);
            if split && chunks > 1 {
                tasks.extend((0..chunks as u32).map(|k| (b as u32, k, partial_rows)));
                bases.push((b, chunks, partial_rows));
                partial_rows += chunks * nkv * tq as usize * group;
            } else {
                tasks.push((b as u32, WHOLE, 0));
            }
        }
        let part_w = hd + 2;
        sc.att_part.resize(partial_rows * part_w, 0.0);
        let att_out = ops::SharedRows::new(&mut sc.att[..total * qd], hd);
        let parts = ops::SharedRows::new(&mut sc.att_part[..partial_rows * part_w], part_w);
        let q = &sc.q;
        let blocks = &sc.att_blocks;
        let step_info = &sc.steps;
        let scratch = &sc.attn;
        let err: Mutex<Option<ForwardError>> = Mutex::new(None);
        // A task: the group's query heads of up to ATT_BLOCK tokens of one step, against that
        // step's ring (all their keys, or chunk k of each row's keys).
        self.pool().run(tasks.len() * nkv, &|task, thread| {
            let ((b, k, base), g) = (tasks[task / nkv], task % nkv);
            let (si, j0, tq) = blocks[b as usize];
            let (r0, _) = step_info[si as usize];
            let ring = &*steps[si as usize].kv;
            // Rows this layer holds before the chunk (a window layer of a windowed pool keeps
            // only its last ones; view index = position - (next_pos - that)).
            let len_before = ring.layer_len(li);
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
                first: fb,
                f,
                stats,
                at,
            } = &mut *guard;
            qb.clear();
            nb.clear();
            fb.clear();
            at.clear();
            for j in j0 as usize..(j0 + tq) as usize {
                let t = r0 + j;
                let (first, n) = keys_of(len_before, j);
                let range = if k == WHOLE {
                    Some((first, n))
                } else {
                    attention::key_chunk(first, n, k as usize)
                };
                let Some((first, n)) = range else { continue };
                for h in g * group..(g + 1) * group {
                    qb.extend_from_slice(&q[t * qd + h * hd..][..hd]);
                    nb.push(n);
                    fb.push(first);
                    at.push((j - j0 as usize) * group + h - g * group);
                }
            }
            let rows = nb.len();
            ob.resize(rows * hd, 0.0);
            stats.resize(2 * rows, 0.0);
            let first = (window.is_some() || k != WHOLE).then_some(&fb[..]);
            attention::attend_rows_ext(
                qb,
                nb,
                first,
                hd,
                &view,
                scale,
                softcap,
                f,
                &mut ob[..rows * hd],
                (k != WHOLE).then_some(&mut stats[..]),
            );
            for (i, o) in ob[..rows * hd].chunks_exact(hd).enumerate() {
                let r = at[i];
                if k == WHOLE {
                    let (j, h) = (j0 as usize + r / group, g * group + r % group);
                    // SAFETY: row (token, head) belongs to this task's block and KV head only.
                    unsafe { att_out.row((r0 + j) * nh + h) }.copy_from_slice(o);
                } else {
                    let slot = base + (k as usize * nkv + g) * tq as usize * group + r;
                    // SAFETY: slot (block, chunk, KV head, row) belongs to this task only.
                    let p = unsafe { parts.row(slot) };
                    p[..hd].copy_from_slice(o);
                    p[hd..].copy_from_slice(&stats[2 * i..2 * i + 2]);
                }
            }
        });
        if let Some(e) = err.into_inner().unwrap_or_else(|e| e.into_inner()) {
            (sc.att_tasks, sc.att_splits) = (tasks, bases);
            return Err(e);
        }
        // The split blocks: each row's chunks merged in order into its output.
        for &(b, chunks, base) in &bases {
            let (si, j0, tq) = blocks[b];
            let (r0, _) = step_info[si as usize];
            let len_before = steps[si as usize].kv.layer_len(li);
            let rows = tq as usize * group;
            for g in 0..nkv {
                for r in 0..rows {
                    let (j, h) = (j0 as usize + r / group, g * group + r % group);
                    let (first, n) = keys_of(len_before, j);
                    // SAFETY: the pool has returned; this loop is the only user of the rows.
                    let o = unsafe { att_out.row((r0 + j) * nh + h) };
                    let mut state = [0.0f32; 2];
                    for k in 0..chunks {
                        if attention::key_chunk(first, n, k).is_none() {
                            break;
                        }
                        // SAFETY: as above.
                        let p = unsafe { parts.row(base + (k * nkv + g) * rows + r) };
                        attention::merge_chunk(o, &mut state, &p[..hd], &p[hd..]);
                    }
                }
            }
        }
        (sc.att_tasks, sc.att_splits) = (tasks, bases);
        Ok(())
    }

    /// Stage 3 (per layer): the attention output is added to `x`, then RMSNorm, the gated MLP
    /// (SwiGLU or GeGLU; or the token's experts) and the down projection into `tmp`
    /// (post-normed when the family has post-norms); `tmp` is added to `x` by the next stage
    /// that reads `x`.
    fn mlp_block(
        &self,
        layer: &Layer,
        sc: &mut Scratch,
        total: usize,
        touch: Touch<'_>,
    ) -> Result<(), ForwardError> {
        let d = self.cfg.n_embd;
        self.residual_norm(
            &mut sc.x[..total * d],
            Some(&sc.tmp[..total * d]),
            &layer.ffn_norm,
            &mut sc.h[..total * d],
        );
        let Scratch {
            h,
            gate,
            up,
            tmp,
            tmp2,
            moe,
            ..
        } = sc;
        match &layer.ffn {
            Ffn::Dense(mlp) => self.gated_mlp(mlp, h, total, gate, up, tmp, tmp2, touch)?,
            Ffn::Moe(ex) => self.experts(ex, h, total, moe, gate, up, tmp, tmp2, touch)?,
        }
        if let Some(w) = &layer.ffn_post_norm {
            self.norm_in_place(&mut sc.tmp[..total * d], w, &mut sc.h[..total * d]);
        }
        Ok(())
    }

    /// Stage 4: on the rows whose logits are wanted only, the last residual add, the final
    /// RMSNorm and the output head (then the final soft-cap); commits every step's ring.
    fn head<S: KvStorage>(
        &self,
        steps: &mut [SeqStep<'_, S>],
        sc: &mut Scratch,
        out: &mut Vec<f32>,
        touch: Touch<'_>,
    ) -> Result<(), ForwardError> {
        let cfg = &self.cfg;
        let d = cfg.n_embd;
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
        if n_out > 0 {
            self.output.touch(touch);
        }
        if let Some((c, _)) = touch {
            c.end_token();
        }
        // Every logit of `out` is written below: only new room is zero-filled.
        let len = n_out * cfg.vocab_size;
        if out.len() < len {
            out.resize(len, 0.0);
        } else {
            out.truncate(len);
        }
        if n_out > 0 {
            if self.split_for('o', &self.output) {
                self.matmul_split(&self.output, &sc.sel, n_out, out, &mut sc.tmp2)?;
            } else {
                self.matmul(&self.output, &sc.sel, n_out, out)?;
            }
            if let Some(cap) = cfg.final_softcap {
                let v = cfg.vocab_size;
                let os = ops::SharedRows::new(&mut out[..], v);
                self.par_rows(n_out, &|r| {
                    // SAFETY: tasks get disjoint rows.
                    ops::softcap_rows(unsafe { os.rows(r) }, cap);
                });
            }
        }
        Ok(())
    }
}

fn lin(g: &dyn WeightSource, name: &str, shape: [u64; 2]) -> Result<Lin, ModelError> {
    lin_stacked(g, name, &shape)
}

/// A matrix of `shape[0]` columns and `shape[1] * shape[2] * ..` rows: a plain matrix, or a
/// stack of equal matrices such as the experts' `ffn_*_exps` (`[cols, rows, n_experts]`).
fn lin_stacked(g: &dyn WeightSource, name: &str, shape: &[u64]) -> Result<Lin, ModelError> {
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
    let base = g.file_bytes(t.file).as_ptr() as usize;
    let start = (t.data.as_ptr() as usize).wrapping_sub(base);
    let l = Lin {
        tensor: t.gguf_index.unwrap_or(usize::MAX),
        file: t.file,
        dtype: t.dtype,
        rows: shape[1..].iter().product::<u64>() as usize,
        cols: shape[0] as usize,
        bytes: start..start + t.data.len(),
        packed: None,
    };
    if name != "token_embd.weight" {
        check_kernel(g, &l, name)?;
    }
    Ok(l)
}

/// Checks that the kernels accept this matrix (dtype supported, length consistent).
fn check_kernel(g: &dyn WeightSource, l: &Lin, name: &str) -> Result<(), ModelError> {
    let data = g.file_bytes(l.file).get(l.bytes.clone()).unwrap_or(&[]);
    match WeightMatrix::new(l.dtype, l.rows, l.cols, data) {
        Ok(_) => Ok(()),
        Err(_) => Err(ModelError::UnsupportedDtype {
            tensor: name.into(),
            dtype: l.dtype,
        }),
    }
}

fn vector(g: &dyn WeightSource, name: &str, len: u64) -> Result<Vec<f32>, ModelError> {
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
