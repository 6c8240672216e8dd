//! Q2_K: 256 values per 84-byte block (2.625 bits per weight), scalar reference code.
//!
//! Block layout (little-endian):
//! - bytes 0..16: `scales[16]`, one per 16-value sub-block: low nibble = scale `sc`, high nibble = min `m`;
//! - bytes 16..80: `qs[64]`, 2-bit quants. The block is two halves of 128 values; in half `h`, value
//!   `128h + 32j + l` (`j < 4`, `l < 32`) is bits `2j..2j+2` of `qs[32h + l]`;
//! - bytes 80..82: `f16 d`, bytes 82..84: `f16 dmin`.
//!
//! Value `i` (sub-block `s = i / 16`) is `(d·sc_s)·q_i − (dmin·m_s)`, computed in that order (this is the order
//! ggml and the `gguf` package use, so dequantization matches them bit for bit).
//!
//! Dot with Q8_K activations: `d_a·(d·Σ_s sc_s·Σ q·a − dmin·Σ_s m_s·bsum_s)`, integer inner sums.
//!
//! Quantizer: per sub-block a weighted least-squares search for scale and min (levels 0..3), then the 16 scales
//! and mins are quantized to 4 bits against the block's `d`/`dmin` and the levels recomputed with the stored
//! values. Weights: `|x|` by default, the importance values when given. Functions never panic on short buffers
//! (whole blocks only).

use super::f16::{f16_at, f16_bytes};
use super::kquant_search::{asymmetric_scale_min, nearest};
use super::{q8_k, QK_K};

pub(crate) const BLOCK_BYTES: usize = 84;

/// Byte offset and bit shift of quant `i` within the block.
#[inline(always)]
fn q_pos(i: usize) -> (usize, u32) {
    let (h, r) = (i / 128, i % 128);
    (16 + 32 * h + r % 32, 2 * (r / 32) as u32)
}

/// Dequantizes one block into 256 values.
#[inline(always)]
pub(crate) fn dequantize_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for h in 0..2 {
        for j in 0..4 {
            for half in 0..2 {
                let s = 8 * h + 2 * j + half;
                let dl = d * (b[s] & 0xf) as f32;
                let ml = dmin * (b[s] >> 4) as f32;
                let q = &b[16 + 32 * h + 16 * half..16 + 32 * h + 16 * half + 16];
                let out = &mut y[16 * s..16 * s + 16];
                for (o, &qb) in out.iter_mut().zip(q) {
                    *o = dl * ((qb >> (2 * j)) & 3) as f32 - ml;
                }
            }
        }
    }
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_block(b, y);
    }
}

pub(crate) fn quantize(src: &[f32], importance: Option<&[f32]>, dst: &mut [u8]) {
    for (bi, (x, b)) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BLOCK_BYTES)).enumerate() {
        let mut w = [0f32; QK_K];
        match importance {
            Some(imp) => w.copy_from_slice(&imp[bi * QK_K..(bi + 1) * QK_K]),
            None => w.iter_mut().zip(x).for_each(|(w, v)| *w = v.abs()),
        }
        quantize_block(x, &w, b);
    }
}

fn quantize_block(x: &[f32], w: &[f32], b: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    for s in 0..16 {
        let r = 16 * s..16 * s + 16;
        let (sc, m) = asymmetric_scale_min(&x[r.clone()], &w[r.clone()], 3, -0.5, 0.1, 15, &mut levels[r]);
        scales[s] = sc.max(0.0);
        mins[s] = m.max(0.0);
    }
    let max_scale = scales.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    b[80..82].copy_from_slice(&f16_bytes(max_scale / 15.0));
    b[82..84].copy_from_slice(&f16_bytes(max_min / 15.0));
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for s in 0..16 {
        let sc = if d > 0.0 { nearest(scales[s] / d).clamp(0, 15) } else { 0 };
        let m = if dmin > 0.0 { nearest(mins[s] / dmin).clamp(0, 15) } else { 0 };
        b[s] = (sc | (m << 4)) as u8;
        let dl = d * sc as f32;
        let ml = dmin * m as f32;
        for i in 16 * s..16 * s + 16 {
            levels[i] = if dl > 0.0 { nearest((x[i] + ml) / dl).clamp(0, 3) as u8 } else { 0 };
        }
    }
    b[16..80].iter_mut().for_each(|v| *v = 0);
    for (i, &l) in levels.iter().enumerate() {
        let (o, sh) = q_pos(i);
        b[o] |= l << sh;
    }
}

/// Q2_K weights · f32 activations over the whole blocks both hold.
pub(crate) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    super::dot_f32_by_blocks(w, x, BLOCK_BYTES, dequantize_block)
}

/// Q2_K weights · Q8_K activations over the whole blocks both hold.
pub(crate) fn dot_q8k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (b, qa) in w.chunks_exact(BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let (mut sumi, mut summ) = (0i32, 0i32);
        let aq = &qa[q8_k::QS..q8_k::QS + QK_K];
        for h in 0..2 {
            for j in 0..4 {
                for half in 0..2 {
                    let s = 8 * h + 2 * j + half;
                    let q = &b[16 + 32 * h + 16 * half..16 + 32 * h + 16 * half + 16];
                    let t: i32 = q
                        .iter()
                        .zip(&aq[16 * s..16 * s + 16])
                        .map(|(&qb, &av)| ((qb >> (2 * j)) & 3) as i32 * av as i8 as i32)
                        .sum();
                    sumi += (b[s] & 0xf) as i32 * t;
                    summ += (b[s] >> 4) as i32 * q8_k::bsum(qa, s);
                }
            }
        }
        acc += q8_k::d(qa) * (f16_at(b, 80) * sumi as f32 - f16_at(b, 82) * summ as f32);
    }
    acc
}
