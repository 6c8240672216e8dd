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
//! octets of a group) accumulates one group over the whole pair. Per pair:
//! - `vshufps` gathers the grid-index dwords of both blocks into one vector (`idx`) and their aux words (signs and
//!   scale) into another, in the same lane order: i32 lane `4m + r` is group `2m + r % 2` of block `r / 2`
//!   (`q8_k::pair_value` lays the activations out to match); `vpmultishiftqb` pulls each octet's 7-bit sign index
//!   out of the aux words;
//! - per half `h` of the values (`4h..4h + 4`): two `vpermt2b` look the grid index up in two 128-byte tables
//!   (points 0..128 and 128..256, index bit 7 ignored) whose bytes pack the levels (0, 1, 2 for 8, 25, 43) of the
//!   point's four values, two bits each, and a byte blend under index bit 7 (`vpmovb2m`) picks the right one; one
//!   `gf2p8affineqb` turns the sign index into the half's four signs at chosen bit positions (sign 7 is the parity
//!   of the index, as `KSIGNS_IQ2XS` has it: linear over GF(2)); two `vpternlogd` selects (one after a shift)
//!   merge levels and signs into two index bytes, each holding two values' levels and signs in its low 6 bits;
//! - per value: `vpermb` on a 64-entry table maps its index byte to `128 ± magnitude` (unsigned, as `vpdpbusd`
//!   wants its first operand; the activations are the signed one) and `vpdpbusd` accumulates; the bias comes off
//!   once per pair, `−128·Σq` from the group's two block sums by one `vpdpwssd` (the pair layout stores the sums in
//!   lane order; LLVM emits `vpmaddwd` + `vpaddd` for it, and writing it out measured no faster). A lane sums one
//!   group: |Σ(128 ± m)·q| ≤ 32·171·127 < 2^20, the result < 2^18, exact in f32;
//! - per group lane: conversion to f32, times `2·scale + 1` (looked up by `vpermps`), times `d_w` (both blocks' f16
//!   scales converted at once) times `d_a`; `1/8` once at the end.
//!
//! A row's last block, when the block count is odd, is plain Q8_K and goes through the gather kernel.
//!
//! Several weight rows against 2..=5 activation rows ([`dot_q_rows`] with more than one weight row: the routed
//! experts in prefill, ~6 rows each in a 256-token chunk, groups of ≤ 5 often) go *tiled*: two pairs of 16 weight
//! rows at a time, each row's accumulators parked in between, so the activations' span (≤ 5 · 2 · 584 bytes)
//! stays in L1 across the weight rows instead of whole rows (5 · 4672 bytes for 4096 values, with the weights
//! streaming through), and the same span of the next 16 rows is prefetched into L2 (the order no longer reads a
//! row straight on). Bit-identical: each row's f32 operations are the untiled ones, in the same order.
//! Tiling pays for 3 to 5 activation rows; at 6 rows it breaks even and at 7 and 8 rows it loses, so those stay
//! untiled.
//! Only the f32 accumulation order differs from the scalar reference.
//!
//! The one-row, four-row and any-row-count ([`dot_q_rows`], 1..=8 rows per decode) kernels share one `N`-generic
//! body.
//!
//! What bounds it (Sapphire Rapids): ports 0 and 5 (every 512-bit op issues there; `vpermt2b` takes port 5 for
//! two cycles; `vpermb`, `vpmultishiftqb`, `vshufps`, `vpermd` only port 5; `gf2p8affineqb`, `vpdpbusd`,
//! `vpmovb2m`, shifts and f32 math only port 0): ~52 such uops per pair, and the `vpdpbusd` chains
//! (two accumulators: one chain of eight was 4 % slower, four 5 %). Tried and slower here: the previous kernels —
//! one `vpermb` + `vpmultishiftqb` + `gf2p8affineqb` per value with signs by `vptestmb` + masked `vpsubb` (46.6
//! G/s), the 128-entry lookups with `gf2p8affineqb` magnitudes and the same sign path (51.9); octet-major layouts
//! with gathers (33 cycles per block) or 16-bit level codes (35); sign masks transposed once per pair and loaded
//! by `kmovq k, m64` (each such load costs a port-5 uop *and* stalls on the store: 29 G/s).

use std::arch::x86_64::*;

use super::super::api::DotQ;
use super::super::iq2_tables::IQ2XXS_GRID;
use super::super::{iq2_xxs, q8_k};
use super::x86::{dot_rows, ld, ld64, prefetch_ahead, RowsKernel, A64};

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
    let [v] = unsafe { imp(w, [a]) };
    v
}

/// Level index (0, 1, 2) of a grid magnitude (8, 25, 43).
const fn level(m: u64) -> u8 {
    match m {
        8 => 0,
        25 => 1,
        _ => 2,
    }
}

/// `LEVELS[h][t]`: byte `i` of the 128-byte table (two vectors) for grid points `128t..128t + 128`, bits
/// `2e..2e+2` = the level of value `4h + e` of point `128t + i`.
const fn level_table(h: usize, t: usize) -> [A64; 2] {
    let mut v = [A64([0u8; 64]), A64([0u8; 64])];
    let mut i = 0;
    while i < 128 {
        let point = IQ2XXS_GRID[128 * t + i];
        let mut e = 0;
        while e < 4 {
            v[i / 64].0[i % 64] |= level((point >> (8 * (4 * h + e))) & 0xff) << (2 * e);
            e += 1;
        }
        i += 1;
    }
    v
}

const LEVELS: [[[A64; 2]; 2]; 2] = [[level_table(0, 0), level_table(0, 1)], [level_table(1, 0), level_table(1, 1)]];

/// `vpmultishiftqb` over the aux words: byte `p` = bits `7(p % 4)..+8` of the aux word of its i32 lane `p / 4`,
/// the low or high dword of qword `p / 8`.
const SIGN_CTRL: A64 = bytes64!(|p| (32 * (p % 8 / 4) + 7 * (p % 4)) as u8);

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

/// Per half `h`, a sign-index byte → the signs the two `vpermb` index bytes take: bits 4, 5 = signs of values
/// `4h`, `4h + 1`, bits 0, 1 = signs of values `4h + 2`, `4h + 3` (sign bit `j` is index bit `j`, sign 7 the
/// parity of the index, as in `KSIGNS_IQ2XS`); bits 2, 3, 6, 7 zero.
const fn signs_m(h: usize) -> i64 {
    const fn bit(j: usize) -> u8 {
        if j == 7 {
            0x7f
        } else {
            1 << j
        }
    }
    matrix([bit(4 * h + 2), bit(4 * h + 3), 0, 0, bit(4 * h), bit(4 * h + 1), 0, 0])
}

const SIGNS_M: [i64; 2] = [signs_m(0), signs_m(1)];

/// The `vpternlogd` truth table of `c ? a : b` (bit-wise select).
const SELECT: i32 = 0xe4;

/// `WEIGHT[e]`: the `vpermb` table of value `4h + e` of a half: index bits (levels and signs placed as the
/// index bytes hold them, see `imp`) → `128 ± magnitude` (level 3 never occurs).
const fn weight_table(e: usize) -> A64 {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let (level, neg) = match e {
            0 => (i & 3, (i >> 4) & 1),
            1 => ((i >> 2) & 3, (i >> 5) & 1),
            2 => ((i >> 2) & 3, i & 1),
            _ => ((i >> 4) & 3, (i >> 1) & 1),
        };
        let m = [8u8, 25, 43, 0][level];
        t[i] = if neg == 1 { 128 - m } else { 128 + m };
        i += 1;
    }
    A64(t)
}

const WEIGHT: [A64; 4] = [weight_table(0), weight_table(1), weight_table(2), weight_table(3)];

/// `2·s + 1` for each 4-bit group scale `s` (bits 28..32 of the aux word).
const GROUP_SCALES: [f32; 16] = [1., 3., 5., 7., 9., 11., 13., 15., 17., 19., 21., 23., 25., 27., 29., 31.];

/// The kernel's loop-invariant vectors (tables and masks), loaded once per call.
#[derive(Clone, Copy)]
struct Consts {
    sign_ctrl: __m512i,
    signs_m: [__m512i; 2],
    weight: [__m512i; 4],
    low4: __m512i,
    mid4: __m512i,
    minus128: __m512i,
    group_scales: __m512,
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,gfni,avx2,fma,f16c")]
fn consts() -> Consts {
    Consts {
        sign_ctrl: ld64(&SIGN_CTRL),
        signs_m: SIGNS_M.map(|m| _mm512_set1_epi64(m)),
        weight: WEIGHT.each_ref().map(|t| ld64(t)),
        low4: _mm512_set1_epi8(0x0f),
        mid4: _mm512_set1_epi8(0x3c),
        minus128: _mm512_set1_epi16(-128),
        // SAFETY: `GROUP_SCALES` is 16 f32.
        group_scales: unsafe { _mm512_loadu_ps(GROUP_SCALES.as_ptr()) },
    }
}

/// Whole pairs `w` holds and every row of `a` (as long as `a[0]`) holds.
fn whole_pairs(w: &[u8], a: &[&[u8]]) -> usize {
    (w.len() / iq2_xxs::BLOCK_BYTES).min(a.first().map_or(0, |x| x.len()) / q8_k::BLOCK_BYTES) / 2
}

/// The kernel against `N` activation rows of equal length (1 for the plain dot, 4 for [`super::super::api::DotQ4`],
/// 1..=8 for [`super::super::api::DotQRows`]): each pair's weights are decoded once (lookups, signs, the `vpermb`
/// weight vectors) and multiplied into every row, and the rows share the per-group scale and `d_w` factors. One row
/// keeps two `vpdpbusd` chains (the latency bound); several rows keep one each (their chains interleave, and fewer
/// registers stay live) — the integer sums are exact either way. Each row goes through the same f32 operations in
/// the same order whatever `N`, so `N` rows at once are bit-identical to `N` single calls.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,gfni,avx2,fma,f16c")]
fn imp<const N: usize>(w: &[u8], a: [&[u8]; N]) -> [f32; N] {
    let c = consts();
    let pairs = whole_pairs(w, &a);
    let mut acc = [_mm512_setzero_ps(); N];
    // SAFETY: `pairs` pairs are whole in `w` and in every row (as long as `a[0]`, this function's contract).
    unsafe { span(&c, w, 0..pairs, a, &mut acc) };
    finish(w, a, pairs, acc)
}

/// [`imp`] over the weight rows of `row_bytes` bytes in `w`, [`TILE_PAIRS`] pairs at a time for [`TILE_ROWS`]
/// weight rows before the next pairs: the activation rows' span (`N · TILE_PAIRS · 584` bytes, 9 KiB for 8 rows)
/// stays in L1 across the weight rows, where whole rows (`N · 4672` bytes for 4096 values: 37 KiB for 8) would
/// not. Each row's accumulators are parked in between and resumed, so its f32 operations are [`imp`]'s, in the
/// same order: bit-identical.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,gfni,avx2,fma,f16c")]
fn imp_block<const N: usize>(w: &[u8], row_bytes: usize, a: [&[u8]; N], put: &mut dyn FnMut(usize, [f32; N])) {
    let c = consts();
    let rb = row_bytes.max(1);
    let pairs = whole_pairs(&w[..rb.min(w.len())], &a);
    let mut accs = [[_mm512_setzero_ps(); N]; TILE_ROWS];
    for (b, wb) in w.chunks(TILE_ROWS * rb).enumerate() {
        let rows = wb.len() / rb;
        accs[..rows].fill([_mm512_setzero_ps(); N]);
        for p0 in (0..pairs).step_by(TILE_PAIRS) {
            let p = p0..(p0 + TILE_PAIRS).min(pairs);
            for (wr, acc) in wb.chunks_exact(rb).zip(&mut accs) {
                // The same pairs of the same row of the next block, into L2 (the span's own prefetch runs ahead
                // along the row, which this order does not read next).
                let next = wr.as_ptr().wrapping_add(TILE_ROWS * rb + p.start * 2 * iq2_xxs::BLOCK_BYTES);
                for k in 0..(p.len() * 2 * iq2_xxs::BLOCK_BYTES).div_ceil(64) {
                    // A hint that never faults; the address is not dereferenced.
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(64 * k) as *const i8);
                }
                // SAFETY: `pairs` pairs are whole in every weight row (all `row_bytes` long) and in every
                // activation row (as long as `a[0]`, this function's contract).
                unsafe { span(&c, wr, p.clone(), a, acc) };
            }
        }
        for (i, (wr, acc)) in wb.chunks_exact(rb).zip(accs).enumerate() {
            put(b * TILE_ROWS + i, finish(wr, a, pairs, acc));
        }
    }
}

/// Weight rows [`imp_block`] takes a span of pairs at a time (their accumulators: `N` vectors each).
const TILE_ROWS: usize = 16;
/// Pairs of one span of [`imp_block`].
const TILE_PAIRS: usize = 2;
/// Most activation rows [`Pairs::block`] tiles (more go through [`imp`] one weight row at a time): tiling measured
/// faster for 2..=5 rows, equal at 6 and slower at 7 and 8 (see the module docs).
const TILE_MAX_N: usize = 5;

/// Accumulates pairs `p` of weight row `w` against the rows `a` into `acc` (one f32 vector per row).
///
/// # Safety
/// Every pair of `p` is whole in `w` and in every row of `a`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,gfni,avx2,fma,f16c")]
unsafe fn span<const N: usize>(c: &Consts, w: &[u8], p: std::ops::Range<usize>, a: [&[u8]; N], acc: &mut [__m512; N]) {
    const WB: usize = iq2_xxs::BLOCK_BYTES;
    const AB: usize = q8_k::BLOCK_BYTES;
    let Consts { sign_ctrl, signs_m, weight, low4, mid4, minus128, group_scales } = *c;
    for pi in p {
        let b = &w[pi * 2 * WB..(pi + 1) * 2 * WB];
        let bp = b.as_ptr();
        // SAFETY: pair `pi` is whole in every row (this function's contract).
        let aps = a.map(|x| unsafe { x.as_ptr().add(pi * 2 * AB) });
        prefetch_ahead::<3>(bp);
        // SAFETY: each block's 8 groups are its bytes 2..66; the pair slice holds both blocks.
        let (g0, g1) = unsafe { (_mm512_loadu_ps(bp.add(2).cast()), _mm512_loadu_ps(bp.add(WB + 2).cast())) };
        // Per 128-bit lane: index dwords 0 and 2 (aux 1 and 3) of block 0, then of block 1.
        let idx = _mm512_castps_si512(_mm512_shuffle_ps::<0x88>(g0, g1));
        let aux = _mm512_castps_si512(_mm512_shuffle_ps::<0xdd>(g0, g1));
        let sign_idx = _mm512_multishift_epi64_epi8(sign_ctrl, aux);
        let upper = _mm512_movepi8_mask(idx);
        let mut sums = [[_mm512_setzero_si512(); 2]; N];
        for (h, tables) in LEVELS.iter().enumerate() {
            let [t0, t1] = tables.each_ref().map(|[x, y]| _mm512_permutex2var_epi8(ld64(x), idx, ld64(y)));
            let levels = _mm512_mask_blend_epi8(upper, t0, t1);
            let signs = _mm512_gf2p8affine_epi64_epi8::<0>(sign_idx, signs_m[h]);
            // Index bytes: levels of values 0, 1 (bits 0..4) and their signs (4, 5); signs of values 2, 3 (bits
            // 0, 1) and their levels (2..6).
            let ia = _mm512_ternarylogic_epi32::<SELECT>(levels, signs, low4);
            let ib = _mm512_ternarylogic_epi32::<SELECT>(_mm512_srli_epi16::<2>(levels), signs, mid4);
            for (e, t) in weight.iter().enumerate() {
                let j = 4 * h + e;
                let y = _mm512_permutexvar_epi8(if e < 2 { ia } else { ib }, *t);
                let chain = if N == 1 { e % 2 } else { 0 };
                for (s, ap) in sums.iter_mut().zip(aps) {
                    // SAFETY: vector `j` is 64 bytes at `q8_k::pair_vector(j)` ≤ 456, inside the 584-byte pair.
                    let q = unsafe { ld(ap.add(q8_k::pair_vector(j))) };
                    s[chain] = _mm512_dpbusd_epi32(s[chain], y, q);
                }
            }
        }
        let scale = _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(aux), group_scales);
        // SAFETY: the f16 scales are bytes 0..2 of each block.
        let (dw0, dw1) = unsafe {
            (
                std::ptr::read_unaligned(bp as *const u16).to_le() as u64,
                std::ptr::read_unaligned(bp.add(WB) as *const u16).to_le() as u64,
            )
        };
        // f16 words d_w0, d_w0, d_w1, d_w1 repeated: lanes 4m + r take block r / 2's scale (exact conversion).
        let dw = _mm512_cvtph_ps(_mm256_set1_epi64x(((dw0 | dw1 << 32) * 0x1_0001) as i64));
        for ((acc, s), ap) in acc.iter_mut().zip(sums).zip(aps) {
            // SAFETY: the lane block sums are the pair's last 64 bytes, the f32 scales its first 8.
            let (bsums, da0, da1) = unsafe {
                (
                    ld(ap.add(q8_k::PAIR_LANE_BSUMS)),
                    f32::from_bits(std::ptr::read_unaligned(ap as *const u32).to_le()),
                    f32::from_bits(std::ptr::read_unaligned(ap.add(4) as *const u32).to_le()),
                )
            };
            // Σ (128 ± m)·q − 128·Σ q: the weights' bias off again, from the group's two block sums.
            let sum = _mm512_add_epi32(s[0], _mm512_dpwssd_epi32(s[1], bsums, minus128));
            let da = _mm512_mask_broadcastss_ps(_mm512_set1_ps(da0), 0xcccc, _mm_set_ss(da1));
            *acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale), _mm512_mul_ps(dw, da), *acc);
        }
    }
}

/// Each row's dot from its accumulator after `pairs` pairs: the lane sum, `1/8`, and a last odd block (plain Q8_K,
/// through the gather kernel).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,gfni,avx2,fma,f16c")]
fn finish<const N: usize>(w: &[u8], a: [&[u8]; N], pairs: usize, acc: [__m512; N]) -> [f32; N] {
    const WB: usize = iq2_xxs::BLOCK_BYTES;
    const AB: usize = q8_k::BLOCK_BYTES;
    let (wt, at) = (2 * pairs * WB, 2 * pairs * AB);
    let mut out = [0f32; N];
    for ((o, acc), x) in out.iter_mut().zip(acc).zip(a) {
        *o = _mm512_reduce_add_ps(acc) * 0.125;
        if w.len() >= wt + WB && x.len() >= at + AB {
            *o += super::avx512::iq2_xxs_q8_k_imp(&w[wt..wt + WB], &x[at..at + AB]);
        }
    }
    out
}

fn iq2_xxs_q8k_pairs4(w: &[u8], a: [&[u8]; 4], _da: [&[f32]; 4]) -> [f32; 4] {
    if a.iter().any(|x| x.len() != a[0].len()) {
        // Rows of different lengths (never from the engine): each on its own, as `DotQ4` promises.
        return a.map(|x| iq2_xxs_q8k_pairs(w, x));
    }
    // SAFETY: only handed out by `dot_q4` after `available()` confirmed the features `imp` needs.
    unsafe { imp(w, a) }
}

/// The four-row pair kernel (see [`imp`]), where this CPU has the features.
pub(super) fn dot_q4() -> Option<super::super::api::DotQ4> {
    available().then_some(iq2_xxs_q8k_pairs4 as super::super::api::DotQ4)
}

/// [`imp`] for every `N`, for [`dot_rows`].
struct Pairs;

impl RowsKernel for Pairs {
    unsafe fn rows<const N: usize>(w: &[u8], a: [&[u8]; N]) -> [f32; N] {
        // SAFETY: the caller confirmed the features (`RowsKernel`'s contract).
        unsafe { imp(w, a) }
    }

    unsafe fn block<const N: usize>(w: &[u8], row_bytes: usize, a: [&[u8]; N], put: &mut dyn FnMut(usize, [f32; N])) {
        if N > TILE_MAX_N {
            for (r, wr) in w.chunks_exact(row_bytes.max(1)).enumerate() {
                // SAFETY: as above.
                put(r, unsafe { imp(wr, a) });
            }
            return;
        }
        // SAFETY: as above.
        unsafe { imp_block(w, row_bytes, a, put) }
    }
}

fn iq2_xxs_q8k_pairs_rows(w: &[u8], row_bytes: usize, a: &[&[u8]], _da: &[&[f32]], out: &mut [f32]) {
    // SAFETY: only handed out by `dot_q_rows` after `available()` confirmed the features `imp` needs.
    unsafe { dot_rows::<Pairs>(w, row_bytes, a, out) }
}

/// The any-row-count pair kernel (see [`imp`]), where this CPU has the features.
pub(super) fn dot_q_rows() -> Option<super::super::api::DotQRows> {
    available().then_some(iq2_xxs_q8k_pairs_rows as super::super::api::DotQRows)
}

#[cfg(test)]
mod tests {
    use super::super::test_blocks::{
        assert_rows_match_single, iq2_biggest_point, iq2_every_point_blocks, iq2_uniform_blocks, mass, q8k_blocks,
    };
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
        // The kernel's per-value path, bit by bit: levels byte, sign byte, index byte, weight table.
        let select = |c: u8, a: u8, b: u8| (a & c) | (b & !c);
        for (g, point) in IQ2XXS_GRID.iter().enumerate() {
            // Bit 7 of the sign byte is the next aux field's first bit: it must not matter.
            for sign_byte in 0..=255u8 {
                let ks = KSIGNS_IQ2XS[(sign_byte & 127) as usize];
                for h in 0..2 {
                    let levels = LEVELS[h][g / 128][g % 128 / 64].0[g % 64];
                    let signs = affine(sign_byte, SIGNS_M[h], 0);
                    let ia = select(0x0f, levels, signs);
                    let ib = select(0x3c, levels >> 2 | 0xc0, signs);
                    for e in 0..4 {
                        let j = 4 * h + e;
                        let y = WEIGHT[e].0[(if e < 2 { ia } else { ib } & 63) as usize] as i32 - 128;
                        let m = ((point >> (8 * j)) & 0xff) as i32;
                        let want = if ks >> j & 1 == 1 { -m } else { m };
                        assert_eq!(y, want, "grid point {g}, sign byte {sign_byte:#x}, value {j}");
                    }
                }
            }
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

    /// Four rows at once give exactly the four single dots, odd block counts and rows of unequal length included.
    #[test]
    fn four_rows_match_four_single_dots_bit_for_bit() {
        let (Some(k), Some(k4)) = (kernel(), dot_q4()) else { return };
        let mut rng = StdRng::seed_from_u64(21);
        for n in [1usize, 2, 3, 4, 7, 16] {
            let w = weights(&mut rng, n);
            let rows: Vec<Vec<u8>> = (0..4)
                .map(|_| pairs(&q8k_blocks(n, rng.gen_range(1e-3f32..1.0), |_| rng.gen_range(-127i8..=127))))
                .collect();
            let got = k4(&w, [&rows[0], &rows[1], &rows[2], &rows[3]], [&[]; 4]);
            for (r, g) in rows.iter().zip(got) {
                assert_eq!(g.to_bits(), k(&w, r).to_bits(), "{n} blocks");
            }
            // A shorter row: every row still gets its own single dot.
            let short = &rows[1][..rows[1].len() - 1];
            let got = k4(&w, [&rows[0], short, &rows[2], &rows[3]], [&[]; 4]);
            for (x, g) in [&rows[0][..], short, &rows[2], &rows[3]].iter().zip(got) {
                assert_eq!(g.to_bits(), k(&w, x).to_bits(), "{n} blocks, unequal rows");
            }
        }
    }

    /// Any number of rows (1..=8 per weight decode, more in groups; tiled over 1, 2 and 35 weight rows: two whole
    /// tiles of `TILE_ROWS` and a partial one) gives exactly the single dots, odd block counts, extreme
    /// activations and rows of unequal length included.
    #[test]
    fn any_rows_match_single_dots_bit_for_bit() {
        let (Some(k), Some(kn)) = (kernel(), dot_q_rows()) else { return };
        let mut rng = StdRng::seed_from_u64(22);
        for n in [1usize, 2, 3, 4, 7, 16] {
            let w = weights(&mut rng, 35 * n);
            let rows: Vec<Vec<u8>> = (0..19)
                .map(|r| match r {
                    0 => pairs(&q8k_blocks(n, 1.0, |_| 127)),
                    1 => pairs(&q8k_blocks(n, 1.0, |_| -127)),
                    _ => pairs(&q8k_blocks(n, rng.gen_range(1e-3f32..1.0), |_| rng.gen_range(-127i8..=127))),
                })
                .collect();
            assert_rows_match_single(k, kn, &w, n * iq2_xxs::BLOCK_BYTES, &rows);
        }
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
