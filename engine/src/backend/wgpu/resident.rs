//! Device-resident tick state of [`super::WgpuBackend`]: the command encoder the tick's ops record into and the
//! device buffers that stand in for the host [`crate::backend::Activations`].
//!
//! One [`Tick`] lives in the backend behind a mutex. [`Tick::enc`] opens the encoder lazily; ops append to it and
//! only [`Tick::take_enc`] (for a readback or the end of the tick) hands it to the queue. Activation buffers
//! ([`ActBufs`]) are grown to the batch (never shrunk) and keep no meaning between ticks. The mHC streams
//! ping-pong between two buffers because the post-mix may not write its input.
//!
//! Invariant: no host write (`queue.write_buffer`) ever targets these buffers or pooled scratch while commands are
//! recorded: writes land at the next submit, before everything recorded earlier. Uploads use fresh buffers.

use super::context::WgpuContext;

type Buf = wgpu::Buffer;

/// A device buffer grown on demand (contents not preserved on growth).
#[derive(Default)]
pub struct Grown {
    buf: Option<Buf>,
}

impl Grown {
    /// The buffer, at least `len` f32 values long.
    pub fn get(&mut self, ctx: &WgpuContext, label: &str, len: usize) -> &Buf {
        let need = (len.max(1) * 4) as u64;
        if self.buf.as_ref().is_none_or(|b| b.size() < need) {
            let size = need.next_power_of_two().max(256);
            tracing::debug!(label, size, "wgpu: growing resident buffer");
            self.buf = Some(ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        self.buf.as_ref().expect("just ensured")
    }
}

/// Device mirrors of the [`crate::backend::Activations`] fields.
#[derive(Default)]
pub struct ActBufs {
    /// Two `[rows, hc·d]` stream buffers; `streams[cur]` holds the current streams.
    pub streams: [Grown; 2],
    pub cur: usize,
    /// `[rows, d]`.
    pub collapsed: Grown,
    /// `[rows, hc + hc²]`: post weights then comb, per row (the layout `ops::hc_pre` writes).
    pub state: Grown,
    /// `[rows, d]`.
    pub sub_out: Grown,
    /// `[rows, d]`.
    pub head_out: Grown,
    /// `[logit_rows, vocab]`.
    pub logits: Grown,
}

/// The state of the tick being recorded. See the module docs.
#[derive(Default)]
pub struct Tick {
    enc: Option<wgpu::CommandEncoder>,
    pub act: ActBufs,
}

impl Tick {
    /// The tick's encoder (opened on first use).
    pub fn enc(&mut self, ctx: &WgpuContext) -> &mut wgpu::CommandEncoder {
        self.enc.get_or_insert_with(|| ctx.encoder())
    }

    /// Takes the encoder (a fresh one when nothing was recorded), e.g. to submit it with a readback.
    pub fn take_enc(&mut self, ctx: &WgpuContext) -> wgpu::CommandEncoder {
        self.enc.take().unwrap_or_else(|| ctx.encoder())
    }

    /// Whether commands are recorded and not yet submitted.
    pub fn pending(&self) -> bool {
        self.enc.is_some()
    }

    /// Drops anything recorded (a failed tick).
    pub fn discard(&mut self) {
        self.enc = None;
    }
}
