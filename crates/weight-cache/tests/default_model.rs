//! The default model (SmolLM2-135M-Instruct Q4_1) opens, its metadata reads, and every tensor is
//! reachable, in bounds and dequantizable. Needs `scripts/fetch-model`.

use std::collections::BTreeMap;

use weight_cache::{GgmlType, Gguf, locate_default_model};

fn open() -> Gguf {
    let path = locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: tests never modify the model file.
    unsafe { Gguf::open(&path) }.unwrap()
}

#[test]
fn opens_and_lists_dtypes() {
    let g = open();
    assert!(matches!(g.version(), 2 | 3));
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for t in g.tensors() {
        *counts.entry(t.dtype.name()).or_default() += 1;
    }
    println!("tensor dtypes: {counts:?}");
    for t in g.tensors().take(12) {
        println!("{:<28} {:<5} {:?} @ {}", t.name, t.dtype, t.shape, t.offset);
    }
    assert_eq!(g.tensor_count(), counts.values().sum::<usize>());
    assert_eq!(g.get_str("general.architecture"), Some("llama"));
    let n_layers = g.get_u32("llama.block_count").unwrap();
    let n_embd = g.get_u32("llama.embedding_length").unwrap() as u64;
    assert!(g.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap() > 0.0);
    assert!(
        g.get_str("tokenizer.chat_template")
            .unwrap()
            .contains("im_start")
    );
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(tokens.len(), types.len());
    assert_eq!(
        g.get_u32("llama.vocab_size").map(|v| v as usize),
        Some(tokens.len())
    );
    assert!(g.get_bool("tokenizer.ggml.add_bos_token").is_some());
    // Every layer's tensors exist, with the embedding width as row length of q.
    for l in 0..n_layers {
        let q = g.tensor(&format!("blk.{l}.attn_q.weight")).unwrap();
        assert_eq!(q.shape[0], n_embd);
        assert!(g.tensor(&format!("blk.{l}.attn_norm.weight")).is_some());
    }
    let emb = g.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.shape, &[n_embd, tokens.len() as u64]);
}

#[test]
fn every_tensor_is_in_bounds_and_dequantizes() {
    let g = open();
    let mut prev_end = g.data_offset() as u64;
    let mut row = Vec::new();
    for t in g.tensors() {
        assert!(t.offset >= prev_end, "{} overlaps its predecessor", t.name);
        prev_end = t.offset + t.data.len() as u64;
        assert_eq!(t.data.len(), t.row_bytes() * t.rows());
        assert_eq!(t.offset % g.alignment(), 0);
        assert_eq!(
            t.data.as_ptr() as usize % 8,
            0,
            "{} data is aligned",
            t.name
        );
        assert!(t.dtype.can_dequantize(), "{} is {}", t.name, t.dtype);
        row.resize(t.row_len(), f32::NAN);
        for r in [0, t.rows() - 1] {
            t.dequantize_row(r, &mut row).unwrap();
            assert!(row.iter().all(|v| v.is_finite()), "{} row {r}", t.name);
        }
        assert_eq!(g.tensor(t.name).unwrap().offset, t.offset);
    }
    assert!(prev_end <= g.bytes().len() as u64);
    // F32 norms: the first attn_norm weights are non-trivial.
    let norm = g.tensor("blk.0.attn_norm.weight").unwrap();
    assert_eq!(norm.dtype, GgmlType::F32);
    assert!(norm.to_f32().unwrap().iter().any(|v| *v != 0.0));
}
