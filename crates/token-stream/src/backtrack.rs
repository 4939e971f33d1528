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

//!
//! Layout, for speed on long pieces (Chinese runs): the trie is a double array
//! ([`DoubleArray`]), a token's facts (length, rank, last merge, next shorter prefix) share one
//! 16-byte record, and the pairs that merge sit in an open-addressing table behind a bit filter
//! that answers most lookups (pairs that do not merge) from a table small enough for L2.

use crate::bpe::{Merges, NONE};
use crate::double_array::{self, DoubleArray};
use crate::pair_table::PairTable;

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

/// What the encoder needs of one token, in one record (one cache line holds four).
#[derive(Debug, Clone, Copy)]
struct TokenFacts {
    /// 0 for one-byte tokens, 1 + the rank of the merge that makes it otherwise; `NONE` for
    /// tokens that are not reachable.
    rank: u32,
    /// Its last merge's two tokens (itself twice for one-byte tokens).
    left: u32,
    right: u32,
    /// The longest reachable token that is a proper prefix of it (24 bits, [`NO_PREFIX`]: none)
    /// above its byte length (8 bits).
    prefix_len: u32,
}

const NO_PREFIX: u32 = 0x00FF_FFFF;

impl TokenFacts {
    const UNREACHABLE: Self = Self {
        rank: NONE,
        left: NONE,
        right: NONE,
        prefix_len: NO_PREFIX << 8,
    };

    #[inline]
    fn len(self) -> usize {
        (self.prefix_len & 0xFF) as usize
    }

    #[inline]
    fn next_prefix(self) -> u32 {
        match self.prefix_len >> 8 {
            NO_PREFIX => NONE,
            id => id,
        }
    }
}

/// The tables of the backtracking encoder (built once per vocabulary).
#[derive(Debug, Clone)]
pub(crate) struct Backtrack {
    /// Every reachable token by its bytes.
    trie: DoubleArray,
    /// The pairs that merge, each as the last merge of the token it makes, with `1 + rank`. (A
    /// merge that is not the last merge of its token's own bytes never happens in any text: the
    /// merges inside a token's span are those of its bytes alone.)
    last_merges: PairTable,
    /// Per token id.
    facts: Vec<TokenFacts>,
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
    /// A token is longer than 255 bytes (its length has 8 bits in the encoder's tables).
    TokenTooLong {
        /// The token.
        id: u32,
    },
    /// The vocabulary has more ids than the tables can number (`NO_PREFIX`).
    TooManyTokens,
}

impl Backtrack {
    /// Builds the tables for `tokens` (every reachable token of the vocabulary, ids below
    /// `vocab_size`), ranked by `merges`.
    pub(crate) fn build<'a>(
        tokens: impl IntoIterator<Item = Reachable<'a>>,
        vocab_size: usize,
        merges: &Merges,
    ) -> Result<Self, Declined> {
        if vocab_size >= NO_PREFIX.min(double_array::MAX_TOKEN) as usize {
            return Err(Declined::TooManyTokens);
        }
        let tokens: Vec<Reachable<'a>> = tokens.into_iter().collect();
        let mut facts = vec![TokenFacts::UNREACHABLE; vocab_size];
        let mut pairs = Vec::new();
        for t in &tokens {
            let len = t.bytes.len();
            if len > 0xFF {
                return Err(Declined::TokenTooLong { id: t.id });
            }
            let (left, right) = t.split.unwrap_or((t.id, t.id));
            let rank = match t.split {
                None => 0,
                Some((l, r)) => {
                    let rank = merges.get(l, r).0.saturating_add(1);
                    pairs.push((l, r, rank));
                    rank
                }
            };
            facts[t.id as usize] = TokenFacts {
                rank,
                left,
                right,
                prefix_len: (NO_PREFIX << 8) | len as u32,
            };
        }
        let keys = tokens.iter().map(|t| (t.bytes, t.id)).collect();
        let trie = DoubleArray::build(keys, MAX_NODES).ok_or(Declined::TooManyNodes)?;
        for t in &tokens {
            let prefix = trie.longest_match(&t.bytes[..t.bytes.len() - 1]);
            if prefix != NONE {
                facts[t.id as usize].prefix_len =
                    (prefix << 8) | (facts[t.id as usize].prefix_len & 0xFF);
            }
            if let Some((l, r)) = t.split {
                let rank = facts[t.id as usize].rank;
                let rises = |part: u32| facts.get(part as usize).is_some_and(|p| p.rank < rank);
                if !(rises(l) && rises(r)) {
                    return Err(Declined::RanksNotRising { id: t.id });
                }
            }
        }
        Ok(Self {
            trie,
            last_merges: PairTable::new(&pairs),
            facts,
        })
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
        let mut left_facts = self.facts[left as usize];
        let mut right_facts = self.facts[right as usize];
        loop {
            *work += 1;
            if let Some(rank) = self.last_merges.get(left, right)
                && rank < limit
            {
                return false;
            }
            if left_facts.rank > right_facts.rank {
                // `left` was made last: undo it, keeping its right part at the boundary.
                limit = left_facts.rank;
                left = left_facts.right;
                left_facts = self.facts[left as usize];
            } else if right_facts.rank > 0 {
                limit = right_facts.rank.saturating_add(1);
                right = right_facts.left;
                right_facts = self.facts[right as usize];
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
        let mut next = self.trie.longest_match(piece);
        while pos < piece.len() {
            let mut token = next;
            if token == NONE {
                return false;
            }
            let last = out.last().copied();
            loop {
                *work += 1;
                let facts = self.facts[token as usize];
                let end = pos + facts.len();
                let fits = open[end / 64] & (1 << (end % 64)) != 0
                    && last.is_none_or(|l| self.compatible(l, token, work));
                if fits {
                    out.push(token);
                    pos = end;
                    next = self.trie.longest_match(&piece[end..]);
                    break;
                }
                let shorter = facts.next_prefix();
                if shorter != NONE {
                    token = shorter;
                    continue;
                }
                // Nothing fits after `last`: give up on this position and take `last` back.
                open[pos / 64] &= !(1 << (pos % 64));
                let Some(back) = out.pop() else {
                    return false;
                };
                pos -= self.facts[back as usize].len();
                next = back;
                break;
            }
        }
        true
    }
}

/// Trie nodes (double-array units) are numbered below this.
const MAX_NODES: usize = 1 << 26;
