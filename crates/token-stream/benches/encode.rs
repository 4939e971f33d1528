//! Single-threaded encode throughput of token-stream against HF `tokenizers` (SmolLM2),
//! `tiktoken-rs` and `bpe-openai` (cl100k_base, o200k_base) on the same corpus, with ratios;
//! plus decode throughput, batch-encode scaling and a 42-token chat prompt. Each row runs
//! token-stream and its peer one pass each in turn, five times, and reports the median of the
//! per-pass ratios, so that a busy machine slows both sides of a ratio alike.
//!
//! Corpus: `scripts/make-tokenizer-corpus bench` (kernel docs as prose, kernel/ + mm/ C as code,
//! Chinese docs + fortunes-zh), found in `$ZEROLAYER_CORPUS` or `~/.cache/zerolayer/corpus`;
//! without it the committed parity corpus is used (and a message says so).
//! `ZEROLAYER_BENCH_MB` (default 2) sets how many MB of each corpus part one pass encodes.
//!
//! SPM rows: the `llama-spm` vocabulary of llama.cpp's suite (`scripts/fetch-vocab-suite`)
//! against HF `tokenizers` loading the same vocabulary as HF's Llama `tokenizer.json` does (BPE
//! with byte fallback, merges derived from the scores, `▁` normalizer), after checking that both
//! give the same ids on the corpus. `ZEROLAYER_BENCH_ONLY=spm` stops after the SPM rows
//! (`scripts/bench-tokenizers-llamacpp` uses that to compare with llama.cpp).
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use token_stream::{ChatTemplate, TemplateMessage, Tokenizer, base64_encode};

fn corpus() -> Vec<(String, Vec<String>)> {
    let dir = std::env::var_os("ZEROLAYER_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/zerolayer/corpus")
        });
    let mb: f64 = std::env::var("ZEROLAYER_BENCH_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let limit = (mb * 1e6) as usize;
    let mut parts = Vec::new();
    for name in ["prose", "code", "zh"] {
        if let Ok(text) = std::fs::read_to_string(dir.join(format!("{name}.txt"))) {
            // Documents of up to ~4 KB cut at line ends, like requests a server would see.
            let mut docs = Vec::new();
            let mut cur = String::new();
            let mut total = 0;
            for line in text.split_inclusive('\n') {
                cur.push_str(line);
                if cur.len() >= 4096 {
                    total += cur.len();
                    docs.push(std::mem::take(&mut cur));
                    if total >= limit {
                        break;
                    }
                }
            }
            if !cur.is_empty() && total < limit {
                docs.push(cur);
            }
            parts.push((name.to_owned(), docs));
        }
    }
    if parts.is_empty() {
        eprintln!(
            "NOTE: no bench corpus in {} (run scripts/make-tokenizer-corpus bench); using the small committed parity corpus",
            dir.display()
        );
        let docs = include_str!("../tests/fixtures/parity.jsonl")
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["text"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        parts.push(("parity".to_owned(), docs));
    }
    parts
}

fn smollm() -> (Tokenizer, tokenizers::Tokenizer) {
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: nothing modifies the model file during the bench.
    let g = unsafe { weight_cache::Gguf::open(&path) }.unwrap();
    let ours = Tokenizer::from_gguf(&g).unwrap();
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    let merges = g.get_str_array("tokenizer.ggml.merges").unwrap();
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence};
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_owned(), i as u32))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').unwrap();
            (a.to_owned(), b.to_owned())
        })
        .collect();
    let mut hf = tokenizers::Tokenizer::new(
        BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .unwrap(),
    );
    hf.with_pre_tokenizer(Some(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    hf.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<_> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i] == 3)
        .map(|(_, s)| tokenizers::AddedToken::from(*s, true))
        .collect();
    hf.add_special_tokens(&specials);
    (ours, hf)
}

/// llama.cpp's `llama-spm` vocabulary (ours) and the same vocabulary as an HF Llama-style
/// `tokenizer.json` (BPE, byte fallback, merges from the scores).
fn llama_spm() -> Option<(Tokenizer, tokenizers::Tokenizer)> {
    let dir = std::env::var_os("ZEROLAYER_VOCAB_SUITE").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/zerolayer/llama-vocab-suite-0.3.36")
        },
        PathBuf::from,
    );
    let path = dir.join("ggml-vocab-llama-spm.gguf");
    if !path.exists() {
        eprintln!(
            "NOTE: no {} (run scripts/fetch-vocab-suite); no SPM rows",
            path.display()
        );
        return None;
    }
    // SAFETY: nothing modifies the vocabulary file during the bench.
    let g = unsafe { weight_cache::Gguf::open(&path) }.unwrap();
    let ours = Tokenizer::from_gguf(&g).unwrap();
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    let scores = g.get_f32_array("tokenizer.ggml.scores").unwrap();
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    let ids: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    // Merges as HF's SentencePiece converter derives them: every split of a normal token into
    // two tokens, ordered by the merged token's score (highest first).
    let mut merges = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if types[id] != 1 {
            continue;
        }
        for (k, _) in t.char_indices().skip(1) {
            if let (Some(&a), Some(&b)) = (ids.get(&t[..k]), ids.get(&t[k..])) {
                merges.push((scores[id], id, a, b));
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then((x.2, x.3).cmp(&(y.2, y.3))));
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_owned(), i.into()))
        .collect();
    let added: Vec<_> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i] == 2 || types[*i] == 3)
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]},
        "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges.iter().map(|m| [tokens[m.2], tokens[m.3]]).collect::<Vec<_>>()},
    });
    let hf: tokenizers::Tokenizer = json.to_string().parse().unwrap();
    Some((ours, hf))
}

fn openai(bpe: &bpe_openai::Tokenizer, o200k: bool) -> Tokenizer {
    let mut s = String::new();
    for id in 0..bpe.bpe.num_tokens() {
        s += &format!("{} {id}\n", base64_encode(bpe.bpe.token_bytes(id as u32)));
    }
    if o200k {
        Tokenizer::o200k_base(&s).unwrap()
    } else {
        Tokenizer::cl100k_base(&s).unwrap()
    }
}

/// Median MB/s of `runs` passes of `f` over `docs`.
fn mbps(docs: &[String], runs: usize, mut f: impl FnMut(&str) -> usize) -> f64 {
    let bytes: usize = docs.iter().map(String::len).sum();
    let mut rates: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            let mut n = 0;
            for d in docs {
                n += f(d);
            }
            black_box(n);
            bytes as f64 / t.elapsed().as_secs_f64() / 1e6
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[runs / 2]
}

/// `ours` and `peer` over `docs`, one pass of each in turn, `runs` times (so both see the same
/// machine load): the median MB/s of each and the median of the per-pass ratios.
fn interleaved(
    docs: &[String],
    runs: usize,
    mut ours: impl FnMut(&str) -> usize,
    mut peer: impl FnMut(&str) -> usize,
) -> (f64, f64, f64) {
    let (mut a, mut b, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let x = mbps(docs, 1, &mut ours);
        let y = mbps(docs, 1, &mut peer);
        a.push(x);
        b.push(y);
        ratios.push(x / y);
    }
    for v in [&mut a, &mut b, &mut ratios] {
        v.sort_by(f64::total_cmp);
    }
    (a[runs / 2], b[runs / 2], ratios[runs / 2])
}

/// Passes of each encoder per table row (interleaved with its peer's).
const RUNS: usize = 5;

fn bench(c: &mut Criterion) {
    let parts = corpus();
    if let Some((ours, hf)) = llama_spm() {
        println!(
            "\nSPM (llama-spm), single-threaded encode, MB/s (median of {RUNS} passes interleaved with the peer's; ratio: median of the per-pass ratios)"
        );
        println!("| corpus | MB | vocab | token-stream | peer | peer MB/s | ratio |");
        println!("|---|---|---|---|---|---|---|");
        for (name, docs) in &parts {
            let differ = docs
                .iter()
                .filter(|d| {
                    ours.encode(d).as_slice() != hf.encode(d.as_str(), false).unwrap().get_ids()
                })
                .count();
            if differ > 0 {
                println!(
                    "NOTE: {name}: {differ} of {} documents differ between token-stream and HF (SPM)",
                    docs.len()
                );
            }
            let mb = docs.iter().map(String::len).sum::<usize>() as f64 / 1e6;
            let (ours_mbps, peer, ratio) = interleaved(
                docs,
                RUNS,
                |d| ours.encode(d).len(),
                |d| hf.encode(d, false).unwrap().len(),
            );
            println!(
                "| {name} | {mb:.1} | llama-spm | {ours_mbps:.1} | HF tokenizers | {peer:.1} | {ratio:.1}x |"
            );
            println!("spm-token-stream-mbps {name} {ours_mbps:.2}");
        }
    }
    if std::env::var("ZEROLAYER_BENCH_ONLY").as_deref() == Ok("spm") {
        return;
    }
    let (ours_smol, hf) = smollm();
    let ours_cl = openai(bpe_openai::cl100k_base(), false);
    let ours_o2 = openai(bpe_openai::o200k_base(), true);
    let tt_cl = tiktoken_rs::cl100k_base().unwrap();
    let tt_o2 = tiktoken_rs::o200k_base().unwrap();
    let (bo_cl, bo_o2) = (bpe_openai::cl100k_base(), bpe_openai::o200k_base());

    println!(
        "\nsingle-threaded encode, MB/s (median of {RUNS} passes interleaved with the peer's; ratio: median of the per-pass token-stream / peer ratios)"
    );
    println!("| corpus | MB | vocab | token-stream | peer | peer MB/s | ratio |");
    println!("|---|---|---|---|---|---|---|");
    for (name, docs) in &parts {
        let mb = docs.iter().map(String::len).sum::<usize>() as f64 / 1e6;
        let (ours, peer, ratio) = interleaved(
            docs,
            RUNS,
            |d| ours_smol.encode(d).len(),
            |d| hf.encode(d, false).unwrap().len(),
        );
        println!(
            "| {name} | {mb:.1} | SmolLM2 | {ours:.1} | HF tokenizers | {peer:.1} | {ratio:.1}x |"
        );
        for (vocab, o, tt, bo) in [
            ("cl100k", &ours_cl, &tt_cl, bo_cl),
            ("o200k", &ours_o2, &tt_o2, bo_o2),
        ] {
            let (ours, peer, ratio) = interleaved(
                docs,
                RUNS,
                |d| o.encode(d).len(),
                |d| tt.encode_ordinary(d).len(),
            );
            println!(
                "| {name} | {mb:.1} | {vocab} | {ours:.1} | tiktoken-rs | {peer:.1} | {ratio:.1}x |"
            );
            let (ours, peer, ratio) =
                interleaved(docs, RUNS, |d| o.encode(d).len(), |d| bo.encode(d).len());
            println!(
                "| {name} | {mb:.1} | {vocab} | {ours:.1} | bpe-openai | {peer:.1} | {ratio:.2}x |"
            );
        }
    }

    // The backtracking encoder against the merge loop it replaces for long pieces, passes
    // interleaved (one of each, five times), so the ratio holds up on a busy machine.
    println!("\nbacktracking vs merging every piece, MB/s (median of 5 interleaved passes)");
    println!("| corpus | vocab | backtracking | merging only | ratio |");
    println!("|---|---|---|---|---|");
    for (name, docs) in &parts {
        for (vocab, t) in [
            ("SmolLM2", &ours_smol),
            ("cl100k", &ours_cl),
            ("o200k", &ours_o2),
        ] {
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            for _ in 0..5 {
                fast.push(mbps(docs, 1, |d| t.encode(d).len()));
                slow.push(mbps(docs, 1, |d| t.encode_merging_only(d).len()));
            }
            fast.sort_by(f64::total_cmp);
            slow.sort_by(f64::total_cmp);
            println!(
                "| {name} | {vocab} | {:.1} | {:.1} | {:.2}x |",
                fast[2],
                slow[2],
                fast[2] / slow[2]
            );
        }
    }

    // Decode throughput (output bytes per second).
    let all: Vec<String> = parts.iter().flat_map(|(_, d)| d.iter().cloned()).collect();
    let ids: Vec<Vec<u32>> = all.iter().map(|d| ours_smol.encode(d).into_vec()).collect();
    let out_bytes: usize = all.iter().map(String::len).sum();
    let mut buf = Vec::with_capacity(out_bytes * 2);
    let t = Instant::now();
    for _ in 0..5 {
        for i in &ids {
            buf.clear();
            ours_smol.decode_bytes_into(i, &mut buf).unwrap();
            black_box(&buf);
        }
    }
    println!(
        "\ndecode (SmolLM2): {:.2} GB/s",
        5.0 * out_bytes as f64 / t.elapsed().as_secs_f64() / 1e9
    );

    // Batch encode scaling.
    for threads in [1, 2, 4] {
        let t = Instant::now();
        black_box(ours_smol.encode_batch(&all, threads));
        println!(
            "encode_batch SmolLM2, {threads} thread(s): {:.1} MB/s",
            out_bytes as f64 / t.elapsed().as_secs_f64() / 1e6
        );
    }

    // Chat prompt.
    let tmpl = ChatTemplate::from_tokenizer(&ours_smol).unwrap();
    let msgs = [TemplateMessage::new(
        "user",
        "What is the capital of France? Answer in one word.",
    )];
    let rendered = tmpl.render(&msgs, true).unwrap();
    let n = ours_smol.encode_with_specials(&rendered).len();
    println!("chat prompt: {n} tokens");

    let mut g = c.benchmark_group("encode");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    let docs = &parts[0].1;
    g.throughput(Throughput::Bytes(
        docs.iter().map(String::len).sum::<usize>() as u64,
    ));
    g.bench_function("token-stream/smollm2", |b| {
        b.iter(|| {
            docs.iter()
                .map(|d| ours_smol.encode(d).len())
                .sum::<usize>()
        })
    });
    g.bench_function("token-stream/cl100k", |b| {
        b.iter(|| docs.iter().map(|d| ours_cl.encode(d).len()).sum::<usize>())
    });
    g.bench_function("bpe-openai/cl100k", |b| {
        b.iter(|| docs.iter().map(|d| bo_cl.encode(d).len()).sum::<usize>())
    });
    g.finish();
    let mut g = c.benchmark_group("chat");
    g.bench_function(format!("encode_with_specials/{n}-token prompt"), |b| {
        b.iter(|| ours_smol.encode_with_specials(black_box(&rendered)))
    });
    g.bench_function("template render+encode", |b| {
        b.iter(|| tmpl.encode(&ours_smol, black_box(&msgs), true).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
