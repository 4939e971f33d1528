//! The [`Tokenizer`]: vocabulary, merges, special tokens, encode and decode.

use rustc_hash::FxHashMap;

use crate::backtrack::{Backtrack, Reachable};
use crate::bpe::{self, Merges, NONE, Work};
use crate::error::DecodeError;
use crate::hf_spm::HfSpmModel;
use crate::pretok::Pretokenizer;
use crate::spm::{SpmModel, SpmScratch};
use crate::tokens::Tokens;
use crate::ugm::UgmModel;
use crate::whole::WholeTokens;
use crate::wpm::WpmModel;

/// The tokenization algorithm; everything else (token bytes, decode table, specials) is common.
#[derive(Debug)]
pub(crate) enum Algo {
    /// Byte-level BPE with a pre-tokenizer (GPT-2, Llama 3, tiktoken, ...).
    Bpe,
    /// llama.cpp's SentencePiece-style merges (`tokenizer.ggml.model = llama`).
    Spm(Box<SpmModel>),
    /// SentencePiece-style BPE from HF `tokenizer.json` (merge ranks, HF's prefix rules).
    HfSpm(Box<HfSpmModel>),
    /// llama.cpp's WordPiece (`tokenizer.ggml.model = bert`).
    Wpm(WpmModel),
    /// llama.cpp's Unigram (`tokenizer.ggml.model = t5`).
    Ugm(Box<UgmModel>),
}

/// llama.cpp's end-of-generation token names (`llama_vocab::impl::load`): a token with one of
/// these texts ends generation, besides EOS, EOT and EOM.
pub(crate) const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
];

/// Pieces of at least this many bytes with a non-ASCII byte in them are spelled by backtracking
/// (when the vocabulary has a [`Backtrack`]); the rest are merged. Measured 2026-12-04 on the
/// busy 2-core machine: with the double-array trie, backtracking is 1.5-2.7x faster than
/// merging on Chinese (bench table "backtracking vs merging"), while spelling ASCII pieces of 6
/// or 12 bytes and more by backtracking too was no faster than merging them on English prose
/// and C code (in-process A/B, passes interleaved). Pieces that only start with ASCII (` 中文`,
/// `abc中文`: o200k keeps letters of all cases and scripts together) are the reason for "any
/// byte" rather than "the first byte": that change halved the merge loop's share of the zh
/// profile (perf, o200k: 17.5% to 8.6% of samples).
const BACKTRACK_FROM: usize = 6;

/// A token of two or more bytes that merging reproduces: its bytes, id and last merge.
type MergedToken = (Box<[u8]>, u32, (u32, u32));

/// How merges are ranked.
#[derive(Debug)]
pub(crate) enum MergeSpec {
    /// HF / GGUF merge list, in priority order: `(left id, right id)`.
    Pairs(Vec<(u32, u32)>),
    /// tiktoken: a pair merges when the concatenation is a token; rank = that token's id.
    FromRanks,
}

/// Everything a loader extracts; turned into a [`Tokenizer`] by [`Tokenizer::from_spec`].
#[derive(Debug)]
pub(crate) struct Spec {
    pub(crate) pretok: Pretokenizer,
    /// Token bytes by id; `None` for holes in the id space.
    pub(crate) tokens: Vec<Option<Vec<u8>>>,
    pub(crate) merges: MergeSpec,
    /// Special tokens (their text, their id); their bytes in `tokens` are their text.
    pub(crate) specials: Vec<(String, u32)>,
    /// A piece that is itself a token is emitted as that token without merging
    /// (tiktoken always; HF `ignore_merges`).
    pub(crate) ignore_merges: bool,
    /// Bytes without a token use `<0xXX>` tokens when the vocabulary has them.
    pub(crate) byte_fallback: bool,
    /// Bytes without a token become this id (HF `unk_token`); otherwise they are dropped.
    pub(crate) unk: Option<u32>,
    /// Consecutive unknown bytes become one `unk` (HF `fuse_unk`).
    pub(crate) fuse_unk: bool,
    pub(crate) bos: Option<u32>,
    pub(crate) eos: Option<u32>,
    pub(crate) chat_template: Option<String>,
    /// Byte-fallback tokens (`<0xXX>`, GGUF type 6) of raw-UTF-8 vocabularies: (byte, id).
    /// Their bytes in `tokens` are the byte; they are used only for characters without a token.
    pub(crate) byte_tokens: Vec<(u8, u32)>,
    /// User-defined tokens (GGUF type 4): llama.cpp cuts them out of plain text too (before
    /// pre-tokenizing), unlike control tokens. Also listed in `specials`.
    pub(crate) user_defined: Vec<(String, u32)>,
    /// Tokens that decode but that no piece can spell (a GGUF byte-level vocabulary's entries
    /// that are not byte-level strings).
    pub(crate) unreachable: Vec<u32>,
}

/// Special tokens matched in text (leftmost-longest), only when the caller allows it.
#[derive(Debug, Clone)]
struct Specials {
    /// Longest first, so the first hit at a position is the longest.
    entries: Vec<(Box<str>, u32)>,
    first_byte: [bool; 256],
    /// Tokens that take the whitespace before (`.0`, HF `lstrip`) or after (`.1`, `rstrip`)
    /// them into their match; empty for most vocabularies.
    strip: FxHashMap<u32, (bool, bool)>,
}

/// A piece of text cut by [`Specials::split_each`].
enum Segment<'a> {
    /// Text between tokens of the set.
    Text(&'a str),
    /// A token of the set.
    Token(u32),
}

impl Specials {
    fn new(mut list: Vec<(String, u32)>) -> Self {
        list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut first_byte = [false; 256];
        let mut entries = Vec::with_capacity(list.len());
        for (s, id) in list {
            if let Some(&b) = s.as_bytes().first() {
                first_byte[b as usize] = true;
                entries.push((s.into_boxed_str(), id));
            }
        }
        Self {
            entries,
            first_byte,
            strip: FxHashMap::default(),
        }
    }

    /// Cuts `text` at this set's tokens: `each` gets the non-empty text between them and the
    /// tokens' ids, in order.
    fn split_each(&self, text: &str, mut each: impl FnMut(Segment<'_>)) {
        let mut pos = 0;
        while let Some((mut start, mut end, id)) = self.find(text, pos) {
            if let Some(&(left, right)) = self.strip.get(&id) {
                if left {
                    start = pos.max(text[..start].trim_end_matches(char::is_whitespace).len());
                }
                if right {
                    end = text.len() - text[end..].trim_start_matches(char::is_whitespace).len();
                }
            }
            if start > pos {
                each(Segment::Text(&text[pos..start]));
            }
            each(Segment::Token(id));
            pos = end;
        }
        if pos < text.len() {
            each(Segment::Text(&text[pos..]));
        }
    }

    /// First special token at or after `from`: (start, end, id).
    fn find(&self, text: &str, from: usize) -> Option<(usize, usize, u32)> {
        if self.entries.is_empty() {
            return None;
        }
        let b = text.as_bytes();
        for i in from..b.len() {
            if self.first_byte[b[i] as usize] {
                for (s, id) in &self.entries {
                    if b[i..].starts_with(s.as_bytes()) {
                        return Some((i, i + s.len(), *id));
                    }
                }
            }
        }
        None
    }
}

/// Length byte of a decode-table entry for a token longer than 15 bytes.
const LONG_TOKEN: u8 = 254;
/// Length byte of a decode-table entry for an id with no token.
const ABSENT_TOKEN: u8 = 255;
const ABSENT_ENTRY: [u8; 16] = {
    let mut e = [0u8; 16];
    e[15] = ABSENT_TOKEN;
    e
};

/// An exact tokenizer: byte-level BPE (GPT-2, SmolLM2, Llama 3, cl100k_base, o200k_base), or
/// from GGUF one of llama.cpp's SPM (`llama`), WordPiece (`bert`) and Unigram (`t5`) models.
///
/// For the non-BPE models, [`Tokenizer::token_bytes`] and decoding give a token's text as
/// llama.cpp's `token_to_piece` does (`▁` as a space, `<0xXX>` as its byte), and user-defined
/// tokens (GGUF token type 4) are split out of text even by [`Tokenizer::encode`], as llama.cpp
/// does with `parse_special = false`.
///
/// `Send + Sync`; share it behind an `Arc`. Encoding never fails and never panics: every
/// string has an encoding. Text is never turned into special tokens by [`Tokenizer::encode`];
/// only [`Tokenizer::encode_with_specials`] does that, for text the caller trusts.
///
/// ```
/// use token_stream::Tokenizer;
/// // A toy vocabulary in tiktoken's rank-file format: the 256 bytes, then "ab" and "abc".
/// let mut ranks = String::new();
/// for b in 0..=255u8 {
///     ranks += &format!("{} {}\n", token_stream::base64_encode(&[b]), b);
/// }
/// ranks += &format!("{} 256\n{} 257\n", token_stream::base64_encode(b"ab"), token_stream::base64_encode(b"abc"));
/// let tok = Tokenizer::from_tiktoken(&ranks, token_stream::Pretokenizer::Cl100k, &[("<|end|>", 258)])?;
/// let ids = tok.encode("abc ab<|end|>");
/// assert_eq!(ids.as_slice(), &[257, 32, 256, 60, 124, 101, 110, 100, 124, 62]);
/// assert_eq!(tok.encode_with_specials("ab<|end|>").as_slice(), &[256, 258]);
/// assert_eq!(tok.decode(&ids)?, "abc ab<|end|>");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Tokenizer {
    pretok: Pretokenizer,
    /// All token bytes back to back; token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    /// Whether id `i` exists (holes in tiktoken's id space do not).
    present: Vec<bool>,
    /// Decode table: token `i`'s bytes inline in `[..15]` and their length in `[15]` when it is
    /// at most 15 bytes long, else [`LONG_TOKEN`] (use `bytes`/`offsets`), or [`ABSENT_TOKEN`].
    /// Decoding copies all 16 bytes at once and advances by the length.
    short: Vec<[u8; 16]>,
    is_special: Vec<bool>,
    /// Initial symbol for each byte value (`NONE`: dropped or `unk`).
    byte_ids: [u32; 256],
    merges: Merges,
    /// Pieces that encode to exactly one token, looked up before merging.
    whole: WholeTokens,
    /// The linear-time encoder for long pieces of byte-level vocabularies (`None`: every piece
    /// is merged; see [`Tokenizer::build_backtrack`]).
    backtrack: Option<Backtrack>,
    /// Whether a piece the backtracking encoder takes must still be looked up in `whole` first:
    /// true when `whole` has tokens that merging does not reproduce (tiktoken's ranks can leave
    /// some; merges ignored), which backtracking would spell otherwise. When false, the lookup is
    /// skipped: backtracking spells a piece that is a reachable token as that token.
    whole_before_backtrack: bool,
    /// Whether every byte value has a one-byte token (the backtracking encoder needs each
    /// byte of a piece to have one).
    every_byte_has_token: bool,
    specials: Specials,
    /// Special tokens that plain text matches too (llama.cpp's user-defined tokens).
    user_defined: Specials,
    unk: Option<u32>,
    fuse_unk: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    chat_template: Option<String>,
    /// Raw-UTF-8 vocabularies ([`Pretokenizer::byte_encoded`] false): the token of each
    /// character that is one; merging starts from characters, not bytes.
    char_ids: FxHashMap<u32, u32>,
    /// Why the pre-tokenizer is not the one the source named, if it is not.
    pretok_fallback: Option<&'static str>,
    /// The algorithm (BPE unless a non-BPE loader set another).
    algo: Algo,
    /// End-of-generation ids, sorted.
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// Appended by [`Tokenizer::encode_for_model`] when `add_eos` (EOS unless the model says).
    end_token: Option<u32>,
    /// Decoding drops one leading space of the first token (SPM with `add_space_prefix`).
    strip_leading_space: bool,
}

/// The non-BPE parts a loader passes to [`Tokenizer::with_algo`].
#[derive(Debug)]
pub(crate) struct ModelParts {
    pub(crate) algo: Algo,
    /// Tokens split out of plain text too (user-defined tokens).
    pub(crate) user_defined: Vec<(String, u32)>,
    pub(crate) add_bos: bool,
    pub(crate) add_eos: bool,
    /// What [`Tokenizer::encode_for_model`] appends when `add_eos` (EOS; WordPiece: `[SEP]`).
    pub(crate) end_token: Option<u32>,
    pub(crate) strip_leading_space: bool,
}

impl Tokenizer {
    /// Replaces the algorithm of a tokenizer built by [`Tokenizer::from_spec`] (its tables are
    /// the common part: token bytes = decoded pieces, specials, BOS/EOS).
    pub(crate) fn with_algo(mut self, parts: ModelParts) -> Self {
        self.algo = parts.algo;
        self.user_defined = Specials::new(parts.user_defined);
        self.add_bos = parts.add_bos;
        self.add_eos = parts.add_eos;
        self.end_token = parts.end_token;
        self.strip_leading_space = parts.strip_leading_space;
        self.whole = WholeTokens::default();
        self.backtrack = None;
        self
    }

    /// Makes special (and user-defined) token `id` take the whitespace before it (`left`, HF's
    /// `lstrip`) and after it (`right`, `rstrip`) into its match when cut out of text.
    pub(crate) fn set_whitespace_strip(&mut self, id: u32, left: bool, right: bool) {
        if left || right {
            self.specials.strip.insert(id, (left, right));
            self.user_defined.strip.insert(id, (left, right));
        }
    }

    /// Adds ids to the end-of-generation set (EOT, EOM, ...); ids outside the vocabulary are
    /// ignored.
    pub(crate) fn extend_eog(&mut self, ids: impl IntoIterator<Item = Option<u32>>) {
        for id in ids.into_iter().flatten() {
            if (id as usize) < self.vocab_size() && !self.eog.contains(&id) {
                self.eog.push(id);
            }
        }
        self.eog.sort_unstable();
    }

    /// Removes ids from the end-of-generation set.
    pub(crate) fn remove_eog(&mut self, ids: &[u32]) {
        self.eog.retain(|id| !ids.contains(id));
    }

    pub(crate) fn from_spec(spec: Spec) -> Self {
        let n = spec.tokens.len();
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        let mut present = Vec::with_capacity(n);
        offsets.push(0u32);
        for t in &spec.tokens {
            if let Some(t) = t {
                bytes.extend_from_slice(t);
            }
            present.push(t.is_some());
            offsets.push(u32::try_from(bytes.len()).expect("vocabulary under 4 GiB"));
        }
        let short = spec
            .tokens
            .iter()
            .map(|t| {
                let mut e = [0u8; 16];
                e[15] = match t {
                    None => ABSENT_TOKEN,
                    Some(t) if t.len() < 16 => {
                        e[..t.len()].copy_from_slice(t);
                        t.len() as u8
                    }
                    Some(_) => LONG_TOKEN,
                };
                e
            })
            .collect();
        let mut is_special = vec![false; n];
        for &(_, id) in &spec.specials {
            is_special[id as usize] = true;
        }
        // Regular token bytes -> id (first id wins for duplicates, as in HF's vocab map).
        let mut is_byte_token = vec![false; n];
        for &(_, id) in &spec.byte_tokens {
            is_byte_token[id as usize] = true;
        }
        for &id in &spec.unreachable {
            is_byte_token[id as usize] = true;
        }
        let mut by_bytes: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
        by_bytes.reserve(n);
        for (id, t) in spec.tokens.iter().enumerate() {
            if let Some(t) = t
                && !is_special[id]
                && !is_byte_token[id]
                && !t.is_empty()
            {
                by_bytes
                    .entry(t.clone().into_boxed_slice())
                    .or_insert(id as u32);
            }
        }
        let mut byte_ids = [NONE; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            if let Some(&id) = by_bytes.get(&[b as u8][..]) {
                *slot = id;
            } else if spec.byte_fallback
                && let Some(&id) = by_bytes.get(format!("<0x{b:02X}>").as_bytes())
            {
                *slot = id;
            }
        }
        let char_level = !spec.pretok.byte_encoded();
        let mut char_ids = FxHashMap::default();
        if char_level {
            // Symbols are characters; a character without a token is spelled with its bytes'
            // `<0xXX>` tokens (dropped where there is none), as llama.cpp does.
            byte_ids = [NONE; 256];
            for &(b, id) in &spec.byte_tokens {
                byte_ids[b as usize] = id;
            }
            for (t, &id) in &by_bytes {
                if let Ok(text) = std::str::from_utf8(t) {
                    let mut chars = text.chars();
                    if let (Some(c), None) = (chars.next(), chars.next()) {
                        char_ids.insert(c as u32, id);
                    }
                }
            }
        }
        let mut merges = Merges::default();
        match &spec.merges {
            MergeSpec::Pairs(pairs) => {
                for (rank, &(a, b)) in pairs.iter().enumerate() {
                    let (ta, tb) = (&spec.tokens[a as usize], &spec.tokens[b as usize]);
                    if let (Some(ta), Some(tb)) = (ta, tb) {
                        let mut cat = ta.clone();
                        cat.extend_from_slice(tb);
                        if let Some(&m) = by_bytes.get(&cat[..]) {
                            merges.insert(a, b, rank as u32, m);
                        }
                    }
                }
            }
            MergeSpec::FromRanks => {
                for (id, t) in spec.tokens.iter().enumerate() {
                    let Some(t) = t else { continue };
                    if is_special[id] || t.len() < 2 {
                        continue;
                    }
                    for k in 1..t.len() {
                        if let (Some(&a), Some(&b)) = (by_bytes.get(&t[..k]), by_bytes.get(&t[k..]))
                        {
                            merges.insert(a, b, id as u32, id as u32);
                        }
                    }
                }
            }
        }
        let mut tok = Self {
            pretok: spec.pretok,
            bytes,
            offsets,
            present,
            short,
            is_special,
            byte_ids,
            merges,
            whole: WholeTokens::default(),
            backtrack: None,
            whole_before_backtrack: true,
            every_byte_has_token: false,
            specials: Specials::new(spec.specials),
            user_defined: Specials::new(spec.user_defined),
            unk: spec.unk,
            fuse_unk: spec.fuse_unk,
            bos: spec.bos,
            eos: spec.eos,
            chat_template: spec.chat_template,
            char_ids,
            pretok_fallback: None,
            algo: Algo::Bpe,
            eog: Vec::new(),
            add_bos: false,
            add_eos: false,
            end_token: spec.eos,
            strip_leading_space: false,
        };
        let named = spec
            .tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| {
                t.as_deref()
                    .is_some_and(|t| EOG_NAMES.iter().any(|n| n.as_bytes() == t))
            })
            .map(|(id, _)| Some(id as u32));
        let named: Vec<_> = named.collect();
        tok.extend_eog(std::iter::once(spec.eos).chain(named));
        // The whole-piece table: every token when merges are ignored (tiktoken), otherwise the
        // tokens that merging their own bytes reproduces (so the shortcut cannot change results).
        let mut whole = WholeTokens::default();
        let mut reachable = Vec::new();
        let mut scratch = Vec::new();
        for (t, id) in by_bytes {
            if t.len() < 2 {
                continue;
            }
            // llama.cpp's Gemma 4 rule: a piece of newlines that is a token is that token.
            let newlines_whole = spec
                .pretok
                .llama_entry()
                .is_some_and(|e| e.newline_pieces_whole)
                && t.iter().all(|&b| b == b'\n');
            let split = tok.last_merge(&t, &mut scratch);
            let merges_whole = match split {
                Some((a, b)) => tok.merges.get(a, b).1 == id,
                None => {
                    scratch.clear();
                    tok.bpe_piece(&t, &mut scratch, &mut Work::default());
                    scratch.len() == 1 && scratch[0] == id
                }
            };
            if let Some(split) = split.filter(|_| merges_whole) {
                reachable.push((t.clone(), id, split));
            }
            if spec.ignore_merges || newlines_whole || merges_whole {
                whole.insert(t, id);
            }
        }
        tok.whole_before_backtrack = whole.len() != reachable.len();
        tok.whole = whole;
        tok.every_byte_has_token = tok.byte_ids.iter().all(|&id| id != NONE);
        tok.backtrack = tok.build_backtrack(&reachable);
        tok
    }

    /// The two tokens that merging the bytes of token `t` leaves before its last merge, when
    /// every byte has a token and it gets that far (byte-level vocabularies only).
    fn last_merge(&self, t: &[u8], symbols: &mut Vec<u32>) -> Option<(u32, u32)> {
        if !self.char_ids.is_empty() {
            return None;
        }
        symbols.clear();
        for &b in t {
            let id = self.byte_ids[b as usize];
            if id == NONE {
                return None;
            }
            symbols.push(id);
        }
        bpe::merge_down_to(symbols, &self.merges, 2);
        match symbols[..] {
            [a, b] => Some((a, b)),
            _ => None,
        }
    }

    /// The backtracking encoder over the one-byte tokens and `merged` (every token of two or
    /// more bytes that merging reproduces, with its last merge), for byte-level vocabularies
    /// whose merge trees rank rising to the root (where [`Backtrack`] is exact); `None` for
    /// others (they keep merging every piece).
    fn build_backtrack(&self, merged: &[MergedToken]) -> Option<Backtrack> {
        if !self.char_ids.is_empty() || merged.is_empty() {
            return None;
        }
        let bytes: Vec<[u8; 1]> = (0..=255u8).map(|b| [b]).collect();
        let singles = bytes
            .iter()
            .zip(self.byte_ids)
            .filter(|&(_, id)| id != NONE);
        let tokens = singles
            .map(|(b, id)| Reachable {
                bytes: b,
                id,
                split: None,
            })
            .chain(merged.iter().map(|(t, id, split)| Reachable {
                bytes: t,
                id: *id,
                split: Some(*split),
            }));
        match Backtrack::build(tokens, self.vocab_size(), &self.merges) {
            Ok(bt) => Some(bt),
            Err(why) => {
                tracing::debug!(?why, "byte-pair merging every piece: no backtracking");
                None
            }
        }
    }

    pub(crate) fn set_model_info(
        &mut self,
        bos: Option<u32>,
        eos: Option<u32>,
        chat_template: Option<String>,
    ) {
        self.bos = bos;
        self.eos = eos;
        self.chat_template = chat_template;
    }

    /// Sets what [`Tokenizer::encode_for_model`] adds (the BPE loaders; the others pass it in
    /// [`ModelParts`]).
    pub(crate) fn set_added_tokens(&mut self, add_bos: bool, add_eos: bool) {
        self.add_bos = add_bos;
        self.add_eos = add_eos;
    }

    pub(crate) fn set_pretokenizer_fallback(&mut self, note: Option<&'static str>) {
        self.pretok_fallback = note;
    }

    /// Why the pre-tokenizer differs from the one the source named, when it does: for a GGUF
    /// file without `tokenizer.ggml.pre`, llama.cpp's `default` is used (as llama.cpp does) and
    /// this says so. `None` when the source named the pre-tokenizer in use.
    pub fn pretokenizer_fallback(&self) -> Option<&str> {
        self.pretok_fallback
    }

    /// Number of ids (the largest id + 1), holes included.
    pub fn vocab_size(&self) -> usize {
        self.present.len()
    }

    /// Number of merge rules.
    pub fn merge_count(&self) -> usize {
        self.merges.len()
    }

    /// The pre-tokenizer in use (BPE; meaningless for the non-BPE models, which split no text).
    pub fn pretokenizer(&self) -> Pretokenizer {
        self.pretok
    }

    /// Beginning-of-sequence token, if the vocabulary declares one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token, if the vocabulary declares one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-generation ids, sorted: EOS, EOT, EOM, for GGUF vocabularies the FIM pad, repo
    /// and file-separator tokens, and the tokens llama.cpp treats as ending generation by name
    /// (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, `<|endoftext|>`, `</s>`, ...; not Gemma
    /// 4's `</s>` nor o200k-harmony's `<|end|>`, as in llama.cpp).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether generating `id` ends generation (see [`Tokenizer::eog_ids`]).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Whether the model expects BOS before a prompt (`tokenizer.ggml.add_bos_token`; for
    /// GGUF vocabularies without the key, llama.cpp's default for the model: true for SPM and
    /// WordPiece, false for BPE except the Llama 3 family's, Tekken's and Chameleon's
    /// pre-tokenizers; always true for Gemma 4, as llama.cpp forces it). Used by
    /// [`Tokenizer::encode_for_model`].
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Whether the model expects a token after a prompt: EOS when `tokenizer.ggml.add_eos_token`
    /// (default false); WordPiece (BERT) always ends with its separator `[SEP]`. Used by
    /// [`Tokenizer::encode_for_model`].
    pub fn add_eos(&self) -> bool {
        self.add_eos && self.end_token.is_some()
    }

    /// Encodes a prompt as the model expects it: BOS first when [`Tokenizer::add_bos`], EOS last
    /// when [`Tokenizer::add_eos`], the text in between as plain text ([`Tokenizer::encode`];
    /// no special-token parsing). This is llama.cpp's `tokenize(text, add_special = true,
    /// parse_special = false)`.
    pub fn encode_for_model(&self, text: &str) -> Tokens<'static> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos() {
            out.extend(self.bos);
        }
        self.encode_into(text, &mut out);
        if self.add_eos() {
            out.extend(self.end_token);
        }
        Tokens::from(out)
    }

    /// The model's Jinja chat template, if the source had one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Whether `id` is a special (control / added) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.is_special.get(id as usize).copied().unwrap_or(false)
    }

    /// The id of special token `text` (for example `"<|im_end|>"`).
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.specials
            .entries
            .iter()
            .find(|(s, _)| &**s == text)
            .map(|&(_, id)| id)
    }

    /// The bytes of token `id` (special tokens: their text).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        if *self.present.get(i)? {
            Some(&self.bytes[self.offsets[i] as usize..self.offsets[i + 1] as usize])
        } else {
            None
        }
    }

    /// Encodes `text` as plain text: special-token text such as `<|im_start|>` is encoded like
    /// any other characters.
    pub fn encode(&self, text: &str) -> Tokens<'static> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_into(text, &mut out);
        Tokens::from(out)
    }

    /// Appends the encoding of plain `text` to `out` (no special-token parsing).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        if !matches!(self.algo, Algo::Bpe) {
            self.encode_model(text, &self.user_defined, out);
            return;
        }
        let mut scratch = Vec::new();
        let mut work = Work::default();
        self.encode_plain(text, out, &mut scratch, &mut work);
    }

    /// Encodes `text`, turning special-token text into special ids (HF `encode`'s default,
    /// tiktoken's `allowed_special="all"`). Only for trusted text: never for user input.
    pub fn encode_with_specials(&self, text: &str) -> Tokens<'static> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_with_specials_into(text, &mut out);
        Tokens::from(out)
    }

    /// Appends the encoding of `text` with special-token parsing to `out`.
    pub fn encode_with_specials_into(&self, text: &str, out: &mut Vec<u32>) {
        if !matches!(self.algo, Algo::Bpe) {
            self.encode_model(text, &self.specials, out);
            return;
        }
        let mut scratch = Vec::new();
        let mut work = Work::default();
        self.specials.split_each(text, |segment| match segment {
            Segment::Text(plain) => self.encode_plain(plain, out, &mut scratch, &mut work),
            Segment::Token(id) => out.push(id),
        });
    }

    /// Finds special tokens in `text` from byte `from`: `(start, end, id)` of the first one.
    pub(crate) fn find_special(&self, text: &str, from: usize) -> Option<(usize, usize, u32)> {
        self.specials.find(text, from)
    }

    /// Encodes many texts on `threads` threads (plain text, no special parsing); output order
    /// follows input order.
    pub fn encode_batch<S: AsRef<str> + Sync>(
        &self,
        texts: &[S],
        threads: usize,
    ) -> Vec<Tokens<'static>> {
        let threads = threads.max(1).min(texts.len().max(1));
        if threads == 1 {
            return texts.iter().map(|t| self.encode(t.as_ref())).collect();
        }
        // Cut the batch into contiguous chunks of roughly equal byte counts.
        let total: usize = texts.iter().map(|t| t.as_ref().len()).sum();
        let per = total / threads + 1;
        let mut bounds = vec![0usize];
        let mut acc = 0;
        for (i, t) in texts.iter().enumerate() {
            acc += t.as_ref().len();
            if acc >= per * bounds.len() && bounds.len() < threads {
                bounds.push(i + 1);
            }
        }
        bounds.push(texts.len());
        bounds.dedup();
        let mut results: Vec<Vec<Tokens<'static>>> = Vec::new();
        std::thread::scope(|scope| {
            let handles: Vec<_> = bounds
                .windows(2)
                .map(|w| {
                    let chunk = &texts[w[0]..w[1]];
                    scope.spawn(move || {
                        chunk
                            .iter()
                            .map(|t| self.encode(t.as_ref()))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in handles {
                results.push(h.join().expect("encode does not panic"));
            }
        });
        results.into_iter().flatten().collect()
    }

    /// Encodes plain `text` merging every piece, never backtracking: the reference that the
    /// backtracking encoder (long pieces of byte-level vocabularies) is tested against. For
    /// SentencePiece (`llama`) vocabularies: llama.cpp's merge loop over each whole fragment,
    /// every pair looked up by its text, the reference for the encoder's shortcuts.
    #[doc(hidden)]
    pub fn encode_merging_only(&self, text: &str) -> Vec<u32> {
        if let Algo::Spm(m) = &self.algo {
            let mut out = Vec::with_capacity(text.len() / 3 + 1);
            self.user_defined.split_each(text, |segment| match segment {
                Segment::Text(raw) => m.encode_reference(raw, m.add_space_prefix, &mut out),
                Segment::Token(id) => out.push(id),
            });
            return out;
        }
        self.encode_in_mode(text, |w| w.merge_only = true)
    }

    /// Encodes plain `text` spelling every piece that is not a whole token by backtracking
    /// (where the vocabulary allows it), to test the backtracking encoder on short and ASCII
    /// pieces too.
    #[doc(hidden)]
    pub fn encode_backtracking_everywhere(&self, text: &str) -> Vec<u32> {
        self.encode_in_mode(text, |w| w.backtrack_all = true)
    }

    /// Plain `text` encoded with a BPE work state that `mode` set up (other algorithms: as
    /// [`encode`](Self::encode)).
    fn encode_in_mode(&self, text: &str, mode: impl FnOnce(&mut Work)) -> Vec<u32> {
        // Sized as `encode` sizes it, so that the bench compares the encoders, not allocations.
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        if !matches!(self.algo, Algo::Bpe) {
            self.encode_into(text, &mut out);
            return out;
        }
        let mut work = Work::default();
        mode(&mut work);
        self.encode_plain(text, &mut out, &mut Vec::new(), &mut work);
        out
    }

    /// Whether long pieces are spelled by backtracking rather than merged.
    #[doc(hidden)]
    pub fn backtracks(&self) -> bool {
        self.backtrack.is_some()
    }

    /// Encode with an operation count (merge-loop steps), for complexity tests.
    #[doc(hidden)]
    pub fn encode_counting_work(&self, text: &str) -> (Vec<u32>, u64) {
        let mut out = Vec::new();
        if !matches!(self.algo, Algo::Bpe) {
            // Only BPE counts its steps.
            self.encode_into(text, &mut out);
            return (out, 0);
        }
        let mut scratch = Vec::new();
        let mut work = Work::default();
        self.encode_plain(text, &mut out, &mut scratch, &mut work);
        (out, work.count)
    }

    /// Non-BPE encoding, as llama.cpp's `tokenize`: `split` tokens are cut out of the text
    /// first; each raw fragment is tokenized by the algorithm (SPM puts a space before a
    /// fragment (each starts the text or follows a special token) when `add_space_prefix` is set).
    fn encode_model(&self, text: &str, split: &Specials, out: &mut Vec<u32>) {
        let mut spm_scratch = SpmScratch::default();
        let mut work = Work::default();
        // A raw fragment always starts the text or follows a special token.
        split.split_each(text, |segment| match segment {
            Segment::Text(raw) => match &self.algo {
                Algo::Bpe => {}
                Algo::Spm(m) => m.encode(raw, m.add_space_prefix, out, &mut spm_scratch),
                // `Metaspace` with prepend scheme `first` needs to know the fragment at offset 0.
                Algo::HfSpm(m) => m.encode(raw, raw.as_ptr() == text.as_ptr(), out, &mut work),
                Algo::Wpm(m) => m.encode(raw, out),
                Algo::Ugm(m) => m.encode(raw, out),
            },
            Segment::Token(id) => out.push(id),
        });
    }

    fn encode_plain(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut Vec<u32>,
        work: &mut Work,
    ) {
        self.user_defined.split_each(text, |segment| match segment {
            Segment::Text(raw) => self.encode_segment(raw, out, scratch, work),
            Segment::Token(id) => out.push(id),
        });
    }

    fn encode_segment(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut Vec<u32>,
        work: &mut Work,
    ) {
        if self.pretok.escapes_whitespace() && text.contains(' ') {
            let escaped = text.replace(' ', "\u{2581}");
            return self.encode_pieces(&escaped, out, scratch, work);
        }
        self.encode_pieces(text, out, scratch, work);
    }

    fn encode_pieces(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut Vec<u32>,
        work: &mut Work,
    ) {
        for piece in self.pretok.split(text) {
            let p = piece.as_bytes();
            if p.len() == 1 && self.char_ids.is_empty() {
                let id = self.byte_ids[p[0] as usize];
                if id != NONE {
                    out.push(id);
                } else if let Some(u) = self.unk {
                    out.push(u);
                }
                continue;
            }
            let backtrack = self.backtrack_for(p, work);
            if (backtrack.is_none() || self.whole_before_backtrack)
                && let Some(id) = self.whole.get(p)
            {
                out.push(id);
                continue;
            }
            scratch.clear();
            self.bpe_piece_with(p, backtrack, scratch, work);
            out.extend_from_slice(scratch);
        }
    }

    /// The backtracking encoder, if it is to spell `piece` (long pieces with a non-ASCII byte,
    /// of a vocabulary that has one, unless `work` asks for another mode).
    #[inline]
    fn backtrack_for(&self, piece: &[u8], work: &Work) -> Option<&Backtrack> {
        let bt = self.backtrack.as_ref()?;
        let wanted = if work.backtrack_all {
            true
        } else {
            piece.len() >= BACKTRACK_FROM && !work.merge_only && !piece.is_ascii()
        };
        let spellable = || {
            self.every_byte_has_token || piece.iter().all(|&b| self.byte_ids[b as usize] != NONE)
        };
        (wanted && spellable()).then_some(bt)
    }

    /// Encodes one piece's bytes into `out` (which must be empty).
    fn bpe_piece(&self, piece: &[u8], out: &mut Vec<u32>, work: &mut Work) {
        self.bpe_piece_with(piece, self.backtrack_for(piece, work), out, work);
    }

    /// Encodes one piece's bytes into `out` (which must be empty): by `backtrack` when given
    /// (see [`Tokenizer::backtrack_for`]), by merging otherwise.
    fn bpe_piece_with(
        &self,
        piece: &[u8],
        backtrack: Option<&Backtrack>,
        out: &mut Vec<u32>,
        work: &mut Work,
    ) {
        if !self.char_ids.is_empty() {
            self.char_symbols(piece, out);
            work.count += piece.len() as u64;
            bpe::merge(out, &self.merges, work);
            return;
        }
        if let Some(bt) = backtrack
            && bt.encode(piece, out, &mut work.open, &mut work.count)
        {
            return;
        }
        out.clear();
        let mut last_unk = false;
        for &b in piece {
            let id = self.byte_ids[b as usize];
            if id != NONE {
                out.push(id);
                last_unk = false;
            } else if let Some(u) = self.unk {
                if !(self.fuse_unk && last_unk) {
                    out.push(u);
                }
                last_unk = true;
            }
        }
        work.count += piece.len() as u64;
        bpe::merge(out, &self.merges, work);
    }

    /// Initial symbols of a raw-UTF-8 piece: each character's token, or its bytes' `<0xXX>`
    /// tokens when it has none.
    fn char_symbols(&self, piece: &[u8], out: &mut Vec<u32>) {
        let mut i = 0;
        while i < piece.len() {
            let (c, l) = crate::unicode::decode_at(piece, i);
            match self.char_ids.get(&c) {
                Some(&id) => out.push(id),
                None => out.extend(
                    piece[i..i + l]
                        .iter()
                        .map(|&b| self.byte_ids[b as usize])
                        .filter(|&id| id != NONE),
                ),
            }
            i += l;
        }
    }

    /// Decodes ids to bytes (special tokens contribute their text).
    ///
    /// SPM vocabularies with `add_space_prefix`: one leading space of the first token's text is
    /// dropped, as llama.cpp's detokenizer does, so `decode(encode(s)) == s`.
    pub fn decode_bytes_into(&self, ids: &[u32], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        let start = out.len();
        self.decode_table(ids, out)?;
        if self.strip_leading_space
            && out.get(start) == Some(&b' ')
            && ids
                .first()
                .and_then(|&id| self.token_bytes(id))
                .is_some_and(|t| t.first() == Some(&b' '))
        {
            out.remove(start);
        }
        Ok(())
    }

    fn decode_table(&self, ids: &[u32], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        // Every short token is one fixed 16-byte copy into room made up front; `pos` then moves
        // by the token's real length. Invariant before token k: out.len() >= pos + 16 * (n - k).
        let mut pos = out.len();
        out.resize(pos + ids.len() * 16, 0);
        for (k, &id) in ids.iter().enumerate() {
            let e = self.short.get(id as usize).unwrap_or(&ABSENT_ENTRY);
            let len = e[15];
            if len < 16 {
                out[pos..pos + 16].copy_from_slice(e);
                pos += len as usize;
                continue;
            }
            if len == ABSENT_TOKEN {
                out.truncate(pos);
                return Err(DecodeError::UnknownId {
                    id,
                    vocab_size: self.vocab_size(),
                });
            }
            let i = id as usize;
            let t = &self.bytes[self.offsets[i] as usize..self.offsets[i + 1] as usize];
            let need = pos + t.len() + 16 * (ids.len() - k - 1);
            if need > out.len() {
                out.resize(need, 0);
            }
            out[pos..pos + t.len()].copy_from_slice(t);
            pos += t.len();
        }
        out.truncate(pos);
        Ok(())
    }

    /// Decodes ids to bytes.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, DecodeError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        self.decode_bytes_into(ids, &mut out)?;
        Ok(out)
    }

    /// Decodes ids to text; byte sequences that are not UTF-8 become U+FFFD (as HF's byte-level
    /// decoder and tiktoken's `decode` with `errors="replace"` do; for a SentencePiece-style
    /// `tokenizer.json`, one U+FFFD per byte token of an invalid run, as HF's `ByteFallback`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, DecodeError> {
        let b = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(b) {
            Ok(s) => s,
            Err(e) => match &self.algo {
                Algo::HfSpm(m) => m.decode_invalid(self, ids, self.strip_leading_space),
                _ => String::from_utf8_lossy(e.as_bytes()).into_owned(),
            },
        })
    }
}
