// Expert-indexed matrix product (MoE without reading the router's choice back): for pair q < n_pairs, with
// expert e = ids[q] and r < expert_rows,
//   y[y_offset + q * y_stride + r] = dot(W[e * expert_rows + r, :], x[x_offset + (q / x_div) * x_stride + :])
// where W's global rows chunk_first .. chunk_first + chunk_rows are this binding (row g at (g - chunk_first) *
// row_bytes); rows held by other chunks are left to the dispatch of their chunk. Composed after bytes.wgsl and one
// quant_*.wgsl, a reduction prelude and lanes.wgsl (row_dot: matmul.wgsl's block order and lane tree). One
// workgroup of 64 per (ROWS rows, pair). Dispatch (grid_x, ceil(ceil(expert_rows / ROWS) / grid_x), n_pairs).
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
// Dispatch (grid_x, ceil(ceil(expert_rows / ROWS) / grid_x), n_pairs / k).
// Entry `tiles` (a prefill's products with the pairs grouped by expert on the device, `moe_group.wgsl`): tile i =
// plan[base_at] + wg.z (this chunk's run of tiles) is (e, first, count) at plan[1 + 3i ..]; for its pairs q = plan[order_at + first + t], t < count,
// and r < expert_rows, y[y_offset + q * y_stride + r] = dot(W[e * expert_rows + r, :], x[x_offset + (q / x_div) *
// x_stride + :]): `main`'s values bit for bit (a token's dot does not depend on its tile), each weight row read
// once per tile. Dispatched indirectly (grid_x, ceil(ceil(expert_rows / ROWS) / grid_x), T), T from the plan.
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
    order_at: u32,
    base_at: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> ids: array<u32>;
@group(0) @binding(5) var<storage, read> aux: array<f32>;
@group(0) @binding(6) var<storage, read> plan: array<u32>;

// Whether some of expert e's `rows` weight rows are in this dispatch's chunk (a workgroup whose expert lies wholly
// in other chunks returns at once: it would write nothing).
fn expert_in_chunk(e: u32, rows: u32) -> bool {
    return e * rows < p.chunk_first + p.chunk_rows && (e + 1u) * rows > p.chunk_first;
}

// The invocation's row: workgroups are numbered wg.x + wg.y · grid_x, ROWS rows each, ROW_LANES lanes a row.
fn my_row(wg: vec3<u32>, li: u32) -> u32 {
    return (wg.x + wg.y * p.grid_x) * ROWS + li / ROW_LANES;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let q = wg.z;
    if (q >= p.n_pairs || !expert_in_chunk(ids[q], p.expert_rows)) {
        return;
    }
    quant_setup(li);
    let row = my_row(wg, li);
    let g = ids[q] * p.expert_rows + row;
    let live = row < p.expert_rows && g >= p.chunk_first && g < p.chunk_first + p.chunk_rows;
    let v = row_dot(li, (g - p.chunk_first) * p.row_bytes, p.x_offset + (q / p.x_div) * p.x_stride, p.cols, live);
    if (live && li % ROW_LANES == 0u) {
        y[p.y_offset + q * p.y_stride + row] = v;
    }
}

@compute @workgroup_size(64)
fn gate_up_swiglu(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let q = wg.z;
    if (q >= p.n_pairs || !expert_in_chunk(ids[q], 2u * p.expert_rows)) {
        return;
    }
    quant_setup(li);
    let row = my_row(wg, li);
    let g = ids[q] * 2u * p.expert_rows + row;
    let live = row < p.expert_rows && g >= p.chunk_first && g + p.expert_rows < p.chunk_first + p.chunk_rows;
    let xb = p.x_offset + (q / p.x_div) * p.x_stride;
    let gate = min(row_dot(li, (g - p.chunk_first) * p.row_bytes, xb, p.cols, live), p.limit);
    let up = clamp(row_dot(li, (g + p.expert_rows - p.chunk_first) * p.row_bytes, xb, p.cols, live), -p.limit, p.limit);
    var h = gate / (1.0 + exp(-gate)) * up;
    if (p.route_weighted != 0u) {
        h *= aux[q];
    }
    if (live && li % ROW_LANES == 0u) {
        y[p.y_offset + q * p.y_stride + row] = h;
    }
}

@compute @workgroup_size(64)
fn down_combine(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.z;
    let k = p.x_div;
    if ((t + 1u) * k > p.n_pairs) {
        return;
    }
    quant_setup(li);
    let row = my_row(wg, li);
    let in_rows = row < p.expert_rows;
    var acc = 0.0;
    if (p.accumulate != 0u && in_rows) {
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
        let live = in_rows && g >= p.chunk_first && g < p.chunk_first + p.chunk_rows;
        let v = row_dot(li, (g - p.chunk_first) * p.row_bytes, p.x_offset + q * p.x_stride, p.cols, live);
        if (live) {
            acc += v;
        }
    }
    if (p.has_shared != 0u && in_rows) {
        acc += aux[t * p.y_stride + row];
    }
    if (in_rows && li % ROW_LANES == 0u) {
        y[p.y_offset + t * p.y_stride + row] = acc;
    }
}

@compute @workgroup_size(64)
fn tiles(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // This chunk's run of tiles starts at plan[base_at] (`moe_group.wgsl`).
    let tile = plan[p.base_at] + wg.z;
    if (tile >= plan[0] || !expert_in_chunk(plan[1u + 3u * tile], p.expert_rows)) {
        return;
    }
    quant_setup(li);
    let e = plan[1u + 3u * tile];
    let first = p.order_at + plan[2u + 3u * tile];
    let nt = min(plan[3u + 3u * tile], TILE);
    let row = my_row(wg, li);
    let g = e * p.expert_rows + row;
    let live = row < p.expert_rows && g >= p.chunk_first && g < p.chunk_first + p.chunk_rows;
    var xbs: array<u32, 8>;
    for (var t = 0u; t < nt; t++) {
        xbs[t] = p.x_offset + (plan[first + t] / p.x_div) * p.x_stride;
    }
    let d = tile_dots_at(li, (g - p.chunk_first) * p.row_bytes, xbs, p.cols, nt, live);
    if (live && li % ROW_LANES == 0u) {
        for (var t = 0u; t < nt; t++) {
            y[p.y_offset + plan[first + t] * p.y_stride + row] = d[t];
        }
    }
}
