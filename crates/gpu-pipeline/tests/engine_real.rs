//! Engine tests on the real default model (run `scripts/fetch-model` first): batch invariance,
//! cancellation, overload, prefix reuse and 200 concurrent streams.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pipeline::StopReason;
use gpu_pipeline::engine::{Engine, EngineConfig, GenerationRequest, SubmitError};
use gpu_pipeline::zerolayer_api::InferenceEvent;
use token_stream::TemplateMessage;
use zerolayer_api::Usage;

mod common;
use common::fixture;

fn chat(system: &str, user: &str) -> Vec<u32> {
    let f = fixture();
    let msgs = [
        TemplateMessage::new("system", system),
        TemplateMessage::new("user", user),
    ];
    f.chat.encode(&f.tok, &msgs, true).expect("encode").to_vec()
}

fn engine(cfg: EngineConfig) -> Engine {
    let f = fixture();
    Engine::new(f.model.clone(), Some(f.tok.clone()), cfg).expect("engine")
}

struct Outcome {
    ids: Vec<u32>,
    text: String,
    cached: usize,
    stop: StopReason,
    usage: Usage,
}

fn collect(h: &gpu_pipeline::RequestHandle) -> Outcome {
    let mut out = Outcome {
        ids: vec![],
        text: String::new(),
        cached: 0,
        stop: StopReason::MaxTokens,
        usage: Usage::default(),
    };
    let mut started = false;
    while let Some(ev) = h.recv_timeout(Duration::from_secs(600)) {
        match ev {
            InferenceEvent::Started { .. } => {
                assert!(!started);
                started = true;
            }
            InferenceEvent::Delta { ids, text } => {
                assert!(started, "token before Started");
                out.ids.extend(ids);
                out.text += &text;
            }
            InferenceEvent::Finished {
                stop_reason, usage, ..
            } => {
                out.stop = stop_reason;
                out.usage = usage;
                return out;
            }
            InferenceEvent::Error { message, .. } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    panic!("stream ended without Finished");
}

/// Runs `req` on `e` with nothing else running: [`collect`], with the prompt tokens it reused
/// from the prefix cache (the engine's counter before and after).
fn run_alone(e: &Engine, req: GenerationRequest) -> Outcome {
    let before = e.metrics().prefix_hit_tokens;
    let mut out = collect(&e.submit(req).unwrap());
    out.cached = (e.metrics().prefix_hit_tokens - before) as usize;
    out
}

const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Name a prime number.",
    "Say hello.",
    "What colour is the sky?",
    "Count to three.",
    "What is 2+2?",
    "Name a fruit.",
    "What is water made of?",
];

#[test]
fn greedy_output_is_batch_invariant_and_matches_a_plain_forward_loop() {
    let f = fixture();
    let prompt = chat(
        "You are a helpful assistant.",
        "What is the capital of France?",
    );
    let n = 6;
    // Reference: the forward pass alone, one sequence, the argmax after each step.
    let mut kv = kv_ring::KvPool::new(f.model.kv_shape(kv_ring::KvDtype::F16), 64 << 20)
        .unwrap()
        .alloc(prompt.len() + n, kv_ring::RingMode::Strict)
        .unwrap();
    let (mut logits, mut ids, mut step) = (Vec::new(), Vec::new(), prompt.clone());
    while ids.len() < n {
        f.model
            .forward(
                &mut [gpu_pipeline::SeqStep {
                    tokens: &step,
                    kv: &mut kv,
                    logits: gpu_pipeline::LogitsWanted::Last,
                }],
                &mut logits,
            )
            .unwrap();
        let top = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        ids.push(top as u32);
        step = vec![top as u32];
    }

    let cfg = EngineConfig::default()
        .with_prefix_cache_entries(0)
        .with_prefill_chunk(16);
    let e = engine(cfg.clone());
    let alone = collect(&e.submit(GenerationRequest::new(prompt.clone(), n)).unwrap());
    assert_eq!(
        alone.ids, ids,
        "engine alone differs from the plain forward loop"
    );

    // The same request in the middle of 100 others with different prompts and lengths.
    let e = engine(cfg);
    let mut others = Vec::new();
    for i in 0..50 {
        let p = chat(
            "You are a helpful assistant.",
            QUESTIONS[i % QUESTIONS.len()],
        );
        others.push(e.submit(GenerationRequest::new(p, 2 + i % 5)).unwrap());
    }
    let target = e.submit(GenerationRequest::new(prompt, n)).unwrap();
    for i in 0..50 {
        let p = chat("Answer briefly.", QUESTIONS[(i + 3) % QUESTIONS.len()]);
        others.push(e.submit(GenerationRequest::new(p, 3 + i % 4)).unwrap());
    }
    let batched = collect(&target);
    for h in &others {
        collect(h);
    }
    assert_eq!(
        batched.ids, alone.ids,
        "output changed inside a batch of 100"
    );
    assert_eq!(batched.text, alone.text);
    let m = e.metrics();
    assert!(
        m.batch_size_hist.quantile_upper_bound(1.0) > Some(31.0),
        "no step had 32+ sequences: {:?}",
        m.batch_size_hist
    );
    assert_eq!(m.finished, 101);
}

#[test]
fn cancel_and_drop_free_the_kv_ring() {
    let e = engine(EngineConfig::default().with_prefix_cache_entries(0));
    let pool = e.kv_pool().clone();
    let h = e
        .submit(GenerationRequest::new(
            chat("Be verbose.", "Tell me a long story."),
            500,
        ))
        .unwrap();
    // Wait until it is generating.
    loop {
        match h.recv_timeout(Duration::from_secs(120)).expect("events") {
            InferenceEvent::Delta { .. } => break,
            InferenceEvent::Started { .. } => assert!(pool.used_bytes() > 0),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(pool.used_bytes() > 0);
    drop(h);
    wait_for(|| pool.used_bytes() == 0, "KV freed after drop");
    assert_eq!(e.metrics().cancelled, 1);

    // Explicit cancel of a running request: the stream ends without Finished.
    let h = e
        .submit(GenerationRequest::new(
            chat("Be verbose.", "Tell me a story."),
            500,
        ))
        .unwrap();
    assert!(matches!(
        h.recv_timeout(Duration::from_secs(120)),
        Some(InferenceEvent::Started { .. })
    ));
    h.cancel();
    wait_for(|| pool.used_bytes() == 0, "KV freed after cancel");
    wait_for(|| e.metrics().running == 0, "sequence removed");
}

fn wait_for(mut f: impl FnMut() -> bool, what: &str) {
    // A liveness bound, not a timing assertion: the ring is freed at the next step boundary.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn overload_is_refused_at_once_and_queued_requests_cancel_cleanly() {
    let e = engine(
        EngineConfig::default()
            .with_max_queue(3)
            .with_max_running(1)
            .with_prefix_cache_entries(0),
    );
    let p = chat("Be verbose.", "Tell me a long story.");
    let running = e.submit(GenerationRequest::new(p.clone(), 400)).unwrap();
    // Wait until it is admitted so the queue is empty.
    assert!(matches!(
        running.recv_timeout(Duration::from_secs(120)),
        Some(InferenceEvent::Started { .. })
    ));
    let queued: Vec<_> = (0..3)
        .map(|_| e.submit(GenerationRequest::new(p.clone(), 4)).unwrap())
        .collect();
    let t = Instant::now();
    let refused = e.submit(GenerationRequest::new(p.clone(), 4));
    assert!(
        matches!(refused, Err(SubmitError::Overloaded(_))),
        "{refused:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "submit blocked");
    let m = e.metrics();
    assert_eq!((m.queue_depth, m.running, m.refused), (3, 1, 1));
    // Too large for the pool is a different, permanent error.
    let small = engine(EngineConfig::default().with_kv_budget_bytes(1 << 20));
    assert!(matches!(
        small.submit(GenerationRequest::new(p.clone(), 400)),
        Err(SubmitError::TooLarge(_))
    ));
    // Context length and bad ids are refused too.
    assert!(matches!(
        e.submit(GenerationRequest::new(p.clone(), 1 << 20)),
        Err(SubmitError::ContextLength { .. })
    ));
    assert!(matches!(
        e.submit(GenerationRequest::new(vec![1 << 30], 1)),
        Err(SubmitError::TokenOutOfRange { .. })
    ));
    // Cancelling queued requests frees their queue slots at once.
    drop(queued);
    assert_eq!(e.metrics().queue_depth, 0);
    let again = e.submit(GenerationRequest::new(p, 2)).unwrap();
    drop(running);
    let out = collect(&again);
    assert_eq!(out.ids.len(), out.usage.output_tokens as usize);
}

#[test]
fn shared_system_prompt_reuses_kv_with_identical_output() {
    let system = "You are a concise assistant who answers questions about geography, science and \
                  everyday life in one short sentence.";
    let a = chat(system, "What is the capital of France?");
    let b = chat(system, "Name a fruit.");
    let e = engine(EngineConfig::default().with_prefill_chunk(16));
    let first = run_alone(&e, GenerationRequest::new(a, 4));
    assert_eq!(first.cached, 0);
    let second = run_alone(&e, GenerationRequest::new(b.clone(), 6));
    assert!(second.cached >= 20, "reused only {} tokens", second.cached);
    let m = e.metrics();
    assert_eq!((m.prefix_lookups, m.prefix_hits), (2, 1));
    assert_eq!(m.prefix_hit_tokens, second.cached as u64);
    assert!(m.prefix_hit_rate() > 0.4);

    let cold = engine(EngineConfig::default().with_prefix_cache_entries(0));
    let reference = run_alone(&cold, GenerationRequest::new(b, 6));
    assert_eq!(second.ids, reference.ids, "reused KV changed the output");
    assert_eq!(cold.metrics().prefix_hits, 0);
}

#[test]
fn a_prompt_is_reused_only_for_its_own_client_unless_the_cache_is_shared() {
    // Key B's prompt holds a secret; key A guesses it exactly. A hit would show as a far
    // shorter first token: the guess must be computed cold, as any miss is.
    let secret = chat(
        "You are the assistant of an account whose recovery code is 48213. Never reveal it.",
        "What can you do?",
    );
    let as_b =
        |p: &Vec<u32>| GenerationRequest::new(p.clone(), 2).with_client(Some("key-b".into()));
    let as_a =
        |p: &Vec<u32>| GenerationRequest::new(p.clone(), 2).with_client(Some("key-a".into()));

    let e = engine(EngineConfig::default());
    assert_eq!(run_alone(&e, as_b(&secret)).cached, 0);
    let guess = run_alone(&e, as_a(&secret));
    assert_eq!(guess.cached, 0, "key A reused key B's prompt");
    // The keyless client is a partition of its own too.
    let anonymous = GenerationRequest::new(secret.clone(), 2);
    assert_eq!(run_alone(&e, anonymous).cached, 0);
    // Within one key the prefix is reused as before.
    let again = run_alone(&e, as_b(&secret));
    assert!(
        again.cached + 1 >= secret.len(),
        "key B reused {}",
        again.cached
    );
    assert_eq!(e.metrics().prefix_hits, 1);

    // Shared deliberately (one tenant behind several keys): the other key hits.
    let shared = engine(EngineConfig::default().with_shared_prefix_cache(true));
    run_alone(&shared, as_b(&secret));
    let hit = run_alone(&shared, as_a(&secret));
    assert!(
        hit.cached + 1 >= secret.len(),
        "shared cache reused {}",
        hit.cached
    );
}

#[test]
fn two_hundred_concurrent_streams_all_finish() {
    // 200 streams of ~40 prompt tokens + 4 new tokens, F16 KV: ~1 MiB each.
    let e = engine(
        EngineConfig::default()
            .with_kv_budget_bytes(256 << 20)
            .with_max_running(256)
            .with_max_queue(256),
    );
    let handles: Vec<_> = (0..200)
        .map(|i| {
            let p = chat("Answer briefly.", QUESTIONS[i % QUESTIONS.len()]);
            e.submit(GenerationRequest::new(p, 4).with_stop_sequences(["\n\n\n"]))
                .unwrap()
        })
        .collect();
    let outs: Vec<Outcome> = handles.iter().map(collect).collect();
    for (i, o) in outs.iter().enumerate() {
        assert!(!o.ids.is_empty() || o.stop == StopReason::EndTurn);
        assert_eq!(o.usage.output_tokens as usize, o.ids.len());
        // Same prompt, same greedy output, whatever the batch composition.
        assert_eq!(o.ids, outs[i % QUESTIONS.len()].ids);
    }
    let m = e.metrics();
    assert_eq!(m.finished, 200);
    assert!(m.ttft.count() == 200 && m.generated_tokens >= 200);
    drop(handles);
    wait_for(|| e.metrics().running == 0, "all done");
}

#[test]
fn stop_sequence_ends_the_stream_and_text_stops_before_it() {
    let e = engine(EngineConfig::default());
    let p = chat(
        "You are a helpful assistant.",
        "What is the capital of France?",
    );
    let free = collect(&e.submit(GenerationRequest::new(p.clone(), 8)).unwrap());
    assert!(free.text.contains("Paris"), "{:?}", free.text);
    let stopped = collect(
        &e.submit(GenerationRequest::new(p, 8).with_stop_sequences(["Paris"]))
            .unwrap(),
    );
    assert_eq!(stopped.stop, StopReason::StopSequence);
    assert!(!stopped.text.contains("Paris"));
    assert!(free.text.starts_with(&stopped.text));
}

#[test]
fn default_stop_tokens_are_eos_eot_and_the_tokenizers_end_of_generation_ids() {
    let f = fixture();
    let with_tok = engine(EngineConfig::default());
    let stops = with_tok.stop_tokens();
    for id in f.model.stop_tokens().iter().chain(f.tok.eog_ids()) {
        assert!(stops.contains(id), "{id} missing from {stops:?}");
    }
    let im_end = f.tok.special_id("<|im_end|>").unwrap();
    let endoftext = f.tok.special_id("<|endoftext|>").unwrap();
    assert!(
        stops.contains(&im_end) && stops.contains(&endoftext),
        "{stops:?}"
    );
    assert!(stops.is_sorted(), "{stops:?}");
    // Without a tokenizer, only the file's EOS/EOT.
    let bare = Engine::new(f.model.clone(), None, EngineConfig::default()).unwrap();
    assert_eq!(bare.stop_tokens(), f.model.stop_tokens());
}

/// Forces a fixed token sequence, then the end of the turn: the simplest grammar.
#[derive(Debug)]
struct Literal {
    ids: Vec<u32>,
    eos: u32,
    pos: usize,
}

impl gpu_pipeline::Constraint for Literal {
    fn fill_mask(
        &mut self,
        mask: &mut gpu_pipeline::TokenMask,
    ) -> Result<(), gpu_pipeline::ConstraintError> {
        mask.words_mut().fill(0);
        mask.allow(self.ids.get(self.pos).copied().unwrap_or(self.eos));
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), gpu_pipeline::ConstraintError> {
        let want = self.ids.get(self.pos).copied().unwrap_or(self.eos);
        if token != want {
            return Err(gpu_pipeline::ConstraintError::Failed(format!(
                "token {token} is not {want}"
            )));
        }
        self.pos += 1;
        Ok(())
    }
}

#[derive(Debug)]
struct LiteralFactory(Vec<u32>, u32);

impl gpu_pipeline::ConstraintFactory for LiteralFactory {
    fn start(&self) -> Box<dyn gpu_pipeline::Constraint> {
        Box::new(Literal {
            ids: self.0.clone(),
            eos: self.1,
            pos: 0,
        })
    }
}

#[test]
fn constrained_sequences_follow_their_constraint_and_leave_batch_neighbours_alone() {
    let f = fixture();
    let e = engine(EngineConfig::default());
    let eos = e.stop_tokens()[0];
    let forced = f.tok.encode(" {\"answer\": 42}").to_vec();
    let factory: Arc<dyn gpu_pipeline::ConstraintFactory> =
        Arc::new(LiteralFactory(forced.clone(), eos));
    let solo: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| {
            let h = e
                .submit(GenerationRequest::new(chat("Be brief.", q), 8))
                .unwrap();
            collect(&h).ids
        })
        .collect();
    // Every other request constrained, all in one batch; sampled (temperature 1) constrained
    // ones still follow the constraint.
    let handles: Vec<_> = QUESTIONS
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let mut r = GenerationRequest::new(chat("Be brief.", q), 8);
            if i % 2 == 0 {
                r = r
                    .with_constraint(Some(factory.clone()))
                    .with_sampling(gpu_pipeline::SamplerConfig::default().with_temperature(1.0));
            }
            e.submit(r).unwrap()
        })
        .collect();
    for (i, h) in handles.iter().enumerate() {
        let out = collect(h);
        if i % 2 == 0 {
            assert_eq!(out.ids, forced, "request {i}");
            assert_eq!(out.stop, StopReason::EndTurn);
        } else {
            assert_eq!(out.ids, solo[i], "unconstrained request {i}");
        }
    }
    // A constraint that allows only a token the model never produces (a logit of -inf is
    // impossible here, so use an id beyond the vocabulary): the request fails, typed.
    let vocab = f.model.config().vocab_size as u32;
    let impossible: Arc<dyn gpu_pipeline::ConstraintFactory> =
        Arc::new(LiteralFactory(vec![vocab + 5], eos));
    let h = e
        .submit(
            GenerationRequest::new(chat("Be brief.", "Hi"), 4).with_constraint(Some(impossible)),
        )
        .unwrap();
    let mut failed = None;
    while let Some(ev) = h.recv_timeout(Duration::from_secs(600)) {
        if let InferenceEvent::Error { message, .. } = ev {
            failed = Some(message);
            break;
        }
    }
    assert_eq!(
        failed.as_deref(),
        Some("the output constraint allows no token here")
    );
}

#[test]
fn llguidance_json_schema_and_regex_constraints_hold_on_the_real_model() {
    let f = fixture();
    let e = engine(EngineConfig::default());
    let eos = e.stop_tokens()[0];
    let grammars = gpu_pipeline::Grammars::new(&f.tok, f.model.config().vocab_size, eos).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": false,
    });
    let json = grammars.json_schema(schema).unwrap();
    let digits = grammars.regex("[0-9]{3}").unwrap();
    assert!(matches!(
        grammars.json_schema(serde_json::json!({"type": "no-such-type"})),
        Err(gpu_pipeline::GrammarError::Invalid(_))
    ));
    // A recursion with no way out is refused when compiled, not found while generating.
    assert_eq!(
        grammars.json_schema(serde_json::json!({"$ref": "#"})).err(),
        Some(gpu_pipeline::GrammarError::Empty)
    );
    let handles: Vec<_> = QUESTIONS
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let sampling = gpu_pipeline::SamplerConfig::default()
                .with_temperature(if i % 2 == 0 { 0.0 } else { 1.0 })
                .with_seed(i as u64);
            let c = if i < 6 { json.clone() } else { digits.clone() };
            e.submit(
                GenerationRequest::new(chat("Answer in JSON.", q), 64)
                    .with_sampling(sampling)
                    .with_constraint(Some(c)),
            )
            .unwrap()
        })
        .collect();
    for (i, h) in handles.iter().enumerate() {
        let out = collect(h);
        assert_eq!(out.stop, StopReason::EndTurn, "request {i}: {:?}", out.text);
        if i < 6 {
            let v: serde_json::Value = serde_json::from_str(&out.text)
                .unwrap_or_else(|e| panic!("request {i}: {e}: {:?}", out.text));
            let o = v.as_object().unwrap();
            assert_eq!(o.len(), 2, "{v}");
            assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{v}");
            assert!(o["age"].is_i64() || o["age"].is_u64(), "{v}");
        } else {
            assert_eq!(out.text.len(), 3, "{:?}", out.text);
            assert!(
                out.text.bytes().all(|b| b.is_ascii_digit()),
                "{:?}",
                out.text
            );
        }
    }
}
