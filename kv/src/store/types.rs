//! The store's public data types: options, lookup and load results, status and reports, exported entries.

use super::*;

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

/// A live entry: id (for `retain`) and key (for `load`).
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
