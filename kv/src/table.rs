//! The entry component table: one struct-of-arrays row per page or checkpoint, ids are indices.
//!
//! Invariants (kept by [`Table::insert`] / [`Table::remove`], relied on by the store):
//! * `by_key[key] == i` iff row `i` is live and `key[i] == key`.
//! * `kids[k]` lists the live rows whose `parent` is `k` (pages after page `k`, checkpoints on prefix `k`).
//! * A removed row's slot goes to `free` and is reused with `gen` bumped, so a stale [`EntryId`] never resolves to
//!   the new occupant.
//!
//! Nothing here does I/O or locking; the store holds the table under its mutex.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use crate::format::{EntryKind, SaveReason};
use crate::key::Key;

/// Index + generation of a table row. `PageId` and `CheckpointId` are this type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EntryId {
    /// Row index.
    pub index: u32,
    /// Slot generation.
    pub gen: u32,
}

/// An id naming a page.
pub type PageId = EntryId;
/// An id naming a checkpoint.
pub type CheckpointId = EntryId;

/// Where an entry's bytes live in the store.
#[derive(Clone, Debug)]
pub enum Storage {
    /// A file in the cache directory.
    Disk,
    /// An in-memory file image (used while disk caching is off).
    Host(Arc<Vec<u8>>),
}

/// Where a stored entry lives. (A page's copies in the engine's RAM and device pools are the engine's: they are
/// found by the same key in `ds4_engine::tables::PageIndex`, not recorded here.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Tier {
    /// In this process's memory.
    Host,
    /// In the cache directory.
    Disk,
}

/// New-row values for [`Table::insert`].
#[derive(Clone, Debug)]
pub struct NewEntry {
    pub key: Key,
    pub kind: EntryKind,
    pub parent: Key,
    pub token_start: u64,
    pub tokens: Box<[u32]>,
    pub storage: Storage,
    pub bytes: u64,
    pub last_use: SystemTime,
    pub created: u64,
    pub reason: SaveReason,
}

/// The table (see module docs).
#[derive(Default, Debug)]
pub struct Table {
    pub key: Vec<Key>,
    pub gen: Vec<u32>,
    pub live: Vec<bool>,
    pub kind: Vec<EntryKind>,
    pub parent: Vec<Key>,
    pub token_start: Vec<u64>,
    pub tokens: Vec<Box<[u32]>>,
    pub refcount: Vec<u32>,
    pub storage: Vec<Storage>,
    pub bytes: Vec<u64>,
    pub last_use: Vec<SystemTime>,
    pub hits: Vec<u32>,
    pub created: Vec<u64>,
    pub reason: Vec<SaveReason>,
    pub by_key: HashMap<Key, u32>,
    pub kids: HashMap<Key, Vec<u32>>,
    free: Vec<u32>,
}

impl Table {
    /// Live row count.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// The id of row `i`.
    pub fn id(&self, i: u32) -> EntryId {
        EntryId { index: i, gen: self.gen[i as usize] }
    }

    /// The row of a live id (None when removed or reused).
    pub fn resolve(&self, id: EntryId) -> Option<u32> {
        let i = id.index as usize;
        (i < self.live.len() && self.live[i] && self.gen[i] == id.gen).then_some(id.index)
    }

    /// The row holding `key`.
    pub fn find(&self, key: &Key) -> Option<u32> {
        self.by_key.get(key).copied()
    }

    /// Live row indices.
    pub fn rows(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_key.values().copied()
    }

    /// Children of `key`.
    pub fn children(&self, key: &Key) -> &[u32] {
        self.kids.get(key).map(|v| v.as_slice()).unwrap_or(&[])
    }

    /// Inserts a row (the key must not be live).
    pub fn insert(&mut self, e: NewEntry) -> EntryId {
        debug_assert!(!self.by_key.contains_key(&e.key));
        let i = match self.free.pop() {
            Some(i) => {
                let u = i as usize;
                self.gen[u] = self.gen[u].wrapping_add(1);
                self.live[u] = true;
                self.key[u] = e.key;
                self.kind[u] = e.kind;
                self.parent[u] = e.parent;
                self.token_start[u] = e.token_start;
                self.tokens[u] = e.tokens;
                self.refcount[u] = 0;
                self.storage[u] = e.storage;
                self.bytes[u] = e.bytes;
                self.last_use[u] = e.last_use;
                self.hits[u] = 0;
                self.created[u] = e.created;
                self.reason[u] = e.reason;
                i
            }
            None => {
                let i = self.key.len() as u32;
                self.key.push(e.key);
                self.gen.push(0);
                self.live.push(true);
                self.kind.push(e.kind);
                self.parent.push(e.parent);
                self.token_start.push(e.token_start);
                self.tokens.push(e.tokens);
                self.refcount.push(0);
                self.storage.push(e.storage);
                self.bytes.push(e.bytes);
                self.last_use.push(e.last_use);
                self.hits.push(0);
                self.created.push(e.created);
                self.reason.push(e.reason);
                i
            }
        };
        self.by_key.insert(e.key, i);
        self.kids.entry(e.parent).or_default().push(i);
        self.id(i)
    }

    /// Removes row `i` (its children, if any, stay: the caller removes subtrees bottom-up).
    pub fn remove(&mut self, i: u32) {
        let u = i as usize;
        if !self.live[u] {
            return;
        }
        self.live[u] = false;
        self.by_key.remove(&self.key[u]);
        if let Some(v) = self.kids.get_mut(&self.parent[u]) {
            v.retain(|&x| x != i);
            if v.is_empty() {
                self.kids.remove(&self.parent[u]);
            }
        }
        self.tokens[u] = Box::new([]);
        self.storage[u] = Storage::Disk;
        self.free.push(i);
    }

    /// Row `i` and every row below it, children before parents.
    pub fn subtree_post_order(&self, i: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut stack = vec![(i, false)];
        while let Some((r, expanded)) = stack.pop() {
            if expanded {
                out.push(r);
                continue;
            }
            stack.push((r, true));
            for &c in self.children(&self.key[r as usize]) {
                stack.push((c, false));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(key: u8, parent: u8) -> NewEntry {
        NewEntry {
            key: Key([key; 20]),
            kind: EntryKind::Page,
            parent: Key([parent; 20]),
            token_start: 0,
            tokens: vec![1, 2].into(),
            storage: Storage::Disk,
            bytes: 10,
            last_use: SystemTime::UNIX_EPOCH,
            created: 0,
            reason: SaveReason::Cold,
        }
    }

    #[test]
    fn insert_remove_reuse_and_subtrees() {
        let mut t = Table::default();
        let a = t.insert(e(1, 0));
        let b = t.insert(e(2, 1));
        let c = t.insert(e(3, 2));
        let d = t.insert(e(4, 1));
        assert_eq!(t.children(&Key([1; 20])).len(), 2);
        let order = t.subtree_post_order(a.index);
        assert_eq!(order.len(), 4);
        assert_eq!(*order.last().unwrap(), a.index);
        let pos = |x: EntryId| order.iter().position(|&r| r == x.index).unwrap();
        assert!(pos(c) < pos(b) && pos(d) < pos(a));
        t.remove(c.index);
        assert_eq!(t.resolve(c), None);
        assert!(t.children(&Key([2; 20])).is_empty());
        let f = t.insert(e(5, 2));
        assert_eq!(f.index, c.index);
        assert_ne!(f.gen, c.gen);
        assert_eq!(t.resolve(f), Some(f.index));
        assert_eq!(t.find(&Key([5; 20])), Some(f.index));
        assert_eq!(t.len(), 4);
    }
}
