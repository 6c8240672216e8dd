//! Random but valid quant blocks, fast enough to fill gigabytes.
//!
//! Every byte pattern is a valid payload for the block formats the benchmarks use (2-bit/4-bit/8-bit codes, packed
//! scales, IQ2_XXS grid and sign indices); only the f16/f32 fields need care, since random bits would give NaN,
//! infinities or absurd magnitudes. [`fill`] therefore writes random bytes and then overwrites each block's scale
//! fields (or each element, for F16/F32) with finite values chosen so that dequantized weights stay within about
//! `±amp`. That keeps a synthetic model's activations bounded. Scales are never subnormal halves (they are clamped
//! to the smallest normal one, so a block of a very long row may reach a little beyond `amp`).
//!
//! Filling is parallel ([`fill_par`]) and deterministic for a given seed and thread split.

use ds4_engine::quant::GgmlType;
use half::f16;

use crate::par;

/// A small, fast PRNG (xorshift64*); not for anything but benchmark data.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed (0 is remapped, xorshift has no zero state).
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A float uniformly in `[-1, 1)`.
    #[inline]
    pub fn next_sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Fills `buf` with random bytes.
    pub fn fill_bytes(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let r = self.next_u64().to_le_bytes();
        let rem = chunks.into_remainder();
        let n = rem.len();
        rem.copy_from_slice(&r[..n]);
    }
}

/// The smallest block scale [`fill`] writes: the smallest normal f16 (2^-14), rounded up one step.
const MIN_NORMAL_SCALE: f32 = 6.1095e-5;

/// Whether [`fill`] can produce valid data of this type.
pub fn supported(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q2K | GgmlType::Q4K | GgmlType::Iq2Xxs)
}

/// Byte offsets of the f16 scale fields inside one block, and the largest integer multiplier a dequantized value
/// can reach per unit of that scale (so `scale = amp / multiplier`).
fn scale_fields(ty: GgmlType) -> &'static [(usize, f32)] {
    match ty {
        // x = d * q, q in [-128, 127]
        GgmlType::Q8_0 => &[(0, 128.0)],
        // x = d * sc(0..15) * q(0..3) - dmin * m(0..15)
        GgmlType::Q2K => &[(80, 45.0), (82, 15.0)],
        // x = d * sc(0..63) * q(0..15) - dmin * m(0..63)
        GgmlType::Q4K => &[(0, 945.0), (2, 63.0)],
        // x = d * (0.5 + ls(0..15)) / 4 * grid(<= 43), signed
        GgmlType::Iq2Xxs => &[(0, 167.0)],
        _ => &[],
    }
}

/// Fills `buf` (a whole number of `ty` blocks) with random valid data of magnitude about `amp`.
///
/// Panics if `ty` is not [`supported`] or `buf.len()` is not a multiple of the block size; both are programming
/// errors of the caller (the benchmark picks its types and sizes).
pub fn fill(ty: GgmlType, buf: &mut [u8], amp: f32, rng: &mut SplitMix64) {
    assert!(supported(ty), "blocks::fill: unsupported type {ty}");
    let bb = ty.block_bytes();
    assert_eq!(buf.len() % bb, 0, "blocks::fill: {} bytes is not whole {ty} blocks", buf.len());
    match ty {
        GgmlType::F16 => {
            let table: Vec<[u8; 2]> = (0..4096).map(|_| f16::from_f32(rng.next_sym() * amp).to_le_bytes()).collect();
            let mut chunks = buf.chunks_exact_mut(8);
            for c in &mut chunks {
                let r = rng.next_u64();
                for (i, v) in c.chunks_exact_mut(2).enumerate() {
                    v.copy_from_slice(&table[((r >> (i * 16)) & 4095) as usize]);
                }
            }
            for v in chunks.into_remainder().chunks_exact_mut(2) {
                v.copy_from_slice(&table[(rng.next_u64() & 4095) as usize]);
            }
        }
        GgmlType::F32 => {
            for v in buf.chunks_exact_mut(4) {
                v.copy_from_slice(&(rng.next_sym() * amp).to_le_bytes());
            }
        }
        _ => {
            rng.fill_bytes(buf);
            let fields = scale_fields(ty);
            for block in buf.chunks_exact_mut(bb) {
                let r = rng.next_u64();
                for (k, &(off, mult)) in fields.iter().enumerate() {
                    // A scale in [0.5, 1.0) * amp / mult, so blocks differ but none is degenerate.
                    // Never below the smallest normal half: real checkpoints' scales are normal, and a subnormal
                    // one costs some engines a denormal assist per block (benches/results/2026-12-01.md), which would make a
                    // written file unfair to them.
                    let frac = 0.5 + ((r >> (k * 16)) & 0xffff) as f32 / 131072.0;
                    let d = f16::from_f32((frac * amp / mult).max(MIN_NORMAL_SCALE));
                    block[off..off + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
        }
    }
}

/// [`fill`] split across `threads` threads at block boundaries; thread `i` uses seed `seed + i`.
pub fn fill_par(ty: GgmlType, buf: &mut [u8], amp: f32, seed: u64, threads: usize) {
    let bb = ty.block_bytes();
    // Split at block boundaries in chunks of at least 1 MiB so threads are worth starting.
    let align = bb * (1usize << 20).div_ceil(bb);
    let ranges = par::split(buf.len(), threads, align);
    std::thread::scope(|s| {
        let mut rest = &mut *buf;
        let mut consumed = 0usize;
        for (i, r) in ranges.iter().enumerate() {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(r.end - consumed);
            rest = tail;
            consumed = r.end;
            s.spawn(move || fill(ty, part, amp, &mut SplitMix64::new(seed.wrapping_add(i as u64))));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_at(b: &[u8], off: usize) -> f32 {
        f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
    }

    #[test]
    fn scale_fields_are_finite_and_bounded() {
        let mut rng = SplitMix64::new(7);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
            let mut buf = vec![0u8; ty.block_bytes() * 50];
            fill(ty, &mut buf, 0.5, &mut rng);
            for block in buf.chunks_exact(ty.block_bytes()) {
                for &(off, mult) in scale_fields(ty) {
                    let d = f16_at(block, off);
                    assert!(d.is_finite() && d > 0.0, "{ty}: scale {d}");
                    assert!(d * mult <= 0.5 * 1.01, "{ty}: scale {d} too large");
                    assert!(d * mult >= 0.5 * 0.49, "{ty}: scale {d} too small");
                }
            }
        }
    }

    #[test]
    fn tiny_amplitudes_still_give_normal_scales() {
        // amp / multiplier far below f16's normal range: every scale is clamped to a normal half.
        let mut rng = SplitMix64::new(3);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
            let mut buf = vec![0u8; ty.block_bytes() * 64];
            fill(ty, &mut buf, 1e-4, &mut rng);
            for block in buf.chunks_exact(ty.block_bytes()) {
                for &(off, _) in scale_fields(ty) {
                    let d = f16::from_le_bytes([block[off], block[off + 1]]);
                    assert!(d.is_normal() && d.to_f32() >= 6.1e-5, "{ty}: scale {d} is subnormal");
                }
            }
        }
    }

    #[test]
    fn float_types_stay_within_amp() {
        let mut rng = SplitMix64::new(1);
        let mut buf = vec![0u8; 2 * 1001];
        fill(GgmlType::F16, &mut buf, 0.25, &mut rng);
        let v: Vec<f32> = buf.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
        assert!(v.iter().all(|x| x.is_finite() && x.abs() <= 0.2502));
        assert!(v.iter().any(|x| *x != v[0]), "values must vary");
        let mut buf = vec![0u8; 4 * 99];
        fill(GgmlType::F32, &mut buf, 2.0, &mut rng);
        assert!(buf.chunks_exact(4).all(|c| f32::from_le_bytes(c.try_into().unwrap()).abs() <= 2.0));
    }

    #[test]
    fn parallel_fill_is_deterministic_and_covers_everything() {
        let ty = GgmlType::Q2K;
        let n = ty.block_bytes() * 30_000;
        let mut a = vec![0u8; n];
        let mut b = vec![0u8; n];
        fill_par(ty, &mut a, 1.0, 42, 3);
        fill_par(ty, &mut b, 1.0, 42, 3);
        assert_eq!(a, b);
        // The last block was written (its d field is a positive finite f16).
        let last = &a[n - ty.block_bytes()..];
        assert!(f16_at(last, 80) > 0.0);
    }

    #[test]
    fn rng_covers_the_symmetric_interval() {
        let mut r = SplitMix64::new(0);
        let xs: Vec<f32> = (0..10_000).map(|_| r.next_sym()).collect();
        assert!(xs.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(xs.iter().any(|&x| x < -0.9) && xs.iter().any(|&x| x > 0.9));
    }
}
