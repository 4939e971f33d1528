//! The CPU executor: today's [`Model`] (SIMD kernels over the mmap'd weights, on its thread pool).

use std::sync::Arc;

use kv_ring::{HostKv, KvDtype, KvShape};
use token_stream::Tokenizer;
use weight_cache::WeightCache;

use super::Executor;
use crate::model::{ForwardError, Model, ModelConfig, SeqStep};
use crate::threadpool::ThreadPool;

/// Runs the forward pass with the CPU kernels: a thin handle over an `Arc<Model>`; every call
/// delegates to the model.
///
/// ```no_run
/// use std::sync::Arc;
/// use gpu_pipeline::executor::{CpuExecutor, Executor};
/// use gpu_pipeline::{Model, ModelOptions};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let path = weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while it is mapped.
/// let gguf = Arc::new(unsafe { weight_cache::Gguf::open(&path) }?);
/// let model = Arc::new(Model::load(gguf, ModelOptions::default())?);
/// let exec = CpuExecutor::new(model);
/// assert!(exec.config().vocab_size > 0);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CpuExecutor {
    model: Arc<Model>,
}

impl CpuExecutor {
    /// Wraps a loaded model.
    pub fn new(model: Arc<Model>) -> Self {
        Self { model }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }
}

impl From<Arc<Model>> for CpuExecutor {
    fn from(model: Arc<Model>) -> Self {
        Self::new(model)
    }
}

impl Executor for CpuExecutor {
    type Kv = HostKv;

    fn kv_allocator(&self) {}

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn kv_shape(&self, dtype: KvDtype) -> KvShape {
        self.model.kv_shape(dtype)
    }

    fn kv_windows(&self) -> Vec<Option<usize>> {
        self.model.kv_windows()
    }

    fn weight_cache(&self) -> Option<&WeightCache> {
        self.model.weight_cache()
    }

    fn host_pool(&self) -> &ThreadPool {
        self.model.pool()
    }

    fn stop_tokens_with(&self, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
        self.model.stop_tokens_with(tokenizer)
    }

    fn forward(
        &self,
        steps: &mut [SeqStep<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        self.model.forward(steps, logits)
    }
}
