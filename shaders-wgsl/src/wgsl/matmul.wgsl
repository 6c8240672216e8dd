// y[t, r] (+)= dot(W[row_base + r, :], x[t, :]) for r < rows, t < n_tok, reading W in its quant format directly.
// Composed after bytes.wgsl and one quant_*.wgsl (which define BLOCK_VALUES, BLOCK_BYTES, block_dot).
// One workgroup of 64 invocations per (row, tile of up to TILE tokens): invocations stride over the row's blocks
// and take each block's product with every token of the tile while its bytes are at hand, so a prefill chunk
// streams each weight row once per tile instead of once per token; then one tree reduction per token.
// A token's result does not depend on the tile it is in (the same block order and tree for every token), so a
// prefill gives bit for bit what one-token decode ticks give.
// Dispatch: (grid_x, ceil(rows / grid_x), ceil(n_tok / TILE)) workgroups; row = wg.x + wg.y * grid_x.
// Grouped products (group_rows > 0: o_groups of the attention output) run in the same dispatch: group g's rows
// read columns g·cols.. of each token's x, so every group is one dispatch instead of one each.
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
    group_rows: u32,
    group_row0: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

const WG: u32 = 64u;
const TILE: u32 = 8u;
var<workgroup> partial: array<f32, 512>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x + wg.y * p.grid_x;
    let tok0 = wg.z * TILE;
    if (row >= p.rows || tok0 >= p.n_tok) {
        return;
    }
    let nt = min(TILE, p.n_tok - tok0);
    let nb = p.cols / BLOCK_VALUES;
    let rb = (p.row_base + row) * p.row_bytes;
    var xg = 0u;
    if (p.group_rows != 0u) {
        xg = ((p.group_row0 + row) / p.group_rows) * p.cols;
    }
    let xb = p.x_offset + tok0 * p.x_stride + xg;
    var acc: array<f32, 8>;
    for (var blk = li; blk < nb; blk += WG) {
        let b = rb + blk * BLOCK_BYTES;
        for (var t = 0u; t < nt; t++) {
            acc[t] += block_dot(b, xb + t * p.x_stride + blk * BLOCK_VALUES);
        }
    }
    for (var t = 0u; t < nt; t++) {
        partial[t * WG + li] = acc[t];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            for (var t = 0u; t < nt; t++) {
                partial[t * WG + li] += partial[t * WG + li + s];
            }
        }
        workgroupBarrier();
    }
    if (li < nt) {
        let yi = p.y_offset + (tok0 + li) * p.y_stride + row;
        if (p.accumulate != 0u) {
            y[yi] += partial[li * WG];
        } else {
            y[yi] = partial[li * WG];
        }
    }
}
