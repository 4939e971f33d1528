//! The [`KvStorage`] contract, on the host storage and on a second real host storage that keeps
//! every block in its own allocation (`ChunkedKv`): rings over both must behave identically
//! through appends, sliding eviction, growth (wrapped or not), forks and window layers, which
//! proves the ring only asks a storage for runs inside one block. Also the slot API a device
//! writer uses ([`KvRing::layer_slots`], [`KvRing::mark_layer_written`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::f16;
use kv_ring::{
    HostKv, HostKvStorage, KvBlock, KvBlockMut, KvDtype, KvError, KvPool, KvRing, KvShape,
    KvStorage, KvTensor, RingMode, StorageOp,
};

/// One allocation per block. The allocator counts the blocks it allocated (a real pool passes
/// it to every fresh buffer and growth).
#[derive(Debug)]
enum ChunkedKv {
    F32(Vec<Vec<f32>>),
    F16(Vec<Vec<f16>>),
}

fn chunks<T: Copy>(lens: &[usize], zero: T) -> Vec<Vec<T>> {
    lens.iter().map(|&n| vec![zero; n]).collect()
}

impl KvStorage for ChunkedKv {
    type Allocator = AtomicUsize;

    fn zeroed(
        allocator: &AtomicUsize,
        dtype: KvDtype,
        block_lens: &[usize],
    ) -> Result<Self, KvError> {
        allocator.fetch_add(block_lens.len(), Ordering::Relaxed);
        Ok(match dtype {
            KvDtype::F32 => Self::F32(chunks(block_lens, 0.0)),
            KvDtype::F16 => Self::F16(chunks(block_lens, f16::ZERO)),
            other => {
                return Err(KvError::StorageFailed {
                    op: StorageOp::Alloc,
                    bytes: 0,
                    reason: format!("no {other:?} blocks"),
                });
            }
        })
    }

    fn empty(dtype: KvDtype) -> Self {
        // Holds nothing, so any dtype may share the f32 variant.
        match dtype {
            KvDtype::F16 => Self::F16(Vec::new()),
            _ => Self::F32(Vec::new()),
        }
    }

    fn allocated_bytes(&self) -> usize {
        match self {
            Self::F32(c) => c.iter().map(|b| b.capacity() * 4).sum(),
            Self::F16(c) => c.iter().map(|b| b.capacity() * 2).sum(),
        }
    }

    fn grow_blocks(
        &mut self,
        allocator: &AtomicUsize,
        block_lens: &[usize],
    ) -> Result<(), KvError> {
        fn grow<T: Copy>(c: &mut [Vec<T>], lens: &[usize], zero: T) {
            assert_eq!(c.len(), lens.len());
            for (b, &n) in c.iter_mut().zip(lens) {
                assert!(n >= b.len(), "blocks only grow");
                b.reserve_exact(n - b.len());
                b.resize(n, zero);
            }
        }
        allocator.fetch_add(block_lens.len(), Ordering::Relaxed);
        match self {
            Self::F32(c) => grow(c, block_lens, 0.0),
            Self::F16(c) => grow(c, block_lens, f16::ZERO),
        }
        Ok(())
    }

    fn copy_within(
        &mut self,
        block: usize,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<(), KvError> {
        match self {
            Self::F32(c) => c[block].copy_within(src..src + len, dst),
            Self::F16(c) => c[block].copy_within(src..src + len, dst),
        }
        Ok(())
    }

    fn copy_from(
        &mut self,
        block: usize,
        dst: usize,
        other: &Self,
        src_block: usize,
        src: usize,
        len: usize,
    ) -> Result<(), KvError> {
        match (self, other) {
            (Self::F32(d), Self::F32(s)) => {
                d[block][dst..dst + len].copy_from_slice(&s[src_block][src..src + len]);
            }
            (Self::F16(d), Self::F16(s)) => {
                d[block][dst..dst + len].copy_from_slice(&s[src_block][src..src + len]);
            }
            _ => panic!("mixed dtypes"),
        }
        Ok(())
    }
}

impl HostKvStorage for ChunkedKv {
    fn block(&self, block: usize) -> Option<KvBlock<'_>> {
        Some(match self {
            Self::F32(c) => KvBlock::F32(&c[block]),
            Self::F16(c) => KvBlock::F16(&c[block]),
        })
    }

    fn block_mut(&mut self, block: usize) -> Option<KvBlockMut<'_>> {
        Some(match self {
            Self::F32(c) => KvBlockMut::F32(&mut c[block]),
            Self::F16(c) => KvBlockMut::F16(&mut c[block]),
        })
    }
}

/// A storage whose elements are "elsewhere" (as a device ring's are): the blocks of a
/// [`ChunkedKv`] the ring may copy but never sees as host slices.
#[derive(Debug)]
struct ElsewhereKv(ChunkedKv);

impl KvStorage for ElsewhereKv {
    type Allocator = AtomicUsize;

    fn zeroed(a: &AtomicUsize, dtype: KvDtype, block_lens: &[usize]) -> Result<Self, KvError> {
        ChunkedKv::zeroed(a, dtype, block_lens).map(Self)
    }

    fn empty(dtype: KvDtype) -> Self {
        Self(ChunkedKv::empty(dtype))
    }

    fn allocated_bytes(&self) -> usize {
        self.0.allocated_bytes()
    }

    fn grow_blocks(&mut self, a: &AtomicUsize, block_lens: &[usize]) -> Result<(), KvError> {
        self.0.grow_blocks(a, block_lens)
    }

    fn copy_within(&mut self, b: usize, src: usize, dst: usize, len: usize) -> Result<(), KvError> {
        self.0.copy_within(b, src, dst, len)
    }

    fn copy_from(
        &mut self,
        b: usize,
        dst: usize,
        other: &Self,
        src_block: usize,
        src: usize,
        len: usize,
    ) -> Result<(), KvError> {
        self.0.copy_from(b, dst, &other.0, src_block, src, len)
    }
}

impl HostKvStorage for ElsewhereKv {
    fn block(&self, _: usize) -> Option<KvBlock<'_>> {
        None
    }

    fn block_mut(&mut self, _: usize) -> Option<KvBlockMut<'_>> {
        None
    }
}

fn block_f32<S: HostKvStorage>(s: &S, b: usize) -> Vec<f32> {
    match s.block(b).expect("host storage") {
        KvBlock::F32(x) => x.to_vec(),
        KvBlock::F16(x) => x.iter().map(|v| v.to_f32()).collect(),
        _ => unreachable!(),
    }
}

fn fill<S: HostKvStorage>(s: &mut S, b: usize, seed: f32) {
    match s.block_mut(b).expect("host storage") {
        KvBlockMut::F32(x) => x
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = seed + i as f32),
        KvBlockMut::F16(x) => x
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = f16::from_f32(seed + i as f32)),
        _ => unreachable!(),
    }
}

/// The contract on one storage type: exact bytes, growth keeps each block's prefix, copies act
/// like `memmove` inside a block and like `memcpy` between storages.
fn storage_contract<S: HostKvStorage>(alloc: &S::Allocator) {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let lens = [8, 12, 4];
        let mut s = S::zeroed(alloc, dtype, &lens).unwrap();
        assert_eq!(Some(s.allocated_bytes()), dtype.bytes_for(24));
        for (b, &n) in lens.iter().enumerate() {
            assert_eq!(block_f32(&s, b), vec![0.0; n], "block {b} starts zeroed");
            fill(&mut s, b, 100.0 * b as f32);
        }
        let before: Vec<Vec<f32>> = (0..3).map(|b| block_f32(&s, b)).collect();

        s.grow_blocks(alloc, &[10, 20, 4]).unwrap();
        assert_eq!(
            Some(s.allocated_bytes()),
            dtype.bytes_for(34),
            "exact growth"
        );
        for (b, old) in before.iter().enumerate() {
            assert_eq!(
                &block_f32(&s, b)[..old.len()],
                &old[..],
                "block {b} keeps its prefix"
            );
        }
        assert_eq!(block_f32(&s, 1).len(), 20);

        // Overlapping moves, both directions, inside block 1 only.
        let mut model = block_f32(&s, 1);
        s.copy_within(1, 0, 3, 9).unwrap();
        model.copy_within(0..9, 3);
        assert_eq!(block_f32(&s, 1), model);
        s.copy_within(1, 5, 2, 6).unwrap();
        model.copy_within(5..11, 2);
        assert_eq!(block_f32(&s, 1), model);
        assert_eq!(
            &block_f32(&s, 0)[..8],
            &before[0][..],
            "other blocks untouched"
        );
        assert_eq!(block_f32(&s, 2), before[2]);

        let mut t = S::zeroed(alloc, dtype, &[6, 6]).unwrap();
        t.copy_from(1, 2, &s, 2, 1, 3).unwrap();
        assert_eq!(block_f32(&t, 1), [0.0, 0.0, 201.0, 202.0, 203.0, 0.0]);
        assert_eq!(block_f32(&t, 0), vec![0.0; 6]);

        let e = S::empty(dtype);
        assert_eq!(e.allocated_bytes(), 0);
    }
}

#[test]
fn host_storage_meets_the_contract() {
    storage_contract::<HostKv>(&());
}

#[test]
fn chunked_storage_meets_the_contract() {
    storage_contract::<ChunkedKv>(&AtomicUsize::new(0));
}

const LAYERS: usize = 3;
const HEADS: usize = 2;
const HD: usize = 4;

/// Rows for `n` tokens from position `pos`: distinct values per (token, head, element, K/V).
fn rows(pos: u64, n: usize, layer: usize, v: bool) -> Vec<f32> {
    (0..n * HEADS * HD)
        .map(|i| {
            let t = pos as usize + i / (HEADS * HD);
            (t * 64 + (i % (HEADS * HD)) * 2 + layer * 1000 + usize::from(v)) as f32 % 2048.0
        })
        .collect()
}

fn append<S: HostKvStorage>(ring: &mut KvRing<S>, n: usize) -> Result<(), KvError> {
    ring.begin(n)?;
    let pos = ring.next_pos();
    for layer in (0..LAYERS).rev() {
        ring.write_layer(
            layer,
            &rows(pos, n, layer, false),
            &rows(pos, n, layer, true),
        )?;
    }
    ring.commit()
}

fn views<S: HostKvStorage>(ring: &KvRing<S>) -> Vec<(usize, Vec<f32>, Vec<f32>)> {
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            let v = ring.view(layer, head).unwrap();
            out.push((v.len, v.keys.to_f32_vec(), v.values.to_f32_vec()));
        }
    }
    out
}

/// Runs one script of operations on a ring of each storage and compares every view after
/// every step. Returns whether some view ended up wrapped (two runs).
fn same_behaviour(pools: (Arc<KvPool>, Arc<KvPool<ChunkedKv>>), mode: RingMode) -> bool {
    let (host_pool, chunked_pool) = pools;
    let mut host = host_pool.alloc(6, mode).unwrap();
    let mut chunked = chunked_pool.alloc(6, mode).unwrap();
    let mut forks = Vec::new();
    // Chunk sizes; 0 means grow by 5, 9 means fork the first 2 positions.
    let script = [3, 2, 1, 0, 4, 1, 3, 9, 2, 2, 0, 1, 5, 1, 9, 3, 1];
    for (step, &op) in script.iter().enumerate() {
        let (a, b) = match op {
            0 => (
                host.grow(host.capacity() + 5),
                chunked.grow(chunked.capacity() + 5),
            ),
            9 => {
                let (a, b) = (host.fork(2), chunked.fork(2));
                assert_eq!(a.is_ok(), b.is_ok(), "step {step}: fork");
                if let (Ok(a), Ok(b)) = (a, b) {
                    assert_eq!(views(&a), views(&b), "step {step}: forked views");
                    forks.push((a, b));
                }
                (Ok(()), Ok(()))
            }
            n => (append(&mut host, n), append(&mut chunked, n)),
        };
        assert_eq!(a, b, "step {step}: same result");
        assert_eq!(
            (host.len(), host.next_pos()),
            (chunked.len(), chunked.next_pos())
        );
        for layer in 0..LAYERS {
            assert_eq!(host.layer_len(layer), chunked.layer_len(layer));
        }
        assert_eq!(views(&host), views(&chunked), "step {step}: views");
        assert_eq!(host.allocated_bytes(), chunked.allocated_bytes());
        assert_eq!(host_pool.used_bytes(), chunked_pool.used_bytes());
    }
    (0..LAYERS).any(|l| host.view(l, 0).unwrap().keys.part_lens()[1] > 0)
}

fn shape(dtype: KvDtype) -> KvShape {
    KvShape::new(LAYERS, HEADS, HD, dtype)
}

#[test]
fn rings_over_chunked_storage_match_host_rings_in_sliding_mode() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let s = shape(dtype);
        let pools = (
            KvPool::new(s, 1 << 20).unwrap(),
            KvPool::new_in(s, 1 << 20, AtomicUsize::new(0)).unwrap(),
        );
        assert!(
            same_behaviour(pools, RingMode::Sliding { sinks: 2 }),
            "wrapped"
        );
    }
}

#[test]
fn rings_over_chunked_storage_match_host_rings_in_strict_mode() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let s = shape(dtype);
        let pools = (
            KvPool::new(s, 1 << 20).unwrap(),
            KvPool::new_in(s, 1 << 20, AtomicUsize::new(0)).unwrap(),
        );
        same_behaviour(pools, RingMode::Strict);
    }
}

#[test]
fn rings_over_chunked_storage_match_host_rings_with_window_layers() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let s = shape(dtype);
        let windows = vec![Some(3), None, Some(2)];
        let pools = (
            KvPool::with_layer_windows(s, 1 << 20, windows.clone(), 5).unwrap(),
            KvPool::with_layer_windows_in(s, 1 << 20, windows, 5, AtomicUsize::new(0)).unwrap(),
        );
        assert!(
            same_behaviour(pools, RingMode::Strict),
            "window layers wrapped"
        );
    }
}

#[test]
fn the_pool_budgets_and_recycles_any_storage() {
    let s = shape(KvDtype::F16);
    let pool =
        KvPool::<ChunkedKv>::new_in(s, 10 * s.bytes_per_token(), AtomicUsize::new(0)).unwrap();
    let ring = pool.alloc(6, RingMode::Strict).unwrap();
    assert_eq!(pool.allocator().load(Ordering::Relaxed), 2 * LAYERS * HEADS);
    assert_eq!(pool.used_bytes(), 6 * s.bytes_per_token());
    assert!(matches!(
        pool.alloc(5, RingMode::Strict),
        Err(KvError::OverBudget { .. })
    ));
    drop(ring);
    assert_eq!(
        (pool.used_bytes(), pool.cached_bytes()),
        (0, 6 * s.bytes_per_token())
    );
    let again = pool.alloc(6, RingMode::Strict).unwrap();
    assert_eq!(
        pool.allocator().load(Ordering::Relaxed),
        2 * LAYERS * HEADS,
        "a recycled buffer, no new allocation"
    );
    assert_eq!(pool.stats().recycled_allocs, 1);
    drop(again);
    assert_eq!(pool.trim(), 6 * s.bytes_per_token());
}

/// What a device executor does: write the pending rows itself at the slots the ring names, then
/// mark the layer written. The views must equal those of `write_layer`.
#[test]
fn an_owner_writing_at_layer_slots_matches_write_layer() {
    let s = shape(KvDtype::F32);
    let pool = KvPool::new(s, 1 << 20).unwrap();
    let mut by_ring = pool.alloc(5, RingMode::Sliding { sinks: 1 }).unwrap();
    let mut by_owner = pool.alloc(5, RingMode::Sliding { sinks: 1 }).unwrap();
    for n in [3, 2, 2, 1, 3, 1] {
        append(&mut by_ring, n).unwrap();
        by_owner.begin(n).unwrap();
        let pos = by_owner.next_pos();
        for layer in 0..LAYERS {
            let slots = by_owner.layer_slots(layer).unwrap();
            assert_eq!(
                (slots.pending, slots.rows),
                (n, slots.committed),
                "not yet written"
            );
            for (t, tensor) in [KvTensor::K, KvTensor::V].into_iter().enumerate() {
                let src = rows(pos, n, layer, t == 1);
                for head in 0..HEADS {
                    let b = by_owner.block_index(layer, head, tensor);
                    let Some(KvBlockMut::F32(block)) = by_owner.storage_mut().block_mut(b) else {
                        unreachable!()
                    };
                    for i in 0..n {
                        let d = slots.slot(slots.committed + i) * HD;
                        let from = (i * HEADS + head) * HD;
                        block[d..d + HD].copy_from_slice(&src[from..from + HD]);
                    }
                }
            }
            by_owner.mark_layer_written(layer).unwrap();
            assert_eq!(
                by_owner.layer_slots(layer).unwrap().rows,
                slots.committed + n
            );
        }
        by_owner.commit().unwrap();
        assert_eq!(views(&by_ring), views(&by_owner));
    }
    assert!(by_owner.evicted() > 0, "the script evicted");
    assert_eq!(by_owner.mark_layer_written(0), Err(KvError::NoPendingChunk));
    by_owner.begin(1).unwrap();
    assert!(matches!(
        by_owner.mark_layer_written(LAYERS),
        Err(KvError::LayerOutOfRange { .. })
    ));
    assert!(matches!(
        by_owner.commit(),
        Err(KvError::LayerNotWritten { layer: 0, .. })
    ));
}

/// A storage that does not keep its elements in host memory refuses host writes and views with
/// a typed error, writing nothing; its owner writes at the slots and the bookkeeping goes on.
#[test]
fn a_ring_not_in_host_memory_refuses_host_writes_and_views() {
    let s = shape(KvDtype::F32);
    let pool = KvPool::<ElsewhereKv>::new_in(s, 1 << 20, AtomicUsize::new(0)).unwrap();
    let mut ring = pool.alloc(4, RingMode::Strict).unwrap();
    ring.begin(1).unwrap();
    let (k, v) = (rows(0, 1, 0, false), rows(0, 1, 0, true));
    assert_eq!(ring.write_layer(0, &k, &v), Err(KvError::NotInHostMemory));
    assert_eq!(
        ring.layer_slots(0).unwrap().rows,
        0,
        "nothing marked written"
    );
    assert_eq!(ring.view(0, 0).err(), Some(KvError::NotInHostMemory));
    for layer in 0..LAYERS {
        ring.mark_layer_written(layer).unwrap();
    }
    ring.commit().unwrap();
    assert_eq!((ring.len(), ring.next_pos()), (1, 1));
}
