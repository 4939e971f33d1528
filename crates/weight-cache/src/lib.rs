//! weight-cache: memory-mapped model files (GGUF, safetensors) and the residency of their bytes.
//!
//! A model file is not "loaded": it is mapped read-only, its header is parsed with full bounds
//! checks (typed errors, no allocation proportional to a declared size), and tensors are exposed as
//! zero-copy views into the mapping. This crate is the format truth: ggml block layouts
//! ([`quant`]) and scalar reference (de)quantization ([`dequantize`], [`quantize`]), checked against
//! the `gguf` Python package.
//!
//! The residency layer, [`WeightCache`], cuts the file into a [`BlockTable`] (64 KiB blocks),
//! counts touches per request and token with relaxed atomics, asks the kernel (mincore) whether
//! blocks were resident when first touched, saves a checksummed [`AccessProfile`], warms the hot
//! blocks in a background thread ([`WarmupStrategy`]) and releases cold ones under a budget.
//!
//! A mapped file that changes on disk is the one thing the mapping cannot guard against:
//! [`Gguf::check_unchanged`] and [`FileWatch`] notice it (typed [`FileChanged`]), and
//! [`install_sigbus_handler`] makes a read past a truncation say which file and offset before the
//! process dies.
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
//!
//! A self-contained example with an in-memory file:
//!
//! ```
//! use std::sync::Arc;
//! use weight_cache::{CacheConfig, GgmlType, Gguf, GgufBuilder, WarmupStrategy, WeightCache, quantize};
//!
//! let w: Vec<f32> = (0..256 * 64).map(|i| (i % 7) as f32).collect();
//! let file = GgufBuilder::new()
//!     .kv_u32("llama.block_count", 1)
//!     .tensor("blk.0.ffn_up.weight", GgmlType::Q4_1, &[256, 64], quantize(GgmlType::Q4_1, &w)?)
//!     .build();
//! let gguf = Arc::new(Gguf::from_bytes(file)?);
//! let t = gguf.tensor("blk.0.ffn_up.weight").unwrap();
//! let mut row = vec![0.0; 256];
//! t.dequantize_row(1, &mut row)?;
//! assert!((row[0] - w[256]).abs() < 0.25); // within half a Q4_1 step
//!
//! let cache = WeightCache::new(gguf.clone(), CacheConfig::default())?;
//! let req = cache.begin_request();
//! cache.touch(t.index, req);
//! cache.end_token();
//! assert_eq!(cache.profile().n_tokens, 1);
//! cache.warm(WarmupStrategy::Full).wait();
//! assert_eq!(cache.stats().touches, 1);
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
mod sigbus;
mod sys;
mod watch;

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
pub use sigbus::{SigbusHandlerError, install_sigbus_handler};
pub use watch::{DEFAULT_WATCH_INTERVAL, FileChanged, FileWatch};
