//! The attention kernels that touch the KV pages (the layer's recipe is [`crate::model::recipe`]).
//!
//! [`compress_push`] advances a compressor (or the indexer's) token by token through each session's run — a row
//! emitted at token `(w+1)·m − 1` is visible to that token — and appends it (normed, roped, simulated) to the
//! pages. [`indexer_topk`] picks each CSA query's top-k compressed rows. [`sparse_attention`]: each (row, head)
//! attends to the raw window (its own row included) plus its compressed rows, with a per-head sink logit in the
//! softmax denominator; V = K. All heads of a row read the same key rows, so a task takes a row's heads together
//! (all of them in prefill) and runs every head group over a tile of keys before the next tile; per output the
//! float operations stay those of the one-head loop. [`kv_store`] writes the last `window` raw rows of each run into
//! the ring.
//!
//! Raw rows of the current run are read from the tick's `KvRows`; earlier positions from the session's ring
//! (written after attention), so runs longer than the window are exact. KV access goes through [`ring_row`] and
//! [`comp_row`].

use std::sync::{Mutex, MutexGuard};

use super::norm::rms_norm_inplace;
use super::pool::{par_rows, worker_index, Pool};
use super::{compressor, fdot, indexer, Scratch};
use crate::backend::StepCtx;
use crate::model::sim;
use crate::model::LayerKind;
use crate::tables::LayerKv;
use crate::Result;

/// Per-thread score buffers: `(scores, selection order)`, one entry per pool thread.
type PerWorker = Vec<Mutex<(Vec<f32>, Vec<u32>)>>;

/// Grows `per` to `threads` entries with room for `scores` scores and `order` indices each. Runs on the calling
/// thread before a dispatch, so the tasks (on whichever thread) never allocate.
fn grow_per_worker(per: &mut PerWorker, threads: usize, scores: usize, order: usize) {
    if per.len() < threads {
        per.resize_with(threads, Default::default);
    }
    for s in per.iter_mut() {
        let (sc, or) = s.get_mut().unwrap_or_else(|e| e.into_inner());
        reserve_to(sc, scores);
        reserve_to(or, order);
    }
}

/// The calling thread's entry of `per` (locked; uncontended unless threads of two pools share a worker index).
fn mine(per: &[Mutex<(Vec<f32>, Vec<u32>)>]) -> MutexGuard<'_, (Vec<f32>, Vec<u32>)> {
    per[worker_index() % per.len()].lock().unwrap_or_else(|e| e.into_inner())
}

/// Grows `v`'s capacity to at least `n` (no-op when already there).
fn reserve_to<T>(v: &mut Vec<T>, n: usize) {
    if v.capacity() < n {
        v.reserve(n - v.len());
    }
}

/// The ring row holding position `pos` (of `hd` values, window `window`).
#[inline]
pub fn ring_row(lk: &LayerKv, pos: usize, window: usize, hd: usize) -> &[f32] {
    let s = crate::tables::kv::ring_index(pos, window);
    &lk.ring[s * hd..(s + 1) * hd]
}

/// The ring row holding position `pos`, for writing.
#[inline]
pub fn ring_row_mut(lk: &mut LayerKv, pos: usize, window: usize, hd: usize) -> &mut [f32] {
    let s = crate::tables::kv::ring_index(pos, window);
    &mut lk.ring[s * hd..(s + 1) * hd]
}

/// Compressed row `w` (of `hd` values).
#[inline]
pub fn comp_row(lk: &LayerKv, w: usize, hd: usize) -> &[f32] {
    debug_assert_eq!(lk.comp_rows.width(), hd);
    lk.comp_rows.row(w)
}

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

/// [`crate::graph::Op::CompressPush`]: the compressor of `layer` (`indexer`: the indexer's) through each run.
pub fn compress_push(sc: &mut Scratch, cx: &mut StepCtx<'_>, layer: usize, indexer: bool, sim_on: bool) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let batch = cx.batch;
    let rows = &batch.rows;
    let (hd, rd, eps) = (c.head_dim, c.rope_dim, c.rms_eps);
    let rope = cx.rope.for_layer(model, layer);
    let ratio = c.compress_ratios[layer];
    let (cw, dim, coff) = match (indexer, &lw.compressor, &lw.indexer) {
        (false, Some(cw), _) => (*cw, hd, if c.layer_kind(layer) == LayerKind::Csa { 2 } else { 1 }),
        (true, _, Some(iw)) => (iw.comp, c.idx_head_dim, 2),
        _ => {
            return Err(crate::Error::Backend { backend: "cpu", what: format!("layer {layer} has no such compressor") })
        }
    };
    let (ape, cnorm) = (model.dense(cw.ape), model.dense(cw.norm));
    let (kv, gate) = if indexer { (&sc.ikv, &sc.ig) } else { (&sc.ckv, &sc.cg) };
    let w = coff * dim;
    for (ri, run) in batch.runs.iter().enumerate() {
        let lk = &mut cx.kv[ri].layers[layer];
        for (r, row) in rows.iter().enumerate().skip(run.start).take(run.len) {
            let front = if indexer { lk.idx.as_mut() } else { lk.comp.as_mut() };
            let front = front.expect("compressed layer has a frontier");
            if compressor::push(front, &kv[r * w..(r + 1) * w], &gate[r * w..(r + 1) * w], ape, &mut sc.crow) {
                let out = &mut sc.crow[..dim];
                rms_norm_inplace(out, cnorm, eps);
                rope.apply(out, row.pos + 1 - ratio, false);
                if sim_on {
                    if indexer {
                        sim::hadamard(out);
                        sim::fp4_blocks(out, 32);
                    } else {
                        sim::fp8_blocks(&mut out[..hd - rd], 64);
                    }
                }
                if indexer {
                    lk.idx_rows.push(out);
                } else {
                    lk.comp_rows.push(out);
                }
            }
        }
    }
    Ok(())
}

/// [`crate::graph::Op::IndexerTopK`]: each row's top-k visible compressed rows (ascending; `u32::MAX` ends a
/// short list).
pub fn indexer_topk(pool: &Pool, sc: &mut Scratch, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
    let c = &cx.model.config;
    let rows = &cx.batch.rows;
    let n = rows.len();
    let (ih, ihd) = (c.idx_heads, c.idx_head_dim);
    let ratio = c.compress_ratios[layer];
    let topk = c.idx_topk.max(1);
    let kvs = &*cx.kv;
    let need = kvs.iter().map(|k| k.layers[layer].idx_rows.capacity_rows()).max().unwrap_or(0);
    grow_per_worker(&mut sc.scores, pool.threads(), need, need);
    let (iq, iwb, per) = (&sc.iq, &sc.iw, &sc.scores);
    par_rows(pool, &mut sc.sel[..n * topk], topk, &|r, out| {
        let row = rows[r];
        let lk = &kvs[row.run].layers[layer];
        let n_vis = crate::graph::visibility::compressed(row.pos, ratio);
        let mut g = mine(per);
        let (scores, order) = &mut *g;
        // Size the scratch for every row this session can hold, once (no growth while decoding).
        reserve_to(scores, lk.idx_rows.capacity_rows());
        reserve_to(order, lk.idx_rows.capacity_rows());
        let cnt = indexer::select(
            &iq[r * ih * ihd..(r + 1) * ih * ihd],
            &iwb[r * ih..(r + 1) * ih],
            lk.idx_rows.page_slices(),
            n_vis,
            ihd,
            topk,
            scores,
            order,
            out,
        );
        if cnt < topk {
            out[cnt] = u32::MAX;
        }
    });
    Ok(())
}

/// Heads per register tile of the sparse attention: they share each key row's loads (see [`fdot`]).
const HEAD_GROUP: usize = 4;

/// Keys per tile of [`attend`]: every head group of a task runs over a tile of keys before the next tile, so the
/// tile's rows are read from memory once per task and then from cache.
const KEY_TILE: usize = 64;

/// Sparse-attention tasks wanted per pool thread: rows are split into head spans until there are this many.
const TASKS_PER_THREAD: usize = 4;

/// [`crate::graph::Op::SparseAttention`]: attention with sinks per (row, head) into `AttnOut`.
///
/// A task is one row and a span of heads: all of them when the tick has rows enough to keep the pool busy (prefill),
/// fewer, in multiples of [`HEAD_GROUP`], when it has not (decode). Keys `j` of a row are its raw window in position
/// order, then its compressed rows (all visible ones for HCA, the selection for CSA). Per head the float operations
/// are those of the one-head loop: `score_j = dot_f32(q, key_j) · scale`, the softmax with the sink as below, and
/// `out = Σ_j p_j · key_j` over the keys in order from `+0.0`, skipping weights below the smallest normal f32 — so
/// results depend neither on the span nor on the tiling (`tests`).
pub fn sparse_attention(pool: &Pool, sc: &mut Scratch, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let batch = cx.batch;
    let rows = &batch.rows;
    let n = rows.len();
    let (hd, nh) = (c.head_dim, c.n_heads);
    let kind = c.layer_kind(layer);
    let ratio = c.compress_ratios[layer];
    let topk = c.idx_topk.max(1);
    let window = c.window;
    let scale = 1.0 / (hd as f32).sqrt();
    let sinks = model.dense(lw.sinks);
    let kvs = &*cx.kv;
    let span = head_span(nh, n, pool.threads());
    let spans = nh / span;
    // Keys a row can have: the window and its compressed rows (at most top-k of them for CSA).
    let keys_max = |lk: &LayerKv| {
        let comp = lk.comp_rows.capacity_rows();
        window + if kind == LayerKind::Csa { comp.min(topk) } else { comp }
    };
    let need = kvs.iter().map(|k| keys_max(&k.layers[layer])).max().unwrap_or(0);
    grow_per_worker(&mut sc.scores, pool.threads(), span * need, 0);
    let (q, kvb, sel, per) = (&sc.q, &sc.kv, &sc.sel, &sc.scores);
    par_rows(pool, &mut sc.attn[..n * nh * hd], span * hd, &|i, out| {
        let (r, h0) = (i / spans, (i % spans) * span);
        let row = rows[r];
        let run = &batch.runs[row.run];
        let p0 = rows[run.start].pos;
        let lk = &kvs[row.run].layers[layer];
        let t = row.pos;
        let first = *crate::graph::visibility::window(t, window).start();
        let nw = t + 1 - first;
        let sel_r = &sel[r * topk..(r + 1) * topk];
        let nc = match kind {
            LayerKind::Window => 0,
            LayerKind::Hca => (t + 1).checked_div(ratio).unwrap_or(0),
            LayerKind::Csa => sel_r.iter().position(|&x| x == u32::MAX).unwrap_or(topk),
        };
        let nk = nw + nc;
        let key = |j: usize| -> &[f32] {
            if j < nw {
                let p = first + j;
                if p >= p0 {
                    let k = run.start + (p - p0);
                    &kvb[k * hd..(k + 1) * hd]
                } else {
                    ring_row(lk, p, window, hd)
                }
            } else if kind == LayerKind::Csa {
                comp_row(lk, sel_r[j - nw] as usize, hd)
            } else {
                comp_row(lk, j - nw, hd)
            }
        };
        let mut g = mine(per);
        let (scores, _) = &mut *g;
        reserve_to(scores, span * keys_max(lk));
        let qs = &q[(r * nh + h0) * hd..(r * nh + h0 + span) * hd];
        attend(qs, &sinks[h0..h0 + span], nk, &key, scale, scores, out);
    });
    Ok(())
}

/// Heads per sparse-attention task for `nh` heads, `n` rows and `threads` pool threads: all heads where the rows
/// alone make [`TASKS_PER_THREAD`] tasks per thread, else the largest multiple of [`HEAD_GROUP`] dividing `nh` that
/// makes them (at the least one group; `nh` when it is no multiple of the group).
fn head_span(nh: usize, n: usize, threads: usize) -> usize {
    if !nh.is_multiple_of(HEAD_GROUP) {
        return nh.max(1);
    }
    let groups = nh / HEAD_GROUP;
    let want = (threads * TASKS_PER_THREAD).div_ceil(n.max(1));
    let splits = (want.min(groups)..=groups).find(|&s| groups.is_multiple_of(s)).unwrap_or(groups);
    nh / splits
}

/// Attention of `sinks.len()` heads (`qs`: their query rows, `out`: their outputs, `hd` values each) over keys
/// `key(0..nk)`, as documented on [`sparse_attention`]: scores and weighted sums by tiles of [`KEY_TILE`] keys, each
/// tile through every group of [`HEAD_GROUP`] heads (single heads where the count is no multiple). `scores` is
/// scratch (grown to `sinks.len() · nk`; no allocation when its capacity suffices).
pub(crate) fn attend<'k>(
    qs: &[f32],
    sinks: &[f32],
    nk: usize,
    key: &impl Fn(usize) -> &'k [f32],
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let nh = sinks.len();
    let hd = out.len() / nh.max(1);
    let hg = if nh.is_multiple_of(HEAD_GROUP) { HEAD_GROUP } else { 1 };
    scores.clear();
    scores.resize(nh * nk, 0.0);
    for j0 in (0..nk).step_by(KEY_TILE) {
        let keys = j0..nk.min(j0 + KEY_TILE);
        for (h0, s) in (0..nh).step_by(hg).zip(scores.chunks_exact_mut(hg * nk.max(1))) {
            let q = |k: usize| &qs[(h0 + k) * hd..(h0 + k + 1) * hd];
            if hg == HEAD_GROUP {
                head_scores::<HEAD_GROUP>(std::array::from_fn(q), nk, keys.clone(), key, hd, scale, s);
            } else {
                head_scores::<1>([q(0)], nk, keys.clone(), key, hd, scale, s);
            }
        }
    }
    for (k, s) in scores.chunks_exact_mut(nk.max(1)).take(nh).enumerate() {
        let s = &mut s[..nk];
        let sink = sinks[k];
        let mx = s.iter().fold(sink, |a, &b| a.max(b));
        let mut den = (sink - mx).exp();
        for v in s.iter_mut() {
            *v = softmax_term(*v - mx);
            den += *v;
        }
        let inv = 1.0 / den;
        for v in s.iter_mut() {
            *v *= inv;
            // Left out below (a zero instead of a denormal keeps the discarded products free of assists).
            if *v < f32::MIN_POSITIVE {
                *v = 0.0;
            }
        }
    }
    // Weights below the smallest normal f32 add nothing an f32 sum with the top weight's term can hold, and as
    // denormal operands they would cost a microcode assist per element on x86: `weighted_sums` leaves them out.
    // An empty key set still runs once, from key 0, to write the zero sums.
    for j0 in (0..nk.max(1)).step_by(KEY_TILE) {
        let keys = j0..nk.min(j0 + KEY_TILE);
        for (o, p) in
            out.chunks_exact_mut(hg * hd).zip(scores.chunks_exact(hg * nk.max(1)).chain(std::iter::repeat(&[][..])))
        {
            if hg == HEAD_GROUP {
                fdot::weighted_sums::<HEAD_GROUP>(o, p, nk, keys.clone(), key);
            } else {
                fdot::weighted_sums::<1>(o, p, nk, keys.clone(), key);
            }
        }
    }
}

/// `scores[k·nk + j] = dot_f32(qs[k], key(j)) · scale` for `j ∈ keys`, two keys per tile.
fn head_scores<'k, const H: usize>(
    qs: [&[f32]; H],
    nk: usize,
    keys: std::ops::Range<usize>,
    key: &impl Fn(usize) -> &'k [f32],
    hd: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let mut j = keys.start;
    while j + 2 <= keys.end {
        let d = fdot::dots(qs, [key(j), key(j + 1)], hd);
        for (k, dk) in d.iter().enumerate() {
            scores[k * nk + j] = dk[0] * scale;
            scores[k * nk + j + 1] = dk[1] * scale;
        }
        j += 2;
    }
    if j < keys.end {
        let d = fdot::dots(qs, [key(j)], hd);
        for (k, dk) in d.iter().enumerate() {
            scores[k * nk + j] = dk[0] * scale;
        }
    }
}

/// [`crate::graph::Op::WindowStore`]: every row of the tick into its session's roll-back log (raw KV row, compressor and
/// indexer features and gates before `ape`), and the last `window` raw rows of each run into its session's ring.
pub fn kv_store(sc: &mut Scratch, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
    let c = &cx.model.config;
    let lw = &cx.model.layers[layer];
    let (hd, ihd, window) = (c.head_dim, c.idx_head_dim, c.window);
    let (cw, iw) = (if c.layer_kind(layer) == LayerKind::Csa { 2 * hd } else { hd }, 2 * ihd);
    let rows = &cx.batch.rows;
    for (ri, run) in cx.batch.runs.iter().enumerate() {
        let lk = &mut cx.kv[ri].layers[layer];
        for (r, row) in rows.iter().enumerate().skip(run.start).take(run.len) {
            let comp = lw.compressor.as_ref().map(|_| (&sc.ckv[r * cw..(r + 1) * cw], &sc.cg[r * cw..(r + 1) * cw]));
            let idx = lw.indexer.as_ref().map(|_| (&sc.ikv[r * iw..(r + 1) * iw], &sc.ig[r * iw..(r + 1) * iw]));
            lk.log.record(row.pos, &sc.kv[r * hd..(r + 1) * hd], comp, idx);
        }
        let from = run.len.saturating_sub(window);
        for j in from..run.len {
            let r = run.start + j;
            ring_row_mut(lk, rows[r].pos, window, hd).copy_from_slice(&sc.kv[r * hd..(r + 1) * hd]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::fdot::tests::random_values as values;
    use super::super::matmul::dot_f32;
    use super::{attend, head_span, softmax_term, HEAD_GROUP};

    /// The one-head loop `attend` replaced (kept verbatim as the reference): scores, softmax with the sink, then
    /// `out += p · key` per key in order, skipping weights below the smallest normal f32.
    fn reference(qh: &[f32], sink: f32, keys: &[&[f32]], scale: f32, out: &mut [f32]) {
        let mut scores: Vec<f32> = keys.iter().map(|k| dot_f32(qh, k) * scale).collect();
        let mx = scores.iter().fold(sink, |a, &b| a.max(b));
        let mut den = (sink - mx).exp();
        for v in scores.iter_mut() {
            *v = softmax_term(*v - mx);
            den += *v;
        }
        let inv = 1.0 / den;
        out.fill(0.0);
        for (j, k) in keys.iter().enumerate() {
            let p = scores[j] * inv;
            if p < f32::MIN_POSITIVE {
                continue;
            }
            for (o, &kv) in out.iter_mut().zip(k.iter()) {
                *o += p * kv;
            }
        }
    }

    #[test]
    fn grouped_heads_match_the_one_head_loop_bit_for_bit() {
        // Head dims with and without a register-block tail; key counts odd and even; query amplitudes from flat
        // softmaxes to ones whose small weights fall below the normal range (the skipped terms).
        for (hd, nk, amp) in [
            (512usize, 640usize, 0.05f32),
            (512, 257, 3.0),
            (128, 1, 1.0),
            (72, 37, 12.0),
            (8, 2, 40.0),
            (16, 0, 1.0),
            (32, 130, 30.0),
        ] {
            let key_vals = values(nk * hd, hd as u32 + nk as u32, 1.0);
            let keys: Vec<&[f32]> = key_vals.chunks_exact(hd).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            for hg in [HEAD_GROUP, 1, 3, 2 * HEAD_GROUP, 16 * HEAD_GROUP] {
                let qs = values(hg * hd, 7 + hg as u32, amp);
                let sinks = values(hg, 99, 2.0);
                let mut sc = Vec::new();
                let mut out = vec![f32::NAN; hg * hd];
                attend(&qs, &sinks, nk, &|j| keys[j], scale, &mut sc, &mut out);
                for h in 0..hg {
                    let mut want = vec![0f32; hd];
                    reference(&qs[h * hd..(h + 1) * hd], sinks[h], &keys, scale, &mut want);
                    let got = &out[h * hd..(h + 1) * hd];
                    for (d, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "hd {hd} nk {nk} group {hg} head {h} dim {d}");
                    }
                }
            }
        }
    }

    #[test]
    fn head_spans_divide_the_heads_and_keep_the_pool_busy() {
        for (nh, n, threads) in
            [(64usize, 256usize, 2usize), (64, 1, 2), (64, 3, 2), (64, 1, 64), (8, 1, 16), (6, 1, 4)]
        {
            let span = head_span(nh, n, threads);
            assert_eq!(nh % span, 0, "{nh} heads, {n} rows: span {span}");
            if nh.is_multiple_of(HEAD_GROUP) {
                assert!(span.is_multiple_of(HEAD_GROUP), "{nh} heads, {n} rows: span {span}");
                // Enough tasks, unless the spans are down to one group.
                assert!(n * nh / span >= threads * 4 || span == HEAD_GROUP, "{nh} heads, {n} rows: span {span}");
            } else {
                assert_eq!(span, nh);
            }
        }
        assert_eq!(head_span(64, 256, 2), 64, "prefill: all heads per task");
        assert_eq!(head_span(64, 1, 2), 8, "decode on 2 threads: 8 tasks of 8 heads");
    }

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
