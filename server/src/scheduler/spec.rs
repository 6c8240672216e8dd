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
//! `auto` pauses speculation for a session whose last [`AUTO_WINDOW`] verify runs accepted fewer than
//! [`AUTO_MIN_ACCEPTED`] drafted tokens per run on average: such a run delivers under 1.5 tokens for a tick that
//! verifies `1 + draft_len` rows plus the drafter's work, which on a bandwidth-bound decode costs about what 1.5
//! plain ticks cost on the shapes `ds4-bench speculate` measures. It tries again after [`AUTO_PAUSE`] tokens.

/// `--speculative`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMode {
    /// Plain decoding.
    Off,
    /// Draft every eligible token with the model's MTP block.
    Mtp,
    /// The MTP block where the model has one, paused per session while its drafts do not pay.
    Auto,
}

impl std::str::FromStr for SpecMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(SpecMode::Off),
            "mtp" => Ok(SpecMode::Mtp),
            "auto" => Ok(SpecMode::Auto),
            "dspark" => Err("--speculative dspark: the DSpark drafter is not implemented yet (use mtp or auto)".into()),
            _ => Err(format!("--speculative {s:?}: expected off, mtp or auto")),
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

/// Verify runs `auto` judges a session on.
pub const AUTO_WINDOW: usize = 8;
/// Accepted drafted tokens per verify run below which `auto` pauses a session.
pub const AUTO_MIN_ACCEPTED: f64 = 0.5;
/// Tokens a paused session decodes plainly before it drafts again.
pub const AUTO_PAUSE: usize = 64;

/// One session's speculation state.
#[derive(Debug, Default)]
pub struct SpecState {
    /// The draft fed behind the session's last token this tick (empty: a plain decode).
    pub draft: Vec<u32>,
    /// The next token, already drawn by a rejected verification (the scheduler emits it instead of sampling).
    pub forced: Option<u32>,
    /// Accepted drafted tokens of the recent verify runs (at most [`AUTO_WINDOW`]).
    recent: Vec<usize>,
    /// Generated-token count until which `auto` keeps the session plain.
    paused_until: usize,
}

impl SpecState {
    /// Whether the session drafts now (`generated`: its tokens so far).
    pub fn drafting(&self, mode: SpecMode, generated: usize) -> bool {
        match mode {
            SpecMode::Off => false,
            SpecMode::Mtp => true,
            SpecMode::Auto => generated >= self.paused_until,
        }
    }

    /// Records a verify run that accepted `accepted` drafted tokens; returns true when `auto` pauses the session.
    pub fn record(&mut self, mode: SpecMode, accepted: usize, generated: usize) -> bool {
        self.recent.push(accepted);
        if self.recent.len() > AUTO_WINDOW {
            self.recent.remove(0);
        }
        let poor = self.recent.len() == AUTO_WINDOW
            && (self.recent.iter().sum::<usize>() as f64) < AUTO_MIN_ACCEPTED * AUTO_WINDOW as f64;
        if mode == SpecMode::Auto && poor {
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
    fn auto_pauses_sessions_whose_drafts_do_not_pay_and_tries_again() {
        let mut s = SpecState::default();
        assert!(s.drafting(SpecMode::Auto, 0));
        for i in 0..AUTO_WINDOW - 1 {
            assert!(!s.record(SpecMode::Auto, 0, i));
        }
        assert!(s.record(SpecMode::Auto, 0, 10), "a full window of rejected drafts pauses");
        assert!(!s.drafting(SpecMode::Auto, 10 + AUTO_PAUSE - 1));
        assert!(s.drafting(SpecMode::Auto, 10 + AUTO_PAUSE));
        // Drafts that pay keep it on; `mtp` never pauses.
        for i in 0..3 * AUTO_WINDOW {
            assert!(!s.record(SpecMode::Auto, 1, 100 + i));
        }
        let mut m = SpecState::default();
        for i in 0..3 * AUTO_WINDOW {
            assert!(!m.record(SpecMode::Mtp, 0, i));
        }
        assert!(m.drafting(SpecMode::Mtp, 1000));
        assert!(!m.drafting(SpecMode::Off, 0));
        assert!("dspark".parse::<SpecMode>().is_err());
        assert_eq!("auto".parse::<SpecMode>(), Ok(SpecMode::Auto));
    }
}
