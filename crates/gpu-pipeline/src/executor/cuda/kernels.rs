//! The kernel source (`kernels.cu`), the names of its kernels, and its NVRTC compilation.

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use weight_cache::GgmlType;

use super::CudaError;
use super::probe;

/// The CUDA C++ source of every kernel (no `#include`: the NVRTC library alone compiles it).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C"` kernel of [`SOURCE`], the names the executor loads.
pub const KERNEL_NAMES: &[&str] = &[
    "matmul_f32",
    "matmul_f16",
    "matmul_bf16",
    "matmul_q4_0",
    "matmul_q4_1",
    "matmul_q8_0",
    "matmul_q5_0",
    "matmul_q5_1",
    "matmul_q2_k",
    "matmul_q3_k",
    "matmul_q4_k",
    "matmul_q5_k",
    "matmul_q6_k",
    "matmul_iq4_nl",
    "matmul_iq4_xs",
    "embed_f32",
    "embed_f16",
    "embed_bf16",
    "embed_q4_0",
    "embed_q4_1",
    "embed_q8_0",
    "embed_q5_0",
    "embed_q5_1",
    "embed_q2_k",
    "embed_q3_k",
    "embed_q4_k",
    "embed_q5_k",
    "embed_q6_k",
    "embed_iq4_nl",
    "embed_iq4_xs",
    "rmsnorm",
    "add_inplace",
    "add_bias",
    "silu_mul",
    "gelu_tanh_mul",
    "softcap",
    "rope",
    "gather_rows",
    "moe_combine",
    "shared_expert_add",
    "kv_scatter",
    "attention_ring",
];

/// Threads per block of the matmul kernel (`MM_THREADS`) and its tokens per block
/// (`MM_TOKENS`).
pub(crate) const MM_THREADS: u32 = 128;
pub(crate) const MM_TOKENS: u32 = 8;
/// Threads per block of `rmsnorm` (`NORM_THREADS`) and `attention_ring` (`ATT_THREADS`).
pub(crate) const NORM_THREADS: u32 = 256;
pub(crate) const ATT_THREADS: u32 = 128;

/// The weight formats the kernels read (every format of the CPU kernels): the suffix of their
/// `matmul_*` / `embed_*` names.
pub(crate) fn format_suffix(dtype: GgmlType) -> Option<&'static str> {
    Some(match dtype {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::IQ4_NL => "iq4_nl",
        GgmlType::IQ4_XS => "iq4_xs",
        _ => return None,
    })
}

/// The file name of [`SOURCE`]'s PTX for `arch` in a precompiled directory
/// ([`CudaOptions::ptx_dir`](super::CudaOptions::ptx_dir)).
pub fn ptx_file_name(arch: &str) -> String {
    format!("zerolayer-kernels.{arch}.ptx")
}

/// Compiles [`SOURCE`] to PTX for `arch` (`"sm_80"`, `"sm_90"`: what the device reports). Loads
/// NVRTC first (`probe::nvrtc`): without it this is [`CudaError::NoNvrtc`], not a panic.
pub fn compile(arch: &str) -> Result<Ptx, CudaError> {
    compile_source(SOURCE, arch)
}

/// Compiles CUDA C++ `source` as [`compile`] does [`SOURCE`] (same options).
pub fn compile_source(source: &str, arch: &str) -> Result<Ptx, CudaError> {
    probe::nvrtc()?;
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        // IEEE division and square root, no flush of denormals: the CPU's arithmetic.
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        name: Some("zerolayer_kernels.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(source, opts).map_err(|e| CudaError::Compile {
        arch: arch.to_owned(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => other.to_string(),
        },
    })
}
