// Row dot products shared by the weight-product kernels (matmul.wgsl, matmul_ids.wgsl): a workgroup of WG = 64
// invocations takes ROWS = WG / ROW_LANES weight rows (ROW_LANES from the quant file), ROW_LANES invocations (the
// row's lanes) per row. Composed after bytes.wgsl, a quant_*.wgsl and a reduction prelude that defines `SG` and
// `lane_shuffle(v, s)`: either `const SG: u32 = 1u` with a `lane_shuffle` that is never called (workgroup memory
// only), or SG = the adapter's smallest subgroup size with `lane_shuffle` = `subgroupShuffleXor`.
//
// The order of the additions is fixed, whatever the prelude: lane l adds the products of blocks l, l + ROW_LANES,
// l + 2·ROW_LANES, … in that order, then the lanes are summed by the tree s = ROW_LANES/2, …, 2, 1 (lane l < s adds
// lane l + s). The steps with s ≥ SG go through workgroup memory, the others through subgroup shuffles (a
// butterfly: lane l adds lane l ^ s, which for the lanes that matter is l + s), so lane 0 ends with the same value
// bit for bit on every adapter, with or without subgroups. A token's value does not depend on the tile it is in.
// Subgroups are taken to hold consecutive local invocation indices, as drivers lay out a one-dimensional
// workgroup (no API promises it: the engine checks it with lane_probe.wgsl when a device opens and sums through
// workgroup memory where it does not hold); SG never exceeds the adapter's smallest subgroup, so the lanes a
// shuffle pairs lie in one subgroup.

const WG: u32 = 64u;
const ROWS: u32 = WG / ROW_LANES;
// Tokens per tile (`MATMUL_TILE` in the engine): a tile's tokens share each weight block read.
const TILE: u32 = 8u;
var<workgroup> partial: array<f32, 512>;

// The dots of the row at byte `rb` with the nt ≤ TILE vectors x[xb + t·x_stride ..][..cols], valid at lane 0 of
// the row (li % ROW_LANES == 0). `live` is false for a row past the end: its lanes read nothing but still take part
// in the barriers. Called by every invocation of the workgroup, in uniform control flow (nt uniform).
fn tile_dots(li: u32, rb: u32, xb: u32, x_stride: u32, cols: u32, nt: u32, live: bool) -> array<f32, 8> {
    let lane = li % ROW_LANES;
    let nb = cols / BLOCK_VALUES;
    var acc: array<f32, 8>;
    if (live) {
        for (var blk = lane; blk < nb; blk += ROW_LANES) {
            for (var t = 0u; t < nt; t++) {
                acc[t] += block_dot(rb, blk, nb, xb + t * x_stride + blk * BLOCK_VALUES);
            }
        }
    }
    return lane_sums(li, acc, nt);
}

// `tile_dots` with each token's vector at its own start: x[xbs[t] ..][..cols] (rows picked by a list). The same
// additions in the same order, so a token's dot is `tile_dots`'s bit for bit.
fn tile_dots_at(li: u32, rb: u32, xbs: array<u32, 8>, cols: u32, nt: u32, live: bool) -> array<f32, 8> {
    let lane = li % ROW_LANES;
    let nb = cols / BLOCK_VALUES;
    var acc: array<f32, 8>;
    if (live) {
        for (var blk = lane; blk < nb; blk += ROW_LANES) {
            for (var t = 0u; t < nt; t++) {
                acc[t] += block_dot(rb, blk, nb, xbs[t] + blk * BLOCK_VALUES);
            }
        }
    }
    return lane_sums(li, acc, nt);
}

// The row's lane sums (the fixed tree above), each lane holding its partial dots `acc` of nt tokens.
fn lane_sums(li: u32, acc_in: array<f32, 8>, nt: u32) -> array<f32, 8> {
    let lane = li % ROW_LANES;
    var acc = acc_in;
    if (ROW_LANES > SG) {
        // The previous call's readers are done with `partial`.
        workgroupBarrier();
        for (var t = 0u; t < nt; t++) {
            partial[t * WG + li] = acc[t];
        }
        workgroupBarrier();
        for (var s = ROW_LANES / 2u; s >= SG; s >>= 1u) {
            if (lane < s) {
                for (var t = 0u; t < nt; t++) {
                    partial[t * WG + li] += partial[t * WG + li + s];
                }
            }
            workgroupBarrier();
        }
        for (var t = 0u; t < nt; t++) {
            acc[t] = partial[t * WG + li];
        }
    }
    for (var s = min(SG, ROW_LANES) / 2u; s > 0u; s >>= 1u) {
        for (var t = 0u; t < nt; t++) {
            acc[t] += lane_shuffle(acc[t], s);
        }
    }
    return acc;
}

// One token's dot (tile_dots with nt = 1).
fn row_dot(li: u32, rb: u32, xb: u32, cols: u32, live: bool) -> f32 {
    return tile_dots(li, rb, xb, 0u, cols, 1u, live)[0];
}
