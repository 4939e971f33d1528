//! The gateway's own counters and their Prometheus text rendering (with the service's snapshot).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::config::LAYER_VERSION;
use zerolayer_api::{Histogram, ServiceMetrics};

/// Per-request decode-rate buckets in tokens per second.
const RATE_BUCKETS: [f64; 12] = [
    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0, 6400.0,
];
/// Window of the `zerolayer_output_tokens_per_second` gauge.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Writes `h` as a Prometheus histogram: cumulative `_bucket{le=".."}` series, `+Inf`, `_sum`,
/// `_count`.
fn render_histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (le, cumulative) in h.cumulative() {
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
    }
    let count = h.count();
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum {}", h.sum());
    let _ = writeln!(out, "{name}_count {count}");
}

/// Which API a request went to (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Endpoint {
    Messages,
    CountTokens,
    Models,
    ChatCompletions,
    Completions,
    Health,
    Metrics,
    /// `GET /`: the page set by [`GatewayConfig::index_page`](super::GatewayConfig::index_page).
    Index,
    Other,
}

impl Endpoint {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Messages => "messages",
            Self::CountTokens => "count_tokens",
            Self::Models => "models",
            Self::ChatCompletions => "chat_completions",
            Self::Completions => "completions",
            Self::Health => "health",
            Self::Metrics => "metrics",
            Self::Index => "index",
            Self::Other => "other",
        }
    }
}

/// The HTTP version a request came over (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Protocol {
    Http1,
    Http2,
    Http3,
}

impl Protocol {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Http1 => "http1",
            Self::Http2 => "http2",
            Self::Http3 => "http3",
        }
    }
}

/// How a generation ended (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Outcome {
    Finished,
    Error,
    Timeout,
    Cancelled,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Finished => "finished",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Counters the gateway keeps itself.
#[derive(Debug)]
pub(crate) struct GatewayMetrics {
    started: Instant,
    requests: Mutex<BTreeMap<(Endpoint, Protocol, u16), u64>>,
    outcomes: Mutex<BTreeMap<Outcome, u64>>,
    ttft: Mutex<Histogram>,
    queue: Mutex<Histogram>,
    latency: Mutex<Histogram>,
    decode_rate: Mutex<Histogram>,
    output_tokens: AtomicU64,
    input_tokens: AtomicU64,
    in_flight: AtomicU64,
    /// Generations of other transports (claudelink) counted by `Gateway::count_in_flight`.
    other_in_flight: AtomicU64,
    connections: Mutex<BTreeMap<Protocol, u64>>,
    reused_requests: AtomicU64,
    total_conn_requests: AtomicU64,
    /// (second since start, tokens) for the sliding tokens/s gauge.
    recent_tokens: Mutex<VecDeque<(u64, u64)>>,
}

impl GatewayMetrics {
    pub(crate) fn new() -> Self {
        Self {
            started: Instant::now(),
            requests: Mutex::default(),
            outcomes: Mutex::default(),
            ttft: Mutex::new(Histogram::new(Histogram::LATENCY_SECONDS)),
            queue: Mutex::new(Histogram::new(Histogram::LATENCY_SECONDS)),
            latency: Mutex::new(Histogram::new(Histogram::LATENCY_SECONDS)),
            decode_rate: Mutex::new(Histogram::new(&RATE_BUCKETS)),
            output_tokens: AtomicU64::new(0),
            input_tokens: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            other_in_flight: AtomicU64::new(0),
            connections: Mutex::default(),
            reused_requests: AtomicU64::new(0),
            total_conn_requests: AtomicU64::new(0),
            recent_tokens: Mutex::default(),
        }
    }

    pub(crate) fn request_done(&self, endpoint: Endpoint, protocol: Protocol, status: u16) {
        *lock(&self.requests)
            .entry((endpoint, protocol, status))
            .or_default() += 1;
    }

    pub(crate) fn connection_opened(&self, protocol: Protocol) {
        *lock(&self.connections).entry(protocol).or_default() += 1;
    }

    /// A request arrived on a connection that had already carried `previous` requests.
    pub(crate) fn connection_request(&self, previous: u64) {
        self.total_conn_requests.fetch_add(1, Ordering::Relaxed);
        if previous > 0 {
            self.reused_requests.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn generation_started(&self) -> u64 {
        self.in_flight.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn generation_ended(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Generations in flight: the gateway's own and those of the services wrapped by
    /// `Gateway::count_in_flight` (claudelink).
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed) + self.other_in_flight.load(Ordering::Relaxed)
    }

    pub(crate) fn other_started(&self) {
        self.other_in_flight.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn other_ended(&self) {
        self.other_in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn observe_queue(&self, d: Duration) {
        lock(&self.queue).observe_duration(d);
    }

    pub(crate) fn observe_ttft(&self, d: Duration) {
        lock(&self.ttft).observe_duration(d);
    }

    pub(crate) fn tokens(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.output_tokens.fetch_add(n, Ordering::Relaxed);
        let sec = self.started.elapsed().as_secs();
        let mut recent = lock(&self.recent_tokens);
        match recent.back_mut() {
            Some((s, c)) if *s == sec => *c += n,
            _ => recent.push_back((sec, n)),
        }
        while recent
            .front()
            .is_some_and(|&(s, _)| s + RATE_WINDOW.as_secs() < sec)
        {
            recent.pop_front();
        }
    }

    /// Records a finished (or failed) generation.
    pub(crate) fn generation_outcome(
        &self,
        outcome: Outcome,
        latency: Duration,
        input_tokens: u32,
        output_tokens: u32,
        decode_time: Option<Duration>,
    ) {
        *lock(&self.outcomes).entry(outcome).or_default() += 1;
        lock(&self.latency).observe_duration(latency);
        self.input_tokens
            .fetch_add(u64::from(input_tokens), Ordering::Relaxed);
        if let Some(d) = decode_time.filter(|d| !d.is_zero() && output_tokens > 1) {
            // Tokens after the first over the time after the first: the steady decode rate.
            lock(&self.decode_rate).observe(f64::from(output_tokens - 1) / d.as_secs_f64());
        }
    }

    /// Requests that arrived on an already-used connection, over all requests.
    pub(crate) fn reuse_ratio(&self) -> f64 {
        let total = self.total_conn_requests.load(Ordering::Relaxed);
        if total == 0 {
            0.0
        } else {
            self.reused_requests.load(Ordering::Relaxed) as f64 / total as f64
        }
    }

    fn tokens_per_second(&self) -> f64 {
        let now = self.started.elapsed();
        let sec = now.as_secs();
        let recent = lock(&self.recent_tokens);
        let total: u64 = recent
            .iter()
            .filter(|&&(s, _)| s + RATE_WINDOW.as_secs() >= sec)
            .map(|&(_, c)| c)
            .sum();
        let window = RATE_WINDOW.as_secs_f64().min(now.as_secs_f64()).max(1.0);
        total as f64 / window
    }

    /// Prometheus text exposition (version 0.0.4).
    pub(crate) fn render(&self, svc: &ServiceMetrics, ready: bool) -> String {
        let mut o = String::with_capacity(8192);
        let _ = writeln!(
            o,
            "# HELP zerolayer_build_info Layer version of this gateway."
        );
        let _ = writeln!(
            o,
            "# TYPE zerolayer_build_info gauge\nzerolayer_build_info{{layer=\"{LAYER_VERSION}\"}} 1"
        );
        gauge(
            &mut o,
            "zerolayer_ready",
            "1 when the service is ready to serve.",
            f64::from(u8::from(ready)),
        );
        gauge(
            &mut o,
            "zerolayer_uptime_seconds",
            "Seconds since the gateway started.",
            self.started.elapsed().as_secs_f64(),
        );

        let _ = writeln!(
            o,
            "# HELP zerolayer_http_requests_total HTTP requests answered."
        );
        let _ = writeln!(o, "# TYPE zerolayer_http_requests_total counter");
        for ((e, p, s), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                o,
                "zerolayer_http_requests_total{{endpoint=\"{}\",protocol=\"{}\",status=\"{s}\"}} {n}",
                e.as_str(),
                p.as_str()
            );
        }
        let _ = writeln!(
            o,
            "# HELP zerolayer_generations_total Generation requests by outcome."
        );
        let _ = writeln!(o, "# TYPE zerolayer_generations_total counter");
        for (k, n) in lock(&self.outcomes).iter() {
            let _ = writeln!(
                o,
                "zerolayer_generations_total{{outcome=\"{}\"}} {n}",
                k.as_str()
            );
        }
        gauge(
            &mut o,
            "zerolayer_generations_in_flight",
            "Generation requests in flight (HTTP and claudelink).",
            self.in_flight() as f64,
        );
        render_histogram(
            &mut o,
            "zerolayer_time_to_first_token_seconds",
            "From request arrival to the first generated text.",
            &lock(&self.ttft),
        );
        render_histogram(
            &mut o,
            "zerolayer_queue_wait_seconds",
            "From submission to the service's start event (queueing plus tokenization).",
            &lock(&self.queue),
        );
        render_histogram(
            &mut o,
            "zerolayer_request_duration_seconds",
            "Generation request latency, arrival to last byte.",
            &lock(&self.latency),
        );
        render_histogram(
            &mut o,
            "zerolayer_request_decode_tokens_per_second",
            "Per-request decode rate after the first token.",
            &lock(&self.decode_rate),
        );
        counter(
            &mut o,
            "zerolayer_output_tokens_total",
            "Tokens generated through the gateway.",
            self.output_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "zerolayer_input_tokens_total",
            "Prompt tokens of generations through the gateway.",
            self.input_tokens.load(Ordering::Relaxed),
        );
        gauge(
            &mut o,
            "zerolayer_output_tokens_per_second",
            "Tokens generated per second over the last 10 s.",
            self.tokens_per_second(),
        );

        let _ = writeln!(
            o,
            "# HELP zerolayer_connections_total Connections accepted."
        );
        let _ = writeln!(o, "# TYPE zerolayer_connections_total counter");
        for (p, n) in lock(&self.connections).iter() {
            let _ = writeln!(
                o,
                "zerolayer_connections_total{{protocol=\"{}\"}} {n}",
                p.as_str()
            );
        }
        counter(
            &mut o,
            "zerolayer_reused_connection_requests_total",
            "Requests that arrived on an already-used connection.",
            self.reused_requests.load(Ordering::Relaxed),
        );
        gauge(
            &mut o,
            "zerolayer_connection_reuse_ratio",
            "Share of requests that arrived on an already-used connection.",
            self.reuse_ratio(),
        );

        gauge(
            &mut o,
            "zerolayer_queue_depth",
            "Requests waiting for admission to the batch.",
            svc.queue_depth as f64,
        );
        gauge(
            &mut o,
            "zerolayer_running_sequences",
            "Sequences in the running batch.",
            svc.running as f64,
        );
        counter(
            &mut o,
            "zerolayer_engine_generated_tokens_total",
            "Tokens generated by the engine since start.",
            svc.generated_tokens,
        );
        counter(
            &mut o,
            "zerolayer_engine_prompt_tokens_total",
            "Prompt tokens processed by the engine since start.",
            svc.prompt_tokens,
        );
        gauge(
            &mut o,
            "zerolayer_kv_bytes_used",
            "KV-cache bytes in use.",
            svc.kv_bytes_used as f64,
        );
        gauge(
            &mut o,
            "zerolayer_kv_bytes_budget",
            "KV-cache budget in bytes.",
            svc.kv_bytes_budget as f64,
        );
        let kv_use = if svc.kv_bytes_budget == 0 {
            0.0
        } else {
            svc.kv_bytes_used as f64 / svc.kv_bytes_budget as f64
        };
        gauge(
            &mut o,
            "zerolayer_kv_utilization",
            "KV-cache bytes used over budget.",
            kv_use,
        );
        gauge(
            &mut o,
            "zerolayer_weight_cache_hit_rate",
            "Weight-cache hit rate in [0, 1].",
            svc.weight_cache_hit_rate,
        );
        gauge(
            &mut o,
            "zerolayer_expert_hit_rate",
            "Mixture-of-experts models: fraction of the chosen experts' weight blocks resident, in [0, 1].",
            svc.expert_hit_rate,
        );
        gauge(
            &mut o,
            "zerolayer_weight_read_bytes_per_token",
            "Bytes read from storage per token processed (page-cache misses of the weights).",
            svc.weight_read_bytes_per_token,
        );
        counter(
            &mut o,
            "zerolayer_prefix_cache_hit_tokens_total",
            "Prompt tokens reused from the prefix cache.",
            svc.prefix_cache_hit_tokens,
        );
        counter(
            &mut o,
            "zerolayer_draft_tokens_total",
            "Speculative draft tokens verified.",
            svc.draft_tokens,
        );
        counter(
            &mut o,
            "zerolayer_accepted_draft_tokens_total",
            "Speculative draft tokens accepted (acceptance rate: over zerolayer_draft_tokens_total).",
            svc.accepted_draft_tokens,
        );
        counter(
            &mut o,
            "zerolayer_lookup_draft_tokens_total",
            "Speculative draft tokens proposed by n-gram lookup (a draft model's lookup-first share, or all with --speculate ngram).",
            svc.lookup_draft_tokens,
        );
        counter(
            &mut o,
            "zerolayer_sampled_steps_total",
            "Sequence steps that emitted tokens (tokens per target step: generated tokens over this).",
            svc.sampled_steps,
        );
        o
    }
}

fn gauge(o: &mut String, name: &str, help: &str, v: f64) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

fn counter(o: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
}

/// Locks a mutex, recovering from poisoning (metrics stay usable after a panic elsewhere).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(Histogram::LATENCY_SECONDS);
        h.observe(0.003);
        h.observe(0.2);
        h.observe(1000.0);
        let mut s = String::new();
        render_histogram(&mut s, "x", "help", &h);
        assert!(s.contains("x_bucket{le=\"0.005\"} 1\n"));
        assert!(s.contains("x_bucket{le=\"0.25\"} 2\n"));
        assert!(s.contains("x_bucket{le=\"300\"} 2\n"));
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count 3\n"));
    }

    /// The speculation counters reach the exposition under their names, each its own value.
    #[test]
    fn speculation_counters_are_exported() {
        let mut svc = ServiceMetrics::default();
        svc.draft_tokens = 90;
        svc.accepted_draft_tokens = 70;
        svc.lookup_draft_tokens = 40;
        svc.sampled_steps = 33;
        let out = GatewayMetrics::new().render(&svc, true);
        for line in [
            "zerolayer_draft_tokens_total 90",
            "zerolayer_accepted_draft_tokens_total 70",
            "zerolayer_lookup_draft_tokens_total 40",
            "zerolayer_sampled_steps_total 33",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing:\n{out}");
        }
    }

    #[test]
    fn reuse_ratio_counts_requests_after_the_first() {
        let m = GatewayMetrics::new();
        m.connection_request(0);
        m.connection_request(1);
        m.connection_request(2);
        m.connection_request(0);
        assert_eq!(m.reuse_ratio(), 0.5);
    }
}
