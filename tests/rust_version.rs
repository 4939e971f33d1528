//! The workspace's `rust-version` is what the sources need, derived from the language and
//! library features they use that are newer than the edition:
//!
//! | feature | stable since | found by |
//! |---|---|---|
//! | edition 2024 | 1.85 | `edition = "2024"` |
//! | `#[target_feature]` on a safe `fn` | 1.86 | the attribute before a `fn` without `unsafe` |
//! | let chains (`if a && let Some(x) = b`) | 1.88 | `&& let` |
//! | AVX-512 intrinsics and target features | 1.89 | `_mm512_` or `enable = "avx512` |
//!
//! Clippy's `incompatible_msrv` lint (on by default; CI runs clippy with `-D warnings`) reads the
//! same field and warns on standard-library items newer than it where it sees them: in a probe
//! crate it flagged `u32::is_multiple_of` (1.87) and `_mm512_*` (1.89) under rust-version 1.86,
//! but on this workspace at 1.86 it flagged nothing (gpu-pipeline's intrinsics included), so this
//! scan is the check that holds. Every member takes `rust-version` from the workspace (checked
//! here too).

use std::path::{Path, PathBuf};

/// A feature, the release that stabilized it and a detector over one source file's lines.
struct Feature {
    name: &'static str,
    since: (u32, u32),
    found_in: fn(&[&str]) -> Option<usize>,
}

/// `#[target_feature(...)]` on a function that is not `unsafe` (other attributes, comments and
/// blank lines may come between).
fn safe_target_feature(lines: &[&str]) -> Option<usize> {
    for (i, line) in lines.iter().enumerate() {
        if !line.trim_start().starts_with("#[target_feature(") {
            continue;
        }
        let item = lines[i + 1..]
            .iter()
            .map(|l| l.trim())
            .find(|l| !(l.is_empty() || l.starts_with("#[") || l.starts_with("//")));
        if let Some(item) = item {
            let words: Vec<&str> = item.split_whitespace().collect();
            let fn_at = words.iter().position(|w| *w == "fn");
            if fn_at.is_some_and(|at| !words[..at].contains(&"unsafe")) {
                return Some(i + 1);
            }
        }
    }
    None
}

fn let_chain(lines: &[&str]) -> Option<usize> {
    lines
        .iter()
        .position(|l| {
            let code = l.split("//").next().unwrap_or("");
            code.contains("&& let ") || code.trim_start().starts_with("&& let ")
        })
        .map(|i| i + 1)
}

fn avx512(lines: &[&str]) -> Option<usize> {
    lines
        .iter()
        .position(|l| {
            let code = l.split("//").next().unwrap_or("");
            code.contains("_mm512_") || code.contains("enable = \"avx512")
        })
        .map(|i| i + 1)
}

const FEATURES: &[Feature] = &[
    Feature {
        name: "#[target_feature] on a safe fn",
        since: (1, 86),
        found_in: safe_target_feature,
    },
    Feature {
        name: "let chains",
        since: (1, 88),
        found_in: let_chain,
    },
    Feature {
        name: "AVX-512 intrinsics",
        since: (1, 89),
        found_in: avx512,
    },
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `.rs` file of the published packages (the fuzz crate is not one).
fn sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for top in ["src", "tests", "examples", "benches"] {
        rust_files(&root().join(top), &mut files);
    }
    for member in std::fs::read_dir(root().join("crates")).unwrap().flatten() {
        rust_files(&member.path(), &mut files);
    }
    assert!(files.len() > 50, "found only {} files", files.len());
    files
}

fn workspace_rust_version() -> (u32, u32) {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.starts_with("rust-version = "))
        .expect("[workspace.package] rust-version");
    let v = line.split('"').nth(1).unwrap();
    let mut parts = v.split('.').map(|n| n.parse::<u32>().unwrap());
    (parts.next().unwrap(), parts.next().unwrap())
}

#[test]
fn rust_version_is_the_newest_feature_the_sources_use() {
    let mut needed = ((1, 85), "edition 2024".to_owned());
    let mut evidence = Vec::new();
    for file in sources() {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for f in FEATURES {
            if let Some(line) = (f.found_in)(&lines) {
                let at = format!("{}:{line}", file.strip_prefix(root()).unwrap().display());
                evidence.push(format!("{} (1.{}): {at}", f.name, f.since.1));
                if f.since > needed.0 {
                    needed = (f.since, format!("{} at {at}", f.name));
                }
            }
        }
    }
    let declared = workspace_rust_version();
    assert_eq!(
        declared,
        needed.0,
        "rust-version is {declared:?}, the sources need {:?} ({}); found:\n{}",
        needed.0,
        needed.1,
        evidence.join("\n")
    );
}

#[test]
fn every_member_takes_the_workspace_rust_version_and_edition() {
    for member in std::fs::read_dir(root().join("crates")).unwrap().flatten() {
        let manifest = std::fs::read_to_string(member.path().join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains("rust-version.workspace = true"),
            "{:?}",
            member.path()
        );
        assert!(
            manifest.contains("edition.workspace = true"),
            "{:?}",
            member.path()
        );
    }
    let root_manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    assert!(root_manifest.contains("edition = \"2024\""));
}

#[test]
fn the_detectors_tell_the_features_apart() {
    let safe = [
        "#[target_feature(enable = \"avx2\")]",
        "#[inline]",
        "pub(crate) fn f() {}",
    ];
    let not_safe = [
        "#[target_feature(enable = \"avx2\")]",
        "pub unsafe fn f() {}",
    ];
    assert_eq!(safe_target_feature(&safe), Some(1));
    assert_eq!(safe_target_feature(&not_safe), None);
    assert_eq!(let_chain(&["if a", "    && let Some(x) = b"]), Some(2));
    assert_eq!(
        let_chain(&["if let Some(d) = x.filter(|d| d > 0 && y) {"]),
        None
    );
    assert_eq!(avx512(&["let v = _mm512_set1_ps(1.0);"]), Some(1));
    assert_eq!(avx512(&["// _mm512_set1_ps in a comment"]), None);
}
