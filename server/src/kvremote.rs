//! The shared KV tier on Redis (`--kv-remote redis://HOST:PORT/DB`): several `ds4-server` replicas behind a load
//! balancer share restore points, so a conversation whose next turn lands on another replica restores its prefix
//! instead of prefilling it again. See `docs/scale-out.md`.
//!
//! How it works:
//! * What the local tier ([`crate::kvdisk::DiskTier`]: the disk store, or an in-memory store with `--no-kv-disk`)
//!   saves is also written to Redis, behind it: a save queues the key of its checkpoint on a bounded channel; a
//!   dedicated I/O thread takes the checkpoint's [`ds4_kv::KvStore::lineage`] (its page chain, itself, and the other
//!   restore points on those pages), exports each entry not written yet as its self-validating file image and `SET`s
//!   it. A full queue drops the save (counted, `ds4_kv_remote_dropped_writes_total{reason="queue_full"}`): the
//!   scheduler thread never waits on the socket to write.
//! * Key layout, per model (`{model}` = the hex model identity hash, `{span}` = tokens per page, so two models or
//!   two page sizes never share a key): `ds4:kv:{model}:{span}:p:{key}` a page image, `…:c:{key}` a checkpoint
//!   image, `…:i:{prefix}` a hash from the key of every checkpoint stored after the page chain `{prefix}` (or the
//!   root) to its tail length. Page and checkpoint keys are the local store's chained prefix hashes. Entries are
//!   immutable; Redis's own eviction (`maxmemory` + `allkeys-lru`) bounds the tier.
//! * Lookup, on the tier's I/O worker when the local tiers do not hold the prompt's longest prefix: one pipelined
//!   round trip asks which of the prompt's pages exist and which checkpoints hang on them; the longest token-exact
//!   candidate that beats the local tiers is fetched (second round trip), validated completely by
//!   [`ds4_kv::KvStore::import_entry`] (length, checksums, model identity, key, parent, tokens) and imported into the
//!   local store, which then restores it as usual. Both round trips are bounded by the socket timeout.
//! * Faults: a corrupt or mismatched blob is a miss, counted as `ds4_kv_remote_errors_total{kind="integrity"}`, and
//!   deleted from Redis (it is recomputed and saved again). Redis down, refusing or slow: one WARN line, the tier is
//!   skipped (lookups miss at once, writes are dropped and counted) and the connection is retried every
//!   `retry` seconds; when it works again one INFO line. Serving never depends on Redis.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, Sender, TrySendError};
use ds4_kv::{checkpoint_key, page_key, EntryKind, Key, KvError, KvStore};
use parking_lot::Mutex;

/// With a remote tier, a session is saved at the end of a request once it grew this many tokens since its last save
/// (without one: every 10240), so the next turn finds its state on whichever replica it lands.
pub const REMOTE_CONTINUED_EVERY: usize = 1024;

/// Entries fetched per round trip while importing (≈ 1 MB each on Flash).
const FETCH_BATCH: usize = 32;

/// `--kv-remote` settings.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// `redis://HOST:PORT/DB` (or `redis+unix:///path?db=N`).
    pub url: String,
    /// Bound on connecting and on each socket read or write.
    pub timeout: Duration,
    /// Saves waiting for the I/O thread at most; past it a save is dropped.
    pub queue: usize,
    /// Seconds between reconnection attempts while Redis is unavailable.
    pub retry: Duration,
}

impl RemoteConfig {
    /// Checks the URL (a clear error for bad input; nothing is connected yet).
    pub fn new(url: &str) -> Result<RemoteConfig, String> {
        redis::Client::open(url).map_err(|e| format!("--kv-remote {url:?}: {e}"))?;
        Ok(RemoteConfig {
            url: url.to_string(),
            timeout: Duration::from_millis(2000),
            queue: 64,
            retry: Duration::from_secs(3),
        })
    }
}

/// Counters of the remote tier (`/metrics`).
#[derive(Debug, Default)]
pub struct RemoteStats {
    /// Lookups that imported a restore point from Redis.
    pub hits: AtomicU64,
    /// Tokens those restore points covered.
    pub hit_tokens: AtomicU64,
    /// Lookups that found nothing better than the local tiers (Redis unavailable included).
    pub misses: AtomicU64,
    /// Entries (pages, checkpoints) written to Redis.
    pub writes: AtomicU64,
    /// Their bytes.
    pub write_bytes: AtomicU64,
    /// Saves dropped because the I/O queue was full.
    pub dropped_queue_full: AtomicU64,
    /// Saves dropped because Redis was unavailable.
    pub dropped_unavailable: AtomicU64,
    /// Blobs that failed validation (torn, corrupt, another model's, another entry's).
    pub err_integrity: AtomicU64,
    /// Connection failures (refused, reset, closed).
    pub err_connection: AtomicU64,
    /// Timeouts.
    pub err_timeout: AtomicU64,
    /// Anything else (server errors such as OOM, local store errors while importing).
    pub err_other: AtomicU64,
    /// Whether the last operation reached Redis.
    pub up: AtomicBool,
}

impl RemoteStats {
    /// Errors by `kind` label.
    pub fn errors_by_kind(&self) -> [(&'static str, u64); 4] {
        [
            ("integrity", self.err_integrity.load(Ordering::Relaxed)),
            ("connection", self.err_connection.load(Ordering::Relaxed)),
            ("timeout", self.err_timeout.load(Ordering::Relaxed)),
            ("other", self.err_other.load(Ordering::Relaxed)),
        ]
    }
}

/// Up/down state shared by the lookup side and the I/O thread: one WARN per outage, retries spaced out.
struct Health {
    down: AtomicBool,
    /// Outages so far: a connection opened before the last one began is stale (reopened before use), so the other
    /// side's old socket does not report the same outage again after Redis came back.
    outages: AtomicU64,
    retry_at: Mutex<Instant>,
    retry: Duration,
    url: String,
    stats: Arc<RemoteStats>,
    /// Keys known to be in Redis (not written again). Cleared when Redis comes back (it may have restarted empty).
    written: Mutex<HashSet<Key>>,
}

/// Bound on [`Health::written`] (cleared past it: a key written twice costs bandwidth, nothing else).
const WRITTEN_MAX: usize = 1 << 20;

impl Health {
    /// Whether to try Redis now (up, or down with a retry due).
    fn usable(&self) -> bool {
        !self.down.load(Ordering::Relaxed) || Instant::now() >= *self.retry_at.lock()
    }

    fn failed(&self, e: &redis::RedisError, doing: &str) {
        let s = &self.stats;
        if e.is_timeout() {
            s.err_timeout.fetch_add(1, Ordering::Relaxed);
        } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
            s.err_connection.fetch_add(1, Ordering::Relaxed);
        } else {
            s.err_other.fetch_add(1, Ordering::Relaxed);
        }
        s.up.store(false, Ordering::Relaxed);
        *self.retry_at.lock() = Instant::now() + self.retry;
        if !self.down.swap(true, Ordering::Relaxed) {
            self.outages.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(url = %self.url, error = %e, doing, retry_s = self.retry.as_secs(),
                "Redis KV tier unavailable: serving from the local tiers, retrying in the background");
        } else {
            tracing::debug!(error = %e, doing, "Redis KV tier still unavailable");
        }
    }

    fn ok(&self) {
        self.stats.up.store(true, Ordering::Relaxed);
        if self.down.swap(false, Ordering::Relaxed) {
            self.written.lock().clear();
            tracing::info!(url = %self.url, "Redis KV tier reachable again");
        }
    }

    fn mark_written(&self, key: Key) {
        let mut w = self.written.lock();
        if w.len() >= WRITTEN_MAX {
            w.clear();
        }
        w.insert(key);
    }
}

/// One connection, opened on demand and dropped after an error.
struct Link {
    client: redis::Client,
    conn: Option<redis::Connection>,
    timeout: Duration,
    health: Arc<Health>,
    /// [`Health::outages`] when `conn` was opened.
    epoch: u64,
}

impl Link {
    fn new(client: redis::Client, timeout: Duration, health: Arc<Health>) -> Link {
        Link { client, conn: None, timeout, health, epoch: 0 }
    }

    fn conn(&mut self) -> redis::RedisResult<&mut redis::Connection> {
        let outages = self.health.outages.load(Ordering::Relaxed);
        if self.epoch != outages {
            self.conn = None;
        }
        if self.conn.is_none() {
            self.epoch = outages;
            let c = self.client.get_connection_with_timeout(self.timeout)?;
            c.set_read_timeout(Some(self.timeout))?;
            c.set_write_timeout(Some(self.timeout))?;
            self.conn = Some(c);
        }
        self.conn.as_mut().ok_or_else(|| redis::RedisError::from(std::io::Error::other("no connection")))
    }

    /// Runs `f` on the connection; on error the connection is dropped (reopened next time).
    fn with<T>(&mut self, f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>) -> redis::RedisResult<T> {
        let r = self.conn().and_then(f);
        if r.is_err() {
            self.conn = None;
        }
        r
    }
}

/// Key names in Redis.
#[derive(Clone)]
struct Names {
    ns: String,
}

impl Names {
    fn new(store: &KvStore) -> Names {
        Names { ns: format!("ds4:kv:{}:{}", store.identity().hash().hex(), store.span_tokens()) }
    }
    fn entry(&self, kind: EntryKind, key: &Key) -> String {
        let k = if kind == EntryKind::Page { 'p' } else { 'c' };
        format!("{}:{k}:{}", self.ns, key.hex())
    }
    fn index(&self, prefix: &Key) -> String {
        format!("{}:i:{}", self.ns, prefix.hex())
    }
}

/// The remote tier of one local store.
pub struct RemoteTier {
    names: Names,
    link: Link,
    health: Arc<Health>,
    tx: Option<Sender<Key>>,
    thread: Option<JoinHandle<()>>,
}

impl RemoteTier {
    /// Starts the tier over `store` (its I/O thread exports entries from it). Connects lazily: Redis being down at
    /// start is the same as Redis going down later.
    pub fn start(cfg: &RemoteConfig, store: Arc<KvStore>, stats: Arc<RemoteStats>) -> Result<RemoteTier, String> {
        let client = || redis::Client::open(cfg.url.as_str()).map_err(|e| format!("--kv-remote: {e}"));
        let names = Names::new(&store);
        let health = Arc::new(Health {
            down: AtomicBool::new(false),
            outages: AtomicU64::new(0),
            retry_at: Mutex::new(Instant::now()),
            retry: cfg.retry,
            url: cfg.url.clone(),
            stats,
            written: Mutex::new(HashSet::new()),
        });
        let (tx, rx) = channel::bounded(cfg.queue.max(1));
        let writer = Writer {
            link: Link::new(client()?, cfg.timeout, health.clone()),
            names: names.clone(),
            health: health.clone(),
            store,
        };
        let thread = std::thread::Builder::new()
            .name("ds4-kv-remote".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| format!("starting the Redis KV I/O thread: {e}"))?;
        tracing::info!(url = %cfg.url, namespace = %names.ns, "Redis KV tier on");
        Ok(RemoteTier {
            names,
            link: Link::new(client()?, cfg.timeout, health.clone()),
            health,
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues the restore point `checkpoint` (and what it needs) for writing; never blocks.
    pub fn queue_write(&self, checkpoint: Key) {
        let Some(tx) = &self.tx else { return };
        let s = &self.health.stats;
        match tx.try_send(checkpoint) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                s.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("Redis KV write queue full: save dropped");
            }
            Err(TrySendError::Disconnected(_)) => {
                s.dropped_unavailable.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Looks `prompt` up in Redis and imports into `store` the longest restore point covering more than
    /// `better_than` tokens. Returns the tokens it covers, or `None` (a miss: nothing better, Redis unavailable,
    /// a blob that failed validation).
    pub fn fetch_into(&mut self, store: &KvStore, prompt: &[u32], better_than: usize) -> Option<usize> {
        let stats = self.health.stats.clone();
        if !self.health.usable() {
            stats.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let r = self.fetch(store, prompt, better_than);
        match r {
            Ok(Some(n)) => {
                stats.hits.fetch_add(1, Ordering::Relaxed);
                stats.hit_tokens.fetch_add(n as u64, Ordering::Relaxed);
                tracing::debug!(tokens = n, "prompt prefix imported from the Redis KV tier");
                Some(n)
            }
            Ok(None) => {
                stats.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(e) => {
                self.health.failed(&e, "lookup");
                stats.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    fn fetch(&mut self, store: &KvStore, prompt: &[u32], better_than: usize) -> redis::RedisResult<Option<usize>> {
        let span = store.span_tokens() as usize;
        let full = prompt.len() / span;
        let mut prefixes = Vec::with_capacity(full + 1);
        prefixes.push(store.root());
        for s in prompt.chunks_exact(span) {
            let k = page_key(prefixes.last().unwrap_or(&store.root()), s);
            prefixes.push(k);
        }
        // prefixes[n] = key of the chain of the first n pages (prefixes[0] = the root).
        let local = store.page_chain(prompt).len();
        let n_min = better_than / span;
        if n_min > full {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        for key in &prefixes[local + 1..] {
            pipe.cmd("EXISTS").arg(self.names.entry(EntryKind::Page, key));
        }
        for prefix in &prefixes[n_min..] {
            pipe.cmd("HGETALL").arg(self.names.index(prefix));
        }
        let values: Vec<redis::Value> = self.link.with(|c| pipe.query(c))?;
        self.health.ok();
        let (exists, indexes) = values.split_at(full - local);
        let mut avail = local;
        for v in exists {
            match redis::from_redis_value_ref::<bool>(v) {
                Ok(true) => avail += 1,
                _ => break,
            }
        }
        let mut best: Option<(usize, usize, Key)> = None; // (tokens, pages, checkpoint key)
        for (i, v) in indexes.iter().enumerate() {
            let n = n_min + i;
            if n > avail {
                break;
            }
            let Ok(index) = redis::from_redis_value_ref::<HashMap<String, u64>>(v) else { continue };
            let pos = n * span;
            for (hex, len) in index {
                let (Some(ck), len) = (Key::from_hex(&hex), len as usize) else { continue };
                let end = pos + len;
                if len >= span || end > prompt.len() || end <= better_than || best.is_some_and(|b| b.0 >= end) {
                    continue;
                }
                if checkpoint_key(&prefixes[n], &prompt[pos..end]) == ck {
                    best = Some((end, n, ck));
                }
            }
        }
        let Some((end, n, ck)) = best else { return Ok(None) };
        // The blobs: the pages not held locally, then the checkpoint.
        let mut names: Vec<(EntryKind, Key)> = (local..n).map(|p| (EntryKind::Page, prefixes[p + 1])).collect();
        names.push((EntryKind::Checkpoint, ck));
        // Fetched a batch at a time, so a long prefix is never held twice in memory whole.
        for (b, batch) in names.chunks(FETCH_BATCH).enumerate() {
            let mut pipe = redis::pipe();
            for (kind, key) in batch {
                pipe.cmd("GET").arg(self.names.entry(*kind, key));
            }
            let blobs: Vec<Option<Vec<u8>>> = self.link.with(|c| pipe.query(c))?;
            for (j, ((kind, key), blob)) in batch.iter().zip(blobs).enumerate() {
                let Some(blob) = blob else {
                    tracing::debug!(key = %key, "Redis KV entry evicted during the lookup");
                    return Ok(None);
                };
                let (parent, tokens) = match kind {
                    EntryKind::Page => {
                        let p = local + b * FETCH_BATCH + j;
                        (prefixes[p], &prompt[p * span..(p + 1) * span])
                    }
                    EntryKind::Checkpoint => (prefixes[n], &prompt[n * span..end]),
                };
                match store.import_entry(*kind, &parent, tokens, &blob) {
                    Ok(_) => self.health.mark_written(*key),
                    Err(KvError::Corrupt(why)) => {
                        self.health.stats.err_integrity.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(key = %key, reason = %why,
                            "Redis KV entry failed validation: removed there, prefilling instead");
                        self.health.written.lock().remove(key);
                        let name = self.names.entry(*kind, key);
                        let _ = self.link.with(|c| redis::cmd("DEL").arg(&name).query::<()>(c));
                        return Ok(None);
                    }
                    Err(e) => {
                        self.health.stats.err_other.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(key = %key, error = %e, "could not import a Redis KV entry");
                        return Ok(None);
                    }
                }
            }
        }
        Ok(Some(end))
    }
}

impl crate::kvdisk::SharedTier for RemoteTier {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn fetch_into(&mut self, local: &KvStore, prompt: &[u32], better_than: usize) -> Option<usize> {
        RemoteTier::fetch_into(self, local, prompt, better_than)
    }

    fn publish(&self, checkpoint: Key) {
        self.queue_write(checkpoint);
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        // Closing the channel lets the I/O thread finish what is queued (each write bounded by the timeout).
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The I/O thread: writes queued restore points to Redis.
struct Writer {
    link: Link,
    names: Names,
    health: Arc<Health>,
    store: Arc<KvStore>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Key>) {
        for checkpoint in rx {
            if !self.health.usable() {
                self.health.stats.dropped_unavailable.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Err(e) = self.write(&checkpoint) {
                self.health.failed(&e, "write");
                self.health.stats.dropped_unavailable.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn write(&mut self, checkpoint: &Key) -> redis::RedisResult<()> {
        let lineage = self.store.lineage(checkpoint);
        let mut wrote = false;
        for r in lineage {
            if self.health.written.lock().contains(&r.key) {
                continue;
            }
            let e = match self.store.export_entry(&r.key) {
                Ok(e) => e,
                Err(KvError::Missing(_)) => continue, // evicted locally meanwhile
                Err(err) => {
                    tracing::debug!(key = %r.key, error = %err, "cannot export a KV entry for Redis");
                    self.health.stats.err_other.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let mut pipe = redis::pipe();
            pipe.cmd("SET").arg(self.names.entry(e.kind, &e.key)).arg(&e.image).ignore();
            if e.kind == EntryKind::Checkpoint {
                pipe.cmd("HSET").arg(self.names.index(&e.parent)).arg(e.key.hex()).arg(e.tokens.len()).ignore();
            }
            self.link.with(|c| pipe.query::<()>(c))?;
            wrote = true;
            let s = &self.health.stats;
            s.writes.fetch_add(1, Ordering::Relaxed);
            s.write_bytes.fetch_add(e.image.len() as u64, Ordering::Relaxed);
            self.health.mark_written(e.key);
        }
        if wrote {
            self.health.ok();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_kv::{KvOptions, ModelIdentity, RowBlock, SaveReason};

    fn store() -> Arc<KvStore> {
        let opts = KvOptions { span_tokens: 128, host_budget_bytes: 16 << 20, ..KvOptions::default() };
        Arc::new(KvStore::in_memory(ModelIdentity::new("test model"), opts).unwrap())
    }

    #[test]
    fn bad_urls_are_refused_with_the_flag_named() {
        assert!(RemoteConfig::new("redis://127.0.0.1:6379/0").is_ok());
        for bad in ["http://127.0.0.1/", "not a url", ""] {
            let e = RemoteConfig::new(bad).unwrap_err();
            assert!(e.contains("--kv-remote"), "{e}");
        }
    }

    #[test]
    fn keys_carry_the_model_identity_and_span() {
        let s = store();
        let n = Names::new(&s);
        let k = s.root();
        let model = s.identity().hash().hex();
        assert_eq!(n.entry(EntryKind::Page, &k), format!("ds4:kv:{model}:128:p:{}", k.hex()));
        assert_eq!(n.entry(EntryKind::Checkpoint, &k), format!("ds4:kv:{model}:128:c:{}", k.hex()));
        assert_eq!(n.index(&k), format!("ds4:kv:{model}:128:i:{}", k.hex()));
        let other = KvStore::in_memory(
            ModelIdentity::new("another model"),
            KvOptions { span_tokens: 128, host_budget_bytes: 1 << 20, ..KvOptions::default() },
        )
        .unwrap();
        assert_ne!(Names::new(&other).ns, n.ns);
    }

    #[test]
    fn a_stalled_redis_never_blocks_the_caller_and_full_queues_drop_and_count() {
        // A listener that never answers: the writer's first SET waits for its read timeout.
        let stalled = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("redis://{}/0", stalled.local_addr().unwrap());
        let cfg = RemoteConfig { timeout: Duration::from_millis(300), queue: 1, ..RemoteConfig::new(&url).unwrap() };
        let s = store();
        let values = vec![0.5f32; 64];
        let groups = vec![vec![RowBlock { tag: 0, rows: 1, width: 64, values: &values }]];
        let ck = s.put_checkpoint(&s.root(), &[1, 2, 3], &groups, SaveReason::Cold).unwrap();
        let stats = Arc::new(RemoteStats::default());
        let mut tier = RemoteTier::start(&cfg, s.clone(), stats.clone()).unwrap();
        let t0 = Instant::now();
        for _ in 0..50 {
            tier.queue_write(ck.key);
        }
        assert!(t0.elapsed() < Duration::from_millis(100), "queueing waited on the socket: {:?}", t0.elapsed());
        assert!(stats.dropped_queue_full.load(Ordering::Relaxed) >= 40);
        // A lookup meets the outage the writer found (or times out itself): a miss, never an error to the caller.
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(tier.fetch_into(&s, &[1, 2, 3, 4], 0), None);
        drop(tier);
        assert_eq!(stats.writes.load(Ordering::Relaxed), 0);
        assert!(stats.err_timeout.load(Ordering::Relaxed) >= 1);
        assert!(stats.misses.load(Ordering::Relaxed) >= 1);
        assert!(!stats.up.load(Ordering::Relaxed));
    }
}
