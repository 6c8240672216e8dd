//! A writer killed with SIGKILL in the middle of a write never leaves a file that is later used.
//!
//! The test binary re-executes itself (`child_writer`, ignored unless run with the env var set) to run a writer that
//! stores big incompressible pages in an endless chain. The parent waits until a temp file is being written, kills
//! the child with SIGKILL, and opens the cache: temp files are removed, no file is corrupt, and every indexed entry
//! loads and matches the rows the child derived from its tokens. The kill is retried a few times until one lands while
//! a temp file exists (it nearly always does on the first try: each file is 8 MiB).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ds4_kv::{KvStore, RowBlock, SaveReason};

const ENV: &str = "DS4_KV_SIGKILL_CHILD_DIR";
const ROWS: u32 = 128;
const WIDTH: u32 = 1024;
const LAYERS: usize = 16;

fn big_layers(start: u64, toks: &[u32]) -> Vec<Vec<f32>> {
    (0..LAYERS as u64)
        .map(|l| {
            let seed = toks.iter().fold(start ^ (l << 40), |a, &t| a.wrapping_mul(31).wrapping_add(t as u64));
            (0..(ROWS * WIDTH) as u64).map(|i| val(seed.wrapping_add(i)) * 1.7).collect()
        })
        .collect()
}

fn chain_tokens(page: u64) -> Vec<u32> {
    tokens(77 + page, SPAN as usize)
}

#[test]
#[ignore = "helper: the child process of killed_writer_never_leaves_a_used_corrupt_file"]
fn child_writer() {
    let Ok(dir) = std::env::var(ENV) else { return };
    let store = open(Path::new(&dir), u64::MAX);
    let mut parent = store.root();
    for page in 0.. {
        let toks = chain_tokens(page);
        let data = big_layers(page * SPAN as u64, &toks);
        let layers: Vec<Vec<RowBlock<'_>>> =
            data.iter().map(|v| vec![RowBlock { tag: 0, rows: ROWS, width: WIDTH, values: v }]).collect();
        parent = store.put_page(&parent, &toks, &layers, SaveReason::Continued).expect("child put").key;
    }
}

fn temp_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".tmp")).count())
        .unwrap_or(0)
}

fn final_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".page")).count())
        .unwrap_or(0)
}

#[test]
fn killed_writer_never_leaves_a_used_corrupt_file() {
    let mut killed_mid_write = 0;
    for attempt in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_writer", "--ignored", "--nocapture"])
            .env(ENV, dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Guard against a broken child, not a timing assertion.
        let deadline = Instant::now() + Duration::from_secs(120);
        while !(final_files(dir.path()) >= 2 && temp_files(dir.path()) >= 1) {
            assert!(Instant::now() < deadline, "child wrote nothing");
            assert!(child.try_wait().unwrap().is_none(), "child exited");
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        let leftover = temp_files(dir.path());
        if leftover > 0 {
            killed_mid_write += 1;
        }

        let store: KvStore = open(dir.path(), u64::MAX);
        let st = store.status();
        assert_eq!(temp_files(dir.path()), 0, "attempt {attempt}: temp files left");
        assert_eq!(st.temp_removed as usize, leftover);
        assert_eq!(st.corrupt_removed, 0, "attempt {attempt}: a final file was corrupt");
        assert!(st.pages >= 2);
        // Every indexed page is complete and holds what the child computed.
        for (page, r) in store.page_chain(&(0..st.pages).flat_map(chain_tokens).collect::<Vec<_>>()).iter().enumerate()
        {
            let want = big_layers(page as u64 * SPAN as u64, &chain_tokens(page as u64));
            let got = collect(&store, &r.key).unwrap();
            assert_eq!(got.len(), LAYERS);
            for (l, g) in got.iter().enumerate() {
                assert_eq!(g.4, want[l], "page {page} layer {l}");
            }
        }
        assert_eq!(store.page_chain(&(0..st.pages).flat_map(chain_tokens).collect::<Vec<_>>()).len() as u64, st.pages);
        if killed_mid_write > 0 {
            break;
        }
    }
    assert!(killed_mid_write > 0, "no kill landed while a temp file existed in 5 attempts");
}
