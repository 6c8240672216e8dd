//! Completion text → reasoning, content and DSML tool calls, incrementally.
//!
//! The model writes, after the prompt's `<think>` (thinking mode) or `</think>` (chat mode):
//! `REASONING</think>` (thinking only), then `CONTENT`, then optionally
//! `\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="N">\n<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>\n…</｜DSML｜invoke>\n…</｜DSML｜tool_calls>`,
//! then `<｜end▁of▁sentence｜>`.
//!
//! [`StreamParser::push`] takes text in arbitrary pieces (one token's text at a time) and returns [`ParseEvent`]s.
//! Text that might be the start of a marker is held back until it is decided, so the concatenated deltas do not
//! depend on how the text was split. Tool-call arguments stream as JSON text: `{"K": "V", "K2": 5}` built exactly as
//! the official decoder builds it (string parameters JSON-quoted, others verbatim). A `string="false"` value that
//! is not valid JSON is passed as a JSON string instead and reported in [`ParsedMessage::errors`], so `arguments`
//! is always valid JSON.
//!
//! Tolerance: whitespace between DSML tags is skipped; anything else unexpected inside the tool-call block is an
//! error (reported as [`ParseEvent::Error`]; the unfinished call is dropped from the result) after which the
//! remaining text is treated as content. Text after EOS is ignored. Never panics.

use super::json::push_python_string_body;
use super::render::Mode;
use super::types::{Message, Role, ToolCall};
use crate::sampler::partial_suffix_len;
use crate::tokenizer::{DSML_TOKEN, EOS_TOKEN, THINK_END_TOKEN, THINK_START_TOKEN};

/// Longest DSML tag (without its value) the parser waits for before calling it malformed.
const MAX_TAG_BYTES: usize = 4096;

/// One thing the parser recognised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseEvent {
    ReasoningDelta(String),
    ContentDelta(String),
    /// A tool call began; `index` counts calls of this message from 0.
    ToolCallStart {
        index: usize,
        name: String,
    },
    /// More of the call's arguments (JSON text).
    ToolArgsDelta {
        index: usize,
        delta: String,
    },
    /// The call is complete; its arguments are final.
    ToolCallEnd {
        index: usize,
    },
    /// Malformed output; see the module doc.
    Error(String),
}

/// One parsed tool call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub name: String,
    /// JSON object text.
    pub arguments: String,
}

/// Everything parsed from one completion.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedMessage {
    pub reasoning_content: String,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
    /// True when `<｜end▁of▁sentence｜>` was seen.
    pub finished: bool,
    /// Problems found (malformed DSML, unterminated call, text after EOS).
    pub errors: Vec<String>,
}

impl ParsedMessage {
    /// As an assistant [`Message`] (reasoning `None` when empty; tool calls without ids).
    pub fn to_message(&self) -> Message {
        Message {
            role: Role::Assistant,
            content: Some(self.content.clone()),
            reasoning_content: (!self.reasoning_content.is_empty()).then(|| self.reasoning_content.clone()),
            tool_calls: self
                .tool_calls
                .iter()
                .map(|c| ToolCall { id: None, name: c.name.clone(), arguments: c.arguments.clone() })
                .collect(),
            ..Default::default()
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    /// Inside `<｜DSML｜tool_calls>`: expecting an invoke or the block end.
    Block,
    /// Inside an invoke: expecting a parameter or the invoke end.
    Invoke,
    /// Inside a parameter value.
    Value {
        string: bool,
    },
    Done,
}

#[derive(Clone, Debug)]
struct Call {
    name: String,
    args: String,
    n_params: usize,
    /// Buffered `string="false"` value (validated at its end).
    raw_value: String,
}

/// Incremental parser; see the module doc.
#[derive(Clone, Debug)]
pub struct StreamParser {
    state: State,
    buf: String,
    at_start: bool,
    call: Option<Call>,
    result: ParsedMessage,
    warned_after_eos: bool,
}

fn tag(name: &str) -> String {
    format!("<{DSML_TOKEN}{name}")
}

impl StreamParser {
    /// A parser for a completion generated after a prompt rendered in `mode`.
    pub fn new(mode: Mode) -> Self {
        StreamParser {
            state: if mode == Mode::Thinking { State::Reasoning } else { State::Content },
            buf: String::new(),
            at_start: true,
            call: None,
            result: ParsedMessage::default(),
            warned_after_eos: false,
        }
    }

    /// True while the parser is inside DSML tool-call syntax (between tags, not in a parameter value): the
    /// sampler may then pick tokens greedily to keep the markup well-formed.
    pub fn in_tool_syntax(&self) -> bool {
        matches!(self.state, State::Block | State::Invoke)
    }

    /// True once EOS was seen.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// What has been parsed so far (the current unfinished call is not included).
    pub fn result(&self) -> &ParsedMessage {
        &self.result
    }

    /// Feeds more text; returns the events it completes.
    pub fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        let mut ev = Vec::new();
        if self.state == State::Done {
            self.after_eos(text, &mut ev);
            return ev;
        }
        self.buf.push_str(text);
        self.run(&mut ev, false);
        ev
    }

    /// Ends the input: flushes held-back text and reports an unterminated tool call. Returns the last events and
    /// the final result.
    pub fn finish(mut self) -> (Vec<ParseEvent>, ParsedMessage) {
        let mut ev = Vec::new();
        self.run(&mut ev, true);
        (ev, self.result)
    }

    fn after_eos(&mut self, text: &str, ev: &mut Vec<ParseEvent>) {
        if !text.is_empty() && !self.warned_after_eos {
            self.warned_after_eos = true;
            self.error("text after end of sentence ignored".into(), ev);
        }
    }

    fn error(&mut self, msg: String, ev: &mut Vec<ParseEvent>) {
        tracing::debug!(%msg, "completion parse error");
        self.result.errors.push(msg.clone());
        ev.push(ParseEvent::Error(msg));
    }

    fn emit_text(&mut self, s: &str, ev: &mut Vec<ParseEvent>) {
        if s.is_empty() {
            return;
        }
        match self.state {
            State::Reasoning => {
                self.result.reasoning_content.push_str(s);
                ev.push(ParseEvent::ReasoningDelta(s.to_string()));
            }
            _ => {
                self.result.content.push_str(s);
                ev.push(ParseEvent::ContentDelta(s.to_string()));
            }
        }
    }

    fn args_delta(&mut self, s: &str, ev: &mut Vec<ParseEvent>) {
        if let Some(c) = self.call.as_mut() {
            c.args.push_str(s);
            ev.push(ParseEvent::ToolArgsDelta { index: self.result.tool_calls.len(), delta: s.to_string() });
        }
    }

    /// Processes `buf` as far as possible. With `eof`, nothing more will come.
    fn run(&mut self, ev: &mut Vec<ParseEvent>, eof: bool) {
        loop {
            let progressed = match self.state {
                State::Done => {
                    let rest = std::mem::take(&mut self.buf);
                    self.after_eos(&rest, ev);
                    false
                }
                State::Reasoning => {
                    if self.at_start {
                        // Tolerate a model that repeats the prompt's `<think>`.
                        if self.buf.starts_with(THINK_START_TOKEN) {
                            self.buf.drain(..THINK_START_TOKEN.len());
                            self.at_start = false;
                        } else if !eof && THINK_START_TOKEN.starts_with(self.buf.as_str()) {
                            return;
                        } else {
                            self.at_start = false;
                        }
                    }
                    self.scan_text(&[THINK_END_TOKEN, EOS_TOKEN], ev, eof)
                }
                State::Content => {
                    self.at_start = false;
                    let start = tag("tool_calls>");
                    let nl_start = format!("\n\n{start}");
                    self.scan_text(&[nl_start.as_str(), start.as_str(), EOS_TOKEN], ev, eof)
                }
                State::Block | State::Invoke => self.scan_tag(ev, eof),
                State::Value { string } => self.scan_value(string, ev, eof),
            };
            if !progressed {
                break;
            }
        }
        if eof {
            if matches!(self.state, State::Block | State::Invoke | State::Value { .. }) {
                let msg = match self.call.take() {
                    Some(c) => format!("tool call {:?} was not terminated; dropped", c.name),
                    None => "tool-call block was not terminated".to_string(),
                };
                self.error(msg, ev);
                self.buf.clear();
                self.state = State::Content;
            }
            let rest = std::mem::take(&mut self.buf);
            if self.state != State::Done {
                self.emit_text(&rest, ev);
            }
        }
    }

    /// Reasoning/content: emits text up to the earliest marker and acts on it. Returns true if a marker was taken.
    fn scan_text(&mut self, markers: &[&str], ev: &mut Vec<ParseEvent>, eof: bool) -> bool {
        let found = markers
            .iter()
            .filter_map(|m| self.buf.find(m).map(|p| (p, m.len(), *m)))
            .min_by_key(|&(p, len, _)| (p, usize::MAX - len));
        match found {
            Some((p, len, m)) => {
                let before = self.buf[..p].to_string();
                self.emit_text(&before, ev);
                self.buf.drain(..p + len);
                if m == EOS_TOKEN {
                    self.result.finished = true;
                    self.state = State::Done;
                } else if m == THINK_END_TOKEN {
                    self.state = State::Content;
                } else {
                    self.state = State::Block;
                }
                true
            }
            None => {
                let hold = if eof { 0 } else { partial_suffix_len(&self.buf, markers) };
                let cut = self.buf.len() - hold;
                let out = self.buf[..cut].to_string();
                self.emit_text(&out, ev);
                self.buf.drain(..cut);
                false
            }
        }
    }

    /// Block/Invoke: skips whitespace, then takes one complete tag. Returns true if a tag was taken.
    fn scan_tag(&mut self, ev: &mut Vec<ParseEvent>, eof: bool) -> bool {
        let ws = self.buf.len() - self.buf.trim_start().len();
        self.buf.drain(..ws);
        if self.buf.is_empty() {
            return false;
        }
        let expected: [String; 2] = if self.state == State::Block {
            [tag("invoke name=\""), format!("</{DSML_TOKEN}tool_calls>")]
        } else {
            [tag("parameter name=\""), format!("</{DSML_TOKEN}invoke>")]
        };
        // The closing tags are complete by themselves.
        if self.buf.starts_with(expected[1].as_str()) {
            self.buf.drain(..expected[1].len());
            if self.state == State::Block {
                self.state = State::Content;
            } else {
                self.end_call(ev);
                self.state = State::Block;
            }
            return true;
        }
        if self.buf.starts_with(expected[0].as_str()) {
            let body_start = expected[0].len();
            match self.buf[body_start..].find("\">") {
                Some(end) if end <= MAX_TAG_BYTES => {
                    let body = self.buf[body_start..body_start + end].to_string();
                    self.buf.drain(..body_start + end + 2);
                    if self.state == State::Block {
                        self.start_call(body, ev);
                    } else {
                        return self.start_param(&body, ev);
                    }
                    return true;
                }
                None if !eof && self.buf.len() - body_start <= MAX_TAG_BYTES => return false,
                _ => {}
            }
        } else if !eof && expected.iter().any(|e| e.starts_with(self.buf.as_str())) {
            return false;
        }
        let what =
            if self.state == State::Block { "an invoke or the block end" } else { "a parameter or the invoke end" };
        self.malformed(format!("malformed tool call: expected {what}; the rest is kept as text"), ev);
        true
    }

    /// Aborts the tool-call block: drops the unfinished call, the rest is content.
    fn malformed(&mut self, msg: String, ev: &mut Vec<ParseEvent>) {
        self.error(msg, ev);
        self.call = None;
        self.state = State::Content;
    }

    fn start_call(&mut self, name: String, ev: &mut Vec<ParseEvent>) {
        let index = self.result.tool_calls.len();
        ev.push(ParseEvent::ToolCallStart { index, name: name.clone() });
        self.call = Some(Call { name, args: String::new(), n_params: 0, raw_value: String::new() });
        self.state = State::Invoke;
        self.args_delta("{", ev);
    }

    fn start_param(&mut self, body: &str, ev: &mut Vec<ParseEvent>) -> bool {
        // body: NAME" string="true|false
        let parsed = body.rsplit_once("\" string=\"").and_then(|(name, flag)| match flag {
            "true" => Some((name, true)),
            "false" => Some((name, false)),
            _ => None,
        });
        let Some((name, string)) = parsed else {
            self.malformed(format!("malformed parameter tag: {body:?}"), ev);
            return true;
        };
        let mut head = String::new();
        if self.call.as_ref().is_some_and(|c| c.n_params > 0) {
            head.push_str(", ");
        }
        head.push('"');
        push_python_string_body(&mut head, name);
        head.push_str("\": ");
        if string {
            head.push('"');
        }
        if let Some(c) = self.call.as_mut() {
            c.n_params += 1;
            c.raw_value.clear();
        }
        self.args_delta(&head, ev);
        self.state = State::Value { string };
        true
    }

    fn scan_value(&mut self, string: bool, ev: &mut Vec<ParseEvent>, eof: bool) -> bool {
        let end_tag = format!("</{DSML_TOKEN}parameter>");
        let (text, closed) = match self.buf.find(end_tag.as_str()) {
            Some(p) => {
                let t = self.buf[..p].to_string();
                self.buf.drain(..p + end_tag.len());
                (t, true)
            }
            None => {
                let hold = if eof { 0 } else { partial_suffix_len(&self.buf, &[end_tag.as_str()]) };
                let cut = self.buf.len() - hold;
                let t = self.buf[..cut].to_string();
                self.buf.drain(..cut);
                (t, false)
            }
        };
        if string {
            let mut esc = String::new();
            push_python_string_body(&mut esc, &text);
            if !esc.is_empty() {
                self.args_delta(&esc, ev);
            }
        } else if let Some(c) = self.call.as_mut() {
            c.raw_value.push_str(&text);
        }
        if !closed {
            return false;
        }
        if string {
            self.args_delta("\"", ev);
        } else {
            let raw = self.call.as_mut().map(|c| std::mem::take(&mut c.raw_value)).unwrap_or_default();
            let value = if serde_json::from_str::<serde_json::Value>(&raw).is_ok() {
                raw
            } else {
                let name = self.call.as_ref().map(|c| c.name.clone()).unwrap_or_default();
                self.error(
                    format!("tool call {name:?}: string=\"false\" value {raw:?} is not JSON; passed as a string"),
                    ev,
                );
                let mut s = String::from("\"");
                push_python_string_body(&mut s, &raw);
                s.push('"');
                s
            };
            self.args_delta(&value, ev);
        }
        self.state = State::Invoke;
        true
    }

    fn end_call(&mut self, ev: &mut Vec<ParseEvent>) {
        self.args_delta("}", ev);
        if let Some(c) = self.call.take() {
            let index = self.result.tool_calls.len();
            self.result.tool_calls.push(ParsedToolCall { name: c.name, arguments: c.args });
            ev.push(ParseEvent::ToolCallEnd { index });
        }
    }
}

/// Parses a whole completion at once (same result as streaming it).
pub fn parse_completion(text: &str, mode: Mode) -> ParsedMessage {
    let mut p = StreamParser::new(mode);
    p.push(text);
    p.finish().1
}

#[cfg(test)]
mod tests;
