//! The link model, without I/O: what happens to a packet that enters one direction of the
//! link at a given time. A packet is lost at random (independently, with the configured
//! probability), dropped at the tail when the queue is full, or delivered at
//! `max(serialised + delay + jitter, previous delivery)`: a FIFO link, so jitter never reorders
//! packets (as a real path mostly does not; `netem` without a rate reorders).

use std::time::Duration;

/// One direction of an emulated link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkConfig {
    /// One-way propagation delay (half the round-trip time of a symmetric link).
    pub delay: Duration,
    /// Each packet's delay varies uniformly within `delay ± jitter` (never below zero).
    pub jitter: Duration,
    /// Probability that a packet is lost, independently of the others (0.0 ..= 1.0).
    pub loss: f64,
    /// Bottleneck rate in bits per second (`None`: unlimited): packets are serialised one
    /// after another at this rate before the delay applies.
    pub rate_bps: Option<u64>,
    /// Drop-tail limit of the queue, in bytes (packets waiting to be delivered).
    pub queue_bytes: usize,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            rate_bps: None,
            queue_bytes: 8 << 20,
        }
    }
}

/// What the link does with a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Deliver it at this time (the same clock as the arrival time).
    Deliver(Duration),
    /// Lost at random.
    Lost,
    /// Dropped: the queue already holds `queue_bytes`.
    QueueFull,
}

/// One direction's state: the random generator, when the bottleneck is free again, the last
/// delivery time and the bytes queued.
#[derive(Debug, Clone)]
pub struct Shaper {
    config: LinkConfig,
    rng: u64,
    link_free: Duration,
    last_delivery: Duration,
    queued: usize,
}

impl Shaper {
    /// A link direction with its own random stream (`seed`; any value, 0 included).
    pub fn new(config: LinkConfig, seed: u64) -> Self {
        Self {
            config,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
            link_free: Duration::ZERO,
            last_delivery: Duration::ZERO,
            queued: 0,
        }
    }

    /// Decides the fate of a packet of `len` bytes arriving at `now`; a delivered packet counts
    /// as queued until [`Shaper::delivered`] is called for it.
    pub fn admit(&mut self, now: Duration, len: usize) -> Verdict {
        if self.uniform() < self.config.loss {
            return Verdict::Lost;
        }
        if self.queued + len > self.config.queue_bytes {
            return Verdict::QueueFull;
        }
        let sent = match self.config.rate_bps {
            Some(bps) if bps > 0 => {
                let start = now.max(self.link_free);
                let wire =
                    Duration::from_nanos((len as u64 * 8).saturating_mul(1_000_000_000) / bps);
                self.link_free = start + wire;
                self.link_free
            }
            _ => now,
        };
        let jitter = self.config.jitter.as_secs_f64() * (2.0 * self.uniform() - 1.0);
        let delay = (self.config.delay.as_secs_f64() + jitter).max(0.0);
        let at = (sent + Duration::from_secs_f64(delay)).max(self.last_delivery);
        self.last_delivery = at;
        self.queued += len;
        Verdict::Deliver(at)
    }

    /// A packet of `len` bytes admitted earlier has been delivered.
    pub fn delivered(&mut self, len: usize) {
        self.queued = self.queued.saturating_sub(len);
    }

    /// A uniform sample in [0, 1) (xorshift64*).
    fn uniform(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let x = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn loss_matches_the_probability() {
        for loss in [0.0, 0.01, 0.03, 0.5] {
            let mut s = Shaper::new(
                LinkConfig {
                    loss,
                    ..LinkConfig::default()
                },
                7,
            );
            let n = 200_000;
            let lost = (0..n)
                .filter(|&i| {
                    let v = s.admit(Duration::from_micros(i), 100);
                    s.delivered(100);
                    v == Verdict::Lost
                })
                .count();
            let rate = lost as f64 / n as f64;
            assert!(
                (rate - loss).abs() <= 0.1 * loss + 1e-9,
                "loss {loss}: measured {rate}"
            );
        }
    }

    #[test]
    fn delay_and_jitter_stay_in_range_and_never_reorder() {
        let config = LinkConfig {
            delay: ms(25),
            jitter: ms(5),
            ..LinkConfig::default()
        };
        // Dense packets (0.5 ms apart, closer than the jitter): order kept, delay in range.
        let mut s = Shaper::new(config, 1);
        let mut last = Duration::ZERO;
        for i in 0..10_000u64 {
            let now = Duration::from_micros(i * 500);
            let Verdict::Deliver(at) = s.admit(now, 1200) else {
                panic!("no loss configured")
            };
            s.delivered(1200);
            assert!(at >= last, "reordered");
            assert!(at >= now + ms(20) && at <= now + ms(30), "{:?}", at - now);
            last = at;
        }
        // Sparse packets (20 ms apart): the jitter averages out to the delay.
        let mut s = Shaper::new(config, 2);
        let mut sum = 0.0;
        for i in 0..10_000u64 {
            let now = ms(i * 20);
            let Verdict::Deliver(at) = s.admit(now, 1200) else {
                panic!("no loss configured")
            };
            s.delivered(1200);
            sum += (at - now).as_secs_f64();
        }
        let mean = sum / 10_000.0;
        assert!((mean - 0.025).abs() < 0.0002, "mean delay {mean}");
    }

    #[test]
    fn the_rate_limit_serialises_packets_and_the_queue_is_bounded() {
        // 8 Mbit/s: a 1000-byte packet takes 1 ms on the wire.
        let config = LinkConfig {
            delay: ms(10),
            rate_bps: Some(8_000_000),
            queue_bytes: 5_000,
            ..LinkConfig::default()
        };
        let mut s = Shaper::new(config, 3);
        let at: Vec<Verdict> = (0..6).map(|_| s.admit(Duration::ZERO, 1000)).collect();
        for (k, v) in at.iter().take(5).enumerate() {
            assert_eq!(*v, Verdict::Deliver(ms(11 + k as u64)));
        }
        assert_eq!(at[5], Verdict::QueueFull);
        s.delivered(1000);
        assert_eq!(s.admit(Duration::ZERO, 1000), Verdict::Deliver(ms(16)));
    }
}
