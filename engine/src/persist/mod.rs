//! Sessions ↔ the `ds4-kv` disk tier: save a session as shared pages + one checkpoint, restore the longest cached
//! prefix of a prompt as a new session.
//!
//! How it works (the guide):
//! * A session at position `n` is stored as `⌊n/S⌋` pages (`S = store.span_tokens()`, a multiple of every compress
//!   ratio) holding the compressed KV rows and indexer rows each span appended, plus one checkpoint holding what is
//!   not shareable: the raw sliding windows, the compressor/indexer frontiers, the rows of the partial last span and
//!   the next-token logits. The mapping is in [`rows`].
//! * Restore points: a save also writes a checkpoint at the last page boundary below the saved position (when the
//!   session's roll-back log reaches it, see [`crate::tables::kv`]): the snapshot rolled back there, without
//!   logits, on the pages already written. A later prompt that diverges inside the last page (a re-rendered tail,
//!   an edited message) then restores that boundary and prefills less than a page. Such a checkpoint holds only
//!   the raw windows and frontiers (≈ 3 pages' bytes on Flash, no partial-span rows, no logits); as a leaf on its
//!   pages it is evicted before them (`ds4_kv::policy` keeps interior pages). [`save_marked`] adds restore points
//!   below given positions (e.g. where the last prompt ended and the model's answer began: the next turn re-renders
//!   the answer, so it diverges there, however long the answer was).
//! * Pages are keyed by a chained hash of the token prefix (and the model identity, [`identity`]), so two sessions
//!   with a common prefix produce the same page keys: [`save`] asks the store which pages exist and writes only the
//!   missing ones. Each save writes one new checkpoint (unless the same position was saved before).
//! * [`restore_longest`] asks the store for the longest token-exact prefix that ends at a checkpoint, streams its
//!   pages and checkpoint into a [`crate::tables::SessionSnapshot`] and hands it to [`Engine::restore`]. Pages the
//!   engine's RAM already holds under the same key ([`crate::tables::PageIndex`]) are taken as they are, not read;
//!   saved and restored pages are registered there. The caller then feeds only the suffix. Rows round-trip
//!   losslessly, so the restored session's logits are bit-identical to those of a session that prefilled everything
//!   (tested in `tests/tests/kv_restore.rs`).
//! * "Cached tokens" = the `matched_tokens` returned: tokens whose state came from the store and were not
//!   recomputed.
//!
//! Errors: store errors become [`Error::Session`] with the store's message. A corrupt entry found while restoring is
//! removed by the store; `restore_longest` then looks up again (at most a few times) and never returns a session
//! built from a partial load. Nothing here panics on bad stored data.

pub(crate) mod identity;
pub(crate) mod rows;

use ds4_kv::{EntryRef, KvError, KvOptions, KvStore, SaveReason};

use crate::engine::Engine;
use crate::model::config::ModelConfig;
use crate::tables::{PageIndex, PageLedger, SessionId, SessionSnapshot};
use crate::{Error, Result};

pub use identity::{identity_text, model_identity};

/// What [`save`] stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedInfo {
    /// The session position saved (tokens).
    pub position: usize,
    /// Full pages of the saved prefix.
    pub pages: usize,
    /// Pages that were not in the store before this save (and were written now).
    pub pages_written: usize,
    /// The checkpoint.
    pub checkpoint: EntryRef,
    /// The positions of the restore points written, largest first: the last page boundary below `position` (if
    /// the roll-back log reaches it), then those below the marks of [`save_marked`].
    pub restore_points: Vec<usize>,
}

fn kv_err(e: KvError) -> Error {
    Error::Session(format!("kv store: {e}"))
}

/// Store options fitting the model `cfg`: `span_multiple_of` = the largest compress ratio, `span_tokens` rounded
/// up to a multiple of it.
pub fn kv_options(cfg: &ModelConfig, span_tokens: u32, disk_budget_bytes: u64) -> KvOptions {
    let m = cfg.compress_ratios.iter().copied().max().unwrap_or(1).max(1) as u32;
    let span = span_tokens.max(1).div_ceil(m) * m;
    KvOptions { span_tokens: span, span_multiple_of: m, disk_budget_bytes, ..KvOptions::default() }
}

/// Opens `dir` as the store for `engine`'s model (identity from [`model_identity`]).
pub fn open_store(engine: &Engine, dir: impl Into<std::path::PathBuf>, opts: KvOptions) -> Result<KvStore> {
    KvStore::open(dir, model_identity(engine), opts).map_err(kv_err)
}

fn check_span(cfg: &ModelConfig, store: &KvStore) -> Result<usize> {
    let span = store.span_tokens() as usize;
    if let Some(r) = cfg.compress_ratios.iter().find(|&&r| r > 0 && !span.is_multiple_of(r)) {
        return Err(Error::InvalidArgument(format!("kv span {span} is not a multiple of compress ratio {r}")));
    }
    Ok(span)
}

/// Saves session `id` (at its current position; queued tokens are not part of it) to `store`.
pub fn save(store: &KvStore, engine: &Engine, id: SessionId, reason: SaveReason) -> Result<SavedInfo> {
    save_marked(store, engine, id, reason, &[])
}

/// [`save`], plus a restore point at the last page boundary at or below each of `marks` — positions where the
/// session's next request is likely to diverge from it, such as the end of its last prompt (the next turn of an
/// agent re-renders what the model generated after it: reasoning dropped, tool calls re-serialized). A mark past
/// the position, at the first page, on an existing restore point or beyond the session's roll-back reach is skipped.
pub fn save_marked(
    store: &KvStore,
    engine: &Engine,
    id: SessionId,
    reason: SaveReason,
    marks: &[usize],
) -> Result<SavedInfo> {
    SaveJob::prepare(store, engine, id, reason, marks)?.write(store)
}

/// A save detached from the engine: what [`save_marked`] stores, taken on the engine's thread
/// ([`SaveJob::prepare`]: a snapshot, which shares the session's pages and copies only its tail, plus the restore
/// points rolled back from it) and written on any thread ([`SaveJob::write`]: encoding, writing and syncing the
/// files, the slow part). The session may go on (or be freed) meanwhile: the job's pages are immutable.
pub struct SaveJob {
    cfg: std::sync::Arc<ModelConfig>,
    /// The saved state, then the restore points (largest first).
    snaps: Vec<SessionSnapshot>,
    reason: SaveReason,
}

impl SaveJob {
    /// Takes session `id`'s state and its restore points (see [`save_marked`]) for a later [`SaveJob::write`] to
    /// `store` (read here for its page span only: no I/O).
    pub fn prepare(
        store: &KvStore,
        engine: &Engine,
        id: SessionId,
        reason: SaveReason,
        marks: &[usize],
    ) -> Result<SaveJob> {
        let span = check_span(engine.config(), store)?;
        let snap = engine.snapshot(id)?;
        if snap.pos == 0 {
            return Err(Error::Session("nothing to save: the session has processed no tokens".into()));
        }
        let points = restore_points(engine, &snap, span, marks);
        let mut snaps = vec![snap];
        snaps.extend(points);
        Ok(SaveJob { cfg: std::sync::Arc::new(engine.config().clone()), snaps, reason })
    }

    /// The saved tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.snaps[0].history
    }

    /// Writes the state's missing pages and its checkpoint, then the restore points' checkpoints.
    pub fn write(&self, store: &KvStore) -> Result<SavedInfo> {
        let span = check_span(&self.cfg, store)?;
        let snap = &self.snaps[0];
        let (checkpoint, pages, pages_written) = save_snapshot(store, &self.cfg, snap, span, self.reason)?;
        let mut info = SavedInfo { position: snap.pos, pages, pages_written, checkpoint, restore_points: Vec::new() };
        for rp in &self.snaps[1..] {
            save_snapshot(store, &self.cfg, rp, span, self.reason)?;
            info.restore_points.push(rp.pos);
        }
        tracing::debug!(pos = info.position, pages = info.pages, written = info.pages_written,
            restore_points = ?info.restore_points, reason = ?self.reason, "kv session saved");
        Ok(info)
    }
}

/// The snapshots of `snap`'s restore points: at the last page boundary below its position, then below each mark,
/// while the roll-back log reaches them (largest first: each roll back continues from the previous one).
fn restore_points(engine: &Engine, snap: &SessionSnapshot, span: usize, marks: &[usize]) -> Vec<SessionSnapshot> {
    let mut points: Vec<usize> = std::iter::once((snap.pos - 1) / span * span)
        .chain(marks.iter().filter(|&&m| m < snap.pos).map(|&m| m / span * span))
        .filter(|&at| at > 0)
        .collect();
    points.sort_unstable_by(|a, b| b.cmp(a));
    points.dedup();
    let mut out = Vec::new();
    let mut cur = snap.clone();
    for at in points {
        if engine.rollback_snapshot(&mut cur, at).is_err() {
            break;
        }
        out.push(cur.clone());
    }
    out
}

/// Writes `snap`'s missing pages and its checkpoint: `(checkpoint, full pages, pages written)`. The snapshot's full
/// pages are then registered in their pool's index under their keys ([`crate::tables::PageIndex`]): a snapshot taken
/// from a host session shares that session's pages, so a later restore of this prefix joins them.
fn save_snapshot(
    store: &KvStore,
    cfg: &ModelConfig,
    snap: &SessionSnapshot,
    span: usize,
    reason: SaveReason,
) -> Result<(EntryRef, usize, usize)> {
    let full = snap.pos / span;
    let chain = store.page_chain(&snap.history[..full * span]);
    let mut keys: Vec<ds4_kv::Key> = chain.iter().map(|r| r.key).collect();
    let mut parent = keys.last().copied().unwrap_or(store.root());
    for p in chain.len()..full {
        let spans = rows::page_spans(cfg, snap, p, span);
        let groups = rows::page_groups(&spans);
        parent = store.put_page(&parent, &snap.history[p * span..(p + 1) * span], &groups, reason).map_err(kv_err)?.key;
        keys.push(parent);
    }
    let meta = rows::frontier_meta(snap);
    let tail = rows::tail_spans(cfg, snap, full, span);
    let groups = rows::checkpoint_groups(cfg, snap, &tail, &meta);
    let checkpoint = store.put_checkpoint(&parent, &snap.history[full * span..], &groups, reason).map_err(kv_err)?;
    if let Some(index) = snap.kv.pool.index().filter(|_| PageIndex::aligned(cfg, span)) {
        index.register(&keys, &snap.history, span, &snap.kv);
    }
    Ok((checkpoint, full, full - chain.len()))
}

/// Restores the longest cached prefix of `tokens` as a new session. Returns the session and the tokens it covers
/// (`≤ tokens.len()`; feed `tokens[matched..]` next), or `None` when no checkpointed prefix is stored.
pub fn restore_longest(store: &KvStore, engine: &mut Engine, tokens: &[u32]) -> Result<Option<(SessionId, usize)>> {
    // The store was opened with the model's identity: taking it from there spares hashing the tensors again.
    let layout = KvLayout {
        cfg: std::sync::Arc::new(engine.config().clone()),
        identity: store.identity().clone(),
        pool: engine.page_pool().clone(),
        ctx: engine.ctx(),
    };
    let Some(snap) = load_longest(store, &layout, tokens)? else { return Ok(None) };
    let n = snap.pos;
    let id = engine.restore(snap)?;
    Ok(Some((id, n)))
}

/// What loading a session from a store needs to know of the engine, detached from it (cheap to clone, `Send`):
/// [`load_longest`] runs on any thread with it, and the engine's thread then only installs the result
/// ([`Engine::restore`]).
#[derive(Clone, Debug)]
pub struct KvLayout {
    cfg: std::sync::Arc<ModelConfig>,
    identity: ds4_kv::ModelIdentity,
    pool: PageLedger,
    ctx: usize,
}

impl KvLayout {
    /// `engine`'s model shapes, page pool (restored pages are accounted with the live ones) and context.
    pub fn of(engine: &Engine) -> KvLayout {
        KvLayout {
            cfg: std::sync::Arc::new(engine.config().clone()),
            identity: model_identity(engine),
            pool: engine.page_pool().clone(),
            ctx: engine.ctx(),
        }
    }

    /// The model's shapes.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The engine's page index counters ([`PageIndex::stats`]: spans resident in RAM, spans restores took from
    /// RAM and spans they decoded); zero for a layout without an index.
    pub fn page_stats(&self) -> crate::tables::PageIndexStats {
        self.pool.index().map(PageIndex::stats).unwrap_or_default()
    }

    /// The model's identity (what a store's entries must match).
    pub fn identity(&self) -> &ds4_kv::ModelIdentity {
        &self.identity
    }
}

/// Loads the longest cached prefix of `tokens` from `store` as a snapshot (its `pos` is the tokens it covers; hand
/// it to [`Engine::restore`], then feed `tokens[pos..]`), or `None` when no checkpointed prefix is stored. Reads,
/// checks and decodes the files: the slow part of a restore, done off the engine's thread.
///
/// One page identity over the tiers: a page RAM already holds under the same key (the engine's
/// [`PageIndex`], when the store's span lines up with the live pages) is taken as it is — no read, no decode, no
/// second copy — and only the other pages and the checkpoint are read; what is decoded is registered, so the next
/// restore of this prefix shares it.
pub fn load_longest(store: &KvStore, layout: &KvLayout, tokens: &[u32]) -> Result<Option<SessionSnapshot>> {
    let span = check_span(&layout.cfg, store)?;
    let index = layout.pool.index().filter(|_| PageIndex::aligned(&layout.cfg, span));
    for _attempt in 0..4 {
        let m = store.longest_prefix(tokens);
        let Some(ck) = m.checkpoint else { return Ok(None) };
        if m.matched_tokens == 0 || m.matched_tokens > layout.ctx {
            return Ok(None);
        }
        let mut b = rows::SnapshotBuilder::new_in(&layout.cfg, &layout.pool);
        let mut build_err = None;
        let mut failed = None;
        let mut joined = 0;
        for (p, r) in m.pages.iter().enumerate() {
            let resident = index.and_then(|ix| ix.resident(&r.key, &tokens[p * span..(p + 1) * span]));
            if let Some(pages) = resident {
                b.push_pages(pages)?;
                joined += 1;
                continue;
            }
            if let Err(e) = load_into(store, &r.key, &mut b, &mut build_err) {
                failed = Some(e);
                break;
            }
        }
        if failed.is_none() {
            failed = load_into(store, &ck.key, &mut b, &mut build_err).err();
        }
        match failed {
            None => {}
            Some(KvError::Corrupt(_)) | Some(KvError::Missing(_)) => {
                tracing::warn!("kv entry vanished or was corrupt while restoring; looking up again");
                continue;
            }
            Some(e) => return Err(build_err.unwrap_or_else(|| kv_err(e))),
        }
        tracing::debug!(matched = m.matched_tokens, pages = m.pages.len(), joined, "kv session loaded");
        let snap = b.finish(tokens[..m.matched_tokens].to_vec());
        if let Some(ix) = index {
            let keys: Vec<ds4_kv::Key> = m.pages.iter().map(|r| r.key).collect();
            ix.register(&keys, &snap.history, span, &snap.kv);
            ix.note_restore(joined, m.pages.len() - joined);
        }
        return Ok(Some(snap));
    }
    Ok(None)
}

/// Streams entry `key` into `b`; a block `b` refuses stops the load (its error kept in `build_err`).
fn load_into(
    store: &KvStore,
    key: &ds4_kv::Key,
    b: &mut rows::SnapshotBuilder<'_>,
    build_err: &mut Option<Error>,
) -> std::result::Result<(), KvError> {
    store
        .load(key, |v| {
            b.push(v).map_err(|e| {
                let msg = e.to_string();
                *build_err = Some(e);
                KvError::Aborted(msg)
            })
        })
        .map(|_| ())
}
