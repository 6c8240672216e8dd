//! The head on the CUDA backend: the output projection of the tick's logit rows
//! ([`Op::Logits`](crate::graph::Op::Logits): the rows gathered on the device, then one product), the sampler's
//! candidates ([`Op::LogitCandidates`](crate::graph::Op::LogitCandidates): `ds4_top_candidates`, the sampler's
//! order exactly) and the tick's one host sync ([`Op::Readback`](crate::graph::Op::Readback)): the logit rows, or
//! only each row's `k` candidates when the batch asks for them (`k` ids and values instead of a vocabulary row).

use ds4_kernels_native::cuda_host;
use ds4_kernels_native::cuda_kernels::Plan;

use super::{dev_err, err, CudaBackend, State};
use crate::backend::StepCtx;
use crate::graph::BufId;
use crate::model::Model;
use crate::Result;

/// Whether the head runs on the CUDA kernels (its weight's format and shape; `k` candidates when given).
pub(super) fn head_ok(model: &Model, k: Option<usize>) -> bool {
    CudaBackend::product_ok(model, model.global.head)
        && k.is_none_or(|k| Plan::top_candidates(1, model.config.vocab, k).is_ok())
}

impl State {
    /// [`crate::graph::Op::Logits`].
    pub(super) fn logits(&mut self, cx: &StepCtx<'_>) -> Result<()> {
        let (model, n) = (cx.model, cx.batch.rows.len());
        let (d, vocab) = (model.config.d_model, model.config.vocab);
        let m = cx.batch.logit_rows.len();
        if m == 0 {
            return Ok(());
        }
        let rows: Vec<i32> = cx
            .batch
            .logit_rows
            .iter()
            .map(|&r| i32::try_from(r).ok().filter(|&r| (r as usize) < n))
            .collect::<Option<_>>()
            .ok_or_else(|| err(format!("logit rows {:?} outside the tick's {n} rows", cx.batch.logit_rows)))?;
        let x = self.input(BufId::HeadOut, n * d * 4)?;
        let list = self.scratch_with("logit_rows", bytemuck::cast_slice(&rows))?;
        let gathered = self.scratch("head_in", m * d * 4)?;
        let r = cuda_host::gather_rows(&mut *self.dev, x, list, gathered, d, m);
        self.launched(r, 1)?;
        let y = self.out(BufId::Logits, m * vocab * 4)?;
        self.product(model, model.global.head, gathered, m, y)
    }

    /// [`crate::graph::Op::LogitCandidates`].
    pub(super) fn candidates(&mut self, cx: &StepCtx<'_>, k: usize) -> Result<()> {
        let (m, vocab) = (cx.batch.logit_rows.len(), cx.model.config.vocab);
        if m == 0 {
            return Ok(());
        }
        let logits = self.input(BufId::Logits, m * vocab * 4)?;
        let ids = self.out(BufId::Candidates, m * k * 4)?;
        let vals = self.scratch("cand_vals", m * k * 4)?;
        let r = cuda_host::top_candidates(&mut *self.dev, logits, m, vocab, k, ids, vals);
        self.launched(r, 1)
    }

    /// [`crate::graph::Op::Readback`] of the logits or the candidates into the host outputs.
    pub(super) fn readback(&mut self, cx: &mut StepCtx<'_>, buf: BufId) -> Result<()> {
        let (m, vocab, k) = (cx.batch.logit_rows.len(), cx.model.config.vocab, cx.batch.candidates);
        if m == 0 {
            return Ok(());
        }
        let act = &mut *cx.act;
        match buf {
            BufId::Logits => {
                let b = self.input(BufId::Logits, m * vocab * 4)?;
                let out = act.logits.get_mut(..m * vocab).ok_or_else(|| err("logits buffer too small".into()))?;
                self.dev.read(b, bytemuck::cast_slice_mut(out)).map_err(dev_err)?;
                self.counters.device_to_host += (m * vocab * 4) as u64;
            }
            BufId::Candidates => {
                let ids = self.input(BufId::Candidates, m * k * 4)?;
                let vals = self.scratch("cand_vals", m * k * 4)?;
                let (Some(oi), Some(ov)) = (act.cand_ids.get_mut(..m * k), act.cand_vals.get_mut(..m * k)) else {
                    return Err(err("candidate buffers too small".into()));
                };
                self.dev.read(ids, bytemuck::cast_slice_mut(oi)).map_err(dev_err)?;
                self.dev.read(vals, bytemuck::cast_slice_mut(ov)).map_err(dev_err)?;
                self.counters.device_to_host += (2 * m * k * 4) as u64;
            }
            other => return Err(err(format!("no readback of {other:?} on cuda"))),
        }
        self.counters.readbacks += 1;
        Ok(())
    }
}
