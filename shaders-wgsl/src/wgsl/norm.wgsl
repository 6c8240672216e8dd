// RMSNorm over rows: y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * (has_weight ? g[:] : 1).
// Rows are `n` values; row r starts at x_offset + r * x_stride (same for y). Activation buffers are read_write so
// x and y may be the same buffer (in-place). One workgroup of 64 invocations per row; dispatch (rows, 1, 1)
// (rows above 65535 go to wg.y: row = wg.x + wg.y * grid_x).
// Entry `norm_rope`: the same norm, then the interleaved RoPE of `rope.wgsl` (forward) on the last `rope_dim`
// values of each row, in one dispatch: row r is head r % heads of token t = r / heads, whose (cos, sin) pairs are
// cs[(t * rope_dim / 2 + i) * 2 + {0, 1}]. Each rope pair is normed and rotated by one invocation with the same
// f32 operations as the two kernels one after the other, so the result is theirs bit for bit. With fp8_block != 0
// the values before the rope slice then get `act.wgsl`'s FP8 simulation (blocks of fp8_block, one invocation per
// block, after a storage barrier), as its `fp8` entry computes it.
// `PairKernel::NORM_ROPE` runs two independent `norm_rope`s in one dispatch (the region between the @rows markers
// copied, renamed, at bindings 5..9).
struct Params {
    n: u32,
    rows: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    has_weight: u32,
    grid_x: u32,
    eps: f32,
    heads: u32,
    rope_dim: u32,
    fp8_block: u32,
}

var<workgroup> partial: array<f32, 64>;

// @rows-begin
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> g: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> cs: array<f32>;

// The rsqrt scale of row r (every invocation of the workgroup gets it).
fn row_scale(xb: u32, li: u32) -> f32 {
    var ss = 0.0;
    for (var i = li; i < p.n; i += 64u) {
        let v = x[xb + i];
        ss += v * v;
    }
    partial[li] = ss;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (li < s) {
            partial[li] += partial[li + s];
        }
        workgroupBarrier();
    }
    return inverseSqrt(partial[0] / f32(p.n) + p.eps);
}

fn normed(xb: u32, i: u32, scale: f32) -> f32 {
    var v = x[xb + i] * scale;
    if (p.has_weight != 0u) {
        v *= g[i];
    }
    return v;
}

// Row r of the plain norm.
fn norm_row(r: u32, li: u32) {
    let xb = p.x_offset + r * p.x_stride;
    let scale = row_scale(xb, li);
    let yb = p.y_offset + r * p.y_stride;
    for (var i = li; i < p.n; i += 64u) {
        y[yb + i] = normed(xb, i, scale);
    }
}

// Row r of `norm_rope`.
fn norm_rope_row(r: u32, li: u32) {
    let xb = p.x_offset + r * p.x_stride;
    let scale = row_scale(xb, li);
    let yb = p.y_offset + r * p.y_stride;
    let lead = p.n - p.rope_dim;
    for (var i = li; i < lead; i += 64u) {
        y[yb + i] = normed(xb, i, scale);
    }
    let half = p.rope_dim / 2u;
    let t = r / p.heads;
    for (var k = li; k < half; k += 64u) {
        let i = lead + 2u * k;
        let a0 = normed(xb, i, scale);
        let a1 = normed(xb, i + 1u, scale);
        let c = cs[(t * half + k) * 2u];
        let s = cs[(t * half + k) * 2u + 1u];
        y[yb + i] = a0 * c - a1 * s;
        y[yb + i + 1u] = a1 * c + a0 * s;
    }
    if (p.fp8_block != 0u) {
        storageBarrier();
        let nb = (lead + p.fp8_block - 1u) / p.fp8_block;
        for (var b = li; b < nb; b += 64u) {
            let b0 = b * p.fp8_block;
            let end = min(b0 + p.fp8_block, lead);
            var amax = 0.0;
            for (var i = b0; i < end; i++) {
                amax = max(amax, abs(y[yb + i]));
            }
            if (amax != 0.0) {
                let sc = exp2(ceil(log2(amax / 448.0)));
                for (var i = b0; i < end; i++) {
                    y[yb + i] = round_mini(y[yb + i] / sc, 3.0, -6.0, 448.0) * sc;
                }
            }
        }
    }
}
// @rows-end

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wg.x + wg.y * p.grid_x;
    if (r < p.rows) {
        norm_row(r, li);
    }
}

@compute @workgroup_size(64)
fn norm_rope(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wg.x + wg.y * p.grid_x;
    if (r < p.rows) {
        norm_rope_row(r, li);
    }
}
