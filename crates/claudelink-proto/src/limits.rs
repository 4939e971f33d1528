//! Connection limits of a listener (the gateway's TCP listener, the QUIC endpoint): at most
//! `max_connections` open connections in all and `max_connections_per_ip` from one client
//! address (IPv4-mapped IPv6 addresses count as their IPv4 address). A sans-IO count
//! ([`ConnectionCounts`]) behind a mutex, and a guard that gives its connection back when dropped.
//!
//! On a listener that requires API keys, a connection counts as *unauthenticated* until it
//! presents a valid key, and unauthenticated connections have a smaller budget: a quarter of the
//! per-address limit and half of the listener's (rounded up). Connections that never present a
//! key (idle ones, scanners, an attacker without a key) cannot take more than that, so the rest
//! stays free for clients that have a key; the transports also close a connection that has not
//! authenticated within a few seconds.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

/// Why a new connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectionRefused {
    /// The listener has `max_connections` open.
    #[error("{limit} connections open on this listener")]
    Listener {
        /// The configured limit.
        limit: usize,
    },
    /// This address has `max_connections_per_ip` open.
    #[error("{limit} connections open from this address")]
    PerIp {
        /// The configured limit.
        limit: usize,
    },
    /// The unauthenticated budget (of the listener or of this address) is used up.
    #[error("{limit} connections without a valid key open")]
    Unauthenticated {
        /// The budget that is full.
        limit: usize,
    },
}

/// Connections of one address.
#[derive(Debug, Default, Clone, Copy)]
struct PerIp {
    open: usize,
    unauthenticated: usize,
}

/// Open connections in all and per address (0 as a limit: none).
#[derive(Debug, Default)]
pub(crate) struct ConnectionCounts {
    max_total: usize,
    max_per_ip: usize,
    total: usize,
    unauthenticated: usize,
    per_ip: HashMap<IpAddr, PerIp>,
}

impl ConnectionCounts {
    pub(crate) fn new(max_total: usize, max_per_ip: usize) -> Self {
        Self {
            max_total,
            max_per_ip,
            ..Self::default()
        }
    }

    /// The unauthenticated budgets: (listener, per address); 0: none.
    fn unauthenticated_limits(&self) -> (usize, usize) {
        (self.max_total.div_ceil(2), self.max_per_ip.div_ceil(4))
    }

    /// Whether half of the total or of `ip`'s limit is in use (the QUIC endpoint then asks new
    /// clients to validate their address first).
    pub(crate) fn under_pressure(&self, ip: IpAddr) -> bool {
        let n = self.per_ip.get(&ip.to_canonical()).map_or(0, |p| p.open);
        (self.max_total > 0 && self.total >= self.max_total.div_ceil(2))
            || (self.max_per_ip > 0 && n >= self.max_per_ip.div_ceil(2))
    }

    /// Counts a new connection from `ip`, or says why it is refused (nothing is counted then).
    /// `authenticated`: whether it needs no key (an open listener); otherwise it is counted
    /// against the unauthenticated budget until [`ConnectionCounts::authenticate`].
    pub(crate) fn open(
        &mut self,
        ip: IpAddr,
        authenticated: bool,
    ) -> Result<(), ConnectionRefused> {
        let ip = ip.to_canonical();
        if self.max_total > 0 && self.total >= self.max_total {
            return Err(ConnectionRefused::Listener {
                limit: self.max_total,
            });
        }
        let (unauth_total, unauth_per_ip) = self.unauthenticated_limits();
        let n = self.per_ip.get(&ip).copied().unwrap_or_default();
        if self.max_per_ip > 0 && n.open >= self.max_per_ip {
            return Err(ConnectionRefused::PerIp {
                limit: self.max_per_ip,
            });
        }
        if !authenticated {
            if unauth_total > 0 && self.unauthenticated >= unauth_total {
                return Err(ConnectionRefused::Unauthenticated {
                    limit: unauth_total,
                });
            }
            if unauth_per_ip > 0 && n.unauthenticated >= unauth_per_ip {
                return Err(ConnectionRefused::Unauthenticated {
                    limit: unauth_per_ip,
                });
            }
        }
        let entry = self.per_ip.entry(ip).or_default();
        entry.open += 1;
        self.total += 1;
        if !authenticated {
            entry.unauthenticated += 1;
            self.unauthenticated += 1;
        }
        Ok(())
    }

    /// Moves a connection from `ip` counted as unauthenticated out of that budget.
    pub(crate) fn authenticate(&mut self, ip: IpAddr) {
        if let Some(p) = self.per_ip.get_mut(&ip.to_canonical())
            && p.unauthenticated > 0
        {
            p.unauthenticated -= 1;
            self.unauthenticated -= 1;
        }
    }

    /// Forgets a connection counted by [`ConnectionCounts::open`] (`authenticated`: whether it
    /// had left the unauthenticated budget).
    pub(crate) fn close(&mut self, ip: IpAddr, authenticated: bool) {
        let ip = ip.to_canonical();
        if let Some(p) = self.per_ip.get_mut(&ip) {
            p.open -= 1;
            self.total -= 1;
            if !authenticated && p.unauthenticated > 0 {
                p.unauthenticated -= 1;
                self.unauthenticated -= 1;
            }
            if p.open == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }

    /// Connections open.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Connections open that have not authenticated.
    #[cfg(test)]
    pub(crate) fn unauthenticated(&self) -> usize {
        self.unauthenticated
    }
}

/// The connection limits of one listener: the counts of open connections, shared by them, and
/// its keyless connections in the order they came (the oldest is closed first when the keyless
/// budget is full). The claudelink [`Server`](crate::Server) keeps one for its UDP endpoint; an
/// HTTP gateway keeps one per TCP listener. Clones share the counts.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use claudelink_proto::{ConnectionLimits, ConnectionRefused};
/// let limits = ConnectionLimits::new(2, 1);
/// let ip = "10.0.0.1".parse().unwrap();
/// let slot = limits.admit(ip, false).unwrap();
/// assert_eq!(limits.admit(ip, false).unwrap_err(), ConnectionRefused::PerIp { limit: 1 });
/// drop(slot);
/// assert_eq!(limits.open_connections(), 0);
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    shared: Arc<Mutex<Shared>>,
}

#[derive(Debug)]
struct Shared {
    counts: ConnectionCounts,
    /// Slots still in the unauthenticated budget (some may have left it or ended), oldest first.
    keyless: VecDeque<Weak<SlotInner>>,
}

impl ConnectionLimits {
    /// Limits of `max_total` connections in all and `max_per_ip` from one client address (0:
    /// no limit).
    pub fn new(max_total: usize, max_per_ip: usize) -> Self {
        Self {
            shared: Arc::new(Mutex::new(Shared {
                counts: ConnectionCounts::new(max_total, max_per_ip),
                keyless: VecDeque::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // Poisoning: every method leaves the counts consistent before it could panic (none
        // does), so a poisoned lock still holds valid counts.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a connection from `ip`; it is counted until the slot (and its clones) is dropped.
    /// `requires_key`: whether the listener has API keys (the connection then starts in the
    /// unauthenticated budget). When that budget is full, the oldest keyless connection of
    /// the same address (else of any) is evicted to make room ([`ConnectionSlot::evicted`]):
    /// a client with a key is never refused because keyless ones hold the budget, it only has
    /// to present its key before newer keyless connections push it out.
    pub fn admit(
        &self,
        ip: IpAddr,
        requires_key: bool,
    ) -> Result<ConnectionSlot, ConnectionRefused> {
        let mut g = self.lock();
        match g.counts.open(ip, !requires_key) {
            Ok(()) => {}
            Err(ConnectionRefused::Unauthenticated { limit }) => {
                if !g.evict_oldest_keyless(ip) {
                    return Err(ConnectionRefused::Unauthenticated { limit });
                }
                g.counts.open(ip, !requires_key)?;
            }
            Err(e) => return Err(e),
        }
        let slot = Arc::new(SlotInner {
            limits: self.clone(),
            ip,
            authenticated: AtomicBool::new(!requires_key),
            in_budget: AtomicBool::new(requires_key),
            evicted: AtomicBool::new(false),
            notify: tokio::sync::Notify::new(),
        });
        if requires_key {
            g.keyless.push_back(Arc::downgrade(&slot));
        }
        Ok(ConnectionSlot(slot))
    }

    /// Whether `ip`, or the listener, holds half or more of its limit (the claudelink server
    /// then asks new peers to prove their address with a QUIC Retry).
    pub fn under_pressure(&self, ip: IpAddr) -> bool {
        self.lock().counts.under_pressure(ip)
    }

    /// Connections open.
    pub fn open_connections(&self) -> usize {
        self.lock().counts.total()
    }
}

impl Shared {
    /// Evicts the oldest connection still in the unauthenticated budget from `ip`, else the
    /// oldest from any address; whether there was one.
    fn evict_oldest_keyless(&mut self, ip: IpAddr) -> bool {
        // A slot that is authenticating (its flag set, the lock not yet taken) is spared.
        self.keyless.retain(|w| {
            w.upgrade().is_some_and(|s| {
                s.in_budget.load(Ordering::Acquire) && !s.authenticated.load(Ordering::Acquire)
            })
        });
        let ip = ip.to_canonical();
        let pick = self
            .keyless
            .iter()
            .position(|w| w.upgrade().is_some_and(|s| s.ip.to_canonical() == ip))
            .or(if self.keyless.is_empty() {
                None
            } else {
                Some(0)
            });
        let Some(victim) = pick
            .and_then(|i| self.keyless.remove(i))
            .and_then(|w| w.upgrade())
        else {
            return false;
        };
        if victim.in_budget.swap(false, Ordering::AcqRel) {
            self.counts.authenticate(victim.ip);
        }
        victim.evicted.store(true, Ordering::Release);
        victim.notify.notify_one();
        true
    }
}

/// An admitted connection's place in its listener's connection limits, held until the
/// connection ends (clones share it). A connection of a listener with API keys starts in the
/// smaller unauthenticated budget; [`ConnectionSlot::authenticated`] moves it out once the
/// peer has presented a valid key. While it is in that budget, newer keyless connections may
/// evict it ([`ConnectionSlot::evicted`]): its transport then closes it.
///
/// Handed to a [`ConnectionHandler`](crate::ConnectionHandler) by the claudelink server for
/// connections of other ALPN protocols (HTTP/3).
#[derive(Debug, Clone)]
pub struct ConnectionSlot(Arc<SlotInner>);

#[derive(Debug)]
struct SlotInner {
    limits: ConnectionLimits,
    ip: IpAddr,
    authenticated: AtomicBool,
    /// Counted in the unauthenticated budget (until it authenticates or is evicted).
    in_budget: AtomicBool,
    evicted: AtomicBool,
    notify: tokio::sync::Notify,
}

impl ConnectionSlot {
    /// Records that the peer presented a valid API key (idempotent).
    pub fn authenticated(&self) {
        if !self.0.authenticated.swap(true, Ordering::AcqRel) {
            let mut g = self.0.limits.lock();
            if self.0.in_budget.swap(false, Ordering::AcqRel) {
                g.counts.authenticate(self.0.ip);
            }
        }
    }

    /// Whether the peer has presented a valid key (always true on a listener without keys).
    pub fn is_authenticated(&self) -> bool {
        self.0.authenticated.load(Ordering::Acquire)
    }

    /// Whether a newer keyless connection took this one's place in the unauthenticated budget:
    /// close the connection.
    pub fn is_evicted(&self) -> bool {
        self.0.evicted.load(Ordering::Acquire)
    }

    /// Resolves once the connection is evicted (see [`ConnectionSlot::is_evicted`]); never for
    /// a connection that authenticated first.
    pub async fn evicted(&self) {
        while !self.is_evicted() {
            self.0.notify.notified().await;
        }
    }
}

impl Drop for SlotInner {
    fn drop(&mut self) {
        let left_budget = !*self.in_budget.get_mut();
        self.limits.lock().counts.close(self.ip, left_budget);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_ip_limit_refuses_the_next_connection_until_one_closes() {
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        let mut c = ConnectionCounts::new(3, 2);
        assert_eq!(c.open(a, true), Ok(()));
        assert_eq!(c.open(a, true), Ok(()));
        assert_eq!(c.open(a, true), Err(ConnectionRefused::PerIp { limit: 2 }));
        assert_eq!(c.open(b, true), Ok(()));
        assert_eq!(
            c.open(b, true),
            Err(ConnectionRefused::Listener { limit: 3 })
        );
        c.close(a, true);
        assert_eq!(c.open(b, true), Ok(()));
        assert_eq!(c.total(), 3);
        c.close(a, true);
        c.close(b, true);
        c.close(b, true);
        assert_eq!(c.total(), 0);
        assert!(c.per_ip.is_empty(), "no entry left for closed addresses");
        c.close(a, true); // closing an unknown address changes nothing
        assert_eq!(c.total(), 0);
    }

    #[test]
    fn zero_means_no_limit() {
        let mut c = ConnectionCounts::new(0, 0);
        for i in 0..10_000 {
            c.open([127, 0, 0, 1].into(), i % 2 == 0).unwrap();
        }
        assert_eq!(c.total(), 10_000);
    }

    #[test]
    fn keyless_connections_leave_room_for_clients_with_a_key() {
        // The issue-47 case: 40 in all, 10 per address.
        let mut c = ConnectionCounts::new(40, 10);
        let attacker = |i: u8| IpAddr::from([127, 0, 0, i]);
        // Each attacking address holds at most a quarter of its limit without a key...
        for i in 1..=4 {
            for _ in 0..3 {
                assert_eq!(c.open(attacker(i), false), Ok(()));
            }
            assert_eq!(
                c.open(attacker(i), false),
                Err(ConnectionRefused::Unauthenticated { limit: 3 })
            );
        }
        // ...and all of them half of the listener's.
        for i in 5..=6 {
            for _ in 0..3 {
                c.open(attacker(i), false).unwrap();
            }
        }
        c.open(attacker(7), false).unwrap();
        c.open(attacker(7), false).unwrap();
        assert_eq!(c.unauthenticated(), 20);
        assert_eq!(
            c.open(attacker(7), false),
            Err(ConnectionRefused::Unauthenticated { limit: 20 })
        );
        // A client with a key (or any client once it authenticated) still gets in, even from
        // an attacking address.
        let honest: IpAddr = [127, 0, 0, 100].into();
        assert_eq!(c.open(honest, true), Ok(()));
        assert_eq!(c.open(attacker(1), true), Ok(()));
        // Authenticating moves a connection out of the budget, making room for one more.
        c.authenticate(attacker(1));
        assert_eq!(c.open(attacker(1), false), Ok(()));
        // Closing an authenticated connection does not touch the unauthenticated count.
        let before = c.unauthenticated();
        c.close(attacker(1), true);
        assert_eq!(c.unauthenticated(), before);
        c.close(attacker(1), false);
        assert_eq!(c.unauthenticated(), before - 1);
    }

    #[test]
    fn a_slot_gives_its_place_back_and_authenticates_once() {
        let limits = ConnectionLimits::new(0, 4);
        let ip: IpAddr = [10, 0, 0, 7].into();
        let slot = limits.admit(ip, true).unwrap();
        assert!(!slot.is_authenticated());
        let clone = slot.clone();
        assert_eq!(limits.lock().counts.unauthenticated(), 1);
        clone.authenticated();
        slot.authenticated();
        assert!(slot.is_authenticated());
        assert_eq!(limits.lock().counts.unauthenticated(), 0);
        assert_eq!(limits.open_connections(), 1);
        drop(slot);
        assert_eq!(limits.open_connections(), 1, "a clone still holds it");
        drop(clone);
        assert_eq!(limits.open_connections(), 0);
        // An open listener's connections never enter the budget.
        let open = limits.admit(ip, false).unwrap();
        assert!(open.is_authenticated());
        assert_eq!(limits.lock().counts.unauthenticated(), 0);
        drop(open);
        let unauth = limits.admit(ip, true).unwrap();
        drop(unauth);
        assert_eq!(limits.lock().counts.unauthenticated(), 0);
        assert!(limits.lock().counts.per_ip.is_empty());
    }

    #[test]
    fn a_full_keyless_budget_evicts_the_oldest_keyless_connection_of_the_address() {
        // A quarter of 8 per address: 2 keyless connections.
        let limits = ConnectionLimits::new(0, 8);
        let (a, b): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        let first = limits.admit(a, true).unwrap();
        let second = limits.admit(a, true).unwrap();
        let other = limits.admit(b, true).unwrap();
        // The third from `a` takes the place of `a`'s oldest, not of `b`'s.
        let third = limits.admit(a, true).unwrap();
        assert!(first.is_evicted() && !second.is_evicted() && !other.is_evicted());
        assert!(!third.is_evicted());
        let evicted = first.clone();
        futures::executor::block_on(evicted.evicted());
        // It is still open (its transport closes it) but out of the budget.
        assert_eq!(limits.open_connections(), 4);
        assert_eq!(limits.lock().counts.unauthenticated(), 3);
        drop((first, evicted));
        assert_eq!(limits.open_connections(), 3);
        assert_eq!(limits.lock().counts.unauthenticated(), 3);
        // A connection that authenticated is never evicted: `second` shows a key, then two
        // more keyless ones come; `third` goes, `second` stays.
        second.authenticated();
        let fourth = limits.admit(a, true).unwrap();
        assert!(!third.is_evicted());
        let _fifth = limits.admit(a, true).unwrap();
        assert!(third.is_evicted() && !second.is_evicted() && !fourth.is_evicted());
        // Everything given back.
        drop((second, third, fourth, _fifth, other));
        assert_eq!(limits.open_connections(), 0);
        assert_eq!(limits.lock().counts.unauthenticated(), 0);
        assert!(limits.lock().counts.per_ip.is_empty());
    }

    #[test]
    fn mapped_ipv6_counts_as_its_ipv4_and_pressure_starts_at_half_a_limit() {
        let v4: IpAddr = [10, 0, 0, 1].into();
        let mapped: IpAddr = std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped().into();
        let mut c = ConnectionCounts::new(0, 4);
        assert!(!c.under_pressure(v4));
        assert_eq!(c.open(v4, true), Ok(()));
        assert!(!c.under_pressure(mapped));
        assert_eq!(c.open(mapped, true), Ok(()));
        assert!(c.under_pressure(v4), "2 of 4 from one address");
        assert_eq!(c.open(v4, true), Ok(()));
        assert_eq!(c.open(mapped, true), Ok(()));
        assert_eq!(c.open(v4, true), Err(ConnectionRefused::PerIp { limit: 4 }));
        c.close(mapped, true);
        assert_eq!(c.total(), 3);
        assert!(
            ConnectionCounts::new(0, 0).open(v4, false).is_ok(),
            "0: no limit"
        );
    }
}
