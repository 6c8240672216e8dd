//! The CUDA kernels' host shim as the tests see it: the `shim_<kernel>` entry points of the library `build.rs`
//! makes from `kernels-native/cuda/host/shim.cpp` (the kernel sources compiled as C++), lookups by kernel name,
//! and [`device::ShimDevice`], a `cuda_host::Device` whose launches run those entry points on host buffers, so the
//! engine's CUDA backend runs whole on the CPU (`cuda_backend.rs`).
#![allow(dead_code)]

pub mod device;

use ds4_kernels_native::cuda_kernels::{CudaWeight, Plan};

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

pub type Grid = *const Dim3;

/// Declares `shim_<kernel>(grid, block, args...)` entry points of the shim library.
macro_rules! shims {
    ($($name:ident ( $($arg:ty),* );)*) => {
        #[link(name = "ds4_cuda_shim", kind = "static")]
        #[link(name = "stdc++")]
        extern "C" {
            $(pub fn $name(g: Grid, b: Grid, $(_: $arg),*);)*
        }
    };
}

pub type MatvecFn =
    unsafe extern "C" fn(Grid, Grid, *const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
pub type F16Fn = unsafe extern "C" fn(Grid, Grid, *const u16, *const f32, *mut f32, i32, i32, i32);
pub type TermsFn = unsafe extern "C" fn(Grid, Grid, *const u8, i32, *const i8, *const f32, *const i32, *mut f32);
pub type GateUpFn = unsafe extern "C" fn(
    Grid,
    Grid,
    *const u8,
    *const u8,
    i64,
    i32,
    *const i8,
    *const f32,
    *const i32,
    *const i32,
    *const f32,
    *mut f32,
    i32,
    i32,
    i32,
    f32,
);
pub type DownSumFn = unsafe extern "C" fn(
    Grid,
    Grid,
    *const u8,
    i64,
    i32,
    *const i8,
    *const f32,
    *const i32,
    *const i32,
    *const f32,
    *mut f32,
    i32,
    i32,
    i32,
);

shims! {
    shim_ds4_quantize_q8_0(*const f32, *mut i8, *mut f32, i32);
    shim_ds4_quantize_q8_k(*const f32, *mut i8, *mut f32, *mut i32, i32);
    shim_ds4_rms_norm(*const f32, *const f32, *mut f32, i32, f32);
    shim_ds4_rope(*mut f32, *const f32, *const i32, i32, i32, i32, i32, i32);
    shim_ds4_swiglu(*mut f32, *const f32, i64, f32);
    shim_ds4_moe_route(*const f32, *const f32, *const i32, *const i32, *mut i32, *mut f32, i32, i32, i32, i32, f32);
    shim_ds4_add(*mut f32, *const f32, i64);
    shim_ds4_gather_rows(*const f32, *const i32, *mut f32, i32, i32);
    shim_ds4_top_candidates(*const f32, i32, i32, *mut u32, *mut f32);
    shim_ds4_embed(*const u8, i32, i64, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_hc_weights(*const f32, i32, *const f32, *const f32, i32, f32, i32, *mut f32, *mut f32, i32);
    shim_ds4_hc_head_weights(*const f32, *const f32, f32, i32, f32, *mut f32, i32);
    shim_ds4_hc_collapse(*const f32, *const f32, *mut f32, i32, i32);
    shim_ds4_hc_post(*mut f32, *const f32, *const f32, i32, i32);
    shim_ds4_matvec_q8_0_b1(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_q8_0_b2(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_q8_0_b4(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_q8_0_b8(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_iq2_xxs_b1(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_iq2_xxs_b4(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_q2_k_b1(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_q2_k_b4(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_q4_k_b1(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_q4_k_b4(*const u8, *const i8, *const f32, *const i32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_f16_b1(*const u16, *const f32, *mut f32, i32, i32, i32);
    shim_ds4_matvec_f16_b4(*const u16, *const f32, *mut f32, i32, i32, i32);
    shim_ds4_block_terms_q8_0(*const u8, i32, *const i8, *const f32, *const i32, *mut f32);
    shim_ds4_block_terms_iq2_xxs(*const u8, i32, *const i8, *const f32, *const i32, *mut f32);
    shim_ds4_block_terms_q2_k(*const u8, i32, *const i8, *const f32, *const i32, *mut f32);
    shim_ds4_block_terms_q4_k(*const u8, i32, *const i8, *const f32, *const i32, *mut f32);
    shim_ds4_moe_gate_up_iq2_xxs(*const u8, *const u8, i64, i32, *const i8, *const f32, *const i32, *const i32,
        *const f32, *mut f32, i32, i32, i32, f32);
    shim_ds4_moe_gate_up_q2_k(*const u8, *const u8, i64, i32, *const i8, *const f32, *const i32, *const i32,
        *const f32, *mut f32, i32, i32, i32, f32);
    shim_ds4_moe_gate_up_q4_k(*const u8, *const u8, i64, i32, *const i8, *const f32, *const i32, *const i32,
        *const f32, *mut f32, i32, i32, i32, f32);
    shim_ds4_moe_down_sum_iq2_xxs(*const u8, i64, i32, *const i8, *const f32, *const i32, *const i32, *const f32,
        *mut f32, i32, i32, i32);
    shim_ds4_moe_down_sum_q2_k(*const u8, i64, i32, *const i8, *const f32, *const i32, *const i32, *const f32,
        *mut f32, i32, i32, i32);
    shim_ds4_moe_down_sum_q4_k(*const u8, i64, i32, *const i8, *const f32, *const i32, *const i32, *const f32,
        *mut f32, i32, i32, i32);
}

pub fn matvec_fn(kernel: &str) -> MatvecFn {
    match kernel {
        "ds4_matvec_q8_0_b1" => shim_ds4_matvec_q8_0_b1,
        "ds4_matvec_q8_0_b2" => shim_ds4_matvec_q8_0_b2,
        "ds4_matvec_q8_0_b4" => shim_ds4_matvec_q8_0_b4,
        "ds4_matvec_q8_0_b8" => shim_ds4_matvec_q8_0_b8,
        "ds4_matvec_iq2_xxs_b1" => shim_ds4_matvec_iq2_xxs_b1,
        "ds4_matvec_iq2_xxs_b4" => shim_ds4_matvec_iq2_xxs_b4,
        "ds4_matvec_q2_k_b1" => shim_ds4_matvec_q2_k_b1,
        "ds4_matvec_q2_k_b4" => shim_ds4_matvec_q2_k_b4,
        "ds4_matvec_q4_k_b1" => shim_ds4_matvec_q4_k_b1,
        "ds4_matvec_q4_k_b4" => shim_ds4_matvec_q4_k_b4,
        k => panic!("no shim entry for {k}"),
    }
}

pub fn f16_fn(kernel: &str) -> F16Fn {
    match kernel {
        "ds4_matvec_f16_b1" => shim_ds4_matvec_f16_b1,
        "ds4_matvec_f16_b4" => shim_ds4_matvec_f16_b4,
        k => panic!("no shim entry for {k}"),
    }
}

pub fn terms_fn(kernel: &str) -> TermsFn {
    match kernel {
        "ds4_block_terms_q8_0" => shim_ds4_block_terms_q8_0,
        "ds4_block_terms_iq2_xxs" => shim_ds4_block_terms_iq2_xxs,
        "ds4_block_terms_q2_k" => shim_ds4_block_terms_q2_k,
        "ds4_block_terms_q4_k" => shim_ds4_block_terms_q4_k,
        k => panic!("no shim entry for {k}"),
    }
}

pub fn moe_fns(ty: CudaWeight) -> (GateUpFn, DownSumFn) {
    match ty {
        CudaWeight::Iq2Xxs => (shim_ds4_moe_gate_up_iq2_xxs, shim_ds4_moe_down_sum_iq2_xxs),
        CudaWeight::Q2K => (shim_ds4_moe_gate_up_q2_k, shim_ds4_moe_down_sum_q2_k),
        CudaWeight::Q4K => (shim_ds4_moe_gate_up_q4_k, shim_ds4_moe_down_sum_q4_k),
        t => panic!("no MoE kernels for {t:?}"),
    }
}

pub fn dims(p: &Plan) -> (Dim3, Dim3) {
    let [gx, gy, gz] = p.dims.grid;
    let [bx, by, bz] = p.dims.block;
    (Dim3 { x: gx, y: gy, z: gz }, Dim3 { x: bx, y: by, z: bz })
}
