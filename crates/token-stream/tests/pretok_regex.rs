//! The hand-written scanners split exactly as the reference regexes (run by `fancy-regex`, the
//! engine tiktoken uses) on random and adversarial strings.

use fancy_regex::Regex;
use proptest::prelude::*;
use token_stream::Pretokenizer;

fn regex_split<'a>(re: &Regex, text: &'a str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut pos = 0;
    for m in re.find_iter(text) {
        let m = m.expect("regex runs");
        assert_eq!(m.start(), pos, "the pattern covers every character");
        out.push(m.as_str());
        pos = m.end();
    }
    assert_eq!(pos, text.len());
    out
}

/// HF's `Digits(individual_digits=true)` then the GPT-2 regex on each remaining segment.
fn smollm_reference<'a>(re: &Regex, text: &'a str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut seg = 0;
    for (i, c) in text.char_indices() {
        if c.is_numeric() {
            out.extend(regex_split(re, &text[seg..i]));
            out.push(&text[i..i + c.len_utf8()]);
            seg = i + c.len_utf8();
        }
    }
    out.extend(regex_split(re, &text[seg..]));
    out
}

fn check(kind: Pretokenizer, re: &Regex, text: &str) {
    let got: Vec<&str> = kind.split(text).collect();
    let want = if kind == Pretokenizer::SmolLm {
        smollm_reference(re, text)
    } else {
        regex_split(re, text)
    };
    assert_eq!(got, want, "{kind:?} on {text:?}");
}

const KINDS: [Pretokenizer; 4] = [
    Pretokenizer::Gpt2,
    Pretokenizer::SmolLm,
    Pretokenizer::Cl100k,
    Pretokenizer::O200k,
];

fn regexes() -> &'static [Regex] {
    static RES: std::sync::OnceLock<Vec<Regex>> = std::sync::OnceLock::new();
    RES.get_or_init(|| {
        KINDS
            .iter()
            .map(|k| Regex::new(k.pattern()).expect("pattern compiles"))
            .collect()
    })
}

/// Characters chosen to hit every class boundary of the patterns.
fn tricky_char() -> impl Strategy<Value = char> {
    prop_oneof![
        prop::sample::select(vec![
            ' ', ' ', '\t', '\n', '\r', '\u{a0}', '\u{3000}', '\u{85}', '\u{2028}', '\'', 's', 'S',
            't', 'r', 'e', 'v', 'm', 'l', 'L', 'd', 'D', 'ſ', 'a', 'Z', 'é', 'É', 'ǅ', 'ʰ', '中',
            'ـ', '\u{301}', '\u{64b}', '0', '7', '٣', '²', 'Ⅻ', '!', '/', '.', '(', '😀',
            '\u{200d}', '\u{0}', '\u{7f}', 'ß', 'Ω', 'ω', 'ا', 'ب', 'ग', '\u{93f}',
        ]),
        any::<char>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn scanners_equal_regexes(chars in prop::collection::vec(tricky_char(), 0..40)) {
        let text: String = chars.into_iter().collect();
        let res = regexes();
        for (k, re) in KINDS.iter().zip(res) {
            check(*k, re, &text);
        }
    }

    #[test]
    fn scanners_equal_regexes_any_string(text in any::<String>()) {
        let res = regexes();
        for (k, re) in KINDS.iter().zip(res) {
            check(*k, re, &text);
        }
    }
}

#[test]
fn scanners_equal_regexes_on_fixed_cases() {
    let res = regexes();
    let cases = [
        "Hello world",
        "I'm here, aren't you? 'S 'LL 'ſ",
        "  \t\n\n  x\r\n\r\ny",
        "HelloWORLDFoo bar'S ÉCOLEécole",
        "a\u{301}\u{301}b \u{301}x",
        "x//\n\n/",
        "1234567 ٣٤٥ ²³",
        "😀😀 👍🏽 a😀",
        "  ",
        " ",
        "",
        "\n",
        "\u{3000}a",
        "中文，测试。",
        "مرحبا بالعالم",
    ];
    for text in cases {
        for (k, re) in KINDS.iter().zip(res) {
            check(*k, re, text);
        }
    }
}

/// Every llama.cpp table entry with a hand-written scanner splits as its general regex path
/// (llama.cpp's regex semantics) does.
fn check_llama_entries(text: &str) {
    for entry in &token_stream::LLAMA_PRES {
        let pre = Pretokenizer::from_llama_name(entry.name()).expect("the entry's own name");
        let got: Vec<&str> = pre.split(text).collect();
        let want = pre.split_reference(text);
        assert_eq!(got, want, "{} on {text:?}", entry.name());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn llama_scanners_equal_llama_regexes(chars in prop::collection::vec(tricky_char(), 0..40)) {
        let text: String = chars.into_iter().collect();
        check_llama_entries(&text);
    }

    #[test]
    fn llama_scanners_equal_llama_regexes_any_string(text in any::<String>()) {
        check_llama_entries(&text);
    }
}

#[test]
fn llama_scanners_equal_llama_regexes_on_fixed_cases() {
    for text in [
        "Hello world",
        "I'm here, aren't you? 'S 'LL 'ſ 'Ve",
        "  \t\n\n  x\r\n\r\ny",
        "a\u{301}\u{301}b \u{301}x \u{64b}",
        "1234567 ٣٤٥ ²³ 3.14",
        "😀😀 👍🏽 a😀\u{200d}",
        "中文，测试。 日本語のテキスト",
        "\n\n\nabc\n \n",
        // U+16FF4: a number to recent Rust `char::is_numeric`, unassigned in the class tables
        // (and llama.cpp's): found by the proptest below.
        "\u{feff}\u{16FF4}sZ 1\u{16FF4}2",
        "",
    ] {
        check_llama_entries(text);
    }
}

/// Pieces the general path gives for a few llama.cpp pre-tokenizers, checked by hand against
/// llama.cpp's rules (so a broken general path cannot agree with itself).
#[test]
fn llama_general_path_examples() {
    let split = |name: &str, text: &'static str| {
        Pretokenizer::from_llama_name(name)
            .unwrap()
            .split_reference(text)
    };
    // default: punctuation runs, GPT-2's pattern, number runs, then threes of ASCII digits.
    assert_eq!(
        split("default", "Hi, you!! 12345"),
        ["Hi", ",", " you", "!!", " ", "123", "45"]
    );
    // falcon: like default without the `\p{N}+` stage, so threes of digits split off after
    // the space stays its own piece.
    assert_eq!(split("falcon", "x 12345"), ["x", " ", "123", "45"]);
    // Llama 3 with llama.cpp's ASCII contractions: 'ſ is not one.
    assert_eq!(split("llama-bpe", "a'ſ a's"), ["a", "'ſ", " a", "'s"]);
    // gpt-4o in llama.cpp: any non-ASCII letter counts as both cases, marks are not letters.
    assert_eq!(split("gpt-4o", "ÉCOLEx"), ["ÉCOLEx"]);
    // Gemma 4: runs of newlines and runs of the rest.
    assert_eq!(split("gemma4", "a b\n\nc"), ["a b", "\n\n", "c"]);
}
