//! [`ModelConfig`]: every hyperparameter of a DeepSeek V4 model, read from the GGUF metadata (`deepseek4.*` keys of
//! `shared/spec/gguf-ds4.md`) and validated for internal consistency.
//!
//! Nothing here is hard-coded to Flash's sizes: tiny test models load through the same path. Validation rejects
//! what the forward pass cannot compute (odd head dims, rope wider than a head, heads not divisible into output
//! groups, a KV head count other than 1, ...) with [`Error::Metadata`] naming the key and the values.
//!
//! Every value is also bounded from above ([`limits`]): a crafted file cannot make the forward pass allocate
//! gigabytes or loop for hours before the first token (e.g. `attention.indexer.top_k = 2^31`,
//! `attention.sliding_window = 2^31`, `hyper_connection.sinkhorn_iterations = 0xffffffff` are errors naming the key
//! and the value). The bounds are orders of magnitude above Flash's values. Sizes that tensors carry (dims, head
//! counts, ranks, expert counts, vocab) are further checked against the tensor shapes by
//! [`Model::load`](super::Model::load); those that no tensor carries (window, top-k, iterations, epsilons, rope,
//! scales) are bounded here. Optional keys other readers use: `expert_gating_func` must be 4 (sqrt-softplus, the
//! only scoring this engine computes), `swiglu_clamp_shexp` must equal `swiglu_clamp_exp` (one clamp for routed and
//! shared experts), `expert_group_count` / `expert_group_used_count` at most 1 (no grouped routing), `revision`
//! one of [`Revision`]'s values. Unknown keys are ignored.
//!
//! Layer kinds follow the compress ratio: 0 = sliding window only, 4 = CSA (overlapping compressor + indexer),
//! any other positive ratio = HCA (non-overlapping compressor, attends to every visible compressed row).

use crate::gguf::GgufFile;
use crate::{Error, Result};

pub use crate::convert::config::Revision;

/// Upper bounds on hyperparameters (see the module docs). Flash's value in brackets.
pub mod limits {
    /// `block_count` \[43\].
    pub const LAYERS: usize = 1024;
    /// `embedding_length` \[4096\], `attention.q_lora_rank` \[1024\], `attention.output_lora_rank` \[1024\],
    /// `expert_feed_forward_length` \[2048\].
    pub const WIDTH: usize = 1 << 16;
    /// `vocab_size` \[129280\].
    pub const VOCAB: usize = 1 << 22;
    /// `context_length` \[1048576\], `rope.scaling.original_context_length` \[65536\].
    pub const CONTEXT: usize = 1 << 24;
    /// `attention.head_count` \[64\], `attention.indexer.head_count` \[64\].
    pub const HEADS: usize = 1024;
    /// `attention.key_length` \[512\], `attention.indexer.key_length` \[128\].
    pub const HEAD_DIM: usize = 1 << 13;
    /// `expert_count` \[256\].
    pub const EXPERTS: usize = 1 << 12;
    /// `expert_used_count` \[6\].
    pub const EXPERTS_USED: usize = 256;
    /// `attention.sliding_window` \[128\].
    pub const WINDOW: usize = 1 << 14;
    /// `attention.indexer.top_k` \[512\].
    pub const TOP_K: usize = 1 << 14;
    /// `hyper_connection.count` \[4\].
    pub const HC: usize = 64;
    /// `hyper_connection.sinkhorn_iterations` \[20\].
    pub const SINKHORN: usize = 1000;
    /// Entries of `attention.compress_ratios` [4, 128].
    pub const RATIO: usize = 1 << 16;
    /// `rope.freq_base` \[10000\], `attention.compress_rope_freq_base` \[160000\].
    pub const ROPE_BASE: f64 = 1e12;
    /// `rope.scaling.factor` \[16\], `rope.scaling.yarn_beta_*` [32, 1], `expert_weights_scale` [1.5],
    /// `swiglu_clamp_exp` \[10\].
    pub const SCALE: f64 = 1e6;
    /// `hyper_connection.epsilon`, `attention.layer_norm_rms_epsilon` [1e-6]: below this.
    pub const EPS: f64 = 1.0;
}

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
pub struct RopeSpec {
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
    pub rope_main: RopeSpec,
    /// Rope of compressed layers, their compressors and indexers.
    pub rope_compress: RopeSpec,
    pub routed_scale: f32,
    /// Renormalise the selected routing weights to sum 1.
    pub weights_norm: bool,
    /// SwiGLU clamp per layer.
    pub swiglu_limit: Vec<f32>,
    /// The model revision (`revision`; absent = April).
    pub revision: Revision,
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
        if n_layers == 0 || n_layers > limits::LAYERS {
            return Err(bad(format!("{P}block_count = {n_layers} is outside 1..={}", limits::LAYERS)));
        }
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
        if let Some((l, r)) = compress_ratios.iter().enumerate().find(|(_, &r)| r > limits::RATIO) {
            return Err(bad(format!("{P}attention.compress_ratios[{l}] = {r} is above {}", limits::RATIO)));
        }
        let clamps = f.get_float_array(&format!("{P}swiglu_clamp_exp"))?;
        if clamps.len() < n_layers {
            return Err(bad(format!("{P}swiglu_clamp_exp has {} entries, block_count is {n_layers}", clamps.len())));
        }
        if let Some(v) = f.get(&format!("{P}swiglu_clamp_shexp")) {
            // A scalar or a per-layer array (llama.cpp reads either); the engine clamps shared experts like routed ones.
            let sh: Vec<f64> = match v.as_array() {
                Some(_) => f.get_float_array(&format!("{P}swiglu_clamp_shexp"))?,
                None => vec![f.get_f64(&format!("{P}swiglu_clamp_shexp"))?; n_layers],
            };
            if sh.len() < n_layers {
                return Err(bad(format!("{P}swiglu_clamp_shexp has {} entries, block_count is {n_layers}", sh.len())));
            }
            if let Some(l) = (0..n_layers).find(|&l| sh[l] as f32 != clamps[l] as f32) {
                return Err(bad(format!(
                    "{P}swiglu_clamp_shexp[{l}] = {} differs from swiglu_clamp_exp[{l}] = {} (this engine clamps the \
                     shared expert like the routed ones)",
                    sh[l], clamps[l]
                )));
            }
        }
        if f.get(&format!("{P}expert_gating_func")).is_some() {
            let g = f.get_u64(&format!("{P}expert_gating_func"))?;
            if g != 4 {
                return Err(bad(format!("{P}expert_gating_func = {g}: only 4 (sqrt-softplus scoring) is supported")));
            }
        }
        for k in ["expert_group_count", "expert_group_used_count"] {
            if f.get(&format!("{P}{k}")).is_some() {
                let g = f.get_u64(&format!("{P}{k}"))?;
                if g > 1 {
                    return Err(bad(format!("{P}{k} = {g}: grouped expert routing is not supported (0 or 1)")));
                }
            }
        }
        let revision = match f.get(&format!("{P}revision")) {
            None => Revision::April,
            Some(_) => {
                let r = f.get_str(&format!("{P}revision"))?;
                Revision::parse(r).ok_or_else(|| {
                    bad(format!("{P}revision = {r:?} is not a known revision (\"2604\" April, \"0731\")"))
                })?
            }
        };
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
            rope_main: RopeSpec { base: fl("rope.freq_base")?, yarn: None },
            rope_compress: RopeSpec { base: fl("attention.compress_rope_freq_base")?, yarn: Some(yarn) },
            routed_scale: fl("expert_weights_scale")? as f32,
            weights_norm: f.get_bool(&format!("{P}expert_weights_norm"))?,
            swiglu_limit: clamps[..n_layers].iter().map(|&c| c as f32).collect(),
            revision,
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
        use limits as L;
        let upper = [
            ("block_count", self.n_layers, L::LAYERS),
            ("embedding_length", self.d_model, L::WIDTH),
            ("vocab_size", self.vocab, L::VOCAB),
            ("context_length", self.ctx_len, L::CONTEXT),
            ("attention.head_count", self.n_heads, L::HEADS),
            ("attention.key_length", self.head_dim, L::HEAD_DIM),
            ("attention.q_lora_rank", self.q_lora_rank, L::WIDTH),
            ("attention.output_group_count", self.o_groups, L::HEADS),
            ("attention.output_lora_rank", self.o_lora_rank, L::WIDTH),
            ("expert_count", self.n_experts, L::EXPERTS),
            ("expert_used_count", self.n_experts_used, L::EXPERTS_USED),
            ("expert_feed_forward_length", self.expert_ffn, L::WIDTH),
            ("attention.sliding_window", self.window, L::WINDOW),
            ("attention.indexer.head_count", self.idx_heads, L::HEADS),
            ("attention.indexer.key_length", self.idx_head_dim, L::HEAD_DIM),
            ("attention.indexer.top_k", self.idx_topk, L::TOP_K),
            ("hyper_connection.count", self.hc_mult, L::HC),
            ("hyper_connection.sinkhorn_iterations", self.hc_sinkhorn_iters, L::SINKHORN),
        ];
        for (k, v, max) in upper {
            if v > max {
                return Err(bad(format!("{P}{k} = {v} is above the supported maximum {max}")));
            }
        }
        if self.compress_ratios.len() != self.n_layers {
            return Err(bad(format!(
                "{P}attention.compress_ratios has {} entries for block_count {}",
                self.compress_ratios.len(),
                self.n_layers
            )));
        }
        if let Some((l, r)) = self.compress_ratios.iter().enumerate().find(|(_, &r)| r > L::RATIO) {
            return Err(bad(format!("{P}attention.compress_ratios[{l}] = {r} is above {}", L::RATIO)));
        }
        if self.swiglu_limit.len() != self.n_layers {
            return Err(bad(format!(
                "{P}swiglu_clamp_exp has {} entries for block_count {}",
                self.swiglu_limit.len(),
                self.n_layers
            )));
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
            for (k, v) in [
                ("attention.indexer.head_count", self.idx_heads),
                ("attention.indexer.key_length", self.idx_head_dim),
                ("attention.indexer.top_k", self.idx_topk),
            ] {
                if v == 0 {
                    return Err(bad(format!("{P}{k} must be > 0 (the model has CSA layers)")));
                }
            }
            if self.rope_dim > self.idx_head_dim {
                return Err(bad(format!(
                    "rope.dimension_count {} > attention.indexer.key_length {}",
                    self.rope_dim, self.idx_head_dim
                )));
            }
        }
        for (k, v) in [("hyper_connection.epsilon", self.hc_eps), ("attention.layer_norm_rms_epsilon", self.rms_eps)] {
            if !(v.is_finite() && v >= 0.0 && (v as f64) < L::EPS) {
                return Err(bad(format!("{P}{k} = {v} is not a finite number in [0, {})", L::EPS)));
            }
        }
        for (i, &l) in self.swiglu_limit.iter().enumerate() {
            if !(l.is_finite() && l > 0.0 && (l as f64) <= L::SCALE) {
                return Err(bad(format!("{P}swiglu_clamp_exp[{i}] = {l} must be finite, > 0 and <= {}", L::SCALE)));
            }
        }
        let rs = self.routed_scale as f64;
        if !(rs.is_finite() && rs > 0.0 && rs <= L::SCALE) {
            return Err(bad(format!("{P}expert_weights_scale = {rs} must be finite, > 0 and <= {}", L::SCALE)));
        }
        for (k, rp) in [("rope.freq_base", self.rope_main), ("attention.compress_rope_freq_base", self.rope_compress)] {
            if !(rp.base.is_finite() && rp.base > 1.0 && rp.base <= L::ROPE_BASE) {
                return Err(bad(format!("{P}{k} = {} must be in (1, {:e}]", rp.base, L::ROPE_BASE)));
            }
            if let Some((factor, orig, bf, bs)) = rp.yarn {
                let checks = [
                    ("rope.scaling.factor", factor, 1.0, L::SCALE),
                    ("rope.scaling.original_context_length", orig, 1.0, L::CONTEXT as f64),
                    ("rope.scaling.yarn_beta_fast", bf, f64::MIN_POSITIVE, L::SCALE),
                    ("rope.scaling.yarn_beta_slow", bs, f64::MIN_POSITIVE, L::SCALE),
                ];
                for (k, v, lo, hi) in checks {
                    if !(v.is_finite() && v >= lo && v <= hi) {
                        return Err(bad(format!("{P}{k} = {v} must be in [{lo:e}, {hi:e}]")));
                    }
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
    pub fn rope_for(&self, l: usize) -> RopeSpec {
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
