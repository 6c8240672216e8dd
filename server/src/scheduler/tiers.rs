//! The scheduler's side of the KV tiers behind the RAM tier ([`crate::kvdisk::DiskTier`]): it reports what happens
//! to sessions (the tier decides what to save and queues it on its I/O worker), and a job whose prompt the tiers may
//! hold waits in `restoring` while the worker loads it; the scheduler never waits on a disk or a socket. Restores
//! count against `max_active`; their results are installed at a tick boundary ([`Worker::take_restored`]) or, when
//! nothing else runs, as soon as they arrive (the run loop waits on requests and results together).

use std::sync::atomic::Ordering;
use std::time::Instant;

use ds4_engine::sampler::Sampler;

use super::{GenRequest, Worker};
use crate::kvdisk::{DiskEvent, Restored};
use crate::model::RunnerSessionId;

/// A job waiting for the KV tiers' I/O worker to load its prompt's cached prefix.
pub(super) struct Restoring {
    pub(super) ticket: u64,
    pub(super) job: GenRequest,
    pub(super) submitted: Instant,
    pub(super) sampler: Sampler,
}

impl Worker {
    /// Queues a restore for `job` when the KV tiers could beat the RAM tier for its prompt; the job then waits in
    /// `restoring`. Hands the job back when it should start now (no tier, nothing to gain, a full I/O queue).
    pub(super) fn try_restore(
        &mut self,
        job: GenRequest,
        submitted: Instant,
        sampler: Sampler,
    ) -> Option<(GenRequest, Instant, Sampler)> {
        let ram = self.best_parked(&job.prompt).map_or(0, |(_, n)| n);
        let Some(t) = &mut self.tier else { return Some((job, submitted, sampler)) };
        if t.could_beat(&job.prompt, ram) {
            self.next_ticket += 1;
            if t.start_restore(self.next_ticket, job.prompt.clone(), ram) {
                self.restoring.push(Restoring { ticket: self.next_ticket, job, submitted, sampler });
                return None;
            }
        }
        Some((job, submitted, sampler))
    }

    /// Reports `event` on `session` to the KV tiers (which decide whether to save).
    pub(super) fn disk_event(&mut self, session: RunnerSessionId, event: DiskEvent) {
        if let Some(t) = &mut self.tier {
            t.on_event(self.runner.as_mut(), session, event);
        }
    }

    /// Frees `session` in the runner and the tiers' bookkeeping.
    pub(super) fn free(&mut self, session: RunnerSessionId) {
        self.runner.free_session(session);
        if let Some(t) = &mut self.tier {
            t.forget(session);
        }
    }

    /// Admits the jobs whose restores have come back.
    pub(super) fn take_restored(&mut self) {
        let done: Vec<Restored> = match &self.tier {
            Some(t) if !self.restoring.is_empty() => t.restored().try_iter().collect(),
            _ => return,
        };
        for r in done {
            self.finish_restore(r);
        }
    }

    /// Installs a restore's snapshot (when it still beats the RAM tier) and starts its job.
    pub(super) fn finish_restore(&mut self, r: Restored) {
        let Some(i) = self.restoring.iter().position(|x| x.ticket == r.ticket) else { return };
        let Restoring { job, submitted, sampler, .. } = self.restoring.swap_remove(i);
        if job.events.is_closed() {
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let restored = r.snapshot.and_then(|snap| {
            let n = snap.pos;
            match self.runner.import(snap) {
                Ok(s) => Some((s, n)),
                Err(e) => {
                    tracing::warn!(error = %e, "a restored KV prefix could not be installed; prefilling instead");
                    None
                }
            }
        });
        if let (Some(t), Some((s, n))) = (&mut self.tier, restored) {
            t.note_restored(s, n);
        }
        self.start(job, submitted, sampler, restored);
    }
}
