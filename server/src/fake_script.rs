//! Scripted turns for the fake model (`ds4-server --fake-model --fake-script FILE`).
//!
//! A script is a list of entries, tried in order; the first whose `when` matches the prompt gives the reply, and a
//! prompt no entry matches gets the built-in reply (see [`crate::fake`]). The file is a JSON array of entries, a JSON
//! object `{"turns": [...]}`, or JSON Lines (one entry per non-empty line; lines starting with `#` are comments):
//!
//! ```json
//! {"when": {"last": "user", "contains": "make a file", "tool": "Bash", "turn": 0},
//!  "reply": {"reasoning": "I will run it.", "text": "Running it.",
//!            "tool_calls": [{"name": "Bash", "arguments": {"command": "touch made.txt"}}]}}
//! ```
//!
//! `when` (every given condition must hold; an empty or missing `when` always matches):
//! - `contains`: a substring of the last user or tool turn (the last one of either);
//! - `last`: `"user"` or `"tool"`: which kind that last turn is (`"tool"`: a tool result came back);
//! - `tool`: a tool of that name is offered;
//! - `turn`: the number of assistant turns already in the conversation (0 for the first answer).
//!
//! `reply` (all optional): `reasoning` (sent only when the prompt opened a reasoning block), `text`, `tool_calls`
//! (`name` + `arguments`, any JSON value, normally an object). In `text`, `reasoning` and string arguments, `{last}`
//! is replaced by the last user/tool turn (at most 200 characters, `<` and newlines removed), so a test can see what
//! came back from a tool.
//!
//! Invariant: matching is a pure function of the prompt text, so a multi-turn conversation is replayed
//! deterministically however often the client resends it.

use serde::Deserialize;
use serde_json::Value;

/// One scripted turn.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    #[serde(default)]
    pub when: When,
    #[serde(default)]
    pub reply: ScriptedReply,
}

/// Conditions of an entry (all that are given must hold).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct When {
    pub contains: Option<String>,
    pub last: Option<LastTurn>,
    pub tool: Option<String>,
    pub turn: Option<usize>,
}

/// Which kind of turn the prompt ends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LastTurn {
    User,
    Tool,
}

/// What the model answers.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ScriptedReply {
    #[serde(default)]
    pub reasoning: String,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub tool_calls: Vec<ScriptedCall>,
}

/// One scripted tool call.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedCall {
    pub name: String,
    #[serde(default = "empty_object")]
    pub arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// A parsed script.
#[derive(Debug, Clone, Default)]
pub struct Script {
    pub entries: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Whole {
    List(Vec<Entry>),
    Object { turns: Vec<Entry> },
}

/// What the fake model knows about a prompt when it picks a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptView<'a> {
    /// The last user or tool turn (a tool turn without its `id:` prefix).
    pub last_text: &'a str,
    /// Which kind it is (`None`: the prompt has neither).
    pub last: Option<LastTurn>,
    pub tools: Vec<String>,
    pub assistant_turns: usize,
}

impl Script {
    /// Parse a script file's text (JSON array, `{"turns": [...]}` or JSON Lines); errors name the line.
    pub fn parse(text: &str) -> Result<Script, String> {
        if let Ok(w) = serde_json::from_str::<Whole>(text) {
            let (Whole::List(entries) | Whole::Object { turns: entries }) = w;
            return Ok(Script { entries });
        }
        let whole: Option<Value> = serde_json::from_str(text).ok();
        if text.trim_start().starts_with('[') || whole.as_ref().is_some_and(|v| v.get("turns").is_some()) {
            // Parse again as the shape it claims to be, for an error that names the problem.
            let err = match whole.and_then(|mut v| v.get_mut("turns").map(Value::take)) {
                Some(turns) => serde_json::from_value::<Vec<Entry>>(turns).err(),
                None => serde_json::from_str::<Vec<Entry>>(text).err(),
            };
            return Err(format!("not a valid script: {}", err.map(|e| e.to_string()).unwrap_or_default()));
        }
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let e: Entry = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
            entries.push(e);
        }
        Ok(Script { entries })
    }

    /// Read and parse a script file.
    pub fn load(path: &std::path::Path) -> Result<Script, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Script::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The first entry matching `view`.
    pub fn pick(&self, view: &PromptView<'_>) -> Option<&ScriptedReply> {
        self.entries.iter().find(|e| e.when.matches(view)).map(|e| &e.reply)
    }
}

impl When {
    fn matches(&self, v: &PromptView<'_>) -> bool {
        self.contains.as_ref().is_none_or(|c| v.last.is_some() && v.last_text.contains(c.as_str()))
            && self.last.is_none_or(|l| v.last == Some(l))
            && self.tool.as_ref().is_none_or(|t| v.tools.iter().any(|n| n == t))
            && self.turn.is_none_or(|n| n == v.assistant_turns)
    }
}

/// `{last}` → the last turn's text, cleaned (in strings, recursively in JSON values).
pub fn substitute(s: &str, last: &str) -> String {
    if !s.contains("{last}") {
        return s.to_string();
    }
    let clean: String = last.chars().filter(|c| *c != '<' && *c != '\n').take(200).collect();
    s.replace("{last}", &clean)
}

/// [`substitute`] in every string of a JSON value.
pub fn substitute_value(v: &Value, last: &str) -> Value {
    match v {
        Value::String(s) => Value::String(substitute(s, last)),
        Value::Array(a) => Value::Array(a.iter().map(|x| substitute_value(x, last)).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, x)| (k.clone(), substitute_value(x, last))).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(last_text: &str, last: Option<LastTurn>, tools: &[&str], turns: usize) -> PromptView<'static> {
        PromptView {
            last_text: Box::leak(last_text.to_string().into_boxed_str()),
            last,
            tools: tools.iter().map(|s| s.to_string()).collect(),
            assistant_turns: turns,
        }
    }

    #[test]
    fn formats_parse_and_the_first_match_wins() {
        let jsonl = r#"
# a comment
{"when": {"last": "tool"}, "reply": {"text": "got {last}"}}
{"when": {"contains": "run", "tool": "Bash"}, "reply": {"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}}
{"reply": {"text": "fallback"}}
"#;
        let s = Script::parse(jsonl).unwrap();
        assert_eq!(s.entries.len(), 3);
        let a =
            Script::parse(&format!("[{}]", jsonl.lines().filter(|l| l.starts_with('{')).collect::<Vec<_>>().join(",")))
                .unwrap();
        assert_eq!(a.entries.len(), 3);
        let o = Script::parse(r#"{"turns": [{"reply": {"text": "x"}}]}"#).unwrap();
        assert_eq!(o.entries[0].reply.text, "x");

        let r = s.pick(&view("out: 42", Some(LastTurn::Tool), &["Bash"], 1)).unwrap();
        assert_eq!(r.text, "got {last}");
        let r = s.pick(&view("please run it", Some(LastTurn::User), &["Bash"], 0)).unwrap();
        assert_eq!(r.tool_calls[0].name, "Bash");
        let r = s.pick(&view("please run it", Some(LastTurn::User), &["bash"], 0)).unwrap();
        assert_eq!(r.text, "fallback");
    }

    #[test]
    fn turn_and_contains_conditions() {
        let s = Script::parse(r#"[{"when": {"turn": 2}, "reply": {"text": "third"}}]"#).unwrap();
        assert!(s.pick(&view("x", Some(LastTurn::User), &[], 1)).is_none());
        assert!(s.pick(&view("x", Some(LastTurn::User), &[], 2)).is_some());
        let s = Script::parse(r#"[{"when": {"contains": ""}, "reply": {}}]"#).unwrap();
        assert!(s.pick(&view("", None, &[], 0)).is_none(), "contains needs a user/tool turn");
    }

    #[test]
    fn bad_scripts_are_clear_errors() {
        let e = Script::parse("{\"reply\": {\"text\": 1}}\n").unwrap_err();
        assert!(e.starts_with("line 1:"), "{e}");
        let e = Script::parse("{\"when\": {\"bogus\": 1}}").unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        assert!(Script::parse("[{\"reply\": 3}]").is_err());
    }

    #[test]
    fn last_is_substituted_everywhere() {
        let v = serde_json::json!({"command": "echo {last}", "n": [1, "{last}"]});
        assert_eq!(substitute_value(&v, "a<b\nc"), serde_json::json!({"command": "echo abc", "n": [1, "abc"]}));
        assert_eq!(substitute("no placeholder", "x"), "no placeholder");
    }
}
