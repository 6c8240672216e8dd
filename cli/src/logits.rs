//! `ds4 logits -m FILE --tokens 0,5,17 --out PATH [--chunk N] [--exact] [--f32-acts] [--backend cpu] [--threads N]`:
//! writes the logits of every prompt position as little-endian f32 `[n_tokens, vocab]`. `--chunk N` prefills in
//! chunks of N tokens (`--chunk 1` = pure decode); results agree with one-pass prefill.

use std::io::Write;
use std::path::PathBuf;

use ds4_engine::engine::{BackendKind, Engine, EngineOptions};

/// Arguments of `ds4 logits` (a contract: keep stable).
#[derive(clap::Args, Debug)]
pub struct LogitsArgs {
    /// The DS4 GGUF model.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long)]
    pub tokens: String,
    /// Output file (little-endian f32, `[n_tokens, vocab]`).
    #[arg(long)]
    pub out: PathBuf,
    /// Prefill chunk size (tokens per tick).
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
    /// Exact mode: no FP8/FP4 activation simulation.
    #[arg(long)]
    pub exact: bool,
    /// CPU backend: multiply quantized weights by f32 activations instead of Q8_0/Q8_K-quantized ones (slower; the
    /// products the wgpu kernels compute, for cross-backend checks).
    #[arg(long)]
    pub f32_acts: bool,
    /// Backend: cpu, wgpu or cuda (cuda: a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Where groups of ops run besides --backend: `experts=cpu` runs every MoE layer's experts on the CPU and the
    /// rest on the GPU backend (a model bigger than GPU memory); `default`: everything on --backend.
    #[arg(long, default_value = "default")]
    pub placement: ds4_engine::exec::Placement,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// Parses `"0,5,17"` into token ids.
pub fn parse_tokens(s: &str) -> anyhow::Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().map_err(|e| anyhow::anyhow!("bad token id {t:?} in --tokens: {e}")))
        .collect()
}

/// Engine options shared by `logits` and `generate`.
pub fn engine_options(
    backend: &str,
    exact: bool,
    threads: usize,
    chunk: usize,
    ctx: usize,
) -> anyhow::Result<EngineOptions> {
    if chunk == 0 {
        anyhow::bail!("--chunk must be > 0");
    }
    Ok(EngineOptions {
        backend: backend.parse::<BackendKind>()?,
        exact,
        threads,
        ctx,
        max_batch_tokens: chunk,
        ..EngineOptions::default()
    })
}

/// Runs `ds4 logits`.
pub fn run(a: LogitsArgs) -> anyhow::Result<i32> {
    let tokens = parse_tokens(&a.tokens)?;
    if tokens.is_empty() {
        anyhow::bail!("--tokens is empty");
    }
    let opts = EngineOptions {
        prefill_logits: true,
        f32_acts: a.f32_acts,
        placement: a.placement,
        ..engine_options(&a.backend, a.exact, a.threads, a.chunk, 0)?
    };
    let mut engine = Engine::open(&a.model, opts)?;
    let s = engine.create_session();
    engine.feed(s, &tokens)?;
    engine.run_until_idle()?;
    let logits = engine.take_all_logits(s)?;
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&a.out).map_err(|e| anyhow::anyhow!("{}: {e}", a.out.display()))?,
    );
    for v in &logits {
        out.write_all(&v.to_le_bytes())?;
    }
    out.flush()?;
    tracing::info!(rows = tokens.len(), vocab = engine.config().vocab, out = %a.out.display(), "logits written");
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("0,5, 17").unwrap(), vec![0, 5, 17]);
        assert!(parse_tokens("1,x").is_err());
        assert!(parse_tokens("-1").is_err());
    }
}
