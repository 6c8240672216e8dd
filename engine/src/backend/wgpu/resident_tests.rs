//! Device-resident KV and tick tests on the tiny-a checkpoint (f32 recipe; layers: two window-only, two CSA with
//! ratio 4, two HCA with ratio 8; window 16): the device KV synced to the host against the CPU backend's tables,
//! restore through the host mirror, interleaved sessions, staleness errors, and the per-tick submission/readback
//! counts. Skipped like the golden tests when `../shared` or an adapter is missing outside CI.

use std::path::PathBuf;
use std::sync::OnceLock;

use super::context::test_context;
use super::WgpuBackend;
use crate::backend::cpu::CpuBackend;
use crate::backend::{Activations, Backend, RopeSet, StepCtx};
use crate::convert::{convert, ConvertOptions, Recipe};
use crate::exec::Executor;
use crate::gguf::GgufFile;
use crate::graph::{Batch, Graph};
use crate::model::Model;
use crate::tables::{KvSync, SessionKv};

/// The converted tiny-a GGUF (converted once per test binary).
fn tiny_path() -> Option<PathBuf> {
    static PATH: OnceLock<Option<(tempfile::TempDir, PathBuf)>> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = crate::testdata::shared("golden/tiny-a", "model.safetensors")?;
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("tiny-a.gguf");
        convert(&ConvertOptions::new(&dir, &out, Recipe::F32)).expect("convert tiny-a");
        Some((tmp, out))
    })
    .as_ref()
    .map(|(_, p)| p.clone())
}

fn setup() -> Option<(Model, WgpuBackend)> {
    let path = tiny_path()?;
    let ctx = test_context(Default::default())?;
    Some((Model::load(GgufFile::open(&path).unwrap()).unwrap(), WgpuBackend::with_context(ctx)))
}

/// A deterministic token sequence inside the vocabulary.
fn tokens(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97 + 13) >> 7) % vocab as u32).collect()
}

/// One tick: `runs` = (slot, first position, tokens), run i on `kv[i]`. Returns every row's logits, run-major.
fn tick(
    be: &dyn Backend,
    model: &Model,
    kv: &mut [SessionKv],
    runs: &[(usize, usize, &[u32])],
    sim: bool,
) -> Vec<Vec<f32>> {
    let mut batch = Batch::default();
    for &(slot, pos0, toks) in runs {
        batch.push_run(slot, pos0, toks.iter().copied(), true);
    }
    let rope = RopeSet::new(model);
    let mut act = Activations::default();
    act.ensure(model, batch.rows.len(), batch.logit_rows.len());
    let mut graph = Graph::default();
    crate::model::recipe::build(&mut graph, model, &batch, sim);
    let mut cx = StepCtx { model, rope: &rope, batch: &batch, kv, act: &mut act, sim };
    Executor::default().run(&graph, be, &mut cx).expect("tick");
    let v = model.config.vocab;
    let mut out = Vec::new();
    let mut at = 0;
    for &(_, _, toks) in runs {
        out.push(act.logits[at * v..(at + toks.len()) * v].to_vec());
        at += toks.len();
    }
    out
}

/// Feeds `toks` to one session in the given chunk sizes (then one token per tick); last logits.
#[allow(clippy::too_many_arguments)]
fn feed(
    be: &dyn Backend,
    model: &Model,
    kv: &mut SessionKv,
    slot: usize,
    pos0: usize,
    toks: &[u32],
    chunks: &[usize],
    sim: bool,
) -> Vec<f32> {
    let (mut pos, mut last) = (pos0, Vec::new());
    let mut sizes = chunks.iter().copied().chain(std::iter::repeat(1));
    while pos - pos0 < toks.len() {
        let n = sizes.next().unwrap().min(toks.len() - (pos - pos0));
        let part = &toks[pos - pos0..pos - pos0 + n];
        let l = tick(be, model, std::slice::from_mut(kv), &[(slot, pos, part)], sim);
        let v = model.config.vocab;
        last = l[0][(n - 1) * v..].to_vec();
        pos += n;
    }
    last
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// Compares two sessions' tables: identical shapes and scalar state, values within `tol` (all but `outliers`
/// values when the activation simulation can round a value to a neighbouring grid point).
fn assert_kv_close(a: &SessionKv, b: &SessionKv, tol: f32, outlier_frac: f64, what: &str) {
    assert_eq!(a.layers.len(), b.layers.len());
    for (l, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        let (xc, yc, xi, yi) = (x.comp_rows.to_vec(), y.comp_rows.to_vec(), x.idx_rows.to_vec(), y.idx_rows.to_vec());
        let mut pairs: Vec<(&str, &[f32], &[f32])> =
            vec![("ring", &x.ring, &y.ring), ("comp", &xc, &yc), ("idx", &xi, &yi)];
        for (name, fx, fy) in [("comp front", &x.comp, &y.comp), ("idx front", &x.idx, &y.idx)] {
            assert_eq!(fx.is_some(), fy.is_some(), "{what}: layer {l} {name}");
            if let (Some(fx), Some(fy)) = (fx, fy) {
                assert_eq!((fx.n_pending, fx.has_prev), (fy.n_pending, fy.has_prev), "{what}: layer {l} {name}");
                pairs.push((name, &fx.pending_kv, &fy.pending_kv));
                pairs.push((name, &fx.pending_gate, &fy.pending_gate));
                pairs.push((name, &fx.prev_kv, &fy.prev_kv));
                pairs.push((name, &fx.prev_gate, &fy.prev_gate));
            }
        }
        for (name, u, v) in pairs {
            assert_eq!(u.len(), v.len(), "{what}: layer {l} {name} length");
            let bad = u.iter().zip(v).filter(|(p, q)| (*p - *q).abs() > tol * q.abs().max(1.0)).count();
            assert!(
                bad as f64 <= outlier_frac * u.len() as f64,
                "{what}: layer {l} {name}: {bad} of {} values differ by more than {tol} (max {})",
                u.len(),
                max_diff(u, v)
            );
        }
    }
}

#[test]
fn device_kv_synced_to_host_matches_cpu_tables() {
    let Some((model, be)) = setup() else { return };
    let cpu = CpuBackend::new(2);
    let c = &model.config;
    let toks = tokens(1, 45, c.vocab);
    // Exact mode: tight; simulation: FP8/FP4 rounding may land a few values on a neighbouring grid point.
    for (sim, tol, frac) in [(false, 1e-3f32, 0.0), (true, 1e-3, 0.02)] {
        let mut kg = SessionKv::new(c, 64);
        let mut kc = SessionKv::new(c, 64);
        // Chunks that cross compressor blocks (4, 8) and the window (16), then decode.
        let lg = feed(&be, &model, &mut kg, 0, 0, &toks, &[7, 13, 18], sim);
        let lc = feed(&cpu, &model, &mut kc, 0, 0, &toks, &[7, 13, 18], sim);
        if !sim {
            assert!(max_diff(&lg, &lc) <= 1e-3, "logits differ: {}", max_diff(&lg, &lc));
        }
        assert!(kg.sync.host_stale && kg.sync.epoch != 0, "the wgpu backend left its host KV current");
        // The stale host arrays are still the empty initial state.
        assert!(kg.layers[2].comp_rows.is_empty());
        assert_eq!(kg.bytes(), kc.bytes(), "device byte count");
        be.sync_kv(0, &mut kg).unwrap();
        assert!(!kg.sync.host_stale);
        assert_kv_close(&kg, &kc, tol, frac, if sim { "sim" } else { "exact" });
        assert_eq!(kg.layers[2].comp_rows.n_values(), 45 / 4 * c.head_dim);
        assert_eq!(kg.layers[3].comp_rows.n_values(), 45 / 8 * c.head_dim);
    }
}

#[test]
fn restore_through_the_host_mirror_continues_bit_identically() {
    let Some((model, be)) = setup() else { return };
    let c = &model.config;
    let toks = tokens(2, 30, c.vocab);
    for sim in [false, true] {
        let mut ka = SessionKv::new(c, 64);
        feed(&be, &model, &mut ka, 0, 0, &toks[..21], &[9, 12], sim);
        be.sync_kv(0, &mut ka).unwrap();
        let snap = ka.clone();
        let la = feed(&be, &model, &mut ka, 0, 21, &toks[21..], &[], sim);
        // As restored from disk (fresh tag): uploaded into another slot.
        let mut kb = snap.clone();
        kb.sync = KvSync::default();
        let lb = feed(&be, &model, &mut kb, 1, 21, &toks[21..], &[], sim);
        assert_eq!(la, lb, "sim={sim}: restored session diverged");
        // A synced copy keeping its tag is uploaded too (host authoritative), also in a new slot.
        let mut kc = snap.clone();
        let lc = feed(&be, &model, &mut kc, 2, 21, &toks[21..], &[], sim);
        assert_eq!(la, lc, "sim={sim}: tagged copy diverged");
        be.sync_kv(0, &mut ka).unwrap();
        be.sync_kv(1, &mut kb).unwrap();
        assert_eq!(ka.layers, kb.layers, "sim={sim}: synced states differ");
    }
}

#[test]
fn two_interleaved_sessions_match_solo_runs() {
    let Some((model, be)) = setup() else { return };
    let c = &model.config;
    let v = c.vocab;
    let (tx, ty) = (tokens(3, 26, v), tokens(4, 19, v));
    // Interleaved: tick 1 both prefill chunks, tick 2 X decodes while Y prefills, then both decode.
    let mut kv = vec![SessionKv::new(c, 64), SessionKv::new(c, 64)];
    let a = tick(&be, &model, &mut kv, &[(0, 0, &tx[..10]), (1, 0, &ty[..6])], false);
    let b = tick(&be, &model, &mut kv[..], &[(0, 10, &tx[10..11]), (1, 6, &ty[6..17])], false);
    let mut got_x = [a[0].clone(), b[0].clone()].concat();
    let mut got_y = [a[1].clone(), b[1].clone()].concat();
    for i in 0..2 {
        let r =
            tick(&be, &model, &mut kv, &[(0, 11 + i, &tx[11 + i..12 + i]), (1, 17 + i, &ty[17 + i..18 + i])], false);
        got_x.extend_from_slice(&r[0]);
        got_y.extend_from_slice(&r[1]);
    }
    // Solo, on the CPU backend, one prefill each.
    let cpu = CpuBackend::new(2);
    for (slot, toks, got) in [(0usize, &tx[..13], &got_x), (1, &ty[..19], &got_y)] {
        let mut k = SessionKv::new(c, 64);
        let want = tick(&cpu, &model, std::slice::from_mut(&mut k), &[(slot, 0, toks)], false).remove(0);
        assert!(max_diff(got, &want) <= 1e-3, "session {slot}: max diff {}", max_diff(got, &want));
        let mut mine = std::mem::take(&mut kv[slot]);
        be.sync_kv(slot, &mut mine).unwrap();
        assert_kv_close(&mine, &k, 1e-3, 0.0, "interleaved");
    }
    assert_eq!(be.kv_slots(), vec![0, 1]);
    // Freeing a session drops its device copy; the other one stays.
    be.release_kv(0);
    assert_eq!(be.kv_slots(), vec![1]);
}

#[test]
fn stale_host_kv_without_its_device_copy_is_an_error() {
    let Some((model, be)) = setup() else { return };
    let c = &model.config;
    let toks = tokens(5, 9, c.vocab);
    let mut k = SessionKv::new(c, 32);
    feed(&be, &model, &mut k, 0, 0, &toks, &[9], false);
    let mut stale = k.clone();
    // Advancing the original leaves the clone's epoch behind: it can neither be synced nor run.
    feed(&be, &model, &mut k, 0, 9, &toks[..1], &[], false);
    assert!(be.sync_kv(0, &mut stale).is_err());
    let mut batch = Batch::default();
    batch.push_run(3, 9, [1u32], false);
    let rope = RopeSet::new(&model);
    let mut act = Activations::default();
    act.ensure(&model, 1, 1);
    let mut graph = Graph::default();
    crate::model::recipe::build(&mut graph, &model, &batch, false);
    let mut cx = StepCtx {
        model: &model,
        rope: &rope,
        batch: &batch,
        kv: std::slice::from_mut(&mut stale),
        act: &mut act,
        sim: false,
    };
    assert!(Executor::default().run(&graph, &be, &mut cx).is_err());
    // Clearing the host state makes it authoritative again.
    stale.clear();
    feed(&be, &model, &mut stale, 3, 0, &toks, &[4], false);
    // Malformed host state is an error at upload, not a panic (a well-formed one at position 0 runs).
    let mut batch0 = Batch::default();
    batch0.push_run(3, 0, [1u32], false);
    let breakers: [fn(&mut SessionKv); 4] = [
        |_| {},
        |k| k.layers[2].comp.as_mut().unwrap().pending_kv.truncate(5),
        // (Rows that are not whole rows can no longer be built: `PagedRows` takes whole rows.)
        |k| k.layers[3].ring.truncate(5),
        |k| k.layers[4].comp = None,
    ];
    for (i, brk) in breakers.iter().enumerate() {
        let mut kv = SessionKv::new(c, 32);
        brk(&mut kv);
        let kv = std::slice::from_mut(&mut kv);
        let mut cx = StepCtx { model: &model, rope: &rope, batch: &batch0, kv, act: &mut act, sim: false };
        let r = Executor::default().run(&graph, &be, &mut cx);
        assert_eq!(r.is_ok(), i == 0, "state {i}: {r:?}");
    }
}

/// A tick records everything into one encoder and submits it once, with the logits as its one readback:
/// attention, the compressors, the ring and the MoE routing (hash and learned) never wait for the host, in decode
/// and in prefill (whose MoE rows are grouped by expert on the device).
#[test]
fn decode_tick_submits_once_and_reads_back_once() {
    let Some((model, be)) = setup() else { return };
    let c = &model.config;
    let toks = tokens(6, 20, c.vocab);
    let mut k = SessionKv::new(c, 64);
    let before = be.context().counters();
    feed(&be, &model, &mut k, 0, 0, &toks[..19], &[19], true);
    let learned = model.layers.iter().filter(|l| l.tid2eid.is_none()).count() as u64;
    assert!(learned > 0 && learned < c.n_layers as u64, "tiny-a has hash-routed and learned layers");
    let d = be.context().counters() - before;
    assert_eq!((d.submits, d.readbacks), (1, 1), "prefill tick");
    let before = be.context().counters();
    // Position 19 completes a CSA block (ratio 4): compressor, indexer and ring all advance in this tick.
    tick(&be, &model, std::slice::from_mut(&mut k), &[(0, 19, &toks[19..20])], true);
    let d = be.context().counters() - before;
    assert_eq!((d.submits, d.readbacks), (1, 1), "decode tick");
    eprintln!("decode tick: {} dispatches", d.dispatches);
    // Syncing is the only other traffic.
    let before = be.context().counters();
    be.sync_kv(0, &mut k).unwrap();
    assert!((be.context().counters() - before).readbacks > 0);
    let before = be.context().counters();
    be.sync_kv(0, &mut k).unwrap();
    let d = be.context().counters() - before;
    assert_eq!((d.submits, d.readbacks), (0, 0), "a synced session reads nothing");
}

/// The expert-indexed product equals the plain product over the chosen expert's rows, bit for bit (same block
/// order and reduction), for every format, with experts split across bindings; the combine adds them in ascending
/// expert order (then the shared expert's output); a pair of matrices interleaved per expert gives both products.
#[test]
fn matmul_ids_matches_matmul_on_the_chosen_experts() {
    use super::matmul::{matmul, View};
    use super::moe_ids::{combine, matmul_ids};
    use super::tests::{ctx_with, random_weight};
    use crate::quant::GgmlType;
    use rand::{Rng, SeedableRng};
    let (experts, er, cols) = (5usize, 3usize, 256usize);
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
        let rb = ty.row_bytes(cols as u64).unwrap();
        // Four rows per binding, no expert grouping: experts of three rows straddle chunks.
        let Some(ctx) = ctx_with(Some((rb * 4).div_ceil(4) * 4)) else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7 + ty.id() as u64);
        let data = random_weight(&mut rng, ty, experts * er, cols);
        let w = super::weights::GpuWeight::upload(&ctx, "w", ty, cols, experts * er, &data, 1).unwrap();
        assert!(w.chunks.len() > 2);
        let (rows, k) = (2usize, 3usize);
        let sel: Vec<u32> = vec![4, 0, 2, 1, 4, 3];
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let (xb, ib) = (ctx.storage_f32("x", &x), ctx.storage_u32("ids", &sel));
        let (got, want) = (ctx.storage_zeroed("y", rows * k * er), ctx.storage_zeroed("y", rows * k * er));
        let mut enc = ctx.encoder();
        matmul_ids(&ctx, &mut enc, &w, er, &ib, rows * k, View::new(&xb, cols), k, View::new(&got, er)).unwrap();
        for (q, &e) in sel.iter().enumerate() {
            let xv = View { buf: &xb, offset: (q / k) * cols, stride: cols };
            let yv = View { buf: &want, offset: q * er, stride: er };
            let e = e as usize;
            matmul(&ctx, &mut enc, &w, e * er..(e + 1) * er, xv, 1, yv, false).unwrap();
        }
        ctx.submit(enc).unwrap();
        let (g, wv) = (ctx.read_f32(&got, 0, rows * k * er).unwrap(), ctx.read_f32(&want, 0, rows * k * er).unwrap());
        assert_eq!(g, wv, "{ty}");
        // combine: ascending expert order per row, then the shared expert's output when given.
        let shared: Vec<f32> = (0..rows * er).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let sb = ctx.storage_f32("shared", &shared);
        for with_shared in [false, true] {
            let out = ctx.storage_zeroed("out", rows * er);
            let mut enc = ctx.encoder();
            combine(&ctx, &mut enc, &got, &ib, &out, with_shared.then_some(&sb), er, rows, k).unwrap();
            ctx.submit(enc).unwrap();
            let o = ctx.read_f32(&out, 0, rows * er).unwrap();
            for r in 0..rows {
                let mut order: Vec<usize> = (0..k).collect();
                order.sort_by_key(|&j| (sel[r * k + j], j));
                for c in 0..er {
                    let mut s = order.iter().fold(0f32, |a, &j| a + g[(r * k + j) * er + c]);
                    if with_shared {
                        s += shared[r * er + c];
                    }
                    assert_eq!(o[r * er + c], s, "{ty} combine row {r} (shared: {with_shared})");
                }
            }
        }

        // Two matrices interleaved per expert (the MoE gate and up): one expert-indexed product over the pair's
        // groups of 2·er rows gives each half's own product, bit for bit, with the pairs split across bindings.
        let data_b = random_weight(&mut rng, ty, experts * er, cols);
        let (a_bytes, b_bytes) = (&data[..], &data_b[..]);
        let pair =
            super::weights::GpuWeight::upload_interleaved(&ctx, "ab", ty, cols, experts * er, a_bytes, b_bytes, er)
                .unwrap();
        assert!(pair.chunks.len() > 1 && pair.rows == 2 * experts * er);
        let wb = super::weights::GpuWeight::upload(&ctx, "b", ty, cols, experts * er, &data_b, 1).unwrap();
        let (both, only_b) = (ctx.storage_zeroed("ab", rows * k * 2 * er), ctx.storage_zeroed("b", rows * k * er));
        let mut enc = ctx.encoder();
        matmul_ids(&ctx, &mut enc, &pair, 2 * er, &ib, rows * k, View::new(&xb, cols), k, View::new(&both, 2 * er))
            .unwrap();
        matmul_ids(&ctx, &mut enc, &wb, er, &ib, rows * k, View::new(&xb, cols), k, View::new(&only_b, er)).unwrap();
        ctx.submit(enc).unwrap();
        let ab = ctx.read_f32(&both, 0, rows * k * 2 * er).unwrap();
        let bv = ctx.read_f32(&only_b, 0, rows * k * er).unwrap();
        for q in 0..rows * k {
            assert_eq!(ab[q * 2 * er..q * 2 * er + er], g[q * er..(q + 1) * er], "{ty} pair {q}: first half");
            assert_eq!(ab[q * 2 * er + er..(q + 1) * 2 * er], bv[q * er..(q + 1) * er], "{ty} pair {q}: second half");
        }
    }
    let Some(ctx) = ctx_with(None) else { return };
    let w = super::weights::GpuWeight::upload(&ctx, "w", GgmlType::F32, 32, 4, &[0u8; 512], 1).unwrap();
    let b = ctx.storage_zeroed("b", 64);
    let ids = ctx.storage_u32("ids", &[0]);
    let mut enc = ctx.encoder();
    assert!(matmul_ids(&ctx, &mut enc, &w, 3, &ids, 1, View::new(&b, 32), 1, View::new(&b, 3)).is_err());
}

/// Through the engine: a wgpu session's snapshot (synced from the device) matches the CPU engine's, reports the
/// same KV bytes, and a restored snapshot — directly, and saved to / loaded from a `ds4-kv` disk store — continues
/// with exactly the logits the original session produces.
#[test]
fn engine_snapshot_persist_and_restore_with_device_kv() {
    use crate::engine::{Engine, EngineOptions};
    use crate::BackendKind;
    let Some(path) = tiny_path() else { return };
    if test_context(Default::default()).is_none() {
        return;
    }
    let opts = |backend| EngineOptions { backend, exact: true, threads: 2, max_batch_tokens: 11, ..Default::default() };
    let mut g = Engine::open(&path, opts(BackendKind::Wgpu)).unwrap();
    let mut c = Engine::open(&path, opts(BackendKind::Cpu)).unwrap();
    let toks = tokens(7, 40, g.config().vocab);
    let (sg, sc) = (g.create_session(), c.create_session());
    for (e, s) in [(&mut g, sg), (&mut c, sc)] {
        e.feed(s, &toks[..32]).unwrap();
        e.run_until_idle().unwrap();
    }
    assert_eq!(g.kv_bytes(sg).unwrap(), c.kv_bytes(sc).unwrap());
    // Tiers: the wgpu session's state is on the device (the host mirror is not synced yet), the CPU's on the host.
    let (dev_g, host_g) = g.kv_bytes_by_tier(sg).unwrap();
    assert_eq!(dev_g, c.kv_bytes(sc).unwrap());
    assert!(host_g < dev_g, "host mirror {host_g} B should lag the device copy {dev_g} B before a sync");
    assert_eq!(c.kv_bytes_by_tier(sc).unwrap(), (0, c.kv_bytes(sc).unwrap()));
    let (snap_g, snap_c) = (g.snapshot(sg).unwrap(), c.snapshot(sc).unwrap());
    assert!(!snap_g.kv.sync.host_stale);
    assert_kv_close(&snap_g.kv, &snap_c.kv, 1e-3, 0.0, "engine snapshot");
    assert!(max_diff(&snap_g.logits, &snap_c.logits) <= 1e-3);

    // Disk round trip of the wgpu session (pages + checkpoint read from the synced host mirror).
    let dir = tempfile::tempdir().unwrap();
    let store =
        crate::persist::open_store(&g, dir.path(), crate::persist::kv_options(g.config(), 16, 1 << 30)).unwrap();
    crate::persist::save(&store, &g, sg, Default::default()).unwrap();

    // The original continues; the restored copies must produce the same logits bit for bit.
    let cont = &toks[32..];
    let mut want = Vec::new();
    for &t in cont {
        g.feed(sg, &[t]).unwrap();
        g.run_until_idle().unwrap();
        want.push(g.logits(sg).unwrap().to_vec());
    }
    let direct = g.restore(snap_g.clone()).unwrap();
    let (disk, matched) = crate::persist::restore_longest(&store, &mut g, &toks[..32]).unwrap().expect("stored prefix");
    assert_eq!(matched, 32);
    for s in [direct, disk] {
        for (i, &t) in cont.iter().enumerate() {
            g.feed(s, &[t]).unwrap();
            g.run_until_idle().unwrap();
            assert_eq!(g.logits(s).unwrap(), &want[i][..], "restored session diverged at step {i}");
        }
    }
}

/// A persist page's row block for a compressed layer is one contiguous range of the device rows: read straight
/// from the device, it equals the block `persist::rows` builds from the synced snapshot, for both tables.
#[test]
fn device_rows_of_a_page_equal_its_persist_row_block() {
    use super::kvdev::RowTable;
    use crate::persist::rows::{page_groups, TAG_COMP, TAG_IDX};
    let Some((model, be)) = setup() else { return };
    let c = &model.config;
    let toks = tokens(8, 40, c.vocab);
    let mut k = SessionKv::new(c, 64);
    feed(&be, &model, &mut k, 0, 0, &toks, &[16, 16], false);
    let stale = k.clone();
    be.sync_kv(0, &mut k).unwrap();
    let snap = crate::tables::SessionSnapshot { pos: 40, history: toks.clone(), kv: k.clone(), logits: Vec::new() };
    let span = 16;
    let spans = crate::persist::rows::page_spans(c, &snap, 1, span);
    let groups = page_groups(&spans);
    let mut checked = 0;
    for (l, blocks) in groups.iter().enumerate() {
        let ratio = c.compress_ratios[l];
        for b in blocks {
            let table = match b.tag {
                TAG_COMP => RowTable::Comp,
                TAG_IDX => RowTable::Idx,
                _ => continue,
            };
            let rows = span / ratio..2 * span / ratio;
            // The stale host copy still names the same device state (same epoch).
            let got = be.kv_rows(&stale, l, table, rows).unwrap();
            assert_eq!(got, b.values, "layer {l} {table:?}");
            checked += 1;
        }
    }
    assert_eq!(checked, 6, "two CSA layers (comp + idx) and two HCA layers (comp)");
    assert!(be.kv_rows(&stale, 2, RowTable::Comp, 0..11).is_err(), "past the rows written");
    assert!(be.kv_rows(&SessionKv::new(c, 8), 2, RowTable::Comp, 0..1).is_err(), "never on the device");
}

/// The wgpu backend is a kernel provider: every node of a prefill and of a decode tick goes to one of its kernels
/// (no stage runs whole), the readback included.
#[test]
fn every_node_of_a_tick_has_a_wgpu_kernel() {
    let Some((model, be)) = setup() else { return };
    for (pos0, n) in [(0, 9), (9, 1)] {
        let mut batch = Batch::default();
        batch.push_run(0, pos0, tokens(3, n, model.config.vocab), false);
        let mut graph = Graph::default();
        crate::model::recipe::build(&mut graph, &model, &batch, true);
        let mut ex = Executor::default();
        let placed = ex.place(&graph, &be, None, &model, n).unwrap();
        assert_eq!(placed.staged, 0, "rows {n}: {placed:?}");
        assert_eq!(placed.native + placed.portable, graph.nodes.len());
        assert!(graph.nodes.iter().any(|node| matches!(node.op, crate::graph::Op::Readback { .. })));
    }
}
