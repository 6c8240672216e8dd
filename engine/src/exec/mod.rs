//! Executors: run a [`Graph`] on a [`Backend`].
//!
//! [`Executor::run`] walks the graph in a topological order driven by dependency counters (Kahn's algorithm): a
//! job becomes ready when every job it depends on has finished. Ops mutate shared tick state ([`StepCtx`]), so this
//! executor runs ready jobs one at a time on the calling thread, in ascending job order; parallelism lives inside
//! the ops (the backend's worker pool). Its vectors are reused across ticks (no allocation in the decode loop).

use crate::backend::{Backend, StepCtx};
use crate::graph::{Graph, Op};
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
    /// Runs every job of `g` on `backend`, bracketed by [`Backend::begin_tick`] and [`Backend::end_tick`]. Fails
    /// with the first op error, or if the graph has a cycle.
    pub fn run(&mut self, g: &Graph, backend: &dyn Backend, cx: &mut StepCtx<'_>) -> Result<()> {
        backend.begin_tick(cx)?;
        self.run_with(g, |op| backend.run_op(op, cx))?;
        backend.end_tick(cx)
    }

    /// Runs every job of `g` through `f`, in dependency order (ties: lowest job index first).
    pub fn run_with(&mut self, g: &Graph, mut f: impl FnMut(Op) -> Result<()>) -> Result<()> {
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
            f(g.jobs[j].op)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Job, Sub};

    #[test]
    fn runs_jobs_in_dependency_order() {
        let mut g = Graph::default();
        g.build(3);
        let mut ex = Executor::default();
        let mut ops = Vec::new();
        ex.run_with(&g, |op| {
            ops.push(op);
            Ok(())
        })
        .unwrap();
        assert_eq!(ops.len(), g.jobs.len());
        assert_eq!(ops[0], Op::Embed);
        assert_eq!(ops[1], Op::HcPre { layer: 0, sub: Sub::Attn });
        assert_eq!(*ops.last().unwrap(), Op::Logits);
        // Every edge is respected.
        let pos = |j: usize| ex.order.iter().position(|&x| x == j).unwrap();
        assert!(g.edges.iter().all(|&(a, b)| pos(a) < pos(b)));
    }

    #[test]
    fn stops_at_the_first_error_and_detects_cycles() {
        let mut g = Graph::default();
        g.build(1);
        let mut ex = Executor::default();
        let mut n = 0;
        let r = ex.run_with(&g, |op| {
            n += 1;
            if op == (Op::Attention { layer: 0 }) {
                return Err(Error::Backend { backend: "test", what: "boom".into() });
            }
            Ok(())
        });
        assert!(r.is_err());
        assert_eq!(n, 3);
        // A two-job cycle never becomes ready.
        let mut cyc = Graph::default();
        cyc.jobs = vec![Job { op: Op::Embed, deps: 1 }, Job { op: Op::Logits, deps: 1 }];
        cyc.edges = vec![(0, 1), (1, 0)];
        assert!(ex.run_with(&cyc, |_| Ok(())).is_err());
    }
}
