//! Shared server state handed to every request handler (`Arc<AppState>`).

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Codec, ModelInfo};
use crate::metrics::Metrics;
use crate::scheduler::Scheduler;
use crate::toolmem::ToolMemory;

/// Per-server limits and defaults.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Request bodies above this are answered 413.
    pub max_body_bytes: usize,
    /// SSE keep-alive comment interval while nothing else is sent (long prefill, queue wait).
    pub keepalive: Duration,
    /// `max_tokens` when a request sends none (clipped to the context left).
    pub default_max_tokens: usize,
    /// Serve the web page on `/` (`--no-webui` turns it off: 404).
    pub webui: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_body_bytes: 32 << 20, keepalive: Duration::from_secs(10), default_max_tokens: 4096, webui: true }
    }
}

/// Everything a handler needs.
pub struct AppState {
    pub info: ModelInfo,
    pub codec: Arc<dyn Codec>,
    pub scheduler: Scheduler,
    pub metrics: Arc<Metrics>,
    pub tools: ToolMemory,
    pub limits: Limits,
}
