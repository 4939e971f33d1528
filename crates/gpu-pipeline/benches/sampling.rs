//! Sampling cost per token over a full vocabulary row: greedy, temperature alone, temperature
//! with top-p, top-k and min-p, for SmolLM2's 49152 tokens and Qwen2.5's 151936, against a
//! straightforward sort-everything sampler (what `Sampler` did before the unsorted full-row
//! draw: every candidate sorted, an f64 `exp` each) in the same run; and the log-probabilities
//! of a token with the top 5 (`token_logprob`) against an f64, collect-everything version.
//! Median over 2000 draws.
//!
//! `cargo bench -p zerolayer-gpu-pipeline --bench sampling` (`cargo test --all-targets` runs it with 5
//! draws per figure).

use std::time::Instant;

use gpu_pipeline::{Sampler, SamplerConfig, token_logprob};

/// A logit row like a language model's: a smooth body around -2 with a few strong tokens.
fn row(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|i| {
            let u = (next() + next() + next() + next() - 2.0) * 2.5 - 2.0;
            if i % 4999 == 7 { u + 12.0 } else { u }
        })
        .collect()
}

/// The reference: candidates scaled by 1/t, sorted, softmax in f64, top-p, min-p, one draw.
fn sort_everything(p: &SamplerConfig, logits: &[f32], u: f64, cand: &mut Vec<(f32, u32)>) -> u32 {
    let inv_t = 1.0 / p.temperature;
    cand.clear();
    cand.extend(
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l * inv_t, i as u32)),
    );
    let by_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, by_desc);
        cand.truncate(p.top_k);
    }
    cand.sort_unstable_by(by_desc);
    let max = cand[0].0;
    let mut sum = 0.0f64;
    for c in cand.iter_mut() {
        let e = f64::from(c.0 - max).exp();
        c.0 = e as f32;
        sum += e;
    }
    let mut keep = cand.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0f64;
        for (i, c) in cand.iter().enumerate() {
            acc += f64::from(c.0) / sum;
            if acc >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = cand[0].0 * p.min_p;
        keep = keep.min(cand.iter().take_while(|c| c.0 >= floor).count().max(1));
    }
    cand.truncate(keep);
    let total: f64 = cand.iter().map(|c| f64::from(c.0)).sum();
    let mut r = u * total;
    for c in cand.iter() {
        r -= f64::from(c.0);
        if r < 0.0 {
            return c.1;
        }
    }
    cand[cand.len() - 1].1
}

/// The reference log-probabilities: f64 `exp` over the row, every entry collected, the top
/// `n` selected and sorted (what `token_logprob` did before).
fn logprobs_reference(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| f64::from(l - max).exp())
        .sum::<f64>()
        .ln()
        + f64::from(max);
    let mut all: Vec<(f32, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (l, i as u32))
        .collect();
    let by_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    all.select_nth_unstable_by(n - 1, by_desc);
    all.truncate(n);
    all.sort_unstable_by(by_desc);
    let lp = |l: f32| (f64::from(l) - lse) as f32;
    (
        lp(logits[token as usize]),
        all.into_iter().map(|(l, i)| (i, lp(l))).collect(),
    )
}

fn median_us(draws: usize, mut f: impl FnMut(usize) -> u32) -> f64 {
    let mut times = Vec::with_capacity(draws);
    let mut sink = 0u64;
    for i in 0..draws {
        let t = Instant::now();
        sink += u64::from(f(i));
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    std::hint::black_box(sink);
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    // `cargo test --all-targets` runs this without `--bench`: then 5 draws per figure.
    let draws = if std::env::args().any(|a| a == "--bench") {
        2000
    } else {
        5
    };
    let settings: [(&str, SamplerConfig); 5] = [
        ("greedy", SamplerConfig::default()),
        ("t=1.0", SamplerConfig::default().with_temperature(1.0)),
        (
            "t=0.8 top-p 0.95",
            SamplerConfig::default()
                .with_temperature(0.8)
                .with_top_p(0.95),
        ),
        (
            "t=0.8 top-k 40",
            SamplerConfig::default()
                .with_temperature(0.8)
                .with_top_k(40),
        ),
        (
            "t=0.8 min-p 0.05",
            SamplerConfig::default()
                .with_temperature(0.8)
                .with_min_p(0.05),
        ),
    ];
    println!("| vocabulary | sampling | Sampler (µs/token) | sort everything (µs/token) | ratio |");
    println!("|---:|---|---:|---:|---:|");
    for vocab in [49_152, 151_936] {
        let rows: Vec<Vec<f32>> = (0..8).map(|s| row(vocab, 0x5EED + s)).collect();
        for (name, params) in &settings {
            let mut s = Sampler::new(params.clone().with_seed(1));
            let ours = median_us(draws, |i| s.sample(&rows[i % rows.len()], &[]));
            let reference = if params.is_greedy() {
                f64::NAN
            } else {
                let mut cand = Vec::new();
                median_us(draws, |i| {
                    sort_everything(params, &rows[i % rows.len()], 0.37, &mut cand)
                })
            };
            println!(
                "| {vocab} | {name} | {ours:.1} | {reference:.1} | {:.1}x |",
                reference / ours
            );
        }
        let ours = median_us(draws, |i| {
            token_logprob(&rows[i % rows.len()], 7, 5).top[0].0
        });
        let reference = median_us(draws, |i| {
            logprobs_reference(&rows[i % rows.len()], 7, 5).1[0].0
        });
        println!(
            "| {vocab} | log-probabilities, top 5 | {ours:.1} | {reference:.1} | {:.1}x |",
            reference / ours
        );
    }
}
