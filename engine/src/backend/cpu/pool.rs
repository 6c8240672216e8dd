//! A fixed worker pool, created once per backend: [`Pool::run`] calls `f(i)` for every task index `i < n` across
//! the workers and the calling thread, and returns when all tasks are done; [`Pool::for_ranges`] covers `0..total`
//! with contiguous ranges (one part per thread, front to back, stealing at the tail) for streaming work such as
//! matmul rows.
//!
//! Tasks are claimed from an atomic counter, so `f` must not depend on which thread runs a task. The pool runs
//! one job at a time (a `run` from several threads at once is serialised by a lock); a `run` from inside a task
//! (nested) executes inline on the calling thread instead of deadlocking. Panics inside `f` are caught
//! on workers and re-raised on the caller after the job completes, so a panicking task cannot leave the borrowed
//! closure in use after `run` returns.
//!
//! Latency: decode issues hundreds of small jobs per token (one expert matrix is ~0.1–0.3 ms of work), and waking
//! a parked thread costs 50–70 µs on an idle VM (the vCPU has halted). So after a job, workers spin (reading one
//! atomic) for up to [`SPIN`] before parking on a condvar, and the caller spins up to `WAIT_SPIN` while it waits
//! for the last worker. Job hand-off is one atomic generation bump; the lock/condvar pair is touched only when
//! someone has parked. On a machine busy with other work spinning backfires (a spinning thread is descheduled and
//! the one it waits for cannot run), so a spinning thread that notices it was preempted (a long gap between two
//! looks at the clock) makes every wait park at once for the next `CONTENDED_FOR`. `DS4_CPU_SPIN_US`
//! (environment, read by [`Pool::new`]) overrides [`SPIN`]; 0 turns spinning off.
//!
//! Every worker takes part in every job (it decrements `pending` once per generation), which is what lets the
//! job description live in a plain cell: it is rewritten only while no worker is inside a job.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Task = dyn Fn(usize) + Sync;

/// How long an idle worker (or a waiting caller) spins before parking.
pub const SPIN: Duration = Duration::from_micros(1000);
/// How long the caller spins waiting for the last worker of a job before parking. Shorter than [`SPIN`]: ranges
/// at the end of a job are small, so a longer wait most likely means that worker lost its CPU, and a spinning
/// caller would only keep it off one. (Treating such a timeout as contention, see `CONTENDED_FOR`, was measured:
/// it parks far too often on a lightly loaded machine.)
const WAIT_SPIN: Duration = Duration::from_micros(100);

thread_local! {
    /// Set while this thread executes pool tasks (workers always; the caller during its share of a job).
    static IN_TASK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// This thread's worker index: `w` on worker `w`, 0 on any other thread. See [`worker_index`].
    static WORKER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The index of the calling thread in the pool it works for: `w` (`1..threads`) on worker `w`, 0 on any other thread
/// (the caller of [`Pool::run`]). Ops keep per-thread scratch as one entry per worker index (index it modulo the
/// entry count, and lock it: a thread of another pool may share an index), grown on the calling thread before a
/// dispatch — so nothing is allocated on a worker, whichever tasks the scheduling hands it.
pub fn worker_index() -> usize {
    WORKER.get()
}

/// Locks `m`, ignoring poisoning (the guarded data is `()`; the pool's state lives in atomics). `std`'s futex-based
/// mutex and condvars are used rather than `parking_lot`'s, whose first park on a thread may allocate (its global
/// wait table): the decode loop must not allocate on any thread.
fn lock(m: &Mutex<()>) -> MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A job posted to the workers: a type-erased pointer to the caller's closure plus the task count.
#[derive(Clone, Copy)]
struct Job {
    f: *const Task,
    n: usize,
}

struct Shared {
    /// Bumped (after `job` is written) to post a job; workers compare it with the last generation they ran.
    generation: AtomicU64,
    job: UnsafeCell<Job>,
    /// The next task index to claim.
    next: AtomicUsize,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    /// Whether the caller parked on `done` waiting for `pending == 0`.
    caller_parked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    done: Condvar,
    spin: Duration,
    /// Time origin of `contended_until`.
    epoch: Instant,
    /// Nanoseconds after `epoch` until which waits park without spinning (see [`PREEMPTED`]).
    contended_until: AtomicU64,
}

// SAFETY: `job` is written only by the thread holding `Pool::run_lock`, while `pending == 0` (no worker is inside a
// job) and before the generation bump that publishes it (SeqCst); workers read it only after observing that bump and
// before decrementing `pending`. The pointee closure is `Sync`. Every other field is a sync primitive.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw closure pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// The worker pool. See the module docs.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    run_lock: Mutex<()>,
    f32_acts: bool,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("threads", &self.threads()).finish()
    }
}

fn run_tasks(f: &(dyn Fn(usize) + Sync + '_), n: usize, next: &AtomicUsize) {
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

/// A gap this long between two looks at the clock while spinning means the thread was descheduled: the CPUs are
/// shared with other work, and spinning there only steals time from the threads we wait for.
const PREEMPTED: Duration = Duration::from_micros(50);
/// After a preemption is seen, every wait parks at once for this long (then spinning is tried again).
const CONTENDED_FOR: Duration = Duration::from_millis(100);

impl Shared {
    /// Spins until `ready()` or until the spin budget has passed; returns whether `ready()` became true. Gives up
    /// at once (and marks the pool contended for [`CONTENDED_FOR`]) when the spinning thread gets preempted.
    #[inline]
    fn spin_until(&self, budget: Duration, ready: impl Fn() -> bool) -> bool {
        if ready() {
            return true;
        }
        let start = Instant::now();
        let now_ns = |t: Instant| t.duration_since(self.epoch).as_nanos() as u64;
        if budget.is_zero() || now_ns(start) < self.contended_until.load(Ordering::Relaxed) {
            return false;
        }
        let mut last = start;
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
                if ready() {
                    return true;
                }
            }
            let now = Instant::now();
            let timed_out = now.duration_since(start) >= budget;
            if now.duration_since(last) >= PREEMPTED {
                let until = now_ns(now) + CONTENDED_FOR.as_nanos() as u64;
                self.contended_until.fetch_max(until, Ordering::Relaxed);
                return ready();
            }
            if timed_out {
                return false;
            }
            last = now;
        }
    }
}

impl Pool {
    /// A pool using `threads` threads in all (the caller counts as one; `threads <= 1` runs everything inline).
    pub fn new(threads: usize) -> Pool {
        let spin = std::env::var("DS4_CPU_SPIN_US").ok().and_then(|v| v.trim().parse::<u64>().ok());
        Pool::with_spin(threads, spin.map_or(SPIN, Duration::from_micros))
    }

    /// [`Pool::new`] with a chosen spin time before parking (zero parks at once, as a plain condvar pool does).
    pub fn with_spin(threads: usize, spin: Duration) -> Pool {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(Job { f: std::ptr::null::<fn(usize)>() as *const Task, n: 0 }),
            next: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            caller_parked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            done: Condvar::new(),
            spin,
            epoch: Instant::now(),
            contended_until: AtomicU64::new(0),
        });
        let workers = (1..threads.max(1))
            .map(|w| {
                let sh = shared.clone();
                std::thread::Builder::new()
                    .name(format!("ds4-cpu-{w}"))
                    .spawn(move || {
                        WORKER.set(w);
                        worker(sh)
                    })
                    .expect("failed to spawn a CPU worker thread")
            })
            .collect();
        Pool { shared, workers, run_lock: Mutex::new(()), f32_acts: false }
    }

    /// Makes the CPU matmul multiply quantized weights with f32 activations (no Q8_0/Q8_K activation
    /// quantization; slower, but the same products the wgpu backend computes). Carried by the pool because every
    /// CPU op receives it.
    pub fn set_f32_acts(&mut self, on: bool) {
        self.f32_acts = on;
    }

    /// Whether [`Pool::set_f32_acts`] is on.
    pub fn f32_acts(&self) -> bool {
        self.f32_acts
    }

    /// Threads in all, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for `i in 0..n` on all threads; returns when every call has returned.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        if self.workers.is_empty() || n == 1 || IN_TASK.get() {
            (0..n).for_each(f);
            return;
        }
        let _guard = lock(&self.run_lock);
        let sh = &*self.shared;
        // SAFETY: only the lifetime is erased; the pointer is dereferenced by workers strictly before they
        // decrement `pending`, and this function does not return until `pending == 0`.
        let f_static: *const Task =
            unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Task>(f) };
        // SAFETY: we hold `run_lock` and the previous job ended with `pending == 0`, so no worker reads `job` now
        // (see `Shared`).
        unsafe { *sh.job.get() = Job { f: f_static, n } };
        sh.next.store(0, Ordering::Relaxed);
        sh.pending.store(self.workers.len(), Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        sh.generation.fetch_add(1, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&sh.lock);
            sh.wake.notify_all();
        }
        IN_TASK.set(true);
        let mine = catch_unwind(AssertUnwindSafe(|| run_tasks(f, n, &sh.next)));
        IN_TASK.set(false);
        if !sh.spin_until(sh.spin.min(WAIT_SPIN), || sh.pending.load(Ordering::Acquire) == 0) {
            let mut g = lock(&sh.lock);
            sh.caller_parked.store(true, Ordering::SeqCst);
            while sh.pending.load(Ordering::SeqCst) != 0 {
                g = sh.done.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            sh.caller_parked.store(false, Ordering::Relaxed);
        }
        let panicked = sh.panicked.load(Ordering::Acquire);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if panicked {
            panic!("a CPU worker task panicked");
        }
    }

    /// Calls `f(range)` for disjoint ranges that together cover `0..total`, on all threads. Each thread owns one
    /// contiguous part of `0..total` and works through it front to back in chunks (so it streams one long
    /// stretch, and what the kernels prefetch past a chunk's end is its own next chunk); a thread that runs out
    /// steals half of what is left of the fullest part, from its back end, down to `grain` items.
    pub fn for_ranges(&self, total: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        if total == 0 {
            return;
        }
        let grain = grain.max(1);
        let threads = self.threads();
        if threads == 1 || total <= grain || IN_TASK.get() {
            f(0..total);
            return;
        }
        if total > u32::MAX as usize {
            // Larger than the packed parts can hold: fixed chunks.
            let chunks = total.div_ceil(grain.max(total / (16 * threads)));
            return self.run(chunks, &|i| f(split(total, chunks, i)));
        }
        let n_parts = threads.min(MAX_PARTS);
        let parts: [AtomicU64; MAX_PARTS] = std::array::from_fn(|p| {
            let r = split(total, n_parts, p);
            AtomicU64::new(if p < n_parts { pack(r.start, r.end) } else { 0 })
        });
        let own_chunk = (total / n_parts / OWN_CHUNKS).max(grain);
        self.run(threads, &|t| {
            if let Some(own) = parts.get(t).filter(|_| t < n_parts) {
                while let Some(r) = take_front(own, own_chunk) {
                    f(r);
                }
            }
            loop {
                let fullest = parts[..n_parts].iter().max_by_key(|p| {
                    let (lo, hi) = unpack(p.load(Ordering::Relaxed));
                    hi.saturating_sub(lo)
                });
                match fullest.and_then(|p| take_back(p, grain)) {
                    Some(r) => f(r),
                    None => {
                        if parts[..n_parts].iter().all(|p| {
                            let (lo, hi) = unpack(p.load(Ordering::Relaxed));
                            lo >= hi
                        }) {
                            return;
                        }
                    }
                }
            }
        });
    }
}

/// Parts [`Pool::for_ranges`] splits into at most (more threads only steal).
const MAX_PARTS: usize = 64;
/// Chunks an owner takes its part in (the most a stealer can be left waiting for is one of them).
const OWN_CHUNKS: usize = 64;

fn pack(lo: usize, hi: usize) -> u64 {
    lo as u64 | (hi as u64) << 32
}

fn unpack(v: u64) -> (usize, usize) {
    ((v & 0xffff_ffff) as usize, (v >> 32) as usize)
}

/// Takes up to `chunk` items from the front of a part.
fn take_front(part: &AtomicU64, chunk: usize) -> Option<Range<usize>> {
    let mut v = part.load(Ordering::Relaxed);
    loop {
        let (lo, hi) = unpack(v);
        if lo >= hi {
            return None;
        }
        let end = hi.min(lo + chunk);
        match part.compare_exchange_weak(v, pack(end, hi), Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(lo..end),
            Err(now) => v = now,
        }
    }
}

/// Takes half of what is left of a part (at least `grain` items, or all of it) from its back end.
fn take_back(part: &AtomicU64, grain: usize) -> Option<Range<usize>> {
    let mut v = part.load(Ordering::Relaxed);
    loop {
        let (lo, hi) = unpack(v);
        if lo >= hi {
            return None;
        }
        let start = hi - (hi - lo).div_ceil(2).max(grain).min(hi - lo);
        match part.compare_exchange_weak(v, pack(lo, start), Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(start..hi),
            Err(now) => v = now,
        }
    }
}

/// Waits for a generation other than `seen` (spinning, then parked); `None` on shutdown.
fn next_job(sh: &Shared, seen: u64) -> Option<u64> {
    let ready = || sh.generation.load(Ordering::Acquire) != seen || sh.shutdown.load(Ordering::Acquire);
    if !sh.spin_until(sh.spin, ready) {
        let mut g = lock(&sh.lock);
        sh.sleepers.fetch_add(1, Ordering::SeqCst);
        while sh.generation.load(Ordering::SeqCst) == seen && !sh.shutdown.load(Ordering::SeqCst) {
            g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        sh.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
    if sh.shutdown.load(Ordering::Acquire) {
        return None;
    }
    Some(sh.generation.load(Ordering::Acquire))
}

fn worker(sh: Arc<Shared>) {
    IN_TASK.set(true);
    let mut seen = 0u64;
    while let Some(g) = next_job(&sh, seen) {
        seen = g;
        // SAFETY: the generation bump we observed (Acquire) published this job, and `run` does not rewrite it or
        // return before we decrement `pending` below.
        let job = unsafe { *sh.job.get() };
        // SAFETY: `run` keeps the closure alive until this worker decrements `pending`.
        let ok = catch_unwind(AssertUnwindSafe(|| run_tasks(unsafe { &*job.f }, job.n, &sh.next))).is_ok();
        if !ok {
            sh.panicked.store(true, Ordering::Release);
        }
        if sh.pending.fetch_sub(1, Ordering::SeqCst) == 1 && sh.caller_parked.load(Ordering::SeqCst) {
            let _g = lock(&sh.lock);
            sh.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = lock(&self.shared.lock);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Runs `f(i, row_i)` for every `width`-sized row `i` of `buf` (`buf.len() / width` rows) across the pool.
pub fn par_rows<T: Send>(pool: &Pool, buf: &mut [T], width: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    if width == 0 {
        return;
    }
    let n = buf.len() / width;
    let ptr = RowPtr(buf.as_mut_ptr());
    let tasks = n.min(pool.threads() * 4).max(1);
    pool.run(tasks, &|t| {
        for i in split(n, tasks, t) {
            // SAFETY: row ranges are disjoint across tasks and `i < n` keeps them inside `buf`, which is
            // borrowed mutably for the duration of `run`.
            let row = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(i * width), width) };
            f(i, row);
        }
    });
}

struct RowPtr<T>(*mut T);
impl<T> Clone for RowPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for RowPtr<T> {}
impl<T> RowPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the raw field).
    fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: only used by `par_rows` for disjoint rows of a `T: Send` buffer.
unsafe impl<T: Send> Send for RowPtr<T> {}
// SAFETY: as above; no two tasks touch the same element.
unsafe impl<T: Send> Sync for RowPtr<T> {}

/// Splits `0..n` into at most `parts` contiguous ranges of near-equal size; range `i` of them.
pub fn split(n: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let base = n / parts;
    let rem = n % parts;
    let start = i * base + i.min(rem);
    let len = base + usize::from(i < rem);
    start..(start + len).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn runs_every_task_once() {
        for spin in [Duration::ZERO, SPIN] {
            let pool = Pool::with_spin(4, spin);
            for n in [0usize, 1, 3, 100] {
                let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn many_back_to_back_jobs_complete() {
        // Exercises the spin hand-off and the park/wake paths (zero spin parks after every job).
        for spin in [Duration::ZERO, Duration::from_micros(50), SPIN] {
            let pool = Pool::with_spin(3, spin);
            let total = AtomicU64::new(0);
            for j in 0..2000u64 {
                pool.run(3, &|i| {
                    total.fetch_add(j * 3 + i as u64, Ordering::Relaxed);
                });
                if j % 500 == 0 {
                    // Long enough for the workers to park.
                    std::thread::sleep(Duration::from_millis(3));
                }
            }
            let n = 2000u64 * 3;
            assert_eq!(total.load(Ordering::Relaxed), n * (n - 1) / 2);
        }
    }

    #[test]
    fn nested_runs_do_not_deadlock() {
        let pool = Pool::new(3);
        let total = AtomicU64::new(0);
        pool.run(8, &|_| {
            pool.run(4, &|j| {
                total.fetch_add(j as u64, Ordering::Relaxed);
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 8 * 6);
    }

    #[test]
    fn for_ranges_covers_each_index_once() {
        let pool = Pool::new(3);
        for (total, grain) in [(0usize, 1usize), (1, 1), (5, 8), (1000, 1), (1000, 7), (4096, 64)] {
            let hits: Vec<AtomicU64> = (0..total).map(|_| AtomicU64::new(0)).collect();
            let calls = AtomicU64::new(0);
            pool.for_ranges(total, grain, &|r| {
                assert!(!r.is_empty());
                calls.fetch_add(1, Ordering::Relaxed);
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "total {total} grain {grain}");
            // Large first: far fewer ranges than indices once the grain allows it.
            if total >= 1000 && grain == 1 {
                assert!(calls.load(Ordering::Relaxed) < 200, "{} ranges", calls.load(Ordering::Relaxed));
            }
        }
    }

    #[test]
    fn split_covers_range() {
        for (n, p) in [(10usize, 3usize), (3, 8), (0, 4), (128, 16)] {
            let mut covered = 0;
            for i in 0..p {
                let r = split(n, p, i);
                assert_eq!(r.start, covered.min(n));
                covered = r.end.max(covered);
            }
            assert_eq!(covered, n);
        }
    }

    #[test]
    fn worker_panic_is_reported() {
        let pool = Pool::new(3);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(64, &|i| assert!(i != 40))));
        assert!(r.is_err());
        // The pool still works afterwards.
        let sum = AtomicU64::new(0);
        pool.run(10, &|i| {
            sum.fetch_add(i as u64, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn drop_stops_parked_and_spinning_workers() {
        for spin in [Duration::ZERO, SPIN] {
            let pool = Pool::with_spin(4, spin);
            pool.run(4, &|_| {});
            drop(pool); // Joins every worker; a lost shutdown wake-up would hang here.
        }
    }
}
