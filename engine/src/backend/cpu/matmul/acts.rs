//! Activation rows of a product: where each input row starts ([`RowAt`]), what a kernel reads ([`Input`]: f32
//! values, or rows already quantized), and [`Acts`], the buffer that quantizes a batch's rows once for every
//! product that reads them (grown, never shrunk: no allocation once large enough).

use super::{backend_err, Kernel};
use crate::backend::cpu::pool::{split, Pool};
use crate::quant::{self, ActType};
use crate::Result;

/// A byte pointer that tasks write through at disjoint rows.
#[derive(Clone, Copy)]
struct BytePtr(*mut u8);
// SAFETY: used only by `Acts::prepare_par` for disjoint rows of a buffer it borrows mutably.
unsafe impl Send for BytePtr {}
// SAFETY: as above.
unsafe impl Sync for BytePtr {}
impl BytePtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the raw field).
    fn get(self) -> *mut u8 {
        self.0
    }
}

/// Where input row `b` of a product starts, in elements of the input buffer (f32 values or activation bytes).
#[derive(Clone, Copy, Debug)]
pub enum RowAt<'a> {
    /// `b * stride + off`.
    Strided { stride: usize, off: usize },
    /// `idx[b] * stride`.
    Gather { idx: &'a [usize], stride: usize },
}

impl RowAt<'_> {
    #[inline]
    pub(super) fn at(&self, b: usize) -> usize {
        match *self {
            RowAt::Strided { stride, off } => b * stride + off,
            RowAt::Gather { idx, stride } => idx[b] * stride,
        }
    }
}

/// The input rows of a product: f32 values, or activations already quantized for the product's kernel.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    F32 {
        x: &'a [f32],
        rows: RowAt<'a>,
    },
    /// `scales`: the f32 value of every block scale of `acts` where the format has f16 ones (Q8_0; see
    /// `quant::act_block_scales`), else empty — the multi-row kernels read them instead of converting per weight row.
    /// `flip_rows`: the rows in the flipped any-row kernel's format where they were prepared for it, else empty.
    Q {
        acts: &'a [u8],
        scales: &'a [f32],
        flip_rows: &'a [quant::FlipLine],
        rows: RowAt<'a>,
    },
}

/// Activation rows quantized once for every product that reads them (grown, never shrunk: no allocation once
/// large enough).
#[derive(Debug, Default)]
pub struct Acts {
    pub(super) act: Option<ActType>,
    pub(super) row_bytes: usize,
    pub(super) data: Vec<u8>,
    pub(super) scales: Vec<f32>,
    pub(super) flip_rows: Vec<quant::FlipLine>,
    pub(super) one: Vec<u8>,
}

impl Acts {
    /// An empty buffer.
    pub const fn new() -> Acts {
        Acts { act: None, row_bytes: 0, data: Vec::new(), scales: Vec::new(), flip_rows: Vec::new(), one: Vec::new() }
    }

    /// For a quantized kernel `k`, quantizes rows `rows.at(b)..+cols` of `x` for `b < n` into rows `0..n` here;
    /// for float kernels does nothing (the product reads `x` directly).
    pub fn prepare(&mut self, k: &Kernel, x: &[f32], rows: RowAt<'_>, n: usize, cols: usize) -> Result<()> {
        let Kernel::Q { act, act_bytes, .. } = *k else {
            self.act = None;
            return Ok(());
        };
        self.act = Some(act);
        self.row_bytes = act_bytes;
        if self.data.len() < n * act_bytes {
            self.data.resize(n * act_bytes, 0);
        }
        for b in 0..n {
            let at = rows.at(b);
            let xr = x.get(at..at + cols).ok_or_else(|| backend_err("activation row out of range".into()))?;
            quant::quantize_acts(act, xr, &mut self.one)
                .map_err(|e| backend_err(format!("matmul activations: {e}")))?;
            self.data[b * act_bytes..(b + 1) * act_bytes].copy_from_slice(&self.one);
        }
        self.finish(k, n);
        Ok(())
    }

    /// [`Acts::prepare`] with the quantization spread over the pool: one task per row, or per run of whole
    /// activation blocks when there are fewer rows than threads (blocks are quantized independently, so the bytes
    /// are the same as [`Acts::prepare`]'s).
    pub fn prepare_par(
        &mut self,
        pool: &Pool,
        k: &Kernel,
        x: &[f32],
        rows: RowAt<'_>,
        n: usize,
        cols: usize,
    ) -> Result<()> {
        let Kernel::Q { act, act_bytes, .. } = *k else {
            self.act = None;
            return Ok(());
        };
        let (bv, bb) = (act.block_values().max(1), act.block_bytes());
        let blocks = cols / bv;
        let threads = pool.threads();
        let pieces = if n >= 2 * threads { 1 } else { (2 * threads).div_ceil(n.max(1)).min(blocks) };
        if threads == 1 || n * pieces <= 1 || blocks * bv != cols || blocks * bb != act_bytes {
            return self.prepare(k, x, rows, n, cols);
        }
        self.act = Some(act);
        self.row_bytes = act_bytes;
        if self.data.len() < n * act_bytes {
            self.data.resize(n * act_bytes, 0);
        }
        for b in 0..n {
            if rows.at(b) + cols > x.len() {
                return Err(backend_err("activation row out of range".into()));
            }
        }
        let failed = std::sync::atomic::AtomicBool::new(false);
        let dst = BytePtr(self.data.as_mut_ptr());
        pool.run(n * pieces, &|t| {
            let (b, blk) = (t / pieces, split(blocks, pieces, t % pieces));
            let at = rows.at(b) + blk.start * bv;
            let piece = blk.len() * bb;
            // SAFETY: blocks `blk` of row `b` (in bounds: `data` holds `n` rows of `blocks` blocks of `bb` bytes) are
            // written by this task only, while `self` is borrowed mutably by this function.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.get().add(b * act_bytes + blk.start * bb), piece) };
            if quant::quantize_acts_into(act, &x[at..at + blk.len() * bv], out).is_err() {
                failed.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        });
        if failed.into_inner() {
            // Redo it on whole rows for the error message (indices relative to the row).
            return self.prepare(k, x, rows, n, cols);
        }
        self.finish(k, n);
        Ok(())
    }

    /// After quantizing `n` rows for `k`: their f32 block scales and, where the kernel has a flipped form, the
    /// rows in its format (converted once per product rather than once per row range).
    pub(super) fn finish(&mut self, k: &Kernel, n: usize) {
        let Kernel::Q { act, act_bytes, flip, .. } = *k else { return };
        let rows = &self.data[..n * act_bytes];
        quant::act_block_scales(act, rows, &mut self.scales);
        self.flip_rows.clear();
        if flip.is_some() {
            quant::flip_acts(act, rows, act_bytes, &mut self.flip_rows);
        }
    }

    /// The f32 block scales of [`Acts::bytes`] where the format has f16 ones (Q8_0), else empty.
    pub fn scales(&self) -> &[f32] {
        if self.act.is_some() {
            &self.scales
        } else {
            &[]
        }
    }

    /// The rows in the flipped any-row kernel's format where [`Acts::prepare`] wrote them (see [`Input::Q`]), else
    /// empty.
    pub fn flip_rows(&self) -> &[quant::FlipLine] {
        if self.act.is_some() {
            &self.flip_rows
        } else {
            &[]
        }
    }

    /// The quantized rows `0..n` as written by [`Acts::prepare`], as bytes (empty for float kernels).
    pub fn bytes(&self) -> &[u8] {
        if self.act.is_some() {
            &self.data
        } else {
            &[]
        }
    }

    /// Bytes per quantized row (0 for float kernels).
    #[cfg_attr(not(any(test, feature = "bench-internals")), allow(dead_code))]
    pub fn row_bytes(&self) -> usize {
        if self.act.is_some() {
            self.row_bytes
        } else {
            0
        }
    }

    /// The input of a product reading rows `at(b)` (in row units of `x`, whose rows are `cols` long) — prepared
    /// quantized rows for quantized kernels, `x` itself for float ones. `at` maps the product's batch row to a row
    /// index of `x` (and of the prepared rows, which were prepared for the same row indices).
    pub fn input<'a>(&'a self, k: &Kernel, x: &'a [f32], cols: usize, at: RowAt<'a>) -> Input<'a> {
        let scale = |stride: usize| match at {
            RowAt::Strided { stride: s, off } => RowAt::Strided { stride: s * stride, off: off * stride },
            RowAt::Gather { idx, stride: s } => RowAt::Gather { idx, stride: s * stride },
        };
        match k {
            Kernel::Q { act_bytes, .. } if self.act.is_some() => {
                Input::Q { acts: &self.data, scales: &self.scales, flip_rows: &self.flip_rows, rows: scale(*act_bytes) }
            }
            _ => Input::F32 { x, rows: scale(cols) },
        }
    }
}
