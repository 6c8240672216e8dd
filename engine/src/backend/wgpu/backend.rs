//! [`WgpuBackend`]: a [`Backend`] on the GPU kernels of this folder, device-resident.
//!
//! Placement: this backend does not yet offer kernels for the fine nodes of [`crate::model::recipe`]
//! ([`Backend::supports`] is false), so the executor runs each [`Stage`] whole through [`Backend::run_stage`],
//! which records the stage's dispatches (the layer-level path; the attention stage is `attn`, the MoE stage
//! is here).
//!
//! Weights are uploaded once, lazily on first use, in their file encoding (split across bindings when large) and
//! cached by weight id; small f32 tensors (norms, sinks, biases, mHC base/scale) likewise.
//!
//! A tick ([`Backend::begin_tick`] … [`Backend::end_tick`], called by the executor) records every op into one
//! command encoder (`resident::Tick`) over device buffers that stand in for [`crate::backend::Activations`]
//! (grown, never shrunk; per-op scratch comes from the context's size-class pool). The host arrays of
//! `Activations` are not written except `logits`, which the logits stage downloads with the
//! tick's submission. MoE layers with learned routing keep the router's choice on the device for small batches
//! (`rows · k ≤ experts`: the expert-indexed product of [`super::moe_ids`]); larger (prefill) batches read the
//! expert ids back to group rows by expert, so each expert's weights are read once — the only other host sync
//! point (hash-routed layers take the ids from the token ids on the host). A decode tick thus submits once and
//! reads back once (counted by [`WgpuContext::counters`]).
//!
//! Session KV lives on the device ([`super::kvdev`], advanced by `attn` without readbacks); the host
//! [`SessionKv`] is a lazily synced mirror: [`Backend::sync_kv`] downloads it, and a host state the device has not
//! seen (new, restored, cleared) is uploaded at its session's next attention op.
//!
//! RoPE cos/sin are computed on the host the way [`crate::model::RopeFreqs::apply`] does (`pos as f32 * f`, then
//! `sin_cos`) and uploaded per op, so both backends rotate by identical angles.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::context::{backend_err, WgpuContext};
use super::kvdev::SlotKv;
use super::matmul::{get_rows, matmul, View};
use super::moe_ids;
use super::ops::{self, HcShape, Routing};
use super::res::StageResources;
use super::resident::Tick;
use super::weights::GpuWeight;
use crate::backend::{Backend, StepCtx};
use crate::graph::{Op, Stage, Sub};
use crate::model::{Model, WeightId};
use crate::tables::SessionKv;
use crate::Result;

type Buf = wgpu::Buffer;

/// The wgpu backend (see module docs).
pub struct WgpuBackend {
    ctx: WgpuContext,
    mats: Mutex<HashMap<u32, Arc<GpuWeight>>>,
    dense: Mutex<HashMap<u32, Arc<Buf>>>,
    tick: Mutex<Tick>,
    /// Device KV mirrors by batch slot (see [`super::kvdev`]).
    kv: Mutex<HashMap<usize, SlotKv>>,
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
            tick: Mutex::new(Tick::default()),
            kv: Mutex::new(HashMap::new()),
        }
    }

    /// The device context.
    pub fn context(&self) -> &WgpuContext {
        &self.ctx
    }

    /// How many bindings (chunks) weight `id` occupies on the device (uploading it if needed).
    pub fn weight_chunks(&self, model: &Model, id: WeightId) -> Result<usize> {
        Ok(self.mat(model, id)?.chunks.len())
    }

    /// Drops every cached device weight (they are keyed by weight id, so call this before using another model)
    /// and every device KV mirror (sessions whose host copy is stale can then no longer be synced).
    pub fn clear_weights(&self) {
        self.mats.lock().clear();
        self.dense.lock().clear();
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
        let kvs = self.kv.lock();
        let e = kv.sync.epoch;
        let m = kvs
            .values()
            .find(|m| e != 0 && m.epoch == e)
            .ok_or_else(|| backend_err("device KV: no device copy of this session state"))?;
        m.read_rows(&self.ctx, layer, table, rows)
    }

    /// Slots with a device KV mirror.
    pub fn kv_slots(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.kv.lock().keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn mat(&self, model: &Model, id: WeightId) -> Result<Arc<GpuWeight>> {
        self.mat_grouped(model, id, 1)
    }

    /// Like `mat`, preferring chunk boundaries every `group` rows (one expert's rows) on first upload.
    fn mat_grouped(&self, model: &Model, id: WeightId, group: usize) -> Result<Arc<GpuWeight>> {
        if let Some(w) = self.mats.lock().get(&id.0) {
            return Ok(w.clone());
        }
        let m = model.mat(id);
        let w = Arc::new(GpuWeight::upload(&self.ctx, model.name(id), m.ty, m.cols, m.rows, m.data, group)?);
        self.mats.lock().insert(id.0, w.clone());
        Ok(w)
    }

    fn dense(&self, model: &Model, id: WeightId) -> Arc<Buf> {
        if let Some(b) = self.dense.lock().get(&id.0) {
            return b.clone();
        }
        let b = Arc::new(self.ctx.storage_f32(model.name(id), model.dense(id)));
        self.dense.lock().insert(id.0, b.clone());
        b
    }

    /// `y[t] = W x[t]` over all rows of `w`.
    fn mm(&self, enc: &mut wgpu::CommandEncoder, w: &GpuWeight, x: View<'_>, n: usize, y: View<'_>) -> Result<()> {
        matmul(&self.ctx, enc, w, 0..w.rows, x, n, y, false)
    }

    fn hc_shape(model: &Model, n: usize) -> HcShape {
        let c = &model.config;
        HcShape {
            n_tok: n,
            d: c.d_model,
            n: c.hc_mult,
            sinkhorn_iters: c.hc_sinkhorn_iters,
            norm_eps: c.rms_eps,
            hc_eps: c.hc_eps,
        }
    }

    /// Current streams → `mix = fn · flatten(X)` (raw) → mHC pre kernel, writing `u` (the collapsed input or the
    /// head output) and, unless `head`, the post/comb state.
    #[allow(clippy::too_many_arguments)]
    fn hc_common(
        &self,
        t: &mut Tick,
        cx: &StepCtx<'_>,
        fn_: WeightId,
        base: WeightId,
        scale: WeightId,
        head: bool,
    ) -> Result<()> {
        let model = cx.model;
        let c = &model.config;
        let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
        let w = self.mat(model, fn_)?;
        let mixn = w.rows;
        let mix = self.ctx.scratch(n * mixn);
        let (bb, sb) = (self.dense(model, base), self.dense(model, scale));
        let shape = Self::hc_shape(model, n);
        let ctx = &self.ctx;
        let act = &mut t.act;
        let xs = act.streams[act.cur].get(ctx, "streams", n * hc * d).clone();
        let state = act.state.get(ctx, "hc state", n * (hc + hc * hc)).clone();
        let u =
            if head { act.head_out.get(ctx, "head out", n * d) } else { act.collapsed.get(ctx, "collapsed", n * d) };
        let u = u.clone();
        let enc = t.enc(ctx);
        self.mm(enc, &w, View::new(&xs, hc * d), n, View::new(&mix, mixn))?;
        ops::hc_pre(ctx, enc, &shape, &xs, (&mix, 0, mixn), &bb, &sb, &state, (&u, 0, d), head)
    }
}

impl Backend for WgpuBackend {
    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn begin_tick(&self, _cx: &mut StepCtx<'_>) -> Result<()> {
        // Anything left from a failed tick is dropped.
        self.tick.lock().discard();
        Ok(())
    }

    fn end_tick(&self, _cx: &mut StepCtx<'_>) -> Result<()> {
        self.flush()
    }

    fn sync_kv(&self, slot: usize, kv: &mut SessionKv) -> Result<()> {
        if !kv.sync.host_stale {
            return Ok(());
        }
        self.flush()?;
        let kvs = self.kv.lock();
        let e = kv.sync.epoch;
        let m = match kvs.get(&slot).filter(|m| m.epoch == e) {
            Some(m) => m,
            None => kvs
                .values()
                .find(|m| m.epoch == e)
                .ok_or_else(|| backend_err("device KV: the host copy is stale and the device copy is gone"))?,
        };
        m.download(&self.ctx, kv)
    }

    fn release_kv(&self, slot: usize) {
        self.kv.lock().remove(&slot);
    }

    /// No fine kernels yet: every stage runs whole through [`Backend::run_stage`] (see the module docs).
    fn supports(&self, _op: &Op, _model: &Model) -> bool {
        false
    }

    fn run_node(&self, op: &Op, _cx: &mut StepCtx<'_>) -> Result<()> {
        Err(backend_err(format!("no wgpu kernel for node {op:?}")))
    }

    fn run_stage(&self, stage: Stage, cx: &mut StepCtx<'_>) -> Result<()> {
        match stage {
            Stage::Embed => self.embed(cx),
            Stage::HcPre { layer, sub } => self.hc_pre(cx, layer, sub),
            Stage::Attention { layer } => self.attention(cx, layer),
            Stage::HcPost { layer, sub } => self.hc_post(cx, layer, sub),
            Stage::Moe { layer } => self.moe(cx, layer),
            Stage::HcHead => self.hc_head(cx),
            Stage::Logits => self.logits(cx),
        }
    }
}

/// The stage kernels: one recorded sequence of dispatches per [`Stage`].
impl WgpuBackend {
    fn embed(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        let model = cx.model;
        let c = &model.config;
        let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
        let emb = self.mat(model, model.global.embed)?;
        let ids: Vec<(usize, usize)> =
            cx.batch.rows.iter().enumerate().map(|(r, row)| (row.token as usize, r)).collect();
        let mut t = self.tick.lock();
        let t = &mut *t;
        t.act.cur = 0;
        let out = t.act.streams[0].get(&self.ctx, "streams", n * hc * d).clone();
        let enc = t.enc(&self.ctx);
        for j in 0..hc {
            get_rows(&self.ctx, enc, &emb, &ids, View::new(&out, hc * d).at(j * d))?;
        }
        Ok(())
    }

    fn hc_pre(&self, cx: &mut StepCtx<'_>, layer: usize, sub: Sub) -> Result<()> {
        let lw = &cx.model.layers[layer];
        let w = match sub {
            Sub::Attn => lw.hc_attn,
            Sub::Ffn => lw.hc_ffn,
        };
        self.hc_common(&mut self.tick.lock(), cx, w.fn_, w.base, w.scale, false)
    }

    fn attention(&self, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
        super::attn::attention(self, &mut self.tick.lock(), &mut self.kv.lock(), cx, layer)
    }

    fn hc_post(&self, cx: &mut StepCtx<'_>, _layer: usize, _sub: Sub) -> Result<()> {
        let c = &cx.model.config;
        let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
        let shape = Self::hc_shape(cx.model, n);
        let ctx = &self.ctx;
        let mut t = self.tick.lock();
        let t = &mut *t;
        let act = &mut t.act;
        let cur = act.cur;
        let xs = act.streams[cur].get(ctx, "streams", n * hc * d).clone();
        let out = act.streams[1 - cur].get(ctx, "streams", n * hc * d).clone();
        let f = act.sub_out.get(ctx, "sub out", n * d).clone();
        let state = act.state.get(ctx, "hc state", n * (hc + hc * hc)).clone();
        act.cur = 1 - cur;
        ops::hc_post(ctx, t.enc(ctx), &shape, &xs, (&f, 0, d), &state, &out)
    }

    fn moe(&self, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
        let model = cx.model;
        let c = &model.config;
        let lw = &model.layers[layer];
        let rows = &cx.batch.rows;
        let n = rows.len();
        let (d, ne, k, ffn) = (c.d_model, c.n_experts, c.n_experts_used, c.expert_ffn);
        let limit = c.swiglu_limit[layer];
        let ctx = &self.ctx;
        let mut t = self.tick.lock();
        let t = &mut *t;
        let u = t.act.collapsed.get(ctx, "collapsed", n * d).clone();
        let out = t.act.sub_out.get(ctx, "sub out", n * d).clone();
        let (xn, logits, sel, rw) = (ctx.scratch(n * d), ctx.scratch(n * ne), ctx.scratch(n * k), ctx.scratch(n * k));
        let gate = self.mat(model, lw.gate)?;
        let fnorm = self.dense(model, lw.ffn_norm);
        let enc = t.enc(ctx);
        ops::rms_norm(ctx, enc, (&u, 0, d), (&xn, 0, d), Some(&fnorm), d, n, c.rms_eps)?;
        self.mm(enc, &gate, View::new(&xn, d), n, View::new(&logits, ne))?;
        let zero_bias;
        let (tid, toks);
        let routing = match (&lw.tid2eid, lw.gate_bias) {
            (Some(tt), _) => {
                tid = ctx.storage_u32("tid2eid", tt);
                toks = ctx.storage_u32("tokens", &rows.iter().map(|r| r.token).collect::<Vec<_>>());
                Routing::Hash { tid2eid: &tid, tokens: &toks }
            }
            (None, Some(b)) => {
                zero_bias = self.dense(model, b);
                Routing::Learned { bias: &zero_bias }
            }
            (None, None) => {
                zero_bias = Arc::new(ctx.storage_zeroed("zero bias", ne));
                Routing::Learned { bias: &zero_bias }
            }
        };
        ops::moe_route(ctx, enc, &logits, routing, n, ne, k, c.routed_scale, c.weights_norm, &sel, &rw)?;
        let gm = self.mat_grouped(model, lw.gate_exps, ffn)?;
        let um = self.mat_grouped(model, lw.up_exps, ffn)?;
        let dm = self.mat_grouped(model, lw.down_exps, d)?;
        // Small batches with learned routing read the router's choice on the device (weights read once per
        // (row, slot), at most about once per expert); otherwise rows are grouped by expert on the host: hash
        // layers know the experts from the token ids, learned ones read them back (the layer's one readback).
        let on_device = lw.tid2eid.is_none() && n * k <= ne;
        let pr = if on_device { n * k } else { n };
        let (packed, gu, h, eo) =
            (ctx.scratch(n * d), ctx.scratch(pr * 2 * ffn), ctx.scratch(pr * ffn), ctx.scratch(pr * d));
        if on_device {
            let enc = t.enc(ctx);
            let np = n * k;
            let (xv, gv) = (View::new(&xn, d), View::new(&gu, 2 * ffn));
            moe_ids::matmul_ids(ctx, enc, &gm, ffn, &sel, np, xv, k, gv)?;
            moe_ids::matmul_ids(ctx, enc, &um, ffn, &sel, np, xv, k, gv.at(ffn))?;
            let wix: Vec<u32> = (0..np as u32).collect();
            ops::swiglu(ctx, enc, &gu, 2 * ffn, ffn, (&h, 0, ffn), ffn, np, limit, Some((&rw, &wix)))?;
            moe_ids::matmul_ids(ctx, enc, &dm, d, &sel, np, View::new(&h, ffn), 1, View::new(&eo, d))?;
            moe_ids::combine(ctx, enc, &eo, &sel, &out, d, n, k)?;
        } else {
            let sel_h = match &lw.tid2eid {
                Some(tt) => {
                    let mut v = Vec::with_capacity(n * k);
                    for r in rows {
                        let at = r.token as usize * k;
                        let ids = tt.get(at..at + k).ok_or_else(|| {
                            backend_err(format!("moe layer {layer}: token {} outside tid2eid", r.token))
                        })?;
                        v.extend_from_slice(ids);
                    }
                    v
                }
                None => ctx.submit_read_u32(t.take_enc(ctx), &sel, 0, n * k)?,
            };
            let mut per_expert: Vec<Vec<(u32, u32)>> = vec![Vec::new(); ne];
            for r in 0..n {
                for j in 0..k {
                    let e = sel_h[r * k + j] as usize;
                    if e >= ne {
                        return Err(backend_err(format!("moe layer {layer}: expert id {e} out of 0..{ne}")));
                    }
                    per_expert[e].push((r as u32, (r * k + j) as u32));
                }
            }
            let enc = t.enc(ctx);
            enc.clear_buffer(&out, 0, Some((n * d * 4) as u64));
            for (e, list) in per_expert.iter().enumerate() {
                if list.is_empty() {
                    continue;
                }
                let m = list.len();
                let rix: Vec<u32> = list.iter().map(|p| p.0).collect();
                let wix: Vec<u32> = list.iter().map(|p| p.1).collect();
                ops::gather_rows(ctx, enc, &xn, &packed, &rix, d, d)?;
                let xv = View::new(&packed, d);
                matmul(ctx, enc, &gm, e * ffn..(e + 1) * ffn, xv, m, View::new(&gu, 2 * ffn), false)?;
                matmul(ctx, enc, &um, e * ffn..(e + 1) * ffn, xv, m, View::new(&gu, 2 * ffn).at(ffn), false)?;
                ops::swiglu(ctx, enc, &gu, 2 * ffn, ffn, (&h, 0, ffn), ffn, m, limit, Some((&rw, &wix)))?;
                matmul(ctx, enc, &dm, e * d..(e + 1) * d, View::new(&h, ffn), m, View::new(&eo, d), false)?;
                ops::scatter_add_rows(ctx, enc, &eo, &out, &rix, d, d)?;
            }
        }
        let enc = t.enc(ctx);
        if let (Some(g), Some(up), Some(dn)) = (lw.gate_sh, lw.up_sh, lw.down_sh) {
            let (g, up, dn) = (self.mat(model, g)?, self.mat(model, up)?, self.mat(model, dn)?);
            let xv = View::new(&xn, d);
            self.mm(enc, &g, xv, n, View::new(&gu, 2 * ffn))?;
            self.mm(enc, &up, xv, n, View::new(&gu, 2 * ffn).at(ffn))?;
            ops::swiglu(ctx, enc, &gu, 2 * ffn, ffn, (&h, 0, ffn), ffn, n, limit, None)?;
            self.mm(enc, &dn, View::new(&h, ffn), n, View::new(&eo, d))?;
            let all: Vec<u32> = (0..n as u32).collect();
            ops::scatter_add_rows(ctx, enc, &eo, &out, &all, d, d)?;
        }
        Ok(())
    }

    fn hc_head(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        let model = cx.model;
        let c = &model.config;
        let g = &model.global;
        let (n, d) = (cx.batch.rows.len(), c.d_model);
        let mut t = self.tick.lock();
        self.hc_common(&mut t, cx, g.hc_fn, g.hc_base, g.hc_scale, true)?;
        let nw = self.dense(model, g.norm);
        let u = t.act.head_out.get(&self.ctx, "head out", n * d).clone();
        ops::rms_norm(&self.ctx, t.enc(&self.ctx), (&u, 0, d), (&u, 0, d), Some(&nw), d, n, c.rms_eps)
    }

    fn logits(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        let model = cx.model;
        let c = &model.config;
        let (n, d, v) = (cx.batch.rows.len(), c.d_model, c.vocab);
        let lr = &cx.batch.logit_rows;
        let ctx = &self.ctx;
        let mut t = self.tick.lock();
        let t = &mut *t;
        if lr.is_empty() {
            if t.pending() {
                ctx.submit(t.take_enc(ctx))?;
            }
            return Ok(());
        }
        let head = self.mat(model, model.global.head)?;
        let x = ctx.scratch(lr.len() * d);
        let h = t.act.head_out.get(ctx, "head out", n * d).clone();
        let out = t.act.logits.get(ctx, "logits", lr.len() * v).clone();
        let rows: Vec<u32> = lr.iter().map(|&r| r as u32).collect();
        let enc = t.enc(ctx);
        ops::gather_rows(ctx, enc, &h, &x, &rows, d, d)?;
        self.mm(enc, &head, View::new(&x, d), lr.len(), View::new(&out, v))?;
        // The tick's submission and its one readback.
        let got = ctx.submit_read_f32(t.take_enc(ctx), &out, 0, lr.len() * v)?;
        cx.act.logits[..lr.len() * v].copy_from_slice(&got);
        Ok(())
    }
}

/// What the attention stage uses of the backend.
impl StageResources for WgpuBackend {
    fn ctx(&self) -> &WgpuContext {
        &self.ctx
    }
    fn weight(&self, model: &Model, id: WeightId) -> Result<Arc<GpuWeight>> {
        self.mat(model, id)
    }
    fn dense_buf(&self, model: &Model, id: WeightId) -> Arc<Buf> {
        self.dense(model, id)
    }
    fn upload(&self, data: &[f32]) -> Buf {
        self.ctx.storage_f32("act", data)
    }
    fn matvec(&self, enc: &mut wgpu::CommandEncoder, w: &GpuWeight, x: View<'_>, n: usize, y: View<'_>) -> Result<()> {
        self.mm(enc, w, x, n, y)
    }
}
