//! AVX-512 IQ2_XXS · Q8_K *pair* kernel: no gathers, grid looked up in registers, activations in the pair layout
//! (`ActType::Q8KPairs`, see `quant::act`). Needs GFNI on top of `avx512`'s F/BW/VBMI/VNNI (Ice Lake and later);
//! resolved at runtime through [`super::avx512::dot_q`], which prefers it, and [`crate::quant::act_type`] asks for
//! the pair layout exactly where it is [`available`].
//!
//! Soundness: the `#[target_feature]` function is only reachable through the plain `fn` wrapper that
//! `avx512::dot_q` hands out after [`available`] confirmed its features; every load reads inside a pair (or block)
//! slice produced by `chunks_exact`, or a 64-byte table constant.
//!
//! Two blocks (512 values, 64 octets of 8 values) at a time, *value-major*: vector `j` holds value `j` of each of
//! the 64 octets, so one byte lane follows one octet through all 8 values and a `vpdpbusd` lane (4 bytes = the 4
//! octets of a group) accumulates one group over the whole pair. Byte `8g + l` is octet `l % 4` of group `g` of
//! block `l / 4`: exactly where the weights keep grid indices, so no byte shuffle gathers them. Per pair:
//! - grid indices: block 0's group bytes with block 1's index dwords shifted into the aux halves (`vpsllq` and a
//!   blend); aux words: dword `2g + h` = group `g` of block `h` (`vpsrlq` and a blend), which is also the i32 lane
//!   of that group; sign indices are pulled out by `vpmultishiftqb` and completed with their parity bit by one
//!   `gf2p8affineqb` (bits 0..7 of `KSIGNS_IQ2XS[k]` are `k` and the XOR of its bits, a linear map over GF(2));
//! - per value `j`: a 64-byte table `T_j` packs the level (0, 1, 2 for 8, 25, 43) of value `j` of 4 grid points
//!   per byte; `vpermb` by `index >> 2` fetches the byte, `vpmultishiftqb` by `2·(index & 3)` moves the level to
//!   bits 0..2, and `gf2p8affineqb` maps it to the magnitude (`8 ⊕ 17·b0 ⊕ 35·b1` is exactly 8, 25, 43 for
//!   levels 0, 1, 2: affine over GF(2)); `vptestmb` on bit `j` of the sign bytes is the k-mask under which
//!   `vpsubb` negates the activations (Q8_K quants are never -128: no wrap); `vpdpbusd` accumulates
//!   (|lane| ≤ 32·43·127 < 2^18);
//! - per group lane, `vpmulld` by `2·scale + 1`, exact conversion to f32, times `d_w·d_a/8` of its block.
//!
//! A row's last block, when the block count is odd, is plain Q8_K and goes through the gather kernel.
//! Only the f32 accumulation order differs from the scalar reference.
//!
//! Measured (one core of this project's Sapphire-Rapids-class VM, 4.1 GHz): 46.6 G weights/s with cache-resident
//! weights (~22.5 cycles per block) vs 29.2 G/s for the gather kernel; streamed from memory 9.0 vs 6.5 GB/s
//! (`quant::simd::bench`; `benches/README.md` has the port measurements behind the numbers below). What bounds it: ports 0 and 5 (every 512-bit op issues there; `vpermb`, `vpermt2b`,
//! `vpmultishiftqb`, `vptestmb` only on port 5, `gf2p8affineqb`, `vpmovb2m` and shifts only on port 0), about
//! 1.7 such uops retire per cycle in practice. Tried and slower on this machine: octet-major layouts with the
//! gather (33 cycles per block: a `vpgatherqq` costs ~4 cycles of its unit plus ~4 port-0/5 uops) or with
//! 16-bit level codes looked up by `vpermt2b` (35); signs by `vpshufbitqmb` (2 uops: ports 0 and 5); sign
//! masks by shift + `vpmovb2m` on port 0 instead of `vptestmb` (slower: port 0 is the busier one); signs as
//! byte masks applied by xor/sub.

use std::arch::x86_64::*;

use super::super::api::DotQ;
use super::super::iq2_tables::IQ2XXS_GRID;
use super::super::{iq2_xxs, q8_k};
use super::avx2::prefetch_ahead;
use super::avx512::{ld, ld64, A64};

/// What the pair kernel needs beyond `avx512::available()`.
pub(crate) fn available() -> bool {
    super::avx512::available() && is_x86_feature_detected!("gfni")
}

/// The pair kernel (activations in `ActType::Q8KPairs`), where this CPU has the features.
pub(super) fn dot_q() -> Option<DotQ> {
    available().then_some(iq2_xxs_q8k_pairs as DotQ)
}

fn iq2_xxs_q8k_pairs(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: only handed out by `dot_q` after `available()` confirmed the features `imp` needs.
    unsafe { imp(w, a) }
}

/// Level index (0, 1, 2) of a grid magnitude (8, 25, 43).
const fn level(m: u64) -> u8 {
    match m {
        8 => 0,
        25 => 1,
        _ => 2,
    }
}

/// `T_j`: byte `b`, bits `2e..2e+2` = the level of value `j` of grid point `4b + e`.
const fn level_table(j: usize) -> A64 {
    let mut t = [0u8; 64];
    let mut b = 0;
    while b < 64 {
        let mut e = 0;
        while e < 4 {
            t[b] |= level((IQ2XXS_GRID[4 * b + e] >> (8 * j)) & 0xff) << (2 * e);
            e += 1;
        }
        b += 1;
    }
    A64(t)
}

const LEVELS: [A64; 8] = [
    level_table(0),
    level_table(1),
    level_table(2),
    level_table(3),
    level_table(4),
    level_table(5),
    level_table(6),
    level_table(7),
];

/// `vpmultishiftqb` over the aux words: byte `p = 8g + l` = bits `7(l % 4)..+8` of the aux word of group `g` of
/// block `l / 4`, the low (block 0) or high (block 1) dword of qword `g`.
const SIGN_CTRL: A64 = bytes64!(|p| (32 * (p % 8 / 4) + 7 * (p % 4)) as u8);

/// Bit offset of byte `p` inside its qword (`vpmultishiftqb` control base for the level fields).
const BYTE_POS: A64 = bytes64!(|p| (8 * (p % 8)) as u8);

/// A `gf2p8affineqb` matrix (one qword): byte `7 - i` is the row (input-bit mask) of output bit `i`.
const fn matrix(rows: [u8; 8]) -> i64 {
    let mut m = 0u64;
    let mut i = 0;
    while i < 8 {
        m |= (rows[i] as u64) << (8 * (7 - i));
        i += 1;
    }
    m as i64
}

/// Bits 0..7 copied, bit 7 = parity of bits 0..7: a 7-bit sign index → its `KSIGNS_IQ2XS` pattern.
const KSIGNS_M: i64 = matrix([1, 2, 4, 8, 16, 32, 64, 0x7f]);

/// Level bits (b0, b1) → magnitude ⊕ 8 (the constant 8 is the instruction's immediate): b0 contributes
/// `25 ⊕ 8`, b1 `43 ⊕ 8`.
const MAGNITUDE_M: i64 = {
    let (c0, c1) = (25u8 ^ 8, 43u8 ^ 8);
    let mut r = [0u8; 8];
    let mut i = 0;
    while i < 8 {
        r[i] = ((c0 >> i) & 1) | (((c1 >> i) & 1) << 1);
        i += 1;
    }
    matrix(r)
};

/// Index → `2·(index & 3)`: the bit offset of its level inside the `T_j` byte.
const FIELD_M: i64 = matrix([0, 1, 2, 0, 0, 0, 0, 0]);

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,gfni,avx2,fma,f16c")]
fn imp(w: &[u8], a: &[u8]) -> f32 {
    const WB: usize = iq2_xxs::BLOCK_BYTES;
    const AB: usize = q8_k::BLOCK_BYTES;
    let levels = LEVELS.each_ref().map(|t| ld64(t));
    let (sign_ctrl, byte_pos) = (ld64(&SIGN_CTRL), ld64(&BYTE_POS));
    let (ksigns_m, magnitude_m, field_m) =
        (_mm512_set1_epi64(KSIGNS_M), _mm512_set1_epi64(MAGNITUDE_M), _mm512_set1_epi64(FIELD_M));
    let one = _mm512_set1_epi32(1);
    let zero = _mm512_setzero_si512();
    let mut acc = _mm512_setzero_ps();
    let pairs = (w.len() / WB).min(a.len() / AB) / 2;
    for (b, qa) in w.chunks_exact(2 * WB).zip(a.chunks_exact(2 * AB)).take(pairs) {
        let (bp, ap) = (b.as_ptr(), qa.as_ptr());
        prefetch_ahead::<4>(bp);
        // SAFETY: each block's 8 groups are its bytes 2..66; the pair slice holds both blocks.
        let (g0, g1) = unsafe { (ld(bp.add(2)), ld(bp.add(WB + 2))) };
        let idx = _mm512_mask_blend_epi8(0xf0f0_f0f0_f0f0_f0f0, g0, _mm512_slli_epi64::<32>(g1));
        let aux = _mm512_mask_blend_epi32(0xaaaa, _mm512_srli_epi64::<32>(g0), g1);
        let signs = _mm512_gf2p8affine_epi64_epi8::<0>(_mm512_multishift_epi64_epi8(sign_ctrl, aux), ksigns_m);
        // Bits 0..6 of `idx >> 2` pick the `T_j` byte (`vpermb` ignores the two bits shifted in from the next
        // byte); `field` is the level's bit offset in qword terms for `vpmultishiftqb`.
        let quad = _mm512_srli_epi16::<2>(idx);
        let field = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8::<0>(idx, field_m), byte_pos);
        let mut sums = [zero; 2];
        for (j, t) in levels.iter().enumerate() {
            let packed = _mm512_permutexvar_epi8(quad, *t);
            let mag = _mm512_gf2p8affine_epi64_epi8::<8>(_mm512_multishift_epi64_epi8(field, packed), magnitude_m);
            let neg = _mm512_test_epi8_mask(signs, _mm512_set1_epi8((1u8 << j) as i8));
            // SAFETY: vector `j` is 64 bytes at `q8_k::pair_vector(j)` ≤ 292 + 4 + 192, inside the 584-byte pair.
            let q = unsafe { ld(ap.add(q8_k::pair_vector(j))) };
            sums[j % 2] = _mm512_dpbusd_epi32(sums[j % 2], mag, _mm512_mask_sub_epi8(q, neg, zero, q));
        }
        // 2·scale + 1 per group: bits 27..32 of the aux word are scale·2 + (a sign bit), so | 1.
        let scale = _mm512_or_si512(_mm512_srli_epi32::<27>(aux), one);
        let sumi = _mm512_mullo_epi32(_mm512_add_epi32(sums[0], sums[1]), scale);
        // SAFETY: the f16 scales are bytes 0..2 of each block, the f32 scales bytes 0..4 of each Q8_K block.
        let (dw0, dw1, da0, da1) = unsafe {
            (
                std::ptr::read_unaligned(bp as *const i16).to_le(),
                std::ptr::read_unaligned(bp.add(WB) as *const i16).to_le(),
                f32::from_bits(std::ptr::read_unaligned(ap as *const u32).to_le()),
                f32::from_bits(std::ptr::read_unaligned(ap.add(AB) as *const u32).to_le()),
            )
        };
        // Even lanes are block 0's groups, odd lanes block 1's: d_w (exact f16 conversion) times d_a/8.
        let dw = _mm512_cvtph_ps(_mm256_set1_epi32((dw0 as u16 as u32 | (dw1 as u16 as u32) << 16) as i32));
        let da = _mm512_mask_blend_ps(0xaaaa, _mm512_set1_ps(da0 * 0.125), _mm512_set1_ps(da1 * 0.125));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(dw, da), acc);
    }
    let mut total = _mm512_reduce_add_ps(acc);
    let (wt, at) = (2 * pairs * WB, 2 * pairs * AB);
    if w.len() >= wt + WB && a.len() >= at + AB {
        total += super::avx512::iq2_xxs_q8_k_imp(&w[wt..wt + WB], &a[at..at + AB]);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::super::test_blocks::{iq2_biggest_point, iq2_every_point_blocks, iq2_uniform_blocks, mass, q8k_blocks};
    use super::*;
    use crate::quant::iq2_tables::KSIGNS_IQ2XS;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn kernel() -> Option<DotQ> {
        let k = dot_q();
        if k.is_none() {
            eprintln!("no AVX-512 VBMI/VNNI + GFNI on this CPU: the pair kernel is never selected, nothing to test");
        }
        k
    }

    /// Plain Q8_K blocks → the pair layout the kernel reads.
    fn pairs(plain: &[u8]) -> Vec<u8> {
        let mut a = plain.to_vec();
        q8_k::to_pairs(&mut a);
        a
    }

    /// Random IQ2_XXS blocks with finite f16 scales of either sign.
    fn weights(rng: &mut StdRng, n: usize) -> Vec<u8> {
        let mut w = vec![0u8; n * iq2_xxs::BLOCK_BYTES];
        rng.fill(&mut w[..]);
        for b in w.chunks_exact_mut(iq2_xxs::BLOCK_BYTES) {
            b[..2].copy_from_slice(&half::f16::from_f32(rng.gen_range(-4.0f32..4.0)).to_le_bytes());
        }
        w
    }

    /// The tables encode what the docs say: levels reproduce the grid, the GF(2) maps reproduce KSIGNS and the
    /// magnitudes, for every input the kernel can feed them.
    #[test]
    fn tables_and_matrices_reproduce_the_grid_and_signs() {
        let affine = |x: u8, m: i64, b: u8| -> u8 {
            let m = m as u64;
            (0..8).fold(b, |y, i| y ^ ((((m >> (8 * (7 - i))) as u8 & x).count_ones() as u8 & 1) << i))
        };
        for (g, point) in IQ2XXS_GRID.iter().enumerate() {
            for (j, t) in LEVELS.iter().enumerate() {
                let lv = (t.0[g / 4] >> (2 * (g % 4))) & 3;
                let mag = affine(lv | 0b1111_1100 & (g as u8).wrapping_mul(37), MAGNITUDE_M, 8);
                assert_eq!(mag as u64, (point >> (8 * j)) & 0xff, "grid point {g}, value {j}");
            }
            assert_eq!(affine(g as u8, FIELD_M, 0), 2 * (g as u8 & 3));
        }
        for k in 0..256usize {
            assert_eq!(affine(k as u8, KSIGNS_M, 0), KSIGNS_IQ2XS[k & 127], "sign index byte {k:#x}");
        }
    }

    #[test]
    fn random_blocks_match_scalar() {
        let Some(k) = kernel() else { return };
        let mut rng = StdRng::seed_from_u64(5);
        for n in [1usize, 2, 3, 4, 5, 8, 15, 16, 17] {
            for _ in 0..8 {
                let w = weights(&mut rng, n);
                let plain = q8k_blocks(n, rng.gen_range(1e-3f32..1.0), |_| rng.gen_range(-127i8..=127));
                let a = pairs(&plain);
                let (got, want) = (k(&w, &a), iq2_xxs::dot_q8k(&w, &plain));
                assert_eq!(iq2_xxs::dot_q8k_pairs(&w, &a), want, "scalar pair dot, {n} blocks");
                let tol = 1e-6 * mass(&w, &plain, iq2_xxs::BLOCK_BYTES, iq2_xxs::dequantize_block) + 1e-30;
                assert!((got as f64 - want as f64).abs() <= tol, "{n} blocks: pairs {got}, scalar {want}, tol {tol:e}");
            }
        }
    }

    /// Unit scales and integer activations keep every intermediate exact: bit-for-bit agreement, including the
    /// largest magnitudes, all-negative signs and the largest group scale.
    #[test]
    fn extremes_are_exact() {
        let Some(k) = kernel() else { return };
        let (big, _) = iq2_biggest_point();
        for (signs, scale, act) in [(127u32, 15u32, 127i8), (127, 15, -127), (0, 15, 127), (0, 0, -127)] {
            let w = iq2_uniform_blocks(4, big, signs, scale);
            let plain = q8k_blocks(4, 1.0, |_| act);
            let want = iq2_xxs::dot_q8k(&w, &plain);
            assert_eq!(k(&w, &pairs(&plain)), want, "signs {signs} scale {scale} act {act}");
        }
        // Every grid point at every octet position, mixed signs, integer activations, unit scales.
        let w = iq2_every_point_blocks(&mut StdRng::seed_from_u64(13));
        let plain = q8k_blocks(8, 1.0, |i| if i % 3 == 0 { -127 } else { 127 });
        assert_eq!(k(&w, &pairs(&plain)), iq2_xxs::dot_q8k(&w, &plain));
    }

    #[test]
    fn uses_only_whole_blocks() {
        let Some(k) = kernel() else { return };
        let mut rng = StdRng::seed_from_u64(3);
        let w = weights(&mut rng, 5);
        let plain = q8k_blocks(5, 0.01, |_| rng.gen_range(-127i8..=127));
        let a = pairs(&plain);
        let four = k(&w[..4 * iq2_xxs::BLOCK_BYTES], &a);
        assert_eq!(k(&w[..5 * iq2_xxs::BLOCK_BYTES - 1], &a), four);
        assert_eq!(k(&w, &a[..5 * q8_k::BLOCK_BYTES - 1]), four);
        assert_eq!(k(&w[..0], &a), 0.0);
    }
}
