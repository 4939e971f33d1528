//! API errors in Anthropic's (and OpenAI's) wire shape.

use http::StatusCode;
use serde_json::{Value, json};

use zerolayer_api::{ErrorCode, ServiceError};

/// The error classes of the Anthropic API, each with its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ApiErrorKind {
    /// 400: the request is malformed or names invalid values.
    InvalidRequest,
    /// 401: missing or wrong API key.
    Authentication,
    /// 403: the key may not use this resource.
    Permission,
    /// 404: unknown route or model.
    NotFound,
    /// 413: the body exceeds the configured limit.
    RequestTooLarge,
    /// 415: the body is not declared as JSON (servers without API keys require it). Its type
    /// is `invalid_request_error`.
    UnsupportedMediaType,
    /// 429: too many concurrent requests for this key.
    RateLimit,
    /// 500: a failure inside the server.
    Api,
    /// 504: the request ran past its time limit.
    Timeout,
    /// 503: the server cannot generate until it is restarted (its model file changed on
    /// disk). Its type is `api_error`: the Anthropic API has no type of its own for 503 (its
    /// SDKs read the status as `ServiceUnavailable`).
    Unavailable,
    /// 529: the server is at capacity (or draining); retry later.
    Overloaded,
}

impl ApiErrorKind {
    /// The `error.type` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest | Self::UnsupportedMediaType => "invalid_request_error",
            Self::Authentication => "authentication_error",
            Self::Permission => "permission_error",
            Self::NotFound => "not_found_error",
            Self::RequestTooLarge => "request_too_large",
            Self::RateLimit => "rate_limit_error",
            Self::Api | Self::Unavailable => "api_error",
            Self::Timeout => "timeout_error",
            Self::Overloaded => "overloaded_error",
        }
    }

    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Self::InvalidRequest => StatusCode::BAD_REQUEST,
            Self::Authentication => StatusCode::UNAUTHORIZED,
            Self::Permission => StatusCode::FORBIDDEN,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::RateLimit => StatusCode::TOO_MANY_REQUESTS,
            Self::Api => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Timeout => StatusCode::GATEWAY_TIMEOUT,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Overloaded => StatusCode::from_u16(529).expect("529 is a valid status"),
        }
    }
}

/// An error answer: its class, a message naming the offending field, and a retry hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Error class (decides the status).
    pub kind: ApiErrorKind,
    /// Human-readable message.
    pub message: String,
    /// For 429/529: how long the client should wait before retrying.
    pub retry_after_ms: Option<u64>,
}

impl ApiError {
    /// A new error of `kind`.
    pub fn new(kind: ApiErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            retry_after_ms: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ApiErrorKind::InvalidRequest, message)
    }

    /// Adds a retry hint.
    pub fn with_retry_after(mut self, ms: u64) -> Self {
        self.retry_after_ms = Some(ms);
        self
    }

    /// The error from an in-stream service failure.
    pub fn from_code(code: ErrorCode, message: String) -> Self {
        let kind = match code {
            ErrorCode::InvalidRequest | ErrorCode::ContextLength => ApiErrorKind::InvalidRequest,
            ErrorCode::NotFound => ApiErrorKind::NotFound,
            ErrorCode::Overloaded | ErrorCode::ShuttingDown => ApiErrorKind::Overloaded,
            ErrorCode::Timeout => ApiErrorKind::Timeout,
            ErrorCode::Cancelled | ErrorCode::Internal => ApiErrorKind::Api,
        };
        let err = Self::new(kind, message);
        if kind == ApiErrorKind::Overloaded {
            err.with_retry_after(1000)
        } else {
            err
        }
    }

    /// The Anthropic error body `{"type":"error","error":{..},"request_id":..}`.
    pub fn anthropic_body(&self, request_id: &str) -> Value {
        json!({
            "type": "error",
            "error": {"type": self.kind.as_str(), "message": self.message},
            "request_id": request_id,
        })
    }

    /// The OpenAI error body `{"error":{"message","type","param","code"}}`.
    pub fn openai_body(&self, request_id: &str) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind.as_str(),
                "param": Value::Null,
                "code": Value::Null,
            },
            "request_id": request_id,
        })
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::Overloaded { retry_after_ms } => {
                Self::new(ApiErrorKind::Overloaded, "Overloaded").with_retry_after(retry_after_ms)
            }
            ServiceError::ShuttingDown => Self::new(
                ApiErrorKind::Overloaded,
                "Overloaded: the server is shutting down",
            )
            .with_retry_after(1000),
            ServiceError::ContextLength {
                prompt_tokens,
                limit,
            } => Self::invalid(format!(
                "prompt is too long: {prompt_tokens} tokens > {limit} maximum"
            )),
            ServiceError::InvalidRequest { field, reason } => {
                Self::invalid(format!("{field}: {reason}"))
            }
            ServiceError::InvalidSchema { schema, reason } => {
                Self::invalid(format!("{schema}: {reason}"))
            }
            // The path stays out of the answer (`/health` names it for the operator).
            ServiceError::ModelFileChanged { .. } => Self::new(
                ApiErrorKind::Unavailable,
                "the served model's file changed on disk after it was loaded: this server \
                 generates nothing more until it is restarted",
            ),
            // A variant added to the service contract later: its own message, as a 500.
            other => Self::new(ApiErrorKind::Api, other.to_string()),
        }
    }
}
