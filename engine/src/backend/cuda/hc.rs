//! mHC on the CUDA backend (`cuda/hc.cu`, the CPU's operations in the CPU's order): the sublayers' weights
//! ([`Op::HcSinkhorn`](crate::graph::Op::HcSinkhorn): `pre`, `post`, the Sinkhorn-normalised `comb`), the head's
//! ([`Op::HcHeadWeights`](crate::graph::Op::HcHeadWeights)), the collapse of the streams into a sublayer input
//! ([`Op::HcCollapse`](crate::graph::Op::HcCollapse)) and the post-mix that writes a sublayer's output back
//! ([`Op::HcPost`](crate::graph::Op::HcPost)), so the residual streams stay on the device between layers.

use ds4_kernels_native::cuda_host;
use ds4_kernels_native::cuda_kernels::MAX_HC;

use super::State;
use crate::backend::StepCtx;
use crate::graph::{BufId, Sub};
use crate::model::Model;
use crate::Result;

/// Whether the mHC kernels take `model`'s streams.
pub(super) fn hc_ok(model: &Model) -> bool {
    (1..=MAX_HC).contains(&model.config.hc_mult)
}

impl State {
    /// [`crate::graph::Op::HcSinkhorn`].
    pub(super) fn hc_sinkhorn(&mut self, cx: &StepCtx<'_>, layer: usize, sub: Sub) -> Result<()> {
        let (model, n) = (cx.model, cx.batch.rows.len());
        let c = &model.config;
        let (hc, mixn) = (c.hc_mult, c.hc_mix());
        let lw = &model.layers[layer];
        let w = match sub {
            Sub::Attn => lw.hc_attn,
            Sub::Ffn => lw.hc_ffn,
        };
        let (base, scale) = (self.weight(model, w.base, true)?, self.weight(model, w.scale, true)?);
        let mix = self.input(BufId::Mix, n * mixn * 4)?;
        let pre = self.out(BufId::Pre, n * hc * 4)?;
        let pc = self.out(BufId::PostComb, n * (hc + hc * hc) * 4)?;
        let r = cuda_host::hc_weights(
            &mut *self.dev,
            mix,
            mixn,
            base,
            scale,
            hc,
            c.hc_eps,
            c.hc_sinkhorn_iters,
            pre,
            pc,
            n,
        );
        self.launched(r, 1)
    }

    /// [`crate::graph::Op::HcHeadWeights`].
    pub(super) fn hc_head_weights(&mut self, cx: &StepCtx<'_>) -> Result<()> {
        let (model, n) = (cx.model, cx.batch.rows.len());
        let (c, g) = (&model.config, &model.global);
        let hc = c.hc_mult;
        let base = self.weight(model, g.hc_base, true)?;
        let scale = model.dense(g.hc_scale)[0];
        let mix = self.input(BufId::Mix, n * hc * 4)?;
        let pre = self.out(BufId::Pre, n * hc * 4)?;
        let r = cuda_host::hc_head_weights(&mut *self.dev, mix, base, scale, hc, c.hc_eps, pre, n);
        self.launched(r, 1)
    }

    /// [`crate::graph::Op::HcCollapse`] into `out`.
    pub(super) fn hc_collapse(&mut self, cx: &StepCtx<'_>, out: BufId) -> Result<()> {
        let (c, n) = (&cx.model.config, cx.batch.rows.len());
        let (hc, d) = (c.hc_mult, c.d_model);
        let x = self.input(BufId::Streams, n * hc * d * 4)?;
        let pre = self.input(BufId::Pre, n * hc * 4)?;
        let u = self.out(out, n * d * 4)?;
        let r = cuda_host::hc_collapse(&mut *self.dev, x, pre, u, n, hc, d);
        self.launched(r, 1)
    }

    /// [`crate::graph::Op::HcPost`].
    pub(super) fn hc_post(&mut self, cx: &StepCtx<'_>) -> Result<()> {
        let (c, n) = (&cx.model.config, cx.batch.rows.len());
        let (hc, d) = (c.hc_mult, c.d_model);
        let x = self.input(BufId::Streams, n * hc * d * 4)?;
        let f = self.input(BufId::SublayerOut, n * d * 4)?;
        let pc = self.input(BufId::PostComb, n * (hc + hc * hc) * 4)?;
        let r = cuda_host::hc_post(&mut *self.dev, x, f, pc, n, hc, d);
        self.launched(r, 1)
    }
}
