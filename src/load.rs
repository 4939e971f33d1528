//! Opening a model: a GGUF file or a Hugging Face directory, with its tokenizer and chat template.

use std::path::Path;
use std::sync::Arc;

use gpu_pipeline::executor::{CpuExecutor, HostedExecutor};
use gpu_pipeline::{Model, ModelOptions, WeightSource};
use token_stream::{ChatTemplate, Tokenizer};

use crate::service::LoadServiceError;

/// Maps the model at `path` with its tokenizer: a GGUF file, or a Hugging Face model directory
/// (`config.json`, `*.safetensors`, `tokenizer.json`; see [`gpu_pipeline::HfModel`]). The one
/// loader of every command (`serve`, `generate`, `run`, `bench`, `perplexity`) and of
/// [`EngineService::load`](crate::EngineService::load).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let path = zerolayer::weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while it is mapped.
/// let (model, tokenizer) =
///     unsafe { zerolayer::load_model(&path, zerolayer::gpu_pipeline::ModelOptions::default()) }?;
/// let template = zerolayer::chat_template(&tokenizer, model.source().as_ref());
/// # Ok(()) }
/// ```
///
/// # Safety
/// The files must not be modified or truncated while mapped (see `weight_cache::Gguf::open`).
pub unsafe fn load_model(
    path: &Path,
    options: ModelOptions,
) -> Result<(Model, Tokenizer), LoadServiceError> {
    if path.is_dir() {
        // SAFETY: forwarded to our caller.
        let hf = unsafe { gpu_pipeline::HfModel::open(path) }?;
        let tokenizer = Tokenizer::from_tokenizer_json_file(hf.tokenizer_json_path())?;
        Ok((Model::load_source(Arc::new(hf), options)?, tokenizer))
    } else {
        // SAFETY: forwarded to our caller.
        let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }?);
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let model = Model::load(gguf.clone(), options)?;
        // Vocabulary and configuration are built: the header's pages need not stay resident
        // (a later metadata read faults them back in). Best effort.
        let _ = gguf.release_header();
        Ok((model, tokenizer))
    }
}

/// The model's chat template: the tokenizer's (GGUF), else the one the source ships (a Hugging
/// Face directory's `tokenizer_config.json`) with the BOS/EOS text of the model's ids, else
/// llama.cpp's fallback (ChatML). What the server and every command render chats with.
pub fn chat_template(tok: &Tokenizer, src: &dyn WeightSource) -> Option<ChatTemplate> {
    if tok.chat_template().is_none()
        && let Some(text) = src.chat_template()
    {
        let (bos, eos) = (
            src.get_u32("tokenizer.ggml.bos_token_id"),
            src.get_u32("tokenizer.ggml.eos_token_id"),
        );
        match ChatTemplate::with_token_ids(&text, tok, bos, eos) {
            Ok(t) => return Some(t),
            Err(e) => tracing::warn!("the model's chat template does not compile ({e}): ChatML"),
        }
    }
    ChatTemplate::from_tokenizer(tok).ok()
}

/// What runs the forward pass ([`executor`], [`EngineService::load_on`](crate::EngineService::load_on)).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExecutorChoice {
    /// The CPU kernels.
    #[default]
    Cpu,
    /// The CUDA executor (partly verified on hardware: see the gpu-pipeline README), with this
    /// many device bytes for the weights (`None`: all resident). A build without the `cuda`
    /// feature answers [`LoadServiceError::CudaNotBuilt`].
    Cuda {
        /// Device bytes for the weights.
        budget: Option<u64>,
    },
    /// The CUDA executor where it starts (a driver, NVRTC or precompiled kernels, a GPU, a model
    /// its kernels cover, the budget met), else the CPU kernels; the log says which ran and,
    /// for the CPU, why the GPU did not.
    Auto {
        /// Device bytes for the weights.
        budget: Option<u64>,
    },
}

/// The executor `choice` names, running `model`: what every command and the server run the
/// forward pass on. The CUDA executor logs its device and how much of the weights it holds.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// let path = zerolayer::weight_cache::locate_default_model()?;
/// // SAFETY: the model file is not modified while it is mapped.
/// let (model, _) = unsafe { zerolayer::load_model(&path, Default::default()) }?;
/// let exec = zerolayer::executor(Arc::new(model), zerolayer::ExecutorChoice::Cpu)?;
/// # Ok(()) }
/// ```
pub fn executor(
    model: Arc<Model>,
    choice: ExecutorChoice,
) -> Result<HostedExecutor, LoadServiceError> {
    match choice {
        ExecutorChoice::Cpu => Ok(CpuExecutor::new(model).into()),
        ExecutorChoice::Cuda { budget } => cuda_executor(model, budget),
        ExecutorChoice::Auto { budget } => match cuda_executor(model.clone(), budget) {
            Ok(exec) => Ok(exec),
            Err(e) => {
                tracing::info!(reason = %e, "no usable GPU: the forward pass runs on the CPU kernels");
                Ok(CpuExecutor::new(model).into())
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn cuda_executor(
    model: Arc<Model>,
    budget: Option<u64>,
) -> Result<HostedExecutor, LoadServiceError> {
    let mut opts = gpu_pipeline::executor::CudaOptions::default();
    opts.budget = budget;
    // Kernels compiled beforehand (`examples/cuda_ptx.rs`), for a machine with the driver and
    // without NVRTC.
    opts.ptx_dir = std::env::var_os("ZEROLAYER_CUDA_PTX_DIR").map(Into::into);
    // The access profile where `serve` keeps it by default (beside the model file): under a
    // budget the hottest tensors (experts) stay on the device.
    let beside = model
        .gguf()
        .and_then(|g| g.path())
        .map(|p| p.with_extension("profile"))
        .filter(|p| p.is_file());
    if let Some(path) = beside.filter(|_| budget.is_some()) {
        match weight_cache::AccessProfile::load(&path) {
            Ok(p) => opts.profile = Some(p),
            Err(e) => tracing::warn!(profile = %path.display(), "ignoring the access profile: {e}"),
        }
    }
    let exec = gpu_pipeline::executor::CudaExecutor::new(model, opts)?;
    let st = exec.stats();
    tracing::info!(
        device = %st.device,
        arch = %st.arch,
        weight_device_bytes = st.weight_device_bytes,
        weight_bytes = st.weight_bytes,
        streamed_bytes_per_step = st.streamed_bytes_per_step,
        "the forward pass runs on the CUDA executor"
    );
    Ok(exec.into())
}

#[cfg(not(feature = "cuda"))]
fn cuda_executor(_: Arc<Model>, _: Option<u64>) -> Result<HostedExecutor, LoadServiceError> {
    Err(LoadServiceError::CudaNotBuilt)
}
