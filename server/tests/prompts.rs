//! The prompts the server builds with the real DeepSeek-V4 renderer and tokenizer (demo model's vocabulary), for the
//! three agents' request shapes: every generation prompt ends in the assistant transition, and turn N's prompt
//! tokens are a prefix of turn N+1's (the basis of prefix reuse), through each API's own request conversion.

use ds4_server::api::{anthropic, openai_chat, responses};
use ds4_server::engine::EngineCodec;
use ds4_server::model::{Codec, Conversation};
use serde_json::{json, Value};

const ASSISTANT_THINK: &str = "<｜Assistant｜><think>";
const ASSISTANT_CHAT: &str = "<｜Assistant｜></think>";

fn codec() -> EngineCodec {
    let file = ds4_engine::gguf::GgufFile::from_bytes(ds4_engine::convert::demo_model_gguf(1).unwrap()).unwrap();
    EngineCodec::new(ds4_engine::tokenizer::Tokenizer::from_gguf(&file).unwrap())
}

/// Renders and tokenizes turn 1 and turn 2; checks both end in `transition` and turn 1 is a token prefix of turn 2.
fn check_turns(codec: &EngineCodec, t1: &Conversation, t2: &Conversation, transition: &str) -> (String, String) {
    let (p1, p2) = (codec.render(t1).unwrap(), codec.render(t2).unwrap());
    assert!(p1.ends_with(transition), "turn 1 does not end in {transition}: …{}", tail(&p1));
    assert!(p2.ends_with(transition), "turn 2 does not end in {transition}: …{}", tail(&p2));
    let (k1, k2) = (codec.encode(&p1).unwrap(), codec.encode(&p2).unwrap());
    assert!(k2.len() > k1.len() && k2[..k1.len()] == k1[..], "turn 1's tokens are not a prefix of turn 2's");
    (p1, p2)
}

fn tail(s: &str) -> String {
    s.chars().rev().take(80).collect::<Vec<_>>().into_iter().rev().collect()
}

fn claude_code_body(turn2: bool) -> Value {
    let env = "# Environment\nYou have been invoked in the following environment: cwd /workspace/project";
    let mut messages = vec![
        json!({"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nBe helpful.\n</system-reminder>"},
            {"type": "text", "text": "<system-reminder>\nNo attribution.\n</system-reminder>"},
            {"type": "text", "text": "list the files here", "cache_control": {"type": "ephemeral"}}]}),
        // First request: blocks with cache_control; follow-ups: the same text as a plain string.
        if turn2 {
            json!({"role": "system", "content": env})
        } else {
            json!({"role": "system", "content": [{"type": "text", "text": env, "cache_control": {"type": "ephemeral"}}]})
        },
    ];
    if turn2 {
        messages.push(json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "README.md\nhello.py", "is_error": false,
             "cache_control": {"type": "ephemeral"}}]}));
    }
    json!({
        "model": "deepseek-v4-flash", "max_tokens": 32000, "stream": true,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.93d; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}}],
        "messages": messages,
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object",
                "properties": {"command": {"type": "string"}}, "required": ["command"]}},
            {"name": "DeferredToolPlaceholder", "description": "placeholder", "defer_loading": true,
                "input_schema": {}}],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    })
}

#[test]
fn claude_code_system_message_joins_the_user_turn_and_turns_extend() {
    let codec = codec();
    let conv = |turn2| anthropic::to_conversation(claude_code_body(turn2).to_string().as_bytes()).unwrap();
    let (p1, _) = check_turns(&codec, &conv(false), &conv(true), ASSISTANT_THINK);
    // The system message inside `messages` is part of the user turn, right before the assistant's turn.
    assert!(
        p1.ends_with(
            "list the files here\n\n# Environment\nYou have been invoked in the following environment: \
cwd /workspace/project<｜Assistant｜><think>"
        ),
        "…{}",
        tail(&p1)
    );
    assert_eq!(p1.matches("<｜User｜>").count(), 1);
    assert!(!p1.contains("x-anthropic-billing-header"));
    assert!(!p1.contains("DeferredToolPlaceholder"), "a deferred tool is in the prompt");
    assert!(p1.contains("\"name\": \"Bash\""));
}

#[test]
fn codex_developer_messages_and_tool_round_extend() {
    let codec = codec();
    let input1 = vec![
        json!({"type": "message", "role": "developer", "id": "msg_1",
            "content": [{"type": "input_text", "text": "You are Codex."}]}),
        json!({"type": "message", "role": "developer", "id": "msg_2",
            "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]}),
        json!({"type": "message", "role": "user", "id": "msg_3",
            "content": [{"type": "input_text", "text": "<environment_context>cwd</environment_context>"}]}),
        json!({"type": "message", "role": "user", "id": "msg_4",
            "content": [{"type": "input_text", "text": "list the files here"}]}),
    ];
    let mut input2 = input1.clone();
    input2.push(json!({"type": "function_call", "id": "fc_1", "status": "completed", "name": "exec_command",
        "arguments": "{\"cmd\":\"ls\"}", "call_id": "call_1"}));
    input2.push(json!({"type": "function_call_output", "id": "fco_1", "call_id": "call_1",
        "output": "Process exited with code 0\nOutput:\nREADME.md\nhello.py\n"}));
    let body = |input: Vec<Value>| {
        json!({"model": "deepseek-v4-flash", "stream": true, "input": input, "tool_choice": "auto",
            "parallel_tool_calls": true, "reasoning": {"summary": "auto"}, "store": false,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s",
            "tools": [
                {"type": "function", "name": "exec_command", "description": "Run", "strict": false,
                    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
                {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn"}]},
                {"type": "web_search", "external_web_access": false}]})
        .to_string()
    };
    let conv = |input| responses::to_conversation(body(input).as_bytes()).unwrap();
    let (p1, _) = check_turns(&codec, &conv(input1.clone()), &conv(input2), ASSISTANT_THINK);
    // Both developer messages form the system prompt, and the tool list follows all of it.
    assert!(p1.starts_with("<｜begin▁of▁sentence｜>You are Codex.\n\n<permissions>sandboxed</permissions>\n\n## Tools"));
}

#[test]
fn opencode_chat_tool_round_extends() {
    let codec = codec();
    let tools = json!([{"type": "function", "function": {"name": "bash", "description": "Run",
        "parameters": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number", "exclusiveMinimum": 0,
                "maximum": 9007199254740991i64}}}}}]);
    let mut messages =
        vec![json!({"role": "system", "content": "You are opencode."}), json!({"role": "user", "content": "\"ls\""})];
    let conv = |messages: &Vec<Value>| {
        let mut req: openai_chat::ChatRequest = serde_json::from_value(json!({"model": "deepseek-v4-flash",
            "max_tokens": 32000, "stream": true, "stream_options": {"include_usage": true}, "tool_choice": "auto",
            "messages": messages, "tools": tools}))
        .unwrap();
        openai_chat::conversation(&mut req).unwrap()
    };
    let t1 = conv(&messages);
    messages.push(json!({"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "README.md\nhello.py"}));
    check_turns(&codec, &t1, &conv(&messages), ASSISTANT_CHAT);
    // A system message after the tool round (no user turn before it) still hands the turn to the assistant.
    messages.push(json!({"role": "system", "content": "Reminder: be brief."}));
    let p = codec.render(&conv(&messages)).unwrap();
    assert!(p.ends_with("</tool_result>\n\nReminder: be brief.<｜Assistant｜></think>"), "…{}", tail(&p));
}

#[test]
fn a_prompt_ending_in_an_assistant_turn_still_ends_in_the_transition() {
    let codec = codec();
    let mut req: openai_chat::ChatRequest = serde_json::from_value(json!({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}))
    .unwrap();
    let p = codec.render(&openai_chat::conversation(&mut req).unwrap()).unwrap();
    assert!(p.ends_with("hello<｜end▁of▁sentence｜><｜Assistant｜></think>"), "{p}");
}
