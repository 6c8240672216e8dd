//! The executor: places a tick's [`Graph`] on a [`Backend`] and runs it.
//!
//! The module is split by concern: placement and its report ([`place`]), residency copies between two backends
//! ([`residency`]), the scheduler ([`sched`]) and op timing ([`times`]); this file holds the [`Executor`] that
//! ties them together.
//!
//! Placement ([`Executor::place`]): each node goes to a native override from `ds4_kernels_native` when one is
//! registered for its typed key ([`node_key`]: the backend, the op kind, the weight type, the expert layout and
//! the batch-shape class, plus the exact sizes the override's predicate checks), else to the backend's portable
//! kernel ([`Backend::supports`]), else — when the run has a fallback backend (the CPU as host fallback,
//! [`Executor::run_on`]) that can take it — to the fallback's portable kernel. Op kinds can also be sent to the
//! fallback on purpose ([`Executor::force_fallback`]: tests, and the seam a device backend without some kernel
//! uses; [`Placement`] — `--placement experts=cpu` — is the user's form). A node that touches a layer's KV pages
//! stays with the primary backend: forcing it elsewhere is an error. A tensor whose layout is a backend's own
//! ([`BufId::host_width`] is `None`: the routes, the expert slot rows, the selection, the logits) is never copied,
//! so every node that uses it must run on one side (an MoE layer's route, expert products and combine move
//! together; placement fails otherwise), and a [`Op::Readback`] runs where its tensor was written. A stage
//! containing a node nobody can run is placed whole on [`Backend::run_stage`] (the layer-level path). A run reuses
//! the last placement when its signature (the
//! backends, the model, the batch size, the options, each node's kind, weight and width) is unchanged, so a
//! steady decode loop places once ([`Executor::placements`]). [`Executor::placement_report`] says which backend
//! and kernel runs each node (`--placement-report` on `ds4` and `ds4-bench`).
//!
//! Adding an override for one op: one file with the kernel and its registry row (a `Pattern` — backend, op kind,
//! and optionally weight type, expert layout, shape class — a predicate on sizes, and the kernel), e.g.
//! `kernels-native/src/cpu/swiglu.rs`, plus one line in `ds4_kernels_native::OVERRIDES`. Only a new kernel
//! signature also needs a `NativeKernel` variant that the hosting backend's [`Backend::run_native`] learns once.
//!
//! Residency: without a fallback every tensor lives with the one backend and nothing is copied (the CPU-only
//! path does no residency work at all). With one, the executor tracks where each tensor's current value is
//! (primary, fallback or both; the KV pages start with the primary) and, before a node runs, copies each of its
//! inputs ([`Op::inputs`]: what it reads and what it updates in place) that is only on the other side — a
//! [`Backend::download`] into one reused host buffer, then a [`Backend::upload`] — so copies happen exactly where
//! residency changes ([`Executor::copies`]); what a node writes then lives on its side only. The host tensors of a
//! tick come back through the recipe's [`Op::Readback`] nodes (the logits), no-ops on the CPU.
//!
//! Running ([`Executor::run`]) is Kahn's algorithm over the graph's precomputed dependency counts and dependents:
//! a node becomes ready when every node it depends on has finished. Ready nodes run on the calling thread, lowest
//! index first (so a tick runs in recipe order); the parallelism lives inside the kernels (the CPU worker pool
//! splits each product over every core). Its vectors are reused across ticks (no allocation in the decode loop).
//!
//! Grouping: on a backend that [`Backend::runs_groups`] (the CPU: the group's products share its worker pool;
//! wgpu with fusion on: products of one input, weight type and width become one dispatch), when the next node is a weight product placed
//! on the portable kernel, every other such product ready at that moment (up to [`MAX_GROUP`]) joins it and they
//! go to [`Backend::run_group`] together — the projections of one normed input (`wq_a`, `wkv`, the compressor's
//! and the indexer's), then `wq_b` with the indexer's query. Ready nodes are independent by construction (a
//! conflict on a tensor is an edge), so only the scheduling changes, never a kernel's inputs. Other backends see
//! every node alone, in order. `DS4_EXEC_GROUP=0` (environment, read by
//! [`Executor::default`]) or [`Executor::group_nodes`] turns grouping off.
//!
//! Op timing ([`Executor::time_ops`]) adds up the wall time of each op kind ([`Op::KINDS`]; a stage run whole
//! counts as `"stage"`) across runs, for finding where a tick's time goes (`ds4-bench` prints it per decoded
//! token). On wgpu, whose nodes record into one encoder submitted by the readback, the readback holds the device
//! time and every other node its recording time.

mod offload;
mod place;
mod residency;
mod sched;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
pub(crate) mod tests;
mod times;

pub use offload::Placement;
pub use place::{node_key, weight_type, NodePlacement, Place, Placed, PlacementReport};
pub use residency::CopiedBytes;
pub use sched::MAX_GROUP;
pub use times::OpTimes;

use residency::{Pair, Residency};
use sched::Sched;

use crate::backend::{Backend, BackendKind, StepCtx};
use crate::graph::{BufId, Graph, Op};
use crate::model::Model;
use crate::{Error, Result};

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
    /// Nodes writing these tensors are sent to the fallback too ([`Executor::force_writers_of`]), as a bit set of
    /// [`BufId::index`] below 64.
    forced_writes: u64,
    /// Signature of the inputs of the last placement, and how many placements were computed.
    sig: Option<u64>,
    placements: u64,
    res: Residency,
    /// The registry key of each node of the last placement, and the backends it was for (primary, fallback).
    keys: Vec<ds4_kernels_native::NodeKey>,
    sides: (BackendKind, Option<BackendKind>),
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
            forced_writes: 0,
            sig: None,
            placements: 0,
            res: Residency::default(),
            keys: Vec::new(),
            sides: (BackendKind::Cpu, None),
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
            self.res.begin(BufId::FIXED + cx.model.config.n_layers, rows, !primary.kv_on_device());
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

    /// Sends every node that writes tensor `buf` (one of the first 64 [`BufId`]s: the per-tick activations) to the
    /// fallback backend when a run has one (`on`) — e.g. the router's product, whose scores only the MoE route
    /// reads — or stops doing so.
    pub fn force_writers_of(&mut self, buf: BufId, on: bool) {
        if buf.index() < 64 {
            let bit = 1u64 << buf.index();
            self.forced_writes = if on { self.forced_writes | bit } else { self.forced_writes & !bit };
        }
    }

    /// Copies between the backends inserted by the last run (0 without a fallback).
    pub fn copies(&self) -> usize {
        self.res.copies
    }

    /// Bytes the copies of the last run moved, each way (zero without a fallback).
    pub fn copied_bytes(&self) -> CopiedBytes {
        self.res.bytes
    }

    /// Copies the last run's final value of tensor `id` (one with a host layout) into `out`, from the backend that
    /// holds it: the primary, or the fallback when the run's last writer of `id` was placed there.
    pub fn download_final(
        &self,
        id: BufId,
        primary: &dyn Backend,
        fallback: Option<&dyn Backend>,
        cx: &mut StepCtx<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        match fallback {
            Some(f) if self.res.only_on_fallback(id) => f.download(id, cx, out),
            _ => primary.download(id, cx, out),
        }
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
        mix(self.forced_writes);
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
