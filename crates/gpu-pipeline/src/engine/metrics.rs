//! Engine counters and histograms, readable at any time.

use std::time::Duration;

use zerolayer_api::{Histogram, ServiceMetrics};

/// Bounds of [`EngineMetrics::batch_size_hist`]: `2^(k+1) - 1`, so that bucket `k` counts
/// steps of `2^k` to `2^(k+1) - 1` sequences (1, 2-3, 4-7, ..., 512-1023; larger steps only in
/// the `+Inf` bucket).
const BATCH_SIZE_BOUNDS: &[f64] = &[1.0, 3.0, 7.0, 15.0, 31.0, 63.0, 127.0, 255.0, 511.0, 1023.0];

/// A snapshot of an engine's metrics ([`Engine::metrics`](super::Engine::metrics)).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct EngineMetrics {
    /// Requests waiting for admission.
    pub queue_depth: usize,
    /// Sequences in the batch.
    pub running: usize,
    /// Requests accepted since start.
    pub submitted: u64,
    /// Requests refused as overloaded since start.
    pub refused: u64,
    /// Requests finished (any stop reason) since start.
    pub finished: u64,
    /// Requests cancelled since start.
    pub cancelled: u64,
    /// Running sequences preempted since start (KV given back, recomputed on readmission)
    /// because the pool could not grow them or a client under its fair share needed room.
    pub preempted: u64,
    /// Forward steps run.
    pub steps: u64,
    /// Steps by batch size (sequences per step), over the bounds 1, 3, 7, ..., 1023: bucket `k`
    /// counts sizes in `[2^k, 2^(k+1))`.
    pub batch_size_hist: Histogram,
    /// Generated tokens since start.
    pub generated_tokens: u64,
    /// Prompt tokens computed (not reused) since start.
    pub prompt_tokens: u64,
    /// Generated tokens per second of busy time (time spent in steps).
    pub generated_tokens_per_s: f64,
    /// Prompt tokens per second of busy time.
    pub prompt_tokens_per_s: f64,
    /// Time spent in forward steps.
    pub busy: Duration,
    /// Time from submit to the first generated token, in seconds over
    /// [`Histogram::LATENCY_SECONDS`] (1 ms to 5 min, the gateway's bounds).
    pub ttft: Histogram,
    /// Time between consecutive generated tokens of a stream, in seconds over
    /// [`Histogram::LATENCY_SECONDS`].
    pub inter_token: Histogram,
    /// KV pool bytes in use (running rings and the prefix cache).
    pub kv_bytes_used: usize,
    /// KV pool budget.
    pub kv_bytes_budget: usize,
    /// Prefix-cache lookups.
    pub prefix_lookups: u64,
    /// Lookups that reused a cached prefix.
    pub prefix_hits: u64,
    /// Prompt tokens reused from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Entries in the prefix cache.
    pub prefix_entries: usize,
    /// Weight-cache hit rate (mincore residency at first and sampled touches) when the model
    /// has a [`WeightCache`](weight_cache::WeightCache) attached and has touched weights.
    pub weight_cache_hit_rate: Option<f64>,
    /// Expert hit rate of a mixture-of-experts model: the fraction of the chosen experts' weight
    /// blocks found resident (mincore) at their first touch in a profiling request and at
    /// sampled touches, with a weight cache attached.
    pub expert_hit_rate: Option<f64>,
    /// Bytes the process read from storage (page-cache misses of the mapped weights, warm-ups
    /// included; Linux task I/O accounting) per token processed (prompt and generated), with a
    /// weight cache attached.
    pub storage_read_bytes_per_token: Option<f64>,
    /// Speculative draft tokens verified since start ([`Speculation`](super::Speculation)).
    pub draft_tokens: u64,
    /// Of which accepted (emitted without a step of their own).
    pub accepted_draft_tokens: u64,
    /// Of the draft tokens, those n-gram lookup proposed (all of them under
    /// [`Speculation::NgramLookup`](super::Speculation::NgramLookup); with a draft model, its
    /// lookup-first drafts, [`DraftModel::lookup_first`](super::DraftModel::lookup_first)).
    pub lookup_draft_tokens: u64,
    /// Sequence steps that sampled (one per sequence per step that emitted tokens): without
    /// speculation about one per generated token.
    pub sampled_steps: u64,
}

impl EngineMetrics {
    /// Fraction of prefix-cache lookups that hit.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_lookups == 0 {
            0.0
        } else {
            self.prefix_hits as f64 / self.prefix_lookups as f64
        }
    }

    /// Fraction of the verified draft tokens that were accepted (0 without drafts).
    pub fn draft_acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            0.0
        } else {
            self.accepted_draft_tokens as f64 / self.draft_tokens as f64
        }
    }

    /// Generated tokens per sequence step that sampled: 1 without speculation, more when drafts
    /// are accepted (0 before any step).
    ///
    /// ```
    /// let mut m = gpu_pipeline::engine::EngineMetrics::default();
    /// (m.generated_tokens, m.sampled_steps) = (30, 12);
    /// assert_eq!(m.tokens_per_sampled_step(), 2.5);
    /// ```
    pub fn tokens_per_sampled_step(&self) -> f64 {
        if self.sampled_steps == 0 {
            0.0
        } else {
            self.generated_tokens as f64 / self.sampled_steps as f64
        }
    }

    pub(crate) fn record_batch(&mut self, n: usize) {
        self.batch_size_hist.observe(n as f64);
    }
}

impl Default for EngineMetrics {
    /// All zero, the histograms empty.
    fn default() -> Self {
        Self {
            queue_depth: 0,
            running: 0,
            submitted: 0,
            refused: 0,
            finished: 0,
            cancelled: 0,
            preempted: 0,
            steps: 0,
            batch_size_hist: Histogram::new(BATCH_SIZE_BOUNDS),
            generated_tokens: 0,
            prompt_tokens: 0,
            generated_tokens_per_s: 0.0,
            prompt_tokens_per_s: 0.0,
            busy: Duration::ZERO,
            ttft: Histogram::new(Histogram::LATENCY_SECONDS),
            inter_token: Histogram::new(Histogram::LATENCY_SECONDS),
            kv_bytes_used: 0,
            kv_bytes_budget: 0,
            prefix_lookups: 0,
            prefix_hits: 0,
            prefix_hit_tokens: 0,
            prefix_entries: 0,
            weight_cache_hit_rate: None,
            expert_hit_rate: None,
            storage_read_bytes_per_token: None,
            draft_tokens: 0,
            accepted_draft_tokens: 0,
            lookup_draft_tokens: 0,
            sampled_steps: 0,
        }
    }
}

/// The snapshot the transports render (`/metrics`): the engine's queue, batch, token, KV and
/// prefix-cache counters, and the weight-cache rates (0 where not measured).
///
/// ```
/// use gpu_pipeline::engine::EngineMetrics;
/// use gpu_pipeline::zerolayer_api::ServiceMetrics;
/// let mut m = EngineMetrics::default();
/// m.queue_depth = 3;
/// m.weight_cache_hit_rate = Some(0.5);
/// let s = ServiceMetrics::from(&m);
/// assert_eq!((s.queue_depth, s.weight_cache_hit_rate, s.expert_hit_rate), (3, 0.5, 0.0));
/// ```
impl From<&EngineMetrics> for ServiceMetrics {
    fn from(m: &EngineMetrics) -> Self {
        let mut s = Self::default();
        s.queue_depth = m.queue_depth as u64;
        s.running = m.running as u64;
        s.generated_tokens = m.generated_tokens;
        s.prompt_tokens = m.prompt_tokens;
        s.kv_bytes_used = m.kv_bytes_used as u64;
        s.kv_bytes_budget = m.kv_bytes_budget as u64;
        s.weight_cache_hit_rate = m.weight_cache_hit_rate.unwrap_or(0.0);
        s.expert_hit_rate = m.expert_hit_rate.unwrap_or(0.0);
        s.weight_read_bytes_per_token = m.storage_read_bytes_per_token.unwrap_or(0.0);
        s.prefix_cache_hit_tokens = m.prefix_hit_tokens;
        s.draft_tokens = m.draft_tokens;
        s.accepted_draft_tokens = m.accepted_draft_tokens;
        s.lookup_draft_tokens = m.lookup_draft_tokens;
        s.sampled_steps = m.sampled_steps;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_size_buckets_are_powers_of_two_ranges() {
        let mut m = EngineMetrics::default();
        for n in [1, 2, 3, 4, 200, 5000] {
            m.record_batch(n);
        }
        let cumulative: Vec<u64> = m.batch_size_hist.cumulative().map(|(_, c)| c).collect();
        // [1], [2, 3], [4, 7], ..., [128, 255] holds 200; 5000 only in +Inf.
        assert_eq!(cumulative, [1, 3, 4, 4, 4, 4, 4, 5, 5, 5]);
        assert_eq!(m.batch_size_hist.count(), 6);
        assert_eq!(m.batch_size_hist.quantile_upper_bound(0.5), Some(3.0));
    }

    #[test]
    fn latencies_are_recorded_in_seconds() {
        let mut m = EngineMetrics::default();
        m.ttft.observe_duration(Duration::from_millis(20));
        m.ttft.observe_duration(Duration::from_millis(40));
        assert_eq!(m.ttft.mean(), Some(0.03));
        assert_eq!(m.ttft.quantile_upper_bound(1.0), Some(0.05));
        assert_eq!(m.inter_token.count(), 0);
    }
}
