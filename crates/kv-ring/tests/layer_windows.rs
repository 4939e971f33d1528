//! Rings of a pool with per-layer sliding windows: window layers keep their last rows only,
//! other layers everything; views, eviction, growth, forks and the budget follow.

use kv_ring::{KvDtype, KvError, KvPool, KvShape, KvSlices, RingMode};

const HD: usize = 2;

/// Layer 0 slides over 4 positions, layer 1 is global, layer 2 slides over 2; chunks up to 3.
fn pool() -> std::sync::Arc<KvPool> {
    let shape = KvShape::new(3, 1, HD, KvDtype::F32);
    KvPool::with_layer_windows(shape, 1 << 20, vec![Some(4), None, Some(2)], 3).unwrap()
}

/// Appends positions `from..from+n`; every K/V row is `[pos, layer]`.
fn append(ring: &mut kv_ring::KvRing, from: u64, n: usize) {
    ring.begin(n).unwrap();
    for l in 0..3 {
        let rows: Vec<f32> = (0..n)
            .flat_map(|i| [(from + i as u64) as f32, l as f32])
            .collect();
        ring.write_layer(l, &rows, &rows).unwrap();
    }
    ring.commit().unwrap();
}

/// The positions a layer's view holds, in order.
fn positions(ring: &kv_ring::KvRing, layer: usize) -> Vec<u64> {
    let v = ring.view(layer, 0).unwrap();
    let KvSlices::F32([a, b]) = v.keys else {
        panic!("f32")
    };
    a.iter()
        .chain(b.iter())
        .step_by(HD)
        .map(|&p| p as u64)
        .collect()
}

#[test]
fn window_layers_keep_their_last_rows() {
    let pool = pool();
    let mut ring = pool.alloc(40, RingMode::Strict).unwrap();
    // Caps: 4 - 1 + 3 = 6, 40, 2 - 1 + 3 = 4.
    assert_eq!(ring.allocated_bytes(), (6 + 40 + 4) * 2 * HD * 4);
    assert_eq!(pool.ring_bytes(40), Some(ring.allocated_bytes()));
    let mut pos = 0u64;
    for n in [3usize, 1, 2, 3, 1, 1, 3, 2, 3, 3] {
        ring.begin(n).unwrap();
        // During the chunk a window layer still holds the window before each new query.
        let before: Vec<u64> = positions(&ring, 0);
        assert!(before.len() + n <= 6);
        assert!(
            before.len() >= 3.min(pos as usize),
            "layer 0 lost its window: {before:?}"
        );
        for l in 0..3 {
            let rows: Vec<f32> = (0..n)
                .flat_map(|i| [(pos + i as u64) as f32, l as f32])
                .collect();
            ring.write_layer(l, &rows, &rows).unwrap();
        }
        ring.commit().unwrap();
        pos += n as u64;
        let all: Vec<u64> = (0..pos).collect();
        assert_eq!(
            positions(&ring, 1),
            all,
            "the global layer keeps everything"
        );
        for (l, cap) in [(0usize, 6usize), (2, 4)] {
            let held = positions(&ring, l);
            assert_eq!(
                held,
                all[all.len().saturating_sub(held.len())..],
                "layer {l}"
            );
            assert!(held.len() <= cap && held.len() == ring.layer_len(l));
            assert!(
                held.len() >= cap.min(pos as usize) - 3,
                "layer {l} keeps {held:?}"
            );
        }
        assert_eq!(ring.len() as u64, pos);
    }
}

#[test]
fn chunks_over_the_limit_are_refused_and_change_nothing() {
    let pool = pool();
    let mut ring = pool.alloc(40, RingMode::Strict).unwrap();
    append(&mut ring, 0, 3);
    let err = ring.begin(4).unwrap_err();
    assert!(
        matches!(err, KvError::ChunkTooLarge { requested: 4, .. }),
        "{err}"
    );
    assert_eq!((ring.len(), ring.pending()), (3, 0));
    assert_eq!(positions(&ring, 0), [0, 1, 2]);
    assert!(matches!(
        pool.alloc(8, RingMode::Sliding { sinks: 1 }),
        Err(KvError::WindowedNotStrict)
    ));
    let shape = KvShape::new(3, 1, HD, KvDtype::F32);
    assert!(KvPool::with_layer_windows(shape, 1 << 20, vec![Some(4)], 3).is_err());
    assert!(KvPool::with_layer_windows(shape, 1 << 20, vec![Some(0), None, None], 3).is_err());
    assert!(KvPool::with_layer_windows(shape, 1 << 20, vec![None; 3], 0).is_err());
}

#[test]
fn growth_keeps_every_layers_rows() {
    let pool = pool();
    let mut ring = pool.alloc(5, RingMode::Strict).unwrap();
    // Capacity 5 caps layer 0 at 5 (< 6): no eviction yet.
    append(&mut ring, 0, 3);
    append(&mut ring, 3, 2);
    assert!(ring.begin(1).is_err(), "full");
    let used = pool.used_bytes();
    ring.grow(30).unwrap();
    assert_eq!(pool.used_bytes(), used + (1 + 25) * 2 * HD * 4);
    assert_eq!(ring.allocated_bytes(), (6 + 30 + 4) * 2 * HD * 4);
    assert_eq!(positions(&ring, 1), [0, 1, 2, 3, 4]);
    assert_eq!(positions(&ring, 2), [1, 2, 3, 4]);
    for p in 5..20 {
        append(&mut ring, p, 1);
    }
    assert_eq!(positions(&ring, 0), [14, 15, 16, 17, 18, 19]);
    assert_eq!(positions(&ring, 1), (0..20).collect::<Vec<_>>());
    drop(ring);
    assert_eq!(pool.used_bytes(), 0);
}

#[test]
fn forks_copy_what_each_layer_keeps() {
    let pool = pool();
    let mut ring = pool.alloc(40, RingMode::Strict).unwrap();
    for p in 0..4 {
        append(&mut ring, p, 1);
    }
    // All of 0..4 is still in every layer except layer 2 (keeps 4: 0..4 too).
    let f = ring.fork(4).unwrap();
    assert_eq!((f.len(), f.next_pos()), (4, 4));
    assert_eq!(positions(&f, 0), [0, 1, 2, 3]);
    assert_eq!(positions(&f, 2), [0, 1, 2, 3]);
    for p in 4..12 {
        append(&mut ring, p, 1);
    }
    // A prefix of 10: layer 0 keeps 6 of it (4..10) and holds 6..12 now: 4 and 5 are gone.
    assert!(matches!(ring.fork(10), Err(KvError::ForkEvicted { .. })));
    let f = ring.fork(12).unwrap();
    assert_eq!(positions(&f, 0), (6..12).collect::<Vec<_>>());
    assert_eq!(positions(&f, 1), (0..12).collect::<Vec<_>>());
    assert_eq!(positions(&f, 2), (8..12).collect::<Vec<_>>());
}

#[test]
fn rollback_of_the_last_chunk_keeps_every_window() {
    let pool = pool();
    let mut ring = pool.alloc(80, RingMode::Strict).unwrap();
    let mut pos = 0u64;
    // Speculative steps: a token and up to 2 drafts, then drop the rejected ones.
    for (n, rejected) in [
        (3usize, 2usize),
        (3, 0),
        (3, 1),
        (2, 1),
        (3, 2),
        (3, 2),
        (1, 0),
    ]
    .into_iter()
    .cycle()
    .take(30)
    {
        append(&mut ring, pos, n);
        ring.rollback(rejected).unwrap();
        pos += (n - rejected) as u64;
        assert_eq!((ring.len() as u64, ring.next_pos()), (pos, pos));
        let all: Vec<u64> = (0..pos).collect();
        assert_eq!(positions(&ring, 1), all);
        for (l, window) in [(0usize, 4usize), (2, 2)] {
            let held = positions(&ring, l);
            assert_eq!(held, all[all.len() - held.len()..], "layer {l}");
            assert!(
                held.len() >= (window - 1).min(pos as usize),
                "layer {l}: {held:?}"
            );
        }
    }
}

#[test]
fn rollback_past_a_window_layers_rows_is_refused_and_changes_nothing() {
    let pool = pool();
    let mut ring = pool.alloc(40, RingMode::Strict).unwrap();
    for p in 0..20 {
        append(&mut ring, p, 1);
    }
    // Layer 0 (window 4) holds 14..20; the query at 16 would need 13..16.
    assert_eq!(positions(&ring, 0), (14..20).collect::<Vec<_>>());
    assert_eq!(
        ring.rollback(4),
        Err(KvError::RollbackEvicted {
            requested: 4,
            max: 3,
            layer: Some(0)
        })
    );
    assert_eq!((ring.len(), ring.next_pos()), (20, 20));
    assert_eq!(positions(&ring, 0), (14..20).collect::<Vec<_>>());
    assert_eq!(
        ring.rollback(21),
        Err(KvError::RollbackTooLong {
            requested: 21,
            len: 20
        })
    );
    ring.rollback(3).unwrap();
    assert_eq!(positions(&ring, 0), [14, 15, 16]);
    assert_eq!(positions(&ring, 2), [16]);
    append(&mut ring, 17, 3);
    assert_eq!(positions(&ring, 0), [14, 15, 16, 17, 18, 19]);
    assert_eq!(positions(&ring, 2), [16, 17, 18, 19]);
}

proptest::proptest! {
    /// Random appends and rollbacks against the plain rule: a rollback succeeds exactly when
    /// the ring holds that many positions and every window layer still holds the
    /// `window - 1` positions before the new `next_pos`; every layer holds a suffix of the
    /// positions so far.
    #[test]
    fn appends_and_rollbacks_match_the_window_rule(
        ops in proptest::collection::vec((1..=3usize, 0..=6usize), 1..60),
    ) {
        let pool = pool();
        let mut ring = pool.alloc(64, RingMode::Strict).unwrap();
        let mut pos = 0u64;
        for (n, back) in ops {
            if pos as usize + n > 64 {
                break;
            }
            append(&mut ring, pos, n);
            pos += n as u64;
            let held: Vec<Vec<u64>> = (0..3).map(|l| positions(&ring, l)).collect();
            let ok = back as u64 <= pos
                && [(0usize, 4u64), (2, 2)].iter().all(|&(l, w)| {
                    let new_next = pos - back as u64;
                    let need_from = new_next.saturating_sub(w - 1);
                    (need_from..new_next).all(|p| held[l].contains(&p))
                });
            let got = ring.rollback(back);
            proptest::prop_assert_eq!(got.is_ok(), ok, "rollback({}) at {}: {:?}", back, pos, got);
            if ok {
                pos -= back as u64;
            }
            proptest::prop_assert_eq!(ring.next_pos(), pos);
            let all: Vec<u64> = (0..pos).collect();
            for l in 0..3 {
                let h = positions(&ring, l);
                proptest::prop_assert_eq!(&h[..], &all[all.len() - h.len()..]);
            }
        }
    }
}
