//! `ds4-bench speculate`: what the speculative verify path can give, side by side with plain decoding in one run.
//!
//! The drafter is the oracle ([`ds4_engine::speculative::OracleDrafter`]): it proposes the target's own greedy
//! continuation (computed by the plain run first), so every draft stands and each verify tick commits `k + 1`
//! tokens. That isolates the cost side: how much more a tick of `k + 1` rows costs than a one-row decode tick, on
//! the model's real shapes (the Flash shapes with `--synthetic flash…`), with no drafter to train. A real drafter's
//! speed-up is this one scaled by its acceptance.
//!
//! With `--drafter mtp` the drafts come from the model file's MTP block, with `--drafter dspark` from its DSpark
//! drafter (V4-Flash-0731) ([`AnyDrafter`]) instead: the real speed-up on a model that has one (the built-in demo
//! model is trained with an MTP block), with its acceptance.
//!
//! Rows (CSV): `mode,draft_len,tokens,secs,tps,speedup,cycles,mean_accepted,acceptance,tick_cost` — `speedup` is
//! plain time / this time; `acceptance` drafted tokens accepted / drafted; `tick_cost` is the mean tick's time
//! (verify ticks, the drafter's work included, and plain ones) over the mean plain decode tick's. Every speculative
//! run's tokens are checked against the plain run's (lossless; a mismatch is an error).

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use ds4_engine::engine::Engine;
use ds4_engine::sampler::{Sampler, SamplerConfig};
use ds4_engine::speculative::{AnyDrafter, Drafter, OracleDrafter, SpecStats};
use indicatif::ProgressBar;

/// The CSV header.
pub const CSV_HEADER: &str = "mode,draft_len,tokens,secs,tps,speedup,cycles,mean_accepted,acceptance,tick_cost";

/// Which drafter the speculative runs use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDrafter {
    /// The target's own greedy continuation: every draft stands (the verify path's best case).
    Oracle,
    /// The model file's MTP block (`mtp.0.*`).
    Mtp,
    /// The model file's DSpark drafter (V4-Flash-0731, `deepseek4.dspark.*`).
    Dspark,
}

/// One row of the report (what the tests read back).
#[derive(Clone, Debug)]
pub struct SpecRow {
    pub draft_len: usize,
    pub secs: f64,
    pub cycles: usize,
    pub mean_accepted: f64,
    pub acceptance: f64,
}

/// Plain greedy decoding of `tokens` tokens after each of `prompts`, then speculative decoding with `kind`'s
/// drafter at each of `drafts` (the same prompts; times and counters summed over them).
pub fn run(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    tokens: usize,
    drafts: &[usize],
    kind: BenchDrafter,
    out: &mut dyn Write,
    pb: &ProgressBar,
) -> Result<Vec<SpecRow>> {
    if tokens < 2 {
        bail!("--tokens must be at least 2");
    }
    if drafts.contains(&0) {
        bail!("--drafts: a draft length is at least 1");
    }
    if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
        bail!("no prompt");
    }
    let threads = engine.options().threads;
    let real = |k| AnyDrafter::require(engine.model(), k, 0.0, threads).map(Some);
    let mut real = match kind {
        BenchDrafter::Oracle => None,
        BenchDrafter::Mtp => real(ds4_engine::speculative::DrafterKind::Mtp)?,
        BenchDrafter::Dspark => real(ds4_engine::speculative::DrafterKind::Dspark)?,
    };
    // Warm-up (first touch of weights and scratch), as the throughput run does.
    let w = engine.create_session();
    engine.generate_greedy(w, &prompts[0][..prompts[0].len().min(8)], 2)?;
    engine.free_session(w)?;

    let mut want = Vec::with_capacity(prompts.len());
    let mut plain = 0.0;
    for p in prompts {
        let s = engine.create_session();
        engine.feed(s, p)?;
        engine.run_until_idle()?;
        let t0 = Instant::now();
        want.push(engine.generate_greedy(s, &[], tokens)?);
        plain += t0.elapsed().as_secs_f64();
        engine.free_session(s)?;
    }
    let n_tok = tokens * prompts.len();
    // generate_greedy runs tokens - 1 decode ticks per prompt (the first token comes from the prompt's logits).
    let plain_ticks = (tokens - 1) * prompts.len();
    let plain_tick = plain / plain_ticks as f64;
    writeln!(out, "{CSV_HEADER}")?;
    writeln!(out, "plain,0,{n_tok},{plain:.4},{:.3},1.000,{plain_ticks},1.000,,1.000", n_tok as f64 / plain)?;
    out.flush()?;
    pb.inc(1);

    let mode = match kind {
        BenchDrafter::Oracle => "oracle",
        BenchDrafter::Mtp => "mtp",
        BenchDrafter::Dspark => "dspark",
    };
    let mut rows =
        vec![SpecRow { draft_len: 0, secs: plain, cycles: plain_ticks, mean_accepted: 1.0, acceptance: 0.0 }];
    for &k in drafts {
        let mut secs = 0.0;
        let mut stats = SpecStats::default();
        for (p, want) in prompts.iter().zip(&want) {
            let s = engine.create_session();
            let mut oracle = OracleDrafter::new(p.iter().chain(want).copied().collect());
            let drafter: &mut dyn Drafter = match &mut real {
                Some(m) => m,
                None => &mut oracle,
            };
            drafter.attach(engine, s)?;
            engine.feed(s, p)?;
            engine.run_until_idle()?;
            let mut sampler = Sampler::new(SamplerConfig::greedy())?;
            let t0 = Instant::now();
            let (got, st) = engine.generate_speculative(s, &mut sampler, drafter, k, tokens)?;
            secs += t0.elapsed().as_secs_f64();
            drafter.detach(engine, s);
            engine.free_session(s)?;
            if got != *want {
                bail!("draft length {k}: speculative tokens differ from plain greedy decoding (lossless check)");
            }
            stats.cycles += st.cycles;
            stats.drafted += st.drafted;
            stats.accepted += st.accepted;
            stats.plain_steps += st.plain_steps;
        }
        let ticks = stats.cycles + stats.plain_steps;
        let tick_cost = if stats.cycles == 0 { 0.0 } else { secs / ticks as f64 / plain_tick };
        writeln!(
            out,
            "{mode},{k},{n_tok},{secs:.4},{:.3},{:.3},{},{:.3},{:.3},{tick_cost:.3}",
            n_tok as f64 / secs,
            plain / secs,
            stats.cycles,
            stats.mean_accepted_length(),
            stats.acceptance_rate()
        )?;
        out.flush()?;
        pb.inc(1);
        rows.push(SpecRow {
            draft_len: k,
            secs,
            cycles: stats.cycles,
            mean_accepted: stats.mean_accepted_length(),
            acceptance: stats.acceptance_rate(),
        });
    }
    if let Some(best) = rows[1..].iter().min_by(|a, b| a.secs.total_cmp(&b.secs)) {
        writeln!(
            out,
            "# best: draft length {}, {:.2}x plain decode ({mode} drafts; acceptance {:.2}, {:.2} tokens per verify \
             tick over {} cycles)",
            best.draft_len,
            plain / best.secs,
            best.acceptance,
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
        let rows =
            run(&mut e, &[vec![1, 2, 3, 4, 5]], 12, &[2, 4], BenchDrafter::Oracle, &mut out, &ProgressBar::hidden())
                .unwrap();
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
        assert!(run(&mut e, &[vec![1, 2]], 12, &[0], BenchDrafter::Oracle, &mut Vec::new(), &ProgressBar::hidden())
            .is_err());
        assert!(
            run(&mut e, &[vec![1, 2]], 12, &[2], BenchDrafter::Mtp, &mut Vec::new(), &ProgressBar::hidden()).is_err(),
            "no MTP block"
        );
        assert!(
            run(&mut e, &[vec![1, 2]], 12, &[2], BenchDrafter::Dspark, &mut Vec::new(), &ProgressBar::hidden())
                .is_err(),
            "no DSpark drafter"
        );
    }

    #[test]
    fn mtp_runs_are_lossless_and_report_acceptance() {
        let mut cfg = demo_config();
        cfg.n_nextn_layers = 1;
        let bytes = random_model_gguf(&cfg, 3, Vec::new()).unwrap();
        let opts = EngineOptions { threads: 2, ctx: 128, ..EngineOptions::default() };
        let mut e = Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), opts).unwrap();
        let mut out = Vec::new();
        let prompts = [vec![1, 2, 3, 4, 5], vec![9, 8, 7]];
        let rows = run(&mut e, &prompts, 10, &[1, 3], BenchDrafter::Mtp, &mut out, &ProgressBar::hidden()).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.lines().nth(2).unwrap().starts_with("mtp,1,20,"), "{text}");
        for r in &rows[1..] {
            assert!((0.0..=1.0).contains(&r.acceptance) && r.cycles > 0, "{rows:?}");
        }
    }

    #[test]
    fn dspark_runs_are_lossless_and_report_acceptance() {
        let cfg = ds4_engine::convert::demo_dspark_config();
        let bytes = random_model_gguf(&cfg, 4, Vec::new()).unwrap();
        let opts = EngineOptions { threads: 2, ctx: 128, ..EngineOptions::default() };
        let mut e = Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), opts).unwrap();
        let mut out = Vec::new();
        let rows =
            run(&mut e, &[vec![1, 2, 3, 4, 5]], 10, &[2, 4], BenchDrafter::Dspark, &mut out, &ProgressBar::hidden())
                .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.lines().nth(2).unwrap().starts_with("dspark,2,10,"), "{text}");
        for r in &rows[1..] {
            assert!((0.0..=1.0).contains(&r.acceptance) && r.cycles > 0, "{rows:?}");
        }
    }
}
