//! Grammars as [`Constraint`]s, by llguidance (the engine llama.cpp and vLLM use for
//! structured output) over our tokenizer: its token trie is built from our vocabulary's token
//! bytes (special tokens marked as llguidance expects), so a JSON Schema, a regular expression
//! or a Lark grammar becomes a per-token mask.

use std::sync::Arc;

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use token_stream::Tokenizer;

use crate::constraint::{Constraint, ConstraintError, ConstraintFactory};
use crate::json_number::NumberGuard;
use crate::sampling::TokenMask;

/// Why a grammar could not be compiled. The messages are llguidance's one-line summaries:
/// never its parser state or the compiled grammar, which stay inside the server.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// llguidance refused the tokenizer.
    #[error("building the token trie: {0}")]
    Tokenizer(String),
    /// The schema, regex or grammar is invalid (llguidance's message).
    #[error("invalid grammar: {0}")]
    Invalid(String),
    /// The grammar compiles, but no text satisfies it from its first token on: a recursion
    /// with no way out (`{"$ref": "#"}`), or an empty language.
    #[error("no text satisfies it")]
    Empty,
    /// The grammar compiles, but constraining its first token is beyond the compiler's limits
    /// (more alternatives at one point than it takes, such as an `anyOf` of thousands of
    /// objects): llguidance's summary.
    #[error("too complex to constrain the output: {0}")]
    TooComplex(String),
}

/// Longest compiler message passed on.
const MAX_MESSAGE: usize = 240;

/// The first line of an llguidance error, at most [`MAX_MESSAGE`] bytes: its summary, without
/// the parser state or grammar dump that may follow.
fn summary(e: &impl std::fmt::Display) -> String {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or("").trim();
    let mut end = line.len().min(MAX_MESSAGE);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line[..end].to_owned()
}

/// Compiles grammars for one model's vocabulary.
///
/// ```no_run
/// # fn f(tok: &token_stream::Tokenizer) -> Result<(), gpu_pipeline::GrammarError> {
/// let grammars = gpu_pipeline::Grammars::new(tok, tok.vocab_size(), 2)?;
/// let json = grammars.json_schema(serde_json::json!({"type": "object"}))?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// The grammar compiler of a model whose logits have `vocab_size` entries (ids beyond the
    /// tokenizer's are never allowed) and whose end of sequence is `eos`.
    pub fn new(tok: &Tokenizer, vocab_size: usize, eos: u32) -> Result<Self, GrammarError> {
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match tok.token_bytes(id) {
                // llguidance marks special tokens with a leading 0xff byte.
                Some(b) if tok.is_special(id) => [&[TokTrie::SPECIAL_TOKEN_MARKER], b].concat(),
                Some(b) => b.to_vec(),
                None => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(summary(&e)))?;
        // Errors carry no parser state or grammar dump (they reach API clients), and nothing
        // is written to stderr behind the server's log.
        factory.limits_mut().verbose_errors = false;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// A constraint to JSON that validates against `schema`, its integers without bounds
    /// held to 64 bits ([`bound_json_integers`]) and its numbers to what a double holds: at
    /// most 20 integer digits, 20 fraction digits and 3 exponent digits, and finite (JSON
    /// Schema has no keyword that limits a number's digits, so a model could otherwise write
    /// one until its token limit).
    pub fn json_schema(
        &self,
        mut schema: serde_json::Value,
    ) -> Result<Arc<dyn ConstraintFactory>, GrammarError> {
        bound_json_integers(&mut schema);
        self.compile(TopLevelGrammar::from_json_schema(schema), true)
    }

    /// A constraint to text matching the regular expression `rx`.
    pub fn regex(&self, rx: &str) -> Result<Arc<dyn ConstraintFactory>, GrammarError> {
        self.compile(TopLevelGrammar::from_regex(rx), false)
    }

    /// A constraint to text of the Lark grammar `lark`.
    pub fn lark(&self, lark: &str) -> Result<Arc<dyn ConstraintFactory>, GrammarError> {
        self.compile(TopLevelGrammar::from_lark(lark.to_owned()), false)
    }

    /// A constraint to text of the Lark grammar `lark` whose numbers are all JSON numbers
    /// (JSON embedded with `%json`, such as a tool call's arguments): they are held to what a
    /// double holds, as in [`json_schema`](Self::json_schema). Digits after a letter or inside
    /// a string are no number.
    pub fn json_lark(&self, lark: &str) -> Result<Arc<dyn ConstraintFactory>, GrammarError> {
        self.compile(TopLevelGrammar::from_lark(lark.to_owned()), true)
    }

    fn compile(
        &self,
        grammar: TopLevelGrammar,
        json_numbers: bool,
    ) -> Result<Arc<dyn ConstraintFactory>, GrammarError> {
        // Compile once now, and constrain the first token, so a bad grammar is an error at
        // submission rather than a failed generation: a recursion with no way out, or too many
        // alternatives at once, only shows when a mask is computed.
        let mut parser = self
            .factory
            .create_parser(grammar.clone())
            .map_err(|e| GrammarError::Invalid(summary(&e)))?;
        parser.start_without_prompt();
        match parser.compute_mask() {
            Ok(first) if !first.is_zero() => {}
            Ok(_) => return Err(GrammarError::Empty),
            Err(_)
                if matches!(
                    parser.stop_reason(),
                    StopReason::NoExtension | StopReason::NoExtensionBias
                ) =>
            {
                return Err(GrammarError::Empty);
            }
            Err(e) => return Err(GrammarError::TooComplex(summary(&e))),
        }
        Ok(Arc::new(GrammarFactory {
            factory: self.factory.clone(),
            grammar,
            json_numbers,
        }))
    }
}

/// The lowest lower bound llguidance 1.9.1 takes for an integer: it reads bounds as `f64`
/// and negates the lower one as an `i64` when it builds its regular expression, so `i64::MIN`
/// and every bound that rounds to it (`-i64::MAX` does) overflow, a panic it reports as an
/// invalid schema. This is the closest `f64` above: `i64::MIN + 1024`.
const I64_LOWEST_BOUND: i64 = i64::MIN + 1024;

/// Gives every integer schema in `schema` that lacks a bound 64-bit bounds: `maximum`
/// `i64::MAX` and `minimum` `i64::MIN + 1024` (the lowest llguidance
/// takes), so that a generated integer is one every JSON parser reads into 64 bits, and a model
/// cannot write digits until its token limit (an unbounded `"population"` ran to its 200-token
/// limit in digits on the default model). Bounds already given are kept, as are integers
/// constrained by `enum` or `const`. An integer schema is one whose `type` is `"integer"` or a
/// list with `"integer"` and without `"number"`.
///
/// ```
/// let mut schema = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}});
/// gpu_pipeline::bound_json_integers(&mut schema);
/// assert_eq!(schema["properties"]["n"]["maximum"], i64::MAX);
/// ```
pub fn bound_json_integers(schema: &mut serde_json::Value) {
    use serde_json::{Value, json};
    match schema {
        Value::Object(node) => {
            let is_integer = match node.get("type") {
                Some(Value::String(t)) => t == "integer",
                Some(Value::Array(ts)) => {
                    ts.iter().any(|t| t == "integer") && !ts.iter().any(|t| t == "number")
                }
                _ => false,
            };
            if is_integer && !node.contains_key("enum") && !node.contains_key("const") {
                if !node.contains_key("maximum") && !node.contains_key("exclusiveMaximum") {
                    node.insert("maximum".into(), json!(i64::MAX));
                }
                if !node.contains_key("minimum") && !node.contains_key("exclusiveMinimum") {
                    node.insert("minimum".into(), json!(I64_LOWEST_BOUND));
                }
            }
            for (key, value) in node.iter_mut() {
                match key.as_str() {
                    // Data, not schemas.
                    "const" | "enum" | "default" | "examples" => {}
                    // Maps of schemas, whose keys are names (a property may be named `enum`).
                    "properties" | "patternProperties" | "$defs" | "definitions"
                    | "dependentSchemas" => {
                        if let Value::Object(map) = value {
                            map.values_mut().for_each(bound_json_integers);
                        }
                    }
                    _ => bound_json_integers(value),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(bound_json_integers),
        _ => {}
    }
}

struct GrammarFactory {
    factory: Arc<ParserFactory>,
    grammar: TopLevelGrammar,
    /// Whether the output's numbers are JSON numbers held to what a double holds.
    json_numbers: bool,
}

impl std::fmt::Debug for GrammarFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarFactory").finish_non_exhaustive()
    }
}

impl ConstraintFactory for GrammarFactory {
    fn start(&self) -> Box<dyn Constraint> {
        let parser = self.factory.create_parser(self.grammar.clone());
        let env = self.factory.tok_env();
        Box::new(GrammarConstraint {
            matcher: Matcher::new(parser),
            vocab: env.tok_trie().vocab_size(),
            numbers: self.json_numbers.then(|| JsonNumbers {
                guard: NumberGuard::default(),
                env: env.clone(),
                refused: Vec::new(),
            }),
        })
    }
}

struct GrammarConstraint {
    matcher: Matcher,
    /// The grammar's vocabulary size (a token id at or past it would put the matcher in its
    /// error state).
    vocab: usize,
    /// The bound on JSON numbers, where the grammar's numbers are JSON's.
    numbers: Option<JsonNumbers>,
}

/// The bound on a JSON grammar's numbers ([`NumberGuard`]) and the token texts it reads.
struct JsonNumbers {
    guard: NumberGuard,
    env: llguidance::toktrie::TokEnv,
    /// The tokens the last mask refused (reused).
    refused: Vec<u32>,
}

impl JsonNumbers {
    /// Forbids in `mask` the tokens that carry the number being written past the bounds,
    /// unless that forbids every token (a grammar that demands more digits, such as a bound
    /// of 10^25, is followed).
    fn restrict(&mut self, mask: &mut TokenMask) {
        if !self.guard.in_number() {
            return;
        }
        let trie = self.env.tok_trie();
        self.refused.clear();
        for (w, &word) in mask.words_mut().iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let id = (w * 32) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                if !self.guard.allows(trie.token(id)) {
                    self.refused.push(id);
                }
            }
        }
        if self.refused.is_empty() {
            return;
        }
        self.refused.iter().for_each(|&id| mask.forbid(id));
        if mask.count_allowed() == 0 {
            self.refused.iter().for_each(|&id| mask.allow(id));
        }
    }
}

impl std::fmt::Debug for GrammarConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarConstraint").finish_non_exhaustive()
    }
}

fn failed(e: impl std::fmt::Display) -> ConstraintError {
    ConstraintError::Failed(summary(&e))
}

impl Constraint for GrammarConstraint {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(failed)?;
        let src = allowed.as_slice();
        let tail_bits = mask.vocab() % 32;
        let dst = mask.words_mut();
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        dst[n..].fill(0);
        if let Some(last) = dst.last_mut().filter(|_| tail_bits != 0) {
            // Bits beyond the vocabulary stay zero.
            *last &= (1u32 << tail_bits) - 1;
        }
        if let Some(numbers) = &mut self.numbers {
            numbers.restrict(mask);
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        // A finished grammar only allows the end of sequence, which ends the generation.
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(failed)?;
        if let Some(numbers) = &mut self.numbers {
            numbers.guard.push(numbers.env.tok_trie().token(token));
        }
        Ok(())
    }

    fn allowed_prefix(&mut self, tokens: &[u32]) -> usize {
        // Ids the grammar does not know end the prefix before the matcher sees them; a
        // stopped or failed matcher allows none (its next mask reports the failure).
        let known = tokens
            .iter()
            .take_while(|&&t| (t as usize) < self.vocab)
            .count();
        let valid = self.matcher.validate_tokens(&tokens[..known]).unwrap_or(0);
        let Some(numbers) = &self.numbers else {
            return valid;
        };
        // The number bound cuts where its mask would refuse a token (without the mask's
        // exception for a grammar that demands more digits: a shorter draft only costs
        // speculation, and the verification samples through the mask).
        let trie = numbers.env.tok_trie();
        let mut guard = numbers.guard.clone();
        tokens[..valid]
            .iter()
            .position(|&t| {
                let refused = !guard.allows(trie.token(t));
                guard.push(trie.token(t));
                refused
            })
            .unwrap_or(valid)
    }
}
