//! End-to-end check of [`WgpuBackend`] on the tiny-a golden checkpoint (f32 recipe): logits from a chunked
//! prefill and from token-by-token decode must match the reference implementation's within 1e-3, driving the
//! backend through the engine's own node graph and executor. Skipped (with a message) when `../shared` is absent
//! outside CI or when no adapter exists outside CI.

use std::path::PathBuf;

use super::context::test_context;
use super::WgpuBackend;
use crate::backend::{Activations, RopeSet, StepCtx};
use crate::convert::{convert, ConvertOptions, Recipe};
use crate::exec::Executor;
use crate::gguf::GgufFile;
use crate::graph::{Batch, Graph, Row, Run};
use crate::model::Model;
use crate::tables::SessionKv;

fn golden_dir() -> Option<PathBuf> {
    crate::testdata::shared("golden/tiny-a", "model.safetensors")
}

fn read_f32(path: PathBuf) -> Vec<f32> {
    let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Runs `tokens` (positions `pos0..`) as one batch; returns logits of every row.
fn run_chunk(
    be: &WgpuBackend,
    model: &Model,
    rope: &RopeSet,
    kv: &mut SessionKv,
    act: &mut Activations,
    tokens: &[u32],
    pos0: usize,
) -> Vec<f32> {
    let n = tokens.len();
    let batch = Batch {
        rows: tokens.iter().enumerate().map(|(i, &t)| Row { run: 0, pos: pos0 + i, token: t }).collect(),
        runs: vec![Run { slot: 0, start: 0, len: n, all_logits: true }],
        logit_rows: (0..n).collect(),
        candidates: 0,
    };
    act.ensure(model, n, n);
    let mut graph = Graph::default();
    crate::model::recipe::build(&mut graph, model, &batch, false);
    let mut cx = StepCtx { model, rope, batch: &batch, kv: std::slice::from_mut(kv), act, sim: false };
    Executor::default().run(&graph, be, &mut cx).expect("tick");
    act.logits[..n * model.config.vocab].to_vec()
}

#[test]
fn tiny_a_logits_match_golden_prefill_and_decode() {
    let Some(dir) = golden_dir() else { return };
    let Some(ctx) = test_context(Default::default()) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny-a.gguf");
    convert(&ConvertOptions::new(&dir, &out, Recipe::F32)).expect("convert tiny-a");
    let model = Model::load(GgufFile::open(&out).unwrap()).unwrap();
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let prompt: Vec<u32> =
        golden["prompt_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let greedy: Vec<u32> =
        golden["greedy_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let prefill = read_f32(dir.join("prefill_logits.f32"));
    let decode = read_f32(dir.join("decode_logits.f32"));
    let v = model.config.vocab;
    let be = WgpuBackend::with_context(ctx);
    let rope = RopeSet::new(&model);
    let mut kv = SessionKv::new(&model.config, prompt.len() + greedy.len() + 1);
    let mut act = Activations::default();

    // Prefill in two uneven chunks (the second one crosses compressor blocks and the window).
    let cut = prompt.len() * 2 / 5;
    let mut got = run_chunk(&be, &model, &rope, &mut kv, &mut act, &prompt[..cut], 0);
    got.extend(run_chunk(&be, &model, &rope, &mut kv, &mut act, &prompt[cut..], cut));
    let max_err = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert_eq!(got.len(), prefill.len());
    let e = max_err(&got, &prefill);
    assert!(e <= 1e-3, "prefill max |logit - golden| = {e}");

    // Decode the greedy continuation token by token (row i = logits after greedy[..i]).
    let steps = greedy.len().min(decode.len() / v).min(4);
    let last = &got[(prompt.len() - 1) * v..prompt.len() * v];
    assert!(max_err(last, &decode[..v]) <= 1e-3, "decode row 0");
    for i in 1..steps {
        let l = run_chunk(&be, &model, &rope, &mut kv, &mut act, &greedy[i - 1..i], prompt.len() + i - 1);
        let e = max_err(&l, &decode[i * v..(i + 1) * v]);
        assert!(e <= 1e-3, "decode row {i}: max err {e}");
        assert_eq!(crate::engine::argmax(&l), greedy[i], "greedy token {i}");
    }
}

/// Runs `prompt` through `backend` as one prefill batch; logits of every row.
fn prefill_with(be: &dyn crate::backend::Backend, model: &Model, prompt: &[u32]) -> Vec<f32> {
    let rope = RopeSet::new(model);
    let mut kv = SessionKv::new(&model.config, prompt.len() + 1);
    let mut act = Activations::default();
    let n = prompt.len();
    let batch = Batch {
        rows: prompt.iter().enumerate().map(|(i, &t)| Row { run: 0, pos: i, token: t }).collect(),
        runs: vec![Run { slot: 0, start: 0, len: n, all_logits: true }],
        logit_rows: (0..n).collect(),
        candidates: 0,
    };
    act.ensure(model, n, n);
    let mut graph = Graph::default();
    crate::model::recipe::build(&mut graph, model, &batch, false);
    let mut cx =
        StepCtx { model, rope: &rope, batch: &batch, kv: std::slice::from_mut(&mut kv), act: &mut act, sim: false };
    Executor::default().run(&graph, be, &mut cx).expect("tick");
    act.logits[..n * model.config.vocab].to_vec()
}

/// The quantized recipes (Q8_0 projections, IQ2_XXS/Q2_K or Q4_K experts) through both backends, exact mode.
///
/// Against the CPU with `f32_acts` (quantized weights times f32 activations, as the WGSL kernels compute) the
/// two differ by f32 summation order only: max |Δlogit| ≤ 1e-3 (the f32 recipe's bound; measured ≤ 4e-6) and the
/// same argmax everywhere. An error in a quant decoder shows up as O(0.1–1) differences.
///
/// Against the default CPU, which quantizes activations to Q8_0/Q8_K for its integer dots (~1e-4 relative error
/// per matrix, see `matmul.rs`' accuracy tests), they differ by that noise carried through the layers, and at a few
/// positions by a discrete choice the noise flips (a router's top-k expert or an indexer's selected rows), which
/// moves that position's logits by O(1) and leaves its neighbours alone. So per position: the largest |Δlogit| is
/// ≤ 0.3 on all but 10% of the positions (measured 0.05–0.17 for Q2 and Q4; two Q4 positions flip, 0.66 and 1.15),
/// the rms over those positions is ≤ 0.05 (measured 0.015–0.03; logit std ≈ 1), and the argmax agrees on ≥ 90%.
/// (Q8_0 is left out here: its choices flip at more positions under that noise.)
#[test]
fn quantized_recipes_agree_with_cpu_backend() {
    let Some(dir) = golden_dir() else { return };
    let Some(ctx) = test_context(Default::default()) else { return };
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let prompt: Vec<u32> =
        golden["prompt_tokens"].as_array().unwrap().iter().take(24).map(|v| v.as_u64().unwrap() as u32).collect();
    let be = WgpuBackend::with_context(ctx);
    let cpu = crate::backend::cpu::CpuBackend::new(2);
    let cpu_f32 = crate::backend::cpu::CpuBackend::new(2).with_f32_acts(true);
    let tmp = tempfile::tempdir().unwrap();
    for recipe in [Recipe::Q8_0, Recipe::Q2, Recipe::Q4] {
        let out = tmp.path().join(format!("tiny-a-{recipe:?}.gguf"));
        convert(&ConvertOptions::new(&dir, &out, recipe)).expect("convert tiny-a");
        let model = Model::load(GgufFile::open(&out).unwrap()).unwrap();
        let v = model.config.vocab;
        let a = prefill_with(&be, &model, &prompt);
        let stats = |b: &[f32]| {
            let err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            let same = (0..prompt.len())
                .filter(|&r| {
                    crate::engine::argmax(&a[r * v..(r + 1) * v]) == crate::engine::argmax(&b[r * v..(r + 1) * v])
                })
                .count();
            let rms = (a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>() / a.len() as f64).sqrt();
            (err, rms, same)
        };
        let (err, rms, same) = stats(&prefill_with(&cpu_f32, &model, &prompt));
        eprintln!("{recipe:?}: max |wgpu - cpu f32_acts| = {err}, rms {rms}, argmax agree {same}/{}", prompt.len());
        assert!(err <= 1e-3, "{recipe:?}: max |wgpu - cpu f32_acts| = {err}");
        assert_eq!(same, prompt.len(), "{recipe:?}: argmax vs cpu f32_acts");
        if recipe != Recipe::Q8_0 {
            let q = prefill_with(&cpu, &model, &prompt);
            let rows = |r: usize| a[r * v..(r + 1) * v].iter().zip(&q[r * v..(r + 1) * v]);
            let per_pos: Vec<f32> =
                (0..prompt.len()).map(|r| rows(r).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)).collect();
            let steady: Vec<usize> = (0..prompt.len()).filter(|&r| per_pos[r] <= 0.3).collect();
            let sq: f64 = steady.iter().flat_map(|&r| rows(r)).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let rms = (sq / (steady.len() * v).max(1) as f64).sqrt();
            let (_, _, same) = stats(&q);
            eprintln!(
                "{recipe:?}: max |wgpu - cpu| per position {per_pos:?}; rms over the {} steady positions {rms}, \
                 argmax agree {same}/{}",
                steady.len(),
                prompt.len()
            );
            assert!(steady.len() * 10 >= prompt.len() * 9, "{recipe:?}: max |wgpu - cpu| per position {per_pos:?}");
            assert!(rms <= 0.05, "{recipe:?}: rms |wgpu - cpu| over steady positions = {rms}");
            assert!(same * 10 >= prompt.len() * 9, "{recipe:?}: argmax agrees on {same}/{}", prompt.len());
        }
        be.clear_weights();
    }
}

/// The f32 tiny-a prefill with a 64 KiB binding limit: the embedding, head, expert and projection weights are all
/// split across several bindings (experts on expert boundaries), and the logits still match golden within 1e-3.
#[test]
fn tiny_a_with_split_weights_matches_golden() {
    let Some(dir) = golden_dir() else { return };
    let opts = super::ContextOptions { max_binding_override: Some(64 * 1024), ..Default::default() };
    let Some(ctx) = test_context(opts) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny-a.gguf");
    convert(&ConvertOptions::new(&dir, &out, Recipe::F32)).expect("convert tiny-a");
    let model = Model::load(GgufFile::open(&out).unwrap()).unwrap();
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let prompt: Vec<u32> =
        golden["prompt_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let be = WgpuBackend::with_context(ctx);
    let got = prefill_with(&be, &model, &prompt);
    let prefill = read_f32(dir.join("prefill_logits.f32"));
    let e = got.iter().zip(&prefill).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(e <= 1e-3, "prefill with split weights: max err {e}");
    let head = be.weight_chunks(&model, model.global.head).unwrap();
    let experts = be.weight_chunks(&model, model.layers[0].gate_exps).unwrap();
    assert!(head > 1 && experts > 1, "weights were not split: head {head} chunks, experts {experts} chunks");
}
