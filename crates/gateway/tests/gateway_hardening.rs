//! The gateway under hostile or careless clients (issue #26): auth before the body, header
//! and connection limits, CPU work off the runtime, prompt size limit, drain abort, cancelled
//! generations of vanished clients, and the in-flight gauge covering claudelink.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use claudelink_proto::*;
use futures::StreamExt;
use gateway_support::*;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "sk-test";

/// Reads from `s` until the end of a response head (or EOF); panics after `within`.
async fn read_head(s: &mut TcpStream, within: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "no response head within {within:?}; got {:?}",
            String::from_utf8_lossy(&got)
        )
    });
    String::from_utf8_lossy(&got).into_owned()
}

/// Reads until the server closes the connection; panics if it stays open past `within`.
async fn read_to_close(s: &mut TcpStream, within: Duration) -> Vec<u8> {
    let mut got = Vec::new();
    tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the connection was still open after {within:?}"));
    got
}

async fn health_on(s: &mut TcpStream) -> String {
    s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    read_head(s, Duration::from_secs(5)).await
}

#[tokio::test]
async fn keyless_request_declaring_a_30_mb_body_gets_401_before_any_body_byte_http1() {
    let server = TestServer::start(GatewayConfig::default().api_keys([KEY.to_string()])).await;
    let cases = [
        ("no key", ""),
        ("no key, Expect: 100-continue", "Expect: 100-continue\r\n"),
        ("wrong key", "x-api-key: sk-wrong\r\n"),
        (
            "wrong key, Expect: 100-continue",
            "x-api-key: sk-wrong\r\nExpect: 100-continue\r\n",
        ),
    ];
    for (case, extra) in cases {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        let head = format!(
            "POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: 30000000\r\n{extra}\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        // Not one body byte is sent: the answer cannot depend on the body.
        let got = read_head(&mut s, Duration::from_secs(5)).await;
        assert!(got.starts_with("HTTP/1.1 401 "), "{case}: {got}");
        assert!(!got.contains("100 Continue"), "{case}: {got}");
        assert!(
            got.to_ascii_lowercase().contains("connection: close"),
            "{case}: {got}"
        );
        // The unread body is not waited for: the server closes the connection.
        read_to_close(&mut s, Duration::from_secs(5)).await;
    }
}

#[tokio::test]
async fn keyless_request_with_a_body_that_never_comes_gets_401_http2() {
    let server = TestServer::start(GatewayConfig::default().api_keys([KEY.to_string()])).await;
    let mut sender = h2_connect(server.addr).await;
    let never = futures::stream::pending::<Result<Frame<Bytes>, std::convert::Infallible>>();
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{}/v1/messages", server.addr))
        .header("content-type", "application/json")
        .header("content-length", "30000000")
        .body(StreamBody::new(never))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), sender.send_request(req))
        .await
        .expect("a keyless HTTP/2 request is answered without waiting for its body")
        .unwrap();
    assert_eq!(resp.status(), 401);
}

#[tokio::test]
async fn bare_key_in_authorization_is_refused_with_a_hint_to_use_bearer() {
    let server = TestServer::start(GatewayConfig::default().api_keys([KEY.to_string()])).await;
    let r = server
        .post("/v1/messages", &[("authorization", KEY)], &user("hi"))
        .await;
    assert_eq!(r.status, 401, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("Bearer") && msg.contains("x-api-key"), "{msg}");
    let r = server
        .post(
            "/v1/messages",
            &[("authorization", &format!("Bearer {KEY}"))],
            &user("hi"),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn metrics_require_the_metrics_key_when_one_is_set() {
    let server = TestServer::start(
        GatewayConfig::default()
            .api_keys([KEY.to_string()])
            .metrics_key(Some("sk-metrics".into())),
    )
    .await;
    assert_eq!(server.get("/metrics", &[]).await.status, 401);
    // An API key is not the metrics key.
    assert_eq!(
        server.get("/metrics", &[("x-api-key", KEY)]).await.status,
        401
    );
    let r = server
        .get("/metrics", &[("authorization", "Bearer sk-metrics")])
        .await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("zerolayer_generations_in_flight"));
    let r = server.get("/metrics", &[("x-api-key", "sk-metrics")]).await;
    assert_eq!(r.status, 200);
    // Without a metrics key /metrics stays open (scrapers in a private network).
    let open = TestServer::start(GatewayConfig::default().api_keys([KEY.to_string()])).await;
    assert_eq!(open.get("/metrics", &[]).await.status, 200);
}

#[tokio::test]
async fn silent_and_half_sent_requests_are_closed_after_the_header_timeout() {
    let server =
        TestServer::start(GatewayConfig::default().header_read_timeout(Duration::from_millis(300)))
            .await;
    // Half of a request head, then silence.
    let mut half = TcpStream::connect(server.addr).await.unwrap();
    half.write_all(b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    // Nothing at all.
    let mut silent = TcpStream::connect(server.addr).await.unwrap();
    read_to_close(&mut half, Duration::from_secs(5)).await;
    let got = read_to_close(&mut silent, Duration::from_secs(5)).await;
    assert!(got.is_empty(), "{got:?}");
    // A prompt client on the same server is served.
    assert_eq!(server.get("/health", &[]).await.status, 200);
    // A keep-alive connection that goes silent after a request is closed as well.
    let mut idle = TcpStream::connect(server.addr).await.unwrap();
    assert!(health_on(&mut idle).await.starts_with("HTTP/1.1 200 "));
    read_to_close(&mut idle, Duration::from_secs(5)).await;
}

#[tokio::test]
async fn per_ip_limit_refuses_the_next_connection_until_one_closes() {
    let server = TestServer::start(GatewayConfig::default().max_connections_per_ip(2)).await;
    let mut a = TcpStream::connect(server.addr).await.unwrap();
    let mut b = TcpStream::connect(server.addr).await.unwrap();
    // Both are being served (and so counted) before the third arrives.
    assert!(health_on(&mut a).await.starts_with("HTTP/1.1 200 "));
    assert!(health_on(&mut b).await.starts_with("HTTP/1.1 200 "));
    let mut c = TcpStream::connect(server.addr).await.unwrap();
    let refused = read_to_close(&mut c, Duration::from_secs(5)).await;
    let refused = String::from_utf8_lossy(&refused);
    assert!(refused.starts_with("HTTP/1.1 503 "), "{refused}");
    // The two open connections still work.
    assert!(health_on(&mut b).await.starts_with("HTTP/1.1 200 "));
    drop(a);
    // Once the server has seen `a` close, a new connection is accepted.
    let mut accepted = false;
    for _ in 0..100 {
        let mut d = TcpStream::connect(server.addr).await.unwrap();
        if health_on(&mut d).await.starts_with("HTTP/1.1 200 ") {
            accepted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(accepted, "no connection accepted after one closed");
}

#[test]
fn health_answers_within_1s_while_two_slow_tokenizations_run() {
    // The server gets 2 runtime threads (as on the 2-core machine of the attack run); each
    // count_tokens blocks a thread for 2 s.
    let service = WordService::new();
    let server = TestServer::start_isolated(service.clone(), GatewayConfig::default(), 2);
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client.block_on(async {
        let body = json!({"model": "word-model",
            "messages": [{"role": "user", "content": "SLOWCOUNT of a long prompt"}]});
        let addr = server.addr;
        let count = |body: serde_json::Value| {
            tokio::spawn(async move {
                send(
                    addr,
                    "POST",
                    "/v1/messages/count_tokens",
                    &[],
                    Bytes::from(body.to_string()),
                )
                .await
            })
        };
        let (one, two) = (count(body.clone()), count(body));
        eventually(|| service.count_calls.load(Ordering::SeqCst) == 2).await;
        let health = tokio::time::timeout(
            Duration::from_secs(1),
            send(addr, "GET", "/health", &[], Bytes::new()),
        )
        .await
        .expect("/health answers within 1 s while two tokenizations run");
        assert_eq!(health.status, 200);
        for r in [one.await.unwrap(), two.await.unwrap()] {
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.json()["input_tokens"], 6);
        }
    });
}

#[tokio::test]
async fn prompt_over_max_prompt_bytes_is_413_before_tokenizing() {
    let server = TestServer::start(GatewayConfig::default().max_prompt_bytes(1000)).await;
    let big = "word ".repeat(400); // 2000 bytes
    let body = json!({"model": "word-model", "messages": [{"role": "user", "content": big}]});
    let r = server.post("/v1/messages/count_tokens", &[], &body).await;
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "request_too_large");
    assert_eq!(server.service.count_calls.load(Ordering::SeqCst), 0);
    let r = server.post("/v1/messages", &[], &user(&big)).await;
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(server.service.last_request.lock().unwrap().is_none());
    // Under the limit it is served.
    let r = server
        .post("/v1/messages/count_tokens", &[], &user("a b c"))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Starts a streaming request and returns its body after the first text delta arrived.
async fn start_stream(
    addr: SocketAddr,
    path: &str,
    body: serde_json::Value,
    http2: bool,
) -> (hyper::body::Incoming, String, tokio::task::JoinHandle<()>) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let io = hyper_util::rt::TokioIo::new(stream);
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let (resp, conn) = if http2 {
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .unwrap();
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        (sender.send_request(req).await.unwrap(), conn)
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        (sender.send_request(req).await.unwrap(), conn)
    };
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut seen = String::new();
    while !(seen.contains("content_block_delta") || seen.contains("\"delta\":{\"content\"")) {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("a first delta within 10 s")
            .expect("the stream ended early")
            .unwrap();
        if let Ok(d) = frame.into_data() {
            seen.push_str(std::str::from_utf8(&d).unwrap());
        }
    }
    (body, seen, conn)
}

/// A streaming request whose answer runs (20 ms a token) until cancelled.
fn slow_request() -> serde_json::Value {
    json!({"model": "word-model", "max_tokens": 100000, "stream": true,
        "messages": [{"role": "user", "content": "SLOW words here"}]})
}

#[tokio::test]
async fn abort_streams_ends_running_streams_with_an_overloaded_error_event() {
    let server = TestServer::start(GatewayConfig::default()).await;
    let (anthropic, mut a_text, _c1) =
        start_stream(server.addr, "/v1/messages", slow_request(), false).await;
    let (openai, mut o_text, _c2) =
        start_stream(server.addr, "/v1/chat/completions", slow_request(), true).await;
    server.gateway.abort_streams();
    for (body, text) in [(anthropic, &mut a_text), (openai, &mut o_text)] {
        let rest = tokio::time::timeout(Duration::from_secs(10), body.collect())
            .await
            .expect("the stream closes within 10 s of abort_streams")
            .unwrap()
            .to_bytes();
        text.push_str(std::str::from_utf8(&rest).unwrap());
    }
    let events = parse_sse(&a_text);
    let last = events.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"), "{a_text}");
    assert_eq!(last.json()["error"]["type"], "overloaded_error");
    let msg = last.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("shutting down"), "{msg}");
    assert!(!a_text.contains("message_stop"), "{a_text}");
    let chunks = parse_sse(&o_text);
    let last = chunks.last().unwrap();
    assert_eq!(last.json()["error"]["type"], "overloaded_error", "{o_text}");
    assert!(!o_text.contains("\"finish_reason\":\"stop\""), "{o_text}");
    // The generations were cancelled, not left running.
    eventually(|| server.service.cancelled.load(Ordering::SeqCst) == 2).await;
    assert_eq!(server.gateway.in_flight(), 0);
}

async fn client_close_cancels_the_generation(http2: bool) {
    let server = TestServer::start(GatewayConfig::default()).await;
    let (body, _, conn) = start_stream(server.addr, "/v1/messages", slow_request(), http2).await;
    assert_eq!(server.gateway.in_flight(), 1);
    // The client closes its socket mid-stream.
    drop(body);
    conn.abort();
    eventually(|| server.service.cancelled.load(Ordering::SeqCst) == 1).await;
    eventually(|| server.gateway.in_flight() == 0).await;
}

#[tokio::test]
async fn client_closing_its_socket_mid_stream_cancels_the_generation_http1() {
    client_close_cancels_the_generation(false).await;
}

#[tokio::test]
async fn client_closing_its_socket_mid_stream_cancels_the_generation_http2() {
    client_close_cancels_the_generation(true).await;
}

#[tokio::test]
async fn in_flight_gauge_counts_streams_of_a_counted_service() {
    let server = TestServer::start(GatewayConfig::default()).await;
    let claudelink_side = server.gateway.count_in_flight(server.service.clone());
    let mut stream = claudelink_side
        .submit(InferenceRequest::new(
            "word-model",
            Prompt::Text("SLOW a".into()),
            100,
        ))
        .unwrap();
    assert!(matches!(
        stream.next().await,
        Some(InferenceEvent::Started { .. })
    ));
    assert_eq!(server.gateway.in_flight(), 1);
    let metrics = server.get("/metrics", &[]).await;
    assert!(
        metrics.text().contains("zerolayer_generations_in_flight 1"),
        "{}",
        metrics.text()
    );
    drop(stream);
    assert_eq!(server.gateway.in_flight(), 0);
}

fn hello() -> serde_json::Value {
    json!({"model": "word-model", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello there"}]})
}

#[tokio::test]
async fn keyless_server_refuses_bodies_a_web_page_could_post_without_a_preflight() {
    let s = TestServer::start(GatewayConfig::default()).await;
    let body = Bytes::from(hello().to_string());
    for (path, content_type) in [
        ("/v1/messages", Some("text/plain")),
        ("/v1/messages", Some("text/plain;charset=UTF-8")),
        (
            "/v1/chat/completions",
            Some("application/x-www-form-urlencoded"),
        ),
        ("/v1/completions", Some("multipart/form-data; boundary=x")),
        ("/v1/messages/count_tokens", None),
    ] {
        let r = match content_type {
            Some(t) => send(s.addr, "POST", path, &[("content-type", t)], body.clone()).await,
            None => raw_post_without_content_type(s.addr, path, &body).await,
        };
        assert_eq!(r.status, 415, "{path} {content_type:?}: {}", r.text());
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("content-type: "), "{message}");
    }
    assert!(
        s.service.last_request.lock().unwrap().is_none(),
        "a refused request reached the service"
    );
    // JSON, with parameters, is served.
    let r = send(
        s.addr,
        "POST",
        "/v1/messages",
        &[("content-type", "application/json; charset=utf-8")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A POST with a body and no `content-type` at all (the support client adds JSON's).
async fn raw_post_without_content_type(addr: SocketAddr, path: &str, body: &Bytes) -> Resp {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    Resp {
        status: head[9..12].parse().unwrap(),
        headers: http::HeaderMap::new(),
        body: Bytes::from(body.to_owned()),
    }
}

#[tokio::test]
async fn keyless_server_answers_only_loopback_names_addresses_and_allowed_hosts() {
    let s =
        TestServer::start(GatewayConfig::default().allowed_hosts(["chat.lan".to_string()])).await;
    let port = s.addr.port().to_string();
    for host in [
        "localhost".to_string(),
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        "192.168.1.20".to_string(),
        "chat.localhost".to_string(),
        format!("CHAT.LAN:{port}"),
    ] {
        let r = s.post("/v1/messages", &[("host", &host)], &hello()).await;
        assert_eq!(r.status, 200, "{host}: {}", r.text());
    }
    // A rebound name reaches nothing but /health.
    let evil = [("host", "evil.example:8080")];
    let r = s.post("/v1/messages", &evil, &hello()).await;
    assert_eq!(r.status, 403, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "permission_error", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("--allow-host evil.example"), "{message}");
    for path in ["/v1/models", "/metrics", "/"] {
        let r = s.get(path, &evil).await;
        assert_eq!(r.status, 403, "{path}: {}", r.text());
    }
    let r = s.post("/v1/chat/completions", &evil, &hello()).await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "permission_error");
    let r = s.get("/health", &evil).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn a_server_with_keys_leaves_host_and_body_type_to_its_keys() {
    let s = TestServer::start(GatewayConfig::default().api_keys([KEY.to_string()])).await;
    let r = s
        .post(
            "/v1/messages",
            &[
                ("host", "gpu-box.example"),
                ("content-type", "text/plain"),
                ("x-api-key", KEY),
            ],
            &hello(),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}
