//! Q8_0 products of one weight row against up to eight activation rows given flipped
//! ([`crate::quant::DotQFlipped`]; decode with several sessions: the output head, the attention projections, the
//! shared expert), each output bit-identical to the AVX2 single-row kernel (`avx2::q8_0_q8_0_imp`).
//!
//! The activations come flipped ([`crate::quant::flip_acts`], made once per product by
//! the caller: each quant plus 128, an unsigned byte, 32 bytes per block, no scale bytes) with their block scales
//! as f32 ([`crate::quant::act_block_scales`]). Per block pair (the two blocks side by side in one 512-bit vector,
//! as in `avx2_x4`'s 512-bit form) the weight quants are loaded once and the correction `-128 · Σ₄ w` (one i32 per
//! lane) is computed once for all rows; per row what remains is one 64-byte load, `vpdpbusd(corr, a + 128, w)` (the
//! lane sums `Σ₄ w·a` with no sign fix-up), the conversion, the scale pick and the FMA — where `avx2_x4`'s form
//! spends two loads, an insert and a masked negation more per row. The scale products `d_w · d_a` are formed eight
//! blocks at a time per row (the weight scales from two word permutes, `avx2_x4::q8_0_scales8`, or gathered for a
//! partial chunk) and kept in registers.
//!
//! Why each output equals the single kernel's: per lane the integer is `Σ₄ w·a` exactly (`a + 128 ≤ 255` unsigned
//! times `w` signed, four products per lane, no saturation; activation quants are in -127..=127, the contract of
//! [`crate::quant::DotQ`], so the single kernel's `sign` never meets a -128); the conversion to f32 is exact;
//! `d_w · d_a` is the same f32 product; block `2j` updates the low half (the single kernel's first accumulator) and
//! `2j + 1` the high half (its second) with one FMA each, in block order, an odd last block the low half only; the
//! result is `hsum(low + high)`.
//!
//! Measured (`benches/README.md`, 2026-12-03, fourth round; one thread, CPU time, eight distinct rows): 1.37–1.45×
//! the `avx2_x4` 512-bit eight-row form in cache, 1.35–1.39× with the weights streamed. Tried and slower: blocks
//! alternating per 32-bit lane (so a pair's two scale products are one 64-bit broadcast load) — the weight
//! interleave (`vpermt2d`) cost more than the permute it saved.
//!
//! Soundness: [`dot_q_flipped`] hands the kernel out only after AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI are
//! detected; the wrapper checks every row's length before the vector code, which reads whole blocks only.

use std::arch::x86_64::*;

use super::super::api::{DotQFlipped, MAX_ROWS};
use super::super::{q8_0, GgmlType};
use super::avx2_x4::{hsum_halves, pair_picks, q8_0_pair, q8_0_scales, q8_0_scales8, vnni_512, SCALE_CHUNK};
use super::x86::{ld, ld_si256, prefetch_ahead};

const B: usize = q8_0::BLOCK_BYTES;
/// Flipped quant bytes of a block.
const QB: usize = 32;
/// Blocks whose scale products are formed at once (one 256-bit vector per row).
const CHUNK: usize = SCALE_CHUNK;

/// The flipped-activation form of the Q8_0 kernel where AVX-512 F/BW/VL/VNNI are present.
pub(super) fn dot_q_flipped(ty: GgmlType) -> Option<DotQFlipped> {
    (ty == GgmlType::Q8_0 && vnni_512()).then_some(q8_0_flipped as DotQFlipped)
}

/// `out[i] = dot(w, a_i)` for `i < out.len()`, up to eight rows per weight decode; a row whose flipped quants or
/// scales hold fewer blocks than `w` gets NaN.
fn q8_0_flipped(w: &[u8], au: &[&[u8]], da: &[&[f32]], out: &mut [f32]) {
    let n = w.len() / B;
    let m = out.len().min(au.len()).min(da.len());
    out[m..].fill(f32::NAN);
    let ok = |i: usize| au[i].len() >= n * QB && da[i].len() >= n;
    if !(0..m).all(ok) {
        for (i, o) in out[..m].iter_mut().enumerate() {
            *o = if ok(i) { run::<1>(w, &au[i..], &da[i..], n)[0] } else { f32::NAN };
        }
        return;
    }
    const _: () = assert!(MAX_ROWS == 8, "one match arm per group size");
    let mut i = 0;
    while i < m {
        let (a, d, o) = (&au[i..], &da[i..], &mut out[i..]);
        let g = (m - i).min(MAX_ROWS);
        match g {
            1 => o[..1].copy_from_slice(&run::<1>(w, a, d, n)),
            2 => o[..2].copy_from_slice(&run::<2>(w, a, d, n)),
            3 => o[..3].copy_from_slice(&run::<3>(w, a, d, n)),
            4 => o[..4].copy_from_slice(&run::<4>(w, a, d, n)),
            5 => o[..5].copy_from_slice(&run::<5>(w, a, d, n)),
            6 => o[..6].copy_from_slice(&run::<6>(w, a, d, n)),
            7 => o[..7].copy_from_slice(&run::<7>(w, a, d, n)),
            _ => o[..8].copy_from_slice(&run::<8>(w, a, d, n)),
        }
        i += g;
    }
}

/// The first `R` rows of `au` / `da` (each checked to hold `n` blocks) against `w`.
fn run<const R: usize>(w: &[u8], au: &[&[u8]], da: &[&[f32]], n: usize) -> [f32; R] {
    // SAFETY: handed out by `dot_q_flipped` only after `vnni_512()` (AVX2/FMA/F16C, AVX-512 F/BW/VL/VNNI); `w`
    // holds `n` whole blocks and every row `n` blocks of flipped quants and scales (checked by the caller).
    unsafe { rows_imp::<R>(w, std::array::from_fn(|r| au[r]), std::array::from_fn(|r| da[r]), n) }
}

/// Q8_0 · flipped activations, `R` rows.
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI present; `w` holds `n` whole blocks, every `au[r]` at least `32 n`
/// bytes and every `da[r]` at least `n` scales.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_imp<const R: usize>(w: &[u8], au: [&[u8]; R], da: [&[f32]; R], n: usize) -> [f32; R] {
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let zero = _mm512_setzero_si512();
    let pick = pair_picks();
    let mut acc = [_mm512_setzero_ps(); R];
    let wp = w.as_ptr();
    let mut c0 = 0;
    while c0 < n {
        let nb = (n - c0).min(CHUNK);
        let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb as i32), lane);
        // SAFETY: blocks `c0..c0 + nb` lie inside the weight row (`n` blocks); a whole chunk for the permutes.
        let dw = unsafe {
            if nb == CHUNK {
                q8_0_scales8(wp.add(c0 * B))
            } else {
                q8_0_scales(wp.add(c0 * B), live)
            }
        };
        let dd: [__m512; R] = std::array::from_fn(|r| {
            // SAFETY: lanes below `nb` read `da[r][c0..c0 + nb]`, inside the slice (`n` scales); the others nothing.
            let d = unsafe { _mm256_maskload_ps(da[r].as_ptr().add(c0), live) };
            _mm512_castps256_ps512(_mm256_mul_ps(dw, d))
        });
        let mut k = 0;
        while k + 2 <= nb {
            let off = (c0 + k) * B;
            prefetch_ahead::<2>(wp.wrapping_add(off));
            // SAFETY: blocks `c0 + k`, `c0 + k + 1 < n` of the weight row.
            let qw = unsafe { q8_0_pair(wp.add(off)) };
            let corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, qw));
            let (pa, s) = ((c0 + k) * QB, pick[k / 2]);
            for r in 0..R {
                // SAFETY: blocks `c0 + k`, `c0 + k + 1 < n` of row `r` (64 bytes at `32 (c0 + k)`).
                let ua = unsafe { ld(au[r].as_ptr().add(pa)) };
                let p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, ua, qw));
                acc[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(s, dd[r]), p, acc[r]);
            }
            k += 2;
        }
        if k < nb {
            // The odd last block of the row: the low half (the single kernel's first accumulator) only.
            let off = (c0 + k) * B;
            // SAFETY: block `c0 + k < n` of the weight row.
            let qw = _mm512_zextsi256_si512(unsafe { ld_si256(wp.add(off + 2)) });
            let corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, qw));
            let (pa, s) = ((c0 + k) * QB, _mm512_set1_epi32(k as i32));
            for r in 0..R {
                // SAFETY: block `c0 + k < n` of row `r`.
                let ua = _mm512_zextsi256_si512(unsafe { ld_si256(au[r].as_ptr().add(pa)) });
                let p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, ua, qw));
                acc[r] = _mm512_mask3_fmadd_ps(_mm512_permutexvar_ps(s, dd[r]), p, acc[r], 0x00ff);
            }
        }
        c0 += CHUNK;
    }
    std::array::from_fn(|r| hsum_halves(acc[r]))
}
