// The entry of `PairKernel::NORM_ROPE` (appended after `norm.wgsl` and its renamed copy): workgroup (x, y, 0) is
// workgroup (x, y) of the first `norm_rope`, (x, y, 1) of the second. Dispatch (max x, max y, 2); each half keeps
// its own rows (row = x + y * grid_x < rows).
@compute @workgroup_size(64)
fn norm_rope_pair(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if (wg.z == 0u) {
        let r = wg.x + wg.y * p.grid_x;
        if (r < p.rows) {
            norm_rope_row(r, li);
        }
    } else {
        let r = wg.x + wg.y * p_b.grid_x;
        if (r < p_b.rows) {
            norm_rope_row_b(r, li);
        }
    }
}
