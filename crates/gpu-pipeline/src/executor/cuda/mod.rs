//! The CUDA executor: the forward pass on an NVIDIA GPU through cudarc (driver API + NVRTC,
//! both loaded with `dlopen` at run time, so this always builds).
//!
//! **Unverified on hardware** until `scripts/gpu-check` has passed on a machine with a GPU: CI
//! compiles every kernel with NVRTC and checks that a machine without a driver gets
//! [`CudaError::NoDriver`], nothing more.
//!
//! Design (simple over fast; see `docs/ARCHITECTURE.md`):
//! - Kernels ([`kernels::SOURCE`]) are compiled with NVRTC for the device's compute capability
//!   when the executor is created. Each mirrors a CPU function (named in its comment).
//! - Weights are uploaded from the source's mapping as the GGUF blocks are (dequantized inside
//!   the matmul). Under a device budget smaller than the weights, a [`StreamPlan`] decides which
//!   tensors stay resident; the others stream per step through two slots: layer `l + 2`'s
//!   upload (mmap -> pinned staging -> device, on a copy stream) starts once layer `l` has
//!   finished with its slot (an event), and layer `l`'s compute waits for its upload (an event).
//! - The KV cache stays on the device: the executor's rings keep their elements in a
//!   [`DeviceKv`] ([`Executor::Kv`](super::Executor::Kv)), allocated by the engine's pool on the
//!   compute stream. The ring on the host does the bookkeeping (positions, slots, eviction,
//!   windows, growth, forks as device-to-device copies); per forward pass the executor uploads
//!   one small table of where each step's rows are per layer (O(layers x (steps + tokens))
//!   words, independent of the context), then per layer `kv_scatter` writes the new K/V rows
//!   at the ring's slots and `attention_ring` reads the rings in place. No K/V crosses the
//!   PCIe bus.
//!
//! [`StreamPlan`]: super::StreamPlan

mod exec;
pub mod kernels;
mod kv;
mod probe;

pub use exec::{CudaExecutor, CudaOptions, DeviceStats};
pub use kv::DeviceKv;
pub(crate) use kv::DeviceRing;
pub use probe::NVRTC_LIB_ENV;

/// Why the CUDA executor could not be created or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (libcuda) is not installed or not on the loader's path: no
    /// NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda not found (tried {})", tried.join(", "))]
    NoDriver {
        /// The library names tried.
        tried: Vec<String>,
    },
    /// The NVRTC library (libnvrtc) is not found; install the CUDA toolkit or the PyPI wheel
    /// `nvidia-cuda-nvrtc-cu12` and set `ZEROLAYER_NVRTC_LIB` to its `lib` directory.
    #[error("no NVRTC: libnvrtc not found (tried {}; or set ZEROLAYER_NVRTC_LIB)", tried.join(", "))]
    NoNvrtc {
        /// The library names tried.
        tried: Vec<String>,
    },
    /// `ZEROLAYER_NVRTC_LIB` is set but does not load.
    #[error("{var} does not load: {reason}")]
    NvrtcEnv {
        /// The variable.
        var: &'static str,
        /// The path tried and the loader's message.
        reason: String,
    },
    /// A driver call failed (no device, out of memory, launch failure...).
    #[error("CUDA driver error in {op}: {source}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// The kernels did not compile.
    #[error("NVRTC compilation for {arch} failed:\n{log}")]
    Compile {
        /// The target architecture (`sm_90`).
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// The precompiled PTX file does not read.
    #[error("cannot read {path}: {source}")]
    PtxFile {
        /// The file.
        path: std::path::PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The model uses a feature the CUDA kernels do not implement.
    #[error("the CUDA executor does not support {feature} (model {arch})")]
    Unsupported {
        /// The feature.
        feature: String,
        /// The model's architecture.
        arch: String,
    },
    /// The device budget does not fit the weights' minimum working set.
    #[error(transparent)]
    Plan(#[from] super::PlanError),
    /// A step's KV ring is not a device ring on this executor's stream (a host ring, or one
    /// from another executor's pool): rings come from a pool of [`DeviceKv`] whose allocator
    /// is this executor's `kv_allocator()`.
    #[error("step {step}: its KV ring is not in this executor's device memory")]
    RingNotOnDevice {
        /// The step.
        step: usize,
    },
    /// A size does not fit the kernels' 32-bit indices.
    #[error("{what} = {value} does not fit the kernels' 32-bit sizes")]
    TooLarge {
        /// Which size.
        what: &'static str,
        /// Its value.
        value: usize,
    },
}

impl CudaError {
    /// A driver error during `op`.
    pub(crate) fn driver(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        move |source| Self::Driver { op, source }
    }
}

/// Whether libcuda and libnvrtc both load here (no GPU is needed for this to be `Ok`).
pub fn probe() -> Result<(), CudaError> {
    probe::driver()?;
    probe::nvrtc()
}

/// Whether the driver library (libcuda) loads: [`CudaError::NoDriver`] otherwise.
pub fn probe_driver() -> Result<(), CudaError> {
    probe::driver()
}

/// Whether NVRTC loads (after `ZEROLAYER_NVRTC_LIB`, if set): [`CudaError::NoNvrtc`] or
/// [`CudaError::NvrtcEnv`] otherwise. Compiling the kernels needs only this, not a GPU.
pub fn probe_nvrtc() -> Result<(), CudaError> {
    probe::nvrtc()
}
