//! Device-resident tick state of [`super::WgpuBackend`]: the command encoder the tick's nodes record into, the
//! device buffer behind each [`BufId`], the tick's RoPE tables and the MoE row plan.
//!
//! One [`Tick`] lives in the backend behind a mutex. [`Tick::enc`] opens the encoder lazily; kernels append to it
//! and only [`Tick::take_enc`] (for a readback) hands it to the queue. Each tensor's buffer ([`Tick::buf`]) is
//! sized by [`len_of`] for the tick's rows — every kernel asks for the same size, so a buffer never grows between
//! its writer and its readers — grown on demand, never shrunk, and keeps no meaning between ticks (a decode loop
//! at a steady batch size therefore creates no tensor buffers).
//!
//! Resolution ([`BufId`] → buffers): one buffer per tensor, except the mHC streams, which ping-pong between two
//! buffers because the post-mix may not write its input ([`Tick::flip_streams`]); [`BufId::Routes`], which is the
//! selected experts (u32, [`Tick::buf`]) plus their weights ([`Tick::route_weights`]) plus the host-side row plan
//! ([`MoePlan`]); and the expert tensors, whose shared-expert rows live in buffers of their own
//! ([`Tick::shared`]). [`BufId::ExpertGate`] and [`BufId::ExpertUp`] are the two halves of one `[slot rows,
//! 2·expert_ffn]` buffer (gate then up per row), the layout the SwiGLU kernel reads; it writes the gate half in place.
//!
//! Invariant: no host write (`queue.write_buffer`) ever targets these buffers or pooled scratch while commands are
//! recorded: writes land at the next submit, before everything recorded earlier. Uploads use fresh buffers.

use super::context::{Enc, WgpuContext};
use crate::backend::StepCtx;
use crate::graph::BufId;
use crate::model::{Model, RopeFreqs};

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
            // The old buffer goes: bind groups naming it must not keep it alive.
            ctx.forget_bindings();
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

/// Values (f32 or u32) of tensor `id` for a tick of `rows` batch rows and `logit_rows` logit rows; expert tensors
/// count the routed slot rows (`rows · k`), the shared expert's rows are [`Tick::shared`]'s. `None` for the KV
/// pages (the session mirrors, [`super::kvdev`]).
pub fn len_of(id: BufId, model: &Model, rows: usize, logit_rows: usize) -> Option<usize> {
    use BufId::*;
    let c = &model.config;
    let per_row = match id {
        Selected => c.idx_topk.max(1),
        Routes => c.n_experts_used,
        // One buffer holds both halves.
        ExpertGate | ExpertUp => c.n_experts_used * 2 * c.expert_ffn,
        ExpertOut => c.n_experts_used * c.d_model,
        Logits => return Some(logit_rows * c.vocab),
        // (id, value bits) pairs, room for the most candidates.
        Candidates => return Some(logit_rows * 2 * crate::graph::MAX_LOGIT_CANDIDATES),
        Kv(_) => return None,
        _ => id.host_width(c)?,
    };
    Some(rows * per_row)
}

/// How the routed rows of an MoE layer are laid out in the expert tensors (set by the routing node, read by the
/// expert nodes of the same layer).
#[derive(Debug, Default)]
pub struct MoePlan {
    /// The layout the rows are planned in for the current layer (`None` until its routing node ran).
    pub layout: Option<crate::graph::Experts>,
    /// The layer has a shared expert (the combine adds it).
    pub shared: bool,
    /// The slot rows grouped by expert on the device ([`Experts::ByExpert`](crate::graph::Experts), made by the
    /// layer's first expert product).
    pub tiles: Option<super::moe_ids::Tiles>,
    /// Index of each slot row's routing weight (`row · k + choice`).
    pub weights: Vec<u32>,
}

/// The state of the tick being recorded. See the module docs.
#[derive(Default)]
pub struct Tick {
    enc: Option<Enc>,
    bufs: Vec<Grown>,
    /// The other stream buffer and whether it holds the current streams.
    streams_alt: Grown,
    alt: bool,
    route_w: Grown,
    /// Shared-expert gate/up `[rows, 2·ffn]` and down `[rows, d]`.
    shared: [Grown; 2],
    /// Batch rows and logit rows of the tick.
    rows: usize,
    logit_rows: usize,
    /// cos/sin of the batch positions: plain, compressed rope.
    rope: [Option<Buf>; 2],
    pub moe: MoePlan,
    /// A node waiting for its successor ([`super::fuse`]).
    pub held: Option<super::fuse::Held>,
}

impl Tick {
    /// Starts a tick over `cx`'s batch: drops anything left recorded (a failed tick) and the last tick's tables.
    pub fn begin(&mut self, cx: &StepCtx<'_>) {
        self.enc = None;
        self.held = None;
        self.rows = cx.batch.rows.len();
        self.logit_rows = cx.batch.logit_rows.len();
        self.rope = [None, None];
        self.moe.tiles = None;
        self.moe.weights.clear();
        self.moe.layout = None;
        if self.bufs.is_empty() {
            self.bufs.resize_with(BufId::FIXED, Grown::default);
        }
    }

    /// The tick's encoder (opened on first use).
    pub fn enc(&mut self, ctx: &WgpuContext) -> &mut Enc {
        self.enc.get_or_insert_with(|| ctx.encoder())
    }

    /// The tick's encoder and the MoE plan together (kernels record while reading the plan).
    pub fn enc_moe(&mut self, ctx: &WgpuContext) -> (&mut Enc, &MoePlan) {
        (self.enc.get_or_insert_with(|| ctx.encoder()), &self.moe)
    }

    /// Takes the encoder (a fresh one when nothing was recorded), e.g. to submit it with a readback.
    pub fn take_enc(&mut self, ctx: &WgpuContext) -> Enc {
        self.enc.take().unwrap_or_else(|| ctx.encoder())
    }

    /// Whether commands are recorded and not yet submitted.
    pub fn pending(&self) -> bool {
        self.enc.is_some()
    }

    /// The device buffer of tensor `id` (for [`BufId::Streams`] the current streams), sized by [`len_of`]; `None`
    /// for the KV pages.
    pub fn buf(&mut self, ctx: &WgpuContext, model: &Model, id: BufId) -> Option<Buf> {
        let len = len_of(id, model, self.rows, self.logit_rows)?;
        // The gate and up halves share one buffer (see the module docs).
        let at = if id == BufId::ExpertUp { BufId::ExpertGate.index() } else { id.index() };
        let g = if id == BufId::Streams && self.alt { &mut self.streams_alt } else { &mut self.bufs[at] };
        Some(g.get(ctx, label(id), len).clone())
    }

    /// The buffer the next post-mix writes the streams into (not the current one).
    pub fn next_streams(&mut self, ctx: &WgpuContext, model: &Model) -> Buf {
        let len = len_of(BufId::Streams, model, self.rows, 0).unwrap_or(0);
        let g = if self.alt { &mut self.bufs[BufId::Streams.index()] } else { &mut self.streams_alt };
        g.get(ctx, "streams", len).clone()
    }

    /// Makes the buffer of [`Tick::next_streams`] the current streams.
    pub fn flip_streams(&mut self) {
        self.alt = !self.alt;
    }

    /// Makes the first stream buffer current (the embedding writes it).
    pub fn reset_streams(&mut self) {
        self.alt = false;
    }

    /// The routing weights of [`BufId::Routes`] (`[rows, k]`).
    pub fn route_weights(&mut self, ctx: &WgpuContext, model: &Model) -> Buf {
        let len = self.rows * model.config.n_experts_used;
        self.route_w.get(ctx, "route weights", len).clone()
    }

    /// The shared expert's rows of the expert tensors: gate/up `[rows, 2·ffn]` and down `[rows, d]`.
    pub fn shared(&mut self, ctx: &WgpuContext, model: &Model) -> (Buf, Buf) {
        let c = &model.config;
        let gu = self.shared[0].get(ctx, "shared gate/up", self.rows * 2 * c.expert_ffn).clone();
        let out = self.shared[1].get(ctx, "shared out", self.rows * c.d_model).clone();
        (gu, out)
    }

    /// The tick's cos/sin table of layer `layer`'s rope at the batch positions (uploaded once per tick and flavour).
    pub fn rope(&mut self, ctx: &WgpuContext, cx: &StepCtx<'_>, layer: usize) -> Buf {
        let compressed = cx.model.config.compress_ratios[layer] != 0;
        let slot = &mut self.rope[compressed as usize];
        slot.get_or_insert_with(|| {
            let freqs = cx.rope.for_layer(cx.model, layer);
            ctx.storage_f32("rope", &rope_table(freqs, cx.batch.rows.iter().map(|r| r.pos)))
        })
        .clone()
    }
}

fn label(id: BufId) -> &'static str {
    match id {
        BufId::Streams => "streams",
        BufId::Logits => "logits",
        BufId::Candidates => "candidates",
        BufId::Selected => "selected",
        BufId::Routes => "routes",
        _ => "tensor",
    }
}

/// `(cos, sin)` per row and pair for `rope` at each position in `pos`.
pub fn rope_table(rope: &RopeFreqs, pos: impl Iterator<Item = usize>) -> Vec<f32> {
    let mut out = Vec::new();
    for p in pos {
        for &f in &rope.inv_freq {
            let (s, c) = (p as f32 * f).sin_cos();
            out.extend([c, s]);
        }
    }
    out
}
