//! Error types, one per operation.

use std::path::PathBuf;

/// Loading a tokenizer failed (GGUF metadata, `tokenizer.json`, or a tiktoken rank file).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Reading the file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `tokenizer.json` is not valid JSON.
    #[error("tokenizer.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A required field is missing or has the wrong type.
    #[error("missing or malformed field `{field}`")]
    MissingField {
        /// The field (a GGUF key or a JSON path).
        field: &'static str,
    },
    /// The tokenizer model is not one this crate implements (byte-level BPE, and llama.cpp's
    /// SentencePiece-style `llama`, WordPiece `bert` and Unigram `t5` models from GGUF).
    #[error(
        "unsupported tokenizer model `{model}` (supported: byte-level BPE; GGUF `llama`, `bert`, `t5`)"
    )]
    UnsupportedModel {
        /// The model name found (`tokenizer.ggml.model`, or `model.type`).
        model: String,
    },
    /// The pre-tokenizer is not one this crate implements exactly.
    #[error("unsupported pre-tokenizer `{name}`")]
    UnsupportedPretokenizer {
        /// The pre-tokenizer (`tokenizer.ggml.pre`, or a description of the JSON one).
        name: String,
    },
    /// `tokenizer.json` has a normalizer this crate does not implement (supported: none, and for
    /// SentencePiece-style BPE `Replace(" ", "▁")`, optionally after `Prepend("▁")`).
    #[error("unsupported normalizer in tokenizer.json: {kind}")]
    UnsupportedNormalizer {
        /// The normalizer (its JSON, shortened).
        kind: String,
    },
    /// The `tokenizer.json` decoder is not one this crate reproduces (for SentencePiece-style
    /// files: `Sequence[Replace("▁", " "), ByteFallback, Fuse]`, optionally with
    /// `Strip(" ", 1, 0)`).
    #[error("unsupported decoder in tokenizer.json: {kind}")]
    UnsupportedDecoder {
        /// The decoder (its JSON, shortened).
        kind: String,
    },
    /// An added token of `tokenizer.json` uses an option this crate does not implement.
    #[error("added token `{content}`: unsupported option {option}")]
    UnsupportedAddedToken {
        /// The token's text.
        content: String,
        /// The option (`single_word`, or `normalized` with a `Prepend` normalizer).
        option: &'static str,
    },
    /// A merge rule is not two known tokens separated by one space.
    #[error("{key}[{index}] `{rule}` is malformed or names an unknown token")]
    BadMerge {
        /// Where the merges come from (`tokenizer.ggml.merges`, `model.merges`).
        key: &'static str,
        /// Position in the merge list.
        index: usize,
        /// The rule text.
        rule: String,
    },
    /// A token id is out of the allowed range (ids must be below 2^24 here).
    #[error("token id {id} is out of range")]
    IdOutOfRange {
        /// The id.
        id: u64,
    },
    /// Two tokens claim the same id.
    #[error("token id {id} is assigned twice")]
    DuplicateId {
        /// The id.
        id: u32,
    },
    /// The token-type array length differs from the token array length.
    #[error("{types} token types for {tokens} tokens")]
    TokenTypeCount {
        /// Number of tokens.
        tokens: usize,
        /// Number of token types.
        types: usize,
    },
    /// A line of a tiktoken rank file is not `<base64> <rank>`.
    #[error("tiktoken rank file line {line} is malformed")]
    BadRankLine {
        /// 1-based line number.
        line: usize,
    },
    /// A per-token metadata array (scores, token types) does not have one entry per token.
    #[error("`{field}` has {found} entries for {tokens} tokens")]
    ArrayLength {
        /// The GGUF key.
        field: &'static str,
        /// Number of tokens.
        tokens: usize,
        /// Number of entries found.
        found: usize,
    },
    /// A special token id given in the metadata is not in the vocabulary.
    #[error("`{field}` = {id} is not below the vocabulary size {vocab_size}")]
    SpecialIdOutOfRange {
        /// The GGUF key.
        field: &'static str,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The vocabulary has no tokens.
    #[error("vocabulary is empty")]
    EmptyVocabulary,
}

/// Decoding ids failed.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// An id is not in the vocabulary.
    #[error("token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownId {
        /// The id.
        id: u32,
        /// The vocabulary size (largest id + 1).
        vocab_size: usize,
    },
}

/// Building [`Tokens`](crate::Tokens) from received bytes failed.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokensFromBytesError {
    /// The byte length is not a multiple of 4.
    #[error("{len} bytes is not a whole number of u32 token ids")]
    Length {
        /// The length received.
        len: usize,
    },
    /// The bytes are not 4-byte aligned, so they cannot be borrowed as `u32`s.
    #[error("token bytes are not 4-byte aligned (address mod 4 = {address_mod_4})")]
    Misaligned {
        /// The buffer address modulo 4.
        address_mod_4: usize,
    },
}

/// Compiling, rendering or encoding a chat failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template failed to compile (syntax error) or to render (unknown filter or method,
    /// undefined attribute, type error, recursion limit, ...); minijinja's message and the
    /// template line are in the error.
    #[error("chat template error: {0}")]
    Template(#[from] minijinja::Error),
    /// The template called `raise_exception(message)`: it refuses this conversation
    /// (e.g. "System role not supported").
    #[error("the chat template raised: {message}")]
    Raised {
        /// The template's message.
        message: String,
    },
    /// Rendering spent its fuel ([`crate::ChatTemplate::FUEL`] minijinja instructions): the
    /// template loops too long to be rendered.
    #[error("the chat template ran out of fuel (too many steps)")]
    Exhausted,
    /// A name that is not one of llama.cpp's built-in chat templates.
    #[error("no built-in chat template is named {name:?}")]
    UnknownBuiltin {
        /// The name given.
        name: String,
    },
    /// JSON text given for tools, documents or keywords did not parse (or, for keywords, is not
    /// an object).
    #[error("invalid JSON for {what}: {message}")]
    InvalidJson {
        /// `tools`, `documents` or `kwargs`.
        what: &'static str,
        /// serde_json's message.
        message: String,
    },
    /// Request text at `at` contains special-token text and the template cuts, rewrites or
    /// tests that text (e.g. `.split('</think>')`, `trim`, a length check), so it could not be
    /// kept apart from the template's own special tokens when encoding.
    #[error(
        "{at} contains special-token text and the template rewrites that text, \
         so it cannot be encoded safely"
    )]
    SpecialTextTransformed {
        /// The (first) part of the request with special-token text.
        at: ChatPart,
    },
    /// A JSON object key (of a tool definition, a document or a tool call's arguments)
    /// contains special-token text. Keys cannot be kept apart from template text (templates
    /// look fields up by key), so the request is refused rather than encoded.
    #[error("a JSON key in {at} contains special-token text: {key:?}")]
    SpecialTextInKey {
        /// Where the key is.
        at: ChatPart,
        /// The key.
        key: String,
    },
    /// Request text contains one of the two non-characters (U+FDD0, U+FDD1) used internally to
    /// mark request text, so it could not be kept apart from template text.
    #[error("{at} contains a reserved non-character (U+FDD0 or U+FDD1)")]
    ReservedChar {
        /// Where the text is.
        at: ChatPart,
    },
}

/// The part of a chat request a [`ChatError`] is about.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatPart {
    /// A message of the conversation (its role, content, reasoning, tool calls,
    /// `tool_call_id` or `name`).
    Message {
        /// Index of the message.
        index: usize,
    },
    /// A tool definition (`tools` of [`crate::RenderOptions`]).
    Tool {
        /// Index in the tool list (0 when the tools are not a list).
        index: usize,
    },
    /// A document (`documents` of [`crate::RenderOptions`]).
    Document {
        /// Index in the document list (0 when the documents are not a list).
        index: usize,
    },
}

impl std::fmt::Display for ChatPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Message { index } => write!(f, "message {index}"),
            Self::Tool { index } => write!(f, "tool {index}"),
            Self::Document { index } => write!(f, "document {index}"),
        }
    }
}
