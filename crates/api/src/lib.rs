//! zerolayer-api: the vocabulary every layer of a zerolayer server shares. One definition of
//! each concept from the edge to the engine: [`InferenceRequest`] (with its [`Prompt`],
//! [`ChatMessage`]s, [`SamplingParams`], tools and [`OutputFormat`]), the [`InferenceEvent`]s a
//! running request sends back ([`StopReason`], [`Usage`], [`TokenLogprob`]), the errors
//! ([`ServiceError`], [`ErrorCode`]), the metrics snapshot ([`ServiceMetrics`]), the
//! [`Histogram`] every layer records latencies and rates in, and the [`InferenceService`] trait
//! an engine implements for the transports.
//!
//! A leaf crate (futures, thiserror and serde_json only): depend on it to implement a service
//! or to write a transport without pulling in either side. The claudelink protocol
//! (`claudelink-proto`) and the HTTP gateway (`zerolayer-gateway`) carry these values; the
//! engine (`gpu-pipeline`) takes and emits them.
//!
//! [`InferenceService::submit`] only enqueues work and returns at once; tokens arrive through
//! the returned [`EventStream`]. Dropping the stream cancels the request and frees its
//! resources (KV cache, batch slot).
//!
//! ```
//! use futures::{StreamExt, stream};
//! use zerolayer_api::*;
//!
//! /// Answers every prompt with "hi".
//! struct Hi;
//! impl InferenceService for Hi {
//!     fn submit(&self, req: InferenceRequest) -> Result<EventStream, ServiceError> {
//!         Ok(Box::pin(stream::iter([
//!             InferenceEvent::Started { input_tokens: 1 },
//!             InferenceEvent::Delta { ids: vec![7], text: "hi".into() },
//!             InferenceEvent::Finished {
//!                 stop_reason: StopReason::EndTurn,
//!                 stop_sequence: None,
//!                 usage: Usage { input_tokens: 1, output_tokens: 1 },
//!             },
//!         ])))
//!     }
//!     fn count_tokens(&self, _: &Prompt) -> Result<u32, ServiceError> { Ok(1) }
//!     fn models(&self) -> Vec<ModelInfo> { vec![] }
//!     fn metrics(&self) -> ServiceMetrics { ServiceMetrics::default() }
//! }
//!
//! let chat = Prompt::Chat(vec![ChatMessage::new(ChatRole::User, "hello")]);
//! let events: Vec<_> = futures::executor::block_on(
//!     Hi.submit(InferenceRequest::new("m", chat, 8)).unwrap().collect(),
//! );
//! assert_eq!(events[1], InferenceEvent::Delta { ids: vec![7], text: "hi".into() });
//! assert!(matches!(events[2], InferenceEvent::Finished { stop_reason: StopReason::EndTurn, .. }));
//! ```

#![forbid(unsafe_code)]

mod error;
mod event;
mod histogram;
mod request;
mod service;

pub use error::{ErrorCode, SchemaSource, ServiceError};
pub use event::{EventStream, InferenceEvent, StopReason, TokenLogprob, Usage};
pub use histogram::Histogram;
pub use request::{
    CacheStrategy, ChatMessage, ChatRole, InferenceRequest, OutputFormat, Prompt, SamplingParams,
    ToolCallMessage, ToolChoice, ToolDefinition, Tools,
};
pub use service::{InferenceService, ModelInfo, ServiceHealth, ServiceMetrics};

/// Async streams ([`EventStream`] is a boxed `futures::Stream`).
pub use futures;
/// JSON values ([`ToolCallMessage::arguments`], [`ToolDefinition::parameters`],
/// [`OutputFormat::JsonSchema`]).
pub use serde_json;
