//! SentencePiece-style vocabularies as llama.cpp tokenizes them (`tokenizer.ggml.model = llama`):
//! spaces become `▁` (U+2581), then adjacent symbols (starting from UTF-8 characters) are merged
//! greedily, always the pair whose concatenation is the token with the highest score first (ties:
//! the leftmost pair). A final symbol that is not a token becomes its bytes' `<0xXX>` tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use crate::error::LoadError;
use crate::load::GgufVocab;
use crate::tokenizer::{Algo, ModelParts, Tokenizer};
use crate::vocab::{Checked, TYPE_BYTE, TYPE_NORMAL};

/// Builds an SPM tokenizer from GGUF metadata (`tokenizer.ggml.model = llama`), with
/// llama.cpp's defaults: BOS 1, EOS 2, unknown 0, `add_space_prefix` and `add_bos_token` true.
pub(crate) fn from_gguf_vocab(v: &GgufVocab<'_>) -> Result<Tokenizer, LoadError> {
    let vocab = Checked::new(v, true)?;
    let bos = vocab.id("tokenizer.ggml.bos_token_id", v.bos, Some(1))?;
    let eos = vocab.id("tokenizer.ggml.eos_token_id", v.eos, Some(2))?;
    let unk = vocab.id("tokenizer.ggml.unknown_token_id", v.unknown, Some(0))?;
    let eog = vocab.eot_eom()?;
    let add_space_prefix = v.add_space_prefix.unwrap_or(true);
    let parts = ModelParts {
        algo: Algo::Spm(Box::new(SpmModel::new(
            &v.tokens,
            v.scores.clone(),
            unk,
            add_space_prefix,
        ))),
        user_defined: Vec::new(),
        add_bos: v.add_bos.unwrap_or(true),
        add_eos: v.add_eos.unwrap_or(false),
        end_token: eos,
        strip_leading_space: add_space_prefix,
    };
    let mut tok = vocab.build(bos, eos, parts);
    tok.extend_eog(eog);
    Ok(tok)
}

/// `▁` (U+2581) in UTF-8: what a space becomes before merging.
pub(crate) const SPACE_MARK: &[u8] = "\u{2581}".as_bytes();

/// No id.
const NO_ID: u32 = u32::MAX;

/// The SPM model: token text lookup and scores.
#[derive(Debug)]
pub(crate) struct SpmModel {
    /// Token text as stored in the vocabulary (`▁` for spaces) -> id; every token (llama.cpp's
    /// `text_to_token` sees control and byte tokens too; the first id wins for duplicates).
    ids: FxHashMap<Box<[u8]>, u32>,
    /// Score of each id (higher merges first).
    scores: Vec<f32>,
    /// `<0xXX>` token of each byte (or the one-byte token), `NO_ID` if neither exists.
    byte_tokens: [u32; 256],
    /// Emitted for a byte with no token at all (otherwise the byte is dropped).
    unk: Option<u32>,
    /// Whether a space is put before the text (and after a special token).
    pub(crate) add_space_prefix: bool,
    /// No token has a `▁` right after another character, so no merge can cross the start of a
    /// `▁` run that follows a character: the text is merged in independent words, which gives
    /// the same result as merging it whole (merges in different words never interact, and the
    /// order within a word is the same).
    split_words: bool,
    /// ASCII bytes no token of two or more bytes contains (llama-spm: `\n`, `\t`, ...): no merge
    /// can take them in, so they are words of their own (with `split_words`).
    barrier: [bool; 128],
    /// Words that merge into exactly one token (checked at load), looked up before merging.
    whole: FxHashMap<Box<[u8]>, u32>,
}

/// A symbol: a byte range of the escaped text, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

/// A candidate merge of two adjacent symbols.
#[derive(Clone, Copy)]
struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    size: u32,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The greatest bigram pops first: highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Reusable buffers for one encode call.
#[derive(Default)]
pub(crate) struct SpmScratch {
    text: Vec<u8>,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Bigram>,
    short_syms: Vec<(u32, u32)>,
    short_scores: Vec<Option<f32>>,
}

/// Words up to this many bytes are merged by [`SpmModel::merge_short`].
const SHORT_WORD: usize = 48;

impl SpmModel {
    /// Builds the model from the vocabulary's token texts (as stored) and scores.
    pub(crate) fn new(
        texts: &[&str],
        scores: Vec<f32>,
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Self {
        let mut ids: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
        ids.reserve(texts.len());
        for (id, t) in texts.iter().enumerate() {
            ids.entry(t.as_bytes().into()).or_insert(id as u32);
        }
        let mut byte_tokens = [NO_ID; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            if let Some(&id) = ids.get(hex.as_bytes()) {
                *slot = id;
            } else if let Some(&id) = ids.get(&[b as u8][..]) {
                *slot = id;
            }
        }
        let split_words = !texts.iter().any(|t| {
            let t = t.as_bytes();
            (1..t.len()).any(|i| t[i..].starts_with(SPACE_MARK) && !t[..i].ends_with(SPACE_MARK))
        });
        let mut barrier = [true; 128];
        for t in texts {
            if t.len() >= 2 {
                for &b in t.as_bytes() {
                    if b < 128 {
                        barrier[b as usize] = false;
                    }
                }
            }
        }
        let mut model = Self {
            barrier,
            ids,
            scores,
            byte_tokens,
            unk,
            add_space_prefix,
            split_words,
            whole: FxHashMap::default(),
        };
        if split_words {
            let mut whole = FxHashMap::default();
            let mut scratch = SpmScratch::default();
            let mut out = Vec::new();
            for (text, &id) in &model.ids {
                if text.len() < 2 {
                    continue;
                }
                out.clear();
                model.merge_word(text, &mut out, &mut scratch);
                if out.len() == 1 && out[0] == id {
                    whole.insert(text.clone(), id);
                }
            }
            model.whole = whole;
        }
        model
    }

    /// The token whose text is `text`.
    fn token(&self, text: &[u8]) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Encodes one fragment of raw text (no special tokens in it), appending ids to `out`.
    /// `space_prefix`: put a space before the text (llama.cpp does at the start and after a
    /// special token when `add_space_prefix` is set).
    pub(crate) fn encode(
        &self,
        raw: &str,
        space_prefix: bool,
        out: &mut Vec<u32>,
        s: &mut SpmScratch,
    ) {
        s.text.clear();
        if space_prefix {
            s.text.extend_from_slice(SPACE_MARK);
        }
        for &b in raw.as_bytes() {
            if b == b' ' {
                s.text.extend_from_slice(SPACE_MARK);
            } else {
                s.text.push(b);
            }
        }
        let text = std::mem::take(&mut s.text);
        if !self.split_words {
            self.merge_word(&text, out, s);
        } else {
            // Words: cut before each `▁` that follows another character.
            let mut start = 0;
            let mut i = 0;
            while i < text.len() {
                let b = text[i];
                if b < 128 && self.barrier[b as usize] {
                    if i > start {
                        self.encode_word(&text[start..i], out, s);
                    }
                    self.emit(&text[i..i + 1], out);
                    start = i + 1;
                } else if i > start
                    && text[i..].starts_with(SPACE_MARK)
                    && !text[..i].ends_with(SPACE_MARK)
                {
                    self.encode_word(&text[start..i], out, s);
                    start = i;
                }
                i += 1;
            }
            self.encode_word(&text[start..], out, s);
        }
        s.text = text;
    }

    fn encode_word(&self, word: &[u8], out: &mut Vec<u32>, s: &mut SpmScratch) {
        match self.whole.get(word) {
            Some(&id) => out.push(id),
            None if word.len() <= SHORT_WORD => self.merge_short(word, out, s),
            None => self.merge_word(word, out, s),
        }
    }

    /// [`SpmModel::merge_word`] for short words without the queue: the pair scores live in an
    /// array and each step merges the first pair with the highest score, which is the pair the
    /// queue would pop (highest score, then leftmost).
    fn merge_short(&self, text: &[u8], out: &mut Vec<u32>, s: &mut SpmScratch) {
        // (start, len) of each symbol, in order.
        let syms = &mut s.short_syms;
        syms.clear();
        let mut pos = 0;
        while pos < text.len() {
            let len = utf8_len(text[pos]).min(text.len() - pos);
            syms.push((pos as u32, len as u32));
            pos += len;
        }
        let pair = |syms: &[(u32, u32)], i: usize| -> Option<f32> {
            let (a, b) = (syms[i], syms[i + 1]);
            let cat = &text[a.0 as usize..(a.0 + a.1 + b.1) as usize];
            self.token(cat)
                .map(|id| self.scores.get(id as usize).copied().unwrap_or(0.0))
        };
        let scores = &mut s.short_scores;
        scores.clear();
        for i in 0..syms.len().saturating_sub(1) {
            scores.push(pair(syms, i));
        }
        loop {
            let mut best: Option<(usize, f32)> = None;
            for (i, sc) in scores.iter().enumerate() {
                if let Some(sc) = *sc
                    && best.is_none_or(|(_, b)| sc.total_cmp(&b) == Ordering::Greater)
                {
                    best = Some((i, sc));
                }
            }
            let Some((i, _)) = best else { break };
            syms[i].1 += syms[i + 1].1;
            syms.remove(i + 1);
            scores.remove(i);
            if i + 1 < syms.len() {
                scores[i] = pair(syms, i);
            }
            if i > 0 {
                scores[i - 1] = pair(syms, i - 1);
            }
        }
        for &(start, len) in syms.iter() {
            self.emit(&text[start as usize..(start + len) as usize], out);
        }
    }

    /// Appends the token for a final symbol, or its bytes' tokens.
    fn emit(&self, piece: &[u8], out: &mut Vec<u32>) {
        match self.token(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece {
                    let id = self.byte_tokens[b as usize];
                    if id != NO_ID {
                        out.push(id);
                    } else if let Some(u) = self.unk {
                        out.push(u);
                    }
                }
            }
        }
    }

    /// Merges `text` (already escaped) and appends its tokens to `out`.
    fn merge_word(&self, text: &[u8], out: &mut Vec<u32>, s: &mut SpmScratch) {
        if text.is_empty() {
            return;
        }
        s.symbols.clear();
        let mut pos = 0usize;
        while pos < text.len() {
            let len = utf8_len(text[pos]).min(text.len() - pos);
            let i = s.symbols.len() as u32;
            s.symbols.push(Symbol {
                start: pos as u32,
                len: len as u32,
                prev: i.wrapping_sub(1),
                next: if pos + len == text.len() {
                    NO_ID
                } else {
                    i + 1
                },
            });
            pos += len;
        }
        s.heap.clear();
        for i in 1..s.symbols.len() as u32 {
            self.try_add(text, &s.symbols, &mut s.heap, i - 1, i);
        }
        while let Some(bg) = s.heap.pop() {
            let (l, r) = (bg.left as usize, bg.right as usize);
            let (ll, rl) = (s.symbols[l].len, s.symbols[r].len);
            if ll == 0 || rl == 0 || ll + rl != bg.size {
                continue;
            }
            s.symbols[l].len += rl;
            s.symbols[r].len = 0;
            let rn = s.symbols[r].next;
            s.symbols[l].next = rn;
            if rn != NO_ID {
                s.symbols[rn as usize].prev = bg.left;
            }
            let lp = s.symbols[l].prev;
            if lp != NO_ID {
                self.try_add(text, &s.symbols, &mut s.heap, lp, bg.left);
            }
            if rn != NO_ID {
                self.try_add(text, &s.symbols, &mut s.heap, bg.left, rn);
            }
        }
        let mut i = 0u32;
        while i != NO_ID {
            let sym = s.symbols[i as usize];
            self.emit(
                &text[sym.start as usize..(sym.start + sym.len) as usize],
                out,
            );
            i = sym.next;
        }
    }

    fn try_add(
        &self,
        text: &[u8],
        symbols: &[Symbol],
        heap: &mut BinaryHeap<Bigram>,
        left: u32,
        right: u32,
    ) {
        let (a, b) = (symbols[left as usize], symbols[right as usize]);
        let size = a.len + b.len;
        // Adjacent symbols are adjacent in the text, so the pair is one slice.
        let cat = &text[a.start as usize..(a.start + size) as usize];
        if let Some(id) = self.token(cat) {
            heap.push(Bigram {
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                left,
                right,
                size,
            });
        }
    }
}

/// Length of the UTF-8 sequence starting with `lead` (1 for continuation bytes, as llama.cpp).
fn utf8_len(lead: u8) -> usize {
    const LOOKUP: [usize; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4];
    LOOKUP[(lead >> 4) as usize]
}

/// The text a token of an SPM vocabulary stands for: `▁` becomes a space, a byte token
/// (`<0xXX>`, type 6) its byte; control, user-defined and other tokens keep their text.
pub(crate) fn piece(text: &str, token_type: i32) -> Vec<u8> {
    if token_type == TYPE_BYTE
        && let Some(b) = parse_byte_token(text)
    {
        return vec![b];
    }
    if token_type == TYPE_NORMAL {
        let mut out = Vec::with_capacity(text.len());
        let mut rest = text.as_bytes();
        while !rest.is_empty() {
            if rest.starts_with(SPACE_MARK) {
                out.push(b' ');
                rest = &rest[SPACE_MARK.len()..];
            } else {
                out.push(rest[0]);
                rest = &rest[1..];
            }
        }
        return out;
    }
    text.as_bytes().to_vec()
}

/// `<0xXX>` -> the byte.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(m: &SpmModel, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        m.encode(
            text,
            m.add_space_prefix,
            &mut out,
            &mut SpmScratch::default(),
        );
        out
    }

    /// A tiny vocabulary where the merge order decides the result.
    fn tiny() -> SpmModel {
        // ids:        0       1    2    3    4     5     6      7
        let texts = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "\u{2581}"];
        let scores = vec![0.0, -1.0, -1.0, -1.0, -5.0, -2.0, -3.0, -1.0];
        SpmModel::new(&texts, scores, Some(0), false)
    }

    #[test]
    fn higher_score_pair_merges_first() {
        let m = tiny();
        // "bc" (-2) beats "ab" (-5), then a + bc = "abc" is a token and merges.
        assert_eq!(encode(&m, "abc"), vec![6]);
        assert_eq!(encode(&m, "ab"), vec![4]);
        // Without "abc" the first merge decides the split.
        let texts = ["a", "b", "c", "ab", "bc"];
        let m = SpmModel::new(&texts, vec![0.0, 0.0, 0.0, -1.0, -2.0], None, false);
        assert_eq!(encode(&m, "abc"), vec![3, 2]);
        let m = SpmModel::new(&texts, vec![0.0, 0.0, 0.0, -3.0, -2.0], None, false);
        assert_eq!(encode(&m, "abc"), vec![0, 4]);
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let texts = ["a", "aa", "aaa"];
        let scores = vec![0.0, -1.0, -10.0];
        let m = SpmModel::new(&texts, scores, None, false);
        // "aaa": pairs (0,1) and (1,2) tie; the left one merges: aa + a, then aaa.
        assert_eq!(encode(&m, "aaa"), vec![2]);
        // "aaaa": aa + aa (leftmost first, then the next free pair), "aaaa" is no token.
        assert_eq!(encode(&m, "aaaa"), vec![1, 1]);
    }

    #[test]
    fn spaces_become_marks_and_unknown_bytes_use_unk() {
        let m = tiny();
        assert_eq!(encode(&m, "a b"), vec![1, 7, 2]);
        // 'z' has no token and no byte token: unk.
        assert_eq!(encode(&m, "z"), vec![0]);
    }

    #[test]
    fn words_are_merged_apart_only_when_no_token_spans_a_word_start() {
        // No token has ▁ after a character: words are independent, the whole-word table is used.
        let m = tiny();
        assert!(m.split_words);
        assert_eq!(encode(&m, "abc abc"), vec![6, 7, 6]);
        // "c▁" is a token: merging must see the whole text, and does.
        let texts = ["a", "c", "\u{2581}", "c\u{2581}"];
        let m = SpmModel::new(&texts, vec![-1.0, -1.0, -1.0, -0.5], None, false);
        assert!(!m.split_words);
        assert_eq!(encode(&m, "c a"), vec![3, 0]);
    }

    #[test]
    fn short_word_merge_equals_the_queue() {
        let texts = [
            "a",
            "b",
            "\u{2581}",
            "ab",
            "ba",
            "aa",
            "aba",
            "\u{2581}a",
            "bab",
            "abab",
        ];
        let scores = vec![0.0, 0.0, 0.0, -2.0, -2.0, -3.0, -1.0, -2.0, -1.5, -4.0];
        let m = SpmModel::new(&texts, scores, None, false);
        let mut s = SpmScratch::default();
        // Every string of up to 7 symbols over a, b, ▁.
        let mut words = vec![String::new()];
        for _ in 0..7 {
            let next: Vec<String> = words
                .iter()
                .flat_map(|w| ["a", "b", "\u{2581}"].map(|c| format!("{w}{c}")))
                .collect();
            for w in &next {
                let (mut short, mut queue) = (Vec::new(), Vec::new());
                m.merge_short(w.as_bytes(), &mut short, &mut s);
                m.merge_word(w.as_bytes(), &mut queue, &mut s);
                assert_eq!(short, queue, "{w}");
            }
            words = next;
        }
    }

    #[test]
    fn byte_tokens_and_pieces() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(b'\n'));
        assert_eq!(parse_byte_token("<0x0A"), None);
        assert_eq!(piece("\u{2581}hi\u{2581}", 1), b" hi ");
        assert_eq!(piece("<0xE2>", 6), vec![0xE2]);
        assert_eq!(piece("<s>", 3), b"<s>");
    }
}
