//! Per-stream KV-cache ring buffers from a memory-budgeted pool.
//!
//! An inference engine serving many streams gives each one a [`KvRing`]: a fixed-capacity cache
//! of the keys and values of every layer and kv head, allocated once from a shared [`KvPool`]
//! whose budget caps the total (an over-budget request gets [`KvError::OverBudget`], not an OOM).
//! Appending (`begin` / `write_layer` / `commit`) and viewing never allocate; a (layer, kv head)
//! [`KvView`] is at most two contiguous `[pos][head_dim]` slices for the attention kernel.
//!
//! Rings are [`RingMode::Strict`] (full is an error: context length reached) or
//! [`RingMode::Sliding`] with StreamingLLM attention sinks (the first `sinks` positions stay,
//! the oldest others are evicted). Keys are stored already rotated (RoPE) at their absolute
//! position; [`KvRing::next_pos`] keeps growing across evictions. [`KvRing::fork`] copies a
//! prefix into a new ring (system-prompt reuse); [`KvRing::rollback`] drops the last positions
//! without a copy (speculative decoding's rejected drafts). See [`KvRing`] and [`KvPool`] for
//! the design.
//!
//! ```
//! use kv_ring::{KvDtype, KvPool, KvShape, KvSlices, RingMode};
//!
//! // SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64; f16 storage.
//! let shape = KvShape::new(30, 3, 64, KvDtype::F16);
//! assert_eq!(shape.bytes_per_token(), 2 * 30 * 3 * 64 * 2);
//! let pool = KvPool::new(shape, 64 << 20)?;
//! let mut ring = pool.alloc(1024, RingMode::Sliding { sinks: 4 })?;
//! assert_eq!(pool.used_bytes(), 1024 * shape.bytes_per_token());
//!
//! // Prefill a 3-token chunk: K and V are [n][n_kv_heads][head_dim] per layer.
//! let k = vec![0.5f32; 3 * 3 * 64];
//! let v = vec![-1.0f32; 3 * 3 * 64];
//! ring.begin(3)?;
//! for layer in 0..30 {
//!     ring.write_layer(layer, &k, &v)?;
//! }
//! let view = ring.view(0, 2)?; // includes the written pending rows
//! assert_eq!(view.len, 3);
//! ring.commit()?;
//! assert_eq!((ring.len(), ring.next_pos()), (3, 3));
//!
//! if let KvSlices::F16([a, b]) = ring.view(0, 0)?.keys {
//!     assert_eq!((a.len(), b.len()), (3 * 64, 0)); // one contiguous run, no wrap yet
//!     assert_eq!(a[64].to_f32(), 0.5);
//! }
//!
//! // Reuse the prompt in another stream; over-budget requests are typed errors.
//! let fork = ring.fork(3)?;
//! assert_eq!(fork.len(), 3);
//! assert!(matches!(pool.alloc(1 << 20, RingMode::Strict), Err(kv_ring::KvError::OverBudget { .. })));
//! drop((ring, fork));
//! assert_eq!(pool.used_bytes(), 0);
//! # Ok::<(), kv_ring::KvError>(())
//! ```
#![forbid(unsafe_code)]

mod error;
mod pool;
mod ring;
mod shape;
mod storage;
mod view;

pub use error::{KvError, KvTensor, StorageOp};
pub use half;
pub use pool::{KvPool, PoolStats};
pub use ring::KvRing;
pub use ring::LayerSlots;
pub use shape::{KvDtype, KvShape, Q8_0_BLOCK, RingMode};
pub use storage::{HostKv, HostKvStorage, KvBlock, KvBlockMut, KvStorage};
pub use view::{KvSlices, KvView, Q4Rows, Q8Rows};
/// llama.cpp's `block_q4_0` ([`KvDtype::Q4_0`]'s storage), from weight-cache.
pub use weight_cache::quant::BlockQ4_0;
