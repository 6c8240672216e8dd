//! One page identity across the tiers: the index of the pages RAM holds, by the key the stores use.
//!
//! A page of the `ds4-kv` store (on disk, in memory, or fetched from Redis into it) is named by its chained key
//! ([`ds4_kv::page_key`]: the model identity, the page span and every token up to the span's end). When the store's
//! span is [`PAGE_TOKENS`] tokens, page `p` of every live row table ([`super::pages`]) holds exactly the rows span `p`
//! appended — the same rows the store's page `p` holds (rows are a function of the token prefix). A [`PageIndex`]
//! maps a key to those live pages, and each registered page carries its key ([`Page::id`]), so:
//! - a restore from any store takes the pages RAM already holds (pointer copies into the restored session) and
//!   reads and decodes only the others (`crate::persist::load_longest`); what it decodes is registered in turn, so
//!   the next restore of the same prefix shares it;
//! - the device tier shares a page it has uploaded once ([`crate::backend::device::pages::PagePool`] keeps its
//!   pages by this key): sessions restored from the same prefix hold one device copy.
//!
//! Invariants:
//! - The index holds weak references: it never keeps a page alive (the RAM budget stays with the sessions that hold
//!   pages). An entry some of whose pages are gone answers as absent and is swept.
//! - An entry is made only for a span whose page is full in every table of the session (a full page is immutable:
//!   see [`super::pages`]) and only when the page span and the store span agree ([`PageIndex::aligned`]).
//! - An entry keeps its span's tokens and every lookup compares them, so a hash collision cannot hand out wrong rows
//!   (the store does the same).
//!
//! Registration runs where the keys are known anyway — when a save is written and when a restore is loaded, both
//! on the tier's I/O worker — so the engine's thread pays nothing for it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use ds4_kv::Key;
use parking_lot::Mutex;

use super::pages::{rows_per_page, Page, PAGE_TOKENS};
use super::{PagedRows, SessionKv};
use crate::model::ModelConfig;

struct Resident {
    tokens: Box<[u32]>,
    /// One page per row table of the session, in [`tables`] order.
    pages: Vec<Weak<Page>>,
}

/// Counters of what restores took from RAM and what they decoded (see [`PageIndex::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageIndexStats {
    /// Spans registered and still resident.
    pub resident: u64,
    /// Spans a restore took from RAM (no read, no decode).
    pub joined: u64,
    /// Spans a restore read and decoded from a store.
    pub decoded: u64,
}

/// The resident pages by key (see the module docs). Shared by the engine's pages ledger and everything cloned from
/// it; all methods take `&self`.
#[derive(Default)]
pub struct PageIndex {
    map: Mutex<HashMap<Key, Resident>>,
    /// Map size after the last sweep (a sweep runs when the map doubles).
    swept_at: AtomicU64,
    joined: AtomicU64,
    decoded: AtomicU64,
}

/// The row tables of `kv` that hold pages, in a fixed order (per layer: compressed rows, then indexer rows).
pub(crate) fn tables(kv: &SessionKv) -> impl Iterator<Item = &PagedRows> + '_ {
    kv.layers.iter().flat_map(|l| {
        let comp = l.comp.is_some().then_some(&l.comp_rows);
        let idx = l.idx.is_some().then_some(&l.idx_rows);
        comp.into_iter().chain(idx)
    })
}

/// [`tables`], mutable.
pub(crate) fn tables_mut(kv: &mut SessionKv) -> impl Iterator<Item = &mut PagedRows> + '_ {
    kv.layers.iter_mut().flat_map(|l| {
        let (has_comp, has_idx) = (l.comp.is_some(), l.idx.is_some());
        let comp = has_comp.then_some(&mut l.comp_rows);
        let idx = has_idx.then_some(&mut l.idx_rows);
        comp.into_iter().chain(idx)
    })
}

impl PageIndex {
    /// Whether a store of `span` tokens per page lines up with the live pages of a model `cfg`: then store page `p`
    /// is page `p` of every table.
    pub fn aligned(cfg: &ModelConfig, span: usize) -> bool {
        span == PAGE_TOKENS
            && cfg.compress_ratios.iter().all(|&r| r == 0 || (span.is_multiple_of(r) && rows_per_page(r) * r == span))
    }

    /// Registers the full spans of `kv` (the state of `history`), `keys[p]` naming span `p` of `span` tokens (the
    /// caller checked [`PageIndex::aligned`]). A span already resident is left as it is. Returns the spans added.
    pub fn register(&self, keys: &[Key], history: &[u32], span: usize, kv: &SessionKv) -> usize {
        let tabs: Vec<&PagedRows> = tables(kv).collect();
        if tabs.is_empty() {
            return 0;
        }
        let mut added = 0;
        let mut map = self.map.lock();
        for (p, key) in keys.iter().enumerate() {
            let Some(tokens) = history.get(p * span..(p + 1) * span) else { break };
            let pages: Option<Vec<&Arc<Page>>> = tabs.iter().map(|t| t.full_page(p)).collect();
            let Some(pages) = pages else { break };
            if map.get(key).is_some_and(|r| r.pages.iter().all(|w| w.strong_count() > 0)) {
                continue;
            }
            for pg in &pages {
                pg.set_id(*key);
            }
            let pages = pages.iter().map(|pg| Arc::downgrade(pg)).collect();
            map.insert(*key, Resident { tokens: tokens.into(), pages });
            added += 1;
        }
        if map.len() as u64 > 2 * self.swept_at.load(Ordering::Relaxed).max(64) {
            map.retain(|_, r| r.pages.iter().all(|w| w.strong_count() > 0));
            self.swept_at.store(map.len() as u64, Ordering::Relaxed);
        }
        added
    }

    /// The live pages of the span named `key` whose tokens are `tokens`, one per row table, or `None` when RAM does
    /// not hold all of them.
    pub fn resident(&self, key: &Key, tokens: &[u32]) -> Option<Vec<Arc<Page>>> {
        let map = self.map.lock();
        let r = map.get(key).filter(|r| *r.tokens == *tokens)?;
        r.pages.iter().map(Weak::upgrade).collect()
    }

    /// Records a restore that took `joined` spans from RAM and decoded `decoded` from a store.
    pub(crate) fn note_restore(&self, joined: usize, decoded: usize) {
        self.joined.fetch_add(joined as u64, Ordering::Relaxed);
        self.decoded.fetch_add(decoded as u64, Ordering::Relaxed);
    }

    /// The counters, and the spans resident now (entries whose pages are all alive).
    pub fn stats(&self) -> PageIndexStats {
        let resident = self.map.lock().values().filter(|r| r.pages.iter().all(|w| w.strong_count() > 0)).count() as u64;
        PageIndexStats {
            resident,
            joined: self.joined.load(Ordering::Relaxed),
            decoded: self.decoded.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::tables::PageLedger;

    fn cfg() -> ModelConfig {
        let f = GgufFile::from_bytes(crate::convert::demo_model_gguf(3).unwrap()).unwrap();
        ModelConfig::from_gguf(&f).unwrap()
    }

    /// A state of `tokens` tokens whose rows are distinct values.
    fn state(cfg: &ModelConfig, tokens: usize, pool: &PageLedger) -> SessionKv {
        let mut kv = SessionKv::new_in(cfg, 0, pool);
        for (l, lk) in kv.layers.iter_mut().enumerate() {
            let r = cfg.compress_ratios[l];
            if r == 0 {
                continue;
            }
            for t in [&mut lk.comp_rows, &mut lk.idx_rows] {
                for i in 0..tokens / r {
                    let row: Vec<f32> = (0..t.width()).map(|j| (l * 100_000 + i * 10 + j) as f32).collect();
                    if !row.is_empty() {
                        t.push(&row);
                    }
                }
            }
        }
        kv
    }

    fn keys(n: usize, history: &[u32]) -> Vec<Key> {
        let mut k = ds4_kv::ModelIdentity::new("test").root(PAGE_TOKENS as u32);
        (0..n)
            .map(|p| {
                k = ds4_kv::page_key(&k, &history[p * PAGE_TOKENS..(p + 1) * PAGE_TOKENS]);
                k
            })
            .collect()
    }

    /// Full spans are registered (the partial one is not), a lookup checks the tokens, pages carry their key, and
    /// the index never keeps a page alive.
    #[test]
    fn full_spans_are_found_by_key_while_a_session_holds_them() {
        let cfg = cfg();
        assert!(PageIndex::aligned(&cfg, PAGE_TOKENS));
        assert!(!PageIndex::aligned(&cfg, 2 * PAGE_TOKENS));
        let pool = PageLedger::new();
        let index = pool.index().expect("a counting pool has an index");
        let history: Vec<u32> = (0..700).map(|t| t * 7 % 1000).collect();
        let kv = state(&cfg, history.len(), &pool);
        let ks = keys(3, &[history.clone(), vec![0; 100]].concat());
        assert_eq!(index.register(&ks, &history, PAGE_TOKENS, &kv), 2, "two full spans of 700 tokens");
        assert_eq!(index.register(&ks, &history, PAGE_TOKENS, &kv), 0, "already resident");
        let got = index.resident(&ks[1], &history[256..512]).expect("span 1 is resident");
        let first = tables(&kv).next().unwrap();
        assert!(Arc::ptr_eq(&got[0], first.full_page(1).unwrap()));
        assert_eq!(got.len(), tables(&kv).count());
        assert_eq!(got[0].id(), Some(ks[1]));
        assert!(index.resident(&ks[1], &history[0..256]).is_none(), "tokens are compared");
        assert!(index.resident(&ks[2], &[0; 256]).is_none(), "the partial span is not registered");
        assert_eq!(index.stats().resident, 2);
        drop((got, kv));
        assert_eq!(pool.live_pages(), 0, "the index holds no page alive");
        assert!(index.resident(&ks[0], &history[..256]).is_none());
        assert_eq!(index.stats().resident, 0);
    }
}
