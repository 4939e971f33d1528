//! Fuzz the GGUF parser: any input is Ok or a typed error; when Ok, every view is in bounds and
//! every metadata value and array element can be read.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weight_cache::{Gguf, MetaValue};

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = Gguf::from_bytes(data.to_vec()) {
        let len = g.bytes().len();
        for t in g.tensors() {
            assert!(t.offset as usize + t.data.len() <= len);
            let _ = t.rows();
        }
        let keys: Vec<String> = g.metadata_keys().map(str::to_owned).collect();
        for k in keys {
            if let Some(MetaValue::Array(a)) = g.metadata(&k) {
                assert_eq!(a.iter().count(), a.len());
                let _ = a.get(a.len().saturating_sub(1));
            }
            let _ = g.get_str_array(&k);
            let _ = g.get_f32_array(&k);
        }
    }
});
