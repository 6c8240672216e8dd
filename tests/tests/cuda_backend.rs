//! The engine's CUDA backend without a GPU: `ds4_engine::backend::cuda::CudaBackend` over
//! [`shim::device::ShimDevice`], whose launches run the CUDA kernel sources compiled for the host (`kernels-native/cuda`,
//! the same launch plans as on the device), on the golden tiny-a checkpoint converted with every quantized recipe:
//! - node by node: every node the backend takes, given the CPU's inputs of a real prefill and decode, writes what
//!   the CPU's kernel writes within the op's documented tolerance (`docs/cuda.md`);
//! - end to end, with the CPU backend beside it for the other ops: the logits of a prefill near the CPU's and the
//!   same argmax almost everywhere (the two sum in other orders, so a near-tie — two experts' router scores, two
//!   logits — can resolve the other way and move what follows), and the placement really put the products, norms
//!   and ropes on the CUDA side.

use ds4_engine::backend::cpu::CpuBackend;
use ds4_engine::backend::cuda::CudaBackend;
use ds4_engine::backend::{Activations, Backend, RopeSet, StepCtx};
use ds4_engine::graph::{Batch, Graph, Op};
use ds4_engine::model::Model;
use ds4_engine::tables::SessionKv;
use ds4_engine::{BackendKind, Engine, EngineOptions};
use ds4_tests::{golden_gguf, ids, max_abs_diff, read_json, row_argmax, shared};

mod shim;

/// Per-node tolerance, relative to the largest |value| the CPU wrote (at least 1): the products sum blocks and
/// lanes in other orders (`docs/cuda.md`: 2·10⁻⁶ of Σ|w·a| per value), RMSNorm within 10⁻⁶, RoPE within 10⁻⁵.
fn node_tol(op: &Op) -> f32 {
    match op {
        Op::Rope { .. } => 5e-6,
        Op::RmsNorm { .. } => 2e-6,
        _ => 1e-5,
    }
}

/// Every node the CUDA backend takes, on the inputs the CPU computed, against the CPU's own kernel: a prefill of
/// 12 tokens and 3 decode ticks of one session on each quantized recipe of tiny-a.
#[test]
fn every_cuda_node_matches_the_cpu_kernel_on_its_inputs() {
    let Some(sh) = shared() else { return };
    let g = read_json(&sh.join("golden/tiny-a/golden.json"));
    let prompt = ids(&g["prompt_tokens"]);
    for recipe in ["q8_0", "q2", "q4"] {
        let gguf = golden_gguf(&sh, "tiny-a", recipe);
        let model = Model::load(ds4_engine::gguf::GgufFile::open(&gguf).unwrap()).unwrap();
        let cpu = CpuBackend::new(2);
        let cuda = CudaBackend::with_device(Box::new(shim::device::ShimDevice::default()), "host shim");
        let rope = RopeSet::new(&model);
        let mut kv = vec![SessionKv::new(&model.config, 64)];
        let mut checked = std::collections::BTreeMap::new();
        let mut graph = Graph::default();
        for t in 0..4 {
            let mut batch = Batch::default();
            match t {
                0 => batch.push_run(0, 0, prompt[..12].iter().copied(), true),
                _ => batch.push_run(0, 11 + t, [prompt[11 + t]], false),
            }
            let mut act = Activations::default();
            act.ensure(&model, batch.rows.len(), batch.logit_rows.len());
            ds4_engine::model::recipe::build(&mut graph, &model, &batch, false);
            let mut cx = StepCtx { model: &model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim: false };
            let c = &model.config;
            for node in &graph.nodes {
                let op = node.op;
                if !cuda.supports(&op, &model) {
                    cpu.run_node(&op, &mut cx).unwrap();
                    continue;
                }
                let mut copy = |b: ds4_engine::graph::BufId| {
                    let w = b.host_width(c).expect("a CUDA node's tensors have a host layout");
                    let mut v = vec![0f32; batch.rows.len() * w];
                    cpu.download(b, &mut cx, &mut v).unwrap();
                    cuda.upload(b, &mut cx, &v).unwrap();
                };
                op.inputs(&mut copy);
                cuda.run_node(&op, &mut cx).unwrap();
                cpu.run_node(&op, &mut cx).unwrap();
                let mut outs = Vec::new();
                op.access(|_| {}, |b| outs.push(b));
                for b in outs {
                    let w = b.host_width(c).unwrap();
                    let (mut want, mut got) = (vec![0f32; batch.rows.len() * w], vec![0f32; batch.rows.len() * w]);
                    cpu.download(b, &mut cx, &mut want).unwrap();
                    cuda.download(b, &mut cx, &mut got).unwrap();
                    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
                    let d = max_abs_diff(&got, &want) / scale;
                    assert!(d <= node_tol(&op), "{recipe} tick {t}: {op:?}: max |Δ| {d} of {scale}");
                    let e = checked.entry(op.name()).or_insert((0usize, 0f32));
                    e.0 += 1;
                    e.1 = e.1.max(d / node_tol(&op));
                }
            }
        }
        eprintln!("{recipe}: (nodes checked, worst |Δ| as a fraction of the tolerance) {checked:?}");
        for kind in ["matmul", "rms_norm", "rope"] {
            assert!(checked.get(kind).map_or(0, |c| c.0) > 0, "{recipe}: no {kind} node ran on cuda");
        }
    }
}

fn engine(path: &std::path::Path, cuda: bool) -> Engine {
    let opts = EngineOptions { exact: true, threads: 2, max_batch_tokens: 16, ..EngineOptions::default() };
    let model = Model::load(ds4_engine::gguf::GgufFile::open(path).unwrap()).unwrap();
    if !cuda {
        return Engine::from_model(model, opts).unwrap();
    }
    let be = CudaBackend::with_device(Box::new(shim::device::ShimDevice::default()), "host shim");
    Engine::with_backend(model, opts, Box::new(be)).unwrap()
}

/// Prefill logits of `prompt` (all positions) and `gen` greedy tokens after it.
fn run(e: &mut Engine, prompt: &[u32], gen: usize) -> (Vec<f32>, Vec<u32>) {
    let s = e.create_session();
    e.set_prefill_logits(s, true).unwrap();
    e.feed(s, prompt).unwrap();
    e.run_until_idle().unwrap();
    let logits = e.take_all_logits(s).unwrap();
    let t = e.create_session();
    let greedy = e.generate_greedy(t, prompt, gen).unwrap();
    (logits, greedy)
}

#[test]
fn cuda_backend_under_the_host_shim_agrees_with_the_cpu() {
    let Some(sh) = shared() else { return };
    let g = read_json(&sh.join("golden/tiny-a/golden.json"));
    let prompt = ids(&g["prompt_tokens"]);
    let prompt = &prompt[..24];
    let vocab = g["vocab_size"].as_u64().unwrap() as usize;
    for recipe in ["q8_0", "q2", "q4"] {
        let gguf = golden_gguf(&sh, "tiny-a", recipe);
        let (want, want_greedy) = run(&mut engine(&gguf, false), prompt, 4);
        let mut e = engine(&gguf, true);
        let (got, greedy) = run(&mut e, prompt, 4);
        let d = max_abs_diff(&got, &want);
        let (a, b) = (row_argmax(&got, vocab), row_argmax(&want, vocab));
        let agree = a.iter().zip(&b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64;
        eprintln!("{recipe}: max |Δlogit| {d}, argmax agreement {agree}, greedy {greedy:?} vs {want_greedy:?}");
        // Near-ties aside (see the module docs), the two agree: a wrong kernel moves every logit by far more.
        assert!(d.is_finite() && d <= 1.0, "{recipe}: cuda vs cpu max |Δlogit| {d}");
        assert!(agree >= 0.9, "{recipe}: argmax agreement {agree}");
        assert_eq!(greedy.len(), want_greedy.len());

        let rep = e.placement_report();
        assert_eq!((rep.primary, rep.fallback), (BackendKind::Cuda, Some(BackendKind::Cpu)), "{recipe}");
        let on =
            |op: &str| rep.nodes.iter().filter(|n| n.key.op.name() == op && n.backend == BackendKind::Cuda).count();
        assert!(on("rms_norm") > 0 && on("rope") > 0, "{recipe}:\n{rep}");
        // q8_0 converts the attention projections to Q8_0; q2/q4 keep some dense ones the kernels take too.
        assert!(on("matmul") > 0, "{recipe}: no product ran on cuda:\n{rep}");
        let c = e.device_counters().unwrap();
        assert!(c.dispatches > 0 && c.device_to_host > 0, "{recipe}: {c:?}");
    }
}

/// A model whose products the kernels cannot take (the f32 recipe) still runs: those nodes go to the CPU, and
/// the logits equal the CPU's up to the norms' and ropes' rounding.
#[test]
fn products_the_kernels_cannot_take_run_on_the_cpu() {
    let Some(sh) = shared() else { return };
    let g = read_json(&sh.join("golden/tiny-a/golden.json"));
    let prompt = ids(&g["prompt_tokens"]);
    let gguf = golden_gguf(&sh, "tiny-a", "f32");
    let (want, _) = run(&mut engine(&gguf, false), &prompt[..8], 0);
    let mut e = engine(&gguf, true);
    let (got, _) = run(&mut e, &prompt[..8], 0);
    let d = max_abs_diff(&got, &want);
    assert!(d <= 1e-3, "f32 recipe: {d}");
    let rep = e.placement_report();
    assert!(rep.nodes.iter().all(|n| n.key.op.name() != "matmul" || n.backend == BackendKind::Cpu), "{rep}");
}
