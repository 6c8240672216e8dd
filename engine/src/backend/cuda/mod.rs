//! The CUDA backend: the graph's ops on an NVIDIA GPU through the kernels of `ds4_kernels_native`
//! (`kernels-native/cuda`), driven over the [`Device`] seam, so the same code runs on the real device
//! (`ds4_kernels_native::cuda::CudaDevice`, feature `cuda`) and, in tests, on any other implementation of the
//! trait (the host shim runs the very kernel sources on the CPU: `tests/tests/cuda_backend.rs`).
//!
//! What runs where. The backend has device kernels for the weight products of the supported formats
//! ([`Op::MatMul`] over Q8_0, F16, IQ2_XXS, Q2_K, Q4_K: activations quantized once per product, exactly the CPU's
//! Q8_0 / Q8_K rows), [`Op::RmsNorm`], [`Op::Rope`], the MoE layer (routing, routed experts through the fused
//! kernels, shared expert: [`moe`]) when the model's experts fit its kernels, mHC and the embeddings ([`hc`]: the
//! residual streams live on the device) and the head (output projection, sampling candidates, the tick's readback:
//! [`head`]); [`Backend::supports`] says no to every other op, and the engine runs those on a CPU backend beside it
//! (the registry's host fallback, [`super::registry::needs_host_fallback`]). The session KV stays in host memory
//! ([`Backend::kv_on_device`] is false), so the attention ops, whose KV pages never cross, run there too; the
//! executor's residency copies move the host-layout tensors between the two ([`crate::exec`]), and
//! [`crate::exec::PlacementReport`] shows which side ran each node. Each further kernel is a match arm in
//! [`CudaBackend::run_node`] and a line in [`CudaBackend::supports`]; the ops still on the CPU are listed in
//! `docs/cuda.md`.
//!
//! Memory. Weights are uploaded on first use and stay (their file encoding, no dequantized copy; norm vectors as
//! f32). A tick's tensors live in one device buffer per [`BufId`], grown when a tick needs more and kept across
//! ticks (a tensor's value is only defined within the tick that wrote it). The batch rows' positions are
//! uploaded when a rope finds them changed.
//!
//! Invariants: every launch goes through `ds4_kernels_native::cuda_host`'s plans, which check each buffer's size
//! against the shapes before launching; a shape the kernels cannot take is refused by [`CudaBackend::supports`]
//! (so it runs on the CPU), never launched; device errors become [`crate::Error::Backend`].

mod hc;
mod head;
mod moe;

use std::collections::HashMap;

use ds4_kernels_native::cuda_host::{self, ActBufs, Arg, CudaBufId, Device, DeviceError, Matrix};
use ds4_kernels_native::cuda_kernels::{CudaWeight, Plan};
use parking_lot::Mutex;

use super::device::DeviceCounters;
use super::{Backend, BackendKind, StepCtx};
use crate::graph::{BufId, Op};
use crate::model::{Model, WeightId};
use crate::quant::GgmlType;
use crate::{Error, Result};

/// The CUDA kernels' type for a ggml weight type, if they multiply it.
pub fn cuda_weight(ty: GgmlType) -> Option<CudaWeight> {
    Some(match ty {
        GgmlType::Q8_0 => CudaWeight::Q8_0,
        GgmlType::F16 => CudaWeight::F16,
        GgmlType::Iq2Xxs => CudaWeight::Iq2Xxs,
        GgmlType::Q2K => CudaWeight::Q2K,
        GgmlType::Q4K => CudaWeight::Q4K,
        _ => return None,
    })
}

/// A device the backend can own (the trait object must move between the engine's threads).
pub type BoxedDevice = Box<dyn Device + Send>;

/// See the module docs.
pub struct CudaBackend {
    device: String,
    st: Mutex<State>,
}

struct State {
    dev: BoxedDevice,
    /// Weights on the device, by [`WeightId`]: buffer and bytes.
    weights: HashMap<u32, (CudaBufId, usize)>,
    weight_bytes: u64,
    /// One buffer per [`BufId::index`]: the buffer and its size in bytes.
    tensors: Vec<Option<(CudaBufId, usize)>>,
    acts: Option<ActBufs>,
    /// `inv_freq` of the plain and the compressed rope.
    rope: [Option<CudaBufId>; 2],
    /// Row positions on the device (i32; buffer and capacity in rows) and the values it holds.
    pos: Option<(CudaBufId, usize)>,
    pos_host: Vec<i32>,
    /// Backend-private buffers by name (route weights, the shared expert's rows, tokens): buffer and bytes.
    scratch: HashMap<&'static str, (CudaBufId, usize)>,
    /// Hash-routing tables (i32) by layer.
    tables: HashMap<usize, CudaBufId>,
    /// A node waiting for the node it is fused with ([`moe`]).
    held: Option<moe::Held>,
    counters: DeviceCounters,
}

fn dev_err(e: DeviceError) -> Error {
    Error::Backend { backend: "cuda", what: e.to_string() }
}

fn err(what: String) -> Error {
    Error::Backend { backend: "cuda", what }
}

impl CudaBackend {
    /// A backend over `dev`, named `device` in reports.
    pub fn with_device(dev: BoxedDevice, device: impl Into<String>) -> CudaBackend {
        CudaBackend {
            device: device.into(),
            st: Mutex::new(State {
                dev,
                weights: HashMap::new(),
                weight_bytes: 0,
                tensors: Vec::new(),
                acts: None,
                rope: [None, None],
                pos: None,
                pos_host: Vec::new(),
                scratch: HashMap::new(),
                tables: HashMap::new(),
                held: None,
                counters: DeviceCounters::default(),
            }),
        }
    }

    /// The backend on GPU 0 (feature `cuda`): the driver and NVRTC are looked for first, so a machine without
    /// them gets this error and nothing else. NVRTC is loaded from `$DS4_CUDA_WHEELS` (the `nvidia-cuda-nvrtc`
    /// wheel's `nvidia/cu13` folder) when set, else found by soname; the compiled kernels are cached under
    /// `$DS4_CUDA_CACHE` (default `~/.cache/ds4/cuda`).
    #[cfg(feature = "cuda")]
    pub fn open() -> Result<CudaBackend> {
        use ds4_kernels_native::cuda::{preload_nvrtc, CudaDevice};
        if let Some(dir) = std::env::var_os("DS4_CUDA_WHEELS") {
            preload_nvrtc(std::path::Path::new(&dir)).map_err(dev_err)?;
        }
        let cache = std::env::var_os("DS4_CUDA_CACHE")
            .map(std::path::PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/ds4/cuda")));
        let dev = CudaDevice::open(0, cache.as_deref()).map_err(dev_err)?;
        let i = &dev.info;
        let name = format!("{} (CUDA, sm_{}{})", i.name, i.compute_capability.0, i.compute_capability.1);
        tracing::info!(device = %name, module = i.module_from, "cuda backend ready");
        Ok(CudaBackend::with_device(Box::new(dev), name))
    }

    /// Whether the kernels can multiply by weight `w` (2-D, a supported format, whole blocks per row).
    fn product_ok(model: &Model, w: WeightId) -> bool {
        let m = model.mat(w);
        model.table.dims[w.0 as usize].len() <= 2
            && cuda_weight(m.ty).is_some_and(|ty| Plan::matvec(ty, m.rows, m.cols, 1).is_ok())
    }
}

impl State {
    /// The device buffer of weight `w` (uploaded on first use): raw file rows, or f32 for a dense vector.
    fn weight(&mut self, model: &Model, w: WeightId, dense: bool) -> Result<CudaBufId> {
        if let Some(&(b, _)) = self.weights.get(&w.0) {
            return Ok(b);
        }
        let bytes: &[u8] = if dense { bytemuck::cast_slice(model.dense(w)) } else { model.mat(w).data };
        let b = self.dev.upload(bytes).map_err(dev_err)?;
        self.counters.host_to_device += bytes.len() as u64;
        self.weight_bytes += bytes.len() as u64;
        self.weights.insert(w.0, (b, bytes.len()));
        Ok(b)
    }

    /// Tensor `id`'s buffer with room for `bytes` bytes (grown, contents dropped, when too small): for a writer.
    fn out(&mut self, id: BufId, bytes: usize) -> Result<CudaBufId> {
        let i = id.index();
        if self.tensors.len() <= i {
            self.tensors.resize(i + 1, None);
        }
        match self.tensors[i] {
            Some((b, size)) if size >= bytes => Ok(b),
            old => {
                if let Some((b, _)) = old {
                    self.dev.free(b);
                }
                let b = self.dev.alloc(bytes.max(4)).map_err(dev_err)?;
                self.tensors[i] = Some((b, bytes.max(4)));
                Ok(b)
            }
        }
    }

    /// Tensor `id`'s buffer, which must hold `bytes` bytes already: for a reader.
    fn input(&self, id: BufId, bytes: usize) -> Result<CudaBufId> {
        match self.tensors.get(id.index()).copied().flatten() {
            Some((b, size)) if size >= bytes => Ok(b),
            _ => Err(err(format!("{id:?} has not been written with {bytes} bytes this tick"))),
        }
    }

    /// Activation buffers for `values` values.
    fn acts(&mut self, values: usize) -> Result<ActBufs> {
        match self.acts {
            Some(a) if a.values >= values => Ok(a),
            old => {
                if let Some(a) = old {
                    for b in [a.q, a.d, a.bs] {
                        self.dev.free(b);
                    }
                }
                let a = ActBufs::new(&mut *self.dev, values.next_power_of_two()).map_err(dev_err)?;
                self.acts = Some(a);
                Ok(a)
            }
        }
    }

    fn launched(&mut self, r: std::result::Result<(), DeviceError>, launches: u64) -> Result<()> {
        self.counters.dispatches += launches;
        r.map_err(dev_err)
    }

    /// A backend-private buffer of at least `bytes` bytes (grown, contents dropped, when too small).
    fn scratch(&mut self, name: &'static str, bytes: usize) -> Result<CudaBufId> {
        match self.scratch.get(name) {
            Some(&(b, size)) if size >= bytes => Ok(b),
            old => {
                if let Some(&(b, _)) = old {
                    self.dev.free(b);
                }
                let b = self.dev.alloc(bytes.max(4)).map_err(dev_err)?;
                self.scratch.insert(name, (b, bytes.max(4)));
                Ok(b)
            }
        }
    }

    /// A backend-private buffer holding `data`.
    fn scratch_with(&mut self, name: &'static str, data: &[u8]) -> Result<CudaBufId> {
        let b = self.scratch(name, data.len())?;
        self.dev.write(b, data).map_err(dev_err)?;
        self.counters.host_to_device += data.len() as u64;
        Ok(b)
    }

    fn matmul(&mut self, model: &Model, w: WeightId, x: BufId, y: BufId, n: usize) -> Result<()> {
        let m = model.mat(w);
        let xb = self.input(x, n * m.cols * 4)?;
        let yb = self.out(y, n * m.rows * 4)?;
        self.product(model, w, xb, n, yb)
    }

    /// `y = W·x` for `n` rows of `x` (device buffers of the right sizes).
    fn product(&mut self, model: &Model, w: WeightId, xb: CudaBufId, n: usize, yb: CudaBufId) -> Result<()> {
        let m = model.mat(w);
        let ty = cuda_weight(m.ty).ok_or_else(|| err(format!("no CUDA kernel multiplies {}", m.ty)))?;
        let mat = Matrix { buf: self.weight(model, w, false)?, ty, rows: m.rows, cols: m.cols };
        let acts = self.acts(n * m.cols)?;
        // One launch (a CTA row per group of `matvec_width` tokens), after the quantizer unless F16.
        let groups = n.div_ceil(Plan::matvec_width(ty, n)) as u64;
        let quant = u64::from(ty != CudaWeight::F16);
        let r = cuda_host::matvec(&mut *self.dev, &mat, xb, n, &acts, yb);
        self.counters.weights_fetched += groups * m.data.len() as u64;
        self.counters.weights_min += m.data.len() as u64;
        self.launched(r, quant + 1)
    }

    fn rms_norm(
        &mut self,
        cx: &StepCtx<'_>,
        x: BufId,
        y: BufId,
        w: Option<WeightId>,
        width: usize,
        heads: usize,
    ) -> Result<()> {
        let nvec = cx.batch.rows.len() * heads;
        let bytes = nvec * width * 4;
        let xb = self.input(x, bytes)?;
        let yb = if x == y { xb } else { self.out(y, bytes)? };
        let wb = match w {
            Some(w) => Arg::Buf(self.weight(cx.model, w, true)?),
            None => Arg::Null,
        };
        let plan = Plan::rms_norm(nvec, width).map_err(|e| dev_err(e.into()))?;
        let args = [Arg::Buf(xb), wb, Arg::Buf(yb), Arg::I32(width as i32), Arg::F32(cx.model.config.rms_eps)];
        let r = self.dev.launch(&plan, &args);
        self.launched(r, 1)
    }

    fn rope(
        &mut self,
        cx: &StepCtx<'_>,
        x: BufId,
        layer: usize,
        width: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()> {
        let n = cx.batch.rows.len();
        let freqs = cx.rope.for_layer(cx.model, layer);
        let flavour = usize::from(cx.model.config.compress_ratios[layer] != 0);
        let f = match self.rope[flavour] {
            Some(b) => b,
            None => {
                let b = self.dev.upload(bytemuck::cast_slice(&freqs.inv_freq)).map_err(dev_err)?;
                self.counters.host_to_device += 4 * freqs.inv_freq.len() as u64;
                self.rope[flavour] = Some(b);
                b
            }
        };
        let pos = self.positions(cx)?;
        let xb = self.input(x, n * heads * width * 4)?;
        let half = freqs.inv_freq.len();
        let plan = Plan::rope(n * heads, width, half).map_err(|e| dev_err(e.into()))?;
        let args = [
            Arg::Buf(xb),
            Arg::Buf(f),
            Arg::Buf(pos),
            Arg::I32(width as i32),
            Arg::I32(heads as i32),
            Arg::I32(half as i32),
            Arg::I32(i32::from(inverse)),
            Arg::I32((n * heads) as i32),
        ];
        let r = self.dev.launch(&plan, &args);
        self.launched(r, 1)
    }

    /// The batch rows' positions on the device, uploaded when they differ from what the buffer holds.
    fn positions(&mut self, cx: &StepCtx<'_>) -> Result<CudaBufId> {
        let n = cx.batch.rows.len();
        let pos: Vec<i32> = cx
            .batch
            .rows
            .iter()
            .map(|r| i32::try_from(r.pos).map_err(|_| err(format!("position {} exceeds 32 bits", r.pos))))
            .collect::<Result<_>>()?;
        let b = match self.pos {
            Some((b, cap)) if cap >= n => {
                if self.pos_host == pos {
                    return Ok(b);
                }
                b
            }
            old => {
                if let Some((b, _)) = old {
                    self.dev.free(b);
                }
                let b = self.dev.alloc(4 * n.max(1)).map_err(dev_err)?;
                self.pos = Some((b, n.max(1)));
                b
            }
        };
        self.dev.write(b, bytemuck::cast_slice(&pos)).map_err(dev_err)?;
        self.counters.host_to_device += 4 * n as u64;
        self.pos_host = pos;
        Ok(b)
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn supports(&self, op: &Op, model: &Model) -> bool {
        match *op {
            Op::MatMul { w, .. } => Self::product_ok(model, w),
            Op::RmsNorm { width, .. } => width > 0,
            Op::Rope { width, .. } => width >= model.config.rope_dim,
            Op::MoeRoute { .. }
            | Op::ExpertUp { .. }
            | Op::SwiGlu { .. }
            | Op::ExpertDown { .. }
            | Op::MoeCombine { .. } => moe::moe_ok(model),
            Op::Logits | Op::Readback { buf: BufId::Logits | BufId::Candidates } => head::head_ok(model, None),
            Op::LogitCandidates { k } => head::head_ok(model, Some(k)),
            Op::HcSinkhorn { .. } | Op::HcHeadWeights | Op::HcCollapse { .. } | Op::HcPost => hc::hc_ok(model),
            Op::Embed => hc::hc_ok(model) && hc::embed_format(model).is_some(),
            _ => false,
        }
    }

    fn run_node(&self, op: &Op, cx: &mut StepCtx<'_>) -> Result<()> {
        let mut st = self.st.lock();
        let n = cx.batch.rows.len();
        match (*op, st.held) {
            (Op::SwiGlu { layer }, Some(moe::Held::Up(l))) if l == layer => {
                st.held = None;
                return st.gate_up_swiglu(cx, layer);
            }
            (Op::MoeCombine { .. }, Some(moe::Held::Down(layer))) => {
                st.held = None;
                return st.down_combine(cx, layer);
            }
            _ => st.no_held(op.name())?,
        }
        match *op {
            Op::MatMul { w, x, y } => st.matmul(cx.model, w, x, y, n),
            Op::MoeRoute { layer, hash, .. } => st.moe_route(cx, layer, hash),
            Op::ExpertUp { layer, .. } => {
                st.held = Some(moe::Held::Up(layer));
                Ok(())
            }
            Op::ExpertDown { layer, .. } => {
                st.held = Some(moe::Held::Down(layer));
                Ok(())
            }
            Op::Logits => st.logits(cx),
            Op::LogitCandidates { k } => st.candidates(cx, k),
            Op::Readback { buf } => st.readback(cx, buf),
            Op::HcSinkhorn { layer, sub } => st.hc_sinkhorn(cx, layer, sub),
            Op::HcHeadWeights => st.hc_head_weights(cx),
            Op::HcCollapse { out } => st.hc_collapse(cx, out),
            Op::HcPost => st.hc_post(cx),
            Op::Embed => st.embed(cx),
            Op::RmsNorm { x, y, w, width, heads } => st.rms_norm(cx, x, y, w, width, heads),
            Op::Rope { x, layer, width, heads, inverse } => st.rope(cx, x, layer, width, heads, inverse),
            _ => Err(err(format!("no CUDA kernel for {}", op.name()))),
        }
    }

    fn download(&self, id: BufId, _cx: &mut StepCtx<'_>, out: &mut [f32]) -> Result<()> {
        let mut st = self.st.lock();
        let b = st.input(id, out.len() * 4)?;
        st.dev.read(b, bytemuck::cast_slice_mut(out)).map_err(dev_err)?;
        st.counters.readbacks += 1;
        st.counters.device_to_host += out.len() as u64 * 4;
        Ok(())
    }

    fn upload(&self, id: BufId, _cx: &mut StepCtx<'_>, data: &[f32]) -> Result<()> {
        let mut st = self.st.lock();
        let b = st.out(id, data.len() * 4)?;
        st.dev.write(b, bytemuck::cast_slice(data)).map_err(dev_err)?;
        st.counters.host_to_device += data.len() as u64 * 4;
        Ok(())
    }

    fn begin_tick(&self, _cx: &mut StepCtx<'_>) -> Result<()> {
        let mut st = self.st.lock();
        st.held = None;
        st.counters.submits += 1;
        Ok(())
    }

    fn end_tick(&self, _cx: &mut StepCtx<'_>) -> Result<()> {
        self.st.lock().no_held("the tick's end")
    }

    fn device_name(&self) -> Option<String> {
        Some(self.device.clone())
    }

    fn device_counters(&self) -> Option<DeviceCounters> {
        Some(self.st.lock().counters)
    }

    fn device_weight_bytes(&self) -> Option<u64> {
        Some(self.st.lock().weight_bytes)
    }
}

#[cfg(test)]
mod tests;
