//! The MTP drafter: the model file's multi-token-prediction block (`mtp.0.*`) run as a one-layer model of its own
//! ([`Model::load_mtp`]) beside the target, drafting for many target sessions in shared ticks.
//!
//! # What it computes
//!
//! Drafter position `q` takes the token `t_q` and the target's final streams of the previous position `H[q−1]`
//! ([`crate::graph::Op::MtpInput`]), runs the block (sliding-window attention over the drafter's own earlier
//! positions, learned-routing MoE), and its head (the target's output matrix, the block's own norm and mHC head)
//! predicts `t_{q+1}` — the token the target itself would predict at `q`, but without the target having processed
//! `t_q` yet. So after the target's last position `n − 1` and the chosen next token `t_n`, the drafter at `n`
//! proposes `d₁`; fed `d₁` with its own final streams in place of the target's, it proposes `d₂`; and so on.
//!
//! # State per target session
//!
//! The drafter needs the target's final streams: [`Drafter::attach`] asks the target to keep them
//! ([`Engine::set_keep_hidden`], bounded to the last rows the block can see), and every draft call takes the new
//! ones. The block attends to a window of `W` positions only, so a drafter session that covers the last `W`
//! target positions is exact: when it has to start over (first draft, a context that diverged beyond its roll
//! back), it starts `W` positions before the draft point (RoPE scores depend on relative positions only, so the
//! offset changes nothing). Positions whose target streams are gone get zero streams: the drafts get weaker for
//! a window, the output never changes (the target verifies every draft).
//!
//! After drafting, the drafter's own speculative positions are rolled back (exact roll back), so its session
//! always covers committed tokens computed from the target's streams.

use std::collections::HashMap;

use super::Drafter;
use crate::engine::{argmax, Engine, EngineOptions};
use crate::model::Model;
use crate::tables::SessionId;
use crate::{Error, Result};

/// Options of the MTP drafter.
#[derive(Clone, Copy, Debug)]
pub struct MtpOptions {
    /// Stop drafting at a token whose drafter probability is below this (0 = always draft the full length).
    pub min_confidence: f32,
    /// CPU threads for the drafter (0 = all cores; a model file under 1 GiB always gets one).
    pub threads: usize,
}

impl Default for MtpOptions {
    fn default() -> Self {
        MtpOptions { min_confidence: 0.0, threads: 0 }
    }
}

/// One target session's drafter state.
#[derive(Debug)]
struct Track {
    /// The drafter's session, or none before the first draft / after a reset.
    session: Option<SessionId>,
    /// Target position of the drafter's position 0.
    base: usize,
    /// Target final streams of positions `rows_from..`, `hc·d` each.
    rows_from: usize,
    rows: Vec<f32>,
}

/// The MTP drafter. See the module docs.
pub struct MtpDrafter {
    engine: Engine,
    opts: MtpOptions,
    tracks: HashMap<SessionId, Track>,
    hcd: usize,
    window: usize,
    /// Draft tokens proposed with a missing target row in the drafter's window (weaker drafts).
    pub cold_positions: usize,
}

impl std::fmt::Debug for MtpDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MtpDrafter").field("opts", &self.opts).field("sessions", &self.tracks.len()).finish()
    }
}

/// Model files below this size get a one-thread drafter.
const SMALL_MODEL_BYTES: u64 = 1 << 30;

/// The longest draft a cycle asks for (bounds the drafter's roll-back log).
pub const MAX_DRAFT: usize = 16;

impl MtpDrafter {
    /// The drafter of `target`'s model file, or `None` when the file has no MTP block. It runs on the CPU.
    pub fn new(target: &Model, opts: MtpOptions) -> Result<Option<MtpDrafter>> {
        let Some(model) = target.load_mtp()? else {
            return Ok(None);
        };
        let (hcd, window) = (model.config.hc_dim(), model.config.window.max(1));
        // A small model's ops are too small to share between threads (the hand-offs cost more than they save).
        let threads = if target.file.file_size() < SMALL_MODEL_BYTES { 1 } else { opts.threads };
        let eopts = EngineOptions {
            threads,
            // The exact forward (no FP8 simulation): drafts need not match bits, and it is the reference's.
            exact: true,
            rollback: MAX_DRAFT + 2,
            ..EngineOptions::default()
        };
        let engine = Engine::from_model(model, eopts)?;
        Ok(Some(MtpDrafter { engine, opts, tracks: HashMap::new(), hcd, window, cold_positions: 0 }))
    }

    /// The options.
    pub fn options(&self) -> MtpOptions {
        self.opts
    }

    /// Sets the confidence cut-off ([`MtpOptions::min_confidence`]).
    pub fn set_min_confidence(&mut self, p: f32) {
        self.opts.min_confidence = p;
    }

    /// How many target final-stream rows a session keeps for the drafter: the block's window before the draft
    /// point, plus a draft's worth.
    pub fn rows_needed(&self) -> usize {
        self.window + MAX_DRAFT + 2
    }

    /// Drafts for several target sessions at once, sharing the drafter's ticks: one per draft position (plus one
    /// to catch up on the tokens the target committed). `reqs`: per session the context (its history and the chosen
    /// next token) and the most tokens wanted. Sessions not [`Drafter::attach`]ed get no draft.
    pub fn draft_many(&mut self, target: &mut Engine, reqs: &[(SessionId, &[u32], usize)]) -> Result<Vec<Vec<u32>>> {
        let mut out = vec![Vec::new(); reqs.len()];
        // Phase 1: bring each drafter session up to the context, the last position being the chosen token.
        let mut live: Vec<(usize, SessionId)> = Vec::new();
        for (i, &(tid, ctx, k)) in reqs.iter().enumerate() {
            if k == 0 || ctx.is_empty() || !self.tracks.contains_key(&tid) {
                continue;
            }
            self.take_rows(target, tid)?;
            if let Some(sid) = self.catch_up(tid, ctx)? {
                live.push((i, sid));
            }
        }
        if live.is_empty() {
            return Ok(out);
        }
        self.engine.run_until_idle()?;
        // Phase 2: one draft token per step for every session still drafting.
        let hcd = self.hcd;
        while !live.is_empty() {
            let mut next = Vec::with_capacity(live.len());
            for &(i, sid) in &live {
                let logits = self.engine.logits(sid)?;
                let tok = argmax(logits);
                let conf = top_probability(logits, tok);
                if conf < self.opts.min_confidence {
                    continue;
                }
                out[i].push(tok);
                if out[i].len() >= reqs[i].2.min(MAX_DRAFT) {
                    continue;
                }
                let (_, rows) = self.engine.take_hidden(sid)?;
                if rows.len() < hcd {
                    return Err(Error::Session("the MTP drafter kept no final streams".into()));
                }
                let y = rows[rows.len() - hcd..].to_vec();
                self.engine.feed_with_hidden(sid, &[tok], &y)?;
                next.push((i, sid));
            }
            if next.is_empty() {
                break;
            }
            self.engine.run_until_idle()?;
            live = next;
        }
        // Phase 3: drop the drafter's speculative positions (keep those of committed tokens).
        for &(tid, ctx, _) in reqs {
            let Some(t) = self.tracks.get(&tid) else { continue };
            let Some(sid) = t.session else { continue };
            let keep = ctx.len() - t.base;
            if self.engine.position(sid)? > keep {
                self.engine.rollback(sid, keep)?;
            }
            let _ = self.engine.take_hidden(sid)?;
        }
        Ok(out)
    }

    /// Takes the target's new final streams of session `tid` into its track (rows of positions the target rolled
    /// back and recomputed replace the old ones) and trims the track to the rows the drafter can still need.
    fn take_rows(&mut self, target: &mut Engine, tid: SessionId) -> Result<()> {
        let (from, rows) = target.take_hidden(tid)?;
        let hcd = self.hcd;
        let keep_rows = self.rows_needed();
        let t = self.tracks.get_mut(&tid).expect("attached");
        if !rows.is_empty() {
            let end = t.rows_from + t.rows.len() / hcd;
            if from < t.rows_from || from > end {
                t.rows.clear();
                t.rows_from = from;
            } else {
                t.rows.truncate((from - t.rows_from) * hcd);
            }
            t.rows.extend_from_slice(&rows);
        }
        let n = t.rows.len() / hcd;
        if n > keep_rows {
            t.rows.drain(..(n - keep_rows) * hcd);
            t.rows_from += n - keep_rows;
        }
        Ok(())
    }

    /// Makes the drafter session of `tid` cover the context (the last position is the chosen token, fed with the
    /// target's streams of the position before), restarting it where the context diverged beyond its roll back.
    /// Returns the session, with the catch-up tokens queued.
    fn catch_up(&mut self, tid: SessionId, ctx: &[u32]) -> Result<Option<SessionId>> {
        let (hcd, window) = (self.hcd, self.window);
        let l = ctx.len();
        let t = self.tracks.get_mut(&tid).expect("attached");
        // How much of the drafter's history still matches the context.
        let mut keep = 0;
        if let Some(sid) = t.session {
            let hist = self.engine.history(sid)?;
            let avail = l.saturating_sub(t.base);
            // The chosen token's position is always fed again (its logits and streams are this call's to take).
            keep = hist
                .iter()
                .zip(ctx.get(t.base..).unwrap_or(&[]))
                .take(avail.saturating_sub(1))
                .take_while(|(a, b)| a == b)
                .count();
            let pos = hist.len();
            if keep < pos {
                if self.engine.rollback_floor(sid)? <= keep && keep > 0 {
                    self.engine.rollback(sid, keep)?;
                } else {
                    self.engine.free_session(sid)?;
                    t.session = None;
                    keep = 0;
                }
            }
            // A session far behind the context restarts at the window (older positions are never seen).
            if t.session.is_some() && t.base + keep + window < l {
                if let Some(sid) = t.session.take() {
                    self.engine.free_session(sid)?;
                }
                keep = 0;
            }
        }
        let sid = match t.session {
            Some(s) => s,
            None => {
                let s = self.engine.create_session();
                self.engine.set_keep_hidden(s, 1)?;
                t.session = Some(s);
                t.base = l.saturating_sub(window);
                s
            }
        };
        let from = t.base + keep;
        let mut hidden = vec![0f32; (l - from) * hcd];
        let row_end = t.rows_from + t.rows.len() / hcd;
        for (j, q) in (from..l).enumerate() {
            if q == 0 {
                continue; // position 0 has no previous streams: zero, as in training
            }
            let p = q - 1;
            if p >= t.rows_from && p < row_end {
                let r = (p - t.rows_from) * hcd;
                hidden[j * hcd..(j + 1) * hcd].copy_from_slice(&t.rows[r..r + hcd]);
            } else {
                self.cold_positions += 1;
            }
        }
        self.engine.feed_with_hidden(sid, &ctx[from..l], &hidden)?;
        Ok(Some(sid))
    }
}

/// Softmax probability of `tok` in `logits`.
fn top_probability(logits: &[f32], tok: u32) -> f32 {
    let m = logits[tok as usize];
    let z: f32 = logits.iter().map(|&v| (v - m).exp()).sum();
    1.0 / z
}

impl Drafter for MtpDrafter {
    fn attach(&mut self, target: &mut Engine, session: SessionId) -> Result<()> {
        target.set_keep_hidden(session, self.rows_needed())?;
        self.tracks.insert(session, Track { session: None, base: 0, rows_from: 0, rows: Vec::new() });
        Ok(())
    }

    fn detach(&mut self, target: &mut Engine, session: SessionId) {
        let _ = target.set_keep_hidden(session, 0);
        if let Some(t) = self.tracks.remove(&session) {
            if let Some(sid) = t.session {
                let _ = self.engine.free_session(sid);
            }
        }
    }

    fn draft(&mut self, target: &mut Engine, session: SessionId, context: &[u32], k: usize) -> Result<Vec<u32>> {
        Ok(self.draft_many(target, &[(session, context, k)])?.pop().unwrap_or_default())
    }
}
