//! Command-line options of the `ds4-server` binary.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

/// Compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    Cpu,
    Wgpu,
}

/// OpenAI / Anthropic / Responses compatible server for DeepSeek V4 Flash.
#[derive(Debug, Parser)]
#[command(name = "ds4-server", version)]
pub struct Args {
    /// Model file (DS4 GGUF). Without it the built-in tiny demo model is served.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Context size in tokens (default: the model's, capped at 32768).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Directory of the on-disk KV cache.
    #[arg(long)]
    pub kv_disk_dir: Option<PathBuf>,
    /// Disk space for the KV cache, in MiB.
    #[arg(long, default_value_t = 4096)]
    pub kv_disk_space_mb: u64,
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Sessions decoding at once (continuous batch width).
    #[arg(long, default_value_t = 32)]
    pub max_active: usize,
    /// Requests that may wait for a slot before new ones get 503.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Prompt tokens fed per tick (long prefills are sliced so decoders keep flowing).
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Idle sessions kept in RAM for prefix reuse.
    #[arg(long, default_value_t = 16)]
    pub max_parked: usize,
    /// Request body limit in MiB (413 above).
    #[arg(long, default_value_t = 32)]
    pub max_body_mb: usize,
    /// Serve the deterministic scripted test model instead of a real one (for client/SDK tests).
    #[arg(long, hide = true)]
    pub fake_model: bool,
    /// Do not serve the built-in web page on `/` (chat + status view); `/v1/status` stays.
    #[arg(long)]
    pub no_webui: bool,
    /// Seconds to let in-flight requests finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout_s: u64,
}
