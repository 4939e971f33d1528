//! A small LRU cache of prompt KV, for prefix reuse (shared system prompts).
//!
//! Entries hold a ring with exactly one prompt's KV. A lookup finds the entry with the longest
//! common token prefix (a linear scan: the cache holds a few entries), so requests sharing a
//! system prompt but not the user turn still reuse the shared part.
//!
//! Every entry belongs to a partition (the engine's: one per client, i.e. per API key, unless
//! the operator shares one deliberately), and a lookup only sees its own partition's entries.
//! A reused prefix is seen from outside as a much shorter time to first token, so a cache
//! shared between tenants would tell one tenant whether another sent a prompt it guessed.
//! Capacity and eviction stay global (least recently used first, whatever the partition): an
//! eviction tells a tenant that someone sent something, never what.

use kv_ring::{HostKv, KvRing, KvStorage};

pub(crate) struct PrefixCache<S: KvStorage = HostKv> {
    entries: Vec<Entry<S>>,
    max_entries: usize,
    min_tokens: usize,
    clock: u64,
}

/// A trust domain of the cache: lookups never cross partitions.
pub(crate) type Partition = u64;

struct Entry<S: KvStorage> {
    partition: Partition,
    tokens: Vec<u32>,
    ring: KvRing<S>,
    last_used: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<S: KvStorage> PrefixCache<S> {
    pub(crate) fn new(max_entries: usize, min_tokens: usize) -> Self {
        Self {
            entries: Vec::new(),
            max_entries,
            min_tokens: min_tokens.max(1),
            clock: 0,
        }
    }

    pub(crate) fn is_disabled(&self) -> bool {
        self.max_entries == 0
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The entry of `partition` sharing the longest prefix with `prompt`, capped at
    /// `prompt.len() - 1` (the last prompt token must be computed for its logits); `None` below
    /// `min_tokens`.
    pub(crate) fn lookup(
        &mut self,
        partition: Partition,
        prompt: &[u32],
    ) -> Option<(&KvRing<S>, usize)> {
        let cap = prompt.len().saturating_sub(1);
        let (i, n) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.partition == partition)
            .map(|(i, e)| (i, common_prefix(&e.tokens, prompt).min(cap)))
            .max_by_key(|&(i, n)| (n, usize::MAX - i))?;
        if n < self.min_tokens {
            return None;
        }
        self.clock += 1;
        let e = &mut self.entries[i];
        e.last_used = self.clock;
        Some((&e.ring, n))
    }

    /// Whether an entry of `partition` already covers all of `prompt`.
    pub(crate) fn covers(&self, partition: Partition, prompt: &[u32]) -> bool {
        self.entries
            .iter()
            .any(|e| e.partition == partition && common_prefix(&e.tokens, prompt) == prompt.len())
    }

    /// Adds an entry to `partition` (the least recently used one of any partition goes when
    /// full). `ring` must hold exactly the KV of `tokens`.
    pub(crate) fn insert(&mut self, partition: Partition, tokens: Vec<u32>, ring: KvRing<S>) {
        if self.max_entries == 0 || tokens.len() < self.min_tokens {
            return;
        }
        // An entry of the same partition that is a prefix of the new one is superseded by it.
        self.entries.retain(|e| {
            e.partition != partition || common_prefix(&e.tokens, &tokens) < e.tokens.len()
        });
        if self.entries.len() >= self.max_entries {
            self.evict_lru();
        }
        self.clock += 1;
        self.entries.push(Entry {
            partition,
            tokens,
            ring,
            last_used: self.clock,
        });
    }

    /// Drops the least recently used entry (frees its ring). Returns whether one was dropped.
    pub(crate) fn evict_lru(&mut self) -> bool {
        let Some(i) = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| e.last_used)
            .map(|(i, _)| i)
        else {
            return false;
        };
        self.entries.swap_remove(i);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_ring::{KvDtype, KvPool, KvShape, RingMode};

    fn ring(pool: &std::sync::Arc<KvPool>, n: usize) -> KvRing {
        let mut r = pool.alloc(n, RingMode::Strict).unwrap();
        r.begin(n).unwrap();
        let per = n * 2;
        for l in 0..1 {
            r.write_layer(l, &vec![0.5; per], &vec![0.25; per]).unwrap();
        }
        r.commit().unwrap();
        r
    }

    #[test]
    fn longest_prefix_lru_and_freeing() {
        let pool = KvPool::new(KvShape::new(1, 1, 2, KvDtype::F32), 1 << 20).unwrap();
        let mut c = PrefixCache::new(2, 2);
        c.insert(0, vec![1, 2, 3, 4], ring(&pool, 4));
        c.insert(0, vec![1, 2, 9], ring(&pool, 3));
        assert_eq!(c.lookup(0, &[1, 2, 3, 4, 5]).map(|(_, n)| n), Some(4));
        assert_eq!(c.lookup(0, &[1, 2, 3, 4]).map(|(_, n)| n), Some(3)); // last token recomputed
        assert_eq!(c.lookup(0, &[1, 7]).map(|(_, n)| n), None); // below min_tokens
        assert!(c.covers(0, &[1, 2]));
        assert!(!c.covers(0, &[1, 2, 3, 4, 5]));
        // [1,2,9] is least recently used: a third entry evicts it.
        c.insert(0, vec![5, 6], ring(&pool, 2));
        assert_eq!(c.len(), 2);
        assert_eq!(c.lookup(0, &[1, 2, 9, 9]).map(|(_, n)| n), Some(2));
        let used = pool.used_bytes();
        assert!(c.evict_lru());
        assert!(pool.used_bytes() < used);
        // A longer prompt supersedes its prefix entry.
        c.insert(0, vec![1, 2, 3, 4, 5, 6], ring(&pool, 6));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn partitions_never_see_each_others_prompts() {
        let pool = KvPool::new(KvShape::new(1, 1, 2, KvDtype::F32), 1 << 20).unwrap();
        let mut c = PrefixCache::new(4, 2);
        let secret = [1, 2, 3, 4, 5, 6];
        c.insert(7, secret.to_vec(), ring(&pool, 6));
        // Another partition's exact guess, and its own prefix of it: no hit, not covered.
        assert!(c.lookup(9, &[1, 2, 3, 4, 5, 6, 7]).is_none());
        assert!(c.lookup(9, &[1, 2, 3]).is_none());
        assert!(!c.covers(9, &secret));
        // The owner hits.
        assert_eq!(c.lookup(7, &[1, 2, 3, 4, 5, 6, 7]).map(|(_, n)| n), Some(6));
        // A longer prompt of another partition does not supersede the owner's entry.
        c.insert(9, vec![1, 2, 3, 4, 5, 6, 7, 8], ring(&pool, 8));
        assert_eq!(c.len(), 2);
        assert_eq!(
            c.lookup(7, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).map(|(_, n)| n),
            Some(6)
        );
        assert_eq!(
            c.lookup(9, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).map(|(_, n)| n),
            Some(8)
        );
    }
}
