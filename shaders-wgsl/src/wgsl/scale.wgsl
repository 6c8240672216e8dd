// Scaling in place (entry `main`, dispatch (ceil(n / 64), 1, 1)): x[i] *= factor for i < n.
struct Params {
    n: u32,
    _p0: u32,
    _p1: u32,
    factor: f32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.n) {
        x[gid.x] = x[gid.x] * p.factor;
    }
}
