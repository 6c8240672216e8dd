//! SIMD kernels, picked at runtime. [`dot_f32`] / [`dot_q`] return the best kernel this CPU supports for a weight
//! type, or `None` when only the scalar reference exists (the public API then uses the scalar code).
//!
//! - x86-64: AVX2 + FMA + F16C (all three required), detected with `is_x86_feature_detected!` (see `avx2`).
//! - aarch64 (little-endian): NEON (baseline on aarch64; compiled when the target enables it, see `neon`).
//!
//! Every SIMD kernel is tested against the scalar code of its format for odd block counts. Kernels follow the
//! contract in [`crate::quant`]: they only touch the whole blocks both buffers hold.

use super::api::{DotF32, DotQ};
use super::GgmlType;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
mod neon;

/// The instruction set the kernels use on this CPU: `"avx2"`, `"neon"` or `"scalar"`.
pub fn level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        return "avx2";
    }
    #[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
    return "neon";
    #[allow(unreachable_code)]
    "scalar"
}

/// The best SIMD kernel for weight type `ty` · f32 activations, if any.
pub(crate) fn dot_f32(ty: GgmlType) -> Option<DotF32> {
    #[cfg(target_arch = "x86_64")]
    return avx2::dot_f32(ty);
    #[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
    return neon::dot_f32(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

/// The best SIMD kernel for weight type `ty` · its quantized activations, if any.
pub(crate) fn dot_q(ty: GgmlType) -> Option<DotQ> {
    #[cfg(target_arch = "x86_64")]
    return avx2::dot_q(ty);
    #[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
    return neon::dot_q(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where SIMD is available every supported weight type must get a SIMD kernel, otherwise the SIMD-vs-scalar
    /// tests in `tests/quant_fixtures.rs` would silently compare the scalar code with itself.
    #[test]
    fn simd_kernels_resolve_for_every_weight_type() {
        if level() == "scalar" {
            eprintln!("no SIMD on this CPU; scalar kernels only");
            return;
        }
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q4K,
            GgmlType::Iq2Xxs,
        ] {
            assert!(dot_f32(ty).is_some(), "{ty}: no SIMD f32 dot");
        }
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
            assert!(dot_q(ty).is_some(), "{ty}: no SIMD quantized dot");
        }
        assert!(dot_q(GgmlType::F32).is_none());
    }
}
