//! What the non-BPE GGUF loaders (SentencePiece, WordPiece, Unigram) share: the checks of the
//! vocabulary's array lengths and special ids, the token table with its special and
//! user-defined lists, and building the common [`Tokenizer`] around a model.

use crate::error::LoadError;
use crate::load::{GgufVocab, MAX_ID};
use crate::pretok::Pretokenizer;
use crate::spm::piece;
use crate::tokenizer::{MergeSpec, ModelParts, Spec, Tokenizer};

/// GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp numbers them.
pub(crate) const TYPE_NORMAL: i32 = 1;
pub(crate) const TYPE_UNKNOWN: i32 = 2;
pub(crate) const TYPE_CONTROL: i32 = 3;
pub(crate) const TYPE_USER_DEFINED: i32 = 4;
pub(crate) const TYPE_UNUSED: i32 = 5;
pub(crate) const TYPE_BYTE: i32 = 6;

/// A vocabulary whose array lengths have been checked.
pub(crate) struct Checked<'a, 'v> {
    pub(crate) v: &'a GgufVocab<'v>,
    pub(crate) n: usize,
}

impl<'a, 'v> Checked<'a, 'v> {
    /// Checks the token count, and the lengths of `scores` (required when `needs_scores`) and of
    /// `token_type` (optional).
    pub(crate) fn new(v: &'a GgufVocab<'v>, needs_scores: bool) -> Result<Self, LoadError> {
        let n = v.tokens.len();
        if n == 0 {
            return Err(LoadError::EmptyVocabulary);
        }
        if n as u64 > MAX_ID {
            return Err(LoadError::IdOutOfRange { id: n as u64 });
        }
        if needs_scores && v.scores.is_empty() {
            return Err(LoadError::MissingField {
                field: "tokenizer.ggml.scores",
            });
        }
        if needs_scores && v.scores.len() != n {
            return Err(LoadError::ArrayLength {
                field: "tokenizer.ggml.scores",
                tokens: n,
                found: v.scores.len(),
            });
        }
        if !v.token_types.is_empty() && v.token_types.len() != n {
            return Err(LoadError::ArrayLength {
                field: "tokenizer.ggml.token_type",
                tokens: n,
                found: v.token_types.len(),
            });
        }
        Ok(Self { v, n })
    }

    /// A special id: one given in the file must be a token; a default that is not is dropped.
    pub(crate) fn id(
        &self,
        field: &'static str,
        given: Option<u32>,
        default: Option<u32>,
    ) -> Result<Option<u32>, LoadError> {
        match given {
            Some(id) if id as usize >= self.n => Err(LoadError::SpecialIdOutOfRange {
                field,
                id,
                vocab_size: self.n,
            }),
            Some(id) => Ok(Some(id)),
            None => Ok(default.filter(|&d| (d as usize) < self.n)),
        }
    }

    /// The end-of-turn and end-of-message ids (checked; no defaults), and a check of the
    /// padding id.
    pub(crate) fn eot_eom(&self) -> Result<[Option<u32>; 2], LoadError> {
        let v = self.v;
        let eot = self.id("tokenizer.ggml.eot_token_id", v.eot, None)?;
        let eom = self.id("tokenizer.ggml.eom_token_id", v.eom, None)?;
        self.id("tokenizer.ggml.padding_token_id", v.padding, None)?;
        Ok([eot, eom])
    }

    /// Token `id`'s type (normal when the file has no types).
    pub(crate) fn token_type(&self, id: usize) -> i32 {
        self.v.token_types.get(id).copied().unwrap_or(TYPE_NORMAL)
    }

    /// Builds the tokenizer: token bytes (`▁` as space, `<0xXX>` byte tokens as their byte),
    /// unknown/control/user-defined tokens as specials, user-defined tokens also split out of
    /// plain text, around `parts` (whose `user_defined` this fills).
    pub(crate) fn build(
        &self,
        bos: Option<u32>,
        eos: Option<u32>,
        mut parts: ModelParts,
    ) -> Tokenizer {
        let mut tokens = Vec::with_capacity(self.n);
        let mut specials = Vec::new();
        let mut user_defined = Vec::new();
        for (id, &text) in self.v.tokens.iter().enumerate() {
            let ty = self.token_type(id);
            tokens.push(Some(piece(text, ty)));
            if matches!(ty, TYPE_UNKNOWN | TYPE_CONTROL | TYPE_USER_DEFINED) && !text.is_empty() {
                specials.push((text.to_owned(), id as u32));
            }
            if ty == TYPE_USER_DEFINED && !text.is_empty() {
                user_defined.push((text.to_owned(), id as u32));
            }
        }
        parts.user_defined = user_defined;
        Tokenizer::from_spec(Spec {
            // Unused by non-BPE models; the spec needs one.
            pretok: Pretokenizer::Gpt2,
            tokens,
            merges: MergeSpec::Pairs(Vec::new()),
            specials,
            ignore_merges: false,
            byte_fallback: false,
            unk: None,
            fuse_unk: false,
            bos,
            eos,
            chat_template: self.v.chat_template.map(str::to_owned),
            // The model handles bytes and user-defined tokens itself (`with_algo`).
            byte_tokens: Vec::new(),
            user_defined: Vec::new(),
            unreachable: Vec::new(),
        })
        .with_algo(parts)
    }
}
