// Reduction prelude of lanes.wgsl without subgroups: every step of the lane tree goes through workgroup memory.
const SG: u32 = 1u;

fn lane_shuffle(v: f32, s: u32) -> f32 {
    return v;
}
