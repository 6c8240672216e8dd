//! The float formats: F32, F16 and BF16 (one value per "block"), scalar reference code.
//!
//! Layout: F32 is 4 bytes little-endian IEEE binary32 per value; F16 is 2 bytes little-endian IEEE binary16; BF16 is
//! the top 16 bits of a binary32, 2 bytes little-endian.
//!
//! Conversions follow ggml / the `gguf` Python package bit for bit: F16 rounds to nearest even (the `half` crate),
//! BF16 rounds to nearest even and turns NaN into a quiet NaN (`ggml_compute_fp32_to_bf16`).
//!
//! Functions here never panic: they process as many whole values as both buffers hold (the public API in
//! [`super`] checks the lengths first).

use half::f16;

/// Decodes a little-endian f16 from two bytes.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Encodes `v` as f16 (round to nearest even), little-endian.
#[inline(always)]
pub(crate) fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// BF16 bits to f32 (exact).
#[inline(always)]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to BF16 bits: round to nearest even, NaN becomes a quiet NaN with the same sign.
#[inline(always)]
pub(crate) fn f32_to_bf16(v: f32) -> u16 {
    let n = v.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n >> 16) | 64) as u16;
    }
    ((n as u64 + (0x7fff + ((n >> 16) & 1)) as u64) >> 16) as u16
}

pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (c, d) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (c, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
    }
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (c, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (v, c) in src.iter().zip(dst.chunks_exact_mut(4)) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (v, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&f16_bytes(*v));
    }
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (v, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
    }
}

/// Sums `f(i) * x[i]` with four partial sums (the scalar fallback; also better rounding than one running sum).
#[inline(always)]
fn dot_with(n: usize, x: &[f32], f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; 4];
    let n4 = n / 4 * 4;
    for i in (0..n4).step_by(4) {
        for k in 0..4 {
            acc[k] += f(i + k) * x[i + k];
        }
    }
    let mut tail = 0f32;
    for i in n4..n {
        tail += f(i) * x[i];
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// F32 row · x over `min(w.len() / 4, x.len())` values.
pub(crate) fn dot_f32_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 4).min(x.len());
    dot_with(n, x, |i| f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]))
}

/// F16 row · x over `min(w.len() / 2, x.len())` values.
pub(crate) fn dot_f16_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    dot_with(n, x, |i| f16_at(w, 2 * i))
}

/// BF16 row · x over `min(w.len() / 2, x.len())` values.
pub(crate) fn dot_bf16_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    dot_with(n, x, |i| bf16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan() {
        // 1.0 + 2^-8 is exactly halfway between two bf16 values: ties go to the even one (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1.0 + 3 * 2^-8 is halfway too, and rounds up to the even mantissa 0x3f82.
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_to_f32(0xc000), -2.0);
    }

    #[test]
    fn f16_round_trip_of_representable_values() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 65504.0, 6.1035156e-5, 5.9604645e-8] {
            let b = f16_bytes(v);
            assert_eq!(f16_at(&b, 0).to_bits(), v.to_bits());
        }
    }

    #[test]
    fn dots_ignore_trailing_partial_values() {
        let w: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(dot_f32_f32(&w, &[1.0, 1.0, 1.0, 100.0]), 6.0);
        assert_eq!(dot_f32_f32(&w[..7], &[1.0, 1.0, 1.0]), 1.0);
    }
}
