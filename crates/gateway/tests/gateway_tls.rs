//! HTTPS on TCP: the gateway behind rustls, with ALPN choosing HTTP/2 or HTTP/1.1, TLS 1.3
//! session resumption, and connections that never finish the handshake closed without an answer.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use claudelink_proto::rustls::{self, pki_types::ServerName};
use claudelink_proto::{Identity, PinnedVerifier};
use gateway_support::*;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use zerolayer_gateway::{Gateway, GatewayConfig};

/// A gateway serving HTTPS on loopback with a fresh self-signed certificate.
struct TlsServer {
    addr: SocketAddr,
    identity: Identity,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(config: GatewayConfig) -> TlsServer {
    let identity = Identity::self_signed(&["localhost"]).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let gateway = Gateway::new(WordService::new(), config);
    let tls = identity.tcp_server_config().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        gateway
            .serve_tcp_tls(listener, tls, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    TlsServer {
        addr,
        identity,
        _stop: tx,
    }
}

/// A client that pins the server's certificate and offers `alpn` (none when empty).
fn client(server: &TlsServer, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedVerifier::new(
            server.identity.fingerprint(),
        )))
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

/// The TLS session of one fresh connection, and the protocol ALPN chose.
async fn connect(
    server: &TlsServer,
    cfg: &Arc<rustls::ClientConfig>,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    TlsConnector::from(cfg.clone())
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap()
}

fn messages_request(stream: bool) -> http::Request<Full<Bytes>> {
    let mut body = user("alpha beta gamma");
    body["stream"] = stream.into();
    http::Request::builder()
        .method("POST")
        .uri("https://localhost/v1/messages")
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

#[tokio::test]
async fn alpn_h2_serves_http2_over_tls() {
    let server = start(GatewayConfig::default()).await;
    let tls = connect(&server, &client(&server, &[b"h2", b"http/1.1"])).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    // Two requests on the one connection: a complete reply and a stream.
    let resp = sender.send_request(messages_request(false)).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["content"][0]["text"], "alpha beta gamma");
    let resp = sender.send_request(messages_request(true)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let events = parse_sse(std::str::from_utf8(&body).unwrap());
    assert_eq!(
        events.first().and_then(|e| e.event.as_deref()),
        Some("message_start")
    );
    assert_eq!(
        events.last().and_then(|e| e.event.as_deref()),
        Some("message_stop")
    );
}

#[tokio::test]
async fn alpn_http11_or_none_serves_http1_over_tls() {
    let server = start(GatewayConfig::default()).await;
    for alpn in [&[&b"http/1.1"[..]][..], &[]] {
        let tls = connect(&server, &client(&server, alpn)).await;
        let chosen = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        assert_eq!(chosen, alpn.first().map(|p| p.to_vec()));
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut req = messages_request(false);
        req.headers_mut()
            .insert("host", http::HeaderValue::from_static("localhost"));
        *req.uri_mut() = "/v1/messages".parse().unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_11);
        assert_eq!(resp.status(), 200);
    }
}

#[tokio::test]
async fn a_second_connection_resumes_the_tls_session() {
    let server = start(GatewayConfig::default()).await;
    let cfg = client(&server, &[b"http/1.1"]);
    let first = connect(&server, &cfg).await;
    assert_eq!(
        first.get_ref().1.handshake_kind(),
        Some(rustls::HandshakeKind::Full)
    );
    // TLS 1.3 tickets arrive after the handshake: one exchange on the first connection reads
    // them.
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(first))
        .await
        .unwrap();
    tokio::spawn(conn);
    let health = http::Request::get("/health")
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(sender.send_request(health).await.unwrap().status(), 200);
    let second = connect(&server, &cfg).await;
    assert_eq!(
        second.get_ref().1.handshake_kind(),
        Some(rustls::HandshakeKind::Resumed)
    );
}

#[tokio::test]
async fn a_stalled_or_plaintext_handshake_is_closed_without_an_answer() {
    let config = GatewayConfig::default().header_read_timeout(Duration::from_millis(300));
    let server = start(config).await;
    // One byte of a TLS record header, then nothing: closed at the handshake timeout.
    let mut tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    tcp.write_all(&[0x16]).await.unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the stalled handshake was not closed");
    assert!(buf.is_empty(), "{buf:?}");
    assert!(started.elapsed() >= Duration::from_millis(250));
    // Cleartext HTTP on the TLS port gets no HTTP answer either (at most a TLS alert).
    let mut tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf))
        .await
        .expect("closed");
    assert!(
        !buf.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
}
