//! Long-chunk Q8_0 products (prefill): many weight rows times many activation rows per call
//! ([`crate::quant::GemmQ`]), each output bit-identical to the AVX2 single-row kernel (`avx2::q8_0_q8_0_imp`).
//!
//! Where the per-row kernels (`avx2_x4`) spend four vector operations per weight block and activation row
//! (`sign`, `vpdpbusd`, convert, FMA), a tile here spends three, on 512-bit vectors that hold two blocks:
//! - The activation quants are stored once per product with their sign bit flipped (`a + 128`, an unsigned byte,
//!   `vpdpbusd`'s left operand), a row's blocks in pairs: 64 bytes per pair, the even block's 4-byte groups at the
//!   even 32-bit lanes and the odd block's at the odd lanes (a row of odd length ends with a half-zero pair).
//! - A weight row's block pairs are repacked the same way once per call (two 32-byte loads and one two-source
//!   permute per pair, into a per-thread buffer: 128 bytes per pair, the quants then the pair's correction
//!   `-128 · Σ₄ w`, one i32 per lane); the correction is loaded as the accumulator `vpdpbusd` adds into, so
//!   `vpdpbusd(corr, a + 128, w)` is `Σ₄ w·a` per lane with no sign fix-up.
//! - The block scale products `d_w · d_a` are formed sixteen blocks at a time per output and a pair's two of them
//!   are broadcast as one 64-bit value, so lane `2m` is scaled by the even block's product and `2m + 1` by the odd.
//!
//! A tile is four weight rows × four activation rows (sixteen 512-bit accumulators, one per output: the single
//! kernel's two 256-bit ones interleaved; its inner loop: per pair four activation loads, eight weight / correction
//! loads, and per output a `vpdpbusd`, a convert, a broadcast and an FMA). Blocking: a run of weight rows
//! (`ROW_CHUNK_BYTES` of the file's rows, ~1.9× that repacked, kept in L2 with their scales) sweeps chunks of
//! activation rows (`ACT_CHUNK_BYTES` of flipped quants). The flipped activations come from the caller
//! ([`crate::quant::gemm_acts`], once per product, 64-byte aligned) or are made here once per call.
//!
//! Why every output equals the single kernel's: per lane the integer is `Σ₄ w·a` exactly (no saturation:
//! `|w| ≤ 128`, `a + 128 ≤ 255`, and the single kernel's `maddubs` pairs stay below 2¹⁵ because activation quants
//! are in -127..=127, the contract of [`crate::quant::DotQ`]); its conversion to f32 is exact; `d_w · d_a` is the
//! same f32 product; the even lanes take the even blocks and the odd lanes the odd ones with one FMA each, in block
//! order — the single kernel's two accumulators — and the result is `hsum(even + odd)`, lane by lane as the single
//! kernel adds them. The missing odd block of a row of odd length adds `0 · 0` to the odd lanes, which leaves them
//! as they are (an accumulator that starts at +0 is never -0). Scales are the exact f32 values of the f16 ones
//! (given, or converted here).
//!
//! Soundness: [`gemm_q`] hands the kernel out only after the AVX2/FMA/F16C and AVX-512 F/VL/VNNI features are
//! detected; shapes are asserted before any vector access, and the tile loads stay inside whole blocks (the odd
//! block of a row's last pair is not read where the row has none).

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::super::api::{GemmIn, GemmQ};
use super::super::{q8_0, GgmlType};
use super::x86::{f16_at, hsum_ps, ld_si256, prefetch_ahead};

/// The long-chunk kernel for `ty` where this CPU has one (Q8_0 with AVX-512 VNNI; the single kernel is then AVX2's).
pub(super) fn gemm_q(ty: GgmlType) -> Option<GemmQ> {
    (ty == GgmlType::Q8_0 && available()).then_some(q8_0_gemm as GemmQ)
}

fn available() -> bool {
    super::avx2::available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

const B: usize = q8_0::BLOCK_BYTES;
/// Quant bytes of a block, and of a flipped block pair.
const QB: usize = 32;
const PB: usize = 2 * QB;
/// Weight rows and activation rows of a tile.
const TW: usize = 4;
const TA: usize = 4;
/// Blocks whose scale products a tile forms at once (one 512-bit vector per output).
const SB: usize = 16;
/// Weight bytes of the run of rows that sweeps every activation chunk (stays in L2).
const ROW_CHUNK_BYTES: usize = 128 << 10;
/// Flipped activation bytes of a chunk (stays in L2 while a tile's weight rows sweep it).
const ACT_CHUNK_BYTES: usize = 256 << 10;

/// Per-thread buffers (grown, never shrunk).
struct Bufs {
    /// Flipped activation pairs, rows of `nb.div_ceil(2)` pairs (where the caller gave none).
    au: Vec<__m512i>,
    /// Activation block scales as f32 (where the caller gave none).
    da: Vec<f32>,
    /// Where row `b`'s flipped quants and f32 scales start (in `au` / `da` or the caller's buffers).
    aup: Vec<*const u8>,
    dap: Vec<*const f32>,
    /// A run of weight rows repacked: per block pair its quants in the pair order, then its corrections
    /// `-128 · Σ₄ w` (one i32 per lane), so `2 · nb.div_ceil(2)` vectors per row.
    cw: Vec<__m512i>,
    /// Weight block scales of a run of rows as f32.
    dw: Vec<f32>,
}

thread_local! {
    static BUFS: RefCell<Bufs> =
        const {
            RefCell::new(Bufs {
                au: Vec::new(),
                da: Vec::new(),
                aup: Vec::new(),
                dap: Vec::new(),
                cw: Vec::new(),
                dw: Vec::new(),
            })
        };
}

/// [`GemmQ`] for Q8_0 (see the module docs).
fn q8_0_gemm(w: &[u8], rb: usize, rows: Range<usize>, a: &GemmIn<'_>, put: &mut dyn FnMut(usize, usize, f32)) {
    let (n, nb) = (a.n, rb / B);
    if rows.is_empty() || n == 0 {
        return;
    }
    assert!(nb > 0 && nb * B == rb && rows.end * rb <= w.len(), "gemm weight shape");
    for b in 0..n {
        assert!((a.at)(b) + rb <= a.acts.len(), "gemm activation shape");
    }
    BUFS.with(|cell| {
        let Ok(mut bufs) = cell.try_borrow_mut() else {
            // Re-entered on this thread (never in the engine): the single kernel, which this equals.
            let dot = super::avx2::dot_q(GgmlType::Q8_0).expect("checked by gemm_q");
            for r in rows {
                for b in 0..n {
                    let at = (a.at)(b);
                    put(b, r, dot(&w[r * rb..(r + 1) * rb], &a.acts[at..at + rb]));
                }
            }
            return;
        };
        let Bufs { au, da, aup, dap, cw, dw } = &mut *bufs;
        let np = nb.div_ceil(2);
        debug_assert_eq!(np, super::super::api::gemm_row_lines(rb));
        // SAFETY (the `_mm512_setzero_si512` fills): AVX-512 F present (checked by `gemm_q`).
        au.resize(au.len().max(n * np), unsafe { _mm512_setzero_si512() });
        da.resize(da.len().max(n * nb), 0.0);
        let row_chunk = (ROW_CHUNK_BYTES / rb).max(TW);
        let act_chunk = (ACT_CHUNK_BYTES / (np * PB)).max(TA);
        let chunk_rows = row_chunk.min(rows.len());
        cw.resize(cw.len().max(chunk_rows * 2 * np), unsafe { _mm512_setzero_si512() });
        dw.resize(dw.len().max(chunk_rows * nb), 0.0);
        aup.clear();
        dap.clear();
        for b in 0..n {
            let at = (a.at)(b);
            // The caller's flipped row (row `at / rb` of `flipped`, `np` lines) and scales where it has them.
            let fl = at.is_multiple_of(rb).then(|| a.flipped.get(at / rb * np..(at / rb + 1) * np)).flatten();
            let sc = a.scales.get(at / B..at / B + nb);
            match fl {
                Some(f) => aup.push(f.as_ptr() as *const u8),
                None => {
                    let dst = &mut au[b * np..(b + 1) * np];
                    // SAFETY: `gemm_q` checked the features; the row holds `nb` blocks (asserted), `dst` `np` pairs.
                    unsafe { flip_row(&a.acts[at..at + rb], nb, dst) };
                    aup.push(dst.as_ptr() as *const u8);
                }
            }
            match sc {
                Some(s) => dap.push(s.as_ptr()),
                None => {
                    let row = &a.acts[at..at + rb];
                    for (k, d) in da[b * nb..(b + 1) * nb].iter_mut().enumerate() {
                        *d = f16_at(row, k * B);
                    }
                    dap.push(da[b * nb..].as_ptr());
                }
            }
        }
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = (r0 + row_chunk).min(rows.end);
            for r in r0..r1 {
                let (c, d) = ((r - r0) * 2 * np, (r - r0) * nb);
                // SAFETY: as above; row `r` is inside `w` (asserted), `cw` / `dw` hold `chunk_rows` rows.
                unsafe { prep_weights(&w[r * rb..(r + 1) * rb], nb, &mut cw[c..c + 2 * np], &mut dw[d..d + nb]) };
            }
            let mut a0 = 0;
            while a0 < n {
                let a1 = (a0 + act_chunk).min(n);
                let mut r = r0;
                while r < r1 {
                    let wr = (r1 - r).min(TW);
                    let (c, d) = ((r - r0) * 2 * np, (r - r0) * nb);
                    let mut b = a0;
                    while b < a1 {
                        let ar = (a1 - b).min(TA);
                        let t = Tile { cw: &cw[c..], dw: &dw[d..], aup: &aup[..], dap: &dap[..], nb, r, b };
                        // SAFETY: as above: rows `r..r + wr` and `b..b + ar` are prepared, `nb` blocks each.
                        unsafe {
                            match (wr, ar) {
                                (4, 4) => t.run::<4, 4>(put),
                                (4, 3) => t.run::<4, 3>(put),
                                (4, 2) => t.run::<4, 2>(put),
                                (4, _) => t.run::<4, 1>(put),
                                (3, 4) => t.run::<3, 4>(put),
                                (3, 3) => t.run::<3, 3>(put),
                                (3, 2) => t.run::<3, 2>(put),
                                (3, _) => t.run::<3, 1>(put),
                                (2, 4) => t.run::<2, 4>(put),
                                (2, 3) => t.run::<2, 3>(put),
                                (2, 2) => t.run::<2, 2>(put),
                                (2, _) => t.run::<2, 1>(put),
                                (_, 4) => t.run::<1, 4>(put),
                                (_, 3) => t.run::<1, 3>(put),
                                (_, 2) => t.run::<1, 2>(put),
                                _ => t.run::<1, 1>(put),
                            }
                        }
                        b += ar;
                    }
                    r += wr;
                }
                a0 = a1;
            }
            r0 = r1;
        }
    });
}

/// One tile's operands: weight rows from `r` (repacked with their corrections in `cw`, `2 · nb.div_ceil(2)`
/// vectors per row, and their scales in `dw`, `nb` per row) and activation rows from `b` (their flipped pairs and
/// f32 scales at `aup[b]` / `dap[b]`).
struct Tile<'a> {
    cw: &'a [__m512i],
    dw: &'a [f32],
    aup: &'a [*const u8],
    dap: &'a [*const f32],
    nb: usize,
    r: usize,
    b: usize,
}

impl Tile<'_> {
    /// Computes the `WR × AR` outputs and hands each to `put(b, r, v)`.
    ///
    /// # Safety
    /// The features of [`gemm_q`] present; `aup[b..b + AR]` / `dap[b..b + AR]` point at `nb.div_ceil(2)` pairs /
    /// `nb` scales that live through the call.
    #[inline]
    unsafe fn run<const WR: usize, const AR: usize>(&self, put: &mut dyn FnMut(usize, usize, f32)) {
        let (nb, r, b, np) = (self.nb, self.r, self.b, self.nb.div_ceil(2));
        assert!(WR * 2 * np <= self.cw.len() && WR * nb <= self.dw.len());
        assert!(b + AR <= self.aup.len() && b + AR <= self.dap.len());
        let cw = std::array::from_fn(|i| self.cw[i * 2 * np..].as_ptr());
        let dw = std::array::from_fn(|i| self.dw[i * nb..].as_ptr());
        let au = std::array::from_fn(|j| self.aup[b + j]);
        let da = std::array::from_fn(|j| self.dap[b + j]);
        // SAFETY: bounds asserted above; features are the caller's contract.
        let v = unsafe { tile::<WR, AR>(cw, dw, au, da, nb) };
        for (i, row) in v.iter().enumerate() {
            for (j, &x) in row.iter().enumerate() {
                put(b + j, r + i, x);
            }
        }
    }
}

/// The 32-bit lane order of a block pair: the even block's lane `m` at `2m`, the odd block's (index 16 + m of a
/// two-source permute) at `2m + 1`.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_order() -> __m512i {
    _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
}

/// Blocks `blk` and `blk + 1` of a Q8_0 row of `nb` blocks at `row`, quants xor `x`, in the pair order (the odd
/// half zero where `blk + 1 == nb`).
///
/// # Safety
/// AVX-512 F present; `blk < nb` and `row` valid for `nb` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn pair(row: *const u8, blk: usize, nb: usize, x: __m256i, order: __m512i) -> __m512i {
    // SAFETY: block `blk < nb`, and `blk + 1` only where it is `< nb` (the caller's contract).
    let (e, o) = unsafe {
        let e = ld_si256(row.add(blk * B + 2));
        let o = if blk + 1 < nb {
            _mm256_xor_si256(ld_si256(row.add((blk + 1) * B + 2)), x)
        } else {
            _mm256_setzero_si256()
        };
        (_mm256_xor_si256(e, x), o)
    };
    _mm512_permutex2var_epi32(_mm512_castsi256_si512(e), order, _mm512_castsi256_si512(o))
}

/// Stores a row's quants `a + 128` in the flipped format (as [`crate::quant::gemm_acts`] does).
///
/// # Safety
/// The features of [`gemm_q`] present; `row` holds `nb` blocks, `au` `nb.div_ceil(2)` pairs.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn flip_row(row: &[u8], nb: usize, au: &mut [__m512i]) {
    let (flip, order) = (_mm256_set1_epi8(-128), pair_order());
    for (p, d) in au.iter_mut().enumerate().take(nb.div_ceil(2)) {
        // SAFETY: block `2p < nb` of the row (the caller's contract).
        // (The odd half of a lone last block: zero bytes, as `gemm_acts` writes.)
        *d = unsafe { pair(row.as_ptr(), 2 * p, nb, flip, order) };
    }
}

/// One weight row repacked (per block pair: its quants in the pair order, then its corrections `-128 · Σ₄ w`)
/// and its per-block scales as f32.
///
/// # Safety
/// The features of [`gemm_q`] present; `w` holds `nb` blocks, `cw` `2 · nb.div_ceil(2)` values and `dw` `nb`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn prep_weights(w: &[u8], nb: usize, cw: &mut [__m512i], dw: &mut [f32]) {
    let (ones128, order) = (_mm512_set1_epi8(-128), pair_order());
    for (p, qc) in cw.chunks_exact_mut(2).enumerate().take(nb.div_ceil(2)) {
        prefetch_ahead::<1>(w.as_ptr().wrapping_add(2 * p * B));
        // SAFETY: block `2p < nb` of the row.
        let q = unsafe { pair(w.as_ptr(), 2 * p, nb, _mm256_setzero_si256(), order) };
        qc[0] = q;
        qc[1] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones128, q));
    }
    for (k, d) in dw.iter_mut().enumerate().take(nb) {
        *d = f16_at(w, k * B);
    }
}

/// Scale products of one output for `SB` blocks (64-byte aligned, read as 64-bit pairs).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Scales([f32; SB]);

/// `WR` weight rows × `AR` activation rows over `nb` blocks (see the module docs).
///
/// # Safety
/// The features of [`gemm_q`] present; every pointer is valid for `nb` blocks of its kind (`cw`: two vectors per
/// pair, `au`: 64-byte pairs, `dw` / `da`: one value per block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn tile<const WR: usize, const AR: usize>(
    cw: [*const __m512i; WR],
    dw: [*const f32; WR],
    au: [*const u8; AR],
    da: [*const f32; AR],
    nb: usize,
) -> [[f32; AR]; WR] {
    let mut acc = [[_mm512_setzero_ps(); AR]; WR];
    let mut dd = [[Scales([0.0; SB]); AR]; WR];
    let mut c0 = 0;
    while c0 < nb {
        let m = (nb - c0).min(SB);
        let live: __mmask16 = if m == SB { !0 } else { (1 << m) - 1 };
        for i in 0..WR {
            // SAFETY: lanes below `m` read blocks `c0..c0 + m ≤ nb`; the others nothing (zero).
            let wv = unsafe { _mm512_maskz_loadu_ps(live, dw[i].add(c0)) };
            for j in 0..AR {
                // SAFETY: as above; `dd[i][j]` is 16 aligned writable f32.
                unsafe {
                    let av = _mm512_maskz_loadu_ps(live, da[j].add(c0));
                    _mm512_store_ps(dd[i][j].0.as_mut_ptr(), _mm512_mul_ps(wv, av));
                }
            }
        }
        let mut k = 0;
        while k < m {
            // `c0` and `k` are even: pair `p` holds blocks `c0 + k` and the next one (where there is one).
            let p = (c0 + k) / 2;
            // SAFETY: pair `p` of every flipped row (`nb.div_ceil(2)` pairs).
            let av: [__m512i; AR] =
                std::array::from_fn(|j| unsafe { _mm512_loadu_si512(au[j].add(p * PB) as *const _) });
            for i in 0..WR {
                // SAFETY: pair `p` of weight row `i`.
                let (wq, c) = unsafe {
                    (
                        _mm512_load_si512(cw[i].add(2 * p) as *const _),
                        _mm512_load_si512(cw[i].add(2 * p + 1) as *const _),
                    )
                };
                for j in 0..AR {
                    let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, av[j], wq));
                    // SAFETY: `k + 1 < SB`: the two scale products of the pair, 8-byte aligned.
                    let d = unsafe { (dd[i][j].0.as_ptr().add(k) as *const f64).read() };
                    acc[i][j] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(d)), s, acc[i][j]);
                }
            }
            k += 2;
        }
        c0 += SB;
    }
    // Lane `2m` + lane `2m + 1` (even block sums + odd ones, in that order), gathered into lanes 0..8.
    let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    std::array::from_fn(|i| {
        std::array::from_fn(|j| {
            let a = acc[i][j];
            let s = _mm512_add_ps(a, _mm512_permute_ps::<0xb1>(a));
            hsum_ps(_mm512_castps512_ps256(_mm512_permutexvar_ps(evens, s)))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `rows` Q8_0 rows of `nb` blocks: random quants (every byte value for weights, -127..=127 for activations),
    /// scales normal and subnormal f16.
    fn blocks(rng: &mut impl Rng, rows: usize, nb: usize, acts: bool) -> Vec<u8> {
        let mut v = vec![0u8; rows * nb * B];
        rng.fill(&mut v[..]);
        for (i, b) in v.chunks_exact_mut(B).enumerate() {
            let d = if i % 5 == 3 { 3.0e-6f32 } else { rng.gen_range(0.001f32..0.1) };
            b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            if acts {
                for q in &mut b[2..] {
                    if *q == 0x80 {
                        *q = 0x81;
                    }
                }
            }
        }
        v
    }

    /// Every output equals the single-row kernel on the same bytes: weight row counts with and without a lone row,
    /// activation row counts with every tail, block counts odd and even (below, at and above the scale chunk; 1100
    /// blocks: runs of 4 weight rows and chunks of 7 activation rows), with and without pre-converted scales and
    /// pre-flipped activations, activation rows gathered out of order.
    #[test]
    fn every_output_is_the_single_kernel() {
        let Some(gemm) = gemm_q(GgmlType::Q8_0) else {
            eprintln!("no AVX-512 VNNI here; nothing to test");
            return;
        };
        let dot = crate::quant::dot_q_kernel(GgmlType::Q8_0).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(16);
        for (rows, nb, n) in [
            (1usize, 1usize, 1usize),
            (3, 7, 17),
            (5, 8, 23),
            (2, 9, 4),
            (7, 17, 40),
            (4, 33, 67),
            (9, 2, 130),
            (5, 1100, 17),
        ] {
            let (rb, w) = (nb * B, blocks(&mut rng, rows, nb, false));
            let acts = blocks(&mut rng, n + 3, nb, true);
            let mut scales = Vec::new();
            crate::quant::act_block_scales(crate::quant::ActType::Q8_0, &acts, &mut scales);
            let order: Vec<usize> = (0..n).map(|b| (b * 7 + 3) % (n + 3)).collect();
            let at = |b: usize| order[b] * rb;
            let mut flipped = Vec::new();
            crate::quant::gemm_acts(crate::quant::ActType::Q8_0, &acts, rb, &mut flipped);
            for (sc, fl) in [(&scales[..], &flipped[..]), (&[], &[]), (&scales[..], &[]), (&[], &flipped[..])] {
                for range in [0..rows, rows / 2..rows] {
                    let mut got = vec![f32::NAN; n * rows];
                    let inp = GemmIn { acts: &acts, scales: sc, flipped: fl, at: &at, n };
                    gemm(&w, rb, range.clone(), &inp, &mut |b, r, v| got[b * rows + r] = v);
                    for r in range.clone() {
                        for b in 0..n {
                            let want = dot(&w[r * rb..(r + 1) * rb], &acts[at(b)..at(b) + rb]);
                            let g = got[b * rows + r];
                            assert_eq!(
                                g.to_bits(),
                                want.to_bits(),
                                "rows {rows} nb {nb} n {n}: ({b}, {r}) {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The flipped format: `gemm_acts` writes the documented byte order (4-byte groups of a block pair alternating,
    /// quants plus 128, zero bytes for the missing block of a row of odd length), and the kernel's own conversion
    /// writes the same bytes.
    #[test]
    fn flipped_format_is_the_documented_one() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for nb in [1usize, 2, 3, 6] {
            let rb = nb * B;
            let acts = blocks(&mut rng, 2, nb, true);
            let mut out = Vec::new();
            crate::quant::gemm_acts(crate::quant::ActType::Q8_0, &acts, rb, &mut out);
            let fr = nb.div_ceil(2) * PB;
            let out: Vec<u8> = out.iter().flat_map(|l| l.0).collect();
            assert_eq!(out.len(), 2 * fr);
            for (row, got) in acts.chunks_exact(rb).zip(out.chunks_exact(fr)) {
                for (i, &g) in got.iter().enumerate() {
                    let (p, m, odd, byte) = (i / PB, i % PB / 8, i % 8 / 4, i % 4);
                    let blk = 2 * p + odd;
                    let want = if blk < nb { row[blk * B + 2 + 4 * m + byte] ^ 0x80 } else { 0 };
                    assert_eq!(g, want, "nb {nb} byte {i}");
                }
                if !available() {
                    continue;
                }
                let mut own = vec![[0u8; PB]; nb.div_ceil(2)];
                // SAFETY: the features are present (checked above); `tmp` holds `nb.div_ceil(2)` pairs, the row `nb`
                // blocks, and each `own[p]` is 64 writable bytes.
                unsafe {
                    let mut tmp = vec![_mm512_setzero_si512(); own.len()];
                    flip_row(row, nb, &mut tmp);
                    for (d, v) in own.iter_mut().zip(&tmp) {
                        _mm512_storeu_si512(d.as_mut_ptr() as *mut _, *v);
                    }
                }
                assert_eq!(own.concat(), got, "nb {nb}: the kernel's own flip");
            }
        }
    }

    /// Extreme quants: weights all -128 or 127 against activations all ±127 (the largest lane sums).
    #[test]
    fn extreme_quants_match() {
        let Some(gemm) = gemm_q(GgmlType::Q8_0) else { return };
        let dot = crate::quant::dot_q_kernel(GgmlType::Q8_0).unwrap();
        let nb = 5;
        let rb = nb * B;
        let one = half::f16::from_f32(1.0).to_le_bytes();
        let fill = |q: u8, rows: usize| {
            let mut v = vec![q; rows * rb];
            v.chunks_exact_mut(B).for_each(|b| b[..2].copy_from_slice(&one));
            v
        };
        for (wq, aq) in [(0x80u8, 0x81u8), (0x80, 0x7f), (0x7f, 0x81), (0x7f, 0x7f)] {
            let (w, acts) = (fill(wq, 3), fill(aq, 5));
            let at = |b: usize| b * rb;
            let mut got = vec![0f32; 15];
            gemm(&w, rb, 0..3, &GemmIn { acts: &acts, scales: &[], flipped: &[], at: &at, n: 5 }, &mut |b, r, v| {
                got[b * 3 + r] = v
            });
            let want = dot(&w[..rb], &acts[..rb]);
            assert_eq!(want, (wq as i8 as f32) * (aq as i8 as f32) * 32.0 * nb as f32);
            assert!(got.iter().all(|&g| g == want), "{wq:#x} {aq:#x}: {got:?} vs {want}");
        }
    }
}
