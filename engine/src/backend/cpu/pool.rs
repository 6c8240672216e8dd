//! A fixed worker pool, created once per backend: [`Pool::run`] calls `f(i)` for every task index `i < n` across
//! the workers and the calling thread, and returns when all tasks are done.
//!
//! Tasks are claimed from an atomic counter, so `f` must not depend on which thread runs a task. The pool runs
//! one job at a time (a `run` from several threads at once is serialised by a lock); a `run` from inside a task
//! (nested) executes inline on the calling thread instead of deadlocking. Panics inside `f` are caught
//! on workers and re-raised on the caller after the job completes, so a panicking task cannot leave the borrowed
//! closure in use after `run` returns.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

type Task = dyn Fn(usize) + Sync;

thread_local! {
    /// Set while this thread executes pool tasks (workers always; the caller during its share of a job).
    static IN_TASK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A job posted to the workers: a type-erased pointer to the caller's closure plus the task count.
#[derive(Clone, Copy)]
struct Job {
    f: *const Task,
    n: usize,
}

// SAFETY: the pointee is `Sync` and `run` keeps it alive (blocks) until every worker has finished with it.
unsafe impl Send for Job {}

struct State {
    generation: u64,
    job: Option<Job>,
    /// Workers still inside the current job.
    active: usize,
    panicked: bool,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    done: Condvar,
    next: AtomicUsize,
}

/// The worker pool. See the module docs.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    run_lock: Mutex<()>,
    /// Matmul policy carried with the pool every CPU op already receives: quantized weights keep f32 activations
    /// (see `matmul`'s module docs). Off by default.
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

impl Pool {
    /// A pool using `threads` threads in all (the caller counts as one; `threads <= 1` runs everything inline).
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: Mutex::new(State { generation: 0, job: None, active: 0, panicked: false, shutdown: false }),
            wake: Condvar::new(),
            done: Condvar::new(),
            next: AtomicUsize::new(0),
        });
        let workers = (1..threads.max(1))
            .map(|w| {
                let sh = shared.clone();
                std::thread::Builder::new()
                    .name(format!("ds4-cpu-{w}"))
                    .spawn(move || worker(sh))
                    .expect("failed to spawn a CPU worker thread")
            })
            .collect();
        Pool { shared, workers, run_lock: Mutex::new(()), f32_acts: false }
    }

    /// Sets whether matmuls on this pool multiply quantized weights with f32 activations (slower, no activation
    /// quantization; see `matmul`'s module docs) instead of Q8_0/Q8_K-quantized ones (the default).
    pub fn set_f32_acts(&mut self, on: bool) {
        self.f32_acts = on;
    }

    /// Whether quantized weights are multiplied with f32 activations (see [`Pool::set_f32_acts`]).
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
        let _guard = self.run_lock.lock();
        // SAFETY: only the lifetime is erased; the pointer is dereferenced by workers strictly before they
        // decrement `active`, and this function does not return until `active == 0`.
        let f_static: *const Task =
            unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Task>(f) };
        {
            let mut st = self.shared.state.lock();
            self.shared.next.store(0, Ordering::Relaxed);
            st.job = Some(Job { f: f_static, n });
            st.generation += 1;
            st.active = self.workers.len();
            st.panicked = false;
            self.shared.wake.notify_all();
        }
        IN_TASK.set(true);
        let mine = catch_unwind(AssertUnwindSafe(|| run_tasks(f, n, &self.shared.next)));
        IN_TASK.set(false);
        let mut st = self.shared.state.lock();
        while st.active > 0 {
            self.shared.done.wait(&mut st);
        }
        st.job = None;
        let panicked = st.panicked;
        drop(st);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if panicked {
            panic!("a CPU worker task panicked");
        }
    }
}

fn worker(sh: Arc<Shared>) {
    IN_TASK.set(true);
    let mut seen = 0u64;
    loop {
        let job = {
            let mut st = sh.state.lock();
            while st.generation == seen && !st.shutdown {
                sh.wake.wait(&mut st);
            }
            if st.shutdown {
                return;
            }
            seen = st.generation;
            st.job
        };
        let ok = match job {
            // SAFETY: `run` keeps the closure alive until this worker decrements `active` below.
            Some(j) => catch_unwind(AssertUnwindSafe(|| run_tasks(unsafe { &*j.f }, j.n, &sh.next))).is_ok(),
            None => true,
        };
        let mut st = sh.state.lock();
        if !ok {
            st.panicked = true;
        }
        st.active -= 1;
        if st.active == 0 {
            sh.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.wake.notify_all();
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
        let pool = Pool::new(4);
        for n in [0usize, 1, 3, 100] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
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
}
