//! # ds4-kv
//!
//! The KV cache as a first-class, paged store: pages of KV state keyed by a chained hash of the token prefix, kept on
//! disk (or in memory, and exchanged as self-validating blobs with a shared tier), shared between sessions, written
//! crash-safely and evicted by a policy that keeps widely shared prefixes. The key is the page's one identity: the
//! engine finds the copies of a page it holds in RAM and on the device by the same key (`ds4_engine::tables::
//! PageIndex`), so a restore reads only what RAM lacks. The crate does not depend on the engine: it stores typed row
//! blocks (`rows × width` f32 values with an engine-defined tag) grouped per layer, and hands them back.
//!
//! | module | what |
//! | --- | --- |
//! | [`store`] | [`KvStore`]: open/scan, `put_page`, `put_checkpoint`, `longest_prefix`, `load`, pins, `gc`, `status` |
//! | [`key`] | [`Key`], [`ModelIdentity`], [`PrefixHasher`]: chained SHA1 page keys |
//! | [`format`](mod@format) | the `.page`/`.ckpt` file format: header, layout with a CRC32 per block, streaming read/write |
//! | [`codec`] | lossless compact encodings (f32, f16, FP8 e4m3 + power-of-two scale per 64 values) |
//! | [`disk`] | atomic publish (temp, fsync, rename, fsync dir), temp cleanup, directory scan |
//! | [`policy`] | eviction: pinned and interior entries stay, then lowest `(1+hits+sharers)·decay/bytes` |
//! | [`triggers`] | when to save: cold, continued, evict, shutdown |
//! | [`io`] | [`IoWorker`]: tier I/O (saves, restores, remote round trips) in order on a thread of its own |
//! | [`admin`] | offline `ls` / `gc` of a directory holding any models' files (for `ds4 kv`) |
//!
//! A page holds, for one span of `span_tokens` tokens (a multiple of the largest compression ratio), the rows every
//! layer appended during that span (CSA: compressed KV + indexer rows; HCA: compressed KV rows). A checkpoint holds a
//! session's non-shareable tail state at a position (raw windows, compressor/indexer frontiers, partial-span rows,
//! next-token logits). Resuming needs pages + one checkpoint; see [`store`].
//!
//! ## Quick guide
//! ```no_run
//! use ds4_kv::{KvOptions, KvStore, ModelIdentity, RowBlock, SaveReason};
//! # fn main() -> ds4_kv::KvResult<()> {
//! let store = KvStore::open("/var/cache/ds4-kv", ModelIdentity::new("flash q2 sim=1"), KvOptions::default())?;
//! let tokens: Vec<u32> = (0..300).collect();
//! let rows = vec![0f32; 64 * 512];
//! // Save: full spans as pages (parent = previous page, the root first), the rest in a checkpoint.
//! let layers = vec![vec![RowBlock { tag: 0, rows: 64, width: 512, values: &rows }]];
//! let page = store.put_page(&store.root(), &tokens[..256], &layers, SaveReason::Cold)?;
//! store.put_checkpoint(&page.key, &tokens[256..], &layers, SaveReason::Cold)?;
//! // Restore: the longest prefix ending at a checkpoint, streamed block by block.
//! let m = store.longest_prefix(&tokens);
//! for e in m.pages.iter().chain(m.checkpoint.iter()) {
//!     store.load(&e.key, |block| {
//!         let _ = (block.group, block.tag, block.rows, block.width, block.values);
//!         Ok(())
//!     })?;
//! }
//! println!("{:?}", store.status()); // DiskStatus: enabled, last_error, error counters, bytes, evictions
//! # Ok(())
//! # }
//! ```
//! Benchmarks: `put_page`/`put_checkpoint` (encode + write + fsync + rename) and `load` (read + CRC + decode) are the
//! operations to time; `cargo run --release -p ds4-kv --example kv_synth -- DIR TOKENS` fills a directory with a
//! Flash-shaped session and prints save/load MB/s next to a raw sequential write.

pub mod admin;
pub mod codec;
pub mod disk;
pub mod error;
pub mod format;
pub mod io;
pub mod key;
pub mod policy;
pub mod store;
mod table;
pub mod triggers;

pub use codec::Encoding;
pub use error::{KvError, KvResult};
pub use format::{BlockDesc, EntryKind, Header, RowBlock, RowsView, SaveReason};
pub use io::{IoJob, IoPending, IoWorker};
pub use key::{checkpoint_key, page_key, Key, ModelIdentity, PrefixHasher};
pub use store::{DiskStatus, EntryInfo, EntryRef, ExportedEntry, GcReport, KvOptions, KvStore, LoadInfo, PrefixMatch};
pub use table::{CheckpointId, EntryId, PageId, Tier};
pub use triggers::SavePolicy;
