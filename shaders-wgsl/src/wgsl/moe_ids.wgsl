// Combines per-(row, slot) expert outputs in ascending expert order (ties: slot order), as the grouped MoE path
// adds them: out[r * n + c] = sum over the k slots j of row r, ordered by (sel[r * k + j], j), of
// eo[(r * k + j) * n + c], then (with `has_shared` set) the shared expert's output shared_out[r * n + c] added last.
// Dispatch (ceil(n / 64), rows, 1).
struct Params {
    n: u32,
    rows: u32,
    k: u32,
    has_shared: u32,
}

@group(0) @binding(0) var<storage, read> eo: array<f32>;
@group(0) @binding(1) var<storage, read> sel: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read> shared_out: array<f32>;

@compute @workgroup_size(64)
fn combine(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = gid.y;
    if (c >= p.n || r >= p.rows) {
        return;
    }
    var acc = 0.0;
    var last = 0u;
    for (var i = 0u; i < p.k; i++) {
        // The smallest key (expert * k + slot) above the previous one (keys are distinct).
        var best = 0xffffffffu;
        for (var j = 0u; j < p.k; j++) {
            let key = sel[r * p.k + j] * p.k + j;
            if ((i == 0u || key > last) && key < best) {
                best = key;
            }
        }
        last = best;
        acc += eo[(r * p.k + best % p.k) * p.n + c];
    }
    if (p.has_shared != 0u) {
        acc += shared_out[r * p.n + c];
    }
    out[r * p.n + c] = acc;
}
