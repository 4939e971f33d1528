//! Connections that hold a slot without doing anything (issue #47): idle HTTP/1.1 and HTTP/2
//! connections are closed after the idle timeout whatever PINGs they answer, connections that
//! never present a valid key are closed after the authentication timeout and count against a
//! smaller budget (the oldest giving its place to a newer one), a long stream is never cut for idleness, and HEAD is answered without a
//! body on every route over HTTP/2.

mod gateway_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use claudelink_proto::*;
use gateway_support::*;
use http_body_util::{BodyExt, Empty, Full};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const KEY: &str = "sk-test";

/// A gateway whose connections idle out after 1 s and must authenticate within 1 s.
fn short_timeouts() -> GatewayConfig {
    GatewayConfig::default()
        .idle_timeout(Duration::from_secs(1))
        .auth_timeout(Duration::from_secs(1))
        // The server's own PINGs every 200 ms: they must not count as activity.
        .http2_keep_alive(Duration::from_millis(200))
}

/// An HTTP/2 client connection that PINGs every 100 ms even with no stream open (what the
/// attacker of issue #47 did), and a future that ends when the connection closes.
async fn pinging_http2(
    addr: SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    tokio::task::JoinHandle<()>,
) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .keep_alive_interval(Duration::from_millis(100))
            .keep_alive_while_idle(true)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let closed = tokio::spawn(async move {
        let _ = conn.await;
    });
    (sender, closed)
}

async fn get_h2(
    sender: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    method: &str,
    path: &str,
    key: Option<&str>,
) -> (u16, Bytes) {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://localhost{path}"))
        .header("anthropic-version", "2023-06-01");
    if let Some(k) = key {
        req = req.header("x-api-key", k);
    }
    let resp = sender
        .send_request(req.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, body)
}

/// Waits for `closed`; the time it took, or a panic after `within`.
async fn closes_within(closed: tokio::task::JoinHandle<()>, within: Duration) -> Duration {
    let t0 = Instant::now();
    tokio::time::timeout(within, closed)
        .await
        .unwrap_or_else(|_| panic!("the connection was still open after {within:?}"))
        .unwrap();
    t0.elapsed()
}

#[tokio::test]
async fn an_http2_connection_with_no_stream_is_closed_at_the_idle_timeout_though_it_pings() {
    let server = TestServer::start(short_timeouts()).await;
    // Preface and SETTINGS, no stream, PINGs answered and sent.
    let (_sender, closed) = pinging_http2(server.addr).await;
    closes_within(closed, Duration::from_secs(5)).await;

    // The same after a request: the idle time counts from the end of the last response.
    let (mut sender, closed) = pinging_http2(server.addr).await;
    assert_eq!(get_h2(&mut sender, "GET", "/health", None).await.0, 200);
    closes_within(closed, Duration::from_secs(5)).await;
}

#[tokio::test]
async fn an_idle_http1_keep_alive_connection_is_closed_at_the_idle_timeout() {
    let server =
        TestServer::start(short_timeouts().header_read_timeout(Duration::from_secs(30))).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("the idle keep-alive connection stayed open");
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200 "));
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "closed before the idle timeout"
    );
}

#[tokio::test]
async fn a_stream_longer_than_the_idle_timeout_runs_to_its_end() {
    let server = TestServer::start(short_timeouts()).await;
    let mut sender = h2_connect(server.addr).await;
    // SLOW: 20 ms per token until max_tokens, i.e. about 2 s, twice the idle timeout.
    let body = json!({"model": "word-model", "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "SLOW a b"}]});
    let req = http::Request::builder()
        .method("POST")
        .uri("http://localhost/v1/messages")
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let t0 = Instant::now();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    let events = parse_sse(&String::from_utf8_lossy(&text));
    assert!(
        t0.elapsed() > Duration::from_millis(1500),
        "the stream was not slow"
    );
    assert_eq!(
        events.last().map(|e| e.event.as_deref()),
        Some(Some("message_stop"))
    );
    let stop = events
        .iter()
        .find(|e| e.event.as_deref() == Some("message_delta"))
        .map(|e| e.json()["delta"]["stop_reason"].clone());
    assert_eq!(stop, Some(json!("max_tokens")));
}

#[tokio::test]
async fn a_connection_without_a_valid_key_is_closed_at_the_auth_timeout_and_one_with_a_key_is_not()
{
    let server = TestServer::start(
        short_timeouts()
            .api_keys([KEY.to_string()])
            .idle_timeout(Duration::from_secs(30)),
    )
    .await;
    // Busy but keyless: a /health every 100 ms never lets it idle, a wrong key does not count.
    let (mut keyless, keyless_closed) = pinging_http2(server.addr).await;
    let (mut keyed, keyed_closed) = pinging_http2(server.addr).await;
    assert_eq!(
        get_h2(&mut keyed, "GET", "/v1/models", Some(KEY)).await.0,
        200
    );
    let t0 = Instant::now();
    let mut statuses = Vec::new();
    while !keyless_closed.is_finished() && t0.elapsed() < Duration::from_secs(5) {
        if let Ok(r) = tokio::time::timeout(Duration::from_secs(1), async {
            let h = get_h2(&mut keyless, "GET", "/health", None).await.0;
            let w = get_h2(&mut keyless, "GET", "/v1/models", Some("sk-wrong"))
                .await
                .0;
            (h, w)
        })
        .await
        {
            statuses.push(r);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        keyless_closed.is_finished(),
        "the keyless connection stayed open 5 s"
    );
    assert!(statuses.iter().all(|&s| s == (200, 401)), "{statuses:?}");
    // The keyed connection outlives it and still works.
    assert!(!keyed_closed.is_finished());
    assert_eq!(
        get_h2(&mut keyed, "GET", "/v1/models", Some(KEY)).await.0,
        200
    );
}

/// A TCP connection from `source` (a loopback address) to `addr`.
async fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::from((source, 0))).unwrap();
    s.connect(addr).await.unwrap()
}

async fn health_status(s: &mut TcpStream, key: Option<&str>) -> String {
    let auth = key
        .map(|k| format!("x-api-key: {k}\r\n"))
        .unwrap_or_default();
    let req = format!("GET /health HTTP/1.1\r\nHost: localhost\r\n{auth}\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&got)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

/// Whether the server has closed `s` (EOF or reset within 2 s).
async fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test]
async fn keyless_connections_from_a_few_addresses_cannot_lock_the_server_out() {
    // Issue #47's setting: 40 connections in all, 10 per address, four attacking addresses.
    let server = TestServer::start(
        GatewayConfig::default()
            .api_keys([KEY.to_string()])
            .max_connections(40)
            .max_connections_per_ip(10)
            .auth_timeout(Duration::from_secs(30))
            .idle_timeout(Duration::from_secs(30))
            .header_read_timeout(Duration::from_secs(30)),
    )
    .await;
    let mut conns = Vec::new();
    for a in 2..=5u8 {
        for _ in 0..10 {
            let mut s = connect_from([127, 0, 0, a], server.addr).await;
            assert_eq!(health_status(&mut s, None).await, "HTTP/1.1 200 OK");
            conns.push(s);
        }
    }
    // Each address keeps at most a quarter of its limit (rounded up: 3) without a key: every
    // newer keyless connection took the place of the address's oldest, which was closed.
    let closed = futures::future::join_all(conns.iter_mut().map(closed_by_server)).await;
    let open: Vec<usize> = (0..closed.len()).filter(|&i| !closed[i]).collect();
    // The last three of each address.
    assert_eq!(open, [7, 8, 9, 17, 18, 19, 27, 28, 29, 37, 38, 39]);
    // Everyone else still gets in; so does a client with a key from an attacking address (its
    // new connection pushes out that address's oldest keyless one, then shows its key), and a
    // connection that showed its key is never pushed out by later keyless ones.
    let mut other = connect_from([127, 0, 0, 9], server.addr).await;
    assert_eq!(health_status(&mut other, None).await, "HTTP/1.1 200 OK");
    let mut keyed = connect_from([127, 0, 0, 2], server.addr).await;
    assert_eq!(
        health_status(&mut keyed, Some(KEY)).await,
        "HTTP/1.1 200 OK"
    );
    for _ in 0..6 {
        let mut s = connect_from([127, 0, 0, 2], server.addr).await;
        assert_eq!(health_status(&mut s, None).await, "HTTP/1.1 200 OK");
    }
    assert!(
        !closed_by_server(&mut keyed).await,
        "a keyed connection was evicted"
    );
    assert_eq!(
        health_status(&mut keyed, Some(KEY)).await,
        "HTTP/1.1 200 OK"
    );
}

#[tokio::test]
async fn head_is_answered_without_a_body_on_every_route_over_http2() {
    let server = TestServer::start(GatewayConfig::default().api_keys([KEY.to_string()])).await;
    let mut sender = h2_connect(server.addr).await;
    for (path, key, want) in [
        ("/no/such/route", Some(KEY), 404),
        ("/no/such/route", None, 404),
        ("/health", None, 200),
        ("/v1/models", Some(KEY), 200),
        ("/v1/models", None, 401),
        ("/v1/messages", Some(KEY), 404),
    ] {
        let (status, body) = get_h2(&mut sender, "HEAD", path, key).await;
        assert_eq!((path, status), (path, want));
        assert!(body.is_empty(), "HEAD {path}: {body:?}");
    }
    // GET still carries the body.
    let (status, body) = get_h2(&mut sender, "GET", "/no/such/route", Some(KEY)).await;
    assert_eq!(status, 404);
    assert!(String::from_utf8_lossy(&body).contains("not_found_error"));
}

#[tokio::test]
async fn a_keyless_server_checks_the_http2_authority_as_it_checks_host() {
    // DNS rebinding: a page at a name the attacker controls, resolved to this server.
    let server = TestServer::start(GatewayConfig::default()).await;
    let mut sender = h2_connect(server.addr).await;
    for (authority, want) in [
        ("rebind.attacker.example:8080", 403),
        ("localhost:8080", 200),
        ("127.0.0.1:8080", 200),
    ] {
        let req = http::Request::builder()
            .method("GET")
            .uri(format!("http://{authority}/v1/models"))
            .header("anthropic-version", "2023-06-01")
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!((authority, resp.status().as_u16()), (authority, want));
    }
}
