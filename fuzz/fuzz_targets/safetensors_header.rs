//! Fuzz the safetensors parser: any input is Ok or a typed error; views stay in bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weight_cache::Safetensors;

fuzz_target!(|data: &[u8]| {
    if let Ok(st) = Safetensors::from_bytes(data.to_vec()) {
        for t in st.tensors() {
            assert!(t.offset as usize + t.data.len() <= st.bytes().len());
            let _ = t.to_f32();
        }
    }
});
