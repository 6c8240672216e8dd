//! The shared KV tier on Redis (`--kv-remote`) end to end: real `ds4-server` replicas on the built-in demo model, a
//! real `redis-server` (Debian package) and, for the load-balancer set-up, a real `nginx` (Debian `nginx-light`),
//! all on loopback ports in temp dirs.
//!
//! * replica B restores a prefix replica A computed (separate disk dirs; B also with `--no-kv-disk`), output
//!   identical to a cold server;
//! * a corrupted blob in Redis is a counted miss (`kind="integrity"`), the answer is still right;
//! * Redis killed mid-run: every request still succeeds, one WARN line, and the tier comes back with Redis;
//! * two replicas behind nginx (round robin): a conversation whose turns alternate replicas keeps its prefix cached,
//!   and 32 concurrent clients get no error.
//!
//! Without `redis-server` / `nginx` the tests say so and pass, except under `CI=true`, where they fail.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const SPAN: u64 = 256; // the server's page size (tokens)
const REDIS: &str = "/usr/bin/redis-server";
const NGINX: &str = "/usr/sbin/nginx";

/// Whether `bin` is there; under `CI=true` its absence fails the test.
fn have(bin: &str, package: &str) -> bool {
    if Path::new(bin).exists() {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{bin} is missing (apt-get install {package}; scripts/test.sh installs it)");
    }
    eprintln!("SKIPPED: {bin} is missing (apt-get install {package})");
    false
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn wait_for_port(port: u16, what: &str) {
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(30), "{what} did not open port {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `redis-server` on a loopback port, nothing persisted.
struct Redis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Redis {
        Self::start_on(free_port())
    }

    fn start_on(port: u16) -> Redis {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new(REDIS)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        wait_for_port(port, "redis-server");
        Redis { child, port, _dir: dir }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().unwrap()
    }

    /// Keys matching `pattern`.
    fn keys(&self, pattern: &str) -> Vec<String> {
        redis::cmd("KEYS").arg(pattern).query(&mut self.conn()).unwrap()
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `ds4-server` process on the demo model.
struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// With `args` after the listen address (no flag for the disk tier: pass `--kv-disk-dir` or `--no-kv-disk`).
    fn start(args: &[&str]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ds4-server"));
        cmd.args(["--host", "127.0.0.1", "--port", "0", "--drain-timeout-s", "30", "--demo-model", "random"])
            .args(args);
        cmd.env_remove("XDG_CACHE_HOME");
        cmd.env("RUST_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn ds4-server");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
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

    /// With a disk tier in `dir` (or none) and the Redis tier at `url`.
    fn replica(dir: Option<&Path>, url: &str, extra: &[&str]) -> Server {
        let mut args = vec!["--kv-remote", url];
        let d;
        match dir {
            Some(p) => {
                d = p.to_str().unwrap().to_string();
                args.extend(["--kv-disk-dir", &d]);
            }
            None => args.push("--no-kv-disk"),
        }
        args.extend_from_slice(extra);
        Server::start(&args)
    }

    fn port(&self) -> u16 {
        self.addr.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Logged lines containing all of `words`.
    fn logged(&self, words: &[&str]) -> usize {
        self.log.lock().unwrap().iter().filter(|l| words.iter().all(|w| l.contains(w))).count()
    }

    fn chat(&self, messages: &[Value]) -> Value {
        chat_at(&self.addr, messages).unwrap_or_else(|e| panic!("{e}"))
    }

    fn metrics(&self) -> String {
        let (status, body) = http(&self.addr, "GET", "/metrics", None).unwrap();
        assert_eq!(status, 200, "{body}");
        body
    }

    /// The sum of every series of `name` whose line contains `filter`.
    fn metric(&self, name: &str, filter: &str) -> f64 {
        let text = self.metrics();
        let values: Vec<f64> = text
            .lines()
            .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' ')))
            .filter(|l| l.contains(filter))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        assert!(!values.is_empty(), "metric {name} {filter} missing in\n{text}");
        values.iter().sum()
    }

    /// Waits until `name` reaches `at_least`.
    fn wait_metric(&self, name: &str, filter: &str, at_least: f64) {
        let t0 = Instant::now();
        while self.metric(name, filter) < at_least {
            assert!(t0.elapsed() < Duration::from_secs(60), "{name}{filter} stayed below {at_least}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

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

/// One HTTP/1.1 request on a fresh connection: `(status, body)` (chunked bodies decoded).
fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").ok_or_else(|| format!("not an HTTP response: {text:?}"))?;
    let status: u16 = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| head.to_string())?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if !chunked {
        return Ok((status, rest.to_string()));
    }
    let mut out = String::new();
    let mut r = rest;
    loop {
        let (size, tail) = r.split_once("\r\n").ok_or("bad chunk")?;
        let n = usize::from_str_radix(size.trim(), 16).map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok((status, out));
        }
        out.push_str(&tail[..n]);
        r = &tail[n + 2..];
    }
}

fn chat_at(addr: &str, messages: &[Value]) -> Result<Value, String> {
    let req = json!({"model": "deepseek-v4-flash", "messages": messages, "temperature": 0, "max_tokens": 8});
    let (status, body) = http(addr, "POST", "/v1/chat/completions", Some(&req))?;
    if status != 200 {
        return Err(format!("status {status}: {body}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))
}

fn long_text(seed: usize, words: usize) -> String {
    const W: [&str; 12] = [
        "amber", "harbor", "pebble", "violet", "candle", "south", "meadow", "bronze", "beacon", "autumn", "ink",
        "comet",
    ];
    (0..words).map(|i| W[(i * 5 + seed * 7 + i / 4) % W.len()]).collect::<Vec<_>>().join(" ")
}

fn usage(r: &Value, path: &[&str]) -> u64 {
    let mut v = &r["usage"];
    for p in path {
        v = &v[p];
    }
    v.as_u64().unwrap_or_else(|| panic!("usage {path:?} missing in {r}"))
}

fn cached(r: &Value) -> u64 {
    usage(r, &["prompt_tokens_details", "cached_tokens"])
}

fn answer(r: &Value) -> String {
    r["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string()
}

/// A first turn long enough to be saved right after its prefill (the cold trigger: 512 tokens).
fn first_turn(seed: usize) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": long_text(seed, 420)}),
        json!({"role": "user", "content": long_text(seed + 1, 260)}),
    ]
}

fn next_turn(mut messages: Vec<Value>, reply: &Value, user: &str) -> Vec<Value> {
    messages.push(json!({"role": "assistant", "content": answer(reply)}));
    messages.push(json!({"role": "user", "content": user}));
    messages
}

/// What a server with no cache at all answers.
fn cold(messages: &[Value]) -> Value {
    let c = Server::start(&["--no-kv-disk"]);
    let r = c.chat(messages);
    assert_eq!(cached(&r), 0);
    c.stop();
    r
}

#[test]
fn replica_b_restores_the_prefix_replica_a_computed() {
    if !have(REDIS, "redis-server") {
        return;
    }
    let redis = Redis::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Server::replica(Some(da.path()), &redis.url(), &[]);
    let turn1 = first_turn(1);
    let r1 = a.chat(&turn1);
    let p1 = usage(&r1, &["prompt_tokens"]);
    assert!(p1 >= 600, "the first turn should be well past the cold-save threshold, got {p1} tokens");
    // The save is written behind the request: wait for its pages and checkpoint.
    a.wait_metric("ds4_kv_remote_writes_total", "", (p1 / SPAN + 1) as f64);
    assert!(!redis.keys("ds4:kv:*:p:*").is_empty() && !redis.keys("ds4:kv:*:i:*").is_empty());

    let turn2 = next_turn(turn1, &r1, "and then?");
    // B has its own (empty) disk dir; C has no disk tier at all (its local tier is in memory).
    let b = Server::replica(Some(db.path()), &redis.url(), &[]);
    let c = Server::replica(None, &redis.url(), &[]);
    let want = cold(&turn2);
    for (name, s) in [("B", &b), ("C", &c)] {
        let r2 = s.chat(&turn2);
        let n = cached(&r2);
        eprintln!(
            "replica {name}: turn 2 of {} prompt tokens, {n} cached (turn 1: {p1})",
            usage(&r2, &["prompt_tokens"])
        );
        assert!(n + SPAN >= p1 && n <= p1, "replica {name} restored {n} tokens of a {p1}-token prefix");
        assert_eq!(s.metric("ds4_kv_remote_hits_total", ""), 1.0);
        assert_eq!(s.metric("ds4_kv_remote_hit_tokens_total", ""), n as f64);
        assert_eq!(s.metric("ds4_kv_remote_errors_total", ""), 0.0);
        assert!(s.metric("ds4_prefix_cache_hit_tokens_total", "tier=\"disk\"") >= n as f64);
        assert_eq!(r2["choices"][0]["message"], want["choices"][0]["message"], "replica {name} vs a cold run");
    }
    assert_eq!(a.metric("ds4_kv_remote_errors_total", ""), 0.0);
    assert_eq!(a.metric("ds4_kv_remote_dropped_writes_total", ""), 0.0);
    // A model of another identity would use other keys: every key names this model's namespace.
    let ns: std::collections::HashSet<String> =
        redis.keys("ds4:kv:*").iter().map(|k| k.split(':').take(4).collect::<Vec<_>>().join(":")).collect();
    assert_eq!(ns.len(), 1, "{ns:?}");
    for s in [a, b, c] {
        s.stop();
    }
}

#[test]
fn a_corrupted_blob_in_redis_is_a_counted_miss_and_the_answer_stays_right() {
    if !have(REDIS, "redis-server") {
        return;
    }
    let redis = Redis::start();
    let da = tempfile::tempdir().unwrap();
    let a = Server::replica(Some(da.path()), &redis.url(), &[]);
    let turn1 = first_turn(3);
    let r1 = a.chat(&turn1);
    let p1 = usage(&r1, &["prompt_tokens"]);
    a.wait_metric("ds4_kv_remote_writes_total", "", (p1 / SPAN + 1) as f64);
    a.stop();
    // Damage every checkpoint: a few bytes in the middle of its payload, and one of them cut short.
    let mut conn = redis.conn();
    let ckpts = redis.keys("ds4:kv:*:c:*");
    assert!(!ckpts.is_empty());
    for (i, k) in ckpts.iter().enumerate() {
        let len: usize = redis::cmd("STRLEN").arg(k).query(&mut conn).unwrap();
        if i == 0 {
            let head: Vec<u8> = redis::cmd("GETRANGE").arg(k).arg(0).arg(len as i64 / 2).query(&mut conn).unwrap();
            let _: () = redis::cmd("SET").arg(k).arg(head).query(&mut conn).unwrap();
        } else {
            let _: () =
                redis::cmd("SETRANGE").arg(k).arg(len / 2).arg("\u{1}\u{2}\u{3}\u{4}").query(&mut conn).unwrap();
        }
    }

    let turn2 = next_turn(turn1, &r1, "and then?");
    let want = cold(&turn2);
    let b = Server::replica(None, &redis.url(), &[]);
    let r2 = b.chat(&turn2);
    assert_eq!(cached(&r2), 0, "a corrupt restore point was used");
    assert_eq!(r2["choices"][0]["message"], want["choices"][0]["message"]);
    assert!(b.metric("ds4_kv_remote_errors_total", "kind=\"integrity\"") >= 1.0);
    assert_eq!(b.metric("ds4_kv_remote_hits_total", ""), 0.0);
    assert!(b.metric("ds4_kv_remote_misses_total", "") >= 1.0);
    // The bad blob is gone from Redis, so it is recomputed and saved again rather than failing every replica.
    let left = redis.keys("ds4:kv:*:c:*");
    assert!(left.len() < ckpts.len() || left.iter().any(|k| !ckpts.contains(k)), "{left:?}");
    // B prefilled turn 2 and saved it (cold): a third replica now restores that from Redis, with the same output.
    b.wait_metric("ds4_kv_remote_writes_total", "", 2.0);
    let c = Server::replica(None, &redis.url(), &[]);
    let r3 = c.chat(&turn2);
    assert!(cached(&r3) + SPAN >= p1, "the recomputed prefix was not shared: {}", r3["usage"]);
    assert_eq!(c.metric("ds4_kv_remote_hits_total", ""), 1.0);
    assert_eq!(c.metric("ds4_kv_remote_errors_total", ""), 0.0);
    assert_eq!(r3["choices"][0]["message"], want["choices"][0]["message"]);
    b.stop();
    c.stop();
}

#[test]
fn a_stalled_redis_costs_a_bounded_wait_and_one_warning() {
    if !have(REDIS, "redis-server") {
        return;
    }
    let redis = Redis::start();
    let d = tempfile::tempdir().unwrap();
    let s = Server::replica(Some(d.path()), &redis.url(), &["--kv-remote-timeout-ms", "300"]);
    s.chat(&first_turn(50));
    s.wait_metric("ds4_kv_remote_writes_total", "", 1.0);
    // Frozen (SIGSTOP): connections hang instead of failing; every request still finishes, in bounded time.
    let pid = redis.child.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let t0 = Instant::now();
    for i in 0..3 {
        let r = s.chat(&first_turn(52 + 2 * i));
        assert!(usage(&r, &["completion_tokens"]) >= 1);
    }
    let took = t0.elapsed();
    assert!(Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    assert!(s.metric("ds4_kv_remote_errors_total", "kind=\"timeout\"") >= 1.0);
    assert_eq!(s.logged(&["WARN", "Redis KV tier unavailable"]), 1);
    eprintln!("3 requests against a frozen Redis took {took:?}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    s.stop();
}

#[test]
fn redis_killed_mid_run_loses_no_request_and_warns_once() {
    if !have(REDIS, "redis-server") {
        return;
    }
    let redis = Redis::start();
    let port = redis.port;
    let url = redis.url();
    let d = tempfile::tempdir().unwrap();
    let s = Server::replica(Some(d.path()), &url, &["--kv-remote-timeout-ms", "500"]);
    let r = s.chat(&first_turn(5));
    s.wait_metric("ds4_kv_remote_writes_total", "", 1.0);
    assert_eq!(s.metric("ds4_kv_remote_up", ""), 1.0);
    redis.kill();
    // Prompts long enough to be looked up and saved (both paths meet the dead socket).
    for i in 0..4 {
        let r = s.chat(&first_turn(10 + 2 * i));
        assert!(usage(&r, &["completion_tokens"]) >= 1);
    }
    let r2 = s.chat(&next_turn(first_turn(5), &r, "more?"));
    assert!(cached(&r2) > 0, "the local tiers still serve prefixes");
    let warned = s.logged(&["WARN", "Redis KV tier unavailable"]);
    assert_eq!(warned, 1, "expected one warning for the outage");
    assert_eq!(s.metric("ds4_kv_remote_up", ""), 0.0);
    assert!(s.metric("ds4_kv_remote_errors_total", "kind=\"connection\"") >= 1.0);

    // Redis back on the same port: after the retry interval the tier writes again.
    let redis = Redis::start_on(port);
    std::thread::sleep(Duration::from_millis(3200));
    let before = s.metric("ds4_kv_remote_writes_total", "");
    s.chat(&first_turn(30));
    s.wait_metric("ds4_kv_remote_writes_total", "", before + 1.0);
    assert_eq!(s.metric("ds4_kv_remote_up", ""), 1.0);
    assert!(!redis.keys("ds4:kv:*").is_empty());
    assert_eq!(s.logged(&["WARN", "Redis KV tier unavailable"]), 1);
    s.stop();
}

#[test]
fn a_bad_kv_remote_url_is_a_clear_error() {
    let help = Command::new(env!("CARGO_BIN_EXE_ds4-server")).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--kv-remote <URL>") && help.contains("redis://HOST:PORT/DB"), "{help}");
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        .args(["--no-kv-disk", "--port", "0", "--kv-remote", "http://example.com/"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--kv-remote"), "{err}");
}

/// nginx in front of `backends`, round robin, on a free port.
struct Nginx {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Nginx {
    fn start(backends: &[u16]) -> Nginx {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let p = dir.path().display();
        let servers: String = backends.iter().map(|b| format!("    server 127.0.0.1:{b} max_fails=0;\n")).collect();
        // SAFETY: geteuid has no preconditions and cannot fail.
        let user = if unsafe { libc::geteuid() } == 0 { "user root;\n" } else { "" };
        let conf = format!(
            "{user}worker_processes 1;\ndaemon off;\npid {p}/nginx.pid;\nerror_log {p}/error.log warn;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n\
               fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
               upstream ds4 {{\n{servers}    keepalive 32;\n  }}\n\
               server {{\n    listen 127.0.0.1:{port};\n    client_max_body_size 32m;\n\
                 location / {{\n      proxy_pass http://ds4;\n      proxy_http_version 1.1;\n\
                   proxy_set_header Connection \"\";\n      proxy_set_header Host $host;\n\
                   proxy_buffering off;\n      proxy_read_timeout 600s;\n    }}\n  }}\n}}\n"
        );
        let conf_path = dir.path().join("nginx.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let child = Command::new(NGINX)
            .arg("-p")
            .arg(dir.path())
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .arg("-c")
            .arg(&conf_path)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn nginx");
        wait_for_port(port, "nginx");
        Nginx { child, port, _dir: dir }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn two_replicas_behind_nginx_round_robin_share_prefixes_and_serve_32_clients() {
    if !have(REDIS, "redis-server") || !have(NGINX, "nginx-light") {
        return;
    }
    let redis = Redis::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Server::replica(Some(da.path()), &redis.url(), &[]);
    let b = Server::replica(Some(db.path()), &redis.url(), &[]);
    let lb = Nginx::start(&[a.port(), b.port()]);
    let addr = lb.addr();
    let writes = |s: &Server| s.metric("ds4_kv_remote_writes_total", "");

    // Turn 1 lands on one replica; its save reaches Redis; turn 2 lands on the other (plain round robin).
    let turn1 = first_turn(40);
    let r1 = chat_at(&addr, &turn1).unwrap();
    let p1 = usage(&r1, &["prompt_tokens"]);
    let t0 = Instant::now();
    while writes(&a) + writes(&b) < (p1 / SPAN + 1) as f64 {
        assert!(t0.elapsed() < Duration::from_secs(60), "turn 1's save never reached Redis");
        std::thread::sleep(Duration::from_millis(50));
    }
    let turn2 = next_turn(turn1, &r1, "and then?");
    let r2 = chat_at(&addr, &turn2).unwrap();
    let n = cached(&r2);
    eprintln!("turn 1: {p1} prompt tokens; turn 2 on the other replica: {n} cached");
    assert!(n + SPAN >= p1, "turn 2 restored only {n} of its {p1}-token prefix");
    let hits = |s: &Server| s.metric("ds4_kv_remote_hits_total", "");
    assert_eq!(hits(&a) + hits(&b), 1.0, "turn 2 did not come through Redis");
    // Turn 3 back on the first replica: its own RAM tier or Redis, either way the prefix is reused.
    let turn3 = next_turn(turn2, &r2, "one more thing");
    let r3 = chat_at(&addr, &turn3).unwrap();
    assert!(cached(&r3) + SPAN >= usage(&r2, &["prompt_tokens"]), "turn 3: {}", r3["usage"]);

    // 32 concurrent clients, a few requests each, some sharing a system prompt: no error.
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let threads: Vec<_> = (0..32)
        .map(|i| {
            let (addr, errors) = (addr.clone(), errors.clone());
            std::thread::spawn(move || {
                let mut msgs = vec![
                    json!({"role": "system", "content": long_text(i % 4, 60)}),
                    json!({"role": "user", "content": format!("client {i}: {}", long_text(i, 12))}),
                ];
                for turn in 0..2 {
                    match chat_at(&addr, &msgs) {
                        Ok(r) => msgs = next_turn(msgs, &r, &format!("turn {turn} again")),
                        Err(e) => errors.lock().unwrap().push(format!("client {i} turn {turn}: {e}")),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let errors = errors.lock().unwrap();
    assert!(errors.is_empty(), "{} failed requests: {:?}", errors.len(), &errors[..errors.len().min(5)]);
    for s in [&a, &b] {
        assert_eq!(s.metric("ds4_kv_remote_errors_total", ""), 0.0);
        let served = s.metric("ds4_requests_total", "endpoint=\"chat_completions\",status=\"200\"");
        assert!(served >= 16.0, "round robin should spread the load, one replica served {served}");
    }
    drop(lb);
    a.stop();
    b.stop();
}
