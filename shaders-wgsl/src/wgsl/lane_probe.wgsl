// The product kernels' subgroup assumption, checked once when a device opens with subgroups (the engine prepends
// `const SG: u32 = <the adapter's smallest subgroup size>u;`): invocation li writes 1 when subgroupShuffleXor(li, s)
// returns li ^ s for every power of two s < SG — the subgroup holds consecutive local invocation indices, as
// lanes.wgsl assumes and no API promises — else 0. Dispatch (1, 1, 1).

@group(0) @binding(0) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32) {
    var ok = 1u;
    for (var s = 1u; s < SG; s <<= 1u) {
        if (subgroupShuffleXor(li, s) != (li ^ s)) {
            ok = 0u;
        }
    }
    out[li] = ok;
}
