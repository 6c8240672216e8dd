//! Tier I/O off the caller's thread: an [`IoWorker`] runs jobs (a save's encoding, writing and syncing, a restore's
//! reading and decoding, a remote tier's round trips) one at a time, in submission order, on a thread of its own, so
//! the thread that decodes never waits on a disk or a socket.
//!
//! Invariants:
//! * FIFO: a job sees the effects of every job submitted before it (a restore queued after a save finds what the
//!   save wrote).
//! * Bounded: at most `capacity` jobs wait. [`IoWorker::try_submit`] hands a job back when the queue is full (the
//!   caller drops or counts it: a save is an optimisation, never a duty); [`IoWorker::submit`] waits for room
//!   (for work that must not be lost, such as the saves at shutdown).
//! * [`IoWorker::pending`] counts jobs queued or running; [`IoWorker::flush`] returns once it is 0. Dropping the
//!   worker runs what is queued, then joins the thread.
//! * A job that panics is counted ([`IoWorker::panics`]) and the worker goes on with the next one.
//! * The thread runs at a lower CPU priority (nice +10 on Linux): where decoding and tier I/O share CPU cores, the
//!   decode threads win them and the I/O takes what is left (on a GPU box the cores are mostly idle anyway).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

/// One unit of tier I/O.
pub type IoJob = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct Shared {
    /// Jobs queued or running.
    pending: Mutex<usize>,
    idle: Condvar,
    panics: AtomicU64,
}

impl Shared {
    fn add(&self) {
        *self.pending.lock() += 1;
    }

    fn done(&self) {
        let mut p = self.pending.lock();
        *p = p.saturating_sub(1);
        if *p == 0 {
            self.idle.notify_all();
        }
    }
}

/// A FIFO worker thread for tier I/O. See the module docs.
pub struct IoWorker {
    tx: Option<SyncSender<IoJob>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl IoWorker {
    /// Starts a worker thread named `name` with room for `capacity` waiting jobs (at least 1).
    pub fn start(name: &str, capacity: usize) -> std::io::Result<IoWorker> {
        let (tx, rx) = sync_channel::<IoJob>(capacity.max(1));
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
            lower_priority();
            while let Ok(job) = rx.recv() {
                if catch_unwind(AssertUnwindSafe(job)).is_err() {
                    s.panics.fetch_add(1, Ordering::Relaxed);
                    tracing::error!("a KV tier I/O job panicked; the worker goes on");
                }
                s.done();
            }
        })?;
        Ok(IoWorker { tx: Some(tx), shared, thread: Some(thread) })
    }

    /// Queues `job` unless the queue is full (then it is handed back, not run).
    pub fn try_submit(&self, job: IoJob) -> Result<(), IoJob> {
        let Some(tx) = &self.tx else { return Err(job) };
        self.shared.add();
        match tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(job)) | Err(TrySendError::Disconnected(job)) => {
                self.shared.done();
                Err(job)
            }
        }
    }

    /// Queues `job`, waiting for room when the queue is full. `false` when the worker is gone (the job is dropped).
    pub fn submit(&self, job: IoJob) -> bool {
        let Some(tx) = &self.tx else { return false };
        self.shared.add();
        if tx.send(job).is_err() {
            self.shared.done();
            return false;
        }
        true
    }

    /// Jobs queued or running.
    pub fn pending(&self) -> usize {
        *self.shared.pending.lock()
    }

    /// Waits until every job submitted so far has run.
    pub fn flush(&self) {
        let mut p = self.shared.pending.lock();
        while *p > 0 {
            self.shared.idle.wait(&mut p);
        }
    }

    /// Jobs that panicked.
    pub fn panics(&self) -> u64 {
        self.shared.panics.load(Ordering::Relaxed)
    }

    /// A handle that reads [`IoWorker::pending`] from anywhere (e.g. a metrics endpoint).
    pub fn pending_handle(&self) -> IoPending {
        IoPending(self.shared.clone())
    }
}

/// Reads an [`IoWorker`]'s pending count (cheap to clone, `Send + Sync`).
#[derive(Clone)]
pub struct IoPending(Arc<Shared>);

impl IoPending {
    /// Jobs queued or running.
    pub fn get(&self) -> usize {
        *self.0.pending.lock()
    }
}

/// Lowers the calling thread's CPU priority (Linux: nice is per thread); best effort.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority takes plain integers; `who` = 0 with PRIO_PROCESS names the calling thread on Linux.
        // A failure (e.g. a sandbox refusing it) leaves the priority as it was, which is harmless.
        let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
    }
}

impl Drop for IoWorker {
    fn drop(&mut self) {
        // Closing the channel lets the thread run what is queued and stop.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    #[test]
    fn jobs_run_in_order_off_the_caller_thread() {
        let w = IoWorker::start("test-io", 8).unwrap();
        let (tx, rx) = channel();
        let caller = std::thread::current().id();
        for i in 0..5 {
            let tx = tx.clone();
            w.submit(Box::new(move || tx.send((i, std::thread::current().id())).unwrap()));
        }
        w.flush();
        assert_eq!(w.pending(), 0);
        assert_eq!(w.pending_handle().get(), 0);
        let got: Vec<_> = rx.try_iter().collect();
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert!(got.iter().all(|g| g.1 != caller));
    }

    #[test]
    fn a_full_queue_hands_the_job_back_and_submit_waits() {
        let w = IoWorker::start("test-io", 1).unwrap();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g = gate.clone();
        // The first job blocks the worker; the second fills the queue; the third is handed back.
        w.submit(Box::new(move || {
            let mut open = g.0.lock();
            while !*open {
                g.1.wait(&mut open);
            }
        }));
        let mut queued = 0;
        let mut refused = 0;
        for _ in 0..3 {
            match w.try_submit(Box::new(|| {})) {
                Ok(()) => queued += 1,
                Err(_) => refused += 1,
            }
        }
        assert!(queued <= 1 && refused >= 2, "queued {queued}, refused {refused}");
        assert_eq!(w.pending(), 1 + queued);
        assert_eq!(w.pending_handle().get(), 1 + queued);
        *gate.0.lock() = true;
        gate.1.notify_all();
        w.flush();
        assert_eq!(w.pending(), 0);
        // With room again, submit queues (and waits for room while full).
        let ran = Arc::new(AtomicU64::new(0));
        for _ in 0..4 {
            let r = ran.clone();
            assert!(w.submit(Box::new(move || {
                std::thread::sleep(Duration::from_millis(2));
                r.fetch_add(1, Ordering::Relaxed);
            })));
        }
        drop(w); // runs what is queued, then joins
        assert_eq!(ran.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_panicking_job_is_counted_and_the_worker_goes_on() {
        let w = IoWorker::start("test-io", 4).unwrap();
        w.submit(Box::new(|| panic!("boom")));
        let (tx, rx) = channel();
        w.submit(Box::new(move || tx.send(7).unwrap()));
        w.flush();
        assert_eq!(w.panics(), 1);
        assert_eq!(rx.recv().unwrap(), 7);
    }
}
