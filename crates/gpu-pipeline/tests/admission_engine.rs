//! KV admission on the real default model (run `scripts/fetch-model` first): one client's
//! requests with huge `max_tokens` do not keep another client out, and a sequence preempted
//! for lack of KV resumes with exactly the greedy output of an uninterrupted run.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest};
use gpu_pipeline::zerolayer_api::InferenceEvent;
use gpu_pipeline::{Model, ModelOptions, RequestHandle, StopReason};
use token_stream::Tokenizer;

struct Fixture {
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the model file is not modified while the tests run.
        let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }.expect("open model"));
        let tok = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
        let model = Arc::new(Model::load(gguf, ModelOptions::default()).expect("load model"));
        Fixture { model, tok }
    })
}

/// Bytes of `tokens` KV positions of the default model in f16.
fn kv_bytes(tokens: usize) -> usize {
    tokens
        * fixture()
            .model
            .kv_shape(kv_ring::KvDtype::F16)
            .bytes_per_token()
}

fn engine(cfg: EngineConfig) -> Engine {
    let f = fixture();
    Engine::new(f.model.clone(), Some(f.tok.clone()), cfg).expect("engine")
}

fn prompt(text: &str) -> Vec<u32> {
    fixture().tok.encode(text).to_vec()
}

/// A greedy request that never stops early (no stop tokens): it runs to `max_new_tokens`.
fn endless(text: &str, max_new_tokens: usize, client: &str) -> GenerationRequest {
    GenerationRequest::new(prompt(text), max_new_tokens)
        .with_stop_tokens(Vec::new())
        .with_client(Some(client.to_string()))
}

#[derive(Debug)]
enum Seen {
    Started,
    Token(u32),
    Finished(StopReason, usize),
    Error(String),
}

/// The next event (a `Delta` carries one token; a last one of held-back text, none).
fn next(h: &RequestHandle, within: Duration) -> Option<Seen> {
    loop {
        return Some(match h.recv_timeout(within)? {
            InferenceEvent::Started { .. } => Seen::Started,
            InferenceEvent::Delta { ids, .. } => match ids[..] {
                [] => continue,
                [id] => Seen::Token(id),
                _ => panic!("a Delta of several tokens: {ids:?}"),
            },
            InferenceEvent::Finished {
                stop_reason, usage, ..
            } => Seen::Finished(stop_reason, usage.input_tokens as usize),
            InferenceEvent::Error { message, .. } => Seen::Error(message),
            other => panic!("unexpected event {other:?}"),
        });
    }
}

/// All generated ids of a request; asserts one `Started` and one `Finished`.
fn collect(h: &RequestHandle) -> (Vec<u32>, StopReason, usize) {
    let mut started = 0;
    let mut ids = Vec::new();
    loop {
        match next(h, Duration::from_secs(600)).expect("stream ended") {
            Seen::Started => started += 1,
            Seen::Token(id) => ids.push(id),
            Seen::Finished(r, input) => {
                assert_eq!(started, 1, "exactly one Started event");
                return (ids, r, input);
            }
            Seen::Error(e) => panic!("request failed: {e}"),
        }
    }
}

/// Finding "KV admission can be hoarded": five streams of one client asking for thousands of
/// tokens reserved the whole pool at admission, and another client's request waited until
/// one of them finished. With KV reserved by use, the other client's request is admitted and
/// finishes while all five are still generating.
#[test]
fn five_huge_requests_of_one_client_do_not_block_another_client() {
    let x_max = 2000;
    let text = "Write a very long story about a lighthouse keeper.";
    let x_prompt = prompt(text).len();
    // The pool holds the five requests' full promise and not one token more.
    let cfg = EngineConfig::default()
        .with_kv_budget_bytes(kv_bytes(5 * (x_prompt + x_max) + 8))
        .with_kv_grow_chunk(64)
        .with_prefix_cache_entries(0);
    let e = engine(cfg);
    let xs: Vec<RequestHandle> = (0..5)
        .map(|_| e.submit(endless(text, x_max, "x")).expect("x accepted"))
        .collect();
    // All five are admitted and generating.
    for x in &xs {
        assert!(matches!(
            next(x, Duration::from_secs(120)),
            Some(Seen::Started)
        ));
        assert!(matches!(
            next(x, Duration::from_secs(120)),
            Some(Seen::Token(_))
        ));
    }
    let y = e.submit(endless("Say hello.", 8, "y")).expect("y accepted");
    // Bounded wait: before, Y waited for one of X's 2000-token generations to finish.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut y_tokens = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match next(&y, left).expect("y did not finish within 120 s") {
            Seen::Started => {}
            Seen::Token(_) => y_tokens += 1,
            Seen::Finished(stop, _) => {
                assert_eq!((y_tokens, stop), (8, StopReason::MaxTokens));
                break;
            }
            Seen::Error(e) => panic!("y failed: {e}"),
        }
    }
    // None of X finished (each has ~2000 tokens to go) and none failed.
    for x in &xs {
        while let Some(ev) = next(x, Duration::ZERO) {
            assert!(matches!(ev, Seen::Token(_)), "x ended before y: {ev:?}");
        }
    }
    let m = e.metrics();
    assert_eq!(m.running, 5, "all of X still running");
    assert!(m.kv_bytes_used < kv_bytes(5 * (x_prompt + x_max)) / 2);
    drop(xs);
}

/// A sequence preempted for lack of KV (recompute: its KV is freed and its prompt + generated
/// tokens are prefilled again on readmission) produces exactly the tokens of an uninterrupted
/// greedy run, with one `Started`, and its usage counts its own prompt.
#[test]
fn a_preempted_sequence_resumes_with_identical_greedy_output() {
    let texts = [
        "The history of the printing press begins",
        "A recipe for bread: first, take",
    ];
    let n = 60;
    let solo: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| {
            let e = engine(EngineConfig::default().with_prefix_cache_entries(0));
            collect(&e.submit(endless(t, n, "a")).unwrap()).0
        })
        .collect();
    let longest = texts.iter().map(|t| prompt(t).len()).max().unwrap();
    // Room for one sequence to finish and a bit, not for both to grow to the end.
    let cfg = EngineConfig::default()
        .with_kv_budget_bytes(kv_bytes(longest + n + 40))
        .with_kv_grow_chunk(16)
        .with_prefix_cache_entries(0);
    let e = engine(cfg);
    // One at a time: the queue bounds waiting requests' promised KV (prompt + max_tokens) by
    // the pool, which holds less than both promises.
    let handles: Vec<RequestHandle> = texts
        .iter()
        .map(|t| {
            let h = e.submit(endless(t, n, "a")).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while e.metrics().queue_depth > 0 {
                assert!(Instant::now() < deadline, "not admitted within 10 s");
                std::thread::sleep(Duration::from_millis(1));
            }
            h
        })
        .collect();
    for ((h, want), t) in handles.iter().zip(&solo).zip(texts) {
        let (ids, stop, input) = collect(h);
        assert_eq!(stop, StopReason::MaxTokens);
        assert_eq!(input, prompt(t).len(), "usage counts the original prompt");
        assert_eq!(&ids, want, "output differs from the uninterrupted run");
    }
    assert!(e.metrics().preempted >= 1, "the pool forced a preemption");
    assert_eq!(e.kv_pool().used_bytes(), 0);
}

/// Per-client limit: past `max_running_per_client` requests in flight, a client is refused at
/// once as overloaded; another client is not.
#[test]
fn a_client_past_its_limit_is_refused_as_overloaded() {
    let e = engine(EngineConfig::default().with_max_running_per_client(2));
    let a1 = e.submit(endless("One.", 500, "a")).unwrap();
    let _a2 = e.submit(endless("Two.", 500, "a")).unwrap();
    let err = e.submit(endless("Three.", 500, "a")).unwrap_err();
    assert!(
        matches!(
            err,
            gpu_pipeline::engine::SubmitError::Overloaded(
                gpu_pipeline::engine::Refusal::ClientLimit {
                    in_flight: 2,
                    limit: 2
                }
            )
        ),
        "{err:?}"
    );
    let _b = e.submit(endless("Four.", 4, "b")).unwrap();
    // Anonymous requests are one client of their own.
    let _n = e
        .submit(GenerationRequest::new(prompt("Five."), 4))
        .unwrap();
    drop(a1);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match e.submit(endless("Six.", 4, "a")) {
            Ok(_) => break,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Err(err) => panic!("a cancelled request still counts against the limit: {err}"),
        }
    }
}
