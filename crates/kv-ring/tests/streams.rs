//! The acceptance test: 200 streams of the default model's KV shape (SmolLM2-135M:
//! 30 layers, 3 kv heads, head_dim 64) run from one pool; over-budget requests get a typed error.

use kv_ring::{KvDtype, KvError, KvPool, KvRing, KvShape, RingMode};

/// SmolLM2-135M-Instruct's attention shape (from its GGUF metadata: block_count 30,
/// head_count_kv 3, embedding_length 576 / head_count 9 = 64).
const LAYERS: usize = 30;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const STREAMS: usize = 200;
const CAPACITY: usize = 96;

fn value(stream: usize, pos: u64, layer: usize) -> f32 {
    // Small integers: exact in f16.
    ((stream * 7 + pos as usize * 3 + layer) % 1024) as f32
}

fn append(ring: &mut KvRing, stream: usize, n: usize, k: &mut Vec<f32>) {
    let first = ring.next_pos();
    ring.begin(n).unwrap();
    for layer in 0..LAYERS {
        k.clear();
        for i in 0..n {
            k.extend(std::iter::repeat_n(
                value(stream, first + i as u64, layer),
                KV_HEADS * HEAD_DIM,
            ));
        }
        let v: &[f32] = k;
        ring.write_layer(layer, v, v).unwrap();
    }
    ring.commit().unwrap();
}

#[test]
fn two_hundred_default_model_streams_from_one_pool() {
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let shape = KvShape::new(LAYERS, KV_HEADS, HEAD_DIM, dtype);
        let per_ring = CAPACITY * shape.bytes_per_token();
        let pool = KvPool::new(shape, STREAMS * per_ring).unwrap();
        let mut rings: Vec<KvRing> = (0..STREAMS)
            .map(|s| {
                let mode = if s % 2 == 0 {
                    RingMode::Strict
                } else {
                    RingMode::Sliding { sinks: 4 }
                };
                pool.alloc(CAPACITY, mode).unwrap()
            })
            .collect();
        assert_eq!(pool.used_bytes(), pool.budget_bytes());
        // Over budget: a typed error carrying the facts, even for one token.
        assert_eq!(
            pool.alloc(1, RingMode::Strict).unwrap_err(),
            KvError::OverBudget {
                requested: shape.bytes_per_token(),
                used: STREAMS * per_ring,
                budget: STREAMS * per_ring
            }
        );

        // A shared system prompt: streams fork it instead of recomputing it.
        let mut k = Vec::new();
        let prompt_pool = KvPool::new(shape, 16 * shape.bytes_per_token()).unwrap();
        let mut prompt = prompt_pool.alloc(16, RingMode::Strict).unwrap();
        append(&mut prompt, 0, 16, &mut k);
        assert!(matches!(
            prompt.fork_into(16, CAPACITY, RingMode::Strict),
            Err(KvError::OverBudget { .. })
        ));

        // Prefill chunks, then interleaved decode steps; sliding rings wrap (96 < 130 tokens).
        for (s, ring) in rings.iter_mut().enumerate() {
            append(ring, s, 32, &mut k);
        }
        for step in 0..98 {
            for (s, ring) in rings.iter_mut().enumerate() {
                let r = if s % 2 == 0 && ring.len() == CAPACITY {
                    // Strict streams stop at their context length with a typed error.
                    ring.begin(1)
                } else {
                    append(ring, s, 1, &mut k);
                    Ok(())
                };
                if let Err(e) = r {
                    assert!(
                        matches!(
                            e,
                            KvError::Full {
                                len: CAPACITY,
                                requested: 1,
                                capacity: CAPACITY
                            }
                        ),
                        "{e}"
                    );
                    assert!(step >= 64);
                }
            }
        }
        for (s, ring) in rings.iter().enumerate() {
            let expect_len = CAPACITY;
            assert_eq!(ring.len(), expect_len);
            let layer = s % LAYERS;
            let view = ring.view(layer, s % KV_HEADS).unwrap();
            assert_eq!(view.len, expect_len);
            for i in [0, 3, 4, 50, expect_len - 1] {
                let pos = ring.position_of(i).unwrap();
                let want = value(s, pos, layer);
                assert_eq!(view.keys.get(i * HEAD_DIM + 17), Some(want));
                assert_eq!(view.values.get(i * HEAD_DIM + 63), Some(want));
            }
            if s % 2 == 1 {
                assert_eq!(ring.next_pos(), 130);
                assert_eq!(ring.position_of(4), Some(130 - 92));
            }
        }
        // Streams end; their memory is reused by new streams without fresh allocation.
        rings.truncate(STREAMS / 2);
        assert_eq!(pool.used_bytes(), STREAMS / 2 * per_ring);
        let fresh = pool.stats().fresh_allocs;
        let again: Vec<KvRing> = (0..STREAMS / 2)
            .map(|_| pool.alloc(CAPACITY, RingMode::Strict).unwrap())
            .collect();
        assert_eq!(pool.stats().fresh_allocs, fresh);
        assert!(matches!(
            pool.alloc(1, RingMode::Strict),
            Err(KvError::OverBudget { .. })
        ));
        drop((rings, again));
        assert_eq!(pool.used_bytes(), 0);
    }
}
