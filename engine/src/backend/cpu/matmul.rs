//! Matrix products against weights in the map: `y[b, o] = W[o, :] · x[b, :]` for a batch of activation rows.
//!
//! Work is split over output rows across the pool; each weight row is read once per batch (matrix-matrix work in
//! prefill). Determinism: every output element is one [`dot`] call whose accumulation order depends only on the
//! row length, never on the batch size or thread count — so one-pass prefill, chunked prefill and decode produce
//! bit-identical projections.
//!
//! Weight types: F32, F16, BF16 and Q8_0 (activations stay f32). Other types are rejected at load by
//! [`supports`].

use std::cell::RefCell;

use crate::backend::cpu::pool::{split, Pool};
use crate::model::weights::Mat;
use crate::quant::GgmlType;

/// Whether [`dot`] / [`dequant_row`] handle `ty`.
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Q8_0)
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

thread_local! {
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Dequantizes one row of `ty` (`bytes` = exactly one row of `out.len()` values).
pub fn dequant_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (ob, blk) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                for (o, &q) in ob.iter_mut().zip(&blk[2..34]) {
                    *o = d * (q as i8) as f32;
                }
            }
        }
        _ => out.fill(f32::NAN),
    }
}

/// `row · x` for one weight row of type `ty`.
#[inline]
pub fn dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match ty {
        GgmlType::F32 => match bytemuck::try_cast_slice::<u8, f32>(row) {
            Ok(w) => dot_f32(w, x),
            Err(_) => dot_via_row(ty, row, x),
        },
        GgmlType::Q8_0 => {
            let mut acc = 0f32;
            for (xb, blk) in x.chunks_exact(32).zip(row.chunks_exact(34)) {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let mut s = [0f32; 4];
                for k in 0..8 {
                    for j in 0..4 {
                        s[j] += (blk[2 + k * 4 + j] as i8) as f32 * xb[k * 4 + j];
                    }
                }
                acc += d * ((s[0] + s[1]) + (s[2] + s[3]));
            }
            acc
        }
        _ => dot_via_row(ty, row, x),
    }
}

fn dot_via_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    ROW.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() < x.len() {
            r.resize(x.len(), 0.0);
        }
        let buf = &mut r[..x.len()];
        dequant_row(ty, row, buf);
        dot_f32(buf, x)
    })
}

/// A raw pointer that tasks write through at disjoint indices.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);
// SAFETY: used only for writes to disjoint indices from pool tasks, while the owning slice is borrowed mutably by
// the function that spawned them.
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

/// `y[b * w.rows + o] = W[o] · x[b * w.cols ..]` for `b < n`. `x.len() >= n * w.cols`, `y.len() >= n * w.rows`.
pub fn matmul(pool: &Pool, w: Mat<'_>, x: &[f32], n: usize, y: &mut [f32]) {
    matmul_strided(pool, w, x, n, (w.cols, 0), y, (w.rows, 0));
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
) {
    let (rows, cols) = (w.rows, w.cols);
    if n == 0 {
        return;
    }
    assert!((n - 1) * xs.0 + xs.1 + cols <= x.len(), "matmul input shape");
    assert!((n - 1) * ys.0 + ys.1 + rows <= y.len(), "matmul output shape");
    assert!(n == 1 || ys.0 >= rows, "matmul output rows overlap");
    // Tasks: blocks of output rows (enough for load balance, big enough to amortise dispatch).
    let work = rows * cols * n;
    let tasks = if work < 32 * 1024 { 1 } else { (pool.threads() * 4).min(rows).max(1) };
    let yp = SyncPtr(y.as_mut_ptr());
    pool.run(tasks, &|t| {
        let yp = yp;
        for o in split(rows, tasks, t) {
            let wr = w.row(o);
            for b in 0..n {
                let xo = b * xs.0 + xs.1;
                let v = dot(w.ty, wr, &x[xo..xo + cols]);
                // SAFETY: (b, o) pairs are disjoint across tasks (o ranges are disjoint) and in bounds (asserted).
                unsafe { *yp.0.add(b * ys.0 + ys.1 + o) = v };
            }
        }
    });
}

/// Like [`matmul`] but on a subset of batch rows: `y[j * w.rows + o] = W[o] · x[rows_idx[j]]`.
pub fn matmul_gather(pool: &Pool, w: Mat<'_>, x: &[f32], rows_idx: &[usize], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(y.len() >= rows_idx.len() * rows, "matmul_gather shapes");
    assert!(rows_idx.iter().all(|&r| (r + 1) * cols <= x.len()), "matmul_gather rows");
    let work = rows * cols * rows_idx.len().max(1);
    let tasks = if work < 32 * 1024 { 1 } else { (pool.threads() * 4).min(rows).max(1) };
    let yp = SyncPtr(y.as_mut_ptr());
    pool.run(tasks, &|t| {
        let yp = yp;
        for o in split(rows, tasks, t) {
            let wr = w.row(o);
            for (j, &b) in rows_idx.iter().enumerate() {
                let v = dot(w.ty, wr, &x[b * cols..(b + 1) * cols]);
                // SAFETY: disjoint (j, o) per task, in bounds (asserted).
                unsafe { *yp.0.add(j * rows + o) = v };
            }
        }
    });
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
        matmul(&pool, m, &x, n, &mut y);
        let r = naive(&w, rows, cols, &x, n);
        for (a, b) in y.iter().zip(&r) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        // Row 3 alone gives bit-identical values.
        let mut y1 = vec![0f32; rows];
        matmul(&pool, m, &x[3 * cols..4 * cols], 1, &mut y1);
        assert_eq!(&y1[..], &y[3 * rows..4 * rows]);
    }

    #[test]
    fn q8_0_dot_matches_dequantized() {
        let mut row = Vec::new();
        for b in 0..2 {
            row.extend_from_slice(&half::f16::from_f32(0.5 + b as f32).to_le_bytes());
            for i in 0..32 {
                row.push(((i as i32 * 9 - 100) as i8) as u8);
            }
        }
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 10.0).collect();
        let mut deq = vec![0f32; 64];
        dequant_row(GgmlType::Q8_0, &row, &mut deq);
        assert_eq!(deq[0], 0.5 * -100.0);
        assert_eq!(deq[33], 1.5 * -91.0);
        let want: f32 = deq.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!((dot(GgmlType::Q8_0, &row, &x) - want).abs() < 1e-2);
    }
}
