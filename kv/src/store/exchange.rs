//! One entry in and out of the store as a self-validating blob (the remote tier's unit): export, lineage, import
//! with full validation.

use super::*;

impl KvStore {
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
}
