//! Helpers shared by the model-correctness tests (`model_logits.rs`, `quant_models.rs`).
#![allow(dead_code, unreachable_pub)]

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
        let row = &logits[j * vocab..(j + 1) * vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = row
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .sum::<f64>()
            .ln()
            + f64::from(max);
        nll += lse - f64::from(row[chunk[j + 1] as usize]);
        count += 1;
    }
    (nll, count)
}
