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

pub mod pair;
pub mod params;

use std::borrow::Cow;

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

    /// The block format's WGSL (`quant_*.wgsl`: `BLOCK_VALUES`, `BLOCK_BYTES`, `ROW_LANES`, `block_value`,
    /// `block_dot`, `quant_setup`).
    pub fn quant_source(self) -> &'static str {
        match self {
            WeightFormat::F32 => include_str!("wgsl/quant_f32.wgsl"),
            WeightFormat::F16 => include_str!("wgsl/quant_f16.wgsl"),
            WeightFormat::Bf16 => include_str!("wgsl/quant_bf16.wgsl"),
            WeightFormat::Q8_0 => include_str!("wgsl/quant_q8_0.wgsl"),
            WeightFormat::Q2K => include_str!("wgsl/quant_q2_k.wgsl"),
            WeightFormat::Q4K => include_str!("wgsl/quant_q4_k.wgsl"),
            WeightFormat::Iq2Xxs => include_str!("wgsl/quant_iq2_xxs.wgsl"),
        }
    }

    /// Invocations that share one weight row in a product kernel (`ROW_LANES` of the format's `quant_*.wgsl`): a
    /// workgroup of 64 takes `64 / row_lanes` rows. Fewer lanes for bigger blocks, so a row's blocks keep every
    /// lane busy.
    pub fn row_lanes(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => 32,
            WeightFormat::Q8_0 => 16,
            WeightFormat::Q2K | WeightFormat::Q4K | WeightFormat::Iq2Xxs => 8,
        }
    }

    /// Weight rows per workgroup of the product kernels (`ROWS` in `lanes.wgsl`).
    pub fn rows_per_workgroup(self) -> usize {
        PRODUCT_WORKGROUP / self.row_lanes()
    }

    /// The matrix product kernel for this format with the lane sums of `reduce`.
    pub fn matmul_source_with(self, reduce: Reduce) -> Cow<'static, str> {
        match reduce {
            Reduce::Shared => Cow::Borrowed(self.matmul_source()),
            Reduce::Subgroup { .. } => Cow::Owned(reduce.compose(self, include_str!("wgsl/matmul.wgsl"))),
        }
    }

    /// The expert-indexed product kernel for this format with the lane sums of `reduce`.
    pub fn matmul_ids_source_with(self, reduce: Reduce) -> Cow<'static, str> {
        match reduce {
            Reduce::Shared => Cow::Borrowed(matmul_ids_source(self)),
            Reduce::Subgroup { .. } => Cow::Owned(reduce.compose(self, include_str!("wgsl/matmul_ids.wgsl"))),
        }
    }

    /// The quantized matrix product kernel (`matmul.wgsl`) for this format, lane sums through workgroup memory.
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

/// Invocations per workgroup of the product kernels (`WG` in `lanes.wgsl`).
pub const PRODUCT_WORKGROUP: usize = 64;

/// How the product kernels sum a row's lanes (`lanes.wgsl`). Both give the same bits: the tree is the same, only
/// where its steps run differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduce {
    /// Every step through workgroup memory, with a barrier each (any adapter).
    Shared,
    /// Steps below `min_size` (the adapter's smallest subgroup size, a power of two) as subgroup shuffles, the
    /// rest through workgroup memory. Needs the adapter's subgroup feature.
    Subgroup { min_size: u32 },
}

impl Reduce {
    /// The pipeline-name suffix that tells the variants apart.
    pub fn tag(self) -> String {
        match self {
            Reduce::Shared => "wg".into(),
            Reduce::Subgroup { min_size } => format!("sg{min_size}"),
        }
    }

    /// `body` (a product kernel) over format `f`'s blocks with this reduction's prelude.
    fn compose(self, f: WeightFormat, body: &str) -> String {
        let (sg_line, prelude) = match self {
            Reduce::Shared => (String::new(), include_str!("wgsl/reduce_shared.wgsl")),
            Reduce::Subgroup { min_size } => {
                (format!("const SG: u32 = {min_size}u;\n"), include_str!("wgsl/reduce_subgroup.wgsl"))
            }
        };
        [&sg_line, include_str!("wgsl/bytes.wgsl"), f.quant_source(), prelude, include_str!("wgsl/lanes.wgsl"), body]
            .concat()
    }
}

macro_rules! quant_kernels {
    ($($matmul:ident, $get_rows:ident, $file:literal;)*) => {
        $(
            #[doc = concat!("`matmul.wgsl` over `", $file, "` weights, lane sums through workgroup memory.")]
            pub const $matmul: &str = concat!(
                include_str!("wgsl/bytes.wgsl"),
                include_str!($file),
                include_str!("wgsl/reduce_shared.wgsl"),
                include_str!("wgsl/lanes.wgsl"),
                include_str!("wgsl/matmul.wgsl")
            );
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
/// A MoE layer's (row, slot) pairs grouped by expert into tiles on the device (`moe_group.wgsl`, entry `group`).
pub const MOE_GROUP: &str = include_str!("wgsl/moe_group.wgsl");

macro_rules! ids_kernels {
    ($($name:ident, $file:literal;)*) => {
        $(
            #[doc = concat!("`matmul_ids.wgsl` over `", $file, "` weights, lane sums through workgroup memory.")]
            pub const $name: &str = concat!(
                include_str!("wgsl/bytes.wgsl"),
                include_str!($file),
                include_str!("wgsl/reduce_shared.wgsl"),
                include_str!("wgsl/lanes.wgsl"),
                include_str!("wgsl/matmul_ids.wgsl")
            );
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

/// The fixed part of the copy kernels (`copy.wgsl`: its `Params`); [`copy_source`] is the whole module.
pub const COPY: &str = include_str!("wgsl/copy.wgsl");

/// Word copies and zero fills as kernels, inside a compute pass: `copy.wgsl` plus, per segment, its two bindings
/// and copy function, and the entries `copy1` .. `copy8` (`m` segments in one dispatch) and `zero`.
pub fn copy_source() -> String {
    let n = params::CopyParams::SEGMENTS;
    let mut s = String::from(COPY);
    for i in 0..n {
        s.push_str(&format!(
            "\n@group(0) @binding({}) var<storage, read> src{i}: array<u32>;\n\
             @group(0) @binding({}) var<storage, read_write> dst{i}: array<u32>;\n\
             fn seg{i}(j: u32) {{\n    let q = p.s[{i}];\n    if (j < q.x) {{\n        \
             dst{i}[q.z + j] = src{i}[q.y + j];\n    }}\n}}\n",
            1 + 2 * i,
            2 + 2 * i
        ));
    }
    for m in 1..=n {
        let calls: String = (0..m).map(|i| format!("    seg{i}(gid.x);\n")).collect();
        s.push_str(&format!(
            "\n@compute @workgroup_size(64)\nfn copy{m}(@builtin(global_invocation_id) gid: vec3<u32>) {{\n{calls}}}\n"
        ));
    }
    s.push_str(
        "\n@compute @workgroup_size(64)\nfn zero(@builtin(global_invocation_id) gid: vec3<u32>) {\n    \
         if (gid.x < p.s[0].x) {\n        dst0[p.s[0].z + gid.x] = 0u;\n    }\n}\n",
    );
    s
}

/// Device-resident KV helpers (`kvdev.wgsl`, entry `add_ape`).
pub const KVDEV: &str = include_str!("wgsl/kvdev.wgsl");

/// The probe of the subgroup layout the product kernels assume (`lane_probe.wgsl`, entry `main`), for an adapter
/// whose smallest subgroup has `min_size` invocations.
pub fn lane_probe_source(min_size: u32) -> String {
    format!("const SG: u32 = {min_size}u;\n{}", include_str!("wgsl/lane_probe.wgsl"))
}

/// Every shader source with a name and its entry points, for validation and pipeline warm-up.
/// The product kernels come in their workgroup-memory form and their subgroup forms for smallest subgroup sizes 4
/// (the least an adapter reports), 32 and 64.
pub fn all_sources() -> Vec<(&'static str, Cow<'static, str>, &'static [&'static str])> {
    let mut v: Vec<(&'static str, Cow<'static, str>, &'static [&'static str])> = Vec::new();
    let reduces = [
        Reduce::Shared,
        Reduce::Subgroup { min_size: 4 },
        Reduce::Subgroup { min_size: 32 },
        Reduce::Subgroup { min_size: 64 },
    ];
    for f in WeightFormat::ALL {
        for r in reduces {
            v.push(("matmul", f.matmul_source_with(r), &["main", "multi", "swiglu_pair"]));
            v.push(("matmul_ids", f.matmul_ids_source_with(r), &["main", "gate_up_swiglu", "down_combine", "tiles"]));
        }
        v.push(("get_rows", f.get_rows_source().into(), &["main", "embed_norm"]));
    }
    v.push(("rms_norm", RMS_NORM.into(), &["main", "norm_rope"]));
    static PAIRS: [pair::PairKernel; 2] = pair::PairKernel::ALL;
    for k in &PAIRS {
        v.push((k.name, k.source().into(), std::slice::from_ref(&k.entry)));
    }
    v.push(("rope", ROPE.into(), &["main"]));
    v.push(("attention", ATTENTION.into(), &["main", "keyed"]));
    v.push((
        "hc",
        HC.into(),
        &["pre", "post", "weights", "collapse", "weights_collapse", "weights_collapse_norm", "post_norm"],
    ));
    v.push(("compress", COMPRESS.into(), &["main"]));
    v.push(("indexer", INDEXER.into(), &["scores", "topk"]));
    v.push(("moe", MOE.into(), &["route", "swiglu", "swiglu_shared", "gather"]));
    v.push(("act", ACT.into(), &["fp8", "fp4", "hadamard", "rope_hadamard_fp4"]));
    v.push(("scale", SCALE.into(), &["main"]));
    v.push(("kvdev", KVDEV.into(), &["add_ape", "front_push"]));
    v.push(("moe_ids", MOE_IDS.into(), &["combine"]));
    v.push(("moe_group", MOE_GROUP.into(), &["group"]));
    v.push(("candidates", CANDIDATES.into(), &["main"]));
    v.push((
        "copy",
        copy_source().into(),
        &["copy1", "copy2", "copy3", "copy4", "copy5", "copy6", "copy7", "copy8", "zero"],
    ));
    v.push(("lane_probe", lane_probe_source(32).into(), &["main"]));
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
        let errors: Vec<String> = all_sources().into_iter().filter_map(|(n, s, e)| validate(n, &s, e).err()).collect();
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
        let errors: Vec<String> = all_sources().into_iter().flat_map(|(n, s, e)| translate(n, &s, e)).collect();
        assert!(errors.is_empty(), "{}", errors.join("\n\n"));
    }

    #[test]
    fn translation_check_reports_problems() {
        let ok = "@compute @workgroup_size(1) fn main() {}";
        assert!(translate("ok", ok, &["main"]).is_empty());
        assert_eq!(translate("missing", ok, &["other"]).len(), 1);
        assert_eq!(translate("broken", "@compute @workgroup_size(1) fn main() { let a: u32 = 1.5; }", &[]).len(), 1);
    }

    /// The Rust side's lanes per row (the dispatch geometry) is the WGSL's `ROW_LANES`, a power of two that
    /// divides the workgroup; a subgroup variant differs from the workgroup-memory one only in its prelude.
    #[test]
    fn row_lanes_agree_with_the_shaders() {
        for f in WeightFormat::ALL {
            let lanes = f.row_lanes();
            assert!(lanes.is_power_of_two() && PRODUCT_WORKGROUP.is_multiple_of(lanes), "{f:?}");
            let line = format!("const ROW_LANES: u32 = {lanes}u;");
            assert!(f.quant_source().contains(&line), "{f:?}: `{line}` missing");
            assert_eq!(f.quant_source().matches("const ROW_LANES").count(), 1, "{f:?}");
            let sg = f.matmul_source_with(Reduce::Subgroup { min_size: 32 });
            assert!(sg.starts_with("const SG: u32 = 32u;") && sg.contains("subgroupShuffleXor("));
            assert!(sg.ends_with(include_str!("wgsl/matmul.wgsl")));
            assert!(!f.matmul_source().contains("subgroupShuffleXor("));
        }
    }

    #[test]
    fn validator_rejects_a_broken_shader() {
        assert!(validate("broken", "@compute @workgroup_size(1) fn main() { let a: u32 = 1.5; }", &["main"]).is_err());
    }
}
