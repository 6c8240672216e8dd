//! Backends: kernel providers for the node graph ([`crate::graph`], built by [`crate::model::recipe`]). `cpu` is
//! the reference backend; `wgpu` runs WGSL compute shaders; `cuda` runs the CUDA kernels of `ds4_kernels_native`
//! on an NVIDIA GPU, with a CPU backend beside it for the ops it has no kernel for yet.
//!
//! A backend owns the tick's tensors (a [`crate::graph::BufId`] resolves to a buffer of its own) and offers a
//! kernel per op kind it supports ([`Backend::supports`], [`Backend::run_node`]); it may also host native
//! overrides from `ds4_kernels_native` ([`Backend::run_native`]). The executor ([`crate::exec`]) places each node:
//! a native override first, then the backend's portable kernel; a stage with a node the backend has no kernel
//! for runs whole through [`Backend::run_stage`] (no backend needs it today: both have a kernel for every op kind).
//! A second backend (the CPU, as host fallback) can take nodes the first has no kernel for, or op kinds forced
//! there; the executor then copies tensors between the two through [`Backend::download`] / [`Backend::upload`]
//! where their residency changes (only tensors with one host layout, [`BufId::host_width`]; the KV pages never
//! move: nodes touching them stay with the primary when it keeps the KV on its device, [`Backend::kv_on_device`],
//! and may run on the fallback when the KV is host memory). The only host tensor every backend fills is [`Activations::logits`] (by [`crate::graph::Op::Readback`]
//! on a device backend).
//!
//! Device-resident backends (wgpu): the executor brackets every tick with [`Backend::begin_tick`] /
//! [`Backend::end_tick`]. Such a backend may keep a session's KV on the device and leave the host [`SessionKv`]
//! stale (tagged by [`crate::tables::KvSync`]): call [`Backend::sync_kv`] before reading the host arrays
//! (snapshot, persistence, clone); writing them (restore, clear, a new session) resets the tag, and the backend
//! uploads them at the session's next tick.

pub mod cpu;
pub mod cuda;
pub mod device;
pub mod registry;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use registry::{BackendKind, BackendOptions};

use crate::graph::{Batch, BufId, Op, Stage};
use crate::model::{Model, ModelConfig, RopeFreqs};
use crate::tables::SessionKv;
use crate::Result;

/// The host outputs of a tick, sized for the batch by [`Activations::ensure`].
#[derive(Debug, Default)]
pub struct Activations {
    /// `[logit_rows, vocab]` (not filled in a tick whose batch asks for candidates).
    pub logits: Vec<f32>,
    /// `[logit_rows, k]` ids and values of each logit row's `k` best logits in a tick whose batch asks for `k`
    /// candidates ([`crate::graph::Op::LogitCandidates`]).
    pub cand_ids: Vec<u32>,
    pub cand_vals: Vec<f32>,
    /// Host input of [`crate::graph::Op::MtpInput`]: `[rows, hc·d]`, each row's input streams (filled by the
    /// engine from what its caller queued; empty for the target model).
    pub hidden_in: Vec<f32>,
    /// The tick's final streams `[rows, hc·d]` (after the last layer, before the head), for the sessions that
    /// keep them ([`crate::engine::Engine::set_keep_hidden`]); filled by the engine after the tick.
    pub hidden_out: Vec<f32>,
}

impl Activations {
    /// Grows the buffers for `logit_rows` output rows (never shrinks).
    pub fn ensure(&mut self, model: &Model, _rows: usize, logit_rows: usize) {
        let n = logit_rows * model.config.vocab;
        if self.logits.len() < n {
            self.logits.resize(n, 0.0);
        }
        let k = logit_rows * crate::graph::MAX_LOGIT_CANDIDATES;
        if self.cand_ids.len() < k {
            self.cand_ids.resize(k, u32::MAX);
            self.cand_vals.resize(k, f32::NEG_INFINITY);
        }
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

/// A kernel provider. See the module docs.
pub trait Backend: Send + Sync {
    /// Which backend of the registry this is; native overrides name their hosting backend by it.
    fn kind(&self) -> BackendKind;

    /// Short name (`"cpu"`, `"wgpu"`), for errors and reports.
    fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Whether the backend has a portable kernel for `op` with `model`'s shapes and weight types.
    fn supports(&self, op: &Op, model: &Model) -> bool;

    /// Runs `op` with the backend's portable kernel.
    fn run_node(&self, op: &Op, cx: &mut StepCtx<'_>) -> Result<()>;

    /// Runs `op` with the native override `kernel`; `Ok(false)` when the backend cannot host that kernel for
    /// this op (the executor then uses the portable kernel). Default: hosts none.
    fn run_native(&self, _op: &Op, _kernel: &ds4_kernels_native::NativeKernel, _cx: &mut StepCtx<'_>) -> Result<bool> {
        Ok(false)
    }

    /// Runs a whole stage at once (for a backend without kernels for some of its nodes). Default: unsupported.
    fn run_stage(&self, stage: Stage, _cx: &mut StepCtx<'_>) -> Result<()> {
        Err(crate::Error::Backend { backend: self.name(), what: format!("no kernels for stage {stage:?}") })
    }

    /// Whether the executor should hand this backend groups of independent nodes ([`Backend::run_group`]).
    /// Default: no (the backend sees every node alone, in recipe order).
    fn runs_groups(&self) -> bool {
        false
    }

    /// Runs `ops`, weight products ([`Op::MatMul`]) placed on the portable kernel that were all ready at once
    /// (independent of each other: no one reads or writes what another writes). The result must be the same as
    /// running them one by one. Default: one by one, in order.
    fn run_group(&self, ops: &[Op], cx: &mut StepCtx<'_>) -> Result<()> {
        ops.iter().try_for_each(|op| self.run_node(op, cx))
    }

    /// Copies this tick's value of tensor `id` (one with a host layout, [`BufId::host_width`]) into `out`
    /// (`rows · width` values), for the executor's residency copies ([`crate::exec`]). Default: unsupported.
    fn download(&self, id: BufId, _cx: &mut StepCtx<'_>, _out: &mut [f32]) -> Result<()> {
        Err(crate::Error::Backend { backend: self.name(), what: format!("no download of {id:?}") })
    }

    /// Makes `data` (`rows · width` values, as [`Backend::download`] gives them) this tick's value of tensor `id`,
    /// ordered after everything the backend ran before. Default: unsupported.
    fn upload(&self, id: BufId, _cx: &mut StepCtx<'_>, _data: &[f32]) -> Result<()> {
        Err(crate::Error::Backend { backend: self.name(), what: format!("no upload of {id:?}") })
    }

    /// Called by the executor before the first node of a tick. Default: nothing.
    fn begin_tick(&self, _cx: &mut StepCtx<'_>) -> Result<()> {
        Ok(())
    }

    /// Called by the executor after the last node of a tick succeeded; a device backend finishes the tick's work
    /// here. Default: nothing.
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

    /// Forks the device copy of the session at batch slot `slot` (host state `kv`) on the device, for a new
    /// session at slot `dst` whose host arrays then stay stale; returns the new session's sync tag and the bytes
    /// copied (a paged device tier shares its KV pages and copies only the private tail), or `None` when the
    /// backend holds no device copy of that state. Default: `None`.
    fn fork_kv(&self, _slot: usize, _kv: &SessionKv, _dst: usize) -> Result<Option<(crate::tables::KvSync, u64)>> {
        Ok(None)
    }

    /// The device the backend runs on, for reports (`"NVIDIA H100 (Vulkan, DiscreteGpu)"`); `None` for a host
    /// backend. Default: `None`.
    fn device_name(&self) -> Option<String> {
        None
    }

    /// What the backend's device has done so far (dispatches, host syncs, bytes each way, weight bytes fetched
    /// against the least possible), monotonic; `None` for a host backend. Default: `None`.
    fn device_counters(&self) -> Option<device::DeviceCounters> {
        None
    }

    /// Starts timing each kernel dispatch on the device (timestamp queries); `false` when the backend cannot (a
    /// host backend, a device without timestamps). Default: `false`.
    fn start_kernel_timing(&self) -> bool {
        false
    }

    /// Stops timing and returns each timed dispatch's kernel and GPU seconds, in order (`None`: no timing was
    /// started). Default: `None`.
    fn kernel_times(&self) -> crate::Result<Option<Vec<(String, f64)>>> {
        Ok(None)
    }

    /// Bytes of weights held in the backend's device memory (uploaded on first use), or `None` for a backend that
    /// reads them from the memory-mapped file. Default: `None`.
    fn device_weight_bytes(&self) -> Option<u64> {
        None
    }

    /// `(live, shared)` device KV pages of a paged device tier over all its sessions — row pages and roll-back log
    /// chunks (shared: referenced by more than one session) — or `None` for a backend that keeps KV on the host.
    /// Default: `None`.
    fn device_kv_pages(&self) -> Option<(usize, usize)> {
        None
    }

    /// Sets R, the tokens of roll-back log a device-resident backend keeps on the device for each session it
    /// mirrors (0: none); the engine calls it once, with [`crate::EngineOptions::rollback`]. Default: ignored.
    fn set_device_rollback(&self, _tokens: usize) {}

    /// Smallest length the backend's device copy of the session at batch slot `slot` (host state `kv`, `pos` tokens
    /// processed) can be rolled back to in place from a log kept on the device ([`Backend::rollback_kv`]); `None`
    /// when the backend holds no device copy of that state. Default: `None`.
    fn device_rollback_floor(&self, _slot: usize, _kv: &SessionKv, _cfg: &ModelConfig, _pos: usize) -> Option<usize> {
        None
    }

    /// Rolls the device copy of the session at batch slot `slot` (host state `kv`) back from `pos` to `len`
    /// tokens in place, exactly (the state of a cold run to `len`), when `device_rollback_floor <= len <= pos`;
    /// `Ok(false)` (nothing changed) otherwise. Default: `Ok(false)`.
    fn rollback_kv(&self, _slot: usize, _kv: &mut SessionKv, _model: &Model, _pos: usize, _len: usize) -> Result<bool> {
        Ok(false)
    }

    /// Whether the backend keeps session KV on its device (then the nodes touching KV pages run on it and
    /// nowhere else). `false`: the KV is the host [`SessionKv`] arrays, and a node the backend has no kernel for
    /// may run on the host fallback whatever it touches. Default: `false`.
    fn kv_on_device(&self) -> bool {
        false
    }

    /// Whether this backend's kernels write each session's roll-back log ([`crate::tables::kv`]'s `TokenLog`, by
    /// [`crate::graph::Op::WindowStore`]). The engine allocates the log only then (elsewhere roll back recomputes).
    /// Default: no.
    fn keeps_rollback_log(&self) -> bool {
        false
    }
}
