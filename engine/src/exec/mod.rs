//! The executor: places a tick's [`Graph`] on a [`Backend`] and runs it.
//!
//! Placement ([`Executor::place`], once per tick): each node goes to a native override from `ds4_kernels_native`
//! when one is registered for its op kind on this backend and applies to its shape, else to the backend's portable
//! kernel ([`Backend::supports`]). A stage containing a node neither can run is placed whole on
//! [`Backend::run_stage`] (the layer-level path). Every tensor of a tick lives with one backend, so no copies are
//! needed between nodes; the one host tensor, the logits, comes back through the recipe's
//! [`Op::Readback`] node (a no-op on the CPU, whose logits are host memory).
//!
//! Running ([`Executor::run`]) is Kahn's algorithm over the graph's precomputed dependency counts and dependents:
//! a node becomes ready when every node it depends on has finished. Ready nodes run on the calling thread, lowest
//! index first (so a tick runs in recipe order); the parallelism lives inside the kernels (the CPU worker pool
//! splits each product over every core). Its vectors are reused across ticks (no allocation in the decode loop).
//!
//! Grouping: on a backend that [`Backend::runs_groups`] (the CPU), when the next node is a weight product placed
//! on the portable kernel, every other such product ready at that moment (up to [`MAX_GROUP`]) joins it and they
//! go to [`Backend::run_group`] together — the projections of one normed input (`wq_a`, `wkv`, the compressor's
//! and the indexer's), then `wq_b` with the indexer's query. Ready nodes are independent by construction (a
//! conflict on a tensor is an edge), so only the scheduling changes, never a kernel's inputs. Other backends (wgpu,
//! recording into one encoder) see every node alone, in order. `DS4_EXEC_GROUP=0` (environment, read by
//! [`Executor::default`]) or [`Executor::group_nodes`] turns grouping off.
//!
//! Op timing ([`Executor::time_ops`]) adds up the wall time of each op kind ([`Op::KINDS`]; a stage run whole
//! counts as `"stage"`) across runs, for finding where a tick's time goes (`ds4-bench` prints it per decoded
//! token). On wgpu, whose nodes record into one encoder submitted by the readback, the readback holds the device
//! time and every other node its recording time.

use crate::backend::{Backend, StepCtx};
use crate::graph::{Graph, Op};
use crate::model::Model;
use crate::{Error, Result};

/// Wall time per op kind, summed over the ticks run while timing was on (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTimes {
    /// Time per kind, indexed like [`Op::KINDS`].
    pub by_kind: [std::time::Duration; Op::KINDS.len()],
    /// Nodes (or whole stages) run per kind.
    pub calls: [u64; Op::KINDS.len()],
    /// Graph runs (ticks) counted.
    pub runs: u64,
}

impl OpTimes {
    /// Time spent in all ops.
    pub fn total(&self) -> std::time::Duration {
        self.by_kind.iter().sum()
    }

    /// `(kind name, time)` for the kinds that ran, largest first.
    pub fn ranked(&self) -> Vec<(&'static str, std::time::Duration)> {
        let mut v: Vec<_> =
            (0..Op::KINDS.len()).filter(|&k| self.calls[k] > 0).map(|k| (Op::KINDS[k], self.by_kind[k])).collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v
    }
}

/// Where a node runs (see the module docs).
#[derive(Clone, Copy, Debug)]
pub enum Place {
    /// A native override.
    Native(&'static ds4_kernels_native::Override),
    /// The backend's portable kernel.
    Portable,
    /// First node of a stage run whole.
    Stage,
    /// Another node of a stage run whole (done by the stage's first node).
    InStage,
}

/// Nodes placed per kind of placement in the last [`Executor::place`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    pub native: usize,
    pub portable: usize,
    /// Nodes inside stages run whole.
    pub staged: usize,
}

/// Most nodes run as one group (see the module docs).
pub const MAX_GROUP: usize = 8;

/// A reusable executor. See the module docs.
#[derive(Debug)]
pub struct Executor {
    sched: Sched,
    /// Placement of each node of the last placed graph.
    pub places: Vec<Place>,
    native: bool,
    group: bool,
}

/// The scheduler's reusable state.
#[derive(Debug, Default)]
struct Sched {
    remaining: Vec<usize>,
    ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>>,
    order: Vec<usize>,
    /// The nodes (and their ops) run in the current step: one node, or a group.
    group: Vec<usize>,
    group_ops: Vec<Op>,
    times: Option<OpTimes>,
}

impl Default for Executor {
    fn default() -> Executor {
        let group = std::env::var("DS4_EXEC_GROUP").map_or(true, |v| v.trim() != "0");
        Executor { sched: Sched::default(), places: Vec::new(), native: true, group }
    }
}

impl Executor {
    /// Places `g` on `backend` and runs every node, bracketed by [`Backend::begin_tick`] and
    /// [`Backend::end_tick`]. Fails with the first kernel error, or if the graph has a cycle.
    pub fn run(&mut self, g: &Graph, backend: &dyn Backend, cx: &mut StepCtx<'_>) -> Result<()> {
        self.place(g, backend, cx.model, cx.batch.rows.len());
        backend.begin_tick(cx)?;
        let places = &self.places;
        let grouping = self.group && backend.runs_groups();
        self.sched.run(g, places, grouping, |nodes, ops| {
            if nodes.len() > 1 {
                return backend.run_group(ops, cx);
            }
            let (i, op) = (nodes[0], &ops[0]);
            match places[i] {
                Place::Native(o) => {
                    if !backend.run_native(op, &o.kernel, cx)? {
                        backend.run_node(op, cx)?;
                    }
                    Ok(())
                }
                Place::Portable => backend.run_node(op, cx),
                Place::Stage => backend.run_stage(g.nodes[i].stage, cx),
                Place::InStage => Ok(()),
            }
        })?;
        backend.end_tick(cx)
    }

    /// Whether independent weight products are grouped on backends that run groups (on by default unless
    /// `DS4_EXEC_GROUP=0`; see the module docs).
    pub fn group_nodes(&mut self, on: bool) {
        self.group = on;
    }

    /// Whether native overrides are consulted (on by default).
    pub fn use_native(&mut self, on: bool) {
        self.native = on;
    }

    /// Places every node of `g` (see the module docs) into [`Executor::places`]; `rows` is the batch size.
    pub fn place(&mut self, g: &Graph, backend: &dyn Backend, model: &Model, rows: usize) -> Placed {
        self.places.clear();
        let mut placed = Placed::default();
        for &(_, a, b) in &g.stages {
            let start = self.places.len();
            let mut whole = false;
            for i in a..b {
                let op = &g.nodes[i].op;
                let native = if self.native {
                    let shape = ds4_kernels_native::Shape { rows, width: native_width(op, model) };
                    ds4_kernels_native::find(op.name(), backend.name(), &shape)
                } else {
                    None
                };
                match native {
                    Some(o) => self.places.push(Place::Native(o)),
                    None if backend.supports(op, model) => self.places.push(Place::Portable),
                    None => {
                        whole = true;
                        break;
                    }
                }
            }
            if whole {
                self.places.truncate(start);
                self.places.push(Place::Stage);
                self.places.extend((a + 1..b).map(|_| Place::InStage));
                placed.staged += b - a;
            } else {
                for p in &self.places[start..] {
                    match p {
                        Place::Native(_) => placed.native += 1,
                        _ => placed.portable += 1,
                    }
                }
            }
        }
        placed
    }

    /// Turns op timing on (counters start at zero) or off (counters dropped).
    pub fn time_ops(&mut self, on: bool) {
        self.sched.times = on.then(OpTimes::default);
    }

    /// The op times summed since timing was turned on or last taken, and restarts the count; `None` when timing
    /// is off.
    pub fn take_op_times(&mut self) -> Option<OpTimes> {
        self.sched.times.as_mut().map(std::mem::take)
    }

    /// Order in which the last run executed the nodes (for tests and tracing).
    pub fn order(&self) -> &[usize] {
        &self.sched.order
    }

    /// Runs every node of `g` through `f(index, op)`, in dependency order (ties: lowest index first), with the
    /// current placements (timing counts nodes of [`Place::Stage`] as `"stage"`).
    pub fn run_with(&mut self, g: &Graph, mut f: impl FnMut(usize, &Op) -> Result<()>) -> Result<()> {
        self.sched.run(g, &self.places, false, |nodes, ops| f(nodes[0], &ops[0]))
    }

    /// Like [`Executor::run_with`], with grouping (see the module docs): `f(nodes, ops)` gets one node or a group
    /// of weight products ready together (ascending).
    pub fn run_groups_with(&mut self, g: &Graph, f: impl FnMut(&[usize], &[Op]) -> Result<()>) -> Result<()> {
        self.sched.run(g, &self.places, true, f)
    }
}

impl Sched {
    fn run(
        &mut self,
        g: &Graph,
        places: &[Place],
        grouping: bool,
        mut f: impl FnMut(&[usize], &[Op]) -> Result<()>,
    ) -> Result<()> {
        self.remaining.clear();
        self.remaining.extend_from_slice(&g.deps);
        self.ready.clear();
        self.order.clear();
        for (i, &d) in self.remaining.iter().enumerate() {
            if d == 0 {
                self.ready.push(std::cmp::Reverse(i));
            }
        }
        if let Some(t) = &mut self.times {
            t.runs += 1;
        }
        let groupable =
            |j: usize| matches!(places.get(j), Some(Place::Portable)) && matches!(g.nodes[j].op, Op::MatMul { .. });
        while let Some(std::cmp::Reverse(j)) = self.ready.pop() {
            self.group.clear();
            self.group.push(j);
            if grouping && groupable(j) {
                for &std::cmp::Reverse(k) in self.ready.iter() {
                    if self.group.len() < MAX_GROUP && groupable(k) {
                        self.group.push(k);
                    }
                }
                if self.group.len() > 1 {
                    let group = &self.group;
                    self.ready.retain(|r| !group.contains(&r.0));
                    self.group.sort_unstable();
                }
            }
            self.group_ops.clear();
            self.group_ops.extend(self.group.iter().map(|&i| g.nodes[i].op));
            match &mut self.times {
                Some(t) => {
                    let t0 = std::time::Instant::now();
                    let r = f(&self.group, &self.group_ops);
                    let staged = matches!(places.get(j), Some(Place::Stage | Place::InStage));
                    let k = if staged { Op::STAGE_KIND } else { g.nodes[j].op.kind() };
                    if !matches!(places.get(j), Some(Place::InStage)) {
                        t.by_kind[k] += t0.elapsed();
                        t.calls[k] += self.group.len() as u64;
                    }
                    r?
                }
                None => f(&self.group, &self.group_ops)?,
            }
            for gi in 0..self.group.len() {
                let i = self.group[gi];
                self.order.push(i);
                for &to in g.dependents(i) {
                    self.remaining[to] -= 1;
                    if self.remaining[to] == 0 {
                        self.ready.push(std::cmp::Reverse(to));
                    }
                }
            }
        }
        if self.order.len() != g.nodes.len() {
            return Err(Error::Backend { backend: "exec", what: "node graph has a cycle".into() });
        }
        Ok(())
    }
}

/// The row width a native override's predicate sees for `op`.
fn native_width(op: &Op, model: &Model) -> usize {
    let c = &model.config;
    match *op {
        Op::SwiGlu { .. } | Op::ExpertUp { .. } | Op::ExpertDown { .. } => c.expert_ffn,
        Op::RmsNorm { width, .. } | Op::Rope { width, .. } | Op::ActSim { width, .. } | Op::Scale { width, .. } => {
            width
        }
        _ => c.d_model,
    }
}

#[cfg(test)]
mod tests {
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
        g.push(Op::MoeCombine);
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

    fn demo() -> Model {
        let bytes = crate::convert::demo::demo_model_gguf(7).unwrap();
        Model::load(crate::gguf::GgufFile::from_bytes(bytes).unwrap()).unwrap()
    }

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
        ex.place(&g, &be, &model, batch.rows.len());
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
                groups
                    .push(ops.iter().map(|o| if let Op::MatMul { w, .. } = *o { w } else { unreachable!() }).collect());
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
}
