//! Engine counters and histograms, readable at any time.

use std::time::Duration;

use zerolayer_api::ServiceMetrics;

/// A histogram of durations over power-of-two microsecond buckets (bucket `k` holds values in
/// `[2^(k-1), 2^k)` µs; bucket 0 holds 0 µs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    /// Counts per bucket.
    pub buckets: Vec<u64>,
    /// Number of samples.
    pub count: u64,
    /// Sum of all samples in microseconds.
    pub sum_us: u64,
}

impl LatencyHistogram {
    pub(crate) fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let k = (64 - us.leading_zeros()) as usize;
        if self.buckets.len() <= k {
            self.buckets.resize(k + 1, 0);
        }
        self.buckets[k] += 1;
        self.count += 1;
        self.sum_us = self.sum_us.saturating_add(us);
    }

    /// Mean, if any samples.
    pub fn mean(&self) -> Option<Duration> {
        (self.count > 0).then(|| Duration::from_micros(self.sum_us / self.count))
    }

    /// Upper bound of the bucket holding quantile `q` in [0, 1] (within a factor of 2).
    pub fn quantile_upper_bound(&self, q: f64) -> Option<Duration> {
        if self.count == 0 {
            return None;
        }
        let target = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (k, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= target {
                return Some(Duration::from_micros(if k == 0 { 0 } else { 1u64 << k }));
            }
        }
        None
    }
}

/// A snapshot of an engine's metrics ([`Engine::metrics`](super::Engine::metrics)).
#[non_exhaustive]
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// Steps by batch size (sequences per step): bucket `k` counts sizes in `[2^k, 2^(k+1))`.
    pub batch_size_hist: Vec<u64>,
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
    /// Time from submit to the first generated token.
    pub ttft: LatencyHistogram,
    /// Time between consecutive generated tokens of a stream.
    pub inter_token: LatencyHistogram,
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
        let k = (usize::BITS - n.max(1).leading_zeros() - 1) as usize;
        if self.batch_size_hist.len() <= k {
            self.batch_size_hist.resize(k + 1, 0);
        }
        self.batch_size_hist[k] += 1;
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
        s.sampled_steps = m.sampled_steps;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles() {
        let mut h = LatencyHistogram::default();
        for us in [0u64, 1, 3, 100, 1000] {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count, 5);
        assert_eq!(h.quantile_upper_bound(0.2), Some(Duration::ZERO));
        assert_eq!(h.quantile_upper_bound(0.6), Some(Duration::from_micros(4)));
        assert_eq!(
            h.quantile_upper_bound(1.0),
            Some(Duration::from_micros(1024))
        );
        let mut m = EngineMetrics::default();
        m.record_batch(1);
        m.record_batch(3);
        m.record_batch(200);
        assert_eq!(m.batch_size_hist, vec![1, 1, 0, 0, 0, 0, 0, 1]);
    }
}
