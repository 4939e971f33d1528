//! The composition behind `zerolayer serve`, in brief: a model served over the Anthropic
//! Messages / OpenAI Chat Completions gateway on TCP (HTTP/1.1, HTTP/2) and, on one UDP port,
//! claudelink plus HTTP/3 (told apart by ALPN). `zerolayer serve --help` is the full server
//! (warm-up policy, budgets, limits, TLS files, the chat page); this shows how the crates fit.
//!
//! ```text
//! cargo run --release --example server -- --api-key sk-local
//! curl -N http://127.0.0.1:8080/v1/messages -H 'x-api-key: sk-local' \
//!   -H 'content-type: application/json' \
//!   -d '{"model":"Smollm2 135M 8k Lc100K Mix1 Ep2","max_tokens":64,"stream":true,
//!        "messages":[{"role":"user","content":"Hello!"}]}'
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use weight_cache::{CacheConfig, WarmupStrategy, WeightCache};
use zerolayer::EngineService;
use zerolayer::claudelink_proto::{ApiKeys, Identity, InferenceService, Server, ServerConfig};
use zerolayer::gpu_pipeline::ModelOptions;
use zerolayer::gpu_pipeline::engine::EngineConfig;
use zerolayer::zerolayer_gateway::{Gateway, GatewayConfig, H3_ALPN};

/// Serve a GGUF model over HTTP/1.1, HTTP/2, HTTP/3 and claudelink.
#[derive(Debug, Parser)]
struct ServerArgs {
    /// GGUF model file (default: the model `zerolayer pull` fetches).
    #[arg(long)]
    model: Option<PathBuf>,
    /// TCP address for HTTP/1.1 and HTTP/2.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http_listen: SocketAddr,
    /// UDP address for claudelink and HTTP/3.
    #[arg(long, default_value = "127.0.0.1:8443")]
    quic_listen: SocketAddr,
    /// Accepted API key (repeatable; none: open to everyone).
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
}

/// Maps the model, starts the engine, and warms the weights from the recorded access profile.
fn load(model: &std::path::Path) -> anyhow::Result<Arc<EngineService>> {
    // SAFETY: the model file is not modified while the server runs.
    let svc =
        unsafe { EngineService::load(model, ModelOptions::default(), EngineConfig::default()) }
            .with_context(|| format!("loading {}", model.display()))?;
    let Some(gguf) = svc.engine().model().gguf().cloned() else {
        return Ok(Arc::new(svc)); // a Hugging Face directory: no weight cache
    };
    let cache = WeightCache::new(gguf, CacheConfig::default())?;
    let _ = cache.load_profile(model.with_extension("profile")); // none yet: warm in file order
    let svc = Arc::new(svc.with_warmup(cache, WarmupStrategy::deterministic()));
    EngineService::watch_weights(&svc, None)?;
    Ok(svc)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter("info,h3=warn,quinn=warn")
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = ServerArgs::parse();
    let model = match args.model {
        Some(p) => p,
        None => weight_cache::locate_default_model()?,
    };
    let engine = load(&model)?;
    let service: Arc<dyn InferenceService> = engine.clone();

    // HTTP on TCP; the Alt-Svc header advertises HTTP/3 on the QUIC port.
    let gateway = Gateway::new(
        service.clone(),
        GatewayConfig::default()
            .api_keys(args.api_keys.clone())
            .h3_port(Some(args.quic_listen.port())),
    );
    // QUIC: claudelink streams, and HTTP/3 handed to the gateway by ALPN. claudelink's streams
    // count in the gateway's in-flight gauge, so one drain waits for both.
    let identity = Identity::self_signed(&["localhost"])?;
    println!("certificate fingerprint {}", identity.fingerprint());
    let quic = Server::bind(
        args.quic_listen,
        ServerConfig::new(identity)
            .api_keys(ApiKeys::new(args.api_keys.clone()))
            .alpn_handler(H3_ALPN, Arc::new(gateway.h3_handler())),
        gateway.count_in_flight(service),
    )?;
    let listener = tokio::net::TcpListener::bind(args.http_listen).await?;
    println!(
        "listening http={} quic={}",
        listener.local_addr()?,
        quic.local_addr()
    );

    let (stop_tcp, stopped) = tokio::sync::oneshot::channel::<()>();
    let http = tokio::spawn({
        let gateway = gateway.clone();
        async move {
            gateway
                .serve_tcp(listener, async {
                    let _ = stopped.await;
                })
                .await
        }
    });

    // Ctrl-C: refuse new work, give running streams 10 s, then end them with an error event.
    tokio::signal::ctrl_c().await?;
    gateway.start_draining();
    quic.start_draining();
    let _ = stop_tcp.send(());
    let deadline = Instant::now() + Duration::from_secs(10);
    while gateway.in_flight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gateway.abort_streams();
    quic.abort_streams();
    let _ = tokio::time::timeout(Duration::from_secs(2), http).await;
    quic.shutdown().await;
    // The access profile recorded while serving orders the next start's warm-up.
    if let Some(cache) = engine.weight_cache() {
        cache.save_profile(model.with_extension("profile"))?;
    }
    Ok(())
}
