// Q2_K: 84-byte blocks of 256 values: u8 scales[16] (low nibble scale, high nibble min), u8 qs[64], f16 d, f16 dmin.
// Value i = 128n + 32j + 16h + l (n < 2, j < 4, h < 2, l < 16): q = (qs[32n + 16h + l] >> 2j) & 3,
// sub-block 8n + 2j + h; x = d * (sc & 15) * q - dmin * (sc >> 4).
const BLOCK_VALUES: u32 = 256u;
const BLOCK_BYTES: u32 = 84u;
// Invocations that share one weight row in a product (lanes.wgsl): fewer for bigger blocks, so a row's
// blocks keep every lane busy.
const ROW_LANES: u32 = 8u;

// Nothing to stage in workgroup memory (quant_iq2_xxs.wgsl stages its grid); called at every product kernel's
// start by every invocation.
fn quant_setup(li: u32) {}

fn block_value(rb: u32, blk: u32, nb: u32, i: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    let n = i / 128u;
    let j = (i % 128u) / 32u;
    let h = (i % 32u) / 16u;
    let l = i % 16u;
    let sc = ld_u8(b + 8u * n + 2u * j + h);
    let q = (ld_u8(b + 16u + 32u * n + 16u * h + l) >> (2u * j)) & 3u;
    return ld_f16(b + 80u) * f32(sc & 15u) * f32(q) - ld_f16(b + 82u) * f32(sc >> 4u);
}

fn block_dot(rb: u32, blk: u32, nb: u32, x0: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    let d = ld_f16(b + 80u);
    let dmin = ld_f16(b + 82u);
    var s = 0.0;
    for (var n = 0u; n < 2u; n++) {
        for (var h = 0u; h < 2u; h++) {
            for (var j = 0u; j < 4u; j++) {
                let sc = ld_u8(b + 8u * n + 2u * j + h);
                let xb = x0 + 128u * n + 32u * j + 16u * h;
                var sq = 0.0;
                var sx = 0.0;
                for (var k = 0u; k < 4u; k++) {
                    let v = ld_u32(b + 16u + 32u * n + 16u * h + 4u * k) >> (2u * j);
                    for (var e = 0u; e < 4u; e++) {
                        let xv = x[xb + 4u * k + e];
                        sq += f32((v >> (8u * e)) & 3u) * xv;
                        sx += xv;
                    }
                }
                s += d * f32(sc & 15u) * sq - dmin * f32(sc >> 4u) * sx;
            }
        }
    }
    return s;
}
