//! The uniform parameter blocks of the WGSL kernels, defined once: `#[repr(C)]` Rust structs the engine fills and
//! uploads as they are (`bytemuck`). Each matches the `Params` struct of its shader member for member; the test
//! `tests/params.rs` checks size and every member's offset, name and scalar type against naga's layout of the
//! parsed shader, so a field added on one side only fails the build's tests instead of corrupting a dispatch.
//! Members named `_p…` are padding (WGSL uniform structs are sized to 16 bytes).

/// `Params` of `matmul.wgsl` ([`crate::MATMUL_F32`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MatmulParams {
    pub rows: u32,
    pub cols: u32,
    pub n_tok: u32,
    pub row_bytes: u32,
    pub row_base: u32,
    pub x_offset: u32,
    pub x_stride: u32,
    pub y_offset: u32,
    pub y_stride: u32,
    pub grid_x: u32,
    pub accumulate: u32,
    /// Rows per group of a grouped product (0: not grouped): row `r` reads the `cols` columns of `x` at
    /// `((group_row0 + r) / group_rows) · cols`.
    pub group_rows: u32,
    /// The weight row of the dispatch's row 0, counted from the first row of group 0.
    pub group_row0: u32,
    /// Entry `multi` only: the number of products (1..=6) and where products 0..4 end (the last ends at `rows`).
    pub outputs: u32,
    pub end1: u32,
    pub end2: u32,
    pub end3: u32,
    pub end4: u32,
    pub end5: u32,
    /// Entry `swiglu_pair` only: the SwiGLU clamp L.
    pub limit: f32,
}

/// `Params` of `get_rows.wgsl` ([`crate::GET_ROWS_F32`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GetRowsParams {
    pub n_ids: u32,
    pub cols: u32,
    pub row_bytes: u32,
    pub y_offset: u32,
    pub y_stride: u32,
    /// Entry `embed_norm` only: the streams per row and the norm's epsilon.
    pub copies: u32,
    pub eps: f32,
    pub _pad: [u32; 1],
}

/// `Params` of `matmul_ids.wgsl` ([`crate::MATMUL_IDS_F32`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct IdsParams {
    pub expert_rows: u32,
    pub cols: u32,
    pub n_pairs: u32,
    pub row_bytes: u32,
    pub chunk_first: u32,
    pub chunk_rows: u32,
    pub x_offset: u32,
    pub x_stride: u32,
    pub x_div: u32,
    pub y_offset: u32,
    pub y_stride: u32,
    pub grid_x: u32,
    /// `gate_up_swiglu`: the SwiGLU clamp L.
    pub limit: f32,
    /// `gate_up_swiglu`: multiply by the pair's routing weight (binding 5).
    pub route_weighted: u32,
    /// `down_combine`: add to the output as a previous chunk's dispatch left it.
    pub accumulate: u32,
    /// `down_combine`: add the shared expert's output (binding 5).
    pub has_shared: u32,
    /// `tiles`: where the pair order starts in the plan (binding 6).
    pub order_at: u32,
    /// `tiles`: where this dispatch's first tile index is in the plan.
    pub base_at: u32,
    pub _p: [u32; 2],
}

/// `Params` of `moe_ids.wgsl` ([`crate::MOE_IDS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CombineParams {
    pub n: u32,
    pub rows: u32,
    pub k: u32,
    /// 1: add the shared expert's output (binding 4) after the routed ones.
    pub has_shared: u32,
}

/// `Params` of `moe_group.wgsl` ([`crate::MOE_GROUP`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GroupParams {
    pub n_pairs: u32,
    pub n_exp: u32,
    /// Where the pair order starts in the plan.
    pub order_at: u32,
    /// Where the dispatches' first tiles start in the plan.
    pub base_at: u32,
    /// The three products' (x, y) workgroup grids, written to the indirect arguments (z = the tile count).
    pub grid0: [u32; 4],
    pub grid1: [u32; 4],
    pub grid2: [u32; 4],
}

/// `Params` of `norm.wgsl` ([`crate::RMS_NORM`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct NormParams {
    pub n: u32,
    pub rows: u32,
    pub x_offset: u32,
    pub x_stride: u32,
    pub y_offset: u32,
    pub y_stride: u32,
    pub has_weight: u32,
    pub grid_x: u32,
    pub eps: f32,
    /// `norm_rope` only: heads per token (row `r` is head `r % heads` of token `r / heads`).
    pub heads: u32,
    /// `norm_rope` only: the rope slice (the last `rope_dim` values of each row).
    pub rope_dim: u32,
    /// `norm_rope` only: when not 0, the FP8 simulation of the values before the rope slice in blocks of this
    /// many (`act.wgsl`'s `fp8`).
    pub fp8_block: u32,
}

/// `Params` of `rope.wgsl` ([`crate::ROPE`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeParams {
    pub n_tok: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub rope_dim: u32,
    pub offset: u32,
    pub tok_stride: u32,
    pub head_stride: u32,
    pub inverse: u32,
}

/// `Params` of `attention.wgsl` ([`crate::ATTENTION`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnParams {
    pub n_tok: u32,
    pub heads: u32,
    pub dim: u32,
    pub max_keys: u32,
    pub q_offset: u32,
    pub q_tok_stride: u32,
    pub o_offset: u32,
    pub o_tok_stride: u32,
    pub scale: f32,
    pub topk: u32,
    /// log2 of the rows per KV page (`pages.wgsl`).
    pub page_shift: u32,
    /// `keyed` only: when not 0, the inverse RoPE of the last `rope_dim` values of each output head (binding 12).
    pub rope_dim: u32,
    /// `keyed` only: the batch row of the dispatch's token 0 (its row in the rope table).
    pub rope_row0: u32,
    pub _p0: u32,
    pub _p1: u32,
    pub _p2: u32,
}

/// `Params` of `kvdev.wgsl` ([`crate::KVDEV`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ApeParams {
    pub rows: u32,
    pub w: u32,
    pub pos0: u32,
    pub ratio: u32,
    pub off: u32,
    pub _p: [u32; 3],
}

/// `Params` of `hc.wgsl` ([`crate::HC`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct HcParams {
    pub n_tok: u32,
    pub d: u32,
    pub n: u32,
    pub iters: u32,
    pub head: u32,
    pub mix_offset: u32,
    pub mix_stride: u32,
    pub u_offset: u32,
    pub u_stride: u32,
    pub f_offset: u32,
    pub f_stride: u32,
    /// `weights_collapse_norm`: whether the norm has a weight (binding 8).
    pub has_weight: u32,
    pub norm_eps: f32,
    pub hc_eps: f32,
    pub _p1: [u32; 2],
}

/// `Params` of `compress.wgsl` ([`crate::COMPRESS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CompressParams {
    pub n_windows: u32,
    pub slots: u32,
    pub dim: u32,
    pub src_stride: u32,
    pub ape_stride: u32,
    pub out_offset: u32,
    pub out_stride: u32,
    pub _p0: u32,
}

/// `Params` of `indexer.wgsl` ([`crate::INDEXER`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct IndexerParams {
    pub n_tok: u32,
    pub n_keys: u32,
    pub heads: u32,
    pub dim: u32,
    pub k: u32,
    /// log2 of the rows per KV page (`pages.wgsl`).
    pub page_shift: u32,
    /// Multiplies each head weight as it is read (1: none), the f32 product a `Scale` of the weights would store.
    pub w_scale: f32,
    pub scale: f32,
    /// The row of token 0 in `q`, `w` and `sel` (a run's first batch row).
    pub row0: u32,
    pub _p: [u32; 3],
}

/// `Params` of `moe.wgsl` ([`crate::MOE`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MoeParams {
    pub n_tok: u32,
    pub n_exp: u32,
    pub k: u32,
    pub hash: u32,
    pub n: u32,
    pub rows: u32,
    pub gu_stride: u32,
    pub up_offset: u32,
    pub h_offset: u32,
    pub h_stride: u32,
    pub use_w: u32,
    pub stride: u32,
    pub route_scale: f32,
    pub limit: f32,
    pub renorm: u32,
    /// `swiglu_shared`: rows of the shared expert (binding 7) after the `rows` routed ones.
    pub rows2: u32,
}

/// `Params` of `act.wgsl` ([`crate::ACT`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ActParams {
    pub rows: u32,
    pub n: u32,
    pub stride: u32,
    pub block: u32,
    /// `rope_hadamard_fp4` only: rows per token (row `r` is head `r % heads` of token `r / heads`).
    pub heads: u32,
    /// `rope_hadamard_fp4` only: the rope slice (the last `rope_dim` values of each row).
    pub rope_dim: u32,
    pub _p0: u32,
    pub _p1: u32,
}

/// `Params` of `scale.wgsl` ([`crate::SCALE`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ScaleParams {
    pub n: u32,
    pub _p0: u32,
    pub _p1: u32,
    pub factor: f32,
}

/// `Params` of `candidates.wgsl` ([`crate::CANDIDATES`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CandParams {
    pub vocab: u32,
    /// Candidates per row (rounds).
    pub k: u32,
    pub rows: u32,
    pub _p: u32,
}

/// `Params` of `copy.wgsl` ([`crate::copy_source`]): up to [`CopyParams::SEGMENTS`] segments, each
/// `[n, src_off, dst_off, 0]` in u32 words.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CopyParams {
    pub s: [[u32; 4]; 8],
}

impl CopyParams {
    /// The most segments one dispatch copies.
    pub const SEGMENTS: usize = 8;
}

/// One parameter block's Rust layout.
#[derive(Clone, Debug)]
pub struct ParamsLayout {
    pub rust_name: &'static str,
    /// The shader source whose `Params` struct it mirrors.
    pub source: &'static str,
    pub size: usize,
    /// `(name, byte offset, byte size)` in declaration order.
    pub members: Vec<(&'static str, usize, usize)>,
}

macro_rules! layout {
    ($ty:ident, $src:ident, [$($f:ident),*]) => {{
        let z = <$ty as bytemuck::Zeroable>::zeroed();
        let _ = &z;
        ParamsLayout {
            rust_name: stringify!($ty),
            source: crate::$src,
            size: std::mem::size_of::<$ty>(),
            members: vec![$((stringify!($f), std::mem::offset_of!($ty, $f), std::mem::size_of_val(&z.$f))),*],
        }
    }};
}

/// Every parameter block with its shader source and its members `(name, offset, size)`, for the layout test.
pub fn all() -> Vec<ParamsLayout> {
    vec![
        layout!(
            MatmulParams,
            MATMUL_F32,
            [
                rows, cols, n_tok, row_bytes, row_base, x_offset, x_stride, y_offset, y_stride, grid_x, accumulate,
                group_rows, group_row0, outputs, end1, end2, end3, end4, end5, limit
            ]
        ),
        layout!(GetRowsParams, GET_ROWS_F32, [n_ids, cols, row_bytes, y_offset, y_stride, copies, eps, _pad]),
        layout!(
            IdsParams,
            MATMUL_IDS_F32,
            [
                expert_rows,
                cols,
                n_pairs,
                row_bytes,
                chunk_first,
                chunk_rows,
                x_offset,
                x_stride,
                x_div,
                y_offset,
                y_stride,
                grid_x,
                limit,
                route_weighted,
                accumulate,
                has_shared,
                order_at,
                base_at,
                _p
            ]
        ),
        layout!(CombineParams, MOE_IDS, [n, rows, k, has_shared]),
        layout!(GroupParams, MOE_GROUP, [n_pairs, n_exp, order_at, base_at, grid0, grid1, grid2]),
        layout!(
            NormParams,
            RMS_NORM,
            [n, rows, x_offset, x_stride, y_offset, y_stride, has_weight, grid_x, eps, heads, rope_dim, fp8_block]
        ),
        layout!(RopeParams, ROPE, [n_tok, heads, head_dim, rope_dim, offset, tok_stride, head_stride, inverse]),
        layout!(
            AttnParams,
            ATTENTION,
            [
                n_tok,
                heads,
                dim,
                max_keys,
                q_offset,
                q_tok_stride,
                o_offset,
                o_tok_stride,
                scale,
                topk,
                page_shift,
                rope_dim,
                rope_row0,
                _p0,
                _p1,
                _p2
            ]
        ),
        layout!(ApeParams, KVDEV, [rows, w, pos0, ratio, off, _p]),
        layout!(
            HcParams,
            HC,
            [
                n_tok, d, n, iters, head, mix_offset, mix_stride, u_offset, u_stride, f_offset, f_stride, has_weight,
                norm_eps, hc_eps, _p1
            ]
        ),
        layout!(CompressParams, COMPRESS, [n_windows, slots, dim, src_stride, ape_stride, out_offset, out_stride, _p0]),
        layout!(IndexerParams, INDEXER, [n_tok, n_keys, heads, dim, k, page_shift, w_scale, scale, row0, _p]),
        layout!(
            MoeParams,
            MOE,
            [
                n_tok,
                n_exp,
                k,
                hash,
                n,
                rows,
                gu_stride,
                up_offset,
                h_offset,
                h_stride,
                use_w,
                stride,
                route_scale,
                limit,
                renorm,
                rows2
            ]
        ),
        layout!(ActParams, ACT, [rows, n, stride, block, heads, rope_dim, _p0, _p1]),
        layout!(ScaleParams, SCALE, [n, _p0, _p1, factor]),
        layout!(CandParams, CANDIDATES, [vocab, k, rows, _p]),
        layout!(CopyParams, COPY, [s]),
    ]
}
