//! `zerolayer run`: chat with a model in the terminal, in process (no server).
//!
//! The answer streams as it is generated. A line ending in `\` continues on the next line, and
//! `"""` opens and closes a multi-line message. `/reset` starts the conversation over (the
//! system prompt stays), `/bye` or Ctrl-D ends the program. Ctrl-C during an answer stops the
//! answer (what was written so far stays in the conversation); at the prompt it ends the program.

use std::io::{BufRead, IsTerminal as _, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Context as _;
use futures::StreamExt as _;
use gpu_pipeline::ModelOptions;
use gpu_pipeline::engine::EngineConfig;
use tokio::sync::watch;
use zerolayer::EngineService;
use zerolayer::claudelink_proto::{
    ChatMessage, ChatRole, InferenceEvent, InferenceRequest, InferenceService as _, Prompt,
};

/// `zerolayer run`.
#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// GGUF model file or Hugging Face model directory (default: the default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 1024)]
    max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    /// Seed for sampling (default: a fresh one per answer).
    #[arg(long)]
    seed: Option<u64>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// After each answer, print its token counts, time to first token and speed on stderr.
    #[arg(long)]
    stats: bool,
    /// What runs the forward pass: `cpu`, `cuda` or `auto` (as `generate --executor`).
    #[arg(long, value_enum, default_value_t = super::generate::ExecutorKind::Cpu)]
    executor: super::generate::ExecutorKind,
    /// With --executor cuda or auto: device bytes for the weights, e.g. 2G.
    #[arg(long, value_parser = zerolayer::parse_byte_size)]
    device_budget: Option<u64>,
}

const HELP: &str = "/reset  start the conversation over (the system prompt stays)\n\
/bye    leave (or Ctrl-D)\n\
\"\"\"     open or close a multi-line message; a line ending in \\ also continues\n\
Ctrl-C  stop the answer being written (at the prompt: leave)";

/// Runs `zerolayer run`.
pub(crate) fn main(args: RunArgs) -> anyhow::Result<()> {
    let path = super::model_path(args.model.as_deref())?;
    let options = ModelOptions::default().with_threads(args.threads.unwrap_or(0));
    let executor = super::generate::executor_choice(args.executor, args.device_budget)?;
    // SAFETY: the model file is not modified while this process maps it.
    let service =
        unsafe { EngineService::load_on(&path, options, EngineConfig::default(), executor) }
            .with_context(|| format!("loading {}", path.display()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let generating = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(0u64);
    rt.spawn(watch_ctrl_c(generating.clone(), stop_tx));

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        println!("{} — /help for help", service.model_id());
    }
    let mut history: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new(ChatRole::System, s.clone()))
        .collect();
    let kept = history.len();
    let mut lines = std::io::stdin().lock().lines();
    while let Some(message) = read_message(&mut lines, interactive.then_some(PromptMarks::SHOWN))? {
        match message.trim() {
            "" => continue,
            "/bye" | "/exit" | "/quit" => break,
            "/reset" | "/clear" => {
                history.truncate(kept);
                println!("(conversation cleared)");
                continue;
            }
            "/help" | "/?" => {
                println!("{HELP}");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new(ChatRole::User, message));
        generating.store(true, Ordering::SeqCst);
        let answer = rt.block_on(answer(&service, &history, &args, stop_rx.clone()));
        generating.store(false, Ordering::SeqCst);
        match answer {
            Ok(text) => history.push(ChatMessage::new(ChatRole::Assistant, text)),
            Err(e) => {
                history.pop();
                eprintln!("error: {e:#}");
            }
        }
    }
    Ok(())
}

/// Ctrl-C: stops the answer being generated, or ends the program at the prompt.
async fn watch_ctrl_c(generating: Arc<AtomicBool>, stop: watch::Sender<u64>) {
    while tokio::signal::ctrl_c().await.is_ok() {
        if generating.load(Ordering::SeqCst) {
            stop.send_modify(|n| *n += 1);
        } else {
            println!();
            std::process::exit(130);
        }
    }
}

/// Streams one answer to stdout and returns its text (cut where Ctrl-C stopped it).
async fn answer(
    service: &EngineService,
    history: &[ChatMessage],
    args: &RunArgs,
    mut stop: watch::Receiver<u64>,
) -> anyhow::Result<String> {
    stop.borrow_and_update();
    let mut request = InferenceRequest::new(
        service.model_id(),
        Prompt::Chat(history.to_vec()),
        args.max_tokens,
    );
    request.sampling.temperature = Some(args.temperature);
    request.sampling.seed = args.seed;
    let t0 = Instant::now();
    let mut events = service.submit(request)?;
    let mut out = std::io::stdout();
    let (mut text, mut first_token, mut input_tokens, mut output_tokens) =
        (String::new(), None, 0, 0);
    let mut stopped = false;
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = stop.changed() => { stopped = true; break; }
        };
        match event {
            Some(InferenceEvent::Started { input_tokens: n }) => input_tokens = n,
            Some(InferenceEvent::Delta { ids, text: piece }) => {
                first_token.get_or_insert_with(Instant::now);
                output_tokens += ids.len();
                out.write_all(piece.as_bytes())?;
                out.flush()?;
                text.push_str(&piece);
            }
            Some(InferenceEvent::Finished { .. }) | None => break,
            Some(InferenceEvent::Error { message, .. }) => anyhow::bail!("{message}"),
            Some(_) => {}
        }
    }
    // Dropping the stream cancels the request and frees its KV cache.
    drop(events);
    println!();
    if stopped {
        eprintln!("[stopped]");
    }
    if args.stats
        && let Some(first) = first_token
    {
        let decode = first.elapsed().as_secs_f64();
        eprintln!(
            "[{input_tokens} prompt tokens, {output_tokens} generated; first token after {:.0} ms, {:.1} tok/s]",
            (first - t0).as_secs_f64() * 1e3,
            output_tokens.saturating_sub(1) as f64 / decode.max(1e-9)
        );
    }
    Ok(text)
}

/// The prompts shown before a message's first and following lines.
#[derive(Debug, Clone, Copy)]
struct PromptMarks {
    first: &'static str,
    more: &'static str,
}

impl PromptMarks {
    const SHOWN: Self = Self {
        first: ">>> ",
        more: "... ",
    };
}

/// Reads one message: a line; lines joined while they end in `\`; or the lines between `"""`
/// marks. `None` at the end of input (an unclosed `"""` block is returned as it is).
fn read_message(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
    marks: Option<PromptMarks>,
) -> std::io::Result<Option<String>> {
    let show = |mark: fn(PromptMarks) -> &'static str| {
        if let Some(m) = marks {
            print!("{}", mark(m));
            let _ = std::io::stdout().flush();
        }
    };
    show(|m| m.first);
    let Some(first) = lines.next().transpose()? else {
        return Ok(None);
    };
    if let Some(rest) = first.trim_start().strip_prefix("\"\"\"") {
        if let Some(one_line) = rest.trim_end().strip_suffix("\"\"\"") {
            return Ok(Some(one_line.to_owned()));
        }
        let mut message = rest.to_owned();
        loop {
            show(|m| m.more);
            let Some(line) = lines.next().transpose()? else {
                return Ok(Some(message));
            };
            if let Some(last) = line.trim_end().strip_suffix("\"\"\"") {
                if !last.is_empty() {
                    push_line(&mut message, last);
                }
                return Ok(Some(message));
            }
            push_line(&mut message, &line);
        }
    }
    let mut message = first;
    while message.ends_with('\\') {
        message.pop();
        show(|m| m.more);
        let Some(line) = lines.next().transpose()? else {
            break;
        };
        message.push('\n');
        message.push_str(&line);
    }
    Ok(Some(message))
}

/// Appends `line` to a multi-line message (no leading newline for the first non-empty part).
fn push_line(message: &mut String, line: &str) {
    if !message.is_empty() {
        message.push('\n');
    }
    message.push_str(line);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(input: &str) -> Vec<String> {
        let mut lines = input.lines().map(|l| Ok(l.to_owned()));
        std::iter::from_fn(|| read_message(&mut lines, None).unwrap()).collect()
    }

    #[test]
    fn each_line_is_a_message() {
        assert_eq!(messages("hi\n/reset\nagain"), ["hi", "/reset", "again"]);
    }

    #[test]
    fn a_trailing_backslash_continues_the_message() {
        assert_eq!(
            messages("one \\\ntwo\\\nthree\nnext"),
            ["one \ntwo\nthree", "next"]
        );
    }

    #[test]
    fn triple_quotes_hold_a_multi_line_message() {
        assert_eq!(
            messages("\"\"\"fn main() {\n    body\n}\"\"\"\nafter"),
            ["fn main() {\n    body\n}", "after"]
        );
        assert_eq!(messages("\"\"\"\na\n\nb\n\"\"\""), ["a\n\nb"]);
        assert_eq!(messages("\"\"\"one line\"\"\""), ["one line"]);
    }

    #[test]
    fn an_unclosed_block_ends_with_the_input() {
        assert_eq!(messages("\"\"\"\na\nb"), ["a\nb"]);
    }
}
