//! The public quant API (re-exported from [`crate::quant`]): length/type validation, then dispatch to the scalar
//! per-format code or the SIMD kernels. Every check happens here so the kernels can stay branch-free.

use super::act::plain_act_type;
use super::{f16, iq2_xxs, q2_k, q4_k, q8_0, q8_k, simd, ActType, GgmlType};
use crate::{Error, Result};

/// Weight row bytes · f32 activations (`x.len()` values). See the module docs for the length contract.
pub type DotF32 = fn(&[u8], &[f32]) -> f32;

/// Weight row bytes · quantized activation row bytes (in [`act_type`] of the weight type). Activations must come from
/// [`quantize_acts`] (whose quants stay within -127..=127; the SIMD kernels negate activation quants, which a -128
/// would overflow). Weight quants may take any value their format allows.
pub type DotQ = fn(&[u8], &[u8]) -> f32;

/// One weight row against four activation rows: `[dot(w, a[0]), .., dot(w, a[3])]`, bit-identical to four
/// [`DotQ`] calls of the same kernel (rows of unequal length get exactly that: four single calls). The third
/// argument may carry each row's block scales as f32 ([`act_block_scales`]) for activation formats whose blocks
/// have f16 scales (Q8_0): converted once per activation row instead of once per weight row. Kernels of other
/// formats ignore it; empty (or short) slices make a Q8_0 kernel convert the scales itself.
pub type DotQ4 = fn(&[u8], [&[u8]; 4], [&[f32]; 4]) -> [f32; 4];

/// One weight row against eight activation rows, bit-identical to eight [`DotQ`] calls (like [`DotQ4`]).
pub type DotQ8 = fn(&[u8], [&[u8]; 8], [&[f32]; 8]) -> [f32; 8];

/// Weight rows against any number of activation rows: `w` holds weight rows of `row_bytes` bytes back to back, and
/// `out[r * a.len() + i] = dot(row r, a[i])` for every whole row `r` whose results fit in `out` (`da` as long as
/// `a`, as for [`DotQ4`], possibly empty slices), bit-identical to the [`DotQ`] calls of the same kernel. The
/// kernel decodes each weight block once for up to [`MAX_ROWS`] rows (more go in groups of at most that many, as
/// even as possible; rows of unequal length each on their own), and may take several weight rows a span of blocks
/// at a time (the IQ2_XXS pair kernel: the activations' span stays in L1 across them).
pub type DotQRows = fn(w: &[u8], row_bytes: usize, a: &[&[u8]], da: &[&[f32]], out: &mut [f32]);

/// One weight row against any number of activation rows given in the flipped format
/// ([`flip_acts`] of rows from [`quantize_acts`]; `au[i]`: one row's flipped quants) with their f32 block scales
/// (`da[i]`, [`act_block_scales`]): `out[i] = dot(w, a_i)` for `i < out.len()`, bit-identical to the [`DotQ`]
/// calls of the same kernel on the rows they were made from, one weight decode per up to [`MAX_ROWS`] rows. A row
/// with fewer blocks (quants or scales) than `w` gets NaN. For every batch size from one row up (decode with one
/// or many sessions, prefill chunks).
pub type DotQFlipped = fn(w: &[u8], au: &[&[u8]], da: &[&[f32]], out: &mut [f32]);

/// [`DotQFlipped`] on a weight row repacked once ([`super::PackedMat`]): the same results, bit for bit, without the
/// per-call transpose of the weight blocks.
pub type DotQPacked = fn(w: super::packed::PackedRow<'_>, au: &[&[u8]], da: &[&[f32]], out: &mut [f32]);

/// Most activation rows a [`DotQRows`] kernel takes per weight decode.
pub const MAX_ROWS: usize = 8;

/// One float weight row (F16/BF16) against four f32 activation rows, bit-identical to four [`DotF32`] calls.
pub type DotF4 = fn(&[u8], [&[f32]; 4]) -> [f32; 4];

/// One float weight row (F16/BF16) against eight f32 activation rows, bit-identical to eight [`DotF32`] calls.
pub type DotF8 = fn(&[u8], [&[f32]; 8]) -> [f32; 8];

fn qerr(op: &'static str, ty: GgmlType, what: impl Into<String>) -> Error {
    Error::Quant { op, ty: ty.name().to_string(), what: what.into() }
}

/// Bytes of a row of `n` values, or an error naming the op.
fn row_len(op: &'static str, ty: GgmlType, n: usize) -> Result<usize> {
    ty.row_bytes(n as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| qerr(op, ty, format!("{n} values is not a whole number of {}-value blocks", ty.block_values())))
}

fn check_finite(op: &'static str, ty: GgmlType, what: &str, v: &[f32]) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(i) => Err(qerr(op, ty, format!("{what}[{i}] = {} is not finite", v[i]))),
    }
}

/// The largest magnitude a format with f16 block scales can represent (f16 max 65504 times the largest level).
fn max_magnitude(ty: GgmlType) -> Option<f32> {
    const F16_MAX: f32 = 65504.0;
    match ty {
        GgmlType::Q8_0 => Some(F16_MAX * 127.0),
        GgmlType::Q2K => Some(F16_MAX * 15.0 * 3.0),
        GgmlType::Q4K => Some(F16_MAX * 63.0 * 15.0),
        GgmlType::Iq2Xxs => Some(F16_MAX * 15.5 * 0.25 * 43.0),
        _ => None,
    }
}

/// Dequantizes one row: `dst.len()` values from `src`, which must be exactly `ty.row_bytes(dst.len())` bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    const OP: &str = "dequantize_row";
    let need = row_len(OP, ty, dst.len())?;
    if src.len() != need {
        return Err(qerr(OP, ty, format!("{} values need {need} bytes, got {}", dst.len(), src.len())));
    }
    match ty {
        GgmlType::F32 => f16::dequantize_f32(src, dst),
        GgmlType::F16 => f16::dequantize_f16(src, dst),
        GgmlType::Bf16 => f16::dequantize_bf16(src, dst),
        GgmlType::Q8_0 => q8_0::dequantize(src, dst),
        GgmlType::Q8K => q8_k::dequantize(src, dst),
        GgmlType::Q2K => q2_k::dequantize(src, dst),
        GgmlType::Q4K => q4_k::dequantize(src, dst),
        GgmlType::Iq2Xxs => iq2_xxs::dequantize(src, dst),
        _ => return Err(qerr(OP, ty, "type not supported")),
    }
    Ok(())
}

/// Quantizes one row (round-to-nearest with a scale search). `importance`, if given, holds one non-negative weight
/// per value (an imatrix row): the scale search minimises the importance-weighted squared error. `dst` must be
/// exactly `ty.row_bytes(src.len())` bytes. Quant types reject non-finite input and values beyond what their f16
/// block scales can represent (e.g. ±8.3e6 for Q8_0); F32/F16/BF16 convert anything (overflowing to ±inf).
pub fn quantize_row(ty: GgmlType, src: &[f32], importance: Option<&[f32]>, dst: &mut [u8]) -> Result<()> {
    const OP: &str = "quantize_row";
    let need = row_len(OP, ty, src.len())?;
    if dst.len() != need {
        return Err(qerr(OP, ty, format!("{} values need {need} bytes, got {}", src.len(), dst.len())));
    }
    if let Some(imp) = importance {
        if imp.len() != src.len() {
            return Err(qerr(OP, ty, format!("importance has {} values, row has {}", imp.len(), src.len())));
        }
        if let Some(i) = imp.iter().position(|w| !(w.is_finite() && *w >= 0.0)) {
            return Err(qerr(OP, ty, format!("importance[{i}] = {} is not a finite non-negative weight", imp[i])));
        }
    }
    if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16) {
        check_finite(OP, ty, "src", src)?;
        if let Some(limit) = max_magnitude(ty) {
            if let Some(i) = src.iter().position(|v| v.abs() > limit) {
                return Err(qerr(OP, ty, format!("src[{i}] = {} is beyond the format's range (±{limit:e})", src[i])));
            }
        }
    }
    match ty {
        GgmlType::F32 => f16::quantize_f32(src, dst),
        GgmlType::F16 => f16::quantize_f16(src, dst),
        GgmlType::Bf16 => f16::quantize_bf16(src, dst),
        GgmlType::Q8_0 => q8_0::quantize(src, importance, dst),
        GgmlType::Q8K => q8_k::quantize(src, dst),
        GgmlType::Q2K => q2_k::quantize(src, importance, dst),
        GgmlType::Q4K => q4_k::quantize(src, importance, dst),
        GgmlType::Iq2Xxs => iq2_xxs::quantize(src, importance, dst),
        _ => return Err(qerr(OP, ty, "type not supported")),
    }
    Ok(())
}

/// The scalar reference kernel for weight type `ty` · f32 activations.
pub fn dot_f32_kernel_scalar(ty: GgmlType) -> Result<DotF32> {
    Ok(match ty {
        GgmlType::F32 => f16::dot_f32_f32,
        GgmlType::F16 => f16::dot_f16_f32,
        GgmlType::Bf16 => f16::dot_bf16_f32,
        GgmlType::Q8_0 => q8_0::dot_f32,
        GgmlType::Q2K => q2_k::dot_f32,
        GgmlType::Q4K => q4_k::dot_f32,
        GgmlType::Iq2Xxs => iq2_xxs::dot_f32,
        _ => return Err(qerr("dot_f32_kernel", ty, "no f32 dot product for this type")),
    })
}

/// The best kernel for weight type `ty` · f32 activations on this CPU (resolve once, cache the pointer).
pub fn dot_f32_kernel(ty: GgmlType) -> Result<DotF32> {
    let scalar = dot_f32_kernel_scalar(ty)?;
    Ok(simd::dot_f32(ty).unwrap_or(scalar))
}

/// The f32 value of every block scale of activation bytes `a` in format `act` — for Q8_0, whose f16 block scales
/// the multi-row kernels ([`DotQ4`], [`DotQ8`]) take pre-converted — into `out` (cleared first; left empty for the
/// other formats, whose kernels read their scales as they are). Covers the whole blocks `a` holds.
pub fn act_block_scales(act: ActType, a: &[u8], out: &mut Vec<f32>) {
    out.clear();
    if act == ActType::Q8_0 {
        out.extend(a.chunks_exact(q8_0::BLOCK_BYTES).map(|b| super::f16::f16_at(b, 0)));
    }
}

/// A four-row form of [`dot_f32_kernel`] (see [`DotF4`]) where this CPU has one (F16 and BF16 with AVX2: each
/// weight vector converted once for the four rows). `None` means: call the single kernel.
pub fn dot_f4_kernel(weight_ty: GgmlType) -> Option<DotF4> {
    simd::dot_f4(weight_ty)
}

/// An eight-row form of [`dot_f32_kernel`] (see [`DotF8`]) where this CPU has one (F16 and BF16 with AVX-512 F:
/// each weight vector converted once for the eight rows). `None` means: four-row or single calls.
pub fn dot_f8_kernel(weight_ty: GgmlType) -> Option<DotF8> {
    simd::dot_f8(weight_ty)
}

/// The activation format paired with a weight type on this CPU: Q8_0 for Q8_0; Q8_K for Q2_K and Q4_K; Q8_K for
/// IQ2_XXS too, in the pair layout ([`ActType::Q8KPairs`]) where the AVX-512 pair kernel runs; F32 otherwise.
/// [`dot_q_kernel`] and [`dot_q_kernel_scalar`] read exactly this format.
pub fn act_type(weight_ty: GgmlType) -> ActType {
    match plain_act_type(weight_ty) {
        ActType::Q8K if weight_ty == GgmlType::Iq2Xxs && simd::iq2_pairs() => ActType::Q8KPairs,
        t => t,
    }
}

/// Quantizes activations `x` into `dst` (cleared first) in `act` (F32, Q8_0, Q8_K or the Q8_K pair layout).
pub fn quantize_acts(act: ActType, x: &[f32], dst: &mut Vec<u8>) -> Result<()> {
    let need = row_len("quantize_acts", act.ggml(), x.len())?;
    dst.clear();
    dst.resize(need, 0);
    quantize_acts_into(act, x, dst)
}

/// [`quantize_acts`] into a slice of exactly the row's size (`act.row_bytes(x.len())`): allocates nothing, so
/// pool tasks can write their pieces of a row in place (pieces of whole [`ActType::block_values`] units give the
/// same bytes as the whole row).
pub fn quantize_acts_into(act: ActType, x: &[f32], dst: &mut [u8]) -> Result<()> {
    const OP: &str = "quantize_acts";
    let ty = act.ggml();
    let need = row_len(OP, ty, x.len())?;
    if dst.len() != need {
        return Err(qerr(OP, ty, format!("destination holds {} bytes, the row needs {need}", dst.len())));
    }
    if !act.is_f32() {
        check_finite(OP, ty, "x", x)?;
    }
    if let Some(limit) = max_magnitude(ty) {
        if let Some(i) = x.iter().position(|v| v.abs() > limit) {
            return Err(qerr(OP, ty, format!("x[{i}] = {} is beyond the format's range (±{limit:e})", x[i])));
        }
    }
    match act {
        ActType::F32 => f16::quantize_f32(x, dst),
        ActType::Q8_0 => x.chunks_exact(q8_0::QK).zip(dst.chunks_exact_mut(q8_0::BLOCK_BYTES)).for_each(|(x, b)| {
            q8_0::quantize_block_rtn(x, b);
        }),
        ActType::Q8K => q8_k::quantize(x, dst),
        ActType::Q8KPairs => {
            q8_k::quantize(x, dst);
            q8_k::to_pairs(dst);
        }
    }
    Ok(())
}

/// Dequantizes an activation row quantized by [`quantize_acts`] in `act` (`dst.len()` values).
pub fn dequantize_acts(act: ActType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    if act != ActType::Q8KPairs {
        return dequantize_row(act.ggml(), src, dst);
    }
    let need = row_len("dequantize_acts", GgmlType::Q8K, dst.len())?;
    if src.len() != need {
        return Err(qerr("dequantize_acts", GgmlType::Q8K, format!("{} values need {need} bytes", dst.len())));
    }
    let mut plain = src.to_vec();
    for (p, out) in src.chunks_exact(q8_k::PAIR_BYTES).zip(plain.chunks_exact_mut(q8_k::PAIR_BYTES)) {
        if let Ok(out) = out.try_into() {
            q8_k::from_pair(p, out);
        }
    }
    q8_k::dequantize(&plain, dst);
    Ok(())
}

/// The scalar reference kernel for weight type `weight_ty` · activations in `act_type(weight_ty)`.
pub fn dot_q_kernel_scalar(weight_ty: GgmlType) -> Result<DotQ> {
    Ok(match weight_ty {
        GgmlType::Q8_0 => q8_0::dot_q8_0,
        GgmlType::Q2K => q2_k::dot_q8k,
        GgmlType::Q4K => q4_k::dot_q8k,
        GgmlType::Iq2Xxs if act_type(weight_ty) == ActType::Q8KPairs => iq2_xxs::dot_q8k_pairs,
        GgmlType::Iq2Xxs => iq2_xxs::dot_q8k,
        _ => return Err(qerr("dot_q_kernel", weight_ty, "no quantized-activation dot product (use dot_f32)")),
    })
}

/// The best kernel for weight type `weight_ty` · quantized activations on this CPU (resolve once, cache it).
pub fn dot_q_kernel(weight_ty: GgmlType) -> Result<DotQ> {
    let scalar = dot_q_kernel_scalar(weight_ty)?;
    Ok(simd::dot_q(weight_ty).unwrap_or(scalar))
}

/// A four-row form of [`dot_q_kernel`] (see [`DotQ4`]) where one exists: kernels whose weight decoding dominates
/// (the AVX-512 IQ2_XXS pair kernel) do it once for four activation rows. `None` means: call the single kernel.
pub fn dot_q4_kernel(weight_ty: GgmlType) -> Option<DotQ4> {
    simd::dot_q4(weight_ty)
}

/// The any-row-count form of [`dot_q_kernel`] (see [`DotQRows`]) where one exists: the AVX-512 IQ2_XXS pair and
/// Q2_K kernels, which decode each weight block once for up to [`MAX_ROWS`] rows. Where it exists the batched
/// products use it for every row count (`DotQ4` / `DotQ8` are then not needed). `None`: use [`dot_q8_kernel`] /
/// [`dot_q4_kernel`] / the single kernel.
pub fn dot_q_rows_kernel(weight_ty: GgmlType) -> Option<DotQRows> {
    simd::dot_q_rows(weight_ty)
}

/// An eight-row form of [`dot_q_kernel`] (see [`DotQ8`]) where one exists (the AVX2 Q2_K, Q4_K and IQ2_XXS kernels:
/// their weight decoding shared by eight rows; Q8_0 with AVX-512 VNNI). `None` means: use [`dot_q4_kernel`] or the
/// single kernel.
pub fn dot_q8_kernel(weight_ty: GgmlType) -> Option<DotQ8> {
    simd::dot_q8(weight_ty)
}

/// The flipped-activation form of [`dot_q_kernel`] (see [`DotQFlipped`]) where this CPU has one (Q8_0 with
/// AVX-512 F/BW/VL/VNNI): per activation row one `vpdpbusd` per block pair, a conversion and an FMA per sixteen
/// blocks (the sixteen-lane contract, `q8_0::dot_q8_0_lanes16`).
pub fn dot_q_flipped_kernel(weight_ty: GgmlType) -> Option<DotQFlipped> {
    simd::dot_q_flipped(weight_ty)
}

/// The packed-weight form of [`dot_q_flipped_kernel`] (see [`DotQPacked`]) where this CPU has one (the same
/// CPUs and types); where it is `Some`, matrices of `weight_ty` are worth packing ([`super::PackedMat`]).
pub fn dot_q_packed_kernel(weight_ty: GgmlType) -> Option<DotQPacked> {
    simd::dot_q_packed(weight_ty)
}

/// 64 bytes of [`flip_acts`]' format, 64-byte aligned (so a kernel's 512-bit loads never straddle cache lines).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlipLine(pub [u8; 64]);

// SAFETY: `FlipLine` is `repr(C)` over `[u8; 64]`: 64 bytes, alignment 64, no padding, every bit pattern valid,
// all zeros valid.
unsafe impl bytemuck::Zeroable for FlipLine {}
// SAFETY: as above (plain bytes, no padding, `Copy`, `'static`).
unsafe impl bytemuck::Pod for FlipLine {}

/// Lines of an activation row of `row_bytes` (Q8_0 blocks) in the flipped format ([`flip_acts`]): nine per
/// chunk of sixteen blocks, the last chunk counted whole.
pub fn flip_row_lines(row_bytes: usize) -> usize {
    (row_bytes / q8_0::BLOCK_BYTES).div_ceil(16) * FLIP_CHUNK_LINES
}

/// [`FlipLine`]s per chunk of sixteen blocks in [`flip_acts`]' format: eight of quants, one of corrections.
pub(crate) const FLIP_CHUNK_LINES: usize = 9;

/// Activation rows `a` (rows of `row_bytes`, whole blocks of `act`) in the format the flipped-activation kernels
/// ([`DotQFlipped`], [`DotQPacked`]) read, into `out` (cleared first; left empty where no kernel has one). Q8_0: a
/// row's blocks in chunks of sixteen, nine [`FlipLine`]s per chunk. Lines `0..8`: byte `4b + j` of line `g` is
/// quant `4g + j` of block `16c + b` (signed, as stored) — so lane `b` of a 512-bit load holds one block's four
/// quants and a kernel's eight `vpdpbusd` per chunk leave each block's sum in its own lane (see
/// `simd::avx512_q8_rows`). Line 8: sixteen little-endian i32, `-128 · Σ` of block `16c + b`'s quants at lane
/// `b` — the kernels multiply the weights plus 128 (unsigned) by these signed quants, and start each block's sum
/// at this correction so that it ends exact. Blocks past the row's end (its last chunk's) are zeros. Each row
/// starts a new line: row `i` is lines `i · L..(i + 1) · L`, `L` = [`flip_row_lines`] (a 512-bit load that
/// straddles two cache lines costs two; measured 1.3–1.4× on the streamed output head, 2026-12-03).
pub fn flip_acts(act: ActType, a: &[u8], row_bytes: usize, out: &mut Vec<FlipLine>) {
    out.clear();
    let nb = row_bytes / q8_0::BLOCK_BYTES;
    if act != ActType::Q8_0 || nb == 0 {
        return;
    }
    let lines = flip_row_lines(row_bytes);
    out.reserve(a.len() / row_bytes * lines);
    for row in a.chunks_exact(row_bytes) {
        let start = out.len();
        out.resize(start + lines, FlipLine([0; 64]));
        for (i, b) in row.chunks_exact(q8_0::BLOCK_BYTES).take(nb).enumerate() {
            let (c, lane) = (i / 16, i % 16);
            let chunk = start + FLIP_CHUNK_LINES * c;
            for (g, q) in b[2..].chunks_exact(4).enumerate() {
                out[chunk + g].0[4 * lane..4 * lane + 4].copy_from_slice(q);
            }
            let sum: i32 = b[2..].iter().map(|&q| q as i8 as i32).sum();
            out[chunk + 8].0[4 * lane..4 * lane + 4].copy_from_slice(&(-128 * sum).to_le_bytes());
        }
    }
}

/// `y[r] = row r of w · x` for a row-major `n_rows × n_cols` weight matrix of type `ty`, single-threaded, on the
/// best path (quantized activations for quant types, computed once). Allocates one activation buffer; use
/// [`matvec_with_scratch`] to reuse one across calls.
pub fn matvec(ty: GgmlType, w: &[u8], n_rows: usize, n_cols: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
    let mut scratch = Vec::new();
    matvec_with_scratch(ty, w, n_rows, n_cols, x, y, &mut scratch)
}

/// [`matvec`] with a caller-owned activation buffer (no allocation once it has grown).
pub fn matvec_with_scratch(
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    n_cols: usize,
    x: &[f32],
    y: &mut [f32],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    const OP: &str = "matvec";
    let rb = row_len(OP, ty, n_cols)?;
    let total = rb.checked_mul(n_rows).ok_or_else(|| qerr(OP, ty, "matrix size overflows"))?;
    if w.len() != total {
        return Err(qerr(OP, ty, format!("{n_rows}×{n_cols} matrix needs {total} bytes, got {}", w.len())));
    }
    if x.len() != n_cols || y.len() != n_rows {
        return Err(qerr(
            OP,
            ty,
            format!("x has {} values (want {n_cols}), y has {} (want {n_rows})", x.len(), y.len()),
        ));
    }
    if rb == 0 {
        y.iter_mut().for_each(|v| *v = 0.0);
        return Ok(());
    }
    let act = act_type(ty);
    if act.is_f32() {
        let k = dot_f32_kernel(ty)?;
        for (yr, wr) in y.iter_mut().zip(w.chunks_exact(rb)) {
            *yr = k(wr, x);
        }
    } else {
        let k = dot_q_kernel(ty)?;
        quantize_acts(act, x, scratch)?;
        for (yr, wr) in y.iter_mut().zip(w.chunks_exact(rb)) {
            *yr = k(wr, scratch);
        }
    }
    Ok(())
}

/// `y[r] = row r of w · acts` with activations already quantized by [`quantize_acts`] into `act_type(ty)` (quantize
/// once, share across matrices with the same input — e.g. gate and up — and across threads working on row ranges).
/// `ty` must have a quantized dot product ([`dot_q_kernel`]); `acts` must hold exactly the bytes of `n_cols` values.
pub fn matvec_q(ty: GgmlType, w: &[u8], n_rows: usize, n_cols: usize, acts: &[u8], y: &mut [f32]) -> Result<()> {
    const OP: &str = "matvec_q";
    let k = dot_q_kernel(ty)?;
    let rb = row_len(OP, ty, n_cols)?;
    let total = rb.checked_mul(n_rows).ok_or_else(|| qerr(OP, ty, "matrix size overflows"))?;
    if w.len() != total {
        return Err(qerr(OP, ty, format!("{n_rows}×{n_cols} matrix needs {total} bytes, got {}", w.len())));
    }
    let act = act_type(ty);
    let need = row_len(OP, act.ggml(), n_cols)?;
    if acts.len() != need || y.len() != n_rows {
        return Err(qerr(
            OP,
            ty,
            format!("acts has {} bytes (want {need} of {act}), y has {} values (want {n_rows})", acts.len(), y.len()),
        ));
    }
    if rb == 0 {
        y.iter_mut().for_each(|v| *v = 0.0);
        return Ok(());
    }
    for (yr, wr) in y.iter_mut().zip(w.chunks_exact(rb)) {
        *yr = k(wr, acts);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flipped format as documented: rows of 17 blocks (one whole chunk and one of a single block) start on
    /// whole lines, lane `b` of line `g` of chunk `c` holds quants `4g..4g + 4` of block `16c + b` as stored,
    /// line 8 of the chunk `-128 · Σ` of that block's quants at lane `b`; the rest of a partial chunk is zeros.
    #[test]
    fn flipped_rows_are_transposed_chunks_on_whole_lines() {
        let nb = 17;
        let x: Vec<f32> = (0..3 * 32 * nb).map(|i| ((i * 37 % 251) as f32 - 125.0) * 0.01).collect();
        let mut a = Vec::new();
        quantize_acts(ActType::Q8_0, &x, &mut a).unwrap();
        let rb = nb * q8_0::BLOCK_BYTES;
        let mut out = Vec::new();
        flip_acts(ActType::Q8_0, &a, rb, &mut out);
        assert_eq!(flip_row_lines(rb), 18);
        assert_eq!(out.len(), 3 * flip_row_lines(rb));
        assert_eq!(out.as_ptr() as usize % 64, 0);
        for (r, row) in a.chunks_exact(rb).enumerate() {
            let lines = &out[r * 18..(r + 1) * 18];
            for c in 0..2 {
                for lane in 0..16 {
                    let b = 16 * c + lane;
                    let blk = row.chunks_exact(q8_0::BLOCK_BYTES).nth(b);
                    for g in 0..8 {
                        let got = &lines[9 * c + g].0[4 * lane..4 * lane + 4];
                        let want = blk.map_or(&[0u8; 4][..], |blk| &blk[2 + 4 * g..6 + 4 * g]);
                        assert_eq!(got, want, "row {r} block {b} group {g}");
                    }
                    let corr = i32::from_le_bytes(lines[9 * c + 8].0[4 * lane..4 * lane + 4].try_into().unwrap());
                    let sum: i32 = blk.map_or(0, |blk| blk[2..].iter().map(|q| *q as i8 as i32).sum());
                    assert_eq!(corr, -128 * sum, "row {r} block {b} correction");
                }
            }
        }
        flip_acts(ActType::Q8K, &a, rb, &mut out);
        assert!(out.is_empty(), "no flipped form for other activation types");
    }

    #[test]
    fn lengths_and_types_are_checked() {
        let mut out = [0f32; 32];
        assert!(dequantize_row(GgmlType::Q8_0, &[0u8; 33], &mut out).is_err());
        assert!(dequantize_row(GgmlType::Q8_0, &[0u8; 34], &mut out[..31]).is_err());
        assert!(dequantize_row(GgmlType::Q4_0, &[0u8; 18], &mut out).is_err());
        let mut b = [0u8; 34];
        assert!(quantize_row(GgmlType::Q8_0, &[f32::NAN; 32], None, &mut b).is_err());
        assert!(quantize_row(GgmlType::Q8_0, &[1e8; 32], None, &mut b).is_err());
        assert!(quantize_row(GgmlType::Q8_0, &[1.0; 32], Some(&[1.0; 31]), &mut b).is_err());
        assert!(quantize_row(GgmlType::Q8_0, &[1.0; 32], Some(&[-1.0; 32]), &mut b).is_err());
        assert!(dot_q_kernel(GgmlType::F16).is_err());
        assert!(quantize_acts(ActType::Q8K, &[0.0; 255], &mut Vec::new()).is_err());
        let mut y = [0f32; 2];
        assert!(matvec(GgmlType::Q8_0, &[0u8; 68], 2, 32, &[0.0; 31], &mut y).is_err());
        assert!(matvec(GgmlType::Q8_0, &[0u8; 67], 2, 32, &[0.0; 32], &mut y).is_err());
    }

    #[test]
    fn act_types_pair_with_weights() {
        assert_eq!(act_type(GgmlType::Q8_0), ActType::Q8_0);
        for t in [GgmlType::Q2K, GgmlType::Q4K] {
            assert_eq!(act_type(t), ActType::Q8K);
        }
        let iq2 = if simd::iq2_pairs() { ActType::Q8KPairs } else { ActType::Q8K };
        assert_eq!(act_type(GgmlType::Iq2Xxs), iq2);
        for t in [GgmlType::F32, GgmlType::F16, GgmlType::Bf16] {
            assert_eq!(act_type(t), ActType::F32);
        }
    }

    /// The pair layout holds the same values as plain Q8_K; pieces of whole pairs quantize to the same bytes as
    /// the whole row; rows with a lone last block work.
    #[test]
    fn pair_layout_acts_round_trip() {
        for blocks in [1usize, 2, 3, 6] {
            let x: Vec<f32> = (0..256 * blocks).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 10.0).collect();
            let (mut plain, mut pairs) = (Vec::new(), Vec::new());
            quantize_acts(ActType::Q8K, &x, &mut plain).unwrap();
            quantize_acts(ActType::Q8KPairs, &x, &mut pairs).unwrap();
            assert_eq!(plain.len(), pairs.len());
            let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            dequantize_acts(ActType::Q8K, &plain, &mut a).unwrap();
            dequantize_acts(ActType::Q8KPairs, &pairs, &mut b).unwrap();
            assert_eq!(a, b, "{blocks} blocks");
            if blocks % 2 == 0 {
                let unit = ActType::Q8KPairs.block_values();
                let ub = ActType::Q8KPairs.block_bytes();
                let mut pieces = vec![0u8; pairs.len()];
                for (xs, out) in x.chunks(unit).zip(pieces.chunks_mut(ub)) {
                    quantize_acts_into(ActType::Q8KPairs, xs, out).unwrap();
                }
                assert_eq!(pieces, pairs);
            }
        }
    }

    #[test]
    fn matvec_q_matches_matvec_and_checks_lengths() {
        let (rows, cols) = (4usize, 512usize);
        let x: Vec<f32> = (0..cols).map(|i| ((i * 29 % 31) as f32 - 15.0) / 15.0).collect();
        for ty in [GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q4K, GgmlType::Iq2Xxs] {
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 105.0).collect();
            let mut w = vec![0u8; rb * rows];
            for (r, chunk) in w.chunks_exact_mut(rb).enumerate() {
                quantize_row(ty, &wf[r * cols..(r + 1) * cols], None, chunk).unwrap();
            }
            let (mut y1, mut y2) = (vec![0f32; rows], vec![0f32; rows]);
            matvec(ty, &w, rows, cols, &x, &mut y1).unwrap();
            let mut acts = Vec::new();
            quantize_acts(act_type(ty), &x, &mut acts).unwrap();
            matvec_q(ty, &w, rows, cols, &acts, &mut y2).unwrap();
            assert_eq!(y1, y2, "{ty}");
            assert!(matvec_q(ty, &w, rows, cols, &acts[1..], &mut y2).is_err());
            assert!(matvec_q(ty, &w[1..], rows, cols, &acts, &mut y2).is_err());
        }
        assert!(matvec_q(GgmlType::F16, &[0u8; 64], 1, 32, &[0u8; 128], &mut [0f32]).is_err());
    }

    #[test]
    fn matvec_matches_row_dots() {
        let (rows, cols) = (3usize, 64usize);
        let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 101) as f32 - 50.0) / 50.0).collect();
        let x: Vec<f32> = (0..cols).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Bf16, GgmlType::Q8_0] {
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let mut w = vec![0u8; rb * rows];
            for (r, chunk) in w.chunks_exact_mut(rb).enumerate() {
                quantize_row(ty, &wf[r * cols..(r + 1) * cols], None, chunk).unwrap();
            }
            let mut y = vec![0f32; rows];
            matvec(ty, &w, rows, cols, &x, &mut y).unwrap();
            for r in 0..rows {
                let mut deq = vec![0f32; cols];
                dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut deq).unwrap();
                let want: f64 = deq.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mass: f64 = deq.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                assert!((y[r] as f64 - want).abs() <= 0.01 * mass + 1e-6, "{ty}: {} vs {want}", y[r]);
            }
        }
    }
}
