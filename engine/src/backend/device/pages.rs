//! Device KV pages: the device tier of [`crate::tables::pages`], over any [`DeviceMem`]. A layer's compressed rows (or indexer rows) of every
//! device-resident session live in one [`PagePool`] — one device buffer of fixed-size pages of
//! [`rows_per_page`]`(ratio)` rows (the host page's and the `ds4-kv` disk page's row span) — and each session holds
//! a [`PageTable`] per layer and table: the page ids of its rows in order, mirrored in a small `u32` device buffer
//! the kernels read. Row `w` of a table lives at pool row `ids[w >> shift] << shift | (w & mask)` (`pages.wgsl`'s
//! `page_row`, shared by the attention and indexer kernels; appends are copies the host records at that address).
//!
//! Invariants:
//! - Page ids are indices into the pool's refcounts (plain host data; 0 = free, on the free list). A pool grows
//!   by doubling with a device-side copy of its buffer, so ids stay valid; it never exceeds the storage binding
//!   limit (an append beyond it is an error naming the limit).
//! - `ids.len() == ceil(rows / rows_per_page)`; pages past a truncate are released at once.
//! - A page referenced by more than one table (after [`PageTable::share`], a fork) is never written: an append
//!   into a shared partial last page first copies its valid rows into a fresh page (copy on write, bytes
//!   returned to the caller), whether the page was partial at the fork or became so by a truncate (roll back).
//! - Every table is released into its pool exactly once ([`PageTable::release`]); a pool whose tables are all
//!   released holds no live page.
//!
//! The roll-back logs ([`super::kv`]) use the same pools with host-only tables: a [`ChunkRing`] is a ring of
//! slots in pages ("chunks") of [`LOG_CHUNK_TOKENS`] rows, shared by a fork and copied whole on the first write into
//! a shared chunk; the kernels never read it (every access is a copy the host records through its ids).
//!
//! Ordering: every write (rows, ids, growth) is a copy recorded into the caller's command encoder, after the
//! commands that may still read the old contents, never a queue write that would land before them.

use std::collections::HashMap;
use std::sync::Arc;

use ds4_kv::Key;

use super::{dev_err as backend_err, DeviceMem};
pub use crate::tables::pages::rows_per_page;
use crate::tables::{Page, PagedRows};
use crate::Result;

/// Pages a new pool holds.
const FIRST_PAGES: usize = 4;
/// Ids a new table's device buffer holds.
const FIRST_IDS: usize = 16;

/// One layer's pages of one row table, shared by every session's [`PageTable`] (see module docs).
pub struct PagePool<D: DeviceMem> {
    /// Full pages by the store key of the span they hold ([`crate::tables::page_index`]): a table uploaded from host
    /// pages that carry a key shares the device page instead of copying it again. A page loses its key when it is
    /// freed or written (an append into it after a truncate).
    keyed: HashMap<Key, u32>,
    /// The key of each page id (`None`: not keyed).
    key_of: Vec<Option<Key>>,
    /// The pages, `capacity() × rows_per_page × width` f32 values.
    pub buf: D::Buf,
    /// Values per row.
    pub width: usize,
    /// log2 of the rows per page.
    pub shift: u32,
    /// References per page id (0: free).
    refs: Vec<u32>,
    /// Free page ids (popped from the end: the lowest first).
    free: Vec<u32>,
}

impl<D: DeviceMem> PagePool<D> {
    /// An empty pool of pages of `rows_per_page` (a power of two) rows of `width` values.
    pub fn new(ctx: &D, width: usize, rows_per_page: usize) -> Result<PagePool<D>> {
        if width == 0 || !rows_per_page.is_power_of_two() {
            return Err(backend_err(format!("device KV pages: {rows_per_page} rows of {width} values")));
        }
        let page_bytes = (rows_per_page * width * 4) as u64;
        let pages = FIRST_PAGES.min((ctx.max_binding() / page_bytes) as usize);
        if pages == 0 {
            return Err(backend_err(format!(
                "device KV pages: a page of {page_bytes} bytes exceeds the storage binding limit {}",
                ctx.max_binding()
            )));
        }
        Ok(PagePool {
            buf: ctx.zeroed("kv pages", pages * rows_per_page * width),
            width,
            shift: rows_per_page.trailing_zeros(),
            refs: vec![0; pages],
            free: (0..pages as u32).rev().collect(),
            keyed: HashMap::new(),
            key_of: vec![None; pages],
        })
    }

    pub fn rows_per_page(&self) -> usize {
        1 << self.shift
    }

    pub(super) fn page_bytes(&self) -> u64 {
        (self.rows_per_page() * self.width * 4) as u64
    }

    /// Pages the buffer holds.
    pub fn capacity(&self) -> usize {
        self.refs.len()
    }

    /// Pages referenced by some table.
    pub fn live_pages(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Pages referenced by more than one table.
    pub fn shared_pages(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 1).count()
    }

    fn shared(&self, id: u32) -> bool {
        self.refs[id as usize] > 1
    }

    /// A fresh page (refcount 1), growing the pool when none is free.
    fn alloc(&mut self, ctx: &D, enc: &mut D::Enc) -> Result<u32> {
        if self.free.is_empty() {
            self.grow(ctx, enc)?;
        }
        let id = self.free.pop().ok_or_else(|| backend_err("device KV pages: no free page after growing"))?;
        self.refs[id as usize] = 1;
        Ok(id)
    }

    /// Doubles the pool (at most to the storage binding limit), copying the pages on the device.
    fn grow(&mut self, ctx: &D, enc: &mut D::Enc) -> Result<()> {
        let old = self.capacity();
        let max = (ctx.max_binding() / self.page_bytes()) as usize;
        if old >= max {
            return Err(backend_err(format!(
                "device KV pages: {old} pages of {} rows of {} values fill the storage binding limit {} bytes",
                self.rows_per_page(),
                self.width,
                ctx.max_binding()
            )));
        }
        let new = (2 * old).min(max);
        let buf = ctx.zeroed("kv pages", new * self.rows_per_page() * self.width);
        ctx.copy(enc, &self.buf, 0, &buf, 0, ctx.size(&self.buf));
        self.buf = buf;
        self.refs.resize(new, 0);
        self.key_of.resize(new, None);
        self.free.extend((old as u32..new as u32).rev());
        Ok(())
    }

    fn retain(&mut self, id: u32) {
        self.refs[id as usize] += 1;
    }

    fn release(&mut self, id: u32) {
        let r = &mut self.refs[id as usize];
        *r -= 1;
        if *r == 0 {
            self.unkey(id);
            self.free.push(id);
        }
    }

    /// The store key page `id` carries, if any.
    pub fn key_of(&self, id: u32) -> Option<Key> {
        self.key_of.get(id as usize).copied().flatten()
    }

    /// Pages that carry a store key.
    pub fn keyed_pages(&self) -> usize {
        self.keyed.len()
    }

    fn key(&mut self, id: u32, key: Key) {
        self.unkey(id);
        self.keyed.insert(key, id);
        self.key_of[id as usize] = Some(key);
    }

    fn unkey(&mut self, id: u32) {
        if let Some(k) = self.key_of[id as usize].take() {
            self.keyed.remove(&k);
        }
    }

    /// A private copy of the first `rows` rows of page `id` in a fresh page, which replaces this reference to
    /// `id` (copy on write).
    fn copy_page(&mut self, ctx: &D, enc: &mut D::Enc, id: u32, rows: usize) -> Result<u32> {
        let new = self.alloc(ctx, enc)?;
        // A buffer cannot be copied into itself: through a scratch buffer.
        let bytes = (rows * self.width * 4) as u64;
        if bytes > 0 {
            let hop = ctx.temp(rows * self.width);
            ctx.copy(enc, &self.buf, self.at(id, 0), &hop, 0, bytes);
            ctx.copy(enc, &hop, 0, &self.buf, self.at(new, 0), bytes);
        }
        self.release(id);
        Ok(new)
    }

    /// Byte offset of row `off` of page `id`.
    fn at(&self, id: u32, off: usize) -> u64 {
        (((id as usize) << self.shift | off) * self.width * 4) as u64
    }
}

/// One session's rows of one layer's row table: page ids in row order, on the host and on the device (see module
/// docs).
pub struct PageTable<D: DeviceMem> {
    /// Page ids, row order.
    pub ids: Vec<u32>,
    /// The ids as `u32` (the kernels' `ptab`); holds at least `ids.len()` of them.
    pub buf: D::Buf,
    /// Rows held.
    pub rows: usize,
    /// Values per row (the pool's).
    pub width: usize,
}

impl<D: DeviceMem> PageTable<D> {
    fn empty(ctx: &D, width: usize, ids: usize) -> PageTable<D> {
        PageTable {
            ids: Vec::new(),
            buf: ctx.upload_u32("kv page table", &vec![0; ids.max(FIRST_IDS)]),
            rows: 0,
            width,
        }
    }

    /// A table holding rows `data` (host values, rows of the pool's width), written into fresh pages of `pool`.
    pub fn upload(ctx: &D, enc: &mut D::Enc, pool: &mut PagePool<D>, data: &[f32]) -> Result<PageTable<D>> {
        let width = pool.width;
        if !data.len().is_multiple_of(width) {
            return Err(backend_err(format!("device KV: {} values are not rows of {width}", data.len())));
        }
        let rows = data.len() / width;
        let mut t = PageTable::empty(ctx, width, rows.div_ceil(pool.rows_per_page()));
        if rows > 0 {
            let src = ctx.upload_f32("kv rows upload", data);
            t.append(ctx, enc, pool, &src, 0, rows)?;
        }
        Ok(t)
    }

    /// A table holding the rows of host table `rows` (its width and page size must be the pool's): a full page
    /// that carries a store key ([`Page::id`]) this pool already holds is shared (refcount + 1, nothing copied),
    /// every other page is uploaded, and the full keyed ones among them are keyed here for the next table. Returns
    /// the table and the pages shared.
    pub fn upload_paged(
        ctx: &D,
        enc: &mut D::Enc,
        pool: &mut PagePool<D>,
        rows: &PagedRows,
    ) -> Result<(PageTable<D>, usize)> {
        if rows.width() != pool.width || rows.rows_per_page() != pool.rows_per_page() {
            return Ok((PageTable::upload(ctx, enc, pool, &rows.to_vec())?, 0));
        }
        let rpp = pool.rows_per_page();
        let mut t = PageTable::empty(ctx, pool.width, rows.n_pages());
        let mut shared = 0;
        // Consecutive pages to upload: their values, and the keys of the full ones (by page index).
        let mut batch: Vec<f32> = Vec::new();
        let mut keys: Vec<(usize, Key)> = Vec::new();
        for (p, values) in rows.page_slices().enumerate() {
            let key = rows.full_page(p).and_then(|pg: &Arc<Page>| pg.id());
            match key.and_then(|k| pool.keyed.get(&k).copied()) {
                Some(id) => {
                    t.upload_batch(ctx, enc, pool, &mut batch, &mut keys)?;
                    pool.retain(id);
                    t.set_id(ctx, enc, p, id);
                    t.rows += rpp;
                    shared += 1;
                }
                None => {
                    batch.extend_from_slice(values);
                    keys.extend(key.map(|k| (p, k)));
                }
            }
        }
        t.upload_batch(ctx, enc, pool, &mut batch, &mut keys)?;
        Ok((t, shared))
    }

    /// Appends the rows of `batch` (emptied) and keys the full pages `keys` names (page index, key) unless another
    /// page holds that key already.
    fn upload_batch(
        &mut self,
        ctx: &D,
        enc: &mut D::Enc,
        pool: &mut PagePool<D>,
        batch: &mut Vec<f32>,
        keys: &mut Vec<(usize, Key)>,
    ) -> Result<()> {
        if !batch.is_empty() {
            let src = ctx.upload_f32("kv rows upload", batch);
            self.append(ctx, enc, pool, &src, 0, batch.len() / pool.width)?;
            batch.clear();
        }
        for (p, k) in keys.drain(..) {
            if !pool.keyed.contains_key(&k) {
                pool.key(self.ids[p], k);
            }
        }
        Ok(())
    }

    /// A table sharing every page of this one: refcounts + 1, the ids copied on the device, no row copied (the ids
    /// are not KV bytes, as the host tier's page references are not).
    pub fn share(&self, ctx: &D, enc: &mut D::Enc, pool: &mut PagePool<D>) -> PageTable<D> {
        let mut t = PageTable::empty(ctx, self.width, (ctx.size(&self.buf) / 4) as usize);
        for &id in &self.ids {
            pool.retain(id);
        }
        let bytes = (self.ids.len() * 4) as u64;
        if bytes > 0 {
            ctx.copy(enc, &self.buf, 0, &t.buf, 0, bytes);
        }
        t.ids = self.ids.clone();
        t.rows = self.rows;
        t
    }

    /// Sets id `i` (appending when `i == ids.len()`), with a 4-byte device copy; the device table grows by
    /// doubling when full.
    fn set_id(&mut self, ctx: &D, enc: &mut D::Enc, i: usize, id: u32) {
        let cap = (ctx.size(&self.buf) / 4) as usize;
        if i >= cap {
            let buf = ctx.upload_u32("kv page table", &vec![0; 2 * cap]);
            ctx.copy(enc, &self.buf, 0, &buf, 0, ctx.size(&self.buf));
            self.buf = buf;
        }
        if i == self.ids.len() {
            self.ids.push(id);
        } else {
            self.ids[i] = id;
        }
        let one = ctx.upload_u32("kv page id", &[id]);
        ctx.copy(enc, &one, 0, &self.buf, (i * 4) as u64, 4);
    }

    /// Appends rows `first..first + n` of `src` (rows of the pool's width) after this table's rows: into the
    /// last page while it has room (copied first when shared: copy on write), then into fresh pages. Returns the
    /// bytes the copy on write copied.
    pub fn append(
        &mut self,
        ctx: &D,
        enc: &mut D::Enc,
        pool: &mut PagePool<D>,
        src: &D::Buf,
        first: usize,
        n: usize,
    ) -> Result<u64> {
        let (rpp, rb) = (pool.rows_per_page(), (self.width * 4) as u64);
        let mut copied = 0;
        let mut done = 0;
        while done < n {
            let (page, off) = (self.rows >> pool.shift, self.rows & (rpp - 1));
            if page == self.ids.len() {
                let id = pool.alloc(ctx, enc)?;
                self.set_id(ctx, enc, page, id);
            } else if pool.shared(self.ids[page]) {
                let id = pool.copy_page(ctx, enc, self.ids[page], off)?;
                self.set_id(ctx, enc, page, id);
                copied += off as u64 * rb;
            } else {
                // Written in place: it no longer holds its span's rows alone.
                pool.unkey(self.ids[page]);
            }
            let k = (rpp - off).min(n - done);
            let at = pool.at(self.ids[page], off);
            ctx.copy(enc, src, (first + done) as u64 * rb, &pool.buf, at, k as u64 * rb);
            self.rows += k;
            done += k;
        }
        Ok(copied)
    }

    /// Keeps the first `rows` rows (at most those held), releasing the pages past them.
    pub fn truncate(&mut self, pool: &mut PagePool<D>, rows: usize) {
        self.rows = self.rows.min(rows);
        for id in self.ids.drain(self.rows.div_ceil(pool.rows_per_page())..) {
            pool.release(id);
        }
    }

    /// Releases every page.
    pub fn release(&mut self, pool: &mut PagePool<D>) {
        self.truncate(pool, 0);
    }

    /// Records copies of rows `rows` (within those held), read through the table, into a contiguous scratch
    /// buffer (row `rows.start` at 0).
    pub fn gather(
        &self,
        ctx: &D,
        enc: &mut D::Enc,
        pool: &PagePool<D>,
        rows: std::ops::Range<usize>,
    ) -> Result<D::Temp> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(backend_err(format!("device KV: rows {rows:?} out of 0..{}", self.rows)));
        }
        let (rpp, rb) = (pool.rows_per_page(), (self.width * 4) as u64);
        let out = ctx.temp(rows.len() * self.width);
        let mut w = rows.start;
        while w < rows.end {
            let off = w & (rpp - 1);
            let k = (rpp - off).min(rows.end - w);
            let at = pool.at(self.ids[w >> pool.shift], off);
            ctx.copy(enc, &pool.buf, at, &out, (w - rows.start) as u64 * rb, k as u64 * rb);
            w += k;
        }
        Ok(out)
    }
}

/// Token slots of a roll-back log chunk ([`ChunkRing`]): the page size of a log's pool.
pub const LOG_CHUNK_TOKENS: usize = 64;

/// An id not allocated yet.
const NO_CHUNK: u32 = u32::MAX;

/// One session's ring of `slots` rows (a roll-back log input, see [`super::kv`]) held as chunks — pages of a
/// [`PagePool`] of [`LOG_CHUNK_TOKENS`] rows: slot `s` is row `s % LOG_CHUNK_TOKENS` of chunk `s / LOG_CHUNK_TOKENS`.
/// Host data only (the kernels never read a log; every access is a copy the host records through the ids). A
/// chunk is allocated at its first write; [`ChunkRing::share`] shares every chunk (a fork, no bytes), and a write
/// into a shared chunk copies the whole chunk into a fresh one first (copy on write).
pub struct ChunkRing {
    ids: Vec<u32>,
}

impl ChunkRing {
    /// A ring of `slots` slots, no chunk allocated.
    pub fn new(slots: usize) -> ChunkRing {
        ChunkRing { ids: vec![NO_CHUNK; slots.div_ceil(LOG_CHUNK_TOKENS)] }
    }

    /// A ring sharing every chunk of this one (refcounts + 1, nothing copied).
    pub fn share<D: DeviceMem>(&self, pool: &mut PagePool<D>) -> ChunkRing {
        for &id in self.ids.iter().filter(|&&id| id != NO_CHUNK) {
            pool.retain(id);
        }
        ChunkRing { ids: self.ids.clone() }
    }

    /// Records copies of rows `(src_row, slot)` of `src` into their slots, allocating the chunks not yet held and
    /// copying the shared ones first (whole chunks). Returns the bytes the copies on write copied.
    pub fn write<D: DeviceMem>(
        &mut self,
        ctx: &D,
        enc: &mut D::Enc,
        pool: &mut PagePool<D>,
        src: &D::Buf,
        pairs: &[(usize, usize)],
    ) -> Result<u64> {
        let mut copied = 0;
        for &(_, slot) in pairs {
            let c = self.chunk(slot)?;
            let id = self.ids[c];
            if id == NO_CHUNK {
                self.ids[c] = pool.alloc(ctx, enc)?;
            } else if pool.shared(id) {
                self.ids[c] = pool.copy_page(ctx, enc, id, pool.rows_per_page())?;
                copied += pool.page_bytes();
            }
        }
        let rows = pairs.iter().map(|&(r, slot)| Ok((r, self.row(pool, slot)?))).collect::<Result<Vec<_>>>()?;
        super::copy_rows(ctx, enc, src, &pool.buf, &rows, pool.width);
        Ok(copied)
    }

    /// Pairs `(slot, dst)` as `(pool row, dst)`, for copies out of `pool.buf`; an error for a slot never written.
    pub fn reads<D: DeviceMem>(&self, pool: &PagePool<D>, pairs: &[(usize, usize)]) -> Result<Vec<(usize, usize)>> {
        pairs.iter().map(|&(slot, d)| Ok((self.row(pool, slot)?, d))).collect()
    }

    fn chunk(&self, slot: usize) -> Result<usize> {
        let c = slot / LOG_CHUNK_TOKENS;
        if c < self.ids.len() {
            Ok(c)
        } else {
            Err(backend_err(format!("device KV log: slot {slot} out of {} chunks", self.ids.len())))
        }
    }

    fn row<D: DeviceMem>(&self, pool: &PagePool<D>, slot: usize) -> Result<usize> {
        match self.ids[self.chunk(slot)?] {
            NO_CHUNK => Err(backend_err(format!("device KV log: slot {slot} was never written"))),
            id => Ok(((id as usize) << pool.shift) | (slot % LOG_CHUNK_TOKENS)),
        }
    }

    /// Releases every chunk into `pool` (the ring is empty afterwards).
    pub fn release<D: DeviceMem>(&mut self, pool: &mut PagePool<D>) {
        for id in self.ids.iter_mut() {
            if *id != NO_CHUNK {
                pool.release(*id);
                *id = NO_CHUNK;
            }
        }
    }
}

/// The layer's page checks, generic over the device: run on the mock ([`super::mock`]) here and on wgpu by its
/// tests.
#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Rows `0..n` of width `w`: row r holds `base + r` in every value.
    fn rows(base: f32, n: usize, w: usize) -> Vec<f32> {
        (0..n).flat_map(|r| std::iter::repeat_n(base + r as f32, w)).collect()
    }

    fn read<D: DeviceMem>(ctx: &D, t: &PageTable<D>, pool: &PagePool<D>) -> Vec<f32> {
        let mut enc = ctx.encoder();
        let out = t.gather(ctx, &mut enc, pool, 0..t.rows).unwrap();
        ctx.submit_read_f32(enc, &out, 0, t.rows * t.width).unwrap()
    }

    fn append<D: DeviceMem>(ctx: &D, t: &mut PageTable<D>, pool: &mut PagePool<D>, data: &[f32]) -> u64 {
        let mut enc = ctx.encoder();
        let src = ctx.upload_f32("src", data);
        let copied = t.append(ctx, &mut enc, pool, &src, 0, data.len() / t.width).unwrap();
        ctx.submit(enc).unwrap();
        copied
    }

    /// Growth keeps ids valid; a shared table copies its partial page on the first append (after a share and after
    /// a truncate into a shared page) and never writes a page the other table reads; releasing returns every page.
    pub(crate) fn shared_pages_are_copied_on_write_and_released<D: DeviceMem>(ctx: &D) {
        let (w, rpp) = (4, 8);
        let mut pool = PagePool::new(ctx, w, rpp).unwrap();
        let first = rows(0.0, 37, w);
        let mut enc = ctx.encoder();
        let mut a = PageTable::upload(ctx, &mut enc, &mut pool, &first).unwrap();
        ctx.submit(enc).unwrap();
        // 5 pages: the pool grew from 4 to 8 on the device, the rows are intact.
        assert_eq!((a.ids.len(), pool.live_pages(), pool.capacity()), (5, 5, 8));
        assert_eq!(read(ctx, &a, &pool), first);
        let mut enc = ctx.encoder();
        let mut b = a.share(ctx, &mut enc, &mut pool);
        ctx.submit(enc).unwrap();
        assert_eq!((pool.live_pages(), pool.shared_pages()), (5, 5), "sharing allocates nothing");
        // b fills the shared partial page (5 valid rows): copied first, a unchanged.
        assert_eq!(append(ctx, &mut b, &mut pool, &rows(100.0, 3, w)), (5 * w * 4) as u64);
        assert_eq!((pool.live_pages(), pool.shared_pages()), (6, 4));
        assert_eq!(read(ctx, &a, &pool), first);
        let mut want_b = first.clone();
        want_b.extend(rows(100.0, 3, w));
        assert_eq!(read(ctx, &b, &pool), want_b);
        // a's partial page is private now: no copy.
        assert_eq!(append(ctx, &mut a, &mut pool, &rows(200.0, 1, w)), 0);
        // Truncate b into the shared second page (3 rows kept there): pages past it released (a still holds all but
        // b's private copy).
        b.truncate(&mut pool, 11);
        assert_eq!((b.ids.len(), pool.live_pages()), (2, 5));
        assert_eq!(append(ctx, &mut b, &mut pool, &rows(300.0, 9, w)), (3 * w * 4) as u64);
        let mut want_a = first.clone();
        want_a.extend(rows(200.0, 1, w));
        assert_eq!(read(ctx, &a, &pool), want_a, "b wrote into a page a reads");
        let mut want_b = first[..11 * w].to_vec();
        want_b.extend(rows(300.0, 9, w));
        assert_eq!(read(ctx, &b, &pool), want_b);
        a.release(&mut pool);
        b.release(&mut pool);
        assert_eq!((pool.live_pages(), pool.shared_pages()), (0, 0));
    }

    /// Host pages carrying a store key are uploaded once: a second table of the same rows shares the keyed full
    /// pages (copies only the rest), both read back the host rows, a write into a shared keyed page copies it, and
    /// a page written in place or freed loses its key (the next upload copies it again, with the new rows).
    pub(crate) fn keyed_pages_are_uploaded_once<D: DeviceMem>(ctx: &D) {
        let (w, rpp) = (4, 8);
        let mut pool = PagePool::new(ctx, w, rpp).unwrap();
        let mut host = PagedRows::new(w, rpp, &crate::tables::PageLedger::new());
        let data = rows(0.0, 37, w);
        host.extend_from_slice(&data);
        for p in 0..4 {
            host.full_page(p).unwrap().set_id(Key([p as u8 + 1; 20]));
        }
        let upload = |pool: &mut PagePool<D>| {
            let mut enc = ctx.encoder();
            let out = PageTable::upload_paged(ctx, &mut enc, pool, &host).unwrap();
            ctx.submit(enc).unwrap();
            out
        };
        let (mut a, shared) = upload(&mut pool);
        assert_eq!((shared, pool.live_pages(), pool.keyed_pages()), (0, 5, 4));
        let (mut b, shared) = upload(&mut pool);
        assert_eq!((shared, pool.live_pages(), pool.shared_pages()), (4, 6, 4), "only the partial page is new");
        assert_eq!(read(ctx, &a, &pool), data);
        assert_eq!(read(ctx, &b, &pool), data);
        // b rolls back into shared keyed page 2 and writes: a copy; a still reads the host rows.
        b.truncate(&mut pool, 20);
        append(ctx, &mut b, &mut pool, &rows(100.0, 6, w));
        assert_eq!(read(ctx, &a, &pool), data);
        a.release(&mut pool);
        assert_eq!(pool.keyed_pages(), 2, "pages 2 and 3 were freed with a (b holds its own copy of 2)");
        // b rolls back into page 1, now b's alone, and writes in place: page 1 loses its key.
        b.truncate(&mut pool, 12);
        append(ctx, &mut b, &mut pool, &rows(200.0, 2, w));
        assert_eq!(pool.keyed_pages(), 1);
        let (c, shared) = upload(&mut pool);
        assert_eq!(shared, 1, "only page 0 is still the host's");
        assert_eq!(read(ctx, &c, &pool), data, "no table reads b's rewritten page");
        for mut t in [b, c] {
            t.release(&mut pool);
        }
        assert_eq!((pool.live_pages(), pool.keyed_pages()), (0, 0));
    }

    /// Reads slots `slots` of `ring` (through its chunk ids) into host rows.
    fn read_slots<D: DeviceMem>(ctx: &D, ring: &ChunkRing, pool: &PagePool<D>, slots: &[usize]) -> Vec<f32> {
        let pairs: Vec<(usize, usize)> = slots.iter().enumerate().map(|(d, &s)| (s, d)).collect();
        let rows = ring.reads(pool, &pairs).unwrap();
        let mut enc = ctx.encoder();
        let out = ctx.temp(slots.len() * pool.width);
        super::super::copy_rows(ctx, &mut enc, &pool.buf, &out, &rows, pool.width);
        ctx.submit_read_f32(enc, &out, 0, slots.len() * pool.width).unwrap()
    }

    fn write<D: DeviceMem>(ctx: &D, ring: &mut ChunkRing, pool: &mut PagePool<D>, base: f32, slots: &[usize]) -> u64 {
        let mut enc = ctx.encoder();
        let src = ctx.upload_f32("src", &rows(base, slots.len(), pool.width));
        let pairs: Vec<(usize, usize)> = slots.iter().enumerate().map(|(r, &s)| (r, s)).collect();
        let copied = ring.write(ctx, &mut enc, pool, &src, &pairs).unwrap();
        ctx.submit(enc).unwrap();
        copied
    }

    /// A log ring allocates chunks at their first write, a shared ring copies a whole chunk on its first write into
    /// it (and only that one), the other ring still reads its own rows, a slot never written is an error, and
    /// releasing both returns every chunk.
    pub(crate) fn log_chunks_are_shared_and_copied_on_write<D: DeviceMem>(ctx: &D) {
        let w = 2;
        let mut pool = PagePool::new(ctx, w, LOG_CHUNK_TOKENS).unwrap();
        let cap = 2 * LOG_CHUNK_TOKENS + 10;
        let mut a = ChunkRing::new(cap);
        let all: Vec<usize> = (0..cap).collect();
        assert_eq!(write(ctx, &mut a, &mut pool, 0.0, &all), 0);
        assert_eq!(pool.live_pages(), 3);
        let mut b = a.share(&mut pool);
        assert_eq!((pool.live_pages(), pool.shared_pages()), (3, 3), "sharing allocates nothing");
        // b overwrites slots 70 and 71 (chunk 1): that chunk is copied whole first, once.
        let chunk = (LOG_CHUNK_TOKENS * w * 4) as u64;
        assert_eq!(write(ctx, &mut b, &mut pool, 500.0, &[70, 71]), chunk);
        assert_eq!(write(ctx, &mut b, &mut pool, 600.0, &[72]), 0, "the copy is private");
        assert_eq!((pool.live_pages(), pool.shared_pages()), (4, 2));
        let probe = [0, 69, 70, 71, 72, 73, cap - 1];
        let mut want_a = Vec::new();
        let mut want_b = Vec::new();
        for &s in &probe {
            want_a.extend(rows(s as f32, 1, w));
            let v = match s {
                70 | 71 => 500.0 + (s - 70) as f32,
                72 => 600.0,
                _ => s as f32,
            };
            want_b.extend(rows(v, 1, w));
        }
        assert_eq!(read_slots(ctx, &a, &pool, &probe), want_a, "b wrote into a chunk a reads");
        assert_eq!(read_slots(ctx, &b, &pool, &probe), want_b);
        let fresh = ChunkRing::new(cap);
        assert!(fresh.reads(&pool, &[(5, 0)]).is_err(), "a slot never written");
        assert!(a.reads(&pool, &[(3 * LOG_CHUNK_TOKENS, 0)]).is_err(), "a slot past the ring");
        a.release(&mut pool);
        b.release(&mut pool);
        assert_eq!((pool.live_pages(), pool.shared_pages()), (0, 0));
    }

    /// A pool never grows past the storage binding limit: the append that would is an error naming it. `ctx`'s
    /// binding limit is [`FULL_POOL_BINDING`].
    pub(crate) fn a_full_pool_is_a_clear_error<D: DeviceMem>(ctx: &D) {
        let mut pool = PagePool::new(ctx, 4, 8).unwrap();
        let mut enc = ctx.encoder();
        let mut t = PageTable::upload(ctx, &mut enc, &mut pool, &rows(0.0, 6 * 8, 4)).unwrap();
        assert_eq!(pool.capacity(), 6);
        let src = ctx.upload_f32("src", &rows(0.0, 1, 4));
        let err = t.append(ctx, &mut enc, &mut pool, &src, 0, 1).unwrap_err().to_string();
        assert!(err.contains("storage binding limit"), "{err}");
        t.release(&mut pool);
        assert_eq!(pool.live_pages(), 0);
        assert!(PagePool::new(ctx, 4, 64).is_err(), "a page larger than a binding");
    }

    /// The binding limit of the device [`a_full_pool_is_a_clear_error`] runs on: six pages of 8 rows of 4 values.
    pub(crate) const FULL_POOL_BINDING: u64 = 4 * 8 * 4 * 6;

    #[test]
    fn on_the_mock_device() {
        let dev = crate::backend::device::mock::MockDevice::new(None);
        shared_pages_are_copied_on_write_and_released(&dev);
        log_chunks_are_shared_and_copied_on_write(&dev);
        keyed_pages_are_uploaded_once(&dev);
        a_full_pool_is_a_clear_error(&crate::backend::device::mock::MockDevice::new(Some(FULL_POOL_BINDING)));
        assert_eq!(dev.pending(), 0, "every recorded command was submitted");
    }
}
