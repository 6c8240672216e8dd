//! [`DeviceMem`] on wgpu: the device layer ([`crate::backend::device`]) records its copies and clears into the
//! tick's encoder ([`Enc`]), allocates storage buffers, borrows pooled scratch buffers as temporaries, and launches
//! `kvdev.wgsl`'s `add_ape` as its one kernel.

use super::context::{Enc, ScratchBuf, WgpuContext};
use crate::backend::device::DeviceMem;
use crate::Result;

impl DeviceMem for WgpuContext {
    type Buf = wgpu::Buffer;
    type Temp = ScratchBuf;
    type Enc = Enc;

    fn max_binding(&self) -> u64 {
        WgpuContext::max_binding(self)
    }

    fn zeroed(&self, label: &'static str, words: usize) -> wgpu::Buffer {
        self.storage_zeroed(label, words)
    }

    fn upload_f32(&self, label: &'static str, data: &[f32]) -> wgpu::Buffer {
        self.storage_f32(label, data)
    }

    fn upload_u32(&self, label: &'static str, data: &[u32]) -> wgpu::Buffer {
        self.storage_u32(label, data)
    }

    fn temp(&self, words: usize) -> ScratchBuf {
        self.scratch(words)
    }

    fn size(&self, b: &wgpu::Buffer) -> u64 {
        b.size()
    }

    fn encoder(&self) -> Enc {
        WgpuContext::encoder(self)
    }

    fn copy(&self, enc: &mut Self::Enc, src: &wgpu::Buffer, src_at: u64, dst: &wgpu::Buffer, dst_at: u64, bytes: u64) {
        WgpuContext::copy(self, enc, src, src_at, dst, dst_at, bytes);
    }

    fn clear(&self, enc: &mut Self::Enc, b: &wgpu::Buffer, at: u64, bytes: u64) {
        WgpuContext::clear(self, enc, b, at, bytes);
    }

    fn add_ape(
        &self,
        enc: &mut Self::Enc,
        g: &wgpu::Buffer,
        off: usize,
        rows: usize,
        w: usize,
        ape: &wgpu::Buffer,
        pos0: usize,
        ratio: usize,
    ) -> Result<()> {
        super::kvdev::add_ape(self, enc, g, off, rows, w, ape, pos0, ratio)
    }

    fn submit(&self, enc: Self::Enc) -> Result<()> {
        WgpuContext::submit(self, enc)
    }

    fn submit_read_f32(&self, enc: Self::Enc, b: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<f32>> {
        WgpuContext::submit_read_f32(self, enc, b, offset, len)
    }

    fn read_f32(&self, b: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<f32>> {
        WgpuContext::read_f32(self, b, offset, len)
    }
}
