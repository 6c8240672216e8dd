//! `scripts/gpu-check.sh` on a machine without an NVIDIA GPU (CI, developer machines): it must exit non-zero
//! within 30 s, say why on stderr, and leave the reason in its results file.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn gpu_present() -> bool {
    Command::new("nvidia-smi").arg("-L").output().is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
}

#[test]
fn gpu_check_fails_fast_and_clearly_without_a_gpu() {
    if gpu_present() {
        eprintln!("SKIP: this machine has an NVIDIA GPU; scripts/gpu-check.sh would run the real check");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results.txt");
    let t = Instant::now();
    let o = Command::new("bash").arg(&script).arg(&out).output().expect("running bash");
    let took = t.elapsed();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "gpu-check.sh succeeded without a GPU; stderr: {stderr}");
    assert!(took < Duration::from_secs(30), "gpu-check.sh took {took:?} to fail");
    assert!(stderr.contains("gpu-check: FAILED") && stderr.contains("GPU"), "unclear message: {stderr}");
    let results = std::fs::read_to_string(&out).expect("results file written");
    assert!(results.contains("FAILED"), "results file lacks the reason: {results}");
}
