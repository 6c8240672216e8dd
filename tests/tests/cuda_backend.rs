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
/// The MoE layer's output (written by `MoeCombine`) within 2·10⁻³: h is re-quantized from values that differ in
/// the last bits, so a quant may round the other way.
fn node_tol(op: &Op) -> f32 {
    match op {
        Op::Rope { .. } => 5e-6,
        Op::RmsNorm { .. } => 2e-6,
        Op::MoeCombine { .. } => 2e-3,
        _ => 1e-5,
    }
}

/// The synthetic tiny model of `ds4-bench --synthetic tiny:layers=3:recipe=RECIPE` (256-wide experts in K-quants,
/// which the CUDA MoE kernels take), written once per recipe.
fn synthetic(recipe: &str) -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    let path = dir.path().join(format!("tiny-{recipe}.gguf"));
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !path.exists() {
        let st = std::process::Command::new(ds4_tests::ds4_bench_bin())
            .args(["--synthetic", &format!("tiny:layers=3:recipe={recipe}"), "--write"])
            .arg(&path)
            .status()
            .unwrap();
        assert!(st.success(), "writing the synthetic {recipe} model");
    }
    path
}

/// The models the node-by-node and end-to-end tests run: tiny-a in the three quantized recipes (MoE on the CPU:
/// its 64-wide experts do not fit the CUDA MoE kernels) and the synthetic tiny model in q2 and q4 (MoE on CUDA).
fn models(sh: &std::path::Path) -> Vec<(String, std::path::PathBuf, bool)> {
    let mut m: Vec<_> =
        ["q8_0", "q2", "q4"].iter().map(|r| (format!("tiny-a {r}"), golden_gguf(sh, "tiny-a", r), false)).collect();
    m.extend(["q2", "q4"].iter().map(|r| (format!("synthetic tiny {r}"), synthetic(r), true)));
    m
}

/// Every node the CUDA backend takes, on the inputs the CPU computed, against the CPU's own kernel: a prefill of
/// 12 tokens and 3 decode ticks of one session on each quantized recipe of tiny-a.
#[test]
fn every_cuda_node_matches_the_cpu_kernel_on_its_inputs() {
    let Some(sh) = shared() else { return };
    let g = read_json(&sh.join("golden/tiny-a/golden.json"));
    let prompt = ids(&g["prompt_tokens"]);
    for (recipe, gguf, moe) in models(&sh) {
        let model = Model::load(ds4_engine::gguf::GgufFile::open(&gguf).unwrap()).unwrap();
        let vocab = model.config.vocab as u32;
        let prompt: Vec<u32> = prompt.iter().map(|&t| t % vocab).collect();
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
            // The last two decode ticks read back only each row's 8 best logits (what a top-k sampler needs).
            batch.candidates = if t >= 2 { 8 } else { 0 };
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
                // Inputs in a host layout come from the CPU; the MoE layer's private ones (routes, expert rows)
                // were written by the previous CUDA node of the layer.
                let mut copy = |b: ds4_engine::graph::BufId| {
                    if let Some(w) = b.host_width(c) {
                        let mut v = vec![0f32; batch.rows.len() * w];
                        cpu.download(b, &mut cx, &mut v).unwrap();
                        cuda.upload(b, &mut cx, &v).unwrap();
                    }
                };
                op.inputs(&mut copy);
                if let Op::Readback { buf } = op {
                    // The host outputs: what the CPU's head wrote (its readback is a no-op) against the CUDA
                    // readback; candidates by value (ids may swap between near-equal logits).
                    let host = |cx: &StepCtx<'_>| match buf {
                        ds4_engine::graph::BufId::Candidates => cx.act.cand_vals[..batch.logit_rows.len() * 8].to_vec(),
                        _ => cx.act.logits[..batch.logit_rows.len() * c.vocab].to_vec(),
                    };
                    let want = host(&cx);
                    cuda.run_node(&op, &mut cx).unwrap();
                    let got = host(&cx);
                    let scale = want.iter().filter(|v| v.is_finite()).fold(1f32, |m, v| m.max(v.abs()));
                    let d = max_abs_diff(&got, &want) / scale;
                    assert!(d <= 1e-5, "{recipe} tick {t}: readback of {buf:?}: max |Δ| {d} of {scale}");
                    let e = checked.entry(op.name()).or_insert((0usize, 0f32));
                    e.0 += 1;
                    e.1 = e.1.max(d / 1e-5);
                    continue;
                }
                cuda.run_node(&op, &mut cx).unwrap();
                cpu.run_node(&op, &mut cx).unwrap();
                let mut outs = Vec::new();
                op.access(|_| {}, |b| outs.extend(b.host_width(c).map(|w| (b, w))));
                for (b, w) in outs {
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
        let kinds: &[&str] = if moe {
            &["matmul", "rms_norm", "rope", "moe_combine", "readback", "hc_sinkhorn", "hc_collapse", "hc_post", "embed"]
        } else {
            &[
                "matmul",
                "rms_norm",
                "rope",
                "readback",
                "hc_sinkhorn",
                "hc_collapse",
                "hc_post",
                "hc_head_weights",
                "embed",
            ]
        };
        for kind in kinds {
            assert!(checked.get(kind).map_or(0, |c| c.0) > 0, "{recipe}: no {kind} node ran on cuda");
        }
    }
}

fn engine(path: &std::path::Path, cuda: bool) -> Engine {
    engine_with(path, cuda, ds4_engine::exec::Placement::default())
}

fn engine_with(path: &std::path::Path, cuda: bool, placement: ds4_engine::exec::Placement) -> Engine {
    let opts = EngineOptions { exact: true, threads: 2, max_batch_tokens: 16, placement, ..EngineOptions::default() };
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
    for (recipe, gguf, moe) in models(&sh) {
        let vocab = Model::load(ds4_engine::gguf::GgufFile::open(&gguf).unwrap()).unwrap().config.vocab;
        let prompt: Vec<u32> = prompt[..24].iter().map(|&t| t % vocab as u32).collect();
        let prompt = &prompt[..];
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
        // The first greedy token comes from the device's candidate selection (k = 1) after the same prefill: it is
        // the argmax of this engine's own last logit row, whatever the CPU's near-ties do.
        assert_eq!(greedy.len(), want_greedy.len());
        assert_eq!(greedy[0] as usize, a[a.len() - 1], "{recipe}: device candidates vs the logit row's argmax");

        let rep = e.placement_report();
        assert_eq!((rep.primary, rep.fallback), (BackendKind::Cuda, Some(BackendKind::Cpu)), "{recipe}");
        let on =
            |op: &str| rep.nodes.iter().filter(|n| n.key.op.name() == op && n.backend == BackendKind::Cuda).count();
        assert!(on("rms_norm") > 0 && on("rope") > 0, "{recipe}:\n{rep}");
        // q8_0 converts the attention projections to Q8_0; q2/q4 keep some dense ones the kernels take too.
        assert!(on("matmul") > 0, "{recipe}: no product ran on cuda:\n{rep}");
        let moe_ops = ["moe_route", "expert_up", "swiglu", "expert_down", "moe_combine"];
        assert!(moe_ops.iter().all(|op| (on(op) > 0) == moe), "{recipe}: MoE on cuda = {moe}:\n{rep}");
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

/// `--backend cuda --placement experts=cpu` (a GPU smaller than the model): the MoE layers on the CPU, everything
/// else the cuda backend takes on the device (mHC included); the logits agree with the CPU's as the all-cuda run's
/// do, and the bytes crossing each way per token are counted.
#[test]
fn experts_on_the_cpu_beside_the_cuda_backend() {
    let Some(sh) = shared() else { return };
    let g = read_json(&sh.join("golden/tiny-a/golden.json"));
    let gguf = synthetic("q4");
    let prompt: Vec<u32> = ids(&g["prompt_tokens"])[..16].iter().map(|&t| t % 1024).collect();
    let (want, _) = run(&mut engine(&gguf, false), &prompt, 0);
    let mut e = engine_with(&gguf, true, ds4_engine::exec::Placement::EXPERTS_ON_CPU);
    let (got, greedy) = run(&mut e, &prompt, 2);
    let d = max_abs_diff(&got, &want);
    assert!(d.is_finite() && d <= 1.0, "max |Δlogit| {d}");
    assert_eq!(greedy.len(), 2);
    let rep = e.placement_report();
    let side = |op: &str| rep.nodes.iter().filter(|n| n.key.op.name() == op).map(|n| n.backend).collect::<Vec<_>>();
    for op in ["moe_route", "expert_up", "swiglu", "expert_down", "moe_combine"] {
        assert!(side(op).iter().all(|&b| b == BackendKind::Cpu) && !side(op).is_empty(), "{op}:\n{rep}");
    }
    assert!(side("hc_post").iter().all(|&b| b == BackendKind::Cuda), "{rep}");
    let c = e.copied_bytes();
    let (up, down) = c.per_row();
    assert!(up > 0.0 && down > 0.0, "{c:?}");
    eprintln!("experts=cpu beside cuda: max |Δlogit| {d}; per token {down} B down, {up} B up");
}
