//! Speculative decoding (n-gram prompt lookup, and a draft model) on the real default model (run
//! `scripts/fetch-model` first): the engine's output with lookup is the output without it,
//! token for token (greedy, seeded sampling, logprobs, stop sequences, max tokens, a grammar),
//! alone and in one batch with sequences in other speculation states.

use std::sync::Arc;
use std::time::Duration;

use gpu_pipeline::engine::{
    DraftModel, Engine, EngineConfig, GenerationRequest, NgramLookup, Speculation,
};
use gpu_pipeline::zerolayer_api::InferenceEvent;
use gpu_pipeline::zerolayer_api::TokenLogprob;
use gpu_pipeline::{Constraint, ConstraintError, ConstraintFactory};
use gpu_pipeline::{SamplerConfig, StopReason, TokenMask};
use token_stream::TemplateMessage;

mod common;
use common::fixture;

fn chat(user: &str) -> Vec<u32> {
    let f = fixture();
    let msgs = [
        TemplateMessage::new("system", "You are a helpful assistant."),
        TemplateMessage::new("user", user),
    ];
    f.chat.encode(&f.tok, &msgs, true).expect("encode").to_vec()
}

fn engine(speculation: Speculation) -> Engine {
    let f = fixture();
    let cfg = EngineConfig::default().with_speculation(speculation);
    Engine::new(f.model.clone(), Some(f.tok.clone()), cfg).expect("engine")
}

fn lookup() -> Speculation {
    Speculation::NgramLookup(NgramLookup::default())
}

const LIST: &str = "Repeat this list exactly, one item per line:\napple\nbanana\ncherry\ndate\n\
    elderberry\nfig\ngrape\nhoneydew\nkiwi\nlemon\nmango\nnectarine\norange\npapaya";

const CODE: &str = "Add type hints to this Python function. Output the complete function.\n\n\
    def merge_sorted(left, right):\n    result = []\n    i = 0\n    j = 0\n    \
    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n            \
    result.append(left[i])\n            i += 1\n        else:\n            \
    result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n    \
    result.extend(right[j:])\n    return result";

const QUOTE: &str = "Here is a paragraph: \"The lighthouse keeper climbed the stairs every \
    evening at dusk. He trimmed the wick, polished the lens, and watched the ships pass in the \
    dark. In forty years he never missed a night.\" Quote the paragraph exactly, then say who \
    the main character is.";

/// Everything a client sees of one request.
#[derive(Debug, PartialEq)]
struct Seen {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<Option<Box<TokenLogprob>>>,
    stop: StopReason,
    stop_sequence: Option<String>,
    output_tokens: u32,
}

fn collect(h: &gpu_pipeline::RequestHandle) -> Seen {
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut logprobs = Vec::new();
    // A token's log-probabilities come just before its Delta.
    let mut next_logprob = None;
    while let Some(ev) = h.recv_timeout(Duration::from_secs(600)) {
        match ev {
            InferenceEvent::Logprobs(lp) => {
                assert!(next_logprob.is_none() && lp.len() == 1, "{lp:?}");
                next_logprob = lp.into_iter().next().map(Box::new);
            }
            InferenceEvent::Delta { ids: new, text: t } => {
                for id in new {
                    ids.push(id);
                    logprobs.push(next_logprob.take());
                }
                text += &t;
            }
            InferenceEvent::Finished {
                stop_reason,
                stop_sequence,
                usage,
            } => {
                return Seen {
                    ids,
                    text,
                    logprobs,
                    stop: stop_reason,
                    stop_sequence,
                    output_tokens: usage.output_tokens,
                };
            }
            InferenceEvent::Error { message, .. } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    panic!("stream ended without Finished");
}

fn run(e: &Engine, req: GenerationRequest) -> Seen {
    collect(&e.submit(req).expect("submit"))
}

#[test]
fn greedy_output_with_lookup_is_bit_identical_on_repetitive_prompts() {
    let (plain, spec) = (engine(Speculation::Off), engine(lookup()));
    for (what, prompt, n) in [
        ("list", LIST, 80),
        ("code", CODE, 110),
        ("quote", QUOTE, 90),
    ] {
        let req = GenerationRequest::new(chat(prompt), n);
        let want = run(&plain, req.clone());
        let got = run(&spec, req);
        assert_eq!(got, want, "{what}");
        eprintln!("{what}: {:?}", want.text);
    }
    let m = spec.metrics();
    eprintln!(
        "drafted {} accepted {} ({:.2}), {:.2} tokens per sampled step",
        m.draft_tokens,
        m.accepted_draft_tokens,
        m.draft_acceptance_rate(),
        m.tokens_per_sampled_step()
    );
    // The small model echoes the list and the code; it retells the quote in its own words.
    assert!(m.accepted_draft_tokens > 60, "lookup speculated: {m:?}");
    assert!(m.tokens_per_sampled_step() > 1.4, "{m:?}");
    assert_eq!(plain.metrics().draft_tokens, 0);
}

/// A length grammar over digits: only tokens made of ASCII digits, spaces, commas and
/// newlines, then only `eos` after `max` tokens.
#[derive(Debug)]
struct DigitsThenEnd {
    allowed: Arc<TokenMask>,
    eos: u32,
    max: usize,
}

#[derive(Debug)]
struct DigitsState {
    allowed: Arc<TokenMask>,
    eos: u32,
    left: usize,
}

impl ConstraintFactory for DigitsThenEnd {
    fn start(&self) -> Box<dyn Constraint> {
        Box::new(DigitsState {
            allowed: self.allowed.clone(),
            eos: self.eos,
            left: self.max,
        })
    }
}

impl Constraint for DigitsState {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        if self.left == 0 {
            *mask = TokenMask::forbid_all(mask.vocab());
        } else {
            mask.clone_from(&self.allowed);
        }
        mask.allow(self.eos);
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        if token == self.eos {
            return Ok(());
        }
        if self.left == 0 || !self.allowed.is_allowed(token) {
            return Err(ConstraintError::Failed(format!(
                "token {token} not allowed"
            )));
        }
        self.left -= 1;
        Ok(())
    }
}

fn digits_then_end(max: usize) -> Arc<dyn ConstraintFactory> {
    let f = fixture();
    let vocab = f.model.config().vocab_size;
    let mut allowed = TokenMask::forbid_all(vocab);
    for id in 0..vocab as u32 {
        let ok = f.tok.token_bytes(id).is_some_and(|b| {
            !b.is_empty() && b.iter().all(|c| c.is_ascii_digit() || b" ,\n".contains(c))
        });
        if ok {
            allowed.allow(id);
        }
    }
    let eos = f.model.stop_tokens_with(Some(&f.tok))[0];
    Arc::new(DigitsThenEnd {
        allowed: Arc::new(allowed),
        eos,
        max,
    })
}

/// Sequences with lookup in different states share batches (repetitive ones drafting long,
/// a chat whose lookup backs off, seeded sampling, logprobs, a stop sequence, a grammar, a
/// request of 3 tokens): each emits what it emits alone without speculation.
#[test]
fn concurrent_sequences_in_different_speculation_states_match_their_plain_runs() {
    let numbers = "Repeat these numbers exactly: 12, 34, 56, 78, 90, 12, 34, 56, 78, 90, 11, 22, \
        33, 44, 55";
    let reqs = vec![
        GenerationRequest::new(chat(LIST), 70),
        GenerationRequest::new(chat(CODE), 90),
        GenerationRequest::new(chat("Write a short poem about the sea at night."), 60),
        GenerationRequest::new(chat(QUOTE), 60)
            .with_sampling(SamplerConfig::default().with_temperature(0.7).with_seed(42)),
        GenerationRequest::new(chat(CODE), 50)
            .with_sampling(
                SamplerConfig::default()
                    .with_temperature(1.0)
                    .with_top_p(0.9)
                    .with_repetition_penalty(1.1, 64)
                    .with_seed(7),
            )
            .with_logprobs(Some(3)),
        GenerationRequest::new(chat(LIST), 60).with_logprobs(Some(2)),
        GenerationRequest::new(chat(LIST), 100).with_stop_sequences(["grape"]),
        GenerationRequest::new(chat(numbers), 40).with_constraint(Some(digits_then_end(30))),
        GenerationRequest::new(chat(LIST), 3),
    ];
    let plain = engine(Speculation::Off);
    let want: Vec<Seen> = reqs.iter().map(|r| run(&plain, r.clone())).collect();
    // Every sequence may draft however many share the batch.
    let spec = engine(Speculation::NgramLookup(
        NgramLookup::default().with_max_batch(16),
    ));
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| spec.submit(r.clone()).expect("submit"))
        .collect();
    for (i, (h, want)) in handles.iter().zip(&want).enumerate() {
        let got = collect(h);
        assert_eq!(&got, want, "request {i}");
    }
    assert_eq!(want[6].stop, StopReason::StopSequence);
    assert_eq!(want[8].ids.len(), 3);
    assert!(
        want[7]
            .ids
            .iter()
            .all(|&t| digits_then_end(30).start().commit(t).is_ok())
    );
    let m = spec.metrics();
    assert!(m.accepted_draft_tokens > 0 && m.draft_tokens > m.accepted_draft_tokens);
    eprintln!(
        "batch: drafted {} accepted {} ({:.2}), {:.2} tokens per sampled step",
        m.draft_tokens,
        m.accepted_draft_tokens,
        m.draft_acceptance_rate(),
        m.tokens_per_sampled_step()
    );
}

/// A request's constraint hidden behind the trait's defaults: drafts are not cut by it (the
/// verification still samples every position through its masks).
#[derive(Debug)]
struct Uncut(Arc<dyn ConstraintFactory>);

#[derive(Debug)]
struct UncutState(Box<dyn Constraint>);

impl ConstraintFactory for Uncut {
    fn start(&self) -> Box<dyn Constraint> {
        Box::new(UncutState(self.0.start()))
    }
}

impl Constraint for UncutState {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        self.0.fill_mask(mask)
    }
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.0.commit(token)
    }
}

/// Structured output with speculation: the prompt's JSON has fields the schema renames, so
/// lookup (and a draft model copying the prompt) keep proposing the prompt's text where the
/// grammar forbids it. The grammar cuts those drafts before the verification (fewer rejected
/// tokens than the same grammar left uncut), and the output is the plain greedy output either
/// way.
#[test]
fn a_grammar_cuts_drafts_and_leaves_the_output_alone() {
    let f = fixture();
    let eos = f.tok.eos_id().expect("eos");
    let grammars =
        gpu_pipeline::Grammars::new(&f.tok, f.model.config().vocab_size, eos).expect("grammars");
    let schema = serde_json::json!({
        "x-guidance": {"whitespace_flexible": false},
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"fruit": {"type": "string"}, "colour": {"type": "string"}},
            "required": ["fruit", "colour"],
            "additionalProperties": false,
        },
        "minItems": 6,
        "maxItems": 6,
    });
    let g = grammars.json_schema(schema).expect("schema");
    let prompt = chat(
        "Copy this JSON exactly: [{\"name\":\"apple\",\"color\":\"red\"},\
         {\"name\":\"banana\",\"color\":\"yellow\"},{\"name\":\"cherry\",\"color\":\"red\"},\
         {\"name\":\"grape\",\"color\":\"purple\"},{\"name\":\"lemon\",\"color\":\"yellow\"},\
         {\"name\":\"lime\",\"color\":\"green\"}]",
    );
    let req = |c: Arc<dyn ConstraintFactory>| {
        GenerationRequest::new(prompt.clone(), 120).with_constraint(Some(c))
    };
    let want = run(&engine(Speculation::Off), req(g.clone()));
    assert!(want.text.starts_with("[{\"fruit\":"), "{}", want.text);
    for (what, spec) in [
        ("lookup", lookup as fn() -> Speculation),
        ("draft model", || q2k_drafts(1, false)),
    ] {
        let mut drafted = Vec::new();
        for c in [
            g.clone(),
            Arc::new(Uncut(g.clone())) as Arc<dyn ConstraintFactory>,
        ] {
            let e = engine(spec());
            assert_eq!(run(&e, req(c)), want, "{what}");
            let m = e.metrics();
            drafted.push((m.draft_tokens, m.draft_tokens - m.accepted_draft_tokens));
        }
        eprintln!(
            "{what}: cut: (drafted, rejected) {:?}, uncut {:?}",
            drafted[0], drafted[1]
        );
        assert!(drafted[0].0 > 0, "{what} drafted nothing");
        assert!(
            drafted[0].1 < drafted[1].1,
            "{what}: the cut rejected as many: {drafted:?}"
        );
    }
}

/// A model of the test-model set ([`common::test_models_dir`], `scripts/make-test-models`).
fn test_model(name: &str) -> Arc<gpu_pipeline::Model> {
    let path = common::test_models_dir().join(format!("{name}.gguf"));
    // SAFETY: the test models are not modified while the tests run.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(&path) }.expect("open test model"));
    Arc::new(gpu_pipeline::Model::load(gguf, gpu_pipeline::ModelOptions::default()).expect("load"))
}

/// The default model requantized to Q2_K drafts for the default model: close enough to be
/// accepted often, far enough to be rejected (every draft goes on to `max_draft`, whatever the
/// draft model's confidence), so the draft ring's rollback runs. Without lookup first (the
/// draft model proposes every draft) unless `lookup`.
fn q2k_drafts(max_batch: usize, lookup: bool) -> Speculation {
    Speculation::DraftModel(
        DraftModel::new(test_model("smollm2.Q2_K"))
            .with_min_probability(0.0)
            .with_max_draft(6)
            .with_max_batch(max_batch)
            .with_lookup_first(lookup.then(NgramLookup::default)),
    )
}

/// Greedy and seeded sampling with a draft model emit what plain decoding emits, alone and in
/// one batch (every sequence drafting), and drafts were both accepted and rejected; with
/// lookup first as well, where lookup proposes some of the drafts (the code and the list are
/// copied from the prompt) and the draft model's ring catches up on the steps it skipped.
#[test]
fn output_with_a_draft_model_is_the_plain_output() {
    let reqs = [
        GenerationRequest::new(chat("Write a short poem about the sea at night."), 60),
        GenerationRequest::new(chat(CODE), 70),
        GenerationRequest::new(chat(QUOTE), 50)
            .with_sampling(SamplerConfig::default().with_temperature(0.7).with_seed(42)),
        GenerationRequest::new(chat(LIST), 40)
            .with_logprobs(Some(2))
            .with_stop_sequences(["date"]),
        GenerationRequest::new(chat(LIST), 2),
    ];
    let plain = engine(Speculation::Off);
    let want: Vec<Seen> = reqs.iter().map(|r| run(&plain, r.clone())).collect();
    assert_eq!(want[3].stop, StopReason::StopSequence);
    for lookup in [false, true] {
        let alone = engine(q2k_drafts(1, lookup));
        for (i, (r, want)) in reqs.iter().zip(&want).enumerate() {
            assert_eq!(
                &run(&alone, r.clone()),
                want,
                "request {i} alone, lookup {lookup}"
            );
        }
        let m = alone.metrics();
        eprintln!(
            "alone, lookup first {lookup}: drafted {} ({} by lookup) accepted {} ({:.2}), \
             {:.2} tokens per sampled step",
            m.draft_tokens,
            m.lookup_draft_tokens,
            m.accepted_draft_tokens,
            m.draft_acceptance_rate(),
            m.tokens_per_sampled_step()
        );
        assert!(m.accepted_draft_tokens > 40, "{m:?}");
        assert!(m.draft_tokens > m.accepted_draft_tokens, "{m:?}");
        assert!(m.tokens_per_sampled_step() > 1.5, "{m:?}");
        if lookup {
            assert!(
                m.lookup_draft_tokens > 20 && m.lookup_draft_tokens < m.draft_tokens,
                "both proposers drafted: {m:?}"
            );
        } else {
            assert_eq!(m.lookup_draft_tokens, 0);
        }
        let batched = engine(q2k_drafts(16, lookup));
        let handles: Vec<_> = reqs
            .iter()
            .map(|r| batched.submit(r.clone()).expect("submit"))
            .collect();
        for (i, (h, want)) in handles.iter().zip(&want).enumerate() {
            assert_eq!(&collect(h), want, "request {i} in a batch, lookup {lookup}");
        }
        let m = batched.metrics();
        assert!(m.accepted_draft_tokens > 40 && m.draft_tokens > m.accepted_draft_tokens);
        assert_eq!(m.lookup_draft_tokens > 0, lookup, "{m:?}");
    }
}

/// In a batch, the draft model's cut-off rises with the number of decoding sequences
/// (`DraftModel::min_probability_in_batch`): five copies of a request decoding together draft
/// fewer tokens each than the request alone, and still emit the plain output.
#[test]
fn a_draft_model_drafts_less_in_a_batch() {
    let req = GenerationRequest::new(chat(CODE), 60);
    let want = run(&engine(Speculation::Off), req.clone());
    let draft = DraftModel::new(test_model("smollm2.Q2_K"))
        .with_min_probability(0.5)
        .with_max_batch(16)
        .with_lookup_first(None);
    let spec = || Speculation::DraftModel(draft.clone());
    let alone = engine(spec());
    assert_eq!(run(&alone, req.clone()), want);
    let batched = engine(spec());
    let handles: Vec<_> = (0..5)
        .map(|_| batched.submit(req.clone()).expect("submit"))
        .collect();
    for h in &handles {
        assert_eq!(collect(h), want);
    }
    let (a, b) = (alone.metrics(), batched.metrics());
    let (per_alone, per_batched) = (a.draft_tokens as f64, b.draft_tokens as f64 / 5.0);
    eprintln!("draft tokens per request: alone {per_alone}, in a batch of 5 {per_batched}");
    assert!(per_alone > 10.0, "{a:?}");
    // Identical sequences draft identically unless the cut-off differs (61 against 52 when
    // written: the Q2_K draft is mostly confident beyond 0.83, the bar for 5).
    assert!(per_batched + 5.0 <= per_alone, "alone {a:?}, batched {b:?}");
    // The bar: odds 5 times those of 0.5.
    assert_eq!(draft.min_probability_in_batch(1), 0.5);
    assert!((draft.min_probability_in_batch(5) - 5.0 / 6.0).abs() < 1e-6);
}

/// A draft model with another vocabulary is refused when the engine starts.
#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let f = fixture();
    let draft = test_model("arch-mixtral.Q8_0");
    let cfg = EngineConfig::default()
        .with_speculation(Speculation::DraftModel(DraftModel::new(draft.clone())));
    match Engine::new(f.model.clone(), Some(f.tok.clone()), cfg) {
        Err(gpu_pipeline::engine::EngineInitError::DraftVocabulary { draft: d, model }) => {
            assert_eq!((d, model), (draft.config().vocab_size, 49152));
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!(
            "a draft model of {} tokens was accepted",
            draft.config().vocab_size
        ),
    }
}
