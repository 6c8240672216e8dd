//! Row-wise kernels: embedding, RMSNorm, grouped products, RoPE, activation simulation, the mHC mixes and the
//! logits. Each reads and writes the tensors its [`crate::graph::Op`] names, for every row of the batch.

use std::cell::RefCell;

use super::matmul::{dequant_row, matmul_gather, matmul_strided};
use super::pool::{par_rows, Pool};
use super::{hc, norm, Scratch};
use crate::backend::StepCtx;
use crate::graph::{BufId, SimKind, Sub};
use crate::model::rope::RopeFreqs;
use crate::model::{sim, WeightId};
use crate::Result;

thread_local! {
    static TMP: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// [`rope`]'s per-row (cos, sin) tables (the calling thread's).
    static ROPE_TAB: RefCell<Vec<(f32, f32)>> = const { RefCell::new(Vec::new()) };
}

/// [`crate::graph::Op::Embed`]: the token's embedding row into every stream.
pub fn embed(pool: &Pool, cx: &StepCtx<'_>, streams: &mut [f32]) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let (d, hc) = (c.d_model, c.hc_mult);
    let emb = model.mat(model.global.embed);
    let rows = &cx.batch.rows;
    par_rows(pool, &mut streams[..rows.len() * hc * d], hc * d, &|r, x| {
        // Validated at load (supported type, whole rows); a failure here would be a bug: poison the row.
        if dequant_row(emb.ty, emb.row(rows[r].token as usize), &mut x[..d]).is_err() {
            x[..d].fill(f32::NAN);
        }
        for j in 1..hc {
            x.copy_within(0..d, j * d);
        }
    });
    Ok(())
}

/// [`crate::graph::Op::MtpInput`]: the MTP drafter's first streams from each row's token and input streams
/// ([`crate::backend::Activations::hidden_in`], `[rows, hc·d]`).
pub fn mtp_input(pool: &Pool, sc: &mut Scratch, cx: &StepCtx<'_>) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let (d, hc, eps) = (c.d_model, c.hc_mult, c.rms_eps);
    let Some(mw) = model.mtp_input else {
        return Err(crate::Error::Backend { backend: "cpu", what: "MtpInput on a model without an MTP block".into() });
    };
    let n = cx.batch.rows.len();
    let h_in = &cx.act.hidden_in;
    if h_in.len() < n * hc * d {
        return Err(crate::Error::Backend {
            backend: "cpu",
            what: format!("MtpInput needs {} input stream values, has {}", n * hc * d, h_in.len()),
        });
    }
    // e = RMSNorm(embed[token])·enorm, one row per batch row.
    let mut e = vec![0f32; n * d];
    embed_rows(pool, cx, &mut e);
    let enorm = model.dense(mw.enorm);
    par_rows(pool, &mut e, d, &|_, r| norm::rms_norm_inplace(r, enorm, eps));
    let mut ep = vec![0f32; n * d];
    super::matmul::matmul(pool, super::weight(pool, model, mw.e_proj), &e, n, &mut ep)?;
    // h = RMSNorm(h_in[r])·hnorm per stream (a zero row stays zero), projected per stream.
    let mut h = h_in[..n * hc * d].to_vec();
    let hnorm = model.dense(mw.hnorm);
    par_rows(pool, &mut h, d, &|_, r| norm::rms_norm_inplace(r, hnorm, eps));
    let streams = &mut sc.streams[..n * hc * d];
    super::matmul::matmul(pool, super::weight(pool, model, mw.h_proj), &h, n * hc, streams)?;
    for (row, x) in streams.chunks_exact_mut(hc * d).enumerate() {
        for s in x.chunks_exact_mut(d) {
            s.iter_mut().zip(&ep[row * d..(row + 1) * d]).for_each(|(v, a)| *v += a);
        }
    }
    Ok(())
}

/// The embedding row of each batch row's token into `out` (`[rows, d]`).
fn embed_rows(pool: &Pool, cx: &StepCtx<'_>, out: &mut [f32]) {
    let model = cx.model;
    let d = model.config.d_model;
    let emb = model.mat(model.global.embed);
    let rows = &cx.batch.rows;
    par_rows(pool, &mut out[..rows.len() * d], d, &|r, x| {
        if dequant_row(emb.ty, emb.row(rows[r].token as usize), x).is_err() {
            x.fill(f32::NAN);
        }
    });
}

/// [`crate::graph::Op::RmsNorm`] over rows of `width` values, `per_row` values per batch row.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    pool: &Pool,
    sc: &mut Scratch,
    cx: &StepCtx<'_>,
    x: BufId,
    y: BufId,
    w: Option<WeightId>,
    per_row: usize,
    width: usize,
) -> Result<()> {
    let n = cx.batch.rows.len() * per_row / width.max(1);
    let eps = cx.model.config.rms_eps;
    let w = w.map(|w| cx.model.dense(w));
    if x == y {
        let buf = sc.buf(x)?;
        par_rows(pool, &mut buf[..n * width], width, &|_, r| match w {
            Some(w) => norm::rms_norm_inplace(r, w, eps),
            None => norm::rms_norm_unweighted(r, eps),
        });
        return Ok(());
    }
    sc.with_xy(x, y, |xs, ys| {
        par_rows(pool, &mut ys[..n * width], width, &|i, out| {
            let row = &xs[i * width..(i + 1) * width];
            match w {
                Some(w) => norm::rms_norm(row, w, eps, out),
                None => {
                    out.copy_from_slice(row);
                    norm::rms_norm_unweighted(out, eps);
                }
            }
        });
        Ok(())
    })
}

/// [`crate::graph::Op::GroupedMatMul`]: group `g` of `x`'s columns through rows `g·rank..` of `w`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul(
    pool: &Pool,
    sc: &mut Scratch,
    cx: &StepCtx<'_>,
    w: WeightId,
    x: BufId,
    y: BufId,
    groups: usize,
    rank: usize,
) -> Result<()> {
    let n = cx.batch.rows.len();
    let wm = super::weight(pool, cx.model, w);
    let gs = wm.cols;
    sc.with_xy(x, y, |xs, ys| {
        for gi in 0..groups {
            matmul_strided(
                pool,
                wm.rows_slice(gi * rank, rank),
                xs,
                n,
                (groups * gs, gi * gs),
                ys,
                (groups * rank, gi * rank),
            )?;
        }
        Ok(())
    })
}

/// [`crate::graph::Op::Rope`].
pub fn rope(
    pool: &Pool,
    x: &mut [f32],
    cx: &StepCtx<'_>,
    layer: usize,
    width: usize,
    heads: usize,
    inverse: bool,
) -> Result<()> {
    let n = cx.batch.rows.len();
    let rope = cx.rope.for_layer(cx.model, layer);
    let half = rope.inv_freq.len();
    // One (cos, sin) table per row, shared by its heads (bit-identical to `apply` per head; the sines and cosines
    // were most of the op's time: heads × rope_dim / 2 of them per row).
    ROPE_TAB.with(|t| {
        let mut tab = t.borrow_mut();
        tab.clear();
        tab.resize(n * half, (0.0, 0.0));
        for (row, cs) in cx.batch.rows.iter().zip(tab.chunks_exact_mut(half.max(1))) {
            rope.table(row.pos, inverse, cs);
        }
        let tab = &tab[..];
        par_rows(pool, &mut x[..n * heads * width], width, &|i, r| {
            let at = i / heads * half;
            RopeFreqs::rotate(r, &tab[at..at + half])
        });
    });
    Ok(())
}

/// [`crate::graph::Op::ActSim`].
pub fn act_sim(pool: &Pool, x: &mut [f32], cx: &StepCtx<'_>, width: usize, heads: usize, kind: SimKind) -> Result<()> {
    let n = cx.batch.rows.len();
    let rd = cx.model.config.rope_dim;
    par_rows(pool, &mut x[..n * heads * width], width, &|_, r| match kind {
        SimKind::Fp8NoRope => sim::fp8_blocks(&mut r[..width - rd], 64),
        SimKind::HadamardFp4 => {
            sim::hadamard(r);
            sim::fp4_blocks(r, 32);
        }
    });
    Ok(())
}

/// [`crate::graph::Op::HcSinkhorn`]: `pre`, `post`, `comb` of every row from its mix.
pub fn hc_sinkhorn(sc: &mut Scratch, cx: &StepCtx<'_>, layer: usize, sub: Sub) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let w = match sub {
        Sub::Attn => lw.hc_attn,
        Sub::Ffn => lw.hc_ffn,
    };
    let (n, hc, mixn) = (cx.batch.rows.len(), c.hc_mult, c.hc_mix());
    let (base, scale) = (model.dense(w.base), model.dense(w.scale));
    for r in 0..n {
        hc::hc_weights(
            &sc.mix[r * mixn..(r + 1) * mixn],
            base,
            scale,
            hc,
            c.hc_eps,
            c.hc_sinkhorn_iters,
            &mut sc.pre[r * hc..(r + 1) * hc],
            &mut sc.post[r * hc..(r + 1) * hc],
            &mut sc.comb[r * hc * hc..(r + 1) * hc * hc],
        );
    }
    Ok(())
}

/// [`crate::graph::Op::TapStreams`]: the mean of each row's streams into its kept tap features.
pub fn tap_streams(sc: &Scratch, cx: &mut StepCtx<'_>, tap: usize) -> Result<()> {
    let c = &cx.model.config;
    let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
    let out = &mut cx.act.hidden_out;
    if n == 0 || out.len() < n * (tap + 1) * d || !out.len().is_multiple_of(n * d) {
        return Err(crate::Error::Backend {
            backend: "cpu",
            what: format!("TapStreams: {} kept values for {n} rows of tap {tap}", out.len()),
        });
    }
    hc::tap_means(&sc.streams[..n * hc * d], n, hc, d, tap, out);
    Ok(())
}

/// [`crate::graph::Op::HcHeadWeights`].
pub fn hc_head_weights(sc: &mut Scratch, cx: &StepCtx<'_>) -> Result<()> {
    let model = cx.model;
    let c = &model.config;
    let g = &model.global;
    let (n, hc) = (cx.batch.rows.len(), c.hc_mult);
    let (base, scale) = (model.dense(g.hc_base), model.dense(g.hc_scale)[0]);
    for r in 0..n {
        hc::head_weights(&sc.mix[r * hc..(r + 1) * hc], base, scale, c.hc_eps, &mut sc.pre[r * hc..(r + 1) * hc]);
    }
    Ok(())
}

/// [`crate::graph::Op::HcCollapse`]: `out = Σ_j pre_j · streams_j`.
pub fn hc_collapse(pool: &Pool, sc: &mut Scratch, cx: &StepCtx<'_>, out: BufId) -> Result<()> {
    let c = &cx.model.config;
    let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
    let hcd = hc * d;
    let mut y = std::mem::take(sc.buf(out)?);
    let (streams, pre) = (&sc.streams, &sc.pre);
    par_rows(pool, &mut y[..n * d], d, &|r, u| {
        hc::collapse(&streams[r * hcd..(r + 1) * hcd], &pre[r * hc..(r + 1) * hc], d, u)
    });
    *sc.buf(out)? = y;
    Ok(())
}

/// [`crate::graph::Op::HcPost`]: `streams ← post·f + combᵀ·streams`.
pub fn hc_post(pool: &Pool, sc: &mut Scratch, cx: &StepCtx<'_>) -> Result<()> {
    let c = &cx.model.config;
    let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
    let hcd = hc * d;
    let (f, post, comb) = (&sc.sub_out, &sc.post, &sc.comb);
    par_rows(pool, &mut sc.streams[..n * hcd], hcd, &|r, x| {
        TMP.with(|t| {
            let mut t = t.borrow_mut();
            if t.len() < hcd {
                t.resize(hcd, 0.0);
            }
            hc::post_mix(
                x,
                &f[r * d..(r + 1) * d],
                &post[r * hc..(r + 1) * hc],
                &comb[r * hc * hc..(r + 1) * hc * hc],
                hc,
                d,
                &mut t,
            );
        })
    });
    Ok(())
}

/// [`crate::graph::Op::Logits`]: the output projection of the batch's logit rows into the host logits.
pub fn logits(pool: &Pool, sc: &mut Scratch, cx: &mut StepCtx<'_>) -> Result<()> {
    let model = cx.model;
    matmul_gather(
        pool,
        super::weight(pool, model, model.global.head),
        &sc.head_out,
        &cx.batch.logit_rows,
        &mut cx.act.logits,
    )
}

/// [`crate::graph::Op::LogitCandidates`]: each logit row's `k` best logits ([`crate::sampler::top_candidates`]).
pub fn logit_candidates(pool: &Pool, cx: &mut StepCtx<'_>, k: usize) -> Result<()> {
    let (n, vocab) = (cx.batch.logit_rows.len(), cx.model.config.vocab);
    let act = &mut *cx.act;
    if k == 0 || k > crate::graph::MAX_LOGIT_CANDIDATES || act.cand_ids.len() < n * k || act.logits.len() < n * vocab {
        return Err(crate::Error::Backend {
            backend: "cpu",
            what: format!("LogitCandidates: {k} candidates of {n} rows (room for {})", act.cand_ids.len()),
        });
    }
    let logits = &act.logits;
    let mut pairs = vec![(0u32, 0f32); n * k];
    par_rows(pool, &mut pairs, k, &|r, out| {
        let (mut ids, mut vals) = (vec![0u32; k], vec![0f32; k]);
        crate::sampler::top_candidates(&logits[r * vocab..(r + 1) * vocab], &mut ids, &mut vals);
        for (o, (i, v)) in out.iter_mut().zip(ids.into_iter().zip(vals)) {
            *o = (i, v);
        }
    });
    for (j, (i, v)) in pairs.into_iter().enumerate() {
        act.cand_ids[j] = i;
        act.cand_vals[j] = v;
    }
    Ok(())
}
