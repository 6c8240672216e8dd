//! The CUDA device (feature `cuda`): a context and one stream on one GPU, the kernel program compiled by NVRTC
//! for that GPU (cached on disk by device, compute capability, NVRTC version and source hash), device buffers,
//! and launches. It implements [`crate::cuda_host::Device`], so the host plans of `cuda_host` drive it.
//!
//! Start-up order: [`CudaDevice::open`] first asks whether the driver library can be loaded
//! (`is_culib_present`) and returns [`DeviceError::Driver`] if not — cudarc panics on a missing library, and
//! under `panic = "abort"` nothing could catch that — then does the same for NVRTC, then creates the context.
//! NVRTC is found by soname (`LD_LIBRARY_PATH`), or by path through [`preload_nvrtc`] (the `nvidia/cu13`
//! folder of the `nvidia-cuda-nvrtc` wheel).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::cuda_host::{module_cache_name, Arg, CudaBufId, Device, DeviceError};
use crate::cuda_kernels::{program_source, source_hash, Plan, KERNELS};

fn drv(e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Driver(format!("{e:?}"))
}

/// Loads NVRTC (and its builtins library) from `dir` (a folder with `lib/libnvrtc.so.13`, such as the
/// `nvidia/cu13` folder of the `nvidia-cuda-nvrtc` wheel) for the rest of the process, so the soname lookup finds
/// it without `LD_LIBRARY_PATH`.
pub fn preload_nvrtc(dir: &Path) -> Result<(), DeviceError> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    for lib in ["lib/libnvrtc-builtins.so.13.0", "lib/libnvrtc.so.13"] {
        let path = dir.join(lib);
        // SAFETY: loading NVIDIA's NVRTC libraries runs their initialisers only, which need nothing from us; the
        // handle is leaked on purpose so the library stays loaded.
        let l = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
            .map_err(|e| DeviceError::Driver(format!("loading {}: {e}", path.display())))?;
        std::mem::forget(l);
    }
    Ok(())
}

/// Whether the CUDA driver library can be loaded (false on a machine without an NVIDIA driver).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version `(major, minor)`.
fn nvrtc_version() -> Result<(i32, i32), DeviceError> {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: NVRTC is loaded (checked by the caller); both pointers are valid for writes.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(DeviceError::Driver(format!("nvrtcVersion: {r:?}")));
    }
    Ok((major, minor))
}

/// Compiles the kernel program to a cubin for `sm_{cc}` with NVRTC.
fn compile_cubin(cc: (i32, i32)) -> Result<Vec<u8>, DeviceError> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(program_source()).map_err(|e| DeviceError::Driver(e.to_string()))?;
    let name = c"ds4.cu";
    let prog = result::create_program(&src, Some(name)).map_err(drv)?;
    let opts = [format!("--gpu-architecture=sm_{}{}", cc.0, cc.1), "--std=c++17".to_string()];
    // SAFETY: `prog` is a live program from create_program; it is destroyed exactly once below.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => {
            let mut n = 0usize;
            // SAFETY: `prog` compiled successfully; `n` is valid for writes, then the buffer holds `n` bytes.
            unsafe {
                let r = sys::nvrtcGetCUBINSize(prog, &mut n);
                if r != sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(DeviceError::Driver(format!("nvrtcGetCUBINSize: {r:?}")))
                } else {
                    let mut buf = vec![0u8; n];
                    let r = sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char);
                    if r != sys::nvrtcResult::NVRTC_SUCCESS {
                        Err(DeviceError::Driver(format!("nvrtcGetCUBIN: {r:?}")))
                    } else {
                        Ok(buf)
                    }
                }
            }
        }
        Err(e) => {
            // SAFETY: as above; the log is read before the program is destroyed.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(DeviceError::Driver(format!("NVRTC compile for sm_{}{} failed: {e:?}\n{log}", cc.0, cc.1)))
        }
    };
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// Facts about the opened device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem: usize,
    pub nvrtc: (i32, i32),
    /// Where the compiled module came from: `"cache"` or `"nvrtc"`.
    pub module_from: &'static str,
    pub module_path: Option<PathBuf>,
}

/// One GPU: context, stream, compiled kernels and the buffers allocated through it.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    bufs: Vec<Option<(CudaSlice<u8>, u64)>>,
    pub info: DeviceInfo,
}

impl CudaDevice {
    /// Opens GPU `ordinal` and loads the kernels, from `cache_dir` when a module for this device, NVRTC and
    /// source is there, else compiled now (and stored there when `cache_dir` is given and writable).
    pub fn open(ordinal: usize, cache_dir: Option<&Path>) -> Result<Self, DeviceError> {
        if !driver_present() {
            return Err(DeviceError::Driver(
                "no CUDA driver library (libcuda.so) on this machine: an NVIDIA GPU and driver are needed".into(),
            ));
        }
        if !nvrtc_present() {
            return Err(DeviceError::Driver(
                "NVRTC (libnvrtc.so.13) not found: install the nvidia-cuda-nvrtc==13.0.88 wheel and put its \
                 nvidia/cu13/lib on LD_LIBRARY_PATH (or pass its folder to preload_nvrtc)"
                    .into(),
            ));
        }
        let n = CudaContext::device_count().map_err(drv)?;
        if ordinal >= n.max(0) as usize {
            return Err(DeviceError::Driver(format!("GPU {ordinal} requested, {n} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        // One stream, in order: no per-buffer events needed (and captured graphs need them off).
        // SAFETY: called before any buffer exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let cc = ctx.compute_capability().map_err(drv)?;
        let name = ctx.name().map_err(drv)?;
        let total_mem = ctx.total_mem().map_err(drv)?;
        let nvrtc = nvrtc_version()?;
        let file = module_cache_name(&name, cc, nvrtc, source_hash());
        let cached = cache_dir.map(|d| d.join(&file));
        let (cubin, from) = match cached.as_ref().and_then(|p| std::fs::read(p).ok()) {
            Some(b) if !b.is_empty() => (b, "cache"),
            _ => {
                let t = std::time::Instant::now();
                let b = compile_cubin(cc)?;
                tracing::info!(device = %name, ms = t.elapsed().as_millis() as u64, "compiled the CUDA kernels");
                if let Some(p) = cached.as_ref() {
                    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                    let stored = p.parent().map(std::fs::create_dir_all).transpose().is_ok()
                        && std::fs::write(&tmp, &b).is_ok()
                        && std::fs::rename(&tmp, p).is_ok();
                    if !stored {
                        tracing::warn!(path = %p.display(), "could not store the compiled kernels");
                    }
                }
                (b, "nvrtc")
            }
        };
        let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(drv)?;
        let mut funcs = HashMap::new();
        for k in KERNELS {
            funcs.insert(k.name, module.load_function(k.name).map_err(drv)?);
        }
        let info =
            DeviceInfo { name, compute_capability: cc, total_mem, nvrtc, module_from: from, module_path: cached };
        Ok(CudaDevice { ctx, stream, funcs, bufs: Vec::new(), info })
    }

    /// Waits for everything queued.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(drv)
    }

    /// The context (for timing events and graphs).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copies `bytes` bytes from buffer `src` to buffer `dst` on the device (for the copy-bandwidth figure).
    pub fn copy(&mut self, src: CudaBufId, dst: CudaBufId, bytes: usize) -> Result<(), DeviceError> {
        if self.size(src).unwrap_or(0) < bytes || self.size(dst).unwrap_or(0) < bytes || src == dst {
            return Err(DeviceError::Buffer(format!("copy of {bytes} bytes between {src:?} and {dst:?}")));
        }
        let (a, b) = (src.0 as usize, dst.0 as usize);
        let (lo, hi) = self.bufs.split_at_mut(a.max(b));
        let (s, d) = if a < b { (&lo[a], &mut hi[0]) } else { (&hi[0], &mut lo[b]) };
        let (Some((s, _)), Some((d, _))) = (s.as_ref(), d.as_mut()) else {
            return Err(DeviceError::Buffer("copy of a freed buffer".into()));
        };
        self.stream.memcpy_dtod(&s.slice(..bytes), &mut d.slice_mut(..bytes)).map_err(drv)
    }

    fn push(&mut self, s: CudaSlice<u8>) -> CudaBufId {
        let ptr = {
            let (ptr, _sync) = s.device_ptr(&self.stream);
            ptr
        };
        self.bufs.push(Some((s, ptr)));
        CudaBufId(self.bufs.len() as u32 - 1)
    }

    fn ptr(&self, b: CudaBufId) -> Result<u64, DeviceError> {
        match self.bufs.get(b.0 as usize) {
            Some(Some((_, p))) => Ok(*p),
            _ => Err(DeviceError::Buffer(format!("unknown or freed {b:?}"))),
        }
    }
}

impl Device for CudaDevice {
    fn alloc(&mut self, bytes: usize) -> Result<CudaBufId, DeviceError> {
        let s = self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(drv)?;
        Ok(self.push(s))
    }

    fn upload(&mut self, data: &[u8]) -> Result<CudaBufId, DeviceError> {
        let s = if data.is_empty() {
            self.stream.alloc_zeros::<u8>(1).map_err(drv)?
        } else {
            self.stream.clone_htod(data).map_err(drv)?
        };
        Ok(self.push(s))
    }

    fn download(&mut self, buf: CudaBufId) -> Result<Vec<u8>, DeviceError> {
        match self.bufs.get(buf.0 as usize) {
            Some(Some((s, _))) => self.stream.clone_dtoh(s).map_err(drv),
            _ => Err(DeviceError::Buffer(format!("unknown or freed {buf:?}"))),
        }
    }

    fn write(&mut self, buf: CudaBufId, data: &[u8]) -> Result<(), DeviceError> {
        match self.bufs.get_mut(buf.0 as usize) {
            Some(Some((s, _))) if s.len() >= data.len() => {
                if data.is_empty() {
                    return Ok(());
                }
                self.stream.memcpy_htod(data, &mut s.slice_mut(..data.len())).map_err(drv)
            }
            _ => Err(DeviceError::Buffer(format!("write of {} bytes to {buf:?}", data.len()))),
        }
    }

    fn read(&mut self, buf: CudaBufId, out: &mut [u8]) -> Result<(), DeviceError> {
        match self.bufs.get(buf.0 as usize) {
            Some(Some((s, _))) if s.len() >= out.len() => {
                if out.is_empty() {
                    return Ok(());
                }
                self.stream.memcpy_dtoh(&s.slice(..out.len()), out).map_err(drv)?;
                self.stream.synchronize().map_err(drv)
            }
            _ => Err(DeviceError::Buffer(format!("read of {} bytes from {buf:?}", out.len()))),
        }
    }

    fn free(&mut self, buf: CudaBufId) {
        if let Some(b) = self.bufs.get_mut(buf.0 as usize) {
            *b = None;
        }
    }

    fn size(&self, buf: CudaBufId) -> Option<usize> {
        match self.bufs.get(buf.0 as usize) {
            Some(Some((s, _))) => Some(s.len()),
            _ => None,
        }
    }

    fn launch(&mut self, plan: &Plan, args: &[Arg]) -> Result<(), DeviceError> {
        let f = self
            .funcs
            .get(plan.kernel)
            .ok_or_else(|| DeviceError::Driver(format!("kernel {} not in the module", plan.kernel)))?;
        // Argument values live here until the launch has copied them.
        enum V {
            P(u64),
            I(i32),
            L(i64),
            F(f32),
        }
        let mut vals = Vec::with_capacity(args.len());
        for a in args {
            vals.push(match *a {
                Arg::Buf(b) => V::P(self.ptr(b)?),
                Arg::Null => V::P(0),
                Arg::I32(v) => V::I(v),
                Arg::I64(v) => V::L(v),
                Arg::F32(v) => V::F(v),
            });
        }
        let mut b = self.stream.launch_builder(f);
        for v in &vals {
            match v {
                V::P(p) => b.arg(p),
                V::I(i) => b.arg(i),
                V::L(l) => b.arg(l),
                V::F(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (plan.dims.grid[0], plan.dims.grid[1], plan.dims.grid[2]),
            block_dim: (plan.dims.block[0], plan.dims.block[1], plan.dims.block[2]),
            shared_mem_bytes: 0,
        };
        // SAFETY: the host plans (cuda_host) pass exactly the kernel's parameters in order, with buffer sizes
        // checked against the shapes the plan's grid covers; pointers are live device allocations of this
        // context (or null where the kernel accepts null).
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }
}
