//! Request validation over `serde_json::Value`, with messages that name the offending field the way
//! the Anthropic API does (`messages.0.content.1.text: Field required`).
//!
//! Fields the server does not honour are refused with a 400 naming them ([`super::fields`]);
//! `null` counts as absent for optional fields.

use serde_json::{Map, Value};

use super::error::ApiError;
use super::fields::{Api, check_fields, check_keys};
use super::format::{output_config, response_format};
use super::tools::{
    CallNames, ParsedTools, anthropic_tools, anthropic_turns, openai_calls, openai_result,
    openai_tools,
};
use zerolayer_api::{
    ChatMessage, ChatRole, OutputFormat, Prompt, SamplingParams, SchemaSource, ServiceError,
    ToolChoice, Tools,
};

/// A validated generation request, from either API flavour.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GenRequest {
    pub(crate) model: String,
    pub(crate) messages: Vec<ChatMessage>,
    pub(crate) max_tokens: u32,
    pub(crate) sampling: SamplingParams,
    pub(crate) stop_sequences: Vec<String>,
    pub(crate) stream: bool,
    /// OpenAI `stream_options.include_usage`.
    pub(crate) include_usage: bool,
    /// OpenAI `logprobs`: `Some(n)` asks for each token's log-probability and its `n` most
    /// likely alternatives (`top_logprobs`, or the legacy completions' integer `logprobs`).
    pub(crate) logprobs: Option<u8>,
    /// OpenAI `n`: how many independent choices to generate.
    pub(crate) n: u32,
    /// The prompt of `/v1/completions` (text or token ids); `None`: the chat `messages`.
    pub(crate) raw_prompt: Option<Prompt>,
    /// The structured output asked for (`response_format`, `output_config.format`).
    pub(crate) output_format: Option<std::sync::Arc<OutputFormat>>,
    /// The tools offered (`tools`, `tool_choice`).
    pub(crate) tools: Option<std::sync::Arc<Tools>>,
    /// At most one tool call may be answered (parallel tool use disabled).
    pub(crate) single_tool_call: bool,
    /// Where the request's schemas are, to name them when the service refuses one.
    pub(crate) schema_fields: SchemaFields,
}

/// The request fields of a request's JSON Schemas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SchemaFields {
    /// The output format's schema (`output_config.format.schema`,
    /// `response_format.json_schema.schema`, ...); empty without one.
    pub(crate) output_format: &'static str,
    /// A tool's schema, under `tools.{i}.` (`input_schema`, `function.parameters`).
    pub(crate) tool_schema: &'static str,
}

impl GenRequest {
    pub(crate) fn prompt(&self) -> Prompt {
        match &self.raw_prompt {
            Some(p) => p.clone(),
            None => Prompt::Chat(self.messages.clone()),
        }
    }

    /// A service's refusal as the client's error; a refused schema is named by its field
    /// (`tools.0.input_schema: ...`).
    pub(crate) fn service_error(&self, e: ServiceError) -> ApiError {
        let ServiceError::InvalidSchema { schema, reason } = &e else {
            return e.into();
        };
        let field = match schema {
            SchemaSource::OutputFormat => self.schema_fields.output_format.to_owned(),
            SchemaSource::Tool(i) => format!("tools.{i}.{}", self.schema_fields.tool_schema),
            _ => "tools".to_owned(),
        };
        ApiError::invalid(format!(
            "{field}: the JSON Schema cannot constrain the output: {reason}"
        ))
    }

    /// Whether the service compiles a grammar for this request (an output format, or a forced
    /// tool call): CPU work that belongs on the blocking pool.
    pub(crate) fn constrained(&self) -> bool {
        self.output_format.is_some()
            || self
                .tools
                .as_ref()
                .is_some_and(|t| matches!(t.choice, ToolChoice::Any | ToolChoice::Named(_)))
    }

    /// Bytes of prompt text (token-id prompts count four bytes a token).
    pub(crate) fn prompt_bytes(&self) -> usize {
        match &self.raw_prompt {
            Some(Prompt::Text(t)) => t.len(),
            Some(Prompt::TokenIds(ids)) => ids.len() * 4,
            _ => self.messages.iter().map(|m| m.content.len()).sum(),
        }
    }
}

/// Most choices one Chat Completions / completions request may ask for (`n`).
pub(crate) const MAX_CHOICES: i64 = 8;

/// Limits the validator applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_output_tokens: u32,
    pub(crate) default_chat_max_tokens: u32,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub(crate) fn wrong_type(path: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(format!(
        "{path}: Input should be a valid {want}, got {}",
        type_name(got)
    ))
}

pub(crate) fn required(path: &str) -> ApiError {
    ApiError::invalid(format!("{path}: Field required"))
}

/// The field, with `null` treated as absent.
pub(crate) fn get<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// The string `key` of `obj` (at `path`); absent or `null` is "Field required".
pub(crate) fn str_field<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<&'a str, ApiError> {
    match get(obj, key) {
        None => Err(required(&format!("{path}.{key}"))),
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(wrong_type(&format!("{path}.{key}"), "string", v)),
    }
}

/// The string `key` of `obj` (at `path`), if present and not `null`.
pub(crate) fn opt_str_field<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<&'a str>, ApiError> {
    match get(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong_type(&format!("{path}.{key}"), "string", v)),
    }
}

fn parse_object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object().ok_or_else(|| {
        ApiError::invalid(format!(
            "request body: Input should be a valid JSON object, got {}",
            type_name(body)
        ))
    })
}

fn opt_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, ApiError> {
    match get(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong_type(key, "string", v)),
    }
}

pub(crate) fn opt_bool(
    obj: &Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<bool>, ApiError> {
    match get(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong_type(path, "boolean", v)),
    }
}

/// An integer in `[min, max]`; integral floats such as `16.0` are accepted.
fn opt_int(
    obj: &Map<String, Value>,
    key: &str,
    min: i64,
    max: i64,
) -> Result<Option<i64>, ApiError> {
    let Some(v) = get(obj, key) else {
        return Ok(None);
    };
    let n = match v {
        Value::Number(n) => n
            .as_i64()
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                    .map(|f| f as i64)
            })
            .or_else(|| n.as_u64().map(|_| i64::MAX)),
        _ => None,
    };
    let Some(n) = n else {
        return Err(wrong_type(key, "integer", v));
    };
    if n < min {
        return Err(ApiError::invalid(format!(
            "{key}: Input should be greater than or equal to {min}"
        )));
    }
    if n > max {
        return Err(ApiError::invalid(format!(
            "{key}: Input should be less than or equal to {max}"
        )));
    }
    Ok(Some(n))
}

/// A finite number in `[min, max]`.
fn opt_f32(
    obj: &Map<String, Value>,
    key: &str,
    min: f64,
    max: f64,
) -> Result<Option<f32>, ApiError> {
    let Some(v) = get(obj, key) else {
        return Ok(None);
    };
    let Some(x) = v.as_f64() else {
        return Err(wrong_type(key, "number", v));
    };
    if x < min {
        return Err(ApiError::invalid(format!(
            "{key}: Input should be greater than or equal to {min}"
        )));
    }
    if x > max {
        return Err(ApiError::invalid(format!(
            "{key}: Input should be less than or equal to {max}"
        )));
    }
    Ok(Some(x as f32))
}

/// The sampling fields of any generating endpoint; `max_temperature` is the API's own bound
/// (1 for Anthropic, 2 for OpenAI).
fn parse_sampling(
    obj: &Map<String, Value>,
    max_temperature: f64,
) -> Result<SamplingParams, ApiError> {
    let repetition_penalty = match (
        opt_f32(obj, "repetition_penalty", 0.0, 10.0)?,
        opt_f32(obj, "repeat_penalty", 0.0, 10.0)?,
    ) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "repeat_penalty: give either repetition_penalty or repeat_penalty (the same setting), not both",
            ));
        }
        (a, b) => a.or(b),
    };
    if repetition_penalty == Some(0.0) {
        return Err(ApiError::invalid(
            "repetition_penalty: Input should be greater than 0",
        ));
    }
    // Field by field: the struct is non-exhaustive (it grows with the sampler).
    let mut sampling = SamplingParams::default();
    sampling.temperature = opt_f32(obj, "temperature", 0.0, max_temperature)?;
    sampling.top_p = opt_f32(obj, "top_p", 0.0, 1.0)?;
    sampling.top_k = opt_int(obj, "top_k", 0, i64::from(u32::MAX))?
        .filter(|&k| k > 0)
        .map(|k| k as u32);
    sampling.min_p = opt_f32(obj, "min_p", 0.0, 1.0)?;
    sampling.repetition_penalty = repetition_penalty;
    sampling.frequency_penalty = opt_f32(obj, "frequency_penalty", -2.0, 2.0)?;
    sampling.presence_penalty = opt_f32(obj, "presence_penalty", -2.0, 2.0)?;
    sampling.seed = opt_seed(obj)?;
    Ok(sampling)
}

/// `seed`: any 64-bit integer, signed (OpenAI) or not.
fn opt_seed(obj: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    match get(obj, "seed") {
        None => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|i| i as u64))
            .map(Some)
            .ok_or_else(|| wrong_type("seed", "integer", &Value::Number(n.clone()))),
        Some(v) => Err(wrong_type("seed", "integer", v)),
    }
}

/// OpenAI `n` (1 to [`MAX_CHOICES`]).
fn parse_n(obj: &Map<String, Value>) -> Result<u32, ApiError> {
    Ok(opt_int(obj, "n", 1, MAX_CHOICES)?.map_or(1, |n| n as u32))
}

fn required_model(obj: &Map<String, Value>) -> Result<String, ApiError> {
    match opt_str(obj, "model")? {
        None => Err(required("model")),
        Some("") => Err(ApiError::invalid(
            "model: String should have at least 1 character",
        )),
        Some(s) => Ok(s.to_owned()),
    }
}

/// Text of a `content` value: a string or an array of `{"type":"text","text":..}` blocks.
fn content_text(v: &Value, path: &str, null_ok: bool) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null if null_ok => Ok(String::new()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let bp = format!("{path}.{i}");
                let Some(obj) = b.as_object() else {
                    return Err(wrong_type(&bp, "object", b));
                };
                let ty = str_field(obj, "type", &bp)?;
                if ty != "text" {
                    return Err(ApiError::invalid(format!(
                        "{bp}.type: content blocks of type `{ty}` are not supported by this server (only `text`)"
                    )));
                }
                check_keys(obj, &["type", "text", "cache_control"], &bp)?;
                parts.push(str_field(obj, "text", &bp)?);
            }
            Ok(parts.join("\n"))
        }
        other => Err(wrong_type(path, "string or list of content blocks", other)),
    }
}

fn parse_stop_list(v: &Value, key: &str, max_items: usize) -> Result<Vec<String>, ApiError> {
    let Value::Array(items) = v else {
        return Err(wrong_type(key, "list of strings", v));
    };
    if items.len() > max_items {
        return Err(ApiError::invalid(format!(
            "{key}: at most {max_items} stop sequences are allowed"
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            Value::String(s) if s.is_empty() => Err(ApiError::invalid(format!(
                "{key}.{i}: stop sequences must be non-empty"
            ))),
            Value::String(s) => Ok(s.clone()),
            other => Err(wrong_type(&format!("{key}.{i}"), "string", other)),
        })
        .collect()
}

/// Appends a turn, merging it into the previous one when a user or assistant role repeats (as
/// the API does; turns carrying tool calls or results stay apart).
/// The `messages` of a request: a list of at least one message.
fn message_list(obj: &Map<String, Value>) -> Result<&[Value], ApiError> {
    match get(obj, "messages") {
        None => Err(required("messages")),
        Some(Value::Array(list)) if list.is_empty() => Err(ApiError::invalid(
            "messages: at least one message is required",
        )),
        Some(Value::Array(list)) => Ok(list),
        Some(other) => Err(wrong_type("messages", "list", other)),
    }
}

fn push_turn(out: &mut Vec<ChatMessage>, m: ChatMessage) {
    match out.last_mut() {
        Some(last)
            if last.role == m.role
                && matches!(m.role, ChatRole::User | ChatRole::Assistant)
                && last.tool_calls.is_empty()
                && m.tool_calls.is_empty() =>
        {
            last.content.push_str("\n\n");
            last.content.push_str(&m.content);
        }
        _ => out.push(m),
    }
}

/// Validates an Anthropic Messages request (`POST /v1/messages`). With `count_only`
/// (`/v1/messages/count_tokens`), `max_tokens` is not required.
pub(crate) fn parse_messages(
    body: &Value,
    limits: Limits,
    count_only: bool,
) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    check_fields(
        obj,
        if count_only {
            Api::CountTokens
        } else {
            Api::Messages
        },
    )?;
    let model = required_model(obj)?;
    let max_tokens = match opt_int(obj, "max_tokens", 1, i64::from(limits.max_output_tokens))? {
        Some(n) => n as u32,
        None if count_only => 1,
        None => return Err(required("max_tokens")),
    };
    let mut messages = Vec::new();
    if let Some(system) = get(obj, "system") {
        let text = content_text(system, "system", false)?;
        if !text.is_empty() {
            messages.push(ChatMessage::new(ChatRole::System, text));
        }
    }
    let list = message_list(obj)?;
    let mut calls = CallNames::default();
    for (i, m) in list.iter().enumerate() {
        let path = format!("messages.{i}");
        let Some(m) = m.as_object() else {
            return Err(wrong_type(&path, "object", m));
        };
        check_keys(m, &["role", "content"], &path)?;
        let role = match m.get("role") {
            None | Some(Value::Null) => return Err(required(&format!("{path}.role"))),
            Some(Value::String(r)) if r == "user" => ChatRole::User,
            Some(Value::String(r)) if r == "assistant" => ChatRole::Assistant,
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "{path}.role: Input should be 'user' or 'assistant'"
                )));
            }
        };
        let turns = match m.get("content") {
            None | Some(Value::Null) => return Err(required(&format!("{path}.content"))),
            Some(c) => anthropic_turns(role, c, &format!("{path}.content"), &mut calls)?,
        };
        for t in turns {
            push_turn(&mut messages, t);
        }
    }
    let sampling = parse_sampling(obj, 1.0)?;
    let stop_sequences = match get(obj, "stop_sequences") {
        None => Vec::new(),
        Some(v) => parse_stop_list(v, "stop_sequences", 64)?,
    };
    let stream = opt_bool(obj, "stream", "stream")?.unwrap_or(false);
    let tools: ParsedTools = anthropic_tools(obj)?;
    let format = output_config(obj)?;
    match get(obj, "metadata") {
        None => {}
        Some(Value::Object(meta)) => {
            if let Some(v) = get(meta, "user_id").filter(|v| !v.is_string()) {
                return Err(wrong_type("metadata.user_id", "string", v));
            }
        }
        Some(other) => return Err(wrong_type("metadata", "object", other)),
    }
    Ok(GenRequest {
        model,
        messages,
        max_tokens,
        sampling,
        stop_sequences,
        stream,
        include_usage: false,
        logprobs: None,
        n: 1,
        raw_prompt: None,
        schema_fields: SchemaFields {
            output_format: format.as_ref().map_or("", |(_, path)| path),
            tool_schema: "input_schema",
        },
        output_format: format.map(|(f, _)| std::sync::Arc::new(f)),
        tools: tools.tools.map(std::sync::Arc::new),
        single_tool_call: tools.single_call,
    })
}

/// Validates an OpenAI Chat Completions request (`POST /v1/chat/completions`).
pub(crate) fn parse_chat(body: &Value, limits: Limits) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    check_fields(obj, Api::Chat)?;
    let model = required_model(obj)?;
    let max = i64::from(limits.max_output_tokens);
    let max_tokens = match opt_int(obj, "max_completion_tokens", 1, max)? {
        Some(n) => n as u32,
        None => opt_int(obj, "max_tokens", 1, max)?.map_or(
            limits.default_chat_max_tokens.min(limits.max_output_tokens),
            |n| n as u32,
        ),
    };
    let list = message_list(obj)?;
    let mut messages = Vec::new();
    let mut calls = CallNames::default();
    for (i, m) in list.iter().enumerate() {
        let path = format!("messages.{i}");
        let Some(m) = m.as_object() else {
            return Err(wrong_type(&path, "object", m));
        };
        let role = match str_field(m, "role", &path)? {
            "system" | "developer" => ChatRole::System,
            "user" => ChatRole::User,
            "assistant" => ChatRole::Assistant,
            "tool" => ChatRole::Tool,
            other => {
                return Err(ApiError::invalid(format!(
                    "{path}.role: role `{other}` is not supported (use system, developer, user, assistant or tool)"
                )));
            }
        };
        check_keys(
            m,
            match role {
                ChatRole::Assistant => &["role", "content", "tool_calls"],
                ChatRole::Tool => &["role", "content", "tool_call_id"],
                _ => &["role", "content"],
            },
            &path,
        )?;
        let tool_calls = openai_calls(
            get(m, "tool_calls"),
            &format!("{path}.tool_calls"),
            &mut calls,
        )?;
        let content = match m.get("content") {
            None if !tool_calls.is_empty() => String::new(),
            None => return Err(required(&format!("{path}.content"))),
            Some(c) => content_text(c, &format!("{path}.content"), role == ChatRole::Assistant)?,
        };
        let turn = match role {
            ChatRole::Tool => openai_result(m, content, &path, &calls)?,
            _ => ChatMessage::new(role, content).with_tool_calls(tool_calls),
        };
        push_turn(&mut messages, turn);
    }
    let n = parse_n(obj)?;
    let sampling = parse_sampling(obj, 2.0)?;
    let tools = openai_tools(obj)?;
    let logprobs = match (
        opt_bool(obj, "logprobs", "logprobs")?.unwrap_or(false),
        opt_int(obj, "top_logprobs", 0, 20)?,
    ) {
        (true, top) => Some(top.unwrap_or(0) as u8),
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs: `logprobs` must be true when `top_logprobs` is given",
            ));
        }
        (false, None) => None,
    };
    let format = response_format(obj)?;
    Ok(GenRequest {
        model,
        messages,
        max_tokens,
        sampling,
        stop_sequences: parse_openai_stop(obj)?,
        stream: opt_bool(obj, "stream", "stream")?.unwrap_or(false),
        include_usage: parse_include_usage(obj)?,
        logprobs,
        n,
        raw_prompt: None,
        schema_fields: SchemaFields {
            output_format: format.as_ref().map_or("", |(_, path)| path),
            tool_schema: "function.parameters",
        },
        output_format: format.map(|(f, _)| std::sync::Arc::new(f)),
        tools: tools.tools.map(std::sync::Arc::new),
        single_tool_call: tools.single_call,
    })
}

/// OpenAI `stop`: a string or a list of at most 4.
fn parse_openai_stop(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    match get(obj, "stop") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) if s.is_empty() => {
            Err(ApiError::invalid("stop: stop sequences must be non-empty"))
        }
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(v) => parse_stop_list(v, "stop", 4),
    }
}

/// OpenAI `stream_options` (only `include_usage`).
fn parse_include_usage(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    match get(obj, "stream_options") {
        None => Ok(false),
        Some(Value::Object(o)) => {
            check_keys(o, &["include_usage"], "stream_options")?;
            Ok(opt_bool(o, "include_usage", "stream_options.include_usage")?.unwrap_or(false))
        }
        Some(other) => Err(wrong_type("stream_options", "object", other)),
    }
}

/// The `prompt` of a legacy completion: a string, a list of one string, a list of token ids
/// or a list of one such list.
fn parse_completion_prompt(v: &Value) -> Result<Prompt, ApiError> {
    let ids = |items: &[Value], path: &str| -> Result<Prompt, ApiError> {
        items
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| wrong_type(&format!("{path}.{i}"), "token id", t))
            })
            .collect::<Result<Vec<u32>, ApiError>>()
            .map(Prompt::TokenIds)
    };
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::invalid("prompt: the prompt must not be empty"))
        }
        Value::Array(items) if items.iter().all(Value::is_number) => ids(items, "prompt"),
        Value::Array(items) if items.len() == 1 => match &items[0] {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(inner) => ids(inner, "prompt.0"),
            other => Err(wrong_type("prompt.0", "string or list of token ids", other)),
        },
        Value::Array(_) => Err(ApiError::invalid(
            "prompt: only one prompt per request is supported (use `n` for several choices)",
        )),
        other => Err(wrong_type("prompt", "string or list of token ids", other)),
    }
}

/// Validates an OpenAI legacy completions request (`POST /v1/completions`).
pub(crate) fn parse_completions(body: &Value, limits: Limits) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    check_fields(obj, Api::Completions)?;
    let model = required_model(obj)?;
    let max = i64::from(limits.max_output_tokens);
    // OpenAI's default for this endpoint is 16 tokens.
    let max_tokens = opt_int(obj, "max_tokens", 1, max)?.map_or(16.min(max as u32), |n| n as u32);
    let prompt = match get(obj, "prompt") {
        None => return Err(required("prompt")),
        Some(v) => parse_completion_prompt(v)?,
    };
    let n = parse_n(obj)?;
    if opt_bool(obj, "echo", "echo")? == Some(true) {
        return Err(ApiError::invalid(
            "echo: echoing the prompt is not supported by this server",
        ));
    }
    if let Some(s) = opt_str(obj, "suffix")?.filter(|s| !s.is_empty()) {
        return Err(ApiError::invalid(format!(
            "suffix: insertion (a suffix of {} bytes) is not supported by this server",
            s.len()
        )));
    }
    if let Some(b) = opt_int(obj, "best_of", 1, MAX_CHOICES)?.filter(|&b| b != i64::from(n)) {
        return Err(ApiError::invalid(format!(
            "best_of: only best_of = n is supported (got {b} with n = {n})"
        )));
    }
    Ok(GenRequest {
        model,
        messages: Vec::new(),
        max_tokens,
        sampling: parse_sampling(obj, 2.0)?,
        stop_sequences: parse_openai_stop(obj)?,
        stream: opt_bool(obj, "stream", "stream")?.unwrap_or(false),
        include_usage: parse_include_usage(obj)?,
        logprobs: opt_int(obj, "logprobs", 0, 5)?.map(|n| n as u8),
        n,
        raw_prompt: Some(prompt),
        output_format: None,
        tools: None,
        single_tool_call: false,
        schema_fields: SchemaFields {
            output_format: "",
            tool_schema: "",
        },
    })
}

/// Decodes the `%XX` escapes of a URL path segment (RFC 3986; `+` stays `+`), as the id in
/// `/v1/models/{id}` needs for ids with spaces (`My%20Model`). `None` for a malformed escape or
/// bytes that are not UTF-8.
pub(crate) fn percent_decode(segment: &str) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const LIMITS: Limits = Limits {
        max_output_tokens: 4096,
        default_chat_max_tokens: 256,
    };

    fn msg_err(body: Value) -> String {
        parse_messages(&body, LIMITS, false).unwrap_err().message
    }

    #[test]
    fn messages_lists_roles_and_block_fields_name_the_offending_path() {
        let chat_err = |body: Value| parse_chat(&body, LIMITS).unwrap_err().message;
        let anthropic = |extra: Value| {
            let mut body = json!({"model": "m", "max_tokens": 8});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            msg_err(body)
        };
        let user = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
        for (got, want) in [
            (anthropic(json!({})), "messages: Field required"),
            (
                anthropic(json!({"messages": []})),
                "messages: at least one message is required",
            ),
            (
                anthropic(json!({"messages": "hi"})),
                "messages: Input should be a valid list, got string",
            ),
            (
                chat_err(json!({"model": "m", "messages": []})),
                "messages: at least one message is required",
            ),
            (
                chat_err(json!({"model": "m", "messages": [{"content": "hi"}]})),
                "messages.0.role: Field required",
            ),
            (
                chat_err(json!({"model": "m", "messages": [{"role": 5}]})),
                "messages.0.role: Input should be a valid string, got number",
            ),
            (
                chat_err(json!({"model": "m", "messages": [{"role": "robot"}]})),
                "messages.0.role: role `robot` is not supported (use system, developer, user, assistant or tool)",
            ),
            (
                anthropic(json!({"system": [{"text": "s"}], "messages": []})),
                "system.0.type: Field required",
            ),
            (
                anthropic(json!({"system": [{"type": "text", "text": 5}], "messages": []})),
                "system.0.text: Input should be a valid string, got number",
            ),
            (
                anthropic(user(json!([{"type": null}]))),
                "messages.0.content.0.type: Field required",
            ),
            (
                anthropic(user(json!([{"type": 1}]))),
                "messages.0.content.0.type: Input should be a valid string, got number",
            ),
        ] {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn minimal_request_parses_and_an_unknown_field_is_named() {
        let e = parse_messages(
            &json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "extra": 1}),
            LIMITS,
            false,
        )
        .unwrap_err();
        assert_eq!(
            e.message,
            "extra: this field is not supported by this server"
        );
        let r = parse_messages(
            &json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
            LIMITS,
            false,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 8);
        assert_eq!(r.messages, vec![ChatMessage::new(ChatRole::User, "hi")]);
        assert!(!r.stream);
    }

    #[test]
    fn blocks_system_and_merging() {
        let r = parse_messages(
            &json!({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                 {"role": "user", "content": "c"},
                                 {"role": "assistant", "content": "d"}],
                    "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop_sequences": ["X"], "stream": true,
                    "metadata": {"user_id": "u"}}),
            LIMITS,
            false,
        )
        .unwrap();
        assert_eq!(r.messages.len(), 3);
        assert_eq!(r.messages[0].role, ChatRole::System);
        assert_eq!(r.messages[1].content, "a\nb\n\nc");
        assert_eq!(r.sampling.temperature, Some(0.5));
        assert_eq!(r.sampling.top_k, Some(40));
        assert_eq!(r.stop_sequences, vec!["X".to_string()]);
        assert!(r.stream);
    }

    #[test]
    fn errors_name_the_field() {
        let base = || json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base();
            b[k] = v;
            b
        };
        assert_eq!(
            msg_err(json!([])),
            "request body: Input should be a valid JSON object, got array"
        );
        let mut b = base();
        b.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(msg_err(b), "max_tokens: Field required");
        assert!(
            msg_err(with("max_tokens", json!("8")))
                .starts_with("max_tokens: Input should be a valid integer")
        );
        assert!(
            msg_err(with("max_tokens", json!(0)))
                .starts_with("max_tokens: Input should be greater")
        );
        assert!(msg_err(with("max_tokens", json!(1.5))).starts_with("max_tokens:"));
        assert!(
            msg_err(with("max_tokens", json!(5000)))
                .starts_with("max_tokens: Input should be less")
        );
        assert!(msg_err(with("temperature", json!(1.5))).starts_with("temperature:"));
        assert!(
            msg_err(with("temperature", json!("hot")))
                .starts_with("temperature: Input should be a valid number")
        );
        assert!(msg_err(with("top_p", json!(-0.1))).starts_with("top_p:"));
        assert!(msg_err(with("top_k", json!(-1))).starts_with("top_k:"));
        assert!(msg_err(with("stop_sequences", json!("X"))).starts_with("stop_sequences:"));
        assert!(msg_err(with("stop_sequences", json!(["a", 1]))).starts_with("stop_sequences.1:"));
        assert!(msg_err(with("stream", json!("yes"))).starts_with("stream:"));
        assert!(msg_err(with("metadata", json!(3))).starts_with("metadata:"));
        assert!(msg_err(with("system", json!(3))).starts_with("system:"));
        assert!(msg_err(with("model", json!(3))).starts_with("model:"));
        assert!(msg_err(with("messages", json!([]))).starts_with("messages:"));
        assert!(
            msg_err(with("messages", json!([{"role": "tool", "content": "x"}])))
                .starts_with("messages.0.role:")
        );
        assert!(
            msg_err(with("messages", json!([{"role": "user"}])))
                .starts_with("messages.0.content: Field required")
        );
        assert!(
            msg_err(with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image"}]}])
            ))
            .starts_with("messages.0.content.0.type:")
        );
        assert!(
            msg_err(with(
                "messages",
                json!([{"role": "user", "content": [{"type": "text"}]}])
            ))
            .starts_with("messages.0.content.0.text: Field required")
        );
    }

    #[test]
    fn count_tokens_needs_no_max_tokens() {
        let r = parse_messages(
            &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            LIMITS,
            true,
        );
        assert!(r.is_ok());
    }

    #[test]
    fn chat_completions() {
        let r = parse_chat(
            &json!({"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}],
                    "stop": "END", "stream": true, "stream_options": {"include_usage": true}, "temperature": 1.5, "seed": 7}),
            LIMITS,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 256);
        assert_eq!(r.stop_sequences, vec!["END".to_string()]);
        assert!(r.include_usage && r.stream);
        assert_eq!(r.sampling.seed, Some(7));
        assert_eq!(r.messages[0].role, ChatRole::System);
        let e = parse_chat(
            &json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}),
            LIMITS,
        )
        .unwrap_err();
        assert!(e.message.starts_with("n:"));
        let e = parse_chat(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}), LIMITS).unwrap_err();
        assert!(e.message.starts_with("stop:"));
    }

    #[test]
    fn sampling_fields_of_both_apis() {
        let body = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repeat_penalty": 1.1,
            "frequency_penalty": 0.5, "presence_penalty": -0.5, "seed": 42});
        let mut want = SamplingParams::default();
        want.temperature = Some(0.8);
        want.top_p = Some(0.9);
        want.top_k = Some(5);
        want.min_p = Some(0.05);
        want.repetition_penalty = Some(1.1);
        want.frequency_penalty = Some(0.5);
        want.presence_penalty = Some(-0.5);
        want.seed = Some(42);
        assert_eq!(parse_messages(&body, LIMITS, false).unwrap().sampling, want);
        let mut chat = body.clone();
        chat.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(parse_chat(&chat, LIMITS).unwrap().sampling, want);
        let mut both = body.clone();
        both["repetition_penalty"] = json!(1.2);
        assert!(msg_err(both).starts_with("repeat_penalty: give either"));
        for (k, v) in [
            ("min_p", json!(1.5)),
            ("frequency_penalty", json!(3)),
            ("presence_penalty", json!(-2.5)),
            ("repetition_penalty", json!(0)),
            ("seed", json!(1.5)),
            ("seed", json!("7")),
        ] {
            let mut b = body.clone();
            b[k] = v;
            b.as_object_mut().unwrap().remove("repeat_penalty");
            assert!(msg_err(b).starts_with(&format!("{k}:")), "{k}");
        }
        let mut neg = chat.clone();
        neg["seed"] = json!(-1);
        assert_eq!(
            parse_chat(&neg, LIMITS).unwrap().sampling.seed,
            Some(u64::MAX)
        );
    }

    #[test]
    fn chat_logprobs_and_n() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        let with = |extra: Value| {
            let mut b = base.clone();
            b.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            parse_chat(&b, LIMITS)
        };
        let r = with(json!({"logprobs": true, "top_logprobs": 3, "n": 2})).unwrap();
        assert_eq!((r.logprobs, r.n), (Some(3), 2));
        assert_eq!(with(json!({"logprobs": true})).unwrap().logprobs, Some(0));
        assert_eq!(with(json!({"logprobs": false})).unwrap().logprobs, None);
        let e = with(json!({"top_logprobs": 3})).unwrap_err();
        assert!(e.message.starts_with("top_logprobs:"), "{}", e.message);
        let e = with(json!({"top_logprobs": 21, "logprobs": true})).unwrap_err();
        assert!(e.message.starts_with("top_logprobs:"), "{}", e.message);
        let e = with(json!({"messages": [{"role": "user", "content": "x", "name": "bob"}]}))
            .unwrap_err();
        assert_eq!(
            e.message,
            "messages.0.name: this field is not supported by this server"
        );
        // fields echoed back as null pass
        let r = with(
            json!({"messages": [{"role": "assistant", "content": "x", "tool_calls": null, "refusal": null}]}),
        );
        assert!(r.is_ok());
        let e = with(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}))
            .unwrap_err();
        assert!(
            e.message.starts_with("messages.0.content.0.type:"),
            "{}",
            e.message
        );
    }

    #[test]
    fn legacy_completions() {
        let ok = |b: Value| parse_completions(&b, LIMITS).unwrap();
        let err = |b: Value| parse_completions(&b, LIMITS).unwrap_err().message;
        let r = ok(json!({"model": "m", "prompt": "Once", "logprobs": 2, "stop": ["\n"]}));
        assert_eq!(r.prompt(), Prompt::Text("Once".into()));
        assert_eq!((r.max_tokens, r.logprobs, r.n), (16, Some(2), 1));
        assert_eq!(
            ok(json!({"model": "m", "prompt": ["a"]})).prompt(),
            Prompt::Text("a".into())
        );
        assert_eq!(
            ok(json!({"model": "m", "prompt": [1, 2, 3]})).prompt(),
            Prompt::TokenIds(vec![1, 2, 3])
        );
        assert_eq!(
            ok(json!({"model": "m", "prompt": [[4]], "best_of": 1})).prompt(),
            Prompt::TokenIds(vec![4])
        );
        assert_eq!(
            ok(json!({"model": "m", "prompt": "x", "max_tokens": 5})).prompt_bytes(),
            1
        );
        assert!(err(json!({"model": "m"})).starts_with("prompt: Field required"));
        assert!(err(json!({"model": "m", "prompt": ["a", "b"]})).starts_with("prompt: only one"));
        assert!(err(json!({"model": "m", "prompt": [1, -2]})).starts_with("prompt.1:"));
        assert!(err(json!({"model": "m", "prompt": []})).starts_with("prompt:"));
        assert!(err(json!({"model": "m", "prompt": "x", "echo": true})).starts_with("echo:"));
        assert!(err(json!({"model": "m", "prompt": "x", "suffix": "y"})).starts_with("suffix:"));
        assert!(err(json!({"model": "m", "prompt": "x", "best_of": 3})).starts_with("best_of:"));
        assert!(err(json!({"model": "m", "prompt": "x", "logprobs": 6})).starts_with("logprobs:"));
        assert!(
            err(json!({"model": "m", "prompt": "x", "stream_options": {"x": 1}}))
                .starts_with("stream_options.x:")
        );
    }

    #[test]
    fn percent_decode_decodes_escapes_and_refuses_malformed_ones() {
        assert_eq!(percent_decode("plain-id").as_deref(), Some("plain-id"));
        assert_eq!(
            percent_decode("Smollm2%20135M%208k").as_deref(),
            Some("Smollm2 135M 8k")
        );
        assert_eq!(percent_decode("a%2Fb%2fc+d").as_deref(), Some("a/b/c+d"));
        assert_eq!(percent_decode("caf%C3%A9").as_deref(), Some("caf\u{e9}"));
        assert_eq!(percent_decode("100%"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%+1"), None);
        assert_eq!(percent_decode("%FF"), None, "not UTF-8");
    }
}
