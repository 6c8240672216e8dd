//! Memory of the tool calls this server produced, keyed by call id, so that a history sent back by a client renders
//! to the bytes the model actually generated (which keeps the prompt a token-exact extension of the parked session,
//! i.e. prefix reuse works).
//!
//! Clients re-serialise arguments (opencode compacts the JSON, Codex echoes, Claude Code sends an `input` object) and
//! drop reasoning (Anthropic `display: "omitted"`). [`ToolMemory::restore`] puts back the remembered argument text and,
//! when the client sent none, the remembered reasoning of that assistant turn. Unknown ids are left untouched.
//! Bounded: the oldest entries are forgotten beyond `capacity`.

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

use crate::model::{Conversation, TurnRole};

#[derive(Debug, Clone)]
struct Remembered {
    name: String,
    arguments: String,
    reasoning: String,
}

/// Thread-safe, bounded id → call map.
pub struct ToolMemory {
    capacity: usize,
    inner: Mutex<(HashMap<String, Remembered>, VecDeque<String>)>,
}

impl ToolMemory {
    pub fn new(capacity: usize) -> Self {
        ToolMemory { capacity: capacity.max(1), inner: Mutex::new((HashMap::new(), VecDeque::new())) }
    }

    /// Remember a call the model produced.
    pub fn remember(&self, id: &str, name: &str, arguments: &str, reasoning: &str) {
        let mut g = self.inner.lock();
        let r = Remembered { name: name.into(), arguments: arguments.into(), reasoning: reasoning.into() };
        if g.0.insert(id.to_string(), r).is_none() {
            g.1.push_back(id.to_string());
        }
        while g.1.len() > self.capacity {
            if let Some(old) = g.1.pop_front() {
                g.0.remove(&old);
            }
        }
    }

    /// Put remembered argument bytes (and missing reasoning) back into the assistant turns of `conv`.
    pub fn restore(&self, conv: &mut Conversation) {
        let g = self.inner.lock();
        for m in conv.messages.iter_mut().filter(|m| m.role == TurnRole::Assistant) {
            let mut reasoning = None;
            for c in &mut m.tool_calls {
                if let Some(r) = g.0.get(&c.id) {
                    if r.name == c.name && same_json(&r.arguments, &c.arguments) {
                        c.arguments = r.arguments.clone();
                    }
                    reasoning.get_or_insert_with(|| r.reasoning.clone());
                }
            }
            if m.reasoning.is_empty() {
                if let Some(r) = reasoning {
                    m.reasoning = r;
                }
            }
        }
    }
}

/// Whether two JSON texts hold the same value (so a client that only re-formatted the arguments gets ours back, and
/// one that changed them keeps its own).
fn same_json(a: &str, b: &str) -> bool {
    match (serde_json::from_str::<serde_json::Value>(a), serde_json::from_str::<serde_json::Value>(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ChatTurn, TurnToolCall};

    fn conv(args: &str) -> Conversation {
        let mut m = ChatTurn::new(TurnRole::Assistant, "");
        m.tool_calls.push(TurnToolCall { id: "call_1".into(), name: "bash".into(), arguments: args.into() });
        Conversation { messages: vec![m], ..Default::default() }
    }

    #[test]
    fn restores_bytes_and_reasoning_only_for_equal_calls() {
        let mem = ToolMemory::new(2);
        mem.remember("call_1", "bash", "{\"command\": \"ls\"}", "I should list.");
        let mut c = conv("{\"command\":\"ls\"}");
        mem.restore(&mut c);
        assert_eq!(c.messages[0].tool_calls[0].arguments, "{\"command\": \"ls\"}");
        assert_eq!(c.messages[0].reasoning, "I should list.");
        let mut c = conv("{\"command\":\"rm\"}");
        mem.restore(&mut c);
        assert_eq!(c.messages[0].tool_calls[0].arguments, "{\"command\":\"rm\"}");
    }

    #[test]
    fn forgets_the_oldest_beyond_capacity() {
        let mem = ToolMemory::new(1);
        mem.remember("call_1", "bash", "{ }", "");
        mem.remember("call_2", "bash", "{}", "");
        let mut c = conv("{}");
        mem.restore(&mut c);
        assert_eq!(c.messages[0].tool_calls[0].arguments, "{}");
    }
}
