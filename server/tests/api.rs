//! End-to-end API behaviour on the scripted fake model: tool-call round trips with prefix reuse in all three APIs,
//! thinking, stop strings, errors in each API's shape, queue limits, keep-alives, cancellation, graceful shutdown and
//! concurrency.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{Options, TestServer};
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::Limits;
use serde_json::{json, Value};

fn bash_tool_openai() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}])
}

#[test]
fn chat_tool_round_trip_reuses_the_prefix() {
    let server = TestServer::start();
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "please use the tool"}),
    ];
    let req = json!({"model": "deepseek-v4-flash", "messages": messages, "tools": bash_tool_openai(),
        "temperature": 0});
    let r = server.post("/v1/chat/completions", &req).json();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "bash");
    assert_eq!(
        serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap()).unwrap(),
        json!({"command": "ls"})
    );
    let p1 = r["usage"]["prompt_tokens"].as_u64().unwrap();
    let c1 = r["usage"]["completion_tokens"].as_u64().unwrap();
    // Like opencode: echo the call with re-serialised arguments and an empty reasoning_content.
    messages.push(json!({"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [{
        "id": call["id"], "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "README.md\nhello.py\n"}));
    let req = json!({"model": "deepseek-v4-flash", "messages": messages, "tools": bash_tool_openai(),
        "stream": true, "stream_options": {"include_usage": true}});
    let r = server.post("/v1/chat/completions", &req);
    let chunks = r.event_json();
    let content: String = chunks.iter().filter_map(|(_, c)| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, "Done: README.mdhello.py");
    let usage = &chunks.last().unwrap().1["usage"];
    // The whole first turn (prompt + generated call, minus the unfed EOS) came from the parked session: the
    // remembered argument bytes replaced the client's re-serialised ones.
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), p1 + c1 - 1);
    assert!(server.metric("ds4_prefix_cache_hit_tokens_total{tier=\"host\"}") >= (p1 + c1 - 1) as f64);
}

#[test]
fn chat_streams_reasoning_and_tool_call_deltas() {
    let server = TestServer::start();
    let req = json!({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "please use the tool"}],
        "tools": bash_tool_openai(), "reasoning_effort": "high", "stream": true});
    let r = server.post("/v1/chat/completions", &req);
    let chunks: Vec<Value> = r.event_json().into_iter().map(|(_, c)| c).collect();
    let reasoning: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str()).collect();
    assert_eq!(reasoning, "Let me think.");
    let calls: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("tool_calls")).collect();
    assert_eq!(calls.len(), 2, "id+name first, then arguments");
    assert_eq!(calls[0][0]["function"]["name"], "bash");
    assert_eq!(calls[0][0]["function"]["arguments"], "");
    assert_eq!(calls[1][0]["index"], 0);
    assert_eq!(calls[1][0]["function"]["arguments"], "{\"command\":\"ls\"}");
    assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "tool_calls"));
    assert!(r.body.ends_with("data: [DONE]\n\n"));
}

#[test]
fn anthropic_thinking_and_tool_round_trip() {
    let server = TestServer::start();
    let tools = json!([{"name": "Bash", "description": "Run", "input_schema": {"type": "object",
        "properties": {"command": {"type": "string"}}}}]);
    let mut messages = vec![json!({"role": "user", "content": [{"type": "text", "text": "please use the tool"}]})];
    let req = json!({"model": "claude-opus-5-5", "max_tokens": 1000, "system": "Be brief.", "messages": messages,
        "tools": tools, "thinking": {"type": "enabled", "budget_tokens": 1024}, "stream": true});
    let r = server.post("/v1/messages?beta=true", &req);
    assert_eq!(r.status, 200, "{}", r.body);
    let ev: Vec<Value> = r.event_json().into_iter().map(|(_, d)| d).collect();
    let starts: Vec<&Value> = ev.iter().filter(|e| e["type"] == "content_block_start").collect();
    assert_eq!(starts[0]["content_block"]["type"], "thinking");
    assert_eq!(starts[1]["content_block"]["type"], "tool_use");
    let tool = &starts[1]["content_block"];
    assert!(tool["id"].as_str().unwrap().starts_with("toolu_"));
    let thinking: String = ev.iter().filter_map(|e| e["delta"]["thinking"].as_str()).collect();
    assert_eq!(thinking, "Let me think.");
    let json_delta: String = ev.iter().filter_map(|e| e["delta"]["partial_json"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&json_delta).unwrap(), json!({"command": "ls"}));
    let delta = ev.iter().find(|e| e["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    let u = &delta["usage"];
    let p1 = u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap();
    let c1 = u["output_tokens"].as_u64().unwrap();
    // Claude Code echoes tool_use without the thinking block; the server restores both for the re-render.
    messages.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": tool["id"], "name": "Bash",
        "input": {"command": "ls"}}]}));
    messages.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool["id"],
        "content": "README.md", "is_error": false, "cache_control": {"type": "ephemeral"}}]}));
    let req = json!({"model": "claude-opus-5-5", "max_tokens": 1000, "system": "Be brief.", "messages": messages,
        "tools": tools, "thinking": {"type": "enabled", "budget_tokens": 1024}});
    let r = server.post("/v1/messages", &req).json();
    assert_eq!(r["type"], "message");
    assert_eq!(r["stop_reason"], "end_turn");
    assert_eq!(r["content"][0], json!({"type": "thinking", "thinking": "Let me think.", "signature": ""}));
    assert_eq!(r["content"][1], json!({"type": "text", "text": "Done: README.md"}));
    assert_eq!(r["usage"]["cache_read_input_tokens"].as_u64().unwrap(), p1 + c1 - 1);
}

#[test]
fn responses_tool_round_trip() {
    let server = TestServer::start();
    let tools = json!([{"type": "function", "name": "exec_command", "strict": false,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
        {"type": "web_search", "external_web_access": false},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn"}]},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"x\""}}]);
    let mut input = vec![
        json!({"type": "message", "id": "msg_1", "role": "developer",
        "content": [{"type": "input_text", "text": "You are Codex."}]}),
        json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "please use the tool"}]}),
    ];
    let req = json!({"model": "gpt-5.5", "input": input, "tools": tools, "stream": true, "store": false,
        "reasoning": {"effort": "medium"}, "include": ["reasoning.encrypted_content"]});
    let r = server.post("/v1/responses", &req);
    assert_eq!(r.status, 200, "{}", r.body);
    let ev: Vec<Value> = r.event_json().into_iter().map(|(_, d)| d).collect();
    let args_delta: String = ev
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&args_delta).unwrap(), json!({"command": "ls"}));
    let done = &ev.last().unwrap()["response"];
    assert_eq!(ev.last().unwrap()["type"], "response.completed");
    let output = done["output"].as_array().unwrap();
    assert_eq!(output[0]["type"], "reasoning");
    assert_eq!(output[0]["content"][0]["text"], "Let me think.");
    let call = output.iter().find(|o| o["type"] == "function_call").unwrap().clone();
    assert_eq!(call["name"], "exec_command", "only function tools are offered; the first is the one called");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    let p1 = done["usage"]["input_tokens"].as_u64().unwrap();
    let c1 = done["usage"]["output_tokens"].as_u64().unwrap();
    input.push(json!({"type": "function_call", "status": "completed", "id": call["id"], "name": "exec_command",
        "arguments": "{\"command\": \"ls\"}", "call_id": call["call_id"]}));
    input.push(json!({"type": "function_call_output", "id": "fco_1", "call_id": call["call_id"],
        "output": "README.md\n"}));
    let req = json!({"model": "gpt-5.5", "input": input, "tools": tools, "store": false,
        "reasoning": {"effort": "medium"}});
    let r = server.post("/v1/responses", &req).json();
    assert_eq!(r["status"], "completed");
    let msg = r["output"].as_array().unwrap().iter().find(|o| o["type"] == "message").unwrap().clone();
    assert_eq!(msg["content"][0]["text"], "Done: README.md");
    assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap(), p1 + c1 - 1);
}

#[test]
fn length_limits_and_stop_strings() {
    let server = TestServer::start();
    let r = server
        .post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}))
        .json();
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["choices"][0]["message"]["content"], "Hello");
    let r = server
        .post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "stop": ["said"]}))
        .json();
    assert_eq!(r["choices"][0]["message"]["content"], "Hello! You ");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let r = server
        .post(
            "/v1/messages",
            &json!({"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}],
        "stop_sequences": ["You"]}),
        )
        .json();
    assert_eq!(r["stop_reason"], "stop_sequence");
    assert_eq!(r["stop_sequence"], "You");
    let r = server.post("/v1/responses", &json!({"input": "a long answer", "max_output_tokens": 4, "stream": true}));
    let last = r.event_json().pop().unwrap().1;
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(last["response"]["incomplete_details"]["reason"], "max_output_tokens");
    let r = server.post("/v1/completions", &json!({"prompt": "<|user|>hey\n<|assistant|>", "max_tokens": 50})).json();
    assert_eq!(r["choices"][0]["text"], "Hello! You said: hey.");
    assert_eq!(r["object"], "text_completion");
}

#[test]
fn count_tokens_models_health_metrics() {
    let server = TestServer::start();
    let body = json!({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hello"}]});
    let n = server.post("/v1/messages/count_tokens?beta=true", &body).json()["input_tokens"].as_u64().unwrap();
    let longer = json!({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hello hello"}]});
    let m = server.post("/v1/messages/count_tokens", &longer).json()["input_tokens"].as_u64().unwrap();
    assert!(n > 0 && m > n);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "deepseek-v4-flash");
    assert_eq!(server.get("/v1/models/deepseek-v4-flash").status, 200);
    assert_eq!(server.get("/v1/models/llama-3").status, 404);
    assert_eq!(server.get("/health").json()["status"], "ok");
    let text = server.get("/metrics").body;
    assert!(text.contains("ds4_requests_total{endpoint=\"count_tokens\",status=\"200\"} 2"), "{text}");
    assert!(text.contains("# TYPE ds4_time_to_first_token_seconds histogram"));
}

fn assert_openai_error(r: &common::Reply, status: u16, needle: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let e = &r.json()["error"];
    assert!(e["message"].as_str().unwrap().contains(needle), "{e}");
    assert!(e["type"].is_string());
}

fn assert_anthropic_error(r: &common::Reply, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let b = r.json();
    assert_eq!(b["type"], "error");
    assert_eq!(b["error"]["type"], kind, "{b}");
}

#[test]
fn errors_in_each_api_shape() {
    let server = TestServer::with(Options {
        context: 300,
        limits: Limits { max_body_bytes: 4000, ..Limits::default() },
        ..Options::default()
    });
    let raw = |path: &str, body: &str| {
        common::request(server.addr, "POST", path, &[("content-type", "application/json")], body.as_bytes())
    };
    assert_openai_error(&raw("/v1/chat/completions", "{\"messages\": ["), 400, "invalid request body");
    assert_openai_error(&raw("/v1/responses", ""), 400, "empty");
    assert_anthropic_error(&raw("/v1/messages?beta=true", "not json"), 400, "invalid_request_error");
    let chat = |v: Value| server.post("/v1/chat/completions", &v);
    assert_openai_error(&chat(json!({"messages": "hi"})), 400, "invalid");
    assert_openai_error(&chat(json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"})), 400, "");
    assert_openai_error(&chat(json!({"messages": [{"role": "user", "content": "x"}], "temperature": 7})), 400, "temp");
    assert_openai_error(&chat(json!({"messages": [{"role": "user", "content": "x"}], "n": 2})), 400, "n = 1");
    assert_openai_error(&chat(json!({"messages": [{"role": "wizard", "content": "x"}]})), 400, "wizard");
    let r = chat(json!({"model": "llama-3", "messages": [{"role": "user", "content": "x"}]}));
    assert_openai_error(&r, 404, "llama-3");
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let long = "word ".repeat(100);
    let r = chat(json!({"messages": [{"role": "user", "content": long}]}));
    assert_openai_error(&r, 400, "300");
    // Counting stopped once the prompt was over the context.
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("prompt is more than 299"), "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]});
    assert_openai_error(&chat(big.clone()), 413, "limit");
    assert_anthropic_error(&server.post("/v1/messages", &big), 413, "request_too_large");
    let m = |v: Value| server.post("/v1/messages", &v);
    assert_anthropic_error(
        &m(json!({"model": "gemini", "messages": [{"role": "user", "content": "x"}]})),
        404,
        "not_found_error",
    );
    assert_anthropic_error(
        &m(json!({"messages": [{"role": "user", "content": [{"text": "a block without a type"}]}]})),
        400,
        "invalid_request_error",
    );
    assert_anthropic_error(&m(json!({"messages": [{"role": "user", "content": 5}]})), 400, "invalid_request_error");
    let r = server.post("/v1/responses", &json!({"input": "x", "previous_response_id": "resp_1"}));
    assert_openai_error(&r, 400, "previous_response_id");
    assert_openai_error(&server.post("/v1/nothing", &json!({})), 404, "no such endpoint");
    assert_openai_error(&server.get("/v1/chat/completions"), 405, "not allowed");
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn full_queue_answers_503_with_retry_after() {
    let server = TestServer::with(Options {
        config: SchedulerConfig { max_queue: 0, ..SchedulerConfig::default() },
        ..Options::default()
    });
    let r = server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x"}]}));
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = server.post("/v1/messages", &json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}));
    assert_eq!(r.json()["error"]["type"], "overloaded_error");
}

#[test]
fn keep_alive_comments_while_the_model_is_slow() {
    let server = TestServer::with(Options {
        delay: Duration::from_millis(60),
        limits: Limits { keepalive: Duration::from_millis(5), ..Limits::default() },
        ..Options::default()
    });
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "stream": true}),
    );
    assert!(r.body.contains(": keep-alive\n\n"), "{}", r.body);
    let r = server.post(
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": true}),
    );
    // After message_start, Anthropic keep-alives are `ping` events.
    assert!(r.body.contains("event: ping\n"), "{}", r.body);
}

#[test]
fn a_disconnected_client_cancels_its_generation() {
    let server = TestServer::with(Options {
        delay: Duration::from_millis(5),
        config: SchedulerConfig { max_active: 1, ..SchedulerConfig::default() },
        ..Options::default()
    });
    let body = json!({"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 100000,
        "stream": true})
    .to_string();
    let mut s = std::net::TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 4096];
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"a\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(s);
    // With one decode slot, this completes only after the abandoned job has been cancelled.
    let r = server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "next"}]}));
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Hello! You said: next.");
    let generated = server.metric("ds4_completion_tokens_total");
    // The scripted answer is 901 tokens; the abandoned stream stopped long before its end.
    assert!(generated < 300.0, "the abandoned stream kept generating: {generated} tokens");
}

#[test]
fn shutdown_drains_in_flight_streams() {
    let mut server = TestServer::with(Options { delay: Duration::from_millis(3), ..Options::default() });
    let addr = server.addr;
    let client = std::thread::spawn(move || {
        let body = json!({"max_tokens": 60, "stream": true,
            "messages": [{"role": "user", "content": "a long answer"}]});
        common::post_json(addr, "/v1/messages", &body)
    });
    // Bounded wait until the request is generating.
    let mut admitted = false;
    for _ in 0..2000 {
        if server.metric("ds4_active_sessions") >= 1.0 {
            admitted = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(admitted);
    server.stop();
    let r = client.join().unwrap();
    assert!(r.body.contains("event: message_stop"), "in-flight stream was cut: {}", r.body);
    assert!(std::net::TcpStream::connect(addr).is_err(), "listener closed after shutdown");
}

#[test]
fn concurrent_streams_equal_solo_runs() {
    let server = TestServer::with(Options {
        config: SchedulerConfig { max_active: 8, prefill_chunk: 64, ..SchedulerConfig::default() },
        ..Options::default()
    });
    let addr = server.addr;
    let ask = move |i: usize, j: usize| {
        let body = json!({"messages": [{"role": "user", "content": format!("client {i} request {j}")}],
            "temperature": 0, "stream": true});
        let r = common::post_json(addr, "/v1/chat/completions", &body);
        r.event_json()
            .iter()
            .filter_map(|(_, c)| c["choices"][0]["delta"]["content"].as_str().map(String::from))
            .collect::<String>()
    };
    let solo: Vec<String> = (0..3).map(|j| ask(0, j)).collect();
    let handles: Vec<_> =
        (0..16).map(|i| std::thread::spawn(move || (0..3).map(|j| ask(i % 2, j)).collect::<Vec<String>>())).collect();
    for (i, h) in handles.into_iter().enumerate() {
        let got = h.join().unwrap();
        if i % 2 == 0 {
            assert_eq!(got, solo);
        } else {
            assert_eq!(got[0], "Hello! You said: client 1 request 0.");
        }
    }
}

#[test]
fn a_disconnected_non_streaming_client_cancels_too() {
    let server = TestServer::with(Options {
        delay: Duration::from_millis(5),
        config: SchedulerConfig { max_active: 1, ..SchedulerConfig::default() },
        ..Options::default()
    });
    let body = json!({"messages": [{"role": "user", "content": "a long answer"}]}).to_string();
    let mut s = std::net::TcpStream::connect(server.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Bounded wait until the request is generating, then hang up.
    let mut generating = false;
    for _ in 0..2000 {
        if server.metric("ds4_completion_tokens_total") >= 1.0 {
            generating = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(generating);
    drop(s);
    let r = server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "next"}]}));
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Hello! You said: next.");
    let generated = server.metric("ds4_completion_tokens_total");
    assert!(generated < 300.0, "the abandoned request kept generating: {generated} tokens");
}
