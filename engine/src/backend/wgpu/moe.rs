//! The MoE kernels of the wgpu backend: [`route`], [`expert_up`], [`swiglu`], [`expert_down`], [`combine`] (the
//! nodes of [`crate::graph::Op`] of those names).
//!
//! The routed slot rows are laid out as the nodes say ([`Experts`], chosen by the recipe), and slot row `r·k + j`
//! is row `r`'s `j`-th choice either way; the expert ids stay on the device ([`super::moe_ids`]):
//! - [`Experts::PerRow`] (decode): every product picks its expert's weight rows by the device-side ids;
//! - [`Experts::ByExpert`] (prefill): the slot rows are grouped by expert into tiles on the device
//!   ([`moe_ids::group`], at the first expert product) and each expert's weights are read once per tile
//!   ([`moe_ids::matmul_tiles`], dispatched indirectly): nothing is read back.
//!
//! The routing weight multiplies the SwiGLU output (so the down product and the combine see weighted rows); the
//! combine sums each row's experts in ascending expert order, then adds the shared expert.

use std::sync::Arc;

use super::backend::WgpuBackend;
use super::context::{backend_err, Enc};
use super::matmul::{swiglu_pair, View};
use super::moe_ids;
use super::ops::{self, Routing};
use super::resident::{MoePlan, Tick};
use crate::backend::StepCtx;
use crate::graph::{BufId, Experts};
use crate::Result;

/// [`crate::graph::Op::MoeRoute`]: experts and weights into `Routes`, and the slot-row plan.
pub fn route(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    layer: usize,
    hash: bool,
    experts: Experts,
) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let rows = &cx.batch.rows;
    let n = rows.len();
    let (ne, k) = (c.n_experts, c.n_experts_used);
    let ctx = be.context();
    let (logits, sel, rw) =
        (be.buf(t, model, BufId::Router)?, be.buf(t, model, BufId::Routes)?, t.route_weights(ctx, model));
    let tid2eid = match (hash, &lw.tid2eid) {
        (true, Some(tt)) => Some(tt),
        (false, _) => None,
        (true, None) => return Err(backend_err(format!("moe layer {layer}: hash routing without tid2eid"))),
    };
    let bias;
    let (tid, toks);
    let routing = match (tid2eid, lw.gate_bias) {
        (Some(tt), _) => {
            tid = be.hash_table(layer, tt);
            toks = ctx.storage_u32("tokens", &rows.iter().map(|r| r.token).collect::<Vec<_>>());
            Routing::Hash { tid2eid: &tid, tokens: &toks }
        }
        (None, Some(b)) => {
            bias = be.dense(model, b);
            Routing::Learned { bias: &bias }
        }
        (None, None) => {
            bias = Arc::new(ctx.storage_zeroed("zero bias", ne));
            Routing::Learned { bias: &bias }
        }
    };
    ops::moe_route(ctx, t.enc(ctx), &logits, routing, n, ne, k, c.routed_scale, c.weights_norm, &sel, &rw)?;
    t.moe.shared = lw.gate_sh.is_some() && lw.up_sh.is_some() && lw.down_sh.is_some();
    // Slot row q = r·k + j carries routing weight q, in either layout.
    t.moe.weights.clear();
    t.moe.weights.extend(0..(n * k) as u32);
    t.moe.tiles = None;
    t.moe.layout = Some(experts);
    Ok(())
}

/// The tick's plan when it is laid out as `experts` (the layer's routing node ran), else an error.
fn planned(t: &Tick, experts: Experts, layer: usize) -> Result<()> {
    if t.moe.layout == Some(experts) {
        return Ok(());
    }
    Err(backend_err(format!("moe layer {layer}: expert rows not laid out {experts:?} (its routing node did not run)")))
}

/// The routed slot rows of one MoE layer, laid out as `experts` says.
struct ExpertGroups<'a> {
    experts: Experts,
    plan: &'a MoePlan,
    /// The selected experts (`[rows, k]`, on the device) and the number of slot rows (`rows · k`).
    sel: &'a wgpu::Buffer,
    n: usize,
}

/// The expert products of a layer, in the order of the grouping's indirect arguments ([`moe_ids::group`]).
const UP: usize = 0;
const UP_SECOND: usize = 1;
const DOWN: usize = 2;

impl ExpertGroups<'_> {
    /// Products of expert matrix `w` (`per` rows per expert) for every slot row `i` (row `i / x_div` of `x`, its
    /// expert by the selected id) into row `i` of `y`: per row, each slot reads its expert's rows; by expert, the
    /// tiles of the device grouping read each expert's rows once per tile (product `which` of its arguments).
    #[allow(clippy::too_many_arguments)]
    fn products(
        &self,
        ctx: &super::context::WgpuContext,
        enc: &mut Enc,
        w: &super::weights::GpuWeight,
        per: usize,
        x: View<'_>,
        x_div: usize,
        (y, which): (View<'_>, usize),
    ) -> Result<()> {
        match (self.experts, &self.plan.tiles) {
            (Experts::PerRow, _) => moe_ids::matmul_ids(ctx, enc, w, per, self.sel, self.n, x, x_div, y),
            (Experts::ByExpert, Some(tiles)) => moe_ids::matmul_tiles(ctx, enc, w, per, (tiles, which), x, x_div, y),
            (Experts::ByExpert, None) => Err(backend_err("moe: expert rows not grouped (no expert up product ran)")),
        }
    }
}

/// [`crate::graph::Op::ExpertUp`]: gate and up products of every slot row and of the shared expert.
pub fn expert_up(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, layer: usize, experts: Experts) -> Result<()> {
    planned(t, experts, layer)?;
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let n = cx.batch.rows.len();
    let (d, k, ffn) = (c.d_model, c.n_experts_used, c.expert_ffn);
    let ctx = be.context();
    let (xn, gu, sel) =
        (be.buf(t, model, BufId::Normed)?, be.buf(t, model, BufId::ExpertGate)?, be.buf(t, model, BufId::Routes)?);
    // Gate and up interleaved per expert: one product per expert (group) computes both halves of its rows.
    let pair = be.mat_pair(model, lw.gate_exps, lw.up_exps, ffn)?;
    let sh_pair = match (lw.gate_sh, lw.up_sh) {
        (Some(g), Some(u)) => be.mat_pair(model, g, u, model.mat(g).rows)?,
        _ => None,
    };
    let (sh_gu, _) = t.shared(ctx, model);
    let gv = View::new(&gu, 2 * ffn);
    let separate = match &pair {
        Some(_) => None,
        None => Some((be.mat_grouped(model, lw.gate_exps, ffn)?, be.mat_grouped(model, lw.up_exps, ffn)?)),
    };
    if experts == Experts::ByExpert {
        // Group the slot rows by expert on the device, planned for this layer's three expert products.
        let dm = be.mat_grouped(model, lw.down_exps, d)?;
        let up: [moe_ids::TiledProduct<'_>; 2] = match (&pair, &separate) {
            (Some(w), _) => [Some((w, 2 * ffn)), None],
            (None, Some((g, u))) => [Some((g, ffn)), Some((u, ffn))],
            (None, None) => return Err(backend_err(format!("moe layer {layer}: no gate and up weights"))),
        };
        let products = [up[0], up[1], Some((&*dm, d))];
        let tiles = moe_ids::group(ctx, t.enc(ctx), &sel, (n * k, c.n_experts), products)?;
        t.moe.tiles = Some(tiles);
    }
    let (enc, plan) = t.enc_moe(ctx);
    let x = View::new(&xn, d);
    let groups = ExpertGroups { experts, plan, sel: &sel, n: n * k };
    match (&pair, &separate) {
        (Some(gu_w), _) => groups.products(ctx, enc, gu_w, 2 * ffn, x, k, (gv, UP))?,
        (None, Some((gm, um))) => {
            groups.products(ctx, enc, gm, ffn, x, k, (gv, UP))?;
            groups.products(ctx, enc, um, ffn, x, k, (gv.at(ffn), UP_SECOND))?;
        }
        (None, None) => {}
    }
    let (xv, sv) = (View::new(&xn, d), View::new(&sh_gu, 2 * ffn));
    match (sh_pair, lw.gate_sh, lw.up_sh) {
        (Some(gu_w), ..) => be.mm(t.enc(ctx), &gu_w, xv, n, sv)?,
        (None, Some(g), Some(up)) => {
            let (g, up) = (be.mat(model, g)?, be.mat(model, up)?);
            let enc = t.enc(ctx);
            be.mm(enc, &g, xv, n, sv)?;
            be.mm(enc, &up, xv, n, sv.at(ffn))?;
        }
        _ => {}
    }
    Ok(())
}

/// [`crate::graph::Op::SwiGlu`]: the clamped SwiGLU of every slot row (times its routing weight) and of the shared
/// expert, written over the gate half.
pub fn swiglu(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
    // Either layout (the slot rows' routing weights are in the plan).
    planned(t, t.moe.layout.unwrap_or(Experts::ByExpert), layer)?;
    let model = cx.model;
    let c = &model.config;
    let n = cx.batch.rows.len();
    let (k, ffn) = (c.n_experts_used, c.expert_ffn);
    let limit = c.swiglu_limit[layer];
    let ctx = be.context();
    let (gu, rw) = (be.buf(t, model, BufId::ExpertGate)?, t.route_weights(ctx, model));
    let (sh_gu, _) = t.shared(ctx, model);
    let (enc, plan) = t.enc_moe(ctx);
    // The shared expert's rows in the same dispatch (its gate|up rows have the routed rows' strides).
    let shared = model.layers[layer].gate_sh.is_some().then_some((&sh_gu, n));
    let weights = Some((&rw, plan.weights.as_slice()));
    ops::swiglu(ctx, enc, &gu, 2 * ffn, ffn, (&gu, 0, 2 * ffn), ffn, n * k, limit, weights, shared)
}

/// [`crate::graph::Op::ExpertDown`]: down products of every slot row and of the shared expert.
pub fn expert_down(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, layer: usize, experts: Experts) -> Result<()> {
    planned(t, experts, layer)?;
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let n = cx.batch.rows.len();
    let (d, k, ffn) = (c.d_model, c.n_experts_used, c.expert_ffn);
    let ctx = be.context();
    let (gu, eo, sel) =
        (be.buf(t, model, BufId::ExpertGate)?, be.buf(t, model, BufId::ExpertOut)?, be.buf(t, model, BufId::Routes)?);
    let dm = be.mat_grouped(model, lw.down_exps, d)?;
    let (sh_gu, sh_out) = t.shared(ctx, model);
    let (enc, plan) = t.enc_moe(ctx);
    let groups = ExpertGroups { experts, plan, sel: &sel, n: n * k };
    groups.products(ctx, enc, &dm, d, View::new(&gu, 2 * ffn), 1, (View::new(&eo, d), DOWN))?;
    if let Some(dn) = lw.down_sh {
        let dn = be.mat(model, dn)?;
        be.mm(t.enc(ctx), &dn, View::new(&sh_gu, 2 * ffn), n, View::new(&sh_out, d))?;
    }
    Ok(())
}

/// [`crate::graph::Op::MoeCombine`]: `SublayerOut` = each row's expert outputs in ascending expert order, plus the
/// shared expert's.
pub fn combine(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, experts: Experts) -> Result<()> {
    planned(t, experts, usize::MAX)?;
    let model = cx.model;
    let c = &model.config;
    let n = cx.batch.rows.len();
    let (d, k) = (c.d_model, c.n_experts_used);
    let ctx = be.context();
    let (eo, sel, out) =
        (be.buf(t, model, BufId::ExpertOut)?, be.buf(t, model, BufId::Routes)?, be.buf(t, model, BufId::SublayerOut)?);
    let (_, sh_out) = t.shared(ctx, model);
    let (enc, plan) = t.enc_moe(ctx);
    // Either layout: slot row r·k + j holds row r's j-th choice.
    let shared = plan.shared.then_some(&sh_out);
    moe_ids::combine(ctx, enc, &eo, &sel, &out, shared, d, n, k)
}

/// [`crate::graph::Op::ExpertUp`] and [`crate::graph::Op::SwiGlu`] of a decode layout ([`Experts::PerRow`]) in one
/// step ([`super::fuse`]): the routed experts' gate + up + SwiGLU (times the routing weight) in one dispatch per
/// weight chunk (`gate_up_swiglu`), the shared expert's in one (`swiglu_pair`); bit for bit the two nodes. Where a
/// weight is not in the fused kernels' layout (gate and up of different types, a shared pair over one binding), the
/// two nodes run in turn.
pub fn expert_up_swiglu(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
    planned(t, Experts::PerRow, layer)?;
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let n = cx.batch.rows.len();
    let (d, k, ffn) = (c.d_model, c.n_experts_used, c.expert_ffn);
    let pair = be.mat_pair(model, lw.gate_exps, lw.up_exps, ffn)?;
    let shared = match (lw.gate_sh, lw.up_sh, lw.down_sh) {
        (None, None, None) => Some(None),
        (Some(g), Some(u), Some(_)) => {
            be.mat_pair(model, g, u, model.mat(g).rows)?.filter(|w| w.chunks.len() == 1 && w.rows == 2 * ffn).map(Some)
        }
        _ => None,
    };
    let (Some(pair), Some(shared)) = (pair, shared) else {
        expert_up(be, t, cx, layer, Experts::PerRow)?;
        return swiglu(be, t, cx, layer);
    };
    let ctx = be.context();
    let (xn, gu, sel) =
        (be.buf(t, model, BufId::Normed)?, be.buf(t, model, BufId::ExpertGate)?, be.buf(t, model, BufId::Routes)?);
    let rw = t.route_weights(ctx, model);
    let (sh_gu, _) = t.shared(ctx, model);
    let limit = c.swiglu_limit[layer];
    let (x, enc) = (View::new(&xn, d), t.enc(ctx));
    moe_ids::gate_up_swiglu(ctx, enc, &pair, ffn, (&sel, &rw), n * k, x, k, View::new(&gu, 2 * ffn), limit)?;
    match shared {
        Some(sw) => swiglu_pair(ctx, enc, &sw, x, n, View::new(&sh_gu, 2 * ffn), limit),
        None => Ok(()),
    }
}

/// [`crate::graph::Op::ExpertDown`] and [`crate::graph::Op::MoeCombine`] of a decode layout ([`Experts::PerRow`])
/// in one step ([`super::fuse`]): the shared expert's down product, then the routed down products and the sum over
/// each row's experts in one dispatch per weight chunk (`down_combine`, no atomics); bit for bit the two nodes.
pub fn expert_down_combine(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
    planned(t, Experts::PerRow, layer)?;
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let n = cx.batch.rows.len();
    let (d, k, ffn) = (c.d_model, c.n_experts_used, c.expert_ffn);
    let dm = be.mat_grouped(model, lw.down_exps, d)?;
    let ctx = be.context();
    let (gu, sel, out) =
        (be.buf(t, model, BufId::ExpertGate)?, be.buf(t, model, BufId::Routes)?, be.buf(t, model, BufId::SublayerOut)?);
    let (sh_gu, sh_out) = t.shared(ctx, model);
    let shared = match lw.down_sh.filter(|_| t.moe.shared) {
        Some(dn) => {
            let dn = be.mat(model, dn)?;
            be.mm(t.enc(ctx), &dn, View::new(&sh_gu, 2 * ffn), n, View::new(&sh_out, d))?;
            Some(&sh_out)
        }
        None => None,
    };
    let h = View::new(&gu, 2 * ffn);
    moe_ids::down_combine(ctx, t.enc(ctx), &dm, d, &sel, (n, k), h, &out, shared)
}
