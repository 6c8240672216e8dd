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
    test_context(ContextOptions { max_binding_override: max_binding, ..Default::default() })
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

/// The decode MoE's fused kernels give bit for bit what the separate kernels give, with the expert matrices split
/// over several bindings (two experts per chunk): `gate_up_swiglu` = `matmul_ids` + `swiglu` (× routing weight),
/// `down_combine` = `matmul_ids` + `combine` (+ the shared expert's output), `swiglu_pair` = `matmul` + `swiglu`.
#[test]
fn fused_moe_kernels_equal_the_separate_kernels_across_chunks() {
    use super::matmul::swiglu_pair;
    use super::moe_ids::{combine, down_combine, gate_up_swiglu, matmul_ids};
    use super::ops::swiglu;
    let (ne, k, n, cols, ffn, d) = (5usize, 3usize, 2usize, 256usize, 8usize, 8usize);
    let limit = 1.5f32;
    for ty in [GgmlType::Q8_0, GgmlType::Q4K] {
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        // Two experts' gate|up rows (or down rows) per binding.
        let Some(ctx) = ctx_with(Some((2 * 2 * ffn * rb).div_ceil(4) as u64 * 4)) else { return };
        let mut rng = StdRng::seed_from_u64(400 + ty.id() as u64);
        let (gate, up) = (random_weight(&mut rng, ty, ne * ffn, cols), random_weight(&mut rng, ty, ne * ffn, cols));
        let pair = GpuWeight::upload_interleaved(&ctx, "gu", ty, cols, ne * ffn, &gate, &up, ffn).unwrap();
        assert!(pair.chunks.len() > 1, "{ty}: the pair is split");
        let down =
            GpuWeight::upload(&ctx, "down", ty, cols, ne * d, &random_weight(&mut rng, ty, ne * d, cols), d).unwrap();
        assert!(down.chunks.len() > 1, "{ty}: down is split");
        // Distinct experts per row, not sorted.
        let ids: Vec<u32> = vec![4, 0, 2, 1, 3, 0];
        let sel = ctx.storage_u32("sel", &ids);
        let rw = ctx.storage_f32("rw", &(0..n * k).map(|_| rng.gen_range(0.1..1.0)).collect::<Vec<f32>>());
        let x = ctx.storage_f32("x", &(0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect::<Vec<f32>>());
        let bits = |b: &wgpu::Buffer, len: usize| {
            ctx.read_f32(b, 0, len).unwrap().iter().map(|f| f.to_bits()).collect::<Vec<_>>()
        };
        // Gate + up + SwiGLU.
        let (gu_a, gu_b) = (ctx.storage_zeroed("gu a", n * k * 2 * ffn), ctx.storage_zeroed("gu b", n * k * 2 * ffn));
        let mut enc = ctx.encoder();
        matmul_ids(&ctx, &mut enc, &pair, 2 * ffn, &sel, n * k, View::new(&x, cols), k, View::new(&gu_a, 2 * ffn))
            .unwrap();
        let idx: Vec<u32> = (0..(n * k) as u32).collect();
        swiglu(&ctx, &mut enc, &gu_a, 2 * ffn, ffn, (&gu_a, 0, 2 * ffn), ffn, n * k, limit, Some((&rw, &idx)), None)
            .unwrap();
        let (xv, gv) = (View::new(&x, cols), View::new(&gu_b, 2 * ffn));
        let before = ctx.counters();
        gate_up_swiglu(&ctx, &mut enc, &pair, ffn, (&sel, &rw), n * k, xv, k, gv, limit).unwrap();
        let cost = ctx.counters() - before;
        // One dispatch per chunk; all but the first counted as due to the split.
        assert_eq!((cost.dispatches, cost.split_dispatches), (pair.chunks.len() as u64, pair.chunks.len() as u64 - 1));
        ctx.submit(enc).unwrap();
        let gate_half = |v: Vec<u32>| v.chunks(2 * ffn).flat_map(|r| r[..ffn].to_vec()).collect::<Vec<_>>();
        assert_eq!(gate_half(bits(&gu_b, n * k * 2 * ffn)), gate_half(bits(&gu_a, n * k * 2 * ffn)), "{ty}: up");
        // Down + the sum over experts (+ shared).
        let shared = ctx.storage_f32("shared", &(0..n * d).map(|_| rng.gen_range(-1.0..1.0)).collect::<Vec<f32>>());
        let (eo, out_a, out_b) = (
            ctx.storage_zeroed("eo", n * k * d),
            ctx.storage_zeroed("out a", n * d),
            ctx.storage_zeroed("out b", n * d),
        );
        let mut enc = ctx.encoder();
        let h = View::new(&gu_a, 2 * ffn);
        matmul_ids(&ctx, &mut enc, &down, d, &sel, n * k, h, 1, View::new(&eo, d)).unwrap();
        combine(&ctx, &mut enc, &eo, &sel, &out_a, Some(&shared), d, n, k).unwrap();
        down_combine(&ctx, &mut enc, &down, d, &sel, (n, k), h, &out_b, Some(&shared)).unwrap();
        ctx.submit(enc).unwrap();
        assert_eq!(bits(&out_b, n * d), bits(&out_a, n * d), "{ty}: down");
        // A dense expert's pair (one chunk).
        let sh =
            GpuWeight::upload_interleaved(&ctx, "sh", ty, cols, ffn, &gate[..ffn * rb], &up[..ffn * rb], ffn).unwrap();
        let (sa, sb) = (ctx.storage_zeroed("sa", n * 2 * ffn), ctx.storage_zeroed("sb", n * 2 * ffn));
        let mut enc = ctx.encoder();
        matmul(&ctx, &mut enc, &sh, 0..2 * ffn, View::new(&x, cols), n, View::new(&sa, 2 * ffn), false).unwrap();
        swiglu(&ctx, &mut enc, &sa, 2 * ffn, ffn, (&sa, 0, 2 * ffn), ffn, n, limit, None, None).unwrap();
        swiglu_pair(&ctx, &mut enc, &sh, View::new(&x, cols), n, View::new(&sb, 2 * ffn), limit).unwrap();
        ctx.submit(enc).unwrap();
        assert_eq!(gate_half(bits(&sb, n * 2 * ffn)), gate_half(bits(&sa, n * 2 * ffn)), "{ty}: shared");
    }
}

/// Kernel timing: every dispatch of the window is timed, labelled with its kernel in recording order, with a
/// non-negative GPU time (and some time in all); nothing is timed outside a window. Lavapipe has timestamp queries
/// (CI runs this on it); an adapter without them reports that timing cannot start.
#[test]
fn dispatches_share_a_pass_and_are_timed_in_a_timing_window() {
    let Some(ctx) = ctx_with(None) else { return };
    if !ctx.has_timestamps() {
        assert!(!ctx.start_timing());
        assert!(ctx.finish_timing().unwrap().is_none());
        crate::testdata::skip_or_fail("this adapter has no timestamp queries");
        return;
    }
    let (rows, cols) = (64usize, 256usize);
    let mut rng = StdRng::seed_from_u64(7);
    let w = GpuWeight::upload(
        &ctx,
        "w",
        GgmlType::Q8_0,
        cols,
        rows,
        &random_weight(&mut rng, GgmlType::Q8_0, rows, cols),
        1,
    )
    .unwrap();
    let xb = ctx.storage_f32("x", &(0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect::<Vec<f32>>());
    let yb = ctx.storage_zeroed("y", rows);
    let record = |n: usize| {
        let mut enc = ctx.encoder();
        for _ in 0..n {
            matmul(&ctx, &mut enc, &w, 0..rows, View::new(&xb, cols), 1, View::new(&yb, rows), false).unwrap();
        }
        get_rows(&ctx, &mut enc, &w, &[(3, 0)], View::new(&yb, cols)).unwrap();
        ctx.submit(enc).unwrap();
    };
    // Untimed, consecutive dispatches share one compute pass; a copy between them ends it.
    let before = ctx.counters();
    record(1);
    assert_eq!((ctx.counters() - before).passes, 1, "two dispatches, one pass");
    let before = ctx.counters();
    let mut enc = ctx.encoder();
    matmul(&ctx, &mut enc, &w, 0..rows, View::new(&xb, cols), 1, View::new(&yb, rows), false).unwrap();
    ctx.raw_encoder(&mut enc).copy_buffer_to_buffer(&yb, 0, &xb, 0, 4 * rows as u64);
    matmul(&ctx, &mut enc, &w, 0..rows, View::new(&xb, cols), 1, View::new(&yb, rows), false).unwrap();
    ctx.submit(enc).unwrap();
    assert_eq!((ctx.counters() - before).passes, 2, "a copy ends the pass");
    assert!(ctx.finish_timing().unwrap().is_none(), "no window was open");
    assert!(ctx.start_timing());
    let before = ctx.counters();
    record(3);
    assert_eq!((ctx.counters() - before).passes, 4, "a timed dispatch is a pass of its own");
    let times = ctx.finish_timing().unwrap().expect("a window was open");
    let labels: Vec<&str> = times.iter().map(|t| t.0.as_str()).collect();
    let product = format!("matmul_Q8_0_{}::main", ctx.reduce().tag());
    assert_eq!(labels, [&product, &product, &product, "get_rows_Q8_0::main"]);
    assert!(times.iter().all(|t| t.1 >= 0.0) && times.iter().map(|t| t.1).sum::<f64>() > 0.0, "{times:?}");
    assert!(ctx.finish_timing().unwrap().is_none(), "the window closed");
}

/// Copies and clears as kernels: bits exact (NaN payloads included) over ranges of a buffer larger than a binding
/// (bound through an aligned window), all in the tick's one pass; a copy command between kernels ends the pass.
#[test]
fn copies_and_clears_run_as_kernels_inside_the_pass() {
    let Some(ctx) = ctx_with(Some(1024)) else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let words: Vec<u32> = (0..1000).map(|i| if i % 7 == 0 { 0x7fc0_1234 } else { rng.gen() }).collect();
    let big = ctx.storage_u32("big", &words); // 4000 bytes: larger than the 1024-byte binding limit
    let small = ctx.storage_zeroed("small", 64);
    let before = ctx.counters();
    let mut enc = ctx.encoder();
    ctx.copy(&mut enc, &big, 4 * 613, &small, 4 * 5, 4 * 50);
    ctx.clear(&mut enc, &big, 4 * 301, 4 * 9);
    ctx.copy(&mut enc, &small, 4 * 5, &big, 4 * 901, 4 * 20);
    ctx.submit(enc).unwrap();
    let cost = ctx.counters() - before;
    assert_eq!((cost.dispatches, cost.passes), (3, 1), "three kernels, one pass");
    let mut want = words.clone();
    let mut small_want = vec![0u32; 64];
    small_want[5..55].copy_from_slice(&words[613..663]);
    want[301..310].fill(0);
    want[901..921].copy_from_slice(&small_want[5..25]);
    assert_eq!(ctx.read_u32(&small, 0, 64).unwrap(), small_want);
    assert_eq!(ctx.read_u32(&big, 0, 1000).unwrap(), want);
    // A buffer that cannot be bound (no storage use) is copied by a copy command, which ends the pass.
    let plain = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("plain"),
        size: 256,
        usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let before = ctx.counters();
    let mut enc = ctx.encoder();
    ctx.clear(&mut enc, &small, 0, 4);
    ctx.copy(&mut enc, &small, 0, &plain, 0, 256);
    ctx.copy(&mut enc, &plain, 16, &small, 0, 8);
    ctx.submit(enc).unwrap();
    assert_eq!(ctx.read_u32(&small, 0, 2).unwrap(), &small_want[4..6]);
    assert_eq!((ctx.counters() - before).passes, 1, "the clear's pass; the copies are commands");
}

/// Batched copies (`copies.rs`): random copies among four buffers (two larger than a binding), some depending on
/// others (a read of what an earlier copy wrote, a write over what an earlier one reads or writes), give exactly
/// what running them one by one in order gives; independent copies share a dispatch.
#[test]
fn batched_copies_equal_copies_in_order() {
    let Some(ctx) = ctx_with(Some(1024)) else { return };
    let mut rng = StdRng::seed_from_u64(11);
    let sizes = [1000usize, 200, 64, 700];
    let mut host: Vec<Vec<u32>> = sizes.iter().map(|&n| (0..n).map(|_| rng.gen()).collect()).collect();
    let bufs: Vec<wgpu::Buffer> = host.iter().map(|h| ctx.storage_u32("buf", h)).collect();
    let before = ctx.counters();
    let mut enc = ctx.encoder();
    let copies = 60;
    for _ in 0..copies {
        let (s, d) = loop {
            let (s, d) = (rng.gen_range(0..4), rng.gen_range(0..4));
            if s != d {
                break (s, d);
            }
        };
        let n = rng.gen_range(1..=sizes[s].min(sizes[d]).min(100));
        let (so, dof) = (rng.gen_range(0..=sizes[s] - n), rng.gen_range(0..=sizes[d] - n));
        ctx.copy(&mut enc, &bufs[s], 4 * so as u64, &bufs[d], 4 * dof as u64, 4 * n as u64);
        let v = host[s][so..so + n].to_vec();
        host[d][dof..dof + n].copy_from_slice(&v);
    }
    ctx.submit(enc).unwrap();
    let cost = ctx.counters() - before;
    assert_eq!(cost.dispatches, cost.copy_kernels);
    assert!(cost.dispatches < copies, "{} dispatches for {copies} copies: none batched", cost.dispatches);
    for (b, h) in bufs.iter().zip(&host) {
        assert_eq!(&ctx.read_u32(b, 0, h.len()).unwrap(), h);
    }
    // Four copies from distinct sources into disjoint rows of one buffer: one dispatch.
    let before = ctx.counters();
    let mut enc = ctx.encoder();
    for (i, b) in bufs[..3].iter().enumerate() {
        ctx.copy(&mut enc, b, 0, &bufs[3], 4 * 100 * i as u64, 4 * 50);
    }
    ctx.copy(&mut enc, &bufs[0], 400, &bufs[3], 4 * 600, 4 * 50);
    ctx.submit(enc).unwrap();
    assert_eq!((ctx.counters() - before).dispatches, 1);
    let got = ctx.read_u32(&bufs[3], 0, 700).unwrap();
    for (i, h) in host[..3].iter().enumerate() {
        assert_eq!(&got[100 * i..100 * i + 50], &h[..50]);
    }
    assert_eq!(&got[600..650], &host[0][100..150]);
}
