//! What the gateway knows of one connection's activity, and the one decision taken from it:
//! keep the connection, or close it because it sat idle or never presented a valid key.
//!
//! The same policy holds on every transport (HTTP/1.1 and HTTP/2 in `tcp.rs`, HTTP/3 in
//! `h3.rs`): a request counts as open from its headers to the end (or drop) of its response
//! body, and only open requests keep a connection alive: HTTP/2 PINGs, SETTINGS, QUIC PINGs
//! and half-sent headers do not. On a gateway with API keys, a connection that has not sent
//! one valid key within `auth_timeout` of opening is closed whatever it does.
//!
//! [`ConnWatch::verdict`] takes the time as an argument and returns what to do (sans-IO); the
//! transports only sleep until the instant it names.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use claudelink_proto::ConnectionSlot;

/// Why a connection is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CloseReason {
    /// No request open for the idle timeout.
    Idle,
    /// No valid API key presented within the authentication timeout.
    Unauthenticated,
}

impl CloseReason {
    /// The reason as a short phrase (QUIC close reason, logs).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Unauthenticated => "unauthenticated",
        }
    }
}

/// What to do with a connection now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Keep it; ask again at this instant.
    KeepUntil(Instant),
    /// Close it (gracefully: open requests get a short grace to finish).
    Close(CloseReason),
}

/// The timeouts a [`ConnWatch`] applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WatchPolicy {
    /// Close after this long with no request open.
    pub(crate) idle: Duration,
    /// Close when no valid key arrived this long after opening (`None`: the gateway has no
    /// keys).
    pub(crate) auth: Option<Duration>,
}

#[derive(Debug)]
struct Activity {
    open: usize,
    /// When `open` last changed (or the connection opened).
    since: Instant,
}

/// One connection's requests and authentication, shared by its request tasks.
#[derive(Debug)]
pub(crate) struct ConnWatch {
    opened: Instant,
    policy: WatchPolicy,
    activity: std::sync::Mutex<Activity>,
    /// The connection's place in its listener's limits; `None` where no limits apply.
    slot: Option<ConnectionSlot>,
    /// Set once a valid key was seen (or from the start on a gateway without keys).
    authenticated: std::sync::atomic::AtomicBool,
}

impl ConnWatch {
    pub(crate) fn new(now: Instant, policy: WatchPolicy, slot: Option<ConnectionSlot>) -> Self {
        // The gateway's keys decide, not the listener's (an HTTP/3 connection's slot belongs
        // to the claudelink endpoint, which may be open while the gateway has keys, or the
        // reverse): a gateway without keys has nothing to wait for.
        let authenticated = policy.auth.is_none();
        if authenticated && let Some(s) = &slot {
            s.authenticated();
        }
        Self {
            opened: now,
            policy,
            activity: std::sync::Mutex::new(Activity {
                open: 0,
                since: now,
            }),
            slot,
            authenticated: std::sync::atomic::AtomicBool::new(authenticated),
        }
    }

    fn activity(&self) -> std::sync::MutexGuard<'_, Activity> {
        // Poisoning: the critical sections only add, subtract and copy; never panic.
        self.activity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts a request as open until the returned guard is dropped.
    pub(crate) fn request_started(self: &Arc<Self>) -> OpenRequest {
        let mut a = self.activity();
        a.open += 1;
        a.since = Instant::now();
        OpenRequest(self.clone())
    }

    /// Whether a valid key was seen (always on a gateway without keys).
    pub(crate) fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }

    /// Records that the peer presented a valid key: the connection leaves the unauthenticated
    /// budget and is no longer closed for want of one.
    pub(crate) fn authenticated(&self) {
        if !self.authenticated.swap(true, Ordering::AcqRel)
            && let Some(s) = &self.slot
        {
            s.authenticated();
        }
    }

    /// Resolves when the connection's slot was evicted from the keyless budget by a newer
    /// keyless connection (close it as unauthenticated); never without a slot.
    pub(crate) async fn evicted(&self) {
        match &self.slot {
            Some(s) => s.evicted().await,
            None => std::future::pending().await,
        }
    }

    /// Requests open now.
    pub(crate) fn open_requests(&self) -> usize {
        self.activity().open
    }

    /// Keep or close, at `now`.
    pub(crate) fn verdict(&self, now: Instant) -> Verdict {
        let (open, since) = {
            let a = self.activity();
            (a.open, a.since)
        };
        let mut next = now + self.policy.idle;
        if let Some(auth) = self.policy.auth
            && !self.is_authenticated()
        {
            let deadline = self.opened + auth;
            if now >= deadline {
                return Verdict::Close(CloseReason::Unauthenticated);
            }
            next = next.min(deadline);
        }
        if open == 0 {
            let deadline = since + self.policy.idle;
            if now >= deadline {
                return Verdict::Close(CloseReason::Idle);
            }
            next = next.min(deadline);
        }
        Verdict::KeepUntil(next)
    }
}

/// An open request of a [`ConnWatch`]'s connection; dropping it ends the request.
#[derive(Debug)]
pub(crate) struct OpenRequest(Arc<ConnWatch>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        let mut a = self.0.activity();
        a.open = a.open.saturating_sub(1);
        a.since = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn watch(auth: Option<Duration>) -> (Arc<ConnWatch>, Instant) {
        let now = Instant::now();
        let policy = WatchPolicy {
            idle: 10 * SEC,
            auth,
        };
        (Arc::new(ConnWatch::new(now, policy, None)), now)
    }

    #[test]
    fn an_idle_connection_closes_after_the_idle_timeout_and_an_open_request_keeps_it() {
        let (w, t0) = watch(None);
        assert!(w.is_authenticated(), "no keys: nothing to present");
        assert_eq!(w.verdict(t0), Verdict::KeepUntil(t0 + 10 * SEC));
        assert_eq!(w.verdict(t0 + 10 * SEC), Verdict::Close(CloseReason::Idle));
        let req = w.request_started();
        assert_eq!(w.open_requests(), 1);
        // A long stream is never idle, however long it runs.
        let later = Instant::now() + 3600 * SEC;
        assert!(matches!(w.verdict(later), Verdict::KeepUntil(_)));
        drop(req);
        let ended = Instant::now();
        assert!(
            matches!(w.verdict(ended + 9 * SEC), Verdict::KeepUntil(t) if t <= ended + 10 * SEC + SEC)
        );
        assert_eq!(
            w.verdict(ended + 11 * SEC),
            Verdict::Close(CloseReason::Idle)
        );
    }

    #[test]
    fn a_connection_without_a_valid_key_closes_at_the_auth_timeout_even_with_requests_open() {
        let (w, t0) = watch(Some(5 * SEC));
        assert!(!w.is_authenticated());
        let _req = w.request_started();
        assert_eq!(w.verdict(t0 + SEC), Verdict::KeepUntil(t0 + 5 * SEC));
        assert_eq!(
            w.verdict(t0 + 5 * SEC),
            Verdict::Close(CloseReason::Unauthenticated)
        );
        // Once a key was seen, only idleness closes it.
        let (w, t0) = watch(Some(5 * SEC));
        w.authenticated();
        assert!(w.is_authenticated());
        assert_eq!(w.verdict(t0 + 6 * SEC), Verdict::KeepUntil(t0 + 10 * SEC));
    }
}
