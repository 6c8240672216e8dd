//! Multi-row 256-bit kernels: one weight row against four ([`crate::quant::DotQ4`]) or eight
//! ([`crate::quant::DotQ8`]) activation rows for Q8_0, Q2_K, Q4_K and IQ2_XXS, and against four f32 rows
//! ([`crate::quant::DotF4`]) for F16 and BF16 — each the batched form of the AVX2
//! single-row kernel of its type (`avx2`), bit for bit. One generic implementation per type, over the row count `R`.
//!
//! What is shared: the weight row is streamed (and prefetched) once, and everything decoded from a weight block
//! alone is computed once for the `R` rows — Q8_0's `|w|`, IQ2_XXS's grid octets, sign vectors and group scales
//! (the expensive part: eight table lookups and inserts per 32 weights), Q2_K's 2-bit and Q4_K's 4-bit planes,
//! sub-block scale vectors and minimums, the F16/BF16 → f32 conversion. What stays per row: the activation loads and the
//! multiply-adds.
//!
//! Q8_0, whose per-row work dominates, has two forms. Both take the activation rows' f16 block scales already
//! converted to f32 (the caller does it once per activation row, `quant::act_block_scales`; without them the
//! kernel gathers and converts them per weight row, eight blocks at a time), so per block and row only `d_w · d_a`
//! remains, computed eight blocks at a time. The AVX2 form (`maddubs` + `madd`) has four rows only: eight rows'
//! sixteen accumulators do not fit the sixteen registers (measured slower than two four-row calls). Where AVX-512
//! VNNI is present, `vpdpbusd` on 256-bit vectors does `maddubs` + `madd` in one instruction, and the 32 registers
//! hold eight rows. These are the Q8_0 forms of CPUs whose single kernel is AVX2's; where AVX-512 BW/VL/VNNI
//! are all present every Q8_0 form is `avx512_q8_rows`' instead (another contract, the sixteen-lane one, which
//! spends about one and a half vector operations per block pair and row where a 512-bit block-pair form spends
//! four).
//!
//! Why the results are the single kernels' exactly: every integer partial sum is exact (the same operand ranges as
//! the single kernel, no saturation), and where the single kernel converts i32 lanes to f32 the lanes hold the
//! same sums (Q8_0: lane `i` = bytes `4i..4i+4`, for `maddubs` + `madd` and `vpdpbusd` alike; elsewhere only
//! a block's lane total matters, and integer addition is associative); each row's float operations — the lane
//! conversions, the products of the block scales (`d_w · d_a` in the single kernel's order), the fused
//! multiply-adds into the same number of accumulators in the same block order, the final horizontal sums and
//! scalar tails — are the single kernel's, only interleaved with the other rows'. Rows of unequal length (never in
//! the engine) fall back to single calls.
//!
//! Soundness: as in `avx2`, the `#[target_feature]` functions are reached only through wrappers that
//! [`dot_q4`] / [`dot_q8`] / [`dot_f4`] hand out after `avx2::available()` (and, for the VNNI forms, after
//! the AVX-512 features are detected); vector loads read inside whole blocks of slices whose block counts were
//! checked, and the scale gathers and masked loads touch only lanes of blocks inside the row.

use std::arch::x86_64::*;

use super::super::api::{DotF4, DotF8, DotQ4, DotQ8};
use super::super::iq2_tables::IQ2XXS_GRID;
use super::super::{iq2_xxs, q2_k, q4_k, q8_0, q8_k, GgmlType};
use super::avx2::{bf16x8_to_ps, ld_ps, q4_k_scales, Q2_SCALE_SHUF, SIGNS_PM1};
use super::x86::{f16_at, hsum_ps, ld, ld_si256, prefetch_ahead};

/// The four-row kernel for `ty` where its single kernel is the AVX2 one (the caller checks that).
pub(super) fn dot_q4(ty: GgmlType) -> Option<DotQ4> {
    if !super::avx2::available() {
        return None;
    }
    Some(match ty {
        GgmlType::Q8_0 if vnni() => q8_0_x4_vnni,
        GgmlType::Q8_0 => q8_0_x4,
        GgmlType::Q2K => q2_k_x4,
        GgmlType::Q4K => q4_k_x4,
        GgmlType::Iq2Xxs => iq2_xxs_x4,
        _ => return None,
    })
}

/// The eight-row kernel for `ty` where its single kernel is the AVX2 one (the caller checks that).
pub(super) fn dot_q8(ty: GgmlType) -> Option<DotQ8> {
    if !super::avx2::available() {
        return None;
    }
    Some(match ty {
        // Without VNNI, eight rows' sixteen accumulators do not fit the sixteen AVX2 registers: two four-row
        // calls are faster (`benches/results/2026-12-02.md`).
        GgmlType::Q8_0 if vnni() => q8_0_x8_vnni,
        GgmlType::Q2K => q2_k_x8,
        GgmlType::Q4K => q4_k_x8,
        GgmlType::Iq2Xxs => iq2_xxs_x8,
        _ => return None,
    })
}

/// The four-row F16 / BF16 kernels (the AVX2 single kernels' multi-row forms). No eight-row AVX2 ones: their
/// sixteen accumulators would spill, and a spilled accumulator, updated every 16 values, puts a store-to-load round
/// trip on the loop's critical path (measured: 0.6–0.7× the single kernel's rate; `benches/results/2026-12-02.md`); with
/// AVX-512 there are eight-row ones on 512-bit vectors ([`dot_f8`]: eight accumulators, 32 registers).
pub(super) fn dot_f4(ty: GgmlType) -> Option<DotF4> {
    if !super::avx2::available() {
        return None;
    }
    match ty {
        GgmlType::F16 => Some(f16_x4),
        GgmlType::Bf16 => Some(bf16_x4),
        _ => None,
    }
}

/// The eight-row F16 / BF16 kernels on 512-bit vectors (AVX-512 F; decode with several sessions: the indexer,
/// compressor, router and hyper-connection weights): sixteen values per step in one vector, which holds the single
/// kernel's two 8-value steps side by side (low half: its first accumulator, high half: its second), so each
/// row's sums are the single kernel's bit for bit (`hsum(low + high)`, then the same scalar tail) — with eight
/// accumulators in eight of 32 registers, and one conversion per 16 weights for all eight rows (the four-row form
/// converts them twice for eight rows and runs twice the instructions).
pub(super) fn dot_f8(ty: GgmlType) -> Option<DotF8> {
    if !(super::avx2::available() && is_x86_feature_detected!("avx512f")) {
        return None;
    }
    match ty {
        GgmlType::F16 => Some(f16_x8),
        GgmlType::Bf16 => Some(bf16_x8),
        _ => None,
    }
}

/// Whether the Q8_0 multi-row kernels can use AVX-512 VNNI (`vpdpbusd` on 256-bit vectors) here.
fn vnni() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// Whether the 512-bit forms can run here (AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI).
pub(super) fn vnni_512() -> bool {
    super::avx2::available() && vnni() && is_x86_feature_detected!("avx512bw")
}

/// Whether all rows hold exactly `n` whole blocks of `ab` bytes.
fn same_blocks<const R: usize>(a: &[&[u8]; R], ab: usize, n: usize) -> bool {
    a.iter().all(|r| r.len() / ab == n)
}

macro_rules! wrap_r {
    ($name:ident, $r:literal, $imp:ident, $single:ident, $wb:expr, $ab:expr) => {
        fn $name(w: &[u8], a: [&[u8]; $r], da: [&[f32]; $r]) -> [f32; $r] {
            let n = w.len() / $wb;
            // SAFETY: handed out by `dot_q4` / `dot_q8` only after `avx2::available()` (AVX2, FMA, F16C), the
            // features both functions are compiled for — and, for the `_vnni` / `_zmm` forms, after `vnni()` (and,
            // for `_zmm`, AVX-512 BW) confirmed the AVX-512 features they add; the multi-row one gets rows of exactly
            // `n` whole blocks.
            unsafe {
                if same_blocks(&a, $ab, n) {
                    $imp::<$r>(w, a, da, n)
                } else {
                    a.map(|r| super::avx2::$single(w, r))
                }
            }
        }
    };
}
wrap_r!(q8_0_x4, 4, q8_0_xr_imp, q8_0_q8_0_imp, q8_0::BLOCK_BYTES, q8_0::BLOCK_BYTES);
wrap_r!(q8_0_x4_vnni, 4, q8_0_xr_vnni_imp, q8_0_q8_0_imp, q8_0::BLOCK_BYTES, q8_0::BLOCK_BYTES);
wrap_r!(q8_0_x8_vnni, 8, q8_0_xr_vnni_imp, q8_0_q8_0_imp, q8_0::BLOCK_BYTES, q8_0::BLOCK_BYTES);
wrap_r!(q2_k_x4, 4, q2_k_xr_imp, q2_k_q8_k_imp, q2_k::BLOCK_BYTES, q8_k::BLOCK_BYTES);
wrap_r!(iq2_xxs_x4, 4, iq2_xxs_xr_imp, iq2_xxs_q8_k_imp, iq2_xxs::BLOCK_BYTES, q8_k::BLOCK_BYTES);
wrap_r!(q2_k_x8, 8, q2_k_xr_imp, q2_k_q8_k_imp, q2_k::BLOCK_BYTES, q8_k::BLOCK_BYTES);
wrap_r!(q4_k_x4, 4, q4_k_xr_imp, q4_k_q8_k_imp, q4_k::BLOCK_BYTES, q8_k::BLOCK_BYTES);
wrap_r!(q4_k_x8, 8, q4_k_xr_imp, q4_k_q8_k_imp, q4_k::BLOCK_BYTES, q8_k::BLOCK_BYTES);
wrap_r!(iq2_xxs_x8, 8, iq2_xxs_xr_imp, iq2_xxs_q8_k_imp, iq2_xxs::BLOCK_BYTES, q8_k::BLOCK_BYTES);

macro_rules! wrap_half {
    ($name:ident, $r:literal, $imp:ident, $single:ident) => {
        fn $name(w: &[u8], x: [&[f32]; $r]) -> [f32; $r] {
            // SAFETY: handed out by `dot_f4` only after `avx2::available()` (AVX2, FMA, F16C), the features
            // both functions are compiled for; the multi-row one gets rows of one length.
            unsafe {
                if x.iter().all(|r| r.len() == x[0].len()) {
                    $imp::<$r>(w, x)
                } else {
                    x.map(|r| super::avx2::$single(w, r))
                }
            }
        }
    };
}
wrap_half!(f16_x4, 4, f16_xr_imp, f16_f32_imp);
wrap_half!(bf16_x4, 4, bf16_xr_imp, bf16_f32_imp);

macro_rules! wrap_half_zmm {
    ($name:ident, $imp:ident, $single:ident) => {
        fn $name(w: &[u8], x: [&[f32]; 8]) -> [f32; 8] {
            // SAFETY: handed out by `dot_f8` only after `avx2::available()` (AVX2, FMA, F16C) and AVX-512 F were
            // detected, the features both functions are compiled for; the multi-row one gets rows of one length.
            unsafe {
                if x.iter().all(|r| r.len() == x[0].len()) {
                    $imp::<8>(w, x)
                } else {
                    x.map(|r| super::avx2::$single(w, r))
                }
            }
        }
    };
}
wrap_half_zmm!(f16_x8, f16_xr_zmm_imp, f16_f32_imp);
wrap_half_zmm!(bf16_x8, bf16_xr_zmm_imp, bf16_f32_imp);

/// `half_rows` on 512-bit vectors: `$cvt` turns 16 packed 16-bit values into 16 f32, the first 8 in the low half.
macro_rules! half_rows_zmm {
    ($w:ident, $x:ident, $R:ident, $cvt:expr, $scalar:expr) => {{
        let n = ($w.len() / 2).min($x[0].len());
        let wp = $w.as_ptr();
        let mut acc = [_mm512_setzero_ps(); $R];
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n, so 32 bytes of w at 2i and 64 bytes of every row (all `n` or longer) at 4i are in
            // bounds.
            unsafe {
                let wv = $cvt(ld_si256(wp.add(2 * i)));
                for r in 0..$R {
                    acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps($x[r].as_ptr().add(i)), acc[r]);
                }
            }
            i += 16;
        }
        std::array::from_fn(|r| {
            let mut s = hsum_halves(acc[r]);
            for j in i..n {
                s += $scalar(u16::from_le_bytes([$w[2 * j], $w[2 * j + 1]])) * $x[r][j];
            }
            s
        })
    }};
}

/// F16 · f32, `R` rows of one length, 512-bit.
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F present.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn f16_xr_zmm_imp<const R: usize>(w: &[u8], x: [&[f32]; R]) -> [f32; R] {
    half_rows_zmm!(w, x, R, _mm512_cvtph_ps, |b| half::f16::from_bits(b).to_f32())
}

/// BF16 · f32, `R` rows of one length, 512-bit.
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F present.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn bf16_xr_zmm_imp<const R: usize>(w: &[u8], x: [&[f32]; R]) -> [f32; R] {
    let cvt = |h: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
    half_rows_zmm!(w, x, R, cvt, super::super::f16::bf16_to_f32)
}

/// The body of the 16-bit float multi-row kernels: the single kernel's loop (`avx2`'s `half_dot`: two
/// accumulators, 16 values per step, a scalar tail) with each 16 weights converted once for the `$R` rows.
macro_rules! half_rows {
    ($w:ident, $x:ident, $R:ident, $cvt:expr, $scalar:expr) => {{
        let n = ($w.len() / 2).min($x[0].len());
        let wp = $w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; $R];
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n, so 32 bytes of w at 2i and 64 bytes of every row (all `n` or longer) at 4i are in
            // bounds.
            unsafe {
                let w0 = $cvt(_mm_loadu_si128(wp.add(2 * i) as *const __m128i));
                let w1 = $cvt(_mm_loadu_si128(wp.add(2 * i + 16) as *const __m128i));
                for r in 0..$R {
                    let xp = $x[r].as_ptr() as *const u8;
                    acc[r][0] = _mm256_fmadd_ps(w0, ld_ps(xp.add(4 * i)), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(w1, ld_ps(xp.add(4 * i + 32)), acc[r][1]);
                }
            }
            i += 16;
        }
        std::array::from_fn(|r| {
            let mut s = hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1]));
            for j in i..n {
                s += $scalar(u16::from_le_bytes([$w[2 * j], $w[2 * j + 1]])) * $x[r][j];
            }
            s
        })
    }};
}

/// F16 · f32, `R` rows of one length.
///
/// # Safety
/// AVX2/FMA/F16C present.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_xr_imp<const R: usize>(w: &[u8], x: [&[f32]; R]) -> [f32; R] {
    half_rows!(w, x, R, _mm256_cvtph_ps, |b| half::f16::from_bits(b).to_f32())
}

/// BF16 · f32, `R` rows of one length.
///
/// # Safety
/// AVX2/FMA/F16C present.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16_xr_imp<const R: usize>(w: &[u8], x: [&[f32]; R]) -> [f32; R] {
    half_rows!(w, x, R, bf16x8_to_ps, super::super::f16::bf16_to_f32)
}

/// Blocks whose scales one gather fetches per row (the Q8_0 multi-row kernels convert them eight at a time).
pub(super) const SCALE_CHUNK: usize = 8;

/// The f16 scales of blocks `0..8` of a Q8_0 row starting at `p` (the first two bytes of each 34-byte block),
/// as f32, exactly (F16C's conversion is exact, like `f16_at`); lanes where `live` is zero read nothing and are 0.
///
/// # Safety
/// AVX2/FMA/F16C present; every block whose lane is live in `live` lies inside the row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_0_scales(p: *const u8, live: __m256i) -> __m256 {
    let at = _mm256_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238);
    // SAFETY: live lanes read 4 bytes at the start of a block inside the row (the caller's contract); masked lanes
    // are not accessed.
    let g = unsafe { _mm256_mask_i32gather_epi32::<1>(_mm256_setzero_si256(), p as *const i32, at, live) };
    let h = _mm256_packus_epi32(_mm256_and_si256(g, _mm256_set1_epi32(0xffff)), _mm256_setzero_si256());
    _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(h)))
}

/// The f16 scales of the eight whole blocks of a Q8_0 row at `p` as f32, exactly, without a gather (slow on some
/// cores: about a third of the 512-bit single-row kernel's samples on Zen 4): block `k`'s scale is 16-bit word `17k`
/// of the chunk, so one word permute over its first 128 bytes picks blocks 0..4 and one over bytes 128..256 blocks
/// 4..8 (words 4, 21, 38, 55 there).
///
/// # Safety
/// AVX-512 F/BW present; eight whole blocks (272 bytes) at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
pub(super) unsafe fn q8_0_scales8(p: *const u8) -> __m256 {
    let idx =
        _mm512_setr_epi32(17 << 16, 51 << 16 | 34, 21 << 16 | 4, 55 << 16 | 38, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    // SAFETY: bytes 0..256 lie in the eight blocks (the caller's contract).
    let (l0, l1, l2, l3) = unsafe { (ld(p), ld(p.add(64)), ld(p.add(128)), ld(p.add(192))) };
    let lo = _mm512_permutex2var_epi16(l0, idx, l1);
    let hi = _mm512_permutex2var_epi16(l2, idx, l3);
    _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_mask_blend_epi16(0xf0, lo, hi)))
}

/// The body of the Q8_0 multi-row kernels, `$R` rows of `$n` blocks; `$prod(mag, qw, qa)` is one block's eight
/// i32 lanes `Σ₄ w·a` from the weight quants `qw`, their magnitudes `mag` and the activation quants `qa`.
///
/// Per chunk of eight blocks the rows' `d_w · d_a` are computed at once (one multiply per row: the single kernel's
/// product, bit for bit; the activation scales from `$da` where the caller converted them, else gathered) into a
/// small array the block loop broadcasts from; per block the
/// weight quants and their magnitudes are loaded once for every row. Even blocks accumulate into a row's first
/// accumulator, odd ones into its second, as in the single kernel.
macro_rules! q8_0_rows_body {
    ($w:ident, $a:ident, $da:ident, $n:ident, $R:ident, $prod:expr) => {{
        const B: usize = q8_0::BLOCK_BYTES;
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut acc = [[_mm256_setzero_ps(); 2]; $R];
        let mut dd = [[0f32; SCALE_CHUNK]; $R];
        let wp = $w.as_ptr();
        let mut c0 = 0;
        while c0 < $n {
            let nb = ($n - c0).min(SCALE_CHUNK);
            let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb as i32), lane);
            // SAFETY: blocks `c0..c0 + nb` lie inside the weight row and every activation row (`$n` blocks each).
            let dw = unsafe { q8_0_scales(wp.add(c0 * B), live) };
            for r in 0..$R {
                let da = if $da[r].len() >= $n {
                    // SAFETY: lanes below `nb` read `$da[r][c0..c0 + nb]`, inside the slice; the others nothing.
                    unsafe { _mm256_maskload_ps($da[r].as_ptr().add(c0), live) }
                } else {
                    // SAFETY: as above.
                    unsafe { q8_0_scales($a[r].as_ptr().add(c0 * B), live) }
                };
                // SAFETY: `dd[r]` is 8 writable f32.
                unsafe { _mm256_storeu_ps(dd[r].as_mut_ptr(), _mm256_mul_ps(dw, da)) };
            }
            let mut k = 0;
            while k < nb {
                let off = (c0 + k) * B;
                prefetch_ahead::<2>(wp.wrapping_add(off));
                for h in 0..2 {
                    if h == 1 && k + 1 == nb {
                        break;
                    }
                    let o = off + h * B;
                    // SAFETY: block `c0 + k + h < $n` of the weight row; 32 bytes at offset 2.
                    let qw = unsafe { ld_si256(wp.add(o + 2)) };
                    let mag = _mm256_sign_epi8(qw, qw);
                    for r in 0..$R {
                        // SAFETY: block `c0 + k + h < $n` of row `r`.
                        let qa = unsafe { ld_si256($a[r].as_ptr().add(o + 2)) };
                        let p = _mm256_cvtepi32_ps($prod(mag, qw, qa));
                        acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(dd[r][k + h]), p, acc[r][h]);
                    }
                }
                k += 2;
            }
            c0 += SCALE_CHUNK;
        }
        std::array::from_fn(|r| hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1])))
    }};
}

/// Q8_0 · Q8_0, `R` rows, AVX2: `maddubs(|w|, sign(a, w))` then `madd` with ones, as the single kernel.
///
/// # Safety
/// AVX2/FMA/F16C present; `w` and every `a[r]` hold at least `n` whole blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_xr_imp<const R: usize>(w: &[u8], a: [&[u8]; R], da: [&[f32]; R], n: usize) -> [f32; R] {
    let ones = _mm256_set1_epi16(1);
    q8_0_rows_body!(w, a, da, n, R, |mag, qw, qa| _mm256_madd_epi16(
        _mm256_maddubs_epi16(mag, _mm256_sign_epi8(qa, qw)),
        ones
    ))
}

/// Q8_0 · Q8_0, `R` rows, with AVX-512 VNNI's `vpdpbusd` on 256-bit vectors: `|w| · sign(a, w)` summed four bytes
/// per i32 lane in one instruction — the same lanes as `maddubs` + `madd` (no pair sum saturates: at most
/// 2·128·127), so the same exact integers. The 32 vector registers hold all eight rows' sixteen accumulators.
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F/VL/VNNI present; `w` and every `a[r]` hold at least `n` whole blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn q8_0_xr_vnni_imp<const R: usize>(w: &[u8], a: [&[u8]; R], da: [&[f32]; R], n: usize) -> [f32; R] {
    q8_0_rows_body!(w, a, da, n, R, |mag, qw, qa| _mm256_dpbusd_epi32(
        _mm256_setzero_si256(),
        mag,
        _mm256_sign_epi8(qa, qw)
    ))
}

/// `hsum(low half + high half)` of a 512-bit accumulator pair (the single kernel's final `hsum(acc₀ + acc₁)`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) fn hsum_halves(v: __m512) -> f32 {
    hsum_ps(_mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    ))
}

/// The per-row part of a Q2_K / Q4_K block `i` (shared by both multi-row kernels): `sumi = Σ_k madd(maddubs(plane k,
/// quants 32k..32k + 32), scales k)` into `acc[r]` scaled by `d_a · d`, and the minimums (`mins16`, one i16 per
/// block-sum lane) times the Q8_K block sums into `acc_min[r]` scaled by `d_a · dmin` — the single kernels' order.
///
/// # Safety
/// AVX2/FMA/F16C present; every `a[r]` holds Q8_K block `i`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kquant_rows<const R: usize>(
    a: &[&[u8]; R],
    i: usize,
    planes: &[__m256i; 8],
    scv: &[__m256i; 8],
    mins16: __m256i,
    (d, dmin): (f32, f32),
    acc: &mut [__m256; R],
    acc_min: &mut [__m256; R],
) {
    const AB: usize = q8_k::BLOCK_BYTES;
    for r in 0..R {
        let qa = &a[r][i * AB..(i + 1) * AB];
        let ap = qa.as_ptr();
        let da = q8_k::d(qa);
        // SAFETY: the 16 i16 block sums are bytes 260..292 of the 292-byte Q8_K block.
        let bsums = unsafe { ld_si256(ap.add(q8_k::BSUMS)) };
        let pm = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins16, bsums));
        acc_min[r] = _mm256_fmadd_ps(_mm256_set1_ps(da * dmin), pm, acc_min[r]);
        let mut sumi = _mm256_setzero_si256();
        for k in 0..8 {
            // SAFETY: 32 Q8_K quants at 4 + 32k ≤ 228 inside the 292-byte block (plane k = sub-blocks 2k, 2k+1).
            let qa8 = unsafe { ld_si256(ap.add(4 + 32 * k)) };
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(planes[k], qa8), scv[k]));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(da * d), _mm256_cvtepi32_ps(sumi), acc[r]);
    }
}

/// Q2_K · Q8_K, `R` rows.
///
/// # Safety
/// AVX2/FMA/F16C present; `w` holds `n` whole Q2_K blocks, every `a[r]` `n` whole Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2_k_xr_imp<const R: usize>(w: &[u8], a: [&[u8]; R], _da: [&[f32]; R], n: usize) -> [f32; R] {
    const WB: usize = q2_k::BLOCK_BYTES;
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0f);
    // SAFETY: each mask is a 32-byte array.
    let shuf: [__m256i; 8] = std::array::from_fn(|k| unsafe { ld_si256(Q2_SCALE_SHUF[k].as_ptr()) });
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_min = [_mm256_setzero_ps(); R];
    for i in 0..n {
        let b = &w[i * WB..(i + 1) * WB];
        let bp = b.as_ptr();
        prefetch_ahead::<2>(bp);
        // SAFETY: scales are bytes 0..16 of the 84-byte block.
        let sc8 = unsafe { _mm_loadu_si128(bp as *const __m128i) };
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc8), m4));
        let scales = _mm256_broadcastsi128_si256(_mm_and_si128(sc8, m4));
        let (dmin, d) = (f16_at(b, 82), f16_at(b, 80));
        // The eight 2-bit planes and their sub-block scale vectors, decoded once into L1 for the rows.
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
        // SAFETY: AVX2/FMA/F16C present and every row holds block `i` (this function's contract).
        unsafe { kquant_rows(&a, i, &planes, &scv, mins, (d, dmin), &mut acc, &mut acc_min) };
    }
    std::array::from_fn(|r| hsum_ps(acc[r]) - hsum_ps(acc_min[r]))
}

/// Q4_K · Q8_K, `R` rows: the nibble planes and sub-block scale vectors of a block decoded once (into L1) for
/// the rows.
///
/// # Safety
/// AVX2/FMA/F16C present; `w` holds `n` whole Q4_K blocks, every `a[r]` `n` whole Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_xr_imp<const R: usize>(w: &[u8], a: [&[u8]; R], _da: [&[f32]; R], n: usize) -> [f32; R] {
    const WB: usize = q4_k::BLOCK_BYTES;
    let m4 = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_min = [_mm256_setzero_ps(); R];
    for i in 0..n {
        let b = &w[i * WB..(i + 1) * WB];
        let bp = b.as_ptr();
        prefetch_ahead::<3>(bp);
        let (sc, mins) = q4_k_scales(&b[4..16]);
        let m8 = _mm_cvtsi64_si128(mins as i64);
        let m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        // Plane 2c / 2c + 1: the low / high nibbles of quant bytes 32c..32c + 32 (sub-blocks 2c, 2c + 1), with
        // their scales.
        let mut planes = [_mm256_setzero_si256(); 8];
        let mut scv = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            // SAFETY: qs are bytes 16..144 of the 144-byte block (32 read at 16 + 32c ≤ 112).
            let q4 = unsafe { ld_si256(bp.add(16 + 32 * c)) };
            planes[2 * c] = _mm256_and_si256(q4, m4);
            planes[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
            scv[2 * c] = _mm256_set1_epi16(((sc >> (16 * c)) & 0xff) as i16);
            scv[2 * c + 1] = _mm256_set1_epi16(((sc >> (16 * c + 8)) & 0xff) as i16);
        }
        // SAFETY: AVX2/FMA/F16C present and every row holds block `i` (this function's contract).
        unsafe { kquant_rows(&a, i, &planes, &scv, m16, (d, dmin), &mut acc, &mut acc_min) };
    }
    std::array::from_fn(|r| hsum_ps(acc[r]) - hsum_ps(acc_min[r]))
}

/// IQ2_XXS · Q8_K, `R` rows (the single kernel's two integer sums per block are one here: the same exact total).
///
/// # Safety
/// AVX2/FMA/F16C present; `w` holds `n` whole IQ2_XXS blocks, every `a[r]` `n` whole Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq2_xxs_xr_imp<const R: usize>(w: &[u8], a: [&[u8]; R], _da: [&[f32]; R], n: usize) -> [f32; R] {
    const WB: usize = iq2_xxs::BLOCK_BYTES;
    const AB: usize = q8_k::BLOCK_BYTES;
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..n {
        let b = &w[i * WB..(i + 1) * WB];
        let bp = b.as_ptr();
        prefetch_ahead::<2>(bp);
        let mut sumi = [_mm256_setzero_si256(); R];
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
            for r in 0..R {
                // SAFETY: group g's 32 Q8_K quants are at 4 + 32g ≤ 228 inside block `i` of row `r`.
                let qa8 = unsafe { ld_si256(a[r].as_ptr().add(i * AB + 4 + 32 * g)) };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(grid, _mm256_sign_epi8(qa8, signs)), scale);
                sumi[r] = _mm256_add_epi32(sumi[r], p);
            }
        }
        let dw = f16_at(b, 0);
        for r in 0..R {
            let d = dw * q8_k::d(&a[r][i * AB..(i + 1) * AB]) * 0.125;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_ps(acc[r]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::act::plain_act_type as plain;
    use crate::quant::{act_block_scales, quantize_acts, quantize_row};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Each row's block scales as the matmul hands them to the multi-row kernels.
    fn block_scales(act: crate::quant::ActType, rows: &[Vec<u8>]) -> Vec<Vec<f32>> {
        rows.iter()
            .map(|r| {
                let mut v = Vec::new();
                act_block_scales(act, r, &mut v);
                v
            })
            .collect()
    }

    /// Four and eight rows at once give exactly that many single AVX2 dots for every type: block counts odd and
    /// even, weight scales small and large, rows of unequal length.
    #[test]
    fn multi_row_kernels_match_single_dots_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(9);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
            let (Some(k4), Some(k)) = (dot_q4(ty), super::super::avx2::dot_q(ty)) else {
                eprintln!("no AVX2 here: nothing to test");
                return;
            };
            let k8 = dot_q8(ty);
            assert_eq!(k8.is_some(), ty != GgmlType::Q8_0 || vnni(), "{ty}: eight-row kernel");
            let bv = ty.block_values();
            for n in [1usize, 2, 3, 5, 8, 9, 17] {
                for scale in [1e-3f32, 1.0, 30.0] {
                    let x: Vec<f32> = (0..n * bv).map(|_| rng.gen_range(-1f32..1.0) * scale).collect();
                    let mut wr = vec![0u8; ty.row_bytes((n * bv) as u64).unwrap() as usize];
                    quantize_row(ty, &x, None, &mut wr).unwrap();
                    if ty == GgmlType::Q8_0 {
                        wr[2] = 0x80; // a -128 quant: files may hold them
                    }
                    let rows: Vec<Vec<u8>> = (0..8)
                        .map(|_| {
                            let v: Vec<f32> = (0..n * bv).map(|_| rng.gen_range(-3f32..3.0)).collect();
                            let mut q = Vec::new();
                            quantize_acts(plain(ty), &v, &mut q).unwrap();
                            q
                        })
                        .collect();
                    let want: Vec<u32> = rows.iter().map(|r| k(&wr, r).to_bits()).collect();
                    // Without and with the rows' block scales converted by the caller.
                    let scales = block_scales(plain(ty), &rows);
                    for da in [[&[][..]; 8], std::array::from_fn(|r| &scales[r][..])] {
                        let got = k4(&wr, std::array::from_fn(|r| &rows[r][..]), std::array::from_fn(|r| da[r]));
                        assert_eq!(got.map(f32::to_bits)[..], want[..4], "{ty} {n} blocks, scale {scale}");
                        if let Some(k8) = k8 {
                            let got = k8(&wr, std::array::from_fn(|r| &rows[r][..]), da);
                            assert_eq!(got.map(f32::to_bits)[..], want[..], "{ty} {n} blocks, scale {scale}, 8 rows");
                        }
                    }
                    let short = &rows[3][..rows[3].len() / 2];
                    let mixed: [&[u8]; 8] = std::array::from_fn(|r| if r == 3 { short } else { &rows[r][..] });
                    let want: Vec<u32> = mixed.iter().map(|r| k(&wr, r).to_bits()).collect();
                    let got = k4(&wr, std::array::from_fn(|r| mixed[r]), [&[]; 4]);
                    assert_eq!(got.map(f32::to_bits)[..], want[..4], "{ty} {n} blocks, unequal rows");
                    if let Some(k8) = k8 {
                        let got = k8(&wr, mixed, [&[]; 8]);
                        assert_eq!(got.map(f32::to_bits)[..], want[..], "{ty} {n} blocks, unequal rows");
                    }
                }
            }
        }
    }

    /// Every Q8_0 multi-row form here (AVX2; VNNI on 256-bit vectors where present) on raw bytes — every quant
    /// value including -128 on both sides, scales normal and subnormal — gives the AVX2 single kernel's bits, for
    /// 1..=20 blocks (whole and partial scale chunks, odd and even counts).
    #[test]
    fn q8_0_multi_row_forms_match_the_single_kernel_on_raw_bytes() {
        if !super::super::avx2::available() {
            eprintln!("no AVX2 here: nothing to test");
            return;
        }
        // SAFETY: AVX2, FMA and F16C were checked above.
        let single = |w: &[u8], a: &[u8]| unsafe { super::super::avx2::q8_0_q8_0_imp(w, a) };
        let mut forms: Vec<(&str, DotQ4, Option<DotQ8>)> = vec![("avx2", q8_0_x4, None)];
        if vnni() {
            forms.push(("vnni", q8_0_x4_vnni, Some(q8_0_x8_vnni)));
        }
        let mut rng = StdRng::seed_from_u64(17);
        let mut block = |rng: &mut StdRng| -> Vec<u8> {
            let mut b: Vec<u8> = (0..q8_0::BLOCK_BYTES).map(|_| rng.gen()).collect();
            // A finite f16 scale: normal (exponent 1..=30) or subnormal (exponent 0).
            let exp: u16 = if rng.gen_bool(0.3) { 0 } else { rng.gen_range(1..31) };
            let h = (rng.gen::<u16>() & 0x83ff) | (exp << 10);
            b[..2].copy_from_slice(&h.to_le_bytes());
            b
        };
        for n in 1..=20usize {
            let row = |rng: &mut StdRng, block: &mut dyn FnMut(&mut StdRng) -> Vec<u8>| -> Vec<u8> {
                (0..n).flat_map(|_| block(rng)).collect()
            };
            let w = row(&mut rng, &mut block);
            let rows: Vec<Vec<u8>> = (0..8).map(|_| row(&mut rng, &mut block)).collect();
            let want: Vec<u32> = rows.iter().map(|r| single(&w, r).to_bits()).collect();
            let scales = block_scales(crate::quant::ActType::Q8_0, &rows);
            for (name, k4, k8) in &forms {
                for da in [[&[][..]; 8], std::array::from_fn(|r| &scales[r][..])] {
                    let got = k4(&w, std::array::from_fn(|r| &rows[r][..]), std::array::from_fn(|r| da[r]));
                    assert_eq!(got.map(f32::to_bits)[..], want[..4], "{name}, 4 rows, {n} blocks");
                    if let Some(k8) = k8 {
                        let got = k8(&w, std::array::from_fn(|r| &rows[r][..]), da);
                        assert_eq!(got.map(f32::to_bits)[..], want[..], "{name}, 8 rows, {n} blocks");
                    }
                }
            }
        }
    }

    /// The F16 and BF16 four-row forms give the single kernel's bits for lengths with and without a scalar tail,
    /// and fall back to it for rows of unequal length.
    #[test]
    fn float_multi_row_kernels_match_single_dots_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(23);
        for ty in [GgmlType::F16, GgmlType::Bf16] {
            let (Some(k4), Some(k)) = (dot_f4(ty), super::super::avx2::dot_f32(ty)) else {
                eprintln!("no AVX2 here: nothing to test");
                return;
            };
            let k8 = dot_f8(ty);
            for n in [1usize, 15, 16, 33, 64, 100] {
                let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-2f32..2.0)).collect();
                let mut w = vec![0u8; 2 * n];
                quantize_row(ty, &x, None, &mut w).unwrap();
                let rows: Vec<Vec<f32>> = (0..4).map(|_| (0..n).map(|_| rng.gen_range(-3f32..3.0)).collect()).collect();
                let want: Vec<u32> = rows.iter().map(|r| k(&w, r).to_bits()).collect();
                let got = k4(&w, std::array::from_fn(|r| &rows[r][..]));
                assert_eq!(got.map(f32::to_bits)[..], want[..], "{ty} {n} values, 4 rows");
                let short = &rows[2][..n / 2];
                let mixed: [&[f32]; 4] = std::array::from_fn(|r| if r == 2 { short } else { &rows[r][..] });
                let want: Vec<u32> = mixed.iter().map(|r| k(&w, r).to_bits()).collect();
                assert_eq!(k4(&w, mixed).map(f32::to_bits)[..], want[..], "{ty} {n} values, unequal rows");
                if let Some(k8) = k8 {
                    let rows8: Vec<Vec<f32>> =
                        (0..8).map(|_| (0..n).map(|_| rng.gen_range(-3f32..3.0)).collect()).collect();
                    let want: Vec<u32> = rows8.iter().map(|r| k(&w, r).to_bits()).collect();
                    let got = k8(&w, std::array::from_fn(|r| &rows8[r][..]));
                    assert_eq!(got.map(f32::to_bits)[..], want[..], "{ty} {n} values, 8 rows");
                    let mixed: [&[f32]; 8] = std::array::from_fn(|r| if r == 5 { short } else { &rows8[r][..] });
                    let want: Vec<u32> = mixed.iter().map(|r| k(&w, r).to_bits()).collect();
                    assert_eq!(k8(&w, mixed).map(f32::to_bits)[..], want[..], "{ty} {n} values, unequal rows, 8");
                }
            }
        }
    }
}
