//! Writes a small llama with the default model's real vocabulary (its `tokenizer.*` metadata:
//! tokens, merges, pre-tokenizer, special ids, chat template) and random weights, about 8 MB: the
//! real-vocabulary case that travels with `scripts/gpu-check` to a GPU machine, where the 98 MB
//! default model does not fit what a call carries. `tests/cuda.rs` runs it there
//! (`ZEROLAYER_REAL_VOCAB_MODEL`) against the CPU, and `zerolayer serve --executor cuda` serves
//! it over HTTP.
//!
//! `cargo run -p zerolayer-gpu-pipeline --example real_vocab_model -- OUT.gguf [default.gguf]`

#[path = "../benches/support/synthetic.rs"]
mod synthetic;

fn main() {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .expect("usage: real_vocab_model OUT.gguf [default.gguf]");
    let src = match args.next() {
        Some(p) => std::path::PathBuf::from(p),
        None => weight_cache::locate_default_model().expect("scripts/fetch-model first"),
    };
    // SAFETY: the model file is not modified while it is mapped.
    let gguf = unsafe { weight_cache::Gguf::open(&src) }.expect("open the vocabulary's model");
    let bytes = synthetic::with_vocabulary(synthetic::real_vocab_dims(&gguf), 5, &gguf);
    std::fs::write(&out, &bytes).expect("write");
    eprintln!(
        "{out}: {} bytes, vocabulary of {}",
        bytes.len(),
        src.display()
    );
}
