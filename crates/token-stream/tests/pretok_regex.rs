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
