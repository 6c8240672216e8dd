//! Placement: which backend and kernel runs each node of a graph (see [`super`]'s docs), looked up by the typed
//! key of the override registry ([`NodeKey`]: backend, op kind, weight type, expert layout, shape class), and the
//! report of it ([`PlacementReport`]).

use std::fmt;

use ds4_kernels_native::{BackendKind, ExpertLayout, NodeKey, Override, ShapeClass, WeightType};

use super::{exec_err, Executor};
use crate::backend::Backend;
use crate::graph::{BufId, Experts, Graph, Op, Stage};
use crate::model::Model;
use crate::quant::GgmlType;
use crate::Result;

/// Where a node runs (see the module docs).
#[derive(Clone, Copy, Debug)]
pub enum Place {
    /// A native override (on the primary backend).
    Native(&'static Override),
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

/// The registry's weight type of a ggml type.
pub fn weight_type(ty: GgmlType) -> WeightType {
    match ty {
        GgmlType::F32 => WeightType::F32,
        GgmlType::F16 => WeightType::F16,
        GgmlType::Bf16 => WeightType::Bf16,
        GgmlType::Q8_0 => WeightType::Q8_0,
        GgmlType::Q2K => WeightType::Q2K,
        GgmlType::Q4K => WeightType::Q4K,
        GgmlType::Iq2Xxs => WeightType::Iq2Xxs,
        _ => WeightType::Other,
    }
}

/// The key the placement looks `op` up by on `backend`, for a tick of `rows` rows of `model`.
pub fn node_key(op: &Op, model: &Model, backend: BackendKind, rows: usize) -> NodeKey {
    let c = &model.config;
    let ty = |w: crate::model::WeightId| Some(weight_type(model.table.types[w.0 as usize]));
    let layout = |e: Experts| {
        Some(match e {
            Experts::PerRow => ExpertLayout::PerRow,
            Experts::ByExpert => ExpertLayout::ByExpert,
        })
    };
    let (weight, experts) = match *op {
        Op::MatMul { w, .. } | Op::GroupedMatMul { w, .. } => (ty(w), None),
        Op::Embed => (ty(model.global.embed), None),
        Op::Logits => (ty(model.global.head), None),
        Op::ExpertUp { layer, experts } | Op::ExpertDown { layer, experts } => {
            (ty(model.layers[layer].gate_exps), layout(experts))
        }
        Op::SwiGlu { layer } => (ty(model.layers[layer].gate_exps), None),
        Op::MoeRoute { experts, .. } | Op::MoeCombine { experts } => (None, layout(experts)),
        _ => (None, None),
    };
    let width = match *op {
        Op::SwiGlu { .. } | Op::ExpertUp { .. } | Op::ExpertDown { .. } => c.expert_ffn,
        Op::RmsNorm { width, .. } | Op::Rope { width, .. } | Op::ActSim { width, .. } | Op::Scale { width, .. } => {
            width
        }
        _ => c.d_model,
    };
    NodeKey { backend, op: op.op_kind(), weight, experts, shape: ShapeClass::of(rows), rows, width }
}

impl Executor {
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
        self.keys.clear();
        self.placed = Placed::default();
        self.sides = (backend.kind(), fallback.map(|f| f.kind()));
        let mut placed = Placed::default();
        for &(_, a, b) in &g.stages {
            let start = self.places.len();
            let mut whole = false;
            for i in a..b {
                let op = &g.nodes[i].op;
                let key = node_key(op, model, backend.kind(), rows);
                self.keys.push(key);
                let fb = fallback.filter(|f| f.supports(op, model));
                let forced = self.forced & (1 << op.kind()) != 0
                    || writes_any(op, self.forced_writes)
                    || readback_of_fallback(g, &self.places, i);
                if fb.is_some() && forced {
                    off_kv(op).map_err(|e| exec_err(format!("node {i} ({}): {e}", op.name())))?;
                    self.places.push(Place::Fallback);
                    continue;
                }
                let native = if self.native { ds4_kernels_native::find(&key) } else { None };
                match native {
                    Some(o) => self.places.push(Place::Native(o)),
                    None if backend.supports(op, model) => self.places.push(Place::Portable),
                    // With the KV in host memory (the primary keeps none on its device), a node may go to the
                    // fallback whatever it touches; the private tensors are checked to stay on one side below.
                    None if fb.is_some() && (!backend.kv_on_device() || movable(op, model).is_ok()) => {
                        self.places.push(Place::Fallback)
                    }
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
                self.keys.truncate(start);
                self.keys.extend((a..b).map(|i| node_key(&g.nodes[i].op, model, backend.kind(), rows)));
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
        if placed.fallback > 0 {
            private_on_one_side(g, &self.places, model)?;
        }
        self.placed = placed;
        Ok(placed)
    }

    /// The last placement, node by node: which backend and kernel runs each node of `g` (the graph it was
    /// computed for; see [`PlacementReport`]). Empty before the first placement.
    pub fn placement_report(&self, g: &Graph) -> PlacementReport {
        let n = self.places.len().min(self.keys.len()).min(g.nodes.len());
        let (primary, fallback) = self.sides;
        let nodes = (0..n)
            .map(|i| {
                let (backend, kernel) = match self.places[i] {
                    Place::Native(o) => (primary, o.name),
                    Place::Portable => (primary, "portable"),
                    Place::Fallback => (fallback.unwrap_or(primary), "portable"),
                    Place::Stage | Place::InStage => (primary, "stage"),
                };
                NodePlacement { node: i, stage: g.nodes[i].stage, key: self.keys[i], backend, kernel }
            })
            .collect();
        PlacementReport { primary, fallback, placed: self.placed, nodes }
    }
}

/// Whether `op` writes a tensor of the bit set `bufs` ([`BufId::index`] below 64).
fn writes_any(op: &Op, bufs: u64) -> bool {
    let mut hit = false;
    if bufs != 0 {
        op.access(|_| {}, |b| hit |= b.index() < 64 && bufs & (1 << b.index()) != 0);
    }
    hit
}

/// Whether node `i` is a readback ([`Op::Readback`]) of a tensor last written by a node placed on the fallback:
/// it then runs there too (it reads a tensor in that backend's own layout; on the CPU it is a no-op).
fn readback_of_fallback(g: &Graph, places: &[Place], i: usize) -> bool {
    let Op::Readback { buf } = g.nodes[i].op else { return false };
    let writes = |j: usize| {
        let mut hit = false;
        g.nodes[j].op.access(|_| {}, |b| hit |= b == buf);
        hit
    };
    (0..i.min(places.len())).rev().find(|&j| writes(j)).is_some_and(|j| matches!(places[j], Place::Fallback))
}

/// Whether `op` may be sent to the fallback on purpose: it does not touch a layer's KV pages, which stay where
/// they live.
fn off_kv(op: &Op) -> std::result::Result<(), String> {
    let kv = std::cell::Cell::new(None);
    let note = |b: BufId| {
        if matches!(b, BufId::Kv(_)) {
            kv.set(Some(b));
        }
    };
    op.access(note, note);
    match kv.get() {
        Some(BufId::Kv(l)) => Err(format!("it touches layer {l}'s KV pages, which stay with the primary backend")),
        _ => Ok(()),
    }
}

/// Every tensor in a backend's own layout ([`BufId::host_width`] is `None`: the routes, the expert rows) is
/// touched by nodes of one side only, since the executor cannot copy it: a group of nodes that passes such
/// tensors between each other (an MoE layer's route, expert products and combine) moves as a whole or not at all.
fn private_on_one_side(g: &Graph, places: &[Place], model: &Model) -> Result<()> {
    let mut first: Vec<(BufId, usize)> = Vec::new();
    for (i, (node, place)) in g.nodes.iter().zip(places).enumerate() {
        if matches!(place, Place::InStage) {
            continue;
        }
        let side = usize::from(matches!(place, Place::Fallback));
        let touched = std::cell::RefCell::new(Vec::new());
        let note = |b: BufId| {
            if b.host_width(&model.config).is_none() && !matches!(b, BufId::Kv(_)) {
                touched.borrow_mut().push(b);
            }
        };
        node.op.access(note, note);
        let mut clash = None;
        for b in touched.into_inner() {
            match first.iter().find(|f| f.0 == b) {
                Some(&(_, j)) if usize::from(matches!(places[j], Place::Fallback)) != side => clash = Some((b, j)),
                Some(_) => {}
                None => first.push((b, i)),
            }
        }
        if let Some((b, j)) = clash {
            return Err(exec_err(format!(
                "node {i} ({}): {b:?} has a backend-private layout (no host copy), and node {j} ({}) uses it on the \
                 other backend: place them together",
                node.op.name(),
                g.nodes[j].op.name()
            )));
        }
    }
    Ok(())
}

/// Whether `op` may run away from the primary backend: every tensor it touches has a host layout
/// ([`BufId::host_width`]); the KV pages stay where they live.
pub(super) fn movable(op: &Op, model: &Model) -> std::result::Result<(), String> {
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

/// Where one node was placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodePlacement {
    /// Index in the graph.
    pub node: usize,
    pub stage: Stage,
    /// The key the registry was asked with (its `backend` is the primary's).
    pub key: NodeKey,
    /// The backend that runs it.
    pub backend: BackendKind,
    /// The override's name, `"portable"` (the backend's own kernel) or `"stage"` (inside a stage run whole).
    pub kernel: &'static str,
}

/// Which backend and kernel ran each node of a placed graph ([`Executor::placement_report`]). Its `Display` is
/// a summary table (one line per distinct op kind, weight type, expert layout, shape class, backend and kernel,
/// with the node count, in graph order); [`PlacementReport::nodes`] has every node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlacementReport {
    pub primary: BackendKind,
    pub fallback: Option<BackendKind>,
    pub placed: Placed,
    pub nodes: Vec<NodePlacement>,
}

impl PlacementReport {
    /// `(line, nodes)` of the summary, in order of first appearance.
    pub fn summary(&self) -> Vec<(String, usize)> {
        let mut lines: Vec<(String, usize)> = Vec::new();
        for n in &self.nodes {
            let k = &n.key;
            let weight = k.weight.map_or("-".to_string(), |w| format!("{w:?}"));
            let experts = k.experts.map_or("-".to_string(), |e| format!("{e:?}"));
            let line = format!(
                "{:<18} {:<8} {:<9} {:<8} {:<7} {}",
                k.op.name(),
                weight,
                experts,
                format!("{:?}", k.shape),
                n.backend.name(),
                n.kernel
            );
            match lines.iter_mut().find(|l| l.0 == line) {
                Some(l) => l.1 += 1,
                None => lines.push((line, 1)),
            }
        }
        lines
    }
}

impl fmt::Display for PlacementReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.placed;
        let fb = self.fallback.map_or(String::new(), |b| format!(", fallback {b}"));
        writeln!(
            f,
            "# placement on {}{fb}: {} nodes (native {}, portable {}, fallback {}, in whole stages {})",
            self.primary,
            self.nodes.len(),
            p.native,
            p.portable,
            p.fallback,
            p.staged
        )?;
        writeln!(f, "{:<18} {:<8} {:<9} {:<8} {:<7} kernel  nodes", "op", "weight", "experts", "shape", "backend")?;
        for (line, n) in self.summary() {
            writeln!(f, "{line}  {n}")?;
        }
        Ok(())
    }
}
