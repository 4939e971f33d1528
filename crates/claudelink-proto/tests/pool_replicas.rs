//! The pool over several replicas on loopback: streams spread by outstanding load, requests
//! moved to another replica before their first token, a stopped replica's streams ended with
//! an error and the replica avoided, a restarted replica back in rotation, DNS names.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use claudelink_proto::*;
use futures::StreamExt;

mod ticker;
use ticker::*;

/// `n` replicas sharing one certificate, each with its own service.
fn replicas(n: usize, deltas: u32, delay: Duration) -> (Identity, Vec<(Server, Arc<Ticker>)>) {
    let id = Identity::self_signed(&["localhost"]).unwrap();
    let servers = (0..n)
        .map(|_| {
            let svc = Ticker::new(deltas, delay);
            let s = start_at(
                "127.0.0.1:0".parse().unwrap(),
                id.clone(),
                svc.clone(),
                |c| c,
            );
            (s, svc)
        })
        .collect();
    (id, servers)
}

fn fleet_client(id: &Identity) -> Client {
    // Fleet settings: a dead replica's connection times out within a second.
    let cfg = ClientConfig::new(Trust::Pinned(id.fingerprint()))
        .keep_alive_interval(Some(Duration::from_millis(200)))
        .connection_ttl(Duration::from_secs(1));
    Client::new(cfg).unwrap()
}

fn fast_config() -> PoolConfig {
    PoolConfig::default()
        .connections(1, 4)
        .health_check_interval(Duration::from_millis(100))
        .replica_backoff(Duration::from_millis(100))
}

fn addrs(servers: &[(Server, Arc<Ticker>)]) -> Vec<SocketAddr> {
    servers.iter().map(|(s, _)| s.local_addr()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_spread_over_replicas_by_outstanding_streams() {
    let (id, servers) = replicas(3, 50, Duration::from_millis(20));
    let pool = Pool::connect_replicas(
        fleet_client(&id),
        Replicas::Addrs(addrs(&servers)),
        fast_config(),
    )
    .await
    .unwrap();
    assert_eq!(pool.stats().replicas, 3);
    let mut streams = Vec::new();
    for _ in 0..60 {
        streams.push(pool.request(&req(50)).await.unwrap());
    }
    eventually("all 60 streams to be active", || {
        servers
            .iter()
            .map(|(_, t)| t.active.load(Ordering::SeqCst))
            .sum::<usize>()
            == 60
    })
    .await;
    for (_, t) in &servers {
        let n = t.active.load(Ordering::SeqCst);
        assert!(
            (16..=24).contains(&n),
            "uneven spread: {n} of 60 on one of 3 replicas"
        );
    }
    for s in streams {
        assert_eq!(s.collect_all().await.unwrap().len(), 52);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_replica_s_requests_go_to_another_before_their_first_token() {
    let (id, servers) = replicas(2, 3, Duration::ZERO);
    servers[0].1.overloaded.store(true, Ordering::SeqCst);
    let pool = Pool::connect_replicas(
        fleet_client(&id),
        Replicas::Addrs(addrs(&servers)),
        fast_config(),
    )
    .await
    .unwrap();
    for _ in 0..10 {
        let s = pool.request(&req(3)).await.unwrap();
        let events = s.collect_all().await.unwrap();
        // One Started (the refused attempt's is not repeated), three deltas, Finished.
        assert_eq!(events.len(), 5, "{events:?}");
        assert!(matches!(events[0], InferenceEvent::Started { .. }));
        assert!(matches!(events[4], InferenceEvent::Finished { .. }));
    }
    assert_eq!(servers[1].1.finished.load(Ordering::SeqCst), 10);
    assert!(pool.stats().retried > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_ends_its_streams_with_an_error_and_is_avoided_until_it_returns() {
    let (id, mut servers) = replicas(2, 1000, Duration::from_millis(10));
    let pool = Pool::connect_replicas(
        fleet_client(&id),
        Replicas::Addrs(addrs(&servers)),
        fast_config(),
    )
    .await
    .unwrap();
    // Four long streams, each past its first token.
    let mut streams = Vec::new();
    for _ in 0..4 {
        let mut s = pool.request(&req(1000)).await.unwrap();
        assert!(matches!(
            s.next().await,
            Some(Ok(InferenceEvent::Started { .. }))
        ));
        assert!(matches!(
            s.next().await,
            Some(Ok(InferenceEvent::Delta { .. }))
        ));
        streams.push(s);
    }
    let (stopped, _) = servers.remove(0);
    let stopped_addr = stopped.local_addr();
    let on_stopped: Vec<bool> = streams
        .iter()
        .map(|s| s.replicas_tried().last() == Some(&stopped_addr))
        .collect();
    assert_eq!(
        on_stopped.iter().filter(|b| **b).count(),
        2,
        "streams spread 2 + 2"
    );
    stopped.shutdown().await;
    // The stopped replica's streams end with an error within 2 s; the others go on.
    let t0 = Instant::now();
    for (s, stopped) in streams.iter_mut().zip(&on_stopped) {
        let mut failed = false;
        while let Some(ev) = tokio::time::timeout(Duration::from_secs(2), s.next())
            .await
            .expect("a stream hung")
        {
            if ev.is_err() {
                failed = true;
                break;
            }
            if !stopped {
                break; // a live one: still producing
            }
        }
        assert_eq!(failed, *stopped);
    }
    assert!(t0.elapsed() < Duration::from_secs(2));
    // New requests all go to the live replica.
    for _ in 0..6 {
        let mut s = pool.request(&req(2)).await.unwrap();
        while let Some(ev) = s.next().await {
            ev.unwrap();
        }
        assert_eq!(s.replicas_tried(), [servers[0].0.local_addr()]);
    }
    // The replica restarts on the same address: back in rotation after its back-off.
    let svc = Ticker::new(2, Duration::ZERO);
    let restarted = start_at(stopped_addr, id.clone(), svc.clone(), |c| c);
    eventually(
        "the restarted replica to be usable with a connection",
        || {
            pool.stats().usable_replicas == 2
                && pool
                    .connections()
                    .iter()
                    .any(|c| c.remote_address() == stopped_addr)
        },
    )
    .await;
    let mut served_by_restarted = 0;
    for _ in 0..10 {
        let mut s = pool.request(&req(2)).await.unwrap();
        while let Some(ev) = s.next().await {
            ev.unwrap();
        }
        served_by_restarted += usize::from(s.replicas_tried().last() == Some(&stopped_addr));
    }
    assert!(
        served_by_restarted > 0,
        "the restarted replica got no request"
    );
    drop(restarted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_name_is_resolved_to_its_replicas() {
    let (id, servers) = replicas(1, 2, Duration::ZERO);
    let port = servers[0].0.local_addr().port();
    let pool = Pool::connect_replicas(
        fleet_client(&id),
        Replicas::Dns(format!("localhost:{port}")),
        fast_config(),
    )
    .await
    .unwrap();
    let events = pool
        .request(&req(2))
        .await
        .unwrap()
        .collect_all()
        .await
        .unwrap();
    assert_eq!(events.len(), 4);
    // A name that does not resolve is a typed error, not a hang.
    let bad = Pool::connect_replicas(
        fleet_client(&id),
        Replicas::Dns("no-such-host.invalid:1".into()),
        fast_config(),
    )
    .await;
    assert!(matches!(bad, Err(ClientError::Resolve { .. })), "{bad:?}");
}

/// A resolver whose answer the test sets: several A and AAAA records, changed while the pool
/// runs (a Kubernetes headless Service as pods come and go).
#[derive(Debug)]
struct StubResolver {
    answer: std::sync::Mutex<Result<Vec<SocketAddr>, String>>,
    asked: std::sync::atomic::AtomicUsize,
}

impl StubResolver {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            answer: std::sync::Mutex::new(Ok(Vec::new())),
            asked: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    fn set(&self, answer: Result<Vec<SocketAddr>, String>) {
        *self.answer.lock().unwrap() = answer;
    }
}

impl ReplicaResolver for StubResolver {
    fn resolve(
        &self,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Vec<SocketAddr>, String>> + Send + '_>> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let answer = self.answer.lock().unwrap().clone();
        Box::pin(async move { answer })
    }
}

/// Which replicas `n` concurrent short requests went to (all read to their end).
async fn served_by(pool: &Pool, n: usize) -> Vec<SocketAddr> {
    let mut streams = Vec::new();
    for _ in 0..n {
        streams.push(pool.request(&req(2)).await.unwrap());
    }
    let mut by = Vec::new();
    for mut s in streams {
        while let Some(ev) = s.next().await {
            ev.unwrap();
        }
        by.push(*s.replicas_tried().last().unwrap());
    }
    by
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_follow_the_resolvers_records_ipv4_and_ipv6_as_members_come_and_go() {
    let id = Identity::self_signed(&["localhost"]).unwrap();
    let server = |at: &str| {
        start_at(
            at.parse().unwrap(),
            id.clone(),
            Ticker::new(2, Duration::ZERO),
            |c| c,
        )
    };
    // Two A records and one AAAA record.
    let (a, b, v6) = (
        server("127.0.0.1:0"),
        server("127.0.0.1:0"),
        server("[::1]:0"),
    );
    let (a_addr, b_addr, v6_addr) = (a.local_addr(), b.local_addr(), v6.local_addr());
    let stub = StubResolver::new();
    stub.set(Ok(vec![a_addr, v6_addr]));
    let pool = Pool::connect_replicas(
        fleet_client(&id),
        Replicas::Resolver(stub.clone()),
        fast_config().resolve_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    assert_eq!(pool.stats().replicas, 2);
    let by = served_by(&pool, 12).await;
    assert!(by.contains(&a_addr) && by.contains(&v6_addr), "{by:?}");
    assert!(!by.contains(&b_addr));

    // A pod goes, another comes: the pool follows within a resolve interval or two.
    stub.set(Ok(vec![v6_addr, b_addr]));
    eventually("the new member set", || {
        let mut now: Vec<SocketAddr> = pool.outstanding().iter().map(|(x, _)| *x).collect();
        now.sort();
        let mut want = vec![v6_addr, b_addr];
        want.sort();
        // The health checker has connected to the newcomer.
        now == want
            && pool.stats().usable_replicas == 2
            && pool
                .connections()
                .iter()
                .any(|c| c.remote_address() == b_addr)
    })
    .await;
    let by = served_by(&pool, 12).await;
    assert!(by.contains(&b_addr) && by.contains(&v6_addr), "{by:?}");
    assert!(
        !by.contains(&a_addr),
        "a removed member got requests: {by:?}"
    );

    // A failing or empty answer keeps the last set.
    let asked = stub.asked.load(Ordering::SeqCst);
    stub.set(Err("SERVFAIL".into()));
    eventually("two more resolutions", || {
        stub.asked.load(Ordering::SeqCst) >= asked + 2
    })
    .await;
    stub.set(Ok(vec![]));
    eventually("two more resolutions", || {
        stub.asked.load(Ordering::SeqCst) >= asked + 4
    })
    .await;
    assert_eq!(pool.stats().replicas, 2);
    assert_eq!(served_by(&pool, 4).await.len(), 4);
    // At start, a failing resolver is a typed error.
    let failing = StubResolver::new();
    failing.set(Err("no such service".into()));
    let err = Pool::connect_replicas(
        fleet_client(&id),
        Replicas::Resolver(failing),
        fast_config(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ClientError::Resolve { .. }), "{err:?}");
    drop((a, b, v6));
}
