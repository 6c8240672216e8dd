//! Quantized matrix products and row gathers on [`GpuWeight`]s, across chunk boundaries.
//!
//! [`matmul`] computes `y[t, r] (+)= W[rows.start + r, :] · x[t, :]` for every token `t < n_tok`, issuing one dispatch
//! per weight chunk the row range touches; a workgroup takes `rows_per_workgroup` rows of the weight's format
//! ([`ds4_shaders_wgsl::WeightFormat::row_lanes`] lanes each) for a tile of [`MATMUL_TILE`] tokens, so a prefill
//! chunk streams each weight row once per tile, with every token's result bit-identical to a one-token product.
//! The lanes of a row are summed by the context's [`ds4_shaders_wgsl::Reduce`] (subgroup shuffles where the
//! adapter has them; the same bits either way). [`get_rows`] copies (dequantizes) rows of a weight into an f32 buffer —
//! the embedding lookup. Both only record commands; the caller submits.
//!
//! Layout conventions: activations are f32, token-major: element `(t, c)` of `x` is `x[x.offset + t * x.stride + c]`,
//! likewise for `y`. Offsets/strides are in f32 elements. The caller guarantees the buffers are large enough; out of
//! range writes are dropped by wgpu's robust buffer access rather than corrupting memory.

use ds4_shaders_wgsl::params::{GetRowsParams, MatmulParams};
use std::ops::Range;
use std::sync::Arc;

use ds4_shaders_wgsl::WeightFormat;

use super::context::{backend_err, Enc, WgpuContext};
use super::weights::GpuWeight;
use crate::error::Result;

/// Where a token-major f32 matrix lives: buffer, element offset, element stride between tokens.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub buf: &'a wgpu::Buffer,
    pub offset: usize,
    pub stride: usize,
}

impl<'a> View<'a> {
    /// A view at offset 0 with the given stride.
    pub fn new(buf: &'a wgpu::Buffer, stride: usize) -> Self {
        Self { buf, offset: 0, stride }
    }

    /// The same view shifted by `d` elements.
    pub fn at(self, d: usize) -> Self {
        Self { offset: self.offset + d, ..self }
    }
}

fn name(kind: &str, f: WeightFormat) -> String {
    format!("{kind}_{f:?}")
}

/// The compiled entry `entry` of `matmul.wgsl` (`ids` false) or `matmul_ids.wgsl` (`ids` true) over format `f`, in
/// the device's lane-sum variant (named `{kernel}_{format}_{variant}`; the source is composed only to compile it).
pub(crate) fn product_pipeline(
    ctx: &WgpuContext,
    f: WeightFormat,
    ids: bool,
    entry: &str,
) -> Result<Arc<wgpu::ComputePipeline>> {
    let r = ctx.reduce();
    let kernel = if ids { "matmul_ids" } else { "matmul" };
    ctx.pipeline_lazy(&format!("{kernel}_{f:?}_{}", r.tag()), entry, || {
        if ids {
            f.matmul_ids_source_with(r)
        } else {
            f.matmul_source_with(r)
        }
    })
}

/// The dispatch grid for `rows` weight rows of format `f` (`rows_per_workgroup` each) and `z` tiles or pairs:
/// `(grid_x, grid_y, z)`, grid_x ≤ 32768 (the kernels number workgroups `wg.x + wg.y · grid_x`).
pub(crate) fn product_grid(ctx: &WgpuContext, f: WeightFormat, rows: usize, z: usize) -> [u32; 3] {
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let n = rows.div_ceil(f.rows_per_workgroup()).max(1);
    let grid_x = n.min(max.min(32768));
    [grid_x as u32, n.div_ceil(grid_x) as u32, z as u32]
}

pub(crate) fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| backend_err(format!("{what} = {v} does not fit in u32")))
}

/// Tokens per workgroup of the matmul kernel (`TILE` in `matmul.wgsl`): a weight row is streamed once per tile.
pub const MATMUL_TILE: usize = 8;

/// Records `y[t, r] (+)= W[rows.start + r] · x[t]` for `r < rows.len()`, `t < n_tok` (see module docs).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    rows: Range<usize>,
    x: View<'_>,
    n_tok: usize,
    y: View<'_>,
    accumulate: bool,
) -> Result<()> {
    product(ctx, enc, w, rows, x, n_tok, y, accumulate, 0)
}

/// Records the grouped product `y[t, r] = W[r] · x[t, g·cols..(g+1)·cols]` with `g = r / group_rows`, for every
/// row of `w` and `t < n_tok`, in one dispatch per weight chunk (each row's result bit for bit that of a product
/// of its group alone).
pub fn grouped_matmul(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    group_rows: usize,
    x: View<'_>,
    n_tok: usize,
    y: View<'_>,
) -> Result<()> {
    if group_rows == 0 || !w.rows.is_multiple_of(group_rows) {
        return Err(backend_err(format!("grouped matmul {}: {} rows in groups of {group_rows}", w.name, w.rows)));
    }
    product(ctx, enc, w, 0..w.rows, x, n_tok, y, false, group_rows)
}

#[allow(clippy::too_many_arguments)]
fn product(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    rows: Range<usize>,
    x: View<'_>,
    n_tok: usize,
    y: View<'_>,
    accumulate: bool,
    group_rows: usize,
) -> Result<()> {
    if rows.end > w.rows || rows.start > rows.end {
        return Err(backend_err(format!("matmul {}: rows {rows:?} out of 0..{}", w.name, w.rows)));
    }
    if n_tok == 0 || rows.is_empty() {
        return Ok(());
    }
    let pipeline = product_pipeline(ctx, w.format, false, "main")?;
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let tiles = n_tok.div_ceil(MATMUL_TILE);
    if tiles > max {
        return Err(backend_err(format!("matmul {}: {n_tok} tokens exceed one dispatch", w.name)));
    }
    // Each workgroup streams its row once per tile of tokens.
    let bytes = (rows.len() * w.row_bytes) as u64;
    ctx.note_weights(bytes * tiles as u64, bytes);
    let first = rows.start;
    for (i, (chunk, local, out_off)) in w.pieces(rows).enumerate() {
        if i > 0 {
            ctx.note_split();
        }
        let n = local.len();
        let groups = product_grid(ctx, w.format, n, tiles);
        let params = MatmulParams {
            rows: u32_of(n, "rows")?,
            cols: u32_of(w.cols, "cols")?,
            n_tok: u32_of(n_tok, "n_tok")?,
            row_bytes: u32_of(w.row_bytes, "row_bytes")?,
            row_base: u32_of(local.start, "row_base")?,
            x_offset: u32_of(x.offset, "x offset")?,
            x_stride: u32_of(x.stride, "x stride")?,
            y_offset: u32_of(y.offset + out_off, "y offset")?,
            y_stride: u32_of(y.stride, "y stride")?,
            grid_x: groups[0],
            accumulate: accumulate as u32,
            group_rows: u32_of(group_rows, "group rows")?,
            group_row0: u32_of(first + out_off, "group row")?,
            ..Default::default()
        };
        let u = ctx.uniform("matmul params", &params);
        ctx.dispatch(enc, &pipeline, &[&chunk.buffer, x.buf, y.buf, &u], groups)?;
    }
    Ok(())
}

/// Most products one [`multi_product`] dispatch takes (`matmul.wgsl`'s entry `multi`).
pub const MULTI_OUTPUTS: usize = 6;

/// Records the products of one input by several weights in one dispatch: `w` is their rows one after another in
/// one chunk (product `k`'s rows end at `ends[k]`, the last at `w.rows`), and product `k`'s `[n_tok, rows_k]`
/// result goes to `ys[k]` (offset 0, stride `rows_k`). Each value is bit for bit what [`matmul`] gives for that
/// product alone.
pub fn multi_product(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    ends: &[usize],
    x: View<'_>,
    n_tok: usize,
    ys: &[&wgpu::Buffer],
) -> Result<()> {
    let k = ys.len();
    let ordered = ends.windows(2).all(|e| e[0] <= e[1]);
    if k == 0 || k > MULTI_OUTPUTS || ends.len() != k || ends.last() != Some(&w.rows) || !ordered {
        return Err(backend_err(format!("multi product {}: ends {ends:?} of {} rows for {k} outputs", w.name, w.rows)));
    }
    let [chunk] = w.chunks.as_slice() else {
        return Err(backend_err(format!("multi product {}: {} chunks (one expected)", w.name, w.chunks.len())));
    };
    if n_tok == 0 || w.rows == 0 {
        return Ok(());
    }
    let pipeline = product_pipeline(ctx, w.format, false, "multi")?;
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let tiles = n_tok.div_ceil(MATMUL_TILE);
    if tiles > max {
        return Err(backend_err(format!("multi product {}: {n_tok} tokens exceed one dispatch", w.name)));
    }
    let bytes = (w.rows * w.row_bytes) as u64;
    ctx.note_weights(bytes * tiles as u64, bytes);
    let end = |i: usize| u32_of(ends.get(i).copied().unwrap_or(w.rows), "product end");
    let groups = product_grid(ctx, w.format, w.rows, tiles);
    let params = MatmulParams {
        rows: u32_of(w.rows, "rows")?,
        cols: u32_of(w.cols, "cols")?,
        n_tok: u32_of(n_tok, "n_tok")?,
        row_bytes: u32_of(w.row_bytes, "row_bytes")?,
        x_offset: u32_of(x.offset, "x offset")?,
        x_stride: u32_of(x.stride, "x stride")?,
        grid_x: groups[0],
        outputs: k as u32,
        end1: end(0)?,
        end2: end(1)?,
        end3: end(2)?,
        end4: end(3)?,
        end5: end(4)?,
        ..Default::default()
    };
    let u = ctx.uniform("multi product params", &params);
    // Outputs past the last are never written; they are bound to the first.
    let y = |i: usize| ys.get(i).copied().unwrap_or(ys[0]);
    let bindings =
        [(0, &chunk.buffer), (1, x.buf), (2, y(0)), (3, &u), (4, y(1)), (5, y(2)), (6, y(3)), (7, y(4)), (8, y(5))];
    ctx.dispatch_at(enc, &pipeline, &bindings, groups)
}

/// Records a dense expert's gate + up + SwiGLU in one dispatch (`matmul.wgsl`'s `swiglu_pair`): `w` is the gate
/// rows then the up rows (one chunk; [`GpuWeight::upload_interleaved`] with one group), and `y[t, r]` for
/// `r < w.rows / 2` is the clamped SwiGLU of the two dots — bit for bit [`matmul`] then `moe.wgsl`'s `swiglu`.
pub fn swiglu_pair(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    x: View<'_>,
    n_tok: usize,
    y: View<'_>,
    limit: f32,
) -> Result<()> {
    let [chunk] = w.chunks.as_slice() else {
        return Err(backend_err(format!("swiglu pair {}: {} chunks (one expected)", w.name, w.chunks.len())));
    };
    if !w.rows.is_multiple_of(2) {
        return Err(backend_err(format!("swiglu pair {}: {} rows (gate and up halves expected)", w.name, w.rows)));
    }
    let rows = w.rows / 2;
    if n_tok == 0 || rows == 0 {
        return Ok(());
    }
    let pipeline = product_pipeline(ctx, w.format, false, "swiglu_pair")?;
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let tiles = n_tok.div_ceil(MATMUL_TILE);
    if tiles > max {
        return Err(backend_err(format!("swiglu pair {}: {n_tok} tokens exceed one dispatch", w.name)));
    }
    let bytes = (w.rows * w.row_bytes) as u64;
    ctx.note_weights(bytes * tiles as u64, bytes);
    let groups = product_grid(ctx, w.format, rows, tiles);
    let params = MatmulParams {
        rows: u32_of(rows, "rows")?,
        cols: u32_of(w.cols, "cols")?,
        n_tok: u32_of(n_tok, "n_tok")?,
        row_bytes: u32_of(w.row_bytes, "row_bytes")?,
        x_offset: u32_of(x.offset, "x offset")?,
        x_stride: u32_of(x.stride, "x stride")?,
        y_offset: u32_of(y.offset, "y offset")?,
        y_stride: u32_of(y.stride, "y stride")?,
        grid_x: groups[0],
        limit,
        ..Default::default()
    };
    let u = ctx.uniform("swiglu pair params", &params);
    ctx.dispatch(enc, &pipeline, &[&chunk.buffer, x.buf, y.buf, &u], groups)
}

/// Records the embedding of a tick's rows into the mHC streams and the streams' unweighted RMSNorm
/// (`get_rows.wgsl`'s `embed_norm`, one dispatch per weight chunk holding one of the tokens): row `r` of `streams`
/// is `copies` copies of `w`'s row `tokens[r]`, row `r` of `normed` its RMSNorm over all `copies · w.cols` values —
/// bit for bit [`get_rows`] then `norm.wgsl`'s `main` without weight.
pub fn embed_norm(
    ctx: &WgpuContext,
    enc: &mut Enc,
    w: &GpuWeight,
    tokens: &[usize],
    copies: usize,
    (streams, normed): (&wgpu::Buffer, &wgpu::Buffer),
    eps: f32,
) -> Result<()> {
    let pipeline = ctx.pipeline_entry(&name("get_rows", w.format), w.format.get_rows_source(), "embed_norm")?;
    let bytes = (tokens.len() * w.row_bytes) as u64;
    ctx.note_weights(bytes, bytes);
    let ids: Vec<(usize, usize)> = tokens.iter().copied().zip(0..).collect();
    for (chunk, pairs) in chunk_pairs(ctx, w, &ids, "embed")? {
        let params = GetRowsParams {
            n_ids: u32_of(pairs.len() / 2, "ids")?,
            cols: u32_of(w.cols, "cols")?,
            row_bytes: u32_of(w.row_bytes, "row_bytes")?,
            copies: u32_of(copies, "copies")?,
            eps,
            ..Default::default()
        };
        let idb = ctx.storage_init("embed ids", bytemuck::cast_slice(&pairs));
        let u = ctx.uniform("embed_norm params", &params);
        let bindings = [(0, &chunk.buffer), (1, &idb), (2, streams), (3, &u), (5, normed)];
        ctx.dispatch_at(enc, &pipeline, &bindings, [params.n_ids, 1, 1])?;
    }
    Ok(())
}

/// The `(row, out)` pairs of `ids` by the chunk of `w` holding the row, as (local row, out) u32 pairs, for the chunks
/// holding any (each after the first counted as a split dispatch); an error names a row outside `w`.
fn chunk_pairs<'w>(
    ctx: &WgpuContext,
    w: &'w GpuWeight,
    ids: &[(usize, usize)],
    what: &str,
) -> Result<Vec<(&'w super::weights::WeightChunk, Vec<u32>)>> {
    let mut by_chunk: Vec<Vec<u32>> = vec![Vec::new(); w.chunks.len()];
    for &(row, out) in ids {
        let (c, local) =
            w.locate(row).ok_or_else(|| backend_err(format!("{what} {}: row {row} out of 0..{}", w.name, w.rows)))?;
        by_chunk[c].extend([u32_of(local, "row")?, u32_of(out, "out")?]);
    }
    let used: Vec<_> = w.chunks.iter().zip(by_chunk).filter(|(_, p)| !p.is_empty()).collect();
    (1..used.len()).for_each(|_| ctx.note_split());
    Ok(used)
}

/// Records `y[out_k] = W[row_k]` (dequantized) for each `(row_k, out_k)` in `ids` (see module docs).
pub fn get_rows(ctx: &WgpuContext, enc: &mut Enc, w: &GpuWeight, ids: &[(usize, usize)], y: View<'_>) -> Result<()> {
    let pipeline = ctx.pipeline(&name("get_rows", w.format), w.format.get_rows_source())?;
    let bytes = (ids.len() * w.row_bytes) as u64;
    ctx.note_weights(bytes, bytes);
    for (chunk, pairs) in chunk_pairs(ctx, w, ids, "get_rows")? {
        let n_ids = pairs.len() / 2;
        let params = GetRowsParams {
            n_ids: n_ids as u32,
            cols: u32_of(w.cols, "cols")?,
            row_bytes: u32_of(w.row_bytes, "row_bytes")?,
            y_offset: u32_of(y.offset, "y offset")?,
            y_stride: u32_of(y.stride, "y stride")?,
            ..Default::default()
        };
        let idb = ctx.storage_init("get_rows ids", bytemuck::cast_slice(&pairs));
        let u = ctx.uniform("get_rows params", &params);
        let groups = [w.cols.div_ceil(64) as u32, u32_of(n_ids, "ids")?, 1];
        ctx.dispatch(enc, &pipeline, &[&chunk.buffer, &idb, y.buf, &u], groups)?;
    }
    Ok(())
}

/// Per-matrix accuracy of the WGSL quantized matmul against an f64 product of the dequantized weights
/// (`quant::dequantize_row`) and the f32 activations, next to the CPU backend's two paths (Q8_0/Q8_K-quantized
/// activations, and f32 activations).
///
/// Tolerances are worst-case f32 rounding bounds, derived from each kernel's summation structure (not from observed
/// errors): a sum whose every term passes through at most `L` roundings is off by at most `L·u·M`, u = 2^-24,
/// M = the sum of the terms' magnitudes. For the k-quants the kernels sum `d·sc·q·x` and `dmin·m·x` separately,
/// so M counts both parts (`Σ (|d·sc·q| + |dmin·m|)·|x|`, measured by dequantizing with `dmin` and then `d` zeroed).
/// The reference's own f32 dequantization adds 3 roundings per weight. A single wrong weight among `cols` moves
/// a result by ~M/cols, tens of times the bound at these sizes (checked by the mutation assertion).
#[cfg(test)]
mod accuracy_tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::super::tests::{ctx_with, dequant_matrix, random_weight};
    use super::*;
    use crate::backend::cpu::matmul as cpu;
    use crate::backend::cpu::pool::Pool;
    use crate::model::Mat;
    use crate::quant::{self, GgmlType};

    const U: f64 = 1.0 / (1u64 << 24) as f64;

    const TYPES: [GgmlType; 7] =
        [GgmlType::F32, GgmlType::F16, GgmlType::Bf16, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs];

    /// Byte offsets (within a block) of the f16 scale fields `(d, dmin)` of the k-quants.
    fn kquant_scales(ty: GgmlType) -> Option<(usize, usize)> {
        match ty {
            GgmlType::Q2K => Some((80, 82)),
            GgmlType::Q4K => Some((0, 2)),
            _ => None,
        }
    }

    /// Longest chain of roundings one product goes through in the WGSL kernel (see `quant_*.wgsl`, `matmul.wgsl`):
    /// the in-block products and partial sums, the lane's loop over its blocks, the lane tree (log2 of the lanes per
    /// row), the optional accumulate (1), plus 3 for the reference's dequantization.
    fn gpu_chain(ty: GgmlType, cols: usize) -> usize {
        let in_block = match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            // i8·x, 4 per line (3 adds), 8 lines, × d.
            GgmlType::Q8_0 => 1 + 3 + 8 + 1,
            // q·x, 16 per sub-block, (d·sc)·sq and the min part, subtraction, 16 sub-blocks.
            GgmlType::Q2K => 1 + 16 + 2 + 1 + 16,
            // q·x, 32 per sub-block, (d·sc)·sq and the min part, subtraction, 8 sub-blocks.
            GgmlType::Q4K => 1 + 32 + 2 + 1 + 8,
            // ±mag·x, 32 per group, d·(0.5+s)·0.25·sg (3), 8 groups.
            GgmlType::Iq2Xxs => 1 + 32 + 3 + 8,
            other => panic!("no WGSL matmul for {other}"),
        };
        let lanes = super::super::weights::weight_format(ty).expect("a WGSL format").row_lanes();
        in_block + (cols / ty.block_values()).div_ceil(lanes) + lanes.ilog2() as usize + 1 + 3
    }

    /// Per row: the magnitudes `(|d·sc·q|, |dmin·m|)` split as the kernels sum them (the second is zero for the
    /// non-k-quants), as `|w|`-like matrices.
    fn magnitudes(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
        let w = dequant_matrix(ty, data, rows, cols);
        let Some((d, dmin)) = kquant_scales(ty) else {
            return w.iter().map(|v| v.abs()).collect();
        };
        let zeroed = |field: usize| {
            let mut z = data.to_vec();
            for b in z.chunks_exact_mut(ty.block_bytes()) {
                b[field..field + 2].fill(0);
            }
            dequant_matrix(ty, &z, rows, cols)
        };
        let (scaled, mins) = (zeroed(dmin), zeroed(d));
        scaled.iter().zip(&mins).map(|(a, b)| a.abs() + b.abs()).collect()
    }

    /// `y[t, r] = Σ_c w[r, c] · x[t, c]` in f64, and `Σ_c mag[r, c] · |x[t, c]|`, token-major `[n_tok, rows]`.
    fn reference(w: &[f32], mag: &[f32], x: &[f32], rows: usize, cols: usize, n_tok: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut y, mut m) = (vec![0f64; n_tok * rows], vec![0f64; n_tok * rows]);
        for t in 0..n_tok {
            let xt = &x[t * cols..(t + 1) * cols];
            for r in 0..rows {
                let (wr, mr) = (&w[r * cols..(r + 1) * cols], &mag[r * cols..(r + 1) * cols]);
                y[t * rows + r] = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                m[t * rows + r] = mr.iter().zip(xt).map(|(&a, &b)| a as f64 * (b as f64).abs()).sum();
            }
        }
        (y, m)
    }

    /// Index of the first element of `got` beyond `chain·u·M` of `want`, with the error.
    fn first_beyond(got: &[f32], want: &[f64], mag: &[f64], chain: usize) -> Option<(usize, f64)> {
        got.iter().zip(want).zip(mag).enumerate().find_map(|(i, ((&g, &w), &m))| {
            let e = (g as f64 - w).abs();
            (e > chain as f64 * U * m + f64::MIN_POSITIVE).then_some((i, e))
        })
    }

    /// The max and rms of |got − want| / M over all outputs (the figures the report quotes).
    fn rel_stats(got: &[f32], want: &[f64], mag: &[f64]) -> (f64, f64) {
        let rel: Vec<f64> = got.iter().zip(want).zip(mag).map(|((&g, &w), &m)| (g as f64 - w).abs() / m).collect();
        let max = rel.iter().cloned().fold(0.0, f64::max);
        (max, (rel.iter().map(|v| v * v).sum::<f64>() / rel.len() as f64).sqrt())
    }

    /// Random activations with a few outliers per row (real activations have them; they set the Q8 step).
    fn activations(rng: &mut StdRng, n_tok: usize, cols: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n_tok * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        for t in 0..n_tok {
            for _ in 0..2 {
                let c = rng.gen_range(0..cols);
                x[t * cols + c] *= 6.0;
            }
        }
        x
    }

    /// Runs the WGSL matmul over `rows` of `w` with `x` at element offset `x_off` (token stride `cols + 3`); returns
    /// `[n_tok, rows.len()]`.
    fn gpu_product(ctx: &WgpuContext, w: &GpuWeight, rows: Range<usize>, x: &[f32], n_tok: usize) -> Vec<f32> {
        let (cols, x_off, xs) = (w.cols, 7usize, w.cols + 3);
        let mut xp = vec![f32::NAN; x_off + n_tok * xs];
        for t in 0..n_tok {
            xp[x_off + t * xs..x_off + t * xs + cols].copy_from_slice(&x[t * cols..(t + 1) * cols]);
        }
        let n = rows.len();
        let xb = ctx.storage_f32("x", &xp);
        let yb = ctx.storage_zeroed("y", n_tok * n);
        let mut enc = ctx.encoder();
        matmul(ctx, &mut enc, w, rows, View::new(&xb, xs).at(x_off), n_tok, View::new(&yb, n), false).unwrap();
        ctx.submit(enc).unwrap();
        ctx.read_f32(&yb, 0, n_tok * n).unwrap()
    }

    /// Every format at the Flash column counts (d_model 4096, expert/shared down 2048, q/o LoRA rank 1024, wo_b
    /// 8192) and the tiny model's (256; 64 and 128 for the formats with blocks of at most 32, which the converter
    /// falls back to on rows shorter than 256), a multi-block-per-invocation row (65 blocks of 256), batch 1 and 5, and
    /// a binding limit that splits every weight into chunks of whole "experts" (row groups of 4): each expert's
    /// rows and a range across chunk boundaries are multiplied separately, as the MoE and `wo_a` paths do.
    #[test]
    fn every_format_matches_the_f64_dequantized_product() {
        let shapes: &[(usize, usize)] =
            &[(64, 5), (128, 1), (256, 5), (1024, 1), (2048, 5), (4096, 1), (8192, 5), (65 * 256, 1)];
        let (rows, group) = (12usize, 4usize);
        for ty in TYPES {
            for &(cols, n_tok) in shapes.iter().filter(|&&(c, _)| c % ty.block_values() == 0) {
                let rb = ty.row_bytes(cols as u64).unwrap();
                // Five rows fit a binding; chunks are cut on expert boundaries (4 rows).
                let Some(ctx) = ctx_with(Some((rb * 5).div_ceil(4) * 4)) else { return };
                let mut rng = StdRng::seed_from_u64(cols as u64 * 31 + ty.id() as u64);
                let data = random_weight(&mut rng, ty, rows, cols);
                let w = GpuWeight::upload(&ctx, "w", ty, cols, rows, &data, group).unwrap();
                assert!(w.chunks.len() == 3 && w.chunks.iter().all(|c| c.rows == group), "{ty}: chunks not per expert");
                let x = activations(&mut rng, n_tok, cols);
                let wf = dequant_matrix(ty, &data, rows, cols);
                let (want, mag) = reference(&wf, &magnitudes(ty, &data, rows, cols), &x, rows, cols, n_tok);
                let chain = gpu_chain(ty, cols);
                let pick = |v: &[f64], r: &Range<usize>| -> Vec<f64> {
                    (0..n_tok).flat_map(|t| v[t * rows + r.start..t * rows + r.end].to_vec()).collect()
                };
                for r in [0..group, group..2 * group, 2 * group..rows, 2..11, 0..rows] {
                    let got = gpu_product(&ctx, &w, r.clone(), &x, n_tok);
                    let (want_r, mag_r) = (pick(&want, &r), pick(&mag, &r));
                    if let Some((i, e)) = first_beyond(&got, &want_r, &mag_r, chain) {
                        let bound = chain as f64 * U * mag_r[i];
                        panic!("{ty} cols {cols} rows {r:?} n_tok {n_tok}: output {i} off by {e:e} > {bound:e}");
                    }
                }
                // The bound is tight enough to see 32 values negated in one row (values 160..192 of a block:
                // sub-block 5 of the 256-value formats; 32..64 on the shortest rows).
                let mut bad = wf.clone();
                let lo = if cols >= 256 { 160 } else { 32 };
                bad[lo..lo + 32].iter_mut().for_each(|v| *v = -*v);
                let (bad_want, _) = reference(&bad, &magnitudes(ty, &data, rows, cols), &x, rows, cols, n_tok);
                let got = gpu_product(&ctx, &w, 0..rows, &x, n_tok);
                assert!(first_beyond(&got, &bad_want, &mag, chain).is_some(), "{ty} cols {cols}: bound too loose");
            }
        }
    }

    /// Tokens multiplied together in tiles of [`MATMUL_TILE`] (13: one full tile and a partial one) give bit for bit
    /// what each token multiplied alone gives, in every format: a prefill and one-token decode ticks agree exactly;
    /// and the device counts the weight streamed once per tile.
    #[test]
    fn tiles_of_tokens_give_each_token_alone_bit_for_bit() {
        let Some(ctx) = ctx_with(None) else { return };
        let (rows, n_tok) = (9usize, 2 * MATMUL_TILE - 3);
        for ty in TYPES {
            let cols = if ty.block_values() > 32 { 512 } else { 96 };
            let mut rng = StdRng::seed_from_u64(ty.id() as u64 + 77);
            let data = random_weight(&mut rng, ty, rows, cols);
            let w = GpuWeight::upload(&ctx, "w", ty, cols, rows, &data, 1).unwrap();
            let x = activations(&mut rng, n_tok, cols);
            let before = ctx.counters();
            let together = gpu_product(&ctx, &w, 0..rows, &x, n_tok);
            let d = ctx.counters() - before;
            assert_eq!(d.weights_fetched, 2 * d.weights_min, "{ty}: two tiles stream the weight twice");
            assert_eq!(d.weights_min, (rows * w.row_bytes) as u64);
            for t in 0..n_tok {
                let alone = gpu_product(&ctx, &w, 0..rows, &x[t * cols..(t + 1) * cols], 1);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&together[t * rows..(t + 1) * rows]), bits(&alone), "{ty}: token {t}");
            }
        }
    }

    /// A grouped product is one dispatch per weight chunk (not one per group) and gives each group's rows bit for
    /// bit what a product of that group's rows with its slice of the activations gives, also when a weight is
    /// split across bindings mid-group.
    #[test]
    fn groups_in_one_dispatch_give_each_group_alone_bit_for_bit() {
        let (groups, rank, n_tok) = (4usize, 3usize, 2usize);
        for ty in [GgmlType::F32, GgmlType::Q8_0] {
            let cols = 64usize;
            let rows = groups * rank;
            let rb = ty.row_bytes(cols as u64).unwrap();
            // Five rows per binding: chunks end inside groups.
            let Some(ctx) = ctx_with(Some((rb * 5).div_ceil(4) * 4)) else { return };
            let mut rng = StdRng::seed_from_u64(ty.id() as u64 + 5);
            let data = random_weight(&mut rng, ty, rows, cols);
            let w = GpuWeight::upload(&ctx, "wo_a", ty, cols, rows, &data, 1).unwrap();
            assert!(w.chunks.len() >= 3, "{ty}: a split weight");
            let x = activations(&mut rng, n_tok, groups * cols);
            let xb = ctx.storage_f32("x", &x);
            let yb = ctx.storage_zeroed("y", n_tok * rows);
            let before = ctx.counters();
            let mut enc = ctx.encoder();
            grouped_matmul(&ctx, &mut enc, &w, rank, View::new(&xb, groups * cols), n_tok, View::new(&yb, rows))
                .unwrap();
            ctx.submit(enc).unwrap();
            assert_eq!((ctx.counters() - before).dispatches, w.chunks.len() as u64, "{ty}: one dispatch per chunk");
            let got = ctx.read_f32(&yb, 0, n_tok * rows).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for g in 0..groups {
                let slice: Vec<f32> =
                    (0..n_tok).flat_map(|t| x[(t * groups + g) * cols..(t * groups + g + 1) * cols].to_vec()).collect();
                let alone = gpu_product(&ctx, &w, g * rank..(g + 1) * rank, &slice, n_tok);
                for t in 0..n_tok {
                    let mine = &got[t * rows + g * rank..t * rows + (g + 1) * rank];
                    assert_eq!(bits(mine), bits(&alone[t * rank..(t + 1) * rank]), "{ty}: group {g} token {t}");
                }
            }
            let mut enc = ctx.encoder();
            let (xv, yv) = (View::new(&xb, groups * cols), View::new(&yb, rows));
            assert!(grouped_matmul(&ctx, &mut enc, &w, 5, xv, n_tok, yv).is_err(), "12 rows are not groups of 5");
        }
    }

    /// The dispatch grid wraps at 32768 workgroups per dimension: a weight with more rows than that (Flash's
    /// output head has 129280) still gets every row, for two tokens.
    #[test]
    fn rows_beyond_one_grid_dimension() {
        let Some(ctx) = ctx_with(None) else { return };
        let (rows, cols, n_tok, ty) = (32768 + 37usize, 32usize, 2usize, GgmlType::Q8_0);
        let mut rng = StdRng::seed_from_u64(9);
        let data = random_weight(&mut rng, ty, rows, cols);
        let w = GpuWeight::upload(&ctx, "head", ty, cols, rows, &data, 1).unwrap();
        let x = activations(&mut rng, n_tok, cols);
        let wf = dequant_matrix(ty, &data, rows, cols);
        let (want, mag) = reference(&wf, &magnitudes(ty, &data, rows, cols), &x, rows, cols, n_tok);
        let got = gpu_product(&ctx, &w, 0..rows, &x, n_tok);
        if let Some((i, e)) = first_beyond(&got, &want, &mag, gpu_chain(ty, cols)) {
            panic!("output {i} (token {}, row {}) off by {e:e}", i / rows, i % rows);
        }
    }

    /// The CPU and wgpu products of one matrix side by side, at the Flash column counts, against two f64
    /// references: `x` itself and `x'`, the activations after the CPU's Q8_0/Q8_K quantization (dequantized).
    /// - wgpu and the CPU with `f32_acts` are within their f32 bounds of the `x` reference;
    /// - the CPU's default (quantized-activation) path is within its f32 bound of the `x'` reference: its integer
    ///   block dots are exact, so only the per-block scale products and the sum over sub-blocks round
    ///   (chain: one per 16 values, + 8).
    ///
    /// So the default CPU and wgpu differ by exactly `W·(x' − x)`, the activation quantization (printed).
    #[test]
    fn cpu_differs_from_wgpu_by_activation_quantization_only() {
        let Some(ctx) = ctx_with(None) else { return };
        let (rows, n_tok) = (16usize, 3usize);
        let mut pool = Pool::new(2);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
            for cols in [4096usize, 2048] {
                let mut rng = StdRng::seed_from_u64(1000 + cols as u64 + ty.id() as u64);
                let data = random_weight(&mut rng, ty, rows, cols);
                let x = activations(&mut rng, n_tok, cols);
                let wf = dequant_matrix(ty, &data, rows, cols);
                let mags = magnitudes(ty, &data, rows, cols);
                let act = quant::act_type(ty);
                let mut xq = vec![0f32; x.len()];
                let mut buf = Vec::new();
                for (xt, qt) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols)) {
                    quant::quantize_acts(act, xt, &mut buf).unwrap();
                    quant::dequantize_acts(act, &buf, qt).unwrap();
                }
                let (want, mag) = reference(&wf, &mags, &x, rows, cols, n_tok);
                let (want_q, mag_q) = reference(&wf, &mags, &xq, rows, cols, n_tok);

                let w = GpuWeight::upload(&ctx, "w", ty, cols, rows, &data, 1).unwrap();
                let gpu = gpu_product(&ctx, &w, 0..rows, &x, n_tok);
                let m = Mat { ty, rows, cols, row_bytes: w.row_bytes, data: &data, packed: None };
                let mut cpu_q = vec![0f32; n_tok * rows];
                pool.set_f32_acts(false);
                cpu::matmul(&pool, m, &x, n_tok, &mut cpu_q).unwrap();
                let mut cpu_f = vec![0f32; n_tok * rows];
                pool.set_f32_acts(true);
                cpu::matmul(&pool, m, &x, n_tok, &mut cpu_f).unwrap();

                let what = format!("{ty} cols {cols}");
                assert_eq!(first_beyond(&gpu, &want, &mag, gpu_chain(ty, cols)), None, "{what}: wgpu vs W·x");
                // Any summation order of `cols` products: at most cols − 1 additions after the product and the
                // block scale(s) (+3), plus the reference's dequantization (+3).
                assert_eq!(first_beyond(&cpu_f, &want, &mag, cols + 6), None, "{what}: cpu f32_acts vs W·x");
                assert_eq!(first_beyond(&cpu_q, &want_q, &mag_q, cols / 16 + 8 + 3), None, "{what}: cpu vs W·x'");
                let (gmax, grms) = rel_stats(&gpu, &want, &mag);
                let (fmax, frms) = rel_stats(&cpu_f, &want, &mag);
                let (qmax, qrms) = rel_stats(&cpu_q, &want, &mag);
                eprintln!(
                    "{what}: |err|/Σ|w·x| vs W·x (f64): wgpu max {gmax:.1e} rms {grms:.1e}; cpu f32_acts max {fmax:.1e} \
                     rms {frms:.1e}; cpu Q8 activations max {qmax:.1e} rms {qrms:.1e}"
                );
            }
        }
    }
}
