//! What real coding agents need beyond the fixtures, on the scripted fake model: a full context is reported with
//! each API's own signal, no output limit means the whole context left (capped by `--max-output-tokens`), non-text
//! content is accepted as notes, deferred tools stay hidden until loaded, reasoning tokens are counted and
//! `response.created` echoes the tools.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{Options, TestServer};
use ds4_server::fake::{FakeCodec, VOCAB};
use ds4_server::model::{BackendError, ModelInfo, Runner, RunnerSessionId};
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::{build_state, Limits};
use serde_json::{json, Value};

fn chat(server: &TestServer, body: Value) -> Value {
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

fn messages(server: &TestServer, body: Value) -> Value {
    let r = server.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

#[test]
fn a_full_context_is_reported_with_each_apis_signal() {
    // The scripted long answer (900 tokens) cannot fit in a 200-token context.
    let server = TestServer::with(Options { context: 200, ..Options::default() });
    let long = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "a long answer"}]});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let r = messages(&server, long(json!({"max_tokens": 32000})));
    assert_eq!(r["stop_reason"], "model_context_window_exceeded");
    let u = &r["usage"];
    let total = u["input_tokens"].as_u64().unwrap()
        + u["cache_read_input_tokens"].as_u64().unwrap()
        + u["output_tokens"].as_u64().unwrap();
    assert_eq!(total, 200);
    assert_eq!(messages(&server, long(json!({"max_tokens": 5})))["stop_reason"], "max_tokens");
    let r = server.post("/v1/messages", &long(json!({"max_tokens": 32000, "stream": true})));
    let delta = r.event_json().into_iter().find(|(n, _)| n.as_deref() == Some("message_delta")).unwrap().1;
    assert_eq!(delta["delta"]["stop_reason"], "model_context_window_exceeded");

    assert_eq!(chat(&server, long(json!({})))["choices"][0]["finish_reason"], "length");

    let r = server.post("/v1/responses", &json!({"input": "a long answer"}));
    let r = r.json();
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["error"]["code"], "context_length_exceeded", "{r}");
    let r = server.post("/v1/responses", &json!({"input": "a long answer", "stream": true}));
    let last = r.event_json().pop().unwrap().1;
    assert_eq!(last["type"], "response.failed");
    assert_eq!(last["response"]["error"]["code"], "context_length_exceeded");
    let r = server.post("/v1/responses", &json!({"input": "a long answer", "max_output_tokens": 5})).json();
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
}

/// A model that never stops: every step predicts `a`.
struct Endless {
    sessions: HashMap<RunnerSessionId, bool>,
    next: RunnerSessionId,
    logits: Vec<f32>,
}

impl Endless {
    fn new() -> Self {
        let mut logits = vec![0.0; VOCAB];
        logits[b'a' as usize] = 30.0;
        Endless { sessions: HashMap::new(), next: 0, logits }
    }
}

impl Runner for Endless {
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn create_session(&mut self) -> Result<RunnerSessionId, BackendError> {
        self.next += 1;
        self.sessions.insert(self.next, false);
        Ok(self.next)
    }
    fn free_session(&mut self, session: RunnerSessionId) {
        self.sessions.remove(&session);
    }
    fn truncate(&mut self, _session: RunnerSessionId, _len: usize) -> bool {
        false
    }
    fn feed(&mut self, session: RunnerSessionId, _tokens: &[u32]) -> Result<(), BackendError> {
        self.sessions.insert(session, false);
        Ok(())
    }
    fn step(&mut self) -> Result<(), BackendError> {
        self.sessions.values_mut().for_each(|ready| *ready = true);
        Ok(())
    }
    fn logits(&self, session: RunnerSessionId) -> Option<&[f32]> {
        self.sessions.get(&session).filter(|r| **r).map(|_| &self.logits[..])
    }
}

fn endless_server(context: usize, limits: Limits) -> TestServer {
    let info = ModelInfo { id: "deepseek-v4-flash".into(), context_size: context, vocab_size: VOCAB, demo: true };
    let config = SchedulerConfig { max_parked: 0, ..SchedulerConfig::default() };
    TestServer::on(build_state(Box::new(Endless::new()), Arc::new(FakeCodec), info, config, limits))
}

#[test]
fn no_output_limit_means_the_context_left_and_the_flag_caps_it() {
    // Codex sends no max_output_tokens: the answer may use the whole context (the old default stopped at 4096).
    let server = endless_server(6000, Limits::default());
    let r = chat(&server, json!({"messages": [{"role": "user", "content": "go"}]}));
    let (p, c) = (r["usage"]["prompt_tokens"].as_u64().unwrap(), r["usage"]["completion_tokens"].as_u64().unwrap());
    assert_eq!(p + c, 6000, "{}", r["usage"]);
    let r = server.post("/v1/responses", &json!({"input": "go"})).json();
    assert_eq!(r["error"]["code"], "context_length_exceeded", "{r}");
    assert_eq!(r["usage"]["total_tokens"], 6000, "{r}");
    drop(server);

    // --max-output-tokens 100: requests without a limit and with a larger one get 100, smaller ones what they ask.
    let server = endless_server(6000, Limits { max_output_tokens: Some(100), ..Limits::default() });
    let used = |body: Value| chat(&server, body)["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(used(json!({"messages": [{"role": "user", "content": "go"}]})), 100);
    assert_eq!(used(json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 500})), 100);
    assert_eq!(used(json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 7})), 7);
    let r = messages(&server, json!({"max_tokens": 32000, "messages": [{"role": "user", "content": "go"}]}));
    assert_eq!(r["stop_reason"], "max_tokens");
}

#[test]
fn reasoning_tokens_are_counted() {
    let server = TestServer::start();
    // The scripted reasoning is `Let me think.</think>` (21 byte tokens).
    let r = server.post("/v1/responses", &json!({"input": "hi", "reasoning": {"summary": "auto"}})).json();
    assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 21);
    assert!(r["usage"]["output_tokens"].as_u64().unwrap() > 21);
    // All of the output was reasoning.
    let r = server
        .post("/v1/responses", &json!({"input": "hi", "reasoning": {"effort": "high"}, "max_output_tokens": 5}))
        .json();
    assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 5);
    assert_eq!(r["usage"]["output_tokens"], 5);
    let r = chat(&server, json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}));
    assert_eq!(r["usage"]["completion_tokens_details"]["reasoning_tokens"], 21);
    let r = chat(&server, json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(r["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
}

#[test]
fn response_created_echoes_the_request_tools() {
    let server = TestServer::start();
    let tools = json!([
        {"type": "function", "name": "exec_command", "description": "Run", "strict": false,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
        {"type": "web_search", "external_web_access": false}]);
    let r = server.post("/v1/responses", &json!({"input": "hi", "stream": true, "tools": tools}));
    let events = r.event_json();
    let created = events.iter().find(|(n, _)| n.as_deref() == Some("response.created")).unwrap();
    assert_eq!(created.1["response"]["tools"], tools);
    assert_eq!(events.last().unwrap().1["response"]["tools"], tools);
}

fn tool_round(result_content: Value, tools: Value) -> Value {
    json!({"max_tokens": 200, "tools": tools, "messages": [
        {"role": "user", "content": "search for a tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
            "input": {"query": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content}]}]})
}

fn reply_text(r: &Value) -> String {
    r["content"].as_array().unwrap().iter().filter_map(|b| b["text"].as_str()).collect()
}

#[test]
fn non_text_blocks_are_accepted_as_notes() {
    let server = TestServer::start();
    let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}});
    // Claude Code's Read of an image: the model is told an image was there.
    let r = messages(&server, tool_round(json!([image, {"type": "text", "text": "README.md"}]), json!([])));
    assert_eq!(reply_text(&r), "Done: [image omitted]READ");
    // Every block type inside a tool result, and in a user message.
    let all = json!([
        {"type": "text", "text": "t"}, image,
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc text"}, "title": "D"},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}},
        {"type": "search_result", "source": "https://x", "title": "S", "content": [{"type": "text", "text": "s"}]},
        {"type": "tool_reference", "tool_name": "Read"}]);
    let r = messages(&server, tool_round(all.clone(), json!([])));
    assert!(reply_text(&r).starts_with("Done: t[image omitted]"), "{r}");
    let mut body = tool_round(json!("ok"), json!([]));
    body["messages"][2]["content"] = all;
    messages(&server, body);
    let r = server.post(
        "/v1/messages/count_tokens",
        &json!({"messages": [{"role": "user", "content": [image, {"type": "container_upload", "file_id": "f"}]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // OpenAI chat parts and Responses parts.
    let r = chat(
        &server,
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "file", "file": {"filename": "a.pdf", "file_data": "JVBE"}}]}]}),
    );
    assert_eq!(r["choices"][0]["message"]["content"], "Hello! You said: look[image omitted][file omitted: a.pdf].");
    let r = chat(
        &server,
        json!({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]}),
    );
    assert_eq!(r["choices"][0]["message"]["content"], "Hello! You said: [audio omitted].");
    let r = server.post(
        "/v1/responses",
        &json!({"input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "see"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"},
                {"type": "input_file", "filename": "b.txt", "file_data": "eA=="}]},
            {"type": "function_call", "name": "view_image", "arguments": "{}", "call_id": "c1"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let msg = r.json()["output"].as_array().unwrap().iter().find(|o| o["type"] == "message").unwrap().clone();
    assert_eq!(msg["content"][0]["text"], "Done: [image omitted]");
}

#[test]
fn deferred_tools_stay_hidden_until_a_tool_reference_loads_them() {
    let server = TestServer::start();
    let tools = json!([
        {"name": "ToolSearch", "description": "find tools", "input_schema": {"type": "object"}},
        {"name": "Cron", "description": "schedule a job", "defer_loading": true,
            "input_schema": {"type": "object", "properties": {"when": {"type": "string"}}}}]);
    let count = |body: &Value| {
        let r = server.post("/v1/messages/count_tokens", body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["input_tokens"].as_u64().unwrap()
    };
    let plain = json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools});
    let mut without = plain.clone();
    without["tools"] = json!([tools[0]]);
    assert_eq!(count(&plain), count(&without), "the deferred tool is in the prompt");
    // Loaded by ToolSearch: its definition shows where the reference is.
    let r = messages(&server, tool_round(json!([{"type": "tool_reference", "tool_name": "Cron"}]), tools.clone()));
    assert_eq!(reply_text(&r), "Done: [tool loaded: Cron] ");
    let loaded = count(&tool_round(json!([{"type": "tool_reference", "tool_name": "Cron"}]), tools.clone()));
    let not_loaded = count(&tool_round(json!([{"type": "tool_reference", "tool_name": "Other"}]), tools));
    assert!(loaded > not_loaded + 20, "{loaded} vs {not_loaded}");
    // Responses: a deferred function tool is offered once a tool_search_output lists it.
    let deferred = json!([{"type": "function", "name": "cron", "description": "schedule", "defer_loading": true,
        "parameters": {"type": "object"}}]);
    let r = server.post("/v1/responses", &json!({"input": "please use the tool", "tools": deferred})).json();
    assert!(r["output"].as_array().unwrap().iter().all(|o| o["type"] != "function_call"), "{r}");
    let r = server
        .post(
            "/v1/responses",
            &json!({"tools": deferred, "input": [
            {"type": "tool_search_output", "call_id": "ts", "tools": [{"type": "function", "name": "cron"}]},
            {"type": "message", "role": "user", "content": "please use the tool"}]}),
        )
        .json();
    assert!(r["output"].as_array().unwrap().iter().any(|o| o["type"] == "function_call" && o["name"] == "cron"), "{r}");
}
