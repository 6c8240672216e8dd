//! [`Mat`]: a row-major view of a weight matrix in the model file (what kernels multiply by).

use crate::quant::{GgmlType, PackedRows};

/// A row-major matrix view into the map: `rows` rows of `cols` values of type `ty`; `packed`, where the CPU
/// backend asked for it ([`crate::model::weights::Model::packed_mat`]), the same rows repacked for its batched
/// Q8_0 kernels (same results, bit for bit; see [`crate::quant::PackedMat`]).
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub data: &'a [u8],
    pub packed: Option<PackedRows<'a>>,
}

impl<'a> Mat<'a> {
    /// The bytes of row `r`. Panics if `r >= rows` (callers index within the validated shape).
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Rows `start..start + n` as a matrix (used for one expert of a stacked tensor, or a group of `wo_a`).
    pub fn rows_slice(&self, start: usize, n: usize) -> Mat<'a> {
        Mat {
            rows: n,
            data: &self.data[start * self.row_bytes..(start + n) * self.row_bytes],
            packed: self.packed.map(|p| p.rows_slice(start, n)),
            ..*self
        }
    }
}
