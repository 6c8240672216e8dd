// The entry of `PairKernel::FRONT_PUSH` (appended after `kvdev.wgsl` and its renamed copy): invocation (c, r, 0)
// is value c of row r of the first `front_push`, (c, r, 1) of the second. Dispatch (max ceil(w / 64), max rows, 2).
@compute @workgroup_size(64)
fn front_push_pair(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.z == 0u) {
        front_push_at(gid.x, gid.y);
    } else {
        front_push_at_b(gid.x, gid.y);
    }
}
