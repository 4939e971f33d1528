//! Byte-pair merging of one pre-tokenized piece.
//!
//! Merges are applied lowest rank first, leftmost first among equal ranks — the semantics of
//! both HF `tokenizers` (merge list order) and `tiktoken` (rank of the merged token). Short
//! pieces (the vast majority) are merged in a small array with a linear scan for the minimum;
//! long pieces use a binary heap over a linked list, so a piece of n bytes costs O(n log n).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

/// Sentinel for "no merge" / "no token".
pub(crate) const NONE: u32 = u32::MAX;

/// Pieces with at most this many initial symbols use the array merge on the stack.
const SMALL: usize = 48;
/// Pieces with at most this many initial symbols use the array merge in reused buffers (a
/// vectorized minimum scan per merge beats the heap up to a few hundred symbols, which is
/// where long CJK pieces of o200k and Qwen land).
const MEDIUM: usize = 256;

/// The merge table: `(left id, right id) -> (rank, merged id)`.
#[derive(Debug, Default, Clone)]
pub(crate) struct Merges {
    map: FxHashMap<u64, (u32, u32)>,
    /// The pairs of two ids below 256 (the byte tokens of tiktoken and GPT-2 vocabularies),
    /// as a dense 256 x 256 table: every piece starts with byte pairs, and this keeps their
    /// lookups in cache. Empty when no such pair merges.
    low: Vec<(u32, u32)>,
}

impl Merges {
    pub(crate) fn insert(&mut self, a: u32, b: u32, rank: u32, merged: u32) {
        if (a | b) < 256 {
            if self.low.is_empty() {
                self.low = vec![(NONE, NONE); 1 << 16];
            }
            let slot = &mut self.low[((a << 8) | b) as usize];
            if slot.0 == NONE {
                *slot = (rank, merged);
            }
        }
        // Keep the first (lowest-rank) entry if a pair is listed twice, as HF does.
        self.map
            .entry((u64::from(a) << 32) | u64::from(b))
            .or_insert((rank, merged));
    }

    #[inline(always)]
    pub(crate) fn get(&self, a: u32, b: u32) -> (u32, u32) {
        if (a | b) < 256
            && let Some(&v) = self.low.get(((a << 8) | b) as usize)
        {
            return v;
        }
        match self.map.get(&((u64::from(a) << 32) | u64::from(b))) {
            Some(&v) => v,
            None => (NONE, NONE),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

/// Per-call state of the encoders, reused from piece to piece.
#[derive(Debug, Default, Clone)]
pub(crate) struct Work {
    /// Elementary steps of the merge and backtracking loops (for the near-linear-time tests).
    pub(crate) count: u64,
    /// The rank/id buffers of the medium-size array merge.
    ranks: Vec<u32>,
    ids: Vec<u32>,
    /// The backtracking encoder's open-position bits.
    pub(crate) open: Vec<u64>,
    /// Merge every piece, never backtrack (the reference the backtracking encoder is tested
    /// against).
    pub(crate) merge_only: bool,
    /// Backtrack every piece of two or more bytes, not only long non-ASCII ones (to test the
    /// backtracking encoder on every kind of piece).
    pub(crate) backtrack_all: bool,
}

/// Merges `symbols` (initial per-byte ids, already filtered) in place, leaving the final ids.
pub(crate) fn merge(symbols: &mut Vec<u32>, merges: &Merges, work: &mut Work) {
    if symbols.len() < 2 {
        return;
    }
    if symbols.len() <= SMALL {
        let mut ranks = [NONE; SMALL];
        let mut ids = [NONE; SMALL];
        merge_scan(symbols, merges, &mut ranks, &mut ids, 1, &mut work.count);
    } else if symbols.len() <= MEDIUM {
        work.ranks.resize(MEDIUM, NONE);
        work.ids.resize(MEDIUM, NONE);
        merge_scan(
            symbols,
            merges,
            &mut work.ranks,
            &mut work.ids,
            1,
            &mut work.count,
        );
    } else {
        merge_large(symbols, merges, work);
    }
}

/// Merges `symbols` until `stop` of them are left or no pair merges, and returns what is left
/// (of a token's bytes, the two parts of its last merge). Quadratic: for single tokens.
pub(crate) fn merge_down_to(symbols: &mut Vec<u32>, merges: &Merges, stop: usize) {
    if symbols.len() > stop.max(1) {
        let (mut ranks, mut ids) = (vec![NONE; symbols.len()], vec![NONE; symbols.len()]);
        merge_scan(symbols, merges, &mut ranks, &mut ids, stop.max(1), &mut 0);
    }
}

/// The array merge: `ranks[i]`/`ids[i]` describe the pair (`symbols[i]`, `symbols[i + 1]`);
/// each step finds the leftmost lowest rank with a vectorizable scan. Stops at `stop` (>= 1)
/// symbols.
fn merge_scan(
    symbols: &mut Vec<u32>,
    merges: &Merges,
    ranks: &mut [u32],
    ids: &mut [u32],
    stop: usize,
    count: &mut u64,
) {
    let n = symbols.len();
    for i in 0..n - 1 {
        (ranks[i], ids[i]) = merges.get(symbols[i], symbols[i + 1]);
    }
    let mut len = n;
    loop {
        let pairs = len - 1;
        let live = &ranks[..pairs];
        let best_rank = live.iter().copied().min().unwrap_or(NONE);
        *count += pairs as u64 + 1;
        if best_rank == NONE {
            break;
        }
        let best = live.iter().position(|&r| r == best_rank).unwrap_or(0);
        symbols[best] = ids[best];
        symbols.remove(best + 1);
        if best + 1 < pairs {
            ranks.copy_within(best + 2..pairs, best + 1);
            ids.copy_within(best + 2..pairs, best + 1);
        }
        len -= 1;
        if best + 1 < len {
            (ranks[best], ids[best]) = merges.get(symbols[best], symbols[best + 1]);
        } else {
            ranks[best] = NONE;
        }
        if best > 0 {
            (ranks[best - 1], ids[best - 1]) = merges.get(symbols[best - 1], symbols[best]);
        }
        if len <= stop {
            break;
        }
    }
}

fn merge_large(symbols: &mut Vec<u32>, merges: &Merges, work: &mut Work) {
    let n = symbols.len();
    let mut prev: Vec<u32> = (0..n as u32).map(|i| i.wrapping_sub(1)).collect();
    let mut next: Vec<u32> = (1..=n as u32).collect();
    let mut alive = vec![true; n];
    // Heap of (rank, position, merged id) — min-heap via Reverse; ties break on position.
    let mut heap: BinaryHeap<Reverse<(u32, u32, u32)>> = BinaryHeap::with_capacity(n);
    for i in 0..n - 1 {
        let (r, id) = merges.get(symbols[i], symbols[i + 1]);
        if r != NONE {
            heap.push(Reverse((r, i as u32, id)));
        }
    }
    work.count += n as u64;
    while let Some(Reverse((_, pos, id))) = heap.pop() {
        work.count += 1;
        let p = pos as usize;
        if !alive[p] {
            continue;
        }
        let q = next[p] as usize;
        if q >= n {
            continue;
        }
        // Stale entry: the pair at p changed since it was pushed.
        if merges.get(symbols[p], symbols[q]).1 != id {
            continue;
        }
        symbols[p] = id;
        alive[q] = false;
        let r = next[q] as usize;
        next[p] = r as u32;
        if r < n {
            prev[r] = p as u32;
            let (rk, nid) = merges.get(symbols[p], symbols[r]);
            if rk != NONE {
                heap.push(Reverse((rk, p as u32, nid)));
                work.count += 1;
            }
        }
        let pp = prev[p];
        if (pp as usize) < n {
            let (rk, nid) = merges.get(symbols[pp as usize], symbols[p]);
            if rk != NONE {
                heap.push(Reverse((rk, pp, nid)));
                work.count += 1;
            }
        }
    }
    let mut out = 0;
    let mut i = 0;
    while i < n {
        symbols[out] = symbols[i];
        out += 1;
        i = next[i] as usize;
    }
    symbols.truncate(out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: repeatedly merge the leftmost lowest-rank pair (quadratic, obviously right).
    fn reference(mut s: Vec<u32>, m: &Merges) -> Vec<u32> {
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..s.len().saturating_sub(1) {
                let (r, id) = m.get(s[i], s[i + 1]);
                if r != NONE && best.is_none_or(|(br, _, _)| r < br) {
                    best = Some((r, i, id));
                }
            }
            match best {
                None => return s,
                Some((_, i, id)) => {
                    s[i] = id;
                    s.remove(i + 1);
                }
            }
        }
    }

    fn table() -> Merges {
        // ids 0..4 are "bytes"; merged ids from 10.
        let mut m = Merges::default();
        m.insert(0, 0, 0, 10); // aa
        m.insert(10, 10, 1, 11); // aaaa
        m.insert(1, 2, 2, 12);
        m.insert(0, 1, 3, 13);
        m.insert(13, 2, 4, 14);
        m.insert(10, 1, 5, 15);
        m.insert(11, 0, 6, 16);
        m
    }

    #[test]
    fn small_and_large_agree_with_reference() {
        let m = table();
        let mut seed = 12345u64;
        for len in [2usize, 3, 5, 17, 47, 48, 49, 100, 255, 256, 257, 333] {
            for _ in 0..20 {
                let s: Vec<u32> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                        ((seed >> 33) % 3) as u32
                    })
                    .collect();
                let want = reference(s.clone(), &m);
                let mut got = s.clone();
                merge(&mut got, &m, &mut Work::default());
                let mut got_scan = s.clone();
                let (mut ranks, mut ids) = (vec![NONE; len], vec![NONE; len]);
                merge_scan(&mut got_scan, &m, &mut ranks, &mut ids, 1, &mut 0);
                assert_eq!(got_scan, want, "{s:?}");
                assert_eq!(got, want, "{s:?}");
                let mut got_large = s.clone();
                merge_large(&mut got_large, &m, &mut Work::default());
                assert_eq!(got_large, want, "{s:?}");
            }
        }
    }
}
