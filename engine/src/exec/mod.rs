//! Executors: run a [`Graph`] on a [`Backend`].
//!
//! [`Executor::run`] walks the graph in a topological order driven by dependency counters (Kahn's algorithm): a
//! job becomes ready when every job it depends on has finished. Ops mutate shared tick state ([`StepCtx`]), so this
//! executor runs ready jobs one at a time on the calling thread, in ascending job order; parallelism lives inside
//! the ops (the backend's worker pool). Its vectors are reused across ticks (no allocation in the decode loop).

use crate::backend::{Backend, StepCtx};
use crate::graph::Graph;
use crate::{Error, Result};

/// A reusable executor. See the module docs.
#[derive(Debug, Default)]
pub struct Executor {
    remaining: Vec<usize>,
    ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>>,
    /// Order in which the last run executed the jobs (for tests and tracing).
    pub order: Vec<usize>,
}

impl Executor {
    /// Runs every job of `g` on `backend`. Fails with the first op error, or if the graph has a cycle.
    pub fn run(&mut self, g: &Graph, backend: &dyn Backend, cx: &mut StepCtx<'_>) -> Result<()> {
        self.remaining.clear();
        self.remaining.extend(g.jobs.iter().map(|j| j.deps));
        self.ready.clear();
        self.order.clear();
        for (i, &d) in self.remaining.iter().enumerate() {
            if d == 0 {
                self.ready.push(std::cmp::Reverse(i));
            }
        }
        while let Some(std::cmp::Reverse(j)) = self.ready.pop() {
            backend.run_op(g.jobs[j].op, cx)?;
            self.order.push(j);
            for &(from, to) in &g.edges {
                if from == j {
                    self.remaining[to] -= 1;
                    if self.remaining[to] == 0 {
                        self.ready.push(std::cmp::Reverse(to));
                    }
                }
            }
        }
        if self.order.len() != g.jobs.len() {
            return Err(Error::Backend { backend: "exec", what: "job graph has a cycle".into() });
        }
        Ok(())
    }
}
