//! Quant formats against an independent implementation (the `gguf` Python package, via committed fixtures made by
//! `tools/quant_fixtures/gen.py`), round-trip error bounds, importance weighting, and every dot-product kernel
//! (SIMD and scalar) against dequantize-then-f64-dot.

use ds4_engine::quant::{
    act_type, dequantize_acts, dequantize_row, dot_f32_kernel, dot_f32_kernel_scalar, dot_q_kernel,
    dot_q_kernel_scalar, matvec, quantize_acts, quantize_row, simd, GgmlType,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

const FIX: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/quant");

fn read(name: &str) -> Vec<u8> {
    let p = format!("{FIX}/{name}");
    std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

fn read_f32(name: &str) -> Vec<f32> {
    read(name).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn dequant(ty: GgmlType, src: &[u8]) -> Vec<f32> {
    let n = src.len() / ty.block_bytes() * ty.block_values();
    let mut out = vec![0f32; n];
    dequantize_row(ty, src, &mut out).unwrap();
    out
}

fn quant(ty: GgmlType, x: &[f32], imp: Option<&[f32]>) -> Vec<u8> {
    let mut out = vec![0u8; ty.row_bytes(x.len() as u64).unwrap() as usize];
    quantize_row(ty, x, imp, &mut out).unwrap();
    out
}

const WEIGHT_TYPES: [GgmlType; 7] =
    [GgmlType::F32, GgmlType::F16, GgmlType::Bf16, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs];

// ---------------------------------------------------------------------------------------------------------------
// Cross-check against gguf.

#[test]
fn dequantize_matches_gguf_bit_for_bit() {
    // Our dequantizers evaluate the same expressions in the same order as gguf's numpy code (e.g. Q2_K is
    // `(d*sc)*q - (dmin*m)`, IQ2_XXS `(d*(0.5+s)*0.25)*grid*sign`), so the results are bit-identical.
    for (name, ty) in [
        ("f16", GgmlType::F16),
        ("bf16", GgmlType::Bf16),
        ("q8_0", GgmlType::Q8_0),
        ("q2_k", GgmlType::Q2K),
        ("q4_k", GgmlType::Q4K),
        ("iq2_xxs", GgmlType::Iq2Xxs),
    ] {
        let raw = read(&format!("{name}.q"));
        let want = read_f32(&format!("{name}.f32"));
        assert_eq!(ty.row_bytes(want.len() as u64), Some(raw.len() as u64), "{name} fixture sizes");
        let got = dequant(ty, &raw);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name} value {i}: ours {g}, gguf {w}");
        }
    }
}

#[test]
fn quantizers_match_gguf_byte_for_byte() {
    for (name, ty) in [("q8_0_quant", GgmlType::Q8_0), ("f16_quant", GgmlType::F16), ("bf16_quant", GgmlType::Bf16)] {
        let x = read_f32(&format!("{name}.f32"));
        let want = read(&format!("{name}.q"));
        let got = quant(ty, &x, None);
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{name} byte {i}");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Round trips.

fn normal(rng: &mut StdRng) -> f32 {
    // Box-Muller.
    let u1: f64 = rng.gen_range(1e-12..1.0);
    let u2: f64 = rng.gen();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

fn gaussian(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| normal(rng)).collect()
}

fn rel_rmse(x: &[f32], y: &[f32], w: Option<&[f32]>) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for i in 0..x.len() {
        let wi = w.map_or(1.0, |w| w[i] as f64);
        num += wi * (x[i] as f64 - y[i] as f64).powi(2);
        den += wi * (x[i] as f64).powi(2);
    }
    (num / den).sqrt()
}

/// Relative RMSE bounds for standard-normal data (see each comment for the reasoning).
fn rmse_bound(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::F32 => 0.0,
        // 11-bit mantissa: relative rounding error ≤ 2^-11, RMS about 2^-11/√3.
        GgmlType::F16 => 4e-4,
        // 8-bit mantissa: ≤ 2^-8 relative.
        GgmlType::Bf16 => 4e-3,
        // Step amax/127 with amax ≈ 2.1σ for 32 normals: RMS error ≈ step/√12 ≈ 0.005σ.
        GgmlType::Q8_0 => 0.01,
        // 16 levels over a 32-value sub-block's range (≈ 4.1σ): step ≈ 0.27σ, RMS ≈ 0.08σ before the scale search.
        GgmlType::Q4K => 0.1,
        // 4 levels over a 16-value range (≈ 3.5σ): step ≈ 1.2σ, RMS ≈ 0.33σ; the search and clipping help.
        GgmlType::Q2K => 0.4,
        // 2 bits per weight on a fixed 256-point E8-like grid with parity-constrained signs.
        GgmlType::Iq2Xxs => 0.5,
        _ => unreachable!(),
    }
}

#[test]
fn round_trip_error_is_bounded() {
    let mut rng = StdRng::seed_from_u64(7);
    let x = gaussian(&mut rng, 16 * 256);
    for ty in WEIGHT_TYPES {
        let y = dequant(ty, &quant(ty, &x, None));
        let e = rel_rmse(&x, &y, None);
        eprintln!("{ty}: relative RMSE {e:.4}");
        assert!(e <= rmse_bound(ty), "{ty}: relative RMSE {e} above {}", rmse_bound(ty));
    }
}

#[test]
fn importance_lowers_the_weighted_error() {
    let mut rng = StdRng::seed_from_u64(11);
    let x = gaussian(&mut rng, 8 * 256);
    // Very uneven importance: a few values matter a lot (like imatrix outlier channels).
    let imp: Vec<f32> =
        (0..x.len()).map(|_| if rng.gen_bool(0.15) { 50.0 } else { rng.gen_range(0.01..1.0) }).collect();
    for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
        let plain = rel_rmse(&x, &dequant(ty, &quant(ty, &x, None)), Some(&imp));
        let weighted = rel_rmse(&x, &dequant(ty, &quant(ty, &x, Some(&imp))), Some(&imp));
        eprintln!("{ty}: weighted RMSE plain {plain:.4}, with importance {weighted:.4}");
        assert!(weighted < plain, "{ty}: importance did not help ({weighted} vs {plain})");
    }
}

#[test]
fn zero_importance_gives_finite_output() {
    // All-zero weights mean "nothing matters"; the quantizers must still produce a valid, finite row.
    let mut rng = StdRng::seed_from_u64(17);
    let x = gaussian(&mut rng, 512);
    let mut imp = vec![0f32; 512];
    imp[300] = 1.0;
    for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
        for imp in [&vec![0f32; 512], &imp] {
            let y = dequant(ty, &quant(ty, &x, Some(imp)));
            assert!(y.iter().all(|v| v.is_finite()), "{ty}: non-finite output");
        }
    }
}

#[test]
fn zero_and_constant_rows_survive() {
    for ty in WEIGHT_TYPES {
        let n = 512;
        for v in [0.0f32, 0.75, -1.5] {
            let x = vec![v; n];
            let y = dequant(ty, &quant(ty, &x, None));
            let tol = if v == 0.0 { 0.0 } else { v.abs() * 0.1 };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{ty} constant {v}: got {b}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dot products.

/// A random weight row of `nb` blocks: random bytes with sane f16 scales for the block formats (every bit pattern
/// of scales and quants is exercised), random normals for the float formats.
fn random_row(ty: GgmlType, n: usize, rng: &mut StdRng) -> Vec<u8> {
    let f16b = |v: f32| half::f16::from_f32(v).to_le_bytes();
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => quant(ty, &gaussian(rng, n), None),
        _ => {
            let mut row = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
            rng.fill(&mut row[..]);
            for b in row.chunks_exact_mut(ty.block_bytes()) {
                match ty {
                    GgmlType::Q8_0 => b[..2].copy_from_slice(&f16b(rng.gen_range(-0.02..0.02))),
                    GgmlType::Q2K => {
                        b[80..82].copy_from_slice(&f16b(rng.gen_range(0.001..0.1)));
                        b[82..84].copy_from_slice(&f16b(rng.gen_range(0.001..0.05)));
                    }
                    GgmlType::Q4K => {
                        b[0..2].copy_from_slice(&f16b(rng.gen_range(0.0005..0.01)));
                        b[2..4].copy_from_slice(&f16b(rng.gen_range(0.0005..0.01)));
                    }
                    GgmlType::Iq2Xxs => b[..2].copy_from_slice(&f16b(rng.gen_range(-0.01..0.01))),
                    _ => unreachable!(),
                }
            }
            row
        }
    }
}

fn dot64(a: &[f32], b: &[f32]) -> (f64, f64) {
    let dot = a.iter().zip(b).map(|(p, q)| *p as f64 * *q as f64).sum();
    let mass = a.iter().zip(b).map(|(p, q)| (*p as f64 * *q as f64).abs()).sum();
    (dot, mass)
}

fn assert_close(what: &str, got: f32, want: f64, mass: f64, rel: f64) {
    let err = (got as f64 - want).abs();
    assert!(err <= rel * mass + 1e-6, "{what}: got {got}, want {want} (error {err:e}, mass {mass:e})");
}

/// Row lengths for a type: 1, 3 and 7 blocks (float formats: 1, 3, 7 × 32 values plus odd tails).
fn sizes(ty: GgmlType) -> Vec<usize> {
    match ty.block_values() {
        1 => vec![1, 3, 7, 32, 96 + 3, 224 + 7, 1000 + 5],
        bv => vec![bv, 3 * bv, 7 * bv],
    }
}

#[test]
fn dot_f32_kernels_match_dequantized_f64_dot() {
    eprintln!("SIMD level: {}", simd::level());
    let mut rng = StdRng::seed_from_u64(3);
    for ty in WEIGHT_TYPES {
        let best = dot_f32_kernel(ty).unwrap();
        let scalar = dot_f32_kernel_scalar(ty).unwrap();
        for n in sizes(ty) {
            for _ in 0..4 {
                let w = random_row(ty, n, &mut rng);
                let x = gaussian(&mut rng, n);
                let (want, mass) = dot64(&dequant(ty, &w), &x);
                let (b, s) = (best(&w, &x), scalar(&w, &x));
                assert_close(&format!("{ty} n={n} best"), b, want, mass, 1e-5);
                assert_close(&format!("{ty} n={n} scalar"), s, want, mass, 1e-5);
                assert_close(&format!("{ty} n={n} best vs scalar"), b, s as f64, mass, 1e-5);
            }
        }
    }
}

#[test]
fn dot_q_kernels_match_dequantized_f64_dot() {
    let mut rng = StdRng::seed_from_u64(5);
    for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
        let best = dot_q_kernel(ty).unwrap();
        let scalar = dot_q_kernel_scalar(ty).unwrap();
        let act = act_type(ty);
        let mut acts = Vec::new();
        for n in sizes(ty) {
            for _ in 0..4 {
                let w = random_row(ty, n, &mut rng);
                let x = gaussian(&mut rng, n);
                quantize_acts(act, &x, &mut acts).unwrap();
                let wd = dequant(ty, &w);
                // Exact reference: the dequantized weights · the dequantized activations.
                let mut xa = vec![0f32; n];
                dequantize_acts(act, &acts, &mut xa).unwrap();
                let (want, mass) = dot64(&wd, &xa);
                let (b, s) = (best(&w, &acts), scalar(&w, &acts));
                assert_close(&format!("{ty} n={n} best"), b, want, mass, 1e-5);
                assert_close(&format!("{ty} n={n} scalar"), s, want, mass, 1e-5);
                assert_close(&format!("{ty} n={n} best vs scalar"), b, s as f64, mass, 1e-5);
                // Against the unquantized activations: only the 8-bit activation rounding separates them.
                let (want_f, mass_f) = dot64(&wd, &x);
                assert_close(&format!("{ty} n={n} vs f32 acts"), b, want_f, mass_f, 0.02);
            }
        }
    }
}

#[test]
fn matvec_uses_the_dot_kernels() {
    let mut rng = StdRng::seed_from_u64(9);
    for ty in WEIGHT_TYPES {
        let (rows, cols) = (5usize, 3 * 256);
        let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
        let x = gaussian(&mut rng, cols);
        let mut y = vec![0f32; rows];
        matvec(ty, &w, rows, cols, &x, &mut y).unwrap();
        let rb = w.len() / rows;
        for r in 0..rows {
            let (want, mass) = dot64(&dequant(ty, &w[r * rb..(r + 1) * rb]), &x);
            let rel = if act_type(ty).is_f32() { 1e-5 } else { 0.02 };
            assert_close(&format!("{ty} row {r}"), y[r], want, mass, rel);
        }
    }
}

#[test]
fn kernels_cover_only_the_whole_blocks_of_short_buffers() {
    // A truncated weight or activation row must not panic or read out of bounds: the kernels compute over the
    // whole blocks both buffers hold, i.e. one block (value) less here.
    let mut rng = StdRng::seed_from_u64(13);
    for ty in WEIGHT_TYPES {
        let bv = ty.block_values();
        let n = 2 * bv.max(32);
        let w = random_row(ty, n, &mut rng);
        let x = gaussian(&mut rng, n);
        let short = ty.row_bytes((n - bv) as u64).unwrap() as usize;
        let (want, mass) = dot64(&dequant(ty, &w[..short]), &x[..n - bv]);
        let k = dot_f32_kernel(ty).unwrap();
        assert_close(&format!("{ty} short w"), k(&w[..w.len() - 1], &x), want, mass, 1e-5);
        assert_close(&format!("{ty} short x"), k(&w, &x[..n - 1]), want, mass, 1e-5);
        if let Ok(kq) = dot_q_kernel(ty) {
            let mut acts = Vec::new();
            quantize_acts(act_type(ty), &x, &mut acts).unwrap();
            let full = kq(&w[..short], &acts);
            assert_eq!(kq(&w[..w.len() - 1], &acts), full, "{ty} short w (q)");
            assert_eq!(kq(&w, &acts[..acts.len() - 1]), full, "{ty} short acts (q)");
        }
    }
}
