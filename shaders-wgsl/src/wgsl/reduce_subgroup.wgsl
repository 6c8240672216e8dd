// Reduction prelude of lanes.wgsl with subgroups (needs the adapter's subgroup feature): the steps of the lane
// tree below SG are subgroup shuffles. The engine puts `const SG: u32 = <the adapter's smallest subgroup size>u;`
// in front of it.

fn lane_shuffle(v: f32, s: u32) -> f32 {
    return subgroupShuffleXor(v, s);
}
