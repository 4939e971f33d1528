//! Weight streaming on the CPU: decode tok/s of the default model with every weight resident
//! (`CpuExecutor`) and through a budgeted arena (`StreamingExecutor`) at 100%, 60%, 40% of the
//! weights and at the minimum working set, with the bytes uploaded per step and the fraction of
//! upload time hidden behind compute. `cargo run --release --example stream_overlap -- [BATCH]
//! [STEPS]` (defaults 8 and 32); `ZEROLAYER_THREADS` sets the compute threads.

use std::sync::Arc;
use std::time::Instant;

use gpu_pipeline::executor::{CpuExecutor, Executor, PlanError, StreamingError, StreamingExecutor};
use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvPool, RingMode};

/// Decode tok/s over `steps` steps of `batch` sequences (after a 16-token prefill each).
fn decode_tok_s(
    exec: &impl Executor<Kv = kv_ring::HostKv>,
    batch: usize,
    steps: usize,
) -> anyhow::Result<f64> {
    let shape = exec.kv_shape(KvDtype::F16);
    let cap = 16 + steps;
    let pool = KvPool::new(shape, batch * cap * shape.bytes_per_token())?;
    let mut rings = (0..batch)
        .map(|_| pool.alloc(cap, RingMode::Strict))
        .collect::<Result<Vec<_>, _>>()?;
    let vocab = exec.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..16u32).map(|i| (i * 911 + 7) % vocab).collect();
    let mut out = Vec::new();
    let mut steps_of = |tokens: &[Vec<u32>], rings: &mut [kv_ring::KvRing]| {
        let mut s: Vec<SeqStep<'_>> = rings
            .iter_mut()
            .zip(tokens)
            .map(|(kv, t)| SeqStep {
                tokens: t,
                kv,
                logits: LogitsWanted::Last,
            })
            .collect();
        exec.forward(&mut s, &mut out)
    };
    steps_of(&vec![prompt; batch], &mut rings)?;
    let t0 = Instant::now();
    for step in 0..steps as u32 {
        let next: Vec<Vec<u32>> = (0..batch as u32)
            .map(|b| vec![(step * 131 + b * 17 + 3) % vocab])
            .collect();
        steps_of(&next, &mut rings)?;
    }
    Ok((batch * steps) as f64 / t0.elapsed().as_secs_f64())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse::<usize>().ok());
    let batch = args.next().unwrap_or(8);
    let steps = args.next().unwrap_or(32);
    let path = weight_cache::locate_default_model()?;
    // SAFETY: the model file is not modified while the example runs.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }?);
    let resident = CpuExecutor::new(Arc::new(Model::load(
        gguf.clone(),
        ModelOptions::default(),
    )?));
    let threads = resident.host_pool().n_threads();
    let base = decode_tok_s(&resident, batch, steps)?;
    println!(
        "{{\"executor\":\"cpu\",\"threads\":{threads},\"batch\":{batch},\"tok_s\":{base:.1}}}"
    );
    let total = StreamingExecutor::weight_bytes(&gguf);
    let minimum = match StreamingExecutor::new(gguf.clone(), 0, None, ModelOptions::default()) {
        Err(StreamingError::Plan(PlanError::BudgetTooSmall { minimum, .. })) => minimum,
        other => anyhow::bail!("a zero budget was not refused: {other:?}"),
    };
    for (label, budget) in [
        ("100%", total),
        ("60%", total * 6 / 10),
        ("40%", total * 4 / 10),
        ("minimum", minimum),
    ] {
        let exec = StreamingExecutor::new(gguf.clone(), budget, None, ModelOptions::default())?;
        let before = exec.stats();
        let tok_s = decode_tok_s(&exec, batch, steps)?;
        let s = exec.stats();
        let upload_ms = (s.upload_time - before.upload_time).as_secs_f64() * 1e3;
        let stall_ms = (s.stall_time - before.stall_time).as_secs_f64() * 1e3;
        let hidden = if upload_ms > 0.0 {
            (1.0 - stall_ms / upload_ms).clamp(0.0, 1.0)
        } else {
            1.0
        };
        println!(
            "{{\"executor\":\"streaming\",\"budget\":\"{label}\",\"budget_bytes\":{budget},\
             \"arena_bytes\":{},\"streamed_bytes_per_step\":{},\"threads\":{threads},\
             \"batch\":{batch},\"tok_s\":{tok_s:.1},\"ratio_to_cpu\":{:.3},\
             \"upload_ms\":{upload_ms:.1},\"stall_ms\":{stall_ms:.1},\"overlap\":{hidden:.2}}}",
            exec.arena_bytes(),
            exec.plan().streamed_bytes(),
            tok_s / base
        );
    }
    Ok(())
}
