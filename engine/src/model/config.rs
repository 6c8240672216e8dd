//! [`ModelConfig`]: every hyperparameter of a DeepSeek V4 model, read from the GGUF metadata (`deepseek4.*` keys of
//! `shared/spec/gguf-ds4.md`) and validated for internal consistency.
//!
//! Nothing here is hard-coded to Flash's sizes: tiny test models load through the same path. Validation rejects
//! what the forward pass cannot compute (odd head dims, rope wider than a head, heads not divisible into output
//! groups, a KV head count other than 1, ...) with [`Error::Metadata`] naming the key and the values.
//!
//! Layer kinds follow the compress ratio: 0 = sliding window only, 4 = CSA (overlapping compressor + indexer),
//! any other positive ratio = HCA (non-overlapping compressor, attends to every visible compressed row).

use crate::gguf::GgufFile;
use crate::{Error, Result};

/// The compress ratio that marks a CSA layer (overlapping windows + lightning indexer).
pub const CSA_RATIO: usize = 4;

/// The attention flavour of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Sliding window only (ratio 0), plain RoPE.
    Window,
    /// Compressed sparse attention: overlapping compressor (coff 2) and the indexer's top-k selection.
    Csa,
    /// Heavily compressed attention: non-overlapping compressor, every visible compressed row attended.
    Hca,
}

/// RoPE frequency parameters of one rope flavour.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// Base θ.
    pub base: f64,
    /// YaRN `(factor, original_ctx, beta_fast, beta_slow)`; `None` = plain RoPE.
    pub yarn: Option<(f64, f64, f64, f64)>,
}

/// Hyperparameters of a DeepSeek V4 model. See the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub n_layers: usize,
    /// Hidden size `d`.
    pub d_model: usize,
    pub vocab: usize,
    /// Trained context length (`context_length`).
    pub ctx_len: usize,
    pub n_heads: usize,
    /// Head dim of q, K and V (K = V, one KV head).
    pub head_dim: usize,
    /// Rope dims at the end of each head.
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub n_shared_experts: usize,
    /// Width of one expert (and of the shared expert).
    pub expert_ffn: usize,
    /// The first `n_hash_layers` layers route by `tid2eid[token]`.
    pub n_hash_layers: usize,
    /// Sliding window (raw KV rows seen by a query, including its own).
    pub window: usize,
    pub idx_heads: usize,
    pub idx_head_dim: usize,
    pub idx_topk: usize,
    /// mHC stream count.
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_eps: f32,
    /// Compress ratio per layer (exactly `n_layers` entries; extra file entries belong to MTP blocks).
    pub compress_ratios: Vec<usize>,
    /// Plain rope (ratio-0 layers).
    pub rope_main: RopeParams,
    /// Rope of compressed layers, their compressors and indexers.
    pub rope_compress: RopeParams,
    pub routed_scale: f32,
    /// Renormalise the selected routing weights to sum 1.
    pub weights_norm: bool,
    /// SwiGLU clamp per layer.
    pub swiglu_limit: Vec<f32>,
}

const P: &str = "deepseek4.";

fn bad(what: String) -> Error {
    Error::Metadata(what)
}

impl ModelConfig {
    /// Reads and validates the config of a `deepseek4` GGUF file.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = f.get_str("general.architecture")?;
        if arch != "deepseek4" {
            return Err(bad(format!("general.architecture is {arch:?}, expected \"deepseek4\"")));
        }
        let u = |k: &str| f.get_usize(&format!("{P}{k}"));
        let fl = |k: &str| f.get_f64(&format!("{P}{k}"));
        let n_layers = u("block_count")?;
        let ratios = f.get_int_array(&format!("{P}attention.compress_ratios"))?;
        if ratios.len() < n_layers {
            return Err(bad(format!(
                "{P}attention.compress_ratios has {} entries, block_count is {n_layers}",
                ratios.len()
            )));
        }
        let compress_ratios = ratios[..n_layers]
            .iter()
            .map(|&r| usize::try_from(r).map_err(|_| bad(format!("{P}attention.compress_ratios holds {r} < 0"))))
            .collect::<Result<Vec<_>>>()?;
        let clamps = f.get_float_array(&format!("{P}swiglu_clamp_exp"))?;
        if clamps.len() < n_layers {
            return Err(bad(format!("{P}swiglu_clamp_exp has {} entries, block_count is {n_layers}", clamps.len())));
        }
        let key_len = u("attention.key_length")?;
        let val_len = u("attention.value_length")?;
        if key_len != val_len {
            return Err(bad(format!("attention.key_length {key_len} != attention.value_length {val_len} (K = V)")));
        }
        let kv_heads = u("attention.head_count_kv")?;
        if kv_heads != 1 {
            return Err(bad(format!("{P}attention.head_count_kv is {kv_heads}; DeepSeek V4 has one shared KV head")));
        }
        let yarn = (
            fl("rope.scaling.factor")?,
            fl("rope.scaling.original_context_length")?,
            fl("rope.scaling.yarn_beta_fast")?,
            fl("rope.scaling.yarn_beta_slow")?,
        );
        let cfg = ModelConfig {
            n_layers,
            d_model: u("embedding_length")?,
            vocab: u("vocab_size")?,
            ctx_len: u("context_length")?,
            n_heads: u("attention.head_count")?,
            head_dim: key_len,
            rope_dim: u("rope.dimension_count")?,
            q_lora_rank: u("attention.q_lora_rank")?,
            o_groups: u("attention.output_group_count")?,
            o_lora_rank: u("attention.output_lora_rank")?,
            n_experts: u("expert_count")?,
            n_experts_used: u("expert_used_count")?,
            n_shared_experts: u("expert_shared_count")?,
            expert_ffn: u("expert_feed_forward_length")?,
            n_hash_layers: u("hash_layer_count")?,
            window: u("attention.sliding_window")?,
            idx_heads: u("attention.indexer.head_count")?,
            idx_head_dim: u("attention.indexer.key_length")?,
            idx_topk: u("attention.indexer.top_k")?,
            hc_mult: u("hyper_connection.count")?,
            hc_sinkhorn_iters: u("hyper_connection.sinkhorn_iterations")?,
            hc_eps: fl("hyper_connection.epsilon")? as f32,
            rms_eps: fl("attention.layer_norm_rms_epsilon")? as f32,
            compress_ratios,
            rope_main: RopeParams { base: fl("rope.freq_base")?, yarn: None },
            rope_compress: RopeParams { base: fl("attention.compress_rope_freq_base")?, yarn: Some(yarn) },
            routed_scale: fl("expert_weights_scale")? as f32,
            weights_norm: f.get_bool(&format!("{P}expert_weights_norm"))?,
            swiglu_limit: clamps[..n_layers].iter().map(|&c| c as f32).collect(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks internal consistency; see the module docs.
    pub fn validate(&self) -> Result<()> {
        let nz = [
            ("block_count", self.n_layers),
            ("embedding_length", self.d_model),
            ("vocab_size", self.vocab),
            ("attention.head_count", self.n_heads),
            ("attention.key_length", self.head_dim),
            ("attention.q_lora_rank", self.q_lora_rank),
            ("attention.output_group_count", self.o_groups),
            ("attention.output_lora_rank", self.o_lora_rank),
            ("expert_count", self.n_experts),
            ("expert_used_count", self.n_experts_used),
            ("expert_feed_forward_length", self.expert_ffn),
            ("attention.sliding_window", self.window),
            ("hyper_connection.count", self.hc_mult),
            ("hyper_connection.sinkhorn_iterations", self.hc_sinkhorn_iters),
        ];
        for (k, v) in nz {
            if v == 0 {
                return Err(bad(format!("{P}{k} must be > 0")));
            }
        }
        if !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim {
            return Err(bad(format!(
                "rope.dimension_count {} must be even and <= attention.key_length {}",
                self.rope_dim, self.head_dim
            )));
        }
        if self.n_experts_used > self.n_experts {
            return Err(bad(format!("expert_used_count {} > expert_count {}", self.n_experts_used, self.n_experts)));
        }
        if self.n_shared_experts > 1 {
            return Err(bad(format!("expert_shared_count {} (at most 1 supported)", self.n_shared_experts)));
        }
        if !self.n_heads.is_multiple_of(self.o_groups) {
            return Err(bad(format!(
                "attention.head_count {} is not divisible by attention.output_group_count {}",
                self.n_heads, self.o_groups
            )));
        }
        if self.n_hash_layers > self.n_layers {
            return Err(bad(format!("hash_layer_count {} > block_count {}", self.n_hash_layers, self.n_layers)));
        }
        if self.has_csa() {
            if self.idx_heads == 0 || self.idx_head_dim == 0 || self.idx_topk == 0 {
                return Err(bad("CSA layers need indexer head_count, key_length and top_k > 0".into()));
            }
            if self.rope_dim > self.idx_head_dim {
                return Err(bad(format!(
                    "rope.dimension_count {} > attention.indexer.key_length {}",
                    self.rope_dim, self.idx_head_dim
                )));
            }
        }
        for (k, v) in [("hyper_connection.epsilon", self.hc_eps), ("attention.layer_norm_rms_epsilon", self.rms_eps)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(format!("{P}{k} = {v} is not a finite non-negative number")));
            }
        }
        for (i, &l) in self.swiglu_limit.iter().enumerate() {
            if !(l.is_finite() && l > 0.0) {
                return Err(bad(format!("swiglu_clamp_exp[{i}] = {l} must be finite and > 0")));
            }
        }
        for rp in [self.rope_main, self.rope_compress] {
            if !(rp.base.is_finite() && rp.base > 1.0) {
                return Err(bad(format!("rope base {} must be > 1", rp.base)));
            }
            if let Some((factor, orig, bf, bs)) = rp.yarn {
                if !(factor >= 1.0 && orig >= 1.0 && bf > 0.0 && bs > 0.0) {
                    return Err(bad(format!(
                        "YaRN parameters factor {factor}, original ctx {orig}, beta_fast {bf}, beta_slow {bs} invalid"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The attention flavour of layer `l`.
    pub fn layer_kind(&self, l: usize) -> LayerKind {
        match self.compress_ratios[l] {
            0 => LayerKind::Window,
            CSA_RATIO => LayerKind::Csa,
            _ => LayerKind::Hca,
        }
    }

    /// Whether any layer is CSA.
    pub fn has_csa(&self) -> bool {
        (0..self.n_layers).any(|l| self.layer_kind(l) == LayerKind::Csa)
    }

    /// The rope used by layer `l` (its attention, compressor and indexer).
    pub fn rope_for(&self, l: usize) -> RopeParams {
        if self.compress_ratios[l] == 0 {
            self.rope_main
        } else {
            self.rope_compress
        }
    }

    /// Values per token of the mHC state (`hc_mult · d`).
    pub fn hc_dim(&self) -> usize {
        self.hc_mult * self.d_model
    }

    /// Outputs of an mHC projection: `(2 + hc) · hc`.
    pub fn hc_mix(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }

    /// Whether layer `l` routes by token hash.
    pub fn is_hash_layer(&self, l: usize) -> bool {
        l < self.n_hash_layers
    }
}
