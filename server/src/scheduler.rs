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
//! Prefix reuse: a finished (or cancelled) job's session is *parked* with exactly the tokens it has processed. A new
//! job takes the parked session that lets it skip the most prompt tokens and feeds only the rest: a parked session
//! whose tokens are a prefix of the prompt is used as is (when they equal the whole prompt, its stored logits are
//! sampled directly); otherwise a copy of it is rolled back to the common prefix when the runner can: anywhere
//! ([`Runner::can_truncate`]) or within its roll-back reach ([`Runner::rollback_floor`]; the real engine rolls back
//! exactly, recomputing nothing, up to R = 1024 tokens). Runners without unbounded truncation also get a copy of
//! every freshly prefilled prompt parked ([`Runner::fork`]), so a request that diverges right after the prompt (a
//! retry, a re-rendered assistant turn) skips it even beyond the roll-back reach. The parked sessions are the
//! RAM KV tier, bounded by bytes: least-recently-used ones are evicted (saved to the disk tier first, when there is
//! one) while their [`Runner::session_bytes`] sum exceeds `max_parked_bytes`, beyond `max_parked` sessions (a
//! bound on the runner's session table, not the cache policy), or when the runner's session table is full.
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

use crate::kvdisk::DiskEvent;
use crate::metrics::{CacheTier, Metrics};
use crate::model::{Runner, RunnerSessionId};
use crate::recent::{Outcome, RequestRecord};
use crate::structured::JobConstraint;
use ds4_engine::sampler::{Sampler, SamplerConfig};

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
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
    Done(StopReason),
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
    /// Start the scheduler thread owning `runner`.
    pub fn start(runner: Box<dyn Runner>, config: SchedulerConfig, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = channel::unbounded();
        let queued = Arc::new(AtomicUsize::new(0));
        let max_queue = config.max_queue;
        let mut worker = Worker::new(runner, config, metrics, queued.clone());
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

struct Parked {
    session: RunnerSessionId,
    tokens: Vec<u32>,
    last_used: u64,
    /// [`Runner::session_bytes`] when it was parked.
    bytes: u64,
}

struct Worker {
    runner: Box<dyn Runner>,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    waiting: VecDeque<(GenRequest, Instant)>,
    active: Vec<Active>,
    parked: Vec<Parked>,
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Worker {
    fn new(runner: Box<dyn Runner>, config: SchedulerConfig, metrics: Arc<Metrics>, queued: Arc<AtomicUsize>) -> Self {
        Worker {
            runner,
            config,
            metrics,
            queued,
            waiting: VecDeque::new(),
            active: Vec::new(),
            parked: Vec::new(),
            clock: 0,
        }
    }

    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            let idle = self.active.is_empty() && self.waiting.is_empty();
            let msg = if idle {
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
        for a in std::mem::take(&mut self.active) {
            let _ = a.job.events.send(JobEvent::Error("server is shutting down".into()));
            self.runner.disk_event(a.session, DiskEvent::Shutdown);
            self.runner.free_session(a.session);
        }
        for p in std::mem::take(&mut self.parked) {
            self.runner.disk_event(p.session, DiskEvent::Shutdown);
            self.runner.free_session(p.session);
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
        m.set_kv_bytes(CacheTier::Disk, kv.disk);
        m.set_kv_fork_bytes_copied(self.runner.kv_bytes_copied());
        m.set_kv_disk_errors(self.runner.disk_error_counts());
    }

    /// Move waiting jobs into the active set while there is room.
    fn admit(&mut self) {
        while self.active.len() < self.config.max_active {
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
            let (session, cached, tier) = match self.acquire(&job.prompt) {
                Ok(x) => x,
                Err(e) => {
                    let _ = job.events.send(JobEvent::Error(e));
                    continue;
                }
            };
            let prompt_len = job.prompt.len();
            let pause_at = self.runner.disk_system_block(&job.prompt, job.system_block, cached);
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
            });
        }
    }

    /// A session for `prompt`: the parked one that lets the most prompt tokens be skipped, else a fresh one.
    /// Returns the session and the number of prompt tokens it already holds (`== prompt.len()` only when the
    /// session also holds the logits that follow the prompt).
    /// A session restored from the disk tier wins when it covers more of the prompt than any parked one.
    fn acquire(&mut self, prompt: &[u32]) -> Result<(RunnerSessionId, usize, CacheTier), String> {
        let can_truncate = self.runner.can_truncate();
        let usable = |runner: &dyn Runner, p: &Parked| -> usize {
            let lcp = common_prefix(&p.tokens, prompt);
            if lcp == p.tokens.len() && (lcp < prompt.len() || runner.logits(p.session).is_some()) {
                lcp // the prompt extends the parked tokens (or equals them, logits included)
            } else if can_truncate {
                lcp.min(prompt.len() - 1)
            } else {
                // Roll back to the common prefix (keeping one prompt token to feed, for its logits) if in reach.
                let n = lcp.min(prompt.len() - 1);
                runner.rollback_floor(p.session).filter(|&f| f <= n).map_or(0, |_| n)
            }
        };
        let best = self
            .parked
            .iter()
            .enumerate()
            .map(|(i, p)| (i, usable(self.runner.as_ref(), p)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, self.parked[i].last_used));
        if let Some((s, n)) = self.runner.disk_restore(prompt, best.map_or(0, |(_, n)| n)) {
            return Ok((s, n, CacheTier::Disk));
        }
        if let Some((i, n)) = best {
            let extends = n == self.parked[i].tokens.len();
            if !can_truncate || !extends {
                // Keep the parked state (whole history) for the next request that shares it; the job continues on
                // a copy, cut back to the common prefix when the prompt diverges.
                if let Some(copy) = self.runner.fork(self.parked[i].session) {
                    if extends || self.runner.truncate(copy, n) {
                        self.clock += 1;
                        self.parked[i].last_used = self.clock;
                        return Ok((copy, n, CacheTier::Host));
                    }
                    self.runner.free_session(copy);
                }
            }
            let p = self.parked.swap_remove(i);
            if extends || self.runner.truncate(p.session, n) {
                return Ok((p.session, n, CacheTier::Host));
            }
            self.runner.free_session(p.session);
        }
        loop {
            match self.runner.create_session() {
                Ok(s) => return Ok((s, 0, CacheTier::Host)),
                Err(e) => {
                    if !self.evict_lru() {
                        return Err(format!("cannot create a session: {e}"));
                    }
                }
            }
        }
    }

    /// Free the least recently used parked session; `false` when there is none.
    fn evict_lru(&mut self) -> bool {
        let Some(lru) = self.parked.iter().enumerate().min_by_key(|(_, p)| p.last_used).map(|(i, _)| i) else {
            return false;
        };
        let p = self.parked.swap_remove(lru);
        self.runner.disk_event(p.session, DiskEvent::Evict);
        self.runner.free_session(p.session);
        true
    }

    /// Keep a copy of a session whose prompt was just processed (when the runner cannot truncate, this is what lets
    /// a request that diverges after the prompt reuse it).
    fn checkpoint_prompt(&mut self, session: RunnerSessionId, prompt: &[u32]) {
        if self.runner.can_truncate() || self.config.max_parked == 0 {
            return;
        }
        if self.parked.iter().any(|p| p.tokens == prompt) {
            return;
        }
        let copy = match self.runner.fork(session) {
            Some(c) => Some(c),
            None if self.evict_lru() => self.runner.fork(session),
            None => None,
        };
        if let Some(c) = copy {
            self.park(c, prompt.to_vec());
        }
    }

    fn park(&mut self, session: RunnerSessionId, mut tokens: Vec<u32>) {
        self.clock += 1;
        tokens.shrink_to_fit();
        let bytes = self.runner.session_bytes(session);
        self.parked.push(Parked { session, tokens, last_used: self.clock, bytes });
        while self.parked.len() > self.config.max_parked || self.parked_bytes() > self.config.max_parked_bytes {
            self.evict_lru();
        }
    }

    /// Bytes the parked sessions hold (the RAM tier's use).
    fn parked_bytes(&self) -> u64 {
        self.parked.iter().map(|p| p.bytes).sum()
    }

    /// Finish the job at `idx`: park its session with the tokens the runner has processed.
    fn retire(&mut self, idx: usize, event: Option<JobEvent>) {
        let a = self.active.swap_remove(idx);
        let outcome = match &event {
            None => Outcome::Cancelled,
            Some(JobEvent::Done(StopReason::Length)) => Outcome::Length,
            Some(JobEvent::Error(_)) => Outcome::Error,
            Some(_) => Outcome::Stop,
        };
        self.metrics.recent.record(a.record(outcome));
        if let Some(ev) = event {
            let _ = a.job.events.send(ev);
        }
        self.runner.disk_event(a.session, DiskEvent::Finished);
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
            if let Err(e) = self.runner.feed(a.session, &a.tokens[a.fed..a.fed + n]) {
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
            // The grammar masks of the sessions this step ends with are computed on a worker while the step runs.
            let ready: Vec<&mut JobConstraint> = self
                .active
                .iter_mut()
                .enumerate()
                .filter(|(i, a)| a.fed == a.tokens.len() && !failed.iter().any(|f| f.0 == *i))
                .filter_map(|(_, a)| a.job.constraint.as_deref_mut())
                .filter(|c| c.active())
                .collect();
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
                    self.runner.free_session(a.session);
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
                self.runner.disk_event(session, DiskEvent::SystemBlock);
            }
        }
        // Ready to sample: everything fed has been processed (after a full prefix hit, nothing needed feeding: the
        // parked session holds the prompt's logits). A session whose feed failed is not sampled.
        let sample_now: Vec<usize> = (0..self.active.len())
            .filter(|&i| {
                let a = &self.active[i];
                a.fed == a.tokens.len() && self.runner.pending(a.session) == 0 && !failed.iter().any(|f| f.0 == i)
            })
            .collect();
        let mut finished: Vec<(usize, JobEvent)> = failed.into_iter().map(|(i, e)| (i, JobEvent::Error(e))).collect();
        let checkpoints: Vec<(RunnerSessionId, Vec<u32>, usize)> = sample_now
            .iter()
            .map(|&i| &self.active[i])
            .filter(|a| a.generated == 0 && a.cached < a.prompt_len)
            .map(|a| (a.session, a.tokens[..a.prompt_len].to_vec(), a.cached))
            .collect();
        for (session, prompt, cached) in checkpoints {
            self.runner.disk_event(session, DiskEvent::Prefilled { cached, prompt_len: prompt.len() });
            self.checkpoint_prompt(session, &prompt);
        }
        let mut sampled = 0u64;
        for i in sample_now {
            let a = &mut self.active[i];
            let Some(logits) = self.runner.logits(a.session) else {
                finished.push((i, JobEvent::Error("the model returned no logits".into())));
                continue;
            };
            let picked = match a.job.constraint.as_mut().map(|c| (Instant::now(), c.take_mask())) {
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
            let now = Instant::now();
            match a.last_token {
                None => {
                    self.metrics.ttft.observe(now - a.submitted);
                    a.first_token = Some(now);
                }
                Some(t) => self.metrics.itl.observe(now - t),
            }
            a.last_token = Some(now);
            a.generated += 1;
            sampled += 1;
            self.metrics.completion_tokens.fetch_add(1, Ordering::Relaxed);
            if a.job.eos.contains(&token) {
                finished.push((i, JobEvent::Done(StopReason::Eos)));
                continue;
            }
            let _ = a.job.events.send(JobEvent::Token(token));
            a.tokens.push(token);
            if a.generated >= a.job.max_tokens || a.tokens.len() >= self.config.context_size {
                finished.push((i, JobEvent::Done(StopReason::Length)));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FakeCodec, FakeRunner, EOS};
    use crate::model::Codec;
    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    fn job(prompt: Vec<u32>, max_tokens: usize) -> (GenRequest, UnboundedReceiver<JobEvent>) {
        let (tx, rx) = unbounded_channel();
        let sampling = SamplerConfig::greedy();
        (GenRequest { prompt, sampling, max_tokens, eos: vec![EOS], system_block: 0, events: tx, constraint: None }, rx)
    }

    fn collect(rx: &mut UnboundedReceiver<JobEvent>) -> (Vec<JobEvent>, String) {
        let mut events = Vec::new();
        let mut text = Vec::new();
        while let Some(ev) = rx.blocking_recv() {
            let last = matches!(ev, JobEvent::Done(_) | JobEvent::Error(_));
            if let JobEvent::Token(t) = ev {
                text.push(t as u8);
            }
            events.push(ev);
            if last {
                break;
            }
        }
        (events, String::from_utf8_lossy(&text).into_owned())
    }

    fn prompt(user: &str) -> Vec<u32> {
        FakeCodec.encode(&format!("<|user|>{user}\n<|assistant|>")).unwrap()
    }

    #[test]
    fn generates_and_reuses_the_prefix() {
        let metrics = Arc::new(Metrics::default());
        let config = SchedulerConfig { prefill_chunk: 7, ..Default::default() };
        let s = Scheduler::start(Box::new(FakeRunner::new(8)), config, metrics.clone());
        let p1 = prompt("hello");
        let (j, mut rx) = job(p1.clone(), 100);
        s.submit(j).unwrap();
        let (ev, text) = collect(&mut rx);
        assert_eq!(text, "Hello! You said: hello.");
        assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p1.len(), cached_tokens: 0 });
        assert_eq!(ev.last().unwrap(), &JobEvent::Done(StopReason::Eos));
        // The follow-up carries the whole history: everything before its new turn comes from the parked session.
        let mut p2 = p1.clone();
        p2.extend(FakeCodec.encode("Hello! You said: hello.<|end|>\n<|user|>again\n<|assistant|>").unwrap());
        let (j, mut rx) = job(p2.clone(), 100);
        s.submit(j).unwrap();
        let (ev, text) = collect(&mut rx);
        assert_eq!(text, "Hello! You said: again.");
        let hello_len = p1.len() + "Hello! You said: hello.".len();
        assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p2.len(), cached_tokens: hello_len });
        assert_eq!(metrics.prefix_hit_tokens(CacheTier::Host), hello_len as u64);
        s.shutdown();
    }

    /// The fake model without any roll back (the real engine rolls back only within its log's reach).
    struct NoTruncate(FakeRunner);

    impl Runner for NoTruncate {
        fn vocab_size(&self) -> usize {
            self.0.vocab_size()
        }
        fn create_session(&mut self) -> Result<RunnerSessionId, crate::model::BackendError> {
            self.0.create_session()
        }
        fn free_session(&mut self, session: RunnerSessionId) {
            self.0.free_session(session)
        }
        fn truncate(&mut self, _: RunnerSessionId, _: usize) -> bool {
            false
        }
        fn fork(&mut self, session: RunnerSessionId) -> Option<RunnerSessionId> {
            self.0.fork(session)
        }
        fn feed(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), crate::model::BackendError> {
            self.0.feed(session, tokens)
        }
        fn step(&mut self) -> Result<(), crate::model::BackendError> {
            self.0.step()
        }
        fn logits(&self, session: RunnerSessionId) -> Option<&[f32]> {
            self.0.logits(session)
        }
    }

    #[test]
    fn without_truncate_prompt_checkpoints_serve_repeats_and_divergent_follow_ups() {
        let s = Scheduler::start(Box::new(NoTruncate(FakeRunner::new(8))), Default::default(), Default::default());
        let p1 = prompt("hello");
        let (j, mut rx) = job(p1.clone(), 100);
        s.submit(j).unwrap();
        let (ev, solo) = collect(&mut rx);
        assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p1.len(), cached_tokens: 0 });
        // The same prompt again: served from the prompt checkpoint, logits included, nothing re-fed.
        let (j, mut rx) = job(p1.clone(), 100);
        s.submit(j).unwrap();
        let (ev, again) = collect(&mut rx);
        assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p1.len(), cached_tokens: p1.len() });
        assert_eq!(again, solo);
        // A follow-up whose assistant turn was re-rendered differently still reuses the first prompt.
        let mut p2 = p1.clone();
        p2.extend(FakeCodec.encode("Hi!<|end|>\n<|user|>more\n<|assistant|>").unwrap());
        let (j, mut rx) = job(p2.clone(), 100);
        s.submit(j).unwrap();
        let (ev, text) = collect(&mut rx);
        assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p2.len(), cached_tokens: p1.len() });
        assert_eq!(text, "Hello! You said: more.");
        s.shutdown();
    }

    #[test]
    fn max_tokens_and_context_limits() {
        let config = SchedulerConfig { context_size: 40, ..Default::default() };
        let s = Scheduler::start(Box::new(FakeRunner::new(8)), config, Arc::new(Metrics::default()));
        let (j, mut rx) = job(prompt("hello"), 3);
        s.submit(j).unwrap();
        let (ev, text) = collect(&mut rx);
        assert_eq!(text, "Hel");
        assert_eq!(ev.last().unwrap(), &JobEvent::Done(StopReason::Length));
        let (j, mut rx) = job(prompt(&"x".repeat(50)), 3);
        s.submit(j).unwrap();
        let (ev, _) = collect(&mut rx);
        assert!(matches!(&ev[0], JobEvent::Error(m) if m.contains("context size 40")), "{ev:?}");
        let (j, mut rx) = job(prompt("a long answer"), 1000);
        s.submit(j).unwrap();
        let (ev, text) = collect(&mut rx);
        assert_eq!(ev.last().unwrap(), &JobEvent::Done(StopReason::Length));
        assert_eq!(text.len() + prompt("a long answer").len(), 40);
        s.shutdown();
    }

    #[test]
    fn concurrent_jobs_match_solo_runs_and_queue_bounds() {
        let config = SchedulerConfig { max_active: 3, max_queue: 64, prefill_chunk: 5, ..Default::default() };
        let s = Scheduler::start(Box::new(FakeRunner::new(32)), config, Arc::new(Metrics::default()));
        let mut rxs = Vec::new();
        for i in 0..10 {
            let (j, rx) = job(prompt(&format!("number {i}")), 100);
            s.submit(j).unwrap();
            rxs.push((i, rx));
        }
        for (i, mut rx) in rxs {
            assert_eq!(collect(&mut rx).1, format!("Hello! You said: number {i}."));
        }
        s.shutdown();
        let (j, _rx) = job(prompt("late"), 5);
        assert_eq!(s.submit(j), Err(SubmitError::ShuttingDown));

        let config = SchedulerConfig { max_queue: 0, ..Default::default() };
        let s = Scheduler::start(Box::new(FakeRunner::new(4)), config, Arc::new(Metrics::default()));
        let (j, _rx) = job(prompt("x"), 5);
        assert_eq!(s.submit(j), Err(SubmitError::QueueFull));
        s.shutdown();
    }

    #[test]
    fn decoding_gets_a_token_every_tick_during_another_long_prefill() {
        // The model processes 8 rows per step and the scheduler may queue 512 prompt tokens: a 400-token prompt
        // takes dozens of ticks, and the session already decoding gets one token in each of them. The worker is
        // driven tick by tick here (no thread), so the counts are exact.
        let runner = FakeRunner::new(8).with_batch_tokens(8);
        let queued = Arc::new(AtomicUsize::new(0));
        let mut w = Worker::new(Box::new(runner), SchedulerConfig::default(), Default::default(), queued.clone());
        let submit = |w: &mut Worker, j: GenRequest| {
            queued.fetch_add(1, Ordering::SeqCst);
            w.waiting.push_back((j, Instant::now()));
        };
        let tokens = |rx: &mut UnboundedReceiver<JobEvent>| {
            std::iter::from_fn(|| rx.try_recv().ok()).filter(|e| matches!(e, JobEvent::Token(_))).count()
        };
        let (a, mut rx_a) = job(prompt("a long answer"), 10_000);
        submit(&mut w, a);
        let mut ticks = 0;
        while tokens(&mut rx_a) == 0 {
            w.admit();
            w.tick();
            ticks += 1;
            assert!(ticks < 100, "no first token");
        }
        let long = prompt(&"x".repeat(400));
        let (b, mut rx_b) = job(long.clone(), 3);
        submit(&mut w, b);
        let mut prefill_ticks = 0;
        loop {
            w.admit();
            w.tick();
            let b_started = tokens(&mut rx_b) > 0;
            // One token for the decoding session on every tick, the prefill tick included.
            assert_eq!(tokens(&mut rx_a), 1, "tick {prefill_ticks} of the prefill");
            if b_started {
                break;
            }
            prefill_ticks += 1;
            assert!(prefill_ticks < 1000, "the prefill does not finish");
        }
        assert!(prefill_ticks >= long.len() / 8, "a {}-token prefill in {prefill_ticks} ticks", long.len());
    }

    #[test]
    fn the_ram_tier_is_bounded_by_bytes_not_by_count() {
        // The fake model charges 64 bytes per token: a budget of 150 tokens' worth keeps two ~68-token
        // conversations (prompt + reply) parked, not three; the least recently used one is evicted.
        let config = SchedulerConfig { max_parked_bytes: 150 * 64, ..Default::default() };
        let mut w = Worker::new(Box::new(FakeRunner::new(64)), config, Default::default(), Default::default());
        let run = |w: &mut Worker, p: Vec<u32>| {
            let (j, mut rx) = job(p, 100);
            w.queued.fetch_add(1, Ordering::SeqCst);
            w.waiting.push_back((j, Instant::now()));
            while w.active.len() + w.waiting.len() > 0 {
                w.admit();
                w.tick();
            }
            collect(&mut rx)
        };
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(&format!("conversation {i}"))).collect();
        for p in &prompts {
            run(&mut w, p.clone());
        }
        let held = |w: &Worker, p: &[u32]| w.parked.iter().any(|s| s.tokens.starts_with(p));
        assert_eq!(w.parked.len(), 2, "bytes {}", w.parked_bytes());
        assert!(w.parked_bytes() <= 150 * 64);
        assert!(!held(&w, &prompts[0]) && held(&w, &prompts[1]) && held(&w, &prompts[2]));
        // Using the oldest one makes it recent: the next eviction takes the other.
        let (ev, _) = run(&mut w, prompts[1].clone());
        assert!(matches!(ev[0], JobEvent::Started { cached_tokens, .. } if cached_tokens + 1 >= prompts[1].len()));
        run(&mut w, prompts[0].clone());
        assert!(held(&w, &prompts[0]) && held(&w, &prompts[1]) && !held(&w, &prompts[2]));
        // Many small sessions fit where a count bound of 16 would have evicted: 40 sessions of 1 KiB.
        let config = SchedulerConfig { max_parked_bytes: 1 << 20, ..Default::default() };
        let mut w = Worker::new(Box::new(FakeRunner::new(128)), config, Default::default(), Default::default());
        for i in 0..40 {
            run(&mut w, prompt(&format!("q{i}")));
        }
        assert_eq!(w.parked.len(), 40);
    }

    #[test]
    fn a_dropped_receiver_cancels_and_frees_the_slot() {
        let config = SchedulerConfig { max_active: 1, ..Default::default() };
        let runner = FakeRunner::new(4).with_delay(std::time::Duration::from_millis(2));
        let s = Scheduler::start(Box::new(runner), config, Arc::new(Metrics::default()));
        let (j, mut rx) = job(prompt("a long answer"), 10_000);
        s.submit(j).unwrap();
        // Wait for the first token, then hang up.
        loop {
            if let Some(JobEvent::Token(_)) = rx.blocking_recv() {
                break;
            }
        }
        drop(rx);
        // With max_active = 1 this only completes once the cancelled job has left the active set.
        let (j, mut rx) = job(prompt("next"), 100);
        s.submit(j).unwrap();
        assert_eq!(collect(&mut rx).1, "Hello! You said: next.");
        s.shutdown();
    }
}
