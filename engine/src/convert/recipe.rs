//! Recipes: which GGUF type each tensor [`Class`] gets, and the encoding of f32 rows into that type.
//!
//! - `f32` / `f16` / `q8_0`: every matrix at that precision; vectors (norms, biases, sinks, HC base/scale) F32,
//!   `tid2eid` I32. Under `q8_0` a matrix whose row length is not a multiple of 32 falls back to F16.
//! - `q2` / `q4`: the two shipped DS4 recipes (spec "The two shipped recipes"): routed gate/up IQ2_XXS + routed down
//!   Q2_K, or Q4_K for all three; attention projections, shared experts and `output.weight` Q8_0; HC, compressor
//!   (incl. APE), indexer, router and embedding F16. A k-quant tensor whose row length is not a multiple of 256 falls
//!   back to Q8_0 (or F16 when not a multiple of 32 either); a Q8_0 one to F16. The real model never needs a
//!   fallback; tiny test models do.
//!
//! Encoding runs rows in parallel on scoped threads; quantized types go through `crate::quant::quantize_row`.

use std::str::FromStr;

use super::plan::Class;
use crate::quant::GgmlType;
use crate::{Error, Result};

/// A conversion recipe (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Recipe {
    F32,
    F16,
    Q8_0,
    Q2,
    Q4,
}

impl FromStr for Recipe {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => Recipe::F32,
            "f16" => Recipe::F16,
            "q8_0" | "q8" => Recipe::Q8_0,
            "q2" => Recipe::Q2,
            "q4" => Recipe::Q4,
            _ => return Err(Error::InvalidArgument(format!("unknown recipe {s:?} (f32, f16, q8_0, q2, q4)"))),
        })
    }
}

impl std::fmt::Display for Recipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Recipe::F32 => "f32",
            Recipe::F16 => "f16",
            Recipe::Q8_0 => "q8_0",
            Recipe::Q2 => "q2",
            Recipe::Q4 => "q4",
        })
    }
}

/// `ty` if `row_len` is a whole number of its blocks, else the next coarser fallback (Q8_0, then F16).
fn fit(ty: GgmlType, row_len: u64) -> GgmlType {
    if ty.row_bytes(row_len).is_some() {
        ty
    } else if GgmlType::Q8_0.row_bytes(row_len).is_some() {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

impl Recipe {
    /// The GGUF type of a tensor of this class with rows of `row_len` values.
    pub fn type_for(self, class: Class, row_len: u64) -> GgmlType {
        use Class::*;
        match class {
            Vector => return GgmlType::F32,
            Tid2eid => return GgmlType::I32,
            _ => {}
        }
        let want = match self {
            Recipe::F32 => GgmlType::F32,
            Recipe::F16 => GgmlType::F16,
            Recipe::Q8_0 => GgmlType::Q8_0,
            Recipe::Q2 | Recipe::Q4 => match class {
                TokenEmbd | HcFn | Compressor | Indexer | Router => GgmlType::F16,
                Output | Attn | SharedExpert => GgmlType::Q8_0,
                RoutedGateUp if self == Recipe::Q2 => GgmlType::Iq2Xxs,
                RoutedDown if self == Recipe::Q2 => GgmlType::Q2K,
                _ => GgmlType::Q4K,
            },
        };
        fit(want, row_len)
    }

    /// llama.cpp's `general.file_type` for the recipe (ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q8_0 7, MOSTLY_Q2_K 10,
    /// MOSTLY_Q4_K_M 15).
    pub fn file_type(self) -> u32 {
        match self {
            Recipe::F32 => 0,
            Recipe::F16 => 1,
            Recipe::Q8_0 => 7,
            Recipe::Q2 => 10,
            Recipe::Q4 => 15,
        }
    }
}

/// The synthetic importance used when no imatrix is given for IQ2_XXS (as the reference C converter does): per
/// column, the sum over rows of the squared weight.
pub fn weight_energy(values: &[f32], row_len: usize) -> Vec<f32> {
    let mut imp = vec![0f32; row_len];
    for row in values.chunks_exact(row_len) {
        for (i, v) in imp.iter_mut().zip(row) {
            *i += v * v;
        }
    }
    imp
}

/// Appends the encoding of `values` (whole rows of `row_len`) as `ty` to `out`, quantizing rows in parallel.
/// IQ2_XXS rows are quantized with [`weight_energy`] importance; other types without importance.
pub fn encode_append(ty: GgmlType, values: &[f32], row_len: usize, out: &mut Vec<u8>) -> Result<()> {
    let n = encoded_len(ty, values.len(), row_len)?;
    let start = out.len();
    out.resize(start + n, 0);
    encode_into(ty, values, row_len, None, &mut out[start..], true)
}

/// Bytes of `n_values` (whole rows of `row_len`) encoded as `ty`.
pub fn encoded_len(ty: GgmlType, n_values: usize, row_len: usize) -> Result<usize> {
    if row_len == 0 || !n_values.is_multiple_of(row_len) {
        return Err(Error::Convert(format!("{n_values} values are not whole rows of {row_len}")));
    }
    let rb = ty
        .row_bytes(row_len as u64)
        .ok_or_else(|| Error::Convert(format!("row of {row_len} values is not whole {ty} blocks")))?;
    Ok(rb as usize * (n_values / row_len))
}

/// Encodes `values` as `ty` into `dst`, which must be exactly [`encoded_len`] bytes. `importance` (one weight per
/// column, e.g. from an imatrix) steers quantized types; without it IQ2_XXS uses [`weight_energy`]. `parallel`:
/// quantize rows on scoped threads (callers that already run one encode per thread pass `false`).
pub fn encode_into(
    ty: GgmlType,
    values: &[f32],
    row_len: usize,
    importance: Option<&[f32]>,
    dst: &mut [u8],
    parallel: bool,
) -> Result<()> {
    let n = encoded_len(ty, values.len(), row_len)?;
    if dst.len() != n {
        return Err(Error::Convert(format!("{ty}: {} bytes of output for {n}", dst.len())));
    }
    match ty {
        GgmlType::F32 => {
            for (d, v) in dst.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        }
        GgmlType::F16 => {
            for (d, v) in dst.chunks_exact_mut(2).zip(values) {
                d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
            Ok(())
        }
        _ => {
            let energy = (importance.is_none() && ty == GgmlType::Iq2Xxs).then(|| weight_energy(values, row_len));
            let rb = n / (values.len() / row_len);
            quantize_rows(ty, values, importance.or(energy.as_deref()), row_len, rb, dst, parallel)
        }
    }
}

/// Below this many values a tensor is quantized on the calling thread.
const PARALLEL_MIN_VALUES: usize = 1 << 16;

fn quantize_rows(
    ty: GgmlType,
    values: &[f32],
    importance: Option<&[f32]>,
    row_len: usize,
    rb: usize,
    dst: &mut [u8],
    parallel: bool,
) -> Result<()> {
    let n_rows = values.len() / row_len;
    if !parallel || values.len() < PARALLEL_MIN_VALUES {
        for (r, o) in values.chunks_exact(row_len).zip(dst.chunks_exact_mut(rb)) {
            crate::quant::quantize_row(ty, r, importance, o)?;
        }
        return Ok(());
    }
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(n_rows.max(1));
    let rows_per = n_rows.div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = values
            .chunks(rows_per * row_len)
            .zip(dst.chunks_mut(rows_per * rb))
            .map(|(src, out)| {
                s.spawn(move || -> Result<()> {
                    for (r, o) in src.chunks_exact(row_len).zip(out.chunks_exact_mut(rb)) {
                        crate::quant::quantize_row(ty, r, importance, o)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| Err(Error::Convert(format!("{ty} quantizer thread panicked"))))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_recipes_match_the_spec() {
        use Class::*;
        let q2 = Recipe::Q2;
        assert_eq!(q2.type_for(RoutedGateUp, 4096), GgmlType::Iq2Xxs);
        assert_eq!(q2.type_for(RoutedDown, 2048), GgmlType::Q2K);
        assert_eq!(Recipe::Q4.type_for(RoutedGateUp, 4096), GgmlType::Q4K);
        assert_eq!(Recipe::Q4.type_for(RoutedDown, 2048), GgmlType::Q4K);
        for c in [Attn, SharedExpert, Output] {
            assert_eq!(q2.type_for(c, 4096), GgmlType::Q8_0);
        }
        for c in [TokenEmbd, HcFn, Compressor, Indexer, Router] {
            assert_eq!(q2.type_for(c, 4096), GgmlType::F16);
        }
        assert_eq!(q2.type_for(Vector, 4096), GgmlType::F32);
        assert_eq!(q2.type_for(Tid2eid, 6), GgmlType::I32);
        // fallbacks for rows that are not whole blocks
        assert_eq!(q2.type_for(RoutedDown, 64), GgmlType::Q8_0);
        assert_eq!(q2.type_for(RoutedDown, 48), GgmlType::F16);
        assert_eq!(Recipe::Q8_0.type_for(Attn, 8), GgmlType::F16);
        assert_eq!(Recipe::F32.type_for(Attn, 8), GgmlType::F32);
        assert_eq!("Q8_0".parse::<Recipe>().unwrap(), Recipe::Q8_0);
        assert!("q3".parse::<Recipe>().is_err());
    }

    #[test]
    fn encodes_f32_and_f16() {
        let mut out = Vec::new();
        encode_append(GgmlType::F32, &[1.0, -2.0], 2, &mut out).unwrap();
        encode_append(GgmlType::F16, &[0.5, 3.0], 1, &mut out).unwrap();
        assert_eq!(&out[..4], &1.0f32.to_le_bytes());
        assert_eq!(&out[8..10], &half::f16::from_f32(0.5).to_le_bytes());
        assert_eq!(out.len(), 12);
        assert!(encode_append(GgmlType::F32, &[1.0, 2.0, 3.0], 2, &mut out).is_err());
    }
}
