//! The per-tick node graph, as plain data.
//!
//! A tick's [`Batch`] covers several sessions, each contributing a run of consecutive tokens (a prefill chunk or
//! one decode token); rows of the batch are `(session, position, token)` triples, grouped by session in
//! [`Run`]s. The [`Graph`] lists [`Node`]s — one fine [`Op`] each (a norm, a weight product, a rope, a compressor
//! push, a top-k, sparse attention, an mHC mix, a routing decision, an expert FFN half, a readback to the host, …)
//! — over named tensors ([`BufId`]) and the KV pages of a layer ([`BufId::Kv`]). The recipe that emits the nodes of a tick is
//! [`crate::model::recipe`]; this module only stores them and derives their dependencies.
//!
//! Invariants:
//! - Every node declares what it reads and writes ([`Op::access`]); dependencies are derived from those
//!   declarations (read-after-write, write-after-read and write-after-write on the same tensor) as nodes are
//!   pushed, so node order is always a valid schedule and edges always go forward.
//! - After [`Graph::finish`], `deps[i]` is node `i`'s dependency count and [`Graph::dependents`] its dependents
//!   (a precomputed adjacency list, as bevy's executor keeps), so an executor runs any node whose count has
//!   dropped to zero without scanning edges.
//! - Each node belongs to one [`Stage`] (the layer-sized step of the model it is part of: an mHC pre-mix, an
//!   attention, an MoE FFN, …); a stage's nodes are consecutive. A backend without a kernel for some node of a
//!   stage can run the whole stage at once ([`crate::backend::Backend::run_stage`]).
//! - What depends on the batch's shape is in the nodes: the MoE layers' expert layout ([`Experts`], per row or
//!   gathered by expert) and every host sync of a device backend ([`Op::Readback`]).
//! - Building reuses the graph's vectors: a tick allocates nothing once capacities are reached.
//! - Every op means one thing, documented on its [`Op`] variant, and every backend's kernel (portable or a native
//!   override) computes exactly that; a step shared by two ops is assigned to one of them (e.g. the MoE routing
//!   weight to [`Op::SwiGlu`], never also to [`Op::MoeCombine`]).

pub use ds4_kernels_native::OpKind;

use crate::model::{ModelConfig, WeightId};

/// The attention visibility rule — which raw and compressed rows a query at a position sees — written once for
/// every backend's [`Op::IndexerTopK`] and [`Op::SparseAttention`] kernels (`shared/spec/model.md`: row `w` of a
/// ratio-`m` compressor exists once token `(w+1)m − 1` is processed).
pub mod visibility {
    /// Positions of the raw rows a query at `pos` sees: the last `window` positions, `pos` included.
    pub fn window(pos: usize, window: usize) -> std::ops::RangeInclusive<usize> {
        (pos + 1).saturating_sub(window)..=pos
    }

    /// Compressed rows (of a ratio-`ratio` compressor) a query at `pos` sees: rows `0..` this count; 0 when the
    /// layer has no compressor (`ratio == 0`).
    pub fn compressed(pos: usize, ratio: usize) -> usize {
        (pos + 1).checked_div(ratio).unwrap_or(0)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn window_and_compressed_rows() {
            assert_eq!(super::window(2, 16), 0..=2);
            assert_eq!(super::window(20, 16), 5..=20);
            assert_eq!(super::window(20, 16).count(), 16);
            assert_eq!(super::compressed(2, 4), 0);
            assert_eq!(super::compressed(3, 4), 1, "row 0 exists once token 3 is processed");
            assert_eq!(super::compressed(10, 0), 0);
        }
    }
}

/// Named tensors (and KV pages) a node reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufId {
    /// mHC streams `[rows, hc·d]`.
    Streams,
    /// Unweighted-normed streams `[rows, hc·d]` (the mHC mix input).
    StreamsNormed,
    /// mHC mix `[rows, (2+hc)·hc]` (head: `[rows, hc]`).
    Mix,
    /// mHC `pre` `[rows, hc]`.
    Pre,
    /// mHC `post` `[rows, hc]` and `comb` `[rows, hc·hc]` of the current sublayer.
    PostComb,
    /// Sublayer input `[rows, d]` (collapsed streams).
    Collapsed,
    /// Normed sublayer input `[rows, d]`.
    Normed,
    /// Query low-rank `[rows, q_lora_rank]`.
    QLow,
    /// Queries `[rows, heads·head_dim]`.
    Q,
    /// This tick's raw KV rows `[rows, head_dim]`.
    KvRows,
    /// Compressor kv and gate projections `[rows, coff·head_dim]` each.
    CompKv,
    CompGate,
    /// Indexer compressor kv and gate projections `[rows, 2·idx_head_dim]` each.
    IdxKv,
    IdxGate,
    /// Indexer queries `[rows, idx_heads·idx_head_dim]`.
    IdxQ,
    /// Indexer head weights `[rows, idx_heads]`.
    IdxW,
    /// Indexer selection `[rows, idx_topk]` (u32, `u32::MAX` ends a short list).
    Selected,
    /// Attention output `[rows, heads·head_dim]`.
    AttnOut,
    /// Grouped output low-rank `[rows, groups·o_lora_rank]`.
    OLow,
    /// Sublayer output `[rows, d]`.
    SublayerOut,
    /// Router scores `[rows, experts]`.
    Router,
    /// Routing: selected experts, weights and the per-expert row plan.
    Routes,
    /// Expert gate / up outputs `[slot rows, expert_ffn]` (the SwiGLU is written into the gate half).
    ExpertGate,
    ExpertUp,
    /// Expert down outputs `[slot rows, d]`.
    ExpertOut,
    /// Head output `[rows, d]` (normed).
    HeadOut,
    /// Output logits `[logit_rows, vocab]` (host memory, [`crate::backend::Activations`]).
    Logits,
    /// The best logits of each logit row, `[logit_rows, k]` (id, value) pairs ([`Op::LogitCandidates`]; host
    /// memory: [`crate::backend::Activations::cand_ids`] and `cand_vals`).
    Candidates,
    /// The per-session KV pages (ring, compressed rows, frontiers) of layer `l`.
    Kv(usize),
}

impl BufId {
    /// Number of tensors other than [`BufId::Kv`].
    pub const FIXED: usize = 28;

    /// A dense index: fixed tensors first, then one per layer's KV.
    pub fn index(self) -> usize {
        use BufId::*;
        match self {
            Streams => 0,
            StreamsNormed => 1,
            Mix => 2,
            Pre => 3,
            PostComb => 4,
            Collapsed => 5,
            Normed => 6,
            QLow => 7,
            Q => 8,
            KvRows => 9,
            CompKv => 10,
            CompGate => 11,
            IdxKv => 12,
            IdxGate => 13,
            IdxQ => 14,
            IdxW => 15,
            Selected => 16,
            AttnOut => 17,
            OLow => 18,
            SublayerOut => 19,
            Router => 20,
            Routes => 21,
            ExpertGate => 22,
            ExpertUp => 23,
            ExpertOut => 24,
            HeadOut => 25,
            Logits => 26,
            Candidates => 27,
            Kv(l) => Self::FIXED + l,
        }
    }

    /// Values per batch row of a tensor that every backend keeps as plain f32 rows in one layout (row-major, `[rows,
    /// width]`; [`BufId::PostComb`] is `post` then `comb` per row), so the executor can copy it from one backend to
    /// another ([`crate::exec`]); `None` for the tensors whose layout is a backend's own: the indexer selection,
    /// the routing and the expert slot rows, the logits and the KV pages.
    pub fn host_width(self, c: &ModelConfig) -> Option<usize> {
        use BufId::*;
        let (hd, d, hc) = (c.head_dim, c.d_model, c.hc_mult);
        Some(match self {
            Streams | StreamsNormed => c.hc_dim(),
            Mix => c.hc_mix().max(hc),
            Pre => hc,
            PostComb => hc + hc * hc,
            Collapsed | Normed | SublayerOut | HeadOut => d,
            QLow => c.q_lora_rank,
            Q | AttnOut => c.n_heads * hd,
            KvRows => hd,
            CompKv | CompGate => 2 * hd,
            IdxKv | IdxGate => 2 * c.idx_head_dim,
            IdxQ => c.idx_heads * c.idx_head_dim,
            IdxW => c.idx_heads,
            OLow => c.o_groups * c.o_lora_rank,
            Router => c.n_experts,
            Selected | Routes | ExpertGate | ExpertUp | ExpertOut | Logits | Candidates | Kv(_) => return None,
        })
    }
}

/// Which sublayer an mHC site wraps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sub {
    Attn,
    Ffn,
}

/// Activation simulation applied to a tensor (see [`crate::model::sim`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimKind {
    /// FP8 (E4M3) blocks of 64 on the non-rope dims of each row.
    Fp8NoRope,
    /// Hadamard rotation then FP4 (E2M1) blocks of 32, per row.
    HadamardFp4,
}

/// The layer-sized step a node belongs to (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Embedding rows copied into every mHC stream.
    Embed,
    /// mHC pre-mix of a sublayer.
    HcPre { layer: usize, sub: Sub },
    /// Attention of a layer (updates its KV pages).
    Attention { layer: usize },
    /// mHC post-mix: streams ← post·f + combᵀ·streams.
    HcPost { layer: usize, sub: Sub },
    /// MoE FFN of a layer.
    Moe { layer: usize },
    /// Final mHC collapse and output norm.
    HcHead,
    /// Output projection for the rows that want logits.
    Logits,
}

/// One fine op. Rows are the batch's rows unless said otherwise; `width` is the length of one row of the op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// Embedding row of each token into every stream of [`BufId::Streams`].
    Embed,
    /// `y = RMSNorm(x)` per row of `width` (`heads` rows per batch row; `· w` when weighted); `x == y` is in place.
    RmsNorm { x: BufId, y: BufId, w: Option<WeightId>, width: usize, heads: usize },
    /// `y = W·x` per row.
    MatMul { w: WeightId, x: BufId, y: BufId },
    /// `y[:, g·rank..] = W[g·rank..(g+1)·rank]·x[:, g·gs..]` per group `g` (the grouped output projection).
    GroupedMatMul { w: WeightId, x: BufId, y: BufId, groups: usize, rank: usize },
    /// RoPE (of `layer`'s flavour) on each `width`-row of `x`, at its batch row's position (`heads` rows per batch
    /// row); `inverse` rotates by `−pos`.
    Rope { x: BufId, layer: usize, width: usize, heads: usize, inverse: bool },
    /// Activation simulation on each `width`-row of `x` (`heads` rows per batch row).
    ActSim { x: BufId, width: usize, heads: usize, kind: SimKind },
    /// `x *= factor` over `rows · width` values.
    Scale { x: BufId, width: usize, factor: f32 },
    /// Advance layer `layer`'s compressor (`indexer`: the indexer's) token by token through each run: each token's
    /// projected features and gate logits (+ `ape`) enter the frontier; every completed block is pooled (softmax
    /// of the gates), then normed, roped (compressed flavour, at its pooling window's first position) and, with `sim`,
    /// simulated, and the row is appended to the KV pages.
    CompressPush { layer: usize, indexer: bool, sim: bool },
    /// Lightning-indexer scores of the compressed rows visible to each row (those whose block ended at or before
    /// the row's position) and their top-k, per row.
    IndexerTopK { layer: usize },
    /// Windowed + compressed attention with sinks, per (row, head). A row at position `p` sees the raw rows of
    /// positions `max(0, p + 1 − window)..=p` (this tick's rows first, then the ring) and the compressed rows whose
    /// block ended at or before `p` — all of them on HCA layers, those [`Op::IndexerTopK`] selected on CSA layers.
    SparseAttention { layer: usize },
    /// The last `window` raw rows of each run into its session's ring, and (where the backend keeps one) every row's
    /// inputs into the roll-back log.
    WindowStore { layer: usize },
    /// mHC `pre`, `post`, `comb` (Sinkhorn) from the mix.
    HcSinkhorn { layer: usize, sub: Sub },
    /// mHC head `pre` from the head mix.
    HcHeadWeights,
    /// `out = Σ_j pre_j · streams_j` per row.
    HcCollapse { out: BufId },
    /// `streams ← post·f + combᵀ·streams` per row.
    HcPost,
    /// Expert selection and weights per row (`hash`: the token's fixed experts, else top-k of scores + bias), and
    /// the routed rows' layout `experts` (with [`Experts::ByExpert`], the per-expert row plan once the experts are
    /// known on the host).
    MoeRoute { layer: usize, hash: bool, experts: Experts },
    /// Gate and up products of every routed row (laid out as `experts` says) and of the shared expert.
    ExpertUp { layer: usize, experts: Experts },
    /// `gate ← w · silu(min(gate, L)) · clamp(up, −L, L)` over every expert row, `w` the row's routing weight from
    /// [`Op::MoeRoute`] (1 for the shared expert's rows): the routing weight is applied here, once, on every
    /// backend (so the down product and the combine see weighted rows; a fused gate + up + SwiGLU kernel applies
    /// it at the same point).
    SwiGlu { layer: usize },
    /// Down products of every expert row (laid out as `experts` says).
    ExpertDown { layer: usize, experts: Experts },
    /// `out = Σ expert out (ascending expert id; rows already weighted by [`Op::SwiGlu`]) + shared out` per row
    /// (the scatter back). No weight is applied here.
    MoeCombine { experts: Experts },
    /// Output projection of the rows in [`Batch::logit_rows`] into [`BufId::Logits`].
    Logits,
    /// The `k` best logits of each logit row (`k` ≤ [`MAX_LOGIT_CANDIDATES`]) into [`BufId::Candidates`], best
    /// first: larger value first, lower id first among equal values (−0 equals +0), NaN and −∞ never taken; a row
    /// with fewer such values ends its list with id `u32::MAX`. Exactly [`crate::sampler::top_candidates`]. A
    /// sampler whose draw depends only on the `k` best logits ([`crate::sampler::SamplerConfig::candidates`]) draws
    /// the same id from these as from the whole row, so a device backend reads back `k` pairs instead of `vocab`
    /// values ([`Batch::candidates`]).
    LogitCandidates { k: usize },
    /// Brings tensor `buf` to the host: the logit rows ([`crate::backend::Activations::logits`]; the tick's last
    /// node), or the selected experts ([`BufId::Routes`]) of a learned-routing layer laid out
    /// [`Experts::ByExpert`], which the host groups by expert. Every host sync of a device backend's tick is one of
    /// these nodes; on the CPU (host memory already) they do nothing. A tick whose batch asks for candidates reads
    /// back [`BufId::Candidates`] in place of the logits.
    Readback { buf: BufId },
    /// The MTP drafter's first stage, in place of [`Op::Embed`] ([`crate::model::MtpInputWeights`]): per row,
    /// `streams[r] = e_proj·(RMSNorm(embed[token])·enorm) + h_proj·(RMSNorm(h[r])·hnorm)` with `h` the row's
    /// input streams ([`crate::backend::Activations::hidden_in`]: the target's final streams of the previous
    /// position, or the drafter's own when it drafts on).
    MtpInput,
    /// The per-row mean over the `hc` mHC streams of [`BufId::Streams`] as they are after layer `layer` (the node
    /// follows that layer's FFN post-mix), written as feature block `tap` of the row in
    /// [`crate::backend::Activations::hidden_out`] (`[rows, taps·d]`): the target features a DSpark drafter reads
    /// ([`crate::engine::Engine::set_tap_layers`]). Only in ticks where a session keeps them.
    TapStreams { layer: usize, tap: usize },
}

/// How an MoE layer lays out its routed rows — the two algorithms of the expert FFN; the recipe picks one per
/// layer from the batch ([`crate::model::recipe`]). Both give every row the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Experts {
    /// Slot row `r·k + j` is row `r`'s `j`-th choice and each product picks its expert's weights by the selected
    /// ids where they are (no host sync; each expert's weights read once per row that chose it): small batches.
    PerRow,
    /// Slot rows grouped by expert (ascending id, rows ascending within an expert), so each expert's weights are
    /// read once per group of rows (the CPU: once per tick; a device backend: once per tile of 8 rows, grouped on
    /// the device from the selected ids): large batches.
    ByExpert,
}

impl Op {
    /// Names of the op kinds, indexed by [`Op::kind`] ([`OpKind::name`]), then the pseudo-kind `"stage"`.
    pub const KINDS: [&'static str; OpKind::ALL.len() + 1] = {
        let mut names = [""; OpKind::ALL.len() + 1];
        let mut i = 0;
        while i < OpKind::ALL.len() {
            names[i] = OpKind::ALL[i].name();
            i += 1;
        }
        names[OpKind::ALL.len()] = "stage";
        names
    };

    /// Index of the pseudo-kind under which a whole stage run at once is timed.
    pub const STAGE_KIND: usize = OpKind::ALL.len();

    /// The op's kind, an index into [`Op::KINDS`] (the discriminant of [`Op::op_kind`]).
    pub fn kind(&self) -> usize {
        self.op_kind() as usize
    }

    /// The op's kind (the typed key of the override registry, `ds4_kernels_native`).
    pub fn op_kind(&self) -> OpKind {
        match self {
            Op::Embed => OpKind::Embed,
            Op::RmsNorm { .. } => OpKind::RmsNorm,
            Op::MatMul { .. } => OpKind::MatMul,
            Op::GroupedMatMul { .. } => OpKind::GroupedMatMul,
            Op::Rope { .. } => OpKind::Rope,
            Op::ActSim { .. } => OpKind::ActSim,
            Op::Scale { .. } => OpKind::Scale,
            Op::CompressPush { .. } => OpKind::CompressPush,
            Op::IndexerTopK { .. } => OpKind::IndexerTopK,
            Op::SparseAttention { .. } => OpKind::SparseAttention,
            Op::WindowStore { .. } => OpKind::WindowStore,
            Op::HcSinkhorn { .. } => OpKind::HcSinkhorn,
            Op::HcHeadWeights => OpKind::HcHeadWeights,
            Op::HcCollapse { .. } => OpKind::HcCollapse,
            Op::HcPost => OpKind::HcPost,
            Op::MoeRoute { .. } => OpKind::MoeRoute,
            Op::ExpertUp { .. } => OpKind::ExpertUp,
            Op::SwiGlu { .. } => OpKind::SwiGlu,
            Op::ExpertDown { .. } => OpKind::ExpertDown,
            Op::MoeCombine { .. } => OpKind::MoeCombine,
            Op::Logits => OpKind::Logits,
            Op::LogitCandidates { .. } => OpKind::LogitCandidates,
            Op::Readback { .. } => OpKind::Readback,
            Op::MtpInput => OpKind::MtpInput,
            Op::TapStreams { .. } => OpKind::TapStreams,
        }
    }

    /// The op kind's name.
    pub fn name(&self) -> &'static str {
        Self::KINDS[self.kind()]
    }

    /// Calls `read` for every tensor the op reads and `write` for every tensor it writes (a tensor updated in
    /// place is written only).
    pub fn access(&self, mut read: impl FnMut(BufId), mut write: impl FnMut(BufId)) {
        use BufId::*;
        match *self {
            Op::Embed | Op::MtpInput => write(Streams),
            Op::RmsNorm { x, y, .. } | Op::MatMul { x, y, .. } | Op::GroupedMatMul { x, y, .. } => {
                if x != y {
                    read(x);
                }
                write(y);
            }
            Op::Rope { x, .. } | Op::ActSim { x, .. } | Op::Scale { x, .. } => write(x),
            Op::CompressPush { layer, indexer, .. } => {
                if indexer {
                    read(IdxKv);
                    read(IdxGate);
                } else {
                    read(CompKv);
                    read(CompGate);
                }
                write(Kv(layer));
            }
            Op::IndexerTopK { layer } => {
                read(IdxQ);
                read(IdxW);
                read(Kv(layer));
                write(Selected);
            }
            Op::SparseAttention { layer } => {
                read(Q);
                read(KvRows);
                read(Selected);
                read(Kv(layer));
                write(AttnOut);
            }
            Op::WindowStore { layer } => {
                // The compressor and indexer inputs go to the roll-back log (read only where the layer has them).
                read(KvRows);
                read(CompKv);
                read(CompGate);
                read(IdxKv);
                read(IdxGate);
                write(Kv(layer));
            }
            Op::HcSinkhorn { .. } => {
                read(Mix);
                write(Pre);
                write(PostComb);
            }
            Op::HcHeadWeights => {
                read(Mix);
                write(Pre);
            }
            Op::HcCollapse { out } => {
                read(Streams);
                read(Pre);
                write(out);
            }
            Op::HcPost => {
                read(SublayerOut);
                read(PostComb);
                write(Streams);
            }
            Op::MoeRoute { .. } => {
                read(Router);
                write(Routes);
            }
            Op::ExpertUp { .. } => {
                read(Normed);
                read(Routes);
                write(ExpertGate);
                write(ExpertUp);
            }
            Op::SwiGlu { .. } => {
                read(ExpertUp);
                read(Routes);
                write(ExpertGate);
            }
            Op::ExpertDown { .. } => {
                read(ExpertGate);
                read(Routes);
                write(ExpertOut);
            }
            Op::MoeCombine { .. } => {
                read(ExpertOut);
                read(Routes);
                write(SublayerOut);
            }
            Op::Logits => {
                read(HeadOut);
                write(Logits);
            }
            Op::LogitCandidates { .. } => {
                read(Logits);
                write(Candidates);
            }
            // The tensor gains a host copy: later readers of it order after the readback.
            Op::Readback { buf } => write(buf),
            // Writes host memory only (the kept rows), which no node reads.
            Op::TapStreams { .. } => read(Streams),
        }
    }

    /// Calls `f` for every tensor whose current value the op needs: what it reads, and what it updates in place
    /// (written, but not overwritten whole — see [`Op::overwrites`]).
    pub fn inputs(&self, mut f: impl FnMut(BufId)) {
        let mut written = [None; 3];
        let mut nw = 0;
        self.access(&mut f, |b| {
            written[nw] = Some(b);
            nw += 1;
        });
        written.iter().flatten().filter(|&&b| !self.overwrites(b)).for_each(|&b| f(b));
    }

    /// Whether the op writes every value of tensor `b` it leaves meaningful without reading the old ones (`false`
    /// for in-place updates such as RoPE, the post-mix of the streams, the KV pages and a readback).
    pub fn overwrites(&self, b: BufId) -> bool {
        use BufId::*;
        match *self {
            Op::Embed | Op::MtpInput => b == Streams,
            Op::RmsNorm { x, y, .. } => x != y && b == y,
            Op::MatMul { y, .. } | Op::GroupedMatMul { y, .. } => b == y,
            Op::HcSinkhorn { .. } => matches!(b, Pre | PostComb),
            Op::HcHeadWeights => b == Pre,
            Op::HcCollapse { out } => b == out,
            Op::IndexerTopK { .. } => b == Selected,
            Op::SparseAttention { .. } => b == AttnOut,
            Op::MoeRoute { .. } => b == Routes,
            Op::ExpertUp { .. } => matches!(b, ExpertGate | ExpertUp),
            Op::ExpertDown { .. } => b == ExpertOut,
            Op::MoeCombine { .. } => b == SublayerOut,
            Op::Logits => b == Logits,
            Op::LogitCandidates { .. } => b == Candidates,
            _ => false,
        }
    }
}

/// One row of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Index of the row's run in [`Batch::runs`].
    pub run: usize,
    /// Absolute position of the token in its session.
    pub pos: usize,
    pub token: u32,
}

/// The rows one session contributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Session slot.
    pub slot: usize,
    /// First row in the batch.
    pub start: usize,
    /// Number of rows (consecutive positions).
    pub len: usize,
    /// Whether every row wants logits (prefill logits), else only the last row.
    pub all_logits: bool,
}

/// A tick's batch.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub rows: Vec<Row>,
    pub runs: Vec<Run>,
    /// Rows whose logits are computed, in output order.
    pub logit_rows: Vec<usize>,
    /// 0: the logit rows come back to the host whole. `k` > 0: only each logit row's `k` best
    /// ([`Op::LogitCandidates`]) come back (the engine sets it when every session of the tick asked for no more).
    pub candidates: usize,
}

/// The most candidates [`Op::LogitCandidates`] takes per row (a device keeps room for this many).
pub const MAX_LOGIT_CANDIDATES: usize = 64;

impl Batch {
    /// Empties the batch, keeping capacity.
    pub fn clear(&mut self) {
        self.rows.clear();
        self.runs.clear();
        self.logit_rows.clear();
        self.candidates = 0;
    }

    /// Appends a run of `tokens` for session `slot`, starting at position `pos0`.
    pub fn push_run(&mut self, slot: usize, pos0: usize, tokens: impl IntoIterator<Item = u32>, all_logits: bool) {
        let run = self.runs.len();
        let start = self.rows.len();
        for (i, token) in tokens.into_iter().enumerate() {
            self.rows.push(Row { run, pos: pos0 + i, token });
        }
        let len = self.rows.len() - start;
        self.runs.push(Run { slot, start, len, all_logits });
        if all_logits {
            self.logit_rows.extend(start..start + len);
        } else if len > 0 {
            self.logit_rows.push(start + len - 1);
        }
    }

    /// Whether every run is a single token (a decode-only tick).
    pub fn is_decode(&self) -> bool {
        self.runs.iter().all(|r| r.len == 1)
    }
}

/// A node: an op and the stage it belongs to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub stage: Stage,
}

/// The node graph of one tick. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub nodes: Vec<Node>,
    /// Dependency count of each node (valid after [`Graph::finish`]).
    pub deps: Vec<usize>,
    /// Edges `(from, to)`: `to` depends on `from`; grouped by `to`, in push order.
    pub edges: Vec<(usize, usize)>,
    dep_start: Vec<usize>,
    dep_list: Vec<usize>,
    cursor: Vec<usize>,
    last_writer: Vec<Option<usize>>,
    readers: Vec<Vec<usize>>,
    stage: Option<Stage>,
    /// `(stage, first node, end)` of every stage, in order.
    pub stages: Vec<(Stage, usize, usize)>,
}

impl Graph {
    /// Empties the graph (keeping capacity) for a model of `n_layers` layers.
    pub fn clear(&mut self, n_layers: usize) {
        self.nodes.clear();
        self.deps.clear();
        self.edges.clear();
        self.dep_start.clear();
        self.dep_list.clear();
        self.stages.clear();
        self.stage = None;
        let nbuf = BufId::FIXED + n_layers;
        self.last_writer.clear();
        self.last_writer.resize(nbuf, None);
        if self.readers.len() < nbuf {
            self.readers.resize_with(nbuf, Vec::new);
        }
        self.readers.iter_mut().for_each(Vec::clear);
    }

    /// Starts a stage: the nodes pushed until the next call belong to it.
    pub fn stage(&mut self, stage: Stage) {
        let at = self.nodes.len();
        if let Some(last) = self.stages.last_mut() {
            last.2 = at;
        }
        self.stages.push((stage, at, at));
        self.stage = Some(stage);
    }

    fn add_edge(&mut self, first_of_to: usize, from: usize, to: usize) {
        if from != to && !self.edges[first_of_to..].contains(&(from, to)) {
            self.edges.push((from, to));
        }
    }

    /// Appends a node of the current stage, deriving its dependencies from the declared accesses.
    pub fn push(&mut self, op: Op) -> usize {
        let id = self.nodes.len();
        let stage = self.stage.expect("Graph::stage before Graph::push");
        self.nodes.push(Node { op, stage });
        if let Some(last) = self.stages.last_mut() {
            last.2 = id + 1;
        }
        let first = self.edges.len();
        let mut reads = [None; 6];
        let mut writes = [None; 3];
        let (mut nr, mut nw) = (0, 0);
        op.access(
            |b| {
                reads[nr] = Some(b);
                nr += 1
            },
            |b| {
                writes[nw] = Some(b);
                nw += 1
            },
        );
        // Read after write.
        for b in reads.iter().flatten() {
            if let Some(w) = self.last_writer[b.index()] {
                self.add_edge(first, w, id);
            }
        }
        for b in writes.iter().flatten() {
            let i = b.index();
            // Write after read, write after write.
            for k in 0..self.readers[i].len() {
                let r = self.readers[i][k];
                self.add_edge(first, r, id);
            }
            if let Some(w) = self.last_writer[i] {
                self.add_edge(first, w, id);
            }
            self.readers[i].clear();
            self.last_writer[i] = Some(id);
        }
        for b in reads.iter().flatten() {
            self.readers[b.index()].push(id);
        }
        id
    }

    /// Computes the dependency counts and the dependents of every node (call once after the last push).
    pub fn finish(&mut self) {
        let n = self.nodes.len();
        self.deps.clear();
        self.deps.resize(n, 0);
        self.dep_start.clear();
        self.dep_start.resize(n + 1, 0);
        for &(from, to) in &self.edges {
            self.deps[to] += 1;
            self.dep_start[from + 1] += 1;
        }
        for i in 0..n {
            self.dep_start[i + 1] += self.dep_start[i];
        }
        self.dep_list.clear();
        self.dep_list.resize(self.edges.len(), 0);
        // Edges are grouped by `to` ascending, so filling in edge order keeps each node's dependents ascending.
        self.cursor.clear();
        self.cursor.extend_from_slice(&self.dep_start[..n]);
        for &(from, to) in &self.edges {
            self.dep_list[self.cursor[from]] = to;
            self.cursor[from] += 1;
        }
    }

    /// The nodes that depend on node `i` (ascending).
    pub fn dependents(&self, i: usize) -> &[usize] {
        &self.dep_list[self.dep_start[i]..self.dep_start[i + 1]]
    }

    /// The graph in Graphviz DOT: one box per node (`index: op [args]`, weights named by `weight_name`),
    /// clustered by stage, and its edges.
    pub fn to_dot(&self, weight_name: &dyn Fn(WeightId) -> String) -> String {
        use std::fmt::Write;
        let mut s = String::from("digraph tick {\n  rankdir=TB;\n  node [shape=box, fontsize=10];\n");
        for (k, &(stage, a, b)) in self.stages.iter().enumerate() {
            let _ = writeln!(s, "  subgraph cluster_{k} {{\n    label=\"{stage:?}\";");
            for i in a..b {
                let label = name_weights(&format!("{i}: {:?}", self.nodes[i].op), weight_name).replace('"', "'");
                let _ = writeln!(s, "    n{i} [label=\"{label}\"];");
            }
            s.push_str("  }\n");
        }
        for &(a, b) in &self.edges {
            let _ = writeln!(s, "  n{a} -> n{b};");
        }
        s.push_str("}\n");
        s
    }
}

/// `text` with every `WeightId(N)` replaced by `name(WeightId(N))`.
fn name_weights(text: &str, name: &dyn Fn(WeightId) -> String) -> String {
    const TAG: &str = "WeightId(";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(TAG) {
        out.push_str(&rest[..at]);
        let after = &rest[at + TAG.len()..];
        let end = after.find(')').unwrap_or(after.len());
        match after[..end].parse::<u32>() {
            Ok(id) => out.push_str(&name(WeightId(id))),
            Err(_) => out.push_str(&rest[at..at + TAG.len() + end]),
        }
        rest = after.get(end + 1..).unwrap_or("");
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests;
