//! Device-resident session KV for [`super::WgpuBackend`]: per batch slot a mirror of the session's
//! [`SessionKv`], advanced by the attention op entirely on the device, synced to the host only on request.
//!
//! Layout per layer ([`LayerDev`]), all f32, same row widths and order as the host tables:
//! - `ring`: `window` rows of `head_dim` (slot `p % window`), exactly the host ring.
//! - `comp` / `idx` ([`Rows`]): the compressed rows (`head_dim`) and indexer rows (`idx_head_dim`) in order, in one
//!   buffer each, grown by doubling with a device-side copy. Row `w` sits at `w·width`, so the rows of persist
//!   page `p` (tokens `p·S..(p+1)·S`, rows `p·S/ratio..`) are one contiguous byte range — the row block
//!   `persist::rows` writes for that layer, with no reformatting. The page table is therefore the identity (page p
//!   at offset `p·(S/ratio)·width·4`); a buffer is limited to the storage binding limit (error beyond it).
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
//!   buffer per input (so a run's rows are at most two contiguous copies, recorded by the KvStore node). From it
//!   [`SlotKv::rollback`] rebuilds the ring and the frontiers of any position `L ≥ pos − R` with device-side copies
//!   and one `ape` add, and cuts the row tables back to `L / ratio` rows (their buffers are not touched): nothing is
//!   recomputed or read back, and the state equals a cold run to `L`, value for value (the host rule of
//!   [`crate::tables::kv`]: pending slots past `L % ratio` keep the previous block's rows, never-written ring
//!   slots and frontier rows are zero). The log is live while `end == pos`; an upload starts it empty.
//!
//! Identity: a mirror carries the epoch of the [`KvSync`] tag it last gave its session. A session whose tag does not
//! match its slot's mirror (new, restored, cleared, or moved from a slot whose mirror is then taken over) is
//! uploaded from the host; a stale host copy without a matching mirror is an error, never silently used.

use std::sync::atomic::{AtomicU64, Ordering};

use super::context::{backend_err, WgpuContext};
use crate::model::config::{LayerKind, ModelConfig};
use crate::tables::{Frontier, KvSync, LayerKv, SessionKv};
use crate::Result;

type Buf = wgpu::Buffer;

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

/// A growing sequence of rows of `width` f32 values in one device buffer (see module docs).
pub struct Rows {
    pub buf: Buf,
    pub rows: usize,
    pub cap: usize,
    pub width: usize,
}

impl Rows {
    fn new(ctx: &WgpuContext, width: usize, data: &[f32]) -> Result<Rows> {
        if width == 0 || !data.len().is_multiple_of(width) {
            return Err(backend_err(format!("device KV: {} values are not rows of {width}", data.len())));
        }
        let rows = data.len() / width;
        let cap = rows.max(64).next_power_of_two();
        let bytes = (cap * width * 4) as u64;
        if bytes > ctx.max_binding() {
            return Err(backend_err(format!(
                "device KV: {cap} rows of {width} values exceed the storage binding limit {}",
                ctx.max_binding()
            )));
        }
        let mut init = vec![0f32; cap * width];
        init[..data.len()].copy_from_slice(data);
        Ok(Rows { buf: ctx.storage_f32("kv rows", &init), rows, cap, width })
    }

    /// Makes room for `extra` more rows, copying the old rows on the device (recorded into `enc`).
    pub fn reserve(&mut self, ctx: &WgpuContext, enc: &mut wgpu::CommandEncoder, extra: usize) -> Result<()> {
        let need = self.rows + extra;
        if need <= self.cap {
            return Ok(());
        }
        let cap = need.next_power_of_two();
        let bytes = (cap * self.width * 4) as u64;
        if bytes > ctx.max_binding() {
            return Err(backend_err(format!(
                "device KV: {cap} rows of {} values exceed the storage binding limit {}",
                self.width,
                ctx.max_binding()
            )));
        }
        let buf = ctx.storage_zeroed("kv rows", cap * self.width);
        enc.copy_buffer_to_buffer(&self.buf, 0, &buf, 0, (self.rows * self.width * 4) as u64);
        self.buf = buf;
        self.cap = cap;
        Ok(())
    }
}

/// A compressor frontier on the device (see module docs).
pub struct FrontDev {
    pub kv: Buf,
    pub gate: Buf,
    pub ratio: usize,
    pub dim: usize,
    pub coff: usize,
}

impl FrontDev {
    fn upload(ctx: &WgpuContext, f: &Frontier) -> Result<FrontDev> {
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
            kv: ctx.storage_f32("frontier kv", &pack(&f.prev_kv, &f.pending_kv)),
            gate: ctx.storage_f32("frontier gate", &pack(&f.prev_gate, &f.pending_gate)),
            ratio: f.ratio,
            dim: f.dim,
            coff: f.coff,
        })
    }

    fn download(&self, ctx: &WgpuContext, pos: usize) -> Result<Frontier> {
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

/// One compressor's inputs in a [`LogDev`]: features and gate logits (before `ape`), `cap` rows of `width` each.
pub struct LogComp {
    pub kv: Buf,
    pub gate: Buf,
    pub width: usize,
}

/// The roll-back log of one layer on the device (see module docs).
pub struct LogDev {
    /// Slots (tokens held).
    pub cap: usize,
    /// Raw KV rows, `cap × head_dim`.
    pub raw: Buf,
    /// The main compressor's inputs (compressed layers).
    pub comp: Option<LogComp>,
    /// The indexer compressor's inputs (CSA layers).
    pub idx: Option<LogComp>,
    /// First logged position still held, and one past the last (`start == end`: empty).
    pub start: usize,
    pub end: usize,
}

impl LogDev {
    fn new(ctx: &WgpuContext, cap: usize, hd: usize, comp: Option<usize>, idx: Option<usize>) -> LogDev {
        let inputs = |width: usize| LogComp {
            kv: ctx.storage_zeroed("kv log", cap * width),
            gate: ctx.storage_zeroed("kv log", cap * width),
            width,
        };
        LogDev {
            cap,
            raw: ctx.storage_zeroed("kv log", cap * hd),
            comp: comp.map(inputs),
            idx: idx.map(inputs),
            start: 0,
            end: 0,
        }
    }

    /// The `(src, dst)` row pairs that log batch rows `first..first + len` (positions `p0..p0 + len`): the last
    /// `cap` of them, each to slot `p % cap`.
    fn slots(&self, first: usize, p0: usize, len: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (len.saturating_sub(self.cap)..len).map(move |j| (first + j, (p0 + j) % self.cap))
    }

    /// Records the logging of a run — batch rows `first..first + len` at positions `p0..` of the tick's raw KV
    /// rows and compressor inputs — into `enc`, and advances the held range. A run that does not continue the
    /// log (after an upload or a gap) restarts it at `p0`.
    pub fn record(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        src: &LogSources<'_>,
        first: usize,
        p0: usize,
        len: usize,
    ) {
        let pairs: Vec<(usize, usize)> = self.slots(first, p0, len).collect();
        copy_rows(enc, src.raw, &self.raw, &pairs, src.hd);
        for (dst, from) in [(&self.comp, src.comp), (&self.idx, src.idx)] {
            if let (Some(d), Some((kv, gate))) = (dst, from) {
                copy_rows(enc, kv, &d.kv, &pairs, d.width);
                copy_rows(enc, gate, &d.gate, &pairs, d.width);
            }
        }
        if self.end != p0 || self.start == self.end {
            self.start = p0;
        }
        self.end = p0 + len;
        self.start = self.start.max(self.end.saturating_sub(self.cap));
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

/// The tick tensors a [`LogDev::record`] copies from: raw KV rows (`hd` wide) and, where the layer has them, the
/// main and indexer compressors' `(features, gates)`.
pub struct LogSources<'a> {
    pub raw: &'a Buf,
    pub hd: usize,
    pub comp: Option<(&'a Buf, &'a Buf)>,
    pub idx: Option<(&'a Buf, &'a Buf)>,
}

/// One layer of a device mirror.
pub struct LayerDev {
    pub ring: Buf,
    pub comp: Option<Rows>,
    pub idx: Option<Rows>,
    pub fcomp: Option<FrontDev>,
    pub fidx: Option<FrontDev>,
    /// Tokens this layer has processed (set by each attention op; `None` right after an upload).
    pub pos: Option<usize>,
    /// The roll-back log (see module docs); `None` when the backend keeps none.
    pub log: Option<LogDev>,
}

/// The device mirror of one session (see module docs).
pub struct SlotKv {
    pub epoch: u64,
    pub layers: Vec<LayerDev>,
}

impl SlotKv {
    /// Uploads host state `kv` for a model with config `cfg`; checks the shapes. `log_tokens` (R) > 0 gives every
    /// layer an empty roll-back log of `R + max(window, 2·ratio)` slots.
    pub fn upload(ctx: &WgpuContext, cfg: &ModelConfig, kv: &SessionKv, log_tokens: usize) -> Result<SlotKv> {
        if kv.sync.host_stale {
            return Err(backend_err("device KV: the host copy is stale and the device copy is gone"));
        }
        if kv.layers.len() != cfg.n_layers {
            return Err(backend_err(format!("device KV: {} layers, model has {}", kv.layers.len(), cfg.n_layers)));
        }
        let mut layers = Vec::with_capacity(kv.layers.len());
        for (l, lk) in kv.layers.iter().enumerate() {
            let kind = cfg.layer_kind(l);
            let bad = |what: &str| backend_err(format!("device KV: layer {l}: {what}"));
            if lk.ring.len() != cfg.window * cfg.head_dim {
                return Err(bad("ring has the wrong size"));
            }
            let (comp, idx) = match kind {
                LayerKind::Window => (None, None),
                LayerKind::Hca => (Some(Rows::new(ctx, cfg.head_dim, &lk.comp_rows.to_vec())?), None),
                LayerKind::Csa => (
                    Some(Rows::new(ctx, cfg.head_dim, &lk.comp_rows.to_vec())?),
                    Some(Rows::new(ctx, cfg.idx_head_dim, &lk.idx_rows.to_vec())?),
                ),
            };
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
            let log = (log_tokens > 0).then(|| {
                let cap = log_tokens + cfg.window.max(2 * ratio);
                let cw = (kind != LayerKind::Window).then_some(coff * cfg.head_dim);
                let iw = (kind == LayerKind::Csa).then_some(2 * cfg.idx_head_dim);
                LogDev::new(ctx, cap, cfg.head_dim, cw, iw)
            });
            layers.push(LayerDev {
                ring: ctx.storage_f32("ring", &lk.ring),
                comp,
                idx,
                fcomp: lk.comp.as_ref().map(|f| FrontDev::upload(ctx, f)).transpose()?,
                fidx: lk.idx.as_ref().map(|f| FrontDev::upload(ctx, f)).transpose()?,
                pos: None,
                log,
            });
        }
        tracing::debug!(layers = layers.len(), "wgpu: uploaded session KV");
        Ok(SlotKv { epoch: 0, layers })
    }

    /// [`SessionKv::bytes`] of the state this mirror holds.
    pub fn bytes(&self) -> u64 {
        let f = |f: &Option<FrontDev>| f.as_ref().map_or(0, |f| 2 * f.ratio * f.coff * f.dim);
        let r = |r: &Option<Rows>| r.as_ref().map_or(0, |r| r.rows * r.width);
        let values: usize = self
            .layers
            .iter()
            .map(|l| (l.ring.size() / 4) as usize + r(&l.comp) + r(&l.idx) + f(&l.fcomp) + f(&l.fidx))
            .sum();
        (values * 4) as u64
    }

    /// Gives the session a fresh epoch: its host arrays are stale from now on.
    pub fn stamp(&mut self, sync: &mut KvSync) {
        self.epoch = next_epoch();
        *sync = KvSync { epoch: self.epoch, host_stale: true, device_bytes: self.bytes() };
    }

    /// Rows `rows` of `table` in layer `layer`, read as one contiguous device range: for the row range of a
    /// persist page this is exactly that page's row block for the layer (see module docs). Waits for the device.
    pub fn read_rows(
        &self,
        ctx: &WgpuContext,
        layer: usize,
        table: RowTable,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let ld = self.layers.get(layer).ok_or_else(|| backend_err(format!("device KV: no layer {layer}")))?;
        let r = match table {
            RowTable::Comp => ld.comp.as_ref(),
            RowTable::Idx => ld.idx.as_ref(),
        }
        .ok_or_else(|| backend_err(format!("device KV: layer {layer} has no {table:?} rows")))?;
        if rows.start > rows.end || rows.end > r.rows {
            return Err(backend_err(format!("device KV: rows {rows:?} out of 0..{}", r.rows)));
        }
        ctx.read_f32(&r.buf, rows.start * r.width, rows.len() * r.width)
    }

    /// A copy of this mirror made on the device (recorded into `enc`; nothing goes through the host), with epoch 0
    /// (give it one with [`SlotKv::stamp`]), and the bytes copied: the valid rows of every table, the rings,
    /// frontiers and roll-back logs.
    pub fn duplicate(&self, ctx: &WgpuContext, enc: &mut wgpu::CommandEncoder) -> (SlotKv, u64) {
        let mut bytes = 0u64;
        let mut dup = |b: &Buf, used: u64| -> Buf {
            let d = ctx.storage_zeroed("kv copy", (b.size() / 4) as usize);
            if used > 0 {
                enc.copy_buffer_to_buffer(b, 0, &d, 0, used);
            }
            bytes += used;
            d
        };
        let layers = self
            .layers
            .iter()
            .map(|ld| {
                let rows = |r: &Option<Rows>, dup: &mut dyn FnMut(&Buf, u64) -> Buf| {
                    r.as_ref().map(|r| Rows {
                        buf: dup(&r.buf, (r.rows * r.width * 4) as u64),
                        rows: r.rows,
                        cap: r.cap,
                        width: r.width,
                    })
                };
                let front = |f: &Option<FrontDev>, dup: &mut dyn FnMut(&Buf, u64) -> Buf| {
                    f.as_ref().map(|f| FrontDev {
                        kv: dup(&f.kv, f.kv.size()),
                        gate: dup(&f.gate, f.gate.size()),
                        ratio: f.ratio,
                        dim: f.dim,
                        coff: f.coff,
                    })
                };
                let inputs = |c: &Option<LogComp>, dup: &mut dyn FnMut(&Buf, u64) -> Buf| {
                    c.as_ref().map(|c| LogComp {
                        kv: dup(&c.kv, c.kv.size()),
                        gate: dup(&c.gate, c.gate.size()),
                        width: c.width,
                    })
                };
                LayerDev {
                    ring: dup(&ld.ring, ld.ring.size()),
                    comp: rows(&ld.comp, &mut dup),
                    idx: rows(&ld.idx, &mut dup),
                    fcomp: front(&ld.fcomp, &mut dup),
                    fidx: front(&ld.fidx, &mut dup),
                    pos: ld.pos,
                    log: ld.log.as_ref().map(|g| LogDev {
                        cap: g.cap,
                        raw: dup(&g.raw, g.raw.size()),
                        comp: inputs(&g.comp, &mut dup),
                        idx: inputs(&g.idx, &mut dup),
                        start: g.start,
                        end: g.end,
                    }),
                }
            })
            .collect();
        (SlotKv { epoch: 0, layers }, bytes)
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
    /// `l`'s compressor `ape` tables on the device (main, indexer).
    pub fn rollback(
        &mut self,
        ctx: &WgpuContext,
        enc: &mut wgpu::CommandEncoder,
        cfg: &ModelConfig,
        apes: &[(Option<&Buf>, Option<&Buf>)],
        pos: usize,
        len: usize,
    ) -> Result<bool> {
        if len > pos || len < self.rollback_floor(cfg, pos) || apes.len() != self.layers.len() {
            return Ok(false);
        }
        let (hd, window) = (cfg.head_dim, cfg.window);
        for (l, ld) in self.layers.iter_mut().enumerate() {
            let log = ld.log.as_mut().ok_or_else(|| backend_err("device KV: roll back without a log"))?;
            let cap = log.cap;
            // Ring slot s: the latest position below `len` in it, if any (else zero).
            let mut pairs = Vec::with_capacity(window);
            for s in 0..window {
                match ((len + window - 1 - s) / window * window + s).checked_sub(window) {
                    Some(p) => pairs.push((p % cap, s)),
                    None => enc.clear_buffer(&ld.ring, (s * hd * 4) as u64, Some((hd * 4) as u64)),
                }
            }
            copy_rows(enc, &log.raw, &ld.ring, &pairs, hd);
            let ratio = cfg.compress_ratios[l];
            for (front, rows, inputs, ape) in
                [(&ld.fcomp, ld.comp.as_mut(), &log.comp, apes[l].0), (&ld.fidx, ld.idx.as_mut(), &log.idx, apes[l].1)]
            {
                let (Some(f), Some(rows), Some(inputs), Some(ape)) = (front, rows, inputs, ape) else {
                    continue;
                };
                rebuild_front(ctx, enc, f, inputs, ape, cap, len)?;
                rows.rows = len / ratio;
            }
            log.end = len;
            ld.pos = Some(len);
        }
        Ok(true)
    }

    /// Copies the device state into `kv`'s host arrays (waits for the device) and clears `host_stale`.
    pub fn download(&self, ctx: &WgpuContext, kv: &mut SessionKv) -> Result<()> {
        if kv.layers.len() != self.layers.len() {
            return Err(backend_err("device KV: layer count changed"));
        }
        for (ld, lk) in self.layers.iter().zip(kv.layers.iter_mut()) {
            let pos = ld.pos;
            download_layer(ctx, ld, lk, pos)?;
        }
        kv.sync.host_stale = false;
        Ok(())
    }
}

fn download_layer(ctx: &WgpuContext, ld: &LayerDev, lk: &mut LayerKv, pos: Option<usize>) -> Result<()> {
    lk.ring = ctx.read_f32(&ld.ring, 0, lk.ring.len())?;
    for (rows, host) in [(&ld.comp, &mut lk.comp_rows), (&ld.idx, &mut lk.idx_rows)] {
        if let Some(r) = rows {
            host.clear();
            host.extend_from_slice(&ctx.read_f32(&r.buf, 0, r.rows * r.width)?);
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
/// `cap`-token log) and the compressor's `ape` (the host `Frontier::rebuild`, on the device): pending slot `j` takes
/// the block of `len` when `j < len % ratio`, else the previous block's row (zero before the first block); CSA's
/// carried rows take the previous complete block (zero before it). Gates get `ape` added back with the push's add.
fn rebuild_front(
    ctx: &WgpuContext,
    enc: &mut wgpu::CommandEncoder,
    f: &FrontDev,
    inputs: &LogComp,
    ape: &Buf,
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
                    enc.clear_buffer(b, (m + j) as u64 * row_bytes, Some(row_bytes));
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
                enc.clear_buffer(b, 0, Some(m as u64 * row_bytes));
            }
        }
    }
    copy_rows(enc, &inputs.kv, &f.kv, &pairs, w);
    copy_rows(enc, &inputs.gate, &f.gate, &pairs, w);
    if pending > 0 {
        super::ops::add_ape(ctx, enc, &f.gate, m * w, pending, w, ape, 0, m)?;
    }
    if f.coff == 2 && blocks > 0 {
        super::ops::add_ape(ctx, enc, &f.gate, 0, m, w, ape, 0, m)?;
    }
    Ok(())
}

/// Records copies of rows `(src_row, dst_row)` of `width` values from `src` to `dst`, merging consecutive runs.
pub fn copy_rows(enc: &mut wgpu::CommandEncoder, src: &Buf, dst: &Buf, pairs: &[(usize, usize)], width: usize) {
    let mut i = 0;
    while i < pairs.len() {
        let (s0, d0) = pairs[i];
        let mut n = 1;
        while i + n < pairs.len() && pairs[i + n] == (s0 + n, d0 + n) {
            n += 1;
        }
        let b = (width * 4) as u64;
        enc.copy_buffer_to_buffer(src, s0 as u64 * b, dst, d0 as u64 * b, n as u64 * b);
        i += n;
    }
}
