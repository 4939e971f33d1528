//! The SentencePiece-style (`tokenizer.ggml.model = llama`) path: round trips on llama.cpp's
//! `llama-spm` vocabulary, special tokens, end-of-generation ids, BOS/EOS, and typed errors for
//! malformed metadata. The exact ids against llama.cpp are checked by `tests/vocab_suite.rs`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use token_stream::{GgufVocab, LoadError, Tokenizer};
use weight_cache::Gguf;

fn suite_file(name: &str) -> PathBuf {
    let dir = std::env::var_os("ZEROLAYER_VOCAB_SUITE").map_or_else(
        || {
            let home = std::env::var_os("HOME").expect("HOME is set");
            Path::new(&home).join(".cache/zerolayer/llama-vocab-suite-0.3.36")
        },
        PathBuf::from,
    );
    assert!(
        dir.join(".complete").exists(),
        "llama.cpp's vocabulary suite is not at {}: run scripts/fetch-vocab-suite",
        dir.display()
    );
    dir.join(format!("ggml-vocab-{name}.gguf"))
}

fn load(name: &str) -> Tokenizer {
    // SAFETY: test process; nothing modifies the suite's files while they are mapped.
    let gguf = unsafe { Gguf::open(suite_file(name)) }.unwrap();
    assert_eq!(gguf.tensor_count(), 0, "a vocabulary-only GGUF");
    Tokenizer::from_gguf(&gguf).unwrap()
}

fn llama_spm() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| load("llama-spm"))
}

#[test]
fn llama_spm_known_ids_and_decode() {
    let t = llama_spm();
    // llama.cpp: " Hello world" -> ▁Hello ▁world (space prefix added).
    let ids = t.encode("Hello world");
    assert_eq!(ids.as_slice(), &[15043, 3186]);
    assert_eq!(t.decode(&ids).unwrap(), "Hello world");
    // A character without a token falls back to its UTF-8 bytes' <0xXX> tokens.
    let ids = t.encode("\u{1F999}");
    // (▁, then <0xF0> <0x9F> <0xA6> <0x99>; byte b is id 3 + b in this vocabulary.)
    let bytes: Vec<u32> = "\u{1F999}".bytes().map(|b| 3 + u32::from(b)).collect();
    assert_eq!(ids.as_slice()[0], 29871);
    assert_eq!(&ids.as_slice()[1..], bytes.as_slice());
    assert_eq!(t.decode(&ids).unwrap(), "\u{1F999}");
    // Plain encode never produces control tokens; encode_with_specials does.
    assert!(!t.encode("<s>hi</s>").as_slice().contains(&1));
    assert_eq!(t.encode_with_specials("<s>hi</s>").as_slice()[0], 1);
    assert_eq!(
        t.encode_with_specials("<s>hi</s>").as_slice().last(),
        Some(&2)
    );
}

#[test]
fn llama_spm_bos_eos_and_eog() {
    let t = llama_spm();
    assert_eq!((t.bos_id(), t.eos_id()), (Some(1), Some(2)));
    assert!(t.add_bos());
    assert!(!t.add_eos());
    let plain = t.encode("Hello");
    let for_model = t.encode_for_model("Hello");
    assert_eq!(for_model.as_slice()[0], 1);
    assert_eq!(&for_model.as_slice()[1..], plain.as_slice());
    assert!(t.is_eog(2));
    assert!(!t.is_eog(1));
    assert_eq!(t.eog_ids(), &[2]);
}

#[test]
fn phi3_user_defined_and_named_eog_tokens() {
    let t = load("phi-3");
    // phi-3 names <|end|> (32007) and <|endoftext|> (32000, also EOS) as ends of generation.
    assert!(t.is_eog(32000));
    assert!(t.is_eog(32007));
    assert!(!t.is_eog(1));
    // Control tokens are text in plain encode.
    assert!(!t.encode("<|end|>").as_slice().contains(&32007));
    assert!(
        t.encode_with_specials("<|end|>")
            .as_slice()
            .contains(&32007)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Every byte has a `<0xXX>` token in llama-spm, so every string survives a round trip.
    #[test]
    fn llama_spm_round_trip(s in any::<String>()) {
        let t = llama_spm();
        let ids = t.encode(&s);
        prop_assert_eq!(t.decode(&ids).unwrap(), s);
    }

    /// Mostly-ASCII text with runs of spaces and newlines (where ▁ merges matter).
    #[test]
    fn llama_spm_round_trip_spaces(s in "[ a-zA-Z\n\t.,é中]{0,64}") {
        let t = llama_spm();
        let ids = t.encode(&s);
        prop_assert_eq!(t.decode(&ids).unwrap(), s);
    }

    /// The encoder's shortcuts (words merged apart, the whole-word table, short words merged
    /// without the queue, pairs looked up by token ids) give llama.cpp's merge loop's ids.
    #[test]
    fn llama_spm_shortcuts_equal_the_plain_merge_loop(s in spm_text()) {
        let t = llama_spm();
        prop_assert_eq!(t.encode(&s).into_vec(), t.encode_merging_only(&s), "{:?}", s);
    }

    /// The same on any string (control characters, unassigned and astral characters).
    #[test]
    fn llama_spm_shortcuts_equal_the_plain_merge_loop_on_any_string(s in any::<String>()) {
        let t = llama_spm();
        prop_assert_eq!(t.encode(&s).into_vec(), t.encode_merging_only(&s), "{:?}", s);
    }
}

/// Text in runs of a few scripts, code punctuation and whitespace, so that words get long
/// (Han runs have no spaces) and merges cross characters of every length.
fn spm_text() -> impl Strategy<Value = String> {
    let run = prop_oneof![
        "[a-zA-Z]{1,30}",
        "[ \n\t]{1,6}",
        "[0-9]{1,8}",
        "[(){};,.*&|<>=+\\-]{1,6}",
        "[\u{4e00}-\u{9fff}，。]{1,80}",
        "[\u{3040}-\u{30ff}]{1,20}",
        "[éèàüöñçß]{1,8}",
        "[\u{1F300}-\u{1F64F}]{1,4}",
    ];
    proptest::collection::vec(run, 0..12).prop_map(|runs| runs.concat())
}

fn tiny<'a>(tokens: Vec<&'a str>, scores: Vec<f32>) -> GgufVocab<'a> {
    let n = tokens.len();
    let mut v = GgufVocab::new("llama", "default", tokens, vec![1; n], Vec::new());
    v.scores = scores;
    v
}

#[test]
fn malformed_spm_metadata_is_a_typed_error() {
    let toks = vec!["<unk>", "<s>", "</s>", "a"];
    // Scores missing.
    let err = Tokenizer::from_gguf_vocab(&tiny(toks.clone(), Vec::new())).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::MissingField {
                field: "tokenizer.ggml.scores"
            }
        ),
        "{err}"
    );
    // Scores of the wrong length.
    let err = Tokenizer::from_gguf_vocab(&tiny(toks.clone(), vec![0.0; 3])).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::ArrayLength {
                field: "tokenizer.ggml.scores",
                tokens: 4,
                found: 3
            }
        ),
        "{err}"
    );
    // Token types of the wrong length.
    let mut v = tiny(toks.clone(), vec![0.0; 4]);
    v.token_types = vec![1; 5];
    let err = Tokenizer::from_gguf_vocab(&v).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::ArrayLength {
                field: "tokenizer.ggml.token_type",
                tokens: 4,
                found: 5
            }
        ),
        "{err}"
    );
    // A special id out of range.
    let mut v = tiny(toks.clone(), vec![0.0; 4]);
    v.eos = Some(4);
    let err = Tokenizer::from_gguf_vocab(&v).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::SpecialIdOutOfRange {
                field: "tokenizer.ggml.eos_token_id",
                id: 4,
                vocab_size: 4
            }
        ),
        "{err}"
    );
    let mut v = tiny(toks.clone(), vec![0.0; 4]);
    v.unknown = Some(99);
    assert!(matches!(
        Tokenizer::from_gguf_vocab(&v).unwrap_err(),
        LoadError::SpecialIdOutOfRange {
            field: "tokenizer.ggml.unknown_token_id",
            ..
        }
    ));
    // Empty vocabulary.
    assert!(matches!(
        Tokenizer::from_gguf_vocab(&tiny(Vec::new(), Vec::new())).unwrap_err(),
        LoadError::EmptyVocabulary
    ));
    // Unknown and not implemented models.
    for model in ["rwkv", "plamo2", "no-such-model"] {
        let mut v = tiny(toks.clone(), vec![0.0; 4]);
        v.model = model;
        let err = Tokenizer::from_gguf_vocab(&v).unwrap_err();
        assert!(
            matches!(&err, LoadError::UnsupportedModel { model: m } if m == model),
            "{err}"
        );
    }
}

#[test]
fn tiny_spm_vocabulary_from_metadata() {
    // ▁ab scores highest, so " ab" is one token; "b▁" is not reachable before ▁ab forms.
    let toks = vec![
        "<unk>",
        "<s>",
        "</s>",
        "a",
        "b",
        "\u{2581}",
        "\u{2581}a",
        "\u{2581}ab",
    ];
    let mut v = tiny(toks, vec![0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -2.0, -0.5]);
    v.token_types = vec![2, 3, 3, 1, 1, 1, 1, 1];
    let t = Tokenizer::from_gguf_vocab(&v).unwrap();
    assert_eq!(t.encode("ab").as_slice(), &[7]);
    assert_eq!(t.encode("ab a").as_slice(), &[7, 6]);
    assert_eq!(t.decode(&[7, 6]).unwrap(), "ab a");
    // add_space_prefix = false: no leading ▁.
    v.add_space_prefix = Some(false);
    let t = Tokenizer::from_gguf_vocab(&v).unwrap();
    assert_eq!(t.encode("ab").as_slice(), &[3, 4]);
    assert_eq!(t.decode(&[5, 3]).unwrap(), " a");
    // 'c' has no token and no byte token: the unknown token.
    assert_eq!(t.encode("c").as_slice(), &[0]);
}

#[test]
fn wordpiece_and_unigram_add_what_llama_cpp_adds() {
    // bert-bge: [CLS] text [SEP]; lowercased, accents stripped.
    let t = load("bert-bge");
    let ids = t.encode_for_model("Héllo");
    assert_eq!(ids.as_slice().first(), Some(&101));
    assert_eq!(ids.as_slice().last(), Some(&102));
    assert_eq!(
        &ids.as_slice()[1..ids.len() - 1],
        t.encode("hello").as_slice()
    );
    // nomic-bert-moe (t5 / Unigram): add_bos_token and add_eos_token are both set.
    let t = load("nomic-bert-moe");
    let ids = t.encode_for_model("Hello");
    assert_eq!(ids.as_slice().first(), Some(&0));
    assert_eq!(ids.as_slice().last(), Some(&2));
    assert_eq!(
        &ids.as_slice()[1..ids.len() - 1],
        t.encode("Hello").as_slice()
    );
    assert_eq!(t.decode(&t.encode("Hello  world")).unwrap(), "Hello world");
}
