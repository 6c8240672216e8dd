//! Entries as self-validating blobs: `export_entry` on one store, `import_entry` on another (the remote tier's
//! path). A copied restore point resumes like the original; torn, bit-flipped, foreign-model, foreign-span and
//! misplaced blobs are refused with `Corrupt` and leave the importing store unchanged.

mod common;

use common::*;
use ds4_kv::{EntryKind, KvError, KvOptions, KvStore, ModelIdentity};

/// Copies the restore point of `toks` (pages + checkpoint) from `src` to `dst` through blobs; returns the count.
fn copy_restore_point(src: &KvStore, dst: &KvStore, toks: &[u32]) -> usize {
    let m = src.longest_prefix(toks);
    let ck = m.checkpoint.expect("a checkpoint");
    let mut parent = dst.root();
    let mut n = 0;
    for (i, p) in m.pages.iter().enumerate() {
        let blob = src.export_entry(&p.key).unwrap();
        assert_eq!(blob.kind, EntryKind::Page);
        let span = SPAN as usize;
        let r = dst.import_entry(EntryKind::Page, &parent, &toks[i * span..(i + 1) * span], &blob.image).unwrap();
        assert_eq!(r.key, p.key);
        parent = r.key;
        n += 1;
    }
    let blob = src.export_entry(&ck.key).unwrap();
    let tail = &toks[m.pages.len() * SPAN as usize..m.matched_tokens];
    assert_eq!(blob.tokens, tail);
    dst.import_entry(EntryKind::Checkpoint, &parent, tail, &blob.image).unwrap();
    n + 1
}

#[test]
fn a_restore_point_copied_as_blobs_resumes_identically_on_disk_and_in_memory() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let src = open(a.path(), u64::MAX);
    let toks = tokens(1, 2 * SPAN as usize + 30);
    let ck = save_session(&src, &toks, 700).unwrap();
    let mem = KvStore::in_memory(identity(), KvOptions { host_budget_bytes: 64 << 20, ..opts(0) }).unwrap();
    for dst in [open(b.path(), u64::MAX), mem] {
        assert_eq!(copy_restore_point(&src, &dst, &toks), 3);
        let m = dst.longest_prefix(&toks);
        assert_eq!(m.matched_tokens, toks.len());
        assert_eq!(m.checkpoint.map(|c| c.key), Some(ck.key));
        for r in m.pages.iter().chain(m.checkpoint.iter()) {
            assert_eq!(collect(&dst, &r.key).unwrap(), collect(&src, &r.key).unwrap());
        }
        // Importing again is a no-op.
        assert_eq!(copy_restore_point(&src, &dst, &toks), 3);
        // The lineage of the checkpoint: its pages in order, then the checkpoint.
        let keys: Vec<_> = dst.lineage(&ck.key).iter().map(|r| r.key).collect();
        let want: Vec<_> = m.pages.iter().chain(m.checkpoint.iter()).map(|r| r.key).collect();
        assert_eq!(keys, want);
    }
    assert_eq!(std::fs::read_dir(b.path()).unwrap().count(), 3, "three files on disk");
}

#[test]
fn torn_corrupt_foreign_and_misplaced_blobs_are_refused() {
    let a = tempfile::tempdir().unwrap();
    let src = open(a.path(), u64::MAX);
    let toks = tokens(3, SPAN as usize + 20);
    save_session(&src, &toks, 300).unwrap();
    let m = src.longest_prefix(&toks);
    let page = src.export_entry(&m.pages[0].key).unwrap();
    let ck = src.export_entry(&m.checkpoint.unwrap().key).unwrap();
    let span = SPAN as usize;
    let fresh = || KvStore::in_memory(identity(), KvOptions { host_budget_bytes: 64 << 20, ..opts(0) }).unwrap();
    let is_corrupt = |r: ds4_kv::KvResult<ds4_kv::EntryRef>| matches!(r, Err(KvError::Corrupt(_)));

    let dst = fresh();
    let root = dst.root();
    // Torn: every truncation, and trailing bytes.
    for cut in [0, 1, 100, page.image.len() / 2, page.image.len() - 1] {
        assert!(is_corrupt(dst.import_entry(EntryKind::Page, &root, &toks[..span], &page.image[..cut])), "cut {cut}");
    }
    let mut long = page.image.clone();
    long.push(0);
    assert!(is_corrupt(dst.import_entry(EntryKind::Page, &root, &toks[..span], &long)));
    // A flipped bit anywhere (sampled): header, layout, payload.
    for at in (0..page.image.len()).step_by(page.image.len() / 97 + 1) {
        let mut bad = page.image.clone();
        bad[at] ^= 0x10;
        assert!(is_corrupt(dst.import_entry(EntryKind::Page, &root, &toks[..span], &bad)), "flip at {at}");
    }
    // Another prompt's tokens (the blob is not the entry the lookup expects), another kind.
    let mut other = toks[..span].to_vec();
    other[5] ^= 1;
    assert!(is_corrupt(dst.import_entry(EntryKind::Page, &root, &other, &page.image)));
    assert!(is_corrupt(dst.import_entry(EntryKind::Checkpoint, &root, &toks[..20], &page.image)));
    assert_eq!(dst.status().host_entries, 0, "nothing was stored");
    // A checkpoint before its page is there: missing parent.
    let tail = &toks[span..];
    assert!(matches!(
        dst.import_entry(EntryKind::Checkpoint, &m.pages[0].key, tail, &ck.image),
        Err(KvError::Missing(_))
    ));

    // A store of another model (or another span) refuses the blob even with matching tokens.
    let foreign = KvStore::in_memory(
        ModelIdentity::new("deepseek4-flash-test layers=3 dim=512 quant=q4 sim=1"),
        KvOptions { host_budget_bytes: 64 << 20, ..opts(0) },
    )
    .unwrap();
    assert!(is_corrupt(foreign.import_entry(EntryKind::Page, &foreign.root(), &toks[..span], &page.image)));
    let wide =
        KvStore::in_memory(identity(), KvOptions { span_tokens: 256, host_budget_bytes: 64 << 20, ..opts(0) }).unwrap();
    let t256 = tokens(4, 256);
    assert!(is_corrupt(wide.import_entry(EntryKind::Page, &wide.root(), &t256, &page.image)));

    // The good blobs still go in afterwards.
    let p = dst.import_entry(EntryKind::Page, &root, &toks[..span], &page.image).unwrap();
    dst.import_entry(EntryKind::Checkpoint, &p.key, tail, &ck.image).unwrap();
    assert_eq!(dst.longest_prefix(&toks).matched_tokens, toks.len());
}

#[test]
fn an_in_memory_store_needs_a_host_budget_and_keeps_entries_off_disk() {
    assert!(matches!(KvStore::in_memory(identity(), opts(0)), Err(KvError::Invalid(_))));
    let mem = KvStore::in_memory(identity(), KvOptions { host_budget_bytes: 64 << 20, ..opts(0) }).unwrap();
    assert!(mem.is_memory() && mem.accepts_entries() && mem.serves_entries());
    let toks = tokens(5, SPAN as usize + 3);
    save_session(&mem, &toks, 100).unwrap();
    let st = mem.status();
    assert_eq!((st.files, st.host_entries), (0, 2));
    assert_eq!(mem.longest_prefix(&toks).matched_tokens, toks.len());
    assert!(!mem.retry_disk());
}
