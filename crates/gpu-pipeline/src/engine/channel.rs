//! The per-request event channel: a small queue with a condvar for threads and a waker for
//! async code, plus the cancellation flag the engine checks at every step boundary.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use zerolayer_api::InferenceEvent;

use super::{SeqId, Shared};

#[derive(Default)]
struct Queue {
    events: VecDeque<InferenceEvent>,
    closed: bool,
    waker: Option<Waker>,
}

/// The engine's end of a request channel.
#[derive(Default)]
pub(crate) struct Chan {
    q: Mutex<Queue>,
    ready: Condvar,
    cancelled: AtomicBool,
}

impl Chan {
    pub(crate) fn send(&self, ev: InferenceEvent) {
        let waker = {
            let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
            if q.closed {
                return;
            }
            let last = matches!(
                ev,
                InferenceEvent::Finished { .. } | InferenceEvent::Error { .. }
            );
            q.events.push_back(ev);
            q.closed |= last;
            q.waker.take()
        };
        self.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}

/// A submitted request: yields its [`InferenceEvent`]s in order (`Started`, a `Delta` per token,
/// then one of `Finished` / `Error`: see the [module](super) overview). Dropping it (or [`cancel`](Self::cancel)) stops the request; its KV
/// ring is freed before the engine's next step.
///
/// Usable from threads ([`recv`](Self::recv), [`recv_timeout`](Self::recv_timeout)) and from
/// async code ([`poll_recv`](Self::poll_recv), e.g. through `futures::stream::poll_fn`).
pub struct RequestHandle {
    pub(crate) id: SeqId,
    pub(crate) chan: Arc<Chan>,
    pub(crate) shared: Arc<Shared>,
    /// When [`Engine::submit`](super::Engine::submit) accepted it.
    pub(crate) submitted: Instant,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RequestHandle {
    /// The request's id inside the engine.
    pub fn id(&self) -> SeqId {
        self.id
    }

    /// The next event, if one is ready; `None` also after the last event.
    pub fn try_recv(&self) -> Option<InferenceEvent> {
        self.chan
            .q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .events
            .pop_front()
    }

    /// Blocks for the next event; `None` after the last one.
    pub fn recv(&self) -> Option<InferenceEvent> {
        let mut q = self.chan.q.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(ev) = q.events.pop_front() {
                return Some(ev);
            }
            if q.closed {
                return None;
            }
            q = self.chan.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Like [`recv`](Self::recv) with a deadline; `None` on timeout or after the last event.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<InferenceEvent> {
        let deadline = Instant::now() + timeout;
        let mut q = self.chan.q.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(ev) = q.events.pop_front() {
                return Some(ev);
            }
            let now = Instant::now();
            if q.closed || now >= deadline {
                return None;
            }
            q = self
                .chan
                .ready
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Async receive: `Ready(Some(ev))`, `Ready(None)` after the last event, or `Pending` (the
    /// task is woken when an event arrives).
    pub fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<InferenceEvent>> {
        let mut q = self.chan.q.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ev) = q.events.pop_front() {
            return Poll::Ready(Some(ev));
        }
        if q.closed {
            return Poll::Ready(None);
        }
        q.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Stops the request now (same as dropping the handle).
    pub fn cancel(&self) {
        if !self.chan.cancelled.swap(true, Ordering::AcqRel) {
            self.shared.cancel(self.id);
        }
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        let done = self.chan.q.lock().unwrap_or_else(|e| e.into_inner()).closed;
        if !done {
            self.cancel();
        }
    }
}
