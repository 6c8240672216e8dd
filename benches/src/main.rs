//! `ds4-bench`: throughput, kernel bandwidth, KV restore and cross-backend correctness, every figure next to what
//! the hardware allows.
//!
//! Subcommands (each report starts with a `#`-prefixed machine summary, then CSV on stdout; progress on stderr):
//! - `kernels`: quant matvec/matmul GB/s on the real Flash shapes vs measured memory bandwidth ([`kernels`]).
//! - `membw`: the bandwidth roofline alone, per buffer size and thread count ([`membw`]).
//!
//! Every run is short by default (seconds); flags make it longer. `--quick` shrinks everything for smoke tests.

mod blocks;
mod engine_api;
mod kernels;
mod machine;
mod membw;
mod par;
mod progress;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "ds4-bench",
    version,
    about = "ds4 benchmarks: every figure as a fraction of what the hardware allows"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Quant matvec (decode) and matmul (prefill) GB/s on the Flash weight shapes vs measured memory bandwidth.
    Kernels(KernelsArgs),
    /// Memory read bandwidth for buffer sizes (MiB) and 1..=threads threads: the roofline every figure divides by.
    Membw(MembwArgs),
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
}

fn run_kernels(a: &KernelsArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    let quick = a.common.quick;
    let opts = kernels::Options {
        threads,
        working_set: if quick {
            4 << 20
        } else {
            a.working_set_mib.map(|m| m << 20).unwrap_or_else(|| kernels::default_working_set(m.llc_bytes))
        },
        batch: if quick { a.batch.min(4) } else { a.batch },
        budget: if quick { Duration::ZERO } else { Duration::from_millis(a.budget_ms) },
        min_passes: if quick { 1 } else { a.passes.max(1) },
        types: a.types.iter().map(|t| kernels::parse_type(t)).collect::<Result<_>>()?,
        all_shapes: a.all_shapes,
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary("cpu (ds4_engine::quant, std scoped threads)", threads))?;
    writeln!(out, "# working set per case: {} MiB", opts.working_set >> 20)?;
    let pb = progress::bar(0, a.common.quiet);
    kernels::run(&engine_api::EngineKernels, &opts, &mut out, &pb)?;
    pb.finish_and_clear();
    Ok(())
}

fn run_membw(a: &MembwArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    let sizes: Vec<usize> = if a.common.quick {
        vec![1 << 20, 4 << 20]
    } else if a.sizes_mib.is_empty() {
        vec![16 << 20, kernels::default_working_set(m.llc_bytes) as usize]
    } else {
        a.sizes_mib.iter().map(|&s| (s.max(1) << 20) as usize).collect()
    };
    let budget = if a.common.quick { Duration::ZERO } else { Duration::from_millis(a.budget_ms) };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary("cpu (std scoped threads, streaming read)", threads))?;
    let pb = progress::bar(0, a.common.quiet);
    membw::sweep(&sizes, threads, if a.common.quick { 1 } else { 3 }, budget, &mut out, &pb)?;
    pb.finish_and_clear();
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Kernels(a) => run_kernels(a),
        Cmd::Membw(a) => run_membw(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ds4-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
