//! Unigram as llama.cpp tokenizes it (`tokenizer.ggml.model = t5`): the text is normalized with
//! SentencePiece's precompiled character map (`tokenizer.ggml.precompiled_charsmap`: a
//! XOR-compressed double-array trie of byte prefixes and their replacement strings), spaces
//! become `▁` (optionally merged, with one put in front), then a Viterbi pass picks the
//! segmentation with the highest total score; a character no token covers is the unknown token
//! at the lowest normal score minus 10, and runs of unknown tokens are fused into one.

use rustc_hash::FxHashMap;

use crate::error::LoadError;
use crate::load::GgufVocab;
use crate::spm::SPACE_MARK;
use crate::tokenizer::{Algo, ModelParts, Tokenizer};
use crate::vocab::{Checked, TYPE_NORMAL, TYPE_UNUSED, TYPE_USER_DEFINED};

/// The precompiled character map: the double array and the replacement strings.
#[derive(Debug, Default)]
struct CharsMap {
    /// Packed double-array nodes (BASE, LCHECK, LEAF bits).
    nodes: Vec<u32>,
    /// NUL-terminated replacement strings, indexed by the leaves' values.
    replacements: Vec<u8>,
}

impl CharsMap {
    /// Parses `<u32 LE size><size bytes of nodes><replacements>`; `None` if malformed.
    fn parse(blob: &[u8]) -> Option<Self> {
        let size = u32::from_le_bytes(blob.get(..4)?.try_into().ok()?) as usize;
        let nodes_end = 4usize.checked_add(size)?;
        if !size.is_multiple_of(4) || nodes_end >= blob.len() {
            return None;
        }
        let nodes = blob[4..nodes_end]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Some(Self {
            nodes,
            replacements: blob[nodes_end..].to_vec(),
        })
    }

    fn node(&self, i: usize) -> Option<u32> {
        self.nodes.get(i).copied()
    }

    /// The longest prefix of `input` the map replaces: (prefix length, replacement).
    fn longest(&self, input: &[u8]) -> Option<(usize, &[u8])> {
        if self.nodes.is_empty() {
            return None;
        }
        let base = |n: u32| (n >> 10) << ((n & (1 << 9)) >> 6);
        let mut index = base(self.node(0)?) as usize;
        let mut best = None;
        for (k, &c) in input.iter().enumerate() {
            if c == 0 {
                break;
            }
            index ^= c as usize;
            let n = self.node(index)?;
            if n & ((1 << 31) | 0xff) != u32::from(c) {
                break;
            }
            let leaf = (n >> 8) & 1 == 1;
            index ^= base(n) as usize;
            if leaf {
                let value = self.node(index)? & ((1 << 31) - 1);
                best = Some((k + 1, value as usize));
            }
        }
        let (len, offset) = best?;
        let rest = self.replacements.get(offset..)?;
        let end = rest.iter().position(|&b| b == 0)?;
        Some((len, &rest[..end]))
    }
}

/// The Unigram model.
#[derive(Debug)]
pub(crate) struct UgmModel {
    /// Normal, user-defined and unused tokens by text.
    ids: FxHashMap<Box<[u8]>, u32>,
    /// Score used in the Viterbi pass (user-defined tokens: 0).
    scores: Vec<f64>,
    max_len: usize,
    /// User-defined token texts, kept whole by normalization (longest first).
    user_defined: Vec<Box<[u8]>>,
    unk: u32,
    unk_score: f64,
    charsmap: CharsMap,
    add_space_prefix: bool,
    remove_extra_whitespaces: bool,
}

impl UgmModel {
    /// Normalizes `input` as llama.cpp's UGM session does.
    fn normalize(&self, input: &[u8], out: &mut Vec<u8>) {
        out.clear();
        let mut space_prepended = false;
        let mut in_word = false;
        let mut pos = 0;
        while pos < input.len() {
            let rest = &input[pos..];
            let (piece, consumed): (&[u8], usize) =
                if let Some(u) = self.user_defined.iter().find(|u| rest.starts_with(u)) {
                    (u, u.len())
                } else if let Some((len, repl)) = self.charsmap.longest(rest) {
                    (repl, len)
                } else {
                    let len = utf8_char_len(rest);
                    if len == 0 {
                        ("\u{FFFD}".as_bytes(), 1)
                    } else {
                        (&rest[..len], len)
                    }
                };
            for &c in piece {
                if c != b' ' {
                    if !in_word {
                        in_word = true;
                        if (self.add_space_prefix && !space_prepended)
                            || self.remove_extra_whitespaces
                        {
                            out.extend_from_slice(SPACE_MARK);
                            space_prepended = true;
                        }
                    }
                    out.push(c);
                } else {
                    in_word = false;
                    if !self.remove_extra_whitespaces {
                        out.extend_from_slice(SPACE_MARK);
                    }
                }
            }
            pos += consumed;
        }
    }

    /// Encodes one raw fragment, appending ids to `out`.
    pub(crate) fn encode(&self, raw: &str, out: &mut Vec<u32>) {
        let mut text = Vec::with_capacity(raw.len() + 8);
        self.normalize(raw.as_bytes(), &mut text);
        let n = text.len();
        if n == 0 {
            return;
        }
        // best[i]: (token, start, score) of the best segmentation of text[..i].
        let mut best = vec![(self.unk, 0usize, f64::MIN); n + 1];
        best[0] = (self.unk, 0, 0.0);
        let mut start = 0;
        while start < n {
            let char_len = utf8_lead_len(text[start]).min(n - start);
            let base = best[start].2;
            let mut whole_char = false;
            for end in start + 1..=n.min(start + self.max_len) {
                if let Some(&id) = self.ids.get(&text[start..end]) {
                    if end - start == char_len {
                        whole_char = true;
                    }
                    let score = base + self.scores[id as usize];
                    if score > best[end].2 {
                        best[end] = (id, start, score);
                    }
                }
            }
            if !whole_char {
                let end = start + char_len;
                let score = base + self.unk_score;
                if score > best[end].2 {
                    best[end] = (self.unk, start, score);
                }
            }
            start += char_len;
        }
        let first = out.len();
        let mut at = n;
        let mut prev_unk = false;
        loop {
            let (id, from, _) = best[at];
            let unk = id == self.unk;
            if !(prev_unk && unk) {
                out.push(id);
            }
            if from == 0 {
                break;
            }
            prev_unk = unk;
            at = from;
        }
        out[first..].reverse();
    }
}

fn utf8_lead_len(lead: u8) -> usize {
    const LOOKUP: [usize; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4];
    LOOKUP[(lead >> 4) as usize]
}

/// Length of the valid UTF-8 character at the start of `s`, 0 if it is not valid.
fn utf8_char_len(s: &[u8]) -> usize {
    let len = utf8_lead_len(s[0]);
    if s[0] & 0xC0 == 0x80 || len > s.len() {
        return 0;
    }
    match std::str::from_utf8(&s[..len]) {
        Ok(_) => len,
        Err(_) => 0,
    }
}

/// Builds a Unigram tokenizer from GGUF metadata (`tokenizer.ggml.model = t5`), with llama.cpp's
/// defaults: EOS 1, unknown 2, no BOS added, EOS added, `add_space_prefix` and
/// `remove_extra_whitespaces` false unless the metadata says otherwise.
pub(crate) fn from_gguf_vocab(v: &GgufVocab<'_>) -> Result<Tokenizer, LoadError> {
    let vocab = Checked::new(v, true)?;
    let bos = vocab.id("tokenizer.ggml.bos_token_id", v.bos, None)?;
    let eos = vocab.id("tokenizer.ggml.eos_token_id", v.eos, Some(1))?;
    let unk = vocab
        .id("tokenizer.ggml.unknown_token_id", v.unknown, Some(2))?
        .ok_or(LoadError::MissingField {
            field: "tokenizer.ggml.unknown_token_id",
        })?;
    let eog = vocab.eot_eom()?;
    let charsmap = match v.precompiled_charsmap {
        None | Some([]) => CharsMap::default(),
        Some(blob) => CharsMap::parse(blob).ok_or(LoadError::MissingField {
            field: "tokenizer.ggml.precompiled_charsmap",
        })?,
    };
    let n = vocab.n;
    let mut ids: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
    let mut scores = Vec::with_capacity(n);
    let mut user_defined: Vec<Box<[u8]>> = Vec::new();
    let (mut min_score, mut max_len) = (f32::MAX, 0);
    for (id, &text) in v.tokens.iter().enumerate() {
        let ty = vocab.token_type(id);
        if ty == TYPE_USER_DEFINED && !text.is_empty() {
            user_defined.push(text.as_bytes().into());
        }
        if ty == TYPE_NORMAL {
            min_score = min_score.min(v.scores[id]);
        }
        if matches!(ty, TYPE_NORMAL | TYPE_USER_DEFINED | TYPE_UNUSED) && !text.is_empty() {
            ids.entry(text.as_bytes().into()).or_insert(id as u32);
            max_len = max_len.max(text.len());
        }
        scores.push(if ty == TYPE_USER_DEFINED {
            0.0
        } else {
            f64::from(v.scores[id])
        });
    }
    user_defined.sort_by_key(|u| std::cmp::Reverse(u.len()));
    let add_space_prefix = v.add_space_prefix.unwrap_or(false);
    let model = UgmModel {
        ids,
        scores,
        max_len,
        user_defined,
        unk,
        unk_score: f64::from(min_score) - 10.0,
        charsmap,
        add_space_prefix,
        remove_extra_whitespaces: v.remove_extra_whitespaces.unwrap_or(false),
    };
    let parts = ModelParts {
        algo: Algo::Ugm(Box::new(model)),
        user_defined: Vec::new(),
        add_bos: v.add_bos.unwrap_or(false),
        add_eos: v.add_eos.unwrap_or(true),
        end_token: eos,
        strip_leading_space: add_space_prefix,
    };
    let mut tok = vocab.build(bos, eos, parts);
    tok.extend_eog(eog);
    Ok(tok)
}
