//! The CPU backend: reference implementations of every op, run on a worker pool created once.
//!
//! One module per op family: [`matmul`] (weight products, split over output rows), [`norm`], [`hc`] (mHC),
//! [`attention`] (projections, rope, compressor, indexer, attention with sinks, grouped output), [`compressor`],
//! [`indexer`], [`moe`]. [`Scratch`] holds every intermediate buffer, grown to the largest batch seen and then
//! reused, so the decode loop does not allocate.

pub mod attention;
pub mod compressor;
pub mod hc;
pub mod indexer;
#[cfg(feature = "bench-internals")]
pub mod matmul;
#[cfg(not(feature = "bench-internals"))]
pub(crate) mod matmul;
pub mod moe;
pub mod norm;
#[cfg(feature = "bench-internals")]
pub mod pool;
#[cfg(not(feature = "bench-internals"))]
pub(crate) mod pool;

use std::cell::RefCell;

use parking_lot::Mutex;

use crate::backend::{Backend, StepCtx};
use crate::graph::Sub;
use crate::model::Model;
use crate::Result;
use matmul::{dequant_row, matmul, matmul_gather};
use pool::{par_rows, Pool};

/// Intermediate buffers of the CPU ops (see the module docs).
#[derive(Debug, Default)]
pub struct Scratch {
    rows: usize,
    pub xn: Vec<f32>,
    pub xnorm: Vec<f32>,
    pub mix: Vec<f32>,
    pub pre: Vec<f32>,
    pub qr: Vec<f32>,
    pub q: Vec<f32>,
    pub kv: Vec<f32>,
    pub ckv: Vec<f32>,
    pub cg: Vec<f32>,
    pub ikv: Vec<f32>,
    pub ig: Vec<f32>,
    pub iq: Vec<f32>,
    pub iw: Vec<f32>,
    pub crow: Vec<f32>,
    pub sel: Vec<u32>,
    pub attn: Vec<f32>,
    pub oa: Vec<f32>,
    pub router: Vec<f32>,
    pub sel_e: Vec<u32>,
    pub w_e: Vec<f32>,
    pub expert_rows: Vec<Vec<(usize, usize)>>,
    pub idx: Vec<usize>,
    pub h1: Vec<f32>,
    pub h3: Vec<f32>,
    pub eo: Vec<f32>,
    /// The grouped MoE dispatch's own buffers (grown on first use).
    pub moe: moe::MoeScratch,
    /// Attention and indexer scores and selection order, one entry per pool thread (see
    /// [`pool::thread_slot`]), grown on the calling thread before the dispatch.
    pub scores: Vec<std::sync::Mutex<(Vec<f32>, Vec<u32>)>>,
}

impl Scratch {
    /// Grows every buffer for `n` batch rows (no-op when already large enough).
    pub fn ensure(&mut self, model: &Model, n: usize) {
        if n <= self.rows {
            return;
        }
        let c = &model.config;
        let hd = c.head_dim;
        let ihd = c.idx_head_dim;
        let f = |v: &mut Vec<f32>, len: usize| v.resize(len, 0.0);
        f(&mut self.xn, n * c.d_model);
        f(&mut self.xnorm, n * c.hc_dim());
        f(&mut self.mix, n * c.hc_mix());
        f(&mut self.pre, n * c.hc_mult);
        f(&mut self.qr, n * c.q_lora_rank);
        f(&mut self.q, n * c.n_heads * hd);
        f(&mut self.kv, n * hd);
        f(&mut self.ckv, n * 2 * hd);
        f(&mut self.cg, n * 2 * hd);
        f(&mut self.ikv, n * 2 * ihd);
        f(&mut self.ig, n * 2 * ihd);
        f(&mut self.iq, n * c.idx_heads * ihd);
        f(&mut self.iw, n * c.idx_heads);
        f(&mut self.crow, hd.max(ihd));
        self.sel.resize(n * c.idx_topk.max(1), 0);
        f(&mut self.attn, n * c.n_heads * hd);
        f(&mut self.oa, n * c.o_groups * c.o_lora_rank);
        f(&mut self.router, n * c.n_experts);
        self.sel_e.resize(n * c.n_experts_used, 0);
        f(&mut self.w_e, n * c.n_experts_used);
        self.expert_rows.resize_with(c.n_experts, Vec::new);
        for e in &mut self.expert_rows {
            e.reserve(n);
        }
        self.idx.reserve(n);
        f(&mut self.h1, n * c.expert_ffn);
        f(&mut self.h3, n * c.expert_ffn);
        f(&mut self.eo, n * c.d_model);
        self.rows = n;
    }
}

thread_local! {
    static TMP: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The CPU backend. See the module docs.
#[derive(Debug)]
pub struct CpuBackend {
    pub pool: Pool,
    scratch: Mutex<Scratch>,
}

impl CpuBackend {
    /// A backend with `threads` threads in all (0 = all available cores).
    pub fn new(threads: usize) -> CpuBackend {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        CpuBackend { pool: Pool::new(threads), scratch: Mutex::new(Scratch::default()) }
    }

    /// The same backend with quantized weights multiplied by f32 activations (no Q8_0/Q8_K activation
    /// quantization; slower). See [`Pool::set_f32_acts`].
    pub fn with_f32_acts(mut self, on: bool) -> CpuBackend {
        self.pool.set_f32_acts(on);
        self
    }

    fn scratch(&self, cx: &StepCtx<'_>) -> parking_lot::MutexGuard<'_, Scratch> {
        let mut s = self.scratch.lock();
        s.ensure(cx.model, cx.batch.rows.len());
        s
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn embed(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        let model = cx.model;
        let c = &model.config;
        let (d, hc) = (c.d_model, c.hc_mult);
        let emb = model.mat(model.global.embed);
        let rows = &cx.batch.rows;
        par_rows(&self.pool, &mut cx.act.streams[..rows.len() * hc * d], hc * d, &|r, x| {
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

    fn hc_pre(&self, cx: &mut StepCtx<'_>, layer: usize, sub: Sub) -> Result<()> {
        let mut sc = self.scratch(cx);
        let sc = &mut *sc;
        let model = cx.model;
        let c = &model.config;
        let lw = &model.layers[layer];
        let w = match sub {
            Sub::Attn => lw.hc_attn,
            Sub::Ffn => lw.hc_ffn,
        };
        let (n, hc, d, mixn) = (cx.batch.rows.len(), c.hc_mult, c.d_model, c.hc_mix());
        let hcd = hc * d;
        sc.xnorm[..n * hcd].copy_from_slice(&cx.act.streams[..n * hcd]);
        let eps = c.rms_eps;
        par_rows(&self.pool, &mut sc.xnorm[..n * hcd], hcd, &|_, r| norm::rms_norm_unweighted(r, eps));
        matmul(&self.pool, model.mat(w.fn_), &sc.xnorm, n, &mut sc.mix)?;
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
                &mut cx.act.post[r * hc..(r + 1) * hc],
                &mut cx.act.comb[r * hc * hc..(r + 1) * hc * hc],
            );
        }
        let (streams, pre) = (&cx.act.streams, &sc.pre);
        par_rows(&self.pool, &mut cx.act.collapsed[..n * d], d, &|r, u| {
            hc::collapse(&streams[r * hcd..(r + 1) * hcd], &pre[r * hc..(r + 1) * hc], d, u)
        });
        Ok(())
    }

    fn attention(&self, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
        let mut sc = self.scratch(cx);
        attention::attention(self, &mut sc, cx, layer)
    }

    fn hc_post(&self, cx: &mut StepCtx<'_>, _layer: usize, _sub: Sub) -> Result<()> {
        let c = &cx.model.config;
        let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
        let hcd = hc * d;
        let (f, post, comb) = (&cx.act.sub_out, &cx.act.post, &cx.act.comb);
        par_rows(&self.pool, &mut cx.act.streams[..n * hcd], hcd, &|r, x| {
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

    fn moe(&self, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
        let mut sc = self.scratch(cx);
        moe::moe(self, &mut sc, cx, layer)
    }

    fn hc_head(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        let mut sc = self.scratch(cx);
        let sc = &mut *sc;
        let model = cx.model;
        let c = &model.config;
        let g = &model.global;
        let (n, hc, d) = (cx.batch.rows.len(), c.hc_mult, c.d_model);
        let hcd = hc * d;
        let eps = c.rms_eps;
        sc.xnorm[..n * hcd].copy_from_slice(&cx.act.streams[..n * hcd]);
        par_rows(&self.pool, &mut sc.xnorm[..n * hcd], hcd, &|_, r| norm::rms_norm_unweighted(r, eps));
        matmul(&self.pool, model.mat(g.hc_fn), &sc.xnorm, n, &mut sc.mix)?;
        let (base, scale, nw) = (model.dense(g.hc_base), model.dense(g.hc_scale)[0], model.dense(g.norm));
        for r in 0..n {
            let (mix, pre) = (&sc.mix[r * hc..(r + 1) * hc], &mut sc.pre[r * hc..(r + 1) * hc]);
            hc::head_weights(mix, base, scale, c.hc_eps, pre);
            let y = &mut cx.act.head_out[r * d..(r + 1) * d];
            hc::collapse(&cx.act.streams[r * hcd..(r + 1) * hcd], pre, d, y);
            norm::rms_norm_inplace(y, nw, eps);
        }
        Ok(())
    }

    fn logits(&self, cx: &mut StepCtx<'_>) -> Result<()> {
        let model = cx.model;
        matmul_gather(
            &self.pool,
            model.mat(model.global.head),
            &cx.act.head_out,
            &cx.batch.logit_rows,
            &mut cx.act.logits,
        )
    }
}
