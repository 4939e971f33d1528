//! kv-ring benches on the default model's KV shape (SmolLM2-135M: 30 layers, 3 kv heads,
//! head_dim 64): decode append, prefill-chunk append, view read-through, pool alloc/free.
//!
//! Peer: a naive growable cache (one `Vec<f32>` per (layer, head) for K and V, extended per
//! token: the "concatenate per step" design), in the same run. After criterion, a short
//! Instant-timed pass prints ratios (ours / peer) and the memory table of the README.
//!
//! Run: `cargo bench -p zerolayer-kv-ring --bench kv_ring`
#![allow(missing_docs)] // criterion_group! generates an undocumented fn

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use kv_ring::{KvDtype, KvPool, KvRing, KvShape, KvSlices, RingMode};

const LAYERS: usize = 30;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const ROW: usize = KV_HEADS * HEAD_DIM;

fn shape(dtype: KvDtype) -> KvShape {
    KvShape::new(LAYERS, KV_HEADS, HEAD_DIM, dtype)
}

fn dtype_name(d: KvDtype) -> &'static str {
    if d == KvDtype::F16 { "f16" } else { "f32" }
}

/// The peer: per (layer, head) growable K and V vectors.
struct NaiveCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl NaiveCache {
    fn new() -> Self {
        Self {
            k: vec![Vec::new(); LAYERS * KV_HEADS],
            v: vec![Vec::new(); LAYERS * KV_HEADS],
        }
    }
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        for (tok_k, tok_v) in k.chunks_exact(ROW).zip(v.chunks_exact(ROW)) {
            for h in 0..KV_HEADS {
                let r = h * HEAD_DIM..(h + 1) * HEAD_DIM;
                self.k[layer * KV_HEADS + h].extend_from_slice(&tok_k[r.clone()]);
                self.v[layer * KV_HEADS + h].extend_from_slice(&tok_v[r]);
            }
        }
    }
}

fn ring_append(ring: &mut KvRing, n: usize, k: &[f32], v: &[f32]) {
    ring.begin(n).unwrap();
    for layer in 0..LAYERS {
        ring.write_layer(layer, k, v).unwrap();
    }
    ring.commit().unwrap();
}

/// Attention-like read-through of one (layer, head): q.k for every row, then sum of values.
fn dot_rows(keys: KvSlices<'_>, values: KvSlices<'_>, q: &[f32]) -> f32 {
    let mut acc = 0.0;
    match (keys, values) {
        (KvSlices::F32(ks), KvSlices::F32(vs)) => {
            for (k, v) in ks.iter().zip(vs.iter()) {
                for (kr, vr) in k.chunks_exact(HEAD_DIM).zip(v.chunks_exact(HEAD_DIM)) {
                    let s: f32 = kr.iter().zip(q).map(|(a, b)| a * b).sum();
                    acc += s * vr[0];
                }
            }
        }
        (KvSlices::F16(ks), KvSlices::F16(vs)) => {
            let mut kf = [0f32; HEAD_DIM];
            for (k, v) in ks.iter().zip(vs.iter()) {
                for (kr, vr) in k.chunks_exact(HEAD_DIM).zip(v.chunks_exact(HEAD_DIM)) {
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(kr, &mut kf);
                    let s: f32 = kf.iter().zip(q).map(|(a, b)| a * b).sum();
                    acc += s * vr[0].to_f32();
                }
            }
        }
        _ => unreachable!(),
    }
    acc
}

fn naive_dot(k: &[f32], v: &[f32], q: &[f32]) -> f32 {
    let mut acc = 0.0;
    for (kr, vr) in k.chunks_exact(HEAD_DIM).zip(v.chunks_exact(HEAD_DIM)) {
        let s: f32 = kr.iter().zip(q).map(|(a, b)| a * b).sum();
        acc += s * vr[0];
    }
    acc
}

fn data(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect()
}

fn bench_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("append");
    let tok = data(ROW);
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let pool = KvPool::new(shape(dtype), usize::MAX).unwrap();
        // Steady-state decode in a full, wrapping sliding ring (evicts and moves 4 sinks each step).
        let mut ring = pool.alloc(4096, RingMode::Sliding { sinks: 4 }).unwrap();
        for _ in 0..4096 {
            ring_append(&mut ring, 1, &tok, &tok);
        }
        g.throughput(Throughput::Elements(1));
        g.bench_function(
            BenchmarkId::new("decode_token_sliding4096", dtype_name(dtype)),
            |b| b.iter(|| ring_append(&mut ring, 1, black_box(&tok), black_box(&tok))),
        );
        // Strict 4096 ring, pages already touched (as a recycled buffer is), reset when full.
        let mut strict = pool.alloc(4096, RingMode::Strict).unwrap();
        for _ in 0..4096 {
            ring_append(&mut strict, 1, &tok, &tok);
        }
        strict.reset();
        g.bench_function(
            BenchmarkId::new("decode_token_strict", dtype_name(dtype)),
            |b| {
                b.iter(|| {
                    if strict.len() == strict.capacity() {
                        strict.reset();
                    }
                    ring_append(&mut strict, 1, black_box(&tok), black_box(&tok))
                })
            },
        );
        let chunk = data(512 * ROW);
        let mut big = pool.alloc(4096, RingMode::Strict).unwrap();
        g.throughput(Throughput::Elements(512));
        g.bench_function(
            BenchmarkId::new("prefill_chunk512", dtype_name(dtype)),
            |b| {
                b.iter(|| {
                    if big.len() + 512 > big.capacity() {
                        big.reset();
                    }
                    ring_append(&mut big, 512, black_box(&chunk), black_box(&chunk))
                })
            },
        );
    }
    let mut naive = NaiveCache::new();
    g.throughput(Throughput::Elements(1));
    g.bench_function(
        BenchmarkId::new("decode_token_peer_vec_growth", "f32"),
        |b| {
            b.iter(|| {
                if naive.k[0].len() >= 4096 * HEAD_DIM {
                    naive = NaiveCache::new();
                }
                for layer in 0..LAYERS {
                    naive.append(layer, black_box(&tok), black_box(&tok));
                }
            })
        },
    );
    g.finish();
}

fn bench_view(c: &mut Criterion) {
    let mut g = c.benchmark_group("view");
    let ctx = 1024;
    let tok = data(ROW);
    let q = data(HEAD_DIM);
    g.throughput(Throughput::Elements((LAYERS * KV_HEADS * ctx) as u64)); // rows read
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let pool = KvPool::new(shape(dtype), usize::MAX).unwrap();
        let mut ring = pool.alloc(ctx, RingMode::Sliding { sinks: 4 }).unwrap();
        for _ in 0..ctx + 100 {
            ring_append(&mut ring, 1, &tok, &tok); // wrapped: two runs per view
        }
        g.bench_function(
            BenchmarkId::new("all_heads_read_through_ctx1024", dtype_name(dtype)),
            |b| {
                b.iter(|| {
                    let mut acc = 0.0;
                    for l in 0..LAYERS {
                        for h in 0..KV_HEADS {
                            let view = ring.view(l, h).unwrap();
                            acc += dot_rows(view.keys, view.values, &q);
                        }
                    }
                    acc
                })
            },
        );
        g.bench_function(
            BenchmarkId::new("view_only_90_heads", dtype_name(dtype)),
            |b| {
                b.iter(|| {
                    let mut n = 0;
                    for l in 0..LAYERS {
                        for h in 0..KV_HEADS {
                            n += black_box(ring.view(l, h).unwrap()).len;
                        }
                    }
                    n
                })
            },
        );
    }
    let mut naive = NaiveCache::new();
    for layer in 0..LAYERS {
        naive.append(layer, &data(ctx * ROW), &data(ctx * ROW));
    }
    g.bench_function(
        BenchmarkId::new("all_heads_read_through_ctx1024_peer_vec", "f32"),
        |b| {
            b.iter(|| {
                let mut acc = 0.0;
                for i in 0..LAYERS * KV_HEADS {
                    acc += naive_dot(&naive.k[i], &naive.v[i], &q);
                }
                acc
            })
        },
    );
    g.finish();
}

fn bench_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let s = shape(dtype);
        let pool = KvPool::new(s, 8 * 4096 * s.bytes_per_token()).unwrap();
        drop(pool.alloc(4096, RingMode::Strict).unwrap()); // prime the free list
        g.bench_function(
            BenchmarkId::new("alloc_free_recycled_ctx4096", dtype_name(dtype)),
            |b| b.iter(|| drop(black_box(pool.alloc(4096, RingMode::Strict).unwrap()))),
        );
        let fresh = KvPool::new(s, 8 * 4096 * s.bytes_per_token()).unwrap();
        fresh.set_recycling(false);
        g.bench_function(
            BenchmarkId::new("alloc_free_fresh_ctx4096", dtype_name(dtype)),
            |b| b.iter(|| drop(black_box(fresh.alloc(4096, RingMode::Strict).unwrap()))),
        );
        let elems = 4096 * s.bytes_per_token() / 4;
        g.bench_function(
            BenchmarkId::new("peer_vec_zeroed_alloc_free_ctx4096", dtype_name(dtype)),
            |b| b.iter(|| drop(black_box(vec![0f32; elems]))),
        );
    }
    g.finish();
}

/// Median ns per call of `f` over a few short rounds (one very short one under `cargo test`,
/// which runs this without `--bench`).
fn time_ns(mut f: impl FnMut()) -> f64 {
    let full = std::env::args().any(|a| a == "--bench");
    let (count, span) = if full { (7, 60) } else { (1, 2) };
    for _ in 0..100 {
        f();
    }
    let mut rounds: Vec<f64> = (0..count)
        .map(|_| {
            let (mut n, t0) = (0u64, Instant::now());
            while t0.elapsed() < Duration::from_millis(span) {
                f();
                n += 1;
            }
            t0.elapsed().as_nanos() as f64 / n as f64
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[rounds.len() / 2]
}

fn ratios() {
    println!("\n== ratios (Instant-timed medians, same process) ==");
    let tok = data(ROW);
    let pool = KvPool::new(shape(KvDtype::F32), usize::MAX).unwrap();
    let mut ring = pool.alloc(4096, RingMode::Strict).unwrap();
    for _ in 0..4096 {
        ring_append(&mut ring, 1, &tok, &tok);
    }
    ring.reset();
    let ours = time_ns(|| {
        if ring.len() == ring.capacity() {
            ring.reset();
        }
        ring_append(&mut ring, 1, &tok, &tok)
    });
    let mut naive = NaiveCache::new();
    let peer = time_ns(|| {
        if naive.k[0].len() >= 4096 * HEAD_DIM {
            naive = NaiveCache::new();
        }
        for layer in 0..LAYERS {
            naive.append(layer, &tok, &tok);
        }
    });
    println!(
        "decode append f32: kv-ring {ours:.0} ns, vec-growth peer {peer:.0} ns, peer/ours = {:.2}x",
        peer / ours
    );

    let ctx = 1024;
    let q = data(HEAD_DIM);
    let mut results = Vec::new();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let pool = KvPool::new(shape(dtype), usize::MAX).unwrap();
        let mut r = pool.alloc(ctx, RingMode::Sliding { sinks: 4 }).unwrap();
        for _ in 0..ctx + 100 {
            ring_append(&mut r, 1, &tok, &tok);
        }
        results.push(time_ns(|| {
            let mut acc = 0.0;
            for l in 0..LAYERS {
                for h in 0..KV_HEADS {
                    let v = r.view(l, h).unwrap();
                    acc += dot_rows(v.keys, v.values, &q);
                }
            }
            black_box(acc);
        }));
    }
    let mut naive = NaiveCache::new();
    for layer in 0..LAYERS {
        naive.append(layer, &data(ctx * ROW), &data(ctx * ROW));
    }
    let peer = time_ns(|| {
        let mut acc = 0.0;
        for i in 0..LAYERS * KV_HEADS {
            acc += naive_dot(&naive.k[i], &naive.v[i], &q);
        }
        black_box(acc);
    });
    println!(
        "read-through ctx {ctx}, 90 heads: kv-ring f32 {:.0} us, f16 {:.0} us, vec peer {:.0} us; peer/ours f32 = {:.2}x, f16 = {:.2}x",
        results[0] / 1e3,
        results[1] / 1e3,
        peer / 1e3,
        peer / results[0],
        peer / results[1]
    );

    let s = shape(KvDtype::F16);
    let pool = KvPool::new(s, 8 * 4096 * s.bytes_per_token()).unwrap();
    drop(pool.alloc(4096, RingMode::Strict).unwrap());
    let recycled = time_ns(|| drop(black_box(pool.alloc(4096, RingMode::Strict).unwrap())));
    pool.set_recycling(false);
    pool.trim();
    let fresh = time_ns(|| drop(black_box(pool.alloc(4096, RingMode::Strict).unwrap())));
    println!(
        "alloc+free ctx 4096 f16 ring (94 MB): recycled {recycled:.0} ns, fresh {fresh:.0} ns, fresh/recycled = {:.1}x",
        fresh / recycled
    );

    println!("\n== memory per 1,000 streams, SmolLM2-135M shape (30 x 3 x 64) ==");
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let s = shape(dtype);
        let bpt = s.bytes_per_token();
        for ctx in [2048usize, 4096, 8192] {
            let bytes = bpt * ctx * 1000;
            println!(
                "{}: {bpt} B/token, ctx {ctx}: {:.1} MiB/stream, {:.2} GiB per 1,000 streams ({bytes} B)",
                dtype_name(dtype),
                (bpt * ctx) as f64 / (1u64 << 20) as f64,
                bytes as f64 / (1u64 << 30) as f64
            );
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = bench_append, bench_view, bench_pool
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    ratios();
}
