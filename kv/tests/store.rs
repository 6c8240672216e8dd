//! KvStore behaviour: put/lookup/load round trips, prefix sharing, divergence, reopening, pins, compact encodings.

mod common;

use common::*;
use ds4_kv::{Encoding, EntryKind, KvError, KvStore, RowBlock, SaveReason, Tier};

#[test]
fn pages_and_checkpoint_round_trip_and_resume_point() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), u64::MAX);
    let toks = tokens(1, 3 * SPAN as usize + 50);
    let ck = save_session(&store, &toks, 1000).unwrap();

    // The same prompt plus more text resumes at the checkpoint.
    let mut longer = toks.clone();
    longer.extend(tokens(2, 40));
    let m = store.longest_prefix(&longer);
    assert_eq!(m.matched_tokens, toks.len());
    assert_eq!(m.pages.len(), 3);
    assert_eq!(m.checkpoint.map(|c| c.key), Some(ck.key));

    // Every page hands back exactly the rows that were stored, in layer order.
    for (p, r) in m.pages.iter().enumerate() {
        let s = &toks[p * SPAN as usize..(p + 1) * SPAN as usize];
        let want = page_rows(p as u64 * SPAN as u64, s);
        let got = collect(&store, &r.key).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!((got[0].0, got[0].1, got[0].2, got[0].3), (0, 0, SPAN / 4, 512));
        assert_eq!(got[0].4, want.csa_kv);
        assert_eq!((got[1].0, got[1].1, got[1].3), (0, 1, 128));
        assert_eq!(got[1].4, want.csa_idx);
        assert_eq!((got[2].0, got[2].2), (1, 1));
        assert_eq!(got[2].4, want.hca);
    }
    let got = collect(&store, &ck.key).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].4, checkpoint_rows(&toks, 1000));

    // A prompt that differs inside the last page can only use the checkpoint-less chain: nothing resumable.
    let mut diverged = toks.clone();
    diverged[2 * SPAN as usize + 5] ^= 1;
    let m = store.longest_prefix(&diverged);
    assert_eq!((m.matched_tokens, m.pages.len(), m.checkpoint), (2 * SPAN as usize, 2, None));
    // Shorter than the checkpoint position: no checkpoint applies either.
    let m = store.longest_prefix(&toks[..toks.len() - 1]);
    assert!(m.checkpoint.is_none());
    assert_eq!(store.longest_prefix(&tokens(3, 500)).matched_tokens, 0);
}

#[test]
fn sessions_with_a_common_prefix_share_pages_and_diverge_with_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), u64::MAX);
    let system = tokens(10, 2 * SPAN as usize);
    let mut a = system.clone();
    a.extend(tokens(11, SPAN as usize + 10));
    let mut b = system.clone();
    b.extend(tokens(12, SPAN as usize + 20));
    save_session(&store, &a, 100).unwrap();
    let files_after_a = store.status().files;
    assert_eq!(files_after_a, 4); // 3 pages + 1 checkpoint
    save_session(&store, &b, 100).unwrap();
    let st = store.status();
    assert_eq!((st.files, st.pages, st.checkpoints), (6, 4, 2)); // the two system pages are shared
    let ca = store.page_chain(&a);
    let cb = store.page_chain(&b);
    assert_eq!(ca[..2], cb[..2]);
    assert_ne!(ca[2], cb[2]);
    // Putting an existing page again is a no-op returning the same entry.
    let rows = page_rows(0, &system[..SPAN as usize]);
    let again = store.put_page(&store.root(), &system[..SPAN as usize], &rows.layers(), SaveReason::Cold).unwrap();
    assert_eq!(again, ca[0]);
    assert_eq!(store.status().files, 6);
}

#[test]
fn reopening_rebuilds_the_index_from_headers() {
    let dir = tempfile::tempdir().unwrap();
    let toks = tokens(20, 2 * SPAN as usize + 3);
    let ck = {
        let store = open(dir.path(), u64::MAX);
        save_session(&store, &toks, 64).unwrap()
    };
    let store = open(dir.path(), u64::MAX);
    let m = store.longest_prefix(&toks);
    assert_eq!(m.matched_tokens, toks.len());
    assert_eq!(m.checkpoint.map(|c| c.key), Some(ck.key));
    assert_eq!(collect(&store, &ck.key).unwrap()[0].4, checkpoint_rows(&toks, 64));
    // Another model or another span sees nothing and removes nothing.
    let other = KvStore::open(dir.path(), ds4_kv::ModelIdentity::new("other"), opts(u64::MAX)).unwrap();
    assert_eq!(other.longest_prefix(&toks).matched_tokens, 0);
    let mut o = opts(u64::MAX);
    o.span_tokens = 256;
    let wider = KvStore::open(dir.path(), identity(), o).unwrap();
    assert_eq!(wider.status().files, 0);
    assert_eq!(open(dir.path(), u64::MAX).status().files, 3);
}

#[test]
fn invalid_input_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), u64::MAX);
    let toks = tokens(30, SPAN as usize);
    let rows = page_rows(0, &toks);
    assert!(matches!(
        store.put_page(&store.root(), &toks[..10], &rows.layers(), SaveReason::Cold),
        Err(KvError::Invalid(_))
    ));
    let v = vec![0f32; 5];
    let bad = vec![vec![RowBlock { tag: 0, rows: 2, width: 3, values: &v }]];
    assert!(matches!(store.put_page(&store.root(), &toks, &bad, SaveReason::Cold), Err(KvError::Invalid(_))));
    assert!(matches!(store.put_checkpoint(&store.root(), &toks, &[], SaveReason::Cold), Err(KvError::Invalid(_))));
    // Unknown parent.
    assert!(matches!(
        store.put_page(&ds4_kv::Key([9; 20]), &toks, &rows.layers(), SaveReason::Cold),
        Err(KvError::Missing(_))
    ));
    assert!(matches!(collect(&store, &ds4_kv::Key([9; 20])), Err(KvError::Missing(_))));
    assert!(KvStore::open(dir.path(), identity(), ds4_kv::KvOptions { span_tokens: 100, ..opts(1) }).is_err());
    // A callback error stops the load and comes back unchanged; the entry stays.
    let p = store.put_page(&store.root(), &toks, &rows.layers(), SaveReason::Cold).unwrap();
    let r = store.load(&p.key, |_| Err(KvError::Invalid("engine full".into())));
    assert!(matches!(r, Err(KvError::Invalid(m)) if m == "engine full"));
    assert!(collect(&store, &p.key).is_ok());
}

#[test]
fn stored_pages_use_the_compact_lossless_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), u64::MAX);
    let toks = tokens(40, SPAN as usize);
    let rows = page_rows(0, &toks);
    let p = store.put_page(&store.root(), &toks, &rows.layers(), SaveReason::Cold).unwrap();
    let path = dir.path().join(ds4_kv::disk::file_name(&p.key, EntryKind::Page));
    let h = ds4_kv::disk::verify_file(&path).unwrap();
    let encs: Vec<Encoding> = h.blocks.iter().map(|b| b.encoding).collect();
    assert_eq!(encs, vec![Encoding::Blocked, Encoding::F16, Encoding::Blocked]);
    // 33 KV rows at 448 + 128 + 8 bytes, 32 indexer rows at 256 bytes.
    assert_eq!(h.payload_bytes, 33 * (448 + 128 + 8) + 32 * 256);
    let raw_f32 = (33 * 512 + 32 * 128) * 4;
    assert!(std::fs::metadata(&path).unwrap().len() < raw_f32 as u64 * 35 / 100);
}

#[test]
fn pinned_entries_survive_a_tight_budget_until_released() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path(), u64::MAX);
        save_session(&store, &tokens(50, SPAN as usize + 5), 100).unwrap();
        assert_eq!(store.status().files, 2);
    }
    // Reopened with a one-byte budget and nothing pinned: everything goes, leaf (checkpoint) first.
    let store = open(dir.path(), 1);
    let st = store.status();
    assert_eq!((st.files, st.evicted), (0, 2));

    // Within one process: a fresh save keeps its chain (interior pages and the entry being written are protected),
    // pins keep it through gc, and releasing the session lets the budget take it.
    let a = tokens(51, SPAN as usize + 5);
    save_session(&store, &a, 100).unwrap();
    assert_eq!(store.status().files, 2);
    let m = store.longest_prefix(&a);
    let ids: Vec<_> = m.pages.iter().chain(m.checkpoint.iter()).map(|r| r.id).collect();
    assert_eq!(store.retain(7, &ids), 2);
    let entries = store.entries();
    assert!(entries.iter().any(|e| e.tiers == vec![Tier::Disk] && e.refcount == 1 && e.hits == 1));
    assert_eq!(store.gc().evicted, 0);
    assert_eq!(store.status().files, 2);
    store.release(7);
    let st = store.status();
    assert_eq!((st.files, st.bytes, st.evicted), (0, 0, 4));
    // Ids of evicted entries are stale now.
    assert_eq!(store.retain(8, &ids), 0);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
