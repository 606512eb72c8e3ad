//! A persistent worker pool for data-parallel kernels.
//!
//! [`ThreadPool::parallel_for`] hands out task indices from one shared counter; the calling
//! thread works too. Workers spin briefly between jobs (a decode step issues hundreds of small
//! jobs back to back) and park once idle, so a call in the common case costs no allocation and
//! no system call. The caller never waits for a worker that has not joined the job: on a busy
//! machine a descheduled worker is simply left out. This module owns only scheduling: it
//! knows nothing about the kernels it runs.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins on the job counter before it parks.
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(1500);
/// Spins between clock reads while waiting.
const SPINS_PER_CLOCK_READ: u32 = 128;

/// Keeps a hot atomic on its own cache line(s) so the threads do not false-share.
#[repr(align(128))]
struct Padded<T>(T);

/// A type-erased pointer to the closure of the job in flight.
type JobFn = *const (dyn Fn(usize) + Sync + 'static);

#[derive(Clone, Copy)]
struct Job {
    f: Option<JobFn>,
    n_tasks: usize,
}

/// Job epochs: even values are open jobs, odd values closed ones (no one may join).
fn is_open(epoch: u64) -> bool {
    epoch.is_multiple_of(2)
}

struct Shared {
    /// The current job's epoch: set to a new even value when a job opens, +1 when it closes.
    epoch: Padded<AtomicU64>,
    /// Next task index to hand out.
    next: Padded<AtomicUsize>,
    /// Workers inside a job (they may read `job` and run tasks).
    active: Padded<AtomicUsize>,
    /// Written only by the thread holding `busy`, while the job is closed and `active == 0`.
    job: UnsafeCell<Job>,
    /// Set while a job runs; a nested or concurrent call finds it set and runs inline.
    busy: AtomicBool,
    shutdown: AtomicBool,
    /// A task panicked on a worker during the current job.
    worker_panicked: AtomicBool,
    /// One flag per worker: set while that worker is (about to be) parked.
    sleeping: Vec<AtomicBool>,
}

// SAFETY: `job` is the only non-Sync field. The `busy` holder writes it only after closing the
// previous job and observing `active == 0`, then opens the new epoch (SeqCst). A worker reads it
// only after incrementing `active` and then seeing an open epoch (both SeqCst), so the writer
// cannot start the next write before that worker decrements `active`. The closure is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw closure pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A fixed set of worker threads that run [`ThreadPool::parallel_for`] jobs.
pub struct ThreadPool {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
    handles: Vec<JoinHandle<()>>,
}

impl ThreadPool {
    /// Starts a pool of `n_threads` threads in total: the caller of `parallel_for` counts as one,
    /// so `n_threads - 1` workers are spawned (`0` is treated as `1`). If the OS refuses to
    /// spawn a thread the pool runs with the threads it got; [`ThreadPool::n_threads`] tells.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_workers = n_threads.max(1) - 1;
        let shared = Arc::new(Shared {
            epoch: Padded(AtomicU64::new(1)),
            next: Padded(AtomicUsize::new(0)),
            active: Padded(AtomicUsize::new(0)),
            job: UnsafeCell::new(Job {
                f: None,
                n_tasks: 0,
            }),
            busy: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            worker_panicked: AtomicBool::new(false),
            sleeping: (0..n_workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let mut threads = Vec::with_capacity(n_workers);
        let mut handles = Vec::with_capacity(n_workers);
        for idx in 0..n_workers {
            let s = Arc::clone(&shared);
            let spawned = thread::Builder::new()
                .name(format!("deepinfer-cpu-{}", idx + 1))
                .spawn(move || worker_main(&s, idx));
            match spawned {
                Ok(h) => {
                    threads.push(h.thread().clone());
                    handles.push(h);
                }
                Err(e) => {
                    tracing::warn!("could not spawn CPU worker thread {}: {e}", idx + 1);
                    break;
                }
            }
        }
        ThreadPool {
            shared,
            threads,
            handles,
        }
    }

    /// Threads that run a job, the caller included.
    pub fn n_threads(&self) -> usize {
        self.threads.len() + 1
    }

    /// Runs f(i) for every i in 0..n_tasks across the pool; the caller participates; returns
    /// when all are done. Each index runs exactly once, in no particular order or thread.
    ///
    /// A call made while the pool is already running a job (from inside a task, or from another
    /// thread) runs its tasks inline on the calling thread.
    ///
    /// # Panics
    /// If a task panics, the panic is resumed on the caller once every thread has let go of `f`.
    pub fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        let s = &*self.shared;
        if n_tasks == 1
            || self.threads.is_empty()
            || s.busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            (0..n_tasks).for_each(f);
            return;
        }
        // SAFETY: only the lifetime is erased. Workers dereference the pointer only while
        // counted in `active`, and this function does not return before `active` is zero with
        // the job closed.
        let erased: JobFn = unsafe {
            std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f)
        };
        // SAFETY: we hold `busy`; the previous job was closed and `active` seen zero, so no
        // worker reads `job` now (see `Shared`).
        unsafe {
            *s.job.get() = Job {
                f: Some(erased),
                n_tasks,
            }
        };
        s.next.0.store(0, Ordering::Relaxed);
        let open = s.epoch.0.load(Ordering::Relaxed) + 1;
        s.epoch.0.store(open, Ordering::SeqCst);
        for (flag, t) in s.sleeping.iter().zip(&self.threads) {
            if flag.load(Ordering::SeqCst) {
                t.unpark();
            }
        }

        let mine = catch_unwind(AssertUnwindSafe(|| run_tasks(&s.next.0, n_tasks, f)));
        // Every task is claimed (or we panicked): close the job, then wait for the workers
        // that joined it to finish their tasks.
        s.epoch.0.store(open + 1, Ordering::SeqCst);
        wait_until(|| s.active.0.load(Ordering::SeqCst) == 0);
        let worker_panicked = s.worker_panicked.swap(false, Ordering::Relaxed);
        s.busy.store(false, Ordering::Release);
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        if worker_panicked {
            panic!("a ThreadPool task panicked on a worker thread");
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for t in &self.threads {
            t.unpark();
        }
        for h in self.handles.drain(..) {
            // A worker never panics outside `catch_unwind`; nothing useful to report if it did.
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads())
            .finish()
    }
}

/// Claims and runs tasks until the counter passes `n_tasks`.
fn run_tasks(next: &AtomicUsize, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n_tasks {
            return;
        }
        f(i);
    }
}

/// Spins until `done()` holds, yielding the CPU if that takes long (an oversubscribed machine).
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins = spins.saturating_add(1);
        if spins < 1 << 12 {
            std::hint::spin_loop();
        } else {
            thread::yield_now();
        }
    }
}

fn worker_main(s: &Shared, idx: usize) {
    let mut seen = s.epoch.0.load(Ordering::Relaxed);
    while let Some(epoch) = wait_for_job(s, idx, seen) {
        seen = epoch;
        s.active.0.fetch_add(1, Ordering::SeqCst);
        // Re-check after announcing ourselves: the caller may have closed the job meanwhile
        // (then it may not wait for us, so we must not touch the job), or opened a newer one.
        let now = s.epoch.0.load(Ordering::SeqCst);
        if is_open(now) {
            seen = now;
            // SAFETY: we are counted in `active` and saw the epoch open, so the job stays as
            // written until we decrement `active` (see `Shared`).
            let job = unsafe { *s.job.get() };
            if let Some(ptr) = job.f {
                // SAFETY: the caller of `parallel_for` keeps the closure alive until `active`
                // is zero, which cannot happen before our decrement below.
                let f = unsafe { &*ptr };
                let run = catch_unwind(AssertUnwindSafe(|| run_tasks(&s.next.0, job.n_tasks, f)));
                if run.is_err() {
                    s.worker_panicked.store(true, Ordering::Relaxed);
                }
            }
        }
        s.active.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits for an open epoch other than `seen`: spins for a while, then parks. `None` on
/// shutdown.
fn wait_for_job(s: &Shared, idx: usize, seen: u64) -> Option<u64> {
    let ready = |e: u64| e != seen && is_open(e);
    let mut start: Option<Instant> = None;
    let mut spins = 0u32;
    loop {
        if s.shutdown.load(Ordering::Acquire) {
            return None;
        }
        let e = s.epoch.0.load(Ordering::Acquire);
        if ready(e) {
            return Some(e);
        }
        spins += 1;
        if spins < SPINS_PER_CLOCK_READ {
            std::hint::spin_loop();
            continue;
        }
        spins = 0;
        let t0 = *start.get_or_insert_with(Instant::now);
        if t0.elapsed() < SPIN_BEFORE_PARK {
            continue;
        }
        // Announce the nap, then re-check: either we see the new epoch here, or the caller sees
        // our flag after its SeqCst epoch store and unparks us (an early unpark is remembered).
        s.sleeping[idx].store(true, Ordering::SeqCst);
        if !ready(s.epoch.0.load(Ordering::SeqCst)) && !s.shutdown.load(Ordering::SeqCst) {
            thread::park();
        }
        s.sleeping[idx].store(false, Ordering::Relaxed);
        start = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visit_counts(pool: &ThreadPool, n: usize) -> Vec<usize> {
        let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool.parallel_for(n, &|i| {
            counts[i].fetch_add(1, Ordering::Relaxed);
        });
        counts.into_iter().map(AtomicUsize::into_inner).collect()
    }

    #[test]
    fn every_index_runs_exactly_once() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            assert_eq!(pool.n_threads(), threads);
            for n in [0, 1, 2, 3, 7, 64, 1000, 20_000] {
                let counts = visit_counts(&pool, n);
                assert_eq!(counts.len(), n);
                assert!(counts.iter().all(|&c| c == 1), "threads {threads} n {n}");
            }
        }
    }

    #[test]
    fn zero_threads_means_one() {
        let pool = ThreadPool::new(0);
        assert_eq!(pool.n_threads(), 1);
        assert_eq!(visit_counts(&pool, 5), vec![1; 5]);
    }

    #[test]
    fn many_sequential_calls_sum_correctly() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            let n = round % 9;
            pool.parallel_for(n, &|i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
        }
        let expected: usize = (0..2000).map(|r| (1..=r % 9).sum::<usize>()).sum();
        assert_eq!(total.load(Ordering::Relaxed), expected);
    }

    #[test]
    fn nested_calls_run_inline() {
        let pool = ThreadPool::new(3);
        let counts: Vec<AtomicUsize> = (0..8 * 16).map(|_| AtomicUsize::new(0)).collect();
        pool.parallel_for(8, &|outer| {
            pool.parallel_for(16, &|inner| {
                counts[outer * 16 + inner].fetch_add(1, Ordering::Relaxed);
            });
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn calls_from_several_threads_share_one_pool() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        pool.parallel_for(10, &|i| {
                            total.fetch_add(i, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 200 * 45);
    }

    #[test]
    fn parked_workers_wake_up_for_the_next_job() {
        let pool = ThreadPool::new(2);
        for _ in 0..3 {
            thread::sleep(SPIN_BEFORE_PARK * 4);
            assert_eq!(visit_counts(&pool, 100), vec![1; 100]);
        }
    }

    #[test]
    fn task_panic_reaches_the_caller_and_pool_survives() {
        let pool = ThreadPool::new(2);
        for bad in [0usize, 37, 99] {
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.parallel_for(100, &|i| {
                    if i == bad {
                        panic!("task {i} fails");
                    }
                })
            }));
            assert!(r.is_err());
            assert_eq!(visit_counts(&pool, 50), vec![1; 50]);
        }
    }

    #[test]
    fn pool_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<ThreadPool>();
    }
}
