//! A byte trie of tokens as a double array: the longest token a text starts with, one array
//! read per byte.
//!
//! Every node is a [`Unit`] in one array. A node's children sit at `base ^ byte` and carry
//! their byte as a label, so following an edge reads exactly one unit, and that unit also holds
//! the child's own base and the token ending there (a hash map trie needs a hash, a control
//! group, a slot and a separate terminal table: three or four cache lines a byte). The
//! backtracking encoder walks this trie at every token boundary; on Chinese text that walk was
//! the largest item of the profile.
//!
//! Bases are unique among nodes with children, so a unit whose label equals the byte asked for
//! is a child of the node asking (two nodes reaching the same slot with the same byte would have
//! the same base). Leaves get base 0, and slots 1..256 are never used, so a leaf's children are
//! never found. Units are placed depth first, which keeps the nodes of one token near each other
//! in memory.

use crate::bpe::NONE;

/// The label of a free slot: above every byte, so it matches none.
const FREE_LABEL: u32 = 0x1FF;
/// Bits of [`Unit::check`] holding the label.
const LABEL_BITS: u32 = 9;
/// Tokens are stored in the bits above the label, plus one (0: no token).
pub(crate) const MAX_TOKEN: u32 = (1 << (32 - LABEL_BITS)) - 2;
/// Slots 0 (the root) to 255 are reserved: a leaf's base is 0, so its children would be there.
const RESERVED: usize = 256;

/// One trie node.
#[derive(Debug, Clone, Copy)]
struct Unit {
    /// Where the children are: child with byte `b` at `base ^ b` (0 for a leaf).
    base: u32,
    /// `(token + 1) << LABEL_BITS | label`: the byte of the edge into this node, and the token
    /// that ends here (0 for none).
    check: u32,
}

const FREE: Unit = Unit {
    base: 0,
    check: FREE_LABEL,
};

/// The double-array trie.
#[derive(Debug, Clone)]
pub(crate) struct DoubleArray {
    units: Vec<Unit>,
}

impl DoubleArray {
    /// Builds the trie of `keys` (byte strings, each with a token id at most [`MAX_TOKEN`]).
    /// Duplicate keys keep the last token. Returns `None` when the array would need more than
    /// `max_units` units.
    pub(crate) fn build(mut keys: Vec<(&[u8], u32)>, max_units: usize) -> Option<Self> {
        keys.sort_by(|a, b| a.0.cmp(b.0));
        let mut b = Builder {
            units: vec![FREE; RESERVED],
            base_used: vec![false; RESERVED],
            next_free: (0..RESERVED as u32).collect(),
        };
        // The root: slot 0, never a child (its label is free), never free.
        b.next_free[0] = 1;
        // Slots below 256 stay free forever (children of leaves, base 0).
        for slot in 1..RESERVED {
            b.next_free[slot] = RESERVED as u32;
        }
        b.base_used[0] = true;
        // Depth first: (node slot, key range, depth).
        let mut stack = vec![(0usize, 0..keys.len(), 0usize)];
        let mut labels = Vec::with_capacity(256);
        let mut ranges = Vec::with_capacity(256);
        while let Some((node, range, depth)) = stack.pop() {
            let mut lo = range.start;
            // Keys are sorted, so the one that ends here (if any) comes first.
            while lo < range.end && keys[lo].0.len() == depth {
                let token = keys[lo].1;
                debug_assert!(token <= MAX_TOKEN);
                b.units[node].check =
                    (b.units[node].check & FREE_LABEL) | ((token + 1) << LABEL_BITS);
                lo += 1;
            }
            labels.clear();
            ranges.clear();
            while lo < range.end {
                let byte = keys[lo].0[depth];
                let mut hi = lo + 1;
                while hi < range.end && keys[hi].0[depth] == byte {
                    hi += 1;
                }
                labels.push(byte);
                ranges.push(lo..hi);
                lo = hi;
            }
            if labels.is_empty() {
                continue;
            }
            let base = b.place(&labels);
            if base as usize + RESERVED > max_units {
                return None;
            }
            b.units[node].base = base;
            // Pushed in reverse so the first child's subtree is placed next.
            for (&byte, range) in labels.iter().zip(ranges.drain(..)).rev() {
                let child = (base ^ u32::from(byte)) as usize;
                stack.push((child, range, depth + 1));
            }
        }
        let mut units = b.units;
        while units.len() > RESERVED && units.last().is_some_and(|u| u.check == FREE_LABEL) {
            units.pop();
        }
        // Every base's block stays in range (a leaf's lookups land below 256).
        let end = units
            .iter()
            .map(|u| (u.base as usize | 0xFF) + 1)
            .max()
            .unwrap_or(RESERVED);
        units.resize(end.max(units.len()), FREE);
        units.shrink_to_fit();
        Some(Self { units })
    }

    /// The longest key that `text` starts with: its token, or `NONE`.
    #[inline]
    pub(crate) fn longest_match(&self, text: &[u8]) -> u32 {
        let mut best = NONE;
        let mut base = self.units[0].base;
        for &byte in text {
            let Some(&unit) = self.units.get((base ^ u32::from(byte)) as usize) else {
                break;
            };
            if unit.check & FREE_LABEL != u32::from(byte) {
                break;
            }
            let token = unit.check >> LABEL_BITS;
            if token != 0 {
                best = token - 1;
            }
            base = unit.base;
        }
        best
    }

    /// The number of units (for the log and tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.units.len()
    }
}

/// The placement state while building.
struct Builder {
    units: Vec<Unit>,
    /// Whether a base value belongs to a node already.
    base_used: Vec<bool>,
    /// Union-find over slots: following it from a slot reaches the first free slot at or
    /// after it (a used slot points past itself).
    next_free: Vec<u32>,
}

impl Builder {
    /// The first free slot at or after `slot` (growing the array when there is none).
    fn free_from(&mut self, slot: usize) -> usize {
        self.grow_to(slot + 1);
        let mut root = slot;
        while self.next_free[root] as usize != root {
            root = self.next_free[root] as usize;
            self.grow_to(root + 1);
        }
        // Path compression.
        let mut cur = slot;
        while cur != root {
            let next = self.next_free[cur] as usize;
            self.next_free[cur] = root as u32;
            cur = next;
        }
        root
    }

    fn grow_to(&mut self, len: usize) {
        if len > self.units.len() {
            // Whole blocks of 256, so a base's children are always in range.
            let new_len = (len | 0xFF) + 1;
            let old = self.units.len();
            self.units.resize(new_len, FREE);
            self.base_used.resize(new_len, false);
            self.next_free.extend(old as u32..new_len as u32);
        }
    }

    fn is_free(&self, slot: usize) -> bool {
        slot >= self.units.len() || self.next_free[slot] as usize == slot
    }

    /// Finds a base for children `labels` (sorted, non-empty), claims their slots (labelled)
    /// and the base, and returns it.
    fn place(&mut self, labels: &[u8]) -> u32 {
        let first = u32::from(labels[0]);
        let mut slot = self.free_from(RESERVED);
        loop {
            let base = slot as u32 ^ first;
            self.grow_to((base as usize | 0xFF) + 1);
            let fits = !self.base_used[base as usize]
                && labels[1..]
                    .iter()
                    .all(|&l| self.is_free((base ^ u32::from(l)) as usize));
            if fits {
                self.base_used[base as usize] = true;
                for &l in labels {
                    let child = (base ^ u32::from(l)) as usize;
                    self.units[child] = Unit {
                        base: 0,
                        check: u32::from(l),
                    };
                    self.next_free[child] = child as u32 + 1;
                }
                return base;
            }
            slot = self.free_from(slot + 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The longest key a text starts with, by brute force.
    fn reference(keys: &[(Vec<u8>, u32)], text: &[u8]) -> u32 {
        keys.iter()
            .filter(|(k, _)| text.starts_with(k))
            .max_by_key(|(k, _)| k.len())
            .map_or(NONE, |&(_, t)| t)
    }

    #[test]
    fn longest_match_equals_brute_force_on_random_keys() {
        let mut seed = 7u64;
        let mut rand = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        // Small alphabets (deep shared prefixes), then every byte value (wide nodes).
        for alphabet in [2u64, 3, 256] {
            let mut keys: Vec<(Vec<u8>, u32)> = Vec::new();
            for id in 0..2000u32 {
                let len = 1 + rand(9) as usize;
                let key: Vec<u8> = (0..len)
                    .map(|_| (rand(alphabet) * 97 % 256) as u8)
                    .collect();
                if !keys.iter().any(|(k, _)| *k == key) {
                    keys.push((key, id));
                }
            }
            let refs: Vec<(&[u8], u32)> = keys.iter().map(|(k, t)| (&k[..], *t)).collect();
            let trie = DoubleArray::build(refs, usize::MAX).unwrap();
            assert!(trie.len() < 20 * keys.len() + 1024, "{} units", trie.len());
            for _ in 0..5000 {
                let len = rand(12) as usize;
                let text: Vec<u8> = (0..len)
                    .map(|_| (rand(alphabet) * 97 % 256) as u8)
                    .collect();
                assert_eq!(
                    trie.longest_match(&text),
                    reference(&keys, &text),
                    "{text:?}"
                );
            }
            for (k, t) in &keys {
                assert_eq!(trie.longest_match(k), *t);
            }
        }
    }

    #[test]
    fn empty_and_missing() {
        let trie = DoubleArray::build(vec![(b"ab", 3), (b"a", 1)], usize::MAX).unwrap();
        assert_eq!(trie.longest_match(b""), NONE);
        assert_eq!(trie.longest_match(b"b"), NONE);
        assert_eq!(trie.longest_match(b"ax"), 1);
        assert_eq!(trie.longest_match(b"abc"), 3);
        assert!(DoubleArray::build(vec![(b"ab", 3)], 10).is_none());
    }
}
