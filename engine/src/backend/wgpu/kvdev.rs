//! Device-resident session KV on wgpu: the shared device layer's mirrors ([`crate::backend::device::kv`]) with
//! wgpu buffers, the row copies the attention kernels record into the tick's encoder (as kernels where they can,
//! [`WgpuContext::copy`]), and the compressor frontier kernels of `kvdev.wgsl` ([`add_ape`], [`front_push`]).

pub use crate::backend::device::kv::RowTable;

use ds4_shaders_wgsl::pair::PairKernel;
use ds4_shaders_wgsl::params::ApeParams;

use super::context::{Enc, WgpuContext};
use super::matmul::u32_of;
use super::ops::groups;
use super::pairs::Use;
use crate::backend::wgpu::context::backend_err;
use crate::Result;

type Buf = wgpu::Buffer;

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

/// `g[off + r·w + c] += ape[((pos0 + r) % ratio)·w + c]` for `rows` rows of `w` (see `kvdev.wgsl`).
#[allow(clippy::too_many_arguments)]
pub fn add_ape(
    ctx: &WgpuContext,
    enc: &mut Enc,
    g: &Buf,
    off: usize,
    rows: usize,
    w: usize,
    ape: &Buf,
    pos0: usize,
    ratio: usize,
) -> Result<()> {
    if rows == 0 || w == 0 {
        return Ok(());
    }
    if ratio == 0 {
        return Err(backend_err("add_ape: ratio 0"));
    }
    let p = ApeParams {
        rows: u32_of(rows, "rows")?,
        w: u32_of(w, "w")?,
        pos0: u32_of(pos0 % ratio, "pos0")?,
        ratio: u32_of(ratio, "ratio")?,
        off: u32_of(off, "off")?,
        _p: [0; 3],
    };
    let pl = ctx.pipeline_entry("kvdev", ds4_shaders_wgsl::KVDEV, "add_ape")?;
    let ub = ctx.uniform("add_ape", &p);
    ctx.dispatch(enc, &pl, &[g, ape, &ub], [groups(w)?, p.rows, 1])
}

/// `kvdev.wgsl`'s `front_push`: rows `start .. start + rows` of `kv` and `gate` (`w` values each, positions
/// `pos0 ..`) into the pending slots of the frontier `(fkv, fgate)` (`2 · ratio` rows), the gate plus `ape`: a
/// compressor push that completes no block (`rows <= ratio`), one dispatch.
#[allow(clippy::too_many_arguments)]
pub fn front_push(
    ctx: &WgpuContext,
    enc: &mut Enc,
    (kv, gate): (&Buf, &Buf),
    start: usize,
    rows: usize,
    w: usize,
    ape: &Buf,
    (fkv, fgate): (&Buf, &Buf),
    pos0: usize,
    ratio: usize,
) -> Result<()> {
    if rows == 0 || w == 0 {
        return Ok(());
    }
    if ratio == 0 || rows > ratio {
        return Err(backend_err(format!("front_push: {rows} rows for ratio {ratio}")));
    }
    let p = ApeParams {
        rows: u32_of(rows, "rows")?,
        w: u32_of(w, "w")?,
        pos0: u32_of(pos0 % ratio, "pos0")?,
        ratio: u32_of(ratio, "ratio")?,
        off: u32_of(start * w, "off")?,
        _p: [0; 3],
    };
    let ub = ctx.uniform("front_push", &p);
    let (r, wr) = (Use::Read, Use::Write);
    let bound = [(1, ape, r), (2, &ub, r), (3, kv, r), (4, gate, r), (5, fkv, wr), (6, fgate, wr)];
    // Held to pair with the layer's other compressor's push (`pairs.rs`).
    ctx.dispatch_pairable(enc, PairKernel::FRONT_PUSH, ("kvdev", "front_push"), &bound, [groups(w)?, p.rows, 1])
}
