//! `ds4-bench kv --tier-io TOKENS`: what saving and restoring long sessions costs the *other* sessions' decode
//! ticks, with the tier I/O on the decode thread (`sync`, how a server without an I/O worker behaves) and on an
//! I/O worker (`async`, what `ds4-server` does: see `ds4_server::kvdisk`).
//!
//! Set-up: a session of `TOKENS` tokens filled directly (pseudo-random rows of the model's shapes, no prefill) is
//! the one to save; a second one of `TOKENS` other tokens is saved beforehand (into two fresh stores, one per
//! phase) and is the one to restore; `--sessions` short sessions decode one token per tick throughout. Phases,
//! `--ticks` decode ticks each (timed: feed + engine step):
//! 1. `decode`: the decode ticks alone (the reference median).
//! 2. `sync`: a quarter into the phase, one tick also saves the long session (`persist::save`: snapshot, encode,
//!    write, fsync) and restores the other (`persist::restore_longest`: lookup, read, check, decode, install).
//! 3. `async`: a quarter into the phase, one tick takes the save job (`persist::SaveJob::prepare`: a snapshot
//!    sharing pages) and queues it and a restore (`persist::load_longest`) on a `ds4_kv::IoWorker`; the tick in
//!    which the restore's snapshot comes back installs it (`Engine::restore`). The phase lasts at least `--ticks`
//!    ticks and until both jobs are done.
//!
//! Report: header [`HEADER`], one row per phase: tick count, median / p99 (nearest rank) / max tick in ms,
//! `p99_over_median` against the `decode` phase's median, and `io_s` (the save + restore time: inline for
//! `sync`, from queueing to both done for `async`). The target is `async` p99 ≤ 1.5 × median. Decoding and I/O
//! share the CPU here (the worker takes a core from the decode threads); on a GPU box the decode ticks do not.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use ds4_engine::engine::Engine;
use ds4_engine::persist::{self, KvLayout, SaveJob};
use ds4_kv::{IoWorker, KvStore, SaveReason};

use crate::kvbench::filled_session;
use crate::throughput;

/// The CSV header of the tier I/O report.
pub const HEADER: &str = "mode,ticks,median_ms,p99_ms,max_ms,p99_over_median,io_s";

/// What to run.
pub struct TierIoOptions {
    /// Tokens of the saved and of the restored session.
    pub tokens: usize,
    /// Sessions decoding throughout.
    pub sessions: usize,
    /// Decode ticks per phase (at least).
    pub ticks: usize,
    /// Tokens per KV page.
    pub span: u32,
}

/// One phase's figures.
#[derive(Clone, Debug)]
pub struct TierIoRow {
    pub mode: &'static str,
    pub ticks: Vec<f64>,
    pub io_s: f64,
}

impl TierIoRow {
    /// The tick time at quantile `q` (nearest rank), in seconds.
    pub fn quantile(&self, q: f64) -> f64 {
        let mut t = self.ticks.clone();
        t.sort_by(f64::total_cmp);
        let rank = ((q * t.len() as f64).ceil() as usize).clamp(1, t.len().max(1));
        t.get(rank - 1).copied().unwrap_or(0.0)
    }
}

/// Engine context the run needs.
pub fn ctx_for(o: &TierIoOptions) -> usize {
    o.tokens.max(16 + 8 * o.ticks) + 1
}

struct Decoders {
    ids: Vec<ds4_engine::tables::SessionId>,
    token: u32,
}

impl Decoders {
    /// One decode tick: a token for every session, then engine steps until it is processed. Returns seconds.
    fn tick(&mut self, engine: &mut Engine, also: impl FnOnce(&mut Engine) -> Result<()>) -> Result<f64> {
        let t0 = Instant::now();
        for &id in &self.ids {
            engine.feed(id, &[self.token])?;
        }
        engine.run_until_idle()?;
        also(engine)?;
        self.token = self.token % 200 + 1;
        Ok(t0.elapsed().as_secs_f64())
    }
}

fn open(engine: &Engine, dir: &Path, span: u32) -> Result<KvStore> {
    let opts = persist::kv_options(engine.config(), span, u64::MAX / 4);
    Ok(persist::open_store(engine, dir, opts)?)
}

/// Runs the three phases in `dir` (two stores are made under it); writes the report to `out`.
pub fn run(engine: &mut Engine, o: &TierIoOptions, dir: &Path, out: &mut dyn Write) -> Result<Vec<TierIoRow>> {
    if ctx_for(o) > engine.ctx() {
        bail!("--tier-io {} needs an engine context of {}", o.tokens, ctx_for(o));
    }
    let vocab = engine.config().vocab;
    let history_a = throughput::prompt(o.tokens, vocab);
    let history_b: Vec<u32> = history_a.iter().map(|&t| (t + 7) % vocab as u32).collect();
    let stores = [open(engine, &dir.join("sync"), o.span)?, open(engine, &dir.join("async"), o.span)?];
    let b = filled_session(engine, &history_b, 0x51ed_270b)?;
    for store in &stores {
        persist::save(store, engine, b, SaveReason::Cold)?;
    }
    engine.free_session(b)?;
    let a = filled_session(engine, &history_a, 0x9e37_79b9)?;
    let mut dec = Decoders { ids: Vec::new(), token: 1 };
    for i in 0..o.sessions.max(1) {
        let id = engine.create_session();
        engine.feed(id, &throughput::prompt(16 + i, vocab))?;
        dec.ids.push(id);
    }
    engine.run_until_idle()?;
    let at = o.ticks / 4;
    let mut rows = Vec::new();

    let mut ticks = Vec::new();
    for _ in 0..o.ticks {
        ticks.push(dec.tick(engine, |_| Ok(()))?);
    }
    rows.push(TierIoRow { mode: "decode", ticks, io_s: 0.0 });

    let mut ticks = Vec::new();
    let mut io_s = 0.0;
    for t in 0..o.ticks {
        ticks.push(dec.tick(engine, |e| {
            if t == at {
                let t0 = Instant::now();
                persist::save(&stores[0], e, a, SaveReason::Evict)?;
                if let Some((id, _)) = persist::restore_longest(&stores[0], e, &history_b)? {
                    e.free_session(id)?;
                }
                io_s = t0.elapsed().as_secs_f64();
            }
            Ok(())
        })?);
    }
    rows.push(TierIoRow { mode: "sync", ticks, io_s });

    let io = IoWorker::start("ds4-bench-io", 4)?;
    let [sync_store, async_store] = stores;
    drop(sync_store);
    let store = std::sync::Arc::new(async_store);
    let layout = KvLayout::of(engine);
    let (tx, rx) = std::sync::mpsc::channel();
    let (saved_tx, saved_rx) = std::sync::mpsc::channel::<Instant>();
    let mut ticks = Vec::new();
    let mut started = None;
    let (mut restored, mut saved) = (None, None);
    let (mut prepare_s, mut install_s) = (0.0, 0.0);
    let mut t = 0;
    while t < o.ticks || (started.is_some() && (restored.is_none() || saved.is_none())) {
        ticks.push(dec.tick(engine, |e| {
            if t == at {
                started = Some(Instant::now());
                let job = SaveJob::prepare(&store, e, a, SaveReason::Evict, &[])?;
                prepare_s = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
                let (s, saved) = (store.clone(), saved_tx.clone());
                io.submit(Box::new(move || {
                    if let Err(err) = job.write(&s) {
                        tracing::error!(error = %err, "tier I/O bench: save failed");
                    }
                    let _ = saved.send(Instant::now());
                }));
                let (s, l, h, tx) = (store.clone(), layout.clone(), history_b.clone(), tx.clone());
                io.submit(Box::new(move || {
                    let _ = tx.send(persist::load_longest(&s, &l, &h));
                }));
            }
            if let Ok(loaded) = rx.try_recv() {
                let snap = loaded?.ok_or_else(|| anyhow::anyhow!("the saved session was not found"))?;
                let t0 = Instant::now();
                let id = e.restore(snap)?;
                install_s = t0.elapsed().as_secs_f64();
                e.free_session(id)?;
                restored = Some(Instant::now());
            }
            if let Ok(at) = saved_rx.try_recv() {
                saved = Some(at);
            }
            Ok(())
        })?);
        t += 1;
        if t > 100 * o.ticks.max(1) {
            bail!("the tier I/O jobs did not finish within {} ticks", t);
        }
    }
    let io_s = match (started, restored, saved) {
        (Some(s), Some(r), Some(w)) => (r.max(w) - s).as_secs_f64(),
        _ => 0.0,
    };
    rows.push(TierIoRow { mode: "async", ticks, io_s });
    engine.free_session(a)?;
    for id in dec.ids {
        engine.free_session(id)?;
    }

    let median = rows[0].quantile(0.5);
    writeln!(out, "{HEADER}")?;
    for r in &rows {
        let (m, p99, max) = (r.quantile(0.5), r.quantile(0.99), r.quantile(1.0));
        writeln!(
            out,
            "{},{},{:.3},{:.3},{:.3},{:.3},{:.3}",
            r.mode,
            r.ticks.len(),
            m * 1e3,
            p99 * 1e3,
            max * 1e3,
            p99 / median.max(f64::MIN_POSITIVE),
            r.io_s
        )?;
    }
    writeln!(
        out,
        "# async, on the decode thread: taking the save job {:.1} ms, installing the restored session {:.1} ms",
        prepare_s * 1e3,
        install_s * 1e3
    )?;
    let ratio = |i: usize| rows[i].quantile(0.99) / median.max(f64::MIN_POSITIVE);
    writeln!(
        out,
        "# tier I/O of a {}-token save + restore: p99 decode tick / median = {:.2} with an I/O worker (target <= 1.5), \
         {:.2} on the decode thread",
        o.tokens,
        ratio(2),
        ratio(1)
    )?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kvbench_span(engine: &Engine) -> u32 {
        let m = engine.config().compress_ratios.iter().copied().max().unwrap_or(1).max(1) as u32;
        16u32.div_ceil(m) * m
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let r = TierIoRow { mode: "x", ticks: (1..=100).map(f64::from).collect(), io_s: 0.0 };
        assert_eq!(r.quantile(0.5), 50.0);
        assert_eq!(r.quantile(0.99), 99.0);
        assert_eq!(r.quantile(1.0), 100.0);
        let one = TierIoRow { mode: "x", ticks: vec![3.0], io_s: 0.0 };
        assert_eq!(one.quantile(0.99), 3.0);
    }

    #[test]
    fn every_phase_runs_and_the_jobs_complete_on_a_tiny_model() {
        let file = ds4_engine::gguf::GgufFile::from_bytes(ds4_engine::convert::demo_model_gguf(3).unwrap()).unwrap();
        let o = TierIoOptions { tokens: 300, sessions: 2, ticks: 8, span: 16 };
        let cfg = crate::engine_api::EngineConfig {
            threads: 1,
            ctx: ctx_for(&o),
            batch_tokens: 64,
            backend: "cpu".into(),
            exact: false,
            placement: Default::default(),
        };
        let mut engine = crate::engine_api::engine_for(file, &cfg).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut out = Vec::new();
        let rows = run(&mut engine, &o, dir.path(), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(rows.iter().map(|r| r.mode).collect::<Vec<_>>(), ["decode", "sync", "async"]);
        assert!(rows.iter().all(|r| r.ticks.len() >= 8));
        assert!(rows[1].io_s > 0.0 && rows[2].io_s > 0.0);
        assert!(text.starts_with(HEADER) && text.contains("\nasync,") && text.contains("# tier I/O"));
        // The async phase's store holds the saved session (written by the worker) next to the restored one.
        let span = kvbench_span(&engine);
        let store = open(&engine, &dir.path().join("async"), span).unwrap();
        let history_a = throughput::prompt(300, engine.config().vocab);
        assert_eq!(store.longest_prefix(&history_a).matched_tokens, 300);
    }
}
