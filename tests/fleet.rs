//! A fleet on loopback: three server processes on the default model behind the claudelink
//! replica pool, 60 concurrent streams for 30 s; one replica is drained (SIGTERM) at 8 s, one
//! killed (SIGKILL) at 14 s and restarted at 17 s. Counted: no request lost before its first
//! token (re-sent elsewhere), every mid-stream failure reported within 2 s of the later of its
//! last event and its replica's disruption (the kill, or the end of the drain), streams spread
//! within 20% across the live replicas, the restarted replica back in rotation within 10 s (a
//! probe opens a stream every 250 ms from the restart until the pool sends one there). The
//! client and pool run with their default settings.
//!
//! Nothing here depends on how fast the machine decodes: on a slow machine one request can
//! outlast the whole run, so lateness counts from the disruption rather than from a stream's
//! last token, and rotation is probed rather than read from the clients' next requests.

use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zerolayer::claudelink_proto::futures::StreamExt as _;
use zerolayer::claudelink_proto::{
    CertFingerprint, ChatMessage, ChatRole, Client, ClientConfig, InferenceEvent, InferenceRequest,
    Pool, PoolConfig, PoolStream, Prompt, Replicas, Trust,
};

const CLIENTS: usize = 60;
const RUN: Duration = Duration::from_secs(30);
const DRAIN_AT: Duration = Duration::from_secs(8);
const KILL_AT: Duration = Duration::from_secs(14);
const RESTART_AT: Duration = Duration::from_secs(17);
/// `--drain-secs` of every replica.
const DRAIN_SECS: u64 = 5;

/// `zerolayer serve`.
fn server_command() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerolayer"));
    c.arg("serve");
    c
}

/// A free port on loopback (of `kind`: "tcp" or "udp").
fn free_port(kind: &str) -> u16 {
    if kind == "tcp" {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    } else {
        UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
}

struct Replica {
    http: SocketAddr,
    quic: SocketAddr,
    child: Option<Child>,
}

impl Replica {
    fn start(&mut self, model: &Path, cert: &Path, key: &Path) {
        let child = server_command()
            .args([
                "--model",
                model.to_str().unwrap(),
                "--threads",
                "1",
                "--drain-secs",
                &DRAIN_SECS.to_string(),
            ])
            .args([
                "--http-listen",
                &self.http.to_string(),
                "--quic-listen",
                &self.quic.to_string(),
            ])
            .args([
                "--tls-cert",
                cert.to_str().unwrap(),
                "--tls-key",
                key.to_str().unwrap(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cargo builds the zerolayer binary for the tests");
        self.child = Some(child);
    }

    fn signal(&mut self, sig: libc::c_int) {
        let pid = self.child.as_ref().unwrap().id() as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid (not yet waited for, so not reused).
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Whether the server's TCP listener accepts (it is bound once the model is mapped).
fn tcp_up(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

/// One request's outcome.
#[derive(Debug, Clone)]
struct Outcome {
    started: Duration,
    replica: Option<SocketAddr>,
    ok: bool,
    first_token: bool,
    /// When its last event (or the stream) arrived, since the start of the run.
    last_event: Duration,
    /// When it ended (finished, or its failure was reported), since the start of the run.
    ended: Duration,
}

async fn one(pool: &Pool, req: &InferenceRequest, start: Instant) -> Outcome {
    let t0 = Instant::now();
    let mut out = Outcome {
        started: t0 - start,
        replica: None,
        ok: false,
        first_token: false,
        last_event: t0 - start,
        ended: t0 - start,
    };
    let stream = pool.request(req).await;
    out.ended = start.elapsed();
    let Ok(stream) = stream else { return out };
    out.last_event = out.ended;
    finish(stream, &mut out, start).await;
    out
}

/// Reads `stream` to its end into `out`.
async fn finish(mut stream: PoolStream, out: &mut Outcome, start: Instant) {
    while let Some(ev) = stream.next().await {
        out.replica = stream.replicas_tried().last().copied();
        out.ended = start.elapsed();
        match ev {
            Ok(InferenceEvent::Delta { ids, .. }) => out.first_token |= !ids.is_empty(),
            Ok(InferenceEvent::Finished { .. }) => out.ok = true,
            Ok(InferenceEvent::Error { .. }) | Err(_) => return,
            Ok(_) => {}
        }
        out.last_event = out.ended;
    }
}

/// From the restart on, opens a stream every 250 ms until the pool sends one to `restarted`
/// (the others are dropped at once, which cancels them) or `within` has passed; reads that one
/// to its end.
async fn probe_rotation(
    pool: &Pool,
    req: &InferenceRequest,
    restarted: SocketAddr,
    start: Instant,
    within: Duration,
) -> Option<Outcome> {
    while start.elapsed() < RESTART_AT + within {
        let t0 = start.elapsed();
        if let Ok(stream) = pool.request(req).await
            && stream.replicas_tried().last() == Some(&restarted)
        {
            let mut out = Outcome {
                started: t0,
                replica: Some(restarted),
                ok: false,
                first_token: false,
                last_event: start.elapsed(),
                ended: start.elapsed(),
            };
            finish(stream, &mut out, start).await;
            return Some(out);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_survives_a_drain_and_a_kill() {
    let model = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let fingerprint = CertFingerprint::of_der(cert.cert.der());
    let mut replicas: Vec<Replica> = (0..3)
        .map(|_| Replica {
            http: SocketAddr::from(([127, 0, 0, 1], free_port("tcp"))),
            quic: SocketAddr::from(([127, 0, 0, 1], free_port("udp"))),
            child: None,
        })
        .collect();
    for r in &mut replicas {
        r.start(&model, &cert_path, &key_path);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !replicas.iter().all(|r| tcp_up(r.http)) {
        assert!(Instant::now() < deadline, "servers did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The defaults: a fleet's failover targets (2 s, 10 s) must hold without tuning.
    let client = Client::new(ClientConfig::new(Trust::Pinned(fingerprint))).unwrap();
    let cfg = PoolConfig::default().connections(1, 2);
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.quic).collect();
    let pool = Pool::connect_replicas(client, Replicas::Addrs(addrs.clone()), cfg)
        .await
        .unwrap();
    let model_id = served_model();
    let req = InferenceRequest::new(
        model_id,
        Prompt::Chat(vec![ChatMessage::new(ChatRole::User, "Name a color.")]),
        16,
    );

    let start = Instant::now();
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (pool, req, outcomes) = (pool.clone(), req.clone(), outcomes.clone());
            tokio::spawn(async move {
                while start.elapsed() < RUN {
                    let o = one(&pool, &req, start).await;
                    outcomes.lock().unwrap().push(o);
                }
            })
        })
        .collect();
    // Outstanding streams per replica, sampled while all three are live.
    let sampler = {
        let (pool, addrs) = (pool.clone(), addrs.clone());
        tokio::spawn(async move {
            let mut samples = Vec::new();
            tokio::time::sleep(Duration::from_secs(1)).await;
            while start.elapsed() < DRAIN_AT {
                let now = pool.outstanding();
                let of = |a: &SocketAddr| now.iter().find(|(x, _)| x == a).map_or(0, |(_, n)| *n);
                samples.push(addrs.iter().map(of).collect::<Vec<usize>>());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        })
    };
    let at = |t: Duration| tokio::time::sleep_until((start + t).into());
    at(DRAIN_AT).await;
    replicas[0].signal(libc::SIGTERM);
    at(KILL_AT).await;
    replicas[1].signal(libc::SIGKILL);
    at(RESTART_AT).await;
    let _ = replicas[1].child.as_mut().unwrap().wait();
    let (model_path, cert_path2, key_path2) = (model.clone(), cert_path.clone(), key_path.clone());
    replicas[1].start(&model_path, &cert_path2, &key_path2);
    let back = probe_rotation(&pool, &req, addrs[1], start, Duration::from_secs(10)).await;
    for t in tasks {
        t.await.unwrap();
    }
    let outcomes = outcomes.lock().unwrap().clone();

    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok).collect();
    let mut took: Vec<Duration> = outcomes
        .iter()
        .filter(|o| o.ok)
        .map(|o| o.ended - o.started)
        .collect();
    took.sort();
    println!(
        "{} requests, {} ok (median {:?} each), {} failed mid-stream; rotation probe: {back:?}",
        outcomes.len(),
        took.len(),
        took.get(took.len() / 2),
        failed.len(),
    );
    let lost_early: Vec<&&Outcome> = failed.iter().filter(|o| !o.first_token).collect();
    assert!(
        lost_early.is_empty(),
        "requests lost before their first token: {lost_early:?}"
    );
    // A failure is reported within 2 s of the later of its last event and its replica's
    // disruption: the kill, or the drain's deadline (streams still running then end with an
    // error). Nothing happens to the third replica, so nothing fails there.
    let lateness = |o: &Outcome| {
        let disrupted = if o.replica == Some(addrs[1]) {
            KILL_AT
        } else {
            DRAIN_AT + Duration::from_secs(DRAIN_SECS)
        };
        o.ended.saturating_sub(o.last_event.max(disrupted))
    };
    println!(
        "latest failure report after its disruption: {:?}",
        failed.iter().map(|o| lateness(o)).max()
    );
    for o in &failed {
        let disrupted = if o.replica == Some(addrs[1]) {
            KILL_AT
        } else if o.replica == Some(addrs[0]) {
            DRAIN_AT + Duration::from_secs(DRAIN_SECS)
        } else {
            panic!("a failure on the undisturbed replica: {o:?}")
        };
        assert!(
            o.ended.saturating_sub(o.last_event.max(disrupted)) <= Duration::from_secs(2),
            "a failure reported late: {o:?}"
        );
    }
    // Spread while all three are live: the time-averaged outstanding streams per replica.
    let samples = sampler.await.unwrap();
    let means: Vec<f64> = (0..3)
        .map(|i| samples.iter().map(|s| s[i] as f64).sum::<f64>() / samples.len() as f64)
        .collect();
    let mean = means.iter().sum::<f64>() / 3.0;
    println!("mean outstanding streams per replica before the drain: {means:?}");
    for m in &means {
        assert!(
            (m - mean).abs() <= 0.2 * mean,
            "uneven spread: mean outstanding {means:?}"
        );
    }
    // The restarted replica is sent a stream within 10 s of the restart, and serves it.
    assert!(
        back.as_ref().is_some_and(|o| o.ok),
        "restarted replica not back in rotation within 10 s: {back:?}"
    );
    // After the drain nothing new went to the drained replica.
    let after_drain = outcomes
        .iter()
        .filter(|o| {
            o.ok && o.replica == Some(addrs[0]) && o.started > DRAIN_AT + Duration::from_secs(1)
        })
        .count();
    assert_eq!(after_drain, 0);
}

/// The model id the fleet serves: the default model's `general.name`, as the server names it.
fn served_model() -> String {
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the test does not modify the model file while it is mapped.
    let gguf = unsafe { weight_cache::Gguf::open(&path) }.unwrap();
    gguf.get_str("general.name").unwrap().trim().to_owned()
}
