//! Speculative decoding on a small random model: lossless against plain decoding, batched, exact state.

use super::*;
use crate::convert::{demo_config, random_model_gguf};
use crate::engine::{BackendKind, EngineOptions};
use crate::gguf::GgufFile;
use crate::sampler::SamplerConfig;

fn model_bytes() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| random_model_gguf(&demo_config(), 7, Vec::new()).expect("random model"))
}

fn engine(rollback: usize) -> Engine {
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        threads: 2,
        ctx: 256,
        max_batch_tokens: 64,
        rollback,
        ..EngineOptions::default()
    };
    Engine::from_gguf(GgufFile::from_bytes(model_bytes().to_vec()).unwrap(), opts).unwrap()
}

const PROMPT: [u32; 9] = [0, 17, 4242, 99, 1000, 5, 77, 31337, 12];
const N: usize = 20;

/// Plain greedy: the tokens, the session's history and its final logits.
fn plain(e: &mut Engine) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let s = e.create_session();
    let out = e.generate_greedy(s, &PROMPT, N).unwrap();
    (out, e.history(s).unwrap().to_vec(), e.logits(s).unwrap().to_vec())
}

/// Proposes the oracle's tokens with every `every`-th drafted position replaced by a wrong token.
struct Noisy {
    oracle: OracleDrafter,
    every: usize,
    offered: usize,
}

impl Drafter for Noisy {
    fn draft(&mut self, _: &mut Engine, _: SessionId, context: &[u32], k: usize) -> Result<Vec<u32>> {
        let mut d = self.oracle.continuation(context, k);
        for t in d.iter_mut() {
            self.offered += 1;
            if self.offered.is_multiple_of(self.every) {
                *t = (*t + 1) % 1000;
            }
        }
        Ok(d)
    }
}

fn prefilled(e: &mut Engine) -> SessionId {
    let s = e.create_session();
    e.feed(s, &PROMPT).unwrap();
    e.run_until_idle().unwrap();
    s
}

#[test]
fn greedy_speculation_gives_the_plain_greedy_tokens_and_state() {
    let mut e = engine(EngineOptions::DEFAULT_ROLLBACK);
    let (want, want_hist, want_logits) = plain(&mut e);
    let mut full = PROMPT.to_vec();
    full.extend_from_slice(&want);
    for k in [1, 3, 5] {
        for every in [0, 2, 3] {
            let s = prefilled(&mut e);
            let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
            let oracle = OracleDrafter::new(full.clone());
            let (got, stats) = if every == 0 {
                e.generate_speculative(s, &mut sampler, &mut oracle.clone(), k, N).unwrap()
            } else {
                e.generate_speculative(s, &mut sampler, &mut Noisy { oracle, every, offered: 0 }, k, N).unwrap()
            };
            assert_eq!(got, want, "k {k}, noise every {every}");
            assert_eq!(e.history(s).unwrap(), &want_hist[..], "k {k}, noise every {every}: history");
            assert_eq!(e.logits(s).unwrap(), &want_logits[..], "k {k}, noise every {every}: logits");
            assert!(stats.cycles > 0);
            if every == 0 {
                assert_eq!(stats.accepted, stats.drafted, "k {k}: the oracle's drafts all stand");
                // Each cycle commits k + 1 tokens, except near the end where the draft is cut to fit N.
                assert!(stats.cycles <= N.div_ceil(k + 1) + 1, "k {k}: {stats:?}");
            } else {
                assert!(stats.accepted < stats.drafted, "k {k}, noise every {every}: {stats:?}");
            }
            e.free_session(s).unwrap();
        }
    }
}

#[test]
fn auto_pauses_drafts_that_do_not_pay_and_keeps_the_plain_tokens() {
    let mut e = engine(EngineOptions::DEFAULT_ROLLBACK);
    let (want, _, want_logits) = plain(&mut e);
    let mut full = PROMPT.to_vec();
    full.extend_from_slice(&want);
    // Every draft wrong: each verify run delivers one token for a cost of more than one tick (the default cost
    // until a plain tick is measured), so drafting pauses after `AUTO_WINDOW` runs and the rest decodes plainly.
    let s = prefilled(&mut e);
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let mut wrong = Noisy { oracle: OracleDrafter::new(full.clone()), every: 1, offered: 0 };
    let mut pace = Default::default();
    let (got, st) = e.generate_speculative_auto(s, &mut sampler, &mut wrong, 1, N, &mut pace).unwrap();
    assert_eq!(got, want);
    assert_eq!(e.logits(s).unwrap(), &want_logits[..]);
    assert_eq!((st.cycles, st.accepted, st.paused), (auto::AUTO_WINDOW, 0, 1), "{st:?}");
    assert_eq!(st.plain_steps, N - 1 - auto::AUTO_WINDOW, "{st:?}");
    e.free_session(s).unwrap();
    // Drafts that all stand pay: no pause.
    let s = prefilled(&mut e);
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let mut pace = Default::default();
    let (got, st) =
        e.generate_speculative_auto(s, &mut sampler, &mut OracleDrafter::new(full), 3, N, &mut pace).unwrap();
    assert_eq!(got, want);
    assert_eq!((st.paused, st.accepted), (0, st.drafted), "{st:?}");
    e.free_session(s).unwrap();
}

#[test]
fn drafts_longer_than_the_rollback_log_recompute_to_the_same_state() {
    let mut e = engine(EngineOptions::DEFAULT_ROLLBACK);
    let (want, want_hist, want_logits) = plain(&mut e);
    let mut full = PROMPT.to_vec();
    full.extend_from_slice(&want);
    let mut short = engine(1);
    let s = prefilled(&mut short);
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let mut noisy = Noisy { oracle: OracleDrafter::new(full), every: 4, offered: 0 };
    let (got, stats) = short.generate_speculative(s, &mut sampler, &mut noisy, 6, N).unwrap();
    assert!(stats.accepted < stats.drafted);
    assert_eq!(got, want);
    assert_eq!(short.history(s).unwrap(), &want_hist[..]);
    assert_eq!(short.logits(s).unwrap(), &want_logits[..]);
}

#[test]
fn batched_cycles_and_plain_decoding_share_ticks_and_match_each_alone() {
    let mut e = engine(EngineOptions::DEFAULT_ROLLBACK);
    let (want, _, want_logits) = plain(&mut e);
    let mut full = PROMPT.to_vec();
    full.extend_from_slice(&want);
    // Two speculating sessions (one drafts perfectly, one with errors) and one plain decoder, in lockstep.
    let (a, b, c) = (prefilled(&mut e), prefilled(&mut e), prefilled(&mut e));
    let mut samplers: Vec<Sampler> = (0..2).map(|_| Sampler::new(SamplerConfig::greedy()).unwrap()).collect();
    let mut drafters = [
        Noisy { oracle: OracleDrafter::new(full.clone()), every: usize::MAX, offered: 0 },
        Noisy { oracle: OracleDrafter::new(full.clone()), every: 3, offered: 0 },
    ];
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let mut firsts = [0u32; 2];
    for (i, s) in [a, b].into_iter().enumerate() {
        firsts[i] = samplers[i].sample(e.logits(s).unwrap()).unwrap();
        samplers[i].accept(firsts[i]);
        outs[i].push(firsts[i]);
    }
    outs[2].push(crate::engine::argmax(e.logits(c).unwrap()));
    let mut ticks = 0;
    while outs.iter().any(|o| o.len() < N) {
        let drafts: Vec<Vec<u32>> = (0..2)
            .map(|i| {
                let room = N.saturating_sub(outs[i].len() + 1).min(4);
                let mut ctx = e.history([a, b][i]).unwrap().to_vec();
                ctx.push(firsts[i]);
                drafters[i].draft(&mut e, [a, b][i], &ctx, room).unwrap()
            })
            .collect();
        if outs[2].len() < N {
            e.feed(c, &[*outs[2].last().unwrap()]).unwrap();
        }
        let live: Vec<usize> = (0..2).filter(|&i| outs[i].len() < N).collect();
        let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
        let mut cycles: Vec<Cycle<'_>> = Vec::new();
        for (i, s) in refs.drain(..).enumerate() {
            if live.contains(&i) {
                cycles.push(Cycle { session: [a, b][i], first: firsts[i], draft: &drafts[i], sampler: s });
            }
        }
        let res = e.verify_drafts(&mut cycles).unwrap();
        drop(cycles);
        for (&i, v) in live.iter().zip(&res) {
            outs[i].extend_from_slice(&drafts[i][..v.accepted]);
            firsts[i] = v.next;
            samplers[i].accept(v.next);
            outs[i].push(v.next);
        }
        if outs[2].len() < N {
            outs[2].push(crate::engine::argmax(e.logits(c).unwrap()));
        }
        ticks += 1;
        assert!(ticks <= N, "no progress");
    }
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(&o[..N], &want[..], "session {i}");
    }
    assert_eq!(e.logits(c).unwrap(), &want_logits[..]);
}

#[test]
fn sampled_speculation_leaves_the_state_of_its_own_tokens() {
    // With sampling the tokens differ from a plain run (the random stream is consumed differently), but the
    // session's state is exactly that of a cold prefill of what it emitted.
    let mut e = engine(EngineOptions::DEFAULT_ROLLBACK);
    let (want, _, _) = plain(&mut e);
    let mut full = PROMPT.to_vec();
    full.extend_from_slice(&want);
    let s = prefilled(&mut e);
    // A drafter that always offers something: the greedy continuation while the context follows it, else the
    // last token repeated (mostly rejected).
    struct Always(OracleDrafter);
    impl Drafter for Always {
        fn draft(&mut self, _: &mut Engine, _: SessionId, context: &[u32], k: usize) -> Result<Vec<u32>> {
            let d = self.0.continuation(context, k);
            Ok(if d.is_empty() { vec![*context.last().unwrap(); k] } else { d })
        }
    }
    let mut sampler = Sampler::new(SamplerConfig { temperature: 0.7, seed: 3, ..Default::default() }).unwrap();
    let (got, stats) = e.generate_speculative(s, &mut sampler, &mut Always(OracleDrafter::new(full)), 4, N).unwrap();
    assert_eq!(got.len(), N);
    assert!(stats.cycles > 0 && stats.accepted < stats.drafted, "{stats:?}");
    let hist = e.history(s).unwrap().to_vec();
    assert_eq!(&hist[..PROMPT.len()], &PROMPT);
    assert_eq!(&hist[PROMPT.len()..], &got[..N - 1], "every emitted token but the last was fed");
    let cold = e.create_session();
    e.feed(cold, &hist).unwrap();
    e.run_until_idle().unwrap();
    assert_eq!(e.logits(cold).unwrap(), e.logits(s).unwrap());
}

#[test]
fn bad_cycles_are_refused_and_change_nothing() {
    let mut e = engine(EngineOptions::DEFAULT_ROLLBACK);
    let s = prefilled(&mut e);
    let before = (e.position(s).unwrap(), e.logits(s).unwrap().to_vec());
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let vocab = e.config().vocab as u32;
    let bad = [1, vocab];
    let err = e.verify_drafts(&mut [Cycle { session: s, first: 3, draft: &bad, sampler: &mut sampler }]);
    assert!(matches!(err, Err(Error::InvalidArgument(_))), "{err:?}");
    let too_long = vec![1u32; 300];
    let err = e.verify_drafts(&mut [Cycle { session: s, first: 3, draft: &too_long, sampler: &mut sampler }]);
    assert!(matches!(err, Err(Error::ContextOverflow { .. })), "{err:?}");
    e.feed(s, &[5]).unwrap();
    let err = e.verify_drafts(&mut [Cycle { session: s, first: 3, draft: &[1], sampler: &mut sampler }]);
    assert!(matches!(err, Err(Error::InvalidArgument(_))), "{err:?}");
    e.truncate(s, before.0).unwrap();
    assert_eq!((e.position(s).unwrap(), e.pending(s).unwrap()), (before.0, 0));
    assert_eq!(e.logits(s).unwrap(), &before.1[..]);
    let fresh = e.create_session();
    let err = e.verify_drafts(&mut [Cycle { session: fresh, first: 3, draft: &[1], sampler: &mut sampler }]);
    assert!(err.is_err(), "a session without logits cannot verify");
}
