//! Constrained sampling never leaves the mask: for random logits (NaN and minus infinity
//! included), random masks, random sampling parameters and histories, `sample_masked` returns a
//! token the mask allows, or `None` exactly when no allowed token has a finite logit.

use gpu_pipeline::{Sampler, SamplingParams, TokenMask};
use proptest::prelude::*;

fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -20.0f32..20.0,
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::NAN),
        1 => Just(1.0e30f32),
    ]
}

fn params() -> impl Strategy<Value = SamplingParams> {
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
            SamplingParams::default()
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
