//! [`WgpuBackend`]: a [`Backend`] on the GPU kernels of this folder, device-resident.
//!
//! A kernel provider for the nodes of [`crate::model::recipe`]: [`Backend::supports`] is true for every op whose
//! weights have a WGSL decoder, and [`Backend::run_node`] records the node's dispatches into the tick's one
//! command encoder (the kernels: `rows` for the row ops, mHC and logits, `attn` for the KV ops, `moe` for the
//! expert ops). The executor records the nodes in recipe order; nothing is submitted until the readback node
//! ([`crate::graph::Op::Readback`]) sends the tick with the copy of the logit rows to the host — one submission and
//! one readback per tick (counted by [`WgpuContext::counters`]). The router's choice stays on the device in decode
//! and prefill alike (the expert-indexed and expert-grouped products of [`super::moe_ids`]).
//!
//! Weights are uploaded once, lazily on first use, in their file encoding (split across bindings when large) and
//! cached by weight id; small f32 tensors (norms, sinks, biases, mHC base/scale) likewise. Each tensor
//! ([`crate::graph::BufId`]) resolves to device buffers of the tick state (`resident::Tick`); the host arrays of
//! [`crate::backend::Activations`] are written only by the readback. When the executor places nodes on a host
//! fallback, [`Backend::download`] submits the tick so far and reads a tensor back (a submission and a readback of
//! its own) and [`Backend::upload`] records a copy from a fresh buffer, in order with the tick's commands.
//!
//! Session KV lives on the device ([`super::kvdev`], advanced by the KV nodes without readbacks); the host
//! [`SessionKv`] is a lazily synced mirror: [`Backend::sync_kv`] downloads it, and a host state the device has not
//! seen (new, restored, cleared) is uploaded at its session's first KV node of a tick.
//!
//! RoPE cos/sin are computed on the host the way [`crate::model::RopeFreqs::apply`] does (`pos as f32 * f`, then
//! `sin_cos`) and uploaded once per tick and rope flavour, so both backends rotate by identical angles.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::context::{backend_err, Enc, WgpuContext};
use super::kvdev::{DevKv, SlotKv};
use super::matmul::{matmul, View};
use super::resident::Tick;
use super::weights::{weight_format, GpuWeight};
use super::{attn, fuse, moe, rows};
use crate::backend::{Backend, StepCtx};
use crate::graph::{BufId, Op};
use crate::model::{CompressorWeights, Model, ModelConfig, WeightId};
use crate::tables::{KvSync, SessionKv};
use crate::Result;

type Buf = wgpu::Buffer;

/// The wgpu backend (see module docs).
pub struct WgpuBackend {
    ctx: WgpuContext,
    mats: Mutex<HashMap<u32, Arc<GpuWeight>>>,
    dense: Mutex<HashMap<u32, Arc<Buf>>>,
    /// Pairs of weights uploaded interleaved by group ([`GpuWeight::upload_interleaved`]: the MoE gate and up
    /// matrices), by the two ids.
    pairs: Mutex<HashMap<(u32, u32), Arc<GpuWeight>>>,
    /// Weights multiplied by one input in one dispatch, uploaded as one matrix ([`fuse::products`]), by their ids
    /// (`None`: they do not fit one binding, and are multiplied apart).
    multis: Mutex<HashMap<Vec<u32>, Option<Arc<GpuWeight>>>>,
    /// Hash-routing tables (`tid2eid`) by layer, uploaded on first use like the weights.
    hash_tables: Mutex<HashMap<usize, Arc<Buf>>>,
    tick: Mutex<Tick>,
    /// Device KV mirrors by batch slot and their page pools (see [`super::kvdev`]).
    kv: Mutex<DevKv>,
    /// Tokens of roll-back log (R) each mirror keeps on the device; 0: none ([`Backend::set_device_rollback`]).
    rollback: AtomicUsize,
    /// Whether consecutive nodes are fused ([`fuse`]; on by default).
    fusion: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuBackend").field("adapter", &self.ctx.info.name).finish()
    }
}

impl WgpuBackend {
    /// Opens the default adapter (see [`WgpuContext::new`]).
    pub fn new() -> Result<Self> {
        Ok(Self::with_context(WgpuContext::new()?))
    }

    /// A backend on an existing context.
    pub fn with_context(ctx: WgpuContext) -> Self {
        Self {
            ctx,
            mats: Mutex::new(HashMap::new()),
            dense: Mutex::new(HashMap::new()),
            pairs: Mutex::new(HashMap::new()),
            multis: Mutex::new(HashMap::new()),
            hash_tables: Mutex::new(HashMap::new()),
            tick: Mutex::new(Tick::default()),
            kv: Mutex::new(DevKv::default()),
            rollback: AtomicUsize::new(0),
            fusion: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Turns the fusion of consecutive nodes ([`fuse`]) on or off (results are the same either way, bit for bit;
    /// off records one dispatch per node kernel, for comparisons).
    pub fn set_fusion(&self, on: bool) {
        self.fusion.store(on, Ordering::Relaxed);
    }

    /// Tokens of roll-back log each device mirror keeps (R; 0: none).
    pub(super) fn rollback_tokens(&self) -> usize {
        self.rollback.load(Ordering::Relaxed)
    }

    /// The slot of the mirror holding session state `kv` (by its [`crate::tables::KvSync`] epoch; preferably
    /// `slot`).
    fn mirror_slot(kvs: &HashMap<usize, SlotKv>, slot: usize, kv: &SessionKv) -> Option<usize> {
        let e = kv.sync.epoch;
        if e == 0 {
            return None;
        }
        if kvs.get(&slot).is_some_and(|m| m.epoch == e) {
            Some(slot)
        } else {
            kvs.iter().find(|(_, m)| m.epoch == e).map(|(&s, _)| s)
        }
    }

    /// The mirror holding session state `kv` (see `mirror_slot`).
    fn mirror_of<'m>(kvs: &'m HashMap<usize, SlotKv>, slot: usize, kv: &SessionKv) -> Option<&'m SlotKv> {
        Self::mirror_slot(kvs, slot, kv).and_then(|s| kvs.get(&s))
    }

    /// The device context.
    pub fn context(&self) -> &WgpuContext {
        &self.ctx
    }

    /// How many bindings (chunks) weight `id` occupies on the device (uploading it if needed).
    pub fn weight_chunks(&self, model: &Model, id: WeightId) -> Result<usize> {
        Ok(self.mat(model, id)?.chunks.len())
    }

    /// The weights uploaded so far (ascending ids): a weight is uploaded the first time a node of this backend
    /// reads it, so the weights of nodes placed elsewhere never are.
    pub fn resident_weights(&self) -> Vec<WeightId> {
        let mut ids: Vec<u32> = self.pairs.lock().keys().flat_map(|&(a, b)| [a, b]).collect();
        ids.extend(self.multis.lock().iter().filter(|(_, w)| w.is_some()).flat_map(|(k, _)| k.iter().copied()));
        let mut v: Vec<WeightId> =
            self.mats.lock().keys().chain(self.dense.lock().keys()).chain(&ids).map(|&i| WeightId(i)).collect();
        v.sort_unstable_by_key(|w| w.0);
        v.dedup();
        v
    }

    /// Drops every cached device weight (they are keyed by weight id, so call this before using another model)
    /// and every device KV mirror (sessions whose host copy is stale can then no longer be synced).
    pub fn clear_weights(&self) {
        self.mats.lock().clear();
        self.dense.lock().clear();
        self.hash_tables.lock().clear();
        self.pairs.lock().clear();
        self.multis.lock().clear();
        self.ctx.forget_bindings();
        self.kv.lock().clear();
    }

    /// Submits the commands recorded so far in this tick, if any (the tick's encoder starts afresh).
    fn flush(&self) -> Result<()> {
        let mut t = self.tick.lock();
        if t.pending() {
            let enc = t.take_enc(&self.ctx);
            self.ctx.submit(enc)?;
        }
        Ok(())
    }

    /// Rows `rows` of one layer's compressed or indexer rows of the session whose state is `kv` (by its
    /// [`crate::tables::KvSync`] epoch), straight from the device: one contiguous range, the values of the
    /// session's persist row block for that layer when `rows` is a page's row range. Works whether or not the host
    /// copy is stale; errors when the device holds no copy of this state.
    pub fn kv_rows(
        &self,
        kv: &SessionKv,
        layer: usize,
        table: super::kvdev::RowTable,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        self.flush()?;
        let dk = self.kv.lock();
        let e = kv.sync.epoch;
        let m = dk
            .slots
            .values()
            .find(|m| e != 0 && m.epoch == e)
            .ok_or_else(|| backend_err("device KV: no device copy of this session state"))?;
        m.read_rows(&self.ctx, &dk.pools, layer, table, rows)
    }

    /// Slots with a device KV mirror.
    pub fn kv_slots(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.kv.lock().slots.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// `(live, shared)` device KV pages over every layer's pools (see [`super::pagedev`]).
    pub fn kv_pages(&self) -> (usize, usize) {
        self.kv.lock().pages()
    }

    pub(super) fn mat(&self, model: &Model, id: WeightId) -> Result<Arc<GpuWeight>> {
        self.mat_grouped(model, id, 1)
    }

    /// Like `mat`, preferring chunk boundaries every `group` rows (one expert's rows) on first upload.
    pub(super) fn mat_grouped(&self, model: &Model, id: WeightId, group: usize) -> Result<Arc<GpuWeight>> {
        if let Some(w) = self.mats.lock().get(&id.0) {
            return Ok(w.clone());
        }
        let m = model.mat(id);
        let w = Arc::new(GpuWeight::upload(&self.ctx, model.name(id), m.ty, m.cols, m.rows, m.data, group)?);
        self.mats.lock().insert(id.0, w.clone());
        Ok(w)
    }

    /// Weights `a` and `b` as one matrix interleaved by groups of `group` rows ([`GpuWeight::upload_interleaved`]),
    /// or `None` when they differ in type or shape (the caller then multiplies them apart).
    pub(super) fn mat_pair(
        &self,
        model: &Model,
        a: WeightId,
        b: WeightId,
        group: usize,
    ) -> Result<Option<Arc<GpuWeight>>> {
        if let Some(w) = self.pairs.lock().get(&(a.0, b.0)) {
            return Ok(Some(w.clone()));
        }
        let (ma, mb) = (model.mat(a), model.mat(b));
        if ma.ty != mb.ty || ma.cols != mb.cols || ma.rows != mb.rows || group == 0 || !ma.rows.is_multiple_of(group) {
            return Ok(None);
        }
        let name = format!("{}+{}", model.name(a), model.name(b));
        let w = GpuWeight::upload_interleaved(&self.ctx, &name, ma.ty, ma.cols, ma.rows, ma.data, mb.data, group)?;
        let w = Arc::new(w);
        self.pairs.lock().insert((a.0, b.0), w.clone());
        Ok(Some(w))
    }

    /// Weights `ids` (one type and width) as one matrix, their rows one after another, for [`fuse::products`];
    /// `None` when they differ in type or width or do not fit one binding.
    pub(super) fn mat_multi(&self, model: &Model, ids: &[WeightId]) -> Result<Option<Arc<GpuWeight>>> {
        let key: Vec<u32> = ids.iter().map(|w| w.0).collect();
        if let Some(w) = self.multis.lock().get(&key) {
            return Ok(w.clone());
        }
        let mats: Vec<_> = ids.iter().map(|&w| model.mat(w)).collect();
        let (ty, cols) = (mats[0].ty, mats[0].cols);
        let bytes: usize = mats.iter().map(|m| m.data.len()).sum();
        let w = if mats.iter().all(|m| m.ty == ty && m.cols == cols) && bytes as u64 <= self.ctx.max_binding() {
            let mut data = Vec::with_capacity(bytes);
            mats.iter().for_each(|m| data.extend_from_slice(m.data));
            let rows = mats.iter().map(|m| m.rows).sum();
            let name = ids.iter().map(|&w| model.name(w)).collect::<Vec<_>>().join("+");
            Some(Arc::new(GpuWeight::upload(&self.ctx, &name, ty, cols, rows, &data, 1)?))
                .filter(|w| w.chunks.len() == 1)
        } else {
            None
        };
        self.multis.lock().insert(key, w.clone());
        Ok(w)
    }

    /// Layer `layer`'s hash-routing table (`tid2eid`, `[vocab, k]`) on the device, uploaded once.
    pub(super) fn hash_table(&self, layer: usize, table: &[u32]) -> Arc<Buf> {
        let mut tables = self.hash_tables.lock();
        tables.entry(layer).or_insert_with(|| Arc::new(self.ctx.storage_u32("tid2eid", table))).clone()
    }

    pub(super) fn dense(&self, model: &Model, id: WeightId) -> Arc<Buf> {
        if let Some(b) = self.dense.lock().get(&id.0) {
            return b.clone();
        }
        let b = Arc::new(self.ctx.storage_f32(model.name(id), model.dense(id)));
        self.dense.lock().insert(id.0, b.clone());
        b
    }

    /// `y[t] = W x[t]` over all rows of `w`.
    pub(super) fn mm(&self, enc: &mut Enc, w: &GpuWeight, x: View<'_>, n: usize, y: View<'_>) -> Result<()> {
        matmul(&self.ctx, enc, w, 0..w.rows, x, n, y, false)
    }
}

impl Backend for WgpuBackend {
    fn kind(&self) -> crate::backend::BackendKind {
        crate::backend::BackendKind::Wgpu
    }

    fn begin_tick(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        self.ctx.next_tick();
        self.tick.lock().begin(cx);
        Ok(())
    }

    fn end_tick(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        self.release_held(&mut self.tick.lock(), cx)?;
        // Normally the readback node has submitted everything already.
        self.flush()
    }

    /// Submits the tick so far and reads the tensor back (a submission and a readback of its own).
    fn download(&self, id: BufId, cx: &mut StepCtx<'_>, out: &mut [f32]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let mut t = self.tick.lock();
        self.release_held(&mut t, cx)?;
        let buf = self.buf(&mut t, cx.model, id)?;
        let got = self.ctx.submit_read_f32(t.take_enc(&self.ctx), &buf, 0, out.len())?;
        out.copy_from_slice(&got);
        Ok(())
    }

    /// Records a copy from a fresh buffer holding `data` into the tensor's buffer, in order with the tick's other
    /// commands (a host write straight into the tensor would land before them).
    fn upload(&self, id: BufId, cx: &mut StepCtx<'_>, data: &[f32]) -> Result<()> {
        let mut t = self.tick.lock();
        self.release_held(&mut t, cx)?;
        let buf = self.buf(&mut t, cx.model, id)?;
        let bytes = std::mem::size_of_val(data) as u64;
        if bytes > buf.size() {
            return Err(backend_err(format!("upload of {} values into {id:?}", data.len())));
        }
        if bytes > 0 {
            let src = self.ctx.storage_f32("upload", data);
            self.ctx.copy(t.enc(&self.ctx), &src, 0, &buf, 0, bytes);
        }
        Ok(())
    }

    fn sync_kv(&self, slot: usize, kv: &mut SessionKv) -> Result<()> {
        if !kv.sync.host_stale {
            return Ok(());
        }
        self.flush()?;
        let dk = self.kv.lock();
        let e = kv.sync.epoch;
        let m = match dk.slots.get(&slot).filter(|m| m.epoch == e) {
            Some(m) => m,
            None => dk
                .slots
                .values()
                .find(|m| m.epoch == e)
                .ok_or_else(|| backend_err("device KV: the host copy is stale and the device copy is gone"))?,
        };
        m.download(&self.ctx, &dk.pools, kv)
    }

    fn release_kv(&self, slot: usize) {
        self.kv.lock().remove(slot);
    }

    /// Copies the mirror's private tail with device-side copies and shares its KV pages (see
    /// [`SlotKv::duplicate`]), submitted at once, under slot `dst` with a fresh epoch.
    fn fork_kv(&self, slot: usize, kv: &SessionKv, dst: usize) -> Result<Option<(KvSync, u64)>> {
        self.flush()?;
        let mut dk = self.kv.lock();
        let Some(at) = Self::mirror_slot(&dk.slots, slot, kv) else { return Ok(None) };
        let mut enc = self.ctx.encoder();
        let DevKv { slots, pools } = &mut *dk;
        let (mut copy, bytes) = match slots.get(&at) {
            Some(m) => m.duplicate(&self.ctx, &mut enc, pools)?,
            None => return Ok(None),
        };
        self.ctx.submit(enc)?;
        let mut tag = KvSync::default();
        copy.stamp(&mut tag);
        dk.insert(dst, copy);
        Ok(Some((tag, bytes)))
    }

    fn device_name(&self) -> Option<String> {
        let i = &self.ctx.info;
        Some(format!("{} ({:?}, {:?}, driver {})", i.name, i.backend, i.device_type, i.driver))
    }

    fn device_counters(&self) -> Option<crate::backend::device::DeviceCounters> {
        Some(self.ctx.counters())
    }

    fn start_kernel_timing(&self) -> bool {
        self.ctx.start_timing()
    }

    fn kernel_times(&self) -> Result<Option<Vec<(String, f64)>>> {
        self.ctx.finish_timing()
    }

    fn device_weight_bytes(&self) -> Option<u64> {
        let size = |w: &Arc<GpuWeight>| (w.rows * w.row_bytes) as u64;
        let mats: u64 = self.mats.lock().values().map(size).sum::<u64>()
            + self.pairs.lock().values().map(size).sum::<u64>()
            + self.multis.lock().values().flatten().map(size).sum::<u64>();
        let dense: u64 = self.dense.lock().values().map(|b| b.size()).sum();
        Some(mats + dense)
    }

    fn device_kv_pages(&self) -> Option<(usize, usize)> {
        Some(self.kv_pages())
    }

    fn kv_on_device(&self) -> bool {
        true
    }

    fn set_device_rollback(&self, tokens: usize) {
        self.rollback.store(tokens, Ordering::Relaxed);
    }

    fn device_rollback_floor(&self, slot: usize, kv: &SessionKv, cfg: &ModelConfig, pos: usize) -> Option<usize> {
        let dk = self.kv.lock();
        Self::mirror_of(&dk.slots, slot, kv).map(|m| m.rollback_floor(cfg, pos))
    }

    /// Rolls the mirror back with device-side copies (see [`super::kvdev`]), submitted at once; the session's host
    /// arrays become stale (a fresh epoch).
    fn rollback_kv(&self, slot: usize, kv: &mut SessionKv, model: &Model, pos: usize, len: usize) -> Result<bool> {
        self.flush()?;
        let apes: Vec<[Option<Arc<Buf>>; 2]> = model
            .layers
            .iter()
            .map(|lw| {
                let ape = |c: Option<&CompressorWeights>| c.map(|c| self.dense(model, c.ape));
                [ape(lw.compressor.as_ref()), ape(lw.indexer.as_ref().map(|i| &i.comp))]
            })
            .collect();
        let apes: Vec<(Option<&Buf>, Option<&Buf>)> = apes.iter().map(|[a, b]| (a.as_deref(), b.as_deref())).collect();
        let mut dk = self.kv.lock();
        let Some(at) = Self::mirror_slot(&dk.slots, slot, kv) else { return Ok(false) };
        let DevKv { slots, pools } = &mut *dk;
        let Some(m) = slots.get_mut(&at) else { return Ok(false) };
        let mut enc = self.ctx.encoder();
        if !m.rollback(&self.ctx, &mut enc, &model.config, &apes, pools, pos, len)? {
            return Ok(false);
        }
        self.ctx.submit(enc)?;
        m.stamp(&mut kv.sync);
        Ok(true)
    }

    /// Every op kind of the target model has a kernel; ops whose weights have no WGSL decoder are not supported,
    /// nor the MTP drafter's input stage (the drafter runs on the CPU).
    fn supports(&self, op: &Op, model: &Model) -> bool {
        let ok = |w: WeightId| weight_format(model.mat(w).ty).is_ok();
        match *op {
            Op::MtpInput => false,
            Op::Embed => ok(model.global.embed),
            Op::MatMul { w, .. } | Op::GroupedMatMul { w, .. } => ok(w),
            Op::Logits => ok(model.global.head),
            Op::ExpertUp { layer, .. } | Op::ExpertDown { layer, .. } => {
                let lw = &model.layers[layer];
                [lw.gate_exps, lw.up_exps, lw.down_exps]
                    .into_iter()
                    .chain(lw.gate_sh)
                    .chain(lw.up_sh)
                    .chain(lw.down_sh)
                    .all(ok)
            }
            _ => true,
        }
    }

    fn runs_groups(&self) -> bool {
        self.fusion.load(Ordering::Relaxed)
    }

    fn run_group(&self, ops: &[Op], cx: &mut StepCtx<'_>) -> Result<()> {
        let singles = {
            let mut t = self.tick.lock();
            self.release_held(&mut t, cx)?;
            fuse::products(self, &mut t, cx, ops)?
        };
        singles.into_iter().try_for_each(|op| self.run_node(&op, cx))
    }

    fn run_node(&self, op: &Op, cx: &mut StepCtx<'_>) -> Result<()> {
        let mut t = self.tick.lock();
        let t = &mut *t;
        if let Some(h) = t.held.take() {
            if fuse::fused(self, t, cx, h, op)? {
                return Ok(());
            }
            if fuse::waits(&h, op) {
                // Recorded alone; the held node keeps waiting for its pair.
                t.held = Some(h);
                return self.record(t, op, cx);
            }
            fuse::run_alone(self, t, cx, h)?;
        }
        if let Some(h) = fuse::hold(op).filter(|_| self.fusion.load(Ordering::Relaxed)) {
            t.held = Some(h);
            return Ok(());
        }
        self.record(t, op, cx)
    }
}

impl WgpuBackend {
    /// Records `op`'s own kernels (no fusion).
    fn record(&self, t: &mut Tick, op: &Op, cx: &mut StepCtx<'_>) -> Result<()> {
        match *op {
            Op::Embed => rows::embed(self, t, cx, None),
            Op::MtpInput => Err(backend_err("no kernel for the MTP input stage (the drafter runs on the CPU)")),
            Op::TapStreams { tap, .. } => {
                // A host sync (only in ticks where a DSpark drafter's target keeps its features): the tick so far
                // is submitted and the streams read back; the means are taken on the host.
                let c = &cx.model.config;
                let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
                let out = &mut cx.act.hidden_out;
                if n == 0 || out.len() < n * (tap + 1) * d || !out.len().is_multiple_of(n * d) {
                    return Err(backend_err(format!(
                        "TapStreams: {} kept values for {n} rows of tap {tap}",
                        out.len()
                    )));
                }
                let buf = self.buf(t, cx.model, BufId::Streams)?;
                let streams = self.ctx.submit_read_f32(t.take_enc(&self.ctx), &buf, 0, n * hc * d)?;
                crate::backend::cpu::hc::tap_means(&streams, n, hc, d, tap, out);
                Ok(())
            }
            Op::RmsNorm { x, y, w, width, heads } => rows::rms_norm(self, t, cx, x, y, w, width, heads),
            Op::MatMul { w, x, y } => rows::matmul(self, t, cx, w, x, y),
            Op::GroupedMatMul { w, x, y, groups, rank } => rows::grouped_matmul(self, t, cx, w, x, y, groups, rank),
            Op::Rope { x, layer, width, heads, inverse } => rows::rope(self, t, cx, x, layer, width, heads, inverse),
            Op::ActSim { x, width, heads, kind } => rows::act_sim(self, t, cx, x, width, heads, kind),
            Op::Scale { x, width, factor } => rows::scale(self, t, cx, x, width, factor),
            Op::HcSinkhorn { layer, sub } => rows::hc_sinkhorn(self, t, cx, layer, sub),
            Op::HcHeadWeights => rows::hc_head_weights(self, t, cx),
            Op::HcCollapse { out } => rows::hc_collapse(self, t, cx, out),
            Op::HcPost => rows::hc_post(self, t, cx, None),
            Op::Logits => rows::logits(self, t, cx),
            Op::LogitCandidates { k } => rows::logit_candidates(self, t, cx, k),
            Op::Readback { buf } => rows::readback(self, t, cx, buf),
            Op::CompressPush { layer, indexer, sim } => {
                attn::compress_push(self, t, &mut self.kv.lock(), cx, layer, indexer, sim)
            }
            Op::IndexerTopK { layer } => attn::indexer_topk(self, t, &mut self.kv.lock(), cx, layer, 1.0),
            Op::SparseAttention { layer } => attn::sparse_attention(self, t, &mut self.kv.lock(), cx, layer, false),
            Op::WindowStore { layer } => attn::kv_store(self, t, &mut self.kv.lock(), cx, layer),
            Op::MoeRoute { layer, hash, experts } => moe::route(self, t, cx, layer, hash, experts),
            Op::ExpertUp { layer, experts } => moe::expert_up(self, t, cx, layer, experts),
            Op::SwiGlu { layer } => moe::swiglu(self, t, cx, layer),
            Op::ExpertDown { layer, experts } => moe::expert_down(self, t, cx, layer, experts),
            Op::MoeCombine { experts } => moe::combine(self, t, cx, experts),
        }
    }

    /// The device KV mirrors and their pools (locked).
    pub(super) fn device_kv(&self) -> parking_lot::MutexGuard<'_, DevKv> {
        self.kv.lock()
    }

    /// Records the node held for fusion, if any ([`fuse`]), before anything else touches the tick.
    fn release_held(&self, t: &mut Tick, cx: &mut StepCtx<'_>) -> Result<()> {
        match t.held.take() {
            Some(h) => fuse::run_alone(self, t, cx, h),
            None => Ok(()),
        }
    }

    /// The device buffer of tensor `id` in tick `t` (an error for the KV pages, which are session mirrors).
    pub(super) fn buf(&self, t: &mut Tick, model: &Model, id: BufId) -> Result<Buf> {
        t.buf(&self.ctx, model, id).ok_or_else(|| backend_err(format!("tensor {id:?} has no tick buffer")))
    }
}
