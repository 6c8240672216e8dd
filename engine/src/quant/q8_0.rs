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

/// Q8_0 weights · Q8_0 activations under the sixteen-lane contract that the AVX-512 VNNI kernels implement
/// (`simd::avx512_q8_rows`; where they run, [`crate::quant::dot_q_kernel`] and every multi-row Q8_0 form return
/// exactly this): block `b`'s exact integer sum `s_b = Σ₃₂ w·a`, then with `d_b = d_w · d_a` (the f16 scales as
/// exact f32, their product rounded to f32) `lane[b mod 16] = fma(d_b, s_b, lane[b mod 16])` in block order from
/// +0, and the sum `h8[i] = lane[i] + lane[i + 8]`, `h4[i] = h8[i] + h8[i + 4]`, `(h4[0] + h4[2]) + (h4[1] +
/// h4[3])`. `s_b` is at most 32·128·127 in magnitude, so its f32 value is exact. (The kernels' tests check them
/// against it.)
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn dot_q8_0_lanes16(w: &[u8], a: &[u8]) -> f32 {
    let mut lane = [0f32; 16];
    for (b, (bw, ba)) in w.chunks_exact(BLOCK_BYTES).zip(a.chunks_exact(BLOCK_BYTES)).enumerate() {
        let s: i32 = bw[2..].iter().zip(&ba[2..]).map(|(&p, &q)| p as i8 as i32 * q as i8 as i32).sum();
        let d = f16_at(bw, 0) * f16_at(ba, 0);
        lane[b % 16] = d.mul_add(s as f32, lane[b % 16]);
    }
    let h8: [f32; 8] = std::array::from_fn(|i| lane[i] + lane[i + 8]);
    let h4: [f32; 4] = std::array::from_fn(|i| h8[i] + h8[i + 4]);
    (h4[0] + h4[2]) + (h4[1] + h4[3])
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

    /// The sixteen-lane reference: exact on integer-valued cases, and within f32 rounding of the sequential
    /// reference on random rows of 1..=40 blocks (it only orders the same block products differently).
    #[test]
    fn sixteen_lane_reference_is_the_block_sum_reordered() {
        let one = f16_bytes(1.0);
        let mut w = vec![0u8; 20 * BLOCK_BYTES];
        let mut a = w.clone();
        for (i, (bw, ba)) in w.chunks_exact_mut(BLOCK_BYTES).zip(a.chunks_exact_mut(BLOCK_BYTES)).enumerate() {
            bw[..2].copy_from_slice(&one);
            ba[..2].copy_from_slice(&one);
            bw[2..].fill((i as i8 - 10) as u8);
            ba[2..].fill(3);
        }
        let want: i32 = (0..20).map(|i| (i - 10) * 3 * 32).sum();
        assert_eq!(dot_q8_0_lanes16(&w, &a), want as f32);
        let mut seed = 1u64;
        let mut rnd = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for nb in 1..=40usize {
            let mut row = |q_max: u32| -> Vec<u8> {
                let mut v = vec![0u8; nb * BLOCK_BYTES];
                for b in v.chunks_exact_mut(BLOCK_BYTES) {
                    b[..2].copy_from_slice(&f16_bytes(0.01 + (rnd() % 100) as f32 * 1e-3));
                    b[2..].iter_mut().for_each(|q| *q = ((rnd() % (2 * q_max + 1)) as i32 - q_max as i32) as u8);
                }
                v
            };
            let (w, a) = (row(127), row(127));
            let (got, seq) = (dot_q8_0_lanes16(&w, &a), dot_q8_0(&w, &a));
            let mass: f32 = w
                .chunks_exact(BLOCK_BYTES)
                .zip(a.chunks_exact(BLOCK_BYTES))
                .map(|(bw, ba)| (f16_at(bw, 0) * f16_at(ba, 0)).abs() * 32.0 * 127.0 * 127.0)
                .sum();
            assert!((got - seq).abs() <= mass * 1e-6, "{nb} blocks: {got} vs {seq}");
        }
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
