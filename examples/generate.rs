//! Embedding the engine's lowest layer: map a GGUF file, load its tokenizer and model, and
//! generate from a chat message, streaming the text as it comes. `zerolayer generate` is the
//! full tool (raw prompts, token ids, sampling flags, scoring, JSON output).
//!
//! ```text
//! cargo run --release --example generate -- "Why is the sky blue?"
//! ```

use std::io::Write as _;
use std::sync::Arc;

use gpu_pipeline::{GenerateOptions, Model, ModelOptions};
use kv_ring::{KvDtype, KvPool, RingMode};
use token_stream::{ChatTemplate, TemplateMessage, Tokenizer};

fn main() -> anyhow::Result<()> {
    let message = std::env::args().nth(1).unwrap_or("Hello!".into());
    let path = weight_cache::locate_default_model()?;
    // SAFETY: the model file is not modified while this process maps it.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(&path) }?);
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    let model = Model::load(gguf, ModelOptions::default())?;

    // The chat template turns messages into the token ids the model was trained on.
    let template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let prompt = template.encode(&tokenizer, &[TemplateMessage::new("user", &message)], true)?;

    // One sequence's KV cache: a ring from a pool sized for it.
    let max_tokens = 128;
    let capacity = prompt.len() + max_tokens;
    let shape = model.kv_shape(KvDtype::F32);
    let pool = KvPool::new(shape, capacity * shape.bytes_per_token())?;
    let mut kv = pool.alloc(capacity, RingMode::Strict)?;

    // Stream whole UTF-8 characters as the tokens complete them.
    let options = GenerateOptions::default().with_max_tokens(max_tokens);
    let mut pending = Vec::new();
    let done = model.generate(&mut kv, &prompt, &options, Some(&tokenizer), &mut |id| {
        pending.extend_from_slice(tokenizer.token_bytes(id).unwrap_or_default());
        let valid = std::str::from_utf8(&pending).map_or_else(|e| e.valid_up_to(), str::len);
        print!("{}", String::from_utf8_lossy(&pending[..valid]));
        let _ = std::io::stdout().flush();
        pending.drain(..valid);
    })?;
    println!(
        "\n[{} tokens; first after {:.0} ms; stop: {}]",
        done.ids.len(),
        done.time_to_first_token.as_secs_f64() * 1e3,
        done.stop_reason
    );
    Ok(())
}
