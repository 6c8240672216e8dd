//! The CUDA kernel sources and their launch plans, without any CUDA dependency.
//!
//! The kernels live under `kernels-native/cuda/` as CUDA C (see `docs/cuda.md`). This module embeds them as one
//! program ([`program_source`]: the files of [`FILES`] concatenated in order; no file includes another), names
//! every kernel entry point ([`KERNELS`], with the hot ones marked: a register spill there fails the compile check)
//! and computes each op's launch geometry from its shapes ([`Plan`]), validating the shapes on the way. The same
//! plans drive the device (`crate::cuda`, feature `cuda`), the host-shim tests (`ds4-tests`, test
//! `cuda_host_shim`) and the compile check (`kernels-native/tests/cuda_compile.rs`), so what the shim runs is what
//! the device runs.
//!
//! Activation layout on the device ("dq", `cuda/blocks.cuh`): a row of `n` values is `i8 q[n]`, `f32 d[n / V]`
//! (`V` = 32 for Q8_0, 256 for Q8_K) and, for Q8_K, `i32 bs[n / 16]`; the values equal the CPU's Q8_0 / Q8_K
//! activation blocks.

use std::fmt;

/// The kernel source files, in program order: `(file name, text)`.
pub const FILES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../cuda/common.cuh")),
    ("iq2_grid.cuh", include_str!("../cuda/iq2_grid.cuh")),
    ("blocks.cuh", include_str!("../cuda/blocks.cuh")),
    ("quant.cu", include_str!("../cuda/quant.cu")),
    ("matvec.cu", include_str!("../cuda/matvec.cu")),
    ("moe.cu", include_str!("../cuda/moe.cu")),
    ("rowops.cu", include_str!("../cuda/rowops.cu")),
    ("hc.cu", include_str!("../cuda/hc.cu")),
];

/// The whole program as NVRTC compiles it: every file of [`FILES`] with a `#line` marker before it, so compiler
/// messages name the right file and line.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, text) in FILES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// FNV-1a (64-bit) of [`program_source`]: the source part of the compiled-module cache key.
pub fn source_hash() -> u64 {
    fnv1a(program_source().as_bytes())
}

/// FNV-1a, 64-bit.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A kernel entry point of the program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// The `extern "C"` name.
    pub name: &'static str,
    /// Runs on every decode tick (products, MoE, norms): a register spill here fails the compile check.
    pub hot: bool,
}

const fn k(name: &'static str, hot: bool) -> KernelInfo {
    KernelInfo { name, hot }
}

/// Every kernel of the program (the compile check fails when ptxas reports one that is not here, or misses one).
pub const KERNELS: &[KernelInfo] = &[
    k("ds4_quantize_q8_0", true),
    k("ds4_quantize_q8_k", true),
    k("ds4_matvec_q8_0_b1", true),
    k("ds4_matvec_q8_0_b2", true),
    k("ds4_matvec_q8_0_b4", true),
    k("ds4_matvec_q8_0_b8", true),
    k("ds4_matvec_iq2_xxs_b1", true),
    k("ds4_matvec_iq2_xxs_b4", true),
    k("ds4_matvec_q2_k_b1", true),
    k("ds4_matvec_q2_k_b4", true),
    k("ds4_matvec_q4_k_b1", true),
    k("ds4_matvec_q4_k_b4", true),
    k("ds4_matvec_f16_b1", true),
    k("ds4_matvec_f16_b4", true),
    k("ds4_block_terms_q8_0", false),
    k("ds4_block_terms_iq2_xxs", false),
    k("ds4_block_terms_q2_k", false),
    k("ds4_block_terms_q4_k", false),
    k("ds4_moe_gate_up_iq2_xxs", true),
    k("ds4_moe_down_sum_iq2_xxs", true),
    k("ds4_moe_gate_up_q2_k", true),
    k("ds4_moe_down_sum_q2_k", true),
    k("ds4_moe_gate_up_q4_k", true),
    k("ds4_moe_down_sum_q4_k", true),
    k("ds4_rms_norm", true),
    k("ds4_rope", true),
    k("ds4_swiglu", true),
    k("ds4_moe_route", true),
    k("ds4_add", true),
    k("ds4_gather_rows", true),
    k("ds4_top_candidates", true),
    k("ds4_hc_weights", true),
    k("ds4_hc_head_weights", true),
    k("ds4_hc_collapse", true),
    k("ds4_hc_post", true),
    k("ds4_embed", true),
];

/// Weight types the kernels multiply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaWeight {
    /// Q8_0 (with Q8_0 activations).
    Q8_0,
    /// F16 (with f32 activations).
    F16,
    /// IQ2_XXS (with Q8_K activations).
    Iq2Xxs,
    /// Q2_K (with Q8_K activations).
    Q2K,
    /// Q4_K (with Q8_K activations).
    Q4K,
}

impl CudaWeight {
    /// Values per weight block.
    pub fn block_values(self) -> usize {
        match self {
            CudaWeight::Q8_0 => 32,
            CudaWeight::F16 => 4,
            _ => 256,
        }
    }

    /// Bytes per block of [`CudaWeight::block_values`] values.
    pub fn block_bytes(self) -> usize {
        match self {
            CudaWeight::Q8_0 => 34,
            CudaWeight::F16 => 8,
            CudaWeight::Iq2Xxs => 66,
            CudaWeight::Q2K => 84,
            CudaWeight::Q4K => 144,
        }
    }

    /// The kernel-name suffix (`q8_0`, `f16`, `iq2_xxs`, `q2_k`, `q4_k`).
    pub fn suffix(self) -> &'static str {
        match self {
            CudaWeight::Q8_0 => "q8_0",
            CudaWeight::F16 => "f16",
            CudaWeight::Iq2Xxs => "iq2_xxs",
            CudaWeight::Q2K => "q2_k",
            CudaWeight::Q4K => "q4_k",
        }
    }

    /// The activation format the products take.
    pub fn act(self) -> ActFormat {
        match self {
            CudaWeight::Q8_0 => ActFormat::Q8_0,
            CudaWeight::F16 => ActFormat::F32,
            _ => ActFormat::Q8K,
        }
    }

    /// Bytes of a row of `cols` values (`None` unless `cols` is whole blocks).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        (cols > 0 && cols.is_multiple_of(self.block_values())).then(|| cols / self.block_values() * self.block_bytes())
    }
}

/// Activation formats on the device (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// Plain f32.
    F32,
    /// Q8_0 values in the dq layout (scale per 32 values).
    Q8_0,
    /// Q8_K values in the dq layout (scale per 256 values, sums per 16).
    Q8K,
}

impl ActFormat {
    /// Values per scale (1 for f32).
    pub fn block_values(self) -> usize {
        match self {
            ActFormat::F32 => 1,
            ActFormat::Q8_0 => 32,
            ActFormat::Q8K => 256,
        }
    }
}

/// A shape the kernels cannot take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanError(pub String);

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda launch plan: {}", self.0)
    }
}

impl std::error::Error for PlanError {}

fn bad<T>(what: String) -> Result<T, PlanError> {
    Err(PlanError(what))
}

/// Grid and block dimensions of one launch (`x, y, z`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

/// The most experts a row may route to (`DS4_ROUTE_MAX_K` in `cuda/moe.cu`).
pub const MAX_ROUTE_K: usize = 16;

/// The most mHC streams the kernels take (`DS4_MAX_HC` in `cuda/hc.cu`; Flash has 4).
pub const MAX_HC: usize = 4;

/// The most candidates a row may ask for (the engine's `graph::MAX_LOGIT_CANDIDATES`).
pub const MAX_CANDIDATES: usize = 64;

/// Threads per CTA of the row-per-warp kernels (8 warps).
pub const CTA_THREADS: u32 = 256;
const WARPS: usize = (CTA_THREADS / 32) as usize;
/// The largest grid.y / grid.z the device accepts.
const MAX_GRID_YZ: usize = 65_535;

fn to_u32(v: usize, what: &str) -> Result<u32, PlanError> {
    u32::try_from(v).map_err(|_| PlanError(format!("{what} = {v} does not fit a launch dimension")))
}

fn grid_x(n: usize, per: usize, what: &str) -> Result<u32, PlanError> {
    if n == 0 {
        return bad(format!("{what} is 0"));
    }
    to_u32(n.div_ceil(per), what)
}

fn yz(v: usize, what: &str) -> Result<u32, PlanError> {
    if v == 0 || v > MAX_GRID_YZ {
        return bad(format!("{what} = {v} is outside 1..={MAX_GRID_YZ}"));
    }
    Ok(v as u32)
}

fn i32_fits(v: usize, what: &str) -> Result<(), PlanError> {
    if v > i32::MAX as usize {
        return bad(format!("{what} = {v} exceeds the kernels' 32-bit sizes"));
    }
    Ok(())
}

/// One launch: the kernel's name and its geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub kernel: &'static str,
    pub dims: Dims,
}

fn kernel(name: &str) -> &'static str {
    KERNELS.iter().find(|k| k.name == name).map(|k| k.name).unwrap_or("?")
}

impl Plan {
    /// Quantize `n` f32 values (whole rows, one after another) into `act` (Q8_0 or Q8_K).
    pub fn quantize(act: ActFormat, n: usize) -> Result<Plan, PlanError> {
        let (name, v) = match act {
            ActFormat::Q8_0 => ("ds4_quantize_q8_0", 32),
            ActFormat::Q8K => ("ds4_quantize_q8_k", 256),
            ActFormat::F32 => return bad("f32 activations are not quantized".into()),
        };
        if n == 0 || !n.is_multiple_of(v) {
            return bad(format!("{name}: {n} values is not a positive multiple of {v}"));
        }
        i32_fits(n / v, "blocks")?;
        Ok(Plan {
            kernel: kernel(name),
            dims: Dims { grid: [grid_x(n / v, WARPS, "blocks")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// The activation rows per launch of a product of `ntok` rows: the largest instantiated batch width not
    /// above `ntok` (decode ticks of 1, 2, 4 or 8 sessions run in one launch).
    pub fn matvec_width(ty: CudaWeight, ntok: usize) -> usize {
        let widths: &[usize] = match ty {
            CudaWeight::Q8_0 => &[8, 4, 2, 1],
            _ => &[4, 1],
        };
        widths.iter().copied().find(|&w| w <= ntok.max(1)).unwrap_or(1)
    }

    /// `y[t] = W · x[t]` for `ntok` activation rows, `W` of `rows × cols` in `ty`.
    pub fn matvec(ty: CudaWeight, rows: usize, cols: usize, ntok: usize) -> Result<Plan, PlanError> {
        if ty.row_bytes(cols).is_none() {
            return bad(format!("matvec {}: cols {cols} is not whole blocks of {}", ty.suffix(), ty.block_values()));
        }
        i32_fits(rows.max(cols).max(ntok), "rows/cols/ntok")?;
        let nb = Self::matvec_width(ty, ntok);
        let name = format!("ds4_matvec_{}_b{nb}", ty.suffix());
        Ok(Plan {
            kernel: kernel(&name),
            dims: Dims {
                grid: [grid_x(rows, WARPS, "rows")?, yz(ntok.div_ceil(nb), "token groups")?, 1],
                block: [CTA_THREADS, 1, 1],
            },
        })
    }

    /// The decode MoE's gate + up + SwiGLU over `n_used` selected experts of `ntok` tokens (`ffn` rows of `cols`).
    pub fn moe_gate_up(ty: CudaWeight, ffn: usize, cols: usize, n_used: usize, ntok: usize) -> Result<Plan, PlanError> {
        Self::check_moe(ty, cols)?;
        Ok(Plan {
            kernel: kernel(&format!("ds4_moe_gate_up_{}", ty.suffix())),
            dims: Dims {
                grid: [grid_x(ffn, WARPS, "ffn rows")?, yz(n_used, "experts used")?, yz(ntok, "tokens")?],
                block: [CTA_THREADS, 1, 1],
            },
        })
    }

    /// The decode MoE's down products summed over the selected experts (`d_model` rows of `ffn`).
    pub fn moe_down_sum(ty: CudaWeight, d_model: usize, ffn: usize, ntok: usize) -> Result<Plan, PlanError> {
        Self::check_moe(ty, ffn)?;
        Ok(Plan {
            kernel: kernel(&format!("ds4_moe_down_sum_{}", ty.suffix())),
            dims: Dims {
                grid: [grid_x(d_model, WARPS, "output rows")?, yz(ntok, "tokens")?, 1],
                block: [CTA_THREADS, 1, 1],
            },
        })
    }

    fn check_moe(ty: CudaWeight, cols: usize) -> Result<(), PlanError> {
        if !matches!(ty, CudaWeight::Iq2Xxs | CudaWeight::Q2K | CudaWeight::Q4K) {
            return bad(format!("no MoE kernel for {} experts", ty.suffix()));
        }
        if ty.row_bytes(cols).is_none() {
            return bad(format!("MoE {}: width {cols} is not whole blocks of 256", ty.suffix()));
        }
        Ok(())
    }

    /// RMSNorm of `rows` rows of `width` values.
    pub fn rms_norm(rows: usize, width: usize) -> Result<Plan, PlanError> {
        if width == 0 {
            return bad("rms_norm: width 0".into());
        }
        i32_fits(width, "width")?;
        Ok(Plan {
            kernel: kernel("ds4_rms_norm"),
            dims: Dims { grid: [grid_x(rows, 1, "rows")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// RoPE of `nvec` vectors of `width` values, rotating the last `2 · half`.
    pub fn rope(nvec: usize, width: usize, half: usize) -> Result<Plan, PlanError> {
        if half == 0 || 2 * half > width {
            return bad(format!("rope: {half} pairs do not fit vectors of {width}"));
        }
        i32_fits(nvec.max(width), "nvec/width")?;
        Ok(Plan {
            kernel: kernel("ds4_rope"),
            dims: Dims {
                grid: [grid_x(nvec * half, CTA_THREADS as usize, "pairs")?, 1, 1],
                block: [CTA_THREADS, 1, 1],
            },
        })
    }

    /// The clamped SwiGLU over `n` values.
    pub fn swiglu(n: usize) -> Result<Plan, PlanError> {
        Ok(Plan {
            kernel: kernel("ds4_swiglu"),
            dims: Dims { grid: [grid_x(n, CTA_THREADS as usize, "values")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// Routing of `n` rows over `ne` experts, `k` chosen each (one thread per row).
    pub fn moe_route(n: usize, ne: usize, k: usize) -> Result<Plan, PlanError> {
        if k == 0 || k > MAX_ROUTE_K || k > ne {
            return bad(format!("moe_route: {k} experts of {ne} (at most {MAX_ROUTE_K})"));
        }
        i32_fits(n.max(ne), "rows/experts")?;
        Ok(Plan {
            kernel: kernel("ds4_moe_route"),
            dims: Dims { grid: [grid_x(n, CTA_THREADS as usize, "rows")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// `y += x` over `n` values.
    pub fn add(n: usize) -> Result<Plan, PlanError> {
        Ok(Plan {
            kernel: kernel("ds4_add"),
            dims: Dims { grid: [grid_x(n, CTA_THREADS as usize, "values")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// Gathers `n` rows of `width` values (grid: column blocks × rows).
    pub fn gather_rows(width: usize, n: usize) -> Result<Plan, PlanError> {
        i32_fits(width, "width")?;
        Ok(Plan {
            kernel: kernel("ds4_gather_rows"),
            dims: Dims {
                grid: [grid_x(width, CTA_THREADS as usize, "width")?, yz(n, "rows")?, 1],
                block: [CTA_THREADS, 1, 1],
            },
        })
    }

    /// The `k` best of each of `n` rows of `vocab` values (one CTA per row).
    pub fn top_candidates(n: usize, vocab: usize, k: usize) -> Result<Plan, PlanError> {
        if k == 0 || k > MAX_CANDIDATES {
            return bad(format!("top_candidates: k = {k} outside 1..={MAX_CANDIDATES}"));
        }
        i32_fits(vocab, "vocab")?;
        Ok(Plan {
            kernel: kernel("ds4_top_candidates"),
            dims: Dims { grid: [grid_x(n, 1, "rows")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// The embedding rows of `n` tokens (`d` values) into every stream of their rows.
    pub fn embed(d: usize, n: usize) -> Result<Plan, PlanError> {
        i32_fits(d, "d")?;
        Ok(Plan {
            kernel: kernel("ds4_embed"),
            dims: Dims { grid: [grid_x(d, CTA_THREADS as usize, "d")?, yz(n, "rows")?, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// mHC `pre`, `post`, `comb` of `n` rows (one thread per row; `hc` ≤ [`MAX_HC`]).
    pub fn hc_weights(n: usize, hc: usize) -> Result<Plan, PlanError> {
        Self::check_hc(hc)?;
        Ok(Plan {
            kernel: kernel("ds4_hc_weights"),
            dims: Dims { grid: [grid_x(n, CTA_THREADS as usize, "rows")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// The head's mHC `pre` of `n` rows.
    pub fn hc_head_weights(n: usize, hc: usize) -> Result<Plan, PlanError> {
        Self::check_hc(hc)?;
        Ok(Plan {
            kernel: kernel("ds4_hc_head_weights"),
            dims: Dims { grid: [grid_x(n * hc, CTA_THREADS as usize, "values")?, 1, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    /// mHC collapse (`name` = `ds4_hc_collapse`) or post-mix (`ds4_hc_post`) of `n` rows of `hc` streams of `d`.
    pub fn hc_rows(name: &str, n: usize, hc: usize, d: usize) -> Result<Plan, PlanError> {
        Self::check_hc(hc)?;
        i32_fits(d, "d")?;
        Ok(Plan {
            kernel: kernel(name),
            dims: Dims { grid: [grid_x(d, CTA_THREADS as usize, "d")?, yz(n, "rows")?, 1], block: [CTA_THREADS, 1, 1] },
        })
    }

    fn check_hc(hc: usize) -> Result<(), PlanError> {
        if hc == 0 || hc > MAX_HC {
            return bad(format!("mHC with {hc} streams (the kernels take 1..={MAX_HC})"));
        }
        Ok(())
    }

    /// The test hook: per-block terms of one row of `nb` blocks (one warp).
    pub fn block_terms(ty: CudaWeight) -> Result<Plan, PlanError> {
        if ty == CudaWeight::F16 {
            return bad("f16 has no integer block terms".into());
        }
        Ok(Plan {
            kernel: kernel(&format!("ds4_block_terms_{}", ty.suffix())),
            dims: Dims { grid: [1, 1, 1], block: [32, 1, 1] },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_planned_kernel_is_listed() {
        // (That every listed kernel is defined, and nothing else, is checked against ptxas's list of entry
        // points by the compile check, tests/cuda_compile.rs.)
        let tys = [CudaWeight::Q8_0, CudaWeight::F16, CudaWeight::Iq2Xxs, CudaWeight::Q2K, CudaWeight::Q4K];
        for ty in tys {
            for ntok in 1..=9 {
                let p = Plan::matvec(ty, 100, ty.block_values() * 3, ntok).unwrap();
                assert_ne!(p.kernel, "?", "{ty:?} × {ntok}");
                let w = Plan::matvec_width(ty, ntok) as u32;
                assert!(w as usize <= ntok && p.dims.grid[1] * w >= ntok as u32);
            }
            if ty != CudaWeight::F16 {
                assert_ne!(Plan::block_terms(ty).unwrap().kernel, "?");
            }
        }
        for ty in [CudaWeight::Iq2Xxs, CudaWeight::Q2K, CudaWeight::Q4K] {
            assert_ne!(Plan::moe_gate_up(ty, 2048, 4096, 6, 1).unwrap().kernel, "?");
            assert_ne!(Plan::moe_down_sum(ty, 4096, 2048, 1).unwrap().kernel, "?");
        }
    }

    #[test]
    fn geometry_covers_the_shapes() {
        let p = Plan::matvec(CudaWeight::Q8_0, 4097, 4096, 1).unwrap();
        assert_eq!(p.dims, Dims { grid: [513, 1, 1], block: [256, 1, 1] });
        assert_eq!(p.kernel, "ds4_matvec_q8_0_b1");
        let p = Plan::matvec(CudaWeight::Q8_0, 64, 64, 11).unwrap();
        assert_eq!((p.kernel, p.dims.grid), ("ds4_matvec_q8_0_b8", [8, 2, 1]));
        let p = Plan::moe_gate_up(CudaWeight::Iq2Xxs, 2048, 4096, 6, 3).unwrap();
        assert_eq!(p.dims.grid, [256, 6, 3]);
        let p = Plan::quantize(ActFormat::Q8K, 6 * 2048).unwrap();
        assert_eq!(p.dims.grid, [6, 1, 1]);
        assert_eq!(Plan::rope(64 * 3, 512, 32).unwrap().dims.grid, [24, 1, 1]);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(Plan::matvec(CudaWeight::Q4K, 10, 100, 1).is_err());
        assert!(Plan::matvec(CudaWeight::Q8_0, 0, 64, 1).is_err());
        assert!(Plan::matvec(CudaWeight::Q8_0, 10, 0, 1).is_err());
        assert!(Plan::matvec(CudaWeight::Q8_0, 10, 64, 0).is_err());
        assert!(Plan::quantize(ActFormat::Q8_0, 33).is_err());
        assert!(Plan::quantize(ActFormat::F32, 32).is_err());
        assert!(Plan::moe_gate_up(CudaWeight::Q8_0, 64, 256, 6, 1).is_err());
        assert!(Plan::moe_gate_up(CudaWeight::Q2K, 64, 256, 0, 1).is_err());
        assert!(Plan::moe_gate_up(CudaWeight::Q2K, 64, 256, 6, 70_000).is_err());
        assert!(Plan::rope(4, 8, 5).is_err());
        assert!(Plan::rms_norm(4, 0).is_err());
        assert!(Plan::matvec(CudaWeight::F16, usize::MAX / 2, 64, 1).is_err());
    }

    #[test]
    fn source_hash_changes_with_the_source() {
        assert_eq!(source_hash(), fnv1a(program_source().as_bytes()));
        assert_ne!(fnv1a(b"a"), fnv1a(b"b"));
        assert!(program_source().starts_with("#line 1 \"common.cuh\""));
    }
}
