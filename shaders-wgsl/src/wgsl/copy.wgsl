// Word copies and zero fills as kernels, so they stay inside the tick's compute pass (a copy command would end it).
// Up to four copies in one dispatch: segment i (`p.s<i>` = (n, src_off, dst_off, 0), in u32 words) copies
//   dst<i>[dst_off + j] = src<i>[src_off + j]   for j < n   (bits copied exactly).
// Entry `copy<m>` runs segments 0 .. m - 1 (m = 1 .. 4), dispatch (ceil(max n / 64), 1, 1). The host batches only
// segments that are independent: no segment writes what another in the batch reads or writes.
// Entry `zero`: dst0[s0.z + j] = 0 for j < s0.x.
// Bindings: 0 `Params`, then 1 + 2i src<i> (read), 2 + 2i dst<i> (read_write).
struct Params {
    s0: vec4<u32>,
    s1: vec4<u32>,
    s2: vec4<u32>,
    s3: vec4<u32>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src0: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst0: array<u32>;
@group(0) @binding(3) var<storage, read> src1: array<u32>;
@group(0) @binding(4) var<storage, read_write> dst1: array<u32>;
@group(0) @binding(5) var<storage, read> src2: array<u32>;
@group(0) @binding(6) var<storage, read_write> dst2: array<u32>;
@group(0) @binding(7) var<storage, read> src3: array<u32>;
@group(0) @binding(8) var<storage, read_write> dst3: array<u32>;

fn seg0(j: u32) {
    if (j < p.s0.x) {
        dst0[p.s0.z + j] = src0[p.s0.y + j];
    }
}

fn seg1(j: u32) {
    if (j < p.s1.x) {
        dst1[p.s1.z + j] = src1[p.s1.y + j];
    }
}

fn seg2(j: u32) {
    if (j < p.s2.x) {
        dst2[p.s2.z + j] = src2[p.s2.y + j];
    }
}

fn seg3(j: u32) {
    if (j < p.s3.x) {
        dst3[p.s3.z + j] = src3[p.s3.y + j];
    }
}

@compute @workgroup_size(64)
fn copy1(@builtin(global_invocation_id) gid: vec3<u32>) {
    seg0(gid.x);
}

@compute @workgroup_size(64)
fn copy2(@builtin(global_invocation_id) gid: vec3<u32>) {
    seg0(gid.x);
    seg1(gid.x);
}

@compute @workgroup_size(64)
fn copy3(@builtin(global_invocation_id) gid: vec3<u32>) {
    seg0(gid.x);
    seg1(gid.x);
    seg2(gid.x);
}

@compute @workgroup_size(64)
fn copy4(@builtin(global_invocation_id) gid: vec3<u32>) {
    seg0(gid.x);
    seg1(gid.x);
    seg2(gid.x);
    seg3(gid.x);
}

@compute @workgroup_size(64)
fn zero(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < p.s0.x) {
        dst0[p.s0.z + gid.x] = 0u;
    }
}
