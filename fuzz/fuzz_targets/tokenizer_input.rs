//! Fuzz token-stream with arbitrary input: encode (every pre-tokenizer) must not panic and must
//! round-trip; the stream decoder must agree with batch decode; the rank-file and tokenizer.json
//! parsers and `Tokens::from_bytes` must return errors, never panic.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use token_stream::{Pretokenizer, StreamDecoder, Tokenizer, Tokens, base64_encode};

fn tokenizers() -> &'static [Tokenizer] {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let mut ranks = String::new();
        for b in 0..=255u8 {
            ranks += &format!("{} {b}\n", base64_encode(&[b]));
        }
        for (i, t) in ["th", "the", " the", "in", "ing", "  ", "\n\n", "😀", "ab", "aaaa", "aa"].iter().enumerate() {
            ranks += &format!("{} {}\n", base64_encode(t.as_bytes()), 256 + i);
        }
        [Pretokenizer::Gpt2, Pretokenizer::SmolLm, Pretokenizer::Cl100k, Pretokenizer::O200k]
            .into_iter()
            .map(|p| Tokenizer::from_tiktoken(&ranks, p, &[("<|end|>", 300)]).unwrap())
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for t in tokenizers() {
        let ids = t.encode(&text);
        assert_eq!(t.decode(&ids).unwrap(), text);
        let ids = t.encode_with_specials(&text);
        assert_eq!(t.decode(&ids).unwrap(), text);
        let mut dec = StreamDecoder::new(t);
        let mut out = String::new();
        for &id in ids.iter() {
            out += dec.push(id).unwrap().text;
        }
        out += dec.finish();
        assert_eq!(out, text);
    }
    let _ = Tokenizer::from_tiktoken(&text, Pretokenizer::Cl100k, &[]);
    let _ = Tokenizer::from_tokenizer_json(&text);
    let _ = Tokens::from_bytes(data);
    let _ = Tokens::from_bytes_copied(data);
});
