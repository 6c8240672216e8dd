//! WGSL compute shaders for every op of the ds4 forward pass. Sources are embedded as strings so the engine can
//! build pipelines without touching the filesystem; tests validate each one with naga.
//!
//! Layout: one `.wgsl` file per op family under `src/wgsl/`. WGSL has no `#include`, so shared helpers are composed
//! at compile time with `concat!`: `pages.wgsl` (`page_row`, the paged KV row address) is appended to the kernels
//! that read device KV pages (attention, indexer), and kernels that read quantized weights are built from
//! `bytes.wgsl` (byte-addressed loads from the `u32` weight buffer `w`) + one `quant_*.wgsl` (defines `BLOCK_VALUES`, `BLOCK_BYTES`, `block_value(b, i)` and
//! `block_dot(b, x0)` for one ggml block format) + the kernel body (`matmul.wgsl`, `get_rows.wgsl`).
//! Weights are read directly in their file format: no dequantized copies of the model exist on the device.
//!
//! Entry points are named in [`all_sources`] (`main` unless a file holds several); bindings and uniform `Params` struct are documented at the top of its
//! file. The uniform `Params` blocks are defined once, in Rust, in [`params`] (checked against naga's layout of each
//! shader); the engine's wgpu backend fills those types.

pub mod params;

/// A weight format the WGSL kernels can read directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q2K,
    Q4K,
    Iq2Xxs,
}

impl WeightFormat {
    /// Every format, for tests and pipeline warm-up.
    pub const ALL: [WeightFormat; 7] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Bf16,
        WeightFormat::Q8_0,
        WeightFormat::Q2K,
        WeightFormat::Q4K,
        WeightFormat::Iq2Xxs,
    ];

    /// (values per block, bytes per block), as the shader sees them.
    pub fn block(self) -> (usize, usize) {
        match self {
            WeightFormat::F32 => (1, 4),
            WeightFormat::F16 | WeightFormat::Bf16 => (1, 2),
            WeightFormat::Q8_0 => (32, 34),
            WeightFormat::Q2K => (256, 84),
            WeightFormat::Q4K => (256, 144),
            WeightFormat::Iq2Xxs => (256, 66),
        }
    }

    /// The quantized matrix product kernel (`matmul.wgsl`) for this format.
    pub fn matmul_source(self) -> &'static str {
        match self {
            WeightFormat::F32 => MATMUL_F32,
            WeightFormat::F16 => MATMUL_F16,
            WeightFormat::Bf16 => MATMUL_BF16,
            WeightFormat::Q8_0 => MATMUL_Q8_0,
            WeightFormat::Q2K => MATMUL_Q2_K,
            WeightFormat::Q4K => MATMUL_Q4_K,
            WeightFormat::Iq2Xxs => MATMUL_IQ2_XXS,
        }
    }

    /// The row-gather (embedding lookup) kernel (`get_rows.wgsl`) for this format.
    pub fn get_rows_source(self) -> &'static str {
        match self {
            WeightFormat::F32 => GET_ROWS_F32,
            WeightFormat::F16 => GET_ROWS_F16,
            WeightFormat::Bf16 => GET_ROWS_BF16,
            WeightFormat::Q8_0 => GET_ROWS_Q8_0,
            WeightFormat::Q2K => GET_ROWS_Q2_K,
            WeightFormat::Q4K => GET_ROWS_Q4_K,
            WeightFormat::Iq2Xxs => GET_ROWS_IQ2_XXS,
        }
    }
}

macro_rules! quant_kernels {
    ($($matmul:ident, $get_rows:ident, $file:literal;)*) => {
        $(
            #[doc = concat!("`matmul.wgsl` over `", $file, "` weights.")]
            pub const $matmul: &str =
                concat!(include_str!("wgsl/bytes.wgsl"), include_str!($file), include_str!("wgsl/matmul.wgsl"));
            #[doc = concat!("`get_rows.wgsl` over `", $file, "` weights.")]
            pub const $get_rows: &str =
                concat!(include_str!("wgsl/bytes.wgsl"), include_str!($file), include_str!("wgsl/get_rows.wgsl"));
        )*
    };
}

quant_kernels! {
    MATMUL_F32, GET_ROWS_F32, "wgsl/quant_f32.wgsl";
    MATMUL_F16, GET_ROWS_F16, "wgsl/quant_f16.wgsl";
    MATMUL_BF16, GET_ROWS_BF16, "wgsl/quant_bf16.wgsl";
    MATMUL_Q8_0, GET_ROWS_Q8_0, "wgsl/quant_q8_0.wgsl";
    MATMUL_Q2_K, GET_ROWS_Q2_K, "wgsl/quant_q2_k.wgsl";
    MATMUL_Q4_K, GET_ROWS_Q4_K, "wgsl/quant_q4_k.wgsl";
    MATMUL_IQ2_XXS, GET_ROWS_IQ2_XXS, "wgsl/quant_iq2_xxs.wgsl";
}

/// RMSNorm over rows, optional weight (`norm.wgsl`, entry `main`).
pub const RMS_NORM: &str = concat!(include_str!("wgsl/round.wgsl"), include_str!("wgsl/norm.wgsl"));
/// Interleaved RoPE / inverse RoPE on the trailing rope dims, CPU-computed cos/sin (`rope.wgsl`, entry `main`).
pub const ROPE: &str = include_str!("wgsl/rope.wgsl");
/// Softmax-with-sink attention over listed key rows, K = V (`attention.wgsl`, entries `main` and `keyed`, the
/// latter reading keys from the batch rows, the window ring and the paged compressed rows of device-resident KV,
/// addressed by `pages.wgsl`).
pub const ATTENTION: &str = concat!(include_str!("wgsl/attention.wgsl"), include_str!("wgsl/pages.wgsl"));
/// mHC: entries `pre` (weights + Sinkhorn + collapse; also the output head), `post` (expand + mix), and the node
/// halves of `pre`: `weights` (of already normed mixes) and `collapse`.
pub const HC: &str = include_str!("wgsl/hc.wgsl");
/// Compressor pooling over slot lists (`compress.wgsl`, entry `main`).
pub const COMPRESS: &str = include_str!("wgsl/compress.wgsl");
/// Lightning indexer: entries `scores` (over paged key rows, addressed by `pages.wgsl`) and `topk`.
pub const INDEXER: &str = concat!(include_str!("wgsl/indexer.wgsl"), include_str!("wgsl/pages.wgsl"));
/// MoE: entries `route`, `swiglu`, `gather`, `scatter`.
pub const MOE: &str = include_str!("wgsl/moe.wgsl");
/// Activation simulation: entries `fp8`, `fp4`, `hadamard`.
pub const ACT: &str = concat!(include_str!("wgsl/round.wgsl"), include_str!("wgsl/act.wgsl"));
/// In-place scaling by a constant (`scale.wgsl`, entry `main`).
pub const SCALE: &str = include_str!("wgsl/scale.wgsl");
/// Combine of expert-indexed MoE outputs in ascending expert order (`moe_ids.wgsl`, entry `combine`).
pub const MOE_IDS: &str = include_str!("wgsl/moe_ids.wgsl");

macro_rules! ids_kernels {
    ($($name:ident, $file:literal;)*) => {
        $(
            #[doc = concat!("`matmul_ids.wgsl` over `", $file, "` weights.")]
            pub const $name: &str =
                concat!(include_str!("wgsl/bytes.wgsl"), include_str!($file), include_str!("wgsl/matmul_ids.wgsl"));
        )*
    };
}

ids_kernels! {
    MATMUL_IDS_F32, "wgsl/quant_f32.wgsl";
    MATMUL_IDS_F16, "wgsl/quant_f16.wgsl";
    MATMUL_IDS_BF16, "wgsl/quant_bf16.wgsl";
    MATMUL_IDS_Q8_0, "wgsl/quant_q8_0.wgsl";
    MATMUL_IDS_Q2_K, "wgsl/quant_q2_k.wgsl";
    MATMUL_IDS_Q4_K, "wgsl/quant_q4_k.wgsl";
    MATMUL_IDS_IQ2_XXS, "wgsl/quant_iq2_xxs.wgsl";
}

/// The expert-indexed matrix product (`matmul_ids.wgsl`: each (row, pair) reads the rows of the expert the
/// device-side router chose) for weights in format `f`.
pub fn matmul_ids_source(f: WeightFormat) -> &'static str {
    match f {
        WeightFormat::F32 => MATMUL_IDS_F32,
        WeightFormat::F16 => MATMUL_IDS_F16,
        WeightFormat::Bf16 => MATMUL_IDS_BF16,
        WeightFormat::Q8_0 => MATMUL_IDS_Q8_0,
        WeightFormat::Q2K => MATMUL_IDS_Q2_K,
        WeightFormat::Q4K => MATMUL_IDS_Q4_K,
        WeightFormat::Iq2Xxs => MATMUL_IDS_IQ2_XXS,
    }
}

/// The best logits of each row, best first (`candidates.wgsl`, entry `main`).
pub const CANDIDATES: &str = include_str!("wgsl/candidates.wgsl");

/// Word copies and zero fills as kernels, inside a compute pass (`copy.wgsl`, entries `main` and `zero`).
pub const COPY: &str = include_str!("wgsl/copy.wgsl");

/// Device-resident KV helpers (`kvdev.wgsl`, entry `add_ape`).
pub const KVDEV: &str = include_str!("wgsl/kvdev.wgsl");

/// Every shader source with a name and its entry points, for validation and pipeline warm-up.
pub fn all_sources() -> Vec<(&'static str, &'static str, &'static [&'static str])> {
    let mut v: Vec<(&'static str, &'static str, &'static [&'static str])> = Vec::new();
    for f in WeightFormat::ALL {
        v.push(("matmul", f.matmul_source(), &["main", "multi", "swiglu_pair"]));
        v.push(("get_rows", f.get_rows_source(), &["main", "embed_norm"]));
    }
    v.push(("rms_norm", RMS_NORM, &["main", "norm_rope"]));
    v.push(("rope", ROPE, &["main"]));
    v.push(("attention", ATTENTION, &["main", "keyed"]));
    v.push((
        "hc",
        HC,
        &["pre", "post", "weights", "collapse", "weights_collapse", "weights_collapse_norm", "post_norm"],
    ));
    v.push(("compress", COMPRESS, &["main"]));
    v.push(("indexer", INDEXER, &["scores", "topk"]));
    v.push(("moe", MOE, &["route", "swiglu", "swiglu_shared", "gather", "scatter"]));
    v.push(("act", ACT, &["fp8", "fp4", "hadamard", "rope_hadamard_fp4"]));
    v.push(("scale", SCALE, &["main"]));
    v.push(("kvdev", KVDEV, &["add_ape"]));
    v.push(("moe_ids", MOE_IDS, &["combine"]));
    v.push(("candidates", CANDIDATES, &["main"]));
    v.push(("copy", COPY, &["main", "zero"]));
    for f in WeightFormat::ALL {
        v.push(("matmul_ids", matmul_ids_source(f), &["main", "gate_up_swiglu", "down_combine"]));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(name: &str, src: &str, entries: &[&str]) -> Result<(), String> {
        let module =
            naga::front::wgsl::parse_str(src).map_err(|e| format!("{name}: parse: {}", e.emit_to_string(src)))?;
        naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
            .validate(&module)
            .map_err(|e| format!("{name}: validate: {}", e.emit_to_string(src)))?;
        for want in entries {
            if !module.entry_points.iter().any(|e| e.name == *want) {
                return Err(format!("{name}: no entry point `{want}`"));
            }
        }
        Ok(())
    }

    #[test]
    fn every_shader_validates_with_naga() {
        let errors: Vec<String> = all_sources().into_iter().filter_map(|(n, s, e)| validate(n, s, e).err()).collect();
        assert!(errors.is_empty(), "{}", errors.join("\n\n"));
    }

    /// Translates one validated shader to Metal Shading Language (Apple) and HLSL (Windows / DX12) as wgpu's Metal
    /// and DX12 backends do (Metal 2.4, HLSL shader model 6.0: DX12's compute baseline) and checks that each wanted
    /// entry point came out, so a shader that only Vulkan could run fails here rather than on a user's Mac or PC.
    /// Returns the problems found.
    fn translate(name: &str, src: &str, entries: &[&str]) -> Vec<String> {
        let module = match naga::front::wgsl::parse_str(src) {
            Ok(m) => m,
            Err(e) => return vec![format!("{name}: parse: {}", e.emit_to_string(src))],
        };
        let info =
            match naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
                .validate(&module)
            {
                Ok(i) => i,
                Err(e) => return vec![format!("{name}: validate: {}", e.emit_to_string(src))],
            };
        let mut errors = Vec::new();
        let mut outputs: Vec<(&str, String, Vec<Option<String>>)> = Vec::new();
        let msl_options = naga::back::msl::Options { lang_version: (2, 4), ..Default::default() };
        match naga::back::msl::write_string(&module, &info, &msl_options, &naga::back::msl::PipelineOptions::default())
        {
            Ok((text, ti)) => outputs.push(("MSL", text, ti.entry_point_names.into_iter().map(Result::ok).collect())),
            Err(e) => errors.push(format!("{name}: MSL: {e}")),
        }
        let hlsl_options =
            naga::back::hlsl::Options { shader_model: naga::back::hlsl::ShaderModel::V6_0, ..Default::default() };
        let pipeline = naga::back::hlsl::PipelineOptions::default();
        let mut text = String::new();
        match naga::back::hlsl::Writer::new(&mut text, &hlsl_options, &pipeline).write(&module, &info, None) {
            Ok(ri) => outputs.push(("HLSL", text, ri.entry_point_names.into_iter().map(Result::ok).collect())),
            Err(e) => errors.push(format!("{name}: HLSL: {e}")),
        }
        for want in entries {
            let Some(index) = module.entry_points.iter().position(|e| e.name == *want) else {
                errors.push(format!("{name}: no entry point `{want}`"));
                continue;
            };
            for (lang, text, names) in &outputs {
                match names.get(index).cloned().flatten() {
                    Some(out) if text.contains(&out) => {}
                    _ => errors.push(format!("{name}: {lang} has no function for entry point `{want}`")),
                }
            }
        }
        errors
    }

    #[test]
    fn every_shader_translates_to_msl_and_hlsl() {
        let errors: Vec<String> = all_sources().into_iter().flat_map(|(n, s, e)| translate(n, s, e)).collect();
        assert!(errors.is_empty(), "{}", errors.join("\n\n"));
    }

    #[test]
    fn translation_check_reports_problems() {
        let ok = "@compute @workgroup_size(1) fn main() {}";
        assert!(translate("ok", ok, &["main"]).is_empty());
        assert_eq!(translate("missing", ok, &["other"]).len(), 1);
        assert_eq!(translate("broken", "@compute @workgroup_size(1) fn main() { let a: u32 = 1.5; }", &[]).len(), 1);
    }

    #[test]
    fn validator_rejects_a_broken_shader() {
        assert!(validate("broken", "@compute @workgroup_size(1) fn main() { let a: u32 = 1.5; }", &["main"]).is_err());
    }
}
