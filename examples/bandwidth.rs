//! The machine's read bandwidth (read-only sum over 3 x 1 GiB, best of 10), the ceiling every
//! decode figure is reported against, and its int8 multiply-accumulate peak (`vpdpbusd` on
//! registers, best of 5; `null` without AVX-512 VNNI), the ceiling of prompt processing:
//! `int8_gops` the plain instruction, `int8_block_gops` with the kernels' exact per-block
//! scaling ([`gpu_pipeline::int8_peak`]). `cargo run --release --example bandwidth --
//! [THREADS...]` prints one JSON line per thread count.

use gpu_pipeline::{ThreadPool, int8_peak, read_bandwidth};

fn main() {
    let mut counts: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if counts.is_empty() {
        counts = vec![1, ThreadPool::default_threads()];
    }
    for threads in counts {
        let pool = ThreadPool::new(threads);
        let bw = read_bandwidth(&pool, 1 << 30, 3, 10);
        let peak = int8_peak(&pool, 5);
        let gops = |f: fn(&gpu_pipeline::Int8Peak) -> f64| {
            peak.as_ref()
                .map_or_else(|| "null".to_owned(), |p| format!("{:.1}", f(p)))
        };
        println!(
            "{{\"threads\":{threads},\"best_gbs\":{:.2},\"median_gbs\":{:.2},\"int8_gops\":{},\"int8_block_gops\":{}}}",
            bw.best_gbs,
            bw.median_gbs,
            gops(|p| p.best_gops),
            gops(|p| p.block_gops)
        );
    }
}
