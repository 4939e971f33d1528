//! Measuring the link end to end: UDP probes from namespace B echoed in namespace A.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::{ADDR_A, ADDR_B, Wan, WanError, enter_netns};

/// What the probes saw.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// Probes sent.
    pub sent: usize,
    /// Echoes received.
    pub received: usize,
    /// Round-trip loss: `1 - received / sent`.
    pub loss: f64,
    /// Mean round-trip time of the echoes.
    pub mean_rtt: Duration,
    /// Median round-trip time.
    pub median_rtt: Duration,
}

const ECHO_PORT: u16 = 9_977;

impl Wan {
    /// Sends `probes` UDP probes from B to an echo in A, one every `interval`, and waits for
    /// the stragglers (twice the largest RTT seen, at least one second).
    pub fn measure(&self, probes: usize, interval: Duration) -> Result<Measurement, WanError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let echo = {
            let (ns, stop) = (Self::ns_path(&self.ns_a()), Arc::clone(&stop));
            std::thread::spawn(move || -> std::io::Result<()> {
                enter_netns(&ns)?;
                let sock = UdpSocket::bind(SocketAddr::from((ADDR_A, ECHO_PORT)))?;
                sock.set_read_timeout(Some(Duration::from_millis(50)))?;
                let _ = ready_tx.send(());
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = sock.recv_from(&mut buf) {
                        sock.send_to(&buf[..n], from)?;
                    }
                }
                Ok(())
            })
        };
        let _ = ready_rx.recv_timeout(Duration::from_secs(5));
        let ns_b = Self::ns_path(&self.ns_b());
        let probe = std::thread::spawn(move || probe_from(&ns_b, probes, interval));
        let result = probe.join().expect("probe thread does not panic");
        stop.store(true, Ordering::Relaxed);
        let echoed = echo.join().expect("echo thread does not panic");
        echoed.map_err(WanError::Measure)?;
        result.map_err(WanError::Measure)
    }
}

fn probe_from(
    ns: &std::path::Path,
    probes: usize,
    interval: Duration,
) -> std::io::Result<Measurement> {
    enter_netns(ns)?;
    let sock = UdpSocket::bind(SocketAddr::from((ADDR_B, 0)))?;
    sock.connect(SocketAddr::from((ADDR_A, ECHO_PORT)))?;
    let receiver = sock.try_clone()?;
    let start = Instant::now();
    let done_sending = Arc::new(AtomicBool::new(false));
    let collect = {
        let done_sending = Arc::clone(&done_sending);
        std::thread::spawn(move || -> std::io::Result<Vec<Duration>> {
            receiver.set_read_timeout(Some(Duration::from_millis(20)))?;
            let mut rtts = Vec::with_capacity(probes);
            let mut seen = vec![false; probes];
            let mut last_heard = Instant::now();
            let mut buf = [0u8; 16];
            loop {
                match receiver.recv(&mut buf) {
                    Ok(16) => {
                        let seq = u64::from_le_bytes(buf[..8].try_into().expect("8")) as usize;
                        let sent = Duration::from_nanos(u64::from_le_bytes(
                            buf[8..].try_into().expect("8"),
                        ));
                        if seq < probes && !std::mem::replace(&mut seen[seq], true) {
                            rtts.push(start.elapsed().saturating_sub(sent));
                            last_heard = Instant::now();
                        }
                    }
                    _ => {
                        let patience = rtts
                            .iter()
                            .max()
                            .map_or(Duration::ZERO, |m| *m * 2)
                            .max(Duration::from_secs(1));
                        if done_sending.load(Ordering::Relaxed) && last_heard.elapsed() > patience {
                            return Ok(rtts);
                        }
                    }
                }
            }
        })
    };
    for seq in 0..probes {
        let due = interval * seq as u32;
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let mut msg = [0u8; 16];
        msg[..8].copy_from_slice(&(seq as u64).to_le_bytes());
        msg[8..].copy_from_slice(&(start.elapsed().as_nanos() as u64).to_le_bytes());
        // A full socket buffer is a loss like any other; the count shows it.
        let _ = sock.send(&msg);
    }
    done_sending.store(true, Ordering::Relaxed);
    let mut rtts = collect.join().expect("collector does not panic")?;
    rtts.sort();
    let received = rtts.len();
    let mean = if received == 0 {
        Duration::ZERO
    } else {
        rtts.iter().sum::<Duration>() / received as u32
    };
    Ok(Measurement {
        sent: probes,
        received,
        loss: 1.0 - received as f64 / probes.max(1) as f64,
        mean_rtt: mean,
        median_rtt: rtts.get(received / 2).copied().unwrap_or_default(),
    })
}
