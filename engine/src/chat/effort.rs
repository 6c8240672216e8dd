//! The reasoning-effort paragraph that thinking mode puts before the first message, per model revision.
//!
//! One table, selected by the loaded model's [`Revision`] (GGUF `deepseek4.revision`, absent = April):
//!
//! | effort | April (`2604`) | V4-Flash-0731 |
//! | --- | --- | --- |
//! | `low` | nothing (DeepSeek maps low to high) | nothing |
//! | `high` (default) | nothing | [`REASONING_EFFORT_MAX`] (the April `max` text) |
//! | `max` | [`REASONING_EFFORT_MAX`] | [`REASONING_EFFORT_MAX_0731`] |
//!
//! Sources for 0731: the official encoder (`encoding/encoding_dsv4.py` and `encoding/README.md` of
//! deepseek-ai/DeepSeek-V4-Flash-0731) was not reachable from here; its texts are taken from public ports that
//! quote it: vLLM-fork PR local-inference-lab/vllm#235 ("align 0731 reasoning and tool prompt contract",
//! `REASONING_EFFORT_PROMPTS = {"low": "", "high": <April max text>, "max": <new text>}`), its sibling #231, and
//! antirez/ds4 issue #635 / PR #704, which quote the 0731 `encoding/README.md` verbatim (including the em dash
//! U+2014 after "Beyond maximum"). The April texts are the April encoder's (see [`super::render`]).

use super::render::{ReasoningEffort, REASONING_EFFORT_MAX};
pub use crate::model::config::Revision;

/// V4-Flash-0731's `max` paragraph (see the module docs for the source).
pub const REASONING_EFFORT_MAX_0731: &str = "Reasoning Effort: Beyond maximum \u{2014} exhaustive, relentless, and \
uncompromising.\n\
You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the \
problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause \
rather than any surface symptom.\n\
Do not stop reasoning until you have independently verified the solution from multiple angles and are certain that \
no assumption remains unchecked and no error remains undiscovered.\n\n";

/// The paragraph for `effort` under `revision` (empty when the effort adds nothing). Thinking mode only.
pub fn effort_prefix(revision: Revision, effort: ReasoningEffort) -> &'static str {
    match (revision, effort) {
        (Revision::April, ReasoningEffort::Low | ReasoningEffort::High) => "",
        (Revision::April, ReasoningEffort::Max) => REASONING_EFFORT_MAX,
        (Revision::V0731, ReasoningEffort::Low) => "",
        (Revision::V0731, ReasoningEffort::High) => REASONING_EFFORT_MAX,
        (Revision::V0731, ReasoningEffort::Max) => REASONING_EFFORT_MAX_0731,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::render::{render_with, Mode, RenderOptions};
    use crate::chat::types::RenderInput;

    const MSGS: &str = r#"{"messages": [{"role": "user", "content": "Hi"}]}"#;

    fn rendered(revision: Revision, mode: Mode, effort: ReasoningEffort) -> String {
        let input = RenderInput::from_json(MSGS).unwrap();
        render_with(&input.messages, &RenderOptions { mode, effort, revision, ..RenderOptions::default() }).unwrap()
    }

    #[test]
    fn the_0731_texts_are_byte_exact() {
        // Byte-exact with the 0731 encoder's `max` text as quoted by local-inference-lab/vllm#235 and
        // antirez/ds4#635 (first line, em dash U+2014, 3 lines, blank line).
        assert!(REASONING_EFFORT_MAX_0731.starts_with("Reasoning Effort: Beyond maximum \u{2014} exhaustive"));
        assert_eq!(REASONING_EFFORT_MAX_0731.matches('\n').count(), 4);
        assert!(REASONING_EFFORT_MAX_0731.ends_with("no error remains undiscovered.\n\n"));
        assert_eq!(REASONING_EFFORT_MAX_0731.len(), 528);
        assert!(REASONING_EFFORT_MAX.starts_with("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"));
    }

    #[test]
    fn each_revision_renders_its_own_paragraph() {
        let base = rendered(Revision::April, Mode::Thinking, ReasoningEffort::High);
        assert_eq!(rendered(Revision::April, Mode::Thinking, ReasoningEffort::Low), base);
        assert_eq!(rendered(Revision::V0731, Mode::Thinking, ReasoningEffort::Low), base);
        let bos = "<｜begin▁of▁sentence｜>";
        let body = base.strip_prefix(bos).unwrap();
        for (rev, effort, para) in [
            (Revision::April, ReasoningEffort::Max, REASONING_EFFORT_MAX),
            (Revision::V0731, ReasoningEffort::High, REASONING_EFFORT_MAX),
            (Revision::V0731, ReasoningEffort::Max, REASONING_EFFORT_MAX_0731),
        ] {
            assert_eq!(rendered(rev, Mode::Thinking, effort), format!("{bos}{para}{body}"), "{rev:?} {effort:?}");
        }
        // Chat mode never carries the paragraph.
        for rev in [Revision::April, Revision::V0731] {
            assert_eq!(
                rendered(rev, Mode::Chat, ReasoningEffort::Max),
                rendered(Revision::April, Mode::Chat, ReasoningEffort::High)
            );
        }
    }
}
