//! A deterministic stand-in model for tests: byte tokens, a plain-text chat format and a scripted "model".
//!
//! Tokens are bytes (0..=255) plus [`EOS`] (256). The chat format is
//! `<|tools|>[json]\n` (when tools are given), then per message `<|system|>..\n`, `<|user|>..\n`,
//! `<|assistant|><think>reasoning</think>content<tool_call>{"name":..,"arguments":..}</tool_call><|end|>\n`,
//! `<|tool|>id:result\n`, and finally `<|assistant|>` (+ `<think>` when thinking).
//!
//! The scripted model answers from the text of the prompt (so a test controls it through its request):
//! - thinking on: first `Let me think.</think>`;
//! - the last turn is a tool result: `Done: <first 20 chars of it>`;
//! - the last user turn contains `use the tool`: a tool call of the first offered tool with `{"command":"ls"}`;
//! - it contains `long answer`: `la ` 300 times;
//! - otherwise `Hello! You said: <last 40 chars of the turn's last line, '<' removed>.`
//!
//! then [`EOS`]. A script ([`crate::fake_script`], `--fake-script FILE`) is tried first: its first entry matching the
//! prompt gives the reply (reasoning, text, tool calls); prompts it does not match get the built-in reply above.
//! Logits are one-hot with a wide margin, so any temperature gives the same text in practice and
//! greedy decoding always does. Structured outputs work on it (a grammar over its byte vocabulary): a masked-out
//! scripted byte leaves a uniform choice among the allowed ones, so a scripted reply that does not fit the format
//! still comes back in it; its tool calls are left to its own parser (`<tool_call>` starts one). Batching cannot
//! change a session's output (sessions are independent). An optional per-step delay makes slow-model tests
//! (keep-alive, cancellation, queueing) possible, and an optional batch budget ([`FakeRunner::with_batch_tokens`]) makes a step process only part of what was fed, like the engine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::fake_script::{substitute, substitute_value, LastTurn, PromptView, Script};
use crate::model::{
    BackendError, Codec, Conversation, KvBytes, OutputParser, Parsed, Runner, RunnerSessionId, TokenDecoder, TurnRole,
};
use ds4_engine::sampler::partial_suffix_len;

/// End-of-sequence token id.
pub const EOS: u32 = 256;
/// Logits per position.
pub const VOCAB: usize = 257;
const ASSISTANT: &str = "<|assistant|>";

/// The fake chat codec.
#[derive(Debug, Default, Clone)]
pub struct FakeCodec;

impl Codec for FakeCodec {
    fn render(&self, conv: &Conversation) -> Result<String, BackendError> {
        let mut out = String::new();
        if !conv.tools.is_empty() {
            let tools: Vec<serde_json::Value> = conv
                .tools
                .iter()
                .map(|t| serde_json::json!({"name": t.name, "description": t.description, "parameters": t.parameters}))
                .collect();
            out.push_str("<|tools|>");
            out.push_str(&serde_json::Value::Array(tools).to_string());
            out.push('\n');
        }
        for m in &conv.messages {
            match m.role {
                TurnRole::System => out.push_str(&format!("<|system|>{}\n", m.content)),
                TurnRole::User => out.push_str(&format!("<|user|>{}\n", m.content)),
                TurnRole::Tool => {
                    out.push_str(&format!("<|tool|>{}:{}\n", m.tool_call_id.as_deref().unwrap_or(""), m.content))
                }
                TurnRole::Assistant => {
                    out.push_str(ASSISTANT);
                    if !m.reasoning.is_empty() {
                        out.push_str(&format!("<think>{}</think>", m.reasoning));
                    }
                    out.push_str(&m.content);
                    for c in &m.tool_calls {
                        out.push_str(&format!(
                            "<tool_call>{{\"name\":{},\"arguments\":{}}}</tool_call>",
                            serde_json::Value::String(c.name.clone()),
                            c.arguments
                        ));
                    }
                    out.push_str("<|end|>\n");
                }
            }
        }
        out.push_str(ASSISTANT);
        if conv.thinking {
            out.push_str("<think>");
        }
        Ok(out)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, BackendError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn encode_bounded(&self, text: &str, limit: usize) -> Result<Vec<u32>, crate::model::EncodeError> {
        if text.len() > limit {
            return Err(crate::model::EncodeError::TooLong { limit });
        }
        self.encode(text).map_err(Into::into)
    }

    fn decoder(&self) -> Box<dyn TokenDecoder> {
        Box::new(ByteDecoder::default())
    }

    fn parser(&self, thinking: bool) -> Box<dyn OutputParser> {
        Box::new(FakeParser { state: if thinking { State::Reasoning } else { State::Content }, buf: String::new() })
    }

    fn eos_tokens(&self) -> Vec<u32> {
        vec![EOS]
    }

    fn grammar(&self) -> Result<Arc<crate::structured::GrammarSupport>, BackendError> {
        static SUPPORT: std::sync::OnceLock<Result<Arc<crate::structured::GrammarSupport>, BackendError>> =
            std::sync::OnceLock::new();
        SUPPORT
            .get_or_init(|| {
                let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
                tokens.push(b"<|eos|>".to_vec());
                let factory = ds4_engine::grammar::ConstraintFactory::from_vocab(&tokens, &[], EOS, VOCAB)
                    .map_err(|e| BackendError(e.to_string()))?;
                Ok(Arc::new(crate::structured::GrammarSupport {
                    factory,
                    eos: EOS,
                    think_end: b"</think>".iter().map(|&b| u32::from(b)).collect(),
                    dsml: None,
                    call_open: Some("<tool_call>".into()),
                }))
            })
            .clone()
    }
}

/// Bytes → UTF-8 text, holding back an incomplete trailing sequence.
#[derive(Debug, Default)]
struct ByteDecoder {
    pending: Vec<u8>,
}

impl TokenDecoder for ByteDecoder {
    fn push(&mut self, token: u32) -> String {
        if token > 255 {
            return String::new();
        }
        self.pending.push(token as u8);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_string();
                self.pending.clear();
                s
            }
            Err(e) if e.error_len().is_none() => {
                let valid = e.valid_up_to();
                let s = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
                self.pending.drain(..valid);
                s
            }
            Err(_) => {
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                s
            }
        }
    }

    fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    Tool,
}

/// Splits `<think>..</think>` reasoning, content and `<tool_call>..</tool_call>` JSON calls, streaming.
struct FakeParser {
    state: State,
    buf: String,
}

impl FakeParser {
    fn emit(&self, text: String, out: &mut Vec<Parsed>) {
        if text.is_empty() {
            return;
        }
        match self.state {
            State::Reasoning => out.push(Parsed::Reasoning(text)),
            _ => out.push(Parsed::Content(text)),
        }
    }

    fn tool_call(body: &str) -> Parsed {
        let v: Option<serde_json::Value> = serde_json::from_str(body).ok();
        match v.as_ref().and_then(|v| Some((v.get("name")?.as_str()?, v.get("arguments")?))) {
            Some((name, args)) => Parsed::ToolCall { name: name.to_string(), arguments: args.to_string() },
            None => Parsed::Content(format!("<tool_call>{body}</tool_call>")),
        }
    }
}

impl OutputParser for FakeParser {
    fn push(&mut self, text: &str) -> Vec<Parsed> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let marker = match self.state {
                State::Reasoning => "</think>",
                State::Content => "<tool_call>",
                State::Tool => "</tool_call>",
            };
            if let Some(pos) = self.buf.find(marker) {
                let before = self.buf[..pos].to_string();
                self.buf.drain(..pos + marker.len());
                match self.state {
                    State::Reasoning => {
                        self.emit(before, &mut out);
                        self.state = State::Content;
                    }
                    State::Content => {
                        self.emit(before, &mut out);
                        self.state = State::Tool;
                    }
                    State::Tool => {
                        out.push(Self::tool_call(&before));
                        self.state = State::Content;
                    }
                }
                continue;
            }
            if self.state != State::Tool {
                let keep = partial_suffix_len(&self.buf, &[marker]);
                let text = self.buf[..self.buf.len() - keep].to_string();
                self.buf.drain(..self.buf.len() - keep);
                self.emit(text, &mut out);
            }
            return out;
        }
    }

    fn finish(&mut self) -> Vec<Parsed> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        if self.state == State::Tool {
            out.push(Parsed::Content(format!("<tool_call>{rest}")));
        } else {
            self.emit(rest, &mut out);
        }
        out
    }
}

struct FakeSession {
    tokens: Vec<u32>,
    pending: Vec<u32>,
    logits: Option<Vec<f32>>,
    /// (generation start, scripted reply tokens) for the current assistant turn.
    script: Option<(usize, Vec<u32>)>,
}

/// The scripted fake model.
pub struct FakeRunner {
    sessions: HashMap<RunnerSessionId, FakeSession>,
    next_id: RunnerSessionId,
    max_sessions: usize,
    delay: Duration,
    script: Arc<Script>,
    /// Rows one `step` processes at most (decode tokens first, like the engine); unlimited by default.
    batch_tokens: usize,
    /// Total tokens processed by `step` (tests read it to see prefix reuse).
    pub tokens_processed: u64,
}

impl FakeRunner {
    pub fn new(max_sessions: usize) -> Self {
        FakeRunner {
            sessions: HashMap::new(),
            next_id: 1,
            max_sessions,
            delay: Duration::ZERO,
            script: Arc::new(Script::default()),
            batch_tokens: usize::MAX,
            tokens_processed: 0,
        }
    }

    /// Answer from `script` first (see [`crate::fake_script`]).
    pub fn with_script(mut self, script: Script) -> Self {
        self.script = Arc::new(script);
        self
    }

    /// Process at most `n` tokens per `step` (at least 1), decoding sessions first, like the engine's batch budget.
    pub fn with_batch_tokens(mut self, n: usize) -> Self {
        self.batch_tokens = n.max(1);
        self
    }

    /// Sleep this long in every `step` (simulates a slow model).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    (0..=hay.len().checked_sub(needle.len())?).rev().find(|&i| &hay[i..i + needle.len()] == needle)
}

/// The scripted reply for a prompt (see the module docs).
fn script_reply(prompt: &[u8], script: &Script) -> Vec<u32> {
    let text = String::from_utf8_lossy(prompt);
    let thinking = text.ends_with("<think>");
    let mut reply = String::new();
    let last_user = text.rfind("<|user|>").map(|p| p + "<|user|>".len());
    let last_tool = text.rfind("<|tool|>").map(|p| p + "<|tool|>".len());
    // A turn runs to the next `\n<|` marker.
    let turn_end = |start: usize| text[start..].find("\n<|").map(|e| start + e).unwrap_or(text.len());
    let (last, last_text) = match (last_user, last_tool) {
        (u, Some(t)) if u.is_none_or(|u| t > u) => {
            let body = &text[t..turn_end(t)];
            (Some(LastTurn::Tool), body.split_once(':').map(|(_, r)| r).unwrap_or(body))
        }
        (Some(u), _) => (Some(LastTurn::User), &text[u..turn_end(u)]),
        _ => (None, ""),
    };
    let tools: Vec<String> = text
        .strip_prefix("<|tools|>")
        .and_then(|t| serde_json::from_str::<Vec<serde_json::Value>>(t.split('\n').next()?).ok())
        .unwrap_or_default()
        .iter()
        .filter_map(|t| Some(t.get("name")?.as_str()?.to_string()))
        .collect();
    let view =
        PromptView { last_text, last, tools, assistant_turns: text.matches(ASSISTANT).count().saturating_sub(1) };
    if let Some(r) = script.pick(&view) {
        if thinking {
            reply.push_str(&substitute(&r.reasoning, last_text));
            reply.push_str("</think>");
        }
        reply.push_str(&substitute(&r.text, last_text));
        for c in &r.tool_calls {
            let name = serde_json::Value::String(c.name.clone());
            let args = substitute_value(&c.arguments, last_text);
            reply.push_str(&format!("<tool_call>{{\"name\":{name},\"arguments\":{args}}}</tool_call>"));
        }
    } else {
        builtin_reply(&view, thinking, &mut reply);
    }
    let mut toks: Vec<u32> = reply.bytes().map(u32::from).collect();
    toks.push(EOS);
    toks
}

/// The built-in rules (see the module docs).
fn builtin_reply(view: &PromptView<'_>, thinking: bool, reply: &mut String) {
    let clean = |s: &str| s.chars().filter(|c| *c != '<' && *c != '\n').collect::<String>();
    if thinking {
        reply.push_str("Let me think.</think>");
    }
    match view.last {
        Some(LastTurn::Tool) => {
            reply.push_str("Done: ");
            reply.push_str(&clean(&view.last_text.chars().take(20).collect::<String>()));
        }
        Some(LastTurn::User) => {
            let turn = view.last_text;
            let last_line = turn.rsplit('\n').next().unwrap_or(turn);
            if let (true, Some(tool)) = (turn.contains("use the tool"), view.tools.first()) {
                let name = serde_json::Value::String(tool.clone());
                reply.push_str(&format!(
                    "<tool_call>{{\"name\":{name},\"arguments\":{{\"command\":\"ls\"}}}}</tool_call>"
                ));
            } else if turn.contains("long answer") {
                reply.push_str(&"la ".repeat(300));
            } else {
                let tail: String = {
                    let chars: Vec<char> = last_line.chars().collect();
                    chars[chars.len().saturating_sub(40)..].iter().collect()
                };
                reply.push_str(&format!("Hello! You said: {}.", clean(&tail)));
            }
        }
        None => reply.push_str("Hello!"),
    }
}

impl Runner for FakeRunner {
    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn create_session(&mut self) -> Result<RunnerSessionId, BackendError> {
        if self.sessions.len() >= self.max_sessions {
            return Err(BackendError(format!("session table full ({} sessions)", self.max_sessions)));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.sessions.insert(id, FakeSession { tokens: Vec::new(), pending: Vec::new(), logits: None, script: None });
        Ok(id)
    }

    fn free_session(&mut self, session: RunnerSessionId) {
        self.sessions.remove(&session);
    }

    fn truncate(&mut self, session: RunnerSessionId, len: usize) -> bool {
        match self.sessions.get_mut(&session) {
            Some(s) if len <= s.tokens.len() => {
                s.tokens.truncate(len);
                s.pending.clear();
                s.logits = None;
                s.script = None;
                true
            }
            _ => false,
        }
    }

    fn can_truncate(&self) -> bool {
        true
    }

    fn fork(&mut self, session: RunnerSessionId) -> Option<RunnerSessionId> {
        let s = self.sessions.get(&session)?;
        let copy = FakeSession {
            tokens: s.tokens.clone(),
            pending: Vec::new(),
            logits: s.logits.clone(),
            script: s.script.clone(),
        };
        let id = self.create_session().ok()?;
        self.sessions.insert(id, copy);
        Some(id)
    }

    fn feed(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), BackendError> {
        let s = self.sessions.get_mut(&session).ok_or_else(|| BackendError(format!("no session {session}")))?;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= VOCAB) {
            return Err(BackendError(format!("token {t} out of range")));
        }
        s.pending.extend_from_slice(tokens);
        Ok(())
    }

    fn step(&mut self) -> Result<(), BackendError> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        let mut ids: Vec<RunnerSessionId> =
            self.sessions.iter().filter(|(_, s)| !s.pending.is_empty()).map(|(&id, _)| id).collect();
        // Decoding sessions (one queued token) first, then prompt chunks in session order.
        ids.sort_by_key(|id| (self.sessions[id].pending.len() != 1, *id));
        let mut budget = self.batch_tokens;
        for id in ids {
            let s = self.sessions.get_mut(&id).expect("listed above");
            let take = s.pending.len().min(budget);
            if take == 0 {
                break;
            }
            budget -= take;
            self.tokens_processed += take as u64;
            s.tokens.extend(s.pending.drain(..take));
            let bytes: Vec<u8> = s.tokens.iter().map(|&t| t.min(255) as u8).collect();
            let start = find_last(&bytes, ASSISTANT.as_bytes()).map(|p| p + ASSISTANT.len());
            let mut logits = vec![0.0f32; VOCAB];
            if let Some(mut start) = start {
                if bytes[start..].starts_with(b"<think>") {
                    // The prompt opened a reasoning block: generation starts after it.
                    start += "<think>".len();
                }
                if s.script.as_ref().is_none_or(|(st, _)| *st != start) {
                    s.script = Some((start, script_reply(&bytes[..start], &self.script)));
                }
                let (st, reply) = s.script.as_ref().expect("set above");
                let idx = s.tokens.len() - st;
                logits[reply.get(idx).copied().unwrap_or(EOS) as usize] = 30.0;
            } else {
                logits[EOS as usize] = 30.0;
            }
            s.logits = Some(logits);
        }
        Ok(())
    }

    fn pending(&self, session: RunnerSessionId) -> usize {
        self.sessions.get(&session).map_or(0, |s| s.pending.len())
    }

    fn logits(&self, session: RunnerSessionId) -> Option<&[f32]> {
        self.sessions.get(&session)?.logits.as_deref()
    }

    fn session_bytes(&self, session: RunnerSessionId) -> u64 {
        self.sessions.get(&session).map_or(0, |s| s.tokens.len() as u64 * 64)
    }

    fn kv_bytes(&self) -> KvBytes {
        let tokens: usize = self.sessions.values().map(|s| s.tokens.len()).sum();
        KvBytes { host: tokens as u64 * 64, ..KvBytes::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ChatTurn, ToolSpec};

    fn generate(runner: &mut FakeRunner, prompt: &[u32]) -> String {
        let s = runner.create_session().unwrap();
        runner.feed(s, prompt).unwrap();
        let mut out = Vec::new();
        for _ in 0..2000 {
            runner.step().unwrap();
            let l = runner.logits(s).unwrap();
            let t = l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
            if t == EOS {
                break;
            }
            out.push(t as u8);
            runner.feed(s, &[t]).unwrap();
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn scripted_replies_follow_the_prompt() {
        let codec = FakeCodec;
        let mut conv = Conversation { messages: vec![ChatTurn::new(TurnRole::User, "hi there")], ..Default::default() };
        let mut r = FakeRunner::new(4);
        assert_eq!(
            generate(&mut r, &codec.encode(&codec.render(&conv).unwrap()).unwrap()),
            "Hello! You said: hi there."
        );
        conv.thinking = true;
        conv.tools.push(ToolSpec { name: "Bash".into(), description: "d".into(), parameters: serde_json::json!({}) });
        conv.messages[0].content = "please use the tool".into();
        let out = generate(&mut r, &codec.encode(&codec.render(&conv).unwrap()).unwrap());
        assert_eq!(
            out,
            "Let me think.</think><tool_call>{\"name\":\"Bash\",\"arguments\":{\"command\":\"ls\"}}</tool_call>"
        );
        let mut p = codec.parser(true);
        let mut events = Vec::new();
        for ch in out.chars() {
            events.extend(p.push(&ch.to_string()));
        }
        events.extend(p.finish());
        assert_eq!(events[0], Parsed::Reasoning("L".into()));
        let reasoning: String =
            events.iter().filter_map(|e| if let Parsed::Reasoning(r) = e { Some(r.as_str()) } else { None }).collect();
        assert_eq!(reasoning, "Let me think.");
        assert_eq!(
            events.last().unwrap(),
            &Parsed::ToolCall { name: "Bash".into(), arguments: "{\"command\":\"ls\"}".into() }
        );
    }

    #[test]
    fn decoder_holds_back_split_utf8() {
        let mut d = ByteDecoder::default();
        let bytes = "é".as_bytes();
        assert_eq!(d.push(bytes[0] as u32), "");
        assert_eq!(d.push(bytes[1] as u32), "é");
        assert_eq!(d.push(EOS), "");
    }

    #[test]
    fn partial_markers_are_held_back() {
        let mut p = FakeCodec.parser(false);
        assert_eq!(p.push("hi <tool"), vec![Parsed::Content("hi ".into())]);
        assert_eq!(p.push("box"), vec![Parsed::Content("<toolbox".into())]);
        assert_eq!(
            p.push("<tool_call>{bad}</tool_call>"),
            vec![Parsed::Content("<tool_call>{bad}</tool_call>".into())]
        );
    }
}
