//! The server on the real ds4 engine with the built-in demo model (random weights, real tokenizer, chat template
//! and DSML parser): every API answers, temperature-0 answers are reproducible, concurrent batching does not change
//! them, and prefix reuse works although the engine cannot roll sessions back.

mod common;

use std::sync::Arc;

use common::TestServer;
use ds4_server::engine::{load, LoadOptions};
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::{build_state, Limits};
use serde_json::json;

fn demo_server() -> TestServer {
    let opts = LoadOptions {
        placement: Default::default(),
        backend: ds4_engine::engine::BackendKind::Cpu,
        ctx: 2048,
        max_batch_tokens: 256,
        max_sessions: 64,
        active_sessions: 8,
        demo_seed: Some(1),
    };
    let (runner, codec, info) = load(None, &opts).expect("demo model");
    assert!(info.demo);
    assert_eq!(info.context_size, 2048);
    let config = SchedulerConfig { max_active: 8, prefill_chunk: 128, ..SchedulerConfig::default() };
    TestServer::on(build_state(Box::new(runner), Arc::new(codec), info, config, Limits::default()))
}

fn chat_text(server: &TestServer, content: &str) -> (String, serde_json::Value) {
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    (v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string(), v["usage"].clone())
}

#[test]
fn demo_model_serves_every_api_reproducibly() {
    let server = demo_server();
    let (first, u1) = chat_text(&server, "Hello there, how are you?");
    let (again, u2) = chat_text(&server, "Hello there, how are you?");
    assert_eq!(first, again, "temperature 0 is reproducible");
    assert_eq!(u1["completion_tokens"], 6);
    // The parked session's KV state is held in host memory and reported by tier.
    assert!(server.metric("ds4_kv_bytes{tier=\"host\"}") > 0.0, "host KV bytes not reported");
    assert_eq!(server.metric("ds4_kv_bytes{tier=\"device\"}"), 0.0);
    // The repeat is served from the parked prompt copy.
    assert_eq!(u2["prompt_tokens_details"]["cached_tokens"], u1["prompt_tokens"]);

    // Concurrent requests (batched together) give the solo answers.
    let prompts: Vec<String> = (0..6).map(|i| format!("Question number {i}?")).collect();
    let solo: Vec<String> = prompts.iter().map(|p| chat_text(&server, p).0).collect();
    let addr = server.addr;
    let handles: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            std::thread::spawn(move || {
                let body = json!({"messages": [{"role": "user", "content": p}], "max_tokens": 6, "temperature": 0,
                    "stream": true});
                let r = common::post_json(addr, "/v1/chat/completions", &body);
                let chunks = r.event_json();
                let reasoning_or_text: String = chunks
                    .iter()
                    .filter_map(|(_, c)| c["choices"][0]["delta"]["content"].as_str().map(String::from))
                    .collect();
                reasoning_or_text
            })
        })
        .collect();
    for (h, s) in handles.into_iter().zip(&solo) {
        assert_eq!(&h.join().unwrap(), s);
    }

    let r = server.post(
        "/v1/messages",
        &json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 100}, "stream": true}),
    );
    assert_eq!(r.status, 200);
    assert!(r.body.contains("event: message_stop"));
    let r = server.post("/v1/responses", &json!({"input": "hi", "max_output_tokens": 4, "stream": true}));
    assert!(r.body.contains("event: response.incomplete") || r.body.contains("event: response.completed"));
    let r = server.post("/v1/messages/count_tokens", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert!(r.json()["input_tokens"].as_u64().unwrap() > 1);
    let long = "word ".repeat(3000);
    let r = server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": long}]}));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("2048"));
}

#[test]
fn count_tokens_agrees_with_generation_for_claude_codes_shape() {
    let server = demo_server();
    // A `role: "system"` message after the user turn, as Claude Code sends it.
    let body = json!({"max_tokens": 3, "temperature": 0, "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "list the files"}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp"}]}],
        "thinking": {"type": "adaptive", "display": "omitted"}});
    let counted = server.post("/v1/messages/count_tokens", &body).json()["input_tokens"].as_u64().unwrap();
    let r = server.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let u = &r.json()["usage"];
    let prompt = u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(counted, prompt);
    // The same text as a top-level system block differs only by placement: both prompts end in the assistant
    // transition (before the fix the in-messages form was two tokens short).
    let top = json!({"system": "# Environment\ncwd: /tmp",
        "messages": [{"role": "user", "content": "list the files"}], "thinking": {"type": "adaptive"}});
    let inline = json!({"messages": [{"role": "user", "content": "list the files"},
        {"role": "system", "content": "# Environment\ncwd: /tmp"}], "thinking": {"type": "adaptive"}});
    let n =
        |b: &serde_json::Value| server.post("/v1/messages/count_tokens", b).json()["input_tokens"].as_u64().unwrap();
    assert!(n(&inline) >= n(&top), "{} vs {}", n(&inline), n(&top));
}
