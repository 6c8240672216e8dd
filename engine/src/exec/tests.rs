use super::*;
use crate::graph::{BufId, Stage};
use crate::model::WeightId;

fn small() -> Graph {
    let mut g = Graph::default();
    g.clear(1);
    g.stage(Stage::Embed);
    g.push(Op::Embed);
    g.stage(Stage::HcHead);
    g.push(Op::RmsNorm { x: BufId::Streams, y: BufId::StreamsNormed, w: None, width: 4, heads: 1 });
    g.push(Op::MatMul { w: WeightId(0), x: BufId::StreamsNormed, y: BufId::Mix });
    g.push(Op::MatMul { w: WeightId(1), x: BufId::StreamsNormed, y: BufId::Q });
    g.push(Op::HcHeadWeights);
    g.stage(Stage::Moe { layer: 0 });
    g.push(Op::MoeCombine { experts: crate::graph::Experts::ByExpert });
    g.finish();
    g
}

#[test]
fn runs_nodes_in_dependency_order() {
    let g = small();
    let mut ex = Executor::default();
    let mut ops = Vec::new();
    ex.run_with(&g, |_, op| {
        ops.push(*op);
        Ok(())
    })
    .unwrap();
    assert_eq!(ops.len(), g.nodes.len());
    assert_eq!(ex.order(), (0..g.nodes.len()).collect::<Vec<_>>());
    let pos = |j: usize| ex.order().iter().position(|&x| x == j).unwrap();
    assert!(g.edges.iter().all(|&(a, b)| pos(a) < pos(b)));
}

#[test]
fn op_times_count_every_op_by_kind() {
    let g = small();
    let mut ex = Executor::default();
    assert_eq!(ex.take_op_times(), None, "off by default");
    ex.time_ops(true);
    for _ in 0..3 {
        ex.run_with(&g, |_, op| {
            if matches!(op, Op::MatMul { .. }) {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            Ok(())
        })
        .unwrap();
    }
    let t = ex.take_op_times().unwrap();
    assert_eq!(t.runs, 3);
    for (k, name) in Op::KINDS.iter().enumerate() {
        let n = g.nodes.iter().filter(|j| j.op.kind() == k).count() as u64;
        assert_eq!(t.calls[k], 3 * n, "{name}");
    }
    assert!(t.by_kind[2] >= std::time::Duration::from_millis(12));
    assert_eq!(t.ranked()[0].0, "matmul");
    assert_eq!(ex.take_op_times().unwrap().runs, 0);
    ex.time_ops(false);
    assert_eq!(ex.take_op_times(), None);
}

use super::testing::demo;

/// On the demo model's CSA layer (compressor and indexer), the projections of the normed input form one group
/// and `wq_b` goes with the indexer's query; the head's and MoE's products run alone.
#[test]
fn groups_the_projections_of_a_layer() {
    use crate::graph::Batch;
    let model = demo();
    let layer = (0..model.config.n_layers).find(|&l| model.layers[l].indexer.is_some()).expect("a CSA layer");
    let lw = &model.layers[layer];
    let (cw, iw) = (lw.compressor.as_ref().unwrap(), lw.indexer.as_ref().unwrap());
    let mut batch = Batch::default();
    batch.push_run(0, 3, [5, 6], true);
    let mut g = Graph::default();
    crate::model::recipe::build(&mut g, &model, &batch, false);
    let be = crate::backend::cpu::CpuBackend::new(1);
    let mut ex = Executor::default();
    ex.place(&g, &be, None, &model, batch.rows.len()).unwrap();
    let mut groups: Vec<Vec<WeightId>> = Vec::new();
    let mut seen = vec![false; g.nodes.len()];
    ex.run_groups_with(&g, |nodes, ops| {
        assert_eq!(nodes.len(), ops.len());
        assert!(nodes.windows(2).all(|w| w[0] < w[1]), "ascending");
        for &i in nodes {
            // Every dependency finished before (ready together means independent).
            assert!(g.edges.iter().filter(|e| e.1 == i).all(|e| seen[e.0]), "node {i} ran early");
        }
        for &i in nodes {
            seen[i] = true;
        }
        if nodes.len() > 1 {
            assert!(ops.iter().all(|o| matches!(o, Op::MatMul { .. })));
            groups.push(ops.iter().map(|o| if let Op::MatMul { w, .. } = *o { w } else { unreachable!() }).collect());
        }
        Ok(())
    })
    .unwrap();
    assert!(seen.iter().all(|&s| s));
    let normed = vec![lw.wq_a, lw.wkv, cw.wkv, cw.wgate, iw.comp.wkv, iw.comp.wgate, iw.proj];
    assert!(groups.contains(&normed), "{groups:?}");
    assert!(groups.contains(&vec![lw.wq_b, iw.wq_b]), "{groups:?}");
    for gr in &groups {
        assert!(!gr.contains(&lw.gate) && !gr.contains(&model.global.hc_fn) && !gr.contains(&lw.hc_attn.fn_));
    }
    // Without grouping (run_with) every node runs alone, in recipe order.
    ex.run_with(&g, |_, _| Ok(())).unwrap();
    assert_eq!(ex.order(), (0..g.nodes.len()).collect::<Vec<_>>());
}

/// Grouped and ungrouped runs on the CPU give bit-identical logits over a prefill and a few decode ticks (two
/// sessions in one batch), with and without the activation simulation.
#[test]
fn grouped_runs_are_bit_identical() {
    use crate::backend::{Activations, RopeSet};
    use crate::graph::Batch;
    use crate::tables::SessionKv;
    let model = demo();
    let rope = RopeSet::new(&model);
    let vocab = model.config.vocab as u32;
    for sim in [false, true] {
        let run = |group: bool| -> Vec<Vec<f32>> {
            let be = crate::backend::cpu::CpuBackend::new(2);
            let mut ex = Executor::default();
            ex.group_nodes(group);
            let mut kv = vec![SessionKv::new(&model.config, 64), SessionKv::new(&model.config, 64)];
            let mut g = Graph::default();
            let mut out = Vec::new();
            let tok = |i: usize| ((i as u32).wrapping_mul(2654435761) % 9973) % vocab;
            for t in 0..4usize {
                let mut batch = Batch::default();
                if t == 0 {
                    batch.push_run(0, 0, (0..9).map(tok), true);
                    batch.push_run(1, 0, (20..25).map(tok), false);
                } else {
                    batch.push_run(0, 8 + t, [tok(40 + t)], false);
                    batch.push_run(1, 4 + t, [tok(60 + t)], false);
                }
                let mut act = Activations::default();
                act.ensure(&model, batch.rows.len(), batch.logit_rows.len());
                crate::model::recipe::build(&mut g, &model, &batch, sim);
                let mut cx = StepCtx { model: &model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim };
                ex.run(&g, &be, &mut cx).unwrap();
                out.push(act.logits[..batch.logit_rows.len() * vocab as usize].to_vec());
            }
            out
        };
        let (a, b) = (run(true), run(false));
        assert!(a.iter().flatten().all(|v| v.is_finite()));
        let bits = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "sim {sim}");
    }
}

/// A run reuses the last placement while the graph and its inputs are unchanged (a decode loop places once),
/// and places again when the graph changes (a prefill, then decode again), when options change, or when a
/// different backend runs it.
#[test]
fn placement_is_cached_while_the_graph_is_unchanged() {
    use crate::backend::{Activations, RopeSet};
    use crate::graph::Batch;
    use crate::tables::SessionKv;
    let model = demo();
    let rope = RopeSet::new(&model);
    let (be, other) = (crate::backend::cpu::CpuBackend::new(1), crate::backend::cpu::CpuBackend::new(1));
    let mut ex = Executor::default();
    let mut kv = vec![SessionKv::new(&model.config, 64)];
    let mut g = Graph::default();
    let mut pos = 0;
    let mut tick = |ex: &mut Executor, n: usize, be: &crate::backend::cpu::CpuBackend| {
        let mut batch = Batch::default();
        batch.push_run(0, pos, (0..n as u32).map(|i| 7 + i), false);
        pos += n;
        let mut act = Activations::default();
        act.ensure(&model, batch.rows.len(), batch.logit_rows.len());
        crate::model::recipe::build(&mut g, &model, &batch, false);
        let mut cx = StepCtx { model: &model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim: false };
        ex.run(&g, be, &mut cx).unwrap();
        assert_eq!(ex.places.len(), g.nodes.len());
        ex.placements()
    };
    assert_eq!(tick(&mut ex, 5, &be), 1);
    assert_eq!(tick(&mut ex, 1, &be), 2, "decode after prefill: another graph");
    assert_eq!(tick(&mut ex, 1, &be), 2, "the same decode graph: placed once");
    assert_eq!(tick(&mut ex, 1, &be), 2);
    assert_eq!(tick(&mut ex, 1, &other), 3, "another backend");
    ex.use_native(false);
    assert_eq!(tick(&mut ex, 1, &other), 4, "another option");
    assert_eq!(ex.placed().native, 0);
    assert_eq!(tick(&mut ex, 3, &other), 5, "another batch size");
    assert_eq!(tick(&mut ex, 3, &other), 5);
}

/// Copies the residency rule of the module docs inserts for `g` with the kinds in `forced` on the fallback,
/// counted from the nodes' declared accesses in node order: `(all, to the fallback)`.
pub(crate) fn expected_copies(g: &Graph, forced: &[usize]) -> (usize, usize) {
    // Per tensor: whether its last writer ran on the fallback, and whether the other side has a copy since.
    let mut state: std::collections::HashMap<BufId, (bool, bool)> = std::collections::HashMap::new();
    let (mut copies, mut to_fallback) = (0, 0);
    for node in &g.nodes {
        let on_fb = forced.contains(&node.op.kind());
        let mut needed = Vec::new();
        node.op.inputs(|b| needed.push(b));
        needed.dedup();
        for b in needed {
            if let Some((writer_fb, copied)) = state.get_mut(&b) {
                if *writer_fb != on_fb && !*copied {
                    *copied = true;
                    copies += 1;
                    to_fallback += usize::from(on_fb);
                }
            }
        }
        node.op.access(
            |_| {},
            |b| {
                state.insert(b, (on_fb, false));
            },
        );
    }
    (copies, to_fallback)
}

/// Two CPU backends (each with its own tensors) with op kinds forced onto the second: the residency copies
/// are exact, so the logits are bit-identical to one backend's, and the copies are the residency changes of the
/// graph; nothing forced, nothing is copied; the KV nodes cannot move.
#[test]
fn fallback_on_a_second_cpu_backend_is_bit_identical() {
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Activations, RopeSet};
    use crate::graph::Batch;
    use crate::tables::SessionKv;
    let model = demo();
    let rope = RopeSet::new(&model);
    let vocab = model.config.vocab;
    let kind = |name: &str| Op::KINDS.iter().position(|k| *k == name).unwrap();
    // Per tick: (copies made, expected copies (all, to the fallback)).
    type Copies = Vec<(usize, (usize, usize))>;
    let run = |forced: &[usize]| -> Result<(Vec<f32>, Copies)> {
        let (be, fb) = (CpuBackend::new(2), CpuBackend::new(1));
        let mut ex = Executor::default();
        forced.iter().for_each(|&k| ex.force_fallback(k, true));
        let mut kv = vec![SessionKv::new(&model.config, 64)];
        let (mut g, mut logits, mut copies) = (Graph::default(), Vec::new(), Vec::new());
        for t in 0..3usize {
            let mut batch = Batch::default();
            match t {
                0 => batch.push_run(0, 0, (0..6u32).map(|i| 11 + 13 * i), true),
                _ => batch.push_run(0, 5 + t, [40 + t as u32], false),
            }
            let mut act = Activations::default();
            act.ensure(&model, batch.rows.len(), batch.logit_rows.len());
            crate::model::recipe::build(&mut g, &model, &batch, true);
            let mut cx = StepCtx { model: &model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim: true };
            ex.run_on(&g, &be, Some(&fb), &mut cx)?;
            copies.push((ex.copies(), expected_copies(&g, forced)));
            assert_eq!(ex.placed().fallback, g.nodes.iter().filter(|n| forced.contains(&n.op.kind())).count());
            logits.extend_from_slice(&act.logits[..batch.logit_rows.len() * vocab]);
        }
        Ok((logits, copies))
    };
    let (want, none) = run(&[]).unwrap();
    assert!(none.iter().all(|c| c.0 == 0), "{none:?}");
    let forced = [kind("rms_norm"), kind("hc_sinkhorn"), kind("rope"), kind("matmul"), kind("hc_post")];
    let (got, copies) = run(&forced).unwrap();
    for (t, &(made, (expected, to_fb))) in copies.iter().enumerate() {
        assert!(made > 0 && to_fb > 0 && to_fb < made, "tick {t}: copies both ways");
        assert_eq!(made, expected, "tick {t}");
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(want.iter().all(|v| v.is_finite()));
    assert_eq!(bits(&got), bits(&want));
    let err = run(&[kind("window_store")]).unwrap_err().to_string();
    assert!(err.contains("KV pages"), "{err}");
}

#[test]
fn stops_at_the_first_error_and_detects_cycles() {
    let g = small();
    let mut ex = Executor::default();
    let mut n = 0;
    let r = ex.run_with(&g, |_, op| {
        n += 1;
        if matches!(op, Op::MatMul { .. }) {
            return Err(Error::Backend { backend: "test", what: "boom".into() });
        }
        Ok(())
    });
    assert!(r.is_err());
    assert_eq!(n, 3);
    // A two-node cycle never becomes ready.
    let mut cyc = Graph::default();
    cyc.clear(0);
    cyc.stage(Stage::Embed);
    cyc.push(Op::Embed);
    cyc.push(Op::Logits);
    cyc.edges = vec![(0, 1), (1, 0)];
    cyc.finish();
    assert!(ex.run_with(&cyc, |_, _| Ok(())).is_err());
}

/// After a run with a fallback, a tensor's final value is read from the side that wrote it last: the streams of a
/// run whose post-mixes and every later reader of the streams ran on the fallback come from the fallback (the
/// primary's copy is the embeddings it wrote).
#[test]
fn final_values_come_from_the_side_that_wrote_them() {
    use crate::backend::{Activations, Backend, RopeSet, StepCtx};
    use crate::graph::Batch;
    use crate::tables::SessionKv;
    let model = demo();
    let rope = RopeSet::new(&model);
    let (primary, fallback) = (crate::backend::cpu::CpuBackend::new(1), crate::backend::cpu::CpuBackend::new(1));
    let mut kv = vec![SessionKv::new(&model.config, 16)];
    let mut batch = Batch::default();
    batch.push_run(0, 0, [3, 4, 5], true);
    let mut act = Activations::default();
    act.ensure(&model, 3, 3);
    let mut g = Graph::default();
    crate::model::recipe::build(&mut g, &model, &batch, false);
    let mut ex = Executor::default();
    for kind in [crate::graph::OpKind::HcPost, crate::graph::OpKind::HcCollapse, crate::graph::OpKind::RmsNorm] {
        ex.force_fallback(kind as usize, true);
    }
    let mut cx = StepCtx { model: &model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim: false };
    ex.run_on(&g, &primary, Some(&fallback), &mut cx).unwrap();
    let n = 3 * model.config.hc_dim();
    let (mut got, mut on_fallback, mut on_primary) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    ex.download_final(BufId::Streams, &primary, Some(&fallback), &mut cx, &mut got).unwrap();
    fallback.download(BufId::Streams, &mut cx, &mut on_fallback).unwrap();
    primary.download(BufId::Streams, &mut cx, &mut on_primary).unwrap();
    assert!(got == on_fallback, "the final streams are the fallback's");
    assert!(got != on_primary, "the primary holds an older value of the streams");
}
