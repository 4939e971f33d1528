//! HTTP/1.1 and HTTP/2 on TCP with hyper: cleartext (HTTP/2 by prior knowledge) or HTTPS
//! (rustls, ALPN `h2` / `http/1.1`).
//!
//! Defences of the listener: connection limits per listener and per client address (refused
//! connections get a minimal `503` and are closed; on a gateway with keys, connections that
//! have not presented one count against a smaller budget), a header-read timeout (HTTP/1.1)
//! and a first-bytes timeout (HTTP/2 preface), the idle and authentication timeouts of
//! `conn_watch.rs` (a connection with no request open, or without a valid key, is closed
//! whatever PINGs it answers), HTTP/2 keep-alive PINGs, TCP keep-alive and
//! `TCP_USER_TIMEOUT` so a vanished peer's connection (and generation) ends within seconds, and
//! a backed-off, rate-limited log when `accept` fails (EMFILE). Requests are admitted on their
//! headers; the body is read only for admitted ones.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http::header::{ALT_SVC, CONNECTION, CONTENT_LENGTH, HeaderValue, TRANSFER_ENCODING};
use http::{Request, Response, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming as HyperBody};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;

use super::conn_watch::{CloseReason, ConnWatch, OpenRequest, Verdict};
use super::core::{Admission, BodyError, Gateway, ReplyBody};
use super::metrics::Protocol;
use claudelink_proto::ConnectionLimits;

/// The response body type of the TCP transport.
type Body = UnsyncBoxBody<Bytes, Infallible>;

/// What a refused connection is told before it is closed.
const REFUSAL: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// The longest pause between `accept` attempts after failures (EMFILE and the like).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

impl Gateway {
    /// Serves HTTP/1.1 and HTTP/2 (h2c prior knowledge) on `listener` until `shutdown` resolves,
    /// then stops accepting, closes idle connections and waits for in-flight responses (streams
    /// included) to finish. Bound the wait with a timeout around this future if needed, and
    /// end the streams with [`Gateway::abort_streams`].
    ///
    /// Connections beyond `max_connections` (in all) or `max_connections_per_ip` (from one
    /// address) get a minimal `503` and are closed.
    pub async fn serve_tcp(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        self.serve_listener(listener, None, shutdown).await
    }

    /// Serves HTTPS on `listener` as [`Gateway::serve_tcp`] serves cleartext: each connection
    /// first completes a TLS handshake with `tls` (see [`claudelink_proto::Identity::tcp_server_config`]:
    /// ALPN `h2` selects HTTP/2, `http/1.1` or none HTTP/1.1), within the header-read timeout;
    /// a client that fails or stalls the handshake is closed without a response.
    ///
    /// ```no_run
    /// # async fn run(gateway: zerolayer_gateway::Gateway) -> Result<(), Box<dyn std::error::Error>> {
    /// let identity = claudelink_proto::Identity::from_pem_files("cert.pem", "key.pem")?;
    /// let listener = tokio::net::TcpListener::bind("0.0.0.0:443").await?;
    /// gateway
    ///     .serve_tcp_tls(listener, identity.tcp_server_config()?, std::future::pending())
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn serve_tcp_tls(
        &self,
        listener: TcpListener,
        tls: Arc<rustls::ServerConfig>,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        self.serve_listener(listener, Some(TlsAcceptor::from(tls)), shutdown)
            .await
    }

    async fn serve_listener(
        &self,
        listener: TcpListener,
        tls: Option<TlsAcceptor>,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        let cfg = &self.inner.config;
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(cfg.header_read_timeout);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(cfg.http2_keep_alive)
            .keep_alive_timeout(cfg.http2_keep_alive);
        let builder = Arc::new(builder);
        let limits = ConnectionLimits::new(cfg.max_connections, cfg.max_connections_per_ip);
        let requires_key = self.requires_keys();
        let policy = self.watch_policy();
        // Shutdown: every connection task watches `stop` (then closes gracefully, letting its
        // responses finish) and holds a `live` sender; `live_rx` ends when the last one ends.
        let (stop_tx, stop_rx) = watch::channel(false);
        let (live_tx, mut live_rx) = mpsc::channel::<()>(1);
        let mut accept_errors = AcceptBackoff::default();
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        // Per-connection failures (EMFILE, reset before accept) must not stop
                        // the server; back off so a descriptor shortage does not spin.
                        let pause = accept_errors.failed(&e, limits.open_connections());
                        tokio::select! {
                            () = tokio::time::sleep(pause) => continue,
                            () = &mut shutdown => break,
                        }
                    }
                },
                () = &mut shutdown => break,
            };
            accept_errors.succeeded();
            let slot = match limits.admit(peer.ip(), requires_key) {
                Ok(s) => s,
                Err(why) => {
                    tracing::debug!(%peer, %why, "connection refused");
                    tokio::spawn(refuse(stream));
                    continue;
                }
            };
            self.tune_socket(&stream);
            let watch = Arc::new(ConnWatch::new(Instant::now(), policy, Some(slot)));
            let svc = self.connection_service(watch.clone());
            let first_bytes = cfg.header_read_timeout;
            let builder = Arc::clone(&builder);
            let stop = stop_rx.clone();
            let live = live_tx.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let _live = live;
                // hyper's header timeout covers HTTP/1.1 once the protocol is known; this
                // covers a client that sends nothing at all (the protocol is not known yet).
                let mut probe = [0u8; 1];
                match tokio::time::timeout(first_bytes, stream.peek(&mut probe)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    Ok(_) => return,
                    Err(_) => {
                        tracing::debug!(%peer, "nothing received within the header timeout: closed");
                        return;
                    }
                }
                let io: Box<dyn Io> = match tls {
                    None => Box::new(stream),
                    Some(acceptor) => {
                        match tokio::time::timeout(first_bytes, acceptor.accept(stream)).await {
                            Ok(Ok(s)) => Box::new(s),
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out: closed");
                                return;
                            }
                        }
                    }
                };
                let conn = builder.serve_connection(TokioIo::new(io), svc);
                drive_connection(conn, &watch, stop, peer).await;
            });
        }
        drop(listener);
        let _ = stop_tx.send(true);
        drop(live_tx);
        // `None` once every connection task has ended (no message is ever sent).
        let _ = live_rx.recv().await;
        Ok(())
    }

    /// The hyper service of one connection: each request is counted open in `watch` until its
    /// response body ends, and a valid key takes the connection out of the unauthenticated
    /// budget.
    fn connection_service(
        &self,
        watch: Arc<ConnWatch>,
    ) -> impl hyper::service::Service<
        Request<HyperBody>,
        Response = Response<Body>,
        Error = Infallible,
        Future = impl Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
    > + Clone
    + Send
    + 'static {
        let gw = self.clone();
        let seen = Arc::new(AtomicU64::new(0));
        hyper::service::service_fn(move |req: Request<HyperBody>| {
            let gw = gw.clone();
            let previous = seen.fetch_add(1, Ordering::Relaxed);
            let open = watch.request_started();
            if !watch.is_authenticated() && gw.presents_key(req.headers()) {
                watch.authenticated();
            }
            async move {
                gw.inner.metrics.connection_request(previous);
                if previous == 0 {
                    let p = if req.version() == Version::HTTP_2 {
                        Protocol::Http2
                    } else {
                        Protocol::Http1
                    };
                    gw.inner.metrics.connection_opened(p);
                }
                let resp = gw.serve_hyper(req).await;
                Ok::<_, Infallible>(
                    resp.map(|body| CountedBody { body, _open: open }.boxed_unsync()),
                )
            }
        })
    }

    /// TCP keep-alive and `TCP_USER_TIMEOUT`: a peer that vanished (no FIN, no RST) is noticed
    /// within seconds, which ends its connection and so cancels its generation.
    fn tune_socket(&self, stream: &TcpStream) {
        let cfg = &self.inner.config;
        let _ = stream.set_nodelay(true);
        let sock = socket2::SockRef::from(stream);
        let idle = cfg.tcp_keepalive.max(Duration::from_secs(1));
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval(idle.div_f64(2.0).max(Duration::from_secs(1)))
            .with_retries(3);
        if let Err(e) = sock.set_tcp_keepalive(&keepalive) {
            tracing::debug!(error = %e, "setting TCP keep-alive");
        }
        #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
        if let Err(e) = sock.set_tcp_user_timeout(Some(cfg.tcp_user_timeout)) {
            tracing::debug!(error = %e, "setting TCP_USER_TIMEOUT");
        }
    }

    async fn serve_hyper(&self, req: Request<HyperBody>) -> Response<Body> {
        let received = Instant::now();
        let protocol = if req.version() == Version::HTTP_2 {
            Protocol::Http2
        } else {
            Protocol::Http1
        };
        let (parts, body) = req.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
        // HTTP/2's `:authority` (or an HTTP/1.1 absolute-form target) names the host; an
        // HTTP/1.1 origin-form request's `Host` header does.
        let authority = parts.uri.authority().map(http::uri::Authority::as_str);
        let admitted = match self.admit_at(
            &parts.method,
            authority,
            &path,
            &parts.headers,
            protocol,
            received,
        ) {
            Admission::ReadBody(a) => a,
            Admission::Reply(reply) => {
                // The body (if any) is never read: an HTTP/1.1 connection cannot be reused.
                let unread = parts.headers.contains_key(TRANSFER_ENCODING)
                    || parts
                        .headers
                        .get(CONTENT_LENGTH)
                        .is_some_and(|v| v.as_bytes() != b"0");
                let mut resp = self.hyper_response(reply.status, reply.headers, reply.body);
                if (unread || self.is_draining()) && protocol == Protocol::Http1 {
                    resp.headers_mut()
                        .insert(CONNECTION, HeaderValue::from_static("close"));
                }
                return resp;
            }
        };
        let limit = self.inner.config.max_body_bytes;
        let declared = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let body = if declared.is_some_and(|n| n > limit as u64) {
            Err(BodyError::TooLarge)
        } else {
            match tokio::time::timeout(
                self.inner.config.body_timeout,
                Limited::new(body, limit).collect(),
            )
            .await
            {
                Err(_) => Err(BodyError::Timeout),
                Ok(Ok(c)) => Ok(c.to_bytes()),
                Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                    Err(BodyError::TooLarge)
                }
                Ok(Err(e)) => Err(BodyError::Transport(e.to_string())),
            }
        };
        let reply = self.respond(admitted, body).await;
        let mut resp = self.hyper_response(reply.status, reply.headers, reply.body);
        // A draining server keeps its listener for `/health` and `/metrics` (see
        // `Gateway::start_draining`), but a keep-alive HTTP/1.1 client should reconnect, to
        // another replica, for its next request (the early replies above do the same).
        if protocol == Protocol::Http1 && self.is_draining() {
            resp.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }

    fn hyper_response(
        &self,
        status: http::StatusCode,
        headers: http::HeaderMap,
        body: ReplyBody,
    ) -> Response<Body> {
        let body: Body = match body {
            ReplyBody::Full(b) => Full::new(b).boxed_unsync(),
            ReplyBody::Stream(s) => {
                StreamBody::new(s.map(|b| Ok::<_, Infallible>(Frame::data(b)))).boxed_unsync()
            }
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        if let Some(v) = self.alt_svc() {
            resp.headers_mut().insert(ALT_SVC, v);
        }
        resp
    }
}

/// A connection's transport: TCP, or TLS over TCP.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// How long a connection closed for idleness or want of a key has to finish what it is
/// sending (a 401, a `/health` answer) before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Serves one connection until it ends, closing it gracefully at the server's shutdown
/// (responses in flight finish) or when `watch` says it sat idle or never authenticated
/// (then it is dropped after [`CLOSE_GRACE`] if it has not closed by itself).
async fn drive_connection<C>(
    conn: C,
    watch: &ConnWatch,
    mut stop: watch::Receiver<bool>,
    peer: std::net::SocketAddr,
) where
    C: Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + GracefulConnection,
{
    let mut conn = std::pin::pin!(conn);
    let mut shut_down = false;
    let mut stopping = false;
    let mut wake = Instant::now();
    let mut forced_at: Option<Instant> = None;
    loop {
        // Whether to close, and (unless the server is stopping) why, with a grace for it.
        let close = tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                None
            }
            // A newer keyless connection took this one's place in the keyless budget.
            () = watch.evicted(), if forced_at.is_none() => Some(CloseReason::Unauthenticated),
            () = tokio::time::sleep_until(forced_at.unwrap_or(wake).into()) => {
                if forced_at.is_some() {
                    tracing::debug!(%peer, "connection did not close within the grace: dropped");
                    return;
                }
                match watch.verdict(Instant::now()) {
                    Verdict::KeepUntil(t) => {
                        wake = t;
                        continue;
                    }
                    Verdict::Close(why) => Some(why),
                }
            }
        };
        if let Some(why) = close {
            tracing::debug!(%peer, reason = why.as_str(), "closing the connection");
            forced_at = Some(Instant::now() + CLOSE_GRACE);
        }
        if !shut_down {
            shut_down = true;
            conn.as_mut().shut_down();
        }
    }
}

/// A connection that can be asked to close gracefully (hyper's `graceful_shutdown`).
trait GracefulConnection {
    fn shut_down(self: std::pin::Pin<&mut Self>);
}

impl<I, S, B> GracefulConnection for auto::Connection<'_, I, S, TokioExecutor>
where
    S: hyper::service::Service<Request<HyperBody>, Response = Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    fn shut_down(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// A response body that keeps its request counted as open (see [`ConnWatch`]) until it has
/// been sent or dropped.
struct CountedBody {
    body: Body,
    _open: OpenRequest,
}

impl hyper::body::Body for CountedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        std::pin::Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Tells a refused connection why (best effort, bounded) and closes it.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(REFUSAL).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// Backs off `accept` after failures and logs them at most once a second.
#[derive(Debug, Default)]
struct AcceptBackoff {
    pause: Duration,
    suppressed: u64,
    last_log: Option<Instant>,
}

impl AcceptBackoff {
    /// Records a failure; returns how long to wait before the next `accept`.
    fn failed(&mut self, e: &std::io::Error, open: usize) -> Duration {
        self.pause = (self.pause * 2).clamp(Duration::from_millis(10), MAX_ACCEPT_BACKOFF);
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            tracing::warn!(error = %e, open_connections = open, suppressed = self.suppressed,
                pause_ms = self.pause.as_millis() as u64, "accept failed");
            self.last_log = Some(now);
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
        self.pause
    }

    fn succeeded(&mut self) {
        self.pause = Duration::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_failures_back_off_to_a_second_and_reset_on_success() {
        let mut b = AcceptBackoff::default();
        let emfile = std::io::Error::from_raw_os_error(24);
        let pauses: Vec<Duration> = (0..10).map(|_| b.failed(&emfile, 1000)).collect();
        assert_eq!(pauses[0], Duration::from_millis(10));
        assert_eq!(pauses[1], Duration::from_millis(20));
        assert!(pauses.windows(2).all(|w| w[0] <= w[1]), "{pauses:?}");
        assert_eq!(*pauses.last().unwrap(), MAX_ACCEPT_BACKOFF);
        // Only the first failure of this burst was logged; the rest were counted.
        assert_eq!(b.suppressed, 9);
        b.succeeded();
        assert_eq!(b.failed(&emfile, 0), Duration::from_millis(10));
    }
}
