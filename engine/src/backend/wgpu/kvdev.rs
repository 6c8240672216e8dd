//! Device-resident session KV on wgpu: the shared device layer's mirrors ([`crate::backend::device::kv`]) with
//! wgpu buffers, plus the row copies the attention kernels record into the tick's encoder (as kernels where they can,
//! [`WgpuContext::copy`]).

pub use crate::backend::device::kv::RowTable;

use super::context::{Enc, WgpuContext};

/// A compressor frontier on wgpu.
pub type FrontDev = crate::backend::device::kv::FrontDev<WgpuContext>;
/// The page pools of one layer on wgpu.
pub type LayerPools = crate::backend::device::kv::LayerPools<WgpuContext>;
/// The tick tensors a roll-back log records from, on wgpu.
pub type LogSources<'a> = crate::backend::device::kv::LogSources<'a, WgpuContext>;
/// Every device mirror of the wgpu backend.
pub type DevKv = crate::backend::device::kv::DevKv<WgpuContext>;
/// One layer of a mirror on wgpu.
pub type LayerDev = crate::backend::device::kv::LayerDev<WgpuContext>;
/// The mirror of one session on wgpu.
pub type SlotKv = crate::backend::device::kv::SlotKv<WgpuContext>;

/// Records copies of rows `(src_row, dst_row)` of `width` values from `src` to `dst`, merging consecutive runs
/// ([`crate::backend::device::row_runs`]).
pub fn copy_rows(
    ctx: &WgpuContext,
    enc: &mut Enc,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    pairs: &[(usize, usize)],
    width: usize,
) {
    let b = (width * 4) as u64;
    crate::backend::device::row_runs(pairs, |s, d, n| {
        ctx.copy(enc, src, s as u64 * b, dst, d as u64 * b, n as u64 * b)
    });
}
