//! Several threads saving, looking up and loading sessions that share a prefix, on one `Arc<KvStore>`.

mod common;

use std::sync::Arc;

use common::*;
use ds4_kv::KvStore;

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn threads_share_prefix_pages_without_duplicates_or_torn_entries() {
    assert_send_sync::<KvStore>();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(dir.path(), u64::MAX));
    let system = tokens(1, 2 * SPAN as usize);
    let session = |t: u64, i: u64| {
        let mut s = system.clone();
        s.extend(tokens(100 * t + i, SPAN as usize + 11));
        s
    };
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let store = store.clone();
            let session = &session;
            sc.spawn(move || {
                for i in 0..5 {
                    let s = session(t, i);
                    let m = store.longest_prefix(&s);
                    for p in &m.pages {
                        collect(&store, &p.key).unwrap();
                    }
                    save_session(&store, &s, 256).unwrap();
                    assert_eq!(store.longest_prefix(&s).matched_tokens, s.len());
                }
            });
        }
    });
    let st = store.status();
    // 2 shared pages + per session one own page and one checkpoint.
    assert_eq!((st.pages, st.checkpoints), (2 + 20, 20));
    assert_eq!(st.files, 42);
    let names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 42, "{names:?}");
    drop(store);
    let store = open(dir.path(), u64::MAX);
    for t in 0..4 {
        for i in 0..5 {
            let s = session(t, i);
            let m = store.longest_prefix(&s);
            assert_eq!(m.matched_tokens, s.len());
            assert_eq!(collect(&store, &m.checkpoint.unwrap().key).unwrap()[0].4, checkpoint_rows(&s, 256));
        }
    }
}
