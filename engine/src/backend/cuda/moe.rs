//! The MoE layer on the CUDA backend: routing on the device (`ds4_moe_route`), the routed experts through the
//! fused kernels of `cuda/moe.cu` with the expert ids read where the router wrote them, and the shared expert
//! through the dense products.
//!
//! The graph's five MoE ops map onto four launches and a few small ones:
//! - [`Op::MoeRoute`](crate::graph::Op::MoeRoute): ids (`BufId::Routes`, i32 `rows × k`) and route weights
//!   (f32, the backend's own buffer) in one launch;
//! - [`Op::ExpertUp`](crate::graph::Op::ExpertUp) is *held*: the next node is always its
//!   [`Op::SwiGlu`](crate::graph::Op::SwiGlu) (it is the only reader of what it writes), and the pair is one
//!   `gate_up` launch — gate and up products, the clamped SwiGLU, the route weight applied there as the graph says —
//!   plus the shared expert's two products and its SwiGLU;
//! - [`Op::ExpertDown`](crate::graph::Op::ExpertDown) is held likewise until its
//!   [`Op::MoeCombine`](crate::graph::Op::MoeCombine): one `down_sum` launch (the down products summed over each
//!   row's experts, no atomics), the shared expert's down product, and one add.
//!
//! Either way the results are the two ops' (the held node's outputs are private tensors no other node reads). A
//! held node followed by anything else is an error, never a silent skip. The layer runs on the device when every
//! layer's experts fit the kernels ([`moe_ok`]: IQ2_XXS / Q2_K / Q4_K experts in whole 256-value blocks, a shared
//! expert the dense products take, at most `MAX_ROUTE_K` experts a row); otherwise every MoE op goes to the CPU.

use ds4_kernels_native::cuda_host::{self, CudaExperts};
use ds4_kernels_native::cuda_kernels::{Plan, MAX_ROUTE_K};

use super::{cuda_weight, dev_err, err, CudaBackend, State};
use crate::backend::StepCtx;
use crate::graph::BufId;
use crate::model::Model;
use crate::Result;

/// A node waiting for the node it is fused with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Held {
    /// `ExpertUp` of a layer, waiting for its `SwiGlu`.
    Up(usize),
    /// `ExpertDown` of a layer, waiting for the `MoeCombine`.
    Down(usize),
}

/// Whether every MoE layer of `model` runs on the CUDA kernels (see the module docs).
pub(super) fn moe_ok(model: &Model) -> bool {
    let c = &model.config;
    let k = c.n_experts_used;
    if k == 0 || k > MAX_ROUTE_K || k > c.n_experts {
        return false;
    }
    model.layers.iter().all(|lw| {
        let (g, u, d) = (model.mat(lw.gate_exps), model.mat(lw.up_exps), model.mat(lw.down_exps));
        let (Some(gt), Some(ut), Some(dt)) = (cuda_weight(g.ty), cuda_weight(u.ty), cuda_weight(d.ty)) else {
            return false;
        };
        let shared = match (lw.gate_sh, lw.up_sh, lw.down_sh) {
            (Some(a), Some(b), Some(e)) => [a, b, e].iter().all(|&w| CudaBackend::product_ok(model, w)),
            (None, None, None) => true,
            _ => false,
        };
        gt == ut
            && g.cols == c.d_model
            && d.cols == c.expert_ffn
            && Plan::moe_gate_up(gt, c.expert_ffn, c.d_model, k, 1).is_ok()
            && Plan::moe_down_sum(dt, c.d_model, c.expert_ffn, 1).is_ok()
            && shared
    }) && model.layers.iter().enumerate().all(|(l, lw)| !c.is_hash_layer(l) || lw.tid2eid.is_some())
}

impl State {
    /// Fails when a held node is still waiting (called before any other node and at the tick's end).
    pub(super) fn no_held(&self, what: &str) -> Result<()> {
        match self.held {
            None => Ok(()),
            Some(h) => Err(err(format!("{h:?} was not followed by the node it is fused with ({what} came first)"))),
        }
    }

    fn experts(&mut self, model: &Model, layer: usize) -> Result<CudaExperts> {
        let (c, lw) = (&model.config, &model.layers[layer]);
        let (g, d) = (model.mat(lw.gate_exps), model.mat(lw.down_exps));
        let ty = |t| cuda_weight(t).ok_or_else(|| err(format!("no CUDA MoE kernel for {t}")));
        Ok(CudaExperts {
            gate: self.weight(model, lw.gate_exps, false)?,
            up: self.weight(model, lw.up_exps, false)?,
            down: self.weight(model, lw.down_exps, false)?,
            up_ty: ty(g.ty)?,
            down_ty: ty(d.ty)?,
            n_experts: c.n_experts,
            d_model: c.d_model,
            ffn: c.expert_ffn,
        })
    }

    /// [`crate::graph::Op::MoeRoute`].
    pub(super) fn moe_route(&mut self, cx: &StepCtx<'_>, layer: usize, hash: bool) -> Result<()> {
        let (model, n) = (cx.model, cx.batch.rows.len());
        let c = &model.config;
        let (ne, k) = (c.n_experts, c.n_experts_used);
        let lw = &model.layers[layer];
        let logits = self.input(BufId::Router, n * ne * 4)?;
        let bias = match (hash, lw.gate_bias) {
            (false, Some(b)) => Some(self.weight(model, b, true)?),
            _ => None,
        };
        let table = if hash {
            let t = lw.tid2eid.as_ref().ok_or_else(|| err(format!("layer {layer} has no hash table")))?;
            let tb = match self.tables.get(&layer) {
                Some(&b) => b,
                None => {
                    let b = self.dev.upload(bytemuck::cast_slice(t)).map_err(dev_err)?;
                    self.counters.host_to_device += 4 * t.len() as u64;
                    self.tables.insert(layer, b);
                    b
                }
            };
            let tokens: Vec<u32> = cx.batch.rows.iter().map(|r| r.token).collect();
            Some((tb, self.scratch_with("tokens", bytemuck::cast_slice(&tokens))?))
        } else {
            None
        };
        let ids = self.out(BufId::Routes, n * k * 4)?;
        let rw = self.scratch("route_w", n * k * 4)?;
        let r = cuda_host::moe_route(
            &mut *self.dev,
            logits,
            bias,
            table,
            n,
            ne,
            k,
            c.weights_norm,
            c.routed_scale,
            ids,
            rw,
        );
        self.launched(r, 1)
    }

    /// [`crate::graph::Op::ExpertUp`] and [`crate::graph::Op::SwiGlu`] of `layer`, fused.
    pub(super) fn gate_up_swiglu(&mut self, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
        let (model, n) = (cx.model, cx.batch.rows.len());
        let c = &model.config;
        let (k, ffn, limit) = (c.n_experts_used, c.expert_ffn, c.swiglu_limit[layer]);
        let ex = self.experts(model, layer)?;
        let x = self.input(BufId::Normed, n * c.d_model * 4)?;
        let ids = self.input(BufId::Routes, n * k * 4)?;
        let rw = self.scratch("route_w", n * k * 4)?;
        let h = self.out(BufId::ExpertGate, n * k * ffn * 4)?;
        let acts = self.acts(n * c.d_model.max(k * ffn))?;
        let r = cuda_host::moe_gate_up(&mut *self.dev, &ex, x, ids, Some(rw), k, n, limit, &acts, h);
        let bytes = 2 * ex.ffn * model.mat(model.layers[layer].gate_exps).row_bytes;
        self.counters.weights_fetched += (n * k * bytes) as u64;
        self.counters.weights_min += ((n * k).min(c.n_experts) * bytes) as u64;
        self.launched(r, 2)?;
        let lw = &model.layers[layer];
        if let (Some(gs), Some(us)) = (lw.gate_sh, lw.up_sh) {
            let g = self.out(BufId::ExpertUp, n * ffn * 4)?;
            let u = self.scratch("shared_up", n * ffn * 4)?;
            self.product(model, gs, x, n, g)?;
            self.product(model, us, x, n, u)?;
            let r = cuda_host::swiglu(&mut *self.dev, g, u, n * ffn, limit);
            self.launched(r, 1)?;
        }
        Ok(())
    }

    /// [`crate::graph::Op::ExpertDown`] of `layer` and [`crate::graph::Op::MoeCombine`], fused.
    pub(super) fn down_combine(&mut self, cx: &StepCtx<'_>, layer: usize) -> Result<()> {
        let (model, n) = (cx.model, cx.batch.rows.len());
        let c = &model.config;
        let (k, ffn, d) = (c.n_experts_used, c.expert_ffn, c.d_model);
        let ex = self.experts(model, layer)?;
        let h = self.input(BufId::ExpertGate, n * k * ffn * 4)?;
        let ids = self.input(BufId::Routes, n * k * 4)?;
        let out = self.out(BufId::SublayerOut, n * d * 4)?;
        let acts = self.acts(n * d.max(k * ffn))?;
        let r = cuda_host::moe_down_sum(&mut *self.dev, &ex, h, ids, None, k, n, &acts, out);
        let bytes = d * model.mat(model.layers[layer].down_exps).row_bytes;
        self.counters.weights_fetched += (n * k * bytes) as u64;
        self.counters.weights_min += ((n * k).min(c.n_experts) * bytes) as u64;
        self.launched(r, 2)?;
        if let Some(ds) = model.layers[layer].down_sh {
            let hs = self.input(BufId::ExpertUp, n * ffn * 4)?;
            let so = self.scratch("shared_out", n * d * 4)?;
            self.product(model, ds, hs, n, so)?;
            let r = cuda_host::add(&mut *self.dev, out, so, n * d);
            self.launched(r, 1)?;
        }
        Ok(())
    }
}
