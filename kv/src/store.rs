//! [`KvStore`]: the prefix-shared, budgeted, crash-safe store of pages and checkpoints.
//!
//! How to use it (the server's view):
//! * `KvStore::open(dir, identity, options)` once at start: scans `dir` (headers only, once), removes temp files of
//!   dead writers, corrupt files and orphans, rebuilds the index, enforces the budget. A directory that cannot be
//!   created or written does not fail `open`: disk caching is switched off and [`KvStore::status`] says why — unless
//!   it can still be read (a read-only mount): then the entries in it are indexed and served, and new entries go to
//!   the host tier only (`status().read_only`).
//! * On a new prompt: [`KvStore::longest_prefix`] → load the pages and the checkpoint with [`KvStore::load`]
//!   (streamed, each block checksummed before the callback sees it), prefill only the rest. If a load fails
//!   (corrupt file: it is removed; the error is returned), discard what the callback received and look up again.
//! * To save a session at position `n`: [`KvStore::page_chain`] tells which full spans are already stored; put the
//!   missing ones in order with [`KvStore::put_page`] (parent = previous page key, the chain root for the first),
//!   then [`KvStore::put_checkpoint`] with the tail tokens after the last full page. Saving an existing key is a
//!   cheap no-op (prefix sharing: two sessions with the same prefix produce the same keys).
//! * [`KvStore::retain`] the entries a live session uses so eviction leaves them alone; [`KvStore::release`] at the
//!   end.
//!
//! Resumption needs a checkpoint: DeepSeek V4 attends over the raw sliding window (the last 128 uncompressed KV rows
//! of every layer) and carries compressor/indexer frontier state, none of which is in the pages. So `longest_prefix`
//! returns the longest prefix that ends at a checkpoint; when there is none it returns the longest page chain with
//! `checkpoint: None`, which is only useful to a caller that has the tail state some other way (e.g. a live session
//! in RAM forking at a page boundary) — a caller without it must prefill from token 0.
//!
//! Pages are immutable full spans; a session that diverges inside a span simply produces a different page key from
//! the common parent on, and its partial-span state lives in its own checkpoint (copy on write of the partial tail).
//!
//! Locking: one `parking_lot::Mutex` over the index; file writes and reads run outside it. Faults: an I/O error while
//! writing switches disk caching off (counted, visible in `status()`); entries then go to the host tier (in-memory file
//! images, `host_budget_bytes`), or are refused with [`KvError::DiskOff`] when that budget is 0. Eviction: see
//! [`crate::policy`].

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, Cursor, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::disk;
use crate::error::{KvError, KvResult as Result};
use crate::format::{self, EntryKind, EntryMeta, RowBlock, RowsView, SaveReason};
use crate::key::{checkpoint_key, page_key, Key, ModelIdentity};
use crate::policy::{self, Candidate};
use crate::table::{EntryId, NewEntry, Storage, Table, Tier};

/// Store configuration.
#[derive(Clone, Debug)]
pub struct KvOptions {
    /// Tokens per page; must be a positive multiple of `span_multiple_of`.
    pub span_tokens: u32,
    /// The largest compression ratio of the model (128 for Flash): spans must be a multiple so that no compressed
    /// block straddles two pages.
    pub span_multiple_of: u32,
    /// Disk budget (bytes of page and checkpoint files).
    pub disk_budget_bytes: u64,
    /// Memory for entries kept in-process while disk caching is off (0 = do not keep them).
    pub host_budget_bytes: u64,
    /// Recency half-life of the eviction score.
    pub half_life_secs: f64,
}

impl Default for KvOptions {
    fn default() -> KvOptions {
        KvOptions {
            span_tokens: 256,
            span_multiple_of: 128,
            disk_budget_bytes: 4 << 30,
            host_budget_bytes: 0,
            half_life_secs: 6.0 * 3600.0,
        }
    }
}

/// A live entry: id (for `retain`, `mark_device`) and key (for `load`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryRef {
    /// Table id.
    pub id: EntryId,
    /// Content key.
    pub key: Key,
}

/// Result of [`KvStore::longest_prefix`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens covered: `pages.len() * span + checkpoint tail` with a checkpoint, `pages.len() * span` without.
    pub matched_tokens: usize,
    /// The page chain from the first token, in order.
    pub pages: Vec<EntryRef>,
    /// The checkpoint to resume from (None: pages only, see the module docs).
    pub checkpoint: Option<EntryRef>,
}

/// What [`KvStore::load`] read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadInfo {
    /// Page or checkpoint.
    pub kind: EntryKind,
    /// Tokens before the entry.
    pub token_start: u64,
    /// The entry's own token ids.
    pub tokens: Vec<u32>,
    /// Group (layer) count.
    pub groups: u32,
    /// Row blocks handed to the callback.
    pub blocks: usize,
    /// Stored bytes.
    pub bytes: u64,
}

/// One entry, for listings and metrics.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EntryInfo {
    /// Key (hex in JSON).
    #[serde(serialize_with = "ser_key")]
    pub key: Key,
    /// Page or checkpoint.
    pub kind: EntryKind,
    /// Tokens before the entry.
    pub token_start: u64,
    /// Own tokens.
    pub tokens: usize,
    /// Stored bytes.
    pub bytes: u64,
    /// Unix seconds of last use.
    pub last_use: u64,
    /// Lookups that reused it.
    pub hits: u32,
    /// Sessions retaining it.
    pub refcount: u32,
    /// Where it lives.
    pub tiers: Vec<Tier>,
    /// Save trigger.
    pub reason: SaveReason,
}

fn ser_key<S: serde::Serializer>(k: &Key, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&k.hex())
}

/// Health and size of the store, for the server's metrics endpoint.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DiskStatus {
    /// Disk caching on.
    pub enabled: bool,
    /// The cache directory.
    pub dir: PathBuf,
    /// Why disk caching is off (or the last I/O error).
    pub last_error: Option<String>,
    /// Failed writes (each switches disk caching off).
    pub write_errors: u64,
    /// Failed reads that were not corruption.
    pub read_errors: u64,
    /// Corrupt or orphaned files removed.
    pub corrupt_removed: u64,
    /// Of those, found by the scan at open (bad headers, inconsistent keys, orphans).
    pub corrupt_at_open: u64,
    /// Of those, found by a failed checksum or format check while loading an entry.
    pub corrupt_on_load: u64,
    /// The directory can be read but not written: entries found at open are served, nothing is saved to disk.
    pub read_only: bool,
    /// Leftover temp files removed.
    pub temp_removed: u64,
    /// Entries evicted for the budget.
    pub evicted: u64,
    /// Entry files on disk.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Disk budget.
    pub budget_bytes: u64,
    /// Entries in the host tier.
    pub host_entries: u64,
    /// Their bytes.
    pub host_bytes: u64,
    /// Live pages.
    pub pages: u64,
    /// Live checkpoints.
    pub checkpoints: u64,
}

/// Result of [`KvStore::gc`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    /// Temp files removed.
    pub temp_removed: usize,
    /// Entries evicted.
    pub evicted: usize,
    /// Disk bytes after.
    pub disk_bytes: u64,
}

#[derive(Default)]
struct Inner {
    t: Table,
    st: DiskStatus,
    sessions: HashMap<u64, Vec<EntryId>>,
}

/// The store. `Send + Sync`; share it with an `Arc`.
pub struct KvStore {
    dir: PathBuf,
    identity: ModelIdentity,
    root: Key,
    opts: KvOptions,
    inner: Mutex<Inner>,
    /// Built by [`KvStore::in_memory`]: no directory, every entry in the host tier.
    memory: bool,
}

/// One entry as a self-validating blob, from [`KvStore::export_entry`]: its `.page`/`.ckpt` file image (header with
/// the model identity, key, parent, position and tokens, a CRC over the header and one per row block). Another store
/// takes it with [`KvStore::import_entry`], which checks all of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedEntry {
    /// Page or checkpoint.
    pub kind: EntryKind,
    /// Its key.
    pub key: Key,
    /// The page it follows (or the chain root).
    pub parent: Key,
    /// Tokens before it.
    pub token_start: u64,
    /// Its own tokens.
    pub tokens: Vec<u32>,
    /// The file image.
    pub image: Vec<u8>,
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Tries to create `dir` and write + remove a probe file in it.
fn probe_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| KvError::io("create dir", dir, e))?;
    let probe = dir.join(format!(".probe.{}.0.tmp", std::process::id()));
    let r = fs::write(&probe, b"ds4-kv probe").map_err(|e| KvError::io("write", &probe, e));
    let _ = fs::remove_file(&probe);
    r
}

impl KvStore {
    /// Opens (creating if needed) the cache in `dir` for `identity`. Fails only on invalid options; disk problems
    /// switch disk caching off (see [`KvStore::status`]).
    pub fn open(dir: impl Into<PathBuf>, identity: ModelIdentity, opts: KvOptions) -> Result<KvStore> {
        if opts.span_tokens == 0 || opts.span_tokens.checked_rem(opts.span_multiple_of) != Some(0) {
            return Err(KvError::Invalid(format!(
                "span_tokens {} must be a positive multiple of {}",
                opts.span_tokens, opts.span_multiple_of
            )));
        }
        let dir = dir.into();
        let store = KvStore {
            root: identity.root(opts.span_tokens),
            identity,
            inner: Mutex::new(Inner::default()),
            dir,
            opts,
            memory: false,
        };
        {
            let mut g = store.inner.lock();
            g.st.dir = store.dir.clone();
            g.st.budget_bytes = store.opts.disk_budget_bytes;
            match probe_dir(&store.dir) {
                Ok(()) => {
                    g.st.enabled = true;
                    store.rebuild(&mut g);
                }
                Err(e) if store.dir.is_dir() && fs::read_dir(&store.dir).is_ok() => {
                    tracing::warn!(dir = %store.dir.display(), error = %e,
                        "KV disk cache directory is not writable: serving the entries in it read-only, saving none");
                    g.st.enabled = true;
                    g.st.read_only = true;
                    g.st.last_error = Some(e.to_string());
                    store.rebuild(&mut g);
                }
                Err(e) => store.disable(&mut g, &e),
            }
            store.enforce_budget(&mut g, false);
        }
        Ok(store)
    }

    /// A store without a directory: every entry is kept in the host tier (`opts.host_budget_bytes`, which must be
    /// positive), nothing touches a disk. For a server without a disk tier that still shares entries with a
    /// remote tier (entries come and go through [`KvStore::export_entry`] / [`KvStore::import_entry`]).
    pub fn in_memory(identity: ModelIdentity, opts: KvOptions) -> Result<KvStore> {
        if opts.span_tokens == 0 || opts.span_tokens.checked_rem(opts.span_multiple_of) != Some(0) {
            return Err(KvError::Invalid(format!(
                "span_tokens {} must be a positive multiple of {}",
                opts.span_tokens, opts.span_multiple_of
            )));
        }
        if opts.host_budget_bytes == 0 {
            return Err(KvError::Invalid("an in-memory store needs a host budget".into()));
        }
        let store = KvStore {
            root: identity.root(opts.span_tokens),
            identity,
            inner: Mutex::new(Inner::default()),
            dir: PathBuf::new(),
            opts,
            memory: true,
        };
        store.inner.lock().st.last_error = Some("in-memory store (no disk tier)".into());
        Ok(store)
    }

    /// Whether this store keeps its entries in memory only ([`KvStore::in_memory`]).
    pub fn is_memory(&self) -> bool {
        self.memory
    }

    /// Whether entries can be stored now (on disk, or in the host tier when it has a budget).
    pub fn accepts_entries(&self) -> bool {
        let g = self.inner.lock();
        (g.st.enabled && !g.st.read_only) || self.opts.host_budget_bytes > 0
    }

    /// Whether lookups can find anything (disk caching on, even read-only, or entries in the host tier).
    pub fn serves_entries(&self) -> bool {
        let g = self.inner.lock();
        g.st.enabled || self.opts.host_budget_bytes > 0
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model identity.
    pub fn identity(&self) -> &ModelIdentity {
        &self.identity
    }

    /// Tokens per page.
    pub fn span_tokens(&self) -> u32 {
        self.opts.span_tokens
    }

    /// The key chain root (parent of the first page, prefix of checkpoints before the first full page).
    pub fn root(&self) -> Key {
        self.root
    }

    fn disable(&self, g: &mut Inner, e: &KvError) {
        if g.st.enabled {
            tracing::error!(dir = %self.dir.display(), error = %e, "KV disk cache switched off");
        }
        g.st.enabled = false;
        g.st.write_errors += 1;
        g.st.last_error = Some(e.to_string());
    }

    /// Scans the directory and rebuilds the index (called once by `open`).
    fn rebuild(&self, g: &mut Inner) {
        g.st.temp_removed += disk::clean_temp_files(&self.dir, false) as u64;
        let scan = match disk::scan_dir(&self.dir) {
            Ok(s) => s,
            Err(e) => return self.disable(g, &e),
        };
        for (path, why) in scan.corrupt {
            tracing::warn!(file = %path.display(), reason = %why, "removing corrupt KV file");
            let _ = fs::remove_file(&path);
            g.st.corrupt_removed += 1;
            g.st.corrupt_at_open += 1;
        }
        let model = self.identity.hash();
        let mut files: HashMap<Key, disk::Scanned> = HashMap::new();
        for f in scan.files {
            if f.header.model == model && f.header.span_tokens == self.opts.span_tokens {
                files.insert(f.header.key, f);
            }
        }
        // Walk from the root: only entries reachable through valid pages are indexed.
        let mut by_parent: HashMap<Key, Vec<Key>> = HashMap::new();
        for f in files.values() {
            by_parent.entry(f.header.parent).or_default().push(f.header.key);
        }
        let mut stack = vec![(self.root, 0u64)];
        while let Some((parent, start)) = stack.pop() {
            for k in by_parent.remove(&parent).unwrap_or_default() {
                let Some(f) = files.remove(&k) else { continue };
                let h = &f.header;
                let span = self.opts.span_tokens as usize;
                let valid = h.token_start == start
                    && match h.kind {
                        EntryKind::Page => h.tokens.len() == span && page_key(&parent, &h.tokens) == k,
                        EntryKind::Checkpoint => h.tokens.len() < span && checkpoint_key(&parent, &h.tokens) == k,
                    };
                if !valid {
                    tracing::warn!(file = %f.path.display(), "removing KV file whose key or position is inconsistent");
                    let _ = fs::remove_file(&f.path);
                    g.st.corrupt_removed += 1;
                    g.st.corrupt_at_open += 1;
                    continue;
                }
                if h.kind == EntryKind::Page {
                    stack.push((k, start + span as u64));
                }
                g.t.insert(NewEntry {
                    key: k,
                    kind: h.kind,
                    parent,
                    token_start: h.token_start,
                    tokens: h.tokens.clone().into(),
                    storage: Storage::Disk,
                    bytes: f.bytes,
                    last_use: f.mtime,
                    created: h.created,
                    reason: h.reason,
                });
                g.st.files += 1;
                g.st.bytes += f.bytes;
            }
        }
        for f in files.values() {
            tracing::warn!(file = %f.path.display(), "removing orphaned KV file (its parent page is gone)");
            let _ = fs::remove_file(&f.path);
            g.st.corrupt_removed += 1;
            g.st.corrupt_at_open += 1;
        }
        tracing::info!(dir = %self.dir.display(), entries = g.t.len(), bytes = g.st.bytes, "KV disk cache opened");
    }

    /// Stores the page holding `tokens` (exactly one span) after the page `parent` (or [`KvStore::root`]), with
    /// `layers[l]` = the row blocks of layer `l` that the span produced. Returns the page; an existing key is reused.
    pub fn put_page(
        &self,
        parent: &Key,
        tokens: &[u32],
        layers: &[Vec<RowBlock<'_>>],
        reason: SaveReason,
    ) -> Result<EntryRef> {
        if tokens.len() != self.opts.span_tokens as usize {
            return Err(KvError::Invalid(format!(
                "a page holds {} tokens, got {}",
                self.opts.span_tokens,
                tokens.len()
            )));
        }
        self.put(EntryKind::Page, parent, page_key(parent, tokens), tokens, layers, reason)
    }

    /// Stores a session's resumable state after the page chain ending at `prefix` (or [`KvStore::root`]) plus `tail`
    /// tokens (fewer than a span). `groups` is the engine's snapshot: raw windows, frontiers, partial-span rows,
    /// logits — any typed rows it needs to resume.
    pub fn put_checkpoint(
        &self,
        prefix: &Key,
        tail: &[u32],
        groups: &[Vec<RowBlock<'_>>],
        reason: SaveReason,
    ) -> Result<EntryRef> {
        if tail.len() >= self.opts.span_tokens as usize {
            return Err(KvError::Invalid(format!(
                "checkpoint tail of {} tokens: store full spans as pages first (span {})",
                tail.len(),
                self.opts.span_tokens
            )));
        }
        self.put(EntryKind::Checkpoint, prefix, checkpoint_key(prefix, tail), tail, groups, reason)
    }

    fn parent_end(&self, g: &Inner, parent: &Key) -> Option<u64> {
        if *parent == self.root {
            return Some(0);
        }
        let i = g.t.find(parent)? as usize;
        (g.t.kind[i] == EntryKind::Page).then(|| g.t.token_start[i] + g.t.tokens[i].len() as u64)
    }

    fn put(
        &self,
        kind: EntryKind,
        parent: &Key,
        key: Key,
        tokens: &[u32],
        groups: &[Vec<RowBlock<'_>>],
        reason: SaveReason,
    ) -> Result<EntryRef> {
        format::validate_groups(groups)?;
        let (start, disk_on) = {
            let mut g = self.inner.lock();
            let Some(start) = self.parent_end(&g, parent) else {
                return Err(KvError::Missing(format!("parent page {parent}")));
            };
            if let Some(i) = g.t.find(&key) {
                if &*g.t.tokens[i as usize] != tokens {
                    return Err(KvError::Invalid(format!("key {key} already holds other tokens (hash collision)")));
                }
                g.t.last_use[i as usize] = SystemTime::now();
                return Ok(EntryRef { id: g.t.id(i), key });
            }
            (start, g.st.enabled && !g.st.read_only)
        };
        let now = SystemTime::now();
        let meta = EntryMeta {
            kind,
            reason,
            identity: self.identity.text(),
            model: self.identity.hash(),
            key,
            parent: *parent,
            span_tokens: self.opts.span_tokens,
            token_start: start,
            tokens,
            created: unix_secs(now),
        };
        let mut storage = None;
        if disk_on {
            match disk::publish(&self.dir, &meta, groups) {
                Ok((_, h)) => storage = Some((Storage::Disk, h.file_bytes())),
                Err(e @ KvError::Io { .. }) => self.disable(&mut self.inner.lock(), &e),
                Err(e) => return Err(e),
            }
        }
        if storage.is_none() && self.opts.host_budget_bytes > 0 {
            let mut cur = Cursor::new(Vec::new());
            format::write_entry(&mut cur, Path::new("<memory>"), &meta, groups)?;
            let img = cur.into_inner();
            let n = img.len() as u64;
            storage = Some((Storage::Host(Arc::new(img)), n));
        }
        let Some((storage, bytes)) = storage else {
            let g = self.inner.lock();
            return Err(KvError::DiskOff(g.st.last_error.clone().unwrap_or_else(|| "no storage".into())));
        };
        self.insert_stored(kind, parent, key, tokens, start, storage, bytes, reason)
    }

    /// Indexes an entry whose bytes were just stored (`storage`), unless its parent went away or another thread
    /// stored the same key meanwhile; enforces the budget.
    #[allow(clippy::too_many_arguments)]
    fn insert_stored(
        &self,
        kind: EntryKind,
        parent: &Key,
        key: Key,
        tokens: &[u32],
        start: u64,
        storage: Storage,
        bytes: u64,
        reason: SaveReason,
    ) -> Result<EntryRef> {
        let now = SystemTime::now();
        let mut g = self.inner.lock();
        let on_disk = matches!(storage, Storage::Disk);
        // The parent may have been evicted while we wrote, or another thread stored the same key.
        if self.parent_end(&g, parent) != Some(start) || g.t.find(&key).is_some() {
            let existing = g.t.find(&key);
            if on_disk && existing.is_none() {
                let _ = fs::remove_file(self.dir.join(disk::file_name(&key, kind)));
            }
            return match existing {
                Some(i) => Ok(EntryRef { id: g.t.id(i), key }),
                None => Err(KvError::Missing(format!("parent page {parent} was evicted during the write"))),
            };
        }
        let id = g.t.insert(NewEntry {
            key,
            kind,
            parent: *parent,
            token_start: start,
            tokens: tokens.into(),
            storage,
            bytes,
            last_use: now,
            created: unix_secs(now),
            reason,
        });
        if on_disk {
            g.st.files += 1;
            g.st.bytes += bytes;
        } else {
            g.st.host_entries += 1;
            g.st.host_bytes += bytes;
        }
        // Protect the new entry during this round, so a tiny budget cannot evict what was just written.
        g.t.refcount[id.index as usize] += 1;
        self.enforce_budget(&mut g, !on_disk);
        g.t.refcount[id.index as usize] -= 1;
        Ok(EntryRef { id, key })
    }

    /// Entry `key` as a self-validating blob (its file image), to copy it to another tier or store.
    /// [`KvError::Missing`] when it is not (or no longer) stored.
    pub fn export_entry(&self, key: &Key) -> Result<ExportedEntry> {
        let (kind, parent, token_start, tokens, storage) = {
            let g = self.inner.lock();
            let i = g.t.find(key).ok_or_else(|| KvError::Missing(key.to_string()))? as usize;
            (g.t.kind[i], g.t.parent[i], g.t.token_start[i], g.t.tokens[i].to_vec(), g.t.storage[i].clone())
        };
        let image = match storage {
            Storage::Host(img) => img.as_ref().clone(),
            Storage::Disk => {
                let path = self.dir.join(disk::file_name(key, kind));
                fs::read(&path).map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => KvError::Missing(format!("{key} (its file vanished)")),
                    _ => KvError::io("read", &path, e),
                })?
            }
        };
        Ok(ExportedEntry { kind, key: *key, parent, token_start, tokens, image })
    }

    /// What a restore through entry `key` needs and what hangs beside it: the page chain from the first page to
    /// `key` (or to its parent, for a checkpoint), `key` itself, and every checkpoint stored after one of those pages
    /// (or after the root), parents before children. Empty when `key` is not stored.
    pub fn lineage(&self, key: &Key) -> Vec<EntryRef> {
        let g = self.inner.lock();
        let Some(i) = g.t.find(key) else { return Vec::new() };
        let mut pages = Vec::new();
        let mut cur = if g.t.kind[i as usize] == EntryKind::Page { Some(i) } else { g.t.find(&g.t.parent[i as usize]) };
        while let Some(p) = cur {
            pages.push(p);
            cur = g.t.find(&g.t.parent[p as usize]);
        }
        pages.reverse();
        let mut out: Vec<EntryRef> =
            pages.iter().map(|&p| EntryRef { id: g.t.id(p), key: g.t.key[p as usize] }).collect();
        for prefix in std::iter::once(self.root).chain(pages.iter().map(|&p| g.t.key[p as usize])) {
            for &c in g.t.children(&prefix) {
                if g.t.kind[c as usize] == EntryKind::Checkpoint {
                    out.push(EntryRef { id: g.t.id(c), key: g.t.key[c as usize] });
                }
            }
        }
        out
    }

    /// Takes an entry exported by another store ([`KvStore::export_entry`]) as the `kind` entry holding `tokens`
    /// after `parent` (the caller's expectation, e.g. from the prompt being looked up). The blob is validated
    /// completely before anything is stored: header and layout checksums, the model identity (hash and text), the
    /// page span, kind, key (recomputed from `parent` and `tokens`), parent, position and tokens, every block's
    /// checksum and encoding, and the exact length. A blob that fails any of these is [`KvError::Corrupt`] and
    /// leaves the store unchanged; a parent not stored here is [`KvError::Missing`]. An entry already stored is
    /// returned as is. Stored like [`KvStore::put_page`] (disk, else the host tier).
    pub fn import_entry(&self, kind: EntryKind, parent: &Key, tokens: &[u32], image: &[u8]) -> Result<EntryRef> {
        let span = self.opts.span_tokens as usize;
        let key = match kind {
            EntryKind::Page if tokens.len() == span => page_key(parent, tokens),
            EntryKind::Checkpoint if tokens.len() < span => checkpoint_key(parent, tokens),
            _ => return Err(KvError::Invalid(format!("a {kind:?} of {} tokens (span {span})", tokens.len()))),
        };
        let src = Path::new("<imported blob>");
        let corrupt = |why: &str| KvError::Corrupt(format!("imported blob: {why}"));
        let mut cur = Cursor::new(image);
        let h = format::read_header(&mut cur, src)?;
        if h.model != self.identity.hash() || h.identity != self.identity.text() {
            return Err(corrupt(&format!("written for another model ({:?})", h.identity)));
        }
        if h.span_tokens != self.opts.span_tokens {
            return Err(corrupt(&format!("page span {} (this store: {span})", h.span_tokens)));
        }
        if h.kind != kind || h.key != key || h.parent != *parent || h.tokens != tokens {
            return Err(corrupt("names another entry (kind, key, parent or tokens differ)"));
        }
        if image.len() as u64 != h.file_bytes() {
            return Err(corrupt(&format!("{} bytes, its header says {}", image.len(), h.file_bytes())));
        }
        format::stream_blocks(&mut cur, src, &h, |_| Ok(()))?;
        let (start, disk_on) = {
            let mut g = self.inner.lock();
            let Some(start) = self.parent_end(&g, parent) else {
                return Err(KvError::Missing(format!("parent page {parent}")));
            };
            if h.token_start != start {
                return Err(corrupt(&format!("starts at token {}, its parent ends at {start}", h.token_start)));
            }
            if let Some(i) = g.t.find(&key) {
                g.t.last_use[i as usize] = SystemTime::now();
                return Ok(EntryRef { id: g.t.id(i), key });
            }
            (start, g.st.enabled && !g.st.read_only)
        };
        let mut storage = None;
        if disk_on {
            match disk::publish_image(&self.dir, &key, kind, image) {
                Ok(()) => storage = Some((Storage::Disk, image.len() as u64)),
                Err(e @ KvError::Io { .. }) => self.disable(&mut self.inner.lock(), &e),
                Err(e) => return Err(e),
            }
        }
        if storage.is_none() && self.opts.host_budget_bytes > 0 {
            storage = Some((Storage::Host(Arc::new(image.to_vec())), image.len() as u64));
        }
        let Some((storage, bytes)) = storage else {
            let g = self.inner.lock();
            return Err(KvError::DiskOff(g.st.last_error.clone().unwrap_or_else(|| "no storage".into())));
        };
        self.insert_stored(kind, parent, key, tokens, start, storage, bytes, h.reason)
    }

    /// The longest stored page chain that is a prefix of `tokens` (no checkpoint needed), in order.
    pub fn page_chain(&self, tokens: &[u32]) -> Vec<EntryRef> {
        let g = self.inner.lock();
        self.chain(&g, tokens)
    }

    fn chain(&self, g: &Inner, tokens: &[u32]) -> Vec<EntryRef> {
        let span = self.opts.span_tokens as usize;
        let mut out = Vec::new();
        let mut k = self.root;
        for s in tokens.chunks_exact(span) {
            let next = page_key(&k, s);
            match g.t.find(&next) {
                Some(i) if g.t.kind[i as usize] == EntryKind::Page && &*g.t.tokens[i as usize] == s => {
                    out.push(EntryRef { id: g.t.id(i), key: next });
                    k = next;
                }
                _ => break,
            }
        }
        out
    }

    /// The longest cached, token-exact prefix of `tokens` that ends at a checkpoint (see the module docs for the
    /// `checkpoint: None` case). Counts a hit and a use on every returned entry.
    pub fn longest_prefix(&self, tokens: &[u32]) -> PrefixMatch {
        let mut g = self.inner.lock();
        let span = self.opts.span_tokens as usize;
        let chain = self.chain(&g, tokens);
        let mut best: Option<(usize, usize, u32)> = None; // (matched, pages used, checkpoint row)
        for n in 0..=chain.len() {
            let prefix = if n == 0 { self.root } else { chain[n - 1].key };
            let pos = n * span;
            for &c in g.t.children(&prefix) {
                let ci = c as usize;
                if g.t.kind[ci] != EntryKind::Checkpoint {
                    continue;
                }
                let tail = &g.t.tokens[ci];
                if tokens.len() >= pos + tail.len() && tokens[pos..pos + tail.len()] == **tail {
                    let m = pos + tail.len();
                    if best.is_none_or(|(bm, _, _)| m > bm) {
                        best = Some((m, n, c));
                    }
                }
            }
        }
        let now = SystemTime::now();
        let result = match best {
            Some((matched, n, c)) => PrefixMatch {
                matched_tokens: matched,
                pages: chain[..n].to_vec(),
                checkpoint: Some(EntryRef { id: g.t.id(c), key: g.t.key[c as usize] }),
            },
            None => PrefixMatch { matched_tokens: chain.len() * span, pages: chain, checkpoint: None },
        };
        for r in result.pages.iter().chain(result.checkpoint.iter()) {
            let i = r.id.index as usize;
            g.t.hits[i] = g.t.hits[i].saturating_add(1);
            g.t.last_use[i] = now;
        }
        result
    }

    /// Streams the rows of entry `key` to `f`, one verified, decoded block at a time (file order: group by group).
    /// On a checksum or format error the entry (and everything built on it) is removed and `KvError::Corrupt` is
    /// returned (a file deleted behind the store's back: removed likewise, `KvError::Missing`); `f` may already have seen earlier blocks, which the caller must then discard. An error returned by
    /// `f` stops the load and is passed through unchanged.
    pub fn load(&self, key: &Key, mut f: impl FnMut(RowsView<'_>) -> Result<()>) -> Result<LoadInfo> {
        let (kind, storage, path) = {
            let mut g = self.inner.lock();
            let i = g.t.find(key).ok_or_else(|| KvError::Missing(key.to_string()))? as usize;
            g.t.last_use[i] = SystemTime::now();
            let kind = g.t.kind[i];
            (kind, g.t.storage[i].clone(), self.dir.join(disk::file_name(key, kind)))
        };
        let mut user_err = None;
        let mut blocks = 0usize;
        let mut cb = |v: RowsView<'_>| {
            blocks += 1;
            f(v).map_err(|e| {
                user_err = Some(e);
                KvError::Aborted("callback".into())
            })
        };
        let r = match &storage {
            Storage::Disk => File::open(&path)
                .map_err(|e| KvError::io("open", &path, e))
                .and_then(|file| self.read_entry(&mut BufReader::with_capacity(1 << 20, file), &path, key, &mut cb)),
            Storage::Host(img) => {
                self.read_entry(&mut Cursor::new(img.as_slice()), Path::new("<memory>"), key, &mut cb)
            }
        };
        match r {
            Ok(h) => {
                if matches!(storage, Storage::Disk) {
                    let _ = OpenOptions::new().write(true).open(&path).and_then(|f| f.set_modified(SystemTime::now()));
                }
                Ok(LoadInfo {
                    kind,
                    token_start: h.token_start,
                    bytes: h.file_bytes(),
                    tokens: h.tokens,
                    groups: h.groups,
                    blocks,
                })
            }
            Err(KvError::Aborted(_)) if user_err.is_some() => {
                Err(user_err.take().unwrap_or(KvError::Aborted(String::new())))
            }
            Err(e) => {
                let mut g = self.inner.lock();
                match &e {
                    KvError::Corrupt(why) => {
                        tracing::warn!(key = %key, reason = %why, "corrupt KV entry removed");
                        g.st.corrupt_removed += 1;
                        g.st.corrupt_on_load += 1;
                        self.remove_subtree(&mut g, key);
                    }
                    KvError::Io { err, .. } if err.kind() == std::io::ErrorKind::NotFound => {
                        tracing::warn!(key = %key, "KV file vanished; dropping it from the index");
                        self.remove_subtree(&mut g, key);
                        return Err(KvError::Missing(format!("{key} (its file vanished)")));
                    }
                    _ => g.st.read_errors += 1,
                }
                Err(e)
            }
        }
    }

    fn read_entry<R: Read>(
        &self,
        r: &mut R,
        path: &Path,
        key: &Key,
        f: &mut impl FnMut(RowsView<'_>) -> Result<()>,
    ) -> Result<format::Header> {
        let h = format::read_header(r, path)?;
        if h.key != *key || h.model != self.identity.hash() {
            return Err(KvError::Corrupt(format!("{}: header names another key or model", path.display())));
        }
        format::stream_blocks(r, path, &h, f)?;
        Ok(h)
    }

    /// Removes the entry `key` and everything below it, deleting files.
    fn remove_subtree(&self, g: &mut Inner, key: &Key) {
        let Some(i) = g.t.find(key) else { return };
        for r in g.t.subtree_post_order(i) {
            self.remove_row(g, r);
        }
    }

    fn remove_row(&self, g: &mut Inner, r: u32) {
        let u = r as usize;
        match &g.t.storage[u] {
            Storage::Disk => {
                let path = self.dir.join(disk::file_name(&g.t.key[u], g.t.kind[u]));
                if let Err(e) = fs::remove_file(&path) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(file = %path.display(), error = %e, "could not remove KV file");
                    }
                }
                g.st.files -= 1;
                g.st.bytes -= g.t.bytes[u];
            }
            Storage::Host(_) => {
                g.st.host_entries -= 1;
                g.st.host_bytes -= g.t.bytes[u];
            }
        }
        g.t.remove(r);
    }

    /// Evicts (see [`crate::policy`]) until the disk (or host) tier is within budget.
    fn enforce_budget(&self, g: &mut Inner, host: bool) {
        let budget = if host { self.opts.host_budget_bytes } else { self.opts.disk_budget_bytes };
        let now = SystemTime::now();
        loop {
            let used = if host { g.st.host_bytes } else { g.st.bytes };
            if used <= budget {
                return;
            }
            let below = self.checkpoints_below(g);
            let cands: Vec<Candidate> =
                g.t.rows()
                    .filter(|&r| matches!(g.t.storage[r as usize], Storage::Host(_)) == host)
                    .map(|r| {
                        let u = r as usize;
                        let sharers = match g.t.kind[u] {
                            EntryKind::Page => below.get(&g.t.key[u]).copied().unwrap_or(0),
                            EntryKind::Checkpoint => below.get(&g.t.parent[u]).copied().unwrap_or(1).saturating_sub(1),
                        };
                        Candidate {
                            id: r as usize,
                            bytes: g.t.bytes[u],
                            hits: g.t.hits[u],
                            sharers,
                            age_secs: now.duration_since(g.t.last_use[u]).map(|d| d.as_secs_f64()).unwrap_or(0.0),
                            pinned: g.t.refcount[u] > 0,
                            children: g.t.children(&g.t.key[u]).len() as u32,
                        }
                    })
                    .collect();
            let Some(v) = policy::pick_victim(&cands, self.opts.half_life_secs) else {
                tracing::warn!(used, budget, host, "KV tier over budget but every entry is pinned or shared");
                return;
            };
            tracing::debug!(key = %g.t.key[v], "evicting KV entry");
            self.remove_row(g, v as u32);
            g.st.evicted += 1;
        }
    }

    /// For every page key (and the root): how many checkpoints hang in its subtree.
    fn checkpoints_below(&self, g: &Inner) -> HashMap<Key, u32> {
        let mut below: HashMap<Key, u32> = HashMap::new();
        for r in g.t.rows() {
            let u = r as usize;
            if g.t.kind[u] != EntryKind::Checkpoint {
                continue;
            }
            let mut k = g.t.parent[u];
            loop {
                *below.entry(k).or_default() += 1;
                match g.t.find(&k) {
                    Some(p) => k = g.t.parent[p as usize],
                    None => break,
                }
            }
        }
        below
    }

    /// Pins entries for a live session: they are not evicted until [`KvStore::release`]. Stale ids are ignored;
    /// returns how many were pinned.
    pub fn retain(&self, session: u64, ids: &[EntryId]) -> usize {
        let mut g = self.inner.lock();
        let mut n = 0;
        for &id in ids {
            if let Some(i) = g.t.resolve(id) {
                g.t.refcount[i as usize] += 1;
                g.sessions.entry(session).or_default().push(id);
                n += 1;
            }
        }
        n
    }

    /// Drops every pin of `session`, then enforces the budgets.
    pub fn release(&self, session: u64) {
        let mut g = self.inner.lock();
        for id in g.sessions.remove(&session).unwrap_or_default() {
            if let Some(i) = g.t.resolve(id) {
                g.t.refcount[i as usize] -= 1;
            }
        }
        self.enforce_budget(&mut g, false);
        self.enforce_budget(&mut g, true);
    }

    /// Records that the engine holds (`Some(location)`, engine-defined) or dropped (`None`) a device copy.
    pub fn mark_device(&self, id: EntryId, location: Option<u64>) -> bool {
        let mut g = self.inner.lock();
        match g.t.resolve(id) {
            Some(i) => {
                g.t.on_device[i as usize] = location;
                true
            }
            None => false,
        }
    }

    /// Removes leftover temp files and enforces the budgets.
    pub fn gc(&self) -> GcReport {
        let mut g = self.inner.lock();
        let temp = if g.st.enabled { disk::clean_temp_files(&self.dir, false) } else { 0 };
        g.st.temp_removed += temp as u64;
        let before = g.st.evicted;
        self.enforce_budget(&mut g, false);
        self.enforce_budget(&mut g, true);
        GcReport { temp_removed: temp, evicted: (g.st.evicted - before) as usize, disk_bytes: g.st.bytes }
    }

    /// Re-probes the directory and switches disk caching back on if it is writable. Returns whether it is on.
    pub fn retry_disk(&self) -> bool {
        let mut g = self.inner.lock();
        if !g.st.enabled && !self.memory {
            match probe_dir(&self.dir) {
                Ok(()) => {
                    tracing::info!(dir = %self.dir.display(), "KV disk cache switched back on");
                    g.st.enabled = true;
                }
                Err(e) => g.st.last_error = Some(e.to_string()),
            }
        }
        g.st.enabled
    }

    /// Counters and sizes.
    pub fn status(&self) -> DiskStatus {
        let g = self.inner.lock();
        let mut st = g.st.clone();
        st.pages = g.t.rows().filter(|&r| g.t.kind[r as usize] == EntryKind::Page).count() as u64;
        st.checkpoints = g.t.len() as u64 - st.pages;
        st
    }

    /// Every live entry, ordered by token position then key.
    pub fn entries(&self) -> Vec<EntryInfo> {
        let g = self.inner.lock();
        let mut v: Vec<EntryInfo> =
            g.t.rows()
                .map(|r| {
                    let u = r as usize;
                    let mut tiers = Vec::new();
                    if g.t.on_device[u].is_some() {
                        tiers.push(Tier::Device);
                    }
                    tiers.push(match g.t.storage[u] {
                        Storage::Disk => Tier::Disk,
                        Storage::Host(_) => Tier::Host,
                    });
                    EntryInfo {
                        key: g.t.key[u],
                        kind: g.t.kind[u],
                        token_start: g.t.token_start[u],
                        tokens: g.t.tokens[u].len(),
                        bytes: g.t.bytes[u],
                        last_use: unix_secs(g.t.last_use[u]),
                        hits: g.t.hits[u],
                        refcount: g.t.refcount[u],
                        tiers,
                        reason: g.t.reason[u],
                    }
                })
                .collect();
        v.sort_by_key(|e| (e.token_start, e.key));
        v
    }
}
