//! Command-line options of the `ds4-server` binary.

use std::path::PathBuf;

use clap::Parser;

/// Compute backend: the engine's registry ([`ds4_engine::backend::registry`]).
pub use ds4_engine::BackendKind;

/// OpenAI / Anthropic / Responses compatible server for DeepSeek V4 Flash.
#[derive(Debug, Parser)]
#[command(name = "ds4-server", version)]
pub struct Args {
    /// Model file (DS4 GGUF). Without it the built-in demo model is served (see --demo-model).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Which built-in model serves without -m: `trained` (small, trained on Python docs, with an MTP block: it
    /// answers in words) or `random` (random weights with the real DeepSeek V4 vocabulary and tokenizer: noise that
    /// exercises every token a client can see).
    #[arg(long, value_enum, default_value = "trained", conflicts_with = "model")]
    pub demo_model: DemoModel,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Context size in tokens (default: the largest that fits this machine's memory, capped at the model's; the
    /// arithmetic is logged at start).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Upper bound on the output tokens of any request (default: none; a request that sends no limit may use all
    /// of the context its prompt leaves).
    #[arg(long)]
    pub max_output_tokens: Option<usize>,
    /// Directory of the on-disk KV cache (default: `$XDG_CACHE_HOME/ds4/kv`, else `~/.cache/ds4/kv`).
    #[arg(long)]
    pub kv_disk_dir: Option<PathBuf>,
    /// Keep no KV cache on disk (prefixes are then reused from RAM only, and lost on restart).
    #[arg(long, conflicts_with = "kv_disk_dir")]
    pub no_kv_disk: bool,
    /// Disk space for the KV cache, in MiB (default: what the cache holds plus a quarter of the free space, 256 MiB
    /// to 64 GiB).
    #[arg(long)]
    pub kv_disk_space_mb: Option<u64>,
    /// Memory for idle sessions kept for prefix reuse (the RAM KV tier), in MiB (default: a quarter of the available
    /// memory left by the weights). Beyond it the least recently used are moved to the disk tier.
    #[arg(long)]
    pub kv_ram_mb: Option<u64>,
    /// With the disk tier: a system prompt + tools block (the prompt before its first user message) at least this
    /// many tokens long is saved to disk at its end (the last page boundary inside it), so another conversation of
    /// the same agent restores it, also after a restart (0: off).
    #[arg(long, default_value_t = 1024)]
    pub kv_system_block_min_tokens: usize,
    /// Shared KV tier on Redis, `redis://HOST:PORT/DB`: replicas behind a load balancer share restore points (what
    /// the local tier saves is also written there, behind it; a local miss asks it). Works with the disk tier and
    /// with --no-kv-disk (then the local tier is in memory, --kv-ram-mb / 4). Redis down: one warning, serving
    /// goes on from the local tiers, reconnects every few seconds. See docs/scale-out.md.
    #[arg(long, value_name = "URL")]
    pub kv_remote: Option<String>,
    /// Milliseconds that connecting to --kv-remote, and each read or write on it, may take.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub kv_remote_timeout_ms: u64,
    /// Saves waiting to be written to --kv-remote at most; past it a save is dropped (counted), so the scheduler
    /// never waits on the network.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub kv_remote_queue: u64,
    /// Speculative decoding: `off`; `mtp` (the model file's MTP block drafts, the target verifies each draft in one
    /// batched tick; output identical to plain decoding at temperature 0, the same distribution otherwise);
    /// `dspark` (the V4-Flash-0731 DSpark drafter: a block of drafts per forward); `auto` (the model's drafter —
    /// MTP, else DSpark — paused per session while its drafts do not pay).
    #[arg(long, default_value = "auto", value_parser = parse_spec_mode)]
    pub speculative: crate::scheduler::SpecMode,
    /// Drafted tokens per verify run at most (1..=16).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub draft_len: u64,
    /// The drafter stops a draft at a token it trusts less than this (MTP: the token's probability; DSpark: the
    /// product of its confidences so far; 0: full length).
    #[arg(long, default_value_t = 0.0)]
    pub draft_min_confidence: f32,
    /// Compute backend: cpu, wgpu or cuda (cuda: a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// Where groups of ops run besides --backend: `experts=cpu` runs every MoE layer's experts on the CPU and the
    /// rest on the GPU backend (a model bigger than GPU memory); `default`: everything on --backend.
    #[arg(long, default_value = "default")]
    pub placement: ds4_engine::exec::Placement,
    /// Sessions decoding at once (continuous batch width).
    #[arg(long, default_value_t = 32)]
    pub max_active: usize,
    /// Requests that may wait for a slot before new ones get 503.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Prompt tokens fed per tick (long prefills are sliced so decoders keep flowing).
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Idle sessions kept in RAM for prefix reuse, at most (their memory is bounded by --kv-ram-mb).
    #[arg(long, default_value_t = 256)]
    pub max_parked: usize,
    /// Request body limit in MiB (413 above).
    #[arg(long, default_value_t = 32)]
    pub max_body_mb: usize,
    /// Memory in MiB that all requests' bodies and prompts being tokenized may take together (past it a request
    /// waits up to --request-memory-wait-s, then gets 503 with Retry-After).
    #[arg(long, default_value_t = 256)]
    pub request_memory_mb: usize,
    /// Seconds a request waits for room in --request-memory-mb before it is answered 503.
    #[arg(long, default_value_t = 10)]
    pub request_memory_wait_s: u64,
    /// Serve the deterministic scripted test model instead of a real one (for client/SDK tests; see README).
    /// Test builds only (feature `test-model`).
    #[cfg(feature = "test-model")]
    #[arg(long)]
    pub fake_model: bool,
    /// Scripted turns for --fake-model (JSON or JSON Lines; see README "Fake model").
    #[cfg(feature = "test-model")]
    #[arg(long, requires = "fake_model")]
    pub fake_script: Option<PathBuf>,
    /// Milliseconds the fake model sleeps per step (a slow model, for keep-alive and cancellation tests).
    #[cfg(feature = "test-model")]
    #[arg(long, default_value_t = 0, requires = "fake_model")]
    pub fake_delay_ms: u64,
    /// Seconds between SSE keep-alives while nothing visible is sent (queue wait, prefill, hidden reasoning).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub keepalive_s: u64,
    /// Do not serve the built-in web page on `/` (chat + status view); `/v1/status` stays.
    #[arg(long)]
    pub no_webui: bool,
    /// Seconds to let in-flight requests finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout_s: u64,
    /// Open connections at most; past it the oldest connection without a request in progress is closed.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds from the first byte of a request to the end of its headers (slow clients are closed).
    #[arg(long, default_value_t = 10)]
    pub header_timeout_s: u64,
    /// Seconds a connection may stay open with no request in progress (keep-alive idle).
    #[arg(long, default_value_t = 60)]
    pub idle_timeout_s: u64,
    /// Seconds to receive a whole request body (408 after).
    #[arg(long, default_value_t = 60)]
    pub body_timeout_s: u64,
    /// Extra names accepted in the Host header besides localhost, 127.0.0.1, ::1, IP addresses and --host
    /// (repeatable; `*` accepts any).
    #[arg(long = "allowed-host")]
    pub allowed_hosts: Vec<String>,
    /// Origin allowed to call the API from a browser (CORS; repeatable; `*` for any). Without it, requests that
    /// carry a foreign Origin header are refused.
    #[arg(long = "cors-origin")]
    pub cors_origins: Vec<String>,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY` (everything but /health).
    #[arg(long, env = "DS4_SERVER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

fn parse_spec_mode(s: &str) -> Result<crate::scheduler::SpecMode, String> {
    s.parse()
}

/// `--demo-model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoModel {
    Trained,
    Random,
}
