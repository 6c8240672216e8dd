//! The MoE kernels (the layer's recipe is [`crate::model::recipe`]).
//!
//! [`route`]: router scores `s = sqrt(softplus(gate·x))`; selection `topk(s + bias)` (ties to the lower expert
//! id) or, on hash layers, `tid2eid[token]`; weights `s[sel]` renormalised (`/ (Σ + 1e-20)`) when the model says
//! so, times the routed scale; and the plan: rows grouped by expert (ascending id), then the shared expert, as
//! groups of consecutive rows of the expert buffers. [`expert_up`]: every group's `w1·x` and `w3·x` in one dispatch
//! (each expert's weights read once per batch). [`swiglu_rows`]: `silu(min(w1·x, L)) · clamp(w3·x, −L, L)`, times
//! the row's routing weight (1 for the shared expert). [`expert_down`]: every group's `w2·h` in one dispatch.
//! [`combine`]: the routed (already weighted) outputs added in ascending expert order, then the shared expert —
//! the meanings [`crate::graph::Op::SwiGlu`] and [`crate::graph::Op::MoeCombine`] document for every backend.

use super::matmul::{grain_rows, run_group, Acts, Kernel, Out, Product, RowAt};
use super::pool::{par_rows, Pool};
use super::Scratch;
use crate::backend::StepCtx;
use crate::model::Mat;
use crate::quant::ActType;
use crate::Result;

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `h1 ← silu(min(h1, L)) · clamp(h3, −L, L)` (the portable kernel of [`crate::graph::Op::SwiGlu`], one row).
pub fn swiglu(h1: &mut [f32], h3: &[f32], limit: f32) {
    for (a, &b) in h1.iter_mut().zip(h3) {
        *a = silu(a.min(limit)) * b.clamp(-limit, limit);
    }
}

/// The shared expert's matrices and kernels, if the layer has one.
fn shared_expert<'m>(
    pool: &Pool,
    cx: &StepCtx<'m>,
    layer: usize,
) -> Result<Option<(Mat<'m>, Mat<'m>, Mat<'m>, Kinds)>> {
    let model = cx.model;
    let lw = &model.layers[layer];
    Ok(match (lw.gate_sh, lw.up_sh, lw.down_sh) {
        (Some(g), Some(u), Some(dn)) => {
            let w = |id| super::weight(pool, model, id);
            let (g, u, dn) = (w(g), w(u), w(dn));
            Some((g, u, dn, Kinds::new(pool, g, u, dn)?))
        }
        _ => None,
    })
}

/// Router logits `z` → scores `sqrt(softplus(z))`, in place (one row).
pub fn router_scores(z: &mut [f32]) {
    for v in z.iter_mut() {
        *v = softplus(*v).sqrt();
    }
}

/// The top `sel.len()` experts of one row by `scores + bias`, best first, ties to the lower id.
pub fn top_k_biased(scores: &[f32], bias: Option<&[f32]>, sel: &mut [u32]) {
    let k = sel.len();
    let biased = |e: usize| scores[e] + bias.map_or(0.0, |b| b[e]);
    // Insertion into a sorted list of k.
    let mut n_in = 0usize;
    for e in 0..scores.len() {
        let v = biased(e);
        let mut at = n_in;
        while at > 0 && biased(sel[at - 1] as usize) < v {
            at -= 1;
        }
        if at < k {
            let end = n_in.min(k - 1);
            for i in (at..end).rev() {
                sel[i + 1] = sel[i];
            }
            sel[at] = e as u32;
            n_in = (n_in + 1).min(k);
        }
    }
}

/// The routing weights of one row's selection `sel`: `scores[sel]`, renormalised (`/ (Σ + 1e-20)`) when `norm`,
/// times `scale`.
pub fn routing_weights(scores: &[f32], sel: &[u32], norm: bool, scale: f32, w: &mut [f32]) {
    let mut sum = 0f32;
    for (wj, &e) in w.iter_mut().zip(sel) {
        *wj = scores[e as usize];
        sum += *wj;
    }
    for wj in w.iter_mut() {
        if norm {
            *wj /= sum + 1e-20;
        }
        *wj *= scale;
    }
}

/// [`crate::graph::Op::MoeRoute`]: selection, weights and the group plan of every row.
#[allow(clippy::needless_range_loop)]
pub fn route(sc: &mut Scratch, cx: &StepCtx<'_>, layer: usize, hash: bool) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let rows = &cx.batch.rows;
    let n = rows.len();
    let (d, ne, k, ffn) = (c.d_model, c.n_experts, c.n_experts_used, c.expert_ffn);
    let bias = lw.gate_bias.map(|b| model.dense(b));
    let table = match (hash, &lw.tid2eid) {
        (true, Some(t)) => Some(t),
        (false, _) => None,
        (true, None) => {
            return Err(crate::Error::Backend { backend: "cpu", what: format!("layer {layer} has no hash table") })
        }
    };
    for e in sc.expert_rows.iter_mut() {
        e.clear();
    }
    if sc.expert_rows.len() < ne {
        sc.expert_rows.resize_with(ne, Vec::new);
    }
    for r in 0..n {
        let logits = &mut sc.router[r * ne..(r + 1) * ne];
        router_scores(logits);
        let sel = &mut sc.sel_e[r * k..(r + 1) * k];
        match table {
            Some(t) => {
                let tok = rows[r].token as usize;
                sel.copy_from_slice(&t[tok * k..(tok + 1) * k]);
            }
            None => top_k_biased(logits, bias, sel),
        }
        routing_weights(logits, sel, c.weights_norm, c.routed_scale, &mut sc.w_e[r * k..(r + 1) * k]);
        for (j, &e) in sel.iter().enumerate() {
            sc.expert_rows[e as usize].push((r, j));
        }
    }

    // Routed experts in ascending id, then the shared expert, as groups of consecutive rows of h1/h3/eo.
    let ms = &mut sc.moe;
    ms.groups.clear();
    sc.idx.clear();
    ms.pick.clear();
    for e in 0..ne {
        let list = &sc.expert_rows[e];
        if !list.is_empty() {
            ms.groups.push(ExpertGroup { expert: Some(e), start: sc.idx.len(), m: list.len() });
            sc.idx.extend(list.iter().map(|&(r, _)| r));
            ms.pick.extend_from_slice(list);
        }
    }
    ms.routed = sc.idx.len();
    ms.shared = lw.gate_sh.is_some() && lw.up_sh.is_some() && lw.down_sh.is_some();
    if ms.shared {
        ms.groups.push(ExpertGroup { expert: None, start: ms.routed, m: n });
    }
    ms.total = ms.routed + if ms.shared { n } else { 0 };
    grow(&mut sc.h1, ms.total * ffn);
    grow(&mut sc.h3, ms.total * ffn);
    grow(&mut sc.eo, ms.total * d);
    Ok(())
}

/// [`crate::graph::Op::ExpertUp`]: gate and up products of every group in one dispatch.
pub fn expert_up(pool: &Pool, sc: &mut Scratch, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let n = cx.batch.rows.len();
    let (d, ffn) = (c.d_model, c.expert_ffn);
    let shared = shared_expert(pool, cx, layer)?;
    let (gate_m, up_m, down_m) = (model.mat(lw.gate_exps), model.mat(lw.up_exps), model.mat(lw.down_exps));
    let kr = Kinds::new(pool, gate_m, up_m, down_m)?;
    let ms = &mut sc.moe;

    // Activations of the normalized input, quantized once per activation type for all gate/up products (spread
    // over the pool: the same bytes as on one thread).
    let all_rows = RowAt::Strided { stride: d, off: 0 };
    let mut prepared = [false; 3];
    for k in [kr.gate, kr.up].into_iter().chain(shared.iter().flat_map(|s| [s.3.gate, s.3.up])) {
        let a = act_index(&k);
        if matches!(k, Kernel::Q { .. }) && !prepared[a] {
            ms.xacts[a].prepare_par(pool, &k, &sc.xn, all_rows, n, d)?;
            prepared[a] = true;
        }
    }

    let (groups, idx, xacts, xn) = (&ms.groups, &sc.idx, &ms.xacts, &sc.xn);
    let (o1, o3) = (Out::new(&mut sc.h1, ffn, 0), Out::new(&mut sc.h3, ffn, 0));
    let product = |u: usize| {
        let s = groups[u / 2];
        let (w, k, at) = match (s.expert, shared) {
            (Some(e), _) => {
                let (w, k) = if u & 1 == 0 { (gate_m, kr.gate) } else { (up_m, kr.up) };
                (w.rows_slice(e * ffn, ffn), k, RowAt::Gather { idx: &idx[s.start..s.start + s.m], stride: 1 })
            }
            (None, Some((g, up, _, ks))) => {
                let (w, k) = if u & 1 == 0 { (g, ks.gate) } else { (up, ks.up) };
                (w, k, RowAt::Strided { stride: 1, off: 0 })
            }
            (None, None) => unreachable!("shared group without shared weights"),
        };
        let out = if u & 1 == 0 { o1 } else { o3 };
        Product { w, k, input: xacts[act_index(&k)].input(&k, xn, d, at), n: s.m, out: out.shifted(s.start * ffn) }
    };
    // SAFETY: product `u` writes rows `start..start + m` of h1 (even `u`) or h3 (odd `u`) of its own group; groups
    // do not overlap (the plan of `route`, which also grew h1/h3 to every group row); h1/h3 outlive the call and
    // are not otherwise used during it.
    unsafe { run_group(pool, 2 * ms.groups.len(), ffn, grain_rows(gate_m.row_bytes), &product) };
    Ok(())
}

/// [`crate::graph::Op::SwiGlu`] over every group row with the row kernel `f` (the portable [`swiglu`] or a native
/// override of the same signature), each routed row then scaled by its routing weight.
pub fn swiglu_rows(
    pool: &Pool,
    sc: &mut Scratch,
    cx: &StepCtx<'_>,
    layer: usize,
    f: fn(&mut [f32], &[f32], f32),
) -> Result<()> {
    let c = &cx.model.config;
    let (ffn, limit) = (c.expert_ffn, c.swiglu_limit[layer]);
    let k = c.n_experts_used;
    let (total, pick, w_e, h3) = (sc.moe.total, &sc.moe.pick, &sc.w_e, &sc.h3);
    par_rows(pool, &mut sc.h1[..total * ffn], ffn, &|i, h| {
        f(h, &h3[i * ffn..(i + 1) * ffn], limit);
        if let Some(&(r, j)) = pick.get(i) {
            let w = w_e[r * k + j];
            h.iter_mut().for_each(|v| *v *= w);
        }
    });
    Ok(())
}

/// [`crate::graph::Op::ExpertDown`]: the SwiGLU outputs quantized, then every group's down product in one dispatch.
pub fn expert_down(pool: &Pool, sc: &mut Scratch, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let n = cx.batch.rows.len();
    let (d, ffn) = (c.d_model, c.expert_ffn);
    let shared = shared_expert(pool, cx, layer)?;
    let (gate_m, up_m, down_m) = (model.mat(lw.gate_exps), model.mat(lw.up_exps), model.mat(lw.down_exps));
    let kr = Kinds::new(pool, gate_m, up_m, down_m)?;
    let ms = &mut sc.moe;
    let routed = ms.routed;
    // Routed rows and shared rows may use different activation types.
    ms.hacts[0].prepare_par(pool, &kr.down, &sc.h1, RowAt::Strided { stride: ffn, off: 0 }, routed, ffn)?;
    if let Some((_, _, _, ks)) = &shared {
        ms.hacts[1].prepare_par(pool, &ks.down, &sc.h1, RowAt::Strided { stride: ffn, off: routed * ffn }, n, ffn)?;
    }
    let (groups, hacts, h1) = (&ms.groups, &ms.hacts, &sc.h1);
    let oe = Out::new(&mut sc.eo, d, 0);
    let product = |u: usize| {
        let s = groups[u];
        let (w, k, base, acts) = match (s.expert, shared) {
            (Some(e), _) => (down_m.rows_slice(e * d, d), kr.down, 0, &hacts[0]),
            (None, Some((_, _, dn, ks))) => (dn, ks.down, routed, &hacts[1]),
            (None, None) => unreachable!("shared group without shared weights"),
        };
        let input = acts.input(&k, &h1[base * ffn..], ffn, RowAt::Strided { stride: 1, off: s.start - base });
        Product { w, k, input, n: s.m, out: oe.shifted(s.start * d) }
    };
    // SAFETY: product `u` writes rows `start..start + m` of eo for its own group; groups do not overlap; eo outlives
    // the call and is not otherwise used during it.
    unsafe { run_group(pool, ms.groups.len(), d, grain_rows(down_m.row_bytes), &product) };
    Ok(())
}

/// [`crate::graph::Op::MoeCombine`]: routed contributions (weighted by the SwiGLU) in ascending expert id, then
/// the shared expert.
pub fn combine(sc: &mut Scratch, cx: &StepCtx<'_>) -> Result<()> {
    let c = &cx.model.config;
    let n = cx.batch.rows.len();
    let d = c.d_model;
    let ms = &sc.moe;
    let out = &mut sc.sub_out[..n * d];
    out.fill(0.0);
    for (i, &(r, _)) in ms.pick.iter().enumerate() {
        for (o, &v) in out[r * d..(r + 1) * d].iter_mut().zip(&sc.eo[i * d..(i + 1) * d]) {
            *o += v;
        }
    }
    if ms.shared {
        let routed = ms.routed;
        for (o, &v) in out.iter_mut().zip(&sc.eo[routed * d..(routed + n) * d]) {
            *o += v;
        }
    }
    Ok(())
}

/// Grows `v` to at least `len` values (never shrinks, so a smaller batch does not reallocate later).
fn grow(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// The kernels of one expert's three matrices.
#[derive(Clone, Copy)]
struct Kinds {
    gate: Kernel,
    up: Kernel,
    down: Kernel,
}

impl Kinds {
    fn new(pool: &Pool, g: Mat<'_>, u: Mat<'_>, dn: Mat<'_>) -> Result<Kinds> {
        Ok(Kinds {
            gate: Kernel::for_pool(pool, g.ty, g.cols)?,
            up: Kernel::for_pool(pool, u.ty, u.cols)?,
            down: Kernel::for_pool(pool, dn.ty, dn.cols)?,
        })
    }
}

/// Which `xacts` buffer holds activations for kernel `k` (one per quantized activation format; float kernels
/// read the f32 rows and never prepare one).
fn act_index(k: &Kernel) -> usize {
    match k.act_type() {
        ActType::Q8_0 => 1,
        ActType::Q8KPairs => 2,
        ActType::Q8K | ActType::F32 => 0,
    }
}

/// One expert of the grouped dispatch: rows `start..start + m` of h1/h3/eo (`expert: None` = the shared expert).
#[derive(Clone, Copy, Debug)]
pub struct ExpertGroup {
    expert: Option<usize>,
    start: usize,
    m: usize,
}

/// Buffers of the grouped MoE dispatch, grown to the largest batch seen and then reused (no allocation in decode).
/// The group rows themselves live in `Scratch::{idx, h1, h3, eo}` (batch row of every routed row; gate, up and down
/// outputs of every group row), grown here past their per-batch-row size to `(n_experts_used + 1) · n` rows.
#[derive(Debug, Default)]
pub struct MoeScratch {
    groups: Vec<ExpertGroup>,
    /// Routed group rows, whether the last group is the shared expert, and all group rows.
    routed: usize,
    shared: bool,
    total: usize,
    /// `(batch row, selection index)` of every routed row (for its routing weight).
    pick: Vec<(usize, usize)>,
    /// Normalized input quantized per activation type (Q8_K, Q8_0).
    xacts: [Acts; 3],
    /// SwiGLU outputs quantized for the routed downs and the shared down.
    hacts: [Acts; 2],
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineOptions};
    use crate::gguf::GgufFile;
    use crate::model::Model;

    /// All positions' logits of `tokens` on the demo model (8 routed experts, top 2, plus the shared expert), fed
    /// `chunk` tokens per tick.
    fn demo_logits(tokens: &[u32], chunk: usize, threads: usize) -> Vec<f32> {
        let file = GgufFile::from_bytes(crate::convert::demo::demo_model_gguf(7).unwrap()).unwrap();
        let opts = EngineOptions { threads, max_batch_tokens: chunk, ..EngineOptions::default() };
        let mut e = Engine::from_gguf(file, opts).unwrap();
        let s = e.create_session();
        e.set_prefill_logits(s, true).unwrap();
        e.feed(s, tokens).unwrap();
        e.run_until_idle().unwrap();
        e.take_all_logits(s).unwrap()
    }

    #[test]
    fn grouped_dispatch_is_batch_and_thread_invariant() {
        // One pass groups several rows per expert (m > 1 products); chunk 1 is decode (m = 1); 5 mixes both.
        let tokens: Vec<u32> = (0..14u32).map(|i| (i * 7919 + 11) % 129_000).collect();
        let want = demo_logits(&tokens, 256, 1);
        assert!(want.iter().all(|v| v.is_finite()));
        for (chunk, threads) in [(256usize, 3usize), (1, 2), (5, 3), (1, 1)] {
            let got = demo_logits(&tokens, chunk, threads);
            assert!(got == want, "chunk {chunk}, {threads} threads: logits differ from one pass on one thread");
        }
    }

    #[test]
    fn native_swiglu_override_is_placed_and_agrees_bit_for_bit() {
        let file = || GgufFile::from_bytes(crate::convert::demo::demo_model_gguf(7).unwrap()).unwrap();
        let tokens: Vec<u32> = (0..9u32).map(|i| (i * 104_729 + 3) % 129_000).collect();
        let run = |native: bool| {
            let opts = EngineOptions { threads: 2, max_batch_tokens: 4, ..EngineOptions::default() };
            let mut e = Engine::from_gguf(file(), opts).unwrap();
            e.use_native_kernels(native);
            let s = e.create_session();
            e.set_prefill_logits(s, true).unwrap();
            e.feed(s, &tokens).unwrap();
            e.run_until_idle().unwrap();
            (e.take_all_logits(s).unwrap(), e.last_placement(), e.placement_report())
        };
        let (with, placed, report) = run(true);
        let (without, plain, plain_report) = run(false);
        let layers = Model::load(file()).unwrap().config.n_layers;
        assert_eq!(placed.native, layers, "one SwiGLU node per layer goes to the override");
        assert_eq!(plain.native, 0);
        assert_eq!(placed.native + placed.portable, plain.portable, "every other node stays portable");
        assert_eq!(placed.staged, 0);
        assert!(with.iter().all(|v| v.is_finite()));
        assert!(with == without, "the override changes no logit bit");
        // The report names the override on exactly the SwiGLU nodes, keyed by the experts' weight type.
        let gate_ty = {
            let m = Model::load(file()).unwrap();
            crate::exec::weight_type(m.table.types[m.layers[0].gate_exps.0 as usize])
        };
        for n in &report.nodes {
            let swiglu = n.key.op == crate::graph::OpKind::SwiGlu;
            assert_eq!(n.kernel == "cpu-swiglu-x8", swiglu, "node {}", n.node);
            assert_eq!(n.backend, crate::backend::BackendKind::Cpu);
            if swiglu {
                assert_eq!(n.key.weight, Some(gate_ty));
            }
        }
        assert!(plain_report.nodes.iter().all(|n| n.kernel == "portable"));
        assert_eq!(report.placed, placed);
        assert_eq!(report.summary().iter().map(|l| l.1).sum::<usize>(), report.nodes.len());
        let text = report.to_string();
        assert!(text.starts_with("# placement on cpu:") && text.contains("cpu-swiglu-x8"), "{text}");
    }

    #[test]
    fn activations() {
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        let mut h1 = [20.0f32, -1.0];
        swiglu(&mut h1, &[5.0, -0.5], 1.5);
        assert!((h1[0] - silu(1.5) * 1.5).abs() < 1e-6);
        assert!((h1[1] - silu(-1.0) * -0.5).abs() < 1e-6);
    }
}
