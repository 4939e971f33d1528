//! A claudelink client and nothing else: streams one answer from a zerolayer server to stdout.
//! It depends on this crate (and tokio) only, so it builds without any HTTP stack.
//!
//! ```text
//! zerolayer serve                      # prints the certificate fingerprint and the model
//! cargo run -p zerolayer-claudelink-proto --example stream -- \
//!     --fingerprint AB:CD:... --model SmolLM2-135M-Instruct "Why is the sky blue?"
//! ```
//!
//! Options: `--server ADDR` (default 127.0.0.1:8443), `--fingerprint FP` (required),
//! `--model ID` (required), `--max-tokens N` (default 256); the API key, when the server has
//! keys, comes from `ZEROLAYER_API_KEY`.

use std::io::Write as _;
use std::net::SocketAddr;

use claudelink_proto::futures::StreamExt as _;
use claudelink_proto::{
    CertFingerprint, ChatMessage, ChatRole, Client, ClientConfig, InferenceEvent, InferenceRequest,
    Prompt, Trust,
};

type Error = Box<dyn std::error::Error>;

/// The command line: options, then the prompt.
struct Options {
    server: SocketAddr,
    fingerprint: CertFingerprint,
    model: String,
    max_tokens: u32,
    prompt: String,
}

fn parse_args() -> Result<Options, Error> {
    let mut server: SocketAddr = "127.0.0.1:8443".parse()?;
    let (mut fingerprint, mut model, mut max_tokens) = (None, None, 256);
    let mut prompt = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--server" => server = value()?.parse()?,
            "--fingerprint" => fingerprint = Some(value()?.parse::<CertFingerprint>()?),
            "--model" => model = Some(value()?),
            "--max-tokens" => max_tokens = value()?.parse()?,
            _ => prompt.push(arg),
        }
    }
    Ok(Options {
        server,
        fingerprint: fingerprint.ok_or("pass --fingerprint (printed by the server)")?,
        model: model.ok_or("pass --model (the id the server serves)")?,
        max_tokens,
        prompt: prompt.join(" "),
    })
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args = parse_args()?;
    let mut config = ClientConfig::new(Trust::Pinned(args.fingerprint));
    if let Ok(key) = std::env::var("ZEROLAYER_API_KEY") {
        config = config.api_key(key);
    }
    let client = Client::new(config)?;
    let conn = client.connect(args.server).await?;
    let prompt = Prompt::Chat(vec![ChatMessage::new(ChatRole::User, args.prompt)]);
    let request = InferenceRequest::new(args.model, prompt, args.max_tokens);
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
                return Err(format!("server error {code:?}: {message}").into());
            }
            _ => {}
        }
    }
    conn.close();
    Ok(())
}
