//! HTTP/1.1 and HTTP/2 (cleartext, prior knowledge) on TCP with hyper.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use http::header::{ALT_SVC, CONTENT_LENGTH};
use http::{Request, Response, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming as HyperBody};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use super::core::{BodyError, Gateway, Incoming, ReplyBody};
use super::metrics::Protocol;

/// The response body type of the TCP transport.
type Body = UnsyncBoxBody<Bytes, Infallible>;

impl Gateway {
    /// Serves HTTP/1.1 and HTTP/2 (h2c prior knowledge) on `listener` until `shutdown` resolves,
    /// then stops accepting, closes idle connections and waits for in-flight responses (streams
    /// included) to finish. Bound the wait with a timeout around this future if needed.
    pub async fn serve_tcp(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        let graceful = GracefulShutdown::new();
        let builder = auto::Builder::new(TokioExecutor::new());
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        // Per-connection failures (e.g. EMFILE, reset before accept) must not stop
                        // the server.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let _ = stream.set_nodelay(true);
            let gw = self.clone();
            let seen = Arc::new(AtomicU64::new(0));
            let svc = hyper::service::service_fn(move |req: Request<HyperBody>| {
                let gw = gw.clone();
                let previous = seen.fetch_add(1, Ordering::Relaxed);
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
                    Ok::<_, Infallible>(gw.serve_hyper(req).await)
                }
            });
            let conn = builder
                .serve_connection(TokioIo::new(stream), svc)
                .into_owned();
            let conn = graceful.watch(conn);
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            });
        }
        drop(listener);
        graceful.shutdown().await;
        Ok(())
    }

    async fn serve_hyper(&self, req: Request<HyperBody>) -> Response<Body> {
        let received = Instant::now();
        let protocol = if req.version() == Version::HTTP_2 {
            Protocol::Http2
        } else {
            Protocol::Http1
        };
        let (parts, body) = req.into_parts();
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
        let path = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
        let incoming = Incoming {
            method: parts.method,
            path,
            headers: parts.headers,
            body,
            protocol,
            received,
        };
        let reply = self.handle(incoming).await;
        let body: Body = match reply.body {
            ReplyBody::Full(b) => Full::new(b).boxed_unsync(),
            ReplyBody::Stream(s) => {
                StreamBody::new(s.map(|b| Ok::<_, Infallible>(Frame::data(b)))).boxed_unsync()
            }
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = reply.status;
        *resp.headers_mut() = reply.headers;
        if let Some(v) = self.alt_svc() {
            resp.headers_mut().insert(ALT_SVC, v);
        }
        resp
    }
}
