//! Typed backing buffers of a ring.

use crate::KvDtype;

/// One ring's K and V elements for all layers and heads.
///
/// `F16` is kept as raw `u16` bits so a fresh buffer comes from `alloc_zeroed` (lazily mapped
/// zero pages, no memset) and is viewed as `f16` through `bytemuck`.
#[derive(Debug)]
pub(crate) enum Storage {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl Storage {
    /// A zeroed buffer of `elems` elements (`vec![0; n]` uses `alloc_zeroed`, so this costs
    /// no memset; pages are faulted in on first write).
    pub(crate) fn zeroed(dtype: KvDtype, elems: usize) -> Self {
        match dtype {
            KvDtype::F32 => Self::F32(vec![0.0; elems]),
            KvDtype::F16 => Self::F16(vec![0; elems]),
        }
    }

    /// An empty buffer (no allocation), the placeholder left in a dropped ring.
    pub(crate) fn empty(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F32 => Self::F32(Vec::new()),
            KvDtype::F16 => Self::F16(Vec::new()),
        }
    }

    pub(crate) fn elems(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    /// Bytes actually allocated (from the vector's capacity, not its length).
    pub(crate) fn allocated_bytes(&self) -> usize {
        match self {
            Self::F32(v) => v.capacity() * size_of::<f32>(),
            Self::F16(v) => v.capacity() * size_of::<u16>(),
        }
    }

    /// Lengthens the buffer to `elems` elements (zero-filled tail), reallocating to exactly that
    /// size: `allocated_bytes` stays exact, and no amortized over-allocation escapes the budget.
    pub(crate) fn grow_to(&mut self, elems: usize) {
        match self {
            Self::F32(v) => {
                v.reserve_exact(elems.saturating_sub(v.len()));
                v.resize(elems, 0.0);
            }
            Self::F16(v) => {
                v.reserve_exact(elems.saturating_sub(v.len()));
                v.resize(elems, 0);
            }
        }
    }

    /// `copy_within` for either element type.
    #[inline]
    pub(crate) fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        match self {
            Self::F32(v) => v.copy_within(src..src + len, dst),
            Self::F16(v) => v.copy_within(src..src + len, dst),
        }
    }

    /// Copies `other[src..src + len]` into `self[dst..]` (same dtype; checked by the caller).
    #[inline]
    pub(crate) fn copy_from(&mut self, dst: usize, other: &Self, src: usize, len: usize) {
        match (self, other) {
            (Self::F32(d), Self::F32(s)) => d[dst..dst + len].copy_from_slice(&s[src..src + len]),
            (Self::F16(d), Self::F16(s)) => d[dst..dst + len].copy_from_slice(&s[src..src + len]),
            _ => unreachable!("rings of one pool share a dtype"),
        }
    }
}
