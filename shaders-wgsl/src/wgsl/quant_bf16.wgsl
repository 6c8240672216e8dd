// BF16 weights: the high half of an f32.
const BLOCK_VALUES: u32 = 1u;
const BLOCK_BYTES: u32 = 2u;
// Invocations that share one weight row in a product (lanes.wgsl): fewer for bigger blocks, so a row's
// blocks keep every lane busy.
const ROW_LANES: u32 = 32u;

// Nothing to stage in workgroup memory (quant_iq2_xxs.wgsl stages its grid); called at every product kernel's
// start by every invocation.
fn quant_setup(li: u32) {}

fn block_value(rb: u32, blk: u32, nb: u32, i: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    return bitcast<f32>(ld_u16(b) << 16u);
}

fn block_dot(rb: u32, blk: u32, nb: u32, x0: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    return bitcast<f32>(ld_u16(b) << 16u) * x[x0];
}
