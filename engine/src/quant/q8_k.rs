//! Q8_K: the activation format for the k-quants and IQ2_XXS (256 values per 292-byte block), scalar code.
//!
//! Block layout (little-endian): `f32 d` (bytes 0..4), `i8 q[256]` (bytes 4..260), `i16 bsums[16]` (bytes 260..292,
//! `bsums[j] = Σ q[16j..16j+16]`); value `i` is `d * q[i]`. The block sums let the Q2_K/Q4_K dot products apply
//! their per-sub-block minimums without touching the 256 quants again.
//!
//! Quantizer: symmetric round-to-nearest, `d = amax / 127`, `q ∈ [-127, 127]` (never -128, so SIMD code may negate
//! a quant without overflow). Functions never panic on short buffers (whole blocks only).

use super::QK_K;

pub(crate) const BLOCK_BYTES: usize = 292;
pub(crate) const QS: usize = 4;
pub(crate) const BSUMS: usize = 4 + QK_K;

/// The block's scale.
#[inline(always)]
pub(crate) fn d(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Block sum `j` (of quants `16j..16j+16`).
#[inline(always)]
pub(crate) fn bsum(b: &[u8], j: usize) -> i32 {
    i16::from_le_bytes([b[BSUMS + 2 * j], b[BSUMS + 2 * j + 1]]) as i32
}

/// Quant `i` of the block.
#[inline(always)]
pub(crate) fn q(b: &[u8], i: usize) -> i32 {
    b[QS + i] as i8 as i32
}

pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            b.iter_mut().for_each(|v| *v = 0);
            continue;
        }
        let iscale = 127.0 / amax;
        b[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        for (o, &v) in b[QS..QS + QK_K].iter_mut().zip(x) {
            *o = (v * iscale).round().clamp(-127.0, 127.0) as i8 as u8;
        }
        for j in 0..QK_K / 16 {
            let s: i32 = b[QS + 16 * j..QS + 16 * j + 16].iter().map(|&v| v as i8 as i32).sum();
            b[BSUMS + 2 * j..BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
    }
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let dd = d(b);
        for (i, yi) in y.iter_mut().enumerate() {
            *yi = dd * q(b, i) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bsums_match_quants_and_error_is_half_a_step() {
        let x: Vec<f32> = (0..2 * QK_K).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut b = vec![0u8; 2 * BLOCK_BYTES];
        quantize(&x, &mut b);
        for blk in b.chunks_exact(BLOCK_BYTES) {
            for j in 0..16 {
                assert_eq!(bsum(blk, j), (16 * j..16 * j + 16).map(|i| q(blk, i)).sum::<i32>());
            }
            assert!((0..QK_K).all(|i| q(blk, i) >= -127));
        }
        let mut y = vec![0f32; 2 * QK_K];
        dequantize(&b, &mut y);
        for (blk, (xs, ys)) in b.chunks_exact(BLOCK_BYTES).zip(x.chunks(QK_K).zip(y.chunks(QK_K))) {
            for (a, c) in xs.iter().zip(ys) {
                assert!((a - c).abs() <= d(blk) * 0.5001);
            }
        }
    }
}
