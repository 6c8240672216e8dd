//! Q8_0: 32 values per 34-byte block, scalar reference code.
//!
//! Block layout (little-endian): `f16 d` (bytes 0..2), then `i8 q[32]` (bytes 2..34); value `i` is `d * q[i]`.
//!
//! Quantizer: without importance it is ggml's reference round-to-nearest bit for bit (`d = amax / 127`, `q =
//! round_half_away(x / d)`, `d` stored as f16), checked against the `gguf` package in the fixture tests. With
//! importance weights it searches a few scales around `amax / 127` for the least weighted squared error.
//!
//! Q8_0 is also the activation format paired with Q8_0 weights ([`dot_q8_0`]).
//!
//! Functions here never panic on short buffers: they handle as many whole blocks as both sides hold.

use super::f16::{f16_at, f16_bytes};
use super::kquant_search::{symmetric_scale, Weighting};

pub(crate) const QK: usize = 32;
pub(crate) const BLOCK_BYTES: usize = 34;

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (yi, &q) in y.iter_mut().zip(&b[2..]) {
            *yi = q as i8 as f32 * d;
        }
    }
}

/// Quantizes whole blocks of `src` into `dst`. `importance`, if given, has one weight per value of `src`.
pub(crate) fn quantize(src: &[f32], importance: Option<&[f32]>, dst: &mut [u8]) {
    for (bi, (x, b)) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BLOCK_BYTES)).enumerate() {
        match importance {
            None => quantize_block_rtn(x, b),
            Some(imp) => {
                let w = &imp[bi * QK..(bi + 1) * QK];
                let mut q = [0i8; QK];
                let d = symmetric_scale(x, Weighting::Importance(w), 127, &mut q);
                b[..2].copy_from_slice(&f16_bytes(d));
                // Re-round against the f16 scale actually stored.
                let df = f16_at(b, 0);
                let id = if df != 0.0 { 1.0 / df } else { 0.0 };
                for (o, &v) in b[2..].iter_mut().zip(x) {
                    *o = (v * id).round().clamp(-127.0, 127.0) as i8 as u8;
                }
            }
        }
    }
}

/// ggml's reference: `d = amax / 127`, `q = round(x * (1 / d))` with ties away from zero.
pub(crate) fn quantize_block_rtn(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16_bytes(d));
    for (o, &v) in b[2..BLOCK_BYTES].iter_mut().zip(x) {
        *o = super::round_i8(v * id);
    }
}

/// Q8_0 weights · f32 activations over the whole blocks both hold.
pub(crate) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, xs) in w.chunks_exact(BLOCK_BYTES).zip(x.chunks_exact(QK)) {
        let mut s = [0f32; 4];
        for (i, (&q, &xv)) in b[2..].iter().zip(xs).enumerate() {
            s[i & 3] += q as i8 as f32 * xv;
        }
        acc += f16_at(b, 0) * ((s[0] + s[1]) + (s[2] + s[3]));
    }
    acc
}

/// Q8_0 weights · Q8_0 activations: exact integer block sums, scaled by `d_w * d_a`.
pub(crate) fn dot_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (bw, ba) in w.chunks_exact(BLOCK_BYTES).zip(a.chunks_exact(BLOCK_BYTES)) {
        let s: i32 = bw[2..].iter().zip(&ba[2..]).map(|(&p, &q)| p as i8 as i32 * q as i8 as i32).sum();
        acc += f16_at(bw, 0) * f16_at(ba, 0) * s as f32;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtn_maps_the_largest_magnitude_to_127() {
        let mut x = [0f32; QK];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.25;
        }
        let mut b = [0u8; BLOCK_BYTES];
        quantize(&x, None, &mut b);
        assert_eq!(b[2] as i8, -127); // x[0] = -4.0 is the largest magnitude
        let mut y = [0f32; QK];
        dequantize(&b, &mut y);
        for (a, c) in x.iter().zip(&y) {
            assert!((a - c).abs() <= 4.0 / 127.0 * 0.5 + 1e-3, "{a} vs {c}");
        }
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let mut b = [0xffu8; BLOCK_BYTES];
        quantize(&[0f32; QK], None, &mut b);
        assert!(b.iter().all(|&v| v == 0));
    }

    #[test]
    fn integer_dot_matches_dequantized_dot() {
        let mut w = [0u8; 2 * BLOCK_BYTES];
        let mut a = [0u8; 2 * BLOCK_BYTES];
        let xs: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1).collect();
        let ys: Vec<f32> = (0..64).map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.3).collect();
        quantize(&xs, None, &mut w);
        quantize(&ys, None, &mut a);
        let (mut dw, mut da) = (vec![0f32; 64], vec![0f32; 64]);
        dequantize(&w, &mut dw);
        dequantize(&a, &mut da);
        let want: f64 = dw.iter().zip(&da).map(|(p, q)| *p as f64 * *q as f64).sum();
        let got = dot_q8_0(&w, &a) as f64;
        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{got} vs {want}");
        let got_f = dot_f32(&w, &da) as f64;
        assert!((got_f - want).abs() <= 1e-5 * want.abs().max(1.0), "{got_f} vs {want}");
    }
}
