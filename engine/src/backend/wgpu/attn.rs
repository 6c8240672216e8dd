//! The KV kernels of the wgpu backend — [`compress_push`], [`indexer_topk`], [`sparse_attention`], [`kv_store`]
//! (the nodes of [`crate::graph::Op`] of those names) — entirely on the device. Each works run by run on the
//! session state in the run's device mirror ([`super::kvdev`]), advanced without any readback:
//! - compressor (main and indexer), per run: the frontier (carried block + pending block) and the run's projected
//!   rows are copied into one scratch matrix (`ext`: rows `0..ratio` carried, `ratio..2·ratio` pending,
//!   then the run's rows with `ape` added by `kvdev.wgsl`), the completed windows are pooled from slot lists into
//!   that matrix (`compress.wgsl`, the CPU push's exact slot order), RMSNorm·norm, RoPE at the window's first
//!   position and the simulation are applied, and the rows are appended to the mirror; then the carried block
//!   (CSA) and the last writer of every pending slot are copied back into the frontier;
//! - the indexer scores its queries against the mirror's indexer rows into [`BufId::Selected`], and attention reads
//!   keys by tagged entry (batch row, ring slot, compressed row, or the indexer's j-th selection) with
//!   `attention.wgsl`'s `keyed` entry, so the selections never leave the device;
//! - the ring takes the last `window` raw rows of each run after attention.
//!
//! Every node that touches a run's mirror gives the session a fresh epoch ([`session`]), so the host copy is stale
//! from the first KV node of a tick on. Everything the host decides (slot lists, key lists, positions for RoPE) is a
//! function of the batch positions.

use super::backend::WgpuBackend;
use super::context::{backend_err, ScratchBuf, WgpuContext};
use super::kvdev::{self, copy_rows, DevKv, FrontDev, LayerDev, LayerPools, LogSources, SlotKv};
use super::ops::{self, key, ActSim, KeyLists, KeySources, Paged, PoolInput, RopeShape};
use super::pagedev::{PagePool, PageTable};
use super::resident::{rope_table, Tick};
use crate::backend::StepCtx;
use crate::graph::{BufId, Run};
use crate::model::{LayerKind, ModelConfig, RopeFreqs};
use crate::tables::SessionKv;
use crate::Result;

type Buf = wgpu::Buffer;
use super::context::Enc;

/// The mirror of `slot` for session state `kv`, uploading (copies recorded into `enc`) or taking over another
/// slot's mirror as needed (see [`super::kvdev`] on identity).
pub(super) fn mirror<'m>(
    be: &WgpuBackend,
    cfg: &ModelConfig,
    dk: &'m mut DevKv,
    enc: &mut Enc,
    slot: usize,
    kv: &SessionKv,
) -> Result<&'m mut SlotKv> {
    let ctx = be.context();
    let e = kv.sync.epoch;
    let here = e != 0 && dk.slots.get(&slot).is_some_and(|m| m.epoch == e);
    if !here {
        let m = if !kv.sync.host_stale {
            let pools = dk.pools(ctx, cfg)?;
            SlotKv::upload(ctx, enc, cfg, kv, be.rollback_tokens(), pools)?
        } else {
            let from = dk.slots.iter().find(|(_, m)| e != 0 && m.epoch == e).map(|(&s, _)| s);
            // A move, not a release: the pages go with the mirror.
            match from.and_then(|s| dk.slots.remove(&s)) {
                Some(m) => {
                    tracing::debug!(slot, "wgpu: session KV moved slots");
                    m
                }
                None => return Err(backend_err("device KV: the host copy is stale and the device copy is gone")),
            }
        };
        dk.insert(slot, m);
    }
    dk.slots.get_mut(&slot).ok_or_else(|| backend_err("device KV: mirror vanished"))
}

/// What a compressor applies to its pooled rows after RMSNorm and RoPE.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowSim {
    None,
    /// FP8 on the non-rope dims (main KV rows).
    Fp8 {
        rope_dim: usize,
    },
    /// Hadamard then FP4 (indexer rows).
    Fp4,
}

/// One compressor over one run (see module docs).
struct Compress<'a> {
    src_kv: &'a Buf,
    src_gate: &'a Buf,
    /// First batch row of the run, its first position, its length.
    start: usize,
    p0: usize,
    len: usize,
    ape: &'a Buf,
    norm: &'a Buf,
    eps: f32,
    rope: &'a RopeFreqs,
    rope_dim: usize,
    sim: RowSim,
}

impl Compress<'_> {
    /// Returns the bytes a copy on write of a shared page copied.
    fn run(
        &self,
        ctx: &WgpuContext,
        enc: &mut Enc,
        f: &FrontDev,
        out_rows: &mut PageTable,
        pool: &mut PagePool,
    ) -> Result<u64> {
        let (ratio, dim, coff) = (f.ratio, f.dim, f.coff);
        let (p0, len) = (self.p0, self.len);
        let w = coff * dim;
        if out_rows.rows != p0 / ratio || out_rows.width != dim {
            return Err(backend_err(format!(
                "device KV: {} compressed rows for position {p0} (ratio {ratio})",
                out_rows.rows
            )));
        }
        let (w0, w1) = (p0 / ratio, (p0 + len) / ratio);
        if w1 == w0 {
            // No block completes: the rows only join the pending block.
            let (src, front) = ((self.src_kv, self.src_gate), (&f.kv, &f.gate));
            kvdev::front_push(ctx, enc, src, self.start, len, w, self.ape, front, p0, ratio)?;
            return Ok(0);
        }
        let ext_rows = 2 * ratio + len;
        let (ek, eg) = (ctx.scratch(ext_rows * w), ctx.scratch(ext_rows * w));
        let (fb, rb) = ((2 * ratio * w * 4) as u64, (w * 4) as u64);
        for (front, src, ext) in [(&f.kv, self.src_kv, &ek), (&f.gate, self.src_gate, &eg)] {
            ctx.copy(enc, front, 0, ext, 0, fb);
            ctx.copy(enc, src, self.start as u64 * rb, ext, fb, len as u64 * rb);
        }
        kvdev::add_ape(ctx, enc, &eg, 2 * ratio * w, len, w, self.ape, p0, ratio)?;
        // ext row of position q: the run's rows, else the pending block, else the carried block.
        let row = |q: usize| -> usize {
            if q >= p0 {
                2 * ratio + q - p0
            } else if q / ratio == p0 / ratio {
                ratio + q % ratio
            } else {
                q % ratio
            }
        };
        let nw = w1 - w0;
        let spw = coff * ratio;
        let mut slots: Vec<PoolInput> = Vec::with_capacity(nw * spw);
        for win in w0..w1 {
            if coff == 2 {
                for s in 0..ratio {
                    slots.push((win >= 1).then(|| (row((win - 1) * ratio + s) as u32, 0, 0)));
                }
            }
            let off = if coff == 2 { dim as u32 } else { 0 };
            for s in 0..ratio {
                slots.push(Some((row(win * ratio + s) as u32, off, 0)));
            }
        }
        let zero_ape = ctx.storage_zeroed("zero ape", w);
        let out = ctx.scratch(nw * dim);
        ops::compress_pool(ctx, enc, &ek, &eg, w, &zero_ape, 0, &slots, spw, dim, (&out, 0, dim))?;
        ops::rms_norm(ctx, enc, (&out, 0, dim), (&out, 0, dim), Some(self.norm), dim, nw, self.eps)?;
        let cs = ctx.storage_f32("rope", &rope_table(self.rope, (w0..w1).map(|x| x * ratio)));
        let shape = RopeShape {
            n_tok: nw,
            heads: 1,
            head_dim: dim,
            rope_dim: self.rope_dim,
            offset: 0,
            tok_stride: dim,
            head_stride: dim,
        };
        ops::rope(ctx, enc, &out, &cs, shape, false)?;
        match self.sim {
            RowSim::None => {}
            RowSim::Fp8 { rope_dim } => ops::act_sim(ctx, enc, &out, ActSim::Fp8, nw, dim - rope_dim, dim, 64)?,
            RowSim::Fp4 => {
                ops::act_sim(ctx, enc, &out, ActSim::Hadamard, nw, dim, dim, 0)?;
                ops::act_sim(ctx, enc, &out, ActSim::Fp4, nw, dim, dim, 32)?;
            }
        }
        let copied = out_rows.append(ctx, enc, pool, &out, 0, nw)?;
        if coff == 2 {
            let b = w1 - 1;
            let pairs: Vec<(usize, usize)> = (0..ratio).map(|s| (row(b * ratio + s), s)).collect();
            copy_rows(ctx, enc, &ek, &f.kv, &pairs, w);
            copy_rows(ctx, enc, &eg, &f.gate, &pairs, w);
        }
        // Pending slots: the last position of the run that maps to each slot (as the host push leaves them).
        let first = p0.max((p0 + len).saturating_sub(ratio));
        let pairs: Vec<(usize, usize)> = (first..p0 + len).map(|q| (2 * ratio + q - p0, ratio + q % ratio)).collect();
        copy_rows(ctx, enc, &ek, &f.kv, &pairs, w);
        copy_rows(ctx, enc, &eg, &f.gate, &pairs, w);
        Ok(copied)
    }
}

/// The mirror of run `ri` of the batch (see [`mirror`]), its session stamped with a fresh epoch.
fn session<'m>(
    be: &WgpuBackend,
    dk: &'m mut DevKv,
    enc: &mut Enc,
    cx: &mut StepCtx<'_>,
    ri: usize,
) -> Result<&'m mut SlotKv> {
    if cx.kv.len() != cx.batch.runs.len() {
        return Err(backend_err(format!("attention: {} KV states for {} runs", cx.kv.len(), cx.batch.runs.len())));
    }
    let m = mirror(be, &cx.model.config, dk, enc, cx.batch.runs[ri].slot, &cx.kv[ri])?;
    m.stamp(&mut cx.kv[ri].sync);
    Ok(m)
}

/// Runs `f(run, its first position, the layer's state in its session's mirror, the layer's page pools, enc)` for
/// every non-empty run of the batch, in order (each session stamped with a fresh epoch, see [`session`]); the
/// bytes `f` returns (copy on write of shared pages) count in the session's [`crate::tables::PageLedger`].
fn for_each_run(
    be: &WgpuBackend,
    dk: &mut DevKv,
    enc: &mut Enc,
    cx: &mut StepCtx<'_>,
    layer: usize,
    mut f: impl FnMut(Run, usize, &mut LayerDev, &mut LayerPools, &mut Enc) -> Result<u64>,
) -> Result<()> {
    let batch = cx.batch;
    for (ri, &run) in batch.runs.iter().enumerate() {
        if run.len == 0 {
            continue;
        }
        session(be, dk, enc, cx, ri)?;
        let DevKv { slots, pools } = &mut *dk;
        let no_layer = || backend_err(format!("device KV: no layer {layer}"));
        let ld = slots.get_mut(&run.slot).and_then(|m| m.layers.get_mut(layer)).ok_or_else(no_layer)?;
        let lp = pools.get_mut(layer).ok_or_else(no_layer)?;
        let copied = f(run, batch.rows[run.start].pos, ld, lp, enc)?;
        if copied > 0 {
            cx.kv[ri].pool.add_copied(copied);
        }
    }
    Ok(())
}

/// A scratch copy of rows `start..start + len` of `src` (`width` values each), for kernels that index a run's
/// rows from 0.
fn run_rows(ctx: &WgpuContext, enc: &mut Enc, src: &Buf, start: usize, len: usize, width: usize) -> ScratchBuf {
    let out = ctx.scratch(len * width);
    ctx.copy(enc, src, (start * width * 4) as u64, &out, 0, (len * width * 4) as u64);
    out
}

/// [`crate::graph::Op::CompressPush`]: each run's projected rows through the layer's compressor (`indexer`: the
/// indexer's) into its session's compressed (indexer) rows.
pub fn compress_push(
    be: &WgpuBackend,
    t: &mut Tick,
    dk: &mut DevKv,
    cx: &mut StepCtx<'_>,
    layer: usize,
    indexer: bool,
    sim: bool,
) -> Result<()> {
    let ctx = be.context();
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let comp = match (indexer, &lw.compressor, &lw.indexer) {
        (false, Some(cw), _) => cw,
        (true, _, Some(iw)) => &iw.comp,
        _ => return Err(backend_err(format!("compress push: layer {layer} has no such compressor"))),
    };
    let (kv_id, gate_id) = if indexer { (BufId::IdxKv, BufId::IdxGate) } else { (BufId::CompKv, BufId::CompGate) };
    let (src_kv, src_gate) = (be.buf(t, model, kv_id)?, be.buf(t, model, gate_id)?);
    let (ape, norm) = (be.dense(model, comp.ape), be.dense(model, comp.norm));
    let rope = cx.rope.for_layer(model, layer);
    let row_sim = match (sim, indexer) {
        (false, _) => RowSim::None,
        (true, false) => RowSim::Fp8 { rope_dim: c.rope_dim },
        (true, true) => RowSim::Fp4,
    };
    let enc = t.enc(ctx);
    for_each_run(be, dk, enc, cx, layer, |run, p0, ld, lp, enc| {
        let (f, rows, pool) = if indexer {
            (&ld.fidx, ld.idx.as_mut(), lp.idx.as_mut())
        } else {
            (&ld.fcomp, ld.comp.as_mut(), lp.comp.as_mut())
        };
        let (Some(f), Some(out_rows), Some(pool)) = (f, rows, pool) else {
            return Err(backend_err(format!("device KV: layer {layer} has no compressor state")));
        };
        let job = Compress {
            src_kv: &src_kv,
            src_gate: &src_gate,
            start: run.start,
            p0,
            len: run.len,
            ape: &ape,
            norm: &norm,
            eps: c.rms_eps,
            rope,
            rope_dim: c.rope_dim,
            sim: row_sim,
        };
        job.run(ctx, enc, f, out_rows, pool)
    })
}

/// [`crate::graph::Op::IndexerTopK`]: per run, the indexer scores of its queries against the session's indexer
/// rows (this tick's included) and their top-k into the run's rows of `Selected`. `w_scale` multiplies the head
/// weights as they are read: the [`crate::graph::Op::Scale`] of them fused in ([`super::fuse`]; 1 when it ran).
pub fn indexer_topk(
    be: &WgpuBackend,
    t: &mut Tick,
    dk: &mut DevKv,
    cx: &mut StepCtx<'_>,
    layer: usize,
    w_scale: f32,
) -> Result<()> {
    let ctx = be.context();
    let model = cx.model;
    let c = &model.config;
    let (ih, ihd, ratio) = (c.idx_heads, c.idx_head_dim, c.compress_ratios[layer]);
    let topk = c.idx_topk.max(1);
    let (iq, iw, selected) =
        (be.buf(t, model, BufId::IdxQ)?, be.buf(t, model, BufId::IdxW)?, be.buf(t, model, BufId::Selected)?);
    if ratio == 0 {
        return Err(backend_err(format!("indexer: layer {layer} does not compress")));
    }
    let enc = t.enc(ctx);
    for_each_run(be, dk, enc, cx, layer, |run, p0, ld, lp, enc| {
        let (start, len) = (run.start, run.len);
        let (idx_rows, pool) = ld
            .idx
            .as_ref()
            .zip(lp.idx.as_ref())
            .ok_or_else(|| backend_err(format!("device KV: layer {layer} has no indexer")))?;
        let n_keys = idx_rows.rows;
        let limit: Vec<u32> =
            (p0..p0 + len).map(|pos| crate::graph::visibility::compressed(pos, ratio).min(n_keys) as u32).collect();
        let sc = ctx.scratch(len * n_keys.max(1));
        // The head weights carry 1/sqrt(heads) (the recipe's Scale node, or `w_scale`).
        let scale = 1.0 / (ihd as f32).sqrt();
        let keys = Paged { rows: &pool.buf, table: &idx_rows.buf, shift: pool.shift };
        // The run's rows of the queries, weights and selection in place (from batch row `start`).
        ops::indexer_topk(
            ctx,
            enc,
            &iq,
            &keys,
            &iw,
            start,
            &limit,
            n_keys,
            ih,
            ihd,
            topk,
            (w_scale, scale),
            &sc,
            &selected,
        )?;
        Ok(0)
    })
}

/// [`crate::graph::Op::SparseAttention`]: per run, each row's window (batch rows and ring) plus its compressed
/// rows (HCA: all visible; CSA: its selections), with sinks, into `AttnOut`.
///
/// With `inverse_rope`, the [`crate::graph::Op::Rope`] (inverse) of `AttnOut` that follows it runs in the same
/// dispatch ([`super::fuse`]).
pub fn sparse_attention(
    be: &WgpuBackend,
    t: &mut Tick,
    dk: &mut DevKv,
    cx: &mut StepCtx<'_>,
    layer: usize,
    inverse_rope: bool,
) -> Result<()> {
    let ctx = be.context();
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let (hd, nh, window) = (c.head_dim, c.n_heads, c.window);
    let kind = c.layer_kind(layer);
    let ratio = c.compress_ratios[layer];
    let topk = c.idx_topk.max(1);
    let (q, kv, attn) =
        (be.buf(t, model, BufId::Q)?, be.buf(t, model, BufId::KvRows)?, be.buf(t, model, BufId::AttnOut)?);
    let selected = if kind == LayerKind::Csa { Some(be.buf(t, model, BufId::Selected)?) } else { None };
    let sinks = be.dense(model, lw.sinks);
    // No compressed rows: `comp` (binding 9) is read-only, so the context's zeros serve.
    let (no_comp, unpaged) = (ctx.zeros().clone(), ops::unpaged_table(ctx));
    let no_sel = ctx.storage_u32("no selections", &[u32::MAX]);
    let cs = inverse_rope.then(|| t.rope(ctx, cx, layer));
    let rope_dim = c.rope_dim;
    let enc = t.enc(ctx);
    let batch = cx.batch;
    let rows = &batch.rows;
    for_each_run(be, dk, enc, cx, layer, |run, p0, ld, lp, enc| {
        let (start, len) = (run.start, run.len);
        let mut keys = KeyLists { rows: Vec::new(), ranges: Vec::with_capacity(len) };
        let n_comp = ld.comp.as_ref().map_or(0, |r| r.rows);
        if n_comp.max(start + len).max(window) > key::MAX_INDEX as usize {
            return Err(backend_err(format!("attention: {n_comp} compressed rows exceed the key index range")));
        }
        for row in &rows[start..start + len] {
            let tpos = row.pos;
            let k0 = keys.rows.len() as u32;
            for p in crate::graph::visibility::window(tpos, window) {
                keys.rows.push(if p >= p0 {
                    key::BATCH | (start + p - p0) as u32
                } else {
                    key::RING | (p % window) as u32
                });
            }
            match kind {
                LayerKind::Window => {}
                LayerKind::Hca => keys.rows.extend(
                    (0..crate::graph::visibility::compressed(tpos, ratio).min(n_comp)).map(|w| key::COMP | w as u32),
                ),
                LayerKind::Csa => keys.rows.extend((0..topk).map(|i| key::SEL | i as u32)),
            }
            keys.ranges.push((k0, keys.rows.len() as u32 - k0));
        }
        // The keyed entry indexes selections by the run's own rows: bind the run's slice of `Selected`.
        let run_sel;
        let sel: &wgpu::Buffer = match &selected {
            Some(s) if start == 0 => s,
            Some(s) => {
                run_sel = run_rows(ctx, enc, s, start, len, topk);
                &run_sel
            }
            None => &no_sel,
        };
        let comp = match (ld.comp.as_ref(), lp.comp.as_ref()) {
            (Some(t), Some(pool)) => Paged { rows: &pool.buf, table: &t.buf, shift: pool.shift },
            _ => Paged { rows: &no_comp, table: &unpaged, shift: ops::UNPAGED_SHIFT },
        };
        let src = KeySources { batch: &kv, ring: &ld.ring, comp, sel, topk };
        let scale = 1.0 / (hd as f32).sqrt();
        let (qv, ov) = ((&q, start * nh * hd, nh * hd), (&attn, start * nh * hd, nh * hd));
        let rope = cs.as_ref().map(|cs| (cs, rope_dim, start));
        ops::attention_keyed(ctx, enc, qv, &src, &keys, &sinks, ov, nh, hd, scale, rope)?;
        Ok(0)
    })
}

/// [`crate::graph::Op::WindowStore`]: the last `window` raw rows of each run into its session's ring.
pub fn kv_store(be: &WgpuBackend, t: &mut Tick, dk: &mut DevKv, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
    let ctx = be.context();
    let model = cx.model;
    let (hd, window) = (model.config.head_dim, model.config.window);
    let kv = be.buf(t, model, BufId::KvRows)?;
    // The roll-back log's inputs, where the backend keeps a log and the layer has them.
    let logged = be.rollback_tokens() > 0;
    let lw = &model.layers[layer];
    let pair =
        |t: &mut Tick, a: BufId, b: BufId| -> Result<(Buf, Buf)> { Ok((be.buf(t, model, a)?, be.buf(t, model, b)?)) };
    let comp = if logged && lw.compressor.is_some() { Some(pair(t, BufId::CompKv, BufId::CompGate)?) } else { None };
    let idx = if logged && lw.indexer.is_some() { Some(pair(t, BufId::IdxKv, BufId::IdxGate)?) } else { None };
    let src = LogSources { raw: &kv, comp: comp.as_ref().map(|(a, b)| (a, b)), idx: idx.as_ref().map(|(a, b)| (a, b)) };
    let enc = t.enc(ctx);
    for_each_run(be, dk, enc, cx, layer, |run, p0, ld, lp, enc| {
        let (start, len) = (run.start, run.len);
        let pairs: Vec<(usize, usize)> =
            (len.saturating_sub(window)..len).map(|j| (start + j, (p0 + j) % window)).collect();
        copy_rows(ctx, enc, &kv, &ld.ring, &pairs, hd);
        let mut copied = 0;
        if let Some(log) = ld.log.as_mut() {
            let pools = lp.log.as_mut().ok_or_else(|| backend_err("device KV: a roll-back log without its pools"))?;
            copied = log.record(ctx, enc, pools, &src, start, p0, len)?;
        }
        ld.pos = Some(p0 + len);
        Ok(copied)
    })
}
