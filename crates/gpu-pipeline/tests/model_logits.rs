//! Model correctness against llama.cpp and an fp32 reference, on the real default model.
//!
//! Fixtures: `tests/fixtures/model-*.json`, made by `scripts/fixtures/gpu-pipeline-fixtures.py`
//! (llama-cpp-python and the numpy fp32 reference `scripts/fixtures/gpu-pipeline-fp32ref.py`).
//! Needs the default model (`scripts/fetch-model`).

mod common;

use std::sync::{Arc, OnceLock};

use common::{argmax, ids_of};

use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvRing};
use serde_json::Value;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the model file is not modified while the tests run.
        let g = Arc::new(unsafe { weight_cache::Gguf::open(&path) }.expect("open default model"));
        Model::load(g, ModelOptions::default()).expect("load default model")
    })
}

fn ring(cap: usize) -> KvRing {
    common::ring(model(), KvDtype::F32, cap)
}

fn fixture(name: &str) -> Value {
    let p = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// Logits of every position of `ids` (one sequence, fresh cache).
fn all_logits(ids: &[u32]) -> Vec<f32> {
    common::all_logits(model(), KvDtype::F32, ids)
}

#[test]
fn teacher_forced_top1_and_logit_error_vs_llama_cpp_and_fp32() {
    let fx = fixture("model-teacher.json");
    let vocab = model().config().vocab_size;
    let seqs = fx["sequences"].as_array().unwrap();
    assert!(seqs.len() >= 8);
    let (mut gap_pos, mut agree) = (0usize, 0usize);
    let (mut ours_err, mut llama_err, mut n_err) = (0f64, 0f64, 0usize);
    for s in seqs {
        let ids = ids_of(&s["ids"]);
        let logits = all_logits(&ids);
        for (i, p) in s["positions"].as_array().unwrap().iter().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let lt = p["llama_top"].as_array().unwrap();
            let l0 = lt[0][1].as_f64().unwrap();
            let l1 = lt[1][1].as_f64().unwrap();
            if l0 - l1 > 0.5 {
                gap_pos += 1;
                let want = lt[0][0].as_u64().unwrap() as usize;
                let got = argmax(row);
                if got == want {
                    agree += 1;
                } else {
                    eprintln!(
                        "{:?} pos {i}: ours {got}, llama.cpp {want} (gap {:.3})",
                        s["prompt"],
                        l0 - l1
                    );
                }
            }
            for e in p["fp32_top"].as_array().unwrap() {
                let id = e[0].as_u64().unwrap() as usize;
                let fp32 = e[1].as_f64().unwrap();
                let llama = e[2].as_f64().unwrap();
                ours_err += (f64::from(row[id]) - fp32).abs();
                llama_err += (llama - fp32).abs();
                n_err += 1;
            }
        }
    }
    let (ours_err, llama_err) = (ours_err / n_err as f64, llama_err / n_err as f64);
    eprintln!(
        "top-1 agreement at gap>0.5: {agree}/{gap_pos}; mean |logit - fp32| over fp32 top-k: ours {ours_err:.4}, llama.cpp {llama_err:.4}"
    );
    assert!(
        gap_pos > 300,
        "fixture has too few decisive positions: {gap_pos}"
    );
    assert_eq!(
        agree, gap_pos,
        "top-1 must equal llama.cpp's wherever its top-2 gap exceeds 0.5"
    );
    assert!(
        ours_err <= llama_err,
        "mean abs logit error vs fp32: ours {ours_err:.4} > llama.cpp {llama_err:.4}"
    );
}

#[test]
fn perplexity_within_one_percent_of_llama_cpp_and_fp32() {
    let fx = fixture("model-ppl.json");
    let ctx = fx["ctx"].as_u64().unwrap() as usize;
    let n_win = fx["ci_windows"].as_u64().unwrap() as usize;
    let ids = ids_of(&fx["ci_ids"]);
    let vocab = model().config().vocab_size;
    let wins = fx["windows"].as_array().unwrap();
    let (mut ours, mut llama, mut fp32, mut count) = (0f64, 0f64, 0f64, 0usize);
    for w in 0..n_win {
        let chunk = &ids[w * ctx..(w + 1) * ctx];
        let (nll, scored) = common::nll_second_half(&all_logits(chunk), chunk, vocab);
        ours += nll;
        count += scored;
        llama += wins[w]["llama_nll"].as_f64().unwrap();
        fp32 += wins[w]["fp32_nll"].as_f64().unwrap();
        assert_eq!(wins[w]["count"].as_u64().unwrap() as usize * (w + 1), count);
    }
    let ppl = |nll: f64| (nll / count as f64).exp();
    let (ours, llama, fp32) = (ppl(ours), ppl(llama), ppl(fp32));
    eprintln!(
        "perplexity over {n_win} windows of {ctx}: ours {ours:.4}, llama.cpp {llama:.4}, fp32 {fp32:.4}"
    );
    assert!(
        (ours / llama - 1.0).abs() < 0.01,
        "ours {ours} vs llama.cpp {llama}"
    );
    assert!(
        (ours / fp32 - 1.0).abs() < 0.01,
        "ours {ours} vs fp32 {fp32}"
    );
}

/// A forward call's rows do not depend on what else is in the batch, bit for bit: three
/// sequences prefilled together in one call (24 tokens, so the many-token kernels and the
/// parallel element-wise paths run) give the logits that each sequence gets when fed one token
/// per call on its own (single-token kernels), and a decode step of the three together matches
/// too; with an f32 cache and with the quantized q8_0 and q4_0 caches (the attention reads their
/// blocks in prefill and in decode, through the same operations).
#[test]
fn batched_forward_is_bit_identical_to_token_by_token() {
    for dtype in [KvDtype::F32, KvDtype::Q8_0, KvDtype::Q4_0] {
        batched_forward_is_bit_identical_to_token_by_token_with(dtype);
    }
}

fn batched_forward_is_bit_identical_to_token_by_token_with(dtype: KvDtype) {
    let m = model();
    let ring = |cap| common::ring(m, dtype, cap);
    let seqs: [&[u32]; 3] = [
        &[1, 504, 3458, 314, 260, 1345, 282, 4849, 47, 2],
        &[1, 9519, 28, 638, 359, 346, 47],
        &[1, 504, 1142, 1345, 282, 253, 2815, 30, 1003],
    ];
    let next = [198u32, 216, 30];
    let v = m.config().vocab_size;
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    // Alone, one token per call.
    let mut alone = Vec::new();
    for (s, &t) in seqs.iter().zip(&next) {
        let mut kv = ring(16);
        let mut rows = Vec::new();
        for tok in s.iter().chain([&t]) {
            let mut out = Vec::new();
            m.forward(
                &mut [SeqStep {
                    tokens: std::slice::from_ref(tok),
                    kv: &mut kv,
                    logits: LogitsWanted::Last,
                }],
                &mut out,
            )
            .unwrap();
            rows.push(out);
        }
        alone.push(rows);
    }
    // Together: one prefill call, then one decode call.
    let mut kvs: Vec<KvRing> = (0..3).map(|_| ring(16)).collect();
    let mut out = Vec::new();
    let mut steps: Vec<SeqStep<'_>> = seqs
        .iter()
        .zip(kvs.iter_mut())
        .map(|(s, kv)| SeqStep {
            tokens: s,
            kv,
            logits: LogitsWanted::All,
        })
        .collect();
    m.forward(&mut steps, &mut out).unwrap();
    let mut rows = out.chunks_exact(v);
    for (i, s) in seqs.iter().enumerate() {
        for (j, want) in alone[i][..s.len()].iter().enumerate() {
            assert!(
                bits(rows.next().unwrap()) == bits(want),
                "{dtype:?}: sequence {i} position {j}: prefilled in a batch differs from token by token"
            );
        }
    }
    let mut steps: Vec<SeqStep<'_>> = next
        .iter()
        .zip(kvs.iter_mut())
        .map(|(t, kv)| SeqStep {
            tokens: std::slice::from_ref(t),
            kv,
            logits: LogitsWanted::Last,
        })
        .collect();
    m.forward(&mut steps, &mut out).unwrap();
    for (i, s) in seqs.iter().enumerate() {
        assert!(
            bits(&out[i * v..(i + 1) * v]) == bits(&alone[i][s.len()]),
            "{dtype:?}: sequence {i}: batched decode step differs from alone"
        );
    }
}

/// Packing the weights at load (the default where the CPU has the packed kernels) changes no
/// bit of the logits: a 40-token prefill (panel path) and single-token decode steps (the
/// packed decode kernel), against the same model computed on the file mapping.
#[test]
fn packed_weights_give_identical_logits() {
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the model file is not modified while the tests run.
    let g = Arc::new(unsafe { weight_cache::Gguf::open(&path) }.expect("open default model"));
    let opts = ModelOptions::default().with_packing(gpu_pipeline::WeightPacking::Off);
    let file = Model::load(g, opts).expect("load default model");
    let ids: Vec<u32> = (0..40u32).map(|i| 100 + 37 * i).collect();
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert!(
        bits(all_logits(&ids)) == bits(common::all_logits(&file, KvDtype::F32, &ids)),
        "prefill logits differ"
    );
    let (mut a, mut b) = (ring(64), common::ring(&file, KvDtype::F32, 64));
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    for &t in &ids[..6] {
        for (m, kv, out) in [(model(), &mut a, &mut la), (&file, &mut b, &mut lb)] {
            let step = SeqStep {
                tokens: &[t],
                kv,
                logits: LogitsWanted::Last,
            };
            m.forward(&mut [step], out).unwrap();
        }
        assert!(bits(la.clone()) == bits(lb.clone()), "decode logits differ");
    }
}
