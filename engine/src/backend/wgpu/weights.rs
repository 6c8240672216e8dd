//! Weight tensors on the device, split at row boundaries across several buffers when they exceed the binding limit.
//!
//! A [`GpuWeight`] is a matrix of `rows` rows of `cols` values in one ggml format, kept in its file encoding (no
//! dequantized copy). Flash has tensors over 2 GiB while lavapipe binds at most 128 MiB, so [`plan_chunks`] cuts the
//! rows into chunks of at most `max_binding` bytes, each its own buffer. Kernels address rows relative to their
//! chunk, so any byte offset works (the shaders load bytes at arbitrary offsets). When `row_group` is given (e.g.
//! the rows of one expert), chunks end on group boundaries whenever a whole group fits, so that one expert's matrix
//! usually lives in a single chunk.
//!
//! Invariants: chunks are contiguous, in order, non-empty and cover `0..rows` exactly; a chunk's buffer holds
//! `rows * row_bytes` bytes padded with zeros to a multiple of 4.

use std::ops::Range;

use ds4_shaders_wgsl::WeightFormat;

use super::context::{backend_err, WgpuContext};
use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// The shader format for a ggml type, or an error naming the unsupported type.
pub fn weight_format(ty: GgmlType) -> Result<WeightFormat> {
    Ok(match ty {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        GgmlType::Bf16 => WeightFormat::Bf16,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        GgmlType::Q2K => WeightFormat::Q2K,
        GgmlType::Q4K => WeightFormat::Q4K,
        GgmlType::Iq2Xxs => WeightFormat::Iq2Xxs,
        other => return Err(Error::Quant { op: "wgpu weight", ty: other.to_string(), what: "no WGSL decoder".into() }),
    })
}

/// The shader format of `ty` and the bytes of one row of `cols` values, or an error naming the tensor.
fn format_and_row_bytes(name: &str, ty: GgmlType, cols: usize) -> Result<(WeightFormat, usize)> {
    let format = weight_format(ty)?;
    let row_bytes = ty.row_bytes(cols as u64).ok_or_else(|| Error::Tensor {
        name: name.into(),
        what: format!("{cols} columns are not a whole number of {ty} blocks"),
    })? as usize;
    Ok((format, row_bytes))
}

/// `bytes` (whole rows of `row_bytes` bytes in file encoding) as the device holds them: Q8_0 rows repacked — the
/// row's quants first (32 bytes a block), then its f16 scales — so the kernel reads a block's quants as aligned
/// words (`quant_q8_0.wgsl`); every other format as it is. The same number of bytes.
pub fn repack_rows(format: WeightFormat, row_bytes: usize, bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if format != WeightFormat::Q8_0 || row_bytes == 0 {
        return std::borrow::Cow::Borrowed(bytes);
    }
    // A block: the f16 scale, then `values` one-byte quants.
    let (values, block_bytes) = format.block();
    let nb = row_bytes / block_bytes;
    let mut out = vec![0u8; bytes.len()];
    for (src, dst) in bytes.chunks_exact(row_bytes).zip(out.chunks_exact_mut(row_bytes)) {
        let (quants, scales) = dst.split_at_mut(values * nb);
        for (j, block) in src.chunks_exact(block_bytes).enumerate() {
            scales[2 * j..2 * j + 2].copy_from_slice(&block[..2]);
            quants[values * j..values * (j + 1)].copy_from_slice(&block[2..]);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// One buffer holding rows `first_row .. first_row + rows` of a weight.
pub struct WeightChunk {
    pub first_row: usize,
    pub rows: usize,
    pub buffer: wgpu::Buffer,
}

/// A weight matrix on the device (see module docs).
pub struct GpuWeight {
    pub name: String,
    pub ty: GgmlType,
    pub format: WeightFormat,
    pub cols: usize,
    pub rows: usize,
    pub row_bytes: usize,
    pub chunks: Vec<WeightChunk>,
}

/// Splits `rows` rows of `row_bytes` bytes into chunks of at most `max_binding` bytes (see module docs).
/// Returns `(first_row, rows)` per chunk; errors when a single row does not fit.
pub fn plan_chunks(rows: usize, row_bytes: usize, max_binding: u64, row_group: usize) -> Result<Vec<(usize, usize)>> {
    if rows == 0 {
        return Ok(Vec::new());
    }
    let padded = |n: usize| ((n * row_bytes).div_ceil(4) * 4) as u64;
    let mut per = (max_binding / row_bytes.max(1) as u64) as usize;
    while per > 0 && padded(per) > max_binding {
        per -= 1;
    }
    if per == 0 {
        return Err(backend_err(format!("a row of {row_bytes} bytes exceeds the storage binding limit {max_binding}")));
    }
    if row_group > 1 && per >= row_group && per < rows {
        per -= per % row_group;
    }
    let mut out = Vec::with_capacity(rows.div_ceil(per));
    let mut r = 0;
    while r < rows {
        let n = per.min(rows - r);
        out.push((r, n));
        r += n;
    }
    Ok(out)
}

impl GpuWeight {
    /// Uploads a `[rows, cols]` matrix of type `ty` (`data` in file encoding, row-major, `rows * row_bytes` bytes).
    pub fn upload(
        ctx: &WgpuContext,
        name: &str,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        data: &[u8],
        row_group: usize,
    ) -> Result<Self> {
        let (format, row_bytes) = format_and_row_bytes(name, ty, cols)?;
        if data.len() != rows * row_bytes {
            return Err(Error::Tensor {
                name: name.into(),
                what: format!("{} bytes for {rows} rows of {row_bytes} bytes", data.len()),
            });
        }
        let plan = plan_chunks(rows, row_bytes, ctx.max_binding(), row_group)?;
        let chunks = plan
            .into_iter()
            .map(|(first_row, n)| WeightChunk {
                first_row,
                rows: n,
                buffer: ctx.storage_init(
                    name,
                    &repack_rows(format, row_bytes, &data[first_row * row_bytes..(first_row + n) * row_bytes]),
                ),
            })
            .collect::<Vec<_>>();
        tracing::debug!(name, %ty, rows, cols, chunks = chunks.len(), "uploaded weight");
        Ok(Self { name: name.into(), ty, format, cols, rows, row_bytes, chunks })
    }

    /// Two matrices of one type and width, `a` and `b` (`rows` rows each, in groups of `group` rows: one expert's),
    /// as one matrix whose group `g` is `a`'s group `g` then `b`'s: `2·rows` rows in groups of `2·group`. A product
    /// over a combined group then computes both halves in one dispatch (the MoE gate and up products). Chunks end on
    /// combined group boundaries when one fits; each chunk is assembled on the host as it is uploaded.
    #[allow(clippy::too_many_arguments)]
    pub fn upload_interleaved(
        ctx: &WgpuContext,
        name: &str,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        a: &[u8],
        b: &[u8],
        group: usize,
    ) -> Result<Self> {
        let (format, row_bytes) = format_and_row_bytes(name, ty, cols)?;
        if group == 0 || !rows.is_multiple_of(group) || a.len() != rows * row_bytes || b.len() != a.len() {
            return Err(Error::Tensor {
                name: name.into(),
                what: format!("{} and {} bytes for two {rows}-row halves in groups of {group}", a.len(), b.len()),
            });
        }
        let plan = plan_chunks(2 * rows, row_bytes, ctx.max_binding(), 2 * group)?;
        let mut bytes = Vec::new();
        let chunks = plan
            .into_iter()
            .map(|(first_row, n)| {
                bytes.clear();
                for r in first_row..first_row + n {
                    let (g, within) = (r / (2 * group), r % (2 * group));
                    let (half, src) =
                        if within < group { (a, g * group + within) } else { (b, g * group + within - group) };
                    bytes.extend_from_slice(&half[src * row_bytes..(src + 1) * row_bytes]);
                }
                WeightChunk {
                    first_row,
                    rows: n,
                    buffer: ctx.storage_init(name, &repack_rows(format, row_bytes, &bytes)),
                }
            })
            .collect::<Vec<_>>();
        tracing::debug!(name, %ty, rows = 2 * rows, cols, chunks = chunks.len(), "uploaded interleaved weights");
        Ok(Self { name: name.into(), ty, format, cols, rows: 2 * rows, row_bytes, chunks })
    }

    /// The chunks intersecting `rows`, each with the local row range inside the chunk and the offset of its first
    /// row relative to `rows.start`.
    pub fn pieces(&self, rows: Range<usize>) -> impl Iterator<Item = (&WeightChunk, Range<usize>, usize)> {
        self.chunks.iter().filter_map(move |c| {
            let lo = rows.start.max(c.first_row);
            let hi = rows.end.min(c.first_row + c.rows);
            (lo < hi).then(|| (c, lo - c.first_row..hi - c.first_row, lo - rows.start))
        })
    }

    /// The chunk holding global row `row` and the row's index inside it.
    pub fn locate(&self, row: usize) -> Option<(usize, usize)> {
        let i = self.chunks.partition_point(|c| c.first_row + c.rows <= row);
        let c = self.chunks.get(i)?;
        (row >= c.first_row).then(|| (i, row - c.first_row))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_cover(plan: &[(usize, usize)], rows: usize, row_bytes: usize, max: u64) {
        let mut next = 0;
        for &(f, n) in plan {
            assert_eq!(f, next);
            assert!(n > 0);
            assert!(((n * row_bytes).div_ceil(4) * 4) as u64 <= max, "chunk of {n} rows exceeds {max}");
            next += n;
        }
        assert_eq!(next, rows);
    }

    /// Q8_0 rows keep their bytes, moved: block j's quants to 32·j, its scale to 32·nb + 2·j; other formats are
    /// untouched.
    #[test]
    fn q8_0_rows_are_repacked_quants_then_scales() {
        let (nb, rows) = (3usize, 2usize);
        let data: Vec<u8> = (0..rows * nb * 34).map(|i| (i * 7 % 251) as u8).collect();
        let out = repack_rows(WeightFormat::Q8_0, nb * 34, &data);
        assert_eq!(out.len(), data.len());
        for r in 0..rows {
            let (src, dst) = (&data[r * nb * 34..(r + 1) * nb * 34], &out[r * nb * 34..(r + 1) * nb * 34]);
            for j in 0..nb {
                assert_eq!(dst[32 * j..32 * j + 32], src[34 * j + 2..34 * j + 34], "row {r} block {j} quants");
                assert_eq!(dst[32 * nb + 2 * j..32 * nb + 2 * j + 2], src[34 * j..34 * j + 2], "row {r} block {j} d");
            }
        }
        assert_eq!(&*repack_rows(WeightFormat::Q4K, 144, &data[..144]), &data[..144]);
    }

    #[test]
    fn plan_respects_limit_and_covers_rows() {
        for (rows, rb, max) in [(10, 34, 100), (7, 66, 132), (1000, 1056, 1 << 20), (5, 4, 4), (3, 6, 8)] {
            let plan = plan_chunks(rows, rb, max, 1).unwrap();
            check_cover(&plan, rows, rb, max);
        }
    }

    #[test]
    fn plan_prefers_group_boundaries() {
        let plan = plan_chunks(64, 100, 2500, 8).unwrap();
        check_cover(&plan, 64, 100, 2500);
        assert!(plan.iter().all(|&(f, n)| f % 8 == 0 && n % 8 == 0), "{plan:?}");
        // 25 rows would fit; 24 (three groups) per chunk.
        assert_eq!(plan, vec![(0, 24), (24, 24), (48, 16)]);
    }

    #[test]
    fn plan_rejects_rows_larger_than_a_binding() {
        assert!(plan_chunks(4, 300, 256, 1).is_err());
        assert!(plan_chunks(0, 300, 256, 1).unwrap().is_empty());
    }
}
