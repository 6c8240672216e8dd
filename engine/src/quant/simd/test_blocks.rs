//! Test inputs shared by the SIMD kernel tests: hand-made Q8_K activation blocks and the error scale of a dot.

use crate::quant::{q8_k, QK_K};

/// `n` Q8_K blocks with quants `q(i)` (value index `i` across blocks) and scale `d`, block sums filled in.
pub(super) fn q8k_blocks(n: usize, d: f32, mut q: impl FnMut(usize) -> i8) -> Vec<u8> {
    let mut v = vec![0u8; n * q8_k::BLOCK_BYTES];
    for (bi, b) in v.chunks_exact_mut(q8_k::BLOCK_BYTES).enumerate() {
        b[..4].copy_from_slice(&d.to_le_bytes());
        for i in 0..QK_K {
            b[q8_k::QS + i] = q(bi * QK_K + i) as u8;
        }
        for j in 0..16 {
            let s: i32 = (0..16).map(|i| b[q8_k::QS + 16 * j + i] as i8 as i32).sum();
            b[q8_k::BSUMS + 2 * j..q8_k::BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
    }
    v
}

/// Σ |term| of the dot of weight blocks `w` (`block_bytes` each, decoded by `dequantize_block`) with Q8_K blocks
/// `a` (dequantized weights · dequantized activations): the scale of f32 rounding errors.
pub(super) fn mass(w: &[u8], a: &[u8], block_bytes: usize, dequantize_block: fn(&[u8], &mut [f32])) -> f64 {
    let mut y = [0f32; QK_K];
    let mut m = 0f64;
    for (b, qa) in w.chunks_exact(block_bytes).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        dequantize_block(b, &mut y);
        m += (0..QK_K).map(|i| (y[i] as f64 * (q8_k::d(qa) * q8_k::q(qa, i) as f32) as f64).abs()).sum::<f64>();
    }
    m
}
