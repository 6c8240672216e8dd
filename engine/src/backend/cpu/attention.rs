//! The attention op of one layer, for every row of the batch.
//!
//! Order (the reference's): `xn = RMSNorm(u)·attn_norm`; `qr = RMSNorm(wq_a·xn)·q_norm`; `q = wq_b·qr`, per-head
//! unweighted RMSNorm, RoPE; `kv = RMSNorm(wkv·xn)·kv_norm`, RoPE, (sim) FP8 on the non-rope dims. Compressed
//! layers then advance their compressor (and, CSA, the indexer's) token by token through each session's run —
//! a row emitted at token `(w+1)·m − 1` is visible to that token — and CSA queries pick their top-k rows with
//! the indexer. Each (row, head) attends to the raw window (its own row included) plus its compressed rows, with
//! a per-head sink logit in the softmax denominator; V = K; the output's rope dims are rotated back by `−pos`.
//! Grouped output projection: group `g` of heads through rows `g·rank..` of `wo_a`, then `wo_b`.
//!
//! Raw rows of the current run are read from the batch's `kv` scratch; earlier positions from the session's ring
//! (updated after attention), so runs longer than the window are exact.

use std::sync::{Mutex, MutexGuard};

use super::matmul::{dot_f32, matmul, matmul_strided};
use super::norm::{rms_norm_inplace, rms_norm_rows, rms_norm_unweighted};
use super::pool::{par_rows, thread_slot};
use super::{compressor, indexer, CpuBackend, Scratch};
use crate::backend::StepCtx;
use crate::model::sim;
use crate::model::LayerKind;
use crate::Result;

/// Per-thread score buffers: `(scores, selection order)`, one entry per pool thread.
type ScoreSlots = Vec<Mutex<(Vec<f32>, Vec<u32>)>>;

/// Grows `slots` to `threads` entries with room for `scores` scores and `order` indices each. Runs on the calling
/// thread before a dispatch, so the tasks (on whichever thread) never allocate.
fn grow_slots(slots: &mut ScoreSlots, threads: usize, scores: usize, order: usize) {
    if slots.len() < threads {
        slots.resize_with(threads, Default::default);
    }
    for s in slots.iter_mut() {
        let (sc, or) = s.get_mut().unwrap_or_else(|e| e.into_inner());
        reserve_to(sc, scores);
        reserve_to(or, order);
    }
}

/// The calling thread's entry of `slots` (locked; uncontended unless threads of two pools share a slot number).
fn slot(slots: &[Mutex<(Vec<f32>, Vec<u32>)>]) -> MutexGuard<'_, (Vec<f32>, Vec<u32>)> {
    slots[thread_slot() % slots.len()].lock().unwrap_or_else(|e| e.into_inner())
}

/// Grows `v`'s capacity to at least `n` (no-op when already there).
fn reserve_to<T>(v: &mut Vec<T>, n: usize) {
    if v.capacity() < n {
        v.reserve(n - v.len());
    }
}

/// Runs [`crate::graph::Op::Attention`] for `layer`.
/// `exp(d)` for a score minus the row maximum (`d ≤ 0`), 0 where the result would not be a normal f32 (`d < -87`):
/// such terms are below an ulp of the denominator (which holds the maximum's `exp(0) = 1`), and denormal results
/// and operands cost microcode assists on x86.
#[inline]
fn softmax_term(d: f32) -> f32 {
    if d < -87.0 {
        0.0
    } else {
        d.exp()
    }
}

pub fn attention(be: &CpuBackend, sc: &mut Scratch, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
    let pool = &be.pool;
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let batch = cx.batch;
    let n = batch.rows.len();
    let (hd, nh, rd) = (c.head_dim, c.n_heads, c.rope_dim);
    let eps = c.rms_eps;
    let rope = cx.rope.for_layer(model, layer);
    let kind = c.layer_kind(layer);
    let ratio = c.compress_ratios[layer];
    let sim_on = cx.sim;

    // Norm and projections.
    rms_norm_rows(&cx.act.collapsed, model.dense(lw.attn_norm), eps, n, &mut sc.xn);
    matmul(pool, model.mat(lw.wq_a), &sc.xn, n, &mut sc.qr)?;
    let q_norm = model.dense(lw.q_norm);
    par_rows(pool, &mut sc.qr[..n * c.q_lora_rank], c.q_lora_rank, &|_, r| rms_norm_inplace(r, q_norm, eps));
    matmul(pool, model.mat(lw.wq_b), &sc.qr, n, &mut sc.q)?;
    let rows = &batch.rows;
    par_rows(pool, &mut sc.q[..n * nh * hd], hd, &|i, r| {
        rms_norm_unweighted(r, eps);
        rope.apply(r, rows[i / nh].pos, false);
    });
    matmul(pool, model.mat(lw.wkv), &sc.xn, n, &mut sc.kv)?;
    let kv_norm = model.dense(lw.kv_norm);
    par_rows(pool, &mut sc.kv[..n * hd], hd, &|i, r| {
        rms_norm_inplace(r, kv_norm, eps);
        rope.apply(r, rows[i].pos, false);
        if sim_on {
            sim::fp8_blocks(&mut r[..hd - rd], 64);
        }
    });

    // Compressor (and indexer) projections.
    if let Some(cw) = &lw.compressor {
        matmul(pool, model.mat(cw.wkv), &sc.xn, n, &mut sc.ckv)?;
        matmul(pool, model.mat(cw.wgate), &sc.xn, n, &mut sc.cg)?;
    }
    let (ih, ihd) = (c.idx_heads, c.idx_head_dim);
    if let Some(iw) = &lw.indexer {
        matmul(pool, model.mat(iw.comp.wkv), &sc.xn, n, &mut sc.ikv)?;
        matmul(pool, model.mat(iw.comp.wgate), &sc.xn, n, &mut sc.ig)?;
        matmul(pool, model.mat(iw.wq_b), &sc.qr, n, &mut sc.iq)?;
        par_rows(pool, &mut sc.iq[..n * ih * ihd], ihd, &|i, r| {
            rope.apply(r, rows[i / ih].pos, false);
            if sim_on {
                sim::hadamard(r);
                sim::fp4_blocks(r, 32);
            }
        });
        matmul(pool, model.mat(iw.proj), &sc.xn, n, &mut sc.iw)?;
        let ws = 1.0 / (ih as f32).sqrt();
        sc.iw[..n * ih].iter_mut().for_each(|v| *v *= ws);
    }

    // Advance the compressors token by token through each run.
    if let Some(cw) = &lw.compressor {
        let ape = model.dense(cw.ape);
        let cnorm = model.dense(cw.norm);
        let coff = if kind == LayerKind::Csa { 2 } else { 1 };
        for (ri, run) in batch.runs.iter().enumerate() {
            let lk = &mut cx.kv[ri].layers[layer];
            for (r, row) in rows.iter().enumerate().skip(run.start).take(run.len) {
                let pos = row.pos;
                let front = lk.comp.as_mut().expect("compressed layer has a frontier");
                let w = coff * hd;
                if compressor::push(front, &sc.ckv[r * w..(r + 1) * w], &sc.cg[r * w..(r + 1) * w], ape, &mut sc.crow) {
                    let row = &mut sc.crow[..hd];
                    rms_norm_inplace(row, cnorm, eps);
                    rope.apply(row, pos + 1 - ratio, false);
                    if sim_on {
                        sim::fp8_blocks(&mut row[..hd - rd], 64);
                    }
                    lk.comp_rows.extend_from_slice(row);
                }
                if let Some(iw) = &lw.indexer {
                    let front = lk.idx.as_mut().expect("CSA layer has an indexer frontier");
                    let w = 2 * ihd;
                    let iape = model.dense(iw.comp.ape);
                    if compressor::push(
                        front,
                        &sc.ikv[r * w..(r + 1) * w],
                        &sc.ig[r * w..(r + 1) * w],
                        iape,
                        &mut sc.crow,
                    ) {
                        let row = &mut sc.crow[..ihd];
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

    // Indexer selection per row.
    let topk = c.idx_topk.max(1);
    if kind == LayerKind::Csa {
        let kvs = &*cx.kv;
        let need = kvs.iter().map(|k| k.layers[layer].idx_rows.capacity() / ihd.max(1)).max().unwrap_or(0);
        grow_slots(&mut sc.scores, pool.threads(), need, need);
        let (iq, iwb, slots) = (&sc.iq, &sc.iw, &sc.scores);
        par_rows(pool, &mut sc.sel[..n * topk], topk, &|r, out| {
            let row = rows[r];
            let lk = &kvs[row.run].layers[layer];
            let n_vis = (row.pos + 1) / ratio;
            {
                let mut g = slot(slots);
                let (scores, order) = &mut *g;
                // Size the scratch for every row this session can hold, once (no growth while decoding).
                reserve_to(scores, lk.idx_rows.capacity() / ihd.max(1));
                reserve_to(order, lk.idx_rows.capacity() / ihd.max(1));
                let cnt = indexer::select(
                    &iq[r * ih * ihd..(r + 1) * ih * ihd],
                    &iwb[r * ih..(r + 1) * ih],
                    &lk.idx_rows[..n_vis * ihd],
                    ihd,
                    topk,
                    scores,
                    order,
                    out,
                );
                // Mark the end of the selection.
                if cnt < topk {
                    out[cnt] = u32::MAX;
                }
            }
        });
    }

    // Attention per (row, head).
    let window = c.window;
    let scale = 1.0 / (hd as f32).sqrt();
    let sinks = model.dense(lw.sinks);
    {
        let kvs = &*cx.kv;
        let need = kvs.iter().map(|k| window + k.layers[layer].comp_rows.capacity() / hd.max(1)).max().unwrap_or(0);
        grow_slots(&mut sc.scores, pool.threads(), need, 0);
        let (q, kvb, sel, slots) = (&sc.q, &sc.kv, &sc.sel, &sc.scores);
        par_rows(pool, &mut sc.attn[..n * nh * hd], hd, &|i, out| {
            let (r, h) = (i / nh, i % nh);
            let row = rows[r];
            let run = &batch.runs[row.run];
            let p0 = rows[run.start].pos;
            let lk = &kvs[row.run].layers[layer];
            let t = row.pos;
            let qh = &q[(r * nh + h) * hd..(r * nh + h + 1) * hd];
            let key = |p: usize| -> &[f32] {
                if p >= p0 {
                    let j = run.start + (p - p0);
                    &kvb[j * hd..(j + 1) * hd]
                } else {
                    let s = p % window;
                    &lk.ring[s * hd..(s + 1) * hd]
                }
            };
            let first = (t + 1).saturating_sub(window);
            let comp_row = |w: usize| &lk.comp_rows[w * hd..(w + 1) * hd];
            let n_comp_vis = (t + 1).checked_div(ratio).unwrap_or(0);
            let sel_r = &sel[r * topk..(r + 1) * topk];
            let n_sel =
                if kind == LayerKind::Csa { sel_r.iter().position(|&x| x == u32::MAX).unwrap_or(topk) } else { 0 };
            {
                let mut g = slot(slots);
                let (scores, _) = &mut *g;
                reserve_to(scores, window + lk.comp_rows.capacity() / hd);
                scores.clear();
                for p in first..=t {
                    scores.push(dot_f32(qh, key(p)) * scale);
                }
                match kind {
                    LayerKind::Window => {}
                    LayerKind::Hca => {
                        for w in 0..n_comp_vis {
                            scores.push(dot_f32(qh, comp_row(w)) * scale);
                        }
                    }
                    LayerKind::Csa => {
                        for &w in &sel_r[..n_sel] {
                            scores.push(dot_f32(qh, comp_row(w as usize)) * scale);
                        }
                    }
                }
                let sink = sinks[h];
                let mx = scores.iter().fold(sink, |a, &b| a.max(b));
                let mut den = (sink - mx).exp();
                for v in scores.iter_mut() {
                    *v = softmax_term(*v - mx);
                    den += *v;
                }
                let inv = 1.0 / den;
                out.fill(0.0);
                let mut acc = |p: f32, k: &[f32]| {
                    let p = p * inv;
                    // Weights below the smallest normal f32 add nothing an f32 sum with the top weight's term can
                    // hold, and as denormal operands they would cost a microcode assist per element on x86.
                    if p < f32::MIN_POSITIVE {
                        return;
                    }
                    for (o, &kv) in out.iter_mut().zip(k) {
                        *o += p * kv;
                    }
                };
                let nw = t + 1 - first;
                for (j, p) in (first..=t).enumerate() {
                    acc(scores[j], key(p));
                }
                match kind {
                    LayerKind::Window => {}
                    LayerKind::Hca => {
                        for w in 0..n_comp_vis {
                            acc(scores[nw + w], comp_row(w));
                        }
                    }
                    LayerKind::Csa => {
                        for (j, &w) in sel_r[..n_sel].iter().enumerate() {
                            acc(scores[nw + j], comp_row(w as usize));
                        }
                    }
                }
            }
            rope.apply(out, t, true);
        });
    }

    // Ring update: the last `window` rows of each run; every row goes to the roll-back log.
    let (cw, iw) = (if kind == LayerKind::Csa { 2 * hd } else { hd }, 2 * ihd);
    for (ri, run) in batch.runs.iter().enumerate() {
        let lk = &mut cx.kv[ri].layers[layer];
        for (r, row) in rows.iter().enumerate().skip(run.start).take(run.len) {
            let comp = lw.compressor.as_ref().map(|_| (&sc.ckv[r * cw..(r + 1) * cw], &sc.cg[r * cw..(r + 1) * cw]));
            let idx = lw.indexer.as_ref().map(|_| (&sc.ikv[r * iw..(r + 1) * iw], &sc.ig[r * iw..(r + 1) * iw]));
            lk.log.record(row.pos, &sc.kv[r * hd..(r + 1) * hd], comp, idx);
        }
        let from = run.len.saturating_sub(window);
        for j in from..run.len {
            let r = run.start + j;
            let s = rows[r].pos % window;
            lk.ring[s * hd..(s + 1) * hd].copy_from_slice(&sc.kv[r * hd..(r + 1) * hd]);
        }
    }

    // Grouped output projection.
    let (g, rank) = (c.o_groups, c.o_lora_rank);
    let gs = nh * hd / g;
    let wo_a = model.mat(lw.wo_a);
    for gi in 0..g {
        matmul_strided(
            pool,
            wo_a.rows_slice(gi * rank, rank),
            &sc.attn,
            n,
            (nh * hd, gi * gs),
            &mut sc.oa,
            (g * rank, gi * rank),
        )?;
    }
    matmul(pool, model.mat(lw.wo_b), &sc.oa, n, &mut cx.act.sub_out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::softmax_term;

    #[test]
    fn softmax_terms_are_exp_or_zero_never_denormal() {
        for i in 0..=2000 {
            let d = -(i as f32) * 0.05;
            let t = softmax_term(d);
            assert!(t == 0.0 || t.is_normal(), "d {d}: {t:e}");
            if d >= -87.0 {
                assert_eq!(t, d.exp(), "d {d}");
            } else {
                assert_eq!(t, 0.0, "d {d}");
            }
        }
        assert_eq!(softmax_term(0.0), 1.0);
        assert_eq!(softmax_term(f32::NEG_INFINITY), 0.0);
    }
}
