//! Tool use in requests: the `tools` and `tool_choice` of both APIs, and the tool calls and
//! results of earlier turns (Anthropic `tool_use` / `tool_result` content blocks, OpenAI
//! assistant `tool_calls` and role `tool` messages), validated into the service's [`Tools`]
//! and [`ChatMessage`]s.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::error::ApiError;
use super::fields::check_keys;
use super::schema::check_schema_limits;
use super::validate::{get, opt_bool, opt_str_field, required, str_field, wrong_type};
use zerolayer_api::{ChatMessage, ChatRole, ToolCallMessage, ToolChoice, ToolDefinition, Tools};

/// Most tools one request may offer.
const MAX_TOOLS: usize = 128;

/// A request's tools: `None` without any.
#[derive(Debug)]
pub(crate) struct ParsedTools {
    pub(crate) tools: Option<Tools>,
    /// At most one call may be returned (Anthropic `disable_parallel_tool_use`, OpenAI
    /// `parallel_tool_calls: false`).
    pub(crate) single_call: bool,
}

fn invalid(msg: String) -> ApiError {
    ApiError::invalid(msg)
}

/// An optional boolean `key` of `obj` (at `path`), false when absent.
fn opt_flag(obj: &Map<String, Value>, key: &str, path: &str) -> Result<bool, ApiError> {
    Ok(opt_bool(obj, key, &format!("{path}.{key}"))?.unwrap_or(false))
}

/// A tool name as both APIs allow it: 1 to 128 of `[a-zA-Z0-9_-]` (OpenAI allows 64; the
/// larger bound accepts both).
fn check_name(name: &str, path: &str) -> Result<(), ApiError> {
    if name.is_empty()
        || name.len() > 128
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(invalid(format!(
            "{path}: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'"
        )));
    }
    Ok(())
}

/// A tool's input schema: a JSON object (a JSON Schema) within the schema limits.
fn schema(obj: &Map<String, Value>, key: &str, path: &str, must: bool) -> Result<Value, ApiError> {
    match get(obj, key) {
        None if must => Err(required(&format!("{path}.{key}"))),
        None => Ok(serde_json::json!({"type": "object", "properties": {}})),
        Some(v @ Value::Object(_)) => {
            check_schema_limits(v, &format!("{path}.{key}"))?;
            Ok(v.clone())
        }
        Some(v) => Err(wrong_type(&format!("{path}.{key}"), "object", v)),
    }
}

/// One tool's `name`, `description`, `strict` and its schema under `schema_key`.
fn definition(
    obj: &Map<String, Value>,
    schema_key: &str,
    schema_required: bool,
    path: &str,
) -> Result<ToolDefinition, ApiError> {
    let name = str_field(obj, "name", path)?;
    check_name(name, &format!("{path}.name"))?;
    opt_flag(obj, "strict", path)?;
    let mut d = ToolDefinition::new(name, schema(obj, schema_key, path, schema_required)?);
    if let Some(desc) = opt_str_field(obj, "description", path)? {
        d = d.with_description(desc);
    }
    Ok(d)
}

fn tool_list(obj: &Map<String, Value>) -> Result<Option<&Vec<Value>>, ApiError> {
    match get(obj, "tools") {
        None => Ok(None),
        Some(Value::Array(list)) if list.len() > MAX_TOOLS => Err(invalid(format!(
            "tools: at most {MAX_TOOLS} tools are allowed"
        ))),
        Some(Value::Array(list)) => Ok(Some(list)),
        Some(v) => Err(wrong_type("tools", "list", v)),
    }
}

fn no_duplicates(defs: &[ToolDefinition]) -> Result<(), ApiError> {
    for (i, d) in defs.iter().enumerate() {
        if defs[..i].iter().any(|e| e.name == d.name) {
            return Err(invalid(format!(
                "tools.{i}.name: tool names must be unique ({:?} repeats)",
                d.name
            )));
        }
    }
    Ok(())
}

/// The named tool of a `tool_choice` must be one of the tools.
fn check_named(choice: &ToolChoice, defs: &[ToolDefinition], path: &str) -> Result<(), ApiError> {
    if let ToolChoice::Named(n) = choice
        && !defs.iter().any(|d| &d.name == n)
    {
        return Err(invalid(format!(
            "{path}: no tool named {n:?} is in `tools`"
        )));
    }
    Ok(())
}

/// Anthropic `tools` and `tool_choice`.
pub(crate) fn anthropic_tools(obj: &Map<String, Value>) -> Result<ParsedTools, ApiError> {
    let mut defs = Vec::new();
    for (i, t) in tool_list(obj)?.into_iter().flatten().enumerate() {
        let path = format!("tools.{i}");
        let Some(t) = t.as_object() else {
            return Err(wrong_type(&path, "object", t));
        };
        match opt_str_field(t, "type", &path)? {
            None | Some("custom") => {}
            Some(other) => {
                return Err(invalid(format!(
                    "{path}.type: server tools (`{other}`) are not supported by this server; \
                     define the tool yourself (type `custom`)"
                )));
            }
        }
        check_keys(
            t,
            &[
                "type",
                "name",
                "description",
                "input_schema",
                "cache_control",
                "strict",
            ],
            &path,
        )?;
        defs.push(definition(t, "input_schema", true, &path)?);
    }
    no_duplicates(&defs)?;
    let (choice, single_call) = match get(obj, "tool_choice") {
        None => (ToolChoice::Auto, false),
        Some(Value::Object(c)) => {
            check_keys(
                c,
                &["type", "name", "disable_parallel_tool_use"],
                "tool_choice",
            )?;
            let single = opt_flag(c, "disable_parallel_tool_use", "tool_choice")?;
            let choice = match str_field(c, "type", "tool_choice")? {
                "auto" => ToolChoice::Auto,
                "any" => ToolChoice::Any,
                "none" => ToolChoice::None,
                "tool" => ToolChoice::Named(str_field(c, "name", "tool_choice")?.to_owned()),
                other => {
                    return Err(invalid(format!(
                        "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none', got {other:?}"
                    )));
                }
            };
            (choice, single)
        }
        Some(v) => return Err(wrong_type("tool_choice", "object", v)),
    };
    finish(defs, choice, single_call)
}

/// OpenAI `tools`, `tool_choice` and `parallel_tool_calls`.
pub(crate) fn openai_tools(obj: &Map<String, Value>) -> Result<ParsedTools, ApiError> {
    let mut defs = Vec::new();
    for (i, t) in tool_list(obj)?.into_iter().flatten().enumerate() {
        let path = format!("tools.{i}");
        let Some(t) = t.as_object() else {
            return Err(wrong_type(&path, "object", t));
        };
        match str_field(t, "type", &path)? {
            "function" => {}
            other => {
                return Err(invalid(format!(
                    "{path}.type: tools of type `{other}` are not supported (only `function`)"
                )));
            }
        }
        check_keys(t, &["type", "function"], &path)?;
        let fpath = format!("{path}.function");
        let f = match get(t, "function") {
            None => return Err(required(&fpath)),
            Some(Value::Object(f)) => f,
            Some(v) => return Err(wrong_type(&fpath, "object", v)),
        };
        check_keys(f, &["name", "description", "parameters", "strict"], &fpath)?;
        defs.push(definition(f, "parameters", false, &fpath)?);
    }
    no_duplicates(&defs)?;
    let choice = match get(obj, "tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Any,
            "none" => ToolChoice::None,
            other => {
                return Err(invalid(format!(
                    "tool_choice: Input should be 'none', 'auto', 'required' or a named function, got {other:?}"
                )));
            }
        },
        Some(Value::Object(c)) => {
            check_keys(c, &["type", "function"], "tool_choice")?;
            if str_field(c, "type", "tool_choice")? != "function" {
                return Err(invalid(
                    "tool_choice.type: only `function` is supported".into(),
                ));
            }
            let f = match get(c, "function") {
                Some(Value::Object(f)) => f,
                Some(v) => return Err(wrong_type("tool_choice.function", "object", v)),
                None => return Err(required("tool_choice.function")),
            };
            check_keys(f, &["name"], "tool_choice.function")?;
            ToolChoice::Named(str_field(f, "name", "tool_choice.function")?.to_owned())
        }
        Some(v) => return Err(wrong_type("tool_choice", "string or object", v)),
    };
    let single_call = match get(obj, "parallel_tool_calls") {
        None => false,
        Some(Value::Bool(b)) => !b,
        Some(v) => return Err(wrong_type("parallel_tool_calls", "boolean", v)),
    };
    finish(defs, choice, single_call)
}

fn finish(
    defs: Vec<ToolDefinition>,
    choice: ToolChoice,
    single_call: bool,
) -> Result<ParsedTools, ApiError> {
    check_named(&choice, &defs, "tool_choice")?;
    if defs.is_empty() {
        if matches!(choice, ToolChoice::Any | ToolChoice::Named(_)) {
            return Err(invalid(
                "tool_choice: a tool call is required but `tools` is empty".into(),
            ));
        }
        return Ok(ParsedTools {
            tools: None,
            single_call,
        });
    }
    Ok(ParsedTools {
        tools: Some(Tools::new(defs).with_choice(choice)),
        single_call,
    })
}

/// The text of a `tool_result`'s `content`: a string or a list of text blocks.
fn result_text(v: Option<&Value>, path: &str) -> Result<String, ApiError> {
    match v {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let bp = format!("{path}.{i}");
                let Some(b) = b.as_object() else {
                    return Err(wrong_type(&bp, "object", b));
                };
                match get(b, "type").and_then(Value::as_str) {
                    Some("text") => {}
                    Some(t) => {
                        return Err(invalid(format!(
                            "{bp}.type: tool results of type `{t}` are not supported by this server (only `text`)"
                        )));
                    }
                    None => return Err(required(&format!("{bp}.type"))),
                }
                check_keys(b, &["type", "text", "cache_control"], &bp)?;
                parts.push(str_field(b, "text", &bp)?.to_owned());
            }
            Ok(parts.join("\n"))
        }
        Some(v) => Err(wrong_type(path, "string or list of content blocks", v)),
    }
}

/// Tracks the calls of earlier turns so each result names its tool.
#[derive(Debug, Default)]
pub(crate) struct CallNames {
    names: HashMap<String, String>,
}

impl CallNames {
    fn name_of(&self, id: &str, path: &str) -> Result<String, ApiError> {
        self.names
            .get(id)
            .cloned()
            .ok_or_else(|| invalid(format!("{path}: no earlier tool call has the id {id:?}")))
    }
}

/// One Anthropic message's content as turns: text blocks (joined), `tool_use` blocks (an
/// assistant's calls) and `tool_result` blocks (a user's results, each a `tool` turn placed
/// before the user's text). Plain string content is one text turn.
pub(crate) fn anthropic_turns(
    role: ChatRole,
    content: &Value,
    path: &str,
    calls: &mut CallNames,
) -> Result<Vec<ChatMessage>, ApiError> {
    let blocks = match content {
        Value::String(s) => return Ok(vec![ChatMessage::new(role, s.clone())]),
        Value::Array(b) => b,
        other => return Err(wrong_type(path, "string or list of content blocks", other)),
    };
    let mut text = Vec::new();
    let mut tool_calls = Vec::new();
    let mut results = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let bp = format!("{path}.{i}");
        let Some(obj) = b.as_object() else {
            return Err(wrong_type(&bp, "object", b));
        };
        let ty = str_field(obj, "type", &bp)?;
        match (ty, role) {
            ("text", _) => {
                check_keys(obj, &["type", "text", "cache_control", "citations"], &bp)?;
                if get(obj, "citations").is_some_and(|c| c.as_array().is_none_or(|a| !a.is_empty()))
                {
                    return Err(invalid(format!(
                        "{bp}.citations: citations are not supported by this server"
                    )));
                }
                text.push(str_field(obj, "text", &bp)?.to_owned());
            }
            ("tool_use", ChatRole::Assistant) => {
                check_keys(obj, &["type", "id", "name", "input", "cache_control"], &bp)?;
                let id = str_field(obj, "id", &bp)?;
                let name = str_field(obj, "name", &bp)?;
                let input = match get(obj, "input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(v) => return Err(wrong_type(&format!("{bp}.input"), "object", v)),
                    None => return Err(required(&format!("{bp}.input"))),
                };
                calls.names.insert(id.to_owned(), name.to_owned());
                tool_calls.push(ToolCallMessage::new(id, name, input));
            }
            ("tool_result", ChatRole::User) => {
                check_keys(
                    obj,
                    &[
                        "type",
                        "tool_use_id",
                        "content",
                        "is_error",
                        "cache_control",
                    ],
                    &bp,
                )?;
                let id = str_field(obj, "tool_use_id", &bp)?;
                let name = calls.name_of(id, &format!("{bp}.tool_use_id"))?;
                let mut body = result_text(get(obj, "content"), &format!("{bp}.content"))?;
                if opt_flag(obj, "is_error", &bp)? {
                    body = format!("Error: {body}");
                }
                results.push(ChatMessage::new(ChatRole::Tool, body).with_tool_result(id, name));
            }
            ("tool_use" | "tool_result", _) => {
                return Err(invalid(format!(
                    "{bp}.type: `{ty}` blocks belong in {} messages",
                    if ty == "tool_use" {
                        "assistant"
                    } else {
                        "user"
                    }
                )));
            }
            _ => {
                return Err(invalid(format!(
                    "{bp}.type: content blocks of type `{ty}` are not supported by this server (only `text`, `tool_use` and `tool_result`)"
                )));
            }
        }
    }
    let mut out = results;
    if !text.is_empty() || !tool_calls.is_empty() || out.is_empty() {
        out.push(ChatMessage::new(role, text.join("\n")).with_tool_calls(tool_calls));
    }
    Ok(out)
}

/// An OpenAI assistant message's `tool_calls` (arguments are JSON text).
pub(crate) fn openai_calls(
    v: Option<&Value>,
    path: &str,
    calls: &mut CallNames,
) -> Result<Vec<ToolCallMessage>, ApiError> {
    let list = match v {
        None => return Ok(Vec::new()),
        Some(Value::Array(l)) => l,
        Some(v) => return Err(wrong_type(path, "list", v)),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        let cp = format!("{path}.{i}");
        let Some(c) = c.as_object() else {
            return Err(wrong_type(&cp, "object", c));
        };
        check_keys(c, &["id", "type", "function"], &cp)?;
        if let Some(t) = opt_str_field(c, "type", &cp)?.filter(|t| *t != "function") {
            return Err(invalid(format!(
                "{cp}.type: only `function` calls are supported, got {t:?}"
            )));
        }
        let id = str_field(c, "id", &cp)?;
        let fp = format!("{cp}.function");
        let f = match get(c, "function") {
            Some(Value::Object(f)) => f,
            Some(v) => return Err(wrong_type(&fp, "object", v)),
            None => return Err(required(&fp)),
        };
        check_keys(f, &["name", "arguments"], &fp)?;
        let name = str_field(f, "name", &fp)?;
        let args = str_field(f, "arguments", &fp)?;
        let arguments: Value = serde_json::from_str(args)
            .map_err(|e| invalid(format!("{fp}.arguments: not valid JSON ({e})")))?;
        calls.names.insert(id.to_owned(), name.to_owned());
        out.push(ToolCallMessage::new(id, name, arguments));
    }
    Ok(out)
}

/// An OpenAI `tool` message: the result of call `tool_call_id`.
pub(crate) fn openai_result(
    m: &Map<String, Value>,
    content: String,
    path: &str,
    calls: &CallNames,
) -> Result<ChatMessage, ApiError> {
    let id = str_field(m, "tool_call_id", path)?;
    let name = calls.name_of(id, &format!("{path}.tool_call_id"))?;
    Ok(ChatMessage::new(ChatRole::Tool, content).with_tool_result(id, name))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn anthropic_tools_and_choices() {
        let t = anthropic_tools(&obj(json!({
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}},
                      {"type": "custom", "name": "now", "input_schema": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "tool", "name": "now", "disable_parallel_tool_use": true}})))
        .unwrap();
        let tools = t.tools.unwrap();
        assert_eq!(tools.tools.len(), 2);
        assert_eq!(tools.tools[0].description.as_deref(), Some("Weather"));
        assert_eq!(tools.choice, ToolChoice::Named("now".into()));
        assert!(t.single_call);
        let err = |v: Value| anthropic_tools(&obj(v)).err().unwrap().message;
        assert!(
            err(json!({"tools": [{"name": "a b", "input_schema": {}}]}))
                .starts_with("tools.0.name:")
        );
        assert!(
            err(json!({"tools": [{"name": "a"}]}))
                .starts_with("tools.0.input_schema: Field required")
        );
        assert!(
            err(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}))
                .starts_with("tools.0.type: server tools")
        );
        assert!(err(json!({"tools": [{"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]})).starts_with("tools.1.name:"));
        assert!(err(json!({"tools": [{"name": "a", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "b"}})).starts_with("tool_choice: no tool named"));
        assert!(
            err(json!({"tool_choice": {"type": "any"}}))
                .starts_with("tool_choice: a tool call is required")
        );
        assert!(err(json!({"tools": [{"name": "a", "input_schema": {}}], "tool_choice": {"type": "sometimes"}})).starts_with("tool_choice.type:"));
        assert!(
            anthropic_tools(&obj(json!({"tools": []})))
                .unwrap()
                .tools
                .is_none()
        );
    }

    #[test]
    fn openai_tools_and_choices() {
        let base = json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                                    {"type": "function", "function": {"name": "g"}}]});
        let with = |extra: Value| {
            let mut b = obj(base.clone());
            b.extend(obj(extra));
            openai_tools(&b)
        };
        let t = with(json!({"tool_choice": "required", "parallel_tool_calls": false})).unwrap();
        assert_eq!(t.tools.as_ref().unwrap().choice, ToolChoice::Any);
        assert!(t.single_call);
        assert_eq!(t.tools.unwrap().tools[1].parameters["type"], "object");
        let t =
            with(json!({"tool_choice": {"type": "function", "function": {"name": "g"}}})).unwrap();
        assert_eq!(t.tools.unwrap().choice, ToolChoice::Named("g".into()));
        assert!(
            with(json!({"tool_choice": "maybe"}))
                .unwrap_err()
                .message
                .starts_with("tool_choice:")
        );
        assert!(
            with(json!({"tool_choice": {"type": "function", "function": {"name": "h"}}}))
                .unwrap_err()
                .message
                .starts_with("tool_choice: no tool named")
        );
        let e =
            openai_tools(&obj(json!({"tools": [{"type": "custom", "custom": {}}]}))).unwrap_err();
        assert!(e.message.starts_with("tools.0.type:"), "{}", e.message);
    }

    #[test]
    fn anthropic_blocks_become_calls_and_results() {
        let mut names = CallNames::default();
        let a = anthropic_turns(
            ChatRole::Assistant,
            &json!([{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "Oslo"}}]),
            "messages.1.content",
            &mut names,
        )
        .unwrap();
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].content, "Checking.");
        assert_eq!(a[0].tool_calls[0].arguments, json!({"c": "Oslo"}));
        let u = anthropic_turns(
            ChatRole::User,
            &json!([{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3 C"}]},
                    {"type": "text", "text": "And tomorrow?"}]),
            "messages.2.content",
            &mut names,
        )
        .unwrap();
        assert_eq!(u.len(), 2);
        assert_eq!(u[0].role, ChatRole::Tool);
        assert_eq!(u[0].tool_name.as_deref(), Some("w"));
        assert_eq!(u[0].content, "-3 C");
        assert_eq!(u[1].content, "And tomorrow?");
        let e = anthropic_turns(
            ChatRole::User,
            &json!([{"type": "tool_result", "tool_use_id": "toolu_9"}]),
            "m",
            &mut names,
        )
        .unwrap_err();
        assert!(
            e.message
                .starts_with("m.0.tool_use_id: no earlier tool call"),
            "{}",
            e.message
        );
        let e = anthropic_turns(
            ChatRole::User,
            &json!([{"type": "tool_use", "id": "x", "name": "w", "input": {}}]),
            "m",
            &mut names,
        )
        .unwrap_err();
        assert!(
            e.message.contains("belong in assistant messages"),
            "{}",
            e.message
        );
        let e = anthropic_turns(ChatRole::User, &json!([{"type": "image"}]), "m", &mut names)
            .unwrap_err();
        assert!(
            e.message
                .starts_with("m.0.type: content blocks of type `image`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn openai_calls_need_json_arguments() {
        let mut names = CallNames::default();
        let calls = openai_calls(
            Some(&json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 2}"}}])),
            "messages.1.tool_calls",
            &mut names,
        )
        .unwrap();
        assert_eq!(calls[0].arguments, json!({"x": 2}));
        let r = openai_result(
            &obj(json!({"tool_call_id": "call_1"})),
            "4".into(),
            "messages.2",
            &names,
        )
        .unwrap();
        assert_eq!(r.tool_name.as_deref(), Some("f"));
        let e = openai_calls(
            Some(&json!([{"id": "c", "function": {"name": "f", "arguments": "{"}}])),
            "t",
            &mut names,
        )
        .unwrap_err();
        assert!(
            e.message
                .starts_with("t.0.function.arguments: not valid JSON"),
            "{}",
            e.message
        );
    }
}
