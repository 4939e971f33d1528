//! gpu-pipeline: the Llama-family transformer forward pass over mmap'd quantized weights.
//!
//! The CPU backend (the default) runs SIMD kernels directly over the GGUF blocks in the mapping,
//! on a persistent thread pool.

pub mod kernels;
mod threadpool;

pub use threadpool::ThreadPool;
