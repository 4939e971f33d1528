//! Writes a small seed corpus for the fuzz targets (`fuzz/corpus/<target>/`). Ignored by default:
//! run with `cargo test -p zerolayer-weight-cache --test fuzz_seeds -- --ignored`.

use weight_cache::{GgmlType, GgufBuilder, quantize};

#[test]
#[ignore = "writes the fuzz seed corpus"]
fn write_seed_corpus() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let gguf_dir = root.join("gguf_header");
    let st_dir = root.join("safetensors_header");
    std::fs::create_dir_all(&gguf_dir).unwrap();
    std::fs::create_dir_all(&st_dir).unwrap();
    let x: Vec<f32> = (0..64).map(|i| i as f32 - 32.0).collect();
    let seeds = [
        GgufBuilder::new().build(),
        GgufBuilder::new().version(2).kv_u32("a", 1).build(),
        GgufBuilder::new()
            .kv_str("general.architecture", "llama")
            .kv_bool("b", true)
            .kv_f32("f", 1.5)
            .kv_u64("u", 7)
            .kv_i32("i", -1)
            .kv_str_array("tokenizer.ggml.tokens", &["a", "bc", "\u{e9}"])
            .kv_i32_array("tokenizer.ggml.token_type", &[1, 2, 3])
            .kv_f32_array("tokenizer.ggml.scores", &[0.0, 1.0])
            .build(),
        GgufBuilder::new()
            .alignment(64)
            .tensor(
                "q8",
                GgmlType::Q8_0,
                &[32, 2],
                quantize(GgmlType::Q8_0, &x).unwrap(),
            )
            .tensor(
                "q4",
                GgmlType::Q4_1,
                &[64],
                quantize(GgmlType::Q4_1, &x).unwrap(),
            )
            .tensor("f", GgmlType::F32, &[2, 2, 2, 2], vec![0; 64])
            .build(),
    ];
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(gguf_dir.join(format!("seed-{i}.gguf")), s).unwrap();
    }
    let header = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}}"#;
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend(header.as_bytes());
    st.extend([0u8; 12]);
    std::fs::write(st_dir.join("seed-0.safetensors"), &st).unwrap();
}
