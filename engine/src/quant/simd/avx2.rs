//! AVX2 + FMA kernels (x86-64).
use super::super::api::{DotF32, DotQ};
use super::super::GgmlType;

pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

pub(super) fn dot_f32(_ty: GgmlType) -> Option<DotF32> {
    None
}

pub(super) fn dot_q(_ty: GgmlType) -> Option<DotQ> {
    None
}
