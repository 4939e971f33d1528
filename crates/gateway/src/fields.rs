//! Which request fields this gateway honours, and a 400 naming every other one: a field the
//! server would silently ignore (a logit bias, extended thinking) changes what the
//! client gets, so it is refused instead. `null` counts as absent (clients echo back
//! `"tool_calls": null` and the like).
//!
//! Fields that change nothing a model produces are accepted and documented as ignored:
//! Anthropic `metadata` (an end-user id for abuse tracking) and `cache_control` on content
//! blocks (a prompt-caching hint; the prefix cache works without it), OpenAI `user` and
//! `safety_identifier` (end-user ids), `store: false`, and `service_tier: "auto" | "default"`.

use serde_json::{Map, Value};

use super::error::ApiError;

/// The request kinds whose fields are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

/// Sampling fields accepted by every generating endpoint beyond its API's own (llama.cpp's and
/// vLLM's names; the 2.x Anthropic SDK sends them with `extra_body`).
const SAMPLING_EXTENSIONS: &[&str] = &[
    "top_k",
    "min_p",
    "repetition_penalty",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "temperature",
    "top_p",
];

const MESSAGES: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "metadata",
];

const CHAT: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "user",
    "safety_identifier",
];

const COMPLETIONS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "suffix",
    "best_of",
    "user",
];

/// The verdict on a field this module knows by name beyond the honoured lists: `Some(Ok)` for
/// a harmless value (accepted and ignored), `Some(Err(reason))` for a refused one, `None` for
/// any other field.
fn special(api: Api, key: &str, value: &Value) -> Option<Result<(), &'static str>> {
    let ty = value.get("type").and_then(Value::as_str);
    Some(match (api, key) {
        // Parsed by `tools.rs` where the API has them.
        (Api::Messages | Api::CountTokens, "tools" | "tool_choice") => Ok(()),
        (Api::Chat, "tools" | "tool_choice" | "parallel_tool_calls") => Ok(()),
        (Api::Chat, "functions" | "function_call") => {
            Err("the deprecated functions API is not supported: use `tools` and `tool_choice`")
        }
        (_, "tools" | "tool_choice" | "parallel_tool_calls" | "functions" | "function_call") => {
            Err("tool use is available on /v1/messages and /v1/chat/completions")
        }
        (Api::Messages | Api::CountTokens, "thinking") if ty == Some("disabled") => Ok(()),
        (Api::Messages | Api::CountTokens, "thinking") => {
            Err("extended thinking is not supported (only {\"type\": \"disabled\"})")
        }
        // Parsed by `format.rs` where the API has them.
        (Api::Chat, "response_format") => Ok(()),
        (Api::Messages | Api::CountTokens, "output_config" | "output_format") => Ok(()),
        (Api::Completions, "response_format") => {
            Err("structured output is available on /v1/chat/completions, not /v1/completions")
        }
        (_, "logit_bias") => Err("logit_bias is not supported"),
        (Api::Chat, "store") if value == &Value::Bool(false) => Ok(()),
        (Api::Chat | Api::Messages, "service_tier")
            if matches!(value.as_str(), Some("auto" | "default" | "standard_only")) =>
        {
            Ok(())
        }
        (_, "modalities" | "audio") => Err("audio output is not supported"),
        _ => return None,
    })
}

/// Whether a top-level field `key` is one this endpoint honours (or ignores harmlessly).
fn known(api: Api, key: &str) -> bool {
    let own = match api {
        // count_tokens takes a Messages body (its generation fields do not change the count).
        Api::Messages | Api::CountTokens => MESSAGES,
        Api::Chat => CHAT,
        Api::Completions => COMPLETIONS,
    };
    own.contains(&key) || SAMPLING_EXTENSIONS.contains(&key)
}

/// A 400 naming the first field of `obj` (in the body's order) that this endpoint does not
/// honour.
///
/// ```ignore
/// check_fields(&json!({"model": "m", "logit_bias": {}}), Api::Chat) // Err: "logit_bias: ..."
/// ```
pub(crate) fn check_fields(obj: &Map<String, Value>, api: Api) -> Result<(), ApiError> {
    for (key, value) in obj {
        if value.is_null() {
            continue;
        }
        match special(api, key, value) {
            Some(Ok(())) => {}
            Some(Err(reason)) => return Err(ApiError::invalid(format!("{key}: {reason}"))),
            None if known(api, key) => {}
            None => {
                return Err(ApiError::invalid(format!(
                    "{key}: this field is not supported by this server"
                )));
            }
        }
    }
    Ok(())
}

/// A 400 naming the first key of an object at `path` (a message or a content block) outside
/// `allowed` (`null` values pass).
pub(crate) fn check_keys(
    obj: &Map<String, Value>,
    allowed: &[&str],
    path: &str,
) -> Result<(), ApiError> {
    match obj
        .iter()
        .find(|(k, v)| !v.is_null() && !allowed.contains(&k.as_str()))
    {
        None => Ok(()),
        Some((k, _)) => Err(ApiError::invalid(format!(
            "{path}.{k}: this field is not supported by this server"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn check(body: Value, api: Api) -> Result<(), String> {
        check_fields(body.as_object().unwrap(), api).map_err(|e| e.message)
    }

    #[test]
    fn honoured_and_harmless_fields_pass() {
        let ok = json!({"model": "m", "max_tokens": 1, "messages": [], "temperature": 1,
            "repeat_penalty": 1.1, "seed": 3, "metadata": {}, "thinking": {"type": "disabled"},
            "tools": null, "service_tier": "auto"});
        assert_eq!(check(ok, Api::Messages), Ok(()));
        let ok = json!({"model": "m", "messages": [], "logprobs": true, "top_logprobs": 2,
            "user": "u", "store": false, "response_format": {"type": "text"}, "min_p": 0.1});
        assert_eq!(check(ok, Api::Chat), Ok(()));
    }

    #[test]
    fn unsupported_fields_are_named() {
        assert_eq!(
            check(json!({"model": "m", "tools": [{}]}), Api::Messages),
            Ok(())
        );
        let e = check(json!({"model": "m", "tools": [{}]}), Api::Completions).unwrap_err();
        assert!(e.starts_with("tools: tool use is available on"), "{e}");
        let e = check(json!({"functions": [{}]}), Api::Chat).unwrap_err();
        assert!(
            e.starts_with("functions: the deprecated functions API"),
            "{e}"
        );
        let e = check(json!({"thinking": {"type": "enabled"}}), Api::Messages).unwrap_err();
        assert!(e.starts_with("thinking:"), "{e}");
        let e = check(
            json!({"response_format": {"type": "json_object"}}),
            Api::Completions,
        )
        .unwrap_err();
        assert!(e.starts_with("response_format: structured output"), "{e}");
        let e = check(json!({"output_config": {}}), Api::Chat).unwrap_err();
        assert!(
            e.starts_with("output_config: this field is not supported"),
            "{e}"
        );
        let e = check(json!({"logit_bias": {"1": 5}}), Api::Chat).unwrap_err();
        assert!(e.starts_with("logit_bias:"), "{e}");
        let e = check(json!({"store": true}), Api::Chat).unwrap_err();
        assert!(e.starts_with("store: this field is not supported"), "{e}");
        let e = check(json!({"frobnicate": 1}), Api::Completions).unwrap_err();
        assert_eq!(e, "frobnicate: this field is not supported by this server");
        assert_eq!(
            check(json!({"max_tokens": 3, "tools": []}), Api::CountTokens),
            Ok(())
        );
    }

    #[test]
    fn nested_keys_are_checked() {
        let block = json!({"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}});
        let allowed = ["type", "text", "cache_control"];
        assert!(check_keys(block.as_object().unwrap(), &allowed, "m.0").is_ok());
        let block = json!({"type": "text", "text": "x", "citations": [1]});
        let e = check_keys(block.as_object().unwrap(), &allowed, "m.0").unwrap_err();
        assert_eq!(
            e.message,
            "m.0.citations: this field is not supported by this server"
        );
    }
}
