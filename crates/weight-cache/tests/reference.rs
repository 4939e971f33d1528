//! Every tensor of the default model against the `gguf` PyPI package
//! (fixture: `scripts/fixtures/weight-cache-gguf-reference.py`), and pseudo-random blocks of every
//! supported type against gguf's dequantization.

use serde_json::Value;
use weight_cache::{GgmlType, Gguf, dequantize, locate_default_model};

fn fixture() -> Value {
    serde_json::from_str(include_str!("fixtures/gguf-reference.json")).unwrap()
}

fn dtype(name: &str) -> GgmlType {
    *GgmlType::ALL
        .iter()
        .find(|t| t.name().eq_ignore_ascii_case(name))
        .unwrap_or_else(|| panic!("unknown dtype {name}"))
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn close(a: f32, b: f32) -> bool {
    a == b || (a - b).abs() <= 1e-6 * a.abs().max(b.abs())
}

#[test]
fn blocks_match_gguf_package() {
    let fx = fixture();
    let mut exact = 0;
    let mut total = 0;
    for b in fx["blocks"].as_array().unwrap() {
        let t = dtype(b["dtype"].as_str().unwrap());
        let hex = b["hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want = floats(&b["values"]);
        let mut got = vec![f32::NAN; want.len()];
        dequantize(t, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(close(*g, *w), "{t} value {i}: {g} vs gguf {w}");
            exact += usize::from(g == w);
            total += 1;
        }
    }
    println!("{exact}/{total} values bit-identical to gguf");
    assert!(total > 1000);
}

#[test]
fn every_tensor_matches_gguf_package() {
    let fx = fixture();
    let path = locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: tests never modify the model file.
    let g = unsafe { Gguf::open(&path) }.unwrap();
    assert_eq!(g.bytes().len() as u64, fx["model_bytes"].as_u64().unwrap());
    let meta = &fx["metadata"];
    assert_eq!(
        g.get_str("general.architecture"),
        meta["general.architecture"].as_str()
    );
    for key in [
        "llama.block_count",
        "llama.embedding_length",
        "llama.context_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.feed_forward_length",
    ] {
        assert_eq!(g.get_u32(key).map(f64::from), meta[key].as_f64(), "{key}");
    }
    for key in [
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
    ] {
        assert_eq!(
            g.get_f32(key),
            meta[key].as_f64().map(|v| v as f32),
            "{key}"
        );
    }
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(
        tokens.len() as u64,
        meta["tokenizer.ggml.tokens.len"].as_u64().unwrap()
    );
    for (i, s) in meta["tokenizer.ggml.tokens.sample"].as_object().unwrap() {
        assert_eq!(tokens[i.parse::<usize>().unwrap()], s.as_str().unwrap());
    }

    let want = fx["tensors"].as_array().unwrap();
    assert_eq!(g.tensor_count(), want.len());
    let mut buf = Vec::new();
    for (t, w) in g.tensors().zip(want) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        assert_eq!(t.dtype, dtype(w["dtype"].as_str().unwrap()), "{}", t.name);
        let shape: Vec<u64> = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(t.shape, shape, "{}", t.name);
        assert_eq!(t.offset, w["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(
            t.data.len() as u64,
            w["n_bytes"].as_u64().unwrap(),
            "{}",
            t.name
        );

        buf.resize(t.n_elements() as usize, 0.0);
        dequantize(t.dtype, t.data, &mut buf).unwrap();
        for (i, v) in floats(&w["first"]).iter().enumerate() {
            assert!(close(buf[i], *v), "{} [{i}]: {} vs {v}", t.name, buf[i]);
        }
        let stride = w["stride"].as_u64().unwrap() as usize;
        for (k, v) in floats(&w["strided"]).iter().enumerate() {
            let x = buf[k * stride];
            assert!(close(x, *v), "{} [{}]: {x} vs {v}", t.name, k * stride);
        }
        let sum: f64 = buf.iter().map(|&v| f64::from(v)).sum();
        let abs: f64 = buf.iter().map(|&v| f64::from(v).abs()).sum();
        let want_sum = w["sum"].as_f64().unwrap();
        assert!(
            (sum - want_sum).abs() <= 1e-9 * abs + 1e-9,
            "{}: sum {sum} vs {want_sum}",
            t.name
        );
    }
}
