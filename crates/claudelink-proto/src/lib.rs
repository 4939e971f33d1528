//! claudelink-proto: the claudelink QUIC inference protocol.
//!
//! The crate depends on no model crate: it reaches inference through the [`InferenceService`]
//! trait, which an application (the `zerolayer` root package) implements over its engine. The
//! HTTP edge (Anthropic Messages and OpenAI APIs over HTTP/1.1, HTTP/2 and HTTP/3) is the
//! `zerolayer-gateway` crate, which builds on this one; a claudelink client or server compiles
//! no HTTP stack.
//!
//! # claudelink/2
//!
//! A binary protocol on QUIC + TLS 1.3 (quinn, rustls): one bidirectional stream per request, a
//! REQUEST frame up, STARTED / DELTA* / FINISHED|ERROR frames down, and a control stream for
//! AUTH (the API key, first), PING/PONG health and GOAWAY. The frame codec ([`decode_frame`], [`Frame`]) and the state
//! machines ([`ServerStream`], [`ClientStream`], [`ConnectionState`]) are sans-IO; [`Server`],
//! [`Client`], [`Connection`] and [`Pool`] are the thin quinn shell. The wire format is specified
//! in `docs/claudelink.md`. Use it when a client talks to the engine often: after one handshake
//! (or none, with 0-RTT) a request costs a stream and a few dozen bytes.
//!
//! ```
//! use std::sync::Arc;
//! use claudelink_proto::*;
//! use futures::StreamExt;
//!
//! struct Two;
//! impl InferenceService for Two {
//!     fn submit(&self, _: InferenceRequest) -> Result<EventStream, ServiceError> {
//!         Ok(Box::pin(futures::stream::iter([
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
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let identity = Identity::self_signed(&["localhost"]).unwrap();
//! let server = Server::bind("127.0.0.1:0".parse().unwrap(), ServerConfig::new(identity), Arc::new(Two)).unwrap();
//! let client = Client::new(ClientConfig::new(Trust::Pinned(server.fingerprint()))).unwrap();
//! let conn = client.connect(server.local_addr()).await.unwrap();
//! let req = InferenceRequest::new("m", Prompt::Text("hello".into()), 8);
//! let events = conn.request(&req).await.unwrap().collect_all().await.unwrap();
//! assert_eq!(events[1], InferenceEvent::Delta { ids: vec![7], text: "hi".into() });
//! # });
//! ```

#![forbid(unsafe_code)]

mod auth;
mod client;
mod codec;
mod limits;
mod pool;
mod server;
mod state;
mod tls;

pub use auth::{ApiKeys, key_label};
pub use client::{
    Client, ClientConfig, ClientError, Connection, RequestError, ResponseStream, StreamError,
};
pub use codec::{
    AppErrorCode, AuthFrame, ChatMessageRef, DEFAULT_MAX_FRAME_SIZE, DeltaFrame, EncodeError,
    ErrorFrame, FRAME_HEADER_LEN, FinishedFrame, Frame, FrameDecodeError, FrameType, GoAwayFrame,
    HARD_MAX_FRAME_SIZE, Health, MAX_STOP_SEQUENCES, PingFrame, PongFrame, PromptRef, RequestFrame,
    StartedFrame, TokenIds, decode_frame, decode_header, decode_payload, error_code_from_u16,
    error_code_name, error_code_to_u16,
};
pub use limits::{ConnectionLimits, ConnectionRefused, ConnectionSlot};
pub use pool::{ConnectionPoolStats, Pool, PoolConfig, PoolStream, ReplicaResolver, Replicas};
pub use server::{
    ALPN, Congestion, ConnectionHandler, ConnectionInfo, Server, ServerConfig, ServerError,
    ServerStats,
};
pub use state::{
    ClientStream, ClientStreamError, ConnectionAction, ConnectionState, ServerStream,
    ServerStreamAction, Side,
};
pub use tls::{CertFingerprint, Identity, PinnedVerifier, TlsError, Trust};
/// The service contract claudelink carries, defined in `zerolayer-api` (re-exported so that a
/// claudelink user needs one dependency).
pub use zerolayer_api::{
    CacheStrategy, ChatMessage, ChatRole, ErrorCode, EventStream, InferenceEvent, InferenceRequest,
    InferenceService, ModelInfo, OutputFormat, Prompt, SamplingParams, SchemaSource, ServiceError,
    ServiceHealth, ServiceMetrics, StopReason, TokenLogprob, ToolCallMessage, ToolChoice,
    ToolDefinition, Tools, Usage,
};

/// Async streams (the [`EventStream`] and client response streams implement its `Stream`).
pub use futures;
/// The QUIC implementation claudelink runs on (its types appear in this crate's API).
pub use quinn;
/// The TLS implementation (its types appear in this crate's API).
pub use rustls;
/// The service contract's crate.
pub use zerolayer_api;
