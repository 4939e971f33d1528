//! Errors: why a request was refused, and the error classes every transport shares.

/// Why a request could not be submitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// Queue or KV budget full; retry after the hint.
    #[error("overloaded; retry after {retry_after_ms} ms")]
    Overloaded {
        /// Suggested wait before retrying.
        retry_after_ms: u64,
    },
    /// The prompt plus `max_tokens` do not fit the model's context.
    #[error("prompt of {prompt_tokens} tokens does not fit the context of {limit} tokens")]
    ContextLength {
        /// Prompt length in tokens.
        prompt_tokens: u32,
        /// The limit that was exceeded.
        limit: u32,
    },
    /// A field has an invalid value.
    #[error("invalid value for `{field}`: {reason}")]
    InvalidRequest {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The service is shutting down.
    #[error("the service is shutting down")]
    ShuttingDown,
    /// A JSON Schema the output is constrained to cannot be used: the compiler refused it, or
    /// it cannot constrain the first token (a recursion with no way out, too many
    /// alternatives).
    #[error("{schema}: {reason}")]
    InvalidSchema {
        /// Which schema of the request.
        schema: SchemaSource,
        /// What is wrong with it, fit for the client (the compiler's summary, no internals).
        reason: String,
    },
    /// The model file changed on disk since it was mapped ([`ServiceHealth::ModelFileChanged`](crate::ServiceHealth::ModelFileChanged)):
    /// nothing is generated from a mapping that no longer matches the file until the process is
    /// restarted. Its [`code`](Self::code) is [`ErrorCode::ShuttingDown`]: retry on another
    /// server.
    #[error(
        "the model file {} changed on disk after it was loaded: restart the server",
        path.display()
    )]
    ModelFileChanged {
        /// The file.
        path: std::path::PathBuf,
    },
}

impl ServiceError {
    /// The protocol error class of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Overloaded { .. } | Self::ShuttingDown => ErrorCode::Overloaded,
            Self::ModelFileChanged { .. } => ErrorCode::ShuttingDown,
            Self::ContextLength { .. } => ErrorCode::ContextLength,
            Self::InvalidRequest { .. } | Self::InvalidSchema { .. } => ErrorCode::InvalidRequest,
        }
    }
}

/// Error classes shared by the protocol, the gateway and the service.
///
/// Exhaustive on purpose: every transport maps each variant to its wire form, so a new one
/// must fail their builds until it is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The request is malformed or asks for something invalid.
    InvalidRequest,
    /// The prompt does not fit the context.
    ContextLength,
    /// The named model is not served here.
    NotFound,
    /// The server is at capacity; retry later or elsewhere.
    Overloaded,
    /// The request was cancelled.
    Cancelled,
    /// The request took too long.
    Timeout,
    /// A bug or failure inside the server.
    Internal,
    /// The server is shutting down (its drain deadline passed): retry on another server.
    ShuttingDown,
}

/// Which schema of a request a [`ServiceError::InvalidSchema`] is about (the gateway names the
/// request field it came from).
///
/// ```
/// use zerolayer_api::SchemaSource;
/// assert_eq!(SchemaSource::Tool(2).to_string(), "tools.2");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaSource {
    /// [`InferenceRequest::output_format`](crate::InferenceRequest::output_format).
    OutputFormat,
    /// The input schema of the tool at this index of [`Tools::tools`](crate::Tools::tools), whose call is forced.
    Tool(usize),
    /// The tools' schemas together (a call of any of them is forced): each one compiles alone,
    /// their union does not.
    Tools,
}

impl std::fmt::Display for SchemaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::OutputFormat => f.write_str("output_format"),
            Self::Tool(i) => write!(f, "tools.{i}"),
            Self::Tools => f.write_str("tools"),
        }
    }
}
