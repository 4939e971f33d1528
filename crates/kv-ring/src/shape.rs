//! Cache geometry: element type, per-token shape and ring mode.

/// Element type the cache stores keys and values in.
///
/// Writers always pass `f32`; the ring converts on write. `F16` halves the memory at a small
/// precision cost (conversion uses the F16C instructions when the CPU has them, via `half`).
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum KvDtype {
    /// IEEE 754 binary32, 4 bytes per element.
    F32,
    /// IEEE 754 binary16, 2 bytes per element.
    F16,
}

impl KvDtype {
    /// Bytes per stored element.
    pub const fn elem_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }
}

/// Per-token geometry of a model's KV cache.
///
/// Construct it with a struct literal (all fields are public) or [`KvShape::new`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct KvShape {
    /// Number of transformer layers (each has its own K and V).
    pub n_layers: usize,
    /// Number of key/value heads (GQA: usually fewer than query heads).
    pub n_kv_heads: usize,
    /// Elements per head vector.
    pub head_dim: usize,
    /// Storage element type.
    pub dtype: KvDtype,
}

impl KvShape {
    /// A shape from its four fields.
    pub const fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize, dtype: KvDtype) -> Self {
        Self {
            n_layers,
            n_kv_heads,
            head_dim,
            dtype,
        }
    }

    /// Bytes one cached token occupies:
    /// `2 (K and V) * n_layers * n_kv_heads * head_dim * dtype.elem_bytes()`.
    ///
    /// This is exactly what a ring allocates per token of capacity (no padding, no per-token
    /// metadata). Saturates at `usize::MAX` for absurd shapes, which [`KvPool::new`] rejects.
    ///
    /// [`KvPool::new`]: crate::KvPool::new
    pub const fn bytes_per_token(&self) -> usize {
        match self.checked_bytes_per_token() {
            Some(b) => b,
            None => usize::MAX,
        }
    }

    /// [`bytes_per_token`](Self::bytes_per_token), or `None` on overflow.
    pub const fn checked_bytes_per_token(&self) -> Option<usize> {
        match self.checked_elems_per_token() {
            Some(e) => e.checked_mul(self.dtype.elem_bytes()),
            None => None,
        }
    }

    /// Elements (K and V, all layers and heads) per token, or `None` on overflow.
    pub(crate) const fn checked_elems_per_token(&self) -> Option<usize> {
        let Some(a) = self.n_layers.checked_mul(self.n_kv_heads) else {
            return None;
        };
        let Some(b) = a.checked_mul(self.head_dim) else {
            return None;
        };
        b.checked_mul(2)
    }
}

/// What a ring does when an append does not fit.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum RingMode {
    /// Full is an error ([`KvError::Full`](crate::KvError::Full)): the engine stops the stream
    /// (`max_tokens` / context length reached). Position `p` is stored at view index `p`.
    Strict,
    /// StreamingLLM-style window: the first `sinks` positions ("attention sinks") are kept
    /// forever, and the oldest of the remaining entries are evicted to make room.
    /// `sinks` must be smaller than the ring's capacity.
    Sliding {
        /// Number of leading positions never evicted (StreamingLLM uses 4).
        sinks: usize,
    },
}

impl RingMode {
    /// Number of sink positions (0 for [`RingMode::Strict`]).
    pub const fn sinks(self) -> usize {
        match self {
            Self::Strict => 0,
            Self::Sliding { sinks } => sinks,
        }
    }
}
