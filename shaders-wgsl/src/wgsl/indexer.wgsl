// Lightning-indexer scores and top-k selection.
//
// Entry `scores` (dispatch (ceil(n_keys / 64), n_tok, 1)): for token t and key row s < n_keys,
//   I(t, s) = sum_h (w[t, h] * w_scale) * relu(q[t, h, :] . k[s, :]) * scale   if s < limit[t], else -inf,
//   (w_scale: a scaling of the head weights done as they are read, bit for bit a `Scale` of them first; 1: none),
//   q[t, h, :] at (row0 + t) * heads * dim + h * dim, w[t, h] at (row0 + t) * heads + h (`row0`: the batch row of
//   token 0, so a run's rows are read in place), k[s, :] at page_row(s) * dim (`kr` is the
//   layer's page pool, `ptab` the session's page table: `pages.wgsl`),
//   out sc[t * n_keys + s].
// Entry `topk` (one workgroup of 64 per token, dispatch (n_tok, 1, 1)): picks kk = min(k, limit[t]) rows of
//   sc[t, 0 .. n_keys] with the largest scores among s < limit[t], ties broken towards the lowest index, and writes
//   them in ascending index order to sel[(row0 + t) * k ..], padding with 0xffffffff. A radix select over the scores'
//   order-preserving u32 keys finds the kk-th largest key T, then a stable compaction emits every key > T plus the
//   first (lowest-index) keys == T.
struct Params {
    n_tok: u32,
    n_keys: u32,
    heads: u32,
    dim: u32,
    k: u32,
    page_shift: u32,
    w_scale: f32,
    scale: f32,
    row0: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> kr: array<f32>;
@group(0) @binding(2) var<storage, read_write> wt: array<f32>;
@group(0) @binding(3) var<storage, read> limit: array<u32>;
@group(0) @binding(4) var<storage, read_write> sc: array<f32>;
@group(0) @binding(5) var<storage, read_write> sel: array<u32>;
@group(0) @binding(6) var<uniform> p: Params;
@group(0) @binding(7) var<storage, read> ptab: array<u32>;

const NEG_INF: f32 = -3.4028235e38;

@compute @workgroup_size(64)
fn scores(@builtin(global_invocation_id) gid: vec3<u32>) {
    let s = gid.x;
    let t = gid.y;
    if (s >= p.n_keys || t >= p.n_tok) {
        return;
    }
    var acc = NEG_INF;
    if (s < limit[t]) {
        acc = 0.0;
        let kb = page_row(s) * p.dim;
        for (var h = 0u; h < p.heads; h++) {
            let qb = ((p.row0 + t) * p.heads + h) * p.dim;
            var d = 0.0;
            for (var c = 0u; c < p.dim; c++) {
                d += q[qb + c] * kr[kb + c];
            }
            acc += (wt[(p.row0 + t) * p.heads + h] * p.w_scale) * max(d, 0.0) * p.scale;
        }
    }
    sc[t * p.n_keys + s] = acc;
}

// Order-preserving map f32 -> u32 (larger float, larger key).
fn okey(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

var<workgroup> hist: array<atomic<u32>, 16>;
var<workgroup> pick: array<u32, 3>;
var<workgroup> flags: array<u32, 64>;

@compute @workgroup_size(64)
fn topk(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    let n = min(limit[t], p.n_keys);
    let kk = min(p.k, n);
    let base = t * p.n_keys;
    let ob = (p.row0 + t) * p.k;
    for (var i = li; i < p.k; i += 64u) {
        sel[ob + i] = 0xffffffffu;
    }
    if (kk == 0u) {
        return;
    }
    // Radix select, 4 bits per pass from the top: prefix/mask describe the bits of T fixed so far;
    // `need` counts how many keys equal to the prefix (in the fixed bits) are still to be taken.
    if (li == 0u) {
        pick[0] = 0u;
        pick[1] = kk;
    }
    workgroupBarrier();
    for (var ps = 0u; ps < 8u; ps++) {
        let shift = 28u - 4u * ps;
        let mask = select(0xffffffffu << (shift + 4u), 0u, ps == 0u);
        if (li < 16u) {
            atomicStore(&hist[li], 0u);
        }
        workgroupBarrier();
        let prefix = pick[0];
        for (var s = li; s < n; s += 64u) {
            let key = okey(sc[base + s]);
            if ((key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & 15u], 1u);
            }
        }
        workgroupBarrier();
        if (li == 0u) {
            var need = pick[1];
            var b = 15u;
            loop {
                let c = atomicLoad(&hist[b]);
                if (c >= need || b == 0u) {
                    break;
                }
                need -= c;
                b -= 1u;
            }
            pick[0] = prefix | (b << shift);
            pick[1] = need;
        }
        workgroupBarrier();
    }
    let tkey = pick[0];
    // Stable compaction in chunks of 64: keys > T always, keys == T while `eq_left` lasts.
    if (li == 0u) {
        pick[2] = 0u;
    }
    workgroupBarrier();
    var eq_left = pick[1];
    let nchunks = (n + 63u) / 64u;
    for (var ch = 0u; ch < nchunks; ch++) {
        let s = ch * 64u + li;
        var f = 0u;
        if (s < n) {
            let key = okey(sc[base + s]);
            f = select(select(0u, 2u, key == tkey), 1u, key > tkey);
        }
        flags[li] = f;
        workgroupBarrier();
        if (li == 0u) {
            var w = pick[2];
            for (var i = 0u; i < 64u; i++) {
                let fi = flags[i];
                if (fi == 1u || (fi == 2u && eq_left > 0u)) {
                    if (fi == 2u) {
                        eq_left -= 1u;
                    }
                    if (w < kk) {
                        sel[ob + w] = ch * 64u + i;
                    }
                    w += 1u;
                }
            }
            pick[2] = w;
        }
        workgroupBarrier();
    }
}
