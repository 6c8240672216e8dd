//! Flat component tables (struct-of-arrays; ids are indices): the [`SessionTable`] and each session's KV state
//! ([`SessionKv`]: raw window rings, compressed rows, indexer rows, compressor frontiers), whose growing rows live in
//! refcounted pages shared between sessions ([`pages`]: [`PagedRows`], [`PageLedger`]); full pages are found by the
//! store's page key ([`page_index`]: [`PageIndex`]).
//!
//! Snapshots are plain data ([`SessionSnapshot`]) that share the pages (immutable once full, copied on write when
//! partial); the `kv` crate serialises them to disk page by page.

pub(crate) mod kv;
pub(crate) mod page_index;
pub(crate) mod pages;
pub(crate) mod session;

pub use kv::{Frontier, KvSync, LayerKv, SessionKv};
pub use page_index::{PageIndex, PageIndexStats};
pub use pages::{Page, PageLedger, PagedRows, PAGE_TOKENS};
pub use session::{SessionId, SessionSnapshot, SessionTable};
