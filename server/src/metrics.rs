//! Prometheus text-format metrics, hand-rolled over atomics (no global registry: one [`Metrics`] per server, shared
//! by `Arc`, so in-process tests do not see each other's counts).
//!
//! Names (all prefixed `ds4_`): `requests_total{endpoint,status}`, `prompt_tokens_total`, `completion_tokens_total`,
//! `time_to_first_token_seconds` and `inter_token_latency_seconds` (histograms), `queue_depth`, `active_sessions`,
//! `parked_sessions`, `kv_bytes{tier}`, `prefix_cache_hit_tokens_total{tier}` (prompt tokens reused),
//! `prefix_cache_hits_total{tier}` (requests that reused any), `prefix_cache_recomputed_tokens_total` (prompt tokens
//! prefilled), `kv_disk_errors_total{kind}`, `kv_disk_saves_dropped_total` (saves dropped on a full tier I/O queue),
//! `kv_io_pending` (tier I/O jobs queued or running), `kv_restoring` (requests waiting for a restore),
//! `kv_pages_resident` (page spans in RAM under their store keys), `kv_restored_pages_total{from}` (spans restores
//! took from RAM by key vs read and decoded from the store), `kv_fork_bytes_copied_total` (KV bytes copied by session forks and
//! copy on write of shared pages; fork shares pages by reference),
//! `generations_cancelled_total` (generations stopped because their client went away), `keepalives_total` (SSE
//! keep-alive frames sent), `connections_open`, `connections_closed_total{reason}` (closed by the server:
//! timeouts, the connection cap), the structured-output set of [`StructuredMetrics`], and the speculative-decoding
//! set of [`SpecMetrics`].

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::recent::Recent;

const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const MASK_BUCKETS: &[f64] = &[0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1];
const COMPILE_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// Speculative-decoding metrics (`--speculative`): `ds4_spec_cycles_total` (verify runs: a chosen token and its
/// draft checked in one tick), `ds4_spec_draft_tokens_total` (drafted tokens verified), `ds4_spec_accepted_tokens_total`
/// (drafted tokens that stood), `ds4_spec_draft_seconds_total` (time the drafter took, on the scheduler thread),
/// `ds4_spec_verify_seconds_total` (time of the model ticks that verified drafts), `ds4_spec_paused_total` (sessions
/// `auto` stopped speculating for, their acceptance below what pays). Acceptance rate = accepted / draft tokens; mean
/// accepted length = (accepted + cycles) / cycles tokens per verify run.
#[derive(Default)]
pub struct SpecMetrics {
    pub cycles: AtomicU64,
    pub draft_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    pub draft_micros: AtomicU64,
    pub verify_micros: AtomicU64,
    pub paused: AtomicU64,
}

/// Structured-output metrics: `ds4_structured_requests_total` (constrained generations), `ds4_grammar_compile_seconds`,
/// `ds4_grammar_mask_seconds` (computing one token's mask, on the worker that runs beside the model step),
/// `ds4_grammar_mask_wait_seconds` (how long sampling waited for a mask after the step: the part on the critical
/// path), `ds4_grammar_masked_tokens_total` and `ds4_grammar_errors_total` (a constrained generation failed).
pub struct StructuredMetrics {
    pub requests: AtomicU64,
    pub compile: Histogram,
    pub mask: Histogram,
    pub mask_wait: Histogram,
    pub masked_tokens: AtomicU64,
    pub errors: AtomicU64,
}

impl Default for StructuredMetrics {
    fn default() -> Self {
        StructuredMetrics {
            requests: AtomicU64::new(0),
            compile: Histogram::new(COMPILE_BUCKETS),
            mask: Histogram::new(MASK_BUCKETS),
            mask_wait: Histogram::new(MASK_BUCKETS),
            masked_tokens: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        }
    }
}

impl StructuredMetrics {
    /// A grammar was compiled for a request in `d`.
    pub fn compiled(&self, d: Duration) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.compile.observe(d);
    }

    fn render(&self, out: &mut String) {
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        counter(out, "ds4_structured_requests_total", "Generations constrained by a grammar.", load(&self.requests));
        counter(
            out,
            "ds4_grammar_masked_tokens_total",
            "Tokens sampled under a grammar mask.",
            load(&self.masked_tokens),
        );
        counter(
            out,
            "ds4_grammar_errors_total",
            "Constrained generations that failed in the grammar.",
            load(&self.errors),
        );
        self.compile.render("ds4_grammar_compile_seconds", "Compiling a request's grammar.", out);
        self.mask.render("ds4_grammar_mask_seconds", "Computing one token's mask (beside the model step).", out);
        self.mask_wait.render(
            "ds4_grammar_mask_wait_seconds",
            "Sampling's wait for a mask after the model step (the mask cost on the critical path).",
            out,
        );
    }
}

const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// A fixed-bucket histogram.
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)) }
    }

    pub fn observe(&self, d: Duration) {
        let v = d.as_secs_f64();
        let mut g = self.inner.lock();
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                g.0[i] += 1;
            }
        }
        g.1 += v;
        g.2 += 1;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let g = self.inner.lock();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in self.bounds.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", g.0[i]);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", g.2, g.1, g.2);
    }
}

/// Storage tiers reported for KV bytes and prefix-cache hits.
#[derive(Debug, Clone, Copy)]
pub enum CacheTier {
    Device = 0,
    Host = 1,
    Disk = 2,
}

/// Tier names, in [`CacheTier`] order.
pub const TIERS: [&str; 3] = ["device", "host", "disk"];

impl CacheTier {
    /// Every tier, in order.
    pub const ALL: [CacheTier; 3] = [CacheTier::Device, CacheTier::Host, CacheTier::Disk];

    /// The tier's label (`device`, `host`, `disk`).
    pub fn name(self) -> &'static str {
        TIERS[self as usize]
    }
}

/// Why the server closed a connection (`ds4_connections_closed_total{reason}`).
#[derive(Debug, Clone, Copy)]
pub enum CloseReason {
    /// No request in progress for `--idle-timeout-s`.
    IdleTimeout = 0,
    /// A request head not complete `--header-timeout-s` after its first byte.
    HeaderTimeout = 1,
    /// Closed to make room at `--max-connections`.
    Evicted = 2,
    /// Refused at `--max-connections` with every connection busy.
    Rejected = 3,
    /// The request body did not arrive within `--body-timeout-s`.
    BodyTimeout = 4,
}

const CLOSE_REASONS: [&str; 5] = ["idle_timeout", "header_timeout", "evicted", "rejected", "body_timeout"];

/// All server metrics.
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub queue_depth: AtomicU64,
    pub active_sessions: AtomicU64,
    pub parked_sessions: AtomicU64,
    /// The KV tiers' live counters (disk errors, dropped saves, pending I/O, disk bytes), when a tier is on.
    pub kv_tier: std::sync::OnceLock<crate::kvdisk::TierStats>,
    /// Requests waiting for a restore from the KV tiers.
    pub kv_restoring: AtomicU64,
    /// Generations stopped because their client went away.
    pub cancelled: AtomicU64,
    /// SSE keep-alive frames sent.
    pub keepalives: AtomicU64,
    kv_bytes: [AtomicU64; 3],
    /// KV bytes copied by forks and copy on write (the engine's running total).
    kv_fork_bytes_copied: AtomicU64,
    prefix_hits: [AtomicU64; 3],
    prefix_hit_requests: [AtomicU64; 3],
    recomputed_tokens: AtomicU64,
    /// Open HTTP connections.
    pub connections_open: AtomicU64,
    closed: [AtomicU64; 5],
    /// Recent requests and the throughput window, for the status view (not exported to Prometheus).
    pub recent: Recent,
    /// Structured outputs (grammar compiles, per-token mask cost).
    pub structured: StructuredMetrics,
    /// Speculative decoding.
    pub spec: SpecMetrics,
    /// The Redis KV tier's counters, when `--kv-remote` is on.
    pub kv_remote: std::sync::OnceLock<std::sync::Arc<crate::kvremote::RemoteStats>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            queue_depth: AtomicU64::new(0),
            active_sessions: AtomicU64::new(0),
            parked_sessions: AtomicU64::new(0),
            kv_tier: std::sync::OnceLock::new(),
            kv_restoring: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            keepalives: AtomicU64::new(0),
            kv_bytes: Default::default(),
            kv_fork_bytes_copied: AtomicU64::new(0),
            prefix_hits: Default::default(),
            prefix_hit_requests: Default::default(),
            recomputed_tokens: AtomicU64::new(0),
            connections_open: AtomicU64::new(0),
            closed: Default::default(),
            recent: Recent::default(),
            structured: StructuredMetrics::default(),
            spec: SpecMetrics::default(),
            kv_remote: std::sync::OnceLock::new(),
        }
    }
}

/// The `ds4_kv_remote_*` series.
fn render_remote(r: &crate::kvremote::RemoteStats, out: &mut String) {
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let series: [(&str, &str, &str, u64); 5] = [
        ("ds4_kv_remote_hits_total", "counter", "Lookups that imported a restore point from Redis.", l(&r.hits)),
        ("ds4_kv_remote_hit_tokens_total", "counter", "Prompt tokens those restore points covered.", l(&r.hit_tokens)),
        (
            "ds4_kv_remote_misses_total",
            "counter",
            "Redis lookups that found nothing better than the local tiers (Redis unavailable included).",
            l(&r.misses),
        ),
        ("ds4_kv_remote_writes_total", "counter", "KV entries (pages, checkpoints) written to Redis.", l(&r.writes)),
        ("ds4_kv_remote_write_bytes_total", "counter", "Bytes of KV entries written to Redis.", l(&r.write_bytes)),
    ];
    for (name, kind, help, v) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    }
    out.push_str("# HELP ds4_kv_remote_dropped_writes_total Saves not written to Redis (queue_full, unavailable).\n");
    out.push_str("# TYPE ds4_kv_remote_dropped_writes_total counter\n");
    let _ = writeln!(out, "ds4_kv_remote_dropped_writes_total{{reason=\"queue_full\"}} {}", l(&r.dropped_queue_full));
    let _ = writeln!(out, "ds4_kv_remote_dropped_writes_total{{reason=\"unavailable\"}} {}", l(&r.dropped_unavailable));
    out.push_str("# HELP ds4_kv_remote_errors_total Redis KV tier failures by kind (integrity: a blob that failed ");
    out.push_str("validation; connection; timeout; other).\n# TYPE ds4_kv_remote_errors_total counter\n");
    for (kind, n) in r.errors_by_kind() {
        let _ = writeln!(out, "ds4_kv_remote_errors_total{{kind=\"{kind}\"}} {n}");
    }
    let up = r.up.load(Ordering::Relaxed) as u64;
    let _ = writeln!(out, "# HELP ds4_kv_remote_up Whether the last Redis operation succeeded.\n# TYPE ds4_kv_remote_up gauge\nds4_kv_remote_up {up}");
}

impl Metrics {
    /// Count one finished request (`endpoint` is a route name, never raw client input).
    pub fn request(&self, endpoint: &str, status: u16) {
        *self.requests.lock().entry((endpoint.to_string(), status)).or_insert(0) += 1;
    }

    pub fn set_kv_bytes(&self, tier: CacheTier, bytes: u64) {
        self.kv_bytes[tier as usize].store(bytes, Ordering::Relaxed);
    }

    /// Sets the running total behind `ds4_kv_fork_bytes_copied_total`.
    pub fn set_kv_fork_bytes_copied(&self, bytes: u64) {
        self.kv_fork_bytes_copied.store(bytes, Ordering::Relaxed);
    }

    pub fn add_prefix_hit(&self, tier: CacheTier, tokens: u64) {
        self.prefix_hits[tier as usize].fetch_add(tokens, Ordering::Relaxed);
    }

    /// An admitted request: whether it reused a cached prefix (from `tier`), and the prompt tokens it prefills.
    pub fn add_prefill(&self, hit: bool, tier: CacheTier, recomputed: u64) {
        if hit {
            self.prefix_hit_requests[tier as usize].fetch_add(1, Ordering::Relaxed);
        }
        self.recomputed_tokens.fetch_add(recomputed, Ordering::Relaxed);
    }

    /// Requests that reused a prefix from `tier` so far.
    pub fn prefix_hit_requests(&self, tier: CacheTier) -> u64 {
        load(&self.prefix_hit_requests[tier as usize])
    }

    /// Prompt tokens prefilled (not reused) so far.
    pub fn recomputed_tokens(&self) -> u64 {
        load(&self.recomputed_tokens)
    }

    /// Count a connection the server closed.
    pub fn connection_closed(&self, reason: CloseReason) {
        self.closed[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Connections closed for `reason` so far.
    pub fn connections_closed(&self, reason: CloseReason) -> u64 {
        load(&self.closed[reason as usize])
    }

    /// Prompt tokens served from `tier` so far.
    pub fn prefix_hit_tokens(&self, tier: CacheTier) -> u64 {
        load(&self.prefix_hits[tier as usize])
    }

    /// KV bytes held in `tier` now.
    pub fn kv_bytes(&self, tier: CacheTier) -> u64 {
        self.kv_bytes_at(tier as usize)
    }

    /// The disk tier's bytes are read live from the tier store; the others are what the scheduler published.
    fn kv_bytes_at(&self, i: usize) -> u64 {
        match self.kv_tier.get() {
            Some(t) if i == CacheTier::Disk as usize => t.disk_bytes(),
            _ => load(&self.kv_bytes[i]),
        }
    }

    /// Finished requests counted by [`Metrics::request`] on `endpoints`, any status.
    pub fn requests_on(&self, endpoints: &[&str]) -> u64 {
        self.requests.lock().iter().filter(|((ep, _), _)| endpoints.contains(&ep.as_str())).map(|(_, n)| n).sum()
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP ds4_requests_total HTTP requests by endpoint and status.\n");
        out.push_str("# TYPE ds4_requests_total counter\n");
        for ((ep, st), n) in self.requests.lock().iter() {
            let _ = writeln!(out, "ds4_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}");
        }
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(&mut out, "ds4_prompt_tokens_total", "Prompt tokens of admitted requests.", load(&self.prompt_tokens));
        counter(&mut out, "ds4_completion_tokens_total", "Generated tokens.", load(&self.completion_tokens));
        let sp = &self.spec;
        counter(&mut out, "ds4_spec_cycles_total", "Speculative verify runs.", load(&sp.cycles));
        counter(&mut out, "ds4_spec_draft_tokens_total", "Drafted tokens verified.", load(&sp.draft_tokens));
        counter(&mut out, "ds4_spec_accepted_tokens_total", "Drafted tokens accepted.", load(&sp.accepted_tokens));
        let secs = |v: &AtomicU64| load(v) as f64 / 1e6;
        let _ = writeln!(
            out,
            "# HELP ds4_spec_draft_seconds_total Time spent drafting.\n# TYPE ds4_spec_draft_seconds_total counter\n\
             ds4_spec_draft_seconds_total {}",
            secs(&sp.draft_micros)
        );
        let _ = writeln!(
            out,
            "# HELP ds4_spec_verify_seconds_total Time of the model ticks that verified drafts.\n\
             # TYPE ds4_spec_verify_seconds_total counter\nds4_spec_verify_seconds_total {}",
            secs(&sp.verify_micros)
        );
        counter(
            &mut out,
            "ds4_spec_paused_total",
            "Times auto speculation paused a session whose drafts did not pay.",
            load(&sp.paused),
        );
        out.push_str("# HELP ds4_kv_disk_errors_total Disk KV tier failures by kind (save, restore, write, read, ");
        out.push_str(
            "corrupt_at_open: corrupt files removed at start, checksum: corrupt entries found while restoring).\n",
        );
        out.push_str("# TYPE ds4_kv_disk_errors_total counter\n");
        let tier = self.kv_tier.get();
        for (kind, n) in tier.map(|t| t.error_counts()).unwrap_or_default().by_kind() {
            let _ = writeln!(out, "ds4_kv_disk_errors_total{{kind=\"{kind}\"}} {n}");
        }
        counter(
            &mut out,
            "ds4_kv_disk_saves_dropped_total",
            "KV saves dropped because the tier I/O queue was full.",
            tier.map_or(0, |t| t.saves_dropped()),
        );
        let _ = writeln!(
            out,
            "# HELP ds4_kv_io_pending KV tier I/O jobs (saves, restores) queued or running.\n\
             # TYPE ds4_kv_io_pending gauge\nds4_kv_io_pending {}",
            tier.map_or(0, |t| t.io_pending())
        );
        let pages = tier.map(|t| t.pages()).unwrap_or_default();
        let _ = writeln!(
            out,
            "# HELP ds4_kv_pages_resident Page spans held in RAM under their store keys (a restore takes them \
             without reading or decoding).\n# TYPE ds4_kv_pages_resident gauge\nds4_kv_pages_resident {}",
            pages.resident
        );
        out.push_str("# HELP ds4_kv_restored_pages_total Page spans restores loaded, by where they came from ");
        out.push_str("(ram: pages already resident, joined by key; store: read and decoded).\n");
        out.push_str("# TYPE ds4_kv_restored_pages_total counter\n");
        let _ = writeln!(out, "ds4_kv_restored_pages_total{{from=\"ram\"}} {}", pages.joined);
        let _ = writeln!(out, "ds4_kv_restored_pages_total{{from=\"store\"}} {}", pages.decoded);
        let _ = writeln!(
            out,
            "# HELP ds4_kv_restoring Requests waiting for a restore from the KV tiers.\n\
             # TYPE ds4_kv_restoring gauge\nds4_kv_restoring {}",
            load(&self.kv_restoring)
        );
        if let Some(r) = self.kv_remote.get() {
            render_remote(r, &mut out);
        }
        counter(
            &mut out,
            "ds4_generations_cancelled_total",
            "Generations stopped because their client went away.",
            load(&self.cancelled),
        );
        counter(&mut out, "ds4_keepalives_total", "SSE keep-alive frames sent.", load(&self.keepalives));
        self.ttft.render("ds4_time_to_first_token_seconds", "Submit to first generated token.", &mut out);
        self.itl.render("ds4_inter_token_latency_seconds", "Time between generated tokens.", &mut out);
        gauge(&mut out, "ds4_queue_depth", "Requests waiting for a session slot.", load(&self.queue_depth));
        gauge(&mut out, "ds4_active_sessions", "Sessions generating now.", load(&self.active_sessions));
        gauge(&mut out, "ds4_parked_sessions", "Idle sessions kept for prefix reuse.", load(&self.parked_sessions));
        out.push_str("# HELP ds4_kv_bytes KV cache bytes by tier.\n# TYPE ds4_kv_bytes gauge\n");
        for (i, t) in TIERS.iter().enumerate() {
            let _ = writeln!(out, "ds4_kv_bytes{{tier=\"{t}\"}} {}", self.kv_bytes_at(i));
        }
        counter(
            &mut out,
            "ds4_kv_fork_bytes_copied_total",
            "KV bytes copied by session forks and copy on write of shared pages.",
            load(&self.kv_fork_bytes_copied),
        );
        out.push_str("# HELP ds4_prefix_cache_hit_tokens_total Prompt tokens served from cache, by tier.\n");
        out.push_str("# TYPE ds4_prefix_cache_hit_tokens_total counter\n");
        for (i, t) in TIERS.iter().enumerate() {
            let _ = writeln!(out, "ds4_prefix_cache_hit_tokens_total{{tier=\"{t}\"}} {}", load(&self.prefix_hits[i]));
        }
        out.push_str("# HELP ds4_prefix_cache_hits_total Requests that reused a cached prompt prefix, by tier.\n");
        out.push_str("# TYPE ds4_prefix_cache_hits_total counter\n");
        for (i, t) in TIERS.iter().enumerate() {
            let _ = writeln!(out, "ds4_prefix_cache_hits_total{{tier=\"{t}\"}} {}", load(&self.prefix_hit_requests[i]));
        }
        counter(
            &mut out,
            "ds4_prefix_cache_recomputed_tokens_total",
            "Prompt tokens prefilled (not served from cache).",
            load(&self.recomputed_tokens),
        );
        gauge(&mut out, "ds4_connections_open", "Open HTTP connections.", load(&self.connections_open));
        out.push_str("# HELP ds4_connections_closed_total Connections closed by the server, by reason.\n");
        out.push_str("# TYPE ds4_connections_closed_total counter\n");
        for (i, r) in CLOSE_REASONS.iter().enumerate() {
            let _ = writeln!(out, "ds4_connections_closed_total{{reason=\"{r}\"}} {}", load(&self.closed[i]));
        }
        self.structured.render(&mut out);
        out
    }
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_and_histograms() {
        let m = Metrics::default();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("messages", 400);
        m.ttft.observe(Duration::from_millis(30));
        m.add_prefix_hit(CacheTier::Host, 12);
        m.add_prefill(true, CacheTier::Host, 5);
        m.add_prefill(false, CacheTier::Host, 7);
        let text = m.render();
        assert!(text.contains("ds4_prefix_cache_hits_total{tier=\"host\"} 1\n"), "{text}");
        assert!(text.contains("ds4_prefix_cache_hits_total{tier=\"disk\"} 0\n"));
        assert!(text.contains("ds4_prefix_cache_recomputed_tokens_total 12\n"));
        assert!(text.contains("ds4_requests_total{endpoint=\"chat\",status=\"200\"} 2\n"));
        assert!(text.contains("ds4_requests_total{endpoint=\"messages\",status=\"400\"} 1\n"));
        assert!(text.contains("ds4_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n"));
        assert!(text.contains("ds4_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(text.contains("ds4_time_to_first_token_seconds_count 1\n"));
        assert!(text.contains("ds4_prefix_cache_hit_tokens_total{tier=\"host\"} 12\n"));
    }
}
