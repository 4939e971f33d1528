//! Response bodies of both API flavours: the Anthropic SSE event sequence and message JSON, and the
//! OpenAI chunk stream and completion JSON.

use bytes::Bytes;
use serde_json::{Value, json};

use super::error::ApiError;
use crate::service::{StopReason, TokenLogprob, Usage};

/// One Anthropic SSE event: its `event:` line and its `data:` line.
pub(crate) fn anthropic_event(data: &Value) -> Bytes {
    let ty = data["type"].as_str().unwrap_or("message");
    Bytes::from(format!("event: {ty}\ndata: {data}\n\n"))
}

/// One OpenAI SSE chunk (`data:` only).
fn openai_event(data: &Value) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// Which API a generation answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    Anthropic,
    /// OpenAI Chat Completions.
    OpenAi,
    /// OpenAI legacy text completions (`/v1/completions`).
    Completions,
}

/// Formats one generation's stream.
#[derive(Debug, Clone)]
pub(crate) struct StreamFormat {
    pub(crate) flavor: Flavor,
    pub(crate) id: String,
    pub(crate) model: String,
    pub(crate) created: u64,
    pub(crate) include_usage: bool,
    /// Characters of completion text before the next delta (legacy completions'
    /// `text_offset`).
    pub(crate) text_offset: usize,
    /// The OpenAI choice index this format's chunks carry (`n` > 1).
    pub(crate) index: u32,
}

fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::EndTurn | StopReason::StopSequence => "stop",
        StopReason::MaxTokens => "length",
    }
}

/// A token's text as OpenAI shows it (bytes that are not UTF-8 alone, lossily).
fn token_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Chat Completions' `logprobs` object of some tokens.
fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|(_, b, lp)| json!({"token": token_text(b), "logprob": lp, "bytes": b}))
                .collect();
            json!({"token": token_text(&t.bytes), "logprob": t.logprob, "bytes": t.bytes,
                   "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

impl StreamFormat {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.flavor {
            Flavor::Completions => "text_completion",
            _ => "chat.completion.chunk",
        };
        json!({
            "id": self.id, "object": object, "created": self.created,
            "model": self.model, "choices": choices,
        })
    }

    /// `logprobs` of a choice: `null` without tokens, else in the flavour's shape (legacy
    /// completions: parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`
    /// lists; this advances [`text_offset`](Self::text_offset)).
    fn logprobs(&mut self, tokens: &[TokenLogprob]) -> Value {
        if tokens.is_empty() {
            return Value::Null;
        }
        match self.flavor {
            Flavor::Completions => {
                let mut offsets = Vec::with_capacity(tokens.len());
                for t in tokens {
                    offsets.push(self.text_offset);
                    self.text_offset += token_text(&t.bytes).chars().count();
                }
                let top: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let m: serde_json::Map<String, Value> = t
                            .top
                            .iter()
                            .map(|(_, b, lp)| (token_text(b), json!(lp)))
                            .collect();
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "tokens": tokens.iter().map(|t| token_text(&t.bytes)).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
            _ => chat_logprobs(tokens),
        }
    }

    /// The events sent before any text.
    pub(crate) fn start(&self, input_tokens: u32) -> Vec<Bytes> {
        match self.flavor {
            Flavor::Anthropic => vec![
                anthropic_event(&json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                }})),
                anthropic_event(&json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}})),
                anthropic_event(&json!({"type": "ping"})),
            ],
            Flavor::OpenAi => vec![openai_event(&self.chunk(json!([
                {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}
            ])))],
            Flavor::Completions => Vec::new(),
        }
    }

    /// One piece of generated text and the log-probabilities of its tokens (empty unless
    /// asked for).
    pub(crate) fn delta(&mut self, text: &str, logprobs: &[TokenLogprob]) -> Bytes {
        match self.flavor {
            Flavor::Anthropic => {
                anthropic_event(&json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": text}}))
            }
            Flavor::OpenAi => {
                let lp = self.logprobs(logprobs);
                openai_event(&self.chunk(json!([
                    {"index": self.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}
                ])))
            }
            Flavor::Completions => {
                let lp = self.logprobs(logprobs);
                openai_event(&self.chunk(json!([
                    {"index": self.index, "text": text, "logprobs": lp, "finish_reason": null}
                ])))
            }
        }
    }

    /// The events that end a successful generation.
    pub(crate) fn finish(
        &self,
        stop: StopReason,
        stop_sequence: Option<&str>,
        usage: Usage,
    ) -> Vec<Bytes> {
        match self.flavor {
            Flavor::Anthropic => vec![
                anthropic_event(&json!({"type": "content_block_stop", "index": 0})),
                anthropic_event(&json!({"type": "message_delta",
                    "delta": {"stop_reason": stop.as_str(), "stop_sequence": stop_sequence},
                    "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}})),
                anthropic_event(&json!({"type": "message_stop"})),
            ],
            Flavor::OpenAi | Flavor::Completions => {
                let mut out = vec![self.choice_end(stop)];
                out.extend(self.stream_end(usage));
                out
            }
        }
    }

    /// The last chunk of one choice (OpenAI flavours; `n` > 1 streams end with
    /// [`stream_end`](Self::stream_end) once all choices did).
    pub(crate) fn choice_end(&self, stop: StopReason) -> Bytes {
        let last = if self.flavor == Flavor::Completions {
            json!({"index": self.index, "text": "", "logprobs": null, "finish_reason": finish_reason(stop)})
        } else {
            json!({"index": self.index, "delta": {}, "logprobs": null, "finish_reason": finish_reason(stop)})
        };
        openai_event(&self.chunk(json!([last])))
    }

    /// The end of an OpenAI stream: the usage chunk (with `include_usage`), then `[DONE]`.
    pub(crate) fn stream_end(&self, usage: Usage) -> Vec<Bytes> {
        let mut out = Vec::with_capacity(2);
        if self.include_usage {
            let mut c = self.chunk(json!([]));
            c["usage"] = openai_usage(usage);
            out.push(openai_event(&c));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }

    /// The event reporting a failure after the response started.
    pub(crate) fn error(&self, err: &ApiError, request_id: &str) -> Bytes {
        match self.flavor {
            Flavor::Anthropic => anthropic_event(&err.anthropic_body(request_id)),
            Flavor::OpenAi | Flavor::Completions => openai_event(&err.openai_body(request_id)),
        }
    }

    /// The complete (non-streaming) response body.
    pub(crate) fn full(
        &mut self,
        text: &str,
        logprobs: &[TokenLogprob],
        stop: StopReason,
        stop_sequence: Option<&str>,
        usage: Usage,
    ) -> Value {
        match self.flavor {
            Flavor::Anthropic => json!({
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": stop.as_str(), "stop_sequence": stop_sequence,
                "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
            }),
            Flavor::OpenAi => json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "message": {"role": "assistant", "content": text},
                             "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason(stop)}],
                "usage": openai_usage(usage),
            }),
            Flavor::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "text": text,
                             "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason(stop)}],
                "usage": openai_usage(usage),
            }),
        }
    }
}

pub(crate) fn openai_usage(u: Usage) -> Value {
    json!({"prompt_tokens": u.input_tokens, "completion_tokens": u.output_tokens,
           "total_tokens": u.input_tokens + u.output_tokens})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fmt(flavor: Flavor) -> StreamFormat {
        StreamFormat {
            flavor,
            id: "x".into(),
            model: "m".into(),
            created: 1,
            include_usage: true,
            text_offset: 0,
            index: 0,
        }
    }

    #[test]
    fn every_anthropic_event_has_its_event_line() {
        let mut f = fmt(Flavor::Anthropic);
        let mut all = f.start(3);
        all.push(f.delta("hi", &[]));
        all.extend(f.finish(
            StopReason::EndTurn,
            None,
            Usage {
                input_tokens: 3,
                output_tokens: 1,
            },
        ));
        let names: Vec<String> = all
            .iter()
            .map(|b| {
                let s = std::str::from_utf8(b).unwrap();
                assert!(s.ends_with("\n\n"));
                let (ev, data) = s.trim_end().split_once('\n').unwrap();
                let ev = ev.strip_prefix("event: ").unwrap();
                let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(v["type"], ev);
                ev.to_owned()
            })
            .collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
    }

    #[test]
    fn openai_stream_ends_with_usage_then_done() {
        let f = fmt(Flavor::OpenAi);
        let end = f.finish(
            StopReason::MaxTokens,
            None,
            Usage {
                input_tokens: 2,
                output_tokens: 5,
            },
        );
        assert_eq!(end.len(), 3);
        assert!(
            std::str::from_utf8(&end[0])
                .unwrap()
                .contains("\"finish_reason\":\"length\"")
        );
        assert!(
            std::str::from_utf8(&end[1])
                .unwrap()
                .contains("\"total_tokens\":7")
        );
        assert_eq!(&end[2][..], b"data: [DONE]\n\n");
    }
}
