//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded RNG; and
//! the stop rules of a generation (EOS, stop sequences, `max_tokens`).
//!
//! The order of the logit transforms is fixed and documented on [`Sampler::sample`]; with the
//! same [`SamplerConfig`] (seed included), the same logits and the same history a [`Sampler`]
//! picks the same tokens on every run and platform (the RNG is a PCG32 of our own, not the OS).

use zerolayer_api::TokenLogprob;

use crate::kernels::{exp_f, multiversion};

/// Parameters of a [`Sampler`]. `Default` is greedy decoding.
///
/// ```
/// use gpu_pipeline::SamplerConfig;
/// let p = SamplerConfig::default().with_temperature(0.7).with_top_p(0.9).with_seed(42);
/// assert_eq!(p.top_p, 0.9);
/// assert!(SamplerConfig::default().is_greedy());
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature. `0.0` (the default) means greedy: always the highest logit (the
    /// lowest token id among exact ties).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to
    /// at least `top_p`; `1.0` disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's; `0.0`
    /// disables.
    pub min_p: f32,
    /// Repetition penalty (CTRL / llama.cpp style): the logit `l` of every token seen in the
    /// last `repetition_window` tokens becomes `l / p` when positive and `l * p` otherwise.
    /// `1.0` disables.
    pub repetition_penalty: f32,
    /// How many of the most recent tokens (prompt included) the penalty looks at.
    pub repetition_window: usize,
    /// Frequency penalty (OpenAI style): `count * frequency_penalty` is subtracted from the
    /// logit of every token generated `count` times so far (generated tokens only, not the
    /// prompt, as vLLM counts them). `0.0` disables.
    pub frequency_penalty: f32,
    /// Presence penalty (OpenAI style): subtracted once from the logit of every token
    /// generated at least once so far. `0.0` disables.
    pub presence_penalty: f32,
    /// RNG seed; the same seed gives the same samples.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_window: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding (the default).
    pub fn greedy() -> Self {
        Self::default()
    }
    /// Sets [`temperature`](Self::temperature).
    pub fn with_temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }
    /// Sets [`top_k`](Self::top_k).
    pub fn with_top_k(mut self, k: usize) -> Self {
        self.top_k = k;
        self
    }
    /// Sets [`top_p`](Self::top_p).
    pub fn with_top_p(mut self, p: f32) -> Self {
        self.top_p = p;
        self
    }
    /// Sets [`min_p`](Self::min_p).
    pub fn with_min_p(mut self, p: f32) -> Self {
        self.min_p = p;
        self
    }
    /// Sets [`repetition_penalty`](Self::repetition_penalty) and its window.
    pub fn with_repetition_penalty(mut self, penalty: f32, window: usize) -> Self {
        self.repetition_penalty = penalty;
        self.repetition_window = window;
        self
    }
    /// Sets [`frequency_penalty`](Self::frequency_penalty).
    pub fn with_frequency_penalty(mut self, p: f32) -> Self {
        self.frequency_penalty = p;
        self
    }
    /// Sets [`presence_penalty`](Self::presence_penalty).
    pub fn with_presence_penalty(mut self, p: f32) -> Self {
        self.presence_penalty = p;
        self
    }
    /// Whether any logit penalty (repetition, frequency, presence) applies.
    pub fn penalizes(&self) -> bool {
        (self.repetition_penalty != 1.0 && self.repetition_penalty > 0.0)
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }
    /// Sets [`seed`](Self::seed).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Whether these parameters always pick the highest (penalized) logit.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }
}

/// A request's sampling parameters ([`zerolayer_api::SamplingParams`], checked by its
/// `validate`) as the sampler runs them: each field the request leaves out at its default
/// (greedy, no truncation, no penalty; a repetition penalty looks at the last 64 tokens), and
/// without a seed a fresh random one, so that two such sampled requests differ.
///
/// ```
/// use gpu_pipeline::SamplerConfig;
/// let mut asked = gpu_pipeline::zerolayer_api::SamplingParams::default();
/// asked.temperature = Some(0.7);
/// asked.top_k = Some(40);
/// asked.seed = Some(1);
/// let c = SamplerConfig::from(&asked);
/// assert_eq!((c.temperature, c.top_k, c.top_p, c.seed), (0.7, 40, 1.0, 1));
/// ```
impl From<&zerolayer_api::SamplingParams> for SamplerConfig {
    fn from(p: &zerolayer_api::SamplingParams) -> Self {
        let mut s = Self::default();
        if let Some(t) = p.temperature {
            s = s.with_temperature(t);
        }
        if let Some(v) = p.top_p {
            s = s.with_top_p(v);
        }
        if let Some(k) = p.top_k {
            s = s.with_top_k(k as usize);
        }
        if let Some(m) = p.min_p {
            s = s.with_min_p(m);
        }
        if let Some(r) = p.repetition_penalty {
            s = s.with_repetition_penalty(r, 64);
        }
        s.with_frequency_penalty(p.frequency_penalty.unwrap_or(0.0))
            .with_presence_penalty(p.presence_penalty.unwrap_or(0.0))
            .with_seed(p.seed.unwrap_or_else(random_seed))
    }
}

/// A seed from the process's random hasher keys (the OS's entropy) and a counter.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// PCG32 (XSH-RR, 64-bit state), seeded through SplitMix64. Small, fast, reproducible.
#[derive(Clone, Debug)]
pub(crate) struct Pcg32 {
    state: u64,
    inc: u64,
}

impl Pcg32 {
    const MUL: u64 = 6_364_136_223_846_793_005;

    pub(crate) fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut splitmix = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let init_state = splitmix();
        let init_seq = splitmix();
        let mut rng = Self {
            state: 0,
            inc: (init_seq << 1) | 1,
        };
        rng.next_u32();
        rng.state = rng.state.wrapping_add(init_state);
        rng.next_u32();
        rng
    }

    pub(crate) fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old.wrapping_mul(Self::MUL).wrapping_add(self.inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(crate) fn next_f64(&mut self) -> f64 {
        let hi = u64::from(self.next_u32()) << 21;
        let lo = u64::from(self.next_u32()) >> 11;
        ((hi | lo) as f64) * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks the next token from a row of logits. Holds its RNG and scratch space (reused: no
/// allocation per token once it has seen the vocabulary size).
///
/// ```
/// use gpu_pipeline::{Sampler, SamplerConfig};
/// let mut greedy = Sampler::new(SamplerConfig::default());
/// assert_eq!(greedy.sample(&[0.1, 2.0, -1.0], &[]), 1);
///
/// let params = SamplerConfig::default().with_temperature(1.0).with_seed(7);
/// let (mut a, mut b) = (Sampler::new(params.clone()), Sampler::new(params));
/// let logits = [1.0, 1.1, 0.9, 1.05];
/// let xs: Vec<u32> = (0..20).map(|_| a.sample(&logits, &[])).collect();
/// let ys: Vec<u32> = (0..20).map(|_| b.sample(&logits, &[])).collect();
/// assert_eq!(xs, ys); // same seed, same tokens
/// ```
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplerConfig,
    rng: Pcg32,
    /// The draw's buffers.
    scratch: PickScratch,
    /// Penalized copy of the logits when a penalty applies.
    penalized: Vec<f32>,
    /// Per-token occurrence counts of the generated tokens (zero between calls).
    counts: Vec<u32>,
}

impl Sampler {
    /// A sampler with these parameters; its RNG starts from `params.seed`.
    pub fn new(params: SamplerConfig) -> Self {
        let rng = Pcg32::new(params.seed);
        Self {
            params,
            rng,
            scratch: PickScratch::default(),
            penalized: Vec::new(),
            counts: Vec::new(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplerConfig {
        &self.params
    }

    /// Restarts the RNG from `seed`.
    pub fn reseed(&mut self, seed: u64) {
        self.params.seed = seed;
        self.rng = Pcg32::new(seed);
    }

    /// Picks a token from `logits` (one row, length = vocabulary size). `history` is the
    /// sequence so far (prompt and generated tokens); the penalties count all of it as
    /// generated (see [`sample_after`](Self::sample_after) to exclude a prompt).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.sample_after(logits, history, 0)
    }

    /// Picks a token from `logits` (one row, length = vocabulary size). `history` is the
    /// sequence so far: its first `prompt_len` tokens are the prompt, the rest were
    /// generated. The repetition penalty looks at the last `repetition_window` tokens of
    /// `history`; the frequency and presence penalties at the generated ones.
    ///
    /// Order (llama.cpp's penalties sampler): repetition penalty, then frequency and presence
    /// penalties; then greedy (if [`SamplerConfig::is_greedy`]) returns the argmax;
    /// otherwise temperature scaling, top-k, softmax, top-p, min-p, renormalise, draw one
    /// uniform number. Ties sort by token id, so the result does not depend on sort
    /// stability. NaN logits are never picked (treated as minus infinity). An empty `logits`
    /// returns 0.
    ///
    /// ```
    /// use gpu_pipeline::{Sampler, SamplerConfig};
    /// let mut s = Sampler::new(SamplerConfig::default().with_presence_penalty(1.5));
    /// // token 0 was generated once (history[1..]): 2.0 - 1.5 < 1.0
    /// assert_eq!(s.sample_after(&[2.0, 1.0], &[1, 0], 1), 1);
    /// // the same token in the prompt is not penalized
    /// assert_eq!(s.sample_after(&[2.0, 1.0], &[0, 1], 1), 0);
    /// ```
    pub fn sample_after(&mut self, logits: &[f32], history: &[u32], prompt_len: usize) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        if self.params.penalizes() {
            self.penalize(logits, history, prompt_len.min(history.len()));
            let Self {
                params,
                rng,
                scratch,
                penalized,
                ..
            } = self;
            pick(params, rng, scratch, penalized)
        } else {
            pick(&self.params, &mut self.rng, &mut self.scratch, logits)
        }
    }

    /// [`sample_after`](Self::sample_after) restricted to the tokens `mask` allows (a grammar's
    /// next-token set): the others are set to minus infinity after the penalties, before
    /// temperature, top-k, top-p and min-p. `None` when no allowed token has a finite logit
    /// (the row is shorter than the mask, or every allowed logit is NaN or minus infinity).
    ///
    /// ```
    /// use gpu_pipeline::{Sampler, SamplerConfig, TokenMask};
    /// let mut s = Sampler::new(SamplerConfig::default());
    /// let mut mask = TokenMask::forbid_all(3);
    /// mask.allow(2);
    /// assert_eq!(s.sample_masked(&[5.0, 4.0, -1.0], &[], 0, &mask), Some(2));
    /// assert_eq!(s.sample_masked(&[5.0, 4.0, f32::NEG_INFINITY], &[], 0, &mask), None);
    /// ```
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        history: &[u32],
        prompt_len: usize,
        mask: &TokenMask,
    ) -> Option<u32> {
        if self.params.penalizes() {
            self.penalize(logits, history, prompt_len.min(history.len()));
        } else {
            self.penalized.clear();
            self.penalized.extend_from_slice(logits);
        }
        let mut any = false;
        for (i, l) in self.penalized.iter_mut().enumerate() {
            if !mask.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            } else if !l.is_nan() && *l != f32::NEG_INFINITY {
                any = true;
            }
        }
        if !any {
            return None;
        }
        let Self {
            params,
            rng,
            scratch,
            penalized,
            ..
        } = self;
        Some(pick(params, rng, scratch, penalized))
    }
}

impl Sampler {
    /// Fills `self.penalized` with `logits` after the repetition, frequency and presence
    /// penalties. No allocation once the scratch has the vocabulary's size.
    fn penalize(&mut self, logits: &[f32], history: &[u32], prompt_len: usize) {
        let p = &self.params;
        self.penalized.clear();
        self.penalized.extend_from_slice(logits);
        let vocab = logits.len();
        if p.repetition_penalty != 1.0 && p.repetition_penalty > 0.0 {
            let start = history.len().saturating_sub(p.repetition_window);
            for &t in &history[start..] {
                let Some(l) = self.penalized.get(t as usize).copied() else {
                    continue;
                };
                // Each distinct token is penalized once: a changed value means done.
                if l != logits[t as usize] {
                    continue;
                }
                self.penalized[t as usize] = if l > 0.0 {
                    l / p.repetition_penalty
                } else {
                    l * p.repetition_penalty
                };
            }
        }
        if p.frequency_penalty == 0.0 && p.presence_penalty == 0.0 {
            return;
        }
        if self.counts.len() < vocab {
            self.counts.resize(vocab, 0);
        }
        let generated = &history[prompt_len..];
        for &t in generated.iter().filter(|&&t| (t as usize) < vocab) {
            self.counts[t as usize] += 1;
        }
        for &t in generated.iter().filter(|&&t| (t as usize) < vocab) {
            let n = std::mem::take(&mut self.counts[t as usize]);
            if n > 0 {
                self.penalized[t as usize] -= n as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
    }
}

/// The log-probability of a sampled `token` under the model's distribution (the log-softmax
/// of the raw `logits` row, before penalties and temperature) and the `top_n` most likely
/// tokens, most likely first (ties by token id); NaN logits count as minus infinity. The
/// tokens' bytes are left empty: the engine fills them from its tokenizer
/// ([`fill_token_bytes`]).
///
/// ```
/// let lp = gpu_pipeline::token_logprob(&[0.0, 0.0, f32::NEG_INFINITY], 1, 2);
/// assert!((lp.logprob + std::f32::consts::LN_2).abs() < 1e-6);
/// assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
/// ```
///
/// # Panics
/// When `token` is not below `logits.len()`.
pub fn token_logprob(logits: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    let lse = log_sum_exp_fast(logits);
    let lp = |l: f32| {
        if l.is_nan() {
            f32::NEG_INFINITY
        } else {
            (f64::from(l) - lse) as f32
        }
    };
    let mut top: Vec<(u32, Vec<u8>, f32)> = Vec::with_capacity(top_n);
    let n = top_n.min(logits.len());
    if n > 0 {
        // The n largest in one scan (NaN counts as minus infinity: those rank last, by id).
        let mut best = Vec::with_capacity(2 * n + 64);
        top_m(logits, n, &mut best);
        best.sort_unstable_by(by_desc);
        top.extend(best.into_iter().map(|(l, i)| (i, Vec::new(), lp(l))));
        let short = n - top.len();
        let rest = logits.iter().enumerate();
        let low = rest.filter(|&(_, &l)| l.is_nan() || l == f32::NEG_INFINITY);
        top.extend(
            low.take(short)
                .map(|(i, _)| (i as u32, Vec::new(), f32::NEG_INFINITY)),
        );
    }
    TokenLogprob {
        id: token,
        bytes: Vec::new(),
        logprob: lp(logits[token as usize]),
        top,
    }
}

/// Fills the bytes of a [`token_logprob`]'s tokens from `tokenizer` (empty for an id it does
/// not know).
pub fn fill_token_bytes(lp: &mut TokenLogprob, tokenizer: &token_stream::Tokenizer) {
    let bytes = |id: u32| {
        tokenizer
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    };
    lp.bytes = bytes(lp.id);
    for (id, b, _) in &mut lp.top {
        *b = bytes(*id);
    }
}

/// `ln(sum(exp(l)))` of a row, in f64 from its maximum (NaN entries skipped): the reference
/// precision of [`token_nll`] (perplexity).
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = max_valid(logits);
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| f64::from(l - max).exp())
        .sum::<f64>()
        .ln()
        + f64::from(max)
}

/// [`log_sum_exp`] with f32 terms (the sampler's vectorized `exp`, relative error ~1e-7) summed
/// in f64: per-token log-probabilities at a few µs instead of an f64 `exp` per vocabulary entry.
fn log_sum_exp_fast(logits: &[f32]) -> f64 {
    let max = max_valid(logits);
    if !max.is_finite() {
        return f64::from(max);
    }
    exp_sum(logits, max).ln() + f64::from(max)
}

multiversion! {
    /// `sum(exp(l - max))` over the non-NaN values of `l` (whose largest is the finite `max`),
    /// in f64 over f32 terms (exponentiated 256 at a time into a buffer, which vectorizes).
    fn exp_sum(l: &[f32], max: f32) -> f64 {
        let mut buf = [0.0f32; DRAW_BLOCK];
        let mut total = 0.0f64;
        for c in l.chunks(DRAW_BLOCK) {
            let b = &mut buf[..c.len()];
            for (o, &v) in b.iter_mut().zip(c) {
                *o = exp_f(v - max);
            }
            total += sum_f64(b);
        }
        total
    }
}

/// Weights per block sum of a full-row draw (see [`draw`]).
const DRAW_BLOCK: usize = 256;

/// Buffers of [`pick`], grown to the vocabulary once and then reused (no allocation per token).
#[derive(Clone, Debug, Default)]
struct PickScratch {
    /// (probability weight, token id) candidates of a top-k / top-p draw.
    cand: Vec<(f32, u32)>,
    /// One weight per token of the row.
    weights: Vec<f32>,
    /// The sums of every [`DRAW_BLOCK`] weights.
    blocks: Vec<f64>,
}

multiversion! {
    /// The largest value of `xs` that is not NaN (minus infinity when there is none).
    fn max_valid(xs: &[f32]) -> f32 {
        let mut m = [f32::NEG_INFINITY; 16];
        let mut it = xs.chunks_exact(16);
        for c in &mut it {
            for l in 0..16 {
                m[l] = m[l].max(c[l]);
            }
        }
        m.into_iter().chain(it.remainder().iter().copied()).fold(f32::NEG_INFINITY, f32::max)
    }
}

/// The f64 sum of `xs` as 8 partial sums (element `i` into sum `i % 8`), added as
/// `((s0+s4)+(s2+s6))+((s1+s5)+(s3+s7))`, then the tail: a fixed order that vectorizes.
#[inline(always)]
fn sum_f64(xs: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut it = xs.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            acc[k] += f64::from(c[k]);
        }
    }
    let tail: f64 = it.remainder().iter().map(|&v| f64::from(v)).sum();
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail
}

multiversion! {
    /// The unnormalised softmax weights `w[i] = e^((l[i] - max) * inv_t)` of a row whose largest
    /// non-NaN value is the finite `max` (0 for NaN and minus infinity, and for weights below
    /// `floor`: min-p, relative to the largest weight, which is 1), and the f64 sums of every
    /// [`DRAW_BLOCK`] of them into `blocks`.
    fn softmax_weights(l: &[f32], max: f32, inv_t: f32, floor: f32, w: &mut [f32], blocks: &mut [f64]) -> () {
        let parts = l.chunks(DRAW_BLOCK).zip(w.chunks_mut(DRAW_BLOCK));
        for ((lb, wb), sum) in parts.zip(blocks.iter_mut()) {
            for (wi, &li) in wb.iter_mut().zip(lb) {
                let e = exp_f((li - max) * inv_t);
                *wi = if e >= floor { e } else { 0.0 };
            }
            *sum = sum_f64(wb);
        }
    }
}

/// The token at uniform `u` (in [0, 1)) of the cumulative weights `w` (block sums `blocks`):
/// the block whose range holds `u * total`, then the token inside it. `None` when every weight
/// is 0. Rounding that leaves the running rest just short picks the last weighted token.
fn draw(w: &[f32], blocks: &[f64], u: f64) -> Option<usize> {
    let total: f64 = blocks.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let last_in = |b: usize| {
        let start = b * DRAW_BLOCK;
        let end = (start + DRAW_BLOCK).min(w.len());
        (start..end).rev().find(|&i| w[i] > 0.0)
    };
    let mut r = u * total;
    let mut last = None;
    for (b, &sum) in blocks.iter().enumerate() {
        if sum > 0.0 {
            last = Some(b);
        }
        if r < sum {
            let start = b * DRAW_BLOCK;
            let end = (start + DRAW_BLOCK).min(w.len());
            for (i, &wi) in w[start..end].iter().enumerate() {
                r -= f64::from(wi);
                if wi > 0.0 && r < 0.0 {
                    return Some(start + i);
                }
            }
            return last_in(b);
        }
        r -= sum;
    }
    last.and_then(last_in)
}

/// Orders candidates most likely first, ties by token id.
fn by_desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The `m` largest values of `xs` with their indices (ties: the lower index), unsorted, into
/// `cand`; NaN and minus infinity never count, so fewer than `m` when fewer are left. One scan
/// that keeps values above the current m-th largest: a buffer of `2m + 64` is cut back to `m`
/// with `select_nth` whenever it fills (a later value equal to the m-th ranks after it, by
/// index, so skipping it is exact).
fn top_m(xs: &[f32], m: usize, cand: &mut Vec<(f32, u32)>) {
    cand.clear();
    if m == 0 {
        return;
    }
    let cap = m.saturating_mul(2).saturating_add(64);
    let mut thr = f32::NEG_INFINITY;
    for (i, &x) in xs.iter().enumerate() {
        if x > thr {
            cand.push((x, i as u32));
            if cand.len() == cap {
                cand.select_nth_unstable_by(m - 1, by_desc);
                cand.truncate(m);
                thr = cand[m - 1].0;
            }
        }
    }
    if cand.len() > m {
        cand.select_nth_unstable_by(m - 1, by_desc);
        cand.truncate(m);
    }
}

/// Sorts `cand` most likely first and cuts it after the shortest prefix whose weights sum to
/// `need`; false (nothing cut) when all of them do not reach it.
fn cut_nucleus(cand: &mut Vec<(f32, u32)>, need: f64) -> bool {
    cand.sort_unstable_by(by_desc);
    let mut acc = 0.0f64;
    let end = cand.iter().position(|c| {
        acc += f64::from(c.0);
        acc >= need
    });
    if let Some(i) = end {
        cand.truncate(i + 1);
    }
    end.is_some()
}

/// Picks a token from a (penalized) row: greedy argmax, or temperature, top-k, softmax, top-p,
/// min-p and one uniform draw (see [`Sampler::sample_after`]).
///
/// Without top-k and top-p (temperature and min-p only) nothing is sorted: the weights of the
/// whole row are computed in one vectorized pass with their block sums, and the draw walks the
/// blocks, then one block. With top-k, `select_nth` keeps the k largest logits and only their
/// weights are computed; with top-p the candidates are sorted only as far as the nucleus
/// reaches (64 first, then 8x more each time).
/// A row with a `+inf` logit (or a temperature so small that `1 / t` overflows) picks its
/// argmax: that token has all the probability.
fn pick(p: &SamplerConfig, rng: &mut Pcg32, sc: &mut PickScratch, logits: &[f32]) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    let inv_t = 1.0 / p.temperature;
    let max = max_valid(logits);
    if !max.is_finite() || !inv_t.is_finite() {
        return argmax(logits);
    }
    let PickScratch {
        cand,
        weights,
        blocks,
    } = sc;
    if p.top_k > 0 {
        // The k largest logits (NaN and minus infinity are never candidates), then their weights.
        top_m(logits, p.top_k, cand);
        for c in cand.iter_mut() {
            c.0 = exp_f((c.0 - max) * inv_t);
        }
    } else {
        let nb = logits.len().div_ceil(DRAW_BLOCK);
        weights.resize(logits.len(), 0.0);
        blocks.resize(nb, 0.0);
        let (w, bs) = (&mut weights[..logits.len()], &mut blocks[..nb]);
        let floor = if p.top_p < 1.0 { 0.0 } else { p.min_p.max(0.0) };
        softmax_weights(logits, max, inv_t, floor, w, bs);
        if p.top_p >= 1.0 {
            let u = rng.next_f64();
            return draw(w, bs, u).map_or_else(|| argmax(logits), |i| i as u32);
        }
        // Top-p over the whole row: the 64, 512, 4096 most likely tokens, then all of them,
        // until a most-likely-first prefix holds `top_p` of the mass.
        let need = f64::from(p.top_p) * bs.iter().sum::<f64>();
        for m in [64, 512, 4096, usize::MAX] {
            top_m(w, m.min(w.len()), cand);
            // Done when the prefix is found, or when every weighted token is here (rounding
            // kept the sum short of `need`).
            if cut_nucleus(cand, need) || cand.len() < m {
                break;
            }
        }
    }
    if p.top_k > 0 && p.top_p < 1.0 {
        // Top-p within the top k.
        let need = f64::from(p.top_p) * cand.iter().map(|c| f64::from(c.0)).sum::<f64>();
        cut_nucleus(cand, need);
    }
    if p.min_p > 0.0 {
        // Relative to the largest weight (1: top-k and top-p keep the maximum).
        let floor = p.min_p;
        if cand.iter().all(|c| c.0 < floor) {
            return argmax(logits);
        }
        cand.retain(|c| c.0 >= floor);
    }
    let total: f64 = cand.iter().map(|c| f64::from(c.0)).sum();
    let mut r = rng.next_f64() * total;
    for c in cand.iter() {
        r -= f64::from(c.0);
        if c.0 > 0.0 && r < 0.0 {
            return c.1;
        }
    }
    // Rounding: the last weighted candidate.
    cand.iter()
        .rev()
        .find(|c| c.0 > 0.0)
        .map_or(cand[0].1, |c| c.1)
}

/// The tokens allowed at one step of a constrained generation: a bitset over the
/// vocabulary, in 32-bit words (the layout of llguidance's `SimpleVob`, so a grammar's mask
/// is one copy).
///
/// ```
/// use gpu_pipeline::TokenMask;
/// let mut m = TokenMask::forbid_all(40);
/// m.allow(33);
/// assert!(m.is_allowed(33) && !m.is_allowed(32) && !m.is_allowed(99));
/// assert_eq!(m.count_allowed(), 1);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    vocab: usize,
}

impl TokenMask {
    /// A mask over `vocab` tokens that allows none.
    pub fn forbid_all(vocab: usize) -> Self {
        Self {
            words: vec![0; vocab.div_ceil(32)],
            vocab,
        }
    }

    /// A mask over `vocab` tokens that allows all.
    pub fn allow_all(vocab: usize) -> Self {
        let mut m = Self::forbid_all(vocab);
        for id in 0..vocab as u32 {
            m.allow(id);
        }
        m
    }

    /// Allows `id` (ignored beyond the vocabulary).
    pub fn allow(&mut self, id: u32) {
        if (id as usize) < self.vocab {
            self.words[id as usize / 32] |= 1 << (id % 32);
        }
    }

    /// Forbids `id`.
    pub fn forbid(&mut self, id: u32) {
        if (id as usize) < self.vocab {
            self.words[id as usize / 32] &= !(1 << (id % 32));
        }
    }

    /// Whether `id` is allowed (never beyond the vocabulary).
    pub fn is_allowed(&self, id: u32) -> bool {
        (id as usize) < self.vocab && self.words[id as usize / 32] & (1 << (id % 32)) != 0
    }

    /// How many tokens are allowed.
    pub fn count_allowed(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The bit words, token `i` at bit `i % 32` of word `i / 32`; bits beyond the
    /// vocabulary must stay zero.
    pub fn words_mut(&mut self) -> &mut [u32] {
        &mut self.words
    }
}

/// Index of the largest value (the lowest index among exact ties; NaN never wins; 0 for an
/// empty or all-NaN row): the maximum in one vectorized pass, then its first position.
pub(crate) fn argmax(xs: &[f32]) -> u32 {
    let m = max_valid(xs);
    let i = first_equal(xs, m);
    if i < xs.len() { i as u32 } else { 0 }
}

/// The most likely token (as [`argmax`]) and its softmax probability (the vectorized `exp`
/// over the non-NaN logits); the probability is NaN when the row has no finite maximum. The
/// draft model's stop test, once per draft token.
pub(crate) fn top_token(logits: &[f32]) -> (u32, f32) {
    let max = max_valid(logits);
    if !max.is_finite() {
        return (argmax(logits), f32::NAN);
    }
    let i = first_equal(logits, max);
    ((i as u32), (1.0 / exp_sum(logits, max)) as f32)
}

multiversion! {
    /// The first index of `m` in `xs` (`xs.len()` when absent), 16 values per step.
    fn first_equal(xs: &[f32], m: f32) -> usize {
        let mut it = xs.chunks_exact(16);
        let mut base = 0;
        for c in &mut it {
            let mut hit = false;
            for &v in c {
                hit |= v == m;
            }
            if hit {
                return base + c.iter().position(|&v| v == m).unwrap_or(0);
            }
            base += 16;
        }
        let rest = it.remainder();
        base + rest.iter().position(|&v| v == m).unwrap_or(rest.len())
    }
}

/// Finds stop sequences in generated text, and says how much of a streamed text must be held
/// back because it could still become a stop sequence.
///
/// ```
/// use gpu_pipeline::StopMatcher;
/// let m = StopMatcher::new(["\n\nUser:", "###"]);
/// assert_eq!(m.find("Hello ##"), None);
/// assert_eq!(m.holdback("Hello ##"), 2); // "##" may start "###"
/// assert_eq!(m.find("Hello ### bye"), Some(("###", 6)));
/// ```
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
}

impl StopMatcher {
    /// A matcher for these stop sequences (empty strings are ignored).
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Self {
        Self {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .collect(),
        }
    }

    /// Whether there are no stop sequences.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The earliest occurrence of any stop sequence in `text`: the sequence and its byte
    /// offset (the generated text is `text[..offset]`). Among sequences starting at the same
    /// offset, the first given wins.
    pub fn find(&self, text: &str) -> Option<(&str, usize)> {
        let mut best: Option<(&str, usize)> = None;
        for s in &self.stops {
            if let Some(i) = text.find(s.as_str())
                && best.is_none_or(|(_, b)| i < b)
            {
                best = Some((s.as_str(), i));
            }
        }
        best
    }

    /// Length in bytes of the longest suffix of `text` that is a proper prefix of some stop
    /// sequence (text a streaming client should not see yet). Always on a char boundary.
    pub fn holdback(&self, text: &str) -> usize {
        let mut best = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(text.len());
            for n in (best + 1..=max).rev() {
                let start = text.len() - n;
                if text.is_char_boundary(start) && s.starts_with(&text[start..]) {
                    best = n;
                    break;
                }
            }
        }
        best
    }
}

/// `-ln p(token)` for one row of logits: the row's log-sum-exp (in f64, from its maximum)
/// minus the token's logit. What perplexity adds up.
///
/// ```
/// let nll = gpu_pipeline::token_nll(&[0.0, 0.0], 1);
/// assert!((nll - std::f64::consts::LN_2).abs() < 1e-12);
/// ```
///
/// # Panics
/// When `token` is not below `logits.len()`.
pub fn token_nll(logits: &[f32], token: u32) -> f64 {
    log_sum_exp(logits) - f64::from(logits[token as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_token_is_the_first_maximum_with_its_softmax_probability() {
        let (t, p) = top_token(&[0.0, 2.0, 2.0, -1.0]);
        assert_eq!(t, 1);
        let e = [(-2.0f32).exp(), 1.0, 1.0, (-3.0f32).exp()];
        assert!((p - 1.0 / e.iter().sum::<f32>()).abs() < 1e-6);
        let (t, p) = top_token(&[f32::NAN, f32::NAN]);
        assert_eq!(t, 0);
        assert!(p.is_nan());
        // NaN logits are skipped, as the sampler skips them.
        let (t, p) = top_token(&[f32::NAN, 1.0, 1.0]);
        assert_eq!(t, 1);
        assert!((p - 0.5).abs() < 1e-6);
    }

    #[test]
    fn greedy_picks_max_and_lowest_tie() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, -2.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, -5.0, -6.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_moves_argmax() {
        let p = SamplerConfig::greedy().with_repetition_penalty(2.0, 8);
        let mut s = Sampler::new(p);
        // token 0 (logit 3) seen twice -> 1.5 (penalized once), token 1 (2.0) wins.
        assert_eq!(s.sample(&[3.0, 2.0, -1.0], &[0, 0]), 1);
        // negative logits get multiplied
        assert_eq!(s.sample(&[-1.0, -1.5, -9.0], &[0]), 1);
        // outside the window: no penalty
        let mut s = Sampler::new(SamplerConfig::greedy().with_repetition_penalty(2.0, 1));
        assert_eq!(s.sample(&[3.0, 2.0], &[0, 1]), 0);
    }

    #[test]
    fn frequency_and_presence_penalties_count_generated_tokens_only() {
        // token 0 generated twice, token 1 once, token 2 only in the prompt
        let history = [2, 2, 0, 1, 0];
        let mut s = Sampler::new(
            SamplerConfig::greedy()
                .with_frequency_penalty(1.0)
                .with_presence_penalty(0.5),
        );
        s.penalize(&[4.0, 3.0, 2.9, 0.0], &history, 2);
        assert_eq!(s.penalized, [4.0 - 2.0 - 0.5, 3.0 - 1.0 - 0.5, 2.9, 0.0]);
        assert_eq!(s.sample_after(&[4.0, 3.0, 2.9, 0.0], &history, 2), 2);
        // the scratch counts are zero again: a second call gives the same row
        s.penalize(&[4.0, 3.0, 2.9, 0.0], &history, 2);
        assert_eq!(s.penalized, [1.5, 1.5, 2.9, 0.0]);
        // negative penalties favour repeats
        let mut s = Sampler::new(SamplerConfig::greedy().with_presence_penalty(-2.0));
        assert_eq!(s.sample_after(&[1.0, 2.0], &[0], 0), 0);
        // out-of-vocabulary ids in the history are skipped, not a panic
        assert_eq!(s.sample_after(&[1.0, 2.0], &[0, 99], 0), 0);
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_raw_row() {
        let logits = [1.0f32, 3.0, 2.0, f32::NAN];
        let lp = token_logprob(&logits, 2, 3);
        let z: f64 = [1.0f64, 3.0, 2.0].iter().map(|l| l.exp()).sum();
        assert!((f64::from(lp.logprob) - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 0]);
        assert!((f64::from(lp.top[0].2) - (3.0 - z.ln())).abs() < 1e-6);
        assert_eq!(token_logprob(&logits, 3, 0).logprob, f32::NEG_INFINITY);
        assert_eq!(token_logprob(&logits, 0, 10).top.len(), 4);
        assert!((token_nll(&logits[..3], 2) + f64::from(lp.logprob)).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_and_min_p_restrict() {
        let logits = [0.0, 5.0, 4.9, -3.0];
        let mut s = Sampler::new(
            SamplerConfig::default()
                .with_temperature(1.0)
                .with_top_k(2)
                .with_seed(3),
        );
        for _ in 0..200 {
            let t = s.sample(&logits, &[]);
            assert!(t == 1 || t == 2, "{t}");
        }
        // min_p 0.99: only tokens within 1% of the top probability survive -> only token 1
        let mut s = Sampler::new(
            SamplerConfig::default()
                .with_temperature(1.0)
                .with_min_p(0.99)
                .with_seed(3),
        );
        for _ in 0..100 {
            assert_eq!(s.sample(&logits, &[]), 1);
        }
    }

    #[test]
    fn top_p_keeps_nucleus() {
        // probabilities ~ [0.665, 0.245, 0.090]
        let logits = [2.0, 1.0, 0.0];
        let mut s = Sampler::new(
            SamplerConfig::default()
                .with_temperature(1.0)
                .with_top_p(0.6)
                .with_seed(1),
        );
        for _ in 0..100 {
            assert_eq!(s.sample(&logits, &[]), 0);
        }
        let mut s = Sampler::new(
            SamplerConfig::default()
                .with_temperature(1.0)
                .with_top_p(0.8)
                .with_seed(1),
        );
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            seen[s.sample(&logits, &[]) as usize] += 1;
        }
        assert_eq!(seen[2], 0);
        // 0.665/0.91 = 0.73 of draws for token 0
        assert!((1300..1620).contains(&seen[0]), "{seen:?}");
    }

    #[test]
    fn temperature_sampling_matches_softmax_frequencies() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut s = Sampler::new(SamplerConfig::default().with_temperature(1.0).with_seed(99));
        let n = 20_000;
        let mut seen = [0usize; 3];
        for _ in 0..n {
            seen[s.sample(&logits, &[]) as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for i in 0..3 {
            let want = f64::from(logits[i]).exp() / z;
            let got = seen[i] as f64 / n as f64;
            assert!(
                (want - got).abs() < 0.015,
                "token {i}: want {want} got {got}"
            );
        }
    }

    /// A row of `n` logits with NaN and minus infinity sprinkled in (never drawn).
    fn big_row(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 97 {
                13 => f32::NAN,
                41 => f32::NEG_INFINITY,
                _ => ((i * 7919) % 1000) as f32 * 0.01 - 5.0 + if i == 1234 { 4.0 } else { 0.0 },
            })
            .collect()
    }

    /// Draw frequencies over a 5000-token row (20 draw blocks) against the softmax, for
    /// temperature alone (the unsorted full-row draw), with top-k, with top-p (a nucleus of
    /// hundreds of tokens, beyond the first sorted 64) and with min-p.
    #[test]
    fn large_rows_sample_the_softmax() {
        let logits = big_row(5000);
        let t = 0.7f64;
        let valid = |i: usize| !logits[i].is_nan() && logits[i] != f32::NEG_INFINITY;
        let probs = |keep: &dyn Fn(usize) -> bool| -> Vec<f64> {
            let w: Vec<f64> = (0..logits.len())
                .map(|i| {
                    if valid(i) && keep(i) {
                        (f64::from(logits[i]) / t).exp()
                    } else {
                        0.0
                    }
                })
                .collect();
            let z: f64 = w.iter().sum();
            w.into_iter().map(|x| x / z).collect()
        };
        let mut order: Vec<usize> = (0..logits.len()).filter(|&i| valid(i)).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let all = probs(&|_| true);
        // The nucleus of 0.5 in most-likely-first order.
        let mut acc = 0.0;
        let nucleus = order
            .iter()
            .take_while(|&&i| {
                let before = acc;
                acc += all[i];
                before < 0.5
            })
            .count();
        assert!(nucleus > 200, "{nucleus}");
        let top: Vec<usize> = order[..nucleus].to_vec();
        let top5: Vec<usize> = order[..5].to_vec();
        let floor = all[order[0]] * 0.3;
        // Top-k 5 then top-p 0.5 of those: the first tokens of the top 5 reaching half their mass.
        let p5 = probs(&|i| top5.contains(&i));
        let mut acc = 0.0;
        let k5p: Vec<usize> = top5
            .iter()
            .copied()
            .take_while(|&i| {
                let before = acc;
                acc += p5[i];
                before < 0.5
            })
            .collect();
        let cases: Vec<(SamplerConfig, Vec<f64>)> = vec![
            (
                SamplerConfig::default().with_top_k(5).with_top_p(0.5),
                probs(&|i| k5p.contains(&i)),
            ),
            (SamplerConfig::default(), all.clone()),
            (
                SamplerConfig::default().with_top_k(5),
                probs(&|i| top5.contains(&i)),
            ),
            (
                SamplerConfig::default().with_top_p(0.5),
                probs(&|i| top.contains(&i)),
            ),
            (
                SamplerConfig::default().with_min_p(0.3),
                probs(&|i| all[i] >= floor),
            ),
        ];
        let n = 40_000;
        for (params, want) in cases {
            let mut s = Sampler::new(params.clone().with_temperature(t as f32).with_seed(11));
            let mut seen = vec![0usize; logits.len()];
            for _ in 0..n {
                seen[s.sample(&logits, &[]) as usize] += 1;
            }
            for (i, (&c, &p)) in seen.iter().zip(&want).enumerate() {
                if p == 0.0 {
                    assert_eq!(c, 0, "{params:?}: token {i} is outside the kept set");
                }
                let sd = (p * (1.0 - p) / n as f64).sqrt();
                let got = c as f64 / n as f64;
                assert!(
                    (got - p).abs() <= 5.0 * sd + 1e-4,
                    "{params:?}: token {i} want {p} got {got}"
                );
            }
            // The most likely token's share, a check with power.
            let best = order[0];
            assert!(seen[best] > 0 && want[best] > 0.0);
        }
    }

    /// The vectorized argmax against the obvious loop, on rows with ties, NaN, infinities and
    /// signed zeros, of lengths around the 16-value steps.
    #[test]
    fn argmax_equals_the_first_maximum() {
        let reference = |xs: &[f32]| -> u32 {
            let mut best: Option<usize> = None;
            for (i, &v) in xs.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|b| v > xs[b]) {
                    best = Some(i);
                }
            }
            best.unwrap_or(0) as u32
        };
        let pool = [
            0.0,
            -0.0,
            1.5,
            -2.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.5,
            3.25,
        ];
        let mut s = 0x9E37_79B9u64;
        for len in (0..70).chain([255, 256, 257, 1000]) {
            for _ in 0..40 {
                let xs: Vec<f32> = (0..len)
                    .map(|_| {
                        s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                        pool[(s >> 33) as usize % pool.len()]
                    })
                    .collect();
                assert_eq!(argmax(&xs), reference(&xs), "{xs:?}");
            }
        }
    }

    /// `token_logprob` against a sort-everything reference in f64: the same ids in the same
    /// order (NaN as minus infinity, ties by id, asking for more than the finite entries), the
    /// same log-probabilities within 1e-5.
    #[test]
    fn logprobs_match_a_full_sort() {
        let row = big_row(3000);
        let lse = token_nll(&row, 0) + f64::from(row[0]);
        for top_n in [0, 1, 5, 64, 2990, 3000, 4000] {
            let lp = token_logprob(&row, 1234, top_n);
            let mut all: Vec<(f32, u32)> = row
                .iter()
                .enumerate()
                .map(|(i, &l)| (if l.is_nan() { f32::NEG_INFINITY } else { l }, i as u32))
                .collect();
            all.sort_by(by_desc);
            all.truncate(top_n);
            assert_eq!(
                lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                all.iter().map(|t| t.1).collect::<Vec<_>>(),
                "top {top_n}"
            );
            for (&(_, _, got), &(l, _)) in lp.top.iter().zip(&all) {
                let want = (f64::from(l) - lse) as f32;
                assert!(got == want || (got - want).abs() < 1e-5, "{got} {want}");
            }
            assert!((f64::from(lp.logprob) - (f64::from(row[1234]) - lse)).abs() < 1e-5);
        }
    }

    #[test]
    fn infinite_logits_and_tiny_temperatures_pick_the_argmax() {
        let mut row = big_row(1000);
        row[777] = f32::INFINITY;
        let mut s = Sampler::new(SamplerConfig::default().with_temperature(1.0).with_seed(2));
        assert!((0..20).all(|_| s.sample(&row, &[]) == 777));
        let row = big_row(1000);
        let mut s = Sampler::new(
            SamplerConfig::default()
                .with_temperature(1e-45)
                .with_seed(2),
        );
        assert_eq!(s.sample(&row, &[]), argmax(&row));
        // Nothing drawable: the argmax rule (token 0 for an all-NaN row).
        let mut s = Sampler::new(SamplerConfig::default().with_temperature(1.0));
        assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY], &[]), 1);
        // min-p above 1 keeps only the most likely token.
        let mut s = Sampler::new(
            SamplerConfig::default()
                .with_temperature(1.0)
                .with_min_p(2.0),
        );
        assert_eq!(s.sample(&row, &[]), argmax(&row));
    }

    #[test]
    fn seeds_reproduce_and_differ() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.1).collect();
        let run = |seed| {
            let mut s = Sampler::new(
                SamplerConfig::default()
                    .with_temperature(1.0)
                    .with_seed(seed),
            );
            (0..50).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn pcg_is_uniform_enough() {
        let mut r = Pcg32::new(0);
        let n = 100_000;
        let mean = (0..n).map(|_| r.next_f64()).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01);
    }

    #[test]
    fn stop_matcher() {
        let m = StopMatcher::new(["ab", "", "bcd"]);
        assert_eq!(m.find("xxabcd"), Some(("ab", 2)));
        assert_eq!(m.find("xxbcd"), Some(("bcd", 2)));
        assert_eq!(m.find("xxbc"), None);
        assert_eq!(m.holdback("xxbc"), 2);
        assert_eq!(m.holdback("xxa"), 1);
        assert_eq!(m.holdback("xx"), 0);
        // multi-byte: never splits a char
        let m = StopMatcher::new(["é!"]);
        assert_eq!(m.holdback("café"), "é".len());
    }
}
