//! f32 kernels of the attention and the indexer that reuse each loaded vector across several rows, with results
//! bit-identical to the one-pair loops they replace.
//!
//! - [`dots`]: the `A × B` dot products of `A` rows with `B` rows; each one is exactly
//!   [`super::matmul::dot_f32`] of its pair (eight lane accumulators `acc[k] += x[k]·y[k]` over the whole groups of
//!   eight, a separate multiply and add, then `((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)) + tail` with the scalar tail).
//!   With AVX one 256-bit register is one pair's eight lanes, so a tile keeps `A·B` independent accumulators in
//!   flight and loads each vector once per tile instead of once per pair.
//! - [`weighted_sum`]: `out = Σ_j p_j · row_j` with every output element accumulated from `+0.0` over `j` in order
//!   (`o += p_j · r_j[d]`), the loop `for j { for d { out[d] += p[j] * row_j[d] } }` — computed a block of 64
//!   outputs at a time in registers, so `out` is not loaded and stored once per row.
//!
//! Both pick the AVX path when the CPU has it (checked once per call with `is_x86_feature_detected!`, which caches)
//! and otherwise run the portable loops; both paths give the same bits (`tests`).

use super::matmul::dot_f32;

/// `out[i][j] = dot_f32(a[i], b[j])` for rows of one length `n` (every slice at least `n` long; only the first `n`
/// values are read).
#[inline]
pub fn dots<const A: usize, const B: usize>(a: [&[f32]; A], b: [&[f32]; B], n: usize) -> [[f32; B]; A] {
    assert!(a.iter().chain(b.iter()).all(|r| r.len() >= n), "row shorter than n");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present (checked above) and every row holds at least `n` values (asserted above).
        return unsafe { avx::dots(a, b, n) };
    }
    let mut out = [[0f32; B]; A];
    for (o, ra) in out.iter_mut().zip(a) {
        for (v, rb) in o.iter_mut().zip(b) {
            *v = dot_f32(&ra[..n], &rb[..n]);
        }
    }
    out
}

/// `out[d] = Σ_j p[j] · row(idx[j])[d]` accumulated in `j` order from `+0.0` (see the module docs); `row(i)` must
/// hold at least `out.len()` values.
#[inline]
pub fn weighted_sum<'k>(out: &mut [f32], p: &[f32], idx: &[u32], row: impl Fn(usize) -> &'k [f32]) {
    let n = out.len();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present (checked above); `avx::weighted_sum` checks each row's length.
        unsafe { avx::weighted_sum(out, p, idx, &row) };
        return;
    }
    out.fill(0.0);
    for (&pj, &i) in p.iter().zip(idx) {
        let r = &row(i as usize)[..n];
        for (o, &v) in out.iter_mut().zip(r) {
            *o += pj * v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    /// [`super::dots`] with one 256-bit accumulator per pair.
    ///
    /// # Safety
    /// AVX must be available and every row must hold at least `n` values.
    #[target_feature(enable = "avx")]
    pub unsafe fn dots<const A: usize, const B: usize>(a: [&[f32]; A], b: [&[f32]; B], n: usize) -> [[f32; B]; A] {
        let mut acc = [[_mm256_setzero_ps(); B]; A];
        let chunks = n / 8;
        for c in 0..chunks {
            let mut bv = [_mm256_setzero_ps(); B];
            for (v, r) in bv.iter_mut().zip(&b) {
                // SAFETY: `c·8 + 8 ≤ n ≤ r.len()`.
                *v = unsafe { _mm256_loadu_ps(r.as_ptr().add(c * 8)) };
            }
            for (acc_i, r) in acc.iter_mut().zip(&a) {
                // SAFETY: as above.
                let av = unsafe { _mm256_loadu_ps(r.as_ptr().add(c * 8)) };
                for (s, &v) in acc_i.iter_mut().zip(&bv) {
                    *s = _mm256_add_ps(*s, _mm256_mul_ps(av, v));
                }
            }
        }
        let mut out = [[0f32; B]; A];
        for ((o, acc_i), ra) in out.iter_mut().zip(&acc).zip(&a) {
            for ((v, s), rb) in o.iter_mut().zip(acc_i).zip(&b) {
                let mut l = [0f32; 8];
                // SAFETY: `l` holds 8 floats.
                unsafe { _mm256_storeu_ps(l.as_mut_ptr(), *s) };
                let mut tail = 0f32;
                for k in chunks * 8..n {
                    tail += ra[k] * rb[k];
                }
                *v = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + tail;
            }
        }
        out
    }

    /// Outputs per register block of [`weighted_sum`].
    const BLOCK: usize = 64;

    /// [`super::weighted_sum`]: blocks of 64 outputs in eight registers, then the scalar tail.
    ///
    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub unsafe fn weighted_sum<'k>(out: &mut [f32], p: &[f32], idx: &[u32], row: &impl Fn(usize) -> &'k [f32]) {
        let n = out.len();
        let m = p.len().min(idx.len());
        let full = n / BLOCK * BLOCK;
        for b0 in (0..full).step_by(BLOCK) {
            let mut acc = [_mm256_setzero_ps(); BLOCK / 8];
            for j in 0..m {
                let r = &row(idx[j] as usize)[b0..b0 + BLOCK];
                let pv = _mm256_set1_ps(p[j]);
                for (k, s) in acc.iter_mut().enumerate() {
                    // SAFETY: `r` holds BLOCK values (sliced above), `k·8 + 8 ≤ BLOCK`.
                    let v = unsafe { _mm256_loadu_ps(r.as_ptr().add(k * 8)) };
                    *s = _mm256_add_ps(*s, _mm256_mul_ps(pv, v));
                }
            }
            for (k, s) in acc.iter().enumerate() {
                // SAFETY: `out[b0 + k·8 .. + 8]` is inside `out` (`b0 + BLOCK ≤ full ≤ n`).
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(b0 + k * 8), *s) };
            }
        }
        if full < n {
            let tail = &mut out[full..];
            tail.fill(0.0);
            for j in 0..m {
                let r = &row(idx[j] as usize)[full..n];
                for (o, &v) in tail.iter_mut().zip(r) {
                    *o += p[j] * v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-2, 2) with a spread of exponents, so rounding differences would show.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let m = (x >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0;
                m * [1.0, 1e-3, 37.0, 0.25][(x & 3) as usize]
            })
            .collect()
    }

    #[test]
    fn dot_tiles_are_dot_f32_bit_for_bit() {
        for n in [0usize, 1, 7, 8, 9, 64, 127, 128, 131, 512] {
            let rows: Vec<Vec<f32>> = (0..6).map(|s| values(n, s as u32 + 7 * n as u32)).collect();
            let got = dots::<4, 2>([&rows[0], &rows[1], &rows[2], &rows[3]], [&rows[4], &rows[5]], n);
            for (i, g) in got.iter().enumerate() {
                for (j, &v) in g.iter().enumerate() {
                    assert_eq!(v.to_bits(), dot_f32(&rows[i], &rows[4 + j]).to_bits(), "n {n} pair {i},{j}");
                }
            }
            let got = dots::<1, 3>([&rows[5]], [&rows[0], &rows[2], &rows[3]], n);
            for (j, k) in [0, 2, 3].into_iter().enumerate() {
                assert_eq!(got[0][j].to_bits(), dot_f32(&rows[5], &rows[k]).to_bits(), "n {n} 1x3 {j}");
            }
        }
    }

    #[test]
    fn weighted_sums_accumulate_rows_in_order_bit_for_bit() {
        for n in [1usize, 8, 63, 64, 65, 130, 512] {
            let rows: Vec<Vec<f32>> = (0..40).map(|s| values(n, 1000 + s)).collect();
            let p = values(25, 5);
            let idx: Vec<u32> = (0..25).map(|j| (j * 7 % 40) as u32).collect();
            let mut got = vec![f32::NAN; n];
            weighted_sum(&mut got, &p, &idx, |i| &rows[i]);
            let mut want = vec![0f32; n];
            for (&pj, &i) in p.iter().zip(&idx) {
                for (o, &v) in want.iter_mut().zip(&rows[i as usize]) {
                    *o += pj * v;
                }
            }
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "n {n}");
            weighted_sum(&mut got, &[], &[], |i| &rows[i]);
            assert!(got.iter().all(|v| v.to_bits() == 0), "empty sum is +0.0");
        }
    }
}
