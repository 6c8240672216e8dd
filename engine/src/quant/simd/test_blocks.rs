//! Test inputs shared by the SIMD kernel tests: hand-made Q8_K activation blocks and the error scale of a dot.

use crate::quant::iq2_tables::IQ2XXS_GRID;
use crate::quant::{iq2_xxs, q8_k, QK_K};

/// `n` Q8_K blocks with quants `q(i)` (value index `i` across blocks) and scale `d`, block sums filled in.
pub(super) fn q8k_blocks(n: usize, d: f32, mut q: impl FnMut(usize) -> i8) -> Vec<u8> {
    let mut v = vec![0u8; n * q8_k::BLOCK_BYTES];
    for (bi, b) in v.chunks_exact_mut(q8_k::BLOCK_BYTES).enumerate() {
        b[..4].copy_from_slice(&d.to_le_bytes());
        for i in 0..QK_K {
            b[q8_k::QS + i] = q(bi * QK_K + i) as u8;
        }
        for j in 0..16 {
            let s: i32 = (0..16).map(|i| b[q8_k::QS + 16 * j + i] as i8 as i32).sum();
            b[q8_k::BSUMS + 2 * j..q8_k::BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
    }
    v
}

/// Σ |term| of the dot of weight blocks `w` (`block_bytes` each, decoded by `dequantize_block`) with Q8_K blocks
/// `a` (dequantized weights · dequantized activations): the scale of f32 rounding errors.
pub(super) fn mass(w: &[u8], a: &[u8], block_bytes: usize, dequantize_block: fn(&[u8], &mut [f32])) -> f64 {
    let mut y = [0f32; QK_K];
    let mut m = 0f64;
    for (b, qa) in w.chunks_exact(block_bytes).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        dequantize_block(b, &mut y);
        m += (0..QK_K).map(|i| (y[i] as f64 * (q8_k::d(qa) * q8_k::q(qa, i) as f32) as f64).abs()).sum::<f64>();
    }
    m
}

/// The IQ2_XXS grid point with the largest magnitude sum, and that sum.
pub(super) fn iq2_biggest_point() -> (usize, i32) {
    let sum = |i: usize| IQ2XXS_GRID[i].to_le_bytes().iter().map(|&v| v as i32).sum::<i32>();
    (0..256).map(|i| (i, sum(i))).max_by_key(|&(_, s)| s).unwrap_or((0, 0))
}

/// `n` IQ2_XXS blocks with unit scale `d` in which every octet is grid point `point` under sign index `signs` and
/// every group has scale `scale` (the format's extremes when `point` is the biggest, `signs` 127, `scale` 15).
pub(super) fn iq2_uniform_blocks(n: usize, point: usize, signs: u32, scale: u32) -> Vec<u8> {
    let one = half::f16::from_f32(1.0).to_le_bytes();
    let mut w = vec![0u8; n * iq2_xxs::BLOCK_BYTES];
    for b in w.chunks_exact_mut(iq2_xxs::BLOCK_BYTES) {
        b[..2].copy_from_slice(&one);
        for g in 0..8 {
            let o = 2 + 8 * g;
            b[o..o + 4].fill(point as u8);
            let aux = signs | signs << 7 | signs << 14 | signs << 21 | scale << 28;
            b[o + 4..o + 8].copy_from_slice(&aux.to_le_bytes());
        }
    }
    w
}

/// 8 IQ2_XXS blocks with unit scales and random signs and group scales that together use every grid point once
/// (block `b`'s octets are points `32b..32b+32`).
pub(super) fn iq2_every_point_blocks(rng: &mut impl rand::Rng) -> Vec<u8> {
    let mut w = vec![0u8; 8 * iq2_xxs::BLOCK_BYTES];
    rng.fill(&mut w[..]);
    for (bi, b) in w.chunks_exact_mut(iq2_xxs::BLOCK_BYTES).enumerate() {
        b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        for i in 0..32 {
            b[2 + 8 * (i / 4) + i % 4] = (32 * bi + i) as u8;
        }
    }
    w
}

/// Asserts that the any-row-count kernel `kn` gives, for every activation row count `0..=rows.len()` (groups of
/// up to `MAX_ROWS` and their remainders included) against the first 1, 2 and all weight rows of `w` (rows of
/// `row_bytes`; more than one block of weight rows where `w` holds them, and a partial last one), exactly the
/// single kernel `k`'s dot of each pair of rows, bit for bit; and the same with one activation row shortened by a
/// byte (rows of unequal length each go on their own).
pub(super) fn assert_rows_match_single(
    k: crate::quant::DotQ,
    kn: crate::quant::DotQRows,
    w: &[u8],
    row_bytes: usize,
    rows: &[Vec<u8>],
) {
    let wrows: Vec<&[u8]> = w.chunks_exact(row_bytes).collect();
    let single = |a: &[&[u8]], nw: usize| -> Vec<u32> {
        wrows[..nw].iter().flat_map(|wr| a.iter().map(|x| k(wr, x).to_bits())).collect()
    };
    let mut counts = vec![1, 2, wrows.len()];
    counts.dedup();
    for n in 0..=rows.len() {
        let a: Vec<&[u8]> = rows[..n].iter().map(|r| &r[..]).collect();
        for &nw in counts.iter().filter(|&&c| c <= wrows.len()) {
            let mut out = vec![f32::NAN; nw * n];
            kn(&w[..nw * row_bytes], row_bytes, &a, &vec![&[][..]; n], &mut out);
            let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, single(&a, nw), "{n} activation rows, {nw} weight rows");
            if n >= 2 {
                let mut a = a.clone();
                a[n / 2] = &rows[n / 2][..rows[n / 2].len() - 1];
                kn(&w[..nw * row_bytes], row_bytes, &a, &vec![&[][..]; n], &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, single(&a, nw), "{n} rows, row {} shorter, {nw} weight rows", n / 2);
            }
        }
    }
}
