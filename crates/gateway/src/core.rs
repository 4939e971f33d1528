//! The transport-independent gateway: routing, auth, validation, generation and its bodies.
//! The TCP (hyper) and HTTP/3 (h3) shells turn their requests into [`Incoming`] and send the
//! [`Reply`] back.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HOST, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Method, StatusCode};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::access::AccessRecord;
use super::choices;
use super::config::{GatewayConfig, LAYER_VERSION};
use super::error::{ApiError, ApiErrorKind};
use super::ids::new_id;
use super::metrics::{Endpoint, GatewayMetrics, Outcome, Protocol};
use super::origin::{check_host, check_json_body};
use super::sse::{Call, Flavor, StreamFormat};
use super::validate::{
    GenRequest, Limits, parse_chat, parse_completions, parse_messages, percent_decode,
};
use claudelink_proto::ApiKeys;
use zerolayer_api::{
    ErrorCode, EventStream, InferenceEvent, InferenceRequest, InferenceService, ServiceHealth,
    StopReason, TokenLogprob, Usage,
};

/// Bodies up to this size are parsed on the runtime's thread; larger ones on the blocking pool.
const SMALL_BODY: usize = 64 * 1024;

/// Anthropic API versions accepted in `anthropic-version`.
pub const SUPPORTED_ANTHROPIC_VERSIONS: [&str; 2] = ["2023-06-01", "2026-10-21"];

pub(crate) const X_CLAUDE_LAYER: HeaderName = HeaderName::from_static("x-claude-layer");
pub(crate) const X_CLAUDE_LAYER_DEBUG: HeaderName = HeaderName::from_static("x-claude-layer-debug");
const X_ANTHROPIC_DEBUG: HeaderName = HeaderName::from_static("x-anthropic-debug");
const REQUEST_ID: HeaderName = HeaderName::from_static("request-id");
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const ANTHROPIC_VERSION: HeaderName = HeaderName::from_static("anthropic-version");

/// Why a request body could not be read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// Larger than `max_body_bytes`.
    TooLarge,
    /// Not received within `body_timeout`.
    Timeout,
    /// The transport failed.
    Transport(String),
}

/// A request whose headers passed routing and auth: the transport reads its body (within
/// `max_body_bytes` and `body_timeout`) and hands both to [`Gateway::respond`].
#[derive(Debug)]
pub(crate) struct Admitted {
    request_id: String,
    path: String,
    endpoint: Endpoint,
    flavor: Flavor,
    caller: Caller,
    debug: bool,
    received: Instant,
    /// The access-log line, written when the request is over.
    access: Arc<AccessRecord>,
}

/// What a transport does once a request's headers are in ([`Gateway::admit`]).
#[derive(Debug)]
pub(crate) enum Admission {
    /// Answer with this and do not read the body (an error, or a body-less endpoint).
    Reply(Reply),
    /// Read the body, then call [`Gateway::respond`].
    ReadBody(Admitted),
}

/// A response body: complete, or a stream of chunks (SSE events) that cancels its generation when
/// dropped.
pub(crate) enum ReplyBody {
    Full(Bytes),
    Stream(Pin<Box<dyn Stream<Item = Bytes> + Send>>),
}

impl std::fmt::Debug for ReplyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Full(b) => write!(f, "Full({} bytes)", b.len()),
            Self::Stream(_) => f.write_str("Stream"),
        }
    }
}

/// A response as the transports send it.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: ReplyBody,
}

impl Reply {
    pub(super) fn json(status: StatusCode, v: &Value) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Self {
            status,
            headers,
            body: ReplyBody::Full(Bytes::from(v.to_string())),
        }
    }

    fn text(status: StatusCode, content_type: &'static str, body: String) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        Self {
            status,
            headers,
            body: ReplyBody::Full(Bytes::from(body)),
        }
    }
}

/// The Anthropic Messages / OpenAI Chat Completions gateway over an [`InferenceService`].
///
/// Cheap to clone (shared state behind an `Arc`). Serve it over TCP with
/// [`Gateway::serve_tcp`] and over HTTP/3 with [`Gateway::serve_h3_connection`] (or
/// [`Gateway::serve_h3`] on an endpoint of its own).
///
/// ```no_run
/// # async fn run(service: std::sync::Arc<dyn zerolayer_api::InferenceService>) -> std::io::Result<()> {
/// use zerolayer_gateway::{Gateway, GatewayConfig};
///
/// let gateway = Gateway::new(service, GatewayConfig::default().api_keys(["sk-1".to_string()]));
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
/// gateway.serve_tcp(listener, std::future::pending()).await
/// # }
/// ```
#[derive(Clone)]
pub struct Gateway {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) service: Arc<dyn InferenceService>,
    pub(crate) config: GatewayConfig,
    pub(crate) metrics: Arc<GatewayMetrics>,
    keys: ApiKeys,
    per_key: Arc<Vec<AtomicUsize>>,
    draining: AtomicBool,
    pub(crate) drain_tx: watch::Sender<bool>,
    /// Set by [`Gateway::abort_streams`]: running generations end with an error event.
    abort_tx: watch::Sender<bool>,
    /// Bounds the CPU-heavy work running on the blocking pool.
    blocking: tokio::sync::Semaphore,
    /// `metrics_key` as an [`ApiKeys`] set (constant-time comparison).
    metrics_keys: ApiKeys,
}

/// Who sent a request, after auth.
#[derive(Debug, Clone, Copy)]
struct Caller {
    key: Option<usize>,
}

impl Gateway {
    /// A gateway over `service`. Logs a warning when no API key is configured (open mode).
    pub fn new(service: Arc<dyn InferenceService>, config: GatewayConfig) -> Self {
        let keys = ApiKeys::new(config.api_keys.iter().cloned());
        if keys.is_empty() {
            tracing::warn!("no API key configured: the gateway accepts every request (open mode)");
        }
        let per_key = Arc::new((0..keys.len()).map(|_| AtomicUsize::new(0)).collect());
        let (drain_tx, _) = watch::channel(false);
        let (abort_tx, _) = watch::channel(false);
        let blocking = match config.blocking_tasks {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        let metrics_keys = ApiKeys::new(config.metrics_key.iter().cloned());
        Self {
            inner: Arc::new(Inner {
                service,
                config,
                metrics: Arc::new(GatewayMetrics::new()),
                keys,
                per_key,
                draining: AtomicBool::new(false),
                drain_tx,
                abort_tx,
                blocking: tokio::sync::Semaphore::new(blocking),
                metrics_keys,
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    /// Starts a graceful shutdown: `/health` answers 503, new generations get 529 with
    /// `x-should-retry: true`, HTTP/1.1 responses close their connection, HTTP/3 connections
    /// get GOAWAY; running streams continue, and `/metrics` still answers. Keep the TCP listener
    /// open (the `shutdown` future of [`Gateway::serve_tcp`] pending) until the drain ends, so
    /// the drain itself can be scraped and probed.
    pub fn start_draining(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
        self.inner.drain_tx.send_replace(true);
    }

    /// Ends every running generation (streaming or not) at once: streams get an error event
    /// (`overloaded_error`, "the server is shutting down"; the OpenAI flavour its error chunk)
    /// and are closed, non-streaming requests answer 529. Call it at the drain deadline, after
    /// [`Gateway::start_draining`]; generations that start later end the same way.
    ///
    /// ```no_run
    /// # async fn f(gateway: zerolayer_gateway::Gateway) {
    /// gateway.start_draining();
    /// tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    /// gateway.abort_streams();
    /// # }
    /// ```
    pub fn abort_streams(&self) {
        self.start_draining();
        self.inner.abort_tx.send_replace(true);
    }

    /// Whether [`Gateway::start_draining`] was called.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    /// Generation requests in flight: the gateway's own, plus those submitted through a
    /// service wrapped by [`Gateway::count_in_flight`] (claudelink).
    pub fn in_flight(&self) -> u64 {
        self.inner.metrics.in_flight()
    }

    /// The `/metrics` text (Prometheus exposition format).
    pub fn render_metrics(&self) -> String {
        self.inner
            .metrics
            .render(&self.inner.service.metrics(), self.inner.service.ready())
    }

    /// The `Alt-Svc` value advertising HTTP/3, when an h3 port is configured.
    pub fn alt_svc(&self) -> Option<HeaderValue> {
        self.inner
            .config
            .h3_port
            .and_then(|p| HeaderValue::from_str(&format!("h3=\":{p}\"; ma=86400")).ok())
    }

    /// Decides on a request from its method, target and headers alone: routing, method, API
    /// key and `anthropic-version` are checked here (and, without API keys, its host and body
    /// type: `origin.rs`), before any byte of the body is read, so an unauthenticated client
    /// cannot make the server buffer (or wait for) a body. The host is `authority` (HTTP/2 and
    /// HTTP/3 `:authority`, an HTTP/1.1 absolute-form target) when the target names one, else
    /// the `Host` header.
    pub(crate) fn admit_at(
        &self,
        method: &Method,
        authority: Option<&str>,
        path_and_query: &str,
        headers: &HeaderMap,
        protocol: Protocol,
        received: Instant,
    ) -> Admission {
        let authority = authority.or_else(|| headers.get(HOST).and_then(|v| v.to_str().ok()));
        let request_id = new_id("req_");
        let path = path_and_query.split('?').next().unwrap_or("").to_owned();
        let endpoint = route_endpoint(&path);
        let access = Arc::new(AccessRecord::new(
            request_id.clone(),
            endpoint,
            protocol,
            received,
        ));
        let flavor = match endpoint {
            Endpoint::ChatCompletions => Flavor::OpenAi,
            Endpoint::Completions => Flavor::Completions,
            _ => Flavor::Anthropic,
        };
        // HEAD is answered on every route as GET would be (or with the same error), without a
        // body (an HTTP/2 or HTTP/3 HEAD response carrying DATA is a protocol error).
        let without_body = |mut reply: Reply| {
            if method == Method::HEAD {
                reply.body = ReplyBody::Full(Bytes::new());
            }
            reply
        };
        match self.admit_headers(method, authority, &path, headers, endpoint, flavor) {
            Ok(Some(reply)) => Admission::Reply(self.finish(without_body(reply), &access)),
            Ok(None) => {
                let debug = headers
                    .get(X_ANTHROPIC_DEBUG)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
                match self.authenticate(headers) {
                    Ok(caller) => Admission::ReadBody(Admitted {
                        request_id,
                        path,
                        endpoint,
                        flavor,
                        caller,
                        debug,
                        received,
                        access,
                    }),
                    Err(e) => {
                        let reply = error_reply(&e, flavor, &request_id);
                        Admission::Reply(self.finish(without_body(reply), &access))
                    }
                }
            }
            Err(e) => {
                let reply = error_reply(&e, flavor, &request_id);
                Admission::Reply(self.finish(without_body(reply), &access))
            }
        }
    }

    /// Answers an admitted request once its body is in.
    pub(crate) async fn respond(&self, req: Admitted, body: Result<Bytes, BodyError>) -> Reply {
        let reply = match self.dispatch(&req, body).await {
            Ok(r) => r,
            Err(e) => error_reply(&e, req.flavor, &req.request_id),
        };
        self.finish(reply, &req.access)
    }

    /// Adds the headers every response carries and counts the response.
    fn finish(&self, mut reply: Reply, access: &AccessRecord) -> Reply {
        let request_id = access.request_id();
        access.set_status(reply.status.as_u16());
        let h = &mut reply.headers;
        h.insert(X_CLAUDE_LAYER, HeaderValue::from_static(LAYER_VERSION));
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.insert(REQUEST_ID, v.clone());
            h.insert(X_REQUEST_ID, v);
        }
        self.inner.metrics.request_done(
            access.endpoint(),
            access.protocol(),
            reply.status.as_u16(),
        );
        reply
    }

    /// `GET /`: the configured page, under a Content-Security-Policy that keeps it to inline
    /// code and requests to this origin.
    fn index_page(&self, path: &str, head: bool) -> Result<Reply, ApiError> {
        let Some(page) = &self.inner.config.index_page else {
            return Err(ApiError::new(
                ApiErrorKind::NotFound,
                format!("GET {path}: no such endpoint"),
            ));
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        headers.insert(
            http::header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(INDEX_PAGE_CSP),
        );
        headers.insert(
            http::header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        let body = if head { Bytes::new() } else { page.clone() };
        Ok(Reply {
            status: StatusCode::OK,
            headers,
            body: ReplyBody::Full(body),
        })
    }

    /// The header-only part of [`Gateway::admit`]: `Some(reply)` for requests answered without
    /// a body (errors included), `None` when the body is needed (auth is checked by the caller).
    fn admit_headers(
        &self,
        m: &Method,
        authority: Option<&str>,
        path: &str,
        headers: &HeaderMap,
        endpoint: Endpoint,
        flavor: Flavor,
    ) -> Result<Option<Reply>, ApiError> {
        let keyless = self.inner.keys.is_empty();
        if let (Endpoint::Health, &Method::GET | &Method::HEAD) = (endpoint, m) {
            return Ok(Some(self.health(m == Method::HEAD)));
        }
        if keyless {
            check_host(authority, &self.inner.config.allowed_hosts)?;
        }
        match (endpoint, m) {
            (Endpoint::Metrics, &Method::GET | &Method::HEAD) => {
                self.authenticate_metrics(headers)?;
                return Ok(Some(Reply::text(
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    self.render_metrics(),
                )));
            }
            (Endpoint::Index, &Method::GET | &Method::HEAD) => {
                return self.index_page(path, m == Method::HEAD).map(Some);
            }
            (Endpoint::Other | Endpoint::Index, _) => {
                return Err(ApiError::new(
                    ApiErrorKind::NotFound,
                    format!("{m} {path}: no such endpoint"),
                ));
            }
            _ => {}
        }
        let allowed = match endpoint {
            Endpoint::Models | Endpoint::Health | Endpoint::Metrics => {
                m == Method::GET || m == Method::HEAD
            }
            _ => m == Method::POST,
        };
        if !allowed {
            return Err(ApiError::new(
                ApiErrorKind::NotFound,
                format!("{m} {path}: method not allowed on this endpoint"),
            ));
        }
        if keyless && m == Method::POST {
            check_json_body(headers)?;
        }
        self.authenticate(headers)?;
        if flavor == Flavor::Anthropic {
            check_version(headers)?;
        }
        if endpoint == Endpoint::Models {
            return self.models(path).map(Some);
        }
        Ok(None)
    }

    async fn dispatch(
        &self,
        req: &Admitted,
        body: Result<Bytes, BodyError>,
    ) -> Result<Reply, ApiError> {
        let body = match body {
            Ok(b) => b,
            Err(BodyError::TooLarge) => {
                return Err(ApiError::new(
                    ApiErrorKind::RequestTooLarge,
                    format!(
                        "request body exceeds the limit of {} bytes",
                        self.inner.config.max_body_bytes
                    ),
                ));
            }
            Err(BodyError::Timeout) => {
                return Err(ApiError::new(
                    ApiErrorKind::Timeout,
                    "request body not received in time",
                ));
            }
            Err(BodyError::Transport(e)) => {
                return Err(ApiError::invalid(format!("request body: {e}")));
            }
        };
        let limits = Limits {
            max_output_tokens: self.inner.config.max_output_tokens,
            default_chat_max_tokens: self.inner.config.default_chat_max_tokens,
        };
        let endpoint = req.endpoint;
        let big = body.len() > SMALL_BODY;
        // Parsing a large body is CPU work too: off the runtime's threads.
        let parse = move || -> Result<GenRequest, ApiError> {
            let value: Value = serde_json::from_slice(&body)
                .map_err(|e| ApiError::invalid(format!("request body: invalid JSON: {e}")))?;
            match endpoint {
                Endpoint::ChatCompletions => parse_chat(&value, limits),
                Endpoint::Completions => parse_completions(&value, limits),
                Endpoint::CountTokens => parse_messages(&value, limits, true),
                _ => parse_messages(&value, limits, false),
            }
        };
        let parsed = if big {
            self.blocking(parse).await??
        } else {
            parse()?
        };
        self.check_prompt_size(&parsed)?;
        if parsed.tools.is_some() && !self.inner.service.supports_tools() {
            return Err(ApiError::invalid(
                "tools: the served model does not take tools (it has no chat template)",
            ));
        }
        match endpoint {
            Endpoint::CountTokens => {
                self.check_model(&parsed.model)?;
                let service = self.inner.service.clone();
                let prompt = parsed.prompt();
                let tools = parsed.tools.clone();
                let n = self
                    .blocking(move || service.count_tokens_with_tools(&prompt, tools.as_deref()))
                    .await??;
                Ok(Reply::json(StatusCode::OK, &json!({"input_tokens": n})))
            }
            Endpoint::Messages | Endpoint::ChatCompletions | Endpoint::Completions => {
                self.generate(parsed, req).await
            }
            _ => Err(ApiError::new(
                ApiErrorKind::NotFound,
                format!("{}: no such endpoint", req.path),
            )),
        }
    }

    /// Runs CPU-heavy request work (body parsing, tokenization) on tokio's blocking pool, at
    /// most `blocking_tasks` at once, so the runtime's threads stay free for I/O (`/health`
    /// answers while large prompts are tokenized).
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let _permit = self
            .inner
            .blocking
            .acquire()
            .await
            .map_err(|_| ApiError::new(ApiErrorKind::Overloaded, "Overloaded"))?;
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| ApiError::new(ApiErrorKind::Api, format!("request work failed: {e}")))
    }

    /// Refuses prompts above `max_prompt_bytes` before they are tokenized.
    fn check_prompt_size(&self, parsed: &GenRequest) -> Result<(), ApiError> {
        let limit = self.inner.config.max_prompt_bytes;
        let bytes = parsed.prompt_bytes();
        if bytes > limit {
            return Err(ApiError::new(
                ApiErrorKind::RequestTooLarge,
                format!("prompt of {bytes} bytes exceeds the limit of {limit} bytes"),
            ));
        }
        Ok(())
    }

    /// `/health`: 200 `ok`, or 503 `draining`, `starting`, or `model_file_changed` with the
    /// file's `path` and what changed (`detail`).
    fn health(&self, head: bool) -> Reply {
        let unavailable = StatusCode::SERVICE_UNAVAILABLE;
        let (status, body) = match (self.is_draining(), self.inner.service.health()) {
            (_, ServiceHealth::ModelFileChanged { path, detail }) => (
                unavailable,
                json!({"status": "model_file_changed", "path": path.to_string_lossy(),
                    "detail": detail, "layer": LAYER_VERSION}),
            ),
            (true, _) => (
                unavailable,
                json!({"status": "draining", "layer": LAYER_VERSION}),
            ),
            (false, ServiceHealth::Ready) => (
                StatusCode::OK,
                json!({"status": "ok", "layer": LAYER_VERSION}),
            ),
            (false, _) => (
                unavailable,
                json!({"status": "starting", "layer": LAYER_VERSION}),
            ),
        };
        let mut r = Reply::json(status, &body);
        if head {
            r.body = ReplyBody::Full(Bytes::new());
        }
        r
    }

    fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        if self.inner.keys.is_empty() {
            return Ok(Caller { key: None });
        }
        let presented = presented_key(headers)?;
        match self.inner.keys.find(presented) {
            Some(i) => Ok(Caller { key: Some(i) }),
            None => Err(ApiError::new(
                ApiErrorKind::Authentication,
                "invalid x-api-key",
            )),
        }
    }

    /// Whether `headers` carry one of the gateway's API keys (what takes a connection out of
    /// the unauthenticated budget); `false` on a gateway without keys, where there is nothing
    /// to present.
    pub(crate) fn presents_key(&self, headers: &HeaderMap) -> bool {
        !self.inner.keys.is_empty()
            && presented_key(headers).is_ok_and(|k| self.inner.keys.find(k).is_some())
    }

    /// Whether connections must present an API key.
    pub(crate) fn requires_keys(&self) -> bool {
        !self.inner.keys.is_empty()
    }

    /// The idle and authentication timeouts every transport applies to its connections.
    pub(crate) fn watch_policy(&self) -> super::conn_watch::WatchPolicy {
        let cfg = &self.inner.config;
        super::conn_watch::WatchPolicy {
            idle: cfg.idle_timeout,
            auth: self.requires_keys().then_some(cfg.auth_timeout),
        }
    }

    /// `/metrics` needs `metrics_key` when one is configured.
    fn authenticate_metrics(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.inner.metrics_keys.is_empty() {
            return Ok(());
        }
        match self.inner.metrics_keys.find(presented_key(headers)?) {
            Some(_) => Ok(()),
            None => Err(ApiError::new(
                ApiErrorKind::Authentication,
                "invalid metrics key",
            )),
        }
    }

    fn models(&self, path: &str) -> Result<Reply, ApiError> {
        let item = |m: &zerolayer_api::ModelInfo| {
            json!({
                "type": "model", "id": m.id, "display_name": m.display_name,
                "created_at": "2024-11-01T00:00:00Z", "context_length": m.context_length,
                "object": "model", "created": 1_730_419_200u64, "owned_by": "zerolayer",
            })
        };
        let models = self.inner.service.models();
        if let Some(raw) = path.strip_prefix("/v1/models/") {
            // Ids may hold spaces (a file's `general.name`): the path carries them escaped.
            let id = percent_decode(raw).ok_or_else(|| {
                ApiError::invalid(format!("model id `{raw}`: malformed percent-encoding"))
            })?;
            return match models.iter().find(|m| m.id == id) {
                Some(m) => Ok(Reply::json(StatusCode::OK, &item(m))),
                None => Err(ApiError::new(
                    ApiErrorKind::NotFound,
                    format!("model: {id}"),
                )),
            };
        }
        let data: Vec<Value> = models.iter().map(item).collect();
        Ok(Reply::json(
            StatusCode::OK,
            &json!({
                "object": "list", "data": data, "has_more": false,
                "first_id": models.first().map(|m| m.id.clone()),
                "last_id": models.last().map(|m| m.id.clone()),
            }),
        ))
    }

    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if self.inner.config.accept_any_model {
            return Ok(());
        }
        let models = self.inner.service.models();
        if models.is_empty() || models.iter().any(|m| m.id == model) {
            return Ok(());
        }
        let served: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
        Err(ApiError::new(
            ApiErrorKind::NotFound,
            format!(
                "model: {model} is not served here (served: {})",
                served.join(", ")
            ),
        ))
    }

    async fn generate(&self, parsed: GenRequest, req: &Admitted) -> Result<Reply, ApiError> {
        let (flavor, caller, debug, received) = (req.flavor, req.caller, req.debug, req.received);
        let request_id = req.request_id.as_str();
        self.check_model(&parsed.model)?;
        let cfg = &self.inner.config;
        if self.is_draining() {
            return Err(ApiError::new(
                ApiErrorKind::Overloaded,
                "Overloaded: the server is shutting down",
            )
            .with_retry_after(cfg.retry_after_ms));
        }
        let deadline = tokio::time::Instant::from_std(received + cfg.request_timeout);
        let submitted = Instant::now();
        // Every choice is a request of its own (the seed of choice i is seed + i).
        let mut gens = Vec::with_capacity(parsed.n as usize);
        for i in 0..parsed.n {
            let mut request =
                InferenceRequest::new(parsed.model.clone(), parsed.prompt(), parsed.max_tokens);
            request.sampling = parsed.sampling.clone();
            request.sampling.seed = parsed.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
            request.stop_sequences = parsed.stop_sequences.clone();
            request.client = caller.key.map(|i| self.inner.keys.label(i).to_owned());
            request.logprobs = parsed.logprobs;
            request.output_format = parsed.output_format.clone();
            request.tools = parsed.tools.clone();
            let slot = Slot::acquire(self, caller)?;
            let events = if parsed.constrained() {
                // The service compiles the schema before it answers: CPU work.
                let service = self.inner.service.clone();
                self.blocking(move || service.submit(request)).await?
            } else {
                self.inner.service.submit(request)
            }
            .map_err(|e| parsed.service_error(e))?;
            gens.push(Generation {
                events,
                buffered: None,
                deadline,
                received,
                input_tokens: 0,
                first_token: None,
                streamed_tokens: 0,
                logprobs: Vec::new(),
                flavor,
                calls_left: if parsed.single_tool_call { 1 } else { u32::MAX },
                done: false,
                access: req.access.clone(),
                metrics: self.inner.metrics.clone(),
                abort: self.inner.abort_tx.subscribe(),
                _slot: slot,
            });
        }
        for g in &mut gens {
            g.wait_started(cfg.max_prompt_tokens).await?;
        }
        let queue = submitted.elapsed();
        self.inner.metrics.observe_queue(queue);
        let now_secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let id = new_id(match flavor {
            Flavor::Anthropic => "msg_",
            Flavor::OpenAi => "chatcmpl-",
            Flavor::Completions => "cmpl-",
        });
        let mut fmt = StreamFormat::new(flavor, id, parsed.model.clone(), now_secs);
        fmt.include_usage = parsed.include_usage;
        let debug_header = |ttft: Option<Duration>| {
            let v = json!({
                "layer": LAYER_VERSION,
                "cache_hit_rate": self.inner.service.metrics().weight_cache_hit_rate,
                "ttft_ms": ttft.map(|d| d.as_secs_f64() * 1e3),
                "queue_ms": queue.as_secs_f64() * 1e3,
            });
            HeaderValue::from_str(&v.to_string()).ok()
        };
        if gens.len() > 1 {
            return Ok(if parsed.stream {
                choices::stream(gens, fmt, request_id)
            } else {
                choices::collect(gens, fmt, request_id).await
            });
        }
        let Some(mut g) = gens.pop() else {
            return Err(ApiError::invalid("n: at least one choice is required"));
        };
        if !parsed.stream {
            return Ok(collect(g, fmt, request_id, debug.then_some(&debug_header)).await);
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        if debug {
            // Hold the headers until the first token so the header carries a measured TTFT.
            if g.buffered.is_none() {
                g.buffered = g.recv().await;
            }
            if let Some(v) = debug_header(g.first_token.map(|t| t - g.received)) {
                headers.insert(X_CLAUDE_LAYER_DEBUG, v);
            }
        }
        Ok(Reply {
            status: StatusCode::OK,
            headers,
            body: ReplyBody::Stream(Box::pin(sse_body(g, fmt, request_id))),
        })
    }
}

/// The key a request presents: `x-api-key`, else `Authorization: Bearer <key>` (`x-api-key`
/// wins when both are sent, as upstream does). A bare `Authorization: <key>` is refused.
fn presented_key(headers: &HeaderMap) -> Result<&[u8], ApiError> {
    if let Some(k) = headers.get(X_API_KEY) {
        return Ok(k.as_bytes());
    }
    let Some(v) = headers.get(http::header::AUTHORIZATION) else {
        return Err(ApiError::new(
            ApiErrorKind::Authentication,
            "x-api-key header (or Authorization: Bearer) is required",
        ));
    };
    let v = v.as_bytes();
    if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
        Ok(v[7..].trim_ascii())
    } else {
        Err(ApiError::new(
            ApiErrorKind::Authentication,
            "Authorization must be `Bearer <key>`; or send the key in x-api-key",
        ))
    }
}

/// The index page's Content-Security-Policy: its own inline script and style, requests to this
/// origin only, nothing loaded from elsewhere, no framing.
const INDEX_PAGE_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; \
    style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

fn route_endpoint(path: &str) -> Endpoint {
    match path {
        "/v1/messages" => Endpoint::Messages,
        "/v1/messages/count_tokens" => Endpoint::CountTokens,
        "/v1/chat/completions" => Endpoint::ChatCompletions,
        "/v1/completions" => Endpoint::Completions,
        "/v1/models" => Endpoint::Models,
        p if p.starts_with("/v1/models/") && p.len() > "/v1/models/".len() => Endpoint::Models,
        "/health" => Endpoint::Health,
        "/metrics" => Endpoint::Metrics,
        "/" | "/index.html" => Endpoint::Index,
        _ => Endpoint::Other,
    }
}

fn check_version(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(v) = headers.get(ANTHROPIC_VERSION) else {
        return Ok(());
    };
    let v = v.to_str().unwrap_or("");
    if SUPPORTED_ANTHROPIC_VERSIONS.contains(&v) {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "anthropic-version: unsupported version `{v}` (supported: {})",
            SUPPORTED_ANTHROPIC_VERSIONS.join(", ")
        )))
    }
}

pub(crate) fn error_reply(e: &ApiError, flavor: Flavor, request_id: &str) -> Reply {
    let body = match flavor {
        Flavor::Anthropic => e.anthropic_body(request_id),
        Flavor::OpenAi | Flavor::Completions => e.openai_body(request_id),
    };
    let mut r = Reply::json(e.kind.status(), &body);
    if let Some(ms) = e.retry_after_ms {
        let h = &mut r.headers;
        h.insert(RETRY_AFTER_MS, HeaderValue::from(ms));
        h.insert(RETRY_AFTER, HeaderValue::from(ms.div_ceil(1000).max(1)));
        h.insert(X_SHOULD_RETRY, HeaderValue::from_static("true"));
    }
    r
}

/// A generation slot: counts toward the global and per-key limits until dropped.
struct Slot {
    metrics: Arc<GatewayMetrics>,
    per_key: Option<(Arc<Vec<AtomicUsize>>, usize)>,
}

impl Slot {
    fn acquire(gw: &Gateway, caller: Caller) -> Result<Self, ApiError> {
        let cfg = &gw.inner.config;
        let n = gw.inner.metrics.generation_started();
        let mut slot = Self {
            metrics: gw.inner.metrics.clone(),
            per_key: None,
        };
        if cfg.max_concurrent_requests > 0 && n > cfg.max_concurrent_requests as u64 {
            return Err(ApiError::new(ApiErrorKind::Overloaded, "Overloaded")
                .with_retry_after(cfg.retry_after_ms));
        }
        if let Some(k) = caller.key {
            let now = gw.inner.per_key[k].fetch_add(1, Ordering::SeqCst) + 1;
            slot.per_key = Some((gw.inner.per_key.clone(), k));
            if cfg.max_concurrent_per_key > 0 && now > cfg.max_concurrent_per_key {
                return Err(ApiError::new(
                    ApiErrorKind::RateLimit,
                    format!(
                        "rate limited: at most {} concurrent requests per API key",
                        cfg.max_concurrent_per_key
                    ),
                )
                .with_retry_after(cfg.retry_after_ms));
            }
        }
        Ok(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.generation_ended();
        if let Some((counts, k)) = &self.per_key {
            counts[*k].fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// One running generation. Dropping it drops the service's [`EventStream`], which cancels the
/// request; an unfinished generation is counted as cancelled.
pub(super) struct Generation {
    events: EventStream,
    buffered: Option<InferenceEvent>,
    deadline: tokio::time::Instant,
    received: Instant,
    pub(super) input_tokens: u32,
    first_token: Option<Instant>,
    /// Output tokens received so far (the count of a cancelled generation).
    streamed_tokens: u32,
    /// Log-probabilities of tokens whose text has not been stepped out yet.
    logprobs: Vec<TokenLogprob>,
    /// The API answered (the style of tool-call ids).
    flavor: Flavor,
    /// Tool calls that may still be passed on (1 when parallel tool use is disabled).
    calls_left: u32,
    done: bool,
    access: Arc<AccessRecord>,
    metrics: Arc<GatewayMetrics>,
    /// [`Gateway::abort_streams`] was called when this turns true.
    abort: watch::Receiver<bool>,
    _slot: Slot,
}

/// A step of a generation, as the bodies need it.
pub(super) enum Step {
    /// Text, and the log-probabilities of the tokens that completed it (when asked for).
    Text(String, Vec<TokenLogprob>),
    /// A tool call.
    ToolCall(Call),
    Finished {
        stop: StopReason,
        stop_sequence: Option<String>,
        usage: Usage,
    },
    Failed(ApiError),
}

impl Generation {
    /// The next raw event (a buffered one first); `None` at the end or on timeout.
    async fn recv(&mut self) -> Option<InferenceEvent> {
        if let Some(ev) = self.buffered.take() {
            return Some(ev);
        }
        let next = tokio::time::timeout_at(self.deadline, self.events.next());
        let ev = tokio::select! {
            ev = next => ev.ok().flatten(),
            // An error from `wait_for` means the gateway is gone: abort as well.
            _ = self.abort.wait_for(|aborted| *aborted) => Some(InferenceEvent::Error {
                code: ErrorCode::ShuttingDown,
                message: "the server is shutting down".into(),
            }),
        };
        if let Some(InferenceEvent::Delta { ids, text }) = &ev {
            if self.first_token.is_none() && (!ids.is_empty() || !text.is_empty()) {
                let now = Instant::now();
                self.first_token = Some(now);
                self.metrics.observe_ttft(now - self.received);
            }
            self.metrics.tokens(ids.len() as u64);
            self.streamed_tokens = self
                .streamed_tokens
                .saturating_add(u32::try_from(ids.len()).unwrap_or(u32::MAX));
        }
        ev
    }

    /// Waits for the service to accept the prompt, so early failures get a proper status.
    async fn wait_started(&mut self, max_prompt_tokens: Option<u32>) -> Result<(), ApiError> {
        match self.recv().await {
            Some(InferenceEvent::Started { input_tokens }) => self.input_tokens = input_tokens,
            Some(InferenceEvent::Error { code, message }) => {
                self.done = true;
                self.record(Outcome::Error, 0);
                return Err(ApiError::from_code(code, message));
            }
            Some(other) => self.buffered = Some(other),
            None if self.timed_out() => return Err(self.fail_timeout()),
            None => return Err(self.fail_ended()),
        }
        if let Some(limit) = max_prompt_tokens.filter(|&l| self.input_tokens > l) {
            self.done = true;
            self.record(Outcome::Error, 0);
            return Err(ApiError::invalid(format!(
                "prompt is too long: {} tokens > {limit} maximum",
                self.input_tokens
            )));
        }
        Ok(())
    }

    fn timed_out(&self) -> bool {
        tokio::time::Instant::now() >= self.deadline
    }

    fn record(&self, outcome: Outcome, output_tokens: u32) {
        let decode = self.first_token.map(|t| t.elapsed());
        self.access.generation(
            self.input_tokens,
            output_tokens.max(self.streamed_tokens),
            self.first_token.map(|t| t - self.received),
            outcome,
        );
        self.metrics.generation_outcome(
            outcome,
            self.received.elapsed(),
            self.input_tokens,
            output_tokens,
            decode,
        );
    }

    fn fail_timeout(&mut self) -> ApiError {
        self.done = true;
        self.record(Outcome::Timeout, 0);
        ApiError::new(ApiErrorKind::Timeout, "the request ran past its time limit")
    }

    fn fail_ended(&mut self) -> ApiError {
        self.done = true;
        self.record(Outcome::Error, 0);
        ApiError::new(ApiErrorKind::Api, "the generation ended without a result")
    }

    /// The next step; `None` after the last one.
    pub(super) async fn step(&mut self) -> Option<Step> {
        if self.done {
            return None;
        }
        loop {
            match self.recv().await {
                Some(InferenceEvent::Delta { text, .. }) if text.is_empty() => {}
                Some(InferenceEvent::Delta { text, .. }) => {
                    return Some(Step::Text(text, std::mem::take(&mut self.logprobs)));
                }
                Some(InferenceEvent::Logprobs(lp)) => self.logprobs.extend(lp),
                Some(InferenceEvent::ToolCall { name, arguments }) if self.calls_left > 0 => {
                    self.calls_left -= 1;
                    return Some(Step::ToolCall(Call::new(self.flavor, name, arguments)));
                }
                Some(InferenceEvent::ToolCall { .. } | InferenceEvent::Started { .. }) => {}
                Some(InferenceEvent::Finished {
                    stop_reason,
                    stop_sequence,
                    usage,
                }) => {
                    self.done = true;
                    self.record(Outcome::Finished, usage.output_tokens);
                    return Some(Step::Finished {
                        stop: stop_reason,
                        stop_sequence,
                        usage,
                    });
                }
                Some(InferenceEvent::Error { code, message }) => {
                    self.done = true;
                    self.record(Outcome::Error, 0);
                    return Some(Step::Failed(ApiError::from_code(code, message)));
                }
                #[allow(unreachable_patterns)]
                Some(_) => {}
                None if self.timed_out() => return Some(Step::Failed(self.fail_timeout())),
                None => return Some(Step::Failed(self.fail_ended())),
            }
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.done {
            self.record(Outcome::Cancelled, 0);
        }
    }
}

/// A generation run to its end: the complete response body of one choice.
pub(super) async fn collect_choice(
    g: &mut Generation,
    fmt: &mut StreamFormat,
) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut logprobs = Vec::new();
    loop {
        match g.step().await {
            Some(Step::Text(t, lp)) => {
                text.push_str(&t);
                logprobs.extend(lp);
            }
            Some(Step::ToolCall(c)) => calls.push(c),
            Some(Step::Finished {
                stop,
                stop_sequence,
                usage,
            }) => {
                return Ok(fmt.full(
                    &text,
                    &calls,
                    &logprobs,
                    stop,
                    stop_sequence.as_deref(),
                    usage,
                ));
            }
            Some(Step::Failed(e)) => return Err(e),
            None => return Err(g.fail_ended()),
        }
    }
}

/// Runs a generation to its end and answers with one JSON body.
async fn collect(
    mut g: Generation,
    mut fmt: StreamFormat,
    request_id: &str,
    debug: Option<&(dyn Fn(Option<Duration>) -> Option<HeaderValue> + Sync)>,
) -> Reply {
    let mut reply = match collect_choice(&mut g, &mut fmt).await {
        Ok(body) => Reply::json(StatusCode::OK, &body),
        Err(e) => error_reply(&e, fmt.flavor, request_id),
    };
    if let Some(v) = debug.and_then(|f| f(g.first_token.map(|t| t - g.received))) {
        reply.headers.insert(X_CLAUDE_LAYER_DEBUG, v);
    }
    reply
}

/// The SSE body of one generation: `fmt`'s start events, its deltas, its end (or an error
/// event).
pub(super) fn sse_body(
    g: Generation,
    fmt: StreamFormat,
    request_id: &str,
) -> impl Stream<Item = Bytes> + Send + use<> {
    let mut fmt = fmt;
    let state = SseState {
        pending: fmt.start(g.input_tokens).into(),
        run: g,
        fmt,
        request_id: request_id.to_owned(),
        finished: false,
    };
    futures::stream::unfold(state, SseState::step)
}

/// State of a streaming body.
struct SseState {
    run: Generation,
    fmt: StreamFormat,
    pending: VecDeque<Bytes>,
    request_id: String,
    finished: bool,
}

impl SseState {
    async fn step(mut self) -> Option<(Bytes, Self)> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Some((b, self));
            }
            if self.finished {
                return None;
            }
            match self.run.step().await {
                Some(Step::Text(t, lp)) => self.pending.push_back(self.fmt.delta(&t, &lp)),
                Some(Step::ToolCall(c)) => self.pending.push_back(self.fmt.tool_call(&c)),
                Some(Step::Finished {
                    stop,
                    stop_sequence,
                    usage,
                }) => {
                    self.pending
                        .extend(self.fmt.finish(stop, stop_sequence.as_deref(), usage));
                    self.finished = true;
                }
                Some(Step::Failed(e)) => {
                    self.pending.push_back(self.fmt.error(&e, &self.request_id));
                    self.finished = true;
                }
                None => self.finished = true,
            }
        }
    }
}
