//! The row kernels of [`super::WgpuBackend`]: embedding, RMSNorm, weight products, RoPE, activation simulation,
//! scaling, the mHC nodes, the logits and the readback. Each records the dispatches of one node
//! ([`crate::graph::Op`], whose docs give the math) over the tick's tensor buffers (`super::resident`); only
//! [`readback`] submits.

use ds4_shaders_wgsl as sh;
use ds4_shaders_wgsl::params::{CandParams, HcParams, ScaleParams};

use super::backend::WgpuBackend;
use super::context::{backend_err, Enc, WgpuContext};
use super::matmul::{embed_norm, get_rows, grouped_matmul as grouped_product, u32_of, View};
use super::ops::{self, ActSim, RopeShape};
use super::resident::Tick;
use crate::backend::StepCtx;
use crate::graph::{BufId, SimKind, Sub};
use crate::model::WeightId;
use crate::Result;

/// [`crate::graph::Op::Embed`]: the token's embedding row into every stream.
///
/// With `normed`, the unweighted [`crate::graph::Op::RmsNorm`] of the new streams into it that follows runs in the
/// same dispatch ([`super::fuse`]).
pub fn embed(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, normed: Option<BufId>) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let (hc, d) = (c.hc_mult, c.d_model);
    let emb = be.mat(model, model.global.embed)?;
    if let Some(normed) = normed {
        let tokens: Vec<usize> = cx.batch.rows.iter().map(|r| r.token as usize).collect();
        t.reset_streams();
        let (out, nb) = (be.buf(t, model, BufId::Streams)?, be.buf(t, model, normed)?);
        let ctx = be.context();
        return embed_norm(ctx, t.enc(ctx), &emb, &tokens, hc, (&out, &nb), c.rms_eps);
    }
    // Row r's stream j is output row r·hc + j of width d: every copy in one gather.
    let ids: Vec<(usize, usize)> = cx
        .batch
        .rows
        .iter()
        .enumerate()
        .flat_map(|(r, row)| (0..hc).map(move |j| (row.token as usize, r * hc + j)))
        .collect();
    t.reset_streams();
    let out = be.buf(t, model, BufId::Streams)?;
    let enc = t.enc(be.context());
    get_rows(be.context(), enc, &emb, &ids, View::new(&out, d))
}

/// [`crate::graph::Op::RmsNorm`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    x: BufId,
    y: BufId,
    w: Option<WeightId>,
    width: usize,
    heads: usize,
) -> Result<()> {
    let model = cx.model;
    let (xb, yb) = (be.buf(t, model, x)?, be.buf(t, model, y)?);
    let g = w.map(|w| be.dense(model, w));
    let n = cx.batch.rows.len() * heads;
    let ctx = be.context();
    ops::rms_norm(ctx, t.enc(ctx), (&xb, 0, width), (&yb, 0, width), g.as_deref(), width, n, model.config.rms_eps)
}

/// [`crate::graph::Op::MatMul`].
pub fn matmul(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, w: WeightId, x: BufId, y: BufId) -> Result<()> {
    let model = cx.model;
    let wm = be.mat(model, w)?;
    let (xb, yb) = (be.buf(t, model, x)?, be.buf(t, model, y)?);
    let enc = t.enc(be.context());
    be.mm(enc, &wm, View::new(&xb, wm.cols), cx.batch.rows.len(), View::new(&yb, wm.rows))
}

/// [`crate::graph::Op::GroupedMatMul`]: group `g` multiplies its slice of each row by its `rank` rows of `w`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    w: WeightId,
    x: BufId,
    y: BufId,
    groups: usize,
    rank: usize,
) -> Result<()> {
    let model = cx.model;
    let wm = be.mat(model, w)?;
    if wm.rows != groups * rank {
        return Err(backend_err(format!("grouped matmul {}: {} rows for {groups} groups of {rank}", wm.name, wm.rows)));
    }
    let (xb, yb) = (be.buf(t, model, x)?, be.buf(t, model, y)?);
    let n = cx.batch.rows.len();
    let ctx = be.context();
    let (xv, yv) = (View::new(&xb, groups * wm.cols), View::new(&yb, groups * rank));
    grouped_product(ctx, t.enc(ctx), &wm, rank, xv, n, yv)
}

/// [`crate::graph::Op::Rope`] at the batch positions (the tick's table of the layer's rope).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    x: BufId,
    layer: usize,
    width: usize,
    heads: usize,
    inverse: bool,
) -> Result<()> {
    let ctx = be.context();
    let xb = be.buf(t, cx.model, x)?;
    let cs = t.rope(ctx, cx, layer);
    let shape = RopeShape {
        n_tok: cx.batch.rows.len(),
        heads,
        head_dim: width,
        rope_dim: cx.model.config.rope_dim,
        offset: 0,
        tok_stride: heads * width,
        head_stride: width,
    };
    ops::rope(ctx, t.enc(ctx), &xb, &cs, shape, inverse)
}

/// [`crate::graph::Op::ActSim`].
pub fn act_sim(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    x: BufId,
    width: usize,
    heads: usize,
    kind: SimKind,
) -> Result<()> {
    let ctx = be.context();
    let xb = be.buf(t, cx.model, x)?;
    let rows = cx.batch.rows.len() * heads;
    let enc = t.enc(ctx);
    match kind {
        SimKind::Fp8NoRope => {
            let rd = cx.model.config.rope_dim;
            ops::act_sim(ctx, enc, &xb, ActSim::Fp8, rows, width.saturating_sub(rd), width, 64)
        }
        SimKind::HadamardFp4 => {
            ops::act_sim(ctx, enc, &xb, ActSim::Hadamard, rows, width, width, 0)?;
            ops::act_sim(ctx, enc, &xb, ActSim::Fp4, rows, width, width, 32)
        }
    }
}

/// [`crate::graph::Op::Scale`].
pub fn scale(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, x: BufId, width: usize, factor: f32) -> Result<()> {
    let ctx = be.context();
    let xb = be.buf(t, cx.model, x)?;
    let n = cx.batch.rows.len() * width;
    if n == 0 {
        return Ok(());
    }
    let p = ScaleParams { n: u32_of(n, "scale values")?, _p0: 0, _p1: 0, factor };
    let pl = ctx.pipeline("scale", sh::SCALE)?;
    let ub = ctx.uniform("scale", &p);
    ctx.dispatch(t.enc(ctx), &pl, &[&xb, &ub], [u32_of(n.div_ceil(64), "workgroups")?, 1, 1])
}

fn hc_params(cx: &StepCtx<'_>, head: bool) -> Result<HcParams> {
    let c = &cx.model.config;
    if c.hc_mult == 0 || c.hc_mult > 8 {
        return Err(backend_err(format!("hc: {} streams (supported: 1..=8)", c.hc_mult)));
    }
    Ok(HcParams {
        n_tok: u32_of(cx.batch.rows.len(), "n_tok")?,
        d: u32_of(c.d_model, "d")?,
        n: c.hc_mult as u32,
        iters: u32_of(c.hc_sinkhorn_iters, "iters")?,
        head: head as u32,
        mix_offset: 0,
        mix_stride: 0,
        u_offset: 0,
        u_stride: 0,
        f_offset: 0,
        f_stride: 0,
        has_weight: 0,
        norm_eps: c.rms_eps,
        hc_eps: c.hc_eps,
        _p1: [0; 2],
    })
}

/// The base and scale weights of the mHC of `of` (`(layer, sub)`; `None`: the output head).
fn hc_weight_ids(cx: &StepCtx<'_>, of: Option<(usize, Sub)>) -> (WeightId, WeightId) {
    match of {
        Some((layer, sub)) => {
            let lw = &cx.model.layers[layer];
            let w = match sub {
                Sub::Attn => lw.hc_attn,
                Sub::Ffn => lw.hc_ffn,
            };
            (w.base, w.scale)
        }
        None => (cx.model.global.hc_base, cx.model.global.hc_scale),
    }
}

/// The parameters of the mHC weights of `of` over the tick's mixes (`u_stride` left to the caller).
fn hc_weight_params(cx: &StepCtx<'_>, of: Option<(usize, Sub)>) -> Result<HcParams> {
    let c = &cx.model.config;
    let mut p = hc_params(cx, of.is_none())?;
    p.mix_stride = u32_of(if of.is_none() { c.hc_mult } else { c.hc_mix() }, "mix stride")?;
    Ok(p)
}

/// `hc.wgsl`'s `weights` of `of` (see [`hc_weight_ids`]): `Pre`, and unless the head the post/comb `PostComb`.
fn hc_weights(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, of: Option<(usize, Sub)>) -> Result<()> {
    let model = cx.model;
    let n = cx.batch.rows.len();
    if n == 0 {
        return Ok(());
    }
    let (mix, pre, state) =
        (be.buf(t, model, BufId::Mix)?, be.buf(t, model, BufId::Pre)?, be.buf(t, model, BufId::PostComb)?);
    let (base, scale) = hc_weight_ids(cx, of);
    let (bb, sb) = (be.dense(model, base), be.dense(model, scale));
    let mut p = hc_weight_params(cx, of)?;
    p.u_stride = model.config.hc_mult as u32;
    let ctx = be.context();
    let pl = ctx.pipeline_entry("hc", sh::HC, "weights")?;
    let ub = ctx.uniform("hc weights", &p);
    let groups = u32_of(n.div_ceil(64), "workgroups")?;
    ctx.dispatch_at(t.enc(ctx), &pl, &[(1, &mix), (2, &bb), (3, &sb), (4, &state), (5, &pre), (6, &ub)], [groups, 1, 1])
}

/// [`crate::graph::Op::HcSinkhorn`]: `pre`, `post` and the Sinkhorn `comb` of a sublayer from its mixes.
pub fn hc_sinkhorn(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, layer: usize, sub: Sub) -> Result<()> {
    hc_weights(be, t, cx, Some((layer, sub)))
}

/// [`crate::graph::Op::HcSinkhorn`] of `of` (`(layer, sub)`; `None`: [`crate::graph::Op::HcHeadWeights`]) and the
/// [`crate::graph::Op::HcCollapse`] into `out` that follows it, and with `norm` (`(y, weight)`) the
/// [`crate::graph::Op::RmsNorm`] of `out` into `y` that follows that, in one dispatch (`hc.wgsl`'s
/// `weights_collapse` / `weights_collapse_norm`; see [`super::fuse`]).
pub fn hc_weights_collapse(
    be: &WgpuBackend,
    t: &mut Tick,
    cx: &StepCtx<'_>,
    of: Option<(usize, Sub)>,
    out: BufId,
    norm: Option<(BufId, Option<WeightId>)>,
) -> Result<()> {
    let model = cx.model;
    let n = cx.batch.rows.len();
    if n == 0 {
        return Ok(());
    }
    let (xs, mix, state) =
        (be.buf(t, model, BufId::Streams)?, be.buf(t, model, BufId::Mix)?, be.buf(t, model, BufId::PostComb)?);
    let (pre, u) = (be.buf(t, model, BufId::Pre)?, be.buf(t, model, out)?);
    let (base, scale) = hc_weight_ids(cx, of);
    let (bb, sb) = (be.dense(model, base), be.dense(model, scale));
    let mut p = hc_weight_params(cx, of)?;
    p.u_stride = u32_of(model.config.d_model, "u stride")?;
    let ctx = be.context();
    let groups = [u32_of(n, "workgroups")?, 1, 1];
    let mut bind = vec![(0, &xs), (1, &mix), (2, &bb), (3, &sb), (4, &state), (5, &u), (7, &pre)];
    let Some((y, w)) = norm else {
        let pl = ctx.pipeline_entry("hc", sh::HC, "weights_collapse")?;
        let ub = ctx.uniform("hc weights collapse", &p);
        bind.push((6, &ub));
        return ctx.dispatch_at(t.enc(ctx), &pl, &bind, groups);
    };
    let yb = be.buf(t, model, y)?;
    let g = w.map(|w| be.dense(model, w));
    p.has_weight = g.is_some() as u32;
    let pl = ctx.pipeline_entry("hc", sh::HC, "weights_collapse_norm")?;
    let ub = ctx.uniform("hc weights collapse norm", &p);
    let gb = g.as_deref().unwrap_or(ctx.zeros());
    bind.extend([(6, &ub), (8, gb), (9, &yb)]);
    ctx.dispatch_at(t.enc(ctx), &pl, &bind, groups)
}

/// [`crate::graph::Op::HcHeadWeights`].
pub fn hc_head_weights(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>) -> Result<()> {
    hc_weights(be, t, cx, None)
}

/// [`crate::graph::Op::HcCollapse`].
pub fn hc_collapse(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, out: BufId) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let n = cx.batch.rows.len();
    if n == 0 {
        return Ok(());
    }
    let (xs, pre, u) = (be.buf(t, model, BufId::Streams)?, be.buf(t, model, BufId::Pre)?, be.buf(t, model, out)?);
    let mut p = hc_params(cx, false)?;
    p.mix_stride = c.hc_mult as u32;
    p.u_stride = u32_of(c.d_model, "u stride")?;
    let ctx = be.context();
    let pl = ctx.pipeline_entry("hc", sh::HC, "collapse")?;
    let ub = ctx.uniform("hc collapse", &p);
    let groups = [u32_of(c.d_model.div_ceil(64), "workgroups")?, p.n_tok, 1];
    ctx.dispatch_at(t.enc(ctx), &pl, &[(0, &xs), (1, &pre), (5, &u), (6, &ub)], groups)
}

/// [`crate::graph::Op::HcPost`]: writes the other stream buffer, which becomes the current streams; with `norm`
/// (the [`crate::graph::Op::RmsNorm`] of the new streams that follows it, unweighted, into that tensor) in the same
/// dispatch (see [`super::fuse`]).
pub fn hc_post(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, norm: Option<BufId>) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let shape = ops::HcShape {
        n_tok: cx.batch.rows.len(),
        d: c.d_model,
        n: c.hc_mult,
        sinkhorn_iters: c.hc_sinkhorn_iters,
        norm_eps: c.rms_eps,
        hc_eps: c.hc_eps,
    };
    let xs = be.buf(t, model, BufId::Streams)?;
    let f = be.buf(t, model, BufId::SublayerOut)?;
    let state = be.buf(t, model, BufId::PostComb)?;
    let out = t.next_streams(be.context(), model);
    let ctx = be.context();
    let yb = norm.map(|y| be.buf(t, model, y)).transpose()?;
    ops::hc_post(ctx, t.enc(ctx), &shape, &xs, (&f, 0, c.d_model), &state, &out, yb.as_ref())?;
    t.flip_streams();
    Ok(())
}

/// [`crate::graph::Op::Logits`]: the logit rows of `HeadOut` (gathered unless they are every row in order), times
/// the output head, into `Logits`.
pub fn logits(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>) -> Result<()> {
    let model = cx.model;
    let d = model.config.d_model;
    let lr = &cx.batch.logit_rows;
    if lr.is_empty() {
        return Ok(());
    }
    let ctx = be.context();
    let head = be.mat(model, model.global.head)?;
    let (h, out) = (be.buf(t, model, BufId::HeadOut)?, be.buf(t, model, BufId::Logits)?);
    let enc = t.enc(ctx);
    // Every row a logit row, in order (a decode tick): the head reads HeadOut as it is.
    if lr.iter().copied().eq(0..cx.batch.rows.len()) {
        return be.mm(enc, &head, View::new(&h, d), lr.len(), View::new(&out, head.rows));
    }
    let rows: Vec<u32> = lr.iter().map(|&r| r as u32).collect();
    let x = ctx.scratch(lr.len() * d);
    ops::gather_rows(ctx, enc, &h, &x, &rows, d, d)?;
    be.mm(enc, &head, View::new(&x, d), lr.len(), View::new(&out, head.rows))
}

/// [`crate::graph::Op::LogitCandidates`]: each logit row's `k` best logits into `Candidates` (`candidates.wgsl`,
/// one workgroup per row).
pub fn logit_candidates(be: &WgpuBackend, t: &mut Tick, cx: &StepCtx<'_>, k: usize) -> Result<()> {
    let rows = cx.batch.logit_rows.len();
    if rows == 0 {
        return Ok(());
    }
    if k == 0 || k > crate::graph::MAX_LOGIT_CANDIDATES {
        return Err(backend_err(format!(
            "LogitCandidates: {k} candidates (1..={})",
            crate::graph::MAX_LOGIT_CANDIDATES
        )));
    }
    let (logits, out) = (be.buf(t, cx.model, BufId::Logits)?, be.buf(t, cx.model, BufId::Candidates)?);
    let ctx = be.context();
    candidates(ctx, t.enc(ctx), &logits, &out, cx.model.config.vocab, k, rows)
}

/// Records `candidates.wgsl` over `rows` rows of `vocab` logits in `logits`: `(id, value bits)` u32 pairs,
/// `[rows, k]`, into `out`.
pub fn candidates(
    ctx: &WgpuContext,
    enc: &mut Enc,
    logits: &wgpu::Buffer,
    out: &wgpu::Buffer,
    vocab: usize,
    k: usize,
    rows: usize,
) -> Result<()> {
    let p = CandParams { vocab: u32_of(vocab, "vocab")?, k: u32_of(k, "k")?, rows: u32_of(rows, "logit rows")?, _p: 0 };
    let ub = ctx.uniform("candidates", &p);
    let pl = ctx.pipeline("candidates", sh::CANDIDATES)?;
    ctx.dispatch(enc, &pl, &[logits, out, &ub], [p.rows, 1, 1])
}

/// [`crate::graph::Op::Readback`] of the logits, or of their candidates: submits the tick with a copy of the logit
/// rows (or of each row's `k` best, `k` = [`crate::graph::Batch::candidates`]) to the host — the tick's submission
/// and its one readback; with no logit rows, just the submission.
pub fn readback(be: &WgpuBackend, t: &mut Tick, cx: &mut StepCtx<'_>, buf: BufId) -> Result<()> {
    let per_row = match buf {
        BufId::Logits => cx.model.config.vocab,
        BufId::Candidates => 2 * cx.batch.candidates,
        _ => return Err(backend_err(format!("readback of {buf:?}: only the logits come back to the host"))),
    };
    let ctx = be.context();
    let rows = cx.batch.logit_rows.len();
    let n = rows * per_row;
    if n == 0 {
        if t.pending() {
            ctx.submit(t.take_enc(ctx))?;
        }
        return Ok(());
    }
    let out = be.buf(t, cx.model, buf)?;
    if buf == BufId::Candidates {
        let k = cx.batch.candidates;
        if cx.act.cand_ids.len() < rows * k {
            return Err(backend_err(format!(
                "readback: room for {} candidates, {} needed",
                cx.act.cand_ids.len(),
                rows * k
            )));
        }
        let got = ctx.submit_read_u32(t.take_enc(ctx), &out, 0, n)?;
        for (j, pair) in got.chunks_exact(2).enumerate() {
            cx.act.cand_ids[j] = pair[0];
            cx.act.cand_vals[j] = f32::from_bits(pair[1]);
        }
        return Ok(());
    }
    if cx.act.logits.len() < n {
        return Err(backend_err(format!("readback: {} host logits for {n}", cx.act.logits.len())));
    }
    let got = ctx.submit_read_f32(t.take_enc(ctx), &out, 0, n)?;
    cx.act.logits[..n].copy_from_slice(&got);
    Ok(())
}
