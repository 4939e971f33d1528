//! Shared helpers for the integration tests: the default model, the reference tokenizers.
#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, OnceLock};

use token_stream::{Tokenizer, base64_encode};
use weight_cache::Gguf;

/// The default model's GGUF (fails with weight-cache's "run scripts/fetch-model" error if absent).
pub fn gguf() -> Arc<Gguf> {
    static G: OnceLock<Arc<Gguf>> = OnceLock::new();
    G.get_or_init(|| {
        let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: test process; nothing modifies the model file while it is mapped.
        Arc::new(unsafe { Gguf::open(&path) }.expect("default model parses"))
    })
    .clone()
}

/// Our SmolLM2 tokenizer, from the GGUF.
pub fn smollm() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_gguf(&gguf()).expect("SmolLM2 vocabulary loads"))
}

/// The SmolLM2 vocabulary as a HF `tokenizer.json` (built from the GGUF metadata, with the
/// `Digits(individual_digits) + ByteLevel` pre-tokenizer SmolLM2's own tokenizer.json has).
pub fn smollm_tokenizer_json() -> String {
    let g = gguf();
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    let merges = g.get_str_array("tokenizer.ggml.merges").unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_owned(), serde_json::Value::from(i)))
        .collect();
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i] == 3)
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges},
    })
    .to_string()
}

/// The HF `tokenizers` reference for SmolLM2, assembled programmatically from the GGUF vocabulary:
/// BPE model + Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=false)] +
/// ByteLevel decoder, control tokens added as special tokens.
pub fn hf_smollm() -> &'static tokenizers::Tokenizer {
    static T: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        use tokenizers::models::bpe::BPE;
        use tokenizers::pre_tokenizers::{
            byte_level::ByteLevel, digits::Digits, sequence::Sequence,
        };
        let g = gguf();
        let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
        let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
        let merges = g.get_str_array("tokenizer.ggml.merges").unwrap();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| ((*t).to_owned(), i as u32))
            .collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| {
                let (a, b) = m.split_once(' ').unwrap();
                (a.to_owned(), b.to_owned())
            })
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .unwrap();
        let mut t = tokenizers::Tokenizer::new(bpe);
        t.with_pre_tokenizer(Some(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        t.with_decoder(Some(ByteLevel::default()));
        let specials: Vec<tokenizers::AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| types[*i] == 3)
            .map(|(_, s)| tokenizers::AddedToken::from(*s, true))
            .collect();
        t.add_special_tokens(&specials);
        t
    })
}

/// A `.tiktoken` rank file rebuilt from `bpe-openai`'s copy of the vocabulary.
fn rank_file(bpe: &bpe_openai::Tokenizer) -> String {
    let mut s = String::new();
    for id in 0..bpe.bpe.num_tokens() {
        s += &base64_encode(bpe.bpe.token_bytes(id as u32));
        s += &format!(" {id}\n");
    }
    s
}

/// Our cl100k_base, loaded from a rank file in tiktoken's format.
pub fn cl100k() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::cl100k_base(&rank_file(bpe_openai::cl100k_base())).unwrap())
}

/// Our o200k_base, loaded from a rank file in tiktoken's format.
pub fn o200k() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::o200k_base(&rank_file(bpe_openai::o200k_base())).unwrap())
}

/// The parity corpus (scripts/make-tokenizer-corpus parity).
pub fn corpus() -> Vec<String> {
    include_str!("../fixtures/parity.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["text"].as_str().unwrap().to_owned()
        })
        .collect()
}

/// Pathological inputs generated in the test (too big to commit), each about `size` bytes.
pub fn pathological(size: usize) -> Vec<String> {
    let units = [
        "a",
        " ",
        "\n",
        "0",
        "😀",
        "中",
        "ab",
        " a",
        "'s",
        "\t ",
        "é",
        "\r\n",
        "!",
        "a\u{301}",
        "<|im_start|>",
    ];
    units.iter().map(|u| u.repeat(size / u.len())).collect()
}

/// llama.cpp's vocabulary suite and chat templates, as `scripts/fetch-vocab-suite` leaves them
/// (`$ZEROLAYER_VOCAB_SUITE` or `~/.cache/zerolayer/llama-vocab-suite-0.3.36`).
pub fn vocab_suite_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("ZEROLAYER_VOCAB_SUITE").map_or_else(
        || {
            let home = std::env::var_os("HOME").expect("HOME is set");
            std::path::Path::new(&home).join(".cache/zerolayer/llama-vocab-suite-0.3.36")
        },
        std::path::PathBuf::from,
    );
    assert!(
        dir.join(".complete").exists(),
        "llama.cpp's vocabulary suite is not at {}: run scripts/fetch-vocab-suite",
        dir.display()
    );
    dir
}
