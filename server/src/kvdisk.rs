//! The KV tier store behind the RAM tier: a `ds4-kv` store (on disk, or in memory with `--no-kv-disk` and
//! `--kv-remote`), the shared tier on Redis behind it ([`crate::kvremote`]), the save triggers, and the I/O worker
//! that does their reading and writing. The scheduler owns it (the model trait, [`crate::model::Runner`], only
//! hands out and takes in session state: [`Runner::export`], [`Runner::import`]).
//!
//! How it works:
//! * Lookup order for a new prompt: parked RAM sessions first (the scheduler), then this tier — it is asked only
//!   when it could beat the RAM match ([`DiskTier::could_beat`]: the store's in-memory index, the saves still
//!   queued, or a remote tier to ask). A hit restores the longest token-exact cached prefix that ends at a
//!   checkpoint (`ds4_engine::persist::load_longest`); only the rest of the prompt is prefilled. "Cached tokens"
//!   in the usage are the prompt tokens whose KV state came from RAM or disk instead of prefill.
//! * Off the decode path: a save takes the session's state on the scheduler thread (a snapshot sharing the
//!   session's pages; only its tail is copied) and queues the job; a restore queues the lookup. One I/O worker
//!   ([`ds4_kv::IoWorker`], FIFO) encodes, writes and syncs the files, asks Redis, reads and decodes, and hands a
//!   restored snapshot back over a channel ([`DiskTier::restored`]); the scheduler installs it at the next tick
//!   boundary while the job waits and every other session goes on decoding. FIFO order means a restore queued
//!   after a save finds what that save wrote. The queue is bounded: a save that finds it full is dropped and
//!   counted (`ds4_kv_disk_saves_dropped_total`), except at shutdown, which waits for room, and the scheduler's
//!   shutdown waits until everything queued is written.
//! * Save triggers ([`DiskEvent`]): **cold** — a prompt that missed (at least `cold_min_tokens` prefilled) is saved
//!   right after its prefill; **continued** — a session that grew `continued_every` tokens since its last save is
//!   saved when its request ends; **evict** — a parked session dropped from RAM; **shutdown** — every live session
//!   on SIGTERM/SIGINT (after the HTTP drain); **system block** — a prompt whose system prompt + tools block (the
//!   tokens before the first user message, [`crate::model::Codec::system_block_len`]) is at least
//!   `--kv-system-block-min-tokens` long is saved at the last page boundary inside the block
//!   ([`DiskTier::system_block_save_at`]: the scheduler pauses that session's prefill there for one tick), unless
//!   the store or the reused prefix has it already, so another conversation of the same agent restores it. Pages
//!   are shared by prefix key, so a save writes only new spans plus one checkpoint.
//! * Restore points: every save also writes one at the last page boundary below the saved position
//!   (`ds4_engine::persist`), so a prompt that diverges inside the last page restores from there.
//! * Eviction of disk entries is the store's (budget `--kv-disk-space-mb`, on the I/O worker as part of a save):
//!   pinned and interior pages stay, then the lowest `(1 + hits + sharers) · recency decay / bytes` goes (see
//!   `ds4_kv::policy`).
//! * Faults: an I/O error switches disk caching off inside the store (reads and saves then miss); serving goes on.
//!   A directory that cannot be used at all is reported at ERROR (and the tier is off); one that can be read but not
//!   written (a read-only mount) at WARN, and its entries are still restored (nothing is saved). Every failure is
//!   logged and counted by kind in [`TierStats::error_counts`] (`ds4_kv_disk_errors_total{kind}`): failed saves and
//!   restores, store write/read errors, corrupt files removed at start, checksum failures while restoring.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam::channel::{Receiver, Sender};
use ds4_engine::persist::{self, KvLayout};
use ds4_engine::tables::SessionSnapshot;
use ds4_kv::{IoWorker, KvStore, SavePolicy, SaveReason};
use parking_lot::Mutex;

use crate::model::{Runner, RunnerSessionId};

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

/// Disk KV tier failures by kind (`ds4_kv_disk_errors_total{kind}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskErrors {
    /// Saves that failed.
    pub save: u64,
    /// Restores that failed (the prompt was prefilled instead).
    pub restore: u64,
    /// Store write I/O errors (each switches disk caching off).
    pub write: u64,
    /// Store read I/O errors that were not corruption.
    pub read: u64,
    /// Corrupt, inconsistent or orphaned files removed when the cache was opened.
    pub corrupt_at_open: u64,
    /// Entries that failed their checksum or format check while being restored (removed).
    pub checksum: u64,
}

impl DiskErrors {
    /// The `kind` label of each count.
    pub fn by_kind(&self) -> [(&'static str, u64); 6] {
        [
            ("save", self.save),
            ("restore", self.restore),
            ("write", self.write),
            ("read", self.read),
            ("corrupt_at_open", self.corrupt_at_open),
            ("checksum", self.checksum),
        ]
    }

    pub fn total(&self) -> u64 {
        self.by_kind().iter().map(|(_, n)| n).sum()
    }
}

/// The tier's counters, read live (see [`DiskTier::stats`]).
#[derive(Clone)]
pub struct TierStats {
    store: Arc<KvStore>,
    layout: KvLayout,
    counts: Arc<Counts>,
    pending: ds4_kv::IoPending,
}

impl TierStats {
    /// Failures so far by kind.
    pub fn error_counts(&self) -> DiskErrors {
        let st = self.store.status();
        DiskErrors {
            save: self.counts.save_errors.load(Ordering::Relaxed),
            restore: self.counts.restore_errors.load(Ordering::Relaxed),
            write: st.write_errors,
            read: st.read_errors,
            corrupt_at_open: st.corrupt_at_open,
            checksum: st.corrupt_on_load,
        }
    }

    /// Saves dropped because the I/O queue was full.
    pub fn saves_dropped(&self) -> u64 {
        self.counts.dropped.load(Ordering::Relaxed)
    }

    /// The page index: spans resident in RAM under their store keys, spans restores took from RAM (no read, no
    /// decode) and spans they read and decoded.
    pub fn pages(&self) -> ds4_engine::tables::PageIndexStats {
        self.layout.page_stats()
    }

    /// Tier I/O jobs queued or running.
    pub fn io_pending(&self) -> usize {
        self.pending.get()
    }

    /// Bytes of KV files on disk (of entries in memory, for an in-memory tier).
    pub fn disk_bytes(&self) -> u64 {
        let st = self.store.status();
        st.bytes + st.host_bytes
    }
}

/// A KV tier that several servers share, behind the local store (`--kv-remote`: [`crate::kvremote::RemoteTier`]
/// on Redis). The local store stays the one every restore reads from: a shared tier imports what it finds into it.
/// Both methods run on the tier store's I/O worker, never on the scheduler thread.
pub trait SharedTier: Send {
    /// A short name for logs.
    fn name(&self) -> &'static str;
    /// Imports into `local` the longest restore point of `prompt` that covers more than `better_than` tokens, with
    /// what it builds on; the tokens it covers, or `None` (a miss: nothing better, the tier unavailable, an entry
    /// that failed validation).
    fn fetch_into(&mut self, local: &KvStore, prompt: &[u32], better_than: usize) -> Option<usize>;
    /// Shares the local restore point `checkpoint` (and the pages it builds on); never blocks on the tier.
    fn publish(&self, checkpoint: ds4_kv::Key);
}

/// A restore's result, handed back by the I/O worker ([`DiskTier::restored`]).
pub struct Restored {
    /// The ticket given to [`DiskTier::start_restore`].
    pub ticket: u64,
    /// The longest cached prefix that beat the RAM tier, as a snapshot for [`crate::model::Runner::import`]
    /// (`None`: a miss).
    pub snapshot: Option<SessionSnapshot>,
}

/// Counters the I/O worker updates.
#[derive(Default)]
struct Counts {
    save_errors: AtomicU64,
    restore_errors: AtomicU64,
    dropped: AtomicU64,
}

/// Waiting jobs the I/O worker holds at most (saves beyond it are dropped and counted).
pub const IO_QUEUE: usize = 16;

/// The store, the trigger policy, per-session save positions and the I/O worker. See the module docs.
pub struct DiskTier {
    // Declared first so it is dropped first: its queued jobs (which use the remote tier) run before the rest goes.
    io: IoWorker,
    store: Arc<KvStore>,
    layout: KvLayout,
    /// The shared tier behind this one (`--kv-remote`: Redis), used on the I/O worker only.
    remote: Option<Arc<Mutex<Box<dyn SharedTier>>>>,
    policy: SavePolicy,
    /// Position of the last save of each live session.
    saved_at: HashMap<RunnerSessionId, usize>,
    counts: Arc<Counts>,
    /// Tokens of each save queued and not written yet, by job number (a lookup counts them).
    in_flight: Arc<Mutex<HashMap<u64, Arc<[u32]>>>>,
    next_job: u64,
    done_tx: Sender<Restored>,
    done_rx: Receiver<Restored>,
    /// Tests: restores wait until this gate opens (holds the I/O worker as a slow disk would).
    #[cfg(test)]
    pub(crate) hold: Option<Arc<(Mutex<bool>, parking_lot::Condvar)>>,
}

impl DiskTier {
    /// Opens `dir` for the model of `layout` with a budget of `space_bytes`. A directory that cannot be used does
    /// not fail: the tier is then off (logged, counted).
    pub fn open(layout: KvLayout, dir: PathBuf, space_bytes: u64) -> Result<DiskTier, String> {
        let opts = persist::kv_options(layout.config(), 256, space_bytes);
        let store = KvStore::open(dir, layout.identity().clone(), opts).map_err(|e| e.to_string())?;
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
        DiskTier::over(store, layout)
    }

    /// A tier over `store`, with no remote tier yet and nothing saved.
    fn over(store: KvStore, layout: KvLayout) -> Result<DiskTier, String> {
        let io = IoWorker::start("ds4-kv-io", IO_QUEUE).map_err(|e| format!("starting the KV I/O thread: {e}"))?;
        let (done_tx, done_rx) = crossbeam::channel::unbounded();
        Ok(DiskTier {
            io,
            store: Arc::new(store),
            layout,
            remote: None,
            policy: SavePolicy::default(),
            saved_at: HashMap::new(),
            counts: Arc::default(),
            in_flight: Arc::default(),
            next_job: 0,
            done_tx,
            done_rx,
            #[cfg(test)]
            hold: None,
        })
    }

    /// A local tier without a disk (`--no-kv-disk` with `--kv-remote`): entries live in memory (`memory_bytes`,
    /// least useful evicted first) and are shared through the remote tier.
    pub fn open_memory(layout: KvLayout, memory_bytes: u64) -> Result<DiskTier, String> {
        let opts = ds4_kv::KvOptions {
            host_budget_bytes: memory_bytes.max(1),
            ..persist::kv_options(layout.config(), 256, 0)
        };
        let store = KvStore::in_memory(layout.identity().clone(), opts).map_err(|e| e.to_string())?;
        tracing::info!(budget = memory_bytes, span = store.span_tokens(), "KV memory tier ready (no disk tier)");
        DiskTier::over(store, layout)
    }

    /// Adds the shared tier on Redis behind this one (see [`crate::kvremote`]).
    pub fn attach_remote(
        &mut self,
        cfg: &crate::kvremote::RemoteConfig,
        stats: Arc<crate::kvremote::RemoteStats>,
    ) -> Result<(), String> {
        let remote = crate::kvremote::RemoteTier::start(cfg, self.store.clone(), stats)?;
        self.attach_shared(Box::new(remote));
        Ok(())
    }

    /// Puts `tier` behind the local store (replacing any): restores ask it on a local miss, saves are published
    /// to it. It is called on the I/O worker only.
    pub fn attach_shared(&mut self, tier: Box<dyn SharedTier>) {
        tracing::debug!(tier = tier.name(), "shared KV tier attached");
        self.remote = Some(Arc::new(Mutex::new(tier)));
    }

    /// Overrides the trigger thresholds.
    pub fn set_policy(&mut self, policy: SavePolicy) {
        self.policy = policy;
    }

    /// Failures so far, all kinds.
    pub fn errors(&self) -> u64 {
        self.stats().error_counts().total()
    }

    /// A live view of the tier's counters for `/metrics` (read when rendered: the I/O worker updates them between
    /// the scheduler's ticks).
    pub fn stats(&self) -> TierStats {
        TierStats {
            store: self.store.clone(),
            layout: self.layout.clone(),
            counts: self.counts.clone(),
            pending: self.io.pending_handle(),
        }
    }

    /// Waits until every queued save and restore has run.
    pub fn flush(&self) {
        self.io.flush();
    }

    /// Whether a restore of `prompt` could cover more than `better_than` tokens: the store's index has such a
    /// prefix, a queued save does, or a remote tier may (it is asked when the local tiers do not hold the whole
    /// prompt). Reads only in-memory state.
    pub fn could_beat(&self, prompt: &[u32], better_than: usize) -> bool {
        if !self.store.serves_entries() || prompt.len() <= better_than + 1 {
            return false;
        }
        let probe = self.store.longest_prefix(prompt);
        let local = if probe.checkpoint.is_some() { probe.matched_tokens } else { 0 };
        if local > better_than {
            return true;
        }
        let span = self.store.span_tokens() as usize;
        let queued = self.in_flight.lock().values().any(|t| common_prefix(t, prompt) >= (better_than + 1).max(span));
        queued || (self.remote.is_some() && local.max(better_than) + 1 < prompt.len())
    }

    /// Queues the restore of the longest cached prefix of `prompt` that covers more than `better_than` tokens; its
    /// result arrives on [`DiskTier::restored`] with `ticket`. `false` (nothing queued) when the I/O queue is full.
    pub fn start_restore(&mut self, ticket: u64, prompt: Vec<u32>, better_than: usize) -> bool {
        let (store, layout, remote) = (self.store.clone(), self.layout.clone(), self.remote.clone());
        let (counts, done) = (self.counts.clone(), self.done_tx.clone());
        #[cfg(test)]
        let hold = self.hold.clone();
        let job = move || {
            #[cfg(test)]
            if let Some(g) = hold {
                let mut open = g.0.lock();
                while !*open {
                    g.1.wait(&mut open);
                }
            }
            let snapshot = restore_job(&store, &layout, remote.as_deref(), &prompt, better_than, &counts);
            let _ = done.send(Restored { ticket, snapshot });
        };
        self.io.try_submit(Box::new(job)).is_ok()
    }

    /// Where restores' results arrive (the scheduler waits on it beside its requests).
    pub fn restored(&self) -> &Receiver<Restored> {
        &self.done_rx
    }

    /// Records that `session` was restored holding `tokens` tokens (no save is due before it grows).
    pub fn note_restored(&mut self, session: RunnerSessionId, tokens: usize) {
        self.saved_at.insert(session, tokens);
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

    /// Applies the save triggers to `event` on `session`: a save due takes the session's state now and is written
    /// by the I/O worker.
    pub fn on_event(&mut self, runner: &mut dyn Runner, session: RunnerSessionId, event: DiskEvent) {
        let pos = runner.position(session).unwrap_or(0);
        let last = self.saved_at.get(&session).copied();
        let reason = match event {
            DiskEvent::Prefilled { cached, prompt_len } => self.policy.after_prefill(cached, prompt_len),
            DiskEvent::Finished => self.policy.while_running(last.unwrap_or(0), pos),
            DiskEvent::SystemBlock => Some(SaveReason::SystemBlock),
            DiskEvent::Evict => Some(SaveReason::Evict),
            DiskEvent::Shutdown => Some(SaveReason::Shutdown),
        };
        let Some(reason) = reason else { return };
        let leaving = matches!(event, DiskEvent::Evict | DiskEvent::Shutdown);
        if leaving {
            self.saved_at.remove(&session);
        }
        if pos == 0 || last == Some(pos) || !self.store.accepts_entries() {
            return;
        }
        let job = match runner.export(session, &self.store, reason) {
            Ok(j) => j,
            Err(e) => {
                self.counts.save_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, ?reason, "KV save failed (serving continues)");
                return;
            }
        };
        if !leaving {
            self.saved_at.insert(session, pos);
        }
        self.next_job += 1;
        let id = self.next_job;
        self.in_flight.lock().insert(id, job.tokens().into());
        let (store, remote, counts, in_flight) =
            (self.store.clone(), self.remote.clone(), self.counts.clone(), self.in_flight.clone());
        let write = move || {
            match job.write(&store) {
                Ok(info) => {
                    tracing::debug!(
                        pos = info.position,
                        pages = info.pages,
                        written = info.pages_written,
                        ?reason,
                        "KV saved to disk"
                    );
                    if let Some(remote) = &remote {
                        remote.lock().publish(info.checkpoint.key);
                    }
                }
                Err(e) => {
                    counts.save_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, ?reason, "KV disk save failed (serving continues)");
                }
            }
            in_flight.lock().remove(&id);
        };
        let queued = if event == DiskEvent::Shutdown {
            self.io.submit(Box::new(write))
        } else {
            self.io.try_submit(Box::new(write)).is_ok()
        };
        if !queued {
            self.in_flight.lock().remove(&id);
            self.saved_at.remove(&session);
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(pos, ?reason, "KV I/O queue full: save dropped");
        }
    }

    /// Forgets a freed session.
    pub fn forget(&mut self, session: RunnerSessionId) {
        self.saved_at.remove(&session);
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The I/O worker's side of a restore: the remote tier when the local one does not hold the whole prompt, then the
/// longest local prefix covering more than `better_than` tokens. A restore point (no logits) that covers the whole
/// prompt is traded for the longest prefix one token shorter, so the job has a token to feed for its logits.
fn restore_job(
    store: &KvStore,
    layout: &KvLayout,
    remote: Option<&Mutex<Box<dyn SharedTier>>>,
    prompt: &[u32],
    better_than: usize,
    counts: &Counts,
) -> Option<SessionSnapshot> {
    let probe = store.longest_prefix(prompt);
    let local = if probe.checkpoint.is_some() { probe.matched_tokens } else { 0 };
    if let Some(remote) = remote {
        if local.max(better_than) + 1 < prompt.len() {
            remote.lock().fetch_into(store, prompt, local.max(better_than));
        }
    }
    let mut loaded = persist::load_longest(store, layout, prompt);
    if let Ok(Some(snap)) = &loaded {
        if snap.pos == prompt.len() && snap.logits.is_empty() {
            loaded = persist::load_longest(store, layout, &prompt[..prompt.len() - 1]);
        }
    }
    match loaded {
        Ok(Some(snap)) if snap.pos > better_than => {
            tracing::debug!(matched = snap.pos, "prompt prefix loaded from the KV tier");
            Some(snap)
        }
        Ok(_) => None,
        Err(e) => {
            counts.restore_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "KV restore failed; prefilling instead");
            None
        }
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

    /// A shared tier over another store (what a second replica would hold), copying entries with their lineage.
    struct StoreTier {
        local: Arc<KvStore>,
        shared: Arc<KvStore>,
        published: Arc<Mutex<Vec<ds4_kv::Key>>>,
        fetches: Arc<AtomicU64>,
    }

    fn copy(from: &KvStore, to: &KvStore, entries: &[ds4_kv::EntryRef]) {
        for r in entries {
            let e = from.export_entry(&r.key).unwrap();
            to.import_entry(e.kind, &e.parent, &e.tokens, &e.image).unwrap();
        }
    }

    impl SharedTier for StoreTier {
        fn name(&self) -> &'static str {
            "test-store"
        }

        fn fetch_into(&mut self, local: &KvStore, prompt: &[u32], better_than: usize) -> Option<usize> {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            let m = self.shared.longest_prefix(prompt);
            let ck = m.checkpoint.filter(|_| m.matched_tokens > better_than)?;
            let entries: Vec<_> = m.pages.iter().cloned().chain(std::iter::once(ck)).collect();
            copy(&self.shared, local, &entries);
            Some(m.matched_tokens)
        }

        fn publish(&self, checkpoint: ds4_kv::Key) {
            self.published.lock().push(checkpoint);
            copy(&self.local, &self.shared, &self.local.lineage(&checkpoint));
        }
    }

    /// The seam behind the local store: a restore that misses locally imports from the shared tier on the I/O
    /// worker, and a save is published to it.
    #[test]
    fn a_shared_tier_serves_local_misses_and_receives_saves() {
        use crate::model::Runner;
        let opts = crate::engine::LoadOptions {
            placement: Default::default(),
            backend: ds4_engine::engine::BackendKind::Cpu,
            ctx: 2048,
            max_batch_tokens: 256,
            max_sessions: 8,
            active_sessions: 2,
            demo_seed: None,
        };
        let (mut runner, _, _) = crate::engine::load(None, &opts).unwrap();
        let prompt: Vec<u32> = (0..900u32).map(|i| 10 + (i * 7919) % 250).collect();
        let run = |runner: &mut crate::engine::EngineRunner, s, tokens: &[u32]| {
            runner.feed(s, tokens).unwrap();
            while runner.pending(s) > 0 {
                runner.step().unwrap();
            }
        };
        let s = runner.create_session().unwrap();
        run(&mut runner, s, &prompt[..600]);
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let layout = runner.kv_layout().unwrap();
        let mut tier = DiskTier::open(layout.clone(), a.path().to_path_buf(), 1 << 30).unwrap();
        let opts = persist::kv_options(layout.config(), 256, 1 << 30);
        let shared = Arc::new(KvStore::open(b.path(), layout.identity().clone(), opts).unwrap());
        runner.export(s, &shared, SaveReason::Cold).unwrap().write(&shared).unwrap();
        let (published, fetches) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicU64::new(0)));
        tier.attach_shared(Box::new(StoreTier {
            local: tier.store.clone(),
            shared: shared.clone(),
            published: published.clone(),
            fetches: fetches.clone(),
        }));
        // A local miss: the shared tier is asked on the worker and its entries restored.
        assert!(tier.store.longest_prefix(&prompt[..700]).checkpoint.is_none());
        assert!(tier.could_beat(&prompt[..700], 0));
        assert!(tier.start_restore(7, prompt[..700].to_vec(), 0));
        let r = tier.restored().recv_timeout(std::time::Duration::from_secs(60)).unwrap();
        assert_eq!(r.ticket, 7);
        assert_eq!(r.snapshot.map(|s| s.pos), Some(600));
        assert_eq!(fetches.load(Ordering::Relaxed), 1);
        // A save is written locally by the worker and published to the shared tier.
        run(&mut runner, s, &prompt[600..900]);
        tier.on_event(&mut runner, s, DiskEvent::Evict);
        tier.flush();
        assert_eq!(published.lock().len(), 1);
        assert_eq!(tier.store.longest_prefix(&prompt).matched_tokens, 900);
        assert_eq!(shared.longest_prefix(&prompt).matched_tokens, 900);
        assert_eq!(tier.errors(), 0);
    }

    /// A busy I/O worker never makes the scheduler wait: saves beyond the queue are dropped and counted, the ones
    /// queued are written once it is free, and a restore's result comes back with its ticket.
    #[test]
    fn saves_beyond_a_full_io_queue_are_dropped_and_counted() {
        use crate::model::Runner;
        let opts = crate::engine::LoadOptions {
            placement: Default::default(),
            backend: ds4_engine::engine::BackendKind::Cpu,
            ctx: 1024,
            max_batch_tokens: 256,
            max_sessions: 40,
            active_sessions: 2,
            demo_seed: None,
        };
        let (mut runner, _, _) = crate::engine::load(None, &opts).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut tier = DiskTier::open(runner.kv_layout().unwrap(), dir.path().to_path_buf(), 1 << 30).unwrap();
        let gate = Arc::new((Mutex::new(false), parking_lot::Condvar::new()));
        tier.hold = Some(gate.clone());
        // A held restore occupies the worker (a miss: the store is empty).
        assert!(tier.start_restore(1, vec![5; 40], 0));
        let n = IO_QUEUE + 6;
        let t0 = std::time::Instant::now();
        for i in 0..n {
            let s = runner.create_session().unwrap();
            let tokens: Vec<u32> = (0..20u32).map(|j| 10 + (j * 31 + i as u32 * 7) % 250).collect();
            runner.feed(s, &tokens).unwrap();
            while runner.pending(s) > 0 {
                runner.step().unwrap();
            }
            tier.on_event(&mut runner, s, DiskEvent::Evict);
        }
        // Queuing never waited on the held worker.
        assert!(t0.elapsed().as_secs() < 30);
        let dropped = tier.stats().saves_dropped();
        assert!(dropped >= (n - IO_QUEUE) as u64, "{dropped} of {n} saves dropped with a queue of {IO_QUEUE}");
        assert_eq!(tier.stats().io_pending() as u64, 1 + n as u64 - dropped);
        *gate.0.lock() = true;
        gate.1.notify_all();
        tier.flush();
        let r = tier.restored().try_recv().unwrap();
        assert_eq!((r.ticket, r.snapshot.is_none()), (1, true));
        let written = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "ckpt"));
        assert_eq!(written.count() as u64, n as u64 - dropped);
        assert_eq!(tier.errors(), 0);
    }
}
