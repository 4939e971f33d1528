//! The claudelink server: a quinn endpoint serving each bidirectional stream as one request
//! through an [`InferenceService`], and other ALPNs (e.g. `h3`) through registered
//! [`ConnectionHandler`]s on the same UDP socket.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use quinn::VarInt;
use quinn::crypto::rustls::QuicServerConfig;
use tokio::sync::{mpsc, watch};

use crate::auth::ApiKeys;
use crate::codec::{AppErrorCode, DEFAULT_MAX_FRAME_SIZE, HARD_MAX_FRAME_SIZE, Health};
use crate::limits::{ConnectionLimits, ConnectionSlot};
use crate::state::{ConnectionAction, ConnectionState, ServerStream, ServerStreamAction, Side};
use crate::tls::{CertFingerprint, Identity, TlsError};
use zerolayer_api::{ErrorCode, EventStream, InferenceService, ModelInfo};

/// The ALPN protocol id of this protocol version.
pub const ALPN: &[u8] = b"claudelink/2";

/// Serves connections that negotiated another ALPN on the claudelink endpoint (e.g. HTTP/3).
///
/// The handler receives the established connection and owns it until its future ends.
pub trait ConnectionHandler: Send + Sync + 'static {
    /// Serves one connection.
    fn handle(&self, conn: quinn::Connection) -> Pin<Box<dyn Future<Output = ()> + Send>>;

    /// Serves one connection that holds `slot` in the endpoint's connection limits (held until
    /// the returned future ends). On a server with API keys the connection starts in the
    /// smaller unauthenticated budget: a handler that checks keys calls
    /// [`ConnectionSlot::authenticated`] when the peer presents a valid one (and should close
    /// connections that do not within a few seconds). The default counts the connection as
    /// authenticated at once and calls [`ConnectionHandler::handle`].
    fn handle_with_slot(
        &self,
        conn: quinn::Connection,
        slot: ConnectionSlot,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        slot.authenticated();
        let served = self.handle(conn);
        // The slot stays taken until the connection's future ends.
        Box::pin(async move {
            served.await;
            drop(slot);
        })
    }
}

/// Server settings. Build with [`ServerConfig::new`] and the setters.
#[derive(Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    identity: Identity,
    max_concurrent_streams: u32,
    connection_ttl: Duration,
    peer_timeout: Duration,
    keep_alive_interval: Option<Duration>,
    stream_buffer_size: u32,
    max_frame_size: u32,
    send_timeout: Duration,
    request_budget: usize,
    api_keys: Arc<ApiKeys>,
    auth_timeout: Duration,
    accept_any_model: bool,
    max_connections: usize,
    max_connections_per_ip: usize,
    congestion: Congestion,
    handlers: Vec<(Vec<u8>, Arc<dyn ConnectionHandler>)>,
}

/// The QUIC congestion controller a server's connections use for what they send (responses).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Congestion {
    /// CUBIC (RFC 9438), quinn's default: loss-based, so every lost packet shrinks the window.
    #[default]
    Cubic,
    /// NewReno (RFC 9002's reference controller), loss-based.
    NewReno,
    /// quinn's BBR (experimental in quinn): model-based, paces at the measured bottleneck
    /// rate, and does not treat random loss as congestion.
    Bbr,
}

impl std::str::FromStr for Congestion {
    type Err = String;

    /// `cubic`, `newreno` or `bbr` (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "cubic" => Ok(Self::Cubic),
            "newreno" | "new-reno" | "reno" => Ok(Self::NewReno),
            "bbr" => Ok(Self::Bbr),
            _ => Err(format!(
                "unknown congestion controller {s:?} (cubic, newreno or bbr)"
            )),
        }
    }
}

impl Congestion {
    fn factory(self) -> Arc<dyn quinn::congestion::ControllerFactory + Send + Sync> {
        match self {
            Self::Cubic => Arc::new(quinn::congestion::CubicConfig::default()),
            Self::NewReno => Arc::new(quinn::congestion::NewRenoConfig::default()),
            Self::Bbr => Arc::new(quinn::congestion::BbrConfig::default()),
        }
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("fingerprint", &self.identity.fingerprint())
            .field("max_concurrent_streams", &self.max_concurrent_streams)
            .field("connection_ttl", &self.connection_ttl)
            .field("peer_timeout", &self.peer_timeout)
            .field("keep_alive_interval", &self.keep_alive_interval)
            .field("stream_buffer_size", &self.stream_buffer_size)
            .field("max_frame_size", &self.max_frame_size)
            .field("send_timeout", &self.send_timeout)
            .field("request_budget", &self.request_budget)
            .field("api_keys", &self.api_keys)
            .field("auth_timeout", &self.auth_timeout)
            .field("accept_any_model", &self.accept_any_model)
            .field("max_connections", &self.max_connections)
            .field("max_connections_per_ip", &self.max_connections_per_ip)
            .field("congestion", &self.congestion)
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
    /// Defaults: 256 concurrent streams per connection, `connection_ttl` 300 s, peer timeout
    /// 8 s with keep-alive every 2 s, 64 KiB per-stream windows, 256 KiB frames, 10 s send
    /// timeout, 4 MiB of buffered request bytes per connection, no API keys (open), 5 s to
    /// authenticate, unknown models refused, 4096 connections of which 128 per IP address.
    ///
    /// ```
    /// use std::time::Duration;
    /// use claudelink_proto::{ApiKeys, Identity, ServerConfig};
    /// let config = ServerConfig::new(Identity::self_signed(&["localhost"]).unwrap())
    ///     .api_keys(ApiKeys::new(["sk-1".to_string()]))
    ///     .peer_timeout(Duration::from_secs(8))
    ///     .keep_alive_interval(Some(Duration::from_secs(2)))
    ///     .max_connections_per_ip(64);
    /// assert!(config.quinn_config().is_ok());
    /// ```
    pub fn new(identity: Identity) -> Self {
        Self {
            identity,
            max_concurrent_streams: 256,
            connection_ttl: Duration::from_secs(300),
            peer_timeout: Duration::from_secs(8),
            keep_alive_interval: Some(Duration::from_secs(2)),
            stream_buffer_size: 64 << 10,
            max_frame_size: DEFAULT_MAX_FRAME_SIZE,
            send_timeout: Duration::from_secs(10),
            request_budget: 4 << 20,
            api_keys: Arc::new(ApiKeys::default()),
            auth_timeout: Duration::from_secs(5),
            accept_any_model: false,
            max_connections: 4096,
            max_connections_per_ip: 128,
            congestion: Congestion::default(),
            handlers: Vec::new(),
        }
    }

    /// Requires every claudelink connection to authenticate with one of these keys (an AUTH
    /// frame first on its control stream, within [`ServerConfig::auth_timeout`]); the key's
    /// label goes into [`InferenceRequest::client`](crate::InferenceRequest::client). An
    /// empty set (the default) serves every connection.
    pub fn api_keys(mut self, keys: ApiKeys) -> Self {
        self.api_keys = Arc::new(keys);
        self
    }

    /// How long after the handshake a client may take to send a valid AUTH before the
    /// connection is closed with `UNAUTHENTICATED` (only with [`ServerConfig::api_keys`]).
    pub fn auth_timeout(mut self, t: Duration) -> Self {
        self.auth_timeout = t;
        self
    }

    /// Serve requests naming a model the service does not list (`false`, the default, refuses
    /// them with ERROR `not_found` like the HTTP gateway; a service listing no models accepts
    /// any name).
    pub fn accept_any_model(mut self, yes: bool) -> Self {
        self.accept_any_model = yes;
        self
    }

    /// Most connections (claudelink and other ALPNs, handshakes included) the endpoint holds;
    /// further connection attempts are refused (0: no limit).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// Most connections from one IP address (0: no limit); further attempts from it are refused. Once half
    /// of this (or of [`ServerConfig::max_connections`]) is in use, new clients must first
    /// validate their address with a QUIC Retry, so spoofed addresses cannot use up the limits.
    pub fn max_connections_per_ip(mut self, n: usize) -> Self {
        self.max_connections_per_ip = n;
        self
    }

    /// The congestion controller of the server's side of each connection (default
    /// [`Congestion::Cubic`]).
    pub fn congestion(mut self, controller: Congestion) -> Self {
        self.congestion = controller;
        self
    }

    /// Request streams a client may have open at once on one connection (QUIC MAX_STREAMS).
    pub fn max_concurrent_streams(mut self, n: u32) -> Self {
        self.max_concurrent_streams = n;
        self
    }

    /// How long a live claudelink connection may stay without request streams before the
    /// server closes it (`NO_ERROR`, "idle"). Health PINGs do not count as activity.
    pub fn connection_ttl(mut self, ttl: Duration) -> Self {
        self.connection_ttl = ttl;
        self
    }

    /// How long the connection may go without hearing anything from the peer before it is
    /// considered gone (QUIC `max_idle_timeout`; the effective value is the smaller of both
    /// sides'). With keep-alive on, a live peer answers the server's PINGs, so this is the
    /// time in which a vanished client (killed, unplugged) is detected and its requests are
    /// cancelled.
    pub fn peer_timeout(mut self, t: Duration) -> Self {
        self.peer_timeout = t;
        self
    }

    /// QUIC keep-alive interval (`None`: off). Keep it well under the peer timeout, so a live
    /// but quiet client is never timed out.
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
            .congestion_controller_factory(self.congestion.factory())
            .max_idle_timeout(Some(
                quinn::IdleTimeout::try_from(self.peer_timeout)
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
    /// Streams refused after GOAWAY or while draining.
    pub refused: u64,
    /// Connection attempts refused: over [`ServerConfig::max_connections`] or
    /// [`ServerConfig::max_connections_per_ip`], or while draining.
    pub refused_connections: u64,
    /// Connections closed with `UNAUTHENTICATED` (wrong, late or missing AUTH).
    pub unauthenticated: u64,
    /// Requests refused with `not_found` (a model the service does not serve).
    pub unknown_model: u64,
    /// Running requests ended by [`Server::abort_streams`].
    pub aborted: u64,
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
    refused_connections: AtomicU64,
    unauthenticated: AtomicU64,
    unknown_model: AtomicU64,
    aborted: AtomicU64,
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
    /// Connections held on the endpoint, in total and per IP address.
    limits: ConnectionLimits,
    draining: AtomicBool,
    /// Set once by [`Server::abort_streams`]; every stream task watches it.
    abort: watch::Sender<bool>,
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
        let limits = ConnectionLimits::new(config.max_connections, config.max_connections_per_ip);
        let shared = Arc::new(Shared {
            service,
            cfg: config,
            counters: Counters::default(),
            conns: Mutex::new(HashMap::new()),
            limits,
            draining: AtomicBool::new(false),
            abort: watch::Sender::new(false),
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
            refused_connections: c.refused_connections.load(Ordering::Relaxed),
            unauthenticated: c.unauthenticated.load(Ordering::Relaxed),
            unknown_model: c.unknown_model.load(Ordering::Relaxed),
            aborted: c.aborted.load(Ordering::Relaxed),
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

    /// Starts draining (graceful shutdown, first step): GOAWAY on every connection, new
    /// connections refused, new request streams on existing connections reset with `REFUSED`
    /// (not processed: the client retries elsewhere). Running requests continue; end them
    /// with [`Server::abort_streams`] at the drain deadline.
    ///
    /// ```no_run
    /// # async fn run(server: claudelink_proto::Server) {
    /// server.start_draining();
    /// let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    /// while server.stats().active_streams > 0 && tokio::time::Instant::now() < deadline {
    ///     tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    /// }
    /// server.abort_streams();
    /// server.shutdown().await;
    /// # }
    /// ```
    pub fn start_draining(&self) {
        self.shared.draining.store(true, Ordering::Release);
        self.goaway_all(None, 0);
    }

    /// Whether [`Server::start_draining`] was called.
    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Acquire)
    }

    /// Ends every running request now (graceful shutdown, drain deadline): its work is
    /// cancelled (the service's event stream dropped) and the client gets ERROR
    /// `shutting_down`; streams still reading their REQUEST are reset with `REFUSED`. Also
    /// starts draining, so nothing new is accepted.
    pub fn abort_streams(&self) {
        self.start_draining();
        self.shared.abort.send_replace(true);
    }

    /// Stops accepting, closes every connection and waits until they are gone. Request
    /// streams still ending (e.g. after [`Server::abort_streams`]) get up to one second to
    /// send their last frames first.
    pub async fn shutdown(self) {
        self.accept.abort();
        let flush = Instant::now() + Duration::from_secs(1);
        while self.shared.counters.active_streams.load(Ordering::Relaxed) > 0
            && Instant::now() < flush
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if self.shared.abort.borrow().to_owned() {
            // The ERROR frames were handed to QUIC; give them a moment on the wire.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
        // Under pressure (half a limit used), a client must first prove it owns its address
        // (a QUIC Retry round trip), so that spoofed source addresses cannot fill the limits.
        if !incoming.remote_address_validated()
            && incoming.may_retry()
            && shared.limits.under_pressure(incoming.remote_address().ip())
        {
            let _ = incoming.retry();
            continue;
        }
        let slot = if shared.draining.load(Ordering::Acquire) {
            None
        } else {
            shared
                .limits
                .admit(
                    incoming.remote_address().ip(),
                    !shared.cfg.api_keys.is_empty(),
                )
                .ok()
        };
        let Some(slot) = slot else {
            shared
                .counters
                .refused_connections
                .fetch_add(1, Ordering::Relaxed);
            incoming.refuse();
            continue;
        };
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
                    let (handshake_tx, handshake) = watch::channel(false);
                    let conn = match connecting.into_0rtt() {
                        Ok((conn, established)) => {
                            tokio::spawn(async move {
                                established.await;
                                handshake_tx.send_replace(true);
                            });
                            conn
                        }
                        Err(connecting) => match connecting.await {
                            Ok(c) => {
                                handshake_tx.send_replace(true);
                                c
                            }
                            Err(_) => return,
                        },
                    };
                    serve_connection(conn, handshake, shared, slot).await;
                }
                Some(p) => {
                    let handler = shared
                        .cfg
                        .handlers
                        .iter()
                        .find(|(a, _)| a == p)
                        .map(|(_, h)| h.clone());
                    match (handler, connecting.await) {
                        (Some(h), Ok(conn)) => h.handle_with_slot(conn, slot).await,
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

/// Whether a connection's request streams may be served yet.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Gate {
    /// Waiting for the client's AUTH.
    Pending,
    /// Serve; requests carry this key label.
    Open(Option<Arc<str>>),
    /// The connection failed authentication or ended: serve nothing; waiting streams are
    /// reset with this code (so a client reads why, even before the connection's close).
    Closed(AppErrorCode),
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
    gate: watch::Sender<Gate>,
    /// Whether the TLS handshake completed (the connection may be served from 0.5-RTT on).
    handshake: watch::Receiver<bool>,
    /// When the connection last had a request stream starting or running (for
    /// `connection_ttl`).
    last_active: Mutex<Instant>,
    /// The connection's place in the endpoint's limits (leaves the unauthenticated budget on
    /// AUTH).
    slot: ConnectionSlot,
}

impl ConnCtx {
    fn lock(&self) -> std::sync::MutexGuard<'_, ConnectionState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn touch(&self) {
        *self.last_active.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    fn idle_deadline(&self) -> Instant {
        *self.last_active.lock().unwrap_or_else(|e| e.into_inner()) + self.shared.cfg.connection_ttl
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
                ConnectionAction::Close(AppErrorCode::Unauthenticated) => {
                    self.gate
                        .send_replace(Gate::Closed(AppErrorCode::Unauthenticated));
                    self.shared
                        .counters
                        .unauthenticated
                        .fetch_add(1, Ordering::Relaxed);
                    // Before the handshake completes, QUIC can only send the close in
                    // Initial/Handshake packets, which carry no application code (RFC 9000
                    // section 10.2.3): wait for it (bounded), so the client learns why.
                    let mut handshake = self.handshake.clone();
                    let _ = tokio::time::timeout(
                        Duration::from_secs(2),
                        handshake.wait_for(|done| *done),
                    )
                    .await;
                    tracing::debug!(remote = %self.conn.remote_address(), "claudelink connection failed to authenticate");
                    self.conn
                        .close(code(AppErrorCode::Unauthenticated), b"unauthenticated");
                }
                ConnectionAction::Close(c) => {
                    self.gate.send_replace(Gate::Closed(c));
                    self.shared
                        .counters
                        .protocol_errors
                        .fetch_add(1, Ordering::Relaxed);
                    self.conn.close(code(c), b"control stream violation");
                }
                ConnectionAction::Authenticated { client } => {
                    self.slot.authenticated();
                    self.gate.send_replace(Gate::Open(client.map(Arc::from)));
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

async fn serve_connection(
    conn: quinn::Connection,
    handshake: watch::Receiver<bool>,
    shared: Arc<Shared>,
    slot: ConnectionSlot,
) {
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
    let cfg = &shared.cfg;
    let state = ConnectionState::new(Side::Server, cfg.max_frame_size, Duration::from_secs(10))
        .require_auth(cfg.api_keys.clone(), Instant::now() + cfg.auth_timeout);
    let gate = if state.is_authenticated() {
        Gate::Open(None)
    } else {
        Gate::Pending
    };
    let ctx = Arc::new(ConnCtx {
        conn: conn.clone(),
        state: Mutex::new(state),
        control: tokio::sync::Mutex::new(None),
        active,
        budget: AtomicUsize::new(cfg.request_budget),
        last_stream_id: AtomicU64::new(0),
        gate: watch::Sender::new(gate),
        handshake,
        last_active: Mutex::new(Instant::now()),
        shared: shared.clone(),
        slot,
    });
    if shared.draining.load(Ordering::Acquire) {
        // Accepted just before draining started: tell the client at once.
        ctx.lock().send_goaway(None, 0, 0, "draining");
        ctx.drive().await;
    }
    let mut control_seen = false;
    loop {
        // The state machine's next deadline (the AUTH deadline on a server with keys).
        let timer = ctx.lock().poll_timeout();
        let idle_at = ctx.idle_deadline();
        tokio::select! {
            bi = conn.accept_bi() => match bi {
                Ok((send, recv)) => {
                    ctx.touch();
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
            _ = tokio::time::sleep_until(timer.unwrap_or(idle_at).into()), if timer.is_some() => {
                ctx.lock().handle_timeout(Instant::now());
                ctx.drive().await;
            }
            () = ctx.slot.evicted() => {
                // A newer keyless connection took this one's place in the keyless budget
                // before it authenticated.
                shared.counters.unauthenticated.fetch_add(1, Ordering::Relaxed);
                conn.close(code(AppErrorCode::Unauthenticated), b"unauthenticated");
                break;
            }
            _ = tokio::time::sleep_until(idle_at.into()) => {
                if ctx.active.load(Ordering::Acquire) > 0 {
                    ctx.touch();
                } else if ctx.idle_deadline() <= Instant::now() {
                    conn.close(code(AppErrorCode::NoError), b"idle");
                    break;
                }
            }
        }
    }
    ctx.gate.send_replace(Gate::Closed(AppErrorCode::Cancelled));
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
        self.0.touch();
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

/// The `not_found` message for a model the service does not serve, exactly as the HTTP
/// gateway decides it: a service listing no models accepts any name.
fn unknown_model(models: &[ModelInfo], model: &str) -> Option<String> {
    if models.is_empty() || models.iter().any(|m| m.id == model) {
        return None;
    }
    let served: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
    Some(format!(
        "model: {model} is not served here (served: {})",
        served.join(", ")
    ))
}

/// Waits until the connection authenticated (its key label) or failed / was aborted (`None`).
async fn await_gate(
    ctx: &ConnCtx,
    abort: &mut watch::Receiver<bool>,
) -> Result<Option<Arc<str>>, AppErrorCode> {
    let mut gate = ctx.gate.subscribe();
    tokio::select! {
        g = gate.wait_for(|g| *g != Gate::Pending) => match g.as_deref() {
            Ok(Gate::Open(client)) => Ok(client.clone()),
            Ok(Gate::Closed(c)) => Err(*c),
            _ => Err(AppErrorCode::Cancelled),
        },
        _ = abort.wait_for(|a| *a) => Err(AppErrorCode::Refused),
    }
}

/// Serves one request stream, in stages: admission (GOAWAY, drain, authentication), reading
/// the REQUEST, submitting it (or refusing it), then streaming the service's events.
async fn serve_stream(ctx: Arc<ConnCtx>, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
    let sid = u64::from(send.id());
    let counters = &ctx.shared.counters;
    if ctx.shared.draining.load(Ordering::Acquire) || !ctx.lock().accept_stream(sid) {
        counters.refused.fetch_add(1, Ordering::Relaxed);
        abort_stream(&mut send, &mut recv, AppErrorCode::Refused);
        return;
    }
    ctx.last_stream_id.fetch_max(sid, Ordering::AcqRel);
    let mut abort = ctx.shared.abort.subscribe();
    // Nothing of the stream is read before the client authenticated: its bytes wait in
    // QUIC's flow-control windows, and a connection that fails closes them all.
    let client = match await_gate(&ctx, &mut abort).await {
        Ok(c) => c,
        Err(c) => {
            // A reset, not the implicit finish of a dropped stream: a client that reads the
            // stream before the connection's close still learns why (e.g. UNAUTHENTICATED).
            abort_stream(&mut send, &mut recv, c);
            return;
        }
    };
    ctx.active.fetch_add(1, Ordering::Relaxed);
    counters.active_streams.fetch_add(1, Ordering::Relaxed);
    let _guard = ActiveGuard(&ctx);
    let mut stream = StreamTask {
        ctx: &ctx,
        ss: ServerStream::new(sid, ctx.shared.cfg.max_frame_size),
        send,
        recv,
        abort,
        recv_done: false,
        events: None,
        aborted: false,
    };
    let Some((mut request, stream_buffer_size)) = stream.read_request().await else {
        return;
    };
    request.client = client.as_deref().map(str::to_owned);
    stream.submit(request);
    stream.stream_events(stream_buffer_size).await;
}

/// One request stream being served (after admission).
struct StreamTask<'a> {
    ctx: &'a ConnCtx,
    ss: ServerStream,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    abort: watch::Receiver<bool>,
    /// The client finished its send side.
    recv_done: bool,
    /// The service's events; dropping them cancels the work.
    events: Option<EventStream>,
    /// [`Server::abort_streams`] ended this stream.
    aborted: bool,
}

impl StreamTask<'_> {
    fn counters(&self) -> &Counters {
        &self.ctx.shared.counters
    }

    /// Reads the REQUEST frame within the connection's request budget; `None` when the stream
    /// ended instead (reset, violation, shutdown), already handled.
    async fn read_request(&mut self) -> Option<(zerolayer_api::InferenceRequest, u32)> {
        let mut budget = Budget {
            ctx: self.ctx,
            held: 0,
        };
        loop {
            tokio::select! {
                biased;
                _ = self.abort.wait_for(|a| *a) => self.ss.shutting_down(),
                r = self.recv.read_chunk(64 << 10, true) => match r {
                    Ok(Some(chunk)) => {
                        if !budget.take(chunk.bytes.len()) {
                            abort_stream(&mut self.send, &mut self.recv, AppErrorCode::ExcessiveLoad);
                            return None;
                        }
                        self.ss.recv(&chunk.bytes, false);
                    }
                    Ok(None) => {
                        self.recv_done = true;
                        self.ss.recv(&[], true);
                    }
                    Err(_) => {
                        self.ss.peer_aborted();
                        return None;
                    }
                },
            }
            match self.ss.poll_action() {
                None => continue,
                Some(ServerStreamAction::Submit {
                    request,
                    stream_buffer_size,
                }) => return Some((request, stream_buffer_size)),
                Some(ServerStreamAction::Abort(c)) => {
                    let counter = if c == AppErrorCode::Refused {
                        &self.counters().refused
                    } else {
                        &self.counters().protocol_errors
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    abort_stream(&mut self.send, &mut self.recv, c);
                    return None;
                }
                Some(_) => return None,
            }
        }
    }

    /// Hands the request to the service, or refuses it (`not_found` for an unknown model, the
    /// service's own refusal).
    fn submit(&mut self, request: zerolayer_api::InferenceRequest) {
        let shared = &self.ctx.shared;
        let unknown = if shared.cfg.accept_any_model {
            None
        } else {
            unknown_model(&shared.service.models(), &request.model)
        };
        if let Some(msg) = unknown {
            self.counters()
                .unknown_model
                .fetch_add(1, Ordering::Relaxed);
            self.ss.reject(ErrorCode::NotFound, &msg);
            return;
        }
        self.counters().requests.fetch_add(1, Ordering::Relaxed);
        match shared.service.submit(request) {
            Ok(ev) => self.events = Some(ev),
            Err(e) => self.ss.submit_failed(&e),
        }
    }

    /// Cancels the work because the server is shutting down; the state machine queues the
    /// ERROR `shutting_down` frame.
    fn shut_down(&mut self) {
        self.aborted = true;
        self.counters().aborted.fetch_add(1, Ordering::Relaxed);
        self.events = None;
        self.ss.shutting_down();
    }

    /// Writes `out` within the send timeout. Returns `false` when the stream ended (the client
    /// went away or did not read), already handled. A shutdown during the write cancels the
    /// work at once; the ERROR frame follows the bytes being written.
    async fn write(&mut self, out: &[u8]) -> bool {
        let ctx: &ConnCtx = self.ctx;
        let counters = &ctx.shared.counters;
        let timeout = ctx.shared.cfg.send_timeout;
        let written = {
            let write = tokio::time::timeout(timeout, self.send.write_all(out));
            tokio::pin!(write);
            loop {
                tokio::select! {
                    r = &mut write => break r.map(|r| r.is_ok()),
                    _ = self.abort.wait_for(|a| *a), if !self.aborted && self.events.is_some() => {
                        self.aborted = true;
                        counters.aborted.fetch_add(1, Ordering::Relaxed);
                        self.events = None;
                        self.ss.shutting_down();
                    }
                }
            }
        };
        match written {
            Ok(true) => true,
            Ok(false) => {
                // The client stopped reading the stream (it dropped the request) or the
                // connection is gone.
                if self.events.take().is_some() {
                    counters.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                false
            }
            Err(_) => {
                counters.slow_readers.fetch_add(1, Ordering::Relaxed);
                drop(self.events.take());
                abort_stream(&mut self.send, &mut self.recv, AppErrorCode::SlowReader);
                false
            }
        }
    }

    /// Streams the service's events to the client until the terminal frame, a cancellation or
    /// a shutdown.
    async fn stream_events(mut self, stream_buffer_size: u32) {
        let ctx: &ConnCtx = self.ctx;
        let counters = &ctx.shared.counters;
        let cfg = &ctx.shared.cfg;
        // Coalesce ready events into writes of at most the client's stream buffer size.
        let coalesce =
            (stream_buffer_size as usize).clamp(1024, cfg.stream_buffer_size.max(1024) as usize);
        let stopped = self.send.stopped();
        tokio::pin!(stopped);
        let mut out: Vec<u8> = Vec::new();
        let mut scratch = [0u8; 256];
        loop {
            // Carry out queued actions.
            let mut finish = false;
            while let Some(a) = self.ss.poll_action() {
                match a {
                    ServerStreamAction::Send(b) => {
                        if out.is_empty() {
                            out = b;
                        } else {
                            out.extend_from_slice(&b);
                        }
                    }
                    ServerStreamAction::Finish => finish = true,
                    ServerStreamAction::Cancel => self.events = None,
                    ServerStreamAction::Abort(c) => {
                        counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                        if self.events.take().is_some() {
                            counters.cancelled.fetch_add(1, Ordering::Relaxed);
                        }
                        abort_stream(&mut self.send, &mut self.recv, c);
                        return;
                    }
                    ServerStreamAction::Submit { .. } => {}
                }
            }
            // Pull more ready events before writing, up to the coalescing size.
            if !finish
                && out.len() < coalesce
                && let Some(ev) = self.events.as_mut()
            {
                match ev.next().now_or_never() {
                    Some(Some(e)) => {
                        self.ss.event(&e);
                        continue;
                    }
                    Some(None) => {
                        self.ss.events_ended();
                        continue;
                    }
                    None => {}
                }
            }
            if !out.is_empty() {
                let was_aborted = self.aborted;
                if !self.write(&out).await {
                    return;
                }
                out.clear();
                if self.aborted && !was_aborted {
                    // Send the ERROR frame queued by the shutdown.
                    continue;
                }
            }
            if finish {
                let _ = self.send.finish();
                return;
            }
            let Some(ev) = self.events.as_mut() else {
                return;
            };
            let mut shut_down = false;
            tokio::select! {
                biased;
                _ = &mut stopped => {
                    // STOP_SENDING, or the connection is gone (closed, or the peer timed out).
                    self.ss.peer_aborted();
                    counters.cancelled.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                _ = self.abort.wait_for(|a| *a), if !self.aborted => shut_down = true,
                r = self.recv.read(&mut scratch), if !self.recv_done => match r {
                    Ok(None) => self.recv_done = true,
                    Ok(Some(n)) => self.ss.recv(&scratch[..n], false),
                    Err(_) => {
                        // The client reset its send side: it cancelled.
                        self.ss.peer_aborted();
                        counters.cancelled.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                },
                e = ev.next() => match e {
                    Some(e) => self.ss.event(&e),
                    None => self.ss.events_ended(),
                },
            }
            if shut_down {
                self.shut_down();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(id: &str) -> ModelInfo {
        ModelInfo {
            id: id.into(),
            display_name: id.into(),
            context_length: 0,
        }
    }

    #[test]
    fn unknown_models_are_decided_like_the_gateway() {
        assert_eq!(unknown_model(&[], "anything"), None);
        assert_eq!(unknown_model(&[model("a"), model("b")], "b"), None);
        let msg = unknown_model(&[model("a"), model("b")], "c").unwrap();
        assert!(msg.contains("model: c") && msg.contains("a, b"), "{msg}");
    }
}
