//! `POST /tokenize` and `/detokenize` in the llama-server and vLLM shapes, with the real DeepSeek-V4 tokenizer and
//! chat template (the demo model's vocabulary): ids agree with the codec, `messages` give the chat-completion
//! prompt's ids, pieces and detokenize round-trip the text, and bad input is a 400 naming the field.

mod common;

use std::sync::{Arc, OnceLock};

use common::TestServer;
use ds4_server::api::openai_chat::{self, ChatRequest};
use ds4_server::engine::EngineCodec;
use ds4_server::fake::FakeRunner;
use ds4_server::model::{Codec, ModelInfo};
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::{build_state, Limits};
use serde_json::{json, Value};

const CTX: usize = 8192;

/// The demo model's tokenizer, built once for all tests (building the demo model takes a while).
fn tokenizer() -> ds4_engine::tokenizer::Tokenizer {
    static TOK: OnceLock<ds4_engine::tokenizer::Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let file = ds4_engine::gguf::GgufFile::from_bytes(ds4_engine::convert::demo_model_gguf(1).unwrap()).unwrap();
        ds4_engine::tokenizer::Tokenizer::from_gguf(&file).unwrap()
    })
    .clone()
}

fn codec() -> EngineCodec {
    EngineCodec::new(tokenizer())
}

fn server() -> TestServer {
    let info = ModelInfo {
        id: "deepseek-v4-flash".into(),
        context_size: CTX,
        vocab_size: tokenizer().vocab_size(),
        demo: true,
    };
    let runner = FakeRunner::new(4);
    TestServer::on(build_state(
        Box::new(runner),
        Arc::new(codec()),
        info,
        SchedulerConfig::default(),
        Limits::default(),
    ))
}

fn ids(v: &Value) -> Vec<u32> {
    v["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

const TEXT: &str = "Hello, wörld! 你好 <｜User｜> done";

#[test]
fn text_in_both_shapes_matches_the_codec() {
    let s = server();
    let c = codec();
    let plain = c.encode(TEXT).unwrap();
    assert!(plain.len() > 3);

    // llama-server: `content`, no special tokens added by default.
    let r = s.post("/tokenize", &json!({"content": TEXT}));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(ids(&v), plain);
    assert_eq!(v["count"], json!(plain.len()));
    assert_eq!(v["max_model_len"], json!(CTX));
    // Special-token text is parsed as the special token (llama-server's `parse_special` default).
    let user = c.encode("<｜User｜>").unwrap();
    assert_eq!(user.len(), 1, "the marker is one special token");
    assert!(plain.contains(&user[0]));

    let r = s.post("/tokenize", &json!({"content": TEXT, "add_special": true})).json();
    assert_eq!(ids(&r)[0], c.bos().unwrap());
    assert_eq!(&ids(&r)[1..], &plain[..]);

    // vLLM: `prompt`, BOS added by default, under /v1 too.
    let r = s.post("/v1/tokenize", &json!({"model": "deepseek-v4-flash", "prompt": TEXT})).json();
    assert_eq!(ids(&r)[0], c.bos().unwrap());
    assert_eq!(r["count"], json!(plain.len() + 1));
    let r = s.post("/v1/tokenize", &json!({"prompt": TEXT, "add_special_tokens": false})).json();
    assert_eq!(ids(&r), plain);
}

#[test]
fn pieces_and_token_strings_spell_the_text() {
    let s = server();
    let r = s.post("/tokenize", &json!({"content": TEXT, "with_pieces": true}));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let mut bytes = Vec::new();
    let mut ids_seen = Vec::new();
    for t in v["tokens"].as_array().unwrap() {
        ids_seen.push(t["id"].as_u64().unwrap() as u32);
        match &t["piece"] {
            Value::String(p) => bytes.extend_from_slice(p.as_bytes()),
            // Not whole UTF-8 on its own: the byte list, as llama-server sends it.
            Value::Array(b) => bytes.extend(b.iter().map(|x| x.as_u64().unwrap() as u8)),
            other => panic!("piece is {other}"),
        }
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), TEXT);
    assert_eq!(ids_seen, codec().encode(TEXT).unwrap());

    let v = s.post("/tokenize", &json!({"prompt": "plain ascii words", "return_token_strs": true})).json();
    let strs: Vec<&str> = v["token_strs"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    assert_eq!(strs.len(), ids(&v).len());
    assert_eq!(strs[1..].concat(), "plain ascii words", "after the BOS token the strings spell the prompt");
}

#[test]
fn messages_give_the_chat_completion_prompt() {
    let s = server();
    let body = json!({
        "model": "deepseek-v4-flash",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "list the files"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        ],
        "tools": [{"type": "function", "function": {"name": "ls", "description": "List", "parameters": {"type": "object"}}}],
    });
    let r = s.post("/tokenize", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let got = ids(&r.json());
    let mut req: ChatRequest = serde_json::from_value(body.clone()).unwrap();
    let conv = openai_chat::conversation(&mut req).unwrap();
    let c = codec();
    assert_eq!(got, c.prompt(&conv, usize::MAX).unwrap());
    assert_eq!(got[0], c.bos().unwrap(), "the rendered prompt starts with BOS");
    let text = c.render(&conv).unwrap();
    assert!(text.ends_with("<｜Assistant｜></think>"), "ends where the reply starts: {text}");

    // With thinking on, the prompt differs (it opens a reasoning block), as for /v1/chat/completions.
    let mut thinking = body.clone();
    thinking["reasoning_effort"] = json!("high");
    let t = ids(&s.post("/tokenize", &thinking).json());
    assert_ne!(t, got);
}

#[test]
fn detokenize_round_trips_in_both_shapes() {
    let s = server();
    let toks = ids(&s.post("/tokenize", &json!({"content": TEXT})).json());
    for path in ["/detokenize", "/v1/detokenize"] {
        let r = s.post(path, &json!({"tokens": toks}));
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["content"], json!(TEXT), "llama-server's field");
        assert_eq!(v["prompt"], json!(TEXT), "vLLM's field");
    }
    let r = s.post("/detokenize", &json!({"tokens": []}));
    assert_eq!(r.json()["content"], json!(""));
}

#[test]
fn bad_input_is_a_clear_400() {
    let s = server();
    let vocab = tokenizer().vocab_size();
    let cases = [
        (json!({}), "missing"),
        (json!({"content": "x", "messages": [{"role": "user", "content": "y"}]}), "not both"),
        (json!({"content": "x", "parse_special": false}), "parse_special"),
        (
            json!({"messages": [{"role": "user", "content": "y"}], "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"role": "wizard", "content": "y"}]}), "role"),
        (json!({"content": 5}), "expected a string"),
    ];
    for (body, needle) in cases {
        let r = s.post("/tokenize", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(r.body.contains(needle), "{body}: {}", r.body);
    }
    for (tokens, at) in [(json!([1, vocab]), "tokens[1]"), (json!([-1]), "tokens[0]")] {
        let r = s.post("/detokenize", &json!({"tokens": tokens}));
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains(at), "{}", r.body);
    }
    let r = s.post("/detokenize", &json!({"tokens": "12"}));
    assert_eq!(r.status, 400);
    let r = s.get("/tokenize");
    assert_eq!(r.status, 405);
}
