// Q8_0: 34-byte blocks of 32 values: f16 d, i8 q[32]; x = d * q.
// On the device a row is repacked at upload (the engine's `weights::repack_rows`): the nb blocks' quants first
// (32 bytes each, block j at 32·j), then their scales (f16, block j's at 32·nb + 2·j), the same 34·nb bytes. So a
// block's quants are whole aligned words wherever the row starts on a word (nb even), read with one load each
// instead of two and a shift, and its scale one aligned 16-bit field.
const BLOCK_VALUES: u32 = 32u;
const BLOCK_BYTES: u32 = 34u;
// Invocations that share one weight row in a product (lanes.wgsl): fewer for bigger blocks, so a row's
// blocks keep every lane busy.
const ROW_LANES: u32 = 16u;

// Nothing to stage in workgroup memory (quant_iq2_xxs.wgsl stages its grid); called at every product kernel's
// start by every invocation.
fn quant_setup(li: u32) {}

fn q8_scale(rb: u32, blk: u32, nb: u32) -> f32 {
    return ld_f16(rb + 32u * nb + 2u * blk);
}

fn block_value(rb: u32, blk: u32, nb: u32, i: u32) -> f32 {
    let q = f32(extractBits(bitcast<i32>(ld_u8(rb + 32u * blk + i)), 0u, 8u));
    return q8_scale(rb, blk, nb) * q;
}

// Quant word k (bytes 4k .. 4k + 3) of the block whose quants start at byte q.
fn q8_word(q: u32, k: u32) -> u32 {
    if ((q & 3u) == 0u) {
        return w[(q >> 2u) + k];
    }
    return ld_u32(q + 4u * k);
}

fn block_dot(rb: u32, blk: u32, nb: u32, x0: u32) -> f32 {
    let q = rb + 32u * blk;
    var s = 0.0;
    for (var k = 0u; k < 8u; k++) {
        let v = q8_word(q, k);
        let xi = x0 + 4u * k;
        s += i8_of(v, 0u) * x[xi] + i8_of(v, 1u) * x[xi + 1u] + i8_of(v, 2u) * x[xi + 2u] + i8_of(v, 3u) * x[xi + 3u];
    }
    return q8_scale(rb, blk, nb) * s;
}
