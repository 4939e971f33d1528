//! `zerolayer serve`: the Anthropic Messages / OpenAI Chat Completions gateway on TCP
//! (HTTP/1.1 and HTTP/2) with the chat page at `/`, and, on one UDP port, claudelink plus
//! HTTP/3 (told apart by ALPN).
//!
//! The model is served under the id `--model-id`, else its own name: the file's `general.name`
//! (trimmed; `Smollm2 135M 8k Lc100K Mix1 Ep2` for the default model), else the file name
//! without `.gguf`. `GET /v1/models` lists it; a request naming another model gets 404
//! `not_found_error`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::ValueEnum;
use weight_cache::{CacheConfig, WarmupStrategy, WeightCache};
use zerolayer::EngineService;
use zerolayer::claudelink_proto::{
    ApiKeys, Congestion, Identity, InferenceService, Server, ServerConfig,
};
use zerolayer::gpu_pipeline::engine::EngineConfig;
use zerolayer::zerolayer_gateway::{CHAT_PAGE, Gateway, GatewayConfig, H3_ALPN};

/// Weight-cache warm-up policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Warmup {
    /// No warm-up: pages fault in on first use.
    None,
    /// Touch every weight page at start.
    Full,
    /// Warm from the recorded access profile.
    Deterministic,
    /// Learn from live accesses.
    Adaptive,
}

/// `zerolayer serve`: a GGUF model or a Hugging Face model directory over the Anthropic
/// Messages API (HTTP/1.1, HTTP/2, HTTP/3) and claudelink, with a chat page at `/`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// GGUF model file, or a Hugging Face model directory (config.json, *.safetensors,
    /// tokenizer.json; default: the model `zerolayer pull` fetches).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Id the model is served as, which requests name in `model` (default: the file's
    /// `general.name`, else the file name without extension). Leading and trailing spaces are
    /// dropped.
    #[arg(long, value_parser = parse_model_id)]
    model_id: Option<String>,
    /// TCP address for HTTP/1.1 and HTTP/2.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http_listen: SocketAddr,
    /// UDP address for claudelink and HTTP/3.
    #[arg(long, default_value = "127.0.0.1:8443")]
    quic_listen: SocketAddr,
    /// Accepted API key (repeatable). Without any, the server is open to everyone.
    #[arg(
        long = "api-key",
        env = "ZEROLAYER_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    api_keys: Vec<String>,
    /// PEM certificate chain for QUIC/HTTP/3 and, when given, HTTPS on the TCP listener
    /// (default: a self-signed certificate for QUIC, cleartext TCP).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key matching --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Compute on the model file's mapping as it is: do not re-arrange the weights into the
    /// packed kernels' layout at load (slower decode; for comparisons).
    #[arg(long)]
    no_pack: bool,
    /// Activation precision of the products: `off` quantizes activations to 8 bits (llama.cpp's
    /// precision; ~30% more batched throughput and ~25% faster first tokens than the default),
    /// `ffn-down` splits the MLP down projection's input into an 8-bit part and its residual
    /// where its weights are a 32-element format (closer to fp32; a K-quant down projection is
    /// not split), `all` splits every product (about fp32, ~2x prefill work).
    #[arg(long, value_enum, default_value_t = super::Split::FfnDown)]
    activation_split: super::Split,
    /// Weight-cache warm-up policy.
    #[arg(long, value_enum, default_value_t = Warmup::Deterministic)]
    warmup: Warmup,
    /// Weight access profile: loaded at start for the deterministic warm-up, saved at shutdown
    /// (default: beside the model file, `<model>.profile`).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Resident weight memory budget, e.g. 512M or 2G (default: unlimited). A soft target, enforced
    /// every 5 s: each decode step reads every weight, so while requests run residency returns to
    /// the model's tensor data (96.6 MB for the default model) whatever the budget; it holds
    /// when idle.
    #[arg(long, value_parser = zerolayer::parse_byte_size)]
    weight_budget: Option<u64>,
    /// What runs the forward pass: `cpu`, `cuda` (an NVIDIA GPU; every family and weight
    /// format; slow, and partly verified on hardware: see the gpu-pipeline README) or `auto` (the
    /// GPU where the CUDA executor starts, else the CPU; the log says which).
    #[arg(long, value_enum, default_value_t = super::generate::ExecutorKind::Cpu)]
    executor: super::generate::ExecutorKind,
    /// With --executor cuda or auto: device bytes for the weights, e.g. 2G; the layers that do
    /// not fit stream from host memory every step (default: all resident).
    #[arg(long, value_parser = zerolayer::parse_byte_size)]
    device_budget: Option<u64>,
    /// Speculative decoding: `off`, or `ngram` (n-gram prompt lookup: drafts taken from each
    /// request's prompt and output, verified in the batched step; the output is unchanged; a
    /// request drafts where its text repeats itself, and fewer tokens the more requests decode
    /// together).
    #[arg(long, value_enum, default_value_t = super::Speculate::Off)]
    speculate: super::Speculate,
    /// With --speculate ngram or --draft-model: most draft tokens verified per step.
    #[arg(long, default_value_t = 8)]
    max_draft: usize,
    /// Speculative decoding with a draft model: a smaller GGUF file (or Hugging Face directory)
    /// with the model's vocabulary proposes each request's drafts (greedily, in its own KV
    /// cache, all drafting requests in one draft pass, fewer tokens the more requests decode
    /// together); the output is the same as without. CPU executor.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// With --draft-model: a draft ends before a token the draft model gives a lower
    /// probability (llama.cpp's --draft-p-min; ours is over the whole vocabulary).
    #[arg(long, default_value_t = 0.1)]
    draft_p_min: f32,
    /// With --draft-model: the draft model proposes every draft. By default n-gram lookup in
    /// the request's own text goes first, and where it confidently proposes 4 tokens or more
    /// they are the draft and the draft model skips that step.
    #[arg(long)]
    no_draft_lookup: bool,
    /// KV-cache budget, e.g. 256M (default: the engine's).
    #[arg(long, value_parser = zerolayer::parse_byte_size)]
    kv_budget: Option<u64>,
    /// KV-cache element type: `f16`, `q8_0` or `q4_0` (llama.cpp's block formats, 53% and 28% of
    /// f16's memory: about 1.9x and 3.6x the tokens in the same --kv-budget; CPU executor) or
    /// `f32`.
    #[arg(long, value_enum, default_value_t = super::KvType::F16)]
    kv_dtype: super::KvType,
    /// Concurrent generation streams (per QUIC connection and in total at the gateway).
    #[arg(long, default_value_t = 256)]
    max_streams: u32,
    /// QUIC congestion controller for what the server sends: cubic (quinn's default), newreno,
    /// or bbr (quinn's experimental BBR, which does not shrink its rate on random loss).
    #[arg(long, default_value = "cubic")]
    quic_congestion: Congestion,
    /// Most sequences in one batched decode step (the rest wait in the queue).
    #[arg(long, default_value_t = 128)]
    max_batch: usize,
    /// Most requests waiting for a slot; beyond them, 529 overloaded at once.
    #[arg(long, default_value_t = 128)]
    max_queue: usize,
    /// Most requests (queued + running) of one API key; keyless requests share one limit.
    /// Beyond it, 529 overloaded at once (default: no limit).
    #[arg(long)]
    max_per_client: Option<usize>,
    /// Largest fraction of the KV cache one API key is admitted up to while others wait.
    #[arg(long, default_value_t = 0.5)]
    max_kv_share_per_client: f64,
    /// Let every API key reuse every other key's cached prompt prefixes (default: each key has
    /// a prefix cache of its own, since a reused prefix answers measurably faster and so tells
    /// one key whether another sent a prompt it guessed). Only for servers whose keys all
    /// belong to one tenant. See docs/SECURITY.md.
    #[arg(long)]
    shared_prefix_cache: bool,
    /// Seconds to let running streams finish after SIGINT/SIGTERM (meanwhile the HTTP port
    /// answers /health with 503 `draining`, /metrics as usual and new generations with 529);
    /// then the gateway's streams end with an `overloaded_error` event.
    #[arg(long, default_value_t = 30)]
    drain_secs: u64,
    /// Key that `GET /metrics` requires (Bearer or x-api-key). Without it, /metrics is open.
    #[arg(long, env = "ZEROLAYER_METRICS_KEY", hide_env_values = true)]
    metrics_key: Option<String>,
    /// Open HTTP (TCP) connections at most; lowered to fit the open-file limit.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Open HTTP (TCP) connections per client IP address at most (0: no limit).
    #[arg(long, default_value_t = 256)]
    max_connections_per_ip: usize,
    /// Answer `GET /` with 404 instead of the chat page.
    #[arg(long)]
    no_chat_page: bool,
    /// Host name a server without API keys answers besides localhost, *.localhost and IP
    /// addresses (repeatable; e.g. the machine's LAN name). Other names get 403 (DNS
    /// rebinding); ignored with API keys.
    #[arg(long = "allow-host", value_name = "NAME")]
    allow_hosts: Vec<String>,
    /// Seconds an HTTP/1.1, HTTP/2 or HTTP/3 connection may stay open with no request (PINGs do
    /// not count).
    #[arg(long, default_value_t = 10)]
    idle_timeout_secs: u64,
    /// With API keys: seconds a connection (any protocol, claudelink included) has to present a
    /// valid key before it is closed; until then it counts against the smaller keyless budget
    /// of the connection limits. See docs/SECURITY.md.
    #[arg(long, default_value_t = 5)]
    auth_timeout_secs: u64,
}

/// Descriptors kept free of HTTP connections: the model file, QUIC sockets, logs, the engine.
const RESERVED_FDS: u64 = 256;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the 1024 default runs out under many
/// idle connections) and returns the resulting limit.
fn raise_open_file_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => {
            tracing::info!(nofile = n, "open-file limit");
            Some(n)
        }
        Err(e) => {
            tracing::warn!("raising the open-file limit: {e}");
            None
        }
    }
}

/// Maps the model, starts the engine and the weight warm-up (which goes on in the background:
/// `/health` answers 503 until a `full` or `deterministic` warm-up is done).
fn build_service(args: &ServeArgs) -> anyhow::Result<(Arc<EngineService>, PathBuf)> {
    let model = super::model_path(args.model.as_deref())?;
    let t0 = Instant::now();
    let mut engine_cfg = EngineConfig::default()
        .with_max_running(args.max_batch)
        .with_max_queue(args.max_queue)
        .with_max_kv_share_per_client(args.max_kv_share_per_client)
        .with_shared_prefix_cache(args.shared_prefix_cache)
        .with_kv_dtype(args.kv_dtype.into())
        .with_speculation(super::speculation(
            args.speculate,
            args.max_draft,
            args.draft_model.as_deref(),
            args.draft_p_min,
            !args.no_draft_lookup,
            args.threads.unwrap_or(0),
        )?);
    if let Some(n) = args.max_per_client {
        engine_cfg = engine_cfg.with_max_running_per_client(n);
    }
    if let Some(b) = args.kv_budget {
        engine_cfg = engine_cfg.with_kv_budget_bytes(usize::try_from(b)?);
    }
    let options = super::model_options(
        args.threads.unwrap_or(0),
        args.no_pack,
        args.activation_split,
    );
    // If the file is truncated anyway, say which file and offset before SIGBUS ends the process.
    if let Err(e) = weight_cache::install_sigbus_handler() {
        tracing::warn!("no SIGBUS handler: {e}");
    }
    // SAFETY: the model file is not modified while the server runs (if it is, /health turns
    // 503 within a second, and a read past a truncation dies of SIGBUS naming the file).
    let executor = super::generate::executor_choice(args.executor, args.device_budget)?;
    let mut svc = unsafe { EngineService::load_on(&model, options, engine_cfg, executor) }
        .with_context(|| format!("loading {}", model.display()))?;
    if let Some(id) = &args.model_id {
        svc = svc.with_model_id(id.as_str());
    }
    let budget = args.weight_budget.map(usize::try_from).transpose()?;
    // `--profile`, else beside the model file.
    let profile = (args.profile.clone()).unwrap_or_else(|| model.with_extension("profile"));
    // The weight cache (access profile, warm-up) works over GGUF files; a Hugging Face
    // directory is served from its safetensors mappings without one.
    let Some(gguf) = svc.engine().model().gguf().cloned() else {
        tracing::info!(model = %model.display(), model_id = svc.model_id(), load_ms = t0.elapsed().as_millis() as u64,
            "model mapped (safetensors: no weight cache or warm-up), engine started");
        return Ok((Arc::new(svc), profile));
    };
    let cache = WeightCache::new(gguf, CacheConfig::default().budget_bytes(budget))?;
    if let Some(b) = budget.filter(|&b| b < cache.tensor_data_bytes()) {
        tracing::warn!(
            budget = b,
            tensor_data = cache.tensor_data_bytes(),
            "--weight-budget is below the weights every decode step reads: it holds when idle only"
        );
    }
    if profile.exists()
        && let Err(e) = cache.load_profile(&profile)
    {
        tracing::warn!(profile = %profile.display(), "ignoring the access profile: {e}");
    }
    let strategy = match args.warmup {
        Warmup::None => WarmupStrategy::None,
        Warmup::Full => WarmupStrategy::Full,
        Warmup::Deterministic => WarmupStrategy::deterministic(),
        Warmup::Adaptive => WarmupStrategy::Adaptive {
            fraction: weight_cache::DEFAULT_WARM_FRACTION,
            interval: Duration::from_secs(10),
        },
    };
    tracing::info!(model = %model.display(), model_id = svc.model_id(), load_ms = t0.elapsed().as_millis() as u64,
        threads = ?args.threads, warmup = ?args.warmup, "model mapped, engine started");
    Ok((Arc::new(svc.with_warmup(cache, strategy)), profile))
}

/// Runs the server until SIGINT or SIGTERM, then drains it.
pub(crate) fn main(args: ServeArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve(args))
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let nofile = raise_open_file_limit();
    let (engine, profile) = build_service(&args)?;
    let budget_every = args.weight_budget.map(|_| Duration::from_secs(5));
    EngineService::watch_weights(&engine, budget_every)?;
    let service: Arc<dyn InferenceService> = engine.clone();

    let identity = match (&args.tls_cert, &args.tls_key) {
        (Some(c), Some(k)) => {
            Identity::from_pem_files(c, k).context("loading --tls-cert/--tls-key")?
        }
        _ => {
            Identity::self_signed(&["localhost"]).context("generating a self-signed certificate")?
        }
    };
    let fingerprint = identity.fingerprint();
    let tcp_tls = match args.tls_cert {
        Some(_) => Some(
            identity
                .tcp_server_config()
                .context("TLS for the TCP listener")?,
        ),
        None => None,
    };
    if args.tls_cert.is_none() {
        println!("self-signed certificate, SHA-256 fingerprint {fingerprint}");
    }

    let config = GatewayConfig::default()
        .api_keys(args.api_keys.iter().map(|k| k.trim().to_owned()))
        .h3_port(Some(args.quic_listen.port()))
        .max_concurrent_requests(args.max_streams as usize)
        .metrics_key(args.metrics_key.clone())
        .max_connections(max_connections(args.max_connections, nofile))
        .max_connections_per_ip(args.max_connections_per_ip)
        .index_page((!args.no_chat_page).then_some(CHAT_PAGE))
        .allowed_hosts(args.allow_hosts.iter().map(|h| h.trim().to_owned()))
        .idle_timeout(Duration::from_secs(args.idle_timeout_secs.max(1)))
        .auth_timeout(Duration::from_secs(args.auth_timeout_secs.max(1)));
    let gateway = Gateway::new(service.clone(), config);

    let quic_config = ServerConfig::new(identity)
        .api_keys(ApiKeys::new(
            args.api_keys.iter().map(|k| k.trim().to_owned()),
        ))
        .max_concurrent_streams(args.max_streams)
        .auth_timeout(Duration::from_secs(args.auth_timeout_secs.max(1)))
        .congestion(args.quic_congestion)
        .alpn_handler(H3_ALPN, Arc::new(gateway.h3_handler()));
    // claudelink's streams count in the gateway's in-flight gauge (and the drain waits on them).
    let quic = Server::bind(
        args.quic_listen,
        quic_config,
        gateway.count_in_flight(service.clone()),
    )
    .with_context(|| format!("binding UDP {}", args.quic_listen))?;
    let listener = tokio::net::TcpListener::bind(args.http_listen)
        .await
        .with_context(|| format!("binding TCP {}", args.http_listen))?;
    let http_addr = listener.local_addr()?;
    let quic_addr = quic.local_addr();
    let scheme = if tcp_tls.is_some() { "https" } else { "http" };
    tracing::info!(
        "HTTP/1.1 + HTTP/2: {scheme}://{http_addr}/v1/messages, /v1/chat/completions, /health, /metrics"
    );
    if !args.no_chat_page {
        tracing::info!("chat page: {scheme}://{http_addr}/");
    }
    tracing::info!(
        "claudelink + HTTP/3: udp {quic_addr} (ALPN claudelink/2 and h3; Alt-Svc advertised)"
    );
    if args.api_keys.is_empty() {
        tracing::warn!(
            "no --api-key / ZEROLAYER_API_KEYS: every request is accepted (JSON bodies, naming \
             localhost, an IP address or an --allow-host name)"
        );
    }
    let shutdown = ShutdownSignal::install()?;
    // Machine-readable line for scripts (scripts/test-clients waits for /health instead).
    println!("listening http={http_addr} quic={quic_addr}");

    let drain = gateway.clone();
    let (stop_tcp, stopped) = tokio::sync::oneshot::channel::<()>();
    let http = tokio::spawn({
        let gateway = gateway.clone();
        async move {
            let stop = async {
                let _ = stopped.await;
            };
            match tcp_tls {
                Some(tls) => gateway.serve_tcp_tls(listener, tls, stop).await,
                None => gateway.serve_tcp(listener, stop).await,
            }
        }
    });
    let started = Instant::now();
    tokio::spawn({
        let service = service.clone();
        async move {
            while !service.ready() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tracing::info!(
                after_ms = started.elapsed().as_millis() as u64,
                "ready: /health answers 200"
            );
        }
    });

    shutdown.recv().await;
    tracing::info!(
        in_flight = drain.in_flight(),
        "shutting down: draining streams"
    );
    drain.start_draining();
    quic.start_draining();
    let deadline = Instant::now() + Duration::from_secs(args.drain_secs);
    while drain.in_flight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The TCP listener stays open through the drain: /health says `draining`, /metrics can be
    // scraped, new generations get 529 and HTTP/1.1 connections close after each response.
    let _ = stop_tcp.send(());
    if drain.in_flight() > 0 {
        // Streams still running at the deadline end with an error event, not a cut: the
        // gateway's with an `overloaded_error` event, claudelink's with ERROR `shutting_down`.
        tracing::warn!(
            in_flight = drain.in_flight(),
            "drain deadline: ending the remaining streams"
        );
        drain.abort_streams();
    }
    quic.abort_streams();
    let grace = deadline.max(Instant::now()) + Duration::from_secs(2);
    let _ = tokio::time::timeout(grace.saturating_duration_since(Instant::now()), http).await;
    quic.shutdown().await;
    // The access profile recorded while serving drives the next start's deterministic warm-up.
    if let Some(cache) = engine.weight_cache().filter(|c| c.stats().touches > 0) {
        match cache.save_profile(&profile) {
            Ok(()) => tracing::info!(profile = %profile.display(), "access profile saved"),
            Err(e) => {
                tracing::warn!(profile = %profile.display(), "saving the access profile: {e}")
            }
        }
    }
    tracing::info!(left = drain.in_flight(), "stopped");
    Ok(())
}

/// `--model-id`: trimmed, not empty.
fn parse_model_id(s: &str) -> Result<String, String> {
    let id = s.trim();
    if id.is_empty() {
        return Err("the model id must not be empty".into());
    }
    Ok(id.to_string())
}

/// `--max-connections`, lowered to leave [`RESERVED_FDS`] of the open-file limit free.
fn max_connections(wanted: usize, nofile: Option<u64>) -> usize {
    let fit = nofile.map_or(u64::MAX, |n| n.saturating_sub(RESERVED_FDS).max(16));
    let n = wanted.min(usize::try_from(fit).unwrap_or(usize::MAX));
    if n < wanted {
        tracing::warn!(
            max_connections = n,
            "--max-connections lowered to fit the open-file limit"
        );
    }
    n
}

/// SIGINT and SIGTERM, caught from its creation on: made before the server announces its
/// address, so a signal sent right after (a test, an orchestrator) starts the drain instead of
/// killing the process with the default action.
struct ShutdownSignal {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    /// Installs the handlers.
    fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves on SIGINT or SIGTERM.
    async fn recv(mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `ServeArgs` as the top of a command line.
    #[derive(Debug, Parser)]
    struct Cmd {
        #[command(flatten)]
        args: ServeArgs,
    }

    impl ServeArgs {
        fn try_parse_from<const N: usize>(argv: [&str; N]) -> Result<Self, clap::Error> {
            Cmd::try_parse_from(argv).map(|c| c.args)
        }
    }

    #[test]
    fn model_id_defaults_to_none_so_the_file_names_the_model() {
        let args = ServeArgs::try_parse_from(["server"]).unwrap();
        assert_eq!(args.model_id, None);
    }

    #[test]
    fn model_id_is_taken_trimmed_with_inner_spaces() {
        let args = ServeArgs::try_parse_from(["server", "--model-id", " My Model 7B "]).unwrap();
        assert_eq!(args.model_id.as_deref(), Some("My Model 7B"));
        let args = ServeArgs::try_parse_from(["server", "--model-id=smollm2"]).unwrap();
        assert_eq!(args.model_id.as_deref(), Some("smollm2"));
    }

    #[test]
    fn a_blank_model_id_is_refused() {
        for blank in ["", "   "] {
            let e = ServeArgs::try_parse_from(["server", "--model-id", blank]).unwrap_err();
            assert!(e.to_string().contains("must not be empty"), "{e}");
        }
    }
}
