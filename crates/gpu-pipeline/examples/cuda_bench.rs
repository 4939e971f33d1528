//! The CUDA executor's bench for `scripts/gpu-check` (needs a GPU): prefill and decode tok/s,
//! 100-concurrent decode throughput, and device bytes + decode tok/s at 100% / 30% / 10% weight
//! budgets, each beside the CPU executor's figure in the same run (ratios printed), and beside
//! the card's own limits probed in the same run: its device-to-device copy bandwidth (decode as
//! GB/s of weights against it) and its host-to-device bandwidth from pinned memory (streaming as
//! GB/s uploaded per second against it).
//!
//! Model: the default model when present (`ZEROLAYER_MODEL` or the cache), else a synthetic
//! llama-shaped Q8_0 model of 40 layers (printed). `ZEROLAYER_CUDA_PTX_DIR`: precompiled kernels
//! (`CudaOptions::ptx_dir`).
//!
//! `cargo run --release -p zerolayer-gpu-pipeline --features cuda --example cuda_bench`

#[path = "../benches/support/synthetic.rs"]
#[allow(unreachable_pub)]
mod synthetic;

use std::sync::Arc;
use std::time::Instant;

use gpu_pipeline::executor::{CpuExecutor, CudaExecutor, CudaOptions, Executor};
use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvPool, RingMode};
use weight_cache::Gguf;

fn gguf() -> (Arc<Gguf>, String) {
    if let Ok(path) = weight_cache::locate_default_model() {
        // SAFETY: the model file is not modified while the bench runs.
        let g = unsafe { Gguf::open(&path) }.expect("open the default model");
        return (Arc::new(g), path.display().to_string());
    }
    // About 0.5 B parameters, the layers most of them (so 30% and 10% budgets fit the
    // minimum working set: globals plus two layer slots).
    let dims = synthetic::Dims {
        n_embd: 1024,
        n_ff: 2816,
        n_layers: 40,
        n_heads: 16,
        n_kv_heads: 4,
        head_dim: 64,
        vocab: 8000,
        ctx: 2048,
    };
    let bytes = synthetic::build("llama", dims, 7).build();
    let g = Gguf::from_bytes(bytes).expect("synthetic model");
    (Arc::new(g), format!("synthetic llama {dims:?}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Tokens per second of `f` (which processes `tokens` tokens), median of `reps`.
fn rate(reps: usize, tokens: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..reps)
            .map(|_| {
                let t0 = Instant::now();
                f();
                tokens as f64 / t0.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn ids(n: usize, vocab: usize, seed: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 977 + seed * 131 + 13) % vocab) as u32)
        .collect()
}

/// (prefill tok/s of a 512-token prompt, decode tok/s of one sequence over 64 steps).
fn single<E: Executor>(exec: &E) -> (f64, f64) {
    let vocab = exec.config().vocab_size;
    let shape = exec.kv_shape(KvDtype::F16);
    let pool = KvPool::new_in(shape, 640 * shape.bytes_per_token(), exec.kv_allocator()).unwrap();
    let prompt = ids(512, vocab, 1);
    let mut out = Vec::new();
    let prefill = rate(3, prompt.len(), || {
        let mut kv = pool.alloc(640, RingMode::Strict).unwrap();
        let step = SeqStep {
            tokens: &prompt,
            kv: &mut kv,
            logits: LogitsWanted::Last,
        };
        exec.forward(&mut [step], &mut out).unwrap();
    });
    let decode = rate(3, 64, || {
        let mut kv = pool.alloc(640, RingMode::Strict).unwrap();
        let step = SeqStep {
            tokens: &prompt[..32],
            kv: &mut kv,
            logits: LogitsWanted::Last,
        };
        exec.forward(&mut [step], &mut out).unwrap();
        for t in 0..64 {
            let tok = [(t * 7 + 3) as u32 % vocab as u32];
            let step = SeqStep {
                tokens: &tok,
                kv: &mut kv,
                logits: LogitsWanted::Last,
            };
            exec.forward(&mut [step], &mut out).unwrap();
        }
    });
    (prefill, decode)
}

/// Decode tok/s of 100 sequences stepping together (16-token prompts, 32 steps).
fn concurrent<E: Executor>(exec: &E) -> f64 {
    const N: usize = 100;
    let vocab = exec.config().vocab_size;
    let shape = exec.kv_shape(KvDtype::F16);
    let pool =
        KvPool::new_in(shape, N * 64 * shape.bytes_per_token(), exec.kv_allocator()).unwrap();
    let mut rings: Vec<_> = (0..N)
        .map(|_| pool.alloc(64, RingMode::Strict).unwrap())
        .collect();
    let prompts: Vec<Vec<u32>> = (0..N).map(|s| ids(16, vocab, s)).collect();
    let mut out = Vec::new();
    let mut steps: Vec<SeqStep<'_, E::Kv>> = rings
        .iter_mut()
        .zip(&prompts)
        .map(|(kv, p)| SeqStep {
            tokens: p,
            kv,
            logits: LogitsWanted::Last,
        })
        .collect();
    exec.forward(&mut steps, &mut out).unwrap();
    drop(steps);
    let toks: Vec<[u32; 1]> = (0..N)
        .map(|s| [(s * 13 + 1) as u32 % vocab as u32])
        .collect();
    let t0 = Instant::now();
    for _ in 0..32 {
        let mut steps: Vec<SeqStep<'_, E::Kv>> = rings
            .iter_mut()
            .zip(&toks)
            .map(|(kv, t)| SeqStep {
                tokens: t,
                kv,
                logits: LogitsWanted::Last,
            })
            .collect();
        exec.forward(&mut steps, &mut out).unwrap();
    }
    (N * 32) as f64 / t0.elapsed().as_secs_f64()
}

/// The card's device-to-device copy bandwidth (2 GiB; bytes read plus bytes written) and its
/// host-to-device bandwidth from pinned host memory (1 GiB), GB/s, medians of 5.
fn probes() -> Result<(f64, f64), cudarc::driver::DriverError> {
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let st = ctx.default_stream();
    let n = 1usize << 31;
    let src = st.alloc_zeros::<u8>(n)?;
    let mut dst = st.alloc_zeros::<u8>(n)?;
    st.synchronize()?;
    let mut copy = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        st.memcpy_dtod(&src, &mut dst)?;
        st.synchronize()?;
        copy.push(2.0 * n as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    drop((src, dst));
    let h = 1usize << 30;
    // SAFETY: `u8` has no invalid values; the buffer is written before it is read.
    let mut pinned = unsafe { ctx.alloc_pinned::<u8>(h) }?;
    pinned.as_mut_slice()?.fill(1);
    let mut dev = st.alloc_zeros::<u8>(h)?;
    let mut up = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        st.memcpy_htod(pinned.as_slice()?, &mut dev)?;
        st.synchronize()?;
        up.push(h as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    Ok((median(copy), median(up)))
}

fn cuda(model: &Arc<Model>, budget: Option<u64>) -> Result<CudaExecutor, String> {
    let mut opts = CudaOptions::default();
    opts.budget = budget;
    opts.ptx_dir = std::env::var_os("ZEROLAYER_CUDA_PTX_DIR").map(Into::into);
    CudaExecutor::new(model.clone(), opts).map_err(|e| e.to_string())
}

fn main() {
    let (g, what) = gguf();
    let model = Arc::new(Model::load(g, ModelOptions::default()).expect("load"));
    println!("model: {what}");
    println!("cpu threads: {}", model.pool().n_threads());
    let cpu = CpuExecutor::new(model.clone());
    let gpu = cuda(&model, None).unwrap_or_else(|e| panic!("{e}"));
    let st = gpu.stats();
    println!(
        "device: {} ({}), weights {} bytes",
        st.device, st.arch, st.weight_bytes
    );

    // The card's limits, measured in this run (the executor's device memory stays allocated).
    let (copy_gbs, h2d_gbs) = match probes() {
        Ok((c, h)) => {
            println!(
                "card: device copy {c:.0} GB/s (read + write), host-to-device (pinned) {h:.1} GB/s"
            );
            (c, h)
        }
        Err(e) => {
            println!("card probes failed: {e}");
            (f64::NAN, f64::NAN)
        }
    };

    let (cp, cd) = single(&cpu);
    let (gp, gd) = single(&gpu);
    println!(
        "prefill 512 tok/s: cuda {gp:.0}, cpu {cp:.0}, ratio {:.2}",
        gp / cp
    );
    println!(
        "decode tok/s (1 seq): cuda {gd:.1}, cpu {cd:.1}, ratio {:.2}",
        gd / cd
    );
    let read = gd * st.weight_bytes as f64 / 1e9;
    println!(
        "decode reads {read:.1} GB/s of weights = {:.1}% of the card's read bandwidth (half the copy's)",
        100.0 * read / (copy_gbs / 2.0)
    );
    let (cc, gc) = (concurrent(&cpu), concurrent(&gpu));
    println!(
        "100-concurrent decode tok/s: cuda {gc:.0}, cpu {cc:.0}, ratio {:.2}",
        gc / cc
    );
    let weights = st.weight_bytes;
    drop(gpu);
    for pct in [100u64, 30, 10] {
        match cuda(&model, Some(weights * pct / 100)) {
            Ok(exec) => {
                let (_, d) = single(&exec);
                let c = concurrent(&exec);
                let st = exec.stats();
                let streamed = d * st.streamed_bytes_per_step as f64 / 1e9;
                println!(
                    "budget {pct}%: streams {streamed:.1} GB/s host-to-device = {:.0}% of the probe",
                    100.0 * streamed / h2d_gbs
                );
                println!(
                    "budget {pct}%: device weight bytes {} ({:.1}% of weights), streamed/step {}, decode tok/s {d:.1} ({:.2} of resident), 100-conc tok/s {c:.0} ({:.2} of resident)",
                    st.weight_device_bytes,
                    100.0 * st.weight_device_bytes as f64 / weights as f64,
                    st.streamed_bytes_per_step,
                    d / gd,
                    c / gc,
                );
            }
            Err(e) => println!("budget {pct}%: refused: {e}"),
        }
    }
}
