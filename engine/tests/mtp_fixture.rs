//! The `mtp-tiny` fixture (`tests/data/mtp-tiny`, written by `tools/train_demo/train.py --fixture`): a tiny random
//! DeepSeek-V4 checkpoint in the official layout (f32, 2 layers of compress ratio 0, layer 0 hash-routed) with an
//! April-style MTP block `mtp.0.*`, plus the logits of the training script's JAX forward pass (float64 on the f32
//! weights) for a 20-token prompt longer than the 8-token window: `trunk_logits.f32` and `mtp_logits.f32` (`[T, vocab]`
//! each, MTP logits at every position q from token q and the trunk's final mHC streams at q-1).
//!
//! Checks here: the converter writes the MTP block under the names the reference C engine binds, with reversed dims,
//! identical f32 bytes and the types a trunk layer's tensors get; a copy without the block converts exactly as before
//! (no `mtp.*`, no `nextn_predict_layers`); the engine's trunk logits and its MTP drafter's logits
//! (`Model::load_mtp`) equal the JAX ones within 1e-4 — which ties the training script's model to the engine's; and
//! speculation with the drafter is lossless (greedy: token-identical; sampled: a chi-square against plain sampling,
//! also on the trained demo model).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ds4_engine::convert::{convert, ConvertOptions, Recipe};
use ds4_engine::gguf::GgufFile;
use ds4_engine::{Engine, EngineOptions};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/mtp-tiny")
}

fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn fixture_json() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("fixture.json")).unwrap()).unwrap()
}

/// The GGUF name of an official `mtp.0.*` tensor (independent of the converter's tables; experts map to their
/// stacked tensor).
fn mtp_gguf_name(official: &str) -> String {
    let x = official.strip_prefix("mtp.0.").expect("an mtp.0 tensor");
    let own = [
        ("e_proj.weight", "e_proj.weight"),
        ("h_proj.weight", "h_proj.weight"),
        ("enorm.weight", "enorm.weight"),
        ("hnorm.weight", "hnorm.weight"),
        ("norm.weight", "norm.weight"),
        ("hc_head_fn", "hc_head_fn.weight"),
        ("hc_head_base", "hc_head_base.weight"),
        ("hc_head_scale", "hc_head_scale.weight"),
    ];
    // The block's own tensors, then those it has as any trunk layer has them.
    if let Some((_, g)) = own.iter().chain(common::LAYER_NAMES).find(|(o, _)| *o == x) {
        return format!("mtp.0.{g}");
    }
    let e = x.strip_prefix("ffn.experts.").expect("an expert tensor");
    let w = e.split('.').nth(1).unwrap();
    let g = match w {
        "w1" => "ffn_gate_exps.weight",
        "w3" => "ffn_up_exps.weight",
        "w2" => "ffn_down_exps.weight",
        _ => panic!("{official}"),
    };
    format!("mtp.0.{g}")
}

fn run_logits(file: GgufFile, prompt: &[u32]) -> Vec<f32> {
    let opts = EngineOptions { exact: true, threads: 2, ..EngineOptions::default() };
    let mut e = Engine::from_gguf(file, opts).unwrap();
    let s = e.create_session();
    e.set_prefill_logits(s, true).unwrap();
    e.feed(s, prompt).unwrap();
    e.run_until_idle().unwrap();
    e.take_all_logits(s).unwrap()
}

/// The fixture converted with the f32 recipe, opened by an engine with `threads` threads in exact mode (the
/// directory holding the file lives as long as the first value).
fn fixture_engine(threads: usize) -> (tempfile::TempDir, Engine) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("mtp.gguf");
    convert(&ConvertOptions::new(fixture_dir(), &out, Recipe::F32)).unwrap();
    let opts = EngineOptions { exact: true, threads, ..EngineOptions::default() };
    let e = Engine::from_gguf(GgufFile::open(&out).unwrap(), opts).unwrap();
    (tmp, e)
}

fn prompt() -> Vec<u32> {
    fixture_json()["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn the_mtp_block_converts_under_the_c_engine_names() {
    let dir = fixture_dir();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("mtp.gguf");
    let r = convert(&ConvertOptions::new(&dir, &out, Recipe::F32)).unwrap();
    assert!(r.unused.is_empty(), "every checkpoint tensor is converted: {:?}", r.unused);
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(f.get_usize("deepseek4.nextn_predict_layers").unwrap(), 1);
    assert_eq!(f.get_usize("deepseek4.block_count").unwrap(), 2);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let n_experts = fixture_config()["n_routed_experts"].as_u64().unwrap() as usize;
    let by_name: HashMap<&str, _> = f.tensors().iter().map(|t| (t.name.as_str(), t)).collect();
    let mut seen = 0;
    for (name, view) in st.tensors() {
        if !name.starts_with("mtp.") {
            continue;
        }
        seen += 1;
        let g = mtp_gguf_name(&name);
        let t = by_name.get(g.as_str()).unwrap_or_else(|| panic!("{name} -> {g} missing"));
        assert_eq!(t.ty, ds4_engine::quant::GgmlType::F32, "{g}");
        let mut dims: Vec<u64> = view.shape().iter().rev().map(|&d| d as u64).collect();
        let data = f.view(t).data;
        if let Some(rest) = name.strip_prefix("mtp.0.ffn.experts.") {
            dims.push(n_experts as u64);
            let e: usize = rest.split('.').next().unwrap().parse().unwrap();
            let n = view.data().len();
            assert_eq!(&data[e * n..(e + 1) * n], view.data(), "{name} in {g}");
        } else {
            assert_eq!(data, view.data(), "{g} holds {name}'s bytes");
        }
        assert_eq!(t.dims, dims, "{g}");
    }
    assert!(seen > 40, "the fixture has an MTP block ({seen} tensors)");
    let mtp_names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).filter(|n| n.starts_with("mtp.")).collect();
    for n in [
        "mtp.0.e_proj.weight",
        "mtp.0.h_proj.weight",
        "mtp.0.enorm.weight",
        "mtp.0.hnorm.weight",
        "mtp.0.norm.weight",
        "mtp.0.hc_head_fn.weight",
        "mtp.0.hc_head_base.weight",
        "mtp.0.hc_head_scale.weight",
        "mtp.0.attn_q_a.weight",
        "mtp.0.ffn_gate_inp.weight",
        "mtp.0.exp_probs_b.bias",
        "mtp.0.ffn_gate_exps.weight",
        "mtp.0.hc_attn_fn.weight",
    ] {
        assert!(mtp_names.contains(&n), "{n} missing from {mtp_names:?}");
    }
    assert!(!mtp_names.iter().any(|n| n.contains("tid2eid")), "the MTP block routes by its learned gate");

    // Under a quantizing recipe each block tensor gets the type a (learned-routing, ratio-0) trunk layer's tensor of
    // the same name gets; e_proj/h_proj are typed as attention projections.
    let q = tmp.path().join("q2.gguf");
    convert(&ConvertOptions::new(&dir, &q, Recipe::Q2)).unwrap();
    let f = GgufFile::open(&q).unwrap();
    let ty: HashMap<&str, _> = f.tensors().iter().map(|t| (t.name.as_str(), t.ty)).collect();
    for t in f.tensors().iter().filter(|t| t.name.starts_with("mtp.0.")) {
        let suffix = &t.name["mtp.0.".len()..];
        let trunk = ty.get(format!("blk.1.{suffix}").as_str()).copied().or_else(|| match suffix {
            "e_proj.weight" | "h_proj.weight" => ty.get("blk.1.attn_output_b.weight").copied(),
            "hc_head_fn.weight" => ty.get("output_hc_fn.weight").copied(),
            "hc_head_base.weight" => ty.get("output_hc_base.weight").copied(),
            "hc_head_scale.weight" => ty.get("output_hc_scale.weight").copied(),
            _ => ty.get("output_norm.weight").copied(),
        });
        assert_eq!(Some(t.ty), trunk, "{}", t.name);
    }
}

fn fixture_config() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("config.json")).unwrap()).unwrap()
}

/// The fixture without its MTP block (`num_nextn_predict_layers` as `nextn`), written into `dst`.
fn strip_mtp(dst: &Path, nextn: u64) {
    let dir = fixture_dir();
    let mut cfg = fixture_config();
    cfg.as_object_mut().unwrap().insert("num_nextn_predict_layers".into(), nextn.into());
    std::fs::create_dir_all(dst).unwrap();
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| !n.starts_with("mtp.")).map(|(n, v)| (n.to_string(), v)).collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}

#[test]
fn a_checkpoint_without_an_mtp_block_converts_as_before() {
    let tmp = tempfile::tempdir().unwrap();
    let with = tmp.path().join("with.gguf");
    convert(&ConvertOptions::new(fixture_dir(), &with, Recipe::F32)).unwrap();
    let with = GgufFile::open(&with).unwrap();
    for nextn in [0, 1] {
        // nextn 1: config.json declares the block but the checkpoint lacks it: trunk only.
        let ck = tmp.path().join(format!("trunk{nextn}"));
        strip_mtp(&ck, nextn);
        let out = tmp.path().join(format!("trunk{nextn}.gguf"));
        let r = convert(&ConvertOptions::new(&ck, &out, Recipe::F32)).unwrap();
        assert!(r.unused.is_empty(), "{:?}", r.unused);
        let f = GgufFile::open(&out).unwrap();
        assert!(f.get("deepseek4.nextn_predict_layers").is_none());
        assert!(f.tensors().iter().all(|t| !t.name.starts_with("mtp.")));
        let trunk: Vec<_> = with.tensors().iter().filter(|t| !t.name.starts_with("mtp.")).collect();
        assert_eq!(f.tensors().len(), trunk.len());
        for (a, b) in f.tensors().iter().zip(trunk) {
            assert_eq!((&a.name, a.ty, &a.dims), (&b.name, b.ty, &b.dims));
            assert!(f.view(a).data == with.view(b).data, "{}", a.name);
        }
    }
}

#[test]
fn engine_trunk_logits_match_the_training_scripts_jax_forward() {
    let dir = fixture_dir();
    let meta = fixture_json();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("mtp.gguf");
    convert(&ConvertOptions::new(&dir, &out, Recipe::F32)).unwrap();
    let prompt = prompt();
    let vocab = meta["vocab_size"].as_u64().unwrap() as usize;
    let window = fixture_config()["sliding_window"].as_u64().unwrap() as usize;
    assert!(prompt.len() > window, "the prompt outruns the window");
    let got = run_logits(GgufFile::open(&out).unwrap(), &prompt);
    let want = read_f32(&dir.join("trunk_logits.f32"));
    assert_eq!(want.len(), prompt.len() * vocab);
    assert_eq!(got.len(), want.len());
    let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let std = (want.iter().map(|x| x * x).sum::<f32>() / want.len() as f32).sqrt();
    eprintln!("max |engine - JAX| trunk logit = {diff} (logit rms {std})");
    assert!(diff <= 1e-4, "max |engine - JAX| trunk logit = {diff} (logit rms {std})");
}

/// The engine's MTP drafter (`Model::load_mtp`: the block as a one-layer model whose first stage takes the token and
/// the trunk's final streams of the previous position) against the JAX MTP logits at every position.
#[test]
fn engine_mtp_logits_match_the_training_scripts_jax_forward() {
    let dir = fixture_dir();
    let meta = fixture_json();
    let (_tmp, mut e) = fixture_engine(2);
    let prompt = prompt();
    let vocab = meta["vocab_size"].as_u64().unwrap() as usize;
    let opts = EngineOptions { exact: true, threads: 2, ..EngineOptions::default() };
    assert_eq!(e.config().vocab, vocab);
    let s = e.create_session();
    e.set_keep_hidden(s, usize::MAX).unwrap();
    e.feed(s, &prompt).unwrap();
    e.run_until_idle().unwrap();
    let (from, h) = e.take_hidden(s).unwrap();
    let hcd = e.config().hc_dim();
    assert_eq!((from, h.len()), (0, prompt.len() * hcd));
    let mut d = Engine::from_model(e.model().load_mtp().unwrap().expect("the fixture has an MTP block"), opts).unwrap();
    let ds = d.create_session();
    d.set_prefill_logits(ds, true).unwrap();
    let mut input = vec![0f32; prompt.len() * hcd];
    input[hcd..].copy_from_slice(&h[..(prompt.len() - 1) * hcd]);
    d.feed_with_hidden(ds, &prompt, &input).unwrap();
    d.run_until_idle().unwrap();
    let got = d.take_all_logits(ds).unwrap();
    let want = read_f32(&dir.join("mtp_logits.f32"));
    assert_eq!(got.len(), want.len());
    let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let std = (want.iter().map(|x| x * x).sum::<f32>() / want.len() as f32).sqrt();
    eprintln!("max |engine - JAX| MTP logit = {diff} (logit rms {std})");
    assert!(std > 0.1, "the reference logits are not degenerate");
    assert!(diff <= 1e-4, "max |engine - JAX| MTP logit = {diff} (logit rms {std})");
}

/// On the fixture model, greedy decoding with the MTP drafter gives the plain greedy tokens, session state included,
/// at several draft lengths.
#[test]
fn mtp_speculation_on_the_fixture_is_token_identical_to_plain_greedy() {
    use ds4_engine::sampler::{Sampler, SamplerConfig};
    use ds4_engine::speculative::{Drafter, MtpDrafter, MtpOptions};
    let (_tmp, mut e) = fixture_engine(2);
    let prompt = prompt();
    let s = e.create_session();
    let want = e.generate_greedy(s, &prompt, 30).unwrap();
    let want_logits = e.logits(s).unwrap().to_vec();
    let mut d = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    for k in [1, 2, 4] {
        let t = e.create_session();
        d.attach(&mut e, t).unwrap();
        e.feed(t, &prompt).unwrap();
        e.run_until_idle().unwrap();
        let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
        let (got, st) = e.generate_speculative(t, &mut sampler, &mut d, k, 30).unwrap();
        assert_eq!(got, want, "k {k}");
        assert_eq!(e.logits(t).unwrap(), &want_logits[..], "k {k}");
        assert!(st.cycles > 0, "k {k}: {st:?}");
        d.detach(&mut e, t);
    }
}

/// Exact sampling: tokens drawn with MTP speculation (verified by rejection sampling) have the distribution plain
/// sampling gives ([`common::chi_square_check`]: a two-sample chi-square over 3000 draws each, bound stated there).
#[test]
fn sampled_mtp_speculation_keeps_the_plain_distribution() {
    use ds4_engine::speculative::{MtpDrafter, MtpOptions};
    // The fixture (a random MTP block: drafts mostly fall) and the trained demo model (drafts often stand), so both
    // paths of the verification carry weight.
    let (_tmp, e) = fixture_engine(1);
    let mut d = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 0.0, threads: 1 }).unwrap().unwrap();
    common::chi_square_check(e, &mut d, &prompt()[..6], (0.7, 12), (20, 0.5));
    let file = || GgufFile::from_bytes(ds4_engine::convert::trained_demo_gguf().to_vec()).unwrap();
    let demo = Engine::from_gguf(file(), EngineOptions { threads: 1, ..EngineOptions::default() }).unwrap();
    let tok = ds4_engine::tokenizer::Tokenizer::from_gguf(&file()).unwrap();
    let p = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Return the number of items.<｜Assistant｜></think>").unwrap();
    let mut d = MtpDrafter::new(demo.model(), MtpOptions { min_confidence: 0.0, threads: 1 }).unwrap().unwrap();
    common::chi_square_check(demo, &mut d, &p, (1.6, 40), (1000, 1.0));
}
