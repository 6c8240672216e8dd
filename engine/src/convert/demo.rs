//! The built-in demo models.
//!
//! - [`trained_demo_gguf`]: the one `ds4 run` / `ds4-server` serve when no `-m` is given — a small model in the
//!   DeepSeek V4 architecture with an MTP block, trained on this repository's CPU script (`tools/train_demo`: Python
//!   standard-library docstrings and code as chat turns, a byte-level tokenizer with the chat template's markers),
//!   3.4 MB (`engine/assets/demo-model.gguf`). It answers in words and code-like text (not sense), and its MTP block
//!   drafts for speculative decoding.
//! - [`demo_model_gguf`]: a tiny random-weight DeepSeek-V4 with the real vocabulary (129280 tokens) and the real
//!   tokenizer metadata, built in memory in well under a second, so every code path that depends on the real
//!   tokenizer can be exercised without an 80 GB file. Its output is gibberish by design.
//!
//! Shape ([`demo_config`]): hidden 64, 3 layers with compress ratios `[0, 4, 8]` (one plain, one CSA with indexer,
//! one HCA), layer 0 hash-routed, 8 routed experts (top 2) + 1 shared, 4 heads × 128 (rope 64), q rank 64, 2 output
//! groups × 32, indexer 4 heads × 64 (top 4), window 16, 4 mHC streams. Tensor names, dims and classes come from
//! the converter's own [`plan`](super::plan), so the layout is the converted one; types follow the shipped `q2`
//! recipe (routed experts fall back to Q8_0 because their rows are not 256 long).
//!
//! Weights: deterministic for a seed (splitmix64); matrices uniform with standard deviation `1/sqrt(row_len)`,
//! norm weights 1, HC scales 0.1, other vectors small. `tid2eid` maps token `t` to distinct experts.

use super::config::{CheckpointConfig, RopeScaling};
use super::plan::{plan, Class};
use super::recipe::{encode_append, Recipe};
use crate::gguf::{GgufWriter, MetaValue, TensorDecl};
use crate::quant::GgmlType;
use crate::Result;

/// The demo model's hyperparameters (see the module docs).
pub fn demo_config() -> CheckpointConfig {
    CheckpointConfig {
        vocab_size: 129280,
        hidden_size: 64,
        n_layers: 3,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 128,
        rope_dim: 64,
        q_lora_rank: 64,
        o_groups: 2,
        o_lora_rank: 32,
        expert_ffn: 64,
        n_experts: 8,
        n_shared_experts: 1,
        n_experts_used: 2,
        n_group: 0,
        topk_group: 0,
        routed_scale: 1.5,
        norm_topk_prob: true,
        swiglu_limit: 10.0,
        n_hash_layers: 1,
        rope_theta: 10000.0,
        compress_rope_theta: 160000.0,
        rope_scaling: Some(RopeScaling {
            kind: "yarn".into(),
            factor: 16.0,
            original_context_length: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        context_length: 65536,
        sliding_window: 16,
        index_n_heads: 4,
        index_head_dim: 64,
        index_topk: 4,
        compress_ratios: vec![0, 4, 8],
        hc_mult: 4,
        hc_sinkhorn_iters: 20,
        hc_eps: 1e-6,
        rms_norm_eps: 1e-6,
        compress_ratios_all: vec![0, 4, 8],
        bos_token_id: 0,
        eos_token_id: 1,
        n_nextn_layers: 0,
        revision: Default::default(),
        dspark: None,
    }
}

/// [`demo_config`] as a V4-Flash-0731 checkpoint with a small DSpark drafter: three stages fed by the three trunk
/// layers, blocks of 4, noise token 7, Markov rank 8 ([`random_model_gguf`] writes its stages).
pub fn demo_dspark_config() -> CheckpointConfig {
    CheckpointConfig {
        revision: super::config::Revision::V0731,
        dspark: Some(super::config::DsparkConfig {
            block_size: 4,
            noise_token_id: 7,
            target_layer_ids: vec![0, 1, 2],
            markov_rank: 8,
        }),
        ..demo_config()
    }
}

struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// The value generator for one tensor, by name and class.
fn values(name: &str, class: Class, dims: &[u64], rng: &mut SplitMix) -> Vec<f32> {
    let n: usize = dims.iter().product::<u64>() as usize;
    let row = dims[0] as f32;
    let (center, amp) = if class != Class::Vector {
        // uniform on [-a, a] has std a/sqrt(3)
        (0.0, 3f32.sqrt() / row.sqrt())
    } else if name.ends_with("norm.weight") {
        (1.0, 0.0)
    } else if name.ends_with("_scale.weight") {
        (0.1, 0.0)
    } else {
        (0.0, 0.05)
    };
    (0..n).map(|_| center + amp * rng.unit()).collect()
}

/// The trained demo model's GGUF bytes (see the module docs), built into the library.
pub fn trained_demo_gguf() -> &'static [u8] {
    include_bytes!("../../assets/demo-model.gguf")
}

/// Builds the random demo model's GGUF bytes for `seed` (same seed, same bytes).
pub fn demo_model_gguf(seed: u64) -> Result<Vec<u8>> {
    let mut extra = vec![("general.name".to_string(), MetaValue::String("ds4-demo (random weights)".into()))];
    extra
        .extend(crate::tokenizer::gguf_metadata_from_tokenizer_json_bytes(crate::tokenizer::bundled_tokenizer_json())?);
    random_model_gguf(&demo_config(), seed, extra)
}

/// A random-weight model of any shape `cfg` describes (with an MTP block when `cfg.n_nextn_layers > 0`), in the converted layout and the `q2` recipe's types, with
/// `extra` metadata (name, tokenizer) after the config's keys. Weights as for the demo model (module docs).
pub fn random_model_gguf(cfg: &CheckpointConfig, seed: u64, extra: Vec<(String, MetaValue)>) -> Result<Vec<u8>> {
    let mut tensors = plan(cfg);
    if cfg.n_nextn_layers > 0 && cfg.revision == super::config::Revision::April {
        // The MTP block, as the converter writes an April checkpoint's.
        tensors.extend(super::plan::mtp_plan(cfg));
    }
    if let (Some(ds), super::config::Revision::V0731) = (&cfg.dspark, cfg.revision) {
        // The DSpark drafter's stages, as the converter writes a 0731 checkpoint's.
        tensors.extend(super::plan::dspark_plan(cfg, ds.target_layer_ids.len(), ds.markov_rank as usize));
    }
    let decls: Vec<TensorDecl> = tensors
        .iter()
        .map(|t| TensorDecl {
            name: t.name.clone(),
            ty: Recipe::Q2.type_for(t.class, t.row_len()),
            dims: t.dims.clone(),
        })
        .collect();
    let mut meta = cfg.gguf_metadata();
    meta.push(("general.file_type".into(), MetaValue::U32(Recipe::Q2.file_type())));
    meta.push(("general.quantization_version".into(), MetaValue::U32(2)));
    meta.extend(extra);
    let data_bytes: u64 = decls.iter().map(|d| d.n_bytes()).sum::<Result<u64>>()?;
    let mut w = GgufWriter::new(Vec::with_capacity(data_bytes as usize + (8 << 20)), &meta, decls.clone())?;
    let mut rng = SplitMix(seed);
    let mut buf = Vec::new();
    for (t, d) in tensors.iter().zip(&decls) {
        buf.clear();
        if d.ty == GgmlType::I32 {
            // tid2eid [top_k, vocab]: token v routes to top_k distinct experts starting at a random one.
            let (k, vocab) = (d.dims[0] as usize, d.dims[1] as usize);
            for _ in 0..vocab {
                let first = rng.next() as usize % cfg.n_experts;
                for j in 0..k {
                    buf.extend_from_slice(&(((first + j) % cfg.n_experts) as i32).to_le_bytes());
                }
            }
        } else {
            let v = values(&t.name, t.class, &d.dims, &mut rng);
            encode_append(d.ty, &v, d.dims[0] as usize, &mut buf)?;
        }
        w.write_tensor(&d.name, &buf)?;
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn demo_model_loads_with_the_ds4_layout() {
        let bytes = demo_model_gguf(1).unwrap();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        let cfg = demo_config();
        assert_eq!(f.get_str("general.architecture").unwrap(), "deepseek4");
        assert_eq!(f.get_usize("deepseek4.vocab_size").unwrap(), 129280);
        assert_eq!(f.get_usize("deepseek4.block_count").unwrap(), 3);
        assert_eq!(f.get_int_array("deepseek4.attention.compress_ratios").unwrap(), vec![0, 4, 8]);
        assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 129280);
        assert!(!f.get_str_array("tokenizer.ggml.merges").unwrap().is_empty());
        // 6 global + 24 per layer + 4 compressor (layers 1, 2) + 6 indexer (layer 1)
        assert_eq!(f.tensors().len(), 6 + 3 * 24 + 2 * 4 + 6);
        let emb = f.tensor_info("token_embd.weight").unwrap();
        assert_eq!((emb.dims.clone(), emb.ty), (vec![64, 129280], GgmlType::F16));
        let out = f.tensor_info("output.weight").unwrap();
        assert_eq!((out.dims.clone(), out.ty), (vec![64, 129280], GgmlType::Q8_0));
        let tid = f.tensor("blk.0.ffn_gate_tid2eid.weight").unwrap();
        assert_eq!(tid.info.dims, vec![2, 129280]);
        let ids: Vec<i32> = tid.data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert!(ids.iter().all(|&e| (0..cfg.n_experts as i32).contains(&e)));
        assert!(ids.chunks(2).all(|p| p[0] != p[1]));
        assert!(f.tensor_info("blk.1.indexer.attn_q_b.weight").is_some());
        assert!(f.tensor_info("blk.2.indexer.attn_q_b.weight").is_none());
        assert!(f.tensor_info("blk.2.attn_compressor_ape.weight").is_some());
        assert_eq!(f.tensor_info("blk.1.exp_probs_b.bias").unwrap().ty, GgmlType::F32);
        let norm = f.tensor("output_norm.weight").unwrap();
        assert!(norm.data.chunks_exact(4).all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) == 1.0));
        // the engine's model loader accepts it
        crate::model::Model::load(GgufFile::from_bytes(bytes.clone()).unwrap()).unwrap();
        // deterministic per seed, different across seeds
        assert!(demo_model_gguf(1).unwrap() == bytes);
        assert!(demo_model_gguf(2).unwrap() != bytes);
    }
}
