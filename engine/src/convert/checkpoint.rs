//! A checkpoint folder's safetensors shards, memory-mapped, with tensors looked up by official name and decoded to
//! f32 (applying FP8/FP4 block scales) or read as integers.
//!
//! Layouts accepted: a sharded folder with `model.safetensors.index.json` (`{"weight_map": {name: file}}`; only the
//! files it names are opened, and every name it lists must be in its file), or else every `*.safetensors` file in the
//! folder. A name present in two shards is an error.
//!
//! ## How the official DeepSeek-V4 release stores weights
//! Established from the reference converter of the C engine (antirez/ds4 `gguf-tools/deepseek4-quantize.c`, which
//! reads the Hugging Face release) and checked against the safetensors dtype list:
//! - Dense FP8 tensors (attention projections, shared experts, ...): weight dtype `F8_E4M3` (`float8_e4m3fn`),
//!   shape `[out, in]`, plus a scale tensor named `<base>.scale` (`<base>` = weight name without `.weight`, e.g.
//!   `layers.0.attn.wq_a.scale`) of dtype `F8_E8M0` (ue8m0: power-of-two exponents) and shape
//!   `[out/128, in/128]`: one scale per 128×128 block. (DeepSeek-V3 used `weight_scale_inv` in F32 with the same
//!   blocks; that name and dtype are accepted too.) Value = e4m3 × scale; the release has no NaN codes in use.
//! - Routed experts `layers.N.ffn.experts.E.w{1,2,3}.weight`: FP4 e2m1 packed two per byte in an `I8` tensor
//!   `[out, in/2]`, element `2i` in the low nibble, with `<base>.scale` `F8_E8M0` `[out, in/32]` (one scale per 32
//!   consecutive inputs of a row).
//! - Everything else BF16 or F32 (norms, HC, router, embedding, head); `ffn.gate.tid2eid` is `I64` `[vocab, top_k]`.
//! - The MTP block lives under `mtp.*` (in the same shards); the main-model conversion ignores it.
//!
//! Decoding here is general: FP8 weights with a scale of shape `[ceil(out/b0), ceil(in/b1)]` (block edges inferred
//! as the powers of two that fit), scale dtypes F32/BF16/F16/E8M0, a single-element scale as a per-tensor scale,
//! FP8 without any scale (scale 1), FP4 in `I8`/`U8` (scale required) or as a safetensors `F4` tensor.
//! Scale companions are looked up as `<base>.scale`, `<name>_scale_inv`, `<name>.scale`.
//!
//! Every tensor and scale read is remembered, so [`Checkpoint::unused`] lists what the conversion ignored. Errors
//! name the file and tensor; no bit pattern or header panics.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use parking_lot::Mutex;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use super::dtypes::Elem;
use crate::{Error, Result};

/// One stored tensor: dtype, stored shape, and where its bytes are.
#[derive(Clone, Debug)]
pub struct StoredTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// An opened checkpoint folder. See the module docs.
pub struct Checkpoint {
    shards: Vec<Shard>,
    tensors: HashMap<String, StoredTensor>,
    used: Mutex<BTreeSet<String>>,
}

fn cerr(msg: String) -> Error {
    Error::Convert(msg)
}

fn open_shard(path: &Path, idx: usize, tensors: &mut HashMap<String, StoredTensor>) -> Result<Shard> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < 8 {
        return Err(cerr(format!("{}: truncated safetensors file ({len} bytes)", path.display())));
    }
    // SAFETY: the file is opened read-only and only read through this map; like every mmap user we rely on no
    // other process truncating the checkpoint while we convert it.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let (n, meta) = SafeTensors::read_metadata(&map)
        .map_err(|e| cerr(format!("{}: corrupt or truncated safetensors file: {e}", path.display())))?;
    let base = 8 + n;
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        let t =
            StoredTensor { dtype: info.dtype, shape: info.shape.clone(), shard: idx, start: base + s, end: base + e };
        if t.end > map.len() || t.start > t.end {
            return Err(cerr(format!("{}: tensor {name} lies outside the file", path.display())));
        }
        if tensors.insert(name.clone(), t).is_some() {
            return Err(cerr(format!("tensor {name} appears in more than one shard (again in {})", path.display())));
        }
    }
    Ok(Shard { path: path.to_path_buf(), map })
}

fn elem_of(dtype: Dtype) -> Option<Elem> {
    Some(match dtype {
        Dtype::F32 => Elem::F32,
        Dtype::F16 => Elem::F16,
        Dtype::BF16 => Elem::Bf16,
        Dtype::F64 => Elem::F64,
        Dtype::F8_E4M3 => Elem::E4m3,
        Dtype::F8_E8M0 => Elem::E8m0,
        Dtype::I8 | Dtype::U8 | Dtype::F4 => Elem::E2m1x2,
        _ => return None,
    })
}

/// The block edge that maps `dim` values onto `blocks` scale entries: the smallest power of two `b` with
/// `ceil(dim / b) == blocks`.
fn block_edge(dim: usize, blocks: usize) -> Option<usize> {
    if blocks == 0 {
        return None;
    }
    (0..usize::BITS).map(|k| 1usize << k).take_while(|&b| b <= dim.max(1) * 2).find(|&b| dim.div_ceil(b) == blocks)
}

impl Checkpoint {
    /// Opens the safetensors of a checkpoint folder (see the module docs for the layouts).
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = Vec::new();
        let mut weight_map: Vec<(String, String)> = Vec::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| cerr(format!("{}: not valid JSON: {e}", index_path.display())))?;
            let wm = v
                .get("weight_map")
                .and_then(|w| w.as_object())
                .ok_or_else(|| cerr(format!("{}: no `weight_map` object", index_path.display())))?;
            let mut seen = BTreeSet::new();
            for (name, file) in wm {
                let file = file
                    .as_str()
                    .ok_or_else(|| cerr(format!("{}: weight_map[{name}] is not a string", index_path.display())))?;
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(cerr(format!(
                        "{}: shard name {file:?} is not a plain file name",
                        index_path.display()
                    )));
                }
                if seen.insert(file.to_string()) {
                    files.push(dir.join(file));
                }
                weight_map.push((name.clone(), file.to_string()));
            }
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for entry in rd {
                let p = entry.map_err(|e| Error::io(dir, e))?.path();
                if p.extension().is_some_and(|x| x == "safetensors") {
                    files.push(p);
                }
            }
            files.sort();
        }
        if files.is_empty() {
            return Err(cerr(format!("{}: no *.safetensors files", dir.display())));
        }
        let mut tensors = HashMap::new();
        let mut shards = Vec::with_capacity(files.len());
        for (i, f) in files.iter().enumerate() {
            shards.push(open_shard(f, i, &mut tensors)?);
        }
        for (name, file) in &weight_map {
            match tensors.get(name) {
                Some(t) if shards[t.shard].path.file_name().is_some_and(|n| n == file.as_str()) => {}
                Some(t) => {
                    return Err(cerr(format!(
                        "index lists tensor {name} in {file}, but it is in {}",
                        shards[t.shard].path.display()
                    )))
                }
                None => return Err(cerr(format!("index lists tensor {name} in {file}, but that file lacks it"))),
            }
        }
        tracing::info!(shards = shards.len(), tensors = tensors.len(), "opened checkpoint {}", dir.display());
        Ok(Checkpoint { shards, tensors, used: Mutex::new(BTreeSet::new()) })
    }

    /// The stored tensor of that name, if any.
    pub fn get(&self, name: &str) -> Option<&StoredTensor> {
        self.tensors.get(name)
    }

    /// Every stored tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// Names never read so far, sorted.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.lock();
        let mut v: Vec<String> = self.tensors.keys().filter(|n| !used.contains(*n)).cloned().collect();
        v.sort();
        v
    }

    fn bytes(&self, t: &StoredTensor) -> &[u8] {
        &self.shards[t.shard].map[t.start..t.end]
    }

    fn stored(&self, name: &str) -> Result<&StoredTensor> {
        self.tensors.get(name).ok_or_else(|| Error::MissingTensor(name.to_string()))
    }

    /// The scale companion of a quantized weight, if stored.
    fn scale_name(&self, name: &str) -> Option<String> {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        [format!("{base}.scale"), format!("{name}_scale_inv"), format!("{name}.scale")]
            .into_iter()
            .find(|c| c != name && self.tensors.contains_key(c))
    }

    /// The tensor's logical shape (packed FP4 in I8/U8 counts two values per byte).
    pub fn logical_shape(&self, name: &str) -> Result<Vec<usize>> {
        let t = self.stored(name)?;
        let mut shape = t.shape.clone();
        if matches!(t.dtype, Dtype::I8 | Dtype::U8) {
            match shape.last_mut() {
                Some(l) => *l *= 2,
                None => return Err(cerr(format!("tensor {name}: packed FP4 tensor with no dimensions"))),
            }
        }
        Ok(shape)
    }

    /// Checks that `name` exists, is decodable, and has the logical shape `expected`.
    pub fn check(&self, name: &str, expected: &[usize]) -> Result<()> {
        let t = self.stored(name)?;
        let got = self.logical_shape(name)?;
        if got != expected {
            return Err(Error::Tensor {
                name: name.into(),
                what: format!("wrong shape: expected {expected:?}, got {got:?} (dtype {:?})", t.dtype),
            });
        }
        if matches!(t.dtype, Dtype::I32 | Dtype::I64) {
            return Ok(());
        }
        if elem_of(t.dtype).is_none() {
            return Err(Error::Tensor { name: name.into(), what: format!("unsupported dtype {:?}", t.dtype) });
        }
        if matches!(t.dtype, Dtype::I8 | Dtype::U8) && self.scale_name(name).is_none() {
            return Err(Error::Tensor {
                name: name.into(),
                what: format!("{:?} tensor (packed FP4) without a scale tensor ({name}_scale_inv / .scale)", t.dtype),
            });
        }
        Ok(())
    }

    /// Reads `name` as f32 values (dequantizing FP8/FP4 with its scale), checking its logical shape first.
    pub fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; expected.iter().product()];
        self.read_f32_into(name, expected, &mut out)?;
        Ok(out)
    }

    /// Like [`Checkpoint::read_f32`], into a caller's buffer of exactly the tensor's element count.
    pub fn read_f32_into(&self, name: &str, expected: &[usize], out: &mut [f32]) -> Result<()> {
        self.check(name, expected)?;
        let t = self.stored(name)?;
        let n: usize = expected.iter().product();
        if out.len() != n {
            return Err(cerr(format!("tensor {name}: buffer of {} values for {n}", out.len())));
        }
        let elem = elem_of(t.dtype)
            .ok_or_else(|| Error::Tensor { name: name.into(), what: format!("cannot read {:?} as floats", t.dtype) })?;
        let bytes = self.bytes(t);
        let need = match elem {
            Elem::E2m1x2 => n.div_ceil(2),
            _ => n * t.dtype.bitsize() / 8,
        };
        if bytes.len() < need {
            return Err(cerr(format!("tensor {name}: {} bytes stored, {need} needed", bytes.len())));
        }
        elem.decode_into(bytes, out);
        self.used.lock().insert(name.to_string());
        if let Some(sname) = self.scale_name(name) {
            if matches!(t.dtype, Dtype::F8_E4M3 | Dtype::I8 | Dtype::U8 | Dtype::F4) {
                self.apply_scale(name, &sname, expected, out)?;
            }
        }
        Ok(())
    }

    fn apply_scale(&self, name: &str, sname: &str, shape: &[usize], out: &mut [f32]) -> Result<()> {
        let st = self.stored(sname)?;
        let sn: usize = st.shape.iter().product();
        let selem = elem_of(st.dtype).filter(|e| !matches!(e, Elem::E2m1x2)).ok_or_else(|| Error::Tensor {
            name: sname.into(),
            what: format!("unsupported scale dtype {:?}", st.dtype),
        })?;
        let mut s = vec![0f32; sn];
        let sbytes = self.bytes(st);
        if sbytes.len() < sn * st.dtype.bitsize() / 8 {
            return Err(cerr(format!("scale {sname}: truncated")));
        }
        selem.decode_into(sbytes, &mut s);
        self.used.lock().insert(sname.to_string());
        if sn == 1 {
            out.iter_mut().for_each(|x| *x *= s[0]);
            return Ok(());
        }
        let (rows, cols) = match shape {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            _ => return Err(cerr(format!("tensor {name}: block scales only for 1-D/2-D tensors, shape {shape:?}"))),
        };
        let (srows, scols) = match st.shape.as_slice() {
            [c] if shape.len() == 1 => (1, *c),
            [r, c] if shape.len() == 2 => (*r, *c),
            _ => (0, 0),
        };
        let (br, bc) = match (block_edge(rows, srows), block_edge(cols, scols)) {
            (Some(br), Some(bc)) => (br, bc),
            _ => {
                return Err(Error::Tensor {
                    name: sname.into(),
                    what: format!("scale shape {:?} does not tile weight {name} of shape {shape:?}", st.shape),
                })
            }
        };
        for (i, row) in out.chunks_mut(cols).enumerate() {
            let srow = &s[(i / br) * scols..(i / br + 1) * scols];
            for (j, x) in row.iter_mut().enumerate() {
                *x *= srow[j / bc];
            }
        }
        Ok(())
    }

    /// Reads an integer tensor (I32 or I64, values must fit i32) of the expected shape.
    pub fn read_i32(&self, name: &str, expected: &[usize]) -> Result<Vec<i32>> {
        let t = self.stored(name)?;
        if t.shape != expected {
            return Err(Error::Tensor {
                name: name.into(),
                what: format!("wrong shape: expected {expected:?}, got {:?}", t.shape),
            });
        }
        let bytes = self.bytes(t);
        let v: Vec<i32> = match t.dtype {
            Dtype::I32 => bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|c| {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(c);
                    i32::try_from(i64::from_le_bytes(a)).unwrap_or(-1)
                })
                .collect(),
            other => {
                return Err(Error::Tensor { name: name.into(), what: format!("expected I32/I64, got dtype {other:?}") })
            }
        };
        if v.len() != expected.iter().product::<usize>() {
            return Err(cerr(format!("tensor {name}: truncated")));
        }
        self.used.lock().insert(name.to_string());
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_edges() {
        assert_eq!(block_edge(4096, 32), Some(128));
        assert_eq!(block_edge(300, 3), Some(128));
        assert_eq!(block_edge(64, 1), Some(64));
        assert_eq!(block_edge(256, 8), Some(32));
        assert_eq!(block_edge(256, 256), Some(1));
        assert_eq!(block_edge(256, 3), None);
        assert_eq!(block_edge(256, 0), None);
    }
}
