//! Linear-time byte-pair encoding of long pieces by backtracking over a token trie.
//!
//! The idea is the one of GitHub's `bpe` crate (its README and paper): a piece's BPE encoding
//! is the only way to spell the piece with tokens such that
//! - every token is *reachable* (merging the token's own bytes gives that token), and
//! - every two neighbours are *compatible* (merging the two tokens' bytes gives the two tokens).
//!
//! (Both follow from BPE being local: until a merge crosses the boundary between two spans, the
//! merges inside each span happen in the order the span alone would make them.) So instead of
//! merging, [`Backtrack::encode`] walks the piece left to right, takes the longest reachable
//! token at each position, and when that token is not compatible with the previous one tries
//! the next shorter one, backing up a token when none fits. Positions from which no spelling
//! was found are remembered, so each is abandoned once.
//!
//! The compatibility test replays the two tokens' merge trees backwards
//! ([`Backtrack::compatible`]) instead of merging their bytes. That replay is exact when every
//! token's merge tree has ranks rising strictly towards the root, which makes every BPE run
//! apply its merges in rank order; [`Backtrack::build`] checks this for the whole vocabulary
//! and declines (the caller keeps the merge loop) when it does not hold.

use rustc_hash::FxHashMap;

use crate::bpe::{Merges, NONE};

/// A reachable token as [`Backtrack::build`] takes it.
pub(crate) struct Reachable<'a> {
    /// The token's bytes.
    pub(crate) bytes: &'a [u8],
    /// Its id.
    pub(crate) id: u32,
    /// The last merge that makes it (`None` for a one-byte token): the two tokens that merging
    /// its bytes leaves just before the end.
    pub(crate) split: Option<(u32, u32)>,
}

/// The tables of the backtracking encoder (built once per vocabulary).
#[derive(Debug, Clone)]
pub(crate) struct Backtrack {
    /// Trie children below depth 2: `(node << 8) | byte -> node` (4-byte keys keep the map
    /// small: nodes are numbered below [`MAX_NODES`]).
    children: FxHashMap<u32, u32>,
    /// The nodes of depth 1 by their byte, and of depth 2 by their two bytes (dense tables:
    /// every walk starts there).
    depth1: [u32; 256],
    depth2: Vec<u32>,
    /// The pairs that merge, each as the last merge of the token it makes: `(left << 32) |
    /// right -> 1 + rank`. (A merge that is not the last merge of its token's own bytes never
    /// happens in any text: the merges inside a token's span are those of its bytes alone.)
    last_merges: FxHashMap<u64, u32>,
    /// The reachable token ending at each trie node, or `NONE`.
    terminal: Vec<u32>,
    /// Per token id: its byte length (0: not reachable).
    len: Vec<u32>,
    /// Per token id: the longest reachable token that is a proper prefix of it, or `NONE`.
    next_prefix: Vec<u32>,
    /// Per token id: 0 for one-byte tokens, 1 + the rank of the merge that makes it otherwise.
    rank: Vec<u32>,
    /// Per token id: its last merge's two tokens (itself twice for one-byte tokens).
    split: Vec<(u32, u32)>,
}

/// Why a vocabulary keeps the merge loop (for the log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Declined {
    /// A token's last merge ranks no higher than a merge inside one of its two parts.
    RanksNotRising {
        /// The token.
        id: u32,
    },
    /// The token trie would have more than [`MAX_NODES`] nodes.
    TooManyNodes,
}

impl Backtrack {
    /// Builds the tables for `tokens` (every reachable token of the vocabulary, ids below
    /// `vocab_size`), ranked by `merges`.
    pub(crate) fn build<'a>(
        tokens: impl IntoIterator<Item = Reachable<'a>>,
        vocab_size: usize,
        merges: &Merges,
    ) -> Result<Self, Declined> {
        let mut bt = Self {
            children: FxHashMap::default(),
            depth1: [NONE; 256],
            depth2: vec![NONE; 1 << 16],
            last_merges: FxHashMap::default(),
            terminal: vec![NONE],
            len: vec![0; vocab_size],
            next_prefix: vec![NONE; vocab_size],
            rank: vec![NONE; vocab_size],
            split: vec![(NONE, NONE); vocab_size],
        };
        let tokens: Vec<Reachable<'a>> = tokens.into_iter().collect();
        for t in &tokens {
            if bt.terminal.len() + t.bytes.len() >= MAX_NODES {
                return Err(Declined::TooManyNodes);
            }
            let node = bt.insert(t.bytes);
            bt.terminal[node as usize] = t.id;
            bt.len[t.id as usize] = t.bytes.len() as u32;
            bt.split[t.id as usize] = t.split.unwrap_or((t.id, t.id));
            bt.rank[t.id as usize] = match t.split {
                None => 0,
                Some((l, r)) => {
                    let rank = merges.get(l, r).0.saturating_add(1);
                    bt.last_merges.insert(pair_key(l, r), rank);
                    rank
                }
            };
        }
        for t in &tokens {
            bt.next_prefix[t.id as usize] = bt.longest_match(&t.bytes[..t.bytes.len() - 1]);
            if let Some((l, r)) = t.split {
                let rank = bt.rank[t.id as usize];
                let rises = |part: u32| bt.rank.get(part as usize).is_some_and(|&p| p < rank);
                if !(rises(l) && rises(r)) {
                    return Err(Declined::RanksNotRising { id: t.id });
                }
            }
        }
        Ok(bt)
    }

    fn insert(&mut self, bytes: &[u8]) -> u32 {
        let mut node = 0u32;
        for (i, &b) in bytes.iter().enumerate() {
            let slot = match i {
                0 => &mut self.depth1[b as usize],
                1 => &mut self.depth2[(usize::from(bytes[0]) << 8) | usize::from(b)],
                _ => self.children.entry(child_key(node, b)).or_insert(NONE),
            };
            if *slot == NONE {
                *slot = self.terminal.len() as u32;
                self.terminal.push(NONE);
            }
            node = *slot;
        }
        node
    }

    /// The longest reachable token that `text` starts with, or `NONE`.
    #[inline]
    fn longest_match(&self, text: &[u8]) -> u32 {
        let (node, rest) = match *text {
            [] => return NONE,
            [a] => return self.terminal_at(self.depth1[a as usize]),
            [a, b, ..] => (
                self.depth2[(usize::from(a) << 8) | usize::from(b)],
                &text[2..],
            ),
        };
        if node == NONE {
            return self.terminal_at(self.depth1[text[0] as usize]);
        }
        let mut node = node;
        let mut best = self.terminal[node as usize];
        if best == NONE {
            best = self.terminal_at(self.depth1[text[0] as usize]);
        }
        for &b in rest {
            match self.children.get(&child_key(node, b)) {
                Some(&next) => node = next,
                None => break,
            }
            let t = self.terminal[node as usize];
            if t != NONE {
                best = t;
            }
        }
        best
    }

    fn terminal_at(&self, node: u32) -> u32 {
        if node == NONE {
            NONE
        } else {
            self.terminal[node as usize]
        }
    }

    /// Whether merging the bytes of `left` then `right` gives exactly `[left, right]`.
    ///
    /// Replays the two merge trees backwards from the finished pair: at each step the pair
    /// straddling the boundary is `(left, right)`, and it lasted from the later of the two
    /// tokens' merges until the merge that ended it (`limit`, in `1 + rank` units). A merge of
    /// the straddling pair ranked below that end (or level with it, when the end was on the
    /// right: ties go to the leftmost pair) would have happened instead.
    #[inline]
    fn compatible(&self, mut left: u32, mut right: u32, work: &mut u64) -> bool {
        let mut limit = u32::MAX;
        loop {
            *work += 1;
            if let Some(&rank) = self.last_merges.get(&pair_key(left, right))
                && rank < limit
            {
                return false;
            }
            let (rank_left, rank_right) = (self.rank[left as usize], self.rank[right as usize]);
            if rank_left > rank_right {
                // `left` was made last: undo it, keeping its right part at the boundary.
                limit = rank_left;
                left = self.split[left as usize].1;
            } else if rank_right > 0 {
                limit = rank_right.saturating_add(1);
                right = self.split[right as usize].0;
            } else {
                // Two single bytes, and the pair never merged.
                return true;
            }
        }
    }

    /// Encodes `piece` (every byte of which must have a one-byte token) into `out` (which must
    /// be empty). Returns false, with `out` unspecified, if no spelling was found, which the
    /// tables built by [`Backtrack::build`] rule out; the caller then merges instead.
    pub(crate) fn encode(
        &self,
        piece: &[u8],
        out: &mut Vec<u32>,
        open: &mut Vec<u64>,
        work: &mut u64,
    ) -> bool {
        // `open` bit p: a spelling of the rest may still start at byte p.
        open.clear();
        open.resize(piece.len() / 64 + 1, u64::MAX);
        let mut pos = 0;
        let mut next = self.longest_match(piece);
        while pos < piece.len() {
            let mut token = next;
            if token == NONE {
                return false;
            }
            let last = out.last().copied();
            loop {
                *work += 1;
                let end = pos + self.len[token as usize] as usize;
                let fits = open[end / 64] & (1 << (end % 64)) != 0
                    && last.is_none_or(|l| self.compatible(l, token, work));
                if fits {
                    out.push(token);
                    pos = end;
                    next = self.longest_match(&piece[end..]);
                    break;
                }
                let shorter = self.next_prefix[token as usize];
                if shorter != NONE {
                    token = shorter;
                    continue;
                }
                // Nothing fits after `last`: give up on this position and take `last` back.
                open[pos / 64] &= !(1 << (pos % 64));
                let Some(back) = out.pop() else {
                    return false;
                };
                pos -= self.len[back as usize] as usize;
                next = back;
                break;
            }
        }
        true
    }
}

/// Trie nodes are numbered below this, so that a node and a byte fit in a `u32` key.
const MAX_NODES: usize = 1 << 24;

fn child_key(node: u32, byte: u8) -> u32 {
    (node << 8) | u32::from(byte)
}

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}
