//! Converts the golden `tiny-a` checkpoint (`../shared/golden/tiny-a`) with the f32 recipe and checks the result
//! against the DS4 layout of `shared/spec/gguf-ds4.md`, independently of the converter's own name table: every
//! official tensor must land under its spec GGUF name with reversed dims and identical bytes, experts stacked in
//! order, and every metadata key must carry config.json's value.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use ds4_engine::convert::{convert_with, ConvertOptions, Progress, Recipe};
use ds4_engine::gguf::GgufFile;
use ds4_engine::quant::GgmlType;
use safetensors::SafeTensors;

/// Counts what the converter reports.
#[derive(Default)]
struct Recorder {
    total: std::cell::Cell<u64>,
    done: std::cell::Cell<u64>,
    tensors: std::cell::Cell<usize>,
    finished: std::cell::Cell<usize>,
}

impl Progress for Recorder {
    fn start(&self, total_bytes: u64) {
        self.total.set(total_bytes);
    }
    fn tensor(&self, _name: &str) {
        self.tensors.set(self.tensors.get() + 1);
    }
    fn advance(&self, bytes: u64) {
        self.done.set(self.done.get() + bytes);
    }
    fn finish(&self) {
        self.finished.set(self.finished.get() + 1);
    }
}

fn golden_dir() -> Option<PathBuf> {
    ds4_engine::testdata::shared("golden/tiny-a", "model.safetensors")
}

/// The spec's official → GGUF name map (gguf-ds4.md, "Tensors").
fn spec_name(official: &str) -> Option<String> {
    let global = [
        ("embed.weight", "token_embd.weight"),
        ("norm.weight", "output_norm.weight"),
        ("head.weight", "output.weight"),
        ("hc_head_fn", "output_hc_fn.weight"),
        ("hc_head_base", "output_hc_base.weight"),
        ("hc_head_scale", "output_hc_scale.weight"),
    ];
    if let Some((_, g)) = global.iter().find(|(o, _)| *o == official) {
        return Some(g.to_string());
    }
    let rest = official.strip_prefix("layers.")?;
    let (il, x) = rest.split_once('.')?;
    let per_layer = common::LAYER_NAMES;
    let (_, g) = per_layer.iter().find(|(o, _)| *o == x)?;
    Some(format!("blk.{il}.{g}"))
}

#[test]
fn tiny_a_f32_matches_the_spec_layout() {
    let Some(dir) = golden_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny-a-f32.gguf");
    let progress = Recorder::default();
    let report = convert_with(&ConvertOptions::new(&dir, &out, Recipe::F32), &progress).unwrap();
    assert!(report.unused.is_empty(), "unused tensors: {:?}", report.unused);
    // Progress: the announced total is what was written, one call per tensor, finished once.
    let data_bytes: u64 = report.by_type.values().map(|(_, b)| b).sum();
    assert_eq!(progress.total.get(), data_bytes);
    assert_eq!(progress.done.get(), data_bytes);
    assert_eq!(progress.tensors.get(), report.n_tensors);
    assert_eq!(progress.finished.get(), 1);
    assert!(!tmp.path().join("tiny-a-f32.gguf.tmp").exists());
    let g = GgufFile::open(&out).unwrap();

    let st_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let n_experts = cfg["n_routed_experts"].as_u64().unwrap() as usize;

    // Every non-expert official tensor: spec name, reversed dims, F32 (I32 for tid2eid), identical bytes.
    // GGUF name -> (expert index, official shape, bytes) per expert
    type Parts = Vec<(usize, Vec<usize>, Vec<u8>)>;
    let mut expert_parts: HashMap<String, Parts> = HashMap::new();
    let mut n_plain = 0;
    for (name, view) in st.tensors() {
        if let Some(pos) = name.find(".ffn.experts.") {
            let rest = &name[pos + ".ffn.experts.".len()..];
            let (e, w) = rest.split_once('.').unwrap();
            let gname = match w {
                "w1.weight" => "ffn_gate_exps.weight",
                "w3.weight" => "ffn_up_exps.weight",
                "w2.weight" => "ffn_down_exps.weight",
                _ => panic!("unexpected expert tensor {name}"),
            };
            let layer = &name[..pos]; // "layers.N"
            let key = format!("blk.{}.{gname}", layer.strip_prefix("layers.").unwrap());
            expert_parts.entry(key).or_default().push((
                e.parse().unwrap(),
                view.shape().to_vec(),
                view.data().to_vec(),
            ));
            continue;
        }
        let gname = spec_name(&name).unwrap_or_else(|| panic!("no spec name for {name}"));
        let t = g.tensor(&gname).unwrap_or_else(|| panic!("{gname} (from {name}) missing"));
        let want_dims: Vec<u64> = view.shape().iter().rev().map(|&d| d as u64).collect();
        assert_eq!(t.info.dims, want_dims, "{gname} dims");
        let want_ty = if name.ends_with("tid2eid") { GgmlType::I32 } else { GgmlType::F32 };
        assert_eq!(t.info.ty, want_ty, "{gname} type");
        assert_eq!(t.data, view.data(), "{gname} bytes");
        n_plain += 1;
    }
    for (gname, mut parts) in expert_parts {
        parts.sort_by_key(|p| p.0);
        assert_eq!(parts.len(), n_experts, "{gname}: expert count");
        let t = g.tensor(&gname).unwrap_or_else(|| panic!("{gname} missing"));
        let shape = &parts[0].1;
        assert_eq!(t.info.dims, vec![shape[1] as u64, shape[0] as u64, n_experts as u64], "{gname} dims");
        assert_eq!(t.info.ty, GgmlType::F32);
        let per = parts[0].2.len();
        for (e, _, bytes) in &parts {
            assert_eq!(&t.data[e * per..(e + 1) * per], bytes.as_slice(), "{gname} expert {e}");
        }
        n_plain += 1;
    }
    assert_eq!(g.tensors().len(), n_plain, "GGUF holds tensors that do not come from the checkpoint");

    // Metadata: every key from config.json.
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let f = |k: &str| cfg[k].as_f64().unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "deepseek4");
    assert_eq!(g.get_usize("general.alignment").unwrap(), 32);
    assert!(!g.get_str("general.name").unwrap().is_empty());
    for (key, want) in [
        ("block_count", u("num_hidden_layers")),
        ("context_length", u("max_position_embeddings")),
        ("embedding_length", u("hidden_size")),
        ("vocab_size", u("vocab_size")),
        ("attention.head_count", u("num_attention_heads")),
        ("attention.head_count_kv", u("num_key_value_heads")),
        ("attention.key_length", u("head_dim")),
        ("attention.value_length", u("head_dim")),
        ("rope.dimension_count", u("qk_rope_head_dim")),
        ("attention.q_lora_rank", u("q_lora_rank")),
        ("attention.output_lora_rank", u("o_lora_rank")),
        ("attention.output_group_count", u("o_groups")),
        ("expert_count", u("n_routed_experts")),
        ("expert_used_count", u("num_experts_per_tok")),
        ("expert_shared_count", u("n_shared_experts")),
        ("expert_feed_forward_length", u("moe_intermediate_size")),
        ("hash_layer_count", u("num_hash_layers")),
        ("attention.sliding_window", u("sliding_window")),
        ("attention.indexer.head_count", u("index_n_heads")),
        ("attention.indexer.key_length", u("index_head_dim")),
        ("attention.indexer.top_k", u("index_topk")),
        ("hyper_connection.count", u("hc_mult")),
        ("hyper_connection.sinkhorn_iterations", u("hc_sinkhorn_iters")),
        (
            "rope.scaling.original_context_length",
            cfg["rope_scaling"]["original_max_position_embeddings"].as_u64().unwrap() as usize,
        ),
    ] {
        assert_eq!(g.get_usize(&format!("deepseek4.{key}")).unwrap(), want, "deepseek4.{key}");
    }
    for (key, want) in [
        ("hyper_connection.epsilon", f("hc_eps")),
        ("rope.freq_base", f("rope_theta")),
        ("attention.compress_rope_freq_base", f("compress_rope_theta")),
        ("expert_weights_scale", f("routed_scaling_factor")),
        ("attention.layer_norm_rms_epsilon", f("rms_norm_eps")),
        ("rope.scaling.factor", cfg["rope_scaling"]["factor"].as_f64().unwrap()),
        ("rope.scaling.yarn_beta_fast", cfg["rope_scaling"]["beta_fast"].as_f64().unwrap()),
        ("rope.scaling.yarn_beta_slow", cfg["rope_scaling"]["beta_slow"].as_f64().unwrap()),
    ] {
        let got = g.get_f64(&format!("deepseek4.{key}")).unwrap();
        assert!((got - want).abs() <= want.abs() * 1e-6, "deepseek4.{key}: {got} vs {want}");
    }
    assert!(g.get_bool("deepseek4.expert_weights_norm").unwrap());
    let n_layers = u("num_hidden_layers");
    let ratios: Vec<i64> = cfg["compress_ratios"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    assert_eq!(g.get_int_array("deepseek4.attention.compress_ratios").unwrap(), ratios[..n_layers].to_vec());
    let clamp = g.get_float_array("deepseek4.swiglu_clamp_exp").unwrap();
    assert_eq!(clamp.len(), n_layers);
    assert!(clamp.iter().all(|&c| (c - f("swiglu_limit")).abs() < 1e-6));
}
