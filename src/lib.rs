//! zerolayer: serve LLMs with almost nothing between the request and the matrix math.
//!
//! This root package re-exports the workspace's crates and composes them; each crate can also be
//! used on its own.

mod service;

pub use service::{EngineService, LoadServiceError};

pub use claudelink_proto;
pub use gpu_pipeline;
pub use kv_ring;
pub use token_stream;
pub use weight_cache;
