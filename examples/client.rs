//! Streams one answer over claudelink (QUIC) to stdout.
//!
//! ```text
//! cargo run --release --example server            # prints the certificate fingerprint
//! cargo run --release --example client -- --fingerprint AB:CD:... "Why is the sky blue?"
//! ```
//!
//! Without `--model` it asks the server's HTTP port (`--http`) which model it serves.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

#[path = "common/served_model.rs"]
mod served_model;
use zerolayer::claudelink_proto::futures::StreamExt as _;
use zerolayer::claudelink_proto::{
    CertFingerprint, ChatMessage, ChatRole, Client, ClientConfig, InferenceEvent, InferenceRequest,
    Prompt, SamplingParams, Trust,
};

/// Ask a zerolayer server a question over claudelink and stream the answer.
#[derive(Debug, Parser)]
#[command(about)]
struct ClientArgs {
    /// The question.
    prompt: String,
    /// The server's claudelink (UDP) address.
    #[arg(long, default_value = "127.0.0.1:8443")]
    server: SocketAddr,
    /// SHA-256 fingerprint of a self-signed server certificate (as the server prints it).
    #[arg(long, conflicts_with = "ca")]
    fingerprint: Option<CertFingerprint>,
    /// PEM file of the CA (or certificate) to trust instead of a fingerprint.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// TLS server name.
    #[arg(long, default_value = "localhost")]
    server_name: String,
    /// Model id (the server refuses models it does not serve with `not_found`; default: the one
    /// the server's `GET /v1/models` on `--http` lists).
    #[arg(long)]
    model: Option<String>,
    /// The server's HTTP (TCP) address, asked for the served model when `--model` is not given.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Sampling temperature (default: greedy).
    #[arg(long)]
    temperature: Option<f32>,
    /// API key, sent in the connection's AUTH frame (needed when the server runs with keys).
    #[arg(long, env = "ZEROLAYER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = ClientArgs::parse();
    let trust = match (&args.fingerprint, &args.ca) {
        (Some(fp), _) => Trust::Pinned(*fp),
        (None, Some(ca)) => Trust::pem_file(ca).context("reading --ca")?,
        (None, None) => anyhow::bail!("pass --fingerprint (printed by the server) or --ca"),
    };
    let mut config = ClientConfig::new(trust).server_name(args.server_name.clone());
    if let Some(key) = &args.api_key {
        config = config.api_key(key.as_str());
    }
    let model = match args.model {
        Some(m) => m,
        None => served_model::served_model(args.http, args.api_key.as_deref()).await?,
    };
    let client = Client::new(config)?;
    let conn = client
        .connect(args.server)
        .await
        .with_context(|| format!("connecting to {}", args.server))?;

    let mut turns = Vec::new();
    if let Some(system) = args.system {
        turns.push(ChatMessage::new(ChatRole::System, system));
    }
    turns.push(ChatMessage::new(ChatRole::User, args.prompt));
    let mut request = InferenceRequest::new(model, Prompt::Chat(turns), args.max_tokens);
    let mut sampling = SamplingParams::default();
    sampling.temperature = args.temperature;
    request.sampling = sampling;

    let mut events = conn.request(&request).await?;
    let mut out = std::io::stdout().lock();
    while let Some(event) = events.next().await {
        match event? {
            InferenceEvent::Delta { text, .. } => {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            InferenceEvent::Finished {
                stop_reason, usage, ..
            } => {
                writeln!(out)?;
                eprintln!(
                    "[{}; {} prompt tokens, {} generated]",
                    stop_reason.as_str(),
                    usage.input_tokens,
                    usage.output_tokens
                );
            }
            InferenceEvent::Error { code, message } => {
                anyhow::bail!("server error {code:?}: {message}")
            }
            _ => {}
        }
    }
    conn.close();
    Ok(())
}
