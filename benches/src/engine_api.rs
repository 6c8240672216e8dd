//! Every call the benchmark makes into `ds4-engine` that is not plain data access lives here, so API changes in the
//! engine touch one file.
//!
//! [`EngineKernels`] binds [`crate::kernels::Kernels`] to the engine's quant API: `matvec` is
//! `quant::matvec_with_scratch` (activations quantized once per call, best SIMD path); `matmul` quantizes the whole
//! activation batch once per call with `quant::quantize_acts` and runs the `quant::dot_q_kernel` (or
//! `dot_f32_kernel` for float weights) of every weight row against every activation row, row-major, so each
//! weight row is loaded from memory once and reused from L1 for the whole batch.
//!
//! [`engine_for`] builds an [`Engine`] from an opened GGUF (file or in-memory synthetic) with the bench's options.

use std::cell::RefCell;
use std::sync::OnceLock;

use anyhow::{bail, Result};
use ds4_engine::quant::{self, GgmlType, PackedMat};

use crate::kernels::{Kernels, MoeWeights, PooledMatmul};
use ds4_engine::backend::cpu::matmul::{self, Acts, Kernel, Out, Product, RowAt};
use ds4_engine::backend::cpu::pool::Pool;
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::model::{packing_on, Mat};

/// How the benchmark builds an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Worker threads (0 = all cores).
    pub threads: usize,
    /// Context per session.
    pub ctx: usize,
    /// Rows per engine tick (prefill chunk).
    pub batch_tokens: usize,
    /// `cpu` or `wgpu`.
    pub backend: String,
    /// Activation simulation off, cached state in f32 (the golden-comparison mode).
    pub exact: bool,
    /// Groups of ops on a second backend (`--placement experts=cpu`).
    pub placement: ds4_engine::exec::Placement,
}

/// An engine on an opened (file-backed or in-memory) model.
pub fn engine_for(file: GgufFile, c: &EngineConfig) -> Result<Engine> {
    engine_with_acts(file, c, false)
}

/// [`engine_for`] with the CPU backend's `f32_acts` option (quantized weights times f32 activations, no Q8_0/Q8_K
/// activation quantization; `ds4_engine::engine::EngineOptions::f32_acts`).
pub fn engine_with_acts(file: GgufFile, c: &EngineConfig, f32_acts: bool) -> Result<Engine> {
    let backend: BackendKind = c.backend.parse()?;
    let opts = EngineOptions {
        backend,
        threads: c.threads,
        ctx: c.ctx,
        max_batch_tokens: c.batch_tokens,
        exact: c.exact,
        f32_acts,
        placement: c.placement,
        ..EngineOptions::default()
    };
    Ok(Engine::from_gguf(file, opts)?)
}

/// The engine's CPU quant kernels (and, for `pooled_matvec`, its CPU backend's matmul on its worker pool).
pub struct EngineKernels {
    threads: usize,
    pool: OnceLock<Pool>,
}

impl EngineKernels {
    /// Kernels whose pooled path uses `threads` threads.
    pub fn new(threads: usize) -> EngineKernels {
        EngineKernels { threads, pool: OnceLock::new() }
    }

    fn pool(&self) -> &Pool {
        self.pool.get_or_init(|| Pool::new(self.threads))
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static MOE: RefCell<MoeBufs> = RefCell::new(MoeBufs::default());
}

/// A stacked expert tensor as a matrix of whole rows.
fn moe_mat(ty: GgmlType, cols: usize, data: &[u8]) -> Result<Mat<'_>> {
    let Some(rb) = ty.row_bytes(cols as u64).map(|b| b as usize).filter(|&b| b > 0) else {
        bail!("moe: {cols} values is not whole {ty} blocks");
    };
    Ok(Mat { ty, rows: data.len() / rb, cols, row_bytes: rb, data, packed: None })
}

/// Buffers of [`EngineKernels::pooled_moe`] (grown once, reused).
#[derive(Default)]
struct MoeBufs {
    xa: Acts,
    ha: Acts,
    h1: Vec<f32>,
    h3: Vec<f32>,
    eo: Vec<f32>,
}

impl Kernels for EngineKernels {
    fn matvec(&self, ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
        SCRATCH.with(|s| quant::matvec_with_scratch(ty, w, rows, cols, x, y, &mut s.borrow_mut()))?;
        Ok(())
    }

    fn pooled_matvec(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<bool> {
        let Some(row_bytes) = ty.row_bytes(cols as u64).map(|b| b as usize) else {
            bail!("matvec: {cols} values is not whole {ty} blocks");
        };
        let m = Mat { ty, rows, cols, row_bytes, data: w, packed: None };
        matmul::matmul(self.pool(), m, x, 1, y)?;
        Ok(true)
    }

    /// The CPU backend's prefill matmul (`backend::cpu::matmul::matmul`, one call per matrix) with each matrix in
    /// the layout a loaded model gives it: Q8_0 packed once (`quant::PackedMat`, as `Model::pack_dense` does; not
    /// with `DS4_CPU_PACK=0`, where this CPU has no packed kernel, or for rows too wide to gain,
    /// `PackedMat::pays_for`), every other type as stored.
    fn pooled_matmul<'a>(
        &'a self,
        ty: GgmlType,
        w: &'a [u8],
        rows: usize,
        cols: usize,
        matrices: usize,
    ) -> Result<Option<PooledMatmul<'a>>> {
        let Some(row_bytes) = ty.row_bytes(cols as u64).map(|b| b as usize).filter(|&b| b > 0) else {
            bail!("matmul: {cols} values is not whole {ty} blocks");
        };
        let mb = rows * row_bytes;
        if rows == 0 || matrices == 0 || w.len() < matrices * mb {
            bail!("matmul: {} weight bytes do not hold {matrices} matrices of {rows} rows", w.len());
        }
        let packs = quant::dot_q_packed_kernel(ty).is_some() && packing_on() && PackedMat::pays_for(cols);
        let packed: Vec<Option<PackedMat>> = if packs {
            w.chunks_exact(mb).take(matrices).map(|m| PackedMat::pack_q8_0(m, rows, row_bytes)).collect()
        } else {
            Vec::new()
        };
        let pool = self.pool();
        Ok(Some(Box::new(move |xs: &[f32], batch: usize, ys: &mut [f32]| {
            if batch == 0 || xs.len() != batch * cols || ys.len() != matrices * rows * batch {
                bail!("matmul: shapes do not match ({} xs, {} ys, batch {batch})", xs.len(), ys.len());
            }
            for (m, ym) in ys.chunks_exact_mut(rows * batch).enumerate() {
                let data = &w[m * mb..(m + 1) * mb];
                let packed = packed.get(m).and_then(|p| p.as_ref()).map(|p| p.view());
                matmul::matmul(pool, Mat { ty, rows, cols, row_bytes, data, packed }, xs, batch, ym)?;
            }
            Ok(())
        })))
    }

    /// The CPU backend's grouped MoE dispatch (`backend::cpu::moe`), without routing: input quantized once, one
    /// `run_group` for every selected expert's gate and up, SwiGLU (unclamped), the down inputs quantized across the
    /// pool, one `run_group` for every down, then the sum.
    fn pooled_moe(&self, w: &MoeWeights<'_>, sel: &[usize], x: &[f32], y: &mut [f32]) -> Result<bool> {
        let (d, ffn, k) = (w.d, w.ffn, sel.len());
        let (gm, um, dm) =
            (moe_mat(w.gate_ty, d, w.gate)?, moe_mat(w.gate_ty, d, w.up)?, moe_mat(w.down_ty, ffn, w.down)?);
        if x.len() != d || y.len() != d || sel.iter().any(|&e| (e + 1) * ffn > gm.rows || (e + 1) * d > dm.rows) {
            bail!("moe: shapes do not match");
        }
        let pool = self.pool();
        let (kg, kd) = (Kernel::for_pool(pool, w.gate_ty, d)?, Kernel::for_pool(pool, w.down_ty, ffn)?);
        MOE.with(|b| -> Result<()> {
            let b = &mut *b.borrow_mut();
            for v in [&mut b.h1, &mut b.h3] {
                v.resize(k * ffn, 0.0);
            }
            b.eo.resize(k * d, 0.0);
            b.xa.prepare(&kg, x, RowAt::Strided { stride: d, off: 0 }, 1, d)?;
            {
                let (xa, o1, o3) = (&b.xa, Out::new(&mut b.h1, ffn, 0), Out::new(&mut b.h3, ffn, 0));
                let p = |u: usize| {
                    let (m, out) = if u & 1 == 0 { (gm, o1) } else { (um, o3) };
                    let input = xa.input(&kg, x, d, RowAt::Strided { stride: 1, off: 0 });
                    Product {
                        w: m.rows_slice(sel[u / 2] * ffn, ffn),
                        k: kg,
                        input,
                        n: 1,
                        out: out.shifted(u / 2 * ffn),
                    }
                };
                // SAFETY: product `u` writes row `u / 2` of h1 (even) or h3 (odd) only; both outlive the call.
                unsafe { matmul::run_group(pool, 2 * k, ffn, matmul::grain_rows(gm.row_bytes), &p) };
            }
            for (a, &g) in b.h1.iter_mut().zip(&b.h3) {
                *a = *a / (1.0 + (-*a).exp()) * g;
            }
            b.ha.prepare_par(pool, &kd, &b.h1, RowAt::Strided { stride: ffn, off: 0 }, k, ffn)?;
            {
                let (ha, h1, oe) = (&b.ha, &b.h1, Out::new(&mut b.eo, d, 0));
                let p = |u: usize| {
                    let input = ha.input(&kd, h1, ffn, RowAt::Strided { stride: 1, off: u });
                    Product { w: dm.rows_slice(sel[u] * d, d), k: kd, input, n: 1, out: oe.shifted(u * d) }
                };
                // SAFETY: product `u` writes row `u` of eo only; eo outlives the call.
                unsafe { matmul::run_group(pool, k, d, matmul::grain_rows(dm.row_bytes), &p) };
            }
            y.fill(0.0);
            for e in b.eo.chunks_exact(d) {
                for (o, v) in y.iter_mut().zip(e) {
                    *o += v;
                }
            }
            Ok(())
        })?;
        Ok(true)
    }

    fn matmul(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        xs: &[f32],
        batch: usize,
        ys: &mut [f32],
    ) -> Result<()> {
        let Some(rb) = ty.row_bytes(cols as u64).map(|b| b as usize) else {
            bail!("matmul: {cols} values is not whole {ty} blocks");
        };
        if w.len() != rows * rb || xs.len() != batch * cols || ys.len() != rows * batch || batch == 0 {
            bail!("matmul: shapes do not match ({} weight bytes, {} xs, {} ys)", w.len(), xs.len(), ys.len());
        }
        let act = quant::act_type(ty);
        if act.is_f32() {
            // Four rows per call where the type has a four-row kernel, as the engine's matmul does.
            let k = quant::dot_f32_kernel(ty)?;
            let k4 = quant::dot_f4_kernel(ty);
            let x = |b: usize| &xs[b * cols..(b + 1) * cols];
            for (wr, yr) in w.chunks_exact(rb).zip(ys.chunks_exact_mut(batch)) {
                let b = k4.map_or(0, |k4| rows_at_once(k4, wr, yr, 0, &x));
                for (y, x) in yr[b..].iter_mut().zip(xs[b * cols..].chunks_exact(cols)) {
                    *y = k(wr, x);
                }
            }
            return Ok(());
        }
        let k = quant::dot_q_kernel(ty)?;
        let ab = act.row_bytes(cols as u64).map(|b| b as usize).unwrap_or(0);
        SCRATCH.with(|s| -> Result<()> {
            let mut all = s.borrow_mut();
            all.clear();
            let mut one = Vec::with_capacity(ab);
            for x in xs.chunks_exact(cols) {
                quant::quantize_acts(act, x, &mut one)?;
                all.extend_from_slice(&one);
            }
            // All rows per call where the type has an any-row-count kernel, else eight, then four activation rows
            // per call where it has those, with the rows' block scales converted once, as the engine's matmul does.
            let (k4, k8) = (quant::dot_q4_kernel(ty), quant::dot_q8_kernel(ty));
            let mut scales = Vec::new();
            quant::act_block_scales(act, &all, &mut scales);
            let per_row = scales.len() / batch;
            let d = |b: usize| scales.get(b * per_row..(b + 1) * per_row).unwrap_or(&[]);
            // Row `b`: its quantized bytes and its block scales.
            let a = |b: usize| (&all[b * ab..(b + 1) * ab], d(b));
            // The any-row-count kernel, where the type has one, takes every row (two or more) in one call; the
            // flipped one (Q8_0 on AVX-512 VNNI) every row, one included, on activations flipped once.
            let kn = quant::dot_q_rows_kernel(ty).filter(|_| batch > 1);
            let (arows, drows): (Vec<&[u8]>, Vec<&[f32]>) = (0..batch).map(a).unzip();
            let kf = quant::dot_q_flipped_kernel(ty);
            let mut lines = Vec::new();
            quant::flip_acts(act, &all, ab, &mut lines);
            let fl = quant::flip_row_lines(ab);
            let frows: Vec<&[u8]> = lines.chunks_exact(fl.max(1)).map(bytemuck::cast_slice).collect();
            for (wr, yr) in w.chunks_exact(rb).zip(ys.chunks_exact_mut(batch)) {
                let mut b = 0;
                if let (Some(kf), true) = (kf, frows.len() == batch) {
                    kf(wr, &frows, &drows, yr);
                    b = batch;
                }
                if let (Some(kn), 0) = (kn, b) {
                    kn(wr, rb, &arows, &drows, yr);
                    b = batch;
                }
                if let Some(k8) = k8 {
                    b = rows_at_once::<(&[u8], &[f32]), 8, _>(
                        |wr, r| k8(wr, r.map(|r| r.0), r.map(|r| r.1)),
                        wr,
                        yr,
                        b,
                        &a,
                    );
                }
                if let Some(k4) = k4 {
                    b = rows_at_once::<(&[u8], &[f32]), 4, _>(
                        |wr, r| k4(wr, r.map(|r| r.0), r.map(|r| r.1)),
                        wr,
                        yr,
                        b,
                        &a,
                    );
                }
                for (y, a) in yr[b..].iter_mut().zip(all[b * ab..].chunks_exact(ab)) {
                    *y = k(wr, a);
                }
            }
            Ok(())
        })
    }
}

/// Calls the `R`-row kernel `k` for weight row `wr` on batch rows `b, b + 1, ..` (activation row `a(b)`) while
/// `R` rows remain, writing `y[b]`; returns the first row not done.
fn rows_at_once<A: Copy, const R: usize, K: Fn(&[u8], [A; R]) -> [f32; R]>(
    k: K,
    wr: &[u8],
    y: &mut [f32],
    mut b: usize,
    a: &dyn Fn(usize) -> A,
) -> usize {
    while b + R <= y.len() {
        y[b..b + R].copy_from_slice(&k(wr, std::array::from_fn(|i| a(b + i))));
        b += R;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{fill, SplitMix64};

    /// The batched path must agree with the engine's matvec row for row (same quantized activations).
    #[test]
    fn matmul_matches_matvec() {
        let mut rng = SplitMix64::new(3);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs, GgmlType::F16] {
            // Six batch rows: one call of the any-row-count kernel where the type has one, else the eight-/four-row
            // kernels and single dots.
            let (rows, cols, nb) = (5usize, 512usize, 6usize);
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let mut w = vec![0u8; rows * rb];
            fill(ty, &mut w, 0.1, &mut rng);
            let xs: Vec<f32> = (0..nb * cols).map(|_| rng.next_sym()).collect();
            let mut ys = vec![0f32; rows * nb];
            EngineKernels::new(2).matmul(ty, &w, rows, cols, &xs, nb, &mut ys).unwrap();
            for b in 0..nb {
                let mut y = vec![0f32; rows];
                EngineKernels::new(2).matvec(ty, &w, rows, cols, &xs[b * cols..(b + 1) * cols], &mut y).unwrap();
                for r in 0..rows {
                    assert_eq!(ys[r * nb + b], y[r], "{ty} row {r} batch {b}");
                }
            }
        }
    }

    /// The engine's pooled decode matmul agrees with the quant matvec.
    #[test]
    fn pooled_matvec_matches_matvec() {
        let mut rng = SplitMix64::new(5);
        let k = EngineKernels::new(2);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs, GgmlType::F16] {
            let (rows, cols) = (64usize, 512usize);
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let mut w = vec![0u8; rows * rb];
            fill(ty, &mut w, 0.1, &mut rng);
            let x: Vec<f32> = (0..cols).map(|_| rng.next_sym()).collect();
            let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
            assert!(k.pooled_matvec(ty, &w, rows, cols, &x, &mut a).unwrap());
            k.matvec(ty, &w, rows, cols, &x, &mut b).unwrap();
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{ty}: {p} vs {q}");
            }
        }
    }

    /// The engine's pooled prefill matmul (Q8_0 packed) agrees with the batched path, one matrix after another.
    #[test]
    fn pooled_matmul_matches_matmul() {
        let mut rng = SplitMix64::new(7);
        let k = EngineKernels::new(2);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs, GgmlType::F16] {
            let (rows, cols, mats, nb) = (40usize, 512usize, 3usize, 6usize);
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let mut w = vec![0u8; mats * rows * rb];
            fill(ty, &mut w, 0.1, &mut rng);
            let xs: Vec<f32> = (0..nb * cols).map(|_| rng.next_sym()).collect();
            let mut got = vec![0f32; mats * rows * nb];
            let mut run = k.pooled_matmul(ty, &w, rows, cols, mats).unwrap().expect("the engine offers it");
            run(&xs, nb, &mut got).unwrap();
            assert!(run(&xs, nb, &mut got[1..]).is_err(), "{ty}: short output");
            for m in 0..mats {
                let mut want = vec![0f32; rows * nb];
                k.matmul(ty, &w[m * rows * rb..(m + 1) * rows * rb], rows, cols, &xs, nb, &mut want).unwrap();
                for (r, b) in (0..rows).flat_map(|r| (0..nb).map(move |b| (r, b))) {
                    let (p, q) = (got[m * rows * nb + b * rows + r], want[r * nb + b]);
                    assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{ty} matrix {m} row {r} batch {b}: {p} vs {q}");
                }
            }
        }
        assert!(k.pooled_matmul(GgmlType::Q8_0, &[0u8; 34], 2, 32, 1).is_err(), "too few weight bytes");
    }

    /// The grouped MoE dispatch equals per-expert quant matvecs exactly (same quantized activations and dots).
    #[test]
    fn pooled_moe_matches_per_expert_matvecs() {
        let mut rng = SplitMix64::new(9);
        let (d, ffn, ne) = (512usize, 256usize, 5usize);
        let (gt, dt) = (GgmlType::Iq2Xxs, GgmlType::Q2K);
        let (grb, drb) = (gt.row_bytes(d as u64).unwrap() as usize, dt.row_bytes(ffn as u64).unwrap() as usize);
        let (mut gate, mut up, mut down) =
            (vec![0u8; ne * ffn * grb], vec![0u8; ne * ffn * grb], vec![0u8; ne * d * drb]);
        fill(gt, &mut gate, 0.1, &mut rng);
        fill(gt, &mut up, 0.1, &mut rng);
        fill(dt, &mut down, 0.1, &mut rng);
        let x: Vec<f32> = (0..d).map(|_| rng.next_sym()).collect();
        let w = MoeWeights { gate_ty: gt, down_ty: dt, d, ffn, gate: &gate, up: &up, down: &down };
        let sel = [3usize, 0, 4];
        let mut y = vec![0f32; d];
        assert!(EngineKernels::new(3).pooled_moe(&w, &sel, &x, &mut y).unwrap());
        let mut want = vec![0f32; d];
        for &e in &sel {
            let (mut g, mut u, mut o) = (vec![0f32; ffn], vec![0f32; ffn], vec![0f32; d]);
            quant::matvec(gt, &gate[e * ffn * grb..(e + 1) * ffn * grb], ffn, d, &x, &mut g).unwrap();
            quant::matvec(gt, &up[e * ffn * grb..(e + 1) * ffn * grb], ffn, d, &x, &mut u).unwrap();
            for (a, b) in g.iter_mut().zip(&u) {
                *a = *a / (1.0 + (-*a).exp()) * b;
            }
            quant::matvec(dt, &down[e * d * drb..(e + 1) * d * drb], d, ffn, &g, &mut o).unwrap();
            for (s, v) in want.iter_mut().zip(&o) {
                *s += v;
            }
        }
        assert_eq!(y, want);
        assert!(EngineKernels::new(2).pooled_moe(&w, &[ne], &x, &mut y).is_err(), "expert out of range");
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = vec![0u8; 34];
        let mut ys = vec![0f32; 2];
        assert!(EngineKernels::new(2).matmul(GgmlType::Q8_0, &w, 1, 32, &[0.0; 32], 2, &mut ys).is_err());
        assert!(EngineKernels::new(2).matmul(GgmlType::Q8_0, &w, 1, 31, &[0.0; 62], 2, &mut ys).is_err());
        assert!(EngineKernels::new(2).matvec(GgmlType::Q8_0, &w, 2, 32, &[0.0; 32], &mut ys).is_err());
    }
}
