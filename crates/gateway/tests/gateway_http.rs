//! The gateway over HTTP/1.1 and HTTP/2 on loopback: response shapes, the SSE event sequence,
//! Chat Completions, count_tokens, models, health, metrics and common headers.

mod gateway_support;

use std::sync::atomic::Ordering;

use bytes::Bytes;
use gateway_support::*;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use zerolayer_gateway::{GatewayConfig, LAYER_VERSION};

const V1: (&str, &str) = ("anthropic-version", "2023-06-01");
const V2: (&str, &str) = ("anthropic-version", "2026-10-21");

#[tokio::test]
async fn messages_json_shape() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let r = s
        .post("/v1/messages", &[V1], &user("alpha beta gamma"))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-claude-layer"), Some(LAYER_VERSION));
    assert!(r.header("request-id").unwrap().starts_with("req_"));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], "word-model");
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "alpha beta gamma"}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["stop_sequence"], Value::Null);
    // One user turn of 3 words: 3 + 1 prompt tokens in the test service.
    assert_eq!(v["usage"], json!({"input_tokens": 4, "output_tokens": 3}));
}

#[tokio::test]
async fn max_tokens_and_stop_sequences() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let mut body = user("one two three four five");
    body["max_tokens"] = json!(2);
    let v = s.post("/v1/messages", &[V1], &body).await.json();
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["content"][0]["text"], "one two");
    assert_eq!(v["usage"]["output_tokens"], 2);

    let mut body = user("one two three four five");
    body["stop_sequences"] = json!(["thr"]);
    let v = s.post("/v1/messages", &[V1], &body).await.json();
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "thr");
    assert_eq!(v["content"][0]["text"], "one two");
    let req = s.service.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(req.stop_sequences, vec!["thr".to_string()]);
}

#[tokio::test]
async fn system_prompt_and_sampling_reach_the_service_under_both_versions() {
    let s = TestServer::start(GatewayConfig::default()).await;
    for version in [V1, V2] {
        let body = json!({"model": "word-model", "max_tokens": 8, "system": "be terse",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "temperature": 0.7, "top_p": 0.9, "top_k": 20, "metadata": {"user_id": "u1"}});
        let r = s.post("/v1/messages", &[version], &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let req = s.service.last_request.lock().unwrap().clone().unwrap();
        assert_eq!(req.max_tokens, 8);
        assert_eq!(req.sampling.temperature, Some(0.7));
        assert_eq!(req.sampling.top_p, Some(0.9));
        assert_eq!(req.sampling.top_k, Some(20));
        let claudelink_proto::Prompt::Chat(msgs) = req.prompt else {
            panic!("chat prompt expected")
        };
        assert_eq!(msgs[0].role, claudelink_proto::ChatRole::System);
        assert_eq!(msgs[0].content, "be terse");
        assert_eq!(msgs[1].content, "hi");
    }
    let r = s
        .post(
            "/v1/messages",
            &[("anthropic-version", "2023-01-01")],
            &user("x"),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("anthropic-version:")
    );
}

#[tokio::test]
async fn sse_event_sequence() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let mut body = user("red green blue");
    body["stream"] = json!(true);
    let r = s.post("/v1/messages", &[V2], &body).await;
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_eq!(r.header("x-claude-layer"), Some(LAYER_VERSION));
    let events = parse_sse(r.text());
    let names: Vec<&str> = events
        .iter()
        .map(|e| e.event.as_deref().expect("every event has an event: line"))
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for e in &events {
        assert_eq!(
            e.json()["type"],
            e.event.as_deref().unwrap(),
            "data type matches event line"
        );
    }
    let start = events[0].json();
    assert_eq!(start["message"]["usage"]["input_tokens"], 4);
    assert_eq!(start["message"]["content"], json!([]));
    assert_eq!(start["message"]["stop_reason"], Value::Null);
    let text: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .map(|e| {
            let d = e.json();
            assert_eq!(d["delta"]["type"], "text_delta");
            assert_eq!(d["index"], 0);
            d["delta"]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, "red green blue");
    let delta = events[7].json();
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["output_tokens"], 3);
}

#[tokio::test]
async fn count_tokens_and_models() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let body = json!({"model": "word-model", "system": "s t", "messages": [{"role": "user", "content": "a b c"}]});
    let r = s.post("/v1/messages/count_tokens", &[V1], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), json!({"input_tokens": 7}));

    let m = s.get("/v1/models", &[V1]).await;
    assert_eq!(m.status, 200);
    let v = m.json();
    assert_eq!(v["data"][0]["id"], "word-model");
    assert_eq!(v["data"][0]["type"], "model");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["has_more"], false);
    assert_eq!(
        s.get("/v1/models/word-model", &[]).await.json()["display_name"],
        "Word model"
    );
    assert_eq!(s.get("/v1/models/nope", &[]).await.status, 404);

    let mut body = user("x");
    body["model"] = json!("claude-unknown");
    let r = s.post("/v1/messages", &[V1], &body).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "not_found_error");
}

#[tokio::test]
async fn chat_completions_json_and_stream() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let body = json!({"model": "word-model", "max_tokens": 2,
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "uno dos tres"}]});
    let r = s.post("/v1/chat/completions", &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "uno dos"})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(
        v["usage"]["total_tokens"],
        v["usage"]["prompt_tokens"].as_u64().unwrap() + 2
    );

    let body = json!({"model": "word-model", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "uno dos"}]});
    let r = s.post("/v1/chat/completions", &[], &body).await;
    assert_eq!(r.status, 200);
    let events = parse_sse(r.text());
    assert!(
        events.iter().all(|e| e.event.is_none()),
        "OpenAI chunks carry no event: line"
    );
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(SseEvent::json)
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "uno dos");
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 2);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );

    let r = s
        .post(
            "/v1/chat/completions",
            &[],
            &json!({"model": "word-model", "messages": "x"}),
        )
        .await;
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("messages:")
    );
}

#[tokio::test]
async fn health_follows_readiness_and_draining() {
    let s = TestServer::start(GatewayConfig::default()).await;
    assert_eq!(s.get("/health", &[]).await.status, 200);
    let head = send(s.addr, "HEAD", "/health", &[], Bytes::new()).await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    s.service.not_ready.store(true, Ordering::SeqCst);
    let r = s.get("/health", &[]).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["status"], "starting");
    s.service.not_ready.store(false, Ordering::SeqCst);
    s.gateway.start_draining();
    assert_eq!(s.get("/health", &[]).await.status, 503);
    let r = s.post("/v1/messages", &[V1], &user("hi")).await;
    assert_eq!(r.status, 529);
    assert_eq!(r.header("x-should-retry"), Some("true"));
}

#[tokio::test]
async fn a_draining_gateway_answers_metrics_and_closes_http1_connections() {
    let s = TestServer::start(GatewayConfig::default()).await;
    s.post("/v1/messages", &[V1], &user("a b c")).await;
    assert_eq!(s.get("/metrics", &[]).await.header("connection"), None);
    s.gateway.start_draining();
    // Scrapable through the drain (the server keeps its listener open until the drain ends).
    let r = s.get("/metrics", &[]).await;
    assert_eq!(r.status, 200);
    assert!(
        r.text()
            .contains("zerolayer_generations_total{outcome=\"finished\"} 1"),
        "{}",
        r.text()
    );
    // Every HTTP/1.1 answer sends its keep-alive client elsewhere for the next request.
    assert_eq!(r.header("connection"), Some("close"));
    let r = s.get("/health", &[]).await;
    assert_eq!((r.status, r.header("connection")), (503, Some("close")));
    let r = s.post("/v1/messages", &[V1], &user("hi")).await;
    assert_eq!((r.status, r.header("connection")), (529, Some("close")));
}

#[tokio::test]
async fn metrics_exposition() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let mut body = user("a b c");
    s.post("/v1/messages", &[V1], &body).await;
    body["stream"] = json!(true);
    s.post("/v1/messages", &[V1], &body).await;
    let r = s.get("/metrics", &[]).await;
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let t = r.text();
    for needle in [
        "zerolayer_http_requests_total{endpoint=\"messages\",protocol=\"http1\",status=\"200\"} 2",
        "zerolayer_generations_total{outcome=\"finished\"} 2",
        "zerolayer_time_to_first_token_seconds_count 2",
        "zerolayer_request_duration_seconds_count 2",
        "zerolayer_queue_wait_seconds_count 2",
        "zerolayer_output_tokens_total 6",
        "zerolayer_output_tokens_per_second ",
        "zerolayer_queue_depth 3",
        "zerolayer_kv_utilization 0.25",
        "zerolayer_weight_cache_hit_rate 0.75",
        "zerolayer_expert_hit_rate 0.625",
        "zerolayer_weight_read_bytes_per_token 4096.5",
        "zerolayer_connection_reuse_ratio ",
        "zerolayer_connections_total{protocol=\"http1\"} 3",
    ] {
        assert!(t.contains(needle), "missing {needle:?} in\n{t}");
    }
    // Every sample line is `name{labels} value` with a numeric value.
    for line in t.lines().filter(|l| !l.starts_with('#')) {
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
    }
}

#[tokio::test]
async fn debug_header_and_alt_svc() {
    let s = TestServer::start(GatewayConfig::default().h3_port(Some(8443))).await;
    let r = s
        .post(
            "/v1/messages",
            &[V1, ("x-anthropic-debug", "true")],
            &user("a b"),
        )
        .await;
    assert_eq!(r.header("alt-svc"), Some("h3=\":8443\"; ma=86400"));
    let d: Value =
        serde_json::from_str(r.header("x-claude-layer-debug").expect("debug header")).unwrap();
    assert_eq!(d["layer"], LAYER_VERSION);
    assert_eq!(d["cache_hit_rate"], 0.75);
    assert!(d["ttft_ms"].as_f64().unwrap() >= 0.0);
    assert!(d["queue_ms"].as_f64().unwrap() >= 0.0);
    let mut body = user("a b");
    body["stream"] = json!(true);
    let r = s
        .post("/v1/messages", &[V1, ("x-anthropic-debug", "true")], &body)
        .await;
    assert!(r.header("x-claude-layer-debug").is_some());
    let r = s.post("/v1/messages", &[V1], &user("a b")).await;
    assert!(r.header("x-claude-layer-debug").is_none());
}

#[tokio::test]
async fn http2_prior_knowledge_and_connection_reuse() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let mut sender = h2_connect(s.addr).await;
    for _ in 0..3 {
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}/v1/messages", s.addr))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(user("h two").to_string())))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), http::Version::HTTP_2);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["content"][0]["text"], "h two");
    }
    let t = s.get("/metrics", &[]).await;
    let t = t.text();
    assert!(t.contains("protocol=\"http2\",status=\"200\"} 3"), "{t}");
    assert!(
        t.contains("zerolayer_reused_connection_requests_total 2"),
        "{t}"
    );
}

#[tokio::test]
async fn chat_n_choices_json_and_stream() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let body = json!({"model": "word-model", "n": 3, "seed": 5,
        "messages": [{"role": "user", "content": "uno dos"}]});
    let r = s.post("/v1/chat/completions", &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "uno dos");
    }
    assert_eq!(v["usage"]["completion_tokens"], 6);
    // the last choice's request carried seed + 2
    let last = s.service.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(last.sampling.seed, Some(7));

    let mut body = body;
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = s.post("/v1/chat/completions", &[], &body).await;
    assert_eq!(r.status, 200);
    let events = parse_sse(r.text());
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert_eq!(events.iter().filter(|e| e.data == "[DONE]").count(), 1);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(SseEvent::json)
        .collect();
    for i in 0..3 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].as_array()?.first())
            .filter(|c| c["index"] == i)
            .collect();
        let text: String = mine
            .iter()
            .filter_map(|c| c["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "uno dos", "choice {i}");
        assert_eq!(mine.last().unwrap()["finish_reason"], "stop");
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
}

#[tokio::test]
async fn legacy_completions_json_and_stream() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let body = json!({"model": "word-model", "prompt": "alpha beta gamma", "max_tokens": 2});
    let r = s.post("/v1/completions", &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["choices"][0]["text"], "alpha beta");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    let req = s.service.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(
        req.prompt,
        claudelink_proto::Prompt::Text("alpha beta gamma".into())
    );

    let mut body = body;
    body["stream"] = json!(true);
    let r = s.post("/v1/completions", &[], &body).await;
    assert_eq!(r.status, 200);
    let events = parse_sse(r.text());
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(SseEvent::json)
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "alpha beta");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
}

#[tokio::test]
async fn fields_the_server_does_not_honour_get_a_400_naming_them() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let msg = json!({"model": "word-model", "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]});
    let chat = json!({"model": "word-model", "messages": [{"role": "user", "content": "a"}]});
    for (path, base, key, value, want) in [
        (
            "/v1/messages",
            &msg,
            "tools",
            json!([{"name": "t", "input_schema": {}}]),
            "tools: the served model does not take tools",
        ),
        (
            "/v1/messages",
            &msg,
            "output_config",
            json!({"format": {"type": "json_schema"}}),
            "output_config.format.schema: Field required",
        ),
        (
            "/v1/messages",
            &msg,
            "unknown_field",
            json!([1]),
            "unknown_field: this field is not supported",
        ),
        (
            "/v1/chat/completions",
            &chat,
            "response_format",
            json!({"type": "grammar"}),
            "response_format.type:",
        ),
        (
            "/v1/chat/completions",
            &chat,
            "tool_choice",
            json!("required"),
            "tool_choice: a tool call is required",
        ),
        (
            "/v1/chat/completions",
            &chat,
            "logit_bias",
            json!({"5": 1}),
            "logit_bias:",
        ),
    ] {
        let mut body = base.clone();
        body[key] = value;
        let r = s.post(path, &[V1], &body).await;
        assert_eq!(r.status, 400, "{path} {key}: {}", r.text());
        let v = r.json();
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(want), "{path} {key}: {message}");
    }
    // an image block is refused by its type
    let mut body = msg.clone();
    body["messages"][0]["content"] = json!([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]);
    let r = s.post("/v1/messages", &[V1], &body).await;
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("messages.0.content.0.type"),
        "{}",
        r.text()
    );
}
