//! weight-cache: memory-mapped model files (GGUF, safetensors) and the residency of their bytes.

mod locate;

pub use locate::{DEFAULT_MODEL_FILE, ModelNotFound, locate_default_model, model_cache_dir};
