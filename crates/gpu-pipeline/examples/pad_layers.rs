//! Writes a copy of a GGUF model with `N` layers appended that change nothing: each new layer is
//! a copy of one of the model's layers (in turn) whose attention output and MLP down projections
//! are zero, so its residual contributions are exactly 0 and the padded model's logits are the
//! original's (`x + 0.0 == x`), while every decode step reads the extra layers' weights as a
//! larger model's. This is how the speculative-decoding bench gets a >= 1 GB target with the
//! default model's vocabulary (no larger SmolLM2 can be downloaded here): the F32 default model
//! (538 MB) padded with 40 layers is 1.10 GB, its outputs the F32 model's; a real larger model
//! agrees less with the 135M draft than this one does, so its acceptance is an upper bound.
//!
//! `cargo run --release -p zerolayer-gpu-pipeline --example pad_layers -- IN.gguf OUT.gguf N`

use weight_cache::{Gguf, GgufBuilder, MetaValue};

/// The layer index of a `blk.N.` tensor name, and the rest of the name.
fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (n, tail) = rest.split_once('.')?;
    Some((n.parse().ok()?, tail))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, n] = &args[..] else {
        panic!("usage: pad_layers IN.gguf OUT.gguf N");
    };
    let extra: usize = n.parse().expect("N: a number of layers");
    // SAFETY: the input file is not modified while it is mapped.
    let g = unsafe { Gguf::open(input) }.expect("open IN.gguf");
    let arch = match g.metadata("general.architecture") {
        Some(MetaValue::String(a)) => a.to_owned(),
        _ => panic!("no general.architecture"),
    };
    let count_key = format!("{arch}.block_count");
    let layers = g
        .metadata(&count_key)
        .and_then(|v| v.as_int())
        .expect("block_count") as usize;
    let mut b = GgufBuilder::new();
    for key in g.metadata_keys() {
        if key == "general.alignment" {
            continue;
        }
        let v = g.metadata(key).expect("listed");
        if key == count_key {
            b = b.kv_u32(key, (layers + extra) as u32);
            continue;
        }
        b = b.kv_value(key, &v);
    }
    let tensors: Vec<_> = g.tensors().collect();
    for t in &tensors {
        b = b.tensor(t.name, t.dtype, t.shape, t.data.to_vec());
    }
    for i in 0..extra {
        let (from, to) = (i % layers, layers + i);
        for t in &tensors {
            let Some((l, tail)) = layer_of(t.name) else {
                continue;
            };
            if l != from {
                continue;
            }
            // The residual branches' last products: zero, so the layer adds exactly 0.
            let zero = tail.starts_with("attn_output.") || tail.starts_with("ffn_down.");
            let data = if zero {
                assert!(
                    matches!(
                        t.dtype,
                        weight_cache::GgmlType::F32 | weight_cache::GgmlType::F16
                    ),
                    "{}: zeroing needs a float format",
                    t.name
                );
                vec![0u8; t.data.len()]
            } else {
                t.data.to_vec()
            };
            b = b.tensor(&format!("blk.{to}.{tail}"), t.dtype, t.shape, data);
        }
    }
    let bytes = b.build();
    std::fs::write(output, &bytes).expect("write OUT.gguf");
    eprintln!(
        "{output}: {} bytes, {} layers ({layers} + {extra} that add zero)",
        bytes.len(),
        layers + extra
    );
}
