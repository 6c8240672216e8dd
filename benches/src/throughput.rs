//! The default `ds4-bench` run: prefill and decode throughput over growing context frontiers, in the reference
//! engine's table shape `ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes`.
//!
//! For each frontier `ctx_start, ctx_start + step, ... <= ctx_max`: the session is prefilled from the previous
//! frontier to this one (`prefill_tokens` = the difference, timed), snapshotted, and `sessions` copies of the
//! snapshot decode `gen_tokens` greedy tokens each, all copies in the same engine ticks (continuous batching), so
//! `gen_tps` is the aggregate decode rate. The prefilled session itself is untouched by decoding and goes on to
//! the next frontier. `kvcache_bytes` is the engine's KV state at the frontier (f32 values × 4) summed over the
//! decoding sessions. Prompt tokens are deterministic pseudo-random ids (what they are does not change the work).
//!
//! Prefill and decode ticks run with the engine's op timing on ([`Engine::time_ops`]), so each row also says
//! where a tick's time went ([`ThroughputRow::prefill_ops_line`], [`ThroughputRow::decode_ops_line`]). Rows are flushed as they are
//! produced, so an interrupted sweep keeps its rows.
//!
//! Warm-up, as `llama-bench` does (and the peer script's llama.cpp side, `benches/peer/llama-timing.c`): before
//! the first frontier a throwaway session prefills the prompt's first [`WARMUP_TOKENS`] tokens and decodes one
//! token, then is freed, so the timed runs do not pay the first touch of the weights' pages (memory-mapped) and
//! of the engine's scratch buffers. Nothing of it stays in the engine (no KV, no cached prefix).

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use ds4_engine::engine::{argmax, Engine};
use indicatif::ProgressBar;

use crate::blocks::SplitMix64;

/// The CSV header (the reference engine's).
pub const CSV_HEADER: &str = "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes";

/// Sweep options.
#[derive(Clone, Debug)]
pub struct ThroughputOptions {
    pub ctx_start: usize,
    pub ctx_max: usize,
    /// Frontier increment (0: only `ctx_start`).
    pub step: usize,
    pub gen_tokens: usize,
    /// Concurrent decoding sessions.
    pub sessions: usize,
}

impl ThroughputOptions {
    /// The frontiers visited.
    pub fn frontiers(&self) -> Result<Vec<usize>> {
        if self.ctx_start == 0 {
            bail!("--ctx-start must be at least 1");
        }
        if self.ctx_max < self.ctx_start {
            bail!("--ctx-max {} is below --ctx-start {}", self.ctx_max, self.ctx_start);
        }
        if self.sessions == 0 {
            bail!("--sessions must be at least 1");
        }
        if self.step == 0 {
            return Ok(vec![self.ctx_start]);
        }
        Ok((self.ctx_start..=self.ctx_max).step_by(self.step).collect())
    }

    /// The context the engine must allow per session.
    pub fn ctx_needed(&self) -> usize {
        self.ctx_max + self.gen_tokens + 1
    }
}

/// One row of the table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThroughputRow {
    pub ctx_tokens: usize,
    pub prefill_tokens: usize,
    pub prefill_tps: f64,
    pub gen_tokens: usize,
    pub gen_tps: f64,
    pub kvcache_bytes: u64,
    /// Where the prefill ticks' time went, per op kind (summed over the frontier's prefill ticks).
    pub prefill_ops: Option<ds4_engine::exec::OpTimes>,
    /// Where the decode ticks' time went, per op kind (summed over the `gen_tokens` ticks).
    pub decode_ops: Option<ds4_engine::exec::OpTimes>,
}

impl ThroughputRow {
    /// `attention 7.10 ms (38 %), logits ...`: decode time per tick by op kind, largest first (empty when not
    /// timed).
    pub fn decode_ops_line(&self) -> String {
        ops_line(self.decode_ops.as_ref())
    }

    /// The same for the frontier's prefill ticks (time per tick; a tick is up to the engine's batch of tokens).
    pub fn prefill_ops_line(&self) -> String {
        ops_line(self.prefill_ops.as_ref())
    }
}

impl ThroughputRow {
    /// The CSV line matching [`CSV_HEADER`].
    pub fn csv(&self) -> String {
        format!(
            "{},{},{:.2},{},{:.2},{}",
            self.ctx_tokens, self.prefill_tokens, self.prefill_tps, self.gen_tokens, self.gen_tps, self.kvcache_bytes
        )
    }
}

/// `kind ms-per-tick (share %)` for each op kind that ran, largest first.
fn ops_line(t: Option<&ds4_engine::exec::OpTimes>) -> String {
    let Some(t) = t else { return String::new() };
    let (ticks, total) = (t.runs.max(1) as f64, t.total().as_secs_f64().max(1e-12));
    t.ranked()
        .iter()
        .map(|(k, d)| format!("{k} {:.2} ms ({:.0} %)", d.as_secs_f64() * 1e3 / ticks, 100.0 * d.as_secs_f64() / total))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Prompt tokens of the untimed warm-up (see the module docs).
pub const WARMUP_TOKENS: usize = 16;

/// The untimed warm-up: a throwaway session prefills `tokens`, decodes one token and is freed.
fn warm_up(engine: &mut Engine, tokens: &[u32]) -> Result<()> {
    if tokens.is_empty() {
        return Ok(());
    }
    let s = engine.create_session();
    engine.feed(s, tokens)?;
    engine.run_until_idle()?;
    let next = argmax(engine.logits(s)?);
    engine.feed(s, &[next])?;
    engine.run_until_idle()?;
    engine.free_session(s)?;
    Ok(())
}

/// Deterministic pseudo-random prompt of `n` token ids below `vocab`.
pub fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = SplitMix64::new(0x70_6b);
    (0..n).map(|_| (rng.next_u64() % vocab.max(1) as u64) as u32).collect()
}

/// Runs the sweep on `engine`, writing the header and one flushed row per frontier to `out`.
pub fn run(
    engine: &mut Engine,
    opts: &ThroughputOptions,
    out: &mut dyn Write,
    pb: &ProgressBar,
) -> Result<Vec<ThroughputRow>> {
    let frontiers = opts.frontiers()?;
    if opts.ctx_needed() > engine.ctx() {
        bail!(
            "--ctx-max {} + --gen-tokens {} exceed the engine context {}",
            opts.ctx_max,
            opts.gen_tokens,
            engine.ctx()
        );
    }
    let last = *frontiers.last().unwrap_or(&opts.ctx_start);
    let tokens = prompt(last, engine.config().vocab);
    pb.set_length((last + frontiers.len() * opts.gen_tokens * opts.sessions) as u64);
    writeln!(out, "{CSV_HEADER}")?;
    out.flush()?;
    warm_up(engine, &tokens[..tokens.len().min(WARMUP_TOKENS)])?;
    let main = engine.create_session();
    let mut rows = Vec::with_capacity(frontiers.len());
    let mut prev = 0usize;
    for &frontier in &frontiers {
        pb.set_message(format!("prefill to {frontier}"));
        engine.feed(main, &tokens[prev..frontier])?;
        engine.time_ops(true);
        let t0 = Instant::now();
        let mut done = engine.position(main)?;
        while engine.step()? {
            let now = engine.position(main)?;
            pb.inc((now - done) as u64);
            done = now;
        }
        let prefill_secs = t0.elapsed().as_secs_f64();
        let prefill_ops = engine.take_op_times();
        engine.time_ops(false);
        let snap = engine.snapshot(main)?;
        let kv_bytes = snap.kv.n_values() as u64 * 4;

        pb.set_message(format!("decode {} x {} at {frontier}", opts.sessions, opts.gen_tokens));
        let ids = (0..opts.sessions).map(|_| engine.restore(snap.clone())).collect::<ds4_engine::Result<Vec<_>>>()?;
        let mut next: Vec<u32> =
            ids.iter().map(|&s| engine.logits(s).map(argmax)).collect::<ds4_engine::Result<_>>()?;
        engine.time_ops(true);
        let t0 = Instant::now();
        for _ in 0..opts.gen_tokens {
            for (&s, &t) in ids.iter().zip(&next) {
                engine.feed(s, &[t])?;
            }
            engine.run_until_idle()?;
            for (n, &s) in next.iter_mut().zip(&ids) {
                *n = argmax(engine.logits(s)?);
            }
            pb.inc(opts.sessions as u64);
        }
        let gen_secs = t0.elapsed().as_secs_f64();
        let decode_ops = engine.take_op_times();
        engine.time_ops(false);
        for s in ids {
            engine.free_session(s)?;
        }
        let row = ThroughputRow {
            ctx_tokens: frontier,
            prefill_tokens: frontier - prev,
            prefill_tps: (frontier - prev) as f64 / prefill_secs.max(1e-9),
            gen_tokens: opts.gen_tokens,
            gen_tps: (opts.gen_tokens * opts.sessions) as f64 / gen_secs.max(1e-9),
            kvcache_bytes: kv_bytes * opts.sessions as u64,
            prefill_ops,
            decode_ops,
        };
        writeln!(out, "{}", row.csv())?;
        out.flush()?;
        rows.push(row);
        prev = frontier;
    }
    engine.free_session(main)?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(start: usize, max: usize, step: usize) -> ThroughputOptions {
        ThroughputOptions { ctx_start: start, ctx_max: max, step, gen_tokens: 2, sessions: 1 }
    }

    #[test]
    fn frontiers_step_up_to_the_max() {
        assert_eq!(opts(64, 256, 64).frontiers().unwrap(), vec![64, 128, 192, 256]);
        assert_eq!(opts(64, 250, 64).frontiers().unwrap(), vec![64, 128, 192]);
        assert_eq!(opts(64, 1000, 0).frontiers().unwrap(), vec![64]);
        assert!(opts(0, 10, 1).frontiers().is_err());
        assert!(opts(64, 32, 1).frontiers().is_err());
        assert!(ThroughputOptions { sessions: 0, ..opts(1, 1, 1) }.frontiers().is_err());
    }

    #[test]
    fn prompt_is_deterministic_and_in_vocab() {
        let a = prompt(500, 100);
        assert_eq!(a, prompt(500, 100));
        assert!(a.iter().all(|&t| t < 100));
        assert!(a.iter().any(|&t| t != a[0]));
    }

    #[test]
    fn sweep_on_a_tiny_synthetic_model() {
        let spec = crate::synth::Spec::parse("tiny:layers=3:recipe=f16").unwrap();
        let o = ThroughputOptions { ctx_start: 8, ctx_max: 24, step: 8, gen_tokens: 2, sessions: 2 };
        let mut engine = crate::engine_api::engine_for(
            crate::synth::build(&spec, 2, &ProgressBar::hidden()).unwrap().file,
            &crate::engine_api::EngineConfig {
                threads: 2,
                ctx: o.ctx_needed(),
                batch_tokens: 16,
                backend: "cpu".into(),
                exact: false,
                placement: Default::default(),
            },
        )
        .unwrap();
        let mut out = Vec::new();
        let rows = run(&mut engine, &o, &mut out, &ProgressBar::hidden()).unwrap();
        assert_eq!(rows.iter().map(|r| r.ctx_tokens).collect::<Vec<_>>(), vec![8, 16, 24]);
        assert_eq!(rows.iter().map(|r| r.prefill_tokens).sum::<usize>(), 24);
        // Compressed layers (ratios 4 and 8) add rows as the context grows; two sessions hold two copies.
        assert!(rows.windows(2).all(|w| w[1].kvcache_bytes > w[0].kvcache_bytes), "{rows:?}");
        assert!(rows.iter().all(|r| r.gen_tokens == 2 && r.gen_tps > 0.0 && r.prefill_tps > 0.0));
        // Each row's decode ticks were timed: 2 ticks (both sessions share a tick), every op kind of a decode
        // tick present: per layer one sparse attention and one routing, over 3 layers.
        for r in &rows {
            let t = r.decode_ops.expect("decode ticks timed");
            assert_eq!(t.runs, 2, "{t:?}");
            let k = |op: ds4_engine::graph::Op| t.calls[op.kind()];
            assert_eq!(k(ds4_engine::graph::Op::SparseAttention { layer: 0 }), 6);
            assert_eq!(k(ds4_engine::graph::Op::SwiGlu { layer: 0 }), 6);
            assert_eq!(k(ds4_engine::graph::Op::Logits), 2);
            let line = r.decode_ops_line();
            assert!(
                line.contains("sparse_attention ") && line.contains("expert_up ") && line.contains(" ms ("),
                "{line}"
            );
        }
        // Prefill: 8 tokens per frontier in ticks of up to 16 rows, one tick each.
        for r in &rows {
            let t = r.prefill_ops.expect("prefill ticks timed");
            assert_eq!(t.runs, 1, "{t:?}");
            assert!(r.prefill_ops_line().starts_with(|c: char| c.is_ascii_lowercase()), "{}", r.prefill_ops_line());
        }
        assert!(engine.take_op_times().is_none(), "timing is switched off after the sweep");
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().next(), Some(CSV_HEADER));
        assert_eq!(text.lines().count(), 4);
        // Context overflow is refused up front.
        let big = ThroughputOptions { ctx_max: 10_000, ..o };
        assert!(run(&mut engine, &big, &mut Vec::new(), &ProgressBar::hidden()).is_err());
    }

    #[test]
    fn warm_up_leaves_nothing_behind() {
        let spec = crate::synth::Spec::parse("tiny:layers=2:recipe=f16").unwrap();
        let cfg = crate::engine_api::EngineConfig {
            threads: 1,
            ctx: 64,
            batch_tokens: 16,
            backend: "cpu".into(),
            exact: false,
            placement: Default::default(),
        };
        let file = crate::synth::build(&spec, 1, &ProgressBar::hidden()).unwrap().file;
        let mut engine = crate::engine_api::engine_for(file, &cfg).unwrap();
        let tokens = prompt(WARMUP_TOKENS, engine.config().vocab);
        let fresh = engine.create_session();
        engine.free_session(fresh).unwrap();
        warm_up(&mut engine, &tokens).unwrap();
        assert_eq!(engine.page_pool().live_pages(), 0, "the warm-up's KV pages are released");
        assert!(!engine.has_pending());
        // Its session slot is free again: the next session reuses it, at position 0.
        let next = engine.create_session();
        assert_eq!(next.slot, fresh.slot);
        assert_eq!(engine.position(next).unwrap(), 0);
    }

    #[test]
    fn csv_line_has_the_header_fields() {
        let r = ThroughputRow {
            ctx_tokens: 8,
            prefill_tokens: 8,
            prefill_tps: 1.5,
            gen_tokens: 2,
            gen_tps: 0.25,
            kvcache_bytes: 9,
            prefill_ops: None,
            decode_ops: None,
        };
        assert_eq!(r.csv(), "8,8,1.50,2,0.25,9");
        assert_eq!(r.decode_ops_line(), "");
        assert_eq!(r.csv().split(',').count(), CSV_HEADER.split(',').count());
    }
}
