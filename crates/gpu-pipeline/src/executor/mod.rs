//! What runs the forward pass, and how its weights reach the device.
//!
//! The engine (scheduler, KV admission, sampling, streaming) talks to the model only through
//! [`Executor`]: the model's shape, the KV layout it wants, and one batched `forward` over
//! sequence steps. [`CpuExecutor`] runs today's CPU kernels. A device backend (CUDA, Metal,
//! ROCm) is another implementation of the trait; see `docs/ARCHITECTURE.md`.
//!
//! [`StreamPlan`] decides, for a device budget smaller than the weights, which tensors stay
//! resident and which stream layer by layer through two double-buffered slots.
//!
//! Each executor names the [`KvStorage`] its sequences' rings keep their elements in
//! ([`Executor::Kv`]); the engine allocates the rings from a [`kv_ring::KvPool`] of that storage
//! ([`Executor::kv_allocator`]). The CPU and streaming executors take host rings
//! ([`HostKv`](kv_ring::HostKv)), whose views the CPU attention reads as slices; the CUDA
//! executor takes device rings ([`cuda::DeviceKv`], feature `cuda`), written and read in place
//! by its kernels; [`HostedExecutor`] (either, chosen at run time) takes [`HostedKv`], an enum
//! of the two whose variant its pool's allocator picks.

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod hosted;
mod plan;
mod streaming;

pub use cpu::CpuExecutor;
#[cfg(feature = "cuda")]
pub use cuda::{CudaError, CudaExecutor, CudaOptions, DeviceStats};
pub use hosted::{HostedExecutor, HostedKv, HostedKvAllocator};
pub use plan::{
    LayerPlan, LayerWeights, Placed, Placement, PlanError, PlanOptions, StreamPlan, WeightSpan,
};
pub use streaming::{StreamStats, StreamingError, StreamingExecutor};

use kv_ring::{KvDtype, KvShape, KvStorage};
use token_stream::Tokenizer;
use weight_cache::WeightCache;

use crate::model::{ForwardError, ModelConfig, SeqStep};
use crate::threadpool::ThreadPool;

/// Runs a model's forward pass for the engine. Implementations are shared between the engine's
/// handle and its worker thread, hence `Send + Sync`.
pub trait Executor: Send + Sync + 'static {
    /// Where the sequences' KV rings keep their elements: [`HostKv`](kv_ring::HostKv) for an
    /// executor whose attention reads host views, a device buffer type for one that keeps KV
    /// on its device.
    type Kv: KvStorage;

    /// The allocator the engine's KV pool passes to every buffer of [`Kv`](Self::Kv) (`()` for
    /// host memory; a device stream).
    fn kv_allocator(&self) -> <Self::Kv as KvStorage>::Allocator;

    /// The model's configuration (vocabulary, context length, layer shapes).
    fn config(&self) -> &ModelConfig;

    /// The KV cache shape for `dtype` storage (what each sequence's ring holds per token).
    fn kv_shape(&self, dtype: KvDtype) -> KvShape;

    /// Per layer, the attention window (`None` = full attention); the KV pool keeps only the
    /// rows a window layer can still attend to.
    fn kv_windows(&self) -> Vec<Option<usize>>;

    /// The weight cache the weights are read through (for its hit-rate metrics), if one is
    /// attached.
    fn weight_cache(&self) -> Option<&WeightCache>;

    /// The host thread pool the engine may use for its own parallel work (sampling).
    fn host_pool(&self) -> &ThreadPool;

    /// The tokens that end a generation by default: the model's EOS/EOT plus `tokenizer`'s
    /// end-of-generation ids.
    fn stop_tokens_with(&self, tokenizer: Option<&Tokenizer>) -> Vec<u32>;

    /// One batched step: appends every step's tokens to its KV ring and writes the wanted
    /// logits rows (`vocab_size` floats each, in step order) to `logits`. A row's result does
    /// not depend on the other steps in the batch.
    fn forward(
        &self,
        steps: &mut [SeqStep<'_, Self::Kv>],
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError>;
}
