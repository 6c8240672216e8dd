//! Q8_0 · Q8_0 where AVX-512 F/BW/VL/VNNI are present: the single-row kernel ([`dot_q`]) and the any-row kernel
//! on activations flipped once per product ([`dot_q_flipped`]; decode with one or several sessions, prefill), all
//! under the sixteen-lane contract of [`crate::quant::q8_0::dot_q8_0_lanes16`]:
//! block `b`'s exact integer sum `Σ₃₂ w·a`, scaled by `d_w · d_a` with one FMA into lane `b mod 16`, the sixteen
//! lanes summed by a fixed tree at the end. Every kernel here returns exactly that value (tested against the
//! scalar reference, bit for bit), so the two forms and every row count agree with each other.
//!
//! Why sixteen lanes: a 512-bit `vpdpbusd` holds sixteen i32 lanes. Sixteen blocks are transposed so that lane
//! `b` of vector `g` holds bytes `4g..4g + 4` of block `b` (eight vectors per chunk of sixteen blocks); eight
//! `vpdpbusd` then leave each block's whole sum in its own lane, and one conversion and one FMA scale sixteen
//! blocks at once: per activation row one `vpdpbusd` per block pair, plus a conversion, a multiply and an FMA
//! per sixteen blocks.
//!
//! - Weights: `vpdpbusd`'s unsigned operand, `w + 128` (`w XOR 0x80`). Either packed once per matrix
//!   ([`crate::quant::PackedMat`]: chunks already transposed, eight aligned loads — [`dot_q_packed`]) or
//!   transposed per call from the blocks as stored (24 two-source permutes and 8 XORs per chunk, once per weight
//!   row for all activation rows of the call — [`dot_q_flipped`]).
//! - Activations, flipped ([`crate::quant::flip_acts`]): the signed quants in the same transposed chunks plus a
//!   line of corrections `-128 · Σ a` per block, made once per product by the caller, 64-byte aligned; their
//!   block scales as f32 ([`crate::quant::act_block_scales`]). Starting each block's sum at its correction,
//!   `Σ (w + 128)·a − 128·Σ a = Σ w·a` exactly (`w + 128 ≤ 255` times `|a| ≤ 127`, 32 products per lane: far from
//!   overflow; activation quants are in -127..=127, the contract of [`crate::quant::DotQ`]).
//! - The single-row form reads activation blocks as stored (34 bytes each): one `vpdpbusd` per block pair as
//!   stored (`|w|` times `a` with `w`'s sign), then a tree of permutes and adds gathers a chunk's sixteen block sums
//!   into lane order (no transpose of either side; `ds4-bench kernels`' own matvec and `quant::matvec` use it).
//! - A row's last chunk may be partial: its missing blocks are loaded as zeros and masked out of the FMA, so
//!   their lanes keep their values (as in the reference, where they get no update).
//!
//! Why packed passes of four rows: with the weights packed, passes of four activation rows over weight blocks held
//! in L2 keep the activations in L1 beside the weights (eight rows' 32 KiB no longer fit), and the L2 + L1 prefetch
//! of `x86::prefetch_ahead` keeps the streamed loop fed (each weight byte carries little work here).
//!
//! Soundness: [`dot_q`] / [`dot_q_flipped`] hand the kernels out only after AVX2/FMA/F16C and AVX-512
//! F/BW/VL/VNNI are detected (`avx2_x4::vnni_512`); the wrappers check every row's length before the vector code,
//! whose loads stay inside the whole blocks (weights, stored activations) or whole chunks (flipped activations)
//! the rows hold; partial chunks use masked loads.

use std::arch::x86_64::*;

use super::super::api::{DotQ, DotQFlipped, DotQPacked, FLIP_CHUNK_LINES, MAX_ROWS};
use super::super::packed::PackedRow;
use super::super::{q8_0, GgmlType};
use super::avx2_x4::{q8_0_scales, q8_0_scales8, vnni_512};
use super::x86::{hsum_ps, ld, ld_si256, prefetch_ahead};

const B: usize = q8_0::BLOCK_BYTES;
/// Blocks per chunk: one per 32-bit lane of a 512-bit vector.
pub(crate) const CHUNK: usize = 16;
/// Vectors (64-byte lines) per chunk: one per 4-byte group of a block.
pub(crate) const GROUPS: usize = 8;
/// Flipped activation bytes per chunk (eight lines of quants, one of corrections).
const CHUNK_BYTES: usize = 64 * FLIP_CHUNK_LINES;

/// The single-row kernel for `ty` where this CPU has the features (Q8_0 only).
pub(super) fn dot_q(ty: GgmlType) -> Option<DotQ> {
    (ty == GgmlType::Q8_0 && vnni_512()).then_some(q8_0_one as DotQ)
}

/// The flipped-activation kernel for `ty` where this CPU has the features (Q8_0 only).
pub(super) fn dot_q_flipped(ty: GgmlType) -> Option<DotQFlipped> {
    (ty == GgmlType::Q8_0 && vnni_512()).then_some(q8_0_flipped as DotQFlipped)
}

/// The packed-weight kernel for `ty` where this CPU has the features (Q8_0 only).
pub(super) fn dot_q_packed(ty: GgmlType) -> Option<DotQPacked> {
    (ty == GgmlType::Q8_0 && vnni_512()).then_some(q8_0_packed as DotQPacked)
}

/// Whether these kernels run here (and so define the Q8_0 results on this CPU).
#[cfg(test)]
fn available() -> bool {
    vnni_512()
}

fn q8_0_one(w: &[u8], a: &[u8]) -> f32 {
    let n = (w.len() / B).min(a.len() / B);
    // SAFETY: handed out by `dot_q` only after `vnni_512()`; both rows hold at least `n` whole blocks.
    unsafe { one_imp(w, a, n) }
}

/// Where a kernel call takes its weight row from.
#[derive(Clone, Copy)]
enum Weights {
    /// Q8_0 blocks as stored (transposed per call).
    Blocks(*const u8),
    /// A packed row: quant lines and f16 scales (see [`crate::quant::PackedMat`]).
    Packed(*const u8, *const u16),
}

/// `out[i] = dot(w, a_i)` for `i < out.len()`, up to eight rows per weight decode; a row whose flipped quants
/// or scales hold fewer blocks than `w` gets NaN.
fn q8_0_flipped(w: &[u8], au: &[&[u8]], da: &[&[f32]], out: &mut [f32]) {
    rows(Weights::Blocks(w.as_ptr()), w.len() / B, au, da, out);
}

/// [`q8_0_flipped`] on a packed weight row (whose quants and scales must cover its blocks' chunks, else NaN).
fn q8_0_packed(w: PackedRow<'_>, au: &[&[u8]], da: &[&[f32]], out: &mut [f32]) {
    let n = w.blocks;
    let chunks = n.div_ceil(CHUNK);
    if w.quants.len() < chunks * GROUPS || w.scales.len() < chunks * CHUNK {
        out.fill(f32::NAN);
        return;
    }
    rows(Weights::Packed(w.quants.as_ptr() as *const u8, w.scales.as_ptr()), n, au, da, out);
}

/// Both kernels' row loop: `w` holds `n` blocks (as stored or packed, checked by the caller).
fn rows(w: Weights, n: usize, au: &[&[u8]], da: &[&[f32]], out: &mut [f32]) {
    let m = out.len().min(au.len()).min(da.len());
    out[m..].fill(f32::NAN);
    let ok = |i: usize| au[i].len() >= n.div_ceil(CHUNK) * CHUNK_BYTES && da[i].len() >= n;
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
fn run<const R: usize>(w: Weights, au: &[&[u8]], da: &[&[f32]], n: usize) -> [f32; R] {
    let (a, d) = (std::array::from_fn(|r| au[r]), std::array::from_fn(|r| da[r]));
    // SAFETY: handed out by `dot_q_flipped` / `dot_q_packed` only after `vnni_512()`; `w` holds `n` whole blocks
    // (as stored, or packed with whole chunks of quants and scales) and every row `n.div_ceil(16)` whole chunks
    // of flipped quants and `n` scales (checked by the callers).
    unsafe {
        match w {
            Weights::Blocks(p) => rows_imp::<R, false>(p, std::ptr::null(), a, d, n),
            Weights::Packed(q, s) => rows_imp::<R, true>(q, s, a, d, n),
        }
    }
}

/// The two-source permute indices of the chunk transpose (see [`transpose`]), one row per permute kind.
const TRANSPOSE_IX: [[i32; 16]; 6] = {
    let mut t = [[0i32; 16]; 6];
    let mut i = 0;
    while i < 16 {
        // Level 1: element `(b, g)` of four blocks at `4g + b`, from pair `b / 2`'s half `b % 2`, group `g`.
        let (g, b) = (i / 4, i % 4);
        let src = (b / 2) * 16 + (b % 2) * 8;
        t[0][i] = (src + g) as i32;
        t[1][i] = (src + g + 4) as i32;
        // Level 2: element `(b, g)` of eight blocks at `8g + b`.
        let (g, b) = (i / 8, i % 8);
        let src = (b / 4) * 16 + b % 4;
        t[2][i] = (src + g * 4) as i32;
        t[3][i] = (src + (g + 2) * 4) as i32;
        // Level 3: block `b` of sixteen at `b`.
        let src = (i / 8) * 16 + i % 8;
        t[4][i] = src as i32;
        t[5][i] = (src + 8) as i32;
        i += 1;
    }
    t
};

/// [`TRANSPOSE_IX`] as vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn transpose_indices() -> [__m512i; 6] {
    // SAFETY: each row is 16 readable i32 (64 bytes).
    TRANSPOSE_IX.map(|v| unsafe { _mm512_loadu_si512(v.as_ptr() as *const __m512i) })
}

/// A chunk's sixteen blocks given as eight block pairs (`v[p]`: block `2p`'s 32 bytes in lanes 0..8, block
/// `2p + 1`'s in lanes 8..16) transposed: lane `b` of result `g` is bytes `4g..4g + 4` of block `b`. Three levels
/// of eight two-source permutes: pairs of pairs (four blocks, groups 0..4 / 4..8, element `(b, g)` at `4g + b`),
/// then eight blocks (two groups each, at `8g + b`), then all sixteen (one group each, at `b`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn transpose(v: [__m512i; 8], ix: &[__m512i; 6]) -> [__m512i; 8] {
    let p2 = |a: __m512i, i: usize, b: __m512i| _mm512_permutex2var_epi32(a, ix[i], b);
    let lo: [__m512i; 4] = std::array::from_fn(|q| p2(v[2 * q], 0, v[2 * q + 1]));
    let hi: [__m512i; 4] = std::array::from_fn(|q| p2(v[2 * q], 1, v[2 * q + 1]));
    let g01: [__m512i; 2] = std::array::from_fn(|h| p2(lo[2 * h], 2, lo[2 * h + 1]));
    let g23: [__m512i; 2] = std::array::from_fn(|h| p2(lo[2 * h], 3, lo[2 * h + 1]));
    let g45: [__m512i; 2] = std::array::from_fn(|h| p2(hi[2 * h], 2, hi[2 * h + 1]));
    let g67: [__m512i; 2] = std::array::from_fn(|h| p2(hi[2 * h], 3, hi[2 * h + 1]));
    [
        p2(g01[0], 4, g01[1]),
        p2(g01[0], 5, g01[1]),
        p2(g23[0], 4, g23[1]),
        p2(g23[0], 5, g23[1]),
        p2(g45[0], 4, g45[1]),
        p2(g45[0], 5, g45[1]),
        p2(g67[0], 4, g67[1]),
        p2(g67[0], 5, g67[1]),
    ]
}

/// The quants of the `nb ≤ 16` Q8_0 blocks at `p` (weights or stored activations) as eight block pairs (see
/// [`transpose`]); blocks at `nb` and beyond are zeros and not read.
///
/// # Safety
/// AVX-512 F present; `nb` whole blocks at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn chunk_pairs(p: *const u8, nb: usize) -> [__m512i; 8] {
    if nb >= CHUNK {
        // SAFETY: sixteen whole blocks at `p` (the caller's contract): block `b`'s quants are bytes `34 b + 2..+32`.
        return std::array::from_fn(|q| unsafe {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(ld_si256(p.add(2 * q * B + 2))),
                ld_si256(p.add((2 * q + 1) * B + 2)),
            )
        });
    }
    let half = |b: usize| {
        if b < nb {
            // SAFETY: block `b < nb` lies at `p + 34 b` (the caller's contract); its quants are bytes 2..34.
            unsafe { ld_si256(p.add(b * B + 2)) }
        } else {
            _mm256_setzero_si256()
        }
    };
    std::array::from_fn(|q| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(half(2 * q)), half(2 * q + 1)))
}

/// The f16 scales of the `nb ≤ 16` blocks at `p` as f32 (exact), lanes at `nb` and beyond 0 and not read.
///
/// # Safety
/// AVX-512 F/BW and AVX2/F16C present; `nb` whole blocks at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn chunk_scales(p: *const u8, nb: usize) -> __m512 {
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let live = |k: usize| _mm256_cmpgt_epi32(_mm256_set1_epi32(nb.saturating_sub(k) as i32), lane);
    // SAFETY: sixteen whole blocks (544 bytes) at `p` when `nb == 16`, so both permute loads stay inside; else
    // the gathers read only blocks below `nb` (the caller's contract).
    let (lo, hi) = unsafe {
        if nb == CHUNK {
            (q8_0_scales8(p), q8_0_scales8(p.add(8 * B)))
        } else {
            (q8_0_scales(p, live(0)), q8_0_scales(p.add(8 * B), live(8)))
        }
    };
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi)))
}

/// Lanes of a chunk of `nb` blocks.
fn lanes(nb: usize) -> __mmask16 {
    if nb >= CHUNK {
        0xffff
    } else {
        (1u16 << nb) - 1
    }
}

/// The contract's final sum of the sixteen lanes: `h8[i] = l[i] + l[i + 8]`, `h4[i] = h8[i] + h8[i + 4]`, then
/// `(h4[0] + h4[2]) + (h4[1] + h4[3])`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn hsum16(v: __m512) -> f32 {
    hsum_ps(_mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    ))
}

/// Q8_0 · flipped activations, `R` rows of `n` blocks; the weights packed (`PACKED`: quant lines at `w`, f16
/// scales at `ws`) or as stored (blocks at `w`).
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI present; `w` holds `n` whole blocks (packed: `n.div_ceil(16)` whole
/// chunks of lines at `w` and of scales at `ws`), every `au[r]` at least `n.div_ceil(16)` whole chunks of the
/// flipped format (576 bytes each) and every `da[r]` at least `n` scales.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_imp<const R: usize, const PACKED: bool>(
    w: *const u8,
    ws: *const u16,
    au: [&[u8]; R],
    da: [&[f32]; R],
    n: usize,
) -> [f32; R] {
    let ix = transpose_indices();
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let mut acc = [_mm512_setzero_ps(); R];
    for c in 0..n.div_ceil(CHUNK) {
        let nb = (n - c * CHUNK).min(CHUNK);
        // The chunk's weights transposed and unsigned (`t`), and their scales as f32 (`dw`); written out here
        // rather than in helpers, which the compiler did not always inline (a call per chunk, its result through
        // memory, cost the one-row output head half its speed).
        let (t, dw) = if PACKED {
            let base = w.wrapping_add(c * GROUPS * 64);
            prefetch_ahead::<GROUPS>(base);
            prefetch_ahead::<1>(ws.wrapping_add(c * CHUNK) as *const u8);
            // SAFETY: the chunk's eight lines (64-byte aligned `FlipLine`s) and sixteen scales lie inside the
            // packed row (the caller's contract).
            unsafe {
                let t: [__m512i; 8] = std::array::from_fn(|g| _mm512_load_si512(base.add(64 * g) as *const __m512i));
                (t, _mm512_cvtph_ps(_mm256_loadu_si256(ws.add(c * CHUNK) as *const __m256i)))
            }
        } else {
            let base = w.wrapping_add(c * CHUNK * B);
            for l in 0..9 {
                prefetch_ahead::<1>(base.wrapping_add(64 * l));
            }
            // SAFETY: blocks `16c..16c + nb` lie inside the weight row (the caller's contract).
            let (v, dw) = unsafe { (chunk_pairs(base, nb), chunk_scales(base, nb)) };
            let v: [__m512i; 8] = std::array::from_fn(|q| _mm512_xor_si512(v[q], flip));
            (transpose(v, &ix), dw)
        };
        let live = lanes(nb);
        for r in 0..R {
            let ap = au[r].as_ptr().wrapping_add(c * CHUNK_BYTES);
            // SAFETY: chunk `c` (576 bytes at `ap`: eight lines of quants, then the corrections) lies inside row
            // `r`'s flipped activations.
            let (mut s0, mut s1) = (unsafe { ld(ap.add(64 * GROUPS)) }, _mm512_setzero_si512());
            for g in 0..GROUPS / 2 {
                // SAFETY: as above.
                let (u0, u1) = unsafe { (ld(ap.add(64 * g)), ld(ap.add(64 * (g + GROUPS / 2)))) };
                s0 = _mm512_dpbusd_epi32(s0, t[g], u0);
                s1 = _mm512_dpbusd_epi32(s1, t[g + GROUPS / 2], u1);
            }
            let s = _mm512_add_epi32(s0, s1);
            // SAFETY: scales `16c..16c + nb` of row `r` (`n` of them); masked lanes are not read.
            let d = unsafe { _mm512_maskz_loadu_ps(live, da[r].as_ptr().wrapping_add(c * CHUNK)) };
            acc[r] = _mm512_mask3_fmadd_ps(_mm512_mul_ps(dw, d), _mm512_cvtepi32_ps(s), acc[r], live);
        }
    }
    std::array::from_fn(|r| hsum16(acc[r]))
}

/// The permute indices of [`block_sums`]: per level, the first and the second operand of each lane's add.
const REDUCE_IX: [[i32; 16]; 6] = {
    let mut t = [[0i32; 16]; 6];
    let mut i = 0;
    while i < 16 {
        // Level 1: four blocks, four partial sums each, at `4b + k`: lanes `2k`, `2k + 1` of block `b`.
        let (b, k) = (i / 4, i % 4);
        let src = (b / 2) * 16 + (b % 2) * 8 + 2 * k;
        (t[0][i], t[1][i]) = (src as i32, src as i32 + 1);
        // Level 2: eight blocks, two partial sums each, at `2b + k`.
        let (b, k) = (i / 2, i % 2);
        let src = (b / 4) * 16 + (b % 4) * 4 + 2 * k;
        (t[2][i], t[3][i]) = (src as i32, src as i32 + 1);
        // Level 3: sixteen blocks at `b`.
        let src = (i / 8) * 16 + (i % 8) * 2;
        (t[4][i], t[5][i]) = (src as i32, src as i32 + 1);
        i += 1;
    }
    t
};

/// [`REDUCE_IX`] as vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn reduce_indices() -> [__m512i; 6] {
    // SAFETY: each row is 16 readable i32 (64 bytes).
    REDUCE_IX.map(|v| unsafe { _mm512_loadu_si512(v.as_ptr() as *const __m512i) })
}

/// Sixteen blocks' integer sums in lane order from eight block pairs' lane sums (`r[p]`: block `2p`'s eight
/// partial sums in lanes 0..8, block `2p + 1`'s in lanes 8..16): three levels of pairwise adds, each lane's two
/// operands picked by two-source permutes (14 permutes and 7 adds; integer adds, so exact in any order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn block_sums(r: [__m512i; 8], ix: &[__m512i; 6]) -> __m512i {
    let add = |a: __m512i, i: usize, b: __m512i| {
        _mm512_add_epi32(_mm512_permutex2var_epi32(a, ix[i], b), _mm512_permutex2var_epi32(a, ix[i + 1], b))
    };
    let y: [__m512i; 4] = std::array::from_fn(|q| add(r[2 * q], 0, r[2 * q + 1]));
    let z: [__m512i; 2] = std::array::from_fn(|h| add(y[2 * h], 2, y[2 * h + 1]));
    add(z[0], 4, z[1])
}

/// Q8_0 · Q8_0 activation blocks as stored, one row of `n` blocks. Each block pair's lane sums come from one
/// `vpdpbusd` on the blocks as stored (`|w|` times `a` negated where `w < 0`: unsigned times signed, exact), and
/// [`block_sums`] turns a chunk's eight pairs into the sixteen block sums in lane order — cheaper here than
/// transposing both sides, and no correction term.
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F/BW/VL/VNNI present; `w` and `a` hold at least `n` whole blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn one_imp(w: &[u8], a: &[u8], n: usize) -> f32 {
    let ix = reduce_indices();
    let zero = _mm512_setzero_si512();
    let mut acc = _mm512_setzero_ps();
    for c in 0..n.div_ceil(CHUNK) {
        let nb = (n - c * CHUNK).min(CHUNK);
        let (wb, ab) = (w.as_ptr().wrapping_add(c * CHUNK * B), a.as_ptr().wrapping_add(c * CHUNK * B));
        for l in 0..9 {
            prefetch_ahead::<1>(wb.wrapping_add(64 * l));
        }
        // SAFETY: blocks `16c..16c + nb` lie inside both rows (`n` blocks each).
        let (qw, qa, dw, da) =
            unsafe { (chunk_pairs(wb, nb), chunk_pairs(ab, nb), chunk_scales(wb, nb), chunk_scales(ab, nb)) };
        let r: [__m512i; 8] = std::array::from_fn(|p| {
            let sa = _mm512_mask_sub_epi8(qa[p], _mm512_movepi8_mask(qw[p]), zero, qa[p]);
            _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(qw[p]), sa)
        });
        let p = _mm512_cvtepi32_ps(block_sums(r, &ix));
        acc = _mm512_mask3_fmadd_ps(_mm512_mul_ps(dw, da), p, acc, lanes(nb));
    }
    hsum16(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{act_block_scales, flip_acts, q8_0::dot_q8_0_lanes16, ActType, FlipLine, PackedMat};
    use rand::{Rng, SeedableRng};

    /// `rows` rows of `nb` random Q8_0 blocks (finite f16 scales of either sign, a quarter of them subnormal;
    /// quants in -127..=127 for activations, the whole i8 range for weights).
    fn blocks(rng: &mut impl Rng, rows: usize, nb: usize, acts: bool) -> Vec<u8> {
        let mut v = vec![0u8; rows * nb * B];
        for b in v.chunks_exact_mut(B) {
            let exp: u16 = if rng.gen_bool(0.25) { 0 } else { rng.gen_range(1..31) };
            let h = (rng.gen::<u16>() & 0x83ff) | (exp << 10);
            b[..2].copy_from_slice(&h.to_le_bytes());
            for q in &mut b[2..] {
                *q = if acts { rng.gen_range(-127i8..=127) as u8 } else { rng.gen::<u8>() };
            }
        }
        v
    }

    fn flipped(a: &[u8], rb: usize) -> (Vec<FlipLine>, Vec<f32>) {
        let (mut f, mut d) = (Vec::new(), Vec::new());
        flip_acts(ActType::Q8_0, a, rb, &mut f);
        act_block_scales(ActType::Q8_0, a, &mut d);
        (f, d)
    }

    /// Every row count 1..=9 (two calls' worth at 9) and block counts around the chunk size: each output equals
    /// the scalar reference of the contract bit for bit, for the flipped form (weights as stored and packed) and
    /// the single-row form alike.
    #[test]
    fn every_form_is_the_sixteen_lane_reference() {
        if !available() {
            eprintln!("no AVX-512 VNNI: the sixteen-lane Q8_0 kernels do not run here");
            return;
        }
        let (one, flip) = (dot_q(GgmlType::Q8_0).unwrap(), dot_q_flipped(GgmlType::Q8_0).unwrap());
        let packed = dot_q_packed(GgmlType::Q8_0).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for nb in [1, 2, 15, 16, 17, 31, 33, 64, 128, 131] {
            let rb = nb * B;
            let w = blocks(&mut rng, 3, nb, false);
            let pw = PackedMat::pack_q8_0(&w, 3, rb).unwrap();
            let a = blocks(&mut rng, 9, nb, true);
            let (f, d) = flipped(&a, rb);
            let lines = f.len() / 9;
            assert_eq!(lines, FLIP_CHUNK_LINES * nb.div_ceil(CHUNK), "{nb} blocks: lines per flipped row");
            let au: Vec<&[u8]> = (0..9).map(|i| bytemuck::cast_slice(&f[i * lines..(i + 1) * lines])).collect();
            let da: Vec<&[f32]> = (0..9).map(|i| &d[i * nb..(i + 1) * nb]).collect();
            for (wi, wr) in w.chunks_exact(rb).enumerate() {
                for m in 1..=9 {
                    let (mut out, mut pout) = (vec![0f32; m], vec![0f32; m]);
                    flip(wr, &au[..m], &da[..m], &mut out);
                    packed(pw.view().row(wi), &au[..m], &da[..m], &mut pout);
                    for (i, (o, p)) in out.iter().zip(&pout).enumerate() {
                        let want = dot_q8_0_lanes16(wr, &a[i * rb..(i + 1) * rb]);
                        assert_eq!(o.to_bits(), want.to_bits(), "{nb} blocks, {m} rows, row {i}: {o} vs {want}");
                        assert_eq!(p.to_bits(), want.to_bits(), "packed, {nb} blocks, {m} rows, row {i}: {p}");
                    }
                }
                for ar in a.chunks_exact(rb) {
                    let (got, want) = (one(wr, ar), dot_q8_0_lanes16(wr, ar));
                    assert_eq!(got.to_bits(), want.to_bits(), "{nb} blocks, single row: {got} vs {want}");
                }
            }
        }
    }

    /// The integer extremes: weights -128 and 127 against activations ±127 (the largest lane sums and the
    /// correction at its largest) — exact, so equal to the reference.
    #[test]
    fn extreme_quants_match() {
        if !available() {
            eprintln!("no AVX-512 VNNI: the sixteen-lane Q8_0 kernels do not run here");
            return;
        }
        let (one, flip) = (dot_q(GgmlType::Q8_0).unwrap(), dot_q_flipped(GgmlType::Q8_0).unwrap());
        let nb = 35;
        let rb = nb * B;
        for (wq, aq) in [(-128i8, 127i8), (-128, -127), (127, 127), (127, -127)] {
            let mk = |q: i8| {
                let mut v = vec![0u8; rb];
                for b in v.chunks_exact_mut(B) {
                    b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                    b[2..].fill(q as u8);
                }
                v
            };
            let (w, a) = (mk(wq), mk(aq));
            let (f, d) = flipped(&a, rb);
            let mut out = [0f32];
            flip(&w, &[bytemuck::cast_slice(&f)], &[&d], &mut out);
            let want = dot_q8_0_lanes16(&w, &a);
            assert_eq!(want, nb as f32 * 32.0 * wq as f32 * aq as f32 * 0.25, "the reference is exact here");
            assert_eq!(out[0].to_bits(), want.to_bits(), "flipped, w {wq} a {aq}");
            let pw = PackedMat::pack_q8_0(&w, 1, rb).unwrap();
            dot_q_packed(GgmlType::Q8_0).unwrap()(pw.view().row(0), &[bytemuck::cast_slice(&f)], &[&d], &mut out);
            assert_eq!(out[0].to_bits(), want.to_bits(), "packed, w {wq} a {aq}");
            assert_eq!(one(&w, &a).to_bits(), want.to_bits(), "single, w {wq} a {aq}");
        }
    }

    /// A flipped row or scale slice shorter than the weight row gives NaN for that row only.
    #[test]
    fn short_rows_get_nan() {
        if !available() {
            eprintln!("no AVX-512 VNNI: the sixteen-lane Q8_0 kernels do not run here");
            return;
        }
        let flip = dot_q_flipped(GgmlType::Q8_0).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (nb, rb) = (20, 20 * B);
        let w = blocks(&mut rng, 1, nb, false);
        let a = blocks(&mut rng, 2, nb, true);
        let (f, d) = flipped(&a, rb);
        let lines = f.len() / 2;
        let full: &[u8] = bytemuck::cast_slice(&f[..lines]);
        let short: &[u8] = bytemuck::cast_slice(&f[lines..2 * lines - FLIP_CHUNK_LINES]);
        let mut out = [0f32; 3];
        flip(&w, &[full, short], &[&d[..nb], &d[nb..]], &mut out);
        assert_eq!(out[0].to_bits(), dot_q8_0_lanes16(&w, &a[..rb]).to_bits());
        assert!(out[1].is_nan() && out[2].is_nan(), "short row and missing row: {out:?}");
        flip(&w, &[full], &[&d[..nb - 1]], &mut out[..1]);
        assert!(out[0].is_nan(), "short scales: {}", out[0]);
        let pw = PackedMat::pack_q8_0(&w, 1, rb).unwrap();
        let packed = dot_q_packed(GgmlType::Q8_0).unwrap();
        packed(pw.view().row(0), &[full, short], &[&d[..nb], &d[nb..]], &mut out);
        assert_eq!(out[0].to_bits(), dot_q8_0_lanes16(&w, &a[..rb]).to_bits());
        assert!(out[1].is_nan() && out[2].is_nan(), "packed: short row and missing row: {out:?}");
        let row = pw.view().row(0);
        let cut = PackedRow { quants: &row.quants[..row.quants.len() - 1], ..row };
        packed(cut, &[full], &[&d[..nb]], &mut out[..1]);
        assert!(out[0].is_nan(), "packed row shorter than its blocks: {}", out[0]);
    }
}
