//! `zerolayer tokenize`: reads `{"text": "..."}` per line on stdin, writes `{"ids": [...]}` per
//! line.
//!
//! By default special-token text (`<|im_start|>`) stays plain text; `--special` turns it into
//! special ids, as HF tokenizers' default `encode` and tiktoken's `allowed_special="all"` do.
//! `--vocab` reads `<name>.tiktoken` from `--tiktoken-dir`, `$ZEROLAYER_TIKTOKEN_DIR`,
//! `~/.cache/zerolayer/tiktoken`, or the copy shipped in the `tiktoken-rs` crate source in the
//! cargo registry.

use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use token_stream::Tokenizer;

/// `zerolayer tokenize`.
#[derive(Debug, clap::Args)]
pub(crate) struct TokenizeArgs {
    /// A GGUF model whose tokenizer to use (default: the default model).
    #[arg(long, conflicts_with = "vocab")]
    model: Option<PathBuf>,
    /// An OpenAI vocabulary: cl100k_base or o200k_base.
    #[arg(long)]
    vocab: Option<String>,
    /// Where `<vocab>.tiktoken` rank files are.
    #[arg(long, env = "ZEROLAYER_TIKTOKEN_DIR")]
    tiktoken_dir: Option<PathBuf>,
    /// Turn special-token text into special ids.
    #[arg(long)]
    special: bool,
}

fn find_rank_file(name: &str, dir: Option<&Path>) -> anyhow::Result<PathBuf> {
    let file = format!("{name}.tiktoken");
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let mut candidates: Vec<PathBuf> = dir.map(|d| d.join(&file)).into_iter().collect();
    candidates.push(home.join(".cache/zerolayer/tiktoken").join(&file));
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or(home.join(".cargo"));
    if let Ok(registries) = std::fs::read_dir(cargo_home.join("registry/src")) {
        for reg in registries.flatten() {
            if let Ok(crates) = std::fs::read_dir(reg.path()) {
                for c in crates.flatten() {
                    if c.file_name().to_string_lossy().starts_with("tiktoken-rs-") {
                        candidates.push(c.path().join("assets").join(&file));
                    }
                }
            }
        }
    }
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{file} not found: pass --tiktoken-dir or put it in ~/.cache/zerolayer/tiktoken"
            )
        })
}

/// Runs `zerolayer tokenize`.
pub(crate) fn main(args: TokenizeArgs) -> anyhow::Result<()> {
    let tok = match (&args.model, &args.vocab) {
        (model, None) => {
            let path = super::model_path(model.as_deref())?;
            // SAFETY: the model file is not modified while this process maps it.
            let gguf = unsafe { weight_cache::Gguf::open(&path) }
                .with_context(|| format!("opening {}", path.display()))?;
            Tokenizer::from_gguf(&gguf)?
        }
        (None, Some(name)) => {
            let ranks =
                std::fs::read_to_string(find_rank_file(name, args.tiktoken_dir.as_deref())?)?;
            match name.as_str() {
                "cl100k_base" => Tokenizer::cl100k_base(&ranks)?,
                "o200k_base" => Tokenizer::o200k_base(&ranks)?,
                other => bail!("unknown vocabulary {other} (cl100k_base or o200k_base)"),
            }
        }
        (Some(_), Some(_)) => bail!("give one of --model PATH or --vocab NAME, not both"),
    };
    let stdin = std::io::stdin().lock();
    let mut out = BufWriter::new(std::io::stdout().lock());
    for (n, line) in stdin.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("line {}: not JSON", n + 1))?;
        let text = v["text"]
            .as_str()
            .with_context(|| format!("line {}: no string field \"text\"", n + 1))?;
        let ids = if args.special {
            tok.encode_with_specials(text)
        } else {
            tok.encode(text)
        };
        serde_json::to_writer(&mut out, &serde_json::json!({ "ids": ids.as_slice() }))?;
        out.write_all(b"\n")?;
    }
    Ok(())
}
