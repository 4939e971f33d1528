//! The service: the trait an engine implements for the transports, and what it reports.

use crate::{EventStream, InferenceRequest, Prompt, ServiceError, Tools};

/// An inference engine as the transports see it.
///
/// ```
/// use zerolayer_api::*;
/// use futures::stream;
///
/// /// Echoes the prompt back, one word per delta.
/// struct Echo;
/// impl InferenceService for Echo {
///     fn submit(&self, req: InferenceRequest) -> Result<EventStream, ServiceError> {
///         let Prompt::Text(text) = req.prompt else {
///             return Err(ServiceError::InvalidRequest { field: "prompt", reason: "text only".into() });
///         };
///         let words: Vec<String> = text.split(' ').map(str::to_owned).collect();
///         let n = words.len() as u32;
///         let mut events = vec![InferenceEvent::Started { input_tokens: n }];
///         events.extend(words.into_iter().map(|w| InferenceEvent::Delta { ids: vec![], text: w }));
///         events.push(InferenceEvent::Finished {
///             stop_reason: StopReason::EndTurn,
///             stop_sequence: None,
///             usage: Usage { input_tokens: n, output_tokens: n },
///         });
///         Ok(Box::pin(stream::iter(events)))
///     }
///     fn count_tokens(&self, prompt: &Prompt) -> Result<u32, ServiceError> {
///         Ok(match prompt { Prompt::Text(t) => t.split(' ').count() as u32, _ => 0 })
///     }
///     fn models(&self) -> Vec<ModelInfo> {
///         vec![ModelInfo { id: "echo".into(), display_name: "Echo".into(), context_length: 2048 }]
///     }
///     fn metrics(&self) -> ServiceMetrics { ServiceMetrics::default() }
/// }
/// let s = Echo;
/// assert_eq!(s.count_tokens(&Prompt::Text("a b".into())).unwrap(), 2);
/// ```
pub trait InferenceService: Send + Sync + 'static {
    /// Enqueue a request. Returns at once; `Err` means it was refused (nothing was enqueued).
    fn submit(&self, request: InferenceRequest) -> Result<EventStream, ServiceError>;
    /// Number of tokens the prompt would use (with the chat template applied for chat prompts).
    fn count_tokens(&self, prompt: &Prompt) -> Result<u32, ServiceError>;
    /// Whether requests may offer tools ([`InferenceRequest::tools`]); the gateway answers 400
    /// to tools sent to a service that does not take them. The default is `false`.
    fn supports_tools(&self) -> bool {
        false
    }
    /// Number of tokens the prompt would use with these tools offered (their definitions are
    /// part of the prompt). The default refuses tools, for services that do not take them.
    fn count_tokens_with_tools(
        &self,
        prompt: &Prompt,
        tools: Option<&Tools>,
    ) -> Result<u32, ServiceError> {
        match tools {
            None => self.count_tokens(prompt),
            Some(_) => Err(ServiceError::InvalidRequest {
                field: "tools",
                reason: "this service does not take tools".into(),
            }),
        }
    }
    /// The models served.
    fn models(&self) -> Vec<ModelInfo>;
    /// Current metrics.
    fn metrics(&self) -> ServiceMetrics;
    /// Whether the service is ready to serve (weights mapped, warm-up far enough).
    fn ready(&self) -> bool {
        true
    }
    /// What `/health` reports. The default: [`ServiceHealth::Ready`] when
    /// [`ready`](Self::ready), else [`ServiceHealth::Starting`]; a service that can tell why it
    /// is not ready says so here (and keeps `ready` false in those cases).
    fn health(&self) -> ServiceHealth {
        if self.ready() {
            ServiceHealth::Ready
        } else {
            ServiceHealth::Starting
        }
    }
}

/// A model the service serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// Id clients put in `model`.
    pub id: String,
    /// Human-readable name.
    pub display_name: String,
    /// Context length in tokens.
    pub context_length: u32,
}

/// Whether a service can serve, as `/health` reports it ([`InferenceService::health`]).
///
/// ```
/// use zerolayer_api::ServiceHealth;
/// let h = ServiceHealth::ModelFileChanged {
///     path: "/m/model.gguf".into(),
///     detail: "model file /m/model.gguf was modified while mapped".into(),
/// };
/// assert_ne!(h, ServiceHealth::Ready);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServiceHealth {
    /// Serving.
    Ready,
    /// Not ready yet (a gating warm-up runs); requests are still taken.
    Starting,
    /// The model file changed on disk since it was mapped (rewritten in place, truncated,
    /// replaced or removed): the mapping no longer matches the file, new generations are
    /// refused ([`ServiceError::ModelFileChanged`]) until the process is restarted.
    ModelFileChanged {
        /// The file.
        path: std::path::PathBuf,
        /// What changed, in words (size, modification time, replacement, removal).
        detail: String,
    },
}

/// A point-in-time snapshot of service metrics, for `/metrics` and debug headers.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ServiceMetrics {
    /// Requests waiting for admission to the batch.
    pub queue_depth: u64,
    /// Sequences currently in the batch.
    pub running: u64,
    /// Generated tokens since start.
    pub generated_tokens: u64,
    /// Prompt tokens processed since start.
    pub prompt_tokens: u64,
    /// KV-cache bytes in use.
    pub kv_bytes_used: u64,
    /// KV-cache budget in bytes.
    pub kv_bytes_budget: u64,
    /// Weight-cache hit rate in [0, 1] (first touches that found the block resident).
    pub weight_cache_hit_rate: f64,
    /// Mixture-of-experts models: fraction of the chosen experts' weight blocks found resident
    /// in [0, 1] (0 for dense models or without a weight cache).
    pub expert_hit_rate: f64,
    /// Bytes read from storage per token processed (page-cache misses of the weights; 0 where
    /// not measured).
    pub weight_read_bytes_per_token: f64,
    /// Prefix-cache hits (prompt tokens reused) since start.
    pub prefix_cache_hit_tokens: u64,
    /// Speculative decoding: draft tokens verified since start.
    pub draft_tokens: u64,
    /// Speculative decoding: draft tokens accepted since start (acceptance rate: this over
    /// `draft_tokens`).
    pub accepted_draft_tokens: u64,
    /// Speculative decoding: of the draft tokens, those n-gram lookup proposed (all of them
    /// with `--speculate ngram`; with a draft model, its lookup-first drafts).
    pub lookup_draft_tokens: u64,
    /// Sequence steps that emitted tokens since start (tokens per target step:
    /// `generated_tokens` over this).
    pub sampled_steps: u64,
}
