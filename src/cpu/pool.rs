//! A small persistent thread pool with static partitioning.
//!
//! `threads - 1` workers wait for a job; the caller runs share 0 itself. A job is a borrowed
//! `Fn(thread_index)`: no boxing, no allocation, no thread spawn per call. Workers spin briefly
//! after a job (decode calls come every few tens of microseconds) and then sleep on a condvar.
//! Each thread always gets the same share of the work, so results do not depend on timing.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = *const (dyn Fn(usize) + Sync + 'static);

/// A job over a chunk of items with per-thread state (see [`Pool::run_chunks_with`]).
type ChunkStateFn<'a, T, S> = dyn Fn(std::ops::Range<usize>, &mut [T], &mut S) + Sync + 'a;

/// How long an idle worker spins before it sleeps, unless [`SPIN_ENV`] says otherwise.
const SPIN: Duration = Duration::from_micros(100);

/// The environment variable that sets the spin, in microseconds (read once, when the first pool
/// starts). Spinning lets back-to-back jobs (a decode step's layers) start without a wake-up; a
/// host that runs its own threads between our jobs (candle's rayon ops around a `HybridFfn`) can
/// set 0 so idle workers give their core back at once.
pub const SPIN_ENV: &str = "POWERINFER_POOL_SPIN_US";

pub(crate) fn spin() -> Duration {
    static SPIN_US: OnceLock<Duration> = OnceLock::new();
    *SPIN_US.get_or_init(|| {
        std::env::var(SPIN_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}

struct Shared {
    epoch: AtomicU64,
    /// Written by the caller before `epoch` is bumped (Release), read by workers after they
    /// observe the new epoch (Acquire).
    job: UnsafeCell<Option<Job>>,
    pending: AtomicUsize,
    panicked: AtomicBool,
    /// The first worker panic's payload of the current run, re-raised by the caller.
    payload: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the single caller holding `Pool::run_lock` while no worker is
// running (pending == 0), and only read by workers between an epoch bump and their decrement of
// `pending`; the atomics order those accesses.
unsafe impl Sync for Shared {}
// SAFETY: see `Sync`; the raw job pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A fixed set of worker threads. Cheap to share: layers of a model use one pool.
pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    run_lock: Mutex<()>,
    handles: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Pool {
    /// A pool running jobs on `threads` threads (the caller plus `threads - 1` workers).
    /// `threads` of 0 is treated as 1.
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            payload: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let handles = (1..threads)
            .filter_map(|idx| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("powerinfer-{idx}"))
                    .spawn(move || worker(&s, idx))
                    .ok()
            })
            .collect::<Vec<_>>();
        // If the OS refused a thread, run with what we got; shares stay static.
        let threads = handles.len() + 1;
        Pool {
            shared,
            threads,
            run_lock: Mutex::new(()),
            handles,
        }
    }

    /// The process-wide pool with `threads` threads, created on first use.
    pub fn shared(threads: usize) -> Arc<Pool> {
        static POOLS: OnceLock<Mutex<HashMap<usize, Arc<Pool>>>> = OnceLock::new();
        let map = POOLS.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(
            map.entry(threads.max(1))
                .or_insert_with(|| Arc::new(Pool::new(threads))),
        )
    }

    /// Number of threads a job runs on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(t)` for every `t in 0..threads()`, each on its own thread, and returns when all
    /// are done. A panic in any share is re-raised here after every share has finished.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            f(0);
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: we erase the borrow's lifetime to hand it to the workers. This function does not
        // return (or unwind) before `pending` is back to 0, i.e. before every worker has finished
        // calling it, so the pointer never outlives `f`.
        let job: Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f) };
        // SAFETY: no worker reads `job` now: the previous run ended with pending == 0 and the
        // epoch has not moved; `run_lock` excludes other callers.
        unsafe { *s.job.get() = Some(job) };
        s.panicked.store(false, Ordering::Relaxed);
        s.pending.store(self.threads - 1, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let start = Instant::now();
        while s.pending.load(Ordering::Acquire) != 0 {
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            let p = s.payload.lock().unwrap_or_else(|e| e.into_inner()).take();
            resume_unwind(p.unwrap_or_else(|| Box::new("a powerinfer pool worker panicked")));
        }
    }

    /// Runs `f(t, &mut states[t])` for every thread `t`; each thread gets its own state.
    /// `states` must hold at least `threads()` entries (extra entries are left alone).
    pub fn run_with<S: Send>(&self, states: &mut [S], f: &(dyn Fn(usize, &mut S) + Sync)) {
        let n = self.threads.min(states.len());
        let base = SendPtr(states.as_mut_ptr());
        self.run(&|t| {
            if t < n {
                // SAFETY: `t` is unique to this thread within this run and `t < states.len()`,
                // so each `&mut` is to a distinct element that outlives the run.
                let s = unsafe { &mut *base.get().add(t) };
                f(t, s);
            }
        });
    }
}

impl Pool {
    /// Splits `data` into `threads()` contiguous parts along `items` items of `per_item` elements
    /// each (thread `t` gets the items of [`share`]`(items, t, threads)`), and runs
    /// `f(item_range, part)` on each thread. `data` must hold `items * per_item` elements; a shorter
    /// `data` only gives out what it holds.
    pub fn run_chunks<T: Send>(
        &self,
        data: &mut [T],
        items: usize,
        per_item: usize,
        f: &(dyn Fn(std::ops::Range<usize>, &mut [T]) + Sync),
    ) {
        let n = self.threads;
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.run(&|t| {
            let r = share(items, t, n);
            let (lo, hi) = ((r.start * per_item).min(len), (r.end * per_item).min(len));
            // SAFETY: the ranges `share` gives for distinct `t` are disjoint and `lo..hi` is
            // clamped to `data`, so each thread gets a distinct, in-bounds sub-slice.
            let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(lo), hi - lo) };
            f(r, part);
        });
    }
}

impl Pool {
    /// [`Pool::run_chunks`] with per-thread state: `f(item_range, part, &mut states[t])`. The items
    /// are shared among `min(threads(), states.len())` threads (none run without a state).
    pub fn run_chunks_with<T: Send, S: Send>(
        &self,
        data: &mut [T],
        items: usize,
        per_item: usize,
        states: &mut [S],
        f: &ChunkStateFn<'_, T, S>,
    ) {
        let n = self.threads.min(states.len());
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.run_with(states, &|t, st| {
            let r = share(items, t, n);
            let (lo, hi) = ((r.start * per_item).min(len), (r.end * per_item).min(len));
            // SAFETY: as in `run_chunks`: disjoint, in-bounds sub-slices per thread.
            let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(lo), hi - lo) };
            f(r, part, st);
        });
    }
}

/// The static share of `len` items that thread `t` of `n` works on: contiguous, sizes differ by at
/// most one, independent of timing.
pub fn share(len: usize, t: usize, n: usize) -> std::ops::Range<usize> {
    let n = n.max(1);
    let (base, rem) = (len / n, len % n);
    let start = t * base + t.min(rem);
    let end = start + base + usize::from(t < rem);
    start.min(len)..end.min(len)
}

/// A raw pointer that may cross threads; only `run_with` dereferences it, with disjoint indices.
struct SendPtr<S>(*mut S);
impl<S> SendPtr<S> {
    fn get(&self) -> *mut S {
        self.0
    }
}
// SAFETY: used only to hand out disjoint `&mut S` (S: Send) to pool threads.
unsafe impl<S: Send> Sync for SendPtr<S> {}

impl Drop for Pool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: &Shared, idx: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if start.elapsed() < spin() {
                std::hint::spin_loop();
                continue;
            }
            let guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            if s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                let _g = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: the caller stored the job before bumping the epoch we just observed (Acquire),
        // and keeps it alive until we decrement `pending` below.
        let job = unsafe { *s.job.get() };
        if let Some(job) = job {
            // SAFETY: see above: the closure is alive for the whole run.
            let f = unsafe { &*job };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(idx))) {
                let mut g = s.payload.lock().unwrap_or_else(|e| e.into_inner());
                if g.is_none() {
                    *g = Some(p);
                }
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::AcqRel);
    }
}
