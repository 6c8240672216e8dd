//! The validating GGUF reader.
//!
//! Files are memory-mapped read-only. Loaders that run the model call [`GgufFile::prefault`]: a file that fits
//! comfortably in memory (at most half of what the OS reports available) is then pre-faulted ([`prefault`]:
//! `MADV_POPULATE_READ` on Linux, 1 GiB at a time, a `tracing` line per GiB), so the first requests do not pay the
//! page faults of first touching the weights (a 512-token prefill touches nearly every routed expert); larger files
//! are faulted in on use as before. `DS4_MMAP_POPULATE=0` turns pre-faulting off. It changes no byte the engine reads.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::metadata::{MetaValue, ValueType};
use super::{DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::quant::GgmlType;
use crate::{Error, Result};

/// Nesting limit for arrays of arrays (GGUF allows them; real files never nest).
const MAX_ARRAY_DEPTH: usize = 2;

/// Bytes pre-faulted per `madvise` call (one progress line each).
const PREFAULT_STEP: usize = 1 << 30;

/// Pre-faults `map` when it fits in memory (see the module docs). Best effort: a kernel without
/// `MADV_POPULATE_READ` (before Linux 5.14) or a failed read leaves the pages to be faulted on use.
fn prefault(map: &memmap2::Mmap, path: &Path) {
    #[cfg(target_os = "linux")]
    {
        if std::env::var("DS4_MMAP_POPULATE").is_ok_and(|v| v == "0") {
            return;
        }
        let len = map.len();
        let Some(avail) = mem_available() else { return };
        if len as u64 > avail / 2 {
            tracing::info!(path = %path.display(), bytes = len, available = avail, "model larger than half the available memory: pages faulted in on use");
            return;
        }
        let mut off = 0;
        while off < len {
            let n = PREFAULT_STEP.min(len - off);
            if map.advise_range(memmap2::Advice::PopulateRead, off, n).is_err() {
                return;
            }
            off += n;
            if len >= PREFAULT_STEP {
                tracing::info!(path = %path.display(), done = off, total = len, "model pages pre-faulted");
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (map, path);
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
#[cfg(target_os = "linux")]
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Where a file's bytes live (shared by [`GgufFile::share`]d handles).
#[derive(Clone)]
enum Backing {
    Mmap(std::sync::Arc<memmap2::Mmap>),
    Owned(std::sync::Arc<Vec<u8>>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One tensor's entry in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q_a.weight`.
    pub name: String,
    /// Storage type.
    pub ty: GgmlType,
    /// Dimensions, innermost first (GGUF order).
    pub dims: Vec<u64>,
    /// Offset of the data, relative to the start of the data region.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of values.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Number of rows (all dims but the first multiplied).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Values per row (`dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }
}

/// A tensor's entry plus its bytes, borrowed from the file.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}

/// An open GGUF file. Tensor data stays in the memory mapping; see the module docs for the guarantees.
pub struct GgufFile {
    path: Option<PathBuf>,
    backing: Backing,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A bounds-checked cursor over the header bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> std::result::Result<&'a [u8], String> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if n > remaining {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {} but only {remaining} remain",
                self.pos
            ));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
    fn u8(&mut self, what: &str) -> std::result::Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> std::result::Result<u16, String> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} at offset {} is not valid UTF-8", self.pos))
    }

    fn value(&mut self, ty: ValueType, what: &str, depth: usize) -> std::result::Result<MetaValue, String> {
        Ok(match ty {
            ValueType::U8 => MetaValue::U8(self.u8(what)?),
            ValueType::I8 => MetaValue::I8(self.u8(what)? as i8),
            ValueType::U16 => MetaValue::U16(self.u16(what)?),
            ValueType::I16 => MetaValue::I16(self.u16(what)? as i16),
            ValueType::U32 => MetaValue::U32(self.u32(what)?),
            ValueType::I32 => MetaValue::I32(self.u32(what)? as i32),
            ValueType::F32 => MetaValue::F32(f32::from_bits(self.u32(what)?)),
            ValueType::Bool => match self.u8(what)? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(format!("{what}: bool byte {b} is neither 0 nor 1")),
            },
            ValueType::String => MetaValue::String(self.string(what)?),
            ValueType::U64 => MetaValue::U64(self.u64(what)?),
            ValueType::I64 => MetaValue::I64(self.u64(what)? as i64),
            ValueType::F64 => MetaValue::F64(f64::from_bits(self.u64(what)?)),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"));
                }
                let ety_id = self.u32(what)?;
                let ety =
                    ValueType::from_id(ety_id).ok_or_else(|| format!("{what}: unknown array element type {ety_id}"))?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the remaining bytes is corrupt, and
                // checking it first keeps a hostile count from reserving memory.
                if n > self.remaining() {
                    return Err(format!(
                        "{what}: array of {n} elements cannot fit in the {} bytes left",
                        self.remaining()
                    ));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(ety, what, depth + 1)?);
                }
                MetaValue::Array(ety, items)
            }
        })
    }
}

impl GgufFile {
    /// Memory-maps and validates a file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only and we never hand out references that outlive `self`. Another process
        // truncating the file while it is mapped would be undefined behaviour, as with every mmap-based model
        // loader; model files are treated as immutable while in use.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(Backing::Mmap(std::sync::Arc::new(mmap)), Some(path.to_path_buf()))
    }

    /// Pre-faults the mapping where the file fits in memory (see the module docs; a no-op for a file held in memory).
    /// For loaders that are about to run the model, not for tools that read the metadata.
    pub fn prefault(&self) {
        if let (Backing::Mmap(m), Some(path)) = (&self.backing, &self.path) {
            prefault(m, path);
        }
    }

    /// A second handle on the same bytes (the mapping or the buffer is shared, not copied; the parsed metadata is
    /// copied): a model made of some of the file's tensors (the MTP drafter) keeps the file alive on its own.
    pub fn share(&self) -> GgufFile {
        GgufFile {
            path: self.path.clone(),
            backing: self.backing.clone(),
            version: self.version,
            alignment: self.alignment,
            data_offset: self.data_offset,
            metadata: self.metadata.clone(),
            meta_index: self.meta_index.clone(),
            tensors: self.tensors.clone(),
            tensor_index: self.tensor_index.clone(),
        }
    }

    /// Parses and validates a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Backing::Owned(std::sync::Arc::new(bytes)), None)
    }

    fn parse(backing: Backing, path: Option<PathBuf>) -> Result<Self> {
        let err = |what: String| Error::Gguf { path: path.clone(), what };
        let buf = backing.bytes();
        let mut c = Cursor { buf, pos: 0 };
        let magic = c.take(4, "magic").map_err(err)?;
        if magic != MAGIC {
            return Err(err(format!("bad magic {magic:02x?}, expected \"GGUF\"")));
        }
        let version = c.u32("version").map_err(err)?;
        if !(2..=3).contains(&version) {
            return Err(err(format!("unsupported GGUF version {version} (2 and 3 are supported)")));
        }
        let n_tensors = c.u64("tensor count").map_err(err)?;
        let n_kv = c.u64("metadata count").map_err(err)?;
        // A key/value takes at least 8 (key len) + 4 (type) + 1 bytes; a tensor info at least 8 + 4 + 4 + 8.
        if n_kv > c.remaining() / 13 {
            return Err(err(format!("metadata count {n_kv} cannot fit in a file of {} bytes", buf.len())));
        }
        if n_tensors > c.remaining() / 24 {
            return Err(err(format!("tensor count {n_tensors} cannot fit in a file of {} bytes", buf.len())));
        }

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}")).map_err(err)?;
            let ty_id = c.u32(&format!("type of {key}")).map_err(err)?;
            let ty = ValueType::from_id(ty_id).ok_or_else(|| err(format!("{key}: unknown value type {ty_id}")))?;
            let value = c.value(ty, &key, 0).map_err(err)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(err(format!("duplicate metadata key {key}")));
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_int().ok_or_else(|| err("general.alignment is not an integer".into()))?;
                if a <= 0 || a > (1 << 20) || (a & (a - 1)) != 0 {
                    return Err(err(format!("general.alignment {a} is not a power of two in 1..=1048576")));
                }
                a as u64
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}")).map_err(err)?;
            let n_dims = c.u32(&format!("{name}: dim count")).map_err(err)? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(err(format!("{name}: {n_dims} dims (1..={MAX_DIMS} allowed)")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&format!("{name}: dims")).map_err(err)?);
            }
            let ty_id = c.u32(&format!("{name}: type")).map_err(err)?;
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| err(format!("{name}: unknown tensor type {ty_id}")))?;
            let offset = c.u64(&format!("{name}: offset")).map_err(err)?;
            if dims.contains(&0) {
                return Err(err(format!("{name}: zero-sized dim in {dims:?}")));
            }
            let n_rows = dims[1..]
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| err(format!("{name}: dims {dims:?} overflow")))?;
            let row_bytes = ty.row_bytes(dims[0]).ok_or_else(|| {
                err(format!(
                    "{name}: row length {} is not a multiple of the {ty} block size {}",
                    dims[0],
                    ty.block_values()
                ))
            })?;
            let n_bytes =
                row_bytes.checked_mul(n_rows).ok_or_else(|| err(format!("{name}: size of dims {dims:?} overflows")))?;
            if offset % alignment != 0 {
                return Err(err(format!("{name}: offset {offset} is not aligned to {alignment}")));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(err(format!("duplicate tensor name {name}")));
            }
            tensors.push(TensorInfo { name, ty, dims, offset, n_bytes });
        }

        let header_end = c.pos as u64;
        let data_offset = header_end.div_ceil(alignment) * alignment;
        let file_len = buf.len() as u64;
        if data_offset > file_len && !tensors.is_empty() {
            return Err(err(format!("truncated: data region starts at {data_offset} past the end ({file_len})")));
        }
        let data_len = file_len.saturating_sub(data_offset);
        // Every tensor lies inside the data region, and no two overlap.
        let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            let end = t.offset.checked_add(t.n_bytes).filter(|&e| e <= data_len).ok_or_else(|| {
                err(format!(
                    "truncated: tensor {} needs bytes {}..{} of a data region of {data_len} bytes",
                    t.name,
                    t.offset,
                    t.offset.saturating_add(t.n_bytes)
                ))
            })?;
            spans.push((t.offset, end, i));
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(err(format!("tensors {} and {} overlap", tensors[w[0].2].name, tensors[w[1].2].name)));
            }
        }

        Ok(GgufFile { path, backing, version, alignment, data_offset, metadata, meta_index, tensors, tensor_index })
    }

    /// The file's path, when it was opened from disk.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// Data alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Absolute offset of the tensor data region.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
    /// Total file size in bytes.
    pub fn file_size(&self) -> u64 {
        self.backing.bytes().len() as u64
    }
    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }
    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    /// The position of tensor `name` in [`tensors`](Self::tensors).
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensor_index.get(name).copied()
    }
    /// A tensor's info by name.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    /// One tensor, with its bytes (validated at open, so the slice is always in bounds).
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = self.tensor_info(name)?;
        Some(self.view(info))
    }
    /// The bytes of a tensor info that belongs to this file.
    pub fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        let start = (self.data_offset + info.offset) as usize;
        TensorView { info, data: &self.backing.bytes()[start..start + info.n_bytes as usize] }
    }

    fn meta_err(&self, what: String) -> Error {
        Error::Metadata(match &self.path {
            Some(p) => format!("{}: {what}", p.display()),
            None => what,
        })
    }

    /// A required unsigned integer (any integer type, non-negative, fitting in u64).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.get(key).ok_or_else(|| self.meta_err(format!("missing key {key}")))?;
        let i = v.as_int().ok_or_else(|| self.meta_err(format!("{key} is not an integer ({v})")))?;
        u64::try_from(i).map_err(|_| self.meta_err(format!("{key} = {i} is out of range")))
    }
    /// A required integer that fits in usize.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get_u64(key)?;
        usize::try_from(v).map_err(|_| self.meta_err(format!("{key} = {v} is too large")))
    }
    /// A required float (any numeric type).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.get(key).ok_or_else(|| self.meta_err(format!("missing key {key}")))?;
        v.as_f64().ok_or_else(|| self.meta_err(format!("{key} is not a number ({v})")))
    }
    /// A required string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.get(key).ok_or_else(|| self.meta_err(format!("missing key {key}")))?;
        v.as_str().ok_or_else(|| self.meta_err(format!("{key} is not a string ({v})")))
    }
    /// A required bool (or integer 0/1).
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.get(key) {
            Some(MetaValue::Bool(b)) => Ok(*b),
            Some(v) => match v.as_int() {
                Some(0) => Ok(false),
                Some(1) => Ok(true),
                _ => Err(self.meta_err(format!("{key} is not a bool ({v})"))),
            },
            None => Err(self.meta_err(format!("missing key {key}"))),
        }
    }
    /// A required array of integers.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>> {
        let v = self.get(key).ok_or_else(|| self.meta_err(format!("missing key {key}")))?;
        let items = v.as_array().ok_or_else(|| self.meta_err(format!("{key} is not an array")))?;
        items
            .iter()
            .map(|x| {
                x.as_int()
                    .and_then(|i| i64::try_from(i).ok())
                    .ok_or_else(|| self.meta_err(format!("{key} holds a non-integer element {x}")))
            })
            .collect()
    }
    /// A required array of numbers as f64.
    pub fn get_float_array(&self, key: &str) -> Result<Vec<f64>> {
        let v = self.get(key).ok_or_else(|| self.meta_err(format!("missing key {key}")))?;
        let items = v.as_array().ok_or_else(|| self.meta_err(format!("{key} is not an array")))?;
        items
            .iter()
            .map(|x| x.as_f64().ok_or_else(|| self.meta_err(format!("{key} holds a non-numeric element {x}"))))
            .collect()
    }
    /// A required array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.get(key).ok_or_else(|| self.meta_err(format!("missing key {key}")))?;
        let items = v.as_array().ok_or_else(|| self.meta_err(format!("{key} is not an array")))?;
        items
            .iter()
            .map(|x| x.as_str().ok_or_else(|| self.meta_err(format!("{key} holds a non-string element {x}"))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    /// The resident bytes of this process's mapping that starts at `addr` (`Rss` in `/proc/self/smaps`).
    #[cfg(target_os = "linux")]
    fn mapped_rss(addr: *const u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{:x}-", addr as usize);
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
        assert!(lines.next().is_some(), "mapping {head} not in /proc/self/smaps");
        let rss = lines.find_map(|l| l.strip_prefix("Rss:")).expect("Rss line");
        rss.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
    }

    /// Pre-faulting maps the file's pages into this process (resident before the first touch) and changes nothing:
    /// the mapping holds the file's bytes.
    #[cfg(target_os = "linux")]
    #[test]
    fn prefault_maps_the_pages_in_and_leaves_the_bytes_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.bin");
        let bytes: Vec<u8> = (0..64 * 4096 + 17).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        assert!(super::mem_available().is_some_and(|m| m > 0), "/proc/meminfo has MemAvailable");
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a private temporary file nobody else writes while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        // Nothing touched yet: the file is in the page cache but not in this process's page tables.
        let before = mapped_rss(map.as_ptr());
        assert!(before < bytes.len() as u64 / 2, "{before} bytes resident before pre-faulting");
        super::prefault(&map, &path);
        let after = mapped_rss(map.as_ptr());
        assert!(after >= 64 * 4096, "{after} bytes resident after pre-faulting {} bytes", bytes.len());
        assert_eq!(&map[..], &bytes[..]);
    }
}
