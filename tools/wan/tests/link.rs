//! The emulated link measured end to end (UDP probes through the TUN forwarder): round-trip
//! time and loss within 10% of the settings. Needs root, `/dev/net/tun` and `ip`; without them
//! the test says why and passes without measuring.

use std::time::Duration;

use zerolayer_wan::{LinkConfig, Wan, WanConfig, WanError};

fn link(prefix: &str, rtt_ms: u64, loss: f64) -> Option<Wan> {
    let cfg = LinkConfig {
        delay: Duration::from_millis(rtt_ms) / 2,
        loss,
        ..LinkConfig::default()
    };
    match Wan::up(WanConfig::new(prefix, cfg).seed(42)) {
        Ok(w) => Some(w),
        Err(e @ (WanError::Ip { .. } | WanError::Tun { .. })) => {
            println!("SKIPPED: cannot create namespaces/TUN devices here: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn within(measured: f64, want: f64, rel: f64) -> bool {
    (measured - want).abs() <= rel * want
}

#[test]
fn rtt_and_loss_match_the_settings() {
    let Some(wan) = link("zlwt", 50, 0.03) else {
        return;
    };
    let m = wan.measure(20_000, Duration::from_micros(200)).unwrap();
    let want_loss = 1.0 - 0.97 * 0.97;
    let rtt = m.mean_rtt.as_secs_f64();
    assert!(within(rtt, 0.050, 0.1), "{m:?}");
    assert!(within(m.loss, want_loss, 0.1), "{m:?}");
    let [ab, ba] = wan.stats();
    use std::sync::atomic::Ordering::Relaxed;
    assert!(ab.lost.load(Relaxed) > 0 && ba.lost.load(Relaxed) > 0);
    drop(wan);
    assert!(!Wan::ns_path("zlwt-a").exists(), "namespace left behind");
}

#[test]
fn a_lossless_link_loses_nothing() {
    let Some(wan) = link("zlwt0", 20, 0.0) else {
        return;
    };
    let m = wan.measure(2_000, Duration::from_micros(200)).unwrap();
    assert_eq!(m.received, m.sent, "{m:?}");
    assert!(within(m.mean_rtt.as_secs_f64(), 0.020, 0.1), "{m:?}");
}
