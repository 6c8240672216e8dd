//! Speculative decoding: a drafter proposes the next few tokens, the target model checks all of them in one tick,
//! and every token that comes out is distributed exactly as plain decoding would produce it.
//!
//! # One cycle
//!
//! A session has processed `history` and holds the logits of its last position. The caller has chosen the next
//! token `first` from them (sampled as usual; not yet fed). A [`Drafter`] proposes `d₁ … d_k` to follow it. Then
//! [`Engine::verify_drafts`]:
//!
//! 1. feeds `first, d₁ … d_k` as one run with every position's logits kept: `k + 1` rows in one tick, batched with
//!    whatever else is queued (plain decode sessions, other sessions' cycles) — the verify tick;
//! 2. walks the draft: row `i` (the logits after `d_i`, row 0 after `first`) judges `d_{i+1}` with
//!    [`Sampler::verify_drafted`] (temperature 0: accept while the argmax matches; otherwise accept with the
//!    target's probability and on rejection draw from the rest), so each emitted token has the target's
//!    distribution given everything before it;
//! 3. with `j` drafts accepted, rolls the session back to `history + first + d₁ … d_j` with the engine's exact
//!    roll back ([`Engine::rollback`]: the KV state becomes that of a cold prefill of the kept tokens, nothing is
//!    replayed) and gives it row `j` as its logits; the token drawn from row `j` (the rejection's replacement, or a
//!    fresh draw when all `k` stood) is the next cycle's `first`.
//!
//! A cycle commits `j + 1` tokens for one tick whose cost grows slowly with `k` (decode is weight-bandwidth bound:
//! `k + 1` rows read each weight once). Whether that pays depends on the acceptance rate; `ds4-bench speculate`
//! measures the verify path on the Flash shapes with an oracle drafter ([`OracleDrafter`], the drafts are the
//! target's own greedy continuation: the best case).
//!
//! # Guarantees
//!
//! - Lossless: at temperature 0 the output is token for token the plain greedy output, and with sampling the
//!   output distribution is the plain one (the standard speculative-sampling argument; checked in
//!   [`crate::sampler`]'s tests and this module's).
//! - Batched: sessions with and without drafts share ticks; each session's tokens and logits are those it would
//!   get alone (the engine's results do not depend on how rows are batched or chunked).
//! - Exact state: after a cycle the session is indistinguishable from one that decoded its committed tokens one
//!   by one (the roll back is exact; where a draft is longer than the roll-back log reaches, the session is
//!   truncated and recomputed instead, with the same result).

pub mod auto;
pub mod dspark;
pub mod mtp;
#[cfg(test)]
mod mtp_tests;
#[cfg(test)]
mod tests;

pub use dspark::{DsparkDrafter, DsparkOptions, Proposal};
pub use mtp::{MtpDrafter, MtpOptions};

use crate::engine::Engine;
use crate::sampler::{Sampler, Verdict};
use crate::tables::SessionId;
use crate::{Error, Result};

/// Proposes the tokens most likely to follow a context.
pub trait Drafter {
    /// Called for a target session before its prompt is fed: a drafter that reads the target's state (the MTP
    /// block reads its final streams) asks for it here.
    fn attach(&mut self, _target: &mut Engine, _session: SessionId) -> Result<()> {
        Ok(())
    }

    /// The session is done (its drafter state is dropped).
    fn detach(&mut self, _target: &mut Engine, _session: SessionId) {}

    /// Up to `k` tokens to follow `context` (target session `session`'s history and the chosen next token).
    /// Fewer (or none) when the drafter has nothing it trusts.
    fn draft(&mut self, target: &mut Engine, session: SessionId, context: &[u32], k: usize) -> Result<Vec<u32>>;
}

/// Which drafter of the model file ([`AnyDrafter::load`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrafterKind {
    /// The April release's MTP block (`mtp.0.*`).
    Mtp,
    /// The 0731 release's DSpark drafter (`deepseek4.dspark.*`).
    Dspark,
    /// The MTP block where the file has one, else the DSpark drafter where it has one.
    Any,
}

/// One of the model file's drafters, behind one face for schedulers (the server, `ds4 run/chat`).
#[derive(Debug)]
pub enum AnyDrafter {
    Mtp(Box<MtpDrafter>),
    Dspark(Box<DsparkDrafter>),
}

impl AnyDrafter {
    /// The drafter of `kind` in `target`'s file (`None` when it has none), with a confidence cut-off and CPU
    /// threads (0: all cores).
    pub fn load(
        target: &crate::model::Model,
        kind: DrafterKind,
        min_confidence: f32,
        threads: usize,
    ) -> Result<Option<Self>> {
        let mtp = || {
            MtpDrafter::new(target, MtpOptions { min_confidence, threads })
                .map(|d| d.map(|d| AnyDrafter::Mtp(Box::new(d))))
        };
        let dspark = || {
            DsparkDrafter::new(target, DsparkOptions { min_confidence, threads })
                .map(|d| d.map(|d| AnyDrafter::Dspark(Box::new(d))))
        };
        match kind {
            DrafterKind::Mtp => mtp(),
            DrafterKind::Dspark => dspark(),
            DrafterKind::Any => match mtp()? {
                Some(d) => Ok(Some(d)),
                None => dspark(),
            },
        }
    }

    /// [`AnyDrafter::load`] for a caller that needs the drafter: a missing one is an error naming what the file
    /// lacks.
    pub fn require(
        target: &crate::model::Model,
        kind: DrafterKind,
        min_confidence: f32,
        threads: usize,
    ) -> Result<Self> {
        Self::load(target, kind, min_confidence, threads)?.ok_or_else(|| {
            crate::Error::InvalidArgument(
                match kind {
                    DrafterKind::Mtp => "the model file has no MTP block (mtp.0.*)",
                    DrafterKind::Dspark => {
                        "the model file has no DSpark drafter (deepseek4.dspark.*, mtp.0.main_proj: a V4-Flash-0731 \
                         conversion has one)"
                    }
                    DrafterKind::Any => "the model file has no drafter (an MTP block or a DSpark drafter)",
                }
                .into(),
            )
        })
    }

    /// Whether `target`'s file holds a drafter of `kind`.
    pub fn present(target: &crate::model::Model, kind: DrafterKind) -> bool {
        let (m, d) = (target.has_mtp(), crate::model::DsparkModel::present(target));
        match kind {
            DrafterKind::Mtp => m,
            DrafterKind::Dspark => d,
            DrafterKind::Any => m || d,
        }
    }

    /// `"mtp"` or `"dspark"`.
    pub fn name(&self) -> &'static str {
        match self {
            AnyDrafter::Mtp(_) => "mtp",
            AnyDrafter::Dspark(_) => "dspark",
        }
    }

    /// Drafts for several sessions at once (see [`MtpDrafter::draft_many`], [`DsparkDrafter::draft_many`]).
    pub fn draft_many(&mut self, target: &mut Engine, reqs: &[(SessionId, &[u32], usize)]) -> Result<Vec<Vec<u32>>> {
        match self {
            AnyDrafter::Mtp(d) => d.draft_many(target, reqs),
            AnyDrafter::Dspark(d) => d.draft_many(target, reqs),
        }
    }

    /// Sets the confidence cut-off.
    pub fn set_min_confidence(&mut self, p: f32) {
        match self {
            AnyDrafter::Mtp(d) => d.set_min_confidence(p),
            AnyDrafter::Dspark(d) => d.set_min_confidence(p),
        }
    }
}

impl Drafter for AnyDrafter {
    fn attach(&mut self, target: &mut Engine, session: SessionId) -> Result<()> {
        match self {
            AnyDrafter::Mtp(d) => d.attach(target, session),
            AnyDrafter::Dspark(d) => d.attach(target, session),
        }
    }

    fn detach(&mut self, target: &mut Engine, session: SessionId) {
        match self {
            AnyDrafter::Mtp(d) => d.detach(target, session),
            AnyDrafter::Dspark(d) => d.detach(target, session),
        }
    }

    fn draft(&mut self, target: &mut Engine, session: SessionId, context: &[u32], k: usize) -> Result<Vec<u32>> {
        match self {
            AnyDrafter::Mtp(d) => d.draft(target, session, context, k),
            AnyDrafter::Dspark(d) => d.draft(target, session, context, k),
        }
    }
}

/// The oracle drafter: proposes a known continuation (the target's own greedy output, computed beforehand), so
/// every draft is accepted under greedy decoding. It measures the best speed-up the verify path can give.
#[derive(Clone, Debug)]
pub struct OracleDrafter {
    tokens: Vec<u32>,
}

impl OracleDrafter {
    /// An oracle for contexts that are prefixes of `tokens` (prompt and continuation).
    pub fn new(tokens: Vec<u32>) -> Self {
        OracleDrafter { tokens }
    }
}

impl OracleDrafter {
    /// The known continuation of `context` (up to `k` tokens; none when `context` is not a prefix).
    pub fn continuation(&self, context: &[u32], k: usize) -> Vec<u32> {
        if context.len() > self.tokens.len() || self.tokens[..context.len()] != *context {
            return Vec::new();
        }
        let end = (context.len() + k).min(self.tokens.len());
        self.tokens[context.len()..end].to_vec()
    }
}

impl Drafter for OracleDrafter {
    fn draft(&mut self, _target: &mut Engine, _session: SessionId, context: &[u32], k: usize) -> Result<Vec<u32>> {
        Ok(self.continuation(context, k))
    }
}

/// One session's cycle for [`Engine::verify_drafts`].
#[derive(Debug)]
pub struct Cycle<'a> {
    pub session: SessionId,
    /// The token already chosen from the session's current logits (not yet fed; already passed to
    /// [`Sampler::accept`]).
    pub first: u32,
    /// The drafted tokens to follow `first`.
    pub draft: &'a [u32],
    /// The session's sampler: judges the drafts and draws the replacement or bonus token.
    pub sampler: &'a mut Sampler,
}

/// What a cycle committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    /// Drafted tokens that stood (a prefix of the draft).
    pub accepted: usize,
    /// The token drawn from the logits after the last kept token: the next cycle's `first` (not fed; not yet
    /// passed to [`Sampler::accept`]).
    pub next: u32,
}

/// Counters of a speculative run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Verify ticks run (cycles with a non-empty draft).
    pub cycles: usize,
    /// Tokens drafted in those cycles.
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
    /// Plain decode ticks (no draft offered).
    pub plain_steps: usize,
    /// Times `auto` paused drafting ([`Engine::generate_speculative_auto`]).
    pub paused: usize,
}

impl SpecStats {
    /// Accepted / drafted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens committed per verify tick: accepted drafts plus the cycle's own token (0 without cycles).
    pub fn mean_accepted_length(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            (self.accepted + self.cycles) as f64 / self.cycles as f64
        }
    }
}

impl Engine {
    /// Runs one speculative cycle for each of `cycles` in shared ticks (see the module docs), together with any
    /// other queued work. Each session must have logits and nothing queued; a session appears at most once; per
    /// position logits it collected ([`Engine::set_prefill_logits`]) and not yet taken are dropped.
    /// Returns each cycle's outcome in order. On an error from the tick the engine's sessions are consistent
    /// (see [`Engine::step`]) and the cycles' tokens are not committed.
    pub fn verify_drafts(&mut self, cycles: &mut [Cycle<'_>]) -> Result<Vec<Verified>> {
        let vocab = self.config().vocab;
        for (i, c) in cycles.iter().enumerate() {
            if cycles[..i].iter().any(|o| o.session == c.session) {
                return Err(Error::InvalidArgument(format!("session {:?} appears twice in one verify", c.session)));
            }
            if self.pending(c.session)? != 0 {
                return Err(Error::InvalidArgument("verify_drafts: the session has queued tokens".into()));
            }
            self.logits(c.session)?;
            if let Some(&t) = std::iter::once(&c.first).chain(c.draft).find(|&&t| t as usize >= vocab) {
                return Err(Error::InvalidArgument(format!("token id {t} is outside the vocabulary (size {vocab})")));
            }
        }
        let mut saved = Vec::with_capacity(cycles.len());
        for c in cycles.iter() {
            saved.push(self.prefill_logits_on(c.session)?);
        }
        // Queue every cycle; on a refusal (context full) undo the ones already queued.
        for (i, c) in cycles.iter().enumerate() {
            let mut run = Vec::with_capacity(c.draft.len() + 1);
            run.push(c.first);
            run.extend_from_slice(c.draft);
            let queued = self.take_all_logits(c.session).and_then(|_| self.set_prefill_logits(c.session, true));
            if let Err(e) = queued.and_then(|_| self.feed(c.session, &run)) {
                for (o, &on) in cycles[..=i].iter().zip(&saved) {
                    let _ = self.truncate(o.session, self.position(o.session)?);
                    self.set_prefill_logits(o.session, on)?;
                }
                return Err(e);
            }
        }
        let ran = self.run_until_idle();
        let mut rows = Vec::with_capacity(cycles.len());
        for (c, &on) in cycles.iter().zip(&saved) {
            rows.push(self.take_all_logits(c.session)?);
            self.set_prefill_logits(c.session, on)?;
        }
        ran?;
        let mut out = Vec::with_capacity(cycles.len());
        for (c, rows) in cycles.iter_mut().zip(rows) {
            let k = c.draft.len();
            if rows.len() != (k + 1) * vocab {
                return Err(Error::Session(format!(
                    "verify tick returned {} logits rows, expected {}",
                    rows.len() / vocab,
                    k + 1
                )));
            }
            let row = |i: usize| &rows[i * vocab..(i + 1) * vocab];
            let mut accepted = 0;
            let mut next = None;
            for (i, &d) in c.draft.iter().enumerate() {
                match c.sampler.verify_drafted(row(i), d)? {
                    Verdict::Accept => {
                        c.sampler.accept(d);
                        accepted += 1;
                    }
                    Verdict::Reject(x) => {
                        next = Some(x);
                        break;
                    }
                }
            }
            let next = match next {
                Some(x) => x,
                None => c.sampler.sample(row(k))?,
            };
            let end = self.position(c.session)?;
            let keep = end - (k - accepted);
            if keep < end {
                if self.rollback_floor(c.session)? <= keep {
                    self.rollback(c.session, keep)?;
                } else {
                    // Beyond the roll-back log's reach: recompute the kept tokens (same state, slower).
                    self.truncate(c.session, keep)?;
                    self.run_until_idle()?;
                }
            }
            self.set_logits(c.session, row(accepted))?;
            out.push(Verified { accepted, next });
        }
        Ok(out)
    }

    /// Generates `n` tokens for session `id` (which must have logits) with `sampler`, speculating with `drafter`
    /// (at most `draft_len` tokens per cycle; 0 = plain decoding). Returns the tokens and the run's counters. Like
    /// [`Engine::generate_greedy`], the last token is not fed back: the session's logits are those that chose it.
    /// The tokens are those plain decoding with the same sampler would give (greedy: identical; sampling: the same
    /// distribution).
    pub fn generate_speculative(
        &mut self,
        id: SessionId,
        sampler: &mut Sampler,
        drafter: &mut dyn Drafter,
        draft_len: usize,
        n: usize,
    ) -> Result<(Vec<u32>, SpecStats)> {
        self.generate_paced(id, sampler, drafter, draft_len, n, None)
    }

    /// [`Engine::generate_speculative`] under `auto`'s rule ([`auto`]): plain decode ticks and cycles (drafting
    /// and verifying) are timed into `pace`'s [`auto::TickCost`], and its [`auto::AutoPause`] stops drafting for
    /// [`auto::AUTO_PAUSE`] tokens when the last [`auto::AUTO_WINDOW`] verify runs delivered fewer tokens than they
    /// cost (counted in [`SpecStats::paused`]). The tokens are those of plain decoding either way.
    pub fn generate_speculative_auto(
        &mut self,
        id: SessionId,
        sampler: &mut Sampler,
        drafter: &mut dyn Drafter,
        draft_len: usize,
        n: usize,
        pace: &mut (auto::AutoPause, auto::TickCost),
    ) -> Result<(Vec<u32>, SpecStats)> {
        self.generate_paced(id, sampler, drafter, draft_len, n, Some(pace))
    }

    fn generate_paced(
        &mut self,
        id: SessionId,
        sampler: &mut Sampler,
        drafter: &mut dyn Drafter,
        draft_len: usize,
        n: usize,
        mut pace: Option<&mut (auto::AutoPause, auto::TickCost)>,
    ) -> Result<(Vec<u32>, SpecStats)> {
        let mut stats = SpecStats::default();
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return Ok((out, stats));
        }
        let mut first = sampler.sample(self.logits(id)?)?;
        sampler.accept(first);
        out.push(first);
        let mut context = self.history(id)?.to_vec();
        while out.len() < n {
            context.push(first);
            // Room for the draft, the cycle's own token and the next one within `n`.
            let drafting = pace.as_ref().is_none_or(|p| p.0.drafting(out.len()));
            let k = if drafting { draft_len.min(n - out.len() - 1) } else { 0 };
            let t0 = std::time::Instant::now();
            let mut draft = if k > 0 { drafter.draft(self, id, &context, k)? } else { Vec::new() };
            draft.truncate(k);
            if draft.is_empty() {
                self.feed(id, &[first])?;
                self.run_until_idle()?;
                stats.plain_steps += 1;
                if let Some(p) = pace.as_mut() {
                    p.1.plain_tick(t0.elapsed().as_secs_f64());
                }
                first = sampler.sample(self.logits(id)?)?;
            } else {
                let mut cycle = [Cycle { session: id, first, draft: &draft, sampler: &mut *sampler }];
                let v = self.verify_drafts(&mut cycle)?.remove(0);
                stats.cycles += 1;
                stats.drafted += draft.len();
                stats.accepted += v.accepted;
                out.extend_from_slice(&draft[..v.accepted]);
                context.extend_from_slice(&draft[..v.accepted]);
                first = v.next;
                if let Some((pause, cost)) = pace.as_deref_mut() {
                    cost.spec_tick(t0.elapsed().as_secs_f64());
                    if pause.record(v.accepted, out.len() + 1, cost.ratio()) {
                        stats.paused += 1;
                    }
                }
            }
            sampler.accept(first);
            out.push(first);
        }
        Ok((out, stats))
    }
}
