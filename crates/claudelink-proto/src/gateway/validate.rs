//! Request validation over `serde_json::Value`, with messages that name the offending field the way
//! the Anthropic API does (`messages.0.content.1.text: Field required`).
//!
//! Unknown fields are ignored; `null` counts as absent for optional fields.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::service::{ChatMessage, ChatRole, Prompt, SamplingParams};

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
}

impl GenRequest {
    pub(crate) fn prompt(&self) -> Prompt {
        Prompt::Chat(self.messages.clone())
    }
}

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

fn wrong_type(path: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(format!(
        "{path}: Input should be a valid {want}, got {}",
        type_name(got)
    ))
}

fn required(path: &str) -> ApiError {
    ApiError::invalid(format!("{path}: Field required"))
}

/// The field, with `null` treated as absent.
fn get<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
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

fn opt_bool(obj: &Map<String, Value>, key: &str, path: &str) -> Result<Option<bool>, ApiError> {
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
                let ty = match obj.get("type") {
                    None | Some(Value::Null) => return Err(required(&format!("{bp}.type"))),
                    Some(Value::String(t)) => t.as_str(),
                    Some(other) => return Err(wrong_type(&format!("{bp}.type"), "string", other)),
                };
                if ty != "text" {
                    return Err(ApiError::invalid(format!(
                        "{bp}.type: content blocks of type `{ty}` are not supported by this server (only `text`)"
                    )));
                }
                match obj.get("text") {
                    None | Some(Value::Null) => return Err(required(&format!("{bp}.text"))),
                    Some(Value::String(t)) => parts.push(t.as_str()),
                    Some(other) => return Err(wrong_type(&format!("{bp}.text"), "string", other)),
                }
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

/// Appends a turn, merging it into the previous one when the role repeats (as the API does).
fn push_turn(out: &mut Vec<ChatMessage>, role: ChatRole, content: String) {
    match out.last_mut() {
        Some(last) if last.role == role && role != ChatRole::System => {
            last.content.push_str("\n\n");
            last.content.push_str(&content);
        }
        _ => out.push(ChatMessage { role, content }),
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
            messages.push(ChatMessage {
                role: ChatRole::System,
                content: text,
            });
        }
    }
    let list = match get(obj, "messages") {
        None => return Err(required("messages")),
        Some(Value::Array(list)) => list,
        Some(other) => return Err(wrong_type("messages", "list", other)),
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages: at least one message is required",
        ));
    }
    for (i, m) in list.iter().enumerate() {
        let path = format!("messages.{i}");
        let Some(m) = m.as_object() else {
            return Err(wrong_type(&path, "object", m));
        };
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
        let content = match m.get("content") {
            None | Some(Value::Null) => return Err(required(&format!("{path}.content"))),
            Some(c) => content_text(c, &format!("{path}.content"), false)?,
        };
        push_turn(&mut messages, role, content);
    }
    let sampling = SamplingParams {
        temperature: opt_f32(obj, "temperature", 0.0, 1.0)?,
        top_p: opt_f32(obj, "top_p", 0.0, 1.0)?,
        top_k: opt_int(obj, "top_k", 0, i64::from(u32::MAX))?
            .filter(|&k| k > 0)
            .map(|k| k as u32),
        ..SamplingParams::default()
    };
    let stop_sequences = match get(obj, "stop_sequences") {
        None => Vec::new(),
        Some(v) => parse_stop_list(v, "stop_sequences", 64)?,
    };
    let stream = opt_bool(obj, "stream", "stream")?.unwrap_or(false);
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
    })
}

/// Validates an OpenAI Chat Completions request (`POST /v1/chat/completions`).
pub(crate) fn parse_chat(body: &Value, limits: Limits) -> Result<GenRequest, ApiError> {
    let obj = parse_object(body)?;
    let model = required_model(obj)?;
    let max = i64::from(limits.max_output_tokens);
    let max_tokens = match opt_int(obj, "max_completion_tokens", 1, max)? {
        Some(n) => n as u32,
        None => opt_int(obj, "max_tokens", 1, max)?.map_or(
            limits.default_chat_max_tokens.min(limits.max_output_tokens),
            |n| n as u32,
        ),
    };
    let list = match get(obj, "messages") {
        None => return Err(required("messages")),
        Some(Value::Array(list)) => list,
        Some(other) => return Err(wrong_type("messages", "list", other)),
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages: at least one message is required",
        ));
    }
    let mut messages = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let path = format!("messages.{i}");
        let Some(m) = m.as_object() else {
            return Err(wrong_type(&path, "object", m));
        };
        let role = match m.get("role") {
            None | Some(Value::Null) => return Err(required(&format!("{path}.role"))),
            Some(Value::String(r)) => match r.as_str() {
                "system" | "developer" => ChatRole::System,
                "user" => ChatRole::User,
                "assistant" => ChatRole::Assistant,
                other => {
                    return Err(ApiError::invalid(format!(
                        "{path}.role: role `{other}` is not supported (use system, developer, user or assistant)"
                    )));
                }
            },
            Some(other) => return Err(wrong_type(&format!("{path}.role"), "string", other)),
        };
        let content = match m.get("content") {
            None => return Err(required(&format!("{path}.content"))),
            Some(c) => content_text(c, &format!("{path}.content"), role == ChatRole::Assistant)?,
        };
        push_turn(&mut messages, role, content);
    }
    if let Some(n) = opt_int(obj, "n", 1, i64::MAX)?.filter(|&n| n != 1) {
        return Err(ApiError::invalid(format!(
            "n: only n=1 is supported, got {n}"
        )));
    }
    let sampling = SamplingParams {
        temperature: opt_f32(obj, "temperature", 0.0, 2.0)?,
        top_p: opt_f32(obj, "top_p", 0.0, 1.0)?,
        top_k: opt_int(obj, "top_k", 0, i64::from(u32::MAX))?
            .filter(|&k| k > 0)
            .map(|k| k as u32),
        seed: opt_int(obj, "seed", i64::MIN, i64::MAX)?.map(|s| s as u64),
        ..SamplingParams::default()
    };
    let stop_sequences = match get(obj, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) if s.is_empty() => {
            return Err(ApiError::invalid("stop: stop sequences must be non-empty"));
        }
        Some(Value::String(s)) => vec![s.clone()],
        Some(v) => parse_stop_list(v, "stop", 4)?,
    };
    let stream = opt_bool(obj, "stream", "stream")?.unwrap_or(false);
    let include_usage = match get(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            opt_bool(o, "include_usage", "stream_options.include_usage")?.unwrap_or(false)
        }
        Some(other) => return Err(wrong_type("stream_options", "object", other)),
    };
    Ok(GenRequest {
        model,
        messages,
        max_tokens,
        sampling,
        stop_sequences,
        stream,
        include_usage,
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
    fn minimal_request_parses() {
        let r = parse_messages(
            &json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "extra": 1}),
            LIMITS,
            false,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 8);
        assert_eq!(
            r.messages,
            vec![ChatMessage {
                role: ChatRole::User,
                content: "hi".into()
            }]
        );
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
            &json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}),
            LIMITS,
        )
        .unwrap_err();
        assert!(e.message.starts_with("n:"));
        let e = parse_chat(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}), LIMITS).unwrap_err();
        assert!(e.message.starts_with("stop:"));
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
