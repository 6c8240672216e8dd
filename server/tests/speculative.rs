//! Speculative decoding in the server (`--speculative mtp|dspark`): on a model with an MTP block or a DSpark
//! drafter, temperature-0 answers of every API, streamed or not, alone or batched with other requests, are token for
//! token the answers without speculation; the drafts are verified (the metrics count them); a grammar-constrained request decodes plainly.

mod common;

use std::sync::Arc;

use common::TestServer;
use ds4_server::engine::{load, LoadOptions};
use ds4_server::scheduler::{SchedulerConfig, SpecConfig, SpecMode};
use ds4_server::{build_state_with_tier, Limits};
use serde_json::{json, Value};

/// `cfg`'s random model with the real tokenizer, as a file.
fn write_model(cfg: &ds4_engine::convert::CheckpointConfig) -> tempfile::TempPath {
    let tok = ds4_engine::tokenizer::bundled_tokenizer_json();
    let meta = ds4_engine::tokenizer::gguf_metadata_from_tokenizer_json_bytes(tok).unwrap();
    let bytes = ds4_engine::convert::random_model_gguf(cfg, 3, meta).unwrap();
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    f.into_temp_path()
}

/// The demo model's shape and real tokenizer with an MTP block (random weights), as a file.
fn model_file() -> &'static std::path::Path {
    static FILE: std::sync::OnceLock<tempfile::TempPath> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        write_model(&ds4_engine::convert::CheckpointConfig { n_nextn_layers: 1, ..ds4_engine::convert::demo_config() })
    })
}

/// The same model with a DSpark drafter (V4-Flash-0731 layout: three stages fed by the three trunk layers) instead
/// of the MTP block.
fn dspark_model_file() -> &'static std::path::Path {
    static FILE: std::sync::OnceLock<tempfile::TempPath> = std::sync::OnceLock::new();
    FILE.get_or_init(|| write_model(&ds4_engine::convert::demo_dspark_config()))
}

fn server(mode: SpecMode) -> TestServer {
    server_on_disk(mode, None)
}

/// [`server`] with the disk KV tier in `disk`.
fn server_on_disk(mode: SpecMode, disk: Option<&std::path::Path>) -> TestServer {
    server_with(model_file(), mode, disk)
}

/// A server of `file` with speculation `mode` (and the disk KV tier in `disk`).
fn server_with(file: &std::path::Path, mode: SpecMode, disk: Option<&std::path::Path>) -> TestServer {
    let opts = LoadOptions {
        placement: Default::default(),
        backend: ds4_engine::engine::BackendKind::Cpu,
        ctx: 1024,
        max_batch_tokens: 256,
        max_sessions: 32,
        active_sessions: 4,
        demo_seed: Some(1),
    };
    let (mut runner, codec, info) = load(Some(file), &opts).expect("model with a drafter");
    assert!(runner.has_drafter(ds4_engine::speculative::DrafterKind::Any));
    if mode != SpecMode::Off {
        runner.enable_drafter(mode.drafter().unwrap(), 0.0).unwrap();
    }
    let tier = disk.map(|dir| {
        use ds4_server::model::Runner;
        ds4_server::kvdisk::DiskTier::open(runner.kv_layout().unwrap(), dir.to_path_buf(), 1 << 30).unwrap()
    });
    let config = SchedulerConfig {
        max_active: 4,
        prefill_chunk: 128,
        speculative: SpecConfig { mode, draft_len: 3 },
        ..SchedulerConfig::default()
    };
    TestServer::on(build_state_with_tier(Box::new(runner), tier, Arc::new(codec), info, config, Limits::default()))
}

/// One request per API (streamed and not), each answering with the text it generated.
fn requests(prompt: &str) -> Vec<(&'static str, Value)> {
    let msgs = json!([{"role": "user", "content": prompt}]);
    let mut out = Vec::new();
    for stream in [false, true] {
        out.push((
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 24, "temperature": 0, "stream": stream}),
        ));
        out.push((
            "/v1/messages",
            json!({"model": "deepseek-v4-flash", "messages": msgs, "max_tokens": 24, "temperature": 0, "stream": stream}),
        ));
        out.push((
            "/v1/responses",
            json!({"input": prompt, "max_output_tokens": 24, "temperature": 0, "stream": stream}),
        ));
        out.push(("/v1/completions", json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": stream})));
    }
    out
}

/// The reply's body with the parts that differ between runs (ids, timings) removed: for a streamed reply the
/// concatenated text deltas, else the generated text fields.
fn answer(path: &str, r: &common::Reply) -> String {
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    let streamed = r.header("content-type").is_some_and(|c| c.contains("event-stream"));
    let mut text = String::new();
    let mut take = |v: &Value| {
        for p in [
            "/choices/0/message/content",
            "/choices/0/message/reasoning_content",
            "/choices/0/text",
            "/choices/0/delta/content",
            "/choices/0/delta/reasoning_content",
            "/delta/text",
            "/delta/thinking",
            "/delta",
            "/output_text",
        ] {
            if let Some(s) = v.pointer(p).and_then(Value::as_str) {
                text.push_str(s);
            }
        }
        if let Some(items) = v.get("content").and_then(Value::as_array) {
            for c in items {
                for k in ["text", "thinking"] {
                    text.push_str(c.get(k).and_then(Value::as_str).unwrap_or_default());
                }
            }
        }
    };
    if streamed {
        for (_, v) in r.event_json() {
            take(&v);
        }
    } else {
        take(&r.json());
    }
    text
}

#[test]
fn speculation_gives_the_plain_answers_on_every_api_alone_and_batched() {
    same_answers(model_file(), SpecMode::Mtp);
}

/// The same on the trained demo model, whose MTP drafts mostly stand (so accepted runs, not only rejections, carry
/// the answers).
#[test]
fn speculation_on_the_trained_model_gives_the_plain_answers_on_every_api_alone_and_batched() {
    static FILE: std::sync::OnceLock<tempfile::TempPath> = std::sync::OnceLock::new();
    let file = FILE.get_or_init(|| {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), ds4_engine::convert::trained_demo_gguf()).unwrap();
        f.into_temp_path()
    });
    assert!(same_answers(file, SpecMode::Mtp) > 0.0, "the trained MTP block's drafts stand");
}

/// The same with the DSpark drafter (its blocks verified in the shared ticks).
#[test]
fn dspark_speculation_gives_the_plain_answers_on_every_api_alone_and_batched() {
    same_answers(dspark_model_file(), SpecMode::Dspark);
    // `auto` picks the file's drafter: DSpark here.
    let opts = LoadOptions {
        placement: Default::default(),
        backend: ds4_engine::engine::BackendKind::Cpu,
        ctx: 512,
        max_batch_tokens: 64,
        max_sessions: 4,
        active_sessions: 2,
        demo_seed: Some(1),
    };
    let (mut runner, ..) = load(Some(dspark_model_file()), &opts).expect("model with a DSpark drafter");
    assert!(!runner.has_drafter(ds4_engine::speculative::DrafterKind::Mtp));
    assert_eq!(runner.enable_drafter(SpecMode::Auto.drafter().unwrap(), 0.0).unwrap(), "dspark");
    // And `mtp` on it is a clear error.
    let e = runner.enable_drafter(SpecMode::Mtp.drafter().unwrap(), 0.0).unwrap_err();
    assert!(e.to_string().contains("no MTP block"), "{e}");
}

/// Temperature-0 answers of every API with speculation `mode` on `file` equal those without, alone and batched;
/// drafts were verified; a grammar-constrained request decodes plainly. Returns the drafted tokens that stood.
fn same_answers(file: &std::path::Path, mode: SpecMode) -> f64 {
    let prompts = ["Write a haiku about caches.", "def fibonacci(n):", "List three colours"];
    let mut plain = server_with(file, SpecMode::Off, None);
    let want: Vec<Vec<String>> = prompts
        .iter()
        .map(|p| requests(p).iter().map(|(path, body)| answer(path, &plain.post(path, body))).collect())
        .collect();
    plain.stop();
    assert!(want.iter().flatten().any(|t| !t.is_empty()), "the plain answers have text");
    let mut spec = server_with(file, mode, None);
    for (p, want) in prompts.iter().zip(&want) {
        let got: Vec<String> = requests(p).iter().map(|(path, body)| answer(path, &spec.post(path, body))).collect();
        assert_eq!(&got, want, "alone: {p}");
    }
    let cycles = spec.metric("ds4_spec_cycles_total");
    assert!(cycles > 0.0, "drafts were verified");
    assert!(spec.metric("ds4_spec_draft_tokens_total") >= cycles);
    assert!(spec.metric("ds4_spec_accepted_tokens_total") <= spec.metric("ds4_spec_draft_tokens_total"));
    // All requests at once: batched with each other, speculating and not (streams finish at different times).
    let addr = spec.addr;
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .flat_map(|(i, p)| requests(p).into_iter().enumerate().map(move |(j, r)| (i, j, r)))
        .map(|(i, j, (path, body))| {
            std::thread::spawn(move || {
                let r = common::post_json(addr, path, &body);
                (i, j, answer(path, &r))
            })
        })
        .collect();
    for h in handles {
        let (i, j, got) = h.join().unwrap();
        assert_eq!(got, want[i][j], "batched: prompt {i}, request {j}");
    }
    assert!(spec.metric("ds4_spec_cycles_total") > cycles);
    // A grammar-constrained request decodes plainly (and still validates).
    let before = spec.metric("ds4_spec_cycles_total");
    let r = spec.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "a number"}], "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(spec.metric("ds4_spec_cycles_total"), before, "no drafts under a grammar");
    let accepted = spec.metric("ds4_spec_accepted_tokens_total");
    spec.stop();
    accepted
}

/// The README's first command: `ds4-server` without `-m` serves the trained demo model, which answers in words and
/// speculates with its MTP block by default (`--speculative auto`).
#[test]
fn the_default_server_serves_the_trained_demo_model_and_speculates() {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        .args(["--port", "0", "--no-kv-disk", "--ctx", "4096"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut notice = false;
    let addr = loop {
        let line = lines.next().expect("the server exits before listening").unwrap();
        notice |= line.contains("demo model") && line.contains("trained");
        if let Some(a) = line.strip_prefix("ds4-server: listening on http://") {
            break a.trim().parse::<std::net::SocketAddr>().unwrap();
        }
    };
    // Keep reading stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    assert!(notice, "no notice that the trained demo model is served");
    let ask = |q: &str| {
        let body = json!({"messages": [{"role": "user", "content": q}], "max_tokens": 48, "temperature": 0,
            "reasoning_effort": "none"});
        let r = common::post_json(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let msg = &v["choices"][0]["message"];
        format!(
            "{}{}",
            msg["reasoning_content"].as_str().unwrap_or_default(),
            msg["content"].as_str().unwrap_or_default()
        )
    };
    let mut text = String::new();
    for q in ["Return the number of items.", "What does the function join do?", "Explain urlsplit."] {
        text += &ask(q);
    }
    let wordy = text.chars().filter(|c| c.is_ascii_alphabetic() || *c == ' ').count();
    assert!(wordy * 10 >= text.chars().count() * 7, "not words: {text:?}");
    let metrics = common::request(addr, "GET", "/metrics", &[], b"").body;
    let cycles = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ds4_spec_cycles_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap();
    assert!(cycles > 0.0, "the MTP block drafted");
    child.kill().unwrap();
    let _ = child.wait();
}

/// A session restored from the disk tier has no roll-back log for its first window of new tokens: it decodes plainly
/// until the log is live, then speculates, and its answer is the plain one.
#[test]
fn a_session_restored_from_disk_speculates_once_it_can_roll_back() {
    let dir = tempfile::tempdir().unwrap();
    let first = json!([{"role": "user", "content": "Tell me about caches and their many layers."}]);
    let ask = |s: &TestServer, msgs: &Value| {
        let r = s.post("/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 40, "temperature": 0}));
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        (v["choices"][0]["message"].clone(), v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
    };
    let mut s1 = server_on_disk(SpecMode::Off, Some(dir.path()));
    let (a1, _) = ask(&s1, &first);
    s1.stop(); // saves the session to the disk tier
    let second =
        json!([first[0], {"role": "assistant", "content": a1["content"]}, {"role": "user", "content": "And then?"}]);
    let mut plain = server(SpecMode::Off);
    let (want, _) = ask(&plain, &second);
    plain.stop();
    let mut s2 = server_on_disk(SpecMode::Mtp, Some(dir.path()));
    let (got, cached) = ask(&s2, &second);
    assert!(cached > 0, "the second turn was restored from disk");
    assert_eq!(got, want, "the restored, speculating session answers as plain decoding does");
    assert!(s2.metric("ds4_spec_cycles_total") > 0.0, "it speculated once its roll-back log was live");
    s2.stop();
}
