//! A simple single-sequence generation loop over [`Model::forward`].

use std::time::{Duration, Instant};

use kv_ring::{KvRing, KvStorage};
use token_stream::Tokenizer;

use crate::executor::Executor;
use crate::model::{ForwardError, LogitsWanted, Model, SeqStep};
use crate::sampling::{Sampler, SamplerConfig, StopMatcher};
use zerolayer_api::StopReason;

/// Options of [`Model::generate`].
///
/// ```
/// use gpu_pipeline::{GenerateOptions, SamplerConfig};
/// let o = GenerateOptions::default().with_max_tokens(32).with_stop_sequences(["\n\n"]);
/// assert_eq!(o.max_tokens, 32);
/// assert_eq!(o.sampling, SamplerConfig::greedy());
/// ```
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Hard cap on generated tokens (the stop token, when one ends the generation, is not
    /// counted and not returned). Default 256.
    pub max_tokens: usize,
    /// Sampling parameters (default greedy).
    pub sampling: SamplerConfig,
    /// Text that ends the generation; the returned text stops before it. Needs a tokenizer.
    pub stop_sequences: Vec<String>,
    /// Token ids that end the generation (`None`: the model's EOS/EOT and the tokenizer's
    /// end-of-generation ids, [`Model::stop_tokens_with`]).
    pub stop_tokens: Option<Vec<u32>>,
    /// The prompt is prefilled in chunks of at most this many tokens. Default 128: a chunk's
    /// activation scratch (~70 KB per token on SmolLM2-135M) is part of the peak RSS, and the
    /// batched kernels multiply at most 128 tokens per weight-panel packing anyway, so larger
    /// chunks only cost memory (default model, 512-token prompt, 2 threads: 128 vs 256 tokens
    /// per chunk 1100-1269 vs 977-1285 tok/s, peak RSS 137.2-137.8 vs 143.9-144.3 MiB).
    pub prefill_chunk: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            sampling: SamplerConfig::default(),
            stop_sequences: Vec::new(),
            stop_tokens: None,
            prefill_chunk: 128,
        }
    }
}

impl GenerateOptions {
    /// Sets [`max_tokens`](Self::max_tokens).
    pub fn with_max_tokens(mut self, n: usize) -> Self {
        self.max_tokens = n;
        self
    }
    /// Sets [`sampling`](Self::sampling).
    pub fn with_sampling(mut self, s: SamplerConfig) -> Self {
        self.sampling = s;
        self
    }
    /// Sets [`stop_sequences`](Self::stop_sequences).
    pub fn with_stop_sequences<S: Into<String>>(mut self, s: impl IntoIterator<Item = S>) -> Self {
        self.stop_sequences = s.into_iter().map(Into::into).collect();
        self
    }
    /// Sets [`stop_tokens`](Self::stop_tokens).
    pub fn with_stop_tokens(mut self, t: Vec<u32>) -> Self {
        self.stop_tokens = Some(t);
        self
    }
    /// Sets [`prefill_chunk`](Self::prefill_chunk).
    pub fn with_prefill_chunk(mut self, n: usize) -> Self {
        self.prefill_chunk = n;
        self
    }
}

/// Result of [`Model::generate`].
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct Generation {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated token ids (at most `max_tokens`; without the stop token).
    pub ids: Vec<u32>,
    /// The generated text (when a tokenizer was given), cut before a matched stop sequence.
    pub text: Option<String>,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// Time to first token: prompt prefill plus the first sampling.
    pub time_to_first_token: Duration,
    /// Time of everything after the first token.
    pub decode_time: Duration,
}

/// Error of [`Model::generate`].
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Stop sequences were given without a tokenizer to turn tokens into text.
    #[error("stop sequences need a tokenizer")]
    StopSequencesNeedTokenizer,
    /// `prefill_chunk` is 0.
    #[error("prefill_chunk must be at least 1")]
    ZeroPrefillChunk,
    /// The forward pass failed (e.g. the context is full).
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

impl Model {
    /// Generates a continuation of `prompt` into `kv` (which may already hold a prefix: the
    /// prompt is appended after it), calling `on_token` for each generated token.
    ///
    /// Stops at the first of: a stop token ([`StopReason::EndTurn`]), a stop sequence in the
    /// decoded text ([`StopReason::StopSequence`]), `max_tokens` generated tokens
    /// ([`StopReason::MaxTokens`]). When the ring fills up the forward error is returned.
    pub fn generate(
        &self,
        kv: &mut KvRing,
        prompt: &[u32],
        opts: &GenerateOptions,
        tokenizer: Option<&Tokenizer>,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation, GenerateError> {
        run(
            &|steps, logits| self.forward(steps, logits),
            &|t| self.stop_tokens_with(t),
            kv,
            prompt,
            opts,
            tokenizer,
            on_token,
        )
    }
}

/// [`Model::generate`] on any [`Executor`] (the CUDA one, say): the same prefill, sampling and
/// stop rules.
pub fn generate_with<E: Executor + ?Sized>(
    exec: &E,
    kv: &mut KvRing<E::Kv>,
    prompt: &[u32],
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation, GenerateError> {
    run(
        &|steps, logits| exec.forward(steps, logits),
        &|t| exec.stop_tokens_with(t),
        kv,
        prompt,
        opts,
        tokenizer,
        on_token,
    )
}

/// A forward pass over a batch of steps.
type ForwardFn<'a, S> =
    dyn Fn(&mut [SeqStep<'_, S>], &mut Vec<f32>) -> Result<(), ForwardError> + 'a;

/// The generation loop over `forward`; `default_stops` gives the stop tokens when `opts` has
/// none.
fn run<S: KvStorage>(
    forward: &ForwardFn<'_, S>,
    default_stops: &dyn Fn(Option<&Tokenizer>) -> Vec<u32>,
    kv: &mut KvRing<S>,
    prompt: &[u32],
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation, GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    if opts.prefill_chunk == 0 {
        return Err(GenerateError::ZeroPrefillChunk);
    }
    let stops = StopMatcher::new(opts.stop_sequences.iter().cloned());
    if !stops.is_empty() && tokenizer.is_none() {
        return Err(GenerateError::StopSequencesNeedTokenizer);
    }
    let stop_tokens = opts
        .stop_tokens
        .clone()
        .unwrap_or_else(|| default_stops(tokenizer));
    let t0 = Instant::now();
    let mut res = Generation {
        prompt_tokens: prompt.len(),
        ids: Vec::new(),
        text: tokenizer.map(|_| String::new()),
        stop_reason: StopReason::MaxTokens,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
    };
    if opts.max_tokens == 0 {
        return Ok(res);
    }
    let mut logits = Vec::new();
    let chunks: Vec<&[u32]> = prompt.chunks(opts.prefill_chunk).collect();
    for (i, c) in chunks.iter().enumerate() {
        let want = if i + 1 == chunks.len() {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        forward(
            &mut [SeqStep {
                tokens: c,
                kv,
                logits: want,
            }],
            &mut logits,
        )?;
    }
    let mut sampler = Sampler::new(opts.sampling.clone());
    let mut history: Vec<u32> = Vec::with_capacity(prompt.len() + opts.max_tokens);
    history.extend_from_slice(prompt);
    let mut bytes: Vec<u8> = Vec::new();
    let mut first = true;
    let mut t_first = t0;
    loop {
        let tok = sampler.sample(&logits, &history);
        if first {
            t_first = Instant::now();
            res.time_to_first_token = t_first - t0;
            first = false;
        }
        if stop_tokens.contains(&tok) {
            res.stop_reason = StopReason::EndTurn;
            break;
        }
        res.ids.push(tok);
        history.push(tok);
        on_token(tok);
        if let Some(tk) = tokenizer {
            if let Some(b) = tk.token_bytes(tok) {
                bytes.extend_from_slice(b);
            }
            if !stops.is_empty() {
                let text = String::from_utf8_lossy(&bytes);
                if let Some((_, at)) = stops.find(&text) {
                    res.text = Some(text[..at].to_string());
                    res.stop_reason = StopReason::StopSequence;
                    break;
                }
            }
        }
        if res.ids.len() >= opts.max_tokens {
            res.stop_reason = StopReason::MaxTokens;
            break;
        }
        forward(
            &mut [SeqStep {
                tokens: &[tok],
                kv,
                logits: LogitsWanted::Last,
            }],
            &mut logits,
        )?;
    }
    res.decode_time = t_first.elapsed();
    if res.stop_reason != StopReason::StopSequence && tokenizer.is_some() {
        res.text = Some(String::from_utf8_lossy(&bytes).into_owned());
    }
    Ok(res)
}
