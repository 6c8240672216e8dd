//! Where tests find the shared test data, and the one rule for when it is missing.
//!
//! The golden checkpoints, tokenizer cases, chat-template cases and client fixtures live in `../shared`, next to the
//! repository (not in it). Every crate's tests locate them through this module so the rule is written once:
//!
//! - present → the path;
//! - absent and `CI=true` → **panic**: CI provides `../shared`, so a golden test must never pass by skipping there;
//! - absent otherwise → `None` after a `skipping: …` note on stderr (a fresh clone without the data still builds and
//!   runs the rest of the suite).
//!
//! The engine itself never calls this at run time; it is public so integration tests of other crates share it.

use std::path::{Path, PathBuf};

/// `true` when the environment says this is CI (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").map(|v| v == "true").unwrap_or(false)
}

/// Records that a test cannot run because `what` is missing.
///
/// # Panics
/// When [`in_ci`] is true: nothing may be skipped in CI.
pub fn skip_or_fail(what: &str) {
    assert!(!in_ci(), "CI=true but {what}");
    eprintln!("skipping: {what}");
}

/// The shared data folder, `<workspace>/../shared` (it may not exist).
pub fn shared_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..").join("shared")
}

/// `<shared>/rel` when `<shared>/rel/probe` exists (use `""` to only require the folder); otherwise
/// [`skip_or_fail`] and `None`.
///
/// # Panics
/// When the data is missing and `CI=true`.
pub fn shared(rel: &str, probe: &str) -> Option<PathBuf> {
    let dir = if rel.is_empty() { shared_root() } else { shared_root().join(rel) };
    let p = if probe.is_empty() { dir.clone() } else { dir.join(probe) };
    if p.exists() {
        return Some(dir);
    }
    skip_or_fail(&format!("{} is missing (tests need ../shared)", p.display()));
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_present_data_and_reports_missing_data() {
        // The repository's own manifest stands in for present data: the rule is about the probe, not the folder.
        let root = shared_root();
        assert!(root.ends_with("shared"));
        if in_ci() {
            let r = std::panic::catch_unwind(|| shared("no-such-folder-for-this-test", ""));
            assert!(r.is_err(), "missing data must fail under CI=true");
        } else {
            assert_eq!(shared("no-such-folder-for-this-test", ""), None);
        }
        if root.join("golden").is_dir() {
            assert_eq!(shared("golden", ""), Some(root.join("golden")));
        }
    }
}
