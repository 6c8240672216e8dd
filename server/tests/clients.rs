//! Replays every recorded agent request in `../shared/clients/` (Claude Code, Codex, opencode) against the server
//! on the scripted fake model, streaming as the clients do, and checks the event shapes each client parses.

mod common;

use common::{fixtures, replay, TestServer};
use serde_json::{json, Value};

fn last_user_text_is_tool_result(body: &Value) -> bool {
    let last = body["messages"].as_array().and_then(|m| m.last()).cloned().unwrap_or(Value::Null);
    last["role"] == "tool" || last["content"].as_array().is_some_and(|c| c.iter().any(|b| b["type"] == "tool_result"))
}

#[test]
fn opencode_chat_completion_streams() {
    let Some(fx) = fixtures("opencode") else { return };
    assert_eq!(fx.len(), 3);
    let server = TestServer::start();
    for (name, f) in &fx {
        let r = replay(&server, f);
        assert_eq!(r.status, 200, "{name}: {}", r.body);
        assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
        let events = r.events();
        assert_eq!(events.last().unwrap().1, "[DONE]", "{name}");
        assert!(events.iter().all(|(n, _)| n.is_none()), "chat chunks carry no event names");
        let chunks = r.event_json();
        let id = chunks[0].1["id"].as_str().unwrap().to_string();
        assert!(chunks.iter().all(|(_, c)| c["object"] == "chat.completion.chunk" && c["id"] == id.as_str()));
        assert_eq!(chunks[0].1["choices"][0]["delta"]["role"], "assistant");
        let content: String =
            chunks.iter().filter_map(|(_, c)| c["choices"][0]["delta"]["content"].as_str()).collect::<String>();
        if last_user_text_is_tool_result(&f["body"]) {
            assert!(content.starts_with("Done: README.md"), "{name}: {content}");
        } else {
            assert!(content.starts_with("Hello! You said: "), "{name}: {content}");
        }
        let finish: Vec<&Value> = chunks
            .iter()
            .filter_map(|(_, c)| c["choices"].get(0).map(|ch| &ch["finish_reason"]).filter(|f| !f.is_null()))
            .collect();
        assert_eq!(finish, vec!["stop"], "{name}");
        // include_usage: one final chunk with empty choices and the usage.
        let (_, usage) = chunks.last().unwrap();
        assert_eq!(usage["choices"], serde_json::json!([]));
        let u = &usage["usage"];
        assert!(u["prompt_tokens"].as_u64().unwrap() > 100);
        assert_eq!(u["total_tokens"], u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap());
        assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
    }
}

#[test]
fn claude_code_messages_stream() {
    let Some(fx) = fixtures("claude-code") else { return };
    assert_eq!(fx.len(), 3);
    let server = TestServer::start();
    for (name, f) in &fx {
        assert!(f["path"].as_str().unwrap().contains("?beta=true"));
        let r = replay(&server, f);
        assert_eq!(r.status, 200, "{name}: {}", r.body);
        let ev = r.event_json();
        for (n, d) in &ev {
            assert_eq!(n.as_deref(), d["type"].as_str(), "{name}: event name equals data.type");
        }
        let types: Vec<&str> = ev.iter().map(|(_, d)| d["type"].as_str().unwrap()).collect();
        assert_eq!(types.first(), Some(&"message_start"));
        assert_eq!(&types[types.len() - 2..], &["message_delta", "message_stop"]);
        let start = &ev[0].1["message"];
        assert_eq!(start["role"], "assistant");
        assert_eq!(start["content"], serde_json::json!([]));
        // Blocks: start/delta*/stop with one index each, in order.
        let mut open: Option<u64> = None;
        let mut next = 0;
        let mut text = String::new();
        for (_, d) in &ev[1..ev.len() - 2] {
            match d["type"].as_str().unwrap() {
                "content_block_start" => {
                    assert!(open.is_none());
                    assert_eq!(d["index"], next);
                    // thinking display "omitted": no thinking blocks reach Claude Code.
                    assert_eq!(d["content_block"]["type"], "text", "{name}");
                    open = Some(next);
                    next += 1;
                }
                "content_block_delta" => {
                    assert_eq!(d["index"].as_u64(), open);
                    text.push_str(d["delta"]["text"].as_str().unwrap());
                }
                "content_block_stop" => {
                    assert_eq!(d["index"].as_u64(), open);
                    open = None;
                }
                "ping" => {}
                other => panic!("{name}: unexpected {other}"),
            }
        }
        assert!(open.is_none());
        if last_user_text_is_tool_result(&f["body"]) {
            assert!(text.starts_with("Done: README.md"), "{name}: {text}");
        } else {
            assert_eq!(text, "Hello! You said: list the files here.", "{name}");
        }
        let delta = &ev[ev.len() - 2].1;
        assert_eq!(delta["delta"]["stop_reason"], "end_turn");
        assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
        assert!(delta["usage"]["input_tokens"].is_u64() && delta["usage"]["cache_read_input_tokens"].is_u64());
    }
}

#[test]
fn claude_code_billing_line_does_not_defeat_prefix_reuse() {
    let Some(fx) = fixtures("claude-code") else { return };
    let server = TestServer::start();
    let first = &fx[0].1;
    let r = replay(&server, first);
    assert_eq!(r.status, 200);
    // The same request from "another conversation": only the billing line's suffix differs.
    let mut other = first.clone();
    let line = other["body"]["system"][0]["text"].as_str().unwrap().replace("93d", "862");
    assert_ne!(Some(line.as_str()), first["body"]["system"][0]["text"].as_str());
    other["body"]["system"][0]["text"] = Value::String(line);
    let r = replay(&server, &other);
    let ev = r.event_json();
    let usage = &ev[ev.len() - 2].1["usage"];
    // Everything but the one token that must be fed for fresh logits comes from the parked session.
    assert_eq!(usage["input_tokens"], 1, "{usage}");
    assert!(usage["cache_read_input_tokens"].as_u64().unwrap() > 1000);
}

#[test]
fn codex_responses_stream() {
    let Some(fx) = fixtures("codex") else { return };
    assert_eq!(fx.len(), 3);
    let server = TestServer::start();
    for (name, f) in &fx {
        let mut f = f.clone();
        // A scrubbed custom-tool grammar (`"<578 chars: start: …>"`) is not a grammar: a 400 naming the tool. A
        // small patch grammar stands in for it.
        let scrubbed: Vec<usize> = (f["body"]["tools"].as_array().unwrap().iter().enumerate())
            .filter(|(_, t)| t["format"]["definition"].as_str().is_some_and(|d| d.starts_with('<')))
            .map(|(i, _)| i)
            .collect();
        for i in scrubbed {
            let r = replay(&server, &f);
            assert_eq!(r.status, 400, "{name}: {}", r.body);
            assert_eq!(r.json()["error"]["param"], format!("tools[{i}].format"), "{name}");
            let tool = f["body"]["tools"][i]["name"].as_str().unwrap().to_string();
            assert!(r.json()["error"]["message"].as_str().unwrap().contains(&format!("`{tool}`")), "{name}");
            f["body"]["tools"][i]["format"]["definition"] =
                json!("start: \"*** Begin Patch\\n\" LINE* \"*** End Patch\\n\"\nLINE: /[^*\\n][^\\n]*\\n/\n");
        }
        let f = &f;
        let r = replay(&server, f);
        assert_eq!(r.status, 200, "{name}: {}", r.body);
        let ev = r.event_json();
        for (i, (n, d)) in ev.iter().enumerate() {
            assert_eq!(n.as_deref(), d["type"].as_str());
            assert_eq!(d["sequence_number"], i as u64, "{name}: sequence numbers count from 0");
        }
        let types: Vec<&str> = ev.iter().map(|(_, d)| d["type"].as_str().unwrap()).collect();
        assert_eq!(&types[..2], &["response.created", "response.in_progress"]);
        assert_eq!(types.last(), Some(&"response.completed"), "{name}");
        let added = types.iter().filter(|t| **t == "response.output_item.added").count();
        let done = types.iter().filter(|t| **t == "response.output_item.done").count();
        assert_eq!(added, done);
        let deltas: String = ev
            .iter()
            .filter(|(_, d)| d["type"] == "response.output_text.delta")
            .map(|(_, d)| d["delta"].as_str().unwrap())
            .collect();
        let final_resp = &ev.last().unwrap().1["response"];
        assert_eq!(final_resp["status"], "completed");
        let output = final_resp["output"].as_array().unwrap();
        assert_eq!(output.len(), done);
        let msg = output.iter().find(|o| o["type"] == "message").expect("a message item");
        assert_eq!(msg["content"][0]["type"], "output_text");
        assert_eq!(msg["content"][0]["text"], deltas.as_str());
        let is_tool_round = f["body"]["input"].as_array().unwrap().iter().any(|i| i["type"] == "function_call_output");
        if is_tool_round {
            assert!(deltas.starts_with("Done: Chunk ID"), "{name}: {deltas}");
        } else {
            assert_eq!(deltas, "Hello! You said: list the files here.", "{name}");
        }
        // `reasoning` was sent, so the model thought first; the reasoning item precedes the message.
        assert_eq!(output[0]["type"], "reasoning", "{name}");
        let u = &final_resp["usage"];
        assert!(u["input_tokens"].as_u64().unwrap() > 100);
        assert!(u["input_tokens_details"]["cached_tokens"].is_u64());
    }
}
