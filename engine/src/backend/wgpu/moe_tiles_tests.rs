//! The device grouping of a prefill's MoE pairs by expert (`moe_group.wgsl`) and the tiled expert products
//! (`matmul_ids.wgsl`'s `tiles`), against the host and the per-pair products.

use rand::{Rng, SeedableRng};

use super::matmul::View;
use super::moe_ids::{group, group_with, matmul_ids, matmul_tiles, MAX_CHUNKS, PAIR_TILE};
use super::tests::{ctx_with, random_weight};
use crate::quant::GgmlType;

/// The plan holds every pair once, grouped by expert in ascending order and ascending within an expert, in tiles
/// of at most 8 pairs of one expert, as many as the experts' counts need; each dispatch's indirect arguments carry
/// its product's grid and the number of tiles of the experts its chunk holds, and its first tile is theirs.
#[test]
fn grouping_on_the_device_matches_a_stable_sort_by_expert() {
    let Some(ctx) = ctx_with(None) else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for (n_pairs, n_exp) in [(1usize, 1usize), (7, 3), (8, 1), (9, 1), (96, 16), (300, 5), (40, 300), (2000, 256)] {
        let sel: Vec<u32> = (0..n_pairs).map(|_| rng.gen_range(0..n_exp as u32)).collect();
        let sb = ctx.storage_u32("sel", &sel);
        let grids = [[3, 1], [5, 2], [7, 4]];
        // Product 0 in one chunk of every expert, product 1 in none, product 2 in three overlapping ranges.
        let mut bounds = vec![0u32; 2 * 3 * MAX_CHUNKS];
        let e = n_exp as u32;
        bounds[..2].copy_from_slice(&[0, e]);
        let third = 2 * 2 * MAX_CHUNKS;
        bounds[third..third + 6].copy_from_slice(&[0, e / 2 + 1, e / 2, e, e, e]);
        let mut enc = ctx.encoder();
        let t = group_with(&ctx, &mut enc, &sb, (n_pairs, n_exp), grids, &bounds).unwrap();
        ctx.submit(enc).unwrap();
        let plan = ctx.read_u32(&t.plan, 0, t.base_at + 3 * MAX_CHUNKS).unwrap();
        let mut order: Vec<u32> = (0..n_pairs as u32).collect();
        order.sort_by_key(|&q| sel[q as usize]);
        assert_eq!(&plan[t.order_at..t.base_at], &order[..], "{n_pairs} pairs, {n_exp} experts: order");
        let mut tiles = Vec::new();
        let mut first_tile = vec![0u32; n_exp + 1];
        let mut at = 0;
        for e in 0..n_exp as u32 {
            first_tile[e as usize] = (tiles.len() / 3) as u32;
            let c = sel.iter().filter(|&&s| s == e).count();
            for i in (0..c).step_by(PAIR_TILE) {
                tiles.extend([e, (at + i) as u32, (c - i).min(PAIR_TILE) as u32]);
            }
            at += c;
        }
        let n_tiles = tiles.len() / 3;
        first_tile[n_exp] = n_tiles as u32;
        assert!(n_tiles <= t.max_tiles);
        assert_eq!(plan[0] as usize, n_tiles, "{n_pairs} pairs, {n_exp} experts: tiles");
        assert_eq!(&plan[1..1 + tiles.len()], &tiles[..], "{n_pairs} pairs, {n_exp} experts: tiles");
        let args = ctx.read_u32(&t.args, 0, 9 * MAX_CHUNKS).unwrap();
        for j in 0..3 * MAX_CHUNKS {
            let (lo, hi) = (bounds[2 * j] as usize, (bounds[2 * j + 1] as usize).max(bounds[2 * j] as usize));
            let g = grids[j / MAX_CHUNKS];
            let want = [g[0], g[1], first_tile[hi] - first_tile[lo]];
            assert_eq!(&args[3 * j..3 * j + 3], &want, "{n_pairs} pairs, {n_exp} experts: dispatch {j}");
            assert_eq!(plan[t.base_at + j], first_tile[lo], "{n_pairs} pairs, {n_exp} experts: dispatch {j}");
        }
    }
}

/// The tiled products equal the per-pair products bit for bit (a token's dot does not depend on its tile), for
/// every format, with experts straddling weight chunks, rows shared by several slots (`x_div`), tiles full and
/// partial; they fetch each expert's rows once per tile, one indirect dispatch per chunk over the tiles of the
/// experts it holds.
#[test]
fn tiled_expert_products_equal_the_per_pair_products_bit_for_bit() {
    let (experts, er, cols) = (5usize, 3usize, 256usize);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
        let rb = ty.row_bytes(cols as u64).unwrap();
        let Some(ctx) = ctx_with(Some((rb * 4).div_ceil(4) * 4)) else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(17 + ty.id() as u64);
        let data = random_weight(&mut rng, ty, experts * er, cols);
        let w = super::weights::GpuWeight::upload(&ctx, "w", ty, cols, experts * er, &data, 1).unwrap();
        assert!(w.chunks.len() > 2);
        let (rows, k) = (13usize, 3usize);
        let n = rows * k;
        let sel: Vec<u32> = (0..n).map(|_| rng.gen_range(0..experts as u32)).collect();
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let (xb, ib) = (ctx.storage_f32("x", &x), ctx.storage_u32("ids", &sel));
        let (got, want) = (ctx.storage_zeroed("y", n * er), ctx.storage_zeroed("y", n * er));
        let mut enc = ctx.encoder();
        let tiles = group(&ctx, &mut enc, &ib, (n, experts), [None, Some((&w, er)), None]).unwrap();
        let before = ctx.counters();
        matmul_tiles(&ctx, &mut enc, &w, er, (&tiles, 1), View::new(&xb, cols), k, View::new(&got, er)).unwrap();
        let cost = ctx.counters() - before;
        matmul_ids(&ctx, &mut enc, &w, er, &ib, n, View::new(&xb, cols), k, View::new(&want, er)).unwrap();
        ctx.submit(enc).unwrap();
        let bits =
            |b: &wgpu::Buffer| ctx.read_f32(b, 0, n * er).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{ty}");
        assert_eq!(cost.dispatches, w.chunks.len() as u64, "{ty}: one dispatch per chunk");
        assert_eq!(cost.weights_fetched, (tiles.max_tiles * er * w.row_bytes) as u64, "{ty}: the tiles' bound");
    }
}
