//! Helpers shared by the x86-64 kernel modules (`avx2`, `avx2_x4`, `avx512`, `avx512_iq2`, `avx512_q2k`): the exact
//! scalar f16 conversion, the weight-row prefetch, small load/sum wrappers, 64-byte vector constants and the
//! row-count dispatch of the `N`-generic multi-row kernels ([`dot_rows`]). A leaf:
//! it imports no other kernel module, so the kernel modules depend on it and on each other in one direction only
//! (`avx2` ← `avx2_x4`; `avx2` ← `avx512` ← `avx512_iq2`; `avx512_q2k`), and the choice between them lives in
//! `simd` itself.

use std::arch::x86_64::*;

/// The little-endian f16 at `b[off..off + 2]` as f32, exact, computed in general-purpose registers.
///
/// Not F16C: for a single scalar LLVM emits `vpinsrw` + `vcvtph2ps`, and the `vpinsrw` merges into an arbitrary
/// register (often the loop's accumulator), adding a false dependency to the loop-carried chain (measured 3x slower
/// Q8_0 dots). Normal halves get their exponent rebiased in integer arithmetic; subnormal halves (scales below
/// 6.1e-5, which small weights do produce) are `mantissa · 2^-24`, an int-to-float conversion and a multiply
/// whose operands are normal f32 — never a denormal operand, which costs a ~150-cycle microcode assist per use on
/// Intel cores (measured: a Q8_0 dot 17× slower on subnormal scales when this went through one); infinities and
/// NaNs get an all-ones exponent. The branch costs a misprediction per block only where a tensor's scales
/// straddle 6.1e-5 at random (the synthetic `wo_b`: its Q8_0 product at ~60 % speed). Measured alternatives were
/// worse overall: a mask-select version (always converting both ways) slowed every Q8_0 product (synthetic logits
/// 23 → 29 ms), and F16C (`vmovd` + `vcvtph2ps`, uniform in the scales) made Q8_0 dots 24 % slower in cache and
/// prefill 13 % slower.
#[inline(always)]
pub(super) fn f16_at(b: &[u8], off: usize) -> f32 {
    let h = u16::from_le_bytes([b[off], b[off + 1]]) as u32;
    let em = h & 0x7fff;
    let mag = if em >= 0x7c00 {
        (em << 13) | 0x7f80_0000
    } else if em >= 0x0400 {
        (em << 13) + (112 << 23)
    } else {
        (em as f32 * f32::from_bits(0x3380_0000)).to_bits()
    };
    f32::from_bits(mag | ((h & 0x8000) << 16))
}

/// How far ahead (bytes) the quantized dots prefetch the weight row into L1: enough to cover the L2 latency and
/// some DRAM latency at the kernels' per-core rate. Measured with `ds4-bench kernels --batch 0`: 768 B < 1536 B <
/// 3072 B (Q2_K 0.55 → 0.76 → 0.85 of the bandwidth, L1 prefetch alone).
const PF_AHEAD: usize = 3072;

/// How far ahead (bytes) they also prefetch into L2 (`prefetcht1`): the hardware prefetchers of the VMs this was
/// measured on do not run far enough ahead of a compute-heavy loop (no software prefetch at all: IQ2_XXS at 0.48 of
/// the bandwidth), and an L1 prefetch occupies a fill buffer for the whole DRAM latency. 8–48 KiB all measured
/// alike; IQ2_XXS gate/up 0.73 → 0.85 with two threads.
const PF_FAR: usize = 12 << 10;

/// Prefetches the cache lines at `p + PF_AHEAD + 64·k` into L1 and at `p + PF_FAR + 64·k` into L2, `k < LINES`.
/// A hint only: it never faults, and the address is formed with `wrapping_add` so running past the end of the
/// weights is harmless.
#[inline(always)]
pub(super) fn prefetch_ahead<const LINES: usize>(p: *const u8) {
    for k in 0..LINES {
        // SAFETY: `_mm_prefetch` is a hint that never faults (SSE, baseline on x86-64); the addresses are not
        // dereferenced by Rust code.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PF_AHEAD + 64 * k) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(PF_FAR + 64 * k) as *const i8);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Loads 32 bytes from `p`.
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn ld_si256(p: *const u8) -> __m256i {
    // SAFETY: guaranteed by the caller.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// 64 bytes, 64-byte aligned (vector constants).
#[repr(C, align(64))]
pub(super) struct A64(pub(super) [u8; 64]);

/// Loads 64 bytes from `p`.
///
/// # Safety
/// `p` must be valid for reading 64 bytes.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn ld(p: *const u8) -> __m512i {
    // SAFETY: guaranteed by the caller.
    unsafe { _mm512_loadu_si512(p as *const __m512i) }
}

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn ld64(t: &A64) -> __m512i {
    // SAFETY: `t` is 64 readable bytes.
    unsafe { ld(t.0.as_ptr()) }
}

/// An `N`-row kernel generic in `N` (one weight decode per block for all rows), for [`dot_rows`].
pub(super) trait RowsKernel {
    /// `[dot(w, a[0]), ..]` for rows of equal length, each bit-identical to the kernel's single-row dot.
    ///
    /// # Safety
    /// The CPU has the features the kernel needs (the caller checked them before handing the kernel out).
    unsafe fn rows<const N: usize>(w: &[u8], a: [&[u8]; N]) -> [f32; N];

    /// `put(r, rows(row r, a))` for the `w.len() / row_bytes` weight rows of `row_bytes` bytes in `w` (rows of
    /// equal length, as for [`RowsKernel::rows`]), in any order: a kernel may go through several weight rows a
    /// span of blocks at a time (so the activation rows' span stays in L1 across them) as long as each result is
    /// bit-identical to [`RowsKernel::rows`]'. This default is one call per weight row.
    ///
    /// # Safety
    /// As for [`RowsKernel::rows`].
    unsafe fn block<const N: usize>(w: &[u8], row_bytes: usize, a: [&[u8]; N], put: &mut dyn FnMut(usize, [f32; N])) {
        for (r, wr) in w.chunks_exact(row_bytes.max(1)).enumerate() {
            // SAFETY: the caller's contract.
            put(r, unsafe { Self::rows::<N>(wr, a) });
        }
    }
}

/// Weight rows [`dot_rows`] hands to [`RowsKernel::block`] at once: each group of activation rows goes through
/// them in turn, so groups after the first read them from L2 rather than memory (16 IQ2_XXS rows of 4096 values:
/// 16.5 KiB).
const BLOCK_ROWS: usize = 16;

/// [`super::super::api::DotQRows`] over an `N`-generic kernel: `out[r * a.len() + i] = dot(row r of w, a[i])`,
/// weight rows [`BLOCK_ROWS`] at a time; the activation rows in groups of at most
/// [`super::super::api::MAX_ROWS`] per weight decode, as even as possible (9 rows: 5 + 4, not 8 + 1); rows of
/// another length than the first each on their own.
///
/// # Safety
/// As for [`RowsKernel::rows`].
pub(super) unsafe fn dot_rows<K: RowsKernel>(w: &[u8], row_bytes: usize, a: &[&[u8]], out: &mut [f32]) {
    /// `K::block::<N>` on the `N` rows of `a` from `i0`, into columns `i0..i0 + N` of `out` (rows of `m`).
    ///
    /// # Safety
    /// As for [`RowsKernel::rows`].
    unsafe fn group<K: RowsKernel, const N: usize>(w: &[u8], rb: usize, a: &[&[u8]], i0: usize, out: &mut [f32]) {
        let (m, g) = (a.len(), std::array::from_fn(|i| a[i0 + i]));
        let mut put = |r: usize, v: [f32; N]| out[r * m + i0..r * m + i0 + N].copy_from_slice(&v);
        // SAFETY (both): the caller's contract.
        if w.len() == rb {
            // One weight row (nothing to tile): the plain form, without the block's set-up.
            put(0, unsafe { K::rows::<N>(w, g) });
        } else {
            unsafe { K::block::<N>(w, rb, g, &mut put) };
        }
    }
    let m = a.len();
    if m == 0 || row_bytes == 0 {
        return;
    }
    let rows = (w.len() / row_bytes).min(out.len() / m);
    let (w, out) = (&w[..rows * row_bytes], &mut out[..rows * m]);
    if a.iter().any(|x| x.len() != a[0].len()) {
        for (wr, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(m)) {
            for (o, x) in out.iter_mut().zip(a) {
                // SAFETY: the caller's contract.
                *o = unsafe { K::rows::<1>(wr, [x]) }[0];
            }
        }
        return;
    }
    const MAX: usize = super::super::api::MAX_ROWS;
    const _: () = assert!(MAX == 8, "one match arm per group size");
    let groups = m.div_ceil(MAX);
    for (wb, ob) in w.chunks(BLOCK_ROWS * row_bytes).zip(out.chunks_mut(BLOCK_ROWS * m)) {
        let mut i0 = 0;
        for g in 0..groups {
            let len = m / groups + usize::from(g < m % groups);
            // SAFETY (every arm): the caller's contract; rows `i0..i0 + len` of `a` exist (the lengths sum to `m`).
            unsafe {
                match len {
                    1 => group::<K, 1>(wb, row_bytes, a, i0, ob),
                    2 => group::<K, 2>(wb, row_bytes, a, i0, ob),
                    3 => group::<K, 3>(wb, row_bytes, a, i0, ob),
                    4 => group::<K, 4>(wb, row_bytes, a, i0, ob),
                    5 => group::<K, 5>(wb, row_bytes, a, i0, ob),
                    6 => group::<K, 6>(wb, row_bytes, a, i0, ob),
                    7 => group::<K, 7>(wb, row_bytes, a, i0, ob),
                    _ => group::<K, 8>(wb, row_bytes, a, i0, ob),
                }
            }
            i0 += len;
        }
    }
}
