//! [`HostedExecutor`]: the executors that run a loaded [`Model`], chosen at run time.

use std::sync::Arc;

use kv_ring::{HostKv, KvDtype, KvShape};
use token_stream::Tokenizer;
use weight_cache::WeightCache;

use super::{CpuExecutor, Executor};
use crate::model::{ForwardError, Model, ModelConfig, SeqStep};
use crate::threadpool::ThreadPool;

/// An executor over a loaded [`Model`] (which keeps the configuration, the tokenizer data and
/// the host thread pool), picked at run time: what a server built once runs on the CPU or a GPU.
/// Each call is one `match` and a delegation.
#[derive(Debug)]
#[non_exhaustive]
pub enum HostedExecutor {
    /// The CPU kernels.
    Cpu(CpuExecutor),
    /// The CUDA executor (boxed: its device state is large).
    #[cfg(feature = "cuda")]
    Cuda(Box<super::CudaExecutor>),
}

impl HostedExecutor {
    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        match self {
            Self::Cpu(e) => e.model(),
            #[cfg(feature = "cuda")]
            Self::Cuda(e) => e.model(),
        }
    }

    fn inner(&self) -> &dyn Executor<Kv = HostKv> {
        match self {
            Self::Cpu(e) => e,
            #[cfg(feature = "cuda")]
            Self::Cuda(e) => &**e,
        }
    }
}

impl From<CpuExecutor> for HostedExecutor {
    fn from(e: CpuExecutor) -> Self {
        Self::Cpu(e)
    }
}

#[cfg(feature = "cuda")]
impl From<super::CudaExecutor> for HostedExecutor {
    fn from(e: super::CudaExecutor) -> Self {
        Self::Cuda(Box::new(e))
    }
}

impl Executor for HostedExecutor {
    type Kv = HostKv;

    fn kv_allocator(&self) {}

    fn config(&self) -> &ModelConfig {
        self.inner().config()
    }

    fn kv_shape(&self, dtype: KvDtype) -> KvShape {
        self.inner().kv_shape(dtype)
    }

    fn kv_windows(&self) -> Vec<Option<usize>> {
        self.inner().kv_windows()
    }

    fn weight_cache(&self) -> Option<&WeightCache> {
        self.inner().weight_cache()
    }

    fn host_pool(&self) -> &ThreadPool {
        self.inner().host_pool()
    }

    fn stop_tokens_with(&self, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
        self.inner().stop_tokens_with(tokenizer)
    }

    fn forward(
        &self,
        steps: &mut [SeqStep<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        self.inner().forward(steps, logits)
    }
}
