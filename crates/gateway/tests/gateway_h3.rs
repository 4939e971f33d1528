//! HTTP/3: an h3 + h3-quinn client against the gateway served through the claudelink server's
//! ALPN hook (same UDP port as claudelink), JSON and SSE.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use claudelink_proto::{Identity, Server, ServerConfig, Trust};
use gateway_support::*;
use serde_json::{Value, json};
use zerolayer_gateway::{GatewayConfig, H3_ALPN, LAYER_VERSION};

struct H3Fixture {
    addr: SocketAddr,
    cert: rustls::pki_types::CertificateDer<'static>,
    _server: Server,
    _tcp: TestServer,
}

async fn start() -> H3Fixture {
    start_with(GatewayConfig::default()).await
}

async fn start_with(config: GatewayConfig) -> H3Fixture {
    let tcp = TestServer::start(config).await;
    let identity = Identity::self_signed(&["localhost"]).unwrap();
    let cert = identity.certificate().clone();
    let config =
        ServerConfig::new(identity).alpn_handler(H3_ALPN, Arc::new(tcp.gateway.h3_handler()));
    let server = Server::bind("127.0.0.1:0".parse().unwrap(), config, tcp.service.clone()).unwrap();
    H3Fixture {
        addr: server.local_addr(),
        cert,
        _server: server,
        _tcp: tcp,
    }
}

async fn h3_client(
    f: &H3Fixture,
) -> (
    quinn::Endpoint,
    h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
) {
    let (endpoint, _conn, send) = h3_client_pinging(f, None).await;
    (endpoint, send)
}

/// An h3 client whose QUIC connection sends a PING every `keep_alive` (if any) even when no
/// request is open; also returns the QUIC connection, to watch for its close.
async fn h3_client_pinging(
    f: &H3Fixture,
    keep_alive: Option<std::time::Duration>,
) -> (
    quinn::Endpoint,
    quinn::Connection,
    h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
) {
    let tls = Trust::certificate(f.cert.clone())
        .unwrap()
        .rustls_client_config(vec![H3_ALPN.to_vec()])
        .unwrap();
    let qcfg = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut client = quinn::ClientConfig::new(Arc::new(qcfg));
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(keep_alive);
    client.transport_config(Arc::new(transport));
    endpoint.set_default_client_config(client);
    let conn = endpoint
        .connect(f.addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn.clone()))
        .await
        .unwrap();
    tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
    (endpoint, conn, send)
}

async fn h3_request(
    send: &mut h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
    method: &str,
    path: &str,
    key: Option<&str>,
) -> (u16, Vec<u8>) {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"))
        .header("anthropic-version", "2023-06-01");
    if let Some(k) = key {
        req = req.header("x-api-key", k);
    }
    let mut stream = send.send_request(req.body(()).unwrap()).await.unwrap();
    stream.finish().await.unwrap();
    let resp = stream.recv_response().await.unwrap();
    let out = read_body(&mut stream).await;
    (resp.status().as_u16(), out)
}

/// The rest of a response's body.
async fn read_body(
    stream: &mut h3::client::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>,
) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(mut chunk) = stream.recv_data().await.unwrap() {
        while chunk.has_remaining() {
            let c = chunk.chunk();
            out.extend_from_slice(c);
            let n = c.len();
            chunk.advance(n);
        }
    }
    out
}

/// Whether `conn` closes within `within`.
async fn closes_within(conn: &quinn::Connection, within: std::time::Duration) -> bool {
    tokio::time::timeout(within, conn.closed()).await.is_ok()
}

#[tokio::test]
async fn an_h3_connection_with_no_request_is_closed_at_the_idle_timeout_though_it_pings() {
    use std::time::Duration;
    let f = start_with(GatewayConfig::default().idle_timeout(Duration::from_secs(1))).await;
    let (_endpoint, conn, _send) = h3_client_pinging(&f, Some(Duration::from_millis(100))).await;
    assert!(
        closes_within(&conn, Duration::from_secs(5)).await,
        "an idle h3 connection answering PINGs stayed open 5 s"
    );
    // After a request too, and the close says why.
    let (_endpoint, conn, mut send) = h3_client_pinging(&f, Some(Duration::from_millis(100))).await;
    assert_eq!(h3_request(&mut send, "GET", "/health", None).await.0, 200);
    assert!(closes_within(&conn, Duration::from_secs(5)).await);
    match conn.close_reason() {
        Some(quinn::ConnectionError::ApplicationClosed(c)) => {
            assert_eq!(&c.reason[..], b"idle");
        }
        other => panic!("closed with {other:?}"),
    }
}

#[tokio::test]
async fn a_keyless_h3_connection_is_closed_at_the_auth_timeout_and_a_keyed_one_is_not() {
    use std::time::Duration;
    let f = start_with(
        GatewayConfig::default()
            .api_keys(["sk-h3".to_string()])
            .auth_timeout(Duration::from_secs(1))
            .idle_timeout(Duration::from_secs(30)),
    )
    .await;
    let (_e1, keyless, mut keyless_send) =
        h3_client_pinging(&f, Some(Duration::from_millis(100))).await;
    let (_e2, keyed, mut keyed_send) =
        h3_client_pinging(&f, Some(Duration::from_millis(100))).await;
    assert_eq!(
        h3_request(&mut keyed_send, "GET", "/v1/models", Some("sk-h3"))
            .await
            .0,
        200
    );
    assert_eq!(
        h3_request(&mut keyless_send, "GET", "/v1/models", Some("sk-no"))
            .await
            .0,
        401
    );
    assert!(
        closes_within(&keyless, Duration::from_secs(5)).await,
        "a keyless h3 connection stayed open 5 s"
    );
    assert!(
        keyed.close_reason().is_none(),
        "the keyed connection was closed"
    );
    assert_eq!(
        h3_request(&mut keyed_send, "GET", "/v1/models", Some("sk-h3"))
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn head_is_answered_without_a_body_over_h3() {
    let f = start().await;
    let (_endpoint, mut send) = h3_client(&f).await;
    for (path, want) in [
        ("/no/such/route", 404),
        ("/health", 200),
        ("/v1/models", 200),
    ] {
        let (status, body) = h3_request(&mut send, "HEAD", path, None).await;
        assert_eq!((path, status), (path, want));
        assert!(body.is_empty(), "HEAD {path}: {body:?}");
    }
}

async fn h3_post(
    send: &mut h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
    path: &str,
    body: &Value,
) -> (http::Response<()>, String) {
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{path}"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(())
        .unwrap();
    let mut stream = send.send_request(req).await.unwrap();
    stream
        .send_data(Bytes::from(body.to_string()))
        .await
        .unwrap();
    stream.finish().await.unwrap();
    let resp = stream.recv_response().await.unwrap();
    let out = read_body(&mut stream).await;
    (resp, String::from_utf8(out).unwrap())
}

#[tokio::test]
async fn h3_messages_json_and_stream_on_the_claudelink_port() {
    let f = start().await;
    let (_endpoint, mut send) = h3_client(&f).await;

    let (resp, body) = h3_post(&mut send, "/v1/messages", &user("quic is fast")).await;
    assert_eq!(resp.status(), 200, "{body}");
    assert_eq!(resp.headers()["x-claude-layer"], LAYER_VERSION);
    assert!(resp.headers().contains_key("request-id"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["content"][0]["text"], "quic is fast");
    assert_eq!(v["stop_reason"], "end_turn");

    let mut b = user("one two");
    b["stream"] = json!(true);
    let (resp, body) = h3_post(&mut send, "/v1/messages", &b).await;
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let names: Vec<String> = parse_sse(&body)
        .into_iter()
        .map(|e| e.event.unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );

    // Errors come back over h3 in the same shape.
    let (resp, body) = h3_post(&mut send, "/v1/messages", &json!({"model": "word-model"})).await;
    assert_eq!(resp.status(), 400);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (resp, body) = h3_post(
        &mut send,
        "/v1/chat/completions",
        &json!({"model": "word-model", "stream": true,
        "messages": [{"role": "user", "content": "a b"}]}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert!(body.ends_with("data: [DONE]\n\n"));

    // Three requests after the first reused the connection.
    let m = f._tcp.get("/metrics", &[]).await;
    let t = m.text();
    assert!(
        t.contains("zerolayer_connections_total{protocol=\"http3\"} 1"),
        "{t}"
    );
    assert!(
        t.contains("endpoint=\"messages\",protocol=\"http3\",status=\"200\"} 2"),
        "{t}"
    );
    assert!(
        t.contains("zerolayer_reused_connection_requests_total 3"),
        "{t}"
    );
}

#[tokio::test]
async fn keyless_h3_request_declaring_a_30_mb_body_gets_401_before_any_body_byte() {
    let f = start_with(GatewayConfig::default().api_keys(["sk-test".to_string()])).await;
    let (_endpoint, mut send) = h3_client(&f).await;
    let req = http::Request::builder()
        .method("POST")
        .uri("https://localhost/v1/messages")
        .header("content-type", "application/json")
        .header("content-length", "30000000")
        .body(())
        .unwrap();
    let mut stream = send.send_request(req).await.unwrap();
    // Not one body byte is sent, and the request stream stays open.
    let resp = tokio::time::timeout(std::time::Duration::from_secs(5), stream.recv_response())
        .await
        .expect("a keyless HTTP/3 request is answered without waiting for its body")
        .unwrap();
    assert_eq!(resp.status(), 401);
}
