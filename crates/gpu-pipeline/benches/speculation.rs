//! Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding, on the
//! default model (or another), one stream at a time, greedy: the committed prompt set
//! `benches/speculation_prompts.txt`
//! (code and config edits, a list, a quote: `repetitive`; answers in the model's own words:
//! `chat`). For each prompt and mode, decode tokens/s (tokens after the first over the time
//! from the first token to the last), medians over rounds that alternate which mode runs
//! first; the ratio of the medians, the median of the back-to-back pairs' ratios, and the
//! ratio per CPU-second of the process (less sensitive to other processes on a shared
//! machine); the drafts' acceptance rate, drafts per run and the tokens per target step;
//! whether the outputs were identical. Then the same per kind, over all its tokens.
//!
//! `scripts/bench-speculation`, or `cargo bench -p zerolayer-gpu-pipeline --bench speculation`
//! (ZEROLAYER_BENCH_THREADS, default 2; ZEROLAYER_BENCH_ROUNDS, default 3;
//! ZEROLAYER_BENCH_MAX_DRAFT, default the engine's; ZEROLAYER_BENCH_P_MIN, lookup's
//! `NgramLookup::min_probability` or the draft model's `DraftModel::min_probability`;
//! ZEROLAYER_BENCH_PROMPTS, another prompt file of the same format, such as
//! `benches/speculation_prompts_heldout.txt`, prompts that did not set lookup's prior; and
//! ZEROLAYER_BENCH_MIN_NGRAM with ZEROLAYER_BENCH_MAX_NGRAM likewise). ZEROLAYER_BENCH_MODEL: the
//! target model file (default: the default model); ZEROLAYER_BENCH_DRAFT: a draft model file
//! of the same vocabulary, which then proposes instead of lookup (ZEROLAYER_BENCH_MIN_ACCEPTANCE:
//! its `DraftModel::min_acceptance`; ZEROLAYER_BENCH_DRAFT_LOOKUP=0: without its lookup first,
//! `DraftModel::lookup_first`); ZEROLAYER_BENCH_MAX_BATCH: `max_batch` of either proposer (the
//! most decoding sequences for which anyone drafts; it matters in the batched runs);
//! ZEROLAYER_BENCH_PROMPTS_OUT: a directory that receives each
//! prompt as text (`NAME.txt`, special tokens written out) and its token limit
//! (`NAME.max`), for a peer run on the same prompts (`scripts/bench-speculation
//! --draft-model`); ZEROLAYER_BENCH_TOKENS_OUT: a directory that receives each prompt's token
//! ids and its plain greedy output's (`NAME.tokens`: a `name kind` line, then the prompt's ids,
//! then the output's, space-separated), for studying draft policies offline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pipeline::engine::{
    DraftModel, Engine, EngineConfig, GenerationRequest, NgramLookup, Speculation,
};
use gpu_pipeline::zerolayer_api::InferenceEvent;
use gpu_pipeline::{Model, ModelOptions};
use token_stream::{ChatTemplate, TemplateMessage, Tokenizer};

const PROMPTS: &str = include_str!("speculation_prompts.txt");

struct Prompt {
    name: String,
    kind: String,
    max_tokens: usize,
    ids: Vec<u32>,
}

fn prompts(tok: &Tokenizer) -> Vec<Prompt> {
    let chat = ChatTemplate::from_tokenizer(tok).expect("chat template");
    let mut out = Vec::new();
    let text = match std::env::var_os("ZEROLAYER_BENCH_PROMPTS") {
        Some(f) => std::fs::read_to_string(f).expect("read ZEROLAYER_BENCH_PROMPTS"),
        None => PROMPTS.to_owned(),
    };
    for section in text.split("\n=== ").skip(1) {
        let (head, body) = section.split_once('\n').expect("a header line");
        let mut h = head.split_whitespace();
        let (name, kind, max) = (h.next(), h.next(), h.next());
        let (Some(name), Some(kind), Some(max)) = (name, kind, max) else {
            panic!("bad header {head:?}");
        };
        let msgs = [TemplateMessage::new("user", body.trim_end())];
        out.push(Prompt {
            name: name.into(),
            kind: kind.into(),
            max_tokens: max.parse().expect("max tokens"),
            ids: chat.encode(tok, &msgs, true).expect("encode").to_vec(),
        });
    }
    out
}

/// One run of a prompt: generated ids, decode tokens and time (wall clock, and the process's
/// CPU time: less sensitive to other processes on a shared machine).
struct Run {
    ids: Vec<u32>,
    decode_tokens: usize,
    decode_time: Duration,
    decode_cpu: Duration,
}

/// CPU time of this process (all threads) so far, from /proc/self/stat (10 ms ticks).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) in parentheses: utime is the
    // 14th field of the line, stime the 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    Duration::from_millis(f.iter().sum::<u64>() * 10)
}

fn run(e: &Engine, p: &Prompt) -> Run {
    let h = e
        .submit(GenerationRequest::new(p.ids.clone(), p.max_tokens))
        .expect("submit");
    let mut ids = Vec::new();
    let (mut first, mut last) = (None, None);
    let (mut cpu_first, mut cpu_last) = (Duration::ZERO, Duration::ZERO);
    while let Some(ev) = h.recv() {
        match ev {
            InferenceEvent::Delta { ids: new, .. } if !new.is_empty() => {
                let now = Instant::now();
                if first.is_none() {
                    cpu_first = cpu_time();
                }
                first.get_or_insert(now);
                last = Some(now);
                cpu_last = cpu_time();
                ids.extend(new);
            }
            InferenceEvent::Finished { .. } => break,
            InferenceEvent::Error { message, .. } => panic!("{message}"),
            _ => {}
        }
    }
    let decode_time = match (first, last) {
        (Some(a), Some(b)) => b - a,
        _ => Duration::ZERO,
    };
    Run {
        decode_tokens: ids.len().saturating_sub(1),
        ids,
        decode_time,
        decode_cpu: cpu_last.saturating_sub(cpu_first),
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Per prompt and mode: decode rates per round; speculative: drafts and acceptance totals.
#[derive(Default)]
struct Stats {
    plain: Vec<(usize, Duration)>,
    spec: Vec<(usize, Duration)>,
    /// Decode tokens and CPU time per run.
    plain_cpu: Vec<(usize, Duration)>,
    spec_cpu: Vec<(usize, Duration)>,
    /// Every run's output, plain and speculative.
    outputs: Vec<Vec<u32>>,
    drafted: u64,
    accepted: u64,
    generated: u64,
    sampled_steps: u64,
}

fn rate((n, t): (usize, Duration)) -> f64 {
    n as f64 / t.as_secs_f64().max(1e-9)
}

fn main() {
    let threads = env_usize("ZEROLAYER_BENCH_THREADS").unwrap_or(2);
    let rounds = env_usize("ZEROLAYER_BENCH_ROUNDS").unwrap_or(3).max(1);
    let mut lookup = NgramLookup::default();
    if let Some(k) = env_usize("ZEROLAYER_BENCH_MAX_DRAFT") {
        lookup = lookup.with_max_draft(k);
    }
    if let (Some(min), Some(max)) = (
        env_usize("ZEROLAYER_BENCH_MIN_NGRAM"),
        env_usize("ZEROLAYER_BENCH_MAX_NGRAM"),
    ) {
        lookup = lookup.with_ngram(min, max);
    }
    let max_batch = env_usize("ZEROLAYER_BENCH_MAX_BATCH");
    if let Some(b) = max_batch {
        lookup = lookup.with_max_batch(b);
    }
    let env_f32 = |name: &str| -> Option<f32> { std::env::var(name).ok()?.parse().ok() };
    let p_min = env_f32("ZEROLAYER_BENCH_P_MIN");
    if let Some(p) = p_min {
        lookup = lookup.with_min_probability(p);
    }
    let path = std::env::var_os("ZEROLAYER_BENCH_MODEL").map_or_else(
        || weight_cache::locate_default_model().expect("scripts/fetch-model first"),
        std::path::PathBuf::from,
    );
    let load = |path: &std::path::Path| {
        // SAFETY: the model files are not modified while the bench runs.
        let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }.expect("open model"));
        let tok = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
        let model = Model::load(gguf, ModelOptions::default().with_threads(threads));
        (Arc::new(model.expect("load model")), tok)
    };
    let (model, tok) = load(&path);
    let prompts = prompts(&tok);
    if let Some(dir) = std::env::var_os("ZEROLAYER_BENCH_PROMPTS_OUT") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).expect("prompt directory");
        for p in &prompts {
            let text = tok.decode_bytes(&p.ids).expect("decode");
            std::fs::write(dir.join(format!("{}.txt", p.name)), text).expect("write prompt");
            std::fs::write(
                dir.join(format!("{}.max", p.name)),
                p.max_tokens.to_string(),
            )
            .expect("write limit");
        }
    }
    let speculation = match std::env::var_os("ZEROLAYER_BENCH_DRAFT") {
        Some(d) => {
            let mut draft =
                DraftModel::new(load(std::path::Path::new(&d)).0).with_max_draft(lookup.max_draft);
            if let Some(r) = env_f32("ZEROLAYER_BENCH_MIN_ACCEPTANCE") {
                draft = draft.with_min_acceptance(r);
            }
            if let Some(p) = p_min {
                draft = draft.with_min_probability(p);
            }
            if let Some(b) = max_batch {
                draft = draft.with_max_batch(b);
            }
            if std::env::var("ZEROLAYER_BENCH_DRAFT_LOOKUP").is_ok_and(|v| v == "0") {
                draft = draft.with_lookup_first(None);
            }
            Speculation::DraftModel(draft)
        }
        None => Speculation::NgramLookup(lookup),
    };
    let cfg = EngineConfig::default().with_prefix_cache_entries(0);
    let plain = Engine::new(model.clone(), Some(tok.clone()), cfg.clone()).expect("engine");
    println!(
        "speculation bench: {} | {threads} threads | {} | {rounds} rounds | {speculation:?}",
        cpu_model(),
        path.display()
    );
    let spec = Engine::new(model, Some(tok), cfg.with_speculation(speculation)).expect("engine");
    // Warm-up (page cache, scratch buffers).
    run(&plain, &prompts[0]);
    run(&spec, &prompts[0]);

    let mut stats: Vec<Stats> = prompts.iter().map(|_| Stats::default()).collect();
    // Each prompt's two runs back to back (a shared machine's load drifts), the first mode
    // alternating between prompts and rounds.
    for round in 0..rounds {
        for (i, (p, st)) in prompts.iter().zip(&mut stats).enumerate() {
            let order = if (round + i) % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for spec_on in order {
                if spec_on {
                    let before = spec.metrics();
                    let r = run(&spec, p);
                    let after = spec.metrics();
                    st.drafted += after.draft_tokens - before.draft_tokens;
                    st.accepted += after.accepted_draft_tokens - before.accepted_draft_tokens;
                    st.generated += after.generated_tokens - before.generated_tokens;
                    st.sampled_steps += after.sampled_steps - before.sampled_steps;
                    st.spec.push((r.decode_tokens, r.decode_time));
                    st.spec_cpu.push((r.decode_tokens, r.decode_cpu));
                    st.outputs.push(r.ids);
                } else {
                    let r = run(&plain, p);
                    st.plain.push((r.decode_tokens, r.decode_time));
                    st.plain_cpu.push((r.decode_tokens, r.decode_cpu));
                    st.outputs.push(r.ids);
                }
            }
        }
    }

    println!(
        "{:<16} {:<10} {:>6} {:>11} {:>11} {:>7} {:>7} {:>7} {:>8} {:>7} {:>9} {:>9}",
        "prompt",
        "kind",
        "tokens",
        "plain tok/s",
        "spec tok/s",
        "ratio",
        "paired",
        "cpu",
        "accept",
        "drafts",
        "tok/step",
        "identical"
    );
    for (p, st) in prompts.iter().zip(&stats) {
        let plain = median(st.plain.iter().copied().map(rate).collect());
        let specr = median(st.spec.iter().copied().map(rate).collect());
        // The median of the back-to-back pairs' ratios.
        let paired = median(
            st.plain
                .iter()
                .zip(&st.spec)
                .map(|(&a, &b)| rate(b) / rate(a))
                .collect(),
        );
        println!(
            "{:<16} {:<10} {:>6} {:>11.1} {:>11.1} {:>6.2}x {:>6.2}x {:>6.2}x {:>8.2} {:>7} {:>9.2} {:>9}",
            p.name,
            p.kind,
            st.plain.first().map_or(0, |r| r.0 + 1),
            plain,
            specr,
            specr / plain,
            paired,
            median(st.spec_cpu.iter().copied().map(rate).collect())
                / median(st.plain_cpu.iter().copied().map(rate).collect()),
            st.accepted as f64 / st.drafted.max(1) as f64,
            st.drafted / rounds as u64,
            st.generated as f64 / st.sampled_steps.max(1) as f64,
            identical(st)
        );
    }
    if let Some(dir) = std::env::var_os("ZEROLAYER_BENCH_TOKENS_OUT") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).expect("token directory");
        for (p, st) in prompts.iter().zip(&stats) {
            let line = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
            let out = st.outputs.first().map_or(String::new(), |o| line(o));
            let text = format!("{} {}\n{}\n{}\n", p.name, p.kind, line(&p.ids), out);
            std::fs::write(dir.join(format!("{}.tokens", p.name)), text).expect("write tokens");
        }
    }
    let mut kinds: Vec<&str> = prompts.iter().map(|p| p.kind.as_str()).collect();
    kinds.dedup();
    for kind in kinds {
        let of_kind = || {
            prompts
                .iter()
                .zip(&stats)
                .filter(move |(p, _)| p.kind == kind)
        };
        // Per round: all the kind's decode tokens over all its decode time.
        let per_round = |pick: &dyn Fn(&Stats) -> &Vec<(usize, Duration)>| -> Vec<f64> {
            (0..rounds)
                .map(|r| {
                    let (n, t) = of_kind().fold((0, Duration::ZERO), |(n, t), (_, st)| {
                        (n + pick(st)[r].0, t + pick(st)[r].1)
                    });
                    rate((n, t))
                })
                .collect()
        };
        let plain_rounds = per_round(&|s| &s.plain);
        let spec_rounds = per_round(&|s| &s.spec);
        let cpu_ratio = median(per_round(&|s| &s.spec_cpu)) / median(per_round(&|s| &s.plain_cpu));
        let (plain, specr) = (median(plain_rounds.clone()), median(spec_rounds.clone()));
        let paired = median(
            plain_rounds
                .iter()
                .zip(&spec_rounds)
                .map(|(a, b)| b / a)
                .collect(),
        );
        let (drafted, accepted) =
            of_kind().fold((0, 0), |(d, a), (_, st)| (d + st.drafted, a + st.accepted));
        let (generated, steps) = of_kind().fold((0, 0), |(g, s), (_, st)| {
            (g + st.generated, s + st.sampled_steps)
        });
        println!(
            "{kind:<10} plain {plain:.1} tok/s (rounds {plain_rounds:.1?}), speculative {specr:.1} tok/s \
             (rounds {spec_rounds:.1?}): {:.2}x (median of the rounds' ratios {paired:.2}x), \
             acceptance {:.2}, {:.2} tokens per target step, identical {}; per CPU-second of \
             the process {cpu_ratio:.2}x",
            specr / plain,
            accepted as f64 / drafted.max(1) as f64,
            generated as f64 / steps.max(1) as f64,
            of_kind().all(|(_, st)| identical(st))
        );
    }
    // Batched: all prompts of a kind at once (up to NgramLookup::max_batch of them draft),
    // generated tokens over the wall time from submitting to the last end, prefill included.
    let mut kinds: Vec<&str> = prompts.iter().map(|p| p.kind.as_str()).collect();
    kinds.dedup();
    for kind in kinds {
        let of_kind: Vec<&Prompt> = prompts.iter().filter(|p| p.kind == kind).collect();
        let (mut plain_rates, mut spec_rates) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for spec_on in order {
                let e = if spec_on { &spec } else { &plain };
                let t0 = Instant::now();
                let handles: Vec<_> = of_kind
                    .iter()
                    .map(|p| {
                        e.submit(GenerationRequest::new(p.ids.clone(), p.max_tokens))
                            .expect("submit")
                    })
                    .collect();
                let mut tokens = 0usize;
                for h in &handles {
                    while let Some(ev) = h.recv() {
                        match ev {
                            InferenceEvent::Delta { ids, .. } => tokens += ids.len(),
                            InferenceEvent::Finished { .. } => break,
                            InferenceEvent::Error { message, .. } => panic!("{message}"),
                            _ => {}
                        }
                    }
                }
                let r = rate((tokens, t0.elapsed()));
                if spec_on {
                    spec_rates.push(r);
                } else {
                    plain_rates.push(r);
                }
            }
        }
        let paired = median(
            plain_rates
                .iter()
                .zip(&spec_rates)
                .map(|(a, b)| b / a)
                .collect(),
        );
        println!(
            "{kind:<10} batched ({} at once): plain {:.1} tok/s, speculative {:.1} tok/s: {:.2}x (median of the rounds' ratios {paired:.2}x)",
            of_kind.len(),
            median(plain_rates.clone()),
            median(spec_rates.clone()),
            median(spec_rates) / median(plain_rates),
        );
    }
}

/// Whether every run of a prompt, plain or speculative, generated the same tokens.
fn identical(st: &Stats) -> bool {
    st.outputs.windows(2).all(|w| w[0] == w[1])
}
