// Groups a MoE layer's (row, slot) pairs by expert on the device, so a prefill's expert products read each expert's
// weights once per tile of up to TILE pairs without the router's choice going to the host.
// Input: sel[q] (the expert of pair q = row * k + slot, q < n_pairs; each < n_exp <= MAX_EXPERTS).
// Output `plan` (u32): plan[0] = T, the number of tiles; tile i at plan[1 + 3i ..] = (expert, first, count): the
// pairs order[first .. first + count] (count <= TILE), all of that expert; order at plan[order_at ..] holds every
// pair once, sorted by expert, ascending within an expert. Tiles are in expert order; T = sum over experts of
// ceil(pairs of the expert / TILE) <= ceil(n_pairs / TILE) + min(n_pairs, n_exp).
// The products run one dispatch per weight chunk (a weight split across bindings); dispatch j = i * MAX_CHUNKS + c
// is product i's over chunk c, which holds experts bounds[2j] .. bounds[2j + 1] (none: equal bounds). It takes
// the tiles of those experts, a contiguous run: its first tile at plan[base_at + j], its indirect dispatch
// arguments (gx_i, gy_i, tiles) at args[3j ..].
// One workgroup of 256; dispatch (1, 1, 1).
const TILE: u32 = 8u;
const MAX_EXPERTS: u32 = 1024u;
const MAX_CHUNKS: u32 = 64u;
const WGS: u32 = 256u;

struct Params {
    n_pairs: u32,
    n_exp: u32,
    order_at: u32,
    base_at: u32,
    grid0: vec4<u32>,
    grid1: vec4<u32>,
    grid2: vec4<u32>,
}

@group(0) @binding(0) var<storage, read> sel: array<u32>;
@group(0) @binding(1) var<storage, read_write> plan: array<u32>;
@group(0) @binding(2) var<storage, read_write> args: array<u32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> bounds: array<u32>;

var<workgroup> count: array<u32, 1024>;
var<workgroup> start: array<u32, 1024>;
// tile0[e]: the first tile of expert e; tile0[n_exp] = T.
var<workgroup> tile0: array<u32, 1025>;

fn grid(i: u32) -> vec4<u32> {
    if (i == 0u) {
        return p.grid0;
    }
    if (i == 1u) {
        return p.grid1;
    }
    return p.grid2;
}

@compute @workgroup_size(256)
fn group(@builtin(local_invocation_index) li: u32) {
    for (var e = li; e < p.n_exp; e += WGS) {
        var c = 0u;
        for (var q = 0u; q < p.n_pairs; q++) {
            c += select(0u, 1u, sel[q] == e);
        }
        count[e] = c;
    }
    workgroupBarrier();
    if (li == 0u) {
        var at = 0u;
        var t = 0u;
        for (var e = 0u; e < p.n_exp; e++) {
            start[e] = at;
            tile0[e] = t;
            at += count[e];
            t += (count[e] + TILE - 1u) / TILE;
        }
        tile0[p.n_exp] = t;
        plan[0] = t;
        for (var j = 0u; j < 3u * MAX_CHUNKS; j++) {
            let lo = min(bounds[2u * j], p.n_exp);
            let hi = max(min(bounds[2u * j + 1u], p.n_exp), lo);
            let g = grid(j / MAX_CHUNKS);
            plan[p.base_at + j] = tile0[lo];
            args[3u * j] = g.x;
            args[3u * j + 1u] = g.y;
            args[3u * j + 2u] = tile0[hi] - tile0[lo];
        }
    }
    workgroupBarrier();
    for (var e = li; e < p.n_exp; e += WGS) {
        var i = 0u;
        for (var q = 0u; q < p.n_pairs; q++) {
            if (sel[q] == e) {
                plan[p.order_at + start[e] + i] = q;
                i++;
            }
        }
        let tiles = (count[e] + TILE - 1u) / TILE;
        for (var t = 0u; t < tiles; t++) {
            let at = 1u + 3u * (tile0[e] + t);
            plan[at] = e;
            plan[at + 1u] = start[e] + t * TILE;
            plan[at + 2u] = min(TILE, count[e] - t * TILE);
        }
    }
}
