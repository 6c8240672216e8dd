//! Device creation, limits, the pipeline cache and small buffer helpers for the wgpu backend.
//!
//! [`WgpuContext::new`] picks an adapter (honouring `WGPU_BACKEND`, e.g. `vulkan`), requests a device with the
//! adapter's own limits (so `max_storage_buffer_binding_size` is as large as the hardware allows) and records the
//! effective binding limit in [`WgpuContext::max_binding`]. That limit drives weight splitting
//! ([`super::weights`]); [`ContextOptions::max_binding_override`] lowers it artificially so tests can exercise the
//! splitting on tiny tensors.
//!
//! ScratchBuf buffers come from a pool keyed by size class ([`WgpuContext::scratch`]: power-of-two sizes, returned
//! on drop, contents undefined). The context counts what it does ([`DeviceCounters`]: submissions, readbacks,
//! dispatches, bind groups made, bytes each way, weight bytes fetched), so tests and `ds4-bench` can pin what a tick
//! costs. Uniform blocks are cached by content and bind groups by pipeline and buffers ([`WgpuContext::uniform`],
//! [`WgpuContext::next_tick`]).
//!
//! Pipelines are compiled once per (kernel name) and cached; shader compile and validation errors are captured with
//! an error scope and returned as [`Error::Backend`] instead of wgpu's default panic.
//!
//! Tests get a context through [`test_context`]: with no adapter it returns `None` (test skipped with a message),
//! except when `CI=true`, where the missing adapter is a failure (CI installs lavapipe).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use wgpu::util::DeviceExt;

use crate::backend::device::DeviceCounters;
use crate::error::{Error, Result};
use ds4_shaders_wgsl::Reduce;

/// Options for [`WgpuContext::with_options`].
#[derive(Clone, Debug, Default)]
pub struct ContextOptions {
    /// Use at most this many bytes per storage binding (must be a positive multiple of 4), even when the device
    /// allows more. For tests of weight splitting.
    pub max_binding_override: Option<u64>,
    /// Sum the product kernels' lanes through workgroup memory only, even where the adapter has subgroups (the same
    /// bits either way; for tests of both paths, and for a driver whose subgroups misbehave). The environment
    /// variable `DS4_WGPU_SUBGROUPS=0` sets it too.
    pub no_subgroups: bool,
}

/// A wgpu device and queue plus the backend's shared caches.
pub struct WgpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub(super) max_binding: u64,
    reduce: Reduce,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    /// Each pipeline's `name::entry`, for the timing labels.
    pipeline_names: Mutex<HashMap<wgpu::ComputePipeline, String>>,
    /// The open timing window, if any ([`super::timing`]).
    timing: Mutex<Option<super::timing::Timing>>,
    /// ScratchBuf buffers by size class (see [`WgpuContext::scratch`]).
    pool: Arc<Mutex<HashMap<u64, Vec<wgpu::Buffer>>>>,
    /// Uniform blocks by content, and bind groups by pipeline and bound buffers: made once and reused while the
    /// buffers live and each tick uses them (see [`WgpuContext::next_tick`], [`WgpuContext::forget_bindings`]).
    uniforms: Mutex<HashMap<Vec<u8>, wgpu::Buffer>>,
    /// 256 zero bytes, bound where a kernel's optional read-only input is absent ([`WgpuContext::zeros`]).
    zeros: wgpu::Buffer,
    /// Bind groups with the tick ([`WgpuContext::next_tick`]) that last used each.
    binds: Mutex<HashMap<BindKey, (wgpu::BindGroup, u64)>>,
    tick: AtomicU64,
    submits: AtomicU64,
    readbacks: AtomicU64,
    dispatches: AtomicU64,
    bind_groups: AtomicU64,
    passes: AtomicU64,
    pub(super) copy_kernels: AtomicU64,
    host_to_device: AtomicU64,
    device_to_host: AtomicU64,
    weights_fetched: AtomicU64,
    weights_min: AtomicU64,
    split_dispatches: AtomicU64,
}

/// A command encoder that keeps one compute pass open across consecutive dispatches
/// ([`WgpuContext::dispatch_at`]): a tick's kernels between two copy commands are one pass. Copies recorded as
/// kernels wait in the encoder ([`super::copies`]) and go out as one dispatch per batch of independent copies
/// before the next dispatch, the next raw command ([`WgpuContext::raw_encoder`], which also ends the open pass)
/// or the submission. Dispatches within a pass are ordered and see each other's writes (WebGPU's per-dispatch
/// usage scopes), so a pass boundary is needed only where the encoder itself records something.
pub struct Enc {
    /// Declared first: dropped (the pass ended) before the encoder.
    pub(super) pass: Option<wgpu::ComputePass<'static>>,
    pub(super) enc: wgpu::CommandEncoder,
    /// Copies recorded but not yet dispatched, in order ([`super::copies`]).
    pub(super) pending: Vec<super::copies::Segment>,
    /// A dispatch held to pair with the next one ([`super::pairs`]).
    pub(super) held: Option<super::pairs::Held>,
}

impl Enc {
    /// Ends the open pass, if any, and finishes the encoder (pending copies must have been flushed).
    fn finish(mut self) -> wgpu::CommandBuffer {
        debug_assert!(self.pending.is_empty() && self.held.is_none());
        self.pass = None;
        self.enc.finish()
    }

    pub(super) fn end_pass(&mut self) {
        self.pass = None;
    }
}

impl std::ops::Deref for Enc {
    type Target = wgpu::CommandEncoder;
    fn deref(&self) -> &wgpu::CommandEncoder {
        &self.enc
    }
}

/// A dispatch's workgroup counts: given, or read by the device from a buffer at a byte offset.
#[derive(Clone, Copy)]
enum Grid<'a> {
    Direct([u32; 3]),
    Indirect(&'a wgpu::Buffer, u64),
}

/// A bind group's identity: the pipeline and each `(binding, buffer, offset, size)` (size 0: the whole buffer).
type BindKey = (wgpu::ComputePipeline, Vec<(u32, wgpu::Buffer, u64, u64)>);

/// Cached uniform blocks or bind groups beyond which a cache starts afresh (per-tick buffers, e.g. key lists, make
/// entries that are never hit again).
const BIND_CACHE_MAX: usize = 8192;

/// Ticks a cached bind group survives unused ([`WgpuContext::next_tick`]).
pub const BIND_KEEP_TICKS: u64 = 4;

/// Buffers at least this large, when created, drop the cached bind groups (which keep their buffers alive), so a
/// replaced tensor or pool buffer is freed.
const BIG_BUFFER: u64 = 1 << 20;

/// A pooled scratch buffer: returned to its context's pool when dropped. Its contents are undefined when handed
/// out unless it came from [`WgpuContext::scratch_zeroed`] (zeroed in the encoder). Never `queue.write_buffer`
/// into a scratch buffer: the write would land at the next submit, before commands recorded earlier in the same
/// encoder that may still read the buffer's previous use.
pub struct ScratchBuf {
    buf: Option<wgpu::Buffer>,
    pool: Arc<Mutex<HashMap<u64, Vec<wgpu::Buffer>>>>,
}

impl std::ops::Deref for ScratchBuf {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        self.buf.as_ref().expect("scratch buffer present until drop")
    }
}

impl Drop for ScratchBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.lock().entry(b.size()).or_default().push(b);
        }
    }
}

/// The product kernels' lane sums for a device: subgroup shuffles below the adapter's smallest subgroup size when
/// the device has subgroups and that size is a power of two, else workgroup memory (the same bits either way).
fn reduce_for(features: wgpu::Features, subgroup_min_size: u32, no_subgroups: bool) -> Reduce {
    if no_subgroups || !features.contains(wgpu::Features::SUBGROUP) || !subgroup_min_size.is_power_of_two() {
        return Reduce::Shared;
    }
    Reduce::Subgroup { min_size: subgroup_min_size }
}

pub(crate) fn backend_err(what: impl Into<String>) -> Error {
    Error::Backend { backend: "wgpu", what: what.into() }
}

impl WgpuContext {
    /// Opens the first adapter wgpu offers (see module docs) with default options.
    pub fn new() -> Result<Self> {
        Self::with_options(ContextOptions::default())
    }

    /// Opens an adapter and device; fails with a clear message when no adapter exists.
    pub fn with_options(opts: ContextOptions) -> Result<Self> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
            apply_limit_buckets: false,
        }))
        .map_err(|e| {
            backend_err(format!(
                "no GPU adapter found ({e}); on Linux install a Vulkan driver \
                 (e.g. `apt-get install mesa-vulkan-drivers libvulkan1`) or pick a backend with WGPU_BACKEND"
            ))
        })?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("ds4"),
            // Timestamp queries where the adapter has them (per-dispatch GPU times, `timing`).
            // Subgroups where the adapter has them (the product kernels' lane sums, `reduce`).
            required_features: adapter.features() & (wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::SUBGROUP),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| backend_err(format!("request_device on {}: {e}", info.name)))?;
        let no_subgroups = opts.no_subgroups || std::env::var("DS4_WGPU_SUBGROUPS").is_ok_and(|v| v.trim() == "0");
        let reduce = reduce_for(device.features(), info.subgroup_min_size, no_subgroups);
        let hw = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size) & !3;
        let max_binding = match opts.max_binding_override {
            Some(n) if n == 0 || !n.is_multiple_of(4) => {
                return Err(Error::InvalidArgument(format!(
                    "max_binding_override {n} must be a positive multiple of 4"
                )))
            }
            Some(n) => n.min(hw),
            None => hw,
        };
        tracing::info!(
            adapter = %info.name,
            backend = ?info.backend,
            max_binding,
            max_buffer = limits.max_buffer_size,
            lane_sums = %reduce.tag(),
            "wgpu device ready"
        );
        let zeros = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("zeros"),
            size: 256,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let mut ctx = Self {
            device,
            queue,
            info,
            limits,
            max_binding,
            reduce,
            pipelines: Mutex::new(HashMap::new()),
            pipeline_names: Mutex::new(HashMap::new()),
            timing: Mutex::new(None),
            pool: Arc::new(Mutex::new(HashMap::new())),
            uniforms: Mutex::new(HashMap::new()),
            zeros,
            binds: Mutex::new(HashMap::new()),
            tick: AtomicU64::new(0),
            submits: AtomicU64::new(0),
            readbacks: AtomicU64::new(0),
            dispatches: AtomicU64::new(0),
            bind_groups: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            copy_kernels: AtomicU64::new(0),
            host_to_device: AtomicU64::new(0),
            device_to_host: AtomicU64::new(0),
            weights_fetched: AtomicU64::new(0),
            weights_min: AtomicU64::new(0),
            split_dispatches: AtomicU64::new(0),
        };
        ctx.check_subgroups();
        Ok(ctx)
    }

    /// Keeps subgroup lane sums only where the probe finds the subgroups holding consecutive local invocation
    /// indices (what the product kernels' shuffles assume; no API promises it); otherwise, or when the probe cannot
    /// run, sums through workgroup memory (the same results, more barriers). Leaves the counters at zero.
    fn check_subgroups(&mut self) {
        let Reduce::Subgroup { min_size } = self.reduce else { return };
        let why = match self.subgroups_are_consecutive(min_size) {
            Ok(true) => None,
            Ok(false) => Some("subgroups do not hold consecutive invocations".to_string()),
            Err(e) => Some(format!("the subgroup probe failed: {e}")),
        };
        if let Some(why) = why {
            tracing::warn!(adapter = %self.info.name, "{why}; product lane sums go through workgroup memory");
            self.reduce = Reduce::Shared;
        }
        self.reset_counters();
    }

    /// Zeroes every counter [`WgpuContext::counters`] reads.
    fn reset_counters(&self) {
        for c in [
            &self.submits,
            &self.readbacks,
            &self.dispatches,
            &self.bind_groups,
            &self.passes,
            &self.copy_kernels,
            &self.host_to_device,
            &self.device_to_host,
            &self.weights_fetched,
            &self.weights_min,
            &self.split_dispatches,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// Runs `lane_probe.wgsl` for subgroups of at least `min_size`: whether every invocation found its shuffle
    /// partners at `li ^ s`.
    pub(crate) fn subgroups_are_consecutive(&self, min_size: u32) -> Result<bool> {
        let pl = self.pipeline(&format!("lane_probe_sg{min_size}"), &ds4_shaders_wgsl::lane_probe_source(min_size))?;
        let out = self.storage_zeroed("lane probe", 64);
        let mut enc = self.encoder();
        self.dispatch(&mut enc, &pl, &[&out], [1, 1, 1])?;
        let got = self.submit_read_u32(enc, &out, 0, 64)?;
        Ok(got.iter().all(|&v| v == 1))
    }

    /// Everything counted so far (monotonic; subtract two reads to count a tick's).
    pub fn counters(&self) -> DeviceCounters {
        DeviceCounters {
            submits: self.submits.load(Ordering::Relaxed),
            readbacks: self.readbacks.load(Ordering::Relaxed),
            dispatches: self.dispatches.load(Ordering::Relaxed),
            bind_groups: self.bind_groups.load(Ordering::Relaxed),
            passes: self.passes.load(Ordering::Relaxed),
            copy_kernels: self.copy_kernels.load(Ordering::Relaxed),
            host_to_device: self.host_to_device.load(Ordering::Relaxed),
            device_to_host: self.device_to_host.load(Ordering::Relaxed),
            weights_fetched: self.weights_fetched.load(Ordering::Relaxed),
            weights_min: self.weights_min.load(Ordering::Relaxed),
            split_dispatches: self.split_dispatches.load(Ordering::Relaxed),
        }
    }

    /// Counts a weight product's fetched bytes and the least it could fetch (see [`DeviceCounters::weights_fetched`]).
    pub(crate) fn note_weights(&self, fetched: u64, min: u64) {
        self.weights_fetched.fetch_add(fetched, Ordering::Relaxed);
        self.weights_min.fetch_add(min, Ordering::Relaxed);
    }

    /// Counts a dispatch over a further chunk of a split weight ([`DeviceCounters::split_dispatches`]); recorders
    /// call it for each chunk after the first they dispatch over.
    pub(crate) fn note_split(&self) {
        self.split_dispatches.fetch_add(1, Ordering::Relaxed);
    }

    /// A pooled storage buffer of at least `len` f32 values (size class: the next power of two, at least 256
    /// bytes). Contents undefined; see [`ScratchBuf`].
    pub fn scratch(&self, len: usize) -> ScratchBuf {
        let size = ((len.max(1) * 4) as u64).next_power_of_two().max(256);
        let buf = self.pool.lock().get_mut(&size).and_then(|v| v.pop()).unwrap_or_else(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("scratch"),
                size,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST
                    | wgpu::BufferUsages::INDIRECT,
                mapped_at_creation: false,
            })
        });
        ScratchBuf { buf: Some(buf), pool: self.pool.clone() }
    }

    /// Like [`WgpuContext::scratch`], zeroed by a clear recorded into `enc`.
    pub fn scratch_zeroed(&self, enc: &mut Enc, len: usize) -> ScratchBuf {
        let s = self.scratch(len);
        self.clear(enc, &s, 0, s.size());
        s
    }

    /// Bytes held by idle pooled buffers.
    pub fn pool_bytes(&self) -> u64 {
        self.pool.lock().iter().map(|(k, v)| k * v.len() as u64).sum()
    }

    /// How the product kernels sum a row's lanes on this device (subgroup shuffles where the adapter has them).
    pub fn reduce(&self) -> Reduce {
        self.reduce
    }

    /// The largest storage binding (bytes) this context uses; weight tensors larger than this are split.
    pub fn max_binding(&self) -> u64 {
        self.max_binding
    }

    /// The compute pipeline for WGSL `source` (entry point `main`), compiled once per `name`.
    pub fn pipeline(&self, name: &str, source: &str) -> Result<Arc<wgpu::ComputePipeline>> {
        self.pipeline_entry(name, source, "main")
    }

    /// The compute pipeline for entry point `entry` of WGSL `source`, compiled once per (`name`, `entry`).
    pub fn pipeline_entry(&self, name: &str, source: &str, entry: &str) -> Result<Arc<wgpu::ComputePipeline>> {
        self.pipeline_lazy(name, entry, || source.into())
    }

    /// [`WgpuContext::pipeline_entry`] for a source composed at run time: `source` is called only when the
    /// pipeline is not compiled yet, so a cached pipeline costs no composition.
    pub fn pipeline_lazy<'s>(
        &self,
        name: &str,
        entry: &str,
        source: impl FnOnce() -> std::borrow::Cow<'s, str>,
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = format!("{name}::{entry}");
        if let Some(p) = self.pipelines.lock().get(&key) {
            return Ok(p.clone());
        }
        let source = source();
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(source),
        });
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(name),
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(backend_err(format!("pipeline {key}: {e}")));
        }
        let p = Arc::new(pipeline);
        self.pipeline_names.lock().insert((*p).clone(), key.clone());
        self.pipelines.lock().insert(key, p.clone());
        Ok(p)
    }

    /// A storage buffer initialised with `data` (padded with zeros to a multiple of 4 bytes).
    pub fn storage_init(&self, label: &str, data: &[u8]) -> wgpu::Buffer {
        let mut padded;
        let bytes = if data.is_empty() || !data.len().is_multiple_of(4) {
            padded = data.to_vec();
            padded.resize(data.len().div_ceil(4).max(1) * 4, 0);
            &padded[..]
        } else {
            data
        };
        self.host_to_device.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if bytes.len() as u64 >= BIG_BUFFER {
            self.forget_bindings();
        }
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        })
    }

    /// A storage buffer holding `data` as f32.
    pub fn storage_f32(&self, label: &str, data: &[f32]) -> wgpu::Buffer {
        self.storage_init(label, bytemuck::cast_slice(data))
    }

    /// A storage buffer holding `data` as u32.
    pub fn storage_u32(&self, label: &str, data: &[u32]) -> wgpu::Buffer {
        self.storage_init(label, bytemuck::cast_slice(data))
    }

    /// A zeroed storage buffer of `len` f32 values.
    pub fn storage_zeroed(&self, label: &str, len: usize) -> wgpu::Buffer {
        if (len * 4) as u64 >= BIG_BUFFER {
            self.forget_bindings();
        }
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (len.max(1) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A uniform buffer holding one `Params` struct: made once per distinct content and reused (uniform buffers
    /// are never written after creation), so a steady decode loop uploads only the blocks that change.
    pub fn uniform<T: bytemuck::Pod>(&self, label: &str, params: &T) -> wgpu::Buffer {
        let bytes = bytemuck::bytes_of(params);
        let mut cache = self.uniforms.lock();
        if let Some(b) = cache.get(bytes) {
            return b.clone();
        }
        if cache.len() >= BIND_CACHE_MAX {
            cache.clear();
        }
        self.host_to_device.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let b = self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytes,
            usage: wgpu::BufferUsages::UNIFORM,
        });
        cache.insert(bytes.to_vec(), b.clone());
        b
    }

    /// A persistent buffer of 256 zero bytes for an absent optional input: bind it only where the kernel reads
    /// (never writes) that binding, so its bind groups are reused across ticks.
    pub fn zeros(&self) -> &wgpu::Buffer {
        &self.zeros
    }

    /// Starts a tick for the bind-group cache: a bind group no dispatch of the last [`BIND_KEEP_TICKS`] ticks used
    /// is dropped, with the buffers only it keeps alive (a tick's own fresh buffers — key lists, attention scratch —
    /// are freed a few ticks later, not when the cache fills), while decode ticks between prefill chunks still find
    /// theirs.
    pub fn next_tick(&self) {
        let tick = self.tick.fetch_add(1, Ordering::Relaxed) + 1;
        self.binds.lock().retain(|_, (_, used)| *used + BIND_KEEP_TICKS >= tick);
    }

    /// Drops the cached bind groups (and the buffers only they keep alive); the next dispatches make new ones.
    /// Called when a large buffer is created (a grown tensor or pool usually replaces one) and when weights are
    /// dropped.
    pub fn forget_bindings(&self) {
        self.binds.lock().clear();
    }

    /// Records one dispatch of `pipeline` with `buffers` bound to bindings 0, 1, ... of group 0.
    pub fn dispatch(
        &self,
        enc: &mut Enc,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
    ) -> Result<()> {
        let bound: Vec<(u32, &wgpu::Buffer)> = buffers.iter().enumerate().map(|(i, b)| (i as u32, *b)).collect();
        self.dispatch_at(enc, pipeline, &bound, groups)
    }

    /// Records one dispatch with explicit `(binding, buffer)` pairs (for entry points that use only some of a
    /// file's bindings: the derived layout holds only those).
    pub fn dispatch_at(
        &self,
        enc: &mut Enc,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
        groups: [u32; 3],
    ) -> Result<()> {
        let whole: Vec<(u32, &wgpu::Buffer, u64, u64)> = buffers.iter().map(|&(i, b)| (i, b, 0, 0)).collect();
        self.dispatch_ranges(enc, pipeline, &whole, groups)
    }

    /// [`WgpuContext::dispatch_at`] with `(binding, buffer, offset, size)`: a byte range of each buffer bound
    /// (`size` 0: the whole buffer). Copies still waiting in `enc` go first.
    pub fn dispatch_ranges(
        &self,
        enc: &mut Enc,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer, u64, u64)],
        groups: [u32; 3],
    ) -> Result<()> {
        self.flush_copies(enc);
        self.record(enc, pipeline, buffers, groups)
    }

    /// Records one dispatch whose workgroup counts the device reads from `args` at byte `offset` (three u32:
    /// x, y, z, written by an earlier kernel; `args` made with [`wgpu::BufferUsages::INDIRECT`], as scratch buffers
    /// are). Copies still waiting in `enc` go first.
    pub fn dispatch_indirect(
        &self,
        enc: &mut Enc,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
        (args, offset): (&wgpu::Buffer, u64),
    ) -> Result<()> {
        self.flush_copies(enc);
        let whole: Vec<(u32, &wgpu::Buffer, u64, u64)> = buffers.iter().map(|&(i, b)| (i, b, 0, 0)).collect();
        self.record_grid(enc, pipeline, &whole, Grid::Indirect(args, offset))
    }

    /// Records one dispatch (nothing waiting in `enc` is flushed: [`WgpuContext::dispatch_ranges`] does that).
    pub(super) fn record(
        &self,
        enc: &mut Enc,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer, u64, u64)],
        groups: [u32; 3],
    ) -> Result<()> {
        let max = self.limits.max_compute_workgroups_per_dimension;
        if groups.iter().any(|&g| g > max) {
            return Err(backend_err(format!("dispatch {groups:?} exceeds {max} workgroups per dimension")));
        }
        if groups.contains(&0) {
            return Ok(());
        }
        self.record_grid(enc, pipeline, buffers, Grid::Direct(groups))
    }

    fn record_grid(
        &self,
        enc: &mut Enc,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer, u64, u64)],
        grid: Grid<'_>,
    ) -> Result<()> {
        let key: BindKey = (pipeline.clone(), buffers.iter().map(|&(i, b, at, n)| (i, b.clone(), at, n)).collect());
        let tick = self.tick.load(Ordering::Relaxed);
        let mut binds = self.binds.lock();
        let bind = match binds.get_mut(&key) {
            Some((b, used)) => {
                *used = tick;
                b.clone()
            }
            None => {
                let entries: Vec<wgpu::BindGroupEntry> = buffers
                    .iter()
                    .map(|&(binding, buffer, offset, n)| wgpu::BindGroupEntry {
                        binding,
                        resource: match std::num::NonZeroU64::new(n) {
                            None => buffer.as_entire_binding(),
                            size => wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size }),
                        },
                    })
                    .collect();
                let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &entries,
                });
                self.bind_groups.fetch_add(1, Ordering::Relaxed);
                if binds.len() >= BIND_CACHE_MAX {
                    binds.clear();
                }
                binds.insert(key, (bind.clone(), tick));
                bind
            }
        };
        drop(binds);
        self.dispatches.fetch_add(1, Ordering::Relaxed);
        let mut timing = self.timing.lock();
        let timestamp_writes = match timing.as_mut() {
            Some(t) => {
                let names = self.pipeline_names.lock();
                t.next(names.get(pipeline).map_or("?", |s| s.as_str()))
            }
            None => None,
        };
        // A timed dispatch is a pass of its own (its timestamps are the pass's); otherwise the open pass goes on.
        let timed = timestamp_writes.is_some();
        if timed {
            enc.end_pass();
        }
        let pass = match &mut enc.pass {
            Some(p) => p,
            open => {
                self.passes.fetch_add(1, Ordering::Relaxed);
                let desc = wgpu::ComputePassDescriptor { label: None, timestamp_writes };
                open.insert(enc.enc.begin_compute_pass(&desc).forget_lifetime())
            }
        };
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, &bind, &[]);
        match grid {
            Grid::Direct([x, y, z]) => pass.dispatch_workgroups(x, y, z),
            Grid::Indirect(args, offset) => pass.dispatch_workgroups_indirect(args, offset),
        }
        if timed {
            enc.end_pass();
        }
        Ok(())
    }

    /// Whether the device takes timestamp queries ([`super::timing`]).
    pub fn has_timestamps(&self) -> bool {
        self.device.features().contains(wgpu::Features::TIMESTAMP_QUERY)
    }

    /// Opens a timing window ([`super::timing`]): the dispatches recorded from now on are timed. `false` (nothing
    /// changes) when the device has no timestamp queries.
    pub fn start_timing(&self) -> bool {
        if !self.has_timestamps() {
            return false;
        }
        *self.timing.lock() = Some(super::timing::Timing::new(&self.device));
        true
    }

    /// Closes the timing window and returns each timed dispatch's pipeline and GPU seconds, in recording order
    /// (one submission and readback of its own); `None` when no window was open. Call after the timed work was
    /// submitted.
    pub fn finish_timing(&self) -> Result<Option<Vec<(String, f64)>>> {
        let Some(t) = self.timing.lock().take() else { return Ok(None) };
        let n = t.labels.len() as u32;
        if n == 0 {
            return Ok(Some(Vec::new()));
        }
        let mut enc = self.encoder();
        self.raw_encoder(&mut enc).resolve_query_set(&t.set, 0..2 * n, &t.resolve, 0);
        let words = self.submit_read_u32(enc, &t.resolve, 0, 4 * n as usize)?;
        let secs = super::timing::durations(&words, self.queue.get_timestamp_period());
        Ok(Some(t.labels.into_iter().zip(secs).collect()))
    }

    /// A new command encoder.
    pub fn encoder(&self) -> Enc {
        Enc {
            pass: None,
            enc: self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
            pending: Vec::new(),
            held: None,
        }
    }

    /// Submits `enc` and waits for the device to finish, reporting validation errors raised meanwhile.
    pub fn submit(&self, mut enc: Enc) -> Result<()> {
        self.flush_copies(&mut enc);
        self.submits.fetch_add(1, Ordering::Relaxed);
        self.queue.submit([enc.finish()]);
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: None })
            .map_err(|e| backend_err(format!("poll: {e}")))?;
        Ok(())
    }

    /// Copies `len` f32 values starting at element `offset` of `buf` back to the host (waits for the device).
    pub fn read_f32(&self, buf: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<f32>> {
        let bytes = self.read_words(buf, offset, len)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Copies `len` u32 values starting at element `offset` of `buf` back to the host (waits for the device).
    pub fn read_u32(&self, buf: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<u32>> {
        let bytes = self.read_words(buf, offset, len)?;
        Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// The bytes of `len` 4-byte words starting at word `offset` of `buf`.
    fn read_words(&self, buf: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<u8>> {
        self.submit_read_words(self.encoder(), buf, offset, len)
    }

    /// Records a copy of `len` f32 values at element `offset` of `buf` to the host at the end of `enc`, submits
    /// `enc` and returns the values: one submission, one readback.
    pub fn submit_read_f32(&self, enc: Enc, buf: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<f32>> {
        let bytes = self.submit_read_words(enc, buf, offset, len)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// [`WgpuContext::submit_read_f32`] for u32 values.
    pub fn submit_read_u32(&self, enc: Enc, buf: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<u32>> {
        let bytes = self.submit_read_words(enc, buf, offset, len)?;
        Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    fn submit_read_words(&self, mut enc: Enc, buf: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<u8>> {
        if len == 0 {
            self.submit(enc)?;
            return Ok(Vec::new());
        }
        let bytes = (len * 4) as u64;
        if (offset * 4) as u64 + bytes > buf.size() {
            return Err(backend_err(format!("read: {len} words at {offset} exceed a buffer of {} bytes", buf.size())));
        }
        self.readbacks.fetch_add(1, Ordering::Relaxed);
        self.device_to_host.fetch_add(bytes, Ordering::Relaxed);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.raw_encoder(&mut enc).copy_buffer_to_buffer(buf, (offset * 4) as u64, &staging, 0, bytes);
        self.submit(enc)?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: None })
            .map_err(|e| backend_err(format!("poll: {e}")))?;
        rx.recv()
            .map_err(|_| backend_err("readback: map callback dropped"))?
            .map_err(|e| backend_err(format!("readback map: {e}")))?;
        let out = {
            let view = staging.get_mapped_range(..).map_err(|e| backend_err(format!("readback view: {e}")))?;
            view.to_vec()
        };
        staging.unmap();
        Ok(out)
    }

    /// Writes f32 values into `buf` at element `offset`.
    pub fn write_f32(&self, buf: &wgpu::Buffer, offset: usize, data: &[f32]) {
        self.host_to_device.fetch_add(std::mem::size_of_val(data) as u64, Ordering::Relaxed);
        self.queue.write_buffer(buf, (offset * 4) as u64, bytemuck::cast_slice(data));
    }
}

/// A context for tests: `None` (with a message on stderr) when no adapter exists, unless `CI=true`, where a missing
/// adapter panics so the test fails.
pub fn test_context(opts: ContextOptions) -> Option<WgpuContext> {
    match WgpuContext::with_options(opts) {
        Ok(c) => Some(c),
        Err(e) => {
            crate::testdata::skip_or_fail(&format!("no wgpu adapter: {e}"));
            None
        }
    }
}
