//! gpu-pipeline: the Llama-family transformer forward pass over mmap'd quantized weights.
//!
//! The CPU backend (the default) runs SIMD kernels directly over the GGUF blocks in the mapping,
//! on a persistent thread pool.

mod bandwidth;
mod constraint;
pub mod engine;
pub mod executor;
mod grammar;
mod json_number;
pub mod kernels;
mod model;
mod sampling;
mod threadpool;

pub use bandwidth::{Bandwidth, Int8Peak, int8_peak, read_bandwidth};
pub use constraint::{Constraint, ConstraintError, ConstraintFactory};
pub use engine::{
    Completion, Engine, EngineConfig, GenerateError, GenerationRequest, RequestHandle, SubmitError,
};
pub use grammar::{GrammarError, Grammars, bound_json_integers};
pub use model::attention::attend_rows;
pub use model::hf;
pub use model::{
    Activation, GgufSource, HfError, HfModel, LayerConfig, LayerRope, MAX_EXPERTS, MoeConfig,
    QkNorm, SUPPORTED_ARCHITECTURES, SourceTensor, WeightSource,
};
pub use model::{
    ActivationSplit, ForwardError, LogitsWanted, Model, ModelConfig, ModelError, ModelOptions,
    RopeConfig, RopeLayout, RopeScaling, SeqStep, WeightPacking,
};
pub use sampling::{
    Sampler, SamplerConfig, StopMatcher, TokenMask, fill_token_bytes, token_logprob, token_nll,
};
pub use threadpool::ThreadPool;
/// The service vocabulary the engine takes and emits ([`StopReason`], `Usage`, ...).
pub use zerolayer_api;
/// Why a generation ended: the service vocabulary's, which the engine emits.
pub use zerolayer_api::StopReason;
