//! `ds4-bench kv --replay FILE.jsonl`: replays a trace of requests through the prefix cache the server uses —
//! parked RAM sessions (forked and rolled back exactly, [`Engine::rollback`]) and the disk store
//! (`ds4_engine::persist`: pages, checkpoints, restore points) — and reports per request how much of it could be
//! reused and how much was.
//!
//! Per request (one JSON object per line: `{"tokens": [ids...]}`):
//! 1. `lcp`: the longest common prefix with every request seen before (including those of an earlier pass);
//! 2. lookup: the parked session with the longest usable common prefix (`min(lcp, len − 1)` when it is within that
//!    session's roll-back reach, or the whole session when the request extends it) versus the disk store's longest
//!    checkpointed prefix of `tokens[..len − 1]` — the larger wins; RAM: fork + roll back, disk: restore
//!    (`restore_s`, timed); `reused` = tokens whose state came from the cache;
//! 3. prefill of the rest (`prefill_s`, timed; `recomputed` tokens);
//! 4. with `verify`, a cold prefill of the whole request in a fresh session: `exact` = the logits are bit-identical;
//! 5. the session is parked (LRU beyond `max_parked`, evicted sessions are saved to disk) and saved to the store
//!    (a checkpoint at its end and a restore point at the page boundary below, as the server's save triggers do).
//!
//! `passes = 2` replays the trace again after a simulated restart: every parked session is dropped from RAM (saved
//! first, like a shutdown), the store is reopened on the same directory, and the second pass starts with an empty
//! RAM tier. CSV header [`CSV_HEADER`].

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_engine::engine::Engine;
use ds4_engine::persist;
use ds4_engine::tables::SessionId;
use ds4_kv::{KvStore, SaveReason};

/// The CSV header of a replay.
pub const CSV_HEADER: &str = "pass,request,tokens,lcp,reused,tier,recomputed,restore_s,prefill_s,exact";

/// One request's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayRow {
    pub pass: usize,
    pub request: usize,
    pub tokens: usize,
    /// Longest common prefix with everything replayed before.
    pub lcp: usize,
    pub reused: usize,
    /// `ram`, `disk` or `none`.
    pub tier: &'static str,
    pub restore_s: f64,
    pub prefill_s: f64,
    /// Logits bit-identical to a cold prefill (`None` without `verify`).
    pub exact: Option<bool>,
}

impl ReplayRow {
    /// The CSV line matching [`CSV_HEADER`].
    pub fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{:.4},{:.4},{}",
            self.pass,
            self.request,
            self.tokens,
            self.lcp,
            self.reused,
            self.tier,
            self.tokens - self.reused,
            self.restore_s,
            self.prefill_s,
            self.exact.map_or("-".to_string(), |e| e.to_string())
        )
    }
}

/// Options of a replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Tokens per KV page.
    pub span: u32,
    /// Store directory (used as is; a restart pass reopens it).
    pub dir: PathBuf,
    /// Parked RAM sessions kept (LRU).
    pub max_parked: usize,
    /// 1, or 2 for a second pass after a simulated restart.
    pub passes: usize,
    /// Compare every request's logits with a cold prefill.
    pub verify: bool,
}

/// Parses a JSONL trace: one `{"tokens": [...]}` object per non-empty line. Errors name the line.
pub fn parse_trace(text: &str, vocab: usize) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("trace line {}", i + 1))?;
        let Some(arr) = v.get("tokens").and_then(|t| t.as_array()) else {
            bail!("trace line {}: expected an object with a \"tokens\" array of token ids", i + 1);
        };
        let mut toks = Vec::with_capacity(arr.len());
        for t in arr {
            match t.as_u64() {
                Some(t) if (t as usize) < vocab => toks.push(t as u32),
                _ => bail!("trace line {}: {t} is not a token id below the vocabulary size {vocab}", i + 1),
            }
        }
        if toks.is_empty() {
            bail!("trace line {}: empty request", i + 1);
        }
        out.push(toks);
    }
    Ok(out)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

struct Parked {
    id: SessionId,
    tokens: Vec<u32>,
    last_used: u64,
}

/// The replay's cache: parked sessions and the store.
struct Cache {
    parked: Vec<Parked>,
    store: KvStore,
    clock: u64,
}

impl Cache {
    /// The best parked session for `req`: `(index, usable tokens)`.
    fn best_ram(&self, engine: &Engine, req: &[u32]) -> Option<(usize, usize)> {
        self.parked
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let lcp = common_prefix(&p.tokens, req);
                let n = if lcp == p.tokens.len() && lcp < req.len() {
                    lcp
                } else {
                    let n = lcp.min(req.len() - 1);
                    if engine.rollback_floor(p.id).ok()? > n {
                        return None;
                    }
                    n
                };
                (n > 0).then_some((i, n, p.last_used))
            })
            .max_by_key(|&(_, n, t)| (n, t))
            .map(|(i, n, _)| (i, n))
    }

    /// The store's longest checkpointed prefix of `req` as a new session, with logits whenever it covers all of
    /// `req` (a restore point holds none: then one token less).
    fn disk_restore(&self, engine: &mut Engine, req: &[u32]) -> Result<Option<(SessionId, usize)>> {
        let r = persist::restore_longest(&self.store, engine, req)?;
        if let Some((id, n)) = r {
            if n == req.len() && engine.logits(id).is_err() {
                engine.free_session(id)?;
                return Ok(persist::restore_longest(&self.store, engine, &req[..req.len() - 1])?);
            }
        }
        Ok(r)
    }

    fn save(&self, engine: &Engine, id: SessionId, reason: SaveReason) -> Result<()> {
        if engine.position(id)? > 0 {
            persist::save(&self.store, engine, id, reason)?;
        }
        Ok(())
    }

    fn park(&mut self, engine: &mut Engine, id: SessionId, tokens: Vec<u32>, max_parked: usize) -> Result<()> {
        self.clock += 1;
        self.parked.push(Parked { id, tokens, last_used: self.clock });
        while self.parked.len() > max_parked {
            let lru = (0..self.parked.len()).min_by_key(|&i| self.parked[i].last_used).unwrap_or(0);
            let p = self.parked.swap_remove(lru);
            self.save(engine, p.id, SaveReason::Evict)?;
            engine.free_session(p.id)?;
        }
        Ok(())
    }

    /// Drops every parked session (saved first, like a shutdown).
    fn drop_all(&mut self, engine: &mut Engine) -> Result<()> {
        for p in std::mem::take(&mut self.parked) {
            self.save(engine, p.id, SaveReason::Shutdown)?;
            engine.free_session(p.id)?;
        }
        Ok(())
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Replays `requests` on `engine` (see the module docs), writing CSV lines to `out`.
pub fn replay(
    engine: &mut Engine,
    requests: &[Vec<u32>],
    opts: &ReplayOptions,
    out: &mut dyn Write,
) -> Result<Vec<ReplayRow>> {
    if opts.passes == 0 || opts.passes > 2 {
        bail!("passes must be 1 or 2");
    }
    if let Some(r) = requests.iter().find(|r| r.len() + 1 > engine.ctx()) {
        bail!("a request of {} tokens does not fit the engine context {}", r.len(), engine.ctx());
    }
    let kv_opts = persist::kv_options(engine, opts.span, u64::MAX / 4);
    std::fs::create_dir_all(&opts.dir).with_context(|| format!("creating {}", opts.dir.display()))?;
    let mut cache =
        Cache { parked: Vec::new(), store: persist::open_store(engine, &opts.dir, kv_opts.clone())?, clock: 0 };
    writeln!(out, "{CSV_HEADER}")?;
    let mut seen: Vec<&[u32]> = Vec::new();
    let mut rows = Vec::new();
    for pass in 1..=opts.passes {
        if pass > 1 {
            cache.drop_all(engine)?;
            // A restart: the store is reopened from its directory.
            cache.store = persist::open_store(engine, &opts.dir, kv_opts.clone())?;
        }
        for (ri, req) in requests.iter().enumerate() {
            let lcp = seen.iter().map(|s| common_prefix(s, req)).max().unwrap_or(0);
            let t0 = Instant::now();
            let ram = cache.best_ram(engine, req);
            let ram_n = ram.map_or(0, |(_, n)| n);
            let probe = cache.store.longest_prefix(req);
            let disk_n = if probe.checkpoint.is_some() { probe.matched_tokens } else { 0 };
            let disk = if disk_n > ram_n { cache.disk_restore(engine, req)? } else { None };
            let (id, reused, tier) = if let Some((id, n)) = disk.filter(|&(_, n)| n > ram_n) {
                (id, n, "disk")
            } else if let Some((i, n)) = ram {
                if let Some((d, _)) = disk {
                    engine.free_session(d)?;
                }
                let snap = engine.snapshot(cache.parked[i].id)?;
                let id = engine.restore(snap)?;
                if n < engine.position(id)? {
                    engine.rollback(id, n)?;
                }
                cache.clock += 1;
                cache.parked[i].last_used = cache.clock;
                (id, n, "ram")
            } else {
                (engine.create_session(), 0, "none")
            };
            let restore_s = t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            engine.feed(id, &req[reused..])?;
            engine.run_until_idle()?;
            let prefill_s = t0.elapsed().as_secs_f64();
            let exact = if opts.verify {
                let c = engine.create_session();
                engine.feed(c, req)?;
                engine.run_until_idle()?;
                let same = bits(engine.logits(c)?) == bits(engine.logits(id)?);
                engine.free_session(c)?;
                Some(same)
            } else {
                None
            };
            cache.save(engine, id, SaveReason::Continued)?;
            cache.park(engine, id, req.clone(), opts.max_parked)?;
            let row =
                ReplayRow { pass, request: ri, tokens: req.len(), lcp, reused, tier, restore_s, prefill_s, exact };
            writeln!(out, "{}", row.csv())?;
            out.flush()?;
            rows.push(row);
            seen.push(req);
        }
    }
    cache.drop_all(engine)?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::ProgressBar;

    fn ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % vocab as u64) as u32
            })
            .collect()
    }

    fn cat(parts: &[&[u32]]) -> Vec<u32> {
        parts.iter().flat_map(|p| p.iter().copied()).collect()
    }

    /// Agent-shaped traces over token ids: a shared system/tools prompt, a title request beside the agent
    /// request, re-rendered tails, several conversations on one system prompt, an edited earlier message.
    fn agent_trace(vocab: usize) -> Vec<Vec<u32>> {
        let sys = ids(1, 260, vocab);
        let (u1, a1, u2, a2, u3) =
            (ids(2, 40, vocab), ids(3, 30, vocab), ids(4, 25, vocab), ids(5, 20, vocab), ids(6, 15, vocab));
        let open = ids(7, 3, vocab); // the assistant-turn opening a prompt ends with
        let closed = ids(8, 2, vocab); // how the next turn re-renders the finished assistant turn
        let title = ids(9, 12, vocab);
        let t1 = cat(&[&sys, &u1, &open]);
        let t2 = cat(&[&sys, &u1, &closed, &a1, &u2, &open]);
        let t3 = cat(&[&sys, &u1, &closed, &a1, &u2, &closed, &a2, &u3, &open]);
        let mut u2_edited = u2.clone();
        u2_edited[10] = (u2_edited[10] + 1) % vocab as u32;
        let t3_edit = cat(&[&sys, &u1, &closed, &a1, &u2_edited, &open]);
        let b1 = cat(&[&sys, &ids(10, 35, vocab), &open]);
        let b2 = cat(&[&b1, &ids(11, 20, vocab), &ids(12, 18, vocab), &open]);
        let c1 = cat(&[&sys, &ids(13, 22, vocab), &open]);
        vec![t1.clone(), cat(&[&title, &u1, &open]), t2, b1, t3, t3_edit, b2, c1]
    }

    #[test]
    fn agent_traces_reuse_their_common_prefix_in_ram_and_after_a_restart_with_exact_logits() {
        let spec = crate::synth::Spec::parse("tiny:layers=3:recipe=f16").unwrap();
        let file = crate::synth::build(&spec, 2, &ProgressBar::hidden()).unwrap().file;
        let cfg = crate::engine_api::EngineConfig {
            threads: 2,
            ctx: 1024,
            batch_tokens: 64,
            backend: "cpu".into(),
            exact: false,
        };
        let mut engine = crate::engine_api::engine_for(file, &cfg).unwrap();
        let trace = agent_trace(engine.config().vocab);
        let text: String = trace.iter().map(|t| format!("{}\n", serde_json::json!({ "tokens": t }))).collect();
        assert_eq!(parse_trace(&text, engine.config().vocab).unwrap(), trace);
        let tmp = tempfile::tempdir().unwrap();
        let span = 16;
        let opts = ReplayOptions { span, dir: tmp.path().join("kv"), max_parked: 4, passes: 2, verify: true };
        let mut out = Vec::new();
        let rows = replay(&mut engine, &trace, &opts, &mut out).unwrap();
        assert_eq!(rows.len(), 2 * trace.len());
        for r in &rows {
            assert_eq!(r.exact, Some(true), "logits differ from a cold prefill: {r:?}");
            assert!(r.reused + span as usize >= r.lcp, "reused less than the common prefix minus a page: {r:?}");
            assert!(r.reused <= r.lcp, "{r:?}");
        }
        // The first pass reuses from RAM (the edited message and the re-rendered tails by roll back) ...
        let first: Vec<_> = rows.iter().filter(|r| r.pass == 1).collect();
        assert_eq!(first[0].tier, "none");
        assert!(first[2..].iter().all(|r| r.tier == "ram" && r.reused + 1 >= r.lcp), "{first:?}");
        // ... the second (after the restart) from disk first, everything seen before.
        let second: Vec<_> = rows.iter().filter(|r| r.pass == 2).collect();
        assert_eq!(second[0].tier, "disk");
        assert!(second.iter().all(|r| r.lcp == r.tokens));
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().next(), Some(CSV_HEADER));
        assert_eq!(text.lines().count(), rows.len() + 1);
        // Bad traces are clear errors.
        assert!(parse_trace("{\"tokens\": [1, 2]}\n{\"text\": \"x\"}", 100)
            .unwrap_err()
            .to_string()
            .contains("line 2"));
        assert!(parse_trace("{\"tokens\": [1, 200]}", 100).is_err());
        assert!(parse_trace("{\"tokens\": []}", 100).is_err());
    }
}
