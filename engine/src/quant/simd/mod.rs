//! SIMD kernels, picked at runtime. [`dot_f32`] / [`dot_q`] return the best kernel this CPU supports for a weight
//! type, or `None` when only the scalar reference exists (the public API then uses the scalar code).
//!
//! - x86-64: AVX2 + FMA + F16C (all three required), detected with `is_x86_feature_detected!` (see `avx2`).
//!   Where AVX-512 F/BW/VBMI/VNNI are also present (Ice Lake and later), [`dot_q`] prefers the `avx512`
//!   kernels for the formats that have one (IQ2_XXS, Q2_K, and Q8_0 where BW/VL/VNNI are present:
//!   `avx512_q8_rows`, the sixteen-lane contract of `q8_0::dot_q8_0_lanes16` for every Q8_0 form, single and
//!   multi-row) and falls back to AVX2 for the rest; [`level`] then reports
//!   `"avx512-vbmi"`. With GFNI too ([`level`]: `"avx512-gfni"`), IQ2_XXS uses the pair kernel (`avx512_iq2`), whose
//!   activations come in the pair layout ([`crate::quant::ActType::Q8KPairs`]; [`iq2_pairs`] says whether it is in use).
//!   Both AVX-512 kernels also come in an any-row-count form ([`dot_q_rows`]: one weight decode for up to 8
//!   activation rows, through `x86::dot_rows` over their `N`-generic bodies).
//!   [`dot_q_variants`] lists every kernel this CPU can run, with the activation format each one reads, for
//!   side-by-side benchmarks.
//!   Module graph (x86-64): `x86` is a leaf of shared helpers (f16 conversion, prefetch, loads, 64-byte
//!   constants); `avx2_x4` builds on `avx2`, `avx512_q8_rows` (every Q8_0 form on AVX-512 VNNI machines: the
//!   single-row kernel and [`dot_q_flipped`]) on `avx2_x4`'s scale helpers,
//!   `avx512_iq2` on `avx512`; the choice between them is made here.
//! - aarch64 (little-endian): NEON (baseline on aarch64; compiled when the target enables it, see `neon`).
//!
//! Every SIMD kernel is tested against the scalar code of its format for odd block counts. Kernels follow the
//! contract in [`crate::quant`]: they only touch the whole blocks both buffers hold.

use super::api::{DotF32, DotQ};
use super::{ActType, GgmlType};

/// Whether IQ2_XXS weights use the pair kernel here (and so their activations the pair layout).
pub(crate) fn iq2_pairs() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx512_iq2::available();
    #[allow(unreachable_code)]
    false
}

/// A 64-byte vector constant (`x86::A64`) from an expression in the byte index `i`, for the AVX-512 kernels'
/// tables (`const` context).
#[cfg(target_arch = "x86_64")]
macro_rules! bytes64 {
    (|$i:ident| $f:expr) => {{
        let mut t = [0u8; 64];
        let mut $i = 0;
        while $i < 64 {
            t[$i] = $f;
            $i += 1;
        }
        super::x86::A64(t)
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_x4;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_iq2;
#[cfg(target_arch = "x86_64")]
mod avx512_q2k;
#[cfg(target_arch = "x86_64")]
mod avx512_q8_rows;
#[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
mod neon;
#[cfg(all(test, target_arch = "x86_64"))]
mod test_blocks;
#[cfg(target_arch = "x86_64")]
mod x86;

/// The instruction set the kernels use on this CPU: `"avx512-gfni"` (AVX-512 kernels where they exist, the IQ2_XXS
/// pair kernel among them, AVX2 for the rest), `"avx512-vbmi"` (the same without GFNI: the IQ2_XXS gather kernel),
/// `"avx2"`, `"neon"` or `"scalar"`.
pub fn level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if avx512_iq2::available() {
        return "avx512-gfni";
    }
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        return "avx512-vbmi";
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        return "avx2";
    }
    #[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
    return "neon";
    #[allow(unreachable_code)]
    "scalar"
}

/// The best SIMD kernel for weight type `ty` · f32 activations, if any.
pub(crate) fn dot_f32(ty: GgmlType) -> Option<DotF32> {
    #[cfg(target_arch = "x86_64")]
    return avx2::dot_f32(ty);
    #[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
    return neon::dot_f32(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

/// The AVX-512 kernel for `ty` where one exists: IQ2_XXS (the pair kernel of `avx512_iq2` where GFNI is present,
/// else `avx512`'s gather kernel) and Q2_K (`avx512_q2k`). Chosen here, not in `avx512`, so that no kernel module
/// depends on one that builds on it.
#[cfg(target_arch = "x86_64")]
fn avx512_dot_q(ty: GgmlType) -> Option<DotQ> {
    match ty {
        GgmlType::Iq2Xxs => avx512_iq2::dot_q().or_else(avx512::iq2_xxs_gather),
        GgmlType::Q2K => avx512_q2k::dot_q(),
        _ => None,
    }
}

/// The best SIMD kernel for weight type `ty` · its quantized activations, if any: an AVX-512 kernel of its own
/// (IQ2_XXS, Q2_K), else the AVX2 one — for Q8_0 in its 512-bit form where the CPU has it (bit-identical).
pub(crate) fn dot_q(ty: GgmlType) -> Option<DotQ> {
    #[cfg(target_arch = "x86_64")]
    return avx512_dot_q(ty).or_else(|| avx512_q8_rows::dot_q(ty)).or_else(|| avx2::dot_q(ty));
    #[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
    return neon::dot_q(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

/// The four-activation-row kernel for `ty` (see [`crate::quant::DotQ4`]) where this CPU has one, always the batched
/// form of the kernel [`dot_q`] picks: the IQ2_XXS pair kernel's (exactly where [`dot_q`] picks the pair kernel)
/// and, where the single kernel is AVX2's, `avx2_x4`'s Q8_0 (with VNNI where present) / Q2_K / Q4_K / IQ2_XXS
/// four-row forms, each bit-identical to the single kernel.
pub fn dot_q4(ty: GgmlType) -> Option<super::api::DotQ4> {
    #[cfg(target_arch = "x86_64")]
    if ty == GgmlType::Iq2Xxs && iq2_pairs() {
        return avx512_iq2::dot_q4();
    }
    // Elsewhere on x86-64 the single kernel is AVX2's wherever AVX-512 has none for the type.
    #[cfg(target_arch = "x86_64")]
    if single_is_avx2(ty) {
        return avx2_x4::dot_q4(ty);
    }
    let _ = ty;
    None
}

/// The any-row-count kernel for `ty` (see [`crate::quant::DotQRows`]) where this CPU has one, always the batched
/// form of the kernel [`dot_q`] picks: the IQ2_XXS pair kernel's (exactly where [`dot_q`] picks it) and the
/// AVX-512 Q2_K kernel's (`avx512_q2k`), one weight decode for up to [`crate::quant::MAX_ROWS`] rows.
pub fn dot_q_rows(ty: GgmlType) -> Option<super::api::DotQRows> {
    #[cfg(target_arch = "x86_64")]
    match ty {
        GgmlType::Iq2Xxs if iq2_pairs() => return avx512_iq2::dot_q_rows(),
        GgmlType::Q2K => return avx512_q2k::dot_q_rows(),
        _ => {}
    }
    let _ = ty;
    None
}

/// The eight-activation-row kernel for `ty` (see [`crate::quant::DotQ8`]) where this CPU has one: `avx2_x4`'s
/// Q2_K / Q4_K / IQ2_XXS eight-row forms where the single kernel is AVX2's, and its Q8_0 one where AVX-512 VL/VNNI
/// (without BW) are present (bit-identical to the AVX2 single kernel).
pub fn dot_q8(ty: GgmlType) -> Option<super::api::DotQ8> {
    #[cfg(target_arch = "x86_64")]
    if single_is_avx2(ty) {
        return avx2_x4::dot_q8(ty);
    }
    let _ = ty;
    None
}

/// Whether [`dot_q`] picks the AVX2 kernel for `ty` here (so `avx2_x4`'s multi-row forms are its batched forms).
#[cfg(target_arch = "x86_64")]
fn single_is_avx2(ty: GgmlType) -> bool {
    avx512_dot_q(ty).is_none() && avx512_q8_rows::dot_q(ty).is_none() && avx2::dot_q(ty).is_some()
}

/// The flipped-activation kernel for `ty` (see [`crate::quant::DotQFlipped`]) where this CPU has one:
/// `avx512_q8_rows`' Q8_0 form (AVX-512 F/BW/VL/VNNI), the batched form of the single kernel [`dot_q`] picks
/// there (the sixteen-lane contract, bit for bit).
pub fn dot_q_flipped(ty: GgmlType) -> Option<super::api::DotQFlipped> {
    #[cfg(target_arch = "x86_64")]
    return avx512_q8_rows::dot_q_flipped(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

/// The packed-weight form of [`dot_q_flipped`] (see [`crate::quant::DotQPacked`]) where this CPU has one (the
/// same CPUs and types), bit-identical to it.
pub fn dot_q_packed(ty: GgmlType) -> Option<super::api::DotQPacked> {
    #[cfg(target_arch = "x86_64")]
    return avx512_q8_rows::dot_q_packed(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

/// The eight-row float kernel for `ty` (see [`crate::quant::DotF8`]) where this CPU has one: `avx2_x4`'s 512-bit
/// F16 / BF16 forms, bit-identical to the AVX2 single kernel.
pub(crate) fn dot_f8(ty: GgmlType) -> Option<super::api::DotF8> {
    #[cfg(target_arch = "x86_64")]
    return avx2_x4::dot_f8(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

/// The four-row float kernel for `ty` (see [`crate::quant::DotF4`]) where this CPU has one: `avx2_x4`'s F16 / BF16
/// forms, bit-identical to the AVX2 single kernel [`dot_f32`] picks for those types.
pub(crate) fn dot_f4(ty: GgmlType) -> Option<super::api::DotF4> {
    #[cfg(target_arch = "x86_64")]
    return avx2_x4::dot_f4(ty);
    #[allow(unreachable_code)]
    {
        let _ = ty;
        None
    }
}

/// Every SIMD kernel this CPU can run for weight type `ty` · its quantized activations, best first, named by
/// instruction set, with the activation format each one reads (e.g. for IQ2_XXS on a GFNI machine
/// `[("avx512-gfni", Q8KPairs, ..), ("avx512-vbmi", Q8K, ..), ("avx2", Q8K, ..)]`); empty where only the scalar
/// code exists. For benchmarks comparing the kernels on the same data; the engine uses
/// [`crate::quant::dot_q_kernel`].
pub fn dot_q_variants(ty: GgmlType) -> Vec<(&'static str, ActType, DotQ)> {
    let mut v = Vec::new();
    let plain = super::act::plain_act_type(ty);
    #[cfg(target_arch = "x86_64")]
    {
        if ty == GgmlType::Iq2Xxs {
            v.extend(avx512_iq2::dot_q().map(|k| ("avx512-gfni", ActType::Q8KPairs, k)));
            v.extend(avx512::iq2_xxs_gather().map(|k| ("avx512-vbmi", plain, k)));
        } else {
            v.extend(avx512_dot_q(ty).map(|k| ("avx512-vbmi", plain, k)));
            v.extend(avx512_q8_rows::dot_q(ty).map(|k| ("avx512-vnni", plain, k)));
        }
        v.extend(avx2::dot_q(ty).map(|k| ("avx2", plain, k)));
    }
    #[cfg(all(target_arch = "aarch64", target_feature = "neon", target_endian = "little"))]
    v.extend(neon::dot_q(ty).map(|k| ("neon", plain, k)));
    let _ = (ty, plain);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where SIMD is available every supported weight type must get a SIMD kernel, otherwise the SIMD-vs-scalar
    /// tests in `tests/quant_fixtures.rs` would silently compare the scalar code with itself.
    #[test]
    fn simd_kernels_resolve_for_every_weight_type() {
        if level() == "scalar" {
            eprintln!("no SIMD on this CPU; scalar kernels only");
            return;
        }
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q4K,
            GgmlType::Iq2Xxs,
        ] {
            assert!(dot_f32(ty).is_some(), "{ty}: no SIMD f32 dot");
        }
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
            assert!(dot_q(ty).is_some(), "{ty}: no SIMD quantized dot");
        }
        assert!(dot_q(GgmlType::F32).is_none());
    }
}

/// Side-by-side throughput of every SIMD kernel on the same data (not a test: prints, asserts nothing about
/// speed). `cargo test --release -p ds4-engine --lib quant::simd::bench -- --ignored --nocapture`; set
/// `DS4_BENCH_MIB` for the streamed size (default 256). "hot" repeats 1 MiB of weights (cache-resident: the
/// kernel's compute rate), "stream" reads the whole buffer once per pass (the memory-bound rate), one thread.
/// Rates use on-CPU time (Linux), so they hold up on a busy machine better than wall time; each kernel runs three
/// times, interleaved, and the best run is printed.
#[cfg(test)]
mod bench {
    use super::*;
    use crate::quant::quantize_acts;
    use std::time::Instant;

    /// Nanoseconds of CPU time this thread has used (`CLOCK_THREAD_CPUTIME_ID`), so time-slicing with other
    /// processes on a busy machine does not count; `None` off 64-bit Linux (wall time is used then).
    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    fn cpu_ns() -> Option<u64> {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
        }
        let mut t = Timespec { sec: 0, nsec: 0 };
        // SAFETY: `t` is a valid, writable timespec (two 64-bit fields on 64-bit Linux); clock 3 is
        // CLOCK_THREAD_CPUTIME_ID.
        let rc = unsafe { clock_gettime(3, &mut t) };
        (rc == 0).then(|| t.sec as u64 * 1_000_000_000 + t.nsec as u64)
    }

    #[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
    fn cpu_ns() -> Option<u64> {
        None
    }

    /// Seconds `f` takes, on-CPU time where available.
    fn seconds(f: impl FnOnce()) -> f64 {
        let (t, c0) = (Instant::now(), cpu_ns());
        f();
        match (c0, cpu_ns()) {
            (Some(a), Some(b)) => (b - a) as f64 / 1e9,
            _ => t.elapsed().as_secs_f64(),
        }
    }

    /// GB/s of weights over `passes` passes, by on-CPU time where available.
    fn run(k: DotQ, w: &[u8], acts: &[u8], rb: usize, passes: usize) -> f64 {
        let mut sink = 0f32;
        let s = seconds(|| {
            for _ in 0..passes {
                for row in w.chunks_exact(rb) {
                    sink += k(row, acts);
                }
            }
        });
        assert!(sink.is_finite());
        (w.len() * passes) as f64 / s / 1e9
    }

    #[test]
    #[ignore = "benchmark; run with --ignored --nocapture"]
    fn dot_q_variants_side_by_side() {
        let mib: usize = std::env::var("DS4_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
        let cols = 4096usize;
        let x: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 506.0).collect();
        for ty in [GgmlType::Iq2Xxs, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Q8_0] {
            let rb = ty.row_bytes(cols as u64).expect("4096 columns are whole blocks") as usize;
            let rows = (mib << 20) / rb;
            // Random bytes with the f16 block scales set to 1/8 (random scale bytes could be inf/nan).
            let mut w: Vec<u8> = (0..rows * rb).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
            let scale_offsets: &[usize] = match ty {
                GgmlType::Q2K => &[80, 82],
                GgmlType::Q4K => &[0, 2],
                _ => &[0],
            };
            for b in w.chunks_exact_mut(ty.block_bytes()) {
                for &o in scale_offsets {
                    b[o..o + 2].copy_from_slice(&0x3000u16.to_le_bytes());
                }
            }
            let hot_rows = ((1 << 20) / rb).max(1);
            let variants = dot_q_variants(ty);
            let acts: Vec<Vec<u8>> = variants
                .iter()
                .map(|(_, act, _)| {
                    let mut a = Vec::new();
                    quantize_acts(*act, &x, &mut a).unwrap();
                    a
                })
                .collect();
            let mut best = vec![(0f64, 0f64); variants.len()];
            for _ in 0..3 {
                for (i, (_, _, k)) in variants.iter().enumerate() {
                    let hot = run(*k, &w[..hot_rows * rb], &acts[i], rb, 64 * mib.max(1) / 16);
                    let cold = run(*k, &w, &acts[i], rb, 2);
                    best[i] = (best[i].0.max(hot), best[i].1.max(cold));
                }
            }
            let wps = |gbs: f64| gbs / ty.block_bytes() as f64 * ty.block_values() as f64;
            for ((name, _, _), (hot, cold)) in variants.iter().zip(best) {
                println!(
                    "{ty:>8} {name:>12}: hot {hot:6.2} GB/s ({:5.2} G weights/s), stream {cold:6.2} GB/s",
                    wps(hot)
                );
            }
            // `n` activation rows per weight row: the engine's kernel `n` times vs its any-row-count form, as
            // multiply-adds per second (weights × rows). The any-row kernel reads `n` distinct rows (as the engine's
            // batch rows are: their working set, not one row's), one weight row per call or 32 per call (as the
            // engine's matmul hands them; the kernel may tile them), in cache and streamed.
            if let (Some(kn), Ok(k)) = (dot_q_rows(ty), crate::quant::dot_q_kernel(ty)) {
                let mut a = Vec::new();
                quantize_acts(crate::quant::act_type(ty), &x, &mut a).unwrap();
                let hot = &w[..hot_rows / 32 * 32 * rb];
                let passes = 8 * mib.max(1) / 16;
                let distinct: Vec<Vec<u8>> = (0..16)
                    .map(|r| {
                        let xr: Vec<f32> =
                            x.iter().enumerate().map(|(i, v)| v * (1.0 + ((i + r) % 5) as f32 / 8.0)).collect();
                        let mut a = Vec::new();
                        quantize_acts(crate::quant::act_type(ty), &xr, &mut a).unwrap();
                        a
                    })
                    .collect();
                for n in [1usize, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16] {
                    let (rows, das) = (distinct[..n].iter().map(|v| &v[..]).collect::<Vec<_>>(), vec![&[][..]; n]);
                    let mut out = vec![0f32; 32 * n];
                    // G MAC/s of `kn` over `buf` (`passes` times), `per` weight rows per call.
                    let mut rate = |buf: &[u8], per: usize, passes: usize| {
                        let mut sink = 0f32;
                        let s = seconds(|| {
                            for _ in 0..passes {
                                for c in buf.chunks_exact(per * rb) {
                                    kn(c, rb, &rows, &das, &mut out);
                                    sink += out[n - 1];
                                }
                            }
                        });
                        assert!(sink.is_finite());
                        (buf.len() / rb * cols * n * passes) as f64 / 1e9 / s
                    };
                    let mut best = [0f64; 5];
                    for _ in 0..3 {
                        let mut sink = 0f32;
                        let s1 = seconds(|| {
                            for _ in 0..passes {
                                for row in hot.chunks_exact(rb) {
                                    for _ in 0..n {
                                        sink += k(row, &a);
                                    }
                                }
                            }
                        });
                        assert!(sink.is_finite());
                        let got = [
                            (hot.len() / rb * cols * n * passes) as f64 / 1e9 / s1,
                            rate(hot, 1, passes),
                            rate(hot, 32, passes),
                            rate(&w, 1, 1),
                            rate(&w, 32, 1),
                        ];
                        for (b, g) in best.iter_mut().zip(got) {
                            *b = b.max(g);
                        }
                    }
                    let [one, hot1, hot32, cold1, cold32] = best;
                    println!(
                        "{ty:>8} {n:2} rows: single x{n} {one:6.2} G MAC/s; any-row kernel, 1 / 32 weight rows per \
                         call: hot {hot1:6.2} / {hot32:6.2}, streamed {cold1:6.2} / {cold32:6.2}"
                    );
                }
            }
            // Four activation rows per weight row: the engine's kernel four times vs its four-row form, in cache,
            // as multiply-adds per second (weights × rows).
            if let (Some(k4), Ok(k)) = (dot_q4(ty), crate::quant::dot_q_kernel(ty)) {
                let mut a = Vec::new();
                quantize_acts(crate::quant::act_type(ty), &x, &mut a).unwrap();
                let mut da = Vec::new();
                crate::quant::act_block_scales(crate::quant::act_type(ty), &a, &mut da);
                let hot = &w[..hot_rows * rb];
                let passes = 16 * mib.max(1) / 16;
                let (mut one, mut four, mut eight) = (0f64, 0f64, 0f64);
                for _ in 0..3 {
                    let mut sink = 0f32;
                    let s1 = seconds(|| {
                        for _ in 0..passes {
                            for row in hot.chunks_exact(rb) {
                                for _ in 0..4 {
                                    sink += k(row, &a);
                                }
                            }
                        }
                    });
                    let s4 = seconds(|| {
                        for _ in 0..passes {
                            for row in hot.chunks_exact(rb) {
                                sink += k4(row, [&a, &a, &a, &a], [&da, &da, &da, &da]).iter().sum::<f32>();
                            }
                        }
                    });
                    let s8 = seconds(|| {
                        if let Some(k8) = dot_q8(ty) {
                            for _ in 0..passes / 2 {
                                for row in hot.chunks_exact(rb) {
                                    sink += k8(row, [&a; 8], [&da; 8]).iter().sum::<f32>();
                                }
                            }
                        }
                    });
                    assert!(sink.is_finite());
                    let macs = (hot_rows * cols * 4 * passes) as f64 / 1e9;
                    one = one.max(macs / s1);
                    four = four.max(macs / s4);
                    eight = eight.max((hot_rows * cols * 8 * (passes / 2)) as f64 / 1e9 / s8.max(1e-9));
                }
                print!("{ty:>8} 4 rows: single x4 {one:6.2} G MAC/s, four-row kernel {four:6.2} G MAC/s");
                if dot_q8(ty).is_some() {
                    print!(", eight-row kernel {eight:6.2} G MAC/s");
                }
                println!();
            }
            // Eight distinct activation rows per weight row (decode with eight sessions), in cache and streamed: the
            // eight-row form vs the flipped-activation form (activations flipped once, outside the timing).
            if let (Some(k8), Some(kf)) = (dot_q8(ty), dot_q_flipped(ty)) {
                let act = crate::quant::act_type(ty);
                let rows: Vec<Vec<u8>> = (0..8)
                    .map(|r| {
                        let xr: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * ((i * (r + 3)) % 7) as f32).collect();
                        let mut a = Vec::new();
                        quantize_acts(act, &xr, &mut a).unwrap();
                        a
                    })
                    .collect();
                let (mut das, mut fls) = (vec![Vec::new(); 8], vec![Vec::<crate::quant::FlipLine>::new(); 8]);
                for r in 0..8 {
                    crate::quant::act_block_scales(act, &rows[r], &mut das[r]);
                    crate::quant::flip_acts(act, &rows[r], rows[r].len(), &mut fls[r]);
                }
                let a8: [&[u8]; 8] = std::array::from_fn(|r| &rows[r][..]);
                let d8: [&[f32]; 8] = std::array::from_fn(|r| &das[r][..]);
                let f8: [&[u8]; 8] = std::array::from_fn(|r| bytemuck::cast_slice(&fls[r][..]));
                for (what, ws, passes) in [("hot", &w[..hot_rows * rb], 8 * mib.max(1) / 16), ("stream", &w[..], 1)] {
                    let (mut eight, mut flipped) = (0f64, 0f64);
                    let mut out = [0f32; 8];
                    for _ in 0..3 {
                        let mut sink = 0f32;
                        let s8 = seconds(|| {
                            for _ in 0..passes {
                                for row in ws.chunks_exact(rb) {
                                    sink += k8(row, a8, d8)[7];
                                }
                            }
                        });
                        let sf = seconds(|| {
                            for _ in 0..passes {
                                for row in ws.chunks_exact(rb) {
                                    kf(row, &f8, &d8, &mut out);
                                    sink += out[7];
                                }
                            }
                        });
                        assert!(sink.is_finite());
                        let macs = (ws.len() / rb * cols * 8 * passes) as f64 / 1e9;
                        eight = eight.max(macs / s8);
                        flipped = flipped.max(macs / sf);
                    }
                    println!(
                        "{ty:>8} 8 distinct rows, {what}: eight-row kernel {eight:6.2} G MAC/s, flipped form \
                         {flipped:6.2} G MAC/s"
                    );
                }
            }
        }
    }
}
