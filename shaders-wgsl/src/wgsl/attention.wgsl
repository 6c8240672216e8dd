// Attention with a per-head sink over an explicit list of key rows (K = V, one KV head shared by all query heads).
// For query token t and head h: keys are rows kidx[kstart[t] .. kstart[t] + kcount[t]] of `kv` (row r at r * dim);
// s_j = q . k_j * scale; m = max(max_j s_j, sink[h]); p_j = exp(s_j - m) / (exp(sink[h] - m) + sum_j exp(s_j - m));
// out[t, h, :] = sum_j p_j k_j. q[t, h, :] at q_offset + t * q_tok_stride + h * dim; out likewise.
// Scores go to `scratch` (at least n_tok * heads * max_keys floats). One workgroup of 64 per (h, t);
// dispatch (heads, n_tok, 1).
// Entry `keyed` (device-resident KV): a key entry's top two bits name its source: 0 = row of `kv` (this batch's raw
// rows), 1 = row of `ring` (the session's window ring), 2 = row of `comp` (its compressed rows), 3 = selection
// `low` of token t: row sel[t * topk + low] of `comp`, skipped (weight exactly 0) when it is 0xffffffff. Results
// equal `main` over the same keys with the skipped ones left out. `comp` is the layer's page pool: compressed row w
// is pool row page_row(w) through the session's page table `ptab` (`pages.wgsl`). With rope_dim != 0 it also applies
// `rope.wgsl`'s inverse rotation to the last rope_dim values of each output head (token t's pairs at batch row
// rope_row0 + t of cs), each pair's two values accumulated in the same order as the others: the attention and the
// rope kernel in turn, bit for bit.
struct Params {
    n_tok: u32,
    heads: u32,
    dim: u32,
    max_keys: u32,
    q_offset: u32,
    q_tok_stride: u32,
    o_offset: u32,
    o_tok_stride: u32,
    scale: f32,
    topk: u32,
    page_shift: u32,
    rope_dim: u32,
    rope_row0: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> kv: array<f32>;
@group(0) @binding(2) var<storage, read> kidx: array<u32>;
@group(0) @binding(3) var<storage, read> krange: array<u32>;
@group(0) @binding(4) var<storage, read> sink: array<f32>;
@group(0) @binding(5) var<storage, read_write> scratch: array<f32>;
@group(0) @binding(6) var<storage, read_write> o: array<f32>;
@group(0) @binding(7) var<uniform> p: Params;
@group(0) @binding(8) var<storage, read> ring: array<f32>;
@group(0) @binding(9) var<storage, read> comp: array<f32>;
@group(0) @binding(10) var<storage, read> sel: array<u32>;
@group(0) @binding(11) var<storage, read> ptab: array<u32>;
@group(0) @binding(12) var<storage, read> cs: array<f32>;

var<workgroup> red: array<f32, 64>;

fn reduce_max(li: u32, v: f32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] = max(red[li], red[li + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(li: u32, v: f32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg.x;
    let t = wg.y;
    let k0 = krange[2u * t];
    let nk = min(krange[2u * t + 1u], p.max_keys);
    let qb = p.q_offset + t * p.q_tok_stride + h * p.dim;
    let sb = (t * p.heads + h) * p.max_keys;
    var m = sink[h];
    for (var j = li; j < nk; j += 64u) {
        let kb = kidx[k0 + j] * p.dim;
        var d = 0.0;
        for (var c = 0u; c < p.dim; c++) {
            d += q[qb + c] * kv[kb + c];
        }
        d *= p.scale;
        scratch[sb + j] = d;
        m = max(m, d);
    }
    m = reduce_max(li, m);
    var l = 0.0;
    for (var j = li; j < nk; j += 64u) {
        let e = exp(scratch[sb + j] - m);
        scratch[sb + j] = e;
        l += e;
    }
    storageBarrier();
    let denom = reduce_sum(li, l) + exp(sink[h] - m);
    let ob = p.o_offset + t * p.o_tok_stride + h * p.dim;
    for (var c = li; c < p.dim; c += 64u) {
        var acc = 0.0;
        for (var j = 0u; j < nk; j++) {
            acc += scratch[sb + j] * kv[kidx[k0 + j] * p.dim + c];
        }
        o[ob + c] = acc / denom;
    }
}

const SKIP: u32 = 4u;

// (source, row) of key entry e of token t (compressed rows: their pool row); source SKIP for an empty selection.
fn key_src(t: u32, e: u32) -> vec2<u32> {
    let tag = e >> 30u;
    let low = e & 0x3fffffffu;
    if (tag == 3u) {
        let w = sel[t * p.topk + low];
        if (w == 0xffffffffu) {
            return vec2<u32>(SKIP, 0u);
        }
        return vec2<u32>(2u, page_row(w));
    }
    if (tag == 2u) {
        return vec2<u32>(2u, page_row(low));
    }
    return vec2<u32>(tag, low);
}

fn key_val(s: vec2<u32>, c: u32) -> f32 {
    let i = s.y * p.dim + c;
    if (s.x == 0u) {
        return kv[i];
    }
    if (s.x == 1u) {
        return ring[i];
    }
    return comp[i];
}

@compute @workgroup_size(64)
fn keyed(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg.x;
    let t = wg.y;
    let k0 = krange[2u * t];
    let nk = min(krange[2u * t + 1u], p.max_keys);
    let qb = p.q_offset + t * p.q_tok_stride + h * p.dim;
    let sb = (t * p.heads + h) * p.max_keys;
    var m = sink[h];
    for (var j = li; j < nk; j += 64u) {
        let s = key_src(t, kidx[k0 + j]);
        if (s.x == SKIP) {
            continue;
        }
        var d = 0.0;
        for (var c = 0u; c < p.dim; c++) {
            d += q[qb + c] * key_val(s, c);
        }
        d *= p.scale;
        scratch[sb + j] = d;
        m = max(m, d);
    }
    m = reduce_max(li, m);
    var l = 0.0;
    for (var j = li; j < nk; j += 64u) {
        let s = key_src(t, kidx[k0 + j]);
        var e = 0.0;
        if (s.x != SKIP) {
            e = exp(scratch[sb + j] - m);
        }
        scratch[sb + j] = e;
        l += e;
    }
    storageBarrier();
    let denom = reduce_sum(li, l) + exp(sink[h] - m);
    let ob = p.o_offset + t * p.o_tok_stride + h * p.dim;
    let lead = p.dim - p.rope_dim;
    for (var c = li; c < lead; c += 64u) {
        var acc = 0.0;
        for (var j = 0u; j < nk; j++) {
            let s = key_src(t, kidx[k0 + j]);
            if (s.x != SKIP) {
                acc += scratch[sb + j] * key_val(s, c);
            }
        }
        o[ob + c] = acc / denom;
    }
    let half = p.rope_dim / 2u;
    let rt = p.rope_row0 + t;
    for (var k = li; k < half; k += 64u) {
        let c0 = lead + 2u * k;
        var a0 = 0.0;
        var a1 = 0.0;
        for (var j = 0u; j < nk; j++) {
            let s = key_src(t, kidx[k0 + j]);
            if (s.x != SKIP) {
                a0 += scratch[sb + j] * key_val(s, c0);
                a1 += scratch[sb + j] * key_val(s, c0 + 1u);
            }
        }
        let v0 = a0 / denom;
        let v1 = a1 / denom;
        let cr = cs[(rt * half + k) * 2u];
        let sr = -cs[(rt * half + k) * 2u + 1u];
        o[ob + c0] = v0 * cr - v1 * sr;
        o[ob + c0 + 1u] = v1 * cr + v0 * sr;
    }
}
