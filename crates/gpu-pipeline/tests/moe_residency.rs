//! A mixture of experts under the weight cache: expert-level access statistics, a residency
//! budget of 30% of the model, and the profile-driven warm-up.
//!
//! The model is a synthetic qwen3moe (`benches/support/synthetic.rs`: 8 Q8_0 experts per layer,
//! top-2, a router skewed towards experts 0 and 1) written to a file under the cargo target
//! directory (a real file: residency is the page cache's, measured with mincore, and released with
//! madvise/fadvise). Each test uses its own file, so the tests' page-cache manipulations do not
//! meet.

#[path = "../benches/support/synthetic.rs"]
mod synthetic;

use std::path::PathBuf;
use std::sync::Arc;

use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvPool, RingMode};
use synthetic::{Dims, EXPERTS, HOT_EXPERTS};
use weight_cache::{CacheConfig, Gguf, WarmupStrategy, WeightCache};

/// ~28 MB, of which ~95% are the experts: 4 layers x 3 stacked tensors x 16 experts of 512 x 256.
const DIMS: Dims = Dims {
    n_embd: 256,
    n_ff: 2048,
    n_layers: 4,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 64,
    vocab: 512,
    ctx: 256,
};

const PROMPT: usize = 24;
const DECODE: usize = 24;

fn write_model(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("moe-{name}.gguf"));
    let mut f = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut f, &synthetic::build("qwen3moe", DIMS, 11).build()).unwrap();
    // Clean pages: the page cache can then drop them (dirty ones stay until written back).
    f.sync_all().unwrap();
    path
}

/// Random access (no read-ahead): a faulted expert brings in its own pages, not its neighbours
/// (the device here reads ahead 8 MB, a third of the model).
fn config() -> CacheConfig {
    CacheConfig::default().random_access(true)
}

fn open(path: &PathBuf) -> Arc<Gguf> {
    // SAFETY: the test's own file, not modified while mapped.
    Arc::new(unsafe { Gguf::open(path) }.expect("open"))
}

fn load(gguf: &Arc<Gguf>) -> Model {
    Model::load(gguf.clone(), ModelOptions::default().with_threads(2)).unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 9) % DIMS.vocab as u32)
        .collect()
}

/// A prompt in one step, then teacher-forced decode steps; every decode step's logits (as bits).
/// `hook(step, false)` is called just before each decode step, `hook(step, true)` after it.
fn run(model: &Model, mut hook: impl FnMut(usize, bool)) -> Vec<u32> {
    let pool = KvPool::new(model.kv_shape(KvDtype::F16), 16 << 20).unwrap();
    let mut kv = pool.alloc(PROMPT + DECODE, RingMode::Strict).unwrap();
    let (prompt, decode) = (tokens(PROMPT, 1), tokens(DECODE, 2));
    let mut out = Vec::new();
    let mut bits = Vec::new();
    let mut step = |toks: &[u32], out: &mut Vec<f32>| {
        let mut s = [SeqStep {
            tokens: toks,
            kv: &mut kv,
            logits: LogitsWanted::Last,
        }];
        model.forward(&mut s, out).unwrap();
    };
    step(&prompt, &mut out);
    for (i, t) in decode.iter().enumerate() {
        hook(i, false);
        step(&[*t], &mut out);
        bits.extend(out.iter().map(|v| v.to_bits()));
        hook(i, true);
    }
    bits
}

/// The blocks of expert `e` of stacked tensor `name` (whole blocks inside its byte slice only:
/// a block shared with a neighbour counts for both).
fn expert_blocks(cache: &WeightCache, name: &str, e: usize) -> std::ops::Range<usize> {
    let t = cache.table();
    let i = cache.gguf().tensor_index(name).unwrap();
    let bytes = t.tensor_bytes(i);
    let n = cache.n_parts(i);
    assert_eq!(n, EXPERTS.0, "{name} is a stack of the experts");
    let part = bytes.len() / n;
    let (a, b) = (bytes.start + e * part, bytes.start + (e + 1) * part);
    let bs = t.block_size();
    a.div_ceil(bs)..b / bs
}

/// A profile made by running the model once with a cache attached; saved to a file.
fn profile(path: &PathBuf) -> PathBuf {
    let gguf = open(path);
    let model = load(&gguf);
    let cache = WeightCache::new(gguf, config()).unwrap();
    model.attach_weight_cache(cache.clone()).unwrap();
    run(&model, |_, _| {});
    let out = path.with_extension("profile");
    cache.save_profile(&out).unwrap();
    out
}

#[test]
fn expert_touches_make_the_hot_experts_blocks_hot() {
    let path = write_model("stats");
    let gguf = open(&path);
    let model = load(&gguf);
    let cache = WeightCache::new(gguf, config()).unwrap();
    model.attach_weight_cache(cache.clone()).unwrap();
    run(&model, |_, _| {});
    let s = cache.stats();
    assert!(s.part_touches > 0 && s.part_hit_rate.is_some(), "{s:?}");
    let p = cache.profile();
    let mean = |r: std::ops::Range<usize>| {
        assert!(!r.is_empty(), "an expert spans whole blocks");
        p.touches[r.clone()].iter().sum::<u64>() as f64 / r.len() as f64
    };
    for l in 0..DIMS.n_layers {
        for t in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
            let name = format!("blk.{l}.{t}.weight");
            let per: Vec<f64> = (0..EXPERTS.0)
                .map(|e| mean(expert_blocks(&cache, &name, e)))
                .collect();
            let hot = per[..HOT_EXPERTS].iter().sum::<f64>() / HOT_EXPERTS as f64;
            let cold = per[HOT_EXPERTS..].iter().sum::<f64>() / (EXPERTS.0 - HOT_EXPERTS) as f64;
            eprintln!("{name}: touches per block of each expert {per:?}");
            assert!(
                hot > 2.0 * cold,
                "{name}: the favoured experts' blocks ({hot}) are not hotter than the others' \
                 ({cold})"
            );
        }
    }
    // The warm-up plan puts a hot expert's blocks before a cold one's.
    let plan = cache.plan(WarmupStrategy::Deterministic {
        fraction: 1.0,
        mlock: false,
    });
    let rank = |b: usize| plan.iter().position(|&x| x == b).unwrap_or(usize::MAX);
    let name = "blk.0.ffn_up_exps.weight";
    let hot = expert_blocks(&cache, name, 0).start;
    let coldest = (HOT_EXPERTS..EXPERTS.0)
        .min_by(|&a, &b| {
            mean(expert_blocks(&cache, name, a)).total_cmp(&mean(expert_blocks(&cache, name, b)))
        })
        .unwrap();
    assert!(rank(hot) < rank(expert_blocks(&cache, name, coldest).start));
}

#[test]
fn a_budget_of_30_percent_keeps_results_bit_identical_and_residency_within_bounds() {
    let path = write_model("budget");
    let reference = run(&load(&open(&path)), |_, _| {});
    let prof = profile(&path);

    let gguf = open(&path);
    let file = gguf.bytes().len();
    let budget = file * 3 / 10;
    let cache = WeightCache::new(gguf.clone(), config().budget_bytes(Some(budget))).unwrap();
    cache.load_profile(&prof).unwrap();
    // The stated overhead: one decode step's reads (everything but the experts, plus two
    // experts of each layer's three stacked tensors, each rounded out to whole blocks).
    let bs = cache.table().block_size();
    let mut expert_bytes = 0;
    let mut step_bytes = 0;
    for t in cache.gguf().tensors() {
        let len = t.data.len();
        if t.name.contains("_exps") {
            expert_bytes += len;
            step_bytes += EXPERTS.1 * (len / EXPERTS.0 + 2 * bs);
        } else {
            step_bytes += len;
        }
    }
    assert!(
        expert_bytes as f64 > 0.8 * file as f64,
        "experts dominate the file"
    );
    assert!(
        budget + step_bytes < file * 8 / 10,
        "the bound says something"
    );
    let model = load(&gguf);
    model.attach_weight_cache(cache.clone()).unwrap();
    cache.make_cold().unwrap();
    cache
        .warm(WarmupStrategy::Deterministic {
            fraction: 0.25,
            mlock: false,
        })
        .wait();
    let mut peak = 0;
    let got = run(&model, |_, done| {
        if !done {
            return;
        }
        let before = cache.resident_bytes().unwrap();
        peak = peak.max(before);
        let r = cache.enforce_budget().unwrap();
        assert!(
            r.resident_after <= budget,
            "after enforcement {} > budget {budget}",
            r.resident_after
        );
    });
    eprintln!(
        "file {file} B, budget {budget} B, peak resident after a decode step {peak} B (bound \
         budget + {step_bytes} B), hit rate {:?}, expert hit rate {:?}",
        cache.stats().hit_rate,
        cache.stats().part_hit_rate
    );
    assert!(
        got == reference,
        "budgeted logits differ from the unbudgeted run"
    );
    assert!(
        peak <= budget + step_bytes,
        "resident {peak} B > budget {budget} B + one step's reads {step_bytes} B"
    );
    assert!(peak < file, "the budget kept part of the model out");
}

#[test]
fn profile_driven_warm_up_beats_a_cold_start_at_first_touch() {
    let path = write_model("warm");
    let prof = profile(&path);
    let first_touch = |warm: bool| {
        let gguf = open(&path);
        let cache = WeightCache::new(gguf.clone(), config()).unwrap();
        let model = load(&gguf);
        model.attach_weight_cache(cache.clone()).unwrap();
        cache.make_cold().unwrap();
        if warm {
            cache.load_profile(&prof).unwrap();
            cache
                .warm(WarmupStrategy::Deterministic {
                    fraction: 0.3,
                    mlock: false,
                })
                .wait();
        }
        run(&model, |_, _| {});
        let s = cache.stats();
        (s.first_touch_hit_rate.unwrap(), s.part_hit_rate.unwrap())
    };
    let (cold, cold_experts) = first_touch(false);
    let (warm, warm_experts) = first_touch(true);
    eprintln!(
        "first-touch hit rate: cold {cold:.3} (experts {cold_experts:.3}), warm-up of 30% by \
         profile {warm:.3} (experts {warm_experts:.3})"
    );
    assert!(warm > cold + 0.2, "warm {warm} vs cold {cold}");
    assert!(warm_experts > cold_experts + 0.2);
}

/// Decode bytes per token against the active parameters: before each decode step the file is
/// made cold; after it, the expert stacks' resident bytes (mincore: what the step faulted in)
/// are the chosen experts' slices (the experts whose blocks the step touched, per the cache's
/// profile: `n_used` per layer and stack), up to page rounding, not whole stacks. The process's
/// storage reads per decode token (`/proc/self/io`, the `/metrics` figure
/// `zerolayer_weight_read_bytes_per_token` divides) are printed against the active bytes: a
/// process-wide counter, clean only when this test runs alone.
#[test]
fn a_cold_decode_step_reads_the_chosen_experts_not_the_stacks() {
    let path = write_model("bytes");
    let gguf = open(&path);
    let model = load(&gguf);
    let cache = WeightCache::new(gguf.clone(), config()).unwrap();
    model.attach_weight_cache(cache.clone()).unwrap();
    let page = 4096;
    let stacks: Vec<(usize, String)> = gguf
        .tensors()
        .enumerate()
        .filter(|(_, t)| t.name.contains("_exps"))
        .map(|(i, t)| (i, t.name.to_string()))
        .collect();
    assert_eq!(stacks.len(), 3 * DIMS.n_layers);
    let all_experts: usize = stacks
        .iter()
        .map(|&(i, _)| cache.table().tensor_bytes(i).len())
        .sum();
    let (mut before, mut read_before) = (Vec::new(), None);
    let (mut ratios, mut read_ratios) = (Vec::new(), Vec::new());
    let mut active_total = 0usize;
    let mut read_total = 0u64;
    run_with(&model, &cache, |step, done| {
        if !done {
            before = cache.profile().touches;
            read_before = cache.stats().storage_read_bytes;
            return;
        }
        let after = cache.profile().touches;
        let read_after = cache.stats().storage_read_bytes;
        // The experts this step chose: those whose blocks it touched.
        let (mut chosen, mut resident) = (0usize, 0usize);
        for (i, name) in &stacks {
            let part = cache.table().tensor_bytes(*i).len() / EXPERTS.0;
            let touched = (0..EXPERTS.0)
                .filter(|&e| {
                    let b = expert_blocks(&cache, name, e);
                    b.clone().any(|k| after[k] > before[k])
                })
                .count();
            assert_eq!(
                touched, EXPERTS.1,
                "decode step {step}: {name}: one token routes to n_used experts"
            );
            chosen += touched * part;
            resident += cache.tensor_resident_bytes(*i).unwrap();
        }
        // Each slice may straddle pages at both ends, and a neighbouring page may come in.
        let slack = 3 * EXPERTS.1 * DIMS.n_layers * 4 * page;
        eprintln!(
            "decode step {step}: chosen experts {chosen} B, expert stacks resident {resident} B \
             (all experts {all_experts} B)"
        );
        assert!(
            resident >= chosen * 9 / 10 && resident <= chosen + slack,
            "decode step {step}: expert bytes resident after a cold step {resident} B, the \
             chosen experts' {chosen} B (+ page rounding {slack} B)"
        );
        ratios.push(resident as f64 / chosen as f64);
        let active = chosen
            + (cache.resident_bytes().unwrap() - resident.min(cache.resident_bytes().unwrap()));
        active_total += active;
        if let (Some(a), Some(b)) = (read_before, read_after) {
            read_total += b.saturating_sub(a);
            read_ratios.push(b.saturating_sub(a) as f64 / active as f64);
        }
    });
    ratios.sort_by(f64::total_cmp);
    read_ratios.sort_by(f64::total_cmp);
    let median = |v: &[f64]| v.get(v.len() / 2).copied().unwrap_or(f64::NAN);
    eprintln!(
        "expert bytes faulted in per cold decode step / chosen experts' bytes: median {:.3} \
         (min {:.3}, max {:.3}); storage read bytes per decode token {} B / active bytes {} B \
         (chosen experts + other file pages resident after the step): median per step {:.3}",
        median(&ratios),
        ratios[0],
        ratios[ratios.len() - 1],
        read_total / DECODE as u64,
        active_total / DECODE,
        median(&read_ratios),
    );
}

/// [`run`], with the file made cold before each decode step; `hook(step, false)` is called just
/// before the step (the file cold), `hook(step, true)` after it.
fn run_with(model: &Model, cache: &WeightCache, mut hook: impl FnMut(usize, bool)) {
    run(model, |i, done| {
        if !done {
            cache.make_cold().unwrap();
        }
        hook(i, done);
    });
}
