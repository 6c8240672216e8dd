//! `ds4 generate -m FILE --tokens 0,5,17 -n N --temperature 0 --print-ids [--exact] [--backend cpu] [--threads N]`:
//! greedy continuation of a token prompt, printed as comma-separated ids on one line.

use std::path::PathBuf;

use super::logits::{engine_options, parse_tokens};
use crate::engine::Engine;

/// Arguments of `ds4 generate` (a contract: keep stable).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The DS4 GGUF model.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Comma-separated prompt token ids.
    #[arg(long)]
    pub tokens: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 16)]
    pub n: usize,
    /// Sampling temperature (only 0 = greedy is supported for now).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Print the generated ids (comma-separated, one line).
    #[arg(long)]
    pub print_ids: bool,
    /// Prefill chunk size.
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
    /// Exact mode: no FP8/FP4 activation simulation.
    #[arg(long)]
    pub exact: bool,
    /// Backend: cpu or wgpu.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// Runs `ds4 generate`.
pub fn run(a: Args) -> anyhow::Result<i32> {
    let tokens = parse_tokens(&a.tokens)?;
    if tokens.is_empty() {
        anyhow::bail!("--tokens is empty");
    }
    if a.temperature != 0.0 {
        anyhow::bail!("only --temperature 0 (greedy) is supported by this build");
    }
    let opts = engine_options(&a.backend, a.exact, a.threads, a.chunk, 0)?;
    let mut engine = Engine::open(&a.model, opts)?;
    let s = engine.create_session();
    let t0 = std::time::Instant::now();
    let ids = engine.generate_greedy(s, &tokens, a.n)?;
    tracing::info!(generated = ids.len(), ms = t0.elapsed().as_millis() as u64, "generate done");
    let line = ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    // Without a tokenizer in this path the ids are the output either way; `--print-ids` keeps the contract.
    let _ = a.print_ids;
    println!("{line}");
    Ok(0)
}
