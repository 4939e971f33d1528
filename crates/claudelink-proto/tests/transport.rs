//! Real-socket tests on loopback: a trivial in-test service streaming N deltas with a delay.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use claudelink_proto::*;
use futures::StreamExt;

mod ticker;
use ticker::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_round_trip_with_pinned_certificate() {
    let svc = Ticker::new(5, Duration::ZERO);
    let server = start(svc.clone(), |c| c);
    let conn = client(&server).connect(server.local_addr()).await.unwrap();
    let events = events(&conn, 5).await;
    assert_eq!(events.len(), 7);
    assert_eq!(events[0], InferenceEvent::Started { input_tokens: 4 });
    assert_eq!(
        events[3],
        InferenceEvent::Delta {
            ids: vec![3],
            text: "x".into()
        }
    );
    assert!(matches!(
        events[6],
        InferenceEvent::Finished {
            stop_reason: StopReason::MaxTokens,
            usage: Usage {
                input_tokens: 4,
                output_tokens: 5
            },
            ..
        }
    ));
    let (_, health) = conn.ping().await.unwrap();
    assert!(health.ready);

    // A client pinning another certificate is refused.
    let other = Identity::self_signed(&["localhost"]).unwrap().fingerprint();
    let bad = Client::new(ClientConfig::new(Trust::Pinned(other))).unwrap();
    assert!(bad.connect(server.local_addr()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_on_one_connection() {
    two_hundred_streams(Congestion::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_congestion_controller_serves_two_hundred_streams() {
    for name in ["newreno", "BBR"] {
        two_hundred_streams(name.parse().unwrap()).await;
    }
    let err = "vegas".parse::<Congestion>().unwrap_err();
    assert!(err.contains("vegas") && err.contains("bbr"), "{err}");
}

async fn two_hundred_streams(congestion: Congestion) {
    let svc = Ticker::new(4, Duration::from_millis(50));
    let server = start(svc.clone(), |c| {
        c.max_concurrent_streams(200).congestion(congestion)
    });
    let conn = client(&server).connect(server.local_addr()).await.unwrap();
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let conn = conn.clone();
            tokio::spawn(async move {
                let s = conn.request(&req(4)).await.map_err(|e| e.to_string())?;
                s.collect_all().await.map_err(|e| e.to_string())
            })
        })
        .collect();
    for t in tasks {
        let events = t.await.unwrap().unwrap();
        assert_eq!(events.len(), 6);
    }
    assert_eq!(svc.max_active.load(Ordering::SeqCst), 200);
    assert_eq!(svc.finished.load(Ordering::SeqCst), 200);
    assert_eq!(server.connections().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_stream_cancels_the_server_work() {
    let svc = Ticker::new(10_000, Duration::from_millis(5));
    let server = start(svc.clone(), |c| c);
    let conn = client(&server).connect(server.local_addr()).await.unwrap();
    let mut s = conn.request(&req(10_000)).await.unwrap();
    assert!(matches!(
        s.next().await,
        Some(Ok(InferenceEvent::Started { .. }))
    ));
    assert!(matches!(
        s.next().await,
        Some(Ok(InferenceEvent::Delta { .. }))
    ));
    assert_eq!(svc.active.load(Ordering::SeqCst), 1);
    drop(s);
    eventually("the service's work to be dropped", || {
        svc.cancelled.load(Ordering::SeqCst) == 1 && svc.active.load(Ordering::SeqCst) == 0
    })
    .await;
    assert_eq!(server.stats().cancelled, 1);
    assert_eq!(conn.in_flight(), 0);
    // The connection still serves.
    assert_eq!(served(&conn, 2).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overloaded_service_gives_overloaded_error_with_retry_hint() {
    let svc = Ticker::new(3, Duration::ZERO);
    svc.overloaded.store(true, Ordering::SeqCst);
    let server = start(svc.clone(), |c| c);
    let conn = client(&server).connect(server.local_addr()).await.unwrap();
    let mut s = conn.request(&req(3)).await.unwrap();
    let ev = s.next().await.unwrap().unwrap();
    assert!(matches!(
        ev,
        InferenceEvent::Error {
            code: ErrorCode::Overloaded,
            ..
        }
    ));
    assert_eq!(s.retry_after_ms(), 250);
    assert!(s.next().await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goaway_moves_new_requests_to_another_connection() {
    let svc = Ticker::new(20, Duration::from_millis(10));
    let server = start(svc.clone(), |c| c);
    let c = client(&server);
    let pool = Pool::connect(
        c,
        server.local_addr(),
        PoolConfig::default().connections(2, 4),
    )
    .await
    .unwrap();
    assert_eq!(pool.stats().connections, 2);
    eventually("server to see 2 connections", || {
        server.connections().len() == 2
    })
    .await;
    // A long request in flight on the first connection.
    let long = pool.request(&req(20)).await.unwrap();
    let busy = server
        .connections()
        .into_iter()
        .find(|c| c.active_streams == 1);
    eventually("the stream to be active on the server", || {
        server.connections().iter().any(|c| c.active_streams == 1)
    })
    .await;
    let busy = busy.or_else(|| {
        server
            .connections()
            .into_iter()
            .find(|c| c.active_streams == 1)
    });
    let busy = busy.unwrap();
    assert!(server.goaway(busy.id, Some(ErrorCode::Overloaded), 100));
    eventually("the client to see GOAWAY", || {
        pool.connections().iter().any(Connection::is_draining)
    })
    .await;
    // New requests go elsewhere and succeed; the pool refills to its minimum.
    for _ in 0..4 {
        let ev = pool
            .request(&req(2))
            .await
            .unwrap()
            .collect_all()
            .await
            .unwrap();
        assert_eq!(ev.len(), 4);
    }
    assert!(pool.connections().iter().all(|c| !c.is_draining()));
    assert_eq!(pool.stats().retired_goaway, 1);
    pool.refill().await.unwrap();
    assert_eq!(pool.stats().connections, 2);
    // The stream already open on the draining connection still completes.
    assert_eq!(long.collect_all().await.unwrap().len(), 22);
    assert_eq!(server.stats().refused, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_uses_0rtt_resumption() {
    let svc = Ticker::new(2, Duration::ZERO);
    let server = start(svc.clone(), |c| c);
    let c = client(&server);
    let first = c.connect(server.local_addr()).await.unwrap();
    assert!(!first.zero_rtt_attempted());
    events(&first, 2).await;
    // Let the session ticket arrive, then drop the connection.
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.close();
    let second = c.connect(server.local_addr()).await.unwrap();
    assert!(
        second.zero_rtt_attempted(),
        "no resumable session was cached"
    );
    // The request goes out in 0-RTT data, before the handshake completes.
    let s = second.request(&req(2)).await.unwrap();
    assert_eq!(second.zero_rtt_accepted().await, Some(true));
    assert_eq!(s.collect_all().await.unwrap().len(), 4);
}

/// Sends a request for `n` deltas on `conn` and returns the events that came back.
async fn events(conn: &Connection, n: u32) -> Vec<InferenceEvent> {
    conn.request(&req(n))
        .await
        .unwrap()
        .collect_all()
        .await
        .unwrap()
}

/// How many events a request for `n` deltas on `conn` got back.
async fn served(conn: &Connection, n: u32) -> usize {
    events(conn, n).await.len()
}

/// Opens a raw stream, writes `bytes`, finishes, and returns the stream's outcome.
async fn raw_stream(conn: &Connection, bytes: &[u8]) -> Result<Vec<u8>, quinn::ReadToEndError> {
    let (mut send, mut recv) = conn.quinn().open_bi().await.unwrap();
    send.write_all(bytes).await.unwrap();
    let _ = send.finish();
    recv.read_to_end(1 << 20).await
}

fn reset_code(r: Result<Vec<u8>, quinn::ReadToEndError>) -> Option<AppErrorCode> {
    match r {
        Err(quinn::ReadToEndError::Read(quinn::ReadError::Reset(c))) => {
            AppErrorCode::from_u64(c.into_inner())
        }
        other => panic!("expected a reset, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_peers_end_only_their_stream_or_connection() {
    let svc = Ticker::new(3, Duration::ZERO);
    let server = start(svc.clone(), |c| c.max_frame_size(64 << 10));
    let c = client(&server);
    let good = c.connect(server.local_addr()).await.unwrap();
    let bad = c.connect(server.local_addr()).await.unwrap();

    // Unknown frame type.
    let r = raw_stream(&bad, &[0x7f, 0, 0, 0, 0]).await;
    assert_eq!(reset_code(r), Some(AppErrorCode::UnknownFrame));
    // Oversize declaration: refused from the header alone, nothing buffered.
    let r = raw_stream(&bad, &[0x01, 0, 0, 0, 0x40]).await;
    assert_eq!(reset_code(r), Some(AppErrorCode::FrameTooLarge));
    // A request cut short by FIN.
    let full = ClientStream::encode_request(&req(3), 65536).unwrap();
    let r = raw_stream(&bad, &full[..full.len() - 3]).await;
    assert_eq!(reset_code(r), Some(AppErrorCode::ProtocolError));
    // A response frame sent by a client.
    let r = raw_stream(&bad, &Frame::Ping(PingFrame { nonce: 1 }).to_vec().unwrap()).await;
    assert_eq!(reset_code(r), Some(AppErrorCode::ProtocolError));
    // The bad connection still serves well-formed requests.
    assert_eq!(served(&bad, 3).await, 5);

    // A control-stream violation (a second control stream) closes only that connection.
    // The server may close the connection as soon as it sees the violation, so the second write
    // (or open) can fail with that close: the close reason below is what is checked.
    for _ in 0..2 {
        let Ok(mut u) = bad.quinn().open_uni().await else {
            break;
        };
        let ping = Frame::Ping(PingFrame { nonce: 9 }).to_vec().unwrap();
        if u.write_all(&ping).await.is_err() {
            break;
        }
    }
    eventually("the bad connection to close", || bad.is_closed()).await;
    match bad.quinn().close_reason() {
        Some(quinn::ConnectionError::ApplicationClosed(a)) => assert_eq!(
            AppErrorCode::from_u64(a.error_code.into_inner()),
            Some(AppErrorCode::ProtocolError)
        ),
        other => panic!("unexpected close: {other:?}"),
    }
    // The other connection is unaffected.
    assert_eq!(served(&good, 3).await, 5);
    assert!(server.stats().protocol_errors >= 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_reads_is_reset_and_its_work_cancelled() {
    let svc = Arc::new(Ticker {
        delta_bytes: 4096,
        ..Arc::into_inner(Ticker::new(100_000, Duration::ZERO)).unwrap()
    });
    let server = start(svc.clone(), |c| c.send_timeout(Duration::from_millis(200)));
    let c = Client::new(
        ClientConfig::new(Trust::Pinned(server.fingerprint())).stream_buffer_size(16 << 10),
    )
    .unwrap();
    let conn = c.connect(server.local_addr()).await.unwrap();
    let (mut send, _recv_never_read) = conn.quinn().open_bi().await.unwrap();
    send.write_all(&ClientStream::encode_request(&req(100_000), 16 << 10).unwrap())
        .await
        .unwrap();
    send.finish().unwrap();
    eventually("the slow reader to be reset", || {
        server.stats().slow_readers == 1
    })
    .await;
    eventually("its work to be cancelled", || {
        svc.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    // The same connection still serves a reader.
    assert_eq!(served(&conn, 2).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_limit_wait_for_credit() {
    let svc = Ticker::new(30, Duration::from_millis(10));
    let server = start(svc.clone(), |c| c.max_concurrent_streams(4));
    let conn = client(&server).connect(server.local_addr()).await.unwrap();
    let mut open = Vec::new();
    for _ in 0..4 {
        open.push(conn.request(&req(30)).await.unwrap());
    }
    // The fifth stream cannot be opened while four are in flight (QUIC MAX_STREAMS).
    let fifth = tokio::time::timeout(Duration::from_millis(100), conn.request(&req(1))).await;
    assert!(fifth.is_err());
    assert_eq!(svc.max_active.load(Ordering::SeqCst), 4);
    drop(open.pop());
    let s = conn.request(&req(1)).await.unwrap();
    assert_eq!(s.collect_all().await.unwrap().len(), 3);
}

#[test]
fn pem_files_load_and_fingerprint_parses() {
    let dir = std::env::temp_dir().join(format!("claudelink-pem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = rcgen_cert();
    std::fs::write(dir.join("cert.pem"), &c.0).unwrap();
    std::fs::write(dir.join("key.pem"), &c.1).unwrap();
    let id = Identity::from_pem_files(dir.join("cert.pem"), dir.join("key.pem")).unwrap();
    let fp = id.fingerprint();
    assert_eq!(fp.to_string().parse::<CertFingerprint>().unwrap(), fp);
    assert!(Trust::pem_file(dir.join("cert.pem")).is_ok());
    assert!(matches!(
        Identity::from_pem_files(dir.join("missing.pem"), dir.join("key.pem")),
        Err(TlsError::Pem { .. })
    ));
    assert!("zz".parse::<CertFingerprint>().is_err());
}

fn rcgen_cert() -> (String, String) {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    (c.cert.pem(), c.signing_key.serialize_pem())
}

/// A handler for another ALPN that keeps each connection until the peer closes it.
#[derive(Debug)]
struct HoldOpen;

impl ConnectionHandler for HoldOpen {
    fn handle(
        &self,
        conn: quinn::Connection,
    ) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let _ = conn.closed().await;
        })
    }
}

/// A connection to `server` negotiating `alpn`, trusting its certificate.
async fn connect_alpn(
    server: &Server,
    alpn: &[u8],
) -> Result<quinn::Connection, quinn::ConnectionError> {
    let tls = Trust::Pinned(server.fingerprint())
        .rustls_client_config(vec![alpn.to_vec()])
        .unwrap();
    let qcfg = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(qcfg)));
    let conn = endpoint
        .connect(server.local_addr(), "localhost")
        .unwrap()
        .await?;
    // The handshake alone can complete before the server decides; a refused connection is
    // closed right after it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    match conn.close_reason() {
        Some(e) => Err(e),
        None => Ok(conn),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_alpns_connections_count_in_the_limits_while_their_handler_runs() {
    let id = Identity::self_signed(&["localhost"]).unwrap();
    let server = start_at(
        "127.0.0.1:0".parse().unwrap(),
        id,
        Ticker::new(1, Duration::ZERO),
        |c| {
            c.max_connections_per_ip(1)
                .alpn_handler(b"x-hold", Arc::new(HoldOpen))
        },
    );
    let first = connect_alpn(&server, b"x-hold")
        .await
        .expect("first connection");
    // The handler still runs: its slot is taken, so a second one from this address is refused.
    assert!(connect_alpn(&server, b"x-hold").await.is_err());
    first.close(0u32.into(), b"done");
    let mut accepted = false;
    for _ in 0..50 {
        if let Ok(c) = connect_alpn(&server, b"x-hold").await {
            c.close(0u32.into(), b"done");
            accepted = true;
            break;
        }
    }
    assert!(
        accepted,
        "no connection accepted after the first one closed"
    );
}
