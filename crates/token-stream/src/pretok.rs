//! Hand-written pre-tokenizers: each one splits text exactly as its reference regex does
//! (leftmost-first alternation with backtracking), without a regex engine on the hot path.
//!
//! Equality with the regexes is checked by the parity corpus and by proptests against
//! `fancy-regex` (see `tests/pretok_regex.rs`).

use crate::pretok_regex::split_general;
use crate::pretok_table::{self, LlamaPreEntry, Scan};
use crate::unicode::{
    ClassTable, LETTER, LOWERISH, MARK, NUMBER, SPACE, UPPERISH, decode_at, table,
};

/// How text is cut into pieces before byte-pair merging.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pretokenizer {
    /// GPT-2's pattern (HF `ByteLevel` with `use_regex`):
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// SmolLM2 (`tokenizer.ggml.pre = smollm`): every numeric character (`char::is_numeric`,
    /// HF `Digits(individual_digits=true)`) is split off on its own, then GPT-2's pattern runs on
    /// the text between them.
    SmolLm,
    /// Llama 3 and cl100k_base (the two patterns select identical pieces):
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
    Cl100k,
    /// o200k_base (see [`Pretokenizer::pattern`]).
    O200k,
    /// A llama.cpp pre-tokenizer (`tokenizer.ggml.pre`), split exactly as llama.cpp splits it.
    Llama(LlamaPre),
}

/// A llama.cpp BPE pre-tokenizer: a handle on its [`LlamaPreEntry`] in
/// [`LLAMA_PRES`](crate::LLAMA_PRES).
#[derive(Clone, Copy)]
pub struct LlamaPre(&'static LlamaPreEntry);

impl LlamaPre {
    /// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` value `name`, if it knows it
    /// and this crate implements it (see [`UNIMPLEMENTED_LLAMA_PRES`](crate::UNIMPLEMENTED_LLAMA_PRES)).
    pub fn from_name(name: &str) -> Option<Self> {
        pretok_table::find(name).map(Self)
    }

    /// llama.cpp's `default` pre-tokenizer (also its choice when `tokenizer.ggml.pre` is missing).
    pub fn llama_default() -> Self {
        Self(pretok_table::default_entry())
    }

    /// The table entry: names, regexes and flags.
    pub fn entry(self) -> &'static LlamaPreEntry {
        self.0
    }
}

impl PartialEq for LlamaPre {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for LlamaPre {}

impl std::hash::Hash for LlamaPre {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.name().hash(state);
    }
}

impl std::fmt::Debug for LlamaPre {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LlamaPre({:?})", self.0.name())
    }
}

const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const CL100K_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

impl Pretokenizer {
    /// The reference regex this scanner implements (for [`Pretokenizer::SmolLm`], the GPT-2
    /// pattern that runs after the numeric split; for [`Pretokenizer::Llama`], the last of the
    /// entry's regexes, see [`LlamaPreEntry::regexes`] for all of them).
    pub fn pattern(self) -> &'static str {
        match self {
            Self::Gpt2 | Self::SmolLm => GPT2_PATTERN,
            Self::Cl100k => CL100K_PATTERN,
            Self::O200k => O200K_PATTERN,
            Self::Llama(p) => p.0.regexes.last().copied().unwrap_or(""),
        }
    }

    /// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` value `name`.
    pub fn from_llama_name(name: &str) -> Option<Self> {
        LlamaPre::from_name(name).map(Self::Llama)
    }

    /// The llama.cpp table entry, for [`Pretokenizer::Llama`].
    pub fn llama_entry(self) -> Option<&'static LlamaPreEntry> {
        match self {
            Self::Llama(p) => Some(p.0),
            _ => None,
        }
    }

    /// Whether `' '` is replaced by `'▁'` (U+2581) before splitting (llama.cpp's
    /// `escape_whitespaces`, Gemma 4).
    pub fn escapes_whitespace(self) -> bool {
        self.llama_entry().is_some_and(|e| e.escape_whitespace)
    }

    /// Whether tokens are GPT-2 byte-level strings (`false`: raw UTF-8, merged per character).
    pub fn byte_encoded(self) -> bool {
        self.llama_entry().is_none_or(|e| e.byte_encode)
    }

    /// The hand-written scanner for this pre-tokenizer, if it has one.
    pub(crate) fn scan(self) -> Option<Scan> {
        match self {
            Self::Gpt2 => Some(Scan::Gpt2),
            Self::SmolLm => Some(Scan::SmolLm),
            Self::Cl100k => Some(Scan::Cl100k),
            Self::O200k => Some(Scan::O200k),
            Self::Llama(p) => p.0.fast,
        }
    }

    /// Splits `text` into pieces; concatenated, the pieces give back `text`.
    ///
    /// ```
    /// use token_stream::Pretokenizer;
    /// let pieces: Vec<&str> = Pretokenizer::SmolLm.split("I've 42 cats").collect();
    /// assert_eq!(pieces, ["I", "'ve", " ", "4", "2", " cats"]);
    /// ```
    pub fn split(self, text: &str) -> Pieces<'_> {
        let mut pieces = Pieces {
            scan: self.scan(),
            text,
            pos: 0,
            seg_end: 0,
            table: table(),
            ends: Vec::new(),
            next_end: 0,
        };
        if let (None, Self::Llama(p)) = (pieces.scan, self) {
            let mut scratch = Vec::new();
            let mut buf = String::new();
            split_general(p.0, text, &mut pieces.ends, &mut scratch, &mut buf);
        }
        pieces
    }

    /// Splits `text` through the general regex path even when a hand-written scanner exists
    /// (for [`Pretokenizer::Llama`]; the others split as [`Pretokenizer::split`]). The two
    /// agree; this is the reference the scanners are tested against.
    #[doc(hidden)]
    pub fn split_reference(self, text: &str) -> Vec<&str> {
        let Self::Llama(p) = self else {
            return self.split(text).collect();
        };
        let (mut ends, mut scratch, mut buf) = (Vec::new(), Vec::new(), String::new());
        split_general(p.0, text, &mut ends, &mut scratch, &mut buf);
        let mut start = 0;
        ends.iter()
            .map(|&end| {
                let piece = &text[start..end];
                start = end;
                piece
            })
            .collect()
    }
}

/// Iterator over the pieces of a text, from [`Pretokenizer::split`].
#[derive(Clone)]
pub struct Pieces<'a> {
    /// The scanner, or `None` for the general path (pieces precomputed in `ends`).
    scan: Option<Scan>,
    text: &'a str,
    pos: usize,
    /// SmolLm: end of the current numeric-free segment (valid while `pos < seg_end`).
    seg_end: usize,
    table: &'static ClassTable,
    /// General path: the end offset of every piece.
    ends: Vec<usize>,
    next_end: usize,
}

impl std::fmt::Debug for Pieces<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pieces")
            .field("scan", &self.scan)
            .field("pos", &self.pos)
            .finish_non_exhaustive()
    }
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a str;

    #[inline]
    fn next(&mut self) -> Option<&'a str> {
        let s = self.text.as_bytes();
        let i = self.pos;
        if i >= s.len() {
            return None;
        }
        let t = self.table;
        let Some(scan) = self.scan else {
            let end = *self.ends.get(self.next_end)?;
            self.next_end += 1;
            self.pos = end;
            return Some(&self.text[i..end]);
        };
        let end = match scan {
            Scan::Gpt2 => gpt2_next(t, s, i, s.len()),
            Scan::SmolLm | Scan::Starcoder => {
                // HF's Digits asks Rust's `char::is_numeric`; llama.cpp its own tables.
                let table = scan == Scan::Starcoder;
                if i >= self.seg_end {
                    let (c, l) = decode_at(s, i);
                    if is_numeric(t, c, table) {
                        self.pos = i + l;
                        return Some(&self.text[i..i + l]);
                    }
                    self.seg_end = next_numeric(t, s, i + l, table);
                }
                gpt2_next(t, s, i, self.seg_end)
            }
            Scan::Cl100k => cl_next::<3, true, false>(t, s, i),
            Scan::O200k => o200k_next(t, s, i),
            Scan::Llama3 => cl_next::<3, false, false>(t, s, i),
            Scan::Qwen2 => cl_next::<1, false, false>(t, s, i),
            Scan::Qwen35 => cl_next::<1, false, true>(t, s, i),
            Scan::Newlines => newline_run(s, i),
        };
        self.pos = end;
        Some(&self.text[i..end])
    }
}

/// `[^\n]+|[\n]+` from `i`.
#[inline]
fn newline_run(s: &[u8], i: usize) -> usize {
    let newline = s[i] == b'\n';
    let mut j = i + 1;
    while j < s.len() && (s[j] == b'\n') == newline {
        j += 1;
    }
    j
}

#[inline(always)]
fn is_numeric(t: &ClassTable, c: u32, table: bool) -> bool {
    if c < 128 {
        (b'0' as u32..=b'9' as u32).contains(&c)
    } else if table {
        t.of(c) & NUMBER != 0
    } else {
        char::from_u32(c).is_some_and(char::is_numeric)
    }
}

/// Position of the first numeric character at or after `i` (or `s.len()`).
fn next_numeric(t: &ClassTable, s: &[u8], mut i: usize, table: bool) -> usize {
    while i < s.len() {
        let b = s[i];
        if b < 0x80 {
            if b.is_ascii_digit() {
                return i;
            }
            i += 1;
        } else {
            let (c, l) = decode_at(s, i);
            if is_numeric(t, c, table) {
                return i;
            }
            i += l;
        }
    }
    s.len()
}

/// Length of a contraction suffix (`s t re ve m ll d`) right after an apostrophe at `i`, if any
/// (`long_s`: with `case_insensitive`, `'ſ` counts too, as `(?i:'s)` matches it; llama.cpp's
/// ASCII `'[sS]` does not).
#[inline]
fn contraction(
    s: &[u8],
    i: usize,
    end: usize,
    case_insensitive: bool,
    long_s: bool,
) -> Option<usize> {
    if i >= end || s[i] != b'\'' {
        return None;
    }
    let at = |k: usize| -> u8 {
        if i + k < end {
            let b = s[i + k];
            if case_insensitive {
                b.to_ascii_lowercase()
            } else {
                b
            }
        } else {
            0
        }
    };
    match at(1) {
        b's' | b't' | b'm' | b'd' => Some(2),
        b'r' | b'v' if at(2) == b'e' => Some(3),
        b'l' if at(2) == b'l' => Some(3),
        // U+017F LATIN SMALL LETTER LONG S case-folds to 's'.
        0xC5 if case_insensitive
            && long_s
            && i + 2 < end
            && s[i + 1] == 0xC5
            && s[i + 2] == 0xBF =>
        {
            Some(3)
        }
        _ => None,
    }
}

/// End of the run of characters starting at `i` (bounded by `end`) whose class satisfies `f`.
#[inline(always)]
fn run(t: &ClassTable, s: &[u8], mut i: usize, end: usize, f: impl Fn(u8) -> bool) -> usize {
    while i < end {
        let (c, l) = decode_at(s, i);
        if !f(t.of(c)) {
            break;
        }
        i += l;
    }
    i
}

#[inline(always)]
fn is_other(k: u8) -> bool {
    k & (LETTER | NUMBER | SPACE) == 0
}

/// `[^\s\p{L}\p{M}\p{N}]` (Qwen3.5's other class).
#[inline(always)]
fn is_other_or_mark(k: u8) -> bool {
    k & (LETTER | MARK | NUMBER | SPACE) == 0
}

/// The `\s+(?!\S)|\s+` tail shared by all patterns, for a whitespace run `[i, j)` with its last
/// character starting at `last`.
#[inline(always)]
fn space_tail(i: usize, j: usize, last: usize, end: usize) -> usize {
    if j >= end || last == i { j } else { last }
}

/// Whitespace run from `i`: (end, start of last char, position after the last `\r`/`\n`).
#[inline(always)]
fn space_run(t: &ClassTable, s: &[u8], i: usize, end: usize) -> (usize, usize, Option<usize>) {
    let mut j = i;
    let mut last = i;
    let mut nl = None;
    while j < end {
        let (c, l) = decode_at(s, j);
        if t.of(c) & SPACE == 0 {
            break;
        }
        if c == u32::from(b'\n') || c == u32::from(b'\r') {
            nl = Some(j + l);
        }
        last = j;
        j += l;
    }
    (j, last, nl)
}

fn gpt2_next(t: &ClassTable, s: &[u8], i: usize, end: usize) -> usize {
    if let Some(n) = contraction(s, i, end, false, false) {
        return i + n;
    }
    let (c, l) = decode_at(s, i);
    let mut k = t.of(c);
    let mut start = i;
    if c == u32::from(b' ') && i + 1 < end {
        let (c2, l2) = decode_at(s, i + 1);
        let k2 = t.of(c2);
        if k2 & SPACE == 0 {
            k = k2;
            start = i + 1 + l2;
            return gpt2_class_run(t, s, start, end, k);
        }
    }
    if k & SPACE != 0 {
        let (j, last, _) = space_run(t, s, i, end);
        return space_tail(i, j, last, end);
    }
    start += l;
    gpt2_class_run(t, s, start, end, k)
}

#[inline(always)]
fn gpt2_class_run(t: &ClassTable, s: &[u8], from: usize, end: usize, k: u8) -> usize {
    if k & LETTER != 0 {
        run(t, s, from, end, |x| x & LETTER != 0)
    } else if k & NUMBER != 0 {
        run(t, s, from, end, |x| x & NUMBER != 0)
    } else {
        run(t, s, from, end, is_other)
    }
}

#[inline(always)]
fn newlines(s: &[u8], mut i: usize, slash: bool) -> usize {
    while i < s.len() && (s[i] == b'\r' || s[i] == b'\n' || (slash && s[i] == b'/')) {
        i += 1;
    }
    i
}

/// Llama 3 / cl100k's pattern (`DIGITS` = 3) and Qwen2's (`DIGITS` = 1); `LONG_S`: tiktoken's
/// `(?i:...)` contractions (matching `'ſ`) rather than llama.cpp's ASCII ones; `MARKS`: letter
/// runs take `\p{M}` too and the other class leaves it out (Qwen3.5).
fn cl_next<const DIGITS: usize, const LONG_S: bool, const MARKS: bool>(
    t: &ClassTable,
    s: &[u8],
    i: usize,
) -> usize {
    let end = s.len();
    let letterish = if MARKS { LETTER | MARK } else { LETTER };
    if let Some(n) = contraction(s, i, end, true, LONG_S) {
        return i + n;
    }
    let (c, l) = decode_at(s, i);
    let k = t.of(c);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if k & letterish != 0 {
        return run(t, s, i + l, end, |x| x & letterish != 0);
    }
    let not_nl = c != u32::from(b'\r') && c != u32::from(b'\n');
    if not_nl && k & NUMBER == 0 && i + l < end {
        let (c2, l2) = decode_at(s, i + l);
        if t.of(c2) & letterish != 0 {
            return run(t, s, i + l + l2, end, |x| x & letterish != 0);
        }
    }
    // \p{N}{1,DIGITS}
    if k & NUMBER != 0 {
        let mut j = i + l;
        for _ in 1..DIGITS {
            if j >= end {
                break;
            }
            let (c2, l2) = decode_at(s, j);
            if t.of(c2) & NUMBER == 0 {
                break;
            }
            j += l2;
        }
        return j;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    let other = if MARKS {
        space_then_other(t, s, i, c, l, k, is_other_or_mark)
    } else {
        space_then_other(t, s, i, c, l, k, is_other)
    };
    if let Some(j) = other {
        return newlines(s, j, false);
    }
    // \s*[\r\n]+|\s+(?!\S)|\s+
    let (j, last, nl) = space_run(t, s, i, end);
    match nl {
        Some(n) => n,
        None => space_tail(i, j, last, end),
    }
}

/// ` ?[^\s\p{L}\p{N}]+`: end of the match at `i`, if it matches.
#[inline(always)]
fn space_then_other(
    t: &ClassTable,
    s: &[u8],
    i: usize,
    c: u32,
    l: usize,
    k: u8,
    other: impl Fn(u8) -> bool + Copy,
) -> Option<usize> {
    let end = s.len();
    if other(k) {
        return Some(run(t, s, i + l, end, other));
    }
    if c == u32::from(b' ') && i + 1 < end {
        let (c2, l2) = decode_at(s, i + 1);
        if other(t.of(c2)) {
            return Some(run(t, s, i + 1 + l2, end, other));
        }
    }
    None
}

/// o200k's first alternative without the optional prefix, starting at `p`:
/// `[UP]*[LO]+` then an optional contraction.
fn o200k_alt1(t: &ClassTable, s: &[u8], p: usize) -> Option<usize> {
    let end = s.len();
    // Greedy [UP]*, remembering the end of the last char that is also LO.
    let mut j = p;
    let mut last_lo_end = None;
    while j < end {
        let (c, l) = decode_at(s, j);
        let k = t.of(c);
        if k & UPPERISH == 0 {
            break;
        }
        j += l;
        if k & LOWERISH != 0 {
            last_lo_end = Some(j);
        }
    }
    let m = if j < end && {
        let (c, _) = decode_at(s, j);
        t.of(c) & LOWERISH != 0
    } {
        run(t, s, j, end, |x| x & LOWERISH != 0)
    } else {
        // Backtrack [UP]* to just before its last LO char; [LO]+ then takes exactly that char.
        last_lo_end?
    };
    Some(m + contraction(s, m, end, true, true).unwrap_or(0))
}

/// o200k's second alternative without the prefix: `[UP]+[LO]*` then an optional contraction.
fn o200k_alt2(t: &ClassTable, s: &[u8], p: usize) -> Option<usize> {
    let end = s.len();
    let j = run(t, s, p, end, |x| x & UPPERISH != 0);
    if j == p {
        return None;
    }
    let m = run(t, s, j, end, |x| x & LOWERISH != 0);
    Some(m + contraction(s, m, end, true, true).unwrap_or(0))
}

fn o200k_next(t: &ClassTable, s: &[u8], i: usize) -> usize {
    let end = s.len();
    let (c, l) = decode_at(s, i);
    let k = t.of(c);
    let prefix =
        c != u32::from(b'\r') && c != u32::from(b'\n') && k & (LETTER | NUMBER) == 0 && i + l < end;
    if k & (LETTER | UPPERISH | LOWERISH) != 0 || prefix {
        if prefix && let Some(e) = o200k_alt1(t, s, i + l) {
            return e;
        }
        if let Some(e) = o200k_alt1(t, s, i) {
            return e;
        }
        if prefix && let Some(e) = o200k_alt2(t, s, i + l) {
            return e;
        }
        if let Some(e) = o200k_alt2(t, s, i) {
            return e;
        }
    }
    if k & NUMBER != 0 {
        let mut j = i + l;
        for _ in 0..2 {
            if j >= end {
                break;
            }
            let (c2, l2) = decode_at(s, j);
            if t.of(c2) & NUMBER == 0 {
                break;
            }
            j += l2;
        }
        return j;
    }
    if let Some(j) = space_then_other(t, s, i, c, l, k, is_other) {
        return newlines(s, j, true);
    }
    let (j, last, nl) = space_run(t, s, i, end);
    match nl {
        Some(n) => n,
        None => space_tail(i, j, last, end),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(p: Pretokenizer, s: &str) -> Vec<&str> {
        p.split(s).collect()
    }

    #[test]
    fn gpt2_basics() {
        let p = Pretokenizer::Gpt2;
        assert_eq!(split(p, "Hello world"), ["Hello", " world"]);
        assert_eq!(split(p, "I'm  here\n\n"), ["I", "'m", " ", " here", "\n\n"]);
        assert_eq!(split(p, "a   b"), ["a", "  ", " b"]);
        assert_eq!(split(p, "x\t y"), ["x", "\t", " y"]);
        assert_eq!(split(p, "12 ab!!"), ["12", " ab", "!!"]);
    }

    #[test]
    fn smollm_digits() {
        let p = Pretokenizer::SmolLm;
        assert_eq!(split(p, "x 2024!"), ["x", " ", "2", "0", "2", "4", "!"]);
        assert_eq!(split(p, "a١b"), ["a", "١", "b"]);
    }

    #[test]
    fn cl100k_basics() {
        let p = Pretokenizer::Cl100k;
        assert_eq!(split(p, "Hello world"), ["Hello", " world"]);
        assert_eq!(split(p, "12345"), ["123", "45"]);
        assert_eq!(split(p, "(hello)\n\n  x"), ["(hello", ")\n\n", " ", " x"]);
        assert_eq!(split(p, "I'M"), ["I", "'M"]);
        assert_eq!(split(p, "a \n\n b"), ["a", " \n\n", " b"]);
    }

    #[test]
    fn o200k_basics() {
        let p = Pretokenizer::O200k;
        assert_eq!(split(p, "HelloWorld"), ["Hello", "World"]);
        assert_eq!(split(p, "HELLO world"), ["HELLO", " world"]);
        assert_eq!(split(p, "don't"), ["don't"]);
        assert_eq!(split(p, "a//\n"), ["a", "//\n"]);
    }
}
