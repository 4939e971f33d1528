//! From a request's prompt to the engine's queue: the model's chat template (with tools rendered
//! natively or described in the system message), the tokenizer, the grammar a request's output
//! format or forced tool call compiles to, and the small thread pool that does this off the
//! caller's async runtime.

use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};

use gpu_pipeline::engine::{Engine, GenerationRequest, RequestHandle, SubmitError};
use gpu_pipeline::executor::HostedExecutor;
use gpu_pipeline::{ConstraintFactory, GrammarError, Grammars};
use token_stream::{ChatTemplate, RenderOptions, TemplateMessage, Tokenizer, ToolCall, ToolSyntax};
use zerolayer_api::{
    ChatRole, OutputFormat, Prompt, SchemaSource, ServiceError, ToolChoice, ToolDefinition, Tools,
};

use crate::service::LoadServiceError;

/// Tokenizer, chat template and engine: what a [`PromptPool`] job needs.
pub(crate) struct PromptParts {
    pub(crate) engine: Arc<Engine<HostedExecutor>>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) chat: Option<Arc<ChatTemplate>>,
    pub(crate) tool_syntax: ToolSyntax,
    pub(crate) grammars: Arc<OnceLock<Result<Grammars, GrammarError>>>,
}

/// The JSON list of tool definitions a template (or the polyfill prompt) shows.
fn tools_json(tools: &Tools) -> serde_json::Value {
    tools
        .tools
        .iter()
        .map(|t| token_stream::tool_json(&t.name, t.description.as_deref(), &t.parameters))
        .collect()
}

/// The grammar a request's decoding is constrained to, and the schema it comes from: its
/// output format, or one call of the allowed tools when a tool is forced.
fn request_format(
    format: Option<Arc<OutputFormat>>,
    tools: Option<&Tools>,
    syntax: ToolSyntax,
) -> Result<Option<(Arc<OutputFormat>, SchemaSource)>, ServiceError> {
    let Some(tools) = tools else {
        return Ok(format.map(|f| (f, SchemaSource::OutputFormat)));
    };
    let forced: Vec<(usize, &ToolDefinition)> = match &tools.choice {
        ToolChoice::Any => tools.tools.iter().enumerate().collect(),
        ToolChoice::Named(name) => {
            let t = tools
                .tools
                .iter()
                .enumerate()
                .find(|(_, t)| &t.name == name)
                .ok_or_else(|| ServiceError::InvalidRequest {
                    field: "tool_choice",
                    reason: format!("no tool is named {name:?}"),
                })?;
            vec![t]
        }
        _ => return Ok(format.map(|f| (f, SchemaSource::OutputFormat))),
    };
    if format.is_some() {
        return Err(ServiceError::InvalidRequest {
            field: "tool_choice",
            reason: "a forced tool call and a structured output format cannot be combined".into(),
        });
    }
    let source = match forced.as_slice() {
        [] => {
            return Err(ServiceError::InvalidRequest {
                field: "tools",
                reason: "a tool call is required but no tool is given".into(),
            });
        }
        [(i, _)] => SchemaSource::Tool(*i),
        _ => SchemaSource::Tools,
    };
    Ok(Some((
        Arc::new(forced_call(syntax, forced.iter().map(|&(_, t)| t))),
        source,
    )))
}

/// The grammar of one call of any of `tools`.
fn forced_call<'a>(
    syntax: ToolSyntax,
    tools: impl Iterator<Item = &'a ToolDefinition>,
) -> OutputFormat {
    // Integers held to 64 bits, as in a JSON Schema output format.
    let bounded: Vec<(&str, serde_json::Value)> = tools
        .map(|t| {
            let mut parameters = t.parameters.clone();
            gpu_pipeline::bound_json_integers(&mut parameters);
            (t.name.as_str(), parameters)
        })
        .collect();
    let forced: Vec<(&str, &serde_json::Value)> = bounded.iter().map(|(n, p)| (*n, p)).collect();
    OutputFormat::Lark(token_stream::forced_call_grammar(syntax, &forced))
}

/// A request's compiled constraint and the schema it comes from.
type Constraint = (Arc<dyn ConstraintFactory>, SchemaSource);

/// A refused grammar's reason, as the client reads it (after the field it names).
fn schema_reason(e: &GrammarError) -> String {
    match e {
        GrammarError::Empty => "no output can satisfy this schema (a recursion with no way out, \
             such as {\"$ref\": \"#\"}?)"
            .into(),
        GrammarError::TooComplex(why) => format!("too complex to constrain the output: {why}"),
        GrammarError::Invalid(why) => format!("cannot be used to constrain the output: {why}"),
        other => other.to_string(),
    }
}

impl PromptParts {
    /// The grammar compiler, built by the first call.
    fn grammars(&self) -> Result<&Grammars, ServiceError> {
        self.grammars
            .get_or_init(|| {
                let stops = self.engine.stop_tokens();
                // The grammar's end is the tokenizer's EOS where it ends generation.
                let eos = self
                    .tokenizer
                    .eos_id()
                    .filter(|e| stops.contains(e))
                    .or_else(|| stops.first().copied())
                    .ok_or_else(|| GrammarError::Tokenizer("the model has no end token".into()))?;
                let vocab = self.engine.model().config().vocab_size;
                Grammars::new(&self.tokenizer, vocab, eos)
            })
            .as_ref()
            .map_err(|e| ServiceError::InvalidRequest {
                field: "output_format",
                reason: format!("this model cannot constrain its output: {e}"),
            })
    }

    /// An output format compiled for the model's vocabulary; `tool_call`: the format is a
    /// forced tool call's grammar (JSON inside the call syntax: its numbers are held to what a
    /// double holds, as a JSON Schema format's are).
    fn compile(
        &self,
        format: &OutputFormat,
        tool_call: bool,
    ) -> Result<Arc<dyn ConstraintFactory>, ServiceError> {
        let grammars = self.grammars()?;
        let compiled = match format {
            OutputFormat::JsonSchema(schema) => grammars.json_schema(compact_json(schema)),
            OutputFormat::Regex(rx) => grammars.regex(rx),
            OutputFormat::Lark(lark) if tool_call => grammars.json_lark(lark),
            OutputFormat::Lark(lark) => grammars.lark(lark),
            _ => Err(GrammarError::Invalid("unknown output format".into())),
        };
        compiled.map_err(|e| ServiceError::InvalidSchema {
            schema: SchemaSource::OutputFormat,
            reason: schema_reason(&e),
        })
    }

    /// The constraint of a request (see [`request_format`]), compiled; a refused schema is
    /// named: the output format, or a forced tool (each one's schema is compiled alone first,
    /// so the one that fails is named), else the tools together.
    pub(crate) fn constraint(
        &self,
        format: Option<Arc<OutputFormat>>,
        tools: Option<&Tools>,
    ) -> Result<Option<Constraint>, ServiceError> {
        let Some((grammar, source)) = request_format(format, tools, self.tool_syntax)? else {
            return Ok(None);
        };
        let named = |schema: SchemaSource, e: ServiceError| match e {
            ServiceError::InvalidSchema { reason, .. } => {
                ServiceError::InvalidSchema { schema, reason }
            }
            other => other,
        };
        // The call's text comes first in a tool grammar: a schema that fails shows only when
        // the arguments start, unless it is compiled alone.
        let forced = match (source, tools) {
            (SchemaSource::Tool(i), Some(_)) => i..i + 1,
            (SchemaSource::Tools, Some(t)) => 0..t.tools.len(),
            _ => 0..0,
        };
        for i in forced {
            let schema = tools.map(|t| t.tools[i].parameters.clone());
            self.compile(&OutputFormat::JsonSchema(schema.unwrap_or_default()), false)
                .map_err(|e| named(SchemaSource::Tool(i), e))?;
        }
        let tool_call = matches!(source, SchemaSource::Tool(_) | SchemaSource::Tools);
        self.compile(&grammar, tool_call)
            .map(|c| Some((c, source)))
            .map_err(|e| named(source, e))
    }

    pub(crate) fn tokenize(
        &self,
        prompt: &Prompt,
        tools: Option<&Tools>,
    ) -> Result<Vec<u32>, ServiceError> {
        let invalid = |reason: String| ServiceError::InvalidRequest {
            field: "prompt",
            reason,
        };
        match prompt {
            Prompt::Text(t) => Ok(self.tokenizer.encode(t).to_vec()),
            Prompt::TokenIds(ids) => {
                let vocab = self.engine.model().config().vocab_size;
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(invalid(format!("token id {bad} is not below {vocab}")));
                }
                Ok(ids.clone())
            }
            Prompt::Chat(msgs) => {
                let chat = self
                    .chat
                    .as_ref()
                    .ok_or_else(|| invalid("the model has no chat template".into()))?;
                // A trailing assistant turn (without calls) is a prefill the answer continues.
                let (turns, prefill) = match msgs.split_last() {
                    Some((last, rest))
                        if last.role == ChatRole::Assistant && last.tool_calls.is_empty() =>
                    {
                        (rest, Some(last.content.as_str()))
                    }
                    _ => (msgs.as_slice(), None),
                };
                let mut ids = self
                    .encode_turns(chat, turns, tools)
                    .map_err(|e| invalid(e.to_string()))?;
                if let Some(p) = prefill {
                    self.tokenizer.encode_into(p, &mut ids);
                }
                Ok(ids)
            }
        }
    }

    /// Renders and tokenizes chat turns with the model's template, tools included: passed to
    /// a template that renders them ([`ToolSyntax::Hermes`]), else described in the system
    /// message with calls and results rewritten as text ([`token_stream::polyfill_messages`]).
    fn encode_turns(
        &self,
        chat: &ChatTemplate,
        turns: &[zerolayer_api::ChatMessage],
        tools: Option<&Tools>,
    ) -> Result<Vec<u32>, token_stream::ChatError> {
        let role = |r: ChatRole| match r {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
        };
        let calls: Vec<Vec<ToolCall<'_>>> = turns
            .iter()
            .map(|m| {
                m.tool_calls
                    .iter()
                    .map(|c| ToolCall::new(&c.name, &c.arguments).with_id(&c.id))
                    .collect()
            })
            .collect();
        let messages: Vec<TemplateMessage<'_>> = turns
            .iter()
            .zip(&calls)
            .map(|(m, calls)| {
                let mut t = TemplateMessage::new(role(m.role), &m.content).with_tool_calls(calls);
                if let Some(id) = &m.tool_call_id {
                    t = t.with_tool_call_id(id);
                }
                if let Some(n) = &m.tool_name {
                    t = t.with_name(n);
                }
                t
            })
            .collect();
        let tools_json = tools.map(tools_json);
        let opts = RenderOptions::new().add_generation_prompt(true);
        let uses_tools = tools_json.is_some()
            || turns
                .iter()
                .any(|m| m.role == ChatRole::Tool || !m.tool_calls.is_empty());
        let ids = if self.tool_syntax != ToolSyntax::HermesPolyfill || !uses_tools {
            let opts = match &tools_json {
                Some(t) => opts.tools(t),
                None => opts,
            };
            chat.encode_with(&self.tokenizer, &messages, &opts)?
        } else {
            let rewritten = token_stream::polyfill_messages(
                &messages,
                tools_json.as_ref().unwrap_or(&serde_json::Value::Null),
            );
            let messages: Vec<TemplateMessage<'_>> = rewritten
                .iter()
                .map(|(r, c)| TemplateMessage::new(r, c))
                .collect();
            chat.encode_with(&self.tokenizer, &messages, &opts)?
        };
        Ok(ids.to_vec())
    }

    /// Tokenizes the prompt and queues the request in the engine.
    pub(crate) fn start(
        &self,
        prompt: &Prompt,
        tools: Option<&Tools>,
        req: impl FnOnce(Vec<u32>) -> GenerationRequest,
    ) -> Result<RequestHandle, ServiceError> {
        let ids = self.tokenize(prompt, tools)?;
        if ids.is_empty() {
            return Err(ServiceError::InvalidRequest {
                field: "prompt",
                reason: "the prompt has no tokens".into(),
            });
        }
        self.engine.submit(req(ids)).map_err(|e| match e {
            SubmitError::ContextLength {
                prompt_tokens,
                max_new_tokens,
                context,
            } => ServiceError::ContextLength {
                prompt_tokens: u32::try_from(prompt_tokens + max_new_tokens).unwrap_or(u32::MAX),
                limit: u32::try_from(context).unwrap_or(u32::MAX),
            },
            SubmitError::Overloaded(_) => ServiceError::Overloaded {
                retry_after_ms: 1000,
            },
            SubmitError::ShuttingDown => ServiceError::ShuttingDown,
            other => ServiceError::InvalidRequest {
                field: "prompt",
                reason: other.to_string(),
            },
        })
    }
}

/// A job of the [`PromptPool`].
pub(crate) type PromptJob = Box<dyn FnOnce() + Send>;

/// A few threads that tokenize (and render the chat template of) submitted prompts, so that
/// [`InferenceService::submit`] only enqueues work and returns at once: tokenizing a prompt of
/// megabytes takes long enough to stall an async runtime's thread. The queue is bounded;
/// when it is full, `submit` answers `Overloaded`. The threads end when the service is dropped.
pub(crate) struct PromptPool {
    jobs: mpsc::SyncSender<PromptJob>,
}

impl PromptPool {
    /// Jobs waiting for a thread before `submit` answers `Overloaded`.
    const QUEUE: usize = 1024;
    /// Threads at most (tokenizing is one thread's work per prompt; the engine needs the rest).
    const MAX_THREADS: usize = 4;

    pub(crate) fn start() -> Result<Self, LoadServiceError> {
        let (jobs, queue) = mpsc::sync_channel::<PromptJob>(Self::QUEUE);
        let queue = Arc::new(Mutex::new(queue));
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(Self::MAX_THREADS);
        for i in 0..threads {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name(format!("zerolayer-prompt-{i}"))
                .spawn(move || {
                    loop {
                        // Poisoning: the lock is held only around `recv`, which does not
                        // panic; a poisoned lock still guards a valid receiver.
                        let job = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
                        let Ok(job) = job else { return };
                        // A panicking job fails only its own request (its reply is dropped).
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    }
                })
                .map_err(LoadServiceError::PromptPool)?;
        }
        Ok(Self { jobs })
    }

    pub(crate) fn try_run(&self, job: PromptJob) -> Result<(), ServiceError> {
        self.jobs.try_send(job).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => ServiceError::Overloaded {
                retry_after_ms: 1000,
            },
            mpsc::TrySendError::Disconnected(_) => ServiceError::ShuttingDown,
        })
    }
}

/// `schema` with llguidance told to emit compact JSON (`{"a": 1, "b": [2, 3]}`, no free
/// whitespace) unless the schema sets its own `x-guidance` options: a small model may
/// otherwise spend its whole budget on newlines, which the grammar allows anywhere.
fn compact_json(schema: &serde_json::Value) -> serde_json::Value {
    let mut schema = schema.clone();
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}
