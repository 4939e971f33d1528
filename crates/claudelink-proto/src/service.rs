//! The boundary between the protocol/gateway layer and an inference engine.
//!
//! Everything the transports need from a model goes through [`InferenceService`]. Implementations
//! must be cheap to call from async code: [`InferenceService::submit`] only enqueues work and
//! returns at once; tokens arrive through the returned [`EventStream`]. Dropping the stream
//! cancels the request and frees its resources (KV cache, batch slot).

use std::pin::Pin;

use futures::Stream;

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChatRole {
    /// The system prompt.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// The result of a tool call (Anthropic `tool_result` blocks, OpenAI role `tool`).
    Tool,
}

/// One chat turn, with its text content already flattened (content blocks joined).
///
/// ```
/// use claudelink_proto::{ChatMessage, ChatRole, ToolCallMessage};
/// let call = ToolCallMessage::new("toolu_1", "weather", serde_json::json!({"city": "Oslo"}));
/// let asked = ChatMessage::new(ChatRole::Assistant, "").with_tool_calls(vec![call]);
/// let answer = ChatMessage::new(ChatRole::Tool, "-3 C").with_tool_result("toolu_1", "weather");
/// assert_eq!(answer.tool_call_id.as_deref(), Some("toolu_1"));
/// assert_eq!(asked.tool_calls[0].name, "weather");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChatMessage {
    /// Author of the turn.
    pub role: ChatRole,
    /// Text of the turn.
    pub content: String,
    /// Tool calls the (assistant) turn made.
    pub tool_calls: Vec<ToolCallMessage>,
    /// For a [`ChatRole::Tool`] turn: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// For a [`ChatRole::Tool`] turn: the name of the tool that was called.
    pub tool_name: Option<String>,
}

impl ChatMessage {
    /// A turn of `role` with this text.
    ///
    /// ```
    /// use claudelink_proto::{ChatMessage, ChatRole};
    /// let m = ChatMessage::new(ChatRole::User, "hi");
    /// assert!(m.tool_calls.is_empty());
    /// ```
    pub fn new(role: ChatRole, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
        }
    }

    /// The same turn with these tool calls.
    ///
    /// ```
    /// use claudelink_proto::{ChatMessage, ChatRole, ToolCallMessage};
    /// let c = ToolCallMessage::new("id", "f", serde_json::json!({}));
    /// assert_eq!(ChatMessage::new(ChatRole::Assistant, "").with_tool_calls(vec![c]).tool_calls.len(), 1);
    /// ```
    pub fn with_tool_calls(mut self, calls: Vec<ToolCallMessage>) -> Self {
        self.tool_calls = calls;
        self
    }

    /// The same turn as the result of call `id` of tool `name`.
    ///
    /// ```
    /// use claudelink_proto::{ChatMessage, ChatRole};
    /// let m = ChatMessage::new(ChatRole::Tool, "42").with_tool_result("call_1", "f");
    /// assert_eq!(m.tool_name.as_deref(), Some("f"));
    /// ```
    pub fn with_tool_result(mut self, id: impl Into<String>, name: impl Into<String>) -> Self {
        self.tool_call_id = Some(id.into());
        self.tool_name = Some(name.into());
        self
    }
}

/// A tool call made by an earlier assistant turn.
///
/// ```
/// let c = claudelink_proto::ToolCallMessage::new("toolu_1", "f", serde_json::json!({"x": 1}));
/// assert_eq!(c.arguments["x"], 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToolCallMessage {
    /// The call's id (Anthropic `tool_use.id`, OpenAI `tool_calls[].id`).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments (a JSON object).
    pub arguments: serde_json::Value,
}

impl ToolCallMessage {
    /// A call of tool `name` with these arguments.
    ///
    /// ```
    /// let c = claudelink_proto::ToolCallMessage::new("id", "f", serde_json::json!({}));
    /// assert_eq!(c.name, "f");
    /// ```
    pub fn new(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: serde_json::Value,
    ) -> Self {
        Self {
            id: id.into(),
            name: name.into(),
            arguments,
        }
    }
}

/// The tools a request offers the model, and whether it must use one.
///
/// ```
/// use claudelink_proto::{ToolChoice, ToolDefinition, Tools};
/// let t = Tools::new(vec![ToolDefinition::new("now", serde_json::json!({"type": "object"}))])
///     .with_choice(ToolChoice::Any);
/// assert_eq!(t.choice, ToolChoice::Any);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Tools {
    /// The tools (at least one).
    pub tools: Vec<ToolDefinition>,
    /// Whether and which tool the model must call.
    pub choice: ToolChoice,
}

impl Tools {
    /// These tools, the model choosing whether to call one ([`ToolChoice::Auto`]).
    ///
    /// ```
    /// let t = claudelink_proto::Tools::new(vec![]);
    /// assert_eq!(t.choice, claudelink_proto::ToolChoice::Auto);
    /// ```
    pub fn new(tools: Vec<ToolDefinition>) -> Self {
        Self {
            tools,
            choice: ToolChoice::Auto,
        }
    }

    /// The same tools with this choice.
    ///
    /// ```
    /// use claudelink_proto::{ToolChoice, Tools};
    /// assert_eq!(Tools::new(vec![]).with_choice(ToolChoice::None).choice, ToolChoice::None);
    /// ```
    pub fn with_choice(mut self, choice: ToolChoice) -> Self {
        self.choice = choice;
        self
    }
}

/// One tool: its name, what it does and the JSON Schema of its input.
///
/// ```
/// let t = claudelink_proto::ToolDefinition::new("now", serde_json::json!({"type": "object"}))
///     .with_description("The current time");
/// assert_eq!(t.description.as_deref(), Some("The current time"));
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ToolDefinition {
    /// The name the model calls it by.
    pub name: String,
    /// What it does (shown to the model).
    pub description: Option<String>,
    /// JSON Schema of its arguments.
    pub parameters: serde_json::Value,
}

impl ToolDefinition {
    /// A tool `name` taking arguments valid for `parameters`.
    ///
    /// ```
    /// let t = claudelink_proto::ToolDefinition::new("f", serde_json::json!({}));
    /// assert!(t.description.is_none());
    /// ```
    pub fn new(name: impl Into<String>, parameters: serde_json::Value) -> Self {
        Self {
            name: name.into(),
            description: None,
            parameters,
        }
    }

    /// The same tool with this description.
    ///
    /// ```
    /// let t = claudelink_proto::ToolDefinition::new("f", serde_json::json!({})).with_description("d");
    /// assert_eq!(t.description.as_deref(), Some("d"));
    /// ```
    pub fn with_description(mut self, description: impl Into<String>) -> Self {
        self.description = Some(description.into());
        self
    }
}

/// Whether the model must call a tool (Anthropic `tool_choice.type`, OpenAI `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolChoice {
    /// The model decides (`auto`).
    Auto,
    /// The model must call one of the tools (Anthropic `any`, OpenAI `required`): decoding is
    /// constrained to a call.
    Any,
    /// The model must call this tool: decoding is constrained to a call of it.
    Named(String),
    /// The tools are shown but the model must not call one (`none`).
    None,
}

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Prompt {
    /// Raw text, tokenized as is (no chat template). Special-token text stays plain text.
    Text(String),
    /// Chat turns; the service applies the model's chat template with a generation prompt.
    /// A trailing assistant message is a prefill that the answer continues.
    Chat(Vec<ChatMessage>),
    /// Token ids fed to the model unchanged.
    TokenIds(Vec<u32>),
}

/// Sampling parameters. `None` means "the service's default" (greedy when all are `None`).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// Softmax temperature; `0.0` means greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: Option<f32>,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<u32>,
    /// Drop tokens whose probability is below `min_p` times the top probability.
    pub min_p: Option<f32>,
    /// Repetition penalty (1.0 = none).
    pub repetition_penalty: Option<f32>,
    /// OpenAI frequency penalty: subtracted once per earlier occurrence in the output.
    pub frequency_penalty: Option<f32>,
    /// OpenAI presence penalty: subtracted once from every token already in the output.
    pub presence_penalty: Option<f32>,
    /// Seed making a sampled run reproducible; `None` with a temperature above zero: a
    /// random seed per request.
    pub seed: Option<u64>,
}

/// Weight-cache warm-up hint carried by a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CacheStrategy {
    /// Warm from the recorded profile (the default).
    #[default]
    Deterministic,
    /// Learn from live accesses.
    Adaptive,
}

/// A request for one generation.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct InferenceRequest {
    /// Model name as the client sent it (the service may ignore it if it serves one model).
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Hard cap on generated tokens.
    pub max_tokens: u32,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Generation stops when the output text contains one of these.
    pub stop_sequences: Vec<String>,
    /// Warm-up hint.
    pub cache_strategy: CacheStrategy,
    /// Scheduling priority (higher first; 0 is normal).
    pub priority: i32,
    /// Who sent the request: a stable label of the API key that authenticated it (see
    /// [`key_label`](crate::key_label); never the key itself), or `None` on a server without
    /// keys. Engines use it for per-client limits and fairness between clients.
    pub client: Option<String>,
    /// `Some(n)`: the service sends an [`InferenceEvent::Logprobs`] before each `Delta` that
    /// carries tokens, with the `n` most likely alternatives of each token (not carried over
    /// claudelink, whose servers never send them).
    pub logprobs: Option<u8>,
    /// `Some`: the output is constrained to this format by constrained decoding (the engine
    /// masks every token that would leave it). Not carried over claudelink: encoding a
    /// request that sets it fails with [`EncodeError::NotCarried`](crate::EncodeError).
    pub output_format: Option<std::sync::Arc<OutputFormat>>,
    /// `Some`: the tools the model may (or must) call; its calls arrive as
    /// [`InferenceEvent::ToolCall`]s. Not carried over claudelink.
    pub tools: Option<std::sync::Arc<Tools>>,
}

/// The language a constrained output must belong to.
///
/// ```
/// use claudelink_proto::OutputFormat;
/// let f = OutputFormat::JsonSchema(serde_json::json!({"type": "object"}));
/// assert!(matches!(f, OutputFormat::JsonSchema(_)));
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum OutputFormat {
    /// JSON that validates against this JSON Schema (`{"type": "object"}` for any object).
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression.
    Regex(String),
    /// Text of this Lark grammar (llguidance's dialect).
    Lark(String),
}

impl InferenceRequest {
    /// A greedy request with no stop sequences.
    ///
    /// ```
    /// use claudelink_proto::{InferenceRequest, Prompt};
    /// let r = InferenceRequest::new("smollm2", Prompt::Text("Hello".into()), 16);
    /// assert_eq!(r.max_tokens, 16);
    /// ```
    pub fn new(model: impl Into<String>, prompt: Prompt, max_tokens: u32) -> Self {
        Self {
            model: model.into(),
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_sequences: Vec::new(),
            cache_strategy: CacheStrategy::default(),
            priority: 0,
            client: None,
            logprobs: None,
            output_format: None,
            tools: None,
        }
    }
}

/// Why a generation ended (the Anthropic API's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The model emitted an end-of-turn / EOS token.
    EndTurn,
    /// `max_tokens` was reached.
    MaxTokens,
    /// A stop sequence matched.
    StopSequence,
    /// The model called a tool (its calls were sent as [`InferenceEvent::ToolCall`]s).
    ToolUse,
}

impl StopReason {
    /// The wire string (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EndTurn => "end_turn",
            Self::MaxTokens => "max_tokens",
            Self::StopSequence => "stop_sequence",
            Self::ToolUse => "tool_use",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
}

/// Error classes shared by the protocol, the gateway and the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The request is malformed or asks for something invalid.
    InvalidRequest,
    /// The prompt does not fit the context.
    ContextLength,
    /// The named model is not served here.
    NotFound,
    /// The server is at capacity; retry later or elsewhere.
    Overloaded,
    /// The request was cancelled.
    Cancelled,
    /// The request took too long.
    Timeout,
    /// A bug or failure inside the server.
    Internal,
    /// The server is shutting down (its drain deadline passed): retry on another server.
    ShuttingDown,
}

/// One event of a running request, in order: `Started`, zero or more `Delta`, then exactly one of
/// `Finished` or `Error`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum InferenceEvent {
    /// The prompt was accepted and tokenized.
    Started {
        /// Prompt length in tokens.
        input_tokens: u32,
    },
    /// New output tokens and the complete UTF-8 text they finished.
    Delta {
        /// Token ids generated since the last delta.
        ids: Vec<u32>,
        /// Text made complete by these tokens (may be empty when a character is split).
        text: String,
    },
    /// A tool call the model made, complete (only for requests with
    /// [`InferenceRequest::tools`]). The text of the call is not sent as a `Delta` (its tokens
    /// are: in `Delta`s with empty text). The gateway gives each call its id.
    ToolCall {
        /// The tool's name.
        name: String,
        /// The arguments as JSON text (an object).
        arguments: String,
    },
    /// The log-probabilities of the tokens of the next `Delta`, in order (only when the
    /// request asked for them: [`InferenceRequest::logprobs`]).
    Logprobs(Vec<TokenLogprob>),
    /// The generation ended.
    Finished {
        /// Why.
        stop_reason: StopReason,
        /// The stop sequence that matched, if any.
        stop_sequence: Option<String>,
        /// Token counts.
        usage: Usage,
    },
    /// The generation failed.
    Error {
        /// Error class.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

/// One generated token's log-probability (natural log, under the model's distribution before
/// penalties and temperature) and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's id.
    pub id: u32,
    /// Its bytes as the tokenizer decodes them (may be part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens at this position: (id, bytes, log-probability), most likely
    /// first.
    pub top: Vec<(u32, Vec<u8>, f32)>,
}

/// The events of one request. Dropping it cancels the request.
pub type EventStream = Pin<Box<dyn Stream<Item = InferenceEvent> + Send + 'static>>;

/// Why a request could not be submitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// Queue or KV budget full; retry after the hint.
    #[error("overloaded; retry after {retry_after_ms} ms")]
    Overloaded {
        /// Suggested wait before retrying.
        retry_after_ms: u64,
    },
    /// The prompt plus `max_tokens` do not fit the model's context.
    #[error("prompt of {prompt_tokens} tokens does not fit the context of {limit} tokens")]
    ContextLength {
        /// Prompt length in tokens.
        prompt_tokens: u32,
        /// The limit that was exceeded.
        limit: u32,
    },
    /// A field has an invalid value.
    #[error("invalid value for `{field}`: {reason}")]
    InvalidRequest {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The service is shutting down.
    #[error("the service is shutting down")]
    ShuttingDown,
    /// A JSON Schema the output is constrained to cannot be used: the compiler refused it, or
    /// it cannot constrain the first token (a recursion with no way out, too many
    /// alternatives).
    #[error("{schema}: {reason}")]
    InvalidSchema {
        /// Which schema of the request.
        schema: SchemaSource,
        /// What is wrong with it, fit for the client (the compiler's summary, no internals).
        reason: String,
    },
    /// The model file changed on disk since it was mapped ([`ServiceHealth::ModelFileChanged`]):
    /// nothing is generated from a mapping that no longer matches the file until the process is
    /// restarted. Its [`code`](Self::code) is [`ErrorCode::ShuttingDown`]: retry on another
    /// server.
    #[error(
        "the model file {} changed on disk after it was loaded: restart the server",
        path.display()
    )]
    ModelFileChanged {
        /// The file.
        path: std::path::PathBuf,
    },
}

/// Whether a service can serve, as `/health` reports it ([`InferenceService::health`]).
///
/// ```
/// use claudelink_proto::ServiceHealth;
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

/// Which schema of a request a [`ServiceError::InvalidSchema`] is about (the gateway names the
/// request field it came from).
///
/// ```
/// use claudelink_proto::SchemaSource;
/// assert_eq!(SchemaSource::Tool(2).to_string(), "tools.2");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaSource {
    /// [`InferenceRequest::output_format`].
    OutputFormat,
    /// The input schema of the tool at this index of [`Tools::tools`], whose call is forced.
    Tool(usize),
    /// The tools' schemas together (a call of any of them is forced): each one compiles alone,
    /// their union does not.
    Tools,
}

impl std::fmt::Display for SchemaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::OutputFormat => f.write_str("output_format"),
            Self::Tool(i) => write!(f, "tools.{i}"),
            Self::Tools => f.write_str("tools"),
        }
    }
}

impl ServiceError {
    /// The protocol error class of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Overloaded { .. } | Self::ShuttingDown => ErrorCode::Overloaded,
            Self::ModelFileChanged { .. } => ErrorCode::ShuttingDown,
            Self::ContextLength { .. } => ErrorCode::ContextLength,
            Self::InvalidRequest { .. } | Self::InvalidSchema { .. } => ErrorCode::InvalidRequest,
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
}

/// An inference engine as the transports see it.
///
/// ```
/// use claudelink_proto::*;
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
