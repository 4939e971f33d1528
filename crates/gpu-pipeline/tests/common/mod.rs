//! Helpers shared by the model-correctness tests (`model_logits.rs`, `quant_models.rs`), the
//! executor tests (`streaming.rs`, `cuda.rs`) and the engine tests on the default model
//! (`engine_real.rs`, `speculation.rs`).
#![allow(dead_code, unreachable_pub)]

use gpu_pipeline::executor::Executor;
use gpu_pipeline::{LogitsWanted, Model, SeqStep};
use kv_ring::{KvDtype, KvPool, KvRing, RingMode};
use serde_json::Value;

/// A fresh KV ring for `cap` tokens of `model`.
pub fn ring(model: &Model, dtype: KvDtype, cap: usize) -> KvRing {
    let shape = model.kv_shape(dtype);
    let pool = KvPool::new(shape, cap * shape.bytes_per_token()).unwrap();
    pool.alloc(cap, RingMode::Strict).unwrap()
}

/// Logits of every position of `ids` (one sequence, fresh cache).
pub fn all_logits(model: &Model, dtype: KvDtype, ids: &[u32]) -> Vec<f32> {
    let mut kv = ring(model, dtype, ids.len());
    let mut out = Vec::new();
    model
        .forward(
            &mut [SeqStep {
                tokens: ids,
                kv: &mut kv,
                logits: LogitsWanted::All,
            }],
            &mut out,
        )
        .unwrap();
    out
}

/// Token ids of a JSON array.
pub fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Index of the largest value (the first one on ties).
pub fn argmax(xs: &[f32]) -> usize {
    xs.iter()
        .enumerate()
        .fold(0, |b, (i, &v)| if v > xs[b] { i } else { b })
}

/// Sum of -log p(chunk[j+1] | chunk[..=j]) over the second half of the window (as llama.cpp's
/// perplexity tool scores it) and the number of scored tokens; `logits` are the window's.
pub fn nll_second_half(logits: &[f32], chunk: &[u32], vocab: usize) -> (f64, usize) {
    let ctx = chunk.len();
    let (mut nll, mut count) = (0f64, 0usize);
    for j in ctx / 2..ctx - 1 {
        nll += gpu_pipeline::token_nll(&logits[j * vocab..(j + 1) * vocab], chunk[j + 1]);
        count += 1;
    }
    (nll, count)
}

/// Logits of every position of `ids` fed in steps of `chunk` tokens through one KV ring (the
/// incremental path: each step attends to the cached K/V of the steps before it).
pub fn chunked_logits(model: &Model, dtype: KvDtype, ids: &[u32], chunk: usize) -> Vec<f32> {
    let mut kv = ring(model, dtype, ids.len());
    let (mut all, mut out) = (Vec::new(), Vec::new());
    for step in ids.chunks(chunk) {
        model
            .forward(
                &mut [SeqStep {
                    tokens: step,
                    kv: &mut kv,
                    logits: LogitsWanted::All,
                }],
                &mut out,
            )
            .unwrap();
        all.extend_from_slice(&out);
    }
    all
}

/// The test models' directory: `$ZEROLAYER_TEST_MODELS`, else `~/.cache/zerolayer/test-models`
/// (where `scripts/make-test-models` writes them).
pub fn test_models_dir() -> std::path::PathBuf {
    std::env::var_os("ZEROLAYER_TEST_MODELS").map_or_else(
        || {
            let home = std::env::var_os("HOME").expect("HOME is set");
            std::path::PathBuf::from(home).join(".cache/zerolayer/test-models")
        },
        std::path::PathBuf::from,
    )
}

/// Maps test model `file` (in [`test_models_dir`]) after checking its sha256 is `sha256`, the
/// file a fixture was made from.
pub fn open_test_model(name: &str, file: &str, sha256: &str) -> std::sync::Arc<weight_cache::Gguf> {
    use sha2::{Digest, Sha256};
    let path = test_models_dir().join(file);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: run scripts/make-test-models to write the test models",
            path.display()
        )
    });
    let sha: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    drop(bytes);
    assert_eq!(
        sha, sha256,
        "{name}: not the file the fixture was made from (another llama.cpp build, or the models \
         changed?); rerun scripts/make-test-models, or regenerate the fixture"
    );
    // SAFETY: the test models are not modified while the tests run.
    std::sync::Arc::new(unsafe { weight_cache::Gguf::open(&path) }.expect("open"))
}

/// Standard base64 (RFC 4648, with padding) to bytes.
pub fn base64_decode(text: &str) -> Vec<u8> {
    fn value(c: u8) -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {:?}", c as char),
        }
    }
    let text = text.as_bytes();
    assert_eq!(text.len() % 4, 0, "base64 length {}", text.len());
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    for quad in text.chunks_exact(4) {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        let bits = quad[..4 - pad]
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &c)| acc | value(c) << (18 - 6 * i));
        out.extend_from_slice(&bits.to_be_bytes()[1..4 - pad]);
    }
    out
}

/// One `#[test]` per fixture model (`$test => "name"` runs `check_model("name")`, attributes
/// such as `#[ignore = ".."]` kept), plus a test that every model of the fixture (`fixture()`
/// in the calling file) has one.
#[allow(unused_macros)]
macro_rules! fixture_tests {
    ($($(#[$attr:meta])* $test:ident => $name:literal,)*) => {
        $(
            #[test]
            $(#[$attr])*
            fn $test() {
                check_model($name);
            }
        )*

        /// Every model of the fixture has a test above.
        #[test]
        fn every_model_of_the_fixture_is_tested() {
            let tested = [$($name),*];
            for name in fixture()["models"].as_object().unwrap().keys() {
                assert!(tested.contains(&name.as_str()), "{name} has no test");
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use fixture_tests;

/// `steps` decode steps of two sequences batched together (step `t` feeds `a` token
/// `(31t + 5) % vocab` and `b` token `(71t + 9) % vocab`), every step's logits appended to `all`.
pub fn decode_pair<E: Executor>(
    exec: &E,
    a: &mut KvRing<E::Kv>,
    b: &mut KvRing<E::Kv>,
    steps: u32,
    all: &mut Vec<f32>,
) {
    let vocab = exec.config().vocab_size as u32;
    let mut out = Vec::new();
    for t in 0..steps {
        let (ta, tb) = ([(t * 31 + 5) % vocab], [(t * 71 + 9) % vocab]);
        exec.forward(
            &mut [
                SeqStep {
                    tokens: &ta,
                    kv: a,
                    logits: LogitsWanted::Last,
                },
                SeqStep {
                    tokens: &tb,
                    kv: b,
                    logits: LogitsWanted::Last,
                },
            ],
            &mut out,
        )
        .unwrap();
        all.extend_from_slice(&out);
    }
}

/// The default model, its tokenizer and chat template, loaded once per test binary.
pub struct Fixture {
    pub model: std::sync::Arc<Model>,
    pub tok: std::sync::Arc<token_stream::Tokenizer>,
    pub chat: token_stream::ChatTemplate,
}

/// [`Fixture`] of the default model (`weight_cache::locate_default_model`).
pub fn fixture() -> &'static Fixture {
    use std::sync::{Arc, OnceLock};
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the model file is not modified while the tests run.
        let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }.expect("open model"));
        let tok = Arc::new(token_stream::Tokenizer::from_gguf(&gguf).expect("tokenizer"));
        let chat = token_stream::ChatTemplate::from_tokenizer(&tok).expect("chat template");
        let model =
            Arc::new(Model::load(gguf, gpu_pipeline::ModelOptions::default()).expect("load model"));
        Fixture { model, tok, chat }
    })
}
