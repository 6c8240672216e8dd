//! Tests of the non-matmul kernels against straightforward CPU references (f64 where it matters).
//! Tolerances are stated per test; every kernel runs on tiny shapes (lavapipe is slow).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::context::WgpuContext;
use super::kvdev::front_push;
use super::ops::*;
use super::tests::ctx_with;

fn rand_vec(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

fn close(got: &[f32], want: &[f64], rel: f64, abs: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= abs + rel * w.abs(), "{what}[{i}]: {g} vs {w}");
    }
}

fn ctx() -> Option<WgpuContext> {
    ctx_with(None)
}

/// RMSNorm: tolerance 1e-5 relative + 1e-6.
#[test]
fn rms_norm_matches_cpu() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(1);
    let (n, rows, stride) = (100usize, 5usize, 110usize);
    let x = rand_vec(&mut rng, rows * stride, -2.0, 2.0);
    let g = rand_vec(&mut rng, n, 0.5, 1.5);
    let want = |weighted: bool| -> Vec<f64> {
        let mut out = Vec::new();
        for r in 0..rows {
            let row = &x[r * stride..r * stride + n];
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
            let s = 1.0 / (ms + 1e-6).sqrt();
            out.extend(row.iter().enumerate().map(|(i, &v)| v as f64 * s * if weighted { g[i] as f64 } else { 1.0 }));
        }
        out
    };
    let xb = ctx.storage_f32("x", &x);
    let yb = ctx.storage_zeroed("y", rows * n);
    let gb = ctx.storage_f32("g", &g);
    let mut enc = ctx.encoder();
    rms_norm(&ctx, &mut enc, (&xb, 0, stride), (&yb, 0, n), Some(&gb), n, rows, 1e-6).unwrap();
    ctx.submit(enc).unwrap();
    close(&ctx.read_f32(&yb, 0, rows * n).unwrap(), &want(true), 1e-5, 1e-6, "weighted");
    // Unweighted, in place.
    let mut enc = ctx.encoder();
    rms_norm(&ctx, &mut enc, (&xb, 0, stride), (&xb, 0, stride), None, n, rows, 1e-6).unwrap();
    ctx.submit(enc).unwrap();
    let got = ctx.read_f32(&xb, 0, rows * stride).unwrap();
    let got: Vec<f32> = (0..rows).flat_map(|r| got[r * stride..r * stride + n].to_vec()).collect();
    close(&got, &want(false), 1e-5, 1e-6, "in place");
}

/// RoPE: rotation of the trailing pairs only; inverse undoes it. Tolerance 1e-5 absolute (|x| ≤ 1).
#[test]
fn rope_rotates_trailing_pairs_and_inverts() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(2);
    let (n_tok, heads, hd, rd) = (2usize, 3usize, 16usize, 8usize);
    let x = rand_vec(&mut rng, n_tok * heads * hd, -1.0, 1.0);
    let ang: Vec<f64> = (0..n_tok * rd / 2).map(|_| rng.gen_range(-10.0..10.0)).collect();
    let cs: Vec<f32> = ang.iter().flat_map(|a| [a.cos() as f32, a.sin() as f32]).collect();
    let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for t in 0..n_tok {
        for h in 0..heads {
            for i in 0..rd / 2 {
                let b = t * heads * hd + h * hd + hd - rd + 2 * i;
                let (c, s) = (cs[2 * (t * rd / 2 + i)] as f64, cs[2 * (t * rd / 2 + i) + 1] as f64);
                let (a0, a1) = (want[b], want[b + 1]);
                want[b] = a0 * c - a1 * s;
                want[b + 1] = a1 * c + a0 * s;
            }
        }
    }
    let xb = ctx.storage_f32("x", &x);
    let csb = ctx.storage_f32("cs", &cs);
    let shape =
        RopeShape { n_tok, heads, head_dim: hd, rope_dim: rd, offset: 0, tok_stride: heads * hd, head_stride: hd };
    let mut enc = ctx.encoder();
    rope(&ctx, &mut enc, &xb, &csb, shape, false).unwrap();
    ctx.submit(enc).unwrap();
    close(&ctx.read_f32(&xb, 0, x.len()).unwrap(), &want, 0.0, 1e-5, "rope");
    let mut enc = ctx.encoder();
    rope(&ctx, &mut enc, &xb, &csb, shape, true).unwrap();
    ctx.submit(enc).unwrap();
    let back: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    close(&ctx.read_f32(&xb, 0, x.len()).unwrap(), &back, 0.0, 1e-5, "inverse");
    assert!(rope(&ctx, &mut ctx.encoder(), &xb, &csb, RopeShape { rope_dim: 7, ..shape }, false).is_err());
}

/// Attention with sink over explicit key lists (including an empty list). Tolerance 1e-5 absolute.
#[test]
fn attention_with_sink_matches_cpu() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let (heads, dim, n_rows) = (3usize, 20usize, 10usize);
    let keys = KeyLists { rows: vec![0, 1, 2, 3, 9, 4, 7, 7, 5], ranges: vec![(0, 4), (4, 5), (0, 0)] };
    let n_tok = keys.ranges.len();
    let q = rand_vec(&mut rng, n_tok * heads * dim, -1.0, 1.0);
    let kv = rand_vec(&mut rng, n_rows * dim, -1.0, 1.0);
    let sink = rand_vec(&mut rng, heads, -1.0, 1.0);
    let scale = 1.0 / (dim as f32).sqrt();
    let mut want = vec![0f64; n_tok * heads * dim];
    for (t, &(s, c)) in keys.ranges.iter().enumerate() {
        for h in 0..heads {
            let qv = &q[(t * heads + h) * dim..][..dim];
            let rows = &keys.rows[s as usize..(s + c) as usize];
            let sc: Vec<f64> = rows
                .iter()
                .map(|&r| {
                    qv.iter().zip(&kv[r as usize * dim..][..dim]).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = sc.iter().cloned().fold(sink[h] as f64, f64::max);
            let den = (sink[h] as f64 - m).exp() + sc.iter().map(|v| (v - m).exp()).sum::<f64>();
            for (j, &r) in rows.iter().enumerate() {
                let p = (sc[j] - m).exp() / den;
                for d in 0..dim {
                    want[(t * heads + h) * dim + d] += p * kv[r as usize * dim + d] as f64;
                }
            }
        }
    }
    let qb = ctx.storage_f32("q", &q);
    let kvb = ctx.storage_f32("kv", &kv);
    let sb = ctx.storage_f32("sink", &sink);
    let ob = ctx.storage_f32("o", &vec![7.0; q.len()]);
    let mut enc = ctx.encoder();
    attention(&ctx, &mut enc, (&qb, 0, heads * dim), &kvb, &keys, &sb, (&ob, 0, heads * dim), heads, dim, scale)
        .unwrap();
    ctx.submit(enc).unwrap();
    close(&ctx.read_f32(&ob, 0, q.len()).unwrap(), &want, 0.0, 1e-5, "attention");
}

/// CPU mHC reference in f64 following the transformers implementation: (u, post, comb).
#[allow(clippy::too_many_arguments)]
fn hc_reference(
    x: &[f32],
    mix: &[f32],
    base: &[f32],
    scale: &[f32],
    n: usize,
    d: usize,
    iters: usize,
    head: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let eps = 1e-6f64;
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let r = 1.0 / (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / (n * d) as f64 + eps).sqrt();
    let m = |k: usize| mix[k] as f64 * r;
    let pre: Vec<f64> = (0..n).map(|j| sig(m(j) * scale[0] as f64 + base[j] as f64) + eps).collect();
    let u: Vec<f64> = (0..d).map(|c| (0..n).map(|j| pre[j] * x[j * d + c] as f64).sum()).collect();
    if head {
        return (u, vec![], vec![]);
    }
    let post: Vec<f64> = (0..n).map(|j| 2.0 * sig(m(n + j) * scale[1] as f64 + base[n + j] as f64)).collect();
    let mut c = vec![0f64; n * n];
    for j in 0..n {
        let row: Vec<f64> =
            (0..n).map(|k| m(2 * n + j * n + k) * scale[2] as f64 + base[2 * n + j * n + k] as f64).collect();
        let mx = row.iter().cloned().fold(f64::MIN, f64::max);
        let s: f64 = row.iter().map(|v| (v - mx).exp()).sum();
        for k in 0..n {
            c[j * n + k] = (row[k] - mx).exp() / s + eps;
        }
    }
    let colnorm = |c: &mut Vec<f64>| {
        for k in 0..n {
            let s: f64 = (0..n).map(|j| c[j * n + k]).sum();
            for j in 0..n {
                c[j * n + k] /= s + eps;
            }
        }
    };
    colnorm(&mut c);
    for _ in 1..iters {
        for j in 0..n {
            let s: f64 = c[j * n..(j + 1) * n].iter().sum();
            for k in 0..n {
                c[j * n + k] /= s + eps;
            }
        }
        colnorm(&mut c);
    }
    (u, post, c)
}

/// mHC pre (sublayer and head) and post. Tolerance 1e-5 relative + 1e-5.
#[test]
fn hc_pre_post_match_reference() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(4);
    let (n, d, n_tok, iters) = (4usize, 24usize, 2usize, 20usize);
    let nm = (2 + n) * n;
    let x = rand_vec(&mut rng, n_tok * n * d, -1.0, 1.0);
    let mix = rand_vec(&mut rng, n_tok * nm, -3.0, 3.0);
    let base = rand_vec(&mut rng, nm, -1.0, 1.0);
    let scale = rand_vec(&mut rng, 3, 0.5, 2.0);
    let f = rand_vec(&mut rng, n_tok * d, -1.0, 1.0);
    let shape = HcShape { n_tok, d, n, sinkhorn_iters: iters, norm_eps: 1e-6, hc_eps: 1e-6 };
    let (xb, mb, bb, sb) = (
        ctx.storage_f32("x", &x),
        ctx.storage_f32("mix", &mix),
        ctx.storage_f32("b", &base),
        ctx.storage_f32("s", &scale),
    );
    let state = ctx.storage_zeroed("state", n_tok * (n + n * n));
    let ub = ctx.storage_zeroed("u", n_tok * d);
    let fb = ctx.storage_f32("f", &f);
    let ob = ctx.storage_zeroed("out", n_tok * n * d);
    for head in [false, true] {
        let mut enc = ctx.encoder();
        hc_pre(&ctx, &mut enc, &shape, &xb, (&mb, 0, nm), &bb, &sb, &state, (&ub, 0, d), head).unwrap();
        if !head {
            hc_post(&ctx, &mut enc, &shape, &xb, (&fb, 0, d), &state, &ob, None).unwrap();
        }
        ctx.submit(enc).unwrap();
        let u = ctx.read_f32(&ub, 0, n_tok * d).unwrap();
        let st = ctx.read_f32(&state, 0, n_tok * (n + n * n)).unwrap();
        let out = ctx.read_f32(&ob, 0, n_tok * n * d).unwrap();
        for t in 0..n_tok {
            let xt = &x[t * n * d..(t + 1) * n * d];
            let (wu, post, comb) = hc_reference(xt, &mix[t * nm..], &base, &scale, n, d, iters, head);
            close(&u[t * d..(t + 1) * d], &wu, 1e-5, 1e-5, "u");
            if head {
                continue;
            }
            let sbase = t * (n + n * n);
            close(&st[sbase..sbase + n], &post, 1e-5, 1e-5, "post");
            close(&st[sbase + n..sbase + n + n * n], &comb, 1e-5, 1e-5, "comb");
            // Sinkhorn ends with a column normalisation: every column of the GPU's comb sums to 1.
            for k in 0..n {
                let colsum: f64 = (0..n).map(|j| st[sbase + n + j * n + k] as f64).sum();
                assert!((colsum - 1.0).abs() < 1e-4, "comb column {k} sums to {colsum}");
            }
            let want: Vec<f64> = (0..n * d)
                .map(|i| {
                    let (k, c) = (i / d, i % d);
                    post[k] * f[t * d + c] as f64 + (0..n).map(|j| comb[j * n + k] * xt[j * d + c] as f64).sum::<f64>()
                })
                .collect();
            close(&out[t * n * d..(t + 1) * n * d], &want, 1e-5, 1e-5, "hc post");
        }
    }
    assert!(hc_post(&ctx, &mut ctx.encoder(), &shape, &xb, (&fb, 0, d), &state, &xb, None).is_err());
}

/// Compressor pooling with overlapping (CSA-style) slots and empty slots. Tolerance 1e-5 absolute.
#[test]
fn compress_pool_matches_cpu() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let (m, dim, n_tokens) = (4usize, 12usize, 8usize);
    let stride = 2 * dim;
    let kv = rand_vec(&mut rng, n_tokens * stride, -1.0, 1.0);
    let gate = rand_vec(&mut rng, n_tokens * stride, -2.0, 2.0);
    let ape = rand_vec(&mut rng, m * stride, -1.0, 1.0);
    // Window w: Ca (offset 0) of block w-1 then Cb (offset dim) of block w; block -1 empty.
    let mut slots: Vec<PoolInput> = Vec::new();
    for w in 0..2u32 {
        for j in 0..m as u32 {
            slots.push((w > 0).then(|| ((w - 1) * m as u32 + j, 0, j)));
        }
        for j in 0..m as u32 {
            slots.push(Some((w * m as u32 + j, dim as u32, j)));
        }
    }
    let mut want = Vec::new();
    for w in 0..2 {
        for f in 0..dim {
            let zs: Vec<(f64, f64)> = slots[w * 2 * m..(w + 1) * 2 * m]
                .iter()
                .flatten()
                .map(|&(r, o, a)| {
                    let i = r as usize * stride + o as usize + f;
                    ((gate[i] + ape[a as usize * stride + o as usize + f]) as f64, kv[i] as f64)
                })
                .collect();
            let mx = zs.iter().map(|z| z.0).fold(f64::MIN, f64::max);
            let den: f64 = zs.iter().map(|z| (z.0 - mx).exp()).sum();
            want.push(zs.iter().map(|z| (z.0 - mx).exp() / den * z.1).sum::<f64>());
        }
    }
    let (kb, gb, ab) = (ctx.storage_f32("kv", &kv), ctx.storage_f32("gate", &gate), ctx.storage_f32("ape", &ape));
    let ob = ctx.storage_zeroed("out", 2 * dim);
    let mut enc = ctx.encoder();
    compress_pool(&ctx, &mut enc, &kb, &gb, stride, &ab, stride, &slots, 2 * m, dim, (&ob, 0, dim)).unwrap();
    ctx.submit(enc).unwrap();
    close(&ctx.read_f32(&ob, 0, 2 * dim).unwrap(), &want, 0.0, 1e-5, "compress");
    assert!(compress_pool(&ctx, &mut ctx.encoder(), &kb, &gb, stride, &ab, stride, &slots[1..], 8, dim, (&ob, 0, dim))
        .is_err());
}

/// Indexer scores over paged keys (tolerance 1e-5 relative + 1e-6) and top-k (exact: stable, lowest index first on
/// ties).
#[test]
fn indexer_scores_and_topk() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(6);
    let (heads, dim, n_keys, k) = (3usize, 8usize, 150usize, 5usize);
    let limit = vec![150u32, 3, 0, 90];
    let n_tok = limit.len();
    let q = rand_vec(&mut rng, n_tok * heads * dim, -1.0, 1.0);
    let mut keys = rand_vec(&mut rng, n_keys * dim, -1.0, 1.0);
    // Many keys opposite to every query direction tie at exactly 0 after ReLU.
    for s in (0..n_keys).step_by(3) {
        keys[s * dim..(s + 1) * dim].iter_mut().for_each(|v| *v = 0.0);
    }
    let w = rand_vec(&mut rng, n_tok * heads, 0.1, 1.0);
    let scale = 1.0 / (dim as f32).sqrt();
    // The keys paged as the device KV pages them: 8-row pages stored in reverse order in the pool.
    let (shift, rpp) = (3u32, 8usize);
    let n_pages = n_keys.div_ceil(rpp);
    let table: Vec<u32> = (0..n_pages as u32).rev().collect();
    let mut pool = vec![0f32; n_pages * rpp * dim];
    for r in 0..n_keys {
        let at = ((table[r >> shift] as usize) << shift | (r & (rpp - 1))) * dim;
        pool[at..at + dim].copy_from_slice(&keys[r * dim..(r + 1) * dim]);
    }
    let (qb, kb, wb) = (ctx.storage_f32("q", &q), ctx.storage_f32("k", &pool), ctx.storage_f32("w", &w));
    let tb = ctx.storage_u32("page table", &table);
    let paged = Paged { rows: &kb, table: &tb, shift };
    let sc = ctx.storage_zeroed("scores", n_tok * n_keys);
    let sel = ctx.storage_zeroed("sel", n_tok * k);
    let mut enc = ctx.encoder();
    indexer_topk(&ctx, &mut enc, &qb, &paged, &wb, 0, &limit, n_keys, heads, dim, k, (1.0, scale), &sc, &sel).unwrap();
    ctx.submit(enc).unwrap();
    let got_sc = ctx.read_f32(&sc, 0, n_tok * n_keys).unwrap();
    let got_sel = ctx.read_u32(&sel, 0, n_tok * k).unwrap();
    for t in 0..n_tok {
        let mut want = Vec::new();
        for s in 0..limit[t] as usize {
            let v: f64 = (0..heads)
                .map(|h| {
                    let d: f64 = (0..dim).map(|c| q[(t * heads + h) * dim + c] as f64 * keys[s * dim + c] as f64).sum();
                    w[t * heads + h] as f64 * d.max(0.0) * scale as f64
                })
                .sum();
            want.push(v);
        }
        close(&got_sc[t * n_keys..t * n_keys + limit[t] as usize], &want, 1e-5, 1e-6, "scores");
        assert!(got_sc[t * n_keys + limit[t] as usize..(t + 1) * n_keys].iter().all(|&v| v < -1e38));
        // Reference selection on the GPU's own scores (so float rounding cannot flip the order).
        let row = &got_sc[t * n_keys..t * n_keys + limit[t] as usize];
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        let mut pick: Vec<u32> = order.into_iter().take(k).map(|i| i as u32).collect();
        pick.sort();
        pick.resize(k, u32::MAX);
        assert_eq!(&got_sel[t * k..(t + 1) * k], &pick[..], "token {t}");
    }
}

/// MoE routing (learned and hash), clamped SwiGLU, gather and scatter-add. Tolerance 1e-5 relative + 1e-6.
#[test]
fn moe_route_swiglu_gather_scatter() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let (n_tok, n_exp, k, scale) = (3usize, 8usize, 2usize, 1.5f32);
    let logits = rand_vec(&mut rng, n_tok * n_exp, -3.0, 3.0);
    let bias = rand_vec(&mut rng, n_exp, -0.5, 0.5);
    let s = |t: usize, e: usize| {
        let v = logits[t * n_exp + e] as f64;
        (v.max(0.0) + (1.0 + (-v.abs()).exp()).ln()).sqrt()
    };
    let lb = ctx.storage_f32("logits", &logits);
    let bb = ctx.storage_f32("bias", &bias);
    let sel = ctx.storage_zeroed("sel", n_tok * k);
    let rw = ctx.storage_zeroed("rw", n_tok * k);
    let tid2eid: Vec<u32> = vec![0, 1, 7, 3, 5, 2, 6, 4];
    let tokens: Vec<u32> = vec![2, 0, 3];
    let (tb, tk) = (ctx.storage_u32("tid2eid", &tid2eid), ctx.storage_u32("tokens", &tokens));
    for hash in [false, true] {
        let routing = if hash { Routing::Hash { tid2eid: &tb, tokens: &tk } } else { Routing::Learned { bias: &bb } };
        let mut enc = ctx.encoder();
        moe_route(&ctx, &mut enc, &lb, routing, n_tok, n_exp, k, scale, true, &sel, &rw).unwrap();
        ctx.submit(enc).unwrap();
        let got_sel = ctx.read_u32(&sel, 0, n_tok * k).unwrap();
        let got_w = ctx.read_f32(&rw, 0, n_tok * k).unwrap();
        for t in 0..n_tok {
            let want_sel: Vec<u32> = if hash {
                tid2eid[tokens[t] as usize * k..][..k].to_vec()
            } else {
                let mut o: Vec<usize> = (0..n_exp).collect();
                o.sort_by(|&a, &b| (s(t, b) + bias[b] as f64).partial_cmp(&(s(t, a) + bias[a] as f64)).unwrap());
                o[..k].iter().map(|&e| e as u32).collect()
            };
            assert_eq!(&got_sel[t * k..(t + 1) * k], &want_sel[..], "hash={hash} token {t}");
            let tot: f64 = want_sel.iter().map(|&e| s(t, e as usize)).sum();
            let want_w: Vec<f64> = want_sel.iter().map(|&e| s(t, e as usize) / tot * scale as f64).collect();
            close(&got_w[t * k..(t + 1) * k], &want_w, 1e-5, 1e-6, "route weights");
        }
    }
    // SwiGLU over 2 rows of 70, gate|up packed with stride 150, up at +75, weighted by rw[{3, 0}].
    let (n, rows, limit) = (70usize, 2usize, 1.5f32);
    let gu = rand_vec(&mut rng, rows * 150, -3.0, 3.0);
    let gub = ctx.storage_f32("gu", &gu);
    let hb = ctx.storage_zeroed("h", rows * n);
    let widx = [3u32, 0];
    let rwv = ctx.read_f32(&rw, 0, n_tok * k).unwrap();
    let mut enc = ctx.encoder();
    swiglu(&ctx, &mut enc, &gub, 150, 75, (&hb, 0, n), n, rows, limit, Some((&rw, &widx)), None).unwrap();
    ctx.submit(enc).unwrap();
    let want: Vec<f64> = (0..rows * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            let g = (gu[r * 150 + c] as f64).min(limit as f64);
            let u = (gu[r * 150 + 75 + c] as f64).clamp(-limit as f64, limit as f64);
            g / (1.0 + (-g).exp()) * u * rwv[widx[r] as usize] as f64
        })
        .collect();
    close(&ctx.read_f32(&hb, 0, rows * n).unwrap(), &want, 1e-5, 1e-6, "swiglu");
    // With a shared expert's 3 rows in the same dispatch: the routed rows as above, the shared rows as a dispatch
    // of their own gives them (unweighted, over their gate halves), bit for bit.
    let sh = rand_vec(&mut rng, 3 * 150, -3.0, 3.0);
    let (sb_alone, sb_fused) = (ctx.storage_f32("sh", &sh), ctx.storage_f32("sh", &sh));
    let hb2 = ctx.storage_zeroed("h", rows * n);
    let mut enc = ctx.encoder();
    swiglu(&ctx, &mut enc, &sb_alone, 150, 75, (&sb_alone, 0, 150), n, 3, limit, None, None).unwrap();
    let shared = Some((&sb_fused, 3));
    swiglu(&ctx, &mut enc, &gub, 150, 75, (&hb2, 0, n), n, rows, limit, Some((&rw, &widx)), shared).unwrap();
    ctx.submit(enc).unwrap();
    let bits =
        |b: &wgpu::Buffer, len: usize| ctx.read_f32(b, 0, len).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&hb2, rows * n), bits(&hb, rows * n), "routed rows with the shared ones");
    assert_eq!(bits(&sb_fused, 3 * 150), bits(&sb_alone, 3 * 150), "shared rows in the routed dispatch");
    assert_ne!(bits(&sb_fused, 3 * 150), sh.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "written");
    // Gather rows {4, 1} of a [5, 9] (stride 10) matrix.
    let src = rand_vec(&mut rng, 50, -1.0, 1.0);
    let sbuf = ctx.storage_f32("src", &src);
    let packed = ctx.storage_zeroed("packed", 18);
    let mut enc = ctx.encoder();
    gather_rows(&ctx, &mut enc, &sbuf, &packed, &[4, 1], 9, 10).unwrap();
    ctx.submit(enc).unwrap();
    let want: Vec<f32> = [4usize, 1].iter().flat_map(|&r| src[r * 10..r * 10 + 9].to_vec()).collect();
    assert_eq!(ctx.read_f32(&packed, 0, 18).unwrap(), want, "gather");
}

/// Nearest value of `grid` (non-negative representable magnitudes), ties to the entry with even index
/// (even mantissa), sign restored.
fn nearest(grid: &[f64], v: f64) -> f64 {
    let a = v.abs();
    let mut best = 0usize;
    for i in 1..grid.len() {
        let (db, di) = ((grid[best] - a).abs(), (grid[i] - a).abs());
        if di < db || (di == db && i % 2 == 0) {
            best = i;
        }
    }
    grid[best].copysign(v)
}

/// FP8 e4m3 / FP4 e2m1 block round trips against enumerated value tables (exact), Hadamard against the explicit
/// matrix (1e-5 absolute).
#[test]
fn activation_simulation_matches_value_tables() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(8);
    // All non-negative finite e4m3fn values (ascending; index parity = mantissa parity) and e2m1 values.
    let mut e4m3 = Vec::new();
    for e in 0..16 {
        for m in 0..8 {
            if e == 15 && m == 7 {
                continue;
            }
            let v = if e == 0 { m as f64 / 8.0 * 2f64.powi(-6) } else { (1.0 + m as f64 / 8.0) * 2f64.powi(e - 7) };
            e4m3.push(v);
        }
    }
    let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let (rows, stride, n) = (3usize, 200usize, 192usize);
    for (kind, block, grid, mx) in [(ActSim::Fp8, 64usize, &e4m3[..], 448.0), (ActSim::Fp4, 32, &e2m1[..], 6.0)] {
        let mut x = rand_vec(&mut rng, rows * stride, -3.0, 3.0);
        x[5] = 0.0;
        x[stride..stride + block].iter_mut().for_each(|v| *v = 0.0);
        let xb = ctx.storage_f32("x", &x);
        let mut enc = ctx.encoder();
        act_sim(&ctx, &mut enc, &xb, kind, rows, n, stride, block).unwrap();
        ctx.submit(enc).unwrap();
        let got = ctx.read_f32(&xb, 0, rows * stride).unwrap();
        for r in 0..rows {
            for b in (0..n).step_by(block) {
                let blk = &x[r * stride + b..r * stride + b + block];
                let amax = blk.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
                for (i, &v) in blk.iter().enumerate() {
                    let want = if amax == 0.0 {
                        v as f64
                    } else {
                        let s = 2f64.powf((amax / mx).log2().ceil());
                        nearest(grid, v as f64 / s) * s
                    };
                    let g = got[r * stride + b + i] as f64;
                    assert!((g - want).abs() <= 1e-6 * want.abs(), "{kind:?} r{r} i{}: {g} vs {want} (x {v})", b + i);
                }
            }
            assert_eq!(&got[r * stride + n..(r + 1) * stride], &x[r * stride + n..(r + 1) * stride], "tail touched");
        }
    }
    let n = 16usize;
    let x = rand_vec(&mut rng, 2 * n, -1.0, 1.0);
    let xb = ctx.storage_f32("x", &x);
    let mut enc = ctx.encoder();
    act_sim(&ctx, &mut enc, &xb, ActSim::Hadamard, 2, n, n, 0).unwrap();
    ctx.submit(enc).unwrap();
    let want: Vec<f64> = (0..2 * n)
        .map(|i| {
            let (r, a) = (i / n, i % n);
            (0..n).map(|b| if (a & b).count_ones() % 2 == 0 { 1.0 } else { -1.0 } * x[r * n + b] as f64).sum::<f64>()
                / (n as f64).sqrt()
        })
        .collect();
    close(&ctx.read_f32(&xb, 0, 2 * n).unwrap(), &want, 0.0, 1e-5, "hadamard");
    assert!(act_sim(&ctx, &mut ctx.encoder(), &xb, ActSim::Hadamard, 1, 12, 12, 0).is_err());
}

/// Bind groups and uniform blocks are made once and reused by every dispatch of the same pipeline, buffers and
/// parameters; a bind group unused for more than `BIND_KEEP_TICKS` ticks is dropped (a tick's own fresh buffers
/// are not kept alive long), and the results do not change.
#[test]
fn bind_groups_and_uniforms_are_reused_across_ticks() {
    let Some(ctx) = ctx() else { return };
    let (n, rows) = (64usize, 3usize);
    let mut rng = StdRng::seed_from_u64(5);
    let x = ctx.storage_f32("x", &rand_vec(&mut rng, n * rows, -1.0, 1.0));
    let y = ctx.storage_zeroed("y", n * rows);
    let norm = |ctx: &WgpuContext| {
        let mut enc = ctx.encoder();
        rms_norm(ctx, &mut enc, (&x, 0, n), (&y, 0, n), None, n, rows, 1e-6).unwrap();
        ctx.submit(enc).unwrap();
        ctx.read_f32(&y, 0, n * rows).unwrap()
    };
    ctx.next_tick();
    let before = ctx.counters();
    let first = norm(&ctx);
    let made = ctx.counters() - before;
    assert_eq!((made.dispatches, made.bind_groups), (1, 1));
    assert!(made.host_to_device > 0, "the first dispatch uploads its uniform block");
    for _ in 0..3 {
        ctx.next_tick();
        let before = ctx.counters();
        assert_eq!(norm(&ctx), first);
        let d = ctx.counters() - before;
        assert_eq!((d.dispatches, d.bind_groups, d.host_to_device), (1, 0, 0), "reused in the next tick");
    }
    // Kept through BIND_KEEP_TICKS ticks without it, dropped after one more, then made again.
    for _ in 0..super::context::BIND_KEEP_TICKS {
        ctx.next_tick();
    }
    let before = ctx.counters();
    assert_eq!(norm(&ctx), first);
    assert_eq!((ctx.counters() - before).bind_groups, 0, "kept while recently used");
    for _ in 0..=super::context::BIND_KEEP_TICKS {
        ctx.next_tick();
    }
    let before = ctx.counters();
    assert_eq!(norm(&ctx), first);
    assert_eq!((ctx.counters() - before).bind_groups, 1, "made again after ticks unused");
}

/// `candidates.wgsl` gives exactly [`crate::sampler::top_candidates`]: ids, and values bit for bit, over rows
/// with ties, NaN, ±∞ and ±0, rows shorter than k, and a width that is no multiple of the workgroup.
#[test]
fn logit_candidates_equal_the_host_definition() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let (vocab, rows) = (1000usize, 4usize);
    let mut x: Vec<f32> = (0..rows * vocab)
        .map(|_| match rng.gen_range(0..16) {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            2 => -0.0,
            3 => 0.0,
            4 => f32::INFINITY,
            5..=9 => rng.gen_range(0..4) as f32,
            _ => rng.gen_range(-10.0..10.0),
        })
        .collect();
    // Row 3 has three eligible values only.
    x[3 * vocab..].fill(f32::NAN);
    x[3 * vocab + 7] = 2.0;
    x[3 * vocab + 900] = -0.0;
    x[3 * vocab + 5] = 0.0;
    let xb = ctx.storage_f32("logits", &x);
    for k in [1usize, 7, 64] {
        let out = ctx.storage_zeroed("candidates", rows * k * 2);
        let mut enc = ctx.encoder();
        super::rows::candidates(&ctx, &mut enc, &xb, &out, vocab, k, rows).unwrap();
        ctx.submit(enc).unwrap();
        let got = ctx.read_u32(&out, 0, rows * k * 2).unwrap();
        for r in 0..rows {
            let (mut ids, mut vals) = (vec![0u32; k], vec![0f32; k]);
            crate::sampler::top_candidates(&x[r * vocab..(r + 1) * vocab], &mut ids, &mut vals);
            for j in 0..k {
                let (id, bits) = (got[(r * k + j) * 2], got[(r * k + j) * 2 + 1]);
                assert_eq!((id, bits), (ids[j], vals[j].to_bits()), "k {k} row {r} slot {j}");
            }
        }
    }
}

/// `front_push` (`kvdev.wgsl`): the pending slots get the rows and the gates plus `ape` (the host's f32 add, bit
/// for bit), other slots untouched; two independent pushes recorded back to back are one dispatch
/// (`pairs.rs`), and a push reading what the one before it wrote is not paired and sees its write.
#[test]
fn front_push_fills_pending_slots_and_pairs_independent_pushes() {
    let Some(ctx) = ctx() else { return };
    let mut rng = StdRng::seed_from_u64(21);
    let (ratio, w) = (4usize, 70usize);
    let push = |(kv, gate): (&[f32], &[f32]), ape: &[f32], front: (&mut [f32], &mut [f32]), start, rows, pos0| {
        for r in 0..rows {
            let slot = (pos0 + r) % ratio;
            for c in 0..w {
                let (s, d) = ((start + r) * w + c, (ratio + slot) * w + c);
                front.0[d] = kv[s];
                front.1[d] = gate[s] + ape[slot * w + c];
            }
        }
    };
    let (src_kv, src_gate, ape) = (
        rand_vec(&mut rng, 5 * w, -2.0, 2.0),
        rand_vec(&mut rng, 5 * w, -2.0, 2.0),
        rand_vec(&mut rng, ratio * w, -1.0, 1.0),
    );
    let fronts: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
        .map(|_| (rand_vec(&mut rng, 2 * ratio * w, -1.0, 1.0), rand_vec(&mut rng, 2 * ratio * w, -1.0, 1.0)))
        .collect();
    let (kb, gb, ab) =
        (ctx.storage_f32("kv", &src_kv), ctx.storage_f32("gate", &src_gate), ctx.storage_f32("ape", &ape));
    let fb: Vec<(wgpu::Buffer, wgpu::Buffer)> =
        fronts.iter().map(|(k, g)| (ctx.storage_f32("fkv", k), ctx.storage_f32("fgate", g))).collect();
    // Two independent pushes (different frontiers, shared sources): one dispatch.
    let before = ctx.counters();
    let mut enc = ctx.encoder();
    front_push(&ctx, &mut enc, (&kb, &gb), 1, 3, w, &ab, (&fb[0].0, &fb[0].1), 5, ratio).unwrap();
    front_push(&ctx, &mut enc, (&kb, &gb), 4, 1, w, &ab, (&fb[1].0, &fb[1].1), 2, ratio).unwrap();
    ctx.submit(enc).unwrap();
    assert_eq!((ctx.counters() - before).dispatches, 1, "independent pushes paired");
    let mut want = fronts.clone();
    let (w0, w1) = want.split_at_mut(1);
    push((&src_kv, &src_gate), &ape, (&mut w0[0].0, &mut w0[0].1), 1, 3, 5);
    push((&src_kv, &src_gate), &ape, (&mut w1[0].0, &mut w1[0].1), 4, 1, 2);
    for ((k, g), (wk, wg)) in fb.iter().zip(&want) {
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(ctx.read_f32(k, 0, 2 * ratio * w).unwrap()), bits(wk.clone()));
        assert_eq!(bits(ctx.read_f32(g, 0, 2 * ratio * w).unwrap()), bits(wg.clone()));
    }
    // The second push reads the first's frontier as its source rows: two dispatches, in order.
    let before = ctx.counters();
    let mut enc = ctx.encoder();
    front_push(&ctx, &mut enc, (&kb, &gb), 0, 2, w, &ab, (&fb[0].0, &fb[0].1), 0, ratio).unwrap();
    front_push(&ctx, &mut enc, (&fb[0].0, &fb[0].1), ratio, 2, w, &ab, (&fb[1].0, &fb[1].1), 1, ratio).unwrap();
    ctx.submit(enc).unwrap();
    assert_eq!((ctx.counters() - before).dispatches, 2, "dependent pushes not paired");
    let (w0, w1) = want.split_at_mut(1);
    push((&src_kv, &src_gate), &ape, (&mut w0[0].0, &mut w0[0].1), 0, 2, 0);
    let (k0, g0) = (w0[0].0.clone(), w0[0].1.clone());
    push((&k0, &g0), &ape, (&mut w1[0].0, &mut w1[0].1), ratio, 2, 1);
    assert_eq!(ctx.read_f32(&fb[1].0, 0, 2 * ratio * w).unwrap(), want[1].0);
    assert_eq!(ctx.read_f32(&fb[1].1, 0, 2 * ratio * w).unwrap(), want[1].1);
}
