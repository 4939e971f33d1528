//! Shared pieces of the gateway tests: a deterministic word-level [`InferenceService`] (a test
//! double for the HTTP layer; the real model is exercised by scripts/test-clients), a gateway on
//! loopback, and a small HTTP/1.1 client with an SSE parser.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use claudelink_proto::*;
use http_body_util::{BodyExt, Full};
use serde_json::Value;
pub use zerolayer_gateway::*;

/// Tokens are whitespace-separated words. The answer repeats the last user turn's words (cycling)
/// for as many tokens as that turn has, then ends the turn. Magic words in the last user turn:
/// `OVERLOAD` (refused with `Overloaded`), `FAILMID` (error after two deltas), `SLOW` (20 ms per
/// token, and the answer runs until `max_tokens`), `SILENT` (never emits an event),
/// `SLOWCOUNT` (`count_tokens` blocks its thread for 2 s, like tokenizing a huge prompt).
#[derive(Debug, Default)]
pub struct WordService {
    pub not_ready: AtomicBool,
    pub last_request: Mutex<Option<InferenceRequest>>,
    pub cancelled: Arc<AtomicU64>,
    pub finished: Arc<AtomicU64>,
    pub context: u32,
    /// Calls of `count_tokens`.
    pub count_calls: AtomicU64,
}

impl WordService {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            context: 64,
            ..Self::default()
        })
    }
}

fn words(prompt: &Prompt) -> (u32, Vec<String>) {
    match prompt {
        Prompt::Chat(msgs) => {
            let n: usize = msgs
                .iter()
                .map(|m| m.content.split_whitespace().count() + 1)
                .sum();
            let last = msgs
                .iter()
                .rev()
                .find(|m| m.role == ChatRole::User)
                .map(|m| m.content.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default();
            (n as u32, last)
        }
        Prompt::Text(t) => (
            t.split_whitespace().count() as u32,
            t.split_whitespace().map(str::to_owned).collect(),
        ),
        _ => (0, Vec::new()),
    }
}

/// Counts a stream as cancelled when dropped before its last event.
struct Tracker {
    done: bool,
    cancelled: Arc<AtomicU64>,
    finished: Arc<AtomicU64>,
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if self.done {
            self.finished.fetch_add(1, Ordering::SeqCst);
        } else {
            self.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl InferenceService for WordService {
    fn submit(&self, req: InferenceRequest) -> Result<EventStream, ServiceError> {
        *self.last_request.lock().unwrap() = Some(req.clone());
        let (input, last) = words(&req.prompt);
        if last.iter().any(|w| w == "OVERLOAD") {
            return Err(ServiceError::Overloaded { retry_after_ms: 25 });
        }
        if input > self.context {
            return Err(ServiceError::ContextLength {
                prompt_tokens: input,
                limit: self.context,
            });
        }
        let slow = last.iter().any(|w| w == "SLOW");
        let fail = last.iter().any(|w| w == "FAILMID");
        let silent = last.iter().any(|w| w == "SILENT");
        let answer_len = if slow {
            u32::MAX
        } else {
            last.len().max(1) as u32
        };
        let max = req.max_tokens;
        let stops = req.stop_sequences.clone();
        let tracker = Tracker {
            done: false,
            cancelled: self.cancelled.clone(),
            finished: self.finished.clone(),
        };
        // State: (next token index, started, ended, tracker).
        let stream = futures::stream::unfold(
            (0u32, false, false, tracker),
            move |(i, started, ended, mut tracker)| {
                let last = last.clone();
                let stops = stops.clone();
                async move {
                    if ended {
                        return None;
                    }
                    if silent {
                        futures::future::pending::<()>().await;
                    }
                    if !started {
                        return Some((
                            InferenceEvent::Started {
                                input_tokens: input,
                            },
                            (0, true, false, tracker),
                        ));
                    }
                    if slow {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let mut finish = |reason, seq, n| {
                        tracker.done = true;
                        let ev = InferenceEvent::Finished {
                            stop_reason: reason,
                            stop_sequence: seq,
                            usage: Usage {
                                input_tokens: input,
                                output_tokens: n,
                            },
                        };
                        (ev, n)
                    };
                    let (ev, next, end) = if fail && i == 2 {
                        tracker.done = true;
                        (
                            InferenceEvent::Error {
                                code: ErrorCode::Internal,
                                message: "engine failure".into(),
                            },
                            i,
                            true,
                        )
                    } else if i >= answer_len {
                        let (ev, n) = finish(StopReason::EndTurn, None, i);
                        (ev, n, true)
                    } else if i >= max {
                        let (ev, n) = finish(StopReason::MaxTokens, None, i);
                        (ev, n, true)
                    } else {
                        let word = last
                            .get(i as usize % last.len().max(1))
                            .cloned()
                            .unwrap_or_else(|| "ok".into());
                        if let Some(s) = stops.iter().find(|s| word.contains(s.as_str())) {
                            // The stop sequence's token is generated but its text is not sent.
                            let (ev, n) = finish(StopReason::StopSequence, Some(s.clone()), i + 1);
                            (ev, n, true)
                        } else {
                            let piece = if i == 0 { word } else { format!(" {word}") };
                            (
                                InferenceEvent::Delta {
                                    ids: vec![i],
                                    text: piece,
                                },
                                i + 1,
                                false,
                            )
                        }
                    };
                    Some((ev, (next, true, end, tracker)))
                }
            },
        );
        Ok(Box::pin(stream))
    }

    fn count_tokens(&self, prompt: &Prompt) -> Result<u32, ServiceError> {
        self.count_calls.fetch_add(1, Ordering::SeqCst);
        let (n, last) = words(prompt);
        if last.iter().any(|w| w == "SLOWCOUNT") {
            std::thread::sleep(Duration::from_secs(2));
        }
        Ok(n)
    }

    fn models(&self) -> Vec<ModelInfo> {
        vec![ModelInfo {
            id: "word-model".into(),
            display_name: "Word model".into(),
            context_length: self.context,
        }]
    }

    fn metrics(&self) -> ServiceMetrics {
        let mut m = ServiceMetrics::default();
        m.queue_depth = 3;
        m.kv_bytes_used = 1024;
        m.kv_bytes_budget = 4096;
        m.weight_cache_hit_rate = 0.75;
        m.expert_hit_rate = 0.625;
        m.weight_read_bytes_per_token = 4096.5;
        m
    }

    fn ready(&self) -> bool {
        !self.not_ready.load(Ordering::SeqCst)
    }
}

/// A gateway serving `service` on a loopback TCP port.
pub struct TestServer {
    pub addr: SocketAddr,
    pub gateway: Gateway,
    pub service: Arc<WordService>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl TestServer {
    pub async fn start(config: GatewayConfig) -> Self {
        Self::start_with(WordService::new(), config).await
    }

    pub async fn start_with(service: Arc<WordService>, config: GatewayConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let gateway = Gateway::new(service.clone(), config);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let gw = gateway.clone();
        tokio::spawn(async move {
            gw.serve_tcp(listener, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        Self {
            addr,
            gateway,
            service,
            shutdown: Some(tx),
            runtime: None,
        }
    }

    /// Like [`TestServer::start_with`], but the gateway runs on a runtime of its own with
    /// `workers` threads, so a blocked server thread cannot stall the test's client.
    pub fn start_isolated(
        service: Arc<WordService>,
        config: GatewayConfig,
        workers: usize,
    ) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let gateway = Gateway::new(service.clone(), config);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let gw = gateway.clone();
        rt.spawn(async move {
            let _ = gw
                .serve_tcp(listener, async {
                    let _ = rx.await;
                })
                .await;
        });
        Self {
            addr,
            gateway,
            service,
            shutdown: Some(tx),
            runtime: Some(rt),
        }
    }

    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Resp {
        send(
            self.addr,
            "POST",
            path,
            headers,
            Bytes::from(body.to_string()),
        )
        .await
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Resp {
        send(self.addr, "GET", path, headers, Bytes::new()).await
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A complete response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }
}

/// One HTTP/1.1 request on a fresh connection; `host: localhost` and, with a body,
/// `content-type: application/json` unless `headers` name their own.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Resp {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    // `host: localhost` and (with a body) `content-type: application/json` unless given.
    let given = |name: &str| headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(name));
    let mut b = http::Request::builder().method(method).uri(path);
    if !given("host") {
        b = b.header("host", "localhost");
    }
    if !body.is_empty() && !given("content-type") {
        b = b.header("content-type", "application/json");
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = sender
        .send_request(b.body(Full::new(body)).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Resp {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

/// An SSE event: (`event:` name if any, parsed `data:` JSON or raw text).
#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

impl SseEvent {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data).unwrap()
    }
}

pub fn parse_sse(body: &str) -> Vec<SseEvent> {
    body.split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|block| {
            let mut ev = SseEvent {
                event: None,
                data: String::new(),
            };
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    ev.event = Some(e.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    ev.data.push_str(d);
                } else {
                    panic!("unexpected SSE line {line:?}");
                }
            }
            ev
        })
        .collect()
}

pub fn user(text: &str) -> Value {
    serde_json::json!({"model": "word-model", "max_tokens": 32, "messages": [{"role": "user", "content": text}]})
}

/// Polls `cond` until it holds (panics after 10 s; a liveness bound, not a timing assertion).
pub async fn eventually(mut cond: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not reached within 10 s");
}

/// An HTTP/2 (prior knowledge) client connection to `addr`, driven on a task of its own.
pub async fn h2_connect<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}
