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

#[inline]
fn inline_key(piece: &[u8]) -> Option<[u64; 2]> {
    if piece.len() > INLINE {
        return None;
    }
    let mut bytes = [0u8; 16];
    bytes[..piece.len()].copy_from_slice(piece);
    bytes[15] = piece.len() as u8;
    let (lo, hi) = bytes.split_at(8);
    Some([
        u64::from_le_bytes(lo.try_into().ok()?),
        u64::from_le_bytes(hi.try_into().ok()?),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

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
