// F16 weights: one value per "block".
const BLOCK_VALUES: u32 = 1u;
const BLOCK_BYTES: u32 = 2u;

fn block_value(b: u32, i: u32) -> f32 {
    return ld_f16(b);
}

fn block_dot(b: u32, x0: u32) -> f32 {
    return ld_f16(b) * x[x0];
}
