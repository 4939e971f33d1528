//! The serving engine: continuous batching, chunked prefill, prefix reuse and admission control
//! over one [`Executor`] (the CPU's [`Model`] by default) and one [`KvPool`].
//!
//! One scheduler thread runs a loop of batched forward steps. At every step all running
//! sequences decode together in one [`Executor::forward`] call (the weights stream from memory
//! once per step, whatever the batch size), prompt chunks fill the rest of the step's token
//! budget, and new requests join between steps. The decisions come from the pure
//! [`Scheduler`]; this module is the thin threaded shell around it.
//!
//! A request's events are the service vocabulary's [`InferenceEvent`]s, in order: `Started`;
//! for each generated token a `Delta` with its id and the text it made final (after a
//! `Logprobs` when the request asked for them); a last `Delta` with no ids for text held back
//! as a possible stop-sequence start; then `Finished`, or `Error` with the [`ErrorCode`] of an
//! [`EngineError`]. A request preempted for lack of KV and readmitted later (its KV recomputed)
//! sees no event of it: one `Started`, and its tokens continue where they stopped.
//!
//! ```no_run
//! use std::sync::Arc;
//! use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest};
//! use gpu_pipeline::zerolayer_api::InferenceEvent;
//! use gpu_pipeline::{Model, ModelOptions};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let path = weight_cache::locate_default_model()?;
//! // SAFETY: the model file is not modified while mapped.
//! let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path)? });
//! let tokenizer = Arc::new(token_stream::Tokenizer::from_gguf(&gguf)?);
//! let model = Arc::new(Model::load(gguf, ModelOptions::default())?);
//! let engine = Engine::new(model, Some(tokenizer.clone()), EngineConfig::default())?;
//! let prompt = tokenizer.encode("The capital of France is").to_vec();
//! let handle = engine.submit(GenerationRequest::new(prompt, 8))?;
//! while let Some(ev) = handle.recv() {
//!     if let InferenceEvent::Delta { text, .. } = ev {
//!         print!("{text}");
//!     }
//! }
//! # Ok(()) }
//! ```

mod channel;
mod complete;
mod draft;
mod metrics;
mod prefix;
mod scheduler;
mod speculate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_ring::{HostKv, KvDtype, KvError, KvPool, KvRing, KvStorage, RingMode};
use token_stream::{StreamDecoder, Tokenizer};

use crate::constraint::{
    Constrained, ConstraintError, ConstraintFactory, MaskFiller, SharedConstrained, lock,
};
use crate::executor::{CpuExecutor, Executor, HostedExecutor};
use crate::model::{LogitsWanted, Model, SeqStep};
use crate::sampling::{Sampler, SamplerConfig, fill_token_bytes, token_logprob};
use zerolayer_api::{ErrorCode, InferenceEvent, StopReason, TokenLogprob, Usage};

pub use channel::RequestHandle;
pub use complete::{Completion, GenerateError};
pub use metrics::EngineMetrics;
pub use scheduler::{
    ClientKey, ClientUsage, KvPlan, Refusal, Scheduler, SchedulerConfig, SeqId, SeqSpec, WorkItem,
};
pub use speculate::{
    DraftModel, LOOKUP_FIRST_MIN, NgramLookup, Speculation, longest_match, propose, verify,
};

use channel::Chan;
use draft::Drafter;
use prefix::PrefixCache;
use speculate::SpecState;

/// Configuration of an [`Engine`].
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// KV pool budget in bytes (of the executor's KV storage: host memory for the CPU, device
    /// memory for the CUDA executor).
    pub kv_budget_bytes: usize,
    /// KV element type ([`KvDtype::F16`]; [`KvDtype::Q8_0`] and [`KvDtype::Q4_0`] hold about
    /// 1.9x and 3.6x the tokens in the same budget, on the CPU executor).
    pub kv_dtype: KvDtype,
    /// Most requests waiting for admission.
    pub max_queue: usize,
    /// Most sequences in the batch.
    pub max_running: usize,
    /// Most tokens per forward step.
    pub step_token_budget: usize,
    /// Most prompt tokens of one sequence per step.
    pub prefill_chunk: usize,
    /// Prefix-cache entries (0 disables prefix reuse).
    pub prefix_cache_entries: usize,
    /// Shortest prefix worth reusing, in tokens.
    pub prefix_min_tokens: usize,
    /// Whether every client shares one prefix cache. `false` (the default): the cache is
    /// partitioned by [`GenerationRequest::client`], so a prompt's KV is only ever reused for
    /// requests of the same client (API key). A reused prefix shows from outside as a far
    /// shorter time to first token, so a shared cache lets one tenant learn whether another
    /// sent a prompt it guessed; share it only when every client trusts every other (one
    /// tenant behind several keys, a single-tenant fleet).
    pub shared_prefix_cache: bool,
    /// KV tokens reserved beyond the prompt at admission and added at each growth: a request
    /// holds the KV it uses rounded up to this, not its whole `max_new_tokens`.
    pub kv_grow_chunk: usize,
    /// Most requests (queued + running) of one client ([`GenerationRequest::client`]; all
    /// requests without a client count as one anonymous client). Beyond it `submit` refuses with
    /// [`SubmitError::Overloaded`] ([`Refusal::ClientLimit`]).
    pub max_running_per_client: usize,
    /// Largest fraction of the KV pool one client is admitted up to while other clients wait
    /// (1.0: only the fair-share preemption applies). See [`Scheduler`] for the policy.
    pub max_kv_share_per_client: f64,
    /// Speculative decoding: [`Speculation::Off`] (the default), n-gram prompt lookup, which
    /// verifies drafts taken from each sequence's own text, or a draft model's proposals
    /// (output unchanged either way: see [`verify`]).
    pub speculation: Speculation,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_budget_bytes: 1 << 30,
            kv_dtype: KvDtype::F16,
            max_queue: 512,
            max_running: 256,
            step_token_budget: 512,
            prefill_chunk: 256,
            prefix_cache_entries: 16,
            prefix_min_tokens: 8,
            shared_prefix_cache: false,
            kv_grow_chunk: 256,
            max_running_per_client: usize::MAX,
            max_kv_share_per_client: 1.0,
            speculation: Speculation::Off,
        }
    }
}

impl EngineConfig {
    /// Sets [`kv_dtype`](Self::kv_dtype).
    pub fn with_kv_dtype(mut self, dtype: KvDtype) -> Self {
        self.kv_dtype = dtype;
        self
    }
    /// Sets [`speculation`](Self::speculation).
    pub fn with_speculation(mut self, s: Speculation) -> Self {
        self.speculation = s;
        self
    }
    /// Sets [`kv_budget_bytes`](Self::kv_budget_bytes).
    pub fn with_kv_budget_bytes(mut self, b: usize) -> Self {
        self.kv_budget_bytes = b;
        self
    }
    /// Sets [`max_queue`](Self::max_queue).
    pub fn with_max_queue(mut self, n: usize) -> Self {
        self.max_queue = n;
        self
    }
    /// Sets [`max_running`](Self::max_running).
    pub fn with_max_running(mut self, n: usize) -> Self {
        self.max_running = n;
        self
    }
    /// Sets [`step_token_budget`](Self::step_token_budget).
    pub fn with_step_token_budget(mut self, n: usize) -> Self {
        self.step_token_budget = n;
        self
    }
    /// Sets [`prefill_chunk`](Self::prefill_chunk).
    pub fn with_prefill_chunk(mut self, n: usize) -> Self {
        self.prefill_chunk = n;
        self
    }
    /// Sets [`prefix_cache_entries`](Self::prefix_cache_entries).
    pub fn with_prefix_cache_entries(mut self, n: usize) -> Self {
        self.prefix_cache_entries = n;
        self
    }
    /// Sets [`shared_prefix_cache`](Self::shared_prefix_cache).
    ///
    /// ```
    /// use gpu_pipeline::engine::EngineConfig;
    /// assert!(!EngineConfig::default().shared_prefix_cache);
    /// assert!(EngineConfig::default().with_shared_prefix_cache(true).shared_prefix_cache);
    /// ```
    pub fn with_shared_prefix_cache(mut self, shared: bool) -> Self {
        self.shared_prefix_cache = shared;
        self
    }
    /// Sets [`kv_grow_chunk`](Self::kv_grow_chunk).
    ///
    /// ```
    /// use gpu_pipeline::engine::EngineConfig;
    /// let cfg = EngineConfig::default()
    ///     .with_kv_grow_chunk(128)
    ///     .with_max_running_per_client(32)
    ///     .with_max_kv_share_per_client(0.5);
    /// assert_eq!((cfg.kv_grow_chunk, cfg.max_running_per_client), (128, 32));
    /// ```
    pub fn with_kv_grow_chunk(mut self, n: usize) -> Self {
        self.kv_grow_chunk = n;
        self
    }
    /// Sets [`max_running_per_client`](Self::max_running_per_client).
    pub fn with_max_running_per_client(mut self, n: usize) -> Self {
        self.max_running_per_client = n;
        self
    }
    /// Sets [`max_kv_share_per_client`](Self::max_kv_share_per_client).
    pub fn with_max_kv_share_per_client(mut self, share: f64) -> Self {
        self.max_kv_share_per_client = share;
        self
    }
}

/// The scheduler's key for a client label: `None` (no API key) is one anonymous client, 0.
///
/// ```
/// use gpu_pipeline::engine::client_key;
/// assert_eq!(client_key(None), 0);
/// assert_eq!(client_key(Some("key-a")), client_key(Some("key-a")));
/// assert_ne!(client_key(Some("key-a")), client_key(Some("key-b")));
/// assert_ne!(client_key(Some("")), 0);
/// ```
pub fn client_key(label: Option<&str>) -> ClientKey {
    use std::hash::{Hash, Hasher};
    match label {
        None => 0,
        Some(l) => {
            // SipHash with fixed keys: stable within and across runs.
            let mut h = std::hash::DefaultHasher::new();
            l.hash(&mut h);
            h.finish().max(1)
        }
    }
}

/// One generation request.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least one).
    pub max_new_tokens: usize,
    /// Sampling.
    pub sampling: SamplerConfig,
    /// Tokens that end the generation (not emitted); `None` means [`Engine::stop_tokens`].
    pub stop_tokens: Option<Vec<u32>>,
    /// Strings that end the generation (need the engine's tokenizer); the text stops before.
    pub stop_sequences: Vec<String>,
    /// Higher is admitted first.
    pub priority: i32,
    /// Who sent it: a stable, non-secret label of the API key (`None`: one anonymous client).
    /// Per-client limits and fair admission go by it.
    pub client: Option<String>,
    /// `Some(n)`: every token's [`InferenceEvent::Delta`] comes after an
    /// [`InferenceEvent::Logprobs`] with its log-probability and the `n` most likely
    /// alternatives ([`TokenLogprob`]).
    pub logprobs: Option<usize>,
    /// Restricts every sampled token to what the constraint allows (structured output).
    pub constraint: Option<Arc<dyn ConstraintFactory>>,
}

impl GenerationRequest {
    /// A greedy request.
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            prompt,
            max_new_tokens,
            sampling: SamplerConfig::default(),
            stop_tokens: None,
            stop_sequences: Vec::new(),
            priority: 0,
            client: None,
            logprobs: None,
            constraint: None,
        }
    }
    /// Sets [`constraint`](Self::constraint).
    pub fn with_constraint(mut self, c: Option<Arc<dyn ConstraintFactory>>) -> Self {
        self.constraint = c;
        self
    }
    /// Sets [`logprobs`](Self::logprobs).
    pub fn with_logprobs(mut self, top_n: Option<usize>) -> Self {
        self.logprobs = top_n;
        self
    }
    /// Sets [`sampling`](Self::sampling).
    pub fn with_sampling(mut self, s: SamplerConfig) -> Self {
        self.sampling = s;
        self
    }
    /// Sets [`stop_sequences`](Self::stop_sequences).
    pub fn with_stop_sequences<S: Into<String>>(mut self, s: impl IntoIterator<Item = S>) -> Self {
        self.stop_sequences = s.into_iter().map(Into::into).collect();
        self
    }
    /// Sets [`stop_tokens`](Self::stop_tokens).
    pub fn with_stop_tokens(mut self, t: Vec<u32>) -> Self {
        self.stop_tokens = Some(t);
        self
    }
    /// Sets [`priority`](Self::priority).
    pub fn with_priority(mut self, p: i32) -> Self {
        self.priority = p;
        self
    }
    /// Sets [`client`](Self::client).
    ///
    /// ```
    /// use gpu_pipeline::engine::GenerationRequest;
    /// let r = GenerationRequest::new(vec![1, 2], 4).with_client(Some("team-a".into()));
    /// assert_eq!(r.client.as_deref(), Some("team-a"));
    /// ```
    pub fn with_client(mut self, client: Option<String>) -> Self {
        self.client = client;
        self
    }
}

/// Why [`Engine::submit`] refused a request.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The queue or the KV budget is full, or the client has too many requests in flight:
    /// retry later (HTTP 529 / `overloaded`).
    #[error("overloaded: {0}")]
    Overloaded(Refusal),
    /// Prompt plus `max_new_tokens` exceed the model's context.
    #[error(
        "prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceed the context of {context}"
    )]
    ContextLength {
        /// Prompt length.
        prompt_tokens: usize,
        /// Requested new tokens.
        max_new_tokens: usize,
        /// The model's context length.
        context: usize,
    },
    /// The request alone needs more KV than the pool holds.
    #[error("request too large for the KV pool: {0}")]
    TooLarge(Refusal),
    /// Empty prompt or `max_new_tokens == 0`.
    #[error("empty request: {0}")]
    Empty(Refusal),
    /// A prompt token id is not below the vocabulary size.
    #[error("prompt token {token} at index {index} is out of range (vocabulary {vocab})")]
    TokenOutOfRange {
        /// Position in the prompt.
        index: usize,
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// Stop sequences were given but the engine has no tokenizer.
    #[error("stop sequences need an engine with a tokenizer")]
    StopSequencesNeedTokenizer,
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// Why a running request failed (the request's last event is then an
/// [`InferenceEvent::Error`] with its [`code`](Self::code) and message).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The batched forward pass failed.
    #[error("forward pass failed: {0}")]
    Forward(#[from] crate::model::ForwardError),
    /// A generated token could not be detokenized.
    #[error("detokenization failed: {0}")]
    Decode(#[from] token_stream::DecodeError),
    /// The engine shut down before the request finished.
    #[error("the engine shut down")]
    ShutDown,
    /// The request's output constraint failed or allowed nothing.
    #[error(transparent)]
    Constraint(#[from] ConstraintError),
    /// Rolling back the KV of rejected speculative drafts failed.
    #[error("rolling back rejected drafts: {0}")]
    Rollback(KvError),
}

impl EngineError {
    /// The error class a client sees: the request's own constraint failing is
    /// [`ErrorCode::InvalidRequest`], a shutdown [`ErrorCode::ShuttingDown`], the rest
    /// [`ErrorCode::Internal`].
    ///
    /// ```
    /// use gpu_pipeline::engine::EngineError;
    /// use gpu_pipeline::zerolayer_api::ErrorCode;
    /// assert_eq!(EngineError::ShutDown.code(), ErrorCode::ShuttingDown);
    /// ```
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Constraint(_) => ErrorCode::InvalidRequest,
            Self::ShutDown => ErrorCode::ShuttingDown,
            Self::Forward(_) | Self::Decode(_) | Self::Rollback(_) => ErrorCode::Internal,
        }
    }

    /// The request's last event.
    fn event(&self) -> InferenceEvent {
        InferenceEvent::Error {
            code: self.code(),
            message: self.to_string(),
        }
    }
}

/// Why [`Engine::new`] failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum EngineInitError {
    /// The KV pool could not be made.
    #[error("KV pool: {0}")]
    Kv(#[from] KvError),
    /// The scheduler thread could not be spawned.
    #[error("spawning the scheduler thread: {0}")]
    Spawn(#[from] std::io::Error),
    /// The draft model of [`Speculation::DraftModel`] has another vocabulary than the model.
    #[error("the draft model's vocabulary has {draft} tokens, the model's {model}")]
    DraftVocabulary {
        /// The draft model's vocabulary size.
        draft: usize,
        /// The model's vocabulary size.
        model: usize,
    },
}

struct Pending {
    req: GenerationRequest,
    chan: Arc<Chan>,
    submitted: Instant,
}

struct State {
    sched: Scheduler,
    pending: HashMap<SeqId, Pending>,
    cancels: Vec<SeqId>,
    shutdown: bool,
    metrics: EngineMetrics,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn cancel(&self, id: SeqId) {
        let mut st = self.lock();
        if st.sched.cancel(id) && st.pending.remove(&id).is_some() {
            // It was still waiting: only the worker's parked state of a preempted sequence
            // remains, which the worker drops when it sees the id.
            st.metrics.cancelled += 1;
        }
        st.cancels.push(id);
        drop(st);
        self.wake.notify_all();
    }
}

/// The serving engine over an [`Executor`] (the CPU kernels by default). See the
/// [module docs](self).
pub struct Engine<E: Executor = CpuExecutor> {
    shared: Arc<Shared>,
    model: Arc<E>,
    pool: Arc<KvPool<E::Kv>>,
    tokenizer: Option<Arc<Tokenizer>>,
    next_id: AtomicU64,
    thread: Option<JoinHandle<()>>,
    started: Instant,
}

impl<E: Executor + std::fmt::Debug> std::fmt::Debug for Engine<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl Engine<CpuExecutor> {
    /// Starts an engine on `model` (run by the CPU kernels) with a KV pool of
    /// `cfg.kv_budget_bytes`. The tokenizer (the model's own) turns tokens into text and
    /// enables stop sequences.
    pub fn new(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineInitError> {
        Self::with_executor(Arc::new(CpuExecutor::new(model)), tokenizer, cfg)
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        self.model.model()
    }
}

impl Engine<HostedExecutor> {
    /// The model (on whichever executor runs it).
    pub fn model(&self) -> &Arc<Model> {
        self.model.model()
    }
}

impl<E: Executor> Engine<E> {
    /// Starts an engine on `model` (any [`Executor`]) with a KV pool of `cfg.kv_budget_bytes`.
    /// The tokenizer (the model's own) turns tokens into text and enables stop sequences.
    pub fn with_executor(
        model: Arc<E>,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineInitError> {
        // Window layers (Gemma, Mistral, ...) keep only the rows a chunk of up to
        // `prefill_chunk` tokens can still attend to.
        let pool = KvPool::with_layer_windows_in(
            model.kv_shape(cfg.kv_dtype),
            cfg.kv_budget_bytes,
            model.kv_windows(),
            cfg.prefill_chunk.max(1),
            model.kv_allocator(),
        )?;
        let draft = match &cfg.speculation {
            Speculation::DraftModel(d) => Some(Drafter::new(d, model.config(), &cfg)?),
            _ => None,
        };
        let bpt = pool.bytes_per_token().max(1);
        let sched = Scheduler::new(SchedulerConfig {
            max_queue: cfg.max_queue,
            max_queued_tokens: cfg.kv_budget_bytes / bpt,
            max_running: cfg.max_running,
            step_token_budget: cfg.step_token_budget,
            prefill_chunk: cfg.prefill_chunk,
            kv_budget_tokens: cfg.kv_budget_bytes / bpt,
            kv_grow_chunk: cfg.kv_grow_chunk,
            max_running_per_client: cfg.max_running_per_client,
            max_kv_share_per_client: cfg.max_kv_share_per_client,
        });
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                sched,
                pending: HashMap::new(),
                cancels: Vec::new(),
                shutdown: false,
                metrics: EngineMetrics::default(),
            }),
            wake: Condvar::new(),
        });
        let worker = Worker {
            shared: shared.clone(),
            model: model.clone(),
            pool: pool.clone(),
            prefix: PrefixCache::new(cfg.prefix_cache_entries, cfg.prefix_min_tokens),
            shared_prefix_cache: cfg.shared_prefix_cache,
            masks: None,
            speculation: cfg.speculation,
            draft,
        };
        let tok = tokenizer.clone();
        let thread = std::thread::Builder::new()
            .name("zerolayer-engine".into())
            .spawn(move || worker.run(tok.as_deref()))?;
        Ok(Self {
            shared,
            model,
            pool,
            tokenizer,
            next_id: AtomicU64::new(1),
            thread: Some(thread),
            started: Instant::now(),
        })
    }

    /// The executor running the model.
    pub fn executor(&self) -> &Arc<E> {
        &self.model
    }

    /// The tokenizer given at construction.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The tokens that end a request without its own [`stop_tokens`](GenerationRequest::stop_tokens):
    /// the model's EOS/EOT and the tokenizer's end-of-generation ids
    /// ([`Executor::stop_tokens_with`]).
    pub fn stop_tokens(&self) -> Vec<u32> {
        self.model.stop_tokens_with(self.tokenizer.as_deref())
    }

    /// The KV pool.
    pub fn kv_pool(&self) -> &Arc<KvPool<E::Kv>> {
        &self.pool
    }

    /// Queues a request, or refuses it at once (never blocks, never queues without bound).
    pub fn submit(&self, req: GenerationRequest) -> Result<RequestHandle, SubmitError> {
        let cfg = self.model.config();
        if let Some((index, &token)) = req
            .prompt
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= cfg.vocab_size)
        {
            return Err(SubmitError::TokenOutOfRange {
                index,
                token,
                vocab: cfg.vocab_size,
            });
        }
        if req.prompt.len().saturating_add(req.max_new_tokens) > cfg.context_length {
            return Err(SubmitError::ContextLength {
                prompt_tokens: req.prompt.len(),
                max_new_tokens: req.max_new_tokens,
                context: cfg.context_length,
            });
        }
        if !req.stop_sequences.iter().all(String::is_empty) && self.tokenizer.is_none() {
            return Err(SubmitError::StopSequencesNeedTokenizer);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let spec = SeqSpec::new(req.prompt.len(), req.max_new_tokens)
            .with_priority(req.priority)
            .with_client(client_key(req.client.as_deref()));
        let chan = Arc::new(Chan::default());
        let mut st = self.shared.lock();
        if st.shutdown {
            return Err(SubmitError::ShuttingDown);
        }
        if let Err(r) = st.sched.submit(id, spec) {
            return Err(match r {
                Refusal::TooLarge { .. } => SubmitError::TooLarge(r),
                Refusal::Empty { .. } => SubmitError::Empty(r),
                _ => {
                    st.metrics.refused += 1;
                    SubmitError::Overloaded(r)
                }
            });
        }
        st.metrics.submitted += 1;
        let submitted = Instant::now();
        st.pending.insert(
            id,
            Pending {
                req,
                chan: chan.clone(),
                submitted,
            },
        );
        drop(st);
        self.shared.wake.notify_all();
        Ok(RequestHandle {
            id,
            chan,
            shared: self.shared.clone(),
            submitted,
        })
    }

    /// Runs one request to its end on this thread: [`submit`](Self::submit), then
    /// [`RequestHandle::wait`], which calls `on_text` with the text as it becomes final.
    /// The one generation loop of the CLI (`generate`, `bench`), the examples and the benches:
    /// the serving engine's, with its sampling, stop rules and speculation.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest};
    /// use gpu_pipeline::{Model, ModelOptions};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let path = weight_cache::locate_default_model()?;
    /// // SAFETY: the model file is not modified while mapped.
    /// let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path)? });
    /// let tokenizer = Arc::new(token_stream::Tokenizer::from_gguf(&gguf)?);
    /// let model = Arc::new(Model::load(gguf, ModelOptions::default())?);
    /// let engine = Engine::new(model, Some(tokenizer.clone()), EngineConfig::default())?;
    /// let prompt = tokenizer.encode("The capital of France is").to_vec();
    /// let done = engine.generate(GenerationRequest::new(prompt, 8), &mut |t| print!("{t}"))?;
    /// println!("\n{} tokens, stop: {}", done.ids.len(), done.stop_reason);
    /// # Ok(()) }
    /// ```
    pub fn generate(
        &self,
        req: GenerationRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Completion, GenerateError> {
        self.submit(req)?.wait(on_text)
    }

    /// A snapshot of the metrics.
    pub fn metrics(&self) -> EngineMetrics {
        let st = self.shared.lock();
        let mut m = st.metrics.clone();
        m.queue_depth = st.sched.queue_depth();
        m.running = st.sched.running();
        m.preempted = st.sched.preemptions();
        drop(st);
        let busy = m.busy.as_secs_f64();
        if busy > 0.0 {
            m.generated_tokens_per_s = m.generated_tokens as f64 / busy;
            m.prompt_tokens_per_s = m.prompt_tokens as f64 / busy;
        }
        m.kv_bytes_used = self.pool.used_bytes();
        m.kv_bytes_budget = self.pool.budget_bytes();
        if let Some(stats) = self
            .model
            .weight_cache()
            .map(weight_cache::WeightCache::stats)
        {
            m.weight_cache_hit_rate = stats.hit_rate;
            m.expert_hit_rate = stats.part_hit_rate;
            let tokens = m.generated_tokens + m.prompt_tokens;
            m.storage_read_bytes_per_token = stats
                .storage_read_bytes
                .filter(|_| tokens > 0)
                .map(|b| b as f64 / tokens as f64);
        }
        m
    }

    /// Time since the engine started.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }
}

impl<E: Executor> Drop for Engine<E> {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A sampled token and, when asked for, its log-probabilities.
type Sampled = (u32, Option<Box<TokenLogprob>>);

/// One sequence's rows of [`Worker::sample_rows`]: one, or one per token of a speculative step
/// (the decode token and its drafts, verified by [`verify`]).
struct SampleJob<'a> {
    sampler: &'a mut Sampler,
    /// The sequence so far, the step's drafts last.
    history: &'a [u32],
    /// Draft tokens at the end of `history`.
    drafts: usize,
    prompt_len: usize,
    logprobs: Option<usize>,
    /// `drafts + 1` rows of logits.
    logits: &'a [f32],
    vocab: usize,
    constrained: Option<&'a SharedConstrained>,
    /// The emitted tokens (cleared first): the accepted drafts and one more.
    emitted: &'a mut Vec<Sampled>,
    /// Drafts accepted, or why a constrained sequence could not sample.
    out: Result<usize, ConstraintError>,
}

impl SampleJob<'_> {
    fn run(&mut self) {
        let Self {
            sampler,
            history,
            drafts,
            prompt_len,
            logprobs,
            logits,
            vocab,
            constrained,
            emitted,
            ..
        } = self;
        emitted.clear();
        let base = history.len() - *drafts;
        self.out = verify(&history[base..], |i| {
            let row = &logits[i * *vocab..(i + 1) * *vocab];
            let sampled = sample_one(
                sampler,
                &history[..base + i],
                *prompt_len,
                *logprobs,
                row,
                *constrained,
            )?;
            let token = sampled.0;
            emitted.push(sampled);
            Ok(token)
        });
    }
}

/// Samples one row as a decode step does: through the constraint's mask when there is one
/// (committing the token to it), with log-probabilities when asked for.
fn sample_one(
    sampler: &mut Sampler,
    history: &[u32],
    prompt_len: usize,
    logprobs: Option<usize>,
    logits: &[f32],
    constrained: Option<&SharedConstrained>,
) -> Result<Sampled, ConstraintError> {
    let token = match constrained {
        None => sampler.sample_after(logits, history, prompt_len),
        Some(c) => {
            let mut c = lock(c);
            let mask = c.mask()?;
            let t = sampler
                .sample_masked(logits, history, prompt_len, mask)
                .ok_or(ConstraintError::NoAllowedToken)?;
            c.state.commit(t)?;
            t
        }
    };
    let logprobs = logprobs.map(|n| Box::new(token_logprob(logits, token, n)));
    Ok((token, logprobs))
}

/// A sequence in the batch, owned by the scheduler thread.
struct Active<'t, S: KvStorage> {
    id: SeqId,
    req: GenerationRequest,
    chan: Arc<Chan>,
    kv: KvRing<S>,
    sampler: Sampler,
    constrained: Option<SharedConstrained>,
    history: Vec<u32>,
    decoder: Option<StreamDecoder<'t>>,
    stop_tokens: Vec<u32>,
    cached: usize,
    /// Prompt tokens whose KV came from the prefix cache at the latest (re)admission.
    cached_now: usize,
    submitted: Instant,
    last_token: Option<Instant>,
    output_tokens: usize,
    /// Prompt tokens of the request as submitted (`req.prompt` also holds the tokens generated
    /// before a preemption).
    input_tokens: usize,
    /// Speculation state (`None`: off).
    spec: Option<SpecState>,
    /// Draft tokens at the end of `history` during a step.
    drafts: usize,
    /// Draft tokens a draft model may propose for the next step (0: none).
    draft_want: usize,
    /// The draft model's KV ring: the sequence's text as the draft model has seen it.
    draft_kv: Option<KvRing<HostKv>>,
    /// The tokens sampled in the last step (reused buffer).
    emitted: Vec<Sampled>,
    /// Drafts accepted in the last step.
    accepted: usize,
}

/// What a preempted sequence keeps while it waits for readmission (everything but its KV):
/// on readmission its prompt plus generated tokens are prefilled again and it goes on where it
/// stopped, with the same sampler state and text decoder.
struct Parked<'t> {
    sampler: Sampler,
    constrained: Option<SharedConstrained>,
    history: Vec<u32>,
    decoder: Option<StreamDecoder<'t>>,
    stop_tokens: Vec<u32>,
    cached: usize,
    last_token: Option<Instant>,
    output_tokens: usize,
    input_tokens: usize,
}

/// An admitted request whose KV could not be allocated, handed back to wait again.
type StartFailed<'t> = Box<(Pending, Option<Parked<'t>>)>;

enum Outcome {
    Continue,
    Stop(StopReason, Option<String>),
    /// Failed; the error was not reported yet.
    Fail(EngineError),
    /// Failed; the error event was already sent.
    Failed,
}

struct Worker<E: Executor> {
    shared: Arc<Shared>,
    model: Arc<E>,
    pool: Arc<KvPool<E::Kv>>,
    prefix: PrefixCache<E::Kv>,
    /// [`EngineConfig::shared_prefix_cache`].
    shared_prefix_cache: bool,
    /// Fills constrained sequences' masks during the forward pass (started by the first
    /// constrained step).
    masks: Option<MaskFiller>,
    /// [`EngineConfig::speculation`].
    speculation: Speculation,
    /// The draft model of [`Speculation::DraftModel`].
    draft: Option<Drafter>,
}

impl<E: Executor> Worker<E> {
    /// Starts filling the masks of the constrained sequences that sample this step, on the
    /// mask thread while the forward pass runs; whether it started (if not, each mask is
    /// filled when its row samples). No allocation without constrained sequences.
    fn begin_masks(&mut self, seqs: &[(WorkItem, Active<'_, E::Kv>)]) -> bool {
        let ahead: Vec<SharedConstrained> = seqs
            .iter()
            .filter(|(w, _)| w.samples())
            .filter_map(|(_, a)| a.constrained.clone())
            .collect();
        if ahead.is_empty() {
            return false;
        }
        if self.masks.is_none() {
            match MaskFiller::start() {
                Ok(m) => self.masks = Some(m),
                Err(e) => tracing::warn!("no mask thread ({e}): masks are filled when sampling"),
            }
        }
        self.masks.as_ref().is_some_and(|m| m.begin(ahead))
    }

    /// Samples the next token of every step item that samples, in order, into its sequence's
    /// `emitted` (a speculative step: its rows until one differs from its draft, by
    /// [`verify`]): in parallel chunks on the model's pool for a large batch (each sequence's
    /// sampler is called as serially, so the tokens are the same). A request that asks for
    /// logprobs gets them from the same row. Returns, per sampling item, the drafts accepted.
    fn sample_rows(
        &self,
        seqs: &mut [(WorkItem, Active<'_, E::Kv>)],
        logits: &[f32],
        vocab: usize,
    ) -> Vec<Result<usize, ConstraintError>> {
        let mut jobs: Vec<SampleJob<'_>> = Vec::new();
        let mut row = 0;
        for (w, a) in seqs.iter_mut() {
            if w.samples() {
                let rows = a.drafts + 1;
                jobs.push(SampleJob {
                    sampler: &mut a.sampler,
                    history: &a.history,
                    drafts: a.drafts,
                    prompt_len: a.input_tokens,
                    logprobs: a.req.logprobs,
                    logits: &logits[row * vocab..(row + rows) * vocab],
                    vocab,
                    constrained: a.constrained.as_ref(),
                    emitted: &mut a.emitted,
                    out: Ok(0),
                });
                row += rows;
            }
        }
        let pool = self.model.host_pool();
        let threads = pool.n_threads();
        if jobs.len() < 8 || threads < 2 {
            jobs.iter_mut().for_each(SampleJob::run);
        } else {
            // Each task takes the next chunk of rows (as the kernels' activation quantization does).
            let chunk = jobs.len().div_ceil(2 * threads);
            let tasks = jobs.len().div_ceil(chunk);
            let chunks = Mutex::new(jobs.chunks_mut(chunk));
            pool.run(tasks, &|_, _| {
                let next = chunks.lock().unwrap_or_else(|e| e.into_inner()).next();
                next.into_iter().flatten().for_each(SampleJob::run);
            });
        }
        jobs.into_iter().map(|j| j.out).collect()
    }

    fn run(mut self, tok: Option<&Tokenizer>) {
        let mut active: HashMap<SeqId, Active<'_, E::Kv>> = HashMap::new();
        let mut parked: HashMap<SeqId, Parked<'_>> = HashMap::new();
        let mut logits = Vec::new();
        let vocab = self.model.config().vocab_size;
        let shared = self.shared.clone();
        loop {
            // ---- speculation: the drafts each decoding sequence would verify next (fewer the
            // more sequences decode: see `NgramLookup::max_batch`)
            let decoding = active.values().filter(|a| a.decoding()).count();
            for a in active.values_mut() {
                a.propose(decoding);
            }
            if let Some(d) = &mut self.draft {
                d.draft(active.values_mut(), decoding);
            }
            // ---- between steps: cancellations, admissions, the plan
            let mut st = shared.lock();
            while st.sched.is_idle() && st.cancels.is_empty() && !st.shutdown {
                st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.shutdown {
                for (_, p) in st.pending.drain() {
                    p.chan.send(EngineError::ShutDown.event());
                }
                for (_, a) in active.drain() {
                    a.chan.send(EngineError::ShutDown.event());
                }
                return;
            }
            let mut cancels = std::mem::take(&mut st.cancels);
            cancels.extend(
                active
                    .iter()
                    .filter(|(_, a)| a.chan.is_cancelled())
                    .map(|(id, _)| *id),
            );
            for id in cancels {
                st.sched.cancel(id);
                st.pending.remove(&id);
                parked.remove(&id);
                if active.remove(&id).is_some() {
                    st.metrics.cancelled += 1;
                }
            }
            for a in active.values() {
                if let Some(sp) = &a.spec {
                    st.sched.set_draft(a.id, sp.proposal.len());
                }
            }
            self.plan_kv(&mut st, &mut active, &mut parked, tok);
            let batch = st.sched.next_batch();
            st.metrics.prefix_entries = self.prefix.len();
            drop(st);
            if batch.is_empty() {
                // Waiting requests that do not fit yet: wait for a cancellation or new work.
                let st = shared.lock();
                if st.cancels.is_empty() && !st.shutdown {
                    drop(shared.wake.wait_timeout(st, Duration::from_millis(5)));
                }
                continue;
            }

            // ---- the step
            let t0 = Instant::now();
            let mut seqs: Vec<(WorkItem, Active<'_, E::Kv>)> = batch
                .iter()
                .filter_map(|w| active.remove(&w.id()).map(|a| (*w, a)))
                .collect();
            for (w, a) in &mut seqs {
                if let WorkItem::Decode { draft, .. } = *w {
                    a.push_drafts(draft);
                }
            }
            let filling = self.begin_masks(&seqs);
            let result = {
                let mut steps: Vec<SeqStep<'_, E::Kv>> = seqs
                    .iter_mut()
                    .map(|(w, a)| {
                        let (tokens, logits) = match *w {
                            WorkItem::Prefill {
                                start, len, last, ..
                            } => (
                                &a.req.prompt[start..start + len],
                                if last {
                                    LogitsWanted::Last
                                } else {
                                    LogitsWanted::None
                                },
                            ),
                            WorkItem::Decode { .. } => (
                                // The last sampled token, then the drafts to verify.
                                &a.history[a.history.len() - 1 - a.drafts..],
                                if a.drafts > 0 {
                                    LogitsWanted::All
                                } else {
                                    LogitsWanted::Last
                                },
                            ),
                        };
                        SeqStep {
                            tokens,
                            kv: &mut a.kv,
                            logits,
                        }
                    })
                    .collect();
                self.model.forward(&mut steps, &mut logits)
            };
            if filling && let Some(m) = &self.masks {
                m.finish();
            }
            let now = Instant::now();
            let mut outcomes = Vec::with_capacity(seqs.len());
            let mut prompt_computed = 0u64;
            let mut generated = 0u64;
            let mut ttfts = Vec::new();
            let mut itls = Vec::new();
            let (mut drafted, mut accepted, mut sampled_steps) = (0u64, 0u64, 0u64);
            let mut lookup_drafted = 0u64;
            match result {
                Err(e) => {
                    let event = EngineError::from(e).event();
                    for (_, a) in &seqs {
                        a.chan.send(event.clone());
                    }
                    outcomes.extend(seqs.iter().map(|_| Outcome::Failed));
                }
                Ok(()) => {
                    let tokens = self.sample_rows(&mut seqs, &logits, vocab);
                    let mut tokens = tokens.into_iter();
                    for (w, a) in &mut seqs {
                        if let WorkItem::Prefill { len, last, .. } = *w {
                            prompt_computed += len as u64;
                            if last {
                                self.remember_prefix(a);
                            }
                        }
                        if !w.samples() {
                            outcomes.push(Outcome::Continue);
                            continue;
                        }
                        let drafts = a.drafts;
                        if a.spec.as_ref().is_some_and(SpecState::proposed_by_lookup) {
                            lookup_drafted += drafts as u64;
                        }
                        let accepted_now =
                            match tokens.next().expect("one result per sampling item") {
                                Ok(n) => n,
                                Err(e) => {
                                    outcomes.push(Outcome::Fail(e.into()));
                                    continue;
                                }
                            };
                        match a.last_token {
                            None => ttfts.push(now - a.submitted),
                            Some(t) => itls.push(now - t),
                        }
                        a.last_token = Some(now);
                        let (outcome, emitted) = a.finish_step(accepted_now);
                        // The tokens after the first arrive with it.
                        itls.extend((1..emitted).map(|_| Duration::ZERO));
                        generated += emitted as u64;
                        sampled_steps += 1;
                        drafted += drafts as u64;
                        accepted += accepted_now as u64;
                        outcomes.push(outcome);
                    }
                }
            }
            let busy = t0.elapsed();

            // ---- after the step: bookkeeping under the lock
            let mut st = shared.lock();
            for (w, a) in &seqs {
                if let WorkItem::Decode { draft, .. } = *w
                    && draft > 0
                {
                    st.sched.drafts_accepted(a.id, a.accepted);
                }
            }
            let max_done = st.sched.complete_batch();
            let m = &mut st.metrics;
            m.steps += 1;
            m.draft_tokens += drafted;
            m.accepted_draft_tokens += accepted;
            m.lookup_draft_tokens += lookup_drafted;
            m.sampled_steps += sampled_steps;
            m.record_batch(seqs.len());
            m.busy += busy;
            m.prompt_tokens += prompt_computed;
            m.generated_tokens += generated;
            for d in ttfts {
                m.ttft.observe_duration(d);
            }
            for d in itls {
                m.inter_token.observe_duration(d);
            }
            for ((_, mut a), outcome) in seqs.into_iter().zip(outcomes) {
                let id_done = max_done.contains(&a.id);
                let finish = match outcome {
                    Outcome::Fail(e) => {
                        st.sched.finish(a.id);
                        a.chan.send(e.event());
                        None
                    }
                    Outcome::Failed => {
                        st.sched.finish(a.id);
                        None
                    }
                    Outcome::Stop(r, s) => {
                        st.sched.finish(a.id);
                        Some((r, s))
                    }
                    Outcome::Continue if id_done => Some((StopReason::MaxTokens, None)),
                    Outcome::Continue => {
                        active.insert(a.id, a);
                        continue;
                    }
                };
                if let Some((stop_reason, stop_sequence)) = finish {
                    st.metrics.finished += 1;
                    let tail_text = match (&mut a.decoder, &stop_sequence) {
                        (Some(d), None) => d.finish().to_string(),
                        _ => String::new(),
                    };
                    let usage = Usage {
                        input_tokens: u32::try_from(a.input_tokens).unwrap_or(u32::MAX),
                        output_tokens: u32::try_from(a.output_tokens).unwrap_or(u32::MAX),
                    };
                    let chan = a.chan.clone();
                    // Free the ring before telling the client.
                    drop(a);
                    if !tail_text.is_empty() {
                        chan.send(InferenceEvent::Delta {
                            ids: Vec::new(),
                            text: tail_text,
                        });
                    }
                    chan.send(InferenceEvent::Finished {
                        stop_reason,
                        stop_sequence,
                        usage,
                    });
                }
            }
        }
    }

    /// Between steps: asks the scheduler for the KV plan within the pool's free memory (after
    /// evicting cached prefixes it wants), then applies it in order: preemptions (the ring is
    /// freed, the request waits again with its generated tokens as prompt), growth, admissions.
    fn plan_kv<'t>(
        &mut self,
        st: &mut State,
        active: &mut HashMap<SeqId, Active<'t, E::Kv>>,
        parked: &mut HashMap<SeqId, Parked<'t>>,
        tok: Option<&'t Tokenizer>,
    ) {
        let bpt = self.pool.bytes_per_token().max(1);
        let free =
            |pool: &KvPool<E::Kv>| pool.budget_bytes().saturating_sub(pool.used_bytes()) / bpt;
        let want = st.sched.kv_wanted();
        while free(&self.pool) < want && self.prefix.evict_lru() {}
        let plan = st.sched.schedule(free(&self.pool));
        for &id in &plan.preempt {
            if let Some(a) = active.remove(&id) {
                park(st, parked, a);
            }
        }
        for &(id, capacity) in &plan.grow {
            let Some(a) = active.get_mut(&id) else {
                continue;
            };
            if a.kv.grow(capacity).is_err() {
                // The pool holds less than the scheduler was told (cannot happen with exact
                // accounting): this sequence waits again instead of failing.
                st.sched.preempt(id);
                if let Some(a) = active.remove(&id) {
                    park(st, parked, a);
                }
            }
        }
        for (id, capacity) in plan.admit {
            let Some(p) = st.pending.remove(&id) else {
                st.sched.cancel(id);
                continue;
            };
            let resumed = parked.remove(&id);
            let is_resume = resumed.is_some();
            match self.start(id, p, capacity, resumed, tok) {
                Ok(a) => {
                    st.sched.started(id, a.cached_now);
                    if !is_resume {
                        if a.cached > 0 {
                            st.metrics.prefix_hits += 1;
                            st.metrics.prefix_hit_tokens += a.cached as u64;
                        }
                        st.metrics.prefix_lookups += 1;
                        a.chan.send(InferenceEvent::Started {
                            input_tokens: u32::try_from(a.input_tokens).unwrap_or(u32::MAX),
                        });
                    }
                    active.insert(id, a);
                }
                Err(failed) => {
                    let (p, resumed) = *failed;
                    st.pending.insert(id, p);
                    if let Some(r) = resumed {
                        parked.insert(id, r);
                    }
                    st.sched.start_failed(id);
                }
            }
        }
    }

    /// Allocates the KV of an admitted request, `capacity` tokens (forking a cached prefix
    /// when one matches); a preempted sequence resumes from its parked state.
    fn start<'t>(
        &mut self,
        id: SeqId,
        p: Pending,
        capacity: usize,
        resumed: Option<Parked<'t>>,
        tok: Option<&'t Tokenizer>,
    ) -> Result<Active<'t, E::Kv>, StartFailed<'t>> {
        let cap = capacity.max(p.req.prompt.len() + 1);
        let partition = self.prefix_partition(&p.req);
        let forked = match self.prefix.lookup(partition, &p.req.prompt) {
            Some((ring, n)) => ring
                .fork_into(n, cap, RingMode::Strict)
                .ok()
                .map(|r| (r, n)),
            None => None,
        };
        let (kv, cached) = match forked {
            Some(x) => x,
            None => match self.pool.alloc(cap, RingMode::Strict) {
                Ok(r) => (r, 0),
                Err(_) => return Err(Box::new((p, resumed))),
            },
        };
        if let Some(r) = resumed {
            return Ok(Active {
                id,
                req: p.req,
                chan: p.chan,
                kv,
                sampler: r.sampler,
                constrained: r.constrained,
                history: r.history,
                decoder: r.decoder,
                stop_tokens: r.stop_tokens,
                cached: r.cached,
                cached_now: cached,
                submitted: p.submitted,
                last_token: r.last_token,
                output_tokens: r.output_tokens,
                input_tokens: r.input_tokens,
                spec: self.new_spec(),
                drafts: 0,
                draft_want: 0,
                draft_kv: None,
                emitted: Vec::with_capacity(1),
                accepted: 0,
            });
        }
        let decoder = tok.map(|t| {
            StreamDecoder::new(t)
                .skip_special_tokens(true)
                .with_stop_sequences(p.req.stop_sequences.iter().cloned())
        });
        let stop_tokens = p
            .req
            .stop_tokens
            .clone()
            .unwrap_or_else(|| self.model.stop_tokens_with(tok));
        let mut history = Vec::with_capacity(p.req.prompt.len() + p.req.max_new_tokens);
        history.extend_from_slice(&p.req.prompt);
        Ok(Active {
            input_tokens: p.req.prompt.len(),
            cached_now: cached,
            id,
            sampler: Sampler::new(p.req.sampling.clone()),
            constrained: p
                .req
                .constraint
                .as_deref()
                .map(|f| Constrained::new(f, self.model.config().vocab_size)),
            req: p.req,
            chan: p.chan,
            kv,
            history,
            decoder,
            stop_tokens,
            cached,
            submitted: p.submitted,
            last_token: None,
            output_tokens: 0,
            spec: self.new_spec(),
            drafts: 0,
            draft_want: 0,
            draft_kv: None,
            emitted: Vec::with_capacity(1),
            accepted: 0,
        })
    }

    /// A new sequence's speculation state, per [`EngineConfig::speculation`].
    fn new_spec(&self) -> Option<SpecState> {
        SpecState::new(&self.speculation)
    }

    /// Keeps a copy of a just-prefilled prompt's KV for later requests with the same prefix.
    fn remember_prefix(&mut self, a: &Active<'_, E::Kv>) {
        let n = a.req.prompt.len();
        // A resumed sequence's prompt holds its own generated tokens: nobody else's prefix.
        let resumed = n != a.input_tokens;
        let partition = self.prefix_partition(&a.req);
        if resumed || self.prefix.is_disabled() || self.prefix.covers(partition, &a.req.prompt) {
            return;
        }
        if let Ok(ring) = a.kv.fork_into(n, n, RingMode::Strict) {
            self.prefix.insert(partition, a.req.prompt.clone(), ring);
        }
    }

    /// The prefix-cache partition of a request: its client's, unless the cache is shared.
    fn prefix_partition(&self, req: &GenerationRequest) -> prefix::Partition {
        if self.shared_prefix_cache {
            0
        } else {
            client_key(req.client.as_deref())
        }
    }
}

/// Frees a preempted sequence's KV and keeps the rest for its readmission: its pending request
/// now has prompt + generated tokens as prompt (what the scheduler queued it with).
fn park<'t, S: KvStorage>(
    st: &mut State,
    parked: &mut HashMap<SeqId, Parked<'t>>,
    a: Active<'t, S>,
) {
    let Active {
        id,
        mut req,
        chan,
        kv,
        sampler,
        constrained,
        history,
        decoder,
        stop_tokens,
        cached,
        submitted,
        last_token,
        output_tokens,
        input_tokens,
        ..
    } = a;
    drop(kv);
    req.prompt.clone_from(&history);
    st.pending.insert(
        id,
        Pending {
            req,
            chan,
            submitted,
        },
    );
    parked.insert(
        id,
        Parked {
            sampler,
            constrained,
            history,
            decoder,
            stop_tokens,
            cached,
            last_token,
            output_tokens,
            input_tokens,
        },
    );
}

impl<S: KvStorage> Active<'_, S> {
    /// Whether the sequence is past its prompt (its KV holds all but its last token).
    fn decoding(&self) -> bool {
        self.kv.next_pos() as usize + 1 == self.history.len()
    }

    /// Proposes the drafts of the next step, if the sequence speculates and is decoding, in a
    /// batch of `batch` decoding sequences.
    fn propose(&mut self, batch: usize) {
        let decoding = self.decoding();
        self.draft_want = 0;
        let Some(sp) = &mut self.spec else {
            return;
        };
        if decoding && batch <= sp.max_batch() {
            let left = (self.req.max_new_tokens).saturating_sub(self.output_tokens + 1);
            if sp.uses_draft_model() {
                self.draft_want = sp.propose_before_draft(&self.history, left, batch);
            } else {
                sp.propose(&self.history, left, batch);
            }
            // Lookup's drafts (a draft model's are cut as it drafts).
            if !sp.proposal.is_empty()
                && let Some(c) = &self.constrained
            {
                let allowed = lock(c).state.allowed_prefix(&sp.proposal);
                sp.proposal.truncate(allowed);
            }
        } else {
            sp.proposal.clear();
        }
    }

    /// Appends the first `n` drafts of the proposal to the history for the step to verify.
    fn push_drafts(&mut self, n: usize) {
        self.drafts = 0;
        if let Some(sp) = &self.spec
            && n > 0
        {
            // The scheduler grants at most the proposal's length (`set_draft`).
            let n = n.min(sp.proposal.len());
            self.history.extend_from_slice(&sp.proposal[..n]);
            self.drafts = n;
        }
    }

    /// After a step sampled `emitted` (its first `accepted` drafts accepted): drops the drafts
    /// from the history and the rejected ones' KV, then takes the emitted tokens in order
    /// until one stops the sequence. Returns the outcome and the tokens taken.
    fn finish_step(&mut self, accepted: usize) -> (Outcome, usize) {
        let drafts = std::mem::take(&mut self.drafts);
        self.history.truncate(self.history.len() - drafts);
        self.accepted = accepted;
        // The draft model's ring keeps the accepted drafts it was fed.
        if let Some(ring) = &mut self.draft_kv {
            let (fed, text) = (ring.next_pos() as usize, self.history.len());
            if fed > text {
                let keep = text + accepted.min(fed - text);
                if ring.rollback(fed - keep).is_err() {
                    self.draft_kv = None;
                }
            }
        }
        if let Some(sp) = &mut self.spec {
            sp.record(drafts, accepted);
        }
        if drafts > accepted
            && let Err(e) = self.kv.rollback(drafts - accepted)
        {
            return (Outcome::Fail(EngineError::Rollback(e)), 0);
        }
        let mut emitted = std::mem::take(&mut self.emitted);
        let (mut outcome, mut taken) = (Outcome::Continue, 0);
        for (token, logprobs) in emitted.drain(..) {
            taken += 1;
            outcome = self.accept(token, logprobs);
            if !matches!(outcome, Outcome::Continue) {
                break;
            }
        }
        self.emitted = emitted;
        (outcome, taken)
    }

    /// Takes a sampled token: emits it, or stops.
    fn accept(&mut self, token: u32, mut logprobs: Option<Box<TokenLogprob>>) -> Outcome {
        if self.stop_tokens.contains(&token) {
            return Outcome::Stop(StopReason::EndTurn, None);
        }
        self.history.push(token);
        self.output_tokens += 1;
        let (text, stopped) = match &mut self.decoder {
            None => (String::new(), None),
            Some(d) => match d.push(token) {
                Ok(step) => (step.text.to_string(), step.stopped),
                Err(e) => return Outcome::Fail(EngineError::from(e)),
            },
        };
        if let (Some(lp), Some(d)) = (logprobs.as_deref_mut(), &self.decoder) {
            fill_token_bytes(lp, d.tokenizer());
        }
        if let Some(lp) = logprobs {
            self.chan.send(InferenceEvent::Logprobs(vec![*lp]));
        }
        self.chan.send(InferenceEvent::Delta {
            ids: vec![token],
            text,
        });
        if let Some(i) = stopped {
            return Outcome::Stop(
                StopReason::StopSequence,
                self.req
                    .stop_sequences
                    .iter()
                    .filter(|s| !s.is_empty())
                    .nth(i)
                    .cloned(),
            );
        }
        Outcome::Continue
    }
}
