//! OpenAI `n` > 1: several independent generations of one prompt answered as the choices of
//! one response (each choice is a request of its own to the service, with the seed of choice
//! `i` being `seed + i` when a seed is given).

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{HeaderMap, StatusCode};
use serde_json::Value;

use super::core::{Generation, Reply, ReplyBody, Step, collect_choice, error_reply};
use super::sse::{StreamFormat, openai_usage};
use zerolayer_api::Usage;

/// Usage over all choices: the prompt once, the generated tokens of every choice.
fn add_usage(total: &mut Usage, choice: Usage) {
    total.input_tokens = choice.input_tokens;
    total.output_tokens += choice.output_tokens;
}

/// Runs every choice to its end and answers with one body listing them (or the first error).
pub(super) async fn collect(gens: Vec<Generation>, fmt: StreamFormat, request_id: &str) -> Reply {
    let runs = gens.into_iter().enumerate().map(|(i, mut g)| {
        let mut fmt = fmt.clone();
        fmt.index = i as u32;
        async move { collect_choice(&mut g, &mut fmt).await }
    });
    let bodies = match futures::future::join_all(runs)
        .await
        .into_iter()
        .collect::<Result<Vec<Value>, _>>()
    {
        Ok(b) => b,
        Err(e) => return error_reply(&e, fmt.flavor, request_id),
    };
    let mut total = Usage::default();
    let mut choices = Vec::with_capacity(bodies.len());
    for b in &bodies {
        choices.push(b["choices"][0].clone());
        add_usage(
            &mut total,
            Usage {
                input_tokens: b["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as u32,
                output_tokens: b["usage"]["completion_tokens"].as_u64().unwrap_or(0) as u32,
            },
        );
    }
    let mut body = bodies.into_iter().next().unwrap_or_default();
    body["choices"] = Value::Array(choices);
    body["usage"] = openai_usage(total);
    Reply::json(StatusCode::OK, &body)
}

/// The chunks of one choice: its first chunk, its deltas and its last chunk (no `[DONE]`);
/// its usage is added to `total` when it finishes.
fn choice_chunks(
    g: Generation,
    fmt: StreamFormat,
    request_id: String,
    total: Arc<Mutex<Usage>>,
) -> impl Stream<Item = Bytes> + Send {
    let mut fmt = fmt;
    let start = futures::stream::iter(fmt.start(g.input_tokens));
    let rest = futures::stream::unfold(Some((g, fmt)), move |state| {
        let (total, request_id) = (total.clone(), request_id.clone());
        async move {
            let (mut g, mut fmt) = state?;
            match g.step().await {
                Some(Step::Text(t, lp)) => {
                    let chunk = fmt.delta(&t, &lp);
                    Some((chunk, Some((g, fmt))))
                }
                Some(Step::ToolCall(c)) => {
                    let chunk = fmt.tool_call(&c);
                    Some((chunk, Some((g, fmt))))
                }
                Some(Step::Finished { stop, usage, .. }) => {
                    add_usage(
                        &mut total.lock().unwrap_or_else(PoisonError::into_inner),
                        usage,
                    );
                    Some((fmt.choice_end(stop), None))
                }
                Some(Step::Failed(e)) => Some((fmt.error(&e, &request_id), None)),
                None => None,
            }
        }
    });
    start.chain(rest)
}

/// Streams every choice's chunks as they come (each chunk names its choice by `index`), then
/// the usage chunk (with `include_usage`) and `[DONE]` once all have ended.
pub(super) fn stream(gens: Vec<Generation>, fmt: StreamFormat, request_id: &str) -> Reply {
    let total = Arc::new(Mutex::new(Usage::default()));
    let choices: Vec<_> = gens
        .into_iter()
        .enumerate()
        .map(|(i, g)| {
            let mut fmt = fmt.clone();
            fmt.index = i as u32;
            choice_chunks(g, fmt, request_id.to_owned(), total.clone()).boxed()
        })
        .collect();
    let end = futures::stream::once(async move {
        let usage = *total.lock().unwrap_or_else(PoisonError::into_inner);
        futures::stream::iter(fmt.stream_end(usage))
    })
    .flatten();
    let body = futures::stream::select_all(choices).chain(end);
    let mut headers = HeaderMap::new();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Reply {
        status: StatusCode::OK,
        headers,
        body: ReplyBody::Stream(Box::pin(body)),
    }
}
