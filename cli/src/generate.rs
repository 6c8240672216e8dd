//! `ds4 generate -m FILE --tokens 0,5,17 -n N --temperature 0 --print-ids [--exact] [--f32-acts] [--backend cpu]
//! [--threads N] [--speculative off|mtp|dspark|auto --draft-len K]`:
//! continuation of a token prompt (greedy at temperature 0, else sampled with [`ds4_engine::sampler::Sampler`]), printed
//! as comma-separated ids on one line.

use std::path::PathBuf;

use super::logits::{engine_options, parse_tokens};
use ds4_engine::engine::{Engine, EngineOptions};
use ds4_engine::sampler::{Sampler, SamplerConfig};

/// Arguments of `ds4 generate` (a contract: keep stable).
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// The DS4 GGUF model.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Comma-separated prompt token ids.
    #[arg(long)]
    pub tokens: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 16)]
    pub n: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely ids when sampling (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the generated ids (comma-separated, one line).
    #[arg(long)]
    pub print_ids: bool,
    /// Prefill chunk size.
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
    /// Speculative decoding with one of the model's drafters: off, mtp, dspark or auto (the file's drafter, paused
    /// while its drafts do not pay for their measured cost); the same ids either way; the counters are logged.
    #[arg(long, default_value = "off")]
    pub speculative: crate::run::SpecChoice,
    /// Drafted tokens per verify run at most.
    #[arg(long = "draft-len", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub draft_len: u64,
}

/// Runs `ds4 generate`.
pub fn run(a: GenerateArgs) -> anyhow::Result<i32> {
    let tokens = parse_tokens(&a.tokens)?;
    if tokens.is_empty() {
        anyhow::bail!("--tokens is empty");
    }
    let cfg = SamplerConfig {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        ..Default::default()
    };
    let mut sampler = Sampler::new(cfg)?;
    let opts = EngineOptions {
        f32_acts: a.f32_acts,
        placement: a.placement,
        ..engine_options(&a.backend, a.exact, a.threads, a.chunk, 0)?
    };
    let mut engine = Engine::open(&a.model, opts)?;
    let s = engine.create_session();
    let t0 = std::time::Instant::now();
    let drafter = crate::run::drafter_for(&engine, a.speculative, a.threads)?;
    let ids = if let Some(mut d) = drafter {
        use ds4_engine::speculative::Drafter;
        d.attach(&mut engine, s)?;
        engine.feed(s, &tokens)?;
        engine.run_until_idle()?;
        let k = a.draft_len as usize;
        let (ids, st) = if a.speculative == crate::run::SpecChoice::Auto {
            // `auto`: drafting pauses while its measured cost exceeds what the drafts deliver.
            let mut pace = Default::default();
            engine.generate_speculative_auto(s, &mut sampler, &mut d, k, a.n, &mut pace)?
        } else {
            engine.generate_speculative(s, &mut sampler, &mut d, k, a.n)?
        };
        tracing::info!(
            cycles = st.cycles,
            drafted = st.drafted,
            accepted = st.accepted,
            acceptance = format!("{:.2}", st.acceptance_rate()),
            paused = st.paused,
            "speculative decoding"
        );
        ids
    } else if a.temperature == 0.0 {
        engine.generate_greedy(s, &tokens, a.n)?
    } else {
        engine.feed(s, &tokens)?;
        engine.run_until_idle()?;
        let mut ids = Vec::with_capacity(a.n);
        for i in 0..a.n {
            let t = sampler.sample(engine.logits(s)?)?;
            sampler.accept(t);
            ids.push(t);
            if i + 1 < a.n {
                engine.feed(s, &[t])?;
                engine.run_until_idle()?;
            }
        }
        ids
    };
    tracing::info!(generated = ids.len(), ms = t0.elapsed().as_millis() as u64, "generate done");
    let line = ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    // Without a tokenizer in this path the ids are the output either way; `--print-ids` keeps the contract.
    let _ = a.print_ids;
    println!("{line}");
    Ok(0)
}
