//! What a stage recorder needs from the backend ([`StageResources`]: the context, cached device weights, uploads,
//! products) and the host-side RoPE table, so stage modules (`attn`) depend on this module, not on
//! [`super::backend`] (which calls them).

use std::sync::Arc;

use super::context::WgpuContext;
use super::matmul::View;
use super::weights::GpuWeight;
use crate::model::{Model, RopeFreqs, WeightId};
use crate::Result;

/// Device resources of the backend, as the stage recorders see them.
pub(super) trait StageResources {
    /// The device context.
    fn ctx(&self) -> &WgpuContext;
    /// Weight `id` on the device (uploaded on first use).
    fn weight(&self, model: &Model, id: WeightId) -> Result<Arc<GpuWeight>>;
    /// Small f32 tensor `id` on the device (uploaded on first use).
    fn dense_buf(&self, model: &Model, id: WeightId) -> Arc<wgpu::Buffer>;
    /// A fresh device buffer holding `data`.
    fn upload(&self, data: &[f32]) -> wgpu::Buffer;
    /// Records `y = W·x` for `n` rows.
    fn matvec(&self, enc: &mut wgpu::CommandEncoder, w: &GpuWeight, x: View<'_>, n: usize, y: View<'_>) -> Result<()>;
}

/// `(cos, sin)` per row and pair for `rope` at each position in `pos`.
pub(super) fn rope_table(rope: &RopeFreqs, pos: impl Iterator<Item = usize>) -> Vec<f32> {
    let mut out = Vec::new();
    for p in pos {
        for &f in &rope.inv_freq {
            let (s, c) = (p as f32 * f).sin_cos();
            out.extend([c, s]);
        }
    }
    out
}
