//! weight-cache benches:
//! * `open`: opening the default model (a private copy, so it can be made cold) and how many bytes
//!   are resident right after opening a cold file (only the header should be read);
//! * `first_token`: reading every page of every tensor (what one forward step faults in) from a
//!   cold file, after a deterministic (23%) warm-up, and after a full warm-up;
//! * `touch`: the profiling hook's cost per call, next to a bare relaxed atomic increment.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use weight_cache::{CacheConfig, Gguf, WarmupStrategy, WeightCache, locate_default_model};

/// A private copy of the default model (other processes may map the original, which keeps it
/// resident), synced so its pages can be dropped.
fn private_copy() -> PathBuf {
    let src = locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    let dst = std::env::temp_dir().join(format!("zerolayer-bench-{}.gguf", std::process::id()));
    std::fs::copy(&src, &dst).unwrap();
    std::fs::File::open(&dst).unwrap().sync_all().unwrap();
    dst
}

fn open(path: &PathBuf) -> Arc<Gguf> {
    // SAFETY: the bench owns the private copy and never modifies it.
    Arc::new(unsafe { Gguf::open(path) }.unwrap())
}

fn read_all_tensor_pages(g: &Gguf) -> u64 {
    let mut acc = 0u64;
    for t in g.tensors() {
        for i in (0..t.data.len()).step_by(4096) {
            acc = acc.wrapping_add(u64::from(t.data[i]));
        }
    }
    acc
}

fn benches(c: &mut Criterion) {
    let path = private_copy();
    let g = open(&path);
    let cache = WeightCache::new(g.clone(), CacheConfig::default()).unwrap();
    let file_len = g.bytes().len();

    // Residency right after a cold open.
    cache.make_cold().unwrap();
    let t0 = Instant::now();
    let g2 = open(&path);
    let open_time = t0.elapsed();
    let c2 = WeightCache::new(g2.clone(), CacheConfig::default()).unwrap();
    let after_open = c2.resident_bytes().unwrap();
    println!(
        "cold open: {open_time:?}, resident after open {after_open} B of {file_len} B ({:.2}%), header {} B",
        100.0 * after_open as f64 / file_len as f64,
        g2.data_offset()
    );
    drop(c2);
    drop(g2);

    let mut group = c.benchmark_group("open");
    group.sample_size(20);
    group.bench_function("gguf_open_warm_page_cache", |b| b.iter(|| open(&path)));
    group.finish();

    let mut group = c.benchmark_group("first_token");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    let mut times = Vec::new();
    for (name, strategy) in [
        ("cold", WarmupStrategy::None),
        ("deterministic_23pct", WarmupStrategy::deterministic()),
        ("full_warm", WarmupStrategy::Full),
    ] {
        let mut total = Duration::ZERO;
        let mut n = 0u32;
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut d = Duration::ZERO;
                for _ in 0..iters {
                    cache.make_cold().unwrap();
                    cache.warm(strategy).wait();
                    let t = Instant::now();
                    black_box(read_all_tensor_pages(&g));
                    d += t.elapsed();
                }
                total += d;
                n += iters as u32;
                d
            })
        });
        times.push((name, total / n.max(1)));
    }
    group.finish();
    let cold = times[0].1.as_secs_f64();
    for (name, t) in &times {
        println!(
            "first-token weight access {name}: {t:?} (cold/this = {:.1}x)",
            cold / t.as_secs_f64()
        );
    }

    let mut group = c.benchmark_group("touch");
    let req = cache.begin_request();
    let n_t = g.tensor_count();
    for i in 0..n_t {
        cache.touch(i, req);
    }
    group.bench_function("weight_cache_touch_all_tensors", |b| {
        b.iter(|| {
            for i in 0..n_t {
                cache.touch(black_box(i), req);
            }
        })
    });
    let bare: Vec<AtomicU64> = (0..n_t).map(|_| AtomicU64::new(0)).collect();
    group.bench_function("peer_bare_fetch_add_all_tensors", |b| {
        b.iter(|| {
            for a in &bare {
                black_box(a).fetch_add(1, Ordering::Relaxed);
            }
        })
    });
    group.finish();
    println!(
        "touch: {n_t} tensors per iteration (divide the times above by {n_t} for ns per touch)"
    );

    let _ = std::fs::remove_file(&path);
}

criterion_group!(benches_group, benches);
criterion_main!(benches_group);
