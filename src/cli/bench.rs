//! `zerolayer bench`: prompt-processing (`pp`, one forward pass over N tokens) and
//! text-generation (`tg`, N decode steps of one request through the serving engine) speed of a
//! model in process, as llama.cpp's `llama-bench` reports them; the median of `--reps` runs. `scripts/bench-vs-llamacpp` runs llama.cpp on the same file
//! beside it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use gpu_pipeline::engine::{Engine, GenerationRequest};
use gpu_pipeline::executor::Executor;
use gpu_pipeline::{LogitsWanted, SeqStep};
use serde_json::json;

use super::generate::one_request_engine;
use super::{LoadedModel, load_model, model_path};
use kv_ring::KvDtype;

/// `zerolayer bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// GGUF model file (default: the default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt tokens of the `pp` test.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Generated tokens of the `tg` test.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Runs of each test (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Compute threads (0 = all CPUs or $ZEROLAYER_THREADS).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Compute on the model file's mapping as it is: do not re-arrange the weights into the
    /// packed kernels' layout at load (slower decode; for comparisons).
    #[arg(long)]
    no_pack: bool,
    /// Activation precision of the products: `off` quantizes activations to 8 bits (llama.cpp's
    /// precision; ~30% more batched throughput and ~25% faster first tokens than the default),
    /// `ffn-down` splits the MLP down projection's input into an 8-bit part and its residual
    /// where its weights are a 32-element format (closer to fp32; a K-quant down projection is
    /// not split), `all` splits every product (about fp32, ~2x prefill work).
    #[arg(long, value_enum, default_value_t = super::Split::FfnDown)]
    activation_split: super::Split,
    /// KV-cache element type of both tests (`q8_0`, `q4_0`: llama.cpp's `-ctk q8_0 -ctv q8_0`,
    /// `-ctk q4_0 -ctv q4_0`).
    #[arg(long, value_enum, default_value_t = super::KvType::F16)]
    kv_dtype: super::KvType,
    /// Tokens already in the KV cache when the `tg` test starts (llama-bench's `-d`): the
    /// decode speed at that context length. Prefilled before timing.
    #[arg(long, default_value_t = 0)]
    depth: usize,
    /// Print one JSON object (with, beside llama-bench's figures, the `tg` request's time to
    /// first token: the prefill of its `--depth` tokens and one more).
    #[arg(long)]
    json: bool,
    /// What runs both tests: `cpu`, `cuda` or `auto` (as `generate --executor`).
    #[arg(long, value_enum, default_value_t = super::generate::ExecutorKind::Cpu)]
    executor: super::generate::ExecutorKind,
    /// With --executor cuda or auto: device bytes for the weights, e.g. 2G.
    #[arg(long, value_parser = zerolayer::parse_byte_size)]
    device_budget: Option<u64>,
}

/// Text the `pp` prompt is cut from (repeated as needed).
const PROMPT_TEXT: &str = "The quick brown fox jumps over the lazy dog while the river runs \
    past the mill, and the miller counts the sacks of grain one by one. ";

/// Runs `zerolayer bench`.
pub(crate) fn main(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.prompt_tokens > 0 && a.gen_tokens > 1 && a.reps > 0,
        "--prompt-tokens, --reps must be at least 1 and --gen-tokens at least 2"
    );
    let path = model_path(a.model.as_deref())?;
    let LoadedModel {
        model, tokenizer, ..
    } = load_model(&path, a.threads, a.no_pack, a.activation_split)?;
    let mut prompt = Vec::new();
    while prompt.len() < a.prompt_tokens {
        prompt.extend_from_slice(tokenizer.encode(PROMPT_TEXT).as_slice());
    }
    prompt.truncate(a.prompt_tokens);
    let exec = Arc::new(super::generate::executor_for(
        Arc::new(model),
        a.executor,
        a.device_budget,
    )?);

    let mut logits = Vec::new();
    let mut pp = Vec::with_capacity(a.reps);
    for _ in 0..a.reps {
        let mut kv = super::generate::ring_on(&*exec, a.prompt_tokens, a.kv_dtype.into())?;
        let t0 = Instant::now();
        exec.forward(
            &mut [SeqStep {
                tokens: &prompt,
                kv: &mut kv,
                logits: LogitsWanted::Last,
            }],
            &mut logits,
        )?;
        pp.push(a.prompt_tokens as f64 / t0.elapsed().as_secs_f64());
    }
    // Generation through the serving engine (one request at a time, as `generate` runs):
    // the depth's tokens (the prompt text repeated) and one more are the prompt, and the
    // decode speed counts the tokens after the first.
    let mut context = Vec::with_capacity(a.depth + 1);
    while context.len() < a.depth + 1 {
        context.extend_from_slice(tokenizer.encode(PROMPT_TEXT).as_slice());
    }
    context.truncate(a.depth + 1);
    let cfg = one_request_engine(&*exec, context.len() + a.gen_tokens, a.kv_dtype.into());
    let engine = Engine::with_executor(exec, None, cfg)?;
    let (mut tg, mut first) = (Vec::with_capacity(a.reps), Vec::with_capacity(a.reps));
    for _ in 0..a.reps {
        let req =
            GenerationRequest::new(context.clone(), a.gen_tokens).with_stop_tokens(Vec::new());
        let g = engine.generate(req, &mut |_| {})?;
        tg.push(g.decode_tokens_per_second().unwrap_or(0.0));
        first.push(g.time_to_first_token.as_secs_f64() * 1e3);
    }
    let first_ms = median(&mut first);
    let (pp, tg) = (median(&mut pp), median(&mut tg));
    let threads = if a.threads == 0 {
        std::thread::available_parallelism().map_or(1, usize::from)
    } else {
        a.threads
    };
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    if a.json {
        println!(
            "{}",
            json!({"model": name, "threads": threads, "reps": a.reps,
                   "kv_dtype": format!("{:?}", KvDtype::from(a.kv_dtype)),
                   "pp": {"tokens": a.prompt_tokens, "tokens_per_second": pp},
                   "tg": {"tokens": a.gen_tokens, "depth": a.depth, "tokens_per_second": tg,
                          "time_to_first_token_ms": first_ms}})
        );
    } else {
        println!("| model | threads | test | t/s (median of {}) |", a.reps);
        println!("|---|---|---|---|");
        println!("| {name} | {threads} | pp{} | {pp:.1} |", a.prompt_tokens);
        let depth = if a.depth > 0 {
            format!(" @ d{}", a.depth)
        } else {
            String::new()
        };
        println!(
            "| {name} | {threads} | tg{}{depth} | {tg:.1} |",
            a.gen_tokens
        );
    }
    Ok(())
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
