//! Backends: implementations of the job-graph ops. `cpu` is the reference (and SIMD-accelerated) backend; `wgpu`
//! runs the same ops as WGSL compute shaders. Every backend exposes the same op surface.

pub mod cpu;
#[cfg(feature = "wgpu")]
pub mod wgpu;
