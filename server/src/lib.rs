//! # ds4-server
//!
//! OpenAI Chat Completions / Completions, Anthropic Messages and OpenAI Responses over HTTP (hyper 1 + tokio), for
//! coding agents, many sessions at once.
//!
//! Layers, top to bottom:
//! - [`http`] — accept loop, the per-request [`access_log`], routing on the path without its query, body limits,
//!   graceful shutdown; [`conn`] — connection timeouts and the connection cap; [`guard`] — Host, Origin/CORS, API
//!   key and body-type checks; [`response`] — the response builders the API modules share;
//! - [`api`] — one module per wire API: parse the request into a [`model::Conversation`], answer in that API's
//!   exact shapes ([`sse`] formats the frames), errors in that API's JSON shape ([`api::errors`]);
//! - [`generate`] — API-neutral generation: submit to the scheduler, detokenize, parse reasoning / content / tool
//!   calls, stop strings, usage;
//! - [`structured`] — structured outputs: response formats and strict tools as a grammar that masks sampling;
//! - [`scheduler`] — the one thread that owns the model and runs continuous-batching ticks, with prefix reuse;
//! - [`webui`] — the built-in page on `/`, fed by [`status`] (`GET /v1/status`) and [`recent`] (the ring of recent
//!   requests the scheduler fills);
//! - [`model`] — the seam to the model ([`model::Runner`] + [`model::Codec`]; [`engine`] adapts the real one); [`fake`] is the deterministic
//!   test model.
//!
//! Embedding (tests do this): build an [`AppState`] with [`build_state`], bind a listener, run [`http::serve`].

pub mod access_log;
pub mod api;
pub mod cli;
pub mod conn;
pub mod context;
pub mod engine;
pub mod fake;
pub mod fake_script;
pub mod generate;
pub mod guard;
pub mod http;
pub mod kvdisk;
pub mod kvremote;
pub mod markers;
pub mod membudget;
pub mod metrics;
pub mod model;
pub mod recent;
pub mod response;
pub mod scheduler;
pub mod sse;
pub mod state;
pub mod status;
pub mod structured;
pub mod toolmem;
pub mod webui;

use std::sync::Arc;

pub use state::{AppState, Limits};

use metrics::Metrics;
use model::{Codec, ModelInfo, Runner};
use scheduler::{Scheduler, SchedulerConfig};
use toolmem::ToolMemory;

/// Start the scheduler on `runner` (no KV tier behind the RAM tier) and assemble the shared state.
pub fn build_state(
    runner: Box<dyn Runner>,
    codec: Arc<dyn Codec>,
    info: ModelInfo,
    config: SchedulerConfig,
    limits: Limits,
) -> Arc<AppState> {
    build_state_with_tier(runner, None, codec, info, config, limits)
}

/// Start the scheduler on `runner` and the KV tier store `tier` ([`kvdisk`]), and assemble the shared state.
pub fn build_state_with_tier(
    runner: Box<dyn Runner>,
    tier: Option<kvdisk::DiskTier>,
    codec: Arc<dyn Codec>,
    info: ModelInfo,
    mut config: SchedulerConfig,
    limits: Limits,
) -> Arc<AppState> {
    let metrics = Arc::new(Metrics::default());
    config.context_size = info.context_size;
    let scheduler = Scheduler::start_with_tier(runner, tier, config, metrics.clone());
    Arc::new(AppState { info, codec, scheduler, metrics, tools: ToolMemory::new(10_000), limits })
}
