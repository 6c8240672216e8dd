//! `ds4-bench`: throughput, kernel bandwidth, KV restore and cross-backend correctness, every figure next to what
//! the hardware allows.
//!
//! Without a subcommand: prefill/decode throughput over growing context frontiers for `-m FILE` or `--synthetic
//! SPEC`, with the decode bandwidth roofline ([`throughput`], [`synth`], [`roofline`]).
//!
//! Subcommands (each report starts with a `#`-prefixed machine summary, then CSV on stdout; progress on stderr):
//! - `kernels`: quant matvec/matmul GB/s on the real Flash shapes vs measured memory bandwidth ([`kernels`]).
//! - `membw`: the bandwidth roofline alone, per buffer size and thread count ([`membw`]).
//! - `speculate`: plain greedy decoding vs the speculative verify path with an oracle drafter at several draft
//!   lengths, tokens/s and speed-up side by side ([`speculate`]).
//! - `correctness`: per backend pair max |Δlogit|, argmax and greedy agreement ([`correctness`]).
//! - `mask`: the per-token cost of constrained decoding per grammar kind, optionally as a share of a decode tick
//!   ([`mask`]).
//! - `kv`: restore-from-disk vs recompute per prefix length, cache write vs raw write ([`kvbench`], on `ds4_engine::persist`).
//!   `kv --replay FILE.jsonl [--restart] [--verify]`: a request trace through the RAM + disk prefix cache ([`kvreplay`]).
//!
//! Every run is short by default (seconds); flags make it longer. `--quick` shrinks everything for smoke tests.
//! `--plot FILE.svg` (throughput, `kv`, `kernels`) also draws the report as an SVG chart ([`plot`]).

mod account;
mod blocks;
mod commands;
mod correctness;
#[cfg(feature = "cuda")]
mod cuda;
mod engine_api;
mod kernels;
mod kvbench;
mod kvreplay;
mod machine;
mod mask;
mod membw;
mod par;
mod plot;
mod progress;
mod roofline;
mod speculate;
mod synth;
mod throughput;
mod tierio;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use commands::{run_correctness, run_kernels, run_kv, run_mask, run_membw, run_speculate, run_throughput};

#[derive(Parser, Debug)]
#[command(
    name = "ds4-bench",
    version,
    about = "ds4 benchmarks: every figure as a fraction of what the hardware allows",
    long_about = "ds4 benchmarks. Without a subcommand: prefill/decode throughput over growing context frontiers \
                  (CSV ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes) for -m FILE or \
                  --synthetic flash[:layers=N][:from=K][:recipe=q2|q4], with the decode bandwidth roofline.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    common: Common,
    /// A DS4 GGUF model file.
    #[arg(short = 'm', long = "model", conflicts_with = "synthetic")]
    model: Option<std::path::PathBuf>,
    /// A random-weight model built in memory: flash[:layers=N][:from=K][:recipe=q2|q4] or tiny[:layers=N].
    #[arg(long)]
    synthetic: Option<String>,
    /// First context frontier (tokens).
    #[arg(long, default_value_t = 32)]
    ctx_start: usize,
    /// Last context frontier.
    #[arg(long, default_value_t = 64)]
    ctx_max: usize,
    /// Frontier increment (0: only --ctx-start).
    #[arg(long, default_value_t = 32)]
    step: usize,
    /// Tokens decoded per session at each frontier.
    #[arg(long, default_value_t = 4)]
    gen_tokens: usize,
    /// Concurrent decoding sessions (continuous batching); gen_tps is their aggregate.
    #[arg(long, default_value_t = 1)]
    sessions: usize,
    /// Rows per engine tick (prefill chunk size).
    #[arg(long, default_value_t = 256)]
    batch_tokens: usize,
    /// Compute backend: cpu, wgpu or cuda (cuda: a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Groups of ops on a second backend: `experts=cpu` runs the MoE layers on the CPU beside a GPU --backend (the
    /// report then says what crosses the bus per token and what the device holds).
    #[arg(long, default_value = "default")]
    placement: ds4_engine::exec::Placement,
    /// Also draw the report as an SVG chart to this file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<std::path::PathBuf>,
    /// With --synthetic: write the model as a GGUF file (converter metadata, synthetic tokenizer) and exit, so the
    /// same file can be benchmarked with -m FILE here and loaded by other engines.
    #[arg(long, value_name = "FILE", requires = "synthetic")]
    write: Option<std::path::PathBuf>,
    /// Print the node graph of one decode tick (one session at position --ctx-start) as Graphviz DOT and exit.
    #[arg(long)]
    print_graph: bool,
    /// After the run, print which backend and kernel ran each node kind of the last (decode) tick, as `#` lines
    /// (the executor's placement report: op, weight type, expert layout, shape class, backend, kernel, nodes).
    #[arg(long)]
    placement_report: bool,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Quant matvec (decode) and matmul (prefill) GB/s on the Flash weight shapes vs measured memory bandwidth.
    Kernels(KernelsArgs),
    /// Memory read bandwidth for buffer sizes (MiB) and 1..=threads threads: the roofline every figure divides by.
    Membw(MembwArgs),
    /// KV cache: restore-from-disk vs recompute time per prefix length, cache write vs raw sequential write.
    Kv(KvArgs),
    /// Backend agreement: max |Δlogit|, argmax agreement and greedy continuation per backend pair (non-zero exit
    /// beyond tolerance).
    #[command(after_help = correctness::TOLERANCES)]
    Correctness(CorrectnessArgs),
    /// Speculative decoding's verify path: plain greedy decode vs an oracle drafter (the target's own greedy
    /// continuation, so every draft stands) at each draft length, tokens/s and speed-up in one run (non-zero exit
    /// if any speculative output differs from the plain one).
    Speculate(SpeculateArgs),
    /// Structured outputs: per-token mask and consume time (mean, p50, p99, max µs) of a JSON schema, a Lark
    /// grammar and a regex on the Flash vocabulary; with a model, also as a share of a decode tick.
    Mask(MaskArgs),
    /// CUDA kernels on the GPU (feature `cuda`): copy bandwidth, each kernel checked against the CPU on tiny and
    /// Flash shapes, µs, GB/s and the fraction of the copy bandwidth (non-zero exit on disagreement or no GPU).
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaArgs),
}

#[derive(Args, Debug)]
struct SpeculateArgs {
    #[command(flatten)]
    common: Common,
    /// A DS4 GGUF model file.
    #[arg(short = 'm', long = "model", conflicts_with = "synthetic")]
    model: Option<std::path::PathBuf>,
    /// A random-weight model built in memory (see the main --help).
    #[arg(long, default_value = "flash:layers=2:from=2")]
    synthetic: String,
    /// Draft lengths to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 3, 5])]
    drafts: Vec<usize>,
    /// The drafter: oracle (the target's own continuation), mtp (the model's MTP block) or dspark (its DSpark drafter).
    #[arg(long, value_enum, default_value = "oracle")]
    drafter: speculate::BenchDrafter,
    /// Chat prompts (repeatable), rendered with the model's template and tokenizer, in place of random token ids.
    #[arg(long = "prompt-text")]
    prompt_text: Vec<String>,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 24)]
    tokens: usize,
    /// Prompt tokens before generation.
    #[arg(long, default_value_t = 32)]
    prompt: usize,
    /// Compute backend: cpu, wgpu or cuda (cuda: a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    backend: String,
}

#[derive(Args, Debug)]
struct CorrectnessArgs {
    #[command(flatten)]
    common: Common,
    /// Comma-separated backends to compare pairwise (cpu, wgpu, cuda); `BACKEND:PLACEMENT` runs a backend with a
    /// placement (`wgpu:experts=cpu`: the MoE layers on the CPU, the rest on wgpu).
    #[arg(long, value_delimiter = ',', default_values_t = ["cpu".to_string(), "wgpu".to_string()])]
    backends: Vec<String>,
    /// A DS4 GGUF model file.
    #[arg(short = 'm', long = "model", conflicts_with = "synthetic")]
    model: Option<std::path::PathBuf>,
    /// A random-weight model built in memory (see the main --help).
    #[arg(long)]
    synthetic: Option<String>,
    /// Prompt token ids (default: 16 deterministic pseudo-random ids).
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Greedy tokens generated after the prompt.
    #[arg(long, default_value_t = 8)]
    gen: usize,
    /// Largest allowed |Δlogit| (see "Tolerances" below).
    #[arg(long, default_value_t = 0.05)]
    tol: f32,
    /// Smallest allowed fraction of prompt positions whose argmax agrees.
    #[arg(long, default_value_t = 1.0)]
    min_agree: f64,
    /// Smallest number of leading greedy tokens that must agree (default: all --gen tokens).
    #[arg(long)]
    min_greedy: Option<usize>,
    /// Exact mode on every backend (no FP8/FP4 activation simulation, f32 caches): compares the arithmetic alone,
    /// without whole-step rounding flips amplifying tiny float differences.
    #[arg(long)]
    exact: bool,
    /// CPU backend: multiply quantized weights with f32 activations (as wgpu does) instead of Q8_0/Q8_K-quantized
    /// ones, so a quantized model's comparison isolates the kernels from activation-quantization noise.
    #[arg(long)]
    f32_acts: bool,
}

#[derive(Args, Debug)]
struct MaskArgs {
    #[command(flatten)]
    common: Common,
    /// Sampled tokens per grammar.
    #[arg(long, default_value_t = 2000)]
    tokens: usize,
    /// A DS4 GGUF model file: also time its decode ticks.
    #[arg(short = 'm', long = "model", conflicts_with = "synthetic")]
    model: Option<std::path::PathBuf>,
    /// A random-weight model built in memory (see the main --help): also time its decode ticks.
    #[arg(long)]
    synthetic: Option<String>,
    /// Context before the timed decode ticks.
    #[arg(long, default_value_t = 128)]
    ctx: usize,
    /// Decode ticks timed.
    #[arg(long, default_value_t = 8)]
    decode: usize,
}

#[derive(Args, Debug)]
struct KvArgs {
    #[command(flatten)]
    common: Common,
    /// A DS4 GGUF model file.
    #[arg(short = 'm', long = "model", conflicts_with = "synthetic")]
    model: Option<std::path::PathBuf>,
    /// A random-weight model built in memory (see the main --help).
    #[arg(long, default_value = "flash:layers=2:from=2")]
    synthetic: String,
    /// Prefix lengths in tokens, ascending.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 128, 192])]
    lengths: Vec<usize>,
    /// Tokens per KV page (rounded up to a multiple of the model's largest compress ratio).
    #[arg(long, default_value_t = 128)]
    span: u32,
    /// Directory for the stores (default: a temporary directory under the system temp dir).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Rows per engine tick (prefill chunk size).
    #[arg(long, default_value_t = 256)]
    batch_tokens: usize,
    /// Also draw the report as an SVG chart to this file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<std::path::PathBuf>,
    /// Fork mode: fork a session of this many tokens (its state filled directly, no prefill) and report fork time
    /// and bytes copied next to a deep copy (see `kvbench::fork`).
    #[arg(long, value_name = "TOKENS", conflicts_with = "replay")]
    fork: Option<usize>,
    /// Tier I/O mode: the p99 decode tick of `--sessions` decoding sessions while a session of this many tokens
    /// is saved and another restored, on the decode thread and on an I/O worker (see `tierio`).
    #[arg(long, value_name = "TOKENS", conflicts_with_all = ["replay", "fork"])]
    tier_io: Option<usize>,
    /// Tier I/O mode: sessions decoding throughout.
    #[arg(long, default_value_t = 4)]
    sessions: usize,
    /// Tier I/O mode: decode ticks per phase (at least).
    #[arg(long, default_value_t = 64)]
    ticks: usize,
    /// Fork mode: compute backend, cpu or wgpu (wgpu forks the session's device-resident KV).
    #[arg(long, default_value = "cpu", requires = "fork")]
    backend: String,
    /// Replay mode: a JSONL trace of requests (`{"tokens": [ids...]}`, or a conversation `{"messages": [...],
    /// "tools": [...]}` in the OpenAI chat or Anthropic messages shape, rendered and tokenized with the model's
    /// tokenizer, per line) through the RAM + disk prefix cache; prints per request the longest common prefix with
    /// everything before, the tokens reused, and restore vs prefill time (see `kvreplay`).
    #[arg(long, value_name = "FILE.jsonl")]
    replay: Option<std::path::PathBuf>,
    /// Replay: also replay the trace a second time after a simulated restart (RAM dropped, disk kept).
    #[arg(long)]
    restart: bool,
    /// Replay: compare every request's logits with a cold prefill (doubles the prefill work).
    #[arg(long)]
    verify: bool,
    /// Replay: parked RAM sessions kept at most (LRU), as the server's `--max-parked`.
    #[arg(long, default_value_t = 256)]
    max_parked: usize,
    /// Replay: MiB of KV state the parked sessions may hold (LRU beyond), as the server's `--kv-ram-mb`
    /// (default: no bound but --max-parked).
    #[arg(long)]
    ram_mb: Option<u64>,
    /// Replay: no disk store, as the server's `--no-kv-disk` (RAM only).
    #[arg(long)]
    no_disk: bool,
    /// Replay: save a system + tools block at least this long at its end, as the server does (0: off).
    #[arg(long, default_value_t = 1024)]
    system_block_min_tokens: usize,
}

#[derive(Args, Debug)]
struct MembwArgs {
    #[command(flatten)]
    common: Common,
    /// Buffer sizes in MiB (default: 16 = in cache, and 1024 / twice the last-level cache).
    #[arg(long, value_delimiter = ',')]
    sizes_mib: Vec<u64>,
    /// Time budget per measurement in milliseconds.
    #[arg(long, default_value_t = 400)]
    budget_ms: u64,
}

#[derive(Args, Debug, Clone)]
struct Common {
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Tiny sizes for smoke tests (figures are meaningless).
    #[arg(long)]
    quick: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

impl Common {
    fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1)
    }
}

#[derive(Args, Debug)]
struct KernelsArgs {
    #[command(flatten)]
    common: Common,
    /// Weight bytes per case in MiB (default: 1024, and at least twice the last-level cache).
    #[arg(long)]
    working_set_mib: Option<u64>,
    /// Activation rows of the prefill matmul (0 skips it).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Time budget per measurement in milliseconds.
    #[arg(long, default_value_t = 400)]
    budget_ms: u64,
    /// Minimum passes per measurement.
    #[arg(long, default_value_t = 3)]
    passes: usize,
    /// Comma-separated quant types to run (q8_0,q2_k,q4_k,iq2_xxs,f16); default all.
    #[arg(long, value_delimiter = ',')]
    types: Vec<String>,
    /// Also run the secondary shapes (attention q_a/out_a/kv, shared expert, compressor, router).
    #[arg(long)]
    all_shapes: bool,
    /// Also draw the report as an SVG chart to this file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match &cli.cmd {
        None => run_throughput(&cli.run),
        Some(Cmd::Kernels(a)) => run_kernels(a),
        Some(Cmd::Membw(a)) => run_membw(a),
        Some(Cmd::Kv(a)) => run_kv(a),
        Some(Cmd::Correctness(a)) => run_correctness(a),
        Some(Cmd::Speculate(a)) => run_speculate(a),
        Some(Cmd::Mask(a)) => run_mask(a),
        #[cfg(feature = "cuda")]
        Some(Cmd::Cuda(a)) => cuda::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ds4-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
