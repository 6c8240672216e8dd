//! The session table: one slot per session, struct-of-arrays, ids are slot indices reused through a free list.
//!
//! Per slot: `pos` (tokens processed), `history` (token ids processed), `pending` (queued, not yet processed),
//! `kv` (the [`SessionKv`]), `logits` (of the last processed position; with `logit_candidates` > 0 only its best
//! `logit_candidates` values are real, the rest −∞, and `logits_partial` says so), `all_logits` (every processed position's
//! logits when prefill logits were requested), `keep_hidden` / `hidden` (final streams kept for an MTP drafter),
//! `pending_hidden` (a drafter model's per-token input streams), `alive`. A freed slot releases its KV pages and keeps
//! its other allocations for the next session.
//!
//! "Slot" means this one thing across the engine: a session's row in this table. The graph's runs
//! ([`crate::graph::Run::slot`]) and the backends' per-session KV calls name sessions by it; window rings, worker
//! threads and expert groups use other words (ring index, worker index, [`crate::backend::cpu::moe::ExpertGroup`]).

use std::collections::VecDeque;

use crate::tables::kv::SessionKv;

/// A session handle (slot index + generation, so a stale id of a reused slot is rejected).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionId {
    pub slot: u32,
    pub generation: u32,
}

/// The complete state of a session as plain data (what `snapshot` returns and `restore` accepts).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionSnapshot {
    pub pos: usize,
    pub history: Vec<u32>,
    pub kv: SessionKv,
    /// Logits of the last processed position (empty before the first token).
    pub logits: Vec<f32>,
}

/// The table. See the module docs.
#[derive(Debug, Default)]
pub struct SessionTable {
    pub pos: Vec<usize>,
    pub history: Vec<Vec<u32>>,
    pub pending: Vec<VecDeque<u32>>,
    pub kv: Vec<SessionKv>,
    pub logits: Vec<Vec<f32>>,
    pub all_logits: Vec<Vec<f32>>,
    pub want_all_logits: Vec<bool>,
    /// 0: ticks bring back whole logit rows; k > 0: the session's sampler reads no more than the `k` best logits
    /// ([`crate::engine::Engine::set_logit_candidates`]).
    pub logit_candidates: Vec<usize>,
    /// `logits` holds only the candidates of a tick that read back no more (every other value −∞).
    pub logits_partial: Vec<bool>,
    /// Final streams of the last this many processed positions are kept (0: none;
    /// [`crate::engine::Engine::set_keep_hidden`]).
    pub keep_hidden: Vec<usize>,
    /// The kept final streams: `(first position, [n, hc·d])`, since the last take.
    pub hidden: Vec<(usize, Vec<f32>)>,
    /// The MTP drafter's input streams of the queued tokens, `hc·d` per token in queue order (empty for a target
    /// model; for a drafter always `pending.len() · hc·d` values).
    pub pending_hidden: Vec<Vec<f32>>,
    pub alive: Vec<bool>,
    pub generation: Vec<u32>,
    pub free: Vec<u32>,
}

impl SessionTable {
    /// Allocates a slot; `make_kv` builds the KV state for a fresh slot (reused slots are cleared instead).
    pub fn create(&mut self, make_kv: impl FnOnce() -> SessionKv) -> SessionId {
        if let Some(slot) = self.free.pop() {
            let s = slot as usize;
            self.pos[s] = 0;
            self.history[s].clear();
            self.pending[s].clear();
            self.kv[s].clear();
            self.logits[s].clear();
            self.all_logits[s].clear();
            self.want_all_logits[s] = false;
            self.logit_candidates[s] = 0;
            self.logits_partial[s] = false;
            self.keep_hidden[s] = 0;
            self.hidden[s] = (0, Vec::new());
            self.pending_hidden[s].clear();
            self.alive[s] = true;
            self.generation[s] = self.generation[s].wrapping_add(1);
            return SessionId { slot, generation: self.generation[s] };
        }
        let slot = self.pos.len() as u32;
        self.pos.push(0);
        self.history.push(Vec::new());
        self.pending.push(VecDeque::new());
        self.kv.push(make_kv());
        self.logits.push(Vec::new());
        self.all_logits.push(Vec::new());
        self.want_all_logits.push(false);
        self.logit_candidates.push(0);
        self.logits_partial.push(false);
        self.keep_hidden.push(0);
        self.hidden.push((0, Vec::new()));
        self.pending_hidden.push(Vec::new());
        self.alive.push(true);
        self.generation.push(0);
        SessionId { slot, generation: 0 }
    }

    /// The slot of a live session, or `None` for a freed / stale / unknown id.
    pub fn slot(&self, id: SessionId) -> Option<usize> {
        let s = id.slot as usize;
        (s < self.alive.len() && self.alive[s] && self.generation[s] == id.generation).then_some(s)
    }

    /// Frees a slot (its allocations are kept for reuse). Returns false for an unknown id.
    pub fn free(&mut self, id: SessionId) -> bool {
        match self.slot(id) {
            Some(s) => {
                self.alive[s] = false;
                self.pending[s].clear();
                self.pending_hidden[s].clear();
                self.hidden[s].1.clear();
                // Its pages go back now (shared ones live on in their other holders).
                self.kv[s].release_pages();
                self.free.push(s as u32);
                true
            }
            None => false,
        }
    }

    /// Live slots with queued tokens, in slot order.
    pub fn with_pending(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.alive.len()).filter(|&s| self.alive[s] && !self.pending[s].is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_and_stale_ids_rejected() {
        let mut t = SessionTable::default();
        let a = t.create(SessionKv::default);
        let b = t.create(SessionKv::default);
        assert_ne!(a.slot, b.slot);
        let sa = t.slot(a).unwrap();
        t.pending[sa].push_back(5);
        assert_eq!(t.with_pending().collect::<Vec<_>>(), vec![a.slot as usize]);
        assert!(t.free(a));
        assert!(!t.free(a));
        assert_eq!(t.slot(a), None);
        let c = t.create(SessionKv::default);
        assert_eq!(c.slot, a.slot);
        assert_ne!(c, a);
        assert_eq!(t.slot(a), None);
        assert!(t.slot(c).is_some());
        assert!(t.pending[c.slot as usize].is_empty());
    }
}
