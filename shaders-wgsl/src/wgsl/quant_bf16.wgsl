// BF16 weights: the high half of an f32.
const BLOCK_VALUES: u32 = 1u;
const BLOCK_BYTES: u32 = 2u;

fn block_value(b: u32, i: u32) -> f32 {
    return bitcast<f32>(ld_u16(b) << 16u);
}

fn block_dot(b: u32, x0: u32) -> f32 {
    return bitcast<f32>(ld_u16(b) << 16u) * x[x0];
}
