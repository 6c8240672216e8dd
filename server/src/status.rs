//! `GET /v1/status`: the live state the web page's status view shows, as one JSON object, taken from the metrics,
//! the scheduler and the ring of recent requests ([`crate::recent`]). It carries counts, bytes and timings only:
//! never prompt or output text.
//!
//! Shape (all counts are integers, rates and times are numbers; `recent` is newest first):
//! ```json
//! {"model": "deepseek-v4-flash", "demo": true, "context_size": 4096, "uptime_s": 12.5,
//!  "sessions": {"active": 1, "parked": 3}, "queue": {"waiting": 0, "max": 256},
//!  "tokens_per_s": {"prefill": 120.0, "decode": 31.5, "window_s": 10.0},
//!  "totals": {"requests": 4, "prompt_tokens": 300, "cached_tokens": 120, "completion_tokens": 90},
//!  "kv_bytes": {"device": 0, "host": 1048576, "disk": 0},
//!  "cache_hit_tokens": {"device": 0, "host": 120, "disk": 0},
//!  "recent": [{"submitted_unix_ms": 1764600000000, "prompt_tokens": 80, "cached_tokens": 60, "cache_tier": "host",
//!              "output_tokens": 20, "queue_ms": 0.1, "ttft_ms": 35.2, "total_ms": 410.0, "decode_tps": 50.1,
//!              "outcome": "stop"}]}
//! ```
//! `kv_bytes` and `cache_hit_tokens` have one key per storage tier the server has (`host` is RAM).

use serde_json::{json, Map, Value};

use crate::metrics::CacheTier;
use crate::recent::RequestRecord;
use crate::state::AppState;

/// Generation endpoints (the route names [`crate::http`] counts requests under).
const GENERATION_ENDPOINTS: &[&str] = &["chat_completions", "completions", "messages", "responses"];

/// The status object.
pub fn snapshot(state: &AppState) -> Value {
    let m = &state.metrics;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let rates = m.recent.rates();
    let per_tier = |f: &dyn Fn(CacheTier) -> u64| -> Value {
        Value::Object(CacheTier::ALL.iter().map(|&t| (t.name().to_string(), json!(f(t)))).collect::<Map<_, _>>())
    };
    let cached_total: u64 = CacheTier::ALL.iter().map(|&t| m.prefix_hit_tokens(t)).sum();
    json!({
        "model": state.info.id,
        "demo": state.info.demo,
        "context_size": state.info.context_size,
        "uptime_s": round3(m.recent.uptime().as_secs_f64()),
        "sessions": {"active": load(&m.active_sessions), "parked": load(&m.parked_sessions)},
        "queue": {"waiting": state.scheduler.queue_depth(), "max": state.scheduler.max_queue()},
        "tokens_per_s": {
            "prefill": round3(rates.prefill_tps),
            "decode": round3(rates.decode_tps),
            "window_s": round3(rates.window_s),
        },
        "totals": {
            "requests": m.requests_on(GENERATION_ENDPOINTS),
            "prompt_tokens": load(&m.prompt_tokens),
            "cached_tokens": cached_total,
            "completion_tokens": load(&m.completion_tokens),
        },
        "kv_bytes": per_tier(&|t| m.kv_bytes(t)),
        "cache_hit_tokens": per_tier(&|t| m.prefix_hit_tokens(t)),
        "recent": m.recent.requests().iter().map(record_json).collect::<Vec<_>>(),
    })
}

fn record_json(r: &RequestRecord) -> Value {
    let ms = |d: std::time::Duration| round3(d.as_secs_f64() * 1e3);
    json!({
        "submitted_unix_ms": r.submitted_unix_ms,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "cache_tier": r.cache_tier,
        "output_tokens": r.output_tokens,
        "queue_ms": ms(r.queue),
        "ttft_ms": r.ttft.map(ms),
        "total_ms": ms(r.total),
        "decode_tps": r.decode_tps().map(round3),
        "outcome": r.outcome.as_str(),
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
