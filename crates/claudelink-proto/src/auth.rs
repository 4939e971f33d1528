//! API keys: constant-time checks shared by the claudelink server and the HTTP gateway, and the
//! stable, non-secret labels that name a key in requests, limits and metrics.

use sha2::{Digest, Sha256};

/// A stable label for an API key, safe to log and to pass to the engine: `key-` and 12 hex
/// digits of a domain-separated SHA-256 of the key (not of its digest used for checking).
///
/// ```
/// let a = claudelink_proto::key_label("sk-local-1");
/// assert!(a.starts_with("key-") && a.len() == 16);
/// assert_eq!(a, claudelink_proto::key_label("sk-local-1"));
/// assert_ne!(a, claudelink_proto::key_label("sk-local-2"));
/// ```
pub fn key_label(key: &str) -> String {
    let d = Sha256::new()
        .chain_update(b"zerolayer key label\0")
        .chain_update(key.as_bytes())
        .finalize();
    let mut s = String::with_capacity(16);
    s.push_str("key-");
    for b in &d[..6] {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The accepted API keys, kept as SHA-256 digests; a presented key is hashed and compared with
/// every digest in constant time, so neither the key bytes nor its length leak through timing.
///
/// ```
/// use claudelink_proto::ApiKeys;
/// let keys = ApiKeys::new(["alpha".to_string(), "beta".to_string()]);
/// assert_eq!(keys.find(b"beta"), Some(1));
/// assert_eq!(keys.find(b"gamma"), None);
/// assert_eq!(keys.label(1), claudelink_proto::key_label("beta"));
/// assert!(ApiKeys::default().is_empty());
/// ```
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
    labels: Vec<String>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys")
            .field("labels", &self.labels)
            .finish()
    }
}

impl ApiKeys {
    /// The key list; empty strings are dropped (an empty key would accept an empty credential).
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        let keys: Vec<String> = keys.into_iter().filter(|k| !k.is_empty()).collect();
        Self {
            digests: keys
                .iter()
                .map(|k| Sha256::digest(k.as_bytes()).into())
                .collect(),
            labels: keys.iter().map(|k| key_label(k)).collect(),
        }
    }

    /// Whether no key is configured (an open server).
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// The label of key `i` (see [`key_label`]).
    ///
    /// # Panics
    /// When `i >= self.len()`.
    pub fn label(&self, i: usize) -> &str {
        &self.labels[i]
    }

    /// Index of the key equal to `presented`, checking every key without early exit.
    pub fn find(&self, presented: &[u8]) -> Option<usize> {
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
    fn keys_match_exactly() {
        let ks = ApiKeys::new(["alpha".into(), "beta".into(), String::new()]);
        assert_eq!(ks.len(), 2);
        assert_eq!(ks.find(b"alpha"), Some(0));
        assert_eq!(ks.find(b"beta"), Some(1));
        assert_eq!(ks.find(b"alph"), None);
        assert_eq!(ks.find(b"alphaa"), None);
        assert_eq!(ks.find(b""), None);
        assert!(ApiKeys::new([]).find(b"x").is_none());
    }

    #[test]
    fn labels_do_not_reveal_the_checking_digest() {
        let ks = ApiKeys::new(["alpha".into()]);
        let digest: [u8; 32] = Sha256::digest(b"alpha").into();
        let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
        assert_ne!(ks.label(0), format!("key-{hex}"));
        assert_eq!(ks.label(0), key_label("alpha"));
    }
}
