//! Unit-level behaviour of the pool and rings: budget, modes, views, errors, forks.

use std::sync::Arc;

use kv_ring::{BlockQ4_0, KvDtype, KvError, KvPool, KvRing, KvShape, KvSlices, KvTensor, RingMode};

fn shape(dtype: KvDtype) -> KvShape {
    KvShape::new(2, 2, 4, dtype)
}

/// K rows for a chunk: value encodes (token position, layer, head, element) so views can be
/// checked exactly (small integers are exact in f16 too).
fn chunk(shape: KvShape, layer: usize, first_pos: u64, n: usize, sign: f32) -> Vec<f32> {
    let mut out = Vec::new();
    for i in 0..n {
        for h in 0..shape.n_kv_heads {
            for e in 0..shape.head_dim {
                let p = first_pos + i as u64;
                out.push(sign * (p as f32 * 16.0 + layer as f32 * 8.0 + h as f32 * 4.0 + e as f32));
            }
        }
    }
    out
}

fn append(ring: &mut KvRing, n: usize) -> Result<(), KvError> {
    let s = ring.pool().shape();
    let p = ring.next_pos();
    ring.begin(n)?;
    for layer in 0..s.n_layers {
        ring.write_layer(
            layer,
            &chunk(s, layer, p, n, 1.0),
            &chunk(s, layer, p, n, -1.0),
        )?;
    }
    ring.commit()
}

/// Checks every (layer, head) view against the positions the ring reports.
fn check_views(ring: &KvRing) {
    let s = ring.pool().shape();
    for layer in 0..s.n_layers {
        for h in 0..s.n_kv_heads {
            let v = ring.view(layer, h).unwrap();
            assert_eq!(v.len, ring.len());
            let keys = v.keys.to_f32_vec();
            let vals = v.values.to_f32_vec();
            assert_eq!(keys.len(), v.len * s.head_dim);
            for i in 0..v.len {
                let p = ring.position_of(i).unwrap();
                for e in 0..s.head_dim {
                    let want = p as f32 * 16.0 + layer as f32 * 8.0 + h as f32 * 4.0 + e as f32;
                    assert_eq!(
                        keys[i * s.head_dim + e],
                        want,
                        "layer {layer} head {h} row {i}"
                    );
                    assert_eq!(vals[i * s.head_dim + e], -want);
                }
            }
        }
    }
}

#[test]
fn memory_per_token_matches_formula_and_allocation() {
    for (dtype, row_bytes) in [
        (KvDtype::F32, 256),
        (KvDtype::F16, 128),
        (KvDtype::Q8_0, 68),
        (KvDtype::Q4_0, 36),
    ] {
        let s = KvShape::new(30, 3, 64, dtype);
        assert_eq!(s.bytes_per_token(), 2 * 30 * 3 * row_bytes);
        let pool = KvPool::new(s, 1 << 30).unwrap();
        let a = pool.alloc(100, RingMode::Strict).unwrap();
        let b = pool.alloc(37, RingMode::Sliding { sinks: 4 }).unwrap();
        assert_eq!(a.allocated_bytes(), 100 * s.bytes_per_token());
        assert_eq!(b.allocated_bytes(), 37 * s.bytes_per_token());
        assert_eq!(pool.used_bytes(), a.allocated_bytes() + b.allocated_bytes());
        drop(a);
        assert_eq!(pool.used_bytes(), 37 * s.bytes_per_token());
        drop(b);
        assert_eq!(pool.used_bytes(), 0);
    }
}

#[test]
fn over_budget_is_typed_and_budget_is_exact() {
    let s = shape(KvDtype::F32);
    let bpt = s.bytes_per_token();
    let pool = KvPool::new(s, 10 * bpt).unwrap();
    let a = pool.alloc(6, RingMode::Strict).unwrap();
    let err = pool.alloc(5, RingMode::Strict).unwrap_err();
    assert_eq!(
        err,
        KvError::OverBudget {
            requested: 5 * bpt,
            used: 6 * bpt,
            budget: 10 * bpt
        }
    );
    let b = pool.alloc(4, RingMode::Strict).unwrap(); // exactly fills the budget
    assert_eq!(pool.used_bytes(), pool.budget_bytes());
    assert!(matches!(
        pool.alloc(1, RingMode::Strict),
        Err(KvError::OverBudget { .. })
    ));
    drop(a);
    let _c = pool.alloc(6, RingMode::Strict).unwrap(); // recycled buffer
    assert_eq!(pool.stats().recycled_allocs, 1);
    assert_eq!(pool.stats().rejected_allocs, 2);
    drop(b);
    // Cached buffers count against the budget, released when a fresh one needs room.
    assert_eq!(pool.cached_bytes(), 4 * bpt);
    let _d = pool.alloc(3, RingMode::Strict).unwrap();
    assert!(pool.used_bytes() + pool.cached_bytes() <= pool.budget_bytes());
    assert_eq!(pool.cached_bytes(), 0);
}

#[test]
fn bad_arguments_are_typed_errors() {
    assert!(matches!(
        KvPool::new(KvShape::new(0, 1, 1, KvDtype::F32), 1),
        Err(KvError::ZeroDimension { .. })
    ));
    assert!(matches!(
        KvPool::new(KvShape::new(usize::MAX, 2, 1, KvDtype::F32), 1),
        Err(KvError::ShapeOverflow { .. })
    ));
    let pool = KvPool::new(shape(KvDtype::F16), usize::MAX).unwrap();
    assert_eq!(
        pool.alloc(0, RingMode::Strict).unwrap_err(),
        KvError::ZeroCapacity
    );
    assert_eq!(
        pool.alloc(4, RingMode::Sliding { sinks: 4 }).unwrap_err(),
        KvError::SinksTooLarge {
            sinks: 4,
            capacity: 4
        }
    );
    assert!(matches!(
        pool.alloc(usize::MAX / 2, RingMode::Strict),
        Err(KvError::CapacityOverflow { .. })
    ));
    let mut r = pool.alloc(4, RingMode::Strict).unwrap();
    assert_eq!(
        r.write_layer(0, &[], &[]).unwrap_err(),
        KvError::NoPendingChunk
    );
    assert_eq!(r.commit().unwrap_err(), KvError::NoPendingChunk);
    r.begin(2).unwrap();
    assert_eq!(
        r.begin(1).unwrap_err(),
        KvError::ChunkPending { pending: 2 }
    );
    assert_eq!(
        r.write_layer(2, &[0.0; 16], &[0.0; 16]).unwrap_err(),
        KvError::LayerOutOfRange {
            layer: 2,
            n_layers: 2
        }
    );
    assert_eq!(
        r.write_layer(0, &[0.0; 16], &[0.0; 15]).unwrap_err(),
        KvError::SliceLength {
            tensor: KvTensor::V,
            expected: 16,
            actual: 15
        }
    );
    assert_eq!(
        r.view(0, 2).unwrap_err(),
        KvError::HeadOutOfRange {
            head: 2,
            n_kv_heads: 2
        }
    );
    // A rejected write wrote nothing: the view does not include pending rows.
    assert_eq!(r.view(0, 0).unwrap().len, 0);
    r.write_layer(1, &[1.0; 16], &[1.0; 16]).unwrap();
    assert_eq!(
        r.commit().unwrap_err(),
        KvError::LayerNotWritten {
            layer: 0,
            pending: 2
        }
    );
    assert_eq!(r.view(0, 0).unwrap().len, 0);
    assert_eq!(r.view(1, 0).unwrap().len, 2);
    r.write_layer(0, &[1.0; 16], &[1.0; 16]).unwrap();
    r.commit().unwrap();
    assert_eq!(
        r.begin(3).unwrap_err(),
        KvError::Full {
            len: 2,
            requested: 3,
            capacity: 4
        }
    );
    assert_eq!(
        r.fork(3).unwrap_err(),
        KvError::ForkTooLong {
            requested: 3,
            len: 2
        }
    );
    assert_eq!(
        r.fork_into(2, 1, RingMode::Strict).unwrap_err(),
        KvError::ForkCapacity {
            requested: 2,
            capacity: 1
        }
    );
}

#[test]
fn strict_fills_then_errors() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let pool = KvPool::new(shape(dtype), 1 << 20).unwrap();
        let mut r = pool.alloc(5, RingMode::Strict).unwrap();
        append(&mut r, 3).unwrap();
        append(&mut r, 1).unwrap();
        append(&mut r, 1).unwrap();
        check_views(&r);
        assert!(matches!(append(&mut r, 1), Err(KvError::Full { .. })));
        assert_eq!((r.len(), r.next_pos(), r.evicted()), (5, 5, 0));
        check_views(&r);
    }
}

#[test]
fn sliding_keeps_sinks_and_wraps() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let pool = KvPool::new(shape(dtype), 1 << 20).unwrap();
        let mut r = pool.alloc(7, RingMode::Sliding { sinks: 2 }).unwrap();
        append(&mut r, 6).unwrap();
        for step in 0..20 {
            append(&mut r, 1 + step % 3).unwrap();
            check_views(&r);
            assert_eq!(r.len(), 7);
            let positions: Vec<u64> = (0..7).map(|i| r.position_of(i).unwrap()).collect();
            let np = r.next_pos();
            assert_eq!(
                positions,
                vec![0, 1, np - 5, np - 4, np - 3, np - 2, np - 1]
            );
            // At most two runs, each whole rows.
            let parts = r.view(1, 1).unwrap().keys.part_lens();
            assert!(parts.iter().all(|p| p % 4 == 0));
        }
        assert!(matches!(
            append(&mut r, 6),
            Err(KvError::ChunkTooLarge { window: 5, .. })
        ));
    }
}

#[test]
fn pending_rows_visible_per_layer_for_causal_prefill() {
    let s = shape(KvDtype::F32);
    let pool = KvPool::new(s, 1 << 20).unwrap();
    let mut r = pool.alloc(6, RingMode::Sliding { sinks: 1 }).unwrap();
    append(&mut r, 5).unwrap();
    r.begin(3).unwrap(); // evicts 2
    assert_eq!((r.len(), r.pending(), r.evicted()), (3, 3, 2));
    assert_eq!(r.view(0, 0).unwrap().len, 3);
    r.write_layer(0, &chunk(s, 0, 5, 3, 1.0), &chunk(s, 0, 5, 3, -1.0))
        .unwrap();
    let v = r.view(0, 1).unwrap();
    assert_eq!(v.len, 6);
    let pos: Vec<u64> = (0..6).map(|i| r.position_of(i).unwrap()).collect();
    assert_eq!(pos, vec![0, 3, 4, 5, 6, 7]);
    assert_eq!(v.keys.get(3 * 4), Some(5.0 * 16.0 + 4.0));
    assert_eq!(r.view(1, 0).unwrap().len, 3);
    r.write_layer(1, &chunk(s, 1, 5, 3, 1.0), &chunk(s, 1, 5, 3, -1.0))
        .unwrap();
    r.commit().unwrap();
    check_views(&r);
}

#[test]
fn fork_copies_prefix() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let pool = KvPool::new(shape(dtype), 1 << 20).unwrap();
        let mut r = pool.alloc(8, RingMode::Strict).unwrap();
        append(&mut r, 5).unwrap();
        let mut f = r.fork(3).unwrap();
        assert_eq!((f.len(), f.next_pos(), f.capacity()), (3, 3, 8));
        check_views(&f);
        append(&mut f, 2).unwrap(); // diverges from r; r unchanged
        check_views(&f);
        check_views(&r);
        let g = r.fork_into(5, 32, RingMode::Sliding { sinks: 4 }).unwrap();
        assert_eq!(g.capacity(), 32);
        check_views(&g);
        assert_eq!(pool.used_bytes(), (8 + 8 + 32) * pool.bytes_per_token());
    }
}

#[test]
fn fork_of_evicted_sliding_prefix() {
    let pool = KvPool::new(shape(KvDtype::F32), 1 << 20).unwrap();
    let mut r = pool.alloc(4, RingMode::Sliding { sinks: 2 }).unwrap();
    append(&mut r, 4).unwrap();
    append(&mut r, 1).unwrap();
    assert_eq!(
        r.fork(3).unwrap_err(),
        KvError::ForkEvicted {
            requested: 3,
            sinks: 2,
            evicted: 1
        }
    );
    append(&mut r, 2).unwrap(); // sinks now wrapped around the buffer end
    let f = r.fork(2).unwrap();
    check_views(&f);
}

#[test]
fn write_all_layers_and_reset() {
    let s = shape(KvDtype::F16);
    let pool = KvPool::new(s, 1 << 20).unwrap();
    let mut r = pool.alloc(4, RingMode::Strict).unwrap();
    r.begin(2).unwrap();
    let k: Vec<f32> = (0..2).flat_map(|l| chunk(s, l, 0, 2, 1.0)).collect();
    let v: Vec<f32> = (0..2).flat_map(|l| chunk(s, l, 0, 2, -1.0)).collect();
    assert!(matches!(
        r.write_all_layers(&k[1..], &v),
        Err(KvError::SliceLength { .. })
    ));
    r.write_all_layers(&k, &v).unwrap();
    r.commit().unwrap();
    check_views(&r);
    r.reset();
    assert_eq!((r.len(), r.next_pos()), (0, 0));
    append(&mut r, 4).unwrap();
    check_views(&r);
}

#[test]
fn f16_views_are_f16_slices() {
    let pool = KvPool::new(shape(KvDtype::F16), 1 << 20).unwrap();
    let mut r = pool.alloc(4, RingMode::Strict).unwrap();
    append(&mut r, 2).unwrap();
    match r.view(0, 0).unwrap().values {
        KvSlices::F16([a, b]) => assert_eq!((a.len(), b.len()), (8, 0)),
        other => panic!("expected f16, got {other:?}"),
    }
}

#[test]
fn send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Arc<KvPool>>();
    assert_send_sync::<KvRing>();
}

/// `KvDtype::quantize_q8_0` writes the blocks llama.cpp writes: the expected scales and quants
/// are those of the `gguf` package's port of llama.cpp's `quantize_row_q8_0_ref`
/// (`gguf.quants.quantize(x, Q8_0)`, gguf 0.19.0) for the same 64 values; and a ring of that
/// dtype returns `d * q` of them from its view.
#[test]
fn q8_0_blocks_are_llama_cpps() {
    let mut x: Vec<f32> = (0..64)
        .map(|i| ((i * 37) % 101 - 50) as f32 / 7.0)
        .collect();
    x[40] = 0.0;
    x[32..].iter_mut().for_each(|v| *v *= 0.01);
    let want_d = [0x2b33u16, 0x1084];
    let want_q: [[i8; 32]; 2] = [
        [
            -127, -33, 61, -102, -8, 86, -76, 18, 112, -51, 43, -119, -25, 69, -94, 0, 94, -69, 25,
            119, -43, 51, -112, -18, 76, -86, 8, 102, -61, 33, 127, -36,
        ],
        [
            60, -106, -10, 86, -80, 16, 111, -54, 0, -124, -29, 67, -98, -3, 93, -73, 23, 119, -47,
            49, -117, -21, 75, -91, 5, 101, -65, 31, 127, -39, 57, -109,
        ],
    ];
    let (mut q, mut d) = ([0i8; 64], [half::f16::ZERO; 2]);
    KvDtype::quantize_q8_0(&x, &mut q, &mut d);
    assert_eq!(d.map(half::f16::to_bits), want_d);
    assert_eq!(q[..32], want_q[0]);
    assert_eq!(q[32..], want_q[1]);

    let pool = KvPool::new(KvShape::new(1, 1, 64, KvDtype::Q8_0), 1 << 20).unwrap();
    let mut ring = pool.alloc(4, RingMode::Strict).unwrap();
    ring.begin(1).unwrap();
    ring.write_layer(0, &x, &x).unwrap();
    ring.commit().unwrap();
    let view = ring.view(0, 0).unwrap();
    let dequant: Vec<f32> = (0..64)
        .map(|i| half::f16::from_bits(want_d[i / 32]).to_f32() * f32::from(want_q[i / 32][i % 32]))
        .collect();
    assert_eq!(view.keys.to_f32_vec(), dequant);
    assert_eq!(view.values.to_f32_vec(), dequant);
    assert!(matches!(
        KvPool::new(KvShape::new(1, 1, 48, KvDtype::Q8_0), 1 << 20),
        Err(KvError::HeadDimNotBlockMultiple { block: 32, .. })
    ));
}

/// `KvDtype::quantize_q4_0` writes the blocks llama.cpp writes: the expected scales and nibbles
/// are those of the `gguf` package's port of llama.cpp's `quantize_row_q4_0_ref`
/// (`scripts/fixtures/kv-ring-q4_0-blocks.py`, gguf 0.19.0) for 128 values (a negative and a
/// positive largest magnitude, a zero, a block of zeros); a ring of that dtype returns
/// `d * (q - 8)` of them from its view; a `head_dim` of 48 is refused.
#[test]
fn q4_0_blocks_are_llama_cpps() {
    let mut x: Vec<f32> = (0..64)
        .map(|i| ((i * 37) % 101 - 50) as f32 / 7.0)
        .collect();
    x[40] = 0.0;
    x[32..].iter_mut().for_each(|v| *v *= 0.01);
    x.extend((0..32).map(|i| ((i * 53) % 89 - 30) as f32 / 3.0));
    x.extend([0.0; 32]);
    let want: [(u16, [u8; 16]); 4] = [
        (
            0x3b25,
            [
                224, 70, 172, 242, 88, 189, 19, 121, 223, 53, 139, 224, 70, 172, 242, 104,
            ],
        ),
        (
            0xa07b,
            [
                116, 15, 185, 83, 253, 151, 49, 235, 136, 47, 202, 100, 14, 168, 66, 253,
            ],
        ),
        (
            0xc0c0,
            [
                108, 181, 58, 130, 23, 96, 181, 74, 147, 24, 96, 181, 74, 147, 24, 97,
            ],
        ),
        (0x8000, [136; 16]),
    ];
    let mut blocks = [BlockQ4_0 {
        d: half::f16::ZERO,
        qs: [0; 16],
    }; 4];
    KvDtype::quantize_q4_0(&x, &mut blocks);
    for (b, (got, (d, qs))) in blocks.iter().zip(want).enumerate() {
        assert_eq!((got.d.to_bits(), got.qs), (d, qs), "block {b}");
    }

    let pool = KvPool::new(KvShape::new(1, 1, 128, KvDtype::Q4_0), 1 << 20).unwrap();
    let mut ring = pool.alloc(4, RingMode::Strict).unwrap();
    ring.begin(1).unwrap();
    ring.write_layer(0, &x, &x).unwrap();
    ring.commit().unwrap();
    let view = ring.view(0, 0).unwrap();
    let dequant: Vec<f32> = (0..128)
        .map(|i| {
            let (d, qs) = want[i / 32];
            let e = i % 32;
            let q = if e < 16 { qs[e] & 0xF } else { qs[e - 16] >> 4 };
            half::f16::from_bits(d).to_f32() * (f32::from(q) - 8.0)
        })
        .collect();
    assert_eq!(view.keys.to_f32_vec(), dequant);
    assert_eq!(view.values.to_f32_vec(), dequant);
    assert!(matches!(
        KvPool::new(KvShape::new(1, 1, 48, KvDtype::Q4_0), 1 << 20),
        Err(KvError::HeadDimNotBlockMultiple { block: 32, .. })
    ));
}

/// A budget holds 128/36 = 3.5x the q4_0 tokens it holds in f16 (and 68/36 the q8_0 ones): the
/// pool counts the blocks' bytes, exactly.
#[test]
fn a_q4_0_pool_fits_the_tokens_its_smaller_rows_allow() {
    let budget = 1000 * KvShape::new(30, 3, 64, KvDtype::Q4_0).bytes_per_token();
    for (dtype, tokens) in [
        (KvDtype::Q4_0, 1000),
        (KvDtype::Q8_0, 1000 * 36 / 68),
        (KvDtype::F16, 1000 * 36 / 128),
    ] {
        let pool = KvPool::new(KvShape::new(30, 3, 64, dtype), budget).unwrap();
        let ring = pool.alloc(tokens, RingMode::Strict).unwrap();
        assert!(
            matches!(
                pool.alloc(1, RingMode::Strict),
                Err(KvError::OverBudget { .. })
            ),
            "{dtype:?}: {tokens} tokens fill the budget"
        );
        drop(ring);
        assert!(matches!(
            pool.alloc(tokens + 1, RingMode::Strict),
            Err(KvError::OverBudget { .. })
        ));
    }
}
