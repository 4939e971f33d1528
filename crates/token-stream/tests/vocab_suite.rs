//! llama.cpp's own tokenizer test suite: every `ggml-vocab-*.gguf` of llama.cpp's
//! `models/` folder (fetched by `scripts/fetch-vocab-suite`), every case of its `.inp` file, ids
//! equal to llama.cpp's (`.out` as shipped, or, for the vocabularies llama.cpp ships without
//! one, the ids llama-cpp-python 0.3.36 gives, committed by
//! `scripts/fixtures/token-stream-vocab-suite.py`), plus the first texts of the parity corpus.
//!
//! The cases are tokenized as llama.cpp's `test-tokenizer-0` does: no BOS/EOS added, special
//! tokens not parsed (our [`Tokenizer::encode`]).

mod common;

use std::path::{Path, PathBuf};

use token_stream::Tokenizer;
use weight_cache::Gguf;

const SEP: &str = "\n__ggml_vocab_test__\n";
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/vocab-suite");

fn suite_dir() -> PathBuf {
    common::vocab_suite_dir()
}

/// The `.inp` format: cases separated by `SEP` (as `test-tokenizer-0.cpp` reads it).
fn read_cases(text: &str) -> Vec<&str> {
    let mut cases = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        match rest.find(SEP) {
            Some(i) => {
                cases.push(&rest[..i]);
                rest = &rest[i + SEP.len()..];
            }
            None => {
                cases.push(rest);
                break;
            }
        }
    }
    cases
}

fn read_ids(text: &str) -> Vec<Vec<u32>> {
    text.lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("an id"))
                .collect()
        })
        .collect()
}

fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(Path::new(FIXTURES).join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Loads `ggml-vocab-<name>.gguf` and checks every case; returns the failures, described.
fn check_vocab(name: &str) {
    let suite = suite_dir();
    let manifest = manifest();
    let entry = &manifest["vocabs"][name];
    assert!(entry.is_object(), "{name} is not in the manifest");
    let path = suite.join(format!("ggml-vocab-{name}.gguf"));
    // SAFETY: test process; nothing modifies the suite's files while they are mapped.
    let gguf = unsafe { Gguf::open(&path) }.unwrap_or_else(|e| panic!("{name}: {e}"));
    let tok = Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));

    let inp = std::fs::read_to_string(suite.join(entry["cases"].as_str().unwrap())).unwrap();
    let out_name = entry["out"].as_str().unwrap();
    let out_path = if out_name.starts_with("ggml-vocab-") {
        suite.join(out_name)
    } else {
        Path::new(FIXTURES).join(out_name)
    };
    let cases = read_cases(&inp);
    let want = read_ids(&std::fs::read_to_string(out_path).unwrap());
    assert!(want.len() >= cases.len(), "{name}: fewer ids than cases");
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let got = tok.encode(case);
        if got.as_slice() != want[i].as_slice() {
            failures.push(format!(
                "case {i} {case:?}:\n   ours  {:?}\n   llama {:?}",
                got.as_slice(),
                want[i]
            ));
        }
    }

    let parity =
        std::fs::read_to_string(Path::new(FIXTURES).join(entry["parity"].as_str().unwrap()))
            .unwrap();
    let want = read_ids(&parity);
    let corpus = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/parity.jsonl"
    ))
    .unwrap();
    for (i, (line, want)) in corpus.lines().zip(&want).enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = v["text"].as_str().unwrap();
        let got = tok.encode(text);
        if got.as_slice() != want.as_slice() {
            failures.push(format!(
                "parity text {i} {text:?}:\n   ours  {:?}\n   llama {:?}",
                got.as_slice(),
                want
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len() + want.len(),
        failures
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

macro_rules! vocab_tests {
    ($($test:ident => $name:literal,)*) => {
        $(
            #[test]
            fn $test() {
                check_vocab($name);
            }
        )*

        /// Every vocabulary of the suite has a test above (a new file in a later llama.cpp
        /// release must not go unchecked).
        #[test]
        fn every_vocabulary_of_the_suite_is_tested() {
            let tested = [$($name),*];
            let manifest = manifest();
            for name in manifest["vocabs"].as_object().unwrap().keys() {
                assert!(tested.contains(&name.as_str()), "{name} has no test");
            }
        }
    };
}

vocab_tests! {
    aquila => "aquila",
    baichuan => "baichuan",
    bert_bge => "bert-bge",
    command_r => "command-r",
    deepseek_coder => "deepseek-coder",
    deepseek_llm => "deepseek-llm",
    falcon => "falcon",
    gemma_4 => "gemma-4",
    gpt_2 => "gpt-2",
    gpt_neox => "gpt-neox",
    llama_bpe => "llama-bpe",
    llama_spm => "llama-spm",
    mpt => "mpt",
    nomic_bert_moe => "nomic-bert-moe",
    phi_3 => "phi-3",
    qwen2 => "qwen2",
    qwen35 => "qwen35",
    refact => "refact",
    starcoder => "starcoder",
}

fn load_suite_vocab(name: &str) -> Tokenizer {
    let path = suite_dir().join(format!("ggml-vocab-{name}.gguf"));
    // SAFETY: test process; nothing modifies the suite's files while they are mapped.
    let gguf = unsafe { Gguf::open(&path) }.unwrap_or_else(|e| panic!("{name}: {e}"));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Which vocabularies put BOS before a prompt, as llama.cpp decides (`llama_vocab::load`): the
/// file's `tokenizer.ggml.add_bos_token` when it has one (deepseek-llm, command-r: true), else
/// the model's default, which for BPE is false except for the Llama 3 family's pre-tokenizer
/// (llama-bpe has no key and adds BOS); Gemma 4 always adds it.
#[test]
fn bpe_vocabularies_add_bos_where_llama_cpp_does() {
    for (name, add_bos) in [
        ("llama-bpe", true),
        ("deepseek-llm", true),
        ("command-r", true),
        ("gemma-4", true),
        ("llama-spm", true),
        ("qwen2", false),
        ("gpt-2", false),
        ("starcoder", false),
    ] {
        let tok = load_suite_vocab(name);
        assert_eq!(tok.add_bos(), add_bos, "{name}");
        let ids = tok.encode_for_model("Hello world");
        assert_eq!(
            ids.as_slice().first() == tok.bos_id().as_ref(),
            add_bos,
            "{name}: {:?}",
            ids.as_slice()
        );
    }
}

/// llama.cpp makes every token named like an end-of-generation token a control token at load
/// (and warns). Qwen2's `</s>` (id 128247) is a normal BPE token in the file: with special
/// parsing, `</s>` in text is that one token, as in llama.cpp, where it was `</`, `s`, `>`;
/// plain text is unchanged, and it ends generation. DeepSeek-Coder's FIM tokens are
/// user-defined in the file and become control tokens too (the file gives no FIM ids):
/// plain text no longer cuts them out, as llama.cpp's tokenizer does not. Gemma 4's `</s>`
/// stays a normal token.
#[test]
fn tokens_named_like_llama_cpp_control_tokens_are_control_tokens() {
    for name in ["qwen2", "qwen35"] {
        let tok = load_suite_vocab(name);
        let end = tok.special_id("</s>").expect("</s> is a special token");
        assert_eq!(end, 128247, "{name}");
        let (a, b) = (tok.encode("a")[0], tok.encode("b")[0]);
        assert_eq!(
            tok.encode_with_specials("a</s>b").as_slice(),
            [a, end, b],
            "{name}"
        );
        assert_eq!(
            tok.encode("</s>").len(),
            3,
            "{name}: plain text keeps three tokens"
        );
        assert!(tok.is_eog(end), "{name}");
    }
    // Gemma 4 (it has `<|tool_response>`): llama.cpp makes `</s>` a normal token that ends
    // nothing.
    let gemma = load_suite_vocab("gemma-4");
    assert_eq!(gemma.special_id("</s>"), None);
    let ids = gemma.encode_with_specials("</s>");
    assert!(
        ids.iter().all(|&id| !gemma.is_eog(id)),
        "{:?}",
        ids.as_slice()
    );
    let coder = load_suite_vocab("deepseek-coder");
    let begin = coder
        .special_id("<\u{ff5c}fim\u{2581}begin\u{ff5c}>")
        .unwrap();
    let text = "x<\u{ff5c}fim\u{2581}begin\u{ff5c}>y";
    assert!(coder.encode_with_specials(text).contains(&begin));
    assert!(!coder.encode(text).contains(&begin));
}

/// With special parsing on, llama.cpp's expectations (`.out`, made without it) still hold
/// for every case of the suite that holds no special-token text: the overrides change
/// nothing else.
#[test]
fn special_parsing_changes_no_case_without_special_text() {
    let manifest = manifest();
    for (name, entry) in manifest["vocabs"].as_object().unwrap() {
        let tok = load_suite_vocab(name);
        let suite = suite_dir();
        let inp = std::fs::read_to_string(suite.join(entry["cases"].as_str().unwrap())).unwrap();
        for case in read_cases(&inp) {
            assert_eq!(
                tok.encode_with_specials(case).as_slice(),
                tok.encode(case).as_slice(),
                "{name}: {case:?}"
            );
        }
    }
}
