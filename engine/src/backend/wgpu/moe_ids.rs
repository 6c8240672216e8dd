//! Recorders for the expert-indexed MoE path: [`matmul_ids`] (`matmul_ids.wgsl`) multiplies each (row, slot) pair
//! by the rows of the expert the device-side router chose, and [`combine`] (`moe_ids.wgsl`) sums a row's expert
//! outputs in ascending expert order. Used for small (decode) batches with learned routing, so the router's choice
//! never has to be read back; larger batches group rows by expert on the host instead (weights read once per
//! expert). Nothing here submits.

use ds4_shaders_wgsl as sh;
use ds4_shaders_wgsl::params::{CombineParams, IdsParams};

use super::context::{backend_err, WgpuContext};
use super::matmul::{u32_of, View};
use super::weights::GpuWeight;
use crate::error::Result;

type Buf = wgpu::Buffer;

/// `y[q, r] = W[ids[q]·expert_rows + r] · x[q / x_div]` for `q < n_pairs`, `r < expert_rows` (`ids`: u32 expert
/// per pair, each `< w.rows / expert_rows`). One dispatch per weight chunk.
#[allow(clippy::too_many_arguments)]
pub fn matmul_ids(
    ctx: &WgpuContext,
    enc: &mut wgpu::CommandEncoder,
    w: &GpuWeight,
    expert_rows: usize,
    ids: &Buf,
    n_pairs: usize,
    x: View<'_>,
    x_div: usize,
    y: View<'_>,
) -> Result<()> {
    if expert_rows == 0 || x_div == 0 || !w.rows.is_multiple_of(expert_rows) {
        return Err(backend_err(format!("matmul_ids {}: {} rows in experts of {expert_rows}", w.name, w.rows)));
    }
    if n_pairs == 0 {
        return Ok(());
    }
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    if n_pairs > max {
        return Err(backend_err(format!("matmul_ids {}: {n_pairs} pairs exceed one dispatch", w.name)));
    }
    let pl = ctx.pipeline(&format!("matmul_ids_{:?}", w.format), sh::matmul_ids_source(w.format))?;
    let grid_x = expert_rows.min(max.min(32768));
    let expert_bytes = (expert_rows * w.row_bytes) as u64;
    let experts = n_pairs.min(w.rows / expert_rows) as u64;
    ctx.note_weights(n_pairs as u64 * expert_bytes, experts * expert_bytes);
    for chunk in &w.chunks {
        let p = IdsParams {
            expert_rows: u32_of(expert_rows, "expert rows")?,
            cols: u32_of(w.cols, "cols")?,
            n_pairs: u32_of(n_pairs, "pairs")?,
            row_bytes: u32_of(w.row_bytes, "row_bytes")?,
            chunk_first: u32_of(chunk.first_row, "chunk first row")?,
            chunk_rows: u32_of(chunk.rows, "chunk rows")?,
            x_offset: u32_of(x.offset, "x offset")?,
            x_stride: u32_of(x.stride, "x stride")?,
            x_div: u32_of(x_div, "x div")?,
            y_offset: u32_of(y.offset, "y offset")?,
            y_stride: u32_of(y.stride, "y stride")?,
            grid_x: grid_x as u32,
        };
        let u = ctx.uniform("matmul_ids", &p);
        let groups = [grid_x as u32, expert_rows.div_ceil(grid_x) as u32, p.n_pairs];
        ctx.dispatch(enc, &pl, &[&chunk.buffer, x.buf, y.buf, &u, ids], groups)?;
    }
    Ok(())
}

/// `out[r] = Σ_j eo[r·k + j]` over the k slots of row r in ascending (expert, slot) order, then `+ shared[r]` when
/// the shared expert's output is given (`sel`: u32 `[rows, k]`, `eo`: `[rows·k, n]`, `out` and `shared`:
/// `[rows, n]`): the whole combine in one dispatch.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    ctx: &WgpuContext,
    enc: &mut wgpu::CommandEncoder,
    eo: &Buf,
    sel: &Buf,
    out: &Buf,
    shared: Option<&Buf>,
    n: usize,
    rows: usize,
    k: usize,
) -> Result<()> {
    if n == 0 || rows == 0 || k == 0 {
        return Ok(());
    }
    let p = CombineParams {
        n: u32_of(n, "n")?,
        rows: u32_of(rows, "rows")?,
        k: u32_of(k, "k")?,
        has_shared: shared.is_some() as u32,
    };
    let pl = ctx.pipeline_entry("moe_ids", sh::MOE_IDS, "combine")?;
    let u = ctx.uniform("moe combine", &p);
    // Without a shared expert binding 4 is never read; any buffer fills it.
    let sh = shared.unwrap_or(eo);
    ctx.dispatch(enc, &pl, &[eo, sel, out, &u, sh], [u32_of(n.div_ceil(64), "groups")?, p.rows, 1])
}
