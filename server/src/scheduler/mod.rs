//! The scheduler thread: the only owner of the [`Runner`]. Requests reach it as [`GenRequest`]s over a channel and get
//! [`JobEvent`]s back over a per-job tokio channel.
//!
//! Each tick: admit waiting jobs (up to `max_active`), drop jobs whose receiver is gone (client disconnected), feed
//! every decoding session its last sampled token plus prompt tokens to the sessions still prefilling, so that at most
//! `prefill_chunk` prompt tokens are queued in the runner in all (so decoders keep flowing during a long prefill),
//! run exactly one `Runner::step` (one model tick: decode tokens first, then as much prefill as the runner's batch
//! holds), then sample for every session whose fed tokens are all processed ([`Runner::pending`] is 0). A decoding
//! session therefore gets a token every tick, however long another session's prompt is.
//!
//! Prefix reuse and the RAM KV tier (parked sessions, their lookup and eviction) live in `parked`; the KV tiers
//! behind it (save events, restores waiting on the tiers' I/O worker) in `tiers`; speculative decoding (a decoding session feeding its token plus a draft, verified after the tick) in [`spec`].
//!
//! Every finished job (done, cancelled or failed) leaves a [`RequestRecord`] — counts and timings, no text — in
//! the metrics' ring of recent requests, and every tick adds its prompt and generated tokens to the throughput
//! window ([`crate::recent`]); the status view reads both.
//!
//! Invariants: a job receives exactly one `Started` (or `Error`) first, then `Token`s, then exactly one `Done` or
//! `Error`. A panic inside the runner fails the jobs of that tick and frees their sessions; it does not kill the
//! thread.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam::channel::{self, Receiver, Sender, TryRecvError};
use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

use crate::kvdisk::{DiskEvent, DiskTier};
use crate::metrics::{CacheTier, Metrics};
use crate::model::{Runner, RunnerSessionId};
use crate::recent::{Outcome, RequestRecord};
use crate::structured::JobConstraint;
use ds4_engine::sampler::{Sampler, SamplerConfig};

mod parked;
pub mod spec;
mod tiers;

use parked::Parked;
pub use spec::{SpecConfig, SpecMode};
use spec::{SpecState, TickCost};
use tiers::Restoring;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStopReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// `max_tokens` or the context size was reached.
    Length,
}

/// Messages from the scheduler to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEvent {
    /// Admitted: `cached_tokens` of the prompt were reused from a parked session.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Token(u32),
    Done(JobStopReason),
    Error(String),
}

/// One generation request.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplerConfig,
    /// Generated tokens at most (the EOS token counts).
    pub max_tokens: usize,
    /// Token ids that end generation (not emitted).
    pub eos: Vec<u32>,
    /// Length of the prompt's system + tools block (tokens before the first user message; 0: unknown). The disk
    /// tier may save a checkpoint at its end ([`DiskEvent::SystemBlock`]).
    pub system_block: usize,
    pub events: UnboundedSender<JobEvent>,
    /// Structured output: every sampled token goes through this grammar's mask ([`crate::structured`]).
    pub constraint: Option<Box<JobConstraint>>,
}

/// Tunables.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_active: usize,
    pub max_queue: usize,
    pub prefill_chunk: usize,
    /// Parked sessions at most (the session table's bound).
    pub max_parked: usize,
    /// Bytes the parked sessions may hold ([`Runner::session_bytes`]; the RAM tier's budget, `--kv-ram-mb`).
    pub max_parked_bytes: u64,
    pub context_size: usize,
    /// Speculative decoding (`--speculative`, `--draft-len`).
    pub speculative: SpecConfig,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_active: 32,
            max_queue: 256,
            prefill_chunk: 512,
            max_parked: 256,
            max_parked_bytes: 1 << 30,
            context_size: 4096,
            speculative: SpecConfig::default(),
        }
    }
}

/// Why a job was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull,
    ShuttingDown,
}

enum Msg {
    Submit(GenRequest, Instant),
    Shutdown,
}

/// The handle request handlers use. Cloneable, cheap.
#[derive(Clone)]
pub struct Scheduler {
    tx: Sender<Msg>,
    queued: Arc<AtomicUsize>,
    max_queue: usize,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Scheduler {
    /// Start the scheduler thread owning `runner` (no KV tier behind the RAM tier).
    pub fn start(runner: Box<dyn Runner>, config: SchedulerConfig, metrics: Arc<Metrics>) -> Self {
        Scheduler::start_with_tier(runner, None, config, metrics)
    }

    /// Start the scheduler thread owning `runner` and the KV tier store `tier` (disk, memory and remote tiers
    /// behind the RAM tier; see [`crate::kvdisk`]).
    pub fn start_with_tier(
        runner: Box<dyn Runner>,
        tier: Option<DiskTier>,
        config: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (tx, rx) = channel::unbounded();
        let queued = Arc::new(AtomicUsize::new(0));
        let max_queue = config.max_queue;
        if let Some(t) = &tier {
            let _ = metrics.kv_tier.set(t.stats());
        }
        let mut worker = Worker::new(runner, tier, config, metrics, queued.clone());
        // What the runner found at start (e.g. corrupt cache files removed) is visible before this returns, so
        // before the server listens (publishing it from the thread raced the first `/metrics` request).
        worker.publish();
        let thread = std::thread::Builder::new()
            .name("ds4-scheduler".into())
            .spawn(move || worker.run(rx))
            .expect("spawning the scheduler thread");
        Scheduler { tx, queued, max_queue, thread: Arc::new(Mutex::new(Some(thread))) }
    }

    /// Queue a job; fails at once when `max_queue` jobs are already waiting.
    pub fn submit(&self, job: GenRequest) -> Result<(), SubmitError> {
        if self.queued.fetch_add(1, Ordering::SeqCst) >= self.max_queue {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull);
        }
        self.tx.send(Msg::Submit(job, Instant::now())).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::ShuttingDown
        })
    }

    /// Jobs submitted but not yet admitted.
    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Jobs that may wait before new ones are refused.
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }

    /// Stop the thread after failing what is still queued or running, and wait for it.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

struct Active {
    job: GenRequest,
    session: RunnerSessionId,
    /// Prompt + generated tokens; `tokens[..fed]` have been fed to the runner.
    tokens: Vec<u32>,
    fed: usize,
    prompt_len: usize,
    /// Prompt tokens reused from a parked session.
    cached: usize,
    /// Where the cached tokens came from.
    tier: CacheTier,
    /// Prefill stops at this position until the disk tier has saved it ([`DiskEvent::SystemBlock`]).
    pause_at: Option<usize>,
    generated: usize,
    sampler: Sampler,
    submitted: Instant,
    admitted: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    spec: SpecState,
}

impl Active {
    /// The status view's record of this job ending with `outcome`.
    fn record(&self, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            submitted_unix_ms: crate::recent::Recent::unix_ms(self.submitted),
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached,
            cache_tier: self.tier.name(),
            output_tokens: self.generated,
            queue: self.admitted - self.submitted,
            ttft: self.first_token.map(|t| t - self.submitted),
            total: self.submitted.elapsed(),
            outcome,
        }
    }
}

struct Worker {
    runner: Box<dyn Runner>,
    /// The KV tiers behind the RAM tier (disk, memory, remote), when on.
    tier: Option<DiskTier>,
    /// Jobs whose restore runs on the tier's I/O worker (they count against `max_active`).
    restoring: Vec<Restoring>,
    next_ticket: u64,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    waiting: VecDeque<(GenRequest, Instant)>,
    active: Vec<Active>,
    parked: Vec<Parked>,
    clock: u64,
    /// What plain and speculative ticks cost (for `--speculative auto`).
    spec_cost: TickCost,
    /// Drafting time of the current tick.
    draft_secs: f64,
}

impl Worker {
    fn new(
        runner: Box<dyn Runner>,
        tier: Option<DiskTier>,
        config: SchedulerConfig,
        metrics: Arc<Metrics>,
        queued: Arc<AtomicUsize>,
    ) -> Self {
        Worker {
            runner,
            tier,
            restoring: Vec::new(),
            next_ticket: 0,
            config,
            metrics,
            queued,
            waiting: VecDeque::new(),
            active: Vec::new(),
            parked: Vec::new(),
            clock: 0,
            spec_cost: TickCost::default(),
            draft_secs: 0.0,
        }
    }

    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            self.take_restored();
            let idle = self.active.is_empty() && self.waiting.is_empty();
            let msg = if idle && !self.restoring.is_empty() {
                // Only restores in flight: wake for a request or for a restore's result.
                let restored = self.tier.as_ref().map(|t| t.restored().clone()).unwrap_or_else(channel::never);
                channel::select! {
                    recv(rx) -> m => match m {
                        Ok(m) => Some(m),
                        Err(_) => break,
                    },
                    recv(restored) -> r => {
                        if let Ok(r) = r {
                            self.finish_restore(r);
                        }
                        continue;
                    }
                }
            } else if idle {
                match rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => break,
                }
            } else {
                match rx.try_recv() {
                    Ok(m) => Some(m),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => break,
                }
            };
            match msg {
                Some(Msg::Submit(job, at)) => {
                    self.waiting.push_back((job, at));
                    continue; // drain everything that is already queued before ticking
                }
                Some(Msg::Shutdown) => break,
                None => {}
            }
            self.admit();
            self.tick();
            self.publish();
        }
        for (job, _) in self.waiting.drain(..) {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = job.events.send(JobEvent::Error("server is shutting down".into()));
        }
        for r in std::mem::take(&mut self.restoring) {
            let _ = r.job.events.send(JobEvent::Error("server is shutting down".into()));
        }
        for a in std::mem::take(&mut self.active) {
            let _ = a.job.events.send(JobEvent::Error("server is shutting down".into()));
            self.disk_event(a.session, DiskEvent::Shutdown);
            self.free(a.session);
        }
        for p in std::mem::take(&mut self.parked) {
            self.disk_event(p.session, DiskEvent::Shutdown);
            self.free(p.session);
        }
        // Everything queued is written before the thread (and with it the server) ends.
        if let Some(t) = &self.tier {
            t.flush();
        }
        self.publish();
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.queue_depth.store(self.queued.load(Ordering::SeqCst) as u64, Ordering::Relaxed);
        m.active_sessions.store(self.active.len() as u64, Ordering::Relaxed);
        m.parked_sessions.store(self.parked.len() as u64, Ordering::Relaxed);
        let kv = self.runner.kv_bytes();
        m.set_kv_bytes(CacheTier::Device, kv.device);
        m.set_kv_bytes(CacheTier::Host, kv.host);
        m.set_kv_fork_bytes_copied(self.runner.kv_bytes_copied());
        m.kv_restoring.store(self.restoring.len() as u64, Ordering::Relaxed);
    }

    /// Move waiting jobs into the active set while there is room (a job whose prompt the KV tiers may hold waits
    /// for its restore first, off this thread).
    fn admit(&mut self) {
        while self.active.len() + self.restoring.len() < self.config.max_active {
            let Some((job, submitted)) = self.waiting.pop_front() else { break };
            self.queued.fetch_sub(1, Ordering::SeqCst);
            if job.events.is_closed() {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if job.prompt.is_empty() || job.prompt.len() >= self.config.context_size {
                let msg = format!(
                    "prompt is {} tokens; it must be between 1 and {} (context size {})",
                    job.prompt.len(),
                    self.config.context_size.saturating_sub(1),
                    self.config.context_size
                );
                let _ = job.events.send(JobEvent::Error(msg));
                continue;
            }
            let sampler = match Sampler::new(job.sampling.clone()) {
                Ok(s) => s,
                Err(e) => {
                    let _ = job.events.send(JobEvent::Error(format!("invalid sampling settings: {e}")));
                    continue;
                }
            };
            if let Some((job, submitted, sampler)) = self.try_restore(job, submitted, sampler) {
                self.start(job, submitted, sampler, None);
            }
        }
    }

    /// Starts `job` on a session: `restored` (a session loaded from the KV tiers and the prompt tokens it holds)
    /// when it beats the RAM tier, else the best parked session or a fresh one.
    fn start(
        &mut self,
        job: GenRequest,
        submitted: Instant,
        sampler: Sampler,
        restored: Option<(RunnerSessionId, usize)>,
    ) {
        let (session, cached, tier) = match self.acquire(&job.prompt, restored) {
            Ok(x) => x,
            Err(e) => {
                let _ = job.events.send(JobEvent::Error(e));
                return;
            }
        };
        let prompt_len = job.prompt.len();
        let pause_at = match &mut self.tier {
            Some(t) => t.system_block_save_at(&job.prompt, job.system_block, cached),
            None => None,
        };
        self.metrics.prompt_tokens.fetch_add(prompt_len as u64, Ordering::Relaxed);
        if cached > 0 {
            self.metrics.add_prefix_hit(tier, cached as u64);
        }
        self.metrics.add_prefill(cached > 0, tier, (prompt_len - cached.min(prompt_len)) as u64);
        let _ = job.events.send(JobEvent::Started { prompt_tokens: prompt_len, cached_tokens: cached });
        tracing::debug!(session, prompt_len, cached, "admitted");
        self.active.push(Active {
            tokens: job.prompt.clone(),
            sampler,
            job,
            session,
            fed: cached,
            prompt_len,
            cached,
            tier,
            pause_at,
            generated: 0,
            submitted,
            admitted: Instant::now(),
            first_token: None,
            last_token: None,
            spec: SpecState::default(),
        });
    }

    /// Finish the job at `idx`: park its session with the tokens the runner has processed.
    fn retire(&mut self, idx: usize, event: Option<JobEvent>) {
        let a = self.active.swap_remove(idx);
        let outcome = match &event {
            None => Outcome::Cancelled,
            Some(JobEvent::Done(JobStopReason::Length)) => Outcome::Length,
            Some(JobEvent::Error(_)) => Outcome::Error,
            Some(_) => Outcome::Stop,
        };
        self.metrics.recent.record(a.record(outcome));
        // Whole rows again for whoever takes the session next (a candidates-only row is dropped).
        self.runner.set_logit_candidates(a.session, 0);
        if let Some(ev) = event {
            let _ = a.job.events.send(ev);
        }
        self.disk_event(a.session, DiskEvent::Finished);
        let mut tokens = a.tokens;
        tokens.truncate(a.fed);
        self.park(a.session, tokens);
    }

    fn tick(&mut self) {
        // Cancelled requests free their slot first.
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].job.events.is_closed() {
                tracing::debug!(session = self.active[i].session, "client went away; cancelling");
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                self.retire(i, None);
            } else {
                i += 1;
            }
        }
        self.plan_drafts();
        let mut budget = self.config.prefill_chunk.max(1);
        let mut failed = Vec::new();
        let mut queued_any = false;
        let mut prefilled = 0u64;
        for (i, a) in self.active.iter_mut().enumerate() {
            // Tokens fed on earlier ticks that the runner has not processed yet count against the prefill budget.
            let pending = self.runner.pending(a.session);
            queued_any |= pending > 0;
            let remaining = a.tokens.len() - a.fed;
            let n = if a.fed >= a.prompt_len {
                remaining // a decode token (exactly one)
            } else {
                let remaining = a.pause_at.map_or(remaining, |p| remaining.min(p.saturating_sub(a.fed)));
                let n = remaining.min(budget.saturating_sub(pending));
                budget = budget.saturating_sub(pending + n);
                n
            };
            if n == 0 {
                continue;
            }
            let fed = if a.spec.draft.is_empty() {
                self.runner.feed(a.session, &a.tokens[a.fed..a.fed + n])
            } else {
                let run: Vec<u32> = a.tokens[a.fed..].iter().chain(&a.spec.draft).copied().collect();
                self.runner.feed_verify(a.session, &run)
            };
            if let Err(e) = fed {
                a.spec.draft.clear();
                failed.push((i, e.0));
                continue;
            }
            if a.fed < a.prompt_len {
                prefilled += n as u64;
            }
            a.fed += n;
            queued_any = true;
        }
        if queued_any {
            let verifying = self.active.iter().any(|a| !a.spec.draft.is_empty());
            // A tick of decode tokens only (no prompt chunk): the plain tick `auto` compares verify runs with.
            let decode_only = prefilled == 0;
            // The grammar masks of the sessions this step ends with are computed on a worker while the step runs.
            let ready: Vec<&mut JobConstraint> = self
                .active
                .iter_mut()
                .enumerate()
                .filter(|(i, a)| a.fed == a.tokens.len() && !failed.iter().any(|f| f.0 == *i))
                .filter_map(|(_, a)| a.job.constraint.as_deref_mut())
                .filter(|c| c.active())
                .collect();
            let t_step = Instant::now();
            let (runner, metrics) = (&mut self.runner, &self.metrics);
            let stepped = std::thread::scope(|s| {
                let worker = (!ready.is_empty()).then(|| {
                    s.spawn(move || {
                        for c in ready {
                            if let Ok(d) = c.prepare() {
                                metrics.structured.mask.observe(d);
                            }
                        }
                    })
                });
                let stepped = catch_unwind(AssertUnwindSafe(|| runner.step()));
                if let Some(w) = worker {
                    let _ = w.join();
                }
                stepped
            });
            let step_secs = t_step.elapsed().as_secs_f64();
            if verifying {
                self.metrics.spec.verify_micros.fetch_add((step_secs * 1e6) as u64, Ordering::Relaxed);
                self.spec_cost.spec_tick(step_secs + self.draft_secs);
            } else if decode_only {
                self.spec_cost.plain_tick(step_secs);
            }
            let err = match stepped {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.0),
                Err(_) => Some("the model panicked during a step".to_string()),
            };
            if let Some(e) = err {
                tracing::error!(error = %e, "step failed; failing the active requests");
                for a in std::mem::take(&mut self.active) {
                    self.metrics.recent.record(a.record(Outcome::Error));
                    let _ = a.job.events.send(JobEvent::Error(format!("model step failed: {e}")));
                    self.free(a.session);
                }
                return;
            }
        }
        // A prefill paused at its system block's end is saved there, then goes on next tick.
        for i in 0..self.active.len() {
            let a = &self.active[i];
            if a.pause_at == Some(a.fed) && self.runner.pending(a.session) == 0 {
                let session = a.session;
                self.active[i].pause_at = None;
                self.disk_event(session, DiskEvent::SystemBlock);
            }
        }
        let mut finished: Vec<(usize, JobEvent)> = failed.into_iter().map(|(i, e)| (i, JobEvent::Error(e))).collect();
        let mut sampled = self.verify_drafts(&mut finished);
        // Ready to sample: everything fed has been processed (after a full prefix hit, nothing needed feeding: the
        // parked session holds the prompt's logits). A session whose feed failed or that finished is not sampled.
        let sample_now: Vec<usize> = (0..self.active.len())
            .filter(|&i| {
                let a = &self.active[i];
                a.fed == a.tokens.len() && self.runner.pending(a.session) == 0 && !finished.iter().any(|f| f.0 == i)
            })
            .collect();
        let checkpoints: Vec<(RunnerSessionId, Vec<u32>, usize)> = sample_now
            .iter()
            .map(|&i| &self.active[i])
            .filter(|a| a.generated == 0 && a.cached < a.prompt_len)
            .map(|a| (a.session, a.tokens[..a.prompt_len].to_vec(), a.cached))
            .collect();
        for (session, prompt, cached) in checkpoints {
            self.disk_event(session, DiskEvent::Prefilled { cached, prompt_len: prompt.len() });
            self.checkpoint_prompt(session, &prompt);
        }
        for i in sample_now {
            let a = &mut self.active[i];
            let Some(logits) = self.runner.logits(a.session) else {
                finished.push((i, JobEvent::Error("the model returned no logits".into())));
                continue;
            };
            let forced = a.spec.forced.take();
            let picked = match a.job.constraint.as_mut().map(|c| (Instant::now(), c.take_mask())) {
                _ if forced.is_some() => Ok(forced.unwrap_or_default()),
                None | Some((_, Ok(None))) => a.sampler.sample(logits).map_err(|e| format!("sampling failed: {e}")),
                Some((t0, Ok(Some(mask)))) => {
                    self.metrics.structured.mask_wait.observe(t0.elapsed());
                    self.metrics.structured.masked_tokens.fetch_add(1, Ordering::Relaxed);
                    a.sampler.sample_masked(logits, &mask, false).map_err(|e| format!("sampling failed: {e}"))
                }
                Some((_, Err(e))) => Err(format!("the output grammar failed: {e}")),
            };
            let picked = picked.and_then(|t| match a.job.constraint.as_mut() {
                Some(c) if !a.job.eos.contains(&t) => {
                    c.accept(t).map(|_| t).map_err(|e| format!("the output grammar failed: {e}"))
                }
                _ => Ok(t),
            });
            let token = match picked {
                Ok(t) => t,
                Err(e) => {
                    if a.job.constraint.is_some() {
                        self.metrics.structured.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    finished.push((i, JobEvent::Error(e)));
                    continue;
                }
            };
            sampled += 1;
            if let Some(ev) = emit(a, token, &self.metrics, self.config.context_size) {
                finished.push((i, ev));
            } else if a.generated == 1 {
                // The prompt's row came back whole (a parked or saved session keeps it); from the first generated
                // token on, a greedy or top-k sampler (no penalties, no grammar) gets only the best logits.
                let k = a.sampler.config().candidates().filter(|&k| k <= ds4_engine::graph::MAX_LOGIT_CANDIDATES);
                if let Some(k) = k.filter(|_| a.job.constraint.is_none()) {
                    self.runner.set_logit_candidates(a.session, k);
                }
            }
        }
        self.metrics.recent.add_tokens(prefilled, sampled);
        // Retire from the highest index down so swap_remove keeps the lower indices valid.
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, ev) in finished {
            self.retire(i, Some(ev));
        }
    }
}

/// Emits `token` for job `a` as its next generated token (metrics, the event, the token list); returns the
/// job's final event when it ends there (an end-of-sequence token, `max_tokens`, the context).
fn emit(a: &mut Active, token: u32, metrics: &Metrics, context_size: usize) -> Option<JobEvent> {
    let now = Instant::now();
    match a.last_token {
        None => {
            metrics.ttft.observe(now - a.submitted);
            a.first_token = Some(now);
        }
        Some(t) => metrics.itl.observe(now - t),
    }
    a.last_token = Some(now);
    a.generated += 1;
    metrics.completion_tokens.fetch_add(1, Ordering::Relaxed);
    if a.job.eos.contains(&token) {
        return Some(JobEvent::Done(JobStopReason::Eos));
    }
    let _ = a.job.events.send(JobEvent::Token(token));
    a.tokens.push(token);
    if a.generated >= a.job.max_tokens || a.tokens.len() >= context_size {
        return Some(JobEvent::Done(JobStopReason::Length));
    }
    None
}

impl Worker {
    /// Chooses the decoding sessions that draft this tick and asks the runner's drafter for their drafts (one
    /// shared drafter pass), leaving each in its [`SpecState::draft`].
    fn plan_drafts(&mut self) {
        let cfg = self.config.speculative;
        self.draft_secs = 0.0;
        for a in &mut self.active {
            a.spec.draft.clear();
        }
        if cfg.mode == SpecMode::Off || cfg.draft_len == 0 || !self.runner.can_draft() {
            return;
        }
        let mut who = Vec::new();
        for (i, a) in self.active.iter().enumerate() {
            let decoding = a.fed >= a.prompt_len && a.tokens.len() == a.fed + 1;
            // Room for the drafts plus the token drawn after them (max_tokens, and the context).
            let room = a
                .job
                .max_tokens
                .saturating_sub(a.generated + 1)
                .min(self.config.context_size.saturating_sub(a.tokens.len() + 1));
            let k = cfg.draft_len.min(room);
            // The rejected drafts go with an exact roll back: only sessions whose roll-back log is live (a session
            // restored from disk has one once it has processed a window of new tokens).
            if decoding
                && k > 0
                && a.job.constraint.is_none()
                && a.spec.drafting(cfg.mode, a.generated)
                && self.runner.pending(a.session) == 0
                && self.runner.rollback_floor(a.session).is_some()
            {
                who.push((i, k));
            }
        }
        if who.is_empty() {
            return;
        }
        let t0 = Instant::now();
        let reqs: Vec<(RunnerSessionId, &[u32], usize)> =
            who.iter().map(|&(i, k)| (self.active[i].session, &self.active[i].tokens[..], k)).collect();
        let drafts = self.runner.draft(&reqs);
        self.draft_secs = t0.elapsed().as_secs_f64();
        self.metrics.spec.draft_micros.fetch_add((self.draft_secs * 1e6) as u64, Ordering::Relaxed);
        for ((i, k), mut d) in who.into_iter().zip(drafts) {
            d.truncate(k);
            self.active[i].spec.draft = d;
        }
    }

    /// Judges the verify runs of this tick: accepted drafted tokens are emitted, the rest rolled back, and a
    /// rejection's replacement becomes the session's next token ([`SpecState::forced`]). Returns the tokens
    /// emitted; jobs that ended go to `finished`.
    fn verify_drafts(&mut self, finished: &mut Vec<(usize, JobEvent)>) -> u64 {
        let vocab = self.runner.vocab_size();
        let mode = self.config.speculative.mode;
        let mut emitted = 0u64;
        for i in 0..self.active.len() {
            let a = &mut self.active[i];
            if a.spec.draft.is_empty() || finished.iter().any(|f| f.0 == i) || self.runner.pending(a.session) > 0 {
                continue;
            }
            let draft = std::mem::take(&mut a.spec.draft);
            let rows = self.runner.take_verify_logits(a.session);
            if rows.len() != (draft.len() + 1) * vocab {
                // Drop the verify run's drafts, so the session parks with exactly the tokens it records.
                self.runner.truncate(a.session, a.fed);
                finished.push((i, JobEvent::Error("the model returned no verify logits".into())));
                continue;
            }
            let row = |j: usize| &rows[j * vocab..(j + 1) * vocab];
            let mut accepted = 0;
            let mut ended = None;
            for &d in &draft {
                match a.sampler.verify_drafted(row(accepted), d) {
                    Ok(ds4_engine::sampler::Verdict::Accept) => {
                        accepted += 1;
                        emitted += 1;
                        a.fed += 1; // processed in the verify run
                        if let Some(ev) = emit(a, d, &self.metrics, self.config.context_size) {
                            if matches!(ev, JobEvent::Done(JobStopReason::Eos)) {
                                a.fed -= 1; // the end token is not part of the session
                            }
                            ended = Some(ev);
                            break;
                        }
                    }
                    Ok(ds4_engine::sampler::Verdict::Reject(x)) => {
                        a.spec.forced = Some(x);
                        break;
                    }
                    Err(e) => {
                        ended = Some(JobEvent::Error(format!("sampling failed: {e}")));
                        break;
                    }
                }
            }
            let m = &self.metrics.spec;
            m.cycles.fetch_add(1, Ordering::Relaxed);
            m.draft_tokens.fetch_add(draft.len() as u64, Ordering::Relaxed);
            let stood = accepted - usize::from(matches!(ended, Some(JobEvent::Done(JobStopReason::Eos))));
            m.accepted_tokens.fetch_add(stood as u64, Ordering::Relaxed);
            if a.spec.record(mode, stood, a.generated, self.spec_cost.ratio()) {
                m.paused.fetch_add(1, Ordering::Relaxed);
            }
            // The logits after the last kept token: verify row `j` follows the `j`-th drafted token (row 0 follows
            // the session's own token).
            if let Err(e) = self.runner.commit_verify(a.session, a.fed, row(stood)) {
                if ended.is_none() {
                    ended = Some(JobEvent::Error(format!("speculative roll back failed: {}", e.0)));
                }
                a.spec.forced = None;
            }
            if let Some(ev) = ended {
                a.spec.forced = None;
                finished.push((i, ev));
            }
        }
        emitted
    }
}

#[cfg(test)]
mod tests;
