//! Chat rendering (messages → prompt text, the official DeepSeek-V4 encoding) and output parsing (completion text →
//! reasoning, content, DSML tool calls).
//!
//! Guide:
//! * [`types`]: the serde message types ([`Message`], [`ToolCall`], [`Tool`], [`RenderInput`]).
//! * [`render`](mod@render): [`render()`] / [`render_with`] produce the prompt, byte-exact with the release's encoder
//!   (checked against `../shared/golden/chat-template`); [`render_prompt`] also guarantees the generation prompt ends
//!   in the assistant transition.
//! * [`parse`]: [`StreamParser`] turns generated text (pushed in pieces as tokens arrive) into reasoning, content
//!   and tool-call events and a final [`ParsedMessage`]; [`parse_completion`] does it in one call.
//! * [`json`]: order-preserving JSON with Python `json.dumps` formatting (the prompt shows JSON the way Python
//!   writes it).
//!
//! Nothing here panics on bad input: malformed messages are [`crate::Error::Chat`], malformed model output stays
//! text or is reported in [`ParsedMessage::errors`].

pub mod effort;
pub(crate) mod json;
pub(crate) mod parse;
pub(crate) mod render;
pub(crate) mod types;

pub use json::JsonValue;
pub use parse::{parse_completion, ParseEvent, ParsedMessage, ParsedToolCall, StreamParser};
pub use render::{render, render_prompt, render_with, Mode, ReasoningEffort, RenderOptions};
pub use types::{Message, RenderInput, Role, Tool, ToolCall};
