// Activation simulation (the FP8/FP4 round trips the official inference code applies; off for golden checks).
//
// Entry `fp8` (one invocation per block, dispatch (ceil(blocks_per_row / 64), rows, 1)): in row r (at r * stride),
//   values [0, n) are split in blocks of `block` (64); each is scaled by s = 2^ceil(log2(amax / 448)), rounded to the
//   nearest FP8 e4m3 value (ties to even, saturating at 448), and scaled back. Values at n.. (the rope dims) are
//   untouched.
// Entry `fp4`: the same with FP4 e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6; max 6), blocks of `block` (32).
// Entry `hadamard` (one workgroup of 64 per row, dispatch (rows, 1, 1)): x[r, 0..n) = H x / sqrt(n), H the
//   Sylvester-Hadamard matrix (n a power of two <= 1024), computed as an in-place fast Walsh-Hadamard transform.
// Entry `rope_hadamard_fp4` (one workgroup of 64 per row, dispatch (rows, 1, 1)): the forward RoPE of `rope.wgsl` on
//   the last rope_dim values of row r (head r % heads of token t = r / heads; pairs from cs), then `hadamard`, then
//   `fp4` in blocks of `block`, with the same f32 operations as the three kernels in turn (the indexer queries).
// (round_even and round_mini come from round.wgsl, composed before this file.)
struct Params {
    rows: u32,
    n: u32,
    stride: u32,
    block: u32,
    heads: u32,
    rope_dim: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> cs: array<f32>;

fn block_round(gid: vec3<u32>, mbits: f32, emin: f32, mx: f32) {
    let r = gid.y;
    let b0 = gid.x * p.block;
    if (r >= p.rows || b0 >= p.n) {
        return;
    }
    let base = r * p.stride;
    let end = min(b0 + p.block, p.n);
    var amax = 0.0;
    for (var i = b0; i < end; i++) {
        amax = max(amax, abs(x[base + i]));
    }
    if (amax == 0.0) {
        return;
    }
    let s = exp2(ceil(log2(amax / mx)));
    for (var i = b0; i < end; i++) {
        x[base + i] = round_mini(x[base + i] / s, mbits, emin, mx) * s;
    }
}

@compute @workgroup_size(64)
fn fp8(@builtin(global_invocation_id) gid: vec3<u32>) {
    block_round(gid, 3.0, -6.0, 448.0);
}

@compute @workgroup_size(64)
fn fp4(@builtin(global_invocation_id) gid: vec3<u32>) {
    block_round(gid, 1.0, 0.0, 6.0);
}

var<workgroup> buf: array<f32, 1024>;

// The in-place fast Walsh-Hadamard transform of buf[0..n) by the 64 invocations of a workgroup (no 1/sqrt(n)).
fn fwht(li: u32, n: u32) {
    for (var h = 1u; h < n; h <<= 1u) {
        for (var i = li; i < n / 2u; i += 64u) {
            let j = (i / h) * 2u * h + (i % h);
            let a = buf[j];
            let b = buf[j + h];
            buf[j] = a + b;
            buf[j + h] = a - b;
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn hadamard(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wg.x;
    let n = min(p.n, 1024u);
    let base = r * p.stride;
    for (var i = li; i < n; i += 64u) {
        buf[i] = x[base + i];
    }
    workgroupBarrier();
    fwht(li, n);
    let norm = inverseSqrt(f32(n));
    for (var i = li; i < n; i += 64u) {
        x[base + i] = buf[i] * norm;
    }
}

@compute @workgroup_size(64)
fn rope_hadamard_fp4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wg.x;
    let n = min(p.n, 1024u);
    let base = r * p.stride;
    for (var i = li; i < n; i += 64u) {
        buf[i] = x[base + i];
    }
    workgroupBarrier();
    let half = p.rope_dim / 2u;
    let t = r / p.heads;
    for (var k = li; k < half; k += 64u) {
        let i = n - p.rope_dim + 2u * k;
        let c = cs[(t * half + k) * 2u];
        let s = cs[(t * half + k) * 2u + 1u];
        let a0 = buf[i];
        let a1 = buf[i + 1u];
        buf[i] = a0 * c - a1 * s;
        buf[i + 1u] = a1 * c + a0 * s;
    }
    workgroupBarrier();
    fwht(li, n);
    let norm = inverseSqrt(f32(n));
    for (var i = li; i < n; i += 64u) {
        buf[i] = buf[i] * norm;
    }
    workgroupBarrier();
    let nb = (n + p.block - 1u) / p.block;
    for (var b = li; b < nb; b += 64u) {
        let b0 = b * p.block;
        let end = min(b0 + p.block, n);
        var amax = 0.0;
        for (var i = b0; i < end; i++) {
            amax = max(amax, abs(buf[i]));
        }
        if (amax == 0.0) {
            for (var i = b0; i < end; i++) {
                x[base + i] = buf[i];
            }
        } else {
            let sc = exp2(ceil(log2(amax / 6.0)));
            for (var i = b0; i < end; i++) {
                x[base + i] = round_mini(buf[i] / sc, 1.0, 0.0, 6.0) * sc;
            }
        }
    }
}
