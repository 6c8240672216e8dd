//! Block quant formats as ggml defines them, and the arithmetic on them.
//!
//! [`GgmlType`] names every type a GGUF file may hold and knows each one's block geometry (values per block, bytes
//! per block). The engine computes with F32, F16, BF16, Q8_0, Q2_K, Q4_K and IQ2_XXS weights; Q8_K (and Q8_0) serve
//! as quantized activation formats.
//!
//! The public API (everything callers need) is re-exported here from `api`:
//! - [`dequantize_row`] / [`quantize_row`]: bytes ⇄ f32 for one row (quantizers are round-to-nearest with an
//!   optional importance-weighted scale search).
//! - [`dot_f32_kernel`] → [`DotF32`]: weight row bytes · f32 activations.
//! - [`act_type`] + [`quantize_acts`] + [`dot_q_kernel`] → [`DotQ`]: weight row bytes · quantized activations (the
//!   fast path: integer dot products, AVX2 `maddubs` style). The activation format ([`ActType`], module `act`) is
//!   chosen per weight type and CPU, and may reorder quants for a kernel (the IQ2_XXS pair layout).
//!   [`dot_q4_kernel`] → [`DotQ4`], where a type has one: the same dot against four activation rows at once,
//!   bit-identical, for batched rows (the IQ2_XXS pair kernel decodes each weight pair once for the four);
//!   [`dot_q8_kernel`] → [`DotQ8`] likewise for eight rows; [`dot_q_rows_kernel`] → [`DotQRows`] for any number
//!   of rows against several weight rows, one weight decode per up to [`MAX_ROWS`] of them (the AVX-512 IQ2_XXS
//!   pair and Q2_K kernels); [`dot_q_flipped_kernel`] → [`DotQFlipped`] the same for Q8_0 against one weight row on
//!   activations flipped once per product ([`flip_acts`], AVX-512 VNNI; any batch from one row up), and
//!   [`dot_q_packed_kernel`] → [`DotQPacked`] the same on weight rows repacked once per matrix ([`PackedMat`]);
//!   [`dot_f4_kernel`] → [`DotF4`] the same for float weights (F16/BF16) against four f32 rows.
//! - [`matvec`] / [`matvec_with_scratch`]: `y = W·x`, single-threaded, best path; [`matvec_q`] takes activations
//!   already quantized (quantize once, share across matrices and threads).
//!
//! Kernels are resolved once (runtime CPU feature detection: AVX2+FMA+F16C on x86-64, NEON on aarch64, scalar
//! otherwise) and handed out as plain `fn` pointers; callers cache them. Kernel contract: a `DotF32`/`DotQ` computes
//! over `n = x.len()` values (resp. the whole blocks of the activation row) and expects `w` to hold exactly the
//! bytes of `n` values; given shorter buffers it only covers the whole blocks both hold — it never panics and never
//! reads out of bounds, but the result is then meaningless, so check lengths once outside the hot loop.
//!
//! Q8_0 results depend on the CPU class, never on the batch: where AVX-512 F/BW/VL/VNNI are present every Q8_0 ·
//! Q8_0 kernel (single, flipped, any row count) computes the sixteen-lane contract (`q8_0::dot_q8_0_lanes16`:
//! exact block sums, one FMA per block into lane `b mod 16`, a fixed final tree); elsewhere every x86 kernel
//! computes the AVX2 kernel's order (eight lanes per block, even and odd blocks in two accumulators) and NEON its
//! own. Within one machine, one pass, chunked prefill, decode and any number of sessions agree bit for bit.
//!
//! Per-format scalar reference code lives in `f16`, `q8_0`, `q2_k`, `q4_k`, `iq2_xxs`, `q8_k` (each documents its
//! block layout); SIMD variants under `simd` are tested against it. Scalar kernels are also public through
//! [`dot_f32_kernel_scalar`] / [`dot_q_kernel_scalar`] for benches and cross-checks.
//!
//! Invariant: a tensor row of `n` values of type `t` occupies `t.row_bytes(n)` bytes and `n` is a multiple of
//! `t.block_values()`; callers check this with [`GgmlType::row_bytes`] (which returns `None` otherwise) before
//! slicing. Nothing in this module panics on bad input: lengths, types and non-finite inputs become
//! [`crate::Error::Quant`].

// Index loops mirror the block-layout formulas in the docs; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

mod act;
mod api;
mod f16;
mod iq2_tables;
mod iq2_xxs;
mod kquant_search;
mod packed;
mod q2_k;
mod q4_k;
mod q8_0;
mod q8_k;
pub mod simd;

pub use act::ActType;
pub use api::{
    act_block_scales, act_type, dequantize_acts, dequantize_row, dot_f32_kernel, dot_f32_kernel_scalar, dot_f4_kernel,
    dot_f8_kernel, dot_q4_kernel, dot_q8_kernel, dot_q_flipped_kernel, dot_q_kernel, dot_q_kernel_scalar,
    dot_q_packed_kernel, dot_q_rows_kernel, flip_acts, flip_row_lines, matvec, matvec_q, matvec_with_scratch,
    quantize_acts, quantize_acts_into, quantize_row, DotF32, DotF4, DotF8, DotQ, DotQ4, DotQ8, DotQFlipped, DotQPacked,
    DotQRows, FlipLine, MAX_ROWS,
};
pub use packed::{PackedMat, PackedRow, PackedRows, PASS_ROWS as PACKED_PASS_ROWS};

use std::fmt;

/// A ggml tensor type, with the numeric id GGUF stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
}

/// Values per block of the k-quants.
pub const QK_K: usize = 256;

/// `y.round().clamp(-127.0, 127.0) as i8` (round half away from zero) for finite `|y| < 2^23`, as a byte, in a
/// form LLVM vectorizes on baseline x86-64 (`f32::round` is a libm call there): adding `0.5 − 2^-25` with `y`'s
/// sign and truncating gives the same integer (checked for every f32 in [-128, 128] when written; the test below
/// samples the ties and their neighbours), and clamping before the truncation does not change the clamped result.
#[inline(always)]
pub(crate) fn round_i8(y: f32) -> u8 {
    (y + 0.499_999_97f32.copysign(y)).clamp(-127.0, 127.0) as i8 as u8
}

impl GgmlType {
    /// Maps a GGUF type id to a type; `None` for ids ggml does not define.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => Iq2Xxs,
            17 => Iq2Xs,
            18 => Iq3Xxs,
            19 => Iq1S,
            20 => Iq4Nl,
            21 => Iq3S,
            22 => Iq2S,
            23 => Iq4Xs,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => Iq1M,
            30 => Bf16,
            _ => return None,
        })
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            Iq2Xxs => 16,
            Iq2Xs => 17,
            Iq3Xxs => 18,
            Iq1S => 19,
            Iq4Nl => 20,
            Iq3S => 21,
            Iq2S => 22,
            Iq4Xs => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            Iq1M => 29,
            Bf16 => 30,
        }
    }

    /// ggml's name for the type (`"q8_0"`, `"iq2_xxs"`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2K => "q2_K",
            Q3K => "q3_K",
            Q4K => "q4_K",
            Q5K => "q5_K",
            Q6K => "q6_K",
            Q8K => "q8_K",
            Iq2Xxs => "iq2_xxs",
            Iq2Xs => "iq2_xs",
            Iq3Xxs => "iq3_xxs",
            Iq1S => "iq1_s",
            Iq4Nl => "iq4_nl",
            Iq3S => "iq3_s",
            Iq2S => "iq2_s",
            Iq4Xs => "iq4_xs",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            F64 => "f64",
            Iq1M => "iq1_m",
            Bf16 => "bf16",
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | Bf16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | Iq4Nl => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | Iq2Xxs | Iq2Xs | Iq3Xxs | Iq1S | Iq3S | Iq2S | Iq4Xs | Iq1M => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | Bf16 => 2,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            Iq2Xxs => 66,
            Iq2Xs => 74,
            Iq3Xxs => 98,
            Iq1S => 50,
            Iq4Nl => 18,
            Iq3S => 110,
            Iq2S => 82,
            Iq4Xs => 136,
            Iq1M => 56,
        }
    }

    /// Bytes taken by a row of `n` values, or `None` when `n` is not a whole number of blocks (or overflows).
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let bv = self.block_values() as u64;
        if !n.is_multiple_of(bv) {
            return None;
        }
        (n / bv).checked_mul(self.block_bytes() as u64)
    }

    /// Whether the engine can compute with this type (dequantize and dot products). Other types can be read and
    /// inspected but not run.
    pub fn is_supported(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | Bf16 | Q8_0 | Q2K | Q4K | Iq2Xxs | Q8K | I32)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Scalar `weights · f32` dot of a 256-value-block format, by expanding each block with `dequantize_block` and
/// summing in four interleaved lanes (the reference order the SIMD kernels are tested against). Covers the whole
/// blocks both slices hold.
pub(crate) fn dot_f32_by_blocks(
    w: &[u8],
    x: &[f32],
    block_bytes: usize,
    dequantize_block: fn(&[u8], &mut [f32]),
) -> f32 {
    let mut y = [0f32; QK_K];
    let mut acc = 0f32;
    for (b, xs) in w.chunks_exact(block_bytes).zip(x.chunks_exact(QK_K)) {
        dequantize_block(b, &mut y);
        let mut s = [0f32; 4];
        for (i, (a, c)) in y.iter().zip(xs).enumerate() {
            s[i & 3] += a * c;
        }
        acc += (s[0] + s[1]) + (s[2] + s[3]);
    }
    acc
}

#[cfg(test)]
mod round_tests {
    use super::round_i8;

    #[test]
    fn round_i8_matches_round_then_clamp() {
        let want = |y: f32| y.round().clamp(-127.0, 127.0) as i8 as u8;
        let mut checked = 0u32;
        // Every tie k + 0.5 and the 64 floats on either side of it, for k in -130..130, plus a coarse sweep.
        for k in -130i32..130 {
            let tie = k as f32 + 0.5;
            let mut lo = tie;
            let mut hi = tie;
            for _ in 0..64 {
                for y in [lo, hi] {
                    assert_eq!(round_i8(y), want(y), "{y:e}");
                    checked += 1;
                }
                lo = f32::from_bits(if lo > 0.0 { lo.to_bits() - 1 } else { lo.to_bits() + 1 });
                hi = f32::from_bits(if hi > 0.0 { hi.to_bits() + 1 } else { hi.to_bits() - 1 });
            }
        }
        for i in -2_000_000i32..=2_000_000 {
            let y = i as f32 * 6.5e-5;
            assert_eq!(round_i8(y), want(y), "{y:e}");
        }
        assert!(checked > 30_000);
        assert_eq!(round_i8(0.0), 0);
        assert_eq!(round_i8(-0.0), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for id in 0..40 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id);
            }
        }
        assert_eq!(GgmlType::from_id(4), None);
    }

    #[test]
    fn row_bytes_checks_block_multiples() {
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::Q8_0.row_bytes(33), None);
        assert_eq!(GgmlType::Iq2Xxs.row_bytes(4096), Some(16 * 66));
        assert_eq!(GgmlType::F32.row_bytes(u64::MAX), None);
    }
}
