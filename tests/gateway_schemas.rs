//! JSON Schemas that the grammar compiler cannot use (a recursion with no way out, more
//! alternatives than it takes at once, more than the gateway's size limit) in
//! `output_config.format`, `response_format` or a forced tool's schema: the gateway over the
//! real service answers 400 `invalid_request_error` naming the request field, with none of the
//! compiler's internals (parser state, grammar dump), and a good schema in the same place
//! still works.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use serde_json::{Value, json};
use zerolayer::EngineService;

/// A gateway over the default model on loopback, started once for the file's tests.
fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let model = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the cached default model is not modified while the tests run.
        let svc = unsafe { EngineService::load(&model, Default::default(), Default::default()) }
            .expect("load");
        common::serve(svc)
    })
}

/// POSTs `body` as JSON; returns the status and the JSON body.
fn post(path: &str, body: &Value) -> (u16, Value) {
    common::http_json(server(), "POST", path, Some(body))
}

/// Asserts a 400 `invalid_request_error` (in either API's shape) whose message starts with
/// `field: ` and carries nothing of the compiler's inside.
fn assert_refused(status: u16, v: &Value, field: &str) {
    let error = &v["error"];
    assert_eq!(status, 400, "{v}");
    assert_eq!(error["type"], "invalid_request_error", "{v}");
    let message = error["message"].as_str().unwrap();
    assert!(message.starts_with(&format!("{field}: ")), "{message}");
    for internal in [
        "<state>",
        "<grammar>",
        "Tokens:",
        "Parser:",
        "<non-verbose/>",
        "\n",
    ] {
        assert!(!message.contains(internal), "{internal:?} in {message:?}");
    }
    assert!(message.len() < 400, "{} bytes: {message}", message.len());
}

fn recursive() -> Value {
    json!({"$ref": "#"})
}

/// An `anyOf` of `n` distinct constants (two JSON values each).
fn constants(n: usize) -> Value {
    json!({"anyOf": (0..n).map(|i| json!({"const": format!("v{i}")})).collect::<Vec<_>>()})
}

/// An `anyOf` of `n` objects, each requiring a key of its own (three JSON values each).
fn objects(n: usize) -> Value {
    json!({"anyOf": (0..n).map(|i| json!({"required": [format!("k{i}")]})).collect::<Vec<_>>()})
}

fn messages(extra: Value) -> Value {
    let mut body = json!({"model": "m", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn a_recursive_output_schema_is_a_400_naming_output_config_format_schema() {
    let body = messages(json!({"output_config": {"format":
        {"type": "json_schema", "schema": recursive()}}}));
    let (status, v) = post("/v1/messages", &body);
    assert_refused(status, &v, "output_config.format.schema");
}

#[test]
fn a_recursive_response_format_schema_is_a_400_naming_it() {
    let body = json!({"model": "m", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "r", "schema": recursive()}}});
    let (status, v) = post("/v1/chat/completions", &body);
    assert_refused(status, &v, "response_format.json_schema.schema");
}

#[test]
fn a_forced_tool_with_a_recursive_schema_is_a_400_naming_its_input_schema() {
    let body = messages(json!({
        "tools": [{"name": "loop", "input_schema": recursive()}],
        "tool_choice": {"type": "tool", "name": "loop"}}));
    let (status, v) = post("/v1/messages", &body);
    assert_refused(status, &v, "tools.0.input_schema");
}

#[test]
fn among_required_tools_the_one_whose_schema_fails_is_named() {
    let body = json!({"model": "m", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [
            {"type": "function", "function": {"name": "ok",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "loop", "parameters": recursive()}}],
        "tool_choice": "required"});
    let (status, v) = post("/v1/chat/completions", &body);
    assert_refused(status, &v, "tools.1.function.parameters");
}

#[test]
fn five_thousand_alternatives_are_a_400_before_compilation() {
    let body = messages(json!({"output_config": {"format":
        {"type": "json_schema", "schema": constants(5000)}}}));
    let (status, v) = post("/v1/messages", &body);
    assert_refused(status, &v, "output_config.format.schema");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too large"),
        "{v}"
    );
}

#[test]
fn alternatives_beyond_the_compilers_limit_are_a_400_not_a_failed_generation() {
    // Within the gateway's size limit, so the compiler sees it; its first token (`{`) is fine,
    // the keys after it are more alternatives than the compiler takes at one point. Found
    // while generating, the schema is named as the service knows it.
    let body = messages(json!({"max_tokens": 8, "output_config": {"format":
        {"type": "json_schema", "schema": objects(2100)}}}));
    let (status, v) = post("/v1/messages", &body);
    assert_refused(status, &v, "output_format");
}

#[test]
fn a_usable_schema_in_the_same_place_constrains_the_reply() {
    let body = messages(json!({"max_tokens": 24, "output_config": {"format":
        {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}}}));
    let (status, v) = post("/v1/messages", &body);
    assert_eq!(status, 200, "{v}");
    let text = v["content"][0]["text"].as_str().unwrap();
    assert!(text == "\"yes\"" || text == "\"no\"", "{text:?}");
}
