//! The forward pass, written once: the nodes of one tick, built from its batch.
//!
//! The MTP drafter ([`Model::load_mtp`]) is the same recipe over its one layer, starting from [`Op::MtpInput`]
//! instead of the embedding.
//!
//! [`build`] emits, for the batch at hand, every fine op of `shared/spec/model.md` in the reference order (the
//! golden data follows it), grouped in [`Stage`]s: the embedding; per layer the mHC pre-mix, attention, mHC
//! post-mix, mHC pre-mix, MoE FFN, mHC post-mix; the head; the logits. What differs between ticks and layers is
//! visible in the nodes, not hidden in a backend: which layers compress (and which index), hash vs learned
//! routing ([`Op::MoeRoute`]), the expert FFN's algorithm for this batch size ([`Experts`]), activation
//! simulation ([`Op::ActSim`]), which rows get logits ([`Op::Logits`] reads [`crate::graph::Batch::logit_rows`])
//! and every readback to the host ([`Op::Readback`]: the logits, or with [`Batch::candidates`] only each logit
//! row's best, [`Op::LogitCandidates`]).
//!
//! Attention of a layer (tensor names are [`BufId`]s): `Normed = RMSNorm(Collapsed)·attn_norm`;
//! `QLow = RMSNorm(wq_a·Normed)·q_norm`; `Q = wq_b·QLow`, per-head unweighted RMSNorm, RoPE;
//! `KvRows = RMSNorm(wkv·Normed)·kv_norm`, RoPE, (sim) FP8. Compressed layers project `CompKv`/`CompGate` (and
//! CSA's indexer `IdxKv`/`IdxGate`/`IdxQ`/`IdxW`) from the same normed input — those projections are independent
//! nodes — then push them through the compressors into the KV pages; CSA picks its top-k rows; sparse attention
//! with sinks; inverse RoPE; the raw rows into the ring; grouped output projection.
//!
//! MoE FFN: `Normed = RMSNorm(Collapsed)·ffn_norm`; router scores; routing; gate/up of every routed row and the
//! shared expert; SwiGLU; down; the weighted sum back into `SublayerOut`. The routed rows' layout ([`Experts`],
//! [`experts_layout`]) is the batch's choice, visible in the nodes: per row (decode: every product picks its
//! expert by the selected ids), or grouped by expert (prefill: each expert's weights read once per group of rows;
//! a device backend groups them on the device, so the logits stay the one host sync of a tick).

use crate::graph::{Batch, BufId, Experts, Graph, Op, SimKind, Stage, Sub};
use crate::model::{LayerKind, Model};

/// Rebuilds `g` as the graph of one tick over `batch` (see the module docs); `sim` adds the activation
/// simulation nodes. Reuses `g`'s vectors.
pub fn build(g: &mut Graph, model: &Model, batch: &Batch, sim: bool) {
    build_with_taps(g, model, batch, sim, &[]);
}

/// [`build`], with an [`Op::TapStreams`] after the FFN post-mix of each layer in `taps` (strictly increasing; the
/// `j`-th is feature block `j` of each row): the target features a DSpark drafter reads.
pub fn build_with_taps(g: &mut Graph, model: &Model, batch: &Batch, sim: bool, taps: &[usize]) {
    let c = &model.config;
    g.clear(c.n_layers);
    g.stage(Stage::Embed);
    g.push(if model.mtp_input.is_some() { Op::MtpInput } else { Op::Embed });
    for layer in 0..c.n_layers {
        hc_pre(g, model, layer, Sub::Attn);
        attention(g, model, layer, sim);
        g.stage(Stage::HcPost { layer, sub: Sub::Attn });
        g.push(Op::HcPost);
        hc_pre(g, model, layer, Sub::Ffn);
        moe(g, model, layer, batch.rows.len());
        g.stage(Stage::HcPost { layer, sub: Sub::Ffn });
        g.push(Op::HcPost);
        if let Some(tap) = taps.iter().position(|&t| t == layer) {
            g.push(Op::TapStreams { layer, tap });
        }
    }
    let gw = &model.global;
    g.stage(Stage::HcHead);
    g.push(Op::RmsNorm { x: BufId::Streams, y: BufId::StreamsNormed, w: None, width: c.hc_dim(), heads: 1 });
    g.push(Op::MatMul { w: gw.hc_fn, x: BufId::StreamsNormed, y: BufId::Mix });
    g.push(Op::HcHeadWeights);
    g.push(Op::HcCollapse { out: BufId::HeadOut });
    g.push(Op::RmsNorm { x: BufId::HeadOut, y: BufId::HeadOut, w: Some(gw.norm), width: c.d_model, heads: 1 });
    // Always present (a backend may finish the tick's work there); with no logit rows it computes nothing.
    g.stage(Stage::Logits);
    g.push(Op::Logits);
    if batch.candidates > 0 {
        // Only the best logits of each row come back (the sessions' samplers need no more).
        g.push(Op::LogitCandidates { k: batch.candidates });
        g.push(Op::Readback { buf: BufId::Candidates });
    } else {
        g.push(Op::Readback { buf: BufId::Logits });
    }
    g.finish();
}

fn hc_pre(g: &mut Graph, model: &Model, layer: usize, sub: Sub) {
    let lw = &model.layers[layer];
    let w = match sub {
        Sub::Attn => lw.hc_attn,
        Sub::Ffn => lw.hc_ffn,
    };
    g.stage(Stage::HcPre { layer, sub });
    g.push(Op::RmsNorm { x: BufId::Streams, y: BufId::StreamsNormed, w: None, width: model.config.hc_dim(), heads: 1 });
    g.push(Op::MatMul { w: w.fn_, x: BufId::StreamsNormed, y: BufId::Mix });
    g.push(Op::HcSinkhorn { layer, sub });
    g.push(Op::HcCollapse { out: BufId::Collapsed });
}

fn attention(g: &mut Graph, model: &Model, layer: usize, sim: bool) {
    use BufId::*;
    let c = &model.config;
    let lw = &model.layers[layer];
    let (hd, nh) = (c.head_dim, c.n_heads);
    g.stage(Stage::Attention { layer });
    g.push(Op::RmsNorm { x: Collapsed, y: Normed, w: Some(lw.attn_norm), width: c.d_model, heads: 1 });
    g.push(Op::MatMul { w: lw.wq_a, x: Normed, y: QLow });
    g.push(Op::RmsNorm { x: QLow, y: QLow, w: Some(lw.q_norm), width: c.q_lora_rank, heads: 1 });
    g.push(Op::MatMul { w: lw.wq_b, x: QLow, y: Q });
    g.push(Op::RmsNorm { x: Q, y: Q, w: None, width: hd, heads: nh });
    g.push(Op::Rope { x: Q, layer, width: hd, heads: nh, inverse: false });
    g.push(Op::MatMul { w: lw.wkv, x: Normed, y: KvRows });
    g.push(Op::RmsNorm { x: KvRows, y: KvRows, w: Some(lw.kv_norm), width: hd, heads: 1 });
    g.push(Op::Rope { x: KvRows, layer, width: hd, heads: 1, inverse: false });
    if sim {
        g.push(Op::ActSim { x: KvRows, width: hd, heads: 1, kind: SimKind::Fp8NoRope });
    }
    if let Some(cw) = &lw.compressor {
        g.push(Op::MatMul { w: cw.wkv, x: Normed, y: CompKv });
        g.push(Op::MatMul { w: cw.wgate, x: Normed, y: CompGate });
    }
    let (ih, ihd) = (c.idx_heads, c.idx_head_dim);
    if let Some(iw) = &lw.indexer {
        g.push(Op::MatMul { w: iw.comp.wkv, x: Normed, y: IdxKv });
        g.push(Op::MatMul { w: iw.comp.wgate, x: Normed, y: IdxGate });
        g.push(Op::MatMul { w: iw.wq_b, x: QLow, y: IdxQ });
        g.push(Op::Rope { x: IdxQ, layer, width: ihd, heads: ih, inverse: false });
        if sim {
            g.push(Op::ActSim { x: IdxQ, width: ihd, heads: ih, kind: SimKind::HadamardFp4 });
        }
        g.push(Op::MatMul { w: iw.proj, x: Normed, y: IdxW });
        g.push(Op::Scale { x: IdxW, width: ih, factor: 1.0 / (ih as f32).sqrt() });
    }
    if lw.compressor.is_some() {
        g.push(Op::CompressPush { layer, indexer: false, sim });
    }
    if lw.indexer.is_some() {
        g.push(Op::CompressPush { layer, indexer: true, sim });
    }
    if c.layer_kind(layer) == LayerKind::Csa {
        g.push(Op::IndexerTopK { layer });
    }
    g.push(Op::SparseAttention { layer });
    g.push(Op::Rope { x: AttnOut, layer, width: hd, heads: nh, inverse: true });
    g.push(Op::WindowStore { layer });
    g.push(Op::GroupedMatMul { w: lw.wo_a, x: AttnOut, y: OLow, groups: c.o_groups, rank: c.o_lora_rank });
    g.push(Op::MatMul { w: lw.wo_b, x: OLow, y: SublayerOut });
}

fn moe(g: &mut Graph, model: &Model, layer: usize, rows: usize) {
    use BufId::*;
    let lw = &model.layers[layer];
    g.stage(Stage::Moe { layer });
    g.push(Op::RmsNorm { x: Collapsed, y: Normed, w: Some(lw.ffn_norm), width: model.config.d_model, heads: 1 });
    g.push(Op::MatMul { w: lw.gate, x: Normed, y: Router });
    let hash = lw.tid2eid.is_some();
    let experts = experts_layout(model, hash, rows);
    g.push(Op::MoeRoute { layer, hash, experts });
    g.push(Op::ExpertUp { layer, experts });
    g.push(Op::SwiGlu { layer });
    g.push(Op::ExpertDown { layer, experts });
    g.push(Op::MoeCombine { experts });
}

/// The routed-row layout of an MoE layer for a batch of `rows` rows (see [`Experts`]): per row while the batch's
/// choices (`rows · k`) do not outnumber the experts — decode, where grouping would read every chosen expert once
/// anyway, and would cost learned routing a host sync and every layer a dispatch per expert — else gathered by
/// expert (hash routing knows the experts from the tokens, so only learned routing needs the sync). `hash` does
/// not change the choice; it is taken so the rule can.
pub fn experts_layout(model: &Model, _hash: bool, rows: usize) -> Experts {
    let c = &model.config;
    if rows * c.n_experts_used <= c.n_experts {
        Experts::PerRow
    } else {
        Experts::ByExpert
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    fn demo() -> Model {
        Model::load(GgufFile::from_bytes(crate::convert::demo::demo_model_gguf(7).unwrap()).unwrap()).unwrap()
    }

    fn decode_batch() -> Batch {
        let mut b = Batch::default();
        b.push_run(0, 5, [42], false);
        b
    }

    #[test]
    fn projections_of_the_normed_input_are_independent() {
        let model = demo();
        let mut g = Graph::default();
        build(&mut g, &model, &decode_batch(), true);
        // Find a compressed layer's attention stage, if the demo has one, else the first.
        let c = &model.config;
        let layer = (0..c.n_layers).find(|&l| model.layers[l].compressor.is_some()).unwrap_or(0);
        let &(_, a, b) = g.stages.iter().find(|s| s.0 == Stage::Attention { layer }).unwrap();
        let norm = a; // RmsNorm(Collapsed → Normed)
        let from_normed: Vec<usize> =
            (a..b).filter(|&i| matches!(g.nodes[i].op, Op::MatMul { x: BufId::Normed, .. })).collect();
        assert!(from_normed.len() >= 2, "wq_a and wkv at least");
        for &i in &from_normed {
            // Within the stage each depends on the norm only: they are ready together. (Earlier layers' readers
            // of the same tensor are write-after-read dependencies, long done.)
            let deps: Vec<usize> = g.edges.iter().filter(|e| e.1 == i && e.0 >= a).map(|e| e.0).collect();
            assert_eq!(deps, vec![norm], "node {i} {:?}", g.nodes[i].op);
        }
        assert!(g.edges.iter().all(|&(x, y)| x < y));
        let sims = g.nodes.iter().filter(|n| matches!(n.op, Op::ActSim { .. })).count();
        assert!(sims >= c.n_layers, "one FP8 simulation of the KV rows per layer");
        let mut exact = Graph::default();
        build(&mut exact, &model, &decode_batch(), false);
        assert!(exact.nodes.iter().all(|n| !matches!(n.op, Op::ActSim { .. })));
    }

    #[test]
    fn routing_and_logits_are_nodes() {
        let model = demo();
        let mut g = Graph::default();
        build(&mut g, &model, &decode_batch(), false);
        for l in 0..model.config.n_layers {
            // A decode tick lays out every layer's expert rows per row, hash-routed or not.
            let hash = model.layers[l].tid2eid.is_some();
            let experts = Experts::PerRow;
            assert!(g.nodes.iter().any(|n| n.op == Op::MoeRoute { layer: l, hash, experts }), "layer {l}");
        }
        let n = g.nodes.len();
        assert_eq!(g.nodes[n - 2].op, Op::Logits);
        assert_eq!(g.nodes[n - 1].op, Op::Readback { buf: BufId::Logits }, "the readback is the last node");
        assert_eq!(g.stages.first().unwrap().0, Stage::Embed);
        // Stages tile the nodes.
        let mut at = 0;
        for &(_, a, b) in &g.stages {
            assert_eq!(a, at);
            assert!(b > a);
            at = b;
        }
        assert_eq!(at, g.nodes.len());
        // Decode with learned routing stays per row: the logits are the one readback.
        assert_eq!(g.nodes.iter().filter(|n| matches!(n.op, Op::Readback { .. })).count(), 1);
        // Rebuilding the same tick gives the same graph.
        let before = (g.nodes.clone(), g.edges.clone());
        build(&mut g, &model, &decode_batch(), false);
        assert_eq!((g.nodes.clone(), g.edges.clone()), before);
    }

    /// The expert layout follows the batch: learned-routing layers go per row while `rows · k ≤ experts`, then
    /// gather by expert behind a readback of their routes; hash layers always gather (no readback). Every expert
    /// node of a layer carries its routing node's layout.
    #[test]
    fn expert_layout_and_route_readbacks_follow_the_batch() {
        let model = demo();
        let c = &model.config;
        let per_row_max = c.n_experts / c.n_experts_used;
        let learned = model.layers.iter().filter(|l| l.tid2eid.is_none()).count();
        assert!(learned > 0 && learned < c.n_layers, "the demo has both routings");
        let mut g = Graph::default();
        for rows in [1, per_row_max, per_row_max + 1, 3 * per_row_max] {
            let mut b = Batch::default();
            b.push_run(0, 0, (0..rows as u32).map(|i| 3 + i), false);
            build(&mut g, &model, &b, false);
            let grouped = rows > per_row_max;
            for l in 0..c.n_layers {
                let hash = model.layers[l].tid2eid.is_some();
                let want = if grouped { Experts::ByExpert } else { Experts::PerRow };
                assert_eq!(experts_layout(&model, hash, rows), want);
                let &(_, a, e) = g.stages.iter().find(|s| s.0 == Stage::Moe { layer: l }).unwrap();
                let ops: Vec<Op> = g.nodes[a..e].iter().map(|n| n.op).collect();
                let route = ops.iter().position(|o| matches!(o, Op::MoeRoute { .. })).unwrap();
                assert_eq!(ops[route], Op::MoeRoute { layer: l, hash, experts: want });
                assert!(ops.contains(&Op::ExpertUp { layer: l, experts: want }));
                assert!(ops.contains(&Op::ExpertDown { layer: l, experts: want }));
                assert!(ops.contains(&Op::MoeCombine { experts: want }));
            }
            // The logits are the one readback, grouped by expert or not.
            let readbacks = g.nodes.iter().filter(|n| matches!(n.op, Op::Readback { .. })).count();
            assert_eq!(readbacks, 1, "{rows} rows");
        }
    }
}
