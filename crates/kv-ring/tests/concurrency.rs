//! Many threads allocating, using and freeing rings from one shared pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;

use kv_ring::{KvDtype, KvError, KvPool, KvShape, RingMode};

#[test]
fn many_threads_alloc_and_free_within_budget() {
    const THREADS: usize = 8;
    const ITERS: usize = 400;
    let shape = KvShape::new(4, 2, 8, KvDtype::F16);
    let bpt = shape.bytes_per_token();
    // Room for about 6 average rings: threads regularly hit the budget.
    let pool = KvPool::new(shape, 100 * bpt).unwrap();
    let ok = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    // Rings also move between threads: half are dropped by a collector thread.
    let (tx, rx) = mpsc::channel();
    let collector = thread::spawn(move || {
        let mut n = 0u64;
        for ring in rx {
            drop(ring);
            n += 1;
        }
        n
    });
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, ok, refused, tx) = (pool.clone(), ok.clone(), refused.clone(), tx.clone());
            thread::spawn(move || {
                let mut x = t as u64 * 7919 + 1;
                for i in 0..ITERS {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let cap = 1 + (x >> 33) as usize % 32;
                    let mode = if i % 2 == 0 {
                        RingMode::Strict
                    } else {
                        RingMode::Sliding { sinks: 0 }
                    };
                    match pool.alloc(cap, mode) {
                        Ok(mut ring) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            assert!(pool.used_bytes() <= pool.budget_bytes());
                            assert_eq!(ring.allocated_bytes(), cap * bpt);
                            // Use it: one token, then read it back.
                            let val = (t * 1000 + i % 1000) as f32;
                            let row = vec![val; 2 * 8];
                            ring.begin(1).unwrap();
                            for l in 0..4 {
                                ring.write_layer(l, &row, &row).unwrap();
                            }
                            ring.commit().unwrap();
                            assert_eq!(
                                ring.view(3, 1).unwrap().keys.get(0),
                                Some(half::f16::from_f32(val).to_f32())
                            );
                            if i % 2 == 0 {
                                tx.send(ring).unwrap();
                            }
                        }
                        Err(KvError::OverBudget {
                            requested,
                            used,
                            budget,
                        }) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            assert_eq!(requested, cap * bpt);
                            assert!(used + requested > budget);
                        }
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
            })
        })
        .collect();
    drop(tx);
    for w in workers {
        w.join().unwrap();
    }
    let collected = collector.join().unwrap();
    assert!(collected > 0);
    let st = pool.stats();
    let (ok, refused) = (ok.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    assert_eq!(ok + refused, (THREADS * ITERS) as u64);
    assert!(ok > 0, "some allocations succeed");
    assert_eq!(st.fresh_allocs + st.recycled_allocs, ok);
    assert_eq!(st.rejected_allocs, refused);
    assert_eq!(st.frees, ok);
    assert_eq!((st.live_rings, st.used_bytes), (0, 0));
    assert!(st.cached_bytes <= pool.budget_bytes());
    assert_eq!(pool.trim(), st.cached_bytes);
    assert_eq!(pool.cached_bytes(), 0);
}
