//! WGSL compute shaders for every op of the ds4 forward pass. Sources are embedded as strings so the engine can
//! build pipelines without touching the filesystem; tests validate each one with naga.
