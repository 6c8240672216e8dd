// y[t, r] (+)= dot(W[row_base + r, :], x[t, :]) for r < rows, t < n_tok, reading W in its quant format directly.
// Composed after bytes.wgsl and one quant_*.wgsl (which define BLOCK_VALUES, BLOCK_BYTES, block_dot).
// One workgroup of 64 invocations per (row, token); invocations stride over the row's blocks, then reduce.
// Dispatch: (grid_x, ceil(rows / grid_x), n_tok) workgroups; row = wg.x + wg.y * grid_x.
struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_bytes: u32,
    row_base: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    grid_x: u32,
    accumulate: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x + wg.y * p.grid_x;
    let tok = wg.z;
    if (row >= p.rows) {
        return;
    }
    let nb = p.cols / BLOCK_VALUES;
    let rb = (p.row_base + row) * p.row_bytes;
    let xb = p.x_offset + tok * p.x_stride;
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
        let yi = p.y_offset + tok * p.y_stride + row;
        if (p.accumulate != 0u) {
            y[yi] += partial[0];
        } else {
            y[yi] = partial[0];
        }
    }
}
