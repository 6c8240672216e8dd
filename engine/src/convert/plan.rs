//! The conversion plan: every GGUF tensor of the DS4 layout, the official checkpoint tensor(s) it comes from, the
//! official shape each source must have (computed from config.json), and its [`Class`] (which decides its type
//! under a recipe).
//!
//! Name map and dims follow `shared/spec/gguf-ds4.md`: GGUF dims are the official PyTorch shape reversed (the bytes
//! of a row-major `[out, in]` tensor already are GGUF `[in, out]`); routed experts `layers.N.ffn.experts.E.w{1,3,2}`
//! are stacked over E into `[in, out, n_experts]`. Compressor tensors exist only on layers with ratio > 0, indexer
//! tensors only on ratio-4 layers, `exp_probs_b.bias` only on learned-routing layers, `ffn_gate_tid2eid.weight` only
//! on hash layers (`il < num_hash_layers`).
//!
//! [`mtp_plan`] adds an April checkpoint's MTP block: official `mtp.0.<x>` → GGUF `mtp.0.<y>`, where a block tensor's
//! `<y>` is the suffix a trunk layer's tensor has under `blk.N.` (ratio 0, learned routing: `mtp.0.attn_q_a.weight`,
//! `mtp.0.ffn_gate_inp.weight`, `mtp.0.exp_probs_b.bias`, `mtp.0.ffn_gate_exps.weight`, `mtp.0.hc_attn_fn.weight`,
//! ...), and the MTP-only tensors are `mtp.0.e_proj.weight`, `mtp.0.h_proj.weight`, `mtp.0.enorm.weight`,
//! `mtp.0.hnorm.weight`, `mtp.0.norm.weight`, `mtp.0.hc_head_fn.weight`, `mtp.0.hc_head_base.weight`,
//! `mtp.0.hc_head_scale.weight` (the names the reference C engine binds).
//!
//! [`dspark_plan`] does the same for a 0731 checkpoint's DSpark drafter: stage `s` (one per target layer id) is a
//! block of compress ratio 0 with learned routing, official `mtp.{s}.<x>` → GGUF `mtp.{s}.<y>` with a trunk layer's
//! suffixes; stage 0 adds `mtp.0.main_proj.weight` and `mtp.0.main_norm.weight`, the last stage `S−1` its
//! `norm.weight`, `hc_head_{fn,base,scale}.weight` (as the MTP block's), `markov_w1.weight` and `markov_w2.weight`
//! (official `markov_head.markov_w{1,2}.weight`) and `confidence.weight` (official `confidence_head.proj.weight`).

use super::config::CheckpointConfig;

/// What a tensor is, for the purpose of choosing its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// Norm weights, biases, sinks, HC base/scale: always F32.
    Vector,
    /// `token_embd.weight`.
    TokenEmbd,
    /// `output.weight` (the LM head).
    Output,
    /// Attention projections (`attn_q_a`, `attn_q_b`, `attn_kv`, `attn_output_a/b`).
    Attn,
    /// Shared-expert matrices.
    SharedExpert,
    /// Hyper-connection mixing matrices (`hc_*_fn`).
    HcFn,
    /// Compressor matrices and APE (main and indexer compressors).
    Compressor,
    /// Indexer query / head-weight projections.
    Indexer,
    /// The router matrix `ffn_gate_inp`.
    Router,
    /// Routed experts gate (w1) and up (w3), stacked.
    RoutedGateUp,
    /// Routed experts down (w2), stacked.
    RoutedDown,
    /// The hash-routing table (I32).
    Tid2eid,
}

/// Where a GGUF tensor's values come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// One official tensor.
    One(String),
    /// One official tensor per expert, stacked in order.
    Experts(Vec<String>),
}

impl Source {
    /// The official names read.
    pub fn names(&self) -> Vec<&str> {
        match self {
            Source::One(n) => vec![n],
            Source::Experts(v) => v.iter().map(|s| s.as_str()).collect(),
        }
    }
}

/// One output tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    /// GGUF name.
    pub name: String,
    /// GGUF dims, innermost first.
    pub dims: Vec<u64>,
    pub class: Class,
    pub source: Source,
    /// The official (PyTorch) shape of each source tensor.
    pub src_shape: Vec<usize>,
}

impl Planned {
    /// The row length (GGUF `dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims[0]
    }
}

struct Builder {
    out: Vec<Planned>,
}

impl Builder {
    fn one(&mut self, gguf: String, official: String, shape: &[usize], class: Class) {
        self.out.push(Planned {
            name: gguf,
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            class,
            source: Source::One(official),
            src_shape: shape.to_vec(),
        });
    }
}

/// The tensors of one decoder block: official names `{official}<x>`, GGUF names `{gguf}<y>`, with compress ratio
/// `ratio` and hash routing (`tid2eid`) or learned routing (`exp_probs_b.bias`).
fn block(b: &mut Builder, c: &CheckpointConfig, official: &str, gguf: &str, ratio: usize, hash: bool) {
    use Class::*;
    let d = c.hidden_size;
    let hc = c.hc_mult;
    let hc_mix = (2 + hc) * hc;
    let o = |x: &str| format!("{official}{x}");
    let g = |x: &str| format!("{gguf}{x}");
    for sub in ["attn", "ffn"] {
        b.one(g(&format!("hc_{sub}_fn.weight")), o(&format!("hc_{sub}_fn")), &[hc_mix, hc * d], HcFn);
        b.one(g(&format!("hc_{sub}_base.weight")), o(&format!("hc_{sub}_base")), &[hc_mix], Vector);
        b.one(g(&format!("hc_{sub}_scale.weight")), o(&format!("hc_{sub}_scale")), &[3], Vector);
    }
    b.one(g("attn_norm.weight"), o("attn_norm.weight"), &[d], Vector);
    b.one(g("attn_q_a.weight"), o("attn.wq_a.weight"), &[c.q_lora_rank, d], Attn);
    b.one(g("attn_q_a_norm.weight"), o("attn.q_norm.weight"), &[c.q_lora_rank], Vector);
    b.one(g("attn_q_b.weight"), o("attn.wq_b.weight"), &[c.n_heads * c.head_dim, c.q_lora_rank], Attn);
    b.one(g("attn_kv.weight"), o("attn.wkv.weight"), &[c.head_dim, d], Attn);
    b.one(g("attn_kv_a_norm.weight"), o("attn.kv_norm.weight"), &[c.head_dim], Vector);
    b.one(g("attn_sinks.weight"), o("attn.attn_sink"), &[c.n_heads], Vector);
    let group_in = c.n_heads * c.head_dim / c.o_groups;
    b.one(g("attn_output_a.weight"), o("attn.wo_a.weight"), &[c.o_groups * c.o_lora_rank, group_in], Attn);
    b.one(g("attn_output_b.weight"), o("attn.wo_b.weight"), &[d, c.o_groups * c.o_lora_rank], Attn);
    if ratio > 0 {
        let w = CheckpointConfig::compressor_coff(ratio) * c.head_dim;
        b.one(g("attn_compressor_ape.weight"), o("attn.compressor.ape"), &[ratio, w], Compressor);
        b.one(g("attn_compressor_kv.weight"), o("attn.compressor.wkv.weight"), &[w, d], Compressor);
        b.one(g("attn_compressor_gate.weight"), o("attn.compressor.wgate.weight"), &[w, d], Compressor);
        b.one(g("attn_compressor_norm.weight"), o("attn.compressor.norm.weight"), &[c.head_dim], Vector);
    }
    if ratio == 4 {
        let (ih, ihd) = (c.index_n_heads, c.index_head_dim);
        let iw = CheckpointConfig::compressor_coff(ratio) * ihd;
        b.one(g("indexer.attn_q_b.weight"), o("attn.indexer.wq_b.weight"), &[ih * ihd, c.q_lora_rank], Indexer);
        b.one(g("indexer.proj.weight"), o("attn.indexer.weights_proj.weight"), &[ih, d], Indexer);
        b.one(g("indexer_compressor_ape.weight"), o("attn.indexer.compressor.ape"), &[ratio, iw], Compressor);
        b.one(g("indexer_compressor_kv.weight"), o("attn.indexer.compressor.wkv.weight"), &[iw, d], Compressor);
        b.one(g("indexer_compressor_gate.weight"), o("attn.indexer.compressor.wgate.weight"), &[iw, d], Compressor);
        b.one(g("indexer_compressor_norm.weight"), o("attn.indexer.compressor.norm.weight"), &[ihd], Vector);
    }
    b.one(g("ffn_norm.weight"), o("ffn_norm.weight"), &[d], Vector);
    b.one(g("ffn_gate_inp.weight"), o("ffn.gate.weight"), &[c.n_experts, d], Router);
    if hash {
        b.one(g("ffn_gate_tid2eid.weight"), o("ffn.gate.tid2eid"), &[c.vocab_size, c.n_experts_used], Tid2eid);
    } else {
        b.one(g("exp_probs_b.bias"), o("ffn.gate.bias"), &[c.n_experts], Vector);
    }
    let f = c.expert_ffn;
    for (gguf, w, shape, class) in [
        ("ffn_gate_exps.weight", "w1", [f, d], RoutedGateUp),
        ("ffn_up_exps.weight", "w3", [f, d], RoutedGateUp),
        ("ffn_down_exps.weight", "w2", [d, f], RoutedDown),
    ] {
        b.out.push(Planned {
            name: g(gguf),
            dims: vec![shape[1] as u64, shape[0] as u64, c.n_experts as u64],
            class,
            source: Source::Experts((0..c.n_experts).map(|e| o(&format!("ffn.experts.{e}.{w}.weight"))).collect()),
            src_shape: shape.to_vec(),
        });
    }
    if c.n_shared_experts > 0 {
        let sf = f * c.n_shared_experts;
        b.one(g("ffn_gate_shexp.weight"), o("ffn.shared_experts.w1.weight"), &[sf, d], SharedExpert);
        b.one(g("ffn_up_shexp.weight"), o("ffn.shared_experts.w3.weight"), &[sf, d], SharedExpert);
        b.one(g("ffn_down_shexp.weight"), o("ffn.shared_experts.w2.weight"), &[d, sf], SharedExpert);
    }
}

/// Builds the plan for a checkpoint with this config.
pub fn plan(c: &CheckpointConfig) -> Vec<Planned> {
    use Class::*;
    let mut b = Builder { out: Vec::new() };
    let d = c.hidden_size;
    let hc = c.hc_mult;
    b.one("token_embd.weight".into(), "embed.weight".into(), &[c.vocab_size, d], TokenEmbd);
    for il in 0..c.n_layers {
        block(&mut b, c, &format!("layers.{il}."), &format!("blk.{il}."), c.compress_ratios[il], c.is_hash_layer(il));
    }
    b.one("output_hc_fn.weight".into(), "hc_head_fn".into(), &[hc, hc * d], HcFn);
    b.one("output_hc_base.weight".into(), "hc_head_base".into(), &[hc], Vector);
    b.one("output_hc_scale.weight".into(), "hc_head_scale".into(), &[1], Vector);
    b.one("output_norm.weight".into(), "norm.weight".into(), &[d], Vector);
    b.one("output.weight".into(), "head.weight".into(), &[c.vocab_size, d], Output);
    b.out
}

/// The official-name prefix of the April release's MTP block, and the GGUF prefix it is written under.
pub const MTP_PREFIX: &str = "mtp.0.";

/// The plan of an April checkpoint's MTP block `mtp.0.*` (written after the trunk when the checkpoint has one; see
/// the module docs of [`crate::convert`]): `e_proj`/`h_proj` (ordinary matrices, [`Class::Attn`]), `enorm`, `hnorm`,
/// `norm`, the MTP head's `hc_head_*`, and one decoder block of compress ratio 0 with learned routing whose tensors
/// are named as a trunk layer's, under `mtp.0.` instead of `layers.N.` / `blk.N.`.
pub fn mtp_plan(c: &CheckpointConfig) -> Vec<Planned> {
    use Class::*;
    let mut b = Builder { out: Vec::new() };
    let d = c.hidden_size;
    let hc = c.hc_mult;
    let m = |x: &str| format!("{MTP_PREFIX}{x}");
    b.one(m("e_proj.weight"), m("e_proj.weight"), &[d, d], Attn);
    b.one(m("h_proj.weight"), m("h_proj.weight"), &[d, d], Attn);
    b.one(m("enorm.weight"), m("enorm.weight"), &[d], Vector);
    b.one(m("hnorm.weight"), m("hnorm.weight"), &[d], Vector);
    block(&mut b, c, MTP_PREFIX, MTP_PREFIX, 0, false);
    b.one(m("hc_head_fn.weight"), m("hc_head_fn"), &[hc, hc * d], HcFn);
    b.one(m("hc_head_base.weight"), m("hc_head_base"), &[hc], Vector);
    b.one(m("hc_head_scale.weight"), m("hc_head_scale"), &[1], Vector);
    b.one(m("norm.weight"), m("norm.weight"), &[d], Vector);
    b.out
}

/// The plan of a 0731 checkpoint's DSpark drafter (`stages` stages, written after the trunk; see the module docs):
/// GGUF names, classes and official shapes. The Markov head's `[vocab, rank]` matrices are [`Class::Output`] (a
/// product over the vocabulary, and rows read per token), the confidence head a vector.
pub fn dspark_plan(c: &CheckpointConfig, stages: usize, rank: usize) -> Vec<Planned> {
    use Class::*;
    let mut b = Builder { out: Vec::new() };
    let d = c.hidden_size;
    let hc = c.hc_mult;
    for s in 0..stages {
        let p = format!("mtp.{s}.");
        let m = |x: &str| format!("{p}{x}");
        if s == 0 {
            b.one(m("main_proj.weight"), m("main_proj.weight"), &[d, stages * d], Attn);
            b.one(m("main_norm.weight"), m("main_norm.weight"), &[d], Vector);
        }
        block(&mut b, c, &p, &p, 0, false);
        if s + 1 == stages {
            b.one(m("hc_head_fn.weight"), m("hc_head_fn"), &[hc, hc * d], HcFn);
            b.one(m("hc_head_base.weight"), m("hc_head_base"), &[hc], Vector);
            b.one(m("hc_head_scale.weight"), m("hc_head_scale"), &[1], Vector);
            b.one(m("norm.weight"), m("norm.weight"), &[d], Vector);
            b.one(m("markov_w1.weight"), m("markov_head.markov_w1.weight"), &[c.vocab_size, rank], Output);
            b.one(m("markov_w2.weight"), m("markov_head.markov_w2.weight"), &[c.vocab_size, rank], Output);
            b.one(m("confidence.weight"), m("confidence_head.proj.weight"), &[1, d + rank], Vector);
        }
    }
    b.out
}
