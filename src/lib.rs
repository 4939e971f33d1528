//! zerolayer: serve LLMs with almost nothing between the request and the matrix math.
//!
//! This root package re-exports the workspace's crates and composes them; each crate can also be
//! used on its own.

mod load;
mod prompt;
mod service;

pub use load::{ExecutorChoice, chat_template, executor, load_model};
pub use service::{EngineService, LoadServiceError};

pub use claudelink_proto;
pub use gpu_pipeline;
pub use kv_ring;
pub use token_stream;
pub use weight_cache;
pub use zerolayer_api;
pub use zerolayer_gateway;

/// Parses a byte size for command lines: `512`, `64K`, `512M`, `2G`, `1T` (binary units).
///
/// ```
/// assert_eq!(zerolayer::parse_byte_size("512M"), Ok(512 << 20));
/// assert_eq!(zerolayer::parse_byte_size("4096"), Ok(4096));
/// assert!(zerolayer::parse_byte_size("3X").is_err());
/// ```
pub fn parse_byte_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("unknown unit `{c}` in `{s}` (use K, M, G or T)")),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    let n: u64 = num.trim().parse().map_err(|e| format!("`{s}`: {e}"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` is too large"))
}
