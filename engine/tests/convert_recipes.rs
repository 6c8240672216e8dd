//! The quantized recipes on the golden `tiny-a` checkpoint: every tensor gets the type the spec's recipe table
//! assigns (with the documented fallbacks for rows that are not whole blocks), and dequantizes back close to the
//! f32 conversion (which `convert_golden.rs` checks byte-for-byte against the checkpoint).

use std::path::PathBuf;

use ds4_engine::convert::{convert, ConvertOptions, Recipe};
use ds4_engine::gguf::GgufFile;
use ds4_engine::quant::{dequantize_row, GgmlType};

fn golden_dir() -> Option<PathBuf> {
    ds4_engine::testdata::shared("golden/tiny-a", "model.safetensors")
}

fn is_vector(name: &str) -> bool {
    name.ends_with("_norm.weight")
        || name.ends_with("_base.weight")
        || name.ends_with("_scale.weight")
        || name.ends_with("attn_sinks.weight")
        || name.ends_with("exp_probs_b.bias")
}

/// The spec's type for a tensor under a recipe ("The two shipped recipes"), before block-size fallbacks.
fn spec_type(recipe: Recipe, name: &str) -> GgmlType {
    if is_vector(name) {
        return GgmlType::F32;
    }
    if name.ends_with("tid2eid.weight") {
        return GgmlType::I32;
    }
    match recipe {
        Recipe::F32 => GgmlType::F32,
        Recipe::F16 => GgmlType::F16,
        Recipe::Q8_0 => GgmlType::Q8_0,
        Recipe::Q2 | Recipe::Q4 => {
            let q8 =
                ["attn_q_a.", "attn_q_b.", "attn_kv.", "attn_output_a.", "attn_output_b.", "_shexp.", "output.weight"];
            if name.contains("_exps.") {
                match (recipe, name.contains("ffn_down_exps")) {
                    (Recipe::Q2, false) => GgmlType::Iq2Xxs,
                    (Recipe::Q2, true) => GgmlType::Q2K,
                    _ => GgmlType::Q4K,
                }
            } else if !name.contains("indexer") && q8.iter().any(|p| name.contains(p)) {
                GgmlType::Q8_0
            } else {
                GgmlType::F16
            }
        }
    }
}

fn with_fallback(ty: GgmlType, row: u64) -> GgmlType {
    if ty.row_bytes(row).is_some() {
        ty
    } else if row.is_multiple_of(32) {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

/// Largest allowed relative RMS error of a dequantized tensor, per type (random Gaussian-like weights).
fn tolerance(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::F32 | GgmlType::I32 => 0.0,
        GgmlType::F16 => 5e-4,
        GgmlType::Q8_0 => 8e-3,
        GgmlType::Q4K => 0.1,
        GgmlType::Q2K => 0.45,
        GgmlType::Iq2Xxs => 0.4,
        _ => panic!("unexpected type {ty}"),
    }
}

fn values(f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f.tensor(name).unwrap();
    let row = t.info.dims[0] as usize;
    let rb = t.info.ty.row_bytes(row as u64).unwrap() as usize;
    let mut out = vec![0f32; t.info.n_elements() as usize];
    if t.info.ty == GgmlType::I32 {
        return t.data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect();
    }
    for (src, dst) in t.data.chunks_exact(rb).zip(out.chunks_exact_mut(row)) {
        dequantize_row(t.info.ty, src, dst).unwrap();
    }
    out
}

#[test]
fn tiny_a_quantized_recipes_follow_the_spec_and_round_trip() {
    let Some(dir) = golden_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let f32_path = tmp.path().join("f32.gguf");
    convert(&ConvertOptions::new(&dir, &f32_path, Recipe::F32)).unwrap();
    let reference = GgufFile::open(&f32_path).unwrap();
    for recipe in [Recipe::F16, Recipe::Q8_0, Recipe::Q2, Recipe::Q4] {
        let path = tmp.path().join(format!("{recipe}.gguf"));
        convert(&ConvertOptions::new(&dir, &path, recipe)).unwrap();
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.tensors().len(), reference.tensors().len());
        assert_eq!(g.metadata().len(), reference.metadata().len());
        let mut seen_types = std::collections::BTreeSet::new();
        for t in g.tensors() {
            let r = reference.tensor_info(&t.name).unwrap();
            assert_eq!(t.dims, r.dims, "{recipe} {}", t.name);
            let want = with_fallback(spec_type(recipe, &t.name), t.dims[0]);
            assert_eq!(t.ty, want, "{recipe} {} type", t.name);
            seen_types.insert(t.ty.name());
            let (a, b) = (values(&g, &t.name), values(&reference, &t.name));
            let err: f64 = a.iter().zip(&b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
            let rel = (err / norm.max(1e-30)).sqrt();
            assert!(rel <= tolerance(t.ty), "{recipe} {} ({}): relative RMS error {rel}", t.name, t.ty);
        }
        eprintln!("{recipe}: types {seen_types:?}");
    }
}
