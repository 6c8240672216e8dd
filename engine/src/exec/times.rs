//! Op timing: wall time per op kind, summed over the ticks run while timing is on (see [`super`]'s docs).

use crate::graph::Op;

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
