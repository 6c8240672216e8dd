//! The built-in web page and the status endpoint on the scripted fake model: the page and its assets are served
//! (and turned off by `Limits::webui = false`), `GET /v1/status` counts requests, cached tokens, output tokens,
//! time to first token and cancellations, and never carries prompt text. (The page itself is driven in a real
//! browser by `tests/python/test_webui.py`.)

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{Options, TestServer};
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::Limits;
use serde_json::{json, Value};

#[test]
fn the_page_and_its_assets_are_served_with_a_strict_policy() {
    let server = TestServer::start();
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").unwrap().starts_with("text/html"));
    let csp = page.header("content-security-policy").expect("a CSP");
    assert!(csp.contains("script-src 'self'") && csp.contains("connect-src 'self'"), "{csp}");
    assert_eq!(page.header("x-content-type-options"), Some("nosniff"));
    for (asset, kind) in [("/webui/app.js", "text/javascript"), ("/webui/style.css", "text/css")] {
        assert!(page.body.contains(asset), "the page does not load {asset}");
        let r = server.get(asset);
        assert_eq!(r.status, 200, "{asset}");
        assert!(r.header("content-type").unwrap().starts_with(kind), "{asset}");
        assert!(!r.body.is_empty());
    }
    // The script talks to this server's own endpoints.
    let js = server.get("/webui/app.js").body;
    assert!(js.contains("/v1/chat/completions") && js.contains("/v1/status"));
    assert_eq!(server.get("/webui/missing.js").status, 404);
    assert_eq!(server.get("/webui/../Cargo.toml").status, 404);
}

#[test]
fn no_webui_turns_the_page_off_but_keeps_the_status() {
    let server =
        TestServer::with(Options { limits: Limits { webui: false, ..Limits::default() }, ..Options::default() });
    assert_eq!(server.get("/").status, 404);
    assert_eq!(server.get("/webui/app.js").status, 404);
    let status = server.get("/v1/status");
    assert_eq!(status.status, 200);
    assert_eq!(status.json()["model"], "deepseek-v4-flash");
}

fn status(server: &TestServer) -> Value {
    let r = server.get("/v1/status");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("application/json"));
    r.json()
}

#[test]
fn status_counts_requests_cached_tokens_and_never_shows_prompt_text() {
    let server = TestServer::start();
    let s = status(&server);
    assert_eq!(s["totals"]["requests"], 0);
    assert_eq!(s["recent"], json!([]));
    for tier in ["device", "host", "disk"] {
        assert!(s["kv_bytes"][tier].is_u64() && s["cache_hit_tokens"][tier].is_u64(), "{s}");
    }
    let secret = "zebra-quokka-1234";
    let mut messages = vec![json!({"role": "user", "content": secret})];
    let first = server.post("/v1/chat/completions", &json!({"messages": messages})).json();
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "again"}));
    let second = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "stream": true, "stream_options": {"include_usage": true}}),
        )
        .event_json();
    let usage = second.last().unwrap().1["usage"].clone();
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 0, "the second turn should reuse the first: {usage}");

    let text = server.get("/v1/status").body;
    assert!(!text.contains(secret) && !text.contains("again"), "the status must not carry prompt text: {text}");
    let s: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(s["totals"]["requests"], 2);
    assert_eq!(s["totals"]["cached_tokens"], cached);
    assert_eq!(s["cache_hit_tokens"]["host"], cached);
    assert!(s["sessions"]["parked"].as_u64().unwrap() >= 1, "{s}");
    assert_eq!(s["sessions"]["active"], 0);
    assert_eq!(s["queue"]["waiting"], 0);
    assert!(s["tokens_per_s"]["decode"].as_f64().unwrap() > 0.0, "{s}");
    assert!(s["tokens_per_s"]["prefill"].as_f64().unwrap() > 0.0, "{s}");
    let recent = s["recent"].as_array().unwrap();
    assert_eq!(recent.len(), 2);
    // Newest first: the second turn, with the usage the client saw.
    let (r2, r1) = (&recent[0], &recent[1]);
    assert_eq!(r2["prompt_tokens"], usage["prompt_tokens"]);
    assert_eq!(r2["cached_tokens"], cached);
    assert_eq!(r2["cache_tier"], "host");
    assert_eq!(r2["output_tokens"], usage["completion_tokens"]);
    assert_eq!(r2["outcome"], "stop");
    assert_eq!(r1["prompt_tokens"], first["usage"]["prompt_tokens"]);
    assert_eq!(r1["cached_tokens"], 0);
    assert_eq!(r1["output_tokens"], first["usage"]["completion_tokens"]);
    for r in recent {
        let ttft = r["ttft_ms"].as_f64().unwrap();
        let total = r["total_ms"].as_f64().unwrap();
        assert!(ttft >= 0.0 && ttft <= total && total < 60_000.0, "{r}");
        assert!(r["queue_ms"].as_f64().unwrap() <= ttft, "{r}");
        assert!(r["submitted_unix_ms"].as_u64().unwrap() > 1_600_000_000_000, "{r}");
    }
}

#[test]
fn a_cancelled_stream_shows_up_as_cancelled() {
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
    // While it streams, the status shows one live session.
    assert_eq!(status(&server)["sessions"]["active"], 1);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(30);
    let rec = loop {
        let s = status(&server);
        if let Some(r) = s["recent"].as_array().and_then(|r| r.first()).cloned() {
            break r;
        }
        assert!(Instant::now() < deadline, "the cancelled request never showed up: {s}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(rec["outcome"], "cancelled", "{rec}");
    let out = rec["output_tokens"].as_u64().unwrap();
    // The scripted answer is 901 tokens; the stream was dropped after its first few.
    assert!((1..300).contains(&out), "{rec}");
}
