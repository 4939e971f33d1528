//! safetensors parsing: zero-copy views and typed errors for bad headers.

use proptest::prelude::*;
use weight_cache::{Safetensors, SafetensorsError, StDtype};

fn file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend(header.as_bytes());
    f.extend(data);
    f
}

fn good() -> Vec<u8> {
    let mut data = Vec::new();
    for v in [1.0f32, -2.0, 3.5] {
        data.extend(v.to_le_bytes());
    }
    data.extend(half::bf16::from_f32(0.5).to_le_bytes());
    data.extend(half::f16::from_f32(-4.0).to_le_bytes());
    data.extend([7u8, 0xF9]);
    file(
        r#"{"__metadata__":{"format":"pt"},
            "a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},
            "b":{"dtype":"BF16","shape":[1,1],"data_offsets":[12,14]},
            "c":{"dtype":"F16","shape":[1],"data_offsets":[14,16]},
            "d":{"dtype":"I8","shape":[2],"data_offsets":[16,18]}}  "#,
        &data,
    )
}

#[test]
fn parses_views() {
    let st = Safetensors::from_bytes(good()).unwrap();
    assert_eq!(st.tensor_count(), 4);
    assert_eq!(st.metadata("format"), Some("pt"));
    assert_eq!(st.tensor("a").unwrap().to_f32().unwrap(), [1.0, -2.0, 3.5]);
    assert_eq!(st.tensor("b").unwrap().to_f32().unwrap(), [0.5]);
    assert_eq!(st.tensor("b").unwrap().shape, &[1, 1]);
    assert_eq!(st.tensor("c").unwrap().to_f32().unwrap(), [-4.0]);
    let d = st.tensor("d").unwrap();
    assert_eq!(d.dtype, StDtype::I8);
    assert_eq!(d.data, [7, 0xF9]);
    assert!(d.to_f32().is_none());
    assert_eq!(d.offset as usize, st.data_offset() + 16);
    assert!(st.tensor("zz").is_none());
}

#[test]
fn typed_errors() {
    use SafetensorsError as E;
    let e = |b: Vec<u8>| Safetensors::from_bytes(b).expect_err("must be rejected");
    assert!(matches!(e(vec![1, 2, 3]), E::TooShort { len: 3 }));
    let mut b = good();
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(e(b), E::HeaderTooLarge { .. }));
    assert!(matches!(e(file("{", &[])), E::BadHeader { .. }));
    assert!(matches!(e(file("[1]", &[])), E::BadHeader { .. }));
    assert!(matches!(e(file("\"\u{FFFD}", &[])), E::BadHeader { .. }));
    let mut b = file("{\"a\":1}", &[]);
    b[9] = 0xFF; // invalid UTF-8 inside the JSON
    assert!(matches!(e(b), E::BadHeader { .. }));
    assert!(matches!(
        e(file(r#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#, &[0; 4])),
        E::BadEntry { field: "dtype", .. }
    ));
    assert!(matches!(
        e(file(
            r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,4]}}"#,
            &[0; 4]
        )),
        E::UnknownDtype { .. }
    ));
    assert!(matches!(
        e(file(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
            &[0; 4]
        )),
        E::ShapeMismatch { .. }
    ));
    assert!(matches!(
        e(file(
            r#"{"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,0]}}"#,
            &[]
        )),
        E::ShapeMismatch { .. }
    ));
    assert!(matches!(
        e(file(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            &[0; 3]
        )),
        E::OutOfBounds { .. }
    ));
    assert!(matches!(
        e(file(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            &[0; 4]
        )),
        E::OutOfBounds { .. }
    ));
    assert!(matches!(
        e(file(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            &[0; 8]
        )),
        E::Overlap { .. }
    ));
    assert!(matches!(
        e(file(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
            &[0; 4]
        )),
        E::BadEntry {
            field: "data_offsets",
            ..
        }
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn mutated_files_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut b = good();
        for (i, v) in flips {
            let i = i.index(b.len());
            b[i] = v;
        }
        if let Some(c) = cut {
            b.truncate(c.index(b.len() + 1));
        }
        if let Ok(st) = Safetensors::from_bytes(b) {
            for t in st.tensors() {
                prop_assert!(t.offset as usize + t.data.len() <= st.bytes().len());
                prop_assert_eq!(t.data.len() as u64, t.shape.iter().product::<u64>() * t.dtype.size() as u64);
            }
        }
    }
}
