//! Response bodies of both API flavours: the Anthropic SSE event sequence and message JSON, and the
//! OpenAI chunk stream and completion JSON.

use bytes::Bytes;
use serde_json::{Value, json};

use super::error::ApiError;
use crate::service::{StopReason, Usage};

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
    OpenAi,
}

/// Formats one generation's stream.
#[derive(Debug, Clone)]
pub(crate) struct StreamFormat {
    pub(crate) flavor: Flavor,
    pub(crate) id: String,
    pub(crate) model: String,
    pub(crate) created: u64,
    pub(crate) include_usage: bool,
}

fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::EndTurn | StopReason::StopSequence => "stop",
        StopReason::MaxTokens => "length",
    }
}

impl StreamFormat {
    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": choices,
        })
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
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}
            ])))],
        }
    }

    /// One piece of generated text.
    pub(crate) fn delta(&self, text: &str) -> Bytes {
        match self.flavor {
            Flavor::Anthropic => {
                anthropic_event(&json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": text}}))
            }
            Flavor::OpenAi => openai_event(&self.chunk(json!([
                {"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null}
            ]))),
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
            Flavor::OpenAi => {
                let mut out = vec![openai_event(&self.chunk(json!([
                    {"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason(stop)}
                ])))];
                if self.include_usage {
                    let mut c = self.chunk(json!([]));
                    c["usage"] = openai_usage(usage);
                    out.push(openai_event(&c));
                }
                out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                out
            }
        }
    }

    /// The event reporting a failure after the response started.
    pub(crate) fn error(&self, err: &ApiError, request_id: &str) -> Bytes {
        match self.flavor {
            Flavor::Anthropic => anthropic_event(&err.anthropic_body(request_id)),
            Flavor::OpenAi => openai_event(&err.openai_body(request_id)),
        }
    }

    /// The complete (non-streaming) response body.
    pub(crate) fn full(
        &self,
        text: &str,
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
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": null, "finish_reason": finish_reason(stop)}],
                "usage": openai_usage(usage),
            }),
        }
    }
}

fn openai_usage(u: Usage) -> Value {
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
        }
    }

    #[test]
    fn every_anthropic_event_has_its_event_line() {
        let f = fmt(Flavor::Anthropic);
        let mut all = f.start(3);
        all.push(f.delta("hi"));
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
