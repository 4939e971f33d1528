//! Random-weight GGUF images of every supported architecture, written in memory with
//! `weight_cache::GgufBuilder` (llama.cpp's tensor names and metadata keys; Q8_0 matrices),
//! for the family bench (`benches/families.rs`) and the loader's error tests
//! (`tests/model_families.rs`). Not reference models: the llama.cpp-checked ones are written by
//! `scripts/make_arch_models.py`.

#![allow(dead_code)]

use weight_cache::{GgmlType, GgufBuilder};

/// Shape of a synthetic model.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub(crate) n_embd: usize,
    pub(crate) n_ff: usize,
    pub(crate) n_layers: usize,
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) vocab: usize,
    pub(crate) ctx: usize,
}

/// Every architecture `build` writes (`llama-moe`: `llama` with Mixtral's expert tensors).
pub(crate) const ARCHES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "smollm3",
    "qwen3moe",
    "llama-moe",
    "olmoe",
    "qwen2moe",
];

/// Experts of the mixture-of-experts architectures, and how many each token uses.
pub(crate) const EXPERTS: (usize, usize) = (16, 2);

/// The inner size of one expert (and of qwen2moe's shared expert): a quarter of `n_ff`.
pub(crate) fn expert_ff(d: Dims) -> usize {
    d.n_ff / 4
}

/// A small deterministic generator (xorshift).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `rows x cols` random Q8_0 matrix with values about `scale`.
fn q8_0(rng: &mut Rng, rows: usize, cols: usize, scale: f32) -> Vec<u8> {
    assert!(cols.is_multiple_of(32));
    let mut out = Vec::with_capacity(rows * cols / 32 * 34);
    for _ in 0..rows * cols / 32 {
        let d = half::f16::from_f32(scale / 127.0);
        out.extend_from_slice(&d.to_le_bytes());
        for _ in 0..32 {
            out.push((rng.next() % 255) as u8 ^ 0x80);
        }
    }
    out
}

/// The byte offsets, in a block of `dtype`, of its f16 scale `d` and (formats with one) its f16
/// scale of the minimums `dmin`: the fields [`random_blocks`] sets.
fn scale_fields(dtype: GgmlType) -> (usize, Option<usize>) {
    match dtype {
        GgmlType::Q2_K => (80, Some(82)),
        GgmlType::Q3_K => (108, None),
        GgmlType::Q4_K | GgmlType::Q5_K => (0, Some(2)),
        GgmlType::Q6_K => (208, None),
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => (0, None),
        other => panic!("{other:?}: use weight_cache::quantize"),
    }
}

/// `values.len() / cols` rows of random `dtype` blocks (a format without a reference quantizer
/// here: the K-quants and IQ4): random quants and sub-block scales, every block's `d` (and
/// `dmin`) one value each, chosen so that the weights have the mean 0 and the RMS of `values`
/// (for the formats with minimums the mean is set by `dmin`). Random weights of the right
/// size, not an encoding of `values`.
fn random_blocks(rng: &mut Rng, dtype: GgmlType, values: &[f32], cols: usize) -> Vec<u8> {
    let (d_at, dmin_at) = scale_fields(dtype);
    let bytes = dtype.row_bytes(cols).expect("whole blocks") * (values.len() / cols);
    let mut data: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
    let set = |data: &mut [u8], d: f32, dmin: f32| {
        for blk in data.chunks_exact_mut(dtype.type_size()) {
            blk[d_at..d_at + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            if let Some(at) = dmin_at {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(dmin).to_le_bytes());
            }
        }
    };
    let stats = |data: &[u8]| {
        let mut w = vec![0f32; values.len()];
        weight_cache::dequantize(dtype, data, &mut w).expect("dequantizable");
        let n = w.len() as f64;
        let mean = w.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let ms = w.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / n;
        (mean, ms)
    };
    // The weights are linear in `d` and `dmin`: their means at (1, 0) and (0, 1) give the ratio
    // that cancels the mean, and the RMS at that ratio the common factor.
    set(&mut data, 1.0, 0.0);
    let (mean_d, _) = stats(&data);
    let ratio = if dmin_at.is_some() {
        set(&mut data, 0.0, 1.0);
        let (mean_m, _) = stats(&data);
        -mean_d / mean_m
    } else {
        0.0
    };
    set(&mut data, 1.0, ratio as f32);
    let (_, ms) = stats(&data);
    let target = values
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        / values.len() as f64;
    let k = (target / ms).sqrt();
    set(&mut data, k as f32, (k * ratio) as f32);
    data
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn around_one(rng: &mut Rng, n: usize) -> Vec<u8> {
    f32s(&(0..n).map(|_| 1.0 + 0.1 * rng.unit()).collect::<Vec<_>>())
}

/// A metadata value (for [`build_with`]'s overrides).
#[derive(Clone, Debug)]
pub(crate) enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
}

/// The architecture's synthetic model.
pub(crate) fn build(arch: &str, d: Dims, seed: u64) -> GgufBuilder {
    build_with(arch, d, seed, &[], &[])
}

/// [`build`] without the tensors named in `skip`.
pub(crate) fn build_without(arch: &str, d: Dims, seed: u64, skip: &[&str]) -> GgufBuilder {
    build_with(arch, d, seed, skip, &[])
}

/// [`build`] without the tensors in `skip`, with the metadata in `set` added or replaced.
pub(crate) fn build_with(
    arch: &str,
    d: Dims,
    seed: u64,
    skip: &[&str],
    set: &[(&str, Meta)],
) -> GgufBuilder {
    build_full(arch, d, seed, skip, set, GgmlType::Q8_0)
}

/// [`build`] with its matrices in `matrices` (the Q8_0 ones dequantized and requantized: the
/// same values up to the format's rounding), for kernels of other formats. The K-quants and
/// IQ4, which weight-cache cannot quantize, get random blocks of the same mean and RMS
/// instead (`random_blocks`; their rows need a multiple of 256 columns for the 256-element
/// formats).
pub(crate) fn build_in(arch: &str, d: Dims, seed: u64, matrices: GgmlType) -> GgufBuilder {
    build_full(arch, d, seed, &[], &[], matrices)
}

fn build_full(
    arch: &str,
    d: Dims,
    seed: u64,
    skip: &[&str],
    set: &[(&str, Meta)],
    matrices: GgmlType,
) -> GgufBuilder {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ seed);
    let moe = arch.ends_with("moe") || arch == "llama-moe";
    let arch = if arch == "llama-moe" { "llama" } else { arch };
    let k = |s: &str| format!("{arch}.{s}");
    let mut meta: Vec<(String, Meta)> = vec![
        ("general.architecture".into(), Meta::Str(arch.into())),
        (
            "general.name".into(),
            Meta::Str(format!("synthetic-{arch}")),
        ),
        (k("block_count"), Meta::U32(d.n_layers as u32)),
        (k("embedding_length"), Meta::U32(d.n_embd as u32)),
        (k("feed_forward_length"), Meta::U32(d.n_ff as u32)),
        (k("attention.head_count"), Meta::U32(d.n_heads as u32)),
        (k("attention.head_count_kv"), Meta::U32(d.n_kv_heads as u32)),
        (k("attention.key_length"), Meta::U32(d.head_dim as u32)),
        (k("attention.value_length"), Meta::U32(d.head_dim as u32)),
        (k("context_length"), Meta::U32(d.ctx as u32)),
        (k("attention.layer_norm_rms_epsilon"), Meta::F32(1e-6)),
        (k("rope.freq_base"), Meta::F32(10_000.0)),
    ];
    match arch {
        "gemma2" => meta.extend([
            (k("attention.sliding_window"), Meta::U32(64)),
            (k("attn_logit_softcapping"), Meta::F32(50.0)),
            (k("final_logit_softcapping"), Meta::F32(30.0)),
        ]),
        "gemma3" => meta.extend([
            (k("attention.sliding_window"), Meta::U32(64)),
            (k("rope.freq_base_swa"), Meta::F32(10_000.0)),
            (k("rope.freq_base"), Meta::F32(1_000_000.0)),
        ]),
        "phi3" => meta.extend([
            (
                k("rope.scaling.original_context_length"),
                Meta::U32((d.ctx / 4) as u32),
            ),
            (k("rope.scaling.attn_factor"), Meta::F32(1.19)),
        ]),
        _ => {}
    }
    let (n_exp, n_used) = EXPERTS;
    let ffe = expert_ff(d);
    if moe {
        meta.extend([
            (k("expert_count"), Meta::U32(n_exp as u32)),
            (k("expert_used_count"), Meta::U32(n_used as u32)),
        ]);
        if arch.starts_with("qwen") {
            meta.push((k("expert_feed_forward_length"), Meta::U32(ffe as u32)));
        } else {
            // Mixtral and OLMoE size their experts by feed_forward_length.
            meta.push((k("feed_forward_length"), Meta::U32(ffe as u32)));
        }
        if arch == "qwen2moe" {
            meta.push((
                k("expert_shared_feed_forward_length"),
                Meta::U32(ffe as u32),
            ));
        }
    }
    for (key, v) in set {
        meta.push((key.to_string(), v.clone()));
    }
    let mut b = GgufBuilder::new();
    for (i, (key, v)) in meta.iter().enumerate() {
        if meta[i + 1..].iter().any(|(k2, _)| k2 == key) {
            continue; // a later entry replaces it
        }
        b = match v {
            Meta::U32(x) => b.kv_u32(key, *x),
            Meta::F32(x) => b.kv_f32(key, *x),
            Meta::Str(x) => b.kv_str(key, x),
        };
    }
    let (de, hd) = (d.n_embd as u64, d.head_dim as u64);
    let (qd, kvd, ff) = (
        d.n_heads as u64 * hd,
        d.n_kv_heads as u64 * hd,
        d.n_ff as u64,
    );
    // Matrices in a format without a reference quantizer draw their random blocks from here.
    let block_rng = std::cell::RefCell::new(Rng(0x2545_F491_4F6C_DD1D ^ seed));
    let t = |b: GgufBuilder, name: String, dtype: GgmlType, shape: &[u64], data: Vec<u8>| {
        if skip.contains(&name.as_str()) {
            b
        } else if dtype == GgmlType::Q8_0 && matrices != GgmlType::Q8_0 {
            let mut f = vec![0f32; data.len() / 34 * 32];
            weight_cache::dequantize(dtype, &data, &mut f).expect("Q8_0");
            let q = match weight_cache::quantize(matrices, &f) {
                Ok(q) => q,
                Err(_) => {
                    random_blocks(&mut block_rng.borrow_mut(), matrices, &f, shape[0] as usize)
                }
            };
            b.tensor(&name, matrices, shape, q)
        } else {
            b.tensor(&name, dtype, shape, data)
        }
    };
    let mut emb = q8_0(&mut rng, d.vocab, d.n_embd, 1.0);
    if moe {
        // Entry 0 of every embedding at the top of its range: a dimension all tokens share,
        // which the router's hot experts weigh (see `experts`).
        let row = d.n_embd / 32 * 34;
        for r in 0..d.vocab {
            emb[r * row + 2] = 127;
        }
    }
    b = t(
        b,
        "token_embd.weight".into(),
        GgmlType::Q8_0,
        &[de, d.vocab as u64],
        emb,
    );
    let on = around_one(&mut rng, d.n_embd);
    b = t(b, "output_norm.weight".into(), GgmlType::F32, &[de], on);
    if arch != "gemma2" && arch != "qwen2" {
        let out = q8_0(&mut rng, d.vocab, d.n_embd, 0.5);
        b = t(
            b,
            "output.weight".into(),
            GgmlType::Q8_0,
            &[de, d.vocab as u64],
            out,
        );
    }
    if arch == "phi3" {
        let half = hd / 2;
        let s: Vec<f32> = (0..half).map(|i| 1.0 + i as f32 * 0.01).collect();
        let l: Vec<f32> = (0..half).map(|i| 1.0 + i as f32 * 0.3).collect();
        b = t(
            b,
            "rope_factors_short.weight".into(),
            GgmlType::F32,
            &[half],
            f32s(&s),
        );
        b = t(
            b,
            "rope_factors_long.weight".into(),
            GgmlType::F32,
            &[half],
            f32s(&l),
        );
    }
    let ws = 1.0 / (d.n_embd as f32).sqrt() * 2.0;
    for l in 0..d.n_layers {
        let n = |s: &str| format!("blk.{l}.{s}");
        let an = around_one(&mut rng, d.n_embd);
        b = t(b, n("attn_norm.weight"), GgmlType::F32, &[de], an);
        if arch == "phi3" {
            let w = q8_0(&mut rng, (qd + 2 * kvd) as usize, d.n_embd, ws);
            b = t(
                b,
                n("attn_qkv.weight"),
                GgmlType::Q8_0,
                &[de, qd + 2 * kvd],
                w,
            );
        } else {
            for (name, rows) in [
                ("attn_q.weight", qd),
                ("attn_k.weight", kvd),
                ("attn_v.weight", kvd),
            ] {
                let w = q8_0(&mut rng, rows as usize, d.n_embd, ws);
                b = t(b, n(name), GgmlType::Q8_0, &[de, rows], w);
            }
        }
        if arch == "qwen2" || arch == "qwen2moe" {
            for (name, len) in [
                ("attn_q.bias", qd),
                ("attn_k.bias", kvd),
                ("attn_v.bias", kvd),
            ] {
                let v: Vec<f32> = (0..len).map(|_| 0.1 * rng.unit()).collect();
                b = t(b, n(name), GgmlType::F32, &[len], f32s(&v));
            }
        }
        if arch == "qwen3" || arch == "gemma3" || arch == "qwen3moe" {
            for name in ["attn_q_norm.weight", "attn_k_norm.weight"] {
                let v = around_one(&mut rng, d.head_dim);
                b = t(b, n(name), GgmlType::F32, &[hd], v);
            }
        }
        if arch == "olmoe" {
            // Over the whole query and key rows.
            for (name, len) in [("attn_q_norm.weight", qd), ("attn_k_norm.weight", kvd)] {
                let v = around_one(&mut rng, len as usize);
                b = t(b, n(name), GgmlType::F32, &[len], v);
            }
        }
        let wo = q8_0(&mut rng, d.n_embd, qd as usize, ws);
        b = t(b, n("attn_output.weight"), GgmlType::Q8_0, &[qd, de], wo);
        let mut fnorm = around_one(&mut rng, d.n_embd);
        if moe {
            // The shared dimension stays visible to the router in every layer.
            fnorm[..4].copy_from_slice(&4f32.to_le_bytes());
        }
        b = t(b, n("ffn_norm.weight"), GgmlType::F32, &[de], fnorm);
        if arch == "gemma2" || arch == "gemma3" {
            for name in ["post_attention_norm.weight", "post_ffw_norm.weight"] {
                let v = around_one(&mut rng, d.n_embd);
                b = t(b, n(name), GgmlType::F32, &[de], v);
            }
        }
        if moe {
            b = experts(b, &mut rng, &t, l, d, arch == "qwen2moe");
            continue;
        }
        if arch == "phi3" {
            let w = q8_0(&mut rng, 2 * d.n_ff, d.n_embd, ws);
            b = t(b, n("ffn_up.weight"), GgmlType::Q8_0, &[de, 2 * ff], w);
        } else {
            for name in ["ffn_gate.weight", "ffn_up.weight"] {
                let w = q8_0(&mut rng, d.n_ff, d.n_embd, ws);
                b = t(b, n(name), GgmlType::Q8_0, &[de, ff], w);
            }
        }
        let w = q8_0(
            &mut rng,
            d.n_embd,
            d.n_ff,
            1.0 / (d.n_ff as f32).sqrt() * 2.0,
        );
        b = t(b, n("ffn_down.weight"), GgmlType::Q8_0, &[ff, de], w);
    }
    b
}

/// Adds a tensor (name, type, shape, bytes) unless the build skips it.
type AddTensor<'a> = dyn Fn(GgufBuilder, String, GgmlType, &[u64], Vec<u8>) -> GgufBuilder + 'a;

/// Experts the router favours: every token's entry 0 is large (see `build_with`), and these
/// experts' router rows weigh it, so they win most tokens (a skewed router, as in trained
/// models); the others win when a token's random part outweighs that.
pub(crate) const HOT_EXPERTS: usize = 3;

/// Layer `l`'s experts: an F32 router skewed towards the first [`HOT_EXPERTS`], stacked Q8_0
/// gate/up/down experts, and qwen2moe's shared expert.
fn experts(
    mut b: GgufBuilder,
    rng: &mut Rng,
    t: &AddTensor<'_>,
    l: usize,
    d: Dims,
    shared: bool,
) -> GgufBuilder {
    let n = |s: &str| format!("blk.{l}.{s}");
    let (n_exp, _) = EXPERTS;
    let (de, ffe, ne) = (d.n_embd as u64, expert_ff(d) as u64, n_exp as u64);
    let ws = 2.0 / (d.n_embd as f32).sqrt();
    let router: Vec<f32> = (0..n_exp * d.n_embd)
        .map(|i| {
            let (e, col) = (i / d.n_embd, i % d.n_embd);
            match (col, e < HOT_EXPERTS) {
                (0, true) => 2.0,
                (0, false) => 0.0,
                _ => ws * rng.unit(),
            }
        })
        .collect();
    b = t(
        b,
        n("ffn_gate_inp.weight"),
        GgmlType::F32,
        &[de, ne],
        f32s(&router),
    );
    for name in ["ffn_gate_exps.weight", "ffn_up_exps.weight"] {
        let w = q8_0(rng, n_exp * ffe as usize, d.n_embd, ws);
        b = t(b, n(name), GgmlType::Q8_0, &[de, ffe, ne], w);
    }
    let down_scale = 2.0 / (ffe as f32).sqrt();
    let w = q8_0(rng, n_exp * d.n_embd, ffe as usize, down_scale);
    b = t(
        b,
        n("ffn_down_exps.weight"),
        GgmlType::Q8_0,
        &[ffe, de, ne],
        w,
    );
    if shared {
        for name in ["ffn_gate_shexp.weight", "ffn_up_shexp.weight"] {
            let w = q8_0(rng, ffe as usize, d.n_embd, ws);
            b = t(b, n(name), GgmlType::Q8_0, &[de, ffe], w);
        }
        let w = q8_0(rng, d.n_embd, ffe as usize, down_scale);
        b = t(b, n("ffn_down_shexp.weight"), GgmlType::Q8_0, &[ffe, de], w);
        let g: Vec<f32> = (0..d.n_embd).map(|_| ws * rng.unit()).collect();
        b = t(
            b,
            n("ffn_gate_inp_shexp.weight"),
            GgmlType::F32,
            &[de],
            f32s(&g),
        );
    }
    b
}

/// The vocabulary size of `vocab_from` (its `tokenizer.ggml.tokens`).
pub(crate) fn vocabulary_size(vocab_from: &weight_cache::Gguf) -> usize {
    match vocab_from.metadata("tokenizer.ggml.tokens") {
        Some(weight_cache::MetaValue::Array(a)) => a.len(),
        _ => panic!("no tokenizer.ggml.tokens"),
    }
}

/// The small llama of the real-vocabulary case (`examples/real_vocab_model.rs`, `tests/cuda.rs`)
/// over `vocab_from`'s vocabulary.
pub(crate) fn real_vocab_dims(vocab_from: &weight_cache::Gguf) -> Dims {
    Dims {
        n_embd: 64,
        n_ff: 128,
        n_layers: 4,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        vocab: vocabulary_size(vocab_from),
        ctx: 512,
    }
}

/// [`build`] of a llama of dims `d` (whose `vocab` must be [`vocabulary_size`]'s) with the
/// tokenizer of `vocab_from` (every `tokenizer.*` metadata entry copied): random weights on a real
/// vocabulary, its tokenizer and chat template, small enough to travel where the real model
/// does not (the GPU check).
pub(crate) fn with_vocabulary(d: Dims, seed: u64, vocab_from: &weight_cache::Gguf) -> Vec<u8> {
    assert_eq!(d.vocab, vocabulary_size(vocab_from), "dims.vocab");
    let mut b = build("llama", d, seed);
    for key in vocab_from
        .metadata_keys()
        .filter(|k| k.starts_with("tokenizer."))
    {
        b = b.kv_value(key, &vocab_from.metadata(key).expect("listed"));
    }
    b.build()
}
