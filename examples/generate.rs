//! Embedding the engine's lowest layer: map a GGUF file, load its tokenizer and model, and
//! generate from a chat message, streaming the text as it comes. `zerolayer generate` is the
//! full tool (raw prompts, token ids, sampling flags, scoring, JSON output).
//!
//! ```text
//! cargo run --release --example generate -- "Why is the sky blue?"
//! ```

use std::io::Write as _;
use std::sync::Arc;

use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest};
use gpu_pipeline::{Model, ModelOptions};
use token_stream::{ChatTemplate, TemplateMessage, Tokenizer};

fn main() -> anyhow::Result<()> {
    let message = std::env::args().nth(1).unwrap_or("Hello!".into());
    let path = weight_cache::locate_default_model()?;
    // SAFETY: the model file is not modified while this process maps it.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(&path) }?);
    let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf)?);
    let model = Arc::new(Model::load(gguf, ModelOptions::default())?);

    // The chat template turns messages into the token ids the model was trained on.
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let prompt = template.encode(&tokenizer, &[TemplateMessage::new("user", &message)], true)?;

    // The serving engine (continuous batching, KV pool, sampling, stop rules) runs the request;
    // its text arrives in whole characters.
    let engine = Engine::new(model, Some(tokenizer), EngineConfig::default())?;
    let request = GenerationRequest::new(prompt.into_vec(), 128);
    let done = engine.generate(request, &mut |text| {
        print!("{text}");
        let _ = std::io::stdout().flush();
    })?;
    println!(
        "\n[{} tokens; first after {:.0} ms; stop: {}]",
        done.ids.len(),
        done.time_to_first_token.as_secs_f64() * 1e3,
        done.stop_reason
    );
    Ok(())
}
