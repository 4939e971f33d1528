//! Embedding the tokenizer alone: text to token ids and back with the default model's
//! vocabulary, and the same text under OpenAI's cl100k_base when its rank file is given.
//! `zerolayer tokenize` is the full tool (JSON lines in and out, special tokens).
//!
//! ```text
//! cargo run --release --example tokenize -- "Hello, world!" [path/to/cl100k_base.tiktoken]
//! ```

use token_stream::Tokenizer;

fn main() -> anyhow::Result<()> {
    let text = std::env::args().nth(1).unwrap_or("Hello, world!".into());
    let path = weight_cache::locate_default_model()?;
    // SAFETY: the model file is not modified while this process maps it.
    let gguf = unsafe { weight_cache::Gguf::open(&path) }?;
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    let ids = tokenizer.encode(&text);
    println!("{}: {:?}", path.display(), ids.as_slice());
    // Decoding gives the text back byte for byte.
    assert_eq!(tokenizer.decode(ids.as_slice())?, text);

    if let Some(ranks) = std::env::args().nth(2) {
        let cl100k = Tokenizer::cl100k_base(&std::fs::read_to_string(ranks)?)?;
        println!("cl100k_base: {:?}", cl100k.encode(&text).as_slice());
    }
    Ok(())
}
