// Device-resident KV helpers.
// Entry `add_ape`: adds the compressor's absolute position embedding to projected gate rows in place:
//   g[off + r * w + c] += ape[((pos0 + r) % ratio) * w + c]   for r < rows, c < w,
// (row r holds the token at position pos0 + r). Dispatch (ceil(w / 64), rows, 1).
// Entry `front_push`: a compressor push that completes no block (rows <= ratio): the run's projected rows go to the
// frontier's pending slots, the gate with the position embedding added (what `add_ape` on a copy of the rows and a
// row copy give, bit for bit): for r < rows, c < w, with slot = (pos0 + r) % ratio and s = off + r * w + c,
//   fkv[(ratio + slot) * w + c] = kv[s];  fgate[(ratio + slot) * w + c] = gate[s] + ape[slot * w + c].
// Dispatch (ceil(w / 64), rows, 1). `PairKernel::FRONT_PUSH` runs two pushes in one dispatch (the region between
// the @rows markers copied, renamed, at bindings 7..12).
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

// @rows-begin
@group(0) @binding(1) var<storage, read> ape: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read> kv: array<f32>;
@group(0) @binding(4) var<storage, read> gate: array<f32>;
@group(0) @binding(5) var<storage, read_write> fkv: array<f32>;
@group(0) @binding(6) var<storage, read_write> fgate: array<f32>;

// Value c of run row r of `front_push`.
fn front_push_at(c: u32, r: u32) {
    if (c >= p.w || r >= p.rows) {
        return;
    }
    let slot = (p.pos0 + r) % p.ratio;
    let s = p.off + r * p.w + c;
    let d = (p.ratio + slot) * p.w + c;
    fkv[d] = kv[s];
    fgate[d] = gate[s] + ape[slot * p.w + c];
}
// @rows-end

@compute @workgroup_size(64)
fn add_ape(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = gid.y;
    if (c >= p.w || r >= p.rows) {
        return;
    }
    g[p.off + r * p.w + c] += ape[((p.pos0 + r) % p.ratio) * p.w + c];
}

@compute @workgroup_size(64)
fn front_push(@builtin(global_invocation_id) gid: vec3<u32>) {
    front_push_at(gid.x, gid.y);
}
