//! `ds4-bench speculate`: what the speculative verify path can give, side by side with plain decoding in one run.
//!
//! The drafter is the oracle ([`ds4_engine::speculative::OracleDrafter`]): it proposes the target's own greedy
//! continuation (computed by the plain run first), so every draft stands and each verify tick commits `k + 1`
//! tokens. That isolates the cost side: how much more a tick of `k + 1` rows costs than a one-row decode tick, on
//! the model's real shapes (the Flash shapes with `--synthetic flash…`), with no drafter to train. A real drafter's
//! speed-up is this one scaled by its acceptance.
//!
//! Rows (CSV): `mode,draft_len,tokens,secs,tps,speedup,cycles,mean_accepted,tick_cost` — `speedup` is plain time /
//! this time; `tick_cost` is the mean verify tick's time over the mean plain decode tick's. Every speculative run's
//! tokens are checked against the plain run's (lossless; a mismatch is an error).

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use ds4_engine::engine::Engine;
use ds4_engine::sampler::{Sampler, SamplerConfig};
use ds4_engine::speculative::OracleDrafter;
use indicatif::ProgressBar;

/// The CSV header.
pub const CSV_HEADER: &str = "mode,draft_len,tokens,secs,tps,speedup,cycles,mean_accepted,tick_cost";

/// One row of the report (what the tests read back).
#[derive(Clone, Debug)]
pub struct SpecRow {
    pub draft_len: usize,
    pub secs: f64,
    pub cycles: usize,
    pub mean_accepted: f64,
}

/// Plain greedy decoding of `tokens` tokens after `prompt`, then the oracle drafter at each of `drafts`.
pub fn run(
    engine: &mut Engine,
    prompt: &[u32],
    tokens: usize,
    drafts: &[usize],
    out: &mut dyn Write,
    pb: &ProgressBar,
) -> Result<Vec<SpecRow>> {
    if tokens < 2 {
        bail!("--tokens must be at least 2");
    }
    if drafts.contains(&0) {
        bail!("--drafts: a draft length is at least 1");
    }
    // Warm-up (first touch of weights and scratch), as the throughput run does.
    let w = engine.create_session();
    engine.generate_greedy(w, &prompt[..prompt.len().min(8)], 2)?;
    engine.free_session(w)?;

    let s = engine.create_session();
    engine.feed(s, prompt)?;
    engine.run_until_idle()?;
    let t0 = Instant::now();
    let want = engine.generate_greedy(s, &[], tokens)?;
    let plain = t0.elapsed().as_secs_f64();
    engine.free_session(s)?;
    // generate_greedy runs tokens - 1 decode ticks (the first token comes from the prompt's logits).
    let plain_tick = plain / (tokens - 1) as f64;
    writeln!(out, "{CSV_HEADER}")?;
    writeln!(out, "plain,0,{tokens},{plain:.4},{:.3},1.000,{},1.000,1.000", tokens as f64 / plain, tokens - 1)?;
    out.flush()?;
    pb.inc(1);

    let mut full = prompt.to_vec();
    full.extend_from_slice(&want);
    let mut rows = vec![SpecRow { draft_len: 0, secs: plain, cycles: tokens - 1, mean_accepted: 1.0 }];
    for &k in drafts {
        let s = engine.create_session();
        engine.feed(s, prompt)?;
        engine.run_until_idle()?;
        let mut sampler = Sampler::new(SamplerConfig::greedy())?;
        let mut oracle = OracleDrafter::new(full.clone());
        let t0 = Instant::now();
        let (got, stats) = engine.generate_speculative(s, &mut sampler, &mut oracle, k, tokens)?;
        let secs = t0.elapsed().as_secs_f64();
        engine.free_session(s)?;
        if got != want {
            bail!("draft length {k}: speculative tokens differ from plain greedy decoding (lossless check)");
        }
        let ticks = stats.cycles + stats.plain_steps;
        let tick_cost = if stats.cycles == 0 { 0.0 } else { secs / ticks as f64 / plain_tick };
        writeln!(
            out,
            "oracle,{k},{tokens},{secs:.4},{:.3},{:.3},{},{:.3},{tick_cost:.3}",
            tokens as f64 / secs,
            plain / secs,
            stats.cycles,
            stats.mean_accepted_length()
        )?;
        out.flush()?;
        pb.inc(1);
        rows.push(SpecRow { draft_len: k, secs, cycles: stats.cycles, mean_accepted: stats.mean_accepted_length() });
    }
    if let Some(best) = rows[1..].iter().min_by(|a, b| a.secs.total_cmp(&b.secs)) {
        writeln!(
            out,
            "# best: draft length {}, {:.2}x plain decode (oracle drafts; {:.2} tokens per verify tick over {} cycles)",
            best.draft_len,
            plain / best.secs,
            best.mean_accepted,
            best.cycles
        )?;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_engine::convert::{demo_config, random_model_gguf};
    use ds4_engine::engine::EngineOptions;
    use ds4_engine::gguf::GgufFile;

    #[test]
    fn oracle_runs_are_lossless_and_commit_several_tokens_per_tick() {
        let bytes = random_model_gguf(&demo_config(), 3, Vec::new()).unwrap();
        let opts = EngineOptions { threads: 2, ctx: 128, ..EngineOptions::default() };
        let mut e = Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), opts).unwrap();
        let mut out = Vec::new();
        let rows = run(&mut e, &[1, 2, 3, 4, 5], 12, &[2, 4], &mut out, &ProgressBar::hidden()).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().next(), Some(CSV_HEADER));
        assert_eq!(text.lines().count(), 5, "{text}");
        assert!(text.lines().last().unwrap().starts_with("# best: draft length "), "{text}");
        assert_eq!(rows.iter().map(|r| r.draft_len).collect::<Vec<_>>(), [0, 2, 4]);
        // 11 tokens after the first, in cycles of k + 1 whose draft is cut to fit: k = 2 commits 3 + 3 + 3 + 2
        // (4 cycles), k = 4 commits 5 + 5 and then one plain tick.
        assert_eq!(rows[1].cycles, 4, "k = 2: {rows:?}");
        assert_eq!(rows[2].cycles, 2, "k = 4: {rows:?}");
        assert_eq!(rows[1].mean_accepted, 2.75, "{rows:?}");
        assert_eq!(rows[2].mean_accepted, 5.0, "{rows:?}");
        assert!(run(&mut e, &[1, 2], 12, &[0], &mut Vec::new(), &ProgressBar::hidden()).is_err());
    }
}
