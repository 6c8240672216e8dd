//! The public engine API: open a model, create sessions, queue tokens, run ticks, read logits.
//!
//! Each [`Engine::step`] builds one tick's batch over every session with queued tokens (continuous batching):
//! decode sessions (one queued token) first, then prefill chunks, up to `max_batch_tokens` rows in all. The batch
//! runs through the per-tick node graph ([`crate::graph`], built by [`crate::model::recipe`]) on the chosen backend
//! ([`crate::backend`]). Results do not depend on how tokens were chunked: one-pass prefill, chunked prefill and
//! token-by-token decode agree.
//!
//! ```no_run
//! use ds4_engine::engine::{Engine, EngineOptions};
//! # fn main() -> ds4_engine::Result<()> {
//! let mut engine = Engine::open("model.gguf", EngineOptions::default())?;
//! let s = engine.create_session();
//! engine.feed(s, &[0, 5, 17])?;
//! engine.run_until_idle()?;
//! let next = ds4_engine::engine::argmax(engine.logits(s)?);
//! let more = engine.generate_greedy(s, &[next], 8)?;
//! println!("{next} {more:?}");
//! # Ok(())
//! # }
//! ```

use std::path::Path;

use crate::backend::{Activations, Backend, RopeSet, StepCtx};
use crate::exec::Executor;
use crate::gguf::GgufFile;
use crate::graph::{Batch, BufId, Graph, MAX_LOGIT_CANDIDATES};
use crate::model::{Model, ModelConfig};
use crate::tables::{PageLedger, SessionId, SessionKv, SessionTable};
use crate::{Error, Result};

mod state;

/// Which backend runs the ops: the one list of backends ([`crate::backend::registry`]).
pub use crate::backend::registry::BackendKind;

/// Engine options.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub backend: BackendKind,
    /// Exact mode: no FP8/FP4 activation simulation (compare with the golden files).
    pub exact: bool,
    /// CPU backend only: multiply quantized weights with f32 activations instead of quantizing the activations to
    /// Q8_0/Q8_K first (slower). The wgpu backend always uses f32 activations, so this makes the two compute the
    /// same products (cross-backend checks). Independent of `exact`.
    pub f32_acts: bool,
    /// Worker threads (0 = all cores).
    pub threads: usize,
    /// Context length per session (0 = the model's trained context).
    pub ctx: usize,
    /// Rows per tick (prefill chunk size).
    pub max_batch_tokens: usize,
    /// New sessions keep every processed position's logits (see [`Engine::take_all_logits`]); per session with
    /// [`Engine::set_prefill_logits`].
    pub prefill_logits: bool,
    /// Tokens a session can be rolled back by without recomputing anything ([`Engine::rollback`]; R in
    /// [`crate::tables::kv`], which gives the memory it costs per session; a device backend keeps the same log on
    /// the device, `backend::wgpu::kvdev`). 0: no roll-back log (roll back recomputes).
    pub rollback: usize,
    /// Groups of ops run on a second backend (`experts=cpu`: the MoE layers on the CPU, the rest on a GPU
    /// backend; [`crate::exec::Placement`]).
    pub placement: crate::exec::Placement,
}

impl EngineOptions {
    /// Default [`EngineOptions::rollback`].
    pub const DEFAULT_ROLLBACK: usize = 1024;
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            backend: BackendKind::Cpu,
            exact: false,
            f32_acts: false,
            threads: 0,
            ctx: 0,
            max_batch_tokens: 256,
            prefill_logits: false,
            rollback: Self::DEFAULT_ROLLBACK,
            placement: crate::exec::Placement::default(),
        }
    }
}

/// Index of the largest value (lowest index on ties); 0 for an empty slice.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Each layer's compressor `ape` tables (what a roll back needs).
fn apes(model: &Model) -> Vec<crate::tables::kv::LayerApes<'_>> {
    model
        .layers
        .iter()
        .map(|l| {
            (l.compressor.as_ref().map(|c| model.dense(c.ape)), l.indexer.as_ref().map(|i| model.dense(i.comp.ape)))
        })
        .collect()
}

/// The engine. See the module docs.
pub struct Engine {
    model: Model,
    rope: RopeSet,
    backend: Box<dyn Backend>,
    /// The second backend of [`EngineOptions::placement`] (the CPU under `experts=cpu`), if any.
    second: Option<Box<dyn Backend>>,
    opts: EngineOptions,
    ctx: usize,
    sessions: SessionTable,
    act: Activations,
    graph: Graph,
    exec: Executor,
    batch: Batch,
    kv_tmp: Vec<SessionKv>,
    /// Accounting of every session's KV pages (live pages, bytes copied by forks and copy on write).
    pages: PageLedger,
    /// Layers whose streams' means are the kept rows instead of the final streams ([`Engine::set_tap_layers`]).
    taps: Vec<usize>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("backend", &self.backend.name()).field("opts", &self.opts).finish()
    }
}

impl Engine {
    /// Opens (memory-maps) a DS4 GGUF file.
    pub fn open(path: impl AsRef<Path>, opts: EngineOptions) -> Result<Engine> {
        let t0 = std::time::Instant::now();
        let file = GgufFile::open(path.as_ref())?;
        file.prefault();
        let e = Engine::from_gguf(file, opts)?;
        tracing::info!(path = %path.as_ref().display(), ms = t0.elapsed().as_millis() as u64, "engine ready");
        Ok(e)
    }

    /// Builds an engine on an already opened (possibly in-memory) GGUF file.
    pub fn from_gguf(file: GgufFile, opts: EngineOptions) -> Result<Engine> {
        Engine::from_model(Model::load(file)?, opts)
    }

    /// Builds an engine on a loaded model (e.g. the MTP drafter of another engine's file, [`Model::load_mtp`]).
    pub fn from_model(model: Model, opts: EngineOptions) -> Result<Engine> {
        let backend_opts = crate::backend::BackendOptions { threads: opts.threads, f32_acts: opts.f32_acts };
        let backend = crate::backend::registry::create(opts.backend, &backend_opts)?;
        Engine::with_backend(model, opts, backend)
    }

    /// Builds an engine on `model` with a backend made by the caller (e.g. the CUDA backend over a device of its
    /// own, [`crate::backend::cuda::CudaBackend::with_device`]); `opts.backend` must name its kind. The second
    /// backend (placement, host fallback) is made from `opts` as in [`Engine::from_model`].
    pub fn with_backend(model: Model, mut opts: EngineOptions, backend: Box<dyn Backend>) -> Result<Engine> {
        opts.backend = backend.kind();
        let backend_opts = crate::backend::BackendOptions { threads: opts.threads, f32_acts: opts.f32_acts };
        if opts.max_batch_tokens == 0 {
            return Err(Error::InvalidArgument("max_batch_tokens must be > 0".into()));
        }
        backend.set_device_rollback(opts.rollback);
        if matches!(opts.backend, BackendKind::Cpu) && !opts.f32_acts {
            model.pack_dense();
        }
        let mut exec = Executor::default();
        // The placement's second backend, or the CPU beside a backend whose kernels cover part of the graph.
        let second = match opts.placement.second_backend(opts.backend)? {
            Some(kind) => Some(kind),
            None if crate::backend::registry::needs_host_fallback(opts.backend) => Some(BackendKind::Cpu),
            None => None,
        };
        let second = second.map(|kind| crate::backend::registry::create(kind, &backend_opts)).transpose()?;
        for kind in opts.placement.moved_kinds(opts.backend) {
            exec.force_fallback(kind, true);
        }
        for &buf in opts.placement.moved_writers(opts.backend) {
            exec.force_writers_of(buf, true);
        }
        let ctx = if opts.ctx == 0 { model.config.ctx_len.max(1) } else { opts.ctx };
        let rope = RopeSet::new(&model);
        let graph = Graph::default();
        Ok(Engine {
            model,
            rope,
            backend,
            second,
            opts,
            ctx,
            sessions: SessionTable::default(),
            act: Activations::default(),
            graph,
            exec,
            batch: Batch::default(),
            kv_tmp: Vec::new(),
            pages: PageLedger::new(),
            taps: Vec::new(),
        })
    }

    /// The model's hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// The loaded model (weights, file).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Context length per session.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Options the engine was built with.
    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// Bytes copied between the primary and the second backend ([`EngineOptions::placement`]) by the last tick,
    /// each way; zero with one backend.
    pub fn copied_bytes(&self) -> crate::exec::CopiedBytes {
        self.exec.copied_bytes()
    }

    /// The primary backend's device, for reports (`None` on the CPU).
    pub fn device_name(&self) -> Option<String> {
        self.backend.device_name()
    }

    /// The primary backend's device counters ([`crate::backend::device::DeviceCounters`]; `None` on the CPU).
    pub fn device_counters(&self) -> Option<crate::backend::device::DeviceCounters> {
        self.backend.device_counters()
    }

    /// Starts timing each kernel dispatch of the primary backend (GPU timestamps; [`Backend::start_kernel_timing`]);
    /// `false` where it cannot.
    pub fn start_kernel_timing(&self) -> bool {
        self.backend.start_kernel_timing()
    }

    /// Stops kernel timing: each timed dispatch's kernel and GPU seconds, in order (`None`: none was started).
    pub fn kernel_times(&self) -> Result<Option<Vec<(String, f64)>>> {
        self.backend.kernel_times()
    }

    /// Bytes of weights the primary backend holds in device memory (`None` on the CPU); with
    /// `experts=cpu` placement the expert tensors are not among them.
    pub fn device_weight_bytes(&self) -> Option<u64> {
        self.backend.device_weight_bytes()
    }

    /// Turns per-op timing on (from zero) or off; see [`crate::exec::OpTimes`].
    pub fn time_ops(&mut self, on: bool) {
        self.exec.time_ops(on);
    }

    /// Op times summed since timing was turned on or last taken (restarting the count); `None` when it is off.
    pub fn take_op_times(&mut self) -> Option<crate::exec::OpTimes> {
        self.exec.take_op_times()
    }

    /// Whether the executor consults the native overrides (`ds4_kernels_native`; on by default).
    pub fn use_native_kernels(&mut self, on: bool) {
        self.exec.use_native(on);
    }

    /// Nodes placed on native overrides, portable kernels, a fallback backend and whole stages in the last tick.
    pub fn last_placement(&self) -> crate::exec::Placed {
        self.exec.placed()
    }

    /// Which backend and kernel ran each node of the last tick's graph (`--placement-report` on `ds4` and
    /// `ds4-bench`; see [`crate::exec::PlacementReport`]). Empty before the first tick.
    pub fn placement_report(&self) -> crate::exec::PlacementReport {
        self.exec.placement_report(&self.graph)
    }

    /// The node graph of one decode tick of one session at position `pos`.
    pub fn decode_graph(&self, pos: usize) -> Graph {
        let mut b = Batch::default();
        b.push_run(0, pos, [0], false);
        let mut g = Graph::default();
        crate::model::recipe::build(&mut g, &self.model, &b, !self.opts.exact);
        g
    }

    /// [`Engine::decode_graph`] as Graphviz DOT, weights by tensor name (`ds4-bench --print-graph`).
    pub fn decode_graph_dot(&self, pos: usize) -> String {
        self.decode_graph(pos).to_dot(&|w| self.model.name(w).to_string())
    }

    /// Tokens of roll-back log each session keeps: [`EngineOptions::rollback`] where the backend writes the log
    /// ([`Backend::keeps_rollback_log`]), else 0 (no memory spent on a log nothing fills).
    fn rollback_tokens(&self) -> usize {
        if self.backend.keeps_rollback_log() {
            self.opts.rollback
        } else {
            0
        }
    }

    /// Creates an empty session.
    pub fn create_session(&mut self) -> SessionId {
        let log_tokens = self.rollback_tokens();
        let (cfg, ctx) = (&self.model.config, self.ctx);
        let pool = &self.pages;
        let id = self.sessions.create(|| SessionKv::new_in(cfg, ctx, pool));
        let s = id.slot as usize;
        if !PageLedger::same(&self.sessions.kv[s].pool, pool) {
            // A reused slot last held a session restored from another pool.
            self.sessions.kv[s] = SessionKv::new_in(cfg, ctx, pool);
        }
        self.sessions.kv[s].enable_log(cfg, ctx, log_tokens);
        let want = ctx.min(SessionKv::RESERVE_TOKENS_MAX);
        let h = &mut self.sessions.history[s];
        h.reserve(want.saturating_sub(h.len()));
        self.sessions.logits[s].reserve(cfg.vocab);
        self.sessions.want_all_logits[s] = self.opts.prefill_logits;
        id
    }

    fn slot(&self, id: SessionId) -> Result<usize> {
        self.sessions.slot(id).ok_or_else(|| Error::Session(format!("unknown or freed session {id:?}")))
    }

    /// When on, every processed position's logits are kept (read them with [`Engine::take_all_logits`]).
    pub fn set_prefill_logits(&mut self, id: SessionId, on: bool) -> Result<()> {
        let s = self.slot(id)?;
        self.sessions.want_all_logits[s] = on;
        Ok(())
    }

    /// Keeps the final streams (after the last layer, before the head: `hc·d` values) of the last `rows`
    /// positions the session processes from now on, until [`Engine::take_hidden`] — what the MTP drafter reads.
    /// 0 turns it off.
    pub fn set_keep_hidden(&mut self, id: SessionId, rows: usize) -> Result<()> {
        let s = self.slot(id)?;
        self.sessions.keep_hidden[s] = rows;
        if rows == 0 {
            self.sessions.hidden[s].1.clear();
        }
        Ok(())
    }

    /// Makes the kept rows ([`Engine::set_keep_hidden`]) the target features a DSpark drafter reads instead of the
    /// final streams: per position, for each layer of `layers` (strictly increasing) the mean of its `hc` streams
    /// after that layer (`layers.len() · d` values; [`crate::graph::Op::TapStreams`]). Empty: the final streams
    /// again. Kept rows of the old kind are dropped.
    pub fn set_tap_layers(&mut self, layers: &[usize]) -> Result<()> {
        let n = self.model.config.n_layers;
        if layers.iter().any(|&l| l >= n) || layers.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::InvalidArgument(format!(
                "tap layers {layers:?}: need strictly increasing layers of the model's 0..{n}"
            )));
        }
        self.taps = layers.to_vec();
        for h in &mut self.sessions.hidden {
            h.1.clear();
        }
        Ok(())
    }

    /// The tap layers ([`Engine::set_tap_layers`]; empty: the final streams are kept).
    pub fn tap_layers(&self) -> &[usize] {
        &self.taps
    }

    /// Values per kept row: `taps · d` with tap layers set, else the final streams' `hc · d`.
    pub fn kept_width(&self) -> usize {
        let c = &self.model.config;
        if self.taps.is_empty() {
            c.hc_dim()
        } else {
            self.taps.len() * c.d_model
        }
    }

    /// Takes the rows kept since the last call ([`Engine::set_keep_hidden`]): the position of the first row and the
    /// rows (`[n, kept_width]`: final streams, or tap features with [`Engine::set_tap_layers`]). Rows of positions
    /// a roll back removed are gone.
    pub fn take_hidden(&mut self, id: SessionId) -> Result<(usize, Vec<f32>)> {
        let s = self.slot(id)?;
        let pos = self.sessions.pos[s];
        let rows = std::mem::take(&mut self.sessions.hidden[s].1);
        let hcd = self.kept_width();
        let from = pos - rows.len() / hcd;
        self.sessions.hidden[s].0 = pos;
        Ok((from, rows))
    }

    /// Queues tokens for an MTP drafter's session ([`Model::load_mtp`]) with each token's input streams
    /// (`hidden`: `hc·d` values per token; see [`crate::graph::Op::MtpInput`]).
    pub fn feed_with_hidden(&mut self, id: SessionId, tokens: &[u32], hidden: &[f32]) -> Result<()> {
        let hcd = self.model.config.hc_dim();
        if self.model.mtp_input.is_none() {
            return Err(Error::InvalidArgument("feed_with_hidden: the model is not an MTP drafter".into()));
        }
        if hidden.len() != tokens.len() * hcd {
            return Err(Error::InvalidArgument(format!(
                "feed_with_hidden: {} input values for {} tokens of {hcd}",
                hidden.len(),
                tokens.len()
            )));
        }
        self.feed_checked(id, tokens)?;
        let s = self.slot(id)?;
        self.sessions.pending_hidden[s].extend_from_slice(hidden);
        Ok(())
    }

    /// Queues tokens for a session (processed by the next ticks). On an MTP drafter's model the tokens' input
    /// streams are zero (as at its first position); [`Engine::feed_with_hidden`] gives them.
    pub fn feed(&mut self, id: SessionId, tokens: &[u32]) -> Result<()> {
        self.feed_checked(id, tokens)?;
        if self.model.mtp_input.is_some() {
            let s = self.slot(id)?;
            let n = tokens.len() * self.model.config.hc_dim();
            let ph = &mut self.sessions.pending_hidden[s];
            ph.resize(ph.len() + n, 0.0);
        }
        Ok(())
    }

    fn feed_checked(&mut self, id: SessionId, tokens: &[u32]) -> Result<()> {
        let s = self.slot(id)?;
        let vocab = self.model.config.vocab;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!("token id {t} is outside the vocabulary (size {vocab})")));
        }
        let total = self.sessions.pos[s] + self.sessions.pending[s].len() + tokens.len();
        if total > self.ctx {
            return Err(Error::ContextOverflow { tokens: total, ctx: self.ctx });
        }
        self.sessions.pending[s].extend(tokens.iter().copied());
        Ok(())
    }

    /// Tokens processed by a session.
    pub fn position(&self, id: SessionId) -> Result<usize> {
        Ok(self.sessions.pos[self.slot(id)?])
    }

    /// Token ids processed by a session.
    pub fn history(&self, id: SessionId) -> Result<&[u32]> {
        Ok(&self.sessions.history[self.slot(id)?])
    }

    /// Tokens queued for a session and not yet processed by a tick.
    pub fn pending(&self, id: SessionId) -> Result<usize> {
        Ok(self.sessions.pending[self.slot(id)?].len())
    }

    /// Whether any session has queued tokens.
    pub fn has_pending(&self) -> bool {
        self.sessions.with_pending().next().is_some()
    }

    /// Runs one tick. Returns false when there was nothing to do. If an op fails, the tick's sessions are reset to
    /// empty with their processed tokens queued again (consistent state), and the error is returned.
    pub fn step(&mut self) -> Result<bool> {
        let budget = self.opts.max_batch_tokens;
        self.batch.clear();
        let mut used = 0usize;
        let mut candidates = Some(0usize);
        // Decode sessions first, then prefill chunks.
        for pass in 0..2 {
            for s in 0..self.sessions.alive.len() {
                let p = &self.sessions.pending[s];
                if !self.sessions.alive[s] || p.is_empty() || (pass == 0) != (p.len() == 1) || used >= budget {
                    continue;
                }
                let take = p.len().min(budget - used);
                let pos0 = self.sessions.pos[s];
                let all = self.sessions.want_all_logits[s];
                self.batch.push_run(s, pos0, p.iter().copied().take(take), all);
                used += take;
                // Candidates only when every session of the tick asks for no more than them.
                let k = self.sessions.logit_candidates[s];
                candidates = candidates.filter(|_| k > 0 && !all).map(|c| c.max(k));
            }
        }
        if self.batch.rows.is_empty() {
            return Ok(false);
        }
        self.batch.candidates = candidates.unwrap_or(0);
        tracing::debug!(rows = self.batch.rows.len(), runs = self.batch.runs.len(), "tick");
        self.act.ensure(&self.model, self.batch.rows.len(), self.batch.logit_rows.len());
        let hcd = self.model.config.hc_dim();
        if self.model.mtp_input.is_some() {
            self.act.hidden_in.clear();
            for run in &self.batch.runs {
                self.act.hidden_in.extend_from_slice(&self.sessions.pending_hidden[run.slot][..run.len * hcd]);
            }
        }
        let keep_hidden = self.batch.runs.iter().any(|r| self.sessions.keep_hidden[r.slot] > 0);
        let taps: &[usize] = if keep_hidden { &self.taps } else { &[] };
        let kept_width = self.kept_width();
        let mut hidden_out = std::mem::take(&mut self.act.hidden_out);
        if !taps.is_empty() {
            // The tap nodes write the tick's rows in place.
            hidden_out.clear();
            hidden_out.resize(self.batch.rows.len() * kept_width, 0.0);
            self.act.hidden_out = std::mem::take(&mut hidden_out);
        }
        self.kv_tmp.clear();
        for run in &self.batch.runs {
            self.kv_tmp.push(std::mem::take(&mut self.sessions.kv[run.slot]));
        }
        let mut cx = StepCtx {
            model: &self.model,
            rope: &self.rope,
            batch: &self.batch,
            kv: &mut self.kv_tmp,
            act: &mut self.act,
            sim: !self.opts.exact,
        };
        crate::model::recipe::build_with_taps(&mut self.graph, &self.model, &self.batch, !self.opts.exact, taps);
        let mut r = self.exec.run_on(&self.graph, self.backend.as_ref(), self.second.as_deref(), &mut cx);
        if !taps.is_empty() {
            hidden_out = std::mem::take(&mut cx.act.hidden_out);
        } else if r.is_ok() && keep_hidden {
            // The streams after the last layer are still in place (the head reads them, writes elsewhere).
            hidden_out.resize(self.batch.rows.len() * hcd, 0.0);
            r = self.exec.download_final(
                BufId::Streams,
                self.backend.as_ref(),
                self.second.as_deref(),
                &mut cx,
                &mut hidden_out,
            );
        }
        self.act.hidden_out = hidden_out;
        for (run, kv) in self.batch.runs.iter().zip(self.kv_tmp.drain(..)) {
            self.sessions.kv[run.slot] = kv;
        }
        if let Err(e) = r {
            // The tick's sessions may hold half-updated KV state: reset them and queue their whole history again,
            // so they stay consistent (the next ticks recompute them).
            for run in &self.batch.runs {
                let s = run.slot;
                self.sessions.kv[s].clear();
                let hist = std::mem::take(&mut self.sessions.history[s]);
                for &t in hist.iter().rev() {
                    self.sessions.pending[s].push_front(t);
                }
                self.sessions.history[s] = hist;
                self.sessions.history[s].clear();
                self.sessions.pos[s] = 0;
                self.sessions.hidden[s] = (0, Vec::new());
                if self.model.mtp_input.is_some() {
                    // A drafter's input streams of its history are not kept: it starts over, empty.
                    self.sessions.pending[s].clear();
                    self.sessions.pending_hidden[s].clear();
                }
                self.sessions.logits[s].clear();
                self.sessions.logits_partial[s] = false;
                self.sessions.all_logits[s].clear();
            }
            tracing::warn!(error = %e, sessions = self.batch.runs.len(), "tick failed; its sessions were reset");
            return Err(e);
        }
        let vocab = self.model.config.vocab;
        let mut out_row = 0usize;
        for run in &self.batch.runs {
            let s = run.slot;
            for row in &self.batch.rows[run.start..run.start + run.len] {
                self.sessions.history[s].push(row.token);
            }
            self.sessions.pending[s].drain(..run.len);
            if !self.sessions.pending_hidden[s].is_empty() {
                self.sessions.pending_hidden[s].drain(..run.len * hcd);
            }
            let cap = self.sessions.keep_hidden[s];
            if cap > 0 {
                let hcd = kept_width;
                let rows = &self.act.hidden_out[run.start * hcd..(run.start + run.len) * hcd];
                let h = &mut self.sessions.hidden[s];
                if h.1.is_empty() {
                    h.0 = self.sessions.pos[s];
                }
                h.1.extend_from_slice(rows);
                let n = h.1.len() / hcd;
                if n > cap {
                    h.1.drain(..(n - cap) * hcd);
                    h.0 += n - cap;
                }
            }
            self.sessions.pos[s] += run.len;
            let k = self.batch.candidates;
            self.sessions.logits_partial[s] = k > 0;
            if k > 0 {
                let (ids, vals) = (&self.act.cand_ids[out_row * k..][..k], &self.act.cand_vals[out_row * k..][..k]);
                self.sessions.logits[s].resize(vocab, 0.0);
                crate::sampler::expand_candidates(ids, vals, &mut self.sessions.logits[s]);
                out_row += 1;
                continue;
            }
            let n_out = if run.all_logits { run.len } else { 1 };
            let block = &self.act.logits[out_row * vocab..(out_row + n_out) * vocab];
            if run.all_logits {
                self.sessions.all_logits[s].extend_from_slice(block);
            }
            let last = &block[(n_out - 1) * vocab..];
            self.sessions.logits[s].clear();
            self.sessions.logits[s].extend_from_slice(last);
            out_row += n_out;
        }
        Ok(true)
    }

    /// Runs ticks until no session has queued tokens.
    pub fn run_until_idle(&mut self) -> Result<()> {
        while self.step()? {}
        Ok(())
    }

    /// Logits of a session's last processed position.
    pub fn logits(&self, id: SessionId) -> Result<&[f32]> {
        let s = self.slot(id)?;
        if self.sessions.logits[s].is_empty() {
            return Err(Error::Session("no logits yet: the session has not processed any token".into()));
        }
        Ok(&self.sessions.logits[s])
    }

    /// How many of each next-token logits row of session `id` come back from the backend: 0 (the default) the
    /// whole row; `k` in `1..=`[`MAX_LOGIT_CANDIDATES`] only its `k` best ([`crate::sampler::top_candidates`]),
    /// for a sampler whose [`crate::sampler::SamplerConfig::candidates`] is at most `k` — it draws the same ids
    /// from them. A tick in which every session asks for candidates (and none for prefill logits) reads back only
    /// those (a device backend then copies `k` pairs per session instead of `vocab` values); the session's
    /// [`Engine::logits`] row then holds them, every other value −∞ ([`Engine::logits_partial`]). Setting 0 while
    /// the row is partial drops it (so no later reader takes it for a whole row); snapshots and forks never
    /// carry a partial row.
    pub fn set_logit_candidates(&mut self, id: SessionId, k: usize) -> Result<()> {
        let s = self.slot(id)?;
        if k > MAX_LOGIT_CANDIDATES {
            return Err(Error::InvalidArgument(format!("{k} logit candidates (at most {MAX_LOGIT_CANDIDATES})")));
        }
        self.sessions.logit_candidates[s] = k;
        if k == 0 && self.sessions.logits_partial[s] {
            self.sessions.logits[s].clear();
            self.sessions.logits_partial[s] = false;
        }
        Ok(())
    }

    /// Whether session `id`'s [`Engine::logits`] row holds only the candidates of its last tick
    /// ([`Engine::set_logit_candidates`]).
    pub fn logits_partial(&self, id: SessionId) -> Result<bool> {
        Ok(self.sessions.logits_partial[self.slot(id)?])
    }

    /// Whether session `id` keeps every processed position's logits ([`Engine::set_prefill_logits`]).
    pub(crate) fn prefill_logits_on(&self, id: SessionId) -> Result<bool> {
        Ok(self.sessions.want_all_logits[self.slot(id)?])
    }

    /// Sets the logits of session `id`'s last processed position: a caller that rolled back keeps the row it had
    /// for that position (speculative verification keeps the verify tick's row). The row must be the one the model
    /// computed there; the engine cannot check it.
    pub fn set_logits(&mut self, id: SessionId, logits: &[f32]) -> Result<()> {
        let s = self.slot(id)?;
        if logits.len() != self.model.config.vocab {
            return Err(Error::InvalidArgument(format!(
                "{} logits for a vocabulary of {}",
                logits.len(),
                self.model.config.vocab
            )));
        }
        self.sessions.logits[s].clear();
        self.sessions.logits[s].extend_from_slice(logits);
        self.sessions.logits_partial[s] = false;
        Ok(())
    }

    /// Takes the per-position logits collected since [`Engine::set_prefill_logits`] (`[n, vocab]`).
    pub fn take_all_logits(&mut self, id: SessionId) -> Result<Vec<f32>> {
        let s = self.slot(id)?;
        Ok(std::mem::take(&mut self.sessions.all_logits[s]))
    }

    /// Feeds `prompt`, then greedily generates `n` tokens (argmax, lowest id on ties). Returns the generated ids.
    /// The last generated id is not fed back (the session's logits are those that chose it).
    /// With an empty prompt the session must already have logits.
    pub fn generate_greedy(&mut self, id: SessionId, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        if !prompt.is_empty() {
            self.feed(id, prompt)?;
            self.run_until_idle()?;
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let t = argmax(self.logits(id)?);
            out.push(t);
            if i + 1 < n {
                self.feed(id, &[t])?;
                self.run_until_idle()?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // That decode steps allocate nothing (on every thread) is tested in `tests/tests/decode_alloc.rs`, a binary of
    // its own because it replaces the global allocator.

    #[test]
    fn engine_can_move_across_threads() {
        fn assert_send<T: Send>() {}
        assert_send::<Engine>();
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[]), 0);
        assert_eq!("cpu".parse::<BackendKind>().unwrap(), BackendKind::Cpu);
        assert!("tpu".parse::<BackendKind>().is_err());
    }
}
