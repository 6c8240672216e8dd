//! The wgpu backend: every op as a WGSL compute shader (sources in the `ds4-shaders-wgsl` crate).
//!
//! Layers, bottom-up:
//! - [`context`]: adapter/device, limits, pipeline cache, scratch-buffer pool, submission/readback counters,
//!   buffer helpers, [`context::test_context`] for tests.
//! - [`weights`]: weight tensors kept in their file encoding, split at row boundaries across buffers when larger
//!   than the storage binding limit.
//! - [`matmul`]: quantized matrix-vector / matrix-matrix products and row gathers over split weights.
//! - [`ops`]: every other kernel (norm, RoPE, attention, mHC, compressor, indexer, MoE, activation simulation,
//!   compressor `ape`).
//! - `resident`: the tick's command encoder and the device buffer behind each tensor ([`crate::graph::BufId`]).
//! - `devmem`: the shared device layer's memory trait ([`crate::backend::device::DeviceMem`]) on wgpu, so the
//!   device KV — page pools and tables shared by forks and copied on write ([`pagedev`]), the session mirrors with
//!   ring, paged rows, frontiers, roll-back log, upload, fork and sync ([`kvdev`]) — is the device layer's
//!   ([`crate::backend::device`]) with wgpu buffers.
//! - the node kernels, one function per [`crate::graph::Op`] kind: `rows` (row ops, mHC, logits, readback), `attn`
//!   (compressor push, indexer top-k, sparse attention, ring store), `moe` (routing and the expert halves).
//! - `fuse`: consecutive nodes recorded as one dispatch where a kernel does both with the same f32 operations
//!   (mHC weights + collapse + norm, mHC post + norm, norm + rope, the decode MoE's up + SwiGLU and down + sum over
//!   experts, …), a peephole over the recipe's order; and the weight products the executor finds ready together,
//!   one dispatch per input, weight type and width.
//! - [`timing`]: per-dispatch GPU times from timestamp queries, where the adapter has them.
//! - [`backend`]: [`WgpuBackend`], the [`crate::backend::Backend`] kernel provider that dispatches nodes to them.
//!
//! Every function here only records commands into a `wgpu::CommandEncoder` unless it says otherwise; call
//! [`context::WgpuContext::submit`] to run them and [`context::WgpuContext::read_f32`] to read results. The expert
//! ids of a MoE layer never leave the device: a prefill groups its rows by expert on the device and dispatches the
//! expert products indirectly ([`moe_ids`]), so a tick is one submission.
//!
//! Known limits (next steps): a layer's device KV page pool is one binding shared by all sessions (at most the
//! storage binding limit: ~128 MiB on lavapipe), so very long contexts or many sessions need a pool split across
//! bindings (the roll-back log's chunk pools too: one buffer per layer and input); key and row lists are small
//! fresh buffers per dispatch and the RoPE tables one per tick and flavour (uniform blocks and bind groups are
//! cached; the tensor buffers are reused, grown only when the batch grows); a product's workgroup takes several
//! output rows (`64 / row_lanes` of the weight format) and a tile of 8 tokens (a prefill streams each weight row
//! once per tile), its lanes summed by subgroup shuffles where the adapter has subgroups (the same bits as the
//! workgroup-memory tree: `shaders-wgsl/src/wgsl/lanes.wgsl`); no 16-byte loads or integer dot products yet, and
//! prefill is not tiled through workgroup memory. The context counts
//! what a tick costs ([`crate::backend::device::DeviceCounters`]: dispatches, syncs, bytes each way, weight bytes
//! fetched against each row once), printed by `ds4-bench --backend wgpu`.

mod attn;
pub(crate) mod backend;
pub mod context;
mod copies;
mod devmem;
mod fuse;
pub(crate) mod kvdev;
pub(crate) mod matmul;
mod moe;
pub(crate) mod moe_ids;
pub(crate) mod ops;
pub(crate) mod pagedev;
mod pairs;
mod resident;
mod rows;
pub mod timing;
pub(crate) mod weights;

#[cfg(test)]
mod candidates_tests;
#[cfg(test)]
mod fallback_tests;
#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod lanes_tests;
#[cfg(test)]
mod moe_tiles_tests;
#[cfg(test)]
mod ops_tests;
#[cfg(test)]
mod resident_tests;
#[cfg(test)]
mod tests;

pub use backend::WgpuBackend;
pub use context::{ContextOptions, Enc, WgpuContext};
pub use matmul::{get_rows, matmul, View};
pub use pagedev::LOG_CHUNK_TOKENS;
pub use weights::{plan_chunks, GpuWeight};
