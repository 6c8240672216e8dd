// Q8_0: 34-byte blocks of 32 values: f16 d, i8 q[32]; x = d * q.
const BLOCK_VALUES: u32 = 32u;
const BLOCK_BYTES: u32 = 34u;
// Invocations that share one weight row in a product (lanes.wgsl): fewer for bigger blocks, so a row's
// blocks keep every lane busy.
const ROW_LANES: u32 = 16u;

// Nothing to stage in workgroup memory (quant_iq2_xxs.wgsl stages its grid); called at every product kernel's
// start by every invocation.
fn quant_setup(li: u32) {}

fn block_value(b: u32, i: u32) -> f32 {
    let q = f32(extractBits(bitcast<i32>(ld_u8(b + 2u + i)), 0u, 8u));
    return ld_f16(b) * q;
}

fn block_dot(b: u32, x0: u32) -> f32 {
    var s = 0.0;
    for (var k = 0u; k < 8u; k++) {
        let v = ld_u32(b + 2u + 4u * k);
        let xi = x0 + 4u * k;
        s += i8_of(v, 0u) * x[xi] + i8_of(v, 1u) * x[xi + 1u] + i8_of(v, 2u) * x[xi + 2u] + i8_of(v, 3u) * x[xi + 3u];
    }
    return ld_f16(b) * s;
}
