//! The connection pool: claudelink connections to one server or to a set of replicas.
//!
//! Policy. The replicas come from a fixed address list or a DNS name re-resolved every
//! `resolve_interval` (a Kubernetes headless Service gives one record per ready pod). A new
//! request goes to the usable replica with the fewest outstanding streams, and there to its
//! least-loaded connection (a new one when all are at `target_streams_per_connection`, up to
//! `max_connections` per replica). A connection that sent GOAWAY leaves the pool at once (its
//! open streams finish; they no longer count as the replica's load) and the health checker
//! opens a replacement; a draining server refuses it, which backs the replica off. A replica is
//! unusable while it is backed off after a failure (connect error, connection lost: 1 s,
//! doubling up to `max_replica_backoff`, 4 s; reset by the next success). The back-off is the
//! replica's, not its streams': the many streams one crash ends back it off once, and only a
//! failure after the back-off has run out (a failed probe) doubles it. When it runs out the
//! health checker probes the replica at once (it opens a connection), so a restarted replica
//! is back in rotation within the back-off cap plus a handshake. A request that fails before
//! its first token (connection lost, stream reset, refused, 0-RTT rejected, or an ERROR
//! `overloaded` / `shutting_down` / `unavailable` event) is sent again to another replica, at
//! most `retries` times; after its first token a failure is the stream's error (never a hang:
//! a dead replica's connections time out within `ClientConfig::connection_ttl`, 1 s by
//! default).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::{Future, Stream};

use crate::client::{Client, ClientError, Connection, RequestError, ResponseStream, StreamError};
use crate::codec::AppErrorCode;
use zerolayer_api::{ErrorCode, InferenceEvent, InferenceRequest};

/// Where a pool's servers are.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Replicas {
    /// Fixed addresses.
    Addrs(Vec<SocketAddr>),
    /// `host:port`, resolved at start and every [`PoolConfig::resolve_interval`]; every
    /// address it resolves to (A and AAAA records alike) is a replica.
    Dns(String),
    /// Asked at start and every [`PoolConfig::resolve_interval`], like a DNS name: service
    /// discovery of your own (a resolver with its own cache rules, a registry client).
    Resolver(Arc<dyn ReplicaResolver>),
}

/// The replica addresses of a [`Replicas::Resolver`].
///
/// ```
/// use std::future::Future;
/// use std::net::SocketAddr;
/// use std::pin::Pin;
/// use claudelink_proto::ReplicaResolver;
///
/// #[derive(Debug)]
/// struct Fixed(Vec<SocketAddr>);
///
/// impl ReplicaResolver for Fixed {
///     fn resolve(&self) -> Pin<Box<dyn Future<Output = Result<Vec<SocketAddr>, String>> + Send + '_>> {
///         Box::pin(async move { Ok(self.0.clone()) })
///     }
/// }
/// ```
pub trait ReplicaResolver: Send + Sync + std::fmt::Debug + 'static {
    /// The replicas now: every address is one. An error or an empty list keeps the pool's
    /// last set (at start, an error fails [`Pool::connect_replicas`]).
    fn resolve(&self)
    -> Pin<Box<dyn Future<Output = Result<Vec<SocketAddr>, String>> + Send + '_>>;
}

/// Pool settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Connections kept open to each replica (5).
    pub min_connections: usize,
    /// Most connections to each replica (50).
    pub max_connections: usize,
    /// Streams per connection before a new connection is opened (100).
    pub target_streams_per_connection: usize,
    /// How often idle connections are health-checked with a PING and missing connections
    /// reopened (2 s; a backed-off replica is also probed as soon as its back-off ends).
    pub health_check_interval: Duration,
    /// How often a [`Replicas::Dns`] name (or a [`Replicas::Resolver`]) is resolved again
    /// (30 s).
    pub resolve_interval: Duration,
    /// First back-off of a failed replica; doubles per failure after the previous back-off
    /// ran out, up to [`max_replica_backoff`](Self::max_replica_backoff) (1 s).
    pub replica_backoff: Duration,
    /// Longest back-off of a replica that keeps failing (4 s): a restarted replica is back in
    /// rotation at most this long (plus a handshake) after it can accept connections.
    pub max_replica_backoff: Duration,
    /// How many times a request that failed before its first token is sent again (3).
    pub retries: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            min_connections: 5,
            max_connections: 50,
            target_streams_per_connection: 100,
            health_check_interval: Duration::from_secs(2),
            resolve_interval: Duration::from_secs(30),
            replica_backoff: Duration::from_secs(1),
            max_replica_backoff: Duration::from_secs(4),
            retries: 3,
        }
    }
}

impl PoolConfig {
    /// Sets the connection bounds (per replica).
    pub fn connections(mut self, min: usize, max: usize) -> Self {
        self.min_connections = min;
        self.max_connections = max.max(min).max(1);
        self
    }

    /// Sets the health-check interval.
    pub fn health_check_interval(mut self, every: Duration) -> Self {
        self.health_check_interval = every;
        self
    }

    /// Sets the streams per connection before another is opened.
    pub fn target_streams_per_connection(mut self, n: usize) -> Self {
        self.target_streams_per_connection = n.max(1);
        self
    }

    /// Sets how often a DNS name is resolved again.
    pub fn resolve_interval(mut self, every: Duration) -> Self {
        self.resolve_interval = every.max(Duration::from_millis(100));
        self
    }

    /// Sets the first back-off of a failed replica.
    pub fn replica_backoff(mut self, first: Duration) -> Self {
        self.replica_backoff = first;
        self
    }

    /// Sets the longest back-off of a replica that keeps failing.
    ///
    /// ```
    /// use std::time::Duration;
    /// use claudelink_proto::PoolConfig;
    /// let cfg = PoolConfig::default().max_replica_backoff(Duration::from_secs(8));
    /// assert_eq!(cfg.max_replica_backoff, Duration::from_secs(8));
    /// assert_eq!(PoolConfig::default().max_replica_backoff, Duration::from_secs(4));
    /// ```
    pub fn max_replica_backoff(mut self, longest: Duration) -> Self {
        self.max_replica_backoff = longest;
        self
    }

    /// Sets how many times a request is re-sent before its first token.
    pub fn retries(mut self, n: usize) -> Self {
        self.retries = n;
        self
    }
}

/// Counters of a connection [`Pool`] ([`Pool::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionPoolStats {
    /// Connections in the pool.
    pub connections: usize,
    /// Replicas known (listed by the last resolution, or still serving streams).
    pub replicas: usize,
    /// Replicas new requests may go to now.
    pub usable_replicas: usize,
    /// Connections opened since start (including the initial ones).
    pub opened: u64,
    /// Connections opened with 0-RTT data.
    pub opened_0rtt: u64,
    /// Connections retired after GOAWAY.
    pub retired_goaway: u64,
    /// Connections dropped by a failed health check or because they closed.
    pub retired_unhealthy: u64,
    /// Requests sent again to another replica before their first token.
    pub retried: u64,
}

/// One server of the pool.
#[derive(Debug)]
struct Replica {
    addr: SocketAddr,
    conns: Vec<Connection>,
    /// No new streams before this instant (after a failure).
    backed_off_until: Option<Instant>,
    consecutive_failures: u32,
    /// Named by the last resolution (an unlisted replica serves its streams, then goes).
    listed: bool,
}

impl Replica {
    fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            conns: Vec::new(),
            backed_off_until: None,
            consecutive_failures: 0,
            listed: true,
        }
    }

    fn outstanding(&self) -> usize {
        self.conns.iter().map(Connection::in_flight).sum()
    }

    /// Whether new streams may go here.
    fn usable(&self, now: Instant) -> bool {
        self.listed && self.backed_off_until.is_none_or(|t| now >= t)
    }
}

#[derive(Debug, Default)]
struct Counters {
    opened: AtomicU64,
    opened_0rtt: AtomicU64,
    retired_goaway: AtomicU64,
    retired_unhealthy: AtomicU64,
    retried: AtomicU64,
}

struct PoolInner {
    client: Client,
    source: Replicas,
    cfg: PoolConfig,
    replicas: Mutex<Vec<Replica>>,
    counters: Counters,
}

/// Where a request goes: a replica, and its connection unless one must be opened.
type Choice = (SocketAddr, Option<Connection>);

impl PoolInner {
    fn replicas(&self) -> MutexGuard<'_, Vec<Replica>> {
        self.replicas.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn resolve(&self) -> Result<Vec<SocketAddr>, ClientError> {
        match &self.source {
            Replicas::Addrs(a) => Ok(a.clone()),
            Replicas::Dns(name) => {
                let resolve_error = |detail: String| ClientError::Resolve {
                    name: name.clone(),
                    detail,
                };
                let addrs: Vec<SocketAddr> = tokio::net::lookup_host(name.as_str())
                    .await
                    .map_err(|e| resolve_error(e.to_string()))?
                    .collect();
                if addrs.is_empty() {
                    return Err(resolve_error("no address".into()));
                }
                Ok(addrs)
            }
            Replicas::Resolver(r) => {
                let resolve_error = |detail: String| ClientError::Resolve {
                    name: format!("{r:?}"),
                    detail,
                };
                let addrs = r.resolve().await.map_err(resolve_error)?;
                if addrs.is_empty() {
                    return Err(resolve_error("no address".into()));
                }
                Ok(addrs)
            }
        }
    }

    /// Adds newly listed replicas; unlisted ones stop taking streams and go once idle.
    fn set_members(&self, addrs: &[SocketAddr]) {
        let mut replicas = self.replicas();
        for r in replicas.iter_mut() {
            r.listed = addrs.contains(&r.addr);
        }
        for &a in addrs {
            if !replicas.iter().any(|r| r.addr == a) {
                replicas.push(Replica::new(a));
            }
        }
        replicas.retain(|r| r.listed || r.outstanding() > 0);
    }

    /// Drops draining and closed connections (their open streams finish on their own); a
    /// replica whose connection closed under it is backed off.
    fn prune(&self) {
        let now = Instant::now();
        let mut replicas = self.replicas();
        for r in replicas.iter_mut() {
            let mut lost = false;
            r.conns.retain(|c| {
                if c.is_closed() {
                    self.counters
                        .retired_unhealthy
                        .fetch_add(1, Ordering::Relaxed);
                    lost = true;
                    false
                } else if c.is_draining() {
                    self.counters.retired_goaway.fetch_add(1, Ordering::Relaxed);
                    false
                } else {
                    true
                }
            });
            if lost {
                back_off(r, &self.cfg, now);
            }
        }
    }

    /// The usable replica with the fewest outstanding streams (not in `exclude` unless no
    /// other is usable), and its connection for one more stream.
    fn choose(&self, exclude: &[SocketAddr]) -> Option<Choice> {
        let now = Instant::now();
        let replicas = self.replicas();
        // A replica without connections is reached by the health checker (which waits for the
        // handshake), not by a request, unless no usable replica has one.
        let need_conns = replicas
            .iter()
            .any(|r| r.usable(now) && !r.conns.is_empty());
        let pick = |allow_excluded: bool| {
            replicas
                .iter()
                .filter(|r| r.usable(now) && (allow_excluded || !exclude.contains(&r.addr)))
                .filter(|r| !need_conns || !r.conns.is_empty())
                .min_by_key(|r| r.outstanding())
        };
        let r = pick(false).or_else(|| pick(true))?;
        Some(Self::connection_on(r, &self.cfg))
    }

    /// The least-loaded connection of `r` for one more stream, or `None`: open another.
    fn connection_on(r: &Replica, cfg: &PoolConfig) -> Choice {
        let best = r.conns.iter().min_by_key(|c| c.in_flight()).cloned();
        let full = r.conns.len() >= cfg.max_connections;
        let conn = best.filter(|c| c.in_flight() < cfg.target_streams_per_connection || full);
        (r.addr, conn)
    }

    /// Opens a connection to `addr`. With `confirm`, a 0-RTT connection (usable at once, even
    /// to a server that is gone) counts only once its handshake completes.
    async fn open(&self, addr: SocketAddr, confirm: bool) -> Result<Connection, ClientError> {
        let mut opened = self.client.connect(addr).await;
        if confirm && let Ok(c) = &opened {
            c.zero_rtt_accepted().await;
            if c.is_closed() {
                opened = Err(ClientError::HandshakeIncomplete { addr });
            }
        }
        let mut replicas = self.replicas();
        let Some(r) = replicas.iter_mut().find(|r| r.addr == addr) else {
            return opened;
        };
        match opened {
            Ok(c) => {
                self.counters.opened.fetch_add(1, Ordering::Relaxed);
                if c.zero_rtt_attempted() {
                    self.counters.opened_0rtt.fetch_add(1, Ordering::Relaxed);
                }
                r.conns.push(c.clone());
                Ok(c)
            }
            Err(e) => {
                back_off(r, &self.cfg, Instant::now());
                Err(e)
            }
        }
    }

    /// When the earliest back-off of a listed replica ends (the health checker probes it
    /// then), if one is backed off.
    fn next_probe(&self) -> Option<Instant> {
        let now = Instant::now();
        self.replicas()
            .iter()
            .filter(|r| r.listed)
            .filter_map(|r| r.backed_off_until)
            .filter(|&t| t > now)
            .min()
    }

    fn succeeded(&self, addr: SocketAddr) {
        if let Some(r) = self.replicas().iter_mut().find(|r| r.addr == addr) {
            r.consecutive_failures = 0;
            r.backed_off_until = None;
        }
    }

    fn failed(&self, addr: SocketAddr) {
        if let Some(r) = self.replicas().iter_mut().find(|r| r.addr == addr) {
            back_off(r, &self.cfg, Instant::now());
        }
    }

    /// Opens connections up to `min_connections` on every listed replica whose back-off is
    /// over (one attempt each); an error only when no replica has a connection.
    async fn refill(&self) -> Result<(), ClientError> {
        let now = Instant::now();
        let wanted: Vec<(SocketAddr, usize)> = self
            .replicas()
            .iter()
            .filter(|r| r.usable(now))
            .map(|r| {
                (
                    r.addr,
                    self.cfg.min_connections.saturating_sub(r.conns.len()),
                )
            })
            .filter(|&(_, n)| n > 0)
            .collect();
        let attempts = wanted
            .iter()
            .flat_map(|&(addr, n)| std::iter::repeat_n(addr, n))
            .map(|addr| self.open(addr, true));
        let results = futures::future::join_all(attempts).await;
        let first_err = results.into_iter().find_map(Result::err);
        let any = self.replicas().iter().any(|r| !r.conns.is_empty());
        match first_err {
            Some(e) if !any => Err(e),
            _ => Ok(()),
        }
    }

    /// Sends `req` to the best replica not in `tried` (tried ones only when nothing else is
    /// usable), opening a connection if needed. Records the replica in `tried`.
    async fn send(
        &self,
        req: &InferenceRequest,
        tried: &mut Vec<SocketAddr>,
    ) -> Result<ResponseStream, RequestError> {
        let mut last_err = None;
        for _ in 0..=self.cfg.retries {
            self.prune();
            let Some((addr, conn)) = self.choose(tried) else {
                break;
            };
            tried.push(addr);
            let conn = match conn {
                Some(c) => c,
                None => match self.open(addr, false).await {
                    Ok(c) => c,
                    Err(e) => {
                        last_err = Some(RequestError::NoConnection(e));
                        continue;
                    }
                },
            };
            match conn.request(req).await {
                Ok(s) => {
                    self.succeeded(addr);
                    return Ok(s);
                }
                Err(e @ (RequestError::Encode(_) | RequestError::Unauthenticated)) => {
                    return Err(e);
                }
                Err(e) => {
                    if conn.is_closed() {
                        self.failed(addr);
                    }
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or(RequestError::Draining))
    }
}

/// Backs `r` off after a failure: 1x, 2x, 4x ... the configured back-off, at most
/// `max_replica_backoff`. A failure while `r` is still backed off (another stream of the same
/// crash, a connection of the same replica) changes nothing: the back-off counts the replica's
/// failures, not its streams'.
fn back_off(r: &mut Replica, cfg: &PoolConfig, now: Instant) {
    if r.backed_off_until.is_some_and(|t| now < t) {
        return;
    }
    let factor = 1u32 << r.consecutive_failures.min(16);
    r.consecutive_failures = r.consecutive_failures.saturating_add(1);
    let pause = cfg
        .replica_backoff
        .saturating_mul(factor)
        .min(cfg.max_replica_backoff.max(cfg.replica_backoff));
    r.backed_off_until = Some(now + pause);
}

/// A pool of claudelink connections to one server or to several replicas (see the module
/// docs for the policy): spreads streams by least outstanding streams, retires connections
/// that sent GOAWAY or fail health checks, backs off failed replicas and brings them back,
/// re-sends requests that failed before their first token to another replica.
///
/// ```no_run
/// # async fn run(client: claudelink_proto::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use claudelink_proto::{Pool, PoolConfig, Replicas};
/// let pool = Pool::connect_replicas(
///     client,
///     Replicas::Dns("zerolayer-headless.default.svc:8443".into()),
///     PoolConfig::default().connections(1, 8),
/// )
/// .await?;
/// println!("{:?}", pool.stats());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
    _health: Arc<HealthTask>,
}

struct HealthTask(tokio::task::JoinHandle<()>);

impl Drop for HealthTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("replicas", &self.inner.source)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Pool {
    /// Opens `min_connections` connections to one server and starts the health checker.
    pub async fn connect(
        client: Client,
        addr: SocketAddr,
        cfg: PoolConfig,
    ) -> Result<Self, ClientError> {
        Self::connect_replicas(client, Replicas::Addrs(vec![addr]), cfg).await
    }

    /// Resolves the replicas, opens `min_connections` to each (an error only when none can be
    /// reached) and starts the health checker, which also re-resolves a DNS name.
    pub async fn connect_replicas(
        client: Client,
        replicas: Replicas,
        cfg: PoolConfig,
    ) -> Result<Self, ClientError> {
        let inner = Arc::new(PoolInner {
            client,
            source: replicas,
            cfg,
            replicas: Mutex::new(Vec::new()),
            counters: Counters::default(),
        });
        let addrs = inner.resolve().await?;
        if addrs.is_empty() {
            return Err(ClientError::Config("the replica list is empty".into()));
        }
        inner.set_members(&addrs);
        inner.refill().await?;
        let task = tokio::spawn(health_loop(Arc::downgrade(&inner)));
        Ok(Self {
            inner,
            _health: Arc::new(HealthTask(task)),
        })
    }

    /// Sends a request (see the module docs for where it goes and when it is re-sent).
    pub async fn request(&self, req: &InferenceRequest) -> Result<PoolStream, RequestError> {
        let mut tried = Vec::new();
        let stream = match self.inner.send(req, &mut tried).await {
            Ok(s) => s,
            Err(e) => {
                let _ = self.inner.refill().await;
                return Err(e);
            }
        };
        Ok(PoolStream {
            pool: self.clone(),
            request: req.clone(),
            tried,
            retries_left: self.inner.cfg.retries,
            state: State::Streaming(stream),
            first_token: false,
            started: false,
        })
    }

    /// Brings every usable replica back to `min_connections` now (normally the health
    /// checker does).
    pub async fn refill(&self) -> Result<(), ClientError> {
        self.inner.prune();
        self.inner.refill().await
    }

    /// The connections in the pool.
    pub fn connections(&self) -> Vec<Connection> {
        self.inner
            .replicas()
            .iter()
            .flat_map(|r| r.conns.iter().cloned())
            .collect()
    }

    /// Outstanding streams per replica address.
    pub fn outstanding(&self) -> Vec<(SocketAddr, usize)> {
        self.inner
            .replicas()
            .iter()
            .map(|r| (r.addr, r.outstanding()))
            .collect()
    }

    /// Counters.
    pub fn stats(&self) -> ConnectionPoolStats {
        let now = Instant::now();
        let replicas = self.inner.replicas();
        let c = &self.inner.counters;
        ConnectionPoolStats {
            connections: replicas.iter().map(|r| r.conns.len()).sum(),
            replicas: replicas.len(),
            usable_replicas: replicas.iter().filter(|r| r.usable(now)).count(),
            opened: c.opened.load(Ordering::Relaxed),
            opened_0rtt: c.opened_0rtt.load(Ordering::Relaxed),
            retired_goaway: c.retired_goaway.load(Ordering::Relaxed),
            retired_unhealthy: c.retired_unhealthy.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
        }
    }
}

/// Every `health_check_interval`: PING idle connections, drop dead and drained ones, resolve
/// a DNS name again when due, reconnect.
async fn health_loop(pool: std::sync::Weak<PoolInner>) {
    let Some(every) = pool.upgrade().map(|p| p.cfg.health_check_interval) else {
        return;
    };
    let every = every.max(Duration::from_millis(10));
    let mut next = Instant::now() + every;
    let mut resolved = Instant::now();
    loop {
        // The next check, or sooner the end of a replica's back-off: a replica that is down
        // is probed the moment it may be tried again.
        let wake = pool
            .upgrade()
            .and_then(|p| p.next_probe())
            .map_or(next, |t| t.min(next));
        tokio::time::sleep_until(wake.into()).await;
        if Instant::now() >= next {
            next = Instant::now() + every;
        }
        let Some(inner) = pool.upgrade() else { return };
        let idle: Vec<Connection> = inner
            .replicas()
            .iter()
            .flat_map(|r| r.conns.iter())
            .filter(|c| c.in_flight() == 0 && !c.is_draining())
            .cloned()
            .collect();
        for c in idle {
            if c.ping().await.is_err() {
                c.close();
            }
        }
        inner.prune();
        if matches!(inner.source, Replicas::Dns(_) | Replicas::Resolver(_))
            && resolved.elapsed() >= inner.cfg.resolve_interval
        {
            resolved = Instant::now();
            match inner.resolve().await {
                Ok(addrs) if !addrs.is_empty() => inner.set_members(&addrs),
                Ok(_) => {
                    tracing::warn!("replica name resolved to no address; keeping the last set")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "re-resolving the replicas failed; keeping the last set")
                }
            }
        }
        let _ = inner.refill().await;
    }
}

type Resend =
    Pin<Box<dyn Future<Output = (Result<ResponseStream, RequestError>, Vec<SocketAddr>)> + Send>>;

enum State {
    Streaming(ResponseStream),
    Resending(Resend),
    Done,
}

/// The events of a pooled request: a [`ResponseStream`] that, until the first token, moves to
/// another replica when its server fails, refuses or sheds it. Dropping it cancels the request.
pub struct PoolStream {
    pool: Pool,
    request: InferenceRequest,
    tried: Vec<SocketAddr>,
    retries_left: usize,
    state: State,
    /// A token has been passed on: from here a failure is the caller's.
    first_token: bool,
    /// `Started` has been passed on (a re-sent request's own is not repeated).
    started: bool,
}

impl std::fmt::Debug for PoolStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolStream")
            .field("tried", &self.tried)
            .field("first_token", &self.first_token)
            .finish()
    }
}

impl PoolStream {
    /// Reads all events.
    pub async fn collect_all(mut self) -> Result<Vec<InferenceEvent>, StreamError> {
        use futures::StreamExt;
        let mut v = Vec::new();
        while let Some(e) = self.next().await {
            v.push(e?);
        }
        Ok(v)
    }

    /// The replicas this request was sent to, in order (the last one is serving it).
    pub fn replicas_tried(&self) -> &[SocketAddr] {
        &self.tried
    }

    /// `retry_after_ms` of an ERROR frame received on the current stream (0 when none).
    pub fn retry_after_ms(&self) -> u32 {
        match &self.state {
            State::Streaming(s) => s.retry_after_ms(),
            _ => 0,
        }
    }

    /// Starts sending the request again elsewhere, if it may be.
    fn resend(&mut self, server_failed: bool) -> bool {
        if self.first_token || self.retries_left == 0 {
            return false;
        }
        self.retries_left -= 1;
        let inner = Arc::clone(&self.pool.inner);
        if server_failed && let Some(&addr) = self.tried.last() {
            inner.failed(addr);
        }
        inner.counters.retried.fetch_add(1, Ordering::Relaxed);
        let request = self.request.clone();
        let mut tried = std::mem::take(&mut self.tried);
        self.state = State::Resending(Box::pin(async move {
            let r = inner.send(&request, &mut tried).await;
            (r, tried)
        }));
        true
    }
}

/// ERROR codes that mean "not processed here, another replica may": overload and shutdown.
fn resendable(code: ErrorCode) -> bool {
    matches!(code, ErrorCode::Overloaded | ErrorCode::ShuttingDown)
}

/// Stream failures before the first token after which the request may go elsewhere: the
/// connection or stream was lost, or the server says it did not process it.
fn stream_failure_resendable(e: &StreamError) -> bool {
    match e {
        StreamError::ConnectionLost(_) | StreamError::ZeroRttRejected => true,
        StreamError::Reset { code, .. } => !matches!(code, Some(AppErrorCode::Cancelled)),
        _ => false,
    }
}

impl Stream for PoolStream {
    type Item = Result<InferenceEvent, StreamError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                State::Done => return Poll::Ready(None),
                State::Resending(fut) => match fut.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready((result, tried)) => {
                        this.tried = tried;
                        match result {
                            Ok(s) => this.state = State::Streaming(s),
                            Err(e) => {
                                this.state = State::Done;
                                return Poll::Ready(Some(Err(StreamError::NotResent(Box::new(e)))));
                            }
                        }
                    }
                },
                State::Streaming(s) => match Pin::new(s).poll_next(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(None) => {
                        this.state = State::Done;
                        return Poll::Ready(None);
                    }
                    Poll::Ready(Some(Err(e))) => {
                        if stream_failure_resendable(&e) && this.resend(true) {
                            continue;
                        }
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(e)));
                    }
                    Poll::Ready(Some(Ok(ev))) => match &ev {
                        InferenceEvent::Started { .. } if this.started => continue,
                        InferenceEvent::Started { .. } => {
                            this.started = true;
                            return Poll::Ready(Some(Ok(ev)));
                        }
                        InferenceEvent::Error { code, .. }
                            if resendable(*code) && this.resend(false) =>
                        {
                            continue;
                        }
                        InferenceEvent::Delta { ids, .. } => {
                            this.first_token |= !ids.is_empty();
                            return Poll::Ready(Some(Ok(ev)));
                        }
                        _ => return Poll::Ready(Some(Ok(ev))),
                    },
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_crash_backs_a_replica_off_once_and_probes_double_it_up_to_the_cap() {
        let cfg = PoolConfig::default();
        let mut r = Replica::new(SocketAddr::from(([127, 0, 0, 1], 1)));
        let t0 = Instant::now();
        // A crash ends 60 streams and 2 connections at about the same time: one back-off.
        for i in 0..62 {
            back_off(&mut r, &cfg, t0 + Duration::from_millis(i));
        }
        assert_eq!(r.backed_off_until, Some(t0 + Duration::from_secs(1)));
        assert!(!r.usable(t0 + Duration::from_millis(999)));
        assert!(r.usable(t0 + Duration::from_secs(1)));
        // Each failed probe after a back-off ran out doubles it, up to 4 s.
        let mut now = t0 + Duration::from_secs(1);
        let mut pauses = Vec::new();
        for _ in 0..6 {
            back_off(&mut r, &cfg, now);
            let until = r.backed_off_until.unwrap();
            pauses.push((until - now).as_secs());
            now = until;
        }
        assert_eq!(pauses, [2, 4, 4, 4, 4, 4]);
        // A restarted replica is probed at most 4 s after it came back, and after one
        // success the next crash starts from 1 s again.
        r.consecutive_failures = 0;
        r.backed_off_until = None;
        back_off(&mut r, &cfg, now);
        assert_eq!(r.backed_off_until, Some(now + Duration::from_secs(1)));
    }
}
