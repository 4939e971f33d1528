//! An emulated wide-area link on one Linux machine, for zerolayer's serving benchmark.
//!
//! The kernels we run on have no `netem` qdisc, but network namespaces and TUN devices work.
//! [`Wan::up`] creates two namespaces (`PREFIX-a`, `PREFIX-b`), one TUN device in each
//! (`10.213.0.1` and `10.213.0.2`, point to point), and a userspace forwarder that moves every
//! IP packet between the two devices through a [`Shaper`] per direction: one-way delay,
//! jitter, random loss and an optional rate limit with a bounded queue. TCP and QUIC between a
//! process in one namespace and one in the other (`ip netns exec PREFIX-a ...`) see a real
//! lossy, slow path. Dropping the [`Wan`] stops the forwarder and deletes both namespaces
//! (and so the devices); a stale pair with the same prefix is removed first.
//!
//! ```no_run
//! use std::time::Duration;
//! use zerolayer_wan::{LinkConfig, Wan, WanConfig};
//!
//! let link = LinkConfig { delay: Duration::from_millis(25), loss: 0.01, ..LinkConfig::default() };
//! let wan = Wan::up(WanConfig::new("zlwan", link))?;
//! let m = wan.measure(2_000, Duration::from_micros(500))?;
//! println!("rtt {:?}, round-trip loss {:.2}%", m.mean_rtt, 100.0 * m.loss);
//! # Ok::<(), zerolayer_wan::WanError>(())
//! ```
//!
//! Needs root (or `CAP_NET_ADMIN` + `CAP_SYS_ADMIN`), `/dev/net/tun` and iproute2's `ip`.

mod measure;
mod shaper;
mod sys;

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use measure::Measurement;
pub use shaper::{LinkConfig, Shaper, Verdict};
use sys::Tun;
pub use sys::{enter_netns, stop_on_signals};

/// The address of namespace A's end of the link.
pub const ADDR_A: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
/// The address of namespace B's end of the link.
pub const ADDR_B: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);

/// Why the link could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WanError {
    /// The prefix would make interface names longer than the kernel's 15 bytes, or holds
    /// characters other than ASCII letters, digits and `-`.
    #[error("bad prefix {0:?}: 1-10 ASCII letters, digits or '-'")]
    BadPrefix(String),
    /// An `ip` command failed (not root? no iproute2?).
    #[error("`ip {args}` failed: {why}")]
    Ip {
        /// Its arguments.
        args: String,
        /// Its standard error, or why it could not run.
        why: String,
    },
    /// A TUN device could not be created or used (no `/dev/net/tun`? not root?).
    #[error("TUN device {name}: {source}")]
    Tun {
        /// The device.
        name: String,
        /// The system error.
        source: std::io::Error,
    },
    /// The measurement's sockets failed.
    #[error("measurement: {0}")]
    Measure(std::io::Error),
}

/// Both directions' link and the names to use.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WanConfig {
    /// Namespace and device name prefix (namespaces `PREFIX-a`/`-b`, devices `PREFIX-a0`/`-b0`).
    pub prefix: String,
    /// A to B.
    pub a_to_b: LinkConfig,
    /// B to A.
    pub b_to_a: LinkConfig,
    /// Seed of the loss and jitter draws (each direction derives its own).
    pub seed: u64,
}

impl WanConfig {
    /// A symmetric link: `link` in both directions (its delay is half the round trip).
    pub fn new(prefix: &str, link: LinkConfig) -> Self {
        Self {
            prefix: prefix.to_owned(),
            a_to_b: link,
            b_to_a: link,
            seed: 1,
        }
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
}

/// Packet counts of one direction.
#[derive(Debug, Default)]
pub struct DirectionStats {
    /// Packets read from the sending side.
    pub received: AtomicU64,
    /// Lost at random.
    pub lost: AtomicU64,
    /// Dropped by the full queue.
    pub queue_full: AtomicU64,
    /// Written to the other side.
    pub delivered: AtomicU64,
}

/// A running link; dropping it tears everything down.
#[derive(Debug)]
pub struct Wan {
    config: WanConfig,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stats: [Arc<DirectionStats>; 2],
}

impl Wan {
    /// Creates the namespaces, devices and forwarder.
    pub fn up(config: WanConfig) -> Result<Self, WanError> {
        let p = &config.prefix;
        if p.is_empty()
            || p.len() > 10
            || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(WanError::BadPrefix(p.clone()));
        }
        remove_namespaces(p);
        let mut wan = Self {
            config: config.clone(),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
            stats: Default::default(),
        };
        let tun_a = setup_end(p, 'a', ADDR_A, ADDR_B)?;
        let tun_b = setup_end(p, 'b', ADDR_B, ADDR_A)?;
        let (tun_a, tun_b) = (Arc::new(tun_a), Arc::new(tun_b));
        for (from, to, link, seed, stats) in [
            (&tun_a, &tun_b, config.a_to_b, config.seed, &wan.stats[0]),
            (
                &tun_b,
                &tun_a,
                config.b_to_a,
                config.seed.rotate_left(32) ^ 1,
                &wan.stats[1],
            ),
        ] {
            let (from, to, stats, stop) = (
                Arc::clone(from),
                Arc::clone(to),
                Arc::clone(stats),
                Arc::clone(&wan.stop),
            );
            let shaper = Shaper::new(link, seed);
            wan.threads.push(std::thread::spawn(move || {
                if let Err(e) = forward(&from, &to, shaper, &stop, &stats) {
                    eprintln!(
                        "zerolayer-wan: forwarding {} -> {}: {e}",
                        from.name(),
                        to.name()
                    );
                }
            }));
        }
        Ok(wan)
    }

    /// Namespace A's name (run a process there with `ip netns exec NAME ...`).
    pub fn ns_a(&self) -> String {
        format!("{}-a", self.config.prefix)
    }

    /// Namespace B's name.
    pub fn ns_b(&self) -> String {
        format!("{}-b", self.config.prefix)
    }

    /// The namespace file of `ns` (for [`enter_netns`]).
    pub fn ns_path(ns: &str) -> PathBuf {
        PathBuf::from("/run/netns").join(ns)
    }

    /// Packet counts: `[A to B, B to A]`.
    pub fn stats(&self) -> [&DirectionStats; 2] {
        [&self.stats[0], &self.stats[1]]
    }
}

impl Drop for Wan {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        remove_namespaces(&self.config.prefix);
    }
}

/// Creates namespace `PREFIX-end` and its TUN device with `local` (peer `peer`), up.
fn setup_end(prefix: &str, end: char, local: Ipv4Addr, peer: Ipv4Addr) -> Result<Tun, WanError> {
    let ns = format!("{prefix}-{end}");
    let dev = format!("{prefix}-{end}0");
    ip(&["netns", "add", &ns])?;
    let tun = Tun::create(&dev).map_err(|source| WanError::Tun {
        name: dev.clone(),
        source,
    })?;
    ip(&["link", "set", &dev, "netns", &ns])?;
    ip(&[
        "-n",
        &ns,
        "addr",
        "add",
        &local.to_string(),
        "peer",
        &peer.to_string(),
        "dev",
        &dev,
    ])?;
    ip(&["-n", &ns, "link", "set", &dev, "up"])?;
    ip(&["-n", &ns, "link", "set", "lo", "up"])?;
    Ok(tun)
}

/// Deletes both namespaces of `prefix` if they exist (their devices go with them).
fn remove_namespaces(prefix: &str) {
    for end in ['a', 'b'] {
        let ns = format!("{prefix}-{end}");
        if Wan::ns_path(&ns).exists() {
            let _ = ip(&["netns", "del", &ns]);
        }
    }
}

fn ip(args: &[&str]) -> Result<(), WanError> {
    let fail = |why: String| WanError::Ip {
        args: args.join(" "),
        why,
    };
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| fail(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(fail(String::from_utf8_lossy(&out.stderr).trim().to_owned()))
    }
}

/// The forwarder of one direction: reads packets from `from`, delivers them to `to` when the
/// shaper says, until `stop`. The queue is bounded by the shaper's `queue_bytes`.
fn forward(
    from: &Tun,
    to: &Tun,
    mut shaper: Shaper,
    stop: &AtomicBool,
    stats: &DirectionStats,
) -> std::io::Result<()> {
    const IDLE: Duration = Duration::from_millis(50);
    let start = Instant::now();
    let mut queue: VecDeque<(Duration, Vec<u8>)> = VecDeque::new();
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
        let now = start.elapsed();
        while queue.front().is_some_and(|(at, _)| *at <= now) {
            let (_, packet) = queue.pop_front().expect("checked");
            to.send(&packet)?;
            shaper.delivered(packet.len());
            stats.delivered.fetch_add(1, Ordering::Relaxed);
        }
        let wait = queue
            .front()
            .map_or(IDLE, |(at, _)| at.saturating_sub(start.elapsed()))
            .min(IDLE);
        from.wait_readable(wait)?;
        while let Some(n) = from.recv(&mut buf)? {
            stats.received.fetch_add(1, Ordering::Relaxed);
            match shaper.admit(start.elapsed(), n) {
                Verdict::Deliver(at) => queue.push_back((at, buf[..n].to_vec())),
                Verdict::Lost => {
                    stats.lost.fetch_add(1, Ordering::Relaxed);
                }
                Verdict::QueueFull => {
                    stats.queue_full.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    Ok(())
}
