//! A hash table of token pairs behind a Bloom filter, for the merge steps of the backtracking
//! BPE encoder and of the SentencePiece encoder: most pairs looked up do not merge, and the
//! filter answers those from a table small enough for L2.

use crate::bpe::NONE;

/// The pairs that merge: `(left, right) -> value` (the backtracking encoder: 1 + the merge's
/// rank; SentencePiece: the token the pair makes), open addressing with linear probing, behind
/// a blocked Bloom filter (three bits in one 64-bit word per pair, about eight bits per pair, so
/// a few percent false positives): a pair that does not merge, which is what nearly every lookup
/// of the compatibility test asks about, is mostly answered by one read of a table small enough
/// for L2 (`o200k_base`: 256 KB) instead of the slots (6 MB).
#[derive(Debug, Clone)]
pub(crate) struct PairTable {
    /// `(left, right, value)`; `left == NONE`: empty.
    slots: Vec<(u32, u32, u32)>,
    slot_shift: u32,
    filter: Vec<u64>,
    /// `hash >> filter_shift` is a pair's filter word.
    filter_shift: u32,
}

impl PairTable {
    /// The table of `(left, right, value)` triples; a pair given twice keeps the lower value.
    pub(crate) fn new(pairs: &[(u32, u32, u32)]) -> Self {
        let slot_bits = (pairs.len() * 2)
            .max(2)
            .next_power_of_two()
            .trailing_zeros();
        let filter_word_bits = (pairs.len() / 8)
            .max(1)
            .next_power_of_two()
            .trailing_zeros();
        let mut table = Self {
            slots: vec![(NONE, NONE, 0); 1 << slot_bits],
            slot_shift: 64 - slot_bits,
            filter: vec![0; 1 << filter_word_bits],
            filter_shift: 64 - filter_word_bits,
        };
        for &(left, right, value) in pairs {
            let hash = pair_hash(left, right);
            let word = table.filter_word(hash);
            table.filter[word] |= filter_bits(hash);
            let mask = table.slots.len() - 1;
            let mut slot = (hash.rotate_left(32) >> table.slot_shift) as usize;
            loop {
                let entry = &mut table.slots[slot];
                if entry.0 == NONE {
                    *entry = (left, right, value);
                    break;
                }
                if (entry.0, entry.1) == (left, right) {
                    // The same pair ends two tokens only in vocabularies with duplicate
                    // tokens; keep the lower value (for ranks: the merge that applies).
                    entry.2 = entry.2.min(value);
                    break;
                }
                slot = (slot + 1) & mask;
            }
        }
        table
    }

    /// The value of the pair (`left`, `right`), if it is in the table.
    #[inline]
    pub(crate) fn get(&self, left: u32, right: u32) -> Option<u32> {
        let hash = pair_hash(left, right);
        let bits = filter_bits(hash);
        if self.filter[self.filter_word(hash)] & bits != bits {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut slot = (hash.rotate_left(32) >> self.slot_shift) as usize;
        loop {
            let (l, r, value) = self.slots[slot];
            if l == left && r == right {
                return Some(value);
            }
            if l == NONE {
                return None;
            }
            slot = (slot + 1) & mask;
        }
    }

    #[inline]
    fn filter_word(&self, hash: u64) -> usize {
        // A shift by 64 (a one-word filter) would overflow.
        hash.checked_shr(self.filter_shift).unwrap_or(0) as usize
    }
}

/// The three bits a pair sets in its filter word (from a second mix of its hash, whose top bits
/// already chose the word).
#[inline]
fn filter_bits(hash: u64) -> u64 {
    let mixed = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (1 << (mixed >> 58)) | (1 << ((mixed >> 52) & 63)) | (1 << ((mixed >> 46) & 63))
}

/// A multiplicative hash of a pair; its top bits choose the filter word, its bits 31 and below
/// (rotated to the top) the slot.
#[inline]
fn pair_hash(left: u32, right: u32) -> u64 {
    ((u64::from(left) << 32) | u64::from(right))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(left))
        .wrapping_mul(0xD6E8_FEB8_6659_FD93)
}
