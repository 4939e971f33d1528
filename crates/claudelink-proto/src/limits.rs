//! Connection limits of a listener (the gateway's TCP listener, the QUIC endpoint): at most
//! `max_connections` open connections in all and `max_connections_per_ip` from one client
//! address (IPv4-mapped IPv6 addresses count as their IPv4 address). A sans-IO count
//! ([`ConnectionCounts`]) behind a mutex, and a guard that gives its connection back when dropped.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Why a new connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
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
}

/// Open connections in all and per address (0 as a limit: none).
#[derive(Debug, Default)]
pub(crate) struct ConnectionCounts {
    max_total: usize,
    max_per_ip: usize,
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

impl ConnectionCounts {
    pub(crate) fn new(max_total: usize, max_per_ip: usize) -> Self {
        Self {
            max_total,
            max_per_ip,
            ..Self::default()
        }
    }

    /// Whether half of the total or of `ip`'s limit is in use (the QUIC endpoint then asks new
    /// clients to validate their address first).
    pub(crate) fn under_pressure(&self, ip: IpAddr) -> bool {
        let n = self.per_ip.get(&ip.to_canonical()).copied().unwrap_or(0);
        (self.max_total > 0 && self.total >= self.max_total.div_ceil(2))
            || (self.max_per_ip > 0 && n >= self.max_per_ip.div_ceil(2))
    }

    /// Counts a new connection from `ip`, or says why it is refused (nothing is counted then).
    pub(crate) fn open(&mut self, ip: IpAddr) -> Result<(), Refused> {
        let ip = ip.to_canonical();
        if self.max_total > 0 && self.total >= self.max_total {
            return Err(Refused::Listener {
                limit: self.max_total,
            });
        }
        let n = self.per_ip.entry(ip).or_insert(0);
        if self.max_per_ip > 0 && *n >= self.max_per_ip {
            return Err(Refused::PerIp {
                limit: self.max_per_ip,
            });
        }
        *n += 1;
        self.total += 1;
        Ok(())
    }

    /// Forgets a connection counted by [`ConnectionCounts::open`].
    pub(crate) fn close(&mut self, ip: IpAddr) {
        if let Some(n) = self.per_ip.get_mut(&ip.to_canonical()) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip.to_canonical());
            }
        }
    }

    /// Connections open.
    pub(crate) fn total(&self) -> usize {
        self.total
    }
}

/// [`ConnectionCounts`] shared by a listener's connections.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionLimits {
    counts: Arc<Mutex<ConnectionCounts>>,
}

impl ConnectionLimits {
    pub(crate) fn new(max_total: usize, max_per_ip: usize) -> Self {
        Self {
            counts: Arc::new(Mutex::new(ConnectionCounts::new(max_total, max_per_ip))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ConnectionCounts> {
        // Poisoning: every method leaves the counts consistent before it could panic (none
        // does), so a poisoned lock still holds valid counts.
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a connection from `ip`; it is counted until the guard is dropped.
    pub(crate) fn admit(&self, ip: IpAddr) -> Result<ConnectionGuard, Refused> {
        self.lock().open(ip)?;
        Ok(ConnectionGuard {
            limits: self.clone(),
            ip,
        })
    }

    /// See [`ConnectionCounts::under_pressure`].
    pub(crate) fn under_pressure(&self, ip: IpAddr) -> bool {
        self.lock().under_pressure(ip)
    }

    /// Connections open.
    pub(crate) fn open_connections(&self) -> usize {
        self.lock().total()
    }
}

/// One admitted connection.
#[derive(Debug)]
pub(crate) struct ConnectionGuard {
    limits: ConnectionLimits,
    ip: IpAddr,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.limits.lock().close(self.ip);
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
        assert_eq!(c.open(a), Ok(()));
        assert_eq!(c.open(a), Ok(()));
        assert_eq!(c.open(a), Err(Refused::PerIp { limit: 2 }));
        assert_eq!(c.open(b), Ok(()));
        assert_eq!(c.open(b), Err(Refused::Listener { limit: 3 }));
        c.close(a);
        assert_eq!(c.open(b), Ok(()));
        assert_eq!(c.total(), 3);
        c.close(a);
        c.close(b);
        c.close(b);
        assert_eq!(c.total(), 0);
        assert!(c.per_ip.is_empty(), "no entry left for closed addresses");
        c.close(a); // closing an unknown address changes nothing
        assert_eq!(c.total(), 0);
    }

    #[test]
    fn zero_means_no_limit() {
        let mut c = ConnectionCounts::new(0, 0);
        for _ in 0..10_000 {
            c.open([127, 0, 0, 1].into()).unwrap();
        }
        assert_eq!(c.total(), 10_000);
    }

    #[test]
    fn mapped_ipv6_counts_as_its_ipv4_and_pressure_starts_at_half_a_limit() {
        let v4: IpAddr = [10, 0, 0, 1].into();
        let mapped: IpAddr = std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped().into();
        let mut c = ConnectionCounts::new(0, 4);
        assert!(!c.under_pressure(v4));
        assert_eq!(c.open(v4), Ok(()));
        assert!(!c.under_pressure(mapped));
        assert_eq!(c.open(mapped), Ok(()));
        assert!(c.under_pressure(v4), "2 of 4 from one address");
        assert_eq!(c.open(v4), Ok(()));
        assert_eq!(c.open(mapped), Ok(()));
        assert_eq!(c.open(v4), Err(Refused::PerIp { limit: 4 }));
        c.close(mapped);
        assert_eq!(c.total(), 3);
        assert!(ConnectionCounts::new(0, 0).open(v4).is_ok(), "0: no limit");
    }
}
