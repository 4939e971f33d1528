//! The backtracking encoder (long non-ASCII pieces of byte-level vocabularies; here also every
//! piece) against the merge loop it replaces, on SmolLM2 (HF merge ranks), cl100k_base and o200k_base (tiktoken ranks): the same
//! ids for random ASCII, CJK, mixed and emoji text, for the bench corpus, and for repetitive
//! pieces that make it back up.

mod common;

use common::*;
use proptest::prelude::*;
use token_stream::Tokenizer;

fn vocabularies() -> [(&'static str, &'static Tokenizer); 3] {
    [
        ("smollm", smollm()),
        ("cl100k", cl100k()),
        ("o200k", o200k()),
    ]
}

fn assert_same(s: &str) -> Result<(), TestCaseError> {
    for (name, t) in vocabularies() {
        prop_assert!(t.backtracks(), "{} should backtrack", name);
        let want = t.encode_merging_only(s);
        let everywhere = t.encode_backtracking_everywhere(s);
        prop_assert_eq!(&everywhere, &want, "{} on {:?} (every piece)", name, s);
        let got = t.encode(s).into_vec();
        prop_assert_eq!(got, want, "{} on {:?}", name, s);
    }
    Ok(())
}

/// Text drawn from a few scripts, in runs (so Han and Latin pieces get long).
fn mixed() -> impl Strategy<Value = String> {
    let run = prop_oneof![
        "[a-zA-Z]{1,40}",
        "[ \n\t]{1,4}",
        "[0-9]{1,8}",
        "[\u{4e00}-\u{9fff}]{1,60}",
        "[\u{3040}-\u{30ff}]{1,20}",
        "[\u{ac00}-\u{d7a3}]{1,20}",
        "[\u{1f300}-\u{1faff}]{1,10}",
        "[，。！？、：；（）]{1,3}",
        "[àéîõüßçñ]{1,10}",
        "[\u{0400}-\u{04ff}]{1,30}",
    ];
    prop::collection::vec(run, 1..12).prop_map(|runs| runs.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn backtracking_equals_merging_on_ascii(s in "[ -~\n]{0,200}") {
        assert_same(&s)?;
    }

    #[test]
    fn backtracking_equals_merging_on_cjk(s in "[\u{4e00}-\u{9fff}\u{3000}-\u{303f}\u{ff00}-\u{ffef}]{0,120}") {
        assert_same(&s)?;
    }

    #[test]
    fn backtracking_equals_merging_on_mixed_scripts(s in mixed()) {
        assert_same(&s)?;
    }

    #[test]
    fn backtracking_equals_merging_on_emoji(s in "[\u{1f300}-\u{1faff}\u{200d}\u{fe0f} a]{0,60}") {
        assert_same(&s)?;
    }

    #[test]
    fn backtracking_equals_merging_on_any_string(s in any::<String>()) {
        assert_same(&s)?;
    }

    /// Few distinct characters repeated: long pieces whose tokens overlap in many ways.
    #[test]
    fn backtracking_equals_merging_on_repetitive_pieces(
        parts in prop::collection::vec(prop::sample::select(vec![
            "a", "aa", "ab", "b", "ing", "的", "是", "中文", "一", "😀", "é", "0", " ", "x"]), 1..80)
    ) {
        assert_same(&parts.concat())?;
    }
}

#[test]
fn backtracking_equals_merging_on_the_corpus() {
    for line in corpus().iter().chain(&pathological(4096)) {
        assert_same(line).unwrap();
    }
}

#[test]
fn backtracking_equals_merging_on_the_bench_corpus_if_present() {
    let dir = std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
        .join(".cache/zerolayer/corpus");
    for part in ["zh", "prose", "code"] {
        let Ok(text) = std::fs::read_to_string(dir.join(format!("{part}.txt"))) else {
            eprintln!("no bench corpus part {part}; skipped");
            continue;
        };
        // The first 200 KB: enough pieces of every kind, a few seconds in a debug build.
        let mut end = text.len().min(200_000);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        for doc in text[..end].split_inclusive('\n') {
            assert_same(doc).unwrap();
        }
    }
}
