//! The device layer: session KV on a device — page pools, page tables, rings, frontiers, the roll-back log and
//! fork — written once over a small device-memory trait ([`DeviceMem`]), for every device-resident backend.
//!
//! - [`pages`]: a layer's [`pages::PagePool`] of fixed-size row pages shared by every session, each session's
//!   [`pages::PageTable`] of page ids (mirrored on the device for the kernels), copy on write of shared pages, and
//!   the roll-back log's chunk rings ([`pages::ChunkRing`]).
//! - [`kv`]: a session's device mirror ([`kv::SlotKv`]: per layer the window ring, the compressed and indexer row
//!   tables, the compressor frontiers and the roll-back log), upload, download, fork ([`kv::SlotKv::duplicate`]:
//!   pages and log chunks shared, only the ring and frontiers copied), roll back from the log
//!   ([`kv::SlotKv::rollback`]), and the mirrors of a backend by batch slot ([`kv::DevKv`]).
//! - `mock` (unit tests only): a host-memory [`DeviceMem`] (commands recorded and run at submit, like a device
//!   queue) on which the layer's page-table, fork and roll-back logic is tested without a GPU.
//!
//! A backend implements [`DeviceMem`] (wgpu: `backend::wgpu::devmem`) and keeps a [`kv::DevKv`] of its own
//! device type; its attention kernels read the rings, tables and pools directly. What the trait asks for is what
//! the layer does: allocate (zeroed or from host data), copy between buffers, clear ranges, read back, submit,
//! and one kernel-launch hook ([`DeviceMem::add_ape`], the frontier rebuild of a roll back). Every write is a
//! command recorded into the caller's encoder after the commands that may still read the old contents.

pub mod kv;
#[cfg(test)]
pub mod mock;
pub mod pages;

use crate::{Error, Result};

/// The device memory the layer runs on (see the module docs). Buffers hold 4-byte words (f32 or u32); offsets
/// and sizes are in bytes unless named in words.
pub trait DeviceMem {
    /// A device buffer.
    type Buf;
    /// A temporary buffer (may come from and return to a pool); contents undefined when handed out.
    type Temp: std::ops::Deref<Target = Self::Buf>;
    /// An ordered list of recorded commands, run by [`DeviceMem::submit`].
    type Enc;

    /// The largest buffer a kernel can bind (a page pool never grows past it).
    fn max_binding(&self) -> u64;
    /// A new buffer of `words` zeroed words.
    fn zeroed(&self, label: &'static str, words: usize) -> Self::Buf;
    /// A new buffer holding `data`.
    fn upload_f32(&self, label: &'static str, data: &[f32]) -> Self::Buf;
    /// A new buffer holding `data`.
    fn upload_u32(&self, label: &'static str, data: &[u32]) -> Self::Buf;
    /// A temporary buffer of at least `words` words.
    fn temp(&self, words: usize) -> Self::Temp;
    /// Size of `b` in bytes.
    fn size(&self, b: &Self::Buf) -> u64;
    /// A new, empty command list.
    fn encoder(&self) -> Self::Enc;
    /// Records a copy of `bytes` bytes from `src` at `src_at` to `dst` at `dst_at` (`src` and `dst` distinct).
    fn copy(&self, enc: &mut Self::Enc, src: &Self::Buf, src_at: u64, dst: &Self::Buf, dst_at: u64, bytes: u64);
    /// Records zeroing `bytes` bytes of `b` at `at`.
    fn clear(&self, enc: &mut Self::Enc, b: &Self::Buf, at: u64, bytes: u64);
    /// Records `g[off + r·w + c] += ape[((pos0 + r) % ratio)·w + c]` for `rows` rows of `w` words (offsets in
    /// words): the compressor's position bias, the one kernel the layer launches.
    #[allow(clippy::too_many_arguments)]
    fn add_ape(
        &self,
        enc: &mut Self::Enc,
        g: &Self::Buf,
        off: usize,
        rows: usize,
        w: usize,
        ape: &Self::Buf,
        pos0: usize,
        ratio: usize,
    ) -> Result<()>;
    /// Runs `enc` and waits for it.
    fn submit(&self, enc: Self::Enc) -> Result<()>;
    /// Runs `enc`, then returns `len` f32 words of `b` from word `offset`.
    fn submit_read_f32(&self, enc: Self::Enc, b: &Self::Buf, offset: usize, len: usize) -> Result<Vec<f32>>;
    /// `len` f32 words of `b` from word `offset` (after everything submitted before).
    fn read_f32(&self, b: &Self::Buf, offset: usize, len: usize) -> Result<Vec<f32>> {
        self.submit_read_f32(self.encoder(), b, offset, len)
    }
}

/// An error of the device layer.
pub(crate) fn dev_err(what: impl Into<String>) -> Error {
    Error::Backend { backend: "device kv", what: what.into() }
}

/// Calls `f(src_row, dst_row, n)` for the runs of consecutive pairs in `pairs` (`(src_row, dst_row)` each), in
/// order: the row copies [`copy_rows`] records, merged.
pub fn row_runs(pairs: &[(usize, usize)], mut f: impl FnMut(usize, usize, usize)) {
    let mut i = 0;
    while i < pairs.len() {
        let (s0, d0) = pairs[i];
        let mut n = 1;
        while i + n < pairs.len() && pairs[i + n] == (s0 + n, d0 + n) {
            n += 1;
        }
        f(s0, d0, n);
        i += n;
    }
}

/// Records copies of rows `(src_row, dst_row)` of `width` words from `src` to `dst`, merging consecutive runs.
pub fn copy_rows<D: DeviceMem>(
    dev: &D,
    enc: &mut D::Enc,
    src: &D::Buf,
    dst: &D::Buf,
    pairs: &[(usize, usize)],
    width: usize,
) {
    let b = (width * 4) as u64;
    row_runs(pairs, |s, d, n| dev.copy(enc, src, s as u64 * b, dst, d as u64 * b, n as u64 * b));
}

/// What a device backend has done so far ([`crate::backend::Backend::device_counters`]; subtract two reads for one
/// tick's): the host syncs, the dispatches and the objects made for them, the bytes crossing the bus, and the
/// weight bytes the product kernels fetch against the least they could.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    pub submits: u64,
    pub readbacks: u64,
    /// Compute dispatches recorded.
    pub dispatches: u64,
    /// Bind groups created (a dispatch reuses the last one made for its pipeline and buffers).
    pub bind_groups: u64,
    /// Compute passes begun: one per run of dispatches between two other encoder commands (copies, clears), and
    /// one per dispatch while a timing window is open.
    pub passes: u64,
    /// Of `dispatches`, the copies and zero fills recorded as kernels so the pass goes on (a tick's KV row copies:
    /// ring, roll-back log, compressor frontiers); `dispatches − copy_kernels` are the compute kernels.
    pub copy_kernels: u64,
    /// Bytes written from the host: buffers created with contents (weights on first use, uniform blocks, id and
    /// key lists, tables) and queue writes.
    pub host_to_device: u64,
    /// Bytes read back to the host.
    pub device_to_host: u64,
    /// Weight bytes the product and row-gather kernels fetch, from their access pattern (a matmul workgroup reads
    /// its weight row once per token it multiplies).
    pub weights_fetched: u64,
    /// The least those kernels could fetch: every weight row a product touches once (for expert products whose
    /// ids stay on the device, `min(pairs, experts)` experts: exact for one token, an upper bound beyond).
    pub weights_min: u64,
    /// Of `dispatches`, those beyond the first of a kernel whose weight is split across bindings (one per further
    /// chunk the kernel runs over): what a device binding the whole weight would not need.
    pub split_dispatches: u64,
}

impl std::ops::Sub for DeviceCounters {
    type Output = DeviceCounters;
    fn sub(self, o: DeviceCounters) -> DeviceCounters {
        DeviceCounters {
            submits: self.submits - o.submits,
            readbacks: self.readbacks - o.readbacks,
            dispatches: self.dispatches - o.dispatches,
            bind_groups: self.bind_groups - o.bind_groups,
            passes: self.passes - o.passes,
            copy_kernels: self.copy_kernels - o.copy_kernels,
            host_to_device: self.host_to_device - o.host_to_device,
            device_to_host: self.device_to_host - o.device_to_host,
            weights_fetched: self.weights_fetched - o.weights_fetched,
            weights_min: self.weights_min - o.weights_min,
            split_dispatches: self.split_dispatches - o.split_dispatches,
        }
    }
}
