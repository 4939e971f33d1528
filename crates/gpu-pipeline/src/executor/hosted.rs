//! [`HostedExecutor`]: the executors that run a loaded [`Model`], chosen at run time, and the
//! KV storage chosen with them ([`HostedKv`]).

use std::sync::Arc;

use kv_ring::{HostKv, HostKvStorage, KvBlock, KvBlockMut, KvDtype, KvError, KvShape, KvStorage};
use token_stream::Tokenizer;
use weight_cache::WeightCache;

use super::{CpuExecutor, Executor};
use crate::model::{ForwardError, Model, ModelConfig, SeqStep};
use crate::threadpool::ThreadPool;

/// An executor over a loaded [`Model`] (which keeps the configuration, the tokenizer data and
/// the host thread pool), picked at run time: what a server built once runs on the CPU or a GPU.
/// Each call is one `match` and a delegation.
///
/// Its rings' storage is [`HostedKv`]: host memory under the CPU executor, device memory under
/// the CUDA one (the engine's pool asks [`kv_allocator`](Executor::kv_allocator), which says
/// which). The CPU arm runs [`Model::forward`] on those rings directly (monomorphized for
/// `HostedKv`: a view's blocks cost one `match` on the storage, no `dyn`).
#[derive(Debug)]
#[non_exhaustive]
pub enum HostedExecutor {
    /// The CPU kernels.
    Cpu(CpuExecutor),
    /// The CUDA executor (boxed: its device state is large).
    #[cfg(feature = "cuda")]
    Cuda(Box<super::CudaExecutor>),
}

/// The KV storage of a [`HostedExecutor`]'s rings: host memory for the CPU executor, device
/// memory for the CUDA one. One pool allocates one kind (its [`HostedKvAllocator`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum HostedKv {
    /// Host memory (the CPU attention reads it through [`kv_ring::KvRing::view`]).
    Host(HostKv),
    /// Device memory (the CUDA executor writes and reads it in place).
    #[cfg(feature = "cuda")]
    Device(super::cuda::DeviceKv),
}

/// What a pool of [`HostedKv`] allocates: host buffers, or device buffers on a stream.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum HostedKvAllocator {
    /// [`HostedKv::Host`] buffers.
    Host,
    /// [`HostedKv::Device`] buffers on the stream (the CUDA executor's compute stream).
    #[cfg(feature = "cuda")]
    Device(Arc<cudarc::driver::CudaStream>),
}

/// Host and device rings met in one copy: only rings of one pool (one allocator) are copied
/// between, so this means rings of two pools were mixed.
#[cfg(feature = "cuda")]
fn mixed(bytes: usize) -> KvError {
    KvError::StorageFailed {
        op: kv_ring::StorageOp::Copy,
        bytes,
        reason: "a host ring and a device ring (from two pools) cannot be copied between".into(),
    }
}

impl KvStorage for HostedKv {
    type Allocator = HostedKvAllocator;

    fn zeroed(
        allocator: &HostedKvAllocator,
        dtype: KvDtype,
        block_lens: &[usize],
    ) -> Result<Self, KvError> {
        match allocator {
            HostedKvAllocator::Host => HostKv::zeroed(&(), dtype, block_lens).map(Self::Host),
            #[cfg(feature = "cuda")]
            HostedKvAllocator::Device(stream) => {
                super::cuda::DeviceKv::zeroed(stream, dtype, block_lens).map(Self::Device)
            }
        }
    }

    fn supports(allocator: &HostedKvAllocator, dtype: KvDtype) -> bool {
        match allocator {
            HostedKvAllocator::Host => HostKv::supports(&(), dtype),
            #[cfg(feature = "cuda")]
            HostedKvAllocator::Device(stream) => super::cuda::DeviceKv::supports(stream, dtype),
        }
    }

    fn empty(dtype: KvDtype) -> Self {
        Self::Host(HostKv::empty(dtype))
    }

    fn allocated_bytes(&self) -> usize {
        match self {
            Self::Host(h) => h.allocated_bytes(),
            #[cfg(feature = "cuda")]
            Self::Device(d) => d.allocated_bytes(),
        }
    }

    fn grow_blocks(
        &mut self,
        allocator: &HostedKvAllocator,
        block_lens: &[usize],
    ) -> Result<(), KvError> {
        match (self, allocator) {
            (Self::Host(h), HostedKvAllocator::Host) => h.grow_blocks(&(), block_lens),
            #[cfg(feature = "cuda")]
            (Self::Device(d), HostedKvAllocator::Device(stream)) => {
                d.grow_blocks(stream, block_lens)
            }
            #[cfg(feature = "cuda")]
            (s, _) => Err(KvError::StorageFailed {
                op: kv_ring::StorageOp::Grow,
                bytes: s.allocated_bytes(),
                reason: "a ring grown through another kind of pool's allocator".into(),
            }),
        }
    }

    fn copy_within(
        &mut self,
        block: usize,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<(), KvError> {
        match self {
            Self::Host(h) => h.copy_within(block, src, dst, len),
            #[cfg(feature = "cuda")]
            Self::Device(d) => d.copy_within(block, src, dst, len),
        }
    }

    fn copy_from(
        &mut self,
        block: usize,
        dst: usize,
        other: &Self,
        src_block: usize,
        src: usize,
        len: usize,
    ) -> Result<(), KvError> {
        match (self, other) {
            (Self::Host(d), Self::Host(s)) => d.copy_from(block, dst, s, src_block, src, len),
            #[cfg(feature = "cuda")]
            (Self::Device(d), Self::Device(s)) => d.copy_from(block, dst, s, src_block, src, len),
            #[cfg(feature = "cuda")]
            _ => Err(mixed(len)),
        }
    }
}

impl HostKvStorage for HostedKv {
    #[inline]
    fn block(&self, block: usize) -> Option<KvBlock<'_>> {
        match self {
            Self::Host(h) => h.block(block),
            #[cfg(feature = "cuda")]
            Self::Device(_) => None,
        }
    }

    #[inline]
    fn block_mut(&mut self, block: usize) -> Option<KvBlockMut<'_>> {
        match self {
            Self::Host(h) => h.block_mut(block),
            #[cfg(feature = "cuda")]
            Self::Device(_) => None,
        }
    }
}

#[cfg(feature = "cuda")]
impl super::cuda::DeviceRing for HostedKv {
    fn device_kv(&self) -> Option<&super::cuda::DeviceKv> {
        match self {
            Self::Device(d) => Some(d),
            Self::Host(_) => None,
        }
    }
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

/// `$body` with `$e` bound to the executor of whichever arm `$self` is.
macro_rules! each {
    ($self:expr, $e:ident => $body:expr) => {
        match $self {
            HostedExecutor::Cpu($e) => $body,
            #[cfg(feature = "cuda")]
            HostedExecutor::Cuda($e) => $body,
        }
    };
}

impl Executor for HostedExecutor {
    type Kv = HostedKv;

    fn kv_allocator(&self) -> HostedKvAllocator {
        match self {
            Self::Cpu(_) => HostedKvAllocator::Host,
            #[cfg(feature = "cuda")]
            Self::Cuda(e) => HostedKvAllocator::Device(e.kv_allocator()),
        }
    }

    fn config(&self) -> &ModelConfig {
        each!(self, e => e.config())
    }

    fn kv_shape(&self, dtype: KvDtype) -> KvShape {
        each!(self, e => e.kv_shape(dtype))
    }

    fn kv_windows(&self) -> Vec<Option<usize>> {
        each!(self, e => e.kv_windows())
    }

    fn weight_cache(&self) -> Option<&WeightCache> {
        each!(self, e => e.weight_cache())
    }

    fn host_pool(&self) -> &ThreadPool {
        each!(self, e => e.host_pool())
    }

    fn stop_tokens_with(&self, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
        each!(self, e => e.stop_tokens_with(tokenizer))
    }

    /// The CPU arm runs the model on the rings as host memory; the CUDA arm on them as device
    /// memory. A ring of the other kind is a typed error ([`KvError::NotInHostMemory`] on the
    /// CPU, `CudaError::RingNotOnDevice` on the GPU), never a panic.
    fn forward(
        &self,
        steps: &mut [SeqStep<'_, HostedKv>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        match self {
            Self::Cpu(e) => e.model().forward(steps, logits),
            #[cfg(feature = "cuda")]
            Self::Cuda(e) => e.forward_on(steps, logits),
        }
    }
}
