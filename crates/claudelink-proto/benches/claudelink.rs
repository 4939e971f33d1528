//! claudelink vs HTTP/1.1 + JSON (hyper) on loopback with a trivial service, in the same run.
//!
//! `cargo bench -p zerolayer-claudelink-proto --bench claudelink` prints first-byte latency (p50/p99) on an
//! established connection, reconnect time (0-RTT vs 1-RTT handshake, vs a new TCP connection),
//! and requests/s at 1, 10 and 200 concurrent requests, each with the HTTP/1.1 peer's number and
//! the ratio. HTTP/1.1 has no multiplexing, so at concurrency c it uses c keep-alive connections;
//! claudelink uses c streams on one connection. The HTTP/1.1 peer runs without TLS (plain TCP),
//! which favours it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use claudelink_proto::*;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame as HFrame;

const DELTAS: u32 = 16;

/// Started, `max_tokens` one-token deltas, Finished, all ready at once.
struct Trivial;

impl InferenceService for Trivial {
    fn submit(&self, req: InferenceRequest) -> Result<EventStream, ServiceError> {
        let n = req.max_tokens;
        let mut ev = Vec::with_capacity(n as usize + 2);
        ev.push(InferenceEvent::Started { input_tokens: 4 });
        for i in 0..n {
            ev.push(InferenceEvent::Delta {
                ids: vec![i],
                text: "tok ".into(),
            });
        }
        ev.push(InferenceEvent::Finished {
            stop_reason: StopReason::MaxTokens,
            stop_sequence: None,
            usage: Usage {
                input_tokens: 4,
                output_tokens: n,
            },
        });
        Ok(Box::pin(futures::stream::iter(ev)))
    }
    fn count_tokens(&self, _: &Prompt) -> Result<u32, ServiceError> {
        Ok(4)
    }
    fn models(&self) -> Vec<ModelInfo> {
        vec![]
    }
    fn metrics(&self) -> ServiceMetrics {
        ServiceMetrics::default()
    }
}

fn request() -> InferenceRequest {
    InferenceRequest::new("bench", Prompt::TokenIds(vec![1, 2, 3, 4]), DELTAS)
}

fn event_json(ev: &InferenceEvent) -> serde_json::Value {
    match ev {
        InferenceEvent::Started { input_tokens } => {
            serde_json::json!({"type": "started", "input_tokens": input_tokens})
        }
        InferenceEvent::Delta { ids, text } => {
            serde_json::json!({"type": "delta", "ids": ids, "text": text})
        }
        InferenceEvent::Finished { usage, .. } => {
            serde_json::json!({"type": "finished", "stop_reason": "max_tokens",
            "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}})
        }
        _ => serde_json::json!({"type": "error"}),
    }
}

/// HTTP/1.1 server: POST a JSON request, get newline-delimited JSON events (chunked).
async fn http_server(service: Arc<dyn InferenceService>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            tcp.set_nodelay(true).unwrap();
            let service = service.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let service = service.clone();
                        async move {
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                            let ids: Vec<u32> = v["prompt"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(|x| x.as_u64().unwrap() as u32)
                                .collect();
                            let r = InferenceRequest::new(
                                v["model"].as_str().unwrap(),
                                Prompt::TokenIds(ids),
                                v["max_tokens"].as_u64().unwrap() as u32,
                            );
                            let events = service.submit(r).unwrap();
                            let s = events.map(|e| {
                                let mut line = serde_json::to_vec(&event_json(&e)).unwrap();
                                line.push(b'\n');
                                Ok::<_, Infallible>(HFrame::data(Bytes::from(line)))
                            });
                            Ok::<_, Infallible>(
                                hyper::Response::builder()
                                    .header("content-type", "application/x-ndjson")
                                    .body(StreamBody::new(s))
                                    .unwrap(),
                            )
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

type HttpSender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn http_connect(addr: SocketAddr) -> HttpSender {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

fn http_body() -> Bytes {
    let r = request();
    let Prompt::TokenIds(ids) = &r.prompt else {
        unreachable!()
    };
    Bytes::from(
        serde_json::to_vec(
            &serde_json::json!({"model": r.model, "max_tokens": r.max_tokens, "prompt": ids}),
        )
        .unwrap(),
    )
}

/// Sends one request; returns (first byte latency, whole-response latency).
async fn http_request(sender: &mut HttpSender, body: Bytes) -> (Duration, Duration) {
    let t0 = Instant::now();
    sender.ready().await.unwrap();
    let req = hyper::Request::post("/v1/generate")
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let mut body = resp.into_body();
    let mut first = None;
    let mut lines = 0;
    while let Some(f) = body.frame().await {
        let f = f.unwrap();
        if let Some(d) = f.data_ref() {
            first.get_or_insert_with(|| t0.elapsed());
            lines += d.iter().filter(|b| **b == b'\n').count();
        }
    }
    assert_eq!(lines, DELTAS as usize + 2);
    (first.unwrap(), t0.elapsed())
}

async fn cl_request(conn: &Connection) -> (Duration, Duration) {
    let t0 = Instant::now();
    let mut s = conn.request(&request()).await.unwrap();
    let mut first = None;
    let mut n = 0;
    while let Some(e) = s.next().await {
        e.unwrap();
        first.get_or_insert_with(|| t0.elapsed());
        n += 1;
    }
    assert_eq!(n, DELTAS as usize + 2);
    (first.unwrap(), t0.elapsed())
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn row(name: &str, unit: &str, cl: f64, http: f64, higher_is_better: bool) {
    let ratio = if higher_is_better {
        cl / http
    } else {
        http / cl
    };
    println!("| {name:<44} | {cl:>12.1} | {http:>12.1} | {unit:<6} | {ratio:>6.2}x |");
}

fn main() {
    let threads: usize = std::env::var("BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .unwrap();
    // `cargo test --all-targets` runs this without `--bench`: then a few requests of each kind.
    let full = std::env::args().any(|a| a == "--bench");
    rt.block_on(run(threads, full));
}

async fn run(threads: usize, full: bool) {
    let scaled = |n: usize| if full { n } else { (n / 100).max(2) };
    let service: Arc<dyn InferenceService> = Arc::new(Trivial);
    let id = Identity::self_signed(&["localhost"]).unwrap();
    let server = Server::bind(
        "127.0.0.1:0".parse().unwrap(),
        ServerConfig::new(id).max_concurrent_streams(256),
        service.clone(),
    )
    .unwrap();
    let http_addr = http_server(service).await;
    let client = Client::new(ClientConfig::new(Trust::Pinned(server.fingerprint()))).unwrap();
    let conn = client.connect(server.local_addr()).await.unwrap();
    let mut sender = http_connect(http_addr).await;
    let body = http_body();

    println!(
        "claudelink vs HTTP/1.1+JSON (hyper), loopback, trivial service ({DELTAS} deltas/request), tokio worker threads: {threads}"
    );
    println!(
        "| measurement                                  |   claudelink |  HTTP/1.1+JSON | unit   |  ratio |"
    );
    println!(
        "|----------------------------------------------|-------------:|-------------:|--------|-------:|"
    );

    // Warm-up.
    for _ in 0..scaled(200) {
        cl_request(&conn).await;
        http_request(&mut sender, body.clone()).await;
    }
    // First-byte latency on an established connection, interleaved.
    let n = scaled(3000);
    let (mut cf, mut hf) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        cf.push(cl_request(&conn).await.0);
        hf.push(http_request(&mut sender, body.clone()).await.0);
    }
    row(
        "first byte, established connection, p50",
        "us",
        us(pct(&mut cf, 0.5)),
        us(pct(&mut hf, 0.5)),
        false,
    );
    row(
        "first byte, established connection, p99",
        "us",
        us(pct(&mut cf, 0.99)),
        us(pct(&mut hf, 0.99)),
        false,
    );

    // Reconnect + first byte: 0-RTT vs 1-RTT QUIC handshake; HTTP/1.1 = new TCP connection (no TLS).
    let one_rtt =
        Client::new(ClientConfig::new(Trust::Pinned(server.fingerprint())).zero_rtt(false))
            .unwrap();
    let reps = scaled(200);
    let (mut z, mut f, mut h) = (Vec::new(), Vec::new(), Vec::new());
    let mut accepted = 0;
    for _ in 0..reps {
        let t0 = Instant::now();
        let c = client.connect(server.local_addr()).await.unwrap();
        let mut s = c.request(&request()).await.unwrap();
        s.next().await.unwrap().unwrap();
        z.push(t0.elapsed());
        drop(s);
        if c.zero_rtt_accepted().await == Some(true) {
            accepted += 1;
        }
        c.close();

        let t0 = Instant::now();
        let c = one_rtt.connect(server.local_addr()).await.unwrap();
        let mut s = c.request(&request()).await.unwrap();
        s.next().await.unwrap().unwrap();
        f.push(t0.elapsed());
        drop(s);
        c.close();

        let t0 = Instant::now();
        let mut snd = http_connect(http_addr).await;
        let connected = t0.elapsed();
        let (first_byte, _) = http_request(&mut snd, body.clone()).await;
        h.push(connected + first_byte);
    }
    let (zp, fp, hp) = (
        us(pct(&mut z, 0.5)),
        us(pct(&mut f, 0.5)),
        us(pct(&mut h, 0.5)),
    );
    row("reconnect + first byte, 0-RTT, p50", "us", zp, hp, false);
    row(
        "reconnect + first byte, 1-RTT handshake, p50",
        "us",
        fp,
        hp,
        false,
    );
    println!(
        "  0-RTT accepted on {accepted}/{reps} reconnects; 1-RTT/0-RTT = {:.2}x (HTTP/1.1 column: new TCP connection, no TLS)",
        fp / zp
    );

    // Throughput at 1, 10, 200 concurrent requests.
    for conc in [1usize, 10, 200] {
        let total = scaled(4000).max(conc * if full { 20 } else { 1 });
        let t0 = Instant::now();
        let per = total / conc;
        let tasks: Vec<_> = (0..conc)
            .map(|_| {
                let conn = conn.clone();
                tokio::spawn(async move {
                    for _ in 0..per {
                        cl_request(&conn).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let cl_rps = (per * conc) as f64 / t0.elapsed().as_secs_f64();

        let mut senders = Vec::new();
        for _ in 0..conc {
            senders.push(http_connect(http_addr).await);
        }
        let t0 = Instant::now();
        let tasks: Vec<_> = senders
            .into_iter()
            .map(|mut s| {
                let body = body.clone();
                tokio::spawn(async move {
                    for _ in 0..per {
                        http_request(&mut s, body.clone()).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let h_rps = (per * conc) as f64 / t0.elapsed().as_secs_f64();
        row(
            &format!("requests/s, {conc} concurrent"),
            "req/s",
            cl_rps,
            h_rps,
            true,
        );
    }
    println!("ratio: >1 means claudelink is better (lower latency or more requests/s)");
}
