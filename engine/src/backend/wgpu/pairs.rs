//! Two independent dispatches of one kernel as one dispatch.
//!
//! A decode tick holds pairs of small kernels that do not depend on each other and run back to back: the
//! attention's query-heads norm + RoPE and its KV-row norm + RoPE + FP8 (`norm.wgsl`'s `norm_rope`), and a CSA
//! layer's two compressor pushes (`kvdev.wgsl`'s `front_push`, main and indexer), each a handful of workgroups.
//! [`WgpuContext::dispatch_pairable`] holds such a dispatch in the encoder; when the next thing recorded is a
//! dispatch of the same kernel that is independent of it, both go out as one dispatch of the kernel's pair
//! ([`ds4_shaders_wgsl::pair::PairKernel`]: the same code over a second set of bindings), otherwise the held one is
//! recorded alone first. Each half computes exactly what it computes alone, so results do not change; only the
//! dispatch count does. A pair binds twice the kernel's storage buffers: where the adapter's per-stage limit is
//! lower, nothing is paired.
//!
//! Invariant: a held dispatch is recorded before anything recorded after it (every dispatch, copy, raw command
//! and submission flushes it first), and it is never held together with waiting copies ([`super::copies`]).

use std::sync::Arc;

use ds4_shaders_wgsl::pair::PairKernel;

use super::context::{Enc, WgpuContext};
use crate::Result;

/// How a dispatch binds a buffer, for the independence check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Use {
    /// Read only (storage `read` or uniform).
    Read,
    /// Bound `read_write` but only read by the kernel (an in-place-capable input).
    ReadInRw,
    /// Written.
    Write,
}

/// A held dispatch: the kernel, its `(binding, buffer, use)` list and its grid.
pub(crate) struct Held {
    kernel: PairKernel,
    /// The single kernel's pipeline (built when held, so recording it later cannot fail on it).
    pipeline: Arc<wgpu::ComputePipeline>,
    bound: Vec<(u32, wgpu::Buffer, Use)>,
    groups: [u32; 3],
}

impl Held {
    /// Whether `self` and `o` may share a dispatch: a buffer both bind is read by both, through bindings of the
    /// same kind (WebGPU forbids a buffer bound read-only and read-write in one dispatch).
    fn independent_of(&self, o: &Held) -> bool {
        self.bound.iter().all(|(_, a, ua)| o.bound.iter().all(|(_, b, ub)| a != b || (ua == ub && *ua != Use::Write)))
    }

    fn bindings(&self, shift: u32) -> impl Iterator<Item = (u32, &wgpu::Buffer, u64, u64)> {
        self.bound.iter().map(move |(i, b, _)| (i + shift, b, 0, 0))
    }
}

/// The pair's grid: z picks the half (each half bounds-checks its own x and y).
fn pair_groups(a: [u32; 3], b: [u32; 3]) -> Option<[u32; 3]> {
    (a[2] == 1 && b[2] == 1).then_some([a[0].max(b[0]), a[1].max(b[1]), 2])
}

impl WgpuContext {
    /// Records one dispatch of `kernel`'s own entry (the single kernel of a [`PairKernel`]: `entry` of `base`) with
    /// `bound` — held to pair with an independent dispatch of the same kernel recorded next (see the module docs).
    pub(crate) fn dispatch_pairable(
        &self,
        enc: &mut Enc,
        kernel: PairKernel,
        (name, entry): (&str, &str),
        bound: &[(u32, &wgpu::Buffer, Use)],
        groups: [u32; 3],
    ) -> Result<()> {
        self.flush_segments(enc);
        let pipeline = self.pipeline_entry(name, kernel.base, entry)?;
        let bound = bound.iter().map(|&(i, b, u)| (i, b.clone(), u)).collect();
        let new = Held { kernel, pipeline, bound, groups };
        let fits = 2 * kernel.storage_bindings <= self.limits.max_storage_buffers_per_shader_stage;
        let pair = enc.held.as_ref().and_then(|h| {
            let same = h.kernel == kernel && fits && h.independent_of(&new);
            same.then(|| pair_groups(h.groups, groups)).flatten()
        });
        if let Some(g) = pair {
            // Where the pair's pipeline cannot be built, both run alone (below).
            match self.pipeline_lazy(kernel.name, kernel.entry, || kernel.source().into()) {
                Ok(pl) => {
                    if let Some(h) = enc.held.take() {
                        let bound: Vec<_> = h.bindings(0).chain(new.bindings(kernel.shift)).collect();
                        return self.record(enc, &pl, &bound, g);
                    }
                }
                Err(e) => tracing::warn!("{}: {e}; its dispatches run one by one", kernel.name),
            }
        }
        self.flush_held(enc);
        let max = self.limits.max_compute_workgroups_per_dimension;
        if groups.iter().all(|&g| g <= max) && pair_groups(groups, groups).is_some() {
            enc.held = Some(new);
            Ok(())
        } else {
            let bound: Vec<_> = new.bindings(0).collect();
            self.record(enc, &new.pipeline, &bound, groups)
        }
    }

    /// Records the held dispatch, if any.
    pub(super) fn flush_held(&self, enc: &mut Enc) {
        if let Some(h) = enc.held.take() {
            let bound: Vec<_> = h.bindings(0).collect();
            // Its pipeline was built and its grid checked when it was held: recording it cannot fail.
            let _ = self.record(enc, &h.pipeline, &bound, h.groups);
        }
    }
}
