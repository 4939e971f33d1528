//! The pieces that encode to exactly one token, by their bytes.
//!
//! Nearly every piece of English text or code is looked up here first, so the common case is
//! kept off the heap: pieces of up to 15 bytes are keyed by their bytes packed into two words
//! (no pointer to follow, no `memcmp`); longer ones by their boxed bytes.

use rustc_hash::FxHashMap;

/// Pieces of at most this many bytes have an inline key.
const INLINE: usize = 15;

/// The whole-piece table.
#[derive(Debug, Default, Clone)]
pub(crate) struct WholeTokens {
    /// Pieces of up to [`INLINE`] bytes: their bytes zero-padded, the length in the last byte.
    short: FxHashMap<[u64; 2], u32>,
    long: FxHashMap<Box<[u8]>, u32>,
}

impl WholeTokens {
    /// Makes `bytes` encode to `id` (replacing an earlier id for the same bytes).
    pub(crate) fn insert(&mut self, bytes: Box<[u8]>, id: u32) {
        match inline_key(&bytes) {
            Some(key) => self.short.insert(key, id),
            None => self.long.insert(bytes, id),
        };
    }

    /// The token `piece` encodes to whole, if it is one.
    #[inline]
    pub(crate) fn get(&self, piece: &[u8]) -> Option<u32> {
        match inline_key(piece) {
            Some(key) => self.short.get(&key).copied(),
            None => self.long.get(piece).copied(),
        }
    }

    /// The number of pieces.
    pub(crate) fn len(&self) -> usize {
        self.short.len() + self.long.len()
    }
}

/// A piece of up to [`INLINE`] bytes as two words: its bytes in order (little-endian, zero
/// padded) with its length in the last byte. Read with overlapping word loads rather than a
/// copy into a buffer (a variable-length copy is a `memcpy` call, on every piece).
#[inline]
fn inline_key(piece: &[u8]) -> Option<[u64; 2]> {
    let n = piece.len();
    let (lo, hi) = match n {
        0 => (0, 0),
        1..=3 => {
            let byte = |i: usize| u64::from(piece[i]) << (8 * i);
            (byte(0) | byte(n / 2) | byte(n - 1), 0)
        }
        4..=7 => {
            let head = u64::from(u32::from_le_bytes(piece[..4].try_into().ok()?));
            let tail = u64::from(u32::from_le_bytes(piece[n - 4..].try_into().ok()?));
            // The first 8 - n bytes of `tail` are in `head` already.
            (head | ((tail >> (8 * (8 - n))) << 32), 0)
        }
        8..=INLINE => {
            let head = u64::from_le_bytes(piece[..8].try_into().ok()?);
            let tail = u64::from_le_bytes(piece[n - 8..].try_into().ok()?);
            // The first 16 - n bytes of `tail` are in `head` already (all of it when n = 8).
            (head, tail.checked_shr(8 * (16 - n) as u32).unwrap_or(0))
        }
        _ => return None,
    };
    Some([lo, hi | ((n as u64) << 56)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_keys_are_the_zero_padded_bytes_and_length() {
        let mut seed = 1u64;
        for n in 0..=INLINE {
            for _ in 0..50 {
                let piece: Vec<u8> = (0..n)
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                        (seed >> 56) as u8
                    })
                    .collect();
                let mut padded = [0u8; 16];
                padded[..n].copy_from_slice(&piece);
                padded[15] = n as u8;
                let want = [
                    u64::from_le_bytes(padded[..8].try_into().unwrap()),
                    u64::from_le_bytes(padded[8..].try_into().unwrap()),
                ];
                assert_eq!(inline_key(&piece), Some(want), "{piece:?}");
            }
        }
        assert_eq!(inline_key(&[0; INLINE + 1]), None);
    }

    #[test]
    fn pieces_differing_only_in_length_or_trailing_zeros_are_distinct() {
        let mut w = WholeTokens::default();
        let pieces: [&[u8]; 7] = [b"", b"\0", b"\0\0", b"a", b"a\0", &[b'a'; 15], &[b'a'; 16]];
        for (id, p) in pieces.iter().enumerate() {
            w.insert((*p).into(), id as u32);
        }
        assert_eq!(w.len(), pieces.len());
        for (id, p) in pieces.iter().enumerate() {
            assert_eq!(w.get(p), Some(id as u32), "{p:?}");
        }
        assert_eq!(w.get(b"b"), None);
        assert_eq!(w.get(&[b'a'; 17]), None);
        assert_eq!(w.get(&[b'a'; 14]), None);
    }
}
