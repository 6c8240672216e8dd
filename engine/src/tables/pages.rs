//! KV pages: the live layout of a session's compressed and indexer rows, shared between sessions by reference.
//!
//! A [`PagedRows`] is one growing row table (one layer's compressed rows, or its indexer rows): a list of
//! refcounted [`Page`]s of `rows_per_page` rows each (a power of two; [`rows_per_page`] gives the [`PAGE_TOKENS`]
//! span of the layer's compress ratio, so a page covers the same 256-token span as a `ds4-kv` disk page) plus the
//! row count. Row `i` lives in page `i >> shift` at offset `(i & mask) · width`: [`PagedRows::row`] is two
//! indexings, no lookup.
//!
//! Invariants:
//! - `pages.len() == ceil(rows / rows_per_page)`; every page but the last holds `rows_per_page` valid rows.
//! - A page referenced by more than one table (after a clone: a fork, a snapshot) is immutable. Appending to a
//!   table whose last (partial) page is shared first copies that page's valid rows into a fresh private page
//!   (copy on write, counted in [`PageLedger::bytes_copied`]); full pages are never copied.
//! - A page's `data` may hold more values than the table's view of it (after a truncate into a shared page, or a
//!   roll back); only the first `valid` rows count, and a private page drops the rest before it is appended to.
//!
//! Cloning a table clones `Arc`s: a fork of a session shares every page and copies nothing here. Every page
//! reports to the [`PageLedger`] it was made in (live pages, live bytes); dropping the last reference returns them,
//! so a pool whose sessions are all gone reads zero.
//!
//! Why not the `ds4-kv` store: that crate indexes content-addressed, encoded, immutable entries behind a mutex
//! (keys are chained hashes of the token prefix, values are file images). The live table needs raw f32 rows the
//! attention loop reads without a lock, a mutable partial page, and sharing by identity rather than by content;
//! `Arc` gives the refcount, and ownership makes ids and generations unnecessary on the host tier.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::page_index::PageIndex;

/// Tokens per page: the default `ds4-kv` span (`KvOptions::span_tokens`), a multiple of every DeepSeek V4 ratio.
pub const PAGE_TOKENS: usize = 256;

/// Rows per page for a layer of compress ratio `ratio`: `PAGE_TOKENS / ratio` rounded down to a power of two
/// (at least 1).
pub fn rows_per_page(ratio: usize) -> usize {
    let n = (PAGE_TOKENS / ratio.max(1)).max(1);
    1 << (usize::BITS - 1 - n.leading_zeros())
}

#[derive(Default)]
struct PoolStats {
    pages: AtomicU64,
    bytes: AtomicU64,
    copied: AtomicU64,
    /// The full pages by their store key ([`super::page_index`]).
    index: PageIndex,
}

impl std::fmt::Debug for PoolStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolStats").field("pages", &self.pages).field("bytes", &self.bytes).finish()
    }
}

/// Accounting shared by the pages of one engine (cheap to clone: an `Arc`). See the module docs. The default
/// pool (what `SessionKv::default()` holds) counts nothing and allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct PageLedger(Option<Arc<PoolStats>>);

impl PageLedger {
    /// A new, empty, counting pool.
    pub fn new() -> PageLedger {
        PageLedger(Some(Arc::default()))
    }

    fn get(&self, f: impl Fn(&PoolStats) -> &AtomicU64) -> u64 {
        self.0.as_ref().map_or(0, |s| f(s).load(Ordering::Relaxed))
    }

    fn add(&self, f: impl Fn(&PoolStats) -> &AtomicU64, n: u64) {
        if let Some(s) = &self.0 {
            f(s).fetch_add(n, Ordering::Relaxed);
        }
    }

    fn sub(&self, f: impl Fn(&PoolStats) -> &AtomicU64, n: u64) {
        if let Some(s) = &self.0 {
            f(s).fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// Pages alive (referenced by any table).
    pub fn live_pages(&self) -> u64 {
        self.get(|s| &s.pages)
    }

    /// Bytes reserved by the live pages.
    pub fn live_bytes(&self) -> u64 {
        self.get(|s| &s.bytes)
    }

    /// KV bytes copied so far: private tails of forks and snapshots, copy-on-write of shared partial pages and of
    /// shared roll-back log chunks.
    pub fn bytes_copied(&self) -> u64 {
        self.get(|s| &s.copied)
    }

    /// Adds `bytes` to [`PageLedger::bytes_copied`].
    pub fn add_copied(&self, bytes: u64) {
        self.add(|s| &s.copied, bytes);
    }

    fn page(&self, values: usize) -> Page {
        let data = Vec::with_capacity(values);
        self.add(|s| &s.pages, 1);
        self.add(|s| &s.bytes, (data.capacity() * 4) as u64);
        Page { data, pool: self.clone(), id: OnceLock::new() }
    }

    /// The index of this pool's full pages by store key ([`super::page_index`]); `None` for the default,
    /// non-counting pool.
    pub fn index(&self) -> Option<&PageIndex> {
        self.0.as_deref().map(|s| &s.index)
    }

    /// Whether `a` and `b` are the same counting pool.
    pub fn same(a: &PageLedger, b: &PageLedger) -> bool {
        matches!((&a.0, &b.0), (Some(x), Some(y)) if Arc::ptr_eq(x, y))
    }
}

/// Bookkeeping only: any two pools compare equal (so states in different pools compare by content).
impl PartialEq for PageLedger {
    fn eq(&self, _: &PageLedger) -> bool {
        true
    }
}

/// One page of rows (see the module docs).
pub struct Page {
    data: Vec<f32>,
    pool: PageLedger,
    /// The store key of the span this (full) page holds, once registered ([`super::page_index`]).
    id: OnceLock<ds4_kv::Key>,
}

impl Page {
    /// The store key of the span this page holds, when it has been registered in its pool's [`PageIndex`] (only
    /// full pages are; a registered page is never written again, since the index's reference stops
    /// `Arc::get_mut`).
    pub fn id(&self) -> Option<ds4_kv::Key> {
        self.id.get().copied()
    }

    pub(crate) fn set_id(&self, key: ds4_kv::Key) {
        let _ = self.id.set(key);
    }

    /// The page's values (`rows_per_page × width` for a full page).
    pub fn values(&self) -> &[f32] {
        &self.data
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        self.pool.sub(|s| &s.pages, 1);
        self.pool.sub(|s| &s.bytes, (self.data.capacity() * 4) as u64);
    }
}

/// A paged row table (see the module docs).
#[derive(Clone, Default)]
pub struct PagedRows {
    width: usize,
    shift: u32,
    rows: usize,
    pages: Vec<Arc<Page>>,
    pool: PageLedger,
}

impl std::fmt::Debug for PagedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedRows")
            .field("width", &self.width)
            .field("rows_per_page", &self.rows_per_page())
            .field("rows", &self.rows)
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl PartialEq for PagedRows {
    fn eq(&self, o: &PagedRows) -> bool {
        self.width == o.width && self.rows == o.rows && (0..self.rows).all(|i| self.row(i) == o.row(i))
    }
}

impl PagedRows {
    /// An empty table of `width`-value rows, `rows_per_page` (rounded down to a power of two) per page, reporting
    /// to `pool`.
    pub fn new(width: usize, rows_per_page: usize, pool: &PageLedger) -> PagedRows {
        let shift = usize::BITS - 1 - rows_per_page.max(1).leading_zeros();
        PagedRows { width, shift, rows: 0, pages: Vec::new(), pool: pool.clone() }
    }

    /// Row width (values).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows per page.
    pub fn rows_per_page(&self) -> usize {
        1 << self.shift
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values held (`rows · width`).
    pub fn n_values(&self) -> usize {
        self.rows * self.width
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Rows this table can hold without growing its page list (at least `rows`).
    pub fn capacity_rows(&self) -> usize {
        (self.pages.capacity() << self.shift).max(self.rows)
    }

    /// Makes room in the page list for `rows` rows in all (pointers only; no page is allocated).
    pub fn reserve_rows(&mut self, rows: usize) {
        let want = rows.div_ceil(self.rows_per_page());
        if want > self.pages.len() {
            self.pages.reserve(want - self.pages.len());
        }
    }

    /// Row `i` (`i < rows`).
    #[inline]
    pub fn row(&self, i: usize) -> &[f32] {
        debug_assert!(i < self.rows);
        let o = (i & ((1 << self.shift) - 1)) * self.width;
        &self.pages[i >> self.shift].data[o..o + self.width]
    }

    /// Valid rows of page `p`.
    fn valid(&self, p: usize) -> usize {
        (self.rows - (p << self.shift)).min(self.rows_per_page())
    }

    /// Appends one row (`row.len() == width`); copies a shared partial last page first (see the module docs).
    pub fn push(&mut self, row: &[f32]) {
        assert_eq!(row.len(), self.width, "row width");
        let rpp = self.rows_per_page();
        if self.rows.is_multiple_of(rpp) {
            let mut page = self.pool.page(rpp * self.width);
            page.data.extend_from_slice(row);
            self.pages.push(Arc::new(page));
        } else {
            let used = (self.rows & (rpp - 1)) * self.width;
            let last = self.pages.last_mut().expect("a partial page exists");
            match Arc::get_mut(last) {
                Some(p) => {
                    p.data.truncate(used);
                    p.data.extend_from_slice(row);
                }
                None => {
                    let mut page = self.pool.page(rpp * self.width);
                    page.data.extend_from_slice(&last.data[..used]);
                    page.data.extend_from_slice(row);
                    self.pool.add_copied((used * 4) as u64);
                    *last = Arc::new(page);
                }
            }
        }
        self.rows += 1;
    }

    /// Appends `values.len() / width` rows.
    pub fn extend_from_slice(&mut self, values: &[f32]) {
        if self.width == 0 {
            return;
        }
        for r in values.chunks_exact(self.width) {
            self.push(r);
        }
    }

    /// Keeps the first `rows` rows (no-op when there are fewer); later pages are released.
    pub fn truncate(&mut self, rows: usize) {
        if rows < self.rows {
            self.rows = rows;
            self.pages.truncate(rows.div_ceil(self.rows_per_page()));
        }
    }

    /// Releases every page.
    pub fn clear(&mut self) {
        self.rows = 0;
        self.pages.clear();
    }

    /// The valid values of each page, in order (concatenated: every row).
    pub fn page_slices(&self) -> impl Iterator<Item = &[f32]> + '_ {
        (0..self.pages.len()).map(|p| &self.pages[p].data[..self.valid(p) * self.width])
    }

    /// Rows `a..b` as one slice: borrowed when they lie in one page (a persisted span), else gathered.
    pub fn range(&self, a: usize, b: usize) -> Cow<'_, [f32]> {
        let b = b.min(self.rows);
        if a >= b {
            return Cow::Borrowed(&[]);
        }
        let (pa, pb) = (a >> self.shift, (b - 1) >> self.shift);
        let base = |p: usize| p << self.shift;
        if pa == pb {
            let d = &self.pages[pa].data;
            return Cow::Borrowed(&d[(a - base(pa)) * self.width..(b - base(pa)) * self.width]);
        }
        let mut v = Vec::with_capacity((b - a) * self.width);
        for i in a..b {
            v.extend_from_slice(self.row(i));
        }
        Cow::Owned(v)
    }

    /// Every row, concatenated (a copy).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.n_values());
        for s in self.page_slices() {
            v.extend_from_slice(s);
        }
        v
    }

    /// Page `p` when it is full (holds `rows_per_page` valid rows).
    pub fn full_page(&self, p: usize) -> Option<&Arc<Page>> {
        (p < self.pages.len() && self.valid(p) == self.rows_per_page()).then(|| &self.pages[p])
    }

    /// Appends a full page (a page RAM already holds for the next span of this table, see
    /// [`super::page_index`]): `false`, and nothing changes, unless the table ends at a page boundary and `page`
    /// holds exactly one page of rows of this width.
    pub fn push_page(&mut self, page: Arc<Page>) -> bool {
        let rpp = self.rows_per_page();
        if !self.rows.is_multiple_of(rpp) || self.width == 0 || page.data.len() != rpp * self.width {
            return false;
        }
        self.pages.push(page);
        self.rows += rpp;
        true
    }

    /// Pages held.
    pub fn n_pages(&self) -> usize {
        self.pages.len()
    }

    /// Pages this table shares with another table.
    pub fn shared_pages(&self) -> usize {
        self.pages.iter().filter(|p| Arc::strong_count(p) > 1).count()
    }

    /// Whether page `p` of `self` and of `o` are the same page (shared, not copied).
    pub fn same_page(&self, o: &PagedRows, p: usize) -> bool {
        p < self.pages.len() && p < o.pages.len() && Arc::ptr_eq(&self.pages[p], &o.pages[p])
    }

    /// The pool the pages report to.
    pub fn pool(&self) -> &PageLedger {
        &self.pool
    }

    /// Takes over `o`'s pages in place of this table's among the first `pages` full pages of both (a session
    /// loaded from disk joining the pages a live session already holds for the same prefix: one copy in memory
    /// instead of two). The caller vouches that those pages hold the rows of the same token prefix (rows are a
    /// function of the prefix); as a guard against a mismatched table, a page whose first row differs is kept, as
    /// are partial pages. Returns the pages taken over. Cost: one row compared per page.
    pub fn adopt_pages(&mut self, o: &PagedRows, pages: usize) -> usize {
        if self.width != o.width || self.shift != o.shift || self.width == 0 {
            return 0;
        }
        let full = (self.rows.min(o.rows) >> self.shift).min(pages);
        let w = self.width;
        let mut adopted = 0;
        for p in 0..full {
            if !Arc::ptr_eq(&self.pages[p], &o.pages[p]) && self.pages[p].data[..w] == o.pages[p].data[..w] {
                self.pages[p] = o.pages[p].clone();
                adopted += 1;
            }
        }
        adopted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(t: &PagedRows) -> Vec<f32> {
        t.to_vec()
    }

    #[test]
    fn full_pages_are_adopted_and_mismatched_or_partial_ones_kept() {
        let pool = PageLedger::new();
        let fill = |t: &mut PagedRows, n: usize, bump: usize| {
            for i in 0..n {
                t.push(&[i as f32 + if i == bump { 0.5 } else { 0.0 }, 1.0]);
            }
        };
        let mut live = PagedRows::new(2, 4, &pool);
        fill(&mut live, 14, usize::MAX); // pages 0..3 full, page 3 partial
        let mut loaded = PagedRows::new(2, 4, &pool);
        fill(&mut loaded, 13, 4); // page 1's first row differs, page 3 partial
        let before = loaded.to_vec();
        assert_eq!(loaded.adopt_pages(&live, usize::MAX), 2);
        assert!(loaded.same_page(&live, 0) && !loaded.same_page(&live, 1) && loaded.same_page(&live, 2));
        assert!(!loaded.same_page(&live, 3));
        assert_eq!(loaded.to_vec(), before);
        // A bound on the pages, a different width, and a second call adopt nothing more.
        let mut other = PagedRows::new(2, 4, &pool);
        fill(&mut other, 12, usize::MAX);
        assert_eq!(other.adopt_pages(&live, 1), 1);
        assert_eq!(loaded.adopt_pages(&live, usize::MAX), 0);
        assert_eq!(PagedRows::new(3, 4, &pool).adopt_pages(&live, 9), 0);
        // The duplicates went back to the pool: loaded and other share live's pages 0 and 2 / 0.
        drop(live);
        assert_eq!(loaded.to_vec(), before);
    }

    #[test]
    fn rows_per_page_covers_the_page_span() {
        assert_eq!(rows_per_page(4), 64);
        assert_eq!(rows_per_page(128), 2);
        assert_eq!(rows_per_page(0), 256);
        assert_eq!(rows_per_page(3), 64);
        assert_eq!(rows_per_page(512), 1);
    }

    #[test]
    fn clone_shares_pages_and_append_copies_only_the_partial_page() {
        let pool = PageLedger::new();
        let mut a = PagedRows::new(2, 4, &pool);
        for i in 0..10 {
            a.push(&[i as f32, -(i as f32)]);
        }
        assert_eq!((a.rows(), a.n_pages(), pool.live_pages()), (10, 3, 3));
        assert_eq!(a.row(5), &[5.0, -5.0]);
        let mut b = a.clone();
        assert_eq!((pool.live_pages(), pool.bytes_copied()), (3, 0));
        assert_eq!(b.shared_pages(), 3);
        b.push(&[100.0, 100.0]);
        // The shared partial page (2 valid rows of 2 values) was copied; the full ones stay shared.
        assert_eq!((pool.live_pages(), pool.bytes_copied()), (4, 16));
        assert!(b.same_page(&a, 0) && b.same_page(&a, 1) && !b.same_page(&a, 2));
        a.push(&[7.0, 7.0]);
        assert_eq!(pool.bytes_copied(), 16, "the parent's partial page is private again");
        assert_eq!(a.row(10), &[7.0, 7.0]);
        assert_eq!(b.row(10), &[100.0, 100.0]);
        assert_eq!(rows(&a)[..20], rows(&b)[..20]);
        drop(a);
        drop(b);
        assert_eq!((pool.live_pages(), pool.live_bytes()), (0, 0));
    }

    #[test]
    fn truncate_into_a_shared_page_then_append_keeps_the_other_table_intact() {
        let pool = PageLedger::new();
        let mut a = PagedRows::new(1, 4, &pool);
        a.extend_from_slice(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let mut b = a.clone();
        b.truncate(2);
        assert_eq!((b.rows(), b.n_pages()), (2, 1));
        b.push(&[9.0]);
        assert_eq!(rows(&b), vec![0.0, 1.0, 9.0]);
        assert_eq!(rows(&a), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        // A private page truncated by a roll back drops its stale tail before the append.
        a.truncate(3);
        drop(b);
        a.push(&[8.0]);
        assert_eq!(rows(&a), vec![0.0, 1.0, 2.0, 8.0]);
        assert_eq!(a.range(1, 3).as_ref(), &[1.0, 2.0]);
        assert!(matches!(a.range(0, 4), Cow::Borrowed(_)));
        a.push(&[6.0]);
        assert!(matches!(a.range(2, 5), Cow::Owned(_)));
        assert_eq!(a.range(2, 5).as_ref(), &[2.0, 8.0, 6.0]);
        assert_eq!(a, a.clone());
        let mut c = a.clone();
        c.truncate(4);
        assert_ne!(a, c);
    }
}
