//! The CPU backend: the reference kernels of every node op, run on a worker pool created once.
//!
//! Kernels only: [`rowops`] (embedding, RMSNorm, RoPE, activation simulation, scaling, mHC, logits),
//! [`matmul`] (weight products, split over output rows), [`attention`] (compressor push, indexer top-k, sparse
//! attention, ring store), [`moe`] (routing, expert halves, SwiGLU, scatter), with the per-token math in
//! [`norm`], [`hc`], [`compressor`], [`indexer`], and the attention's and indexer's tiled f32 products in
//! [`fdot`]. The recipe that strings them together is [`crate::model::recipe`]. [`Scratch`] holds every tensor of a
//! tick (a [`BufId`] resolves to one of its buffers), grown to the largest batch seen and then reused, so the decode
//! loop does not allocate.

pub(crate) mod attention;
pub(crate) mod compressor;
pub(crate) mod fdot;
pub(crate) mod hc;
pub(crate) mod indexer;
#[cfg(feature = "bench-internals")]
pub mod matmul;
#[cfg(not(feature = "bench-internals"))]
pub(crate) mod matmul;
pub(crate) mod moe;

/// The MoE routing rule as the CPU computes it (scores, top k with ties to the lower id, weights), for other
/// kernels' tests to compare against (the CUDA routing kernel's, under the host shim).
pub mod routing {
    pub use super::moe::{router_scores, routing_weights, top_k_biased};
}
pub(crate) mod norm;
#[cfg(feature = "bench-internals")]
pub mod pool;
#[cfg(not(feature = "bench-internals"))]
pub(crate) mod pool;
pub(crate) mod rowops;

use parking_lot::Mutex;

use crate::backend::{Backend, StepCtx};
use crate::graph::{BufId, Op};
use crate::model::{Mat, Model, WeightId};
use crate::{Error, Result};
use pool::Pool;

/// A dense weight matrix as the CPU multiplies by it: with its packed rows ([`Model::packed_mat`]) unless the pool
/// computes with f32 activations (whose kernels read the blocks as stored). Routed experts use [`Model::mat`]:
/// at their sizes a second copy would not be worth it.
pub(crate) fn weight<'m>(pool: &Pool, model: &'m Model, id: WeightId) -> Mat<'m> {
    if pool.f32_acts() {
        model.mat(id)
    } else {
        model.packed_mat(id)
    }
}

/// Intermediate buffers of the CPU ops (see the module docs).
#[derive(Debug, Default)]
pub struct Scratch {
    rows: usize,
    pub streams: Vec<f32>,
    pub collapsed: Vec<f32>,
    pub post: Vec<f32>,
    pub comb: Vec<f32>,
    pub sub_out: Vec<f32>,
    pub head_out: Vec<f32>,
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
    /// [`pool::worker_index`]), grown on the calling thread before the dispatch.
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
        f(&mut self.streams, n * c.hc_dim());
        f(&mut self.collapsed, n * c.d_model);
        f(&mut self.post, n * c.hc_mult);
        f(&mut self.comb, n * c.hc_mult * c.hc_mult);
        f(&mut self.sub_out, n * c.d_model);
        f(&mut self.head_out, n * c.d_model);
        f(&mut self.xn, n * c.d_model);
        f(&mut self.xnorm, n * c.hc_dim());
        f(&mut self.mix, n * c.hc_mix().max(c.hc_mult));
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

    /// The f32 buffer behind tensor `id`; `None` for tensors that are not plain f32 rows (selections, routes,
    /// logits, KV pages).
    pub fn f32_buf(&mut self, id: BufId) -> Option<&mut Vec<f32>> {
        use BufId::*;
        Some(match id {
            Streams => &mut self.streams,
            StreamsNormed => &mut self.xnorm,
            Mix => &mut self.mix,
            Pre => &mut self.pre,
            Collapsed => &mut self.collapsed,
            Normed => &mut self.xn,
            QLow => &mut self.qr,
            Q => &mut self.q,
            KvRows => &mut self.kv,
            CompKv => &mut self.ckv,
            CompGate => &mut self.cg,
            IdxKv => &mut self.ikv,
            IdxGate => &mut self.ig,
            IdxQ => &mut self.iq,
            IdxW => &mut self.iw,
            AttnOut => &mut self.attn,
            OLow => &mut self.oa,
            SublayerOut => &mut self.sub_out,
            Router => &mut self.router,
            ExpertGate => &mut self.h1,
            ExpertUp => &mut self.h3,
            ExpertOut => &mut self.eo,
            HeadOut => &mut self.head_out,
            PostComb | Selected | Routes | Logits | Candidates | Kv(_) => return None,
        })
    }

    /// Runs `f(x, y)` on tensors `x` (read) and `y` (written), `x != y`. The buffers are moved out and back (no
    /// copy, no allocation).
    pub fn with_xy<R>(&mut self, x: BufId, y: BufId, f: impl FnOnce(&[f32], &mut [f32]) -> Result<R>) -> Result<R> {
        let xs = std::mem::take(self.f32_buf(x).ok_or_else(|| not_f32(x))?);
        let r = match self.f32_buf(y) {
            Some(ys) => f(&xs, ys),
            None => Err(not_f32(y)),
        };
        *self.f32_buf(x).expect("resolved above") = xs;
        r
    }

    /// The buffer of tensor `x` (for in-place kernels).
    pub fn buf(&mut self, x: BufId) -> Result<&mut Vec<f32>> {
        self.f32_buf(x).ok_or_else(|| not_f32(x))
    }
}

/// [`BufId::PostComb`] in its host layout (`post` then `comb` per row) from the CPU's two buffers.
fn post_comb_out(sc: &Scratch, cx: &StepCtx<'_>, out: &mut [f32]) -> Result<()> {
    let hc = cx.model.config.hc_mult;
    for (r, row) in out.chunks_exact_mut(hc + hc * hc).enumerate().take(cx.batch.rows.len()) {
        row[..hc].copy_from_slice(&sc.post[r * hc..(r + 1) * hc]);
        row[hc..].copy_from_slice(&sc.comb[r * hc * hc..(r + 1) * hc * hc]);
    }
    Ok(())
}

/// The inverse of [`post_comb_out`].
fn post_comb_in(sc: &mut Scratch, cx: &StepCtx<'_>, data: &[f32]) -> Result<()> {
    let hc = cx.model.config.hc_mult;
    let w = hc + hc * hc;
    for (r, row) in data.chunks_exact(w).enumerate().take(cx.batch.rows.len()) {
        sc.post[r * hc..(r + 1) * hc].copy_from_slice(&row[..hc]);
        sc.comb[r * hc * hc..(r + 1) * hc * hc].copy_from_slice(&row[hc..]);
    }
    Ok(())
}

fn not_f32(id: BufId) -> Error {
    Error::Backend { backend: "cpu", what: format!("tensor {id:?} is not an f32 tensor") }
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
    fn kind(&self) -> crate::backend::BackendKind {
        crate::backend::BackendKind::Cpu
    }

    fn keeps_rollback_log(&self) -> bool {
        true
    }

    fn supports(&self, op: &Op, model: &Model) -> bool {
        match *op {
            Op::MatMul { w, .. } | Op::GroupedMatMul { w, .. } => matmul::supports(model.mat(w).ty),
            Op::Logits => matmul::supports(model.mat(model.global.head).ty),
            _ => true,
        }
    }

    fn run_node(&self, op: &Op, cx: &mut StepCtx<'_>) -> Result<()> {
        let mut sc = self.scratch(cx);
        let sc = &mut *sc;
        let pool = &self.pool;
        match *op {
            Op::Embed => rowops::embed(pool, cx, &mut sc.streams),
            Op::MtpInput => rowops::mtp_input(pool, sc, cx),
            Op::TapStreams { tap, .. } => rowops::tap_streams(sc, cx, tap),
            Op::RmsNorm { x, y, w, width, heads } => rowops::rms_norm(pool, sc, cx, x, y, w, width * heads, width),
            Op::MatMul { w, x, y } => {
                let n = cx.batch.rows.len();
                sc.with_xy(x, y, |xs, ys| matmul::matmul(pool, weight(pool, cx.model, w), xs, n, ys))
            }
            Op::GroupedMatMul { w, x, y, groups, rank } => rowops::grouped_matmul(pool, sc, cx, w, x, y, groups, rank),
            Op::Rope { x, layer, width, heads, inverse } => {
                rowops::rope(pool, sc.buf(x)?, cx, layer, width, heads, inverse)
            }
            Op::ActSim { x, width, heads, kind } => rowops::act_sim(pool, sc.buf(x)?, cx, width, heads, kind),
            Op::Scale { x, width, factor } => {
                let n = cx.batch.rows.len();
                sc.buf(x)?[..n * width].iter_mut().for_each(|v| *v *= factor);
                Ok(())
            }
            Op::CompressPush { layer, indexer, sim } => attention::compress_push(sc, cx, layer, indexer, sim),
            Op::IndexerTopK { layer } => attention::indexer_topk(pool, sc, cx, layer),
            Op::SparseAttention { layer } => attention::sparse_attention(pool, sc, cx, layer),
            Op::WindowStore { layer } => attention::kv_store(sc, cx, layer),
            Op::HcSinkhorn { layer, sub } => rowops::hc_sinkhorn(sc, cx, layer, sub),
            Op::HcHeadWeights => rowops::hc_head_weights(sc, cx),
            Op::HcCollapse { out } => rowops::hc_collapse(pool, sc, cx, out),
            Op::HcPost => rowops::hc_post(pool, sc, cx),
            // The routes are host memory: the rows are always gathered by expert (the per-row layout's products
            // are the same per row, so both layouts give the same bits).
            Op::MoeRoute { layer, hash, .. } => moe::route(sc, cx, layer, hash),
            Op::ExpertUp { layer, .. } => moe::expert_up(pool, sc, cx, layer),
            Op::SwiGlu { layer } => moe::swiglu_rows(pool, sc, cx, layer, moe::swiglu),
            Op::ExpertDown { layer, .. } => moe::expert_down(pool, sc, cx, layer),
            Op::MoeCombine { .. } => moe::combine(sc, cx),
            Op::Logits => rowops::logits(pool, sc, cx),
            Op::LogitCandidates { k } => rowops::logit_candidates(pool, cx, k),
            // Every tensor is host memory (the logits are written to the host buffer directly).
            Op::Readback { .. } => Ok(()),
        }
    }

    fn runs_groups(&self) -> bool {
        true
    }

    fn download(&self, id: BufId, cx: &mut StepCtx<'_>, out: &mut [f32]) -> Result<()> {
        let mut sc = self.scratch(cx);
        let sc = &mut *sc;
        if id == BufId::PostComb {
            return post_comb_out(sc, cx, out);
        }
        let src = sc.buf(id)?;
        let n = out.len().min(src.len());
        out[..n].copy_from_slice(&src[..n]);
        Ok(())
    }

    fn upload(&self, id: BufId, cx: &mut StepCtx<'_>, data: &[f32]) -> Result<()> {
        let mut sc = self.scratch(cx);
        let sc = &mut *sc;
        if id == BufId::PostComb {
            return post_comb_in(sc, cx, data);
        }
        let dst = sc.buf(id)?;
        if dst.len() < data.len() {
            return Err(Error::Backend {
                backend: "cpu",
                what: format!("upload of {} values into {id:?}", data.len()),
            });
        }
        dst[..data.len()].copy_from_slice(data);
        Ok(())
    }

    fn run_group(&self, ops: &[Op], cx: &mut StepCtx<'_>) -> Result<()> {
        // Every product's (x, y); outputs distinct from each other and from every input (else one by one).
        let mut xy = [(BufId::Streams, BufId::Streams); matmul::MAX_MANY];
        let ok = ops.len() <= matmul::MAX_MANY
            && ops.iter().enumerate().all(|(i, op)| match *op {
                Op::MatMul { x, y, .. } => {
                    xy[i] = (x, y);
                    x != y
                }
                _ => false,
            })
            && (0..ops.len()).all(|i| (0..ops.len()).all(|k| i == k || (xy[i].1 != xy[k].1 && xy[i].1 != xy[k].0)));
        if ops.len() < 2 || !ok {
            return ops.iter().try_for_each(|op| self.run_node(op, cx));
        }
        let xy = &xy[..ops.len()];
        let mut sc = self.scratch(cx);
        // Move the tensors out (no copy, no allocation), run, and put them back whatever happened.
        let mut bufs: [(Option<BufId>, Vec<f32>); 2 * matmul::MAX_MANY] = std::array::from_fn(|_| (None, Vec::new()));
        let mut nb = 0;
        let mut taken = Ok(());
        for id in xy.iter().flat_map(|&(x, y)| [x, y]) {
            if bufs[..nb].iter().any(|b| b.0 == Some(id)) {
                continue;
            }
            match sc.f32_buf(id) {
                Some(v) => bufs[nb] = (Some(id), std::mem::take(v)),
                None => {
                    taken = Err(not_f32(id));
                    break;
                }
            }
            nb += 1;
        }
        let r = taken.and_then(|()| {
            let n = cx.batch.rows.len();
            let mut xs: [Option<(BufId, &[f32])>; 2 * matmul::MAX_MANY] = [None; 2 * matmul::MAX_MANY];
            let mut ys: [Option<(BufId, &mut [f32])>; 2 * matmul::MAX_MANY] = std::array::from_fn(|_| None);
            for (k, (id, v)) in bufs[..nb].iter_mut().enumerate() {
                let id = id.expect("taken above");
                if xy.iter().any(|e| e.1 == id) {
                    ys[k] = Some((id, &mut v[..]));
                } else {
                    xs[k] = Some((id, &v[..]));
                }
            }
            let mut jobs: [Option<matmul::MatJob<'_>>; matmul::MAX_MANY] = std::array::from_fn(|_| None);
            for (i, op) in ops.iter().enumerate() {
                let Op::MatMul { w, .. } = *op else { unreachable!("checked above") };
                let x = xs.iter().flatten().find(|e| e.0 == xy[i].0).map(|e| e.1).expect("taken above");
                let y = ys.iter_mut().find(|e| e.as_ref().is_some_and(|e| e.0 == xy[i].1)).and_then(Option::take);
                let y = y.expect("taken above").1;
                jobs[i] = Some(matmul::MatJob { w: weight(&self.pool, cx.model, w), x, y });
            }
            matmul::matmul_many(&self.pool, &mut jobs[..ops.len()], n)
        });
        for (id, v) in bufs[..nb].iter_mut() {
            *sc.f32_buf(id.expect("taken above")).expect("resolved above") = std::mem::take(v);
        }
        r
    }

    fn run_native(&self, op: &Op, kernel: &ds4_kernels_native::NativeKernel, cx: &mut StepCtx<'_>) -> Result<bool> {
        match (*op, *kernel) {
            (Op::SwiGlu { layer }, ds4_kernels_native::NativeKernel::SwiGlu(f)) => {
                let mut sc = self.scratch(cx);
                moe::swiglu_rows(&self.pool, &mut sc, cx, layer, f)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
