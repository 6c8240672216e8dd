//! Per-session KV state, as plain data: per layer the raw sliding-window ring, the compressed rows, the indexer
//! key rows, and the compressor frontiers.
//!
//! Layout and invariants (for a session that has processed `pos` tokens):
//! - `ring`: `window` rows of `head_dim`; the row of position `p` lives in slot `p % window` and is valid for
//!   `p >= pos - window`.
//! - `comp_rows`: `pos / ratio` rows of `head_dim`, in order, in refcounted pages of
//!   [`crate::tables::pages::PAGE_TOKENS`] tokens ([`PagedRows`]); row `w` is a pure function of the token prefix
//!   `..(w + 1) * ratio`, so full pages are immutable and shared by every session (fork, snapshot) with that
//!   prefix, and a 256-token span is exactly one page (what the kv crate stores on disk).
//! - `idx_rows`: the same count of `idx_head_dim` rows (CSA layers only).
//! - [`Frontier`]: the partially filled block (`pos % ratio` pending rows of projected features and gate logits,
//!   `ape` already added) and, for CSA, the previous complete block's first-half (`Ca`) features and gates.
//!
//! - `log` ([`TokenLog`], roll-back support, not part of the state): per processed token the inputs that the ring
//!   and the compressors consumed — the raw KV row, and for compressed layers the projected features and gate
//!   logits (before `ape`) of the main and indexer compressors — for the last `cap = R + max(window, 2·ratio)`
//!   tokens, slot `p % cap`. From it [`SessionKv::rollback`] rebuilds the ring and the frontiers of any position
//!   `L ≥ pos − R` exactly (the gates get `ape` added again with the same f32 add), and cuts the row tables back
//!   to `L / ratio` rows: no token is recomputed, and the state equals a cold prefill of the first `L` tokens.
//!   The log is live only while `log.end == pos` (the CPU backend records every processed row; a backend that
//!   keeps KV on a device keeps the same log there instead, and rolls its copy back itself:
//!   [`crate::backend::Backend::rollback_kv`]).
//!   Memory per session and layer: `cap × (head_dim + 2·coff·head_dim + [CSA] 4·idx_head_dim)` f32 (reserved at
//!   creation, touched as tokens arrive). DS4 Flash (`head_dim` 512, `idx_head_dim` 128, window 128, ratios 4 /
//!   128) with R = 1024: ≈ 12 KiB per token on a CSA layer, 6 KiB on an HCA layer, 2 KiB on a window layer —
//!   about 0.4 MB per logged token over the 43 layers, ≈ 0.5 GB per session at R = 1024 (`EngineOptions::rollback`
//!   lowers it; 0 turns the log off and roll back recomputes).
//!
//! Everything is f32; the ring and the frontiers (the private tail) are owned, the pages and log chunks are shared
//! and copied on write, so a clone is a complete snapshot (nothing it references can change) that copies only the
//! tail ([`SessionKv::fork`], [`SessionKv::tail_bytes`]), and restoring it gives bit-identical results.
//! In simulation mode the stored rows are already rounded (KV rows: FP8 on the non-rope dims; indexer rows:
//! Hadamard-rotated, then FP4), exactly as attention reads them; a snapshot taken in one mode must be restored
//! into an engine running the same mode.

use std::sync::Arc;

use crate::model::config::{LayerKind, ModelConfig};
use crate::tables::pages::{rows_per_page, PageLedger, PagedRows};

/// The carried state of one compressor (main or indexer). See the module docs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Frontier {
    /// Tokens per compressed row.
    pub ratio: usize,
    /// Output row width.
    pub dim: usize,
    /// Feature groups per token: 2 for CSA (`Ca | Cb`), 1 for HCA.
    pub coff: usize,
    /// `ratio × coff·dim` projected features of the pending block (first `n_pending` rows valid).
    pub pending_kv: Vec<f32>,
    /// `ratio × coff·dim` gate logits (+ ape) of the pending block.
    pub pending_gate: Vec<f32>,
    pub n_pending: usize,
    /// CSA: `ratio × dim` `Ca` features of the previous complete block.
    pub prev_kv: Vec<f32>,
    /// CSA: `ratio × dim` `Ca` gate logits (+ ape) of the previous complete block.
    pub prev_gate: Vec<f32>,
    /// CSA: whether `prev_*` hold a block (false before the first block completes).
    pub has_prev: bool,
}

impl Frontier {
    /// An empty frontier.
    pub fn new(ratio: usize, dim: usize, coff: usize) -> Frontier {
        let w = coff * dim;
        let prev = if coff == 2 { ratio * dim } else { 0 };
        Frontier {
            ratio,
            dim,
            coff,
            pending_kv: vec![0.0; ratio * w],
            pending_gate: vec![0.0; ratio * w],
            n_pending: 0,
            prev_kv: vec![0.0; prev],
            prev_gate: vec![0.0; prev],
            has_prev: false,
        }
    }
}

/// Tokens per roll-back log chunk (the unit the log is shared and copied on write in).
pub const LOG_CHUNK: usize = 64;

/// Per-token roll-back log of one layer (see the module docs). Not part of the state: two logs always compare
/// equal (it only caches inputs the state was built from).
///
/// The slots live in refcounted chunks of [`LOG_CHUNK`] tokens: a clone (a fork) shares every chunk and copies
/// nothing; the first [`TokenLog::record`] into a chunk that is still shared copies that chunk
/// (`LOG_CHUNK × width()` values, counted in the pool's `bytes_copied`). So after a fork the writer that continues
/// re-materialises its log chunk by chunk as it logs tokens — at most one extra copy per logged value, spread over
/// the next `cap` tokens — while the rows both sides never overwrite stay shared.
#[derive(Clone, Debug, Default)]
pub struct TokenLog {
    /// Tokens held (0: no log).
    pub cap: usize,
    /// Values per token: raw row `hd`, then main compressor features and gates (`cw` each), then the indexer's
    /// (`iw` each).
    pub hd: usize,
    pub cw: usize,
    pub iw: usize,
    /// `ceil(cap / LOG_CHUNK)` chunks of `LOG_CHUNK` slots of `width()` values; position `p` in slot `p % cap`.
    chunks: Vec<Arc<Vec<f32>>>,
    /// Where copy-on-write copies are counted.
    pool: PageLedger,
    /// First logged position still held.
    pub start: usize,
    /// One past the last logged position.
    pub end: usize,
}

impl PartialEq for TokenLog {
    fn eq(&self, _: &TokenLog) -> bool {
        true
    }
}

impl TokenLog {
    /// A log of `cap` tokens for rows of these widths (`cw` / `iw` 0 where the layer has no such compressor),
    /// counting its copies in `pool`.
    pub fn new(cap: usize, hd: usize, cw: usize, iw: usize, pool: &PageLedger) -> TokenLog {
        let mut t = TokenLog { cap, hd, cw, iw, chunks: Vec::new(), pool: pool.clone(), start: 0, end: 0 };
        // Zeroed allocations: the pages are only touched as tokens are logged.
        let w = t.width();
        t.chunks = (0..cap.div_ceil(LOG_CHUNK)).map(|_| Arc::new(vec![0.0; LOG_CHUNK * w])).collect();
        t
    }

    /// Values per token.
    pub fn width(&self) -> usize {
        self.hd + 2 * self.cw + 2 * self.iw
    }

    /// Values allocated (shared chunks included).
    pub fn n_values(&self) -> usize {
        self.chunks.len() * LOG_CHUNK * self.width()
    }

    /// Chunks this log shares with another log.
    pub fn shared_chunks(&self) -> usize {
        self.chunks.iter().filter(|c| Arc::strong_count(c) > 1).count()
    }

    /// Records position `pos`'s inputs. A position that does not follow the last one restarts the log there.
    pub fn record(&mut self, pos: usize, raw: &[f32], comp: Option<(&[f32], &[f32])>, idx: Option<(&[f32], &[f32])>) {
        if self.cap == 0 {
            return;
        }
        if pos != self.end {
            self.start = pos;
        }
        let (hd, cw, iw, w) = (self.hd, self.cw, self.iw, self.width());
        let s = pos % self.cap;
        let chunk = &mut self.chunks[s / LOG_CHUNK];
        if Arc::get_mut(chunk).is_none() {
            self.pool.add_copied((chunk.len() * 4) as u64);
            *chunk = Arc::new(chunk.as_ref().clone());
        }
        let data = Arc::get_mut(chunk).expect("a private chunk");
        let o = (s % LOG_CHUNK) * w;
        let slot = &mut data[o..o + w];
        slot[..hd].copy_from_slice(&raw[..hd]);
        if let Some((kv, g)) = comp {
            slot[hd..hd + cw].copy_from_slice(&kv[..cw]);
            slot[hd + cw..hd + 2 * cw].copy_from_slice(&g[..cw]);
        }
        if let Some((kv, g)) = idx {
            let o = hd + 2 * cw;
            slot[o..o + iw].copy_from_slice(&kv[..iw]);
            slot[o + iw..o + 2 * iw].copy_from_slice(&g[..iw]);
        }
        self.end = pos + 1;
        self.start = self.start.max(self.end.saturating_sub(self.cap));
    }

    /// Forgets everything (the next recorded position starts the log).
    pub fn reset(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// Whether positions `from..end` are all held.
    pub fn holds_from(&self, from: usize) -> bool {
        self.cap > 0 && self.start <= from
    }

    fn slot(&self, p: usize) -> &[f32] {
        let (w, s) = (self.width(), p % self.cap);
        let o = (s % LOG_CHUNK) * w;
        &self.chunks[s / LOG_CHUNK][o..o + w]
    }

    /// Raw KV row of position `p` (must be held).
    pub fn raw(&self, p: usize) -> &[f32] {
        &self.slot(p)[..self.hd]
    }

    /// `(features, gate logits without ape)` of position `p` for the main (`idx == false`) or indexer compressor.
    pub fn comp(&self, p: usize, idx: bool) -> (&[f32], &[f32]) {
        let s = self.slot(p);
        let (o, w) = if idx { (self.hd + 2 * self.cw, self.iw) } else { (self.hd, self.cw) };
        (&s[o..o + w], &s[o + w..o + 2 * w])
    }
}

/// The state of one layer. See the module docs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerKv {
    pub ring: Vec<f32>,
    /// Compressed rows, paged and shared by reference (see [`crate::tables::pages`]).
    pub comp_rows: PagedRows,
    /// Indexer rows (CSA layers; empty, width 0, elsewhere), paged like `comp_rows`.
    pub idx_rows: PagedRows,
    pub comp: Option<Frontier>,
    pub idx: Option<Frontier>,
    /// Roll-back log (see the module docs); ignored by `==`.
    pub log: TokenLog,
}

/// Row of position `p` in a raw window ring of `window` rows.
#[inline]
pub fn ring_index(p: usize, window: usize) -> usize {
    p % window
}

impl Frontier {
    /// Rebuilds this frontier as it is after the first `len` tokens, from `log` (which must hold positions
    /// `len − (len % ratio) − ratio ..len`, clamped at 0) and the compressor's `ape` (`ratio × coff·dim`).
    fn rebuild(&mut self, log: &TokenLog, idx: bool, ape: &[f32], len: usize) {
        let (m, dim, w) = (self.ratio, self.dim, self.coff * self.dim);
        let (blocks, np) = (len / m, len % m);
        for j in 0..m {
            let p = if j < np { Some(blocks * m + j) } else { blocks.checked_sub(1).map(|b| b * m + j) };
            let (kv, g) = (&mut self.pending_kv[j * w..(j + 1) * w], &mut self.pending_gate[j * w..(j + 1) * w]);
            match p {
                Some(p) => {
                    let (lkv, lg) = log.comp(p, idx);
                    kv.copy_from_slice(lkv);
                    for ((o, &z), &a) in g.iter_mut().zip(lg).zip(&ape[j * w..(j + 1) * w]) {
                        *o = z + a;
                    }
                }
                None => {
                    kv.fill(0.0);
                    g.fill(0.0);
                }
            }
        }
        self.n_pending = np;
        if self.coff == 2 {
            self.has_prev = blocks > 0;
            for j in 0..m {
                let (kv, g) = (&mut self.prev_kv[j * dim..(j + 1) * dim], &mut self.prev_gate[j * dim..(j + 1) * dim]);
                if blocks > 0 {
                    let (lkv, lg) = log.comp((blocks - 1) * m + j, idx);
                    kv.copy_from_slice(&lkv[..dim]);
                    for ((o, &z), &a) in g.iter_mut().zip(&lg[..dim]).zip(&ape[j * w..j * w + dim]) {
                        *o = z + a;
                    }
                } else {
                    kv.fill(0.0);
                    g.fill(0.0);
                }
            }
        }
    }
}

/// The `ape` tables a roll back needs for one layer: `(main, indexer)` compressor, `ratio × coff·dim` each.
pub type LayerApes<'a> = (Option<&'a [f32]>, Option<&'a [f32]>);

/// Bookkeeping for backends that keep a device copy of a session's KV (see
/// [`crate::backend::Backend::sync_kv`]). Not part of the state: two tags always compare equal.
///
/// A backend that advances its device copy gives it a fresh, process-unique `epoch`, stores the same epoch here and
/// sets `host_stale`; the host arrays of [`SessionKv`] are then out of date until the backend's `sync_kv` copies the
/// device state back (which clears `host_stale`). Anything that writes the host arrays must reset the tag
/// ([`SessionKv::clear`] and [`SessionKv::new`] do), so the backend uploads them instead of using its copy.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvSync {
    /// Epoch of the device copy these arrays correspond to (0: host only, never on a device).
    pub epoch: u64,
    /// The device copy is newer than the host arrays.
    pub host_stale: bool,
    /// [`SessionKv::bytes`] of the device copy (what `bytes` reports while `host_stale`).
    pub device_bytes: u64,
}

impl PartialEq for KvSync {
    fn eq(&self, _: &KvSync) -> bool {
        true
    }
}

/// The complete KV state of a session.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionKv {
    pub layers: Vec<LayerKv>,
    /// Device-copy bookkeeping (see [`KvSync`]); ignored by `==`.
    pub sync: KvSync,
    /// The pool the pages and log chunks report to; ignored by `==`.
    pub pool: PageLedger,
}

impl SessionKv {
    /// Bytes of KV state the session holds now (rows in use and frontiers; not spare capacity): the device copy's
    /// while the host arrays are stale, else the host arrays'.
    pub fn bytes(&self) -> u64 {
        if self.sync.host_stale {
            return self.sync.device_bytes;
        }
        self.host_bytes()
    }

    /// Bytes of the session's device copy (0 when no backend made one): the device tier of the KV metrics.
    pub fn device_bytes(&self) -> u64 {
        if self.sync.epoch != 0 {
            self.sync.device_bytes
        } else {
            0
        }
    }

    /// Bytes held by the host arrays (rows in use and frontiers; possibly an older copy while `sync.host_stale`):
    /// the host tier of the KV metrics.
    pub fn host_bytes(&self) -> u64 {
        let f = |fr: &Option<Frontier>| fr.as_ref().map_or(0, |f| f.pending_kv.len() + f.pending_gate.len());
        let values: usize = self
            .layers
            .iter()
            .map(|l| l.ring.len() + l.comp_rows.n_values() + l.idx_rows.n_values() + f(&l.comp) + f(&l.idx))
            .sum();
        (values * std::mem::size_of::<f32>()) as u64
    }

    /// Tokens whose page lists are reserved up front; longer sessions grow (amortised doubling).
    pub const RESERVE_TOKENS_MAX: usize = 32768;

    /// Empty state for `cfg` with pages in a pool of its own (see [`SessionKv::new_in`]).
    pub fn new(cfg: &ModelConfig, ctx: usize) -> SessionKv {
        SessionKv::new_in(cfg, ctx, &PageLedger::new())
    }

    /// Empty state for `cfg`, its pages reporting to `pool`, with page-list room for `min(ctx,
    /// RESERVE_TOKENS_MAX)` tokens (pages themselves are allocated as rows arrive: one per layer and table every
    /// [`crate::tables::pages::PAGE_TOKENS`] tokens).
    pub fn new_in(cfg: &ModelConfig, ctx: usize, pool: &PageLedger) -> SessionKv {
        let ctx = ctx.min(Self::RESERVE_TOKENS_MAX);
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let ratio = cfg.compress_ratios[l];
                let kind = cfg.layer_kind(l);
                let (comp, idx) = match kind {
                    LayerKind::Window => (None, None),
                    LayerKind::Hca => (Some(Frontier::new(ratio, cfg.head_dim, 1)), None),
                    LayerKind::Csa => {
                        (Some(Frontier::new(ratio, cfg.head_dim, 2)), Some(Frontier::new(ratio, cfg.idx_head_dim, 2)))
                    }
                };
                let n_rows = ctx.checked_div(ratio).unwrap_or(0);
                let table = |on: bool, width: usize| {
                    let mut t = PagedRows::new(if on { width } else { 0 }, rows_per_page(ratio), pool);
                    if on {
                        t.reserve_rows(n_rows);
                    }
                    t
                };
                LayerKv {
                    ring: vec![0.0; cfg.window * cfg.head_dim],
                    comp_rows: table(comp.is_some(), cfg.head_dim),
                    idx_rows: table(idx.is_some(), cfg.idx_head_dim),
                    comp,
                    idx,
                    log: TokenLog::default(),
                }
            })
            .collect();
        SessionKv { layers, sync: KvSync::default(), pool: pool.clone() }
    }

    /// Bytes a fork copies: the private tail (raw window rings and compressor frontiers). Pages and log chunks are
    /// shared by reference (see [`crate::tables::pages`] and [`TokenLog`]).
    pub fn tail_bytes(&self) -> u64 {
        let f = |fr: &Option<Frontier>| {
            fr.as_ref().map_or(0, |f| f.pending_kv.len() + f.pending_gate.len() + f.prev_kv.len() + f.prev_gate.len())
        };
        let values: usize = self.layers.iter().map(|l| l.ring.len() + f(&l.comp) + f(&l.idx)).sum();
        (values * std::mem::size_of::<f32>()) as u64
    }

    /// A copy sharing every page and log chunk with `self` (copies only the private tail, counted in the pool's
    /// `bytes_copied`). Device bookkeeping is reset: the copy's host arrays are authoritative.
    pub fn fork(&self) -> SessionKv {
        self.pool.add_copied(self.tail_bytes());
        let mut k = self.clone();
        k.sync = KvSync::default();
        k
    }

    /// Page-list room for `tokens` tokens in all (so appending up to there does not grow the lists).
    pub fn reserve_tokens(&mut self, cfg: &ModelConfig, tokens: usize) {
        for (l, lk) in self.layers.iter_mut().enumerate() {
            if let Some(rows) = tokens.checked_div(cfg.compress_ratios[l]) {
                lk.comp_rows.reserve_rows(rows);
                lk.idx_rows.reserve_rows(rows);
            }
        }
    }

    /// Gives every layer a roll-back log reaching `rollback` tokens back (see the module docs), capped at `ctx`
    /// tokens; `rollback == 0` removes the logs.
    pub fn enable_log(&mut self, cfg: &ModelConfig, ctx: usize, rollback: usize) {
        for (l, lk) in self.layers.iter_mut().enumerate() {
            if rollback == 0 {
                lk.log = TokenLog::default();
                continue;
            }
            let ratio = cfg.compress_ratios[l];
            let cap = (rollback + cfg.window.max(2 * ratio)).min(ctx.max(1));
            let cw = lk.comp.as_ref().map_or(0, |f| f.coff * f.dim);
            let iw = lk.idx.as_ref().map_or(0, |f| f.coff * f.dim);
            if lk.log.cap != cap || lk.log.hd != cfg.head_dim || lk.log.cw != cw || lk.log.iw != iw {
                lk.log = TokenLog::new(cap, cfg.head_dim, cw, iw, &self.pool);
            }
        }
    }

    /// Bytes held by the roll-back logs (allocated; see the module docs).
    pub fn log_bytes(&self) -> u64 {
        self.layers.iter().map(|l| (l.log.n_values() * std::mem::size_of::<f32>()) as u64).sum()
    }

    /// Smallest position this state (now at `pos` tokens) can be rolled back to exactly with
    /// [`SessionKv::rollback`]; `pos` itself when the log is off or not live (no roll back).
    pub fn rollback_floor(&self, cfg: &ModelConfig, pos: usize) -> usize {
        if self.sync.host_stale || self.layers.is_empty() {
            return pos;
        }
        let mut floor = 0usize;
        for (l, lk) in self.layers.iter().enumerate() {
            let log = &lk.log;
            if log.cap == 0 || log.end != pos {
                return pos;
            }
            // Position L needs L − need.. held.
            let need = cfg.window.max(2 * cfg.compress_ratios[l]);
            floor = floor.max(if log.start == 0 { 0 } else { log.start + need });
        }
        floor.min(pos)
    }

    /// Rolls this state (at `pos` tokens) back to the state after the first `len` tokens, exactly (see the module
    /// docs), when `rollback_floor(cfg, pos) <= len <= pos`; returns false (and changes nothing) otherwise.
    /// `apes[l]` are layer `l`'s compressor `ape` tables.
    pub fn rollback(&mut self, cfg: &ModelConfig, apes: &[LayerApes<'_>], pos: usize, len: usize) -> bool {
        if len > pos || len < self.rollback_floor(cfg, pos) || apes.len() != self.layers.len() {
            return false;
        }
        if len == pos {
            return true;
        }
        let (hd, window) = (cfg.head_dim, cfg.window);
        for (l, lk) in self.layers.iter_mut().enumerate() {
            let LayerKv { ring, comp_rows, idx_rows, comp, idx, log } = lk;
            for s in 0..window {
                // The latest position below `len` in slot `s`, if any.
                let p = (len + window - 1 - s) / window * window + s;
                let dst = &mut ring[s * hd..(s + 1) * hd];
                match p.checked_sub(window) {
                    Some(p) => dst.copy_from_slice(log.raw(p)),
                    None => dst.fill(0.0),
                }
            }
            let ratio = cfg.compress_ratios[l];
            if let Some(f) = comp {
                comp_rows.truncate(len / ratio);
                f.rebuild(log, false, apes[l].0.unwrap_or(&[]), len);
            }
            if let Some(f) = idx {
                idx_rows.truncate(len / ratio);
                f.rebuild(log, true, apes[l].1.unwrap_or(&[]), len);
            }
            log.end = len;
        }
        self.sync = KvSync::default();
        true
    }

    /// Zeroes the state (as new) while keeping the ring, frontier and log allocations; pages are released.
    pub fn clear(&mut self) {
        self.sync = KvSync::default();
        for l in &mut self.layers {
            l.log.reset();
            l.ring.fill(0.0);
            l.comp_rows.clear();
            l.idx_rows.clear();
            for f in [&mut l.comp, &mut l.idx].into_iter().flatten() {
                f.pending_kv.fill(0.0);
                f.pending_gate.fill(0.0);
                f.n_pending = 0;
                f.prev_kv.fill(0.0);
                f.prev_gate.fill(0.0);
                f.has_prev = false;
            }
        }
    }

    /// Drops every page reference (rows and roll-back log chunks go back to the pool; ring and frontiers stay).
    pub fn release_pages(&mut self) {
        for l in &mut self.layers {
            l.comp_rows.clear();
            l.idx_rows.clear();
            l.log = TokenLog::default();
        }
    }

    /// Values held (for logs and memory accounting).
    pub fn n_values(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let f = |f: &Option<Frontier>| f.as_ref().map_or(0, |f| f.pending_kv.len() * 2 + f.prev_kv.len() * 2);
                l.ring.len() + l.comp_rows.n_values() + l.idx_rows.n_values() + f(&l.comp) + f(&l.idx)
            })
            .sum()
    }
}
