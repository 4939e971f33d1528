//! The CUDA executor (feature `cuda`).
//!
//! Without a GPU (CI): every kernel compiles with NVRTC for sm_80 and sm_90 (SKIPPED when
//! libnvrtc is absent, unless `ZEROLAYER_REQUIRE_NVRTC=1`, which `scripts/test` sets; it finds
//! the library through `ZEROLAYER_NVRTC_LIB`), and creating the executor on a machine without a
//! driver is `CudaError::NoDriver`, not a panic.
//!
//! With a GPU (`ZEROLAYER_REQUIRE_GPU=1`, set by `scripts/gpu-check`; SKIPPED otherwise): the
//! CUDA logits against the CPU executor's on the default model (top-1 equal wherever the CPU's
//! top-1/top-2 gap exceeds 0.5, perplexity within 1%), a batched prefill + decode, and the
//! streamed runs at smaller device budgets bit-identical to the resident CUDA run; a KV ring
//! in device memory (`DeviceKv`, written by `kv_scatter`) holding what a host ring holds.
#![cfg(feature = "cuda")]

mod common;
#[path = "../benches/support/synthetic.rs"]
mod synthetic;

use std::sync::{Arc, OnceLock};

use common::{argmax, ids_of, nll_second_half};
use cudarc::driver::{CudaContext, sys};
use gpu_pipeline::executor::cuda::{self, CudaError, DeviceKv, KvScatter, kernels};
use gpu_pipeline::executor::{CpuExecutor, CudaExecutor, CudaOptions, Executor};
use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvPool, KvRing, KvShape, KvTensor, RingMode};
use serde_json::Value;
use weight_cache::Gguf;

fn env_is(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: the model file is not modified while the tests run.
        let g = Arc::new(unsafe { Gguf::open(&path) }.expect("open default model"));
        Arc::new(Model::load(g, ModelOptions::default()).expect("load default model"))
    })
    .clone()
}

#[test]
fn every_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
    if let Err(e) = cuda::probe_nvrtc() {
        assert!(
            !env_is("ZEROLAYER_REQUIRE_NVRTC"),
            "ZEROLAYER_REQUIRE_NVRTC=1 but NVRTC does not load: {e}"
        );
        eprintln!("SKIPPED: {e}");
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        let ptx = kernels::compile(arch).unwrap_or_else(|e| panic!("{e}"));
        let src = ptx.to_src();
        assert!(
            src.contains(&format!(".target {arch}")),
            "PTX not for {arch}"
        );
        for name in kernels::KERNEL_NAMES {
            assert!(
                src.contains(&format!(".entry {name}(")),
                "{arch}: kernel {name} missing from the PTX"
            );
        }
    }
}

#[test]
fn a_kernel_source_error_is_a_typed_compile_error_with_the_log() {
    if cuda::probe_nvrtc().is_err() {
        eprintln!("SKIPPED: no NVRTC");
        return;
    }
    let err = kernels::compile_source(
        "extern \"C\" __global__ void k() { undefined_x = 1; }",
        "sm_80",
    )
    .unwrap_err();
    match err {
        CudaError::Compile { arch, log } => {
            assert_eq!(arch, "sm_80");
            assert!(log.contains("undefined_x"), "{log}");
        }
        other => panic!("expected a compile error, got {other}"),
    }
}

#[test]
fn without_a_driver_creating_the_executor_is_a_typed_error() {
    if env_is("ZEROLAYER_REQUIRE_GPU") {
        eprintln!("SKIPPED: a GPU is required here (the GPU tests cover creation)");
        return;
    }
    match cuda::probe_driver() {
        Ok(()) => eprintln!("SKIPPED: this machine has libcuda"),
        Err(CudaError::NoDriver { tried }) => {
            assert!(tried.iter().any(|t| t == "libcuda.so.1"), "{tried:?}");
            let err = CudaExecutor::new(model(), CudaOptions::default()).unwrap_err();
            assert!(matches!(err, CudaError::NoDriver { .. }), "{err}");
            assert!(err.to_string().starts_with("no CUDA driver"), "{err}");
        }
        Err(other) => panic!("unexpected probe error: {other}"),
    }
}

/// Whether the GPU tests on the default model run: `ZEROLAYER_REQUIRE_GPU=1` and the model is
/// there (it does not fit what travels to a device machine; the synthetic tests cover the
/// kernels there).
fn gpu_with_default_model() -> bool {
    if !gpu() {
        return false;
    }
    match weight_cache::locate_default_model() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED: default-model GPU test: {e}");
            false
        }
    }
}

/// Whether the GPU tests run (`ZEROLAYER_REQUIRE_GPU=1`).
fn gpu() -> bool {
    let on = env_is("ZEROLAYER_REQUIRE_GPU");
    if !on {
        eprintln!("SKIPPED: GPU test (set ZEROLAYER_REQUIRE_GPU=1 on a machine with a GPU)");
    }
    on
}

/// Options with `budget` and the precompiled kernels of `ZEROLAYER_CUDA_PTX_DIR`, if set.
fn options(budget: Option<u64>) -> CudaOptions {
    let mut opts = CudaOptions::default();
    opts.budget = budget;
    opts.ptx_dir = std::env::var_os("ZEROLAYER_CUDA_PTX_DIR").map(Into::into);
    opts
}

fn cuda_exec(budget: Option<u64>) -> CudaExecutor {
    CudaExecutor::new(model(), options(budget)).unwrap_or_else(|e| panic!("{e}"))
}

/// A fixture from the crate's `tests/fixtures`; a test binary moved to another machine
/// (`scripts/gpu-check`) runs from the repository root and finds them there.
fn fixture(name: &str) -> Value {
    let built = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let p = if std::path::Path::new(&built).is_file() {
        built
    } else {
        format!("crates/gpu-pipeline/tests/fixtures/{name}")
    };
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// Logits of every position of `ids` (one sequence, fresh f16 ring).
fn all_logits(exec: &impl Executor<Kv = kv_ring::HostKv>, ids: &[u32]) -> Vec<f32> {
    let shape = exec.kv_shape(KvDtype::F16);
    let pool = KvPool::new(shape, ids.len() * shape.bytes_per_token()).unwrap();
    let mut kv = pool.alloc(ids.len(), RingMode::Strict).unwrap();
    let mut out = Vec::new();
    exec.forward(
        &mut [SeqStep {
            tokens: ids,
            kv: &mut kv,
            logits: LogitsWanted::All,
        }],
        &mut out,
    )
    .unwrap();
    out
}

/// The CPU's top-1 where its gap to the top-2 exceeds 0.5: (rows checked, rows where `got`
/// has the same top-1), and the largest absolute logit difference.
fn compare(want: &[f32], got: &[f32], vocab: usize) -> (usize, usize, f32) {
    assert_eq!(want.len(), got.len());
    let (mut checked, mut agree, mut max_diff) = (0, 0, 0f32);
    for (w, g) in want.chunks_exact(vocab).zip(got.chunks_exact(vocab)) {
        let top = argmax(w);
        let second = w
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != top)
            .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
        if w[top] - second > 0.5 {
            checked += 1;
            agree += usize::from(argmax(g) == top);
        }
        for (a, b) in w.iter().zip(g) {
            max_diff = max_diff.max((a - b).abs());
        }
    }
    (checked, agree, max_diff)
}

#[test]
fn cuda_logits_match_the_cpu_executor_on_the_default_model() {
    if !gpu_with_default_model() {
        return;
    }
    let cpu = CpuExecutor::new(model());
    let gpu = cuda_exec(None);
    let vocab = cpu.config().vocab_size;
    let fx = fixture("model-teacher.json");
    let (mut checked, mut agree, mut max_diff) = (0, 0, 0f32);
    for s in fx["sequences"].as_array().unwrap() {
        let ids = ids_of(&s["ids"]);
        let (c, a, m) = compare(&all_logits(&cpu, &ids), &all_logits(&gpu, &ids), vocab);
        checked += c;
        agree += a;
        max_diff = max_diff.max(m);
    }
    eprintln!("cuda vs cpu: top-1 {agree}/{checked} (gap > 0.5), max |logit diff| {max_diff}");
    assert!(checked > 0);
    assert_eq!(agree, checked, "top-1 differs from the CPU's");

    let fx = fixture("model-ppl.json");
    let ctx = fx["ctx"].as_u64().unwrap() as usize;
    let ids = ids_of(&fx["ci_ids"]);
    let (mut nll_cpu, mut nll_gpu, mut count) = (0f64, 0f64, 0usize);
    for w in 0..fx["ci_windows"].as_u64().unwrap() as usize {
        let chunk = &ids[w * ctx..(w + 1) * ctx];
        let (n, c) = nll_second_half(&all_logits(&cpu, chunk), chunk, vocab);
        nll_cpu += n;
        count += c;
        nll_gpu += nll_second_half(&all_logits(&gpu, chunk), chunk, vocab).0;
    }
    let ppl = |nll: f64| (nll / count as f64).exp();
    let (pc, pg) = (ppl(nll_cpu), ppl(nll_gpu));
    eprintln!("perplexity: cpu {pc:.4}, cuda {pg:.4}");
    assert!((pg / pc - 1.0).abs() < 0.01, "cuda {pg} vs cpu {pc}");
}

/// A 20-token and a 7-token prefill in one step, then 3 decode steps of both.
fn batch_logits(exec: &impl Executor<Kv = kv_ring::HostKv>) -> Vec<f32> {
    let vocab = exec.config().vocab_size as u32;
    let shape = exec.kv_shape(KvDtype::F16);
    let pool = KvPool::new(shape, 2 * 64 * shape.bytes_per_token()).unwrap();
    let mut a = pool.alloc(64, RingMode::Strict).unwrap();
    let mut b = pool.alloc(64, RingMode::Strict).unwrap();
    let ids: Vec<u32> = (0..27u32).map(|i| (i * 977 + 13) % vocab).collect();
    let (mut all, mut out) = (Vec::new(), Vec::new());
    let mut step = |ta: &[u32], tb: &[u32], la, out: &mut Vec<f32>| {
        exec.forward(
            &mut [
                SeqStep {
                    tokens: ta,
                    kv: &mut a,
                    logits: la,
                },
                SeqStep {
                    tokens: tb,
                    kv: &mut b,
                    logits: LogitsWanted::Last,
                },
            ],
            out,
        )
        .unwrap();
    };
    step(&ids[..20], &ids[20..], LogitsWanted::All, &mut out);
    all.extend_from_slice(&out);
    for t in 0..3u32 {
        step(
            &[(t * 31 + 5) % vocab],
            &[(t * 71 + 9) % vocab],
            LogitsWanted::Last,
            &mut out,
        );
        all.extend_from_slice(&out);
    }
    all
}

#[test]
fn cuda_batched_prefill_and_decode_match_the_cpu_executor() {
    if !gpu_with_default_model() {
        return;
    }
    let cpu = CpuExecutor::new(model());
    let gpu = cuda_exec(None);
    let vocab = cpu.config().vocab_size;
    let (checked, agree, max_diff) = compare(&batch_logits(&cpu), &batch_logits(&gpu), vocab);
    eprintln!("batch: top-1 {agree}/{checked}, max |logit diff| {max_diff}");
    assert_eq!(agree, checked);
}

#[test]
fn cuda_streaming_under_a_budget_gives_the_resident_logits_bit_for_bit() {
    if !gpu_with_default_model() {
        return;
    }
    let resident = cuda_exec(None);
    let weights = resident.stats().weight_bytes;
    let want = batch_logits(&resident);
    drop(resident);
    // The default model's minimum working set is 35.9% of its weights (tests/streaming.rs).
    for pct in [50u64, 40] {
        let budget = weights * pct / 100;
        let exec = cuda_exec(Some(budget));
        let got = batch_logits(&exec);
        let st = exec.stats();
        eprintln!("{pct}%: {st:?}");
        assert!(st.weight_device_bytes <= budget, "{st:?} over {budget}");
        assert!(st.streamed_bytes_per_step > 0 && st.uploaded_bytes > 0);
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{pct}%: streamed logits differ from the resident run"
        );
    }
    let err = CudaExecutor::new(model(), options(Some(weights / 10)));
    assert!(matches!(err, Err(CudaError::Plan(_))), "{err:?}");
}

/// Synthetic random-weight models of every family (40 layers, tiny vocabulary): the families
/// the CUDA kernels cover match the CPU executor (top-1 where the gap > 0.5) and stream
/// bit-identically at 30% and 10% of their weights; the others are refused with a typed
/// `Unsupported` error naming the feature.
#[test]
fn synthetic_families_match_the_cpu_and_stream_at_30_and_10_percent() {
    if !gpu() {
        return;
    }
    let dims = synthetic::Dims {
        n_embd: 64,
        n_ff: 128,
        n_layers: 40,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        vocab: 96,
        ctx: 256,
    };
    let mut covered = 0;
    for arch in synthetic::ARCHES {
        let gguf = Arc::new(Gguf::from_bytes(synthetic::build(arch, dims, 7).build()).unwrap());
        let model = Arc::new(Model::load(gguf, ModelOptions::default().with_threads(2)).unwrap());
        let resident = match CudaExecutor::new(model.clone(), options(None)) {
            Ok(e) => e,
            Err(CudaError::Unsupported { feature, .. }) => {
                eprintln!("{arch}: not covered by the CUDA kernels ({feature})");
                continue;
            }
            Err(e) => panic!("{arch}: {e}"),
        };
        covered += 1;
        let want = batch_logits(&resident);
        let (checked, agree, max_diff) = compare(
            &batch_logits(&CpuExecutor::new(model.clone())),
            &want,
            dims.vocab,
        );
        eprintln!("{arch}: top-1 {agree}/{checked}, max |logit diff| {max_diff}");
        assert_eq!(agree, checked, "{arch}: top-1 differs from the CPU's");
        let weights = resident.stats().weight_bytes;
        drop(resident);
        for pct in [30u64, 10] {
            let budget = weights * pct / 100;
            let exec = CudaExecutor::new(model.clone(), options(Some(budget)))
                .unwrap_or_else(|e| panic!("{arch} at {pct}%: {e}"));
            let got = batch_logits(&exec);
            let st = exec.stats();
            assert!(st.weight_device_bytes <= budget, "{arch} at {pct}%: {st:?}");
            assert!(
                st.streamed_bytes_per_step > 0,
                "{arch} at {pct}%: nothing streams"
            );
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{arch} at {pct}%: streamed logits differ from the resident run"
            );
        }
    }
    assert!(covered >= 3, "only {covered} families covered");
}

/// Every weight format the kernels read, through the whole forward pass: the synthetic llama
/// with its matrices (and token embedding) in Q4_0, Q4_1, Q8_0, F16, BF16 and F32 matches the
/// CPU executor (top-1 where the gap > 0.5).
/// The synthetic llama of the weight-format tests: small, its matrices in one format each.
const FORMAT_DIMS: synthetic::Dims = synthetic::Dims {
    n_embd: 128,
    n_ff: 256,
    n_layers: 4,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 32,
    vocab: 160,
    ctx: 256,
};

/// Every weight format the CUDA kernels read.
const FORMATS: [weight_cache::GgmlType; 6] = {
    use weight_cache::GgmlType::*;
    [Q4_0, Q4_1, Q8_0, F16, BF16, F32]
};

/// The synthetic llama of [`FORMAT_DIMS`] with its matrices in `fmt` (checked), loaded.
fn format_model(fmt: weight_cache::GgmlType) -> Arc<Model> {
    let bytes = synthetic::build_in("llama", FORMAT_DIMS, 11, fmt).build();
    let gguf = Arc::new(Gguf::from_bytes(bytes).unwrap());
    assert!(gguf.tensors().any(|t| t.dtype == fmt), "{fmt:?}");
    Arc::new(Model::load(gguf, ModelOptions::default().with_threads(2)).unwrap())
}

#[test]
fn every_weight_format_matches_the_cpu_executor() {
    if !gpu() {
        return;
    }
    let dims = FORMAT_DIMS;
    for fmt in FORMATS {
        let model = format_model(fmt);
        let gpu = CudaExecutor::new(model.clone(), options(None))
            .unwrap_or_else(|e| panic!("{fmt:?}: {e}"));
        let (checked, agree, max_diff) = compare(
            &batch_logits(&CpuExecutor::new(model)),
            &batch_logits(&gpu),
            dims.vocab,
        );
        eprintln!("{fmt:?}: top-1 {agree}/{checked}, max |logit diff| {max_diff}");
        assert!(checked > 0, "{fmt:?}: no row with a clear top-1");
        assert_eq!(agree, checked, "{fmt:?}: top-1 differs from the CPU's");
    }
}

/// The synthetic models the GPU format test uses load and run on the CPU (so a GPU run fails
/// only on the GPU's side).
#[test]
fn the_synthetic_models_of_every_format_run_on_the_cpu() {
    let dims = FORMAT_DIMS;
    for fmt in FORMATS {
        let model = format_model(fmt);
        let logits = batch_logits(&CpuExecutor::new(model));
        assert!(logits.iter().all(|v| v.is_finite()), "{fmt:?}");
        let (checked, _, _) = compare(&logits, &logits, dims.vocab);
        assert!(checked > 0, "{fmt:?}: no row with a clear top-1");
    }
}

/// Every (layer, head, K then V) of `ring` in view order, read back from the device through the
/// ring's slots.
fn device_views(ring: &KvRing<DeviceKv>) -> Vec<Vec<f32>> {
    let stream = ring.pool().allocator();
    let all: Vec<f32> = stream
        .clone_dtoh(ring.storage().buffer().expect("live ring"))
        .unwrap();
    let shape = ring.pool().shape();
    let hd = shape.head_dim;
    let mut out = Vec::new();
    for layer in 0..shape.n_layers {
        let slots = ring.layer_slots(layer).unwrap();
        for head in 0..shape.n_kv_heads {
            for tensor in [KvTensor::K, KvTensor::V] {
                let base = ring
                    .storage()
                    .block_offset(ring.block_index(layer, head, tensor));
                out.push(
                    (0..slots.rows)
                        .flat_map(|i| &all[base + slots.slot(i) * hd..][..hd])
                        .copied()
                        .collect(),
                );
            }
        }
    }
    out
}

fn host_views(ring: &KvRing) -> Vec<Vec<f32>> {
    let shape = ring.pool().shape();
    let mut out = Vec::new();
    for layer in 0..shape.n_layers {
        for head in 0..shape.n_kv_heads {
            let view = ring.view(layer, head).unwrap();
            out.push(view.keys.to_f32_vec());
            out.push(view.values.to_f32_vec());
        }
    }
    out
}

#[test]
fn a_device_kv_ring_written_by_kv_scatter_holds_what_the_host_ring_holds() {
    if !gpu() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let cc = |a| ctx.attribute(a).unwrap();
    let arch = format!(
        "sm_{}{}",
        cc(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
        cc(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    );
    let module = ctx.load_module(kernels::compile(&arch).unwrap()).unwrap();
    let stream = ctx.default_stream();
    let mut scatter = KvScatter::new(&module).unwrap();
    let shape = KvShape::new(3, 2, 8, KvDtype::F32);
    let host_pool = KvPool::new(shape, 1 << 20).unwrap();
    let dev_pool = KvPool::<DeviceKv>::new_in(shape, 1 << 20, Arc::clone(&stream)).unwrap();
    let mode = RingMode::Sliding { sinks: 2 };
    let (mut host, mut dev) = (
        host_pool.alloc(7, mode).unwrap(),
        dev_pool.alloc(7, mode).unwrap(),
    );
    assert_eq!(dev.allocated_bytes(), host.allocated_bytes());
    let row = shape.n_kv_heads * shape.head_dim;
    // Chunk sizes; 0 grows both rings by 5 positions (a wrapped sliding ring by then).
    for (step, n) in [3, 2, 4, 1, 0, 5, 1, 3, 2].into_iter().enumerate() {
        if n == 0 {
            host.grow(host.capacity() + 5).unwrap();
            dev.grow(dev.capacity() + 5).unwrap();
            assert_eq!(dev_pool.used_bytes(), host_pool.used_bytes());
        } else {
            host.begin(n).unwrap();
            dev.begin(n).unwrap();
            let pos = host.next_pos() as usize;
            for layer in 0..shape.n_layers {
                let k: Vec<f32> = (0..n * row)
                    .map(|i| (layer * 10_000 + pos * 100 + i) as f32)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                host.write_layer(layer, &k, &v).unwrap();
                let (kd, vd) = (
                    stream.clone_htod(&k).unwrap(),
                    stream.clone_htod(&v).unwrap(),
                );
                scatter
                    .write_layer(&mut dev, layer, &kd.slice(..), &vd.slice(..))
                    .unwrap();
            }
            host.commit().unwrap();
            dev.commit().unwrap();
        }
        assert_eq!((dev.len(), dev.next_pos()), (host.len(), host.next_pos()));
        assert_eq!(device_views(&dev), host_views(&host), "step {step}");
    }
    assert!(host.evicted() > 0, "the sinks moved");
    let (host_fork, dev_fork) = (host.fork(2).unwrap(), dev.fork(2).unwrap());
    assert_eq!(device_views(&dev_fork), host_views(&host_fork));
    let one = stream.alloc_zeros::<f32>(1).unwrap();
    let none = one.slice(0..0);
    assert_eq!(
        scatter.write_layer(&mut dev, 0, &none, &none),
        Err(kv_ring::KvError::NoPendingChunk),
        "between chunks"
    );
}
