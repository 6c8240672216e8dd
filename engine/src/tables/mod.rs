//! Flat component tables (struct-of-arrays; ids are indices): the [`SessionTable`] and each session's KV state
//! ([`SessionKv`]: raw window rings, compressed rows, indexer rows, compressor frontiers).
//!
//! Snapshots are plain data ([`SessionSnapshot`]); the `kv` crate serialises them and pages the growing rows.

pub mod kv;
pub mod pages;
pub mod session;

pub use kv::{Frontier, KvSync, LayerKv, SessionKv};
pub use pages::{PagePool, PagedRows, PAGE_TOKENS};
pub use session::{SessionId, SessionSnapshot, SessionTable};
