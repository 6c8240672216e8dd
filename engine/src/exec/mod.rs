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
//! a node becomes ready when every node it depends on has finished. Ready nodes run one at a time on the calling
//! thread, lowest index first (so a tick runs in recipe order); the parallelism lives inside the kernels (the CPU
//! worker pool splits each product over every core, so running independent nodes side by side would only
//! oversubscribe them). Its vectors are reused across ticks (no allocation in the decode loop).
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

/// A reusable executor. See the module docs.
#[derive(Debug)]
pub struct Executor {
    sched: Sched,
    /// Placement of each node of the last placed graph.
    pub places: Vec<Place>,
    native: bool,
}

/// The scheduler's reusable state.
#[derive(Debug, Default)]
struct Sched {
    remaining: Vec<usize>,
    ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>>,
    order: Vec<usize>,
    times: Option<OpTimes>,
}

impl Default for Executor {
    fn default() -> Executor {
        Executor { sched: Sched::default(), places: Vec::new(), native: true }
    }
}

impl Executor {
    /// Places `g` on `backend` and runs every node, bracketed by [`Backend::begin_tick`] and
    /// [`Backend::end_tick`]. Fails with the first kernel error, or if the graph has a cycle.
    pub fn run(&mut self, g: &Graph, backend: &dyn Backend, cx: &mut StepCtx<'_>) -> Result<()> {
        self.place(g, backend, cx.model, cx.batch.rows.len());
        backend.begin_tick(cx)?;
        let places = &self.places;
        self.sched.run(g, places, |i, op| match places[i] {
            Place::Native(o) => {
                if !backend.run_native(op, &o.kernel, cx)? {
                    backend.run_node(op, cx)?;
                }
                Ok(())
            }
            Place::Portable => backend.run_node(op, cx),
            Place::Stage => backend.run_stage(g.nodes[i].stage, cx),
            Place::InStage => Ok(()),
        })?;
        backend.end_tick(cx)
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
    pub fn run_with(&mut self, g: &Graph, f: impl FnMut(usize, &Op) -> Result<()>) -> Result<()> {
        self.sched.run(g, &self.places, f)
    }
}

impl Sched {
    fn run(&mut self, g: &Graph, places: &[Place], mut f: impl FnMut(usize, &Op) -> Result<()>) -> Result<()> {
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
        while let Some(std::cmp::Reverse(j)) = self.ready.pop() {
            let op = &g.nodes[j].op;
            match &mut self.times {
                Some(t) => {
                    let t0 = std::time::Instant::now();
                    let r = f(j, op);
                    let staged = matches!(places.get(j), Some(Place::Stage | Place::InStage));
                    let k = if staged { Op::STAGE_KIND } else { op.kind() };
                    if !matches!(places.get(j), Some(Place::InStage)) {
                        t.by_kind[k] += t0.elapsed();
                        t.calls[k] += 1;
                    }
                    r?
                }
                None => f(j, op)?,
            }
            self.order.push(j);
            for &to in g.dependents(j) {
                self.remaining[to] -= 1;
                if self.remaining[to] == 0 {
                    self.ready.push(std::cmp::Reverse(to));
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
