// Expert-indexed matrix product (MoE without reading the router's choice back): for pair q < n_pairs, with
// expert e = ids[q] and r < expert_rows,
//   y[y_offset + q * y_stride + r] = dot(W[e * expert_rows + r, :], x[x_offset + (q / x_div) * x_stride + :])
// where W's global rows chunk_first .. chunk_first + chunk_rows are this binding (row g at (g - chunk_first) *
// row_bytes); rows held by other chunks are left to the dispatch of their chunk. Composed after bytes.wgsl and one
// quant_*.wgsl (BLOCK_VALUES, BLOCK_BYTES, block_dot). One workgroup of 64 per (row, pair), the same block order
// and reduction as matmul.wgsl. Dispatch (grid_x, ceil(expert_rows / grid_x), n_pairs).
//
// Entry `gate_up_swiglu` (the decode MoE's gate + up + SwiGLU in one dispatch): W's experts are 2 · expert_rows
// rows each, gate rows then up rows (the interleaved pair); for pair q and r < expert_rows, with g and u the dots of
// gate row r and up row r (as `main` computes each),
//   y[y_offset + q * y_stride + r] = silu(min(g, L)) * clamp(u, -L, L) (* aux[q] when route_weighted)
// (moe.wgsl's `swiglu`, the same f32 operations). Same dispatch as `main`.
// Entry `down_combine` (the decode MoE's down product + the sum over experts, no atomics): for token t = wg.z and
// r < expert_rows, out[y_offset + t * y_stride + r] = sum over its k = x_div slots j in ascending (ids[t·k + j], j)
// order of dot(W[ids[t·k + j] · expert_rows + r], x[x_offset + (t·k + j) · x_stride ..]), then + aux[t · y_stride
// + r] (the shared expert's output, when has_shared): bit for bit `main` per slot then moe_ids.wgsl's `combine`.
// Over several chunks, one dispatch each in row order: a dispatch adds the slots whose row is in its chunk to the
// sum so far (`accumulate`: out as the previous chunk left it; the rows of one output grow with the expert, so the
// additions keep ascending expert order), and the last one (has_shared) adds the shared expert's.
// Dispatch (grid_x, ceil(expert_rows / grid_x), n_pairs / k).
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
    limit: f32,
    route_weighted: u32,
    accumulate: u32,
    has_shared: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> ids: array<u32>;
@group(0) @binding(5) var<storage, read> aux: array<f32>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

// dot(W row at byte rb, x[xb ..]): invocations stride over the row's blocks, then one tree reduction (matmul.wgsl's
// order). Called by every invocation; returns the same value to all.
fn row_dot(li: u32, rb: u32, xb: u32) -> f32 {
    let nb = p.cols / BLOCK_VALUES;
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
    let v = partial[0];
    workgroupBarrier();
    return v;
}

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
    let v = row_dot(li, (g - p.chunk_first) * p.row_bytes, p.x_offset + (q / p.x_div) * p.x_stride);
    if (li == 0u) {
        y[p.y_offset + q * p.y_stride + row] = v;
    }
}

@compute @workgroup_size(64)
fn gate_up_swiglu(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x + wg.y * p.grid_x;
    let q = wg.z;
    if (row >= p.expert_rows || q >= p.n_pairs) {
        return;
    }
    let g = ids[q] * 2u * p.expert_rows + row;
    if (g < p.chunk_first || g + p.expert_rows >= p.chunk_first + p.chunk_rows) {
        return;
    }
    let xb = p.x_offset + (q / p.x_div) * p.x_stride;
    let gate = min(row_dot(li, (g - p.chunk_first) * p.row_bytes, xb), p.limit);
    let up = clamp(row_dot(li, (g + p.expert_rows - p.chunk_first) * p.row_bytes, xb), -p.limit, p.limit);
    var h = gate / (1.0 + exp(-gate)) * up;
    if (p.route_weighted != 0u) {
        h *= aux[q];
    }
    if (li == 0u) {
        y[p.y_offset + q * p.y_stride + row] = h;
    }
}

@compute @workgroup_size(64)
fn down_combine(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x + wg.y * p.grid_x;
    let t = wg.z;
    let k = p.x_div;
    if (row >= p.expert_rows || (t + 1u) * k > p.n_pairs) {
        return;
    }
    var acc = 0.0;
    if (p.accumulate != 0u) {
        acc = y[p.y_offset + t * p.y_stride + row];
    }
    var last = 0u;
    for (var i = 0u; i < k; i++) {
        // The smallest key (expert * k + slot) above the previous one (keys are distinct).
        var best = 0xffffffffu;
        for (var j = 0u; j < k; j++) {
            let key = ids[t * k + j] * k + j;
            if ((i == 0u || key > last) && key < best) {
                best = key;
            }
        }
        last = best;
        let q = t * k + best % k;
        let g = ids[q] * p.expert_rows + row;
        if (g >= p.chunk_first && g < p.chunk_first + p.chunk_rows) {
            acc += row_dot(li, (g - p.chunk_first) * p.row_bytes, p.x_offset + q * p.x_stride);
        }
    }
    if (p.has_shared != 0u) {
        acc += aux[t * p.y_stride + row];
    }
    if (li == 0u) {
        y[p.y_offset + t * p.y_stride + row] = acc;
    }
}
