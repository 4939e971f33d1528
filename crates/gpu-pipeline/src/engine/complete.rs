//! One request run to its end from a thread: what the CLI's `generate` and `bench`, the
//! examples and the benches use, so that every generation goes through the engine's loop.

use std::time::{Duration, Instant};

use zerolayer_api::{ErrorCode, InferenceEvent, StopReason};

use super::{RequestHandle, SubmitError};

/// A finished request ([`Engine::generate`](super::Engine::generate),
/// [`RequestHandle::wait`]).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated token ids (at most `max_new_tokens`; without a final stop token).
    pub ids: Vec<u32>,
    /// The generated text, cut before a matched stop sequence (empty when the engine has no
    /// tokenizer).
    pub text: String,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// The stop sequence that matched.
    pub stop_sequence: Option<String>,
    /// From the submission to the first generated token (queueing, prefill, the first
    /// sampling); the whole request's time when it generated nothing.
    pub time_to_first_token: Duration,
    /// From the first generated token to the end.
    pub decode_time: Duration,
}

impl Completion {
    /// Decode speed: tokens after the first per second of [`decode_time`](Self::decode_time)
    /// (`None` with fewer than two tokens).
    pub fn decode_tokens_per_second(&self) -> Option<f64> {
        let secs = self.decode_time.as_secs_f64();
        (self.ids.len() >= 2 && secs > 0.0).then(|| (self.ids.len() - 1) as f64 / secs)
    }
}

/// Why a request run to its end failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The engine refused the request.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The request failed while running (an [`EngineError`](super::EngineError), as its
    /// last event told it).
    #[error("generation failed ({code:?}): {message}")]
    Failed {
        /// The error class.
        code: ErrorCode,
        /// What went wrong.
        message: String,
    },
}

impl RequestHandle {
    /// Receives every event of the request until it ends, calling `on_text` with the text as
    /// it becomes final (whole characters, never a stop sequence or what may begin one: the
    /// [`InferenceEvent::Delta`]s' text), and returns the whole generation. Times count from
    /// the submission.
    pub fn wait(self, on_text: &mut dyn FnMut(&str)) -> Result<Completion, GenerateError> {
        let mut done = Completion {
            prompt_tokens: 0,
            ids: Vec::new(),
            text: String::new(),
            stop_reason: StopReason::MaxTokens,
            stop_sequence: None,
            time_to_first_token: Duration::ZERO,
            decode_time: Duration::ZERO,
        };
        let mut first: Option<Instant> = None;
        loop {
            match self.recv() {
                Some(InferenceEvent::Started { input_tokens }) => {
                    done.prompt_tokens = input_tokens as usize;
                }
                Some(InferenceEvent::Delta { ids, text }) => {
                    if !ids.is_empty() {
                        first.get_or_insert_with(Instant::now);
                        done.ids.extend_from_slice(&ids);
                    }
                    if !text.is_empty() {
                        on_text(&text);
                        done.text += &text;
                    }
                }
                Some(InferenceEvent::Finished {
                    stop_reason,
                    stop_sequence,
                    ..
                }) => {
                    let end = Instant::now();
                    done.stop_reason = stop_reason;
                    done.stop_sequence = stop_sequence;
                    let first = first.unwrap_or(end);
                    done.time_to_first_token = first - self.submitted;
                    done.decode_time = end - first;
                    return Ok(done);
                }
                Some(InferenceEvent::Error { code, message }) => {
                    return Err(GenerateError::Failed { code, message });
                }
                Some(_) => {}
                None => {
                    return Err(GenerateError::Failed {
                        code: ErrorCode::Internal,
                        message: "the engine ended the stream".into(),
                    });
                }
            }
        }
    }
}
