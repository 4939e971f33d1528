//! The access log: one `tracing` event per request (target `zerolayer_gateway::access`, message
//! `request`), written when the request is over: its reply sent, or its stream ended or dropped.
//!
//! Fields: `request_id`, `route`, `protocol`, `status`, and for generations `tokens_in`,
//! `tokens_out`, `ttft_ms` (when a token came), `outcome`; always `duration_ms`. The prompt and
//! the answer are never logged.
//!
//! Everything that takes part in a request holds the same [`AccessRecord`]; the line is written
//! when the last holder lets go (its `Drop`), so a stream the client abandons is logged too.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::metrics::{Endpoint, Outcome, Protocol};

/// What the access line of one request says, filled in as the request goes.
#[derive(Debug)]
pub(crate) struct AccessRecord {
    request_id: String,
    endpoint: Endpoint,
    protocol: Protocol,
    received: Instant,
    status: AtomicU16,
    tokens_in: AtomicU32,
    tokens_out: AtomicU32,
    ttft: OnceLock<Duration>,
    outcome: OnceLock<Outcome>,
}

impl AccessRecord {
    pub(crate) fn new(
        request_id: String,
        endpoint: Endpoint,
        protocol: Protocol,
        received: Instant,
    ) -> Self {
        Self {
            request_id,
            endpoint,
            protocol,
            received,
            status: AtomicU16::new(0),
            tokens_in: AtomicU32::new(0),
            tokens_out: AtomicU32::new(0),
            ttft: OnceLock::new(),
            outcome: OnceLock::new(),
        }
    }

    pub(crate) fn request_id(&self) -> &str {
        &self.request_id
    }

    pub(crate) fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    pub(crate) fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The HTTP status the reply went out with.
    pub(crate) fn set_status(&self, status: u16) {
        self.status.store(status, Ordering::Relaxed);
    }

    /// A generation's end: its token counts, time to first token and outcome (the first call
    /// wins for the last two).
    pub(crate) fn generation(
        &self,
        tokens_in: u32,
        tokens_out: u32,
        ttft: Option<Duration>,
        outcome: Outcome,
    ) {
        self.tokens_in.store(tokens_in, Ordering::Relaxed);
        // `n` > 1 choices share one record: their output tokens add up.
        self.tokens_out.fetch_add(tokens_out, Ordering::Relaxed);
        if let Some(t) = ttft {
            let _ = self.ttft.set(t);
        }
        let _ = self.outcome.set(outcome);
    }
}

impl Drop for AccessRecord {
    fn drop(&mut self) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (id, route, protocol) = (
            self.request_id.as_str(),
            self.endpoint.as_str(),
            self.protocol.as_str(),
        );
        let status = *self.status.get_mut();
        let duration_ms = ms(self.received.elapsed());
        let Some(outcome) = self.outcome.get() else {
            tracing::info!(target: "zerolayer_gateway::access", request_id = id, route, protocol,
                status, duration_ms, "request");
            return;
        };
        let (tokens_in, tokens_out) = (*self.tokens_in.get_mut(), *self.tokens_out.get_mut());
        let outcome = outcome.as_str();
        match self.ttft.get().copied().map(ms) {
            Some(ttft_ms) => tracing::info!(target: "zerolayer_gateway::access", request_id = id,
                route, protocol, status, tokens_in, tokens_out, ttft_ms, duration_ms, outcome,
                "request"),
            None => tracing::info!(target: "zerolayer_gateway::access", request_id = id, route,
                protocol, status, tokens_in, tokens_out, duration_ms, outcome, "request"),
        }
    }
}
