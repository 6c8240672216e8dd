//! The backend registry: the one list of backends ([`BackendKind`], defined next to the override registry in
//! `ds4_kernels_native` so overrides name their host by it) and the one place that creates them ([`create`]).
//! The engine, server, CLI, benches and tests all pick a backend through it: by [`BackendKind`], or by name with
//! [`BackendKind::from_str`](std::str::FromStr) (`"cpu"`, `"wgpu"`, `"cuda"`).
//!
//! A backend compiled out of this build (the `wgpu` feature off) is still a kind: creating it is a clear error,
//! so a command line names the same backends in every build.

pub use ds4_kernels_native::BackendKind;

use super::cpu::CpuBackend;
use super::Backend;
use crate::{Error, Result};

/// What creating a backend may depend on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendOptions {
    /// CPU worker threads (0 = all cores).
    pub threads: usize,
    /// CPU: quantized weights times f32 activations ([`crate::EngineOptions::f32_acts`]).
    pub f32_acts: bool,
}

/// Whether this build can create backends of `kind` at all (a device may still be missing at run time).
pub fn compiled(kind: BackendKind) -> bool {
    match kind {
        BackendKind::Cpu => true,
        BackendKind::Wgpu => cfg!(feature = "wgpu"),
        BackendKind::Cuda => cfg!(feature = "cuda"),
    }
}

/// Whether a backend of `kind` runs beside a CPU backend that takes the ops it has no kernel for (the CUDA
/// backend: its kernels cover part of the graph, see [`super::cuda`]).
pub fn needs_host_fallback(kind: BackendKind) -> bool {
    matches!(kind, BackendKind::Cuda)
}

/// A new backend of `kind`.
pub fn create(kind: BackendKind, opts: &BackendOptions) -> Result<Box<dyn Backend>> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(CpuBackend::new(opts.threads).with_f32_acts(opts.f32_acts))),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => Ok(Box::new(super::wgpu::WgpuBackend::new()?)),
        #[cfg(not(feature = "wgpu"))]
        BackendKind::Wgpu => {
            Err(Error::Backend { backend: "wgpu", what: "this build has no wgpu support (feature off)".into() })
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => Ok(Box::new(super::cuda::CudaBackend::open()?)),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => Err(Error::Backend {
            backend: "cuda",
            what: "this build has no CUDA support: build with `--features cuda` (needs no CUDA installed to build)"
                .into(),
        }),
    }
}

/// Parses a backend name, as an engine error.
pub fn parse(name: &str) -> Result<BackendKind> {
    name.parse().map_err(|e: ds4_kernels_native::UnknownBackend| Error::InvalidArgument(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_compiled_kind_creates_a_backend_of_that_kind() {
        assert!(parse("tpu").unwrap_err().to_string().contains("tpu"));
        assert_eq!(parse("cpu").unwrap(), BackendKind::Cpu);
        let be = create(BackendKind::Cpu, &BackendOptions { threads: 1, f32_acts: false }).unwrap();
        assert_eq!((be.kind(), be.name()), (BackendKind::Cpu, "cpu"));
        assert!(compiled(BackendKind::Cpu));
        if !compiled(BackendKind::Wgpu) {
            assert!(create(BackendKind::Wgpu, &BackendOptions::default()).is_err());
        }
        assert_eq!(parse("cuda").unwrap(), BackendKind::Cuda);
        assert!(needs_host_fallback(BackendKind::Cuda) && !needs_host_fallback(BackendKind::Cpu));
        if !compiled(BackendKind::Cuda) {
            let e = create(BackendKind::Cuda, &BackendOptions::default()).err().unwrap().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }
}
