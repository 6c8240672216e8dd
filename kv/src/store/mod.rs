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
//!
//! Files: this one holds the store, its index, saving, lookups and loads; `types` the public data types,
//! `exchange` entries as self-validating blobs (export / import, for the remote tier), `eviction` the budgets
//! and the pins of live sessions.

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

mod eviction;
mod exchange;
mod types;

pub use types::*;

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
                    let tiers = vec![match g.t.storage[u] {
                        Storage::Disk => Tier::Disk,
                        Storage::Host(_) => Tier::Host,
                    }];
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
