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
//! streamed runs at smaller device budgets bit-identical to the resident CUDA run; KV rings in
//! device memory (`DeviceKv`) holding what host rings hold through eviction, growth and forks,
//! and the executor's logits over such rings (`kv_scatter` writing them, `attention_ring`
//! reading them in place) matching the CPU's across ring wraps, sinks and window layers.
#![cfg(feature = "cuda")]

mod common;
#[path = "../benches/support/synthetic.rs"]
mod synthetic;

use std::sync::{Arc, OnceLock};

use common::{argmax, ids_of, nll_second_half};
use cudarc::driver::CudaContext;
use gpu_pipeline::executor::cuda::{self, CudaError, DeviceKv, kernels};
use gpu_pipeline::executor::{CpuExecutor, CudaExecutor, CudaOptions, Executor, HostedExecutor};
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

/// A pool of `exec`'s ring storage for `tokens` positions of `dtype` (the engine's way: the
/// executor's allocator and windows, chunks of up to 32 tokens).
fn pool_of<E: Executor>(exec: &E, dtype: KvDtype, tokens: usize) -> Arc<KvPool<E::Kv>> {
    let shape = exec.kv_shape(dtype);
    KvPool::with_layer_windows_in(
        shape,
        tokens * shape.bytes_per_token(),
        exec.kv_windows(),
        32,
        exec.kv_allocator(),
    )
    .unwrap()
}

/// Logits of every position of `ids` (one sequence, fresh f16 ring).
fn all_logits<E: Executor>(exec: &E, ids: &[u32]) -> Vec<f32> {
    let shape = exec.kv_shape(KvDtype::F16);
    let pool = KvPool::new_in(
        shape,
        ids.len() * shape.bytes_per_token(),
        exec.kv_allocator(),
    )
    .unwrap();
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
fn batch_logits<E: Executor>(exec: &E) -> Vec<f32> {
    let vocab = exec.config().vocab_size as u32;
    let pool = pool_of(exec, KvDtype::F16, 2 * 64);
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

/// Synthetic random-weight models of every family (40 layers, tiny vocabulary): llama, qwen2,
/// qwen3's Q/K norms, gemma2's and gemma3's post-norms, soft-caps, windows and two RoPE bases,
/// phi3, smollm3, and the mixtures of experts (qwen3moe, Mixtral's llama, olmoe's whole-row Q/K
/// norms, qwen2moe's shared expert: routed on the host as the CPU routes, the experts on the
/// device) match the CPU executor (top-1 where the gap > 0.5) and stream bit-identically at 30%
/// and 10% of their weights.
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
    assert_eq!(covered, synthetic::ARCHES.len(), "families not covered");
}

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

/// [`FORMAT_DIMS`] for the 256-element formats (K-quants, IQ4_XS): every matrix's rows a
/// multiple of 256 columns.
const FORMAT_DIMS_256: synthetic::Dims = synthetic::Dims {
    n_embd: 256,
    n_ff: 512,
    head_dim: 64,
    ..FORMAT_DIMS
};

/// Every weight format the CUDA kernels read: every format of the CPU kernels.
const FORMATS: [weight_cache::GgmlType; 15] = {
    use weight_cache::GgmlType::*;
    [
        Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, F16, BF16, F32,
    ]
};

/// The dimensions of `fmt`'s synthetic model.
fn format_dims(fmt: weight_cache::GgmlType) -> synthetic::Dims {
    if fmt.block_size() == 256 {
        FORMAT_DIMS_256
    } else {
        FORMAT_DIMS
    }
}

/// The synthetic llama of [`format_dims`] with its matrices in `fmt` (checked), loaded.
fn format_model(fmt: weight_cache::GgmlType) -> Arc<Model> {
    let bytes = synthetic::build_in("llama", format_dims(fmt), 11, fmt).build();
    let gguf = Arc::new(Gguf::from_bytes(bytes).unwrap());
    let n = gguf.tensors().filter(|t| t.dtype == fmt).count();
    // The matrices of every layer, the token embedding and the head.
    assert!(
        n >= 7 * format_dims(fmt).n_layers + 2,
        "{fmt:?}: {n} tensors"
    );
    Arc::new(Model::load(gguf, ModelOptions::default().with_threads(2)).unwrap())
}

/// Every weight format the kernels read, through the whole forward pass: the synthetic llama
/// with its matrices (and token embedding and head) in each format matches the CPU executor
/// (top-1 where the gap > 0.5). The decoders themselves are checked on the host bit for bit
/// (`tests/cuda_decoders.rs`).
#[test]
fn every_weight_format_matches_the_cpu_executor() {
    if !gpu() {
        return;
    }
    for fmt in FORMATS {
        let model = format_model(fmt);
        let gpu = CudaExecutor::new(model.clone(), options(None))
            .unwrap_or_else(|e| panic!("{fmt:?}: {e}"));
        let (checked, agree, max_diff) = compare(
            &batch_logits(&CpuExecutor::new(model)),
            &batch_logits(&gpu),
            format_dims(fmt).vocab,
        );
        eprintln!("{fmt:?}: top-1 {agree}/{checked}, max |logit diff| {max_diff}");
        assert!(checked > 0, "{fmt:?}: no row with a clear top-1");
        assert_eq!(agree, checked, "{fmt:?}: top-1 differs from the CPU's");
    }
}

/// The synthetic models the GPU format test uses load and run on the CPU, with rows whose top-1
/// is clear (so a GPU run fails only on the GPU's side).
#[test]
fn the_synthetic_models_of_every_format_run_on_the_cpu() {
    for fmt in FORMATS {
        let model = format_model(fmt);
        let logits = batch_logits(&CpuExecutor::new(model));
        assert!(logits.iter().all(|v| v.is_finite()), "{fmt:?}");
        let (checked, _, _) = compare(&logits, &logits, format_dims(fmt).vocab);
        eprintln!("{fmt:?}: {checked} rows with a clear top-1");
        assert!(checked > 0, "{fmt:?}: no row with a clear top-1");
    }
}

/// The real-vocabulary case (`examples/real_vocab_model.rs`: the default model's tokenizer and
/// random weights): the file `ZEROLAYER_REAL_VOCAB_MODEL` names (`scripts/gpu-check` carries it),
/// else built here from the default model when that is present; `None` without either.
fn real_vocab_gguf() -> Option<(Arc<Gguf>, Option<Arc<Gguf>>)> {
    let default = weight_cache::locate_default_model()
        .ok()
        // SAFETY: the model file is not modified while it is mapped.
        .map(|p| Arc::new(unsafe { Gguf::open(&p) }.unwrap()));
    if let Ok(path) = std::env::var("ZEROLAYER_REAL_VOCAB_MODEL") {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        return Some((Arc::new(Gguf::from_bytes(bytes).unwrap()), default));
    }
    let src = default.clone()?;
    let bytes = synthetic::with_vocabulary(synthetic::real_vocab_dims(&src), 5, &src);
    Some((Arc::new(Gguf::from_bytes(bytes).unwrap()), default))
}

/// A model on a real vocabulary: its tokenizer (from the file's own metadata) encodes text as the
/// default model's does, and the GPU's logits over that text match the CPU executor's (top-1
/// where the gap > 0.5). On the CPU (CI) the first half; on a GPU both.
#[test]
fn a_real_vocabulary_model_runs_on_the_gpu_as_on_the_cpu() {
    let Some((gguf, default)) = real_vocab_gguf() else {
        assert!(!gpu(), "the GPU check needs ZEROLAYER_REAL_VOCAB_MODEL");
        eprintln!("SKIPPED: no default model and no ZEROLAYER_REAL_VOCAB_MODEL");
        return;
    };
    let tok = token_stream::Tokenizer::from_gguf(&gguf).expect("the copied tokenizer loads");
    let text = "The capital of France is Paris. Rust's borrow checker (2015) says: \"no\"!";
    let ids: Vec<u32> = tok.encode(text).to_vec();
    assert!(ids.len() > 10, "{ids:?}");
    if let Some(d) = &default {
        let real = token_stream::Tokenizer::from_gguf(d).unwrap();
        assert_eq!(ids, real.encode(text).to_vec(), "the default model's ids");
    }
    let model = Arc::new(Model::load(gguf, ModelOptions::default().with_threads(2)).unwrap());
    let vocab = model.config().vocab_size;
    let want = all_logits(&CpuExecutor::new(model.clone()), &ids);
    assert!(want.iter().all(|v| v.is_finite()));
    let (checked, _, _) = compare(&want, &want, vocab);
    assert!(checked > 0, "no row with a clear top-1");
    if !gpu() {
        return;
    }
    let exec = CudaExecutor::new(model, options(None)).unwrap();
    let got = all_logits(&exec, &ids);
    let (checked, agree, max_diff) = compare(&want, &got, vocab);
    let argmax =
        |row: &[f32]| (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as u32;
    let next: Vec<u32> = got.chunks_exact(vocab).map(argmax).collect();
    eprintln!(
        "real vocabulary ({vocab} tokens, {} positions): top-1 {agree}/{checked}, max |logit \
         diff| {max_diff}; the GPU's next tokens: {:?}",
        ids.len(),
        tok.decode(&next)
    );
    assert_eq!(agree, checked, "top-1 differs from the CPU's");
}

/// Every (layer, head, K then V) of `ring` in view order, read back from the device through the
/// ring's slots, as f32.
fn device_views(ring: &KvRing<DeviceKv>) -> Vec<Vec<f32>> {
    let stream = ring.pool().allocator();
    let bytes: Vec<u8> = stream
        .clone_dtoh(ring.storage().buffer().expect("live ring"))
        .unwrap();
    let all: Vec<f32> = match ring.storage().dtype() {
        KvDtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes(b.try_into().unwrap()).to_f32())
            .collect(),
    };
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

/// Writes the pending rows `k`/`v` (`[n][kv heads][head_dim]`) of `layer` into a device ring
/// from the host, row by row at the slots the ring names (what `kv_scatter` does on the
/// device), and marks the layer written.
fn write_device_layer(ring: &mut KvRing<DeviceKv>, layer: usize, k: &[f32], v: &[f32]) {
    let shape = ring.pool().shape();
    let (heads, hd) = (shape.n_kv_heads, shape.head_dim);
    let slots = ring.layer_slots(layer).unwrap();
    let stream = Arc::clone(ring.pool().allocator());
    let elem = shape.dtype.bytes_for(1).unwrap();
    for (tensor, src) in [(KvTensor::K, k), (KvTensor::V, v)] {
        for head in 0..heads {
            let base = ring
                .storage()
                .block_offset(ring.block_index(layer, head, tensor));
            for i in 0..slots.pending {
                let row = &src[(i * heads + head) * hd..][..hd];
                let bytes: Vec<u8> = match shape.dtype {
                    KvDtype::F32 => row.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    _ => row
                        .iter()
                        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                        .collect(),
                };
                let at = (base + slots.slot(slots.committed + i) * hd) * elem;
                let buf = ring.storage_mut().buffer_mut().expect("live ring");
                stream
                    .memcpy_htod(&bytes, &mut buf.slice_mut(at..at + bytes.len()))
                    .unwrap();
            }
        }
    }
    ring.mark_layer_written(layer).unwrap();
}

/// The storage contract on the device: a `DeviceKv` ring (rows written at the ring's slots)
/// holds what a host ring holds through sliding eviction (the sinks moved on the device),
/// growth of a wrapped ring and forks, in f32 and f16.
#[test]
fn a_device_kv_ring_holds_what_the_host_ring_holds_through_eviction_growth_and_forks() {
    if !gpu() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let shape = KvShape::new(3, 2, 8, dtype);
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
                    // Small integers: exact in f16 too.
                    let k: Vec<f32> = (0..n * row)
                        .map(|i| ((layer * 97 + pos * 13 + i) % 1000) as f32)
                        .collect();
                    let v: Vec<f32> = k.iter().map(|x| -x).collect();
                    host.write_layer(layer, &k, &v).unwrap();
                    write_device_layer(&mut dev, layer, &k, &v);
                }
                host.commit().unwrap();
                dev.commit().unwrap();
            }
            assert_eq!((dev.len(), dev.next_pos()), (host.len(), host.next_pos()));
            assert_eq!(
                device_views(&dev),
                host_views(&host),
                "{dtype:?} step {step}"
            );
        }
        assert!(host.evicted() > 0, "the sinks moved");
        let (host_fork, dev_fork) = (host.fork(2).unwrap(), dev.fork(2).unwrap());
        assert_eq!(device_views(&dev_fork), host_views(&host_fork));
    }
}

/// Deterministic token ids below `vocab`.
fn tokens(n: usize, seed: u32, vocab: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 977 + seed * 131 + 13) % vocab)
        .collect()
}

/// A long run through the engine's kind of pool: sequence `a` is prefilled in chunks of 16
/// up to 64 tokens, grown, forked into `b` (its first 4 positions); then one batch of `a`'s
/// last 16-token chunk and `b`'s first decode token, and 30 decode steps of both. A model without window layers runs sliding rings of 24 positions with 4 sinks
/// (evicting and wrapping from the second chunk on); a model with window layers (48) runs
/// strict rings whose window layers keep their last 79 rows (48 - 1 + the pool's chunk of
/// 32), so those wrap during the decode while the window masks keys from position 48 on.
/// Returns every logits row.
fn wrapping_run<E: Executor>(exec: &E, dtype: KvDtype) -> Vec<f32> {
    let vocab = exec.config().vocab_size as u32;
    let pool = pool_of(exec, dtype, 1024);
    let windowed = pool.max_chunk().is_some();
    let (mode, cap, grown) = if windowed {
        (RingMode::Strict, 100, 140)
    } else {
        (RingMode::Sliding { sinks: 4 }, 24, 32)
    };
    let mut a = pool.alloc(cap, mode).unwrap();
    let (mut all, mut out) = (Vec::new(), Vec::new());
    for c in 0..4 {
        let chunk = tokens(16, c, vocab);
        exec.forward(
            &mut [SeqStep {
                tokens: &chunk,
                kv: &mut a,
                logits: LogitsWanted::All,
            }],
            &mut out,
        )
        .unwrap();
        all.extend_from_slice(&out);
    }
    a.grow(grown).unwrap();
    let mut b = a.fork(4).unwrap();
    // A prefill chunk and a decode token in one batch.
    let (chunk, first) = (tokens(16, 4, vocab), [7 % vocab]);
    exec.forward(
        &mut [
            SeqStep {
                tokens: &chunk,
                kv: &mut a,
                logits: LogitsWanted::All,
            },
            SeqStep {
                tokens: &first,
                kv: &mut b,
                logits: LogitsWanted::Last,
            },
        ],
        &mut out,
    )
    .unwrap();
    all.extend_from_slice(&out);
    common::decode_pair(exec, &mut a, &mut b, 30, &mut all);
    if windowed {
        let layers = exec.kv_shape(dtype).n_layers;
        assert!(
            (0..layers).any(|l| a.layer_len(l) < a.len()),
            "the window layers dropped rows"
        );
    } else {
        assert!(a.evicted() > 0 && b.evicted() > 0, "both rings wrapped");
    }
    all
}

/// The synthetic llama of the ring-wrap tests, as is and with a window of 48 on every other
/// layer (Mistral's kind of window; gemma2/3's run in the family test).
fn wrap_models() -> Vec<(&'static str, Arc<Model>)> {
    let dims = synthetic::Dims {
        n_embd: 64,
        n_ff: 128,
        n_layers: 4,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        vocab: 96,
        ctx: 256,
    };
    let windows = [
        ("llama.attention.sliding_window", synthetic::Meta::U32(48)),
        (
            "llama.attention.sliding_window_pattern",
            synthetic::Meta::U32(2),
        ),
    ];
    [("llama", &[][..]), ("llama with windows", &windows[..])]
        .into_iter()
        .map(|(name, set)| {
            let gguf = synthetic::build_with("llama", dims, 5, &[], set).build();
            let gguf = Arc::new(Gguf::from_bytes(gguf).unwrap());
            let model = Model::load(gguf, ModelOptions::default().with_threads(2)).unwrap();
            let n_windows = model.kv_windows().iter().filter(|w| w.is_some()).count();
            assert_eq!(n_windows, if set.is_empty() { 0 } else { 2 }, "{name}");
            (name, Arc::new(model))
        })
        .collect()
}

/// The ring-wrap runs work on the CPU (so a GPU run fails only on the GPU's side), and the
/// run-time choice's CPU arm (`HostedExecutor`, rings of `HostedKv` in host memory) gives the
/// CPU executor's logits bit for bit.
#[test]
fn the_wrapping_runs_wrap_on_the_cpu_and_the_hosted_cpu_arm_is_the_cpu_executor() {
    for (name, model) in wrap_models() {
        let cpu = CpuExecutor::new(model.clone());
        let want = wrapping_run(&cpu, KvDtype::F16);
        let got = wrapping_run(&HostedExecutor::from(cpu), KvDtype::F16);
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}"
        );
    }
}

/// The executor's own rings (`DeviceKv`: new rows written by `kv_scatter`, attention reading
/// the rings in place) across ring wraps, sink moves, growth, forks and window layers, in f16
/// and f32: the CUDA logits match the CPU executor's over host rings (top-1 where the gap >
/// 0.5), and the run-time choice (`HostedExecutor`, rings of `HostedKv`) gives the CUDA
/// executor's logits bit for bit.
#[test]
fn device_rings_match_the_cpu_across_wraps_sinks_growth_forks_and_windows() {
    if !gpu() {
        return;
    }
    for (name, model) in wrap_models() {
        let vocab = model.config().vocab_size;
        let gpu = CudaExecutor::new(model.clone(), options(None)).unwrap_or_else(|e| panic!("{e}"));
        let cpu = CpuExecutor::new(model);
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let want = wrapping_run(&cpu, dtype);
            let got = wrapping_run(&gpu, dtype);
            let (checked, agree, max_diff) = compare(&want, &got, vocab);
            eprintln!("{name} {dtype:?}: top-1 {agree}/{checked}, max |logit diff| {max_diff}");
            assert!(checked > 0, "{name}: no row with a clear top-1");
            assert_eq!(
                agree, checked,
                "{name} {dtype:?}: top-1 differs from the CPU's"
            );
        }
        let hosted = HostedExecutor::from(gpu);
        let via_enum = wrapping_run(&hosted, KvDtype::F16);
        let HostedExecutor::Cuda(gpu) = hosted else {
            unreachable!("built from a CUDA executor")
        };
        let direct = wrapping_run(&*gpu, KvDtype::F16);
        assert!(
            direct
                .iter()
                .zip(&via_enum)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: HostedExecutor's CUDA arm differs from the CUDA executor"
        );
    }
}

/// A ring from another kind of pool is a typed error, not a panic or a wild address: host
/// rings on the CUDA executor.
#[test]
fn the_cuda_executor_refuses_rings_not_in_its_device_memory() {
    if !gpu() {
        return;
    }
    let gpu = CudaExecutor::new(format_model(weight_cache::GgmlType::Q8_0), options(None))
        .unwrap_or_else(|e| panic!("{e}"));
    let hosted = HostedExecutor::from(gpu);
    let shape = hosted.kv_shape(KvDtype::F16);
    let host_pool = KvPool::<gpu_pipeline::executor::HostedKv>::new_in(
        shape,
        64 * shape.bytes_per_token(),
        gpu_pipeline::executor::HostedKvAllocator::Host,
    )
    .unwrap();
    let mut ring = host_pool.alloc(16, RingMode::Strict).unwrap();
    let err = hosted
        .forward(
            &mut [SeqStep {
                tokens: &[1, 2, 3],
                kv: &mut ring,
                logits: LogitsWanted::Last,
            }],
            &mut Vec::new(),
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("not in this executor's device memory"),
        "{err}"
    );
}
