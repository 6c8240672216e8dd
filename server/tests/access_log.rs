//! The access log: one INFO line per request with method, path, status, token counts and timings — and never the
//! prompt text. (Its own test binary: it installs the process-wide tracing subscriber.)

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::json;

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buf {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// The access lines so far, waiting (bounded) until there are at least `n`.
    fn lines(&self, n: usize) -> Vec<String> {
        let t0 = Instant::now();
        loop {
            let lines: Vec<String> =
                self.text().lines().filter(|l| l.contains("ds4_server::access")).map(str::to_string).collect();
            if lines.len() >= n || t0.elapsed() > Duration::from_secs(10) {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn field(line: &str, name: &str) -> String {
    let at = line.find(&format!(" {name}=")).unwrap_or_else(|| panic!("no {name} in {line}")) + name.len() + 2;
    line[at..].split(' ').next().unwrap().to_string()
}

#[test]
fn one_line_per_request_with_tokens_and_timings_but_no_text() {
    let buf = Buf::default();
    let writer = buf.clone();
    tracing_subscriber::fmt()
        .with_env_filter("ds4_server::access=info")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let server = TestServer::start();
    let secret = "my secret prompt text";
    let r = server.post(
        "/v1/chat/completions?x=1",
        &json!({"messages": [{"role": "user", "content": secret}], "stream": true,
            "stream_options": {"include_usage": true}}),
    );
    let usage = r.event_json().pop().unwrap().1["usage"].clone();
    let lines = buf.lines(1);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let l = &lines[0];
    assert!(l.contains(" INFO "), "{l}");
    assert_eq!(field(l, "method"), "POST");
    assert_eq!(field(l, "path"), "/v1/chat/completions");
    assert_eq!(field(l, "status"), "200");
    assert_eq!(field(l, "prompt_tokens"), usage["prompt_tokens"].to_string());
    assert_eq!(field(l, "output_tokens"), usage["completion_tokens"].to_string());
    assert_eq!(field(l, "cached_tokens"), "0");
    assert_eq!(field(l, "complete"), "true");
    let (ttfb, total): (u64, u64) = (field(l, "ttfb_ms").parse().unwrap(), field(l, "total_ms").parse().unwrap());
    assert!(ttfb <= total, "{l}");
    // The same prompt again: served from the parked session.
    server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": secret}]}));
    let bad = server.post("/v1/messages", &json!({"messages": []}));
    assert_eq!(bad.status, 400);
    server.get("/health");
    let lines = buf.lines(4);
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_ne!(field(&lines[1], "cached_tokens"), "0", "{}", lines[1]);
    assert_eq!(field(&lines[2], "status"), "400");
    assert_eq!(field(&lines[2], "output_tokens"), "0");
    assert_eq!(field(&lines[3], "path"), "/health");
    assert!(!buf.text().contains("secret"), "prompt text in the log");
}
