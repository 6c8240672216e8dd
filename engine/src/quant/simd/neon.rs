//! NEON kernels (aarch64).
use super::super::api::{DotF32, DotQ};
use super::super::GgmlType;

pub(super) fn dot_f32(_ty: GgmlType) -> Option<DotF32> {
    None
}

pub(super) fn dot_q(_ty: GgmlType) -> Option<DotQ> {
    None
}
