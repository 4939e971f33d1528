//! Response bodies of both API flavours: the Anthropic SSE event sequence and message JSON, and the
//! OpenAI chunk stream and completion JSON.

use bytes::Bytes;
use serde_json::{Value, json};

use super::error::ApiError;
use super::ids::new_id;
use zerolayer_api::{StopReason, TokenLogprob, Usage};

/// A tool call the model made, with the id the response gives it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Call {
    pub(crate) id: String,
    pub(crate) name: String,
    /// The arguments as JSON text.
    pub(crate) arguments: String,
}

impl Call {
    /// A call with a fresh id in the flavour's style (`toolu_…`, `call_…`).
    pub(crate) fn new(flavor: Flavor, name: String, arguments: String) -> Self {
        let prefix = if flavor == Flavor::Anthropic {
            "toolu_"
        } else {
            "call_"
        };
        Self {
            id: new_id(prefix),
            name,
            arguments,
        }
    }

    /// The arguments as a JSON value (Anthropic's `input`).
    fn input(&self) -> Value {
        serde_json::from_str(&self.arguments).unwrap_or_else(|_| json!({}))
    }
}

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
    /// Anthropic: the index of the current content block.
    pub(crate) block: u32,
    /// Anthropic: whether the current block is an open text block.
    pub(crate) text_open: bool,
    /// Tool calls streamed so far (OpenAI's `tool_calls[].index`).
    pub(crate) calls: u32,
}

impl StreamFormat {
    /// A format for one generation's response.
    pub(crate) fn new(flavor: Flavor, id: String, model: String, created: u64) -> Self {
        Self {
            flavor,
            id,
            model,
            created,
            include_usage: false,
            text_offset: 0,
            index: 0,
            block: 0,
            text_open: false,
            calls: 0,
        }
    }
}

fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::EndTurn | StopReason::StopSequence => "stop",
        StopReason::MaxTokens => "length",
        StopReason::ToolUse => "tool_calls",
    }
}

/// Events joined into one body chunk.
fn join(events: Vec<Bytes>) -> Bytes {
    match <[Bytes; 1]>::try_from(events) {
        Ok([one]) => one,
        Err(many) => Bytes::from(many.concat()),
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
    pub(crate) fn start(&mut self, input_tokens: u32) -> Vec<Bytes> {
        self.text_open = self.flavor == Flavor::Anthropic;
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
                let mut events = Vec::with_capacity(2);
                if !self.text_open {
                    // Text after a tool call opens a new text block.
                    self.block += 1;
                    self.text_open = true;
                    events.push(anthropic_event(&json!({"type": "content_block_start",
                        "index": self.block, "content_block": {"type": "text", "text": ""}})));
                }
                events.push(anthropic_event(&json!({"type": "content_block_delta",
                    "index": self.block, "delta": {"type": "text_delta", "text": text}})));
                join(events)
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

    /// One tool call: Anthropic closes an open text block and sends the call as a `tool_use`
    /// block (its input in one `input_json_delta`); OpenAI sends a `tool_calls` delta.
    pub(crate) fn tool_call(&mut self, call: &Call) -> Bytes {
        match self.flavor {
            Flavor::Anthropic => {
                let mut events = Vec::with_capacity(4);
                if self.text_open {
                    events.push(anthropic_event(
                        &json!({"type": "content_block_stop", "index": self.block}),
                    ));
                    self.text_open = false;
                }
                self.block += 1;
                let i = self.block;
                events.push(anthropic_event(&json!({"type": "content_block_start", "index": i,
                    "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}})));
                events.push(anthropic_event(
                    &json!({"type": "content_block_delta", "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
                ));
                events.push(anthropic_event(
                    &json!({"type": "content_block_stop", "index": i}),
                ));
                self.calls += 1;
                join(events)
            }
            Flavor::OpenAi | Flavor::Completions => {
                let call = json!([{"index": self.calls, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]);
                self.calls += 1;
                openai_event(&self.chunk(json!([
                    {"index": self.index, "delta": {"tool_calls": call}, "logprobs": null, "finish_reason": null}
                ])))
            }
        }
    }

    /// The events that end a successful generation.
    pub(crate) fn finish(
        &mut self,
        stop: StopReason,
        stop_sequence: Option<&str>,
        usage: Usage,
    ) -> Vec<Bytes> {
        match self.flavor {
            Flavor::Anthropic => {
                let mut out = Vec::with_capacity(3);
                if self.text_open {
                    out.push(anthropic_event(
                        &json!({"type": "content_block_stop", "index": self.block}),
                    ));
                    self.text_open = false;
                }
                out.push(anthropic_event(&json!({"type": "message_delta",
                    "delta": {"stop_reason": stop.as_str(), "stop_sequence": stop_sequence},
                    "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}})));
                out.push(anthropic_event(&json!({"type": "message_stop"})));
                out
            }
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
        calls: &[Call],
        logprobs: &[TokenLogprob],
        stop: StopReason,
        stop_sequence: Option<&str>,
        usage: Usage,
    ) -> Value {
        match self.flavor {
            Flavor::Anthropic => {
                let mut content = Vec::with_capacity(1 + calls.len());
                if !text.is_empty() || calls.is_empty() {
                    content.push(json!({"type": "text", "text": text}));
                }
                content.extend(calls.iter().map(
                    |c| json!({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input()}),
                ));
                json!({
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": content,
                    "stop_reason": stop.as_str(), "stop_sequence": stop_sequence,
                    "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
                })
            }
            Flavor::OpenAi => {
                let mut message = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    if text.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = calls
                        .iter()
                        .map(|c| {
                            json!({"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}})
                        })
                        .collect();
                }
                json!({
                    "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": [{"index": self.index, "message": message,
                                 "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason(stop)}],
                    "usage": openai_usage(usage),
                })
            }
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
        let mut f = StreamFormat::new(flavor, "x".into(), "m".into(), 1);
        f.include_usage = true;
        f
    }

    /// The `data:` JSON of every event in a body chunk.
    fn events(chunks: &[Bytes]) -> Vec<Value> {
        chunks
            .iter()
            .flat_map(|b| {
                std::str::from_utf8(b)
                    .unwrap()
                    .split("\n\n")
                    .filter(|e| !e.is_empty())
                    .map(|e| {
                        let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
                        serde_json::from_str(data).unwrap()
                    })
                    .collect::<Vec<Value>>()
            })
            .collect()
    }

    #[test]
    fn anthropic_tool_calls_get_blocks_of_their_own() {
        let mut f = fmt(Flavor::Anthropic);
        let mut all = f.start(3);
        all.push(f.delta("Checking.", &[]));
        let call = Call::new(Flavor::Anthropic, "w".into(), "{\"c\":\"Oslo\"}".into());
        all.push(f.tool_call(&call));
        all.push(f.delta(" Done.", &[]));
        all.extend(f.finish(StopReason::ToolUse, None, Usage::default()));
        let evs = events(&all);
        let shape: Vec<(String, Option<u64>)> = evs
            .iter()
            .map(|e| (e["type"].as_str().unwrap().to_owned(), e["index"].as_u64()))
            .collect();
        let want: Vec<(String, Option<u64>)> = [
            ("message_start", None),
            ("content_block_start", Some(0)),
            ("ping", None),
            ("content_block_delta", Some(0)),
            ("content_block_stop", Some(0)),
            ("content_block_start", Some(1)),
            ("content_block_delta", Some(1)),
            ("content_block_stop", Some(1)),
            ("content_block_start", Some(2)),
            ("content_block_delta", Some(2)),
            ("content_block_stop", Some(2)),
            ("message_delta", None),
            ("message_stop", None),
        ]
        .iter()
        .map(|(t, i)| ((*t).to_owned(), *i))
        .collect();
        assert_eq!(shape, want);
        assert!(call.id.starts_with("toolu_"));
        assert_eq!(evs[5]["content_block"]["name"], "w");
        assert_eq!(evs[6]["delta"]["partial_json"], "{\"c\":\"Oslo\"}");
        assert_eq!(evs[11]["delta"]["stop_reason"], "tool_use");
    }

    #[test]
    fn full_bodies_carry_the_calls() {
        let call = Call::new(Flavor::OpenAi, "f".into(), "{\"x\":1}".into());
        let mut f = fmt(Flavor::OpenAi);
        let body = f.full(
            "",
            std::slice::from_ref(&call),
            &[],
            StopReason::ToolUse,
            None,
            Usage::default(),
        );
        let m = &body["choices"][0]["message"];
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{\"x\":1}");
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
        let mut f = fmt(Flavor::Anthropic);
        let body = f.full(
            "",
            &[call],
            &[],
            StopReason::ToolUse,
            None,
            Usage::default(),
        );
        assert_eq!(body["content"].as_array().unwrap().len(), 1);
        assert_eq!(body["content"][0]["input"]["x"], 1);
        assert_eq!(body["stop_reason"], "tool_use");
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
        let mut f = fmt(Flavor::OpenAi);
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
