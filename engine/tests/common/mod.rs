//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

/// Official per-layer tensor suffix (`layers.N.<x>`) → GGUF suffix (`blk.N.<y>`), written from
/// `shared/spec/gguf-ds4.md` independently of the converter's tables (the routed experts are stacked and mapped
/// separately).
pub const LAYER_NAMES: &[(&str, &str)] = &[
    ("hc_attn_fn", "hc_attn_fn.weight"),
    ("hc_attn_base", "hc_attn_base.weight"),
    ("hc_attn_scale", "hc_attn_scale.weight"),
    ("hc_ffn_fn", "hc_ffn_fn.weight"),
    ("hc_ffn_base", "hc_ffn_base.weight"),
    ("hc_ffn_scale", "hc_ffn_scale.weight"),
    ("attn_norm.weight", "attn_norm.weight"),
    ("attn.wq_a.weight", "attn_q_a.weight"),
    ("attn.q_norm.weight", "attn_q_a_norm.weight"),
    ("attn.wq_b.weight", "attn_q_b.weight"),
    ("attn.wkv.weight", "attn_kv.weight"),
    ("attn.kv_norm.weight", "attn_kv_a_norm.weight"),
    ("attn.attn_sink", "attn_sinks.weight"),
    ("attn.wo_a.weight", "attn_output_a.weight"),
    ("attn.wo_b.weight", "attn_output_b.weight"),
    ("attn.compressor.ape", "attn_compressor_ape.weight"),
    ("attn.compressor.wkv.weight", "attn_compressor_kv.weight"),
    ("attn.compressor.wgate.weight", "attn_compressor_gate.weight"),
    ("attn.compressor.norm.weight", "attn_compressor_norm.weight"),
    ("attn.indexer.wq_b.weight", "indexer.attn_q_b.weight"),
    ("attn.indexer.weights_proj.weight", "indexer.proj.weight"),
    ("attn.indexer.compressor.ape", "indexer_compressor_ape.weight"),
    ("attn.indexer.compressor.wkv.weight", "indexer_compressor_kv.weight"),
    ("attn.indexer.compressor.wgate.weight", "indexer_compressor_gate.weight"),
    ("attn.indexer.compressor.norm.weight", "indexer_compressor_norm.weight"),
    ("ffn_norm.weight", "ffn_norm.weight"),
    ("ffn.gate.weight", "ffn_gate_inp.weight"),
    ("ffn.gate.bias", "exp_probs_b.bias"),
    ("ffn.gate.tid2eid", "ffn_gate_tid2eid.weight"),
    ("ffn.shared_experts.w1.weight", "ffn_gate_shexp.weight"),
    ("ffn.shared_experts.w3.weight", "ffn_up_shexp.weight"),
    ("ffn.shared_experts.w2.weight", "ffn_down_shexp.weight"),
];
