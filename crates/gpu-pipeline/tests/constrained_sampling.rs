//! Constrained sampling never leaves the mask: for random logits (NaN and minus infinity
//! included), random masks, random sampling parameters and histories, `sample_masked` returns a
//! token the mask allows, or `None` exactly when no allowed token has a finite logit.

use gpu_pipeline::{Sampler, SamplerConfig, TokenMask};
use proptest::prelude::*;

fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -20.0f32..20.0,
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::NAN),
        1 => Just(1.0e30f32),
    ]
}

fn params() -> impl Strategy<Value = SamplerConfig> {
    (
        prop_oneof![Just(0.0f32), 0.05f32..2.0],
        0usize..8,
        0.05f32..=1.0,
        0.0f32..0.5,
        0.5f32..2.0,
        -2.0f32..2.0,
        -2.0f32..2.0,
        any::<u64>(),
    )
        .prop_map(|(t, k, p, min_p, rep, freq, pres, seed)| {
            SamplerConfig::default()
                .with_temperature(t)
                .with_top_k(k)
                .with_top_p(p)
                .with_min_p(min_p)
                .with_repetition_penalty(rep, 16)
                .with_frequency_penalty(freq)
                .with_presence_penalty(pres)
                .with_seed(seed)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn constrained_sampling_never_yields_a_token_outside_the_mask(
        logits in prop::collection::vec(logit(), 1..300),
        allowed_bits in prop::collection::vec(any::<bool>(), 300),
        params in params(),
        history in prop::collection::vec(0u32..320, 0..40),
        prompt_len in 0usize..40,
        steps in 1usize..6,
    ) {
        let vocab = logits.len();
        let mut mask = TokenMask::forbid_all(vocab);
        for (i, &a) in allowed_bits.iter().enumerate().take(vocab) {
            if a {
                mask.allow(i as u32);
            }
        }
        let pickable = (0..vocab)
            .any(|i| mask.is_allowed(i as u32) && !logits[i].is_nan() && logits[i] != f32::NEG_INFINITY);
        let mut sampler = Sampler::new(params);
        let mut history = history;
        for _ in 0..steps {
            match sampler.sample_masked(&logits, &history, prompt_len, &mask) {
                Some(t) => {
                    prop_assert!(pickable);
                    prop_assert!(mask.is_allowed(t), "token {} outside the mask", t);
                    prop_assert!(!logits[t as usize].is_nan());
                    history.push(t);
                }
                None => prop_assert!(!pickable, "None although an allowed token is finite"),
            }
        }
    }

    #[test]
    fn a_full_mask_samples_as_the_unconstrained_sampler(
        logits in prop::collection::vec(-20.0f32..20.0, 1..200),
        params in params(),
        history in prop::collection::vec(0u32..200, 0..20),
    ) {
        let mask = TokenMask::allow_all(logits.len());
        let (mut a, mut b) = (Sampler::new(params.clone()), Sampler::new(params));
        for _ in 0..4 {
            prop_assert_eq!(
                a.sample_masked(&logits, &history, 0, &mask),
                Some(b.sample_after(&logits, &history, 0))
            );
        }
    }
}

#[test]
fn mask_bits_follow_the_simple_vob_layout() {
    let mut m = TokenMask::forbid_all(70);
    m.words_mut()[1] = 1 << 3;
    assert!(m.is_allowed(35));
    assert_eq!(m.count_allowed(), 1);
    m.forbid(35);
    m.allow(69);
    m.allow(70); // beyond the vocabulary: ignored
    assert_eq!(m.count_allowed(), 1);
    assert_eq!(TokenMask::allow_all(70).count_allowed(), 70);
}

/// A random JSON Schema: an object of up to 4 properties of random kinds, some required.
fn json_schema() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        (0u32..12).prop_map(|n| serde_json::json!({"type": "string", "maxLength": n})),
        (0i64..1000).prop_map(|m| serde_json::json!({"type": "integer", "minimum": 0, "maximum": m})),
        Just(serde_json::json!({"type": "boolean"})),
        prop::collection::vec("[a-z]{1,6}", 1..4).prop_map(|v| serde_json::json!({"enum": v})),
        (0usize..3).prop_map(|n| serde_json::json!(
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": n}
        )),
    ];
    prop::collection::vec((leaf, any::<bool>()), 0..5).prop_map(|props| {
        let names: Vec<String> = (0..props.len()).map(|i| format!("p{i}")).collect();
        let required: Vec<&String> = names
            .iter()
            .zip(&props)
            .filter(|(_, p)| p.1)
            .map(|(n, _)| n)
            .collect();
        let properties: serde_json::Map<String, serde_json::Value> = names
            .iter()
            .cloned()
            .zip(props.iter().map(|p| p.0.clone()))
            .collect();
        serde_json::json!({
            "x-guidance": {"whitespace_flexible": false},
            "type": "object", "properties": properties, "required": required,
            "additionalProperties": false,
        })
    })
}

/// The default model's tokenizer and its grammar compiler (built once for all cases).
fn grammars() -> &'static (token_stream::Tokenizer, gpu_pipeline::Grammars, u32) {
    static G: std::sync::OnceLock<(token_stream::Tokenizer, gpu_pipeline::Grammars, u32)> =
        std::sync::OnceLock::new();
    G.get_or_init(|| {
        let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the model file is not modified while the test runs.
        let gguf = unsafe { weight_cache::Gguf::open(path) }.expect("open model");
        let tok = token_stream::Tokenizer::from_gguf(&gguf).expect("tokenizer");
        let eos = tok.eos_id().expect("eos");
        let g = gpu_pipeline::Grammars::new(&tok, tok.vocab_size(), eos).expect("grammars");
        (tok, g, eos)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// For random JSON Schemas and random logits, every sampled token is one the schema's mask
    /// allows (and llguidance accepts it), and an output that reaches EOS is JSON with the
    /// schema's required keys.
    #[test]
    fn schema_constrained_sampling_stays_in_the_schema(
        schema in json_schema(),
        params in params(),
        seed in any::<u64>(),
    ) {
        let (tok, grammars, eos) = grammars();
        let vocab = tok.vocab_size();
        let factory = grammars.json_schema(schema.clone()).expect("compiles");
        let mut c = factory.start();
        let mut mask = TokenMask::forbid_all(vocab);
        let mut sampler = Sampler::new(params);
        let mut rng = seed | 1;
        let mut logits = vec![0f32; vocab];
        let mut out: Vec<u32> = Vec::new();
        for _ in 0..80 {
            for l in logits.iter_mut() {
                // xorshift64: random logits in [-8, 8)
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                *l = (rng >> 40) as f32 / (1u64 << 24) as f32 * 16.0 - 8.0;
            }
            c.fill_mask(&mut mask).expect("mask");
            let t = sampler.sample_masked(&logits, &out, 0, &mask).expect("an allowed token");
            prop_assert!(mask.is_allowed(t), "token {} outside the mask", t);
            if t == *eos {
                let text = tok.decode(&out).expect("decodes");
                let v: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| TestCaseError::fail(format!("{e}: {text:?}")))?;
                for k in schema["required"].as_array().unwrap() {
                    prop_assert!(v.get(k.as_str().unwrap()).is_some(), "{} lacks {}", text, k);
                }
                break;
            }
            c.commit(t).expect("llguidance accepts the token its mask allowed");
            out.push(t);
        }
    }
}

/// Whether the constraint of `factory` lets the default model write `text` token by token and
/// then end (EOS allowed).
fn accepts(factory: &std::sync::Arc<dyn gpu_pipeline::ConstraintFactory>, text: &str) -> bool {
    let (tok, _, eos) = grammars();
    let mut c = factory.start();
    let mut mask = TokenMask::forbid_all(tok.vocab_size());
    for t in tok.encode(text).iter().copied() {
        c.fill_mask(&mut mask).expect("mask");
        if !mask.is_allowed(t) {
            return false;
        }
        c.commit(t).expect("an allowed token is accepted");
    }
    c.fill_mask(&mut mask).expect("mask");
    mask.is_allowed(*eos)
}

/// An integer without bounds in a JSON Schema is held to 64 bits: `i64::MAX` and
/// `i64::MIN + 1024` pass, one more digit does not (on the default model an unbounded
/// `"population"` ran to its 200-token limit in digits); explicit bounds are the schema's own.
/// The 1024 lowest `i64`s are out: llguidance cannot take a lower bound that rounds to
/// `i64::MIN` as an `f64` (see `bound_json_integers`).
#[test]
fn unbounded_integers_are_held_to_64_bits_and_explicit_bounds_kept() {
    let (_, grammars, _) = grammars();
    let schema = serde_json::json!({
        "x-guidance": {"whitespace_flexible": false},
        "type": "object",
        "properties": {"population": {"type": "integer"}},
        "required": ["population"],
        "additionalProperties": false,
    });
    let g = grammars.json_schema(schema).expect("compiles");
    let doc = |n: &str| format!("{{\"population\":{n}}}");
    for n in [
        "0",
        "-1",
        "1234567890",
        &i64::MAX.to_string(),
        &(i64::MIN + 1024).to_string(),
    ] {
        assert!(accepts(&g, &doc(n)), "{n} refused");
    }
    for n in [
        "9223372036854775808",
        "-9223372036854775809",
        &i64::MIN.to_string(),
        "12345678901234567890",
        "-12345678901234567890",
        "123456789012345678901234",
    ] {
        assert!(!accepts(&g, &doc(n)), "{n} accepted");
    }
    // One bound given: the other is 64-bit; both given: the schema's.
    let g = grammars
        .json_schema(serde_json::json!({"type": "integer", "minimum": 5}))
        .unwrap();
    assert!(accepts(&g, &i64::MAX.to_string()));
    assert!(!accepts(&g, "4"));
    assert!(!accepts(&g, "99999999999999999999"));
    let wide = serde_json::json!({"type": "integer", "minimum": -1e30, "maximum": 1e30});
    let mut bounded = wide.clone();
    gpu_pipeline::bound_json_integers(&mut bounded);
    assert_eq!(bounded, wide, "explicit bounds unchanged");
}

/// `allowed_prefix` (how speculative decoding cuts a draft) on a real grammar: from any state,
/// the longest prefix of a draft that the token-by-token masks allow, without advancing the
/// state; ids the grammar does not know end the prefix without breaking the matcher.
#[test]
fn allowed_prefix_is_what_the_masks_allow_and_does_not_advance() {
    let (tok, grammars, _) = grammars();
    let schema = serde_json::json!({
        "x-guidance": {"whitespace_flexible": false},
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false,
    });
    let g = grammars.json_schema(schema).expect("compiles");
    let mut mask = TokenMask::forbid_all(tok.vocab_size());
    // What the masks allow, token by token, from a fresh state after `done`.
    let by_masks = |done: &[u32], draft: &[u32]| {
        let mut c = g.start();
        for &t in done {
            c.commit(t).expect("commit");
        }
        let mut mask = TokenMask::forbid_all(tok.vocab_size());
        let mut n = 0;
        for &t in draft {
            c.fill_mask(&mut mask).expect("mask");
            if !mask.is_allowed(t) {
                break;
            }
            c.commit(t).expect("commit");
            n += 1;
        }
        n
    };
    let good = tok.encode(r#"{"name":"Ada Lovelace","age":36}"#).to_vec();
    let bad = tok
        .encode(r#"{"name":"Ada Lovelace","age":"thirty-six"}"#)
        .to_vec();
    let cut = good.iter().zip(&bad).take_while(|(a, b)| a == b).count();
    assert!(cut > 3 && cut < bad.len());
    for start in [0, 1, 4, cut - 1] {
        let mut c = g.start();
        for &t in &good[..start] {
            c.commit(t).expect("commit");
        }
        for draft in [&good[start..], &bad[start..]] {
            let want = by_masks(&good[..start], draft);
            assert_eq!(c.allowed_prefix(draft), want, "from token {start}");
            // Asking did not advance the state: the next mask is the one after `start`.
            c.fill_mask(&mut mask).expect("mask");
            assert!(mask.is_allowed(good[start]));
        }
        assert_eq!(c.allowed_prefix(&bad[start..]), cut - start);
        assert_eq!(c.allowed_prefix(&good[start..]), good.len() - start);
        // An id past the vocabulary ends the prefix; the matcher goes on.
        let mut odd = good[start..start + 2].to_vec();
        odd.extend([u32::MAX, good[start + 2]]);
        assert_eq!(c.allowed_prefix(&odd), 2);
        c.commit(good[start]).expect("the matcher still works");
    }
}

/// Samples up to `steps` tokens through `factory`'s constraint from logits that favour the
/// tokens that write numbers (digits most, then `.`, `e`, `E`, `-`, `+`; everything else
/// below), at temperature 1 with `seed`. The text, and whether it reached the end token.
fn number_loving_run(
    factory: &std::sync::Arc<dyn gpu_pipeline::ConstraintFactory>,
    seed: u64,
    steps: usize,
) -> (String, bool) {
    let (tok, _, eos) = grammars();
    let vocab = tok.vocab_size();
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 40) as f32 / (1u64 << 24) as f32
    };
    let logits: Vec<f32> = (0..vocab as u32)
        .map(|id| {
            let b = tok.token_bytes(id).unwrap_or_default();
            let number =
                !b.is_empty() && b.iter().all(|c| c.is_ascii_digit() || b".eE-+".contains(c));
            match b.first() {
                Some(c) if number && c.is_ascii_digit() => 12.0 + next(),
                Some(_) if number => 8.0 + next(),
                _ => next() * 4.0,
            }
        })
        .collect();
    let mut c = factory.start();
    let mut mask = TokenMask::forbid_all(vocab);
    let mut sampler = Sampler::new(
        SamplerConfig::default()
            .with_temperature(1.0)
            .with_seed(seed),
    );
    let mut out: Vec<u32> = Vec::new();
    for _ in 0..steps {
        c.fill_mask(&mut mask).expect("mask");
        let t = sampler
            .sample_masked(&logits, &out, 0, &mask)
            .expect("an allowed token");
        if t == *eos {
            return (tok.decode(&out).expect("decodes"), true);
        }
        c.commit(t)
            .expect("llguidance accepts the token its mask allowed");
        out.push(t);
    }
    (tok.decode(&out).expect("decodes"), false)
}

/// The digits of a JSON number literal: integer, fraction and exponent.
fn number_digits(literal: &str) -> (usize, usize, usize) {
    let count = |s: &str| s.bytes().filter(u8::is_ascii_digit).count();
    let (mantissa, exponent) = literal.split_once(['e', 'E']).unwrap_or((literal, ""));
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    (count(int), count(frac), count(exponent))
}

/// A JSON number without bounds ends within what a double holds (at most 20 integer, 20
/// fraction and 3 exponent digits, finite) however much the model wants digits, in a JSON
/// Schema output format and in a forced tool call's grammar; the same schema through a plain
/// Lark grammar (no bound) runs to the token limit inside the number, so the bound is what ends
/// it. Integers keep their 64-bit range (19 digits are still written).
#[test]
fn json_numbers_end_within_what_a_double_holds() {
    let (tok, grammars, _) = grammars();
    let number = serde_json::json!({
        "x-guidance": {"whitespace_flexible": false},
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
        "additionalProperties": false,
    });
    let call =
        token_stream::forced_call_grammar(token_stream::ToolSyntax::Hermes, &[("f", &number)]);
    let schema = grammars.json_schema(number.clone()).expect("schema");
    let tool = grammars.json_lark(&call).expect("tool call");
    for seed in 1..9u64 {
        for (name, factory) in [("schema", &schema), ("tool call", &tool)] {
            let (text, ended) = number_loving_run(factory, seed, 150);
            assert!(ended, "{name}, seed {seed}: no end in 150 tokens: {text:?}");
            let json = text
                .trim_start_matches("<tool_call>\n")
                .trim_end_matches("\n</tool_call>");
            let v: serde_json::Value = serde_json::from_str(json).expect(json);
            let x = if name == "schema" {
                &v["x"]
            } else {
                &v["arguments"]["x"]
            };
            assert!(x.as_f64().is_some_and(f64::is_finite), "{name}: {text}");
            let literal = json
                .rsplit_once("\"x\":")
                .expect("x")
                .1
                .trim_end_matches('}');
            let (int, frac, exp) = number_digits(literal);
            assert!(int <= 20 && frac <= 20 && exp <= 3, "{name}: {literal}");
        }
    }
    // Speculative drafts are cut where the bound refuses (the 21st digit), not before.
    let mut c = schema.start();
    for &t in tok.encode(&format!("{{\"x\":{}", "1".repeat(20))).iter() {
        c.commit(t).expect("commit");
    }
    let (one, close) = (tok.encode("1")[0], tok.encode("}")[0]);
    assert_eq!(c.allowed_prefix(&[close, one]), 1);
    assert_eq!(c.allowed_prefix(&[one, close]), 0);
    let unbounded = grammars
        .lark(&format!("start: %json {number}"))
        .expect("plain lark");
    assert!(
        (1..9u64).any(|seed| !number_loving_run(&unbounded, seed, 150).1),
        "without the bound some run should still be writing its number at 150 tokens"
    );
    let integer = grammars
        .json_schema(serde_json::json!({
            "x-guidance": {"whitespace_flexible": false},
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": false,
        }))
        .expect("integer schema");
    let longest = (1..9u64)
        .map(|seed| {
            let (text, ended) = number_loving_run(&integer, seed, 150);
            assert!(ended, "integer, seed {seed}: {text:?}");
            let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
            assert!(v["n"].is_i64(), "{text}");
            number_digits(text.rsplit_once(':').unwrap().1.trim_end_matches('}')).0
        })
        .max();
    assert_eq!(longest, Some(19), "64-bit integers are written whole");
}
