//! SentencePiece-style vocabularies as llama.cpp tokenizes them (`tokenizer.ggml.model = llama`):
//! spaces become `▁` (U+2581), then adjacent symbols (starting from UTF-8 characters) are merged
//! greedily, always the pair whose concatenation is the token with the highest score first (ties:
//! the leftmost pair). A final symbol that is not a token becomes its bytes' `<0xXX>` tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use crate::error::LoadError;
use crate::load::GgufVocab;
use crate::pair_table::PairTable;
use crate::tokenizer::{Algo, ModelParts, Tokenizer};
use crate::vocab::{Checked, TYPE_BYTE, TYPE_NORMAL};
use crate::whole::WholeTokens;

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
    whole: WholeTokens,
    /// The length of the longest word in `whole` (longer words are not looked up).
    whole_max: usize,
    /// The token of each ASCII character (`NO_ID`: none).
    ascii: [u32; 128],
    /// The token of each other character that is one, by [`packed_char`].
    chars: FxHashMap<u32, u32>,
    /// Every pair of tokens whose texts make a token: the token. Symbols carry their token, so
    /// a merge step looks up two ids, not the text.
    pairs: PairTable,
    /// One bit per token: whether it is the left one of some pair in `pairs` (most pairs of
    /// Chinese text are not; the bits fit in L1 and answer before the table is read).
    lefts: Vec<u64>,
    /// Of each token that is one ASCII character or `▁`: its index in `small_pairs` (the byte,
    /// 128 for `▁`); [`NOT_SMALL`] for the others.
    small: Vec<u8>,
    /// The merges of two such tokens, `SMALL * left + right` (`NO_ID`: none): most pairs of
    /// Latin text and code looked up, from a table that fits in L2, without a hash.
    small_pairs: Vec<(u32, u32)>,
    /// Each token's score as [`score_order`] (the merge priority of a pair that makes it).
    order: Vec<u32>,
    /// Whether some token contains a character that is no token. Only then can a symbol
    /// without a token (a character) merge; its pairs are looked up by their text.
    orphan_chars_merge: bool,
}

/// The number of characters with an entry in [`SpmModel::small_pairs`]: ASCII and `▁`.
const SMALL: usize = 129;
/// [`SpmModel::small`] of a token that is not one of those characters.
const NOT_SMALL: u8 = u8::MAX;

/// What merging a pair of symbols makes: the token and its score as [`score_order`].
#[derive(Clone, Copy, Debug)]
struct Merge {
    id: u32,
    order: u32,
}

/// A symbol: a byte range of the escaped text, linked to its neighbours, and its token
/// (`NO_ID` for a character that is no token; merged symbols always are tokens).
#[derive(Clone, Copy)]
struct Symbol {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
    id: u32,
}

/// A candidate merge of two adjacent symbols.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Bigram {
    /// The score's [`score_order`] above the bits of `!left`: the greatest key is the highest
    /// score, then the leftmost pair, as one integer comparison.
    key: u64,
    right: u32,
    size: u32,
    /// The token the merge makes.
    id: u32,
}

impl Bigram {
    fn left(&self) -> u32 {
        !(self.key as u32)
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The greatest bigram pops first: highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.key.cmp(&other.key)
    }
}

/// `score` as an unsigned integer in the order of `f32::total_cmp`.
fn score_order(score: f32) -> u32 {
    let bits = score.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    }
}

/// A character of up to four bytes as one integer: its bytes, little-endian. Distinct
/// characters get distinct integers (only ASCII, kept apart, has a zero second byte).
fn packed_char(ch: &[u8]) -> u32 {
    ch.iter()
        .take(4)
        .enumerate()
        .fold(0, |acc, (i, &b)| acc | u32::from(b) << (8 * i))
}

/// Reusable buffers for one encode call.
#[derive(Default)]
pub(crate) struct SpmScratch {
    text: Vec<u8>,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Bigram>,
    short_syms: Vec<ShortSymbol>,
    /// Of each adjacent pair of `short_syms`: its merge's score as [`score_order`] + 1 (0: the
    /// pair does not merge), and the token it makes.
    short_pairs: Vec<(u64, u32)>,
}

/// A symbol of [`SpmModel::merge_short`]: byte range and token.
#[derive(Clone, Copy)]
struct ShortSymbol {
    start: u32,
    len: u32,
    id: u32,
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
        // Single characters (as the encoder cuts text into characters) and pairs.
        let mut ascii = [NO_ID; 128];
        let mut chars = FxHashMap::default();
        for (text, &id) in &ids {
            if !text.is_empty() && char_len(text, 0) == text.len() {
                if text[0] < 128 {
                    ascii[text[0] as usize] = id;
                } else {
                    chars.insert(packed_char(text), id);
                }
            }
        }
        let order: Vec<u32> = (0..texts.len())
            .map(|id| score_order(scores.get(id).copied().unwrap_or(0.0)))
            .collect();
        let mut pairs = Vec::new();
        let mut lefts = vec![0u64; texts.len().div_ceil(64)];
        let mut orphan_chars_merge = false;
        for (text, &id) in &ids {
            // Every split (at any byte: a superset of the character boundaries merging sees).
            for k in 1..text.len() {
                if let (Some(&left), Some(&right)) = (ids.get(&text[..k]), ids.get(&text[k..])) {
                    pairs.push((left, right, id));
                    lefts[left as usize / 64] |= 1 << (left % 64);
                }
            }
            if char_len(text, 0) < text.len() {
                let mut pos = 0;
                while pos < text.len() {
                    let len = char_len(text, pos);
                    orphan_chars_merge |= !ids.contains_key(&text[pos..pos + len]);
                    pos += len;
                }
            }
        }
        let mut small = vec![NOT_SMALL; texts.len()];
        for (b, &id) in ascii.iter().enumerate() {
            if id != NO_ID {
                small[id as usize] = b as u8;
            }
        }
        if let Some(&id) = ids.get(SPACE_MARK) {
            small[id as usize] = 128;
        }
        let mut small_pairs = vec![(NO_ID, 0); SMALL * SMALL];
        for &(left, right, id) in &pairs {
            let (l, r) = (small[left as usize], small[right as usize]);
            if l != NOT_SMALL && r != NOT_SMALL {
                small_pairs[SMALL * l as usize + r as usize] = (id, order[id as usize]);
            }
        }
        let mut model = Self {
            small,
            small_pairs,
            barrier,
            ids,
            scores,
            byte_tokens,
            unk,
            add_space_prefix,
            split_words,
            whole: WholeTokens::default(),
            whole_max: 0,
            ascii,
            chars,
            pairs: PairTable::new(&pairs),
            lefts,
            order,
            orphan_chars_merge,
        };
        if split_words {
            let mut whole = WholeTokens::default();
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
                    model.whole_max = model.whole_max.max(text.len());
                }
            }
            model.whole = whole;
        }
        model
    }

    /// The token of the character `ch` (`NO_ID`: none).
    #[inline]
    fn char_token(&self, ch: &[u8]) -> u32 {
        if ch.len() == 1 && ch[0] < 128 {
            self.ascii[ch[0] as usize]
        } else {
            self.chars.get(&packed_char(ch)).copied().unwrap_or(NO_ID)
        }
    }

    /// What merging two adjacent symbols (`left` starting at byte `start` of `text`, `size`
    /// bytes together) makes, if they merge.
    #[inline]
    fn merge_of(&self, text: &[u8], start: u32, size: u32, left: u32, right: u32) -> Option<Merge> {
        let id = if left != NO_ID && right != NO_ID {
            let (l, r) = (self.small[left as usize], self.small[right as usize]);
            if l != NOT_SMALL && r != NOT_SMALL {
                let (id, order) = self.small_pairs[SMALL * l as usize + r as usize];
                return (id != NO_ID).then_some(Merge { id, order });
            }
            if self.lefts[left as usize / 64] & (1 << (left % 64)) == 0 {
                return None;
            }
            self.pairs.get(left, right)?
        } else if self.orphan_chars_merge {
            self.token(&text[start as usize..(start + size) as usize])?
        } else {
            return None;
        };
        Some(Merge {
            id,
            order: self.order[id as usize],
        })
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
        // Each space grows by two bytes; sized once, copied in runs between spaces.
        s.text.reserve(raw.len() * 3 + SPACE_MARK.len());
        if space_prefix {
            s.text.extend_from_slice(SPACE_MARK);
        }
        for (k, run) in raw.split(' ').enumerate() {
            if k > 0 {
                s.text.extend_from_slice(SPACE_MARK);
            }
            s.text.extend_from_slice(run.as_bytes());
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
                    self.emit_symbol(&text, i as u32, 1, self.ascii[b as usize], out);
                    start = i + 1;
                } else if b == SPACE_MARK[0]
                    && i > start
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
        let whole = if word.len() <= self.whole_max {
            self.whole.get(word)
        } else {
            None
        };
        match whole {
            Some(id) => out.push(id),
            None if word.len() <= SHORT_WORD => self.merge_short(word, out, s),
            None => self.merge_word(word, out, s),
        }
    }

    /// [`SpmModel::merge_word`] for short words without the queue: the pair scores live in an
    /// array and each step merges the first pair with the highest score, which is the pair the
    /// queue would pop (highest score, then leftmost).
    fn merge_short(&self, text: &[u8], out: &mut Vec<u32>, s: &mut SpmScratch) {
        let syms = &mut s.short_syms;
        syms.clear();
        let mut pos = 0;
        while pos < text.len() {
            let len = char_len(text, pos);
            syms.push(ShortSymbol {
                start: pos as u32,
                len: len as u32,
                id: self.char_token(&text[pos..pos + len]),
            });
            pos += len;
        }
        // (score order + 1, token) of the pair at `i`; 0 when it does not merge.
        let pair = |syms: &[ShortSymbol], i: usize| -> (u64, u32) {
            let (a, b) = (syms[i], syms[i + 1]);
            match self.merge_of(text, a.start, a.len + b.len, a.id, b.id) {
                Some(m) => (u64::from(m.order) + 1, m.id),
                None => (0, NO_ID),
            }
        };
        let pairs = &mut s.short_pairs;
        pairs.clear();
        for i in 0..syms.len().saturating_sub(1) {
            pairs.push(pair(syms, i));
        }
        loop {
            // The first pair with the highest score.
            let (mut best, mut best_key) = (0, 0);
            for (i, &(key, _)) in pairs.iter().enumerate() {
                if key > best_key {
                    (best, best_key) = (i, key);
                }
            }
            if best_key == 0 {
                break;
            }
            let i = best;
            syms[i].len += syms[i + 1].len;
            syms[i].id = pairs[i].1;
            syms.remove(i + 1);
            pairs.remove(i);
            if i + 1 < syms.len() {
                pairs[i] = pair(syms, i);
            }
            if i > 0 {
                pairs[i - 1] = pair(syms, i - 1);
            }
        }
        for sym in syms.iter() {
            self.emit_symbol(text, sym.start, sym.len, sym.id, out);
        }
    }

    /// Appends a final symbol's token, or its bytes' tokens when it has none.
    #[inline]
    fn emit_symbol(&self, text: &[u8], start: u32, len: u32, id: u32, out: &mut Vec<u32>) {
        if id != NO_ID {
            out.push(id);
        } else {
            self.emit_bytes(&text[start as usize..(start + len) as usize], out);
        }
    }

    /// Appends the token for a final symbol, or its bytes' tokens.
    fn emit(&self, piece: &[u8], out: &mut Vec<u32>) {
        match self.token(piece) {
            Some(id) => out.push(id),
            None => self.emit_bytes(piece, out),
        }
    }

    /// Appends the `<0xXX>` token of each byte of `piece` (or `unk`, or nothing).
    fn emit_bytes(&self, piece: &[u8], out: &mut Vec<u32>) {
        for &b in piece {
            let id = self.byte_tokens[b as usize];
            if id != NO_ID {
                out.push(id);
            } else if let Some(u) = self.unk {
                out.push(u);
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
            let len = char_len(text, pos);
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
                id: self.char_token(&text[pos..pos + len]),
            });
            pos += len;
        }
        // The first pairs are collected and heapified at once (linear), not pushed one by one.
        let mut items = std::mem::take(&mut s.heap).into_vec();
        items.clear();
        for i in 1..s.symbols.len() as u32 {
            if let Some(bg) = self.bigram(text, &s.symbols, i - 1, i) {
                items.push(bg);
            }
        }
        let mut heap = BinaryHeap::from(items);
        while let Some(bg) = heap.pop() {
            let (left, r) = (bg.left(), bg.right as usize);
            let l = left as usize;
            let (ll, rl) = (s.symbols[l].len, s.symbols[r].len);
            if ll == 0 || rl == 0 || ll + rl != bg.size {
                continue;
            }
            s.symbols[l].len += rl;
            s.symbols[l].id = bg.id;
            s.symbols[r].len = 0;
            let rn = s.symbols[r].next;
            s.symbols[l].next = rn;
            if rn != NO_ID {
                s.symbols[rn as usize].prev = left;
            }
            let lp = s.symbols[l].prev;
            if lp != NO_ID
                && let Some(bg) = self.bigram(text, &s.symbols, lp, left)
            {
                heap.push(bg);
            }
            if rn != NO_ID
                && let Some(bg) = self.bigram(text, &s.symbols, left, rn)
            {
                heap.push(bg);
            }
        }
        s.heap = heap;
        let mut i = 0u32;
        while i != NO_ID {
            let sym = s.symbols[i as usize];
            self.emit_symbol(text, sym.start, sym.len, sym.id, out);
            i = sym.next;
        }
    }

    /// The bigram of the adjacent symbols `left` and `right`, if they merge.
    #[inline]
    fn bigram(&self, text: &[u8], symbols: &[Symbol], left: u32, right: u32) -> Option<Bigram> {
        let (a, b) = (symbols[left as usize], symbols[right as usize]);
        let size = a.len + b.len;
        let m = self.merge_of(text, a.start, size, a.id, b.id)?;
        Some(Bigram {
            key: u64::from(m.order) << 32 | u64::from(!left),
            right,
            size,
            id: m.id,
        })
    }

    /// Encodes one fragment as llama.cpp does, with none of the shortcuts of
    /// [`encode`](Self::encode) (no words, no whole-word table, no pair table: every pair is
    /// looked up by its text): the reference the shortcuts are tested against.
    pub(crate) fn encode_reference(&self, raw: &str, space_prefix: bool, out: &mut Vec<u32>) {
        let mut text = Vec::with_capacity(raw.len() + 3);
        if space_prefix {
            text.extend_from_slice(SPACE_MARK);
        }
        for &b in raw.as_bytes() {
            if b == b' ' {
                text.extend_from_slice(SPACE_MARK);
            } else {
                text.push(b);
            }
        }
        if text.is_empty() {
            return;
        }
        // (start, len, prev, next) of each symbol; the queue holds (score, !left, right, size).
        let mut syms: Vec<[u32; 4]> = Vec::new();
        let mut pos = 0;
        while pos < text.len() {
            let len = char_len(&text, pos);
            let i = syms.len() as u32;
            let next = if pos + len == text.len() {
                NO_ID
            } else {
                i + 1
            };
            syms.push([pos as u32, len as u32, i.wrapping_sub(1), next]);
            pos += len;
        }
        let mut heap = BinaryHeap::new();
        let push =
            |heap: &mut BinaryHeap<(u32, u32, u32, u32)>, syms: &[[u32; 4]], l: u32, r: u32| {
                let (a, b) = (syms[l as usize], syms[r as usize]);
                let size = a[1] + b[1];
                if let Some(id) = self.token(&text[a[0] as usize..(a[0] + size) as usize]) {
                    let score = self.scores.get(id as usize).copied().unwrap_or(0.0);
                    heap.push((score_order(score), !l, r, size));
                }
            };
        for i in 1..syms.len() as u32 {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some((_, not_l, r, size)) = heap.pop() {
            let (l, r) = (!not_l as usize, r as usize);
            if syms[l][1] == 0 || syms[r][1] == 0 || syms[l][1] + syms[r][1] != size {
                continue;
            }
            syms[l][1] += syms[r][1];
            syms[r][1] = 0;
            let rn = syms[r][3];
            syms[l][3] = rn;
            if rn != NO_ID {
                syms[rn as usize][2] = l as u32;
                push(&mut heap, &syms, l as u32, rn);
            }
            let lp = syms[l][2];
            if lp != NO_ID {
                push(&mut heap, &syms, lp, l as u32);
            }
        }
        let mut i = 0u32;
        while i != NO_ID {
            let [start, len, _, next] = syms[i as usize];
            self.emit(&text[start as usize..(start + len) as usize], out);
            i = next;
        }
    }
}

/// The length of the character at `pos` of `text`, as the encoder cuts characters.
#[inline]
fn char_len(text: &[u8], pos: usize) -> usize {
    utf8_len(text[pos]).min(text.len() - pos)
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
    fn a_character_without_a_token_still_merges_into_one() {
        // 'a' is no token, "ab" is: the pair is looked up by its text.
        let texts = ["b", "ab", "ab\u{2581}", "\u{2581}"];
        let m = SpmModel::new(&texts, vec![-1.0, -2.0, -3.0, -1.0], None, false);
        assert!(m.orphan_chars_merge);
        for text in ["ab", "aab", "ab ab", "ba", "a"] {
            let mut want = Vec::new();
            m.encode_reference(text, false, &mut want);
            assert_eq!(encode(&m, text), want, "{text}");
        }
        // The first 'a' has no token, no byte token and no unk: it is dropped.
        assert_eq!(encode(&m, "ab"), vec![1]);
        assert_eq!(encode(&m, "aab"), vec![1]);
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
