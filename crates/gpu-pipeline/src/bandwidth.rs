//! The machine's ceilings, measured the way the kernels' figures are judged: the read bandwidth
//! (a read-only sum, STREAM-style, over arrays far larger than the last-level cache, split
//! across the threads of a [`ThreadPool`], best of N passes), the ceiling of decode; and the
//! int8 multiply-accumulate peak ([`int8_peak`]), the ceiling of batched products.

use std::time::Instant;

use crate::ThreadPool;

/// What [`read_bandwidth`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Bandwidth {
    /// Best pass, bytes read per second / 1e9.
    pub best_gbs: f64,
    /// Median pass, GB/s.
    pub median_gbs: f64,
    /// Threads that read.
    pub threads: usize,
    /// Bytes read per pass.
    pub bytes_per_pass: usize,
}

/// Reads `arrays` arrays of `bytes_per_array` bytes each (`passes` times, every thread summing
/// its contiguous share of every array) and reports the best and median pass.
///
/// Use arrays much larger than the last-level cache (the benches use 3 x 1 GiB) so the figure is
/// DRAM bandwidth: the ceiling of a decode step, which reads every weight once.
///
/// ```
/// use gpu_pipeline::{ThreadPool, read_bandwidth};
/// let pool = ThreadPool::new(2);
/// let bw = read_bandwidth(&pool, 1 << 20, 2, 3); // small: cache bandwidth, just a demo
/// assert!(bw.best_gbs > 0.0 && bw.best_gbs >= bw.median_gbs);
/// ```
pub fn read_bandwidth(
    pool: &ThreadPool,
    bytes_per_array: usize,
    arrays: usize,
    passes: usize,
) -> Bandwidth {
    let words = (bytes_per_array / 8).max(8);
    let data: Vec<Vec<u64>> = (0..arrays.max(1))
        .map(|a| (0..words as u64).map(|i| i ^ a as u64).collect())
        .collect();
    let threads = pool.n_threads();
    let share = words.div_ceil(threads);
    let mut rates = Vec::with_capacity(passes.max(1));
    let sink = std::sync::atomic::AtomicU64::new(0);
    for _ in 0..passes.max(1) {
        let start = Instant::now();
        pool.run(threads, &|task, _| {
            let lo = (task * share).min(words);
            let hi = ((task + 1) * share).min(words);
            let mut total = 0u64;
            for array in &data {
                total = total.wrapping_add(sum_words(&array[lo..hi]));
            }
            sink.fetch_add(total, std::sync::atomic::Ordering::Relaxed);
        });
        let secs = start.elapsed().as_secs_f64();
        rates.push((words * 8 * data.len()) as f64 / secs / 1e9);
    }
    std::hint::black_box(sink.into_inner());
    rates.sort_by(f64::total_cmp);
    Bandwidth {
        best_gbs: rates[rates.len() - 1],
        median_gbs: rates[rates.len() / 2],
        threads,
        bytes_per_pass: words * 8 * data.len(),
    }
}

/// What [`int8_peak`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Int8Peak {
    /// Best pass, int8 operations per second / 1e9 (a multiply-add counts as 2).
    pub best_gops: f64,
    /// Median pass, GOP/s.
    pub median_gops: f64,
    /// Threads that ran.
    pub threads: usize,
    /// Best pass of the same register-only loop with the exact per-block scaling the many-token
    /// kernels do (see [`int8_peak`]), GOP/s of its multiply-adds: the ceiling of those kernels
    /// under their exactness contract, which the plain `vpdpbusd` figure is not.
    pub block_gops: f64,
}

/// The int8 multiply-accumulate peak of the instruction the AVX-512 kernels' integer products
/// run on (`vpdpbusd` on 512-bit registers, 64 multiply-adds each): every thread of `pool` runs
/// a register-only loop of independent `vpdpbusd` chains; best and median of `passes`. `None`
/// where the CPU lacks AVX-512 VNNI. On a shared machine (a sibling hyperthread busy) it moves
/// with the load, like the kernels, so the benches report products as a share of the peak
/// measured in the same run.
///
/// [`Int8Peak::block_gops`] is the same loop with the kernels' per-block epilogue: for each
/// 32-element block of 16 rows and one token, the 8 `vpdpbusd` of its integer dot product, then
/// its conversion to f32, the scale product `d_w * d_x` and the two FMAs (dot and minimum, as for
/// Q4_1) that keep results bit-identical across kernels and batch sizes. Those four float
/// operations per 8 `vpdpbusd` compete for the same vector ports, so this is the rate the
/// many-token kernels can approach (they also load their operands), and the plain figure is not.
///
/// ```
/// use gpu_pipeline::{ThreadPool, int8_peak};
/// if let Some(p) = int8_peak(&ThreadPool::new(1), 2) {
///     assert!(p.best_gops > 0.0 && p.best_gops >= p.median_gops && p.block_gops > 0.0);
/// }
/// ```
pub fn int8_peak(pool: &ThreadPool, passes: usize) -> Option<Int8Peak> {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
            return None;
        }
        const ITERS: usize = 1 << 21;
        let threads = pool.n_threads();
        let sink = std::sync::atomic::AtomicI64::new(0);
        // GOP/s of one pass of `run` on every thread, `ops` int8 operations each.
        let pass = |run: &(dyn Fn(i32) -> i64 + Sync), ops: usize| {
            let start = Instant::now();
            pool.run(threads, &|task, _| {
                sink.fetch_add(run(task as i32), std::sync::atomic::Ordering::Relaxed);
            });
            (threads * ops) as f64 / start.elapsed().as_secs_f64() / 1e9
        };
        let mut rates = Vec::with_capacity(passes.max(1));
        let mut block_best = 0.0f64;
        for _ in 0..passes.max(1) {
            // SAFETY (both loops): AVX-512F and VNNI were detected above.
            rates.push(pass(
                &|seed| unsafe { vnni_loop(ITERS, seed) },
                ITERS * VNNI_CHAINS * 64 * 2,
            ));
            let block = pass(
                &|seed| unsafe { block_loop(ITERS / 8, seed) },
                ITERS / 8 * BLOCK_UNITS * 8 * 64 * 2,
            );
            block_best = block_best.max(block);
        }
        std::hint::black_box(sink.into_inner());
        rates.sort_by(f64::total_cmp);
        Some(Int8Peak {
            best_gops: rates[rates.len() - 1],
            median_gops: rates[rates.len() / 2],
            threads,
            block_gops: block_best,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pool, passes);
        None
    }
}

/// Independent `vpdpbusd` chains per iteration of [`vnni_loop`] (more than latency x
/// throughput, so the loop runs at the instruction's throughput).
#[cfg(target_arch = "x86_64")]
const VNNI_CHAINS: usize = 12;

/// `iters` x [`VNNI_CHAINS`] `vpdpbusd` on registers; returns a value depending on all of them.
///
/// # Safety
/// The CPU supports AVX-512F and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[allow(clippy::incompatible_msrv)] // AVX-512 intrinsics are stable since 1.89; toolchain 1.95
unsafe fn vnni_loop(iters: usize, seed: i32) -> i64 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_epi32(0x0102_0304 ^ seed);
    let b = _mm512_set1_epi32(0x0101_0101);
    // Distinct starting values, so no two chains are the same computation.
    let mut acc: [__m512i; VNNI_CHAINS] = std::array::from_fn(|i| _mm512_set1_epi32(i as i32));
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm512_dpbusd_epi32(*c, a, b);
        }
    }
    acc.iter()
        .map(|&c| i64::from(_mm512_reduce_add_epi32(c)))
        .sum()
}

/// Independent blocks per iteration of [`block_loop`] (the panel kernel's 2-panel x 4-token
/// tile: 8 integer sums and 8 f32 accumulators).
#[cfg(target_arch = "x86_64")]
const BLOCK_UNITS: usize = 8;

/// `iters` x [`BLOCK_UNITS`] blocks on registers, each as the many-token kernels treat one
/// block of 16 rows and one token: 8 `vpdpbusd` into a fresh integer sum, `vcvtdq2ps`, the scale
/// product, an FMA of sum by scale and one of minimum by activation sum into its f32 chain.
/// Returns a value depending on all of them.
///
/// # Safety
/// The CPU supports AVX-512F and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
#[allow(clippy::incompatible_msrv)] // AVX-512 intrinsics are stable since 1.89; toolchain 1.95
unsafe fn block_loop(iters: usize, seed: i32) -> i64 {
    use std::arch::x86_64::*;
    let w: [__m512i; 4] = std::array::from_fn(|j| _mm512_set1_epi32(0x0102_0304 ^ seed ^ j as i32));
    let a = _mm512_set1_epi32(0x0101_0101);
    // A weight scale per block (so no two scale products are the same computation).
    let d: [__m512; BLOCK_UNITS] = std::array::from_fn(|i| _mm512_set1_ps(0.5 + i as f32));
    let (m, sx) = (_mm512_set1_ps(-0.125), _mm512_set1_ps(1e-3));
    let mut acc: [__m512; BLOCK_UNITS] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
    let mut ad = _mm512_set1_ps(0.25);
    for _ in 0..iters {
        // A new activation scale each iteration (opaque to the compiler), so the scale products
        // stay in the loop as in the kernels.
        ad = std::hint::black_box(ad);
        for (c, d) in acc.iter_mut().zip(&d) {
            let s = _mm512_mul_ps(*d, ad);
            // Starting from the scale's bits (the kernels start from zero or an offset), so the
            // compiler can neither hoist the integer sums out of the loop nor merge blocks.
            let mut sum = _mm512_castps_si512(s);
            for j in 0..8 {
                sum = _mm512_dpbusd_epi32(sum, w[j % 4], a);
            }
            *c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, *c);
            *c = _mm512_fmadd_ps(m, sx, *c);
        }
    }
    acc.iter().map(|&c| _mm512_reduce_add_ps(c) as i64).sum()
}

/// Eight independent accumulators so the loads, not an add chain, set the pace.
fn sum_words(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for chunk in &mut chunks {
        for (a, &w) in acc.iter_mut().zip(chunk) {
            *a = a.wrapping_add(w);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |s, &w| s.wrapping_add(w));
    acc.iter().fold(tail, |s, &a| s.wrapping_add(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_words_adds_every_word_including_the_tail() {
        let words: Vec<u64> = (1..=21).collect();
        assert_eq!(sum_words(&words), 231);
    }

    #[test]
    fn reports_the_bytes_of_every_array_and_best_not_below_median() {
        let pool = ThreadPool::new(2);
        let bw = read_bandwidth(&pool, 64 << 10, 3, 3);
        assert_eq!(bw.bytes_per_pass, 3 * (64 << 10));
        assert_eq!(bw.threads, 2);
        assert!(bw.best_gbs >= bw.median_gbs && bw.median_gbs > 0.0);
    }
}
