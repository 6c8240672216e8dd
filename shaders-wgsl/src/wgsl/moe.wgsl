// Mixture-of-experts routing and expert plumbing.
//
// Entry `route` (one invocation per token, dispatch (ceil(n_tok / 64), 1, 1)):
//   s_e = sqrt(softplus(logit[t, e])) for e < n_exp (logits at t * n_exp + e).
//   hash != 0: selection = tid2eid[tok[t] * k + i]; else the k largest s_e + bias[e] (ties: lowest index).
//   w_i = s_sel_i / (sum_i s_sel_i + 1e-20) * route_scale (without the division when renorm == 0). Writes sel[t * k + i] (u32) and rw[t * k + i].
// Entry `swiglu` (dispatch (ceil(n / 64), rows, 1)): h[r, c] = silu(min(g, L)) * clamp(u, -L, L) * (use_w ? rw[wi[r]] : 1)
//   with g = gu[r * gu_stride + c], u = gu[r * gu_stride + up_offset + c], h at h_offset + r * h_stride + c.
// Entry `swiglu_shared` (dispatch (ceil(n / 64), rows + rows2, 1)): `swiglu` for rows < rows, and for the next
//   rows2 rows the shared expert's, in place in binding 7 (gate half of each gu_stride row, no routing weight): the
//   routed and the shared expert's SwiGLU in one dispatch, each value as `swiglu` computes it.
// Entry `gather` (dispatch (ceil(n / 64), rows, 1)): dst[r * n + c] = src[rows_idx[r] * src_stride + c].
//   A destination row must appear at most once per dispatch (true for one expert's token list).
struct Params {
    n_tok: u32,
    n_exp: u32,
    k: u32,
    hash: u32,
    n: u32,
    rows: u32,
    gu_stride: u32,
    up_offset: u32,
    h_offset: u32,
    h_stride: u32,
    use_w: u32,
    stride: u32,
    route_scale: f32,
    limit: f32,
    renorm: u32,
    rows2: u32,
}

@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> b: array<f32>;
@group(0) @binding(2) var<storage, read> ia: array<u32>;
@group(0) @binding(3) var<storage, read> ib: array<u32>;
@group(0) @binding(4) var<storage, read_write> sel: array<u32>;
@group(0) @binding(5) var<storage, read_write> rw: array<f32>;
@group(0) @binding(6) var<uniform> p: Params;
@group(0) @binding(7) var<storage, read_write> sh: array<f32>;

fn sqrt_softplus(v: f32) -> f32 {
    // softplus(v) = log(1 + e^v), computed without overflow.
    let sp = max(v, 0.0) + log(1.0 + exp(-abs(v)));
    return sqrt(sp);
}

// a = logits [n_tok, n_exp], b = bias [n_exp] (learned), ia = token ids, ib = tid2eid [vocab, k].
@compute @workgroup_size(64)
fn route(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x;
    if (t >= p.n_tok) {
        return;
    }
    let lb = t * p.n_exp;
    let ob = t * p.k;
    var total = 0.0;
    for (var i = 0u; i < p.k; i++) {
        var e = 0u;
        if (p.hash != 0u) {
            e = ib[ia[t] * p.k + i];
        } else {
            var best = -3.4e38;
            var be = 0xffffffffu;
            for (var c = 0u; c < p.n_exp; c++) {
                var taken = false;
                for (var j = 0u; j < i; j++) {
                    if (sel[ob + j] == c) {
                        taken = true;
                    }
                }
                let v = sqrt_softplus(a[lb + c]) + b[c];
                if (!taken && (be == 0xffffffffu || v > best)) {
                    best = v;
                    be = c;
                }
            }
            e = be;
        }
        sel[ob + i] = e;
        let s = sqrt_softplus(a[lb + min(e, p.n_exp - 1u)]);
        rw[ob + i] = s;
        total += s;
    }
    for (var i = 0u; i < p.k; i++) {
        var v = rw[ob + i];
        if (p.renorm != 0u) {
            v = v / (total + 1e-20);
        }
        rw[ob + i] = v * p.route_scale;
    }
}

// a = gate|up rows, b = h, ia = per-row index into rw (when use_w).
@compute @workgroup_size(64)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = gid.y;
    if (c >= p.n || r >= p.rows) {
        return;
    }
    let g = min(a[r * p.gu_stride + c], p.limit);
    let u = clamp(a[r * p.gu_stride + p.up_offset + c], -p.limit, p.limit);
    var h = g / (1.0 + exp(-g)) * u;
    if (p.use_w != 0u) {
        h *= rw[ia[r]];
    }
    b[p.h_offset + r * p.h_stride + c] = h;
}

fn silu_glu(g0: f32, u0: f32) -> f32 {
    let g = min(g0, p.limit);
    let u = clamp(u0, -p.limit, p.limit);
    return g / (1.0 + exp(-g)) * u;
}

@compute @workgroup_size(64)
fn swiglu_shared(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = gid.y;
    if (c >= p.n) {
        return;
    }
    if (r < p.rows) {
        var h = silu_glu(a[r * p.gu_stride + c], a[r * p.gu_stride + p.up_offset + c]);
        if (p.use_w != 0u) {
            h *= rw[ia[r]];
        }
        b[p.h_offset + r * p.h_stride + c] = h;
    } else if (r < p.rows + p.rows2) {
        let s = r - p.rows;
        sh[s * p.gu_stride + c] = silu_glu(sh[s * p.gu_stride + c], sh[s * p.gu_stride + p.up_offset + c]);
    }
}

// a = src (stride `stride`), b = dst (packed rows of n), ia = source rows.
@compute @workgroup_size(64)
fn gather(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = gid.y;
    if (c >= p.n || r >= p.rows) {
        return;
    }
    b[r * p.n + c] = a[ia[r] * p.stride + c];
}
