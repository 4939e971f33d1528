//! A persistent thread pool for data-parallel kernels.
//!
//! Design goals, in order:
//! - no thread spawn per operation: workers live as long as the pool;
//! - low dispatch latency: an idle worker spins for a bounded time (about 50 µs) before it parks, so
//!   the back-to-back operations of a decode step find it awake;
//! - graceful under contention: tasks are claimed from an atomic counter (no static split), the
//!   calling thread takes tasks too, and a worker that has not joined an operation by the time all
//!   its tasks are claimed is simply not waited for. A worker descheduled by a competing process
//!   therefore delays an operation by at most the task it holds, and nobody spins for long;
//! - fewer threads when the CPU is oversubscribed (Linux): every ~20 ms the caller reads how long
//!   the workers waited on a run queue (`/proc/<pid>/task/<tid>/schedstat`). Above a fifth of the
//!   time in three windows in a row, a competing process holds a core, and the pool lets one
//!   thread fewer join operations (the excluded worker parks); once a second it tries one more
//!   for a window. Measured with one busy process on 2 cores (`zerolayer bench --gen-tokens 128
//!   --threads 2`, default model): decode at 0.54-0.55 of the idle speed with every thread
//!   joining, 0.59-0.64 adaptive. `ZEROLAYER_ADAPTIVE_THREADS=0` or
//!   [`ThreadPool::set_adaptive`] turns it off.
//!   Results do not depend on how many threads ran an operation.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker (or a caller waiting for stragglers) spins before it parks or yields.
const SPIN: Duration = Duration::from_micros(50);

/// Length of one run-queue measurement window of the adaptive width.
const WINDOW: Duration = Duration::from_millis(20);
/// Share of a window the joined workers may wait on a run queue before the width shrinks.
const CONTENDED: f64 = 0.2;
/// Consecutive contended windows before the width shrinks (a competitor that runs for a moment,
/// such as a short command, does not count).
const STRIKES: u32 = 3;
/// How long a reduced width holds before one more thread is tried again.
const PROBE_EVERY: Duration = Duration::from_secs(1);

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
    /// Threads that may join operations, the caller included (`1..=n_threads`): workers
    /// `width - 1..` park instead.
    width: AtomicUsize,
    /// Per worker: its `schedstat` file, set by the worker when it starts (Linux).
    stat_paths: Vec<OnceLock<std::path::PathBuf>>,
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
    /// Serialises operations; holds the adaptive width's state.
    run_lock: Mutex<Adapt>,
    n_threads: usize,
}

/// The adaptive width's controller state (see the module docs), owned by the running caller.
#[derive(Debug)]
struct Adapt {
    enabled: bool,
    /// Operations since the last clock read.
    ops: u32,
    /// Start of the current window and how many workers joined operations in it.
    window: Option<(Instant, usize)>,
    /// Each worker's run-queue wait (ns) at the start of the window (allocated once: this runs
    /// on the decode path, which must not allocate).
    base: Vec<Option<u64>>,
    /// When a reduced width next tries one more thread.
    probe_at: Option<Instant>,
    /// Consecutive contended windows so far.
    strikes: u32,
}

/// The width after a window in which the joined workers waited `frac` of the time on a run
/// queue, `strikes` being the contended windows in a row before this one; returns the width and
/// the new count. One thread fewer after [`STRIKES`] contended windows in a row, one more (a
/// probe) when `probe_due` and this window was not contended, else unchanged; always in
/// `1..=full`.
fn next_width(
    width: usize,
    full: usize,
    frac: Option<f64>,
    strikes: u32,
    probe_due: bool,
) -> (usize, u32) {
    match frac {
        Some(f) if f > CONTENDED => {
            if strikes + 1 >= STRIKES {
                (width.saturating_sub(1).max(1), 0)
            } else {
                (width.clamp(1, full), strikes + 1)
            }
        }
        _ if probe_due && width < full => (width + 1, 0),
        _ => (width.clamp(1, full), 0),
    }
}

/// Run-queue wait (ns) in a `schedstat` file (`cpu_ns wait_ns slices`), read without allocating.
fn read_wait(path: &std::path::Path) -> Option<u64> {
    use std::io::Read;
    let mut buf = [0u8; 96];
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = 0;
    while len < buf.len() {
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(k) => len += k,
            Err(_) => return None,
        }
    }
    let text = std::str::from_utf8(&buf[..len]).ok()?;
    text.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// This thread's `schedstat` file (Linux), from `/proc/thread-self`.
fn own_stat_path() -> Option<std::path::PathBuf> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    let path = std::path::Path::new("/proc").join(link).join("schedstat");
    read_wait(&path).map(|_| path)
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
            width: AtomicUsize::new(n_threads),
            stat_paths: (0..n_workers).map(|_| OnceLock::new()).collect(),
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
            run_lock: Mutex::new(Adapt {
                enabled: std::env::var("ZEROLAYER_ADAPTIVE_THREADS").map_or(true, |v| v != "0"),
                ops: 0,
                window: None,
                base: vec![None; n_workers],
                probe_at: None,
                strikes: 0,
            }),
            n_threads,
        }
    }

    /// Turns the adaptive width on or off (on by default; `ZEROLAYER_ADAPTIVE_THREADS=0` turns
    /// it off for new pools). Off: every thread joins every operation again.
    pub fn set_adaptive(&self, on: bool) {
        let mut a = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        a.enabled = on;
        a.window = None;
        a.probe_at = None;
        a.strikes = 0;
        self.shared.width.store(self.n_threads, Ordering::SeqCst);
    }

    /// Threads that currently join operations (the caller included): [`n_threads`](Self::n_threads)
    /// unless the adaptive width has found the CPU oversubscribed (see the module docs).
    pub fn active_threads(&self) -> usize {
        self.shared.width.load(Ordering::Relaxed)
    }

    /// Ends a measurement window of the adaptive width if one is due (called with the run lock
    /// held, before an operation is published).
    fn adapt(&self, a: &mut Adapt) {
        a.ops = a.ops.wrapping_add(1);
        if !a.enabled || self.workers.is_empty() || !a.ops.is_multiple_of(64) {
            return;
        }
        let sh = &*self.shared;
        let now = Instant::now();
        let width = sh.width.load(Ordering::Relaxed);
        // The workers that join operations at this width (the caller's thread may change
        // between operations, so it is not measured).
        let waits = |w: usize| sh.stat_paths[w].get().and_then(|p| read_wait(p));
        // Opens a window at `now` over the workers that join at `width`: their waits so far.
        let open = |a: &mut Adapt, width: usize| {
            let joined = width.saturating_sub(1).min(self.workers.len());
            a.base
                .iter_mut()
                .take(joined)
                .enumerate()
                .for_each(|(w, b)| *b = waits(w));
            a.window = Some((now, joined));
        };
        let Some((start, measured)) = a.window else {
            open(a, width);
            return;
        };
        let elapsed = now.duration_since(start);
        if elapsed < WINDOW {
            return;
        }
        let (mut sum, mut count) = (0u64, 0u32);
        for (w, b) in a.base.iter().take(measured).enumerate() {
            if let (Some(b), Some(now_wait)) = (b, waits(w)) {
                sum += now_wait.saturating_sub(*b);
                count += 1;
            }
        }
        let frac = (count > 0).then(|| sum as f64 / f64::from(count) / elapsed.as_nanos() as f64);
        let probe_due = a.probe_at.is_none_or(|t| now >= t);
        let (next, strikes) = next_width(width, self.n_threads, frac, a.strikes, probe_due);
        a.strikes = strikes;
        if next < width {
            a.probe_at = Some(now + PROBE_EVERY);
        } else if next > width {
            a.probe_at = (next < self.n_threads).then_some(now + PROBE_EVERY);
            // A probe that finds the competitor still there ends after one window.
            a.strikes = STRIKES - 1;
        }
        sh.width.store(next, Ordering::SeqCst);
        open(a, next);
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
        let mut serial = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.workers.is_empty() || n_tasks == 1 {
            IN_POOL.with(|c| c.set(Some(0)));
            let _reset = ResetInPool;
            (0..n_tasks).for_each(|t| f(t, 0));
            return;
        }
        self.adapt(&mut serial);
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
        let joining = sh.width.load(Ordering::Relaxed).saturating_sub(1);
        for (w, (thread, _)) in self.workers.iter().enumerate().take(joining) {
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
    if let Some(p) = own_stat_path() {
        let _ = sh.stat_paths[w].set(p);
    }
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
                // A worker outside the adaptive width parks at once.
                let excluded = thread >= sh.width.load(Ordering::Relaxed);
                if !excluded && (!spins.is_multiple_of(64) || start.elapsed() < SPIN) {
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
        if epoch.is_multiple_of(2) || thread >= sh.width.load(Ordering::Relaxed) {
            continue; // an operation we missed entirely, or one we are not to join
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
    fn width_shrinks_under_contention_and_probes_back() {
        let last = STRIKES - 1;
        // Contended windows count up; the last strike takes one thread away, never below 1.
        assert_eq!(next_width(4, 4, Some(0.3), 0, false), (4, 1));
        assert_eq!(next_width(4, 4, Some(0.3), last, false), (3, 0));
        assert_eq!(next_width(2, 2, Some(0.9), last, true), (1, 0));
        assert_eq!(next_width(1, 2, Some(0.9), last, true), (1, 0));
        // A quiet window resets the count: a moment of contention does not add up.
        assert_eq!(next_width(2, 2, Some(0.01), last, false), (2, 0));
        // Not contended (or nothing measured): unchanged until a probe is due, then one more.
        assert_eq!(next_width(3, 4, Some(0.05), 0, false), (3, 0));
        assert_eq!(next_width(1, 2, None, 0, false), (1, 0));
        assert_eq!(next_width(1, 2, None, 0, true), (2, 0));
        assert_eq!(next_width(3, 4, Some(0.1), 0, true), (4, 0));
        assert_eq!(next_width(4, 4, Some(0.0), 0, true), (4, 0));
        // Exactly at the threshold is not contended.
        assert_eq!(next_width(2, 2, Some(CONTENDED), last, false), (2, 0));
    }

    #[test]
    fn excluded_workers_run_no_tasks_and_rejoin() {
        let pool = ThreadPool::new(3);
        pool.set_adaptive(false);
        pool.shared.width.store(1, Ordering::SeqCst);
        assert_eq!(pool.active_threads(), 1);
        for _ in 0..200 {
            let on_workers = AtomicUsize::new(0);
            let total = AtomicUsize::new(0);
            pool.run(64, &|t, th| {
                if th != 0 {
                    on_workers.fetch_add(1, Ordering::Relaxed);
                }
                total.fetch_add(t, Ordering::Relaxed);
            });
            assert_eq!(on_workers.into_inner(), 0);
            assert_eq!(total.into_inner(), 64 * 63 / 2);
        }
        // Widening again: every task still runs once, on any of the threads.
        pool.set_adaptive(false);
        assert_eq!(pool.active_threads(), 3);
        let hits: Vec<AtomicUsize> = (0..500).map(|_| AtomicUsize::new(0)).collect();
        pool.run(500, &|t, th| {
            assert!(th < 3);
            hits[t].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn schedstat_is_read_where_linux_has_it() {
        // On Linux the workers find their run-queue statistics; elsewhere the width never adapts.
        let pool = ThreadPool::new(2);
        if std::path::Path::new("/proc/thread-self/schedstat").exists() {
            // The worker records its path as it starts (wait for that, however slow the host).
            let deadline = Instant::now() + Duration::from_secs(30);
            while pool.shared.stat_paths[0].get().is_none() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(1));
            }
            let p = pool.shared.stat_paths[0]
                .get()
                .expect("worker schedstat path");
            assert!(read_wait(p).is_some());
        }
        assert_eq!(
            read_wait(std::path::Path::new("/nonexistent/schedstat")),
            None
        );
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
