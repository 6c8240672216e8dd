//! Shared helpers for ds4's cross-crate integration tests (locating `../shared`, converting the golden checkpoints,
//! running the CLI binaries).
//!
//! `shared()` returns the `../shared` folder, or `None` (tests then skip with a message) — except when `CI=true`,
//! where a missing folder is a test failure: golden tests must never be skipped silently in CI.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use ds4_engine::convert::{convert, ConvertOptions, Recipe};

/// The repository root (the workspace folder).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests crate lives in the workspace").to_path_buf()
}

/// `../shared` relative to the repository root, if present. Panics when it is missing and `CI=true`.
pub fn shared() -> Option<PathBuf> {
    ds4_engine::testdata::shared("", "golden")
}

/// Reads a little-endian f32 file.
pub fn read_f32(path: &Path) -> Vec<f32> {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Reads a JSON file.
pub fn read_json(path: &Path) -> serde_json::Value {
    let s = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON array of integers as token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("integer") as u32).collect()
}

/// Converts `golden/<name>` with the given recipe into a temp folder (once per process and recipe) and returns
/// the GGUF path.
pub fn golden_gguf(shared: &Path, name: &str, recipe: &str) -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    let out = dir.path().join(format!("{name}-{recipe}.gguf"));
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !out.exists() {
        let recipe: Recipe = recipe.parse().expect("recipe");
        convert(&ConvertOptions::new(shared.join("golden").join(name), &out, recipe))
            .unwrap_or_else(|e| panic!("converting golden/{name}: {e}"));
    }
    out
}

/// Path of the `ds4` binary of this build profile, building it first if needed.
pub fn ds4_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| workspace_bin("ds4-cli", "ds4")).clone()
}

/// Path of the `ds4-bench` binary of this build profile, building it first if needed.
pub fn ds4_bench_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| workspace_bin("ds4-bench", "ds4-bench")).clone()
}

/// Builds binary `bin` of workspace package `package` in this test's build profile and returns its path.
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    // target/<profile>/deps/<test-exe> -> target/<profile>/<bin>
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target profile dir").to_path_buf();
    let path = profile_dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-q", "-p", package, "--bin", bin]).current_dir(repo_root());
    if release {
        cmd.arg("--release");
    }
    let st = cmd.status().expect("running cargo build");
    assert!(st.success(), "building the {bin} binary failed");
    assert!(path.exists(), "{} missing after build", path.display());
    path
}

/// Whether a wgpu adapter is usable here. Without one, wgpu tests skip with a message — except under `CI=true`,
/// where CI installs the software Vulkan driver and a missing adapter is a failure (the engine's own test rule).
pub fn wgpu_available() -> bool {
    ds4_engine::backend::wgpu::context::test_context(Default::default()).is_some()
}

/// Max absolute difference of two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Argmax of each `vocab`-wide row (lowest index on ties).
pub fn row_argmax(v: &[f32], vocab: usize) -> Vec<usize> {
    v.chunks_exact(vocab)
        .map(|r| {
            let mut b = 0;
            for (i, &x) in r.iter().enumerate() {
                if x > r[b] {
                    b = i;
                }
            }
            b
        })
        .collect()
}

/// Deterministic pseudo-random token ids below `vocab` (xorshift; the same `seed` gives the same ids).
pub fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// The bit patterns of `v` (compare logits bit for bit, NaN included).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits (bits) of session `s` after each token of `cont`, fed one at a time.
pub fn continue_with(
    e: &mut ds4_engine::engine::Engine,
    s: ds4_engine::tables::SessionId,
    cont: &[u32],
) -> Vec<Vec<u32>> {
    cont.iter()
        .map(|&t| {
            e.feed(s, &[t]).unwrap();
            e.run_until_idle().unwrap();
            bits(e.logits(s).unwrap())
        })
        .collect()
}
