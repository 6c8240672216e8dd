//! The disk KV tier end to end with the real `ds4-server` binary on the built-in demo model (loopback, ephemeral
//! port): a conversation survives a SIGTERM restart through `--kv-disk-dir` (the next turn reports the restored
//! prefix in `cached_tokens` and generates exactly what a server without the cache generates at temperature 0), and
//! two conversations sharing a long system prompt store its pages once.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(kv_dir: Option<&Path>) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ds4-server"));
        cmd.args(["--host", "127.0.0.1", "--port", "0", "--drain-timeout-s", "30"]);
        if let Some(d) = kv_dir {
            cmd.arg("--kv-disk-dir").arg(d);
        }
        cmd.env("RUST_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn ds4-server");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[server] {line}");
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(rest.trim().to_string());
                    }
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(120)).expect("server did not report its address");
        Server { child, addr }
    }

    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> String {
        let mut s = TcpStream::connect(&self.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let (head, rest) = out.split_once("\r\n\r\n").expect("http response");
        assert!(head.starts_with("HTTP/1.1 200"), "{method} {path}: {head}\n{rest}");
        rest.to_string()
    }

    fn chat(&self, messages: &[Value]) -> Value {
        let req = json!({"model": "deepseek-v4-flash", "messages": messages, "temperature": 0, "max_tokens": 8});
        let body = self.request("POST", "/v1/chat/completions", Some(&req));
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }

    fn metric(&self, name: &str) -> f64 {
        let text = self.request("GET", "/metrics", None);
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    /// SIGTERM, then wait for a clean exit.
    fn stop(mut self) {
        let st = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(st.success());
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "server exit status {st}");
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn long_text(seed: usize, words: usize) -> String {
    const W: [&str; 12] =
        ["alpha", "river", "stone", "quiet", "lamp", "north", "garden", "copper", "signal", "winter", "paper", "orbit"];
    (0..words).map(|i| W[(i * 7 + seed * 5 + i / 3) % W.len()]).collect::<Vec<_>>().join(" ")
}

fn usage_u64(r: &Value, path: &[&str]) -> u64 {
    let mut v = &r["usage"];
    for p in path {
        v = &v[p];
    }
    v.as_u64().unwrap_or_else(|| panic!("usage {path:?} missing in {r}"))
}

fn files(dir: &Path, ext: &str) -> usize {
    std::fs::read_dir(dir).unwrap().filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == ext)).count()
}

#[cfg(unix)]
#[test]
fn conversation_survives_a_restart_through_the_disk_tier() {
    const SPAN: u64 = 256; // the server's page size (tokens)
    let dir = tempfile::tempdir().unwrap();
    let mut messages = vec![
        json!({"role": "system", "content": long_text(1, 300)}),
        json!({"role": "user", "content": long_text(2, 200)}),
    ];
    let a = Server::start(Some(dir.path()));
    let r1 = a.chat(&messages);
    let p1 = usage_u64(&r1, &["prompt_tokens"]);
    assert!(p1 >= 400, "the conversation should be several hundred tokens, got {p1}");
    let answer = r1["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
    a.stop();
    assert!(files(dir.path(), "page") >= 1 && files(dir.path(), "ckpt") >= 1, "nothing saved at shutdown");

    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "and then?"}));
    let b = Server::start(Some(dir.path()));
    let r2 = b.chat(&messages);
    let cached = usage_u64(&r2, &["prompt_tokens_details", "cached_tokens"]);
    let p2 = usage_u64(&r2, &["prompt_tokens"]);
    eprintln!("turn 1: {p1} prompt tokens; turn 2: {p2} prompt tokens, {cached} cached");
    assert!(cached + SPAN >= p1, "cached {cached} < history {p1} minus a page");
    assert!(cached < p2);
    assert!(b.metric("ds4_prefix_cache_hit_tokens_total{tier=\"disk\"}") >= cached as f64);
    assert_eq!(b.metric("ds4_kv_disk_errors_total"), 0.0);
    b.stop();

    let c = Server::start(None);
    let r3 = c.chat(&messages);
    assert_eq!(usage_u64(&r3, &["prompt_tokens_details", "cached_tokens"]), 0);
    assert_eq!(r2["choices"][0]["message"], r3["choices"][0]["message"], "cached and uncached outputs differ");
    c.stop();
}

#[cfg(unix)]
#[test]
fn a_shared_system_prompt_is_stored_once() {
    let system = json!({"role": "system", "content": long_text(3, 700)});
    let conv = |i: usize| vec![system.clone(), json!({"role": "user", "content": long_text(10 + i, 40)})];
    let run = |convs: &[usize]| -> usize {
        let dir = tempfile::tempdir().unwrap();
        let s = Server::start(Some(dir.path()));
        for &i in convs {
            s.chat(&conv(i));
        }
        s.stop();
        files(dir.path(), "page")
    };
    let (only_a, only_b, both) = (run(&[0]), run(&[1]), run(&[0, 1]));
    eprintln!("pages: a {only_a}, b {only_b}, a+b {both}");
    assert!(only_a >= 2 && only_b >= 2, "the system prompt should span pages");
    // The shared system prompt's pages are written once: the union saves them a second time for nobody.
    let shared = (only_a + only_b).saturating_sub(both);
    assert!(shared >= 2, "shared pages were stored twice ({both} pages for a+b; a {only_a}, b {only_b})");
}

#[cfg(unix)]
#[test]
fn an_unusable_cache_dir_turns_caching_off_and_serving_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let not_a_dir = tmp.path().join("file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    let s = Server::start(Some(&not_a_dir.join("kv")));
    let r = s.chat(&[json!({"role": "user", "content": long_text(4, 30)})]);
    assert!(usage_u64(&r, &["completion_tokens"]) >= 1);
    assert!(s.metric("ds4_kv_disk_errors_total") >= 1.0, "the disk failure is not visible in /metrics");
    s.stop();
}
