//! When the server should save: the four triggers of the reference engine, as a small pure policy.
//!
//! * **cold**: a prompt that missed the cache (matched fewer than `cold_min_tokens`) and is at least that long — save
//!   once its prefill is done, so the next request with the same prefix (system prompt, pasted file) resumes.
//! * **continued**: every `continued_every` tokens of a live session (bounded loss if the process dies).
//! * **evict**: before a session is dropped from RAM; **shutdown**: on a clean exit. The server calls those directly.
//! * **system block**: a prompt whose system prompt + tools block (the rendered prefix before the first user message)
//!   is at least `system_block_min_tokens` long is also saved at the last page boundary inside that block, so the
//!   next conversation of the same agent (same system/tools, another first message) resumes there, after a restart
//!   too. The cold checkpoint alone would not serve it: it sits at the end of the whole first prompt.
//!
//! Pages are shared and written once, so a save costs only the new spans plus one checkpoint.

use crate::format::SaveReason;

/// Thresholds for the automatic triggers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavePolicy {
    /// A prompt at least this long that missed the cache is saved after prefill.
    pub cold_min_tokens: usize,
    /// A live session is saved again after this many new tokens.
    pub continued_every: usize,
    /// A system + tools block at least this long is saved at its end (0: never).
    pub system_block_min_tokens: usize,
}

impl Default for SavePolicy {
    fn default() -> SavePolicy {
        SavePolicy { cold_min_tokens: 512, continued_every: 10240, system_block_min_tokens: 1024 }
    }
}

impl SavePolicy {
    /// After prefilling a prompt of `prompt_tokens` of which `matched_tokens` came from the cache.
    pub fn after_prefill(&self, matched_tokens: usize, prompt_tokens: usize) -> Option<SaveReason> {
        (prompt_tokens >= self.cold_min_tokens
            && prompt_tokens - matched_tokens.min(prompt_tokens) >= self.cold_min_tokens)
            .then_some(SaveReason::Cold)
    }

    /// While a session grows: `last_saved` is the position of its last checkpoint, `position` the current one.
    pub fn while_running(&self, last_saved: usize, position: usize) -> Option<SaveReason> {
        (self.continued_every > 0 && position >= last_saved.saturating_add(self.continued_every))
            .then_some(SaveReason::Continued)
    }

    /// Where to save the end of a system + tools block of `block_tokens` (pages of `span` tokens): the last page
    /// boundary at or below its end, when the block is long enough and that boundary is past the first page.
    pub fn system_block_end(&self, block_tokens: usize, span: usize) -> Option<usize> {
        if self.system_block_min_tokens == 0 || block_tokens < self.system_block_min_tokens || span == 0 {
            return None;
        }
        let at = block_tokens / span * span;
        (at > 0).then_some(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triggers() {
        let p = SavePolicy { cold_min_tokens: 100, continued_every: 1000, system_block_min_tokens: 300 };
        assert_eq!(p.after_prefill(0, 99), None);
        assert_eq!(p.after_prefill(0, 100), Some(SaveReason::Cold));
        assert_eq!(p.after_prefill(950, 1000), None);
        assert_eq!(p.after_prefill(2000, 1000), None);
        assert_eq!(p.while_running(0, 999), None);
        assert_eq!(p.while_running(0, 1000), Some(SaveReason::Continued));
        assert_eq!(p.while_running(usize::MAX, 5), None);
        assert_eq!(p.system_block_end(299, 128), None);
        assert_eq!(p.system_block_end(300, 128), Some(256));
        assert_eq!(p.system_block_end(512, 128), Some(512));
        assert_eq!(p.system_block_end(300, 512), None, "a block inside the first page has no boundary to save at");
        let off = SavePolicy { system_block_min_tokens: 0, ..p };
        assert_eq!(off.system_block_end(100_000, 128), None);
    }
}
