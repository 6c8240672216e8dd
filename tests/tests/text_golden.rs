//! The `ds4 tokenize` and `ds4 render` CLI contract on the golden data of `../shared/golden/{tokenizer,chat-template}`.
//!
//! Runs the `ds4` binary (env `DS4_BIN`, else the newest of `target/release/ds4` and `target/debug/ds4`). Without
//! `../shared` or the binary the tests skip with a message, except under `CI=true`, where they fail.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use ds4_engine::testdata::skip_or_fail;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn golden(sub: &str) -> Option<PathBuf> {
    let p = repo_root().join("../shared/golden").join(sub);
    if p.is_dir() {
        Some(p)
    } else {
        skip_or_fail(&format!("{} is missing", p.display()));
        None
    }
}

fn ds4_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("DS4_BIN") {
        return Some(PathBuf::from(p));
    }
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| repo_root().join("target"));
    let newest = ["release", "debug"]
        .iter()
        .map(|p| target.join(p).join("ds4"))
        .filter_map(|p| p.metadata().and_then(|m| m.modified()).ok().map(|t| (t, p)))
        .max()
        .map(|(_, p)| p);
    if newest.is_none() {
        skip_or_fail("no ds4 binary (run `cargo build -p ds4-cli` first or set DS4_BIN)");
    }
    newest
}

fn run(bin: &Path, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(bin)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ds4");
    if let Some(input) = stdin {
        // The command may exit (on bad arguments) before reading its input: a broken pipe is fine here.
        let _ = child.stdin.take().unwrap().write_all(input);
    }
    child.wait_with_output().unwrap()
}

fn last_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("").to_string()
}

fn n_cases(jsonl: &Path) -> usize {
    std::fs::read_to_string(jsonl).unwrap().lines().filter(|l| !l.trim().is_empty()).count()
}

#[test]
fn tokenize_all_cases_from_tokenizer_json_and_bundled() {
    let (Some(dir), Some(bin)) = (golden("tokenizer"), ds4_bin()) else { return };
    let cases = dir.join("cases.jsonl");
    let n = n_cases(&cases);
    let json = dir.join("tokenizer.json");
    for args in [
        vec!["tokenize", "--tokenizer", json.to_str().unwrap(), "--jsonl", cases.to_str().unwrap()],
        vec!["tokenize", "--jsonl", cases.to_str().unwrap()],
    ] {
        let out = run(&bin, &args, None);
        assert_eq!(
            last_line(&out),
            format!("{n} passed, 0 failed"),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success());
    }
}

#[test]
fn tokenize_all_cases_from_gguf_metadata() {
    let (Some(dir), Some(bin)) = (golden("tokenizer"), ds4_bin()) else { return };
    let meta = ds4_engine::tokenizer::gguf_metadata_from_tokenizer_json(&dir.join("tokenizer.json")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tok.gguf");
    let file = std::fs::File::create(&path).unwrap();
    ds4_engine::gguf::GgufWriter::new(std::io::BufWriter::new(file), &meta, Vec::new()).unwrap().finish().unwrap();
    let cases = dir.join("cases.jsonl");
    let out = run(&bin, &["tokenize", "-m", path.to_str().unwrap(), "--jsonl", cases.to_str().unwrap()], None);
    assert_eq!(
        last_line(&out),
        format!("{} passed, 0 failed", n_cases(&cases)),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success());
}

#[test]
fn tokenize_reports_failures() {
    let Some(bin) = ds4_bin() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cases = tmp.path().join("bad.jsonl");
    // "Hello" is not token 0 (BOS); the second line is not a case at all.
    std::fs::write(&cases, "{\"text\": \"Hello\", \"ids\": [0]}\nnot json\n").unwrap();
    let out = run(&bin, &["tokenize", "--jsonl", cases.to_str().unwrap()], None);
    assert_eq!(last_line(&out), "0 passed, 2 failed");
    assert!(!out.status.success());
}

#[test]
fn render_all_template_cases_byte_exact() {
    let (Some(dir), Some(bin)) = (golden("chat-template"), ds4_bin()) else { return };
    // Modes from the cases' README.
    for (n, mode) in [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")] {
        let input = std::fs::read(dir.join(format!("case{n}.input.json"))).unwrap();
        let expected = std::fs::read(dir.join(format!("case{n}.expected.txt"))).unwrap();
        let out = run(&bin, &["render", "--mode", mode], Some(&input));
        assert!(out.status.success(), "case {n}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(out.stdout == expected, "case {n} differs:\n{}", String::from_utf8_lossy(&out.stdout));
    }
}

#[test]
fn render_effort_and_bad_input() {
    let Some(bin) = ds4_bin() else { return };
    let conv = br#"[{"role": "user", "content": "Hi"}]"#;
    let out = run(&bin, &["render", "--mode", "thinking", "--reasoning-effort", "max"], Some(conv));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum"), "{text}");
    assert!(text.ends_with("<｜User｜>Hi<｜Assistant｜><think>"));
    let out = run(&bin, &["render", "--mode", "chat"], Some(conv));
    assert_eq!(out.stdout, "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>".as_bytes());
    for (args, input) in [
        (vec!["render", "--mode", "chat"], &b"{not json"[..]),
        (vec!["render", "--mode", "banana"], &conv[..]),
        (vec!["render", "--mode", "thinking", "--reasoning-effort", "medium"], &conv[..]),
    ] {
        let out = run(&bin, &args, Some(input));
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(!out.stderr.is_empty());
    }
}
