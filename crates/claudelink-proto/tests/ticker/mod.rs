//! A trivial in-test service streaming N deltas with a delay, servers and clients around it
//! (shared by the loopback transport and pool tests).
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use claudelink_proto::*;

/// Streams `deltas` deltas, `delay` apart, and records concurrency and cancellation.
pub struct Ticker {
    pub deltas: u32,
    pub delay: Duration,
    pub delta_bytes: usize,
    pub active: Arc<AtomicUsize>,
    pub max_active: Arc<AtomicUsize>,
    pub cancelled: Arc<AtomicUsize>,
    pub finished: Arc<AtomicUsize>,
    pub overloaded: AtomicBool,
}

impl Ticker {
    pub fn new(deltas: u32, delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            deltas,
            delay,
            delta_bytes: 1,
            active: Arc::default(),
            max_active: Arc::default(),
            cancelled: Arc::default(),
            finished: Arc::default(),
            overloaded: AtomicBool::new(false),
        })
    }
}

/// Counts a request as active while alive; as cancelled when dropped before the end.
struct Work {
    active: Arc<AtomicUsize>,
    cancelled: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
    done: bool,
}

impl Drop for Work {
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
        if self.done {
            self.finished.fetch_add(1, Ordering::SeqCst);
        } else {
            self.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl InferenceService for Ticker {
    fn submit(&self, req: InferenceRequest) -> Result<EventStream, ServiceError> {
        if self.overloaded.load(Ordering::SeqCst) {
            return Err(ServiceError::Overloaded {
                retry_after_ms: 250,
            });
        }
        let n = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_active.fetch_max(n, Ordering::SeqCst);
        let work = Work {
            active: self.active.clone(),
            cancelled: self.cancelled.clone(),
            finished: self.finished.clone(),
            done: false,
        };
        let input = match &req.prompt {
            Prompt::TokenIds(ids) => ids.len() as u32,
            _ => 3,
        };
        let total = self.deltas.min(req.max_tokens);
        let delay = self.delay;
        let text = "x".repeat(self.delta_bytes);
        let s = futures::stream::unfold((0u32, work), move |(i, mut work)| {
            let text = text.clone();
            async move {
                if i == 0 {
                    return Some((
                        InferenceEvent::Started {
                            input_tokens: input,
                        },
                        (1, work),
                    ));
                }
                if i > total + 1 {
                    return None;
                }
                if i == total + 1 {
                    work.done = true;
                    return Some((
                        InferenceEvent::Finished {
                            stop_reason: StopReason::MaxTokens,
                            stop_sequence: None,
                            usage: Usage {
                                input_tokens: input,
                                output_tokens: total,
                            },
                        },
                        (i + 1, work),
                    ));
                }
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                Some((InferenceEvent::Delta { ids: vec![i], text }, (i + 1, work)))
            }
        });
        Ok(Box::pin(s))
    }
    fn count_tokens(&self, _: &Prompt) -> Result<u32, ServiceError> {
        Ok(3)
    }
    fn models(&self) -> Vec<ModelInfo> {
        vec![]
    }
    fn metrics(&self) -> ServiceMetrics {
        ServiceMetrics::default()
    }
}

pub fn start(service: Arc<Ticker>, cfg: impl FnOnce(ServerConfig) -> ServerConfig) -> Server {
    let id = Identity::self_signed(&["localhost"]).unwrap();
    start_at("127.0.0.1:0".parse().unwrap(), id, service, cfg)
}

/// A server at `addr` with `identity` (replicas share one certificate).
pub fn start_at(
    addr: std::net::SocketAddr,
    identity: Identity,
    service: Arc<Ticker>,
    cfg: impl FnOnce(ServerConfig) -> ServerConfig,
) -> Server {
    Server::bind(addr, cfg(ServerConfig::new(identity)), service).unwrap()
}

pub fn client(server: &Server) -> Client {
    Client::new(ClientConfig::new(Trust::Pinned(server.fingerprint()))).unwrap()
}

pub fn req(max_tokens: u32) -> InferenceRequest {
    InferenceRequest::new("ticker", Prompt::TokenIds(vec![1, 2, 3, 4]), max_tokens)
}

pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}
