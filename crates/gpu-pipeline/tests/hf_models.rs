//! Hugging Face model directories, end to end against transformers.
//!
//! Fixtures: `tests/fixtures/hf/<name>/` (tiny random models of every served family, F32, some
//! BF16/F16 copies, one sharded; the mixtures of experts Mixtral, Qwen3-MoE with a dense layer,
//! OLMoE, Qwen2-MoE, and Mixtral's weights stored as transformers 5's fused 3-D experts) and `tests/fixtures/hf-logits.json` (transformers' fp32
//! teacher-forced logits), made by `scripts/fixtures/gpu-pipeline-hf-fixtures.py`.
//!
//! F32 directories: at every position, max |logit - transformers| is below 1e-3 of that
//! position's max |logit|, with the sequence run whole and in chunks of 5 tokens. BF16/F16
//! directories: top-1 equals transformers' (the rounded weights computed in fp32) wherever its
//! top-2 gap exceeds 1e-3 of the position's scale.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use common::{argmax, ids_of, ring};
use gpu_pipeline::{HfModel, LogitsWanted, Model, ModelOptions, SeqStep, WeightSource};
use kv_ring::KvDtype;
use serde_json::Value;

fn fixture() -> &'static Value {
    static F: OnceLock<Value> = OnceLock::new();
    F.get_or_init(|| {
        let p = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-logits.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    })
}

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// The model of directory `name`, serving the fixture's `context` when it names one.
fn load(name: &str) -> Model {
    load_with(name, fixture()["models"][name]["context"].as_u64())
}

fn load_with(name: &str, context: Option<u64>) -> Model {
    // SAFETY: the fixtures are not modified while the tests run.
    let src = unsafe { HfModel::open(dir(name)) }
        .unwrap_or_else(|e| panic!("{name}: does not open: {e}"));
    let mut opts = ModelOptions::default();
    if let Some(ctx) = context {
        opts = opts.with_context(ctx as usize);
    }
    Model::load_source(Arc::new(src), opts).unwrap_or_else(|e| panic!("{name}: does not load: {e}"))
}

/// Teacher-forced logits of every position, feeding `chunk` tokens per forward call.
fn logits(model: &Model, ids: &[u32], chunk: usize) -> Vec<f32> {
    let mut kv = ring(model, KvDtype::F32, ids.len());
    let mut all = Vec::with_capacity(ids.len() * model.config().vocab_size);
    let mut out = Vec::new();
    for part in ids.chunks(chunk) {
        model
            .forward(
                &mut [SeqStep {
                    tokens: part,
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

/// Max |ours - want| / max |want| over one row, and where.
fn row_error(ours: &[f32], want: &Value) -> (f64, usize, f64) {
    let want: Vec<f64> = want
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(ours.len(), want.len(), "vocabulary size");
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    let (mut err, mut at) = (0f64, 0);
    for (i, (&o, &w)) in ours.iter().zip(&want).enumerate() {
        let e = (f64::from(o) - w).abs();
        if e > err {
            (err, at) = (e, i);
        }
    }
    (err / scale, at, want[at])
}

/// Phi-3 past `original_max_position_embeddings`, served with the default context (its
/// `max_position_embeddings`): the long LongRoPE factors, as transformers uses them for a
/// sequence that long.
#[test]
fn phi3_long_sequence_uses_the_long_rope_factors_as_transformers() {
    let long = &fixture()["models"]["phi3"]["long"];
    let model = load_with("phi3", None);
    let vocab = model.config().vocab_size;
    let ids = ids_of(&long["ids"]);
    let got = logits(&model, &ids, ids.len());
    for (p, want) in long["positions"]
        .as_array()
        .unwrap()
        .iter()
        .zip(long["logits"].as_array().unwrap())
    {
        let p = p.as_u64().unwrap() as usize;
        let ours = &got[p * vocab..(p + 1) * vocab];
        let (rel, at, w) = row_error(ours, want);
        assert!(
            rel < 1e-3,
            "phi3 (long): position {p}: relative error {rel:.2e} at token {at} ({} vs {w})",
            ours[at]
        );
    }
}

fn check_f32(name: &str) {
    let model = load(name);
    let vocab = model.config().vocab_size;
    let entry = &fixture()["models"][name];
    assert_eq!(entry["dtype"], "F32");
    // The same weights as another directory (mixtral-fused: mixtral's, stored fused).
    let logits_of = entry["logits_of"].as_str().unwrap_or(name);
    let mut worst = 0f64;
    for (seq, want) in fixture()["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .zip(fixture()["models"][logits_of]["logits"].as_array().unwrap())
    {
        let ids = ids_of(seq);
        let want = want.as_array().unwrap();
        for chunk in [ids.len(), 5] {
            let got = logits(&model, &ids, chunk);
            for (p, row) in want.iter().enumerate() {
                let ours = &got[p * vocab..(p + 1) * vocab];
                let (rel, at, w) = row_error(ours, row);
                worst = worst.max(rel);
                assert!(
                    rel < 1e-3,
                    "{name}: sequence of {} tokens, chunks of {chunk}: position {p}: \
                     |logit - transformers| / max |logit| = {rel:.2e} at token {at} \
                     ({} vs {w})",
                    ids.len(),
                    ours[at],
                );
            }
        }
    }
    eprintln!("{name}: max |logit - transformers| / scale = {worst:.2e}");
}

fn check_low_precision(name: &str) {
    let model = load(name);
    let vocab = model.config().vocab_size;
    let entry = &fixture()["models"][name];
    let (mut decisive, mut agree) = (0, 0);
    for (seq, want) in fixture()["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .zip(entry["top1"].as_array().unwrap())
    {
        let ids = ids_of(seq);
        let got = logits(&model, &ids, ids.len());
        for (p, w) in want.as_array().unwrap().iter().enumerate() {
            let (top, gap, scale) = (
                w[0].as_u64().unwrap() as usize,
                w[1].as_f64().unwrap(),
                w[2].as_f64().unwrap(),
            );
            if gap <= 1e-3 * scale {
                continue;
            }
            decisive += 1;
            let ours = argmax(&got[p * vocab..(p + 1) * vocab]);
            assert_eq!(
                ours,
                top,
                "{name}: sequence of {} tokens: position {p}: top-1 {ours}, transformers {top} \
                 (gap {gap:.4}, scale {scale:.3})",
                ids.len()
            );
            agree += 1;
        }
    }
    assert!(
        decisive > 20,
        "{name}: too few decisive positions ({decisive})"
    );
    eprintln!("{name}: top-1 {agree}/{decisive}");
}

macro_rules! hf_tests {
    ($($test:ident => $check:ident($name:literal),)*) => {
        $(
            #[test]
            fn $test() {
                $check($name);
            }
        )*

        /// Every model of the fixture has a test above.
        #[test]
        fn every_fixture_model_is_tested() {
            let tested = [$($name),*];
            for name in fixture()["models"].as_object().unwrap().keys() {
                assert!(tested.contains(&name.as_str()), "{name} has no test");
            }
        }
    };
}

hf_tests! {
    llama3_rope_scaling_matches_transformers => check_f32("llama"),
    mistral_sliding_window_matches_transformers => check_f32("mistral"),
    qwen2_sharded_with_biases_matches_transformers => check_f32("qwen2"),
    qwen3_qk_norm_matches_transformers => check_f32("qwen3"),
    gemma2_softcaps_and_windows_match_transformers => check_f32("gemma2"),
    gemma3_local_global_layers_match_transformers => check_f32("gemma3"),
    phi3_fused_longrope_matches_transformers => check_f32("phi3"),
    smollm3_no_rope_layers_match_transformers => check_f32("smollm3"),
    mixtral_per_expert_tensors_match_transformers => check_f32("mixtral"),
    mixtral_fused_gate_up_experts_match_transformers => check_f32("mixtral-fused"),
    qwen3moe_with_a_dense_layer_matches_transformers => check_f32("qwen3moe"),
    olmoe_unnormalised_weights_match_transformers => check_f32("olmoe"),
    qwen2moe_shared_expert_matches_transformers => check_f32("qwen2moe"),
    llama_bf16_top1_matches_transformers => check_low_precision("llama-bf16"),
    qwen3_bf16_top1_matches_transformers => check_low_precision("qwen3-bf16"),
    gemma2_bf16_top1_matches_transformers => check_low_precision("gemma2-bf16"),
    mistral_f16_top1_matches_transformers => check_low_precision("mistral-f16"),
}

/// The tokenizer and chat template of every directory load and agree with the `tokenizers`
/// library's ids and transformers' `apply_chat_template` rendering.
#[test]
fn tokenizer_and_chat_template_match_transformers_in_every_directory() {
    let reference = &fixture()["tokenizer"];
    let text = reference["text"].as_str().unwrap();
    let chat_text = reference["chat"].as_str().unwrap();
    let messages: Vec<token_stream::TemplateMessage<'_>> = reference["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            token_stream::TemplateMessage::new(
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap(),
            )
        })
        .collect();
    for name in fixture()["models"].as_object().unwrap().keys() {
        // SAFETY: the fixtures are not modified while the tests run.
        let src = unsafe { HfModel::open(dir(name)) }.unwrap();
        let tok = token_stream::Tokenizer::from_tokenizer_json_file(src.tokenizer_json_path())
            .unwrap_or_else(|e| panic!("{name}: tokenizer.json: {e}"));
        assert_eq!(
            tok.encode(text).to_vec(),
            ids_of(&reference["ids"]),
            "{name}: ids of {text:?}"
        );
        let template = src.chat_template().expect("chat_template");
        let chat = token_stream::ChatTemplate::new(&template, "<s>", "</s>")
            .unwrap_or_else(|e| panic!("{name}: chat template: {e}"));
        assert_eq!(chat.render(&messages, true).unwrap(), chat_text, "{name}");
        assert_eq!(
            tok.encode_with_specials(chat_text).to_vec(),
            ids_of(&reference["chat_ids"]),
            "{name}: ids of the chat"
        );
        assert_eq!(src.eos_token_ids(), [1], "{name}");
        assert_eq!(src.model_name().as_deref(), Some(name.as_str()));
        assert_eq!(src.get_u32("tokenizer.ggml.bos_token_id"), Some(0));
    }
}
