//! The model records its weight reads in an attached weight-cache (the live access profile).

use std::sync::Arc;

use gpu_pipeline::kernels::PackedWeights;
use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep, WeightPacking};
use kv_ring::{KvDtype, KvPool, RingMode};
use weight_cache::GgmlType;
use weight_cache::{CacheConfig, Gguf, WarmupStrategy, WeightCache};

fn open() -> Arc<Gguf> {
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the model file is not modified while the test runs.
    Arc::new(unsafe { Gguf::open(path) }.expect("open"))
}

/// Weights packed at load are computed from the model's own copy: the file's pages of them are
/// not read, so they are not touched (the profile and warm-up leave them alone).
#[test]
fn packed_weights_are_not_touched() {
    if !PackedWeights::supported(GgmlType::Q4_1) {
        return; // nothing packs on this CPU
    }
    let gguf = open();
    let model = Model::load(gguf.clone(), ModelOptions::default().with_threads(1)).unwrap();
    let cache = WeightCache::new(gguf, CacheConfig::default()).unwrap();
    model.attach_weight_cache(cache.clone()).unwrap();
    let pool = KvPool::new(model.kv_shape(KvDtype::F16), 16 << 20).unwrap();
    let mut kv = pool.alloc(64, RingMode::Strict).unwrap();
    let mut logits = Vec::new();
    let step = SeqStep {
        tokens: &[1u32, 9690, 198],
        kv: &mut kv,
        logits: LogitsWanted::Last,
    };
    model.forward(&mut [step], &mut logits).unwrap();
    // The default model is Q4_1 with a tied Q8_0 embedding: everything is packed.
    let s = cache.stats();
    assert_eq!((s.touches, s.tokens), (0, 1), "{s:?}");
}

#[test]
fn forward_touches_every_weight_tensor_once_per_call() {
    let gguf = open();
    let opts = ModelOptions::default()
        .with_threads(1)
        .with_packing(WeightPacking::Off);
    let model = Model::load(gguf.clone(), opts).unwrap();
    let cache = WeightCache::new(gguf.clone(), CacheConfig::default()).unwrap();
    // A cache over another mapping of the same file is refused (its indices would be fine,
    // but its residency answers would be about other pages).
    let other = WeightCache::new(open(), CacheConfig::default()).unwrap();
    assert!(model.attach_weight_cache(other).is_err());
    model.attach_weight_cache(cache.clone()).unwrap();
    assert!(
        model.attach_weight_cache(cache.clone()).is_err(),
        "only one cache"
    );

    let pool = KvPool::new(model.kv_shape(KvDtype::F16), 16 << 20).unwrap();
    let mut kv = pool.alloc(64, RingMode::Strict).unwrap();
    let mut logits = Vec::new();
    let layers = model.config().n_layers as u64;
    // Prefill (3 tokens) and two decode steps: embedding + 7 matrices per layer + output head.
    let per_call = 1 + 7 * layers + 1;
    let mut first_checked = 0;
    for (i, toks) in [&[1u32, 9690, 198][..], &[2683], &[359]].iter().enumerate() {
        model
            .forward(
                &mut [SeqStep {
                    tokens: toks,
                    kv: &mut kv,
                    logits: LogitsWanted::Last,
                }],
                &mut logits,
            )
            .unwrap();
        let s = cache.stats();
        assert_eq!(s.touches, per_call * (i as u64 + 1), "{s:?}");
        assert_eq!(s.tokens, i as u64 + 1);
        if i == 0 {
            first_checked = s.first_touch_blocks;
        }
    }
    // All three calls are one profiling request: only the first call's touches were first
    // touches (mincore checked).
    let s = cache.stats();
    assert!(first_checked > 0);
    assert_eq!(s.first_touch_blocks, first_checked);
    assert!(s.hit_rate.is_some());
    // The profile now ranks the weights forward really read: a deterministic plan over it
    // covers blocks of every layer's matrices, not only the static heuristic's first layers.
    let plan = cache.plan(WarmupStrategy::Deterministic {
        fraction: 1.0,
        mlock: false,
    });
    let table = cache.table();
    let last = gguf
        .tensor_index(&format!("blk.{}.ffn_down.weight", layers - 1))
        .unwrap();
    let range = table.tensor_blocks(last);
    assert!(
        plan.iter().any(|b| range.contains(b)),
        "last layer's ffn_down not in the plan"
    );
}
