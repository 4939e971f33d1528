//! [`Tokens`]: a token stream over an owned `Vec<u32>` or a borrowed `&[u32]`, viewable as bytes.

use std::borrow::Cow;
use std::ops::Deref;

use crate::error::TokensFromBytesError;

/// A sequence of token ids, owned or borrowed, that goes onto the wire without copying.
///
/// The byte view ([`Tokens::as_bytes`]) is the ids in native byte order, which is little-endian
/// on every target zerolayer supports; [`Tokens::from_bytes`] borrows received bytes back as ids
/// after checking length and alignment.
///
/// ```
/// use token_stream::Tokens;
/// let t = Tokens::from(vec![1u32, 2, 300]);
/// let wire: &[u8] = t.as_bytes();
/// assert_eq!(wire.len(), 12);
/// let back = Tokens::from_bytes(wire)?; // borrows, no copy
/// assert_eq!(back.as_slice(), &[1, 2, 300]);
/// assert!(Tokens::from_bytes(&wire[..5]).is_err()); // not a multiple of 4
/// # Ok::<(), token_stream::TokensFromBytesError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Tokens<'a>(Cow<'a, [u32]>);

impl<'a> Tokens<'a> {
    /// Borrows `ids` without copying.
    pub fn borrowed(ids: &'a [u32]) -> Self {
        Self(Cow::Borrowed(ids))
    }

    /// The ids.
    pub fn as_slice(&self) -> &[u32] {
        &self.0
    }

    /// The ids as bytes (4 per id, native byte order), without copying.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }

    /// Borrows ids from received bytes without copying. The slice must be 4-byte aligned and a
    /// multiple of 4 long; for unaligned buffers use [`Tokens::from_bytes_copied`].
    pub fn from_bytes(bytes: &'a [u8]) -> Result<Self, TokensFromBytesError> {
        check_len(bytes)?;
        match bytemuck::try_cast_slice::<u8, u32>(bytes) {
            Ok(ids) => Ok(Self(Cow::Borrowed(ids))),
            Err(_) => Err(TokensFromBytesError::Misaligned {
                address_mod_4: bytes.as_ptr() as usize % 4,
            }),
        }
    }

    /// Copies ids out of received bytes of any alignment (length must be a multiple of 4).
    pub fn from_bytes_copied(bytes: &[u8]) -> Result<Tokens<'static>, TokensFromBytesError> {
        check_len(bytes)?;
        let ids = bytes
            .chunks_exact(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Tokens(Cow::Owned(ids)))
    }

    /// Whether the ids are borrowed (no copy was made).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.0, Cow::Borrowed(_))
    }

    /// Takes ownership (copies only if borrowed).
    pub fn into_owned(self) -> Tokens<'static> {
        Tokens(Cow::Owned(self.0.into_owned()))
    }

    /// The ids as a vector (copies only if borrowed).
    pub fn into_vec(self) -> Vec<u32> {
        self.0.into_owned()
    }
}

fn check_len(bytes: &[u8]) -> Result<(), TokensFromBytesError> {
    if !bytes.len().is_multiple_of(4) {
        Err(TokensFromBytesError::Length { len: bytes.len() })
    } else {
        Ok(())
    }
}

impl Deref for Tokens<'_> {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.0
    }
}

impl From<Vec<u32>> for Tokens<'static> {
    fn from(v: Vec<u32>) -> Self {
        Self(Cow::Owned(v))
    }
}

impl<'a> From<&'a [u32]> for Tokens<'a> {
    fn from(v: &'a [u32]) -> Self {
        Self(Cow::Borrowed(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_errors() {
        let t = Tokens::from(vec![7u32, 0, u32::MAX]);
        let b = t.as_bytes();
        let back = Tokens::from_bytes(b).unwrap();
        assert!(back.is_borrowed());
        assert_eq!(back.as_ptr(), t.as_ptr());
        assert_eq!(&*back, &[7, 0, u32::MAX]);
        assert_eq!(
            Tokens::from_bytes(&b[..7]),
            Err(TokensFromBytesError::Length { len: 7 })
        );
        // A u32 buffer is 4-aligned, so bytes 1..13 of it are certainly misaligned.
        let mut words = [0u32; 4];
        let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        buf[1..13].copy_from_slice(b);
        assert!(matches!(
            Tokens::from_bytes(&buf[1..13]),
            Err(TokensFromBytesError::Misaligned { .. })
        ));
        assert_eq!(Tokens::from_bytes_copied(&buf[1..13]).unwrap(), t);
    }
}
