//! Messages → prompt text, byte-exact with the official DeepSeek-V4 encoder (`encoding_dsv4.py` of the release).
//!
//! The format, in the order the renderer applies it:
//! 1. `tool` messages become `<tool_result>…</tool_result>` blocks of a user turn; consecutive user turns and tool
//!    results merge into one user turn (blocks joined by `"\n\n"`), and the tool results of one turn are put in the
//!    order of the preceding assistant's `tool_calls` (matched by `tool_call_id`). A `system` message that follows a
//!    user or developer turn (Claude Code puts one after the first user message) is not part of the official format
//!    — the official encoder would glue its text to the user text with no assistant transition — so it becomes a
//!    text block of that user turn (a new user turn after a developer turn). System messages anywhere else (at the
//!    start, after an assistant turn) render as the official encoder renders them.
//! 2. Thinking mode with no tools anywhere drops earlier reasoning: assistant turns before the last user/developer
//!    turn lose `reasoning_content`, developer turns before it are dropped, and those assistant turns get `</think>`
//!    instead of `<think>` after `<｜Assistant｜>`.
//! 3. Each message renders as: system `TEXT[\n\n## Tools…]`, user `<｜User｜>TEXT`, developer
//!    `<｜User｜>TEXT[\n\n## Tools…]`, latest_reminder `<｜latest_reminder｜>TEXT`, assistant
//!    `[REASONING</think>]CONTENT[\n\n<｜DSML｜tool_calls>…</｜DSML｜tool_calls>]<｜end▁of▁sentence｜>`.
//! 4. After a user/developer turn that is followed by an assistant turn, a latest_reminder, or nothing:
//!    `<｜Assistant｜>` + `<think>` (thinking) or `</think>` (chat, or dropped reasoning). A `task` on the message
//!    replaces this with the task token (`action`: `<｜Assistant｜></think><｜action｜>` in chat mode).
//! 5. The whole prompt starts with `<｜begin▁of▁sentence｜>`; in thinking mode with effort `max`, the first message
//!    is preceded by the "Reasoning Effort" paragraph ([`REASONING_EFFORT_MAX`]). Effort `high` adds nothing.
//!
//! [`render_prompt`] is what a server uses: [`render_with`], plus the assistant transition (`<｜Assistant｜>` +
//! `<think>` / `</think>`) whenever the conversation does not already end in one (it ends in an assistant or system
//! turn), so every generation prompt hands the turn to the assistant. For every conversation the official encoder
//! ends in a transition it is exactly [`render_with`].
//!
//! Errors (never panics): a developer message without content, an unknown task, a tool message that cannot be
//! merged.

use std::borrow::Cow;

use super::json::JsonValue;
use super::types::{Message, RenderInput, Role, Tool, ToolCall};
use crate::tokenizer::{
    ASSISTANT_TOKEN, BOS_TOKEN, DSML_TOKEN, EOS_TOKEN, LATEST_REMINDER_TOKEN, THINK_END_TOKEN, THINK_START_TOKEN,
    USER_TOKEN,
};
use crate::{Error, Result};

/// Chat (answer directly) or thinking (reason inside `<think>…</think>` first).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    Chat,
    #[default]
    Thinking,
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "chat" => Ok(Mode::Chat),
            "thinking" | "think" => Ok(Mode::Thinking),
            _ => Err(Error::InvalidArgument(format!("mode must be chat or thinking, got {s:?}"))),
        }
    }
}

/// Reasoning effort in thinking mode. `High` is the default. What each adds before the first message depends on
/// the model revision ([`super::effort`]): for April files `High` and `Low` add nothing and `Max` prepends
/// [`REASONING_EFFORT_MAX`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningEffort {
    Low,
    #[default]
    High,
    Max,
}

impl std::str::FromStr for ReasoningEffort {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "low" => Ok(ReasoningEffort::Low),
            "high" => Ok(ReasoningEffort::High),
            "max" => Ok(ReasoningEffort::Max),
            _ => Err(Error::InvalidArgument(format!("reasoning effort must be low, high or max, got {s:?}"))),
        }
    }
}

/// The paragraph thinking mode with effort `max` puts before the first message.
pub const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, \
rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, \
and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// Task names and their tokens.
pub const TASK_TOKENS: &[(&str, &str)] = &[
    ("action", "<｜action｜>"),
    ("query", "<｜query｜>"),
    ("authority", "<｜authority｜>"),
    ("domain", "<｜domain｜>"),
    ("title", "<｜title｜>"),
    ("read_url", "<｜read_url｜>"),
];

/// All rendering options; [`render`] uses the defaults for `drop_thinking` (true) and `add_bos` (true).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    pub mode: Mode,
    pub effort: ReasoningEffort,
    /// Drop reasoning of turns before the last user turn (only when no message declares tools).
    pub drop_thinking: bool,
    /// Start with `<｜begin▁of▁sentence｜>`.
    pub add_bos: bool,
    /// The model revision: selects the reasoning-effort paragraph ([`super::effort`]).
    pub revision: super::effort::Revision,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            mode: Mode::Thinking,
            effort: ReasoningEffort::High,
            drop_thinking: true,
            add_bos: true,
            revision: Default::default(),
        }
    }
}

/// Renders a conversation into prompt text (see the module doc).
pub fn render(input: &RenderInput, mode: Mode, effort: ReasoningEffort) -> Result<String> {
    render_with(&input.messages, &RenderOptions { mode, effort, ..Default::default() })
}

/// A piece of a user turn after tool messages were merged.
#[derive(Clone, Debug)]
enum Block<'a> {
    Text(Cow<'a, str>),
    ToolResult { id: Option<&'a str>, content: Cow<'a, str> },
}

/// A message after preprocessing.
#[derive(Clone, Debug)]
struct Turn<'a> {
    role: Role,
    content: Option<&'a str>,
    /// For user turns: the merged blocks.
    blocks: Vec<Block<'a>>,
    reasoning: Option<&'a str>,
    tool_calls: &'a [ToolCall],
    tools: &'a [Tool],
    task: Option<&'a str>,
    response_format: Option<&'a JsonValue>,
    wo_eos: bool,
}

impl<'a> Turn<'a> {
    fn from_message(m: &'a Message) -> Self {
        Turn {
            role: m.role,
            content: m.content.as_deref(),
            blocks: Vec::new(),
            reasoning: m.reasoning_content.as_deref(),
            tool_calls: &m.tool_calls,
            tools: &m.tools,
            task: m.task.as_deref(),
            response_format: m.response_format.as_ref(),
            wo_eos: m.wo_eos,
        }
    }
}

/// Step 1 of the module doc: tool messages and consecutive user messages merge into user turns.
fn merge_tool_messages(messages: &[Message]) -> Vec<Turn<'_>> {
    let mut out: Vec<Turn<'_>> = Vec::with_capacity(messages.len());
    for m in messages {
        match m.role {
            Role::Tool => {
                let block = Block::ToolResult {
                    id: m.tool_call_id.as_deref(),
                    content: Cow::Borrowed(m.content.as_deref().unwrap_or("")),
                };
                match out.last_mut() {
                    Some(prev) if prev.role == Role::User => prev.blocks.push(block),
                    _ => {
                        let mut t = Turn::from_message(m);
                        t.role = Role::User;
                        t.content = None;
                        t.reasoning = None;
                        t.tool_calls = &[];
                        t.tools = &[];
                        t.task = None;
                        t.response_format = None;
                        t.wo_eos = false;
                        t.blocks.push(block);
                        out.push(t);
                    }
                }
            }
            Role::User => {
                let block = Block::Text(Cow::Borrowed(m.content.as_deref().unwrap_or("")));
                match out.last_mut() {
                    Some(prev) if prev.role == Role::User && prev.task.is_none() => prev.blocks.push(block),
                    _ => {
                        let mut t = Turn::from_message(m);
                        t.blocks.push(block);
                        out.push(t);
                    }
                }
            }
            Role::System if out.last().is_some_and(|p| matches!(p.role, Role::User | Role::Developer)) => {
                let block = Block::Text(Cow::Borrowed(m.content.as_deref().unwrap_or("")));
                match out.last_mut() {
                    Some(prev) if prev.role == Role::User && prev.task.is_none() => prev.blocks.push(block),
                    _ => {
                        let mut t = Turn::from_message(m);
                        t.role = Role::User;
                        t.content = None;
                        t.task = None;
                        t.blocks.push(block);
                        out.push(t);
                    }
                }
            }
            _ => out.push(Turn::from_message(m)),
        }
    }
    out
}

/// Tool results of a user turn follow the order of the preceding assistant's tool calls.
fn sort_tool_results(turns: &mut [Turn<'_>]) {
    let mut order: Vec<&str> = Vec::new();
    for t in turns.iter_mut() {
        if t.role == Role::Assistant && !t.tool_calls.is_empty() {
            order = t.tool_calls.iter().filter_map(|c| c.id.as_deref()).collect();
        } else if t.role == Role::User {
            let n_results = t.blocks.iter().filter(|b| matches!(b, Block::ToolResult { .. })).count();
            if n_results > 1 && !order.is_empty() {
                let rank = |b: &Block<'_>| match b {
                    Block::ToolResult { id: Some(id), .. } => t_rank(&order, id),
                    _ => 0,
                };
                let mut results: Vec<Block<'_>> =
                    t.blocks.iter().filter(|b| matches!(b, Block::ToolResult { .. })).cloned().collect();
                results.sort_by_key(|b| rank(b));
                let mut it = results.into_iter();
                for b in t.blocks.iter_mut() {
                    if matches!(b, Block::ToolResult { .. }) {
                        if let Some(r) = it.next() {
                            *b = r;
                        }
                    }
                }
            }
        }
    }
}

/// Position of a call id in the last assistant's calls; unknown ids rank first (0), as in the official encoder.
fn t_rank(order: &[&str], id: &str) -> usize {
    order.iter().position(|x| *x == id).unwrap_or(0)
}

fn last_user_index(turns: &[Turn<'_>]) -> Option<usize> {
    turns.iter().rposition(|t| matches!(t.role, Role::User | Role::Developer))
}

/// Step 2 of the module doc.
fn drop_thinking(turns: Vec<Turn<'_>>) -> Vec<Turn<'_>> {
    let last = last_user_index(&turns);
    let mut out = Vec::with_capacity(turns.len());
    for (i, mut t) in turns.into_iter().enumerate() {
        let at_or_after = last.is_none_or(|l| i >= l);
        match t.role {
            Role::User | Role::System | Role::Tool | Role::LatestReminder => out.push(t),
            _ if at_or_after => out.push(t),
            Role::Assistant => {
                t.reasoning = None;
                out.push(t);
            }
            Role::Developer => {}
        }
    }
    out
}

fn render_tools(out: &mut String, tools: &[Tool]) {
    let d = DSML_TOKEN;
    out.push_str("## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<");
    out.push_str(d);
    out.push_str("tool_calls>\" block like the following:\n\n");
    out.push_str(&format!(
        "<{d}tool_calls>\n<{d}invoke name=\"$TOOL_NAME\">\n<{d}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{d}parameter>\n...\n</{d}invoke>\n<{d}invoke name=\"$TOOL_NAME2\">\n...\n</{d}invoke>\n</{d}tool_calls>\n\n"
    ));
    out.push_str("String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n");
    out.push_str(&format!("If thinking_mode is enabled (triggered by {THINK_START_TOKEN}), you MUST output your complete reasoning inside {THINK_START_TOKEN}...{THINK_END_TOKEN} BEFORE any tool calls or final response.\n\n"));
    out.push_str(&format!("Otherwise, output directly after {THINK_END_TOKEN} with tool calls or final response.\n\n"));
    out.push_str("### Available Tool Schemas\n\n");
    for (i, t) in tools.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&t.function.to_python_json());
    }
    out.push_str(
        "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n",
    );
}

fn render_response_format(out: &mut String, rf: &JsonValue) {
    out.push_str("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n");
    out.push_str(&rf.to_python_json());
}

/// One tool call as DSML: `<｜DSML｜invoke name="N">\n<｜DSML｜parameter …>V</｜DSML｜parameter>…\n</｜DSML｜invoke>`.
/// Arguments that are not a JSON object are passed as one string parameter named `arguments`.
pub fn render_tool_call(out: &mut String, call: &ToolCall) {
    let d = DSML_TOKEN;
    out.push_str(&format!("<{d}invoke name=\"{}\">\n", call.name));
    let params: Vec<(String, JsonValue)> = match JsonValue::parse(&call.arguments) {
        Ok(JsonValue::Object(kv)) => kv,
        _ => vec![("arguments".to_string(), JsonValue::String(call.arguments.clone()))],
    };
    for (i, (k, v)) in params.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let (is_str, text) = match v {
            JsonValue::String(s) => ("true", Cow::Borrowed(s.as_str())),
            other => ("false", Cow::Owned(other.to_python_json())),
        };
        out.push_str(&format!("<{d}parameter name=\"{k}\" string=\"{is_str}\">{text}</{d}parameter>"));
    }
    out.push_str(&format!("\n</{d}invoke>"));
}

/// The tool-call block an assistant turn ends with (before EOS), including the leading `"\n\n"`.
pub fn render_tool_calls(out: &mut String, calls: &[ToolCall]) {
    let d = DSML_TOKEN;
    out.push_str(&format!("\n\n<{d}tool_calls>\n"));
    for (i, c) in calls.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        render_tool_call(out, c);
    }
    out.push_str(&format!("\n</{d}tool_calls>"));
}

fn task_token(task: &str) -> Result<&'static str> {
    TASK_TOKENS.iter().find(|(n, _)| *n == task).map(|(_, t)| *t).ok_or_else(|| {
        Error::Chat(format!("unknown task {task:?}; expected one of action, query, authority, domain, title, read_url"))
    })
}

/// Renders messages with explicit options (see the module doc).
pub fn render_with(messages: &[Message], opt: &RenderOptions) -> Result<String> {
    let thinking = opt.mode == Mode::Thinking;
    let mut turns = merge_tool_messages(messages);
    sort_tool_results(&mut turns);
    let drop = opt.drop_thinking && !messages.iter().any(|m| !m.tools.is_empty());
    if thinking && drop {
        turns = drop_thinking(turns);
    }
    let last_user = last_user_index(&turns);
    let mut out = String::new();
    if opt.add_bos {
        out.push_str(BOS_TOKEN);
    }
    for i in 0..turns.len() {
        render_turn(
            &mut out,
            &turns,
            i,
            thinking,
            drop,
            super::effort::effort_prefix(opt.revision, opt.effort),
            last_user,
        )?;
    }
    Ok(out)
}

/// [`render_with`], ending in the assistant transition when the conversation does not already (see the module doc):
/// the prompt a server generates from.
pub fn render_prompt(messages: &[Message], opt: &RenderOptions) -> Result<String> {
    let mut out = render_with(messages, opt)?;
    let open = if opt.mode == Mode::Thinking { THINK_START_TOKEN } else { THINK_END_TOKEN };
    let ends_in_transition = [THINK_START_TOKEN, THINK_END_TOKEN]
        .iter()
        .any(|t| out.strip_suffix(t).is_some_and(|head| head.ends_with(ASSISTANT_TOKEN)))
        || TASK_TOKENS.iter().any(|(_, t)| out.ends_with(t));
    if !ends_in_transition {
        out.push_str(ASSISTANT_TOKEN);
        out.push_str(open);
    }
    Ok(out)
}

fn render_turn(
    out: &mut String,
    turns: &[Turn<'_>],
    i: usize,
    thinking: bool,
    drop: bool,
    effort_prefix: &str,
    last_user: Option<usize>,
) -> Result<()> {
    let t = &turns[i];
    if i == 0 && thinking {
        out.push_str(effort_prefix);
    }
    let after_last_user = |idx: usize| last_user.is_none_or(|l| idx > l);
    match t.role {
        Role::System => {
            out.push_str(t.content.unwrap_or(""));
            if !t.tools.is_empty() {
                out.push_str("\n\n");
                render_tools(out, t.tools);
            }
            if let Some(rf) = t.response_format {
                render_response_format(out, rf);
            }
        }
        Role::Developer => {
            let content = t
                .content
                .filter(|c| !c.is_empty())
                .ok_or_else(|| Error::Chat(format!("developer message {i} has no content (the format requires it)")))?;
            out.push_str(USER_TOKEN);
            out.push_str(content);
            if !t.tools.is_empty() {
                out.push_str("\n\n");
                render_tools(out, t.tools);
            }
            if let Some(rf) = t.response_format {
                render_response_format(out, rf);
            }
        }
        Role::User => {
            out.push_str(USER_TOKEN);
            if t.blocks.is_empty() {
                out.push_str(t.content.unwrap_or(""));
            }
            for (k, b) in t.blocks.iter().enumerate() {
                if k > 0 {
                    out.push_str("\n\n");
                }
                match b {
                    Block::Text(s) => out.push_str(s),
                    Block::ToolResult { content, .. } => {
                        out.push_str("<tool_result>");
                        out.push_str(content);
                        out.push_str("</tool_result>");
                    }
                }
            }
        }
        Role::LatestReminder => {
            out.push_str(LATEST_REMINDER_TOKEN);
            out.push_str(t.content.unwrap_or(""));
        }
        Role::Tool => return Err(Error::Chat(format!("tool message {i} could not be merged into a user turn"))),
        Role::Assistant => {
            let prev_has_task = i > 0 && turns[i - 1].task.is_some();
            if thinking && !prev_has_task && (!drop || after_last_user(i)) {
                out.push_str(t.reasoning.unwrap_or(""));
                out.push_str(THINK_END_TOKEN);
            }
            out.push_str(t.content.unwrap_or(""));
            if !t.tool_calls.is_empty() {
                render_tool_calls(out, t.tool_calls);
            }
            if !t.wo_eos {
                out.push_str(EOS_TOKEN);
            }
        }
    }
    // Transition to the assistant's turn.
    if let Some(next) = turns.get(i + 1) {
        if !matches!(next.role, Role::Assistant | Role::LatestReminder) {
            return Ok(());
        }
    }
    if let Some(task) = t.task {
        let tok = task_token(task)?;
        if task == "action" {
            out.push_str(ASSISTANT_TOKEN);
            out.push_str(if thinking { THINK_START_TOKEN } else { THINK_END_TOKEN });
        }
        out.push_str(tok);
    } else if matches!(t.role, Role::User | Role::Developer) {
        out.push_str(ASSISTANT_TOKEN);
        let open = thinking && (!drop || last_user.is_none_or(|l| i >= l));
        out.push_str(if open { THINK_START_TOKEN } else { THINK_END_TOKEN });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
