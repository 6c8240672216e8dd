//! Device-resident session KV for a device backend (wgpu: `backend::wgpu::WgpuBackend`), over any
//! [`DeviceMem`]: per batch slot a mirror of the session's
//! [`SessionKv`], advanced by the attention op entirely on the device, synced to the host only on request.
//!
//! Layout per layer ([`LayerDev`]), all f32, same row widths and order as the host tables:
//! - `ring`: `window` rows of `head_dim` (slot `p % window`), exactly the host ring.
//! - `comp` / `idx` ([`PageTable`]): the compressed rows (`head_dim`) and indexer rows (`idx_head_dim`), paged
//!   ([`super::pages`]): the session holds page ids, the rows live in the layer's [`PagePool`] of that table,
//!   shared by every mirror of the backend ([`DevKv::pools`]), `rows_per_page(ratio)` rows a page (the host and
//!   disk page span). The kernels read row `w` at pool row `ids[w >> shift] << shift | (w & mask)`; the host
//!   reads rows (sync, [`SlotKv::read_rows`] for persist) through the table into one contiguous buffer. A fork
//!   ([`SlotKv::duplicate`]) shares every page and log chunk and copies only the ring and frontiers; an append
//!   into a shared page (the partial last page after a fork, or after a roll back into a shared page) copies it
//!   first. A pool is one binding (at most the storage binding limit, error beyond it) for all sessions of the
//!   layer.
//! - frontiers ([`FrontDev`]): one `kv` and one `gate` buffer of `2·ratio` rows of `coff·dim`: rows
//!   `0..ratio` the CSA carried block (`Ca` in the first `dim` values; the host keeps only those), rows
//!   `ratio..2·ratio` the pending block (slot `p % ratio`, gate with `ape` added, as on the host). The scalar
//!   state (`n_pending = pos % ratio`, `has_prev = pos ≥ ratio`) is a function of the position, which the host
//!   knows, so it is never read back.
//!
//! - roll-back log ([`LogDev`], when the backend keeps one: [`crate::backend::Backend::set_device_rollback`]): per
//!   processed token the inputs the ring and the compressors consumed — the raw KV row, the main and indexer
//!   compressors' projected features and gate logits (before `ape`) — exactly the host [`crate::tables::kv`] log's
//!   contents, for the last `cap = R + max(window, 2·ratio)` tokens, position `p` in slot `p % cap` of one ring
//!   per input, held as [`ChunkRing`] chunks of [`LOG_CHUNK_TOKENS`] slots in the layer's [`LogPools`] (shared by
//!   every mirror, like the page pools; a chunk is allocated at its first write, recorded by the WindowStore node). A
//!   fork shares every chunk; the first write into a shared chunk copies the whole chunk first (counted as bytes
//!   copied: one chunk per input per layer for a decode step, at most two for a run shorter than a chunk). From it
//!   [`SlotKv::rollback`] rebuilds the ring and the frontiers of any position `L ≥ pos − R` with device-side copies
//!   and one `ape` add, and cuts the row tables back to `L / ratio` rows (pages past them released, the rest not
//!   touched; the next append copies the last page first if it is shared): nothing is recomputed or read back,
//!   and the state equals a cold run to `L`, value for value (the host rule of [`crate::tables::kv`]: pending
//!   slots past `L % ratio` keep the previous block's rows, never-written ring slots and frontier rows are zero). The log is live while `end == pos`; an upload starts it empty.
//!
//! Ownership: the mirrors live in a [`DevKv`] by batch slot, next to the pools; replacing or removing a mirror
//! there ([`DevKv::insert`], [`DevKv::remove`]) releases its pages and log chunks, so a backend without sessions
//! holds none ([`DevKv::pages`] counts both).
//!
//! Identity: a mirror carries the epoch of the [`KvSync`] tag it last gave its session. A session whose tag does not
//! match its slot's mirror (new, restored, cleared, or moved from a slot whose mirror is then taken over) is
//! uploaded from the host; a stale host copy without a matching mirror is an error, never silently used.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::pages::{rows_per_page, ChunkRing, PagePool, PageTable, LOG_CHUNK_TOKENS};
use super::{copy_rows, dev_err as backend_err, DeviceMem};
use crate::model::config::{LayerKind, ModelConfig};
use crate::tables::{Frontier, KvSync, LayerKv, SessionKv};
use crate::Result;

static NEXT_EPOCH: AtomicU64 = AtomicU64::new(1);

/// A process-unique epoch (never 0).
pub fn next_epoch() -> u64 {
    NEXT_EPOCH.fetch_add(1, Ordering::Relaxed)
}

/// Which growing row table of a layer (the persist tags `TAG_COMP` / `TAG_IDX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowTable {
    /// Compressed KV rows (`head_dim` wide).
    Comp,
    /// Indexer key rows (`idx_head_dim` wide, CSA layers).
    Idx,
}

/// A compressor frontier on the device (see module docs).
pub struct FrontDev<D: DeviceMem> {
    pub kv: D::Buf,
    pub gate: D::Buf,
    pub ratio: usize,
    pub dim: usize,
    pub coff: usize,
}

impl<D: DeviceMem> FrontDev<D> {
    fn upload(ctx: &D, f: &Frontier) -> Result<FrontDev<D>> {
        let w = f.coff * f.dim;
        let prev = if f.coff == 2 { f.ratio * f.dim } else { 0 };
        if f.ratio == 0
            || !(1..=2).contains(&f.coff)
            || f.pending_kv.len() != f.ratio * w
            || f.pending_gate.len() != f.ratio * w
            || f.prev_kv.len() != prev
            || f.prev_gate.len() != prev
        {
            return Err(backend_err("device KV: a compressor frontier has the wrong shape"));
        }
        let pack = |prev: &[f32], pending: &[f32]| {
            let mut v = vec![0f32; 2 * f.ratio * w];
            if f.coff == 2 {
                for j in 0..f.ratio {
                    v[j * w..j * w + f.dim].copy_from_slice(&prev[j * f.dim..(j + 1) * f.dim]);
                }
            }
            v[f.ratio * w..].copy_from_slice(pending);
            v
        };
        Ok(FrontDev {
            kv: ctx.upload_f32("frontier kv", &pack(&f.prev_kv, &f.pending_kv)),
            gate: ctx.upload_f32("frontier gate", &pack(&f.prev_gate, &f.pending_gate)),
            ratio: f.ratio,
            dim: f.dim,
            coff: f.coff,
        })
    }

    fn download(&self, ctx: &D, pos: usize) -> Result<Frontier> {
        let mut f = Frontier::new(self.ratio, self.dim, self.coff);
        let w = self.coff * self.dim;
        for (buf, prev, pending) in
            [(&self.kv, &mut f.prev_kv, &mut f.pending_kv), (&self.gate, &mut f.prev_gate, &mut f.pending_gate)]
        {
            let v = ctx.read_f32(buf, 0, 2 * self.ratio * w)?;
            if self.coff == 2 {
                for j in 0..self.ratio {
                    prev[j * self.dim..(j + 1) * self.dim].copy_from_slice(&v[j * w..j * w + self.dim]);
                }
            }
            pending.copy_from_slice(&v[self.ratio * w..]);
        }
        f.n_pending = pos % self.ratio;
        f.has_prev = self.coff == 2 && pos >= self.ratio;
        Ok(f)
    }
}

/// One compressor's inputs in a [`LogDev`]: features and gate logits (before `ape`), `cap` slots of `width` each,
/// both in that compressor's [`LogPools`] pool.
pub struct LogComp {
    pub kv: ChunkRing,
    pub gate: ChunkRing,
    pub width: usize,
}

/// The roll-back log of one layer on the device (see module docs).
pub struct LogDev {
    /// Slots (tokens held).
    pub cap: usize,
    /// Raw KV rows, `cap` slots of `head_dim`.
    pub raw: ChunkRing,
    /// The main compressor's inputs (compressed layers).
    pub comp: Option<LogComp>,
    /// The indexer compressor's inputs (CSA layers).
    pub idx: Option<LogComp>,
    /// First logged position still held, and one past the last (`start == end`: empty).
    pub start: usize,
    pub end: usize,
}

impl LogDev {
    /// An empty log of `cap` slots (no chunk allocated) with compressor inputs of widths `comp` / `idx`.
    fn new(cap: usize, comp: Option<usize>, idx: Option<usize>) -> LogDev {
        let inputs = |width: usize| LogComp { kv: ChunkRing::new(cap), gate: ChunkRing::new(cap), width };
        LogDev { cap, raw: ChunkRing::new(cap), comp: comp.map(inputs), idx: idx.map(inputs), start: 0, end: 0 }
    }

    /// A log sharing every chunk of this one (a fork: nothing copied). `pools` are the ones the log was made
    /// for (an input has chunks only where its pool exists).
    fn share<D: DeviceMem>(&self, pools: &mut LogPools<D>) -> LogDev {
        let inputs = |c: &Option<LogComp>, pool: &mut Option<PagePool<D>>| {
            let (c, pool) = c.as_ref().zip(pool.as_mut())?;
            Some(LogComp { kv: c.kv.share(pool), gate: c.gate.share(pool), width: c.width })
        };
        let (comp, idx) = (inputs(&self.comp, &mut pools.comp), inputs(&self.idx, &mut pools.idx));
        let raw = self.raw.share(&mut pools.raw);
        LogDev { cap: self.cap, raw, comp, idx, start: self.start, end: self.end }
    }

    /// Returns every chunk to `pools`.
    fn release<D: DeviceMem>(&mut self, pools: &mut LogPools<D>) {
        self.raw.release(&mut pools.raw);
        for (c, pool) in [(&mut self.comp, &mut pools.comp), (&mut self.idx, &mut pools.idx)] {
            if let (Some(c), Some(pool)) = (c, pool) {
                c.kv.release(pool);
                c.gate.release(pool);
            }
        }
    }

    /// The `(src, dst)` row pairs that log batch rows `first..first + len` (positions `p0..p0 + len`): the last
    /// `cap` of them, each to slot `p % cap`.
    fn slots(&self, first: usize, p0: usize, len: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (len.saturating_sub(self.cap)..len).map(move |j| (first + j, (p0 + j) % self.cap))
    }

    /// Records the logging of a run — batch rows `first..first + len` at positions `p0..` of the tick's raw KV
    /// rows and compressor inputs — into `enc` (chunks of `pools`), and advances the held range. A run that does
    /// not continue the log (after an upload or a gap) restarts it at `p0`. Returns the bytes copied on write
    /// (whole chunks shared with a fork, at most two per input for a run shorter than a chunk).
    #[allow(clippy::too_many_arguments)]
    pub fn record<D: DeviceMem>(
        &mut self,
        ctx: &D,
        enc: &mut D::Enc,
        pools: &mut LogPools<D>,
        src: &LogSources<'_, D>,
        first: usize,
        p0: usize,
        len: usize,
    ) -> Result<u64> {
        let pairs: Vec<(usize, usize)> = self.slots(first, p0, len).collect();
        let mut copied = self.raw.write(ctx, enc, &mut pools.raw, src.raw, &pairs)?;
        for (dst, from, pool) in [(&mut self.comp, src.comp, &mut pools.comp), (&mut self.idx, src.idx, &mut pools.idx)]
        {
            if let (Some(d), Some((kv, gate)), Some(pool)) = (dst, from, pool.as_mut()) {
                copied += d.kv.write(ctx, enc, pool, kv, &pairs)?;
                copied += d.gate.write(ctx, enc, pool, gate, &pairs)?;
            }
        }
        if self.end != p0 || self.start == self.end {
            self.start = p0;
        }
        self.end = p0 + len;
        self.start = self.start.max(self.end.saturating_sub(self.cap));
        Ok(copied)
    }

    /// Smallest position this layer can be rolled back to at `pos` (the host rule: `L` needs `L − need..` held),
    /// or `pos` when the log is not live there.
    fn floor(&self, pos: usize, need: usize) -> usize {
        if self.end != pos || self.start == self.end {
            return pos;
        }
        if self.start == 0 {
            0
        } else {
            (self.start + need).min(pos)
        }
    }
}

/// A layer's compressor `ape` tables on the device: `(main, indexer)`.
pub type DevApes<'a, D> = (Option<&'a <D as DeviceMem>::Buf>, Option<&'a <D as DeviceMem>::Buf>);

/// The tick tensors a [`LogDev::record`] copies from: raw KV rows and, where the layer has them, the main and
/// indexer compressors' `(features, gates)`.
pub struct LogSources<'a, D: DeviceMem> {
    pub raw: &'a D::Buf,
    pub comp: Option<(&'a D::Buf, &'a D::Buf)>,
    pub idx: Option<(&'a D::Buf, &'a D::Buf)>,
}

/// The page pools of one layer: compressed rows, indexer rows (where the layer has them), and the roll-back
/// logs' chunks (made at the first upload with a log).
pub struct LayerPools<D: DeviceMem> {
    pub comp: Option<PagePool<D>>,
    pub idx: Option<PagePool<D>>,
    pub log: Option<LogPools<D>>,
}

impl<D: DeviceMem> LayerPools<D> {
    /// Every pool of the layer.
    fn all(&self) -> impl Iterator<Item = &PagePool<D>> {
        let log = self.log.as_ref();
        [self.comp.as_ref(), self.idx.as_ref(), log.map(|l| &l.raw), log.and_then(|l| l.comp.as_ref())]
            .into_iter()
            .chain([log.and_then(|l| l.idx.as_ref())])
            .flatten()
    }
}

/// The chunk pools of one layer's roll-back logs ([`LOG_CHUNK_TOKENS`]-row pages): raw KV rows, and per
/// compressor one pool holding both its feature and its gate chunks (same width).
pub struct LogPools<D: DeviceMem> {
    pub raw: PagePool<D>,
    pub comp: Option<PagePool<D>>,
    pub idx: Option<PagePool<D>>,
}

/// Every device mirror of a backend, by batch slot, and the page pools their row tables live in (see module docs).
pub struct DevKv<D: DeviceMem> {
    pub slots: HashMap<usize, SlotKv<D>>,
    /// Per layer, made at the first upload (for that model: [`DevKv::clear`] before another).
    pub pools: Vec<LayerPools<D>>,
}

impl<D: DeviceMem> Default for LayerPools<D> {
    fn default() -> Self {
        LayerPools { comp: None, idx: None, log: None }
    }
}

impl<D: DeviceMem> Default for DevKv<D> {
    fn default() -> Self {
        DevKv { slots: HashMap::new(), pools: Vec::new() }
    }
}

impl<D: DeviceMem> DevKv<D> {
    /// The pools for a model of config `cfg`, made empty on first use.
    pub fn pools(&mut self, ctx: &D, cfg: &ModelConfig) -> Result<&mut [LayerPools<D>]> {
        if self.pools.len() != cfg.n_layers {
            if self.pools.iter().flat_map(LayerPools::all).any(|p| p.live_pages() > 0) {
                return Err(backend_err("device KV: the page pools hold another model's rows"));
            }
            let mut pools = Vec::with_capacity(cfg.n_layers);
            for l in 0..cfg.n_layers {
                let (kind, ratio) = (cfg.layer_kind(l), cfg.compress_ratios[l]);
                let pool = |w: usize| PagePool::new(ctx, w, rows_per_page(ratio));
                pools.push(LayerPools {
                    comp: (kind != LayerKind::Window).then(|| pool(cfg.head_dim)).transpose()?,
                    idx: (kind == LayerKind::Csa).then(|| pool(cfg.idx_head_dim)).transpose()?,
                    log: None,
                });
            }
            self.pools = pools;
        }
        Ok(&mut self.pools)
    }

    /// Puts mirror `m` at `slot`, releasing the pages of the mirror it replaces.
    pub fn insert(&mut self, slot: usize, m: SlotKv<D>) {
        if let Some(mut old) = self.slots.insert(slot, m) {
            old.release(&mut self.pools);
        }
    }

    /// Drops the mirror at `slot`, releasing its pages.
    pub fn remove(&mut self, slot: usize) {
        if let Some(mut old) = self.slots.remove(&slot) {
            old.release(&mut self.pools);
        }
    }

    /// Drops every mirror and pool.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.pools.clear();
    }

    /// `(live, shared)` pages over every pool, row pages and log chunks (shared: referenced by more than one
    /// table).
    pub fn pages(&self) -> (usize, usize) {
        let pools = self.pools.iter().flat_map(LayerPools::all);
        pools.fold((0, 0), |(l, s), p| (l + p.live_pages(), s + p.shared_pages()))
    }
}

/// One layer of a device mirror.
pub struct LayerDev<D: DeviceMem> {
    pub ring: D::Buf,
    /// Values in `ring` (`window · head_dim`).
    pub ring_len: usize,
    pub comp: Option<PageTable<D>>,
    pub idx: Option<PageTable<D>>,
    pub fcomp: Option<FrontDev<D>>,
    pub fidx: Option<FrontDev<D>>,
    /// Tokens this layer has processed (set by each attention op; `None` right after an upload).
    pub pos: Option<usize>,
    /// The roll-back log (see module docs); `None` when the backend keeps none.
    pub log: Option<LogDev>,
}

/// The device mirror of one session (see module docs).
pub struct SlotKv<D: DeviceMem> {
    pub epoch: u64,
    pub layers: Vec<LayerDev<D>>,
    /// Pages the upload shared with other tables instead of copying (pages carrying a store key the pool held:
    /// [`PageTable::upload_paged`]).
    pub shared_on_upload: usize,
}

impl<D: DeviceMem> SlotKv<D> {
    /// Uploads host state `kv` for a model with config `cfg` (rows into fresh pages of `pools`, copies recorded
    /// into `enc`); checks the shapes. `log_tokens` (R) > 0 gives every layer an empty roll-back log of
    /// `R + max(window, 2·ratio)` slots. On an error every page taken so far is released.
    pub fn upload(
        ctx: &D,
        enc: &mut D::Enc,
        cfg: &ModelConfig,
        kv: &SessionKv,
        log_tokens: usize,
        pools: &mut [LayerPools<D>],
    ) -> Result<SlotKv<D>> {
        if kv.sync.host_stale {
            return Err(backend_err("device KV: the host copy is stale and the device copy is gone"));
        }
        if kv.layers.len() != cfg.n_layers || pools.len() != cfg.n_layers {
            return Err(backend_err(format!("device KV: {} layers, model has {}", kv.layers.len(), cfg.n_layers)));
        }
        let mut m = SlotKv { epoch: 0, layers: Vec::with_capacity(kv.layers.len()), shared_on_upload: 0 };
        match m.upload_layers(ctx, enc, cfg, kv, log_tokens, pools) {
            Ok(()) => {
                tracing::debug!(layers = m.layers.len(), shared = m.shared_on_upload, "device: uploaded session KV");
                Ok(m)
            }
            Err(e) => {
                m.release(pools);
                Err(e)
            }
        }
    }

    fn upload_layers(
        &mut self,
        ctx: &D,
        enc: &mut D::Enc,
        cfg: &ModelConfig,
        kv: &SessionKv,
        log_tokens: usize,
        pools: &mut [LayerPools<D>],
    ) -> Result<()> {
        for (l, (lk, lp)) in kv.layers.iter().zip(pools.iter_mut()).enumerate() {
            let kind = cfg.layer_kind(l);
            let bad = |what: &str| backend_err(format!("device KV: layer {l}: {what}"));
            if lk.ring.len() != cfg.window * cfg.head_dim {
                return Err(bad("ring has the wrong size"));
            }
            let coff = if kind == LayerKind::Csa { 2 } else { 1 };
            let ratio = cfg.compress_ratios[l];
            let fits = |f: &Option<Frontier>, want: Option<(usize, usize)>| match (f, want) {
                (None, None) => true,
                (Some(f), Some((dim, coff))) => f.ratio == ratio && f.dim == dim && f.coff == coff,
                _ => false,
            };
            let comp_want = (kind != LayerKind::Window).then_some((cfg.head_dim, coff));
            let idx_want = (kind == LayerKind::Csa).then_some((cfg.idx_head_dim, 2));
            if !fits(&lk.comp, comp_want) || !fits(&lk.idx, idx_want) {
                return Err(bad("frontiers do not match the layer kind"));
            }
            let cw = (kind != LayerKind::Window).then_some(coff * cfg.head_dim);
            let iw = (kind == LayerKind::Csa).then_some(2 * cfg.idx_head_dim);
            if log_tokens > 0 && lp.log.is_none() {
                let pool = |w: usize| PagePool::new(ctx, w, LOG_CHUNK_TOKENS);
                lp.log = Some(LogPools {
                    raw: pool(cfg.head_dim)?,
                    comp: cw.map(pool).transpose()?,
                    idx: iw.map(pool).transpose()?,
                });
            }
            let log = (log_tokens > 0).then(|| LogDev::new(log_tokens + cfg.window.max(2 * ratio), cw, iw));
            self.layers.push(LayerDev {
                ring: ctx.upload_f32("ring", &lk.ring),
                ring_len: lk.ring.len(),
                comp: None,
                idx: None,
                fcomp: lk.comp.as_ref().map(|f| FrontDev::upload(ctx, f)).transpose()?,
                fidx: lk.idx.as_ref().map(|f| FrontDev::upload(ctx, f)).transpose()?,
                pos: None,
                log,
            });
            let ld = self.layers.last_mut().ok_or_else(|| bad("vanished"))?;
            for (dst, pool, rows) in
                [(&mut ld.comp, &mut lp.comp, &lk.comp_rows), (&mut ld.idx, &mut lp.idx, &lk.idx_rows)]
            {
                match pool {
                    Some(pool) => {
                        let (t, shared) = PageTable::upload_paged(ctx, enc, pool, rows)?;
                        self.shared_on_upload += shared;
                        *dst = Some(t);
                    }
                    None if rows.rows() == 0 => {}
                    None => return Err(bad("rows for a table the layer does not have")),
                }
            }
        }
        Ok(())
    }

    /// Returns every page and log chunk of this mirror to `pools` (the mirror is empty afterwards).
    pub fn release(&mut self, pools: &mut [LayerPools<D>]) {
        for (ld, lp) in self.layers.iter_mut().zip(pools.iter_mut()) {
            if let (Some(mut log), Some(lpl)) = (ld.log.take(), lp.log.as_mut()) {
                log.release(lpl);
            }
            for (t, pool) in [(&mut ld.comp, &mut lp.comp), (&mut ld.idx, &mut lp.idx)] {
                if let (Some(mut t), Some(pool)) = (t.take(), pool.as_mut()) {
                    t.release(pool);
                }
            }
        }
    }

    /// [`SessionKv::bytes`] of the state this mirror holds.
    pub fn bytes(&self) -> u64 {
        let f = |f: &Option<FrontDev<D>>| f.as_ref().map_or(0, |f| 2 * f.ratio * f.coff * f.dim);
        let r = |r: &Option<PageTable<D>>| r.as_ref().map_or(0, |r| r.rows * r.width);
        let values: usize =
            self.layers.iter().map(|l| l.ring_len + r(&l.comp) + r(&l.idx) + f(&l.fcomp) + f(&l.fidx)).sum();
        (values * 4) as u64
    }

    /// Gives the session a fresh epoch: its host arrays are stale from now on.
    pub fn stamp(&mut self, sync: &mut KvSync) {
        self.epoch = next_epoch();
        *sync = KvSync { epoch: self.epoch, host_stale: true, device_bytes: self.bytes() };
    }

    /// Rows `rows` of `table` in layer `layer`, read through its page table (pages in `pools`): for the row range
    /// of a persist page this is exactly that page's row block for the layer (see module docs). Waits for the
    /// device.
    pub fn read_rows(
        &self,
        ctx: &D,
        pools: &[LayerPools<D>],
        layer: usize,
        table: RowTable,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let (ld, lp) = self
            .layers
            .get(layer)
            .zip(pools.get(layer))
            .ok_or_else(|| backend_err(format!("device KV: no layer {layer}")))?;
        let (t, pool) = match table {
            RowTable::Comp => (ld.comp.as_ref(), lp.comp.as_ref()),
            RowTable::Idx => (ld.idx.as_ref(), lp.idx.as_ref()),
        };
        let (t, pool) =
            t.zip(pool).ok_or_else(|| backend_err(format!("device KV: layer {layer} has no {table:?} rows")))?;
        let mut enc = ctx.encoder();
        let n = rows.len() * t.width;
        let out = t.gather(ctx, &mut enc, pool, rows)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        ctx.submit_read_f32(enc, &out, 0, n)
    }

    /// A copy of this mirror made on the device (recorded into `enc`; nothing goes through the host), with epoch 0
    /// (give it one with [`SlotKv::stamp`]), and the bytes copied: the private tail — rings, frontiers; the row
    /// tables share every page of `pools` and the roll-back logs every chunk (nothing of them is copied; see
    /// [`super::pages`] on copy on write).
    pub fn duplicate(&self, ctx: &D, enc: &mut D::Enc, pools: &mut [LayerPools<D>]) -> Result<(SlotKv<D>, u64)> {
        if self.layers.iter().zip(pools.iter()).any(|(ld, lp)| ld.log.is_some() && lp.log.is_none()) {
            return Err(backend_err("device KV: a roll-back log without its chunk pools"));
        }
        let mut c = Copier { ctx, enc, bytes: 0 };
        let mut layers = Vec::with_capacity(self.layers.len());
        for (ld, lp) in self.layers.iter().zip(pools.iter_mut()) {
            let (fcomp, fidx) = (c.front(&ld.fcomp), c.front(&ld.fidx));
            let ring = c.dup(&ld.ring);
            let (comp, idx) = (c.share(&ld.comp, &mut lp.comp), c.share(&ld.idx, &mut lp.idx));
            let log = ld.log.as_ref().zip(lp.log.as_mut()).map(|(g, pools)| g.share(pools));
            layers.push(LayerDev { ring, ring_len: ld.ring_len, comp, idx, fcomp, fidx, pos: ld.pos, log });
        }
        Ok((SlotKv { epoch: 0, layers, shared_on_upload: 0 }, c.bytes))
    }

    /// Smallest length this mirror (at `pos` tokens) can be rolled back to in place: the largest of its layers'
    /// log floors, or `pos` when some layer has no live log.
    pub fn rollback_floor(&self, cfg: &ModelConfig, pos: usize) -> usize {
        let mut floor = 0;
        for (l, ld) in self.layers.iter().enumerate() {
            match &ld.log {
                Some(log) if ld.pos == Some(pos) => {
                    floor = floor.max(log.floor(pos, cfg.window.max(2 * cfg.compress_ratios[l])))
                }
                _ => return pos,
            }
        }
        floor.min(pos)
    }

    /// Records into `enc` the roll back of this mirror from `pos` to `len` tokens (see module docs), when
    /// `rollback_floor(cfg, pos) <= len <= pos`; else records nothing and returns false. `apes[l]` are layer
    /// `l`'s compressor `ape` tables on the device (main, indexer); the row tables release their pages past the
    /// new row counts into `pools`.
    #[allow(clippy::too_many_arguments)]
    pub fn rollback(
        &mut self,
        ctx: &D,
        enc: &mut D::Enc,
        cfg: &ModelConfig,
        apes: &[DevApes<'_, D>],
        pools: &mut [LayerPools<D>],
        pos: usize,
        len: usize,
    ) -> Result<bool> {
        let n = self.layers.len();
        if len > pos || len < self.rollback_floor(cfg, pos) || apes.len() != n || pools.len() != n {
            return Ok(false);
        }
        let (hd, window) = (cfg.head_dim, cfg.window);
        for (l, (ld, lp)) in self.layers.iter_mut().zip(pools.iter_mut()).enumerate() {
            let log = ld.log.as_mut().ok_or_else(|| backend_err("device KV: roll back without a log"))?;
            let lpl = lp.log.as_ref().ok_or_else(|| backend_err("device KV: roll back without log chunk pools"))?;
            let cap = log.cap;
            // Ring slot s: the latest position below `len` in it, if any (else zero).
            let mut pairs = Vec::with_capacity(window);
            for s in 0..window {
                match ((len + window - 1 - s) / window * window + s).checked_sub(window) {
                    Some(p) => pairs.push((p % cap, s)),
                    None => ctx.clear(enc, &ld.ring, (s * hd * 4) as u64, (hd * 4) as u64),
                }
            }
            copy_rows(ctx, enc, &lpl.raw.buf, &ld.ring, &log.raw.reads(&lpl.raw, &pairs)?, hd);
            let ratio = cfg.compress_ratios[l];
            for (front, rows, pool, inputs, ape) in [
                (&ld.fcomp, ld.comp.as_mut(), lp.comp.as_mut(), (&log.comp, &lpl.comp), apes[l].0),
                (&ld.fidx, ld.idx.as_mut(), lp.idx.as_mut(), (&log.idx, &lpl.idx), apes[l].1),
            ] {
                let (Some(f), Some(rows), Some(pool), (Some(inputs), Some(chunks)), Some(ape)) =
                    (front, rows, pool, inputs, ape)
                else {
                    continue;
                };
                rebuild_front(ctx, enc, f, (inputs, chunks), ape, cap, len)?;
                rows.truncate(pool, len / ratio);
            }
            log.end = len;
            ld.pos = Some(len);
        }
        Ok(true)
    }

    /// Copies the device state into `kv`'s host arrays (rows read through the page tables into `pools`; waits
    /// for the device) and clears `host_stale`.
    pub fn download(&self, ctx: &D, pools: &[LayerPools<D>], kv: &mut SessionKv) -> Result<()> {
        if kv.layers.len() != self.layers.len() || pools.len() != self.layers.len() {
            return Err(backend_err("device KV: layer count changed"));
        }
        for ((ld, lk), lp) in self.layers.iter().zip(kv.layers.iter_mut()).zip(pools) {
            download_layer(ctx, ld, lp, lk)?;
        }
        kv.sync.host_stale = false;
        Ok(())
    }
}

/// The device-side copies of [`SlotKv::duplicate`], counting the bytes.
struct Copier<'a, D: DeviceMem> {
    ctx: &'a D,
    enc: &'a mut D::Enc,
    bytes: u64,
}

impl<D: DeviceMem> Copier<'_, D> {
    fn dup(&mut self, b: &D::Buf) -> D::Buf {
        let size = self.ctx.size(b);
        let d = self.ctx.zeroed("kv copy", (size / 4) as usize);
        self.ctx.copy(self.enc, b, 0, &d, 0, size);
        self.bytes += size;
        d
    }

    fn front(&mut self, f: &Option<FrontDev<D>>) -> Option<FrontDev<D>> {
        let f = f.as_ref()?;
        Some(FrontDev { kv: self.dup(&f.kv), gate: self.dup(&f.gate), ratio: f.ratio, dim: f.dim, coff: f.coff })
    }

    fn share(&mut self, t: &Option<PageTable<D>>, pool: &mut Option<PagePool<D>>) -> Option<PageTable<D>> {
        Some(t.as_ref()?.share(self.ctx, self.enc, pool.as_mut()?))
    }
}

fn download_layer<D: DeviceMem>(ctx: &D, ld: &LayerDev<D>, lp: &LayerPools<D>, lk: &mut LayerKv) -> Result<()> {
    let pos = ld.pos;
    lk.ring = ctx.read_f32(&ld.ring, 0, lk.ring.len())?;
    for (rows, pool, host) in [(&ld.comp, &lp.comp, &mut lk.comp_rows), (&ld.idx, &lp.idx, &mut lk.idx_rows)] {
        if let (Some(r), Some(pool)) = (rows, pool) {
            // Leading pages the (stale) host table still holds under the device page's key hold the same rows (a
            // keyed device page is full and never written): kept, not read back.
            let same = |p: usize| {
                let dev = r.ids.get(p).and_then(|&id| pool.key_of(id));
                dev.is_some() && host.full_page(p).and_then(|pg| pg.id()) == dev
            };
            let keep = if host.width() == r.width && host.rows_per_page() == pool.rows_per_page() {
                (0..r.ids.len()).take_while(|&p| same(p)).count()
            } else {
                0
            };
            let from = (keep * pool.rows_per_page()).min(r.rows);
            host.truncate(from);
            if from < r.rows {
                let mut enc = ctx.encoder();
                let rest = r.gather(ctx, &mut enc, pool, from..r.rows)?;
                host.extend_from_slice(&ctx.submit_read_f32(enc, &rest, 0, (r.rows - from) * r.width)?);
            }
        }
    }
    for (fd, host) in [(&ld.fcomp, &mut lk.comp), (&ld.fidx, &mut lk.idx)] {
        if let (Some(fd), Some(h)) = (fd, host.as_mut()) {
            let pos = pos.ok_or_else(|| backend_err("device KV: frontier position unknown"))?;
            *h = fd.download(ctx, pos)?;
        }
    }
    Ok(())
}

/// Records the rebuild of frontier `f` as it is after the first `len` tokens from the logged `inputs` (slots of a
/// `cap`-token log, chunks in the given pool) and the compressor's `ape` (the host `Frontier::rebuild`, on the device): pending slot `j` takes
/// the block of `len` when `j < len % ratio`, else the previous block's row (zero before the first block); CSA's
/// carried rows take the previous complete block (zero before it). Gates get `ape` added back with the push's add.
fn rebuild_front<D: DeviceMem>(
    ctx: &D,
    enc: &mut D::Enc,
    f: &FrontDev<D>,
    (inputs, chunks): (&LogComp, &PagePool<D>),
    ape: &D::Buf,
    cap: usize,
    len: usize,
) -> Result<()> {
    let (m, w) = (f.ratio, f.coff * f.dim);
    let (blocks, np) = (len / m, len % m);
    let row_bytes = (w * 4) as u64;
    // (log slot, frontier row) pairs; rows not listed are cleared.
    let mut pairs = Vec::with_capacity(2 * m);
    for j in 0..m {
        let p = if j < np { Some(blocks * m + j) } else { blocks.checked_sub(1).map(|b| b * m + j) };
        match p {
            Some(p) => pairs.push((p % cap, m + j)),
            None => {
                for b in [&f.kv, &f.gate] {
                    ctx.clear(enc, b, (m + j) as u64 * row_bytes, row_bytes);
                }
            }
        }
    }
    // Pending rows that got a logged row are 0..np, or all of them once a block is complete.
    let pending = if blocks > 0 { m } else { np };
    if f.coff == 2 {
        if blocks > 0 {
            pairs.extend((0..m).map(|j| (((blocks - 1) * m + j) % cap, j)));
        } else {
            for b in [&f.kv, &f.gate] {
                ctx.clear(enc, b, 0, m as u64 * row_bytes);
            }
        }
    }
    copy_rows(ctx, enc, &chunks.buf, &f.kv, &inputs.kv.reads(chunks, &pairs)?, w);
    copy_rows(ctx, enc, &chunks.buf, &f.gate, &inputs.gate.reads(chunks, &pairs)?, w);
    if pending > 0 {
        ctx.add_ape(enc, &f.gate, m * w, pending, w, ape, 0, m)?;
    }
    if f.coff == 2 && blocks > 0 {
        ctx.add_ape(enc, &f.gate, 0, m, w, ape, 0, m)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
