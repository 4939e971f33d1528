//! Attention kernel throughput (`gpu_pipeline::attend_rows`) on f16 and q8_0 kv-ring views
//! with head dim 64 (SmolLM2's), one thread: decode (one token's GQA group of 3 query rows against
//! 64..2048 keys, from cache and from DRAM: many rings cycled) and a prefill block (16 tokens x 3
//! heads, causal, against 600 keys). Prints ns per key and GMAC/s next to a plain loop over the
//! same K/V converted to f32 beforehand (dot products, a max-subtracted softmax, the weighted
//! value sum; compiled for the default target) and the ratio.
//!
//! Run: `cargo bench -p zerolayer-gpu-pipeline --bench attention`.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpu_pipeline::attend_rows;
use kv_ring::{KvDtype, KvPool, KvRing, KvShape, KvSlices, KvView, RingMode};

const HD: usize = 64;

fn rings(dtype: KvDtype, n_rings: usize, keys: usize) -> (std::sync::Arc<KvPool>, Vec<KvRing>) {
    let shape = KvShape {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: HD,
        dtype,
    };
    let pool = KvPool::new(shape, n_rings * (keys + 1) * shape.bytes_per_token()).unwrap();
    let rings = (0..n_rings)
        .map(|r| {
            let mut kv = pool.alloc(keys, RingMode::Strict).unwrap();
            let k: Vec<f32> = (0..keys * HD)
                .map(|i| ((i * 7 + r * 13) as f32 * 0.011).sin())
                .collect();
            let v: Vec<f32> = k.iter().map(|x| x * 0.5 + 0.1).collect();
            kv.begin(keys).unwrap();
            kv.write_layer(0, &k, &v).unwrap();
            kv.commit().unwrap();
            kv
        })
        .collect();
    (pool, rings)
}

/// A view's K and V as f32 (converted once, outside the timed loop; q8_0 dequantized).
fn as_f32(view: &KvView<'_>) -> (Vec<f32>, Vec<f32>) {
    let f = |s: &KvSlices<'_>| -> Vec<f32> {
        match s {
            KvSlices::F16([x, _]) => x.iter().map(|h| h.to_f32()).collect(),
            KvSlices::Q8_0([x, _]) => (0..x.q.len()).map(|i| x.get(i).unwrap()).collect(),
            _ => unreachable!("the bench writes unwrapped f16 and q8_0 rings"),
        }
    };
    (f(&view.keys), f(&view.values))
}

/// The scalar reference: the same quantity, computed the plain way over f32 K/V.
fn naive(q: &[f32], n_keys: &[usize], kv: &(Vec<f32>, Vec<f32>), scale: f32, out: &mut [f32]) {
    let (k, v) = kv;
    let mut s = vec![0.0f32; k.len() / HD];
    for (r, &n) in n_keys.iter().enumerate() {
        let qr = &q[r * HD..][..HD];
        for (j, sj) in s.iter_mut().enumerate().take(n) {
            let kj = &k[j * HD..][..HD];
            *sj = qr.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
        }
        let m = s[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0.0;
        for sj in &mut s[..n] {
            *sj = (*sj - m).exp();
            z += *sj;
        }
        let o = &mut out[r * HD..][..HD];
        o.fill(0.0);
        for (j, &p) in s[..n].iter().enumerate() {
            for (oi, vi) in o.iter_mut().zip(&v[j * HD..][..HD]) {
                *oi += p * vi;
            }
        }
        o.iter_mut().for_each(|x| *x /= z);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds per call of `f` over ~0.3 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) || samples.len() < 5 {
        let t = Instant::now();
        for _ in 0..10 {
            f();
        }
        samples.push(t.elapsed().as_secs_f64() / 10.0);
    }
    median(samples)
}

/// (name, K/V type, rings, keys, query rows' key counts)
fn cases() -> Vec<(String, KvDtype, usize, usize, Vec<usize>)> {
    let mut v = Vec::new();
    for (dtype, tn) in [(KvDtype::F16, "f16"), (KvDtype::Q8_0, "q8_0")] {
        for keys in [64usize, 512, 2048] {
            v.push((
                format!("{tn}_decode_{keys}_cached"),
                dtype,
                1,
                keys,
                vec![keys; 3],
            ));
            // Enough rings (>= 96 MiB of f16 K/V) that each call reads DRAM, as in batched
            // decoding.
            let n = (96usize << 20).div_ceil(keys * HD * 4);
            v.push((
                format!("{tn}_decode_{keys}_dram"),
                dtype,
                n,
                keys,
                vec![keys; 3],
            ));
        }
        let nk: Vec<usize> = (0..48).map(|r| 600 - 16 + r / 3 + 1).collect();
        v.push((format!("{tn}_prefill_48x600"), dtype, 1, 600, nk));
    }
    v
}

/// Queries, output and kernel scratch for query rows with key counts `nk`.
fn buffers(nk: &[usize]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let q = (0..nk.len() * HD)
        .map(|i| (i as f32 * 0.03).cos())
        .collect();
    (q, vec![0.0f32; nk.len() * HD], Vec::new())
}

/// One `attend_rows` call per invocation, on the next view in turn (so that the DRAM cases
/// read a ring not touched for a while).
fn caller<'a>(
    views: &'a [KvView<'a>],
    q: &'a [f32],
    nk: &'a [usize],
    scratch: &'a mut Vec<f32>,
    out: &'a mut [f32],
) -> impl FnMut() + 'a {
    let mut i = 0;
    move || {
        attend_rows(
            black_box(q),
            nk,
            HD,
            &views[i % views.len()],
            0.125,
            scratch,
            out,
        );
        i += 1;
    }
}

fn summary() {
    println!("attention summary: head dim {HD}, 1 thread; medians");
    println!(
        "| case | ns per call | ns per key (per row group) | GMAC/s | plain loop GMAC/s | ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, dtype, n_rings, keys, nk) in cases() {
        let (_pool, rs) = rings(dtype, n_rings, keys);
        let views: Vec<KvView<'_>> = rs.iter().map(|r| r.view(0, 0).unwrap()).collect();
        let (q, mut out, mut scratch) = buffers(&nk);
        let fast = time(caller(&views, &q, &nk, &mut scratch, &mut out));
        let f32s: Vec<_> = views.iter().map(as_f32).collect();
        let mut i = 0;
        let slow = time(|| {
            naive(&q, &nk, &f32s[i % f32s.len()], 0.125, &mut out);
            i += 1;
        });
        let macs = 2.0 * (nk.iter().sum::<usize>() * HD) as f64;
        let groups = nk.len().div_ceil(3) as f64;
        println!(
            "| {name} | {:.0} | {:.1} | {:.2} | {:.2} | {:.1}x |",
            fast * 1e9,
            fast * 1e9 / (keys as f64 * groups),
            macs / fast / 1e9,
            macs / slow / 1e9,
            slow / fast
        );
    }
}

fn bench(c: &mut Criterion) {
    summary();
    let mut g = c.benchmark_group("attention_1t");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    for (name, dtype, n_rings, keys, nk) in cases() {
        let (_pool, rs) = rings(dtype, n_rings, keys);
        let views: Vec<KvView<'_>> = rs.iter().map(|r| r.view(0, 0).unwrap()).collect();
        let (q, mut out, mut scratch) = buffers(&nk);
        g.throughput(Throughput::Elements(nk.iter().sum::<usize>() as u64));
        let mut call = caller(&views, &q, &nk, &mut scratch, &mut out);
        g.bench_function(name, |b| b.iter(&mut call));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
