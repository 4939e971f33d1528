//! weight-cache: memory-mapped model files (GGUF, safetensors) and the residency of their bytes.
//!
//! A model file is not "loaded": it is mapped read-only, its header is parsed with full bounds
//! checks, and tensors are exposed as zero-copy views into the mapping. This crate is the format
//! truth: ggml block layouts ([`quant`]) and scalar reference dequantization ([`dequantize`]).
//!
//! ```no_run
//! use weight_cache::{Gguf, GgmlType, locate_default_model};
//!
//! let path = locate_default_model()?;
//! // SAFETY: nothing modifies the model file while it is mapped.
//! let gguf = unsafe { Gguf::open(&path)? };
//! let n_embd = gguf.get_u32("llama.embedding_length").unwrap() as usize;
//! let norm = gguf.tensor("blk.0.attn_norm.weight").unwrap();
//! assert_eq!(norm.dtype, GgmlType::F32);
//! let w = norm.to_f32()?;
//! assert_eq!(w.len(), n_embd);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod block_table;
mod builder;
mod cache;
mod dequant;
mod ggml_type;
mod gguf;
mod locate;
mod profile;
pub mod quant;
mod safetensors;
mod sys;

pub use block_table::{BlockTable, BlockTableError, DEFAULT_BLOCK_SIZE};
pub use builder::GgufBuilder;
pub use cache::{
    BudgetReport, CacheConfig, CacheStats, DEFAULT_WARM_FRACTION, ReleaseMode, RequestId,
    WarmupHandle, WarmupProgress, WarmupStrategy, WeightCache,
};
pub use dequant::{
    DequantError, QuantizeError, dequantize, quantize, quantize_q4_0, quantize_q4_1, quantize_q8_0,
};
pub use ggml_type::GgmlType;
pub use gguf::{
    DEFAULT_ALIGNMENT, Gguf, GgufError, MAX_DIMS, MetaArray, MetaArrayIter, MetaType, MetaValue,
    TensorView,
};
pub use locate::{DEFAULT_MODEL_FILE, ModelNotFound, locate_default_model, model_cache_dir};
pub use profile::{AccessProfile, ProfileError};
pub use safetensors::{
    MAX_SAFETENSORS_HEADER, Safetensors, SafetensorsError, StDtype, StTensorView,
};
