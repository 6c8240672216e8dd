//! Activation formats: how an activation row is laid out for the dot-product kernel of a weight type.
//!
//! Quantized kernels take their activations pre-quantized ([`crate::quant::quantize_acts`]), once per row and
//! shared by every weight row of a product. Most formats are plain ggml blocks; one is a kernel-specific reordering
//! of Q8_K blocks that lets the AVX-512 IQ2_XXS kernel skip a per-row shuffle:
//!
//! - [`ActType::Q8KPairs`]: every *pair* of Q8_K blocks (584 bytes, the size of two plain blocks) re-laid out
//!   for the kernel: the two f32 scales (bytes 0..8), then 8 value-major vectors (64 bytes each): vector `j` holds
//!   value `j` of each of the pair's 64 octets (8-value runs), byte `p` being octet `p % 4` of i32 lane `p / 4`, and
//!   lane `4m + r` is group `2m + r % 2` (32 values) of block `r / 2` — the order in which one `vshufps` gathers the
//!   IQ2_XXS weights' grid indices (`q8_k::pair_value`); then the block sums, two i16 per lane in the same lane
//!   order (`q8_k::PAIR_LANE_BSUMS`). A row's last block, when the block count is odd, stays plain Q8_K.
//!   [`crate::quant::act_type`] picks it only where the kernel that reads it runs.
//!
//! Every format keeps Q8_K/Q8_0 sizes, so a row of `n` values takes the same bytes whatever the layout.

use std::fmt;

use super::{q8_k, GgmlType, QK_K};

/// An activation format (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActType {
    /// f32 values (float kernels).
    F32,
    /// Q8_0 blocks (for Q8_0 weights).
    Q8_0,
    /// Q8_K blocks (for the k-quants, and IQ2_XXS where the pair kernel is not available).
    Q8K,
    /// Q8_K blocks, quants value-major per pair of blocks (for the AVX-512 IQ2_XXS pair kernel).
    Q8KPairs,
}

impl ActType {
    /// The ggml block type whose blocks (sizes, scales) this format uses.
    pub fn ggml(self) -> GgmlType {
        match self {
            ActType::F32 => GgmlType::F32,
            ActType::Q8_0 => GgmlType::Q8_0,
            ActType::Q8K | ActType::Q8KPairs => GgmlType::Q8K,
        }
    }

    /// Values per independently quantizable unit (a pair of blocks for [`ActType::Q8KPairs`]): rows split into
    /// pieces of whole units quantize to the same bytes as the whole row.
    pub fn block_values(self) -> usize {
        match self {
            ActType::Q8KPairs => 2 * QK_K,
            t => t.ggml().block_values(),
        }
    }

    /// Bytes of one unit of [`ActType::block_values`] values.
    pub fn block_bytes(self) -> usize {
        match self {
            ActType::Q8KPairs => 2 * q8_k::BLOCK_BYTES,
            t => t.ggml().block_bytes(),
        }
    }

    /// Bytes of a row of `n` values (`None` unless `n` is whole blocks of the underlying ggml type; a pair layout
    /// row may end with a lone block).
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        self.ggml().row_bytes(n)
    }

    /// Whether activations stay f32.
    pub fn is_f32(self) -> bool {
        self == ActType::F32
    }

    /// A short name (`q8_K-pairs` for the pair layout).
    pub fn name(self) -> &'static str {
        match self {
            ActType::Q8KPairs => "q8_K-pairs",
            t => t.ggml().name(),
        }
    }
}

/// The plain (ggml block order) activation format of a weight type: Q8_0 for Q8_0; Q8_K for Q2_K, Q4_K and
/// IQ2_XXS; F32 otherwise. [`crate::quant::act_type`] may pick a kernel-specific layout instead.
pub(crate) fn plain_act_type(weight_ty: GgmlType) -> ActType {
    match weight_ty {
        GgmlType::Q8_0 => ActType::Q8_0,
        GgmlType::Q2K | GgmlType::Q4K | GgmlType::Iq2Xxs => ActType::Q8K,
        _ => ActType::F32,
    }
}

impl fmt::Display for ActType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
