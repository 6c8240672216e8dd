//! The streaming GGUF writer: declare every tensor up front (so offsets are known), then write their bytes one at a
//! time in declaration order. Peak memory is one tensor, whatever the file size.

use std::io::Write;

use super::metadata::MetaValue;
use super::{DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::quant::GgmlType;
use crate::{Error, Result};

/// A tensor to be written: name, type and GGUF dims (innermost first).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorDecl {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
}

impl TensorDecl {
    /// Bytes of data the tensor takes.
    pub fn n_bytes(&self) -> Result<u64> {
        let rows: u64 = self.dims.iter().skip(1).product();
        let first = self.dims.first().copied().unwrap_or(1);
        self.ty.row_bytes(first).and_then(|rb| rb.checked_mul(rows)).ok_or_else(|| Error::Tensor {
            name: self.name.clone(),
            what: format!("dims {:?} are not whole {} blocks", self.dims, self.ty),
        })
    }
}

/// Writes a GGUF v3 file. See the module docs.
pub struct GgufWriter<W: Write> {
    out: W,
    decls: Vec<TensorDecl>,
    sizes: Vec<u64>,
    next: usize,
    written: u64,
    alignment: u64,
}

fn w_err(e: std::io::Error) -> Error {
    Error::Io { path: "<gguf output>".into(), source: e }
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => buf.push(*x),
        MetaValue::I8(x) => buf.push(*x as u8),
        MetaValue::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => buf.push(*x as u8),
        MetaValue::String(s) => put_str(buf, s),
        MetaValue::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Array(ty, items) => {
            buf.extend_from_slice(&(*ty as u32).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(buf, it);
            }
        }
    }
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header (metadata and tensor infos) and returns a writer expecting the tensors' data in the order
    /// of `tensors`. `general.alignment` in `metadata`, if present, sets the alignment.
    pub fn new(mut out: W, metadata: &[(String, MetaValue)], tensors: Vec<TensorDecl>) -> Result<Self> {
        let alignment = metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_int())
            .map(|a| a as u64)
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(Error::InvalidArgument(format!("general.alignment {alignment} is not a power of two")));
        }
        for (k, v) in metadata {
            if let MetaValue::Array(ty, items) = v {
                if items.iter().any(|i| i.value_type() != *ty) {
                    return Err(Error::InvalidArgument(format!("metadata {k}: array elements of mixed types")));
                }
            }
        }
        let mut buf = Vec::new();
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&3u32.to_le_bytes());
        buf.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        buf.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut buf, k);
            buf.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut buf, v);
        }
        let mut sizes = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in &tensors {
            if t.dims.is_empty() || t.dims.len() > MAX_DIMS || t.dims.contains(&0) {
                return Err(Error::Tensor { name: t.name.clone(), what: format!("bad dims {:?}", t.dims) });
            }
            let n = t.n_bytes()?;
            put_str(&mut buf, &t.name);
            buf.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                buf.extend_from_slice(&d.to_le_bytes());
            }
            buf.extend_from_slice(&t.ty.id().to_le_bytes());
            buf.extend_from_slice(&offset.to_le_bytes());
            sizes.push(n);
            offset = (offset + n).div_ceil(alignment) * alignment;
        }
        let pad = (buf.len() as u64).div_ceil(alignment) * alignment - buf.len() as u64;
        buf.resize(buf.len() + pad as usize, 0);
        out.write_all(&buf).map_err(w_err)?;
        Ok(GgufWriter { out, decls: tensors, sizes, next: 0, written: 0, alignment })
    }

    /// The declaration of the tensor expected next, if any.
    pub fn next_tensor(&self) -> Option<&TensorDecl> {
        self.decls.get(self.next)
    }

    /// Writes the data of the next declared tensor; `name` must match it and `data` must have its exact size.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let decl = self.decls.get(self.next).ok_or_else(|| Error::Tensor {
            name: name.to_string(),
            what: "written but never declared (all declared tensors already written)".into(),
        })?;
        if decl.name != name {
            return Err(Error::Tensor {
                name: name.to_string(),
                what: format!("written out of order: expected {}", decl.name),
            });
        }
        let want = self.sizes[self.next];
        if data.len() as u64 != want {
            return Err(Error::Tensor {
                name: name.to_string(),
                what: format!("{} bytes given, {} {:?} needs {want}", data.len(), decl.ty, decl.dims),
            });
        }
        self.out.write_all(data).map_err(w_err)?;
        self.written += want;
        let padded = self.written.div_ceil(self.alignment) * self.alignment;
        if self.next + 1 < self.decls.len() && padded > self.written {
            let zeros = vec![0u8; (padded - self.written) as usize];
            self.out.write_all(&zeros).map_err(w_err)?;
            self.written = padded;
        }
        self.next += 1;
        Ok(())
    }

    /// Checks that every declared tensor was written, flushes and returns the output.
    pub fn finish(mut self) -> Result<W> {
        if let Some(d) = self.decls.get(self.next) {
            return Err(Error::Tensor { name: d.name.clone(), what: "declared but never written".into() });
        }
        self.out.flush().map_err(w_err)?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{GgufFile, MetaValue};
    use super::*;

    fn sample() -> Vec<u8> {
        let meta = vec![
            ("general.architecture".to_string(), MetaValue::String("deepseek4".into())),
            ("deepseek4.block_count".to_string(), MetaValue::U32(2)),
            (
                "deepseek4.attention.compress_ratios".to_string(),
                MetaValue::Array(super::super::ValueType::I32, vec![MetaValue::I32(0), MetaValue::I32(4)]),
            ),
            ("tokenizer.ggml.tokens".to_string(), MetaValue::string_array(["a", "b", "ab"])),
            ("x.f".to_string(), MetaValue::F32(1.5)),
        ];
        let decls = vec![
            TensorDecl { name: "a".into(), ty: GgmlType::F32, dims: vec![3, 2] },
            TensorDecl { name: "b".into(), ty: GgmlType::Q8_0, dims: vec![32] },
        ];
        let mut w = GgufWriter::new(Vec::new(), &meta, decls).unwrap();
        let a: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        w.write_tensor("a", &a).unwrap();
        w.write_tensor("b", &[7u8; 34]).unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn round_trip() {
        let f = GgufFile::from_bytes(sample()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.get_str("general.architecture").unwrap(), "deepseek4");
        assert_eq!(f.get_usize("deepseek4.block_count").unwrap(), 2);
        assert_eq!(f.get_int_array("deepseek4.attention.compress_ratios").unwrap(), vec![0, 4]);
        assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap(), vec!["a", "b", "ab"]);
        assert_eq!(f.get_f64("x.f").unwrap(), 1.5);
        let a = f.tensor("a").unwrap();
        assert_eq!(a.info.dims, vec![3, 2]);
        assert_eq!(&a.data[4..8], &1.0f32.to_le_bytes());
        let b = f.tensor("b").unwrap();
        assert_eq!(b.info.offset % 32, 0);
        assert_eq!(b.data, &[7u8; 34]);
        assert!(f.get_usize("missing").is_err());
        assert!(f.get_str("deepseek4.block_count").is_err());
    }

    #[test]
    fn writer_rejects_wrong_order_and_size() {
        let decls = vec![
            TensorDecl { name: "a".into(), ty: GgmlType::F32, dims: vec![2] },
            TensorDecl { name: "b".into(), ty: GgmlType::F32, dims: vec![2] },
        ];
        let mut w = GgufWriter::new(Vec::new(), &[], decls.clone()).unwrap();
        assert!(w.write_tensor("b", &[0; 8]).is_err());
        assert!(w.write_tensor("a", &[0; 7]).is_err());
        w.write_tensor("a", &[0; 8]).unwrap();
        assert!(GgufWriter::new(Vec::new(), &[], decls).unwrap().finish().is_err());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        for len in 0..bytes.len() {
            let r = GgufFile::from_bytes(bytes[..len].to_vec());
            assert!(r.is_err(), "truncation at {len} was accepted");
        }
    }

    #[test]
    fn mutations_never_panic() {
        let bytes = sample();
        let mut state = 0x9E3779B97F4A7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..3000 {
            let mut m = bytes.clone();
            for _ in 0..(1 + next() % 4) {
                let i = (next() % m.len() as u64) as usize;
                m[i] = match next() % 3 {
                    0 => next() as u8,
                    1 => 0xff,
                    _ => 0,
                };
            }
            if let Ok(f) = GgufFile::from_bytes(m) {
                for t in f.tensors() {
                    let v = f.view(t);
                    assert_eq!(v.data.len() as u64, t.n_bytes);
                }
            }
        }
    }
}
