//! Decode ticks that read back only the logit candidates ([`crate::engine::Engine::set_logit_candidates`]), on
//! the demo model: the same sampled ids as whole rows on wgpu and on the CPU, `k` (id, value) pairs per session as
//! the tick's one readback on the device, and no partial row escaping into a snapshot, a fork or a later request.

use super::context::test_context;
use super::fallback_tests::demo;
use crate::backend::BackendKind;
use crate::engine::{Engine, EngineOptions};
use crate::sampler::{Sampler, SamplerConfig};

fn engine(backend: BackendKind) -> Engine {
    Engine::from_model(demo(), EngineOptions { backend, exact: true, threads: 2, ..Default::default() }).unwrap()
}

/// Prompt, then `n` sampled tokens fed back one tick each; with `k`, the session asks for `k` candidates after
/// the prompt. Returns the ids and the device-to-host bytes of each decode tick (empty on the CPU).
fn generate(e: &mut Engine, cfg: &SamplerConfig, k: Option<usize>, n: usize) -> (Vec<u32>, Vec<u64>) {
    let vocab = e.config().vocab as u32;
    let s = e.create_session();
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 7919 + 3) % vocab).collect();
    e.feed(s, &prompt).unwrap();
    e.run_until_idle().unwrap();
    assert!(!e.logits_partial(s).unwrap(), "the prompt's row is whole");
    if let Some(k) = k {
        e.set_logit_candidates(s, k).unwrap();
    }
    let mut sampler = Sampler::new(cfg.clone()).unwrap();
    let (mut ids, mut bytes) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = sampler.sample(e.logits(s).unwrap()).unwrap();
        ids.push(t);
        let before = e.device_counters();
        e.feed(s, &[t]).unwrap();
        e.run_until_idle().unwrap();
        if let (Some(a), Some(b)) = (before, e.device_counters()) {
            bytes.push((b - a).device_to_host);
        }
        assert_eq!(e.logits_partial(s).unwrap(), k.is_some());
    }
    e.free_session(s).unwrap();
    (ids, bytes)
}

#[test]
fn candidate_ticks_draw_the_same_ids_and_read_back_only_the_candidates() {
    if test_context(Default::default()).is_none() {
        return;
    }
    let greedy = SamplerConfig::greedy();
    let top_k = SamplerConfig { temperature: 1.5, top_k: 6, top_p: 0.95, seed: 9, ..Default::default() };
    for backend in [BackendKind::Wgpu, BackendKind::Cpu] {
        for cfg in [&greedy, &top_k] {
            let k = cfg.candidates().unwrap();
            let mut e = engine(backend);
            let vocab = e.config().vocab as u64;
            let (want, whole) = generate(&mut e, cfg, None, 8);
            let (got, part) = generate(&mut e, cfg, Some(k), 8);
            assert_eq!(got, want, "{backend:?} {cfg:?}: the same ids from the candidates");
            if backend == BackendKind::Wgpu {
                assert!(whole.iter().all(|&b| b == vocab * 4), "whole rows: {whole:?}");
                assert!(part.iter().all(|&b| b == k as u64 * 8), "{k} candidates: {part:?}");
            }
        }
    }
}

#[test]
fn partial_rows_stay_with_their_session() {
    if test_context(Default::default()).is_none() {
        return;
    }
    let mut e = engine(BackendKind::Wgpu);
    let (a, b) = (e.create_session(), e.create_session());
    for s in [a, b] {
        e.feed(s, &[5, 6, 7]).unwrap();
    }
    e.run_until_idle().unwrap();
    e.set_logit_candidates(a, 4).unwrap();
    assert!(e.set_logit_candidates(a, crate::graph::MAX_LOGIT_CANDIDATES + 1).is_err());
    // A tick with a session that wants whole rows brings whole rows for every session.
    e.feed(a, &[8]).unwrap();
    e.feed(b, &[8]).unwrap();
    e.run_until_idle().unwrap();
    assert!(!e.logits_partial(a).unwrap() && !e.logits_partial(b).unwrap());
    let whole = e.logits(a).unwrap().to_vec();
    assert_eq!(whole, e.logits(b).unwrap(), "same tokens, same row");
    // Alone, `a` gets its candidates: the 4 best of the whole row, the rest −∞.
    e.feed(a, &[9]).unwrap();
    e.feed(b, &[9]).unwrap();
    e.set_logit_candidates(b, 4).unwrap();
    e.run_until_idle().unwrap();
    let row = e.logits(a).unwrap().to_vec();
    assert!(e.logits_partial(a).unwrap());
    assert_eq!(row.iter().filter(|x| x.is_finite()).count(), 4);
    // Snapshots and forks carry no partial row; asking for whole rows again drops it.
    assert!(e.snapshot(a).unwrap().logits.is_empty());
    let f = e.fork(a).unwrap();
    assert!(e.logits(f).is_err());
    e.set_logit_candidates(a, 0).unwrap();
    assert!(e.logits(a).is_err(), "a partial row is dropped when whole rows are asked for");
    e.feed(a, &[10]).unwrap();
    e.run_until_idle().unwrap();
    assert!(!e.logits_partial(a).unwrap());
    assert_eq!(e.logits(a).unwrap().len(), e.config().vocab);
}
