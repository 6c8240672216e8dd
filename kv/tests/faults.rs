//! Faults: torn / truncated / bit-flipped files, orphans, leftover temp files, a disk that cannot be written.
//!
//! Unwritable directories: tests run as root, where `chmod 0555` does not stop writes. The reliable simulation used
//! here is a cache path that stops being a directory (its parent, or the path itself, is a regular file), which fails
//! every create/write with ENOTDIR for any user. A real ENOSPC is tested on a 256 KiB tmpfs when this process may
//! mount one (root with CAP_SYS_ADMIN); otherwise that test says so and returns. `chmod 0555` is tested when not root.

mod common;

use std::fs;
use std::path::Path;

use common::*;
use ds4_kv::{disk, EntryKind, KvError, KvOptions, KvStore, Tier};

fn file_of(dir: &Path, key: &ds4_kv::Key, kind: EntryKind) -> std::path::PathBuf {
    dir.join(disk::file_name(key, kind))
}

#[test]
fn bit_flip_is_detected_at_load_and_the_entry_and_its_descendants_removed() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), u64::MAX);
    let toks = tokens(1, 3 * SPAN as usize + 9);
    save_session(&store, &toks, 500).unwrap();
    let m = store.longest_prefix(&toks);
    assert_eq!(m.matched_tokens, toks.len());
    // Flip one bit in the middle of page 1's payload.
    let path = file_of(dir.path(), &m.pages[1].key, EntryKind::Page);
    let mut bytes = fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0x10;
    fs::write(&path, &bytes).unwrap();
    assert!(collect(&store, &m.pages[0].key).is_ok());
    assert!(matches!(collect(&store, &m.pages[1].key), Err(KvError::Corrupt(_))));
    let st = store.status();
    assert_eq!(st.corrupt_removed, 1);
    assert_eq!((st.pages, st.checkpoints, st.files), (1, 0, 1)); // pages 2, 3 and the checkpoint hung off page 1
    assert!(!path.exists());
    let again = store.longest_prefix(&toks);
    assert_eq!((again.pages.len(), again.checkpoint), (1, None));
    assert!(matches!(collect(&store, &m.checkpoint.unwrap().key), Err(KvError::Missing(_))));
    // A file deleted behind the store's back: Missing, and dropped from the index.
    fs::remove_file(file_of(dir.path(), &m.pages[0].key, EntryKind::Page)).unwrap();
    assert!(matches!(collect(&store, &m.pages[0].key), Err(KvError::Missing(_))));
    assert_eq!(store.status().files, 0);
    assert!(store.longest_prefix(&toks).pages.is_empty());
}

#[test]
fn torn_truncated_garbage_orphan_and_temp_files_are_cleaned_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let a = tokens(2, 2 * SPAN as usize + 1);
    let b = tokens(3, 2 * SPAN as usize + 1);
    let c = tokens(4, SPAN as usize + 1);
    let (ma, mb, mc) = {
        let store = open(dir.path(), u64::MAX);
        save_session(&store, &a, 100).unwrap();
        save_session(&store, &b, 100).unwrap();
        save_session(&store, &c, 100).unwrap();
        (store.longest_prefix(&a), store.longest_prefix(&b), store.longest_prefix(&c))
    };
    // a: truncate its checkpoint (torn write by a non-atomic writer).
    let pa = file_of(dir.path(), &ma.checkpoint.unwrap().key, EntryKind::Checkpoint);
    let len = fs::metadata(&pa).unwrap().len();
    fs::OpenOptions::new().write(true).open(&pa).unwrap().set_len(len - 7).unwrap();
    // b: delete its first page: the second page and the checkpoint are orphans.
    fs::remove_file(file_of(dir.path(), &mb.pages[0].key, EntryKind::Page)).unwrap();
    // garbage under a valid-looking name, a leftover temp file from a dead writer, an unrelated file
    fs::write(dir.path().join(format!("{}.page", "ab".repeat(20))), b"DS4KV garbage").unwrap();
    fs::write(dir.path().join(format!(".{}.4000000001.3.tmp", "cd".repeat(20))), vec![0u8; 4096]).unwrap();
    fs::write(dir.path().join("notes.txt"), b"keep me").unwrap();

    let store = open(dir.path(), u64::MAX);
    let st = store.status();
    assert_eq!(st.temp_removed, 1);
    assert_eq!(st.corrupt_removed, 1 + 2 + 1); // truncated ckpt, two orphans of b, garbage
    assert_eq!(store.longest_prefix(&a).pages.len(), 2);
    assert!(store.longest_prefix(&a).checkpoint.is_none());
    assert_eq!(store.longest_prefix(&b).pages.len(), 0);
    assert_eq!(store.longest_prefix(&c).checkpoint.map(|k| k.key), mc.checkpoint.map(|k| k.key));
    let mut names: Vec<String> =
        fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names.len(), 2 + 2 + 1, "{names:?}"); // a's pages, c's page + ckpt, notes.txt
    assert!(names.contains(&"notes.txt".to_string()));
    // Every remaining entry loads cleanly.
    for e in store.entries() {
        collect(&store, &e.key).unwrap();
    }
}

#[test]
fn unusable_directory_at_open_switches_disk_off_and_keeps_working() {
    let base = tempfile::tempdir().unwrap();
    let file = base.path().join("plain-file");
    fs::write(&file, b"x").unwrap();
    let dir = file.join("kv"); // parent is a regular file: ENOTDIR for everyone, root included
    let toks = tokens(5, SPAN as usize + 3);

    let store = open(&dir, u64::MAX);
    let st = store.status();
    assert!(!st.enabled);
    assert!(st.last_error.as_deref().unwrap_or("").contains("plain-file"), "{:?}", st.last_error);
    assert!(matches!(save_session(&store, &toks, 10), Err(KvError::DiskOff(_))));
    assert_eq!(store.longest_prefix(&toks).matched_tokens, 0);
    assert_eq!(store.gc().evicted, 0);

    // With a host budget the entries live in memory instead.
    let host = KvStore::open(&dir, identity(), KvOptions { host_budget_bytes: 64 << 20, ..opts(u64::MAX) }).unwrap();
    save_session(&host, &toks, 10).unwrap();
    let m = host.longest_prefix(&toks);
    assert_eq!(m.matched_tokens, toks.len());
    let want = page_rows(0, &toks[..SPAN as usize]);
    assert_eq!(collect(&host, &m.pages[0].key).unwrap()[0].4, want.csa_kv);
    assert!(host.entries().iter().all(|e| e.tiers == vec![Tier::Host]));
    let st = host.status();
    assert_eq!((st.host_entries, st.files), (2, 0));
    assert!(!host.retry_disk());
}

#[test]
fn write_failure_mid_run_switches_disk_off_visibly_and_retry_recovers() {
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("kv");
    let store = KvStore::open(&dir, identity(), KvOptions { host_budget_bytes: 64 << 20, ..opts(u64::MAX) }).unwrap();
    let a = tokens(6, SPAN as usize + 3);
    save_session(&store, &a, 10).unwrap();
    assert!(store.status().enabled);
    // The directory goes away and a regular file takes its path: every write fails from now on.
    let moved = base.path().join("kv-moved");
    fs::rename(&dir, &moved).unwrap();
    fs::write(&dir, b"not a directory").unwrap();
    let b = tokens(7, SPAN as usize + 3);
    save_session(&store, &b, 10).unwrap(); // lands in the host tier
    let st = store.status();
    assert!(!st.enabled);
    assert_eq!(st.write_errors, 1);
    assert!(st.last_error.is_some());
    assert_eq!(st.host_entries, 2);
    assert_eq!(store.longest_prefix(&b).matched_tokens, b.len());
    // No temp file was left next to the cache.
    assert_eq!(fs::read_dir(base.path()).unwrap().count(), 2);
    // Restore the directory: retry switches disk caching back on and new saves go to disk again.
    fs::remove_file(&dir).unwrap();
    fs::rename(&moved, &dir).unwrap();
    assert!(store.retry_disk());
    let c = tokens(8, SPAN as usize + 3);
    save_session(&store, &c, 10).unwrap();
    assert_eq!(store.status().files, 2 + 2);
    assert_eq!(store.longest_prefix(&a).matched_tokens, a.len());
}

/// Unmounts on drop.
struct Mount(std::path::PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn full_disk_enospc_on_a_tiny_tmpfs() {
    let base = tempfile::tempdir().unwrap();
    let mnt = base.path().join("small");
    fs::create_dir(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&mnt)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIP full_disk_enospc_on_a_tiny_tmpfs: cannot mount a tmpfs here (needs CAP_SYS_ADMIN)");
        return;
    }
    let _guard = Mount(mnt.clone());
    let store = open(&mnt, u64::MAX); // budget larger than the disk: the disk fills first
    let mut saved = 0;
    let mut failed = None;
    for i in 0..200 {
        match save_session(&store, &tokens(100 + i, SPAN as usize + 1), 1000) {
            Ok(_) => saved += 1,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    assert!(saved > 0);
    assert!(matches!(failed, Some(KvError::DiskOff(_))), "{failed:?}");
    let st = store.status();
    assert!(!st.enabled);
    assert!(st.last_error.as_deref().unwrap_or("").contains("No space left"), "{:?}", st.last_error);
    // No temp file left behind, everything indexed still loads.
    assert!(fs::read_dir(&mnt).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp")));
    for e in store.entries() {
        collect(&store, &e.key).unwrap();
    }
    // Freeing space (gc with a smaller budget from a fresh open) and retrying brings it back.
    drop(store);
    let store = open(&mnt, 64 << 10);
    assert!(store.status().enabled);
    assert!(store.status().bytes <= 64 << 10);
}

#[test]
fn read_only_directory_when_not_root() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("ro");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o555)).unwrap();
    if fs::write(dir.join("probe"), b"x").is_ok() {
        eprintln!("SKIP read_only_directory_when_not_root: running as root, chmod does not stop writes");
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        return;
    }
    let store = open(&dir, u64::MAX);
    assert!(!store.status().enabled);
    assert!(matches!(save_session(&store, &tokens(9, 10), 1), Err(KvError::DiskOff(_))));
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    assert!(store.retry_disk());
}

#[test]
fn host_tier_has_its_own_budget_while_disk_is_off() {
    let base = tempfile::tempdir().unwrap();
    let file = base.path().join("f");
    fs::write(&file, b"x").unwrap();
    let one = {
        let probe = tempfile::tempdir().unwrap();
        let s = open(probe.path(), u64::MAX);
        save_session(&s, &tokens(300, SPAN as usize + 2), 100).unwrap();
        s.status().bytes
    };
    let budget = one * 2 + one / 2;
    let store =
        KvStore::open(file.join("kv"), identity(), KvOptions { host_budget_bytes: budget, ..opts(u64::MAX) }).unwrap();
    for i in 0..6 {
        let t = tokens(300 + i, SPAN as usize + 2);
        save_session(&store, &t, 100).unwrap();
        let st = store.status();
        assert!(st.host_bytes <= budget, "{} > {budget}", st.host_bytes);
    }
    let st = store.status();
    assert_eq!(st.evicted, 4 * 2);
    assert_eq!(st.host_entries, 4);
    let last = tokens(305, SPAN as usize + 2);
    assert_eq!(store.longest_prefix(&last).matched_tokens, last.len());
}
