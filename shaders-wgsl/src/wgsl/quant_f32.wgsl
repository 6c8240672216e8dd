// F32 weights: one value per "block".
const BLOCK_VALUES: u32 = 1u;
const BLOCK_BYTES: u32 = 4u;

fn block_value(b: u32, i: u32) -> f32 {
    return bitcast<f32>(ld_u32(b));
}

fn block_dot(b: u32, x0: u32) -> f32 {
    return bitcast<f32>(ld_u32(b)) * x[x0];
}
