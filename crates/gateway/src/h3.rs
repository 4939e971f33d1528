//! HTTP/3 with h3 + h3-quinn, on a QUIC connection that negotiated ALPN `h3`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use futures::StreamExt;
use h3::server::{RequestResolver, RequestStream};
use http::Response;
use quinn::VarInt;

use super::conn_watch::{CloseReason, ConnWatch, Verdict};
use super::core::{Admission, BodyError, Gateway, Reply, ReplyBody};
use super::metrics::Protocol;
use claudelink_proto::ConnectionHandler;
use claudelink_proto::ConnectionSlot;

/// The ALPN protocol id of HTTP/3.
pub const H3_ALPN: &[u8] = b"h3";

type H3Conn = h3_quinn::Connection;
type H3Stream = h3_quinn::BidiStream<Bytes>;

/// Serves HTTP/3 on the claudelink server's UDP port: pass it to
/// [`ServerConfig::alpn_handler`](claudelink_proto::ServerConfig::alpn_handler) with [`H3_ALPN`].
///
/// ```no_run
/// # fn f(gateway: zerolayer_gateway::Gateway, identity: claudelink_proto::Identity) {
/// use std::sync::Arc;
/// use claudelink_proto::ServerConfig;
/// use zerolayer_gateway::H3_ALPN;
/// let config = ServerConfig::new(identity).alpn_handler(H3_ALPN, Arc::new(gateway.h3_handler()));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct H3Handler {
    gateway: Gateway,
}

impl ConnectionHandler for H3Handler {
    fn handle(&self, conn: quinn::Connection) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let gw = self.gateway.clone();
        Box::pin(async move { gw.serve_h3_connection(conn).await })
    }

    fn handle_with_slot(
        &self,
        conn: quinn::Connection,
        slot: ConnectionSlot,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let gw = self.gateway.clone();
        Box::pin(async move { gw.serve_h3_watched(conn, Some(slot)).await })
    }
}

/// How long an HTTP/3 connection closed for idleness or want of a key has to finish what it is
/// sending before the QUIC connection is closed.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// `H3_NO_ERROR`, the application close code of a connection closed on purpose.
const H3_NO_ERROR: u32 = 0x100;

impl Gateway {
    /// The [`ConnectionHandler`] that serves HTTP/3 connections with this gateway.
    pub fn h3_handler(&self) -> H3Handler {
        H3Handler {
            gateway: self.clone(),
        }
    }

    /// Serves HTTP/3 requests on one QUIC connection (whose handshake negotiated ALPN `h3`)
    /// until the peer closes it or the gateway drains (then GOAWAY is sent and running requests
    /// finish). A connection with no request open for
    /// [`idle_timeout`](crate::GatewayConfig::idle_timeout), or (with API keys) without a
    /// valid key [`auth_timeout`](crate::GatewayConfig::auth_timeout) after it opened, gets
    /// GOAWAY and is closed; QUIC PINGs do not keep it open.
    pub async fn serve_h3_connection(&self, conn: quinn::Connection) {
        self.serve_h3_watched(conn, None).await;
    }

    /// [`Gateway::serve_h3_connection`] for a connection holding `slot` in its endpoint's
    /// limits (it leaves the unauthenticated budget with the first valid key).
    async fn serve_h3_watched(&self, conn: quinn::Connection, slot: Option<ConnectionSlot>) {
        let watch = Arc::new(ConnWatch::new(Instant::now(), self.watch_policy(), slot));
        let quic = conn.clone();
        let remote = conn.remote_address();
        self.inner.metrics.connection_opened(Protocol::Http3);
        let mut h3c = match h3::server::builder()
            .max_field_section_size(64 * 1024)
            .build::<H3Conn, Bytes>(h3_quinn::Connection::new(conn))
            .await
        {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(%remote, error = %e, "h3 handshake failed");
                return;
            }
        };
        let mut drain = self.inner.drain_tx.subscribe();
        let mut draining = *drain.borrow();
        if draining {
            let _ = h3c.shutdown(0).await;
        }
        let mut served = 0u64;
        let mut wake = Instant::now();
        loop {
            let next = tokio::select! {
                r = h3c.accept() => r,
                _ = drain.changed(), if !draining => {
                    draining = true;
                    let _ = h3c.shutdown(0).await;
                    continue;
                }
                () = watch.evicted() => {
                    // A newer keyless connection took this one's place in the keyless budget.
                    tracing::debug!(%remote, "closing the h3 connection: evicted while keyless");
                    let _ = h3c.shutdown(0).await;
                    quic.close(VarInt::from_u32(H3_NO_ERROR), CloseReason::Unauthenticated.as_str().as_bytes());
                    break;
                }
                () = tokio::time::sleep_until(wake.into()) => {
                    match watch.verdict(Instant::now()) {
                        Verdict::KeepUntil(t) => wake = t,
                        Verdict::Close(why) => {
                            tracing::debug!(%remote, reason = why.as_str(), "closing the h3 connection");
                            let _ = h3c.shutdown(0).await;
                            let grace = Instant::now() + CLOSE_GRACE;
                            while watch.open_requests() > 0 && Instant::now() < grace {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            quic.close(VarInt::from_u32(H3_NO_ERROR), why.as_str().as_bytes());
                            break;
                        }
                    }
                    continue;
                }
            };
            match next {
                Ok(Some(resolver)) => {
                    self.inner.metrics.connection_request(served);
                    served += 1;
                    let gw = self.clone();
                    let open = watch.request_started();
                    let watch = watch.clone();
                    tokio::spawn(async move {
                        gw.serve_h3_request(resolver, &watch).await;
                        drop(open);
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    if !e.is_h3_no_error() {
                        tracing::debug!(%remote, error = %e, "h3 connection ended");
                    }
                    break;
                }
            }
        }
    }

    /// Accepts QUIC connections on an endpoint dedicated to HTTP/3 (its server config offering
    /// ALPN `h3`) and serves each with [`Gateway::serve_h3_connection`], until `shutdown`
    /// resolves. Useful when the claudelink server does not share the port.
    pub async fn serve_h3(&self, endpoint: quinn::Endpoint, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let incoming = tokio::select! {
                i = endpoint.accept() => match i { Some(i) => i, None => break },
                () = &mut shutdown => break,
            };
            let gw = self.clone();
            tokio::spawn(async move {
                match incoming.await {
                    Ok(conn) => gw.serve_h3_connection(conn).await,
                    Err(e) => tracing::debug!(error = %e, "QUIC handshake failed"),
                }
            });
        }
        self.start_draining();
    }

    async fn serve_h3_request(&self, resolver: RequestResolver<H3Conn, Bytes>, watch: &ConnWatch) {
        let received = Instant::now();
        let (req, mut stream) = match resolver.resolve_request().await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "h3 request headers failed");
                return;
            }
        };
        let (parts, ()) = req.into_parts();
        if !watch.is_authenticated() && self.presents_key(&parts.headers) {
            watch.authenticated();
        }
        let path = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
        let admitted = match self.admit_at(
            &parts.method,
            parts.uri.authority().map(http::uri::Authority::as_str),
            &path,
            &parts.headers,
            Protocol::Http3,
            received,
        ) {
            Admission::ReadBody(a) => a,
            Admission::Reply(reply) => {
                // The body (if any) is never read: tell the peer to stop sending it.
                stream.stop_sending(h3::error::Code::H3_NO_ERROR);
                send_reply(&mut stream, reply).await;
                return;
            }
        };
        let limit = self.inner.config.max_body_bytes;
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let body = if declared.is_some_and(|n| n > limit as u64) {
            Err(BodyError::TooLarge)
        } else {
            let read = async {
                let mut buf = BytesMut::new();
                while let Some(mut chunk) = stream
                    .recv_data()
                    .await
                    .map_err(|e| BodyError::Transport(e.to_string()))?
                {
                    if buf.len() + chunk.remaining() > limit {
                        return Err(BodyError::TooLarge);
                    }
                    while chunk.has_remaining() {
                        let c = chunk.chunk();
                        buf.extend_from_slice(c);
                        let n = c.len();
                        chunk.advance(n);
                    }
                }
                Ok(buf.freeze())
            };
            match tokio::time::timeout(self.inner.config.body_timeout, read).await {
                Ok(r) => r,
                Err(_) => Err(BodyError::Timeout),
            }
        };
        let reply = self.respond(admitted, body).await;
        send_reply(&mut stream, reply).await;
    }
}

/// Sends a reply on an HTTP/3 request stream and finishes it.
async fn send_reply(stream: &mut RequestStream<H3Stream, Bytes>, reply: Reply) {
    let mut resp = Response::new(());
    *resp.status_mut() = reply.status;
    *resp.headers_mut() = reply.headers;
    if let Err(e) = stream.send_response(resp).await {
        tracing::debug!(error = %e, "h3 send_response failed");
        return;
    }
    match reply.body {
        ReplyBody::Full(b) => {
            if !b.is_empty() && stream.send_data(b).await.is_err() {
                return;
            }
        }
        ReplyBody::Stream(mut s) => {
            while let Some(chunk) = s.next().await {
                if stream.send_data(chunk).await.is_err() {
                    // The client went away: dropping `s` cancels the generation.
                    return;
                }
            }
        }
    }
    let _ = stream.finish().await;
}
