//! The claudelink server: a quinn endpoint serving each bidirectional stream as one request
//! through an [`InferenceService`], and other ALPNs (e.g. `h3`) through registered
//! [`ConnectionHandler`]s on the same UDP socket.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use quinn::VarInt;
use quinn::crypto::rustls::QuicServerConfig;
use tokio::sync::mpsc;

use crate::codec::{AppErrorCode, DEFAULT_MAX_FRAME_SIZE, HARD_MAX_FRAME_SIZE, Health};
use crate::service::{ErrorCode, EventStream, InferenceService};
use crate::state::{ConnectionAction, ConnectionState, ServerStream, ServerStreamAction, Side};
use crate::tls::{CertFingerprint, Identity, TlsError};

/// The ALPN protocol id of this protocol version.
pub const ALPN: &[u8] = b"claudelink/2";

/// Serves connections that negotiated another ALPN on the claudelink endpoint (e.g. HTTP/3).
///
/// The handler receives the established connection and owns it until its future ends.
pub trait ConnectionHandler: Send + Sync + 'static {
    /// Serves one connection.
    fn handle(&self, conn: quinn::Connection) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Server settings. Build with [`ServerConfig::new`] and the setters.
#[derive(Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    identity: Identity,
    max_concurrent_streams: u32,
    connection_ttl: Duration,
    keep_alive_interval: Option<Duration>,
    stream_buffer_size: u32,
    max_frame_size: u32,
    send_timeout: Duration,
    request_budget: usize,
    handlers: Vec<(Vec<u8>, Arc<dyn ConnectionHandler>)>,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("fingerprint", &self.identity.fingerprint())
            .field("max_concurrent_streams", &self.max_concurrent_streams)
            .field("connection_ttl", &self.connection_ttl)
            .field("keep_alive_interval", &self.keep_alive_interval)
            .field("stream_buffer_size", &self.stream_buffer_size)
            .field("max_frame_size", &self.max_frame_size)
            .field("send_timeout", &self.send_timeout)
            .field("request_budget", &self.request_budget)
            .field(
                "alpns",
                &self
                    .handlers
                    .iter()
                    .map(|(a, _)| String::from_utf8_lossy(a).into_owned())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl ServerConfig {
    /// Defaults: 256 concurrent streams per connection, `connection_ttl` 300 s, keep-alive
    /// every 15 s, 64 KiB per-stream windows, 256 KiB frames, 10 s send timeout, 4 MiB of
    /// buffered request bytes per connection.
    pub fn new(identity: Identity) -> Self {
        Self {
            identity,
            max_concurrent_streams: 256,
            connection_ttl: Duration::from_secs(300),
            keep_alive_interval: Some(Duration::from_secs(15)),
            stream_buffer_size: 64 << 10,
            max_frame_size: DEFAULT_MAX_FRAME_SIZE,
            send_timeout: Duration::from_secs(10),
            request_budget: 4 << 20,
            handlers: Vec::new(),
        }
    }

    /// Request streams a client may have open at once on one connection (QUIC MAX_STREAMS).
    pub fn max_concurrent_streams(mut self, n: u32) -> Self {
        self.max_concurrent_streams = n;
        self
    }

    /// Idle timeout of a connection.
    pub fn connection_ttl(mut self, ttl: Duration) -> Self {
        self.connection_ttl = ttl;
        self
    }

    /// QUIC keep-alive interval (`None`: off).
    pub fn keep_alive_interval(mut self, every: Option<Duration>) -> Self {
        self.keep_alive_interval = every;
        self
    }

    /// Per-stream receive window.
    pub fn stream_buffer_size(mut self, bytes: u32) -> Self {
        self.stream_buffer_size = bytes;
        self
    }

    /// Largest frame payload accepted (clamped to 16 MiB).
    pub fn max_frame_size(mut self, bytes: u32) -> Self {
        self.max_frame_size = bytes.min(HARD_MAX_FRAME_SIZE);
        self
    }

    /// How long one write may wait for a client that does not read before the stream is
    /// reset with `SLOW_READER` and its work cancelled.
    pub fn send_timeout(mut self, t: Duration) -> Self {
        self.send_timeout = t;
        self
    }

    /// Bytes of not-yet-complete REQUEST frames a connection may hold buffered in total.
    pub fn request_budget(mut self, bytes: usize) -> Self {
        self.request_budget = bytes;
        self
    }

    /// Also serves connections that negotiate `alpn` (e.g. `b"h3"`) on the same endpoint,
    /// handing them to `handler`. The server advertises `claudelink/2` first, then these in
    /// registration order.
    pub fn alpn_handler(mut self, alpn: &[u8], handler: Arc<dyn ConnectionHandler>) -> Self {
        self.handlers.retain(|(a, _)| a != alpn);
        self.handlers.push((alpn.to_vec(), handler));
        self
    }

    /// The server's identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Builds the quinn server config this server uses.
    pub fn quinn_config(&self) -> Result<quinn::ServerConfig, ServerError> {
        let mut alpns = vec![ALPN.to_vec()];
        alpns.extend(self.handlers.iter().map(|(a, _)| a.clone()));
        let tls = self.identity.rustls_server_config(alpns)?;
        let crypto = QuicServerConfig::try_from(Arc::new(tls))
            .map_err(|e| ServerError::Quic(e.to_string()))?;
        let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        let mut t = quinn::TransportConfig::default();
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_streams))
            // Our control stream plus HTTP/3's control and QPACK streams.
            .max_concurrent_uni_streams(VarInt::from_u32(16))
            .stream_receive_window(VarInt::from_u32(self.stream_buffer_size.max(1024)))
            // Bounds what one connection can make us buffer in quinn.
            .receive_window(VarInt::from_u32(
                self.stream_buffer_size
                    .saturating_mul(16)
                    .max(self.max_frame_size.saturating_mul(2)),
            ))
            .send_window(
                u64::from(self.stream_buffer_size) * u64::from(self.max_concurrent_streams.max(1)),
            )
            .keep_alive_interval(self.keep_alive_interval)
            .max_idle_timeout(Some(
                quinn::IdleTimeout::try_from(self.connection_ttl)
                    .map_err(|e| ServerError::Quic(e.to_string()))?,
            ));
        cfg.transport_config(Arc::new(t));
        Ok(cfg)
    }
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// TLS setup failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// quinn rejected the configuration.
    #[error("QUIC configuration rejected: {0}")]
    Quic(String),
    /// The UDP socket could not be bound.
    #[error("cannot bind UDP {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Counters of a running server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerStats {
    /// claudelink connections open.
    pub connections: u64,
    /// Request streams being served.
    pub active_streams: u64,
    /// Requests handed to the service.
    pub requests: u64,
    /// Requests cancelled by the client (stream reset or stopped) before they finished.
    pub cancelled: u64,
    /// Streams and connections ended for protocol violations.
    pub protocol_errors: u64,
    /// Streams reset because the client did not read.
    pub slow_readers: u64,
    /// Streams refused after GOAWAY.
    pub refused: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    active_streams: AtomicU64,
    requests: AtomicU64,
    cancelled: AtomicU64,
    protocol_errors: AtomicU64,
    slow_readers: AtomicU64,
    refused: AtomicU64,
}

enum ConnCommand {
    GoAway {
        code: Option<ErrorCode>,
        retry_after_ms: u32,
    },
}

struct ConnEntry {
    remote: SocketAddr,
    active: Arc<AtomicU32>,
    tx: mpsc::UnboundedSender<ConnCommand>,
}

struct Shared {
    service: Arc<dyn InferenceService>,
    cfg: ServerConfig,
    counters: Counters,
    conns: Mutex<HashMap<usize, ConnEntry>>,
}

/// A running claudelink server (on the current tokio runtime).
///
/// ```no_run
/// # async fn run(service: std::sync::Arc<dyn claudelink_proto::InferenceService>) -> Result<(), Box<dyn std::error::Error>> {
/// use claudelink_proto::{Identity, Server, ServerConfig};
/// let identity = Identity::self_signed(&["localhost"])?;
/// let server = Server::bind("127.0.0.1:4433".parse()?, ServerConfig::new(identity), service)?;
/// println!("claudelink on {} fingerprint {}", server.local_addr(), server.fingerprint());
/// # Ok(()) }
/// ```
pub struct Server {
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    fingerprint: CertFingerprint,
    accept: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("local_addr", &self.local_addr())
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

/// A claudelink connection as the server sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// Id for [`Server::goaway`].
    pub id: usize,
    /// Peer address.
    pub remote: SocketAddr,
    /// Request streams being served on it.
    pub active_streams: u32,
}

impl Server {
    /// Binds a UDP socket and starts accepting. Must be called inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        config: ServerConfig,
        service: Arc<dyn InferenceService>,
    ) -> Result<Self, ServerError> {
        let qcfg = config.quinn_config()?;
        let endpoint = quinn::Endpoint::server(qcfg, addr)
            .map_err(|source| ServerError::Bind { addr, source })?;
        let fingerprint = config.identity.fingerprint();
        tracing::info!(%fingerprint, addr = ?endpoint.local_addr().ok(), "claudelink server listening");
        let shared = Arc::new(Shared {
            service,
            cfg: config,
            counters: Counters::default(),
            conns: Mutex::new(HashMap::new()),
        });
        let accept = tokio::spawn(accept_loop(endpoint.clone(), shared.clone()));
        Ok(Self {
            endpoint,
            shared,
            fingerprint,
            accept,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// SHA-256 fingerprint of the server certificate (for clients to pin).
    pub fn fingerprint(&self) -> CertFingerprint {
        self.fingerprint
    }

    /// The quinn endpoint.
    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    /// Counters.
    pub fn stats(&self) -> ServerStats {
        let c = &self.shared.counters;
        ServerStats {
            connections: c.connections.load(Ordering::Relaxed),
            active_streams: c.active_streams.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            protocol_errors: c.protocol_errors.load(Ordering::Relaxed),
            slow_readers: c.slow_readers.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
        }
    }

    /// The open claudelink connections.
    pub fn connections(&self) -> Vec<ConnectionInfo> {
        let conns = self.shared.conns.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = conns
            .iter()
            .map(|(id, e)| ConnectionInfo {
                id: *id,
                remote: e.remote,
                active_streams: e.active.load(Ordering::Relaxed),
            })
            .collect();
        v.sort_by_key(|c| c.id);
        v
    }

    /// Sends GOAWAY on one connection (to shed load): streams already open finish, later
    /// ones are refused and the client moves new requests elsewhere. Returns whether the
    /// connection was found.
    pub fn goaway(&self, id: usize, code: Option<ErrorCode>, retry_after_ms: u32) -> bool {
        let conns = self.shared.conns.lock().unwrap_or_else(|e| e.into_inner());
        conns.get(&id).is_some_and(|e| {
            e.tx.send(ConnCommand::GoAway {
                code,
                retry_after_ms,
            })
            .is_ok()
        })
    }

    /// Sends GOAWAY on every connection.
    pub fn goaway_all(&self, code: Option<ErrorCode>, retry_after_ms: u32) {
        let conns = self.shared.conns.lock().unwrap_or_else(|e| e.into_inner());
        for e in conns.values() {
            let _ = e.tx.send(ConnCommand::GoAway {
                code,
                retry_after_ms,
            });
        }
    }

    /// Stops accepting, closes every connection and waits until they are gone.
    pub async fn shutdown(self) {
        self.accept.abort();
        self.endpoint
            .close(VarInt::from_u32(0), b"server shutting down");
        self.endpoint.wait_idle().await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    while let Some(incoming) = endpoint.accept().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let Ok(mut connecting) = incoming.accept() else {
                return;
            };
            let protocol = match connecting.handshake_data().await {
                Ok(hd) => hd
                    .downcast::<quinn::crypto::rustls::HandshakeData>()
                    .ok()
                    .and_then(|h| h.protocol),
                Err(e) => {
                    tracing::debug!(error = %e, "handshake failed");
                    return;
                }
            };
            match protocol.as_deref() {
                Some(p) if p == ALPN => {
                    // 0.5-RTT: requests sent in the client's 0-RTT data are served at once.
                    let conn = match connecting.into_0rtt() {
                        Ok((conn, _)) => conn,
                        Err(connecting) => match connecting.await {
                            Ok(c) => c,
                            Err(_) => return,
                        },
                    };
                    serve_connection(conn, shared).await;
                }
                Some(p) => {
                    let handler = shared
                        .cfg
                        .handlers
                        .iter()
                        .find(|(a, _)| a == p)
                        .map(|(_, h)| h.clone());
                    match (handler, connecting.await) {
                        (Some(h), Ok(conn)) => h.handle(conn).await,
                        (None, Ok(conn)) => conn.close(
                            VarInt::from_u64(AppErrorCode::ProtocolError.to_u64())
                                .unwrap_or(VarInt::from_u32(1)),
                            b"no handler for ALPN",
                        ),
                        (_, Err(_)) => {}
                    }
                }
                None => {
                    if let Ok(conn) = connecting.await {
                        conn.close(code(AppErrorCode::ProtocolError), b"ALPN required");
                    }
                }
            }
        });
    }
}

pub(crate) fn code(c: AppErrorCode) -> VarInt {
    VarInt::from_u64(c.to_u64()).unwrap_or(VarInt::from_u32(1))
}

/// Per-connection context shared by its tasks.
struct ConnCtx {
    conn: quinn::Connection,
    shared: Arc<Shared>,
    state: Mutex<ConnectionState>,
    control: tokio::sync::Mutex<Option<quinn::SendStream>>,
    active: Arc<AtomicU32>,
    budget: AtomicUsize,
    last_stream_id: AtomicU64,
}

impl ConnCtx {
    fn lock(&self) -> std::sync::MutexGuard<'_, ConnectionState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Carries out the connection state machine's queued actions.
    async fn drive(&self) {
        loop {
            let action = self.lock().poll_action();
            let Some(action) = action else { return };
            match action {
                ConnectionAction::SendControl(bytes) => {
                    let mut ctl = self.control.lock().await;
                    if ctl.is_none() {
                        match self.conn.open_uni().await {
                            Ok(s) => *ctl = Some(s),
                            Err(_) => return,
                        }
                    }
                    if let Some(s) = ctl.as_mut()
                        && s.write_all(&bytes).await.is_err()
                    {
                        return;
                    }
                }
                ConnectionAction::Close(c) => {
                    self.shared
                        .counters
                        .protocol_errors
                        .fetch_add(1, Ordering::Relaxed);
                    self.conn.close(code(c), b"control stream violation");
                }
                ConnectionAction::PingReceived { nonce } => {
                    let m = self.shared.service.metrics();
                    let health = Health {
                        ready: self.shared.service.ready(),
                        queue_depth: m.queue_depth.min(u64::from(u32::MAX)) as u32,
                        running: m.running.min(u64::from(u32::MAX)) as u32,
                        active_streams: self.active.load(Ordering::Relaxed),
                    };
                    self.lock().send_pong(nonce, health);
                }
                _ => {}
            }
        }
    }
}

async fn serve_connection(conn: quinn::Connection, shared: Arc<Shared>) {
    let id = conn.stable_id();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let active = Arc::new(AtomicU32::new(0));
    shared
        .conns
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(
            id,
            ConnEntry {
                remote: conn.remote_address(),
                active: active.clone(),
                tx,
            },
        );
    shared.counters.connections.fetch_add(1, Ordering::Relaxed);
    let ctx = Arc::new(ConnCtx {
        conn: conn.clone(),
        state: Mutex::new(ConnectionState::new(
            Side::Server,
            shared.cfg.max_frame_size,
            Duration::from_secs(10),
        )),
        control: tokio::sync::Mutex::new(None),
        active,
        budget: AtomicUsize::new(shared.cfg.request_budget),
        last_stream_id: AtomicU64::new(0),
        shared: shared.clone(),
    });
    let mut control_seen = false;
    loop {
        tokio::select! {
            bi = conn.accept_bi() => match bi {
                Ok((send, recv)) => {
                    let ctx = ctx.clone();
                    tokio::spawn(serve_stream(ctx, send, recv));
                }
                Err(_) => break,
            },
            uni = conn.accept_uni() => match uni {
                Ok(recv) if !control_seen => {
                    control_seen = true;
                    tokio::spawn(read_control(ctx.clone(), recv));
                }
                Ok(_) => {
                    shared.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    conn.close(code(AppErrorCode::ProtocolError), b"second control stream");
                    break;
                }
                Err(_) => break,
            },
            cmd = rx.recv() => match cmd {
                Some(ConnCommand::GoAway { code, retry_after_ms }) => {
                    let last = ctx.last_stream_id.load(Ordering::Acquire);
                    ctx.lock().send_goaway(code, last, retry_after_ms, "goaway");
                    ctx.drive().await;
                }
                None => break,
            },
        }
    }
    shared
        .conns
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id);
    shared.counters.connections.fetch_sub(1, Ordering::Relaxed);
}

async fn read_control(ctx: Arc<ConnCtx>, mut recv: quinn::RecvStream) {
    loop {
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => ctx.lock().recv_control(&chunk.bytes, Instant::now()),
            Ok(None) => ctx.lock().control_finished(),
            Err(_) => return,
        }
        ctx.drive().await;
        if ctx.lock().is_closed() {
            return;
        }
    }
}

struct ActiveGuard<'a>(&'a ConnCtx);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
        self.0
            .shared
            .counters
            .active_streams
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Returns reserved request bytes to the connection's budget.
struct Budget<'a> {
    ctx: &'a ConnCtx,
    held: usize,
}

impl Budget<'_> {
    fn take(&mut self, n: usize) -> bool {
        let ok = self
            .ctx
            .budget
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| b.checked_sub(n))
            .is_ok();
        if ok {
            self.held += n;
        }
        ok
    }

    fn release(&mut self) {
        self.ctx.budget.fetch_add(self.held, Ordering::AcqRel);
        self.held = 0;
    }
}

impl Drop for Budget<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

fn abort_stream(send: &mut quinn::SendStream, recv: &mut quinn::RecvStream, c: AppErrorCode) {
    let _ = send.reset(code(c));
    let _ = recv.stop(code(c));
}

async fn serve_stream(ctx: Arc<ConnCtx>, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
    let sid = u64::from(send.id());
    let counters = &ctx.shared.counters;
    if !ctx.lock().accept_stream(sid) {
        counters.refused.fetch_add(1, Ordering::Relaxed);
        abort_stream(&mut send, &mut recv, AppErrorCode::Refused);
        return;
    }
    ctx.last_stream_id.fetch_max(sid, Ordering::AcqRel);
    ctx.active.fetch_add(1, Ordering::Relaxed);
    counters.active_streams.fetch_add(1, Ordering::Relaxed);
    let _guard = ActiveGuard(&ctx);
    let cfg = &ctx.shared.cfg;
    let mut ss = ServerStream::new(sid, cfg.max_frame_size);
    let mut budget = Budget { ctx: &ctx, held: 0 };

    // Phase 1: read the REQUEST frame.
    let mut recv_done = false;
    let (request, sbs) = loop {
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => {
                if !budget.take(chunk.bytes.len()) {
                    abort_stream(&mut send, &mut recv, AppErrorCode::ExcessiveLoad);
                    return;
                }
                ss.recv(&chunk.bytes, false);
            }
            Ok(None) => {
                recv_done = true;
                ss.recv(&[], true);
            }
            Err(_) => {
                ss.peer_aborted();
                return;
            }
        }
        match ss.poll_action() {
            None => continue,
            Some(ServerStreamAction::Submit {
                request,
                stream_buffer_size,
            }) => break (request, stream_buffer_size),
            Some(ServerStreamAction::Abort(c)) => {
                counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                abort_stream(&mut send, &mut recv, c);
                return;
            }
            Some(_) => return,
        }
    };
    budget.release();
    counters.requests.fetch_add(1, Ordering::Relaxed);
    // Coalesce ready events into writes of at most the client's stream buffer size.
    let coalesce = (sbs as usize).clamp(1024, cfg.stream_buffer_size.max(1024) as usize);

    let mut events: Option<EventStream> = match ctx.shared.service.submit(request) {
        Ok(ev) => Some(ev),
        Err(e) => {
            ss.submit_failed(&e);
            None
        }
    };
    let stopped = send.stopped();
    tokio::pin!(stopped);
    let mut out: Vec<u8> = Vec::new();
    let mut scratch = [0u8; 256];
    loop {
        // Carry out queued actions.
        let mut finish = false;
        while let Some(a) = ss.poll_action() {
            match a {
                ServerStreamAction::Send(b) => {
                    if out.is_empty() {
                        out = b;
                    } else {
                        out.extend_from_slice(&b);
                    }
                }
                ServerStreamAction::Finish => finish = true,
                ServerStreamAction::Cancel => {
                    events = None;
                }
                ServerStreamAction::Abort(c) => {
                    counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    if events.take().is_some() {
                        counters.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    abort_stream(&mut send, &mut recv, c);
                    return;
                }
                ServerStreamAction::Submit { .. } => {}
            }
        }
        // Pull more ready events before writing, up to the coalescing size.
        if !finish && out.len() < coalesce {
            if let Some(ev) = events.as_mut() {
                match ev.next().now_or_never() {
                    Some(Some(e)) => {
                        ss.event(&e);
                        continue;
                    }
                    Some(None) => {
                        ss.events_ended();
                        continue;
                    }
                    None => {}
                }
            }
        }
        if !out.is_empty() {
            match tokio::time::timeout(cfg.send_timeout, send.write_all(&out)).await {
                Ok(Ok(())) => out.clear(),
                Ok(Err(_)) => {
                    // The client stopped reading the stream (it dropped the request).
                    if events.take().is_some() {
                        counters.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    return;
                }
                Err(_) => {
                    counters.slow_readers.fetch_add(1, Ordering::Relaxed);
                    drop(events.take());
                    abort_stream(&mut send, &mut recv, AppErrorCode::SlowReader);
                    return;
                }
            }
        }
        if finish {
            let _ = send.finish();
            return;
        }
        let Some(ev) = events.as_mut() else {
            return;
        };
        tokio::select! {
            biased;
            _ = &mut stopped => {
                ss.peer_aborted();
                counters.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
            r = recv.read(&mut scratch), if !recv_done => match r {
                Ok(None) => recv_done = true,
                Ok(Some(n)) => ss.recv(&scratch[..n], false),
                Err(_) => {
                    // The client reset its send side: it cancelled.
                    ss.peer_aborted();
                    counters.cancelled.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            },
            e = ev.next() => match e {
                Some(e) => ss.event(&e),
                None => ss.events_ended(),
            },
        }
    }
}
