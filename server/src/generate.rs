//! API-neutral generation: prompt tokens in, a stream of [`GenEvent`]s out, plus usage and the finish reason.
//!
//! [`Generation::start`] checks the context, submits a scheduler job (503 when the queue is full) and returns at once;
//! [`Generation::next`] yields reasoning / content deltas and complete tool calls (with server-made ids, remembered in
//! [`crate::toolmem`]), and `KeepAlive` whenever nothing was yielded for `Limits::keepalive` (SSE writers turn it
//! into a ping or comment). Stop strings cut the content and cancel the job. Dropping a `Generation` cancels its job.
//!
//! Hidden reasoning is not silence: after [`Generation::hide_reasoning`] reasoning deltas are not yielded (they are
//! still remembered for tool calls), so the keep-alive clock keeps running while the model thinks. A streaming
//! writer calls [`Generation::watch`] with its [`SseSender`]: once the client is gone (the response body was dropped)
//! `next` returns `None` at once and the job is cancelled, without waiting for a visible write.
//!
//! Limits: the output may use all of the context the prompt leaves unless the request or the server
//! (`Limits::max_output_tokens`) caps it; reaching the cap is [`Finish::Length`], filling the context
//! [`Finish::ContextFull`] (each API names the two differently). Usage counts the reasoning tokens (every token until
//! one yields content or a tool call) and is mirrored into the request's access-log slot ([`crate::access_log`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::time::Instant;

use crate::api::errors::ApiError;
use crate::model::{OutputParser, Parsed, TokenDecoder, TurnToolCall};
use crate::scheduler::{GenRequest, JobEvent, JobStopReason, SubmitError};
use crate::sse::SseSender;
use crate::state::AppState;
use ds4_engine::sampler::{SamplerConfig, StopChecker, StopStatus};

/// What the generation produced next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GenEvent {
    Reasoning(String),
    Content(String),
    ToolCall(TurnToolCall),
    /// Nothing for a while (send a keep-alive).
    KeepAlive,
}

/// Why the answer ended, in API-neutral terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Finish {
    #[default]
    Stop,
    /// The output limit (`max_tokens`, or the server's `--max-output-tokens`) was reached.
    Length,
    /// The context window filled up (prompt + output reached the server's context size) before the model stopped.
    ContextFull,
    ToolCalls,
    /// A client stop string matched.
    StopSequence,
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// The part of `completion_tokens` generated inside the reasoning block (up to and including `</think>`).
    pub reasoning_tokens: usize,
}

/// Per-request generation options.
#[derive(Debug, Clone)]
pub struct GenOptions {
    pub sampling: SamplerConfig,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// The prompt opened a reasoning block.
    pub thinking: bool,
    /// Prefix of tool call ids (`call_`, `toolu_`).
    pub tool_id_prefix: &'static str,
    /// Plain text completion: no reasoning / tool-call parsing.
    pub raw: bool,
    /// Structured output: the grammar every sampled token must follow ([`crate::structured::plan`]).
    pub constraint: Option<crate::structured::JobConstraint>,
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            sampling: SamplerConfig::default(),
            max_tokens: None,
            stop: Vec::new(),
            thinking: false,
            tool_id_prefix: "call_",
            raw: false,
            constraint: None,
        }
    }
}

/// A random id with `prefix` and 24 hex digits.
pub fn new_id(prefix: &str) -> String {
    let n: u128 = rand::thread_rng().gen();
    format!("{prefix}{:024x}", n & ((1u128 << 96) - 1))
}

/// A running generation.
pub struct Generation {
    state: Arc<AppState>,
    rx: Option<UnboundedReceiver<JobEvent>>,
    decoder: Box<dyn TokenDecoder>,
    parser: Box<dyn OutputParser>,
    opts: GenOptions,
    queue: VecDeque<GenEvent>,
    /// The client's stop strings (holds back content that could begin one); `None` without any.
    stops: Option<StopChecker>,
    reasoning: String,
    usage: Usage,
    finish: Option<Finish>,
    saw_tool_call: bool,
    /// The next token still belongs to the reasoning block.
    in_reasoning: bool,
    keepalive: Duration,
    /// When `next` last returned an event (the keep-alive clock).
    last_yield: Instant,
    hide_reasoning: bool,
    /// The stream's sender: its closing means the client went away.
    watch: Option<SseSender>,
    /// Where the access log reads this request's usage (see [`crate::access_log`]).
    stats: Option<Arc<crate::access_log::Stats>>,
}

impl Generation {
    /// Submit `prompt`; fails on context overflow (400) or a full queue (503).
    pub fn start(state: &Arc<AppState>, prompt: Vec<u32>, mut opts: GenOptions) -> Result<Self, ApiError> {
        let ctx = state.info.context_size;
        if prompt.len() >= ctx {
            return Err(ApiError::context_overflow(prompt.len(), ctx));
        }
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty"));
        }
        // No limit asked for: whatever the context has left (an agent's turn may be long), below the server's cap.
        let room = ctx - prompt.len();
        let cap = state.limits.max_output_tokens.unwrap_or(usize::MAX);
        let max_tokens = opts.max_tokens.unwrap_or(usize::MAX).min(cap).min(room).max(1);
        let (tx, rx) = unbounded_channel();
        let usage = Usage { prompt_tokens: prompt.len(), ..Usage::default() };
        let system_block = state.codec.system_block_len(&prompt);
        let job = GenRequest {
            prompt,
            sampling: opts.sampling.clone(),
            max_tokens,
            eos: state.codec.eos_tokens(),
            system_block,
            events: tx,
            constraint: opts.constraint.take().map(Box::new),
        };
        state.scheduler.submit(job).map_err(|e| match e {
            SubmitError::QueueFull => ApiError::overloaded(1),
            SubmitError::ShuttingDown => ApiError::new(503, "the server is shutting down"),
        })?;
        Ok(Generation {
            state: state.clone(),
            rx: Some(rx),
            decoder: state.codec.decoder(),
            parser: if opts.raw { Box::new(PassThrough) } else { state.codec.parser(opts.thinking) },
            in_reasoning: opts.thinking && !opts.raw,
            stops: (!opts.stop.is_empty()).then(|| StopChecker::new(opts.stop.iter().cloned(), None)),
            opts,
            queue: VecDeque::new(),
            reasoning: String::new(),
            usage,
            finish: None,
            saw_tool_call: false,
            keepalive: state.limits.keepalive,
            last_yield: Instant::now(),
            hide_reasoning: false,
            watch: None,
            stats: crate::access_log::current(),
        }
        .reported())
    }

    /// Do not yield reasoning deltas (the client does not show them); keep-alives cover the silence.
    pub fn hide_reasoning(&mut self) {
        self.hide_reasoning = true;
    }

    /// Stop (and cancel the job) as soon as `tx`'s client is gone, even while nothing is being written.
    pub fn watch(&mut self, tx: &SseSender) {
        self.watch = Some(tx.clone());
    }

    /// Usage so far (complete once `next` returned `None`).
    pub fn usage(&self) -> Usage {
        self.usage
    }

    /// The finish reason, once `next` returned `None`.
    pub fn finish(&self) -> Finish {
        self.finish.unwrap_or(Finish::Stop)
    }

    /// The next event; `None` when done (or the watched client is gone); an error when the model side failed.
    pub async fn next(&mut self) -> Option<Result<GenEvent, ApiError>> {
        loop {
            if let Some(ev) = self.queue.pop_front() {
                self.last_yield = Instant::now();
                return Some(Ok(ev));
            }
            let rx = self.rx.as_mut()?;
            let deadline = self.last_yield + self.keepalive;
            let watch = self.watch.as_ref();
            let ev = tokio::select! {
                biased;
                _ = client_gone(watch) => {
                    tracing::debug!("client went away; cancelling the generation");
                    self.rx = None; // cancels the job
                    self.watch = None;
                    return None;
                }
                r = tokio::time::timeout_at(deadline, rx.recv()) => r,
            };
            let ev = match ev {
                Err(_) => {
                    self.last_yield = Instant::now();
                    if self.watch.is_some() {
                        self.state.metrics.keepalives.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    return Some(Ok(GenEvent::KeepAlive));
                }
                Ok(ev) => ev,
            };
            match ev {
                Some(JobEvent::Started { prompt_tokens, cached_tokens }) => {
                    self.usage.prompt_tokens = prompt_tokens;
                    self.usage.cached_tokens = cached_tokens;
                    self.report();
                }
                Some(JobEvent::Token(t)) => {
                    self.usage.completion_tokens += 1;
                    let text = self.decoder.push(t);
                    let parsed = self.parser.push(&text);
                    // A token is reasoning until one yields content or a call (`</think>` itself yields nothing).
                    if parsed.iter().any(|p| !matches!(p, Parsed::Reasoning(_))) {
                        self.in_reasoning = false;
                    }
                    if self.in_reasoning {
                        self.usage.reasoning_tokens += 1;
                    }
                    self.absorb(parsed);
                    self.report();
                }
                Some(JobEvent::Done(reason)) => {
                    if reason == JobStopReason::Eos {
                        self.usage.completion_tokens += 1;
                    }
                    let full = self.usage.prompt_tokens + self.usage.completion_tokens >= self.state.info.context_size;
                    self.end(match reason {
                        JobStopReason::Length if full => Finish::ContextFull,
                        JobStopReason::Length => Finish::Length,
                        _ => Finish::Stop,
                    });
                    self.report();
                }
                Some(JobEvent::Error(e)) => {
                    self.rx = None;
                    return Some(Err(ApiError::internal(e)));
                }
                None => {
                    self.rx = None;
                    return Some(Err(ApiError::internal("the scheduler stopped")));
                }
            }
        }
    }

    /// Hands the usage so far to the access log.
    fn report(&self) {
        if let Some(s) = &self.stats {
            s.set_usage(self.usage);
        }
    }

    fn reported(self) -> Self {
        self.report();
        self
    }

    /// Flush decoder and parser, then stop.
    fn end(&mut self, finish: Finish) {
        if self.rx.is_none() {
            return;
        }
        let tail = self.decoder.finish();
        let mut parsed = self.parser.push(&tail);
        parsed.extend(self.parser.finish());
        self.absorb(parsed);
        if self.finish.is_none() {
            self.flush_held();
            self.finish = Some(if self.saw_tool_call { Finish::ToolCalls } else { finish });
        }
        self.rx = None;
    }

    fn absorb(&mut self, parsed: Vec<Parsed>) {
        for p in parsed {
            if self.finish.is_some() {
                return;
            }
            match p {
                Parsed::Reasoning(r) => {
                    self.reasoning.push_str(&r);
                    if !self.hide_reasoning {
                        self.queue.push_back(GenEvent::Reasoning(r));
                    }
                }
                Parsed::Content(c) => self.content(c),
                Parsed::ToolCall { name, arguments } => {
                    self.flush_held();
                    let id = new_id(self.opts.tool_id_prefix);
                    self.state.tools.remember(&id, &name, &arguments, &self.reasoning);
                    self.saw_tool_call = true;
                    self.queue.push_back(GenEvent::ToolCall(TurnToolCall { id, name, arguments }));
                }
            }
        }
    }

    /// Content goes through the stop-string filter.
    fn content(&mut self, text: String) {
        let Some(stops) = self.stops.as_mut() else {
            self.queue.push_back(GenEvent::Content(text));
            return;
        };
        let (emit, stopped) = match stops.push(&text) {
            StopStatus::Continue { emit } => (emit, false),
            StopStatus::Stop { emit, .. } => (emit, true),
        };
        if !emit.is_empty() {
            self.queue.push_back(GenEvent::Content(emit));
        }
        if stopped {
            self.finish = Some(Finish::StopSequence);
            self.rx = None; // cancels the job
        }
    }

    /// Content held back for the stop strings goes out (a tool call follows it, or the answer ended).
    fn flush_held(&mut self) {
        let held = self.stops.as_mut().map(StopChecker::finish).unwrap_or_default();
        if !held.is_empty() {
            self.queue.push_back(GenEvent::Content(held));
        }
    }

    /// Run to the end, collecting everything (non-streaming requests).
    pub async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut out = Collected::default();
        while let Some(ev) = self.next().await {
            match ev? {
                GenEvent::Reasoning(r) => out.reasoning.push_str(&r),
                GenEvent::Content(c) => out.content.push_str(&c),
                GenEvent::ToolCall(c) => out.tool_calls.push(c),
                GenEvent::KeepAlive => {}
            }
        }
        out.finish = self.finish();
        out.usage = self.usage();
        Ok(out)
    }
}

/// Resolves when the watched client is gone; never without a watch.
async fn client_gone(watch: Option<&SseSender>) {
    match watch {
        Some(tx) => tx.closed().await,
        None => std::future::pending().await,
    }
}

/// The parser of raw completions: everything is content.
struct PassThrough;

impl OutputParser for PassThrough {
    fn push(&mut self, text: &str) -> Vec<Parsed> {
        if text.is_empty() {
            Vec::new()
        } else {
            vec![Parsed::Content(text.to_string())]
        }
    }

    fn finish(&mut self) -> Vec<Parsed> {
        Vec::new()
    }
}

/// A whole answer.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<TurnToolCall>,
    pub finish: Finish,
    pub usage: Usage,
}
