//! Prefix reuse: a finished (or cancelled) job's session is *parked* with exactly the tokens it has processed. A new
//! job takes the parked session that lets it skip the most prompt tokens and feeds only the rest: a parked session
//! whose tokens are a prefix of the prompt is used as is (when they equal the whole prompt, its stored logits are
//! sampled directly); otherwise a copy of it is rolled back to the common prefix when the runner can: anywhere
//! ([`Runner::can_truncate`]) or within its roll-back reach ([`Runner::rollback_floor`]; the real engine rolls back
//! exactly, recomputing nothing, up to R = 1024 tokens). Runners without unbounded truncation also get a copy of
//! every freshly prefilled prompt parked ([`Runner::fork`]), so a request that diverges right after the prompt (a
//! retry, a re-rendered assistant turn) skips it even beyond the roll-back reach. The parked sessions are the
//! RAM KV tier, bounded by bytes: least-recently-used ones are evicted (saved to the KV tiers first, when there
//! are) while their [`Runner::session_bytes`] sum exceeds `max_parked_bytes`, beyond `max_parked` sessions (a
//! bound on the runner's session table, not the cache policy), or when the runner's session table is full.

use super::Worker;
use crate::kvdisk::DiskEvent;
use crate::metrics::CacheTier;
use crate::model::RunnerSessionId;

pub(super) struct Parked {
    pub(super) session: RunnerSessionId,
    pub(super) tokens: Vec<u32>,
    pub(super) last_used: u64,
    /// [`Runner::session_bytes`] when it was parked.
    pub(super) bytes: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Worker {
    /// The parked session that lets the most of `prompt` be skipped, and how many tokens: its index in `parked`.
    pub(super) fn best_parked(&self, prompt: &[u32]) -> Option<(usize, usize)> {
        let can_truncate = self.runner.can_truncate();
        let runner = self.runner.as_ref();
        let usable = |p: &Parked| -> usize {
            let lcp = common_prefix(&p.tokens, prompt);
            if lcp == p.tokens.len() && (lcp < prompt.len() || runner.logits(p.session).is_some()) {
                lcp // the prompt extends the parked tokens (or equals them, logits included)
            } else if can_truncate {
                lcp.min(prompt.len() - 1)
            } else {
                // Roll back to the common prefix (keeping one prompt token to feed, for its logits) if in reach.
                let n = lcp.min(prompt.len() - 1);
                runner.rollback_floor(p.session).filter(|&f| f <= n).map_or(0, |_| n)
            }
        };
        self.parked
            .iter()
            .enumerate()
            .map(|(i, p)| (i, usable(p)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, self.parked[i].last_used))
    }

    /// A session for `prompt`: `restored` (a session the KV tiers loaded, and the prompt tokens it holds) when it
    /// covers more of the prompt than any parked session, else the parked one that lets the most prompt tokens be
    /// skipped, else a fresh one. Returns the session and the number of prompt tokens it already holds
    /// (`== prompt.len()` only when the session also holds the logits that follow the prompt).
    pub(super) fn acquire(
        &mut self,
        prompt: &[u32],
        restored: Option<(RunnerSessionId, usize)>,
    ) -> Result<(RunnerSessionId, usize, CacheTier), String> {
        let can_truncate = self.runner.can_truncate();
        let best = self.best_parked(prompt);
        if let Some((s, n)) = restored {
            if n > best.map_or(0, |(_, n)| n) {
                return Ok((s, n, CacheTier::Disk));
            }
            // A parked session overtook it while it loaded.
            self.free(s);
        }
        if let Some((i, n)) = best {
            let extends = n == self.parked[i].tokens.len();
            if !can_truncate || !extends {
                // Keep the parked state (whole history) for the next request that shares it; the job continues on
                // a copy, cut back to the common prefix when the prompt diverges.
                if let Some(copy) = self.runner.fork(self.parked[i].session) {
                    if extends || self.runner.truncate(copy, n) {
                        self.clock += 1;
                        self.parked[i].last_used = self.clock;
                        return Ok((copy, n, CacheTier::Host));
                    }
                    self.free(copy);
                }
            }
            let p = self.parked.swap_remove(i);
            if extends || self.runner.truncate(p.session, n) {
                return Ok((p.session, n, CacheTier::Host));
            }
            self.free(p.session);
        }
        loop {
            match self.runner.create_session() {
                Ok(s) => return Ok((s, 0, CacheTier::Host)),
                Err(e) => {
                    if !self.evict_lru() {
                        return Err(format!("cannot create a session: {e}"));
                    }
                }
            }
        }
    }

    /// Free the least recently used parked session; `false` when there is none.
    pub(super) fn evict_lru(&mut self) -> bool {
        let Some(lru) = self.parked.iter().enumerate().min_by_key(|(_, p)| p.last_used).map(|(i, _)| i) else {
            return false;
        };
        let p = self.parked.swap_remove(lru);
        self.disk_event(p.session, DiskEvent::Evict);
        self.free(p.session);
        true
    }

    /// Keep a copy of a session whose prompt was just processed (when the runner cannot truncate, this is what lets
    /// a request that diverges after the prompt reuse it).
    pub(super) fn checkpoint_prompt(&mut self, session: RunnerSessionId, prompt: &[u32]) {
        if self.runner.can_truncate() || self.config.max_parked == 0 {
            return;
        }
        if self.parked.iter().any(|p| p.tokens == prompt) {
            return;
        }
        let copy = match self.runner.fork(session) {
            Some(c) => Some(c),
            None if self.evict_lru() => self.runner.fork(session),
            None => None,
        };
        if let Some(c) = copy {
            self.park(c, prompt.to_vec());
        }
    }

    pub(super) fn park(&mut self, session: RunnerSessionId, mut tokens: Vec<u32>) {
        self.clock += 1;
        tokens.shrink_to_fit();
        let bytes = self.runner.session_bytes(session);
        self.parked.push(Parked { session, tokens, last_used: self.clock, bytes });
        while self.parked.len() > self.config.max_parked || self.parked_bytes() > self.config.max_parked_bytes {
            self.evict_lru();
        }
    }

    /// Bytes the parked sessions hold (the RAM tier's use).
    pub(super) fn parked_bytes(&self) -> u64 {
        self.parked.iter().map(|p| p.bytes).sum()
    }
}
