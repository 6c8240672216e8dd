//! Native overrides of the hottest ds4 ops: CUDA kernels (compiled with NVRTC at run time) and Metal kernels (Apple
//! only). A backend consults this crate for an override before falling back to its portable implementation.
