//! The disk KV tier of the real engine: a `ds4-kv` store plus the save triggers, used by
//! [`crate::engine::EngineRunner`] through [`crate::model::Runner::disk_restore`] / `disk_event`.
//!
//! How it works:
//! * Lookup order for a new prompt: parked RAM sessions first (the scheduler), then this tier — it is asked only
//!   when it could beat the RAM match. A hit restores the longest token-exact cached prefix that ends at a
//!   checkpoint (`ds4_engine::persist::restore_longest`) as a new session; only the rest of the prompt is prefilled.
//!   "Cached tokens" in the usage are the prompt tokens whose KV state came from RAM or disk instead of prefill.
//! * Save triggers ([`DiskEvent`]): **cold** — a prompt that missed (at least `cold_min_tokens` prefilled) is saved
//!   right after its prefill; **continued** — a session that grew `continued_every` tokens since its last save is
//!   saved when its request ends; **evict** — a parked session dropped from RAM; **shutdown** — every live session
//!   on SIGTERM/SIGINT (after the HTTP drain); **system block** — a prompt whose system prompt + tools block (the
//!   tokens before the first user message, [`crate::model::Codec::system_block_len`]) is at least
//!   `--kv-system-block-min-tokens` long is saved at the last page boundary inside the block
//!   ([`DiskTier::system_block_save_at`]: the scheduler pauses that session's prefill there for one tick), unless
//!   the store or the reused prefix has it already, so another conversation of the same agent restores it. Pages are shared by prefix key, so a save writes only new spans plus
//!   one checkpoint.
//! * Restore points: every save also writes one at the last page boundary below the saved position
//!   (`ds4_engine::persist`), so a prompt that diverges inside the last page restores from there.
//! * Eviction of disk entries is the store's (budget `--kv-disk-space-mb`): pinned and interior pages stay, then the
//!   lowest `(1 + hits + sharers) · recency decay / bytes` goes (see `ds4_kv::policy`).
//! * Faults: an I/O error switches disk caching off inside the store (reads and saves then miss); serving goes on.
//!   A directory that cannot be used at all is reported at ERROR (and the tier is off); one that can be read but not
//!   written (a read-only mount) at WARN, and its entries are still restored (nothing is saved). Every failure is
//!   logged and counted by kind in [`DiskTier::error_counts`] (`ds4_kv_disk_errors_total{kind}`): failed saves and
//!   restores, store write/read errors, corrupt files removed at start, checksum failures while restoring.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use ds4_engine::engine::Engine;
use ds4_engine::persist;
use ds4_engine::tables::SessionId as EngineSession;
use ds4_kv::{KvStore, SavePolicy, SaveReason};

/// The disk tier's default directory: `$XDG_CACHE_HOME/ds4/kv` when that variable is an absolute path (the XDG
/// base directory rule: a relative one is ignored), else `$HOME/.cache/ds4/kv`; `None` when neither is set.
pub fn default_dir() -> Option<PathBuf> {
    dir_from_env(std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

/// [`default_dir`] from the two variables' values.
pub fn dir_from_env(xdg_cache_home: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    let xdg = xdg_cache_home.map(PathBuf::from).filter(|p| p.is_absolute());
    let base = match xdg {
        Some(x) => x,
        None => PathBuf::from(home.filter(|h| !h.is_empty())?).join(".cache"),
    };
    Some(base.join("ds4").join("kv"))
}

/// Largest default disk budget (`--kv-disk-space-mb` sets any).
pub const MAX_DEFAULT_SPACE: u64 = 64 << 30;
/// Smallest default disk budget.
pub const MIN_DEFAULT_SPACE: u64 = 256 << 20;

/// The default disk budget: what the cache holds already plus a quarter of the file system's free space, within
/// [`MIN_DEFAULT_SPACE`]`..=`[`MAX_DEFAULT_SPACE`] (free space unknown: the minimum plus what is held).
pub fn default_space(free: Option<u64>, held: u64) -> u64 {
    let grow = free.map_or(MIN_DEFAULT_SPACE, |f| f / 4);
    held.saturating_add(grow).clamp(MIN_DEFAULT_SPACE, MAX_DEFAULT_SPACE)
}

/// Bytes available to an unprivileged user on the file system that holds `path` (or its nearest existing
/// ancestor, for a directory not created yet).
pub fn free_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path.ancestors().find(|p| p.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` points to writable memory of the right type; statvfs only
    // writes through it, and we read it only when the call succeeded.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled the whole struct.
    let st = unsafe { st.assume_init() };
    // The field types differ between platforms (u32 block counts on macOS).
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Bytes of the regular files under `dir` (recursively; unreadable entries count 0).
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// What happened to a session (the scheduler reports these; the tier decides whether to save).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskEvent {
    /// Its prompt was just prefilled; `cached` of `prompt_len` tokens came from a cache.
    Prefilled { cached: usize, prompt_len: usize },
    /// Its request ended (it is being parked).
    Finished,
    /// Its prefill reached the end of its system + tools block (the position [`DiskTier::system_block_save_at`]
    /// chose).
    SystemBlock,
    /// It is being dropped from RAM.
    Evict,
    /// The server is stopping.
    Shutdown,
}

/// The store, the trigger policy and per-session save positions.
pub struct DiskTier {
    store: std::sync::Arc<KvStore>,
    /// The shared tier on Redis (`--kv-remote`), behind this one.
    remote: Option<crate::kvremote::RemoteTier>,
    policy: SavePolicy,
    /// Position of the last save of each live engine session.
    saved_at: HashMap<EngineSession, usize>,
    save_errors: u64,
    restore_errors: u64,
}

impl DiskTier {
    /// Opens `dir` for `engine`'s model with a budget of `space_bytes`. A directory that cannot be used does not
    /// fail: the tier is then off (logged, counted).
    pub fn open(engine: &Engine, dir: PathBuf, space_bytes: u64) -> Result<DiskTier, String> {
        let opts = persist::kv_options(engine, 256, space_bytes);
        let store = persist::open_store(engine, dir, opts).map_err(|e| e.to_string())?;
        let st = store.status();
        let why = st.last_error.as_deref().unwrap_or("unknown error");
        if !st.enabled {
            tracing::error!(dir = %st.dir.display(), error = why, "--kv-disk-dir cannot be used: disk KV tier off");
        } else if st.read_only {
            tracing::warn!(dir = %st.dir.display(), error = why, files = st.files,
                "--kv-disk-dir is read-only: restoring from its entries, saving nothing");
        } else {
            tracing::info!(dir = %st.dir.display(), files = st.files, bytes = st.bytes, budget = space_bytes,
                span = store.span_tokens(), "KV disk tier ready");
        }
        if st.corrupt_at_open > 0 {
            tracing::warn!(removed = st.corrupt_at_open, "corrupt KV files removed at start");
        }
        Ok(DiskTier::over(store))
    }

    /// A tier over `store`, with no remote tier yet and nothing saved.
    fn over(store: KvStore) -> DiskTier {
        DiskTier {
            store: std::sync::Arc::new(store),
            remote: None,
            policy: SavePolicy::default(),
            saved_at: HashMap::new(),
            save_errors: 0,
            restore_errors: 0,
        }
    }

    /// A local tier without a disk (`--no-kv-disk` with `--kv-remote`): entries live in memory (`memory_bytes`,
    /// least useful evicted first) and are shared through the remote tier.
    pub fn open_memory(engine: &Engine, memory_bytes: u64) -> Result<DiskTier, String> {
        let opts = ds4_kv::KvOptions { host_budget_bytes: memory_bytes.max(1), ..persist::kv_options(engine, 256, 0) };
        let store = KvStore::in_memory(persist::model_identity(engine), opts).map_err(|e| e.to_string())?;
        tracing::info!(budget = memory_bytes, span = store.span_tokens(), "KV memory tier ready (no disk tier)");
        Ok(DiskTier::over(store))
    }

    /// Adds the shared tier on Redis behind this one (see [`crate::kvremote`]).
    pub fn attach_remote(
        &mut self,
        cfg: &crate::kvremote::RemoteConfig,
        stats: std::sync::Arc<crate::kvremote::RemoteStats>,
    ) -> Result<(), String> {
        self.remote = Some(crate::kvremote::RemoteTier::start(cfg, self.store.clone(), stats)?);
        Ok(())
    }

    /// The trigger thresholds.
    pub fn policy(&self) -> SavePolicy {
        self.policy
    }

    /// Overrides the trigger thresholds.
    pub fn set_policy(&mut self, policy: SavePolicy) {
        self.policy = policy;
    }

    /// Failures so far, all kinds.
    pub fn errors(&self) -> u64 {
        self.error_counts().total()
    }

    /// Failures so far by kind.
    pub fn error_counts(&self) -> crate::model::DiskErrors {
        let st = self.store.status();
        crate::model::DiskErrors {
            save: self.save_errors,
            restore: self.restore_errors,
            write: st.write_errors,
            read: st.read_errors,
            corrupt_at_open: st.corrupt_at_open,
            checksum: st.corrupt_on_load,
        }
    }

    /// Bytes of KV files on disk (of entries in memory, for an in-memory tier).
    pub fn disk_bytes(&self) -> u64 {
        let st = self.store.status();
        st.bytes + st.host_bytes
    }

    /// Restores the longest cached prefix of `prompt` when it covers more than `better_than` tokens.
    pub fn restore(
        &mut self,
        engine: &mut Engine,
        prompt: &[u32],
        better_than: usize,
    ) -> Option<(EngineSession, usize)> {
        if !self.store.serves_entries() {
            return None;
        }
        let mut probe = self.store.longest_prefix(prompt);
        let local = if probe.checkpoint.is_some() { probe.matched_tokens } else { 0 };
        if let Some(remote) = &mut self.remote {
            // The shared tier is asked when the local tiers do not hold the whole prompt.
            if local.max(better_than) + 1 < prompt.len()
                && remote.fetch_into(&self.store, prompt, local.max(better_than)).is_some()
            {
                probe = self.store.longest_prefix(prompt);
            }
        }
        if probe.checkpoint.is_none() || probe.matched_tokens <= better_than {
            return None;
        }
        let mut restored = persist::restore_longest(&self.store, engine, prompt);
        if let Ok(Some((sid, n))) = restored {
            if n == prompt.len() && engine.logits(sid).is_err() {
                // A restore point (no logits) covering the whole prompt: take one token less, to feed it.
                let _ = engine.free_session(sid);
                restored = persist::restore_longest(&self.store, engine, &prompt[..prompt.len() - 1]);
            }
        }
        match restored {
            Ok(Some((sid, n))) if n > better_than => {
                self.saved_at.insert(sid, n);
                tracing::debug!(matched = n, "prompt prefix restored from the disk KV tier");
                Some((sid, n))
            }
            Ok(Some((sid, _))) => {
                let _ = engine.free_session(sid);
                None
            }
            Ok(None) => None,
            Err(e) => {
                self.restore_errors += 1;
                tracing::warn!(error = %e, "KV disk restore failed; prefilling instead");
                None
            }
        }
    }

    /// Where a session prefilling `prompt` (with `cached` tokens held) should pause for a [`DiskEvent::SystemBlock`]
    /// save, given a system + tools block of `block` tokens: the policy's page boundary, when it is past `cached`,
    /// inside the prompt, and not stored yet (`None` otherwise, and when saving is off).
    pub fn system_block_save_at(&mut self, prompt: &[u32], block: usize, cached: usize) -> Option<usize> {
        if !self.store.accepts_entries() {
            return None;
        }
        let at = self.policy.system_block_end(block.min(prompt.len()), self.store.span_tokens() as usize)?;
        if at <= cached || at >= prompt.len() {
            return None;
        }
        let probe = self.store.longest_prefix(&prompt[..at]);
        (probe.checkpoint.is_none() || probe.matched_tokens < at).then_some(at)
    }

    /// Applies the save triggers to `event` on `sid`.
    pub fn on_event(&mut self, engine: &Engine, sid: EngineSession, event: DiskEvent) {
        let pos = engine.position(sid).unwrap_or(0);
        let last = self.saved_at.get(&sid).copied();
        let reason = match event {
            DiskEvent::Prefilled { cached, prompt_len } => self.policy.after_prefill(cached, prompt_len),
            DiskEvent::Finished => self.policy.while_running(last.unwrap_or(0), pos),
            DiskEvent::SystemBlock => Some(SaveReason::SystemBlock),
            DiskEvent::Evict => Some(SaveReason::Evict),
            DiskEvent::Shutdown => Some(SaveReason::Shutdown),
        };
        let Some(reason) = reason else { return };
        if matches!(event, DiskEvent::Evict | DiskEvent::Shutdown) {
            self.saved_at.remove(&sid);
        }
        if pos == 0 || last == Some(pos) || !self.store.accepts_entries() {
            return;
        }
        match persist::save(&self.store, engine, sid, reason) {
            Ok(info) => {
                if !matches!(event, DiskEvent::Evict | DiskEvent::Shutdown) {
                    self.saved_at.insert(sid, pos);
                }
                tracing::debug!(pos, pages = info.pages, written = info.pages_written, ?reason, "KV saved to disk");
                if let Some(remote) = &self.remote {
                    remote.queue_write(info.checkpoint.key);
                }
            }
            Err(e) => {
                self.save_errors += 1;
                tracing::warn!(error = %e, ?reason, "KV disk save failed (serving continues)");
            }
        }
    }

    /// Forgets a freed session.
    pub fn forget(&mut self, sid: EngineSession) {
        self.saved_at.remove(&sid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_dir_follows_xdg_then_home() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(dir_from_env(os("/x/cache"), os("/home/u")), Some(PathBuf::from("/x/cache/ds4/kv")));
        // A relative XDG_CACHE_HOME is ignored (XDG base directory rule), an empty one too.
        assert_eq!(dir_from_env(os("rel"), os("/home/u")), Some(PathBuf::from("/home/u/.cache/ds4/kv")));
        assert_eq!(dir_from_env(os(""), os("/home/u")), Some(PathBuf::from("/home/u/.cache/ds4/kv")));
        assert_eq!(dir_from_env(None, os("/home/u")), Some(PathBuf::from("/home/u/.cache/ds4/kv")));
        assert_eq!(dir_from_env(None, None), None);
        assert_eq!(dir_from_env(None, os("")), None);
    }

    #[test]
    fn default_space_is_held_plus_a_quarter_of_free_within_bounds() {
        let gib = 1u64 << 30;
        assert_eq!(default_space(Some(100 * gib), 2 * gib), 27 * gib);
        assert_eq!(default_space(Some(10 << 20), 0), MIN_DEFAULT_SPACE);
        assert_eq!(default_space(Some(10_000 * gib), 0), MAX_DEFAULT_SPACE);
        assert_eq!(default_space(None, gib), gib + MIN_DEFAULT_SPACE);
    }

    #[test]
    fn free_space_of_a_path_not_created_yet_is_its_ancestors() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("a/b/c");
        let free = free_space(&deep).expect("statvfs of the temp dir");
        assert!(free > 0);
        std::fs::create_dir_all(tmp.path().join("a/b")).unwrap();
        std::fs::write(tmp.path().join("a/b/f"), vec![0u8; 1000]).unwrap();
        std::fs::write(tmp.path().join("a/g"), vec![0u8; 24]).unwrap();
        assert_eq!(dir_bytes(tmp.path()), 1024);
    }
}
