//! Loaders: tiktoken rank files, HF `tokenizer.json`, GGUF `tokenizer.ggml.*` metadata.

use std::path::Path;

use rustc_hash::FxHashMap;
use serde_json::Value;

use crate::error::LoadError;
use crate::pretok::{LlamaPre, Pretokenizer};
use crate::pretok_table::UNIMPLEMENTED_LLAMA_PRES;
use crate::tokenizer::{MergeSpec, Spec, Tokenizer};
use crate::type_overrides::LlamaCppFixes;

/// Largest id accepted from a file (bounds every allocation by the real vocabulary size).
pub(crate) const MAX_ID: u64 = 1 << 24;

/// GPT-2's byte-to-character map: the character that stands for each byte in byte-level vocabularies.
fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let direct =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        map[b as usize] = if direct {
            char::from_u32(b).expect("below 256")
        } else {
            n += 1;
            char::from_u32(255 + n).expect("below 512")
        };
    }
    map
}

/// Inverse of [`byte_to_char`] for characters below U+0200.
fn char_to_byte() -> [i16; 512] {
    let mut inv = [-1i16; 512];
    for (b, c) in byte_to_char().iter().enumerate() {
        inv[*c as usize] = b as i16;
    }
    inv
}

/// Decodes a byte-level token string to its bytes; `None` if a character is not in the alphabet.
fn byte_level_decode(s: &str, inv: &[i16; 512]) -> Option<Vec<u8>> {
    s.chars()
        .map(|c| {
            let i = c as usize;
            if i < 512 && inv[i] >= 0 {
                Some(inv[i] as u8)
            } else {
                None
            }
        })
        .collect()
}

/// Standard base64 (with padding) of `bytes`, as used in tiktoken rank files.
pub fn base64_encode(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        out.push(A[(n >> 18) as usize & 63] as char);
        out.push(A[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            A[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            A[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for (ci, c) in s.chunks(4).enumerate() {
        let last = ci + 1 == s.len() / 4;
        let pad = c.iter().rev().take_while(|&&b| b == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &b in &c[..4 - pad] {
            n = (n << 6) | val(b)?;
        }
        n <<= 6 * pad as u32;
        out.push((n >> 16) as u8);
        if pad < 2 {
            out.push((n >> 8) as u8);
        }
        if pad < 1 {
            out.push(n as u8);
        }
    }
    Some(out)
}

fn put(tokens: &mut Vec<Option<Vec<u8>>>, id: u64, bytes: Vec<u8>) -> Result<(), LoadError> {
    if id >= MAX_ID {
        return Err(LoadError::IdOutOfRange { id });
    }
    let i = id as usize;
    if tokens.len() <= i {
        tokens.resize(i + 1, None);
    }
    if tokens[i].is_some() {
        return Err(LoadError::DuplicateId { id: id as u32 });
    }
    tokens[i] = Some(bytes);
    Ok(())
}

/// The reading of `tokenizer.ggml.*` metadata needed to build a tokenizer, borrowed from a GGUF
/// file (see `Tokenizer::from_gguf`) or built by hand.
#[non_exhaustive]
#[derive(Debug, Clone, Default)]
pub struct GgufVocab<'a> {
    /// `tokenizer.ggml.model` (the BPE ones: `gpt2` and `gemma4`).
    pub model: &'a str,
    /// `tokenizer.ggml.pre` (empty when the file has none).
    pub pre: &'a str,
    /// `tokenizer.ggml.tokens` (byte-level encoded, or raw UTF-8 for SentencePiece-style BPE).
    pub tokens: Vec<&'a str>,
    /// `tokenizer.ggml.token_type` (1 normal, 3 control, 4 user-defined, ...); empty = all normal.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, `"left right"`, in priority order.
    pub merges: Vec<&'a str>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<&'a str>,
    /// `tokenizer.ggml.scores` (SPM: merge priority, higher first); one per token.
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.add_space_prefix` (`None`: the model's default, true for SPM).
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.ggml.add_bos_token` (`None`: the model's default, true for SPM and for the
    /// BPE pre-tokenizers llama.cpp gives BOS, such as Llama 3's).
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token` (`None`: false).
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.unknown_token_id` (`None`: the model's default, 0 for SPM).
    pub unknown: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn; ends generation).
    pub eot: Option<u32>,
    /// `tokenizer.ggml.eom_token_id` (end of message; ends generation).
    pub eom: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding: Option<u32>,
    /// `tokenizer.ggml.fim_pre_token_id` (or the older `prefix_token_id`): fill-in-the-middle
    /// prefix. With the other FIM ids, EOT and EOM: when absent, llama.cpp finds the token by
    /// name and makes it a control token (see `Tokenizer::from_gguf_vocab`).
    pub fim_pre: Option<u32>,
    /// `tokenizer.ggml.fim_suf_token_id` (or the older `suffix_token_id`).
    pub fim_suf: Option<u32>,
    /// `tokenizer.ggml.fim_mid_token_id` (or the older `middle_token_id`).
    pub fim_mid: Option<u32>,
    /// `tokenizer.ggml.fim_pad_token_id` (ends generation).
    pub fim_pad: Option<u32>,
    /// `tokenizer.ggml.fim_rep_token_id` (repository name; ends generation).
    pub fim_rep: Option<u32>,
    /// `tokenizer.ggml.fim_sep_token_id` (file separator; ends generation).
    pub fim_sep: Option<u32>,
    /// `tokenizer.ggml.seperator_token_id` (llama.cpp's spelling; WordPiece's `[SEP]`).
    pub separator: Option<u32>,
    /// `tokenizer.ggml.remove_extra_whitespaces` (Unigram; `None`: false).
    pub remove_extra_whitespaces: Option<bool>,
    /// `tokenizer.ggml.precompiled_charsmap` (Unigram's normalization map).
    pub precompiled_charsmap: Option<&'a [u8]>,
}

impl<'a> GgufVocab<'a> {
    /// A vocabulary description with the given fields and no BOS/EOS/template.
    pub fn new(
        model: &'a str,
        pre: &'a str,
        tokens: Vec<&'a str>,
        token_types: Vec<i32>,
        merges: Vec<&'a str>,
    ) -> Self {
        Self {
            model,
            pre,
            tokens,
            token_types,
            merges,
            ..Self::default()
        }
    }
}

/// What [`Tokenizer::pretokenizer_fallback`] reports when `tokenizer.ggml.pre` is missing.
pub(crate) const MISSING_PRE_FALLBACK: &str = "tokenizer.ggml.pre is missing: using llama.cpp's `default` pre-tokenizer, as llama.cpp does \
     (it warns that generation quality will be degraded)";

/// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` value `name` (empty: missing), and
/// the fallback note when it is llama.cpp's choice for a missing value. An unknown name is an
/// error, as in llama.cpp (`unknown pre-tokenizer type`).
fn pretok_from_gguf_name(name: &str) -> Result<(LlamaPre, Option<&'static str>), LoadError> {
    if name.is_empty() {
        tracing::warn!("{MISSING_PRE_FALLBACK}");
        return Ok((LlamaPre::llama_default(), Some(MISSING_PRE_FALLBACK)));
    }
    LlamaPre::from_name(name)
        .map(|p| (p, None))
        .ok_or_else(|| LoadError::UnsupportedPretokenizer {
            name: if UNIMPLEMENTED_LLAMA_PRES.contains(&name) {
                format!("{name} (llama.cpp splits it with custom code not reproduced here)")
            } else {
                name.to_owned()
            },
        })
}

/// `<0xXX>`: the byte a byte-fallback token stands for.
fn byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Builds a tokenizer from GGUF `tokenizer.ggml.*` metadata, as llama.cpp does for its BPE
    /// models (`tokenizer.ggml.model` `gpt2`, and `gemma4`, whose pre-tokenizer is always
    /// `gemma4`).
    ///
    /// `tokenizer.ggml.pre` selects the llama.cpp pre-tokenizer ([`LLAMA_PRES`](crate::LLAMA_PRES)) and its flags;
    /// a missing (empty) value uses llama.cpp's `default`, reported by
    /// [`Tokenizer::pretokenizer_fallback`] and a `tracing` warning; an unknown value is
    /// [`LoadError::UnsupportedPretokenizer`].
    ///
    /// Control (type 3) and user-defined (type 4) tokens become special tokens, matched in text
    /// only by [`Tokenizer::encode_with_specials`]. Bytes with no token in the vocabulary
    /// (SmolLM2 lacks 21 of them, such as 0x04 and the lead bytes 0xF1/0xF2) are dropped, exactly
    /// as llama.cpp and HF `tokenizers` (for a BPE model without `unk_token`) do. Vocabularies of
    /// raw UTF-8 tokens (Gemma 4) merge whole characters and spell a character without a token
    /// with its bytes' `<0xXX>` tokens (type 6).
    ///
    /// Token types are first corrected as llama.cpp corrects them at load, each change logged
    /// with `tracing::warn!`: a token named like an end-of-turn, end-of-message or
    /// fill-in-the-middle token becomes a control token when the file gives no such id, and so
    /// does every token named like an end-of-generation token (Qwen2's `</s>`), with llama.cpp's
    /// exceptions for gpt-oss, o200k-harmony, Gemma 4 and PLaMo. End-of-generation ids follow
    /// llama.cpp's too: EOS, EOT, EOM, the FIM pad / repo / file-separator ids and the tokens
    /// named like end-of-generation tokens ([`Tokenizer::eog_ids`]).
    pub fn from_gguf_vocab(v: &GgufVocab<'_>) -> Result<Self, LoadError> {
        let fixes = LlamaCppFixes::of(v);
        let mut tok = match fixes.apply(v) {
            Some(fixed) => Self::from_gguf_vocab_types_as_given(&fixed)?,
            None => Self::from_gguf_vocab_types_as_given(v)?,
        };
        tok.extend_eog([v.eot, v.eom]);
        tok.extend_eog(fixes.eog_extra.iter().map(|&id| Some(id)));
        tok.remove_eog(&fixes.eog_removed);
        Ok(tok)
    }

    /// [`Tokenizer::from_gguf_vocab`] without llama.cpp's corrections.
    fn from_gguf_vocab_types_as_given(v: &GgufVocab<'_>) -> Result<Self, LoadError> {
        let pre_name = match v.model {
            "llama" => return crate::spm::from_gguf_vocab(v),
            "bert" => return crate::wpm::from_gguf_vocab(v),
            "t5" => return crate::ugm::from_gguf_vocab(v),
            "gpt2" => v.pre,
            // llama.cpp overrides the pre-tokenizer of this model.
            "gemma4" => "gemma4",
            _ => {
                return Err(LoadError::UnsupportedModel {
                    model: v.model.to_owned(),
                });
            }
        };
        let (pre, fallback) = pretok_from_gguf_name(pre_name)?;
        let entry = pre.entry();
        if v.tokens.is_empty() {
            return Err(LoadError::EmptyVocabulary);
        }
        if v.tokens.len() as u64 > MAX_ID {
            return Err(LoadError::IdOutOfRange {
                id: v.tokens.len() as u64,
            });
        }
        if !v.token_types.is_empty() && v.token_types.len() != v.tokens.len() {
            return Err(LoadError::TokenTypeCount {
                tokens: v.tokens.len(),
                types: v.token_types.len(),
            });
        }
        let inv = char_to_byte();
        let mut tokens = Vec::with_capacity(v.tokens.len());
        let mut specials = Vec::new();
        let mut byte_tokens = Vec::new();
        let mut user_defined = Vec::new();
        let mut unreachable = Vec::new();
        let mut ids: FxHashMap<&str, u32> = FxHashMap::default();
        ids.reserve(v.tokens.len());
        for (id, &t) in v.tokens.iter().enumerate() {
            let ty = v.token_types.get(id).copied().unwrap_or(1);
            if ty == 3 || ty == 4 {
                specials.push((t.to_owned(), id as u32));
                if ty == 4 {
                    user_defined.push((t.to_owned(), id as u32));
                }
                tokens.push(Some(t.as_bytes().to_vec()));
            } else if !entry.byte_encode {
                match byte_token(t).filter(|_| ty == 6) {
                    Some(b) => {
                        byte_tokens.push((b, id as u32));
                        tokens.push(Some(vec![b]));
                    }
                    None => tokens.push(Some(t.as_bytes().to_vec())),
                }
            } else {
                // A token that is not a byte-level string can never be a piece's spelling
                // (llama.cpp looks pieces up byte-level encoded); it only decodes.
                tokens.push(Some(byte_level_decode(t, &inv).unwrap_or_else(|| {
                    unreachable.push(id as u32);
                    t.as_bytes().to_vec()
                })));
            }
            ids.entry(t).or_insert(id as u32);
        }
        let mut pairs = Vec::with_capacity(v.merges.len());
        for (index, rule) in v.merges.iter().enumerate() {
            let bad = || LoadError::BadMerge {
                key: "tokenizer.ggml.merges",
                index,
                rule: (*rule).to_owned(),
            };
            // llama.cpp splits at the first space after the first byte.
            let cut = rule
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .ok_or_else(bad)?
                + 1;
            let (a, b) = (&rule[..cut], &rule[cut + 1..]);
            let (&a, &b) = ids.get(a).zip(ids.get(b)).ok_or_else(bad)?;
            pairs.push((a, b));
        }
        let check = |id: Option<u32>| id.filter(|&i| (i as usize) < tokens.len());
        let (bos, eos) = (check(v.bos), check(v.eos));
        let mut tok = Self::from_spec(Spec {
            pretok: Pretokenizer::Llama(pre),
            tokens,
            merges: MergeSpec::Pairs(pairs),
            specials,
            ignore_merges: entry.ignore_merges,
            byte_fallback: false,
            unk: None,
            fuse_unk: false,
            bos,
            eos,
            chat_template: v.chat_template.map(str::to_owned),
            byte_tokens,
            user_defined,
            unreachable,
        });
        tok.set_pretokenizer_fallback(fallback);
        // llama.cpp: the pre-tokenizer's default, then the file's key, then Gemma 4's override.
        let add_bos = entry.always_bos || v.add_bos.unwrap_or(entry.add_bos);
        tok.set_added_tokens(add_bos, v.add_eos.unwrap_or(false));
        Ok(tok)
    }

    /// Loads the tokenizer of a GGUF model (its `tokenizer.ggml.*` and `tokenizer.chat_template`
    /// metadata).
    #[cfg(feature = "gguf")]
    pub fn from_gguf(gguf: &weight_cache::Gguf) -> Result<Self, LoadError> {
        let field = |field: &'static str| LoadError::MissingField { field };
        let model = gguf
            .get_str("tokenizer.ggml.model")
            .ok_or_else(|| field("tokenizer.ggml.model"))?;
        // Only BPE needs merges; a key that is there must have the right type.
        let merges = match gguf.metadata("tokenizer.ggml.merges") {
            None if model != "gpt2" => Vec::new(),
            _ => gguf
                .get_str_array("tokenizer.ggml.merges")
                .ok_or_else(|| field("tokenizer.ggml.merges"))?,
        };
        let optional_f32s = |key: &'static str| match gguf.metadata(key) {
            None => Ok(Vec::new()),
            Some(_) => gguf.get_f32_array(key).ok_or_else(|| field(key)),
        };
        let optional_bool = |key: &'static str| match gguf.metadata(key) {
            None => Ok(None),
            Some(_) => gguf.get_bool(key).map(Some).ok_or_else(|| field(key)),
        };
        let optional_id = |key: &'static str| match gguf.metadata(key) {
            None => Ok(None),
            Some(_) => gguf.get_u32(key).map(Some).ok_or_else(|| field(key)),
        };
        let lenient_id = |keys: &[&str]| keys.iter().rev().find_map(|k| gguf.get_u32(k));
        let token_types = match gguf.metadata("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(_) => gguf
                .get_i32_array("tokenizer.ggml.token_type")
                .ok_or_else(|| field("tokenizer.ggml.token_type"))?,
        };
        let charsmap: Option<Vec<u8>> = match gguf.get_array("tokenizer.ggml.precompiled_charsmap")
        {
            None => None,
            Some(a) => Some(
                a.iter()
                    .map(|x| x.as_int().and_then(|i| u8::try_from(i & 0xff).ok()))
                    .collect::<Option<Vec<u8>>>()
                    .ok_or_else(|| field("tokenizer.ggml.precompiled_charsmap"))?,
            ),
        };
        let v = GgufVocab {
            model,
            pre: gguf.get_str("tokenizer.ggml.pre").unwrap_or(""),
            tokens: gguf
                .get_str_array("tokenizer.ggml.tokens")
                .ok_or_else(|| field("tokenizer.ggml.tokens"))?,
            token_types,
            merges,
            bos: optional_id("tokenizer.ggml.bos_token_id")?,
            eos: optional_id("tokenizer.ggml.eos_token_id")?,
            chat_template: gguf.get_str("tokenizer.chat_template"),
            scores: optional_f32s("tokenizer.ggml.scores")?,
            add_space_prefix: optional_bool("tokenizer.ggml.add_space_prefix")?,
            add_bos: optional_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: optional_bool("tokenizer.ggml.add_eos_token")?,
            unknown: optional_id("tokenizer.ggml.unknown_token_id")?,
            eot: optional_id("tokenizer.ggml.eot_token_id")?,
            eom: optional_id("tokenizer.ggml.eom_token_id")?,
            padding: optional_id("tokenizer.ggml.padding_token_id")?,
            // Read leniently, as llama.cpp does (a wrong type is no id); the older names win.
            fim_pre: lenient_id(&[
                "tokenizer.ggml.fim_pre_token_id",
                "tokenizer.ggml.prefix_token_id",
            ]),
            fim_suf: lenient_id(&[
                "tokenizer.ggml.fim_suf_token_id",
                "tokenizer.ggml.suffix_token_id",
            ]),
            fim_mid: lenient_id(&[
                "tokenizer.ggml.fim_mid_token_id",
                "tokenizer.ggml.middle_token_id",
            ]),
            fim_pad: lenient_id(&["tokenizer.ggml.fim_pad_token_id"]),
            fim_rep: lenient_id(&["tokenizer.ggml.fim_rep_token_id"]),
            fim_sep: lenient_id(&["tokenizer.ggml.fim_sep_token_id"]),
            separator: optional_id("tokenizer.ggml.seperator_token_id")?,
            remove_extra_whitespaces: optional_bool("tokenizer.ggml.remove_extra_whitespaces")?,
            precompiled_charsmap: charsmap.as_deref(),
        };
        Self::from_gguf_vocab(&v)
    }

    /// Parses a tiktoken rank file (`<base64 token> <rank>` per line) with the given split
    /// pattern and special tokens. Ids are ranks; a piece that is a token is emitted directly.
    pub fn from_tiktoken(
        ranks: &str,
        pretok: Pretokenizer,
        specials: &[(&str, u32)],
    ) -> Result<Self, LoadError> {
        let mut tokens = Vec::new();
        for (i, line) in ranks.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = || LoadError::BadRankLine { line: i + 1 };
            let (b64, rank) = line.split_once(' ').ok_or_else(bad)?;
            let bytes = base64_decode(b64).ok_or_else(bad)?;
            let rank: u64 = rank.trim().parse().map_err(|_| bad())?;
            put(&mut tokens, rank, bytes)?;
        }
        if tokens.is_empty() {
            return Err(LoadError::EmptyVocabulary);
        }
        let mut sp = Vec::new();
        for &(s, id) in specials {
            put(&mut tokens, u64::from(id), s.as_bytes().to_vec())?;
            sp.push((s.to_owned(), id));
        }
        Ok(Self::from_spec(Spec {
            pretok,
            tokens,
            merges: MergeSpec::FromRanks,
            specials: sp,
            ignore_merges: true,
            byte_fallback: false,
            unk: None,
            fuse_unk: false,
            bos: None,
            eos: specials
                .iter()
                .find(|(s, _)| *s == "<|endoftext|>")
                .map(|&(_, id)| id),
            chat_template: None,
            byte_tokens: Vec::new(),
            user_defined: Vec::new(),
            unreachable: Vec::new(),
        }))
    }

    /// Reads a tiktoken rank file from disk; see [`Tokenizer::from_tiktoken`].
    pub fn from_tiktoken_file(
        path: impl AsRef<Path>,
        pretok: Pretokenizer,
        specials: &[(&str, u32)],
    ) -> Result<Self, LoadError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_tiktoken(&text, pretok, specials)
    }

    /// The cl100k_base tokenizer from its rank file (`cl100k_base.tiktoken`), with its special tokens.
    pub fn cl100k_base(ranks: &str) -> Result<Self, LoadError> {
        Self::from_tiktoken(ranks, Pretokenizer::Cl100k, CL100K_SPECIALS)
    }

    /// The o200k_base tokenizer from its rank file (`o200k_base.tiktoken`), with its special tokens.
    pub fn o200k_base(ranks: &str) -> Result<Self, LoadError> {
        Self::from_tiktoken(ranks, Pretokenizer::O200k, O200K_SPECIALS)
    }

    /// Parses a HF `tokenizer.json`: a byte-level BPE model (GPT-2, SmolLM2, Llama 3, Qwen), or
    /// a SentencePiece-style BPE model (Llama 2, Mistral, Gemma 2/3, Phi-3: `▁` for spaces,
    /// `<0xXX>` byte fallback, spaces escaped by a `Prepend`/`Replace` normalizer or a
    /// `Metaspace` pre-tokenizer), with HF `tokenizers`' ids.
    ///
    /// For the SentencePiece-style layout, decoding turns `▁` into spaces and drops the leading
    /// space when the file's decoder has `Strip(" ", 1, 0)`; a `TemplateProcessing`
    /// post-processor's `[<s>] $A [</s>]` sets [`Tokenizer::add_bos`] / [`Tokenizer::add_eos`].
    /// Other layouts are refused with the part that is not supported
    /// ([`LoadError::UnsupportedModel`] for `Unigram`/`WordPiece`,
    /// [`LoadError::UnsupportedNormalizer`], [`LoadError::UnsupportedPretokenizer`],
    /// [`LoadError::UnsupportedDecoder`], [`LoadError::UnsupportedAddedToken`]).
    pub fn from_tokenizer_json(json: &str) -> Result<Self, LoadError> {
        let v: Value = serde_json::from_str(json)?;
        if crate::hf_spm::is_spm_layout(&v) {
            return crate::hf_spm::from_json(&v);
        }
        let field = |field: &'static str| LoadError::MissingField { field };
        if let Some(n) = v.get("normalizer").filter(|n| !n.is_null()) {
            return Err(LoadError::UnsupportedNormalizer {
                kind: n
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_owned(),
            });
        }
        let model = v.get("model").ok_or_else(|| field("model"))?;
        let mtype = model.get("type").and_then(Value::as_str).unwrap_or("BPE");
        if mtype != "BPE" {
            return Err(LoadError::UnsupportedModel {
                model: mtype.to_owned(),
            });
        }
        let pretok = pretok_from_json(v.get("pre_tokenizer").unwrap_or(&Value::Null))?;
        let vocab = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or_else(|| field("model.vocab"))?;
        let inv = char_to_byte();
        let mut tokens = Vec::new();
        let mut ids: FxHashMap<&str, u32> = FxHashMap::default();
        for (s, id) in vocab {
            let id = id.as_u64().ok_or_else(|| field("model.vocab"))?;
            let bytes = byte_level_decode(s, &inv).unwrap_or_else(|| s.as_bytes().to_vec());
            put(&mut tokens, id, bytes)?;
            ids.insert(s, id as u32);
        }
        let mut specials = Vec::new();
        for a in read_added(&v)? {
            let i = a.id as usize;
            if tokens.len() <= i {
                tokens.resize(i + 1, None);
            }
            tokens[i] = Some(a.content.as_bytes().to_vec());
            specials.push((a.content.to_owned(), a.id));
        }
        let merges = read_merges(model)?;
        let mut pairs = Vec::with_capacity(merges.len());
        for rule in merges {
            let rule = rule?;
            let (&a, &b) = ids
                .get(rule.left)
                .zip(ids.get(rule.right))
                .ok_or_else(|| rule.error())?;
            pairs.push((a, b));
        }
        let unk = model
            .get("unk_token")
            .and_then(Value::as_str)
            .and_then(|u| ids.get(u).copied());
        let flag = |k: &str| model.get(k).and_then(Value::as_bool).unwrap_or(false);
        Ok(Self::from_spec(Spec {
            pretok,
            tokens,
            merges: MergeSpec::Pairs(pairs),
            specials,
            ignore_merges: flag("ignore_merges"),
            byte_fallback: flag("byte_fallback"),
            unk,
            fuse_unk: flag("fuse_unk"),
            bos: None,
            eos: None,
            chat_template: None,
            byte_tokens: Vec::new(),
            user_defined: Vec::new(),
            unreachable: Vec::new(),
        }))
    }

    /// Reads a HF `tokenizer.json` from disk; see [`Tokenizer::from_tokenizer_json`].
    pub fn from_tokenizer_json_file(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_tokenizer_json(&text)
    }

    /// Sets the BOS/EOS ids and chat template (for sources such as `tokenizer.json` that keep
    /// them elsewhere, e.g. in `tokenizer_config.json`).
    pub fn with_model_info(
        mut self,
        bos: Option<u32>,
        eos: Option<u32>,
        chat_template: Option<String>,
    ) -> Self {
        self.set_model_info(bos, eos, chat_template);
        self
    }
}

/// cl100k_base's special tokens.
pub const CL100K_SPECIALS: &[(&str, u32)] = &[
    ("<|endoftext|>", 100257),
    ("<|fim_prefix|>", 100258),
    ("<|fim_middle|>", 100259),
    ("<|fim_suffix|>", 100260),
    ("<|endofprompt|>", 100276),
];

/// o200k_base's special tokens.
pub const O200K_SPECIALS: &[(&str, u32)] =
    &[("<|endoftext|>", 199999), ("<|endofprompt|>", 200018)];

fn pretok_from_json(p: &Value) -> Result<Pretokenizer, LoadError> {
    let describe = || LoadError::UnsupportedPretokenizer {
        name: p.to_string().chars().take(200).collect(),
    };
    let ty = |v: &Value| {
        v.get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let byte_level_regex = |v: &Value| {
        ty(v) == "ByteLevel"
            && v.get("use_regex").and_then(Value::as_bool).unwrap_or(true)
            && !v
                .get("add_prefix_space")
                .and_then(Value::as_bool)
                .unwrap_or(false)
    };
    let byte_level_plain = |v: &Value| {
        ty(v) == "ByteLevel"
            && !v.get("use_regex").and_then(Value::as_bool).unwrap_or(true)
            && !v
                .get("add_prefix_space")
                .and_then(Value::as_bool)
                .unwrap_or(false)
    };
    if byte_level_regex(p) {
        return Ok(Pretokenizer::Gpt2);
    }
    if ty(p) == "Sequence" {
        let items = p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .ok_or_else(describe)?;
        if items.len() == 2 {
            let (a, b) = (&items[0], &items[1]);
            if ty(a) == "Digits"
                && a.get("individual_digits").and_then(Value::as_bool) == Some(true)
                && byte_level_regex(b)
            {
                return Ok(Pretokenizer::SmolLm);
            }
            if ty(a) == "Split" && byte_level_plain(b) {
                let regex = a
                    .get("pattern")
                    .and_then(|p| p.get("Regex"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let behavior = a.get("behavior").and_then(Value::as_str).unwrap_or("");
                let invert = a.get("invert").and_then(Value::as_bool).unwrap_or(false);
                if behavior == "Isolated" && !invert {
                    let norm = regex.replace("?+", "?").replace("++", "+");
                    for kind in [
                        Pretokenizer::Cl100k,
                        Pretokenizer::O200k,
                        Pretokenizer::Gpt2,
                    ] {
                        if norm == kind.pattern() || regex == kind.pattern() {
                            return Ok(kind);
                        }
                    }
                }
            }
        }
    }
    Err(describe())
}

/// An added token of `tokenizer.json`.
pub(crate) struct Added<'a> {
    pub(crate) content: &'a str,
    pub(crate) id: u32,
    pub(crate) special: bool,
    pub(crate) normalized: bool,
    /// Matches whole words only.
    pub(crate) single_word: bool,
    /// Takes the whitespace before it into its match.
    pub(crate) lstrip: bool,
    /// Takes the whitespace after it into its match.
    pub(crate) rstrip: bool,
}

/// One rule of a `tokenizer.json`'s `model.merges`: the two tokens it joins.
pub(crate) struct MergeRule<'a> {
    /// Position in the list.
    pub(crate) index: usize,
    /// The left token.
    pub(crate) left: &'a str,
    /// The right token.
    pub(crate) right: &'a str,
    /// The rule as written.
    raw: &'a Value,
}

impl MergeRule<'_> {
    /// The error for this rule (it names a token the loader refuses).
    pub(crate) fn error(&self) -> LoadError {
        bad_merge(self.index, self.raw)
    }
}

fn bad_merge(index: usize, raw: &Value) -> LoadError {
    LoadError::BadMerge {
        key: "model.merges",
        index,
        rule: raw.to_string(),
    }
}

/// The `model.merges` of a `tokenizer.json`, rule by rule in order: each written `"a b"` or
/// `["a", "b"]`; any other form is [`LoadError::BadMerge`] when its turn comes. Missing:
/// [`LoadError::MissingField`].
pub(crate) fn read_merges(
    model: &Value,
) -> Result<impl ExactSizeIterator<Item = Result<MergeRule<'_>, LoadError>>, LoadError> {
    let list = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or(LoadError::MissingField {
            field: "model.merges",
        })?;
    Ok(list.iter().enumerate().map(|(index, raw)| {
        let bad = || bad_merge(index, raw);
        let (left, right) = match raw {
            Value::String(s) => s.split_once(' ').ok_or_else(bad)?,
            Value::Array(p) if p.len() == 2 => (
                p[0].as_str().ok_or_else(bad)?,
                p[1].as_str().ok_or_else(bad)?,
            ),
            _ => return Err(bad()),
        };
        Ok(MergeRule {
            index,
            left,
            right,
            raw,
        })
    }))
}

/// The `added_tokens` of a `tokenizer.json`, checked (content, id in range).
pub(crate) fn read_added(v: &Value) -> Result<Vec<Added<'_>>, LoadError> {
    let field = |field: &'static str| LoadError::MissingField { field };
    let mut added = Vec::new();
    for t in v
        .get("added_tokens")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        let content = t
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| field("added_tokens.content"))?;
        let id = t
            .get("id")
            .and_then(Value::as_u64)
            .ok_or_else(|| field("added_tokens.id"))?;
        if id >= MAX_ID {
            return Err(LoadError::IdOutOfRange { id });
        }
        let flag = |k: &str| t.get(k).and_then(Value::as_bool).unwrap_or(false);
        added.push(Added {
            content,
            id: id as u32,
            special: flag("special"),
            normalized: flag("normalized"),
            single_word: flag("single_word"),
            lstrip: flag("lstrip"),
            rstrip: flag("rstrip"),
        });
    }
    Ok(added)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_roundtrip() {
        for n in 0..20usize {
            let v: Vec<u8> = (0..n as u8).map(|x| x.wrapping_mul(37)).collect();
            assert_eq!(base64_decode(&base64_encode(&v)).unwrap(), v);
        }
        assert_eq!(base64_encode(b"hello"), "aGVsbG8=");
        assert!(base64_decode("a===").is_none());
        assert!(base64_decode("a!==").is_none());
    }

    #[test]
    fn merge_rules_are_read_in_both_forms_and_refused_in_turn() {
        let model = serde_json::json!({"merges": ["a b", ["c", "d e"], ["x"], "nospace"]});
        let mut rules = read_merges(&model).unwrap();
        assert_eq!(rules.len(), 4);
        let first = rules.next().unwrap().unwrap();
        assert_eq!((first.index, first.left, first.right), (0, "a", "b"));
        let second = rules.next().unwrap().unwrap();
        assert_eq!((second.left, second.right), ("c", "d e"));
        let err = rules.next().unwrap().err().unwrap();
        assert!(matches!(
            err,
            LoadError::BadMerge { key: "model.merges", index: 2, ref rule } if rule == r#"["x"]"#
        ));
        assert!(matches!(
            second.error(),
            LoadError::BadMerge { index: 1, .. }
        ));
        assert!(matches!(
            read_merges(&serde_json::json!({})).err(),
            Some(LoadError::MissingField {
                field: "model.merges"
            })
        ));
    }

    #[test]
    fn byte_level_alphabet() {
        let m = byte_to_char();
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(
            byte_level_decode("Ġhello", &char_to_byte()).unwrap(),
            b" hello"
        );
    }
}
