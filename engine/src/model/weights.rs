//! The weight table: every tensor the forward pass reads, validated against [`ModelConfig`] at load.
//!
//! Layout (struct-of-arrays): [`WeightTable`] holds one entry per tensor — name, type, GGUF dims, index of the
//! tensor in the file — and, for small tensors (norm weights, biases, sinks, mHC base/scale, compressor `ape`),
//! an f32 copy made at load. Matrices stay in the GGUF memory map (zero copy) and are read through [`Mat`]; the
//! CPU backend adds, per dense Q8_0 matrix, a copy repacked for its batched kernels ([`Model::packed_mat`],
//! [`Model::pack_dense`]; `DS4_CPU_PACK=0` turns it off).
//! [`GlobalWeights`] and [`LayerWeights`] are index structs of [`WeightId`]s into the table.
//!
//! Invariants after [`Model::load`]: every id points at a tensor whose type the engine can compute with and
//! whose dims match the config (errors name the tensor, expected and found dims); `dense(id)` is only called on
//! ids loaded as dense (it panics otherwise — a programming error, not bad input); `tid2eid` entries are valid
//! expert ids.

use std::sync::OnceLock;

pub use super::mat::Mat;
use crate::gguf::GgufFile;
use crate::model::config::{LayerKind, ModelConfig};
use crate::quant::{self, GgmlType, PackedMat};
use crate::{Error, Result};

/// Index of a tensor in the [`WeightTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightId(pub u32);

/// The flat tensor table (struct-of-arrays). See the module docs.
#[derive(Debug, Default)]
pub struct WeightTable {
    pub names: Vec<String>,
    pub types: Vec<GgmlType>,
    /// GGUF dims, innermost first.
    pub dims: Vec<Vec<u64>>,
    /// Index of the tensor in `GgufFile::tensors()`.
    pub file_index: Vec<usize>,
    /// f32 copy for small tensors; empty for matrices read from the map.
    pub dense: Vec<Vec<f32>>,
}

/// Global tensors.
#[derive(Clone, Debug)]
pub struct GlobalWeights {
    pub embed: WeightId,
    pub norm: WeightId,
    pub head: WeightId,
    pub hc_fn: WeightId,
    pub hc_base: WeightId,
    pub hc_scale: WeightId,
}

/// One mHC site (attention or FFN side of a layer).
#[derive(Clone, Copy, Debug)]
pub struct HcWeights {
    pub fn_: WeightId,
    pub base: WeightId,
    pub scale: WeightId,
}

/// A compressor (main or indexer).
#[derive(Clone, Copy, Debug)]
pub struct CompressorWeights {
    pub ape: WeightId,
    pub wkv: WeightId,
    pub wgate: WeightId,
    pub norm: WeightId,
}

/// The indexer of a CSA layer.
#[derive(Clone, Copy, Debug)]
pub struct IndexerWeights {
    pub wq_b: WeightId,
    pub proj: WeightId,
    pub comp: CompressorWeights,
}

/// Tensors of one layer.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub hc_attn: HcWeights,
    pub hc_ffn: HcWeights,
    pub attn_norm: WeightId,
    pub wq_a: WeightId,
    pub q_norm: WeightId,
    pub wq_b: WeightId,
    pub wkv: WeightId,
    pub kv_norm: WeightId,
    pub sinks: WeightId,
    pub wo_a: WeightId,
    pub wo_b: WeightId,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
    pub ffn_norm: WeightId,
    pub gate: WeightId,
    pub gate_bias: Option<WeightId>,
    /// `[n_tokens_vocab * n_used]` expert ids (hash layers only).
    pub tid2eid: Option<Vec<u32>>,
    pub gate_exps: WeightId,
    pub up_exps: WeightId,
    pub down_exps: WeightId,
    pub gate_sh: Option<WeightId>,
    pub up_sh: Option<WeightId>,
    pub down_sh: Option<WeightId>,
}

/// The MTP block's input projections (see [`Model::load_mtp`]): position `q` of the drafter takes token `t_q` and
/// the target's final streams `H[q−1]` (zero at `q = 0`) and starts from the streams
/// `X[r] = e_proj·(RMSNorm(embed[t_q])·enorm) + h_proj·(RMSNorm(H[q−1][r])·hnorm)` for every stream `r`.
#[derive(Clone, Copy, Debug)]
pub struct MtpInputWeights {
    pub e_proj: WeightId,
    pub h_proj: WeightId,
    pub enorm: WeightId,
    pub hnorm: WeightId,
}

/// A loaded model: config, the file (owning the map) and the weight table; `packed`: per tensor, the CPU's
/// repacked copy of a Q8_0 matrix, made on first use by [`Model::packed_mat`]. `mtp_input` is set on the MTP
/// drafter's model only ([`Model::load_mtp`]): its first stage is [`crate::graph::Op::MtpInput`], not the embedding.
pub struct Model {
    pub config: ModelConfig,
    pub file: GgufFile,
    pub table: WeightTable,
    pub global: GlobalWeights,
    pub layers: Vec<LayerWeights>,
    pub mtp_input: Option<MtpInputWeights>,
    packed: Vec<OnceLock<Option<PackedMat>>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("config", &self.config).field("tensors", &self.table.names.len()).finish()
    }
}

/// How a tensor is held.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Hold {
    /// f32 copy (F32/F16/BF16 only).
    Dense,
    /// Matrix in the map (any computable type).
    Map,
}

pub(super) struct Loader<'a> {
    pub(super) f: &'a GgufFile,
    pub(super) t: WeightTable,
}

impl Loader<'_> {
    /// Binds tensor `name`, which must have `dims` (GGUF order); each dim comes with the hyperparameter(s) it
    /// follows, named in the error when the file disagrees.
    pub(super) fn add(&mut self, name: &str, dims: &[(usize, &str)], hold: Hold) -> Result<WeightId> {
        let idx = self.f.tensor_index(name).ok_or_else(|| Error::MissingTensor(name.into()))?;
        let info = &self.f.tensors()[idx];
        let want: Vec<u64> = dims.iter().map(|&(d, _)| d as u64).collect();
        // Trailing 1-dims are insignificant in GGUF.
        let mut got = info.dims.clone();
        while got.len() > want.len() && got.last() == Some(&1) {
            got.pop();
        }
        if got != want {
            let keys: Vec<String> = dims.iter().map(|&(d, k)| format!("{k} = {d}")).collect();
            return Err(Error::Tensor {
                name: name.into(),
                what: format!(
                    "expected dims {want:?} (GGUF order) from the metadata [{}], found {:?}",
                    keys.join(", "),
                    info.dims
                ),
            });
        }
        let dense = match hold {
            Hold::Dense => {
                let data = self.f.view(info).data;
                match info.ty {
                    GgmlType::F32 => {
                        data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
                    }
                    GgmlType::F16 => {
                        data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
                    }
                    GgmlType::Bf16 => {
                        data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
                    }
                    ty => {
                        // Any dequantizable type, row by row.
                        let (cols, rows) = (info.row_len() as usize, info.n_rows() as usize);
                        let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
                        let mut out = vec![0f32; cols * rows];
                        for r in 0..rows {
                            crate::quant::dequantize_row(
                                ty,
                                &data[r * rb..(r + 1) * rb],
                                &mut out[r * cols..(r + 1) * cols],
                            )
                            .map_err(|e| Error::Tensor {
                                name: name.into(),
                                what: format!("cannot read as f32: {e}"),
                            })?;
                        }
                        out
                    }
                }
            }
            Hold::Map => {
                if !crate::backend::cpu::matmul::supports(info.ty) {
                    return Err(Error::Tensor {
                        name: name.into(),
                        what: format!("type {} cannot be used for matrix products", info.ty),
                    });
                }
                Vec::new()
            }
        };
        let id = WeightId(self.t.names.len() as u32);
        self.t.names.push(name.into());
        self.t.types.push(info.ty);
        self.t.dims.push(info.dims.clone());
        self.t.file_index.push(idx);
        self.t.dense.push(dense);
        Ok(id)
    }

    fn has(&self, name: &str) -> bool {
        self.f.tensor_info(name).is_some()
    }
}

/// The tokenizer keys that must agree with the vocabulary the tensors have: `tokenizer.ggml.tokens` (when present)
/// has `vocab_size` entries, and the special-token ids present are inside it.
fn check_tokenizer_keys(f: &GgufFile, vocab: usize) -> Result<()> {
    if let Some(v) = f.get("tokenizer.ggml.tokens") {
        let n = v
            .as_array()
            .map(|a| a.len())
            .ok_or_else(|| Error::Metadata("tokenizer.ggml.tokens is not an array".into()))?;
        if n != vocab {
            return Err(Error::Metadata(format!(
                "tokenizer.ggml.tokens has {n} tokens, deepseek4.vocab_size is {vocab}"
            )));
        }
    }
    for k in ["bos_token_id", "eos_token_id", "padding_token_id"] {
        let key = format!("tokenizer.ggml.{k}");
        if f.get(&key).is_some() {
            let id = f.get_u64(&key)?;
            if id >= vocab as u64 {
                return Err(Error::Metadata(format!("{key} = {id} is outside the vocabulary of {vocab}")));
            }
        }
    }
    Ok(())
}

impl Model {
    /// Reads the config and builds the weight table of `file`, validating every tensor.
    pub fn load(file: GgufFile) -> Result<Model> {
        let config = ModelConfig::from_gguf(&file)?;
        check_tokenizer_keys(&file, config.vocab)?;
        let c = &config;
        let mut ld = Loader { f: &file, t: WeightTable::default() };
        let Dims { dk, vk, hcd, mixk, .. } = Dims::of(c);
        let global = load_global(&mut ld, c, "output_norm.weight", "output_hc_")?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let lw = load_layer(&mut ld, c, l, &format!("blk.{l}."), dk, vk, hcd, mixk).map_err(|e| {
                let what = format!(
                    "layer {l} (deepseek4.attention.compress_ratios[{l}] = {}: {:?} attention; {} by \
                     deepseek4.hash_layer_count = {}): {e}",
                    c.compress_ratios[l],
                    c.layer_kind(l),
                    if c.is_hash_layer(l) { "hash-routed" } else { "learned routing" },
                    c.n_hash_layers
                );
                Error::Metadata(what)
            })?;
            layers.push(lw);
        }
        let table = ld.t;
        tracing::info!(
            layers = config.n_layers,
            tensors = table.names.len(),
            d_model = config.d_model,
            vocab = config.vocab,
            "model loaded"
        );
        let packed = (0..table.names.len()).map(|_| OnceLock::new()).collect();
        Ok(Model { config, file, table, global, layers, mtp_input: None, packed })
    }

    /// Whether the file holds an MTP block (`mtp.0.*`, the April release's layout).
    pub fn has_mtp(&self) -> bool {
        self.file.tensor_info("mtp.0.e_proj.weight").is_some()
    }

    /// The MTP drafter as a model of its own (`None` when the file has no MTP block): one layer — the block
    /// `mtp.0.<layer tensors>`, sliding-window attention (compress ratio 0), learned routing — whose first stage
    /// combines the token's embedding with the target's final streams ([`MtpInputWeights`]), and whose head is
    /// the target's (`token_embd`, `output.weight`) with the block's own `mtp.0.norm` and `mtp.0.hc_head_*`. Its
    /// logits at position `q` predict token `q + 1`, as the target's do; its final streams feed its next
    /// position when it drafts several tokens in a row. Shares the file's bytes ([`GgufFile::share`]).
    pub fn load_mtp(&self) -> Result<Option<Model>> {
        if !self.has_mtp() {
            return Ok(None);
        }
        let mut config = self.config.clone();
        config.n_layers = 1;
        config.compress_ratios = vec![0];
        config.n_hash_layers = 0;
        config.swiglu_limit = vec![*self.config.swiglu_limit.last().unwrap_or(&0.0)];
        let file = self.file.share();
        let c = &config;
        let mut ld = Loader { f: &file, t: WeightTable::default() };
        use Hold::*;
        let Dims { dk, vk, hcd, mixk, .. } = Dims::of(c);
        // The target's embedding and output matrix, the block's own norm and mHC head.
        let global = load_global(&mut ld, c, "mtp.0.norm.weight", "mtp.0.hc_head_")?;
        let mtp_input = MtpInputWeights {
            e_proj: ld.add("mtp.0.e_proj.weight", &[dk, dk], Map)?,
            h_proj: ld.add("mtp.0.h_proj.weight", &[dk, dk], Map)?,
            enorm: ld.add("mtp.0.enorm.weight", &[dk], Dense)?,
            hnorm: ld.add("mtp.0.hnorm.weight", &[dk], Dense)?,
        };
        let block = load_layer(&mut ld, c, 0, "mtp.0.", dk, vk, hcd, mixk)
            .map_err(|e| Error::Metadata(format!("the MTP block (mtp.0.*: window attention, learned routing): {e}")))?;
        let table = ld.t;
        tracing::info!(tensors = table.names.len(), "MTP drafter loaded");
        let packed = (0..table.names.len()).map(|_| OnceLock::new()).collect();
        Ok(Some(Model { config, file, table, global, layers: vec![block], mtp_input: Some(mtp_input), packed }))
    }

    /// A model over `file` from a finished table (the DSpark drafter's stages, [`crate::model::dspark`]).
    pub(super) fn from_parts(
        config: ModelConfig,
        file: GgufFile,
        table: WeightTable,
        global: GlobalWeights,
        layers: Vec<LayerWeights>,
    ) -> Model {
        let packed = (0..table.names.len()).map(|_| OnceLock::new()).collect();
        Model { config, file, table, global, layers, mtp_input: None, packed }
    }

    /// The f32 copy of a small tensor. Panics if `id` was loaded as a matrix (see module docs).
    pub fn dense(&self, id: WeightId) -> &[f32] {
        let v = &self.table.dense[id.0 as usize];
        assert!(!v.is_empty(), "tensor {} is not held dense", self.table.names[id.0 as usize]);
        v
    }

    /// A tensor as a matrix: rows = product of dims after the first, cols = dims\[0\].
    pub fn mat(&self, id: WeightId) -> Mat<'_> {
        let i = id.0 as usize;
        let info = &self.file.tensors()[self.table.file_index[i]];
        let data = self.file.view(info).data;
        let cols = info.row_len() as usize;
        let rows = info.n_rows() as usize;
        let ty = info.ty;
        // Validated at load: whole blocks, and n_bytes == rows * row_bytes.
        let row_bytes = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
        Mat { ty, rows, cols, row_bytes, data, packed: None }
    }

    /// [`Model::mat`] with [`Mat::packed`] filled where this CPU has a packed-weight kernel for the type
    /// (`quant::dot_q_packed_kernel`: Q8_0 with AVX-512 VNNI) and the rows are short enough to gain from it
    /// ([`PackedMat::pays_for`]: up to 4096 values; Flash's 8192-value attention output rows stay as stored): the
    /// copy is made on the first call for the tensor (all cores, about as fast as reading the matrix once) and
    /// kept for the model's life — resident memory grows by the Q8_0 matrices packed, while their mapped pages,
    /// no longer read, stay reclaimable page cache. Results are bit-identical with or without it.
    pub fn packed_mat(&self, id: WeightId) -> Mat<'_> {
        let mut m = self.mat(id);
        if quant::dot_q_packed_kernel(m.ty).is_none() || !packing_on() || !PackedMat::pays_for(m.cols) {
            return m;
        }
        let packed = self.packed[id.0 as usize].get_or_init(|| {
            let p = PackedMat::pack_q8_0(m.data, m.rows, m.row_bytes);
            tracing::debug!(tensor = self.name(id), bytes = p.as_ref().map_or(0, |p| p.bytes()), "packed for the CPU");
            p
        });
        m.packed = packed.as_ref().map(|p| p.view());
        m
    }

    /// Packs, now, every matrix [`Model::packed_mat`] would pack on first use — the dense Q8_0 ones; not the
    /// token embedding (read a row at a time) nor the routed experts (multiplied as stored) — so that the first
    /// request does not wait for it; a `tracing` line per GiB packed and one at the end. Returns the bytes packed
    /// (0 where this CPU has no packed kernel or `DS4_CPU_PACK=0`).
    pub fn pack_dense(&self) -> usize {
        if quant::dot_q_packed_kernel(GgmlType::Q8_0).is_none() || !packing_on() {
            return 0;
        }
        let t0 = std::time::Instant::now();
        let mut skip = vec![false; self.table.names.len()];
        skip[self.global.embed.0 as usize] = true;
        for lw in &self.layers {
            for id in [lw.gate_exps, lw.up_exps, lw.down_exps] {
                skip[id.0 as usize] = true;
            }
        }
        let (mut done, mut logged) = (0usize, 0usize);
        for (i, ty) in self.table.types.iter().enumerate() {
            let id = WeightId(i as u32);
            if skip[i] || *ty != GgmlType::Q8_0 || !self.table.dense[i].is_empty() {
                continue;
            }
            let m = self.packed_mat(id);
            if m.packed.is_some() {
                done += m.data.len();
            }
            if done >> 30 > logged {
                logged = done >> 30;
                tracing::info!(gib = logged, "packing dense Q8_0 weights for the CPU");
            }
        }
        tracing::info!(bytes = done, ms = t0.elapsed().as_millis() as u64, "dense Q8_0 weights packed for the CPU");
        done
    }

    /// Name of a tensor (for error messages).
    pub fn name(&self, id: WeightId) -> &str {
        &self.table.names[id.0 as usize]
    }
}

/// The dims the tensors follow, each with the metadata key(s) it comes from (named when a tensor disagrees).
pub(super) struct Dims {
    pub(super) dk: (usize, &'static str),
    pub(super) vk: (usize, &'static str),
    pub(super) hck: (usize, &'static str),
    pub(super) hcd: (usize, &'static str),
    pub(super) mixk: (usize, &'static str),
}

impl Dims {
    pub(super) fn of(c: &ModelConfig) -> Dims {
        Dims {
            dk: (c.d_model, "deepseek4.embedding_length"),
            vk: (c.vocab, "deepseek4.vocab_size"),
            hck: (c.hc_mult, "deepseek4.hyper_connection.count"),
            hcd: (c.hc_mult * c.d_model, "deepseek4.hyper_connection.count × embedding_length"),
            mixk: (c.hc_mix(), "(2 + deepseek4.hyper_connection.count) × hyper_connection.count"),
        }
    }
}

/// Binds the head's tensors: the embedding and output matrix, the final norm `norm` and the mHC head
/// `{hc}fn.weight`, `{hc}base.weight`, `{hc}scale.weight` (the target's `output_hc_`, the MTP block's `mtp.0.hc_head_`).
pub(super) fn load_global(ld: &mut Loader, c: &ModelConfig, norm: &str, hc: &str) -> Result<GlobalWeights> {
    use Hold::*;
    let Dims { dk, vk, hck, hcd, .. } = Dims::of(c);
    Ok(GlobalWeights {
        embed: ld.add("token_embd.weight", &[dk, vk], Map)?,
        norm: ld.add(norm, &[dk], Dense)?,
        head: ld.add("output.weight", &[dk, vk], Map)?,
        hc_fn: ld.add(&format!("{hc}fn.weight"), &[hcd, hck], Map)?,
        hc_base: ld.add(&format!("{hc}base.weight"), &[hck], Dense)?,
        hc_scale: ld.add(&format!("{hc}scale.weight"), &[(1, "1")], Dense)?,
    })
}

/// Whether [`Model::packed_mat`] packs: yes unless `DS4_CPU_PACK=0` (keeps resident memory at the mapped file's,
/// at the cost of the batched Q8_0 speed; results are the same either way). Read once.
pub fn packing_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| !std::env::var("DS4_CPU_PACK").is_ok_and(|v| v == "0"))
}

/// Binds the tensors of layer `l`, named `{prefix}<suffix>` (see [`Model::load`], [`Model::load_mtp`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn load_layer(
    ld: &mut Loader,
    c: &ModelConfig,
    l: usize,
    prefix: &str,
    dk: (usize, &str),
    vk: (usize, &str),
    hcd: (usize, &str),
    mixk: (usize, &str),
) -> Result<LayerWeights> {
    use Hold::*;
    let file = ld.f;
    let n = |s: &str| format!("{prefix}{s}");
    let hcw = |ld: &mut Loader, side: &str| -> Result<HcWeights> {
        Ok(HcWeights {
            fn_: ld.add(&n(&format!("hc_{side}_fn.weight")), &[hcd, mixk], Map)?,
            base: ld.add(&n(&format!("hc_{side}_base.weight")), &[mixk], Dense)?,
            scale: ld.add(&n(&format!("hc_{side}_scale.weight")), &[(3, "3")], Dense)?,
        })
    };
    let hc_attn = hcw(ld, "attn")?;
    let hc_ffn = hcw(ld, "ffn")?;
    let kind = c.layer_kind(l);
    let ratio = (c.compress_ratios[l], "deepseek4.attention.compress_ratios[layer]");
    let hdk = (c.head_dim, "deepseek4.attention.key_length");
    let idk = (c.idx_head_dim, "deepseek4.attention.indexer.key_length");
    let comp = |ld: &mut Loader, pre: &str, hd: (usize, &str), coff: usize| -> Result<CompressorWeights> {
        let w = (coff * hd.0, hd.1);
        Ok(CompressorWeights {
            ape: ld.add(&n(&format!("{pre}_ape.weight")), &[w, ratio], Dense)?,
            wkv: ld.add(&n(&format!("{pre}_kv.weight")), &[dk, w], Map)?,
            wgate: ld.add(&n(&format!("{pre}_gate.weight")), &[dk, w], Map)?,
            norm: ld.add(&n(&format!("{pre}_norm.weight")), &[hd], Dense)?,
        })
    };
    let (compressor, indexer) = match kind {
        LayerKind::Window => (None, None),
        LayerKind::Hca => (Some(comp(ld, "attn_compressor", hdk, 1)?), None),
        LayerKind::Csa => {
            let cw = comp(ld, "attn_compressor", hdk, 2)?;
            let iw = IndexerWeights {
                wq_b: ld.add(
                    &n("indexer.attn_q_b.weight"),
                    &[
                        (c.q_lora_rank, "deepseek4.attention.q_lora_rank"),
                        (
                            c.idx_heads * c.idx_head_dim,
                            "deepseek4.attention.indexer.head_count × attention.indexer.key_length",
                        ),
                    ],
                    Map,
                )?,
                proj: ld.add(
                    &n("indexer.proj.weight"),
                    &[dk, (c.idx_heads, "deepseek4.attention.indexer.head_count")],
                    Map,
                )?,
                comp: comp(ld, "indexer_compressor", idk, 2)?,
            };
            (Some(cw), Some(iw))
        }
    };
    let hash = c.is_hash_layer(l);
    let tid2eid = if hash {
        let name = n("ffn_gate_tid2eid.weight");
        let info = file.tensor_info(&name).ok_or_else(|| Error::MissingTensor(name.clone()))?;
        let want = vec![c.n_experts_used as u64, vk.0 as u64];
        if info.ty != GgmlType::I32 || info.dims != want {
            return Err(Error::Tensor {
                name,
                what: format!(
                    "expected i32 {want:?} from the metadata [deepseek4.expert_used_count = {}, {} = {}], found {} {:?}",
                    c.n_experts_used, vk.1, vk.0, info.ty, info.dims
                ),
            });
        }
        let data = file.view(info).data;
        let mut ids = Vec::with_capacity(data.len() / 4);
        for ch in data.chunks_exact(4) {
            let e = i32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]);
            if e < 0 || e as usize >= c.n_experts {
                return Err(Error::Tensor {
                    name,
                    what: format!("expert id {e} out of range 0..{} (deepseek4.expert_count)", c.n_experts),
                });
            }
            ids.push(e as u32);
        }
        Some(ids)
    } else {
        None
    };
    let nek = (c.n_experts, "deepseek4.expert_count");
    let ffk = (c.expert_ffn, "deepseek4.expert_feed_forward_length");
    let gate_bias_name = n("exp_probs_b.bias");
    let gate_bias = if !hash || ld.has(&gate_bias_name) { Some(ld.add(&gate_bias_name, &[nek], Dense)?) } else { None };
    let (gate_sh, up_sh, down_sh) = if c.n_shared_experts == 1 {
        (
            Some(ld.add(&n("ffn_gate_shexp.weight"), &[dk, ffk], Map)?),
            Some(ld.add(&n("ffn_up_shexp.weight"), &[dk, ffk], Map)?),
            Some(ld.add(&n("ffn_down_shexp.weight"), &[ffk, dk], Map)?),
        )
    } else {
        (None, None, None)
    };
    let hd_all = c.n_heads * c.head_dim;
    let qk = (c.q_lora_rank, "deepseek4.attention.q_lora_rank");
    let hdall = (hd_all, "deepseek4.attention.head_count × attention.key_length");
    let og = (c.o_groups * c.o_lora_rank, "deepseek4.attention.output_group_count × attention.output_lora_rank");
    Ok(LayerWeights {
        hc_attn,
        hc_ffn,
        attn_norm: ld.add(&n("attn_norm.weight"), &[dk], Dense)?,
        wq_a: ld.add(&n("attn_q_a.weight"), &[dk, qk], Map)?,
        q_norm: ld.add(&n("attn_q_a_norm.weight"), &[qk], Dense)?,
        wq_b: ld.add(&n("attn_q_b.weight"), &[qk, hdall], Map)?,
        wkv: ld.add(&n("attn_kv.weight"), &[dk, hdk], Map)?,
        kv_norm: ld.add(&n("attn_kv_a_norm.weight"), &[hdk], Dense)?,
        sinks: ld.add(&n("attn_sinks.weight"), &[(c.n_heads, "deepseek4.attention.head_count")], Dense)?,
        wo_a: ld.add(
            &n("attn_output_a.weight"),
            &[
                (
                    hd_all / c.o_groups,
                    "deepseek4.attention.head_count × attention.key_length / attention.output_group_count",
                ),
                og,
            ],
            Map,
        )?,
        wo_b: ld.add(&n("attn_output_b.weight"), &[og, dk], Map)?,
        compressor,
        indexer,
        ffn_norm: ld.add(&n("ffn_norm.weight"), &[dk], Dense)?,
        gate: ld.add(&n("ffn_gate_inp.weight"), &[dk, nek], Map)?,
        gate_bias,
        tid2eid,
        gate_exps: ld.add(&n("ffn_gate_exps.weight"), &[dk, ffk, nek], Map)?,
        up_exps: ld.add(&n("ffn_up_exps.weight"), &[dk, ffk, nek], Map)?,
        down_exps: ld.add(&n("ffn_down_exps.weight"), &[ffk, dk, nek], Map)?,
        gate_sh,
        up_sh,
        down_sh,
    })
}
