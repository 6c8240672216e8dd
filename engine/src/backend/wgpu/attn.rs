//! The attention op of [`WgpuBackend`] for one layer (same order and semantics as the CPU backend's
//! `backend::cpu::attention`, whose module docs give the equations).
//!
//! Device: every projection, the norms, RoPE, activation simulation, indexer scores + top-k, attention with
//! sinks, inverse RoPE and the grouped output projection. Host: compressor frontiers (one token at a time, with
//! RMSNorm · norm and RoPE of each finished row), key-list construction and the sliding-window ring update.
//! Keys are uploaded per call as one matrix: this batch's raw rows, then per run its ring and compressed rows.

use super::backend::{rope_table, WgpuBackend};
use super::matmul::{matmul, View};
use super::ops::{self, ActSim, KeyLists, RopeShape};
use super::resident::Tick;
use crate::backend::cpu::compressor;
use crate::backend::cpu::norm::rms_norm_inplace;
use crate::backend::StepCtx;
use crate::model::{sim, LayerKind};
use crate::Result;

/// Runs [`crate::graph::Op::Attention`] for `layer` on the device.
pub fn attention(be: &WgpuBackend, t: &mut Tick, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
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
    let (xn, qr, q, kv) = (ctx.scratch(n * d), ctx.scratch(n * ql), ctx.scratch(n * nh * hd), ctx.scratch(n * hd));
    let mut enc = t.take_enc(ctx);
    let an = be.dense_buf(model, lw.attn_norm);
    ops::rms_norm(ctx, &mut enc, (&u, 0, d), (&xn, 0, d), Some(&an), d, n, eps)?;
    be.matvec(&mut enc, &*be.weight(model, lw.wq_a)?, View::new(&xn, d), n, View::new(&qr, ql))?;
    let qn = be.dense_buf(model, lw.q_norm);
    ops::rms_norm(ctx, &mut enc, (&qr, 0, ql), (&qr, 0, ql), Some(&qn), ql, n, eps)?;
    be.matvec(&mut enc, &*be.weight(model, lw.wq_b)?, View::new(&qr, ql), n, View::new(&q, nh * hd))?;
    ops::rms_norm(ctx, &mut enc, (&q, 0, hd), (&q, 0, hd), None, hd, n * nh, eps)?;
    let qshape =
        RopeShape { n_tok: n, heads: nh, head_dim: hd, rope_dim: rd, offset: 0, tok_stride: nh * hd, head_stride: hd };
    ops::rope(ctx, &mut enc, &q, &cs, qshape, false)?;
    be.matvec(&mut enc, &*be.weight(model, lw.wkv)?, View::new(&xn, d), n, View::new(&kv, hd))?;
    let kn = be.dense_buf(model, lw.kv_norm);
    ops::rms_norm(ctx, &mut enc, (&kv, 0, hd), (&kv, 0, hd), Some(&kn), hd, n, eps)?;
    ops::rope(ctx, &mut enc, &kv, &cs, RopeShape { heads: 1, tok_stride: hd, ..qshape }, false)?;
    if sim_on {
        ops::act_sim(ctx, &mut enc, &kv, ActSim::Fp8, n, hd - rd, hd, 64)?;
    }
    let comp_bufs = match &lw.compressor {
        Some(cw) => {
            let (ckv, cg) = (ctx.scratch(n * coff * hd), ctx.scratch(n * coff * hd));
            be.matvec(&mut enc, &*be.weight(model, cw.wkv)?, View::new(&xn, d), n, View::new(&ckv, coff * hd))?;
            be.matvec(&mut enc, &*be.weight(model, cw.wgate)?, View::new(&xn, d), n, View::new(&cg, coff * hd))?;
            Some((ckv, cg))
        }
        None => None,
    };
    let idx_bufs = match &lw.indexer {
        Some(iw) => {
            let (ikv, ig) = (ctx.scratch(n * 2 * ihd), ctx.scratch(n * 2 * ihd));
            let (iq, iwb) = (ctx.scratch(n * ih * ihd), ctx.scratch(n * ih));
            be.matvec(&mut enc, &*be.weight(model, iw.comp.wkv)?, View::new(&xn, d), n, View::new(&ikv, 2 * ihd))?;
            be.matvec(&mut enc, &*be.weight(model, iw.comp.wgate)?, View::new(&xn, d), n, View::new(&ig, 2 * ihd))?;
            be.matvec(&mut enc, &*be.weight(model, iw.wq_b)?, View::new(&qr, ql), n, View::new(&iq, ih * ihd))?;
            let ishape = RopeShape { heads: ih, head_dim: ihd, tok_stride: ih * ihd, head_stride: ihd, ..qshape };
            ops::rope(ctx, &mut enc, &iq, &cs, ishape, false)?;
            if sim_on {
                ops::act_sim(ctx, &mut enc, &iq, ActSim::Hadamard, n * ih, ihd, ihd, 0)?;
                ops::act_sim(ctx, &mut enc, &iq, ActSim::Fp4, n * ih, ihd, ihd, 32)?;
            }
            be.matvec(&mut enc, &*be.weight(model, iw.proj)?, View::new(&xn, d), n, View::new(&iwb, ih))?;
            Some((ikv, ig, iq, iwb))
        }
        None => None,
    };
    let kv_h = ctx.submit_read_f32(enc, &kv, 0, n * hd)?;

    // Compressor frontiers, token by token (host).
    if let (Some(cw), Some((ckv, cg))) = (&lw.compressor, &comp_bufs) {
        let (ckv, cg) = (ctx.read_f32(ckv, 0, n * coff * hd)?, ctx.read_f32(cg, 0, n * coff * hd)?);
        let idx_h = match &idx_bufs {
            Some((ikv, ig, _, _)) => Some((ctx.read_f32(ikv, 0, n * 2 * ihd)?, ctx.read_f32(ig, 0, n * 2 * ihd)?)),
            None => None,
        };
        let (ape, cnorm) = (model.dense(cw.ape), model.dense(cw.norm));
        let mut crow = vec![0f32; hd.max(ihd)];
        for (ri, run) in batch.runs.iter().enumerate() {
            let lk = &mut cx.kv[ri].layers[layer];
            for r in run.start..run.start + run.len {
                let pos = rows[r].pos;
                let w = coff * hd;
                let front = lk
                    .comp
                    .as_mut()
                    .ok_or_else(|| crate::Error::Session("compressed layer lacks a frontier".into()))?;
                if compressor::push(front, &ckv[r * w..(r + 1) * w], &cg[r * w..(r + 1) * w], ape, &mut crow) {
                    let row = &mut crow[..hd];
                    rms_norm_inplace(row, cnorm, eps);
                    rope.apply(row, pos + 1 - ratio, false);
                    if sim_on {
                        sim::fp8_blocks(&mut row[..hd - rd], 64);
                    }
                    lk.comp_rows.extend_from_slice(row);
                }
                if let (Some(iw), Some((ikv, ig))) = (&lw.indexer, &idx_h) {
                    let front = lk
                        .idx
                        .as_mut()
                        .ok_or_else(|| crate::Error::Session("CSA layer lacks an indexer frontier".into()))?;
                    let w = 2 * ihd;
                    if compressor::push(
                        front,
                        &ikv[r * w..(r + 1) * w],
                        &ig[r * w..(r + 1) * w],
                        model.dense(iw.comp.ape),
                        &mut crow,
                    ) {
                        let row = &mut crow[..ihd];
                        rms_norm_inplace(row, model.dense(iw.comp.norm), eps);
                        rope.apply(row, pos + 1 - ratio, false);
                        if sim_on {
                            sim::hadamard(row);
                            sim::fp4_blocks(row, 32);
                        }
                        lk.idx_rows.extend_from_slice(row);
                    }
                }
            }
        }
    }

    // Indexer top-k per run (device), selections back to the host.
    let topk = c.idx_topk.max(1);
    let mut sel_h = vec![u32::MAX; n * topk];
    if let (LayerKind::Csa, Some((_, _, iq, iwb))) = (kind, &idx_bufs) {
        for (ri, run) in batch.runs.iter().enumerate() {
            let lk = &cx.kv[ri].layers[layer];
            let n_keys = lk.idx_rows.len() / ihd;
            let m = run.len;
            let limit: Vec<u32> =
                (run.start..run.start + m).map(|r| ((rows[r].pos + 1) / ratio).min(n_keys) as u32).collect();
            let (qrun, wrun) = (ctx.scratch(m * ih * ihd), ctx.scratch(m * ih));
            let keys = be.upload(if n_keys > 0 { &lk.idx_rows[..n_keys * ihd] } else { &[0.0] });
            let (sc, sel) = (ctx.scratch(m * n_keys.max(1)), ctx.scratch(m * topk));
            let mut enc = ctx.encoder();
            let f4 = 4u64;
            enc.copy_buffer_to_buffer(iq, (run.start * ih * ihd) as u64 * f4, &qrun, 0, (m * ih * ihd) as u64 * f4);
            enc.copy_buffer_to_buffer(iwb, (run.start * ih) as u64 * f4, &wrun, 0, (m * ih) as u64 * f4);
            let scale = 1.0 / ((ihd as f32).sqrt() * (ih as f32).sqrt());
            ops::indexer_topk(ctx, &mut enc, &qrun, &keys, &wrun, &limit, n_keys, ih, ihd, topk, scale, &sc, &sel)?;
            sel_h[run.start * topk..(run.start + m) * topk].copy_from_slice(&ctx.submit_read_u32(
                enc,
                &sel,
                0,
                m * topk,
            )?);
        }
    }

    // Key matrix and per-row key lists (host), attention on the device.
    let window = c.window;
    let mut key_rows: Vec<f32> = kv_h.clone();
    let mut ring_base = Vec::with_capacity(batch.runs.len());
    let mut comp_base = Vec::with_capacity(batch.runs.len());
    for ri in 0..batch.runs.len() {
        let lk = &cx.kv[ri].layers[layer];
        ring_base.push(key_rows.len() / hd);
        key_rows.extend_from_slice(&lk.ring);
        comp_base.push(key_rows.len() / hd);
        key_rows.extend_from_slice(&lk.comp_rows);
    }
    let mut keys = KeyLists { rows: Vec::new(), ranges: Vec::with_capacity(n) };
    for (r, row) in rows.iter().enumerate() {
        let run = &batch.runs[row.run];
        let p0 = rows[run.start].pos;
        let t = row.pos;
        let start = keys.rows.len() as u32;
        for p in (t + 1).saturating_sub(window)..=t {
            keys.rows.push(if p >= p0 {
                (run.start + p - p0) as u32
            } else {
                (ring_base[row.run] + p % window) as u32
            });
        }
        match kind {
            LayerKind::Window => {}
            LayerKind::Hca => {
                for w in 0..(t + 1) / ratio {
                    keys.rows.push((comp_base[row.run] + w) as u32);
                }
            }
            LayerKind::Csa => {
                for &w in sel_h[r * topk..(r + 1) * topk].iter().take_while(|&&w| w != u32::MAX) {
                    keys.rows.push((comp_base[row.run] + w as usize) as u32);
                }
            }
        }
        keys.ranges.push((start, keys.rows.len() as u32 - start));
    }
    let kvb = be.upload(&key_rows);
    let attn = ctx.scratch(n * nh * hd);
    let sinks = be.dense_buf(model, lw.sinks);
    let (g, rank) = (c.o_groups, c.o_lora_rank);
    let gs = nh * hd / g;
    let oa = ctx.scratch(n * g * rank);
    let out = t.act.sub_out.get(ctx, "sub out", n * d).clone();
    let enc = t.enc(ctx);
    let scale = 1.0 / (hd as f32).sqrt();
    ops::attention(ctx, enc, (&q, 0, nh * hd), &kvb, &keys, &sinks, (&attn, 0, nh * hd), nh, hd, scale)?;
    ops::rope(ctx, enc, &attn, &cs, qshape, true)?;
    let wo_a = be.weight(model, lw.wo_a)?;
    for gi in 0..g {
        let x = View { buf: &attn, offset: gi * gs, stride: nh * hd };
        let y = View { buf: &oa, offset: gi * rank, stride: g * rank };
        matmul(ctx, enc, &wo_a, gi * rank..(gi + 1) * rank, x, n, y, false)?;
    }
    be.matvec(enc, &*be.weight(model, lw.wo_b)?, View::new(&oa, g * rank), n, View::new(&out, d))?;

    // Ring update: the last `window` rows of each run.
    for (ri, run) in batch.runs.iter().enumerate() {
        let lk = &mut cx.kv[ri].layers[layer];
        for j in run.len.saturating_sub(window)..run.len {
            let r = run.start + j;
            let s = rows[r].pos % window;
            lk.ring[s * hd..(s + 1) * hd].copy_from_slice(&kv_h[r * hd..(r + 1) * hd]);
        }
    }
    Ok(())
}
