//! Unicode character classes used by the split patterns, as a two-level lookup table.
//!
//! The ranges come from `regex-syntax`'s Unicode tables (the same tables the `regex` and
//! `fancy-regex` crates, and so `tiktoken`, match with), so the hand-written scanners agree
//! with the reference regexes character for character.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, Hir, HirKind};

/// `\p{L}`: any letter.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`: any number.
pub(crate) const NUMBER: u8 = 2;
/// `\s`: Unicode `White_Space`.
pub(crate) const SPACE: u8 = 4;
/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]` (o200k's "upper-ish" class).
pub(crate) const UPPERISH: u8 = 8;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}]` (o200k's "lower-ish" class).
pub(crate) const LOWERISH: u8 = 16;
/// `\p{M}`: any mark.
pub(crate) const MARK: u8 = 32;
/// `\p{P}`: any punctuation.
pub(crate) const PUNCT: u8 = 64;
/// `\p{S}`: any symbol.
pub(crate) const SYMBOL: u8 = 128;

const BLOCK_BITS: u32 = 8;
const BLOCK: usize = 1 << BLOCK_BITS;
const N_BLOCKS: usize = (0x11_0000 >> BLOCK_BITS) as usize;

/// Class bits for every code point: `index[cp >> 8]` selects a deduplicated 256-entry block.
pub(crate) struct ClassTable {
    ascii: [u8; 128],
    index: Vec<u16>,
    blocks: Vec<[u8; BLOCK]>,
}

impl ClassTable {
    /// Class bits of `c` (a combination of [`LETTER`], [`NUMBER`], ...).
    #[inline(always)]
    pub(crate) fn of(&self, c: u32) -> u8 {
        if c < 128 {
            self.ascii[c as usize]
        } else {
            let b = self.index[(c >> BLOCK_BITS) as usize] as usize;
            self.blocks[b][(c as usize) & (BLOCK - 1)]
        }
    }

    fn build() -> Self {
        let mut flat = vec![0u8; 0x11_0000];
        let classes: [(&str, u8); 8] = [
            (r"\p{L}", LETTER),
            (r"\p{N}", NUMBER),
            (r"\s", SPACE),
            (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", UPPERISH),
            (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", LOWERISH),
            (r"\p{M}", MARK),
            (r"\p{P}", PUNCT),
            (r"\p{S}", SYMBOL),
        ];
        for (pattern, bit) in classes {
            let hir = regex_syntax::parse(pattern).expect("built-in class pattern parses");
            for (start, end) in class_ranges(&hir) {
                for cell in &mut flat[start as usize..=end as usize] {
                    *cell |= bit;
                }
            }
        }
        let mut ascii = [0u8; 128];
        ascii.copy_from_slice(&flat[..128]);
        let mut blocks: Vec<[u8; BLOCK]> = Vec::new();
        let mut seen: rustc_hash::FxHashMap<[u8; BLOCK], u16> = Default::default();
        let mut index = Vec::with_capacity(N_BLOCKS);
        for chunk in flat.chunks_exact(BLOCK) {
            let block: [u8; BLOCK] = chunk.try_into().expect("chunk is BLOCK long");
            let id = *seen.entry(block).or_insert_with(|| {
                blocks.push(block);
                u16::try_from(blocks.len() - 1).expect("fewer than 65536 distinct blocks")
            });
            index.push(id);
        }
        Self {
            ascii,
            index,
            blocks,
        }
    }
}

pub(crate) fn class_ranges(hir: &Hir) -> Vec<(u32, u32)> {
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        other => panic!("built-in class pattern is not a Unicode class: {other:?}"),
    }
}

/// The process-wide class table (built once, about 100 KB).
pub(crate) fn table() -> &'static ClassTable {
    static TABLE: OnceLock<ClassTable> = OnceLock::new();
    TABLE.get_or_init(ClassTable::build)
}

/// Decodes the UTF-8 scalar starting at `i` of a valid UTF-8 byte string: `(code point, length)`.
#[inline(always)]
pub(crate) fn decode_at(s: &[u8], i: usize) -> (u32, usize) {
    let b0 = s[i] as u32;
    if b0 < 0x80 {
        (b0, 1)
    } else if b0 < 0xE0 {
        (((b0 & 0x1F) << 6) | (s[i + 1] as u32 & 0x3F), 2)
    } else if b0 < 0xF0 {
        (
            ((b0 & 0x0F) << 12) | ((s[i + 1] as u32 & 0x3F) << 6) | (s[i + 2] as u32 & 0x3F),
            3,
        )
    } else {
        (
            ((b0 & 0x07) << 18)
                | ((s[i + 1] as u32 & 0x3F) << 12)
                | ((s[i + 2] as u32 & 0x3F) << 6)
                | (s[i + 3] as u32 & 0x3F),
            4,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_agree_with_std_on_samples() {
        let t = table();
        for c in ['a', 'Z', 'é', 'ж', '中', 'ـ', 'ǅ'] {
            assert_ne!(t.of(c as u32) & LETTER, 0, "{c:?}");
        }
        for c in ['0', '٣', '²', 'Ⅻ'] {
            assert_ne!(t.of(c as u32) & NUMBER, 0, "{c:?}");
        }
        for c in [
            ' ', '\t', '\n', '\r', '\u{85}', '\u{a0}', '\u{3000}', '\u{2028}',
        ] {
            assert_ne!(t.of(c as u32) & SPACE, 0, "{c:?}");
        }
        assert_ne!(t.of('\u{301}' as u32) & UPPERISH, 0);
        assert_ne!(t.of('\u{301}' as u32) & LOWERISH, 0);
        assert_eq!(t.of('\u{301}' as u32) & LETTER, 0);
        assert_eq!(t.of('a' as u32) & UPPERISH, 0);
        assert_eq!(t.of('A' as u32) & LOWERISH, 0);
        for c in ['!', '\'', '😀', '\u{0}'] {
            assert_eq!(t.of(c as u32) & (LETTER | NUMBER | SPACE), 0, "{c:?}");
        }
    }

    #[test]
    fn decode_matches_std() {
        let s = "aé中😀";
        let mut i = 0;
        for c in s.chars() {
            let (cp, l) = decode_at(s.as_bytes(), i);
            assert_eq!(cp, c as u32);
            assert_eq!(l, c.len_utf8());
            i += l;
        }
    }
}
