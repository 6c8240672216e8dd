//! Kernel tests against CPU references (run on lavapipe in CI; see `context::test_context` for the skip rule).
//! Random weights in each format are dequantized with `crate::quant::dequantize_row` for the reference.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::context::{test_context, ContextOptions, WgpuContext};
use super::matmul::{get_rows, matmul, View};
use super::weights::GpuWeight;
use crate::quant::{dequantize_row, GgmlType};

/// Random bytes of `rows` rows of `cols` values of `ty`, with every f16 scale field set to a sane finite value.
pub(super) fn random_weight(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| rng.gen_range(-1.0f32..1.0).to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| f16(rng.gen_range(-1.0f32..1.0))).collect(),
        GgmlType::Bf16 => {
            (0..n).flat_map(|_| half::bf16::from_f32(rng.gen_range(-1.0f32..1.0)).to_le_bytes()).collect()
        }
        _ => {
            let bb = ty.block_bytes();
            let nblocks = n / ty.block_values();
            let mut out: Vec<u8> = (0..nblocks * bb).map(|_| rng.gen()).collect();
            let fields: &[usize] = match ty {
                GgmlType::Q8_0 | GgmlType::Iq2Xxs => &[0],
                GgmlType::Q2K => &[80, 82],
                GgmlType::Q4K => &[0, 2],
                _ => panic!("random_weight: unsupported {ty}"),
            };
            for b in 0..nblocks {
                for &f in fields {
                    let v = rng.gen_range(0.002f32..0.05) * if rng.gen() { 1.0 } else { -1.0 };
                    out[b * bb + f..b * bb + f + 2].copy_from_slice(&f16(v));
                }
            }
            out
        }
    }
}

pub(super) fn dequant_matrix(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(ty, &data[r * rb..(r + 1) * rb], &mut out[r * cols..(r + 1) * cols]).unwrap();
    }
    out
}

pub(super) fn ctx_with(max_binding: Option<u64>) -> Option<WgpuContext> {
    test_context(ContextOptions { max_binding_override: max_binding })
}

const TYPES: [GgmlType; 7] =
    [GgmlType::F32, GgmlType::F16, GgmlType::Bf16, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs];

/// Tolerance: |gpu − ref| ≤ 1e-5·Σ|w·x| + 1e-6 (f32 accumulation in a different order than the f64 reference).
#[test]
fn matmul_all_formats_split_across_bindings() {
    let (rows, cols, n_tok) = (13usize, 512usize, 3usize);
    for ty in TYPES {
        let rb = ty.row_bytes(cols as u64).unwrap();
        // At most three rows per binding: every weight is split into several chunks.
        let Some(ctx) = ctx_with(Some((rb * 3).div_ceil(4) * 4)) else { return };
        let mut rng = StdRng::seed_from_u64(ty.id() as u64);
        let data = random_weight(&mut rng, ty, rows, cols);
        let w = GpuWeight::upload(&ctx, "w", ty, cols, rows, &data, 1).unwrap();
        assert!(w.chunks.len() >= 4, "{ty}: expected a split weight, got {} chunks", w.chunks.len());
        let wf = dequant_matrix(ty, &data, rows, cols);
        let x: Vec<f32> = (0..n_tok * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        // y: token stride 20 at offset 5, prefilled so accumulate is visible; rows 2..12 only.
        let (r0, r1, ystride, yoff) = (2usize, 12usize, 20usize, 5usize);
        let y0: Vec<f32> = (0..yoff + n_tok * ystride).map(|i| i as f32 * 0.25).collect();
        for accumulate in [false, true] {
            let xb = ctx.storage_f32("x", &x);
            let yb = ctx.storage_f32("y", &y0);
            let mut enc = ctx.encoder();
            matmul(
                &ctx,
                &mut enc,
                &w,
                r0..r1,
                View::new(&xb, cols),
                n_tok,
                View::new(&yb, ystride).at(yoff),
                accumulate,
            )
            .unwrap();
            ctx.submit(enc).unwrap();
            let y = ctx.read_f32(&yb, 0, y0.len()).unwrap();
            for (i, (&got, &orig)) in y.iter().zip(&y0).enumerate() {
                let in_out = i >= yoff && (i - yoff) % ystride < r1 - r0 && (i - yoff) / ystride < n_tok;
                if !in_out {
                    assert_eq!(got, orig, "{ty}: element {i} outside the output was written");
                    continue;
                }
                let (t, r) = ((i - yoff) / ystride, (i - yoff) % ystride + r0);
                let (mut dot, mut mag) = (0f64, 0f64);
                for c in 0..cols {
                    let p = wf[r * cols + c] as f64 * x[t * cols + c] as f64;
                    dot += p;
                    mag += p.abs();
                }
                let want = dot + if accumulate { orig as f64 } else { 0.0 };
                let tol = 1e-5 * (mag + orig.abs() as f64) + 1e-6;
                assert!((got as f64 - want).abs() <= tol, "{ty} acc={accumulate} t={t} r={r}: {got} vs {want}");
            }
        }
    }
}

#[test]
fn matmul_rejects_bad_row_range() {
    let Some(ctx) = ctx_with(None) else { return };
    let data = vec![0u8; 4 * 32 * 4];
    let w = GpuWeight::upload(&ctx, "w", GgmlType::F32, 32, 4, &data, 1).unwrap();
    let xb = ctx.storage_zeroed("x", 32);
    let yb = ctx.storage_zeroed("y", 8);
    let mut enc = ctx.encoder();
    assert!(matmul(&ctx, &mut enc, &w, 2..5, View::new(&xb, 32), 1, View::new(&yb, 8), false).is_err());
    assert!(GpuWeight::upload(&ctx, "w", GgmlType::Q8_0, 33, 1, &data, 1).is_err());
    assert!(GpuWeight::upload(&ctx, "w", GgmlType::F32, 32, 5, &data, 1).is_err());
}

/// get_rows is an exact copy of the dequantized values (same f32 arithmetic as the reference), tolerance 1e-6 rel.
#[test]
fn get_rows_all_formats_split() {
    let (rows, cols) = (9usize, 256usize);
    for ty in TYPES {
        let rb = ty.row_bytes(cols as u64).unwrap();
        let Some(ctx) = ctx_with(Some((rb * 2).div_ceil(4) * 4)) else { return };
        let mut rng = StdRng::seed_from_u64(100 + ty.id() as u64);
        let data = random_weight(&mut rng, ty, rows, cols);
        let w = GpuWeight::upload(&ctx, "emb", ty, cols, rows, &data, 1).unwrap();
        let wf = dequant_matrix(ty, &data, rows, cols);
        let ids = [(8usize, 0usize), (0, 2), (5, 1), (5, 3)];
        let yb = ctx.storage_zeroed("y", 4 * cols);
        let mut enc = ctx.encoder();
        get_rows(&ctx, &mut enc, &w, &ids, View::new(&yb, cols)).unwrap();
        ctx.submit(enc).unwrap();
        let y = ctx.read_f32(&yb, 0, 4 * cols).unwrap();
        for &(r, o) in &ids {
            for c in 0..cols {
                let (got, want) = (y[o * cols + c], wf[r * cols + c]);
                assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "{ty} row {r} col {c}: {got} vs {want}");
            }
        }
        let mut enc = ctx.encoder();
        assert!(get_rows(&ctx, &mut enc, &w, &[(rows, 0)], View::new(&yb, cols)).is_err());
    }
}

/// The products of one input by several weights in one dispatch (`multi_product`, every output count up to
/// MULTI_OUTPUTS, products of different heights, a prefill of two token tiles) give each product's values bit for bit
/// as `matmul` of that weight alone.
#[test]
fn multi_product_equals_each_product_alone_bit_for_bit() {
    use super::matmul::{multi_product, MULTI_OUTPUTS};
    let Some(ctx) = ctx_with(None) else { return };
    let (cols, n_tok) = (256usize, 11usize);
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4K] {
        let mut rng = StdRng::seed_from_u64(300 + ty.id() as u64);
        let heights: Vec<usize> = (0..MULTI_OUTPUTS).map(|k| 3 + 5 * k % 7).collect();
        let parts: Vec<Vec<u8>> = heights.iter().map(|&h| random_weight(&mut rng, ty, h, cols)).collect();
        let x: Vec<f32> = (0..n_tok * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let xb = ctx.storage_f32("x", &x);
        for k in 1..=MULTI_OUTPUTS {
            let (hs, ps) = (&heights[..k], &parts[..k]);
            let alone: Vec<Vec<f32>> = hs
                .iter()
                .zip(ps)
                .map(|(&h, p)| {
                    let w = GpuWeight::upload(&ctx, "w", ty, cols, h, p, 1).unwrap();
                    let yb = ctx.storage_zeroed("y", n_tok * h);
                    let mut enc = ctx.encoder();
                    matmul(&ctx, &mut enc, &w, 0..h, View::new(&xb, cols), n_tok, View::new(&yb, h), false).unwrap();
                    ctx.submit(enc).unwrap();
                    ctx.read_f32(&yb, 0, n_tok * h).unwrap()
                })
                .collect();
            let all: Vec<u8> = ps.concat();
            let w = GpuWeight::upload(&ctx, "all", ty, cols, hs.iter().sum(), &all, 1).unwrap();
            let ends: Vec<usize> = hs
                .iter()
                .scan(0, |e, &h| {
                    Some({
                        *e += h;
                        *e
                    })
                })
                .collect();
            let ys: Vec<wgpu::Buffer> = hs.iter().map(|&h| ctx.storage_zeroed("y", n_tok * h)).collect();
            let yr: Vec<&wgpu::Buffer> = ys.iter().collect();
            let mut enc = ctx.encoder();
            multi_product(&ctx, &mut enc, &w, &ends, View::new(&xb, cols), n_tok, &yr).unwrap();
            ctx.submit(enc).unwrap();
            for (i, (yb, want)) in ys.iter().zip(&alone).enumerate() {
                let got = ctx.read_f32(yb, 0, want.len()).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(want), "{ty}: product {i} of {k}");
            }
            // Ends that do not cover the weight are refused.
            let short: Vec<usize> = ends.iter().map(|e| e - 1).collect();
            assert!(multi_product(&ctx, &mut ctx.encoder(), &w, &short, View::new(&xb, cols), n_tok, &yr).is_err());
        }
    }
}
