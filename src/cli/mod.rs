//! The subcommands of the `zerolayer` binary, one module each, and what they share: logging
//! and loading a model.

mod bench;
mod generate;
mod logging;
mod pull;
mod run;
mod serve;
mod tokenize;
mod wheel;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use gpu_pipeline::{ActivationSplit, Model, ModelOptions, WeightPacking};
use token_stream::{ChatTemplate, Tokenizer};

/// Serve LLMs with almost nothing between the request and the matrix math.
#[derive(Debug, Parser)]
#[command(name = "zerolayer", version, propagate_version = true)]
struct Cli {
    /// Log format on stderr: `text` (coloured only when stderr is a terminal) or `json` (one
    /// object per line). `RUST_LOG` sets the filter.
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Text)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model: the Anthropic Messages / OpenAI Chat Completions APIs and a chat page on
    /// TCP (HTTP/1.1, HTTP/2), claudelink and HTTP/3 on UDP.
    Serve(serve::ServeArgs),
    /// Chat with a model in the terminal (in process).
    Run(run::RunArgs),
    /// Generate text from a prompt, or score a token sequence.
    Generate(generate::GenerateArgs),
    /// Tokenize JSON lines `{"text": ...}` from stdin into `{"ids": [...]}`.
    Tokenize(tokenize::TokenizeArgs),
    /// Perplexity of a model on a text file (llama.cpp's method).
    Perplexity(generate::PerplexityArgs),
    /// Download the default model (SmolLM2-135M-Instruct Q4_1) into the model cache.
    Pull(pull::PullArgs),
    /// Prompt-processing and generation speed of a model (llama-bench's pp/tg tests).
    Bench(bench::BenchArgs),
    /// Wait, then exit: the Kubernetes `preStop` pause in an image that has no `sleep` binary
    /// (the lifecycle `sleep` action needs Kubernetes 1.30).
    Sleep(SleepArgs),
}

/// `zerolayer sleep`.
#[derive(Debug, clap::Args)]
struct SleepArgs {
    /// Seconds to wait.
    seconds: u64,
}

/// Parses the command line, sets up logging and runs the subcommand.
pub(crate) fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_filter = match cli.command {
        // The chat and the one-shot tools keep the terminal for their own output.
        Command::Serve(_) | Command::Pull(_) => "info,h3=warn,quinn=warn",
        _ => "warn",
    };
    logging::init(cli.log_format, default_filter);
    let result = match cli.command {
        Command::Serve(a) => serve::main(a),
        Command::Run(a) => run::main(a),
        Command::Generate(a) => generate::main(a),
        Command::Tokenize(a) => tokenize::main(a),
        Command::Perplexity(a) => generate::perplexity(a),
        Command::Pull(a) => pull::main(a),
        Command::Bench(a) => bench::main(a),
        Command::Sleep(a) => {
            std::thread::sleep(std::time::Duration::from_secs(a.seconds));
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zerolayer: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--model`, else `$ZEROLAYER_MODEL`, else the default model in the cache, pulled first (as
/// `zerolayer pull` does) when it is not there yet.
fn model_path(model: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = model {
        return Ok(p.to_path_buf());
    }
    match weight_cache::locate_default_model() {
        Ok(p) => Ok(p),
        Err(e) if std::env::var_os("ZEROLAYER_MODEL").is_some_and(|v| !v.is_empty()) => {
            Err(e.into())
        }
        Err(_) => {
            eprintln!("the default model is not in the cache yet: pulling it");
            let index =
                std::env::var("PIP_INDEX_URL").unwrap_or_else(|_| pull::DEFAULT_INDEX.into());
            pull::pull(&index, false)
        }
    }
}

/// `--kv-dtype`: how the KV cache stores keys and values (llama.cpp's `-ctk`/`-ctv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum KvType {
    /// 2 bytes per element.
    F16,
    /// llama.cpp's `q8_0` blocks: 34 bytes per 32 elements (53% of f16); `head_dim` a multiple
    /// of 32; the CPU executor only.
    #[value(name = "q8_0")]
    Q8_0,
    /// llama.cpp's `q4_0` blocks: 18 bytes per 32 elements (28% of f16); `head_dim` a multiple
    /// of 32; the CPU executor only.
    #[value(name = "q4_0")]
    Q4_0,
    /// 4 bytes per element (the reference precision).
    F32,
}

impl From<KvType> for kv_ring::KvDtype {
    fn from(t: KvType) -> Self {
        match t {
            KvType::F16 => Self::F16,
            KvType::Q8_0 => Self::Q8_0,
            KvType::Q4_0 => Self::Q4_0,
            KvType::F32 => Self::F32,
        }
    }
}

/// `--speculate`: see [`Speculation`](gpu_pipeline::engine::Speculation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Speculate {
    /// One token per sequence per step.
    #[default]
    Off,
    /// N-gram prompt lookup: drafts from each request's own prompt and output, verified in its
    /// step of the batched forward pass (the output is the same as without).
    Ngram,
}

/// The engine's speculation from `--speculate`, `--max-draft`, `--draft-model` (a GGUF file
/// or Hugging Face directory with the model's vocabulary, loaded with `threads` compute threads
/// and 8-bit activations: a draft's precision changes only how many drafts are accepted),
/// `--draft-p-min` and `--no-draft-lookup` (`lookup_first` false).
pub(crate) fn speculation(
    speculate: Speculate,
    max_draft: usize,
    draft_model: Option<&Path>,
    p_min: f32,
    lookup_first: bool,
    threads: usize,
) -> anyhow::Result<gpu_pipeline::engine::Speculation> {
    use gpu_pipeline::engine::{DraftModel, NgramLookup, Speculation};
    match (speculate, draft_model) {
        (Speculate::Ngram, Some(_)) => {
            bail!("--draft-model proposes the drafts itself: leave out --speculate ngram")
        }
        (_, Some(path)) => {
            let draft = load_model(path, threads, false, Split::Off)?;
            Ok(Speculation::DraftModel(
                DraftModel::new(Arc::new(draft.model))
                    .with_max_draft(max_draft)
                    .with_min_probability(p_min)
                    .with_lookup_first(lookup_first.then(NgramLookup::default)),
            ))
        }
        (s, None) => Ok(s.engine(max_draft)),
    }
}

impl Speculate {
    /// The engine's setting, with at most `max_draft` draft tokens per step.
    pub(crate) fn engine(self, max_draft: usize) -> gpu_pipeline::engine::Speculation {
        use gpu_pipeline::engine::{NgramLookup, Speculation};
        match self {
            Self::Off => Speculation::Off,
            Self::Ngram => {
                Speculation::NgramLookup(NgramLookup::default().with_max_draft(max_draft))
            }
        }
    }
}

/// `--activation-split`: see [`ActivationSplit`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Split {
    /// 8-bit activations everywhere (llama.cpp's precision).
    Off,
    /// Split the MLP down projection's input where its weights are a 32-element format (the
    /// default; K-quant down projections are not split).
    #[default]
    FfnDown,
    /// Split every product.
    All,
}

impl From<Split> for ActivationSplit {
    fn from(s: Split) -> Self {
        match s {
            Split::Off => Self::Off,
            Split::FfnDown => Self::FfnDown,
            Split::All => Self::All,
        }
    }
}

/// The model options of the `--threads`, `--no-pack` and `--activation-split` flags.
fn model_options(threads: usize, no_pack: bool, split: Split) -> ModelOptions {
    let packing = if no_pack {
        WeightPacking::Off
    } else {
        WeightPacking::Auto
    };
    ModelOptions::default()
        .with_threads(threads)
        .with_packing(packing)
        .with_activation_split(split.into())
}

/// A model mapped with its tokenizer and chat template, for the in-process subcommands.
struct LoadedModel {
    model: Model,
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
}

/// Maps the model at `path` (a GGUF file or a Hugging Face model directory) with
/// [`zerolayer::load_model`], the server's loader.
fn load_model(
    path: &Path,
    threads: usize,
    no_pack: bool,
    split: Split,
) -> anyhow::Result<LoadedModel> {
    // SAFETY: the model files are not modified while this process maps them.
    let (model, tokenizer) =
        unsafe { zerolayer::load_model(path, model_options(threads, no_pack, split)) }
            .with_context(|| format!("loading {}", path.display()))?;
    let chat = zerolayer::chat_template(&tokenizer, model.source().as_ref());
    Ok(LoadedModel {
        model,
        tokenizer,
        chat,
    })
}
