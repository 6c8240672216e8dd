//! Shared server state handed to every request handler (`Arc<AppState>`).

use std::sync::Arc;
use std::time::Duration;

use crate::conn::ConnLimits;
use crate::guard::Access;
use crate::membudget::RequestMemory;
use crate::metrics::Metrics;
use crate::model::{Codec, ModelInfo};
use crate::scheduler::Scheduler;
use crate::toolmem::ToolMemory;

/// Per-server limits and defaults.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Request bodies above this are answered 413.
    pub max_body_bytes: usize,
    /// SSE keep-alive interval while nothing visible is sent (queue wait, long prefill, hidden reasoning).
    pub keepalive: Duration,
    /// Upper bound on the output tokens of any request (`--max-output-tokens`); `None`: a request that sends no
    /// limit may use all of the context its prompt leaves, and one that does gets what it asked for (both always
    /// clipped to the context left).
    pub max_output_tokens: Option<usize>,
    /// Connection timeouts and cap (see [`crate::conn`]).
    pub conn: ConnLimits,
    /// Host / Origin / API-key policy (see [`crate::guard`]).
    pub access: Access,
    /// Serve the web page on `/` (`--no-webui` turns it off: 404).
    pub webui: bool,
    /// The memory budget shared by all requests' bodies and prompts (see [`crate::membudget`]).
    pub request_memory: Arc<RequestMemory>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 << 20,
            keepalive: Duration::from_secs(5),
            max_output_tokens: None,
            conn: ConnLimits::default(),
            access: Access::default(),
            webui: true,
            request_memory: RequestMemory::new(256 << 20, Duration::from_secs(10)),
        }
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
