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
use ds4_engine::quant::{self, GgmlType};

use crate::kernels::Kernels;
use ds4_engine::backend::cpu::matmul;
use ds4_engine::backend::cpu::pool::Pool;
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::model::Mat;

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
        let m = Mat { ty, rows, cols, row_bytes, data: w };
        matmul::matmul(self.pool(), m, x, 1, y)?;
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
        if act == GgmlType::F32 {
            let k = quant::dot_f32_kernel(ty)?;
            for (wr, yr) in w.chunks_exact(rb).zip(ys.chunks_exact_mut(batch)) {
                for (y, x) in yr.iter_mut().zip(xs.chunks_exact(cols)) {
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
            for (wr, yr) in w.chunks_exact(rb).zip(ys.chunks_exact_mut(batch)) {
                for (y, a) in yr.iter_mut().zip(all.chunks_exact(ab)) {
                    *y = k(wr, a);
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{fill, Rng};

    /// The batched path must agree with the engine's matvec row for row (same quantized activations).
    #[test]
    fn matmul_matches_matvec() {
        let mut rng = Rng::new(3);
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs, GgmlType::F16] {
            let (rows, cols, nb) = (5usize, 512usize, 3usize);
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
        let mut rng = Rng::new(5);
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

    #[test]
    fn bad_shapes_are_errors() {
        let w = vec![0u8; 34];
        let mut ys = vec![0f32; 2];
        assert!(EngineKernels::new(2).matmul(GgmlType::Q8_0, &w, 1, 32, &[0.0; 32], 2, &mut ys).is_err());
        assert!(EngineKernels::new(2).matmul(GgmlType::Q8_0, &w, 1, 31, &[0.0; 62], 2, &mut ys).is_err());
        assert!(EngineKernels::new(2).matvec(GgmlType::Q8_0, &w, 2, 32, &[0.0; 32], &mut ys).is_err());
    }
}
