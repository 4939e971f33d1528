//! WordPiece as llama.cpp tokenizes it (`tokenizer.ggml.model = bert`): text is normalized
//! (each character replaced by the first character of its NFD decomposition, marks dropped,
//! lowercased to the first character of its lowercase mapping), split at whitespace, with
//! every punctuation character, ASCII symbol and CJK ideograph a word of its own; each word,
//! prefixed with `▁`, is cut greedily into the longest vocabulary tokens from the left (the
//! GGUF vocabulary spells word starts `▁word` and continuations without `##`). A word that
//! cannot be cut completely becomes the unknown token.

use std::sync::OnceLock;

use rustc_hash::FxHashMap;
use unicode_normalization::char::decompose_canonical;

use crate::error::LoadError;
use crate::load::GgufVocab;
use crate::spm::SPACE_MARK;
use crate::tokenizer::{Algo, ModelParts, Tokenizer};
use crate::unicode::class_ranges;
use crate::vocab::Checked;

/// The WordPiece model: token text lookup.
#[derive(Debug)]
pub(crate) struct WpmModel {
    /// Token text as stored (`▁` starts a word) -> id (first id wins).
    ids: FxHashMap<Box<[u8]>, u32>,
    /// Longest token text in bytes.
    max_len: usize,
    /// Emitted for a word that cannot be cut into tokens.
    unk: Option<u32>,
}

/// Character classes llama.cpp's WordPiece pre-processing looks at.
struct Classes {
    /// `\p{P}`.
    punctuation: Vec<(u32, u32)>,
    /// `\p{S}`.
    symbol: Vec<(u32, u32)>,
    /// `\p{M}`.
    mark: Vec<(u32, u32)>,
    /// `\p{C}` without `Cn` (and `Cs`, no `char`).
    control: Vec<(u32, u32)>,
}

fn classes() -> &'static Classes {
    static C: OnceLock<Classes> = OnceLock::new();
    C.get_or_init(|| {
        let ranges = |p: &str| class_ranges(&regex_syntax::parse(p).expect("class parses"));
        Classes {
            punctuation: ranges(r"\p{P}"),
            symbol: ranges(r"\p{S}"),
            mark: ranges(r"\p{M}"),
            // Unassigned code points (Cn) are not control here: llama.cpp marks them undefined.
            control: ranges(r"[\p{Cc}\p{Cf}\p{Co}]"),
        }
    })
}

fn in_ranges(ranges: &[(u32, u32)], c: u32) -> bool {
    let i = ranges.partition_point(|&(_, end)| end < c);
    ranges.get(i).is_some_and(|&(start, _)| start <= c)
}

/// CJK ideograph ranges WordPiece splits one character at a time (as HF's BERT normalizer, with
/// its 0x2B920 start of one range).
fn is_cjk(c: u32) -> bool {
    matches!(c,
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x20000..=0x2A6DF
        | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F
        | 0x2B920..=0x2CEAF
        | 0xF900..=0xFAFF
        | 0x2F800..=0x2FA1F)
}

impl WpmModel {
    pub(crate) fn new(texts: &[&str], unk: Option<u32>) -> Self {
        let mut ids: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
        ids.reserve(texts.len());
        let mut max_len = 0;
        for (id, t) in texts.iter().enumerate() {
            ids.entry(t.as_bytes().into()).or_insert(id as u32);
            max_len = max_len.max(t.len());
        }
        Self { ids, max_len, unk }
    }

    /// Encodes one raw fragment (no special tokens in it), appending ids to `out`.
    pub(crate) fn encode(&self, raw: &str, out: &mut Vec<u32>) {
        let cls = classes();
        let mut word: Vec<u8> = Vec::with_capacity(64);
        word.extend_from_slice(SPACE_MARK);
        let mut buf = [0u8; 4];
        for c in raw.chars() {
            let first = first_nfd(c);
            let cp = first as u32;
            if first.is_whitespace() {
                self.emit_word(&mut word, out);
                continue;
            }
            if cp == 0 || cp == 0xFFFD || in_ranges(&cls.control, cp) || in_ranges(&cls.mark, cp) {
                continue;
            }
            let lower = first.to_lowercase().next().unwrap_or(first);
            let s = lower.encode_utf8(&mut buf).as_bytes();
            if in_ranges(&cls.punctuation, cp)
                || (cp < 0x7F && in_ranges(&cls.symbol, cp))
                || is_cjk(cp)
            {
                self.emit_word(&mut word, out);
                word.extend_from_slice(s);
                self.emit_word(&mut word, out);
            } else {
                word.extend_from_slice(s);
            }
        }
        self.emit_word(&mut word, out);
    }

    /// Cuts the word in `word` (after its `▁`) into tokens, then leaves `word` as just `▁`.
    fn emit_word(&self, word: &mut Vec<u8>, out: &mut Vec<u32>) {
        let n = word.len();
        if n == SPACE_MARK.len() {
            return;
        }
        let before = out.len();
        let mut i = 0;
        while i < n {
            let mut j = n.min(i + self.max_len + 1);
            let mut found = None;
            while j > i {
                if let Some(&id) = self.ids.get(&word[i..j]) {
                    found = Some((id, j));
                    break;
                }
                j -= 1;
            }
            match found {
                Some((id, end)) => {
                    out.push(id);
                    i = end;
                }
                None => {
                    out.truncate(before);
                    break;
                }
            }
        }
        if out.len() == before {
            out.extend(self.unk);
        }
        word.truncate(SPACE_MARK.len());
    }
}

/// The first character of `c`'s canonical decomposition (`c` itself if it has none), as
/// llama.cpp's NFD table maps one code point to one.
fn first_nfd(c: char) -> char {
    let mut first = None;
    decompose_canonical(c, |d| {
        if first.is_none() {
            first = Some(d);
        }
    });
    first.unwrap_or(c)
}

/// Builds a WordPiece tokenizer from GGUF metadata (`tokenizer.ggml.model = bert`), with
/// llama.cpp's defaults: BOS (`[CLS]`) 101, unknown 100, separator 102; the model adds
/// `[CLS]` before and `[SEP]` after a prompt ([`Tokenizer::encode_for_model`]).
pub(crate) fn from_gguf_vocab(v: &GgufVocab<'_>) -> Result<Tokenizer, LoadError> {
    let vocab = Checked::new(v, false)?;
    let bos = vocab.id("tokenizer.ggml.bos_token_id", v.bos, Some(101))?;
    let eos = vocab.id("tokenizer.ggml.eos_token_id", v.eos, None)?;
    let unk = vocab.id("tokenizer.ggml.unknown_token_id", v.unknown, Some(100))?;
    let sep = vocab.id("tokenizer.ggml.seperator_token_id", v.separator, Some(102))?;
    let eog = vocab.eot_eom()?;
    let parts = ModelParts {
        algo: Algo::Wpm(WpmModel::new(&v.tokens, unk)),
        user_defined: Vec::new(),
        add_bos: true,
        add_eos: sep.is_some(),
        end_token: sep,
        strip_leading_space: false,
    };
    let mut tok = vocab.build(bos, eos, parts);
    tok.extend_eog(eog);
    Ok(tok)
}
