//! Executors: run a [`Graph`] on a [`Backend`].
//!
//! [`Executor::run`] walks the graph in a topological order driven by dependency counters (Kahn's algorithm): a
//! job becomes ready when every job it depends on has finished. Ops mutate shared tick state ([`StepCtx`]), so this
//! executor runs ready jobs one at a time on the calling thread, in ascending job order; parallelism lives inside
//! the ops (the backend's worker pool). Its vectors are reused across ticks (no allocation in the decode loop).
//!
//! Op timing ([`Executor::time_ops`]) adds up the wall time of each op kind ([`Op::KINDS`]) across runs, for
//! finding where a tick's time goes (`ds4-bench` prints it per decoded token). It measures how long `run_op` took
//! on the calling thread: on the CPU backend that is the op's work; on wgpu, which submits the tick once, mostly
//! recording time.

use crate::backend::{Backend, StepCtx};
use crate::graph::{Graph, Op};
use crate::{Error, Result};

/// Wall time per op kind, summed over the ticks run while timing was on (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTimes {
    /// Time per kind, indexed like [`Op::KINDS`].
    pub by_kind: [std::time::Duration; Op::KINDS.len()],
    /// Ops run per kind.
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

/// A reusable executor. See the module docs.
#[derive(Debug, Default)]
pub struct Executor {
    remaining: Vec<usize>,
    ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>>,
    /// Order in which the last run executed the jobs (for tests and tracing).
    pub order: Vec<usize>,
    times: Option<OpTimes>,
}

impl Executor {
    /// Runs every job of `g` on `backend`, bracketed by [`Backend::begin_tick`] and [`Backend::end_tick`]. Fails
    /// with the first op error, or if the graph has a cycle.
    pub fn run(&mut self, g: &Graph, backend: &dyn Backend, cx: &mut StepCtx<'_>) -> Result<()> {
        backend.begin_tick(cx)?;
        self.run_with(g, |op| backend.run_op(op, cx))?;
        backend.end_tick(cx)
    }

    /// Turns op timing on (counters start at zero) or off (counters dropped).
    pub fn time_ops(&mut self, on: bool) {
        self.times = on.then(OpTimes::default);
    }

    /// The op times summed since timing was turned on or last taken, and restarts the count; `None` when timing
    /// is off.
    pub fn take_op_times(&mut self) -> Option<OpTimes> {
        self.times.as_mut().map(std::mem::take)
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
        if let Some(t) = &mut self.times {
            t.runs += 1;
        }
        while let Some(std::cmp::Reverse(j)) = self.ready.pop() {
            let op = g.jobs[j].op;
            match &mut self.times {
                Some(t) => {
                    let t0 = std::time::Instant::now();
                    let r = f(op);
                    t.by_kind[op.kind()] += t0.elapsed();
                    t.calls[op.kind()] += 1;
                    r?
                }
                None => f(op)?,
            }
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
    fn op_times_count_every_op_by_kind() {
        let mut g = Graph::default();
        g.build(2);
        let mut ex = Executor::default();
        assert_eq!(ex.take_op_times(), None, "off by default");
        ex.time_ops(true);
        for _ in 0..3 {
            ex.run_with(&g, |op| {
                if matches!(op, Op::Moe { .. }) {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Ok(())
            })
            .unwrap();
        }
        let t = ex.take_op_times().unwrap();
        assert_eq!(t.runs, 3);
        for (k, name) in Op::KINDS.iter().enumerate() {
            let n = g.jobs.iter().filter(|j| j.op.kind() == k).count() as u64;
            assert_eq!(t.calls[k], 3 * n, "{name}");
        }
        assert_eq!(t.calls.iter().sum::<u64>(), 3 * g.jobs.len() as u64);
        // Six MoE ops slept 2 ms each: the largest share, and at least that much.
        assert!(t.by_kind[Op::Moe { layer: 0 }.kind()] >= std::time::Duration::from_millis(12));
        assert_eq!(t.ranked()[0].0, "moe");
        // Taking restarts the count; turning off drops it.
        assert_eq!(ex.take_op_times().unwrap().runs, 0);
        ex.time_ops(false);
        assert_eq!(ex.take_op_times(), None);
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
