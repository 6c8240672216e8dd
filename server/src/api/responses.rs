//! `POST /v1/responses` (OpenAI Responses, as Codex uses it: stateless, `store: false`, full history each turn).
//!
//! Input items: messages (`role` system/developer → system, user, assistant; content a string or `input_text` /
//! `output_text` / `text` parts; `input_image`, `input_file` and other parts become short notes, see
//! [`crate::api::content`]), `function_call` (joined to the preceding assistant turn), `function_call_output`
//! (string or parts), `custom_tool_call` / `custom_tool_call_output` (treated as function calls with raw input),
//! `reasoning` (its text becomes the next assistant turn's reasoning). Other item types are ignored. `instructions`
//! becomes a leading system message. Tools: `function` tools are offered (a `defer_loading: true` one only once a
//! `tool_search_output` item lists it); `custom` (freeform) tools are offered as a tool with one plain-text
//! parameter, `input` (the rendering a `custom_tool_call` input item gets too), whose value follows the tool's
//! `format`: `{"type": "grammar", "syntax": "lark" | "regex", "definition": …}` constrains it by grammar,
//! `{"type": "text"}` or no format leaves it free; a bad grammar is a 400 naming the tool (`tools[i].format`).
//! `namespace`, `web_search`, `tool_search` and any other type are skipped, not rejected. The response echoes the
//! request's `tools` as sent. `tool_choice`: `"none"` hides the tools; `"required"` or `{"type": "custom" |
//! "function", "name": …}` forces a call (of that tool, when it is offered; a custom tool that is not is a 400);
//! anything else lets the model choose; `parallel_tool_calls: false` allows one call. `reasoning` (any value but
//! `effort: "none"`) turns thinking on. `previous_response_id` is refused: nothing is stored. `text.format` and
//! `tools[].strict` constrain the output ([`crate::structured`]); the format is echoed in the response's `text`.
//!
//! Output items: `reasoning`, `message`, `function_call` and, for a custom tool, `custom_tool_call`
//! (`{call_id, name, input, id, status}`, `input` the raw text).
//!
//! Stream events (each with `sequence_number`): `response.created`, `response.in_progress`, then per output item
//! `response.output_item.added` … `response.output_item.done` (reasoning: `response.reasoning_text.delta/done`;
//! message: `response.content_part.added`, `response.output_text.delta/done`, `response.content_part.done`;
//! function call: `response.function_call_arguments.delta/done`; custom tool call:
//! `response.custom_tool_call_input.delta/done`), and finally `response.completed`,
//! `response.incomplete` (`incomplete_details.reason: "max_output_tokens"`: the output limit) or `response.failed`
//! with `error.code: "context_length_exceeded"` (the context filled up: Codex's signal to compact). Errors
//! mid-stream: `response.failed`. Keep-alives are SSE comments.

use std::sync::Arc;

use bytes::Bytes;
use hyper::{HeaderMap, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::errors::ApiError;
use crate::api::{content, max_tokens, models, now_unix, parse_json, sampling};
use crate::generate::{new_id, Finish, GenEvent, GenOptions, Generation, Usage};
use crate::model::{ChatTurn, Conversation, ToolSpec, TurnRole, TurnToolCall};
use crate::response::{json_response, sse_response, Body};
use crate::sse;
use crate::state::AppState;
use crate::structured::{
    custom_description, custom_input, custom_parameters, CustomFormat, CustomTool, Force, ToolRules,
};

#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: Option<String>,
    input: Input,
    instructions: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    stream: Option<bool>,
    max_output_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    reasoning: Option<Value>,
    previous_response_id: Option<String>,
    parallel_tool_calls: Option<bool>,
    text: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// Text of a content value: text parts as they are, other parts (`input_image`, `input_file`, …) as short notes.
fn text_of(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = Vec::new();
            for p in parts {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text" | "summary_text" | "reasoning_text", Some(t)) => {
                        out.push(t.to_string())
                    }
                    ("refusal", _) => {}
                    _ => out.push(content::openai_part(kind, p)),
                }
            }
            Ok(out.join("\n"))
        }
        _ => Err(ApiError::param(at, "content must be a string or a list of content parts")),
    }
}

fn str_field<'a>(item: &'a Value, key: &str) -> Option<&'a str> {
    item.get(key).and_then(Value::as_str)
}

/// A `custom` tool's format: none or `{"type": "text"}` (free text), or `{"type": "grammar", "syntax": "lark" |
/// "regex", "definition": …}`.
fn custom_format(t: &Value, at: &str) -> Result<CustomFormat, ApiError> {
    let param = format!("{at}.format");
    let Some(f) = t.get("format").filter(|f| !f.is_null()) else { return Ok(CustomFormat::Text) };
    let name = str_field(t, "name").unwrap_or_default();
    let bad = |msg: String| ApiError::param(&param, format!("custom tool `{name}`: {msg}"));
    match str_field(f, "type") {
        Some("text") => Ok(CustomFormat::Text),
        Some("grammar") => {
            let def =
                str_field(f, "definition").ok_or_else(|| bad("a grammar format needs a string `definition`".into()))?;
            match str_field(f, "syntax") {
                Some("lark") => Ok(CustomFormat::Lark(def.to_string())),
                Some("regex") => Ok(CustomFormat::Regex(def.to_string())),
                Some(other) => Err(bad(format!("grammar syntax `{other}` is not supported (lark or regex)"))),
                None => Err(bad("a grammar format needs a `syntax` (lark or regex)".into())),
            }
        }
        Some(other) => Err(bad(format!("unsupported format type `{other}`; expected text or grammar"))),
        None => Err(bad("the format needs a string `type`".into())),
    }
}

/// `tool_choice` as a forced call: `"required"`, or `{"type": "custom" | "function", "name": …}`.
fn forced(choice: Option<&Value>) -> Option<Force> {
    match choice? {
        Value::String(s) if s == "required" => Some(Force::Any),
        v @ Value::Object(_) if matches!(str_field(v, "type"), Some("custom" | "function")) => {
            str_field(v, "name").map(|n| Force::Tool(n.to_string()))
        }
        _ => None,
    }
}

fn conversation(req: &mut ResponsesRequest) -> Result<(Conversation, ToolRules), ApiError> {
    let mut conv = Conversation::default();
    if let Some(i) = req.instructions.take().filter(|i| !i.is_empty()) {
        conv.messages.push(ChatTurn::new(TurnRole::System, i));
    }
    let items = match std::mem::replace(&mut req.input, Input::Items(Vec::new())) {
        Input::Text(t) => vec![json!({"type": "message", "role": "user", "content": t})],
        Input::Items(v) => v,
    };
    let mut pending_reasoning = String::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        if !item.is_object() {
            return Err(ApiError::param(&at, "each input item must be an object"));
        }
        let kind = str_field(item, "type").unwrap_or(if item.get("role").is_some() { "message" } else { "" });
        let last_assistant = |conv: &mut Conversation| -> usize {
            match conv.messages.last() {
                Some(m) if m.role == TurnRole::Assistant => conv.messages.len() - 1,
                _ => {
                    conv.messages.push(ChatTurn::new(TurnRole::Assistant, ""));
                    conv.messages.len() - 1
                }
            }
        };
        match kind {
            "message" => {
                let role = match str_field(item, "role") {
                    Some("system" | "developer") => TurnRole::System,
                    Some("user") => TurnRole::User,
                    Some("assistant") => TurnRole::Assistant,
                    Some(other) => {
                        return Err(ApiError::param(&format!("{at}.role"), format!("unknown role `{other}`")));
                    }
                    None => return Err(ApiError::param(&format!("{at}.role"), "a message needs a string `role`")),
                };
                let text = text_of(item.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
                let mut m = ChatTurn::new(role, text);
                if role == TurnRole::Assistant {
                    m.reasoning = std::mem::take(&mut pending_reasoning);
                }
                conv.messages.push(m);
            }
            "function_call" | "custom_tool_call" => {
                let name = str_field(item, "name").unwrap_or_default().to_string();
                let arguments = match kind {
                    "function_call" => str_field(item, "arguments").unwrap_or("{}").to_string(),
                    _ => json!({"input": str_field(item, "input").unwrap_or("")}).to_string(),
                };
                let id = str_field(item, "call_id").or(str_field(item, "id")).unwrap_or_default().to_string();
                let idx = last_assistant(&mut conv);
                let m = &mut conv.messages[idx];
                if m.reasoning.is_empty() {
                    m.reasoning = std::mem::take(&mut pending_reasoning);
                }
                m.tool_calls.push(TurnToolCall { id, name, arguments });
            }
            "function_call_output" | "custom_tool_call_output" => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => text_of(v, &format!("{at}.output"))?,
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                let mut m = ChatTurn::new(TurnRole::Tool, output);
                m.tool_call_id = str_field(item, "call_id").map(str::to_string);
                conv.messages.push(m);
            }
            "reasoning" => {
                for key in ["content", "summary"] {
                    if let Some(v) = item.get(key).filter(|v| v.is_array()) {
                        let t = text_of(v, &format!("{at}.{key}"))?;
                        if !t.is_empty() {
                            pending_reasoning = t;
                            break;
                        }
                    }
                }
            }
            _ => {} // item types this server does not use (web_search_call, compaction, …)
        }
    }
    if !conv.messages.iter().any(|m| m.role != TurnRole::System) {
        return Err(ApiError::param("input", "input must contain at least one user message"));
    }
    let hide_tools = matches!(&req.tool_choice, Some(Value::String(s)) if s == "none");
    // A deferred function tool (`defer_loading: true`) is offered once a `tool_search_output` item loaded it.
    let loaded: Vec<&str> = items
        .iter()
        .filter(|i| str_field(i, "type") == Some("tool_search_output"))
        .filter_map(|i| i.get("tools").and_then(Value::as_array))
        .flatten()
        .filter_map(|t| str_field(t, "name"))
        .collect();
    let mut rules = ToolRules {
        strict: crate::structured::strict_names(req.tools.as_deref().unwrap_or_default(), None),
        ..ToolRules::default()
    };
    for (i, t) in req.tools.clone().unwrap_or_default().into_iter().enumerate() {
        if hide_tools {
            continue;
        }
        if str_field(&t, "type") == Some("custom") {
            let at = format!("tools[{i}]");
            let name = str_field(&t, "name").filter(|n| !n.is_empty());
            let name = name.ok_or_else(|| ApiError::param(&format!("{at}.name"), "a custom tool needs a `name`"))?;
            if conv.tools.iter().any(|x| x.name == name) {
                return Err(ApiError::param(&format!("{at}.name"), format!("tool name `{name}` is used twice")));
            }
            let format = custom_format(&t, &at)?;
            conv.tools.push(ToolSpec {
                name: name.to_string(),
                description: custom_description(str_field(&t, "description").unwrap_or_default(), &format),
                parameters: custom_parameters(),
            });
            rules.custom.push(CustomTool { name: name.to_string(), format, param: format!("{at}.format") });
            continue;
        }
        if str_field(&t, "type") != Some("function") {
            continue;
        }
        let deferred = t.get("defer_loading").and_then(Value::as_bool) == Some(true);
        if deferred && !str_field(&t, "name").is_some_and(|n| loaded.contains(&n)) {
            continue;
        }
        let Some(name) = str_field(&t, "name") else { continue };
        conv.tools.push(ToolSpec {
            name: name.to_string(),
            description: str_field(&t, "description").unwrap_or_default().to_string(),
            parameters: t.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
        });
    }
    // A function tool of a custom tool's name (in either order) is ambiguous.
    if let Some(c) = rules.custom.iter().find(|c| conv.tools.iter().filter(|t| t.name == c.name).count() > 1) {
        return Err(ApiError::param("tools", format!("tool name `{}` is used twice", c.name)));
    }
    rules.single = req.parallel_tool_calls == Some(false);
    // A forced call needs its tool offered. A named custom tool or `"required"` without any tools is a 400; a
    // named function tool this server does not offer (inside a namespace, deferred) or `"required"` with only tool
    // types it skips leaves the choice to the model.
    let force = if hide_tools { None } else { forced(req.tool_choice.as_ref()) };
    let named_custom = str_field(req.tool_choice.as_ref().unwrap_or(&Value::Null), "type") == Some("custom");
    rules.force = match force {
        Some(Force::Any) if req.tools.as_ref().is_none_or(Vec::is_empty) => {
            return Err(ApiError::param("tool_choice", "tool_choice asks for a tool call, but no tool is offered"))
        }
        Some(Force::Tool(n)) if !conv.tools.iter().any(|t| t.name == n) => {
            if named_custom {
                return Err(ApiError::param(
                    "tool_choice",
                    format!("tool_choice names `{n}`, which is not an offered custom tool"),
                ));
            }
            None
        }
        Some(Force::Any) if conv.tools.is_empty() => None,
        f => f,
    };
    conv.thinking = match &req.reasoning {
        None | Some(Value::Null) => false,
        Some(r) => str_field(r, "effort") != Some("none"),
    };
    Ok((conv, rules))
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The parts of a response object that do not depend on the output.
struct Envelope {
    id: String,
    created: u64,
    model: String,
    max_output_tokens: Option<u64>,
    parallel_tool_calls: bool,
    tool_choice: Value,
    /// The request's tools, echoed as sent.
    tools: Value,
    /// The request's `text` (its `format`), echoed.
    text: Value,
}

impl Envelope {
    fn object(&self, status: &str, output: &[Value], usage: Option<&Usage>, finish: Option<Finish>) -> Value {
        let incomplete = (finish == Some(Finish::Length)).then(|| json!({"reason": "max_output_tokens"}));
        let error = (finish == Some(Finish::ContextFull)).then(|| {
            json!({"code": "context_length_exceeded",
                "message": "the context window filled up before the answer ended; compact or shorten the conversation"})
        });
        json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": error, "incomplete_details": incomplete,
            "instructions": null, "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls, "tool_choice": self.tool_choice, "tools": self.tools,
            "previous_response_id": null, "reasoning": null, "store": false, "temperature": null, "top_p": null,
            "text": self.text, "truncation": "disabled", "metadata": {},
            "usage": usage.map(usage_json),
        })
    }
}

/// `incomplete` at the output limit; `failed` (error `context_length_exceeded`, Codex's signal to compact) when the
/// context filled up.
fn status_of(finish: Finish) -> &'static str {
    match finish {
        Finish::Length => "incomplete",
        Finish::ContextFull => "failed",
        _ => "completed",
    }
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
        "content": [{"type": "reasoning_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, c: &TurnToolCall, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": c.id, "name": c.name, "arguments": arguments,
        "status": status})
}

fn custom_item(id: &str, c: &TurnToolCall, input: &str, status: &str) -> Value {
    json!({"type": "custom_tool_call", "id": id, "call_id": c.id, "name": c.name, "input": input, "status": status})
}

/// The output item of a finished call: `custom_tool_call` (with the raw input) for a custom tool, else
/// `function_call`.
fn finished_call_item(c: &TurnToolCall, rules: &ToolRules) -> Value {
    match rules.custom(&c.name) {
        Some(_) => custom_item(&new_id("ctc_"), c, &custom_input(&c.arguments), "completed"),
        None => call_item(&new_id("fc_"), c, &c.arguments, "completed"),
    }
}

/// The conversation a request body describes (no model check, no tool-call memory): what tests render.
pub fn to_conversation(body: &[u8]) -> Result<Conversation, ApiError> {
    let mut req: ResponsesRequest = parse_json(body)?;
    conversation(&mut req).map(|(conv, _)| conv)
}

/// `POST /v1/responses`.
pub async fn handle(state: Arc<AppState>, _headers: HeaderMap, body: Bytes) -> Result<Response<Body>, ApiError> {
    let mut req: ResponsesRequest = parse_json(&body)?;
    let model = models::check(&state, req.model.as_deref())?;
    if req.previous_response_id.is_some() {
        return Err(ApiError::param(
            "previous_response_id",
            "previous_response_id is not supported: this server stores nothing; send the whole input",
        ));
    }
    let opts = GenOptions {
        sampling: sampling(req.temperature, req.top_p, None, None)?,
        max_tokens: max_tokens("max_output_tokens", req.max_output_tokens)?,
        stop: Vec::new(),
        thinking: false,
        tool_id_prefix: "call_",
        raw: false,
        constraint: None,
    };
    let format = crate::structured::responses_text_format(req.text.as_ref())?;
    let (mut conv, rules) = conversation(&mut req)?;
    state.tools.restore(&mut conv);
    let tokens = crate::api::prompt_tokens(&state, &conv, "input").await?;
    let constraint =
        crate::structured::plan_with(&state, format, "text.format", &conv.tools, &rules, conv.thinking).await?;
    let gen = Generation::start(&state, tokens, GenOptions { thinking: conv.thinking, constraint, ..opts })?;
    let env = Envelope {
        id: new_id("resp_"),
        created: now_unix(),
        model,
        max_output_tokens: req.max_output_tokens,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        tools: Value::Array(req.tools.take().unwrap_or_default()),
        text: match req.text.as_ref().and_then(|t| t.get("format")) {
            Some(f) if !f.is_null() => json!({"format": f}),
            _ => json!({"format": {"type": "text"}}),
        },
    };
    if !req.stream.unwrap_or(false) {
        let out = gen.collect().await?;
        let mut output = Vec::new();
        if !out.reasoning.is_empty() {
            output.push(reasoning_item(&new_id("rs_"), &out.reasoning, "completed"));
        }
        if !out.content.is_empty() || out.tool_calls.is_empty() {
            output.push(message_item(&new_id("msg_"), &out.content, "completed"));
        }
        for c in &out.tool_calls {
            output.push(finished_call_item(c, &rules));
        }
        let status = status_of(out.finish);
        return Ok(json_response(200, &env.object(status, &output, Some(&out.usage), Some(out.finish))));
    }
    let (tx, response) = sse_response();
    tokio::spawn(async move {
        let mut w = Writer { tx, seq: 0, output: Vec::new(), open: None, rules };
        let created = env.object("in_progress", &[], None, None);
        if !w.emit("response.created", json!({"response": created})).await
            || !w.emit("response.in_progress", json!({"response": created})).await
        {
            return;
        }
        let mut gen = gen;
        gen.watch(&w.tx);
        while let Some(ev) = gen.next().await {
            let ok = match ev {
                Ok(GenEvent::KeepAlive) => w.tx.send(sse::comment("keep-alive")).await,
                Ok(GenEvent::Reasoning(r)) => w.text("reasoning", &r).await,
                Ok(GenEvent::Content(c)) => w.text("message", &c).await,
                Ok(GenEvent::ToolCall(c)) => w.call(&c).await,
                Err(e) => {
                    let _ = w.close_open().await;
                    let mut failed = env.object("failed", &w.output, Some(&gen.usage()), None);
                    failed["error"] = json!({"code": "server_error", "message": e.message});
                    let _ = w.emit("response.failed", json!({"response": failed})).await;
                    return;
                }
            };
            if !ok {
                return;
            }
        }
        if !w.close_open().await {
            return;
        }
        let finish = gen.finish();
        let status = status_of(finish);
        let done = env.object(status, &w.output, Some(&gen.usage()), Some(finish));
        let _ = w.emit(&format!("response.{status}"), json!({"response": done})).await;
    });
    Ok(response)
}

/// The streaming state: sequence numbers, finished output items, the open text item.
struct Writer {
    tx: sse::SseSender,
    seq: u64,
    output: Vec<Value>,
    /// (kind "reasoning"/"message", item id, text so far).
    open: Option<(&'static str, String, String)>,
    /// Which calls are custom tool calls.
    rules: ToolRules,
}

impl Writer {
    async fn emit(&mut self, kind: &str, mut data: Value) -> bool {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.tx.send(sse::event(kind, &data)).await
    }

    /// Append text to an open item of `kind`, opening one (and closing another) as needed.
    async fn text(&mut self, kind: &'static str, delta: &str) -> bool {
        if self.open.as_ref().map(|o| o.0) != Some(kind) {
            if !self.close_open().await {
                return false;
            }
            let (prefix, item) = if kind == "reasoning" { ("rs_", "reasoning") } else { ("msg_", "message") };
            let id = new_id(prefix);
            let out_index = self.output.len();
            let added = if item == "reasoning" {
                json!({"type": "reasoning", "id": id, "status": "in_progress", "summary": [], "content": []})
            } else {
                message_item(&id, "", "in_progress")
            };
            if !self.emit("response.output_item.added", json!({"output_index": out_index, "item": added})).await {
                return false;
            }
            let part = if kind == "reasoning" {
                json!({"type": "reasoning_text", "text": ""})
            } else {
                json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            };
            let ev = json!({"item_id": id, "output_index": out_index, "content_index": 0, "part": part});
            if !self.emit("response.content_part.added", ev).await {
                return false;
            }
            self.open = Some((kind, id, String::new()));
        }
        let out_index = self.output.len();
        let (_, id, text) = self.open.as_mut().expect("opened above");
        text.push_str(delta);
        let id = id.clone();
        let name = if kind == "reasoning" { "response.reasoning_text.delta" } else { "response.output_text.delta" };
        let mut ev = json!({"item_id": id, "output_index": out_index, "content_index": 0, "delta": delta});
        if kind == "message" {
            ev["logprobs"] = json!([]);
        }
        self.emit(name, ev).await
    }

    async fn close_open(&mut self) -> bool {
        let Some((kind, id, text)) = self.open.take() else { return true };
        let out_index = self.output.len();
        let (done_name, part, item) = if kind == "reasoning" {
            (
                "response.reasoning_text.done",
                json!({"type": "reasoning_text", "text": text}),
                reasoning_item(&id, &text, "completed"),
            )
        } else {
            (
                "response.output_text.done",
                json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []}),
                message_item(&id, &text, "completed"),
            )
        };
        let base = json!({"item_id": id, "output_index": out_index, "content_index": 0});
        let mut done = base.clone();
        done["text"] = json!(text);
        if kind == "message" {
            done["logprobs"] = json!([]);
        }
        let mut part_done = base;
        part_done["part"] = part;
        let ok = self.emit(done_name, done).await
            && self.emit("response.content_part.done", part_done).await
            && self.emit("response.output_item.done", json!({"output_index": out_index, "item": item})).await;
        self.output.push(item);
        ok
    }

    async fn call(&mut self, c: &TurnToolCall) -> bool {
        if !self.close_open().await {
            return false;
        }
        if self.rules.custom(&c.name).is_some() {
            return self.custom_call(c).await;
        }
        let id = new_id("fc_");
        let i = self.output.len();
        let done_item = call_item(&id, c, &c.arguments, "completed");
        let ok = self
            .emit(
                "response.output_item.added",
                json!({"output_index": i, "item": call_item(&id, c, "", "in_progress")}),
            )
            .await
            && self
                .emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": i,
                    "delta": c.arguments}),
                )
                .await
            && self
                .emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": i,
                    "name": c.name, "arguments": c.arguments}),
                )
                .await
            && self.emit("response.output_item.done", json!({"output_index": i, "item": done_item})).await;
        self.output.push(done_item);
        ok
    }

    /// A custom tool's call: `custom_tool_call` with its raw input (`response.custom_tool_call_input.delta/done`).
    async fn custom_call(&mut self, c: &TurnToolCall) -> bool {
        let id = new_id("ctc_");
        let i = self.output.len();
        let input = custom_input(&c.arguments);
        let done_item = custom_item(&id, c, &input, "completed");
        let ok = self
            .emit(
                "response.output_item.added",
                json!({"output_index": i, "item": custom_item(&id, c, "", "in_progress")}),
            )
            .await
            && self
                .emit(
                    "response.custom_tool_call_input.delta",
                    json!({"item_id": id, "output_index": i, "delta": input}),
                )
                .await
            && self
                .emit("response.custom_tool_call_input.done", json!({"item_id": id, "output_index": i, "input": input}))
                .await
            && self.emit("response.output_item.done", json!({"output_index": i, "item": done_item})).await;
        self.output.push(done_item);
        ok
    }
}
