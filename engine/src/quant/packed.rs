//! Q8_0 weight matrices repacked once for the CPU's batched kernels ([`PackedMat`], viewed as [`PackedRows`] /
//! [`PackedRow`]).
//!
//! Why: the flipped Q8_0 kernels (`simd::avx512_q8_rows`) want each chunk of sixteen weight blocks transposed
//! (lane `b` of vector `g` = bytes `4g..4g + 4` of block `b`) and unsigned (`vpdpbusd`'s left operand). Done per
//! call, that is 24 permutes, 8 inserts and 8 XORs per chunk and weight row — a third of an eight-row tick's
//! vector work on Zen 4, where every 512-bit op costs a cycle — and it ties the weight row to one pass over
//! all activation rows (several passes would repeat it). Repacked once, the kernel loads a chunk with eight
//! aligned loads, so activation rows can go in passes small enough for L1 over weight blocks held in L2.
//!
//! Format, per weight row of `n` Q8_0 blocks and `C = ⌈n / 16⌉` chunks:
//! - `quants`: `8·C` [`FlipLine`]s; byte `4b + j` of line `g` of chunk `c` is quant `4g + j` of block `16c + b`
//!   XOR `0x80` (the signed quant plus 128, as an unsigned byte). Blocks past the row's end are zeros.
//! - `scales`: `16·C` f16 bit patterns, block `16c + b` at `16c + b`, as stored in the block (the kernel converts
//!   them exactly). Past the row's end: zeros.
//!
//! Invariant: a [`PackedMat`] holds exactly `rows` rows of this format for `blocks` blocks per row, made from the
//! matrix it is attached to ([`crate::model::mat::Mat::packed`]); the results computed from it are bit-identical
//! to the kernels on the original blocks (the same integer block sums and the same scale products).

use super::api::FlipLine;
use super::q8_0;

/// Blocks per chunk.
const CHUNK: usize = 16;
/// Lines (64 bytes) of quants per chunk.
const LINES: usize = 8;

/// Batch rows per pass of the packed kernel over a block of weight rows (the CPU matmul's order): few enough that
/// their flipped activations stay in L1 beside the streamed weight lines, for rows that [`PackedMat::pays_for`].
pub const PASS_ROWS: usize = 4;
/// The flipped-activation bytes [`PASS_ROWS`] rows may take: most of a 32 KiB L1D (Zen 4, recent Intel cores),
/// the rest for the weight lines in flight.
const PASS_L1_BYTES: usize = 20 * 1024;

/// A Q8_0 matrix in the packed format (see the module docs), owned: one anonymous mapping, the quant lines then
/// the scales, advised to use transparent huge pages on Linux (streamed like the weights it copies: with 4 KiB
/// pages the one-row output head ran 1.5x slower than from the model file's mapping, whose page cache uses large
/// folios).
#[derive(Debug)]
pub struct PackedMat {
    map: memmap2::MmapMut,
    quant_bytes: usize,
    rows: usize,
    blocks: usize,
}

/// Rows of a [`PackedMat`] (a whole matrix or a run of its rows).
#[derive(Clone, Copy, Debug)]
pub struct PackedRows<'a> {
    quants: &'a [FlipLine],
    scales: &'a [u16],
    rows: usize,
    blocks: usize,
}

/// One packed weight row: `8·⌈blocks / 16⌉` lines of quants and `16·⌈blocks / 16⌉` f16 scales.
#[derive(Clone, Copy, Debug)]
pub struct PackedRow<'a> {
    pub quants: &'a [FlipLine],
    pub scales: &'a [u16],
    pub blocks: usize,
}

impl PackedMat {
    /// Whether a Q8_0 matrix with rows of `cols` values gains from packing: its rows are short enough that
    /// [`PASS_ROWS`] batch rows' flipped activations fit in L1 ([`PASS_L1_BYTES`]; rows of up to 4096 values).
    /// Wider rows run faster as stored, in one pass of all batch rows (measured 2026-12-04, `ds4-bench kernels`'
    /// `engine-matmul`, batches of 8 and 16 on Zen 4: Flash's 8192-value attention output rows 5–15 % slower
    /// packed — four rows' activations are 36 KiB — while the 1024- and 4096-value matrices ran as fast or faster,
    /// the 8-session output head 26.8 vs 32.0 ms).
    pub fn pays_for(cols: usize) -> bool {
        let blocks = cols.div_ceil(q8_0::QK);
        PASS_ROWS * super::api::flip_row_lines(blocks * q8_0::BLOCK_BYTES) * std::mem::size_of::<FlipLine>()
            <= PASS_L1_BYTES
    }

    /// Packs `rows` Q8_0 rows of `row_bytes` bytes each from `data` (`None` when `data` is not exactly that, a
    /// row is not whole blocks, or the memory cannot be mapped).
    pub fn pack_q8_0(data: &[u8], rows: usize, row_bytes: usize) -> Option<PackedMat> {
        let b = q8_0::BLOCK_BYTES;
        if rows == 0 || row_bytes == 0 || !row_bytes.is_multiple_of(b) || rows.checked_mul(row_bytes)? != data.len() {
            return None;
        }
        let blocks = row_bytes / b;
        let chunks = blocks.div_ceil(CHUNK);
        let per_row = (chunks * LINES, chunks * CHUNK);
        let quant_bytes = rows.checked_mul(per_row.0 * 64)?;
        let mut map = memmap2::MmapMut::map_anon(quant_bytes.checked_add(rows.checked_mul(per_row.1 * 2)?)?).ok()?;
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let (qb, sb) = map.split_at_mut(quant_bytes);
        // A fresh mapping is page-aligned (so 64-byte aligned), and the scales start at a multiple of 64 bytes.
        let quants: &mut [FlipLine] = bytemuck::cast_slice_mut(qb);
        let scales: &mut [u16] = bytemuck::cast_slice_mut(sb);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows);
        let per_thread = rows.div_ceil(threads.max(1)).max(1);
        std::thread::scope(|s| {
            let parts = quants
                .chunks_mut(per_thread * per_row.0)
                .zip(scales.chunks_mut(per_thread * per_row.1))
                .zip(data.chunks(per_thread * row_bytes));
            for ((q, d), src) in parts {
                s.spawn(move || {
                    let rows = q.chunks_exact_mut(per_row.0).zip(d.chunks_exact_mut(per_row.1));
                    for ((q, d), row) in rows.zip(src.chunks_exact(row_bytes)) {
                        pack_row(row, q, d);
                    }
                });
            }
        });
        Some(PackedMat { map, quant_bytes, rows, blocks })
    }

    /// The whole matrix as rows.
    pub fn view(&self) -> PackedRows<'_> {
        let (q, s) = self.map.split_at(self.quant_bytes);
        PackedRows {
            quants: bytemuck::cast_slice(q),
            scales: bytemuck::cast_slice(s),
            rows: self.rows,
            blocks: self.blocks,
        }
    }

    /// Bytes held (quants and scales).
    pub fn bytes(&self) -> usize {
        self.map.len()
    }
}

/// One row of whole Q8_0 blocks into its packed quants (`q`: `8·C` lines) and scales (`d`: `16·C`).
fn pack_row(row: &[u8], q: &mut [FlipLine], d: &mut [u16]) {
    for (i, blk) in row.chunks_exact(q8_0::BLOCK_BYTES).enumerate() {
        let (c, lane) = (i / CHUNK, i % CHUNK);
        d[i] = u16::from_le_bytes([blk[0], blk[1]]);
        for (g, quads) in blk[2..].chunks_exact(4).enumerate() {
            let line = &mut q[c * LINES + g].0[4 * lane..4 * lane + 4];
            line.iter_mut().zip(quads).for_each(|(o, w)| *o = w ^ 0x80);
        }
    }
}

impl<'a> PackedRows<'a> {
    fn chunks(&self) -> usize {
        self.blocks.div_ceil(CHUNK)
    }

    /// Row `r`. Panics if `r >= rows` (callers index within the matrix's shape).
    pub fn row(&self, r: usize) -> PackedRow<'a> {
        assert!(r < self.rows, "packed row {r} of {}", self.rows);
        let c = self.chunks();
        PackedRow {
            quants: &self.quants[r * c * LINES..(r + 1) * c * LINES],
            scales: &self.scales[r * c * CHUNK..(r + 1) * c * CHUNK],
            blocks: self.blocks,
        }
    }

    /// Rows `start..start + n`. Panics if out of range.
    pub fn rows_slice(&self, start: usize, n: usize) -> PackedRows<'a> {
        assert!(start + n <= self.rows, "packed rows {start}..{} of {}", start + n, self.rows);
        let c = self.chunks();
        PackedRows {
            quants: &self.quants[start * c * LINES..(start + n) * c * LINES],
            scales: &self.scales[start * c * CHUNK..(start + n) * c * CHUNK],
            rows: n,
            blocks: self.blocks,
        }
    }

    /// Rows in the view.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documented layout, byte by byte, for a row with a partial last chunk; bad shapes are refused.
    #[test]
    fn packed_bytes_are_the_documented_format() {
        let (rows, nb) = (3, 19);
        let rb = nb * q8_0::BLOCK_BYTES;
        let data: Vec<u8> = (0..rows * rb).map(|i| (i * 7 + i / 5) as u8).collect();
        let p = PackedMat::pack_q8_0(&data, rows, rb).unwrap();
        let v = p.view();
        assert_eq!((v.rows(), v.blocks()), (rows, nb));
        for r in 0..rows {
            let pr = v.row(r);
            assert_eq!((pr.quants.len(), pr.scales.len()), (16, 32), "two chunks per row");
            for blk in 0..32 {
                let (c, lane) = (blk / 16, blk % 16);
                let src = (blk < nb).then(|| &data[r * rb + blk * 34..r * rb + (blk + 1) * 34]);
                let want_d = src.map_or(0, |s| u16::from_le_bytes([s[0], s[1]]));
                assert_eq!(pr.scales[blk], want_d, "row {r} block {blk} scale");
                for k in 0..32 {
                    let (g, j) = (k / 4, k % 4);
                    let got = pr.quants[c * 8 + g].0[4 * lane + j];
                    assert_eq!(got, src.map_or(0, |s| s[2 + k] ^ 0x80), "row {r} block {blk} quant {k}");
                }
            }
        }
        let sl = v.rows_slice(1, 2);
        assert_eq!(sl.row(0).quants, v.row(1).quants);
        assert_eq!(sl.row(1).scales, v.row(2).scales);
        assert!(PackedMat::pack_q8_0(&data[1..], rows, rb).is_none(), "short data");
        assert!(PackedMat::pack_q8_0(&data, rows, rb - 1).is_none(), "rows not whole blocks");
        assert_eq!(p.bytes(), rows * (16 * 64 + 32 * 2));
    }

    /// Packing pays where `PASS_ROWS` rows' flipped activations fit the L1 share: Flash's 1024-, 2048- and
    /// 4096-value rows (four rows: 18 KiB at 4096), not its 8192-value attention output rows (36 KiB).
    #[test]
    fn packing_pays_for_rows_whose_pass_fits_l1() {
        for cols in [32, 1024, 2048, 4096] {
            assert!(PackedMat::pays_for(cols), "{cols}");
        }
        for cols in [4608, 8192, 16384] {
            assert!(!PackedMat::pays_for(cols), "{cols}");
        }
    }
}
