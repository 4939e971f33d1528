//! The token-type corrections llama.cpp makes when it loads a GGUF vocabulary
//! (`llama_vocab::impl::load`, after the special ids are read), so that special-token text
//! parses as llama.cpp parses it.
//!
//! 1. A token whose text names an end-of-turn, end-of-message or fill-in-the-middle token is
//!    made a control token when the file does not give that special id (`tokenizer.ggml.eot_token_id`,
//!    `eom_token_id`, `fim_*_token_id` and the deprecated `prefix/suffix/middle_token_id`); one
//!    token per list.
//! 2. Every token whose text is an end-of-generation name ([`EOG_NAMES`], `</s>` among them) is
//!    made a control token. Qwen2's `</s>` is a normal BPE token in the file: with special
//!    parsing it is then one token, as in llama.cpp, instead of `</`, `s`, `>`.
//! 3. gpt-oss's `<|channel|>`, `<|message|>`, `<|start|>` and `<|constrain|>` become
//!    user-defined (always matched in text, rendered when decoded).
//! 4. o200k-harmony and solar-open vocabularies (`<|return|>` and `<|call|>`, or `<|calls|>`
//!    and `<|flush|>`, beside `<|end|>`): `<|end|>` becomes user-defined and ends nothing.
//! 5. Gemma 4 and PLaMo (an end-of-generation `<|tool_response>` or `<|plamo:eos|>`): `</s>` is
//!    a normal token and ends nothing.
//!
//! llama.cpp prints a warning for each; the loader logs each with `tracing::warn!`. In its
//! rule 1 llama.cpp takes, among several tokens of one list, the first its hash map visits;
//! here the lowest id.

use crate::load::GgufVocab;
use crate::tokenizer::EOG_NAMES;

/// llama.cpp's `tokenizer.ggml.token_type` values used here.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// The end-of-turn names (llama.cpp's `special_eot_id` auto-detection).
const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "<end_of_utterance>",
];
const EOM_NAMES: &[&str] = &["<|eom_id|>"];
const FIM_PRE_NAMES: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<\u{ff5c}fim\u{2581}begin\u{ff5c}>",
    "<PRE>",
    "\u{2581}<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_NAMES: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<\u{ff5c}fim\u{2581}hole\u{ff5c}>",
    "<SUF>",
    "\u{2581}<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_NAMES: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<\u{ff5c}fim\u{2581}end\u{ff5c}>",
    "<MID>",
    "\u{2581}<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_NAMES: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_NAMES: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_NAMES: &[&str] = &["<|file_sep|>"];
/// gpt-oss's tokens that llama.cpp always renders (made user-defined).
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// One token whose type llama.cpp changes at load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TypeOverride {
    pub(crate) id: u32,
    /// The type in the file (1 normal, 3 control, 4 user-defined, ...).
    pub(crate) from: i32,
    /// The type llama.cpp gives it.
    pub(crate) to: i32,
}

/// What llama.cpp changes in a vocabulary at load: token types, and end-of-generation ids
/// beyond EOS, EOT, EOM and the [`EOG_NAMES`].
#[derive(Debug, Default)]
pub(crate) struct LlamaCppFixes {
    /// Token types to change, by id (ascending).
    pub(crate) types: Vec<TypeOverride>,
    /// Ids that end generation too: the end-of-turn and end-of-message ids and the FIM
    /// pad / repo / file-separator ids, from the file or found by name.
    pub(crate) eog_extra: Vec<u32>,
    /// Ids that end no generation although their name is in [`EOG_NAMES`] (rules 4 and 5).
    pub(crate) eog_removed: Vec<u32>,
}

impl LlamaCppFixes {
    /// The fixes of vocabulary `v`.
    pub(crate) fn of(v: &GgufVocab<'_>) -> Self {
        let n = v.tokens.len();
        let mut types: Vec<i32> = (0..n)
            .map(|i| v.token_types.get(i).copied().unwrap_or(NORMAL))
            .collect();
        let file_types = types.clone();
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        let find = |names: &[&str]| {
            v.tokens
                .iter()
                .position(|t| names.contains(t))
                .map(|i| i as u32)
        };
        let promote = |types: &mut [i32], id: u32| {
            if types[id as usize] != CONTROL {
                types[id as usize] = CONTROL;
            }
        };
        // Rule 1: one token per list, where the file gives no valid id.
        let mut detected = [None; 8];
        let lists: [(Option<u32>, &[&str]); 8] = [
            (v.eot, EOT_NAMES),
            (v.eom, EOM_NAMES),
            (v.fim_pre, FIM_PRE_NAMES),
            (v.fim_suf, FIM_SUF_NAMES),
            (v.fim_mid, FIM_MID_NAMES),
            (v.fim_pad, FIM_PAD_NAMES),
            (v.fim_rep, FIM_REP_NAMES),
            (v.fim_sep, FIM_SEP_NAMES),
        ];
        for (slot, (given, names)) in detected.iter_mut().zip(lists) {
            *slot = match in_range(given) {
                Some(id) => Some(id),
                None => {
                    let found = find(names);
                    if let Some(id) = found {
                        promote(&mut types, id);
                    }
                    found
                }
            };
        }
        // Rule 2.
        let named_eog: Vec<u32> = (0..n as u32)
            .filter(|&i| EOG_NAMES.contains(&v.tokens[i as usize]))
            .collect();
        for &id in &named_eog {
            promote(&mut types, id);
        }
        // Rule 3.
        for (id, t) in v.tokens.iter().enumerate() {
            if ALWAYS_RENDERED.contains(t) {
                types[id] = USER_DEFINED;
            }
        }
        // Rules 4 and 5 look at the end-of-generation set as llama.cpp has it by then.
        let [eot, eom, _, _, _, pad, rep, sep] = detected;
        let eog_extra: Vec<u32> = [eot, eom, pad, rep, sep].into_iter().flatten().collect();
        let mut eog: Vec<u32> = named_eog;
        eog.extend(&eog_extra);
        eog.extend(in_range(v.eos));
        let eog_with = |text: &str| eog.iter().find(|&&i| v.tokens[i as usize] == text).copied();
        let mut eog_removed = Vec::new();
        if let Some(end) = eog_with("<|end|>") {
            let call = eog_with("<|call|>").or(eog_with("<|calls|>"));
            let harmony = eog_with("<|return|>").is_some() && call.is_some();
            let solar = call.is_some() && eog_with("<|flush|>").is_some();
            if harmony || solar {
                types[end as usize] = USER_DEFINED;
                eog_removed.push(end);
            }
        }
        if let Some(s) = eog_with("</s>")
            && (eog_with("<|tool_response>").is_some() || eog_with("<|plamo:eos|>").is_some())
        {
            types[s as usize] = NORMAL;
            eog_removed.push(s);
        }
        let types = file_types
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (from, to))| from != to)
            .map(|(id, (&from, &to))| TypeOverride {
                id: id as u32,
                from,
                to,
            })
            .collect();
        Self {
            types,
            eog_extra,
            eog_removed,
        }
    }

    /// `v` with the types changed (a copy), logging each change; `None` when nothing changes
    /// or the file's types do not match its tokens (the loader reports that).
    pub(crate) fn apply<'a>(&self, v: &GgufVocab<'a>) -> Option<GgufVocab<'a>> {
        if self.types.is_empty()
            || !(v.token_types.is_empty() || v.token_types.len() == v.tokens.len())
        {
            return None;
        }
        let mut fixed = v.clone();
        fixed.token_types.resize(v.tokens.len(), NORMAL);
        for o in &self.types {
            let token = v.tokens[o.id as usize];
            tracing::warn!(
                id = o.id,
                token,
                file_type = o.from,
                new_type = o.to,
                "token type overridden as llama.cpp does at load ({})",
                match o.to {
                    CONTROL => "control-looking token that was not control-type",
                    USER_DEFINED => "rendered as text",
                    _ => "a normal token in this vocabulary",
                }
            );
            fixed.token_types[o.id as usize] = o.to;
        }
        Some(fixed)
    }
}
