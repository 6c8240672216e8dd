//! Test harness: an in-process server on 127.0.0.1 with an ephemeral port over the scripted fake model, and a tiny
//! blocking HTTP/1.1 client (one request per connection, chunked bodies decoded, SSE split into events).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use ds4_server::fake::{FakeCodec, FakeRunner};
use ds4_server::model::ModelInfo;
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::{build_state, http, AppState, Limits};
use serde_json::Value;

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub struct Options {
    pub delay: Duration,
    pub config: SchedulerConfig,
    pub limits: Limits,
    pub context: usize,
    /// Scripted turns of the fake model.
    pub script: ds4_server::fake_script::Script,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            delay: Duration::ZERO,
            config: SchedulerConfig::default(),
            limits: Limits::default(),
            context: 65536,
            script: Default::default(),
        }
    }
}

impl TestServer {
    pub fn start() -> Self {
        Self::with(Options::default())
    }

    pub fn with(o: Options) -> Self {
        let runner = FakeRunner::new(256).with_delay(o.delay).with_script(o.script);
        let info = ModelInfo {
            id: "deepseek-v4-flash".into(),
            context_size: o.context,
            vocab_size: ds4_server::fake::VOCAB,
            demo: true,
        };
        Self::on(build_state(Box::new(runner), Arc::new(FakeCodec), info, o.config, o.limits))
    }

    /// Serve an already built state.
    pub fn on(state: Arc<AppState>) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            rt.block_on(http::serve(
                listener,
                st,
                async {
                    let _ = rx.await;
                },
                Duration::from_secs(30),
            ))
        });
        TestServer { addr, state, shutdown: Some(tx), thread: Some(thread) }
    }

    /// Signal shutdown and wait until `serve` returned (in-flight requests drained).
    pub fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.state.scheduler.shutdown();
    }

    pub fn post(&self, path: &str, body: &Value) -> Reply {
        request(self.addr, "POST", path, &[("content-type", "application/json")], body.to_string().as_bytes())
    }

    pub fn get(&self, path: &str) -> Reply {
        request(self.addr, "GET", path, &[], b"")
    }

    pub fn metric(&self, line_prefix: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("metric {line_prefix} missing in:\n{text}"))
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// SSE events as (event name, data), comments dropped.
    pub fn events(&self) -> Vec<(Option<String>, String)> {
        let mut out = Vec::new();
        for frame in self.body.split("\n\n").filter(|f| !f.trim().is_empty()) {
            let mut name = None;
            let mut data = Vec::new();
            for line in frame.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push(d);
                }
            }
            if !data.is_empty() {
                out.push((name, data.join("\n")));
            }
        }
        out
    }

    /// The JSON data of every event except a `[DONE]` marker.
    pub fn event_json(&self) -> Vec<(Option<String>, Value)> {
        self.events()
            .into_iter()
            .filter(|(_, d)| d != "[DONE]")
            .map(|(n, d)| (n, serde_json::from_str(&d).unwrap_or_else(|e| panic!("bad event data {d}: {e}"))))
            .collect()
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(std::str::from_utf8(&raw[..eol]).unwrap().trim(), 16).unwrap();
        raw = &raw[eol + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
    out
}

/// `POST path` with a JSON body to the server at `addr` (a server started some other way than [`TestServer`]).
pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, &[("content-type", "application/json")], body.to_string().as_bytes())
}

/// One request on a fresh connection (`connection: close`), read to the end.
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) before reading a large body; a failed write is fine then.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_reply(&raw)
}

pub fn parse_reply(raw: &[u8]) -> Reply {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("no header end in reply");
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string())))
        .collect();
    let body = &raw[split + 4..];
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(body) } else { body.to_vec() };
    Reply { status, headers, body: String::from_utf8(body).unwrap() }
}

/// `../shared/clients/<client>/*.json`, sorted; `None` (with a note) when the folder is absent outside CI.
pub fn fixtures(client: &str) -> Option<Vec<(String, Value)>> {
    let dir = ds4_engine::testdata::shared(&format!("clients/{client}"), "")?;
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    Some(
        files
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .map(|p| {
                let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
                (p.file_name().unwrap().to_string_lossy().into_owned(), v)
            })
            .collect(),
    )
}

/// Replay a fixture: its method, path (query included), headers (the redacted auth ones too) and body.
pub fn replay(server: &TestServer, fixture: &Value) -> Reply {
    let headers: Vec<(String, String)> = fixture["headers"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "content-length" | "host" | "connection" | "accept-encoding"))
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect();
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let body = fixture["body"].to_string();
    request(server.addr, fixture["method"].as_str().unwrap(), fixture["path"].as_str().unwrap(), &h, body.as_bytes())
}

/// A server on the demo model (random weights, the real tokenizer, DSML template and parser): its free output is
/// noise, so whatever structure comes back was made by a constraint.
pub fn demo_server() -> TestServer {
    let opts = ds4_server::engine::LoadOptions {
        placement: Default::default(),
        backend: ds4_engine::engine::BackendKind::Cpu,
        ctx: 2048,
        max_batch_tokens: 256,
        max_sessions: 16,
        active_sessions: 4,
        demo_seed: Some(1),
    };
    let (runner, codec, info) = ds4_server::engine::load(None, &opts).expect("demo model");
    let config = SchedulerConfig { max_active: 4, prefill_chunk: 128, ..SchedulerConfig::default() };
    TestServer::on(build_state(Box::new(runner), Arc::new(codec), info, config, Limits::default()))
}
