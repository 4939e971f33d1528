//! A persistent thread pool for data-parallel kernels.
//!
//! Design goals, in order:
//! - no thread spawn per operation: workers live as long as the pool;
//! - low dispatch latency: an idle worker spins for a bounded time (about 50 µs) before it parks, so
//!   the back-to-back operations of a decode step find it awake;
//! - graceful under contention: tasks are claimed from an atomic counter (no static split), the
//!   calling thread takes tasks too, and a worker that has not joined an operation by the time all
//!   its tasks are claimed is simply not waited for. A worker descheduled by a competing process
//!   therefore delays an operation by at most the task it holds, and nobody spins for long.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker (or a caller waiting for stragglers) spins before it parks or yields.
const SPIN: Duration = Duration::from_micros(50);

type TaskFn<'a> = dyn Fn(usize, usize) + Sync + 'a;

thread_local! {
    /// The thread index inside a pool run, when this thread is executing pool tasks.
    static IN_POOL: Cell<Option<usize>> = const { Cell::new(None) };
}

struct Shared {
    /// Even: no operation open. Odd: an operation is open and its fields below are valid.
    epoch: AtomicUsize,
    /// Next task index to claim.
    next: AtomicUsize,
    /// Number of tasks of the open operation.
    n_tasks: AtomicUsize,
    /// Thin pointer to a `&TaskFn` living on the caller's stack while the operation is open.
    func: AtomicPtr<()>,
    /// Workers currently inside the open operation.
    active: AtomicUsize,
    /// Set when a task panicked on a worker.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Per worker: true while parked (or about to park).
    sleeping: Vec<AtomicBool>,
}

/// A persistent pool of worker threads that runs data-parallel operations.
///
/// `run(n_tasks, f)` calls `f(task, thread)` once for every `task` in `0..n_tasks`, spread over the
/// calling thread (thread index 0) and the workers (`1..n_threads`), and returns when all calls
/// have returned. Operations from several threads are serialised; a `run` nested inside a task runs
/// inline on the current thread.
///
/// ```
/// use gpu_pipeline::ThreadPool;
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// let pool = ThreadPool::new(2);
/// let sum = AtomicUsize::new(0);
/// pool.run(100, &|task, _thread| {
///     sum.fetch_add(task, Ordering::Relaxed);
/// });
/// assert_eq!(sum.into_inner(), 4950);
/// ```
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(Thread, JoinHandle<()>)>,
    run_lock: Mutex<()>,
    n_threads: usize,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

impl ThreadPool {
    /// A pool with `n_threads` threads in total, counting the caller of [`run`](Self::run):
    /// `n_threads - 1` workers are spawned. `0` means [`default_threads`](Self::default_threads).
    pub fn new(n_threads: usize) -> Self {
        let n_threads = if n_threads == 0 {
            Self::default_threads()
        } else {
            n_threads
        };
        let n_workers = n_threads - 1;
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            n_tasks: AtomicUsize::new(0),
            func: AtomicPtr::new(std::ptr::null_mut()),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: (0..n_workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let workers = (0..n_workers)
            .map(|w| {
                let shared = Arc::clone(&shared);
                let handle = thread::Builder::new()
                    .name(format!("zerolayer-worker-{}", w + 1))
                    .spawn(move || worker_loop(&shared, w))
                    .expect("failed to spawn a thread-pool worker");
                (handle.thread().clone(), handle)
            })
            .collect();
        Self {
            shared,
            workers,
            run_lock: Mutex::new(()),
            n_threads,
        }
    }

    /// The thread count used by [`new(0)`](Self::new) and [`global`](Self::global):
    /// `$ZEROLAYER_THREADS` if set to a positive integer, else `std::thread::available_parallelism`.
    pub fn default_threads() -> usize {
        std::env::var("ZEROLAYER_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// The process-wide pool, created on first use with [`default_threads`](Self::default_threads).
    pub fn global() -> &'static Self {
        static GLOBAL: OnceLock<ThreadPool> = OnceLock::new();
        GLOBAL.get_or_init(|| Self::new(0))
    }

    /// Threads that run tasks, the caller of [`run`](Self::run) included.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Calls `f(task, thread)` for every task in `0..n_tasks` and returns when all have returned.
    /// `thread` is in `0..n_threads()` and no two concurrent calls share it, so it can index
    /// per-thread scratch space. Tasks are claimed dynamically: their order and thread are not
    /// fixed. A panic in a task is propagated to the caller after all tasks have finished.
    pub fn run(&self, n_tasks: usize, f: &TaskFn<'_>) {
        if n_tasks == 0 {
            return;
        }
        if let Some(thread) = IN_POOL.with(Cell::get) {
            // Nested call from inside a task: run inline, keeping the thread index.
            (0..n_tasks).for_each(|t| f(t, thread));
            return;
        }
        let _serial = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.workers.is_empty() || n_tasks == 1 {
            IN_POOL.with(|c| c.set(Some(0)));
            let _reset = ResetInPool;
            (0..n_tasks).for_each(|t| f(t, 0));
            return;
        }
        let sh = &*self.shared;
        // Publish the operation. `fref` lives until `close` below has waited for every worker
        // that joined, so workers never see a dangling pointer.
        let fref: &TaskFn<'_> = f;
        sh.func
            .store((&raw const fref).cast_mut().cast(), Ordering::Relaxed);
        sh.n_tasks.store(n_tasks, Ordering::Relaxed);
        sh.next.store(0, Ordering::Relaxed);
        let epoch = sh.epoch.load(Ordering::Relaxed) + 1; // odd: open
        sh.epoch.store(epoch, Ordering::SeqCst);
        for (w, (thread, _)) in self.workers.iter().enumerate() {
            if sh.sleeping[w].load(Ordering::SeqCst) {
                thread.unpark();
            }
        }
        // Close the operation even if a task panics on this thread.
        let guard = CloseGuard { sh, epoch };
        IN_POOL.with(|c| c.set(Some(0)));
        let _reset = ResetInPool;
        run_tasks(sh, fref, 0);
        drop(guard);
        if sh.panicked.swap(false, Ordering::SeqCst) {
            resume_unwind(Box::new("a thread-pool task panicked on a worker thread"));
        }
    }
}

struct ResetInPool;

impl Drop for ResetInPool {
    fn drop(&mut self) {
        IN_POOL.with(|c| c.set(None));
    }
}

struct CloseGuard<'a> {
    sh: &'a Shared,
    epoch: usize,
}

impl Drop for CloseGuard<'_> {
    fn drop(&mut self) {
        let sh = self.sh;
        // No task can be claimed any more once `next >= n_tasks`; make sure of it if we unwind.
        sh.next.store(usize::MAX / 2, Ordering::SeqCst);
        sh.epoch.store(self.epoch + 1, Ordering::SeqCst); // even: closed
        // Wait for the workers that joined (they hold at most one task each).
        let start = Instant::now();
        let mut spins = 0u32;
        let mut yielding = false;
        while sh.active.load(Ordering::SeqCst) != 0 {
            spins = spins.wrapping_add(1);
            // The clock is read once per 64 spins: reading it every spin cost more than the
            // wait itself (clock_gettime was ~3% of a decode profile).
            if !yielding && spins.is_multiple_of(64) {
                yielding = start.elapsed() >= SPIN;
            }
            if yielding {
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        sh.func.store(std::ptr::null_mut(), Ordering::Relaxed);
    }
}

fn run_tasks(sh: &Shared, f: &TaskFn<'_>, thread: usize) {
    let n = sh.n_tasks.load(Ordering::Relaxed);
    loop {
        let t = sh.next.fetch_add(1, Ordering::Relaxed);
        if t >= n {
            break;
        }
        f(t, thread);
    }
}

fn worker_loop(sh: &Shared, w: usize) {
    let thread = w + 1;
    IN_POOL.with(|c| c.set(Some(thread)));
    let mut seen = sh.epoch.load(Ordering::SeqCst);
    loop {
        // Wait for a new epoch: spin for a bounded time, then park.
        let mut epoch = sh.epoch.load(Ordering::SeqCst);
        if epoch == seen {
            let start = Instant::now();
            let mut spins = 0u32;
            loop {
                epoch = sh.epoch.load(Ordering::SeqCst);
                if epoch != seen || sh.shutdown.load(Ordering::Relaxed) {
                    break;
                }
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(64) || start.elapsed() < SPIN {
                    std::hint::spin_loop();
                    continue;
                }
                sh.sleeping[w].store(true, Ordering::SeqCst);
                epoch = sh.epoch.load(Ordering::SeqCst);
                if epoch == seen && !sh.shutdown.load(Ordering::SeqCst) {
                    thread::park_timeout(Duration::from_millis(100));
                }
                sh.sleeping[w].store(false, Ordering::SeqCst);
            }
        }
        if sh.shutdown.load(Ordering::SeqCst) {
            return;
        }
        seen = epoch;
        if epoch.is_multiple_of(2) {
            continue; // an operation we missed entirely
        }
        // Join, then re-check the operation is still open: the closer stores the even epoch
        // before reading `active`, so either it waits for us or we see it closed.
        sh.active.fetch_add(1, Ordering::SeqCst);
        if sh.epoch.load(Ordering::SeqCst) == epoch {
            let ptr = sh.func.load(Ordering::Relaxed).cast::<&TaskFn<'_>>();
            // SAFETY: the operation is open (epoch checked after joining), so `func` points at the
            // caller's `&TaskFn`, which stays alive until `active` drops back to zero.
            let f: &TaskFn<'_> = unsafe { *ptr };
            if catch_unwind(AssertUnwindSafe(|| run_tasks(sh, f, thread))).is_err() {
                sh.panicked.store(true, Ordering::SeqCst);
            }
        }
        sh.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for (thread, _) in &self.workers {
            thread.unpark();
        }
        for (_, handle) in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        for threads in 1..=4 {
            let pool = ThreadPool::new(threads);
            for n in [0usize, 1, 2, 3, 17, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|t, th| {
                    assert!(th < threads);
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn many_back_to_back_runs_and_parking() {
        let pool = ThreadPool::new(3);
        let total = AtomicUsize::new(0);
        for i in 0..2000 {
            pool.run(5, &|t, _| {
                total.fetch_add(t, Ordering::Relaxed);
            });
            if i % 500 == 0 {
                thread::sleep(Duration::from_millis(2)); // let workers park
            }
        }
        assert_eq!(total.into_inner(), 2000 * 10);
    }

    #[test]
    fn nested_run_is_inline() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        pool.run(4, &|_, _| {
            pool.run(3, &|t, _| {
                total.fetch_add(t + 1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.into_inner(), 4 * 6);
    }

    #[test]
    fn concurrent_callers_are_serialised() {
        let pool = Arc::new(ThreadPool::new(2));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    let total = AtomicUsize::new(0);
                    for _ in 0..200 {
                        pool.run(7, &|t, _| {
                            total.fetch_add(t, Ordering::Relaxed);
                        });
                    }
                    total.into_inner()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 200 * 21);
        }
    }

    #[test]
    fn worker_panic_propagates_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, &|t, _| {
                if t == 40 {
                    panic!("boom");
                }
            });
        }));
        assert!(r.is_err());
        let total = AtomicUsize::new(0);
        pool.run(10, &|t, _| {
            total.fetch_add(t, Ordering::Relaxed);
        });
        assert_eq!(total.into_inner(), 45);
    }
}
