//! claudelink-proto: the claudelink QUIC inference protocol and the Anthropic Messages API gateway.
//!
//! The crate depends on no model crate: it reaches inference through the [`InferenceService`]
//! trait, which an application (the `zerolayer` root package) implements over its engine.

mod client;
mod codec;
mod gateway;
mod server;
mod service;
mod state;
mod tls;

pub use service::{
    CacheStrategy, ChatMessage, ChatRole, ErrorCode, EventStream, InferenceEvent, InferenceRequest,
    InferenceService, ModelInfo, Prompt, SamplingParams, ServiceError, ServiceMetrics, StopReason,
    Usage,
};
pub use gateway::{
    ApiError, ApiErrorKind, Gateway, GatewayConfig, H3_ALPN, H3Handler, LAYER_VERSION,
    SUPPORTED_ANTHROPIC_VERSIONS,
};
pub use client::{
    Client, ClientConfig, ClientError, Connection, Pool, PoolConfig, PoolStats, RequestError,
    ResponseStream, StreamError,
};
pub use codec::{
    AppErrorCode, ChatMessageRef, DEFAULT_MAX_FRAME_SIZE, DecodeError, DeltaFrame, EncodeError,
    ErrorFrame, FRAME_HEADER_LEN, FinishedFrame, Frame, FrameType, GoAwayFrame,
    HARD_MAX_FRAME_SIZE, Health, MAX_STOP_SEQUENCES, PingFrame, PongFrame, PromptRef,
    RequestFrame, StartedFrame, TokenIds, decode_frame, decode_header, decode_payload,
    error_code_from_u16, error_code_name, error_code_to_u16,
};
pub use server::{
    ALPN, ConnectionHandler, ConnectionInfo, Server, ServerConfig, ServerError, ServerStats,
};
pub use state::{
    ClientStream, ClientStreamError, ConnectionAction, ConnectionState, ServerStream,
    ServerStreamAction, Side,
};
pub use tls::{CertFingerprint, Identity, PinnedVerifier, TlsError, Trust};

/// The QUIC implementation claudelink runs on (its types appear in this crate's API).
pub use quinn;
/// The TLS implementation (its types appear in this crate's API).
pub use rustls;
/// Async streams (the [`EventStream`] and client response streams implement its `Stream`).
pub use futures;
