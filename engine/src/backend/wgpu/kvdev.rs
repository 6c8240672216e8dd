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

/// One layer of a device mirror.
pub struct LayerDev {
    pub ring: Buf,
    pub comp: Option<Rows>,
    pub idx: Option<Rows>,
    pub fcomp: Option<FrontDev>,
    pub fidx: Option<FrontDev>,
    /// Tokens this layer has processed (set by each attention op; `None` right after an upload).
    pub pos: Option<usize>,
}

/// The device mirror of one session (see module docs).
pub struct SlotKv {
    pub epoch: u64,
    pub layers: Vec<LayerDev>,
}

impl SlotKv {
    /// Uploads host state `kv` for a model with config `cfg`; checks the shapes.
    pub fn upload(ctx: &WgpuContext, cfg: &ModelConfig, kv: &SessionKv) -> Result<SlotKv> {
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
            layers.push(LayerDev {
                ring: ctx.storage_f32("ring", &lk.ring),
                comp,
                idx,
                fcomp: lk.comp.as_ref().map(|f| FrontDev::upload(ctx, f)).transpose()?,
                fidx: lk.idx.as_ref().map(|f| FrontDev::upload(ctx, f)).transpose()?,
                pos: None,
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
