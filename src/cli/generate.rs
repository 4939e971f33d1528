//! `zerolayer generate` (one generation, or `--score`: the top logits of every position) and
//! `zerolayer perplexity` (llama.cpp's method), in process on the CPU.
//!
//! `--json` prints `{"prompt_ids": [...], "ids": [...], "text": "...", "stop_reason": "..."}`;
//! `--score` prints `{"positions": [{"top": [[id, logit], ...]}, ...]}` (one entry per position
//! of the given sequence, the logits after it). These are what the scripts comparing against
//! llama.cpp read. `--weight-budget F [--weight-profile FILE]` keeps the model file's residency
//! within F of its size while generating (the mixture-of-experts residency bench).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use gpu_pipeline::executor::Executor;
use gpu_pipeline::{LogitsWanted, Model, SamplerConfig, SeqStep};
use kv_ring::{KvDtype, KvPool, KvRing, RingMode};
use serde_json::json;
use token_stream::{ChatTemplate, TemplateMessage, Tokenizer};

use super::{LoadedModel, load_model, model_path};

/// `zerolayer generate`.
#[derive(Debug, clap::Args)]
pub(crate) struct GenerateArgs {
    /// GGUF model file (default: the default model, see `zerolayer pull`).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Raw text prompt.
    #[arg(long, conflicts_with_all = ["chat", "prompt_ids"])]
    prompt: Option<String>,
    /// A user message, wrapped in the model's chat template with a generation prompt.
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: Option<String>,
    /// Comma-separated prompt token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Hard cap on generated tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Print the top-k logits of every position instead of generating.
    #[arg(long)]
    score: bool,
    /// With --score: how many logits per position; otherwise: top-k sampling (0 = off).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Min-p threshold.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop sequence (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Threads (0 = all CPUs or $ZEROLAYER_THREADS).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Compute on the model file's mapping as it is: do not re-arrange the weights into the
    /// packed kernels' layout at load (slower decode; for comparisons).
    #[arg(long)]
    no_pack: bool,
    /// KV-cache element type: `f16`, `q8_0` or `q4_0` (llama.cpp's block formats, 53% and 28%
    /// of f16's memory; CPU executor) or `f32`.
    #[arg(long, value_enum, default_value_t = super::KvType::F16)]
    kv_dtype: super::KvType,
    /// Activation precision of the products: `off` quantizes activations to 8 bits (llama.cpp's
    /// precision; ~30% more batched throughput and ~25% faster first tokens than the default),
    /// `ffn-down` splits the MLP down projection's input into an 8-bit part and its residual
    /// where its weights are a 32-element format (closer to fp32; a K-quant down projection is
    /// not split), `all` splits every product (about fp32, ~2x prefill work).
    #[arg(long, value_enum, default_value_t = super::Split::FfnDown)]
    activation_split: super::Split,
    /// Do not stop at the model's EOS/EOT token (benchmarks: exactly --max-tokens tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Print timings (tok/s) to stderr.
    #[arg(long)]
    timings: bool,
    /// Keep the model file's page-cache residency within this fraction of its size: a weight
    /// cache (random access, no read-ahead) enforces the budget every 100 ms while generating,
    /// after a profile-driven warm-up of 90% of it (with --weight-profile).
    #[arg(long)]
    weight_budget: Option<f64>,
    /// Access profile: loaded before (when it exists) and saved after generating.
    #[arg(long)]
    weight_profile: Option<PathBuf>,
    /// What runs the forward pass: `cpu` (the SIMD kernels), `cuda` (an NVIDIA GPU; every
    /// family and weight format; slow, and partly verified on hardware: see the
    /// gpu-pipeline README) or `auto` (the GPU where the CUDA executor starts, else the CPU; the
    /// log says which).
    #[arg(long, value_enum, default_value_t = ExecutorKind::Cpu)]
    executor: ExecutorKind,
    /// With --executor cuda or auto: device bytes for the weights, e.g. 2G; the layers that do
    /// not fit stream from host memory every step (default: all resident).
    #[arg(long, value_parser = zerolayer::parse_byte_size)]
    device_budget: Option<u64>,
    /// Speculative decoding: `off`, or `ngram` (n-gram prompt lookup; the generation then runs
    /// through the serving engine, on the CPU; the output is the same as without).
    #[arg(long, value_enum, default_value_t = super::Speculate::Off)]
    speculate: super::Speculate,
    /// With --speculate ngram or --draft-model: most draft tokens verified per step.
    #[arg(long, default_value_t = 8)]
    max_draft: usize,
    /// Speculative decoding with a draft model: a smaller GGUF file (or Hugging Face directory)
    /// with the model's vocabulary proposes the drafts (greedily, in its own KV cache); the
    /// output is the same as without. Runs through the serving engine, on the CPU.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// With --draft-model: a draft ends before a token the draft model gives a lower
    /// probability (llama.cpp's --draft-p-min; ours is over the whole vocabulary).
    #[arg(long, default_value_t = 0.1)]
    draft_p_min: f32,
    /// With --draft-model: the draft model proposes every draft. By default n-gram lookup in
    /// the request's own text goes first, and where it confidently proposes 4 tokens or more
    /// they are the draft and the draft model skips that step.
    #[arg(long)]
    no_draft_lookup: bool,
}

/// `--executor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ExecutorKind {
    /// The CPU kernels.
    Cpu,
    /// The CUDA executor (needs the `cuda` feature, on by default, and a GPU at run time).
    Cuda,
    /// The CUDA executor where it starts, else the CPU kernels (the log says which, and why).
    Auto,
}

/// `zerolayer perplexity`.
#[derive(Debug, clap::Args)]
pub(crate) struct PerplexityArgs {
    /// Text file to score.
    file: PathBuf,
    /// GGUF model file (default: the default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Window size: as llama.cpp's perplexity does, each window starts with BOS when the
    /// vocabulary adds one and is scored on its second half; the text must hold two windows.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many windows, the first ones (llama.cpp's `--chunks`; 0 = all).
    #[arg(long, default_value_t = 0)]
    chunks: usize,
    /// KV-cache element type (`f32`, the reference precision; `f16`, `q8_0` or `q4_0` to measure
    /// what they cost, as llama.cpp's `-ctk`/`-ctv`).
    #[arg(long, value_enum, default_value_t = super::KvType::F32)]
    kv_dtype: super::KvType,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Threads (0 = all CPUs or $ZEROLAYER_THREADS).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Activation precision of the products: `off` quantizes activations to 8 bits (llama.cpp's
    /// precision; ~30% more batched throughput and ~25% faster first tokens than the default),
    /// `ffn-down` splits the MLP down projection's input into an 8-bit part and its residual
    /// where its weights are a 32-element format (closer to fp32; a K-quant down projection is
    /// not split), `all` splits every product (about fp32, ~2x prefill work).
    #[arg(long, value_enum, default_value_t = super::Split::FfnDown)]
    activation_split: super::Split,
    /// What runs the forward pass: `cpu`, `cuda` or `auto` (as `generate --executor`).
    #[arg(long, value_enum, default_value_t = ExecutorKind::Cpu)]
    executor: ExecutorKind,
    /// With --executor cuda or auto: device bytes for the weights, e.g. 2G.
    #[arg(long, value_parser = zerolayer::parse_byte_size)]
    device_budget: Option<u64>,
}

/// A KV ring of `cap` tokens for `model` stored as `dtype`, from a pool sized for it alone.
/// Generation and `bench` store K/V as f16, as the server's engine and llama.cpp do (half the
/// memory); scoring (`perplexity`, `--score`) keeps f32, the reference precision.
pub(crate) fn new_ring(model: &Model, cap: usize, dtype: KvDtype) -> anyhow::Result<KvRing> {
    let shape = model.kv_shape(dtype);
    let pool = KvPool::new(shape, cap * shape.bytes_per_token())?;
    Ok(pool.alloc(cap, RingMode::Strict)?)
}

/// A ring of `cap` tokens in `exec`'s KV memory (the device's for the CUDA executor).
pub(crate) fn ring_on<E: Executor>(
    exec: &E,
    cap: usize,
    dtype: KvDtype,
) -> anyhow::Result<KvRing<E::Kv>> {
    let shape = exec.kv_shape(dtype);
    let pool = KvPool::new_in(shape, cap * shape.bytes_per_token(), exec.kv_allocator())?;
    Ok(pool.alloc(cap, RingMode::Strict)?)
}

/// `--executor`'s executor over `model` (a `cuda` that does not start is the error, named).
pub(crate) fn executor_for(
    model: Arc<Model>,
    kind: ExecutorKind,
    budget: Option<u64>,
) -> anyhow::Result<gpu_pipeline::executor::HostedExecutor> {
    let choice = executor_choice(kind, budget)?;
    zerolayer::executor(model, choice).map_err(|e| match choice {
        zerolayer::ExecutorChoice::Cuda { .. } => anyhow::anyhow!("--executor cuda: {e}"),
        _ => e.into(),
    })
}

/// Runs `zerolayer perplexity`: llama.cpp's `perplexity()` (`tools/perplexity/perplexity.cpp`).
/// The file's text, less one trailing newline (as llama.cpp's `-f` reads a prompt file), is
/// tokenized as a prompt (BOS first when the vocabulary adds one), cut into windows by
/// [`perplexity_windows`] (BOS in each window's first place), and each window is scored on its
/// second half.
pub(crate) fn perplexity(a: PerplexityArgs) -> anyhow::Result<()> {
    let LoadedModel {
        model, tokenizer, ..
    } = load_model(
        &model_path(a.model.as_deref())?,
        a.threads,
        false,
        a.activation_split,
    )?;
    if tokenizer.add_eos() {
        // llama.cpp's perplexity refuses these too (`GGML_ASSERT(!llama_vocab_get_add_eos)`):
        // an end token after the text is not part of it.
        bail!("this vocabulary ends every prompt with a token: perplexity is not defined for it");
    }
    let vocab = model.config().vocab_size;
    let exec = executor_for(Arc::new(model), a.executor, a.device_budget)?;
    let mut text = std::fs::read_to_string(&a.file)?;
    if text.ends_with('\n') {
        text.pop();
    }
    let ids = tokenizer.encode_for_model(&text).into_vec();
    if a.ctx < 4 || ids.len() < 2 * a.ctx {
        bail!(
            "{} tokens: perplexity needs at least twice the window ({}), as llama.cpp's does",
            ids.len(),
            a.ctx
        );
    }
    let bos = tokenizer.add_bos().then(|| tokenizer.bos_id()).flatten();
    let n_win = match a.chunks {
        0 => ids.len() / a.ctx,
        c => c.min(ids.len() / a.ctx),
    };
    let mut logits = Vec::new();
    let (mut nll, mut count) = (0f64, 0usize);
    // The perplexity after each window, as llama.cpp prints it (`[1]15.1756,[2]...`).
    let mut running = Vec::with_capacity(n_win);
    let t0 = Instant::now();
    for (w, window) in perplexity_windows(&ids, a.ctx, bos).take(n_win).enumerate() {
        let mut kv = ring_on(&exec, a.ctx, a.kv_dtype.into())?;
        exec.forward(
            &mut [SeqStep {
                tokens: &window,
                kv: &mut kv,
                logits: LogitsWanted::All,
            }],
            &mut logits,
        )?;
        for j in a.ctx / 2..a.ctx - 1 {
            nll += gpu_pipeline::token_nll(&logits[j * vocab..(j + 1) * vocab], window[j + 1]);
            count += 1;
        }
        running.push((nll / count as f64).exp());
        eprintln!("[{}/{n_win}] running ppl {:.4}", w + 1, running[w]);
    }
    let ppl = (nll / count as f64).exp();
    if a.json {
        println!(
            "{}",
            json!({"perplexity": ppl, "tokens": ids.len(), "windows": n_win, "ctx": a.ctx, "scored": count, "bos": bos, "running": running})
        );
    } else {
        println!(
            "perplexity {ppl:.4} over {n_win} windows of {} ({} tokens, {:.1}s)",
            a.ctx,
            ids.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The windows llama.cpp's perplexity evaluates: `ids` (the whole text as one prompt) cut into
/// `ids.len() / ctx` consecutive windows of `ctx` tokens, the rest dropped, each window's first
/// token replaced by `bos` when the vocabulary adds one (`Some`), so every window starts as a
/// prompt does. Each window is scored on its second half (`window[j + 1]` after position `j`, for
/// `j` in `ctx / 2..ctx - 1`), never on the replaced token.
fn perplexity_windows(
    ids: &[u32],
    ctx: usize,
    bos: Option<u32>,
) -> impl Iterator<Item = Vec<u32>> + '_ {
    ids.chunks_exact(ctx.max(1)).map(move |chunk| {
        let mut window = chunk.to_vec();
        if let (Some(bos), Some(first)) = (bos, window.first_mut()) {
            *first = bos;
        }
        window
    })
}

/// Runs `zerolayer generate`.
pub(crate) fn main(a: GenerateArgs) -> anyhow::Result<()> {
    let loaded = load_model(
        &model_path(a.model.as_deref())?,
        a.threads,
        a.no_pack,
        a.activation_split,
    )?;
    let prompt = prompt_ids(&a, &loaded.tokenizer, loaded.chat.as_ref())?;
    if a.score {
        score(&loaded.model, &prompt, a.top_k.unwrap_or(5))
    } else {
        generate(&a, loaded, &prompt)
    }
}

/// `--executor` and `--device-budget` as an executor choice.
pub(crate) fn executor_choice(
    kind: ExecutorKind,
    budget: Option<u64>,
) -> anyhow::Result<zerolayer::ExecutorChoice> {
    match kind {
        ExecutorKind::Cpu if budget.is_some() => {
            bail!("--device-budget needs --executor cuda or auto")
        }
        ExecutorKind::Cpu => Ok(zerolayer::ExecutorChoice::Cpu),
        ExecutorKind::Cuda => Ok(zerolayer::ExecutorChoice::Cuda { budget }),
        ExecutorKind::Auto => Ok(zerolayer::ExecutorChoice::Auto { budget }),
    }
}

/// The prompt's token ids from `--prompt-ids`, `--chat` (rendered with the model's chat
/// template, as the server renders it) or `--prompt`.
fn prompt_ids(
    a: &GenerateArgs,
    tok: &Tokenizer,
    chat: Option<&ChatTemplate>,
) -> anyhow::Result<Vec<u32>> {
    let prompt: Vec<u32> = if let Some(ids) = &a.prompt_ids {
        ids.clone()
    } else if let Some(msg) = &a.chat {
        let Some(tmpl) = chat else {
            bail!("--chat: the model has no usable chat template");
        };
        tmpl.encode(tok, &[TemplateMessage::new("user", msg)], true)?
            .into_vec()
    } else if let Some(p) = &a.prompt {
        tok.encode(p).into_vec()
    } else {
        bail!("give one of --prompt, --chat or --prompt-ids");
    };
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    Ok(prompt)
}

/// Prints the `k` largest logits after every position of `prompt` as JSON.
fn score(model: &Model, prompt: &[u32], k: usize) -> anyhow::Result<()> {
    let vocab = model.config().vocab_size;
    let k = k.clamp(1, vocab);
    let mut kv = new_ring(model, prompt.len(), KvDtype::F32)?;
    let mut logits = Vec::new();
    model.forward(
        &mut [SeqStep {
            tokens: prompt,
            kv: &mut kv,
            logits: LogitsWanted::All,
        }],
        &mut logits,
    )?;
    let positions: Vec<_> = logits
        .chunks_exact(vocab)
        .map(|row| {
            let mut idx: Vec<usize> = (0..vocab).collect();
            idx.select_nth_unstable_by(k - 1, |&x, &y| row[y].total_cmp(&row[x]).then(x.cmp(&y)));
            idx.truncate(k);
            idx.sort_by(|&x, &y| row[y].total_cmp(&row[x]).then(x.cmp(&y)));
            json!({"top": idx.iter().map(|&i| json!([i, row[i]])).collect::<Vec<_>>()})
        })
        .collect();
    println!("{}", json!({"prompt_ids": prompt, "positions": positions}));
    Ok(())
}

/// A weight cache over the model's file with a budget of `fraction` of it, attached to
/// `model`, the profile's warm-up done, and a thread enforcing the budget until `stop` is set.
fn budgeted_cache(
    model: &Model,
    fraction: f64,
    profile: Option<&PathBuf>,
    stop: &Arc<AtomicBool>,
) -> anyhow::Result<weight_cache::WeightCache> {
    use weight_cache::{CacheConfig, WarmupStrategy, WeightCache};
    let Some(gguf) = model.gguf() else {
        bail!("--weight-budget needs a GGUF model");
    };
    let budget = (gguf.bytes().len() as f64 * fraction) as usize;
    let cfg = CacheConfig::default()
        .budget_bytes(Some(budget))
        .random_access(true);
    let cache = WeightCache::new(Arc::clone(gguf), cfg)?;
    if model.attach_weight_cache(cache.clone()).is_err() {
        bail!("the model has a weight cache already");
    }
    cache.enforce_budget()?;
    if let Some(p) = profile.filter(|p| p.exists()) {
        cache.load_profile(p)?;
        let warm = WarmupStrategy::Deterministic {
            fraction: (fraction * 0.9) as f32,
            mlock: false,
        };
        cache.warm(warm).wait();
    }
    let (c, stop) = (cache.clone(), Arc::clone(stop));
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            let _ = c.enforce_budget();
        }
    });
    Ok(cache)
}

/// Generates from `prompt` through the serving engine (one request), streaming the text to
/// stdout unless `--json`.
fn generate(a: &GenerateArgs, loaded: LoadedModel, prompt: &[u32]) -> anyhow::Result<()> {
    use gpu_pipeline::engine::{Engine, GenerationRequest};
    let LoadedModel {
        model, tokenizer, ..
    } = loaded;
    let (model, tokenizer) = (Arc::new(model), Arc::new(tokenizer));
    let speculating = a.speculate != super::Speculate::Off || a.draft_model.is_some();
    if a.executor == ExecutorKind::Cuda && speculating {
        bail!("--speculate and --draft-model need --executor cpu");
    }
    // Speculation runs on the CPU executor: `auto` picks it (and has no device budget to use).
    let (kind, budget) = match a.executor {
        ExecutorKind::Auto if speculating => {
            tracing::info!(
                "speculative decoding runs on the CPU kernels: --executor auto picks them"
            );
            (ExecutorKind::Cpu, None)
        }
        kind => (kind, a.device_budget),
    };
    let speculation = super::speculation(
        a.speculate,
        a.max_draft,
        a.draft_model.as_deref(),
        a.draft_p_min,
        !a.no_draft_lookup,
        a.threads,
    )?;
    let exec = executor_for(model.clone(), kind, budget)?;
    let sampling = SamplerConfig::default()
        .with_temperature(a.temperature)
        .with_top_k(a.top_k.unwrap_or(0))
        .with_top_p(a.top_p)
        .with_min_p(a.min_p)
        .with_repetition_penalty(a.repeat_penalty, 64)
        .with_seed(a.seed);
    // Like llama.cpp's tools, generation ends when the context is full.
    let max_tokens = a
        .max_tokens
        .min(model.config().context_length.saturating_sub(prompt.len()));
    if max_tokens == 0 {
        bail!(
            "the prompt ({} tokens) leaves no room in the context of {}",
            prompt.len(),
            model.config().context_length
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let cache = match a.weight_budget {
        Some(f) => Some(budgeted_cache(&model, f, a.weight_profile.as_ref(), &stop)?),
        None => None,
    };
    let cfg = one_request_engine(&exec, prompt.len() + max_tokens, a.kv_dtype.into())
        .with_speculation(speculation);
    let engine = Engine::with_executor(Arc::new(exec), Some(tokenizer), cfg)?;
    let mut req = GenerationRequest::new(prompt.to_vec(), max_tokens)
        .with_sampling(sampling)
        .with_stop_sequences(a.stop.clone());
    if a.ignore_eos {
        req = req.with_stop_tokens(Vec::new());
    }
    let mut out = std::io::stdout();
    let g = engine.generate(req, &mut |text| {
        if !a.json {
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
        }
    })?;
    if a.json {
        println!(
            "{}",
            json!({"prompt_ids": prompt, "ids": g.ids, "text": g.text, "stop_reason": g.stop_reason.as_str()})
        );
    } else {
        println!();
    }
    if a.timings {
        eprintln!(
            "prompt {} tokens, time to first token {:.1} ms ({:.1} tok/s prefill); {} generated, {:.1} tok/s decode; stop: {}",
            g.prompt_tokens,
            g.time_to_first_token.as_secs_f64() * 1e3,
            g.prompt_tokens as f64 / g.time_to_first_token.as_secs_f64(),
            g.ids.len(),
            g.decode_tokens_per_second().unwrap_or(0.0),
            g.stop_reason
        );
        if speculating {
            let m = engine.metrics();
            eprintln!(
                "speculation: {} draft tokens ({} by lookup), {} accepted ({:.2}), {:.2} tokens per target step",
                m.draft_tokens,
                m.lookup_draft_tokens,
                m.accepted_draft_tokens,
                m.draft_acceptance_rate(),
                m.tokens_per_sampled_step()
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(c) = cache {
        let s = c.stats();
        let tokens = (g.prompt_tokens + g.ids.len()).max(1) as f64;
        eprintln!(
            "weight cache: budget {:.0}% of {} bytes, resident now {} bytes, storage reads {} \
             bytes per token, hit rate {:?}, expert hit rate {:?}",
            a.weight_budget.unwrap_or(0.0) * 100.0,
            s.file_bytes,
            s.resident_bytes,
            s.storage_read_bytes
                .map_or("n/a".to_string(), |b| format!("{:.0}", b as f64 / tokens)),
            s.hit_rate,
            s.part_hit_rate
        );
        if let Some(p) = &a.weight_profile {
            c.save_profile(p)?;
        }
    }
    Ok(())
}

/// The engine configuration of the in-process commands (`generate`, `bench`): one request at a
/// time of at most `tokens` tokens (prompt and generation), K/V stored as `dtype`, no prefix
/// reuse (each request computes its whole prompt, as llama.cpp's tools do), prompts prefilled
/// in chunks of 128 tokens: a chunk's activation scratch (~70 KB per token on SmolLM2-135M) is
/// part of the peak RSS, and the batched kernels multiply at most 128 tokens per weight-panel
/// packing anyway (default model, 512-token prompt, 2 threads: 128 vs 256 tokens per chunk
/// 1100-1269 vs 977-1285 tok/s, peak RSS 137.2-137.8 vs 143.9-144.3 MiB).
pub(crate) fn one_request_engine<E: Executor>(
    exec: &E,
    tokens: usize,
    dtype: KvDtype,
) -> gpu_pipeline::engine::EngineConfig {
    let cfg = gpu_pipeline::engine::EngineConfig::default()
        .with_prefix_cache_entries(0)
        .with_max_running(1)
        .with_prefill_chunk(128)
        .with_kv_dtype(dtype);
    // The pool holds the request's KV rounded up to the growth chunk.
    let bytes = (tokens + cfg.kv_grow_chunk) * exec.kv_shape(dtype).bytes_per_token();
    cfg.with_kv_budget_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::perplexity_windows;

    #[test]
    fn perplexity_windows_start_with_bos_when_the_vocabulary_adds_it_and_drop_the_rest() {
        // The text as llama.cpp tokenizes it: BOS (1) first, then 10 tokens.
        let ids = [1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19];
        let windows: Vec<_> = perplexity_windows(&ids, 4, Some(1)).collect();
        assert_eq!(
            windows,
            [vec![1, 10, 11, 12], vec![1, 14, 15, 16]],
            "the second window's first token (13) is replaced; 17..19 make no whole window"
        );
    }

    #[test]
    fn perplexity_windows_are_the_plain_chunks_without_bos() {
        let ids: Vec<u32> = (100..109).collect();
        let windows: Vec<_> = perplexity_windows(&ids, 3, None).collect();
        assert_eq!(
            windows,
            [
                vec![100, 101, 102],
                vec![103, 104, 105],
                vec![106, 107, 108]
            ]
        );
    }
}
