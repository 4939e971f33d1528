//! The decode path does not allocate: once its buffers have grown, a forward call of one
//! sequence (single-token kernels) or of a batch of 24 (many-token kernels, parallel
//! element-wise work) makes no heap allocation on any thread. Needs the default model
//! (`scripts/fetch-model`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

#[path = "../benches/support/synthetic.rs"]
mod synthetic;

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

/// The counter is global: the tests of this binary run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Allocations made by 5 decode steps of `N` sequences once their buffers have grown.
///
/// Warm-up: steps run until 8 in a row allocate nothing (at most 80). A pool worker grows its
/// own thread-local scratch the first time it runs a task of a kind, and on a loaded machine it
/// may get no task at all for several steps (the caller takes them all), so a fixed number of
/// warm-up steps left a worker's first-time growth inside the measured steps now and then (and
/// 3 quiet steps were not enough either: seen once here with two compilers running beside the
/// test, a Gemma 3 worker's first panel task 2 allocations late).
fn decode_allocations<const N: usize>(model: &Model, pool: &Arc<KvPool>) -> usize {
    let mut rings: [KvRing; N] = std::array::from_fn(|_| pool.alloc(64, RingMode::Strict).unwrap());
    let vocab = model.config().vocab_size;
    let toks: [[u32; 1]; N] = std::array::from_fn(|i| [((100 + 7 * i) % vocab) as u32]);
    let mut logits = Vec::new();
    let mut step = |rings: &mut [KvRing; N]| {
        let before = ALLOCS.load(Ordering::SeqCst);
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
        ALLOCS.load(Ordering::SeqCst) - before
    };
    let mut quiet = 0;
    for _ in 0..80 {
        quiet = if step(&mut rings) == 0 { quiet + 1 } else { 0 };
        if quiet == 8 {
            break;
        }
    }
    (0..5).map(|_| step(&mut rings)).sum()
}

#[test]
fn decode_steps_make_no_heap_allocation() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let path = weight_cache::locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the model file is not modified while the test runs.
    let gguf = Arc::new(unsafe { weight_cache::Gguf::open(path) }.expect("open"));
    let model = Model::load(gguf, ModelOptions::default().with_threads(2)).unwrap();
    // Each thread grows its batched kernels' scratch once, the first time it runs one of their
    // tasks. Under a competing process the adaptive width may keep the worker out of every
    // warm-up step and let it back in later (measured here: 2-4 allocations in the 24-sequence
    // steps while another build ran); with every thread joining, the warm-up reaches them all.
    model.pool().set_adaptive(false);
    let pool = KvPool::new(model.kv_shape(KvDtype::F16), 256 << 20).unwrap();
    let one = decode_allocations::<1>(&model, &pool);
    let many = decode_allocations::<24>(&model, &pool);
    assert_eq!(
        (one, many),
        (0, 0),
        "allocations in 5 decode steps of 1 and of 24 sequences"
    );
}

/// The family features on the decode path (Gemma 3: Q/K norms, post-norms, GeGLU, local and
/// global RoPE, window layers on their own rows; Gemma 2: soft-caps) allocate nothing either.
#[test]
fn family_features_make_no_heap_allocation_when_decoding() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Big enough that every product splits into tasks for both threads (as the default model's
    // do): a worker's first task of a kind may set up thread-local state once.
    let dims = synthetic::Dims {
        n_embd: 512,
        n_ff: 1536,
        n_layers: 6,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
        vocab: 2048,
        ctx: 512,
    };
    // And the experts (router, top-k, grouping, expert products, shared expert).
    for arch in [
        "gemma3", "gemma2", "qwen3", "phi3", "qwen3moe", "olmoe", "qwen2moe",
    ] {
        let g = weight_cache::Gguf::from_bytes(synthetic::build(arch, dims, 5).build()).unwrap();
        let model = Model::load(Arc::new(g), ModelOptions::default().with_threads(2)).unwrap();
        let pool = KvPool::with_layer_windows(
            model.kv_shape(KvDtype::F16),
            64 << 20,
            model.kv_windows(),
            16,
        )
        .unwrap();
        let one = decode_allocations::<1>(&model, &pool);
        let many = decode_allocations::<24>(&model, &pool);
        assert_eq!(
            (one, many),
            (0, 0),
            "{arch}: allocations in 5 decode steps of 1 and of 24"
        );
    }
}
