//! f32 kernels of the attention and the indexer that reuse each loaded vector across several rows, with results
//! bit-identical to the one-pair loops they replace.
//!
//! - [`dots`]: the `A × B` dot products of `A` rows with `B` rows; each one is exactly
//!   [`super::matmul::dot_f32`] of its pair (eight lane accumulators `acc[k] += x[k]·y[k]` over the whole groups of
//!   eight, a separate multiply and add, then `((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)) + tail` with the scalar tail).
//!   With AVX one 256-bit register is one pair's eight lanes, so a tile keeps `A·B` independent accumulators in
//!   flight and loads each vector once per tile instead of once per pair.
//! - [`weighted_sums`]: for `H` heads at once, `out_h = Σ_j p_hj · row_j` with every output element accumulated
//!   from `+0.0` over `j` in order (`o += p_hj · r_j[d]`), terms whose weight is below the smallest normal f32 left
//!   out (`p < f32::MIN_POSITIVE`: not added at all) — each head's loop
//!   `for j { if keep { for d { out[d] += p * row_j[d] } } }`, computed 16 (AVX) or 32 (AVX-512) outputs of each
//!   of the `H` heads at a time in registers, so each row's values are loaded once for all `H` heads and `out` is not
//!   loaded and stored once per row. Rows go in segments of 64, each row resolved and classed once per segment: a
//!   row every head keeps is a plain multiply and add, one no head keeps is not read, only a mixed one pays for the
//!   per-head skip. A call may cover a range of rows; a range not starting at 0 continues the stored sums, so
//!   consecutive ranges give the bits of one call (the attention runs every head group over one tile of keys before
//!   the next). The attention's `H` is its head group; the indexer uses [`dots`] only.
//!
//! Each picks its widest SIMD path the CPU has (checked once per call with `is_x86_feature_detected!`, which caches)
//! and otherwise runs the portable loop; every path gives the same bits (`tests` run each one the CPU has).

use std::ops::Range;

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

/// `out[h·n ..][d] += Σ_{j ∈ rows} p[h·nk + j] · row(j)[d]` for `h < H`, `n = out.len() / H`, accumulated in `j`
/// order, from `+0.0` when `rows` starts at 0 (so `0..nk` is the whole sum and a later range continues it, with the
/// same bits as one call), leaving out terms with `p < f32::MIN_POSITIVE` (see the module docs); `row(j)` must hold
/// at least `n` values and `p` at least `H · nk`.
#[inline]
pub fn weighted_sums<'k, const H: usize>(
    out: &mut [f32],
    p: &[f32],
    nk: usize,
    rows: Range<usize>,
    row: impl Fn(usize) -> &'k [f32],
) {
    let n = out.len() / H.max(1);
    assert!(p.len() >= H * nk && rows.end <= nk.max(rows.start), "weights");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above); `avx512::weighted_sums` slices every row it reads.
        unsafe { avx512::weighted_sums::<H>(out, p, nk, rows, n, &row) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present (checked above); `avx::weighted_sums` slices every row it reads.
        unsafe { avx::weighted_sums::<H>(out, p, nk, rows, n, &row) };
        return;
    }
    tail_sums::<H>(out, p, nk, rows, n, 0, &row);
}

/// Rows per segment of the SIMD [`weighted_sums`]: one bit each in the segment's masks.
#[cfg(target_arch = "x86_64")]
const SEG: usize = 64;

/// Resolves and classes rows `s0 .. s0 + rows.len()` of a SIMD [`weighted_sums`] segment: bit `i` of the first
/// mask says every head keeps row `s0 + i`, of the second that at least one does (`!(p < f32::MIN_POSITIVE)`, as the
/// one-head loop); `rows[i]` is that row's first `n` values, or empty where no head keeps it (not read then).
#[cfg(target_arch = "x86_64")]
fn class_rows<'k, const H: usize>(
    p: &[f32],
    nk: usize,
    n: usize,
    s0: usize,
    rows: &mut [&'k [f32]],
    row: &impl Fn(usize) -> &'k [f32],
) -> (u64, u64) {
    debug_assert!(rows.len() <= SEG);
    let (mut all, mut any) = (0u64, 0u64);
    for (i, r) in rows.iter_mut().enumerate() {
        // Not `p < f32::MIN_POSITIVE` (a NaN weight is kept, as in the one-head loop).
        let kept = (0..H).map(|h| p[h * nk + s0 + i]).filter(|&v| v >= f32::MIN_POSITIVE || v.is_nan()).count();
        all |= u64::from(kept == H) << i;
        any |= u64::from(kept > 0) << i;
        *r = if kept > 0 { &row(s0 + i)[..n] } else { &[] };
    }
    (all, any)
}

/// The portable loop of [`weighted_sums`] for outputs `from..n` of each head.
fn tail_sums<'k, const H: usize>(
    out: &mut [f32],
    p: &[f32],
    nk: usize,
    rows: Range<usize>,
    n: usize,
    from: usize,
    row: &impl Fn(usize) -> &'k [f32],
) {
    for h in 0..H {
        let o = &mut out[h * n + from..(h + 1) * n];
        if rows.start == 0 {
            o.fill(0.0);
        }
        for j in rows.clone() {
            let pj = p[h * nk + j];
            if pj < f32::MIN_POSITIVE {
                continue;
            }
            for (o, &v) in o.iter_mut().zip(&row(j)[from..n]) {
                *o += pj * v;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;
    use std::ops::Range;

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
                for (x, y) in ra[chunks * 8..n].iter().zip(&rb[chunks * 8..n]) {
                    tail += x * y;
                }
                *v = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + tail;
            }
        }
        out
    }

    /// [`super::weighted_sums`] with blocks of 16 outputs per head in two 256-bit registers ([`super::simd_sums`]);
    /// in a mixed row a skipped term is blended away, leaving the accumulator as it was.
    ///
    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub unsafe fn weighted_sums<'k, const H: usize>(
        out: &mut [f32],
        p: &[f32],
        nk: usize,
        rows: Range<usize>,
        n: usize,
        row: &impl Fn(usize) -> &'k [f32],
    ) {
        // SAFETY: AVX is available (the caller's contract), so are `__m256`'s operations.
        unsafe { super::simd_sums::<__m256, H>(out, p, nk, rows, n, row) }
    }

    // SAFETY (every method): AVX is available wherever `SumReg` is used for `__m256` (only from `weighted_sums`
    // above), and pointers hold 8 values (the trait's contract).
    impl super::SumReg for __m256 {
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm256_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn add_product(self, p: Self, v: Self) -> Self {
            unsafe { _mm256_add_ps(self, _mm256_mul_ps(p, v)) }
        }
        #[inline(always)]
        unsafe fn add_product_kept(self, p: Self, v: Self) -> Self {
            unsafe {
                let skip = _mm256_cmp_ps::<_CMP_LT_OQ>(p, _mm256_set1_ps(f32::MIN_POSITIVE));
                _mm256_blendv_ps(self.add_product(p, v), self, skip)
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// [`super::weighted_sums`] with blocks of 32 outputs per head in two 512-bit registers ([`super::simd_sums`]);
    /// in a mixed row a skipped term is masked out of the addition (the accumulator lane kept as it was).
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_sums<'k, const H: usize>(
        out: &mut [f32],
        p: &[f32],
        nk: usize,
        rows: Range<usize>,
        n: usize,
        row: &impl Fn(usize) -> &'k [f32],
    ) {
        // SAFETY: AVX-512F is available (the caller's contract), so are `__m512`'s operations.
        unsafe { super::simd_sums::<__m512, H>(out, p, nk, rows, n, row) }
    }

    // SAFETY (every method): AVX-512F is available wherever `SumReg` is used for `__m512` (only from
    // `weighted_sums` above), and pointers hold 16 values (the trait's contract).
    impl super::SumReg for __m512 {
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm512_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn add_product(self, p: Self, v: Self) -> Self {
            unsafe { _mm512_add_ps(self, _mm512_mul_ps(p, v)) }
        }
        #[inline(always)]
        unsafe fn add_product_kept(self, p: Self, v: Self) -> Self {
            unsafe {
                let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(p, _mm512_set1_ps(f32::MIN_POSITIVE));
                _mm512_mask_add_ps(self, keep, self, _mm512_mul_ps(p, v))
            }
        }
    }
}

/// The register of a SIMD [`weighted_sums`] path: `LANES` f32 lanes and the operations the blocks need.
///
/// # Safety
/// Its methods need the CPU feature of the register type (the implementing module's path checks it); `load` and
/// `store` need `LANES` values at the pointer.
#[cfg(target_arch = "x86_64")]
trait SumReg: Copy {
    const LANES: usize;
    unsafe fn zero() -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn splat(x: f32) -> Self;
    /// `self + p · v` per lane (a separate multiply and add).
    unsafe fn add_product(self, p: Self, v: Self) -> Self;
    /// [`SumReg::add_product`] in the lanes whose `p` is kept (`!(p < f32::MIN_POSITIVE)`), `self` in the others.
    unsafe fn add_product_kept(self, p: Self, v: Self) -> Self;
}

/// The SIMD [`weighted_sums`] over registers `R`: the rows are taken in segments of [`SEG`], each resolved and
/// classed once ([`class_rows`]); blocks of `2·R::LANES` outputs of every head are accumulated in `2·H` registers
/// over a segment's rows (from `+0.0` in the first segment, from the stored partial sums after), then the portable
/// loop does the tail. A row no head keeps is not read; a row every head keeps is a plain multiply and add per head;
/// a mixed row goes through [`SumReg::add_product_kept`]. Per output the additions are those of the one-head loop,
/// in the same order.
///
/// # Safety
/// `R`'s CPU feature must be available; inlined into the path that checked it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn simd_sums<'k, R: SumReg, const H: usize>(
    out: &mut [f32],
    p: &[f32],
    nk: usize,
    rows_in: Range<usize>,
    n: usize,
    row: &impl Fn(usize) -> &'k [f32],
) {
    let block = 2 * R::LANES;
    let full = n / block * block;
    let mut rows: [&[f32]; SEG] = [&[]; SEG];
    for s0 in rows_in.clone().step_by(SEG) {
        let rows = &mut rows[..SEG.min(rows_in.end - s0)];
        let (all, any) = class_rows::<H>(p, nk, n, s0, rows, row);
        for b0 in (0..full).step_by(block) {
            // SAFETY (the whole block): `R`'s feature is available (the caller's contract); every pointer below
            // starts `2·LANES = block` values before the end of its slice (`b0 + block ≤ full ≤ n`).
            let mut acc = [[unsafe { R::zero() }; 2]; H];
            if s0 > 0 {
                for (h, a) in acc.iter_mut().enumerate() {
                    let o = &out[h * n + b0..h * n + b0 + block];
                    // SAFETY: as above.
                    unsafe { *a = [R::load(o.as_ptr()), R::load(o.as_ptr().add(R::LANES))] };
                }
            }
            for (i, r) in rows.iter().enumerate() {
                if any >> i & 1 == 0 {
                    continue;
                }
                // SAFETY: as above (a kept row was sliced to `n` values).
                let (v0, v1) = unsafe { (R::load(r.as_ptr().add(b0)), R::load(r.as_ptr().add(b0 + R::LANES))) };
                let j = s0 + i;
                if all >> i & 1 == 1 {
                    for (h, a) in acc.iter_mut().enumerate() {
                        // SAFETY: as above.
                        let pv = unsafe { R::splat(p[h * nk + j]) };
                        // SAFETY: as above.
                        unsafe { *a = [a[0].add_product(pv, v0), a[1].add_product(pv, v1)] };
                    }
                } else {
                    for (h, a) in acc.iter_mut().enumerate() {
                        // SAFETY: as above.
                        let pv = unsafe { R::splat(p[h * nk + j]) };
                        // SAFETY: as above.
                        unsafe { *a = [a[0].add_product_kept(pv, v0), a[1].add_product_kept(pv, v1)] };
                    }
                }
            }
            for (h, a) in acc.iter().enumerate() {
                let o = &mut out[h * n + b0..h * n + b0 + block];
                // SAFETY: as above.
                unsafe {
                    a[0].store(o.as_mut_ptr());
                    a[1].store(o.as_mut_ptr().add(R::LANES));
                }
            }
        }
    }
    zero_or_tail::<H>(out, p, nk, rows_in, n, full, row);
}

/// The end of a SIMD [`weighted_sums`] whose blocks covered outputs `..full` of each head: `+0.0` there for an
/// empty sum from row 0 (no block was written), then the portable loop for outputs `full..n`.
#[cfg(target_arch = "x86_64")]
fn zero_or_tail<'k, const H: usize>(
    out: &mut [f32],
    p: &[f32],
    nk: usize,
    rows: Range<usize>,
    n: usize,
    full: usize,
    row: &impl Fn(usize) -> &'k [f32],
) {
    if rows == (0..0) {
        for h in 0..H {
            out[h * n..h * n + full].fill(0.0);
        }
    }
    if full < n {
        tail_sums::<H>(out, p, nk, rows, n, full, row);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic pseudo-random values in `[-amp, amp)` (xorshift of `seed`), for the kernels' tests.
    pub(crate) fn random_values(n: usize, seed: u32, amp: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                ((x >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * amp
            })
            .collect()
    }

    /// Values in [-2, 2) with a spread of exponents, so rounding differences would show.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let scales = [1.0, 1e-3, 37.0, 0.25];
        random_values(n, seed, 2.0).iter().enumerate().map(|(i, v)| v * scales[i % 4]).collect()
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

    /// A weighted sum of `H` heads: `(out, p, nk, rows, row)`.
    type Sums = for<'a> fn(&mut [f32], &[f32], usize, Range<usize>, &'a dyn Fn(usize) -> &'a [f32]);

    /// Every [`weighted_sums`] path this CPU runs: the dispatching entry point, then each SIMD path by itself
    /// (a CPU with AVX-512 would otherwise never run the AVX one) and the portable loop.
    fn paths<const H: usize>() -> Vec<(&'static str, Sums)> {
        let mut v: Vec<(&'static str, Sums)> = vec![
            ("dispatch", |o, p, nk, r, row| weighted_sums::<H>(o, p, nk, r, row)),
            ("portable", |o, p, nk, r, row| tail_sums::<H>(o, p, nk, r, o.len() / H, 0, &row)),
        ];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx") {
                // SAFETY: AVX is present (checked above).
                v.push(("avx", |o, p, nk, r, row| unsafe { avx::weighted_sums::<H>(o, p, nk, r, o.len() / H, &row) }));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F is present (checked above).
                v.push(("avx512", |o, p, nk, r, row| unsafe {
                    avx512::weighted_sums::<H>(o, p, nk, r, o.len() / H, &row)
                }));
            }
        }
        v
    }

    #[test]
    fn weighted_sums_accumulate_rows_in_order_bit_for_bit() {
        // Row counts below, at and across the AVX path's 64-row segments; outputs with and without a block tail.
        for (n, nk) in [(1usize, 40usize), (8, 3), (15, 64), (16, 65), (17, 40), (130, 129), (512, 200)] {
            let rows: Vec<Vec<f32>> = (0..nk).map(|s| values(n, 1000 + s as u32)).collect();
            // Weights with denormal, zero, negative and tiny-normal entries (the skipped terms and the kept ones),
            // and rows that no head keeps or every head keeps.
            let mut p = values(3 * nk, 5 + n as u32);
            for (i, v) in p.iter_mut().enumerate() {
                match (i % 7, i % nk % 5) {
                    (_, 3) => *v = f32::MIN_POSITIVE / 2.0,
                    (_, 4) => *v = v.abs() + f32::MIN_POSITIVE,
                    (0, _) => *v = f32::MIN_POSITIVE / 3.0,
                    (1, _) => *v = 0.0,
                    (2, _) => *v = f32::MIN_POSITIVE,
                    _ => {}
                }
            }
            let mut want = vec![0f32; 3 * n];
            for (h, want) in want.chunks_exact_mut(n).enumerate() {
                for (j, &pj) in p[h * nk..(h + 1) * nk].iter().enumerate() {
                    if pj < f32::MIN_POSITIVE {
                        continue;
                    }
                    for (o, &v) in want.iter_mut().zip(&rows[j]) {
                        *o += pj * v;
                    }
                }
            }
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            // The whole sum in one call, and continued over ranges that cut segments.
            let cuts = [vec![0, nk], vec![0, nk / 3, nk / 3 + 1, nk - nk / 5, nk]];
            for (path, sums) in paths::<3>() {
                for cut in &cuts {
                    let mut got = vec![f32::NAN; 3 * n];
                    for w in cut.windows(2) {
                        sums(&mut got, &p, nk, w[0]..w[1], &|j| &rows[j][..]);
                    }
                    let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{path}: n {n} nk {nk} ranges {cut:?}");
                }
                let mut got = vec![f32::NAN; 3 * n];
                sums(&mut got, &[], 0, 0..0, &|j| &rows[j][..]);
                assert!(got.iter().all(|v| v.to_bits() == 0), "{path}: an empty sum is +0.0");
            }
        }
    }
}
