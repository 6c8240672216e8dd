//! Exact roll back ([`Engine::rollback`], and [`Engine::truncate`] built on it): a session rolled back to any
//! earlier position within its roll-back reach has exactly the KV state of a cold prefill of that prefix, and
//! once re-fed it gives bit-identical logits — at positions on both sides of compressor block boundaries, for a
//! model with CSA (ratio 4), HCA ratio 128 and window layers, in simulation and exact mode, and for the tiny-a
//! golden checkpoint (ratios 4 and 8). Beyond the reach an in-place roll back is refused and changes nothing;
//! truncate then recomputes, with the same result. On wgpu the same log lives on the device (`kvdev`), and a
//! roll back is device-side copies: the same exactness checks run there, against cold wgpu prefills; a device fork
//! shares its KV pages with its parent and rolls back without touching them.

use ds4_engine::convert::{demo_config, random_model_gguf};
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_tests::{bits, continue_with, golden_gguf, shared, tokens, wgpu_available};

/// A random model with one CSA (ratio 4), one HCA ratio-128 and one window layer; GGUF bytes.
fn model_128() -> Vec<u8> {
    let mut c = demo_config();
    c.compress_ratios = vec![4, 128, 0];
    c.compress_ratios_all = c.compress_ratios.clone();
    random_model_gguf(&c, 11, Vec::new()).expect("random model")
}

#[derive(Clone, Copy)]
enum M<'a> {
    Bytes(&'a [u8]),
    File(&'a std::path::Path),
}

fn open(m: M<'_>, exact: bool, rollback: usize, backend: BackendKind) -> Engine {
    let opts = EngineOptions {
        backend,
        exact,
        threads: 2,
        ctx: 2048,
        max_batch_tokens: 64,
        rollback,
        ..EngineOptions::default()
    };
    match m {
        M::Bytes(b) => Engine::from_gguf(GgufFile::from_bytes(b.to_vec()).unwrap(), opts).unwrap(),
        M::File(p) => Engine::open(p, opts).unwrap(),
    }
}

/// A session that processed `toks` (fed in uneven pieces, so runs cross block boundaries mid-run).
fn prefill(e: &mut Engine, toks: &[u32]) -> ds4_engine::tables::SessionId {
    let s = e.create_session();
    for piece in toks.chunks(37) {
        e.feed(s, piece).unwrap();
        e.run_until_idle().unwrap();
    }
    s
}

/// Rolls one long session back to each of `points` (descending) and checks state and continued logits against
/// cold prefills of the same prefix.
fn check_points(m: M<'_>, exact: bool, n: usize, points: &[usize]) {
    check_points_on(BackendKind::Cpu, m, exact, n, points)
}

fn check_points_on(backend: BackendKind, m: M<'_>, exact: bool, n: usize, points: &[usize]) {
    let mut e = open(m, exact, 1024, backend);
    let vocab = e.config().vocab;
    let all = tokens(3, n, vocab);
    let cont = tokens(9, 3, vocab);
    let s = prefill(&mut e, &all);
    assert_eq!(e.rollback_floor(s).unwrap(), 0, "the whole history is within R");
    let mut cold = open(m, exact, 0, backend);
    for &l in points {
        e.rollback(s, l).unwrap();
        assert_eq!(e.position(s).unwrap(), l);
        assert_eq!(e.history(s).unwrap(), &all[..l]);
        let c = prefill(&mut cold, &all[..l]);
        let (got, want) = (e.snapshot(s).unwrap(), cold.snapshot(c).unwrap());
        for (li, (a, b)) in got.kv.layers.iter().zip(&want.kv.layers).enumerate() {
            assert!(a == b, "layer {li}: state after roll back to {l} differs from a cold prefill (exact {exact})");
        }
        let a = continue_with(&mut e, s, &cont);
        let b = continue_with(&mut cold, c, &cont);
        assert!(a == b, "roll back to {l}: continued logits differ from a cold prefill (exact {exact})");
        cold.free_session(c).unwrap();
        // Back to the roll-back point, then re-grow the original history for the next (earlier) point.
        e.rollback(s, l).unwrap();
        e.feed(s, &all[l..]).unwrap();
        e.run_until_idle().unwrap();
        assert_eq!(e.position(s).unwrap(), n);
    }
}

#[test]
fn rollback_is_exact_across_block_boundaries_ratio_4_and_128() {
    let bytes = model_128();
    // Around the ratio-128 boundaries (128, 256) and ratio-4 ones, the window (16), and the very start.
    let points = [299, 257, 256, 255, 200, 129, 128, 127, 17, 16, 5, 4, 3, 1, 0];
    for exact in [false, true] {
        check_points(M::Bytes(&bytes), exact, 300, &points);
    }
}

#[test]
fn rollback_is_exact_on_tiny_a() {
    let Some(sh) = shared() else { return };
    let gguf = golden_gguf(&sh, "tiny-a", "f32");
    let points = [63, 48, 33, 32, 31, 24, 17, 16, 15, 9, 8, 7, 4, 1];
    for exact in [true, false] {
        check_points(M::File(&gguf), exact, 64, &points);
    }
}

#[test]
fn rollback_beyond_reach_is_refused_and_truncate_recomputes() {
    let bytes = model_128();
    let r = 40;
    let mut e = open(M::Bytes(&bytes), false, r, BackendKind::Cpu);
    let vocab = e.config().vocab;
    let all = tokens(5, 600, vocab);
    let s = prefill(&mut e, &all);
    assert_eq!(e.rollback_floor(s).unwrap(), 600 - r, "reach is exactly R tokens");
    let before = e.snapshot(s).unwrap();
    let err = e.rollback(s, 600 - r - 1).unwrap_err().to_string();
    assert!(err.contains("reachable"), "{err}");
    assert!(e.snapshot(s).unwrap() == before, "a refused roll back changed the session");
    assert!(e.rollback(s, 601).is_err());

    let mut cold = open(M::Bytes(&bytes), false, 0, BackendKind::Cpu);
    let cont = tokens(8, 2, vocab);
    for len in [600 - r + 1, 300] {
        // Within reach (one token recomputed), then beyond it (recomputed from scratch).
        e.truncate(s, len).unwrap();
        e.run_until_idle().unwrap();
        assert_eq!(e.position(s).unwrap(), len);
        let c = prefill(&mut cold, &all[..len]);
        assert_eq!(bits(e.logits(s).unwrap()), bits(cold.logits(c).unwrap()), "truncate to {len}");
        assert!(continue_with(&mut e, s, &cont) == continue_with(&mut cold, c, &cont), "truncate to {len}");
        cold.free_session(c).unwrap();
        e.rollback(s, len).unwrap();
        e.feed(s, &all[len..]).unwrap();
        e.run_until_idle().unwrap();
    }
    // The full recompute restarted the log at 0; regrown to 600 tokens the reach is R again.
    assert_eq!(e.rollback_floor(s).unwrap(), 600 - r);
}

#[test]
fn forked_session_rolls_back_without_touching_the_original() {
    let bytes = model_128();
    let mut e = open(M::Bytes(&bytes), false, 1024, BackendKind::Cpu);
    let vocab = e.config().vocab;
    let all = tokens(6, 150, vocab);
    let s = prefill(&mut e, &all);
    let before = e.snapshot(s).unwrap();
    let f = e.restore(before.clone()).unwrap();
    assert_eq!(e.rollback_floor(f).unwrap(), 0, "a fork keeps the roll-back log");
    e.rollback(f, 130).unwrap();
    let cont = tokens(2, 2, vocab);
    let a = continue_with(&mut e, f, &cont);
    assert!(e.snapshot(s).unwrap() == before);
    let mut cold = open(M::Bytes(&bytes), false, 0, BackendKind::Cpu);
    let c = prefill(&mut cold, &all[..130]);
    assert!(a == continue_with(&mut cold, c, &cont));
    // A session restored from a snapshot without a log (as from disk) cannot roll back before its position.
    let mut plain = before.clone();
    for l in &mut plain.kv.layers {
        l.log = Default::default();
    }
    let p = e.restore(plain).unwrap();
    assert_eq!(e.rollback_floor(p).unwrap(), 150);
}

#[test]
fn wgpu_rollback_is_exact_on_the_device() {
    if !wgpu_available() {
        return;
    }
    // Ratios 4 and 8, window 16, both modes; then the ratio-128 boundaries in simulation mode (lavapipe is slow).
    let small = random_model_gguf(&demo_config(), 5, Vec::new()).expect("random model");
    let points = [59, 33, 32, 17, 16, 15, 8, 4, 1, 0];
    for exact in [true, false] {
        check_points_on(BackendKind::Wgpu, M::Bytes(&small), exact, 60, &points);
    }
    check_points_on(BackendKind::Wgpu, M::Bytes(&model_128()), false, 300, &[299, 256, 255, 128]);
}

#[test]
fn wgpu_rollback_reach_and_truncate() {
    if !wgpu_available() {
        return;
    }
    // Ratios 4 and 8, window 16: a roll back to L needs L − 16.. logged, so the reach is exactly R.
    let bytes = random_model_gguf(&demo_config(), 5, Vec::new()).expect("random model");
    let r = 20;
    let mut g = open(M::Bytes(&bytes), true, r, BackendKind::Wgpu);
    let vocab = g.config().vocab;
    let all = tokens(4, 60, vocab);
    let s = prefill(&mut g, &all);
    assert_eq!(g.rollback_floor(s).unwrap(), 60 - r, "the device log reaches exactly R tokens");
    assert!(g.rollback(s, 60 - r - 1).is_err(), "beyond the reach");
    let mut cold = open(M::Bytes(&bytes), true, 0, BackendKind::Wgpu);
    let fresh = cold.create_session();
    assert_eq!(cold.rollback_floor(fresh).unwrap(), 0);
    for len in [50, 20] {
        // Within reach: roll back to len − 1 and recompute one token; beyond: recompute everything.
        g.truncate(s, len).unwrap();
        g.run_until_idle().unwrap();
        assert_eq!(g.position(s).unwrap(), len);
        let c = prefill(&mut cold, &all[..len]);
        assert_eq!(bits(g.logits(s).unwrap()), bits(cold.logits(c).unwrap()), "truncate to {len}");
        cold.free_session(c).unwrap();
    }
    // A session without a device copy yet (restored from a host snapshot) has no device log: nothing to roll.
    let snap = g.snapshot(s).unwrap();
    let p = g.restore(snap).unwrap();
    assert_eq!(g.rollback_floor(p).unwrap(), 20);
    assert!(g.rollback(p, 10).is_err());
}

#[test]
fn wgpu_fork_is_made_on_the_device_and_rolls_back_alone() {
    if !wgpu_available() {
        return;
    }
    let bytes = model_128();
    let mut e = open(M::Bytes(&bytes), false, 1024, BackendKind::Wgpu);
    let vocab = e.config().vocab;
    let all = tokens(6, 150, vocab);
    let s = prefill(&mut e, &all);
    let (live, _) = e.device_kv_pages().unwrap();
    let f = e.fork(s).unwrap();
    assert_eq!(e.device_kv_pages(), Some((live, live)), "the fork shares every device page, copies none");
    assert_eq!(e.kv_bytes(f).unwrap(), e.kv_bytes(s).unwrap());
    assert_eq!(e.rollback_floor(f).unwrap(), 0, "the fork keeps the device roll-back log");
    let before = e.snapshot(s).unwrap();
    e.rollback(f, 130).unwrap();
    let cont = tokens(2, 2, vocab);
    let a = continue_with(&mut e, f, &cont);
    assert!(e.snapshot(s).unwrap() == before, "rolling the fork back changed the original");
    let mut cold = open(M::Bytes(&bytes), false, 0, BackendKind::Wgpu);
    let c = prefill(&mut cold, &all[..130]);
    assert!(a == continue_with(&mut cold, c, &cont), "the fork rolled back differs from a cold prefill");
    // The original still continues as if nothing happened.
    let b = continue_with(&mut e, s, &cont);
    let c2 = prefill(&mut cold, &all);
    assert!(b == continue_with(&mut cold, c2, &cont));
}
