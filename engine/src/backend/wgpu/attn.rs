//! The attention stage of the wgpu backend for one layer (same order and semantics as the recipe,
//! [`crate::model::recipe`], whose module docs give the equations), entirely on the device.
//!
//! Every projection, norm, RoPE and activation simulation runs as before; the session state lives in the
//! slot's device mirror ([`super::kvdev`]) and is advanced without any readback:
//! - compressor (main and indexer), per run: the frontier (carried block + pending block) and the run's projected
//!   rows are copied into one scratch matrix (`ext`: rows `0..ratio` carried, `ratio..2·ratio` pending,
//!   then the run's rows with `ape` added by `kvdev.wgsl`), the completed windows are pooled from slot lists into
//!   that matrix (`compress.wgsl`, the CPU push's exact slot order), RMSNorm·norm, RoPE at the window's first
//!   position and the simulation are applied, and the rows are appended to the mirror; then the carried block
//!   (CSA) and the last writer of every pending slot are copied back into the frontier;
//! - the indexer scores its queries against the mirror's indexer rows, and attention reads keys by tagged entry
//!   (batch row, ring slot, compressed row, or the indexer's j-th selection) with `attention.wgsl`'s `keyed` entry,
//!   so the selections never leave the device;
//! - the ring takes the last `window` raw rows of each run after attention.
//!
//! Everything the host decides (slot lists, key lists, positions for RoPE) is a function of the batch positions.

use std::collections::HashMap;

use super::context::{backend_err, WgpuContext};
use super::kvdev::{copy_rows, FrontDev, Rows, SlotKv};
use super::matmul::{matmul, View};
use super::ops::{self, key, ActSim, KeyLists, KeySources, RopeShape, Slot};
use super::res::{rope_table, StageResources};
use super::resident::Tick;
use crate::backend::StepCtx;
use crate::model::{LayerKind, ModelConfig, RopeFreqs};
use crate::tables::SessionKv;
use crate::Result;

type Buf = wgpu::Buffer;
type Enc = wgpu::CommandEncoder;

/// The mirror of `slot` for session state `kv`, uploading or taking over another slot's mirror as needed (see
/// [`super::kvdev`] on identity).
pub(super) fn mirror<'m>(
    ctx: &WgpuContext,
    cfg: &ModelConfig,
    kvs: &'m mut HashMap<usize, SlotKv>,
    slot: usize,
    kv: &SessionKv,
) -> Result<&'m mut SlotKv> {
    let e = kv.sync.epoch;
    let here = e != 0 && kvs.get(&slot).is_some_and(|m| m.epoch == e);
    if !here {
        let m = if !kv.sync.host_stale {
            SlotKv::upload(ctx, cfg, kv)?
        } else {
            let from = kvs.iter().find(|(_, m)| e != 0 && m.epoch == e).map(|(&s, _)| s);
            match from.and_then(|s| kvs.remove(&s)) {
                Some(m) => {
                    tracing::debug!(slot, "wgpu: session KV moved slots");
                    m
                }
                None => return Err(backend_err("device KV: the host copy is stale and the device copy is gone")),
            }
        };
        kvs.insert(slot, m);
    }
    kvs.get_mut(&slot).ok_or_else(|| backend_err("device KV: mirror vanished"))
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
    fn run(&self, ctx: &WgpuContext, enc: &mut Enc, f: &FrontDev, out_rows: &mut Rows) -> Result<()> {
        let (ratio, dim, coff) = (f.ratio, f.dim, f.coff);
        let (p0, len) = (self.p0, self.len);
        let w = coff * dim;
        if out_rows.rows != p0 / ratio || out_rows.width != dim {
            return Err(backend_err(format!(
                "device KV: {} compressed rows for position {p0} (ratio {ratio})",
                out_rows.rows
            )));
        }
        let ext_rows = 2 * ratio + len;
        let (ek, eg) = (ctx.scratch(ext_rows * w), ctx.scratch(ext_rows * w));
        let (fb, rb) = ((2 * ratio * w * 4) as u64, (w * 4) as u64);
        for (front, src, ext) in [(&f.kv, self.src_kv, &ek), (&f.gate, self.src_gate, &eg)] {
            enc.copy_buffer_to_buffer(front, 0, ext, 0, fb);
            enc.copy_buffer_to_buffer(src, self.start as u64 * rb, ext, fb, len as u64 * rb);
        }
        ops::add_ape(ctx, enc, &eg, 2 * ratio * w, len, w, self.ape, p0, ratio)?;
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
        let (w0, w1) = (p0 / ratio, (p0 + len) / ratio);
        if w1 > w0 {
            let nw = w1 - w0;
            let spw = coff * ratio;
            let mut slots: Vec<Slot> = Vec::with_capacity(nw * spw);
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
            out_rows.reserve(ctx, enc, nw)?;
            let at = (out_rows.rows * dim * 4) as u64;
            enc.copy_buffer_to_buffer(&out, 0, &out_rows.buf, at, (nw * dim * 4) as u64);
            out_rows.rows += nw;
            if coff == 2 {
                let b = w1 - 1;
                let pairs: Vec<(usize, usize)> = (0..ratio).map(|s| (row(b * ratio + s), s)).collect();
                copy_rows(enc, &ek, &f.kv, &pairs, w);
                copy_rows(enc, &eg, &f.gate, &pairs, w);
            }
        }
        // Pending slots: the last position of the run that maps to each slot (as the host push leaves them).
        let first = p0.max((p0 + len).saturating_sub(ratio));
        let pairs: Vec<(usize, usize)> = (first..p0 + len).map(|q| (2 * ratio + q - p0, ratio + q % ratio)).collect();
        copy_rows(enc, &ek, &f.kv, &pairs, w);
        copy_rows(enc, &eg, &f.gate, &pairs, w);
        Ok(())
    }
}

/// Records the [`crate::graph::Stage::Attention`] of `layer` on the device.
pub fn attention(
    be: &impl StageResources,
    t: &mut Tick,
    kvs: &mut HashMap<usize, SlotKv>,
    cx: &mut StepCtx<'_>,
    layer: usize,
) -> Result<()> {
    let ctx = be.ctx();
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let batch = cx.batch;
    let rows = &batch.rows;
    let n = rows.len();
    if n == 0 {
        return Ok(());
    }
    let (d, hd, nh, rd, ql) = (c.d_model, c.head_dim, c.n_heads, c.rope_dim, c.q_lora_rank);
    let (ih, ihd) = (c.idx_heads, c.idx_head_dim);
    let eps = c.rms_eps;
    let rope = cx.rope.for_layer(model, layer);
    let kind = c.layer_kind(layer);
    let ratio = c.compress_ratios[layer];
    let sim_on = cx.sim;
    let coff = if kind == LayerKind::Csa { 2 } else { 1 };

    let cs = be.upload(&rope_table(rope, rows.iter().map(|r| r.pos)));
    let u = t.act.collapsed.get(ctx, "collapsed", n * d).clone();
    let out = t.act.sub_out.get(ctx, "sub out", n * d).clone();
    let (xn, qr, q, kv) = (ctx.scratch(n * d), ctx.scratch(n * ql), ctx.scratch(n * nh * hd), ctx.scratch(n * hd));
    let enc = t.enc(ctx);
    let an = be.dense_buf(model, lw.attn_norm);
    ops::rms_norm(ctx, enc, (&u, 0, d), (&xn, 0, d), Some(&an), d, n, eps)?;
    be.matvec(enc, &*be.weight(model, lw.wq_a)?, View::new(&xn, d), n, View::new(&qr, ql))?;
    let qn = be.dense_buf(model, lw.q_norm);
    ops::rms_norm(ctx, enc, (&qr, 0, ql), (&qr, 0, ql), Some(&qn), ql, n, eps)?;
    be.matvec(enc, &*be.weight(model, lw.wq_b)?, View::new(&qr, ql), n, View::new(&q, nh * hd))?;
    ops::rms_norm(ctx, enc, (&q, 0, hd), (&q, 0, hd), None, hd, n * nh, eps)?;
    let qshape =
        RopeShape { n_tok: n, heads: nh, head_dim: hd, rope_dim: rd, offset: 0, tok_stride: nh * hd, head_stride: hd };
    ops::rope(ctx, enc, &q, &cs, qshape, false)?;
    be.matvec(enc, &*be.weight(model, lw.wkv)?, View::new(&xn, d), n, View::new(&kv, hd))?;
    let kn = be.dense_buf(model, lw.kv_norm);
    ops::rms_norm(ctx, enc, (&kv, 0, hd), (&kv, 0, hd), Some(&kn), hd, n, eps)?;
    ops::rope(ctx, enc, &kv, &cs, RopeShape { heads: 1, tok_stride: hd, ..qshape }, false)?;
    if sim_on {
        ops::act_sim(ctx, enc, &kv, ActSim::Fp8, n, hd - rd, hd, 64)?;
    }
    let comp_bufs = match &lw.compressor {
        Some(cw) => {
            let (ckv, cg) = (ctx.scratch(n * coff * hd), ctx.scratch(n * coff * hd));
            be.matvec(enc, &*be.weight(model, cw.wkv)?, View::new(&xn, d), n, View::new(&ckv, coff * hd))?;
            be.matvec(enc, &*be.weight(model, cw.wgate)?, View::new(&xn, d), n, View::new(&cg, coff * hd))?;
            Some((ckv, cg, be.dense_buf(model, cw.ape), be.dense_buf(model, cw.norm)))
        }
        None => None,
    };
    let idx_bufs = match &lw.indexer {
        Some(iw) => {
            let (ikv, ig) = (ctx.scratch(n * 2 * ihd), ctx.scratch(n * 2 * ihd));
            let (iq, iwb) = (ctx.scratch(n * ih * ihd), ctx.scratch(n * ih));
            be.matvec(enc, &*be.weight(model, iw.comp.wkv)?, View::new(&xn, d), n, View::new(&ikv, 2 * ihd))?;
            be.matvec(enc, &*be.weight(model, iw.comp.wgate)?, View::new(&xn, d), n, View::new(&ig, 2 * ihd))?;
            be.matvec(enc, &*be.weight(model, iw.wq_b)?, View::new(&qr, ql), n, View::new(&iq, ih * ihd))?;
            let ishape = RopeShape { heads: ih, head_dim: ihd, tok_stride: ih * ihd, head_stride: ihd, ..qshape };
            ops::rope(ctx, enc, &iq, &cs, ishape, false)?;
            if sim_on {
                ops::act_sim(ctx, enc, &iq, ActSim::Hadamard, n * ih, ihd, ihd, 0)?;
                ops::act_sim(ctx, enc, &iq, ActSim::Fp4, n * ih, ihd, ihd, 32)?;
            }
            be.matvec(enc, &*be.weight(model, iw.proj)?, View::new(&xn, d), n, View::new(&iwb, ih))?;
            let comp = &iw.comp;
            Some((ikv, ig, iq, iwb, be.dense_buf(model, comp.ape), be.dense_buf(model, comp.norm)))
        }
        None => None,
    };

    let attn = ctx.scratch(n * nh * hd);
    let sinks = be.dense_buf(model, lw.sinks);
    let topk = c.idx_topk.max(1);
    let window = c.window;
    let no_comp = ctx.storage_zeroed("no comp rows", 1);
    let no_sel = ctx.storage_u32("no selections", &[u32::MAX]);
    if cx.kv.len() != batch.runs.len() {
        return Err(backend_err(format!("attention: {} KV states for {} runs", cx.kv.len(), batch.runs.len())));
    }
    for (ri, run) in batch.runs.iter().enumerate() {
        if run.len == 0 {
            continue;
        }
        let m = mirror(ctx, c, kvs, run.slot, &cx.kv[ri])?;
        let ld = &mut m.layers[layer];
        let p0 = rows[run.start].pos;
        let (start, len) = (run.start, run.len);
        if let (Some((ckv, cg, ape, norm)), Some(f), Some(out_rows)) = (&comp_bufs, &ld.fcomp, ld.comp.as_mut()) {
            let sim = if sim_on { RowSim::Fp8 { rope_dim: rd } } else { RowSim::None };
            let job = Compress { src_kv: ckv, src_gate: cg, start, p0, len, ape, norm, eps, rope, rope_dim: rd, sim };
            job.run(ctx, enc, f, out_rows)?;
        }
        let mut sel = None;
        if let (Some((ikv, ig, iq, iwb, ape, norm)), Some(f), Some(idx_rows)) = (&idx_bufs, &ld.fidx, ld.idx.as_mut()) {
            let sim = if sim_on { RowSim::Fp4 } else { RowSim::None };
            let job = Compress { src_kv: ikv, src_gate: ig, start, p0, len, ape, norm, eps, rope, rope_dim: rd, sim };
            job.run(ctx, enc, f, idx_rows)?;
            // Indexer top-k of this run against the session's indexer rows (this tick's included).
            let n_keys = idx_rows.rows;
            let limit: Vec<u32> =
                (start..start + len).map(|r| ((rows[r].pos + 1) / ratio).min(n_keys) as u32).collect();
            let (qrun, wrun) = (ctx.scratch(len * ih * ihd), ctx.scratch(len * ih));
            let f4 = 4u64;
            enc.copy_buffer_to_buffer(iq, (start * ih * ihd) as u64 * f4, &qrun, 0, (len * ih * ihd) as u64 * f4);
            enc.copy_buffer_to_buffer(iwb, (start * ih) as u64 * f4, &wrun, 0, (len * ih) as u64 * f4);
            let (sc, s) = (ctx.scratch(len * n_keys.max(1)), ctx.scratch(len * topk));
            let scale = 1.0 / ((ihd as f32).sqrt() * (ih as f32).sqrt());
            let keys = &idx_rows.buf;
            ops::indexer_topk(ctx, enc, &qrun, keys, &wrun, &limit, n_keys, ih, ihd, topk, scale, &sc, &s)?;
            sel = Some(s);
        }

        // Key lists of this run's rows (local token index), attention on the device.
        let mut keys = KeyLists { rows: Vec::new(), ranges: Vec::with_capacity(len) };
        let n_comp = ld.comp.as_ref().map_or(0, |r| r.rows);
        if n_comp.max(start + len).max(window) > key::MAX_INDEX as usize {
            return Err(backend_err(format!("attention: {n_comp} compressed rows exceed the key index range")));
        }
        for (j, row) in rows[start..start + len].iter().enumerate() {
            let tpos = row.pos;
            let k0 = keys.rows.len() as u32;
            for p in (tpos + 1).saturating_sub(window)..=tpos {
                keys.rows.push(if p >= p0 {
                    key::BATCH | (start + p - p0) as u32
                } else {
                    key::RING | (p % window) as u32
                });
            }
            match kind {
                LayerKind::Window => {}
                LayerKind::Hca => keys.rows.extend((0..((tpos + 1) / ratio).min(n_comp)).map(|w| key::COMP | w as u32)),
                LayerKind::Csa => keys.rows.extend((0..topk).map(|i| key::SEL | i as u32)),
            }
            debug_assert_eq!(j, keys.ranges.len());
            keys.ranges.push((k0, keys.rows.len() as u32 - k0));
        }
        let src = KeySources {
            batch: &kv,
            ring: &ld.ring,
            comp: ld.comp.as_ref().map_or(&no_comp, |r| &r.buf),
            sel: sel.as_deref().unwrap_or(&no_sel),
            topk,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let (qv, ov) = ((&*q, start * nh * hd, nh * hd), (&*attn, start * nh * hd, nh * hd));
        ops::attention_keyed(ctx, enc, qv, &src, &keys, &sinks, ov, nh, hd, scale)?;

        // Ring update: the last `window` rows of the run.
        let pairs: Vec<(usize, usize)> =
            (len.saturating_sub(window)..len).map(|j| (start + j, (p0 + j) % window)).collect();
        copy_rows(enc, &kv, &ld.ring, &pairs, hd);
        ld.pos = Some(p0 + len);
        m.stamp(&mut cx.kv[ri].sync);
    }

    ops::rope(ctx, enc, &attn, &cs, qshape, true)?;
    let (g, rank) = (c.o_groups, c.o_lora_rank);
    let gs = nh * hd / g;
    let oa = ctx.scratch(n * g * rank);
    let wo_a = be.weight(model, lw.wo_a)?;
    for gi in 0..g {
        let x = View { buf: &attn, offset: gi * gs, stride: nh * hd };
        let y = View { buf: &oa, offset: gi * rank, stride: g * rank };
        matmul(ctx, enc, &wo_a, gi * rank..(gi + 1) * rank, x, n, y, false)?;
    }
    be.matvec(enc, &*be.weight(model, lw.wo_b)?, View::new(&oa, g * rank), n, View::new(&out, d))?;
    Ok(())
}
