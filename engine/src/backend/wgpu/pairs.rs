//! Two independent dispatches of one kernel as one dispatch.
//!
//! A decode tick holds pairs of small kernels that do not depend on each other and run back to back: the
//! attention's query-heads norm + RoPE and its KV-row norm + RoPE + FP8 (`norm.wgsl`'s `norm_rope`, one workgroup
//! per row, a handful of rows each). [`WgpuContext::norm_rope`] holds such a dispatch in the encoder; when the next
//! thing recorded is another `norm_rope` that is independent of it, both go out as one dispatch of
//! `norm_rope_pair` (the same row code over a second set of bindings, `ds4_shaders_wgsl::norm_rope_pair_source`),
//! otherwise the held one is recorded alone first. Each half computes exactly what it computes alone, so results
//! do not change; only the dispatch count does.
//!
//! Invariant: a held dispatch is recorded before anything recorded after it (every dispatch, copy, raw command
//! and submission flushes it first), and it is never held together with waiting copies ([`super::copies`]).

use super::context::{Enc, WgpuContext};
use crate::Result;

/// A held `norm_rope` dispatch: its buffers (x and y bound read-write, g and cs read-only, u its parameters) and
/// grid.
pub(crate) struct Held {
    x: wgpu::Buffer,
    y: wgpu::Buffer,
    g: wgpu::Buffer,
    u: wgpu::Buffer,
    cs: wgpu::Buffer,
    groups: [u32; 3],
}

impl Held {
    fn bound(&self, first: u32) -> [(u32, &wgpu::Buffer, u64, u64); 5] {
        let f = first;
        [
            (f, &self.x, 0, 0),
            (f + 1, &self.y, 0, 0),
            (f + 2, &self.g, 0, 0),
            (f + 3, &self.u, 0, 0),
            (f + 4, &self.cs, 0, 0),
        ]
    }

    /// Whether `self` and `o` may share a dispatch: neither writes (y) a buffer the other binds, and no buffer is
    /// bound read-write in one and read-only in the other (x is bound read-write: two reads of one x are fine).
    fn independent_of(&self, o: &Held) -> bool {
        let clear_of = |w: &wgpu::Buffer, h: &Held| *w != h.x && *w != h.y && *w != h.g && *w != h.cs;
        clear_of(&self.y, o)
            && clear_of(&o.y, self)
            && self.x != o.g
            && self.x != o.cs
            && o.x != self.g
            && o.x != self.cs
    }
}

impl WgpuContext {
    /// Records `norm.wgsl`'s `norm_rope` over `groups` with `(x, y, g, params, cs)` bound to bindings 0..4: held
    /// to pair with an independent `norm_rope` recorded next (see the module docs).
    pub fn norm_rope(&self, enc: &mut Enc, b: [&wgpu::Buffer; 5], groups: [u32; 3]) -> Result<()> {
        self.flush_segments(enc);
        let new = Held { x: b[0].clone(), y: b[1].clone(), g: b[2].clone(), u: b[3].clone(), cs: b[4].clone(), groups };
        if let Some(h) = enc.held.take() {
            if h.independent_of(&new) {
                let pl =
                    self.pipeline_entry("rms_norm_pair", &ds4_shaders_wgsl::norm_rope_pair_source(), "norm_rope_pair")?;
                let mut bound = h.bound(0).to_vec();
                bound.extend_from_slice(&new.bound(5));
                return self.record(enc, &pl, &bound, [h.groups[0].max(groups[0]), 2, 1]);
            }
            self.record_held(enc, h)?;
        }
        let max = self.limits.max_compute_workgroups_per_dimension;
        if groups[1] == 1 && groups[2] == 1 && groups[0] <= max {
            // Built now, so recording it later cannot fail.
            self.pipeline_entry("rms_norm", ds4_shaders_wgsl::RMS_NORM, "norm_rope")?;
            enc.held = Some(new);
            Ok(())
        } else {
            self.record_held(enc, new)
        }
    }

    /// Records the held dispatch, if any.
    pub(super) fn flush_held(&self, enc: &mut Enc) {
        if let Some(h) = enc.held.take() {
            // Its pipeline was built and its grid checked when it was held: recording it cannot fail.
            let _ = self.record_held(enc, h);
        }
    }

    fn record_held(&self, enc: &mut Enc, h: Held) -> Result<()> {
        let pl = self.pipeline_entry("rms_norm", ds4_shaders_wgsl::RMS_NORM, "norm_rope")?;
        self.record(enc, &pl, &h.bound(0), h.groups)
    }
}
