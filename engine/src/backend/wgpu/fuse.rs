//! Fusion of consecutive graph nodes into one dispatch (a peephole over the recipe's order; the graph stays fine).
//!
//! A dispatch costs tens of microseconds on Vulkan and Metal whatever it computes, so the small nodes of a decode
//! tick cost more than their work. wgpu sees the tick's nodes one by one in recipe order; a node that can open a
//! fused pair is *held* ([`hold`]) instead of recorded, and the next node either completes the pair ([`fused`]:
//! one dispatch for both) or the held node is recorded alone first ([`run_alone`]). Anything else that touches the
//! tick (a residency copy, the tick's end) records a held node first, so the recorded order of effects is always
//! the graph's.
//!
//! The pairs (each fused kernel does the same f32 operations as the two kernels in turn, so results are theirs bit
//! for bit — tested in `ops_tests`):
//! - the mHC weights ([`Op::HcSinkhorn`], [`Op::HcHeadWeights`]) and [`Op::HcCollapse`]: `hc.wgsl`'s
//!   `weights_collapse`; and with the [`Op::RmsNorm`] of what it collapsed that follows (the sublayer's input norm,
//!   the head's final norm), three nodes in one dispatch: `weights_collapse_norm`;
//! - an [`Op::RmsNorm`] and the forward [`Op::Rope`] of the tensor it wrote, with the same row shape (the query
//!   heads, the KV row): `norm.wgsl`'s `norm_rope`; and with the KV row's FP8 simulation ([`Op::ActSim`],
//!   `Fp8NoRope`) that follows, three nodes in one dispatch;
//! - a forward [`Op::Rope`] and the Hadamard + FP4 simulation of what it rotated (the indexer queries):
//!   `act.wgsl`'s `rope_hadamard_fp4`;
//! - [`Op::SparseAttention`] and the inverse [`Op::Rope`] of its output: `attention.wgsl`'s `keyed` with the
//!   rotation in its output loop;
//! - [`Op::HcPost`] and the unweighted [`Op::RmsNorm`] of the new streams that opens the next sublayer (or the
//!   head): `hc.wgsl`'s `post_norm`;
//! - in decode (experts laid out per row), [`Op::ExpertUp`] and [`Op::SwiGlu`]: the routed experts' gate + up +
//!   SwiGLU × routing weight in one dispatch (`matmul_ids.wgsl`'s `gate_up_swiglu`), the shared expert's in one
//!   (`matmul.wgsl`'s `swiglu_pair`); and [`Op::ExpertDown`] and [`Op::MoeCombine`]: the shared down product, then
//!   the routed down products summed over each row's experts in one dispatch (`down_combine`, no atomics);
//! - [`Op::Embed`] and the unweighted [`Op::RmsNorm`] of the new streams: `get_rows.wgsl`'s `embed_norm`;
//! - the [`Op::Scale`] of the indexer's head weights and the [`Op::IndexerTopK`] that reads them: the scores kernel
//!   multiplies each weight as it reads it (the f32 product the scale would have stored). The scale is not
//!   adjacent to its pair (the compressor pushes come between), so it *waits* ([`waits`]) over nodes that neither
//!   read nor write the weights, each recorded alone meanwhile.
//!
//! Apart from pairs, the weight products the executor finds ready together ([`crate::backend::Backend::run_group`]:
//! the projections of one normed input — `wq_a`, `wkv`, the compressor's and the indexer's) go through
//! [`products`]: those of one input whose weights share a type and width are one dispatch
//! ([`super::matmul::multi_product`], their weights uploaded as one matrix), each value bit for bit its own
//! product's.

use ds4_shaders_wgsl as sh;
use ds4_shaders_wgsl::pair::PairKernel;
use ds4_shaders_wgsl::params::{ActParams, NormParams};

use super::backend::WgpuBackend;
use super::context::{backend_err, WgpuContext};
use super::matmul::{multi_product, u32_of, View, MULTI_OUTPUTS};
use super::ops::grid2;
use super::pairs::Use;

use super::context::Enc;
type Buf = wgpu::Buffer;
use super::resident::Tick;
use super::{attn, moe, rows};
use crate::backend::StepCtx;
use crate::graph::{BufId, Experts, Op, SimKind, Sub};
use crate::model::WeightId;
use crate::Result;

/// A node waiting for its successor (see the module docs).
#[derive(Clone, Copy, Debug)]
pub enum Held {
    /// The mHC weights of a sublayer (`Some((layer, sub))`, [`Op::HcSinkhorn`]) or of the output head (`None`).
    Weights(Option<(usize, Sub)>),
    /// An [`Op::RmsNorm`].
    Norm { x: BufId, y: BufId, w: Option<WeightId>, width: usize, heads: usize },
    /// An [`Op::HcPost`].
    Post,
    /// An [`Op::SparseAttention`].
    Attention { layer: usize },
    /// A forward [`Op::Rope`] alone.
    Rope { x: BufId, layer: usize, width: usize, heads: usize },
    /// An [`Op::RmsNorm`] and the forward [`Op::Rope`] of `y` (already paired, waiting for an FP8 simulation of `y`).
    NormRope { x: BufId, y: BufId, w: Option<WeightId>, width: usize, heads: usize, layer: usize },
    /// The mHC weights and the [`Op::HcCollapse`] into `out` (already paired, waiting for a norm of `out`).
    WeightsCollapse { of: Option<(usize, Sub)>, out: BufId },
    /// An [`Op::ExpertUp`] laid out per row (decode).
    Up { layer: usize },
    /// An [`Op::ExpertDown`] laid out per row (decode).
    Down { layer: usize },
    /// An [`Op::Embed`].
    Embed,
    /// An [`Op::Scale`] of the indexer's head weights (it waits for the [`Op::IndexerTopK`] that reads them).
    IdxScale { width: usize, factor: f32 },
}

/// Whether `op` opens a fused pair: then it is held instead of recorded.
pub fn hold(op: &Op) -> Option<Held> {
    match *op {
        Op::HcSinkhorn { layer, sub } => Some(Held::Weights(Some((layer, sub)))),
        Op::HcHeadWeights => Some(Held::Weights(None)),
        Op::RmsNorm { x, y, w, width, heads } => Some(Held::Norm { x, y, w, width, heads }),
        Op::HcPost => Some(Held::Post),
        Op::SparseAttention { layer } => Some(Held::Attention { layer }),
        Op::Rope { x, layer, width, heads, inverse: false } => Some(Held::Rope { x, layer, width, heads }),
        Op::ExpertUp { layer, experts: Experts::PerRow } => Some(Held::Up { layer }),
        Op::ExpertDown { layer, experts: Experts::PerRow } => Some(Held::Down { layer }),
        Op::Scale { x: BufId::IdxW, width, factor } => Some(Held::IdxScale { width, factor }),
        Op::Embed => Some(Held::Embed),
        _ => None,
    }
}

/// Records `held` and `next` as one dispatch when they form a pair; `false` (nothing recorded) otherwise.
pub fn fused(be: &WgpuBackend, t: &mut Tick, cx: &mut StepCtx<'_>, held: Held, next: &Op) -> Result<bool> {
    match (held, *next) {
        (Held::Weights(of), Op::HcCollapse { out }) => {
            // Held in turn: the norm of what it collapsed usually follows.
            t.held = Some(Held::WeightsCollapse { of, out });
            Ok(true)
        }
        (Held::WeightsCollapse { of, out }, Op::RmsNorm { x, y, w, width, heads: 1 })
            if x == out && width == cx.model.config.d_model =>
        {
            rows::hc_weights_collapse(be, t, cx, of, out, Some((y, w)))?;
            Ok(true)
        }
        (Held::Norm { x, y, w, width, heads }, Op::Rope { x: rx, layer, width: rw, heads: rh, inverse: false })
            if rx == y && rw == width && rh == heads && norm_rope_fits(cx, width) =>
        {
            // Held in turn: the KV row's FP8 simulation usually follows.
            t.held = Some(Held::NormRope { x, y, w, width, heads, layer });
            Ok(true)
        }
        (
            Held::NormRope { x, y, w, width, heads, layer },
            Op::ActSim { x: ax, width: aw, heads: ah, kind: SimKind::Fp8NoRope },
        ) if ax == y && aw == width && ah == heads => {
            norm_rope(be, t, cx, (x, y), w, width, heads, layer, true)?;
            Ok(true)
        }
        (Held::Post, Op::RmsNorm { x: BufId::Streams, y, w: None, width, heads: 1 })
            if y != BufId::Streams
                && width == cx.model.config.hc_dim()
                && cx.model.config.d_model.is_multiple_of(64) =>
        {
            rows::hc_post(be, t, cx, Some(y))?;
            Ok(true)
        }
        (
            Held::Rope { x, layer, width, heads },
            Op::ActSim { x: ax, width: aw, heads: ah, kind: SimKind::HadamardFp4 },
        ) if ax == x && aw == width && ah == heads && width.is_power_of_two() && width <= 1024 => {
            rope_hadamard_fp4(be, t, cx, x, layer, width, heads)?;
            Ok(true)
        }
        (Held::Attention { layer }, Op::Rope { x: BufId::AttnOut, layer: rl, width, heads, inverse: true })
            if rl == layer && width == cx.model.config.head_dim && heads == cx.model.config.n_heads =>
        {
            attn::sparse_attention(be, t, &mut be.device_kv(), cx, layer, true)?;
            Ok(true)
        }
        (Held::Up { layer }, Op::SwiGlu { layer: l }) if l == layer => {
            moe::expert_up_swiglu(be, t, cx, layer)?;
            Ok(true)
        }
        (Held::Down { layer }, Op::MoeCombine { experts: Experts::PerRow }) => {
            moe::expert_down_combine(be, t, cx, layer)?;
            Ok(true)
        }
        (Held::Embed, Op::RmsNorm { x: BufId::Streams, y, w: None, width, heads: 1 })
            if y != BufId::Streams && width == cx.model.config.hc_dim() =>
        {
            rows::embed(be, t, cx, Some(y))?;
            Ok(true)
        }
        (Held::IdxScale { width, factor }, Op::IndexerTopK { layer }) if width == cx.model.config.idx_heads => {
            attn::indexer_topk(be, t, &mut be.device_kv(), cx, layer, factor)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Records `held` alone (its successor does not pair with it, or something else needs the tick in order).
pub fn run_alone(be: &WgpuBackend, t: &mut Tick, cx: &mut StepCtx<'_>, held: Held) -> Result<()> {
    match held {
        Held::Weights(Some((layer, sub))) => rows::hc_sinkhorn(be, t, cx, layer, sub),
        Held::Weights(None) => rows::hc_head_weights(be, t, cx),
        Held::Norm { x, y, w, width, heads } => rows::rms_norm(be, t, cx, x, y, w, width, heads),
        Held::NormRope { x, y, w, width, heads, layer } => norm_rope(be, t, cx, (x, y), w, width, heads, layer, false),
        Held::Post => rows::hc_post(be, t, cx, None),
        Held::Attention { layer } => attn::sparse_attention(be, t, &mut be.device_kv(), cx, layer, false),
        Held::Rope { x, layer, width, heads } => rows::rope(be, t, cx, x, layer, width, heads, false),
        Held::WeightsCollapse { of, out } => rows::hc_weights_collapse(be, t, cx, of, out, None),
        Held::Up { layer } => moe::expert_up(be, t, cx, layer, Experts::PerRow),
        Held::Down { layer } => moe::expert_down(be, t, cx, layer, Experts::PerRow),
        Held::IdxScale { width, factor } => rows::scale(be, t, cx, BufId::IdxW, width, factor),
        Held::Embed => rows::embed(be, t, cx, None),
    }
}

/// Products that can share a dispatch: one input, one weight type, one width.
type ProductClass = (BufId, crate::quant::GgmlType, usize);

/// The weight products of a group ready together ([`crate::backend::Backend::run_group`]): products of one input by
/// weights of one type and width are recorded as one dispatch each [`MULTI_OUTPUTS`] (see the module docs). Returns
/// the ops left to run one by one (other ops, lone products, weights that do not fit one binding together).
pub fn products(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, ops: &[Op]) -> Result<Vec<Op>> {
    let model = cx.model;
    let mut singles = Vec::new();
    // By (input, weight type, width), in the order first seen.
    let mut classes: Vec<(ProductClass, Vec<(WeightId, BufId)>)> = Vec::new();
    for op in ops {
        let Op::MatMul { w, x, y } = *op else {
            singles.push(*op);
            continue;
        };
        let m = model.mat(w);
        let key = (x, m.ty, m.cols);
        match classes.iter_mut().find(|c| c.0 == key) {
            Some(c) => c.1.push((w, y)),
            None => classes.push((key, vec![(w, y)])),
        }
    }
    for ((x, ..), list) in classes {
        for part in list.chunks(MULTI_OUTPUTS) {
            if part.len() == 1 || !multi(be, t, cx, x, part)? {
                singles.extend(part.iter().map(|&(w, y)| Op::MatMul { w, x, y }));
            }
        }
    }
    Ok(singles)
}

/// Records the products `x · w → y` of `part` as one dispatch; `false` (nothing recorded) when their weights do not
/// fit one binding together.
fn multi(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, x: BufId, part: &[(WeightId, BufId)]) -> Result<bool> {
    let model = cx.model;
    let ids: Vec<WeightId> = part.iter().map(|p| p.0).collect();
    let Some(w) = be.mat_multi(model, &ids)? else { return Ok(false) };
    let ends: Vec<usize> = ids
        .iter()
        .scan(0, |end, &id| {
            *end += model.mat(id).rows;
            Some(*end)
        })
        .collect();
    let xb = be.buf(t, model, x)?;
    let ys = part.iter().map(|&(_, y)| be.buf(t, model, y)).collect::<Result<Vec<_>>>()?;
    let ys: Vec<&Buf> = ys.iter().collect();
    let ctx = be.context();
    multi_product(ctx, t.enc(ctx), &w, &ends, View::new(&xb, w.cols), cx.batch.rows.len(), &ys)?;
    Ok(true)
}

/// Whether `held` keeps waiting while `next` is recorded alone: the indexer weights' scale waits over the nodes
/// between it and the indexer (the compressor pushes), which neither read nor write the weights and hold nothing
/// themselves. Host syncs (readbacks, taps) record it first.
pub fn waits(held: &Held, next: &Op) -> bool {
    let Held::IdxScale { .. } = held else { return false };
    if hold(next).is_some() || matches!(next, Op::Readback { .. } | Op::TapStreams { .. } | Op::IndexerTopK { .. }) {
        return false;
    }
    let (mut reads, mut writes) = (false, false);
    next.access(|b| reads |= b == BufId::IdxW, |b| writes |= b == BufId::IdxW);
    !reads && !writes
}

fn norm_rope_fits(cx: &StepCtx<'_>, width: usize) -> bool {
    let rd = cx.model.config.rope_dim;
    rd > 0 && rd.is_multiple_of(2) && rd <= width
}

#[allow(clippy::too_many_arguments)]
fn norm_rope(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    (x, y): (BufId, BufId),
    w: Option<WeightId>,
    width: usize,
    heads: usize,
    layer: usize,
    fp8: bool,
) -> Result<()> {
    let model = cx.model;
    let ctx = be.context();
    let (xb, yb) = (be.buf(t, model, x)?, be.buf(t, model, y)?);
    let g = w.map(|w| be.dense(model, w));
    let cs = t.rope(ctx, cx, layer);
    let rows = cx.batch.rows.len() * heads;
    let (rope_dim, eps) = (model.config.rope_dim, model.config.rms_eps);
    let shape = NormRope { width, rows, heads, rope_dim, eps, fp8_block: if fp8 { 64 } else { 0 } };
    norm_rope_kernel(ctx, t.enc(ctx), (&xb, &yb), g.as_deref(), &cs, shape)
}

// The fused kernels' recorders.

/// The forward rope of `x` (`heads` rows of `width` per token) and its Hadamard + FP4 simulation (the indexer
/// queries) in one dispatch: `act.wgsl`'s `rope_hadamard_fp4`.
fn rope_hadamard_fp4(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    x: BufId,
    layer: usize,
    width: usize,
    heads: usize,
) -> Result<()> {
    let rows = cx.batch.rows.len() * heads;
    let rope_dim = cx.model.config.rope_dim;
    if !rope_dim.is_multiple_of(2) || rope_dim > width || heads == 0 {
        return Err(backend_err(format!("rope_hadamard_fp4: rope_dim {rope_dim} of rows of {width} ({heads} heads)")));
    }
    if rows == 0 {
        return Ok(());
    }
    let ctx = be.context();
    let xb = be.buf(t, cx.model, x)?;
    let cs = t.rope(ctx, cx, layer);
    let p = ActParams {
        rows: u32_of(rows, "rows")?,
        n: u32_of(width, "width")?,
        stride: u32_of(width, "stride")?,
        block: 32,
        heads: u32_of(heads, "heads")?,
        rope_dim: u32_of(rope_dim, "rope_dim")?,
        _p0: 0,
        _p1: 0,
    };
    let pl = ctx.pipeline_entry("act", sh::ACT, "rope_hadamard_fp4")?;
    let ub = ctx.uniform("rope hadamard fp4", &p);
    ctx.dispatch_at(t.enc(ctx), &pl, &[(0, &xb), (1, &ub), (2, &cs)], [p.rows, 1, 1])
}

/// Shape of a fused RMSNorm + RoPE ([`norm_rope_kernel`]): `rows` rows of `width` values, `heads` rows per token, rope on
/// the last `rope_dim` values of each row.
#[derive(Clone, Copy, Debug)]
pub struct NormRope {
    pub width: usize,
    pub rows: usize,
    pub heads: usize,
    pub rope_dim: usize,
    pub eps: f32,
    /// When not 0: the FP8 simulation (`ActSim::Fp8NoRope`) of the values before the rope slice, in blocks of this
    /// many.
    pub fp8_block: usize,
}

/// Records `norm.wgsl`'s `norm_rope`: [`super::ops::rms_norm`] of rows of `x` into `y` (contiguous rows), then the forward
/// [`super::ops::rope`] of `y` with the tick's table `cs`, in one dispatch (bit for bit the two in turn).
pub fn norm_rope_kernel(
    ctx: &WgpuContext,
    enc: &mut Enc,
    (x, y): (&Buf, &Buf),
    g: Option<&Buf>,
    cs: &Buf,
    s: NormRope,
) -> Result<()> {
    if s.rope_dim == 0 || !s.rope_dim.is_multiple_of(2) || s.rope_dim > s.width || s.heads == 0 {
        return Err(backend_err(format!(
            "norm_rope: rope_dim {} of rows of {} ({} heads)",
            s.rope_dim, s.width, s.heads
        )));
    }
    if s.rows == 0 {
        return Ok(());
    }
    let (gx, gy) = grid2(s.rows);
    let w = u32_of(s.width, "width")?;
    let p = NormParams {
        n: w,
        rows: u32_of(s.rows, "rows")?,
        x_offset: 0,
        x_stride: w,
        y_offset: 0,
        y_stride: w,
        has_weight: g.is_some() as u32,
        grid_x: gx,
        eps: s.eps,
        heads: u32_of(s.heads, "heads")?,
        rope_dim: u32_of(s.rope_dim, "rope_dim")?,
        fp8_block: u32_of(s.fp8_block, "fp8 block")?,
    };
    let u = ctx.uniform("norm_rope", &p);
    let gb = g.unwrap_or(ctx.zeros());
    // Held to pair with an independent norm + rope recorded next (the query heads' and the KV row's).
    let bound = [(0, x, Use::ReadInRw), (1, y, Use::Write), (2, gb, Use::Read), (3, &u, Use::Read), (4, cs, Use::Read)];
    ctx.dispatch_pairable(enc, PairKernel::NORM_ROPE, ("rms_norm", "norm_rope"), &bound, [gx, gy, 1])
}

#[cfg(test)]
mod tests {
    use super::super::context::test_context;
    use super::super::fallback_tests::{demo, ticks};
    use super::super::WgpuBackend;
    use super::MULTI_OUTPUTS;
    use crate::exec::Executor;
    use crate::graph::{BufId, Experts, Op, SimKind};

    /// On the demo model (CSA, HCA and window layers, simulation on), a prefill and decode ticks give the same
    /// logits bit for bit with fusion on and off, and fusion saves exactly one dispatch per pair the recipe holds:
    /// each sublayer's and the head's mHC weights + collapse + norm (two pairs), each norm followed by the rope of
    /// what it wrote and the KV row's FP8 simulation after them, each mHC post followed by the norm of the new
    /// streams (and the embedding followed by it), each decode MoE's up + SwiGLU and down + combine, each indexer weights' scale + the indexer; and two
    /// for each indexer query's rope + Hadamard + FP4 (three kernels). The weight products ready
    /// together (the executor's groups) take one dispatch per input, weight type and width, not one each.
    /// The tensor normed and roped in place by `ops[i]` and `ops[i + 1]` when they fuse into one `norm_rope`.
    fn norm_rope_at(ops: &[Op], i: usize) -> Option<BufId> {
        match (ops.get(i)?, ops.get(i + 1)?) {
            (&Op::RmsNorm { y, width, heads, .. }, &Op::Rope { x, width: rw, heads: rh, inverse: false, .. })
                if x == y && rw == width && rh == heads =>
            {
                Some(y)
            }
            _ => None,
        }
    }

    #[test]
    fn fused_pairs_give_the_unfused_results_bit_for_bit_in_fewer_dispatches() {
        let Some(ctx) = test_context(Default::default()) else { return };
        let model = demo();
        let be = WgpuBackend::with_context(ctx);
        let run = |on: bool| {
            be.set_fusion(on);
            let mut ex = Executor::default();
            let (mut dispatches, mut pairs, mut groups) = (Vec::new(), Vec::new(), Vec::new());
            let mut before = be.context().counters();
            let logits = ticks(&model, &be, None, &mut ex, 9, 2, |g, ex| {
                let now = be.context().counters();
                dispatches.push((now - before).dispatches);
                before = now;
                let ops: Vec<Op> = g.nodes.iter().map(|n| n.op).collect();
                // Dispatches each adjacent pair saves: one, and two for the indexer query's rope + Hadamard + FP4
                // (the simulation is two kernels).
                let n: u64 = ops
                    .windows(2)
                    .map(|w| match (w[0], w[1]) {
                        (Op::HcSinkhorn { .. } | Op::HcHeadWeights, Op::HcCollapse { .. }) => 1,
                        (Op::RmsNorm { y, width, heads, .. }, Op::Rope { x, width: rw, heads: rh, inverse, .. }) => {
                            (x == y && rw == width && rh == heads && !inverse) as u64
                        }
                        (Op::HcPost | Op::Embed, Op::RmsNorm { x: BufId::Streams, w: None, .. }) => 1,
                        (Op::SparseAttention { .. }, Op::Rope { x: BufId::AttnOut, inverse: true, .. }) => 1,
                        (Op::ExpertUp { experts: Experts::PerRow, .. }, Op::SwiGlu { .. }) => 1,
                        (Op::ExpertDown { experts: Experts::PerRow, .. }, Op::MoeCombine { .. }) => 1,
                        (Op::HcCollapse { out }, Op::RmsNorm { x, heads: 1, .. }) => (x == out) as u64,
                        (
                            Op::Rope { x, width, heads, inverse: false, .. },
                            Op::ActSim { x: ax, width: aw, heads: ah, kind },
                        ) if x == ax && width == aw && heads == ah => match kind {
                            SimKind::Fp8NoRope => 1,
                            SimKind::HadamardFp4 => 2,
                        },
                        _ => 0,
                    })
                    .sum::<u64>()
                    // The indexer weights' scale, fused into the indexer that reads them.
                    + ops.iter().filter(|o| matches!(o, Op::Scale { x: BufId::IdxW, .. })).count() as u64
                    // Two independent norm + rope dispatches in a row: one (`pairs.rs`). Products of the normed
                    // input between them ran earlier, grouped with the first of them (`wkv` with `wq_a`).
                    + (0..ops.len())
                        .filter(|&i| {
                            let mut j = i + 2;
                            while matches!(ops.get(j), Some(Op::MatMul { x: BufId::Normed, .. })) {
                                j += 1;
                            }
                            matches!((norm_rope_at(&ops, i), norm_rope_at(&ops, j)), (Some(a), Some(b)) if a != b)
                        })
                        .count() as u64;
                // Products of one input, type and width ready together: one dispatch each MULTI_OUTPUTS.
                let mut grouped = 0;
                ex.run_groups_with(g, |_, ops| {
                    let mut classes: Vec<(BufId, crate::quant::GgmlType, usize, usize)> = Vec::new();
                    for op in ops {
                        let &Op::MatMul { w, x, .. } = op else { continue };
                        let m = model.mat(w);
                        match classes.iter_mut().find(|c| (c.0, c.1, c.2) == (x, m.ty, m.cols)) {
                            Some(c) => c.3 += 1,
                            None => classes.push((x, m.ty, m.cols, 1)),
                        }
                    }
                    grouped += classes.iter().map(|c| c.3 - c.3.div_ceil(MULTI_OUTPUTS)).sum::<usize>() as u64;
                    Ok(())
                })
                .unwrap();
                pairs.push(n);
                groups.push(grouped);
            })
            .unwrap();
            (logits, dispatches, pairs, groups)
        };
        let (plain, d_plain, ..) = run(false);
        let (fused, d_fused, pairs, groups) = run(true);
        let bits =
            |v: &Vec<Vec<f32>>| v.iter().map(|l| l.iter().map(|f| f.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
        assert_eq!(bits(&fused), bits(&plain), "fused kernels changed the logits");
        assert!(pairs.iter().all(|&p| p as usize > 2 * model.config.n_layers), "pairs per tick: {pairs:?}");
        // The demo's attention projections of the normed input share a type: some group saves dispatches.
        assert!(groups.iter().all(|&g| g > 0), "grouped products saved nothing: {groups:?}");
        for (t, ((a, b), (p, g))) in d_plain.iter().zip(&d_fused).zip(pairs.iter().zip(&groups)).enumerate() {
            assert_eq!(a - b, p + g, "tick {t}: {a} dispatches unfused, {b} fused, {p} pairs, {g} by grouping");
        }
    }
}
