//! IQ2_XXS: 256 values per 66-byte block (2.0625 bits per weight), scalar reference code.
//!
//! Block layout (little-endian): `f16 d` (bytes 0..2), then 8 groups of 32 values, 8 bytes each (group `g` at
//! `2 + 8g`):
//! - bytes 0..4: four grid indices `a_0..a_3`, one per 8 values (`IQ2XXS_GRID[a_l]` = 8 magnitudes, each 8, 25 or 43);
//! - bytes 4..8: a u32 `aux`: bits `7l..7l+7` = sign index `k_l` of octet `l`, bits 28..32 = the group scale `s`.
//!
//! Value `j` of octet `l` of group `g` is `(d·(0.5+s)·0.25)·grid[a_l][j]·(−1 if bit j of KSIGNS_IQ2XS[k_l])`,
//! in that order (as ggml and `gguf` compute it). The 8th sign is implied: every octet has an even number of minus
//! signs.
//!
//! Dot with Q8_K activations: `d·d_a/8·Σ_g (2s_g+1)·Σ grid·sign·a` with integer inner sums.
//!
//! Quantizer (written for this engine; not ggml's): per group, fix the signs (flipping the smallest-magnitude value
//! of an octet whose count of negatives is odd), then search ~15 group scales, each picking for every octet the
//! nearest grid point under the weighted squared error (a 3^8 lookup when the per-value optimum is a grid point,
//! else the best of its precomputed grid neighbours) and refitting the scale by least squares. The group
//! scales are then quantized to 4 bits against a block `d` (two candidates tried, neighbouring `s` values checked)
//! and grid points re-picked for the stored scales. Weights: 1 by default, the importance values when given.
//! Functions never panic on short buffers (whole blocks only).

use std::sync::OnceLock;

use super::f16::{f16_at, f16_bytes};
use super::iq2_tables::{IQ2XXS_GRID, KMASK_IQ2XS, KSIGNS_IQ2XS};
use super::kquant_search::nearest;
use super::{q8_k, QK_K};

pub(crate) const BLOCK_BYTES: usize = 66;

/// The three magnitudes a grid value can take.
const LEVELS: [f32; 3] = [8.0, 25.0, 43.0];

#[inline(always)]
fn aux(b: &[u8], g: usize) -> u32 {
    let o = 2 + 8 * g + 4;
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Dequantizes one block into 256 values.
#[inline(always)]
pub(crate) fn dequantize_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for g in 0..8 {
        let a = aux(b, g);
        let db = d * (0.5 + (a >> 28) as f32) * 0.25;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[b[2 + 8 * g + l] as usize].to_le_bytes();
            let signs = KSIGNS_IQ2XS[((a >> (7 * l)) & 127) as usize];
            for j in 0..8 {
                let sign = if signs & KMASK_IQ2XS[j] != 0 { -1.0 } else { 1.0 };
                y[32 * g + 8 * l + j] = db * grid[j] as f32 * sign;
            }
        }
    }
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_block(b, y);
    }
}

/// IQ2_XXS weights · f32 activations over the whole blocks both hold.
pub(crate) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    super::dot_f32_by_blocks(w, x, BLOCK_BYTES, dequantize_block)
}

/// IQ2_XXS weights · Q8_K activations over the whole blocks both hold.
pub(crate) fn dot_q8k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (b, qa) in w.chunks_exact(BLOCK_BYTES).zip(a.chunks_exact(q8_k::BLOCK_BYTES)) {
        acc += block_dot_q8k(b, qa);
    }
    acc
}

/// One block's term of [`dot_q8k`]: `d·d_a/8 · Σ_g (2s_g+1)·Σ grid·sign·q`.
#[inline(always)]
fn block_dot_q8k(b: &[u8], qa: &[u8]) -> f32 {
    let mut bsum = 0i32;
    for g in 0..8 {
        let ax = aux(b, g);
        let mut sumi = 0i32;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[b[2 + 8 * g + l] as usize].to_le_bytes();
            let signs = KSIGNS_IQ2XS[((ax >> (7 * l)) & 127) as usize];
            for j in 0..8 {
                let v = grid[j] as i32 * q8_k::q(qa, 32 * g + 8 * l + j);
                sumi += if signs & KMASK_IQ2XS[j] != 0 { -v } else { v };
            }
        }
        bsum += (2 * (ax >> 28) as i32 + 1) * sumi;
    }
    f16_at(b, 0) * q8_k::d(qa) * 0.125 * bsum as f32
}

/// [`dot_q8k`] with activations in the pair layout (`quant::act`, `ActType::Q8KPairs`): bit-identical to
/// `dot_q8k` on the same activations in plain Q8_K (same terms, same order).
pub(crate) fn dot_q8k_pairs(w: &[u8], a: &[u8]) -> f32 {
    let blocks = (w.len() / BLOCK_BYTES).min(a.len() / q8_k::BLOCK_BYTES);
    let mut acc = 0f32;
    let mut plain = [0u8; q8_k::PAIR_BYTES];
    let mut b = 0;
    while b + 2 <= blocks {
        q8_k::from_pair(&a[b * q8_k::BLOCK_BYTES..(b + 2) * q8_k::BLOCK_BYTES], &mut plain);
        for k in 0..2 {
            acc += block_dot_q8k(&w[(b + k) * BLOCK_BYTES..], &plain[k * q8_k::BLOCK_BYTES..]);
        }
        b += 2;
    }
    if b < blocks {
        acc += block_dot_q8k(&w[b * BLOCK_BYTES..], &a[b * q8_k::BLOCK_BYTES..]);
    }
    acc
}

/// Per grid point, the level index (0, 1, 2 for 8, 25, 43) of each of its 8 values.
fn grid_levels() -> &'static [[u8; 8]; 256] {
    static T: OnceLock<[[u8; 8]; 256]> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = [[0u8; 8]; 256];
        for (p, row) in t.iter_mut().enumerate() {
            for (j, v) in IQ2XXS_GRID[p].to_le_bytes().iter().enumerate() {
                row[j] = (*v > 8) as u8 + (*v > 25) as u8;
            }
        }
        t
    })
}

/// Base-3 code of 8 level indices → grid point, or -1 when that combination is not on the grid.
fn grid_lookup() -> &'static [i16] {
    static T: OnceLock<Vec<i16>> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = vec![-1i16; 6561];
        for (p, row) in grid_levels().iter().enumerate() {
            let code = row.iter().rev().fold(0usize, |c, &l| c * 3 + l as usize);
            t[code] = p as i16;
        }
        t
    })
}

/// For every base-3 code that is not a grid point, the grid points nearest to it in level space (L1 distance over
/// level indices at most one more than the minimum), flattened: `(offsets[code]..offsets[code + 1])` into `points`.
struct Neighbours {
    offsets: Vec<u32>,
    points: Vec<u8>,
}

fn neighbours() -> &'static Neighbours {
    static T: OnceLock<Neighbours> = OnceLock::new();
    T.get_or_init(|| {
        let levels = grid_levels();
        let mut offsets = Vec::with_capacity(6562);
        let mut points = Vec::new();
        let mut dist = [0u32; 256];
        for code in 0..6561usize {
            offsets.push(points.len() as u32);
            if grid_lookup()[code] >= 0 {
                continue;
            }
            let mut c = code;
            let mut lv = [0u8; 8];
            for l in lv.iter_mut() {
                *l = (c % 3) as u8;
                c /= 3;
            }
            for (p, row) in levels.iter().enumerate() {
                dist[p] = (0..8).map(|j| (lv[j] as i32 - row[j] as i32).unsigned_abs()).sum();
            }
            let dmin = dist.iter().copied().min().unwrap_or(0);
            points.extend((0..256).filter(|&p| dist[p] <= dmin + 1).map(|p| p as u8));
        }
        offsets.push(points.len() as u32);
        Neighbours { offsets, points }
    })
}

/// The grid point (nearly) minimising `Σ w (γ·g_j − t_j)²` for one octet, and that error: exact when the per-value
/// optimum is a grid point, else the best of that optimum's grid neighbours (ggml's approach; exhaustive search
/// over all 256 points changed the round-trip error by < 1% in our measurements and costs ~20× more).
fn best_grid_point(t: &[f32], w: &[f32], gamma: f32) -> (u8, f32) {
    let mut e = [[0f32; 3]; 8];
    let mut code = 0usize;
    let mut base_err = 0f32;
    for j in (0..8).rev() {
        let mut best = 0usize;
        for k in 0..3 {
            let diff = gamma * LEVELS[k] - t[j];
            e[j][k] = w[j] * diff * diff;
            if e[j][k] < e[j][best] {
                best = k;
            }
        }
        code = code * 3 + best;
        base_err += e[j][best];
    }
    let idx = grid_lookup()[code];
    if idx >= 0 {
        return (idx as u8, base_err);
    }
    let nb = neighbours();
    let levels = grid_levels();
    let mut best = (0u8, f32::INFINITY);
    for &p in &nb.points[nb.offsets[code] as usize..nb.offsets[code + 1] as usize] {
        let row = &levels[p as usize];
        let err: f32 = (0..8).map(|j| e[j][row[j] as usize]).sum();
        if err < best.1 {
            best = (p, err);
        }
    }
    best
}

/// One 32-value group with its signs fixed: targets `t` (|x|, or −|x| for a flipped value), weights, and the
/// 4 sign indices.
struct Group {
    t: [f32; 32],
    w: [f32; 32],
    sign_idx: [u8; 4],
}

impl Group {
    fn new(x: &[f32], w: &[f32]) -> Self {
        let mut t = [0f32; 32];
        let mut ww = [0f32; 32];
        let mut sign_idx = [0u8; 4];
        for l in 0..4 {
            let xs = &x[8 * l..8 * l + 8];
            let mut mask = 0u8;
            for (j, v) in xs.iter().enumerate() {
                if *v < 0.0 {
                    mask |= 1 << j;
                }
                t[8 * l + j] = v.abs();
                ww[8 * l + j] = w[8 * l + j];
            }
            if mask.count_ones() % 2 == 1 {
                // Flip the value that costs least to get wrong: smallest weighted magnitude.
                let j = (0..8)
                    .min_by(|&a, &b| (ww[8 * l + a] * t[8 * l + a]).total_cmp(&(ww[8 * l + b] * t[8 * l + b])))
                    .unwrap_or(0);
                mask ^= 1 << j;
                t[8 * l + j] = -t[8 * l + j];
            }
            sign_idx[l] = mask & 127;
        }
        Group { t, w: ww, sign_idx }
    }

    /// Best grid points for scale `gamma`: (points, weighted error).
    fn pick(&self, gamma: f32) -> ([u8; 4], f32) {
        let mut pts = [0u8; 4];
        let mut err = 0f32;
        for l in 0..4 {
            let (p, e) = best_grid_point(&self.t[8 * l..8 * l + 8], &self.w[8 * l..8 * l + 8], gamma);
            pts[l] = p;
            err += e;
        }
        (pts, err)
    }

    /// Least-squares scale for fixed grid points with its numerator and denominator (None when degenerate).
    fn refit(&self, pts: &[u8; 4]) -> Option<(f32, f32, f32)> {
        let (mut num, mut den) = (0f32, 0f32);
        for l in 0..4 {
            let g = IQ2XXS_GRID[pts[l] as usize].to_le_bytes();
            for j in 0..8 {
                let gv = g[j] as f32;
                num += self.w[8 * l + j] * self.t[8 * l + j] * gv;
                den += self.w[8 * l + j] * gv * gv;
            }
        }
        (den > 0.0 && num > 0.0).then(|| (num / den, num, den))
    }

    /// Searches a continuous group scale (value per grid unit).
    fn best_gamma(&self) -> f32 {
        let tmax = self.t.iter().fold(0f32, |m, v| m.max(v.abs()));
        if tmax == 0.0 {
            return 0.0;
        }
        let mut best = (0f32, f32::INFINITY);
        // Mostly "the largest value lands near 43", plus candidates where it lands on 25 or 8 (flat groups).
        let cands = (0..10)
            .map(|k| tmax / 43.0 * (0.55 + 0.1 * k as f32))
            .chain([0.9f32, 1.0, 1.1].map(|f| tmax / 25.0 * f))
            .chain([0.9f32, 1.0].map(|f| tmax / 8.0 * f));
        let sum_wt2: f32 = (0..32).map(|i| self.w[i] * self.t[i] * self.t[i]).sum();
        for gamma in cands {
            let (pts, _) = self.pick(gamma);
            if let Some((g2, num, den)) = self.refit(&pts) {
                // Error of these points at the refitted scale: Σwt² − num²/den.
                let e2 = sum_wt2 - num * num / den;
                if e2 < best.1 {
                    best = (g2, e2);
                }
            }
        }
        best.0
    }
}

pub(crate) fn quantize(src: &[f32], importance: Option<&[f32]>, dst: &mut [u8]) {
    for (bi, (x, b)) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BLOCK_BYTES)).enumerate() {
        let w: [f32; QK_K] = match importance {
            Some(imp) => {
                let mut w = [0f32; QK_K];
                w.copy_from_slice(&imp[bi * QK_K..(bi + 1) * QK_K]);
                w
            }
            None => [1.0; QK_K],
        };
        quantize_block(x, &w, b);
    }
}

/// Encodes one block for the stored `d` (f16 already rounded); returns the weighted error.
fn encode(groups: &[Group], gammas: &[f32; 8], d: f32, out: &mut [u8]) -> f32 {
    let mut total = 0f32;
    for (g, grp) in groups.iter().enumerate() {
        let (mut best_s, mut best_pts, mut best_e) = (0u32, [0u8; 4], f32::INFINITY);
        if d > 0.0 {
            let s0 = nearest(gammas[g] * 8.0 / d * 0.5 - 0.5).clamp(0, 15);
            for s in (s0 - 1).max(0)..=(s0 + 1).min(15) {
                let gamma = d * (0.5 + s as f32) * 0.25;
                let (pts, e) = grp.pick(gamma);
                if e < best_e {
                    (best_s, best_pts, best_e) = (s as u32, pts, e);
                }
            }
        } else {
            best_e = grp.pick(0.0).1;
        }
        total += best_e;
        let o = 2 + 8 * g;
        out[o..o + 4].copy_from_slice(&best_pts);
        let mut a = best_s << 28;
        for l in 0..4 {
            a |= (grp.sign_idx[l] as u32) << (7 * l);
        }
        out[o + 4..o + 8].copy_from_slice(&a.to_le_bytes());
    }
    total
}

fn quantize_block(x: &[f32], w: &[f32], b: &mut [u8]) {
    let groups: Vec<Group> = (0..8).map(|g| Group::new(&x[32 * g..32 * g + 32], &w[32 * g..32 * g + 32])).collect();
    let mut gammas = [0f32; 8];
    for (g, grp) in groups.iter().enumerate() {
        gammas[g] = grp.best_gamma();
    }
    let gmax = gammas.iter().fold(0f32, |m, &v| m.max(v));
    // γ = d·(2s+1)/8, so s = 15 reaches γ = d·31/8.
    let mut best_e = f32::INFINITY;
    let mut tmp = [0u8; BLOCK_BYTES];
    for f in [1.0f32, 0.9] {
        let d_bytes = f16_bytes(gmax * 8.0 / 31.0 * f);
        tmp[..2].copy_from_slice(&d_bytes);
        let e = encode(&groups, &gammas, f16_at(&tmp, 0), &mut tmp);
        if e < best_e {
            best_e = e;
            b[..BLOCK_BYTES].copy_from_slice(&tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_lookup_covers_every_point_once() {
        let t = grid_lookup();
        assert_eq!(t.iter().filter(|&&v| v >= 0).count(), 256);
    }

    #[test]
    fn sign_table_has_even_parity() {
        for (k, &s) in KSIGNS_IQ2XS.iter().enumerate() {
            assert_eq!(s & 127, k as u8);
            assert_eq!(s.count_ones() % 2, 0);
        }
    }

    #[test]
    fn exact_grid_values_round_trip() {
        // Build a block straight from grid points with even sign parity and check the quantizer recovers it.
        let mut x = [0f32; QK_K];
        let d = 0.01f32;
        for g in 0..8 {
            let s = 15 - g as u32; // distinct scales, largest first so gmax sets d
            let db = half::f16::from_f32(d).to_f32() * (0.5 + s as f32) * 0.25;
            for l in 0..4 {
                let p = (37 * (4 * g + l) + 11) % 256;
                let grid = IQ2XXS_GRID[p].to_le_bytes();
                let signs = KSIGNS_IQ2XS[(5 * g + 3 * l) % 128];
                for j in 0..8 {
                    let sign = if signs & KMASK_IQ2XS[j] != 0 { -1.0 } else { 1.0 };
                    x[32 * g + 8 * l + j] = db * grid[j] as f32 * sign;
                }
            }
        }
        let mut b = [0u8; BLOCK_BYTES];
        quantize(&x, None, &mut b);
        let mut y = [0f32; QK_K];
        dequantize(&b, &mut y);
        let err: f32 = x.iter().zip(&y).map(|(a, c)| (a - c) * (a - c)).sum::<f32>().sqrt();
        let sig: f32 = x.iter().map(|a| a * a).sum::<f32>().sqrt();
        assert!(err / sig < 0.02, "relative error {}", err / sig);
    }
}
