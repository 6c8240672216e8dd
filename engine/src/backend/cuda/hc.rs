//! mHC on the CUDA backend (`cuda/hc.cu`, the CPU's operations in the CPU's order): the sublayers' weights
//! ([`Op::HcSinkhorn`](crate::graph::Op::HcSinkhorn): `pre`, `post`, the Sinkhorn-normalised `comb`), the head's
//! ([`Op::HcHeadWeights`](crate::graph::Op::HcHeadWeights)), the collapse of the streams into a sublayer input
//! ([`Op::HcCollapse`](crate::graph::Op::HcCollapse)) and the post-mix that writes a sublayer's output back
//! ([`Op::HcPost`](crate::graph::Op::HcPost)), so the residual streams stay on the device between layers; and the
//! [`Op::Embed`](crate::graph::Op::Embed) that starts them (`ds4_embed`: an F32, F16 or Q8_0 table).

use ds4_kernels_native::cuda_host::{self, EmbedFormat};
use ds4_kernels_native::cuda_kernels::MAX_HC;

use super::{err, State};
use crate::backend::StepCtx;
use crate::graph::{BufId, Sub};
use crate::model::Model;
use crate::Result;

/// Whether the mHC kernels take `model`'s streams.
pub(super) fn hc_ok(model: &Model) -> bool {
    (1..=MAX_HC).contains(&model.config.hc_mult)
}

/// The embedding table's format for `ds4_embed`, if it takes it.
pub(super) fn embed_format(model: &Model) -> Option<EmbedFormat> {
    let m = model.mat(model.global.embed);
    let fmt = match m.ty {
        crate::quant::GgmlType::F32 => EmbedFormat::F32,
        crate::quant::GgmlType::F16 => EmbedFormat::F16,
        crate::quant::GgmlType::Q8_0 => EmbedFormat::Q8_0,
        _ => return None,
    };
    (m.cols == model.config.d_model && fmt.row_bytes(m.cols) == Some(m.row_bytes)).then_some(fmt)
}

impl State {
    /// [`crate::graph::Op::Embed`].
    pub(super) fn embed(&mut self, cx: &StepCtx<'_>) -> Result<()> {
        let (model, n) = (cx.model, cx.batch.rows.len());
        let (c, e) = (&model.config, model.global.embed);
        let fmt = embed_format(model).ok_or_else(|| err("no CUDA kernel reads this embedding table".into()))?;
        let vocab = model.mat(e).rows;
        let tokens: Vec<i32> = cx
            .batch
            .rows
            .iter()
            .map(|r| i32::try_from(r.token).ok().filter(|&t| (t as usize) < vocab))
            .collect::<Option<_>>()
            .ok_or_else(|| err(format!("a token of the tick is outside the {vocab}-row embedding table")))?;
        let table = self.weight(model, e, false)?;
        let tb = self.scratch_with("tokens", bytemuck::cast_slice(&tokens))?;
        let streams = self.out(BufId::Streams, n * c.hc_mult * c.d_model * 4)?;
        let r = cuda_host::embed(&mut *self.dev, table, fmt, vocab, tb, streams, c.d_model, c.hc_mult, n);
        self.launched(r, 1)
    }

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
