//! Request to first token across the crates, on the default model, in one process:
//!
//! | path | what the time covers |
//! |---|---|
//! | `model` (the peer) | prefill of the already tokenized prompt (`Model::forward`) and the first sampled token |
//! | `service` | `EngineService::submit` of the chat messages: chat template, tokenizer, engine queue and batch, prefill, first token, detokenizer, up to the first text `Delta` |
//! | `http1` | the same through the gateway over loopback TCP: new connection, `POST /v1/messages` (streamed), JSON parse, up to the first `content_block_delta` bytes |
//!
//! Prints the median of each and its ratio to `model`: what the layers above the forward pass
//! cost. (claudelink and HTTP/3 first-byte latency are in claudelink-proto's own bench.)
//!
//! `cargo bench --bench first_token` (30 rounds after one warm-up round per path; `cargo test
//! --all-targets` runs 2 without `--bench`). `ZEROLAYER_THREADS` sets the compute threads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use zerolayer::EngineService;
use zerolayer::claudelink_proto::{
    ChatMessage, ChatRole, InferenceEvent, InferenceRequest, InferenceService, Prompt,
};
use zerolayer::gpu_pipeline::engine::EngineConfig;
use zerolayer::gpu_pipeline::{LogitsWanted, ModelOptions, Sampler, SamplerConfig, SeqStep};
use zerolayer::kv_ring::{KvDtype, KvPool, RingMode};
use zerolayer::token_stream::{self, ChatTemplate};
use zerolayer::zerolayer_gateway::{Gateway, GatewayConfig};

/// The user message of round `i`: each round's differs from its start, so that no path reuses
/// an earlier round's prompt (the engine keeps prefixes; the chat template's own header is the
/// same in every round and may be reused, as in serving).
fn question(i: usize) -> String {
    format!("Question {i}: why is the sky blue? Explain it to a ten-year-old in a few sentences.")
}

/// Round 0 warms up (page faults, caches) and is not counted.
fn rounds_of(rounds: usize) -> impl Iterator<Item = (usize, bool)> {
    (0..=rounds).map(|i| (i, i > 0))
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// The peer: the model alone on the prompt ids, tokenized beforehand.
fn model_first_token(svc: &EngineService, rounds: usize) -> Duration {
    let model = svc.engine().model();
    let tok = svc.engine().tokenizer().expect("the engine's tokenizer");
    let template = ChatTemplate::from_tokenizer(tok).expect("chat template");
    let shape = model.kv_shape(KvDtype::F32);
    let pool = KvPool::new(shape, 1024 * shape.bytes_per_token()).expect("pool");
    let mut logits = Vec::new();
    let mut times = Vec::with_capacity(rounds);
    for (i, counted) in rounds_of(rounds) {
        let user = question(i + 1000);
        let ids = template
            .encode(
                tok,
                &[token_stream::TemplateMessage::new("user", &user)],
                true,
            )
            .expect("prompt")
            .into_vec();
        let mut kv = pool.alloc(ids.len() + 2, RingMode::Strict).expect("ring");
        let t0 = Instant::now();
        model
            .forward(
                &mut [SeqStep {
                    tokens: &ids,
                    kv: &mut kv,
                    logits: LogitsWanted::Last,
                }],
                &mut logits,
            )
            .expect("forward");
        std::hint::black_box(Sampler::new(SamplerConfig::greedy()).sample(&logits, &ids));
        if counted {
            times.push(t0.elapsed());
        }
    }
    median(times)
}

fn request(svc: &EngineService, i: usize) -> InferenceRequest {
    let messages = vec![ChatMessage::new(ChatRole::User, question(i))];
    InferenceRequest::new(svc.model_id(), Prompt::Chat(messages), 8)
}

/// Through the service: submit, then wait for the first text.
async fn service_first_token(svc: &EngineService, rounds: usize) -> Duration {
    let mut times = Vec::with_capacity(rounds);
    for (i, counted) in rounds_of(rounds) {
        let t0 = Instant::now();
        let mut events = svc.submit(request(svc, i + 2000)).expect("submit");
        while let Some(ev) = events.next().await {
            if matches!(&ev, InferenceEvent::Delta { text, .. } if !text.is_empty()) {
                break;
            }
        }
        if counted {
            times.push(t0.elapsed());
        }
        // Dropping the stream cancels the rest of the answer.
    }
    median(times)
}

/// Through the gateway over loopback HTTP/1.1.
async fn http1_first_token(addr: std::net::SocketAddr, model: &str, rounds: usize) -> Duration {
    let mut times = Vec::with_capacity(rounds);
    let mut buf = Vec::with_capacity(16 << 10);
    for (i, counted) in rounds_of(rounds) {
        let body = serde_json::json!({
            "model": model, "max_tokens": 8, "stream": true,
            "messages": [{"role": "user", "content": question(i + 3000)}],
        })
        .to_string();
        let head = format!(
            "POST /v1/messages HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        buf.clear();
        let t0 = Instant::now();
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(head.as_bytes()).await.expect("write");
        s.write_all(body.as_bytes()).await.expect("write");
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).await.expect("read");
            assert!(
                n > 0,
                "the stream ended before a delta: {}",
                String::from_utf8_lossy(&buf)
            );
            buf.extend_from_slice(&chunk[..n]);
            if buf.windows(19).any(|w| w == b"content_block_delta") {
                break;
            }
        }
        if counted {
            times.push(t0.elapsed());
        }
    }
    median(times)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let rounds = if full { 30 } else { 2 };
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the model file is not modified while the bench runs.
    let svc = Arc::new(
        unsafe { EngineService::load(&path, ModelOptions::default(), EngineConfig::default()) }
            .expect("loading the default model"),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let model = model_first_token(&svc, rounds);
    let service = rt.block_on(service_first_token(&svc, rounds));
    let http1 = rt.block_on(async {
        let gateway = Gateway::new(
            svc.clone() as Arc<dyn InferenceService>,
            GatewayConfig::default(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { gateway.serve_tcp(listener, std::future::pending()).await });
        http1_first_token(addr, svc.model_id(), rounds).await
    });
    let threads = svc.engine().model().pool().n_threads();
    println!("first token, default model, {threads} compute threads, median of {rounds} rounds");
    println!("| path | median | / model |");
    println!("|---|---:|---:|");
    for (name, d) in [("model", model), ("service", service), ("http1", http1)] {
        println!(
            "| {name} | {:.2} ms | {:.2}x |",
            d.as_secs_f64() * 1e3,
            d.as_secs_f64() / model.as_secs_f64()
        );
    }
}
