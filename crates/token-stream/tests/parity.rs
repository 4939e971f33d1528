//! Exact parity with the reference tokenizers on every line of the parity corpus:
//! HF `tokenizers` for SmolLM2 (default model), `tiktoken-rs` for cl100k_base and o200k_base.

mod common;

use common::*;
use token_stream::Tokenizer;

fn report(name: &str, fails: &[(usize, String, Vec<u32>, Vec<u32>)], total: usize) {
    for (i, text, got, want) in fails.iter().take(5) {
        eprintln!("{name} line {i}: {text:?}\n  ours: {got:?}\n  ref:  {want:?}");
    }
    assert!(
        fails.is_empty(),
        "{name}: {} of {total} lines differ",
        fails.len()
    );
}

#[test]
fn smollm2_matches_hf_tokenizers() {
    let ours = smollm();
    let mut hf = hf_smollm().clone();
    let mut lines = corpus();
    lines.extend(pathological(100_000));
    let mut fails = Vec::new();
    for (i, text) in lines.iter().enumerate() {
        // HF's default encode parses special-token text: compare with encode_with_specials.
        let want = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let got = ours.encode_with_specials(text).into_vec();
        if got != want {
            fails.push((i, text.clone(), got, want));
        }
    }
    report("SmolLM2 (specials parsed)", &fails, lines.len());
    // Plain mode: HF with encode_special_tokens=true treats special-token text as text.
    hf.set_encode_special_tokens(true);
    let mut fails = Vec::new();
    for (i, text) in lines.iter().enumerate() {
        let want = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let got = ours.encode(text).into_vec();
        if got != want {
            fails.push((i, text.clone(), got, want));
        }
    }
    report("SmolLM2 (plain)", &fails, lines.len());
}

#[test]
fn tokenizer_json_loader_matches_gguf_loader() {
    let from_json = Tokenizer::from_tokenizer_json(&smollm_tokenizer_json()).unwrap();
    let ours = smollm();
    for text in corpus().iter().step_by(3) {
        assert_eq!(
            from_json.encode_with_specials(text),
            ours.encode_with_specials(text),
            "{text:?}"
        );
    }
}

fn tiktoken_parity(name: &str, ours: &Tokenizer, reference: &tiktoken_rs::CoreBPE) {
    let mut lines = corpus();
    // tiktoken's merge loop is quadratic per piece, so its pathological inputs stay smaller.
    lines.extend(pathological(8_000));
    let mut fails = Vec::new();
    for (i, text) in lines.iter().enumerate() {
        let want = reference.encode_ordinary(text);
        let got = ours.encode(text).into_vec();
        if got != want {
            fails.push((i, text.clone(), got, want));
        }
        let want = reference.encode_with_special_tokens(text);
        let got = ours.encode_with_specials(text).into_vec();
        if got != want {
            fails.push((i, text.clone(), got, want));
        }
    }
    report(name, &fails, lines.len());
}

#[test]
fn cl100k_matches_tiktoken() {
    tiktoken_parity(
        "cl100k_base",
        cl100k(),
        &tiktoken_rs::cl100k_base().unwrap(),
    );
}

#[test]
fn o200k_matches_tiktoken() {
    tiktoken_parity("o200k_base", o200k(), &tiktoken_rs::o200k_base().unwrap());
}

#[test]
fn large_pathological_inputs_match_bpe_openai() {
    // 100 KB of one character: tiktoken-rs is quadratic here, bpe-openai is not.
    for text in pathological(100_000) {
        assert_eq!(
            cl100k().encode(&text).into_vec(),
            bpe_openai::cl100k_base().encode(&text),
            "{:?}...",
            &text[..8]
        );
    }
}
