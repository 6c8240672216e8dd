//! The converter: an official checkpoint folder (config.json + safetensors, f32/bf16/f16/FP8/FP4) → a DS4 GGUF file
//! in the layout of `shared/spec/gguf-ds4.md`.
//!
//! Entry point: [`convert`] with [`ConvertOptions`] ([`convert_with`] also reports progress to a [`Progress`]: the
//! CLI draws its bar from it; the engine draws nothing). Steps:
//! 1. [`config`]: `config.json` (official key names) → hyperparameters → `deepseek4.*` metadata.
//! 2. [`checkpoint`]: memory-map the shards (index json or all `*.safetensors`), look tensors up by name.
//! 3. [`plan`]: the list of GGUF tensors, their sources and expected official shapes; every source is checked
//!    (present, decodable, right shape) *before* anything is written, so a bad checkpoint fails in seconds.
//! 4. [`recipe`]: each tensor's GGUF type; values are decoded to f32 and re-encoded one tensor at a time, rows
//!    quantized in parallel; routed experts are decoded and encoded in parallel, one expert per worker, straight
//!    into the stacked tensor's bytes. Optional [`imatrix`] importance steers the quantizers. Peak memory ≈ the
//!    largest f32 tensor (Flash: the 2.1 GB embedding/head) plus its encoding, or one encoded expert stack plus one
//!    f32 expert per worker. Tensors are written in plan order (embedding, layers, output).
//! 5. The file is written to `OUTPUT.tmp` and renamed to `OUTPUT` when complete; on error the temp file is removed.
//!
//! Non-finite decoded values are an error naming the tensor (the release has none); tid2eid ids must be
//! `< n_routed_experts`; `--tokenizer` vocabularies must have exactly `vocab_size` tokens.
//!
//! How the official release stores quantized weights (what [`checkpoint`] decodes) is documented there.
//! Without `--tokenizer`, [`synth_tokenizer`] writes a synthetic byte-level tokenizer section of `vocab_size` tokens
//! (tiny models; a vocabulary it cannot fill is refused, asking for `--tokenizer`).
//!
//! Revisions ([`config::Revision`], written as `deepseek4.revision`): an April checkpoint's MTP block `mtp.0.*` (one
//! extra decoder block of compress ratio 0 with learned routing, plus `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`
//! and its own `hc_head_*`; the trunk's embedding and `head.weight` are shared) is converted when the checkpoint has
//! it (`mtp.0.e_proj.weight` present): its tensors are written after the trunk under the names the reference C
//! engine binds (`mtp.0.e_proj.weight`, ..., `mtp.0.hc_head_fn.weight`, and the block as `mtp.0.` + the GGUF suffix
//! a trunk layer has under `blk.N.`: `mtp.0.attn_q_a.weight`, `mtp.0.exp_probs_b.bias`, ...; see [`plan::mtp_plan`]),
//! with the types the recipe gives a trunk layer's tensors of the same class (`e_proj`/`h_proj` as attention
//! projections), and `deepseek4.nextn_predict_layers` = 1 is written. A checkpoint without it converts as before (no
//! `mtp.*` tensors, no `nextn_predict_layers` key). A V4-Flash-0731 checkpoint (config.json has
//! `dspark_*` fields) keeps its DSpark drafter, after the trunk, and `deepseek4.dspark.*` records its config: when
//! the checkpoint has the whole drafter (`mtp.0.main_proj.weight` present) its stages are converted like trunk
//! layers (`mtp.{s}.` + a trunk layer's GGUF suffix, with that layer's types; `main_proj`/`main_norm`, the last
//! stage's `norm` and `hc_head_*`, the Markov and confidence heads; see [`plan::dspark_plan`]); any other `mtp.*`
//! tensor is written under its official name (GGUF dims = official shape reversed; F32 for 1-D tensors and under
//! the f32 recipe, else F16; integer tensors as I32). The trunk ignores them, so a 0731 file runs the same trunk as
//! an April one; [`crate::model::DsparkModel`] loads the drafter.
//! Other checkpoint tensors the plan does not use are listed in the report and logged.
//! [`demo`] builds the small random-weight model that `ds4 run` uses without `-m`.

pub(crate) mod checkpoint;
pub(crate) mod config;
pub mod demo;
pub(crate) mod dtypes;
pub mod imatrix;
pub mod plan;
pub(crate) mod recipe;
pub mod synth_tokenizer;

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use checkpoint::Checkpoint;
pub use config::{CheckpointConfig, DsparkConfig, Revision};
pub use demo::{demo_config, demo_dspark_config, demo_model_gguf, random_model_gguf, trained_demo_gguf};
pub use imatrix::Imatrix;
pub use plan::{Class, Planned, Source};
pub use recipe::Recipe;

use crate::gguf::{GgufWriter, MetaValue, TensorDecl};
use crate::quant::GgmlType;
use crate::{Error, Result};

/// What to convert and how.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// The checkpoint folder (config.json + safetensors).
    pub input: PathBuf,
    /// The GGUF file to write.
    pub output: PathBuf,
    pub recipe: Recipe,
    /// A `tokenizer.json` whose vocabulary and merges go into `tokenizer.ggml.*`.
    pub tokenizer: Option<PathBuf>,
    /// An importance matrix (llama.cpp legacy `.dat`, see [`imatrix`]) for the quantized tensors it covers.
    pub imatrix: Option<PathBuf>,
    /// `general.name`; defaults to the input folder's name.
    pub name: Option<String>,
}

/// Where [`convert_with`] reports how far it is (bytes of tensor data written). Every method has a no-op default.
pub trait Progress {
    /// Before the first tensor: the tensor bytes the file will hold.
    fn start(&self, _total_bytes: u64) {}
    /// The tensor `name` is being converted.
    fn tensor(&self, _name: &str) {}
    /// `bytes` more tensor bytes were written.
    fn advance(&self, _bytes: u64) {}
    /// Everything was written (not called on error).
    fn finish(&self) {}
}

/// The [`Progress`] that reports nothing.
pub struct NoProgress;

impl Progress for NoProgress {}

impl ConvertOptions {
    /// Options with no tokenizer, no importance matrix and the default name.
    pub fn new(input: impl Into<PathBuf>, output: impl Into<PathBuf>, recipe: Recipe) -> Self {
        ConvertOptions {
            input: input.into(),
            output: output.into(),
            recipe,
            tokenizer: None,
            imatrix: None,
            name: None,
        }
    }
}

/// What a conversion produced.
#[derive(Clone, Debug, Default)]
pub struct ConvertReport {
    /// Tensors written.
    pub n_tensors: usize,
    /// Size of the output file in bytes.
    pub file_bytes: u64,
    /// Per GGUF type: tensor count and data bytes.
    pub by_type: BTreeMap<String, (usize, u64)>,
    /// Checkpoint tensors that were not used (e.g. `mtp.*`).
    pub unused: Vec<String>,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Converts a checkpoint folder to a DS4 GGUF file. See the module docs.
pub fn convert(opts: &ConvertOptions) -> Result<ConvertReport> {
    convert_with(opts, &NoProgress)
}

/// [`convert`], reporting progress to `progress`.
pub fn convert_with(opts: &ConvertOptions, progress: &dyn Progress) -> Result<ConvertReport> {
    let tmp = tmp_path(&opts.output);
    let r = convert_to(opts, &tmp, progress);
    match r {
        Ok(mut report) => {
            std::fs::rename(&tmp, &opts.output).map_err(|e| Error::io(&opts.output, e))?;
            report.file_bytes = std::fs::metadata(&opts.output).map_err(|e| Error::io(&opts.output, e))?.len();
            tracing::info!(
                tensors = report.n_tensors,
                bytes = report.file_bytes,
                seconds = report.seconds,
                "wrote {}",
                opts.output.display()
            );
            Ok(report)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn tmp_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Reads `DIR/config.json`.
pub fn read_config(dir: &Path) -> Result<CheckpointConfig> {
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
    CheckpointConfig::from_json_str(&text).map_err(|e| Error::Convert(format!("{}: {e}", p.display())))
}

/// The GGUF metadata for a conversion: config keys, `general.*`, and tokenizer keys if a tokenizer is given.
pub fn build_metadata(cfg: &CheckpointConfig, opts: &ConvertOptions) -> Result<Vec<(String, MetaValue)>> {
    let mut meta = cfg.gguf_metadata();
    let name = opts.name.clone().unwrap_or_else(|| {
        opts.input
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "DeepSeek-V4".into())
    });
    meta.push(("general.name".into(), MetaValue::String(name)));
    meta.push(("general.file_type".into(), MetaValue::U32(opts.recipe.file_type())));
    meta.push(("general.quantization_version".into(), MetaValue::U32(2)));
    if let Some(tok) = &opts.tokenizer {
        let tmeta = crate::tokenizer::gguf_metadata_from_tokenizer_json(tok)?;
        let n_tokens = tmeta
            .iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
            .and_then(|(_, v)| v.as_array())
            .map_or(0, |a| a.len());
        if n_tokens != cfg.vocab_size {
            return Err(Error::Convert(format!(
                "{}: {n_tokens} tokens, but config.json vocab_size is {}",
                tok.display(),
                cfg.vocab_size
            )));
        }
        meta.extend(tmeta);
    } else {
        meta.extend(synth_tokenizer::synthetic_tokenizer_metadata(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)?);
    }
    Ok(meta)
}

/// Checks that every source of the plan is present, decodable and of the expected shape.
pub fn check_plan(ckpt: &Checkpoint, plan: &[Planned]) -> Result<()> {
    for t in plan {
        for n in t.source.names() {
            ckpt.check(n, &t.src_shape)?;
        }
    }
    Ok(())
}

/// The bytes of one planned tensor in its declared type.
fn tensor_bytes(
    ckpt: &Checkpoint,
    cfg: &CheckpointConfig,
    t: &Planned,
    decl: &TensorDecl,
    im: Option<&Imatrix>,
) -> Result<Vec<u8>> {
    let row = t.row_len() as usize;
    match &t.source {
        Source::One(n) if t.class == Class::Tid2eid => {
            let v = ckpt.read_i32(n, &t.src_shape)?;
            if let Some(bad) = v.iter().find(|&&e| e < 0 || e as usize >= cfg.n_experts) {
                return Err(Error::Tensor {
                    name: n.clone(),
                    what: format!("expert id {bad} out of range (n_routed_experts {})", cfg.n_experts),
                });
            }
            Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        Source::One(n) => {
            let f = ckpt.read_f32(n, &t.src_shape)?;
            check_finite(&f, n)?;
            let imp = importance(im, decl.ty, &[&t.name, n], row, None, 0)?;
            let mut out = vec![0u8; recipe::encoded_len(decl.ty, f.len(), row)?];
            recipe::encode_into(decl.ty, &f, row, imp, &mut out, true)
                .map_err(|e| Error::Tensor { name: n.clone(), what: e.to_string() })?;
            Ok(out)
        }
        Source::Experts(names) => expert_stack_bytes(ckpt, t, decl, names, im),
    }
}

/// The stacked experts of one tensor: experts are decoded and encoded in parallel, one expert per worker at a time,
/// each into its own slice of the output (memory: the encoded stack plus one f32 expert per worker).
fn expert_stack_bytes(
    ckpt: &Checkpoint,
    t: &Planned,
    decl: &TensorDecl,
    names: &[String],
    im: Option<&Imatrix>,
) -> Result<Vec<u8>> {
    let row = t.row_len() as usize;
    let n_values: usize = t.src_shape.iter().product();
    let per = recipe::encoded_len(decl.ty, n_values, row)?;
    let mut out = vec![0u8; per * names.len()];
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(names.len()).max(1);
    // Work queue: (expert name, its slice of the output); each worker takes the next one.
    let queue = parking_lot::Mutex::new(names.iter().zip(out.chunks_mut(per)).enumerate());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let mut buf = vec![0f32; n_values];
                    loop {
                        let Some((e, (name, dst))) = queue.lock().next() else { return Ok(()) };
                        ckpt.read_f32_into(name, &t.src_shape, &mut buf)?;
                        check_finite(&buf, name)?;
                        let imp = importance(im, decl.ty, &[&t.name, name], row, Some(e), names.len())?;
                        recipe::encode_into(decl.ty, &buf, row, imp, dst, false)
                            .map_err(|err| Error::Tensor { name: name.clone(), what: err.to_string() })?;
                    }
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| Err(Error::Convert(format!("{}: expert worker panicked", t.name))))
        })
    })?;
    Ok(out)
}

/// Whether an (April) checkpoint holds the MTP block `mtp.0.*` (its `e_proj`, the block's first tensor).
fn has_mtp_block(ckpt: &Checkpoint) -> bool {
    ckpt.get(&format!("{}e_proj.weight", plan::MTP_PREFIX)).is_some()
}

/// One drafter tensor of a 0731 checkpoint, copied under its official name.
struct DrafterTensor {
    /// Official (logical, decoded) shape.
    shape: Vec<usize>,
    int: bool,
    decl: TensorDecl,
}

/// Whether `name` is the block-scale companion of another stored tensor (read together with it, not on its own).
fn is_scale_companion(ckpt: &Checkpoint, name: &str) -> bool {
    let base = name.strip_suffix(".scale").or_else(|| name.strip_suffix("_scale_inv"));
    base.is_some_and(|b| ckpt.get(&format!("{b}.weight")).is_some() || ckpt.get(b).is_some())
}

/// The drafter tensors (`mtp.*`) of a 0731 checkpoint that the plan does not convert (`planned`: the official names
/// it reads), in name order. See the module docs for names and types.
fn drafter_plan(ckpt: &Checkpoint, recipe: Recipe, planned: &HashSet<&str>) -> Result<Vec<DrafterTensor>> {
    use safetensors::tensor::Dtype;
    let mut names: Vec<&str> = ckpt.names().filter(|n| n.starts_with("mtp.") && !planned.contains(n)).collect();
    names.sort_unstable();
    let mut out = Vec::new();
    for name in names {
        if is_scale_companion(ckpt, name) {
            continue;
        }
        let stored = ckpt.get(name).ok_or_else(|| Error::MissingTensor(name.into()))?;
        let int = matches!(stored.dtype, Dtype::I64 | Dtype::I32);
        let shape = if int { stored.shape.clone() } else { ckpt.logical_shape(name)? };
        if shape.is_empty() || shape.contains(&0) {
            return Err(Error::Tensor { name: name.into(), what: format!("drafter tensor has shape {shape:?}") });
        }
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let ty = if int {
            GgmlType::I32
        } else if dims.len() == 1 || recipe == Recipe::F32 {
            GgmlType::F32
        } else {
            GgmlType::F16
        };
        out.push(DrafterTensor { shape, int, decl: TensorDecl { name: name.into(), ty, dims } });
    }
    Ok(out)
}

fn drafter_bytes(ckpt: &Checkpoint, d: &DrafterTensor) -> Result<Vec<u8>> {
    let name = &d.decl.name;
    if d.int {
        let v = ckpt.read_i32(name, &d.shape)?;
        return Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    let f = ckpt.read_f32(name, &d.shape)?;
    check_finite(&f, name)?;
    let row = d.decl.dims[0] as usize;
    let mut out = vec![0u8; recipe::encoded_len(d.decl.ty, f.len(), row)?];
    recipe::encode_into(d.decl.ty, &f, row, None, &mut out, true)
        .map_err(|e| Error::Tensor { name: name.clone(), what: e.to_string() })?;
    Ok(out)
}

fn check_finite(values: &[f32], name: &str) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::Tensor { name: name.into(), what: format!("non-finite value {} at {i}", values[i]) }),
    }
}

/// The imatrix vector for a quantized tensor (F32/F16 targets ignore importance).
fn importance<'a>(
    im: Option<&'a Imatrix>,
    ty: GgmlType,
    names: &[&str],
    row: usize,
    expert: Option<usize>,
    n_experts: usize,
) -> Result<Option<&'a [f32]>> {
    match im {
        Some(im) if !matches!(ty, GgmlType::F32 | GgmlType::F16) => im.find(names, row, expert, n_experts),
        _ => Ok(None),
    }
}

fn convert_to(opts: &ConvertOptions, tmp: &Path, progress: &dyn Progress) -> Result<ConvertReport> {
    let t0 = Instant::now();
    let cfg = read_config(&opts.input)?;
    let ckpt = Checkpoint::open(&opts.input)?;
    let mut plan = plan::plan(&cfg);
    let mtp = cfg.revision == config::Revision::April && has_mtp_block(&ckpt);
    if mtp {
        plan.extend(plan::mtp_plan(&cfg));
    } else if cfg.revision == config::Revision::April && cfg.n_nextn_layers > 0 {
        tracing::info!(
            "config.json declares {} MTP layer(s), the checkpoint has no mtp.0.*: trunk only",
            cfg.n_nextn_layers
        );
    }
    // A 0731 checkpoint with a whole DSpark drafter (its first stage's `main_proj`): its stages are converted like
    // the trunk (names and types of the recipe); any other `mtp.*` tensor is kept under its official name.
    let dspark = match &cfg.dspark {
        Some(ds) if cfg.revision == config::Revision::V0731 && ckpt.get("mtp.0.main_proj.weight").is_some() => {
            plan.extend(plan::dspark_plan(&cfg, ds.target_layer_ids.len(), ds.markov_rank as usize));
            true
        }
        _ => false,
    };
    check_plan(&ckpt, &plan)?;
    let mut decls: Vec<TensorDecl> = plan
        .iter()
        .map(|t| TensorDecl {
            name: t.name.clone(),
            ty: opts.recipe.type_for(t.class, t.row_len()),
            dims: t.dims.clone(),
        })
        .collect();
    let planned: HashSet<&str> = plan.iter().flat_map(|t| t.source.names()).collect();
    let drafter =
        if cfg.revision == config::Revision::V0731 { drafter_plan(&ckpt, opts.recipe, &planned)? } else { Vec::new() };
    decls.extend(drafter.iter().map(|d| d.decl.clone()));
    let mut meta = build_metadata(&cfg, opts)?;
    if mtp {
        meta.push(("deepseek4.nextn_predict_layers".into(), MetaValue::U32(1)));
    }
    if dspark {
        tracing::info!("DSpark drafter: stages converted with the recipe");
    }
    let im = match &opts.imatrix {
        Some(p) => {
            let im = Imatrix::load(p)?;
            meta.push(("quantize.imatrix.file".into(), MetaValue::String(p.display().to_string())));
            meta.push(("quantize.imatrix.entries_count".into(), MetaValue::U64(im.len() as u64)));
            if let Some(ds) = &im.dataset {
                meta.push(("quantize.imatrix.dataset".into(), MetaValue::String(ds.clone())));
            }
            if let Some(n) = im.chunks {
                meta.push(("quantize.imatrix.chunks_count".into(), MetaValue::U64(n as u64)));
            }
            Some(im)
        }
        None => None,
    };
    let total: u64 = decls.iter().map(|d| d.n_bytes()).sum::<Result<u64>>()?;
    tracing::info!(
        recipe = %opts.recipe,
        tensors = decls.len(),
        bytes = total,
        "converting {} -> {}",
        opts.input.display(),
        opts.output.display()
    );
    let file = File::create(tmp).map_err(|e| Error::io(tmp, e))?;
    let mut w = GgufWriter::new(BufWriter::with_capacity(8 << 20, file), &meta, decls.clone())?;
    progress.start(total);
    let mut report = ConvertReport::default();
    for (t, decl) in plan.iter().zip(&decls) {
        progress.tensor(&t.name);
        let bytes = tensor_bytes(&ckpt, &cfg, t, decl, im.as_ref())?;
        w.write_tensor(&decl.name, &bytes)?;
        tracing::debug!(name = %decl.name, ty = %decl.ty, dims = ?decl.dims, "wrote tensor");
        let e = report.by_type.entry(decl.ty.name().to_string()).or_default();
        e.0 += 1;
        e.1 += bytes.len() as u64;
        progress.advance(bytes.len() as u64);
    }
    for d in &drafter {
        progress.tensor(&d.decl.name);
        let bytes = drafter_bytes(&ckpt, d)?;
        w.write_tensor(&d.decl.name, &bytes)?;
        let e = report.by_type.entry(d.decl.ty.name().to_string()).or_default();
        e.0 += 1;
        e.1 += bytes.len() as u64;
        progress.advance(bytes.len() as u64);
    }
    let buf = w.finish()?;
    let file = buf.into_inner().map_err(|e| Error::io(tmp, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(tmp, e))?;
    progress.finish();
    report.n_tensors = decls.len();
    report.unused = ckpt.unused();
    if !report.unused.is_empty() {
        let shown: Vec<&str> = report.unused.iter().take(5).map(|s| s.as_str()).collect();
        tracing::warn!(count = report.unused.len(), first = ?shown, "checkpoint tensors not used by the DS4 layout");
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}
