// Q4_K: 144-byte blocks of 256 values: f16 d, f16 dmin, u8 scales[12] (eight 6-bit scale/min pairs), u8 qs[128].
// Value i = 64j + 32h + l: q = (qs[32j + l] >> 4h) & 15, sub-block 2j + h; x = d * sc * q - dmin * m.
const BLOCK_VALUES: u32 = 256u;
const BLOCK_BYTES: u32 = 144u;
// Invocations that share one weight row in a product (lanes.wgsl): fewer for bigger blocks, so a row's
// blocks keep every lane busy.
const ROW_LANES: u32 = 8u;

// Nothing to stage in workgroup memory (quant_iq2_xxs.wgsl stages its grid); called at every product kernel's
// start by every invocation.
fn quant_setup(li: u32) {}

// (scale, min) of sub-block `s` (0..7); the 12 scale bytes start at byte 4 of the block.
fn q4k_scale_min(b: u32, s: u32) -> vec2<u32> {
    let sb = b + 4u;
    if (s < 4u) {
        return vec2<u32>(ld_u8(sb + s) & 63u, ld_u8(sb + s + 4u) & 63u);
    }
    let sc = (ld_u8(sb + s + 4u) & 15u) | ((ld_u8(sb + s - 4u) >> 6u) << 4u);
    let m = (ld_u8(sb + s + 4u) >> 4u) | ((ld_u8(sb + s) >> 6u) << 4u);
    return vec2<u32>(sc, m);
}

fn block_value(rb: u32, blk: u32, nb: u32, i: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    let j = i / 64u;
    let h = (i % 64u) / 32u;
    let l = i % 32u;
    let sm = q4k_scale_min(b, 2u * j + h);
    let q = (ld_u8(b + 16u + 32u * j + l) >> (4u * h)) & 15u;
    return ld_f16(b) * f32(sm.x) * f32(q) - ld_f16(b + 2u) * f32(sm.y);
}

fn block_dot(rb: u32, blk: u32, nb: u32, x0: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    let d = ld_f16(b);
    let dmin = ld_f16(b + 2u);
    var s = 0.0;
    for (var j = 0u; j < 4u; j++) {
        for (var h = 0u; h < 2u; h++) {
            let sm = q4k_scale_min(b, 2u * j + h);
            let xb = x0 + 64u * j + 32u * h;
            var sq = 0.0;
            var sx = 0.0;
            for (var k = 0u; k < 8u; k++) {
                let v = ld_u32(b + 16u + 32u * j + 4u * k) >> (4u * h);
                for (var e = 0u; e < 4u; e++) {
                    let xv = x[xb + 4u * k + e];
                    sq += f32((v >> (8u * e)) & 15u) * xv;
                    sx += xv;
                }
            }
            s += d * f32(sm.x) * sq - dmin * f32(sm.y) * sx;
        }
    }
    return s;
}
