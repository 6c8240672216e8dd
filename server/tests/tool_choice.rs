//! A forced tool call on chat completions and Anthropic messages: `tool_choice` `"required"` / `{"type": "any"}`
//! or naming a tool makes the answer a call of an offered (or that) tool. On the demo model (random weights, real
//! tokenizer, DSML template and parser) nothing but the constraint makes it call a tool, so every call that comes
//! back shows the forcing works; strict tools with closed enum schemas keep the arguments short, and each call's
//! arguments are checked by hand against the schema. A forced call of a tool that is not offered is a 400.

mod common;

use common::demo_server;
use serde_json::{json, Value};

/// Each tool's one argument and the values its schema allows.
const TOOLS: [(&str, &str, [&str; 2]); 2] =
    [("pick_city", "city", ["paris", "rome"]), ("pick_day", "day", ["mon", "tue"])];

fn schema(arg: &str, values: [&str; 2]) -> Value {
    json!({"type": "object", "properties": {arg: {"type": "string", "enum": values}}, "required": [arg],
           "additionalProperties": false})
}

/// Whether `(name, arguments)` is a call of one of `allowed` with arguments its schema accepts.
fn valid_call(name: &str, arguments: &Value, allowed: &[&str]) -> bool {
    let Some((_, arg, values)) = TOOLS.iter().find(|t| t.0 == name) else { return false };
    let Some(obj) = arguments.as_object() else { return false };
    allowed.contains(&name)
        && obj.len() == 1
        && obj.get(*arg).and_then(Value::as_str).is_some_and(|v| values.contains(&v))
}

fn chat_body(choice: Value) -> Value {
    let tools: Vec<Value> = TOOLS
        .iter()
        .map(|(n, a, v)| {
            json!({"type": "function", "function": {"name": n, "description": "Pick one.", "strict": true,
                   "parameters": schema(a, *v)}})
        })
        .collect();
    json!({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "Plan a trip."}], "tools": tools,
           "tool_choice": choice, "parallel_tool_calls": false, "temperature": 0, "max_tokens": 400})
}

fn messages_body(choice: Value) -> Value {
    let tools: Vec<Value> = TOOLS
        .iter()
        .map(|(n, a, v)| json!({"name": n, "description": "Pick one.", "strict": true, "input_schema": schema(a, *v)}))
        .collect();
    json!({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "Plan a trip."}], "tools": tools,
           "tool_choice": choice, "temperature": 0, "max_tokens": 400})
}

#[test]
fn chat_tool_choice_forces_a_call() {
    let server = demo_server();
    let cases = [
        (json!({"type": "function", "function": {"name": "pick_day"}}), vec!["pick_day"]),
        (json!("required"), vec!["pick_city", "pick_day"]),
    ];
    for (choice, allowed) in cases {
        let r = server.post("/v1/chat/completions", &chat_body(choice.clone()));
        assert_eq!(r.status, 200, "{choice}: {}", r.body);
        let v = r.json();
        let choice0 = &v["choices"][0];
        let calls = choice0["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        assert_eq!(calls.len(), 1, "{choice}: parallel_tool_calls false allows one call: {v}");
        let f = &calls[0]["function"];
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).expect("arguments are JSON");
        assert!(valid_call(f["name"].as_str().unwrap(), &args, &allowed), "{choice}: {f}");
        assert_eq!(choice0["finish_reason"], "tool_calls", "{choice}: {v}");
    }
}

#[test]
fn messages_tool_choice_forces_a_call() {
    let server = demo_server();
    let cases = [
        (json!({"type": "tool", "name": "pick_city", "disable_parallel_tool_use": true}), vec!["pick_city"]),
        (json!({"type": "any", "disable_parallel_tool_use": true}), vec!["pick_city", "pick_day"]),
    ];
    for (choice, allowed) in cases {
        let r = server.post("/v1/messages", &messages_body(choice.clone()));
        assert_eq!(r.status, 200, "{choice}: {}", r.body);
        let v = r.json();
        let uses: Vec<&Value> = v["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
        assert_eq!(uses.len(), 1, "{choice}: {v}");
        assert!(valid_call(uses[0]["name"].as_str().unwrap(), &uses[0]["input"], &allowed), "{choice}: {v}");
        assert_eq!(v["stop_reason"], "tool_use", "{choice}: {v}");
    }
}

#[test]
fn forcing_a_tool_that_is_not_offered_is_a_400() {
    let server = demo_server();
    let bad = |path: &str, body: Value, what: &str| {
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        let e = &r.json()["error"];
        let text = e.to_string();
        assert!(text.contains("tool_choice") && text.contains(what), "{path}: {text}");
    };
    bad("/v1/chat/completions", chat_body(json!({"type": "function", "function": {"name": "nope"}})), "`nope`");
    bad("/v1/messages", messages_body(json!({"type": "tool", "name": "nope"})), "`nope`");
    let mut none = chat_body(json!("required"));
    none.as_object_mut().unwrap().remove("tools");
    bad("/v1/chat/completions", none, "no tool is offered");
    let mut none = messages_body(json!({"type": "any"}));
    none.as_object_mut().unwrap().remove("tools");
    bad("/v1/messages", none, "no tool is offered");
    // "none" still hides the tools, and the server answers normally afterwards.
    let mut hidden = chat_body(json!("none"));
    hidden["max_tokens"] = json!(4);
    let r = server.post("/v1/chat/completions", &hidden);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["choices"][0]["message"]["tool_calls"].is_null(), "{}", r.body);
}
