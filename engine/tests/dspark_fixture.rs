//! The `dspark-tiny` fixture (`tests/data/dspark-tiny`, written by
//! `tools/train_demo/dspark_ref.py --dspark-fixture`): a tiny random V4-Flash-0731 checkpoint (3 trunk layers of
//! window attention, layer 0 hash-routed) with a three-stage DSpark drafter under the official names, plus an
//! independent JAX forward's outputs (float64 on the f32 weights): the trunk's logits, the target features of every
//! position, and for five anchors the block's `x_post`, base logits, Markov-corrected logits, greedy drafts and
//! confidences.
//!
//! Checks here: the converter writes the stages under a trunk layer's names with the recipe's types; the engine's
//! tap features ([`Engine::set_tap_layers`]) and the drafter's outputs ([`DsparkDrafter::propose_many`]) equal the
//! JAX ones within 1e-4 (drafts exactly), alone and batched; and greedy speculation with the drafter gives the
//! plain greedy tokens, and sampled speculation keeps the plain distribution (chi-square).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ds4_engine::convert::{convert, ConvertOptions, Recipe};
use ds4_engine::gguf::GgufFile;
use ds4_engine::speculative::{Drafter, DsparkDrafter, DsparkOptions};
use ds4_engine::{Engine, EngineOptions};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/dspark-tiny")
}

fn fixture_json() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("fixture.json")).unwrap()).unwrap()
}

fn read_f32(name: &str) -> Vec<f32> {
    let p = fixture_dir().join(name);
    std::fs::read(p).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn ints(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The fixture converted with `recipe`, opened by an exact engine (the directory lives as long as the first value).
fn fixture_engine(recipe: Recipe) -> (tempfile::TempDir, Engine) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dspark.gguf");
    let r = convert(&ConvertOptions::new(fixture_dir(), &out, recipe)).unwrap();
    assert!(r.unused.is_empty(), "every checkpoint tensor is converted: {:?}", r.unused);
    let opts = EngineOptions { exact: true, threads: 2, ..EngineOptions::default() };
    (tmp, Engine::from_gguf(GgufFile::open(&out).unwrap(), opts).unwrap())
}

#[test]
fn the_stages_convert_under_a_trunk_layers_names_and_types() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q2.gguf");
    let r = convert(&ConvertOptions::new(fixture_dir(), &out, Recipe::Q2)).unwrap();
    assert!(r.unused.is_empty(), "{:?}", r.unused);
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(f.get_str("deepseek4.revision").unwrap(), "0731");
    let ty: HashMap<&str, _> = f.tensors().iter().map(|t| (t.name.as_str(), t.ty)).collect();
    for s in 0..3 {
        for suffix in
            ["attn_q_a.weight", "attn_kv.weight", "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight"]
        {
            let name = format!("mtp.{s}.{suffix}");
            assert_eq!(ty.get(name.as_str()), ty.get(format!("blk.1.{suffix}").as_str()), "{name}");
        }
    }
    for n in [
        "mtp.0.main_proj.weight",
        "mtp.0.main_norm.weight",
        "mtp.2.norm.weight",
        "mtp.2.hc_head_fn.weight",
        "mtp.2.markov_w1.weight",
        "mtp.2.markov_w2.weight",
        "mtp.2.confidence.weight",
    ] {
        assert!(ty.contains_key(n), "{n}");
    }
    assert!(!ty.contains_key("mtp.1.main_proj.weight") && !ty.contains_key("mtp.0.markov_w1.weight"));
    assert!(!ty.keys().any(|n| n.starts_with("mtp.") && n.contains("attn.wq_a")), "no official stage names left");
}

#[test]
fn target_features_match_the_reference() {
    let (_tmp, mut e) = fixture_engine(Recipe::F32);
    let j = fixture_json();
    let tokens = ints(&j["tokens"]);
    e.set_tap_layers(&ints(&j["target_layer_ids"]).iter().map(|&l| l as usize).collect::<Vec<_>>()).unwrap();
    let s = e.create_session();
    e.set_prefill_logits(s, true).unwrap();
    e.set_keep_hidden(s, tokens.len()).unwrap();
    // Two chunks: the kept rows follow positions across ticks.
    e.feed(s, &tokens[..7]).unwrap();
    e.run_until_idle().unwrap();
    e.feed(s, &tokens[7..]).unwrap();
    e.run_until_idle().unwrap();
    let (from, rows) = e.take_hidden(s).unwrap();
    assert_eq!(from, 0);
    let want = read_f32("features.f32");
    let d = max_diff(&rows, &want);
    eprintln!("max |engine - JAX| feature = {d}");
    assert!(d <= 1e-4, "{d}");
    let logits = e.take_all_logits(s).unwrap();
    let d = max_diff(&logits, &read_f32("trunk_logits.f32"));
    assert!(d <= 1e-4, "trunk logits {d}");
    // A roll back drops the kept rows of the removed positions.
    e.set_keep_hidden(s, tokens.len()).unwrap();
    e.feed(s, &[5, 6]).unwrap();
    e.run_until_idle().unwrap();
    e.rollback(s, tokens.len() + 1).unwrap();
    let (from, rows) = e.take_hidden(s).unwrap();
    assert_eq!((from, rows.len()), (tokens.len(), e.kept_width()));
}

fn check_proposal(p: &ds4_engine::speculative::Proposal, k: usize, j: &serde_json::Value) {
    let (bs, v, d) = (4, 288, 64);
    let part = |name: &str, w: usize| read_f32(name)[k * bs * w..(k + 1) * bs * w].to_vec();
    let dx = max_diff(&p.x_post, &part("x_post.f32", d));
    let db = max_diff(&p.base_logits, &part("base_logits.f32", v));
    let dz = max_diff(&p.logits, &part("markov_logits.f32", v));
    let dc = max_diff(&p.confidence, &read_f32("confidence.f32")[k * bs..(k + 1) * bs]);
    eprintln!("anchor #{k}: x_post {dx}, base {db}, markov {dz}, confidence {dc}");
    for (what, diff) in [("x_post", dx), ("base", db), ("markov", dz), ("confidence", dc)] {
        assert!(diff <= 1e-4, "anchor #{k}: max |engine - JAX| {what} = {diff}");
    }
    assert_eq!(p.tokens, ints(&j["drafts"]["values"][k]), "anchor #{k} drafts");
    assert_eq!(p.cold, 0);
}

#[test]
fn drafter_outputs_match_the_reference_alone_and_batched() {
    let (_tmp, mut e) = fixture_engine(Recipe::F32);
    let j = fixture_json();
    let tokens = ints(&j["tokens"]);
    let anchors: Vec<usize> = ints(&j["anchors"]).iter().map(|&a| a as usize).collect();
    let mut dr = DsparkDrafter::new(e.model(), DsparkOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    assert_eq!(dr.block_size(), 4);
    let mut sessions = Vec::new();
    for (k, &a) in anchors.iter().enumerate() {
        let s = e.create_session();
        dr.attach(&mut e, s).unwrap();
        e.feed(s, &tokens[..a]).unwrap();
        e.run_until_idle().unwrap();
        let p = dr.propose_many(&mut e, &[(s, &tokens[..=a])]).unwrap().pop().unwrap().unwrap();
        check_proposal(&p, k, &j);
        // Drafting again from the same point gives the same block (the track holds only context rows).
        let again = dr.propose_many(&mut e, &[(s, &tokens[..=a])]).unwrap().pop().unwrap().unwrap();
        assert_eq!(again, p);
        sessions.push(s);
    }
    // All anchors in one forward.
    let reqs: Vec<_> = sessions.iter().zip(&anchors).map(|(&s, &a)| (s, &tokens[..=a])).collect();
    let all = dr.propose_many(&mut e, &reqs).unwrap();
    for (k, p) in all.iter().enumerate() {
        check_proposal(p.as_ref().unwrap(), k, &j);
    }
    // A session grown token by token (ticks of one row) from an earlier anchor gives the later anchor's block.
    let s = sessions[1];
    for t in anchors[1]..anchors[2] {
        e.feed(s, &[tokens[t]]).unwrap();
        e.run_until_idle().unwrap();
        let _ = dr.propose_many(&mut e, &[(s, &tokens[..=t + 1])]).unwrap();
    }
    let p = dr.propose_many(&mut e, &[(s, &tokens[..=anchors[2]])]).unwrap().pop().unwrap().unwrap();
    check_proposal(&p, 2, &j);
    // A context the target is not at gets nothing.
    assert!(dr.propose_many(&mut e, &[(s, &tokens[..3])]).unwrap()[0].is_none());
}

/// Greedy decoding with the DSpark drafter gives the plain greedy tokens and logits, at several draft lengths,
/// with and without a confidence cut.
#[test]
fn dspark_speculation_on_the_fixture_is_token_identical_to_plain_greedy() {
    use ds4_engine::sampler::{Sampler, SamplerConfig};
    let (_tmp, mut e) = fixture_engine(Recipe::F32);
    let prompt = ints(&fixture_json()["tokens"]);
    let s = e.create_session();
    let want = e.generate_greedy(s, &prompt, 30).unwrap();
    let want_logits = e.logits(s).unwrap().to_vec();
    let mut d = DsparkDrafter::new(e.model(), DsparkOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    for (k, min) in [(1, 0.0), (2, 0.0), (4, 0.0), (4, 0.3)] {
        d.set_min_confidence(min);
        let t = e.create_session();
        d.attach(&mut e, t).unwrap();
        e.feed(t, &prompt).unwrap();
        e.run_until_idle().unwrap();
        let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
        let (got, st) = e.generate_speculative(t, &mut sampler, &mut d, k, 30).unwrap();
        assert_eq!(got, want, "k {k}, cut {min}");
        assert_eq!(e.logits(t).unwrap(), &want_logits[..], "k {k}, cut {min}");
        if min == 0.0 {
            assert!(st.cycles > 0, "k {k}: {st:?}");
        }
        d.detach(&mut e, t);
    }
}

/// Exact sampling: tokens drawn with DSpark speculation (verified by rejection sampling) have the distribution plain
/// sampling gives ([`common::chi_square_check`]: a two-sample chi-square over 3000 draws each, bound stated there).
#[test]
fn sampled_dspark_speculation_keeps_the_plain_distribution() {
    let (_tmp, e) = fixture_engine(Recipe::F32);
    let prompt: Vec<u32> = ints(&fixture_json()["tokens"]).into_iter().take(6).collect();
    let mut d = DsparkDrafter::new(e.model(), DsparkOptions { min_confidence: 0.0, threads: 1 }).unwrap().unwrap();
    common::chi_square_check(e, &mut d, &prompt, (0.7, 12), (20, 0.5));
}
