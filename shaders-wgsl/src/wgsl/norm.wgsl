// RMSNorm over rows: y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * (has_weight ? g[:] : 1).
// Rows are `n` values; row r starts at x_offset + r * x_stride (same for y). Activation buffers are read_write so
// x and y may be the same buffer (in-place). One workgroup of 64 invocations per row; dispatch (rows, 1, 1)
// (rows above 65535 go to wg.y: row = wg.x + wg.y * grid_x).
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
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> g: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wg.x + wg.y * p.grid_x;
    if (r >= p.rows) {
        return;
    }
    let xb = p.x_offset + r * p.x_stride;
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
    let scale = inverseSqrt(partial[0] / f32(p.n) + p.eps);
    let yb = p.y_offset + r * p.y_stride;
    for (var i = li; i < p.n; i += 64u) {
        var v = x[xb + i] * scale;
        if (p.has_weight != 0u) {
            v *= g[i];
        }
        y[yb + i] = v;
    }
}
