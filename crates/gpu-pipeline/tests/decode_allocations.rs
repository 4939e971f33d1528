//! The decode path does not allocate: once its buffers have grown, a forward call of one
//! sequence (single-token kernels) or of a batch of 24 (many-token kernels, parallel
//! element-wise work) makes no heap allocation on any thread. Needs the default model
//! (`scripts/fetch-model`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use gpu_pipeline::{LogitsWanted, Model, ModelOptions, SeqStep};
use kv_ring::{KvDtype, KvPool, KvRing, RingMode};

/// Counts allocations on every thread of this test binary.
struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by `N` sequences' decode steps 4..8 (steps 1..3 grow the buffers).
fn decode_allocations<const N: usize>(model: &Model, pool: &Arc<KvPool>) -> usize {
    let mut rings: [KvRing; N] = std::array::from_fn(|_| pool.alloc(64, RingMode::Strict).unwrap());
    let toks: [[u32; 1]; N] = std::array::from_fn(|i| [(100 + 7 * i) as u32]);
    let mut logits = Vec::new();
    let mut before = 0;
    for i in 0..8 {
        if i == 3 {
            before = ALLOCS.load(Ordering::SeqCst);
        }
        let mut k = 0;
        let mut steps = rings.each_mut().map(|kv| {
            k += 1;
            SeqStep {
                tokens: &toks[k - 1][..],
                kv,
                logits: LogitsWanted::Last,
            }
        });
        model.forward(&mut steps, &mut logits).unwrap();
    }
    ALLOCS.load(Ordering::SeqCst) - before
}

#[test]
fn decode_steps_make_no_heap_allocation() {
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the model file is not modified while the test runs.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }.expect("open"));
    let model = Model::load(gguf, ModelOptions::default().with_threads(2)).unwrap();
    let pool = KvPool::new(model.kv_shape(KvDtype::F16), 256 << 20).unwrap();
    let one = decode_allocations::<1>(&model, &pool);
    let many = decode_allocations::<24>(&model, &pool);
    assert_eq!(
        (one, many),
        (0, 0),
        "allocations in 5 decode steps of 1 and of 24 sequences"
    );
}
