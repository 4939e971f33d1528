//! The HTTP gateway: the Anthropic Messages API (and OpenAI Chat Completions) over HTTP/1.1 and
//! HTTP/2 on TCP (hyper) and over HTTP/3 on QUIC (h3 + h3-quinn), in front of an
//! [`InferenceService`](crate::InferenceService).
//!
//! Endpoints: `POST /v1/messages` (JSON or SSE), `POST /v1/messages/count_tokens`,
//! `GET /v1/models[/{id}]`, `POST /v1/chat/completions` (JSON or `data:` chunks ending in
//! `[DONE]`), `GET|HEAD /health`, `GET /metrics` (Prometheus text).
//!
//! Deviation from upstream: `anthropic-version: 2026-10-21` removed `temperature`, `top_p` and
//! `top_k` (upstream answers 400 when they are sent); this gateway honours them under both
//! versions, so old and new SDKs (the latter via `extra_body`) can sample.

mod config;
mod core;
mod error;
mod h3;
mod ids;
mod in_flight;
mod limits;
mod metrics;
mod sse;
mod tcp;
mod validate;

pub use self::config::{GatewayConfig, LAYER_VERSION};
pub use self::core::{Gateway, SUPPORTED_ANTHROPIC_VERSIONS};
pub use self::error::{ApiError, ApiErrorKind};
pub use self::h3::{H3_ALPN, H3Handler};
