//! Responses custom (freeform) tools: on the demo model (random weights, real tokenizer, DSML template and parser)
//! a tool's Lark or regex grammar is the only thing that can make its input valid, so every `custom_tool_call` that
//! comes back is checked against the grammar by hand; on the scripted test model, a free-text custom tool's call
//! comes back as a `custom_tool_call` with the raw input. Bad grammars are 400s naming the tool, on both.

mod common;

use common::{demo_server, Options, TestServer};
use ds4_server::fake_script::Script;
use serde_json::{json, Value};

/// A small patch language, bounded (so that noise has to finish it): one or two hunks of one to three lines.
const PATCH: &str = r#"start: "*** Begin Patch\n" hunk hunk? "*** End Patch\n"
hunk: "*** Add File: " PATH "\n" line line? line?
PATH: /[a-z]{1,8}\.txt/
line: "+" /[a-z ]{0,20}/ "\n"
"#;

/// Whether `s` is in [`PATCH`]'s language (checked by hand, not by the grammar engine).
fn is_patch(s: &str) -> bool {
    let Some(body) = s.strip_prefix("*** Begin Patch\n").and_then(|b| b.strip_suffix("*** End Patch\n")) else {
        return false;
    };
    let Some(body) = body.strip_suffix('\n') else { return false };
    let mut hunks = 0;
    let mut lines_in_hunk = 0;
    for line in body.split('\n') {
        if let Some(path) = line.strip_prefix("*** Add File: ") {
            if hunks > 0 && lines_in_hunk == 0 {
                return false;
            }
            let Some(stem) = path.strip_suffix(".txt") else { return false };
            if !(1..=8).contains(&stem.len()) || !stem.bytes().all(|b| b.is_ascii_lowercase()) {
                return false;
            }
            hunks += 1;
            lines_in_hunk = 0;
        } else if let Some(text) = line.strip_prefix('+') {
            if hunks == 0 || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_lowercase() || b == b' ') {
                return false;
            }
            lines_in_hunk += 1;
            if lines_in_hunk > 3 {
                return false;
            }
        } else {
            return false;
        }
    }
    (1..=2).contains(&hunks) && lines_in_hunk >= 1
}

/// Whether `s` matches `[0-9]{3}-[a-z]{2,4}` (by hand).
fn is_ticket(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 6
        && b.len() <= 8
        && b[..3].iter().all(u8::is_ascii_digit)
        && b[3] == b'-'
        && b[4..].iter().all(u8::is_ascii_lowercase)
}

fn patch_tool() -> Value {
    json!({"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": PATCH}})
}

fn ticket_tool() -> Value {
    json!({"type": "custom", "name": "file_ticket", "description": "File a ticket by id.",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[a-z]{2,4}"}})
}

fn function_tool() -> Value {
    json!({"type": "function", "name": "shell", "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}})
}

fn request(tools: Value, tool_choice: Value, stream: bool) -> Value {
    json!({"model": "deepseek-v4-flash", "input": "Add a file with a greeting.", "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": false, "temperature": 0, "max_output_tokens": 600,
        "stream": stream})
}

/// The custom tool calls of a finished response (asserting it completed and has no function calls of their name).
fn custom_calls(v: &Value) -> Vec<Value> {
    assert_eq!(v["status"], "completed", "{v}");
    let out = v["output"].as_array().unwrap();
    out.iter().filter(|i| i["type"] == "custom_tool_call").cloned().collect()
}

#[test]
fn custom_tools_with_grammars_on_the_demo_model() {
    let server = demo_server();

    // A Lark grammar, the tool named by tool_choice, beside a function tool.
    let r = server.post(
        "/v1/responses",
        &request(json!([function_tool(), patch_tool()]), json!({"type": "custom", "name": "apply_patch"}), false),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls = custom_calls(&v);
    assert_eq!(calls.len(), 1, "{v}");
    let c = &calls[0];
    assert_eq!(c["name"], "apply_patch");
    assert_eq!(c["status"], "completed");
    assert!(c["call_id"].as_str().is_some_and(|s| s.starts_with("call_")), "{c}");
    assert!(c["id"].as_str().is_some_and(|s| !s.is_empty()), "{c}");
    assert!(c.get("arguments").is_none(), "{c}");
    let input = c["input"].as_str().unwrap();
    assert!(is_patch(input), "not a patch: {input:?}");
    assert!(!v["output"].as_array().unwrap().iter().any(|i| i["type"] == "function_call"), "{v}");
    // The response echoes the tools as sent.
    assert_eq!(v["tools"][1]["format"]["definition"], PATCH);

    // A regex, forced by "required" (the only tool).
    let r = server.post("/v1/responses", &request(json!([ticket_tool()]), json!("required"), false));
    assert_eq!(r.status, 200, "{}", r.body);
    let calls = custom_calls(&r.json());
    assert_eq!(calls.len(), 1, "{}", r.body);
    assert_eq!(calls[0]["name"], "file_ticket");
    let input = calls[0]["input"].as_str().unwrap();
    assert!(is_ticket(input), "does not match the regex: {input:?}");

    // The history a client sends back (the call, its output) renders and is answered.
    let mut follow = request(json!([patch_tool()]), json!("auto"), false);
    follow["input"] = json!([
        {"type": "message", "role": "user", "content": "Add a file."},
        {"type": "custom_tool_call", "call_id": c["call_id"], "name": "apply_patch", "input": c["input"]},
        {"type": "custom_tool_call_output", "call_id": c["call_id"], "output": "Done."},
    ]);
    follow["max_output_tokens"] = json!(8);
    let r = server.post("/v1/responses", &follow);
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_streamed_custom_tool_call() {
    let server = demo_server();
    let r = server.post("/v1/responses", &request(json!([patch_tool()]), json!("required"), true));
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.event_json();
    let kinds: Vec<&str> = events.iter().map(|(_, e)| e["type"].as_str().unwrap()).collect();
    let at = |k: &str| kinds.iter().position(|x| *x == k).unwrap_or_else(|| panic!("no {k} in {kinds:?}"));
    let added = events
        .iter()
        .map(|(_, e)| e)
        .find(|e| e["type"] == "response.output_item.added" && e["item"]["type"] == "custom_tool_call")
        .unwrap_or_else(|| panic!("no custom_tool_call added: {kinds:?}"));
    assert_eq!(added["item"]["status"], "in_progress");
    assert_eq!(added["item"]["input"], "");
    let item_id = added["item"]["id"].as_str().unwrap();
    let deltas: String = events
        .iter()
        .map(|(_, e)| e)
        .filter(|e| e["type"] == "response.custom_tool_call_input.delta")
        .inspect(|e| assert_eq!(e["item_id"], item_id))
        .map(|e| e["delta"].as_str().unwrap().to_string())
        .collect();
    let done = &events[at("response.custom_tool_call_input.done")].1;
    assert_eq!(done["item_id"], item_id);
    let input = done["input"].as_str().unwrap();
    assert_eq!(deltas, input);
    assert!(is_patch(input), "not a patch: {input:?}");
    assert!(at("response.output_item.added") < at("response.custom_tool_call_input.delta"));
    assert!(at("response.custom_tool_call_input.delta") < at("response.custom_tool_call_input.done"));
    let item_done = events
        .iter()
        .map(|(_, e)| e)
        .find(|e| e["type"] == "response.output_item.done" && e["item"]["type"] == "custom_tool_call")
        .unwrap();
    assert_eq!(item_done["item"]["input"], input);
    assert_eq!(item_done["item"]["status"], "completed");
    assert!(!kinds.contains(&"response.function_call_arguments.delta"), "{kinds:?}");
    let completed = &events.last().unwrap().1;
    assert_eq!(completed["type"], "response.completed", "{kinds:?}");
    let calls = custom_calls(&completed["response"]);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["input"], input);
    assert_eq!(calls[0]["call_id"], item_done["item"]["call_id"]);
}

/// The error of a 400 reply: (param, message).
fn bad_request(server: &TestServer, body: &Value) -> (String, String) {
    let r = server.post("/v1/responses", body);
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    (e["param"].as_str().unwrap_or_default().to_string(), e["message"].as_str().unwrap().to_string())
}

#[test]
fn bad_custom_tool_grammars_are_400s_naming_the_tool() {
    let server = demo_server();
    let with = |format: Value| {
        let tool = json!({"type": "custom", "name": "apply_patch", "format": format});
        request(json!([function_tool(), tool]), json!("auto"), false)
    };
    let cases = [
        (json!({"type": "grammar", "syntax": "lark", "definition": "start: \"a\" (("}), "Lark"),
        (json!({"type": "grammar", "syntax": "lark", "definition": "start: missing_rule"}), "missing_rule"),
        (json!({"type": "grammar", "syntax": "regex", "definition": "[0-9"}), "regex"),
        (json!({"type": "grammar", "syntax": "ebnf", "definition": "x"}), "`ebnf`"),
        (json!({"type": "grammar", "syntax": "lark"}), "definition"),
        (json!({"type": "json"}), "`json`"),
    ];
    for (format, what) in cases {
        let (param, message) = bad_request(&server, &with(format.clone()));
        assert_eq!(param, "tools[1].format", "{format}: {message}");
        assert!(message.contains("`apply_patch`"), "{format}: {message}");
        assert!(message.contains(what), "{format}: {message} (expected {what:?})");
    }
    // tool_choice naming a tool that is not offered; a custom tool without a name; a name used twice.
    let (param, message) =
        bad_request(&server, &request(json!([patch_tool()]), json!({"type": "custom", "name": "nope"}), false));
    assert_eq!(param, "tool_choice");
    assert!(message.contains("`nope`"), "{message}");
    let (param, _) = bad_request(&server, &request(json!([{"type": "custom"}]), json!("auto"), false));
    assert_eq!(param, "tools[0].name");
    let twin = json!({"type": "function", "name": "apply_patch", "parameters": {"type": "object"}});
    let (_, message) = bad_request(&server, &request(json!([patch_tool(), twin]), json!("auto"), false));
    assert!(message.contains("used twice"), "{message}");
    // The server still answers after all that.
    let r = server.post("/v1/responses", &request(json!([ticket_tool()]), json!("required"), false));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn free_text_custom_tools_on_the_scripted_model() {
    let script = Script::parse(
        r#"[{"when": {"contains": "patch it"},
             "reply": {"text": "", "tool_calls": [{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\nraw <text> \"here\"\n"}}]}}]"#,
    )
    .unwrap();
    let server = TestServer::with(Options { script, ..Options::default() });
    let tool =
        json!({"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": {"type": "text"}});
    let body = json!({"input": "please patch it", "tools": [tool, function_tool()]});
    let r = server.post("/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls = custom_calls(&v);
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["input"], "*** Begin Patch\nraw <text> \"here\"\n");
    assert_eq!(calls[0]["name"], "apply_patch");

    // Streamed: the input arrives as custom_tool_call_input events.
    let r = server.post("/v1/responses", &json!({"input": "please patch it", "tools": [tool], "stream": true}));
    let events = r.event_json();
    let done = events.iter().find(|(_, e)| e["type"] == "response.custom_tool_call_input.done").unwrap();
    assert_eq!(done.1["input"], "*** Begin Patch\nraw <text> \"here\"\n");

    // Its tool calls are its own parser's: a grammar is checked (a bad one is a 400 naming the tool), the call
    // comes back as scripted.
    let bad = json!({"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
        "definition": "start: (("}});
    let (param, message) = bad_request(&server, &json!({"input": "please patch it", "tools": [bad]}));
    assert_eq!(param, "tools[0].format");
    assert!(message.contains("`apply_patch`"), "{message}");
    let r = server.post("/v1/responses", &json!({"input": "please patch it", "tools": [patch_tool()]}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(custom_calls(&r.json())[0]["input"], "*** Begin Patch\nraw <text> \"here\"\n");
}
