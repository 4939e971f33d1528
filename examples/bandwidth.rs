//! The machine's read bandwidth (read-only sum over 3 x 1 GiB, best of 10), the ceiling every
//! decode figure is reported against. `cargo run --release --example bandwidth -- [THREADS...]`
//! prints one JSON line per thread count.

use gpu_pipeline::{ThreadPool, read_bandwidth};

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
        println!(
            "{{\"threads\":{threads},\"best_gbs\":{:.2},\"median_gbs\":{:.2}}}",
            bw.best_gbs, bw.median_gbs
        );
    }
}
