//! SentencePiece-style BPE from a HF `tokenizer.json` (Llama 2, Mistral, Gemma 2/3, Phi-3): model
//! `BPE` over raw UTF-8 tokens with `▁` (U+2581) for spaces and `<0xXX>` byte tokens, spaces
//! escaped by the normalizer (`Sequence[Prepend("▁"), Replace(" ", "▁")]`, or `Replace` alone)
//! or by a `Metaspace` pre-tokenizer, decoded by `Sequence[Replace("▁", " "), ByteFallback, Fuse,
//! Strip(" ", 1, 0)]`.
//!
//! Encoding follows HF `tokenizers` step by step, so ids are HF's: added tokens are cut out of the
//! text first; each piece between them is normalized (the `Prepend` normalizer puts `▁` before
//! every non-empty piece; `Metaspace` before the piece unless it already starts with `▁`, and with
//! prepend scheme `first` only for the piece at the start of the text); its characters become
//! their tokens (a character without one: its bytes' `<0xXX>` tokens, else `unk`), which are
//! merged by merge-list rank, lowest first, leftmost first among equals ([`crate::bpe::merge`],
//! the engine of the byte-level path).
//!
//! llama.cpp's SPM merges by token score instead ([`crate::spm`]). transformers ranks the merges
//! by the merged token's score, so the two orders agree except where two different splits of one
//! token are adjacent at once (equal scores: SPM takes the leftmost, HF the split ranked first).
//! On the 334 fixture texts of `tests/hf_spm.rs` the GGUF SPM path gives HF's ids for every text
//! of `phi-3` and all but one of `llama-spm` (`<unk>`, a control token in GGUF, plain text in
//! the converted file); the rank order is used here so that the rare case matches too. Words
//! (with `Metaspace` `split`, or cut before a `▁` that follows another character when no merge
//! result spans such a cut) are merged separately; merges never cross them, so the ids are the
//! same as merging the whole piece.

use rustc_hash::FxHashMap;
use serde_json::Value;

use crate::bpe::{self, Merges, NONE, Work};
use crate::error::LoadError;
use crate::load::{GgufVocab, MAX_ID, read_added, read_merges};
use crate::spm::parse_byte_token;
use crate::tokenizer::{Algo, ModelParts, Tokenizer};
use crate::vocab::{Checked, TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL, TYPE_USER_DEFINED};

/// `▁` (U+2581): what a space becomes.
const MARK: char = '\u{2581}';

/// When `▁` is put before a piece of text (a piece: the text between added tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prefix {
    /// The `Prepend("▁")` normalizer: before every non-empty piece.
    Always,
    /// `Metaspace` with prepend scheme `always`: before every piece not starting with `▁`.
    UnlessMarked,
    /// `Metaspace` with prepend scheme `first`: as `UnlessMarked`, only for the piece at the
    /// start of the text.
    FirstUnlessMarked,
    /// No prefix (Gemma; `Metaspace` with scheme `never`).
    Never,
}

/// The model: character tokens, byte tokens and merges.
#[derive(Debug)]
pub(crate) struct HfSpmModel {
    /// The token of each character that is one (HF looks characters up in the whole vocabulary).
    char_ids: FxHashMap<char, u32>,
    /// The `<0xXX>` token of each byte (`NONE`: missing), when the model has `byte_fallback`.
    byte_ids: [u32; 256],
    /// A character that has no token and not all of whose bytes have one becomes this.
    unk: Option<u32>,
    /// Consecutive unknown characters become one `unk` (HF `fuse_unk`).
    fuse_unk: bool,
    /// `(left, right) -> (rank, merged)`.
    merges: Merges,
    prefix: Prefix,
    /// `Metaspace` with `split`: every `▁` starts a new word (merges never cross it).
    split_at_marks: bool,
    /// HF `ignore_merges`: a word that is a token is that token, without merging (the model's
    /// vocabulary, filled only then).
    whole_words: FxHashMap<Box<str>, u32>,
    ignore_merges: bool,
    /// No merge result has a `▁` right after another character: cutting the text before each
    /// `▁` that follows another character cannot change the result (no merge crosses such a
    /// cut, and merges in different words are independent), so long texts merge word by word.
    words_independent: bool,
}

impl HfSpmModel {
    /// Encodes one piece of text between added tokens; `at_start`: the piece starts the text.
    pub(crate) fn encode(&self, raw: &str, at_start: bool, out: &mut Vec<u32>, work: &mut Work) {
        if raw.is_empty() {
            return;
        }
        let prefix = match self.prefix {
            Prefix::Always => true,
            Prefix::UnlessMarked => !raw.starts_with([' ', MARK]),
            Prefix::FirstUnlessMarked => at_start && !raw.starts_with([' ', MARK]),
            Prefix::Never => false,
        };
        let mut text = String::with_capacity(raw.len() + 3);
        if prefix {
            text.push(MARK);
        }
        for c in raw.chars() {
            text.push(if c == ' ' { MARK } else { c });
        }
        let mut symbols = Vec::new();
        let mut start = 0;
        for (i, c) in text.char_indices() {
            // With `ignore_merges` a whole piece may be a token: only HF's own split applies.
            let independent = self.words_independent && !self.ignore_merges;
            let cut = c == MARK
                && i > start
                && (self.split_at_marks || (independent && !text[..i].ends_with(MARK)));
            if cut {
                self.encode_word(&text[start..i], out, &mut symbols, work);
                start = i;
            }
        }
        self.encode_word(&text[start..], out, &mut symbols, work);
    }

    fn encode_word(&self, word: &str, out: &mut Vec<u32>, symbols: &mut Vec<u32>, work: &mut Work) {
        if self.ignore_merges
            && let Some(&id) = self.whole_words.get(word)
        {
            out.push(id);
            return;
        }
        symbols.clear();
        // (unk id, pending) as HF's `merge_word`: unknown characters fuse when `fuse_unk`.
        let mut pending_unk = false;
        for c in word.chars() {
            if let Some(&id) = self.char_ids.get(&c) {
                if pending_unk {
                    symbols.extend(self.unk);
                    pending_unk = false;
                }
                symbols.push(id);
                continue;
            }
            let mut buf = [0u8; 4];
            let bytes = c.encode_utf8(&mut buf).as_bytes();
            if bytes.iter().all(|&b| self.byte_ids[b as usize] != NONE) {
                // HF pushes the byte tokens without flushing a pending unk first.
                symbols.extend(bytes.iter().map(|&b| self.byte_ids[b as usize]));
                continue;
            }
            if let Some(u) = self.unk {
                if pending_unk && !self.fuse_unk {
                    symbols.push(u);
                }
                pending_unk = true;
            }
        }
        if pending_unk {
            symbols.extend(self.unk);
        }
        bpe::merge(symbols, &self.merges, work);
        out.extend_from_slice(symbols);
    }
}

impl HfSpmModel {
    /// HF's `ByteFallback` decoder for ids whose bytes are not UTF-8 (`ids` are known to exist):
    /// each run of byte tokens that is not UTF-8 on its own becomes one U+FFFD per token; with
    /// `strip`, one leading space of the whole text is dropped (`Strip(" ", 1, 0)` after `Fuse`).
    pub(crate) fn decode_invalid(&self, tok: &Tokenizer, ids: &[u32], strip: bool) -> String {
        let mut text = String::new();
        let mut run = Vec::new();
        let flush = |run: &mut Vec<u8>, text: &mut String| {
            match std::str::from_utf8(run) {
                Ok(s) => text.push_str(s),
                Err(_) => text.extend(std::iter::repeat_n('\u{FFFD}', run.len())),
            }
            run.clear();
        };
        for &id in ids {
            let bytes = tok.token_bytes(id).unwrap_or_default();
            match bytes {
                [b] if self.byte_ids[*b as usize] == id => run.push(*b),
                _ => {
                    flush(&mut run, &mut text);
                    text.push_str(&String::from_utf8_lossy(bytes));
                }
            }
        }
        flush(&mut run, &mut text);
        if strip && text.starts_with(' ') {
            text.remove(0);
        }
        text
    }
}

/// The type of a JSON object (`""` when it has none).
fn kind(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

/// A short description of a JSON value for error messages.
fn describe(v: &Value) -> String {
    v.to_string().chars().take(200).collect()
}

/// `Replace` whose pattern is the plain string `from` and whose content is `to`.
fn is_replace(v: &Value, from: &str, to: &str) -> bool {
    kind(v) == "Replace"
        && v.get("pattern")
            .and_then(|p| p.get("String"))
            .and_then(Value::as_str)
            == Some(from)
        && v.get("content").and_then(Value::as_str) == Some(to)
}

/// Whether `tokenizer.json` has the SentencePiece-style layout this module loads (rather than
/// byte-level BPE): no `ByteLevel` pre-tokenizer or decoder, and a `BPE` model with byte
/// fallback, a normalizer, or a `Metaspace` pre-tokenizer.
pub(crate) fn is_spm_layout(v: &Value) -> bool {
    let byte_level = |key: &str| {
        v.get(key).is_some_and(|p| {
            kind(p) == "ByteLevel"
                || ["pretokenizers", "decoders"].iter().any(|list| {
                    p.get(list)
                        .and_then(Value::as_array)
                        .is_some_and(|a| a.iter().any(|x| kind(x) == "ByteLevel"))
                })
        })
    };
    if byte_level("pre_tokenizer") || byte_level("decoder") {
        return false;
    }
    let model = v.get("model").unwrap_or(&Value::Null);
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool) == Some(true);
    let normalizer = v.get("normalizer").is_some_and(|n| !n.is_null());
    let pre = v.get("pre_tokenizer").unwrap_or(&Value::Null);
    let metaspace = kind(pre) == "Metaspace"
        || pre
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|p| kind(p) == "Metaspace"));
    byte_fallback || normalizer || metaspace
}

/// What the normalizer does: whether it escapes spaces, and whether it prepends `▁`.
fn read_normalizer(n: &Value) -> Result<(bool, bool), LoadError> {
    let unsupported = || LoadError::UnsupportedNormalizer { kind: describe(n) };
    if n.is_null() {
        return Ok((false, false));
    }
    let items: Vec<&Value> = match kind(n) {
        "Sequence" => n
            .get("normalizers")
            .and_then(Value::as_array)
            .ok_or_else(unsupported)?
            .iter()
            .collect(),
        _ => vec![n],
    };
    match items.as_slice() {
        [] => Ok((false, false)),
        [r] if is_replace(r, " ", "\u{2581}") => Ok((true, false)),
        [p, r]
            if kind(p) == "Prepend"
                && p.get("prepend").and_then(Value::as_str) == Some("\u{2581}")
                && is_replace(r, " ", "\u{2581}") =>
        {
            Ok((true, true))
        }
        _ => Err(unsupported()),
    }
}

/// The `Metaspace` pre-tokenizer's prefix rule and split flag.
fn read_metaspace(p: &Value) -> Option<(Prefix, bool)> {
    if kind(p) != "Metaspace" || p.get("replacement").and_then(Value::as_str) != Some("\u{2581}") {
        return None;
    }
    let prefix = match p.get("prepend_scheme").and_then(Value::as_str) {
        Some("always") => Prefix::UnlessMarked,
        Some("first") => Prefix::FirstUnlessMarked,
        Some("never") => Prefix::Never,
        Some(_) => return None,
        // Files from before prepend schemes: `add_prefix_space`.
        None => match p.get("add_prefix_space").and_then(Value::as_bool) {
            Some(false) => Prefix::Never,
            _ => Prefix::UnlessMarked,
        },
    };
    let split = p.get("split").and_then(Value::as_bool).unwrap_or(true);
    Some((prefix, split))
}

/// Whether decoding strips one leading space (the `Strip` step); other decoders are refused.
fn read_decoder(d: &Value) -> Result<bool, LoadError> {
    let unsupported = || LoadError::UnsupportedDecoder { kind: describe(d) };
    let items = d
        .get("decoders")
        .and_then(Value::as_array)
        .filter(|_| kind(d) == "Sequence")
        .ok_or_else(unsupported)?;
    let base = items.len() >= 3
        && is_replace(&items[0], "\u{2581}", " ")
        && kind(&items[1]) == "ByteFallback"
        && kind(&items[2]) == "Fuse";
    match &items[..] {
        [_, _, _] if base => Ok(false),
        [_, _, _, s]
            if base
                && kind(s) == "Strip"
                && s.get("content").and_then(Value::as_str) == Some(" ")
                && s.get("start").and_then(Value::as_u64) == Some(1)
                && s.get("stop").and_then(Value::as_u64) == Some(0) =>
        {
            Ok(true)
        }
        _ => Err(unsupported()),
    }
}

/// BOS/EOS that a `TemplateProcessing` post-processor puts around a single sequence
/// (`[<s>] $A [</s>]`); other post-processors add nothing here.
fn read_post_processor(p: &Value) -> (Option<u32>, Option<u32>) {
    let id_of = |name: &str| {
        p.get("special_tokens")
            .and_then(|s| s.get(name))
            .and_then(|t| t.get("ids"))
            .and_then(Value::as_array)
            .filter(|ids| ids.len() == 1)
            .and_then(|ids| ids[0].as_u64())
            .map(|id| id as u32)
    };
    let Some(single) = p
        .get("single")
        .and_then(Value::as_array)
        .filter(|_| kind(p) == "TemplateProcessing")
    else {
        return (None, None);
    };
    let special = |v: &Value| {
        v.get("SpecialToken")
            .and_then(|s| s.get("id"))
            .and_then(Value::as_str)
            .and_then(id_of)
    };
    let Some(a) = single.iter().position(|v| v.get("Sequence").is_some()) else {
        return (None, None);
    };
    let bos = a.checked_sub(1).and_then(|i| special(&single[i]));
    let eos = single.get(a + 1).and_then(special);
    (bos, eos)
}

/// Loads the SentencePiece-style BPE layout of `tokenizer.json` (see the module docs).
pub(crate) fn from_json(v: &Value) -> Result<Tokenizer, LoadError> {
    let field = |field: &'static str| LoadError::MissingField { field };
    let model = v.get("model").ok_or_else(|| field("model"))?;
    let mtype = model.get("type").and_then(Value::as_str).unwrap_or("BPE");
    if mtype != "BPE" {
        return Err(LoadError::UnsupportedModel {
            model: mtype.to_owned(),
        });
    }
    for (key, supported) in [
        ("continuing_subword_prefix", ""),
        ("end_of_word_suffix", ""),
    ] {
        if let Some(s) = model
            .get(key)
            .and_then(Value::as_str)
            .filter(|s| *s != supported)
        {
            return Err(LoadError::UnsupportedModel {
                model: format!("BPE with {key} `{s}`"),
            });
        }
    }
    if model
        .get("dropout")
        .and_then(Value::as_f64)
        .is_some_and(|d| d > 0.0)
    {
        return Err(LoadError::UnsupportedModel {
            model: "BPE with dropout".to_owned(),
        });
    }
    let (escapes, prepends) = read_normalizer(v.get("normalizer").unwrap_or(&Value::Null))?;
    let pre = v.get("pre_tokenizer").unwrap_or(&Value::Null);
    let unsupported_pre = || LoadError::UnsupportedPretokenizer {
        name: describe(pre),
    };
    let (prefix, split_at_marks) = match (escapes, prepends) {
        (true, prepends) => {
            // Spaces are gone after the normalizer: splitting at them does nothing.
            let noop_split = kind(pre) == "Split"
                && pre
                    .get("pattern")
                    .and_then(|p| p.get("String"))
                    .and_then(Value::as_str)
                    == Some(" ")
                && pre.get("invert").and_then(Value::as_bool) != Some(true);
            if !pre.is_null() && !noop_split {
                return Err(unsupported_pre());
            }
            (
                if prepends {
                    Prefix::Always
                } else {
                    Prefix::Never
                },
                false,
            )
        }
        (false, _) => read_metaspace(pre).ok_or_else(unsupported_pre)?,
    };
    let strip_leading_space = read_decoder(v.get("decoder").unwrap_or(&Value::Null))?;
    let added = read_added(v)?;
    if let Some(a) = added.iter().find(|a| a.single_word) {
        return Err(LoadError::UnsupportedAddedToken {
            content: a.content.to_owned(),
            option: "single_word",
        });
    }
    // HF matches a `normalized` added token in the normalized text. That is the raw text's match
    // unless the normalizer prepends `▁` (which changes where the pieces after it start) or
    // rewrites a space inside the token.
    if let Some(a) = added
        .iter()
        .find(|a| a.normalized && (prepends || (escapes && a.content.contains(' '))))
    {
        return Err(LoadError::UnsupportedAddedToken {
            content: a.content.to_owned(),
            option: "normalized (with a normalizer that changes its match)",
        });
    }

    // Token texts by id, and their GGUF-style types.
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| field("model.vocab"))?;
    let mut texts: Vec<Option<&str>> = Vec::new();
    let mut ids: FxHashMap<&str, u32> = FxHashMap::default();
    ids.reserve(vocab.len());
    let place = |texts: &mut Vec<Option<&'_ str>>, id: u64| -> Result<usize, LoadError> {
        if id >= MAX_ID {
            return Err(LoadError::IdOutOfRange { id });
        }
        let i = id as usize;
        if texts.len() <= i {
            texts.resize(i + 1, None);
        }
        Ok(i)
    };
    for (s, id) in vocab {
        let id = id.as_u64().ok_or_else(|| field("model.vocab"))?;
        let i = place(&mut texts, id)?;
        if texts[i].is_some() {
            return Err(LoadError::DuplicateId { id: id as u32 });
        }
        texts[i] = Some(s);
        ids.insert(s, id as u32);
    }
    // HF's BPE model sees only its own vocabulary (added tokens are cut out before it runs).
    let model_ids = ids.clone();
    let mut types: Vec<i32> = texts
        .iter()
        .map(|t| match t {
            Some(t) if parse_byte_token(t).is_some() => TYPE_BYTE,
            _ => TYPE_NORMAL,
        })
        .collect();
    for a in &added {
        let i = place(&mut texts, u64::from(a.id))?;
        types.resize(texts.len(), TYPE_NORMAL);
        texts[i] = Some(a.content);
        types[i] = if a.special {
            TYPE_CONTROL
        } else {
            TYPE_USER_DEFINED
        };
        ids.entry(a.content).or_insert(a.id);
    }
    if texts.is_empty() {
        return Err(LoadError::EmptyVocabulary);
    }

    let mut merges = Merges::default();
    let mut joined = String::new();
    // Whether no merge joins across a word start (a MARK inside it, not after another MARK).
    let mut words_independent = true;
    for rule in read_merges(model)? {
        let rule = rule?;
        joined.clear();
        joined.push_str(rule.left);
        joined.push_str(rule.right);
        words_independent &= !joined
            .char_indices()
            .any(|(i, c)| c == MARK && i > 0 && !joined[..i].ends_with(MARK));
        // HF refuses a merge whose parts or result are not tokens.
        let (&ia, &ib) = model_ids
            .get(rule.left)
            .zip(model_ids.get(rule.right))
            .ok_or_else(|| rule.error())?;
        let &merged = model_ids.get(joined.as_str()).ok_or_else(|| rule.error())?;
        merges.insert(ia, ib, rule.index as u32, merged);
    }

    let mut char_ids = FxHashMap::default();
    for (&s, &id) in &model_ids {
        let mut chars = s.chars();
        if let (Some(c), None) = (chars.next(), chars.next()) {
            char_ids.insert(c, id);
        }
    }
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool) == Some(true);
    let mut byte_ids = [NONE; 256];
    if byte_fallback {
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            if let Some(&id) = model_ids.get(format!("<0x{b:02X}>").as_str()) {
                *slot = id;
            }
        }
    }
    let unk = model
        .get("unk_token")
        .and_then(Value::as_str)
        .and_then(|u| model_ids.get(u).copied());
    let fuse_unk = model.get("fuse_unk").and_then(Value::as_bool) == Some(true);
    let (bos, eos) = read_post_processor(v.get("post_processor").unwrap_or(&Value::Null));
    let ignore_merges = model.get("ignore_merges").and_then(Value::as_bool) == Some(true);
    let whole_words = if ignore_merges {
        model_ids.iter().map(|(&s, &id)| (s.into(), id)).collect()
    } else {
        FxHashMap::default()
    };
    let hf = HfSpmModel {
        whole_words,
        ignore_merges,
        char_ids,
        byte_ids,
        unk,
        fuse_unk,
        merges,
        prefix,
        split_at_marks,
        words_independent,
    };

    let tokens: Vec<&str> = texts.iter().map(|t| t.unwrap_or("")).collect();
    let gguf = GgufVocab {
        model: "llama",
        tokens,
        token_types: types,
        ..GgufVocab::default()
    };
    let checked = Checked::new(&gguf, false)?;
    let named = |names: [&str; 2]| names.iter().find_map(|n| ids.get(n).copied());
    let bos_id = bos.or_else(|| named(["<s>", "<bos>"]));
    let eos_id = eos.or_else(|| named(["</s>", "<eos>"]));
    let parts = ModelParts {
        algo: Algo::HfSpm(Box::new(hf)),
        user_defined: Vec::new(),
        add_bos: bos.is_some(),
        add_eos: eos.is_some(),
        end_token: eos_id,
        strip_leading_space,
    };
    let mut tok = checked.build(bos_id, eos_id, parts);
    for a in &added {
        tok.set_whitespace_strip(a.id, a.lstrip, a.rstrip);
    }
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(normalizer: Value, pre: Value) -> Tokenizer {
        let json = serde_json::json!({
            "added_tokens": [{"id": 1, "content": "<s>", "special": true, "normalized": false}],
            "normalizer": normalizer,
            "pre_tokenizer": pre,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "byte_fallback": true, "fuse_unk": true, "unk_token": "<unk>",
                "vocab": {"<unk>": 0, "<s>": 1, "<0x21>": 2, "\u{2581}": 3, "a": 4, "b": 5,
                    "\u{2581}a": 6, "ab": 7, "\u{2581}ab": 8},
                "merges": [["a", "b"], ["\u{2581}", "a"], ["\u{2581}a", "b"]]},
        });
        from_json(&json).unwrap()
    }

    fn llama() -> Tokenizer {
        tiny(
            serde_json::json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u{2581}"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]}),
            Value::Null,
        )
    }

    #[test]
    fn merges_apply_by_rank_after_the_prefix() {
        let tok = llama();
        // ▁ab: "a b" (rank 0) first, then ▁ + ab has no merge.
        assert_eq!(tok.encode("ab").as_slice(), &[3, 7]);
        assert_eq!(tok.encode("a").as_slice(), &[6]);
        assert_eq!(tok.decode(&[3, 7]).unwrap(), "ab");
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes_or_fuse_into_unk() {
        let tok = llama();
        assert_eq!(tok.encode("!").as_slice(), &[3, 2]);
        assert_eq!(tok.encode("a??").as_slice(), &[6, 0]);
    }

    #[test]
    fn ignore_merges_emits_a_word_that_is_a_token_whole() {
        let json = serde_json::json!({
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": {"type": "BPE", "byte_fallback": true, "ignore_merges": true,
                "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4},
                "merges": [["a", "b"]]},
        });
        let tok = from_json(&json).unwrap();
        // "abc" has no merge path to itself but is a token; "abca" is not one and merges.
        assert_eq!(tok.encode("abc").as_slice(), &[4]);
        assert_eq!(tok.encode("abca").as_slice(), &[3, 2, 0]);
    }

    #[test]
    fn byte_level_files_keep_the_byte_level_path() {
        let byte_level = serde_json::json!({
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false},
            "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "byte_fallback": true},
        });
        assert!(!is_spm_layout(&byte_level));
        let llama =
            serde_json::json!({"normalizer": {"type": "Replace"}, "model": {"type": "BPE"}});
        assert!(is_spm_layout(&llama));
        let mistral = serde_json::json!({"pre_tokenizer": {"type": "Metaspace"}, "model": {}});
        assert!(is_spm_layout(&mistral));
    }

    #[test]
    fn metaspace_first_prefixes_only_the_start_of_the_text() {
        let pre = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
            "prepend_scheme": "first", "split": false});
        let tok = tiny(Value::Null, pre);
        assert_eq!(tok.encode_with_specials("a<s>a").as_slice(), &[6, 1, 4]);
        assert_eq!(tok.encode_with_specials(" a").as_slice(), &[6]);
    }
}
