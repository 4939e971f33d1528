//! Load generator for the serving benchmark (`scripts/bench-serving`): a fixed number of
//! concurrent clients send chat requests for a fixed time over claudelink (one connection pool,
//! many streams), HTTP/3 (a few QUIC connections), HTTP/2 over TLS (a few TCP connections, many
//! streams) or HTTP/1.1 (a keep-alive connection pool, cleartext or over TLS), against
//! zerolayer's server or any server speaking the Anthropic Messages or OpenAI Chat Completions
//! API with streaming.
//!
//! `--connect-probe N` measures reconnects instead: N times in a row, a new connection and one
//! request, timed from the start of the connection to the first response byte (claudelink: the
//! `Started` event; HTTP: the response head).
//!
//! ```text
//! loadgen --transport claudelink --addr 127.0.0.1:8443 --fingerprint AB:CD:.. \
//!   --concurrency 100 --duration 30 --prompt-file q.txt --max-tokens 32 --records r.jsonl
//! ```
//!
//! Without `--model`, it sends the model the server's `GET /v1/models` lists (asked on `--addr`
//! for http1, on `--models-addr` for the QUIC transports).
//!
//! Per request it records time to first token (first non-empty text), the gaps between
//! successive text deltas, total latency, output tokens and the error kind; at the end it prints one JSON summary on stdout (times in ms,
//! percentiles over successful requests). Loopback use only: bounded in clients and time.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::{Buf as _, Bytes};
use clap::{Parser, ValueEnum};

#[path = "common/served_model.rs"]
mod served_model;
use http_body_util::{BodyExt as _, Full};
use serde_json::{Value, json};
use tokio::sync::{Mutex, Semaphore};
use zerolayer::claudelink_proto::futures::StreamExt as _;
use zerolayer::claudelink_proto::{
    CertFingerprint, ChatMessage, ChatRole, Client, ClientConfig, InferenceEvent, InferenceRequest,
    PinnedVerifier, Pool, PoolConfig, Prompt, Replicas, Trust, error_code_name, quinn, rustls,
};
use zerolayer::zerolayer_gateway::H3_ALPN;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Transport {
    /// claudelink over QUIC (a connection pool, one stream per request).
    Claudelink,
    /// HTTP/3 (h3 over QUIC).
    H3,
    /// HTTP/1.1 with keep-alive connections.
    Http1,
    /// HTTP/1.1 over TLS (HTTPS) with keep-alive connections.
    Https1,
    /// HTTP/2 over TLS (ALPN h2), a few connections carrying many streams.
    H2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Api {
    /// `POST /v1/messages`, `stream: true`.
    Anthropic,
    /// `POST /v1/chat/completions`, `stream: true`.
    Openai,
}

/// Drive a server with concurrent streaming chat requests and report latency percentiles.
#[derive(Debug, Parser)]
#[command(about)]
struct LoadgenArgs {
    #[arg(long, value_enum)]
    transport: Transport,
    /// Server address (UDP for claudelink and h3, TCP for http1, https1 and h2).
    #[arg(long)]
    addr: SocketAddr,
    /// More replicas of the same service (claudelink, repeatable): the pool spreads streams
    /// over `--addr` and these, and moves requests that fail before their first token.
    #[arg(long = "replica")]
    replicas: Vec<SocketAddr>,
    /// SHA-256 fingerprint of the server's certificate (all but http1).
    #[arg(long)]
    fingerprint: Option<CertFingerprint>,
    /// HTTP API (http1, h3).
    #[arg(long, value_enum, default_value_t = Api::Anthropic)]
    api: Api,
    /// Concurrent clients.
    #[arg(long)]
    concurrency: usize,
    /// Seconds during which new requests are started.
    #[arg(long)]
    duration: f64,
    /// QUIC connections (claudelink, h3; default 4), HTTP/2 connections (h2; default 1) or
    /// most HTTP/1.1 connections (http1, https1; default one per client).
    #[arg(long)]
    connections: Option<usize>,
    /// File holding the user message.
    #[arg(long)]
    prompt_file: PathBuf,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Model name sent (default: the first of the server's `GET /v1/models`).
    #[arg(long)]
    model: Option<String>,
    /// HTTP (TCP) address asked for `GET /v1/models` when `--model` is not given (default:
    /// `--addr` with http1; needed with claudelink and h3).
    #[arg(long)]
    models_addr: Option<SocketAddr>,
    /// API key (sent as `x-api-key` and `Authorization: Bearer`; on claudelink, in AUTH).
    #[arg(long)]
    api_key: Option<String>,
    /// Per-request time limit in seconds (beyond it the request counts as `timeout`).
    #[arg(long, default_value_t = 120.0)]
    request_timeout: f64,
    /// Per-request JSON lines written here.
    #[arg(long)]
    records: Option<PathBuf>,
    /// Measure N reconnects instead of load (see the module docs); `--zero-rtt false` for
    /// claudelink without 0-RTT, `--tls-resume false` for HTTPS without session resumption.
    #[arg(long)]
    connect_probe: Option<usize>,
    /// claudelink: resumed connections send their first flight as 0-RTT data.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    zero_rtt: bool,
    /// HTTPS: reconnects resume the TLS session.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    tls_resume: bool,
}

/// Outcome of one request.
#[derive(Debug, Clone, Default)]
struct Record {
    ttft: Option<Duration>,
    /// Gaps between successive non-empty text deltas.
    gaps: Vec<Duration>,
    /// When the last non-empty text arrived (since the request started).
    last_text: Option<Duration>,
    latency: Duration,
    output_tokens: u64,
    error: Option<String>,
    /// claudelink: the replica that served (or last tried) the request.
    replica: Option<SocketAddr>,
    /// For a failure: how long after the last event (or the start) it was reported.
    error_after: Option<Duration>,
    /// Whether the failure came after the first token.
    failed_mid_stream: bool,
}

impl Record {
    /// A non-empty piece of text arrived `at` after the request started.
    fn text(&mut self, at: Duration) {
        match self.last_text {
            None => self.ttft = Some(at),
            Some(last) => self.gaps.push(at.saturating_sub(last)),
        }
        self.last_text = Some(at);
    }
}

static NEXT_CONN: AtomicUsize = AtomicUsize::new(0);

type H1Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
type H2Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;
type H3Sender = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

enum Backend {
    Claudelink(Pool),
    H3(Vec<H3Sender>, quinn::Endpoint),
    Http1 {
        idle: Mutex<Vec<H1Sender>>,
        slots: Semaphore,
        /// HTTPS (https1).
        tls: Option<tokio_rustls::TlsConnector>,
    },
    H2(Vec<H2Sender>),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = LoadgenArgs::parse();
    if args.model.is_none() {
        let addr = match (args.models_addr, args.transport) {
            (Some(a), _) => a,
            (None, Transport::Http1) => args.addr,
            (None, _) => {
                anyhow::bail!("pass --model, or --models-addr (the server's cleartext TCP address)")
            }
        };
        args.model = Some(served_model::served_model(addr, args.api_key.as_deref()).await?);
    }
    let args = Arc::new(args);
    anyhow::ensure!(
        (1..=10_000).contains(&args.concurrency),
        "--concurrency must be 1..=10000"
    );
    anyhow::ensure!(
        args.duration > 0.0 && args.duration <= 3600.0,
        "--duration must be in (0, 3600] seconds"
    );
    let prompt = std::fs::read_to_string(&args.prompt_file)
        .with_context(|| format!("reading {}", args.prompt_file.display()))?;
    let body = Bytes::from(request_json(&args, &prompt).to_string());
    let request = {
        let turn = ChatMessage::new(ChatRole::User, prompt.clone());
        InferenceRequest::new(
            args.model.clone().unwrap_or_default(),
            Prompt::Chat(vec![turn]),
            args.max_tokens,
        )
    };
    if let Some(n) = args.connect_probe {
        let times = probe::reconnects(&args, n, &body, &request).await?;
        println!("{}", probe::summary(&args, &times));
        return Ok(());
    }
    let backend = Arc::new(connect(&args).await?);

    let start = Instant::now();
    let stop_at = start + Duration::from_secs_f64(args.duration);
    let limit = Duration::from_secs_f64(args.request_timeout);
    let mut tasks = Vec::with_capacity(args.concurrency);
    for _ in 0..args.concurrency {
        let (backend, args, body, request) =
            (backend.clone(), args.clone(), body.clone(), request.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while Instant::now() < stop_at {
                let t0 = Instant::now();
                let mut r = Record::default();
                // A request cut by the limit keeps what it measured (its TTFT, if any).
                let fut = one(&backend, &args, &body, &request, t0, &mut r);
                if tokio::time::timeout(limit, fut).await.is_err() {
                    r.error = Some("timeout".into());
                }
                r.latency = t0.elapsed();
                let failed = r.error.is_some();
                out.push(r);
                if failed {
                    // Do not spin on a refusing server.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            out
        }));
    }
    let mut records = Vec::new();
    for t in tasks {
        records.extend(t.await?);
    }
    let elapsed = start.elapsed();
    if let Some(path) = &args.records {
        let mut s = String::new();
        for r in &records {
            let line = json!({
                "ttft_ms": r.ttft.map(ms),
                "max_gap_ms": r.gaps.iter().max().copied().map(ms),
                "latency_ms": ms(r.latency),
                "output_tokens": r.output_tokens,
                "error": r.error,
                "replica": r.replica.map(|a| a.to_string()),
                "error_after_ms": r.error_after.map(ms),
                "mid_stream": r.failed_mid_stream,
            });
            s.push_str(&line.to_string());
            s.push('\n');
        }
        std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{}", summary(&args, &records, elapsed));
    if let Backend::H3(_, endpoint) = &*backend {
        endpoint.close(0u32.into(), b"done");
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn pct(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    (n > 0).then(|| sorted[((p * n as f64).ceil() as usize).clamp(1, n) - 1])
}

fn summary(args: &LoadgenArgs, records: &[Record], elapsed: Duration) -> Value {
    let ok: Vec<&Record> = records.iter().filter(|r| r.error.is_none()).collect();
    let mut errors = serde_json::Map::new();
    for r in records {
        if let Some(e) = &r.error {
            let n = errors.get(e).and_then(Value::as_u64).unwrap_or(0);
            errors.insert(e.clone(), json!(n + 1));
        }
    }
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft.map(ms)).collect();
    let mut lat: Vec<f64> = ok.iter().map(|r| ms(r.latency)).collect();
    let mut gaps: Vec<f64> = ok
        .iter()
        .flat_map(|r| r.gaps.iter().map(|g| ms(*g)))
        .collect();
    ttft.sort_by(f64::total_cmp);
    lat.sort_by(f64::total_cmp);
    gaps.sort_by(f64::total_cmp);
    let secs = elapsed.as_secs_f64();
    let tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let mut by_replica = serde_json::Map::new();
    for r in &ok {
        if let Some(a) = r.replica {
            let n = by_replica
                .get(&a.to_string())
                .and_then(Value::as_u64)
                .unwrap_or(0);
            by_replica.insert(a.to_string(), json!(n + 1));
        }
    }
    json!({
        "transport": format!("{:?}", args.transport).to_lowercase(),
        "api": format!("{:?}", args.api).to_lowercase(),
        "concurrency": args.concurrency,
        "requests": records.len(),
        "ok": ok.len(),
        "errors": errors,
        "ttft_ms": {"p50": pct(&ttft, 0.5), "p99": pct(&ttft, 0.99)},
        "latency_ms": {"p50": pct(&lat, 0.5), "p99": pct(&lat, 0.99)},
        "inter_token_ms": {"p50": pct(&gaps, 0.5), "p99": pct(&gaps, 0.99), "max": gaps.last()},
        "req_per_s": ok.len() as f64 / secs,
        "output_tok_per_s": tokens as f64 / secs,
        "duration_s": secs,
        "ok_by_replica": by_replica,
    })
}

fn request_json(args: &LoadgenArgs, prompt: &str) -> Value {
    let messages = json!([{"role": "user", "content": prompt}]);
    match args.api {
        Api::Anthropic => json!({
            "model": args.model, "max_tokens": args.max_tokens, "stream": true,
            "messages": messages,
        }),
        Api::Openai => json!({
            "model": args.model, "max_tokens": args.max_tokens, "stream": true,
            "temperature": 0.0, "messages": messages,
            "stream_options": {"include_usage": true},
        }),
    }
}

/// TLS 1.3 pinned to the server's certificate, offering `alpn`.
fn rustls_config(fp: CertFingerprint, alpn: &[u8]) -> anyhow::Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedVerifier::new(fp)))
        .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.to_vec()];
    Ok(tls)
}

fn tls_config(fp: CertFingerprint, alpn: &[u8]) -> anyhow::Result<quinn::ClientConfig> {
    let q = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_config(fp, alpn)?)?;
    Ok(quinn::ClientConfig::new(Arc::new(q)))
}

/// An HTTPS connector for the TCP transports (`None` for cleartext http1).
fn tcp_tls(args: &LoadgenArgs) -> anyhow::Result<Option<tokio_rustls::TlsConnector>> {
    let alpn: &[u8] = match args.transport {
        Transport::Https1 => b"http/1.1",
        Transport::H2 => b"h2",
        _ => return Ok(None),
    };
    let fp = args
        .fingerprint
        .context("--fingerprint is required for https1 and h2")?;
    let mut cfg = rustls_config(fp, alpn)?;
    if !args.tls_resume {
        cfg.resumption = rustls::client::Resumption::disabled();
    }
    Ok(Some(tokio_rustls::TlsConnector::from(Arc::new(cfg))))
}

/// A TCP connection to the server, through TLS when `tls` is given.
async fn tcp_connect(
    addr: SocketAddr,
    tls: Option<&tokio_rustls::TlsConnector>,
) -> Result<Box<dyn Io>, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    Ok(match tls {
        None => Box::new(tcp),
        Some(tls) => {
            let name = rustls::pki_types::ServerName::try_from("localhost").expect("valid name");
            Box::new(
                tls.connect(name, tcp)
                    .await
                    .map_err(|e| format!("tls: {e}"))?,
            )
        }
    })
}

/// A byte stream hyper can drive (TCP or TLS over TCP).
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> Io for T {}

async fn h1_handshake(io: Box<dyn Io>) -> Result<H1Sender, String> {
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

async fn h2_handshake(io: Box<dyn Io>) -> Result<H2Sender, String> {
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(io),
    )
    .await
    .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

async fn connect(args: &LoadgenArgs) -> anyhow::Result<Backend> {
    let need_fp = || {
        args.fingerprint
            .context("--fingerprint is required for claudelink and h3")
    };
    Ok(match args.transport {
        Transport::Claudelink => {
            let n = args.connections.unwrap_or(4).max(1);
            let mut config = ClientConfig::new(Trust::Pinned(need_fp()?));
            if let Some(k) = &args.api_key {
                config = config.api_key(k.clone());
            }
            let client = Client::new(config)?;
            let per_conn = args.concurrency.div_ceil(n).max(1);
            let cfg = PoolConfig::default()
                .connections(n, n)
                .target_streams_per_connection(per_conn);
            let mut addrs = vec![args.addr];
            addrs.extend(&args.replicas);
            Backend::Claudelink(Pool::connect_replicas(client, Replicas::Addrs(addrs), cfg).await?)
        }
        Transport::H3 => {
            let any: SocketAddr = if args.addr.is_ipv6() {
                "[::]:0"
            } else {
                "0.0.0.0:0"
            }
            .parse()?;
            let mut endpoint = quinn::Endpoint::client(any)?;
            endpoint.set_default_client_config(tls_config(need_fp()?, H3_ALPN)?);
            let mut senders = Vec::new();
            for _ in 0..args.connections.unwrap_or(4).max(1) {
                let conn = endpoint.connect(args.addr, "localhost")?.await?;
                let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn)).await?;
                tokio::spawn(async move {
                    let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
                });
                senders.push(send);
            }
            Backend::H3(senders, endpoint)
        }
        Transport::Http1 | Transport::Https1 => Backend::Http1 {
            idle: Mutex::new(Vec::new()),
            slots: Semaphore::new(args.connections.unwrap_or(args.concurrency).max(1)),
            tls: tcp_tls(args)?,
        },
        Transport::H2 => {
            let tls = tcp_tls(args)?;
            let mut senders = Vec::new();
            for _ in 0..args.connections.unwrap_or(1).max(1) {
                let io = tcp_connect(args.addr, tls.as_ref())
                    .await
                    .map_err(anyhow::Error::msg)?;
                senders.push(h2_handshake(io).await.map_err(anyhow::Error::msg)?);
            }
            Backend::H2(senders)
        }
    })
}

/// One request into `rec`; `latency` is filled in by the caller.
async fn one(
    backend: &Backend,
    args: &LoadgenArgs,
    body: &Bytes,
    request: &InferenceRequest,
    t0: Instant,
    rec: &mut Record,
) {
    let res = match backend {
        Backend::Claudelink(pool) => claudelink(pool, request, t0, rec).await,
        Backend::H3(senders, _) => {
            // Round-robin over the connections.
            let i = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
            let mut send = senders[i % senders.len()].clone();
            h3_request(&mut send, args, body, t0, rec).await
        }
        Backend::Http1 { idle, slots, tls } => {
            http1(idle, slots, tls.as_ref(), args, body, t0, rec).await
        }
        Backend::H2(senders) => {
            let i = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
            let mut send = senders[i % senders.len()].clone();
            h2_request(&mut send, args, body, t0, rec).await
        }
    };
    if let Err(kind) = res {
        rec.error = Some(kind);
    }
}

async fn claudelink(
    pool: &Pool,
    request: &InferenceRequest,
    t0: Instant,
    rec: &mut Record,
) -> Result<(), String> {
    let mut stream = pool
        .request(request)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let mut last_event = t0.elapsed();
    while let Some(ev) = stream.next().await {
        rec.replica = stream.replicas_tried().last().copied();
        let ev = ev.map_err(|e| {
            rec.error_after = Some(t0.elapsed().saturating_sub(last_event));
            rec.failed_mid_stream = rec.ttft.is_some();
            format!("stream: {e}")
        })?;
        last_event = t0.elapsed();
        match ev {
            InferenceEvent::Delta { text, .. } if !text.is_empty() => rec.text(t0.elapsed()),
            InferenceEvent::Finished { usage, .. } => {
                rec.output_tokens = u64::from(usage.output_tokens);
                return Ok(());
            }
            InferenceEvent::Error { code, .. } => return Err(error_code_name(code).into()),
            _ => {}
        }
    }
    Err("stream ended without finishing".into())
}

fn http_request(args: &LoadgenArgs, authority: &str) -> http::request::Builder {
    let path = match args.api {
        Api::Anthropic => "/v1/messages",
        Api::Openai => "/v1/chat/completions",
    };
    let mut b = http::Request::builder()
        .method("POST")
        .uri(format!(
            "{}{authority}{path}",
            if authority.is_empty() { "" } else { "https://" }
        ))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01");
    if let Some(k) = &args.api_key {
        b = b
            .header("x-api-key", k)
            .header("authorization", format!("Bearer {k}"));
    }
    b
}

fn status_error(status: http::StatusCode) -> String {
    match status.as_u16() {
        529 | 503 => "overloaded".into(),
        429 => "rate_limited".into(),
        s => format!("http_{s}"),
    }
}

/// Incremental SSE reader: feeds bytes, calls back with each event's `data` payload.
#[derive(Default)]
struct Sse {
    buf: Vec<u8>,
    done: bool,
}

impl Sse {
    fn feed(
        &mut self,
        chunk: &[u8],
        api: Api,
        t0: Instant,
        rec: &mut Record,
    ) -> Result<(), String> {
        // CRLF line ends (sse-starlette's default) read as LF: JSON data has no raw CR.
        self.buf.extend(chunk.iter().filter(|&&b| b != b'\r'));
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                let data = data.trim();
                if data == "[DONE]" {
                    self.done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).map_err(|_| "bad_sse_json")?;
                handle_event(&v, api, t0, rec, &mut self.done)?;
            }
        }
        Ok(())
    }
}

fn handle_event(
    v: &Value,
    api: Api,
    t0: Instant,
    rec: &mut Record,
    done: &mut bool,
) -> Result<(), String> {
    if v["type"] == "error" || v.get("error").is_some_and(|e| !e.is_null()) {
        let kind = v["error"]["type"].as_str().unwrap_or("error");
        return Err(kind.trim_end_matches("_error").into());
    }
    let first = |rec: &mut Record| rec.text(t0.elapsed());
    match api {
        Api::Anthropic => match v["type"].as_str() {
            Some("content_block_delta")
                if v["delta"]["text"].as_str().is_some_and(|t| !t.is_empty()) =>
            {
                first(rec)
            }
            Some("message_delta") => {
                rec.output_tokens = v["usage"]["output_tokens"].as_u64().unwrap_or(0);
            }
            Some("message_stop") => *done = true,
            _ => {}
        },
        Api::Openai => {
            let content = &v["choices"][0]["delta"]["content"];
            if content.as_str().is_some_and(|t| !t.is_empty()) {
                first(rec);
                // Servers that send no usage: one chunk per token.
                rec.output_tokens += 1;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                rec.output_tokens = n;
            }
        }
    }
    Ok(())
}

async fn h3_request(
    send: &mut H3Sender,
    args: &LoadgenArgs,
    body: &Bytes,
    t0: Instant,
    rec: &mut Record,
) -> Result<(), String> {
    let req = http_request(args, "localhost")
        .body(())
        .map_err(|e| e.to_string())?;
    let mut stream = send
        .send_request(req)
        .await
        .map_err(|e| format!("h3: {e}"))?;
    stream
        .send_data(body.clone())
        .await
        .map_err(|e| format!("h3: {e}"))?;
    stream.finish().await.map_err(|e| format!("h3: {e}"))?;
    let resp = stream
        .recv_response()
        .await
        .map_err(|e| format!("h3: {e}"))?;
    if resp.status() != http::StatusCode::OK {
        return Err(status_error(resp.status()));
    }
    let mut sse = Sse::default();
    while let Some(mut chunk) = stream.recv_data().await.map_err(|e| format!("h3: {e}"))? {
        while chunk.has_remaining() {
            let c = chunk.chunk();
            let n = c.len();
            sse.feed(c, args.api, t0, rec)?;
            chunk.advance(n);
        }
    }
    if sse.done {
        Ok(())
    } else {
        Err("stream ended without finishing".into())
    }
}

async fn http1(
    idle: &Mutex<Vec<H1Sender>>,
    slots: &Semaphore,
    tls: Option<&tokio_rustls::TlsConnector>,
    args: &LoadgenArgs,
    body: &Bytes,
    t0: Instant,
    rec: &mut Record,
) -> Result<(), String> {
    let _slot = slots.acquire().await.map_err(|e| e.to_string())?;
    let popped = idle.lock().await.pop();
    let mut sender = match popped {
        Some(s) if s.is_ready() => s,
        _ => h1_handshake(tcp_connect(args.addr, tls).await?).await?,
    };
    let req = http_request(args, "")
        .header("host", args.addr.to_string())
        .body(Full::new(body.clone()))
        .map_err(|e| e.to_string())?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("http1: {e}"))?;
    let read = read_sse(resp, args, t0, rec).await;
    // The body was read to its end: the connection can serve the next request.
    if !matches!(&read, Err(e) if e.starts_with("body:")) {
        idle.lock().await.push(sender);
    }
    read
}

async fn h2_request(
    send: &mut H2Sender,
    args: &LoadgenArgs,
    body: &Bytes,
    t0: Instant,
    rec: &mut Record,
) -> Result<(), String> {
    send.ready().await.map_err(|e| format!("h2: {e}"))?;
    let req = http_request(args, "localhost")
        .body(Full::new(body.clone()))
        .map_err(|e| e.to_string())?;
    let resp = send
        .send_request(req)
        .await
        .map_err(|e| format!("h2: {e}"))?;
    read_sse(resp, args, t0, rec).await
}

/// Reads an HTTP response's SSE body into `rec` (errors reading the body start with `body:`).
async fn read_sse(
    resp: http::Response<hyper::body::Incoming>,
    args: &LoadgenArgs,
    t0: Instant,
    rec: &mut Record,
) -> Result<(), String> {
    let status = resp.status();
    let mut body = resp.into_body();
    let mut sse = Sse::default();
    // The body is read to its end even after an error event, so the connection stays usable.
    let mut failed = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        if let Some(data) = frame.data_ref()
            && status == http::StatusCode::OK
            && failed.is_none()
        {
            failed = sse.feed(data, args.api, t0, rec).err();
        }
    }
    if status != http::StatusCode::OK {
        return Err(status_error(status));
    }
    if let Some(e) = failed {
        return Err(e);
    }
    if sse.done {
        Ok(())
    } else {
        Err("stream ended without finishing".into())
    }
}

/// Reconnect cost: the time from starting a connection to the first response byte.
mod probe {
    use super::*;

    /// `n` timed reconnects (after one untimed connection that fetches session tickets).
    pub(super) async fn reconnects(
        args: &LoadgenArgs,
        n: usize,
        body: &Bytes,
        request: &InferenceRequest,
    ) -> anyhow::Result<Vec<Duration>> {
        let mut times = Vec::with_capacity(n);
        match args.transport {
            Transport::Claudelink => {
                let fp = args
                    .fingerprint
                    .context("--fingerprint is required for claudelink")?;
                let mut config = ClientConfig::new(Trust::Pinned(fp)).zero_rtt(args.zero_rtt);
                if let Some(k) = &args.api_key {
                    config = config.api_key(k.clone());
                }
                let client = Client::new(config)?;
                for i in 0..=n {
                    let t0 = Instant::now();
                    let conn = client.connect(args.addr).await?;
                    let mut stream = conn.request(request).await?;
                    let first = stream.next().await.context("no response")??;
                    let took = t0.elapsed();
                    anyhow::ensure!(
                        !matches!(first, InferenceEvent::Error { .. }),
                        "error response: {first:?}"
                    );
                    while let Some(ev) = stream.next().await {
                        if matches!(ev?, InferenceEvent::Finished { .. }) {
                            break;
                        }
                    }
                    conn.close();
                    if i > 0 {
                        times.push(took);
                    }
                }
            }
            Transport::Http1 | Transport::Https1 | Transport::H2 => {
                // One connector for all: with --tls-resume, reconnects resume the session.
                let tls = tcp_tls(args)?;
                for i in 0..=n {
                    let t0 = Instant::now();
                    let io = tcp_connect(args.addr, tls.as_ref())
                        .await
                        .map_err(anyhow::Error::msg)?;
                    let resp = if args.transport == Transport::H2 {
                        let mut send = h2_handshake(io).await.map_err(anyhow::Error::msg)?;
                        let req = http_request(args, "localhost").body(Full::new(body.clone()))?;
                        send.send_request(req).await?
                    } else {
                        let mut send = h1_handshake(io).await.map_err(anyhow::Error::msg)?;
                        let req = http_request(args, "")
                            .header("host", args.addr.to_string())
                            .body(Full::new(body.clone()))?;
                        send.send_request(req).await?
                    };
                    let took = t0.elapsed();
                    anyhow::ensure!(
                        resp.status() == http::StatusCode::OK,
                        "status {}",
                        resp.status()
                    );
                    resp.into_body().collect().await?;
                    if i > 0 {
                        times.push(took);
                    }
                }
            }
            Transport::H3 => {
                anyhow::bail!("--connect-probe measures claudelink, http1, https1 and h2")
            }
        }
        Ok(times)
    }

    pub(super) fn summary(args: &LoadgenArgs, times: &[Duration]) -> Value {
        let mut v: Vec<f64> = times.iter().map(|d| ms(*d)).collect();
        v.sort_by(f64::total_cmp);
        json!({
            "transport": format!("{:?}", args.transport).to_lowercase(),
            "zero_rtt": args.zero_rtt,
            "tls_resume": args.tls_resume,
            "probes": v.len(),
            "first_byte_ms": {"min": v.first(), "p50": pct(&v, 0.5), "p90": pct(&v, 0.9)},
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANTHROPIC: &str = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n\
        event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"\"}}\n\n\
        event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n\
        event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":7}}\n\n\
        event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

    #[test]
    fn sse_events_split_anywhere_give_the_same_record() {
        for cut in 0..ANTHROPIC.len() {
            let (a, b) = ANTHROPIC.as_bytes().split_at(cut);
            let (mut sse, mut rec, t0) = (Sse::default(), Record::default(), Instant::now());
            sse.feed(a, Api::Anthropic, t0, &mut rec).unwrap();
            assert!(!sse.done || cut == ANTHROPIC.len());
            sse.feed(b, Api::Anthropic, t0, &mut rec).unwrap();
            assert!(sse.done, "cut {cut}");
            assert_eq!(rec.output_tokens, 7);
            // The empty first delta is not the first token.
            assert!(rec.ttft.is_some());
        }
    }

    #[test]
    fn crlf_events_read_like_lf_events() {
        let crlf = ANTHROPIC.replace('\n', "\r\n");
        let (mut sse, mut rec) = (Sse::default(), Record::default());
        sse.feed(crlf.as_bytes(), Api::Anthropic, Instant::now(), &mut rec)
            .unwrap();
        assert!(sse.done);
        assert_eq!(rec.output_tokens, 7);
    }

    #[test]
    fn error_events_and_openai_chunks() {
        let (mut sse, mut rec, t0) = (Sse::default(), Record::default(), Instant::now());
        let err = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"busy\"}}\n\n";
        assert_eq!(
            sse.feed(err.as_bytes(), Api::Anthropic, t0, &mut rec),
            Err("overloaded".into())
        );
        let (mut sse, mut rec) = (Sse::default(), Record::default());
        let chunks = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n";
        sse.feed(chunks.as_bytes(), Api::Openai, t0, &mut rec)
            .unwrap();
        assert_eq!(rec.output_tokens, 2);
        assert!(!sse.done);
        let usage =
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":5}}\n\ndata: [DONE]\n\n";
        sse.feed(usage.as_bytes(), Api::Openai, t0, &mut rec)
            .unwrap();
        assert!(sse.done);
        assert_eq!(rec.output_tokens, 5);
        assert_eq!(
            status_error(http::StatusCode::from_u16(529).unwrap()),
            "overloaded"
        );
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(pct(&v, 0.5), Some(50.0));
        assert_eq!(pct(&v, 0.99), Some(99.0));
        assert_eq!(pct(&v[..1], 0.99), Some(1.0));
        assert_eq!(pct(&[], 0.5), None);
    }
}
