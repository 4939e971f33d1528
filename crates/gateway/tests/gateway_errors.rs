//! Error answers: shapes, statuses, validation messages, auth, limits, retry headers, mid-stream
//! failures, timeouts and cancellation on disconnect.

mod gateway_support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use gateway_support::*;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zerolayer_gateway::GatewayConfig;

const V1: (&str, &str) = ("anthropic-version", "2023-06-01");

/// Checks the Anthropic error shape and returns the message.
fn error_of(r: &Resp, status: u16, ty: &str) -> String {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], ty);
    let id = r.header("request-id").expect("request-id header");
    assert_eq!(v["request_id"], id);
    assert!(r.header("x-claude-layer").is_some());
    v["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn validation_errors_name_the_field() {
    let s = TestServer::start(GatewayConfig::default().max_output_tokens(4096)).await;
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"model": "word-model", "messages": [{"role": "user", "content": "x"}]}),
            "max_tokens: Field required",
        ),
        (
            json!({"model": "word-model", "max_tokens": "5", "messages": []}),
            "max_tokens: Input should be a valid integer",
        ),
        (
            json!({"model": "word-model", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
            "max_tokens:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 99999, "messages": [{"role": "user", "content": "x"}]}),
            "max_tokens:",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
            "model: Field required",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5}),
            "messages: Field required",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]}),
            "messages.0.role:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]}),
            "messages.0.content:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
            "messages.0.content.0.text:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "temperature": 3, "messages": [{"role": "user", "content": "x"}]}),
            "temperature:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "top_p": "a", "messages": [{"role": "user", "content": "x"}]}),
            "top_p:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "top_k": 1.5, "messages": [{"role": "user", "content": "x"}]}),
            "top_k:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "stop_sequences": [""], "messages": [{"role": "user", "content": "x"}]}),
            "stop_sequences.0:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "stream": 1, "messages": [{"role": "user", "content": "x"}]}),
            "stream:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "system": {"a": 1}, "messages": [{"role": "user", "content": "x"}]}),
            "system:",
        ),
        (
            json!({"model": "word-model", "max_tokens": 5, "metadata": {"user_id": 3}, "messages": [{"role": "user", "content": "x"}]}),
            "metadata.user_id:",
        ),
    ];
    for (body, prefix) in cases {
        let r = s.post("/v1/messages", &[V1], &body).await;
        let msg = error_of(&r, 400, "invalid_request_error");
        assert!(
            msg.starts_with(prefix),
            "{body} -> {msg:?}, want prefix {prefix:?}"
        );
    }
    let r = send(
        s.addr,
        "POST",
        "/v1/messages",
        &[V1],
        Bytes::from_static(b"{not json"),
    )
    .await;
    assert!(error_of(&r, 400, "invalid_request_error").contains("invalid JSON"));
}

#[tokio::test]
async fn schemas_over_the_depth_or_size_limit_are_a_400_naming_their_field() {
    let s = TestServer::start(GatewayConfig::default()).await;
    // 70 levels of `items`; an `anyOf` of 5,000 alternatives.
    let deep = (0..70).fold(
        json!({"type": "string"}),
        |inner, _| json!({"items": inner}),
    );
    let wide = json!({"anyOf": (0..5000).map(|i| json!({"const": i})).collect::<Vec<_>>()});
    for (schema, why) in [(deep, "nests deeper than 64 levels"), (wide, "too large")] {
        let base = json!({"model": "word-model", "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}]});
        let with = |extra: Value| {
            let mut b = base.clone();
            b.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            b
        };
        let cases = [
            (
                "/v1/messages",
                with(json!({"output_config": {"format":
                    {"type": "json_schema", "schema": schema}}})),
                "output_config.format.schema",
            ),
            (
                "/v1/messages",
                with(json!({"output_format": {"type": "json_schema", "schema": schema}})),
                "output_format.schema",
            ),
            (
                "/v1/messages",
                with(json!({"tools": [{"name": "t", "input_schema": schema}]})),
                "tools.0.input_schema",
            ),
            (
                "/v1/chat/completions",
                with(json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "r", "schema": schema}}})),
                "response_format.json_schema.schema",
            ),
            (
                "/v1/chat/completions",
                with(json!({"tools": [{"type": "function",
                    "function": {"name": "ok", "parameters": {"type": "object"}}},
                    {"type": "function", "function": {"name": "t", "parameters": schema}}]})),
                "tools.1.function.parameters",
            ),
        ];
        for (path, body, field) in cases {
            let r = s.post(path, &[V1], &body).await;
            assert_eq!(r.status, 400, "{path} {field}: {}", r.text());
            let v = r.json();
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(message.starts_with(&format!("{field}: ")), "{message}");
            assert!(message.contains(why), "{message}");
        }
    }
}

#[tokio::test]
async fn not_found_and_too_large() {
    let s = TestServer::start(GatewayConfig::default().max_body_bytes(256)).await;
    let r = s.get("/v1/nothing", &[]).await;
    error_of(&r, 404, "not_found_error");
    let r = s.get("/v1/messages", &[]).await;
    error_of(&r, 404, "not_found_error");
    let big = user(&"word ".repeat(200));
    let r = s.post("/v1/messages", &[V1], &big).await;
    let msg = error_of(&r, 413, "request_too_large");
    assert!(msg.contains("256"));
}

#[tokio::test]
async fn auth_accepts_both_header_styles_in_constant_time_check() {
    let s = TestServer::start(
        GatewayConfig::default().api_keys(["sk-good".to_string(), "sk-other".to_string()]),
    )
    .await;
    let body = user("a");
    let r = s.post("/v1/messages", &[V1], &body).await;
    assert!(error_of(&r, 401, "authentication_error").contains("x-api-key"));
    let r = s
        .post("/v1/messages", &[V1, ("x-api-key", "sk-bad")], &body)
        .await;
    error_of(&r, 401, "authentication_error");
    let r = s
        .post("/v1/messages", &[("authorization", "Bearer sk-goo")], &body)
        .await;
    error_of(&r, 401, "authentication_error");
    assert_eq!(
        s.post("/v1/messages", &[V1, ("x-api-key", "sk-good")], &body)
            .await
            .status,
        200
    );
    let r = s
        .post(
            "/v1/messages",
            &[
                ("anthropic-version", "2026-10-21"),
                ("authorization", "Bearer sk-other"),
            ],
            &body,
        )
        .await;
    assert_eq!(r.status, 200);
    // x-api-key wins over Authorization when both are sent.
    let r = s
        .post(
            "/v1/messages",
            &[("x-api-key", "sk-bad"), ("authorization", "Bearer sk-good")],
            &body,
        )
        .await;
    assert_eq!(r.status, 401);
    // Chat Completions answers auth failures in OpenAI's shape.
    let r = s
        .post(
            "/v1/chat/completions",
            &[("authorization", "Bearer nope")],
            &json!({}),
        )
        .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(s.get("/health", &[]).await.status, 200);
    assert_eq!(s.get("/metrics", &[]).await.status, 200);
}

#[tokio::test]
async fn overload_answers_529_with_retry_headers() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let r = s
        .post("/v1/messages", &[V1], &user("please OVERLOAD now"))
        .await;
    error_of(&r, 529, "overloaded_error");
    assert_eq!(r.header("retry-after-ms"), Some("25"));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("x-should-retry"), Some("true"));
}

#[tokio::test]
async fn concurrency_limits_give_529_and_429() {
    let s = TestServer::start(
        GatewayConfig::default()
            .max_concurrent_requests(1)
            .retry_after_ms(1500),
    )
    .await;
    let mut slow = user("SLOW");
    slow["stream"] = json!(true);
    slow["max_tokens"] = json!(100_000);
    let held = open_stream(s.addr, &slow, &[]).await;
    let r = s.post("/v1/messages", &[V1], &user("a")).await;
    error_of(&r, 529, "overloaded_error");
    assert_eq!(r.header("retry-after-ms"), Some("1500"));
    assert_eq!(r.header("retry-after"), Some("2"));
    drop(held);
    eventually(|| s.gateway.in_flight() == 0).await;
    assert_eq!(s.post("/v1/messages", &[V1], &user("a")).await.status, 200);

    let s = TestServer::start(
        GatewayConfig::default()
            .api_keys(["k1".to_string(), "k2".to_string()])
            .max_concurrent_per_key(1),
    )
    .await;
    let held = open_stream(s.addr, &slow, &[("x-api-key", "k1")]).await;
    let r = s
        .post("/v1/messages", &[V1, ("x-api-key", "k1")], &user("a"))
        .await;
    error_of(&r, 429, "rate_limit_error");
    assert_eq!(r.header("x-should-retry"), Some("true"));
    assert_eq!(
        s.post("/v1/messages", &[V1, ("x-api-key", "k2")], &user("a"))
            .await
            .status,
        200
    );
    drop(held);
}

#[tokio::test]
async fn context_length_is_a_400() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let r = s
        .post("/v1/messages", &[V1], &user(&"w ".repeat(100)))
        .await;
    let msg = error_of(&r, 400, "invalid_request_error");
    assert!(
        msg.starts_with("prompt is too long: 101 tokens > 64 maximum"),
        "{msg}"
    );
    let s = TestServer::start(GatewayConfig::default().max_prompt_tokens(Some(5))).await;
    let r = s.post("/v1/messages", &[V1], &user("a b c d e f")).await;
    let msg = error_of(&r, 400, "invalid_request_error");
    assert!(
        msg.starts_with("prompt is too long: 7 tokens > 5 maximum"),
        "{msg}"
    );
}

#[tokio::test]
async fn mid_stream_failure_is_an_error_event() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let mut body = user("x y FAILMID z");
    body["stream"] = json!(true);
    let r = s.post("/v1/messages", &[V1], &body).await;
    assert_eq!(r.status, 200);
    let events = parse_sse(r.text());
    let last = events.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"));
    let v = last.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "api_error");
    assert_eq!(v["error"]["message"], "engine failure");
    assert_eq!(v["request_id"], r.header("request-id").unwrap());
    assert!(
        events
            .iter()
            .all(|e| e.event.as_deref() != Some("message_stop"))
    );
    // Without streaming the same failure is a 500.
    let r = s.post("/v1/messages", &[V1], &user("x y FAILMID z")).await;
    error_of(&r, 500, "api_error");
}

#[tokio::test]
async fn request_timeout() {
    let s = TestServer::start(GatewayConfig::default().request_timeout(Duration::from_millis(200)))
        .await;
    let mut body = user("SLOW");
    body["max_tokens"] = json!(100_000);
    let r = s.post("/v1/messages", &[V1], &body).await;
    error_of(&r, 504, "timeout_error");
    body["stream"] = json!(true);
    let r = s.post("/v1/messages", &[V1], &body).await;
    let events = parse_sse(r.text());
    assert_eq!(events[0].event.as_deref(), Some("message_start"));
    assert_eq!(
        events.last().unwrap().json()["error"]["type"],
        "timeout_error"
    );
    // A service that never starts also times out, before the response starts.
    let r = s.post("/v1/messages", &[V1], &user("SILENT")).await;
    error_of(&r, 504, "timeout_error");
    eventually(|| s.gateway.in_flight() == 0).await;
    let m = s.get("/metrics", &[]).await;
    assert!(
        m.text()
            .contains("zerolayer_generations_total{outcome=\"timeout\"} 3"),
        "{}",
        m.text()
    );
}

/// Sends a streaming request on a raw socket and reads until the first text delta arrived.
async fn open_stream(
    addr: std::net::SocketAddr,
    body: &Value,
    headers: &[(&str, &str)],
) -> tokio::net::TcpStream {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = body.to_string();
    let mut req = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("content_block_delta") {
        let n = sock.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "stream closed early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    sock
}

#[tokio::test]
async fn client_disconnect_cancels_generation() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let mut body = user("SLOW");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(100_000);
    let sock = open_stream(s.addr, &body, &[]).await;
    assert_eq!(s.gateway.in_flight(), 1);
    assert_eq!(s.service.cancelled.load(Ordering::SeqCst), 0);
    drop(sock);
    eventually(|| s.service.cancelled.load(Ordering::SeqCst) == 1).await;
    eventually(|| s.gateway.in_flight() == 0).await;
    let m = s.get("/metrics", &[]).await;
    assert!(
        m.text()
            .contains("zerolayer_generations_total{outcome=\"cancelled\"} 1"),
        "{}",
        m.text()
    );
    assert_eq!(s.service.finished.load(Ordering::SeqCst), 0);
}
