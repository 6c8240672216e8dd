// y[t, r] (+)= dot(W[row_base + r, :], x[t, :]) for r < rows, t < n_tok, reading W in its quant format directly.
// Composed after bytes.wgsl, one quant_*.wgsl (BLOCK_VALUES, BLOCK_BYTES, ROW_LANES, block_dot, quant_setup), a
// reduction prelude and lanes.wgsl (tile_dots: the block order and lane tree of every product).
// One workgroup of 64 invocations per (ROWS rows, tile of up to TILE tokens): a row's ROW_LANES lanes stride over
// its blocks and take each block's product with every token of the tile while its bytes are at hand, so a prefill
// chunk streams each weight row once per tile instead of once per token; then the lane tree per token.
// A token's result does not depend on the tile it is in (the same block order and tree for every token), so a
// prefill gives bit for bit what one-token decode ticks give.
// Dispatch: (grid_x, ceil(ceil(rows / ROWS) / grid_x), ceil(n_tok / TILE)) workgroups; workgroup
// i = wg.x + wg.y * grid_x takes rows i·ROWS .. i·ROWS + ROWS.
// Grouped products (group_rows > 0: o_groups of the attention output) run in the same dispatch: group g's rows
// read columns g·cols.. of each token's x, so every group is one dispatch instead of one each.
// Entry `multi`: the products of one input by several weights of one format and width, uploaded as one matrix
// (rows 0 .. end1 the first product's, end1 .. end2 the second's, …; `outputs` products, at most 6): the row's
// product k writes y_k (bindings 2, 4 .. 8; unused ones bound to any buffer) at (tok · rows_k + row − start_k),
// row_base 0, no accumulation, no groups. Each value is bit for bit what `main` gives for that
// product alone (the same tile_dots).
// Entry `swiglu_pair` (a dense expert's gate + up + SwiGLU: the shared expert): W is the gate rows then the up rows
// (2 · rows rows, one chunk, row_base 0); for r < rows, with g and u the dots of gate row r and up row rows + r (as
// `main` computes each), y[y_offset + t * y_stride + r] = silu(min(g, L)) * clamp(u, -L, L) (moe.wgsl's
// `swiglu`, the same f32 operations). Same dispatch as `main` over `rows`.
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
    outputs: u32,
    end1: u32,
    end2: u32,
    end3: u32,
    end4: u32,
    end5: u32,
    limit: f32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read_write> y1: array<f32>;
@group(0) @binding(5) var<storage, read_write> y2: array<f32>;
@group(0) @binding(6) var<storage, read_write> y3: array<f32>;
@group(0) @binding(7) var<storage, read_write> y4: array<f32>;
@group(0) @binding(8) var<storage, read_write> y5: array<f32>;

// The workgroup's first row: workgroups are numbered wg.x + wg.y · grid_x, ROWS rows each.
fn first_row(wg: vec3<u32>) -> u32 {
    return (wg.x + wg.y * p.grid_x) * ROWS;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tok0 = wg.z * TILE;
    if (tok0 >= p.n_tok) {
        return;
    }
    quant_setup(li);
    let row = first_row(wg) + li / ROW_LANES;
    let live = row < p.rows;
    let nt = min(TILE, p.n_tok - tok0);
    var xg = 0u;
    if (p.group_rows != 0u) {
        xg = ((p.group_row0 + row) / p.group_rows) * p.cols;
    }
    let d = tile_dots(li, (p.row_base + row) * p.row_bytes, p.x_offset + tok0 * p.x_stride + xg, p.x_stride, p.cols, nt, live);
    if (live && li % ROW_LANES == 0u) {
        for (var t = 0u; t < nt; t++) {
            let yi = p.y_offset + (tok0 + t) * p.y_stride + row;
            if (p.accumulate != 0u) {
                y[yi] += d[t];
            } else {
                y[yi] = d[t];
            }
        }
    }
}

// The first row after product k (the last product's ends at `rows`).
fn product_end(k: u32) -> u32 {
    switch k {
        case 0u: { return p.end1; }
        case 1u: { return p.end2; }
        case 2u: { return p.end3; }
        case 3u: { return p.end4; }
        case 4u: { return p.end5; }
        default: { return p.rows; }
    }
}

fn put(k: u32, i: u32, v: f32) {
    switch k {
        case 0u: { y[i] = v; }
        case 1u: { y1[i] = v; }
        case 2u: { y2[i] = v; }
        case 3u: { y3[i] = v; }
        case 4u: { y4[i] = v; }
        default: { y5[i] = v; }
    }
}

@compute @workgroup_size(64)
fn multi(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tok0 = wg.z * TILE;
    if (tok0 >= p.n_tok) {
        return;
    }
    quant_setup(li);
    let row = first_row(wg) + li / ROW_LANES;
    let live = row < p.rows;
    let nt = min(TILE, p.n_tok - tok0);
    let d = tile_dots(li, row * p.row_bytes, p.x_offset + tok0 * p.x_stride, p.x_stride, p.cols, nt, live);
    if (live && li % ROW_LANES == 0u) {
        var k = 0u;
        var start = 0u;
        while (k + 1u < p.outputs && row >= product_end(k)) {
            start = product_end(k);
            k++;
        }
        let rows_k = min(product_end(k), p.rows) - start;
        for (var t = 0u; t < nt; t++) {
            put(k, (tok0 + t) * rows_k + row - start, d[t]);
        }
    }
}

@compute @workgroup_size(64)
fn swiglu_pair(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tok0 = wg.z * TILE;
    if (tok0 >= p.n_tok) {
        return;
    }
    quant_setup(li);
    let row = first_row(wg) + li / ROW_LANES;
    let live = row < p.rows;
    let nt = min(TILE, p.n_tok - tok0);
    let xb = p.x_offset + tok0 * p.x_stride;
    let g = tile_dots(li, row * p.row_bytes, xb, p.x_stride, p.cols, nt, live);
    let u = tile_dots(li, (p.rows + row) * p.row_bytes, xb, p.x_stride, p.cols, nt, live);
    if (live && li % ROW_LANES == 0u) {
        for (var t = 0u; t < nt; t++) {
            let gate = min(g[t], p.limit);
            let up = clamp(u[t], -p.limit, p.limit);
            y[p.y_offset + (tok0 + t) * p.y_stride + row] = gate / (1.0 + exp(-gate)) * up;
        }
    }
}
