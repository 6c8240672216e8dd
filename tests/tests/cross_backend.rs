//! The portable GPU path against the golden checkpoint and the CPU backend, through the user-facing commands:
//! `ds4 logits --backend wgpu --exact`, `ds4 generate --backend wgpu --exact`, and the cross-backend correctness
//! runner `ds4-bench correctness --backends cpu,wgpu`. CI runs these on lavapipe (Mesa's software Vulkan driver).

use std::process::Command;

use ds4_tests::{
    ds4_bench_bin, ds4_bin, golden_gguf, ids, max_abs_diff, read_f32, read_json, row_argmax, shared, wgpu_available,
};

fn join(ids: &[u32]) -> String {
    ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
}

#[test]
fn wgpu_cli_reproduces_golden_logits_and_greedy_tokens() {
    let Some(sh) = shared() else { return };
    if !wgpu_available() {
        return;
    }
    let dir = sh.join("golden/tiny-a");
    let g = read_json(&dir.join("golden.json"));
    let prompt = ids(&g["prompt_tokens"]);
    let greedy = ids(&g["greedy_tokens"]);
    let vocab = g["vocab_size"].as_u64().unwrap() as usize;
    let gguf = golden_gguf(&sh, "tiny-a", "f32");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.f32");

    let st = Command::new(ds4_bin())
        .args(["logits", "--backend", "wgpu", "--exact", "--chunk", "32", "-m"])
        .arg(&gguf)
        .args(["--tokens", &join(&prompt), "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success(), "ds4 logits --backend wgpu failed");
    let got = read_f32(&out);
    let want = read_f32(&dir.join("prefill_logits.f32"));
    let d = max_abs_diff(&got, &want);
    assert!(d <= 1e-3, "wgpu logits differ from golden by {d}");
    assert_eq!(row_argmax(&got, vocab), row_argmax(&want, vocab), "argmax differs from golden");

    let o = Command::new(ds4_bin())
        .args(["generate", "--backend", "wgpu", "--exact", "--temperature", "0", "--print-ids", "-m"])
        .arg(&gguf)
        .args(["--tokens", &join(&prompt), "-n", &greedy.len().to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "ds4 generate --backend wgpu failed: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), join(&greedy));
}

#[test]
fn correctness_runner_compares_cpu_and_wgpu() {
    let Some(sh) = shared() else { return };
    if !wgpu_available() {
        return;
    }
    let g = read_json(&sh.join("golden/tiny-a/golden.json"));
    let prompt = ids(&g["prompt_tokens"]);
    let gguf = golden_gguf(&sh, "tiny-a", "f32");
    let o = Command::new(ds4_bench_bin())
        .args(["correctness", "--backends", "cpu,wgpu", "--exact", "--quiet", "--gen", "8", "--tol", "1e-3", "-m"])
        .arg(&gguf)
        .args(["--tokens", &join(&prompt[..48])])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "correctness runner failed:\n{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    let pair =
        stdout.lines().find(|l| l.starts_with("cpu,wgpu")).unwrap_or_else(|| panic!("no pair row in:\n{stdout}"));
    assert!(pair.ends_with(",true"), "pair row does not pass: {pair}");

    // A tolerance no pair can meet must fail the run (the runner really checks).
    let st = Command::new(ds4_bench_bin())
        .args(["correctness", "--backends", "cpu,wgpu", "--exact", "--quiet", "--gen", "1", "--tol=-1", "-m"])
        .arg(&gguf)
        .args(["--tokens", &join(&prompt[..8])])
        .status()
        .unwrap();
    assert!(!st.success(), "a negative tolerance must fail");
}
