//! `zerolayer-wan`: run the emulated link, or check it against its settings.
//!
//! ```text
//! zerolayer-wan up    --rtt-ms 50 --loss-pct 1 [--jitter-ms 0] [--rate-mbit 0] [--prefix zlwan] [--seed 1]
//! zerolayer-wan check --rtt-ms 50 --loss-pct 1 [--probes 20000] [...]
//! ```
//! `up` prints `ready ns_a=... addr_a=... ns_b=... addr_b=...` and forwards until SIGINT or
//! SIGTERM, then removes the namespaces and prints the packet counts. `check` measures the
//! round-trip time and loss with UDP probes and fails (exit 1) unless both are within 10% of
//! the settings (round-trip loss expected `1 - (1 - p)^2` for a per-direction loss `p`).

use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::{Parser, Subcommand};
use zerolayer_wan::{ADDR_A, ADDR_B, LinkConfig, Wan, WanConfig, stop_on_signals};

#[derive(Parser)]
#[command(about = "An emulated WAN link between two network namespaces")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Bring the link up and forward until SIGINT/SIGTERM.
    Up(LinkArgs),
    /// Measure the link with UDP probes and compare with the settings.
    Check {
        #[command(flatten)]
        link: LinkArgs,
        /// Probes to send (one every 200 µs).
        #[arg(long, default_value_t = 20_000)]
        probes: usize,
    },
}

#[derive(clap::Args)]
struct LinkArgs {
    /// Round-trip time in milliseconds (half of it each way).
    #[arg(long, default_value_t = 50.0)]
    rtt_ms: f64,
    /// Loss in percent, applied to each direction independently.
    #[arg(long, default_value_t = 0.0)]
    loss_pct: f64,
    /// One-way delay varies uniformly within ± this (milliseconds; never reorders).
    #[arg(long, default_value_t = 0.0)]
    jitter_ms: f64,
    /// Bottleneck rate per direction in Mbit/s (0: unlimited).
    #[arg(long, default_value_t = 0.0)]
    rate_mbit: f64,
    /// Namespace/device name prefix.
    #[arg(long, default_value = "zlwan")]
    prefix: String,
    /// Seed of the loss and jitter draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl LinkArgs {
    fn config(&self) -> WanConfig {
        let link = LinkConfig {
            delay: Duration::from_secs_f64(self.rtt_ms.max(0.0) / 2e3),
            jitter: Duration::from_secs_f64(self.jitter_ms.max(0.0) / 1e3),
            loss: (self.loss_pct / 100.0).clamp(0.0, 1.0),
            rate_bps: (self.rate_mbit > 0.0).then_some((self.rate_mbit * 1e6) as u64),
            ..LinkConfig::default()
        };
        WanConfig::new(&self.prefix, link).seed(self.seed)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stop = stop_on_signals();
    let (args, probes) = match &cli.command {
        Cmd::Up(a) => (a, None),
        Cmd::Check { link, probes } => (link, Some(*probes)),
    };
    let wan = match Wan::up(args.config()) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("zerolayer-wan: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(probes) = probes else {
        println!(
            "ready ns_a={} addr_a={ADDR_A} ns_b={} addr_b={ADDR_B}",
            wan.ns_a(),
            wan.ns_b()
        );
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
        }
        for (dir, s) in ["a->b", "b->a"].iter().zip(wan.stats()) {
            eprintln!(
                "zerolayer-wan {dir}: received {} lost {} queue-full {} delivered {}",
                s.received.load(Ordering::Relaxed),
                s.lost.load(Ordering::Relaxed),
                s.queue_full.load(Ordering::Relaxed),
                s.delivered.load(Ordering::Relaxed)
            );
        }
        return ExitCode::SUCCESS;
    };
    let m = match wan.measure(probes, Duration::from_micros(200)) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("zerolayer-wan: {e}");
            return ExitCode::from(2);
        }
    };
    let p = (args.loss_pct / 100.0).clamp(0.0, 1.0);
    let want_loss = 1.0 - (1.0 - p) * (1.0 - p);
    let rtt_ms = m.mean_rtt.as_secs_f64() * 1e3;
    let rtt_ok = (rtt_ms - args.rtt_ms).abs() <= 0.1 * args.rtt_ms.max(1.0);
    let loss_ok = (m.loss - want_loss).abs() <= 0.1 * want_loss + 0.001;
    println!(
        "rtt: set {:.1} ms, measured mean {rtt_ms:.2} ms (median {:.2}) {}; round-trip loss: expected {:.3}%, measured {:.3}% ({} of {}) {}",
        args.rtt_ms,
        m.median_rtt.as_secs_f64() * 1e3,
        if rtt_ok { "ok" } else { "OUT OF RANGE" },
        100.0 * want_loss,
        100.0 * m.loss,
        m.sent - m.received,
        m.sent,
        if loss_ok { "ok" } else { "OUT OF RANGE" },
    );
    if rtt_ok && loss_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
