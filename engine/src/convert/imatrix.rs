//! Importance matrices (`--imatrix`) in llama.cpp's legacy binary `.dat` format, as `ds4 --imatrix-out` of the
//! reference C engine writes them:
//!
//! ```text
//! i32 n_entries
//! n_entries × { i32 name_len, name bytes, i32 n_calls, i32 n_values, f32 values[n_values] }
//! optional: i32 n_chunks, i32 dataset_len, dataset bytes
//! ```
//!
//! Values are sums over `n_calls`; they are divided by `n_calls` (when > 0) on load. Every value must be finite
//! and non-negative. Lookup ([`Imatrix::find`]) tries, for a routed-expert tensor, the per-expert names
//! `<name>.expert.<e>` and `<name>.expert_<e>` first, then the plain name, for each candidate name (the GGUF name,
//! then the official one). A plain entry of `n_cols` values applies to every row; one of `n_cols × n_experts`
//! values holds one vector per expert (the C engine's packed layout). Any other size is an error.

use std::collections::HashMap;
use std::path::Path;

use crate::{Error, Result};

/// A loaded importance matrix: one vector per tensor name.
#[derive(Clone, Debug, Default)]
pub struct Imatrix {
    entries: HashMap<String, Vec<f32>>,
    /// The optional trailer: chunk count and dataset name (written as `quantize.imatrix.chunks_count` /
    /// `quantize.imatrix.dataset`, as the shipped files carry them).
    pub chunks: Option<u32>,
    pub dataset: Option<String>,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| Error::Convert(format!("imatrix: truncated while reading {what}")))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn i32(&mut self, what: &str) -> Result<i32> {
        let s = self.take(4, what)?;
        Ok(i32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
}

impl Imatrix {
    /// Reads a `.dat` file.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&bytes).map_err(|e| Error::Convert(format!("{}: {e}", path.display())))
    }

    /// Parses the bytes of a `.dat` file.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut c = Cursor { b: bytes, at: 0 };
        let n = c.i32("entry count")?;
        if n < 1 {
            return Err(Error::Convert(format!("imatrix: {n} entries")));
        }
        let mut entries = HashMap::new();
        for i in 0..n {
            let len = c.i32("name length")?;
            if !(1..=4096).contains(&len) {
                return Err(Error::Convert(format!("imatrix: entry {i}: bad name length {len}")));
            }
            let name = String::from_utf8(c.take(len as usize, "name")?.to_vec())
                .map_err(|_| Error::Convert(format!("imatrix: entry {i}: name is not UTF-8")))?;
            let calls = c.i32("call count")?;
            let nval = c.i32("value count")?;
            if nval < 1 {
                return Err(Error::Convert(format!("imatrix: {name}: {nval} values")));
            }
            let raw = c.take(nval as usize * 4, "values")?;
            let mut v: Vec<f32> = raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if calls > 0 {
                v.iter_mut().for_each(|x| *x /= calls as f32);
            }
            if let Some(j) = v.iter().position(|x| !(x.is_finite() && *x >= 0.0)) {
                return Err(Error::Convert(format!("imatrix: {name}[{j}] = {} is not a finite weight ≥ 0", v[j])));
            }
            entries.insert(name, v);
        }
        // Optional trailer; anything malformed there is ignored (it carries no weights).
        let (mut chunks, mut dataset) = (None, None);
        if let Ok(nc) = c.i32("chunk count") {
            chunks = u32::try_from(nc).ok();
            if let Ok(len) = c.i32("dataset length") {
                if (1..=4096).contains(&len) {
                    dataset = c.take(len as usize, "dataset").ok().and_then(|b| String::from_utf8(b.to_vec()).ok());
                }
            }
        }
        tracing::info!(entries = entries.len(), "loaded imatrix");
        Ok(Imatrix { entries, chunks, dataset })
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The importance vector (`n_cols` values) for a tensor known under `names`, for routed expert `expert` of
    /// `n_experts` (or a plain tensor when `expert` is `None`). `Ok(None)` when no entry matches.
    pub fn find(
        &self,
        names: &[&str],
        n_cols: usize,
        expert: Option<usize>,
        n_experts: usize,
    ) -> Result<Option<&[f32]>> {
        let mut candidates: Vec<String> = Vec::new();
        if let Some(e) = expert {
            for n in names {
                candidates.push(format!("{n}.expert.{e}"));
                candidates.push(format!("{n}.expert_{e}"));
            }
        }
        candidates.extend(names.iter().map(|n| n.to_string()));
        for cand in &candidates {
            let Some(v) = self.entries.get(cand) else { continue };
            if v.len() == n_cols {
                return Ok(Some(v));
            }
            if let Some(e) = expert {
                if v.len() == n_cols * n_experts {
                    return Ok(Some(&v[e * n_cols..(e + 1) * n_cols]));
                }
            }
            return Err(Error::Convert(format!(
                "imatrix entry {cand} has {} values, tensor rows have {n_cols}{}",
                v.len(),
                if expert.is_some() { format!(" ({n_experts} experts)") } else { String::new() }
            )));
        }
        Ok(None)
    }
}

/// Serializes entries (name, calls, values) in the `.dat` layout. For tests and tools.
pub fn write_dat(entries: &[(&str, i32, &[f32])]) -> Vec<u8> {
    let mut out = (entries.len() as i32).to_le_bytes().to_vec();
    for (name, calls, values) in entries {
        out.extend_from_slice(&(name.len() as i32).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&calls.to_le_bytes());
        out.extend_from_slice(&(values.len() as i32).to_le_bytes());
        for v in values.iter() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_optional_chunk_and_dataset_trailer() {
        let mut bytes = write_dat(&[("blk.0.attn_q_a.weight", 1, &[1.0f32, 2.0])]);
        let plain = Imatrix::parse(&bytes).unwrap();
        assert_eq!((plain.chunks, plain.dataset.as_deref()), (None, None));
        bytes.extend_from_slice(&202100i32.to_le_bytes());
        bytes.extend_from_slice(&(9i32).to_le_bytes());
        bytes.extend_from_slice(b"calib.txt");
        let t = Imatrix::parse(&bytes).unwrap();
        assert_eq!((t.chunks, t.dataset.as_deref()), (Some(202100), Some("calib.txt")));
    }

    #[test]
    fn parses_and_finds_plain_packed_and_per_expert_entries() {
        let plain = [2.0f32, 4.0];
        let packed = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let one = [9.0f32, 9.0];
        let bytes = write_dat(&[
            ("blk.0.attn_q_a.weight", 2, &plain),
            ("blk.1.ffn_up_exps.weight", 1, &packed),
            ("blk.2.ffn_up_exps.weight.expert.1", 0, &one),
        ]);
        let im = Imatrix::parse(&bytes).unwrap();
        assert_eq!(im.len(), 3);
        assert_eq!(im.find(&["blk.0.attn_q_a.weight"], 2, None, 0).unwrap(), Some(&[1.0f32, 2.0][..]));
        assert_eq!(im.find(&["blk.1.ffn_up_exps.weight"], 2, Some(2), 3).unwrap(), Some(&[5.0f32, 6.0][..]));
        assert_eq!(im.find(&["blk.2.ffn_up_exps.weight"], 2, Some(1), 3).unwrap(), Some(&one[..]));
        assert_eq!(im.find(&["blk.2.ffn_up_exps.weight"], 2, Some(0), 3).unwrap(), None);
        assert_eq!(im.find(&["nope", "blk.0.attn_q_a.weight"], 2, None, 0).unwrap().map(|v| v.len()), Some(2));
        let e = im.find(&["blk.0.attn_q_a.weight"], 3, None, 0).unwrap_err().to_string();
        assert!(e.contains("blk.0.attn_q_a.weight") && e.contains("2 values"), "{e}");
    }

    #[test]
    fn rejects_bad_files() {
        let good = write_dat(&[("a", 1, &[1.0, 2.0])]);
        for len in 0..good.len() {
            assert!(Imatrix::parse(&good[..len]).is_err(), "truncation at {len} accepted");
        }
        assert!(Imatrix::parse(&write_dat(&[("a", 1, &[-1.0])])).is_err());
        assert!(Imatrix::parse(&write_dat(&[("a", 1, &[f32::NAN])])).is_err());
        assert!(Imatrix::parse(&write_dat(&[])).is_err());
    }
}
