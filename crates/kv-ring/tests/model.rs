//! Model-based property tests: random sequences of allocs, appends (with per-layer writes in
//! random order, mid-chunk views, forgotten layers), forks, resets, grows, rollbacks and drops,
//! checked after every
//! step against a plain `VecDeque` reference, in both modes and both dtypes.

use std::collections::VecDeque;
use std::sync::Arc;

use half::f16;
use kv_ring::{KvDtype, KvError, KvPool, KvRing, KvShape, RingMode};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Entry {
    pos: u64,
    /// `[layer][head][head_dim]`, already rounded to the storage dtype.
    k: Vec<f32>,
    v: Vec<f32>,
}

/// The reference: the cached entries in position order.
#[derive(Clone, Debug)]
struct RefRing {
    cap: usize,
    sinks: usize,
    strict: bool,
    entries: VecDeque<Entry>,
    next_pos: u64,
}

impl RefRing {
    fn new(cap: usize, mode: RingMode) -> Self {
        Self {
            cap,
            sinks: mode.sinks(),
            strict: mode == RingMode::Strict,
            entries: VecDeque::new(),
            next_pos: 0,
        }
    }

    /// Reference `begin`: the expected error, or the evictions done.
    fn begin(&mut self, n: usize) -> Result<(), KvError> {
        let len = self.entries.len();
        if len + n > self.cap {
            if self.strict {
                return Err(KvError::Full {
                    len,
                    requested: n,
                    capacity: self.cap,
                });
            }
            let window = self.cap - self.sinks;
            if n > window {
                return Err(KvError::ChunkTooLarge {
                    requested: n,
                    len,
                    capacity: self.cap,
                    window,
                });
            }
            for _ in 0..len + n - self.cap {
                self.entries.remove(self.sinks);
            }
        }
        Ok(())
    }

    fn evicted(&self) -> u64 {
        self.next_pos - self.entries.len() as u64
    }

    /// Reference `rollback`: the last `n` entries go unless one of them is gone or a sink.
    fn rollback(&mut self, n: usize) -> Result<(), KvError> {
        let len = self.entries.len();
        if n > len {
            return Err(KvError::RollbackTooLong { requested: n, len });
        }
        // Only entries at consecutive positions up to `next_pos` can be dropped.
        let droppable = self
            .entries
            .iter()
            .rev()
            .zip((0..self.next_pos).rev())
            .take_while(|(e, p)| e.pos == *p)
            .count();
        if n > droppable {
            return Err(KvError::RollbackEvicted {
                requested: n,
                max: droppable,
                layer: None,
            });
        }
        self.entries.truncate(len - n);
        self.next_pos -= n as u64;
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        cap: usize,
        sinks: Option<usize>,
    },
    Append {
        ring: usize,
        n: usize,
        seed: u64,
        order: Vec<usize>,
        mid_view: bool,
        forget_layer: bool,
    },
    Fork {
        ring: usize,
        n: usize,
        target: Option<(usize, Option<usize>)>,
    },
    Drop {
        ring: usize,
    },
    Reset {
        ring: usize,
    },
    /// `rollback(n)` (speculative decoding's rejected drafts), halfway through a chunk when
    /// `mid_chunk` (must be refused).
    Rollback {
        ring: usize,
        n: usize,
        mid_chunk: bool,
    },
    /// `grow(capacity + extra)`, halfway through a chunk when `mid_chunk` (must be refused).
    Grow {
        ring: usize,
        extra: usize,
        mid_chunk: bool,
    },
}

fn mode_of(sinks: Option<usize>) -> RingMode {
    match sinks {
        None => RingMode::Strict,
        Some(sinks) => RingMode::Sliding { sinks },
    }
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1..=12usize, proptest::option::of(0..=6usize))
            .prop_map(|(cap, sinks)| Op::Alloc { cap, sinks }),
        8 => (
            any::<usize>(),
            prop_oneof![3 => 1..=3usize, 1 => 0..=13usize],
            any::<u64>(),
            Just((0..3usize).collect::<Vec<_>>()).prop_shuffle(),
            any::<bool>(),
            proptest::bool::weighted(0.2),
        )
            .prop_map(|(ring, n, seed, order, mid_view, forget_layer)| Op::Append {
                ring,
                n,
                seed,
                order,
                mid_view,
                forget_layer,
            }),
        2 => (
            any::<usize>(),
            0..=10usize,
            proptest::option::of((1..=14usize, proptest::option::of(0..=6usize)))
        )
            .prop_map(|(ring, n, target)| Op::Fork { ring, n, target }),
        1 => any::<usize>().prop_map(|ring| Op::Drop { ring }),
        1 => any::<usize>().prop_map(|ring| Op::Reset { ring }),
        2 => (any::<usize>(), 0..=8usize, proptest::bool::weighted(0.1))
            .prop_map(|(ring, extra, mid_chunk)| Op::Grow { ring, extra, mid_chunk }),
        3 => (any::<usize>(), prop_oneof![3 => 0..=4usize, 1 => 0..=14usize], proptest::bool::weighted(0.1))
            .prop_map(|(ring, n, mid_chunk)| Op::Rollback { ring, n, mid_chunk }),
    ]
}

fn shape_strategy() -> impl Strategy<Value = KvShape> {
    (1..=3usize, 1..=2usize, 1..=3usize, 0..4u8).prop_map(|(l, h, d, f)| match f {
        0 => KvShape::new(l, h, d, KvDtype::F32),
        1 => KvShape::new(l, h, d, KvDtype::F16),
        // q8_0 and q4_0 need whole 32-element blocks per head row.
        2 => KvShape::new(l, h, 32 * d, KvDtype::Q8_0),
        _ => KvShape::new(l, h, 32 * d, KvDtype::Q4_0),
    })
}

/// Deterministic pseudo-random data in [-8, 8).
fn data(seed: u64, len: usize) -> Vec<f32> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 16.0 - 8.0
        })
        .collect()
}

/// One token's row of one layer (`[n_kv_heads][head_dim]`) as the ring stores it: f16-rounded,
/// or quantized per 32 elements (`d * q` for q8_0; `q4_0` through weight-cache's row quantizer
/// and dequantizer, not the ring's block path), else as it is.
fn round_row(dtype: KvDtype, row: &[f32]) -> Vec<f32> {
    match dtype {
        KvDtype::F16 => row.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
        KvDtype::Q8_0 => {
            let mut q = vec![0i8; row.len()];
            let mut d = vec![f16::ZERO; row.len() / 32];
            KvDtype::quantize_q8_0(row, &mut q, &mut d);
            q.iter()
                .enumerate()
                .map(|(i, &q)| d[i / 32].to_f32() * f32::from(q))
                .collect()
        }
        KvDtype::Q4_0 => {
            use weight_cache::GgmlType;
            let bytes = weight_cache::quantize(GgmlType::Q4_0, row).unwrap();
            let mut out = vec![0.0; row.len()];
            weight_cache::dequantize(GgmlType::Q4_0, &bytes, &mut out).unwrap();
            out
        }
        _ => row.to_vec(),
    }
}

struct Harness {
    shape: KvShape,
    pool: Arc<KvPool>,
    rings: Vec<(KvRing, RefRing)>,
}

impl Harness {
    fn expected_used(&self) -> usize {
        self.rings.iter().map(|(_, r)| r.cap).sum::<usize>() * self.shape.bytes_per_token()
    }

    /// Expected outcome of allocating `cap` tokens in `mode` from the pool.
    fn expect_alloc(&self, cap: usize, mode: RingMode) -> Result<(), KvError> {
        if cap == 0 {
            return Err(KvError::ZeroCapacity);
        }
        if mode.sinks() >= cap && mode != RingMode::Strict {
            return Err(KvError::SinksTooLarge {
                sinks: mode.sinks(),
                capacity: cap,
            });
        }
        let bytes = cap * self.shape.bytes_per_token();
        let used = self.expected_used();
        if used + bytes > self.pool.budget_bytes() {
            return Err(KvError::OverBudget {
                requested: bytes,
                used,
                budget: self.pool.budget_bytes(),
            });
        }
        Ok(())
    }

    fn check_ring(&self, ring: &KvRing, r: &RefRing, pending: Option<(&[Entry], &[bool])>) {
        let s = self.shape;
        let (hd, heads) = (s.head_dim, s.n_kv_heads);
        assert_eq!(ring.len(), r.entries.len());
        assert_eq!(ring.next_pos(), r.next_pos);
        assert_eq!(ring.evicted(), r.evicted());
        assert_eq!(ring.capacity(), r.cap);
        assert_eq!(ring.allocated_bytes(), r.cap * s.bytes_per_token());
        let pend = pending.map_or(&[][..], |p| p.0);
        for (i, e) in r.entries.iter().chain(pend).enumerate() {
            assert_eq!(
                ring.position_of(i),
                Some(e.pos),
                "position of view index {i}"
            );
        }
        assert_eq!(ring.position_of(r.entries.len() + pend.len()), None);
        for layer in 0..s.n_layers {
            let written = pending.is_some_and(|p| p.1[layer]);
            for h in 0..heads {
                let view = ring.view(layer, h).unwrap();
                let rows: Vec<&Entry> = r
                    .entries
                    .iter()
                    .chain(pend.iter().filter(|_| written))
                    .collect();
                assert_eq!(view.len, rows.len(), "layer {layer} head {h}");
                let o = (layer * heads + h) * hd;
                let want_k: Vec<f32> = rows.iter().flat_map(|e| e.k[o..o + hd].to_vec()).collect();
                let want_v: Vec<f32> = rows.iter().flat_map(|e| e.v[o..o + hd].to_vec()).collect();
                assert_eq!(
                    view.keys.to_f32_vec(),
                    want_k,
                    "keys layer {layer} head {h}"
                );
                assert_eq!(
                    view.values.to_f32_vec(),
                    want_v,
                    "values layer {layer} head {h}"
                );
                for p in view.keys.part_lens() {
                    assert_eq!(p % hd, 0, "runs hold whole rows");
                }
                assert_eq!(view.keys.part_lens(), view.values.part_lens());
            }
        }
    }

    fn check_all(&self) {
        for (ring, r) in &self.rings {
            self.check_ring(ring, r, None);
        }
        assert_eq!(self.pool.used_bytes(), self.expected_used());
        assert!(self.pool.used_bytes() + self.pool.cached_bytes() <= self.pool.budget_bytes());
        assert_eq!(self.pool.stats().live_rings, self.rings.len());
    }

    fn apply(&mut self, op: Op) {
        let s = self.shape;
        let row = s.n_kv_heads * s.head_dim;
        match op {
            Op::Alloc { cap, sinks } => {
                let mode = mode_of(sinks);
                let expected = self.expect_alloc(cap, mode);
                match (self.pool.alloc(cap, mode), expected) {
                    (Ok(ring), Ok(())) => self.rings.push((ring, RefRing::new(cap, mode))),
                    (Err(got), Err(want)) => assert_eq!(got, want),
                    (got, want) => panic!("alloc: got {got:?}, want {want:?}"),
                }
            }
            Op::Append {
                ring,
                n,
                seed,
                order,
                mid_view,
                forget_layer,
            } => {
                if self.rings.is_empty() {
                    return;
                }
                let idx = ring % self.rings.len();
                let mut r = self.rings[idx].1.clone();
                let want = r.begin(n);
                let got = self.rings[idx].0.begin(n);
                assert_eq!(got, want);
                if got.is_err() {
                    self.rings[idx].1 = r;
                    return;
                }
                assert!(matches!(
                    self.rings[idx].0.begin(1),
                    Err(KvError::ChunkPending { pending }) if pending == n
                ));
                let k = data(seed, s.n_layers * n * row);
                let v = data(seed ^ 0x9e37_79b9, s.n_layers * n * row);
                // Reference pending entries: [layer][head][hd] per token.
                let pend: Vec<Entry> = (0..n)
                    .map(|i| {
                        let pick = |src: &[f32]| {
                            (0..s.n_layers)
                                .flat_map(|l| {
                                    let o = (l * n + i) * row;
                                    round_row(s.dtype, &src[o..o + row])
                                })
                                .collect()
                        };
                        Entry {
                            pos: r.next_pos + i as u64,
                            k: pick(&k),
                            v: pick(&v),
                        }
                    })
                    .collect();
                let layers: Vec<usize> = order.into_iter().filter(|&l| l < s.n_layers).collect();
                let mut written = vec![false; s.n_layers];
                let skip = (forget_layer && n > 0).then(|| *layers.last().unwrap());
                for &l in &layers {
                    if Some(l) == skip {
                        continue;
                    }
                    let sl = l * n * row..(l + 1) * n * row;
                    self.rings[idx]
                        .0
                        .write_layer(l, &k[sl.clone()], &v[sl])
                        .unwrap();
                    written[l] = true;
                    if mid_view {
                        self.check_ring(&self.rings[idx].0, &r, Some((&pend, &written)));
                    }
                }
                if let Some(l) = skip {
                    let first_missing = written.iter().position(|w| !w).unwrap();
                    assert_eq!(
                        self.rings[idx].0.commit(),
                        Err(KvError::LayerNotWritten {
                            layer: first_missing,
                            pending: n
                        })
                    );
                    let sl = l * n * row..(l + 1) * n * row;
                    self.rings[idx]
                        .0
                        .write_layer(l, &k[sl.clone()], &v[sl])
                        .unwrap();
                }
                self.rings[idx].0.commit().unwrap();
                r.entries.extend(pend);
                r.next_pos += n as u64;
                self.rings[idx].1 = r;
            }
            Op::Fork { ring, n, target } => {
                if self.rings.is_empty() {
                    return;
                }
                let idx = ring % self.rings.len();
                let src = &self.rings[idx].1;
                let (cap, mode) = match target {
                    None => (
                        src.cap,
                        if src.strict {
                            RingMode::Strict
                        } else {
                            RingMode::Sliding { sinks: src.sinks }
                        },
                    ),
                    Some((cap, sinks)) => (cap, mode_of(sinks)),
                };
                let want = if n > src.entries.len() {
                    Err(KvError::ForkTooLong {
                        requested: n,
                        len: src.entries.len(),
                    })
                } else if src.evicted() > 0 && n > src.sinks {
                    Err(KvError::ForkEvicted {
                        requested: n,
                        sinks: src.sinks,
                        evicted: src.evicted(),
                    })
                } else if n > cap {
                    Err(KvError::ForkCapacity {
                        requested: n,
                        capacity: cap,
                    })
                } else {
                    self.expect_alloc(cap, mode)
                };
                match (self.rings[idx].0.fork_into(n, cap, mode), want) {
                    (Ok(f), Ok(())) => {
                        let mut r = RefRing::new(cap, mode);
                        r.entries = src.entries.iter().take(n).cloned().collect();
                        r.next_pos = n as u64;
                        self.rings.push((f, r));
                    }
                    (Err(got), Err(want)) => assert_eq!(got, want),
                    (got, want) => panic!("fork: got {got:?}, want {want:?}"),
                }
            }
            Op::Drop { ring } => {
                if !self.rings.is_empty() {
                    let idx = ring % self.rings.len();
                    self.rings.swap_remove(idx);
                }
            }
            Op::Reset { ring } => {
                if !self.rings.is_empty() {
                    let idx = ring % self.rings.len();
                    self.rings[idx].0.reset();
                    let r = &mut self.rings[idx].1;
                    r.entries.clear();
                    r.next_pos = 0;
                }
            }
            Op::Rollback { ring, n, mid_chunk } => {
                if self.rings.is_empty() {
                    return;
                }
                let idx = ring % self.rings.len();
                if mid_chunk {
                    self.rings[idx].0.begin(0).unwrap();
                    assert_eq!(
                        self.rings[idx].0.rollback(n),
                        Err(KvError::ChunkPending { pending: 0 })
                    );
                    self.rings[idx].0.commit().unwrap();
                    return;
                }
                let want = self.rings[idx].1.rollback(n);
                assert_eq!(self.rings[idx].0.rollback(n), want, "rollback({n})");
            }
            Op::Grow {
                ring,
                extra,
                mid_chunk,
            } => {
                if self.rings.is_empty() {
                    return;
                }
                let idx = ring % self.rings.len();
                let cap = self.rings[idx].1.cap;
                if mid_chunk {
                    // begin(0) never evicts nor fails on a committed ring.
                    self.rings[idx].0.begin(0).unwrap();
                    assert_eq!(
                        self.rings[idx].0.grow(cap + extra.max(1)),
                        Err(KvError::ChunkPending { pending: 0 })
                    );
                    self.rings[idx].0.commit().unwrap();
                    return;
                }
                let bytes = extra * self.shape.bytes_per_token();
                let used = self.expected_used();
                let want = if used + bytes > self.pool.budget_bytes() {
                    Err(KvError::OverBudget {
                        requested: bytes,
                        used,
                        budget: self.pool.budget_bytes(),
                    })
                } else {
                    Ok(())
                };
                assert_eq!(self.rings[idx].0.grow(cap + extra), want);
                if want.is_ok() {
                    self.rings[idx].1.cap = cap + extra;
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn matches_vecdeque_reference(
        shape in shape_strategy(),
        budget_tokens in 0..=40usize,
        slack in 0..64usize,
        ops in proptest::collection::vec(op_strategy(), 1..60),
    ) {
        let pool = KvPool::new(shape, budget_tokens * shape.bytes_per_token() + slack).unwrap();
        let mut h = Harness { shape, pool, rings: Vec::new() };
        for op in ops {
            h.apply(op);
            h.check_all();
        }
        h.rings.clear();
        prop_assert_eq!(h.pool.used_bytes(), 0);
        let st = h.pool.stats();
        prop_assert_eq!(st.fresh_allocs + st.recycled_allocs, st.frees);
        // Grown buffers are recycled under their new size: allocations of that size reuse them.
        prop_assert!(h.pool.used_bytes() + h.pool.cached_bytes() <= h.pool.budget_bytes());
    }
}
