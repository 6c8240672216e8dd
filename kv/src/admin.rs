//! Offline maintenance of a cache directory without knowing the model: listing, inspecting and garbage-collecting
//! files of every model in it (what `ds4 kv ls|inspect|gc` prints and does).
//!
//! Each file's chain root is recomputed from the identity text in its own header, so orphans (files whose parent page
//! is gone) are recognised for any model. `gc` removes temp files of dead writers only (a running server's in-flight
//! writes are left alone), corrupt files (header/size checks; with `verify`, every block checksum too), orphans, and
//! then evicts with the same [`crate::policy`] as the store (no hit counts offline: structure, recency, size).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::disk;
use crate::error::KvResult as Result;
use crate::format::{EntryKind, Header};
use crate::key::{Key, ModelIdentity};
use crate::policy::{self, Candidate};

/// One file of a listing.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FileEntry {
    /// Full path.
    pub path: PathBuf,
    /// Its validated header.
    pub header: Header,
    /// File size.
    pub bytes: u64,
    /// Last use (mtime), unix seconds.
    pub last_use: u64,
    /// Files whose parent is this one (pages after it, checkpoints on it).
    pub refs: usize,
    /// Its parent is neither the chain root nor a file in the directory.
    pub orphan: bool,
}

/// Everything in a cache directory.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Listing {
    /// Valid files, by token position then key.
    pub files: Vec<FileEntry>,
    /// Files that failed header/size checks, with the reason.
    pub corrupt: Vec<(PathBuf, String)>,
    /// Temp files (in-flight or left by a killed writer).
    pub temp: Vec<PathBuf>,
}

/// Lists a directory (headers only).
pub fn list(dir: &Path) -> Result<Listing> {
    let scan = disk::scan_dir(dir)?;
    let temp = fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".tmp")))
                .collect()
        })
        .unwrap_or_default();
    let present: HashMap<Key, ()> = scan.files.iter().map(|f| (f.header.key, ())).collect();
    let mut refs: HashMap<Key, usize> = HashMap::new();
    for f in &scan.files {
        *refs.entry(f.header.parent).or_default() += 1;
    }
    let mut files: Vec<FileEntry> = scan
        .files
        .into_iter()
        .map(|f| {
            let root = ModelIdentity::new(f.header.identity.clone()).root(f.header.span_tokens);
            let orphan = f.header.parent != root && !present.contains_key(&f.header.parent);
            FileEntry {
                refs: refs.get(&f.header.key).copied().unwrap_or(0),
                last_use: f.mtime.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
                bytes: f.bytes,
                path: f.path,
                header: f.header,
                orphan,
            }
        })
        .collect();
    files.sort_by_key(|f| (f.header.identity.clone(), f.header.token_start, f.header.key));
    Ok(Listing { files, corrupt: scan.corrupt, temp })
}

/// What `gc` did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GcSummary {
    /// Temp files of dead writers removed.
    pub temp_removed: usize,
    /// Corrupt files removed.
    pub corrupt_removed: usize,
    /// Orphans removed.
    pub orphans_removed: usize,
    /// Files evicted for the budget.
    pub evicted: usize,
    /// Entry bytes before.
    pub bytes_before: u64,
    /// Entry bytes after.
    pub bytes_after: u64,
}

/// Cleans `dir` and, with `max_bytes`, evicts until the entry files fit. `verify` also reads every payload.
pub fn gc(dir: &Path, max_bytes: Option<u64>, verify: bool, half_life_secs: f64) -> Result<GcSummary> {
    let mut s = GcSummary { temp_removed: disk::clean_temp_files(dir, false), ..GcSummary::default() };
    let listing = list(dir)?;
    s.bytes_before = listing.files.iter().map(|f| f.bytes).sum();
    for (p, why) in &listing.corrupt {
        tracing::warn!(file = %p.display(), reason = %why, "removing corrupt KV file");
        if fs::remove_file(p).is_ok() {
            s.corrupt_removed += 1;
        }
    }
    let mut files = Vec::new();
    for f in listing.files {
        if verify {
            if let Err(e) = disk::verify_file(&f.path) {
                tracing::warn!(file = %f.path.display(), error = %e, "removing corrupt KV file");
                if fs::remove_file(&f.path).is_ok() {
                    s.corrupt_removed += 1;
                }
                continue;
            }
        }
        files.push(f);
    }
    // Orphans, repeatedly (removing one can orphan its children).
    loop {
        let present: HashMap<Key, ()> = files.iter().map(|f| (f.header.key, ())).collect();
        let before = files.len();
        files.retain(|f| {
            let root = ModelIdentity::new(f.header.identity.clone()).root(f.header.span_tokens);
            let ok = f.header.parent == root || present.contains_key(&f.header.parent);
            if !ok && fs::remove_file(&f.path).is_ok() {
                s.orphans_removed += 1;
            }
            ok
        });
        if files.len() == before {
            break;
        }
    }
    if let Some(max) = max_bytes {
        evict(&mut files, max, half_life_secs, &mut s.evicted);
    }
    s.bytes_after = files.iter().map(|f| f.bytes).sum();
    Ok(s)
}

fn evict(files: &mut Vec<FileEntry>, max: u64, half_life_secs: f64, evicted: &mut usize) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    while files.iter().map(|f| f.bytes).sum::<u64>() > max {
        let idx: HashMap<Key, usize> = files.iter().enumerate().map(|(i, f)| (f.header.key, i)).collect();
        let mut children: HashMap<Key, u32> = HashMap::new();
        let mut below: HashMap<Key, u32> = HashMap::new();
        for f in files.iter() {
            *children.entry(f.header.parent).or_default() += 1;
            if f.header.kind == EntryKind::Checkpoint {
                let mut k = f.header.parent;
                loop {
                    *below.entry(k).or_default() += 1;
                    match idx.get(&k) {
                        Some(&p) => k = files[p].header.parent,
                        None => break,
                    }
                }
            }
        }
        let cands: Vec<Candidate> = files
            .iter()
            .enumerate()
            .map(|(i, f)| Candidate {
                id: i,
                bytes: f.bytes,
                hits: 0,
                sharers: match f.header.kind {
                    EntryKind::Page => below.get(&f.header.key).copied().unwrap_or(0),
                    EntryKind::Checkpoint => below.get(&f.header.parent).copied().unwrap_or(1).saturating_sub(1),
                },
                age_secs: now - f.last_use as f64,
                pinned: false,
                children: children.get(&f.header.key).copied().unwrap_or(0),
            })
            .collect();
        let Some(v) = policy::pick_victim(&cands, half_life_secs) else { break };
        let f = files.swap_remove(v);
        match fs::remove_file(&f.path) {
            Ok(()) => *evicted += 1,
            Err(e) => tracing::warn!(file = %f.path.display(), error = %e, "could not remove KV file"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{RowBlock, SaveReason};
    use crate::store::{KvOptions, KvStore};

    fn fill(dir: &Path, id: &str, seed: u32) -> Vec<u32> {
        let s =
            KvStore::open(dir, ModelIdentity::new(id), KvOptions { span_tokens: 128, ..KvOptions::default() }).unwrap();
        let toks: Vec<u32> = (0..256 + 5).map(|i| i * 7 + seed).collect();
        let v: Vec<f32> = (0..4096).map(|i| (i as f32 * 0.37 + seed as f32).sin()).collect();
        let rows = vec![vec![RowBlock { tag: 0, rows: 4, width: 1024, values: &v }]];
        let p1 = s.put_page(&s.root(), &toks[..128], &rows, SaveReason::Cold).unwrap();
        let p2 = s.put_page(&p1.key, &toks[128..256], &rows, SaveReason::Cold).unwrap();
        s.put_checkpoint(&p2.key, &toks[256..], &rows, SaveReason::Evict).unwrap();
        toks
    }

    #[test]
    fn list_and_gc_across_models() {
        let dir = tempfile::tempdir().unwrap();
        fill(dir.path(), "model-a", 1);
        fill(dir.path(), "model-b", 2);
        let l = list(dir.path()).unwrap();
        assert_eq!(l.files.len(), 6);
        assert_eq!(l.files.iter().filter(|f| f.refs == 1).count(), 4); // each model: two pages with one child
        assert!(l.files.iter().all(|f| !f.orphan));
        // Break model-b's chain and add a dead writer's temp file and a corrupt file.
        let b_first =
            l.files.iter().find(|f| f.header.identity == "model-b" && f.header.token_start == 0).unwrap().path.clone();
        fs::remove_file(&b_first).unwrap();
        fs::write(dir.path().join(format!(".{}.4000000002.0.tmp", "ee".repeat(20))), b"x").unwrap();
        fs::write(dir.path().join(format!("{}.ckpt", "ff".repeat(20))), b"short").unwrap();
        let total: u64 = l.files.iter().filter(|f| f.header.identity == "model-a").map(|f| f.bytes).sum();
        let s = gc(dir.path(), Some(total - 1), true, 3600.0).unwrap();
        assert_eq!((s.temp_removed, s.corrupt_removed, s.orphans_removed), (1, 1, 2));
        assert_eq!(s.evicted, 1); // model-a's checkpoint (the only leaf) goes first
        let l = list(dir.path()).unwrap();
        assert_eq!(l.files.len(), 2);
        assert!(l.files.iter().all(|f| f.header.kind == EntryKind::Page && f.header.identity == "model-a"));
        assert_eq!(s.bytes_after, l.files.iter().map(|f| f.bytes).sum::<u64>());
    }
}
