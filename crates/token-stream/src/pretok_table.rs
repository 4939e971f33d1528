//! llama.cpp's BPE pre-tokenizers as data: one [`LlamaPreEntry`] per group of
//! `tokenizer.ggml.pre` names that llama.cpp treats alike (same split regexes, same flags).
//!
//! Source: `llama_vocab::impl::load` (the name chain and its per-name flags) and the
//! `llm_tokenizer_bpe` constructor (the `regex_exprs` per `LLAMA_VOCAB_PRE_TYPE_*`) of
//! llama.cpp as vendored in llama-cpp-python 0.3.36. A new pre-tokenizer is one entry here.
//!
//! Every entry splits through the general path (`pretok_regex`, llama.cpp's regex semantics
//! run by `fancy-regex`); entries with a `fast` scanner use it instead, and
//! `tests/pretok_regex.rs` checks the two agree.

use std::sync::OnceLock;

use crate::pretok_regex::CompiledStage;

/// Hand-written scanners (see `pretok.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Scan {
    /// GPT-2's pattern.
    Gpt2,
    /// Each numeric character alone (HF's `Digits`: Rust's `char::is_numeric`), then GPT-2's
    /// pattern between them.
    SmolLm,
    /// As `SmolLm` with llama.cpp's `\p{N}` (the class tables, whose Unicode version is
    /// llama.cpp's, not the toolchain's): llama.cpp's `starcoder`/`smollm` entries.
    Starcoder,
    /// Llama 3's pattern with tiktoken's `(?i:...)` contractions (which also match `'ſ`).
    Cl100k,
    /// o200k_base's pattern.
    O200k,
    /// Llama 3's pattern with ASCII-only case-insensitive contractions (llama.cpp).
    Llama3,
    /// Qwen2: Llama 3's pattern with single digits.
    Qwen2,
    /// Qwen3.5: Qwen2's pattern where letter runs also take `\p{M}`.
    Qwen35,
    /// `[^\n]+|[\n]+`: runs of newlines and runs of anything else.
    Newlines,
}

/// One llama.cpp BPE pre-tokenizer: the `tokenizer.ggml.pre` names mapping to it, the split
/// regexes llama.cpp applies in sequence (each one refines the pieces of the previous one;
/// text between matches stays a piece of its own), and the flags llama.cpp sets with it.
#[derive(Debug)]
pub struct LlamaPreEntry {
    /// llama.cpp's `tokenizer.ggml.pre` values for this entry (the first names the entry).
    pub names: &'static [&'static str],
    /// The split regexes, exactly as llama.cpp's `regex_exprs` list them.
    pub regexes: &'static [&'static str],
    /// llama.cpp's `ignore_merges`: a piece that is itself a token is emitted as that token.
    pub ignore_merges: bool,
    /// llama.cpp's `clean_spaces` (`clean_up_tokenization_spaces`, a detokenizer option).
    pub clean_spaces: bool,
    /// Whether tokens are GPT-2 byte-level strings (`false`: raw UTF-8 text, symbols are whole
    /// characters, bytes without a token use `<0xXX>` tokens).
    pub byte_encode: bool,
    /// llama.cpp's `escape_whitespaces`: every `' '` becomes `'▁'` (U+2581) before splitting.
    pub escape_whitespace: bool,
    /// A piece made only of `\n` that is a token is emitted as that token (llama.cpp's Gemma 4
    /// fix, llama.cpp PR 21343).
    pub(crate) newline_pieces_whole: bool,
    /// llama.cpp's `add_bos` for this pre-tokenizer when the file has no
    /// `tokenizer.ggml.add_bos_token` (the Llama 3 family, Tekken, Chameleon).
    pub(crate) add_bos: bool,
    /// BOS is added whatever `tokenizer.ggml.add_bos_token` says (llama.cpp's Gemma 4
    /// workaround, llama.cpp PR 21500).
    pub(crate) always_bos: bool,
    pub(crate) fast: Option<Scan>,
    pub(crate) compiled: OnceLock<Vec<CompiledStage>>,
}

impl LlamaPreEntry {
    const fn new(names: &'static [&'static str], regexes: &'static [&'static str]) -> Self {
        Self {
            names,
            regexes,
            ignore_merges: false,
            clean_spaces: true,
            byte_encode: true,
            escape_whitespace: false,
            newline_pieces_whole: false,
            add_bos: false,
            always_bos: false,
            fast: None,
            compiled: OnceLock::new(),
        }
    }
    const fn fast(mut self, scan: Scan) -> Self {
        self.fast = Some(scan);
        self
    }
    const fn ignore_merges(mut self) -> Self {
        self.ignore_merges = true;
        self
    }
    const fn add_bos(mut self) -> Self {
        self.add_bos = true;
        self
    }
    const fn keep_spaces(mut self) -> Self {
        self.clean_spaces = false;
        self
    }
    const fn spm_style(mut self) -> Self {
        self.byte_encode = false;
        self.escape_whitespace = true;
        self
    }

    /// The entry's name (its first `tokenizer.ggml.pre` value).
    pub fn name(&self) -> &'static str {
        self.names[0]
    }
}

/// GPT-2's pattern as llama.cpp writes it (no final `|\s+`: its custom scanner and the
/// between-matches rule give the same pieces).
pub(crate) const GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const NEWLINES: &str = r"[^\n]+|[\n]+";
const DEEPSEEK3: &[&str] = &[
    r"\p{N}{1,3}",
    "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
const STARCODER: &[&str] = &[r"\p{N}", GPT2];
const BLOOM: &str = " ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Number of entries in [`LLAMA_PRES`].
pub const N_LLAMA_PRES: usize = 42;

/// Every BPE pre-tokenizer of llama.cpp's vocabulary code, except the three that llama.cpp
/// runs with custom code this crate does not reproduce ([`UNIMPLEMENTED_LLAMA_PRES`]).
pub static LLAMA_PRES: [LlamaPreEntry; N_LLAMA_PRES] = [
    // Index 0 is llama.cpp's default (also used when `tokenizer.ggml.pre` is missing).
    LlamaPreEntry::new(
        &["default"],
        &[
            r"[\p{P}\$\+<=>\^~\|]+",
            GPT2,
            r"\p{N}+",
            r"[0-9][0-9][0-9]",
        ],
    ),
    LlamaPreEntry::new(&["minicpm5"], &[r"\p{N}{1,3}", r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"])
        .ignore_merges(),
    LlamaPreEntry::new(
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        &[LLAMA3],
    )
    .ignore_merges()
    .add_bos()
    .fast(Scan::Llama3),
    LlamaPreEntry::new(
        &["deepseek-llm"],
        &[
            "[\r\n]",
            "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
            "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
            r"\s+$",
            "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
            r"\p{N}+",
        ],
    )
    .keep_spaces(),
    LlamaPreEntry::new(
        &["deepseek-coder"],
        &[
            "[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
            r"\p{N}",
        ],
    )
    .keep_spaces(),
    LlamaPreEntry::new(&["deepseek-v3"], DEEPSEEK3).keep_spaces(),
    LlamaPreEntry::new(&["hunyuan-dense"], DEEPSEEK3).keep_spaces(),
    LlamaPreEntry::new(&["hy_v4"], DEEPSEEK3).keep_spaces(),
    LlamaPreEntry::new(&["joyai-llm"], DEEPSEEK3).keep_spaces(),
    LlamaPreEntry::new(
        &["spark2_5"],
        &[
            r"\p{N}{1,3}",
            "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
            r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##,
            r"\p{N}",
        ],
    )
    .keep_spaces(),
    LlamaPreEntry::new(
        &["youtu"],
        &[
            "[\u{AC00}-\u{D7A3}\u{3131}-\u{318E}]+|[\u{FF01}\u{2026}\u{201C}\u{201D}\u{2018}\u{2019}\u{2014}\u{FF1A}\u{FF1B}\u{FF0C}\u{3001}-\u{303F}\u{FE30}-\u{FE4F}]+|[\u{3105}-\u{312F}]+|[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    )
    .keep_spaces()
    .ignore_merges(),
    LlamaPreEntry::new(
        &["falcon"],
        &[
            r"[\p{P}\$\+<=>\^~\|`]+",
            GPT2,
            r"[0-9][0-9][0-9]",
        ],
    ),
    LlamaPreEntry::new(&["mpt"], &[GPT2]).fast(Scan::Gpt2),
    LlamaPreEntry::new(&["starcoder"], STARCODER).fast(Scan::Starcoder),
    LlamaPreEntry::new(
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
            "olmo",
            "jais",
        ],
        &[GPT2],
    )
    .fast(Scan::Gpt2),
    LlamaPreEntry::new(&["jais-2"], &[r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"]),
    {
        let mut e = LlamaPreEntry::new(&["gemma4", "granite-embed-multi-311m"], &[NEWLINES])
            .spm_style()
            .fast(Scan::Newlines);
        e.newline_pieces_whole = true;
        e.always_bos = true;
        e
    },
    LlamaPreEntry::new(&["sarvam-moe"], &[NEWLINES])
        .spm_style()
        .keep_spaces()
        .fast(Scan::Newlines),
    {
        let mut e = LlamaPreEntry::new(&["whitespace"], &[r"\S+"]);
        e.byte_encode = false;
        e
    },
    LlamaPreEntry::new(&["refact"], STARCODER)
        .keep_spaces()
        .fast(Scan::Starcoder),
    LlamaPreEntry::new(&["command-r"], STARCODER)
        .keep_spaces()
        .fast(Scan::Starcoder),
    LlamaPreEntry::new(
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "hunyuan",
            "grok-2",
            "solar-open",
        ],
        &[QWEN2],
    )
    .keep_spaces()
    .fast(Scan::Qwen2),
    LlamaPreEntry::new(&["qwen35"], &[QWEN35])
        .keep_spaces()
        .fast(Scan::Qwen35),
    LlamaPreEntry::new(&["stablelm2", "megrez"], &[QWEN2]).fast(Scan::Qwen2),
    LlamaPreEntry::new(&["dbrx", "smaug-bpe", "chatglm-bpe"], &[LLAMA3]).fast(Scan::Llama3),
    LlamaPreEntry::new(&["glm4", "glm5"], &[LLAMA3])
        .ignore_merges()
        .fast(Scan::Llama3),
    LlamaPreEntry::new(&["poro-chat"], &[BLOOM]).keep_spaces(),
    LlamaPreEntry::new(&["bloom", "gpt3-finnish"], &[BLOOM]),
    LlamaPreEntry::new(&["viking"], &[BLOOM, r"\p{N}"]).keep_spaces(),
    LlamaPreEntry::new(
        &["tekken"],
        &[r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    )
    .keep_spaces()
    .ignore_merges()
    .add_bos(),
    LlamaPreEntry::new(
        &["codeshell", "exaone", "minerva-7b", "mellum2"],
        STARCODER,
    )
    .fast(Scan::Starcoder),
    LlamaPreEntry::new(&["smollm"], STARCODER)
        .keep_spaces()
        .fast(Scan::Starcoder),
    LlamaPreEntry::new(&["exaone-moe"], &[r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"]),
    LlamaPreEntry::new(
        &["chameleon"],
        &[
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            GPT2,
        ],
    )
    .keep_spaces()
    .add_bos(),
    LlamaPreEntry::new(&["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], &[GPT4O])
        .keep_spaces(),
    LlamaPreEntry::new(
        &["granite-embed-multi-97m"],
        &[r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    )
    .keep_spaces()
    .ignore_merges(),
    LlamaPreEntry::new(&["superbpe"], &[r"\p{N}+", r"(?=(\d{3})+(?!\d))"]).keep_spaces(),
    LlamaPreEntry::new(&["trillion", "granite-docling"], &[GPT2])
        .keep_spaces()
        .fast(Scan::Gpt2),
    LlamaPreEntry::new(
        &["bailingmoe", "bailingmoe2", "llada-moe"],
        &[r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
    )
    .keep_spaces(),
    LlamaPreEntry::new(
        &["seed-coder"],
        &[r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"],
    )
    .keep_spaces(),
    LlamaPreEntry::new(
        &["ufakzeka"],
        &[r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    )
    .keep_spaces(),
    LlamaPreEntry::new(&["laguna"], &[NEWLINES, QWEN2]).keep_spaces(),
];

/// `tokenizer.ggml.pre` values llama.cpp accepts but splits with hand-written code of its own
/// (Kimi K2's Han handling, AFMoE's and Tiny Aya's digit grouping) that this crate does not
/// reproduce: loading them is an error rather than a silent approximation.
pub const UNIMPLEMENTED_LLAMA_PRES: &[&str] = &["kimi-k2", "afmoe", "tiny_aya", "cohere2moe"];

/// The entry llama.cpp uses for `tokenizer.ggml.pre` value `name`.
pub(crate) fn find(name: &str) -> Option<&'static LlamaPreEntry> {
    LLAMA_PRES.iter().find(|e| e.names.contains(&name))
}

/// llama.cpp's default entry.
pub(crate) fn default_entry() -> &'static LlamaPreEntry {
    &LLAMA_PRES[0]
}
