//! Crash-safe file publication and directory scanning.
//!
//! Publication protocol ([`publish`]): write the whole file to `.<stem>.<pid>.<n>.tmp` in the cache directory,
//! `fsync` it, `rename` it to `<key-hex>.<page|ckpt>`, `fsync` the directory. A reader only ever opens final names, so
//! a process killed at any point leaves either no final file or a complete one (power loss is covered by the two
//! fsyncs). Leftover temp files are removed by [`clean_temp_files`] when their writer is gone (its pid no longer runs,
//! checked through `/proc` on Linux; elsewhere temp files older than an hour).
//!
//! [`scan_dir`] reads every final file's header once (no payload), checks the file size against it and the name
//! against the key; files that fail are reported as corrupt for the caller to remove.

use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::error::{KvError, KvResult as Result};
use crate::format::{self, EntryKind, EntryMeta, Header, RowBlock};
use crate::key::Key;

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Final file name of an entry.
pub fn file_name(key: &Key, kind: EntryKind) -> String {
    format!("{}.{}", key.hex(), kind.ext())
}

/// Parses a final file name into key and kind.
pub fn parse_file_name(name: &str) -> Option<(Key, EntryKind)> {
    let (stem, ext) = name.split_once('.')?;
    let kind = match ext {
        "page" => EntryKind::Page,
        "ckpt" => EntryKind::Checkpoint,
        _ => return None,
    };
    Some((Key::from_hex(stem)?, kind))
}

fn temp_name(key: &Key) -> String {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(".{}.{}.{n}.tmp", key.hex(), std::process::id())
}

/// Writes an entry atomically into `dir`; returns its final path and header. On error the temp file is removed.
pub fn publish(dir: &Path, meta: &EntryMeta<'_>, groups: &[Vec<RowBlock<'_>>]) -> Result<(PathBuf, Header)> {
    let tmp = dir.join(temp_name(&meta.key));
    let final_path = dir.join(file_name(&meta.key, meta.kind));
    let r = (|| {
        let f =
            OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| KvError::io("create", &tmp, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let header = format::write_entry(&mut w, &tmp, meta, groups)?;
        w.flush().map_err(|e| KvError::io("write", &tmp, e))?;
        let f = w.into_inner().map_err(|e| KvError::io("write", &tmp, e.into_error()))?;
        f.sync_all().map_err(|e| KvError::io("fsync", &tmp, e))?;
        drop(f);
        fs::rename(&tmp, &final_path).map_err(|e| KvError::io("rename", &final_path, e))?;
        sync_dir(dir)?;
        Ok(header)
    })();
    match r {
        Ok(h) => Ok((final_path, h)),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Writes an entry's complete file image (already validated by the caller) atomically into `dir`, like
/// [`publish`].
pub fn publish_image(dir: &Path, key: &Key, kind: EntryKind, image: &[u8]) -> Result<()> {
    let tmp = dir.join(temp_name(key));
    let final_path = dir.join(file_name(key, kind));
    let r = (|| {
        let mut f =
            OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| KvError::io("create", &tmp, e))?;
        f.write_all(image).map_err(|e| KvError::io("write", &tmp, e))?;
        f.sync_all().map_err(|e| KvError::io("fsync", &tmp, e))?;
        drop(f);
        fs::rename(&tmp, &final_path).map_err(|e| KvError::io("rename", &final_path, e))?;
        sync_dir(dir)
    })();
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r
}

/// Fsyncs a directory so a rename in it is durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| KvError::io("fsync dir", dir, e))
}

fn writer_alive(pid: u32) -> Option<bool> {
    if pid == std::process::id() {
        return Some(true);
    }
    if cfg!(target_os = "linux") {
        return Some(Path::new("/proc").join(pid.to_string()).exists());
    }
    None
}

/// Removes temp files left by dead writers (or, without `/proc`, older than an hour). Returns how many.
/// `all = true` removes every temp file not written by this process (for `ds4 kv gc` with no server running).
pub fn clean_temp_files(dir: &Path, all: bool) -> usize {
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for ent in rd.flatten() {
        let name = ent.file_name().to_string_lossy().into_owned();
        if !(name.starts_with('.') && name.ends_with(".tmp")) {
            continue;
        }
        let pid: Option<u32> = name.split('.').nth(2).and_then(|p| p.parse().ok());
        let stale = match pid.map(writer_alive) {
            Some(Some(true)) => pid != Some(std::process::id()) && all,
            Some(Some(false)) => true,
            _ => {
                all || ent
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > Duration::from_secs(3600))
            }
        };
        if stale && fs::remove_file(ent.path()).is_ok() {
            tracing::info!(file = %ent.path().display(), "removed leftover KV temp file");
            removed += 1;
        }
    }
    removed
}

/// A final file found by [`scan_dir`].
#[derive(Debug)]
pub struct Scanned {
    /// Full path.
    pub path: PathBuf,
    /// Its validated header.
    pub header: Header,
    /// File size in bytes.
    pub bytes: u64,
    /// Last modification (the store's "last use").
    pub mtime: SystemTime,
}

/// Result of scanning a directory.
#[derive(Debug, Default)]
pub struct Scan {
    /// Valid files.
    pub files: Vec<Scanned>,
    /// Files that failed validation, with the reason.
    pub corrupt: Vec<(PathBuf, String)>,
}

/// Reads the header of every `<key>.page|ckpt` file in `dir`.
pub fn scan_dir(dir: &Path) -> Result<Scan> {
    let rd = fs::read_dir(dir).map_err(|e| KvError::io("read dir", dir, e))?;
    let mut scan = Scan::default();
    for ent in rd.flatten() {
        let name = ent.file_name().to_string_lossy().into_owned();
        let Some((key, kind)) = parse_file_name(&name) else { continue };
        let path = ent.path();
        match check_file(&path, key, kind) {
            Ok((header, bytes, mtime)) => scan.files.push(Scanned { path, header, bytes, mtime }),
            Err(KvError::Io { err, .. }) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => scan.corrupt.push((path, e.to_string())),
        }
    }
    scan.files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(scan)
}

/// Validates one file's header, size and name; returns header, size and mtime.
pub fn check_file(path: &Path, key: Key, kind: EntryKind) -> Result<(Header, u64, SystemTime)> {
    let f = File::open(path).map_err(|e| KvError::io("open", path, e))?;
    let md = f.metadata().map_err(|e| KvError::io("stat", path, e))?;
    let mut r = BufReader::with_capacity(64 << 10, f);
    let header = format::read_header(&mut r, path)?;
    if header.key != key || header.kind != kind {
        return Err(KvError::Corrupt(format!("{}: header key/kind does not match the file name", path.display())));
    }
    if header.file_bytes() != md.len() {
        return Err(KvError::Corrupt(format!(
            "{}: size {} but header implies {}",
            path.display(),
            md.len(),
            header.file_bytes()
        )));
    }
    Ok((header, md.len(), md.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
}

/// Reads a whole file and checks every block checksum (for `inspect`/`gc --verify`); returns the header.
pub fn verify_file(path: &Path) -> Result<Header> {
    let f = File::open(path).map_err(|e| KvError::io("open", path, e))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let header = format::read_header(&mut r, path)?;
    format::stream_blocks(&mut r, path, &header, |_| Ok(()))?;
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::SaveReason;

    #[test]
    fn publish_scan_and_temp_cleanup() {
        let dir = tempfile::tempdir().unwrap();
        let v = vec![1.0f32; 64];
        let key = Key([7; 20]);
        let meta = EntryMeta {
            kind: EntryKind::Page,
            reason: SaveReason::Cold,
            identity: "m",
            model: Key([1; 20]),
            key,
            parent: Key([0; 20]),
            span_tokens: 1,
            token_start: 0,
            tokens: &[3],
            created: 0,
        };
        let (path, h) =
            publish(dir.path(), &meta, &[vec![RowBlock { tag: 0, rows: 1, width: 64, values: &v }]]).unwrap();
        assert_eq!(path.file_name().unwrap().to_str().unwrap(), file_name(&key, EntryKind::Page));
        // A temp file from a pid that cannot exist, and one of ours.
        fs::write(dir.path().join(format!(".{}.4000000000.0.tmp", key.hex())), b"junk").unwrap();
        fs::write(dir.path().join(format!(".{}.{}.99.tmp", key.hex(), std::process::id())), b"junk").unwrap();
        assert_eq!(clean_temp_files(dir.path(), false), 1);
        let scan = scan_dir(dir.path()).unwrap();
        assert_eq!(scan.files.len(), 1);
        assert_eq!(scan.files[0].header.key, h.key);
        assert_eq!(verify_file(&path).unwrap().tokens, vec![3]);
        // Renamed under another key: rejected.
        let other = dir.path().join(file_name(&Key([8; 20]), EntryKind::Page));
        fs::rename(&path, &other).unwrap();
        let scan = scan_dir(dir.path()).unwrap();
        assert_eq!((scan.files.len(), scan.corrupt.len()), (0, 1));
        assert_eq!(parse_file_name("x.page"), None);
    }
}
