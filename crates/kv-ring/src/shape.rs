//! Cache geometry: element type, per-token shape and ring mode.

use weight_cache::quant::{BlockQ4_0, BlockQ8_0, QK};

/// Element type the cache stores keys and values in.
///
/// Writers always pass `f32`; the ring converts on write. `F16` halves the memory at a small
/// precision cost (conversion uses the F16C instructions when the CPU has them, via `half`);
/// `Q8_0` and `Q4_0` are llama.cpp's block formats (`-ctk q8_0 -ctv q8_0`, `-ctk q4_0 -ctv
/// q4_0`): each 32 consecutive elements of a head's row share one f16 scale, 34 bytes per 32
/// elements for `Q8_0` (53% of `F16`), 18 for `Q4_0` (28%), and need a `head_dim` that is a
/// multiple of 32.
#[non_exhaustive]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum KvDtype {
    /// IEEE 754 binary32, 4 bytes per element.
    F32,
    /// IEEE 754 binary16, 2 bytes per element.
    F16,
    /// llama.cpp's `q8_0`: per 32 elements an f16 scale `d` and 32 `i8` quants, element
    /// `d * q` ([`KvDtype::quantize_q8_0`]).
    Q8_0,
    /// llama.cpp's `q4_0`: per 32 elements a [`BlockQ4_0`] (an f16 scale `d` and 32 4-bit
    /// quants), element `d * (q - 8)` ([`KvDtype::quantize_q4_0`]).
    Q4_0,
}

/// Elements per [`KvDtype::Q8_0`] block (one scale each).
pub const Q8_0_BLOCK: usize = 32;

impl KvDtype {
    /// Elements that share one scale: 1 for the float types, 32 for `Q8_0` ([`Q8_0_BLOCK`])
    /// and `Q4_0`. A pool's `head_dim` must be a multiple of it.
    pub const fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 => 1,
            Self::Q8_0 => Q8_0_BLOCK,
            Self::Q4_0 => QK,
        }
    }

    /// Bytes `elems` elements take (`elems` a multiple of [`block_elems`](Self::block_elems)),
    /// or `None` on overflow.
    ///
    /// ```
    /// use kv_ring::KvDtype;
    /// assert_eq!(KvDtype::F16.bytes_for(64), Some(128));
    /// assert_eq!(KvDtype::Q8_0.bytes_for(64), Some(68));
    /// assert_eq!(KvDtype::Q4_0.bytes_for(64), Some(36));
    /// ```
    pub const fn bytes_for(self, elems: usize) -> Option<usize> {
        match self {
            Self::F32 => elems.checked_mul(4),
            Self::F16 => elems.checked_mul(2),
            // Per block: 32 quants and a 2-byte scale.
            Self::Q8_0 => (elems / Q8_0_BLOCK).checked_mul(Q8_0_BLOCK + 2),
            // Per block: llama.cpp's `block_q4_0`, 16 bytes of nibbles and a 2-byte scale.
            Self::Q4_0 => (elems / QK).checked_mul(size_of::<BlockQ4_0>()),
        }
    }

    /// Quantizes `x` (a multiple of 32 elements) to `q8_0` with weight-cache's
    /// [`BlockQ8_0::quantize`] (llama.cpp's `quantize_row_q8_0_ref`: per block
    /// `d = max|x| / 127`, `q = round(x / d)` half away from zero, the scale stored as f16),
    /// the quants into `q` and the scales into `d`.
    ///
    /// ```
    /// use kv_ring::KvDtype;
    /// use kv_ring::half::f16;
    /// let x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
    /// let (mut q, mut d) = ([0i8; 32], [f16::ZERO; 1]);
    /// KvDtype::quantize_q8_0(&x, &mut q, &mut d);
    /// assert_eq!(q[0], -127);
    /// assert!((d[0].to_f32() * f32::from(q[31]) - 15.0).abs() < 0.07);
    /// ```
    pub fn quantize_q8_0(x: &[f32], q: &mut [i8], d: &mut [half::f16]) {
        debug_assert!(x.len() == q.len() && x.len() == d.len() * Q8_0_BLOCK);
        for ((xb, qb), db) in x
            .as_chunks::<Q8_0_BLOCK>()
            .0
            .iter()
            .zip(q.chunks_exact_mut(Q8_0_BLOCK))
            .zip(d.iter_mut())
        {
            let b = BlockQ8_0::quantize(xb);
            qb.copy_from_slice(&b.qs);
            *db = b.d;
        }
    }

    /// Quantizes `x` (`32 * out.len()` elements) to `q4_0` blocks with weight-cache's
    /// [`BlockQ4_0::quantize`] (llama.cpp's `quantize_row_q4_0_ref`: `d = max / -8` for the
    /// element of largest magnitude, `q = min(15, (i8)(x / d + 8.5))`; block `b`'s low
    /// nibbles hold its elements 0..16, the high nibbles 16..32).
    ///
    /// ```
    /// use kv_ring::half::f16;
    /// use kv_ring::{BlockQ4_0, KvDtype};
    /// let x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
    /// let mut b = [BlockQ4_0 { d: f16::ZERO, qs: [0; 16] }];
    /// KvDtype::quantize_q4_0(&x, &mut b);
    /// let [BlockQ4_0 { d, qs }] = b;
    /// assert_eq!(d.to_f32(), 2.0);
    /// // -16 is 2 * (0 - 8); 15 would be q = 16, clamped to 15 (14.0).
    /// assert_eq!((qs[0] & 0xF, qs[15] >> 4), (0, 15));
    /// ```
    pub fn quantize_q4_0(x: &[f32], out: &mut [BlockQ4_0]) {
        debug_assert_eq!(x.len(), out.len() * QK);
        for (b, xb) in out.iter_mut().zip(x.as_chunks::<QK>().0) {
            *b = BlockQ4_0::quantize(xb);
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

    /// Bytes one cached token occupies: `2 (K and V) * n_layers * n_kv_heads` rows of
    /// `head_dim` elements of `dtype` ([`KvDtype::bytes_for`]).
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
            Some(e) => self.dtype.bytes_for(e),
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
