//! Hidden reasoning is not silence, and a client that goes away is noticed without a visible write: keep-alives
//! while the model thinks out of sight, and cancellation of a dropped client's generation in every API and mode.
//! Also the scripted fake model driving a tool round trip through the HTTP APIs.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{Options, TestServer};
use ds4_server::fake_script::Script;
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::Limits;
use serde_json::{json, Value};

fn script(text: &str) -> Script {
    Script::parse(text).unwrap()
}

/// Long hidden reasoning, then a short answer.
fn thinker(reasoning_len: usize) -> Script {
    let reasoning = "r".repeat(reasoning_len);
    script(&json!([{"reply": {"reasoning": reasoning, "text": "visible answer"}}]).to_string())
}

#[test]
fn hidden_reasoning_sends_pings_while_tokens_flow() {
    let server = TestServer::with(Options {
        // 2 ms per token: tokens arrive far more often than the keep-alive interval, so only the
        // "nothing visible was written" clock can produce pings.
        delay: Duration::from_millis(2),
        limits: Limits { keepalive: Duration::from_millis(40), ..Limits::default() },
        script: thinker(400),
        ..Options::default()
    });
    let r = server.post(
        "/v1/messages",
        &json!({"max_tokens": 2000, "stream": true, "thinking": {"type": "adaptive", "display": "omitted"},
            "messages": [{"role": "user", "content": "think hard"}]}),
    );
    let events = r.event_json();
    // Before `message_start` a keep-alive is an SSE comment, after it a `ping` event; `message_start` goes out with
    // the first (hidden) token, so hidden reasoning is covered by real `ping` events, as the Anthropic API sends.
    let ping_events = events.iter().filter(|(n, _)| n.as_deref() == Some("ping")).count();
    let pings = ping_events + r.body.matches(": keep-alive\n\n").count();
    assert!(pings >= 3, "{pings} pings during ~0.8 s of hidden reasoning:\n{}", r.body);
    assert!(ping_events >= 2, "{ping_events} ping events (the rest were comments before message_start):\n{}", r.body);
    let start = r.body.find("event: message_start").expect("message_start");
    let first_ping = r.body.find("event: ping").expect("ping");
    assert!(start < first_ping, "ping before message_start:\n{}", r.body);
    assert!(!r.body.contains("thinking_delta"), "hidden reasoning was sent: {}", r.body);
    let text: String = events.iter().filter_map(|(_, v)| v["delta"]["text"].as_str().map(String::from)).collect();
    assert_eq!(text, "visible answer");
    assert!(server.metric("ds4_keepalives_total") >= pings as f64);

    // Shown reasoning is sent as it comes (and the same script is followed).
    let r = server.post(
        "/v1/messages",
        &json!({"max_tokens": 2000, "stream": true, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "think hard"}]}),
    );
    let shown: String =
        r.event_json().iter().filter_map(|(_, v)| v["delta"]["thinking"].as_str().map(String::from)).collect();
    assert_eq!(shown, "r".repeat(400));
}

/// Send a request on a raw socket and return the open connection.
fn open(server: &TestServer, path: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(server.addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_dropped_client_is_cancelled_in_every_api_and_mode_without_a_visible_write() {
    let server = TestServer::with(Options {
        delay: Duration::from_millis(2),
        // Keep-alives far apart: cancellation must not wait for one.
        limits: Limits { keepalive: Duration::from_secs(600), ..Limits::default() },
        config: SchedulerConfig { max_active: 1, ..SchedulerConfig::default() },
        // ~20 s of reasoning: nothing visible is written before the client goes away.
        script: thinker(10_000),
        ..Options::default()
    });
    let msgs = json!([{"role": "user", "content": "think"}]);
    let cases: Vec<(&str, Value)> = vec![
        (
            "/v1/messages",
            json!({"max_tokens": 60000, "thinking": {"type": "adaptive", "display": "omitted"}, "messages": msgs}),
        ),
        ("/v1/chat/completions", json!({"max_tokens": 60000, "reasoning_effort": "high", "messages": msgs})),
        ("/v1/responses", json!({"max_output_tokens": 60000, "reasoning": {"effort": "high"}, "input": "think"})),
        ("/v1/completions", json!({"max_tokens": 60000, "prompt": "<|user|>a long answer\n<|assistant|><think>"})),
    ];
    let mut cancelled = server.metric("ds4_generations_cancelled_total");
    for (path, body) in cases {
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let what = format!("{path} stream={stream}");
            let before = server.metric("ds4_completion_tokens_total");
            let mut s = open(&server, path, &body);
            wait_for(&format!("{what} to generate"), Duration::from_secs(30), || {
                server.metric("ds4_completion_tokens_total") >= before + 5.0
            });
            if stream {
                // Only headers / keep-alive-free frames so far; read what is there without waiting.
                s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
            }
            drop(s);
            let t = Instant::now();
            wait_for(&format!("{what} to be cancelled"), Duration::from_secs(10), || {
                server.metric("ds4_active_sessions") == 0.0
                    && server.metric("ds4_generations_cancelled_total") > cancelled
            });
            let took = t.elapsed();
            cancelled = server.metric("ds4_generations_cancelled_total");
            let generated = server.metric("ds4_completion_tokens_total") - before;
            assert!(generated < 5000.0, "{what}: the dropped request kept generating ({generated} tokens, {took:?})");
        }
    }
}

#[test]
fn a_scripted_tool_round_trip_over_every_chat_api() {
    let server = TestServer::with(Options {
        script: script(
            r#"
{"when": {"last": "tool"}, "reply": {"text": "the tool said {last}"}}
{"when": {"contains": "make a file", "tool": "shell"}, "reply": {"reasoning": "plan", "text": "On it.", "tool_calls": [{"name": "shell", "arguments": {"cmd": "touch made.txt", "n": 2}}]}}
"#,
        ),
        ..Options::default()
    });
    let schema = json!({"type": "object", "properties": {"cmd": {"type": "string"}}});
    // OpenAI chat.
    let tools = json!([{"type": "function", "function": {"name": "shell", "parameters": schema}}]);
    let mut messages = vec![json!({"role": "user", "content": "please make a file"})];
    let r = server.post("/v1/chat/completions", &json!({"messages": messages, "tools": tools}));
    let m = &r.json()["choices"][0]["message"];
    assert_eq!(m["content"], "On it.");
    let call = &m["tool_calls"][0];
    assert_eq!(call["function"]["name"], "shell");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"cmd": "touch made.txt", "n": 2}));
    assert_eq!(r.json()["choices"][0]["finish_reason"], "tool_calls");
    messages.push(m.clone());
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "MARK-1"}));
    let r = server.post("/v1/chat/completions", &json!({"messages": messages, "tools": tools}));
    assert_eq!(r.json()["choices"][0]["message"]["content"], "the tool said MARK-1");
    // The follow-up reused the first request's prompt.
    assert!(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 20);

    // Anthropic.
    let tools = json!([{"name": "shell", "input_schema": schema}]);
    let user = json!({"role": "user", "content": "make a file now"});
    let r = server.post("/v1/messages", &json!({"max_tokens": 100, "messages": [user], "tools": tools}));
    let content = r.json()["content"].clone();
    let tool_use = content.as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap().clone();
    assert_eq!(tool_use["input"], json!({"cmd": "touch made.txt", "n": 2}));
    let result = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"],
        "content": "MARK-2"}]});
    let r = server.post(
        "/v1/messages",
        &json!({"max_tokens": 100, "messages": [user, {"role": "assistant", "content": content}, result],
            "tools": tools}),
    );
    assert_eq!(r.json()["content"][0]["text"], "the tool said MARK-2");

    // Responses.
    let tools = json!([{"type": "function", "name": "shell", "parameters": schema}]);
    let r = server.post("/v1/responses", &json!({"input": "make a file please", "tools": tools}));
    let out = r.json()["output"].clone();
    let call = out.as_array().unwrap().iter().find(|o| o["type"] == "function_call").unwrap().clone();
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["cmd"], "touch made.txt");
    let mut input = vec![json!({"role": "user", "content": "make a file please"})];
    input.extend(out.as_array().unwrap().iter().cloned());
    input.push(json!({"type": "function_call_output", "call_id": call["call_id"], "output": "MARK-3"}));
    let r = server.post("/v1/responses", &json!({"input": input, "tools": tools}));
    assert_eq!(
        r.json()["output_text"].as_str().map(String::from).unwrap_or_else(|| {
            let o = r.json()["output"].clone();
            o.as_array().unwrap().iter().filter_map(|i| i["content"][0]["text"].as_str().map(String::from)).collect()
        }),
        "the tool said MARK-3"
    );
}
