//! What the model is shown for content it cannot see: images, files, audio, documents without text, tool references.
//!
//! Every API accepts every content block / part type it defines (a client that resends a history with an image in a
//! tool result must not get stuck on a 400). Text stays text; anything else becomes one short bracketed note, the
//! same in every API, so the model knows something was there: `[image omitted]`, `[file omitted: NAME]`,
//! `[tool reference: NAME]`. Notes are pure functions of the block, so a resent history renders the same bytes.
//!
//! Deferred tools (Anthropic `defer_loading: true`) stay out of the tool list; when a tool result loads one (a
//! `tool_reference` block naming it, as Claude Code's ToolSearch returns), its definition is written right there in
//! the tool result ([`tool_loaded`]). Putting it there rather than in the tool list keeps every earlier prompt token
//! unchanged, so the conversation keeps its prefix cache when a tool is loaded.

use serde_json::Value;

use crate::model::ToolSpec;

/// `[KIND omitted]` or `[KIND omitted: DETAIL]`.
pub fn omitted(kind: &str, detail: Option<&str>) -> String {
    match detail.map(str::trim).filter(|d| !d.is_empty()) {
        Some(d) => format!("[{kind} omitted: {}]", one_line(d)),
        None => format!("[{kind} omitted]"),
    }
}

/// A reference to a tool that is already in the tool list (or unknown).
pub fn tool_reference(name: &str) -> String {
    format!("[tool reference: {}]", one_line(name))
}

/// A deferred tool loaded by a tool result: its definition, in the JSON shape of the tool list.
pub fn tool_loaded(t: &ToolSpec) -> String {
    let (name, description) = (Value::String(t.name.clone()), Value::String(t.description.clone()));
    let def = format!("{{\"name\":{name},\"description\":{description},\"parameters\":{}}}", t.parameters);
    format!("[tool loaded: {}] {def}", one_line(&t.name))
}

/// The note for an OpenAI content part (Chat `image_url` / `input_audio` / `file`, Responses `input_image` /
/// `input_file`, anything else by its type).
pub fn openai_part(kind: &str, part: &Value) -> String {
    let filename =
        part.get("filename").or_else(|| part.get("file").and_then(|f| f.get("filename"))).and_then(Value::as_str);
    match kind {
        "image_url" | "input_image" | "image" => omitted("image", None),
        "input_audio" | "audio" => omitted("audio", None),
        "file" | "input_file" => omitted("file", filename),
        other => omitted(if other.is_empty() { "content" } else { other }, None),
    }
}

/// Notes are one line: newlines and brackets in client-chosen names are flattened.
fn one_line(s: &str) -> String {
    s.chars().map(|c| if c.is_control() || c == ']' { ' ' } else { c }).collect::<String>().trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn notes_are_short_and_one_line() {
        assert_eq!(omitted("image", None), "[image omitted]");
        assert_eq!(omitted("document", Some("a]\nb")), "[document omitted: a  b]");
        assert_eq!(tool_reference("Read"), "[tool reference: Read]");
        assert_eq!(openai_part("input_file", &json!({"filename": "x.pdf"})), "[file omitted: x.pdf]");
        assert_eq!(openai_part("file", &json!({"file": {"filename": "y"}})), "[file omitted: y]");
        assert_eq!(openai_part("image_url", &json!({})), "[image omitted]");
        let t = ToolSpec { name: "T".into(), description: "d".into(), parameters: json!({"type": "object"}) };
        assert_eq!(
            tool_loaded(&t),
            r#"[tool loaded: T] {"name":"T","description":"d","parameters":{"type":"object"}}"#
        );
    }
}
