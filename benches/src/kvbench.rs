//! `ds4-bench kv`: for cached prefixes of growing length, the time to restore a session from the `ds4-kv` disk
//! store versus recomputing it (prefill), and the store's write throughput versus a raw sequential write of the
//! same bytes to the same disk.
//!
//! Per prefix length `L` (prompt: the same deterministic pseudo-random ids as the throughput sweep):
//! 1. recompute: a fresh session prefills `L` tokens (timed), its snapshot is the reference;
//! 2. write: the session is saved into an empty store directory (pages + checkpoint, `ds4_engine::persist::save`;
//!    timed; `kv_file_bytes` = bytes of the files written, including the store's fsyncs);
//! 3. restore: `ds4_engine::persist::restore_longest` — lookup, streamed checksummed loads, `Engine::restore`
//!    (timed); `exact` says whether the restored session's state equals the reference bit for bit;
//! 4. raw: the same byte count written to one file in the same directory and fsynced (timed).
//!
//! CSV header [`CSV_HEADER`]; `speedup` = recompute / restore, `write_fraction` = cache write GB/s / raw GB/s.
//!
//! `--fork N` ([`fork`]): a session of `N` tokens whose state is filled directly (pseudo-random rows of the
//! model's shapes, no prefill, so 32k tokens of Flash shapes take seconds) is forked with `Engine::fork`; reported
//! (header [`FORK_HEADER`]): the session's KV bytes, the fork's time and bytes copied (`Engine::kv_bytes_copied`),
//! the pages it shares, the bytes the first decode step of the fork copies (copy on write of the shared partial
//! pages and roll-back log chunks), and for comparison the time and bytes of a deep copy of the rows and rings
//! (what fork = snapshot + restore copied before pages; the roll-back log, which it also copied, not included).
//! On a device-resident backend (`--backend wgpu`) the session is filled with `N − 1` tokens and decodes one, so
//! its KV is on the device when it is forked (a device fork: shared device pages, `Engine::device_kv_pages`); the
//! deep copy is then the host copy of the rows read back through the fork's page tables.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_engine::engine::Engine;
use ds4_engine::persist;
use ds4_kv::SaveReason;
use indicatif::ProgressBar;

use crate::throughput;

/// The CSV header of the kv report.
pub const CSV_HEADER: &str =
    "prefix_tokens,kv_file_bytes,recompute_s,restore_s,speedup,cache_write_gbs,raw_write_gbs,write_fraction,exact";

/// The CSV header of the fork report.
pub const FORK_HEADER: &str =
    "tokens,kv_bytes,fork_s,fork_bytes_copied,shared_pages,first_append_bytes_copied,deep_copy_s,deep_copy_bytes";

/// Forks a directly filled session of `tokens` tokens (see the module docs); writes one CSV line.
pub fn fork(engine: &mut Engine, tokens: usize, out: &mut dyn Write) -> Result<()> {
    if tokens < 2 || tokens + 1 > engine.ctx() {
        bail!("--fork {tokens} does not fit the engine context {}", engine.ctx());
    }
    // A device-resident backend gets the state on the device by decoding the last token.
    let device = engine.device_kv_pages().is_some();
    let (filled, decoded) = if device { (tokens - 1, 1) } else { (tokens, 0) };
    let prompt = throughput::prompt(tokens, engine.config().vocab);
    let id = filled_session(engine, &prompt[..filled], 0x9e37_79b9)?;
    if decoded > 0 {
        engine.feed(id, &prompt[filled..])?;
        engine.run_until_idle()?;
    }
    let kv_bytes = engine.kv_bytes(id)?;

    let before = engine.kv_bytes_copied();
    let t0 = Instant::now();
    let f = engine.fork(id)?;
    let fork_s = t0.elapsed().as_secs_f64();
    let fork_bytes = engine.kv_bytes_copied() - before;
    let device_shared = engine.device_kv_pages().map(|(_, shared)| shared);
    let snap = engine.snapshot(f)?;
    let host_shared = || snap.kv.layers.iter().map(|l| l.comp_rows.shared_pages() + l.idx_rows.shared_pages()).sum();
    let shared: usize = device_shared.unwrap_or_else(host_shared);

    let t0 = Instant::now();
    let deep: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        snap.kv.layers.iter().map(|l| (l.comp_rows.to_vec(), l.idx_rows.to_vec(), l.ring.clone())).collect();
    let deep_copy_s = t0.elapsed().as_secs_f64();
    let deep_bytes: usize = deep.iter().map(|(a, b, c)| (a.len() + b.len() + c.len()) * 4).sum();
    drop(deep);
    drop(snap);

    let before = engine.kv_bytes_copied();
    engine.feed(f, &[1])?;
    engine.run_until_idle()?;
    let append_bytes = engine.kv_bytes_copied() - before;
    engine.free_session(f)?;
    engine.free_session(id)?;
    writeln!(out, "{FORK_HEADER}")?;
    writeln!(
        out,
        "{tokens},{kv_bytes},{fork_s:.6},{fork_bytes},{shared},{append_bytes},{deep_copy_s:.6},{deep_bytes}"
    )?;
    Ok(())
}

/// A session holding `history` whose state is filled directly (pseudo-random rows of the model's shapes from
/// `seed`, no prefill: 64k tokens of Flash shapes take seconds); its logits are zeros.
pub fn filled_session(engine: &mut Engine, history: &[u32], seed: u32) -> Result<ds4_engine::tables::SessionId> {
    let cfg = engine.config().clone();
    let filled = history.len();
    let mut kv = ds4_engine::tables::SessionKv::new_in(&cfg, filled, engine.page_pool());
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    };
    for (l, lk) in kv.layers.iter_mut().enumerate() {
        lk.ring.iter_mut().for_each(|v| *v = next() * 0.1);
        if let Some(rows) = filled.checked_div(cfg.compress_ratios[l]) {
            for t in [&mut lk.comp_rows, &mut lk.idx_rows] {
                let mut row = vec![0f32; t.width()];
                for _ in 0..if t.width() > 0 { rows } else { 0 } {
                    row.iter_mut().for_each(|v| *v = next() * 0.1);
                    t.push(&row);
                }
            }
        }
        for f in [&mut lk.comp, &mut lk.idx].into_iter().flatten() {
            f.n_pending = filled % f.ratio;
            f.has_prev = f.coff == 2 && filled >= f.ratio;
        }
    }
    let logits = vec![0f32; cfg.vocab];
    let snap = ds4_engine::tables::SessionSnapshot { pos: filled, history: history.to_vec(), kv, logits };
    Ok(engine.restore(snap)?)
}

/// One row.
#[derive(Clone, Copy, Debug)]
pub struct KvRow {
    pub prefix_tokens: usize,
    pub kv_file_bytes: u64,
    pub recompute_s: f64,
    pub restore_s: f64,
    pub write_s: f64,
    pub raw_write_s: f64,
    pub exact: bool,
}

impl KvRow {
    /// The CSV line matching [`CSV_HEADER`].
    pub fn csv(&self) -> String {
        let gbs = |s: f64| self.kv_file_bytes as f64 / s.max(1e-9) / 1e9;
        format!(
            "{},{},{:.4},{:.4},{:.2},{:.3},{:.3},{:.3},{}",
            self.prefix_tokens,
            self.kv_file_bytes,
            self.recompute_s,
            self.restore_s,
            self.recompute_s / self.restore_s.max(1e-9),
            gbs(self.write_s),
            gbs(self.raw_write_s),
            self.raw_write_s / self.write_s.max(1e-9),
            self.exact
        )
    }
}

/// Options of a kv run.
#[derive(Clone, Debug)]
pub struct KvBenchOptions {
    /// Prefix lengths, ascending.
    pub lengths: Vec<usize>,
    /// Tokens per page (a multiple of the model's largest compress ratio).
    pub span: u32,
    /// Directory the stores and raw files go in (one fresh subdirectory per length, removed afterwards).
    pub dir: std::path::PathBuf,
}

/// Bytes of the regular files under `dir` (one level).
fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut n = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let m = e?.metadata()?;
        if m.is_file() {
            n += m.len();
        }
    }
    Ok(n)
}

/// Writes `bytes` bytes to `path` in 8 MiB chunks and fsyncs; returns seconds.
fn raw_write(path: &Path, bytes: u64) -> Result<f64> {
    let chunk = vec![0x5au8; 8 << 20];
    let t0 = Instant::now();
    let mut f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(t0.elapsed().as_secs_f64())
}

/// The span to use for a model: `want` rounded up to a multiple of the largest compress ratio.
pub fn span_for(max_ratio: usize, want: u32) -> u32 {
    let m = max_ratio.max(1) as u32;
    want.div_ceil(m).max(1) * m
}

/// Runs the kv benchmark on `engine`.
pub fn run(engine: &mut Engine, opts: &KvBenchOptions, out: &mut dyn Write, pb: &ProgressBar) -> Result<Vec<KvRow>> {
    if opts.lengths.is_empty() || opts.lengths.windows(2).any(|w| w[0] >= w[1]) || opts.lengths[0] == 0 {
        bail!("--lengths must be ascending and positive");
    }
    let max = *opts.lengths.last().unwrap_or(&0);
    if max + 1 > engine.ctx() {
        bail!("prefix {max} does not fit the engine context {}", engine.ctx());
    }
    let cfg = engine.config().clone();
    let max_ratio = cfg.compress_ratios.iter().copied().max().unwrap_or(0);
    if !(opts.span as usize).is_multiple_of(max_ratio.max(1)) {
        bail!("span {} is not a multiple of the largest compress ratio {max_ratio}", opts.span);
    }
    let tokens = throughput::prompt(max, cfg.vocab);
    pb.set_length(opts.lengths.iter().map(|&l| l as u64).sum());
    writeln!(out, "{CSV_HEADER}")?;
    out.flush()?;
    let kv_opts = persist::kv_options(engine.config(), opts.span, u64::MAX / 4);
    let mut rows = Vec::new();
    for (i, &len) in opts.lengths.iter().enumerate() {
        pb.set_message(format!("recompute {len}"));
        let s = engine.create_session();
        engine.feed(s, &tokens[..len])?;
        let t0 = Instant::now();
        engine.run_until_idle()?;
        let recompute_s = t0.elapsed().as_secs_f64();
        let reference = engine.snapshot(s)?;

        pb.set_message(format!("write {len}"));
        let dir = opts.dir.join(format!("kv-{i}-{len}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let store = persist::open_store(engine, &dir, kv_opts.clone())?;
        let t0 = Instant::now();
        persist::save(&store, engine, s, SaveReason::Cold)?;
        let write_s = t0.elapsed().as_secs_f64();
        engine.free_session(s)?;
        let kv_file_bytes = dir_bytes(&dir)?;

        pb.set_message(format!("restore {len}"));
        let t0 = Instant::now();
        let (id, matched) =
            persist::restore_longest(&store, engine, &tokens[..len])?.context("the store returned no checkpoint")?;
        let restore_s = t0.elapsed().as_secs_f64();
        let exact = matched == len && engine.snapshot(id)? == reference;
        engine.free_session(id)?;
        drop(store);

        let raw = dir.join("raw-sequential.bin");
        let raw_write_s = raw_write(&raw, kv_file_bytes)?;
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;

        let row = KvRow { prefix_tokens: len, kv_file_bytes, recompute_s, restore_s, write_s, raw_write_s, exact };
        writeln!(out, "{}", row.csv())?;
        out.flush()?;
        rows.push(row);
        pb.inc(len as u64);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_round_up_to_the_largest_ratio() {
        assert_eq!(span_for(128, 256), 256);
        assert_eq!(span_for(128, 200), 256);
        assert_eq!(span_for(8, 8), 8);
        assert_eq!(span_for(0, 5), 5);
    }

    #[test]
    fn save_and_restore_round_trip_on_a_tiny_model() {
        let spec = crate::synth::Spec::parse("tiny:layers=3:recipe=f16").unwrap();
        let file = crate::synth::build(&spec, 2, &ProgressBar::hidden()).unwrap().file;
        let cfg = crate::engine_api::EngineConfig {
            threads: 2,
            ctx: 64,
            batch_tokens: 16,
            backend: "cpu".into(),
            exact: false,
            placement: Default::default(),
        };
        let mut engine = crate::engine_api::engine_for(file, &cfg).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        // Lengths inside one span, on a span boundary and across spans with a tail (ratios 4 and 8, span 8).
        let opts = KvBenchOptions { lengths: vec![5, 16, 27], span: 8, dir: tmp.path().to_path_buf() };
        let mut out = Vec::new();
        let rows = run(&mut engine, &opts, &mut out, &ProgressBar::hidden()).unwrap();
        assert_eq!(rows.len(), 3);
        for r in &rows {
            assert!(r.exact, "restored state differs at {}", r.prefix_tokens);
            assert!(r.kv_file_bytes > 0);
        }
        let mut fout = Vec::new();
        fork(&mut engine, 60, &mut fout).unwrap();
        let ftext = String::from_utf8(fout).unwrap();
        assert_eq!(ftext.lines().next(), Some(FORK_HEADER));
        let v: Vec<f64> = ftext.lines().nth(1).unwrap().split(',').map(|x| x.parse().unwrap()).collect();
        // The fork copies its tail, shares the (partial) pages, and its first step copies the shared partial pages.
        assert!(v[3] > 0.0 && v[4] > 0.0 && v[5] > 0.0 && v[7] > 0.0, "{ftext}");
        assert_eq!(engine.page_pool().live_pages(), 0, "the benchmark's sessions were released");
        assert!(rows[2].kv_file_bytes > rows[0].kv_file_bytes);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().next(), Some(CSV_HEADER));
        for l in text.lines().skip(1) {
            assert_eq!(l.split(',').count(), CSV_HEADER.split(',').count());
        }
        // The work directories are cleaned up.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        // Bad options are errors.
        let bad = KvBenchOptions { lengths: vec![8, 4], ..opts.clone() };
        assert!(run(&mut engine, &bad, &mut Vec::new(), &ProgressBar::hidden()).is_err());
        let bad = KvBenchOptions { span: 6, ..opts };
        assert!(run(&mut engine, &bad, &mut Vec::new(), &ProgressBar::hidden()).is_err());
    }

    #[test]
    fn fork_on_wgpu_shares_the_device_pages() {
        if ds4_engine::backend::wgpu::context::test_context(Default::default()).is_none() {
            return;
        }
        let spec = crate::synth::Spec::parse("tiny:layers=3:recipe=f16").unwrap();
        let file = crate::synth::build(&spec, 2, &ProgressBar::hidden()).unwrap().file;
        let cfg = crate::engine_api::EngineConfig {
            threads: 2,
            ctx: 1024,
            batch_tokens: 16,
            backend: "wgpu".into(),
            exact: false,
            placement: Default::default(),
        };
        let mut engine = crate::engine_api::engine_for(file, &cfg).unwrap();
        let mut out = Vec::new();
        fork(&mut engine, 600, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let v: Vec<f64> = text.lines().nth(1).unwrap().split(',').map(|x| x.parse().unwrap()).collect();
        // Two full 256-token pages and a partial one per table are shared; the fork copies only its tail.
        assert!(v[3] > 0.0 && v[4] >= 6.0 && v[7] > 0.0, "{text}");
        assert_eq!(engine.device_kv_pages(), Some((0, 0)), "the benchmark's sessions released their device pages");
    }

    #[test]
    fn restored_session_decodes_like_the_original() {
        let spec = crate::synth::Spec::parse("tiny:layers=3:recipe=f16").unwrap();
        let file = crate::synth::build(&spec, 2, &ProgressBar::hidden()).unwrap().file;
        let cfg = crate::engine_api::EngineConfig {
            threads: 2,
            ctx: 64,
            batch_tokens: 16,
            backend: "cpu".into(),
            exact: false,
            placement: Default::default(),
        };
        let mut engine = crate::engine_api::engine_for(file, &cfg).unwrap();
        let mcfg = engine.config().clone();
        let tokens = throughput::prompt(21, mcfg.vocab);
        let s = engine.create_session();
        engine.feed(s, &tokens).unwrap();
        engine.run_until_idle().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let store =
            persist::open_store(&engine, tmp.path(), persist::kv_options(engine.config(), 8, u64::MAX / 4)).unwrap();
        let saved = persist::save(&store, &engine, s, SaveReason::Cold).unwrap();
        assert_eq!((saved.pages, saved.pages_written, saved.position), (2, 2, 21));
        let (r, matched) = persist::restore_longest(&store, &mut engine, &tokens).unwrap().unwrap();
        assert_eq!(matched, 21);
        let a = engine.generate_greedy(s, &[], 3).unwrap();
        let b = engine.generate_greedy(r, &[], 3).unwrap();
        assert_eq!(a, b);
        assert_eq!(engine.logits(s).unwrap(), engine.logits(r).unwrap());
        // A prompt that diverges in its first token restores nothing.
        let mut other = tokens.clone();
        other[0] = (other[0] + 1) % mcfg.vocab as u32;
        assert!(persist::restore_longest(&store, &mut engine, &other).unwrap().is_none());
    }
}
