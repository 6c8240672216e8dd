//! `auto` speculation: keep drafting for a session only while its drafts pay for their cost.
//!
//! A verify run that drafted `k` tokens delivers `1 + a` tokens (`a` of the drafts stood) and costs `c` plain decode
//! ticks: the drafter's ticks plus a verify tick over `1 + k` rows, over a one-row decode tick. [`TickCost`] measures
//! `c` as the caller runs (running means of both kinds of tick); [`AutoPause`] watches a session's last
//! [`AUTO_WINDOW`] verify runs and, when they delivered fewer tokens per run than they cost (`1 + a < c`), pauses its
//! speculation for [`AUTO_PAUSE`] tokens, then tries again. Used by the server's scheduler (per session, one shared
//! cost), by `ds4 run/chat` (per turn) and by [`crate::engine::Engine::generate_speculative_auto`] (`ds4 generate`).

/// Verify runs `auto` judges a session on.
pub const AUTO_WINDOW: usize = 8;
/// The cost of a verify run in plain decode ticks before it has been measured (about what `ds4-bench speculate`
/// finds for 3 drafts on the Flash shapes, drafter excluded).
pub const DEFAULT_COST: f64 = 1.5;
/// Tokens a paused session decodes plainly before it drafts again.
pub const AUTO_PAUSE: usize = 64;

/// Running means (exponential, weight 1/16) of what a plain decode tick and a speculative cycle (drafting plus its
/// verify tick) take; their ratio is what a verify run costs in plain ticks.
#[derive(Debug, Default, Clone, Copy)]
pub struct TickCost {
    plain: Option<f64>,
    spec: Option<f64>,
}

impl TickCost {
    fn update(v: &mut Option<f64>, secs: f64) {
        *v = Some(match *v {
            None => secs,
            Some(m) => m + (secs - m) / 16.0,
        });
    }

    /// A tick that only decoded (no verify run) took `secs`.
    pub fn plain_tick(&mut self, secs: f64) {
        Self::update(&mut self.plain, secs);
    }

    /// A tick with verify runs took `secs`, drafting included.
    pub fn spec_tick(&mut self, secs: f64) {
        Self::update(&mut self.spec, secs);
    }

    /// A verify run's cost in plain decode ticks ([`DEFAULT_COST`] until both kinds of tick were measured).
    pub fn ratio(&self) -> f64 {
        match (self.plain, self.spec) {
            (Some(p), Some(s)) if p > 0.0 => s / p,
            _ => DEFAULT_COST,
        }
    }
}

/// One session's `auto` state (see the module docs).
#[derive(Debug, Default, Clone)]
pub struct AutoPause {
    /// Accepted drafted tokens of the recent verify runs (at most [`AUTO_WINDOW`]).
    recent: Vec<usize>,
    /// Generated-token count until which the session decodes plainly.
    paused_until: usize,
}

impl AutoPause {
    /// Whether the session drafts now (`generated`: its tokens so far).
    pub fn drafting(&self, generated: usize) -> bool {
        generated >= self.paused_until
    }

    /// Records a verify run that accepted `accepted` drafted tokens, a run costing `cost` plain ticks; returns true
    /// when this pauses the session.
    pub fn record(&mut self, accepted: usize, generated: usize, cost: f64) -> bool {
        self.recent.push(accepted);
        if self.recent.len() > AUTO_WINDOW {
            self.recent.remove(0);
        }
        let mean = self.recent.iter().sum::<usize>() as f64 / self.recent.len() as f64;
        if self.recent.len() == AUTO_WINDOW && 1.0 + mean < cost {
            self.paused_until = generated + AUTO_PAUSE;
            self.recent.clear();
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_pauses_when_its_runs_deliver_less_than_they_cost() {
        let mut c = TickCost::default();
        assert_eq!(c.ratio(), DEFAULT_COST);
        c.plain_tick(0.010);
        assert_eq!(c.ratio(), DEFAULT_COST, "both kinds of tick are needed");
        c.spec_tick(0.030);
        assert!((c.ratio() - 3.0).abs() < 1e-9);
        c.spec_tick(0.014);
        assert!((c.ratio() - 2.9).abs() < 1e-9, "a running mean: {}", c.ratio());
        let mut p = AutoPause::default();
        // 1.875 tokens per run for runs costing 1.5 ticks: pays.
        for i in 0..3 * AUTO_WINDOW {
            assert!(!p.record(if i % 8 == 0 { 0 } else { 1 }, i, 1.5));
        }
        // The same acceptance at a cost of 2.9 ticks: paused for AUTO_PAUSE tokens, then drafting again.
        assert!((0..AUTO_WINDOW).any(|i| p.record(1, 100 + i, 2.9)));
        assert!(!p.drafting(100 + AUTO_WINDOW));
        assert!(p.drafting(100 + AUTO_WINDOW + AUTO_PAUSE));
    }
}
