//! Speculative decoding in the scheduler (`--speculative`): which decoding sessions draft this tick, and `auto`'s
//! rule for the sessions whose drafts do not pay.
//!
//! A decoding session normally feeds its last sampled token. With a drafter ([`crate::model::Runner::can_draft`])
//! it may feed that token followed by up to `draft_len` drafted tokens as one verify run, in the same tick as
//! everyone else's work; after the tick each draft token is judged in order against the target's logits at its
//! position (`Sampler::verify_drafted`: greedy accepts while the argmax matches, sampling keeps the target's
//! distribution exactly), the accepted ones are emitted as if sampled one by one, the rest are rolled back exactly
//! ([`crate::model::Runner::commit_verify`]), and the token after the last kept one comes from the verify row
//! there (the rejection's replacement, or a fresh draw when every draft stood). Output is what plain decoding
//! gives: token-identical at temperature 0, the same distribution otherwise.
//!
//! Not drafted: sessions under an output grammar (their tokens go through the mask one at a time), sessions with
//! fewer than two tokens of room left (`max_tokens`, context).
//!
//! `auto` pauses speculation for a session whose drafts do not pay for their cost: over its last [`AUTO_WINDOW`]
//! verify runs it delivered `1 + a` tokens per run (`a` accepted drafts on average), and a run costs `c` plain decode
//! ticks — measured as it goes ([`TickCost`]: the drafter's time plus the verify tick's, over the time of ticks that
//! only decode; [`DEFAULT_COST`] until both were seen). When `1 + a < c` the session decodes plainly for
//! [`AUTO_PAUSE`] tokens, then tries again.

/// `--speculative`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMode {
    /// Plain decoding.
    Off,
    /// Draft every eligible token with the model's MTP block.
    Mtp,
    /// Draft every eligible token with the model's DSpark drafter (V4-Flash-0731).
    Dspark,
    /// The model's drafter (the MTP block, else the DSpark drafter) where it has one, paused per session while
    /// its drafts do not pay.
    Auto,
}

impl SpecMode {
    /// The drafter this mode loads (`None` for [`SpecMode::Off`]).
    pub fn drafter(self) -> Option<ds4_engine::speculative::DrafterKind> {
        use ds4_engine::speculative::DrafterKind;
        match self {
            SpecMode::Off => None,
            SpecMode::Mtp => Some(DrafterKind::Mtp),
            SpecMode::Dspark => Some(DrafterKind::Dspark),
            SpecMode::Auto => Some(DrafterKind::Any),
        }
    }
}

impl std::str::FromStr for SpecMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(SpecMode::Off),
            "mtp" => Ok(SpecMode::Mtp),
            "auto" => Ok(SpecMode::Auto),
            "dspark" => Ok(SpecMode::Dspark),
            _ => Err(format!("--speculative {s:?}: expected off, mtp, dspark or auto")),
        }
    }
}

/// Speculative decoding settings.
#[derive(Debug, Clone, Copy)]
pub struct SpecConfig {
    pub mode: SpecMode,
    /// Drafted tokens per verify run at most.
    pub draft_len: usize,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig { mode: SpecMode::Off, draft_len: 3 }
    }
}

pub use ds4_engine::speculative::auto::{AutoPause, TickCost, AUTO_PAUSE, AUTO_WINDOW, DEFAULT_COST};

/// One session's speculation state.
#[derive(Debug, Default)]
pub struct SpecState {
    /// The draft fed behind the session's last token this tick (empty: a plain decode).
    pub draft: Vec<u32>,
    /// The next token, already drawn by a rejected verification (the scheduler emits it instead of sampling).
    pub forced: Option<u32>,
    /// `auto`'s judgement of the session's recent verify runs.
    auto: AutoPause,
}

impl SpecState {
    /// Whether the session drafts now (`generated`: its tokens so far).
    pub fn drafting(&self, mode: SpecMode, generated: usize) -> bool {
        match mode {
            SpecMode::Off => false,
            SpecMode::Mtp | SpecMode::Dspark => true,
            SpecMode::Auto => self.auto.drafting(generated),
        }
    }

    /// Records a verify run that accepted `accepted` drafted tokens, verify runs costing `cost` plain ticks; returns
    /// true when `auto` pauses the session.
    pub fn record(&mut self, mode: SpecMode, accepted: usize, generated: usize, cost: f64) -> bool {
        let paused = self.auto.record(accepted, generated, cost);
        if mode != SpecMode::Auto {
            self.auto = AutoPause::default();
            return false;
        }
        paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_pauses_sessions_whose_drafts_do_not_pay_and_tries_again() {
        let mut s = SpecState::default();
        assert!(s.drafting(SpecMode::Auto, 0));
        for i in 0..AUTO_WINDOW - 1 {
            assert!(!s.record(SpecMode::Auto, 0, i, 1.5));
        }
        assert!(s.record(SpecMode::Auto, 0, 10, 1.5), "a full window of rejected drafts pauses");
        assert!(!s.drafting(SpecMode::Auto, 10 + AUTO_PAUSE - 1));
        assert!(s.drafting(SpecMode::Auto, 10 + AUTO_PAUSE));
        // Drafts that pay keep it on; the same acceptance stops paying when a run costs more than it delivers.
        for i in 0..3 * AUTO_WINDOW {
            assert!(!s.record(SpecMode::Auto, 1, 100 + i, 1.5));
        }
        assert!(s.record(SpecMode::Auto, 1, 200, 2.5), "2 tokens per run for the cost of 2.5 ticks");
        // `mtp` never pauses.
        let mut m = SpecState::default();
        for i in 0..3 * AUTO_WINDOW {
            assert!(!m.record(SpecMode::Mtp, 0, i, 9.0));
        }
        assert!(m.drafting(SpecMode::Mtp, 1000));
        assert!(!m.drafting(SpecMode::Off, 0));
        assert_eq!("dspark".parse::<SpecMode>(), Ok(SpecMode::Dspark));
        assert!("medusa".parse::<SpecMode>().is_err());
        let mut c = TickCost::default();
        assert_eq!(c.ratio(), DEFAULT_COST);
        c.plain_tick(0.010);
        assert_eq!(c.ratio(), DEFAULT_COST, "both kinds of tick are needed");
        c.spec_tick(0.020);
        assert!((c.ratio() - 2.0).abs() < 1e-9);
        assert_eq!("auto".parse::<SpecMode>(), Ok(SpecMode::Auto));
    }
}
