//! Speculative decoding: proposing draft tokens (by n-gram lookup in the sequence's own text,
//! or from a smaller draft model), the acceptance rule that keeps the output exactly the target
//! model's, and the per-sequence policy that sizes drafts by their measured acceptance.
//!
//! **Proposal by lookup** ([`longest_match`]): the end of the sequence (prompt and generated
//! text) is matched against its earlier text, up to [`NgramLookup::max_ngram`] tokens; at the
//! most recent occurrence of the longest match, the tokens that followed it are the draft
//! (llama.cpp's `llama-lookup` and vLLM's n-gram proposer). Code edits and summaries repeat
//! their prompt, so these drafts are often right, and the longer the match the likelier:
//! on the default model's outputs a token after a 1-token match was the next token 10-17% of
//! the time, after 4 tokens 67-81%, after 8 or more 94-97%. So each sequence keeps an estimate
//! of a draft token's acceptance per match length (1 to 8 and more; a prior from those rates,
//! updated by its own verifications: `MatchStats`), and the draft runs, token `j` continuing
//! a match of `n + j`, while the product of the estimates (the chance that everything drafted
//! so far is accepted) stays at least [`NgramLookup::min_probability`]. Text that does not
//! repeat itself gets few and short drafts, without a switch.
//!
//! **Proposal by a draft model** ([`DraftModel`]): a smaller model sharing the target's
//! vocabulary decodes greedily from the sequence's text in its own KV ring (the engine first
//! feeds it whatever text it has not seen: the prompt once, then the tokens of each step), one
//! token per draft step, and stops early when its top token's probability falls under
//! [`DraftModel::min_probability`] (llama.cpp's `--draft-p-min`). Every drafting sequence
//! of a step runs in one batched forward pass of the draft model. After the verification the
//! draft ring is rolled back to the accepted text, as the target's is. Lookup goes first
//! ([`DraftModel::lookup_first`], on by default): where it confidently proposes at least
//! [`LOOKUP_FIRST_MIN`] tokens, those are the step's draft and the draft model does not run
//! (a draft pass per token is what a draft model costs; its ring catches up on the skipped
//! text, batched, the next time it drafts).
//!
//! **Verification** ([`verify`]): the engine runs the sequence's step on `[last token, draft...]`
//! (one forward pass, logits for every row; the other sequences of the batch are untouched, a
//! row's result not depending on the others) and samples row `i` exactly as it would sample
//! that position without speculation: same sampler (penalties see the drafts before `i` as
//! generated, as they would be), same grammar mask, same random stream. Row `i`'s token is
//! emitted; if it equals draft `i` the next row is sampled too, else the step ends there.
//! This is the standard speculative rejection rule for a draft distribution that is a point
//! mass on draft `t` (accept `t` with probability `min(1, p(t)/q(t)) = p(t)`; on rejection draw
//! from the residual `max(0, p - q)`, which is `p` with `t` removed and renormalized): drawing
//! `x ~ p` and accepting iff `x == t` accepts with probability `p(t)`, and a rejected draw is
//! distributed as `p` conditioned on `x != t`. Both proposers are point masses (lookup, and the
//! draft model's greedy choice). It uses one draw per emitted token, in the order a plain
//! decode draws them, so with the same seed the output is not only distributed as the
//! target's, it is the same tokens; greedy output is bit-identical. The KV rows of rejected
//! drafts are rolled back ([`kv_ring::KvRing::rollback`]) and the step emits the accepted
//! drafts plus the one token of the first row that did not match (the correction, or the
//! bonus after a fully accepted draft).
//!
//! **Under a constraint** (structured output): a sequence's draft is cut at the first token its
//! constraint forbids ([`Constraint::allowed_prefix`](crate::Constraint::allowed_prefix),
//! which checks without advancing; the draft model stops drafting there), so verification rows
//! are not spent on tokens the mask would reject anyway.
//!
//! **Draft-model policy** ([`SpecState`]): drafts start at the draft model's `max_draft`, its
//! confidence cut-off shortening them; the length grows by 2 after a fully accepted draft and
//! shrinks by 1 otherwise (HF transformers' heuristic), within `1..=max_draft`. An exponential
//! average of the acceptance rate (from 0.5, after at least 3 verifications) below the
//! configured `min_acceptance` turns drafting off for the sequence for a back-off of 16 steps,
//! then one 1-token probe: rejected, the back-off doubles (up to 256 steps). So text that the
//! draft model cannot predict costs a few failed verifications at its start and one 1-token
//! probe now and then, not one per step. (Lookup sizes its drafts by its estimate instead.)

use std::sync::Arc;

use crate::model::Model;

/// Whether and how the [`Engine`](super::Engine) speculates
/// ([`EngineConfig::speculation`](super::EngineConfig::speculation)).
///
/// ```
/// use gpu_pipeline::engine::{EngineConfig, NgramLookup, Speculation};
/// let cfg = EngineConfig::default()
///     .with_speculation(Speculation::NgramLookup(NgramLookup::default().with_max_draft(6)));
/// assert!(matches!(cfg.speculation, Speculation::NgramLookup(n) if n.max_draft == 6));
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, Default)]
pub enum Speculation {
    /// One token per sequence per step.
    #[default]
    Off,
    /// Drafts from n-gram lookup in the sequence's own text (see [`propose`] and [`verify`]).
    NgramLookup(NgramLookup),
    /// Drafts from a smaller model with the same vocabulary (see [`DraftModel`]).
    DraftModel(DraftModel),
}

/// Settings of draft-model speculation ([`Speculation::DraftModel`]): the draft model (run by
/// the CPU kernels, with its own KV pool) and the policy.
///
/// ```no_run
/// use std::sync::Arc;
/// use gpu_pipeline::engine::{DraftModel, EngineConfig, Speculation};
/// use gpu_pipeline::{Model, ModelOptions};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // SAFETY: the model file is not modified while mapped.
/// let gguf = Arc::new(unsafe { weight_cache::Gguf::open("small.gguf")? });
/// let draft = Arc::new(Model::load(gguf, ModelOptions::default())?);
/// let cfg = EngineConfig::default()
///     .with_speculation(Speculation::DraftModel(DraftModel::new(draft).with_max_draft(6)));
/// # Ok(()) }
/// ```
#[non_exhaustive]
#[derive(Clone)]
pub struct DraftModel {
    /// The draft model; its vocabulary must be the target's (checked when the engine starts).
    pub model: Arc<Model>,
    /// Most draft tokens verified per step (the adaptive length stays within it).
    pub max_draft: usize,
    /// A draft step whose top token has a lower probability (under the draft model) ends the
    /// draft before that token (llama.cpp's `--draft-p-min`).
    pub min_probability: f32,
    /// Acceptance rate (an exponential average over verifications) below which a sequence
    /// stops drafting for a while.
    pub min_acceptance: f32,
    /// Most decoding sequences in the batch for which anyone drafts (default 16), with
    /// lookup's odds rule ([`NgramLookup::max_batch`]): in a batch of `B` decoding sequences a
    /// draft token's top probability must have odds `B` times those of `min_probability`
    /// ([`min_probability_in_batch`](Self::min_probability_in_batch): 0.1 alone, 0.18 for 2,
    /// 0.36 for 5, 0.64 for 16). All drafting sequences share each draft pass. The default
    /// model (Q4_1) drafting for its F32 version, `scripts/bench-speculation --rounds 2
    /// --max-batch 8` (2 threads; each kind's prompts at once against plain batched decoding in
    /// the same run): 5 repetitive prompts 1.37x, 3 chats 1.53x; with the weaker Q2_K
    /// requantization as the draft 1.23x and 1.00x, against 1.04x and 0.99x drafting only alone
    /// (`max_batch` 1, the default before).
    pub max_batch: usize,
    /// KV budget of the draft model's own pool, in bytes. A sequence whose draft ring does not
    /// fit decodes without drafts.
    pub kv_budget_bytes: usize,
    /// Lookup first: where n-gram lookup in the sequence's own text confidently proposes at
    /// least [`LOOKUP_FIRST_MIN`] tokens (as [`Speculation::NgramLookup`] with these settings
    /// would, up to this draft model's `max_draft`; its `max_draft` and `max_batch` are not
    /// used), those are the draft and the draft model does not run for that step (its ring
    /// catches up on the text later). Text that repeats the prompt then costs no draft passes.
    pub lookup_first: Option<NgramLookup>,
}

/// Fewest tokens a confident lookup must propose to stand in for the draft model
/// ([`DraftModel::lookup_first`]).
pub const LOOKUP_FIRST_MIN: usize = 4;

impl DraftModel {
    /// Drafts from `model` with the default policy: up to 8 tokens, cut at a top-token
    /// probability under 0.1 (the probability over the whole vocabulary: on the default model
    /// drafting for its F32 version, `scripts/bench-speculation`, 0.5 cut most drafts short,
    /// 1.4x plain decoding against 1.7x at 0.1-0.2), off under an acceptance of 0.3, while up
    /// to 16 sequences decode (the cut-off rising with their number), 256 MiB of draft KV.
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            max_draft: 8,
            min_probability: 0.1,
            min_acceptance: 0.3,
            max_batch: 16,
            kv_budget_bytes: 256 << 20,
            lookup_first: Some(NgramLookup::default()),
        }
    }
    /// Sets [`max_draft`](Self::max_draft) (at least 1).
    pub fn with_max_draft(mut self, n: usize) -> Self {
        self.max_draft = n.max(1);
        self
    }
    /// Sets [`min_probability`](Self::min_probability).
    pub fn with_min_probability(mut self, p: f32) -> Self {
        self.min_probability = p;
        self
    }
    /// Sets [`min_acceptance`](Self::min_acceptance).
    pub fn with_min_acceptance(mut self, rate: f32) -> Self {
        self.min_acceptance = rate;
        self
    }
    /// Sets [`max_batch`](Self::max_batch).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }
    /// The cut-off of a draft token in a batch of `batch` decoding sequences: the top token's
    /// probability must have odds `batch` times those of
    /// [`min_probability`](Self::min_probability) (lookup's rule,
    /// [`NgramLookup::min_probability_in_batch`]; see [`max_batch`](Self::max_batch)).
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use gpu_pipeline::engine::DraftModel;
    /// # use gpu_pipeline::{Model, ModelOptions};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let gguf = Arc::new(unsafe { weight_cache::Gguf::open("small.gguf")? });
    /// # let draft = Arc::new(Model::load(gguf, ModelOptions::default())?);
    /// let d = DraftModel::new(draft).with_min_probability(0.2);
    /// assert_eq!(d.min_probability_in_batch(1), 0.2);
    /// assert!((d.min_probability_in_batch(4) - 0.5).abs() < 1e-6); // odds 0.25 -> 1
    /// # Ok(()) }
    /// ```
    pub fn min_probability_in_batch(&self, batch: usize) -> f32 {
        odds_bar(self.min_probability, batch)
    }
    /// Sets [`kv_budget_bytes`](Self::kv_budget_bytes).
    pub fn with_kv_budget_bytes(mut self, b: usize) -> Self {
        self.kv_budget_bytes = b;
        self
    }
    /// Sets [`lookup_first`](Self::lookup_first) (`None`: the draft model always proposes).
    pub fn with_lookup_first(mut self, lookup: Option<NgramLookup>) -> Self {
        self.lookup_first = lookup;
        self
    }
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.model.config();
        f.debug_struct("DraftModel")
            .field("arch", &c.arch)
            .field("n_layers", &c.n_layers)
            .field("n_embd", &c.n_embd)
            .field("max_draft", &self.max_draft)
            .field("min_probability", &self.min_probability)
            .field("min_acceptance", &self.min_acceptance)
            .field("max_batch", &self.max_batch)
            .field("kv_budget_bytes", &self.kv_budget_bytes)
            .field("lookup_first", &self.lookup_first)
            .finish()
    }
}

/// Settings of n-gram prompt-lookup speculation ([`Speculation::NgramLookup`]).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NgramLookup {
    /// Most draft tokens verified per step.
    pub max_draft: usize,
    /// Longest match measured: the sequence's last tokens are matched against its earlier text
    /// up to this many tokens (a longer match picks the occurrence and predicts better).
    pub max_ngram: usize,
    /// Shortest match that may propose (1: a single token).
    pub min_ngram: usize,
    /// A draft goes on while the estimated probability that all of it, up to and including
    /// the next token, is accepted stays at least this. The estimate is the sequence's own:
    /// per length of the match a draft token continues (1 to 8 and more), a prior measured on
    /// the default model's outputs (a token after a 1-token match was right 10-17% of the
    /// time, after 8 or more 94-97%) updated by the sequence's verifications. A draft token
    /// costs about a fifth of a step on the default model (2 threads,
    /// `examples/step_cost`) and yields a token only if it and every draft token before it
    /// are accepted; 0.3 did best when the bench prompts' outputs were replayed under that
    /// cost (1.71x plain, against 1.68x for 0.4 and 1.66x for 0.5).
    pub min_probability: f32,
    /// Most decoding sequences in the batch for which anyone drafts (default 16). A draft
    /// token costs a token's compute whether it is accepted or not, and what an accepted one
    /// saves shrinks as the batch grows: a step reads the weights once for all its tokens, so
    /// the more sequences decode together, the more a step costs per token in compute rather
    /// than in reading the weights, and the nearer a draft token's cost comes to what a token
    /// costs in a plain batched step. So in a batch of `B` decoding sequences a draft goes on
    /// only while its estimated probability `p` has odds `p / (1 - p)` at least `B` times
    /// those of `min_probability` ([`min_probability_in_batch`](Self::min_probability_in_batch):
    /// 0.3 alone, 0.46 for 2, 0.68 for 5, 0.87 for 16), so only long, well-predicted matches
    /// draft in a large batch. Default model, 2 threads, `scripts/bench-speculation --rounds
    /// 3`: each kind's prompts at once (5 repetitive, 3 chats), against plain batched decoding
    /// in the same run: drafting only alone (`max_batch` 1) 0.98x and 0.93x, up to 8 at the
    /// single-stream threshold 1.20x and 0.98x, with the odds rule 1.27x and 1.10x.
    pub max_batch: usize,
}

impl Default for NgramLookup {
    fn default() -> Self {
        Self {
            max_draft: 8,
            max_ngram: 16,
            min_ngram: 1,
            min_probability: 0.3,
            max_batch: 16,
        }
    }
}

impl NgramLookup {
    /// Sets [`max_draft`](Self::max_draft) (at least 1).
    pub fn with_max_draft(mut self, n: usize) -> Self {
        self.max_draft = n.max(1);
        self
    }
    /// Sets [`min_ngram`](Self::min_ngram) and [`max_ngram`](Self::max_ngram) (`1 <= min <=
    /// max`).
    pub fn with_ngram(mut self, min: usize, max: usize) -> Self {
        self.min_ngram = min.max(1);
        self.max_ngram = max.max(self.min_ngram);
        self
    }
    /// Sets [`max_batch`](Self::max_batch).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }
    /// Sets [`min_probability`](Self::min_probability).
    pub fn with_min_probability(mut self, p: f32) -> Self {
        self.min_probability = p;
        self
    }

    /// The probability a draft must keep in a batch of `batch` decoding sequences: odds
    /// `batch` times those of [`min_probability`](Self::min_probability) (see
    /// [`max_batch`](Self::max_batch)); `min_probability` itself for one.
    ///
    /// ```
    /// use gpu_pipeline::engine::NgramLookup;
    /// let l = NgramLookup::default().with_min_probability(0.5);
    /// assert_eq!(l.min_probability_in_batch(1), 0.5);
    /// assert!((l.min_probability_in_batch(3) - 0.75).abs() < 1e-6); // odds 1 -> 3
    /// ```
    pub fn min_probability_in_batch(&self, batch: usize) -> f32 {
        odds_bar(self.min_probability, batch)
    }
}

/// `p` with its odds `p / (1 - p)` multiplied by `batch` (`p` itself for a batch of at most
/// one, or `p` outside `(0, 1)`): the bar a draft clears in a batch of `batch` decoding
/// sequences (see [`NgramLookup::max_batch`]).
pub(crate) fn odds_bar(p: f32, batch: usize) -> f32 {
    let b = batch.max(1) as f32;
    if b == 1.0 || p <= 0.0 || p >= 1.0 {
        return p;
    }
    b * p / (1.0 + p * (b - 1.0))
}

/// The longest match of the end of `text` with its earlier text: `(n, from)` where the last
/// `n` tokens (`1 <= n <= max_n`) also end at `from - 1`, `from < text.len()` (an occurrence
/// followed by at least one token), for the largest such `n`, and among those the most recent
/// occurrence. `None` when the last token occurs nowhere earlier. One pass over the text, no
/// allocation.
///
/// ```
/// use gpu_pipeline::engine::longest_match;
/// let text = [7, 1, 2, 3, 9, 1, 2, 5, 2, 3];
/// // "2 3" also ends at index 3 (followed by 9); "1 2 3" nowhere else.
/// assert_eq!(longest_match(&text, 8), Some((2, 4)));
/// assert_eq!(longest_match(&text, 1), Some((1, 4)));
/// assert_eq!(longest_match(&[1, 2, 4], 8), None);
/// ```
pub fn longest_match(text: &[u32], max_n: usize) -> Option<(usize, usize)> {
    let (&last, earlier) = text.split_last()?;
    let mut best: Option<(usize, usize)> = None;
    for (i, _) in earlier
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, t)| **t == last)
    {
        let n = text[..=i]
            .iter()
            .rev()
            .zip(text.iter().rev())
            .take(max_n)
            .take_while(|(a, b)| a == b)
            .count();
        if n > 0 && best.is_none_or(|(m, _)| n > m) {
            best = Some((n, i + 1));
            if n >= max_n {
                break;
            }
        }
    }
    best
}

/// Fills `out` with up to `max_len` tokens that followed the most recent earlier occurrence of
/// the last `n` tokens of `text`, for the largest `n` in `min_n..=max_n` that occurs earlier
/// (an occurrence followed by nothing does not count; [`longest_match`]). Empty when nothing
/// matches. No allocation when `out` has room.
///
/// ```
/// use gpu_pipeline::engine::propose;
/// let text = [1, 2, 3, 4, 5, 9, 2, 3];
/// let mut out = Vec::new();
/// propose(&text, 1, 3, 4, &mut out);
/// assert_eq!(out, [4, 5, 9, 2]); // "2 3" was followed by "4 5 9 2"
/// propose(&text, 3, 3, 4, &mut out);
/// assert!(out.is_empty()); // "9 2 3" never occurred before
/// ```
pub fn propose(text: &[u32], min_n: usize, max_n: usize, max_len: usize, out: &mut Vec<u32>) {
    out.clear();
    if let Some((n, from)) = longest_match(text, max_n)
        && n >= min_n.max(1)
    {
        out.extend_from_slice(&text[from..(from + max_len).min(text.len())]);
    }
}

/// Match lengths with their own acceptance estimate in lookup (longer matches share the last).
const MATCH_BUCKETS: usize = 8;
/// Lookup's prior acceptance of a draft token by the length of the match it continues
/// (1..=8+): the rates measured on the default model's greedy outputs for the prompts of
/// `scripts/bench-speculation` (repetitive: 0.17, 0.55, 0.60, 0.81, 0.86, 0.92, 0.82, 0.97;
/// chat: 0.10, 0.41, 0.47, 0.67, then 0.7-1.0 on few tokens), rounded.
const MATCH_PRIOR: [f32; MATCH_BUCKETS] = [0.15, 0.5, 0.6, 0.8, 0.85, 0.9, 0.9, 0.95];
/// Weight of the prior, in verified draft tokens.
const PRIOR_WEIGHT: f32 = 8.0;
/// Verified tokens per bucket after which its counts are halved (so the estimate follows the
/// text as it changes).
const MAX_COUNT: f32 = 256.0;

/// A sequence's estimate of how likely a lookup draft token is to be accepted, per length of
/// the match it continues: the prior ([`MATCH_PRIOR`]) updated by the sequence's own
/// verifications.
#[derive(Clone, Debug)]
struct MatchStats {
    accepted: [f32; MATCH_BUCKETS],
    verified: [f32; MATCH_BUCKETS],
}

impl MatchStats {
    fn new() -> Self {
        Self {
            accepted: [0.0; MATCH_BUCKETS],
            verified: [0.0; MATCH_BUCKETS],
        }
    }

    /// The estimated acceptance of a token continuing a match of `n` tokens.
    fn p(&self, n: usize) -> f32 {
        let b = n.clamp(1, MATCH_BUCKETS) - 1;
        (self.accepted[b] + PRIOR_WEIGHT * MATCH_PRIOR[b]) / (self.verified[b] + PRIOR_WEIGHT)
    }

    /// A draft of `drafted` tokens continuing a match of `n` had its first `accepted`
    /// accepted: draft token `j` continued a match of `n + j`, and was verified if every token
    /// before it was accepted.
    fn record(&mut self, n: usize, drafted: usize, accepted: usize) {
        for j in 0..drafted.min(accepted + 1) {
            let b = (n + j).clamp(1, MATCH_BUCKETS) - 1;
            self.verified[b] += 1.0;
            if j < accepted {
                self.accepted[b] += 1.0;
            }
            if self.verified[b] > MAX_COUNT {
                self.verified[b] /= 2.0;
                self.accepted[b] /= 2.0;
            }
        }
    }
}

/// Lookup's state in a sequence: its settings, the acceptance estimate, and the match length
/// of the current proposal.
#[derive(Clone, Debug)]
struct Lookup {
    config: NgramLookup,
    stats: MatchStats,
    matched: usize,
}

/// The acceptance rule of speculative decoding (see [`Speculation`]): samples row 0,
/// 1, ... through `sample_row` (which samples row `i` as a plain decode would sample that
/// position, given that drafts `0..i` were accepted, and emits the token), until a row's token
/// differs from its draft or the row after the last draft was sampled. Returns the number of
/// drafts accepted: `sample_row` ran for `accepted + 1` rows. An error from `sample_row` ends
/// the verification.
///
/// ```
/// use gpu_pipeline::engine::verify;
/// // The target would emit 7, 8, 5, 6: drafts [7, 8, 9] keep 7 and 8, then 5 corrects 9.
/// let target = [7, 8, 5, 6];
/// let mut emitted = Vec::new();
/// let accepted = verify::<()>(&[7, 8, 9], |i| {
///     emitted.push(target[i]);
///     Ok(target[i])
/// });
/// assert_eq!((accepted, emitted), (Ok(2), vec![7, 8, 5]));
/// ```
pub fn verify<E>(
    drafts: &[u32],
    mut sample_row: impl FnMut(usize) -> Result<u32, E>,
) -> Result<usize, E> {
    for (i, &draft) in drafts.iter().enumerate() {
        if sample_row(i)? != draft {
            return Ok(i);
        }
    }
    sample_row(drafts.len())?;
    Ok(drafts.len())
}

/// Longest back-off, in steps, of a sequence whose drafts are rarely accepted.
const MAX_BACKOFF: u32 = 256;
/// Back-off after the first time acceptance falls too low.
const FIRST_BACKOFF: u32 = 16;
/// Verifications before the acceptance average may turn lookup off.
const MIN_VERIFICATIONS: u32 = 3;
/// Weight of the newest verification in the acceptance average.
const RATE_WEIGHT: f32 = 0.3;

/// How a sequence's drafts are sized and when drafting stops for a while (see the
/// [module docs](self)).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    max_draft: usize,
    min_acceptance: f32,
    max_batch: usize,
    /// The first draft length.
    start: usize,
}

impl Policy {
    /// Lookup sizes each draft by its own estimate ([`MatchStats`]): no adaptive length and
    /// no back-off.
    fn ngram(c: &NgramLookup) -> Self {
        Self {
            max_draft: c.max_draft.max(1),
            min_acceptance: 0.0,
            max_batch: c.max_batch,
            start: c.max_draft.max(1),
        }
    }

    fn draft_model(c: &DraftModel) -> Self {
        Self {
            max_draft: c.max_draft.max(1),
            min_acceptance: c.min_acceptance,
            max_batch: c.max_batch,
            start: c.max_draft.max(1),
        }
    }
}

/// One sequence's speculation state: the adaptive draft length, the acceptance average and the
/// back-off (see the [module docs](self)), and the buffer of the current proposal.
#[derive(Clone, Debug)]
pub(crate) struct SpecState {
    policy: Policy,
    /// Lookup's state (with a draft model: its lookup-first, if on).
    lookup: Option<Lookup>,
    /// Whether a draft model proposes.
    draft_model: bool,
    /// Whether the current proposal came from lookup.
    from_lookup: bool,
    draft_len: usize,
    rate: f32,
    verifications: u32,
    /// Steps left with drafting off.
    off_for: u32,
    /// The next back-off.
    backoff: u32,
    /// The drafts proposed for the next step.
    pub(crate) proposal: Vec<u32>,
}

impl SpecState {
    /// The state of a sequence under `s` (`None`: no speculation).
    pub(crate) fn new(s: &Speculation) -> Option<Self> {
        let lookup = |c: &NgramLookup| Lookup {
            config: *c,
            stats: MatchStats::new(),
            matched: 0,
        };
        let (policy, lookup, draft_model) = match s {
            Speculation::Off => return None,
            Speculation::NgramLookup(c) => (Policy::ngram(c), Some(lookup(c)), false),
            Speculation::DraftModel(c) => (
                Policy::draft_model(c),
                c.lookup_first.as_ref().map(lookup),
                true,
            ),
        };
        Some(Self::from_parts(policy, lookup, draft_model))
    }

    fn from_parts(policy: Policy, lookup: Option<Lookup>, draft_model: bool) -> Self {
        Self {
            draft_model,
            from_lookup: false,
            draft_len: policy.start,
            rate: 0.5,
            verifications: 0,
            off_for: 0,
            backoff: FIRST_BACKOFF,
            proposal: Vec::with_capacity(policy.max_draft),
            policy,
            lookup,
        }
    }

    /// The most draft tokens for the next step, at most `left` (0 while drafting is off: that
    /// counts one step of the back-off). Clears the proposal.
    pub(crate) fn budget(&mut self, left: usize) -> usize {
        self.proposal.clear();
        if self.off_for > 0 || left == 0 {
            self.off_for = self.off_for.saturating_sub(1);
            return 0;
        }
        self.draft_len.min(self.policy.max_draft).min(left)
    }

    /// Proposes the drafts of the next step into [`proposal`](Self::proposal), at most
    /// `left`, in a batch of `batch` decoding sequences: by lookup in `text`, the tokens after
    /// the longest match while the estimated probability that they are all accepted stays at
    /// least [`NgramLookup::min_probability_in_batch`] (empty when nothing matches). A draft
    /// model's proposals are filled by the engine (after [`budget`](Self::budget)).
    pub(crate) fn propose(&mut self, text: &[u32], left: usize, batch: usize) {
        let n = self.budget(left);
        self.lookup_into_proposal(text, n, batch);
    }

    /// The draft model's budget for the next step (see [`budget`](Self::budget)), or 0 when
    /// lookup first ([`DraftModel::lookup_first`]) confidently proposed at least
    /// [`LOOKUP_FIRST_MIN`] tokens (up to the draft model's `max_draft` and `left`) into
    /// [`proposal`](Self::proposal): those are the draft then.
    pub(crate) fn propose_before_draft(
        &mut self,
        text: &[u32],
        left: usize,
        batch: usize,
    ) -> usize {
        self.proposal.clear();
        if self.lookup.is_some() && left > 0 {
            self.lookup_into_proposal(text, self.policy.max_draft.min(left), batch);
            if self.proposal.len() >= LOOKUP_FIRST_MIN.min(left) {
                self.from_lookup = true;
                return 0;
            }
        }
        self.from_lookup = false;
        self.budget(left)
    }

    /// Lookup's draft of at most `n` tokens into the proposal (cleared first), in a batch of
    /// `batch` decoding sequences.
    fn lookup_into_proposal(&mut self, text: &[u32], n: usize, batch: usize) {
        self.proposal.clear();
        let Some(l) = &mut self.lookup else {
            return;
        };
        l.matched = 0;
        let Some((m, from)) = longest_match(text, l.config.max_ngram) else {
            return;
        };
        if n == 0 || m < l.config.min_ngram {
            return;
        }
        let min_p = l.config.min_probability_in_batch(batch);
        let mut p = 1.0;
        for (j, &t) in text[from..].iter().take(n).enumerate() {
            p *= l.stats.p(m + j);
            if p < min_p {
                break;
            }
            self.proposal.push(t);
        }
        l.matched = m;
    }

    /// Whether lookup proposed the current drafts (rather than a draft model).
    pub(crate) fn proposed_by_lookup(&self) -> bool {
        !self.draft_model || self.from_lookup
    }

    /// Whether a draft model proposes (lookup first or not).
    pub(crate) fn uses_draft_model(&self) -> bool {
        self.draft_model
    }

    /// Most decoding sequences in a batch for which anyone drafts.
    pub(crate) fn max_batch(&self) -> usize {
        self.policy.max_batch
    }

    /// Records a verification of `drafted` tokens of which `accepted` were accepted.
    pub(crate) fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if !self.draft_model || self.from_lookup {
            if let Some(l) = &mut self.lookup {
                l.stats.record(l.matched, drafted, accepted);
            }
            return;
        }
        let c = self.policy;
        self.draft_len = if accepted == drafted {
            (self.draft_len + 2).min(c.max_draft)
        } else {
            self.draft_len.saturating_sub(1).max(1)
        };
        let r = accepted as f32 / drafted as f32;
        self.rate += RATE_WEIGHT * (r - self.rate);
        self.verifications += 1;
        if self.verifications >= MIN_VERIFICATIONS && self.rate < c.min_acceptance {
            self.off_for = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            // After the back-off one probe of one token: rejected, it backs off again (twice
            // as long); accepted, drafting goes on.
            self.draft_len = 1;
            self.rate = c.min_acceptance;
            self.verifications = MIN_VERIFICATIONS;
        } else if r >= 0.5 {
            self.backoff = FIRST_BACKOFF;
        }
    }

    /// Whether drafting is off now (a back-off).
    #[cfg(test)]
    pub(crate) fn is_off(&self) -> bool {
        self.off_for > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{Sampler, SamplerConfig};

    #[test]
    fn lookup_prefers_the_longest_ngram_then_the_most_recent_occurrence() {
        let mut out = Vec::new();
        // "5 1 2" occurs once (followed by 8); "1 2" most recently followed by 7.
        let text = [5, 1, 2, 8, 0, 1, 2, 7, 3, 5, 1, 2];
        propose(&text, 1, 3, 3, &mut out);
        assert_eq!(out, [8, 0, 1]);
        propose(&text, 1, 2, 3, &mut out);
        assert_eq!(out, [7, 3, 5]);
        // The draft stops at the end of the text; too short a text proposes nothing.
        propose(&[4, 4, 4], 1, 3, 5, &mut out);
        assert_eq!(out, [4]);
        propose(&[4], 1, 3, 5, &mut out);
        assert!(out.is_empty());
        propose(&text, 1, 3, 0, &mut out);
        assert!(out.is_empty());
    }

    /// A toy target model: the logits of the next token are a function of the whole prefix.
    fn toy_logits(prefix: &[u32], vocab: usize) -> Vec<f32> {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &t in prefix {
            h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
        }
        (0..vocab)
            .map(|i| {
                let x = (h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
                    .wrapping_mul(0x2545_f491_4f6c_dd1d);
                // A few likely tokens, echoing earlier text (so lookups hit).
                let echo = prefix.len() >= 4 && i as u32 == prefix[prefix.len() - 4];
                (x >> 40) as f32 / (1u64 << 24) as f32 * 3.0 + if echo { 4.0 } else { 0.0 }
            })
            .collect()
    }

    /// Plain decoding of the toy model, and speculative decoding with lookup drafts of up to
    /// `max_draft`, from the same seed: the same tokens, for greedy, temperature and
    /// penalized sampling.
    #[test]
    fn speculative_output_is_the_plain_output_token_for_token() {
        let vocab = 12;
        for params in [
            SamplerConfig::default(),
            SamplerConfig::default().with_temperature(0.8).with_seed(3),
            SamplerConfig::default()
                .with_temperature(1.0)
                .with_top_k(5)
                .with_repetition_penalty(1.3, 8)
                .with_frequency_penalty(0.2)
                .with_seed(11),
        ] {
            let prompt = [1u32, 2, 3, 4, 1, 2, 3, 4, 1, 2];
            let n = 60;
            let mut plain = prompt.to_vec();
            let mut s = Sampler::new(params.clone());
            while plain.len() < prompt.len() + n {
                let t = s.sample_after(&toy_logits(&plain, vocab), &plain, prompt.len());
                plain.push(t);
            }
            let mut spec = prompt.to_vec();
            let mut s = Sampler::new(params.clone());
            let mut state = SpecState::new(&Speculation::NgramLookup(
                NgramLookup::default().with_max_draft(5),
            ))
            .expect("on");
            let (mut steps, mut accepted_total) = (0, 0);
            while spec.len() < prompt.len() + n {
                let left = prompt.len() + n - spec.len() - 1;
                state.propose(&spec, left, 1);
                let drafts = state.proposal.clone();
                let base = spec.len();
                let mut with_drafts = spec.clone();
                with_drafts.extend_from_slice(&drafts);
                let mut emitted = Vec::new();
                let accepted = verify::<()>(&drafts, |i| {
                    let prefix = &with_drafts[..base + i];
                    let t = s.sample_after(&toy_logits(prefix, vocab), prefix, prompt.len());
                    emitted.push(t);
                    Ok(t)
                })
                .unwrap();
                assert_eq!(emitted.len(), accepted + 1);
                assert_eq!(emitted[..accepted], drafts[..accepted]);
                state.record(drafts.len(), accepted);
                spec.extend_from_slice(&emitted);
                steps += 1;
                accepted_total += accepted;
            }
            assert_eq!(spec, plain, "{params:?}");
            assert!(steps < n, "some drafts were accepted ({params:?})");
            assert!(accepted_total > 0);
        }
    }

    /// The rule's output distribution, measured: the first emitted token follows row 0's
    /// softmax; given that draft 0 was accepted, the second follows row 1's; the acceptance
    /// rate of draft 0 is its probability. A rule that accepted drafts more often (or sampled
    /// the correction from the full row 0 after a rejection) fails the checks.
    #[test]
    fn sampled_acceptance_keeps_the_target_distribution() {
        let rows: [[f32; 4]; 3] = [
            [0.0, 1.0, 1.5, 0.5],
            [1.2, 0.0, 0.3, 1.0],
            [0.0, 0.0, 2.0, 1.0],
        ];
        let drafts = [2u32, 0];
        let softmax = |r: &[f32; 4]| -> Vec<f64> {
            let z: f64 = r.iter().map(|&l| f64::from(l).exp()).sum();
            r.iter().map(|&l| f64::from(l).exp() / z).collect()
        };
        let mut s = Sampler::new(SamplerConfig::default().with_temperature(1.0).with_seed(5));
        let n = 60_000;
        let mut first = [0usize; 4];
        let mut second = [0usize; 4];
        let mut third = [0usize; 4];
        let mut lengths = [0usize; 3];
        for _ in 0..n {
            let mut emitted = Vec::new();
            let accepted = verify::<()>(&drafts, |i| {
                let t = s.sample(&rows[i], &[]);
                emitted.push(t);
                Ok(t)
            })
            .unwrap();
            lengths[accepted] += 1;
            first[emitted[0] as usize] += 1;
            if let Some(&t) = emitted.get(1) {
                second[t as usize] += 1;
            }
            if let Some(&t) = emitted.get(2) {
                third[t as usize] += 1;
            }
        }
        let check = |seen: &[usize; 4], want: &[f64], what: &str| {
            let total: usize = seen.iter().sum();
            for (i, &w) in want.iter().enumerate() {
                let got = seen[i] as f64 / total as f64;
                assert!(
                    (got - w).abs() < 0.015,
                    "{what} token {i}: want {w:.4} got {got:.4}"
                );
            }
        };
        let (p0, p1) = (softmax(&rows[0]), softmax(&rows[1]));
        check(&first, &p0, "first");
        check(&second, &p1, "second given draft 0 accepted");
        check(&third, &softmax(&rows[2]), "bonus given both accepted");
        let rate0 = 1.0 - lengths[0] as f64 / n as f64;
        assert!(
            (rate0 - p0[2]).abs() < 0.015,
            "acceptance of draft 0: {rate0} vs p = {}",
            p0[2]
        );
        let both = lengths[2] as f64 / n as f64;
        assert!((both - p0[2] * p1[0]).abs() < 0.015, "both drafts: {both}");
    }

    #[test]
    fn draft_model_length_adapts_and_low_acceptance_backs_off() {
        let mut st = SpecState::from_parts(
            Policy {
                max_draft: 6,
                min_acceptance: 0.3,
                max_batch: 1,
                start: 2,
            },
            None,
            true,
        );
        assert!(st.uses_draft_model());
        assert_eq!(st.budget(100), 2);
        st.record(2, 2);
        st.record(4, 4);
        assert_eq!(st.budget(100), 6, "grows by 2, within max_draft");
        assert_eq!(st.budget(2), 2, "never more than the tokens left");
        assert_eq!(st.budget(0), 0, "nothing when one token is left");
        st.record(6, 2);
        assert_eq!(st.budget(100), 5, "shrinks by 1");
        // Rejections: off after a few, then one probe of one token, then off twice as long.
        let mut off_steps = Vec::new();
        for round in 0..3 {
            let mut rejected = 0;
            while !st.is_off() {
                let n = st.budget(100);
                assert!(round == 0 || n == 1, "a probe of one token");
                st.record(n, 0);
                rejected += 1;
            }
            assert!(
                round == 0 || rejected == 1,
                "one rejected probe backs off again"
            );
            let mut k = 0;
            while st.is_off() {
                assert_eq!(st.budget(100), 0);
                k += 1;
            }
            off_steps.push(k);
        }
        assert_eq!(
            off_steps,
            [FIRST_BACKOFF, 2 * FIRST_BACKOFF, 4 * FIRST_BACKOFF]
        );
        // An accepted probe keeps drafting, and resets the back-off.
        assert_eq!(st.budget(100), 1);
        st.record(1, 1);
        st.record(3, 3);
        assert!(!st.is_off());
        while !st.is_off() {
            st.record(1, 0);
        }
        let mut k = 0;
        while st.is_off() {
            st.budget(100);
            k += 1;
        }
        assert_eq!(k, FIRST_BACKOFF);
    }

    /// A draft model's sequence with lookup first: a confident lookup of at least
    /// `LOOKUP_FIRST_MIN` tokens is the draft (no draft-model budget) and its verification
    /// updates lookup's estimate, not the draft model's length; otherwise the draft model's
    /// budget, with an empty proposal.
    #[test]
    fn lookup_first_stands_in_for_the_draft_model_when_confident() {
        let policy = Policy {
            max_draft: 6,
            min_acceptance: 0.3,
            max_batch: 1,
            start: 6,
        };
        let lookup = || Lookup {
            config: NgramLookup::default(),
            stats: MatchStats::new(),
            matched: 0,
        };
        let mut st = SpecState::from_parts(policy, Some(lookup()), true);
        let long = [1u32, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4];
        assert_eq!(st.propose_before_draft(&long, 100, 1), 0);
        assert_eq!(st.proposal, [5, 6, 7, 8, 9, 0]);
        assert!(st.proposed_by_lookup());
        st.record(6, 2);
        assert_eq!(st.draft_len, 6, "the draft model's length is untouched");
        assert!(st.lookup.as_ref().expect("lookup").stats.verified[3] > 0.0);
        // A 2-token match proposes 2 (< 4): the draft model drafts, up to its length.
        let two = [7u32, 8, 1, 2, 3, 4, 5, 9, 9, 1, 2];
        assert_eq!(st.propose_before_draft(&two, 100, 1), 6);
        assert!(st.proposal.is_empty() && !st.proposed_by_lookup());
        st.record(6, 1);
        assert_eq!(st.draft_len, 5);
        // Near the end: as many as are left is enough.
        assert_eq!(st.propose_before_draft(&long, 2, 1), 0);
        assert_eq!(st.proposal, [5, 6]);
        // Without lookup first, always the draft model.
        let mut st = SpecState::from_parts(policy, None, true);
        assert_eq!(st.propose_before_draft(&long, 100, 1), 6);
        assert!(st.proposal.is_empty() && !st.proposed_by_lookup());
    }

    /// `longest_match` against the definition (every `n`, every occurrence), on random texts
    /// over small alphabets (many matches of every length).
    #[test]
    fn longest_match_is_the_longest_then_most_recent() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for case in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 40) as usize;
            let alphabet = 1 + (x >> 8) % 4;
            let text: Vec<u32> = (0..len)
                .map(|i| ((x >> (i % 48)) ^ (i as u64 * 0x9e37)) as u32 % alphabet as u32)
                .collect();
            let max_n = 1 + (x >> 20) as usize % 10;
            let want = (1..=max_n.min(len.saturating_sub(1))).rev().find_map(|n| {
                let pat = &text[len - n..];
                (0..len - n)
                    .rev()
                    .find(|&i| &text[i..i + n] == pat)
                    .map(|i| (n, i + n))
            });
            assert_eq!(longest_match(&text, max_n), want, "case {case}: {text:?}");
        }
    }

    /// Lookup drafts run while the estimated acceptance holds: long after a long match, none
    /// after a match of one token (the prior's 0.15 is under 0.3), and shorter once the
    /// sequence's own verifications at those lengths fail.
    #[test]
    fn lookup_drafts_by_match_length_and_learns_from_rejections() {
        let cfg = NgramLookup::default().with_max_draft(6);
        let mut st = SpecState::new(&Speculation::NgramLookup(cfg)).expect("on");
        assert!(!st.uses_draft_model());
        // The last 4 tokens (1 2 3 4) occurred at the start, followed by 5 6 7 8 9 1 2 3 4.
        let text = [1u32, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4];
        st.propose(&text, 100, 1);
        assert_eq!(
            st.proposal,
            [5, 6, 7, 8, 9, 0],
            "a long match drafts max_draft"
        );
        st.propose(&text, 3, 1);
        assert_eq!(st.proposal, [5, 6, 7], "never more than the tokens left");
        st.propose(&text, 0, 1);
        assert!(st.proposal.is_empty());
        // "9" occurred once before, as a 1-token match: 0.15 < 0.3, no draft.
        st.propose(&[9, 5, 1, 9], 100, 1);
        assert!(st.proposal.is_empty());
        // A 2-token match: 0.5, then 0.5 * 0.6 = 0.3 (kept), then * 0.8 < 0.3.
        let two = [7u32, 8, 1, 2, 3, 4, 5, 9, 9, 1, 2];
        st.propose(&two, 100, 1);
        assert_eq!(st.proposal, [3, 4]);
        // Rejected at its first token again and again: the 2-token estimate falls under 0.3
        // after 6 (4 / 14; after 5 it is 4 / 13 and still drafts one token).
        for _ in 0..6 {
            st.propose(&two, 100, 1);
            let n = st.proposal.len();
            st.record(n, 0);
        }
        st.propose(&two, 100, 1);
        assert!(st.proposal.is_empty(), "{:?}", st.proposal);
        // The long match's estimate is its own: still drafting there.
        st.propose(&text, 100, 1);
        assert_eq!(st.proposal.len(), 6);
        // Accepted drafts raise the estimate again.
        for _ in 0..40 {
            st.propose(&text, 100, 1);
            let n = st.proposal.len();
            st.record(n, n);
        }
        let stats = &st.lookup.as_ref().expect("lookup").stats;
        assert!(stats.p(4) > MATCH_PRIOR[3] && stats.p(2) < 0.3);
    }

    /// In a batch a draft needs odds `B` times the single-stream threshold's: the 4-token
    /// match's running estimates (0.8, 0.68, 0.61, 0.55, 0.52, 0.50) draft 6 tokens alone and
    /// for 2 (0.46), 2 for 4 (0.63), none for 16 (0.87); past `max_batch` nothing.
    #[test]
    fn lookup_drafts_shrink_with_the_batch() {
        let cfg = NgramLookup::default().with_max_draft(6);
        assert_eq!(cfg.max_batch, 16);
        assert_eq!(cfg.min_probability_in_batch(0), 0.3);
        let mut last = 0.3;
        for b in 2..=32 {
            let p = cfg.min_probability_in_batch(b);
            assert!(p > last && p < 1.0, "batch {b}: {p}");
            last = p;
        }
        let mut st = SpecState::new(&Speculation::NgramLookup(cfg)).expect("on");
        let text = [1u32, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4];
        for (batch, want) in [(1, 6), (2, 6), (4, 2), (16, 0)] {
            st.propose(&text, 100, batch);
            assert_eq!(st.proposal.len(), want, "batch {batch}");
        }
    }
}
