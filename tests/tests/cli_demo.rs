//! `ds4 run` and `ds4 chat` work on a fresh machine without any model file: the built-in demo model (small, trained:
//! it answers in words) is used when no `-m` is given, and it speculates with its MTP block by default.

use std::io::Write;
use std::process::{Command, Stdio};

use ds4_tests::ds4_bin;

#[test]
fn run_without_a_model_uses_the_demo_model_deterministically() {
    let go = || {
        Command::new(ds4_bin())
            .args(["run", "-p", "Return the number of items.", "--nothink", "--temperature", "0", "--max-tokens", "40"])
            .output()
            .unwrap()
    };
    let (a, b) = (go(), go());
    assert!(a.status.success(), "ds4 run failed: {}", String::from_utf8_lossy(&a.stderr));
    assert!(String::from_utf8_lossy(&a.stderr).contains("demo model"), "no notice that the demo model is used");
    assert!(!a.stdout.is_empty(), "no answer text");
    assert_eq!(a.stdout, b.stdout, "temperature 0 must be deterministic");
    // Words, not noise: mostly letters and spaces.
    let text = String::from_utf8_lossy(&a.stdout);
    let wordy = text.chars().filter(|c| c.is_ascii_alphabetic() || *c == ' ').count();
    assert!(wordy * 10 >= text.chars().count() * 7, "the demo model's answer is not words: {text:?}");
    assert!(String::from_utf8_lossy(&a.stderr).contains("speculative decoding"), "the MTP block drafts by default");
    // The same answer without speculation.
    let plain = Command::new(ds4_bin())
        .args(["run", "-p", "Return the number of items.", "--nothink", "--temperature", "0", "--max-tokens", "40"])
        .args(["--speculative", "off"])
        .output()
        .unwrap();
    assert_eq!(plain.stdout, a.stdout, "speculation changes nothing in the answer");
}

#[test]
fn chat_without_a_model_answers_each_line() {
    let mut child = Command::new(ds4_bin())
        .args(["chat", "--nothink", "--temperature", "0", "--max-tokens", "4"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\n/reset\nsecond question\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "ds4 chat failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // Two questions (the `/reset` command produces no answer): two answers, each ending its line.
    assert!(text.lines().filter(|l| !l.trim().is_empty()).count() >= 2, "expected one answer per question: {text:?}");
}
