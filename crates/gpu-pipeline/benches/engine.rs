//! Engine throughput on the default model: 42-token chat prompts, 32 generated tokens, at 1, 8,
//! 32, 100 and 200 concurrent requests. Prints aggregate generated tok/s, requests/s, p50/p99
//! time to first token, the ideal TTFT (all queued prompt tokens / measured prefill rate) and
//! the speed-up over one stream.
//!
//! It also prints the rate of the load's matrix products (the model's multiply-adds per prompt
//! and generated token, counted as 2 operations, output head included where it runs, the
//! activation split's extra products not counted) as a share of the int8 ceiling of the
//! kernels' exact per-block arithmetic ([`gpu_pipeline::Int8Peak::block_gops`]), measured before
//! and after the table: how far from the machine the batched forward runs.
//!
//! `cargo bench -p zerolayer-gpu-pipeline --bench engine` (ZEROLAYER_BENCH_LEVELS=1,8 to pick levels;
//! ZEROLAYER_BENCH_ROUNDS=N rounds per level, the median one printed, default 3;
//! ZEROLAYER_BENCH_SPLIT=off|ffn-down|all for the model's `ActivationSplit`, default ffn-down).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest};
use gpu_pipeline::zerolayer_api::InferenceEvent;
use gpu_pipeline::{ActivationSplit, LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvPool, RingMode};
use token_stream::{ChatTemplate, TemplateMessage, Tokenizer};

const PROMPT_TOKENS: usize = 42;
const NEW_TOKENS: usize = 32;

fn prompts(tok: &Tokenizer, n: usize) -> Vec<Vec<u32>> {
    let chat = ChatTemplate::from_tokenizer(tok).expect("chat template");
    (0..n)
        .map(|i| {
            let user = format!(
                "Request number {i}: please write a short friendly paragraph about the number {} and why \
                 it might be interesting to a curious student who likes mathematics and history.",
                i * 7 + 3
            );
            let msgs = [TemplateMessage::new("user", &user)];
            let mut ids = chat.encode(tok, &msgs, true).expect("encode").to_vec();
            // Keep the generation prompt at the end: cut from the middle of the user text.
            let tail = ids.split_off(ids.len() - 5);
            ids.truncate(PROMPT_TOKENS - tail.len());
            ids.extend(tail);
            assert_eq!(ids.len(), PROMPT_TOKENS);
            ids
        })
        .collect()
}

/// Prompt tokens per second of a batched prefill of `n` prompts (one forward call).
fn prefill_rate(model: &Model, prompts: &[Vec<u32>]) -> f64 {
    let pool = KvPool::new(model.kv_shape(KvDtype::F16), 512 << 20).expect("pool");
    let mut best = f64::MAX;
    for _ in 0..3 {
        let mut rings: Vec<_> = prompts
            .iter()
            .map(|p| pool.alloc(p.len() + 1, RingMode::Strict).unwrap())
            .collect();
        let mut steps: Vec<SeqStep<'_>> = prompts
            .iter()
            .zip(rings.iter_mut())
            .map(|(p, kv)| SeqStep {
                tokens: p,
                kv,
                logits: LogitsWanted::Last,
            })
            .collect();
        let mut out = Vec::new();
        let t = Instant::now();
        model.forward(&mut steps, &mut out).expect("forward");
        best = best.min(t.elapsed().as_secs_f64());
    }
    prompts.iter().map(Vec::len).sum::<usize>() as f64 / best
}

/// Multiply-adds per token of the model's matrices: (the layers', the output head's).
fn macs_per_token(model: &Model) -> (f64, f64) {
    let c = model.config();
    let (d, q, kv) = (c.n_embd, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let layer = d * (q + 2 * kv) + q * d + 3 * d * c.n_ff;
    ((c.n_layers * layer) as f64, (c.vocab_size * d) as f64)
}

struct Row {
    c: usize,
    tok_s: f64,
    req_s: f64,
    p50: Duration,
    p99: Duration,
    ideal: Duration,
}

fn run_level(model: &Arc<Model>, tok: &Arc<Tokenizer>, prompts: &[Vec<u32>], rate: f64) -> Row {
    let c = prompts.len();
    let cfg = EngineConfig::default()
        .with_prefix_cache_entries(0)
        .with_kv_budget_bytes(1 << 30)
        .with_max_running(256)
        .with_max_queue(512);
    let engine = Engine::new(model.clone(), Some(tok.clone()), cfg).expect("engine");
    let t0 = Instant::now();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(GenerationRequest::new(p.clone(), NEW_TOKENS).with_stop_tokens(vec![]))
                .expect("submit")
        })
        .collect();
    let results: Vec<(Duration, usize)> = std::thread::scope(|s| {
        let joins: Vec<_> = handles
            .iter()
            .map(|h| {
                s.spawn(move || {
                    let mut ttft = None;
                    let mut n = 0;
                    while let Some(ev) = h.recv() {
                        match ev {
                            InferenceEvent::Delta { ids, .. } if !ids.is_empty() => {
                                ttft.get_or_insert_with(|| t0.elapsed());
                                n += ids.len();
                            }
                            InferenceEvent::Error { message, .. } => panic!("{message}"),
                            _ => {}
                        }
                    }
                    (ttft.expect("no token"), n)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().expect("join")).collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let generated: usize = results.iter().map(|r| r.1).sum();
    assert_eq!(generated, c * NEW_TOKENS);
    let mut ttfts: Vec<Duration> = results.iter().map(|r| r.0).collect();
    ttfts.sort();
    let q = |f: f64| ttfts[((f * c as f64).ceil() as usize).clamp(1, c) - 1];
    Row {
        c,
        tok_s: generated as f64 / wall,
        req_s: c as f64 / wall,
        p50: q(0.5),
        p99: q(0.99),
        ideal: Duration::from_secs_f64((c * PROMPT_TOKENS) as f64 / rate),
    }
}

fn main() {
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the model file is not modified while the bench runs.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }.expect("open model"));
    let tok = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
    let split = match std::env::var("ZEROLAYER_BENCH_SPLIT").as_deref() {
        Ok("off") => ActivationSplit::Off,
        Ok("all") => ActivationSplit::All,
        Ok("ffn-down") | Err(_) => ActivationSplit::FfnDown,
        Ok(other) => panic!("ZEROLAYER_BENCH_SPLIT={other}: use off, ffn-down or all"),
    };
    let opts = ModelOptions::default().with_activation_split(split);
    let model = Arc::new(Model::load(gguf, opts).expect("model"));
    // `cargo test --all-targets` runs this without `--bench`: then one round of two small levels.
    let full = std::env::args().any(|a| a == "--bench");
    let levels: Vec<usize> = std::env::var("ZEROLAYER_BENCH_LEVELS")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| {
            if full {
                vec![1, 8, 32, 100, 200]
            } else {
                vec![1, 4]
            }
        });
    let rounds: usize = std::env::var("ZEROLAYER_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(if full { 3 } else { 1 })
        .max(1);
    let all = prompts(&tok, levels.iter().copied().max().unwrap_or(1));
    let ceiling = || gpu_pipeline::int8_peak(model.pool(), 3).map(|p| p.block_gops);
    let ceiling_before = ceiling();
    let rate = prefill_rate(&model, &all[..all.len().min(8)]);
    println!(
        "engine bench: {PROMPT_TOKENS}-token chat prompts, {NEW_TOKENS} new tokens, {} threads, activation split {split:?}, prefill rate {rate:.0} tok/s, median of {rounds} rounds per level",
        model.pool().n_threads()
    );
    println!(
        "| concurrent | gen tok/s | x single | req/s | p50 TTFT | p99 TTFT | ideal TTFT | p99/ideal | matrix GOP/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    // A request's matrix work: every prompt token and every generated token but the last
    // through the layers, the head once per generated token.
    let (layers, head) = macs_per_token(&model);
    let request_ops =
        2.0 * ((PROMPT_TOKENS + NEW_TOKENS - 1) as f64 * layers + NEW_TOKENS as f64 * head);
    let mut gops = Vec::new();
    let mut single = None;
    for &c in &levels {
        // Each level runs `rounds` times (a fresh engine each); the round with the median
        // generated tok/s is printed, so one disturbed run on a shared machine does not set it.
        let mut runs: Vec<Row> = (0..rounds)
            .map(|_| run_level(&model, &tok, &all[..c], rate))
            .collect();
        runs.sort_by(|a, b| a.tok_s.total_cmp(&b.tok_s));
        let r = runs.swap_remove(runs.len() / 2);
        let base = *single.get_or_insert(r.tok_s);
        println!(
            "| {} | {:.1} | {:.2}x | {:.2} | {:.0} ms | {:.0} ms | {:.0} ms | {:.2} | {:.0} |",
            r.c,
            r.tok_s,
            r.tok_s / base,
            r.req_s,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.ideal.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() / r.ideal.as_secs_f64(),
            r.req_s * request_ops / 1e9,
        );
        gops.push((r.c, r.req_s * request_ops / 1e9));
    }
    if let (Some(a), Some(b)) = (ceiling_before, ceiling()) {
        let mean = (a + b) / 2.0;
        println!(
            "\nint8 ceiling of the kernels' exact per-block arithmetic (register-only loop, {} threads): \
             {a:.0} / {b:.0} GOP/s before / after the table; matrix work as a share of their mean:",
            model.pool().n_threads()
        );
        for (c, g) in gops {
            println!(
                "  {c:>3} concurrent: {g:.0} GOP/s = {:.0}%",
                100.0 * g / mean
            );
        }
    }
}
