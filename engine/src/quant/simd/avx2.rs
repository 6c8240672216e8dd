//! AVX2 + FMA kernels (x86-64), resolved at runtime.
//!
//! Soundness: every `#[target_feature]` function here is only reachable through the plain `fn` wrappers that
//! [`dot_f32`] / [`dot_q`] hand out, and those are handed out only after `is_x86_feature_detected!` confirmed the
//! features on this CPU (AVX2, FMA and F16C). Every vector load reads inside a block slice produced by
//! `chunks_exact` (or below an index bounded by the slice length), so no load goes out of bounds.
//!
//! Integer paths: weight quants are unsigned bytes (Q2_K 0..3, Q4_K 0..15, IQ2_XXS grid magnitudes 8..43) and
//! activation quants signed bytes in -127..127, so `_mm256_maddubs_epi16` never saturates (max 2·43·127 = 10922);
//! `_mm256_madd_epi16` then applies the small per-sub-block scales into i32 lanes. The Q2_K/Q4_K minimums use the
//! Q8_K block sums instead of a second pass over the quants.

use std::arch::x86_64::*;

use super::super::api::{DotF32, DotQ};
use super::super::iq2_tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::super::{iq2_xxs, q2_k, q4_k, q8_0, q8_k, GgmlType, QK_K};
use super::x86::{f16_at, hsum_ps, ld_si256, prefetch_ahead};

/// AVX2, FMA and F16C (every AVX2 CPU has F16C; the kernels use it for the f16 block scales).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

pub(super) fn dot_f32(ty: GgmlType) -> Option<DotF32> {
    if !available() {
        return None;
    }
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
    if !available() {
        return None;
    }
    Some(match ty {
        GgmlType::Q8_0 => q8_0_q8_0,
        GgmlType::Q2K => q2_k_q8_k,
        GgmlType::Q4K => q4_k_q8_k,
        GgmlType::Iq2Xxs => iq2_xxs_q8_k,
        _ => return None,
    })
}

// Safe wrappers (see the module docs for why calling the target-feature functions is sound).
macro_rules! wrap {
    ($name:ident, $imp:ident, $b:ty) => {
        fn $name(w: &[u8], x: $b) -> f32 {
            // SAFETY: this wrapper is only handed out by `dot_f32`/`dot_q` after runtime detection of the
            // features `$imp` is compiled for.
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
wrap!(q2_k_q8_k, q2_k_q8_k_imp, &[u8]);
wrap!(q4_k_q8_k, q4_k_q8_k_imp, &[u8]);
wrap!(iq2_xxs_q8_k, iq2_xxs_q8_k_imp, &[u8]);

/// Loads 8 f32 from `p`.
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn ld_ps(p: *const u8) -> __m256 {
    // SAFETY: guaranteed by the caller.
    unsafe { _mm256_loadu_ps(p as *const f32) }
}

/// Σ a[i]·x[i] over `n ≤ min(a.len()/4, x.len())` f32 values stored as bytes.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32_bytes(a: &[u8], x: &[f32], n: usize) -> f32 {
    let (ap, xp) = (a.as_ptr(), x.as_ptr() as *const u8);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let o = 4 * (i + 8 * k);
            // SAFETY: i + 8k + 8 ≤ n ≤ both lengths (in f32 values), so 32 bytes at offset o are in bounds.
            *acc = unsafe { _mm256_fmadd_ps(ld_ps(ap.add(o)), ld_ps(xp.add(o)), *acc) };
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: i + 8 ≤ n.
        acc[0] = unsafe { _mm256_fmadd_ps(ld_ps(ap.add(4 * i)), ld_ps(xp.add(4 * i)), acc[0]) };
        i += 8;
    }
    let mut s = hsum_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for j in i..n {
        s += f32::from_le_bytes([a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3]]) * x[j];
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
fn f32_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    dot_f32_bytes(w, x, (w.len() / 4).min(x.len()))
}

/// Shared loop for the 16-bit float formats: `cvt` turns 8 packed 16-bit values into 8 f32 (`avx2_x4` has the
/// multi-row form, `half_rows`, in the same order).
macro_rules! half_dot {
    ($w:ident, $x:ident, $cvt:expr, $scalar:expr) => {{
        let n = ($w.len() / 2).min($x.len());
        let (wp, xp) = ($w.as_ptr(), $x.as_ptr() as *const u8);
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n, so 32 bytes of w at 2i and 64 bytes of x at 4i are in bounds.
            unsafe {
                let h0 = _mm_loadu_si128(wp.add(2 * i) as *const __m128i);
                let h1 = _mm_loadu_si128(wp.add(2 * i + 16) as *const __m128i);
                acc0 = _mm256_fmadd_ps($cvt(h0), ld_ps(xp.add(4 * i)), acc0);
                acc1 = _mm256_fmadd_ps($cvt(h1), ld_ps(xp.add(4 * i + 32)), acc1);
            }
            i += 16;
        }
        let mut s = hsum_ps(_mm256_add_ps(acc0, acc1));
        for j in i..n {
            s += $scalar(u16::from_le_bytes([$w[2 * j], $w[2 * j + 1]])) * $x[j];
        }
        s
    }};
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    half_dot!(w, x, _mm256_cvtph_ps, |b| half::f16::from_bits(b).to_f32())
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bf16_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    half_dot!(w, x, bf16x8_to_ps, super::super::f16::bf16_to_f32)
}

/// 8 packed BF16 values to 8 f32 (exact: shift into the high half).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bf16x8_to_ps(h: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in w.chunks_exact(q8_0::BLOCK_BYTES).zip(x.chunks_exact(q8_0::QK)) {
        let (bp, xp) = (b.as_ptr(), xs.as_ptr() as *const u8);
        let mut s = _mm256_setzero_ps();
        for k in 0..4 {
            // SAFETY: the block has 34 bytes (8 read at 2 + 8k ≤ 26) and xs 32 f32 (8 read at 8k).
            unsafe {
                let q = _mm_loadl_epi64(bp.add(2 + 8 * k) as *const __m128i);
                let qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                s = _mm256_fmadd_ps(qf, ld_ps(xp.add(32 * k)), s);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), s, acc);
    }
    hsum_ps(acc)
}

/// Dequantizes block by block (scalar) and dots each block with AVX2.
macro_rules! deq_dot {
    ($w:ident, $x:ident, $bytes:expr, $deq:path) => {{
        let mut y = [0f32; QK_K];
        let mut acc = 0f32;
        for (b, xs) in $w.chunks_exact($bytes).zip($x.chunks_exact(QK_K)) {
            $deq(b, &mut y);
            acc += dot_f32_bytes(bytemuck_f32(&y), xs, QK_K);
        }
        acc
    }};
}

/// Views f32s as bytes (little-endian host).
fn bytemuck_f32(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// 8 unsigned bytes (the low 8 of `v`) as 8 f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn u8x8_to_ps(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q2_k_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let mut acc = [_mm256_setzero_ps(); 2];
    for (b, xs) in w.chunks_exact(q2_k::BLOCK_BYTES).zip(x.chunks_exact(QK_K)) {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        let (bp, xp) = (b.as_ptr(), xs.as_ptr() as *const u8);
        for h in 0..2 {
            // SAFETY: qs are bytes 16..80 of the 84-byte block (32 read at 16 + 32h ≤ 48).
            let q2 = unsafe { ld_si256(bp.add(16 + 32 * h)) };
            for j in 0..4 {
                let q = match j {
                    0 => _mm256_and_si256(q2, m3),
                    1 => _mm256_and_si256(_mm256_srli_epi16::<2>(q2), m3),
                    2 => _mm256_and_si256(_mm256_srli_epi16::<4>(q2), m3),
                    _ => _mm256_and_si256(_mm256_srli_epi16::<6>(q2), m3),
                };
                // Bytes 0..16 belong to sub-block s, bytes 16..32 to s + 1.
                for half in 0..2 {
                    let s = 8 * h + 2 * j + half;
                    let dl = _mm256_set1_ps(d * (b[s] & 0xf) as f32);
                    let ml = _mm256_set1_ps(dmin * (b[s] >> 4) as f32);
                    let q16 = if half == 0 { _mm256_castsi256_si128(q) } else { _mm256_extracti128_si256::<1>(q) };
                    let v = 128 * h + 32 * j + 16 * half;
                    // SAFETY: v + 16 ≤ 256 values of this block's 256 activations.
                    let (x0, x1) = unsafe { (ld_ps(xp.add(4 * v)), ld_ps(xp.add(4 * v + 32))) };
                    let w0 = _mm256_fmsub_ps(dl, u8x8_to_ps(q16), ml);
                    let w1 = _mm256_fmsub_ps(dl, u8x8_to_ps(_mm_srli_si128::<8>(q16)), ml);
                    acc[0] = _mm256_fmadd_ps(w0, x0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(w1, x1, acc[1]);
                }
            }
        }
    }
    hsum_ps(_mm256_add_ps(acc[0], acc[1]))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    deq_dot!(w, x, q4_k::BLOCK_BYTES, q4_k::dequantize_block)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn iq2_xxs_f32_imp(w: &[u8], x: &[f32]) -> f32 {
    let bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let neg = _mm256_set1_ps(-0.0);
    let mut acc = [_mm256_setzero_ps(); 2];
    for (b, xs) in w.chunks_exact(iq2_xxs::BLOCK_BYTES).zip(x.chunks_exact(QK_K)) {
        let d = f16_at(b, 0);
        let xp = xs.as_ptr() as *const u8;
        for g in 0..8 {
            let o = 2 + 8 * g;
            let aux = u32::from_le_bytes([b[o + 4], b[o + 5], b[o + 6], b[o + 7]]);
            let db = _mm256_set1_ps(d * (0.5 + (aux >> 28) as f32) * 0.25);
            for l in 0..4 {
                let grid = u8x8_to_ps(_mm_cvtsi64_si128(IQ2XXS_GRID[b[o + l] as usize] as i64));
                let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize] as i32;
                // Lanes whose sign bit is set get the f32 sign bit flipped.
                let m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(signs), bit), bit);
                let wv = _mm256_xor_ps(_mm256_mul_ps(db, grid), _mm256_and_ps(_mm256_castsi256_ps(m), neg));
                // SAFETY: 8 activations at 32g + 8l ≤ 248 of this block's 256.
                let xv = unsafe { ld_ps(xp.add(4 * (32 * g + 8 * l))) };
                acc[l & 1] = _mm256_fmadd_ps(wv, xv, acc[l & 1]);
            }
        }
    }
    hsum_ps(_mm256_add_ps(acc[0], acc[1]))
}

/// One Q8_0 · Q8_0 block: the 8 partial integer sums as f32, and `d_w · d_a`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_block(bw: &[u8], ba: &[u8]) -> (__m256, f32) {
    // SAFETY: callers pass 34-byte blocks; 32 bytes are read at offset 2.
    let (qw, qa) = unsafe { (ld_si256(bw.as_ptr().add(2)), ld_si256(ba.as_ptr().add(2))) };
    // |w| · sign(w)·a, so the unsigned × signed multiply sees a non-negative left operand.
    let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
    let p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    (_mm256_cvtepi32_ps(p32), f16_at(bw, 0) * f16_at(ba, 0))
}

/// Q8_0 · Q8_0 over the whole blocks both hold (`avx2_x4` has the four-row form, bit-identical).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q8_0_q8_0_imp(w: &[u8], a: &[u8]) -> f32 {
    const B: usize = q8_0::BLOCK_BYTES;
    let n = (w.len() / B).min(a.len() / B);
    // Two accumulators: the FMA latency, not throughput, bounds a single chain.
    let mut acc = [_mm256_setzero_ps(); 2];
    for (pw, pa) in w[..n * B].chunks_exact(2 * B).zip(a[..n * B].chunks_exact(2 * B)) {
        prefetch_ahead::<2>(pw.as_ptr());
        for k in 0..2 {
            let (p, d) = q8_0_block(&pw[k * B..(k + 1) * B], &pa[k * B..(k + 1) * B]);
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc[k]);
        }
    }
    if n % 2 == 1 {
        let (p, d) = q8_0_block(&w[(n - 1) * B..n * B], &a[(n - 1) * B..n * B]);
        acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc[0]);
    }
    hsum_ps(_mm256_add_ps(acc[0], acc[1]))
}

/// Unpacks the 12 packed Q4_K scale bytes into (8 six-bit scales, 8 six-bit mins), one per byte.
#[inline(always)]
pub(super) fn q4_k_scales(s: &[u8]) -> (u64, u64) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    // Scales 0..4: low 6 bits of bytes 0..4; scales 4..8: low nibbles of bytes 8..12 plus the top 2 bits of
    // bytes 0..4. Mins likewise from bytes 4..8 and the high nibbles of bytes 8..12.
    let sc_lo = w0 & LOW6;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
    let m_lo = w1 & LOW6;
    let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
    (sc_lo as u64 | (sc_hi as u64) << 32, m_lo as u64 | (m_hi as u64) << 32)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_k_q8_k_imp(w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0f);
    let mut acc = _mm256_setzero_ps();
    let mut acc_min = _mm256_setzero_ps();
    for (b, qa) in w.chunks_exact(q4_k::BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let da = q8_k::d(qa);
        let (sc, mins) = q4_k_scales(&b[4..16]);
        let (bp, ap) = (b.as_ptr(), qa.as_ptr());
        prefetch_ahead::<3>(bp);
        // Σ_j m_j·(bsum_2j + bsum_2j+1): each min duplicated into two i16 lanes, times the 16 block sums.
        let m8 = _mm_cvtsi64_si128(mins as i64);
        let m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        // SAFETY: the 16 i16 block sums are bytes 260..292 of the 292-byte Q8_K block.
        let bsums = unsafe { ld_si256(ap.add(q8_k::BSUMS)) };
        let pm = _mm256_cvtepi32_ps(_mm256_madd_epi16(m16, bsums));
        acc_min = _mm256_fmadd_ps(_mm256_set1_ps(da * f16_at(b, 2)), pm, acc_min);
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            // SAFETY: qs are bytes 16..144 of the 144-byte block (32 read at 16 + 32c ≤ 112); the Q8_K quants are
            // bytes 4..260 of its 292-byte block (64 read at 4 + 64c ≤ 196).
            let (q4, a_lo, a_hi) =
                unsafe { (ld_si256(bp.add(16 + 32 * c)), ld_si256(ap.add(4 + 64 * c)), ld_si256(ap.add(36 + 64 * c))) };
            let lo = _mm256_and_si256(q4, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
            let s_lo = ((sc >> (16 * c)) & 0xff) as i16;
            let s_hi = ((sc >> (16 * c + 8)) & 0xff) as i16;
            let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a_lo), _mm256_set1_epi16(s_lo));
            let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a_hi), _mm256_set1_epi16(s_hi));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(da * f16_at(b, 0)), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) - hsum_ps(acc_min)
}

/// `_mm256_shuffle_epi8` masks turning the 16 Q2_K scale nibbles (broadcast to both lanes) into i16 lanes holding
/// scale `2k` (low 128-bit lane) and scale `2k + 1` (high lane); 0x80 bytes produce zeros.
pub(super) const Q2_SCALE_SHUF: [[u8; 32]; 8] = {
    let mut t = [[0x80u8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        let mut i = 0;
        while i < 8 {
            t[k][2 * i] = 2 * k as u8;
            t[k][16 + 2 * i] = 2 * k as u8 + 1;
            i += 1;
        }
        k += 1;
    }
    t
};

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q2_k_q8_k_imp(w: &[u8], a: &[u8]) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0f);
    // SAFETY: each mask is a 32-byte array.
    let shuf: [__m256i; 8] = std::array::from_fn(|k| unsafe { ld_si256(Q2_SCALE_SHUF[k].as_ptr()) });
    let mut acc = _mm256_setzero_ps();
    let mut acc_min = _mm256_setzero_ps();
    for (b, qa) in w.chunks_exact(q2_k::BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let da = q8_k::d(qa);
        let (bp, ap) = (b.as_ptr(), qa.as_ptr());
        prefetch_ahead::<2>(bp);
        // SAFETY: scales are bytes 0..16 of the 84-byte block; block sums bytes 260..292 of the Q8_K block.
        let (sc8, bsums) = unsafe { (_mm_loadu_si128(bp as *const __m128i), ld_si256(ap.add(q8_k::BSUMS))) };
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc8), m4));
        let pm = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bsums));
        acc_min = _mm256_fmadd_ps(_mm256_set1_ps(da * f16_at(b, 82)), pm, acc_min);
        let scales = _mm256_broadcastsi128_si256(_mm_and_si128(sc8, m4));
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            // SAFETY: qs are bytes 16..80 of the 84-byte block (32 read at 16 + 32h ≤ 48).
            let q2 = unsafe { ld_si256(bp.add(16 + 32 * h)) };
            for j in 0..4 {
                // SAFETY: 32 Q8_K quants at 4 + 128h + 32j ≤ 228, inside the 292-byte block.
                let qa8 = unsafe { ld_si256(ap.add(4 + 128 * h + 32 * j)) };
                let q = match j {
                    0 => _mm256_and_si256(q2, m3),
                    1 => _mm256_and_si256(_mm256_srli_epi16::<2>(q2), m3),
                    2 => _mm256_and_si256(_mm256_srli_epi16::<4>(q2), m3),
                    _ => _mm256_and_si256(_mm256_srli_epi16::<6>(q2), m3),
                };
                // Low 128-bit lane = sub-block 8h + 2j, high lane = sub-block 8h + 2j + 1.
                let scv = _mm256_shuffle_epi8(scales, shuf[4 * h + j]);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, qa8), scv));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(da * f16_at(b, 80)), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) - hsum_ps(acc_min)
}

/// For each 7-bit sign index, 8 bytes of +1 / -1 (0x01 / 0xff) ready for `_mm256_sign_epi8`.
pub(super) const SIGNS_PM1: [u64; 128] = {
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

/// One IQ2_XXS group (32 weights: 4 grid indices, then 4×7 sign bits and a 4-bit scale, as one little-endian u64)
/// times its 32 Q8_K quants `qa8`, as 8 i32 partial sums scaled by `2·scale + 1`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq2_xxs_group(q: u64, qa8: __m256i) -> __m256i {
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
    let p16 = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(qa8, signs));
    _mm256_madd_epi16(p16, _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq2_xxs_q8_k_imp(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, qa) in w.chunks_exact(iq2_xxs::BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        let (bp, ap) = (b.as_ptr(), qa.as_ptr());
        prefetch_ahead::<2>(bp);
        // Two independent sums, two groups per step, so the table lookups of one overlap the other's arithmetic.
        let mut sumi = [_mm256_setzero_si256(); 2];
        for g in (0..8).step_by(2) {
            // SAFETY: groups g and g + 1 are 8 bytes each at 2 + 8g ≤ 50 inside the 66-byte block; their 32 Q8_K
            // quants each are at 4 + 32g ≤ 228 inside the 292-byte block.
            let (q0, q1, a0, a1) = unsafe {
                (
                    std::ptr::read_unaligned(bp.add(2 + 8 * g) as *const u64).to_le(),
                    std::ptr::read_unaligned(bp.add(10 + 8 * g) as *const u64).to_le(),
                    ld_si256(ap.add(4 + 32 * g)),
                    ld_si256(ap.add(36 + 32 * g)),
                )
            };
            sumi[0] = _mm256_add_epi32(sumi[0], iq2_xxs_group(q0, a0));
            sumi[1] = _mm256_add_epi32(sumi[1], iq2_xxs_group(q1, a1));
        }
        let d = f16_at(b, 0) * q8_k::d(qa) * 0.125;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_add_epi32(sumi[0], sumi[1])), acc);
    }
    hsum_ps(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_scale_unpacking_matches_scalar() {
        let mut s = [0u8; 12];
        for seed in 0..64u32 {
            for (i, v) in s.iter_mut().enumerate() {
                *v = (seed.wrapping_mul(2654435761).rotate_left(i as u32 * 3) >> 7) as u8 ^ (i as u8).wrapping_mul(37);
            }
            let (sc, m) = q4_k_scales(&s);
            for j in 0..8 {
                assert_eq!(((sc >> (8 * j)) as u8, (m >> (8 * j)) as u8), q4_k::scale_min(&s, j), "j={j}");
            }
        }
    }

    #[test]
    fn f16_conversion_is_exact_for_every_bit_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_at(&h.to_le_bytes(), 0);
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn sign_table_matches_ksigns() {
        for (k, &v) in SIGNS_PM1.iter().enumerate() {
            for j in 0..8 {
                let byte = (v >> (8 * j)) as u8;
                let neg = KSIGNS_IQ2XS[k] & (1 << j) != 0;
                assert_eq!(byte, if neg { 0xff } else { 0x01 });
            }
        }
    }
}
