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
