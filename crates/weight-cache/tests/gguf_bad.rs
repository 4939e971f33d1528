//! Bad GGUF files give typed errors, never panics or huge allocations; proptest over mutations of
//! a valid small file.

use proptest::prelude::*;
use weight_cache::{GgmlType, Gguf, GgufBuilder, GgufError, MetaValue, quantize};

fn small() -> GgufBuilder {
    let w: Vec<f32> = (0..64).map(|i| i as f32 / 8.0).collect();
    GgufBuilder::new()
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_f32("llama.rope.freq_base", 10000.0)
        .kv_bool("tokenizer.ggml.add_bos_token", true)
        .kv_str_array("tokenizer.ggml.tokens", &["a", "b", "ü"])
        .kv_i32_array("tokenizer.ggml.token_type", &[1, 1, 3])
        .kv_f32_array("tokenizer.ggml.scores", &[0.0, -1.0, -2.5])
        .tensor(
            "w",
            GgmlType::Q8_0,
            &[32, 2],
            quantize(GgmlType::Q8_0, &w).unwrap(),
        )
        .tensor(
            "n",
            GgmlType::F32,
            &[4],
            quantize(GgmlType::F32, &[1.0, 2.0, 3.0, 4.0]).unwrap(),
        )
}

fn err(bytes: Vec<u8>) -> GgufError {
    Gguf::from_bytes(bytes).expect_err("must be rejected")
}

/// Byte offset of the first tensor info's fields for `small()`: found by searching the name.
fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

#[test]
fn valid_small_file_round_trips() {
    let g = Gguf::from_bytes(small().build()).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.get_str("general.architecture"), Some("llama"));
    assert_eq!(g.get_u32("llama.block_count"), Some(2));
    assert_eq!(g.get_f32("llama.rope.freq_base"), Some(10000.0));
    assert_eq!(g.get_bool("tokenizer.ggml.add_bos_token"), Some(true));
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["a", "b", "ü"]
    );
    assert_eq!(
        g.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        [1, 1, 3]
    );
    assert_eq!(
        g.get_f32_array("tokenizer.ggml.scores").unwrap(),
        [0.0, -1.0, -2.5]
    );
    let a = g.get_array("tokenizer.ggml.scores").unwrap();
    assert_eq!(a.get(2), Some(MetaValue::F32(-2.5)));
    assert_eq!(a.get(3), None);
    assert_eq!(g.get_u32("general.architecture"), None);
    assert_eq!(g.metadata_keys().count(), 7);
    let n = g.tensor("n").unwrap();
    assert_eq!(n.to_f32().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(g.tensor("w").unwrap().rows(), 2);
    let v2 = Gguf::from_bytes(small().version(2).build()).unwrap();
    assert_eq!(v2.version(), 2);
}

#[test]
fn header_errors() {
    let good = small().build();
    assert!(matches!(
        err(vec![]),
        GgufError::Truncated { what: "magic", .. }
    ));
    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(err(b), GgufError::BadMagic { .. }));
    assert!(matches!(
        err(small().version(1).build()),
        GgufError::UnsupportedVersion { version: 1 }
    ));
    // Tensor count far beyond the file.
    let mut b = good.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        err(b),
        GgufError::CountTooLarge { what: "tensor", .. }
    ));
    let mut b = good.clone();
    b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        err(b),
        GgufError::CountTooLarge {
            what: "metadata entry",
            ..
        }
    ));
    // Every truncation of the header is a typed error.
    let g = Gguf::from_bytes(good.clone()).unwrap();
    for len in 0..g.data_offset() {
        let e = err(good[..len].to_vec());
        assert!(
            matches!(
                e,
                GgufError::Truncated { .. }
                    | GgufError::CountTooLarge { .. }
                    | GgufError::TensorOutOfBounds { .. }
            ),
            "len {len}: {e}"
        );
    }
    // Cutting into tensor data.
    assert!(matches!(
        err(good[..good.len() - 1].to_vec()),
        GgufError::TensorOutOfBounds { .. }
    ));
}

#[test]
fn metadata_errors() {
    let bad_utf8 = GgufBuilder::new().kv_raw("k", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]);
    assert!(matches!(
        err(bad_utf8.build()),
        GgufError::InvalidUtf8 { .. }
    ));
    let bad_key = GgufBuilder::new().kv_raw("k\u{0}", 4, &[0; 4]).build();
    let mut b = bad_key.clone();
    let i = find(&b, b"k\0");
    b[i + 1] = 0xC3; // lone UTF-8 lead byte
    assert!(matches!(
        err(b),
        GgufError::InvalidUtf8 {
            what: "metadata key",
            ..
        }
    ));
    let unknown = GgufBuilder::new().kv_raw("k", 13, &[0; 8]).build();
    assert!(matches!(
        err(unknown),
        GgufError::UnknownValueType { type_id: 13, .. }
    ));
    let bad_bool = GgufBuilder::new().kv_raw("k", 7, &[2]).build();
    assert!(matches!(
        err(bad_bool),
        GgufError::InvalidBool { value: 2, .. }
    ));
    let dup = GgufBuilder::new().kv_u32("k", 1).kv_u32("k", 2).build();
    assert!(matches!(err(dup), GgufError::DuplicateKey { .. }));
    // Array declaring 2^60 u32 elements.
    let mut arr = 4u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 60).to_le_bytes());
    let huge = GgufBuilder::new().kv_raw("k", 9, &arr).build();
    assert!(matches!(
        err(huge),
        GgufError::CountTooLarge {
            what: "array element",
            ..
        }
    ));
    // A string of declared length 2^63.
    let mut s = (1u64 << 63).to_le_bytes().to_vec();
    s.extend(b"abc");
    let long = GgufBuilder::new().kv_raw("k", 8, &s).build();
    assert!(matches!(err(long), GgufError::Truncated { needed, .. } if needed == 1 << 63));
    // Deeply nested arrays.
    let mut nested = Vec::new();
    for _ in 0..10 {
        nested.extend(9u32.to_le_bytes());
        nested.extend(1u64.to_le_bytes());
    }
    nested.extend(4u32.to_le_bytes());
    nested.extend(0u64.to_le_bytes());
    let deep = GgufBuilder::new().kv_raw("k", 9, &nested[..]).build();
    assert!(matches!(err(deep), GgufError::NestingTooDeep { .. }));
    // Alignment.
    let a = GgufBuilder::new().alignment(24).build();
    assert!(matches!(
        err(a),
        GgufError::BadAlignment { value: Some(24) }
    ));
    let a = GgufBuilder::new().kv_str("general.alignment", "32").build();
    assert!(matches!(err(a), GgufError::BadAlignment { value: None }));
    let ok = GgufBuilder::new()
        .alignment(64)
        .tensor("t", GgmlType::F32, &[3], vec![0; 12])
        .tensor("u", GgmlType::F32, &[3], vec![0; 12]);
    let g = Gguf::from_bytes(ok.build()).unwrap();
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.tensor("u").unwrap().offset % 64, 0);
}

/// Patch the tensor info of tensor `name` in `small()`: the u64 at `field` bytes after the name.
fn patch_info(name: &str, field: usize, bytes: &[u8]) -> Vec<u8> {
    let mut b = small().build();
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend(name.as_bytes());
    let i = find(&b, &needle) + needle.len() + field;
    b[i..i + bytes.len()].copy_from_slice(bytes);
    b
}

#[test]
fn tensor_errors() {
    // Layout after the name of "w": n_dims u32, dims 2 x u64, type u32, offset u64.
    assert!(matches!(
        err(patch_info("w", 0, &5u32.to_le_bytes())),
        GgufError::TooManyDims { n_dims: 5, .. }
    ));
    assert!(matches!(
        err(patch_info("w", 4, &33u64.to_le_bytes())),
        GgufError::RowNotBlockAligned { row_len: 33, .. }
    ));
    assert!(matches!(
        err(patch_info("w", 12, &(1u64 << 62).to_le_bytes())),
        GgufError::ShapeOverflow { .. } | GgufError::TensorOutOfBounds { .. }
    ));
    assert!(matches!(
        err(patch_info("w", 4, &(u64::MAX - 31).to_le_bytes())),
        GgufError::ShapeOverflow { .. }
    ));
    assert!(matches!(
        err(patch_info("w", 20, &4u32.to_le_bytes())),
        GgufError::UnknownTensorType { type_id: 4, .. }
    ));
    assert!(matches!(
        err(patch_info("w", 24, &8u64.to_le_bytes())),
        GgufError::TensorMisaligned { offset: 8, .. }
    ));
    assert!(matches!(
        err(patch_info("w", 24, &(u64::MAX - 31).to_le_bytes())),
        GgufError::TensorOutOfBounds { .. }
    ));
    // "n" (one dim) moved onto "w"'s data.
    assert!(matches!(
        err(patch_info("n", 16, &0u64.to_le_bytes())),
        GgufError::TensorOverlap { .. }
    ));
    let dup = GgufBuilder::new()
        .tensor("t", GgmlType::F32, &[1], vec![0; 4])
        .tensor("t", GgmlType::F32, &[1], vec![0; 4])
        .build();
    assert!(matches!(err(dup), GgufError::DuplicateTensor { .. }));
    let mut b = small().build();
    let i = find(&b, b"\x01\x00\x00\x00\x00\x00\x00\x00w") + 8;
    b[i] = 0xFF;
    assert!(matches!(
        err(b),
        GgufError::InvalidUtf8 {
            what: "tensor name",
            ..
        }
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any byte flips, truncation or extension of a valid file: Ok or a typed error, no panic; when
    /// Ok, every tensor view lies inside the file and every metadata value can be read.
    #[test]
    fn mutated_headers_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut b = small().build();
        for (i, v) in flips {
            let i = i.index(b.len());
            b[i] = v;
        }
        if let Some(c) = cut {
            b.truncate(c.index(b.len() + 1));
        }
        if let Ok(g) = Gguf::from_bytes(b) {
            let len = g.bytes().len() as u64;
            for t in g.tensors() {
                prop_assert!(t.offset + t.data.len() as u64 <= len);
                prop_assert_eq!(Some(t.data.len()), t.dtype.row_bytes(t.row_len()).map(|r| r * t.rows()));
            }
            let keys: Vec<String> = g.metadata_keys().map(str::to_owned).collect();
            for k in keys {
                let v = g.metadata(&k);
                prop_assert!(v.is_some());
                if let Some(MetaValue::Array(a)) = v {
                    prop_assert_eq!(a.iter().count(), a.len());
                }
            }
        }
    }
}

/// Found by `scripts/fuzz` (gguf_header, with overflow checks): a zero dimension makes the element
/// count 0, so only the row count (product of the other dimensions) overflowed, in
/// `TensorView::rows`. The parser now refuses such shapes.
#[test]
fn a_zero_dimension_does_not_hide_a_row_count_overflow() {
    let huge = 1u64 << 40;
    let file = GgufBuilder::new()
        .tensor("z", GgmlType::F32, &[0, huge, huge], Vec::new())
        .build();
    assert!(matches!(
        err(file),
        GgufError::ShapeOverflow { ref shape, .. } if shape == &[0, huge, huge]
    ));
    // Zero-sized tensors whose row count fits still load.
    let file = GgufBuilder::new()
        .tensor("z", GgmlType::F32, &[0, 3, 5], Vec::new())
        .build();
    let g = Gguf::from_bytes(file).expect("an empty tensor with a sane shape loads");
    assert_eq!(
        g.tensor("z").map(|t| (t.rows(), t.n_elements())),
        Some((15, 0))
    );
}
