//! NEON kernels (aarch64; compiled only when the target enables `neon`, which the aarch64 baseline does, so no
//! runtime detection is needed).
//!
//! Integer dot products use `vmull_s8` + `vpadalq_s16` (the baseline; the optional `dotprod` extension is not
//! assumed). F16 rows are converted with integer ops (Rust's `f16` NEON types are not stable). Every pointer load reads
//! inside a block slice produced by `chunks_exact`, or below an index bounded by the slice length.
//!
//! To run the tests on an x86 machine: `rustup target add aarch64-unknown-linux-gnu`, `apt-get install qemu-user
//! gcc-aarch64-linux-gnu`, then `CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
//! CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" cargo test --target
//! aarch64-unknown-linux-gnu -p ds4-engine quant`.

use std::arch::aarch64::*;

use super::super::api::{DotF32, DotQ};
use super::super::f16::{bf16_to_f32, f16_at};
use super::super::iq2_tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::super::{iq2_xxs, q2_k, q4_k, q8_0, q8_k, GgmlType, QK_K};

pub(super) fn dot_f32(ty: GgmlType) -> Option<DotF32> {
    Some(match ty {
        GgmlType::F32 => f32_f32,
        GgmlType::F16 => f16_f32,
        GgmlType::Bf16 => bf16_f32,
        GgmlType::Q8_0 => q8_0_f32,
        GgmlType::Q2K => q2_k_f32,
        GgmlType::Q4K => q4_k_f32,
        GgmlType::Iq2Xxs => iq2_xxs_f32,
        _ => return None,
    })
}

pub(super) fn dot_q(ty: GgmlType) -> Option<DotQ> {
    Some(match ty {
        GgmlType::Q8_0 => q8_0_q8_0,
        GgmlType::Q2K => q2_k_q8_k,
        GgmlType::Q4K => q4_k_q8_k,
        GgmlType::Iq2Xxs => iq2_xxs_q8_k,
        _ => return None,
    })
}

// Safe wrappers: this module is only compiled when `neon` is enabled for the target (it is part of the aarch64
// baseline), so the target-feature functions may always be called.
macro_rules! wrap {
    ($name:ident, $imp:ident, $b:ty) => {
        fn $name(w: &[u8], x: $b) -> f32 {
            // SAFETY: compiled only with `target_feature = "neon"` (see `simd/mod.rs`), so NEON is available.
            unsafe { $imp(w, x) }
        }
    };
}
wrap!(f32_f32, f32_f32_imp, &[f32]);
wrap!(f16_f32, f16_f32_imp, &[f32]);
wrap!(bf16_f32, bf16_f32_imp, &[f32]);
wrap!(q8_0_f32, q8_0_f32_imp, &[f32]);
wrap!(q2_k_f32, q2_k_f32_imp, &[f32]);
wrap!(q4_k_f32, q4_k_f32_imp, &[f32]);
wrap!(iq2_xxs_f32, iq2_xxs_f32_imp, &[f32]);
wrap!(q8_0_q8_0, q8_0_q8_0_imp, &[u8]);
wrap!(q4_k_q8_k, q4_k_q8_k_imp, &[u8]);
wrap!(q2_k_q8_k, q2_k_q8_k_imp, &[u8]);
wrap!(iq2_xxs_q8_k, iq2_xxs_q8_k_imp, &[u8]);

/// Σ a[i]·x[i] over `n ≤ min(a.len(), x.len())` values.
#[target_feature(enable = "neon")]
fn dot_slices(a: &[f32], x: &[f32], n: usize) -> f32 {
    let (ap, xp) = (a.as_ptr(), x.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 4k + 4 ≤ n ≤ both lengths.
            *acc = unsafe { vfmaq_f32(*acc, vld1q_f32(ap.add(i + 4 * k)), vld1q_f32(xp.add(i + 4 * k))) };
        }
        i += 16;
    }
    while i + 4 <= n {
        // SAFETY: i + 4 ≤ n.
        acc[0] = unsafe { vfmaq_f32(acc[0], vld1q_f32(ap.add(i)), vld1q_f32(xp.add(i))) };
        i += 4;
    }
    let mut s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    for j in i..n {
        s += a[j] * x[j];
    }
    s
}

#[target_feature(enable = "neon")]
fn f32_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 4).min(x.len());
    let mut acc = [vdupq_n_f32(0.0); 2];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i + 8 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 4k + 4 ≤ n values, inside both buffers; the weight load is unaligned-safe (`vld1q_u8`).
            unsafe {
                let wv = vreinterpretq_f32_u8(vld1q_u8(wp.add(4 * (i + 4 * k))));
                *acc = vfmaq_f32(*acc, wv, vld1q_f32(xp.add(i + 4 * k)));
            }
        }
        i += 8;
    }
    let mut s = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
    for j in i..n {
        s += f32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]]) * x[j];
    }
    s
}

/// 4 f16 bit patterns (in u32 lanes) to f32, exact: shift exponent and mantissa into f32 position and scale by
/// 2^112 (handles normals and subnormals), give infinities/NaNs an all-ones exponent, then restore the sign.
#[inline]
#[target_feature(enable = "neon")]
fn f16x4_to_f32(u: uint32x4_t) -> float32x4_t {
    let em = vandq_u32(u, vdupq_n_u32(0x7fff));
    let sign = vshlq_n_u32::<16>(vandq_u32(u, vdupq_n_u32(0x8000)));
    let shifted = vshlq_n_u32::<13>(em);
    let scaled = vmulq_f32(vreinterpretq_f32_u32(shifted), vdupq_n_f32(f32::from_bits(0x7780_0000)));
    let special = vreinterpretq_f32_u32(vorrq_u32(shifted, vdupq_n_u32(0x7f80_0000)));
    let v = vbslq_f32(vcgeq_u32(em, vdupq_n_u32(0x7c00)), special, scaled);
    vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(v), sign))
}

#[target_feature(enable = "neon")]
fn f16_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 2];
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 ≤ n: 16 bytes of w at 2i and 8 f32 of x at i are in bounds.
        unsafe {
            let h = vreinterpretq_u16_u8(vld1q_u8(wp.add(2 * i)));
            let lo = f16x4_to_f32(vmovl_u16(vget_low_u16(h)));
            let hi = f16x4_to_f32(vmovl_u16(vget_high_u16(h)));
            acc[0] = vfmaq_f32(acc[0], lo, vld1q_f32(xp.add(i)));
            acc[1] = vfmaq_f32(acc[1], hi, vld1q_f32(xp.add(i + 4)));
        }
        i += 8;
    }
    let mut s = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
    for j in i..n {
        s += f16_at(w, 2 * j) * x[j];
    }
    s
}

#[target_feature(enable = "neon")]
fn bf16_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 2];
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 ≤ n: 16 bytes of w at 2i and 8 f32 of x at i are in bounds.
        unsafe {
            let h = vreinterpretq_u16_u8(vld1q_u8(wp.add(2 * i)));
            let lo = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h)));
            let hi = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(h)));
            acc[0] = vfmaq_f32(acc[0], lo, vld1q_f32(xp.add(i)));
            acc[1] = vfmaq_f32(acc[1], hi, vld1q_f32(xp.add(i + 4)));
        }
        i += 8;
    }
    let mut s = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
    for j in i..n {
        s += bf16_to_f32(u16::from_le_bytes([w[2 * j], w[2 * j + 1]])) * x[j];
    }
    s
}

#[target_feature(enable = "neon")]
fn q8_0_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = vdupq_n_f32(0.0);
    for (b, xs) in w.chunks_exact(q8_0::BLOCK_BYTES).zip(x.chunks_exact(q8_0::QK)) {
        let (bp, xp) = (b.as_ptr(), xs.as_ptr());
        let mut s = vdupq_n_f32(0.0);
        for k in 0..4 {
            // SAFETY: 8 quants at 2 + 8k ≤ 26 inside the 34-byte block; 8 f32 at 8k inside the 32 values.
            unsafe {
                let q = vmovl_s8(vld1_s8(bp.add(2 + 8 * k) as *const i8));
                let lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(q)));
                let hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(q)));
                s = vfmaq_f32(s, lo, vld1q_f32(xp.add(8 * k)));
                s = vfmaq_f32(s, hi, vld1q_f32(xp.add(8 * k + 4)));
            }
        }
        acc = vfmaq_n_f32(acc, s, f16_at(b, 0));
    }
    vaddvq_f32(acc)
}

/// Dequantizes block by block (scalar) and dots each block with NEON.
macro_rules! deq_dot {
    ($w:ident, $x:ident, $bytes:expr, $deq:path) => {{
        let mut y = [0f32; QK_K];
        let mut acc = 0f32;
        for (b, xs) in $w.chunks_exact($bytes).zip($x.chunks_exact(QK_K)) {
            $deq(b, &mut y);
            acc += dot_slices(&y, xs, QK_K);
        }
        acc
    }};
}

#[target_feature(enable = "neon")]
fn q2_k_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    deq_dot!(w, x, q2_k::BLOCK_BYTES, q2_k::dequantize_block)
}

#[target_feature(enable = "neon")]
fn q4_k_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    deq_dot!(w, x, q4_k::BLOCK_BYTES, q4_k::dequantize_block)
}

#[target_feature(enable = "neon")]
fn iq2_xxs_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    deq_dot!(w, x, iq2_xxs::BLOCK_BYTES, iq2_xxs::dequantize_block)
}

/// Σ a·b over 16 signed bytes, accumulated into `acc`.
#[inline]
#[target_feature(enable = "neon")]
fn dot16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    vpadalq_s16(acc, vmull_s8(vget_high_s8(a), vget_high_s8(b)))
}

#[target_feature(enable = "neon")]
fn q8_0_q8_0_imp(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (bw, ba) in w.chunks_exact(q8_0::BLOCK_BYTES).zip(a.chunks_exact(q8_0::BLOCK_BYTES)) {
        let (pw, pa) = (bw.as_ptr(), ba.as_ptr());
        // SAFETY: 32 quants at offset 2 of each 34-byte block.
        let s = unsafe {
            let mut s = vdupq_n_s32(0);
            s = dot16(s, vld1q_s8(pw.add(2) as *const i8), vld1q_s8(pa.add(2) as *const i8));
            s = dot16(s, vld1q_s8(pw.add(18) as *const i8), vld1q_s8(pa.add(18) as *const i8));
            vaddvq_s32(s)
        };
        acc += f16_at(bw, 0) * f16_at(ba, 0) * s as f32;
    }
    acc
}

#[target_feature(enable = "neon")]
fn q4_k_q8_k_imp(w: &[u8], a: &[u8]) -> f32 {
    let m4 = vdupq_n_u8(0x0f);
    let mut acc = 0f32;
    for (b, qa) in w.chunks_exact(q4_k::BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let (bp, ap) = (b.as_ptr(), qa.as_ptr());
        let (mut sumi, mut summ) = (0i32, 0i32);
        for c in 0..4 {
            let (sc_lo, m_lo) = q4_k::scale_min(&b[4..16], 2 * c);
            let (sc_hi, m_hi) = q4_k::scale_min(&b[4..16], 2 * c + 1);
            summ += m_lo as i32 * (q8_k::bsum(qa, 4 * c) + q8_k::bsum(qa, 4 * c + 1))
                + m_hi as i32 * (q8_k::bsum(qa, 4 * c + 2) + q8_k::bsum(qa, 4 * c + 3));
            // SAFETY: 32 quant bytes at 16 + 32c ≤ 112 inside the 144-byte block; 64 Q8_K quants at 4 + 64c ≤ 196
            // inside the 292-byte block.
            let (lo, hi) = unsafe {
                let mut lo = vdupq_n_s32(0);
                let mut hi = vdupq_n_s32(0);
                for half in 0..2 {
                    let q = vld1q_u8(bp.add(16 + 32 * c + 16 * half));
                    let ql = vreinterpretq_s8_u8(vandq_u8(q, m4));
                    let qh = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q));
                    lo = dot16(lo, ql, vld1q_s8(ap.add(4 + 64 * c + 16 * half) as *const i8));
                    hi = dot16(hi, qh, vld1q_s8(ap.add(36 + 64 * c + 16 * half) as *const i8));
                }
                (vaddvq_s32(lo), vaddvq_s32(hi))
            };
            sumi += sc_lo as i32 * lo + sc_hi as i32 * hi;
        }
        acc += q8_k::d(qa) * (f16_at(b, 0) * sumi as f32 - f16_at(b, 2) * summ as f32);
    }
    acc
}

#[target_feature(enable = "neon")]
fn q2_k_q8_k_imp(w: &[u8], a: &[u8]) -> f32 {
    let m3 = vdupq_n_u8(3);
    let mut acc = 0f32;
    for (b, qa) in w.chunks_exact(q2_k::BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let (bp, ap) = (b.as_ptr(), qa.as_ptr());
        let (mut sumi, mut summ) = (0i32, 0i32);
        for s in 0..16 {
            summ += (b[s] >> 4) as i32 * q8_k::bsum(qa, s);
        }
        for h in 0..2 {
            for half in 0..2 {
                // SAFETY: 16 quant bytes at 16 + 32h + 16half ≤ 64 inside the 84-byte block.
                let q2 = unsafe { vld1q_u8(bp.add(16 + 32 * h + 16 * half)) };
                for j in 0..4 {
                    let q = match j {
                        0 => vandq_u8(q2, m3),
                        1 => vandq_u8(vshrq_n_u8::<2>(q2), m3),
                        2 => vandq_u8(vshrq_n_u8::<4>(q2), m3),
                        _ => vshrq_n_u8::<6>(q2),
                    };
                    // Values 128h + 32j + 16half + (0..16) = sub-block 8h + 2j + half.
                    // SAFETY: 16 Q8_K quants at 4 + 128h + 32j + 16half ≤ 244 inside the 292-byte block.
                    let qa8 = unsafe { vld1q_s8(ap.add(4 + 128 * h + 32 * j + 16 * half) as *const i8) };
                    let t = vaddvq_s32(dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(q), qa8));
                    sumi += (b[8 * h + 2 * j + half] & 0xf) as i32 * t;
                }
            }
        }
        acc += q8_k::d(qa) * (f16_at(b, 80) * sumi as f32 - f16_at(b, 82) * summ as f32);
    }
    acc
}

#[target_feature(enable = "neon")]
fn iq2_xxs_q8_k_imp(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (b, qa) in w.chunks_exact(iq2_xxs::BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let ap = qa.as_ptr();
        let mut bsum = 0i32;
        for g in 0..8 {
            let o = 2 + 8 * g;
            let aux = u32::from_le_bytes([b[o + 4], b[o + 5], b[o + 6], b[o + 7]]);
            let mut s = vdupq_n_s32(0);
            for l in 0..4 {
                let grid = vreinterpret_s8_u64(vcreate_u64(IQ2XXS_GRID[b[o + l] as usize]));
                let sign = vreinterpret_s8_u64(vcreate_u64(SIGNS_PM1[((aux >> (7 * l)) & 127) as usize]));
                // SAFETY: 8 Q8_K quants at 4 + 32g + 8l ≤ 252 inside the 292-byte block.
                let q8 = unsafe { vld1_s8(ap.add(4 + 32 * g + 8 * l) as *const i8) };
                s = vpadalq_s16(s, vmull_s8(grid, vmul_s8(q8, sign)));
            }
            bsum += (2 * (aux >> 28) as i32 + 1) * vaddvq_s32(s);
        }
        acc += f16_at(b, 0) * q8_k::d(qa) * 0.125 * bsum as f32;
    }
    acc
}

/// For each 7-bit sign index, 8 bytes of +1 / -1 (0x01 / 0xff).
const SIGNS_PM1: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut k = 0;
    while k < 128 {
        let s = KSIGNS_IQ2XS[k];
        let mut v = 0u64;
        let mut j = 0;
        while j < 8 {
            let byte: u64 = if s & (1 << j) != 0 { 0xff } else { 0x01 };
            v |= byte << (8 * j);
            j += 1;
        }
        t[k] = v;
        k += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_bit_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            // SAFETY: this module only exists where NEON is enabled.
            let got = unsafe { vgetq_lane_f32::<0>(f16x4_to_f32(vdupq_n_u32(h as u32))) };
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            }
        }
    }
}
