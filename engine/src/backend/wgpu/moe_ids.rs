//! Recorders for the expert-indexed MoE path: the router's choice stays on the device. [`matmul_ids`]
//! (`matmul_ids.wgsl`) multiplies each (row, slot) pair by the rows of the expert the device-side router chose —
//! for small (decode) batches, each pair reading its expert's rows; for larger ones [`group`] (`moe_group.wgsl`)
//! first sorts the pairs by expert into tiles of up to 8 on the device and [`matmul_tiles`] reads each expert's rows
//! once per tile, dispatched indirectly (the tile count never comes to the host). Both leave pair `q`'s output in
//! row `q`, so the SwiGLU and [`combine`] (`moe_ids.wgsl`: a row's expert outputs summed in ascending expert order)
//! are the same for either, and the values are the same bits. Nothing here submits.

use ds4_shaders_wgsl as sh;
use ds4_shaders_wgsl::params::{CombineParams, GroupParams, IdsParams};

use super::context::{backend_err, Enc, ScratchBuf, WgpuContext};
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

/// Pairs per tile of [`matmul_tiles`] (`TILE` in `moe_group.wgsl` and `lanes.wgsl`).
pub const PAIR_TILE: usize = 8;

/// Most experts [`group`] handles (`MAX_EXPERTS` in `moe_group.wgsl`).
pub const MAX_EXPERTS: usize = 1024;

/// Most weight chunks (bindings) of one expert product [`group`] plans for (`MAX_CHUNKS` in `moe_group.wgsl`).
pub const MAX_CHUNKS: usize = 64;

/// A MoE layer's (row, slot) pairs grouped by expert on the device ([`group`]): the plan (tile count, tiles, pair
/// order, each dispatch's first tile) and the indirect dispatch arguments (`args` at byte `12 · j` for dispatch
/// `j = product · MAX_CHUNKS + chunk`).
pub struct Tiles {
    pub plan: ScratchBuf,
    pub args: ScratchBuf,
    pub order_at: usize,
    pub base_at: usize,
    pub n_pairs: usize,
    /// The most tiles the plan can hold: `⌈pairs / 8⌉ + min(pairs, experts)`.
    pub max_tiles: usize,
}

impl std::fmt::Debug for Tiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tiles").field("n_pairs", &self.n_pairs).field("max_tiles", &self.max_tiles).finish()
    }
}

/// An expert product a grouping plans for: the weight (its chunks) and its rows per expert.
pub type TiledProduct<'a> = Option<(&'a GpuWeight, usize)>;

/// Records the grouping of the `n_pairs` pairs of `sel` (their experts, `< n_exp`) by expert into tiles
/// (`moe_group.wgsl`, one workgroup), with the indirect arguments of up to three expert products (`products[i]`,
/// used with `which = i` by [`matmul_tiles`]): each weight chunk's dispatch covers the tiles of the experts it
/// holds.
pub fn group(
    ctx: &WgpuContext,
    enc: &mut Enc,
    sel: &Buf,
    (n_pairs, n_exp): (usize, usize),
    products: [TiledProduct<'_>; 3],
) -> Result<Tiles> {
    let mut grids = [[0u32; 2]; 3];
    let mut bounds = vec![0u32; 2 * 3 * MAX_CHUNKS];
    for (i, p) in products.iter().enumerate() {
        let Some((w, er)) = *p else { continue };
        if er == 0 || w.chunks.len() > MAX_CHUNKS {
            return Err(backend_err(format!(
                "moe grouping: {} in {} chunks of experts of {er} rows",
                w.name,
                w.chunks.len()
            )));
        }
        grids[i] = tile_grid(ctx, w.format, er);
        for (c, ch) in w.chunks.iter().enumerate() {
            let j = 2 * (i * MAX_CHUNKS + c);
            bounds[j] = u32_of(ch.first_row / er, "expert")?;
            bounds[j + 1] = u32_of((ch.first_row + ch.rows).div_ceil(er), "expert")?;
        }
    }
    group_with(ctx, enc, sel, (n_pairs, n_exp), grids, &bounds)
}

/// [`group`] with the products' grids and chunk bounds given (`bounds[2j], bounds[2j + 1]`: the experts of dispatch
/// `j`).
pub(crate) fn group_with(
    ctx: &WgpuContext,
    enc: &mut Enc,
    sel: &Buf,
    (n_pairs, n_exp): (usize, usize),
    grids: [[u32; 2]; 3],
    bounds: &[u32],
) -> Result<Tiles> {
    if n_exp == 0 || n_exp > MAX_EXPERTS {
        return Err(backend_err(format!("moe grouping: {n_exp} experts (1 to {MAX_EXPERTS} on the device)")));
    }
    if bounds.len() != 2 * 3 * MAX_CHUNKS {
        return Err(backend_err(format!("moe grouping: {} chunk bounds", bounds.len())));
    }
    let max_tiles = n_pairs.div_ceil(PAIR_TILE) + n_pairs.min(n_exp);
    if max_tiles > ctx.limits.max_compute_workgroups_per_dimension as usize {
        return Err(backend_err(format!("moe grouping: {n_pairs} pairs make too many tiles for one dispatch")));
    }
    let order_at = 1 + 3 * max_tiles;
    let base_at = order_at + n_pairs;
    let (plan, args) = (ctx.scratch(base_at + 3 * MAX_CHUNKS), ctx.scratch(3 * 3 * MAX_CHUNKS));
    let p = GroupParams {
        n_pairs: u32_of(n_pairs, "pairs")?,
        n_exp: u32_of(n_exp, "experts")?,
        order_at: u32_of(order_at, "order")?,
        base_at: u32_of(base_at, "bases")?,
        grid0: [grids[0][0], grids[0][1], 0, 0],
        grid1: [grids[1][0], grids[1][1], 0, 0],
        grid2: [grids[2][0], grids[2][1], 0, 0],
    };
    let pl = ctx.pipeline_entry("moe_group", sh::MOE_GROUP, "group")?;
    let u = ctx.uniform("moe group", &p);
    let bb = ctx.storage_u32("moe chunk bounds", bounds);
    ctx.dispatch(enc, &pl, &[sel, &plan, &args, &u, &bb], [1, 1, 1])?;
    Ok(Tiles { plan, args, order_at, base_at, n_pairs, max_tiles })
}

/// `y[q, r] = W[e·expert_rows + r] · x[q / x_div]` for every pair `q` of the tiles (expert `e` = its tile's), `r <
/// expert_rows`: [`matmul_ids`]'s values bit for bit, each expert's rows read once per tile. Product `which` of
/// the grouping (planned for this weight and `expert_rows`); one dispatch per weight chunk, over the tiles of the
/// experts the chunk holds.
#[allow(clippy::too_many_arguments)]
pub fn matmul_tiles(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    expert_rows: usize,
    (tiles, which): (&Tiles, usize),
    x: View<'_>,
    x_div: usize,
    y: View<'_>,
) -> Result<()> {
    if expert_rows == 0 || x_div == 0 || !w.rows.is_multiple_of(expert_rows) || which > 2 || w.chunks.len() > MAX_CHUNKS
    {
        return Err(backend_err(format!("matmul_tiles {}: {} rows in experts of {expert_rows}", w.name, w.rows)));
    }
    if tiles.n_pairs == 0 {
        return Ok(());
    }
    let pl = product_pipeline(ctx, w.format, true, "tiles")?;
    let groups = tile_grid(ctx, w.format, expert_rows);
    let expert_bytes = (expert_rows * w.row_bytes) as u64;
    // The tile count stays on the device: fetched is its bound.
    let experts = tiles.n_pairs.min(w.rows / expert_rows) as u64;
    ctx.note_weights(tiles.max_tiles as u64 * expert_bytes, experts * expert_bytes);
    for (ci, chunk) in w.chunks.iter().enumerate() {
        if ci > 0 {
            ctx.note_split();
        }
        let p = IdsParams {
            order_at: u32_of(tiles.order_at, "order")?,
            base_at: u32_of(tiles.base_at + which * MAX_CHUNKS + ci, "base")?,
            ..ids_params(w, chunk, (expert_rows, tiles.n_pairs), (x, x_div, y), groups[0])?
        };
        let u = ctx.uniform("matmul tiles", &p);
        let bindings = [(0, &chunk.buffer), (1, x.buf), (2, y.buf), (3, &u), (6, &*tiles.plan)];
        let at = 12 * (which * MAX_CHUNKS + ci) as u64;
        ctx.dispatch_indirect(enc, &pl, &bindings, (&*tiles.args, at))?;
    }
    Ok(())
}

/// The (x, y) workgroup grid of [`matmul_tiles`] over experts of `expert_rows` rows of format `f`.
pub fn tile_grid(ctx: &WgpuContext, f: ds4_shaders_wgsl::WeightFormat, expert_rows: usize) -> [u32; 2] {
    let g = product_grid(ctx, f, expert_rows, 1);
    [g[0], g[1]]
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
        let mut p = ids_params(w, chunk, (out_rows, n_pairs), (x, x_div, y), groups[0])?;
        set(&mut p, ci);
        let u = ctx.uniform(entry, &p);
        let mut bindings = vec![(0, &chunk.buffer), (1, x.buf), (2, y.buf), (3, &u), (4, ids)];
        bindings.extend(aux.map(|a| (5, a)));
        ctx.dispatch_at(enc, &pl, &bindings, groups)?;
    }
    Ok(())
}

/// The `matmul_ids.wgsl` parameters every entry shares: `rows` outputs per pair of `n_pairs`, over `chunk` of `w`.
fn ids_params(
    w: &GpuWeight,
    chunk: &super::weights::WeightChunk,
    (rows, n_pairs): (usize, usize),
    (x, x_div, y): (View<'_>, usize, View<'_>),
    grid_x: u32,
) -> Result<IdsParams> {
    Ok(IdsParams {
        expert_rows: u32_of(rows, "expert rows")?,
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
        grid_x,
        ..Default::default()
    })
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
