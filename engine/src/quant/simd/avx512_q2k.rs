//! AVX-512 (BW/VBMI/VNNI) Q2_K · Q8_K kernel, resolved at runtime through [`dot_q`] (which `simd` asks).
//!
//! Soundness: the `#[target_feature]` function is only reachable through the plain `fn` wrappers that [`dot_q`]
//! and [`dot_q_rows`] hand out after `avx512::available()` confirmed its features; every weight load reads inside
//! a block slice produced by `chunks_exact`, every activation load inside block `bi < blocks` of a row at least as
//! long as the first.
//!
//! Per 256-value block, the 64 bytes of 2-bit quants are one register; shift `j` (0..4) of it holds values
//! `32j..32j+32` (bytes 0..32) and `128+32j..` (bytes 32..64), so their activations are two 32-byte loads. The
//! 4-bit sub-block scales are folded into the quants before the multiply: a 64-byte table holds `q·scale` for
//! every (sub-block, q) pair (`scale·[0, 1, 2, 3]`, built with one `vpermb` and one `vpmullw` per block), and a
//! `vpermb` indexed by `4·sub-block + q` replaces each quant by its scaled value (≤ 45, an unsigned byte). One
//! `vpdpbusd` per 64 values then accumulates `Σ scale·q·a` straight into i32 lanes (each < 4·4·45·127 < 2^17, so
//! the per-block conversion to f32 is exact). The minimums use the Q8_K block sums, as in `avx2`. Only the f32
//! accumulation order differs from the scalar reference.
//!
//! Several activation rows (prefill: the routed experts' `w2`, ~6 rows each in a 256-token chunk): one `N`-generic
//! body, as in `avx512_iq2`, builds each block's table and the four `vpermb`-scaled quant vectors once and runs
//! every row's `vpdpbusd`s and minimums against them ([`dot_q_rows`], up to 8 rows per decode); each row's f32
//! operations are those of the single dot, in the same order, so it is bit-identical to it.
//!
//! Rows are read through raw pointers, not bounds-checked slices: the checks cost far more than the kernel's
//! arithmetic (the bounds are established once by the wrappers, see Soundness).

use std::arch::x86_64::*;

use super::super::api::{DotQ, DotQRows};
use super::super::{q2_k, q8_k};
use super::x86::{dot_rows, f16_at, ld, ld64, prefetch_ahead, RowsKernel, A64};

/// For shift `j`, byte `p` of the quants belongs to sub-block `8·(p/32) + 2j + (p%32)/16`; its table offset is 4×.
const SUB_OFFSET: [A64; 4] = [
    bytes64!(|p| (4 * (8 * (p / 32) + (p % 32) / 16)) as u8),
    bytes64!(|p| (4 * (8 * (p / 32) + 2 + (p % 32) / 16)) as u8),
    bytes64!(|p| (4 * (8 * (p / 32) + 4 + (p % 32) / 16)) as u8),
    bytes64!(|p| (4 * (8 * (p / 32) + 6 + (p % 32) / 16)) as u8),
];

/// `vpermb` indices spreading scale byte `s` to bytes `4s` and `4s + 2` (the odd bytes are zeroed by the mask).
const SCALE_SPREAD: A64 = bytes64!(|i| (i / 4) as u8);

/// Per 16-bit word of the table: `scale · (v_lo + 256·v_hi)` gives bytes `scale·v` for `v` = 0, 1 (even words)
/// and 2, 3 (odd words); no carries since `3·15 < 256`.
const LEVEL_MUL: A64 = bytes64!(|i| match i % 4 {
    1 => 1,
    2 => 2,
    3 => 3,
    _ => 0,
});

/// This kernel where the CPU can run it (`avx512::available()`).
pub(super) fn dot_q() -> Option<DotQ> {
    super::avx512::available().then_some(q2_k_q8_k as DotQ)
}

fn q2_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: only handed out by `dot_q` after `available()` confirmed the features `imp` needs.
    let [v] = unsafe { imp(w, [a]) };
    v
}

/// [`imp`] for every `N`, for [`dot_rows`].
struct Rows;

impl RowsKernel for Rows {
    unsafe fn rows<const N: usize>(w: &[u8], a: [&[u8]; N]) -> [f32; N] {
        // SAFETY: the caller confirmed the features (`RowsKernel`'s contract).
        unsafe { imp(w, a) }
    }
}

fn q2_k_q8_k_rows(w: &[u8], row_bytes: usize, a: &[&[u8]], _da: &[&[f32]], out: &mut [f32]) {
    // SAFETY: only handed out by `dot_q_rows` after `available()` confirmed the features `imp` needs.
    unsafe { dot_rows::<Rows>(w, row_bytes, a, out) }
}

/// The any-row-count form of this kernel (see [`imp`]) where the CPU can run it.
pub(super) fn dot_q_rows() -> Option<DotQRows> {
    super::avx512::available().then_some(q2_k_q8_k_rows as DotQRows)
}

/// Q2_K weights · `N` rows of Q8_K activations of equal length (1 for the plain dot), over the whole blocks the
/// weights and the first row hold. Each block's scale table and `vpermb`-scaled quants are built once and
/// multiplied into every row; each row goes through the same operations in the same order whatever `N`, so `N`
/// rows at once are bit-identical to `N` single calls.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma,f16c")]
fn imp<const N: usize>(w: &[u8], a: [&[u8]; N]) -> [f32; N] {
    let offsets = SUB_OFFSET.each_ref().map(|t| ld64(t));
    let spread = ld64(&SCALE_SPREAD);
    let level_mul = ld64(&LEVEL_MUL);
    let low4 = _mm_set1_epi8(0x0f);
    let three = _mm512_set1_epi8(3);
    let mut acc = [_mm512_setzero_ps(); N];
    let mut acc_min = [_mm256_setzero_ps(); N];
    let blocks = (w.len() / q2_k::BLOCK_BYTES).min(a.first().map_or(0, |x| x.len()) / q8_k::BLOCK_BYTES);
    for (bi, b) in w.chunks_exact(q2_k::BLOCK_BYTES).take(blocks).enumerate() {
        let bp = b.as_ptr();
        prefetch_ahead::<2>(bp);
        // SAFETY: every row holds block `bi` (`bi < blocks` and the rows are as long as `a[0]`).
        let aps = a.map(|x| unsafe { x.as_ptr().add(bi * q8_k::BLOCK_BYTES) });
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        // SAFETY: scales are bytes 0..16 and quants bytes 16..80 of the 84-byte block.
        let (sc, qs) = unsafe { (_mm_loadu_si128(bp as *const __m128i), ld(bp.add(16))) };
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc), low4));
        // The q·scale table: byte 4s + v = v·scale_s.
        let sc_lo = _mm512_castsi128_si512(_mm_and_si128(sc, low4));
        let table = _mm512_mullo_epi16(_mm512_maskz_permutexvar_epi8(0x5555_5555_5555_5555, spread, sc_lo), level_mul);
        let scaled: [__m512i; 4] = std::array::from_fn(|j| {
            let q = match j {
                0 => qs,
                1 => _mm512_srli_epi16::<2>(qs),
                2 => _mm512_srli_epi16::<4>(qs),
                _ => _mm512_srli_epi16::<6>(qs),
            };
            // (q & 3) | offset, the table index of each quant.
            _mm512_permutexvar_epi8(_mm512_ternarylogic_epi64::<0xea>(q, three, offsets[j]), table)
        });
        for ((acc, acc_min), ap) in acc.iter_mut().zip(&mut acc_min).zip(aps) {
            // SAFETY: the f32 scale is bytes 0..4, the block sums bytes 260..292 of the 292-byte Q8_K block.
            let (da, bsums) = unsafe {
                (
                    f32::from_bits(std::ptr::read_unaligned(ap as *const u32).to_le()),
                    _mm256_loadu_si256(ap.add(q8_k::BSUMS) as *const __m256i),
                )
            };
            // Minimums: Σ_s min_s · bsum_s.
            let pm = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bsums));
            *acc_min = _mm256_fmadd_ps(_mm256_set1_ps(da * dmin), pm, *acc_min);
            let mut sumi = _mm512_setzero_si512();
            for (j, s) in scaled.iter().enumerate() {
                // SAFETY: 32 Q8_K quants at 4 + 32j ≤ 100 and at 132 + 32j ≤ 228, inside the 292-byte block.
                let act = unsafe {
                    let lo = _mm256_loadu_si256(ap.add(4 + 32 * j) as *const __m256i);
                    let hi = _mm256_loadu_si256(ap.add(132 + 32 * j) as *const __m256i);
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                };
                sumi = _mm512_dpbusd_epi32(sumi, *s, act);
            }
            *acc = _mm512_fmadd_ps(_mm512_set1_ps(da * d), _mm512_cvtepi32_ps(sumi), *acc);
        }
    }
    std::array::from_fn(|i| {
        let m = _mm_add_ps(_mm256_castps256_ps128(acc_min[i]), _mm256_extractf128_ps::<1>(acc_min[i]));
        let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_add_ss(m, _mm_movehdup_ps(m));
        _mm512_reduce_add_ps(acc[i]) - _mm_cvtss_f32(m)
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_blocks::{assert_rows_match_single, mass, q8k_blocks};
    use super::dot_q;
    use crate::quant::{q2_k, q8_k};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn kernel() -> Option<crate::quant::DotQ> {
        let k = dot_q();
        if k.is_none() {
            eprintln!("no AVX-512 VBMI/VNNI on this CPU: the avx512 Q2_K kernel is not selected, nothing to test");
        }
        k
    }

    /// `n` random Q2_K blocks with finite f16 scales `d`, `dmin` of either sign.
    fn weights(rng: &mut StdRng, n: usize) -> Vec<u8> {
        let mut w = vec![0u8; n * q2_k::BLOCK_BYTES];
        rng.fill(&mut w[..]);
        for b in w.chunks_exact_mut(q2_k::BLOCK_BYTES) {
            for o in [80, 82] {
                let v = half::f16::from_f32(rng.gen_range(-2.0f32..2.0));
                b[o..o + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    /// Integer sums are exact in both kernels; the f32 accumulation differs in order (scalar: one `d·sumi −
    /// dmin·summ` per block; here 16 + 8 lanes per block, two trees, one subtraction), so the results agree to a
    /// few ulps of the summed magnitudes (1e-6 relative ≈ 8 ulps).
    #[test]
    fn q2_k_random_blocks_match_scalar() {
        let Some(k) = kernel() else { return };
        let mut rng = StdRng::seed_from_u64(5);
        for n in [1usize, 2, 3, 7, 8, 16, 17] {
            for _ in 0..8 {
                let w = weights(&mut rng, n);
                let a = q8k_blocks(n, rng.gen_range(1e-3f32..1.0), |_| rng.gen_range(-127i8..=127));
                let (got, want) = (k(&w, &a), q2_k::dot_q8k(&w, &a));
                let tol = 1e-6 * mass(&w, &a, q2_k::BLOCK_BYTES, q2_k::dequantize_block);
                assert!((got as f64 - want as f64).abs() <= tol, "{n} blocks: avx512 {got}, scalar {want}");
            }
        }
    }

    /// Unit scales keep every intermediate an exact integer: the kernels must agree bit for bit.
    #[test]
    fn q2_k_extremes_are_exact() {
        let Some(k) = kernel() else { return };
        let one = half::f16::from_f32(1.0).to_le_bytes();
        for (scales, quants, act) in [(0xffu8, 0xffu8, 127i8), (0xff, 0xff, -127), (0x0f, 0xff, 127), (0xf0, 0, -127)] {
            let n = 3;
            let mut w = vec![0u8; n * q2_k::BLOCK_BYTES];
            for b in w.chunks_exact_mut(q2_k::BLOCK_BYTES) {
                b[..16].fill(scales);
                b[16..80].fill(quants);
                b[80..82].copy_from_slice(&one);
                b[82..84].copy_from_slice(&one);
            }
            let a = q8k_blocks(n, 1.0, |_| act);
            let want = q2_k::dot_q8k(&w, &a);
            assert_eq!(k(&w, &a), want, "scales {scales:#x} quants {quants:#x} act {act}");
            let (sc, m, q) = ((scales & 15) as i32, (scales >> 4) as i32, (quants & 3) as i32);
            assert_eq!(want, (n as i32 * 256 * act as i32 * (sc * q - m)) as f32);
        }
        // Every scale, min and quant pattern, mixed activations.
        let mut rng = StdRng::seed_from_u64(9);
        let mut w = vec![0u8; 16 * q2_k::BLOCK_BYTES];
        rng.fill(&mut w[..]);
        for (bi, b) in w.chunks_exact_mut(q2_k::BLOCK_BYTES).enumerate() {
            for s in 0..16 {
                b[s] = (16 * bi + s) as u8;
            }
            b[80..82].copy_from_slice(&one);
            b[82..84].copy_from_slice(&one);
        }
        let a = q8k_blocks(16, 1.0, |i| if i % 5 == 0 { -127 } else { 127 - (i % 7) as i8 });
        assert_eq!(k(&w, &a), q2_k::dot_q8k(&w, &a));
    }

    /// Any number of rows (1..=8 per weight decode, more in groups) against 1, 2 and 19 weight rows gives exactly
    /// the single dots, odd block counts, extreme quants and rows of unequal length included.
    #[test]
    fn q2_k_any_rows_match_single_dots_bit_for_bit() {
        let (Some(k), Some(kn)) = (kernel(), super::dot_q_rows()) else { return };
        let mut rng = StdRng::seed_from_u64(23);
        for n in [1usize, 2, 3, 7, 16] {
            let w = weights(&mut rng, 19 * n);
            let rows: Vec<Vec<u8>> = (0..19)
                .map(|r| match r {
                    0 => q8k_blocks(n, 1.0, |_| 127),
                    1 => q8k_blocks(n, 1.0, |_| -127),
                    _ => q8k_blocks(n, rng.gen_range(1e-3f32..1.0), |_| rng.gen_range(-127i8..=127)),
                })
                .collect();
            assert_rows_match_single(k, kn, &w, n * q2_k::BLOCK_BYTES, &rows);
        }
    }

    #[test]
    fn q2_k_uses_only_whole_blocks() {
        let Some(k) = kernel() else { return };
        let mut rng = StdRng::seed_from_u64(4);
        let mut w = vec![0u8; 3 * q2_k::BLOCK_BYTES];
        rng.fill(&mut w[..]);
        for b in w.chunks_exact_mut(q2_k::BLOCK_BYTES) {
            b[80..84].copy_from_slice(&[0, 0x30, 0, 0x2c]);
        }
        let a = q8k_blocks(3, 0.02, |_| rng.gen_range(-127i8..=127));
        let two = k(&w[..2 * q2_k::BLOCK_BYTES], &a);
        assert_eq!(k(&w[..3 * q2_k::BLOCK_BYTES - 1], &a), two);
        assert_eq!(k(&w, &a[..3 * q8_k::BLOCK_BYTES - 1]), two);
    }
}
