//! `--synthetic`: a DeepSeek V4 model with random weights in the real shapes and quant recipes, built in memory as a
//! GGUF (no file) and handed to the engine like any model file.
//!
//! `--write FILE` streams the same model to a file instead ([`write_file`]), with the converter's metadata and a
//! synthetic tokenizer, so other engines can load exactly what ds4 benchmarks.
//!
//! Spec strings: `flash[:layers=N][:from=K][:recipe=q2|q4]` — Flash's real hyperparameters (the public
//! `config.json` values below) with `N` layers copied from the real layer list starting at layer `K` (default 0, so
//! `layers=2` gives the two window-only hash-routed layers; `from=3` gives CSA/HCA layers with compressors and
//! indexers) — and `tiny[:layers=N][:recipe=...]`, a small model with the same structure for smoke tests.
//!
//! The tensor list, names, dims and types come from the converter (`ds4_engine::convert::{plan, Recipe}`), so the
//! synthetic file has exactly the layout a converted checkpoint has. Weights: matrices uniform-ish in
//! `±1/sqrt(row_len)` (random valid quant blocks, see [`crate::blocks`]), norm weights 1, other vectors small,
//! `tid2eid` rows of distinct random expert ids. Activations therefore stay bounded; the logits mean nothing.
//!
//! Memory: the output `Vec` is reserved up front (header estimate + tensor bytes), plus one tensor of scratch, so
//! `flash:layers=2` (q2) needs about 5.5 GiB and fits a 24 GiB machine with room for the engine.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_engine::convert::synth_tokenizer::synthetic_tokenizer_metadata;
use ds4_engine::convert::{plan, CheckpointConfig, Class, Recipe};
use ds4_engine::gguf::{GgufFile, GgufWriter, MetaValue, TensorDecl};
use ds4_engine::quant::GgmlType;
use indicatif::ProgressBar;

use crate::blocks::{self, SplitMix64};

/// Which synthetic model to build.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// `flash` or `tiny`.
    pub base: Base,
    pub layers: usize,
    /// First real layer copied (Flash's layer list: ratios, hash routing).
    pub from: usize,
    pub recipe: Recipe,
}

/// The base shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    Flash,
    Tiny,
}

/// Flash's compress ratios: `[0, 0] + [4, 128] × 20 + [4]`.
pub fn flash_ratios() -> Vec<usize> {
    let mut r = vec![0, 0];
    for _ in 0..20 {
        r.extend([4, 128]);
    }
    r.push(4);
    r
}

const FLASH_LAYERS: usize = 43;
const FLASH_HASH_LAYERS: usize = 3;

impl Spec {
    /// Parses `flash[:layers=N][:from=K][:recipe=q2|q4]` or `tiny[...]`.
    pub fn parse(s: &str) -> Result<Spec> {
        let mut parts = s.split(':');
        let base = match parts.next().unwrap_or("") {
            "flash" => Base::Flash,
            "tiny" => Base::Tiny,
            other => bail!("--synthetic {s:?}: unknown model {other:?} (expected flash or tiny)"),
        };
        let mut spec = Spec {
            base,
            layers: match base {
                Base::Flash => FLASH_LAYERS,
                Base::Tiny => 4,
            },
            from: 0,
            recipe: Recipe::Q2,
        };
        for kv in parts {
            let (k, v) = kv.split_once('=').with_context(|| format!("--synthetic {s:?}: {kv:?} is not key=value"))?;
            let num = || v.parse::<usize>().with_context(|| format!("--synthetic {s:?}: {k}={v:?} is not a number"));
            match k {
                "layers" => spec.layers = num()?,
                "from" => spec.from = num()?,
                "recipe" => match v {
                    "q2" => spec.recipe = Recipe::Q2,
                    "q4" => spec.recipe = Recipe::Q4,
                    "q8_0" => spec.recipe = Recipe::Q8_0,
                    "f16" => spec.recipe = Recipe::F16,
                    _ => bail!("--synthetic {s:?}: recipe {v:?} (expected q2, q4, q8_0 or f16)"),
                },
                _ => bail!("--synthetic {s:?}: unknown key {k:?} (layers, from, recipe)"),
            }
        }
        if spec.layers == 0 {
            bail!("--synthetic {s:?}: layers must be at least 1");
        }
        if spec.base == Base::Flash && spec.from + spec.layers > FLASH_LAYERS {
            bail!("--synthetic {s:?}: layers {}..{} exceed Flash's {FLASH_LAYERS}", spec.from, spec.from + spec.layers);
        }
        Ok(spec)
    }

    /// The model's hyperparameters in the official `config.json` form.
    pub fn config_json(&self) -> String {
        let (ratios, hash) = match self.base {
            Base::Flash => {
                let r = flash_ratios()[self.from..self.from + self.layers].to_vec();
                (r, FLASH_HASH_LAYERS.saturating_sub(self.from).min(self.layers))
            }
            Base::Tiny => ((0..self.layers).map(|l| [0, 4, 8][l % 3]).collect(), 1.min(self.layers)),
        };
        let ratios = format!("{ratios:?}");
        match self.base {
            Base::Flash => format!(
                r#"{{"vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": {layers}, "num_attention_heads": 64,
                "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
                "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
                "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": {hash}, "rope_theta": 10000.0,
                "compress_rope_theta": 160000.0, "rope_scaling": {{"type": "yarn", "factor": 16.0,
                "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}},
                "max_position_embeddings": 1048576, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
                "index_topk": 512, "compress_ratios": {ratios}, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06,
                "rms_norm_eps": 1e-06}}"#,
                layers = self.layers
            ),
            Base::Tiny => format!(
                r#"{{"vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": {layers}, "num_attention_heads": 4,
                "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64,
                "moe_intermediate_size": 256, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": {hash}, "rope_theta": 10000.0,
                "compress_rope_theta": 160000.0, "rope_scaling": {{"type": "yarn", "factor": 16.0,
                "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}},
                "max_position_embeddings": 65536, "sliding_window": 16, "index_n_heads": 4, "index_head_dim": 64,
                "index_topk": 8, "compress_ratios": {ratios}, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06,
                "rms_norm_eps": 1e-06}}"#,
                layers = self.layers
            ),
        }
    }

    /// The parsed config.
    pub fn config(&self) -> Result<CheckpointConfig> {
        Ok(CheckpointConfig::from_json_str(&self.config_json())?)
    }
}

/// What [`build`] made.
pub struct Synth {
    pub file: GgufFile,
    /// Bytes of weights one decoded token reads: every tensor, except one embedding row, one `tid2eid` row and
    /// `used / n_experts` of each routed expert tensor.
    pub bytes_per_token: u64,
    /// Bytes of tensor data.
    pub tensor_bytes: u64,
    /// Seconds spent building.
    pub build_secs: f64,
}

/// One tensor to write: declaration plus how it is touched per token.
struct Item {
    decl: TensorDecl,
    class: Class,
    bytes: u64,
    per_token: u64,
}

fn items(spec: &Spec, cfg: &CheckpointConfig) -> Result<Vec<Item>> {
    plan::plan(cfg)
        .into_iter()
        .map(|p| {
            let ty = spec.recipe.type_for(p.class, p.row_len());
            let decl = TensorDecl { name: p.name.clone(), ty, dims: p.dims.clone() };
            let bytes = decl.n_bytes()?;
            let rows = p.dims.iter().skip(1).product::<u64>().max(1);
            let per_token = match p.class {
                Class::RoutedGateUp | Class::RoutedDown => bytes / cfg.n_experts as u64 * cfg.n_experts_used as u64,
                Class::TokenEmbd | Class::Tid2eid => bytes / rows,
                _ => bytes,
            };
            Ok(Item { decl, class: p.class, bytes, per_token })
        })
        .collect()
}

/// The weight bytes one decoded token reads, and the total tensor bytes, without building anything.
pub fn footprint(spec: &Spec) -> Result<(u64, u64)> {
    let cfg = spec.config()?;
    let it = items(spec, &cfg)?;
    Ok((it.iter().map(|i| i.per_token).sum(), it.iter().map(|i| i.bytes).sum()))
}

/// Fills `buf` with this tensor's synthetic values (see the module docs).
fn fill_tensor(item: &Item, cfg: &CheckpointConfig, buf: &mut [u8], seed: u64, threads: usize) {
    let ty = item.decl.ty;
    let row_len = item.decl.dims[0] as f32;
    match item.class {
        Class::Tid2eid => {
            let mut rng = SplitMix64::new(seed);
            let (n, used) = (cfg.n_experts as u64, cfg.n_experts_used);
            for row in buf.chunks_exact_mut(4 * used) {
                let mut ids: Vec<u32> = Vec::with_capacity(used);
                while ids.len() < used {
                    let e = (rng.next_u64() % n) as u32;
                    if !ids.contains(&e) {
                        ids.push(e);
                    }
                }
                for (o, e) in row.chunks_exact_mut(4).zip(ids) {
                    o.copy_from_slice(&(e as i32).to_le_bytes());
                }
            }
        }
        Class::Vector if item.decl.name.contains("norm") => {
            for v in buf.chunks_exact_mut(4) {
                v.copy_from_slice(&1f32.to_le_bytes());
            }
        }
        Class::Vector => blocks::fill(GgmlType::F32, buf, 0.05, &mut SplitMix64::new(seed)),
        _ => blocks::fill_par(ty, buf, 1.0 / row_len.sqrt(), seed, threads),
    }
}

/// Builds the synthetic model in memory and opens it as a [`GgufFile`]. `pb` counts tensor bytes.
pub fn build(spec: &Spec, threads: usize, pb: &ProgressBar) -> Result<Synth> {
    let t0 = Instant::now();
    let (tensor_bytes, n_items) = footprint_items(spec)?;
    let reserve = tensor_bytes + 32 * n_items as u64 + (16 << 20);
    let mut out: Vec<u8> = Vec::new();
    out.try_reserve_exact(reserve as usize)
        .with_context(|| format!("cannot allocate {} MiB for the synthetic model", reserve >> 20))?;
    let (bytes, bytes_per_token) = write_into(spec, threads, pb, out)?;
    let file = GgufFile::from_bytes(bytes)?;
    Ok(Synth { file, bytes_per_token, tensor_bytes, build_secs: t0.elapsed().as_secs_f64() })
}

/// Writes the synthetic model to `path` (streaming: one tensor of memory) and returns its tensor bytes. The file
/// is a complete DS4 GGUF — the converter's metadata keys and tensor layout, a synthetic byte-level tokenizer of
/// the model's vocabulary — so other engines (llama.cpp's `deepseek4`) can load it too.
pub fn write_file(spec: &Spec, threads: usize, pb: &ProgressBar, path: &std::path::Path) -> Result<u64> {
    let f = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let (out, _) = write_into(spec, threads, pb, std::io::BufWriter::with_capacity(8 << 20, f))?;
    let f = out.into_inner().map_err(|e| e.into_error()).with_context(|| format!("writing {}", path.display()))?;
    f.sync_all().with_context(|| format!("writing {}", path.display()))?;
    Ok(footprint_items(spec)?.0)
}

/// Total tensor bytes and tensor count.
fn footprint_items(spec: &Spec) -> Result<(u64, usize)> {
    let it = items(spec, &spec.config()?)?;
    Ok((it.iter().map(|i| i.bytes).sum(), it.len()))
}

/// The GGUF metadata: what `ds4 convert` writes for this config without `--tokenizer`.
fn metadata(spec: &Spec, cfg: &CheckpointConfig) -> Result<Vec<(String, MetaValue)>> {
    let mut meta = cfg.gguf_metadata();
    meta.push(("general.name".into(), MetaValue::String(format!("ds4-bench synthetic {}", spec_name(spec)))));
    meta.push(("general.file_type".into(), MetaValue::U32(spec.recipe.file_type())));
    meta.push(("general.quantization_version".into(), MetaValue::U32(2)));
    meta.extend(synthetic_tokenizer_metadata(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)?);
    Ok(meta)
}

/// Streams the whole file into `out`; returns it and the weight bytes one token reads.
fn write_into<W: std::io::Write>(spec: &Spec, threads: usize, pb: &ProgressBar, out: W) -> Result<(W, u64)> {
    let cfg = spec.config()?;
    let items = items(spec, &cfg)?;
    let meta = metadata(spec, &cfg)?;
    let tensor_bytes: u64 = items.iter().map(|i| i.bytes).sum();
    let bytes_per_token = items.iter().map(|i| i.per_token).sum();
    pb.set_length(tensor_bytes);
    pb.set_message(format!("building synthetic {} ({} MiB)", spec_name(spec), tensor_bytes >> 20));
    let mut w = GgufWriter::new(out, &meta, items.iter().map(|i| i.decl.clone()).collect())?;
    let largest = items.iter().map(|i| i.bytes).max().unwrap_or(0) as usize;
    let mut scratch = vec![0u8; largest];
    for (k, item) in items.iter().enumerate() {
        let buf = &mut scratch[..item.bytes as usize];
        fill_tensor(item, &cfg, buf, 0xd54_0000 + k as u64, threads);
        w.write_tensor(&item.decl.name, buf)?;
        pb.inc(item.bytes);
    }
    Ok((w.finish()?, bytes_per_token))
}

/// A short label, e.g. `flash:layers=2:from=0:recipe=q2`.
pub fn spec_name(spec: &Spec) -> String {
    let base = match spec.base {
        Base::Flash => "flash",
        Base::Tiny => "tiny",
    };
    format!("{base}:layers={}:from={}:recipe={}", spec.layers, spec.from, spec.recipe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let s = Spec::parse("flash:layers=2").unwrap();
        assert_eq!((s.base, s.layers, s.from, s.recipe), (Base::Flash, 2, 0, Recipe::Q2));
        let s = Spec::parse("flash:layers=3:from=3:recipe=q4").unwrap();
        assert_eq!((s.layers, s.from, s.recipe), (3, 3, Recipe::Q4));
        assert_eq!(Spec::parse("flash").unwrap().layers, 43);
        for bad in [
            "",
            "llama",
            "flash:layers",
            "flash:layers=x",
            "flash:layers=0",
            "flash:recipe=q3",
            "flash:from=42:layers=2",
            "flash:bogus=1",
        ] {
            assert!(Spec::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn flash_ratio_list_matches_the_spec() {
        let r = flash_ratios();
        assert_eq!(r.len(), 43);
        assert_eq!(&r[..4], &[0, 0, 4, 128]);
        assert_eq!(r[42], 4);
    }

    #[test]
    fn flash_footprint_is_the_real_one() {
        // Two window layers of the 2-bit recipe: routed experts dominate; the per-token share is 6 of 256.
        let spec = Spec::parse("flash:layers=2").unwrap();
        let (per_token, total) = footprint(&spec).unwrap();
        let experts_per_layer = 2 * 256 * 2048 * (4096 / 256) * 66 + 256 * 4096 * (2048 / 256) * 84;
        assert!(total > 2 * experts_per_layer as u64);
        assert!(total < 6 << 30, "{total}");
        assert!(per_token < total / 2);
        assert!(per_token > 2 * (experts_per_layer as u64 * 6 / 256));
        // The 4-bit recipe is bigger.
        let (_, total4) = footprint(&Spec::parse("flash:layers=2:recipe=q4").unwrap()).unwrap();
        assert!(total4 > total);
    }

    #[test]
    fn tiny_model_builds_and_has_the_converter_layout() {
        let spec = Spec::parse("tiny:layers=3").unwrap();
        let s = build(&spec, 2, &ProgressBar::hidden()).unwrap();
        let f = &s.file;
        assert_eq!(f.get_usize("deepseek4.block_count").unwrap(), 3);
        assert_eq!(f.get_str("general.architecture").unwrap(), "deepseek4");
        // Layer 1 is CSA (ratio 4): compressor and indexer present; layer 0 is window-only.
        assert!(f.tensor("blk.1.indexer.attn_q_b.weight").is_some());
        assert!(f.tensor("blk.0.attn_compressor_kv.weight").is_none());
        assert!(f.tensor("blk.0.ffn_gate_tid2eid.weight").is_some());
        // Norms are ones; tid2eid rows are distinct valid expert ids.
        let norm = f.tensor("output_norm.weight").unwrap();
        assert!(norm.data.chunks_exact(4).all(|c| f32::from_le_bytes(c.try_into().unwrap()) == 1.0));
        let t = f.tensor("blk.0.ffn_gate_tid2eid.weight").unwrap();
        for row in t.data.chunks_exact(8) {
            let a = i32::from_le_bytes(row[..4].try_into().unwrap());
            let b = i32::from_le_bytes(row[4..].try_into().unwrap());
            assert!(a != b && (0..8).contains(&a) && (0..8).contains(&b));
        }
        assert_eq!(s.tensor_bytes, f.tensors().iter().map(|t| t.n_bytes).sum::<u64>());
        assert!(s.bytes_per_token < s.tensor_bytes);
        // A complete file: the synthetic tokenizer of the model's vocabulary.
        let tok = ds4_engine::tokenizer::Tokenizer::from_gguf(f).unwrap();
        assert_eq!(tok.vocab_size(), 1024);
    }

    #[test]
    fn written_file_is_the_in_memory_model() {
        let spec = Spec::parse("tiny:layers=2:recipe=q8_0").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let bytes = write_file(&spec, 2, &ProgressBar::hidden(), &path).unwrap();
        let on_disk = GgufFile::open(&path).unwrap();
        let mem = build(&spec, 2, &ProgressBar::hidden()).unwrap();
        assert_eq!(bytes, mem.tensor_bytes);
        assert_eq!(on_disk.metadata().len(), mem.file.metadata().len());
        assert_eq!(on_disk.tensors().len(), mem.file.tensors().len());
        for t in mem.file.tensors() {
            let a = mem.file.view(t);
            let b = on_disk.tensor(&t.name).unwrap();
            assert!(a.data == b.data, "{} differs", t.name);
        }
        assert!(write_file(&spec, 1, &ProgressBar::hidden(), &dir.path().join("no/such/dir.gguf")).is_err());
    }
}
