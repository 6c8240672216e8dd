//! The DSpark drafter's weights (V4-Flash-0731): config from `deepseek4.dspark.*`, stages from `mtp.{s}.*` as
//! [`crate::convert`] writes them (a trunk layer's suffixes per stage, plus the stage-0 target projection and the
//! last stage's head, Markov head and confidence head). What the drafter computes is in
//! [`crate::speculative::dspark`].
//!
//! Invariants after [`DsparkModel::load`]: the stages are layers of compress ratio 0 with learned routing, every
//! tensor has the dims the config implies (errors name it), the target layer ids are strictly increasing layers of
//! the trunk, one per stage, and the noise token is inside the vocabulary.

use super::weights::{load_global, load_layer, Dims, Hold, Loader};
use super::{Model, ModelConfig, WeightId, WeightTable};
use crate::gguf::GgufFile;
use crate::{Error, Result};

/// `deepseek4.dspark.*`.
#[derive(Clone, Debug, PartialEq)]
pub struct DsparkParams {
    /// Draft tokens per block (the block is the anchor and `block_size − 1` noise tokens).
    pub block_size: usize,
    /// The noise (mask) token filling the block after the anchor.
    pub noise_token: u32,
    /// Trunk layers whose streams feed the drafter (one per stage, strictly increasing).
    pub target_layers: Vec<usize>,
    /// Rank of the Markov head.
    pub markov_rank: usize,
}

/// The drafter's own tensors besides its stages.
#[derive(Clone, Copy, Debug)]
pub struct DsparkWeights {
    /// `[d, taps·d]` (GGUF order): target features → context input.
    pub main_proj: WeightId,
    pub main_norm: WeightId,
    /// `[rank, vocab]`: a row per previous token.
    pub markov_w1: WeightId,
    /// `[rank, vocab]`: the bias product `rank → vocab`.
    pub markov_w2: WeightId,
    /// `[d + rank]`: the confidence head.
    pub confidence: WeightId,
}

/// The drafter: its stages as a [`Model`] (layers = stages; the global weights are the target's embedding and
/// output matrix with the last stage's norm and mHC head), plus [`DsparkWeights`] and [`DsparkParams`].
pub struct DsparkModel {
    pub model: Model,
    pub weights: DsparkWeights,
    pub config: DsparkParams,
}

impl std::fmt::Debug for DsparkModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DsparkModel").field("config", &self.config).finish()
    }
}

impl DsparkModel {
    /// Whether `target`'s file holds a converted DSpark drafter (`deepseek4.dspark.*` and `mtp.0.main_proj`).
    pub fn present(target: &Model) -> bool {
        target.file.get("deepseek4.dspark.block_size").is_some()
            && target.file.tensor_info("mtp.0.main_proj.weight").is_some()
    }

    /// The drafter of `target`'s file (`None` when it has none; an error naming the tensor or key when it has a
    /// broken one). Shares the file's bytes.
    pub fn load(target: &Model) -> Result<Option<DsparkModel>> {
        if !Self::present(target) {
            return Ok(None);
        }
        let f = &target.file;
        let tc = &target.config;
        let block_size = f.get_usize("deepseek4.dspark.block_size")?;
        let noise = f.get_u64("deepseek4.dspark.noise_token_id")?;
        let markov_rank = f.get_usize("deepseek4.dspark.markov_rank")?;
        let ids = f.get_int_array("deepseek4.dspark.target_layer_ids")?;
        let mut target_layers = Vec::with_capacity(ids.len());
        for &i in &ids {
            match usize::try_from(i) {
                Ok(l) if l < tc.n_layers && target_layers.last().is_none_or(|&p| p < l) => target_layers.push(l),
                _ => {
                    return Err(Error::Metadata(format!(
                        "deepseek4.dspark.target_layer_ids = {ids:?}: need strictly increasing layers of 0..{}",
                        tc.n_layers
                    )))
                }
            }
        }
        if target_layers.is_empty() || !(1..=64).contains(&block_size) || markov_rank == 0 {
            return Err(Error::Metadata(format!(
                "deepseek4.dspark: block_size {block_size} (1..=64), {} target layers (≥ 1), markov_rank \
                 {markov_rank} (≥ 1)",
                target_layers.len()
            )));
        }
        if noise >= tc.vocab as u64 {
            return Err(Error::Metadata(format!(
                "deepseek4.dspark.noise_token_id = {noise} is outside the vocabulary of {}",
                tc.vocab
            )));
        }
        let stages = target_layers.len();
        let mut config: ModelConfig = tc.clone();
        config.n_layers = stages;
        config.compress_ratios = vec![0; stages];
        config.n_hash_layers = 0;
        let last_limit = *tc.swiglu_limit.last().unwrap_or(&0.0);
        config.swiglu_limit = vec![last_limit; stages];
        let file: GgufFile = f.share();
        let c = &config;
        let mut ld = Loader { f: &file, t: WeightTable::default() };
        let Dims { dk, vk, hcd, mixk, .. } = Dims::of(c);
        let last = format!("mtp.{}.", stages - 1);
        let global = load_global(&mut ld, c, &format!("{last}norm.weight"), &format!("{last}hc_head_"))?;
        let rk = (markov_rank, "deepseek4.dspark.markov_rank");
        let weights = DsparkWeights {
            main_proj: ld.add(
                "mtp.0.main_proj.weight",
                &[(stages * c.d_model, "stages × deepseek4.embedding_length"), dk],
                Hold::Map,
            )?,
            main_norm: ld.add("mtp.0.main_norm.weight", &[dk], Hold::Dense)?,
            markov_w1: ld.add(&format!("{last}markov_w1.weight"), &[rk, vk], Hold::Map)?,
            markov_w2: ld.add(&format!("{last}markov_w2.weight"), &[rk, vk], Hold::Map)?,
            confidence: ld.add(
                &format!("{last}confidence.weight"),
                &[(c.d_model + markov_rank, "embedding_length + dspark.markov_rank")],
                Hold::Dense,
            )?,
        };
        let mut layers = Vec::with_capacity(stages);
        for s in 0..stages {
            let lw = load_layer(&mut ld, c, s, &format!("mtp.{s}."), dk, vk, hcd, mixk).map_err(|e| {
                Error::Metadata(format!("DSpark stage {s} (mtp.{s}.*: window attention, learned routing): {e}"))
            })?;
            layers.push(lw);
        }
        let table = ld.t;
        tracing::info!(stages, block_size, tensors = table.names.len(), "DSpark drafter loaded");
        let model = Model::from_parts(config, file, table, global, layers);
        Ok(Some(DsparkModel {
            model,
            weights,
            config: DsparkParams { block_size, noise_token: noise as u32, target_layers, markov_rank },
        }))
    }
}
