//! Real-socket tests of the claudelink security findings (issue #26): authentication, 0-RTT
//! replay, unknown models, dead peers, connection limits and drain.
//!
//! A UDP relay between client and server stands in for the network: it forwards, captures
//! (without forwarding) or black-holes datagrams, so a test can make a client vanish without a
//! CONNECTION_CLOSE (as SIGKILL or a pulled cable would) or replay a client's first flight.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use claudelink_proto::*;
use futures::StreamExt;
use tokio::net::UdpSocket;

/// A test service: records every request it is handed, streams `Started`, then a delta every
/// `delay` (`deltas` of them then `Finished`, or forever when `deltas` is `None`), and counts
/// event streams dropped before they ended.
struct Recorder {
    deltas: Option<u32>,
    delay: Duration,
    models: Vec<ModelInfo>,
    requests: parking::Mutex<Vec<InferenceRequest>>,
    dropped: Arc<AtomicUsize>,
    live: Arc<AtomicUsize>,
}

/// `std::sync::Mutex` behind a panic-free lock (a poisoned test mutex only means another
/// assertion already failed).
mod parking {
    pub(crate) struct Mutex<T>(std::sync::Mutex<T>);
    impl<T> Mutex<T> {
        pub(crate) fn new(v: T) -> Self {
            Self(std::sync::Mutex::new(v))
        }
        pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
    }
}

impl Recorder {
    fn new(deltas: Option<u32>, delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            deltas,
            delay,
            models: Vec::new(),
            requests: parking::Mutex::new(Vec::new()),
            dropped: Arc::default(),
            live: Arc::default(),
        })
    }

    fn serving(models: &[&str]) -> Arc<Self> {
        Arc::new(Self {
            deltas: Some(2),
            delay: Duration::ZERO,
            models: models
                .iter()
                .map(|m| ModelInfo {
                    id: (*m).into(),
                    display_name: (*m).into(),
                    context_length: 2048,
                })
                .collect(),
            requests: parking::Mutex::new(Vec::new()),
            dropped: Arc::default(),
            live: Arc::default(),
        })
    }

    fn submitted(&self) -> usize {
        self.requests.lock().len()
    }

    fn clients(&self) -> Vec<Option<String>> {
        self.requests
            .lock()
            .iter()
            .map(|r| r.client.clone())
            .collect()
    }
}

/// Alive while the service's event stream is; counts a drop before the end.
struct Work {
    dropped: Arc<AtomicUsize>,
    live: Arc<AtomicUsize>,
    done: bool,
}

impl Drop for Work {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        if !self.done {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl InferenceService for Recorder {
    fn submit(&self, req: InferenceRequest) -> Result<EventStream, ServiceError> {
        self.requests.lock().push(req);
        self.live.fetch_add(1, Ordering::SeqCst);
        let work = Work {
            dropped: self.dropped.clone(),
            live: self.live.clone(),
            done: false,
        };
        let (deltas, delay) = (self.deltas, self.delay);
        let s = futures::stream::unfold((0u32, work), move |(i, mut work)| async move {
            if i == 0 {
                return Some((InferenceEvent::Started { input_tokens: 1 }, (1, work)));
            }
            match deltas {
                Some(n) if i > n + 1 => return None,
                Some(n) if i == n + 1 => {
                    work.done = true;
                    let usage = Usage {
                        input_tokens: 1,
                        output_tokens: n,
                    };
                    return Some((
                        InferenceEvent::Finished {
                            stop_reason: StopReason::MaxTokens,
                            stop_sequence: None,
                            usage,
                        },
                        (i + 1, work),
                    ));
                }
                _ => {}
            }
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let ev = InferenceEvent::Delta {
                ids: vec![i],
                text: "t".into(),
            };
            Some((ev, (i + 1, work)))
        });
        Ok(Box::pin(s))
    }
    fn count_tokens(&self, _: &Prompt) -> Result<u32, ServiceError> {
        Ok(1)
    }
    fn models(&self) -> Vec<ModelInfo> {
        self.models.clone()
    }
    fn metrics(&self) -> ServiceMetrics {
        ServiceMetrics::default()
    }
}

const KEY: &str = "sk-test-right";

fn keys() -> ApiKeys {
    ApiKeys::new([KEY.to_string(), "sk-test-other".to_string()])
}

fn start(svc: Arc<Recorder>, cfg: impl FnOnce(ServerConfig) -> ServerConfig) -> Server {
    let id = Identity::self_signed(&["localhost"]).unwrap();
    Server::bind(
        "127.0.0.1:0".parse().unwrap(),
        cfg(ServerConfig::new(id)),
        svc,
    )
    .unwrap()
}

fn client_with(server: &Server, key: Option<&str>) -> Client {
    let mut cfg = ClientConfig::new(Trust::Pinned(server.fingerprint()));
    if let Some(k) = key {
        cfg = cfg.api_key(k);
    }
    Client::new(cfg).unwrap()
}

fn req(model: &str, max_tokens: u32) -> InferenceRequest {
    InferenceRequest::new(model, Prompt::Text("hi".into()), max_tokens)
}

async fn eventually(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("not within {within:?}: {what}");
}

/// Asserts that `conn` is served a one-token request (Started, one Delta, Finished).
async fn assert_served_one(conn: &Connection) {
    let ev = conn
        .request(&req("m", 1))
        .await
        .unwrap()
        .collect_all()
        .await;
    assert_eq!(ev.unwrap().len(), 3);
}

/// A client without a key and without 0-RTT (its `connect` returns once the server has
/// admitted or refused the connection).
fn keyless_client(server: &Server) -> Client {
    Client::new(ClientConfig::new(Trust::Pinned(server.fingerprint())).zero_rtt(false)).unwrap()
}

fn close_code(conn: &Connection) -> Option<AppErrorCode> {
    match conn.quinn().close_reason() {
        Some(quinn::ConnectionError::ApplicationClosed(a)) => {
            AppErrorCode::from_u64(a.error_code.into_inner())
        }
        _ => None,
    }
}

// ---------------------------------------------------------------- authentication

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_client_gets_no_token_from_a_server_with_keys() {
    let svc = Recorder::new(Some(3), Duration::ZERO);
    let server = start(svc.clone(), |c| {
        c.api_keys(keys()).auth_timeout(Duration::from_millis(500))
    });
    let conn = client_with(&server, None)
        .connect(server.local_addr())
        .await
        .unwrap();
    let started = Instant::now();
    let r = match conn.request(&req("m", 3)).await {
        Ok(s) => s.collect_all().await.map(|_| ()).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let err = r.expect_err("a keyless request must not be served");
    assert!(err.contains("UNAUTHENTICATED"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(close_code(&conn), Some(AppErrorCode::Unauthenticated));
    assert_eq!(svc.submitted(), 0, "the service was called");
    assert_eq!(server.stats().unauthenticated, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_key_is_refused_at_once_and_reported_as_unauthenticated() {
    let svc = Recorder::new(Some(3), Duration::ZERO);
    // A long AUTH deadline: a wrong key must not wait for it.
    let server = start(svc.clone(), |c| {
        c.api_keys(keys()).auth_timeout(Duration::from_secs(60))
    });
    let conn = client_with(&server, Some("sk-test-wrong"))
        .connect(server.local_addr())
        .await
        .unwrap();
    let res = tokio::time::timeout(Duration::from_secs(10), async {
        match conn.request(&req("m", 3)).await {
            Ok(s) => s.collect_all().await.map(|_| ()).map_err(|e| match e {
                StreamError::Unauthenticated => "unauthenticated".to_string(),
                e => format!("{e:?}"),
            }),
            Err(RequestError::Unauthenticated) => Err("unauthenticated".into()),
            Err(e) => Err(format!("{e:?}")),
        }
    })
    .await
    .expect("a wrong key is refused before the AUTH deadline");
    assert_eq!(res, Err("unauthenticated".to_string()));
    assert_eq!(close_code(&conn), Some(AppErrorCode::Unauthenticated));
    assert_eq!(svc.submitted(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_key_is_served_and_its_label_reaches_the_request() {
    let svc = Recorder::new(Some(3), Duration::ZERO);
    let server = start(svc.clone(), |c| c.api_keys(keys()));
    let conn = client_with(&server, Some(KEY))
        .connect(server.local_addr())
        .await
        .unwrap();
    let ev = conn
        .request(&req("m", 3))
        .await
        .unwrap()
        .collect_all()
        .await;
    assert_eq!(ev.unwrap().len(), 5);
    // The pool authenticates each of its connections too.
    let pool = Pool::connect(
        client_with(&server, Some(KEY)),
        server.local_addr(),
        PoolConfig::default().connections(2, 2),
    )
    .await
    .unwrap();
    for _ in 0..4 {
        let ev = pool
            .request(&req("m", 3))
            .await
            .unwrap()
            .collect_all()
            .await;
        assert_eq!(ev.unwrap().len(), 5);
    }
    let label = key_label(KEY);
    assert_eq!(svc.clients(), vec![Some(label); 5]);
    assert_eq!(server.stats().unauthenticated, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_without_keys_serves_clients_with_or_without_auth() {
    let svc = Recorder::new(Some(1), Duration::ZERO);
    let server = start(svc.clone(), |c| c);
    for key in [None, Some("anything")] {
        let conn = client_with(&server, key)
            .connect(server.local_addr())
            .await
            .unwrap();
        assert_served_one(&conn).await;
        // The control stream still works after AUTH.
        conn.ping().await.unwrap();
    }
    assert_eq!(svc.clients(), vec![None, None]);
}

/// Writes `frames` on a fresh control stream of a raw connection after `delay`, then sends a
/// request on it and returns how its connection was closed.
async fn raw_control(
    server: &Server,
    delay: Duration,
    frames: &[Frame<'_>],
) -> Option<AppErrorCode> {
    let client = client_with(server, None);
    let conn = client.connect(server.local_addr()).await.unwrap();
    tokio::time::sleep(delay).await;
    if let Ok(mut ctl) = conn.quinn().open_uni().await {
        for f in frames {
            if ctl.write_all(&f.to_vec().unwrap()).await.is_err() {
                break;
            }
        }
    }
    if let Ok(s) = conn.request(&req("m", 1)).await {
        let _ = s.collect_all().await;
    }
    eventually("the connection to close", Duration::from_secs(10), || {
        conn.is_closed()
    })
    .await;
    close_code(&conn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_late_or_not_first_closes_the_connection_unauthenticated() {
    let svc = Recorder::new(Some(1), Duration::ZERO);
    let server = start(svc.clone(), |c| {
        c.api_keys(keys()).auth_timeout(Duration::from_millis(300))
    });
    let auth = Frame::Auth(AuthFrame { credential: KEY });
    let ping = Frame::Ping(PingFrame { nonce: 1 });
    // The right key, but after the deadline.
    let late = raw_control(
        &server,
        Duration::from_millis(800),
        std::slice::from_ref(&auth),
    )
    .await;
    assert_eq!(late, Some(AppErrorCode::Unauthenticated));
    // Another control frame before AUTH.
    let first = raw_control(&server, Duration::ZERO, &[ping, auth.clone()]).await;
    assert_eq!(first, Some(AppErrorCode::Unauthenticated));
    // A request-stream frame on the control stream before AUTH.
    let r = req("m", 1);
    let request = Frame::Request(RequestFrame::from_request(&r, 65536));
    let misplaced = raw_control(&server, Duration::ZERO, &[request, auth]).await;
    assert_eq!(misplaced, Some(AppErrorCode::Unauthenticated));
    assert_eq!(svc.submitted(), 0, "the service was called");
    assert_eq!(server.stats().unauthenticated, 3);
}

// ---------------------------------------------------------------- unknown models

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_gets_not_found_like_the_gateway() {
    let svc = Recorder::serving(&["smollm2"]);
    let server = start(svc.clone(), |c| c);
    let conn = client_with(&server, None)
        .connect(server.local_addr())
        .await
        .unwrap();
    let ev = conn
        .request(&req("gpt-5", 2))
        .await
        .unwrap()
        .collect_all()
        .await;
    match ev.unwrap().as_slice() {
        [InferenceEvent::Error { code, message }] => {
            assert_eq!(*code, ErrorCode::NotFound);
            assert!(message.contains("gpt-5"), "{message}");
        }
        other => panic!("expected one not_found ERROR, got {other:?}"),
    }
    assert_eq!(svc.submitted(), 0);
    let ok = conn
        .request(&req("smollm2", 2))
        .await
        .unwrap()
        .collect_all()
        .await;
    assert_eq!(ok.unwrap().len(), 4);
    assert_eq!(server.stats().unknown_model, 1);

    // The switch mirrors GatewayConfig::accept_any_model.
    let svc = Recorder::serving(&["smollm2"]);
    let server = start(svc.clone(), |c| c.accept_any_model(true));
    let conn = client_with(&server, None)
        .connect(server.local_addr())
        .await
        .unwrap();
    let ev = conn
        .request(&req("gpt-5", 2))
        .await
        .unwrap()
        .collect_all()
        .await;
    assert_eq!(ev.unwrap().len(), 4);
}

// ---------------------------------------------------------------- 0-RTT

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_rtt_works_for_an_authenticated_client() {
    let svc = Recorder::new(Some(2), Duration::ZERO);
    let server = start(svc.clone(), |c| c.api_keys(keys()));
    let c = client_with(&server, Some(KEY));
    let first = c.connect(server.local_addr()).await.unwrap();
    assert!(!first.zero_rtt_attempted());
    first
        .request(&req("m", 2))
        .await
        .unwrap()
        .collect_all()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.close();
    let second = c.connect(server.local_addr()).await.unwrap();
    assert!(
        second.zero_rtt_attempted(),
        "no resumable session was cached"
    );
    // AUTH and the request go out in 0-RTT data.
    let s = second.request(&req("m", 2)).await.unwrap();
    assert_eq!(second.zero_rtt_accepted().await, Some(true));
    assert_eq!(s.collect_all().await.unwrap().len(), 4);
    assert_eq!(svc.clients(), vec![Some(key_label(KEY)); 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_0rtt_resends_auth_and_the_retried_request_is_served() {
    let identity = Identity::self_signed(&["localhost"]).unwrap();
    let svc = Recorder::new(Some(1), Duration::ZERO);
    let cfg = || ServerConfig::new(identity.clone()).api_keys(keys());
    let a = Server::bind("127.0.0.1:0".parse().unwrap(), cfg(), svc.clone()).unwrap();
    let addr = a.local_addr();
    let c = Client::new(ClientConfig::new(Trust::Pinned(a.fingerprint())).api_key(KEY)).unwrap();
    let first = c.connect(addr).await.unwrap();
    first
        .request(&req("m", 1))
        .await
        .unwrap()
        .collect_all()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.close();
    a.shutdown().await;
    // The same identity restarted on the same port: it knows none of the old tickets.
    // (The old socket closes once the old server's tasks have dropped their endpoint handles.)
    let mut b = None;
    for _ in 0..200 {
        if let Ok(s) = Server::bind(addr, cfg(), svc.clone()) {
            b = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = b.expect("the port is free again");
    let second = c.connect(addr).await.unwrap();
    assert!(second.zero_rtt_attempted());
    // Sent in early data, the request is not processed; if the handshake was already over
    // when it was opened (a loaded machine), it went in 1-RTT data and is served.
    let early = match second.request(&req("m", 1)).await {
        Ok(s) => s.collect_all().await,
        // The rejection came while the request was being written.
        Err(RequestError::Write(quinn::WriteError::ZeroRttRejected)) => {
            Err(StreamError::ZeroRttRejected)
        }
        Err(e) => panic!("{e:?}"),
    };
    let served_early = match early {
        Err(StreamError::ZeroRttRejected) => 0,
        Ok(ev) if ev.len() == 3 => 1,
        other => panic!("{other:?}"),
    };
    assert_eq!(second.zero_rtt_accepted().await, Some(false));
    // Served only if the client sent AUTH again when its first one was in the dropped early
    // data (else this waits for the AUTH deadline and fails UNAUTHENTICATED), and did not open
    // a second control stream when it was not (PROTOCOL_ERROR).
    let retried = second
        .request(&req("m", 1))
        .await
        .unwrap()
        .collect_all()
        .await;
    assert_eq!(retried.unwrap().len(), 3);
    assert!(!second.is_closed());
    assert_eq!(svc.clients(), vec![Some(key_label(KEY)); 2 + served_early]);
    assert_eq!(b.stats().unauthenticated, 0);
    assert_eq!(b.stats().protocol_errors, 0);
}

/// What the relay does with datagrams from the client.
const FORWARD: u8 = 0;
const BLACK_HOLE: u8 = 1;
const CAPTURE: u8 = 2;

/// A UDP relay for one client: forwards both ways, drops everything, or records the client's
/// datagrams without forwarding them.
struct Relay {
    addr: SocketAddr,
    mode: Arc<AtomicU8>,
    captured: Arc<parking::Mutex<Vec<Vec<u8>>>>,
}

impl Relay {
    async fn start(server: SocketAddr) -> Self {
        let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let back = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = front.local_addr().unwrap();
        let mode = Arc::new(AtomicU8::new(FORWARD));
        let captured = Arc::new(parking::Mutex::new(Vec::new()));
        let peer = Arc::new(parking::Mutex::new(None::<SocketAddr>));
        {
            let (front, back, mode, captured, peer) = (
                front.clone(),
                back.clone(),
                mode.clone(),
                captured.clone(),
                peer.clone(),
            );
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok((n, from)) = front.recv_from(&mut buf).await {
                    *peer.lock() = Some(from);
                    match mode.load(Ordering::SeqCst) {
                        FORWARD => {
                            let _ = back.send_to(&buf[..n], server).await;
                        }
                        CAPTURE => captured.lock().push(buf[..n].to_vec()),
                        _ => {}
                    }
                }
            });
        }
        {
            let mode = mode.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok((n, _)) = back.recv_from(&mut buf).await {
                    let to = *peer.lock();
                    if let (FORWARD, Some(to)) = (mode.load(Ordering::SeqCst), to) {
                        let _ = front.send_to(&buf[..n], to).await;
                    }
                }
            });
        }
        Self {
            addr,
            mode,
            captured,
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }
}

/// Sends recorded client datagrams to the server from a fresh socket (a new "attacker" address)
/// and keeps the socket open a while, as an attacker replaying a first flight would.
async fn replay(datagrams: &[Vec<u8>], server: SocketAddr) -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for d in datagrams {
        s.send_to(d, server).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_0rtt_first_flight_runs_its_request_at_most_once() {
    let svc = Recorder::new(Some(1), Duration::ZERO);
    // A short peer timeout, so that the attacker's handshakes (which never complete) end soon.
    let server = start(svc.clone(), |c| {
        c.api_keys(keys()).peer_timeout(Duration::from_secs(1))
    });
    let c = client_with(&server, Some(KEY));
    // A full handshake leaves session tickets in the client's cache.
    let first = c.connect(server.local_addr()).await.unwrap();
    first
        .request(&req("m", 1))
        .await
        .unwrap()
        .collect_all()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.close();
    assert_eq!(svc.submitted(), 1);

    // The next connection resumes with 0-RTT (AUTH + REQUEST in early data) through a relay
    // that records its datagrams and delivers none: the ticket is still unused at the server.
    let relay = Relay::start(server.local_addr()).await;
    relay.set(CAPTURE);
    let captured_conn = c.connect(relay.addr).await.unwrap();
    assert!(captured_conn.zero_rtt_attempted());
    let pending = tokio::spawn({
        let conn = captured_conn.clone();
        async move {
            let r = req("m", 1);
            let _ = tokio::time::timeout(Duration::from_secs(3), async {
                if let Ok(s) = conn.request(&r).await {
                    let _ = s.collect_all().await;
                }
            })
            .await;
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let flight = relay.captured.lock().clone();
    assert!(!flight.is_empty(), "nothing captured");

    // First delivery of that flight (from another address): the early data is accepted once,
    // which shows the replay reaches the service when the ticket is fresh.
    let _a = replay(&flight, server.local_addr()).await;
    eventually(
        "the first delivery to be served",
        Duration::from_secs(5),
        || svc.submitted() == 2,
    )
    .await;
    // Replays of the same flight, each once the previous handshake is gone (quinn routes
    // Initial packets by their destination connection id, so a replay during the handshake
    // would only be a duplicate): the ticket was taken from the server's session store on
    // first use (single-use tickets, RFC 8446 section 8.1), so their early data is rejected
    // and the request does not run again.
    for _ in 0..2 {
        eventually(
            "the replayed handshake to time out",
            Duration::from_secs(10),
            || server.stats().connections == 0,
        )
        .await;
        // quinn keeps a closed connection's ids for a few PTOs.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let _again = replay(&flight, server.local_addr()).await;
        eventually(
            "the replay to reach the server",
            Duration::from_secs(5),
            || server.stats().connections == 1,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(svc.submitted(), 2, "a replayed 0-RTT request ran twice");
    }
    captured_conn.close();
    let _ = pending.await;
}

// ---------------------------------------------------------------- dead peers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_client_has_its_generation_cancelled_within_10s() {
    // Default timeouts: the point is that the server's own settings detect the dead peer.
    let svc = Recorder::new(None, Duration::from_millis(50));
    let server = start(svc.clone(), |c| c);
    let relay = Relay::start(server.local_addr()).await;
    // The client's own idle timeout and keep-alive stay at their (long) defaults.
    let conn = client_with(&server, None)
        .connect(relay.addr)
        .await
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut s = conn.request(&req("m", u32::MAX)).await.unwrap();
        for _ in 0..3 {
            s.next().await.unwrap().unwrap();
        }
        streams.push(s);
    }
    assert_eq!(svc.live.load(Ordering::SeqCst), 3);
    // The client vanishes: no CONNECTION_CLOSE, no ACKs, nothing (SIGKILL, cable pulled).
    relay.set(BLACK_HOLE);
    let gone = Instant::now();
    eventually(
        "the service to see its 3 event streams dropped",
        Duration::from_secs(10),
        || svc.dropped.load(Ordering::SeqCst) == 3,
    )
    .await;
    eprintln!("dead peer's work cancelled after {:?}", gone.elapsed());
    assert_eq!(svc.live.load(Ordering::SeqCst), 0);
    eventually(
        "the connection to be forgotten",
        Duration::from_secs(2),
        || server.stats().connections == 0,
    )
    .await;
    drop(streams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_quiet_client_is_kept_past_the_peer_timeout() {
    let svc = Recorder::new(Some(1), Duration::ZERO);
    let server = start(svc.clone(), |c| {
        c.peer_timeout(Duration::from_secs(1))
            .keep_alive_interval(Some(Duration::from_millis(200)))
    });
    // The client sends nothing on its own (no keep-alive): the server's PINGs keep it alive.
    let cfg = ClientConfig::new(Trust::Pinned(server.fingerprint())).keep_alive_interval(None);
    let conn = Client::new(cfg)
        .unwrap()
        .connect(server.local_addr())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!conn.is_closed(), "{:?}", conn.quinn().close_reason());
    assert_served_one(&conn).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_ttl_closes_connections_without_streams() {
    let svc = Recorder::new(Some(1), Duration::ZERO);
    let server = start(svc.clone(), |c| {
        c.connection_ttl(Duration::from_millis(500))
    });
    let conn = client_with(&server, None)
        .connect(server.local_addr())
        .await
        .unwrap();
    conn.request(&req("m", 1))
        .await
        .unwrap()
        .collect_all()
        .await
        .unwrap();
    eventually(
        "the idle connection to close",
        Duration::from_secs(5),
        || conn.is_closed(),
    )
    .await;
    assert_eq!(close_code(&conn), Some(AppErrorCode::NoError));
}

// ---------------------------------------------------------------- connection limits

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_per_ip_limit_are_refused() {
    let svc = Recorder::new(Some(1), Duration::ZERO);
    // (With a limit of 2, the second and later connections also go through a QUIC Retry.)
    let server = start(svc.clone(), |c| c.max_connections_per_ip(2));
    // Without 0-RTT, `connect` returns once the server has admitted (or refused) the
    // connection, so the three arrive in order.
    let c = keyless_client(&server);
    let a = c.connect(server.local_addr()).await.unwrap();
    let b = c.connect(server.local_addr()).await.unwrap();
    match c.connect(server.local_addr()).await {
        Err(ClientError::Connection {
            source: quinn::ConnectionError::ConnectionClosed(_),
            ..
        }) => {}
        other => panic!("the third connection from one address was not refused: {other:?}"),
    }
    assert!(server.stats().refused_connections >= 1);
    // A place frees up when a connection ends.
    a.close();
    eventually("the slot to be released", Duration::from_secs(5), || {
        server.stats().connections == 1
    })
    .await;
    let d = keyless_client(&server)
        .connect(server.local_addr())
        .await
        .unwrap();
    assert_served_one(&d).await;
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_connections_give_their_place_to_a_client_with_a_key() {
    let svc = Recorder::new(Some(1), Duration::ZERO);
    // 4 per address: 1 of them without a key; a long AUTH timeout, so only eviction closes.
    let server = start(svc.clone(), |c| {
        c.api_keys(keys())
            .auth_timeout(Duration::from_secs(30))
            .max_connections_per_ip(4)
    });
    let keyless = keyless_client(&server);
    // A client that connects and never sends AUTH holds the address's keyless place...
    let idle = keyless.connect(server.local_addr()).await.unwrap();
    // ...until a client with a key connects: it takes the place, authenticates and is served.
    let keyed = client_with(&server, Some(KEY))
        .connect(server.local_addr())
        .await
        .unwrap();
    assert_served_one(&keyed).await;
    eventually(
        "the keyless connection to be closed",
        Duration::from_secs(5),
        || idle.is_closed(),
    )
    .await;
    assert_eq!(close_code(&idle), Some(AppErrorCode::Unauthenticated));
    // The authenticated connection keeps its place when more keyless ones come.
    let more = keyless.connect(server.local_addr()).await.unwrap();
    let _more2 = keyless.connect(server.local_addr()).await.unwrap();
    eventually(
        "the older keyless connection to be closed",
        Duration::from_secs(5),
        || more.is_closed(),
    )
    .await;
    assert_served_one(&keyed).await;
}

// ---------------------------------------------------------------- drain

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_refuses_new_connections_and_streams_and_finishes_running_ones() {
    let svc = Recorder::new(Some(20), Duration::from_millis(20));
    let server = start(svc.clone(), |c| c);
    let c = client_with(&server, None);
    let conn = c.connect(server.local_addr()).await.unwrap();
    let running = conn.request(&req("m", 20)).await.unwrap();
    eventually("the request to run", Duration::from_secs(5), || {
        svc.submitted() == 1
    })
    .await;
    server.start_draining();
    eventually("GOAWAY to arrive", Duration::from_secs(5), || {
        conn.is_draining()
    })
    .await;
    // A new stream on the old connection (raw: the client would not open one) is refused.
    let (mut send, mut recv) = conn.quinn().open_bi().await.unwrap();
    let bytes = ClientStream::encode_request(&req("m", 1), 65536).unwrap();
    let _ = send.write_all(&bytes).await;
    let _ = send.finish();
    match recv.read_to_end(1 << 16).await {
        Err(quinn::ReadToEndError::Read(quinn::ReadError::Reset(code))) => {
            assert_eq!(
                AppErrorCode::from_u64(code.into_inner()),
                Some(AppErrorCode::Refused)
            );
        }
        other => panic!("expected REFUSED, got {other:?}"),
    }
    // A new connection is refused.
    let fresh = keyless_client(&server).connect(server.local_addr()).await;
    assert!(fresh.is_err(), "a connection was accepted while draining");
    assert!(server.stats().refused_connections >= 1);
    // The running request still completes.
    assert_eq!(running.collect_all().await.unwrap().len(), 22);
    assert_eq!(svc.submitted(), 1);
    assert_eq!(svc.dropped.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_streams_ends_running_requests_with_shutting_down_and_cancels_them() {
    let svc = Recorder::new(None, Duration::from_millis(20));
    let server = start(svc.clone(), |c| c);
    let conn = client_with(&server, None)
        .connect(server.local_addr())
        .await
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut s = conn.request(&req("m", u32::MAX)).await.unwrap();
        s.next().await.unwrap().unwrap();
        streams.push(s);
    }
    server.start_draining();
    server.abort_streams();
    for s in streams {
        let events = tokio::time::timeout(Duration::from_secs(5), s.collect_all())
            .await
            .expect("the stream ends")
            .expect("it ends with a frame, not a reset");
        match events.last() {
            Some(InferenceEvent::Error { code, .. }) => assert_eq!(*code, ErrorCode::ShuttingDown),
            other => panic!("expected ERROR shutting_down, got {other:?}"),
        }
    }
    eventually("the work to be cancelled", Duration::from_secs(5), || {
        svc.dropped.load(Ordering::SeqCst) == 3 && svc.live.load(Ordering::SeqCst) == 0
    })
    .await;
    assert_eq!(server.stats().aborted, 3);
}
