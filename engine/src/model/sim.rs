//! Activation simulation: the FP8 / FP4 round trips the official inference code applies to cached activations
//! (switched off by `--exact`).
//!
//! - [`fp8_e4m3_round`]: nearest FP8 e4m3fn value (max 448, subnormal step 2^-9, ties to even).
//! - [`fp4_e2m1_round`]: nearest FP4 e2m1 value (`{0, 0.5, 1, 1.5, 2, 3, 4, 6}` with sign, ties to even).
//! - [`fp8_blocks`] / [`fp4_blocks`]: per-block power-of-two scale `2^ceil(log2(amax / max))`, then round trip.
//! - [`hadamard`]: orthonormal Walsh–Hadamard transform (Sylvester order) of a power-of-two length.
//!
//! All functions are pure and allocation-free. A block whose amax is 0 (or not finite) is left unchanged.

/// Rounds to the nearest value on a grid with `mant_bits` mantissa bits and minimum normal exponent `emin`,
/// saturating at `max`; ties to even.
fn round_minifloat(x: f32, mant_bits: i32, emin: i32, max: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let a = x.abs();
    if a == 0.0 {
        return x;
    }
    // Exponent of a (floor(log2 a)), clamped to the subnormal range.
    let e = (a.log2().floor() as i32).max(emin);
    let step = 2f32.powi(e - mant_bits);
    let q = (a / step).round_ties_even() * step;
    q.min(max).copysign(x)
}

/// FP8 e4m3fn round trip of one value (4 exponent bits, bias 7, 3 mantissa bits, max 448).
pub fn fp8_e4m3_round(x: f32) -> f32 {
    round_minifloat(x, 3, -6, 448.0)
}

/// FP4 e2m1 round trip of one value (2 exponent bits, bias 1, 1 mantissa bit, max 6).
pub fn fp4_e2m1_round(x: f32) -> f32 {
    round_minifloat(x, 1, 0, 6.0)
}

fn blocks(x: &mut [f32], block: usize, max: f32, round: fn(f32) -> f32) {
    for b in x.chunks_mut(block) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 || !amax.is_finite() {
            continue;
        }
        let scale = 2f32.powf((amax / max).log2().ceil());
        for v in b.iter_mut() {
            *v = round(*v / scale) * scale;
        }
    }
}

/// FP8 e4m3 round trip of `x` in blocks of `block` values with scale `2^ceil(log2(amax/448))`.
pub fn fp8_blocks(x: &mut [f32], block: usize) {
    blocks(x, block, 448.0, fp8_e4m3_round)
}

/// FP4 e2m1 round trip of `x` in blocks of `block` values with scale `2^ceil(log2(amax/6))`.
pub fn fp4_blocks(x: &mut [f32], block: usize) {
    blocks(x, block, 6.0, fp4_e2m1_round)
}

/// In-place orthonormal Walsh–Hadamard transform; `x.len()` must be a power of two (checked by the caller;
/// other lengths are left unchanged).
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    if n == 0 || !n.is_power_of_two() {
        return;
    }
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_hand_checked_values() {
        assert_eq!(fp8_e4m3_round(448.0), 448.0);
        assert_eq!(fp8_e4m3_round(1000.0), 448.0);
        assert_eq!(fp8_e4m3_round(-1.0), -1.0);
        // Between 1 and 2 the step is 1/8: 1.0625 is a tie between 1.0 and 1.125 -> even mantissa (1.0).
        assert_eq!(fp8_e4m3_round(1.0625), 1.0);
        assert_eq!(fp8_e4m3_round(1.1875), 1.25);
        assert_eq!(fp8_e4m3_round(1.1), 1.125);
        // Between 256 and 448 the step is 32.
        assert_eq!(fp8_e4m3_round(300.0), 288.0);
        // Subnormals: steps of 2^-9 below 2^-6.
        assert_eq!(fp8_e4m3_round(2f32.powi(-9)), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_round(3.4 * 2f32.powi(-9)), 3.0 * 2f32.powi(-9));
        assert_eq!(fp8_e4m3_round(0.5 * 2f32.powi(-9)), 0.0); // tie to even (0)
        assert_eq!(fp8_e4m3_round(1.5 * 2f32.powi(-9)), 2.0 * 2f32.powi(-9)); // tie to even (2)
        assert_eq!(fp8_e4m3_round(0.0), 0.0);
    }

    #[test]
    fn e2m1_grid() {
        let grid = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for &g in &grid {
            assert_eq!(fp4_e2m1_round(g), g);
            assert_eq!(fp4_e2m1_round(-g), -g);
        }
        assert_eq!(fp4_e2m1_round(0.25), 0.0); // tie -> 0 (even)
        assert_eq!(fp4_e2m1_round(0.75), 1.0); // tie -> 1.0 (even mantissa)
        assert_eq!(fp4_e2m1_round(1.25), 1.0); // tie -> 1.0
        assert_eq!(fp4_e2m1_round(1.75), 2.0); // tie -> 2.0
        assert_eq!(fp4_e2m1_round(2.5), 2.0); // tie -> 2
        assert_eq!(fp4_e2m1_round(3.5), 4.0); // tie -> 4
        assert_eq!(fp4_e2m1_round(5.0), 4.0); // tie -> 4
        assert_eq!(fp4_e2m1_round(5.1), 6.0);
        assert_eq!(fp4_e2m1_round(7.0), 6.0);
    }

    #[test]
    fn block_scales_are_powers_of_two() {
        // amax 3 -> scale 2^ceil(log2(0.5)) = 0.5; 3/0.5 = 6 exactly representable.
        let mut x = [3.0f32, 1.3, -0.2, 0.0];
        fp4_blocks(&mut x, 4);
        // 1.3/0.5 = 2.6 -> 3 -> 1.5; -0.2/0.5 = -0.4 -> -0.5 -> -0.25.
        assert_eq!(x, [3.0, 1.5, -0.25, 0.0]);
        // amax 448 -> scale 1; values pass through fp8 unscaled.
        let mut y = [448.0f32, 1.1];
        fp8_blocks(&mut y, 2);
        assert_eq!(y, [448.0, 1.125]);
        let mut z = [0.0f32; 4];
        fp8_blocks(&mut z, 4);
        assert_eq!(z, [0.0; 4]);
    }

    #[test]
    fn hadamard_is_orthonormal_involution() {
        let mut x = [1.0f32, 0.0, 0.0, 0.0];
        hadamard(&mut x);
        assert_eq!(x, [0.5; 4]);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 2.0).collect();
        let mut y = orig.clone();
        hadamard(&mut y);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = y.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        hadamard(&mut y);
        for (a, b) in y.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
