//! Structured outputs on the scripted test model: its grammar support is a mask over its byte vocabulary, so a
//! scripted reply that does not fit the format still comes back in it (a refused byte leaves a uniform choice among
//! the allowed ones), with thinking too (the grammar starts after the byte sequence `</think>`).

mod common;

use common::TestServer;
use serde_json::{json, Value};

/// `{"n": 0..=9, "tag": "a" | "b"}`, nothing else.
fn schema() -> Value {
    json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"], "additionalProperties": false})
}

fn valid(text: &str) -> bool {
    let Ok(Value::Object(m)) = serde_json::from_str::<Value>(text) else { return false };
    m.len() == 2
        && m.get("n").and_then(Value::as_i64).is_some_and(|n| (0..=9).contains(&n))
        && m.get("tag").and_then(Value::as_str).is_some_and(|t| t == "a" || t == "b")
}

#[test]
fn formats_shape_the_scripted_models_answers() {
    let server = TestServer::start();
    // The built-in reply ("Hello! You said: …") is not JSON; the answer is.
    let format = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema(), "strict": true}});
    for stream in [false, true] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "response_format": format,
            "stream": stream});
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let text = if stream {
            r.event_json().iter().filter_map(|(_, c)| c["choices"][0]["delta"]["content"].as_str()).collect::<String>()
        } else {
            r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        };
        assert!(valid(&text), "stream {stream}: {text:?}");
    }
    // Thinking: the reasoning is free ("Let me think."), the answer after it follows the format.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled",
        "budget_tokens": 100}, "max_tokens": 400, "output_config": {"format": {"type": "json_schema",
        "schema": schema()}}});
    let r = server.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["content"][0], json!({"type": "thinking", "thinking": "Let me think.", "signature": ""}), "{v}");
    assert!(valid(v["content"][1]["text"].as_str().unwrap()), "{v}");
    // A regex.
    let body = json!({"input": "hi", "text": {"format": {"type": "regex", "pattern": "[0-9]{2}-[xy]{3}"}}});
    let r = server.post("/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["output"][0]["content"][0]["text"].as_str().unwrap().to_string();
    let b = text.as_bytes();
    assert!(
        b.len() == 6
            && b[..2].iter().all(u8::is_ascii_digit)
            && b[2] == b'-'
            && b[3..].iter().all(|c| b"xy".contains(c)),
        "{text:?}"
    );
    assert!(server.metric("ds4_structured_requests_total") >= 4.0);
}
