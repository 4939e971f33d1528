//! Request, message and completion ids, and constant-time API-key checks.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

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

/// SHA-256 digests of the configured keys; a presented key is hashed and compared with every
/// digest in constant time, so neither the key bytes nor its length leak through timing.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeySet {
    digests: Vec<[u8; 32]>,
}

impl KeySet {
    pub(crate) fn new(keys: &[String]) -> Self {
        Self {
            digests: keys
                .iter()
                .map(|k| Sha256::digest(k.as_bytes()).into())
                .collect(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.digests.len()
    }

    /// Index of the matching key, checking every key without early exit.
    pub(crate) fn find(&self, presented: &[u8]) -> Option<usize> {
        let d: [u8; 32] = Sha256::digest(presented).into();
        let mut found = usize::MAX;
        for (i, k) in self.digests.iter().enumerate() {
            let diff = k.iter().zip(&d).fold(0u8, |acc, (a, b)| acc | (a ^ b));
            // Branch-free select: mask is all ones when diff == 0.
            let mask = (u64::from(std::hint::black_box(diff)) as usize).wrapping_sub(1) >> 8;
            let is_match = 0usize.wrapping_sub(mask & 1);
            found = (found & !is_match) | (i & is_match);
        }
        (found != usize::MAX).then_some(found)
    }
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

    #[test]
    fn keys_match_exactly() {
        let ks = KeySet::new(&["alpha".into(), "beta".into()]);
        assert_eq!(ks.find(b"alpha"), Some(0));
        assert_eq!(ks.find(b"beta"), Some(1));
        assert_eq!(ks.find(b"alph"), None);
        assert_eq!(ks.find(b"alphaa"), None);
        assert_eq!(ks.find(b""), None);
        assert!(KeySet::new(&[]).find(b"x").is_none());
    }
}
