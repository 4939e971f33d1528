//! Kernel throughput: matvec GB/s of weight bytes per dtype on the default model's shapes, matmul
//! GFLOP/s for n = 8, 64, 512 (also on a 1.7B and an 8B Llama's FFN shapes), with 1 and 2 threads, plus
//! all matvecs of one decode step over the real default model (when present).
//!
//! Run: `cargo bench -p zerolayer-gpu-pipeline --bench kernels [-- FILTER]`; a filter (e.g. `q5_0` or
//! `q5_0|q2_K`) also restricts the summary to the dtypes it names. The summary measures the
//! backend [`CpuIsa::detect`] picks: `ZEROLAYER_KERNELS=avx2` gives the AVX2 figures on an
//! AVX-512 machine. A summary table (medians, effective
//! bandwidth as a share of the machine's read bandwidth measured in the same run by
//! `gpu_pipeline::read_bandwidth` (read-only sum over 3 x 1 GiB, best of 5, same threads), ratios to the scalar backend) is printed first; criterion
//! groups follow. Matvec inputs cycle over enough copies of the weights (>= 256 MiB and twice the
//! L3 cache) that they come from DRAM, as in decoding, not from the L3 cache.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpu_pipeline::ThreadPool;
use gpu_pipeline::kernels::{CpuIsa, GgmlType, PackedWeights, WeightMatrix, matmul_with};

/// The default model's shapes, a mixture of experts' expert matrix (`scripts/make_arch_models.py
/// --bench-moe`: 768 x 1024 gate/up), plus two larger than L3 (the last one for the 256-element
/// block formats, which need rows of a multiple of 256).
const SHAPES: [(usize, usize); 6] = [
    (576, 576),
    (768, 1024),
    (1536, 576),
    (576, 1536),
    (49152, 576),
    (16384, 1536),
];
/// Matmul shapes: the default model's, a ~1.7B Llama's FFN (`ffn_up`/`ffn_gate` 8192 x 2048,
/// `ffn_down` 2048 x 8192) for the 256-element block formats (the default model's only
/// K-quant-sized shape is 576 x 1536), and an 8B Llama's FFN (14336 x 4096, 4096 x 14336: the
/// matrices of the 4-5 GB Q4_K_M files people run).
const MATMUL_SHAPES: [(usize, usize); 7] = [
    (576, 576),
    (1536, 576),
    (576, 1536),
    (8192, 2048),
    (2048, 8192),
    (14336, 4096),
    (4096, 14336),
];
const DTYPES: [GgmlType; 15] = [
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

/// Whether the command line's filter (the first non-flag argument, `|`- or `,`-separated
/// dtype names) selects `dtype`; no filter selects all.
fn selected(dtype: GgmlType) -> bool {
    let Some(filter) = std::env::args().skip(1).find(|a| !a.starts_with('-')) else {
        return true;
    };
    filter
        .split(['|', ','])
        .any(|part| part.eq_ignore_ascii_case(dtype.name()) || dtype.name().contains(part))
}

/// Byte offsets of the f16 scale fields of a block (for random blocks with sane scales).
fn scale_offsets(dtype: GgmlType) -> &'static [usize] {
    match dtype {
        GgmlType::Q6_K => &[208],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        _ => &[0],
    }
}

fn weights(dtype: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    match weight_cache::quantize(dtype, &v) {
        Ok(b) => b,
        // No reference quantizer for this type: random bytes with sane f16 scales.
        Err(_) => {
            let rb = dtype.row_bytes(cols).unwrap();
            let mut b: Vec<u8> = (0..rows * rb)
                .map(|i| (i as u64).wrapping_mul(0x9E37_79B9) as u8 >> 1)
                .collect();
            let bs = dtype.type_size();
            for blk in b.chunks_exact_mut(bs) {
                for &off in scale_offsets(dtype) {
                    blk[off..off + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                }
            }
            b
        }
    }
}

/// Bytes the matvec inputs cycle over so that they come from DRAM: at least 256 MiB and twice
/// the last-level cache (a 300 MiB L3 holds 256 MiB).
fn dram_bytes() -> usize {
    let l3 = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
            let k = match unit {
                "K" => 1 << 10,
                "M" => 1 << 20,
                _ => 1,
            };
            num.parse::<usize>().ok().map(|n| n * k)
        })
        .unwrap_or(0);
    (256usize << 20).max(2 * l3)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `f` over a ~`budget` run.
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 5 {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
    }
    median(samples)
}

fn summary() {
    let best = CpuIsa::detect();
    println!("kernels summary: backend {best:?}");
    for threads in [1usize, 2] {
        let pool = ThreadPool::new(threads);
        let peak = gpu_pipeline::read_bandwidth(&pool, 1 << 30, 3, 5).best_gbs;
        println!(
            "\nread bandwidth, {threads} thread(s): {peak:.1} GB/s (read-only sum over 3 x 1 GiB, best of 5)"
        );
        println!("\n== matvec (decode), {threads} thread(s): GB/s of weight bytes ==");
        println!(
            "{:<6} {:>12} {:>9} {:>7} {:>11} {:>13} {:>13} {:>14}",
            "dtype",
            "shape",
            "GB/s",
            "of bw",
            "vs scalar",
            "cached GB/s",
            "packed GB/s",
            "packed cached"
        );
        for dtype in DTYPES.into_iter().filter(|&d| selected(d)) {
            for (rows, cols) in SHAPES {
                if dtype.row_bytes(cols).is_none() {
                    continue;
                }
                let one = weights(dtype, rows, cols, 1);
                let bytes = one.len();
                let copies = dram_bytes().div_ceil(bytes).max(2);
                let all: Vec<u8> = one.iter().copied().cycle().take(bytes * copies).collect();
                let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
                let mut y = vec![0.0f32; rows];
                let mut run = |backend: CpuIsa, budget: Duration| {
                    let mut i = 0;
                    time(budget, || {
                        let w =
                            WeightMatrix::new(dtype, rows, cols, &all[i * bytes..(i + 1) * bytes])
                                .unwrap();
                        matmul_with(backend, w, black_box(&x), 1, &mut y, &pool).unwrap();
                        i = (i + 1) % copies;
                    })
                };
                let t = run(best, Duration::from_millis(300));
                let hot = {
                    let w = WeightMatrix::new(dtype, rows, cols, &one).unwrap();
                    let mut y = vec![0.0f32; rows];
                    time(Duration::from_millis(100), || {
                        matmul_with(best, w, black_box(&x), 1, &mut y, &pool).unwrap();
                    })
                };
                let ts = run(CpuIsa::Scalar, Duration::from_millis(100));
                let gbs = bytes as f64 / t / 1e9;
                // The same products on packed copies (row-interleaved layout), when it exists.
                let packed = packed_matvec(dtype, rows, cols, &one, copies, &x, &pool);
                let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
                println!(
                    "{:<6} {:>12} {:>9.2} {:>6.0}% {:>10.1}x {:>13.2} {:>13} {:>14}",
                    dtype.name(),
                    format!("{rows}x{cols}"),
                    gbs,
                    100.0 * gbs / peak,
                    ts / t,
                    bytes as f64 / hot / 1e9,
                    show(packed.map(|p| p.0)),
                    show(packed.map(|p| p.1)),
                );
            }
        }
        // The int8 peak, measured before and after the table (it moves with the machine's
        // load); each integer product's share is of the mean of the two.
        let int8 = || gpu_pipeline::int8_peak(&pool, 5).map(|p| (p.best_gops, p.block_gops));
        let int8_before = int8();
        println!("\n== matmul (prefill), {threads} thread(s): GFLOP/s (2*rows*cols*n / s) ==");
        println!(
            "{:<6} {:>12} {:>5} {:>9} {:>11}",
            "dtype", "shape", "n", "GFLOP/s", "ms"
        );
        let mut shares: Vec<(String, f64)> = Vec::new();
        for dtype in DTYPES.into_iter().filter(|&d| selected(d)) {
            // `cargo test` runs this summary as a smoke test (no `--bench` argument): the
            // default model's shapes only, not the 1.7B ones (minutes of set-up on 2 cores).
            let full = std::env::args().any(|a| a == "--bench");
            for (rows, cols) in MATMUL_SHAPES.into_iter().take(if full { 7 } else { 3 }) {
                if dtype.row_bytes(cols).is_none() {
                    continue;
                }
                let data = weights(dtype, rows, cols, 2);
                let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
                let p = PackedWeights::pack(w, &pool).unwrap();
                for n in [8usize, 64, 512] {
                    let x: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.013).sin()).collect();
                    let mut y = vec![0.0f32; n * rows];
                    let flops = 2.0 * (rows * cols * n) as f64;
                    let mut t_of = |w: WeightMatrix<'_>| {
                        time(Duration::from_millis(200), || {
                            matmul_with(best, w, black_box(&x), n, &mut y, &pool).unwrap();
                        })
                    };
                    let t = t_of(w);
                    let tp = p.as_ref().map(|p| t_of(p.matrix()));
                    if !matches!(dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                        let best_t = tp.map_or(t, |tp| tp.min(t));
                        shares.push((
                            format!("{} {rows}x{cols} n={n}", dtype.name()),
                            flops / best_t / 1e9,
                        ));
                    }
                    println!(
                        "{:<6} {:>12} {:>5} {:>9.1} {:>11.3}{}",
                        dtype.name(),
                        format!("{rows}x{cols}"),
                        n,
                        flops / t / 1e9,
                        t * 1e3,
                        tp.map_or(String::new(), |tp| format!(
                            "   packed {:.1} GFLOP/s",
                            flops / tp / 1e9
                        ))
                    );
                }
            }
        }
        if let (Some((a, ba)), Some((b, bb))) = (int8_before, int8())
            && !shares.is_empty()
        {
            let peak8 = (a + b) / 2.0;
            let block8 = (ba + bb) / 2.0;
            println!(
                "\nint8 peak, {threads} thread(s): {a:.0} / {b:.0} GOP/s before / after the table \
                 (vpdpbusd zmm on registers, best of 5); with the exact per-block scaling \
                 (`Int8Peak::block_gops`) {ba:.0} / {bb:.0}. Integer products (faster of file / \
                 packed layout) as a share of the means {peak8:.0} and {block8:.0}:"
            );
            for (what, g) in &shares {
                println!(
                    "  {what:<26} {g:>7.1} GOP/s {:>5.0}% {:>5.0}%",
                    100.0 * g / peak8,
                    100.0 * g / block8
                );
            }
        }
        if std::env::args().skip(1).all(|a| a.starts_with('-')) {
            model_step(&pool, threads, peak);
        }
    }
}

/// Matvec GB/s of `copies` packed copies of `one` (streamed from DRAM) and of one (cached), if
/// the format packs on this CPU.
fn packed_matvec(
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    one: &[u8],
    copies: usize,
    x: &[f32],
    pool: &ThreadPool,
) -> Option<(f64, f64)> {
    let w = WeightMatrix::new(dtype, rows, cols, one).unwrap();
    let first = PackedWeights::pack(w, pool).unwrap()?;
    let many: Vec<PackedWeights> = (1..copies)
        .map(|_| PackedWeights::pack(w, pool).unwrap().unwrap())
        .collect();
    let bytes = first.bytes_len() as f64;
    let mut y = vec![0.0f32; rows];
    let mut i = 0;
    let t = time(Duration::from_millis(300), || {
        let m = if i == 0 { &first } else { &many[i - 1] };
        matmul_with(CpuIsa::detect(), m.matrix(), black_box(x), 1, &mut y, pool).unwrap();
        i = (i + 1) % copies;
    });
    let hot = time(Duration::from_millis(100), || {
        matmul_with(
            CpuIsa::detect(),
            first.matrix(),
            black_box(x),
            1,
            &mut y,
            pool,
        )
        .unwrap();
    });
    Some((bytes / t / 1e9, bytes / hot / 1e9))
}

/// All matvecs of one decode step (and of a 512-token prefill) over the real default model.
fn model_step(pool: &ThreadPool, threads: usize, peak: f64) {
    let Ok(path) = weight_cache::locate_default_model() else {
        println!("(default model absent: skipping the model step)");
        return;
    };
    // SAFETY: the model file is not modified while the benchmark runs.
    let Ok(gguf) = (unsafe { weight_cache::Gguf::open(&path) }) else {
        return;
    };
    let mut mats: Vec<WeightMatrix<'_>> = gguf
        .tensors()
        .filter(|t| t.shape.len() == 2 && t.name.starts_with("blk."))
        .filter_map(|t| WeightMatrix::from_tensor(&t).ok())
        .collect();
    if let Some(t) = gguf
        .tensor("output.weight")
        .or_else(|| gguf.tensor("token_embd.weight"))
    {
        mats.push(WeightMatrix::from_tensor(&t).unwrap());
    }
    let bytes: usize = mats.iter().map(|m| m.data.len()).sum();
    let maxc = mats.iter().map(|m| m.cols).max().unwrap_or(0);
    let maxr = mats.iter().map(|m| m.rows).max().unwrap_or(0);
    for n in [1usize, 512] {
        let x: Vec<f32> = (0..n * maxc).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut y = vec![0.0f32; n * maxr];
        let t = time(
            Duration::from_millis(if n == 1 { 1500 } else { 3000 }),
            || {
                for m in &mats {
                    let (xs, ys) = (&x[..n * m.cols], &mut y[..n * m.rows]);
                    matmul_with(CpuIsa::detect(), *m, xs, n, ys, pool).unwrap();
                }
            },
        );
        if n == 1 {
            println!(
                "\nmodel decode step ({threads} thr): {} matrices, {:.1} MB, {:.3} ms -> {:.1} GB/s ({:.0}% of the {peak:.1} GB/s read bandwidth), matvec-only ceiling {:.0} tok/s",
                mats.len(),
                bytes as f64 / 1e6,
                t * 1e3,
                bytes as f64 / t / 1e9,
                100.0 * bytes as f64 / t / 1e9 / peak,
                1.0 / t
            );
        } else {
            println!(
                "model prefill {n} tokens ({threads} thr): {:.1} ms -> matmul-only ceiling {:.0} tok/s",
                t * 1e3,
                n as f64 / t
            );
        }
    }
}

fn bench(c: &mut Criterion) {
    summary();
    let best = CpuIsa::detect();
    for threads in [1usize, 2] {
        let pool = ThreadPool::new(threads);
        let mut g = c.benchmark_group(format!("matvec_{threads}t"));
        g.measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500))
            .sample_size(20);
        for dtype in DTYPES.into_iter().filter(|&d| selected(d)) {
            for (rows, cols) in SHAPES {
                if dtype.row_bytes(cols).is_none() {
                    continue;
                }
                let data = weights(dtype, rows, cols, 3);
                let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
                let x: Vec<f32> = (0..cols).map(|i| (i as f32).cos()).collect();
                let mut y = vec![0.0f32; rows];
                g.throughput(Throughput::Bytes(data.len() as u64));
                g.bench_function(format!("{}_{rows}x{cols}", dtype.name()), |b| {
                    b.iter(|| matmul_with(best, w, black_box(&x), 1, &mut y, &pool).unwrap());
                });
            }
        }
        g.finish();
        let mut g = c.benchmark_group(format!("matmul_{threads}t"));
        g.measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500))
            .sample_size(10);
        let (rows, cols) = (1536, 576);
        let data = weights(GgmlType::Q4_1, rows, cols, 4);
        let w = WeightMatrix::new(GgmlType::Q4_1, rows, cols, &data).unwrap();
        for n in [8usize, 64, 512] {
            let x: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.3).sin()).collect();
            let mut y = vec![0.0f32; n * rows];
            g.throughput(Throughput::Elements((2 * rows * cols * n) as u64));
            g.bench_function(format!("q4_1_{rows}x{cols}_n{n}"), |b| {
                b.iter(|| matmul_with(best, w, black_box(&x), n, &mut y, &pool).unwrap());
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
