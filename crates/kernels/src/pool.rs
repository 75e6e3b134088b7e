//! A persistent thread pool for kernel calls: workers spin briefly between calls (a
//! decode step issues hundreds of matmuls in a row), then park, so an idle process costs
//! nothing and a busy one pays no thread start-up per call.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};

/// Spins before a worker parks (roughly tens of microseconds).
const WORKER_SPINS: u32 = 20_000;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
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

    /// Runs `f(i)` for every `i` in `0..size()`, one per thread, and returns when all are
    /// done. A panic inside `f` is re-raised here.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.size == 1 {
            f(0);
            return;
        }
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let s = &self.shared;
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
}

fn worker(shared: Arc<Shared>, index: usize) {
    // Generation 0 is the pool's start: a job published before this thread first runs
    // must still be seen as new.
    let mut seen = 0;
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
