// Expert-indexed matrix product (MoE without reading the router's choice back): for pair q < n_pairs, with
// expert e = ids[q] and r < expert_rows,
//   y[y_offset + q * y_stride + r] = dot(W[e * expert_rows + r, :], x[x_offset + (q / x_div) * x_stride + :])
// where W's global rows chunk_first .. chunk_first + chunk_rows are this binding (row g at (g - chunk_first) *
// row_bytes); rows held by other chunks are left to the dispatch of their chunk. Composed after bytes.wgsl and one
// quant_*.wgsl (BLOCK_VALUES, BLOCK_BYTES, block_dot). One workgroup of 64 per (row, pair), the same block order
// and reduction as matmul.wgsl. Dispatch (grid_x, ceil(expert_rows / grid_x), n_pairs).
struct Params {
    expert_rows: u32,
    cols: u32,
    n_pairs: u32,
    row_bytes: u32,
    chunk_first: u32,
    chunk_rows: u32,
    x_offset: u32,
    x_stride: u32,
    x_div: u32,
    y_offset: u32,
    y_stride: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> ids: array<u32>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x + wg.y * p.grid_x;
    let q = wg.z;
    if (row >= p.expert_rows || q >= p.n_pairs) {
        return;
    }
    let g = ids[q] * p.expert_rows + row;
    if (g < p.chunk_first || g >= p.chunk_first + p.chunk_rows) {
        return;
    }
    let nb = p.cols / BLOCK_VALUES;
    let rb = (g - p.chunk_first) * p.row_bytes;
    let xb = p.x_offset + (q / p.x_div) * p.x_stride;
    var acc = 0.0;
    for (var blk = li; blk < nb; blk += WG) {
        acc += block_dot(rb + blk * BLOCK_BYTES, xb + blk * BLOCK_VALUES);
    }
    partial[li] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            partial[li] += partial[li + s];
        }
        workgroupBarrier();
    }
    if (li == 0u) {
        y[p.y_offset + q * p.y_stride + row] = partial[0];
    }
}
