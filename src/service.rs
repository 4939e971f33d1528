//! [`EngineService`]: the [`InferenceService`] the transports talk to, over the gpu-pipeline
//! [`Engine`] and the model's own tokenizer and chat template.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::task::Poll;

use futures::FutureExt;
use futures::channel::oneshot;

use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest, RequestHandle};
use gpu_pipeline::executor::HostedExecutor;
use gpu_pipeline::{GrammarError, Grammars, ModelOptions, SamplerConfig, WeightSource};
use token_stream::{ChatTemplate, Tokenizer, ToolCallParser, ToolEvent, ToolSyntax};
use weight_cache::{FileWatch, WarmupHandle, WarmupStrategy, WeightCache};
use zerolayer_api::{
    ErrorCode, EventStream, InferenceEvent, InferenceRequest, InferenceService, ModelInfo, Prompt,
    ServiceError, ServiceHealth, ServiceMetrics, StopReason, ToolChoice, Tools,
};

use crate::load::{ExecutorChoice, chat_template, load_model};
use crate::prompt::{PromptParts, PromptPool};

/// Why [`EngineService::load`] failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum LoadServiceError {
    /// The model file could not be mapped or parsed.
    #[error("opening the model: {0}")]
    Gguf(#[from] weight_cache::GgufError),
    /// The tokenizer in the file could not be loaded.
    #[error("loading the tokenizer: {0}")]
    Tokenizer(#[from] token_stream::LoadError),
    /// The model could not be loaded.
    #[error("loading the model: {0}")]
    Model(#[from] gpu_pipeline::ModelError),
    /// The engine could not start.
    #[error("starting the engine: {0}")]
    Engine(#[from] gpu_pipeline::engine::EngineInitError),
    /// The weight cache's block table could not be built.
    #[error("building the weight cache: {0}")]
    WeightCache(#[from] weight_cache::BlockTableError),
    /// A Hugging Face model directory could not be opened.
    #[error("opening the model directory: {0}")]
    Hf(#[from] gpu_pipeline::HfError),
    /// A thread of the prompt (tokenizer) pool could not be started.
    #[error("starting the prompt tokenizer threads: {0}")]
    PromptPool(std::io::Error),
    /// The engine has no tokenizer and its model is not a GGUF file to read one from.
    #[error("the engine has no tokenizer and the model source carries none")]
    NoTokenizer,
    /// The CUDA executor could not start (no driver, no GPU, an unsupported model).
    #[cfg(feature = "cuda")]
    #[error("starting the CUDA executor: {0}")]
    Cuda(#[from] gpu_pipeline::executor::CudaError),
    /// The CUDA executor was asked for, but this build of zerolayer has no `cuda` feature.
    #[error("this zerolayer was built without the `cuda` feature")]
    CudaNotBuilt,
}

/// An [`InferenceService`] over one model served by an [`Engine`].
///
/// ```no_run
/// use zerolayer::EngineService;
/// use zerolayer::zerolayer_api::{InferenceService, Prompt};
/// let path = zerolayer::weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while mapped.
/// let svc = unsafe {
///     EngineService::load(&path, Default::default(), Default::default())
/// }?;
/// // Served under the file's `general.name` unless renamed with `with_model_id`.
/// let id = svc.model_id().to_owned();
/// assert!(!id.is_empty());
/// assert!(svc.count_tokens(&Prompt::Text("Hello".into()))? > 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct EngineService {
    engine: Arc<Engine<HostedExecutor>>,
    tokenizer: Arc<Tokenizer>,
    chat: Option<Arc<ChatTemplate>>,
    /// How tools reach the chat template (found once, by probing it).
    tool_syntax: ToolSyntax,
    info: ModelInfo,
    weights: Option<Weights>,
    /// Whether the served file changed on disk since it was mapped (checked once a second;
    /// GGUF files).
    file_watch: Option<Arc<FileWatch>>,
    /// Tokenizes submitted prompts off the caller's (async) thread.
    prompts: PromptPool,
    /// The grammar compiler over the model's vocabulary, built by the first request with an
    /// output format (its token trie takes a moment).
    grammars: Arc<OnceLock<Result<Grammars, GrammarError>>>,
}

/// The weight cache of the served file and its running warm-up.
struct Weights {
    cache: WeightCache,
    warm: WarmupHandle,
    /// Whether `ready()` waits for the warm-up to finish (false for adaptive, which never does).
    gate: bool,
}

impl std::fmt::Debug for EngineService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineService")
            .field("model", &self.info)
            .finish_non_exhaustive()
    }
}

impl EngineService {
    /// Maps the model at `path` and starts an engine on it, served under the model's own name
    /// (see [`new`](Self::new); [`with_model_id`](Self::with_model_id) renames it). `path` is a
    /// GGUF file, or a Hugging Face model directory (`config.json`, `*.safetensors`,
    /// `tokenizer.json`, the chat template from `tokenizer_config.json`; see
    /// [`gpu_pipeline::HfModel`]).
    ///
    /// # Safety
    /// The files must not be modified or truncated while mapped (see `weight_cache::Gguf::open`).
    pub unsafe fn load(
        path: &Path,
        options: ModelOptions,
        cfg: EngineConfig,
    ) -> Result<Self, LoadServiceError> {
        // SAFETY: forwarded to our caller.
        unsafe { Self::load_on(path, options, cfg, ExecutorChoice::Cpu) }
    }

    /// [`load`](Self::load) with the forward pass on `executor`.
    ///
    /// # Safety
    /// As [`load`](Self::load).
    pub unsafe fn load_on(
        path: &Path,
        options: ModelOptions,
        cfg: EngineConfig,
        executor: ExecutorChoice,
    ) -> Result<Self, LoadServiceError> {
        // SAFETY: forwarded to our caller.
        let (model, tokenizer) = unsafe { load_model(path, options) }?;
        let tokenizer = Arc::new(tokenizer);
        let exec = crate::executor(Arc::new(model), executor)?;
        let engine = Engine::with_executor(Arc::new(exec), Some(tokenizer.clone()), cfg)?;
        Self::new(engine)
    }

    /// Serves `engine` with the engine's tokenizer or else the one in the file.
    ///
    /// The served model id (what requests name in `model` and `/v1/models` lists) is the
    /// model's own name: the file's `general.name`, trimmed, when it is not blank, else the
    /// file (or directory) name without its extension ([`WeightSource::model_name`]), else
    /// `"model"`.
    /// [`with_model_id`](Self::with_model_id) overrides it.
    pub fn new(engine: Engine<HostedExecutor>) -> Result<Self, LoadServiceError> {
        let tokenizer = match engine.tokenizer() {
            Some(t) => t.clone(),
            None => match engine.model().gguf() {
                Some(g) => Arc::new(Tokenizer::from_gguf(g)?),
                None => return Err(LoadServiceError::NoTokenizer),
            },
        };
        let chat = chat_template(&tokenizer, engine.model().source().as_ref()).map(Arc::new);
        let tool_syntax = chat
            .as_ref()
            .map_or(ToolSyntax::HermesPolyfill, |c| c.tool_syntax());
        let model_id = served_model_id(engine.model().source().as_ref());
        let info = ModelInfo {
            display_name: engine
                .model()
                .source()
                .get_str("general.name")
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .unwrap_or(&model_id)
                .to_string(),
            id: model_id,
            context_length: u32::try_from(engine.model().config().context_length)
                .unwrap_or(u32::MAX),
        };
        let file_watch = engine
            .model()
            .gguf()
            .map(|g| Arc::new(FileWatch::new(g.clone())));
        if let Some(w) = &file_watch
            && let Err(e) = FileWatch::spawn_checker(w)
        {
            tracing::warn!("no model-file watch thread ({e}): ready() checks the file itself");
        }
        Ok(Self {
            engine: Arc::new(engine),
            tokenizer,
            chat,
            tool_syntax,
            info,
            weights: None,
            file_watch,
            prompts: PromptPool::start()?,
            grammars: Arc::default(),
        })
    }

    /// Serves the model as `id` instead of its own name (the display name stays the file's
    /// `general.name`).
    ///
    /// ```no_run
    /// # fn f(svc: zerolayer::EngineService) {
    /// let svc = svc.with_model_id("smollm2");
    /// assert_eq!(svc.model_id(), "smollm2");
    /// # }
    /// ```
    pub fn with_model_id(mut self, id: impl Into<String>) -> Self {
        self.info.id = id.into();
        self
    }

    /// The id the model is served as (the only entry of [`models`](InferenceService::models)).
    pub fn model_id(&self) -> &str {
        &self.info.id
    }

    /// Starts a warm-up of the served file's weights in the background (serving goes on) and
    /// keeps `cache` for metrics. Until a `Full` or `Deterministic` warm-up has finished,
    /// [`ready`](InferenceService::ready) is false; `Adaptive` and `None` are ready at once.
    pub fn with_warmup(mut self, cache: WeightCache, strategy: WarmupStrategy) -> Self {
        let gate = matches!(
            strategy,
            WarmupStrategy::Full | WarmupStrategy::Deterministic { .. }
        );
        // A cache over another file (or a second one) only loses the live profile: not fatal.
        if self
            .engine
            .model()
            .attach_weight_cache(cache.clone())
            .is_err()
        {
            tracing::warn!(
                "the weight cache is not over the served model's mapping: no live profile"
            );
        }
        let warm = cache.warm(strategy);
        self.weights = Some(Weights { cache, warm, gate });
        self
    }

    /// Starts a thread that logs the warm-up's progress (every 500 ms after the first second,
    /// and when it is done) and then, with `enforce_budget_every`, releases cold weight blocks
    /// beyond the cache's budget at that interval. It ends with the service (it holds only a
    /// weak reference).
    pub fn watch_weights(
        this: &Arc<Self>,
        enforce_budget_every: Option<std::time::Duration>,
    ) -> std::io::Result<()> {
        use std::time::{Duration, Instant};
        let weak = Arc::downgrade(this);
        let t0 = Instant::now();
        std::thread::Builder::new()
            .name("zerolayer-weights".into())
            .spawn(move || {
                let mut warming = true;
                while let Some(svc) = weak.upgrade() {
                    let Some(w) = &svc.weights else { return };
                    let p = w.warm.progress();
                    if warming {
                        let (done, total) = (p.done_blocks(), p.total_blocks());
                        if p.is_finished() {
                            let ms = p.elapsed().as_millis() as u64;
                            tracing::info!(
                                blocks = total,
                                mib = p.bytes() >> 20,
                                ms,
                                "warm-up done"
                            );
                            warming = false;
                        } else if t0.elapsed() > Duration::from_secs(1) {
                            tracing::info!("warm-up: {done}/{total} blocks");
                        }
                    } else if enforce_budget_every.is_none() {
                        return;
                    } else if let Err(e) = w.cache.enforce_budget() {
                        tracing::warn!("enforcing the weight budget: {e}");
                    }
                    drop(svc);
                    let pause = if warming {
                        Duration::from_millis(500)
                    } else {
                        enforce_budget_every.unwrap_or_default()
                    };
                    std::thread::sleep(pause);
                }
            })?;
        Ok(())
    }

    /// The weight cache given to [`with_warmup`](Self::with_warmup).
    pub fn weight_cache(&self) -> Option<&WeightCache> {
        self.weights.as_ref().map(|w| &w.cache)
    }

    /// The progress of the warm-up started by [`with_warmup`](Self::with_warmup).
    pub fn warmup_progress(&self) -> Option<&weight_cache::WarmupProgress> {
        self.weights.as_ref().map(|w| w.warm.progress())
    }

    /// The change of the served file on disk since it was mapped, if any (see [`FileWatch`]).
    fn file_changed(&self) -> Option<ServiceHealth> {
        let watch = self.file_watch.as_ref()?;
        let change = watch.check(std::time::Instant::now())?;
        let path = watch
            .gguf()
            .path()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        Some(ServiceHealth::ModelFileChanged {
            path,
            detail: change.to_string(),
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<HostedExecutor> {
        &self.engine
    }

    /// Token ids of a prompt (chat prompts through the model's chat template).
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>, ServiceError> {
        self.prompt_parts().tokenize(prompt, None)
    }

    /// How tools reach this model's prompt: natively when its chat template renders them in
    /// the Hermes syntax, else described in the system message.
    pub fn tool_syntax(&self) -> ToolSyntax {
        self.tool_syntax
    }

    /// What tokenizing a prompt and submitting it needs, detached from `self` for the pool.
    fn prompt_parts(&self) -> PromptParts {
        PromptParts {
            engine: self.engine.clone(),
            tokenizer: self.tokenizer.clone(),
            chat: self.chat.clone(),
            tool_syntax: self.tool_syntax,
            grammars: self.grammars.clone(),
        }
    }
}

/// The id a model is served as when none is given: the source's own name
/// ([`WeightSource::model_name`]: `general.name` trimmed, else the file or directory name),
/// else `"model"` (a source with neither).
fn served_model_id(source: &dyn WeightSource) -> String {
    source
        .model_name()
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "model".to_string())
}

/// Queues what the tool-call parser found in one piece of output: text as a `Delta` (the
/// first carrying the piece's token `ids`, which the gateway counts), calls as `ToolCall`s. A
/// piece whose text was all held back still sends its ids in an empty `Delta`.
fn push_tool_events(ready: &mut VecDeque<InferenceEvent>, ids: Vec<u32>, found: Vec<ToolEvent>) {
    let mut ids = Some(ids);
    for ev in found {
        match ev {
            ToolEvent::Text(text) => ready.push_back(InferenceEvent::Delta {
                ids: ids.take().unwrap_or_default(),
                text,
            }),
            ToolEvent::Call(c) => ready.push_back(InferenceEvent::ToolCall {
                name: c.name,
                arguments: c.arguments.to_string(),
            }),
            _ => {}
        }
    }
    if let Some(ids) = ids.filter(|i| !i.is_empty()) {
        ready.push_back(InferenceEvent::Delta {
            ids,
            text: String::new(),
        });
    }
}

impl InferenceService for EngineService {
    fn submit(&self, request: InferenceRequest) -> Result<EventStream, ServiceError> {
        // Nothing is generated from a mapping that no longer matches the file on disk.
        if let Some(ServiceHealth::ModelFileChanged { path, .. }) = self.file_changed() {
            return Err(ServiceError::ModelFileChanged { path });
        }
        request.validate()?;
        let sampling = SamplerConfig::from(&request.sampling);
        let max_tokens = request.max_tokens as usize;
        let (stops, priority, client) = (request.stop_sequences, request.priority, request.client);
        let logprobs = request.logprobs.map(usize::from);
        let tools = request.tools;
        let parts = self.prompt_parts();
        // Compiling the schema is CPU work (the gateway submits such requests from its blocking
        // pool); a refused one names the schema, before anything is enqueued.
        let (constraint, constrained_by) =
            match parts.constraint(request.output_format, tools.as_deref())? {
                Some((c, source)) => (Some(c), Some(source)),
                None => (None, None),
            };
        // Calls are looked for in the output unless the request forbids them.
        let mut calls = tools
            .as_ref()
            .filter(|t| t.choice != ToolChoice::None)
            .map(|_| ToolCallParser::for_syntax(self.tool_syntax));
        let prompt = request.prompt;
        // Tokenizing (and rendering the chat template) is CPU work proportional to the prompt:
        // it runs on the prompt pool; its failures arrive as the stream's first event.
        let (reply, started) = oneshot::channel::<Result<RequestHandle, ServiceError>>();
        self.prompts.try_run(Box::new(move || {
            if reply.is_canceled() {
                return;
            }
            let handle = parts.start(&prompt, tools.as_deref(), |ids| {
                GenerationRequest::new(ids, max_tokens)
                    .with_constraint(constraint)
                    .with_sampling(sampling)
                    .with_stop_sequences(stops)
                    .with_priority(priority)
                    .with_client(client)
                    .with_logprobs(logprobs)
            });
            // A stream dropped meanwhile drops the handle here, which cancels the request.
            let _ = reply.send(handle);
        }))?;
        let mut started = Some(started);
        let mut handle: Option<RequestHandle> = None;
        let mut ready: VecDeque<InferenceEvent> = VecDeque::new();
        let stream = futures::stream::poll_fn(move |cx| {
            loop {
                if let Some(ev) = ready.pop_front() {
                    return Poll::Ready(Some(ev));
                }
                if let Some(pending) = started.as_mut() {
                    let outcome = match pending.poll_unpin(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(r)) => r,
                        Poll::Ready(Err(oneshot::Canceled)) => Err(ServiceError::InvalidRequest {
                            field: "prompt",
                            reason: "tokenizing the prompt failed".into(),
                        }),
                    };
                    started = None;
                    match outcome {
                        Ok(h) => handle = Some(h),
                        Err(e) => {
                            return Poll::Ready(Some(InferenceEvent::Error {
                                code: e.code(),
                                message: e.to_string(),
                            }));
                        }
                    }
                }
                let Some(h) = handle.as_ref() else {
                    return Poll::Ready(None);
                };
                let ev = match h.poll_recv(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(None) => return Poll::Ready(None),
                    Poll::Ready(Some(ev)) => ev,
                };
                // The engine's events are the service's; with tools, the text goes through the
                // tool-call parser (calls become `ToolCall` events, `EndTurn` becomes `ToolUse`).
                match (ev, calls.as_mut()) {
                    (InferenceEvent::Delta { ids, text }, Some(p)) => {
                        let mut found = Vec::new();
                        p.push(&text, &mut found);
                        push_tool_events(&mut ready, ids, found);
                    }
                    (
                        InferenceEvent::Finished {
                            stop_reason,
                            stop_sequence,
                            usage,
                        },
                        Some(p),
                    ) => {
                        let mut found = Vec::new();
                        p.finish(&mut found);
                        push_tool_events(&mut ready, vec![], found);
                        let called = p.calls() > 0 && stop_reason == StopReason::EndTurn;
                        ready.push_back(InferenceEvent::Finished {
                            stop_reason: if called {
                                StopReason::ToolUse
                            } else {
                                stop_reason
                            },
                            stop_sequence,
                            usage,
                        });
                    }
                    // A schema that fails past the first token (the compiler's limits, a
                    // recursion with no way out further in) is the request's fault: name it.
                    (
                        InferenceEvent::Error {
                            code: ErrorCode::InvalidRequest,
                            message,
                        },
                        _,
                    ) => {
                        let message = match constrained_by {
                            Some(source) => format!("{source}: {message}"),
                            None => message,
                        };
                        ready.push_back(InferenceEvent::Error {
                            code: ErrorCode::InvalidRequest,
                            message,
                        });
                    }
                    (ev, _) => ready.push_back(ev),
                }
            }
        });
        Ok(Box::pin(stream))
    }

    fn count_tokens(&self, prompt: &Prompt) -> Result<u32, ServiceError> {
        self.count_tokens_with_tools(prompt, None)
    }

    fn supports_tools(&self) -> bool {
        self.chat.is_some()
    }

    fn count_tokens_with_tools(
        &self,
        prompt: &Prompt,
        tools: Option<&Tools>,
    ) -> Result<u32, ServiceError> {
        let n = self.prompt_parts().tokenize(prompt, tools)?.len();
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    fn models(&self) -> Vec<ModelInfo> {
        vec![self.info.clone()]
    }

    fn metrics(&self) -> ServiceMetrics {
        ServiceMetrics::from(&self.engine.metrics())
    }

    /// False while a gating warm-up runs, and for good once the model file changed on disk
    /// (see [`health`](Self::health)).
    fn ready(&self) -> bool {
        self.health() == ServiceHealth::Ready
    }

    /// [`ServiceHealth::ModelFileChanged`] for good once the model file changed on disk
    /// (truncated, rewritten, replaced or removed: see [`FileWatch`], which logs it once at
    /// error level; checked at most once a second), so `/health` answers 503 naming the file,
    /// new requests are refused and the process can be restarted before a read of a truncated
    /// page kills it. Else `Starting` while a gating warm-up runs.
    fn health(&self) -> ServiceHealth {
        if let Some(change) = self.file_changed() {
            return change;
        }
        let warming = self
            .weights
            .as_ref()
            .is_some_and(|w| w.gate && !w.warm.progress().is_finished());
        if warming {
            ServiceHealth::Starting
        } else {
            ServiceHealth::Ready
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use gpu_pipeline::GgufSource;
    use zerolayer_api::ChatMessage as Msg;
    use zerolayer_api::{ChatRole, OutputFormat, SchemaSource};

    /// The default model, served under its own name with default options.
    fn load_default() -> EngineService {
        load_with(ModelOptions::default())
    }

    fn load_with(options: ModelOptions) -> EngineService {
        let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the model file is not modified while the test runs.
        unsafe { EngineService::load(&path, options, EngineConfig::default()) }.expect("load")
    }

    /// The `general.name` of the default model (SmolLM2-135M-Instruct.Q4_1.gguf).
    const DEFAULT_MODEL_NAME: &str = "Smollm2 135M 8k Lc100K Mix1 Ep2";

    /// A metadata-only GGUF with `general.name` set to `name` (absent for `None`).
    fn gguf_named(name: Option<&str>) -> Vec<u8> {
        let b = weight_cache::GgufBuilder::new().kv_str("general.architecture", "llama");
        match name {
            Some(n) => b.kv_str("general.name", n),
            None => b,
        }
        .build()
    }

    #[test]
    fn model_id_is_the_trimmed_general_name_spaces_inside_kept() {
        let gguf = weight_cache::Gguf::from_bytes(gguf_named(Some("  My Model 7B\n"))).unwrap();
        assert_eq!(served_model_id(&GgufSource(Arc::new(gguf))), "My Model 7B");
    }

    #[test]
    fn model_id_falls_back_to_the_file_name_without_extension_when_the_name_is_blank() {
        for name in [None, Some(""), Some("  \t ")] {
            let path = std::env::temp_dir().join(format!(
                "zerolayer-model-id-{}-{}.Q4_0.gguf",
                std::process::id(),
                name.map_or(0, str::len)
            ));
            std::fs::write(&path, gguf_named(name)).unwrap();
            // SAFETY: the file is this test's own and is not changed while mapped.
            let gguf = unsafe { weight_cache::Gguf::open(&path) }.unwrap();
            let id = served_model_id(&GgufSource(Arc::new(gguf)));
            let _ = std::fs::remove_file(&path);
            let stem = path.file_stem().unwrap().to_str().unwrap();
            assert_eq!(id, stem, "general.name {name:?}");
            assert!(id.ends_with(".Q4_0"), "{id}");
        }
    }

    #[test]
    fn model_id_is_model_for_an_unnamed_in_memory_file() {
        let gguf = weight_cache::Gguf::from_bytes(gguf_named(None)).unwrap();
        assert_eq!(served_model_id(&GgufSource(Arc::new(gguf))), "model");
    }

    #[test]
    fn the_default_model_is_served_under_its_general_name_unless_renamed() {
        let svc = load_default();
        assert_eq!(svc.model_id(), DEFAULT_MODEL_NAME);
        assert_eq!(svc.models().len(), 1);
        assert_eq!(svc.models()[0].id, DEFAULT_MODEL_NAME);
        assert_eq!(svc.models()[0].display_name, DEFAULT_MODEL_NAME);
        let svc = svc.with_model_id("smollm2");
        assert_eq!(svc.model_id(), "smollm2");
        assert_eq!(svc.models()[0].id, "smollm2");
        assert_eq!(svc.models()[0].display_name, DEFAULT_MODEL_NAME);
    }

    #[test]
    fn one_api_keys_prompt_prefix_is_never_reused_for_another_key() {
        // Issue 47: a cache hit answers far faster, so a shared cache would tell key A whether
        // key B sent the prompt A guesses. The gateway puts the key's label in `client`.
        let svc = load_default();
        let secret = || {
            Prompt::Chat(vec![
                Msg::new(
                    ChatRole::System,
                    "The account's recovery code is 48213. Never reveal it to anyone.",
                ),
                Msg::new(ChatRole::User, "What can you do?"),
            ])
        };
        let run = |client: Option<&str>| {
            let mut req = InferenceRequest::new(svc.model_id(), secret(), 1);
            req.client = client.map(str::to_owned);
            let events: Vec<InferenceEvent> =
                futures::executor::block_on(svc.submit(req).expect("submit").collect());
            assert!(
                matches!(events.last(), Some(InferenceEvent::Finished { .. })),
                "{events:?}"
            );
            svc.engine().metrics().prefix_hits
        };
        assert_eq!(run(Some("key-b")), 0);
        assert_eq!(run(Some("key-a")), 0, "key A's guess hit key B's prefix");
        assert_eq!(run(None), 0, "a keyless request hit key B's prefix");
        assert_eq!(run(Some("key-b")), 1, "key B's own prefix is reused");
    }

    #[test]
    fn submit_only_enqueues_and_prompt_errors_arrive_as_the_first_event() {
        let svc = load_default();
        let context = svc.models()[0].context_length as usize;
        let too_long = Prompt::Text("hello ".repeat(context + 16));
        let stream = svc
            .submit(InferenceRequest::new(svc.model_id(), too_long, 8))
            .expect("submit does not tokenize: the context error comes as an event");
        let events: Vec<InferenceEvent> = futures::executor::block_on(stream.collect());
        assert!(
            matches!(
                events.as_slice(),
                [InferenceEvent::Error {
                    code: ErrorCode::ContextLength,
                    ..
                }]
            ),
            "{events:?}"
        );
        let bad_id = Prompt::TokenIds(vec![u32::MAX]);
        let events: Vec<InferenceEvent> = futures::executor::block_on(
            svc.submit(InferenceRequest::new(svc.model_id(), bad_id, 8))
                .unwrap()
                .collect(),
        );
        assert!(
            matches!(
                events.as_slice(),
                [InferenceEvent::Error {
                    code: ErrorCode::InvalidRequest,
                    ..
                }]
            ),
            "{events:?}"
        );
        // A valid prompt still starts (Started first) after its tokenization.
        let ok = Prompt::Text("Hello".into());
        let mut stream = svc
            .submit(InferenceRequest::new(svc.model_id(), ok.clone(), 2))
            .unwrap();
        let first = futures::executor::block_on(stream.next());
        let n = svc.count_tokens(&ok).unwrap();
        assert_eq!(first, Some(InferenceEvent::Started { input_tokens: n }));
    }

    /// The generated ids of a request (panics on an error event).
    fn generated_ids(svc: &EngineService, req: InferenceRequest) -> Vec<u32> {
        run_events(svc, req)
            .iter()
            .flat_map(|e| match e {
                InferenceEvent::Delta { ids, .. } => ids.clone(),
                _ => vec![],
            })
            .collect()
    }

    #[test]
    fn a_seeded_sampled_request_repeats_and_an_unseeded_one_varies() {
        let svc = load_default();
        let prompt = Prompt::Chat(vec![Msg::new(ChatRole::User, "Tell me a story.")]);
        let request = |seed: Option<u64>| {
            let mut r = InferenceRequest::new(svc.model_id(), prompt.clone(), 16);
            r.sampling.temperature = Some(1.0);
            r.sampling.seed = seed;
            r
        };
        let a = generated_ids(&svc, request(Some(7)));
        assert_eq!(a.len(), 16, "{a:?}");
        assert_eq!(a, generated_ids(&svc, request(Some(7))));
        let unseeded: std::collections::HashSet<Vec<u32>> =
            (0..3).map(|_| generated_ids(&svc, request(None))).collect();
        assert!(unseeded.len() > 1, "{unseeded:?}");
        // Penalties reach the engine: a strong presence penalty never repeats a token.
        let mut r = request(Some(1));
        r.sampling.temperature = Some(0.0);
        r.sampling.presence_penalty = Some(1000.0);
        let ids = generated_ids(&svc, r);
        let distinct: std::collections::HashSet<&u32> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len(), "{ids:?}");
    }

    /// The text of a request's deltas and its stop reason (panics on an error event).
    fn generated_text(svc: &EngineService, req: InferenceRequest) -> (String, StopReason) {
        let events: Vec<InferenceEvent> =
            futures::executor::block_on(svc.submit(req).unwrap().collect());
        let Some(InferenceEvent::Finished { stop_reason, .. }) = events.last() else {
            panic!("{events:?}");
        };
        let text = events
            .iter()
            .filter_map(|e| match e {
                InferenceEvent::Delta { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        (text, *stop_reason)
    }

    #[test]
    fn an_output_format_constrains_the_reply_and_a_bad_schema_is_an_invalid_request() {
        let svc = load_default();
        let schema = serde_json::json!({
            "type": "object",
            // Bounded (at most 20 characters and 9 digits): every reply fits in 48 tokens
            // whatever the sampler draws, so the test does not depend on a seed's luck (an
            // unbounded integer can run on for as long as the model keeps drawing digits).
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
            "required": ["city", "population"], "additionalProperties": false,
        });
        for (i, q) in [
            "Name a big city.",
            "Which city is the capital of Japan?",
            "Hi!",
        ]
        .into_iter()
        .enumerate()
        {
            let prompt = Prompt::Chat(vec![Msg::new(ChatRole::User, q)]);
            let mut r = InferenceRequest::new(svc.model_id(), prompt, 48);
            r.sampling.temperature = Some(if i == 0 { 0.0 } else { 1.0 });
            r.sampling.seed = Some(i as u64);
            r.output_format = Some(Arc::new(OutputFormat::JsonSchema(schema.clone())));
            let (text, stop) = generated_text(&svc, r);
            assert_eq!(stop, StopReason::EndTurn, "{text:?}");
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            let o = v.as_object().unwrap();
            assert_eq!(o.len(), 2, "{v}");
            assert!(o["city"].as_str().unwrap().chars().count() <= 20, "{v}");
            assert!(o["population"].as_u64().is_some(), "{v}");
        }
        let prompt = Prompt::Chat(vec![Msg::new(ChatRole::User, "Hi")]);
        let mut r = InferenceRequest::new(svc.model_id(), prompt, 8);
        r.output_format = Some(Arc::new(OutputFormat::JsonSchema(
            serde_json::json!({"type": "no-such-type"}),
        )));
        match svc.submit(r) {
            Err(ServiceError::InvalidSchema {
                schema: SchemaSource::OutputFormat,
                reason,
            }) => assert!(reason.contains("no-such-type"), "{reason}"),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a bad schema was accepted"),
        }
    }

    /// The events of a request (panics unless it finished).
    fn run_events(svc: &EngineService, req: InferenceRequest) -> Vec<InferenceEvent> {
        let events: Vec<InferenceEvent> =
            futures::executor::block_on(svc.submit(req).unwrap().collect());
        assert!(
            matches!(events.last(), Some(InferenceEvent::Finished { .. })),
            "{events:?}"
        );
        events
    }

    fn weather_tools(choice: ToolChoice) -> Arc<Tools> {
        use zerolayer_api::ToolDefinition;
        let weather = serde_json::json!({
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": false,
        });
        Arc::new(
            Tools::new(vec![
                ToolDefinition::new("get_weather", weather).with_description("Current weather"),
                ToolDefinition::new("get_time", serde_json::json!({"type": "object"})),
            ])
            .with_choice(choice),
        )
    }

    #[test]
    fn a_forced_tool_call_is_valid_for_its_schema_and_its_result_is_taken_in_the_next_turn() {
        let svc = load_default();
        // SmolLM2's template has no tool support: the tools go into the system message.
        assert_eq!(svc.tool_syntax(), ToolSyntax::HermesPolyfill);
        for (i, q) in ["What is the weather in Paris?", "Is it cold in Oslo today?"]
            .into_iter()
            .enumerate()
        {
            let prompt = Prompt::Chat(vec![Msg::new(ChatRole::User, q)]);
            let mut r = InferenceRequest::new(svc.model_id(), prompt, 64);
            r.sampling.temperature = Some(if i == 0 { 0.0 } else { 1.0 });
            r.sampling.seed = Some(i as u64);
            r.tools = Some(weather_tools(ToolChoice::Named("get_weather".into())));
            let events = run_events(&svc, r);
            let calls: Vec<(&str, serde_json::Value)> = events
                .iter()
                .filter_map(|e| match e {
                    InferenceEvent::ToolCall { name, arguments } => {
                        Some((name.as_str(), serde_json::from_str(arguments).unwrap()))
                    }
                    _ => None,
                })
                .collect();
            assert_eq!(calls.len(), 1, "{events:?}");
            let (name, args) = &calls[0];
            assert_eq!(*name, "get_weather");
            assert!(
                args["city"].as_str().unwrap().chars().count() <= 30,
                "{args}"
            );
            assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
            let Some(InferenceEvent::Finished {
                stop_reason, usage, ..
            }) = events.last()
            else {
                unreachable!()
            };
            assert_eq!(*stop_reason, StopReason::ToolUse);
            // The call's tokens are counted though its text is not sent.
            let ids: usize = events
                .iter()
                .map(|e| match e {
                    InferenceEvent::Delta { ids, .. } => ids.len(),
                    _ => 0,
                })
                .sum();
            assert_eq!(ids as u32, usage.output_tokens);
        }
        // The next turn: the call and its result are in the prompt, the answer is text.
        let call = zerolayer_api::ToolCallMessage::new(
            "call_1",
            "get_weather",
            serde_json::json!({"city": "Paris", "unit": "celsius"}),
        );
        let turns = vec![
            Msg::new(ChatRole::User, "What is the weather in Paris?"),
            Msg::new(ChatRole::Assistant, "").with_tool_calls(vec![call]),
            Msg::new(ChatRole::Tool, "{\"temperature\": 21, \"sky\": \"sunny\"}")
                .with_tool_result("call_1", "get_weather"),
        ];
        let tools = weather_tools(ToolChoice::None);
        let ids = svc
            .prompt_parts()
            .tokenize(&Prompt::Chat(turns.clone()), Some(&tools))
            .unwrap();
        let text = svc.tokenizer.decode(&ids).unwrap();
        assert!(
            text.contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\""),
            "{text}"
        );
        assert!(
            text.contains(
                "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\""
            ),
            "{text}"
        );
        assert!(
            text.contains("<|im_start|>user\n<tool_response>\n{\"temperature\": 21"),
            "{text}"
        );
        let counted = svc
            .count_tokens_with_tools(&Prompt::Chat(turns.clone()), Some(&tools))
            .unwrap();
        assert_eq!(counted as usize, ids.len());
        assert!(counted > svc.count_tokens(&Prompt::Chat(turns.clone())).unwrap());
        let mut r = InferenceRequest::new(svc.model_id(), Prompt::Chat(turns), 24);
        r.tools = Some(tools);
        let events = run_events(&svc, r);
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, InferenceEvent::ToolCall { .. })),
            "tool_choice none: {events:?}"
        );
        // A forced call of a tool that is not offered is refused at once.
        let mut r = InferenceRequest::new(svc.model_id(), Prompt::Text("x".into()), 4);
        r.tools = Some(weather_tools(ToolChoice::Named("nope".into())));
        assert!(matches!(
            svc.submit(r),
            Err(ServiceError::InvalidRequest {
                field: "tool_choice",
                ..
            })
        ));
    }

    #[test]
    fn logprobs_come_before_their_tokens_and_match_the_greedy_choice() {
        let svc = load_default();
        let prompt = Prompt::Chat(vec![Msg::new(
            ChatRole::User,
            "What is the capital of France?",
        )]);
        let mut r = InferenceRequest::new(svc.model_id(), prompt, 8);
        r.logprobs = Some(3);
        let events: Vec<InferenceEvent> =
            futures::executor::block_on(svc.submit(r).unwrap().collect());
        let mut pending: Vec<zerolayer_api::TokenLogprob> = Vec::new();
        let mut seen = 0;
        for e in &events {
            match e {
                InferenceEvent::Logprobs(lp) => pending.extend(lp.iter().cloned()),
                InferenceEvent::Delta { ids, .. } if !ids.is_empty() => {
                    let got: Vec<u32> = pending.iter().map(|t| t.id).collect();
                    assert_eq!(&got, ids);
                    for t in pending.drain(..) {
                        assert_eq!(t.top.len(), 3);
                        // greedy: the sampled token is the most likely one
                        assert_eq!(t.top[0].0, t.id);
                        assert_eq!(t.top[0].2, t.logprob);
                        assert!(t.top.windows(2).all(|w| w[0].2 >= w[1].2));
                        assert!(t.logprob <= 0.0);
                        let mass: f32 = t.top.iter().map(|x| x.2.exp()).sum();
                        assert!(mass <= 1.0 + 1e-5, "{mass}");
                        assert_eq!(t.bytes, svc.tokenizer.token_bytes(t.id).unwrap());
                        seen += 1;
                    }
                }
                _ => {}
            }
        }
        assert_eq!(seen, 8);
    }

    #[test]
    fn chat_request_streams_text_and_usage_from_the_real_model() {
        // Weights read from the file (not packed), so the attached weight cache sees every read.
        let svc = load_with(ModelOptions::default().with_packing(gpu_pipeline::WeightPacking::Off));
        let gguf = svc.engine().model().gguf().expect("a GGUF model").clone();
        let cache = WeightCache::new(gguf, Default::default()).expect("block table");
        let svc = svc.with_warmup(cache, WarmupStrategy::Full);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !svc.ready() {
            assert!(
                std::time::Instant::now() < deadline,
                "the full warm-up never finished"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let progress = svc.warmup_progress().unwrap();
        assert_eq!(progress.done_blocks(), progress.total_blocks());
        assert!(progress.total_blocks() > 0);
        let prompt = Prompt::Chat(vec![Msg::new(
            ChatRole::User,
            "What is the capital of France?",
        )]);
        let n = svc.count_tokens(&prompt).unwrap();
        let events: Vec<InferenceEvent> = futures::executor::block_on(
            svc.submit(InferenceRequest::new(svc.model_id(), prompt.clone(), 8))
                .unwrap()
                .collect(),
        );
        assert_eq!(events[0], InferenceEvent::Started { input_tokens: n });
        let text: String = events
            .iter()
            .filter_map(|e| match e {
                InferenceEvent::Delta { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        // The greedy answer is llama.cpp's (llama-cpp-python 0.3.36 on the same file, from the
        // committed teacher fixture): this 135M model at Q4_1 does not say "Paris" here.
        // Read at run time: the file is gpu-pipeline's, in the repository, not in this package.
        let teacher = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/crates/gpu-pipeline/tests/fixtures/model-teacher.json"
        );
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(teacher).expect(teacher)).unwrap();
        let seq = &fixture["sequences"][0];
        assert_eq!(seq["prompt"], "What is the capital of France?");
        let ids_of = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let (prompt_ids, all_ids) = (ids_of(&seq["prompt_ids"]), ids_of(&seq["ids"]));
        assert_eq!(svc.tokenize(&prompt).unwrap(), prompt_ids);
        let ours: Vec<u32> = events
            .iter()
            .flat_map(|e| match e {
                InferenceEvent::Delta { ids, .. } => ids.clone(),
                _ => vec![],
            })
            .collect();
        assert_eq!(ours, all_ids[prompt_ids.len()..prompt_ids.len() + 8]);
        assert!(text.starts_with("L'\u{c9}toile"), "{text:?}");
        assert!(matches!(
            events.last(),
            Some(InferenceEvent::Finished { .. })
        ));
        assert!(svc.metrics().generated_tokens > 0);
        // The forward passes touched the attached cache (touch counts, and mincore checks that
        // found the fully warmed file resident).
        let stats = svc.weight_cache().unwrap().stats();
        assert!(stats.touches >= 30 * 8, "{stats:?}");
        assert_eq!(stats.hit_rate, Some(1.0), "{stats:?}");
        assert_eq!(svc.metrics().weight_cache_hit_rate, 1.0);
        let err = svc.submit(InferenceRequest::new(
            svc.model_id(),
            Prompt::Text("x".into()),
            0,
        ));
        assert!(matches!(
            err,
            Err(ServiceError::InvalidRequest {
                field: "max_tokens",
                ..
            })
        ));
    }
}
