//! The loader and graph features of every supported family on synthetic random-weight models
//! (`benches/support/synthetic.rs`): each loads and runs with chunking-independent results,
//! the features do what they claim (sliding windows cut the receptive field, soft-caps bound
//! the logits), and files that contradict themselves fail at load with the key or tensor named.
//! Agreement with llama.cpp is `tests/arch_models.rs`'s job.

#[path = "../benches/support/synthetic.rs"]
mod synthetic;

use std::sync::Arc;

use gpu_pipeline::{
    ActivationSplit, LayerRope, LogitsWanted, Model, ModelError, ModelOptions, SeqStep,
};
use kv_ring::{KvDtype, KvPool, RingMode};
use synthetic::{ARCHES, Dims, Meta, build, build_in, build_with, build_without};
use weight_cache::Gguf;

const DIMS: Dims = Dims {
    n_embd: 128,
    n_ff: 256,
    n_layers: 6,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 32,
    vocab: 96,
    ctx: 512,
};

fn load(bytes: Vec<u8>) -> Result<Model, ModelError> {
    let g = Gguf::from_bytes(bytes).expect("valid GGUF image");
    Model::load(Arc::new(g), ModelOptions::default().with_threads(2))
}

/// Teacher-forced logits of `tokens`, fed in chunks of `chunk`.
fn logits(model: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let pool = KvPool::new(model.kv_shape(KvDtype::F32), 64 << 20).unwrap();
    let mut kv = pool.alloc(tokens.len(), RingMode::Strict).unwrap();
    run(model, &mut kv, tokens, chunk)
}

/// Feeds `tokens` in chunks of `chunk` through `kv`; every position's logits.
fn run(model: &Model, kv: &mut kv_ring::KvRing, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut all = Vec::new();
    let mut out = Vec::new();
    for c in tokens.chunks(chunk) {
        model
            .forward(
                &mut [SeqStep {
                    tokens: c,
                    kv: &mut *kv,
                    logits: LogitsWanted::All,
                }],
                &mut out,
            )
            .unwrap();
        all.extend_from_slice(&out);
    }
    all
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) % DIMS.vocab as u32)
        .collect()
}

#[test]
fn every_family_loads_runs_and_is_chunking_invariant() {
    for arch in ARCHES {
        let model = load(build(arch, DIMS, 1).build()).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let t = tokens(150, 3);
        let whole = logits(&model, &t, t.len());
        assert!(
            whole.iter().all(|v| v.is_finite()),
            "{arch}: non-finite logits"
        );
        for chunk in [1usize, 7, 64] {
            let got = logits(&model, &t, chunk);
            assert!(
                whole
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{arch}: chunks of {chunk} differ from one step"
            );
        }
    }
}

/// Past `KEY_CHUNK` (512) keys a row's attention runs chunk by chunk, and a decode step of a
/// few sequences spreads one row's chunks over the threads (split tasks, merged after): a
/// 1100-token text decoded one token at a time (split) gives the same bits at every position
/// as one prefill (whole blocks, each chunked inside the kernel), with one thread and two, with
/// and without sliding windows longer than a chunk and soft-capping.
#[test]
fn long_contexts_split_over_threads_are_bit_identical() {
    let dims = Dims { ctx: 2048, ..DIMS };
    let window = [
        ("gemma2.attention.sliding_window", Meta::U32(700)),
        ("gemma2.attention.sliding_window_pattern", Meta::U32(2)),
    ];
    for (arch, set) in [
        ("llama", &[][..]),
        ("gemma2", &window[..]),
        ("qwen3", &[][..]),
    ] {
        let img = build_with(arch, dims, 4, &[], set).build();
        let t = tokens(1100, 9);
        let mut got = Vec::new();
        for threads in [1, 2] {
            let g = Gguf::from_bytes(img.clone()).expect("valid GGUF image");
            let model = Model::load(Arc::new(g), ModelOptions::default().with_threads(threads))
                .unwrap_or_else(|e| panic!("{arch}: {e}"));
            if arch == "gemma2" {
                assert!(model.config().layers.iter().any(|l| l.window == Some(700)));
            }
            got.push(logits(&model, &t, t.len()));
            got.push(logits(&model, &t, 1));
        }
        for (i, g) in got.iter().enumerate().skip(1) {
            assert!(
                got[0]
                    .iter()
                    .zip(g)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{arch}: run {i} (threads {}, chunk {}) differs from one prefill",
                1 + i / 2,
                if i % 2 == 0 { t.len() } else { 1 }
            );
        }
    }
}

/// The activation split recovers the precision of the 8-bit activations of integer-quantized
/// weights; float weights take f32 activations, so it must leave their products alone: an F16
/// model's logits are the same bits with every product split as with none (a dense and a
/// mixture-of-experts family), while its Q8_0 twin's differ.
#[test]
fn activation_split_leaves_float_weights_alone() {
    let with = |bytes: Vec<u8>, split: ActivationSplit| {
        let g = Gguf::from_bytes(bytes).expect("valid GGUF image");
        let opts = ModelOptions::default()
            .with_threads(2)
            .with_activation_split(split);
        let model = Model::load(Arc::new(g), opts).expect("loads");
        logits(&model, &tokens(40, 5), 40)
    };
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    for arch in ["llama", "qwen3moe"] {
        let f16 = || build_in(arch, DIMS, 2, weight_cache::GgmlType::F16).build();
        assert_eq!(
            bits(with(f16(), ActivationSplit::All)),
            bits(with(f16(), ActivationSplit::Off)),
            "{arch} F16: the split changed float products"
        );
        let q8 = || build(arch, DIMS, 2).build();
        assert_ne!(
            bits(with(q8(), ActivationSplit::All)),
            bits(with(q8(), ActivationSplit::Off)),
            "{arch} Q8_0: the split should change quantized products"
        );
    }
}

#[test]
fn family_configs_follow_llama_cpp() {
    let cfg = |arch: &str| load(build(arch, DIMS, 1).build()).unwrap().config().clone();
    let g2 = cfg("gemma2");
    // Gemma 2: every other layer slides (pattern 2), soft-caps 50 / 30, embedding * sqrt(d).
    let w: Vec<_> = g2.layers.iter().map(|l| l.window).collect();
    assert_eq!(w, [Some(64), None, Some(64), None, Some(64), None]);
    assert_eq!(
        (g2.attn_softcap, g2.final_softcap),
        (Some(50.0), Some(30.0))
    );
    assert_eq!(g2.embedding_scale, (128f32).sqrt());
    assert!(g2.post_norms && g2.qk_norm == gpu_pipeline::QkNorm::Off);
    // Gemma 3: 5 local : 1 global, local layers on their own RoPE base.
    let g3 = cfg("gemma3");
    let r: Vec<_> = g3.layers.iter().map(|l| l.rope).collect();
    assert_eq!(r[..5], [LayerRope::Local; 5]);
    assert_eq!(r[5], LayerRope::Global);
    assert_eq!(g3.layers[5].window, None);
    assert_eq!(g3.rope_local.as_ref().map(|r| r.theta), Some(10_000.0));
    assert_eq!(g3.rope.theta, 1_000_000.0);
    assert!(
        g3.qk_norm == gpu_pipeline::QkNorm::PerHead && g3.post_norms && g3.attn_softcap.is_none()
    );
    // SmolLM3: every fourth layer without RoPE.
    let s3 = cfg("smollm3");
    let r: Vec<_> = s3.layers.iter().map(|l| l.rope).collect();
    assert_eq!(r[3], LayerRope::Off);
    assert_eq!(r.iter().filter(|&&r| r == LayerRope::Off).count(), 1);
    // Phi-3: LongRoPE factors and attention factor.
    let p3 = cfg("phi3");
    assert!(p3.rope.long_freq_factors.is_some() && p3.rope.freq_factors.is_some());
    assert_eq!((p3.rope.original_context, p3.rope.attn_factor), (128, 1.19));
}

#[test]
fn sliding_windows_cut_the_receptive_field() {
    // All 6 layers slide over 8 keys: position p sees tokens >= p - 6 * 7 only.
    let set = [
        ("gemma2.attention.sliding_window", Meta::U32(8)),
        ("gemma2.attention.sliding_window_pattern", Meta::U32(0)),
    ];
    let img = build_with("gemma2", DIMS, 2, &[], &set).build();
    let model = load(img).unwrap();
    assert!(model.config().layers.iter().all(|l| l.window == Some(8)));
    let a = tokens(60, 5);
    let mut b = a.clone();
    b[0] = (b[0] + 1) % DIMS.vocab as u32;
    let (la, lb) = (logits(&model, &a, 9), logits(&model, &b, 9));
    let v = DIMS.vocab;
    let row = |l: &[f32], p: usize| l[p * v..(p + 1) * v].to_vec();
    assert_ne!(
        row(&la, 42),
        row(&lb, 42),
        "token 0 is inside position 42's field"
    );
    for p in 43..60 {
        assert_eq!(row(&la, p), row(&lb, p), "position {p} saw token 0");
    }
}

/// Teacher-forced logits through a ring of a pool whose window layers keep only their last
/// rows (`Model::kv_windows`, chunks of up to `max_chunk`), and that ring's size.
fn windowed_logits(
    model: &Model,
    tokens: &[u32],
    chunk: usize,
    max_chunk: usize,
) -> (Vec<f32>, usize) {
    let pool = KvPool::with_layer_windows(
        model.kv_shape(KvDtype::F32),
        64 << 20,
        model.kv_windows(),
        max_chunk,
    )
    .unwrap();
    let mut kv = pool.alloc(tokens.len(), RingMode::Strict).unwrap();
    let all = run(model, &mut kv, tokens, chunk);
    assert!(
        model
            .kv_windows()
            .iter()
            .enumerate()
            .any(|(l, w)| w.is_some() && kv.layer_len(l) < kv.len()),
        "no window layer dropped a row: a weak test"
    );
    (all, kv.allocated_bytes())
}

#[test]
fn window_layers_on_their_own_rows_give_the_full_caches_logits_in_less_memory() {
    // Gemma 2 (every other layer over 64 positions), Gemma 3 (5 of 6 over 64), and an
    // all-window Llama (Mistral-style, 32 positions): 150 tokens, past every window.
    let mistral = [("llama.attention.sliding_window", Meta::U32(32))];
    for (arch, set) in [
        ("gemma2", &[][..]),
        ("gemma3", &[][..]),
        ("llama", &mistral[..]),
    ] {
        let model = load(build_with(arch, DIMS, 4, &[], set).build()).unwrap();
        assert!(
            model.kv_windows().iter().any(Option::is_some),
            "{arch}: no window layer"
        );
        let t = tokens(150, 9);
        let full = logits(&model, &t, t.len());
        let plain_bytes = KvPool::new(model.kv_shape(KvDtype::F32), 1 << 30)
            .unwrap()
            .ring_bytes(t.len())
            .unwrap();
        for (chunk, max_chunk) in [(1usize, 1usize), (7, 7), (7, 16), (20, 20)] {
            let (got, bytes) = windowed_logits(&model, &t, chunk, max_chunk);
            assert!(
                full.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{arch}: chunks of {chunk} (limit {max_chunk}) differ from the full cache"
            );
            assert!(bytes < plain_bytes, "{arch}: {bytes} >= {plain_bytes}");
        }
        // A chunk over the pool's limit is refused before anything changes.
        let pool = KvPool::with_layer_windows(
            model.kv_shape(KvDtype::F32),
            1 << 26,
            model.kv_windows(),
            8,
        )
        .unwrap();
        let mut kv = pool.alloc(64, RingMode::Strict).unwrap();
        let e = model
            .forward(
                &mut [SeqStep {
                    tokens: &t[..9],
                    kv: &mut kv,
                    logits: LogitsWanted::Last,
                }],
                &mut Vec::new(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("9"), "{e}");
        assert_eq!(kv.len(), 0);
    }
}

#[test]
fn final_softcap_bounds_the_logits() {
    let model = load(
        build_with(
            "gemma2",
            DIMS,
            3,
            &[],
            &[("gemma2.final_logit_softcapping", Meta::F32(2.0))],
        )
        .build(),
    )
    .unwrap();
    let l = logits(&model, &tokens(20, 1), 20);
    assert!(l.iter().all(|v| v.abs() <= 2.0), "a logit beyond the cap");
    assert!(
        l.iter().any(|v| v.abs() > 1.5),
        "the cap is not reached: weak test"
    );
}

#[test]
fn contradictions_fail_at_load_naming_the_culprit() {
    let err = |b: weight_cache::GgufBuilder| load(b.build()).err().map(|e| e.to_string());
    let with = |arch: &str, key: &str, v: Meta| build_with(arch, DIMS, 1, &[], &[(key, v)]);
    let unknown = with("llama", "general.architecture", Meta::Str("mamba".into()));
    assert!(err(unknown).unwrap().contains("\"mamba\""));
    for (arch, missing, named) in [
        (
            "gemma2",
            "blk.2.post_ffw_norm.weight",
            "blk.2.post_ffw_norm.weight",
        ),
        (
            "gemma3",
            "blk.0.attn_k_norm.weight",
            "blk.0.attn_k_norm.weight",
        ),
        (
            "qwen3",
            "blk.5.attn_q_norm.weight",
            "blk.5.attn_q_norm.weight",
        ),
        ("llama", "blk.1.ffn_down.weight", "blk.1.ffn_down.weight"),
        // Without the fused tensor the loader looks for separate Q/K/V.
        ("phi3", "blk.0.attn_qkv.weight", "blk.0.attn_q.weight"),
    ] {
        let e = err(build_without(arch, DIMS, 1, &[missing])).unwrap();
        assert!(e.contains(&format!("{named:?}")), "{arch}: {e}");
    }
    // Metadata saying a wider MLP than the tensors have.
    let e = err(with("qwen2", "qwen2.feed_forward_length", Meta::U32(512))).unwrap();
    assert!(e.contains("ffn_gate") && e.contains("512"), "{e}");
    let e = err(with(
        "gemma3",
        "gemma3.attention.head_count_kv",
        Meta::U32(3),
    ))
    .unwrap();
    assert!(e.contains("head_count_kv"), "{e}");
    let e = err(with(
        "llama",
        "llama.rope.scaling.type",
        Meta::Str("yarn".into()),
    ))
    .unwrap();
    assert!(e.contains("yarn"), "{e}");
}

#[test]
fn bad_expert_metadata_fails_with_typed_errors() {
    let with = |arch: &str, set: &[(&str, Meta)]| load(build_with(arch, DIMS, 1, &[], set).build());
    for (arch, experts, used) in [
        ("qwen3moe", 0, 2),
        ("olmoe", 8, 0),
        ("qwen3moe", 8, 9),
        ("qwen2moe", 5000, 2),
    ] {
        let set = [
            (format!("{arch}.expert_count"), Meta::U32(experts)),
            (format!("{arch}.expert_used_count"), Meta::U32(used)),
        ];
        let set: Vec<(&str, Meta)> = set.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        match with(arch, &set) {
            Err(ModelError::ExpertCount {
                experts: e,
                used: u,
                ..
            }) => assert_eq!((e, u), (experts, used), "{arch}"),
            other => panic!("{arch} {experts}/{used}: {other:?}"),
        }
    }
    // Metadata that disagrees with the stacked tensors names the tensor and both shapes.
    let set = [("qwen3moe.expert_count", Meta::U32(4))];
    match with("qwen3moe", &set) {
        Err(ModelError::BadShape {
            tensor,
            expected,
            actual,
        }) => {
            assert_eq!(tensor, "blk.0.ffn_gate_inp.weight");
            assert_eq!((expected[1], actual[1]), (4, synthetic::EXPERTS.0 as u64));
        }
        other => panic!("{other:?}"),
    }
    let set = [("qwen3moe.expert_feed_forward_length", Meta::U32(96))];
    match with("qwen3moe", &set) {
        Err(ModelError::BadShape {
            tensor, expected, ..
        }) => {
            assert_eq!(tensor, "blk.0.ffn_gate_exps.weight");
            assert_eq!(expected, [128, 96, synthetic::EXPERTS.0 as u64]);
        }
        other => panic!("{other:?}"),
    }
    // Dense llama without expert tensors but with a count: the missing tensor is named.
    let set = [
        ("llama.expert_count", Meta::U32(8)),
        ("llama.expert_used_count", Meta::U32(2)),
    ];
    let e = with("llama", &set).unwrap_err().to_string();
    assert!(e.contains("blk.0.ffn_gate_inp.weight"), "{e}");
    // Skipping an expert tensor names it.
    let e = load(build_without("olmoe", DIMS, 1, &["blk.1.ffn_down_exps.weight"]).build())
        .unwrap_err()
        .to_string();
    assert!(e.contains("blk.1.ffn_down_exps.weight"), "{e}");
}

#[test]
fn moe_configs_follow_llama_cpp() {
    let cfg = |arch: &str| load(build(arch, DIMS, 1).build()).unwrap().config().clone();
    let (q3, mx, ol, q2) = (
        cfg("qwen3moe"),
        cfg("llama-moe"),
        cfg("olmoe"),
        cfg("qwen2moe"),
    );
    let m = |c: &gpu_pipeline::ModelConfig| c.moe.clone().expect("experts");
    assert!(m(&q3).norm_weights && m(&mx).norm_weights);
    assert!(!m(&ol).norm_weights && !m(&q2).norm_weights);
    assert_eq!((m(&q3).n_experts, m(&q3).n_used), synthetic::EXPERTS);
    assert_eq!(m(&q2).n_ff_shared, Some(synthetic::expert_ff(DIMS)));
    assert_eq!(q3.qk_norm, gpu_pipeline::QkNorm::PerHead);
    assert_eq!(ol.qk_norm, gpu_pipeline::QkNorm::Full);
    assert!(cfg("llama").moe.is_none());
}

mod fuzz {
    //! Loading never panics on metadata or bytes a file may hold, and what loads runs.

    use super::*;
    use proptest::prelude::*;

    const SMALL: Dims = Dims {
        n_embd: 64,
        n_ff: 128,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 32,
        vocab: 40,
        ctx: 64,
    };

    const KEYS: &[&str] = &[
        "block_count",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.value_length",
        "context_length",
        "rope.dimension_count",
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "rope.scaling.original_context_length",
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
    ];
    const FLOAT_KEYS: &[&str] = &[
        "attention.layer_norm_rms_epsilon",
        "rope.freq_base",
        "rope.freq_base_swa",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "attention.scale",
        "rope.scaling.factor",
        "rope.scaling.attn_factor",
    ];

    fn run(bytes: Vec<u8>) {
        let Ok(g) = Gguf::from_bytes(bytes) else {
            return;
        };
        let Ok(model) = Model::load(Arc::new(g), ModelOptions::default().with_threads(1)) else {
            return;
        };
        let pool = KvPool::new(model.kv_shape(KvDtype::F32), 16 << 20).unwrap();
        let mut kv = pool.alloc(8, RingMode::Strict).unwrap();
        let mut out = Vec::new();
        let t = [0u32, 1, 2];
        model
            .forward(
                &mut [SeqStep {
                    tokens: &t,
                    kv: &mut kv,
                    logits: LogitsWanted::All,
                }],
                &mut out,
            )
            .expect("a model that loads runs");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_integer_metadata(arch in 0..ARCHES.len(), key in 0..KEYS.len(), v in prop_oneof![0u32..4, 0u32..300, any::<u32>()]) {
            let arch = ARCHES[arch];
            let set = [(format!("{}.{}", arch.trim_end_matches("-moe"), KEYS[key]), Meta::U32(v))];
            let set: Vec<(&str, Meta)> = set.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            run(build_with(arch, SMALL, 1, &[], &set).build());
        }

        #[test]
        fn any_float_metadata(arch in 0..ARCHES.len(), key in 0..FLOAT_KEYS.len(), v in prop_oneof![Just(0.0f32), Just(-1.0), Just(f32::NAN), Just(f32::INFINITY), -10.0f32..1e7]) {
            let arch = ARCHES[arch];
            let set = [(format!("{}.{}", arch.trim_end_matches("-moe"), FLOAT_KEYS[key]), Meta::F32(v))];
            let set: Vec<(&str, Meta)> = set.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            run(build_with(arch, SMALL, 1, &[], &set).build());
        }

        #[test]
        fn any_corrupted_header_byte(arch in 0..ARCHES.len(), at in 0usize..4096, v in any::<u8>()) {
            let mut bytes = build(ARCHES[arch], SMALL, 1).build();
            let i = at % bytes.len().min(4096);
            bytes[i] = v;
            run(bytes);
        }
    }
}

/// `forward` sets `out` to exactly the wanted rows' logits whatever it held (it is not
/// zero-filled first: a longer buffer of NaN is cut to length and every logit written), and an
/// error leaves it empty.
#[test]
fn forward_overwrites_whatever_the_logits_buffer_held() {
    let model = load(build("llama", DIMS, 1).build()).unwrap();
    let toks = tokens(12, 3);
    let fresh = logits(&model, &toks, 12);
    let pool = KvPool::new(model.kv_shape(KvDtype::F32), 64 << 20).unwrap();
    let mut kv = pool.alloc(toks.len(), RingMode::Strict).unwrap();
    let mut out = vec![f32::NAN; 100 * DIMS.vocab];
    model
        .forward(
            &mut [SeqStep {
                tokens: &toks,
                kv: &mut kv,
                logits: LogitsWanted::All,
            }],
            &mut out,
        )
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out), bits(&fresh));
    let mut kv2 = pool.alloc(4, RingMode::Strict).unwrap();
    let bad = [DIMS.vocab as u32];
    let r = model.forward(
        &mut [SeqStep {
            tokens: &bad,
            kv: &mut kv2,
            logits: LogitsWanted::All,
        }],
        &mut out,
    );
    assert!(r.is_err() && out.is_empty());
}
