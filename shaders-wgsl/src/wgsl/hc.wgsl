// Manifold-constrained hyper-connections (mHC) with N streams of width d; X[t] is N*d values (stream j at j*d).
//
// Entry `pre` (one workgroup of 64 per token, dispatch (n_tok, 1, 1)):
//   mix = raw mixes from a matmul of the flattened X[t] by fn (mix[t, k] at mix_offset + t * mix_stride + k),
//   r = rsqrt(mean(X[t]^2) + norm_eps) (the unweighted RMSNorm folded in: fn . (v r) = r (fn . v)).
//   head == 0 (sublayer): pre_j = sigmoid(r mix_j s0 + b_j) + hc_eps; post_j = 2 sigmoid(r mix_{N+j} s1 + b_{N+j});
//     comb[j][k] = softmax_k(r mix_{2N+jN+k} s2 + b_{2N+jN+k}) + hc_eps, then Sinkhorn: columns, then
//     (iters - 1) x (rows, columns), each dividing by (sum + hc_eps). state[t] = (post[N], comb[N*N]).
//   head != 0 (output head): pre_j = sigmoid(r mix_j s0 + b_j) + hc_eps only.
//   u[t, c] = sum_j pre_j X[t, j, c]   (u at u_offset + t * u_stride).
// Entry `post` (dispatch (ceil(d / 64), n_tok, 1)):
//   Xout[t, k, c] = post_k f[t, c] + sum_j comb[j][k] X[t, j, c]   (f at f_offset + t * f_stride).
// X and Xout must be different buffers for `post` (every output reads all streams).
// Entry `weights` (one invocation per token, dispatch (ceil(n_tok / 64), 1, 1)): the weights of `pre` with r = 1
//   (mixes of the already normed streams), pre_j written to u at u_offset + t * u_stride + j; state as in `pre`.
// Entry `collapse` (dispatch (ceil(d / 64), n_tok, 1)): u[t, c] = sum_j pre[t, j] X[t, j, c] with pre in binding 1
//   at mix_offset + t * mix_stride (the summation order of `pre`).
// Entry `weights_collapse` (one workgroup of 64 per token, dispatch (n_tok, 1, 1)): `weights` then `collapse` in one
//   dispatch: the weights of token t from its mixes (binding 1, mix_offset + t * mix_stride; state as in `weights`),
//   pre written to binding 7 (N per token), and u[t, c] = sum_j pre_j X[t, j, c] at u_offset + t * u_stride. The
//   same f32 operations as the two entries one after the other: their results bit for bit.
// Entry `weights_collapse_norm`: `weights_collapse`, then the RMSNorm of each token's u (d values, eps norm_eps,
//   times binding 8 when has_weight) into binding 9 (row t at t * d); as in `post_norm`, each invocation sums the
//   squares of its own outputs in the norm's order, so the three results are the three kernels', bit for bit.
// Entry `post_norm` (one workgroup of 64 per token, dispatch (n_tok, 1, 1); d a multiple of 64): `post` into u, then
//   the unweighted RMSNorm of each new row of N*d values (`norm.wgsl`, eps = norm_eps) into binding 7: each
//   invocation writes the outputs whose index is its own modulo 64, in ascending order, summing their squares as the
//   norm does, so both results are those of the two kernels in turn, bit for bit.
struct Params {
    n_tok: u32,
    d: u32,
    n: u32,
    iters: u32,
    head: u32,
    mix_offset: u32,
    mix_stride: u32,
    u_offset: u32,
    u_stride: u32,
    f_offset: u32,
    f_stride: u32,
    has_weight: u32,
    norm_eps: f32,
    hc_eps: f32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> xs: array<f32>;
@group(0) @binding(1) var<storage, read_write> mix: array<f32>;
@group(0) @binding(2) var<storage, read> base: array<f32>;
@group(0) @binding(3) var<storage, read> scale: array<f32>;
@group(0) @binding(4) var<storage, read_write> state: array<f32>;
@group(0) @binding(5) var<storage, read_write> u: array<f32>;
@group(0) @binding(6) var<uniform> p: Params;
// `weights_collapse`: pre (N per token); `post_norm`: the normed new streams.
@group(0) @binding(7) var<storage, read_write> aux: array<f32>;
@group(0) @binding(8) var<storage, read> g: array<f32>;
@group(0) @binding(9) var<storage, read_write> normed: array<f32>;

const MAX_N: u32 = 8u;
var<workgroup> red: array<f32, 64>;
var<workgroup> pre_w: array<f32, 8>;

// Sums red[0..64) into red[0] (a tree, the same for every kernel here); every invocation of the workgroup calls it.
fn reduce_red(li: u32) {
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

// The weights of token t from its mixes scaled by r: returns pre (N values) and, unless head, writes
// state[t] = (post, Sinkhorn comb).
fn weights_of(t: u32, r: f32) -> array<f32, 8> {
    let n = min(p.n, MAX_N);
    var w: array<f32, 8>;
    let mb = p.mix_offset + t * p.mix_stride;
    for (var j = 0u; j < n; j++) {
        w[j] = sigmoid(mix[mb + j] * r * scale[0] + base[j]) + p.hc_eps;
    }
    if (p.head == 0u) {
        let sb = t * (n + n * n);
        for (var j = 0u; j < n; j++) {
            state[sb + j] = 2.0 * sigmoid(mix[mb + n + j] * r * scale[1] + base[n + j]);
        }
        var c: array<f32, 64>;
        for (var j = 0u; j < n; j++) {
            var mx = -3.4e38;
            for (var k = 0u; k < n; k++) {
                let v = mix[mb + 2u * n + j * n + k] * r * scale[2] + base[2u * n + j * n + k];
                c[j * n + k] = v;
                mx = max(mx, v);
            }
            var sum = 0.0;
            for (var k = 0u; k < n; k++) {
                let e = exp(c[j * n + k] - mx);
                c[j * n + k] = e;
                sum += e;
            }
            for (var k = 0u; k < n; k++) {
                c[j * n + k] = c[j * n + k] / sum + p.hc_eps;
            }
        }
        for (var it = 0u; it < p.iters; it++) {
            if (it > 0u) {
                for (var j = 0u; j < n; j++) {
                    var sum = 0.0;
                    for (var k = 0u; k < n; k++) {
                        sum += c[j * n + k];
                    }
                    for (var k = 0u; k < n; k++) {
                        c[j * n + k] /= sum + p.hc_eps;
                    }
                }
            }
            for (var k = 0u; k < n; k++) {
                var sum = 0.0;
                for (var j = 0u; j < n; j++) {
                    sum += c[j * n + k];
                }
                for (var j = 0u; j < n; j++) {
                    c[j * n + k] /= sum + p.hc_eps;
                }
            }
        }
        for (var i = 0u; i < n * n; i++) {
            state[sb + n + i] = c[i];
        }
    }
    return w;
}

@compute @workgroup_size(64)
fn pre(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    let n = min(p.n, MAX_N);
    let w = n * p.d;
    let xb = t * w;
    var ss = 0.0;
    for (var i = li; i < w; i += 64u) {
        let v = xs[xb + i];
        ss += v * v;
    }
    red[li] = ss;
    reduce_red(li);
    if (li == 0u) {
        let r = inverseSqrt(red[0] / f32(w) + p.norm_eps);
        let pw = weights_of(t, r);
        for (var j = 0u; j < n; j++) {
            pre_w[j] = pw[j];
        }
    }
    workgroupBarrier();
    let ub = p.u_offset + t * p.u_stride;
    for (var c = li; c < p.d; c += 64u) {
        var acc = 0.0;
        for (var j = 0u; j < n; j++) {
            acc += pre_w[j] * xs[xb + j * p.d + c];
        }
        u[ub + c] = acc;
    }
}

// For `post`: binding 1 (`mix`) carries f, binding 5 (`u`) receives Xout.
@compute @workgroup_size(64)
fn post(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= p.d || t >= p.n_tok) {
        return;
    }
    let n = min(p.n, MAX_N);
    let xb = t * n * p.d;
    let sb = t * (n + n * n);
    let f = mix[p.f_offset + t * p.f_stride + c];
    for (var k = 0u; k < n; k++) {
        var acc = state[sb + k] * f;
        for (var j = 0u; j < n; j++) {
            acc += state[sb + n + j * n + k] * xs[xb + j * p.d + c];
        }
        u[xb + k * p.d + c] = acc;
    }
}

// For `weights`: the mixes come from the normed streams (r = 1); pre goes to `u` (N per token at u_offset +
// t * u_stride), post/comb to `state` unless head.
@compute @workgroup_size(64)
fn weights(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x;
    if (t >= p.n_tok) {
        return;
    }
    let pw = weights_of(t, 1.0);
    let ub = p.u_offset + t * p.u_stride;
    for (var j = 0u; j < min(p.n, MAX_N); j++) {
        u[ub + j] = pw[j];
    }
}

// For `collapse`: binding 1 (`mix`) carries pre (N per token at mix_offset + t * mix_stride).
@compute @workgroup_size(64)
fn collapse(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= p.d || t >= p.n_tok) {
        return;
    }
    let n = min(p.n, MAX_N);
    let xb = t * n * p.d;
    let mb = p.mix_offset + t * p.mix_stride;
    var acc = 0.0;
    for (var j = 0u; j < n; j++) {
        acc += mix[mb + j] * xs[xb + j * p.d + c];
    }
    u[p.u_offset + t * p.u_stride + c] = acc;
}

// `weights_collapse` for token t; returns the sum of the squares of the outputs this invocation wrote (in order).
fn collapse_token(t: u32, li: u32) -> f32 {
    let n = min(p.n, MAX_N);
    if (li == 0u) {
        let pw = weights_of(t, 1.0);
        for (var j = 0u; j < n; j++) {
            pre_w[j] = pw[j];
            aux[t * n + j] = pw[j];
        }
    }
    workgroupBarrier();
    let xb = t * n * p.d;
    let ub = p.u_offset + t * p.u_stride;
    var ss = 0.0;
    for (var c = li; c < p.d; c += 64u) {
        var acc = 0.0;
        for (var j = 0u; j < n; j++) {
            acc += pre_w[j] * xs[xb + j * p.d + c];
        }
        u[ub + c] = acc;
        ss += acc * acc;
    }
    return ss;
}

@compute @workgroup_size(64)
fn weights_collapse(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    if (t >= p.n_tok) {
        return;
    }
    collapse_token(t, li);
}

@compute @workgroup_size(64)
fn weights_collapse_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    if (t >= p.n_tok) {
        return;
    }
    red[li] = collapse_token(t, li);
    reduce_red(li);
    let scale = inverseSqrt(red[0] / f32(p.d) + p.norm_eps);
    let ub = p.u_offset + t * p.u_stride;
    for (var c = li; c < p.d; c += 64u) {
        var v = u[ub + c] * scale;
        if (p.has_weight != 0u) {
            v *= g[c];
        }
        normed[t * p.d + c] = v;
    }
}

@compute @workgroup_size(64)
fn post_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    if (t >= p.n_tok) {
        return;
    }
    let n = min(p.n, MAX_N);
    let xb = t * n * p.d;
    let sb = t * (n + n * n);
    var ss = 0.0;
    for (var k = 0u; k < n; k++) {
        for (var c = li; c < p.d; c += 64u) {
            let f = mix[p.f_offset + t * p.f_stride + c];
            var acc = state[sb + k] * f;
            for (var j = 0u; j < n; j++) {
                acc += state[sb + n + j * n + k] * xs[xb + j * p.d + c];
            }
            u[xb + k * p.d + c] = acc;
            ss += acc * acc;
        }
    }
    red[li] = ss;
    reduce_red(li);
    let w = n * p.d;
    let scale = inverseSqrt(red[0] / f32(w) + p.norm_eps);
    for (var i = li; i < w; i += 64u) {
        aux[xb + i] = u[xb + i] * scale;
    }
}
