//! zerolayer-gateway: the HTTP edge of an inference server. The Anthropic Messages API and the
//! OpenAI Chat Completions / Completions APIs over HTTP/1.1 and HTTP/2 on TCP (hyper, optionally
//! TLS) and over HTTP/3 on QUIC (h3 + h3-quinn, on a claudelink server's UDP port), in front of
//! any [`InferenceService`](zerolayer_api::InferenceService). Use it to give an engine the
//! APIs that existing SDKs speak; a Rust client that wants the engine's own protocol depends on
//! `claudelink-proto` alone, which has no HTTP stack.
//!
//! ```
//! use std::sync::Arc;
//! use zerolayer_api::*;
//! use zerolayer_gateway::{Gateway, GatewayConfig};
//!
//! /// A service that answers every prompt with "hi".
//! struct Hi;
//! impl InferenceService for Hi {
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
//! let gateway = Gateway::new(Arc::new(Hi), GatewayConfig::default());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! let addr = listener.local_addr().unwrap();
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let server = tokio::spawn(async move {
//!     gateway.serve_tcp(listener, async { stopped.await.ok(); }).await
//! });
//!
//! // One non-streaming Messages request over HTTP/1.1.
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! let body = r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hello"}]}"#;
//! let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
//! let head = format!(
//!     "POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
//!      content-length: {}\r\nconnection: close\r\n\r\n",
//!     body.len()
//! );
//! tcp.write_all(head.as_bytes()).await.unwrap();
//! tcp.write_all(body.as_bytes()).await.unwrap();
//! let mut reply = String::new();
//! tcp.read_to_string(&mut reply).await.unwrap();
//! assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
//! assert!(reply.contains(r#""text":"hi""#), "{reply}");
//! stop.send(()).unwrap();
//! server.await.unwrap().unwrap();
//! # });
//! ```
//!
//! # What it serves
//!
//! Endpoints: `POST /v1/messages` (JSON or SSE), `POST /v1/messages/count_tokens`,
//! `GET /v1/models[/{id}]`, `POST /v1/chat/completions` (JSON or `data:` chunks ending in
//! `[DONE]`; `logprobs`/`top_logprobs`, `n` up to 8), `POST /v1/completions` (OpenAI legacy
//! text completions, streaming and not, integer `logprobs`), `GET|HEAD /health`,
//! `GET /metrics` (Prometheus text).
//!
//! Sampling fields accepted by all generating endpoints (whatever the API names): `temperature`,
//! `top_p`, `top_k`, `min_p`, `repetition_penalty` (or llama.cpp's `repeat_penalty`),
//! `frequency_penalty`, `presence_penalty`, `seed` (without one, a sampled request draws a
//! random seed). Structured output: OpenAI `response_format` (`json_object`, `json_schema`) and
//! Anthropic `output_config.format` (`json_schema`; the beta's `output_format` too) constrain
//! decoding to the schema (`format.rs`). Tool use on both chat APIs (`tools.rs`): `tools` and
//! `tool_choice` reach the model's chat template, its calls come back as Anthropic `tool_use`
//! blocks / OpenAI `tool_calls` (streamed too), earlier calls and their results are taken in
//! later turns, and a forced tool constrains decoding to a call valid for its schema. Every
//! other field, message key or content-block type that the server does not honour (images,
//! thinking, ...) is answered with a 400 naming it (see `fields.rs` for the few harmless ones
//! accepted and ignored).
//!
//! Defences: requests are admitted on their headers (route, method, API key) before any body
//! byte is read; bodies, prompts (`max_prompt_bytes`), JSON Schemas (at most 64 levels deep and
//! 8192 JSON values each, `schema.rs`) and TCP connections (in all and per client address) are
//! limited; headers must arrive within `header_read_timeout`; dead TCP
//! peers are found by keep-alive and `TCP_USER_TIMEOUT`; JSON parsing of large bodies and
//! tokenization (`count_tokens`) run on tokio's blocking pool, never on a runtime thread. A
//! server without API keys answers only JSON bodies (415 otherwise) and only requests naming a
//! loopback host, an IP address or an allowed name (`allowed_hosts`; 403 otherwise), so that a
//! web page cannot use it through a visitor's browser (`origin.rs`).
//!
//! Deviation from upstream: `anthropic-version: 2026-10-21` removed `temperature`, `top_p` and
//! `top_k` (upstream answers 400 when they are sent); this gateway honours them under both
//! versions, so old and new SDKs (the latter via `extra_body`) can sample.

#![forbid(unsafe_code)]

mod access;
mod choices;
mod config;
mod conn_watch;
mod core;
mod error;
mod fields;
mod format;
mod h3;
mod ids;
mod in_flight;
mod metrics;
mod origin;
mod schema;
mod sse;
mod tcp;
mod tools;
mod validate;

pub use self::config::{GatewayConfig, LAYER_VERSION};
pub use self::core::{Gateway, SUPPORTED_ANTHROPIC_VERSIONS};
pub use self::error::{ApiError, ApiErrorKind};
pub use self::h3::{H3_ALPN, H3Handler};

/// A chat page for [`GatewayConfig::index_page`]: one self-contained HTML file (no external
/// resources) that talks to this gateway's `/v1/messages` with streaming; `zerolayer serve`
/// serves it at `/`.
pub const CHAT_PAGE: &str = include_str!("chat.html");

/// The protocol crate whose TLS identities and QUIC server appear in this crate's API.
pub use claudelink_proto;
/// The service contract ([`InferenceService`](zerolayer_api::InferenceService)) a gateway serves.
pub use zerolayer_api;
