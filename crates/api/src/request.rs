//! Requests: what a client asks for, validated once, where outside data becomes these values.

use std::sync::Arc;

use crate::ServiceError;

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
    /// Who sent the request: a stable label of the API key that authenticated it (claudelink's
    /// `key_label`; never the key itself), or `None` on a server without keys. Engines use it for per-client limits and fairness between clients.
    pub client: Option<String>,
    /// `Some(n)`: the service sends an [`InferenceEvent::Logprobs`](crate::InferenceEvent::Logprobs) before each `Delta` that
    /// carries tokens, with the `n` most likely alternatives of each token (not carried over
    /// claudelink, whose servers never send them).
    pub logprobs: Option<u8>,
    /// `Some`: the output is constrained to this format by constrained decoding (the engine
    /// masks every token that would leave it). Not carried over claudelink: encoding a
    /// request that sets it fails with claudelink's `EncodeError::NotCarried`.
    pub output_format: Option<Arc<OutputFormat>>,
    /// `Some`: the tools the model may (or must) call; its calls arrive as
    /// [`InferenceEvent::ToolCall`](crate::InferenceEvent::ToolCall)s. Not carried over claudelink.
    pub tools: Option<Arc<Tools>>,
}

impl InferenceRequest {
    /// A greedy request with no stop sequences.
    ///
    /// ```
    /// use zerolayer_api::{InferenceRequest, Prompt};
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

    /// Checks what every service needs of a request, whatever transport brought it: at
    /// least one token to generate, and sampling parameters a sampler can use
    /// ([`SamplingParams::validate`]). The error names the field.
    ///
    /// ```
    /// use zerolayer_api::{InferenceRequest, Prompt, ServiceError};
    /// let mut r = InferenceRequest::new("m", Prompt::Text("Hello".into()), 16);
    /// assert_eq!(r.validate(), Ok(()));
    /// r.max_tokens = 0;
    /// let Err(ServiceError::InvalidRequest { field, .. }) = r.validate() else { panic!() };
    /// assert_eq!(field, "max_tokens");
    /// ```
    pub fn validate(&self) -> Result<(), ServiceError> {
        if self.max_tokens == 0 {
            return Err(ServiceError::InvalidRequest {
                field: "max_tokens",
                reason: "must be at least 1".into(),
            });
        }
        self.sampling.validate()
    }
}

/// What the model is asked to continue.
///
/// Exhaustive on purpose: every transport maps each variant to its wire form, so a new one
/// must fail their builds until it is carried.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Raw text, tokenized as is (no chat template). Special-token text stays plain text.
    Text(String),
    /// Chat turns; the service applies the model's chat template with a generation prompt.
    /// A trailing assistant message is a prefill that the answer continues.
    Chat(Vec<ChatMessage>),
    /// Token ids fed to the model unchanged.
    TokenIds(Vec<u32>),
}

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
/// use zerolayer_api::{ChatMessage, ChatRole, ToolCallMessage};
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
    /// use zerolayer_api::{ChatMessage, ChatRole};
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
    /// use zerolayer_api::{ChatMessage, ChatRole, ToolCallMessage};
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
    /// use zerolayer_api::{ChatMessage, ChatRole};
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
/// let c = zerolayer_api::ToolCallMessage::new("toolu_1", "f", serde_json::json!({"x": 1}));
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
    /// let c = zerolayer_api::ToolCallMessage::new("id", "f", serde_json::json!({}));
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
/// use zerolayer_api::{ToolChoice, ToolDefinition, Tools};
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
    /// let t = zerolayer_api::Tools::new(vec![]);
    /// assert_eq!(t.choice, zerolayer_api::ToolChoice::Auto);
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
    /// use zerolayer_api::{ToolChoice, Tools};
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
/// let t = zerolayer_api::ToolDefinition::new("now", serde_json::json!({"type": "object"}))
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
    /// let t = zerolayer_api::ToolDefinition::new("f", serde_json::json!({}));
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
    /// let t = zerolayer_api::ToolDefinition::new("f", serde_json::json!({})).with_description("d");
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

impl SamplingParams {
    /// Checks the values a sampler cannot use: a temperature that is not a finite
    /// non-negative number, a `top_p` outside (0, 1]. The rest is defined for every value
    /// (the HTTP gateway holds each field to its API's documented range before this).
    ///
    /// ```
    /// use zerolayer_api::SamplingParams;
    /// let mut p = SamplingParams::default();
    /// p.top_p = Some(0.0);
    /// assert_eq!(p.validate().unwrap_err().to_string(), "invalid value for `top_p`: 0 is not in (0, 1]");
    /// ```
    pub fn validate(&self) -> Result<(), ServiceError> {
        if let Some(t) = self.temperature
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(ServiceError::InvalidRequest {
                field: "temperature",
                reason: format!("{t} is not a finite non-negative number"),
            });
        }
        if let Some(v) = self.top_p
            && !(v > 0.0 && v <= 1.0)
        {
            return Err(ServiceError::InvalidRequest {
                field: "top_p",
                reason: format!("{v} is not in (0, 1]"),
            });
        }
        Ok(())
    }
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

/// The language a constrained output must belong to.
///
/// ```
/// use zerolayer_api::OutputFormat;
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
