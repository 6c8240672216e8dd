//! Chat messages as the renderer and the API server see them (OpenAI-style JSON, DeepSeek extensions).
//!
//! Accepted shapes (serde):
//! * `role`: `system`, `user`, `assistant`, `tool`, `developer`, `latest_reminder`.
//! * `content`: a string, `null`, or a list of blocks; text blocks (`{"type":"text","text":…}`, also `input_text` /
//!   `output_text`) are joined with `"\n\n"`, any other block becomes `[Unsupported TYPE]` (as the official encoder
//!   writes unsupported tool-result blocks).
//! * `tool_calls`: OpenAI `{"id","type":"function","function":{"name","arguments"}}` or flat `{"id","name","arguments"}`;
//!   `arguments` is a JSON string (an object is accepted and written as Python-style JSON text).
//! * `tools`: OpenAI `{"type":"function","function":{…}}` or the bare function object; the function object keeps its
//!   key order ([`JsonValue`]) because the prompt shows it verbatim.
//! * `task` (`action`, `query`, `authority`, `domain`, `title`, `read_url`), `response_format`, `wo_eos` (render an
//!   assistant turn without the closing EOS, to continue it). Unknown fields are ignored.
//!
//! [`RenderInput::from_json`] takes either a list of messages or `{"tools": [...], "messages": [...]}`, where the
//! tools belong to the first message.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::json::JsonValue;
use crate::{Error, Result};

/// Who wrote a message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    #[default]
    User,
    Assistant,
    Tool,
    Developer,
    LatestReminder,
}

/// One tool call of an assistant message.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ToolCall {
    pub id: Option<String>,
    pub name: String,
    /// The arguments as JSON text (an object).
    pub arguments: String,
}

/// One tool definition; `function` is the `{name, description, parameters}` object in document order.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub function: JsonValue,
}

impl Tool {
    /// The function's name, if it has one.
    pub fn name(&self) -> Option<&str> {
        self.function.get("name").and_then(JsonValue::as_str)
    }
}

/// One chat message.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(default, deserialize_with = "de_content", skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, deserialize_with = "de_null_vec", skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, deserialize_with = "de_null_vec", skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<Tool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<JsonValue>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wo_eos: bool,
}

impl Message {
    /// A message with a role and text content.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message { role, content: Some(content.into()), ..Default::default() }
    }
}

/// What the renderer takes: the conversation (tools live on the system or developer message that declares them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RenderInput {
    pub messages: Vec<Message>,
}

impl RenderInput {
    /// Parses a list of messages or `{"tools": [...], "messages": [...]}` (tools go to the first message).
    pub fn from_json(text: &str) -> Result<Self> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Shape {
            List(Vec<Message>),
            Object {
                #[serde(default, deserialize_with = "de_null_vec")]
                tools: Vec<Tool>,
                messages: Vec<Message>,
            },
        }
        // Parse once as a generic value first so that errors name the real problem, not "no variant matched".
        let shape: Shape = serde_json::from_str(text).map_err(|e| {
            let detail = match serde_json::from_str::<serde_json::Value>(text) {
                Err(e2) => format!("invalid JSON: {e2}"),
                Ok(v) if v.is_array() => match serde_json::from_str::<Vec<Message>>(text) {
                    Err(e3) => format!("bad message list: {e3}"),
                    Ok(_) => e.to_string(),
                },
                Ok(_) => format!("expected a list of messages or {{\"tools\", \"messages\"}}: {e}"),
            };
            Error::Chat(detail)
        })?;
        Ok(match shape {
            Shape::List(messages) => RenderInput { messages },
            Shape::Object { tools, mut messages } => {
                if !tools.is_empty() {
                    let first = messages
                        .first_mut()
                        .ok_or_else(|| Error::Chat("tools given but there are no messages to attach them to".into()))?;
                    first.tools = tools;
                }
                RenderInput { messages }
            }
        })
    }
}

fn de_null_vec<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> std::result::Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

fn de_content<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    let v = Option::<JsonValue>::deserialize(d)?;
    Ok(match v {
        None | Some(JsonValue::Null) => None,
        Some(JsonValue::String(s)) => Some(s),
        Some(JsonValue::Array(blocks)) => Some(flatten_blocks(&blocks)),
        Some(other) => {
            return Err(serde::de::Error::custom(format!(
                "content must be a string or a list, got {}",
                other.to_python_json()
            )))
        }
    })
}

/// Joins content blocks: text blocks' text, other blocks as `[Unsupported TYPE]`, separated by `"\n\n"`.
pub fn flatten_blocks(blocks: &[JsonValue]) -> String {
    let parts: Vec<String> = blocks
        .iter()
        .map(|b| match b {
            JsonValue::String(s) => s.clone(),
            _ => {
                let ty = b.get("type").and_then(JsonValue::as_str).unwrap_or("");
                match (ty, b.get("text").and_then(JsonValue::as_str)) {
                    ("text" | "input_text" | "output_text", Some(t)) => t.to_string(),
                    ("text" | "input_text" | "output_text", None) => String::new(),
                    _ => format!("[Unsupported {ty}]"),
                }
            }
        })
        .collect();
    parts.join("\n\n")
}

impl<'de> Deserialize<'de> for ToolCall {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let v = JsonValue::deserialize(d)?;
        let f = v.get("function").unwrap_or(&v);
        let name =
            f.get("name").and_then(JsonValue::as_str).ok_or_else(|| D::Error::custom("tool call without a name"))?;
        let arguments = match f.get("arguments") {
            None | Some(JsonValue::Null) => "{}".to_string(),
            Some(JsonValue::String(s)) => s.clone(),
            Some(other) => other.to_python_json(),
        };
        let id = v.get("id").and_then(JsonValue::as_str).map(str::to_string);
        Ok(ToolCall { id, name: name.to_string(), arguments })
    }
}

impl Serialize for ToolCall {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut kv = Vec::new();
        if let Some(id) = &self.id {
            kv.push(("id".to_string(), JsonValue::String(id.clone())));
        }
        kv.push(("type".to_string(), JsonValue::String("function".into())));
        kv.push((
            "function".to_string(),
            JsonValue::Object(vec![
                ("name".to_string(), JsonValue::String(self.name.clone())),
                ("arguments".to_string(), JsonValue::String(self.arguments.clone())),
            ]),
        ));
        JsonValue::Object(kv).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Tool {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let v = JsonValue::deserialize(d)?;
        let function = match v.get("function") {
            Some(f @ JsonValue::Object(_)) => f.clone(),
            Some(_) => return Err(D::Error::custom("tool \"function\" must be an object")),
            None if matches!(v, JsonValue::Object(_)) => v,
            None => return Err(D::Error::custom("a tool must be an object")),
        };
        Ok(Tool { function })
    }
}

impl Serialize for Tool {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        JsonValue::Object(vec![
            ("type".to_string(), JsonValue::String("function".into())),
            ("function".to_string(), self.function.clone()),
        ])
        .serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_openai_shapes() {
        let m: Message = serde_json::from_str(
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
            "function":{"name":"f","arguments":"{\"a\": 1}"}}, {"name":"g","arguments":{"b":[1,2]}}],"mask":1}"#,
        )
        .unwrap();
        assert_eq!(m.content, None);
        assert_eq!(
            m.tool_calls[0],
            ToolCall { id: Some("c1".into()), name: "f".into(), arguments: "{\"a\": 1}".into() }
        );
        assert_eq!(m.tool_calls[1].arguments, "{\"b\": [1, 2]}");
        let m: Message = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"},{"type":"text","text":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(m.content.as_deref(), Some("a\n\n[Unsupported image_url]\n\nb"));
        let m: Message = serde_json::from_str(r#"{"role":"latest_reminder","content":"x","tool_calls":null}"#).unwrap();
        assert_eq!(m.role, Role::LatestReminder);
        assert!(serde_json::from_str::<Message>(r#"{"role":"robot","content":"x"}"#).is_err());
        assert!(serde_json::from_str::<Message>(r#"{"role":"user","content":5}"#).is_err());
    }

    #[test]
    fn render_input_shapes() {
        let r = RenderInput::from_json(r#"[{"role":"user","content":"hi"}]"#).unwrap();
        assert_eq!(r.messages.len(), 1);
        let r = RenderInput::from_json(
            r#"{"tools":[{"type":"function","function":{"name":"f","description":"d"}}],
               "messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}"#,
        )
        .unwrap();
        assert_eq!(r.messages[0].tools.len(), 1);
        assert_eq!(r.messages[0].tools[0].name(), Some("f"));
        assert!(r.messages[1].tools.is_empty());
        assert!(RenderInput::from_json(r#"{"tools":[{"name":"f"}],"messages":[]}"#).is_err());
        assert!(RenderInput::from_json("{").is_err());
        assert!(RenderInput::from_json("42").is_err());
    }

    #[test]
    fn tool_call_serializes_openai_style() {
        let tc = ToolCall { id: None, name: "f".into(), arguments: "{}".into() };
        assert_eq!(
            serde_json::to_string(&tc).unwrap(),
            r#"{"type":"function","function":{"name":"f","arguments":"{}"}}"#
        );
    }
}
