// Word copies and zero fills as kernels, so they stay inside the tick's compute pass (a copy command would end it).
// Entry `main`: dst[p.dst_off + i] = src[p.src_off + i] for i < p.n (u32 words: bits copied exactly).
// Entry `zero`: dst[p.dst_off + i] = 0 for i < p.n.
// Bindings: 0 src (read), 1 dst (read_write), 2 `Params`. Dispatch (ceil(n / 64), 1, 1).
struct Params {
    n: u32,
    src_off: u32,
    dst_off: u32,
    _p: u32,
}

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.n) {
        dst[p.dst_off + gid.x] = src[p.src_off + gid.x];
    }
}

@compute @workgroup_size(64)
fn zero(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.n) {
        dst[p.dst_off + gid.x] = 0u;
    }
}
