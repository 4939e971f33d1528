//! The claudelink client: connections (with 0-RTT resumption), request streams as async
//! `Stream`s of events (the pool over them is `pool.rs`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use quinn::VarInt;
use quinn::crypto::rustls::QuicClientConfig;
use tokio::sync::{oneshot, watch};

use crate::codec::{AppErrorCode, DEFAULT_MAX_FRAME_SIZE, EncodeError, Health};
use crate::server::{ALPN, code};
use crate::state::{ClientStream, ClientStreamError, ConnectionAction, ConnectionState, Side};
use crate::tls::{TlsError, Trust};
use zerolayer_api::{InferenceEvent, InferenceRequest};

/// An API key, never printed.
#[derive(Clone)]
struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// [`ClientConfig::connection_ttl`]'s default: a dead server's streams fail within 2 s.
const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(1);

/// [`ClientConfig::keep_alive_interval`]'s default: several PINGs per peer timeout, so one
/// lost packet does not close a healthy connection.
const DEFAULT_KEEP_ALIVE: Duration = Duration::from_millis(250);

/// Client settings. Build with [`ClientConfig::new`] and the setters.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientConfig {
    trust: Trust,
    api_key: Option<Secret>,
    server_name: String,
    stream_buffer_size: u32,
    connection_ttl: Duration,
    keep_alive_interval: Option<Duration>,
    max_frame_size: u32,
    health_timeout: Duration,
    zero_rtt: bool,
}

impl ClientConfig {
    /// Defaults: server name `localhost`, 64 KiB per-stream window, `connection_ttl` 1 s
    /// with a keep-alive PING every 250 ms (a server silent for 1 s is taken for gone, so a
    /// [`Pool`](crate::Pool) re-sends or fails its streams within 2 s of a crash; raise both
    /// on lossy long-distance links), 256 KiB frames, 5 s health timeout, 0-RTT on.
    pub fn new(trust: Trust) -> Self {
        Self {
            trust,
            api_key: None,
            server_name: "localhost".into(),
            stream_buffer_size: 64 << 10,
            connection_ttl: DEFAULT_PEER_TIMEOUT,
            keep_alive_interval: Some(DEFAULT_KEEP_ALIVE),
            max_frame_size: DEFAULT_MAX_FRAME_SIZE,
            health_timeout: Duration::from_secs(5),
            zero_rtt: true,
        }
    }

    /// The API key sent in an AUTH frame, the first frame of the control stream, on every
    /// connection (the [`Pool`](crate::Pool)'s too). A server configured with keys closes connections
    /// without a valid one; requests on them fail with [`RequestError::Unauthenticated`] /
    /// [`StreamError::Unauthenticated`].
    ///
    /// ```
    /// use claudelink_proto::{CertFingerprint, ClientConfig, Trust};
    /// let config = ClientConfig::new(Trust::Pinned(CertFingerprint([0; 32]))).api_key("sk-1");
    /// assert!(!format!("{config:?}").contains("sk-1"));
    /// ```
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(Secret(key.into()));
        self
    }

    /// TLS server name (SNI, and the name checked against the certificate with [`Trust::Roots`]).
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = name.into();
        self
    }

    /// Per-stream receive window: how far the server may run ahead of this client's reads.
    /// Also sent in every request.
    pub fn stream_buffer_size(mut self, bytes: u32) -> Self {
        self.stream_buffer_size = bytes;
        self
    }

    /// How long the server may stay silent before the connection is taken for lost (the
    /// QUIC idle timeout; the keep-alive PINGs keep a healthy idle connection open, and the
    /// server's own, shorter or longer, timeout also applies). Its streams then end with
    /// [`StreamError::ConnectionLost`]: the time a crashed or unreachable server's streams
    /// take to fail (or, in a [`Pool`](crate::Pool), to be re-sent).
    pub fn connection_ttl(mut self, ttl: Duration) -> Self {
        self.connection_ttl = ttl;
        self
    }

    /// QUIC keep-alive interval (`None`: off).
    pub fn keep_alive_interval(mut self, every: Option<Duration>) -> Self {
        self.keep_alive_interval = every;
        self
    }

    /// Largest response frame payload accepted.
    pub fn max_frame_size(mut self, bytes: u32) -> Self {
        self.max_frame_size = bytes;
        self
    }

    /// How long a health PING may go unanswered.
    pub fn health_timeout(mut self, t: Duration) -> Self {
        self.health_timeout = t;
        self
    }

    /// Whether reconnects send their AUTH and first requests in 0-RTT data. The reference
    /// server only accepts early data with a single-use session ticket, so it is not
    /// replayable against it (see `docs/claudelink.md` section 7).
    pub fn zero_rtt(mut self, on: bool) -> Self {
        self.zero_rtt = on;
        self
    }
}

/// Why a client or connection could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// TLS setup failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The local UDP socket could not be bound.
    #[error("cannot bind the client UDP socket: {0}")]
    Bind(std::io::Error),
    /// quinn refused to start the connection (bad server name, config).
    #[error("cannot start a connection to {addr}: {source}")]
    Connect {
        /// Server address.
        addr: SocketAddr,
        /// quinn's error.
        source: quinn::ConnectError,
    },
    /// The handshake failed.
    #[error("connection to {addr} failed: {source}")]
    Connection {
        /// Server address.
        addr: SocketAddr,
        /// quinn's error.
        source: quinn::ConnectionError,
    },
    /// A setting was rejected.
    #[error("invalid client setting: {0}")]
    Config(String),
    /// A 0-RTT connection's handshake did not complete (the server is gone or refused it).
    #[error("the handshake with {addr} did not complete")]
    HandshakeIncomplete {
        /// Server address.
        addr: SocketAddr,
    },
    /// A pool's replica name did not resolve, or resolved to no address.
    #[error("resolving {name}: {detail}")]
    Resolve {
        /// The `host:port` name.
        name: String,
        /// The resolver's error, or "no address".
        detail: String,
    },
}

/// Why a request could not be sent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The connection received GOAWAY; send the request on another connection.
    #[error("the connection is draining (GOAWAY received)")]
    Draining,
    /// The server closed the connection with `UNAUTHENTICATED`: the API key is missing or
    /// wrong ([`ClientConfig::api_key`]). Do not retry with the same key.
    #[error("the server refused the credential (UNAUTHENTICATED): set a valid API key")]
    Unauthenticated,
    /// The connection is closed.
    #[error("connection lost: {0}")]
    ConnectionLost(quinn::ConnectionError),
    /// The request does not encode (non-finite float, too many stop sequences, too large).
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// Writing the request failed.
    #[error("cannot write the request: {0}")]
    Write(#[from] quinn::WriteError),
    /// A health PING was not answered in time.
    #[error("no PONG within {0:?}")]
    PingTimeout(Duration),
    /// The pool has no usable connection and could not open one.
    #[error("no connection available: {0}")]
    NoConnection(#[from] ClientError),
}

/// Why a response stream ended early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The server reset the stream (`Refused`: not processed, retry elsewhere).
    #[error("stream reset by the server with code {raw:#x} ({code:?})")]
    Reset {
        /// The claudelink code, if known.
        code: Option<AppErrorCode>,
        /// The raw QUIC application code.
        raw: u64,
    },
    /// The connection closed.
    #[error("connection lost: {0}")]
    ConnectionLost(quinn::ConnectionError),
    /// The server closed the connection with `UNAUTHENTICATED`: the API key is missing or
    /// wrong ([`ClientConfig::api_key`]).
    #[error("the server refused the credential (UNAUTHENTICATED): set a valid API key")]
    Unauthenticated,
    /// The server rejected 0-RTT data; the request was not processed, retry it.
    #[error("0-RTT rejected; the request was not processed")]
    ZeroRttRejected,
    /// The server broke the protocol.
    #[error(transparent)]
    Protocol(#[from] ClientStreamError),
    /// The request failed before its first token and could not be sent to another replica
    /// ([`crate::Pool`]).
    #[error("the request failed before its first token and could not be re-sent: {0}")]
    NotResent(Box<RequestError>),
}

impl From<quinn::ConnectionError> for RequestError {
    fn from(e: quinn::ConnectionError) -> Self {
        if is_unauthenticated(&e) {
            Self::Unauthenticated
        } else {
            Self::ConnectionLost(e)
        }
    }
}

impl From<quinn::ConnectionError> for StreamError {
    fn from(e: quinn::ConnectionError) -> Self {
        if is_unauthenticated(&e) {
            Self::Unauthenticated
        } else {
            Self::ConnectionLost(e)
        }
    }
}

/// Whether the server closed the connection for a missing or wrong credential.
fn is_unauthenticated(e: &quinn::ConnectionError) -> bool {
    matches!(e, quinn::ConnectionError::ApplicationClosed(c)
        if c.error_code.into_inner() == AppErrorCode::Unauthenticated.to_u64())
}

impl StreamError {
    /// Whether the request was certainly not processed and may be sent again.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::ZeroRttRejected
                | Self::Reset {
                    code: Some(AppErrorCode::Refused),
                    ..
                }
        )
    }
}

/// A claudelink client endpoint: one UDP socket and a TLS session cache shared by its
/// connections (so reconnects resume and may use 0-RTT).
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: quinn::Endpoint,
    cfg: Arc<ClientConfig>,
}

impl Client {
    /// Binds an ephemeral UDP port. Must be called inside a tokio runtime.
    pub fn new(config: ClientConfig) -> Result<Self, ClientError> {
        let tls = config.trust.rustls_client_config(vec![ALPN.to_vec()])?;
        let crypto = QuicClientConfig::try_from(Arc::new(tls))
            .map_err(|e| ClientError::Config(e.to_string()))?;
        let mut qc = quinn::ClientConfig::new(Arc::new(crypto));
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(VarInt::from_u32(config.stream_buffer_size.max(1024)))
            .max_concurrent_uni_streams(VarInt::from_u32(4))
            .max_concurrent_bidi_streams(VarInt::from_u32(0))
            .keep_alive_interval(config.keep_alive_interval)
            .max_idle_timeout(Some(
                quinn::IdleTimeout::try_from(config.connection_ttl)
                    .map_err(|e| ClientError::Config(e.to_string()))?,
            ));
        qc.transport_config(Arc::new(t));
        // A dual-stack socket reaches IPv6 replicas (AAAA records) and IPv4 ones alike; an
        // IPv4 socket where the host has no IPv6.
        let mut endpoint =
            quinn::Endpoint::client(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)))
                .or_else(|_| quinn::Endpoint::client(SocketAddr::from(([0, 0, 0, 0], 0))))
                .map_err(ClientError::Bind)?;
        endpoint.set_default_client_config(qc);
        Ok(Self {
            endpoint,
            cfg: Arc::new(config),
        })
    }

    /// The quinn endpoint.
    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    /// Connects. When a session ticket from an earlier connection to this server is cached
    /// (and 0-RTT is on), the connection is usable at once and requests go out as 0-RTT data.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Connection, ClientError> {
        let connecting = self
            .endpoint
            .connect(addr, &self.cfg.server_name)
            .map_err(|source| ClientError::Connect { addr, source })?;
        let (conn, zero_rtt) = if self.cfg.zero_rtt {
            match connecting.into_0rtt() {
                Ok((conn, accepted)) => (conn, Some(accepted)),
                Err(connecting) => (
                    connecting
                        .await
                        .map_err(|source| ClientError::Connection { addr, source })?,
                    None,
                ),
            }
        } else {
            (
                connecting
                    .await
                    .map_err(|source| ClientError::Connection { addr, source })?,
                None,
            )
        };
        let (zr_tx, zr_rx) = watch::channel(None);
        let attempted = zero_rtt.is_some();
        let inner = Arc::new(ConnInner {
            conn,
            cfg: self.cfg.clone(),
            state: Mutex::new(ConnectionState::new(
                Side::Client,
                self.cfg.max_frame_size,
                self.cfg.health_timeout,
            )),
            control: tokio::sync::Mutex::new(None),
            pongs: Mutex::new(HashMap::new()),
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            zero_rtt_attempted: attempted,
            zero_rtt: zr_rx,
        });
        // AUTH goes first on the control stream, opened right away (in 0-RTT data when
        // resuming), so the server can serve the requests that follow.
        inner.send_auth().await;
        if let Some(accepted) = zero_rtt {
            let inner = inner.clone();
            tokio::spawn(async move {
                let ok = accepted.await;
                if !ok {
                    // The server dropped all early data. If our control stream (and AUTH) was
                    // part of it, open a new one and send AUTH again; if the handshake was
                    // already over when it was opened, it went in 1-RTT data and stands (a
                    // second control stream would be a protocol violation).
                    let mut ctl = inner.control.lock().await;
                    let lost = match ctl.as_mut() {
                        Some(s) => matches!(
                            futures::FutureExt::now_or_never(s.write(&[])),
                            Some(Err(quinn::WriteError::ZeroRttRejected))
                        ),
                        None => true,
                    };
                    if lost {
                        *ctl = None;
                        drop(ctl);
                        inner.send_auth().await;
                    }
                }
                let _ = zr_tx.send(Some(ok));
            });
        }
        tokio::spawn(client_control(inner.clone()));
        Ok(Connection { inner })
    }
}

struct ConnInner {
    conn: quinn::Connection,
    cfg: Arc<ClientConfig>,
    state: Mutex<ConnectionState>,
    control: tokio::sync::Mutex<Option<quinn::SendStream>>,
    pongs: Mutex<HashMap<u64, oneshot::Sender<(Duration, Health)>>>,
    draining: AtomicBool,
    in_flight: AtomicUsize,
    zero_rtt_attempted: bool,
    zero_rtt: watch::Receiver<Option<bool>>,
}

impl ConnInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, ConnectionState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends AUTH when the config has a key.
    async fn send_auth(&self) {
        if let Some(key) = &self.cfg.api_key {
            self.lock().send_auth(&key.0);
            self.drive().await;
        }
    }

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
                    self.conn.close(code(c), b"control stream violation");
                }
                ConnectionAction::PongReceived {
                    nonce, rtt, health, ..
                } => {
                    let tx = self
                        .pongs
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&nonce);
                    if let Some(tx) = tx {
                        let _ = tx.send((rtt, health));
                    }
                }
                ConnectionAction::GoAwayReceived { .. } => {
                    self.draining.store(true, Ordering::Release);
                }
                _ => {}
            }
        }
    }
}

async fn client_control(inner: Arc<ConnInner>) {
    let Ok(mut recv) = inner.conn.accept_uni().await else {
        return;
    };
    loop {
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => inner.lock().recv_control(&chunk.bytes, Instant::now()),
            Ok(None) => inner.lock().control_finished(),
            Err(_) => return,
        }
        inner.drive().await;
        if inner.lock().is_closed() {
            return;
        }
    }
}

/// One claudelink connection. Cheap to clone.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use claudelink_proto::*;
/// use futures::StreamExt;
/// let fp: CertFingerprint = "AB:CD:...".parse()?; // printed by the server at start
/// let client = Client::new(ClientConfig::new(Trust::Pinned(fp)))?;
/// let conn = client.connect("127.0.0.1:4433".parse()?).await?;
/// let req = InferenceRequest::new("smollm2", Prompt::Text("Hello".into()), 16);
/// let mut events = conn.request(&req).await?;
/// while let Some(ev) = events.next().await {
///     println!("{:?}", ev?);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Connection {
    inner: Arc<ConnInner>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("remote", &self.remote_address())
            .field("in_flight", &self.in_flight())
            .field("draining", &self.is_draining())
            .finish()
    }
}

impl Connection {
    /// Sends a request on a new stream and returns its events.
    pub async fn request(&self, req: &InferenceRequest) -> Result<ResponseStream, RequestError> {
        if self.is_draining() {
            return Err(RequestError::Draining);
        }
        let bytes = ClientStream::encode_request(req, self.inner.cfg.stream_buffer_size)?;
        let (send, recv) = self.inner.conn.open_bi().await?;
        self.inner.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut stream = ResponseStream {
            recv,
            send: None,
            machine: ClientStream::new(self.inner.cfg.max_frame_size),
            buf: vec![0; 16 << 10].into_boxed_slice(),
            done: false,
            conn: self.inner.clone(),
        };
        // Dropping `stream` on a failed write resets the stream and releases the slot.
        let send = stream.send.insert(send);
        send.write_all(&bytes).await.map_err(|e| match e {
            quinn::WriteError::ConnectionLost(e) => RequestError::from(e),
            e => RequestError::Write(e),
        })?;
        let _ = send.finish();
        Ok(stream)
    }

    /// Sends a health PING and waits for the PONG (round-trip time and server health).
    pub async fn ping(&self) -> Result<(Duration, Health), RequestError> {
        let (tx, rx) = oneshot::channel();
        let nonce = self.inner.lock().send_ping(Instant::now());
        self.inner
            .pongs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(nonce, tx);
        self.inner.drive().await;
        let timeout = self.inner.cfg.health_timeout;
        let res = tokio::time::timeout(timeout, rx).await;
        self.inner
            .pongs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&nonce);
        match res {
            Ok(Ok(x)) => Ok(x),
            _ => {
                if let Some(e) = self.inner.conn.close_reason() {
                    return Err(e.into());
                }
                Err(RequestError::PingTimeout(timeout))
            }
        }
    }

    /// Whether the server sent GOAWAY.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Whether the connection is closed.
    pub fn is_closed(&self) -> bool {
        self.inner.conn.close_reason().is_some()
    }

    /// Request streams open on this connection.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Acquire)
    }

    /// Whether this connection was started with 0-RTT data (a resumed TLS session).
    pub fn zero_rtt_attempted(&self) -> bool {
        self.inner.zero_rtt_attempted
    }

    /// Waits for the handshake and says whether the server accepted the 0-RTT data
    /// (`None` when 0-RTT was not attempted).
    pub async fn zero_rtt_accepted(&self) -> Option<bool> {
        if !self.inner.zero_rtt_attempted {
            return None;
        }
        let mut rx = self.inner.zero_rtt.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(v) => *v,
            Err(_) => Some(false),
        }
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.inner.conn.close(VarInt::from_u32(0), b"client closed");
    }

    /// The server's address, as it was connected to: an IPv4 server is named by its IPv4
    /// address (quinn's own [`remote_address`](quinn::Connection::remote_address) gives it
    /// IPv4-mapped, since the client's socket is dual-stack).
    pub fn remote_address(&self) -> SocketAddr {
        let a = self.inner.conn.remote_address();
        SocketAddr::new(a.ip().to_canonical(), a.port())
    }

    /// The underlying quinn connection.
    pub fn quinn(&self) -> &quinn::Connection {
        &self.inner.conn
    }
}

/// The events of one request. Dropping it before the end resets the stream (`CANCELLED`) and
/// the server cancels the work.
pub struct ResponseStream {
    recv: quinn::RecvStream,
    send: Option<quinn::SendStream>,
    machine: ClientStream,
    buf: Box<[u8]>,
    done: bool,
    conn: Arc<ConnInner>,
}

impl std::fmt::Debug for ResponseStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseStream")
            .field("stream", &self.recv.id())
            .field("request_id", &self.machine.request_id())
            .field("done", &self.done)
            .finish()
    }
}

impl ResponseStream {
    /// The server's request id (from STARTED).
    pub fn request_id(&self) -> Option<u64> {
        self.machine.request_id()
    }

    /// `retry_after_ms` of an ERROR frame received on this stream (0 when none).
    pub fn retry_after_ms(&self) -> u32 {
        self.machine.retry_after_ms()
    }

    /// Reads all events.
    pub async fn collect_all(mut self) -> Result<Vec<InferenceEvent>, StreamError> {
        use futures::StreamExt;
        let mut v = Vec::new();
        while let Some(e) = self.next().await {
            v.push(e?);
        }
        Ok(v)
    }
}

fn map_read_error(e: quinn::ReadError) -> StreamError {
    match e {
        quinn::ReadError::Reset(c) if c.into_inner() == AppErrorCode::Unauthenticated.to_u64() => {
            StreamError::Unauthenticated
        }
        quinn::ReadError::Reset(c) => {
            let raw = c.into_inner();
            StreamError::Reset {
                code: AppErrorCode::from_u64(raw),
                raw,
            }
        }
        quinn::ReadError::ConnectionLost(e) => e.into(),
        quinn::ReadError::ZeroRttRejected => StreamError::ZeroRttRejected,
        quinn::ReadError::ClosedStream | quinn::ReadError::IllegalOrderedRead => {
            StreamError::Reset {
                code: None,
                raw: u64::MAX,
            }
        }
    }
}

impl Stream for ResponseStream {
    type Item = Result<InferenceEvent, StreamError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(ev) = this.machine.poll_event() {
                return Poll::Ready(Some(Ok(ev)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.recv.poll_read(cx, &mut this.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => {
                    this.done = true;
                    if let Err(e) = this.machine.recv(&[], true) {
                        return Poll::Ready(Some(Err(e.into())));
                    }
                }
                Poll::Ready(Ok(n)) => {
                    if let Err(e) = this.machine.recv(&this.buf[..n], false) {
                        this.done = true;
                        let _ = this.recv.stop(code(AppErrorCode::ProtocolError));
                        return Poll::Ready(Some(Err(e.into())));
                    }
                }
                Poll::Ready(Err(e)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(map_read_error(e))));
                }
            }
        }
    }
}

impl Drop for ResponseStream {
    fn drop(&mut self) {
        if !self.machine.is_terminal() {
            let _ = self.recv.stop(code(AppErrorCode::Cancelled));
            if let Some(s) = self.send.as_mut() {
                let _ = s.reset(code(AppErrorCode::Cancelled));
            }
        }
        self.conn.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}
