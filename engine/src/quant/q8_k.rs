//! Q8_K: the activation format for the k-quants and IQ2_XXS (256 values per 292-byte block), scalar code.
//!
//! Block layout (little-endian): `f32 d` (bytes 0..4), `i8 q[256]` (bytes 4..260), `i16 bsums[16]` (bytes 260..292,
//! `bsums[j] = Σ q[16j..16j+16]`); value `i` is `d * q[i]`. The block sums let the Q2_K/Q4_K dot products apply
//! their per-sub-block minimums without touching the 256 quants again.
//!
//! Quantizer: symmetric round-to-nearest, `d = amax / 127`, `q ∈ [-127, 127]` (never -128, so SIMD code may negate
//! a quant without overflow). Functions never panic on short buffers (whole blocks only).

use super::QK_K;

pub(crate) const BLOCK_BYTES: usize = 292;
pub(crate) const QS: usize = 4;
pub(crate) const BSUMS: usize = 4 + QK_K;

/// The block's scale.
#[inline(always)]
pub(crate) fn d(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Block sum `j` (of quants `16j..16j+16`).
#[inline(always)]
pub(crate) fn bsum(b: &[u8], j: usize) -> i32 {
    i16::from_le_bytes([b[BSUMS + 2 * j], b[BSUMS + 2 * j + 1]]) as i32
}

/// Quant `i` of the block.
#[inline(always)]
pub(crate) fn q(b: &[u8], i: usize) -> i32 {
    b[QS + i] as i8 as i32
}

pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            b.iter_mut().for_each(|v| *v = 0);
            continue;
        }
        let iscale = 127.0 / amax;
        b[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        for (o, &v) in b[QS..QS + QK_K].iter_mut().zip(x) {
            *o = super::round_i8(v * iscale);
        }
        for j in 0..QK_K / 16 {
            let s: i32 = b[QS + 16 * j..QS + 16 * j + 16].iter().map(|&v| v as i8 as i32).sum();
            b[BSUMS + 2 * j..BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
    }
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let dd = d(b);
        for (i, yi) in y.iter_mut().enumerate() {
            *yi = dd * q(b, i) as f32;
        }
    }
}

/// Bytes of a pair of blocks (the unit of the value-major pair layout, see `quant::act`).
pub(crate) const PAIR_BYTES: usize = 2 * BLOCK_BYTES;

/// Byte offset, inside a pair, of block `k`'s scale `d` (f32).
pub(crate) const PAIR_D: [usize; 2] = [0, 4];

/// Byte offset, inside a pair, of the block sums in kernel lane order: i32 lane `L = 4m + r` (4 bytes at
/// `PAIR_LANE_BSUMS + 4L`) holds the two i16 block sums (16 values each) of the group that lane accumulates, group
/// `2m + r % 2` of block `r / 2` (see [`pair_value`]).
pub(crate) const PAIR_LANE_BSUMS: usize = 8 + 8 * 64;

const _: () = assert!(PAIR_LANE_BSUMS + 64 == PAIR_BYTES);

/// The (block, group) whose sums i32 lane `lane` (0..16) of a pair accumulates.
#[inline(always)]
pub(crate) const fn lane_group(lane: usize) -> (usize, usize) {
    let (m, r) = (lane / 4, lane % 4);
    (r / 2, 2 * m + r % 2)
}

/// Byte offset, inside a pair of blocks in the pair layout, of vector `j` (value `j` of each of the pair's 64
/// octets, ordered by [`pair_value`]).
#[inline(always)]
pub(crate) const fn pair_vector(j: usize) -> usize {
    8 + 64 * j
}

/// The pair value (0..512: block `v / 256`, quant `v % 256`) stored at byte `p` of vector `j` in the pair layout.
/// Byte `p` is octet `p % 4` of i32 lane `p / 4 = 4m + r`, which holds group `2m + r % 2` of block `r / 2`: the
/// order `vshufps` puts the two blocks' grid-index dwords in.
#[inline(always)]
pub(crate) const fn pair_value(j: usize, p: usize) -> usize {
    let (k, g) = lane_group(p / 4);
    QK_K * k + 32 * g + 8 * (p % 4) + j
}

/// Lays out every whole pair of blocks in `row` (plain Q8_K) as the pair layout (`quant::act`): the two scales,
/// the 8 value-major vectors, the block sums in lane order. A last lone block and any partial block stay as they
/// are.
pub(crate) fn to_pairs(row: &mut [u8]) {
    let mut plain = [0u8; PAIR_BYTES];
    for pair in row.chunks_exact_mut(PAIR_BYTES) {
        plain.copy_from_slice(pair);
        for k in 0..2 {
            pair[PAIR_D[k]..PAIR_D[k] + 4].copy_from_slice(&plain[k * BLOCK_BYTES..k * BLOCK_BYTES + 4]);
        }
        for j in 0..8 {
            let v = pair_vector(j);
            for p in 0..64 {
                let i = pair_value(j, p);
                pair[v + p] = plain[(i / QK_K) * BLOCK_BYTES + QS + i % QK_K];
            }
        }
        for lane in 0..16 {
            let (k, g) = lane_group(lane);
            let o = k * BLOCK_BYTES + BSUMS + 4 * g;
            pair[PAIR_LANE_BSUMS + 4 * lane..PAIR_LANE_BSUMS + 4 * lane + 4].copy_from_slice(&plain[o..o + 4]);
        }
    }
}

/// The inverse of [`to_pairs`] for one pair: the two plain Q8_K blocks of a pair-layout pair.
pub(crate) fn from_pair(pair: &[u8], out: &mut [u8; PAIR_BYTES]) {
    for k in 0..2 {
        out[k * BLOCK_BYTES..k * BLOCK_BYTES + 4].copy_from_slice(&pair[PAIR_D[k]..PAIR_D[k] + 4]);
    }
    for j in 0..8 {
        let v = pair_vector(j);
        for p in 0..64 {
            let i = pair_value(j, p);
            out[(i / QK_K) * BLOCK_BYTES + QS + i % QK_K] = pair[v + p];
        }
    }
    for lane in 0..16 {
        let (k, g) = lane_group(lane);
        let o = k * BLOCK_BYTES + BSUMS + 4 * g;
        out[o..o + 4].copy_from_slice(&pair[PAIR_LANE_BSUMS + 4 * lane..PAIR_LANE_BSUMS + 4 * lane + 4]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bsums_match_quants_and_error_is_half_a_step() {
        let x: Vec<f32> = (0..2 * QK_K).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut b = vec![0u8; 2 * BLOCK_BYTES];
        quantize(&x, &mut b);
        for blk in b.chunks_exact(BLOCK_BYTES) {
            for j in 0..16 {
                assert_eq!(bsum(blk, j), (16 * j..16 * j + 16).map(|i| q(blk, i)).sum::<i32>());
            }
            assert!((0..QK_K).all(|i| q(blk, i) >= -127));
        }
        let mut y = vec![0f32; 2 * QK_K];
        dequantize(&b, &mut y);
        for (blk, (xs, ys)) in b.chunks_exact(BLOCK_BYTES).zip(x.chunks(QK_K).zip(y.chunks(QK_K))) {
            for (a, c) in xs.iter().zip(ys) {
                assert!((a - c).abs() <= d(blk) * 0.5001);
            }
        }
    }

    #[test]
    fn pair_layout_round_trips_and_keeps_scales() {
        for blocks in [1usize, 2, 3, 4, 5] {
            let x: Vec<f32> = (0..blocks * QK_K).map(|i| ((i * 7919 + i / 97) % 1013) as f32 / 506.0 - 1.0).collect();
            let mut row = vec![0u8; blocks * BLOCK_BYTES];
            quantize(&x, &mut row);
            let plain = row.clone();
            to_pairs(&mut row);
            for (pi, pair) in row.chunks_exact(PAIR_BYTES).enumerate() {
                let blk = |k: usize| &plain[pi * PAIR_BYTES + k * BLOCK_BYTES..];
                for k in 0..2 {
                    assert_eq!(pair[PAIR_D[k]..PAIR_D[k] + 4], blk(k)[..4], "{blocks} blocks: scale of block {k}");
                }
                for lane in 0..16 {
                    let (k, g) = (lane % 4 / 2, 2 * (lane / 4) + lane % 2);
                    let o = PAIR_LANE_BSUMS + 4 * lane;
                    assert_eq!(pair[o..o + 4], blk(k)[BSUMS + 4 * g..BSUMS + 4 * g + 4], "lane {lane} sums");
                    let sum = (32 * g..32 * g + 32).map(|i| q(blk(k), i)).sum::<i32>();
                    let lane_sum =
                        i16::from_le_bytes([pair[o], pair[o + 1]]) + i16::from_le_bytes([pair[o + 2], pair[o + 3]]);
                    assert_eq!(lane_sum as i32, sum, "lane {lane}: sums of its group");
                }
                // Byte p of vector j: value j of octet p % 4 of lane p / 4 = 4m + r, group 2m + r % 2 of block
                // r / 2; every value exactly once.
                let mut seen = [false; 2 * QK_K];
                for j in 0..8 {
                    for p in 0..64 {
                        let (m, r) = (p / 16, p / 4 % 4);
                        let (k, i) = (r / 2, 32 * (2 * m + r % 2) + 8 * (p % 4) + j);
                        assert_eq!(pair[pair_vector(j) + p], blk(k)[QS + i], "{blocks} blocks: vector {j} byte {p}");
                        assert!(!seen[k * QK_K + i]);
                        seen[k * QK_K + i] = true;
                    }
                }
                assert!(seen.iter().all(|&s| s));
                let mut back = [0u8; PAIR_BYTES];
                from_pair(pair, &mut back);
                assert_eq!(back[..], plain[pi * PAIR_BYTES..(pi + 1) * PAIR_BYTES]);
            }
            if blocks % 2 == 1 {
                let o = (blocks - 1) * BLOCK_BYTES;
                assert_eq!(row[o..], plain[o..], "the lone last block stays plain");
            }
        }
    }
}
