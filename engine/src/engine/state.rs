//! Session state beyond the tick: roll back and truncate ([`Engine::rollback`], [`Engine::truncate`]), fork,
//! snapshot and restore ([`Engine::fork`], [`Engine::snapshot`], [`Engine::restore`]), and the KV accounting a
//! scheduler reads ([`Engine::kv_bytes`], [`Engine::page_pool`]).
//!
//! Invariant: every operation here leaves a session exactly as a cold prefill of its kept history would (KV state,
//! position, logits where stated), or fails and changes nothing. Roll back is exact (the roll-back log restores
//! what later tokens overwrote; nothing is recomputed); truncate recomputes where the log does not reach.

use super::{apes, Engine};
#[cfg(doc)]
use crate::backend::Backend;
use crate::tables::{PageLedger, SessionId, SessionKv, SessionSnapshot};
use crate::{Error, Result};

impl Engine {
    /// Smallest length session `id` can be rolled back to in place ([`Engine::rollback`]); its position when
    /// it cannot be rolled back at all (no live roll-back log: log off, or a device copy without one). The log is
    /// the host's ([`crate::tables::kv`]) or, for a session a device backend keeps, the device's
    /// ([`Backend::device_rollback_floor`]).
    pub fn rollback_floor(&self, id: SessionId) -> Result<usize> {
        let s = self.slot(id)?;
        let (kv, pos, cfg) = (&self.sessions.kv[s], self.sessions.pos[s], &self.model.config);
        let host = kv.rollback_floor(cfg, pos);
        Ok(self.backend.device_rollback_floor(s, kv, cfg, pos).map_or(host, |d| d.min(host)))
    }

    /// Rolls session `id` back to its first `len` processed tokens in place, recomputing nothing: the KV state
    /// becomes exactly that of a cold prefill of `history[..len]` (see [`crate::tables::kv`]), queued tokens are
    /// dropped, and the logits are cleared unless `len` is the current position (feed the next token to get
    /// logits again). Needs `rollback_floor(id) <= len <= position`; otherwise an error and nothing changes.
    pub fn rollback(&mut self, id: SessionId, len: usize) -> Result<()> {
        let s = self.slot(id)?;
        let pos = self.sessions.pos[s];
        let apes = apes(&self.model);
        if !self.sessions.kv[s].rollback(&self.model.config, &apes, pos, len)
            && !self.backend.rollback_kv(s, &mut self.sessions.kv[s], &self.model, pos, len)?
        {
            let floor = self.rollback_floor(id)?;
            return Err(Error::InvalidArgument(format!(
                "cannot roll a session of {pos} tokens back to {len} in place (reachable: {floor}..={pos})"
            )));
        }
        self.sessions.pending[s].clear();
        self.sessions.pending_hidden[s].clear();
        if len < pos {
            self.sessions.pos[s] = len;
            self.sessions.history[s].truncate(len);
            self.sessions.logits[s].clear();
            self.sessions.all_logits[s].clear();
            self.cut_hidden(s, len);
        }
        Ok(())
    }

    /// Drops the kept final streams of positions `len..`.
    pub(super) fn cut_hidden(&mut self, s: usize, len: usize) {
        let hcd = self.kept_width();
        let h = &mut self.sessions.hidden[s];
        if h.0 >= len {
            h.1.clear();
            h.0 = len;
        } else {
            h.1.truncate((len - h.0) * hcd);
        }
    }

    /// [`Engine::rollback`] on a snapshot taken from this engine ([`Engine::snapshot`]): afterwards it is the
    /// snapshot of the first `len` tokens, without logits (unless `len` is its position). Needs the snapshot's
    /// roll-back log to reach `len` (see [`crate::tables::SessionKv::rollback_floor`]); otherwise an error and
    /// nothing changes.
    pub fn rollback_snapshot(&self, snap: &mut SessionSnapshot, len: usize) -> Result<()> {
        let apes = apes(&self.model);
        if snap.history.len() != snap.pos || !snap.kv.rollback(&self.model.config, &apes, snap.pos, len) {
            return Err(Error::InvalidArgument(format!("cannot roll a snapshot of {} tokens back to {len}", snap.pos)));
        }
        if len < snap.pos {
            snap.pos = len;
            snap.history.truncate(len);
            snap.logits.clear();
        }
        Ok(())
    }

    /// Rolls a session back to its first `len` processed tokens (queued tokens are dropped); afterwards (once the
    /// queued token ran) the state, logits included, is identical to never having gone further. Within the
    /// roll-back log's reach ([`Engine::rollback_floor`] `< len`) this is [`Engine::rollback`] to `len − 1` with
    /// token `len − 1` queued again (one token recomputed, for its logits); beyond it the state is cleared and
    /// `history[..len]` is queued again (the next ticks recompute it).
    pub fn truncate(&mut self, id: SessionId, len: usize) -> Result<()> {
        let s = self.slot(id)?;
        let pos = self.sessions.pos[s];
        if len > pos {
            return Err(Error::InvalidArgument(format!("cannot truncate a session of {pos} tokens to {len}")));
        }
        if self.model.mtp_input.is_some() && len < pos {
            // Recomputing would need the input streams of the kept tokens, which are not kept.
            return Err(Error::InvalidArgument("an MTP drafter's session rolls back; it cannot be truncated".into()));
        }
        self.sessions.pending[s].clear();
        self.sessions.pending_hidden[s].clear();
        if len == pos {
            return Ok(());
        }
        self.cut_hidden(s, len);
        if len > 0 && self.rollback_floor(id)? < len {
            let last = self.sessions.history[s][len - 1];
            self.rollback(id, len - 1)?;
            self.sessions.pending[s].push_back(last);
            return Ok(());
        }
        let mut hist = std::mem::take(&mut self.sessions.history[s]);
        hist.truncate(len);
        self.sessions.hidden[s] = (0, Vec::new());
        self.sessions.kv[s].clear();
        self.sessions.pos[s] = 0;
        self.sessions.logits[s].clear();
        self.sessions.all_logits[s].clear();
        self.sessions.pending[s].extend(hist.iter().copied());
        hist.clear();
        self.sessions.history[s] = hist;
        Ok(())
    }

    /// Frees a session (its slot and allocations are reused).
    pub fn free_session(&mut self, id: SessionId) -> Result<()> {
        if self.sessions.free(id) {
            self.backend.release_kv(id.slot as usize);
            Ok(())
        } else {
            Err(Error::Session(format!("unknown or freed session {id:?}")))
        }
    }

    /// The complete state of a session (queued tokens are not part of it). A device-resident backend's KV is
    /// synced into the copy ([`Backend::sync_kv`]); the session's own host arrays stay lazily synced.
    /// The KV pages are shared with the session (not copied); the private tail is, and counts in
    /// [`Engine::kv_bytes_copied`].
    pub fn snapshot(&self, id: SessionId) -> Result<SessionSnapshot> {
        let s = self.slot(id)?;
        let mut kv = self.sessions.kv[s].clone();
        kv.pool.add_copied(kv.tail_bytes());
        self.backend.sync_kv(s, &mut kv)?;
        Ok(SessionSnapshot {
            pos: self.sessions.pos[s],
            history: self.sessions.history[s].clone(),
            kv,
            logits: self.whole_logits(s),
        })
    }

    /// Brings session `id`'s host KV arrays up to date with the backend's device copy (a no-op on the CPU
    /// backend); afterwards they may be read directly.
    pub fn sync_kv(&mut self, id: SessionId) -> Result<()> {
        let s = self.slot(id)?;
        self.backend.sync_kv(s, &mut self.sessions.kv[s])
    }

    /// Bytes of KV state session `id` holds (see [`SessionKv::bytes`]).
    pub fn kv_bytes(&self, id: SessionId) -> Result<u64> {
        Ok(self.sessions.kv[self.slot(id)?].bytes())
    }

    /// `(device, host)` bytes of session `id`'s KV state: its device copy (wgpu keeps KV resident; 0 on the CPU
    /// backend) and its host arrays (the CPU backend's state, or wgpu's lazily synced mirror).
    pub fn kv_bytes_by_tier(&self, id: SessionId) -> Result<(u64, u64)> {
        let kv = &self.sessions.kv[self.slot(id)?];
        Ok((kv.device_bytes(), kv.host_bytes()))
    }

    /// A new session with the same state as `id` (history, KV, logits; nothing queued). The KV pages and roll-back
    /// log chunks are shared by reference, so this copies only the private tail (raw window rings and compressor
    /// frontiers: [`SessionKv::tail_bytes`], independent of the session's length); either session's first append
    /// into a shared partial page or log chunk copies that page or chunk (copy on write). All of it counts in
    /// [`Engine::kv_bytes_copied`]. A session whose state lives on a device backend (its host arrays stale) is
    /// forked there instead ([`Backend::fork_kv`]; on wgpu the device KV pages are shared the same way and the
    /// ring, frontiers and roll-back log are device-side copies, nothing through the host; those copies
    /// and the device's copy on write count too); the fork's host arrays start stale too.
    pub fn fork(&mut self, id: SessionId) -> Result<SessionId> {
        let s = self.slot(id)?;
        let (pos, history, logits) = (self.sessions.pos[s], self.sessions.history[s].clone(), self.whole_logits(s));
        if self.sessions.kv[s].sync.host_stale {
            let placeholder = SessionKv::new_in(&self.model.config, 0, &self.pages);
            let new = self.install(placeholder, pos, history.clone(), logits.clone());
            let ns = new.slot as usize;
            if let Some((tag, bytes)) = self.backend.fork_kv(s, &self.sessions.kv[s], ns)? {
                self.sessions.kv[ns].sync = tag;
                self.pages.add_copied(bytes);
                return Ok(new);
            }
            self.free_session(new)?;
        }
        self.backend.sync_kv(s, &mut self.sessions.kv[s])?;
        let kv = self.sessions.kv[s].fork();
        Ok(self.install(kv, pos, history, logits))
    }

    /// Slot `s`'s logits row when it is whole; empty when it holds only candidates (a copy of the session must
    /// not hand another sampler a row it cannot use).
    fn whole_logits(&self, s: usize) -> Vec<f32> {
        if self.sessions.logits_partial[s] {
            Vec::new()
        } else {
            self.sessions.logits[s].clone()
        }
    }

    /// KV bytes copied by this engine's sessions so far: private tails of forks and snapshots, copy on write of
    /// shared partial pages and log chunks (see [`Engine::fork`]).
    pub fn kv_bytes_copied(&self) -> u64 {
        self.pages.bytes_copied()
    }

    /// `(live, shared)` KV pages and log chunks of the backend's device tier (see [`Backend::device_kv_pages`]),
    /// or `None` when the backend keeps KV on the host.
    pub fn device_kv_pages(&self) -> Option<(usize, usize)> {
        self.backend.device_kv_pages()
    }

    /// The pool this engine's sessions' pages report to (live pages and bytes; see [`crate::tables::pages`]).
    pub fn page_pool(&self) -> &PageLedger {
        &self.pages
    }

    /// A new session slot holding `kv` at `pos` (host arrays authoritative, roll-back log per this engine).
    fn install(&mut self, mut kv: SessionKv, pos: usize, mut history: Vec<u32>, mut logits: Vec<f32>) -> SessionId {
        let id = self.sessions.create(SessionKv::default);
        let s = id.slot as usize;
        let (cfg, ctx) = (&self.model.config, self.ctx);
        let want = ctx.min(SessionKv::RESERVE_TOKENS_MAX);
        kv.reserve_tokens(cfg, want);
        // Host arrays are authoritative for a new session: the backend uploads them at its next tick.
        kv.sync = crate::tables::KvSync::default();
        // A kept roll-back log is used when it is live and has this engine's shape; else a fresh one.
        kv.enable_log(cfg, ctx, self.rollback_tokens());
        history.reserve(want.saturating_sub(history.len()));
        logits.reserve(cfg.vocab.saturating_sub(logits.len()));
        self.sessions.kv[s] = kv;
        self.sessions.pos[s] = pos;
        self.sessions.history[s] = history;
        self.sessions.logits[s] = logits;
        self.sessions.want_all_logits[s] = self.opts.prefill_logits;
        id
    }

    /// Creates a session from a snapshot (validated against this model's shapes). Its pages are taken over as
    /// they are (shared with the snapshot's other holders; they keep reporting to the pool they were made in),
    /// except full pages a live session holds for the same token prefix: those are replaced by the live session's
    /// (a snapshot loaded from disk joins the live pages; its duplicates are released).
    pub fn restore(&mut self, snap: SessionSnapshot) -> Result<SessionId> {
        let fresh = SessionKv::new(&self.model.config, 0);
        let bad = |what: String| Error::Session(format!("snapshot does not fit this model: {what}"));
        if snap.kv.layers.len() != fresh.layers.len() {
            return Err(bad(format!("{} layers, model has {}", snap.kv.layers.len(), fresh.layers.len())));
        }
        if snap.history.len() != snap.pos || snap.pos > self.ctx {
            return Err(bad(format!(
                "position {} with {} history tokens (ctx {})",
                snap.pos,
                snap.history.len(),
                self.ctx
            )));
        }
        let c = &self.model.config;
        for (l, (a, b)) in snap.kv.layers.iter().zip(&fresh.layers).enumerate() {
            let ratio = c.compress_ratios[l];
            let n_rows = snap.pos.checked_div(ratio).unwrap_or(0);
            let same_front = |x: &Option<crate::tables::Frontier>, y: &Option<crate::tables::Frontier>| match (x, y) {
                (None, None) => true,
                (Some(x), Some(y)) => {
                    x.ratio == y.ratio
                        && x.dim == y.dim
                        && x.coff == y.coff
                        && x.pending_kv.len() == y.pending_kv.len()
                        && x.pending_gate.len() == y.pending_gate.len()
                        && x.prev_kv.len() == y.prev_kv.len()
                        && x.prev_gate.len() == y.prev_gate.len()
                        && x.n_pending == snap.pos % x.ratio
                }
                _ => false,
            };
            let table_ok = |x: &crate::tables::PagedRows, y: &crate::tables::PagedRows, on: bool| {
                x.width() == y.width()
                    && (x.rows_per_page() == y.rows_per_page() || !on)
                    && x.rows() == if on { n_rows } else { 0 }
            };
            let ok = a.ring.len() == b.ring.len()
                && table_ok(&a.comp_rows, &b.comp_rows, b.comp.is_some())
                && table_ok(&a.idx_rows, &b.idx_rows, b.idx.is_some())
                && same_front(&a.comp, &b.comp)
                && same_front(&a.idx, &b.idx);
            if !ok {
                return Err(bad(format!("layer {l} state has the wrong shape")));
            }
        }
        if !snap.logits.is_empty() && snap.logits.len() != c.vocab {
            return Err(bad(format!("{} logits, vocab is {}", snap.logits.len(), c.vocab)));
        }
        if snap.kv.sync.host_stale {
            return Err(Error::Session(
                "snapshot KV is stale device state: take snapshots with Engine::snapshot".into(),
            ));
        }
        let mut kv = snap.kv;
        self.join_live_pages(&mut kv, &snap.history);
        Ok(self.install(kv, snap.pos, snap.history, snap.logits))
    }

    /// Gives `kv` (the state of `history`, e.g. loaded from disk) the full pages that the live session sharing the
    /// longest prefix with it holds for that prefix ([`crate::tables::PagedRows::adopt_pages`]): compressed rows
    /// are a function of the token prefix, so they are the same rows (for a snapshot from this engine's backend
    /// and mode, bit for bit), and the restored session joins the live pages instead of keeping a second copy.
    /// Pointer swaps and one row compared per page, so it is cheap on the engine's thread. Sessions whose host
    /// arrays are stale (their state is on a device) are not used. Returns the pages taken over.
    fn join_live_pages(&self, kv: &mut SessionKv, history: &[u32]) -> usize {
        let t = &self.sessions;
        let common = |s: usize| t.history[s].iter().zip(history).take_while(|(a, b)| a == b).count();
        let best = (0..t.alive.len()).filter(|&s| t.alive[s] && !t.kv[s].sync.host_stale).map(|s| (common(s), s)).max();
        let Some((lcp, s)) = best.filter(|&(lcp, _)| lcp >= crate::tables::PAGE_TOKENS) else { return 0 };
        let cfg = &self.model.config;
        let mut adopted = 0;
        for (l, (mine, live)) in kv.layers.iter_mut().zip(&t.kv[s].layers).enumerate() {
            let ratio = cfg.compress_ratios[l];
            if ratio == 0 {
                continue;
            }
            // Rows up to `lcp / ratio` are a function of the common prefix alone.
            for (a, b) in [(&mut mine.comp_rows, &live.comp_rows), (&mut mine.idx_rows, &live.idx_rows)] {
                let pages = (lcp / ratio) / a.rows_per_page().max(1);
                adopted += a.adopt_pages(b, pages);
            }
        }
        adopted
    }
}
