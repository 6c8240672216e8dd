//! The scheduler: Kahn's algorithm over a graph's precomputed dependency counts, with optional grouping of ready
//! weight products (see [`super`]'s docs).

use super::place::Place;
use super::times::OpTimes;
use crate::graph::{Graph, Op};
use crate::{Error, Result};

/// Most nodes run as one group (see the module docs).
pub const MAX_GROUP: usize = 8;

/// The scheduler's reusable state.
#[derive(Debug, Default)]
pub(super) struct Sched {
    pub(super) remaining: Vec<usize>,
    ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>>,
    pub(super) order: Vec<usize>,
    /// The nodes (and their ops) run in the current step: one node, or a group.
    group: Vec<usize>,
    group_ops: Vec<Op>,
    pub(super) times: Option<OpTimes>,
}

impl Sched {
    pub(super) fn run(
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
