//! Overrides hosted by the CPU backend (kernels over host slices).

pub mod swiglu;
