//! Recorders for the expert-indexed MoE path: [`matmul_ids`] (`matmul_ids.wgsl`) multiplies each (row, slot) pair
//! by the rows of the expert the device-side router chose, and [`combine`] (`moe_ids.wgsl`) sums a row's expert
//! outputs in ascending expert order. Used for small (decode) batches with learned routing, so the router's choice
//! never has to be read back; larger batches group rows by expert on the host instead (weights read once per
//! expert). Nothing here submits.

use ds4_shaders_wgsl as sh;
use ds4_shaders_wgsl::params::{CombineParams, IdsParams};

use super::context::{backend_err, Enc, WgpuContext};
use super::matmul::{product_grid, product_pipeline, u32_of, View};
use super::weights::GpuWeight;
use crate::error::Result;

type Buf = wgpu::Buffer;

/// `y[q, r] = W[ids[q]·expert_rows + r] · x[q / x_div]` for `q < n_pairs`, `r < expert_rows` (`ids`: u32 expert
/// per pair, each `< w.rows / expert_rows`). One dispatch per weight chunk.
#[allow(clippy::too_many_arguments)]
pub fn matmul_ids(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    expert_rows: usize,
    ids: &Buf,
    n_pairs: usize,
    x: View<'_>,
    x_div: usize,
    y: View<'_>,
) -> Result<()> {
    ids_dispatch(ctx, enc, w, "main", expert_rows, expert_rows, n_pairs, (x, x_div, y), (ids, None), |_, _| {})
}

/// The decode MoE's gate + up + SwiGLU in one dispatch per weight chunk (`matmul_ids.wgsl`'s `gate_up_swiglu`):
/// `w` is the interleaved gate|up pair (experts of `2·ffn` rows, [`GpuWeight::upload_interleaved`]); for pair
/// `q < n_pairs` (expert `ids[q]`, input row `q / x_div`) and `r < ffn`, `y[q, r]` = the clamped SwiGLU of its gate
/// and up dots times `rw[q]` — bit for bit [`matmul_ids`] then `moe.wgsl`'s `swiglu`.
#[allow(clippy::too_many_arguments)]
pub fn gate_up_swiglu(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    ffn: usize,
    (ids, rw): (&Buf, &Buf),
    n_pairs: usize,
    x: View<'_>,
    x_div: usize,
    y: View<'_>,
    limit: f32,
) -> Result<()> {
    ids_dispatch(ctx, enc, w, "gate_up_swiglu", 2 * ffn, ffn, n_pairs, (x, x_div, y), (ids, Some(rw)), |p, _| {
        p.limit = limit;
        p.route_weighted = 1;
    })
}

/// The decode MoE's down product and the sum over each row's experts in one dispatch (`matmul_ids.wgsl`'s
/// `down_combine`, no atomics): `out[t, r]` = the down dots of token `t`'s `k` slots (slot `t·k + j` of `h`, expert
/// `ids[t·k + j]`) summed in ascending (expert, slot) order, plus `shared[t, r]` — bit for bit [`matmul_ids`] then
/// [`combine`]. One dispatch per weight chunk of `w` (experts of `d` rows), each adding the slots whose rows it
/// holds, in order (so the sum keeps ascending expert order).
#[allow(clippy::too_many_arguments)]
pub fn down_combine(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    d: usize,
    ids: &Buf,
    (rows, k): (usize, usize),
    h: View<'_>,
    out: &Buf,
    shared: Option<&Buf>,
) -> Result<()> {
    if k == 0 {
        return Err(backend_err(format!("down_combine {}: no slots per row", w.name)));
    }
    let aux = Some(shared.unwrap_or(h.buf));
    let y = View::new(out, d);
    let last = w.chunks.len().saturating_sub(1);
    ids_dispatch(ctx, enc, w, "down_combine", d, d, rows * k, (h, k, y), (ids, aux), |p, chunk| {
        p.accumulate = (chunk > 0) as u32;
        p.has_shared = (shared.is_some() && chunk == last) as u32;
    })
}

/// One dispatch per chunk of a `matmul_ids.wgsl` entry: experts of `expert_rows` rows, `out_rows` outputs per pair
/// (per token for `down_combine`, whose workgroups cover `n_pairs / x_div` tokens), `aux` binding 5 for the entries
/// that read it, `set` fills the entry's own parameters (given the chunk's index).
#[allow(clippy::too_many_arguments)]
fn ids_dispatch(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    entry: &str,
    expert_rows: usize,
    out_rows: usize,
    n_pairs: usize,
    (x, x_div, y): (View<'_>, usize, View<'_>),
    (ids, aux): (&Buf, Option<&Buf>),
    set: impl Fn(&mut IdsParams, usize),
) -> Result<()> {
    let per_token = entry == "down_combine";
    let what = if entry == "main" { "matmul_ids" } else { entry };
    if expert_rows == 0
        || x_div == 0
        || !w.rows.is_multiple_of(expert_rows)
        || per_token && !n_pairs.is_multiple_of(x_div)
    {
        return Err(backend_err(format!(
            "{what} {}: {} rows in experts of {expert_rows}, {n_pairs} pairs by {x_div}",
            w.name, w.rows
        )));
    }
    if n_pairs == 0 {
        return Ok(());
    }
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let z = if per_token { n_pairs / x_div } else { n_pairs };
    if z > max {
        return Err(backend_err(format!("{what} {}: {n_pairs} pairs exceed one dispatch", w.name)));
    }
    let pl = product_pipeline(ctx, w.format, true, entry)?;
    let groups = product_grid(ctx, w.format, out_rows, z);
    let expert_bytes = (expert_rows * w.row_bytes) as u64;
    let experts = n_pairs.min(w.rows / expert_rows) as u64;
    ctx.note_weights(n_pairs as u64 * expert_bytes, experts * expert_bytes);
    for (ci, chunk) in w.chunks.iter().enumerate() {
        if ci > 0 {
            ctx.note_split();
        }
        let mut p = IdsParams {
            expert_rows: u32_of(out_rows, "expert rows")?,
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
            grid_x: groups[0],
            ..Default::default()
        };
        set(&mut p, ci);
        let u = ctx.uniform(entry, &p);
        let mut bindings = vec![(0, &chunk.buffer), (1, x.buf), (2, y.buf), (3, &u), (4, ids)];
        bindings.extend(aux.map(|a| (5, a)));
        ctx.dispatch_at(enc, &pl, &bindings, groups)?;
    }
    Ok(())
}

/// `out[r] = Σ_j eo[r·k + j]` over the k slots of row r in ascending (expert, slot) order, then `+ shared[r]` when
/// the shared expert's output is given (`sel`: u32 `[rows, k]`, `eo`: `[rows·k, n]`, `out` and `shared`:
/// `[rows, n]`): the whole combine in one dispatch.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    ctx: &WgpuContext,
    enc: &mut Enc,
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
