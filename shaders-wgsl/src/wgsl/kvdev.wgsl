// Device-resident KV helpers.
// Entry `add_ape`: adds the compressor's absolute position embedding to projected gate rows in place:
//   g[off + r * w + c] += ape[((pos0 + r) % ratio) * w + c]   for r < rows, c < w,
// (row r holds the token at position pos0 + r). Dispatch (ceil(w / 64), rows, 1).
struct Params {
    rows: u32,
    w: u32,
    pos0: u32,
    ratio: u32,
    off: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> g: array<f32>;
@group(0) @binding(1) var<storage, read> ape: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn add_ape(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = gid.y;
    if (c >= p.w || r >= p.rows) {
        return;
    }
    g[p.off + r * p.w + c] += ape[((p.pos0 + r) % p.ratio) * p.w + c];
}
