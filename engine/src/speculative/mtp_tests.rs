//! The MTP drafter on a small random model with an MTP block: lossless, batched, and the incremental drafting
//! computes what one pass over the whole sequence computes.

use super::mtp::{MtpDrafter, MtpOptions};
use super::*;
use crate::convert::{demo_config, random_model_gguf};
use crate::engine::{argmax, EngineOptions};
use crate::gguf::GgufFile;
use crate::sampler::SamplerConfig;

/// A random model of the demo's shape with learned routing on every layer and an MTP block (random weights in every
/// role, which is all these tests need; the forward itself is checked against the training script's JAX in
/// `tests/mtp_fixture.rs`).
pub(crate) fn model_with_mtp() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| {
        let mut cfg = demo_config();
        cfg.n_hash_layers = 0;
        cfg.n_nextn_layers = 1;
        random_model_gguf(&cfg, 11, Vec::new()).unwrap()
    })
}

fn target() -> Engine {
    let opts = EngineOptions { threads: 2, ctx: 256, max_batch_tokens: 64, ..EngineOptions::default() };
    Engine::from_gguf(GgufFile::from_bytes(model_with_mtp().to_vec()).unwrap(), opts).unwrap()
}

const PROMPT: [u32; 9] = [0, 17, 4242, 99, 1000, 5, 77, 31337, 12];
const N: usize = 40;

#[test]
fn the_mtp_block_loads_as_a_one_layer_model() {
    let e = target();
    assert!(e.model().has_mtp());
    let m = e.model().load_mtp().unwrap().unwrap();
    assert_eq!(m.config.n_layers, 1);
    assert_eq!(m.config.compress_ratios, vec![0]);
    assert!(m.mtp_input.is_some() && m.layers[0].tid2eid.is_none());
    let mut g = crate::graph::Graph::default();
    let mut b = crate::graph::Batch::default();
    b.push_run(0, 0, [3u32], false);
    crate::model::recipe::build(&mut g, &m, &b, false);
    assert_eq!(g.nodes[0].op, crate::graph::Op::MtpInput);
    assert!(!g.nodes.iter().any(|n| n.op == crate::graph::Op::Embed));
    // A model without the block has no drafter.
    let plain = Engine::from_gguf(
        GgufFile::from_bytes(random_model_gguf(&demo_config(), 7, Vec::new()).unwrap()).unwrap(),
        EngineOptions { threads: 1, ..EngineOptions::default() },
    )
    .unwrap();
    assert!(!plain.model().has_mtp());
    assert!(MtpDrafter::new(plain.model(), MtpOptions::default()).unwrap().is_none());
}

/// The drafter's logits at every position, computed as drafting computes them (incrementally, window restarts
/// included), equal one pass over the sequence with the target's streams: the definition in the module docs.
#[test]
fn incremental_drafting_equals_the_drafter_over_the_whole_sequence() {
    let mut e = target();
    let s = e.create_session();
    let toks: Vec<u32> = PROMPT.iter().copied().chain((0..24).map(|i| (i * 7919 + 13) % 5000)).collect();
    e.set_keep_hidden(s, usize::MAX).unwrap();
    e.feed(s, &toks).unwrap();
    e.run_until_idle().unwrap();
    let (from, h) = e.take_hidden(s).unwrap();
    let hcd = e.config().hc_dim();
    assert_eq!((from, h.len()), (0, toks.len() * hcd));
    // Reference: the drafter model over the whole sequence at once, input streams H[q-1] (zero at 0).
    let model = e.model().load_mtp().unwrap().unwrap();
    let mut d =
        Engine::from_model(model, EngineOptions { threads: 2, exact: true, ..EngineOptions::default() }).unwrap();
    let ds = d.create_session();
    d.set_prefill_logits(ds, true).unwrap();
    let mut hin = vec![0f32; toks.len() * hcd];
    hin[hcd..].copy_from_slice(&h[..(toks.len() - 1) * hcd]);
    d.feed_with_hidden(ds, &toks, &hin).unwrap();
    d.run_until_idle().unwrap();
    let all = d.take_all_logits(ds).unwrap();
    let vocab = e.config().vocab;
    // Drafting one token at a time at every position from 1: the first draft of each call is the argmax of the
    // reference row at that position (same logits, up to summation order of the chunking).
    let mut dr = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    let t = e.create_session();
    dr.attach(&mut e, t).unwrap();
    e.feed(t, &toks[..1]).unwrap();
    e.run_until_idle().unwrap();
    for q in 1..toks.len() {
        let got = dr.draft(&mut e, t, &toks[..=q], 1).unwrap();
        let row = &all[q * vocab..(q + 1) * vocab];
        assert_eq!(got, vec![argmax(row)], "position {q}");
        e.feed(t, &[toks[q]]).unwrap();
        e.run_until_idle().unwrap();
    }
    assert_eq!(dr.cold_positions, 0, "every input row was the target's");
    // A first draft after a prompt longer than the window starts the drafter a window back (relative positions
    // only): same draft as the whole sequence gives.
    let window = e.config().window;
    assert!(toks.len() > window + 2);
    for q in [window + 1, toks.len() - 1] {
        let u = e.create_session();
        dr.attach(&mut e, u).unwrap();
        e.feed(u, &toks[..q]).unwrap();
        e.run_until_idle().unwrap();
        let got = dr.draft(&mut e, u, &toks[..=q], 1).unwrap();
        assert_eq!(got, vec![argmax(&all[q * vocab..(q + 1) * vocab])], "first draft at {q}");
        dr.detach(&mut e, u);
    }
    assert_eq!(dr.cold_positions, 0);
}

#[test]
fn mtp_speculation_is_lossless_alone_and_batched() {
    let mut e = target();
    let s = e.create_session();
    let want = e.generate_greedy(s, &PROMPT, N).unwrap();
    let want_logits = e.logits(s).unwrap().to_vec();
    let mut dr = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    for k in [1, 2, 4] {
        let s = e.create_session();
        dr.attach(&mut e, s).unwrap();
        e.feed(s, &PROMPT).unwrap();
        e.run_until_idle().unwrap();
        let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
        let (got, stats) = e.generate_speculative(s, &mut sampler, &mut dr, k, N).unwrap();
        assert_eq!(got, want, "k {k}");
        assert_eq!(e.logits(s).unwrap(), &want_logits[..], "k {k}");
        assert!(stats.cycles > 0 && stats.drafted > 0, "k {k}: {stats:?}");
        dr.detach(&mut e, s);
        e.free_session(s).unwrap();
    }
    // Two sessions drafting in shared ticks get what each gets alone.
    let (a, b) = (e.create_session(), e.create_session());
    for x in [a, b] {
        dr.attach(&mut e, x).unwrap();
    }
    e.feed(a, &PROMPT).unwrap();
    e.feed(b, &PROMPT[..5]).unwrap();
    e.run_until_idle().unwrap();
    let ca: Vec<u32> = PROMPT.iter().copied().chain([7]).collect();
    let cb: Vec<u32> = PROMPT[..5].iter().copied().chain([9]).collect();
    let together = dr.draft_many(&mut e, &[(a, &ca, 3), (b, &cb, 3)]).unwrap();
    let mut solo = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    let (a2, b2) = (e.create_session(), e.create_session());
    for x in [a2, b2] {
        solo.attach(&mut e, x).unwrap();
    }
    e.feed(a2, &PROMPT).unwrap();
    e.feed(b2, &PROMPT[..5]).unwrap();
    e.run_until_idle().unwrap();
    assert_eq!(together[0], solo.draft(&mut e, a2, &ca, 3).unwrap());
    assert_eq!(together[1], solo.draft(&mut e, b2, &cb, 3).unwrap());
    assert_eq!(together[0].len(), 3);
}

#[test]
fn a_confidence_cut_off_shortens_drafts() {
    let mut e = target();
    let mut dr = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 1.1, threads: 2 }).unwrap().unwrap();
    let s = e.create_session();
    dr.attach(&mut e, s).unwrap();
    e.feed(s, &PROMPT).unwrap();
    e.run_until_idle().unwrap();
    let ctx: Vec<u32> = PROMPT.iter().copied().chain([7]).collect();
    assert!(dr.draft(&mut e, s, &ctx, 4).unwrap().is_empty(), "no probability reaches 1.1");
    dr.set_min_confidence(0.0);
    assert_eq!(dr.draft(&mut e, s, &ctx, 4).unwrap().len(), 4);
}
