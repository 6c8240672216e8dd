//! Q4_K: 256 values per 144-byte block (4.5 bits per weight), scalar reference code.
//!
//! Block layout (little-endian):
//! - bytes 0..2: `f16 d`, bytes 2..4: `f16 dmin`;
//! - bytes 4..16: `scales[12]`, eight 6-bit scales `sc_j` and eight 6-bit mins `m_j` (one per 32-value
//!   sub-block `j`) packed as: for `j < 4`, `sc_j = s[j] & 63`, `m_j = s[j+4] & 63`; for `j ≥ 4`,
//!   `sc_j = (s[j+4] & 15) | (s[j-4] >> 6) << 4`, `m_j = (s[j+4] >> 4) | (s[j] >> 6) << 4`;
//! - bytes 16..144: `qs[128]`, 4-bit quants: value `64c + l` (`l < 32`) is the low nibble of `qs[32c + l]`, value
//!   `64c + 32 + l` the high nibble.
//!
//! Value `i` (sub-block `j = i / 32`) is `(d·sc_j)·q_i − (dmin·m_j)`, in that order (as ggml and `gguf` compute it).
//!
//! Dot with Q8_K activations: `d_a·(d·Σ_j sc_j·Σ q·a − dmin·Σ_j m_j·(bsum_2j + bsum_2j+1))`.
//!
//! Quantizer: per sub-block weighted least-squares search for scale and min (levels 0..15), scales/mins quantized
//! to 6 bits against `d`/`dmin`, levels recomputed with the stored values. Weights: `rms(x) + |x|` by default, the
//! importance values when given. Functions never panic on short buffers (whole blocks only).

use super::f16::{f16_at, f16_bytes};
use super::kquant_search::{asymmetric_scale_min, nearest};
use super::{q8_k, QK_K};

pub(crate) const BLOCK_BYTES: usize = 144;

/// The 6-bit scale and min of sub-block `j` from the 12 packed bytes.
#[inline(always)]
pub(crate) fn scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

fn pack_scales(sc: &[u8; 8], m: &[u8; 8], s: &mut [u8]) {
    s[..12].iter_mut().for_each(|v| *v = 0);
    for j in 0..8 {
        if j < 4 {
            s[j] |= sc[j];
            s[j + 4] |= m[j];
        } else {
            s[j + 4] = (sc[j] & 0xf) | ((m[j] & 0xf) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
}

/// Dequantizes one block into 256 values.
#[inline(always)]
pub(crate) fn dequantize_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    for c in 0..4 {
        let (sc1, m1) = scale_min(&b[4..16], 2 * c);
        let (sc2, m2) = scale_min(&b[4..16], 2 * c + 1);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &b[16 + 32 * c..16 + 32 * c + 32];
        let (lo, hi) = y[64 * c..64 * c + 64].split_at_mut(32);
        for ((l, h), &qb) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
            *l = d1 * (qb & 0xf) as f32 - m1;
            *h = d2 * (qb >> 4) as f32 - m2;
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
            None => {
                let av = (x.iter().map(|v| v * v).sum::<f32>() / QK_K as f32).sqrt();
                w.iter_mut().zip(x).for_each(|(w, v)| *w = av + v.abs());
            }
        }
        quantize_block(x, &w, b);
    }
}

fn quantize_block(x: &[f32], w: &[f32], b: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let r = 32 * j..32 * j + 32;
        let (sc, m) = asymmetric_scale_min(&x[r.clone()], &w[r.clone()], 15, -1.0, 0.1, 20, &mut levels[r]);
        scales[j] = sc.max(0.0);
        mins[j] = m.max(0.0);
    }
    let max_scale = scales.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    b[0..2].copy_from_slice(&f16_bytes(max_scale / 63.0));
    b[2..4].copy_from_slice(&f16_bytes(max_min / 63.0));
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let mut sc6 = [0u8; 8];
    let mut m6 = [0u8; 8];
    for j in 0..8 {
        sc6[j] = if d > 0.0 { nearest(scales[j] / d).clamp(0, 63) as u8 } else { 0 };
        m6[j] = if dmin > 0.0 { nearest(mins[j] / dmin).clamp(0, 63) as u8 } else { 0 };
        let dl = d * sc6[j] as f32;
        let ml = dmin * m6[j] as f32;
        for i in 32 * j..32 * j + 32 {
            levels[i] = if dl > 0.0 { nearest((x[i] + ml) / dl).clamp(0, 15) as u8 } else { 0 };
        }
    }
    pack_scales(&sc6, &m6, &mut b[4..16]);
    for c in 0..4 {
        for l in 0..32 {
            b[16 + 32 * c + l] = levels[64 * c + l] | (levels[64 * c + 32 + l] << 4);
        }
    }
}

/// Q4_K weights · f32 activations over the whole blocks both hold.
pub(crate) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    super::dot_f32_by_blocks(w, x, BLOCK_BYTES, dequantize_block)
}

/// Q4_K weights · Q8_K activations over the whole blocks both hold.
pub(crate) fn dot_q8k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (b, qa) in w.chunks_exact(BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let (mut sumi, mut summ) = (0i32, 0i32);
        let aq = &qa[q8_k::QS..q8_k::QS + QK_K];
        for c in 0..4 {
            let q = &b[16 + 32 * c..16 + 32 * c + 32];
            let (alo, ahi) = aq[64 * c..64 * c + 64].split_at(32);
            let (mut tl, mut th) = (0i32, 0i32);
            for ((&qb, &l), &h) in q.iter().zip(alo).zip(ahi) {
                tl += (qb & 0xf) as i32 * l as i8 as i32;
                th += (qb >> 4) as i32 * h as i8 as i32;
            }
            for (k, t) in [(2 * c, tl), (2 * c + 1, th)] {
                let (sc, m) = scale_min(&b[4..16], k);
                sumi += sc as i32 * t;
                summ += m as i32 * (q8_k::bsum(qa, 2 * k) + q8_k::bsum(qa, 2 * k + 1));
            }
        }
        acc += q8_k::d(qa) * (f16_at(b, 0) * sumi as f32 - f16_at(b, 2) * summ as f32);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_packing_round_trips() {
        let sc: [u8; 8] = [0, 63, 17, 32, 5, 63, 40, 1];
        let m: [u8; 8] = [63, 0, 9, 48, 62, 31, 16, 33];
        let mut s = [0u8; 12];
        pack_scales(&sc, &m, &mut s);
        for j in 0..8 {
            assert_eq!(scale_min(&s, j), (sc[j], m[j]), "sub-block {j}");
        }
    }
}
