//! What the status view shows beyond the Prometheus counters: a bounded ring of the most recent finished requests
//! (token counts and timings — never prompt or output text) and a sliding window of token throughput.
//!
//! Both are written by the scheduler thread only ([`Recent::record`] once per finished job, [`Recent::add_tokens`]
//! once per tick) and read by `GET /v1/status` ([`crate::status`]). Invariants: the ring holds at most its capacity
//! (oldest dropped first); the rate window covers the last [`WINDOW_S`] whole seconds plus the current one, so memory
//! is constant however long the server runs. Locks are held for a copy at most, never across I/O.

use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// Seconds of throughput history the rates are averaged over.
pub const WINDOW_S: u64 = 10;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// End of sequence.
    Stop,
    /// `max_tokens` or the context was reached.
    Length,
    /// The handler dropped the job before the end: the client went away, or a stop string matched.
    Cancelled,
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Cancelled => "cancelled",
            Outcome::Error => "error",
        }
    }
}

/// One finished request, as counts and durations.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// Unix time of the submission, milliseconds.
    pub submitted_unix_ms: u64,
    pub prompt_tokens: usize,
    /// Prompt tokens reused from a cache tier (`cache_tier` says which).
    pub cached_tokens: usize,
    /// The tier the cached tokens came from (`host`, `disk`, ...; meaningful when `cached_tokens > 0`).
    pub cache_tier: &'static str,
    pub output_tokens: usize,
    /// Submit to admission (waiting for a session slot).
    pub queue: Duration,
    /// Submit to the first generated token; `None` when none was generated.
    pub ttft: Option<Duration>,
    /// Submit to the end.
    pub total: Duration,
    pub outcome: Outcome,
}

impl RequestRecord {
    /// Generated tokens per second after the first one (`None` below two tokens).
    pub fn decode_tps(&self) -> Option<f64> {
        let ttft = self.ttft?;
        let secs = self.total.checked_sub(ttft)?.as_secs_f64();
        (self.output_tokens >= 2 && secs > 0.0).then(|| (self.output_tokens - 1) as f64 / secs)
    }
}

/// Tokens processed per second over the recent window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rates {
    pub prefill_tps: f64,
    pub decode_tps: f64,
    /// Seconds the rates are averaged over (shorter than [`WINDOW_S`] right after start).
    pub window_s: f64,
}

struct Window {
    /// `(second since start, prefill tokens, decode tokens)`, oldest first, at most `WINDOW_S + 1` entries.
    buckets: VecDeque<(u64, u64, u64)>,
}

/// The ring of recent requests and the throughput window.
pub struct Recent {
    capacity: usize,
    started: Instant,
    ring: Mutex<VecDeque<RequestRecord>>,
    window: Mutex<Window>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent::new(32)
    }
}

impl Recent {
    /// Keep the last `capacity` requests.
    pub fn new(capacity: usize) -> Self {
        Recent {
            capacity,
            started: Instant::now(),
            ring: Mutex::new(VecDeque::with_capacity(capacity)),
            window: Mutex::new(Window { buckets: VecDeque::with_capacity(WINDOW_S as usize + 2) }),
        }
    }

    /// Time since this was created (the server's uptime).
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Unix milliseconds of `at` (an `Instant` of this process).
    pub fn unix_ms(at: Instant) -> u64 {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        now.saturating_sub(at.elapsed()).as_millis() as u64
    }

    /// Add a finished request, dropping the oldest beyond the capacity.
    pub fn record(&self, r: RequestRecord) {
        if self.capacity == 0 {
            return;
        }
        let mut ring = self.ring.lock();
        while ring.len() >= self.capacity {
            ring.pop_front();
        }
        ring.push_back(r);
    }

    /// The recorded requests, newest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.ring.lock().iter().rev().cloned().collect()
    }

    /// Count tokens processed now.
    pub fn add_tokens(&self, prefill: u64, decode: u64) {
        self.add_tokens_at(self.started.elapsed(), prefill, decode);
    }

    fn add_tokens_at(&self, since_start: Duration, prefill: u64, decode: u64) {
        if prefill == 0 && decode == 0 {
            return;
        }
        let sec = since_start.as_secs();
        let mut w = self.window.lock();
        match w.buckets.back_mut() {
            Some(b) if b.0 == sec => {
                b.1 += prefill;
                b.2 += decode;
            }
            _ => w.buckets.push_back((sec, prefill, decode)),
        }
        while w.buckets.front().is_some_and(|b| b.0 + WINDOW_S < sec) {
            w.buckets.pop_front();
        }
    }

    /// Token rates over the last [`WINDOW_S`] seconds.
    pub fn rates(&self) -> Rates {
        self.rates_at(self.started.elapsed())
    }

    fn rates_at(&self, since_start: Duration) -> Rates {
        let now = since_start.as_secs_f64();
        let window = now.min(WINDOW_S as f64);
        let from = now - window;
        let w = self.window.lock();
        let (mut p, mut d) = (0u64, 0u64);
        // A bucket counts when its second overlaps the window.
        for &(_, bp, bd) in w.buckets.iter().filter(|b| (b.0 + 1) as f64 > from) {
            p += bp;
            d += bd;
        }
        let secs = window.max(1.0);
        Rates { prefill_tps: p as f64 / secs, decode_tps: d as f64 / secs, window_s: window }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: usize) -> RequestRecord {
        RequestRecord {
            submitted_unix_ms: i as u64,
            prompt_tokens: 10 + i,
            cached_tokens: i,
            cache_tier: "host",
            output_tokens: 5,
            queue: Duration::ZERO,
            ttft: Some(Duration::from_millis(100)),
            total: Duration::from_millis(500),
            outcome: Outcome::Stop,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_first_and_is_bounded() {
        let r = Recent::new(3);
        for i in 0..5 {
            r.record(rec(i));
        }
        let got: Vec<usize> = r.requests().iter().map(|x| x.cached_tokens).collect();
        assert_eq!(got, vec![4, 3, 2]);
        let none = Recent::new(0);
        none.record(rec(1));
        assert!(none.requests().is_empty());
    }

    #[test]
    fn decode_rate_excludes_the_first_token() {
        // 5 tokens, the first at 100 ms, the last at 500 ms: 4 tokens in 0.4 s.
        assert!((rec(0).decode_tps().unwrap() - 10.0).abs() < 1e-9);
        assert_eq!(RequestRecord { output_tokens: 1, ..rec(0) }.decode_tps(), None);
        assert_eq!(RequestRecord { ttft: None, ..rec(0) }.decode_tps(), None);
    }

    #[test]
    fn rates_average_over_the_window_and_forget_old_seconds() {
        let r = Recent::new(1);
        let s = Duration::from_secs;
        r.add_tokens_at(s(1), 100, 10);
        r.add_tokens_at(s(1), 100, 10);
        r.add_tokens_at(s(3), 0, 20);
        // At 4 s the window is the 4 s since start.
        let at4 = r.rates_at(s(4));
        assert_eq!(at4.window_s, 4.0);
        assert!((at4.prefill_tps - 50.0).abs() < 1e-9 && (at4.decode_tps - 10.0).abs() < 1e-9, "{at4:?}");
        // At 20 s everything is older than the window.
        assert_eq!(r.rates_at(s(20)).decode_tps, 0.0);
        // New tokens drop the old buckets: memory stays bounded.
        for t in 0..1000 {
            r.add_tokens_at(s(t), 1, 1);
        }
        assert!(r.window.lock().buckets.len() <= WINDOW_S as usize + 1);
        let late = r.rates_at(s(999));
        assert!((late.decode_tps - 1.0).abs() < 0.2, "{late:?}");
    }
}
