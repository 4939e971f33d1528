//! Events: what a running request sends back, in order.

use std::pin::Pin;

use futures::Stream;

use crate::ErrorCode;

/// One event of a running request, in order: `Started`, zero or more `Delta`, then exactly one of
/// `Finished` or `Error`.
///
/// Exhaustive on purpose: every transport maps each variant to its wire form, so a new one
/// must fail their builds until it is carried.
#[derive(Debug, Clone, PartialEq)]
pub enum InferenceEvent {
    /// The prompt was accepted and tokenized.
    Started {
        /// Prompt length in tokens.
        input_tokens: u32,
    },
    /// New output tokens and the complete UTF-8 text they finished.
    Delta {
        /// Token ids generated since the last delta.
        ids: Vec<u32>,
        /// Text made complete by these tokens (may be empty when a character is split).
        text: String,
    },
    /// A tool call the model made, complete (only for requests with
    /// [`InferenceRequest::tools`](crate::InferenceRequest::tools)). The text of the call is not sent as a `Delta` (its tokens
    /// are: in `Delta`s with empty text). The gateway gives each call its id.
    ToolCall {
        /// The tool's name.
        name: String,
        /// The arguments as JSON text (an object).
        arguments: String,
    },
    /// The log-probabilities of the tokens of the next `Delta`, in order (only when the
    /// request asked for them: [`InferenceRequest::logprobs`](crate::InferenceRequest::logprobs)).
    Logprobs(Vec<TokenLogprob>),
    /// The generation ended.
    Finished {
        /// Why.
        stop_reason: StopReason,
        /// The stop sequence that matched, if any.
        stop_sequence: Option<String>,
        /// Token counts.
        usage: Usage,
    },
    /// The generation failed.
    Error {
        /// Error class.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

/// The events of one request. Dropping it cancels the request.
pub type EventStream = Pin<Box<dyn Stream<Item = InferenceEvent> + Send + 'static>>;

/// Why a generation ended (the Anthropic API's values). The engine ends a generation with one
/// of the first three; a service that finds tool calls in the output reports `ToolUse` instead
/// of `EndTurn`.
///
/// ```
/// use zerolayer_api::StopReason;
/// assert_eq!(StopReason::StopSequence.as_str(), "stop_sequence");
/// assert_eq!(StopReason::ToolUse.to_string(), "tool_use");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The model emitted an end-of-turn / EOS token.
    EndTurn,
    /// `max_tokens` was reached.
    MaxTokens,
    /// A stop sequence matched.
    StopSequence,
    /// The model called a tool (its calls were sent as [`InferenceEvent::ToolCall`]s).
    ToolUse,
}

impl StopReason {
    /// The wire string (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EndTurn => "end_turn",
            Self::MaxTokens => "max_tokens",
            Self::StopSequence => "stop_sequence",
            Self::ToolUse => "tool_use",
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
}

/// One generated token's log-probability (natural log, under the model's distribution before
/// penalties and temperature) and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's id.
    pub id: u32,
    /// Its bytes as the tokenizer decodes them (may be part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens at this position: (id, bytes, log-probability), most likely
    /// first.
    pub top: Vec<(u32, Vec<u8>, f32)>,
}
