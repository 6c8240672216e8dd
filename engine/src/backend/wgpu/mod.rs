//! The wgpu backend: every op as a WGSL compute shader (sources in the `ds4-shaders-wgsl` crate).
