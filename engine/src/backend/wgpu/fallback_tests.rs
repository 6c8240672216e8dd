//! The executor's seams on a device backend, on the demo model: every host sync of a wgpu tick is a readback node
//! of its graph, and op kinds forced to the CPU as host fallback run there with copies exactly where a tensor's
//! residency changes. Skipped like the other wgpu tests when no adapter is found outside CI.

use super::context::test_context;
use super::WgpuBackend;
use crate::backend::cpu::CpuBackend;
pub(super) use crate::exec::testing::{demo, ticks};
use crate::exec::Executor;
use crate::graph::{Graph, Op};

fn readback_nodes(g: &Graph) -> u64 {
    g.nodes.iter().filter(|n| matches!(n.op, Op::Readback { .. })).count() as u64
}

/// Every submission and readback of a tick is a readback node of its graph, and the logits' is the only one: a
/// prefill batch groups its MoE rows by expert on the device, as a decode tick reads its experts there.
#[test]
fn every_host_sync_of_a_tick_is_a_readback_node() {
    let Some(ctx) = test_context(Default::default()) else { return };
    let model = demo();
    let be = WgpuBackend::with_context(ctx);
    let c = &model.config;
    let learned = model.layers.iter().filter(|l| l.tid2eid.is_none()).count() as u64;
    assert!(learned > 0, "the demo model has learned-routing layers");
    let mut ex = Executor::default();
    // The largest batch laid out per row, and the smallest gathered by expert (decode ticks follow each).
    for n in [c.n_experts / c.n_experts_used, c.n_experts / c.n_experts_used + 1] {
        let mut before = be.context().counters();
        let mut syncs = Vec::new();
        ticks(&model, &be, None, &mut ex, n, 1, |g, _| {
            let now = be.context().counters();
            let d = now - before;
            before = now;
            syncs.push((readback_nodes(g), d.readbacks, d.submits));
        })
        .unwrap();
        for (t, &(nodes, readbacks, submits)) in syncs.iter().enumerate() {
            assert_eq!((readbacks, submits), (nodes, nodes), "{n} rows, tick {t}");
        }
        assert_eq!(syncs[0].0, 1, "{n}-row prefill");
        assert!(syncs[1..].iter().all(|s| s.0 == 1), "decode ticks read back the logits only");
    }
}

/// Op kinds forced to the CPU (the host fallback) give logits within the cross-backend tolerance of the all-wgpu
/// run; the executor inserts exactly the copies the residency changes need (each download is one wgpu readback);
/// with nothing forced it copies nothing; a node on the KV pages cannot leave the device.
#[test]
fn forced_fallback_nodes_copy_only_where_residency_changes() {
    let Some(ctx) = test_context(Default::default()) else { return };
    let model = demo();
    let be = WgpuBackend::with_context(ctx);
    let cpu = CpuBackend::new(2);
    let mut ex = Executor::default();
    let mut copies = Vec::new();
    let want = ticks(&model, &be, Some(&cpu), &mut ex, 7, 1, |_, ex| copies.push(ex.copies())).unwrap();
    assert_eq!(copies, vec![0; 2], "nothing forced: nothing copied");
    assert_eq!(ex.placed().fallback, 0);

    let kind = |name: &str| Op::KINDS.iter().position(|k| *k == name).unwrap();
    let forced = [kind("rms_norm"), kind("hc_sinkhorn"), kind("rope")];
    let mut ex = Executor::default();
    for &k in &forced {
        ex.force_fallback(k, true);
    }
    let mut before = be.context().counters();
    let mut seen = Vec::new();
    let got = ticks(&model, &be, Some(&cpu), &mut ex, 7, 1, |g, ex| {
        let now = be.context().counters();
        let d = now - before;
        before = now;
        let on_cpu = g.nodes.iter().filter(|n| forced.contains(&n.op.kind())).count();
        assert_eq!(ex.placed().fallback, on_cpu);
        // Copies to the CPU are the downloads, each a readback of its own.
        let downloads = d.readbacks - readback_nodes(g);
        seen.push((ex.copies(), crate::exec::tests::expected_copies(g, &forced), downloads));
    })
    .unwrap();
    for (t, &(made, (expected, to_cpu), downloads)) in seen.iter().enumerate() {
        assert!(made > 0 && to_cpu > 0 && to_cpu < made, "tick {t}: copies both ways");
        assert_eq!(made, expected, "tick {t}");
        assert_eq!(downloads as usize, to_cpu, "tick {t}");
    }
    let d = want.iter().flatten().zip(got.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(want.iter().flatten().all(|v| v.is_finite()));
    assert!(d <= 1e-3, "max |Δlogit| {d} with {forced:?} on the CPU");
    eprintln!("forced to the CPU: (copies, expected, downloads) per tick {seen:?}, max |Δlogit| {d}");

    let mut ex = Executor::default();
    ex.force_fallback(kind("sparse_attention"), true);
    let err = ticks(&model, &be, Some(&cpu), &mut ex, 3, 0, |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("KV pages"), "{err}");
    let mut ex = Executor::default();
    ex.force_fallback(kind("swiglu"), true);
    let err = ticks(&model, &be, Some(&cpu), &mut ex, 3, 0, |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("backend-private layout"), "{err}");
}

/// `experts=cpu` placement ([`crate::exec::Placement`]): every MoE layer's route, expert products and combine run
/// on the CPU, the rest on wgpu. Logits agree with the all-wgpu run within the cross-backend tolerance (the CPU with
/// f32 activations computes the same products); what crosses per tick is exactly each layer's normed input down
/// and its output up, per row; the expert tensors are never uploaded to the device.
#[test]
fn experts_on_the_cpu_cross_only_each_layers_input_and_output() {
    let Some(ctx) = test_context(Default::default()) else { return };
    let model = demo();
    let c = &model.config;
    let all_gpu = WgpuBackend::with_context(ctx);
    let mut ex = Executor::default();
    let want = ticks(&model, &all_gpu, None, &mut ex, 7, 2, |_, _| {}).unwrap();
    let experts: Vec<_> = model.layers.iter().flat_map(|l| [l.gate_exps, l.up_exps, l.down_exps]).collect();
    assert!(experts.iter().all(|w| all_gpu.resident_weights().contains(w)), "all-wgpu uploads the experts");
    drop(all_gpu);

    let Some(ctx) = test_context(Default::default()) else { return };
    let be = WgpuBackend::with_context(ctx);
    let cpu = CpuBackend::new(2).with_f32_acts(true);
    let placement = crate::exec::Placement::EXPERTS_ON_CPU;
    let mut ex = Executor::default();
    for k in placement.moved_kinds(crate::backend::BackendKind::Wgpu) {
        ex.force_fallback(k, true);
    }
    for &b in placement.moved_writers(crate::backend::BackendKind::Wgpu) {
        ex.force_writers_of(b, true);
    }
    let mut crossed = Vec::new();
    let got = ticks(&model, &be, Some(&cpu), &mut ex, 7, 2, |g, ex| {
        let moe = g.nodes.iter().filter(|n| crate::exec::Placement::EXPERT_OPS.contains(&n.op.op_kind())).count();
        let routers = g.nodes.iter().filter(|n| matches!(n.op, Op::MatMul { y: crate::graph::BufId::Router, .. }));
        let moe = moe + routers.count();
        assert_eq!(ex.placed().fallback, moe);
        crossed.push((g.nodes.iter().filter(|n| matches!(n.op, Op::MoeCombine { .. })).count(), ex.copied_bytes()));
    })
    .unwrap();
    let rows = [7usize, 1, 1];
    for (t, &(layers, bytes)) in crossed.iter().enumerate() {
        assert_eq!(layers, c.n_layers, "tick {t}");
        let per_row_down = c.d_model * 4;
        let per_row_up = c.d_model * 4;
        assert_eq!(bytes.to_fallback, (layers * rows[t] * per_row_down) as u64, "tick {t}: down");
        assert_eq!(bytes.to_primary, (layers * rows[t] * per_row_up) as u64, "tick {t}: up");
    }
    let resident = be.resident_weights();
    assert!(!resident.is_empty() && experts.iter().all(|w| !resident.contains(w)), "no expert tensor uploaded");
    let d = want.iter().flatten().zip(got.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(got.iter().flatten().all(|v| v.is_finite()));
    assert!(d <= 1e-3, "max |Δlogit| {d} with the experts on the CPU");
    eprintln!("experts on the CPU: bytes crossed per tick {crossed:?}, max |Δlogit| {d}");
}
