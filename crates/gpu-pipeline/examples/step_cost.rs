//! Cost of a decode step by the number of tokens it carries (a verification of `k` drafts is a
//! step of `k + 1` tokens with every row's logits), relative to a 1-token step, on the default
//! model (or `model.gguf`) at a context of 300 tokens (or `context`): what a draft token costs,
//! the figure that bounds what speculative decoding can gain. Medians over rounds that cycle
//! through the step sizes; each step is rolled back, so every one runs at the same context.
//!
//! `cargo run --release -p zerolayer-gpu-pipeline --example step_cost [threads] [rounds] [context]
//! [model.gguf]`

use std::sync::Arc;
use std::time::Instant;

use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvPool, RingMode};

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(30);
    let ctx: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(300);
    let path = match args.next() {
        Some(p) => std::path::PathBuf::from(p),
        None => weight_cache::locate_default_model().expect("scripts/fetch-model first"),
    };
    // SAFETY: the model file is not modified while mapped.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(&path) }.expect("open"));
    let model = Model::load(gguf, ModelOptions::default().with_threads(threads)).expect("load");
    let shape = model.kv_shape(KvDtype::F16);
    let pool = KvPool::new(shape, 1024 * shape.bytes_per_token()).expect("pool");
    let mut kv = pool.alloc(1024, RingMode::Strict).expect("ring");
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| 100 + (i * 37) % 5000).collect();
    let mut out = Vec::new();
    let mut step = |tokens: &[u32], logits, kv: &mut _| {
        model
            .forward(&mut [SeqStep { tokens, kv, logits }], &mut out)
            .expect("forward");
    };
    step(&prompt, LogitsWanted::Last, &mut kv);
    let max_k = 8;
    let mut times = vec![[Vec::new(), Vec::new()]; max_k + 1];
    for _ in 0..rounds {
        for (k, by_k) in times.iter_mut().enumerate() {
            for (w, logits) in [LogitsWanted::All, LogitsWanted::Last]
                .into_iter()
                .enumerate()
            {
                let toks: Vec<u32> = (0..=k as u32).map(|i| 200 + i).collect();
                let t = Instant::now();
                step(&toks, logits, &mut kv);
                by_k[w].push(t.elapsed().as_secs_f64() * 1e3);
                kv.rollback(k + 1).expect("rollback");
            }
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = med(&mut times[0][0].clone());
    println!("threads {threads}, rounds {rounds}, context {ctx}; medians, ms (x the 1-token step)");
    println!("drafts  all-logits        last-logit");
    for (k, t) in times.iter_mut().enumerate() {
        let (a, l) = (med(&mut t[0]), med(&mut t[1]));
        println!(
            "{k:>6}  {a:6.2} ({:.2}x)  {l:6.2} ({:.2}x)",
            a / base,
            l / base
        );
    }
}
