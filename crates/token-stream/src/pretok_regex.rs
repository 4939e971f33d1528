//! The general split path: a [`LlamaPreEntry`]'s regexes run the way llama.cpp's
//! `unicode_regex_split` runs them, with `fancy-regex` as the engine.
//!
//! llama.cpp's semantics, reproduced here:
//! - the regexes apply in sequence; each one splits every piece left by the previous one on its
//!   own (lookarounds and `$` do not see past the piece), and the text between two matches stays
//!   a piece of its own;
//! - a regex naming a Unicode category (`\p{N}`, `\p{L}`, `\p{P}`, `\p{M}`, `\p{S}`, `\p{Lu}`,
//!   ...) runs on a "collapsed" text where every non-ASCII character is replaced by one stand-in
//!   per category (whitespace by `\x0B`; all letter categories are one: `\p{Lu}` means any
//!   letter), and each `\p{..}` becomes its stand-in plus the ASCII members of the category;
//! - any other regex runs on the code points, with non-ASCII whitespace replaced by `\x0B`;
//! - `\d` is ECMAScript's `[0-9]`.
//!
//! The compiled regexes live in the entry (`OnceLock`), so they are built once per process.

use fancy_regex::Regex;

use crate::pretok_table::LlamaPreEntry;
use crate::unicode::{ClassTable, LETTER, MARK, NUMBER, PUNCT, SPACE, SYMBOL, table};

/// One compiled regex of an entry.
#[derive(Debug)]
pub(crate) struct CompiledStage {
    /// `None` when the translated regex does not compile (a table bug, caught by unit tests);
    /// such a stage leaves the pieces as they are.
    regex: Option<Regex>,
    collapsed: bool,
}

/// Stand-ins for the non-ASCII members of each category in collapsed text (private use area).
const OTHER_STANDIN: char = '\u{E0D0}';
const CATEGORIES: [(&str, u8, char, &str); 10] = [
    (r"\p{N}", NUMBER, '\u{E0D1}', "0-9"),
    (r"\p{L}", LETTER, '\u{E0D2}', "A-Za-z"),
    (r"\p{P}", PUNCT, '\u{E0D3}', r"!-#%-*,-/:-;?-@\[-\]_\{\}"),
    (r"\p{M}", MARK, '\u{E0D4}', ""),
    (r"\p{S}", SYMBOL, '\u{E0D5}', r"\$\+<->\^`\|~"),
    (r"\p{Lu}", LETTER, '\u{E0D2}', "A-Za-z"),
    (r"\p{Ll}", LETTER, '\u{E0D2}', "A-Za-z"),
    (r"\p{Lt}", LETTER, '\u{E0D2}', "A-Za-z"),
    (r"\p{Lm}", LETTER, '\u{E0D2}', "A-Za-z"),
    (r"\p{Lo}", LETTER, '\u{E0D2}', "A-Za-z"),
];

/// Translates one of llama.cpp's regexes to the `fancy-regex` regex that selects the same
/// pieces on the mapped text; the flag says whether the text is collapsed.
pub(crate) fn translate(regex: &str) -> (String, bool) {
    let collapsed = CATEGORIES.iter().any(|(p, ..)| regex.contains(p));
    let mut out = String::with_capacity(regex.len() * 2);
    let mut inside = false;
    let mut prev = '\0';
    let mut rest = regex;
    while let Some(c) = rest.chars().next() {
        if c == '[' && prev != '\\' {
            inside = true;
        } else if inside && c == ']' && prev != '\\' {
            inside = false;
        }
        if c == '\\' && prev != '\\' {
            if rest.starts_with(r"\d") {
                out.push_str(if inside { "0-9" } else { "[0-9]" });
                rest = &rest[2..];
                prev = 'd';
                continue;
            }
            if collapsed
                && let Some(&(p, _, standin, ascii)) =
                    CATEGORIES.iter().find(|(p, ..)| rest.starts_with(p))
            {
                if !inside {
                    out.push('[');
                }
                out.push(standin);
                out.push_str(ascii);
                if !inside {
                    out.push(']');
                }
                rest = &rest[p.len()..];
                prev = '}';
                continue;
            }
        }
        out.push(c);
        // An escaped backslash does not escape what follows it.
        prev = if c == '\\' && prev == '\\' { '\0' } else { c };
        rest = &rest[c.len_utf8()..];
    }
    (out, collapsed)
}

/// The character `c` stands for in the text a stage's regex runs on.
#[inline]
fn mapped(t: &ClassTable, c: char, collapsed: bool) -> char {
    if c.is_ascii() {
        return c;
    }
    let k = t.of(c as u32);
    if k & SPACE != 0 {
        return '\x0B';
    }
    if !collapsed {
        return c;
    }
    CATEGORIES[..5]
        .iter()
        .find(|(_, bit, ..)| k & bit != 0)
        .map_or(OTHER_STANDIN, |&(_, _, standin, _)| standin)
}

impl LlamaPreEntry {
    pub(crate) fn stages(&self) -> &[CompiledStage] {
        self.compiled.get_or_init(|| {
            self.regexes
                .iter()
                .map(|r| {
                    let (translated, collapsed) = translate(r);
                    CompiledStage {
                        regex: Regex::new(&translated).ok(),
                        collapsed,
                    }
                })
                .collect()
        })
    }
}

/// Splits `text` as llama.cpp does with `entry`'s regexes: fills `ends` with the end offset of
/// every piece (in order; the last is `text.len()` when `text` is not empty). `scratch` and
/// `buf` are working space.
pub(crate) fn split_general(
    entry: &LlamaPreEntry,
    text: &str,
    ends: &mut Vec<usize>,
    scratch: &mut Vec<usize>,
    buf: &mut String,
) {
    ends.clear();
    if text.is_empty() {
        return;
    }
    ends.push(text.len());
    let t = table();
    for stage in entry.stages() {
        let Some(re) = &stage.regex else { continue };
        scratch.clear();
        let mut start = 0;
        for &end in ends.iter() {
            split_segment(t, re, stage.collapsed, text, start, end, scratch, buf);
            start = end;
        }
        std::mem::swap(ends, scratch);
    }
}

#[allow(clippy::too_many_arguments)]
fn split_segment(
    t: &ClassTable,
    re: &Regex,
    collapsed: bool,
    text: &str,
    start: usize,
    end: usize,
    out: &mut Vec<usize>,
    buf: &mut String,
) {
    buf.clear();
    buf.extend(text[start..end].chars().map(|c| mapped(t, c, collapsed)));
    // Walks the original and the mapped text together (matches come in order).
    let mut orig = start;
    let mut map_pos = 0;
    let mut to_orig = |target: usize| -> usize {
        while map_pos < target {
            let c = text[orig..].chars().next().expect("inside the segment");
            map_pos += mapped(t, c, collapsed).len_utf8();
            orig += c.len_utf8();
        }
        orig
    };
    let mut prev = start;
    for m in re.find_iter(buf) {
        // A regex that gives up (backtrack limit) leaves the rest of the segment one piece.
        let Ok(m) = m else { break };
        let match_start = to_orig(m.start());
        let match_end = to_orig(m.end());
        if match_start > prev {
            out.push(match_start);
        }
        if match_end > match_start {
            out.push(match_end);
        }
        prev = prev.max(match_end);
    }
    if prev < end {
        out.push(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pretok_table::LLAMA_PRES;

    #[test]
    fn every_table_regex_compiles() {
        for e in &LLAMA_PRES {
            for (r, s) in e.regexes.iter().zip(e.stages()) {
                assert!(
                    s.regex.is_some(),
                    "{:?}: {r} -> {:?}",
                    e.names,
                    translate(r)
                );
            }
        }
    }

    #[test]
    fn translation_follows_llama_cpp() {
        assert_eq!(
            translate(r"\s?\p{L}+"),
            ("\\s?[\u{E0D2}A-Za-z]+".to_owned(), true)
        );
        assert_eq!(
            translate(r"[^\s\p{L}\p{N}]+"),
            ("[^\\s\u{E0D2}A-Za-z\u{E0D1}0-9]+".to_owned(), true)
        );
        assert_eq!(
            translate(r"(?=(\d{3})+(?!\d))"),
            ("(?=([0-9]{3})+(?![0-9]))".to_owned(), false)
        );
        assert_eq!(translate("[\r\n]"), ("[\r\n]".to_owned(), false));
    }

    fn pieces<'a>(name: &str, text: &'a str) -> Vec<&'a str> {
        let e = crate::pretok_table::find(name).unwrap();
        let (mut ends, mut scratch, mut buf) = (Vec::new(), Vec::new(), String::new());
        split_general(e, text, &mut ends, &mut scratch, &mut buf);
        let mut start = 0;
        ends.iter()
            .map(|&end| {
                let p = &text[start..end];
                start = end;
                p
            })
            .collect()
    }

    #[test]
    fn default_splits_like_llama_cpp() {
        // Punctuation runs first, then GPT-2's pattern, then number runs cut in threes.
        assert_eq!(
            pieces("default", "Hello, world!! 12345 é+"),
            ["Hello", ",", " world", "!!", " ", "123", "45", " é", "+"]
        );
        // Unmatched text between matches stays a piece: a lone space before a tab.
        assert_eq!(pieces("gpt-2", "a \tb"), ["a", " ", "\t", "b"]);
    }

    #[test]
    fn deepseek_coder_splits_cjk_and_digits() {
        assert_eq!(
            pieces("deepseek-coder", "ab 中文12\nx"),
            ["ab", " ", "中文", "1", "2", "\n", "x"]
        );
    }
}
