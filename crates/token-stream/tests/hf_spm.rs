//! SentencePiece-style `tokenizer.json` files (Llama 2, Mistral, Gemma, Phi-3 layouts) against HF
//! `tokenizers`: for llama.cpp's `llama-spm` and `phi-3` vocabularies converted by transformers'
//! `LlamaConverter`, in eight layouts (Prepend+Replace normalizer, with and without added tokens'
//! `lstrip`/`rstrip`; Gemma's Replace-only; `Metaspace` with each prepend scheme, and the legacy
//! `add_prefix_space` form that splits at every `▁`, also with `ignore_merges`), every text's ids
//! and decode equal HF's, and so does the decode of id sequences with invalid UTF-8.
//! Fixtures from `scripts/fixtures/token-stream-hf-spm.py`.

use std::io::Read;
use std::path::PathBuf;

use serde_json::Value;
use token_stream::{LoadError, Tokenizer};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf-spm")
        .join(name)
}

/// The converted `tokenizer.json` of `vocab` and HF's results for its layout variants.
fn load(vocab: &str) -> (Value, Value) {
    let gz = std::fs::read(fixture(&format!("{vocab}.tokenizer.json.gz"))).unwrap();
    let mut json = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut json)
        .unwrap();
    let expected = std::fs::read_to_string(fixture(&format!("{vocab}.expected.json"))).unwrap();
    (
        serde_json::from_str(&json).unwrap(),
        serde_json::from_str(&expected).unwrap(),
    )
}

/// The file of one layout variant: the converted file with the variant's keys replaced (`a.b`:
/// field `b` of `a`).
fn variant(base: &Value, keys: &Value) -> String {
    let mut doc = base.clone();
    for (k, v) in keys.as_object().unwrap() {
        let mut target = &mut doc;
        for part in k.split('.') {
            target = &mut target[part];
        }
        *target = v.clone();
    }
    doc.to_string()
}

fn check_vocab(vocab: &str) {
    let (base, expected) = load(vocab);
    let texts: Vec<&str> = expected["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let mut failures = Vec::new();
    for (name, v) in expected["variants"].as_object().unwrap() {
        let tok = Tokenizer::from_tokenizer_json(&variant(&base, &v["keys"]))
            .unwrap_or_else(|e| panic!("{vocab}/{name}: {e}"));
        let (ids, decoded) = (
            v["ids"].as_array().unwrap(),
            v["decoded"].as_array().unwrap(),
        );
        assert_eq!(ids.len(), texts.len());
        let mut same = 0;
        for (i, text) in texts.iter().enumerate() {
            let want: Vec<u32> = ids[i]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode_with_specials(text);
            let got_decoded = tok.decode(&want).unwrap();
            if got.as_slice() != want.as_slice() {
                failures.push(format!(
                    "{vocab}/{name} ids of {text:?}:\n  ours {:?}\n  HF   {want:?}",
                    got.as_slice()
                ));
            } else if got_decoded != decoded[i].as_str().unwrap() {
                failures.push(format!(
                    "{vocab}/{name} decode of {text:?}: ours {got_decoded:?}, HF {:?}",
                    decoded[i]
                ));
            } else {
                same += 1;
            }
        }
        eprintln!("{vocab}/{name}: {same}/{} texts identical", texts.len());
        // Sequences no text encodes to: invalid UTF-8 from byte tokens decodes as HF's
        // ByteFallback decoder does (one U+FFFD per byte token of an invalid run).
        let odd = expected["odd_ids"].as_array().unwrap();
        for (seq, want) in odd.iter().zip(v["odd_decoded"].as_array().unwrap()) {
            let seq: Vec<u32> = seq
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = tok.decode(&seq).unwrap();
            if got != want.as_str().unwrap() {
                failures.push(format!(
                    "{vocab}/{name} decode of {seq:?}: ours {got:?}, HF {want}"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures[..failures.len().min(10)].join("\n")
    );
}

#[test]
fn llama_spm_vocabulary_encodes_and_decodes_as_hf_in_every_layout() {
    check_vocab("llama-spm");
}

#[test]
fn phi3_vocabulary_encodes_and_decodes_as_hf_in_every_layout() {
    check_vocab("phi-3");
}

/// The converted Llama 2 layout file of the `llama-spm` vocabulary.
fn llama_json() -> Value {
    load("llama-spm").0
}

#[test]
fn template_post_processor_sets_bos_for_encode_for_model() {
    let mut doc = llama_json();
    doc["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    });
    let tok = Tokenizer::from_tokenizer_json(&doc.to_string()).unwrap();
    assert!(tok.add_bos());
    assert!(!tok.add_eos());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(
        tok.encode_for_model("Hello world").as_slice(),
        &[1, 15043, 3186]
    );
    assert_eq!(tok.decode(&[1, 15043, 3186]).unwrap(), "<s> Hello world");
    // Without a post-processor nothing is added.
    let plain = Tokenizer::from_tokenizer_json(&llama_json().to_string()).unwrap();
    assert!(!plain.add_bos());
    assert_eq!(
        plain.encode_for_model("Hello world").as_slice(),
        &[15043, 3186]
    );
}

#[test]
fn plain_encode_keeps_special_token_text_as_text() {
    let tok = Tokenizer::from_tokenizer_json(&llama_json().to_string()).unwrap();
    assert_eq!(tok.encode_with_specials("<s>").as_slice(), &[1]);
    assert!(!tok.encode("<s>").as_slice().contains(&1));
    assert_eq!(tok.decode(&tok.encode("a <s> b")).unwrap(), "a <s> b");
}

#[test]
fn unsupported_layouts_are_typed_errors_naming_the_part() {
    let err = |doc: &Value| Tokenizer::from_tokenizer_json(&doc.to_string()).unwrap_err();
    let mut doc = llama_json();
    doc["model"]["type"] = "Unigram".into();
    assert!(matches!(err(&doc), LoadError::UnsupportedModel { model } if model == "Unigram"));

    let mut doc = llama_json();
    doc["normalizer"] = serde_json::json!({"type": "NFKC"});
    assert!(
        matches!(err(&doc), LoadError::UnsupportedNormalizer { kind } if kind.contains("NFKC"))
    );

    let mut doc = llama_json();
    doc["normalizer"] = Value::Null;
    doc["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
    assert!(
        matches!(err(&doc), LoadError::UnsupportedPretokenizer { name } if name.contains("Whitespace"))
    );

    let mut doc = llama_json();
    doc["decoder"] = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}"});
    assert!(
        matches!(err(&doc), LoadError::UnsupportedDecoder { kind } if kind.contains("Metaspace"))
    );

    let mut doc = llama_json();
    doc["added_tokens"][0]["single_word"] = true.into();
    assert!(matches!(
        err(&doc),
        LoadError::UnsupportedAddedToken {
            option: "single_word",
            ..
        }
    ));

    let mut doc = llama_json();
    doc["added_tokens"][0]["normalized"] = true.into();
    assert!(matches!(
        err(&doc),
        LoadError::UnsupportedAddedToken { content, .. } if content == "<s>"
    ));
}
