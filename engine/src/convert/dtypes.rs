//! Element formats of checkpoint tensors, decoded to f32: F32, F16, BF16, FP8 e4m3fn, e8m0 (power-of-two scales)
//! and FP4 e2m1 (two per byte), plus the inverse encoders the tests use to build quantized checkpoints.
//!
//! Bit layouts (facts of the formats):
//! - e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; exponent 0 is subnormal (`m/8 · 2^-6`); `S.1111.111` is NaN;
//!   there is no infinity; largest finite 448.
//! - e8m0 (ue8m0): 8-bit unsigned exponent, value `2^(e−127)`; 0xFF is NaN.
//! - e2m1: 1 sign, 2 exponent (bias 1), 1 mantissa; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Packed two per byte,
//!   element `2i` in the low nibble, `2i+1` in the high nibble (PyTorch `float4_e2m1fn_x2` order).
//!
//! All decoders take little-endian byte slices whose length the caller has already checked; they never panic on
//! any bit pattern.

/// The eight non-negative e2m1 magnitudes, indexed by the low three bits.
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decodes one FP8 e4m3fn byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// Decodes one e8m0 scale byte.
pub fn e8m0_to_f32(b: u8) -> f32 {
    if b == 0xff {
        f32::NAN
    } else {
        2f32.powi(b as i32 - 127)
    }
}

/// Decodes one e2m1 nibble (low four bits of `n`).
pub fn e2m1_to_f32(n: u8) -> f32 {
    let v = E2M1_VALUES[(n & 7) as usize];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Encodes an f32 as the nearest e4m3fn byte (saturating at ±448; ties to even by brute force over the table).
/// Used by tests to build FP8 checkpoints.
#[cfg(test)]
pub(crate) fn f32_to_e4m3(x: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = f32::INFINITY;
    for b in 0u8..=0x7e {
        let err = (e4m3_to_f32(b) - x.abs()).abs();
        if err < best_err || (err == best_err && b & 1 == 0) {
            best = b;
            best_err = err;
        }
    }
    if x.is_sign_negative() && best != 0 {
        best | 0x80
    } else {
        best
    }
}

/// Encodes an f32 as the nearest e2m1 nibble (saturating at ±6). Used by tests to build FP4 checkpoints.
#[cfg(test)]
pub(crate) fn f32_to_e2m1(x: f32) -> u8 {
    let a = x.abs();
    let mut best = 0u8;
    for (i, v) in E2M1_VALUES.iter().enumerate() {
        if (v - a).abs() < (E2M1_VALUES[best as usize] - a).abs() {
            best = i as u8;
        }
    }
    if x.is_sign_negative() && best != 0 {
        best | 8
    } else {
        best
    }
}

/// How to read the elements of one stored tensor as f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    Bf16,
    F64,
    E4m3,
    E8m0,
    /// Two e2m1 values per byte.
    E2m1x2,
}

impl Elem {
    /// Decodes `n` values from `bytes` (which must hold at least their encoding) into `out`.
    pub fn decode_into(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            Elem::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Elem::F64 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(c);
                    *o = f64::from_le_bytes(a) as f32;
                }
            }
            Elem::F16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Elem::Bf16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Elem::E4m3 => {
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = e4m3_to_f32(b);
                }
            }
            Elem::E8m0 => {
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = e8m0_to_f32(b);
                }
            }
            Elem::E2m1x2 => {
                for (pair, &b) in out.chunks_mut(2).zip(bytes) {
                    pair[0] = e2m1_to_f32(b & 0x0f);
                    if let Some(hi) = pair.get_mut(1) {
                        *hi = e2m1_to_f32(b >> 4);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exponent 7, mantissa 0
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert!(e4m3_to_f32(0x7f).is_nan());
        for b in 0u8..=0xff {
            let x = e4m3_to_f32(b);
            if x.is_finite() && x != 0.0 {
                assert_eq!(e4m3_to_f32(f32_to_e4m3(x)), x, "byte {b:#x}");
            }
        }
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1000.0)), 448.0);
    }

    #[test]
    fn e8m0_and_e2m1() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(120), 2f32.powi(-7));
        assert!(e8m0_to_f32(255).is_nan());
        assert_eq!(e2m1_to_f32(0x7), 6.0);
        assert_eq!(e2m1_to_f32(0xb), -1.5);
        assert_eq!(f32_to_e2m1(2.4), 0x4);
        assert_eq!(f32_to_e2m1(-100.0), 0xf);
        let mut out = [0f32; 3];
        Elem::E2m1x2.decode_into(&[0x21, 0x0f], &mut out);
        assert_eq!(out, [0.5, 1.0, -6.0]);
    }
}
