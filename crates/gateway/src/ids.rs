//! Request, message and completion ids.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh id such as `req_01a3…` (24 hex digits after the prefix), unique within the process and
/// unpredictable across processes (SipHash of a counter under a random per-process key).
pub(crate) fn new_id(prefix: &str) -> String {
    static KEYS: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let keys = KEYS.get_or_init(Default::default);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h1 = keys.build_hasher();
    h1.write_u64(n);
    let a = h1.finish();
    let mut h2 = keys.build_hasher();
    h2.write_u64(!n);
    let b = h2.finish();
    format!("{prefix}{a:016x}{:08x}", b >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_prefixed() {
        let a = new_id("req_");
        let b = new_id("req_");
        assert_ne!(a, b);
        assert!(a.starts_with("req_"));
        assert_eq!(a.len(), 4 + 24);
    }
}
