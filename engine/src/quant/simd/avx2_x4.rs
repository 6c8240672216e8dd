//! Four-row AVX2 kernels: one weight row against four activation rows ([`crate::quant::DotQ4`]) for Q8_0, Q2_K and
//! IQ2_XXS, each the batched form of the AVX2 single-row kernel of its type (`avx2`), bit for bit.
//!
//! What is shared: the weight row is streamed (and prefetched) once, and everything decoded from a weight block
//! alone is computed once for the four rows — Q8_0's `|w|`, IQ2_XXS's grid octets, sign vectors and group scales
//! (the expensive part: eight table lookups and inserts per 32 weights), Q2_K's 2-bit planes, sub-block scale
//! vectors and minimums. What stays per row: the activation loads and the multiply-adds.
//!
//! Why the results are the single kernels' exactly: every integer partial sum is exact (the same operand ranges as
//! the single kernel, no saturation), and each row's float operations — the lane conversions, the products of the
//! block scales (`d_w · d_a` in the single kernel's order), the fused multiply-adds into the same number of
//! accumulators in the same block order, the final horizontal sums — are the single kernel's, only interleaved
//! with the other rows'. Rows of unequal length (never in the engine) fall back to four single calls.
//!
//! Soundness: as in `avx2`, the `#[target_feature]` functions are reached only through wrappers that
//! [`dot_q4`] hands out after `avx2::available()`; vector loads read inside whole blocks of slices whose block
//! counts were checked.

use std::arch::x86_64::*;

use super::super::api::DotQ4;
use super::super::iq2_tables::IQ2XXS_GRID;
use super::super::{iq2_xxs, q2_k, q8_0, q8_k, GgmlType};
use super::avx2::{Q2_SCALE_SHUF, SIGNS_PM1};
use super::x86::{f16_at, hsum_ps, ld_si256, prefetch_ahead};

/// The four-row kernel for `ty` where its single kernel is the AVX2 one (the caller checks that).
pub(super) fn dot_q4(ty: GgmlType) -> Option<DotQ4> {
    if !super::avx2::available() {
        return None;
    }
    Some(match ty {
        GgmlType::Q8_0 => q8_0_x4,
        GgmlType::Q2K => q2_k_x4,
        GgmlType::Iq2Xxs => iq2_xxs_x4,
        _ => return None,
    })
}

/// Whether all four rows hold exactly `n` whole blocks of `ab` bytes.
fn same_blocks(a: &[&[u8]; 4], ab: usize, n: usize) -> bool {
    a.iter().all(|r| r.len() / ab == n)
}

macro_rules! wrap4 {
    ($name:ident, $imp:ident, $single:ident, $wb:expr, $ab:expr) => {
        fn $name(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
            let n = w.len() / $wb;
            // SAFETY: handed out by `dot_q4` only after `avx2::available()` (AVX2, FMA, F16C), the features both
            // functions are compiled for; the four-row one gets rows of exactly `n` whole blocks.
            unsafe {
                if same_blocks(&a, $ab, n) {
                    $imp(w, a, n)
                } else {
                    a.map(|r| super::avx2::$single(w, r))
                }
            }
        }
    };
}
wrap4!(q8_0_x4, q8_0_x4_imp, q8_0_q8_0_imp, q8_0::BLOCK_BYTES, q8_0::BLOCK_BYTES);
wrap4!(q2_k_x4, q2_k_x4_imp, q2_k_q8_k_imp, q2_k::BLOCK_BYTES, q8_k::BLOCK_BYTES);
wrap4!(iq2_xxs_x4, iq2_xxs_x4_imp, iq2_xxs_q8_k_imp, iq2_xxs::BLOCK_BYTES, q8_k::BLOCK_BYTES);

/// Q8_0 · Q8_0, four rows (the single kernel: two accumulators, even blocks into the first).
///
/// # Safety
/// AVX2/FMA/F16C present; `w` and every `a[r]` hold at least `n` whole blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_x4_imp(w: &[u8], a: [&[u8]; 4], n: usize) -> [f32; 4] {
    const B: usize = q8_0::BLOCK_BYTES;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let wp = w.as_ptr();
    let mut j = 0;
    while j < n {
        let pair = j + 1 < n;
        if pair {
            prefetch_ahead::<2>(wp.wrapping_add(j * B));
        }
        for k in 0..if pair { 2 } else { 1 } {
            let off = (j + k) * B;
            // SAFETY: block `j + k < n` of the weight row; 32 bytes at offset 2.
            let qw = unsafe { ld_si256(wp.add(off + 2)) };
            let mag = _mm256_sign_epi8(qw, qw);
            // The four rows' scales converted together (F16C's conversion is exact, like `f16_at`), then
            // `d_w · d_a` per row: the single kernel's product, bit for bit.
            let h = |r: usize| u16::from_le_bytes([a[r][off], a[r][off + 1]]) as i16;
            let da = _mm_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), 0, 0, 0, 0));
            let d4 = _mm_mul_ps(_mm_set1_ps(f16_at(w, off)), da);
            let d = [
                _mm256_broadcastss_ps(d4),
                _mm256_broadcastss_ps(_mm_permute_ps::<0b01_01_01_01>(d4)),
                _mm256_broadcastss_ps(_mm_permute_ps::<0b10_10_10_10>(d4)),
                _mm256_broadcastss_ps(_mm_permute_ps::<0b11_11_11_11>(d4)),
            ];
            for r in 0..4 {
                // SAFETY: block `j + k < n` of row `r`.
                let qa = unsafe { ld_si256(a[r].as_ptr().add(off + 2)) };
                let p16 = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(qa, qw));
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[r][k] = _mm256_fmadd_ps(d[r], p, acc[r][k]);
            }
        }
        j += 2;
    }
    std::array::from_fn(|r| hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1])))
}

/// Q2_K · Q8_K, four rows.
///
/// # Safety
/// AVX2/FMA/F16C present; `w` holds `n` whole Q2_K blocks, every `a[r]` `n` whole Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2_k_x4_imp(w: &[u8], a: [&[u8]; 4], n: usize) -> [f32; 4] {
    const WB: usize = q2_k::BLOCK_BYTES;
    const AB: usize = q8_k::BLOCK_BYTES;
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0f);
    // SAFETY: each mask is a 32-byte array.
    let shuf: [__m256i; 8] = std::array::from_fn(|k| unsafe { ld_si256(Q2_SCALE_SHUF[k].as_ptr()) });
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut acc_min = [_mm256_setzero_ps(); 4];
    for i in 0..n {
        let b = &w[i * WB..(i + 1) * WB];
        let bp = b.as_ptr();
        prefetch_ahead::<2>(bp);
        // SAFETY: scales are bytes 0..16 of the 84-byte block.
        let sc8 = unsafe { _mm_loadu_si128(bp as *const __m128i) };
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc8), m4));
        let scales = _mm256_broadcastsi128_si256(_mm_and_si128(sc8, m4));
        let (dmin, d) = (f16_at(b, 82), f16_at(b, 80));
        // The eight 2-bit planes and their sub-block scale vectors, decoded once into L1 for the four rows.
        let mut planes = [_mm256_setzero_si256(); 8];
        let mut scv = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            // SAFETY: qs are bytes 16..80 of the 84-byte block (32 read at 16 + 32h ≤ 48).
            let q2 = unsafe { ld_si256(bp.add(16 + 32 * h)) };
            planes[4 * h] = _mm256_and_si256(q2, m3);
            planes[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16::<2>(q2), m3);
            planes[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16::<4>(q2), m3);
            planes[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16::<6>(q2), m3);
            for j in 0..4 {
                scv[4 * h + j] = _mm256_shuffle_epi8(scales, shuf[4 * h + j]);
            }
        }
        let mut sumi = [_mm256_setzero_si256(); 4];
        for r in 0..4 {
            let qa = &a[r][i * AB..(i + 1) * AB];
            // SAFETY: block sums are bytes 260..292 of the Q8_K block.
            let bsums = unsafe { ld_si256(qa.as_ptr().add(q8_k::BSUMS)) };
            let pm = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bsums));
            acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(q8_k::d(qa) * dmin), pm, acc_min[r]);
        }
        for r in 0..4 {
            let ap = a[r][i * AB..(i + 1) * AB].as_ptr();
            for k in 0..8 {
                // SAFETY: 32 Q8_K quants at 4 + 32k ≤ 228 inside the 292-byte block (plane k = sub-blocks 2k, 2k+1).
                let qa8 = unsafe { ld_si256(ap.add(4 + 32 * k)) };
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(planes[k], qa8), scv[k]));
            }
        }
        for r in 0..4 {
            let da = q8_k::d(&a[r][i * AB..(i + 1) * AB]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(da * d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_ps(acc[r]) - hsum_ps(acc_min[r]))
}

/// IQ2_XXS · Q8_K, four rows (the single kernel: two integer sums per block, even groups into the first).
///
/// # Safety
/// AVX2/FMA/F16C present; `w` holds `n` whole IQ2_XXS blocks, every `a[r]` `n` whole Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq2_xxs_x4_imp(w: &[u8], a: [&[u8]; 4], n: usize) -> [f32; 4] {
    const WB: usize = iq2_xxs::BLOCK_BYTES;
    const AB: usize = q8_k::BLOCK_BYTES;
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in 0..n {
        let b = &w[i * WB..(i + 1) * WB];
        let bp = b.as_ptr();
        prefetch_ahead::<2>(bp);
        let mut sumi = [[_mm256_setzero_si256(); 2]; 4];
        for g in 0..8 {
            // SAFETY: group g is 8 bytes at 2 + 8g ≤ 58 inside the 66-byte block.
            let q = unsafe { std::ptr::read_unaligned(bp.add(2 + 8 * g) as *const u64).to_le() };
            let aux = (q >> 32) as u32;
            let grid = _mm256_set_epi64x(
                IQ2XXS_GRID[(q >> 24) as u8 as usize] as i64,
                IQ2XXS_GRID[(q >> 16) as u8 as usize] as i64,
                IQ2XXS_GRID[(q >> 8) as u8 as usize] as i64,
                IQ2XXS_GRID[q as u8 as usize] as i64,
            );
            let signs = _mm256_set_epi64x(
                SIGNS_PM1[((aux >> 21) & 127) as usize] as i64,
                SIGNS_PM1[((aux >> 14) & 127) as usize] as i64,
                SIGNS_PM1[((aux >> 7) & 127) as usize] as i64,
                SIGNS_PM1[(aux & 127) as usize] as i64,
            );
            let scale = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
            for r in 0..4 {
                // SAFETY: group g's 32 Q8_K quants are at 4 + 32g ≤ 228 inside block `i` of row `r`.
                let qa8 = unsafe { ld_si256(a[r].as_ptr().add(i * AB + 4 + 32 * g)) };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(grid, _mm256_sign_epi8(qa8, signs)), scale);
                sumi[r][g % 2] = _mm256_add_epi32(sumi[r][g % 2], p);
            }
        }
        let dw = f16_at(b, 0);
        for r in 0..4 {
            let d = dw * q8_k::d(&a[r][i * AB..(i + 1) * AB]) * 0.125;
            let s = _mm256_cvtepi32_ps(_mm256_add_epi32(sumi[r][0], sumi[r][1]));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_ps(acc[r]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::act::plain_act_type as plain;
    use crate::quant::{quantize_acts, quantize_row};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Four rows at once give exactly four single AVX2 dots for every type: block counts odd and even, weight
    /// scales small and large, rows of unequal length.
    #[test]
    fn four_rows_match_four_single_dots_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(9);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Iq2Xxs] {
            let (Some(k4), Some(k)) = (dot_q4(ty), super::super::avx2::dot_q(ty)) else {
                eprintln!("no AVX2 here: nothing to test");
                return;
            };
            let bv = ty.block_values();
            for n in [1usize, 2, 3, 5, 8] {
                for scale in [1e-3f32, 1.0, 30.0] {
                    let x: Vec<f32> = (0..n * bv).map(|_| rng.gen_range(-1f32..1.0) * scale).collect();
                    let mut wr = vec![0u8; ty.row_bytes((n * bv) as u64).unwrap() as usize];
                    quantize_row(ty, &x, None, &mut wr).unwrap();
                    if ty == GgmlType::Q8_0 {
                        wr[2] = 0x80; // a -128 quant: files may hold them
                    }
                    let rows: Vec<Vec<u8>> = (0..4)
                        .map(|_| {
                            let v: Vec<f32> = (0..n * bv).map(|_| rng.gen_range(-3f32..3.0)).collect();
                            let mut q = Vec::new();
                            quantize_acts(plain(ty), &v, &mut q).unwrap();
                            q
                        })
                        .collect();
                    let got = k4(&wr, [&rows[0], &rows[1], &rows[2], &rows[3]]);
                    for (r, g) in rows.iter().zip(got) {
                        assert_eq!(g.to_bits(), k(&wr, r).to_bits(), "{ty} {n} blocks, scale {scale}");
                    }
                    let short = &rows[3][..rows[3].len() / 2];
                    let got = k4(&wr, [&rows[0], &rows[1], &rows[2], short]);
                    for (r, g) in [&rows[0][..], &rows[1], &rows[2], short].iter().zip(got) {
                        assert_eq!(g.to_bits(), k(&wr, r).to_bits(), "{ty} {n} blocks, unequal rows");
                    }
                }
            }
        }
    }
}
