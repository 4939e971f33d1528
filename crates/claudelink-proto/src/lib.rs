//! claudelink-proto: the claudelink QUIC inference protocol and the Anthropic Messages API gateway.
//!
//! The crate depends on no model crate: it reaches inference through the [`InferenceService`]
//! trait, which an application (the `zerolayer` root package) implements over its engine.

mod service;

pub use service::{
    CacheStrategy, ChatMessage, ChatRole, ErrorCode, EventStream, InferenceEvent, InferenceRequest,
    InferenceService, ModelInfo, Prompt, SamplingParams, ServiceError, ServiceMetrics, StopReason,
    Usage,
};
