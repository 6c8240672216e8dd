//! Quantized matrix products and row gathers on [`GpuWeight`]s, across chunk boundaries.
//!
//! [`matmul`] computes `y[t, r] (+)= W[rows.start + r, :] · x[t, :]` for every token `t < n_tok`, issuing one dispatch
//! per weight chunk the row range touches. [`get_rows`] copies (dequantizes) rows of a weight into an f32 buffer —
//! the embedding lookup. Both only record commands; the caller submits.
//!
//! Layout conventions: activations are f32, token-major: element `(t, c)` of `x` is `x[x.offset + t * x.stride + c]`,
//! likewise for `y`. Offsets/strides are in f32 elements. The caller guarantees the buffers are large enough; out of
//! range writes are dropped by wgpu's robust buffer access rather than corrupting memory.

use std::ops::Range;

use ds4_shaders_wgsl::WeightFormat;

use super::context::{backend_err, WgpuContext};
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

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MatmulParams {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_bytes: u32,
    row_base: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    grid_x: u32,
    accumulate: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct GetRowsParams {
    n_ids: u32,
    cols: u32,
    row_bytes: u32,
    y_offset: u32,
    y_stride: u32,
    _pad: [u32; 3],
}

fn name(kind: &str, f: WeightFormat) -> String {
    format!("{kind}_{f:?}")
}

pub(crate) fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| backend_err(format!("{what} = {v} does not fit in u32")))
}

/// Records `y[t, r] (+)= W[rows.start + r] · x[t]` for `r < rows.len()`, `t < n_tok` (see module docs).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    ctx: &WgpuContext,
    enc: &mut wgpu::CommandEncoder,
    w: &GpuWeight,
    rows: Range<usize>,
    x: View<'_>,
    n_tok: usize,
    y: View<'_>,
    accumulate: bool,
) -> Result<()> {
    if rows.end > w.rows || rows.start > rows.end {
        return Err(backend_err(format!("matmul {}: rows {rows:?} out of 0..{}", w.name, w.rows)));
    }
    if n_tok == 0 || rows.is_empty() {
        return Ok(());
    }
    let pipeline = ctx.pipeline(&name("matmul", w.format), w.format.matmul_source())?;
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    if n_tok > max {
        return Err(backend_err(format!("matmul {}: {n_tok} tokens exceed one dispatch", w.name)));
    }
    for (chunk, local, out_off) in w.pieces(rows) {
        let n = local.len();
        let grid_x = n.min(max.min(32768));
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
            grid_x: grid_x as u32,
            accumulate: accumulate as u32,
            _pad: 0,
        };
        let u = ctx.uniform("matmul params", &params);
        let groups = [grid_x as u32, n.div_ceil(grid_x) as u32, n_tok as u32];
        ctx.dispatch(enc, &pipeline, &[&chunk.buffer, x.buf, y.buf, &u], groups)?;
    }
    Ok(())
}

/// Records `y[out_k] = W[row_k]` (dequantized) for each `(row_k, out_k)` in `ids` (see module docs).
pub fn get_rows(
    ctx: &WgpuContext,
    enc: &mut wgpu::CommandEncoder,
    w: &GpuWeight,
    ids: &[(usize, usize)],
    y: View<'_>,
) -> Result<()> {
    let pipeline = ctx.pipeline(&name("get_rows", w.format), w.format.get_rows_source())?;
    for (ci, chunk) in w.chunks.iter().enumerate() {
        let mut pairs = Vec::new();
        for &(row, out) in ids {
            let (c, local) = w
                .locate(row)
                .ok_or_else(|| backend_err(format!("get_rows {}: row {row} out of 0..{}", w.name, w.rows)))?;
            if c == ci {
                pairs.push(u32_of(local, "row")?);
                pairs.push(u32_of(out, "out")?);
            }
        }
        if pairs.is_empty() {
            continue;
        }
        let n_ids = pairs.len() / 2;
        let params = GetRowsParams {
            n_ids: n_ids as u32,
            cols: u32_of(w.cols, "cols")?,
            row_bytes: u32_of(w.row_bytes, "row_bytes")?,
            y_offset: u32_of(y.offset, "y offset")?,
            y_stride: u32_of(y.stride, "y stride")?,
            _pad: [0; 3],
        };
        let idb = ctx.storage_init("get_rows ids", bytemuck::cast_slice(&pairs));
        let u = ctx.uniform("get_rows params", &params);
        let groups = [w.cols.div_ceil(64) as u32, u32_of(n_ids, "ids")?, 1];
        ctx.dispatch(enc, &pipeline, &[&chunk.buffer, &idb, y.buf, &u], groups)?;
    }
    Ok(())
}
