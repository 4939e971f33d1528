//! # token-stream
//!
//! Exact, fast tokenizers: text becomes a plain `u32` token stream ([`Tokens`]) that flows to
//! the model and onto the wire without copies, and back into text with a streaming
//! detokenizer ([`StreamDecoder`]).
//!
//! - Algorithms: byte-level BPE, and from GGUF the non-BPE models of llama.cpp with its exact
//!   results: SentencePiece-style merges (`tokenizer.ggml.model = llama`: Llama 2, Phi-3,
//!   Baichuan), WordPiece (`bert`) and Unigram (`t5`), checked against llama.cpp's own
//!   vocabulary suite (`tests/vocab_suite.rs`). End-of-generation ids ([`Tokenizer::eog_ids`])
//!   and BOS/EOS adding ([`Tokenizer::encode_for_model`]) follow llama.cpp.
//! - Vocabularies: GPT-2-style, SmolLM2 (`tokenizer.ggml.pre = smollm`), Llama 3, OpenAI's
//!   cl100k_base and o200k_base, and every BPE pre-tokenizer of llama.cpp's vocabulary code
//!   ([`LLAMA_PRES`]: one table entry per `tokenizer.ggml.pre` group, split exactly as
//!   llama.cpp splits, ids equal to llama.cpp's on its own vocabulary suite, see
//!   `tests/vocab_suite.rs`), plus the `gemma4` BPE model. Loaded from GGUF metadata ([`Tokenizer::from_gguf`], feature
//!   `gguf`), a HF `tokenizer.json` ([`Tokenizer::from_tokenizer_json`]: byte-level BPE, and the
//!   SentencePiece-style BPE of Llama 2, Mistral, Gemma and Phi-3 with HF's exact ids, see
//!   `tests/hf_spm.rs`) or a tiktoken rank file ([`Tokenizer::from_tiktoken`]).
//! - Exact: ids equal HF `tokenizers` and `tiktoken` on the parity corpus (see `tests/parity.rs`).
//!   The split regexes are hand-written scanners ([`Pretokenizer`]) proven equal to the regexes.
//! - Safe by default: [`Tokenizer::encode`] never produces special tokens from text; only
//!   [`Tokenizer::encode_with_specials`] (trusted text) and [`ChatTemplate::encode`] (the
//!   template's own markers) do.
//! - Vocabulary gaps: a byte with no token (SmolLM2 has none for 21 byte values, among them
//!   0x04, 0x06, 0x13, 0x14, 0x16, 0x1D and the UTF-8 lead bytes 0xF1/0xF2) is dropped, as the
//!   references do, so `decode(encode(s)) == s` holds for every string without those bytes.
//!
//! ```
//! use token_stream::{Pretokenizer, Tokenizer, Tokens, base64_encode};
//! // A tiny tiktoken-format vocabulary: all bytes, plus "he", "ll", "hell", "hello".
//! let mut ranks = String::new();
//! for b in 0..=255u8 { ranks += &format!("{} {b}\n", base64_encode(&[b])); }
//! for (i, t) in ["he", "ll", "hell", "hello"].iter().enumerate() {
//!     ranks += &format!("{} {}\n", base64_encode(t.as_bytes()), 256 + i);
//! }
//! let tok = Tokenizer::from_tiktoken(&ranks, Pretokenizer::Cl100k, &[("<|endoftext|>", 300)])?;
//! let ids: Tokens<'static> = tok.encode("hello hell");
//! assert_eq!(ids.as_slice(), &[259, 32, 258]);
//! let wire = ids.as_bytes(); // zero-copy view for the network
//! assert_eq!(tok.decode(&Tokens::from_bytes(wire)?)?, "hello hell");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod backtrack;
mod bpe;
mod chat;
mod double_array;
mod error;
mod hf_spm;
mod load;
mod pair_table;
mod pretok;
mod pretok_regex;
mod pretok_table;
mod spm;
mod stream;
mod tokenizer;
mod tokens;
mod type_overrides;
mod ugm;
mod unicode;
mod vocab;
mod whole;
mod wpm;

pub use chat::{
    BuiltinTemplate, ChatTemplate, ParsedToolCall, RenderOptions, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,
    TemplateMessage, ToolCall, ToolCallParser, ToolEvent, ToolSyntax, forced_call_grammar,
    polyfill_messages, tool_json, tools_system_prompt,
};
pub use error::{ChatError, ChatPart, DecodeError, LoadError, TokensFromBytesError};
pub use load::{CL100K_SPECIALS, GgufVocab, O200K_SPECIALS, base64_encode};
pub use pretok::{LlamaPre, Pieces, Pretokenizer};
pub use pretok_table::{LLAMA_PRES, LlamaPreEntry, N_LLAMA_PRES, UNIMPLEMENTED_LLAMA_PRES};
pub use stream::{StreamDecoder, StreamStep};
pub use tokenizer::Tokenizer;
pub use tokens::Tokens;

#[cfg(feature = "gguf")]
pub use weight_cache;
