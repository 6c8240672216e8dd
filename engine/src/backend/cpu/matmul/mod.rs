//! Matrix products against weights in the map: `y[b, o] = W[o, :] · x[b, :]` for a batch of activation rows.
//!
//! Work is split over output rows across the pool ([`Pool::for_ranges`]: long contiguous row ranges per thread,
//! smaller ones at the tail); each weight row is read once per batch (matrix-matrix work in prefill).
//! Determinism: every output element is one dot-product call whose accumulation order depends only on the row
//! length, never on the batch size, thread count or how rows are grouped — so one-pass prefill, chunked prefill,
//! decode and the grouped MoE dispatch produce bit-identical projections.
//!
//! Kernels: F32 weights use [`dot_f32`] here (the golden-checked path); F16/BF16 use `quant::dot_f32_kernel`;
//! quantized weights (Q8_0, Q2_K, Q4_K, IQ2_XXS) quantize each activation row into `quant::act_type` (Q8_0 /
//! Q8_K, as ggml does; for IQ2_XXS on AVX-512 + GFNI, Q8_K in the pair layout its kernel reads) and use
//! `quant::dot_q_kernel`. Types without a kernel are rejected at load by [`supports`]. Batch rows go, per batch block
//! of up to eight, through the kernel's any-row-count form where the CPU has one (`quant::dot_q_flipped_kernel`:
//! AVX-512 Q8_0 on activations flipped once per product — every batch, one row included; `quant::dot_q_rows_kernel`:
//! AVX-512 IQ2_XXS and Q2_K, the routed experts' types — an expert gets ~6 rows of a 256-token chunk; 32 weight
//! rows per call, which the IQ2_XXS kernel tiles for small batch blocks), else eight
//! at a time through its eight-row form, then four at a time through its four-row form, where the CPU has them
//! (`quant::dot_q8_kernel`, `quant::dot_f8_kernel`, `quant::dot_q4_kernel`, `quant::dot_f4_kernel`), the rest one by one (a block of one
//! quantized row, decode's case, as a plain loop of single-row calls over the weight rows); each multi-row
//! form decodes a weight row once for its rows and is bit-identical to the single-row kernel. Quantized
//! activations carry their blocks' scales as f32 where the format stores f16 ones (Q8_0, [`Acts`]), converted once
//! per product for the multi-row kernels, and, where the type has a flipped kernel, in its format
//! (`quant::flip_acts`: sixteen-block chunks transposed, once per product). Long batches (prefill) go the same
//! way: weight rows in L2-sized sub-blocks, each swept by every batch block of eight rows.
//!
//! Packed Q8_0 weights: a [`Mat`] whose `packed` rows are set (the CPU backend's dense matrices,
//! `Model::packed_mat`) runs batches of two rows or more through `quant::dot_q_packed_kernel` — the flipped
//! kernel without its per-call weight transpose — in passes of four batch rows over 256 KiB weight sub-blocks
//! (four rows' activations fit L1 beside the weights; the sub-block comes from memory once, from L2 for the
//! other passes). One row streams the blocks as stored, and so do rows too wide for four in L1
//! (`quant::PackedMat::pays_for`: over 4096 values). Same results, bit for bit.
//!
//! Activation quantization is the CPU's one deliberate approximation: each activation is rounded to a grid of
//! `amax/127` per block of 32 (Q8_0) or 256 (Q8_K) values, an error of up to half a step per activation. When the
//! pool says [`Pool::f32_acts`] (engine option `f32_acts`), quantized weights use `quant::dot_f32_kernel` with f32
//! activations instead — what the wgpu backend computes — so cross-backend checks compare the kernels alone.
//!
//! Two layers: [`matmul`] / [`matmul_strided`] / [`matmul_gather`] are one product each (activations quantized per
//! call into a thread-local buffer, no allocation once it has grown). Under them, a [`Product`] is one prepared
//! product (kernel chosen, input located, output described by a raw pointer); [`run_group`] runs many products
//! in ONE pool dispatch (the MoE runs all selected experts' gate+up at once, then all downs), with activations
//! quantized once by the caller ([`Acts`]) and shared by every product that reads the same rows.

use std::cell::RefCell;
use std::ops::Range;

use crate::backend::cpu::pool::Pool;
use crate::model::mat::Mat;
use crate::quant::{
    self, ActType, DotF32, DotF4, DotF8, DotQ, DotQ4, DotQ8, DotQFlipped, DotQPacked, DotQRows, GgmlType, MAX_ROWS,
};
use crate::{Error, Result};

mod acts;
pub use acts::{Acts, Input, RowAt};

/// Whether matrices of type `ty` can be multiplied (and their rows dequantized).
pub fn supports(ty: GgmlType) -> bool {
    ty == GgmlType::F32 || quant::dot_f32_kernel(ty).is_ok()
}

/// Batch rows processed together against each weight row (cache blocking; results do not depend on it).
const BATCH_BLOCK: usize = 8;
const _: () = assert!(BATCH_BLOCK <= MAX_ROWS, "a batch block is one call of a `DotQRows` kernel");
/// Weight rows per call of a `DotQRows` kernel.
const ROWS_PER_CALL: usize = 32;
/// Weight bytes of the row sub-block that one batch block streams over (kept in L2 across batch blocks).
const ROW_BLOCK_BYTES: usize = 64 * 1024;
/// Batch rows per pass of the packed Q8_0 kernel over a row sub-block (the packed format's `PASS_ROWS`, four):
/// their flipped activations (18 KiB at 4096 values) stay in L1 beside the weights, where eight (36 KiB) would
/// not; the sub-block's weights come from memory once and from L2 for the other passes. Only matrices whose rows
/// are short enough for that are multiplied packed (`quant::PackedMat::pays_for`).
const PACKED_PASS_ROWS: usize = quant::PACKED_PASS_ROWS;
/// [`ROW_BLOCK_BYTES`] for the packed Q8_0 kernel's passes.
const PACKED_BLOCK_BYTES: usize = 256 * 1024;
/// Smallest row range handed to one thread, in weight bytes (keeps a range long enough to stream).
const GRAIN_BYTES: usize = 16 * 1024;
/// Activation values from which a product quantizes its input across the pool (below, on the calling thread).
const PAR_ACTS: usize = 2048;
/// Products with fewer multiply-adds than this run on the calling thread (a dispatch would cost more).
const INLINE_WORK: usize = 32 * 1024;

/// The dot product used for a weight type.
#[derive(Clone, Copy, Debug)]
pub enum Kernel {
    /// F32 weights, [`dot_f32`].
    F32,
    /// Float weights (F16/BF16, or quantized weights with [`Pool::f32_acts`]) against f32 activations; `dot8` /
    /// `dot4` as for [`Kernel::Q`].
    F { dot: DotF32, dot4: Option<DotF4>, dot8: Option<DotF8> },
    /// Quantized weights against activations quantized to `act` (`act_bytes` per row); `rows`, where the type has
    /// it, multiplies a weight row into any number of activation rows (up to `quant::MAX_ROWS` per weight decode),
    /// else `dot8` / `dot4`, where the type has them, into eight / four at once (all bit-identical to that many
    /// `dot` calls); `flip`, where it has one, any number of activation rows in the flipped format
    /// (`quant::flip_acts`; every batch block, one row included; preferred to `rows` / `dot8` / `dot4` / `dot`), and
    /// `packed` its form on packed weight rows (used where the matrix carries them, [`Mat::packed`]).
    Q {
        act: ActType,
        dot: DotQ,
        rows: Option<DotQRows>,
        flip: Option<DotQFlipped>,
        packed: Option<DotQPacked>,
        dot4: Option<DotQ4>,
        dot8: Option<DotQ8>,
        act_bytes: usize,
    },
}

impl Kernel {
    /// The kernel for `ty` weights with rows of `cols` values.
    pub fn for_type(ty: GgmlType, cols: usize) -> Result<Kernel> {
        if ty == GgmlType::F32 {
            return Ok(Kernel::F32);
        }
        let act = quant::act_type(ty);
        if !act.is_f32() {
            if let (Ok(dot), Some(b)) = (quant::dot_q_kernel(ty), act.row_bytes(cols as u64)) {
                let (dot4, dot8) = (quant::dot_q4_kernel(ty), quant::dot_q8_kernel(ty));
                let (rows, flip) = (quant::dot_q_rows_kernel(ty), quant::dot_q_flipped_kernel(ty));
                let packed = flip.and(quant::dot_q_packed_kernel(ty));
                return Ok(Kernel::Q { act, dot, rows, flip, packed, dot4, dot8, act_bytes: b as usize });
            }
        }
        Kernel::float(ty)
    }

    /// The f32-activation kernel for `ty`, with its four-row form where the CPU has one.
    fn float(ty: GgmlType) -> Result<Kernel> {
        Ok(Kernel::F {
            dot: quant::dot_f32_kernel(ty)?,
            dot4: quant::dot_f4_kernel(ty),
            dot8: quant::dot_f8_kernel(ty),
        })
    }

    /// The kernel the pool's settings ask for: [`Kernel::for_type`], or f32 activations for every weight type when
    /// [`Pool::f32_acts`] is on.
    pub fn for_pool(pool: &Pool, ty: GgmlType, cols: usize) -> Result<Kernel> {
        if pool.f32_acts() && ty != GgmlType::F32 {
            return Kernel::float(ty);
        }
        Kernel::for_type(ty, cols)
    }

    /// The activation format (`F32` when activations stay f32).
    pub fn act_type(&self) -> ActType {
        match self {
            Kernel::Q { act, .. } => *act,
            _ => ActType::F32,
        }
    }
}

thread_local! {
    static ACTS: RefCell<Acts> = const { RefCell::new(Acts::new()) };
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
#[derive(Clone, Copy, Debug)]
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

pub(super) fn backend_err(what: String) -> Error {
    Error::Backend { backend: "cpu", what }
}

/// Where a product writes: element `(b, o)` at `ptr[b * stride + off + o]`, all inside `len` elements.
#[derive(Clone, Copy, Debug)]
pub struct Out {
    ptr: SyncPtr,
    len: usize,
    stride: usize,
    off: usize,
}

impl Out {
    /// Output into `y` with the given row stride and offset. Writing happens only in the `unsafe` [`Product::rows`]
    /// / [`run_group`], whose callers guarantee `y` outlives them and nobody else touches the written elements.
    pub fn new(y: &mut [f32], stride: usize, off: usize) -> Out {
        Out { ptr: SyncPtr(y.as_mut_ptr()), len: y.len(), stride, off }
    }

    /// The same output moved `by` elements further into the buffer.
    pub fn shifted(self, by: usize) -> Out {
        Out { off: self.off + by, ..self }
    }
}

/// One prepared product: `out(b, o) = W[o] · input(b)` for `b < n`, `o < w.rows`.
#[derive(Clone, Copy, Debug)]
pub struct Product<'a> {
    pub w: Mat<'a>,
    pub k: Kernel,
    pub input: Input<'a>,
    pub n: usize,
    pub out: Out,
}

impl Product<'_> {
    /// Computes output rows `range` for every batch row.
    ///
    /// # Safety
    /// `self.out` points into a live buffer that no other thread reads or writes at the elements of these rows
    /// during the call (other rows may be written concurrently). Index bounds are checked (a bad shape panics).
    pub unsafe fn rows(&self, range: Range<usize>) {
        let (w, n, cols) = (self.w, self.n, self.w.cols);
        if range.is_empty() || n == 0 {
            return;
        }
        assert!(range.end <= w.rows, "matmul rows out of range");
        let o = self.out;
        assert!((n - 1) * o.stride + o.off + range.end <= o.len, "matmul output out of range");
        // SAFETY: in bounds (asserted); exclusive access to these elements is the caller's contract.
        let put = |b: usize, r: usize, v: f32| unsafe { *o.ptr.get().add(b * o.stride + o.off + r) = v };
        let rb = w.row_bytes.max(1);
        // Packed weight rows and their kernel, where both exist and the batch has two rows or more: passes of
        // `PACKED_PASS_ROWS` batch rows. One row (decode of one session) is bound by memory either way and
        // streams the blocks as stored (measured 2026-12-04: the packed copy's two streams, quants and scales,
        // were ~4 % slower on the one-row output head).
        let packed_w = match self.k {
            Kernel::Q { packed: Some(k), .. } if n > 1 && quant::PackedMat::pays_for(w.cols) => {
                w.packed.filter(|p| p.rows() == w.rows).map(|p| (k, p))
            }
            _ => None,
        };
        let block = if packed_w.is_some() { PACKED_PASS_ROWS } else { BATCH_BLOCK };
        let block_bytes = if packed_w.is_some() { PACKED_BLOCK_BYTES } else { ROW_BLOCK_BYTES };
        let sub = if n <= block { range.len() } else { (block_bytes / rb).max(1) };
        let mut s0 = range.start;
        while s0 < range.end {
            let s1 = (s0 + sub).min(range.end);
            for b0 in (0..n).step_by(block) {
                let b1 = (b0 + block).min(n);
                match (self.k, self.input) {
                    (
                        Kernel::Q { act, dot, rows: dotn, flip, dot4, dot8, act_bytes, .. },
                        Input::Q { acts, scales, flip_rows, rows, .. },
                    ) => {
                        // Row `b`'s bytes and the f32 scales of its blocks (empty where the format has none).
                        let bb = act.block_bytes().max(1);
                        let act = |b: usize| {
                            let a = rows.at(b);
                            (&acts[a..a + act_bytes], scales.get(a / bb..(a + act_bytes) / bb).unwrap_or(&[]))
                        };
                        // Flipped rows and their scales, where prepared (`Acts::finish`): row `at / act_bytes`,
                        // `fl` lines each (64-byte aligned).
                        let fl = quant::flip_row_lines(act_bytes);
                        let flipped_at = |b: usize| {
                            let at = rows.at(b) / act_bytes.max(1) * fl;
                            let lines = flip_rows.get(at..at + fl).map(bytemuck::cast_slice::<quant::FlipLine, u8>);
                            lines.zip(Some(act(b).1).filter(|d| !d.is_empty()))
                        };
                        let flip = flip.filter(|_| (b0..b1).all(|b| flipped_at(b).is_some()));
                        if b1 - b0 == 1 && flip.is_none() {
                            // One activation row (decode) without a flipped kernel: a plain loop of single-row calls.
                            let a = act(b0).0;
                            for r in s0..s1 {
                                put(b0, r, dot(w.row(r), a));
                            }
                            continue;
                        }
                        let one = |wr: &[u8], (a, _): (&[u8], &[f32])| dot(wr, a);
                        let four = dot4
                            .map(|k| move |wr: &[u8], a: [(&[u8], &[f32]); 4]| k(wr, a.map(|r| r.0), a.map(|r| r.1)));
                        let eight = dot8
                            .map(|k| move |wr: &[u8], a: [(&[u8], &[f32]); 8]| k(wr, a.map(|r| r.0), a.map(|r| r.1)));
                        // The flipped any-row kernel where every row of the block was prepared for it: one call
                        // per weight row for the whole batch block (`BATCH_BLOCK` ≤ `MAX_ROWS` rows).
                        if let Some(k) = flip {
                            let rs: [(&[u8], &[f32]); MAX_ROWS] =
                                std::array::from_fn(|i| flipped_at((b0 + i).min(b1 - 1)).unwrap_or_default());
                            let (a, d, m) = (rs.map(|r| r.0), rs.map(|r| r.1), b1 - b0);
                            let mut v = [0f32; MAX_ROWS];
                            for r in s0..s1 {
                                match packed_w {
                                    Some((kp, pw)) => kp(pw.row(r), &a[..m], &d[..m], &mut v[..m]),
                                    None => k(w.row(r), &a[..m], &d[..m], &mut v[..m]),
                                }
                                for (i, v) in v[..m].iter().enumerate() {
                                    put(b0 + i, r, *v);
                                }
                            }
                        } else if let Some(k) = dotn {
                            // The any-row kernel: one call per `ROWS_PER_CALL` weight rows for the whole batch
                            // block (the kernel may tile them; see `DotQRows`).
                            let rs: [(&[u8], &[f32]); MAX_ROWS] = std::array::from_fn(|i| act((b0 + i).min(b1 - 1)));
                            let (a, d, m) = (rs.map(|r| r.0), rs.map(|r| r.1), b1 - b0);
                            let mut v = [0f32; ROWS_PER_CALL * MAX_ROWS];
                            for r0 in (s0..s1).step_by(ROWS_PER_CALL) {
                                let (r1, rb) = ((r0 + ROWS_PER_CALL).min(s1), w.row_bytes);
                                let v = &mut v[..(r1 - r0) * m];
                                k(&w.data[r0 * rb..r1 * rb], rb, &a[..m], &d[..m], v);
                                for (r, vr) in (r0..r1).zip(v.chunks_exact(m)) {
                                    for (i, v) in vr.iter().enumerate() {
                                        put(b0 + i, r, *v);
                                    }
                                }
                            }
                        } else {
                            for r in s0..s1 {
                                row_times_batch(
                                    w.row(r),
                                    b0..b1,
                                    &act,
                                    &one,
                                    four.as_ref().map(|f| f as _),
                                    eight.as_ref().map(|f| f as _),
                                    &|b, v| put(b, r, v),
                                );
                            }
                        }
                    }
                    (Kernel::F { dot, dot4, dot8 }, Input::F32 { x, rows }) => {
                        let act = |b: usize| {
                            let a = rows.at(b);
                            &x[a..a + cols]
                        };
                        let four = dot4.map(|k| move |wr: &[u8], a: [&[f32]; 4]| k(wr, a));
                        let eight = dot8.map(|k| move |wr: &[u8], a: [&[f32]; 8]| k(wr, a));
                        for r in s0..s1 {
                            row_times_batch(
                                w.row(r),
                                b0..b1,
                                &act,
                                &|wr, a| dot(wr, a),
                                four.as_ref().map(|f| f as _),
                                eight.as_ref().map(|f| f as _),
                                &|b, v| put(b, r, v),
                            );
                        }
                    }
                    (Kernel::F32, Input::F32 { x, rows }) => {
                        for r in s0..s1 {
                            let wr = w.row(r);
                            for b in b0..b1 {
                                let a = rows.at(b);
                                let xr = &x[a..a + cols];
                                let v = match bytemuck::try_cast_slice::<u8, f32>(wr) {
                                    Ok(wf) => dot_f32(wf, xr),
                                    Err(_) => quant::dot_f32_kernel(GgmlType::F32).map_or(f32::NAN, |f| f(wr, xr)),
                                };
                                put(b, r, v);
                            }
                        }
                    }
                    _ => panic!("matmul input does not match the kernel"),
                }
            }
            s0 = s1;
        }
    }
}

/// A multi-row kernel as [`row_times_batch`] calls it: one weight row against `R` activation rows.
type RowsDot<'a, A, const R: usize> = &'a dyn Fn(&[u8], [A; R]) -> [f32; R];

/// One weight row `wr` times batch rows `bs` (activation row `b` is `act(b)`): eight rows per `dot8` call, then
/// four per `dot4` call where the kernel has them, the rest one by one; `put(b, v)` receives each result. The
/// multi-row kernels are bit-identical to `dot`, so the grouping never shows in the results.
#[inline]
fn row_times_batch<A: Copy>(
    wr: &[u8],
    bs: Range<usize>,
    act: &dyn Fn(usize) -> A,
    dot: &dyn Fn(&[u8], A) -> f32,
    dot4: Option<RowsDot<'_, A, 4>>,
    dot8: Option<RowsDot<'_, A, 8>>,
    put: &dyn Fn(usize, f32),
) {
    let mut b = bs.start;
    if let Some(dot8) = dot8 {
        while b + 8 <= bs.end {
            for (i, v) in dot8(wr, std::array::from_fn(|i| act(b + i))).into_iter().enumerate() {
                put(b + i, v);
            }
            b += 8;
        }
    }
    if let Some(dot4) = dot4 {
        while b + 4 <= bs.end {
            for (i, v) in dot4(wr, std::array::from_fn(|i| act(b + i))).into_iter().enumerate() {
                put(b + i, v);
            }
            b += 4;
        }
    }
    for b in b..bs.end {
        put(b, dot(wr, act(b)));
    }
}

/// Runs `units` products of `unit_rows` output rows each in one pool dispatch: `product(u)` describes product
/// `u` (called from the tasks, so it must be cheap and must not fail). Row ranges are cut at product boundaries.
///
/// # Safety
/// Every product's output buffer is live for the call, and no two products (and nothing else during the call)
/// write or read the same output element.
pub unsafe fn run_group<'a>(
    pool: &Pool,
    units: usize,
    unit_rows: usize,
    grain: usize,
    product: &(dyn Fn(usize) -> Product<'a> + Sync),
) {
    let total = units * unit_rows;
    if total == 0 {
        return;
    }
    pool.for_ranges(total, grain, &|r| {
        let mut a = r.start;
        while a < r.end {
            let u = a / unit_rows;
            let b = ((u + 1) * unit_rows).min(r.end);
            let p = product(u);
            // SAFETY: disjoint ranges of disjoint products (the caller's contract and `for_ranges`').
            unsafe { p.rows(a - u * unit_rows..b - u * unit_rows) };
            a = b;
        }
    });
}

/// A row grain for `for_ranges` over rows of `row_bytes` weight bytes.
pub fn grain_rows(row_bytes: usize) -> usize {
    (GRAIN_BYTES / row_bytes.max(1)).max(1)
}

/// Runs one product on the pool (inline when small).
fn run_one(pool: &Pool, p: &Product<'_>) {
    let work = p.w.rows * p.w.cols * p.n;
    if work < INLINE_WORK {
        // SAFETY: `p.out` came from a `&mut` slice borrowed by our caller for this call; one thread.
        unsafe { p.rows(0..p.w.rows) };
        return;
    }
    // SAFETY: as above; `for_ranges` hands out disjoint row ranges.
    pool.for_ranges(p.w.rows, grain_rows(p.w.row_bytes), &|r| unsafe { p.rows(r) });
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
    assert!((n - 1) * xs.0 + xs.1 + w.cols <= x.len(), "matmul input shape");
    run(pool, w, n, RowAt::Strided { stride: xs.0, off: xs.1 }, x, y, ys)
}

/// Like [`matmul`] but on a subset of batch rows: `y[j * w.rows + o] = W[o] · x[rows_idx[j]]`.
pub fn matmul_gather(pool: &Pool, w: Mat<'_>, x: &[f32], rows_idx: &[usize], y: &mut [f32]) -> Result<()> {
    let cols = w.cols;
    assert!(rows_idx.iter().all(|&r| (r + 1) * cols <= x.len()), "matmul_gather rows");
    run(pool, w, rows_idx.len(), RowAt::Gather { idx: rows_idx, stride: cols }, x, y, (w.rows, 0))
}

/// The shared driver: input row `b` starts at `x[at.at(b)]`.
fn run(pool: &Pool, w: Mat<'_>, n: usize, at: RowAt<'_>, x: &[f32], y: &mut [f32], ys: (usize, usize)) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    if n == 0 {
        return Ok(());
    }
    assert!((n - 1) * ys.0 + ys.1 + rows <= y.len(), "matmul output shape");
    assert!(n == 1 || ys.0 >= rows, "matmul output rows overlap");
    let k = Kernel::for_pool(pool, w.ty, cols)?;
    let out = Out::new(y, ys.0, ys.1);
    let go = |acts: &mut Acts| -> Result<()> {
        if n * cols >= PAR_ACTS {
            acts.prepare_par(pool, &k, x, at, n, cols)?;
        } else {
            acts.prepare(&k, x, at, n, cols)?;
        }
        let input = match k {
            Kernel::Q { act_bytes, .. } => Input::Q {
                acts: acts.bytes(),
                scales: acts.scales(),
                flip_rows: acts.flip_rows(),
                rows: RowAt::Strided { stride: act_bytes, off: 0 },
            },
            _ => Input::F32 { x, rows: at },
        };
        run_one(pool, &Product { w, k, input, n, out });
        Ok(())
    };
    if !matches!(k, Kernel::Q { .. }) {
        return go(&mut Acts::new());
    }
    ACTS.with(|a| match a.try_borrow_mut() {
        Ok(mut acts) => go(&mut acts),
        // Re-entered on this thread (a matmul inside a pool task): a private buffer.
        Err(_) => go(&mut Acts::new()),
    })
}

/// Most products [`matmul_many`] runs in one dispatch (more run one by one).
pub const MAX_MANY: usize = 8;

/// One product of [`matmul_many`]: `y[b * w.rows + o] = W[o] · x[b * w.cols ..]` for `b < n`.
#[derive(Debug)]
pub struct MatJob<'a> {
    pub w: Mat<'a>,
    pub x: &'a [f32],
    pub y: &'a mut [f32],
}

thread_local! {
    /// Activation buffers of [`matmul_many`], one per product (grown, never shrunk).
    static MANY_ACTS: RefCell<[Acts; MAX_MANY]> = const { RefCell::new([const { Acts::new() }; MAX_MANY]) };
}

/// Several independent products over `n` batch rows in ONE pool dispatch: the output rows of all of them are
/// split across the threads as one range (cut at product boundaries), so there is one barrier instead of one per
/// product. Products reading the same input with the same activation format share one quantization of it. Every
/// output element is the same kernel call on the same bytes as [`matmul`]'s, so the results are bit-identical.
/// Each entry of `jobs` must be `Some`; outputs must not overlap each other or any input (guaranteed by the
/// borrows).
pub fn matmul_many(pool: &Pool, jobs: &mut [Option<MatJob<'_>>], n: usize) -> Result<()> {
    let m = jobs.len();
    if n == 0 || m == 0 {
        return Ok(());
    }
    let one_by_one = |jobs: &mut [Option<MatJob<'_>>]| -> Result<()> {
        for j in jobs.iter_mut().flatten() {
            matmul(pool, j.w, j.x, n, j.y)?;
        }
        Ok(())
    };
    if m > MAX_MANY || jobs.iter().any(Option::is_none) {
        return one_by_one(jobs);
    }
    let mut kernels = [Kernel::F32; MAX_MANY];
    for (i, j) in jobs.iter().flatten().enumerate() {
        let (rows, cols) = (j.w.rows, j.w.cols);
        assert!(n * cols <= j.x.len(), "matmul input shape");
        assert!(n * rows <= j.y.len(), "matmul output shape");
        kernels[i] = Kernel::for_pool(pool, j.w.ty, cols)?;
    }
    MANY_ACTS.with(|cell| {
        // Re-entered on this thread (inside a pool task): one product at a time, each with its own buffer.
        let Ok(mut acts) = cell.try_borrow_mut() else { return one_by_one(jobs) };
        // `src[i]`: the product whose quantized activations product `i` reads (the first with the same input and
        // activation format).
        let mut src = [0usize; MAX_MANY];
        for i in 0..m {
            let j = jobs[i].as_ref().expect("checked above");
            let same = |k: usize| {
                let e = jobs[k].as_ref().expect("checked above");
                std::ptr::eq(e.x, j.x) && e.w.cols == j.w.cols && kernels[k].act_type() == kernels[i].act_type()
            };
            src[i] = (0..i).find(|&k| same(k)).unwrap_or(i);
            if src[i] == i && matches!(kernels[i], Kernel::Q { .. }) {
                let (at, cols) = (RowAt::Strided { stride: j.w.cols, off: 0 }, j.w.cols);
                if n * cols >= PAR_ACTS {
                    acts[i].prepare_par(pool, &kernels[i], j.x, at, n, cols)?;
                } else {
                    acts[i].prepare(&kernels[i], j.x, at, n, cols)?;
                }
            }
        }
        let mut prods: [Option<Product<'_>>; MAX_MANY] = [None; MAX_MANY];
        let mut start = [0usize; MAX_MANY + 1];
        let (mut work, mut grain) = (0usize, usize::MAX);
        for (i, j) in jobs.iter_mut().flatten().enumerate() {
            let (w, k) = (j.w, kernels[i]);
            let input = match k {
                Kernel::Q { act_bytes, .. } => Input::Q {
                    acts: acts[src[i]].bytes(),
                    scales: acts[src[i]].scales(),
                    flip_rows: acts[src[i]].flip_rows(),
                    rows: RowAt::Strided { stride: act_bytes, off: 0 },
                },
                _ => Input::F32 { x: j.x, rows: RowAt::Strided { stride: w.cols, off: 0 } },
            };
            prods[i] = Some(Product { w, k, input, n, out: Out::new(j.y, w.rows, 0) });
            start[i + 1] = start[i] + w.rows;
            work += w.rows * w.cols * n;
            grain = grain.min(grain_rows(w.row_bytes));
        }
        let prods = &prods[..m];
        let start = &start[..=m];
        let total = start[m];
        let rows = |r: Range<usize>| {
            let mut a = r.start;
            while a < r.end {
                // The product holding row `a` (the last whose start is <= a; empty products are skipped).
                let u = start.partition_point(|&s| s <= a) - 1;
                let b = start[u + 1].min(r.end);
                let p = prods[u].as_ref().expect("filled above");
                // SAFETY: each output buffer is borrowed mutably by `jobs` for this call and written only here, at
                // the disjoint rows of disjoint ranges (`for_ranges`' contract); products' buffers are distinct.
                unsafe { p.rows(a - start[u]..b - start[u]) };
                a = b;
            }
        };
        if work < INLINE_WORK {
            rows(0..total);
        } else {
            pool.for_ranges(total, grain, &rows);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests;
