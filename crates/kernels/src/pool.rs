//! A persistent thread pool for kernel calls: workers spin briefly between calls (a
//! decode step issues hundreds of matmuls in a row), then park, so an idle process costs
//! nothing and a busy one pays no thread start-up per call.
//!
//! A pool can run its calls in the background ([`ThreadPool::set_background`]): every
//! thread of it moves to Linux's `SCHED_IDLE` class, so any other process's work preempts
//! it. A runner does that for steps of bulk prefill, so another model's short prompts and
//! decode steps on the same machine do not wait behind a long prompt: the kernels split
//! work statically across threads, and a thread of theirs that loses its core to a busy
//! neighbour for a time slice stalls every call it takes part in.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};

/// Spins before a worker parks (roughly tens of microseconds).
const WORKER_SPINS: u32 = 20_000;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Calls run at idle priority.
    background: AtomicBool,
    generation: AtomicUsize,
    remaining: AtomicUsize,
    job: UnsafeCell<Option<Job>>,
    panicked: AtomicBool,
    stop: AtomicBool,
}

// SAFETY: `job` is written only by the caller of `run` before it publishes a new
// generation (Release) and read by workers after they observe it (Acquire); `run` does
// not return, and so the job does not die, before every worker has finished with it.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// `threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
    handles: Vec<JoinHandle<()>>,
    size: usize,
    /// Serializes callers: one job at a time.
    lock: std::sync::Mutex<()>,
}

impl ThreadPool {
    pub fn new(size: usize) -> Self {
        let size = size.max(1);
        let shared = Arc::new(Shared {
            background: AtomicBool::new(false),
            generation: AtomicUsize::new(0),
            remaining: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let mut handles = Vec::new();
        for index in 1..size {
            let shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("shoal-kernel-{index}"))
                .spawn(move || worker(shared, index));
            match spawned {
                Ok(h) => handles.push(h),
                Err(_) => break, // fewer threads than asked: still correct
            }
        }
        let threads = handles.iter().map(|h| h.thread().clone()).collect();
        let size = handles.len() + 1;
        Self {
            shared,
            threads,
            handles,
            size,
            lock: std::sync::Mutex::new(()),
        }
    }

    /// The process-wide pool: `SHOAL_NUM_THREADS` threads, else one per core.
    pub fn global() -> &'static ThreadPool {
        static POOL: OnceLock<ThreadPool> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = std::env::var("SHOAL_NUM_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&n: &usize| n > 0)
                .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
                .unwrap_or(1);
            ThreadPool::new(n)
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Runs the calls from now on at idle priority (`true`) or normal priority. A no-op
    /// where the system will not let a thread move back out of the idle class.
    pub fn set_background(&self, on: bool) {
        if priority_classes_work() {
            self.shared.background.store(on, Ordering::Relaxed);
        }
    }

    /// Runs `f(i)` for every `i` in `0..size()`, one per thread, and returns when all are
    /// done. A panic inside `f` is re-raised here.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.size == 1 {
            f(0);
            return;
        }
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let s = &self.shared;
        CALLER_CLASS.with(|applied| follow_class(&s.background, applied));
        // SAFETY: erasing the lifetime is sound because this function waits below until
        // every worker has finished calling `f`.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: no worker reads `job` until the generation below changes.
        unsafe { *s.job.get() = Some(job) };
        s.remaining.store(self.size - 1, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        for t in &self.threads {
            t.unpark();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 10_000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker is done with the job.
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a kernel thread panicked");
        }
    }

    /// Runs `f` over `0..n` in pieces of `chunk` (the last may be shorter), each thread
    /// taking the next piece when it finishes one, and returns when all are done. Work
    /// that stalls on one thread — a core lent to another process for a time slice (a
    /// VM's stolen time), a piece that costs more — moves to the others, where a static
    /// split would leave them waiting.
    pub fn run_chunks(&self, n: usize, chunk: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let chunk = chunk.max(1);
        let next = AtomicUsize::new(0);
        self.run(&|_| {
            loop {
                let start = next.fetch_add(1, Ordering::Relaxed).saturating_mul(chunk);
                if start >= n {
                    break;
                }
                f(start..(start + chunk).min(n));
            }
        });
    }
}

thread_local! {
    /// The scheduling class a pool's calling thread is in (`true`: idle).
    static CALLER_CLASS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Moves this thread into the class `wanted` says, if it is not there yet.
fn follow_class(wanted: &AtomicBool, applied: &std::cell::Cell<bool>) {
    let want = wanted.load(Ordering::Relaxed);
    if want != applied.get() && set_class(want) {
        applied.set(want);
    }
}

/// This thread to `SCHED_IDLE` (`true`) or `SCHED_OTHER`; whether it took.
fn set_class(idle: bool) -> bool {
    #[cfg(target_os = "linux")]
    {
        let policy = if idle {
            libc::SCHED_IDLE
        } else {
            libc::SCHED_OTHER
        };
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` outlives the call.
        unsafe { libc::sched_setscheduler(0, policy, &param) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = idle;
        false
    }
}

/// Whether a thread can go idle and come back (an unprivileged process may not leave
/// `SCHED_IDLE` under a zero `RLIMIT_NICE`): tried once, on a thread of its own.
fn priority_classes_work() -> bool {
    static WORKS: OnceLock<bool> = OnceLock::new();
    *WORKS.get_or_init(|| {
        std::thread::spawn(|| set_class(true) && set_class(false))
            .join()
            .unwrap_or(false)
    })
}

fn worker(shared: Arc<Shared>, index: usize) {
    // Generation 0 is the pool's start: a job published before this thread first runs
    // must still be seen as new.
    let mut seen = 0;
    let applied = std::cell::Cell::new(false);
    loop {
        let mut spins = 0u32;
        let current = loop {
            let g = shared.generation.load(Ordering::Acquire);
            if g != seen || shared.stop.load(Ordering::Relaxed) {
                break g;
            }
            spins += 1;
            if spins < WORKER_SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::park();
            }
        };
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        seen = current;
        follow_class(&shared.background, &applied);
        // SAFETY: the generation changed, so `job` holds the caller's closure, alive
        // until `remaining` reaches zero.
        if let Some(job) = unsafe { *shared.job.get() } {
            let f = unsafe { &*job };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
        }
        shared.remaining.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in &self.threads {
            t.unpark();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_per_call() {
        let pool = ThreadPool::new(3);
        for _ in 0..1000 {
            let hits: Vec<AtomicUsize> = (0..pool.size()).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    /// The class each of the pool's threads runs a call in: idle while in the
    /// background, normal again after (where the system allows both).
    #[test]
    fn background_calls_run_idle_and_come_back() {
        let pool = ThreadPool::new(2);
        let class = || {
            let policies: Vec<AtomicUsize> =
                (0..pool.size()).map(|_| AtomicUsize::new(99)).collect();
            pool.run(&|i| {
                // SAFETY: pid 0 is the calling thread.
                let p = unsafe { libc::sched_getscheduler(0) };
                policies[i].store(p as usize, Ordering::Relaxed);
            });
            policies
                .iter()
                .map(|p| p.load(Ordering::Relaxed) as i32)
                .collect::<Vec<_>>()
        };
        if !priority_classes_work() {
            eprintln!("this system does not let a thread leave SCHED_IDLE; skipped");
            return;
        }
        pool.set_background(true);
        assert_eq!(class(), [libc::SCHED_IDLE; 2]);
        pool.set_background(false);
        assert_eq!(class(), [libc::SCHED_OTHER; 2]);
    }

    #[test]
    fn chunks_cover_every_item_once() {
        let pool = ThreadPool::new(3);
        for (n, chunk) in [(0, 4), (1, 4), (17, 4), (64, 8), (100, 1), (5, 100)] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run_chunks(n, chunk, &|range| {
                assert!(range.len() <= chunk && !range.is_empty());
                for i in range {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{n} by {chunk}"
            );
        }
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|i| assert!(i != 1, "worker fails"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), pool.size());
    }
}
