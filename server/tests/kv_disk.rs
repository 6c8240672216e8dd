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
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Server {
    fn start(kv_dir: Option<&Path>) -> Server {
        Self::start_as(kv_dir, false)
    }

    /// `unprivileged`: when the tests run as root, run the server as `nobody` (through `setpriv`), so file
    /// permissions apply to it (root writes into a mode 0555 directory).
    fn start_as(kv_dir: Option<&Path>, unprivileged: bool) -> Server {
        Self::start_with(kv_dir, unprivileged, &[])
    }

    /// With `extra` flags. Without `kv_dir` the disk tier is off (`--no-kv-disk`: no test writes into the real
    /// cache directory).
    fn start_with(kv_dir: Option<&Path>, unprivileged: bool, extra: &[&str]) -> Server {
        match kv_dir {
            Some(d) => {
                let mut args = vec!["--kv-disk-dir", d.to_str().expect("utf-8 temp path")];
                args.extend_from_slice(extra);
                Self::spawn(unprivileged, &args, &[])
            }
            None => {
                let mut args = vec!["--no-kv-disk"];
                args.extend_from_slice(extra);
                Self::spawn(unprivileged, &args, &[])
            }
        }
    }

    /// With exactly `args` (after the listen address) and `env` set.
    fn spawn(unprivileged: bool, args: &[&str], env: &[(&str, &Path)]) -> Server {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let mut cmd = if unprivileged && root {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_ds4-server")]);
            c
        } else {
            Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        };
        // The random demo model (real tokenizer): the prompts' token counts below are its.
        cmd.args(["--host", "127.0.0.1", "--port", "0", "--drain-timeout-s", "30", "--demo-model", "random"]);
        cmd.args(args);
        // Only what a test sets: the runner's own cache directory is never used.
        cmd.env_remove("XDG_CACHE_HOME");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.env("RUST_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn ds4-server");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[server] {line}");
                log2.lock().unwrap().push(line.clone());
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(rest.trim().to_string());
                    }
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(120)).expect("server did not report its address");
        Server { child, addr, log }
    }

    /// Whether a logged line contains all of `words`.
    fn logged(&self, words: &[&str]) -> bool {
        self.log.lock().unwrap().iter().any(|l| words.iter().all(|w| l.contains(w)))
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
        self.chat_tools(messages, &json!([]))
    }

    fn chat_tools(&self, messages: &[Value], tools: &Value) -> Value {
        let mut req = json!({"model": "deepseek-v4-flash", "messages": messages, "temperature": 0, "max_tokens": 8});
        if tools.as_array().is_some_and(|t| !t.is_empty()) {
            req["tools"] = tools.clone();
        }
        let body = self.request("POST", "/v1/chat/completions", Some(&req));
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }

    /// A thinking-mode chat request generating up to `max_tokens`.
    fn chat_thinking(&self, messages: &[Value], max_tokens: u32) -> Value {
        let req = json!({"model": "deepseek-v4-flash", "messages": messages, "temperature": 0,
            "max_tokens": max_tokens, "reasoning_effort": "high"});
        let body = self.request("POST", "/v1/chat/completions", Some(&req));
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }

    fn metric(&self, name: &str) -> f64 {
        let text = self.request("GET", "/metrics", None);
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    /// The sum of every series of `name` (all label sets).
    fn metric_sum(&self, name: &str) -> f64 {
        let text = self.request("GET", "/metrics", None);
        let values: Vec<f64> = text
            .lines()
            .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' ')))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        assert!(!values.is_empty(), "metric {name} missing in\n{text}");
        values.iter().sum()
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
    assert_eq!(b.metric_sum("ds4_kv_disk_errors_total"), 0.0);
    b.stop();

    let c = Server::start(None);
    let r3 = c.chat(&messages);
    assert_eq!(usage_u64(&r3, &["prompt_tokens_details", "cached_tokens"]), 0);
    assert_eq!(r2["choices"][0]["message"], r3["choices"][0]["message"], "cached and uncached outputs differ");
    c.stop();
}

/// The disk tier is on by default, under `$XDG_CACHE_HOME/ds4/kv` (else `$HOME/.cache/ds4/kv`): a server started
/// with no cache flag at all keeps a conversation's prefix across a restart.
#[cfg(unix)]
#[test]
fn default_flags_keep_the_prefix_across_a_restart() {
    const SPAN: u64 = 256;
    let tmp = tempfile::tempdir().unwrap();
    let (home, xdg) = (tmp.path().join("home"), tmp.path().join("xdg"));
    std::fs::create_dir_all(&home).unwrap();
    let env = [("HOME", home.as_path()), ("XDG_CACHE_HOME", xdg.as_path())];
    let mut messages = vec![
        json!({"role": "system", "content": long_text(3, 300)}),
        json!({"role": "user", "content": long_text(4, 200)}),
    ];
    let a = Server::spawn(false, &[], &env);
    let r1 = a.chat(&messages);
    let p1 = usage_u64(&r1, &["prompt_tokens"]);
    let answer = r1["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
    a.stop();
    let kv = xdg.join("ds4").join("kv");
    assert!(files(&kv, "page") >= 1 && files(&kv, "ckpt") >= 1, "nothing saved under {}", kv.display());
    assert!(!home.join(".cache").exists(), "XDG_CACHE_HOME set, yet the cache went under HOME");

    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "and then?"}));
    let b = Server::spawn(false, &[], &env);
    let r2 = b.chat(&messages);
    let cached = usage_u64(&r2, &["prompt_tokens_details", "cached_tokens"]);
    assert!(cached + SPAN >= p1, "cached {cached} < history {p1} minus a page");
    assert_eq!(b.metric_sum("ds4_kv_disk_errors_total"), 0.0);
    b.stop();

    // Without XDG_CACHE_HOME (the harness clears it) the cache is under HOME; `--no-kv-disk` writes nothing.
    let c = Server::spawn(false, &[], &[("HOME", home.as_path())]);
    c.chat(&messages[..2]);
    c.stop();
    assert!(files(&home.join(".cache/ds4/kv"), "ckpt") >= 1, "nothing saved under HOME/.cache/ds4/kv");
    let off = tmp.path().join("off");
    std::fs::create_dir_all(&off).unwrap();
    let d = Server::spawn(false, &["--no-kv-disk"], &[("HOME", off.as_path()), ("XDG_CACHE_HOME", off.as_path())]);
    d.chat(&messages[..2]);
    d.stop();
    assert_eq!(std::fs::read_dir(&off).unwrap().count(), 0, "--no-kv-disk wrote into the cache directory");
}

/// An agent's next turn re-renders what the model generated (its reasoning dropped), so it diverges right after the
/// previous prompt — more than a page before the end of the saved session when the answer was long. The copy of the
/// prompt's state the scheduler parks (`checkpoint_prompt`) is saved at shutdown with its restore point, so after a
/// restart the next turn still reuses the previous prompt minus less than a page, and generates what an uncached
/// server generates.
#[cfg(unix)]
#[test]
fn a_turn_after_a_long_generation_reuses_the_previous_prompt_after_a_restart() {
    const SPAN: u64 = 256;
    let dir = tempfile::tempdir().unwrap();
    let mut messages = vec![
        json!({"role": "system", "content": long_text(6, 150)}),
        json!({"role": "user", "content": long_text(7, 220)}),
    ];
    let a = Server::start(Some(dir.path()));
    let r1 = a.chat_thinking(&messages, 300);
    let (p1, c1) = (usage_u64(&r1, &["prompt_tokens"]), usage_u64(&r1, &["completion_tokens"]));
    assert!(p1 > SPAN && p1 < 512, "a prompt past a page and below the cold save threshold, got {p1}");
    assert!(c1 > SPAN, "the answer should outrun a page, got {c1} tokens");
    a.stop();

    let answer = r1["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "and then?"}));
    let b = Server::start(Some(dir.path()));
    let r2 = b.chat_thinking(&messages, 4);
    let cached = usage_u64(&r2, &["prompt_tokens_details", "cached_tokens"]);
    eprintln!("turn 1: {p1} prompt + {c1} generated tokens; turn 2: {cached} cached");
    assert!(cached + SPAN > p1 && cached <= p1, "cached {cached}, previous prompt {p1}");
    b.stop();

    let c = Server::start(None);
    let r3 = c.chat_thinking(&messages, 4);
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
    assert!(s.metric_sum("ds4_kv_disk_errors_total") >= 1.0, "the disk failure is not visible in /metrics");
    s.stop();
}

#[cfg(unix)]
#[test]
fn an_unusable_cache_dir_is_reported_as_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let s = Server::start(Some(&file));
    let r = s.chat(&[json!({"role": "user", "content": long_text(5, 30)})]);
    assert!(usage_u64(&r, &["completion_tokens"]) >= 1);
    assert!(s.logged(&["ERROR", "--kv-disk-dir cannot be used"]), "no ERROR line saying why the cache is off");
    assert!(s.metric("ds4_kv_disk_errors_total{kind=\"write\"}") >= 1.0);
    s.stop();
}

#[cfg(unix)]
#[test]
fn a_read_only_cache_dir_is_still_restored_from() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().join("kv");
    let mut messages = vec![
        json!({"role": "system", "content": long_text(6, 300)}),
        json!({"role": "user", "content": long_text(7, 200)}),
    ];
    let a = Server::start(Some(&dir));
    let r1 = a.chat(&messages);
    let p1 = usage_u64(&r1, &["prompt_tokens"]);
    let answer = r1["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
    a.stop();
    let saved = files(&dir, "page") + files(&dir, "ckpt");
    assert!(saved >= 2, "nothing saved");
    for e in std::fs::read_dir(&dir).unwrap() {
        std::fs::set_permissions(e.unwrap().path(), std::fs::Permissions::from_mode(0o444)).unwrap();
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();

    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "and then?"}));
    let b = Server::start_as(Some(&dir), true);
    let r2 = b.chat(&messages);
    let cached = usage_u64(&r2, &["prompt_tokens_details", "cached_tokens"]);
    assert!(cached + 256 >= p1, "restored only {cached} of {p1} tokens from the read-only cache");
    assert!(b.logged(&["WARN", "read-only"]), "no WARN line about the read-only cache");
    assert_eq!(b.metric_sum("ds4_kv_disk_errors_total"), 0.0);
    b.stop();
    assert_eq!(files(&dir, "page") + files(&dir, "ckpt"), saved, "the read-only cache was written to");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Overwrites `n` bytes at `at` (from the end when negative) of every file with extension `ext`.
fn damage(dir: &Path, ext: &str, at: i64, n: usize) {
    let paths: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    assert!(!paths.is_empty(), "no .{ext} file to damage");
    for path in paths {
        let mut bytes = std::fs::read(&path).unwrap();
        let start = if at < 0 { bytes.len() - at.unsigned_abs() as usize } else { at as usize };
        for b in &mut bytes[start..start + n] {
            *b ^= 0x5a;
        }
        std::fs::write(&path, bytes).unwrap();
    }
}

#[test]
fn corrupt_cache_files_are_counted_by_kind() {
    let messages = vec![
        json!({"role": "system", "content": long_text(8, 300)}),
        json!({"role": "user", "content": long_text(9, 200)}),
    ];
    // A damaged header: removed when the cache is opened.
    let dir = tempfile::tempdir().unwrap();
    let a = Server::start(Some(dir.path()));
    a.chat(&messages);
    a.stop();
    damage(dir.path(), "page", 0, 8);
    let b = Server::start(Some(dir.path()));
    assert!(b.metric("ds4_kv_disk_errors_total{kind=\"corrupt_at_open\"}") >= 1.0);
    b.stop();

    // A damaged payload: found by its checksum while restoring, removed, and the prompt is prefilled instead.
    let dir = tempfile::tempdir().unwrap();
    let a = Server::start(Some(dir.path()));
    a.chat(&messages);
    a.stop();
    damage(dir.path(), "ckpt", -16, 8);
    let b = Server::start(Some(dir.path()));
    assert_eq!(b.metric("ds4_kv_disk_errors_total{kind=\"corrupt_at_open\"}"), 0.0);
    let r = b.chat(&messages);
    assert!(usage_u64(&r, &["completion_tokens"]) >= 1);
    assert!(b.metric("ds4_kv_disk_errors_total{kind=\"checksum\"}") >= 1.0);
    b.stop();
}

#[cfg(unix)]
#[test]
fn a_prompt_diverging_inside_a_parked_session_reuses_the_common_prefix_from_ram() {
    // Turn 1, then the same conversation with its last user message edited near the end (as when a client
    // re-renders a tail or the user edits a message): the parked session is rolled back to the common prefix.
    let system = json!({"role": "system", "content": long_text(11, 300)});
    let user = long_text(12, 200);
    let first = vec![system.clone(), json!({"role": "user", "content": user.clone()})];
    let edited = vec![system, json!({"role": "user", "content": format!("{user} orbit quiet")})];
    let s = Server::start(None);
    let r1 = s.chat(&first);
    let p1 = usage_u64(&r1, &["prompt_tokens"]);
    assert_eq!(usage_u64(&r1, &["prompt_tokens_details", "cached_tokens"]), 0);
    let r2 = s.chat(&edited);
    let p2 = usage_u64(&r2, &["prompt_tokens"]);
    let cached = usage_u64(&r2, &["prompt_tokens_details", "cached_tokens"]);
    eprintln!("turn 1: {p1} prompt tokens; edited: {p2} prompt tokens, {cached} cached");
    // The edit touches the last few tokens of the user message (and the template's closing tokens).
    assert!(cached + 16 >= p1 && cached < p2, "cached {cached} of {p2} (first prompt {p1})");
    assert_eq!(s.metric("ds4_prefix_cache_hits_total{tier=\"host\"}"), 1.0);
    assert_eq!(s.metric("ds4_prefix_cache_recomputed_tokens_total"), (p1 + p2 - cached) as f64);
    s.stop();

    let c = Server::start(None);
    let r3 = c.chat(&edited);
    assert_eq!(usage_u64(&r3, &["prompt_tokens_details", "cached_tokens"]), 0);
    assert_eq!(r2["choices"][0]["message"], r3["choices"][0]["message"], "rolled-back and cold outputs differ");
    c.stop();
}

#[cfg(unix)]
#[test]
fn a_new_conversation_of_the_same_agent_restores_the_system_block_after_a_restart() {
    const SPAN: u64 = 256; // the server's page size (tokens)
    let system = json!({"role": "system", "content": long_text(13, 420)});
    let tools = json!([{"type": "function", "function": {"name": "read_file", "description": long_text(14, 60),
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]);
    // Conversation A's first user message is long, so its cold and shutdown checkpoints (and their restore
    // points) all lie more than a page past the system block: only the system-block save can serve B.
    let a_msgs = [system.clone(), json!({"role": "user", "content": long_text(15, 450)})];
    let b_msgs = [system.clone(), json!({"role": "user", "content": "what does main.rs do?"})];
    let run = |min_tokens: &str| -> (u64, u64, Value) {
        let dir = tempfile::tempdir().unwrap();
        let flags = ["--kv-system-block-min-tokens", min_tokens];
        let a = Server::start_with(Some(dir.path()), false, &flags);
        let ra = a.chat_tools(&a_msgs, &tools);
        a.stop();
        let b = Server::start_with(Some(dir.path()), false, &flags);
        let rb = b.chat_tools(&b_msgs, &tools);
        let cached = usage_u64(&rb, &["prompt_tokens_details", "cached_tokens"]);
        if cached > 0 {
            assert!(b.metric("ds4_prefix_cache_hit_tokens_total{tier=\"disk\"}") >= cached as f64);
        }
        assert_eq!(b.metric_sum("ds4_kv_disk_errors_total"), 0.0);
        b.stop();
        (usage_u64(&ra, &["prompt_tokens"]), cached, rb)
    };
    let (pa, cached, rb) = run("256");
    let pb = usage_u64(&rb, &["prompt_tokens"]);
    // B's prompt is the block plus a few tokens: `<｜User｜>`, the short question, the assistant opening.
    let block = pb.saturating_sub(16);
    eprintln!("A: {pa} prompt tokens; B: {pb} prompt tokens (block ≈ {block}), {cached} restored from disk");
    // A's restore points lie at the page boundary below its saved positions (≥ pa − SPAN): past B's prefix.
    assert!(block >= 2 * SPAN && pa >= block + SPAN + 16, "the test's shapes are off: A {pa}, B {pb}");
    assert!(cached + SPAN >= block && cached < pb, "B restored {cached} tokens of a {block}-token system block");
    // The same with the trigger off: nothing of A's saved state lies inside the block.
    let (_, cached_off, rb_off) = run("0");
    assert!(cached_off + SPAN < block, "without the system-block save B restored {cached_off}");
    assert_eq!(rb["choices"][0]["message"], rb_off["choices"][0]["message"], "restored and prefilled outputs differ");
}
