// Byte-addressed loads from the weight buffer `w` (binding 0, array<u32>, little-endian).
// ggml blocks are not 4-byte aligned (Q8_0 blocks are 34 bytes, IQ2_XXS 66), so every load takes a byte offset.
// Prepended to every kernel that reads quantized weights; the kernel declares `w` itself.

fn ld_u8(b: u32) -> u32 {
    return (w[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

// 16-bit load; `b` must be even (all ggml f16/u16 fields are).
fn ld_u16(b: u32) -> u32 {
    return (w[b >> 2u] >> ((b & 2u) * 8u)) & 0xffffu;
}

fn ld_f16(b: u32) -> f32 {
    return unpack2x16float(ld_u16(b)).x;
}

// 32-bit load at any byte offset.
fn ld_u32(b: u32) -> u32 {
    let s = (b & 3u) * 8u;
    let lo = w[b >> 2u];
    if (s == 0u) {
        return lo;
    }
    return (lo >> s) | (w[(b >> 2u) + 1u] << (32u - s));
}

// Signed byte k (0..3) of a word, as f32.
fn i8_of(v: u32, k: u32) -> f32 {
    return f32(extractBits(bitcast<i32>(v), k * 8u, 8u));
}
