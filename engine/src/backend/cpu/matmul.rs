//! Matrix products against weights in the map: `y[b, o] = W[o, :] · x[b, :]` for a batch of activation rows.
//!
//! Work is split over output rows across the pool; each weight row is read once per batch (matrix-matrix work in
//! prefill). Determinism: every output element is one dot-product call whose accumulation order depends only on
//! the row length, never on the batch size or thread count — so one-pass prefill, chunked prefill and decode
//! produce bit-identical projections.
//!
//! Kernels: F32 weights use [`dot_f32`] here (the golden-checked path); F16/BF16 use `quant::dot_f32_kernel`;
//! quantized weights (Q8_0, Q2_K, Q4_K, IQ2_XXS) quantize each activation row once per call into
//! `quant::act_type` (Q8_0 / Q8_K, as ggml does) and use `quant::dot_q_kernel`. Types without a kernel are
//! rejected at load by [`supports`].
//!
//! Activation quantization is the CPU's one deliberate approximation: each activation is rounded to a grid of
//! `amax/127` per block of 32 (Q8_0) or 256 (Q8_K) values, an error of up to half a step per activation. When the
//! pool says [`Pool::f32_acts`] (engine option `f32_acts`), quantized weights use `quant::dot_f32_kernel` with f32
//! activations instead — what the wgpu backend computes — so cross-backend checks compare the kernels alone.

use std::cell::RefCell;

use crate::backend::cpu::pool::{split, Pool};
use crate::model::weights::Mat;
use crate::quant::{self, DotF32, DotQ, GgmlType};
use crate::{Error, Result};

/// Whether matrices of type `ty` can be multiplied (and their rows dequantized).
pub fn supports(ty: GgmlType) -> bool {
    ty == GgmlType::F32 || quant::dot_f32_kernel(ty).is_ok()
}

/// Batch rows processed together against each weight row (cache blocking; results do not depend on it).
const BATCH_BLOCK: usize = 8;

/// The dot product used for a weight type.
#[derive(Clone, Copy)]
enum Kernel {
    F32,
    F(DotF32),
    Q { act: GgmlType, dot: DotQ, act_bytes: usize },
}

fn kernel(ty: GgmlType, cols: usize, f32_acts: bool) -> Result<Kernel> {
    if ty == GgmlType::F32 {
        return Ok(Kernel::F32);
    }
    let act = quant::act_type(ty);
    if act != GgmlType::F32 && !f32_acts {
        if let (Ok(dot), Some(b)) = (quant::dot_q_kernel(ty), act.row_bytes(cols as u64)) {
            return Ok(Kernel::Q { act, dot, act_bytes: b as usize });
        }
    }
    Ok(Kernel::F(quant::dot_f32_kernel(ty)?))
}

thread_local! {
    static ACTS: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// f32 dot product with 8 independent accumulators (fixed order for a given length).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Dequantizes one row of `ty` (`bytes` = exactly one row of `out.len()` values).
pub fn dequant_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    quant::dequantize_row(ty, bytes, out)
}

/// A raw pointer that tasks write through at disjoint indices.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);
// SAFETY: used only for writes to disjoint indices from pool tasks, while the owning slice is borrowed mutably by
// the function that spawned them.
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the raw field).
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

/// `y[b * w.rows + o] = W[o] · x[b * w.cols ..]` for `b < n`. `x.len() >= n * w.cols`, `y.len() >= n * w.rows`.
pub fn matmul(pool: &Pool, w: Mat<'_>, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
    matmul_strided(pool, w, x, n, (w.cols, 0), y, (w.rows, 0))
}

/// Strided form: input row `b` is `x[b * xs.0 + xs.1 ..][..w.cols]`, output element `(b, o)` is
/// `y[b * ys.0 + ys.1 + o]`.
pub fn matmul_strided(
    pool: &Pool,
    w: Mat<'_>,
    x: &[f32],
    n: usize,
    xs: (usize, usize),
    y: &mut [f32],
    ys: (usize, usize),
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let cols = w.cols;
    assert!((n - 1) * xs.0 + xs.1 + cols <= x.len(), "matmul input shape");
    run(pool, w, n, &|b| b * xs.0 + xs.1, x, y, (ys.0, ys.1))
}

/// Like [`matmul`] but on a subset of batch rows: `y[j * w.rows + o] = W[o] · x[rows_idx[j]]`.
pub fn matmul_gather(pool: &Pool, w: Mat<'_>, x: &[f32], rows_idx: &[usize], y: &mut [f32]) -> Result<()> {
    let cols = w.cols;
    assert!(rows_idx.iter().all(|&r| (r + 1) * cols <= x.len()), "matmul_gather rows");
    run(pool, w, rows_idx.len(), &|j| rows_idx[j] * cols, x, y, (w.rows, 0))
}

/// The shared driver: input row `b` starts at `x[x_off(b)]`.
fn run(
    pool: &Pool,
    w: Mat<'_>,
    n: usize,
    x_off: &(dyn Fn(usize) -> usize + Sync),
    x: &[f32],
    y: &mut [f32],
    ys: (usize, usize),
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    if n == 0 {
        return Ok(());
    }
    assert!((n - 1) * ys.0 + ys.1 + rows <= y.len(), "matmul output shape");
    assert!(n == 1 || ys.0 >= rows, "matmul output rows overlap");
    let k = kernel(w.ty, cols, pool.f32_acts())?;
    let work = rows * cols * n;
    let tasks = if work < 32 * 1024 { 1 } else { (pool.threads() * 4).min(rows).max(1) };
    let yp = SyncPtr(y.as_mut_ptr());
    let body = |acts: &[u8]| {
        pool.run(tasks, &|t| {
            // Batch rows in blocks of BATCH_BLOCK so a block of activations stays in cache while this task's
            // weight rows stream past it once per block.
            let range = split(rows, tasks, t);
            for b0 in (0..n).step_by(BATCH_BLOCK) {
                let b1 = (b0 + BATCH_BLOCK).min(n);
                for o in range.clone() {
                    let wr = w.row(o);
                    for b in b0..b1 {
                        let v = match k {
                            Kernel::F32 => match bytemuck::try_cast_slice::<u8, f32>(wr) {
                                Ok(wf) => dot_f32(wf, &x[x_off(b)..x_off(b) + cols]),
                                Err(_) => quant::dot_f32_kernel(GgmlType::F32)
                                    .map_or(f32::NAN, |f| f(wr, &x[x_off(b)..x_off(b) + cols])),
                            },
                            Kernel::F(f) => f(wr, &x[x_off(b)..x_off(b) + cols]),
                            Kernel::Q { dot, act_bytes, .. } => dot(wr, &acts[b * act_bytes..(b + 1) * act_bytes]),
                        };
                        // SAFETY: (b, o) pairs are disjoint across tasks (o ranges are disjoint) and in bounds
                        // (asserted).
                        unsafe { *yp.get().add(b * ys.0 + ys.1 + o) = v };
                    }
                }
            }
        })
    };
    match k {
        Kernel::Q { act, act_bytes, .. } => ACTS.with(|a| -> Result<()> {
            let (all, one) = &mut *a.borrow_mut();
            all.clear();
            all.reserve(n * act_bytes);
            for b in 0..n {
                quant::quantize_acts(act, &x[x_off(b)..x_off(b) + cols], one)
                    .map_err(|e| Error::Backend { backend: "cpu", what: format!("matmul activations: {e}") })?;
                all.extend_from_slice(one);
            }
            body(all);
            Ok(())
        }),
        _ => {
            body(&[]);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * rows];
        for b in 0..n {
            for o in 0..rows {
                y[b * rows + o] =
                    (0..cols).map(|k| w[o * cols + k] as f64 * x[b * cols + k] as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    #[test]
    fn f32_matmul_matches_naive_and_is_batch_invariant() {
        let (rows, cols, n) = (37usize, 70usize, 5usize);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 104729 % 777) as f32 - 388.0) / 200.0).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = Mat { ty: GgmlType::F32, rows, cols, row_bytes: cols * 4, data: &bytes };
        let pool = Pool::new(3);
        let mut y = vec![0f32; n * rows];
        matmul(&pool, m, &x, n, &mut y).unwrap();
        let r = naive(&w, rows, cols, &x, n);
        for (a, b) in y.iter().zip(&r) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        // Row 3 alone gives bit-identical values.
        let mut y1 = vec![0f32; rows];
        matmul(&pool, m, &x[3 * cols..4 * cols], 1, &mut y1).unwrap();
        assert_eq!(&y1[..], &y[3 * rows..4 * rows]);
    }

    #[test]
    fn quantized_matmul_is_close_to_dequantized_f32() {
        let (rows, cols, n) = (8usize, 64usize, 3usize);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 104729 % 777) as f32 - 388.0) / 200.0).collect();
        let mut bytes = vec![0u8; rows * 68];
        for r in 0..rows {
            quant::quantize_row(GgmlType::Q8_0, &w[r * cols..(r + 1) * cols], None, &mut bytes[r * 68..(r + 1) * 68])
                .unwrap();
        }
        let mut deq = vec![0f32; rows * cols];
        for r in 0..rows {
            dequant_row(GgmlType::Q8_0, &bytes[r * 68..(r + 1) * 68], &mut deq[r * cols..(r + 1) * cols]).unwrap();
        }
        let m = Mat { ty: GgmlType::Q8_0, rows, cols, row_bytes: 68, data: &bytes };
        let pool = Pool::new(2);
        let mut y = vec![0f32; n * rows];
        matmul(&pool, m, &x, n, &mut y).unwrap();
        let r = naive(&deq, rows, cols, &x, n);
        for (a, b) in y.iter().zip(&r) {
            // Q8_0 activations add ~0.4% relative error per value.
            assert!((a - b).abs() < 0.05 * (1.0 + b.abs()), "{a} vs {b}");
        }
        // Gathered rows give the same values as the full product.
        let mut g = vec![0f32; rows];
        matmul_gather(&pool, m, &x, &[2], &mut g).unwrap();
        assert_eq!(&g[..], &y[2 * rows..3 * rows]);
        // With f32 activations the product is the dequantized weights · x up to f32 rounding (|w|, |x| <= 2, 64
        // terms: 64 · 2^-24 · Σ|w·x| < 1e-3), far tighter than the Q8_0-activation path above.
        let mut pool = Pool::new(2);
        pool.set_f32_acts(true);
        let mut yf = vec![0f32; n * rows];
        matmul(&pool, m, &x, n, &mut yf).unwrap();
        for (a, b) in yf.iter().zip(&r) {
            assert!((a - b).abs() < 1e-3, "f32 activations: {a} vs {b}");
        }
        assert!(yf.iter().zip(&y).any(|(a, b)| a != b), "f32_acts changed nothing");
    }
}
