//! The executor: places a tick's [`Graph`] on a [`Backend`] and runs it.
//!
//! Placement ([`Executor::place`]): each node goes to a native override from `ds4_kernels_native` when one is
//! registered for its op kind on this backend and applies to its shape, else to the backend's portable kernel
//! ([`Backend::supports`]), else — when the run has a fallback backend (the CPU as host fallback,
//! [`Executor::run_on`]) that can take it — to the fallback's portable kernel. Op kinds can also be sent to the
//! fallback on purpose ([`Executor::force_fallback`]: tests, and the seam a device backend without some kernel
//! uses). A node that touches a layer's KV pages, or a tensor whose layout is a backend's own
//! ([`BufId::host_width`] is `None`: the routes, the expert slot rows, the selection, the logits), stays with the
//! primary backend: forcing it elsewhere is an error. A stage containing a node nobody can run is placed whole on
//! [`Backend::run_stage`] (the layer-level path). A run reuses the last placement when its signature (the
//! backends, the model, the batch size, the options, each node's kind, weight and width) is unchanged, so a
//! steady decode loop places once ([`Executor::placements`]).
//!
//! Residency: without a fallback every tensor lives with the one backend and nothing is copied (the CPU-only
//! path does no residency work at all). With one, the executor tracks where each tensor's current value is
//! (primary, fallback or both; the KV pages start with the primary) and, before a node runs, copies each of its
//! inputs ([`Op::inputs`]: what it reads and what it updates in place) that is only on the other side — a
//! [`Backend::download`] into one reused host buffer, then a [`Backend::upload`] — so copies happen exactly where
//! residency changes ([`Executor::copies`]); what a node writes then lives on its side only. The host tensors of a
//! tick come back through the recipe's [`Op::Readback`] nodes (the logits; a device backend's MoE routes), no-ops
//! on the CPU.
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
use crate::graph::{BufId, Graph, Op};
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
    /// A native override (on the primary backend).
    Native(&'static ds4_kernels_native::Override),
    /// The primary backend's portable kernel.
    Portable,
    /// The fallback backend's portable kernel.
    Fallback,
    /// First node of a stage run whole (on the primary backend).
    Stage,
    /// Another node of a stage run whole (done by the stage's first node).
    InStage,
}

/// Nodes placed per kind of placement in the last placement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    pub native: usize,
    pub portable: usize,
    /// Nodes on the fallback backend.
    pub fallback: usize,
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
    placed: Placed,
    native: bool,
    group: bool,
    /// Op kinds ([`Op::kind`]) sent to the fallback backend whenever one is given, as a bit set.
    forced: u32,
    /// Signature of the inputs of the last placement, and how many placements were computed.
    sig: Option<u64>,
    placements: u64,
    res: Residency,
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

/// Where each tensor's current value is during a run with a fallback backend (see the module docs).
#[derive(Debug, Default)]
struct Residency {
    /// Per tensor ([`BufId::index`]): bit 0 set when the primary backend holds the current value, bit 1 the
    /// fallback; 0 before the tick writes it.
    valid: Vec<u8>,
    /// Host staging of one copied tensor.
    host: Vec<f32>,
    /// Copies inserted by the last run.
    copies: usize,
}

/// The two backends of a run (the fallback, if any, as host fallback or forced placement).
#[derive(Clone, Copy)]
struct Pair<'a> {
    primary: &'a dyn Backend,
    fallback: Option<&'a dyn Backend>,
}

impl Pair<'_> {
    /// The backend of side `s` (0 primary, 1 fallback).
    fn side(&self, s: usize) -> Result<&dyn Backend> {
        match s {
            0 => Ok(self.primary),
            _ => self.fallback.ok_or_else(|| exec_err("a node is placed on the fallback, but none is given")),
        }
    }
}

impl Residency {
    /// Starts a tick over `nbuf` tensors: only the KV pages have a value, and they live with the primary backend.
    fn begin(&mut self, nbuf: usize) {
        self.valid.clear();
        self.valid.resize(nbuf, 0);
        self.valid[BufId::FIXED..].fill(1);
        self.copies = 0;
    }

    /// Makes the current value of every input of `op` present on side `s`, copying from the other side where it
    /// is not.
    fn inputs_on(&mut self, op: &Op, s: usize, be: Pair<'_>, cx: &mut StepCtx<'_>) -> Result<()> {
        let bit = 1u8 << s;
        let mut need = [None; 8];
        let mut n = 0;
        op.inputs(|b| {
            if n < need.len() && !need[..n].contains(&Some(b)) {
                need[n] = Some(b);
                n += 1;
            }
        });
        for b in need[..n].iter().flatten() {
            let v = self.valid[b.index()];
            if v == 0 || v & bit != 0 {
                continue;
            }
            let width = b.host_width(&cx.model.config).ok_or_else(|| {
                exec_err(format!("{} needs {b:?} on the other backend, and it has no host layout", op.name()))
            })?;
            self.host.clear();
            self.host.resize(cx.batch.rows.len() * width, 0.0);
            be.side(1 - s)?.download(*b, cx, &mut self.host)?;
            be.side(s)?.upload(*b, cx, &self.host)?;
            self.valid[b.index()] |= bit;
            self.copies += 1;
        }
        Ok(())
    }

    /// Records that `op` ran on side `s`: what it wrote now lives there only.
    fn wrote(&mut self, op: &Op, s: usize) {
        let valid = &mut self.valid;
        op.access(|_| {}, |b| valid[b.index()] = 1 << s);
    }
}

impl Default for Executor {
    fn default() -> Executor {
        let group = std::env::var("DS4_EXEC_GROUP").map_or(true, |v| v.trim() != "0");
        Executor {
            sched: Sched::default(),
            places: Vec::new(),
            placed: Placed::default(),
            native: true,
            group,
            forced: 0,
            sig: None,
            placements: 0,
            res: Residency::default(),
        }
    }
}

fn exec_err(what: impl Into<String>) -> Error {
    Error::Backend { backend: "exec", what: what.into() }
}

impl Executor {
    /// Places `g` on `backend` and runs every node, bracketed by [`Backend::begin_tick`] and
    /// [`Backend::end_tick`]. Fails with the first kernel error, or if the graph has a cycle.
    pub fn run(&mut self, g: &Graph, backend: &dyn Backend, cx: &mut StepCtx<'_>) -> Result<()> {
        self.run_on(g, backend, None, cx)
    }

    /// Like [`Executor::run`], with `fallback` (the CPU, as host fallback) taking the nodes `primary` has no
    /// kernel for and the op kinds forced there ([`Executor::force_fallback`]), and the copies between the two
    /// inserted where a tensor's residency changes (see the module docs).
    pub fn run_on(
        &mut self,
        g: &Graph,
        primary: &dyn Backend,
        fallback: Option<&dyn Backend>,
        cx: &mut StepCtx<'_>,
    ) -> Result<()> {
        let rows = cx.batch.rows.len();
        let sig = self.signature(g, primary, fallback, cx.model, rows);
        if self.sig != Some(sig) || self.places.len() != g.nodes.len() {
            self.sig = None;
            self.place(g, primary, fallback, cx.model, rows)?;
            self.sig = Some(sig);
        }
        let be = Pair { primary, fallback };
        let two = fallback.is_some();
        if two {
            self.res.begin(BufId::FIXED + cx.model.config.n_layers);
        }
        primary.begin_tick(cx)?;
        if let Some(f) = fallback {
            f.begin_tick(cx)?;
        }
        let (places, res) = (&self.places, &mut self.res);
        let grouping = self.group && primary.runs_groups();
        self.sched.run(g, places, grouping, |nodes, ops| {
            if nodes.len() > 1 {
                if two {
                    ops.iter().try_for_each(|op| res.inputs_on(op, 0, be, cx))?;
                }
                primary.run_group(ops, cx)?;
                if two {
                    ops.iter().for_each(|op| res.wrote(op, 0));
                }
                return Ok(());
            }
            let (i, op) = (nodes[0], &ops[0]);
            let s = matches!(places[i], Place::Fallback) as usize;
            if two {
                match places[i] {
                    Place::InStage => return Ok(()),
                    Place::Stage => {
                        let &(_, a, b) = g.stages.iter().find(|st| (st.1..st.2).contains(&i)).expect("a stage");
                        for j in a..b {
                            res.inputs_on(&g.nodes[j].op, 0, be, cx)?;
                            res.wrote(&g.nodes[j].op, 0);
                        }
                    }
                    _ => res.inputs_on(op, s, be, cx)?,
                }
            }
            match places[i] {
                Place::Native(o) => {
                    if !primary.run_native(op, &o.kernel, cx)? {
                        primary.run_node(op, cx)?;
                    }
                }
                Place::Portable => primary.run_node(op, cx)?,
                Place::Fallback => be.side(1)?.run_node(op, cx)?,
                Place::Stage => primary.run_stage(g.nodes[i].stage, cx)?,
                Place::InStage => {}
            }
            if two {
                res.wrote(op, s);
            }
            Ok(())
        })?;
        if let Some(f) = fallback {
            f.end_tick(cx)?;
        }
        primary.end_tick(cx)
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

    /// Sends every node of op kind `kind` ([`Op::kind`]) to the fallback backend when a run has one (`on`), or
    /// stops doing so.
    pub fn force_fallback(&mut self, kind: usize, on: bool) {
        if kind < Op::KINDS.len() {
            self.forced = if on { self.forced | 1 << kind } else { self.forced & !(1 << kind) };
        }
    }

    /// Copies between the backends inserted by the last run (0 without a fallback).
    pub fn copies(&self) -> usize {
        self.res.copies
    }

    /// How many times a placement was computed (a run reuses the last one when its signature is unchanged).
    pub fn placements(&self) -> u64 {
        self.placements
    }

    /// Nodes per kind of placement in the last placement.
    pub fn placed(&self) -> Placed {
        self.placed
    }

    /// What a placement depends on, hashed: the backends, the model, the batch size, the options, and each
    /// node's kind, weight and width (the recipe's nodes are otherwise a function of these).
    fn signature(
        &self,
        g: &Graph,
        primary: &dyn Backend,
        fallback: Option<&dyn Backend>,
        model: &Model,
        rows: usize,
    ) -> u64 {
        // FNV-1a over 64-bit words.
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut mix = |v: u64| h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3);
        mix(primary as *const dyn Backend as *const () as u64 ^ primary.name().as_ptr() as u64);
        mix(fallback.map_or(0, |f| f as *const dyn Backend as *const () as u64));
        mix(model as *const Model as u64);
        mix(rows as u64);
        mix(u64::from(self.forced) << 2 | u64::from(self.native) << 1 | u64::from(self.group));
        mix(g.nodes.len() as u64);
        for n in &g.nodes {
            let w = match n.op {
                Op::MatMul { w, .. } | Op::GroupedMatMul { w, .. } => u64::from(w.0),
                Op::RmsNorm { width, .. }
                | Op::Rope { width, .. }
                | Op::ActSim { width, .. }
                | Op::Scale { width, .. } => width as u64,
                Op::ExpertUp { layer, .. } | Op::ExpertDown { layer, .. } | Op::SwiGlu { layer } => layer as u64,
                _ => 0,
            };
            mix(n.op.kind() as u64 | w << 8);
        }
        h
    }

    /// Places every node of `g` (see the module docs) into [`Executor::places`]; `rows` is the batch size. Fails
    /// when a node forced to the fallback cannot go there (it touches the KV pages, or a tensor without a host
    /// layout).
    pub fn place(
        &mut self,
        g: &Graph,
        backend: &dyn Backend,
        fallback: Option<&dyn Backend>,
        model: &Model,
        rows: usize,
    ) -> Result<Placed> {
        self.placements += 1;
        self.places.clear();
        self.placed = Placed::default();
        let mut placed = Placed::default();
        for &(_, a, b) in &g.stages {
            let start = self.places.len();
            let mut whole = false;
            for i in a..b {
                let op = &g.nodes[i].op;
                let fb = fallback.filter(|f| f.supports(op, model));
                if fb.is_some() && self.forced & (1 << op.kind()) != 0 {
                    movable(op, model).map_err(|e| exec_err(format!("node {i} ({}): {e}", op.name())))?;
                    self.places.push(Place::Fallback);
                    continue;
                }
                let native = if self.native {
                    let shape = ds4_kernels_native::Shape { rows, width: native_width(op, model) };
                    ds4_kernels_native::find(op.name(), backend.name(), &shape)
                } else {
                    None
                };
                match native {
                    Some(o) => self.places.push(Place::Native(o)),
                    None if backend.supports(op, model) => self.places.push(Place::Portable),
                    None if fb.is_some() && movable(op, model).is_ok() => self.places.push(Place::Fallback),
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
                        Place::Fallback => placed.fallback += 1,
                        _ => placed.portable += 1,
                    }
                }
            }
        }
        self.placed = placed;
        Ok(placed)
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

/// Whether `op` may run away from the primary backend: every tensor it touches has a host layout
/// ([`BufId::host_width`]); the KV pages stay where they live.
fn movable(op: &Op, model: &Model) -> std::result::Result<(), String> {
    let bad = std::cell::Cell::new(None);
    let note = |b: BufId| {
        // The KV pages are the reason to name first.
        if b.host_width(&model.config).is_none() && !matches!(bad.get(), Some(BufId::Kv(_))) {
            bad.set(Some(b));
        }
    };
    op.access(note, note);
    match bad.get() {
        None => Ok(()),
        Some(BufId::Kv(l)) => Err(format!("it touches layer {l}'s KV pages, which stay with the primary backend")),
        Some(b) => Err(format!("{b:?} has a backend-private layout (no host copy)")),
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
pub(crate) mod tests {
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
                let mut cx =
                    StepCtx { model: &model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim: true };
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
        let err = run(&[kind("kv_store")]).unwrap_err().to_string();
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
}
