//! AVX-512 kernels (x86-64 with AVX-512 F/BW/VBMI/VNNI, e.g. Ice Lake and later), resolved at runtime.
//! Only the formats where they beat AVX2 are here (IQ2_XXS below, Q2_K in `avx512_q2k`); [`super::dot_q`] falls
//! back to AVX2 for the rest. For IQ2_XXS, [`super::dot_q`] prefers the faster pair kernel of `avx512_iq2` (GFNI, pair
//! layout activations); the gather kernel below serves CPUs without GFNI, and the pair kernel's odd last block.
//!
//! Soundness: as in `avx2`, every `#[target_feature]` function is reachable only through the plain `fn` wrappers
//! that [`iq2_xxs_gather`] hands out after [`available`] confirmed every feature they are compiled for; every vector load
//! reads inside a block slice produced by `chunks_exact`, and the gathers read `IQ2XXS_GRID` at byte indices.
//!
//! IQ2_XXS · Q8_K, per 256-value block (4 chunks of 64 values = 2 groups = 8 octets each):
//! - The 8 groups (one u64 each: 4 grid indices, then 4×7 sign bits and the 4-bit scale) are one 64-byte load.
//! - Per chunk, a `vpermb` zero-extends the chunk's 8 grid indices into qwords and `vpgatherqq` fetches the 8
//!   grid octets (64 magnitude bytes) from `IQ2XXS_GRID` at once: no scalar loads, no inserts.
//! - Signs: per block, `vpmultishiftqb` pulls the 32 seven-bit sign indices into bytes and one `vpermi2b` maps
//!   them through `KSIGNS_IQ2XS` (adding the parity bit); per chunk, a `vpermb` spreads each octet's sign byte
//!   over its 8 bytes and `vptestmb` against one-hot bytes turns that into the chunk's 64-bit k-mask, under which
//!   `vpsubb` negates the activations. Q8_K quants are in -127..=127 (never -128; see `q8_k`), so the negation
//!   cannot wrap.
//! - `vpdpbusd` (unsigned magnitudes × signed activations) gives i32 lanes of 4 products (|·| ≤ 4·43·127 < 2^15),
//!   and `vpdpwssd` multiplies each lane by its group's `2·scale + 1` (the lane's high half is its sign extension,
//!   paired with a zero). Per block the i32 lanes (< 2^22) are converted exactly to f32 and scaled by
//!   `d_w·d_a/8`; only that f32 accumulation differs in order from the scalar reference.
//!
//! The gathers are the kernel's cost (distinct grid entries per block cost more than repeating ones); the
//! variants that avoided them on this layout were no faster (the `avx512_iq2` pair layout is what removed them).
//!
//! Superseded where GFNI is present: an IQ2_XXS-specific activation layout lets `avx512_iq2` drop the gathers.

use std::arch::x86_64::*;

use super::super::api::DotQ;
use super::super::iq2_tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::super::{iq2_xxs, q8_k};
use super::x86::{ld, ld64, prefetch_ahead, A64};

/// AVX-512 F/BW/VBMI/VNNI, plus what `avx2` needs (the scalar f16 helper and prefetch are shared).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vbmi")
        && is_x86_feature_detected!("avx512vnni")
        && super::avx2::available()
}

fn iq2_xxs_q8_k(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: only handed out by `iq2_xxs_gather` after `available()` confirmed the features `iq2_xxs_q8_k_imp` needs.
    unsafe { iq2_xxs_q8_k_imp(w, a) }
}

/// The gather kernel for IQ2_XXS (plain Q8_K activations), for side-by-side benchmarks; `dot_q` prefers the pair
/// kernel of `avx512_iq2` where GFNI is present.
pub(super) fn iq2_xxs_gather() -> Option<DotQ> {
    available().then_some(iq2_xxs_q8_k as DotQ)
}

/// Per-chunk constants: `$f` (an expression in `c` and `i`) gives byte `i` of chunk `c`'s vector.
macro_rules! per_chunk {
    (|$c:ident, $i:ident| $f:expr) => {{
        let mut t = [A64([0u8; 64]), A64([0u8; 64]), A64([0u8; 64]), A64([0u8; 64])];
        let mut $c = 0;
        while $c < 4 {
            let mut $i = 0;
            while $i < 64 {
                t[$c].0[$i] = $f;
                $i += 1;
            }
            $c += 1;
        }
        t
    }};
}

/// Qword `o` of chunk `c` is octet `o % 4` of group `2c + o / 4`; its grid index is byte `8g + l` of the groups.
const fn octet_byte(c: usize, o: usize) -> usize {
    8 * (2 * c + o / 4) + o % 4
}

/// `vpermb` indices putting chunk `c`'s grid indices in byte 0 of each qword (the other bytes are zeroed by the
/// mask `0x0101…`).
const GATHER_IDX: [A64; 4] = per_chunk!(|c, i| octet_byte(c, i / 8) as u8);

/// `vpmultishiftqb` control putting sign index `l` of group `g` (bits `32 + 7l` of its u64) in byte `8g + 4 + l`,
/// over the group's own sign/scale bytes (bytes 0..4 pick anything; unused).
const SIGN_CTRL: A64 = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        if i % 8 >= 4 {
            t[i] = 32 + 7 * (i % 8 - 4) as u8;
        }
        i += 1;
    }
    A64(t)
};

/// `vpermb` indices copying the sign byte of octet `o` (byte `octet_byte + 4` after the sign lookup) to all 8
/// bytes of qword `o`.
const SIGN_SPREAD: [A64; 4] = per_chunk!(|c, i| (octet_byte(c, i / 8) + 4) as u8);

/// Byte `j` of every qword is `1 << j`: tests sign bit `j` of the spread sign byte.
const ONE_HOT: A64 = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = 1 << (i % 8);
        i += 1;
    }
    A64(t)
};

/// `vpermd` indices spreading the per-group scales (low dword of qword `g`) over the 16 i32 lanes of chunk `c`:
/// lanes 0..8 ← group `2c`, lanes 8..16 ← group `2c + 1` (only byte 0 of each dword is non-zero).
const SCALE_IDX: [A64; 4] = per_chunk!(|c, i| if i % 4 == 0 { (2 * (2 * c + i / 32)) as u8 } else { 0 });

/// `acc + Σ pairs of i16 products` per i32 lane (`vpdpwssd`, no saturation). Through the intrinsic, LLVM's
/// generic x86-64 tuning splits it into `vpmaddwd` + `vpaddd` (one more uop).
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut r = acc;
    // SAFETY: a register-only VNNI instruction; the features are enabled for this function.
    unsafe {
        std::arch::asm!("vpdpwssd {r}, {a}, {b}", r = inout(zmm_reg) r, a = in(zmm_reg) a, b = in(zmm_reg) b,
            options(pure, nomem, nostack))
    };
    r
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma,f16c")]
pub(super) fn iq2_xxs_q8_k_imp(w: &[u8], a: &[u8]) -> f32 {
    let [ks0, ks1] = [0, 1].map(|k| {
        let t = &KSIGNS_IQ2XS[64 * k..64 * k + 64];
        // SAFETY: `t` is 64 readable bytes.
        unsafe { ld(t.as_ptr()) }
    });
    let sign_ctrl = ld64(&SIGN_CTRL);
    let one_hot = ld64(&ONE_HOT);
    let gather_idx = [0, 1, 2, 3].map(|c| ld64(&GATHER_IDX[c]));
    let sign_spread = [0, 1, 2, 3].map(|c| ld64(&SIGN_SPREAD[c]));
    let scale_idx = [0, 1, 2, 3].map(|c| ld64(&SCALE_IDX[c]));
    let one = _mm512_set1_epi64(1);
    let eighth = _mm512_set1_ps(0.125);
    let zero = _mm512_setzero_si512();
    let grid = IQ2XXS_GRID.as_ptr() as *const i64;
    let mut acc = _mm512_setzero_ps();
    for (b, qa) in w.chunks_exact(iq2_xxs::BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let (bp, ap) = (b.as_ptr(), qa.as_ptr());
        prefetch_ahead::<2>(bp);
        // SAFETY: the 8 groups are bytes 2..66 of the 66-byte block.
        let groups = unsafe { ld(bp.add(2)) };
        let signs = _mm512_permutex2var_epi8(ks0, _mm512_multishift_epi64_epi8(sign_ctrl, groups), ks1);
        // 2·scale + 1 in the low dword of each group's qword: bits 59..64 are scale·2 + (a sign bit), so | 1.
        let scales = _mm512_or_si512(_mm512_srli_epi64::<59>(groups), one);
        let mut sumi = zero;
        for c in 0..4 {
            let idx = _mm512_maskz_permutexvar_epi8(0x0101_0101_0101_0101, gather_idx[c], groups);
            // SAFETY: every index is one byte, inside the 256-entry grid table.
            let mag = unsafe { _mm512_i64gather_epi64::<8>(idx, grid) };
            let neg = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(sign_spread[c], signs), one_hot);
            // SAFETY: 64 Q8_K quants at 4 + 64c ≤ 196, inside the 292-byte block.
            let q = unsafe { ld(ap.add(4 + 64 * c)) };
            let dot = _mm512_dpbusd_epi32(zero, mag, _mm512_mask_sub_epi8(q, neg, zero, q));
            sumi = dpwssd(sumi, dot, _mm512_permutexvar_epi32(scale_idx[c], scales));
        }
        // d_w·d_a/8 in the scalar code's order, broadcast: the f16 converts exactly (`vcvtph2ps`); cheaper than the
        // scalar conversion plus a broadcast (measured ~3%).
        // SAFETY: the f16 scale is bytes 0..2 of the weight block, the f32 scale bytes 0..4 of the Q8_K block.
        let (dw, da) = unsafe {
            (
                std::ptr::read_unaligned(bp as *const i16).to_le(),
                f32::from_bits(std::ptr::read_unaligned(ap as *const u32).to_le()),
            )
        };
        let d = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm256_set1_epi16(dw)), _mm512_set1_ps(da)), eighth);
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc);
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(test)]
mod tests {
    use super::super::test_blocks::{iq2_biggest_point, iq2_every_point_blocks, iq2_uniform_blocks, mass, q8k_blocks};
    use super::*;
    use crate::quant::GgmlType;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// `None` (with a note) where this CPU lacks the features: the kernel is then never selected.
    fn kernel(ty: GgmlType) -> Option<DotQ> {
        let k = if ty == GgmlType::Iq2Xxs { iq2_xxs_gather() } else { None };
        if k.is_none() {
            eprintln!("no AVX-512 VBMI/VNNI on this CPU: the avx512 kernels are not selected, nothing to test");
        }
        k
    }

    /// Integer partial sums are exact in both kernels; only the f32 accumulation order differs (the scalar code
    /// adds one product per block, this kernel 16 lanes per block, then a tree). A few ulps of the summed
    /// magnitudes bounds that; 1e-6 relative is ~8 ulps.
    fn assert_matches_scalar(k: DotQ, w: &[u8], a: &[u8], what: &str) {
        let (got, want) = (k(w, a), iq2_xxs::dot_q8k(w, a));
        let tol = 1e-6 * mass(w, a, iq2_xxs::BLOCK_BYTES, iq2_xxs::dequantize_block) + 1e-30;
        assert!((got as f64 - want as f64).abs() <= tol, "{what}: avx512 {got}, scalar {want}, tol {tol:e}");
    }

    /// The bounds in the module docs: grid magnitudes are unsigned bytes ≤ 43, sign patterns carry their parity.
    #[test]
    fn tables_hold_what_the_kernel_assumes() {
        for (i, g) in IQ2XXS_GRID.iter().enumerate() {
            assert!(g.to_le_bytes().iter().all(|v| [8, 25, 43].contains(v)), "grid point {i}: {g:#018x}");
        }
        for (k, &s) in KSIGNS_IQ2XS.iter().enumerate() {
            assert_eq!((s & 0x7f, s.count_ones() % 2), (k as u8, 0), "sign index {k}");
        }
    }

    #[test]
    fn iq2_xxs_random_blocks_match_scalar() {
        let Some(k) = kernel(GgmlType::Iq2Xxs) else { return };
        let mut rng = StdRng::seed_from_u64(7);
        for n in [1usize, 2, 3, 5, 7, 16, 17, 28] {
            for _ in 0..8 {
                let mut w = vec![0u8; n * iq2_xxs::BLOCK_BYTES];
                rng.fill(&mut w[..]);
                for b in w.chunks_exact_mut(iq2_xxs::BLOCK_BYTES) {
                    // A finite f16 scale of either sign (exponent below 31).
                    let d = half::f16::from_f32(rng.gen_range(-4.0f32..4.0));
                    b[..2].copy_from_slice(&d.to_le_bytes());
                }
                let a = q8k_blocks(n, rng.gen_range(1e-3f32..1.0), |_| rng.gen_range(-127i8..=127));
                assert_matches_scalar(k, &w, &a, &format!("{n} blocks"));
            }
        }
    }

    /// Unit scales make every intermediate an exact binary fraction, so here the kernels must agree bit for bit.
    #[test]
    fn iq2_xxs_extremes_are_exact() {
        let Some(k) = kernel(GgmlType::Iq2Xxs) else { return };
        // The grid point with the largest magnitudes; sign index 127 negates all 8 values; scale 15 is the largest.
        let (big, big_sum) = iq2_biggest_point();
        for (signs, scale, act) in [(127u32, 15u32, 127i8), (127, 15, -127), (0, 15, 127), (0, 0, -127)] {
            let n = 3;
            let w = iq2_uniform_blocks(n, big, signs, scale);
            let a = q8k_blocks(n, 1.0, |_| act);
            let (got, want) = (k(&w, &a), iq2_xxs::dot_q8k(&w, &a));
            assert_eq!(got, want, "signs {signs} scale {scale} act {act}");
            let sign = if signs == 127 { -1 } else { 1 };
            let exact = sign * act as i32 * big_sum * 32 * (2 * scale as i32 + 1) * n as i32;
            assert_eq!(want, exact as f32 / 8.0);
        }
        // Mixed signs and every grid point, integer activations, unit scales.
        let w = iq2_every_point_blocks(&mut StdRng::seed_from_u64(11));
        let a = q8k_blocks(8, 1.0, |i| if i % 3 == 0 { -127 } else { 127 });
        assert_eq!(k(&w, &a), iq2_xxs::dot_q8k(&w, &a));
    }

    #[test]
    fn iq2_xxs_uses_only_whole_blocks() {
        let Some(k) = kernel(GgmlType::Iq2Xxs) else { return };
        let mut rng = StdRng::seed_from_u64(3);
        let mut w = vec![0u8; 4 * iq2_xxs::BLOCK_BYTES];
        rng.fill(&mut w[..]);
        for b in w.chunks_exact_mut(iq2_xxs::BLOCK_BYTES) {
            b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        }
        let a = q8k_blocks(4, 0.01, |_| rng.gen_range(-127i8..=127));
        let three = k(&w[..3 * iq2_xxs::BLOCK_BYTES], &a);
        assert_eq!(k(&w[..4 * iq2_xxs::BLOCK_BYTES - 1], &a), three);
        assert_eq!(k(&w, &a[..4 * q8_k::BLOCK_BYTES - 1]), three);
        assert_eq!(k(&w[..0], &a), 0.0);
    }
}
