//! `POST /v1/chat/completions` (OpenAI Chat Completions, DeepSeek flavour: `reasoning_content` beside `content`).
//!
//! Accepted: `messages` (system/developer/user/assistant/tool; content as a string or parts: text parts as they are,
//! `image_url` / `input_audio` / `file` parts as short notes, see [`crate::api::content`]), `tools`
//! (function tools; other types are skipped), `tool_choice` (`"none"` hides the tools; `"required"` or
//! `{"type": "function", "function": {"name": …}}` forces a call of an offered tool or that one, a name not offered
//! is a 400), `parallel_tool_calls` (`false`: at most one call),
//! `stream`, `stream_options.include_usage`, `max_tokens`/`max_completion_tokens`, `temperature`, `top_p`, `top_k`,
//! `seed`, `stop`, `n` (1 only), `reasoning_effort` / `thinking` (turn reasoning on), `response_format` and
//! `tools[].function.strict` (structured outputs, see [`crate::structured`]). Unknown fields are ignored.
//! Assistant turns may echo `reasoning_content` (opencode sends `""`).
//!
//! Stream: a role chunk, then `reasoning_content` / `content` / `tool_calls` delta chunks (a call's id and name first
//! with empty arguments, then its arguments), a chunk with `finish_reason`, a usage chunk with `choices: []` when
//! `stream_options.include_usage` is set, and `data: [DONE]`. Keep-alives are SSE comments.

use std::sync::Arc;

use bytes::Bytes;
use hyper::{HeaderMap, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::errors::{ApiError, Flavor};
use crate::api::{content, max_tokens, models, now_unix, parse_json, sampling, stop_strings, OneOrMany};
use crate::generate::{new_id, Finish, GenEvent, GenOptions, Generation, Usage};
use crate::model::{ChatTurn, Conversation, ToolSpec, TurnRole, TurnToolCall};
use crate::response::{json_response, sse_response, Body};
use crate::sse;
use crate::state::AppState;

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Vec<ChatTool>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u64>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany>,
    pub n: Option<u64>,
    pub reasoning_effort: Option<String>,
    pub thinking: Option<Value>,
    pub response_format: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    pub reasoning_content: Option<String>,
    pub tool_calls: Option<Vec<ChatToolCall>>,
    pub tool_call_id: Option<String>,
}

/// A string, or a list of content parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    /// Content parts as sent (`text`, `image_url`, `input_audio`, `file`, …).
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
pub struct ChatToolCall {
    pub id: Option<String>,
    pub function: FunctionCall,
}

#[derive(Debug, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON string (an object is tolerated and serialised).
    pub arguments: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChatTool {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: Option<FunctionDef>,
}

#[derive(Debug, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// Text of a content field; parts the model cannot see (images, audio, files) become short notes.
fn content_text(c: Option<Content>, at: &str) -> Result<String, ApiError> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(s)) => Ok(s),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                let Some(kind) = p.get("type").and_then(Value::as_str) else {
                    return Err(ApiError::param(at, "each content part must be an object with a `type`"));
                };
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text" | "output_text", Some(t)) => out.push_str(t),
                    ("text" | "input_text" | "output_text" | "refusal", None) | ("refusal", _) => {}
                    _ => out.push_str(&content::openai_part(kind, &p)),
                }
            }
            Ok(out)
        }
    }
}

fn arguments_text(v: Option<Value>) -> String {
    match v {
        None | Some(Value::Null) => "{}".into(),
        Some(Value::String(s)) => s,
        Some(other) => other.to_string(),
    }
}

/// Convert the request into a conversation (tool-call memory is applied by the caller).
/// `tool_choice` as a forced call: `"required"`, or `{"type": "function", "function": {"name": …}}`.
fn forced(choice: Option<&Value>) -> Option<crate::structured::Force> {
    use crate::structured::Force;
    match choice? {
        Value::String(s) if s == "required" => Some(Force::Any),
        v @ Value::Object(_) if v.get("type").and_then(Value::as_str) == Some("function") => {
            v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).map(|n| Force::Tool(n.to_string()))
        }
        _ => None,
    }
}

pub fn conversation(req: &mut ChatRequest) -> Result<Conversation, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::param("messages", "messages must not be empty"));
    }
    let mut conv = Conversation::default();
    for (i, m) in std::mem::take(&mut req.messages).into_iter().enumerate() {
        let at = format!("messages[{i}].content");
        let role = match m.role.as_str() {
            "system" | "developer" => TurnRole::System,
            "user" => TurnRole::User,
            "assistant" => TurnRole::Assistant,
            "tool" | "function" => TurnRole::Tool,
            other => return Err(ApiError::param(&format!("messages[{i}].role"), format!("unknown role `{other}`"))),
        };
        let mut msg = ChatTurn::new(role, content_text(m.content, &at)?);
        msg.reasoning = m.reasoning_content.unwrap_or_default();
        msg.tool_call_id = m.tool_call_id;
        for c in m.tool_calls.unwrap_or_default() {
            let id = c.id.unwrap_or_else(|| new_id("call_"));
            msg.tool_calls.push(TurnToolCall {
                id,
                name: c.function.name,
                arguments: arguments_text(c.function.arguments),
            });
        }
        conv.messages.push(msg);
    }
    let hide_tools = matches!(&req.tool_choice, Some(Value::String(s)) if s == "none");
    if !hide_tools {
        for t in req.tools.take().unwrap_or_default() {
            if let (None | Some("function"), Some(f)) = (t.kind.as_deref(), t.function) {
                conv.tools.push(ToolSpec {
                    name: f.name,
                    description: f.description.unwrap_or_default(),
                    parameters: f.parameters.unwrap_or_else(|| json!({"type": "object", "properties": {}})),
                });
            }
        }
    }
    let effort_on = req.reasoning_effort.as_deref().is_some_and(|e| e != "none" && e != "minimal");
    let thinking_on =
        req.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str).is_some_and(|t| t != "disabled");
    conv.thinking = effort_on || thinking_on;
    Ok(conv)
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "prompt_cache_hit_tokens": u.cached_tokens,
        "prompt_cache_miss_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
    })
}

fn finish_str(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::StopSequence => "stop",
        // Chat Completions has one signal for both limits.
        Finish::Length | Finish::ContextFull => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

fn tool_call_json(c: &TurnToolCall) -> Value {
    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// `POST /v1/chat/completions`.
pub async fn handle(state: Arc<AppState>, _headers: HeaderMap, body: Bytes) -> Result<Response<Body>, ApiError> {
    let mut req: ChatRequest = parse_json(&body)?;
    let model = models::check(&state, req.model.as_deref())?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::param("n", "only n = 1 is supported"));
    }
    let opts = GenOptions {
        sampling: sampling(req.temperature, req.top_p, req.top_k, req.seed)?,
        max_tokens: max_tokens("max_tokens", req.max_completion_tokens.or(req.max_tokens))?,
        stop: stop_strings("stop", req.stop.take().map(OneOrMany::into_vec))?,
        thinking: false,
        tool_id_prefix: "call_",
        raw: false,
        constraint: None,
    };
    let format = crate::structured::openai_response_format(req.response_format.as_ref())?;
    let strict: Vec<String> = req
        .tools
        .iter()
        .flatten()
        .filter_map(|t| t.function.as_ref())
        .filter(|f| f.strict == Some(true))
        .map(|f| f.name.clone())
        .collect();
    let mut conv = conversation(&mut req)?;
    state.tools.restore(&mut conv);
    let tokens = crate::api::prompt_tokens(&state, &conv, "messages").await?;
    let rules = crate::structured::ToolRules {
        strict,
        force: crate::structured::check_force(forced(req.tool_choice.as_ref()), &conv.tools, "tool_choice")?,
        single: req.parallel_tool_calls == Some(false),
        ..Default::default()
    };
    let constraint =
        crate::structured::plan_with(&state, format, "response_format", &conv.tools, &rules, conv.thinking).await?;
    let gen = Generation::start(&state, tokens, GenOptions { thinking: conv.thinking, constraint, ..opts })?;
    let id = new_id("chatcmpl-");
    let created = now_unix();
    if !req.stream.unwrap_or(false) {
        let out = gen.collect().await?;
        let mut message = json!({"role": "assistant", "content": out.content});
        if !out.reasoning.is_empty() {
            message["reasoning_content"] = json!(out.reasoning);
        }
        if !out.tool_calls.is_empty() {
            message["tool_calls"] = out.tool_calls.iter().map(tool_call_json).collect();
        }
        return Ok(json_response(
            200,
            &json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_str(out.finish),
                    "logprobs": null}],
                "usage": usage_json(&out.usage),
                "system_fingerprint": null,
            }),
        ));
    }
    let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let (tx, response) = sse_response();
    tokio::spawn(async move {
        let chunk = |delta: Value, finish: Option<&str>| {
            sse::data(&json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": null,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
            }))
        };
        let mut gen = gen;
        gen.watch(&tx);
        let mut started = false;
        let mut tool_index = 0usize;
        while let Some(ev) = gen.next().await {
            let ev = match ev {
                Ok(ev) => ev,
                Err(e) => {
                    let _ = tx.send(sse::data(&e.body(Flavor::OpenAi))).await;
                    return;
                }
            };
            if !started && ev != GenEvent::KeepAlive {
                started = true;
                if !tx.send(chunk(json!({"role": "assistant", "content": ""}), None)).await {
                    return;
                }
            }
            let frame = match ev {
                GenEvent::KeepAlive => sse::comment("keep-alive"),
                GenEvent::Reasoning(r) => chunk(json!({"reasoning_content": r}), None),
                GenEvent::Content(c) => chunk(json!({"content": c}), None),
                GenEvent::ToolCall(c) => {
                    let i = tool_index;
                    tool_index += 1;
                    let head = json!({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": ""}}]});
                    if !tx.send(chunk(head, None)).await {
                        return;
                    }
                    chunk(json!({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]}), None)
                }
            };
            if !tx.send(frame).await {
                return;
            }
        }
        if !started && !tx.send(chunk(json!({"role": "assistant", "content": ""}), None)).await {
            return;
        }
        if !tx.send(chunk(json!({}), Some(finish_str(gen.finish())))).await {
            return;
        }
        if include_usage {
            let usage = sse::data(&json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": usage_json(&gen.usage()),
            }));
            if !tx.send(usage).await {
                return;
            }
        }
        let _ = tx.send(sse::done()).await;
    });
    Ok(response)
}
