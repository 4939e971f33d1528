//! Constrained decoding on the default model: the per-step cost of a JSON Schema mask
//! (llguidance, median and p99 over the tokens of valid documents), and engine throughput
//! with 0%, 50% and 100% of 32 concurrent requests constrained to a JSON Schema (32 generated
//! tokens each; the schema cannot be complete within them, so every request does the same work).
//!
//! `cargo bench -p zerolayer-gpu-pipeline --bench constrained` (ZEROLAYER_BENCH_ROUNDS=N rounds
//! per mix, the median printed, default 3).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest};
use gpu_pipeline::zerolayer_api::InferenceEvent;
use gpu_pipeline::{ConstraintFactory, Grammars, Model, ModelOptions, TokenMask};
use token_stream::{ChatTemplate, TemplateMessage, Tokenizer};

const NEW_TOKENS: usize = 32;
const CONCURRENT: usize = 32;

/// A city record, compact JSON (as the server compiles schemas).
fn city_schema() -> serde_json::Value {
    serde_json::json!({
        "x-guidance": {"whitespace_flexible": false},
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
            "size": {"enum": ["small", "medium", "large"]},
            "sights": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}
        },
        "required": ["city", "population", "size"],
        "additionalProperties": false
    })
}

/// Per-step mask time of `factory` over the tokens of `docs` (each a document it accepts).
fn mask_times(
    factory: &dyn ConstraintFactory,
    tok: &Tokenizer,
    vocab: usize,
    docs: &[&str],
) -> Vec<Duration> {
    let mut mask = TokenMask::forbid_all(vocab);
    let mut times = Vec::new();
    for doc in docs {
        let mut c = factory.start();
        for &t in tok.encode(doc).iter() {
            let t0 = Instant::now();
            c.fill_mask(&mut mask).expect("mask");
            times.push(t0.elapsed());
            assert!(mask.is_allowed(t), "{doc}: token {t} refused");
            c.commit(t).expect("commit");
        }
    }
    times.sort();
    times
}

fn prompts(tok: &Tokenizer, n: usize) -> Vec<Vec<u32>> {
    let chat = ChatTemplate::from_tokenizer(tok).expect("chat template");
    (0..n)
        .map(|i| {
            let user = format!("Describe city number {i} as JSON.");
            chat.encode(tok, &[TemplateMessage::new("user", &user)], true)
                .expect("encode")
                .to_vec()
        })
        .collect()
}

/// Generated tokens per second of all `prompts` at once, the first `constrained` of them
/// under `factory`.
fn throughput(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    prompts: &[Vec<u32>],
    constrained: usize,
    factory: &Arc<dyn ConstraintFactory>,
) -> f64 {
    let cfg = EngineConfig::default()
        .with_prefix_cache_entries(0)
        .with_kv_budget_bytes(1 << 30)
        .with_max_running(256)
        .with_max_queue(512);
    let engine = Engine::new(model.clone(), Some(tok.clone()), cfg).expect("engine");
    let t0 = Instant::now();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let c = (i < constrained).then(|| factory.clone());
            engine
                .submit(
                    GenerationRequest::new(p.clone(), NEW_TOKENS)
                        .with_stop_tokens(vec![])
                        .with_constraint(c),
                )
                .expect("submit")
        })
        .collect();
    let mut generated = 0;
    for h in &handles {
        while let Some(ev) = h.recv() {
            match ev {
                InferenceEvent::Delta { ids, .. } => generated += ids.len(),
                InferenceEvent::Error { message, .. } => panic!("{message}"),
                _ => {}
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    assert_eq!(generated, prompts.len() * NEW_TOKENS);
    generated as f64 / wall
}

fn main() {
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the model file is not modified while the bench runs.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }.expect("open model"));
    let tok = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
    let model = Arc::new(Model::load(gguf, ModelOptions::default()).expect("model"));
    let vocab = model.config().vocab_size;
    let full = std::env::args().any(|a| a == "--bench");
    let rounds: usize = std::env::var("ZEROLAYER_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(if full { 3 } else { 1 })
        .max(1);
    let eos = tok.eos_id().expect("eos");
    let grammars = Grammars::new(&tok, vocab, eos).expect("grammars");

    let city = grammars.json_schema(city_schema()).expect("schema");
    let docs = [
        r#"{"city":"Paris","population":2100000,"size":"large","sights":["Louvre","Eiffel Tower"]}"#,
        r#"{"city":"Ulm","population":126000,"size":"medium"}"#,
        r#"{"city":"Hallstatt","population":750,"size":"small","sights":[]}"#,
    ];
    let times = mask_times(city.as_ref(), &tok, vocab, &docs);
    let q = |f: f64| times[((f * times.len() as f64).ceil() as usize).clamp(1, times.len()) - 1];
    println!(
        "mask cost (city JSON Schema, {} steps over {} documents, vocab {vocab}): median {:.1} us, p99 {:.1} us, max {:.1} us",
        times.len(),
        docs.len(),
        q(0.5).as_secs_f64() * 1e6,
        q(0.99).as_secs_f64() * 1e6,
        times[times.len() - 1].as_secs_f64() * 1e6
    );

    // A list of at least 8 city records: never complete within NEW_TOKENS.
    let mut list = serde_json::json!({"type": "array", "items": city_schema(), "minItems": 8});
    list["x-guidance"] = serde_json::json!({"whitespace_flexible": false});
    let list = grammars.json_schema(list).expect("schema");
    let prompts = prompts(&tok, CONCURRENT);
    println!(
        "engine throughput: {CONCURRENT} concurrent requests, {NEW_TOKENS} new tokens, {} threads, median of {rounds} rounds",
        model.pool().n_threads()
    );
    println!("| constrained | gen tok/s | vs unconstrained |");
    println!("|---:|---:|---:|");
    let mut base = None;
    for constrained in [0, CONCURRENT / 2, CONCURRENT] {
        let mut runs: Vec<f64> = (0..rounds)
            .map(|_| throughput(&model, &tok, &prompts, constrained, &list))
            .collect();
        runs.sort_by(f64::total_cmp);
        let r = runs[runs.len() / 2];
        let b = *base.get_or_insert(r);
        println!(
            "| {}% | {r:.1} | {:.3} |",
            constrained * 100 / CONCURRENT,
            r / b
        );
    }
}
