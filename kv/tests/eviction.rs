//! The eviction policy against the reference engine's failure mode: many conversations share one system prompt;
//! under a tight budget the shared prefix (pages + its checkpoint) must survive while one-off tails are evicted,
//! also across a restart (when in-memory hit counts are gone).

mod common;

use common::*;

const WINDOW: usize = 4096; // checkpoint values (f32, incompressible): ~16 KB per checkpoint

fn conversation(system: &[u32], i: u64) -> Vec<u32> {
    let mut t = system.to_vec();
    t.extend(tokens(1000 + i, 2 * SPAN as usize + 37));
    t
}

#[test]
fn shared_system_prompt_survives_while_one_off_tails_are_evicted() {
    let dir = tempfile::tempdir().unwrap();
    let system = tokens(7, 4 * SPAN as usize);

    // Measure what one shared prefix and one conversation tail cost on disk.
    let (shared_bytes, conv_bytes) = {
        let probe = tempfile::tempdir().unwrap();
        let s = open(probe.path(), u64::MAX);
        save_session(&s, &system, WINDOW).unwrap();
        let a = s.status().bytes;
        save_session(&s, &conversation(&system, 999), WINDOW).unwrap();
        (a, s.status().bytes - a)
    };
    let budget = shared_bytes + 3 * conv_bytes + conv_bytes / 2;

    let run = |store: &ds4_kv::KvStore, budget: u64, from: u64, to: u64| {
        for i in from..to {
            let conv = conversation(&system, i);
            let m = store.longest_prefix(&conv);
            // Every conversation resumes at least from the shared system prompt.
            assert_eq!(m.matched_tokens, system.len(), "conversation {i}");
            assert!(m.checkpoint.is_some());
            save_session(store, &conv, WINDOW).unwrap();
            let st = store.status();
            assert!(st.bytes <= budget, "conversation {i}: {} bytes over budget {budget}", st.bytes);
        }
    };

    let store = open(dir.path(), budget);
    save_session(&store, &system, WINDOW).unwrap(); // the server's "cold" save at the end of the system prompt
    run(&store, budget, 0, 20);
    let st = store.status();
    assert!(st.evicted >= 16 * 3, "one-off tails were evicted: {}", st.evicted);
    // The latest conversation is still resumable in full; an early one is not.
    let last = conversation(&system, 19);
    assert_eq!(store.longest_prefix(&last).matched_tokens, last.len());
    assert_eq!(store.longest_prefix(&conversation(&system, 0)).matched_tokens, system.len());
    drop(store);

    // After a restart hit counts are gone and the shared checkpoint is the oldest file; structure (the conversation
    // checkpoints below the shared prefix) still protects it when a smaller budget forces evictions at open.
    // Make the shared prefix's files two hours old, as if the system prompt had been saved long ago.
    for key in store_keys(&dir, &system) {
        let f = std::fs::File::options().write(true).open(key).unwrap();
        f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(7200)).unwrap();
    }
    let small = shared_bytes + conv_bytes + conv_bytes / 2;
    let store = open(dir.path(), small);
    assert!(store.status().evicted >= 2);
    run(&store, small, 20, 35);
    let fresh = conversation(&system, 5000);
    let m = store.longest_prefix(&fresh);
    assert_eq!(m.matched_tokens, system.len());
    assert_eq!(m.pages.len(), 4);
    for p in &m.pages {
        assert!(collect(&store, &p.key).is_ok());
    }
}

/// Paths of the shared prefix's files (pages + checkpoint).
fn store_keys(dir: &tempfile::TempDir, system: &[u32]) -> Vec<std::path::PathBuf> {
    let store = open(dir.path(), u64::MAX);
    let m = store.longest_prefix(system);
    assert_eq!(m.matched_tokens, system.len());
    let mut v: Vec<_> =
        m.pages.iter().map(|p| dir.path().join(ds4_kv::disk::file_name(&p.key, ds4_kv::EntryKind::Page))).collect();
    let ck = m.checkpoint.unwrap();
    v.push(dir.path().join(ds4_kv::disk::file_name(&ck.key, ds4_kv::EntryKind::Checkpoint)));
    v
}

#[test]
fn prefix_chains_are_evicted_leaf_first() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), u64::MAX);
    let a = tokens(3, 3 * SPAN as usize + 1);
    save_session(&store, &a, 16).unwrap();
    drop(store);
    // Budget for about half the chain: the tail goes, the head stays, nothing is left orphaned.
    let total: u64 = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    let store = open(dir.path(), total / 2);
    let chain = store.page_chain(&a);
    let st = store.status();
    assert!(st.bytes <= total / 2);
    assert!(!chain.is_empty() && chain.len() < 3, "kept {} pages", chain.len());
    assert_eq!(st.files as usize, chain.len());
    assert!(store.longest_prefix(&a).checkpoint.is_none());
}
