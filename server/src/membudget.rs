//! One memory budget for request bodies being read and prompts being tokenized, across all connections.
//!
//! The body limit bounds one request; this bounds them all together. Before a request's body is read it reserves
//! [`COPIES`] times its declared length (the body, the strings parsed from it, the rendered prompt and the
//! tokenizer's working copy all live at once), or [`COPIES`] times the body limit when the length is not declared;
//! a reservation larger than the whole budget is cut to the budget, so any single request can run. The reservation
//! is held while the handler parses, renders and tokenizes, and returned when it answers (a streamed answer has
//! dropped the body and the prompt text by then). Past the budget a request waits, in arrival order, for at most
//! the configured wait; then it is answered 503 with `Retry-After` without its body being read.
//!
//! Small bodies (under [`SMALL_BODY`]) reserve nothing: `/health`, status pages and ordinary chat turns never wait
//! behind a burst of huge prompts, and what they can hold together is bounded by the connection cap.
//!
//! Memory handed back: after a burst the allocator keeps freed pages mapped (glibc keeps them in its arenas), so
//! the resident size would stay near the peak. When the last reservation of a burst that held a big body (at least
//! [`TRIM_AFTER`]) is returned, the allocator is asked to give free memory back to the system (`malloc_trim` on
//! glibc, off the async threads).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Copies of a body that exist at once while it is parsed, rendered and tokenized.
pub const COPIES: usize = 4;
/// Bodies below this many bytes reserve nothing.
pub const SMALL_BODY: usize = 64 << 10;
/// A burst that held a body at least this big ends with the allocator trimmed.
pub const TRIM_AFTER: usize = 1 << 20;
/// The budget is counted in units of this many bytes (the semaphore counts units).
const UNIT: usize = 64 << 10;

/// The shared budget (see the module docs).
#[derive(Debug)]
pub struct RequestMemory {
    sem: Arc<Semaphore>,
    units: usize,
    wait: Duration,
    /// Reservations currently held.
    held: AtomicUsize,
    /// A big body was held since the last trim.
    trim_due: AtomicBool,
}

/// Why a reservation was not granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetFull {
    /// Seconds a client should wait before retrying.
    pub retry_after: u64,
}

/// Memory reserved for one request; returned on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<RequestMemory>,
    _permit: OwnedSemaphorePermit,
}

impl RequestMemory {
    /// A budget of `bytes` (at least one unit) where a request waits at most `wait` for room.
    pub fn new(bytes: usize, wait: Duration) -> Arc<Self> {
        let units = bytes.div_ceil(UNIT).clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
        Arc::new(RequestMemory {
            sem: Arc::new(Semaphore::new(units)),
            units,
            wait,
            held: AtomicUsize::new(0),
            trim_due: AtomicBool::new(false),
        })
    }

    /// The budget in bytes.
    pub fn bytes(&self) -> usize {
        self.units * UNIT
    }

    /// Bytes reserved right now.
    pub fn reserved_bytes(&self) -> usize {
        (self.units - self.sem.available_permits().min(self.units)) * UNIT
    }

    /// Reserve room for a body of `body_bytes` (see the module docs): `Ok(None)` for a small body, `Err` after
    /// waiting the configured time in vain.
    pub async fn reserve(self: &Arc<Self>, body_bytes: usize) -> Result<Option<Reservation>, BudgetFull> {
        if body_bytes < SMALL_BODY {
            return Ok(None);
        }
        let units = body_bytes.saturating_mul(COPIES).div_ceil(UNIT).clamp(1, self.units);
        let acquire = self.sem.clone().acquire_many_owned(units as u32);
        match tokio::time::timeout(self.wait, acquire).await {
            Ok(Ok(permit)) => {
                self.held.fetch_add(1, Ordering::AcqRel);
                if body_bytes >= TRIM_AFTER {
                    self.trim_due.store(true, Ordering::Release);
                }
                Ok(Some(Reservation { budget: self.clone(), _permit: permit }))
            }
            // Closed never happens (the semaphore is never closed); a timeout is the busy answer.
            Ok(Err(_)) | Err(_) => Err(BudgetFull { retry_after: self.wait.as_secs().clamp(1, 10) }),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let last = self.budget.held.fetch_sub(1, Ordering::AcqRel) == 1;
        if last && self.budget.trim_due.swap(false, Ordering::AcqRel) {
            // The permit is returned after this body runs; the trim itself runs off the async threads.
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn_blocking(trim);
                }
                Err(_) => trim(),
            }
        }
    }
}

/// Ask the allocator to return free memory to the system.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` only releases free memory of glibc's own arenas; it takes no pointers and is
        // thread-safe (it locks each arena while trimming it).
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn small_bodies_pass_big_ones_wait_then_get_busy() {
        let m = RequestMemory::new(8 << 20, Duration::from_millis(100));
        assert!(m.reserve(1000).await.unwrap().is_none());
        let a = m.reserve(1 << 20).await.unwrap().expect("a reservation");
        assert_eq!(m.reserved_bytes(), 4 << 20);
        let b = m.reserve(1 << 20).await.unwrap().expect("room for a second");
        assert_eq!(m.reserved_bytes(), 8 << 20);
        let busy = m.reserve(1 << 20).await.unwrap_err();
        assert!(busy.retry_after >= 1);
        // Small bodies still pass while the budget is full.
        assert!(m.reserve(100).await.unwrap().is_none());
        drop(a);
        let c = m.reserve(1 << 20).await.unwrap().expect("room again after a release");
        drop((b, c));
        assert_eq!(m.reserved_bytes(), 0);
    }

    #[tokio::test]
    async fn a_body_larger_than_the_budget_still_runs_alone() {
        let m = RequestMemory::new(4 << 20, Duration::from_millis(50));
        let r = m.reserve(100 << 20).await.unwrap().expect("cut to the whole budget");
        assert_eq!(m.reserved_bytes(), m.bytes());
        assert!(m.reserve(1 << 20).await.is_err());
        drop(r);
        assert!(m.reserve(1 << 20).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_waiting_request_gets_room_when_it_is_freed() {
        let m = RequestMemory::new(4 << 20, Duration::from_secs(5));
        let r = m.reserve(1 << 20).await.unwrap().unwrap();
        let m2 = m.clone();
        let waiter = tokio::spawn(async move { m2.reserve(1 << 20).await.map(|r| r.is_some()) });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "waits while the budget is full");
        drop(r);
        assert_eq!(waiter.await.unwrap(), Ok(true));
    }
}
