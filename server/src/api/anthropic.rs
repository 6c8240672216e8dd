//! `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic Messages).
//!
//! Accepted: `system` (string or blocks), `messages` (user / assistant, and the `role: "system"` turn Claude Code
//! puts inside `messages` — kept as a system message; the renderer folds one that follows a user turn into that
//! turn), `tools` (custom tools; `type`d server tools are skipped; `defer_loading: true` tools stay out of the tool
//! list until a `tool_reference` in a tool result loads them), `tool_choice` (`{"type":"none"}` hides tools;
//! `{"type":"any"}` or `{"type":"tool","name":…}` forces a call, a name not offered is a 400;
//! `disable_parallel_tool_use: true` allows one call),
//! `thinking` (`enabled`/`adaptive` turn reasoning on; `display: "omitted"` keeps it out of the answer),
//! `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences`, `stream`, `output_config.format` (or the older
//! beta `output_format`) and `tools[].strict` (structured outputs: the JSON arrives as the text block, see
//! [`crate::structured`]). `metadata`, `context_management`, `output_config.effort`, `cache_control` and every
//! `anthropic-beta` header are accepted and ignored.
//!
//! Content blocks: every type the API defines is accepted. `text` is text; `tool_use` / `server_tool_use` (assistant)
//! are tool calls; `thinking` (assistant) is reasoning, `redacted_thinking` is dropped; `tool_result` content may be
//! a string or blocks; `document` with a text source shows its text, `search_result` its title, source and text;
//! `tool_reference` names a tool; anything the model cannot see (`image`, a PDF `document`, server-tool results, …)
//! becomes a short note (see [`crate::api::content`]).
//!
//! **Billing line normalisation.** Claude Code sends `x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;` as
//! system block 0, with a suffix that changes per conversation. It carries no instruction for the model and sits in
//! front of everything else, so it would break every cross-conversation prefix match at the first tokens: any system
//! block (or first system line) starting with `x-anthropic-billing-header:` is removed before rendering.
//!
//! Usage: `input_tokens` counts the prompt tokens that were *not* served from cache, `cache_read_input_tokens` the
//! ones that were (Anthropic's convention: their sum is the prompt). `stop_reason` is `max_tokens` at the output
//! limit and `model_context_window_exceeded` when the context filled up.

use std::sync::Arc;

use bytes::Bytes;
use hyper::{HeaderMap, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::errors::{ApiError, Flavor};
use crate::api::{content, max_tokens, models, parse_json, sampling, stop_strings};
use crate::generate::{new_id, Finish, GenEvent, GenOptions, Generation, Usage};
use crate::model::{ChatTurn, Conversation, ToolSpec, TurnRole, TurnToolCall};
use crate::response::{json_response, sse_response, Body};
use crate::sse;
use crate::state::AppState;

const BILLING_PREFIX: &str = "x-anthropic-billing-header:";

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    messages: Vec<AMessage>,
    system: Option<AContent>,
    max_tokens: Option<u64>,
    tools: Option<Vec<ATool>>,
    tool_choice: Option<Value>,
    thinking: Option<AThinking>,
    stream: Option<bool>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    stop_sequences: Option<Vec<String>>,
    output_config: Option<Value>,
    /// The older structured-outputs beta field (`output_config.format` replaced it).
    output_format: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct AMessage {
    role: String,
    content: AContent,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum AContent {
    Text(String),
    Blocks(Vec<ABlock>),
}

#[derive(Debug, Deserialize)]
struct ABlock {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    thinking: Option<String>,
    id: Option<String>,
    name: Option<String>,
    input: Option<Value>,
    tool_use_id: Option<String>,
    content: Option<AContent>,
    is_error: Option<bool>,
    /// `tool_reference`: the tool it names.
    tool_name: Option<String>,
    /// `document`, `search_result`.
    title: Option<String>,
    /// `document` (`{type: text|content|base64|url|file, …}`), `search_result` (a string).
    source: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ATool {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: String,
    description: Option<String>,
    input_schema: Option<Value>,
    defer_loading: Option<bool>,
    strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct AThinking {
    #[serde(rename = "type")]
    kind: String,
    display: Option<String>,
}

/// The tools of a request: the ones offered in the tool list, and the deferred ones (`defer_loading: true`), which
/// the model only sees where a `tool_reference` loads them (see [`crate::api::content`]).
#[derive(Default)]
struct Tools {
    offered: Vec<ToolSpec>,
    deferred: Vec<ToolSpec>,
}

impl Tools {
    fn from_request(tools: Vec<ATool>, hide: bool) -> Self {
        let mut out = Tools::default();
        for t in tools {
            if hide || t.kind.as_deref().is_some_and(|k| k != "custom") {
                continue;
            }
            let spec = ToolSpec {
                name: t.name,
                description: t.description.unwrap_or_default(),
                parameters: t.input_schema.unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            };
            if t.defer_loading == Some(true) {
                out.deferred.push(spec);
            } else {
                out.offered.push(spec);
            }
        }
        out
    }

    fn reference(&self, name: &str) -> String {
        match self.deferred.iter().find(|t| t.name == name) {
            Some(t) => content::tool_loaded(t),
            None => content::tool_reference(name),
        }
    }
}

/// What the model is shown for one content block: text as is, what it cannot see as a short note.
fn block_text(b: ABlock, tools: &Tools) -> String {
    match b.kind.as_str() {
        "text" => b.text.unwrap_or_default(),
        "tool_reference" => tools.reference(b.tool_name.as_deref().unwrap_or("")),
        "document" => {
            let source = b.source.unwrap_or(Value::Null);
            let body = match source.get("type").and_then(Value::as_str) {
                Some("text") => source.get("data").and_then(Value::as_str).map(str::to_string),
                Some("content") => match source.get("content") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Array(parts)) => Some(
                        parts
                            .iter()
                            .filter_map(|p| serde_json::from_value::<ABlock>(p.clone()).ok())
                            .map(|p| block_text(p, tools))
                            .collect::<Vec<_>>()
                            .join("\n"),
                    ),
                    _ => None,
                },
                _ => None,
            };
            match body {
                Some(body) => match b.title.filter(|t| !t.is_empty()) {
                    Some(title) => format!("[document: {title}]\n{body}"),
                    None => body,
                },
                None => content::omitted("document", b.title.as_deref()),
            }
        }
        "search_result" => {
            let src = b.source.as_ref().and_then(Value::as_str).unwrap_or("");
            let head = format!("[search result: {} {src}]", b.title.as_deref().unwrap_or("")).replace(" ]", "]");
            let body = b.content.map(|c| plain_text(c, tools)).unwrap_or_default();
            if body.is_empty() {
                head
            } else {
                format!("{head}\n{body}")
            }
        }
        "tool_result" => b.content.map(|c| plain_text(c, tools)).unwrap_or_default(),
        other => content::omitted(other, b.name.as_deref().or(b.title.as_deref())),
    }
}

/// Text of a content value: text blocks as they are, other blocks as notes, joined with newlines.
fn plain_text(c: AContent, tools: &Tools) -> String {
    match c {
        AContent::Text(s) => s,
        AContent::Blocks(blocks) => blocks.into_iter().map(|b| block_text(b, tools)).collect::<Vec<_>>().join("\n"),
    }
}

/// The system prompt without Claude Code's per-conversation billing line.
fn system_text(system: Option<AContent>) -> String {
    let blocks = match system {
        None => return String::new(),
        Some(AContent::Text(s)) => vec![s],
        Some(AContent::Blocks(b)) => b.into_iter().map(|blk| block_text(blk, &Tools::default())).collect(),
    };
    let kept: Vec<String> = blocks
        .into_iter()
        .filter_map(|b| {
            if b.starts_with(BILLING_PREFIX) {
                // Drop the billing line, keep anything after it.
                b.split_once('\n').map(|(_, rest)| rest.to_string()).filter(|r| !r.is_empty())
            } else {
                Some(b)
            }
        })
        .collect();
    kept.join("\n")
}

/// Convert the request into a conversation; returns it and whether thinking should be shown.
fn conversation(req: &mut MessagesRequest) -> Result<(Conversation, bool), ApiError> {
    let mut conv = Conversation::default();
    let system = system_text(req.system.take());
    if !system.is_empty() {
        conv.messages.push(ChatTurn::new(TurnRole::System, system));
    }
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages: at least one message is required"));
    }
    let hide_tools = req.tool_choice.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str) == Some("none");
    let tools = Tools::from_request(req.tools.take().unwrap_or_default(), hide_tools);
    for (i, m) in std::mem::take(&mut req.messages).into_iter().enumerate() {
        match m.role.as_str() {
            // Kept as a system message; the renderer folds one that follows a user turn into that turn.
            "system" => conv.messages.push(ChatTurn::new(TurnRole::System, plain_text(m.content, &tools))),
            "user" => match m.content {
                AContent::Text(t) => conv.messages.push(ChatTurn::new(TurnRole::User, t)),
                AContent::Blocks(blocks) => {
                    let mut text: Vec<String> = Vec::new();
                    for b in blocks {
                        match b.kind.as_str() {
                            "tool_result" => {
                                let tool_use_id = b.tool_use_id.clone();
                                let is_error = b.is_error == Some(true);
                                let mut content = block_text(b, &tools);
                                if is_error && !content.starts_with("Error") {
                                    content = format!("Error: {content}");
                                }
                                let mut msg = ChatTurn::new(TurnRole::Tool, content);
                                msg.tool_call_id = tool_use_id;
                                conv.messages.push(msg);
                            }
                            // Reasoning blocks belong to assistant turns; a client that echoes them here is ignored.
                            "thinking" | "redacted_thinking" => {}
                            _ => text.push(block_text(b, &tools)),
                        }
                    }
                    if !text.is_empty() {
                        conv.messages.push(ChatTurn::new(TurnRole::User, text.join("\n")));
                    }
                }
            },
            "assistant" => {
                let mut msg = ChatTurn::new(TurnRole::Assistant, "");
                match m.content {
                    AContent::Text(t) => msg.content = t,
                    AContent::Blocks(blocks) => {
                        for b in blocks {
                            match b.kind.as_str() {
                                "text" => msg.content.push_str(b.text.as_deref().unwrap_or("")),
                                "thinking" => msg.reasoning.push_str(b.thinking.as_deref().unwrap_or("")),
                                "tool_use" | "server_tool_use" => msg.tool_calls.push(TurnToolCall {
                                    id: b.id.unwrap_or_else(|| new_id("toolu_")),
                                    name: b.name.unwrap_or_default(),
                                    arguments: b.input.unwrap_or_else(|| json!({})).to_string(),
                                }),
                                _ => {}
                            }
                        }
                    }
                }
                conv.messages.push(msg);
            }
            other => return Err(ApiError::invalid(format!("messages.{i}.role: unknown role `{other}`"))),
        }
    }
    conv.tools = tools.offered;
    let (thinking, show) = match &req.thinking {
        Some(t) if t.kind == "enabled" || t.kind == "adaptive" => (true, t.display.as_deref() != Some("omitted")),
        _ => (false, false),
    };
    conv.thinking = thinking;
    Ok((conv, show))
}

fn usage_json(u: &Usage) -> Value {
    let cached = u.cached_tokens.min(u.prompt_tokens);
    json!({
        "input_tokens": u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    })
}

fn stop_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        // Anthropic's own signal: Claude Code compacts instead of retrying with a larger max_tokens.
        Finish::ContextFull => "model_context_window_exceeded",
        Finish::ToolCalls => "tool_use",
        Finish::StopSequence => "stop_sequence",
    }
}

fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

/// What `prepare` hands on: the request, its conversation, whether thinking is shown, the options, and the
/// structured-output format with the strict tools' names.
type Prepared = (MessagesRequest, Conversation, bool, GenOptions, Option<crate::structured::Format>, Vec<String>);

/// Render, tokenize and start; shared by `handle`.
fn prepare(state: &Arc<AppState>, body: &[u8]) -> Result<Prepared, ApiError> {
    let mut req: MessagesRequest = parse_json(body)?;
    models::check(state, req.model.as_deref())?;
    let opts = GenOptions {
        sampling: sampling(req.temperature, req.top_p, req.top_k, None)?,
        max_tokens: max_tokens("max_tokens", req.max_tokens)?,
        stop: stop_strings("stop_sequences", req.stop_sequences.take())?,
        thinking: false,
        tool_id_prefix: "toolu_",
        raw: false,
        constraint: None,
    };
    if req.temperature.is_some_and(|t| t > 1.0) {
        return Err(ApiError::invalid("temperature: must be between 0 and 1"));
    }
    let format = crate::structured::anthropic_output_format(req.output_config.as_ref(), req.output_format.as_ref())?;
    let strict: Vec<String> =
        req.tools.iter().flatten().filter(|t| t.strict == Some(true)).map(|t| t.name.clone()).collect();
    let (mut conv, show) = conversation(&mut req)?;
    state.tools.restore(&mut conv);
    Ok((req, conv, show, opts, format, strict))
}

/// The conversation a request body describes (no model check, no tool-call memory): what tests render.
pub fn to_conversation(body: &[u8]) -> Result<Conversation, ApiError> {
    let mut req: MessagesRequest = parse_json(body)?;
    Ok(conversation(&mut req)?.0)
}

/// `POST /v1/messages/count_tokens`.
pub async fn count_tokens(state: Arc<AppState>, _h: HeaderMap, body: Bytes) -> Result<Response<Body>, ApiError> {
    let (_, conv, _, _, _, _) = prepare(&state, &body)?;
    let n = crate::api::prompt_tokens(&state, &conv, "messages").await?.len();
    Ok(json_response(200, &json!({"input_tokens": n})))
}

/// `tool_choice` as a forced call: `{"type": "any"}`, or `{"type": "tool", "name": …}`.
fn forced(choice: Option<&Value>) -> Option<crate::structured::Force> {
    use crate::structured::Force;
    let c = choice?;
    match c.get("type").and_then(Value::as_str)? {
        "any" => Some(Force::Any),
        "tool" => c.get("name").and_then(Value::as_str).map(|n| Force::Tool(n.to_string())),
        _ => None,
    }
}

/// `POST /v1/messages`.
pub async fn handle(state: Arc<AppState>, _headers: HeaderMap, body: Bytes) -> Result<Response<Body>, ApiError> {
    let (req, conv, show_thinking, opts, format, strict) = prepare(&state, &body)?;
    if req.max_tokens.is_none() {
        // As the Anthropic API: max_tokens is required on /v1/messages (not on count_tokens).
        return Err(ApiError::param("max_tokens", "max_tokens: Field required"));
    }
    let model = req.model.clone().unwrap_or_else(|| state.info.id.clone());
    let tokens = crate::api::prompt_tokens(&state, &conv, "messages").await?;
    let stop_seqs = opts.stop.clone();
    let format_param = if req.output_config.as_ref().and_then(|c| c.get("format")).is_some() {
        "output_config.format"
    } else {
        "output_format"
    };
    let choice = req.tool_choice.as_ref();
    let rules = crate::structured::ToolRules {
        strict,
        force: crate::structured::check_force(forced(choice), &conv.tools, "tool_choice")?,
        single: choice.and_then(|c| c.get("disable_parallel_tool_use")).and_then(Value::as_bool) == Some(true),
        ..Default::default()
    };
    let constraint =
        crate::structured::plan_with(&state, format, format_param, &conv.tools, &rules, conv.thinking).await?;
    let gen = Generation::start(&state, tokens, GenOptions { thinking: conv.thinking, constraint, ..opts })?;
    let id = new_id("msg_");
    if !req.stream.unwrap_or(false) {
        let out = gen.collect().await?;
        let mut content = Vec::new();
        if show_thinking && !out.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": out.reasoning, "signature": ""}));
        }
        if !out.content.is_empty() {
            content.push(json!({"type": "text", "text": out.content}));
        }
        for c in &out.tool_calls {
            content.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(&c.arguments)}));
        }
        let stop_sequence = (out.finish == Finish::StopSequence).then(|| stop_seqs.first().cloned()).flatten();
        return Ok(json_response(
            200,
            &json!({
                "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop_reason(out.finish), "stop_sequence": stop_sequence,
                "usage": usage_json(&out.usage),
            }),
        ));
    }
    let (tx, response) = sse_response();
    tokio::spawn(async move {
        let mut gen = gen;
        gen.watch(&tx);
        if !show_thinking {
            gen.hide_reasoning();
        }
        let mut started = false;
        // (index, kind) of the open content block.
        let mut open: Option<(usize, &'static str)> = None;
        let mut next_index = 0usize;
        loop {
            let ev = match gen.next().await {
                None => break,
                Some(Ok(ev)) => ev,
                Some(Err(e)) => {
                    let _ = tx.send(sse::event("error", &e.body(Flavor::Anthropic))).await;
                    return;
                }
            };
            let mut frames = Vec::new();
            // `message_start` carries the cached-token count, known once the prompt is in (the first token, visible
            // or hidden): from then on keep-alives are real `ping` events, before it SSE comments.
            let prompt_done = gen.usage().completion_tokens > 0;
            if !started && (ev != GenEvent::KeepAlive || prompt_done) {
                started = true;
                frames.push(message_start(&id, &model, &gen.usage()));
            }
            let kind = match &ev {
                GenEvent::KeepAlive => {
                    frames.push(if started {
                        sse::event("ping", &json!({"type": "ping"}))
                    } else {
                        sse::comment("keep-alive")
                    });
                    None
                }
                GenEvent::Reasoning(_) if !show_thinking => None,
                GenEvent::Reasoning(_) => Some("thinking"),
                GenEvent::Content(_) => Some("text"),
                GenEvent::ToolCall(_) => Some("tool_use"),
            };
            if let Some(kind) = kind {
                if open.map(|(_, k)| k) != Some(kind) || kind == "tool_use" {
                    if let Some((i, _)) = open.take() {
                        frames.push(block_stop(i));
                    }
                    let block = match &ev {
                        GenEvent::ToolCall(c) => json!({"type": "tool_use", "id": c.id, "name": c.name, "input": {}}),
                        GenEvent::Reasoning(_) => json!({"type": "thinking", "thinking": "", "signature": ""}),
                        _ => json!({"type": "text", "text": ""}),
                    };
                    frames.push(sse::event(
                        "content_block_start",
                        &json!({"type": "content_block_start", "index": next_index, "content_block": block}),
                    ));
                    open = Some((next_index, kind));
                    next_index += 1;
                }
                let index = open.map(|(i, _)| i).unwrap_or(0);
                let delta = match ev {
                    GenEvent::Reasoning(r) => json!({"type": "thinking_delta", "thinking": r}),
                    GenEvent::Content(c) => json!({"type": "text_delta", "text": c}),
                    GenEvent::ToolCall(c) => json!({"type": "input_json_delta", "partial_json": c.arguments}),
                    GenEvent::KeepAlive => unreachable!("keep-alive has no block"),
                };
                frames.push(sse::event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                ));
            }
            for f in frames {
                if !tx.send(f).await {
                    return;
                }
            }
        }
        let usage = gen.usage();
        let mut frames = Vec::new();
        if !started {
            frames.push(message_start(&id, &model, &usage));
        }
        if let Some((i, _)) = open.take() {
            frames.push(block_stop(i));
        }
        let finish = gen.finish();
        let stop_sequence = (finish == Finish::StopSequence).then(|| stop_seqs.first().cloned()).flatten();
        frames.push(sse::event(
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason(finish), "stop_sequence": stop_sequence},
                "usage": usage_json(&usage)}),
        ));
        frames.push(sse::event("message_stop", &json!({"type": "message_stop"})));
        for f in frames {
            if !tx.send(f).await {
                return;
            }
        }
    });
    Ok(response)
}

fn message_start(id: &str, model: &str, usage: &Usage) -> Bytes {
    let mut u = usage_json(usage);
    u["output_tokens"] = json!(0);
    sse::event(
        "message_start",
        &json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": u}}),
    )
}

fn block_stop(index: usize) -> Bytes {
    sse::event("content_block_stop", &json!({"type": "content_block_stop", "index": index}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn billing_line_is_removed() {
        let sys: AContent = serde_json::from_value(json!([
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.93d; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ]))
        .unwrap();
        assert_eq!(system_text(Some(sys)), "You are an agent.");
        let sys = AContent::Text("x-anthropic-billing-header: cc_version=1.abc;\nBe brief.".into());
        assert_eq!(system_text(Some(sys)), "Be brief.");
    }
}
