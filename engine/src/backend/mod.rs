//! Backends: implementations of the job-graph ops. `cpu` is the reference backend; `wgpu` runs the same ops as
//! WGSL compute shaders. Every backend exposes the same op surface, the [`Backend`] trait: one method per
//! [`Op`], each reading and writing the named host buffers in [`Activations`] and the sessions' KV tables.
//!
//! A backend may keep device copies and scratch of its own; what it must honour is the contract of each op on the
//! buffers the graph declares (see [`crate::graph::Op::access`]).
//!
//! Device-resident backends (wgpu): the executor brackets every tick with [`Backend::begin_tick`] /
//! [`Backend::end_tick`]. Such a backend keeps the tick's activations in device buffers and fills only
//! [`Activations::logits`] on the host (at the end of the tick); the other `Activations` fields are then left
//! untouched — only the CPU backend fills them. Likewise it may keep a session's KV on the device and leave the
//! host [`SessionKv`] stale (tagged by [`crate::tables::KvSync`]): call [`Backend::sync_kv`] before reading the
//! host arrays (snapshot, persistence, clone); writing them (restore, clear, a new session) resets the tag, and the
//! backend uploads them at the session's next tick.

pub mod cpu;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use crate::graph::{Batch, Op, Sub};
use crate::model::{Model, RopeFreqs};
use crate::tables::SessionKv;
use crate::Result;

/// The named activation buffers of a tick (host memory), sized for the batch by [`Activations::ensure`].
#[derive(Debug, Default)]
pub struct Activations {
    /// `[rows, hc·d]` mHC streams.
    pub streams: Vec<f32>,
    /// `[rows, d]` collapsed sublayer input.
    pub collapsed: Vec<f32>,
    /// `[rows, hc]` post weights of the current sublayer.
    pub post: Vec<f32>,
    /// `[rows, hc·hc]` comb matrix (row-major `[j][k]`) of the current sublayer.
    pub comb: Vec<f32>,
    /// `[rows, d]` sublayer output.
    pub sub_out: Vec<f32>,
    /// `[rows, d]` normed head output.
    pub head_out: Vec<f32>,
    /// `[logit_rows, vocab]`.
    pub logits: Vec<f32>,
}

impl Activations {
    /// Grows the buffers for `rows` batch rows and `logit_rows` output rows (never shrinks).
    pub fn ensure(&mut self, model: &Model, rows: usize, logit_rows: usize) {
        let c = &model.config;
        let grow = |v: &mut Vec<f32>, n: usize| {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        };
        grow(&mut self.streams, rows * c.hc_dim());
        grow(&mut self.collapsed, rows * c.d_model);
        grow(&mut self.post, rows * c.hc_mult);
        grow(&mut self.comb, rows * c.hc_mult * c.hc_mult);
        grow(&mut self.sub_out, rows * c.d_model);
        grow(&mut self.head_out, rows * c.d_model);
        grow(&mut self.logits, logit_rows * c.vocab);
    }
}

/// Rope frequency tables of a model: `[plain, compressed]`.
#[derive(Clone, Debug)]
pub struct RopeSet {
    pub main: RopeFreqs,
    pub compress: RopeFreqs,
}

impl RopeSet {
    /// Frequencies for `model`'s two rope flavours.
    pub fn new(model: &Model) -> RopeSet {
        let c = &model.config;
        RopeSet {
            main: RopeFreqs::new(&c.rope_main, c.rope_dim),
            compress: RopeFreqs::new(&c.rope_compress, c.rope_dim),
        }
    }

    /// The rope of layer `l`.
    pub fn for_layer(&self, model: &Model, l: usize) -> &RopeFreqs {
        if model.config.compress_ratios[l] == 0 {
            &self.main
        } else {
            &self.compress
        }
    }
}

/// Everything an op sees during a tick.
pub struct StepCtx<'a> {
    pub model: &'a Model,
    pub rope: &'a RopeSet,
    pub batch: &'a Batch,
    /// KV state of each run's session, indexed like `batch.runs`.
    pub kv: &'a mut [SessionKv],
    pub act: &'a mut Activations,
    /// Activation simulation (FP8 KV rows, Hadamard + FP4 indexer) on.
    pub sim: bool,
}

/// The op surface every backend implements. See the module docs.
pub trait Backend: Send + Sync {
    /// Short name (`"cpu"`, `"wgpu"`).
    fn name(&self) -> &'static str;
    /// [`Op::Embed`].
    fn embed(&self, cx: &mut StepCtx<'_>) -> Result<()>;
    /// [`Op::HcPre`].
    fn hc_pre(&self, cx: &mut StepCtx<'_>, layer: usize, sub: Sub) -> Result<()>;
    /// [`Op::Attention`].
    fn attention(&self, cx: &mut StepCtx<'_>, layer: usize) -> Result<()>;
    /// [`Op::HcPost`].
    fn hc_post(&self, cx: &mut StepCtx<'_>, layer: usize, sub: Sub) -> Result<()>;
    /// [`Op::Moe`].
    fn moe(&self, cx: &mut StepCtx<'_>, layer: usize) -> Result<()>;
    /// [`Op::HcHead`].
    fn hc_head(&self, cx: &mut StepCtx<'_>) -> Result<()>;
    /// [`Op::Logits`].
    fn logits(&self, cx: &mut StepCtx<'_>) -> Result<()>;

    /// Called by the executor before the first op of a tick. Default: nothing.
    fn begin_tick(&self, _cx: &mut StepCtx<'_>) -> Result<()> {
        Ok(())
    }

    /// Called by the executor after the last op of a tick succeeded; a device backend finishes the tick's work
    /// here if [`Op::Logits`] did not. Default: nothing.
    fn end_tick(&self, _cx: &mut StepCtx<'_>) -> Result<()> {
        Ok(())
    }

    /// Brings the host arrays of `kv` (the state of the session the backend saw at batch slot `slot`) up to date
    /// with the backend's device copy, if it keeps one and `kv.sync.host_stale`. Default (host KV backends):
    /// nothing.
    fn sync_kv(&self, _slot: usize, _kv: &mut SessionKv) -> Result<()> {
        Ok(())
    }

    /// The session at batch slot `slot` was freed: a backend may drop its device copy of the KV (a stale host copy
    /// of that session can then no longer be synced). Default: nothing.
    fn release_kv(&self, _slot: usize) {}

    /// Runs one op (dispatch on the enum).
    fn run_op(&self, op: Op, cx: &mut StepCtx<'_>) -> Result<()> {
        match op {
            Op::Embed => self.embed(cx),
            Op::HcPre { layer, sub } => self.hc_pre(cx, layer, sub),
            Op::Attention { layer } => self.attention(cx, layer),
            Op::HcPost { layer, sub } => self.hc_post(cx, layer, sub),
            Op::Moe { layer } => self.moe(cx, layer),
            Op::HcHead => self.hc_head(cx),
            Op::Logits => self.logits(cx),
        }
    }
}
