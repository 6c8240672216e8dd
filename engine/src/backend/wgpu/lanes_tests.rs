//! The product kernels' lane sums (`lanes.wgsl`): the subgroup variant and the workgroup-memory variant give the
//! same bits, for every format and every product entry, on rows that do not fill the last workgroup and lanes with
//! unequal block counts; the context picks subgroups where the adapter has them.

use ds4_shaders_wgsl::Reduce;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::context::{test_context, ContextOptions, WgpuContext};
use super::matmul::{matmul, multi_product, swiglu_pair, View};
use super::moe_ids::{down_combine, gate_up_swiglu, matmul_ids};
use super::tests::random_weight;
use super::weights::{weight_format, GpuWeight};
use crate::quant::GgmlType;
use crate::testdata::in_ci;

const TYPES: [GgmlType; 7] =
    [GgmlType::F32, GgmlType::F16, GgmlType::Bf16, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs];

/// Every product entry over one format's random weights, read back in one vector.
fn products(ctx: &WgpuContext, ty: GgmlType, seed: u64) -> Vec<f32> {
    let f = weight_format(ty).unwrap();
    let bv = ty.block_values();
    // Blocks per row: not a multiple of the lanes, so lanes hold unequal counts.
    let cols = bv * (3 * f.row_lanes() + 5);
    // Rows: the last workgroup part full.
    let rows = 2 * f.rows_per_workgroup() + 3;
    let n_tok = 11; // two tiles, the second part full
    let mut rng = StdRng::seed_from_u64(seed);
    let data = random_weight(&mut rng, ty, rows, cols);
    let x: Vec<f32> = (0..n_tok * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let w = GpuWeight::upload(ctx, "w", ty, cols, rows, &data, 1).unwrap();
    let xb = ctx.storage_f32("x", &x);
    let mut out = Vec::new();
    let mut read = |buf: &wgpu::Buffer, n: usize| out.extend(ctx.read_f32(buf, 0, n).unwrap());

    // Plain, accumulating and multi products, and the dense SwiGLU pair.
    let y = ctx.storage_f32("y", &vec![0.5; n_tok * rows]);
    let (y1, y2) = (ctx.storage_zeroed("y1", n_tok * 5), ctx.storage_zeroed("y2", n_tok * (rows - 5)));
    let sw = ctx.storage_zeroed("sw", n_tok * (rows / 2));
    let pair = GpuWeight::upload(ctx, "pair", ty, cols, rows - 1, &data[..(rows - 1) * w.row_bytes], 1).unwrap();
    let mut enc = ctx.encoder();
    matmul(ctx, &mut enc, &w, 0..rows, View::new(&xb, cols), n_tok, View::new(&y, rows), true).unwrap();
    multi_product(ctx, &mut enc, &w, &[5, rows], View::new(&xb, cols), n_tok, &[&y1, &y2]).unwrap();
    swiglu_pair(ctx, &mut enc, &pair, View::new(&xb, cols), n_tok, View::new(&sw, rows / 2), 7.0).unwrap();
    ctx.submit(enc).unwrap();
    read(&y, n_tok * rows);
    read(&y1, n_tok * 5);
    read(&y2, n_tok * (rows - 5));
    read(&sw, n_tok * (rows / 2));

    // Expert-indexed: 3 experts of er rows, 2 tokens × 2 slots; gate + up pairs and down + combine.
    let er = f.rows_per_workgroup() + 1;
    let experts = 3;
    let edata = random_weight(&mut rng, ty, experts * 2 * er, cols);
    let ew = GpuWeight::upload(ctx, "e", ty, cols, experts * 2 * er, &edata, 1).unwrap();
    let (tokens, k) = (2usize, 2usize);
    let ids = ctx.storage_u32("ids", &[2, 0, 1, 2]);
    let rw = ctx.storage_f32("rw", &[0.25, -1.5, 0.75, 2.0]);
    let (yi, gu) = (ctx.storage_zeroed("yi", tokens * k * 2 * er), ctx.storage_zeroed("gu", tokens * k * er));
    let h: Vec<f32> = (0..tokens * k * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let hb = ctx.storage_f32("h", &h);
    let (down, shared) = (ctx.storage_zeroed("down", tokens * 2 * er), ctx.storage_f32("shared", &vec![0.125; 2 * er]));
    let mut enc = ctx.encoder();
    matmul_ids(ctx, &mut enc, &ew, 2 * er, &ids, tokens * k, View::new(&xb, cols), k, View::new(&yi, 2 * er)).unwrap();
    gate_up_swiglu(ctx, &mut enc, &ew, er, (&ids, &rw), tokens * k, View::new(&xb, cols), k, View::new(&gu, er), 7.0)
        .unwrap();
    down_combine(ctx, &mut enc, &ew, 2 * er, &ids, (tokens, k), View::new(&hb, cols), &down, Some(&shared)).unwrap();
    ctx.submit(enc).unwrap();
    read(&yi, tokens * k * 2 * er);
    read(&gu, tokens * k * er);
    read(&down, tokens * 2 * er);
    out
}

#[test]
fn subgroup_and_workgroup_lane_sums_agree_bit_for_bit() {
    let Some(sg) = test_context(Default::default()) else { return };
    let Some(wg) = test_context(ContextOptions { no_subgroups: true, ..Default::default() }) else { return };
    assert_eq!(wg.reduce(), Reduce::Shared);
    let has = sg.device.features().contains(wgpu::Features::SUBGROUP);
    match sg.reduce() {
        Reduce::Subgroup { min_size } => {
            assert!(has && min_size == sg.info.subgroup_min_size);
            // The probe that kept subgroups on answers so again, and counts nothing before the first tick.
            assert!(sg.subgroups_are_consecutive(min_size).unwrap());
            assert_eq!(test_context(Default::default()).unwrap().counters().dispatches, 0);
        }
        Reduce::Shared => {
            // Lavapipe (the CI adapter) has subgroups and passes the probe: this test must compare the two paths.
            assert!(!in_ci(), "CI=true but {} has no usable subgroups (none, or the probe failed)", sg.info.name);
            eprintln!("skipping the comparison: {} offers no subgroups", sg.info.name);
            return;
        }
    }
    for (i, ty) in TYPES.into_iter().enumerate() {
        let (a, b) = (products(&sg, ty, 40 + i as u64), products(&wg, ty, 40 + i as u64));
        assert_eq!(a.len(), b.len());
        let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(
            differ,
            0,
            "{ty}: {differ} of {} values differ between {:?} and workgroup sums",
            a.len(),
            sg.reduce()
        );
        assert!(a.iter().all(|v| v.is_finite()) && a.iter().any(|&v| v != 0.0), "{ty}: degenerate outputs");
    }
}
