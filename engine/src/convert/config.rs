//! `config.json` of an official checkpoint → typed hyperparameters ([`CheckpointConfig`]) → `deepseek4.*` GGUF
//! metadata ([`CheckpointConfig::gguf_metadata`]).
//!
//! Key names are the official release's (`hidden_size`, `num_hidden_layers`, `compress_ratios`, `num_hash_layers`,
//! `qk_rope_head_dim`, `o_groups`, `o_lora_rank`, `index_*`, `hc_*`, `swiglu_limit`, `rope_scaling.*`, ...). Every size
//! is read from the file; nothing assumes Flash. A missing required key is [`Error::Convert`] naming the key; keys
//! with a documented default (`num_key_value_heads` 1, `n_group`/`topk_group` 0, `norm_topk_prob` true,
//! `num_hash_layers` 0, `num_nextn_predict_layers` 0, no `rope_scaling`) fall back to it.

use serde_json::Value;

use crate::gguf::{MetaValue, ValueType};
use crate::{Error, Result};

/// YaRN parameters (`rope_scaling` in config.json).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeScaling {
    pub kind: String,
    pub factor: f64,
    pub original_context_length: u64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// The hyperparameters the converter needs, read from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub expert_ffn: usize,
    pub n_experts: usize,
    pub n_shared_experts: usize,
    pub n_experts_used: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scale: f64,
    pub norm_topk_prob: bool,
    pub swiglu_limit: f64,
    pub n_hash_layers: usize,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub context_length: usize,
    pub sliding_window: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    /// One entry per layer (extra entries in config.json, e.g. for MTP layers, are dropped).
    pub compress_ratios: Vec<usize>,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f64,
    pub rms_norm_eps: f64,
    /// All `compress_ratios` entries of config.json (0731 lists the drafter stages after the trunk layers).
    pub compress_ratios_all: Vec<usize>,
    /// `bos_token_id` / `eos_token_id` (default 0 / 1, DeepSeek V4's).
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    /// `num_nextn_predict_layers` (default 0): MTP blocks the checkpoint declares (April: 1, `mtp.0.*`).
    pub n_nextn_layers: usize,
    /// The model revision (see [`Revision`]): 0731 when config.json has `dspark_*` fields.
    pub revision: Revision,
    /// The 0731 DSpark drafter's config fields, when present.
    pub dspark: Option<DsparkConfig>,
}

/// The model revision a checkpoint belongs to, written as `deepseek4.revision`.
///
/// Both revisions share the trunk (same tensors, shapes and forward pass); they differ in the speculative drafter
/// and the official chat encoder's reasoning-effort texts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Revision {
    /// The April 2026 release (one MTP layer `mtp.0.*`, converted under `mtp.0.*` GGUF names).
    #[default]
    April,
    /// V4-Flash-0731: `dspark_*` config fields, a three-stage drafter in `mtp.{0,1,2}.*` (kept in the GGUF).
    V0731,
}

impl Revision {
    /// The value of `deepseek4.revision`.
    pub fn as_str(self) -> &'static str {
        match self {
            Revision::April => "2604",
            Revision::V0731 => "0731",
        }
    }

    /// Parses a `deepseek4.revision` value.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "2604" => Some(Revision::April),
            "0731" => Some(Revision::V0731),
            _ => None,
        }
    }
}

/// The `dspark_*` fields of a 0731 config.json (written as `deepseek4.dspark.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct DsparkConfig {
    pub block_size: u32,
    pub noise_token_id: u32,
    pub target_layer_ids: Vec<u32>,
    pub markov_rank: u32,
}

/// The largest compress ratio accepted (Flash uses 4 and 128).
pub const MAX_COMPRESS_RATIO: usize = 1 << 16;

/// `expert_gating_func` value for sqrt-softplus scoring (llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS`).
pub const GATING_SQRT_SOFTPLUS: u32 = 4;

fn key<'a>(v: &'a Value, k: &str) -> Result<&'a Value> {
    v.get(k).ok_or_else(|| Error::Convert(format!("config.json: missing key `{k}`")))
}

fn uint(v: &Value, k: &str) -> Result<usize> {
    let x = key(v, k)?;
    x.as_u64()
        .and_then(|u| usize::try_from(u).ok())
        .ok_or_else(|| Error::Convert(format!("config.json: `{k}` is {x}, expected a non-negative integer")))
}

fn uint_or(v: &Value, k: &str, default: usize) -> Result<usize> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(_) => uint(v, k),
    }
}

/// The 0731 `dspark_*` fields: `None` when none is present; all four required once any is.
fn dspark_config(v: &Value) -> Result<Option<DsparkConfig>> {
    const KEYS: [&str; 4] =
        ["dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank"];
    if KEYS.iter().all(|k| v.get(*k).is_none_or(Value::is_null)) {
        return Ok(None);
    }
    let u32_of = |k: &str| -> Result<u32> {
        let x = uint(v, k)?;
        u32::try_from(x).map_err(|_| Error::Convert(format!("config.json: `{k}` = {x} does not fit in u32")))
    };
    let ids = key(v, "dspark_target_layer_ids")?
        .as_array()
        .and_then(|a| a.iter().map(|x| x.as_u64().and_then(|u| u32::try_from(u).ok())).collect::<Option<Vec<_>>>())
        .ok_or_else(|| Error::Convert("config.json: `dspark_target_layer_ids` is not an array of layer ids".into()))?;
    Ok(Some(DsparkConfig {
        block_size: u32_of("dspark_block_size")?,
        noise_token_id: u32_of("dspark_noise_token_id")?,
        target_layer_ids: ids,
        markov_rank: u32_of("dspark_markov_rank")?,
    }))
}

fn float(v: &Value, k: &str) -> Result<f64> {
    let x = key(v, k)?;
    x.as_f64().ok_or_else(|| Error::Convert(format!("config.json: `{k}` is {x}, expected a number")))
}

impl CheckpointConfig {
    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::Convert(format!("config.json is not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(Error::Convert("config.json: top level is not an object".into()));
        }
        let n_layers = uint(&v, "num_hidden_layers")?;
        let ratios = key(&v, "compress_ratios")?
            .as_array()
            .ok_or_else(|| Error::Convert("config.json: `compress_ratios` is not an array".into()))?;
        if ratios.len() < n_layers {
            return Err(Error::Convert(format!(
                "config.json: `compress_ratios` has {} entries, num_hidden_layers is {n_layers}",
                ratios.len()
            )));
        }
        let compress_ratios_all = ratios
            .iter()
            .map(|r| r.as_u64().and_then(|u| usize::try_from(u).ok()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::Convert("config.json: `compress_ratios` holds a non-integer".into()))?;
        let compress_ratios = compress_ratios_all[..n_layers].to_vec();
        match v.get("scoring_func").and_then(Value::as_str) {
            None | Some("sqrtsoftplus") => {}
            Some(other) => {
                return Err(Error::Convert(format!(
                    "config.json: `scoring_func` is {other:?}; only \"sqrtsoftplus\" (DeepSeek V4) is supported"
                )))
            }
        }
        let dspark = dspark_config(&v)?;
        let id32 = |k: &str, default: u32| -> Result<u32> {
            let x = uint_or(&v, k, default as usize)?;
            u32::try_from(x).map_err(|_| Error::Convert(format!("config.json: `{k}` = {x} does not fit in u32")))
        };
        let rope_scaling = match v.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(rs) => Some(RopeScaling {
                kind: rs.get("type").or_else(|| rs.get("rope_type")).and_then(|t| t.as_str()).unwrap_or("yarn").into(),
                factor: float(rs, "factor").map_err(|e| Error::Convert(format!("rope_scaling: {e}")))?,
                original_context_length: uint(rs, "original_max_position_embeddings")
                    .map_err(|e| Error::Convert(format!("rope_scaling: {e}")))?
                    as u64,
                beta_fast: float(rs, "beta_fast").map_err(|e| Error::Convert(format!("rope_scaling: {e}")))?,
                beta_slow: float(rs, "beta_slow").map_err(|e| Error::Convert(format!("rope_scaling: {e}")))?,
            }),
        };
        let c = CheckpointConfig {
            vocab_size: uint(&v, "vocab_size")?,
            hidden_size: uint(&v, "hidden_size")?,
            n_layers,
            n_heads: uint(&v, "num_attention_heads")?,
            n_kv_heads: uint_or(&v, "num_key_value_heads", 1)?,
            head_dim: uint(&v, "head_dim")?,
            rope_dim: uint(&v, "qk_rope_head_dim")?,
            q_lora_rank: uint(&v, "q_lora_rank")?,
            o_groups: uint(&v, "o_groups")?,
            o_lora_rank: uint(&v, "o_lora_rank")?,
            expert_ffn: uint(&v, "moe_intermediate_size")?,
            n_experts: uint(&v, "n_routed_experts")?,
            n_shared_experts: uint(&v, "n_shared_experts")?,
            n_experts_used: uint(&v, "num_experts_per_tok")?,
            n_group: uint_or(&v, "n_group", 0)?,
            topk_group: uint_or(&v, "topk_group", 0)?,
            routed_scale: float(&v, "routed_scaling_factor")?,
            norm_topk_prob: v.get("norm_topk_prob").and_then(|b| b.as_bool()).unwrap_or(true),
            swiglu_limit: float(&v, "swiglu_limit")?,
            n_hash_layers: uint_or(&v, "num_hash_layers", 0)?,
            rope_theta: float(&v, "rope_theta")?,
            compress_rope_theta: float(&v, "compress_rope_theta")?,
            rope_scaling,
            context_length: uint(&v, "max_position_embeddings")?,
            sliding_window: uint(&v, "sliding_window")?,
            index_n_heads: uint(&v, "index_n_heads")?,
            index_head_dim: uint(&v, "index_head_dim")?,
            index_topk: uint(&v, "index_topk")?,
            compress_ratios,
            hc_mult: uint(&v, "hc_mult")?,
            hc_sinkhorn_iters: uint(&v, "hc_sinkhorn_iters")?,
            hc_eps: float(&v, "hc_eps")?,
            rms_norm_eps: float(&v, "rms_norm_eps")?,
            compress_ratios_all,
            bos_token_id: id32("bos_token_id", 0)?,
            eos_token_id: id32("eos_token_id", 1)?,
            n_nextn_layers: uint_or(&v, "num_nextn_predict_layers", 0)?,
            revision: if dspark.is_some() { Revision::V0731 } else { Revision::April },
            dspark,
        };
        c.validate()?;
        Ok(c)
    }

    /// Internal consistency checks that would otherwise surface later as confusing shape errors.
    fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Convert(format!("config.json: {what}")));
        for (k, x) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.n_layers),
            ("num_attention_heads", self.n_heads),
            ("head_dim", self.head_dim),
            ("o_groups", self.o_groups),
            ("n_routed_experts", self.n_experts),
            ("num_experts_per_tok", self.n_experts_used),
            ("hc_mult", self.hc_mult),
        ] {
            if x == 0 {
                return bad(format!("`{k}` is 0"));
            }
        }
        if !self.n_heads.is_multiple_of(self.o_groups) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of o_groups {}",
                self.n_heads, self.o_groups
            ));
        }
        if self.rope_dim > self.head_dim {
            return bad(format!("qk_rope_head_dim {} > head_dim {}", self.rope_dim, self.head_dim));
        }
        if self.n_experts_used > self.n_experts {
            return bad(format!("num_experts_per_tok {} > n_routed_experts {}", self.n_experts_used, self.n_experts));
        }
        if self.n_hash_layers > self.n_layers {
            return bad(format!("num_hash_layers {} > num_hidden_layers {}", self.n_hash_layers, self.n_layers));
        }
        if let Some(&r) = self.compress_ratios_all.iter().find(|&&r| r > MAX_COMPRESS_RATIO) {
            return bad(format!("`compress_ratios` holds {r} (at most {MAX_COMPRESS_RATIO})"));
        }
        if let Some(ds) = &self.dspark {
            if let Some(&l) = ds.target_layer_ids.iter().find(|&&l| l as usize >= self.n_layers) {
                return bad(format!("dspark_target_layer_ids holds {l} >= num_hidden_layers {}", self.n_layers));
            }
            if ds.noise_token_id as usize >= self.vocab_size {
                return bad(format!("dspark_noise_token_id {} >= vocab_size {}", ds.noise_token_id, self.vocab_size));
            }
        }
        Ok(())
    }

    /// Whether layer `il` routes by the token-id hash table (`tid2eid`) instead of the learned gate bias.
    pub fn is_hash_layer(&self, il: usize) -> bool {
        il < self.n_hash_layers
    }

    /// The compressor's feature multiplier: 2 for the overlapping CSA compressor (ratio 4), else 1.
    pub fn compressor_coff(ratio: usize) -> usize {
        if ratio == 4 {
            2
        } else {
            1
        }
    }

    /// The `deepseek4.*` metadata keys (plus `general.architecture`/`general.alignment`; the caller adds
    /// `general.name` and tokenizer keys).
    pub fn gguf_metadata(&self) -> Vec<(String, MetaValue)> {
        let u = |x: usize| MetaValue::U32(x as u32);
        let f = |x: f64| MetaValue::F32(x as f32);
        let mut m: Vec<(&str, MetaValue)> = vec![
            ("block_count", u(self.n_layers)),
            ("context_length", u(self.context_length)),
            ("embedding_length", u(self.hidden_size)),
            ("vocab_size", u(self.vocab_size)),
            ("attention.head_count", u(self.n_heads)),
            ("attention.head_count_kv", u(self.n_kv_heads)),
            ("attention.key_length", u(self.head_dim)),
            ("attention.value_length", u(self.head_dim)),
            ("rope.dimension_count", u(self.rope_dim)),
            ("attention.q_lora_rank", u(self.q_lora_rank)),
            ("attention.output_lora_rank", u(self.o_lora_rank)),
            ("attention.output_group_count", u(self.o_groups)),
            ("expert_count", u(self.n_experts)),
            ("expert_used_count", u(self.n_experts_used)),
            ("expert_shared_count", u(self.n_shared_experts)),
            ("expert_feed_forward_length", u(self.expert_ffn)),
            ("expert_group_count", u(self.n_group)),
            ("expert_group_used_count", u(self.topk_group)),
            ("expert_weights_scale", f(self.routed_scale)),
            ("expert_weights_norm", MetaValue::Bool(self.norm_topk_prob)),
            ("hash_layer_count", u(self.n_hash_layers)),
            ("attention.sliding_window", u(self.sliding_window)),
            ("attention.indexer.head_count", u(self.index_n_heads)),
            ("attention.indexer.key_length", u(self.index_head_dim)),
            ("attention.indexer.top_k", u(self.index_topk)),
            ("hyper_connection.count", u(self.hc_mult)),
            ("hyper_connection.sinkhorn_iterations", u(self.hc_sinkhorn_iters)),
            ("hyper_connection.epsilon", f(self.hc_eps)),
            (
                "attention.compress_ratios",
                MetaValue::Array(
                    ValueType::I32,
                    // April files list the trunk layers (as before); 0731 files also the drafter stages.
                    if self.revision == Revision::V0731 { &self.compress_ratios_all } else { &self.compress_ratios }
                        .iter()
                        .map(|&r| MetaValue::I32(r as i32))
                        .collect(),
                ),
            ),
            ("rope.freq_base", f(self.rope_theta)),
            ("attention.compress_rope_freq_base", f(self.compress_rope_theta)),
            (
                "swiglu_clamp_exp",
                MetaValue::Array(ValueType::F32, vec![MetaValue::F32(self.swiglu_limit as f32); self.n_layers]),
            ),
            ("attention.layer_norm_rms_epsilon", f(self.rms_norm_eps)),
            ("expert_gating_func", MetaValue::U32(GATING_SQRT_SOFTPLUS)),
            (
                "swiglu_clamp_shexp",
                MetaValue::Array(ValueType::F32, vec![MetaValue::F32(self.swiglu_limit as f32); self.n_layers]),
            ),
            ("revision", MetaValue::String(self.revision.as_str().into())),
        ];
        if let Some(ds) = &self.dspark {
            let u32s = |v: &[u32]| MetaValue::Array(ValueType::U32, v.iter().map(|&x| MetaValue::U32(x)).collect());
            m.push(("dspark.block_size", MetaValue::U32(ds.block_size)));
            m.push(("dspark.noise_token_id", MetaValue::U32(ds.noise_token_id)));
            m.push(("dspark.target_layer_ids", u32s(&ds.target_layer_ids)));
            m.push(("dspark.markov_rank", MetaValue::U32(ds.markov_rank)));
        }
        if let Some(rs) = &self.rope_scaling {
            m.push(("rope.scaling.type", MetaValue::String(rs.kind.clone())));
            m.push(("rope.scaling.factor", f(rs.factor)));
            m.push(("rope.scaling.original_context_length", MetaValue::U32(rs.original_context_length as u32)));
            m.push(("rope.scaling.yarn_beta_fast", f(rs.beta_fast)));
            m.push(("rope.scaling.yarn_beta_slow", f(rs.beta_slow)));
        }
        let mut out = vec![
            ("general.architecture".to_string(), MetaValue::String("deepseek4".into())),
            ("general.alignment".to_string(), MetaValue::U32(32)),
        ];
        out.extend(m.into_iter().map(|(k, v)| (format!("deepseek4.{k}"), v)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
        "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
        "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5, "swiglu_limit": 1.5, "num_hash_layers": 1, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "rope_scaling": {"type": "yarn", "factor": 16.0,
        "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}, "max_position_embeddings": 4096,
        "sliding_window": 16, "index_n_heads": 16, "index_head_dim": 64, "index_topk": 4,
        "compress_ratios": [0, 4, 8, 0], "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "rms_norm_eps": 1e-06}"#;

    #[test]
    fn parses_and_truncates_ratios() {
        let c = CheckpointConfig::from_json_str(TINY).unwrap();
        assert_eq!(c.compress_ratios, vec![0, 4, 8]);
        assert_eq!(c.n_kv_heads, 1);
        assert!(c.is_hash_layer(0) && !c.is_hash_layer(1));
        let m = c.gguf_metadata();
        let get = |k: &str| m.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
        assert_eq!(get("deepseek4.block_count").as_int(), Some(3));
        assert_eq!(get("deepseek4.rope.scaling.original_context_length").as_int(), Some(32));
        assert_eq!(get("deepseek4.swiglu_clamp_exp").as_array().unwrap().len(), 3);
        assert_eq!(get("deepseek4.context_length").as_int(), Some(4096));
        assert_eq!(c.n_nextn_layers, 0, "num_nextn_predict_layers defaults to 0");
        let with_mtp = TINY.replace("\"rms_norm_eps\"", "\"num_nextn_predict_layers\": 1, \"rms_norm_eps\"");
        assert_eq!(CheckpointConfig::from_json_str(&with_mtp).unwrap().n_nextn_layers, 1);
    }

    #[test]
    fn missing_key_is_named() {
        let text = TINY.replace("\"o_groups\": 2,", "");
        let e = CheckpointConfig::from_json_str(&text).unwrap_err().to_string();
        assert!(e.contains("o_groups"), "{e}");
        let text = TINY.replace("[0, 4, 8, 0]", "[0, 4]");
        let e = CheckpointConfig::from_json_str(&text).unwrap_err().to_string();
        assert!(e.contains("compress_ratios"), "{e}");
        assert!(CheckpointConfig::from_json_str("[1]").is_err());
        assert!(CheckpointConfig::from_json_str("{").is_err());
    }
}
