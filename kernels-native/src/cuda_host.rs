//! The CUDA backend's host-side logic over an abstract device: which launches an op issues, with which buffers
//! and arguments, after checking every buffer size against the shapes. [`Device`] is the seam: the real device
//! (`crate::cuda::CudaDevice`, feature `cuda`) implements it with cudarc, and [`CudaMockDevice`] records launches
//! and buffer sizes so the sequencing is tested without a GPU (in CI). The compiled-module cache key
//! ([`module_cache_name`]) lives here for the same reason.
//!
//! Ops and their launches (kernels in `kernels-native/cuda`, geometry from [`Plan`]):
//! - [`matvec`]: quantize the activations once (Q8_0 or Q8_K, skipped for F16), then one product launch per
//!   group of 1–8 rows of the batch (one launch for a decode tick of up to 8 sessions);
//! - [`moe_decode`]: quantize x, one gate + up + SwiGLU launch over every selected expert (expert ids and route
//!   weights read on the device), quantize h, one down + sum launch: four launches per MoE layer whatever the
//!   number of experts used.

use std::fmt;

use crate::cuda_kernels::{ActFormat, CudaWeight, Plan, PlanError};

/// A device buffer, as the host plans see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaBufId(pub u32);

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A buffer's device address.
    Buf(CudaBufId),
    /// A null pointer (optional inputs such as the route weights).
    Null,
    I32(i32),
    I64(i64),
    F32(f32),
}

/// What a device call can fail with.
#[derive(Debug)]
pub enum DeviceError {
    /// The shapes do not fit the kernels.
    Plan(PlanError),
    /// A buffer is missing or has the wrong size.
    Buffer(String),
    /// The device or driver failed (message from the driver).
    Driver(String),
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::Plan(e) => write!(f, "{e}"),
            DeviceError::Buffer(s) => write!(f, "cuda buffer: {s}"),
            DeviceError::Driver(s) => write!(f, "cuda driver: {s}"),
        }
    }
}

impl std::error::Error for DeviceError {}

impl From<PlanError> for DeviceError {
    fn from(e: PlanError) -> Self {
        DeviceError::Plan(e)
    }
}

/// Device memory and launches, as the host plans need them.
pub trait Device {
    /// A zeroed buffer of `bytes` bytes.
    fn alloc(&mut self, bytes: usize) -> Result<CudaBufId, DeviceError>;
    /// A buffer holding `data`.
    fn upload(&mut self, data: &[u8]) -> Result<CudaBufId, DeviceError>;
    /// The buffer's contents.
    fn download(&mut self, buf: CudaBufId) -> Result<Vec<u8>, DeviceError>;
    /// Copies `data` into the first `data.len()` bytes of `buf` (ordered after every launch queued before).
    fn write(&mut self, buf: CudaBufId, data: &[u8]) -> Result<(), DeviceError>;
    /// Fills `out` with the first `out.len()` bytes of `buf`, after every launch queued before (a host sync).
    fn read(&mut self, buf: CudaBufId, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Frees `buf` (its id is not reused; later use is an error).
    fn free(&mut self, buf: CudaBufId);
    /// The buffer's size in bytes (`None` for an unknown buffer).
    fn size(&self, buf: CudaBufId) -> Option<usize>;
    /// Queues one launch of `plan.kernel` with `args` in the kernel's parameter order.
    fn launch(&mut self, plan: &Plan, args: &[Arg]) -> Result<(), DeviceError>;
}

fn need(dev: &dyn Device, buf: CudaBufId, bytes: usize, what: &str) -> Result<(), DeviceError> {
    match dev.size(buf) {
        Some(s) if s >= bytes => Ok(()),
        Some(s) => Err(DeviceError::Buffer(format!("{what} holds {s} bytes, needs {bytes}"))),
        None => Err(DeviceError::Buffer(format!("{what}: unknown buffer {buf:?}"))),
    }
}

fn i32v(v: usize, what: &str) -> Result<i32, DeviceError> {
    i32::try_from(v).map_err(|_| DeviceError::Buffer(format!("{what} = {v} exceeds 32 bits")))
}

/// Quantized activations of up to `values` values in the dq layout (`cuda/blocks.cuh`): quants, scales and, for
/// Q8_K, block sums.
#[derive(Clone, Copy, Debug)]
pub struct ActBufs {
    pub q: CudaBufId,
    pub d: CudaBufId,
    pub bs: CudaBufId,
    pub values: usize,
}

impl ActBufs {
    /// Buffers for `values` values in either format (sized for the larger: Q8_0's scales, Q8_K's sums).
    pub fn new(dev: &mut dyn Device, values: usize) -> Result<Self, DeviceError> {
        Ok(ActBufs {
            q: dev.alloc(values)?,
            d: dev.alloc(values.div_ceil(32) * 4)?,
            bs: dev.alloc(values.div_ceil(16) * 4)?,
            values,
        })
    }
}

/// Quantizes `n` f32 values of `x` into `acts` (one launch).
pub fn quantize(
    dev: &mut dyn Device,
    act: ActFormat,
    x: CudaBufId,
    n: usize,
    acts: &ActBufs,
) -> Result<(), DeviceError> {
    let plan = Plan::quantize(act, n)?;
    if n > acts.values {
        return Err(DeviceError::Buffer(format!("activation buffers hold {} values, {n} given", acts.values)));
    }
    need(dev, x, n * 4, "quantize input")?;
    let nb = i32v(n / act.block_values(), "blocks")?;
    let args: Vec<Arg> = match act {
        ActFormat::Q8_0 => vec![Arg::Buf(x), Arg::Buf(acts.q), Arg::Buf(acts.d), Arg::I32(nb)],
        _ => vec![Arg::Buf(x), Arg::Buf(acts.q), Arg::Buf(acts.d), Arg::Buf(acts.bs), Arg::I32(nb)],
    };
    dev.launch(&plan, &args)
}

/// A weight matrix on the device: `rows × cols` values of `ty`.
#[derive(Clone, Copy, Debug)]
pub struct Matrix {
    pub buf: CudaBufId,
    pub ty: CudaWeight,
    pub rows: usize,
    pub cols: usize,
}

/// `y[t] = W · x[t]` for `ntok` f32 rows of `x` (`y`: `ntok × rows` f32).
pub fn matvec(
    dev: &mut dyn Device,
    w: &Matrix,
    x: CudaBufId,
    ntok: usize,
    acts: &ActBufs,
    y: CudaBufId,
) -> Result<(), DeviceError> {
    let plan = Plan::matvec(w.ty, w.rows, w.cols, ntok)?;
    let row_bytes = w.ty.row_bytes(w.cols).unwrap_or(0);
    need(dev, w.buf, w.rows * row_bytes, "weights")?;
    need(dev, x, ntok * w.cols * 4, "x")?;
    need(dev, y, ntok * w.rows * 4, "y")?;
    let (rows, cols, nt) = (i32v(w.rows, "rows")?, i32v(w.cols, "cols")?, i32v(ntok, "ntok")?);
    if w.ty == CudaWeight::F16 {
        return dev
            .launch(&plan, &[Arg::Buf(w.buf), Arg::Buf(x), Arg::Buf(y), Arg::I32(rows), Arg::I32(cols), Arg::I32(nt)]);
    }
    let act = w.ty.act();
    quantize(dev, act, x, ntok * w.cols, acts)?;
    let bs = if act == ActFormat::Q8K { Arg::Buf(acts.bs) } else { Arg::Null };
    dev.launch(
        &plan,
        &[
            Arg::Buf(w.buf),
            Arg::Buf(acts.q),
            Arg::Buf(acts.d),
            bs,
            Arg::Buf(y),
            Arg::I32(rows),
            Arg::I32(cols),
            Arg::I32(nt),
        ],
    )
}

/// A layer's routed experts on the device: `n_experts` stacked matrices each (gate and up `ffn × d_model` of
/// `up_ty`, down `d_model × ffn` of `down_ty`; Flash's 2-bit file: IQ2_XXS and Q2_K).
#[derive(Clone, Copy, Debug)]
pub struct CudaExperts {
    pub gate: CudaBufId,
    pub up: CudaBufId,
    pub down: CudaBufId,
    pub up_ty: CudaWeight,
    pub down_ty: CudaWeight,
    pub n_experts: usize,
    pub d_model: usize,
    pub ffn: usize,
}

/// Where the route weights are applied in [`moe_decode`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteWeightAt {
    /// In the SwiGLU (h is already weighted).
    SwiGlu,
    /// In the sum over experts (as the CPU backend's combine).
    Sum,
}

/// The decode MoE of `ntok` tokens: `out[t] = Σ_j rw[t][j] · down_e(swiglu(gate_e·x_t, up_e·x_t))` over the
/// `n_used` experts `e = ids[t][j]` (`ids`: i32, `rw`: f32, both `ntok × n_used` on the device), in four launches
/// ([`moe_gate_up`] then [`moe_down_sum`], with Flash's clamp [`SWIGLU_LIMIT`]). `h` is f32 scratch of
/// `ntok × n_used × ffn`; `acts` must hold `max(d_model, n_used · ffn) · ntok` values.
#[allow(clippy::too_many_arguments)]
pub fn moe_decode(
    dev: &mut dyn Device,
    ex: &CudaExperts,
    x: CudaBufId,
    ids: CudaBufId,
    rw: CudaBufId,
    n_used: usize,
    ntok: usize,
    at: RouteWeightAt,
    acts: &ActBufs,
    h: CudaBufId,
    out: CudaBufId,
) -> Result<(), DeviceError> {
    let rw_up = (at == RouteWeightAt::SwiGlu).then_some(rw);
    let rw_down = (at == RouteWeightAt::Sum).then_some(rw);
    moe_gate_up(dev, ex, x, ids, rw_up, n_used, ntok, SWIGLU_LIMIT, acts, h)?;
    moe_down_sum(dev, ex, h, ids, rw_down, n_used, ntok, acts, out)
}

fn check_experts(dev: &dyn Device, ex: &CudaExperts) -> Result<(usize, usize), DeviceError> {
    let (gr, dr) = (ex.up_ty.row_bytes(ex.d_model).unwrap_or(0), ex.down_ty.row_bytes(ex.ffn).unwrap_or(0));
    let (up_bytes, down_bytes) = (ex.ffn * gr, ex.d_model * dr);
    need(dev, ex.gate, ex.n_experts * up_bytes, "gate experts")?;
    need(dev, ex.up, ex.n_experts * up_bytes, "up experts")?;
    need(dev, ex.down, ex.n_experts * down_bytes, "down experts")?;
    Ok((up_bytes, down_bytes))
}

fn opt(b: Option<CudaBufId>) -> Arg {
    b.map_or(Arg::Null, Arg::Buf)
}

/// `h[t][j] = swiglu(gate_e·x_t, up_e·x_t)` (clamp `limit`; `· rw[t][j]` when `rw` is given) for the `n_used`
/// experts `e = ids[t][j]` of each of `ntok` tokens: x quantized (Q8_K), then one launch.
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up(
    dev: &mut dyn Device,
    ex: &CudaExperts,
    x: CudaBufId,
    ids: CudaBufId,
    rw: Option<CudaBufId>,
    n_used: usize,
    ntok: usize,
    limit: f32,
    acts: &ActBufs,
    h: CudaBufId,
) -> Result<(), DeviceError> {
    let plan = Plan::moe_gate_up(ex.up_ty, ex.ffn, ex.d_model, n_used, ntok)?;
    let (up_bytes, _) = check_experts(dev, ex)?;
    need(dev, x, ntok * ex.d_model * 4, "x")?;
    need(dev, ids, ntok * n_used * 4, "expert ids")?;
    if let Some(rw) = rw {
        need(dev, rw, ntok * n_used * 4, "route weights")?;
    }
    need(dev, h, ntok * n_used * ex.ffn * 4, "h")?;
    let (ne, nu) = (i32v(ex.n_experts, "experts")?, i32v(n_used, "experts used")?);
    let (d, f) = (i32v(ex.d_model, "d_model")?, i32v(ex.ffn, "ffn")?);
    quantize(dev, ActFormat::Q8K, x, ntok * ex.d_model, acts)?;
    dev.launch(
        &plan,
        &[
            Arg::Buf(ex.gate),
            Arg::Buf(ex.up),
            Arg::I64(up_bytes as i64),
            Arg::I32(ne),
            Arg::Buf(acts.q),
            Arg::Buf(acts.d),
            Arg::Buf(acts.bs),
            Arg::Buf(ids),
            opt(rw),
            Arg::Buf(h),
            Arg::I32(f),
            Arg::I32(d),
            Arg::I32(nu),
            Arg::F32(limit),
        ],
    )
}

/// `out[t] = Σ_j (rw[t][j] ·) down_e·h[t][j]` over the `n_used` experts `e = ids[t][j]` of each of `ntok` tokens,
/// in slot order: h quantized (Q8_K), then one launch (each output value owned by one warp, no atomics).
#[allow(clippy::too_many_arguments)]
pub fn moe_down_sum(
    dev: &mut dyn Device,
    ex: &CudaExperts,
    h: CudaBufId,
    ids: CudaBufId,
    rw: Option<CudaBufId>,
    n_used: usize,
    ntok: usize,
    acts: &ActBufs,
    out: CudaBufId,
) -> Result<(), DeviceError> {
    let plan = Plan::moe_down_sum(ex.down_ty, ex.d_model, ex.ffn, ntok)?;
    let (_, down_bytes) = check_experts(dev, ex)?;
    need(dev, h, ntok * n_used * ex.ffn * 4, "h")?;
    need(dev, ids, ntok * n_used * 4, "expert ids")?;
    if let Some(rw) = rw {
        need(dev, rw, ntok * n_used * 4, "route weights")?;
    }
    need(dev, out, ntok * ex.d_model * 4, "out")?;
    let (ne, nu) = (i32v(ex.n_experts, "experts")?, i32v(n_used, "experts used")?);
    let (d, f) = (i32v(ex.d_model, "d_model")?, i32v(ex.ffn, "ffn")?);
    quantize(dev, ActFormat::Q8K, h, ntok * n_used * ex.ffn, acts)?;
    dev.launch(
        &plan,
        &[
            Arg::Buf(ex.down),
            Arg::I64(down_bytes as i64),
            Arg::I32(ne),
            Arg::Buf(acts.q),
            Arg::Buf(acts.d),
            Arg::Buf(acts.bs),
            Arg::Buf(ids),
            opt(rw),
            Arg::Buf(out),
            Arg::I32(d),
            Arg::I32(f),
            Arg::I32(nu),
        ],
    )
}

/// Routing of `n` rows (`logits`: `n × ne` router logits): each row's `k` experts and weights into `ids` (i32) and
/// `rw` (f32), both `n × k` — by `table` (`[vocab][k]` i32, hash routing, with the rows' `tokens`) or by the top k
/// of the scores + `bias`; weights renormalised when `norm`, times `scale`. One launch.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    dev: &mut dyn Device,
    logits: CudaBufId,
    bias: Option<CudaBufId>,
    table: Option<(CudaBufId, CudaBufId)>,
    n: usize,
    ne: usize,
    k: usize,
    norm: bool,
    scale: f32,
    ids: CudaBufId,
    rw: CudaBufId,
) -> Result<(), DeviceError> {
    let plan = Plan::moe_route(n, ne, k)?;
    need(dev, logits, n * ne * 4, "router logits")?;
    if let Some(b) = bias {
        need(dev, b, ne * 4, "router bias")?;
    }
    if let Some((_, tokens)) = table {
        need(dev, tokens, n * 4, "tokens")?;
    }
    need(dev, ids, n * k * 4, "expert ids")?;
    need(dev, rw, n * k * 4, "route weights")?;
    dev.launch(
        &plan,
        &[
            Arg::Buf(logits),
            opt(bias),
            opt(table.map(|t| t.0)),
            opt(table.map(|t| t.1)),
            Arg::Buf(ids),
            Arg::Buf(rw),
            Arg::I32(i32v(n, "rows")?),
            Arg::I32(i32v(ne, "experts")?),
            Arg::I32(i32v(k, "experts per row")?),
            Arg::I32(i32::from(norm)),
            Arg::F32(scale),
        ],
    )
}

/// `y += x` over `n` f32 values (one launch).
pub fn add(dev: &mut dyn Device, y: CudaBufId, x: CudaBufId, n: usize) -> Result<(), DeviceError> {
    let plan = Plan::add(n)?;
    need(dev, y, n * 4, "y")?;
    need(dev, x, n * 4, "x")?;
    dev.launch(&plan, &[Arg::Buf(y), Arg::Buf(x), Arg::I64(n as i64)])
}

/// `y[r] = x[rows[r]]` for `n` rows of `width` f32 (`rows`: i32 on the device; one launch).
pub fn gather_rows(
    dev: &mut dyn Device,
    x: CudaBufId,
    rows: CudaBufId,
    y: CudaBufId,
    width: usize,
    n: usize,
) -> Result<(), DeviceError> {
    let plan = Plan::gather_rows(width, n)?;
    need(dev, rows, n * 4, "row list")?;
    need(dev, y, n * width * 4, "y")?;
    need(dev, x, width * 4, "x")?;
    dev.launch(
        &plan,
        &[Arg::Buf(x), Arg::Buf(rows), Arg::Buf(y), Arg::I32(i32v(width, "width")?), Arg::I32(i32v(n, "rows")?)],
    )
}

/// The `k` best values of each of `n` rows of `vocab` logits into `ids` (u32) and `vals` (f32), `n × k` each, in
/// the sampler's order (one launch).
#[allow(clippy::too_many_arguments)]
pub fn top_candidates(
    dev: &mut dyn Device,
    logits: CudaBufId,
    n: usize,
    vocab: usize,
    k: usize,
    ids: CudaBufId,
    vals: CudaBufId,
) -> Result<(), DeviceError> {
    let plan = Plan::top_candidates(n, vocab, k)?;
    need(dev, logits, n * vocab * 4, "logits")?;
    need(dev, ids, n * k * 4, "candidate ids")?;
    need(dev, vals, n * k * 4, "candidate values")?;
    dev.launch(
        &plan,
        &[Arg::Buf(logits), Arg::I32(i32v(vocab, "vocab")?), Arg::I32(i32v(k, "k")?), Arg::Buf(ids), Arg::Buf(vals)],
    )
}

/// The embedding table formats `ds4_embed` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmbedFormat {
    F32 = 0,
    F16 = 1,
    Q8_0 = 2,
}

impl EmbedFormat {
    /// Bytes of a row of `d` values (`None`: not whole Q8_0 blocks).
    pub fn row_bytes(self, d: usize) -> Option<usize> {
        match self {
            EmbedFormat::F32 => Some(4 * d),
            EmbedFormat::F16 => Some(2 * d),
            EmbedFormat::Q8_0 => d.is_multiple_of(32).then_some(d / 32 * 34),
        }
    }
}

/// `streams[r][j] = E[tokens[r]]` (dequantized, `d` values) for every one of the `hc` streams of each of `n` rows;
/// `table` holds `vocab` rows in `fmt`, `tokens` n i32 below `vocab` (one launch).
#[allow(clippy::too_many_arguments)]
pub fn embed(
    dev: &mut dyn Device,
    table: CudaBufId,
    fmt: EmbedFormat,
    vocab: usize,
    tokens: CudaBufId,
    streams: CudaBufId,
    d: usize,
    hc: usize,
    n: usize,
) -> Result<(), DeviceError> {
    let plan = Plan::embed(d, n)?;
    let row =
        fmt.row_bytes(d).ok_or_else(|| DeviceError::Buffer(format!("{d} values are not whole blocks of {fmt:?}")))?;
    need(dev, table, vocab * row, "embedding table")?;
    need(dev, tokens, n * 4, "tokens")?;
    need(dev, streams, n * hc * d * 4, "streams")?;
    dev.launch(
        &plan,
        &[
            Arg::Buf(table),
            Arg::I32(fmt as i32),
            Arg::I64(row as i64),
            Arg::Buf(tokens),
            Arg::Buf(streams),
            Arg::I32(i32v(d, "d")?),
            Arg::I32(i32v(hc, "hc")?),
            Arg::I32(i32v(n, "rows")?),
        ],
    )
}

/// mHC `pre` (`n × hc`) and `post`+`comb` (`n × (hc + hc²)`) of `n` rows of `mix` (row stride `mix_stride`); `base`
/// (`(2 + hc)·hc`) and `scale` (3) f32 (one launch).
#[allow(clippy::too_many_arguments)]
pub fn hc_weights(
    dev: &mut dyn Device,
    mix: CudaBufId,
    mix_stride: usize,
    base: CudaBufId,
    scale: CudaBufId,
    hc: usize,
    eps: f32,
    iters: usize,
    pre: CudaBufId,
    postcomb: CudaBufId,
    n: usize,
) -> Result<(), DeviceError> {
    let plan = Plan::hc_weights(n, hc)?;
    let mixn = (2 + hc) * hc;
    if mix_stride < mixn {
        return Err(DeviceError::Buffer(format!("mix rows of {mix_stride} values, {mixn} needed")));
    }
    need(dev, mix, ((n.max(1) - 1) * mix_stride + mixn) * 4, "mix")?;
    need(dev, base, mixn * 4, "base")?;
    need(dev, scale, 3 * 4, "scale")?;
    need(dev, pre, n * hc * 4, "pre")?;
    need(dev, postcomb, n * (hc + hc * hc) * 4, "post and comb")?;
    dev.launch(
        &plan,
        &[
            Arg::Buf(mix),
            Arg::I32(i32v(mix_stride, "mix stride")?),
            Arg::Buf(base),
            Arg::Buf(scale),
            Arg::I32(i32v(hc, "hc")?),
            Arg::F32(eps),
            Arg::I32(i32v(iters, "iterations")?),
            Arg::Buf(pre),
            Arg::Buf(postcomb),
            Arg::I32(i32v(n, "rows")?),
        ],
    )
}

/// The head's mHC `pre` (`n × hc`) from `n` rows of `hc` mix values (one launch).
#[allow(clippy::too_many_arguments)]
pub fn hc_head_weights(
    dev: &mut dyn Device,
    mix: CudaBufId,
    base: CudaBufId,
    scale: f32,
    hc: usize,
    eps: f32,
    pre: CudaBufId,
    n: usize,
) -> Result<(), DeviceError> {
    let plan = Plan::hc_head_weights(n, hc)?;
    need(dev, mix, n * hc * 4, "mix")?;
    need(dev, base, hc * 4, "base")?;
    need(dev, pre, n * hc * 4, "pre")?;
    let (h, rows) = (i32v(hc, "hc")?, i32v(n, "rows")?);
    dev.launch(
        &plan,
        &[Arg::Buf(mix), Arg::Buf(base), Arg::F32(scale), Arg::I32(h), Arg::F32(eps), Arg::Buf(pre), Arg::I32(rows)],
    )
}

/// mHC collapse `u = Σ_j pre_j · X_j` of `n` rows of `hc` streams of `d` (one launch).
pub fn hc_collapse(
    dev: &mut dyn Device,
    x: CudaBufId,
    pre: CudaBufId,
    u: CudaBufId,
    n: usize,
    hc: usize,
    d: usize,
) -> Result<(), DeviceError> {
    let plan = Plan::hc_rows("ds4_hc_collapse", n, hc, d)?;
    need(dev, x, n * hc * d * 4, "streams")?;
    need(dev, pre, n * hc * 4, "pre")?;
    need(dev, u, n * d * 4, "out")?;
    dev.launch(&plan, &[Arg::Buf(x), Arg::Buf(pre), Arg::Buf(u), Arg::I32(i32v(hc, "hc")?), Arg::I32(i32v(d, "d")?)])
}

/// mHC post-mix in place: `X'_k = post_k · f + Σ_j comb[j][k] · X_j` for `n` rows (one launch).
pub fn hc_post(
    dev: &mut dyn Device,
    x: CudaBufId,
    f: CudaBufId,
    postcomb: CudaBufId,
    n: usize,
    hc: usize,
    d: usize,
) -> Result<(), DeviceError> {
    let plan = Plan::hc_rows("ds4_hc_post", n, hc, d)?;
    need(dev, x, n * hc * d * 4, "streams")?;
    need(dev, f, n * d * 4, "sublayer output")?;
    need(dev, postcomb, n * (hc + hc * hc) * 4, "post and comb")?;
    dev.launch(
        &plan,
        &[Arg::Buf(x), Arg::Buf(f), Arg::Buf(postcomb), Arg::I32(i32v(hc, "hc")?), Arg::I32(i32v(d, "d")?)],
    )
}

/// The clamped SwiGLU over `n` values: `g ← silu(min(g, limit)) · clamp(u, −limit, limit)` (one launch).
pub fn swiglu(dev: &mut dyn Device, g: CudaBufId, u: CudaBufId, n: usize, limit: f32) -> Result<(), DeviceError> {
    let plan = Plan::swiglu(n)?;
    need(dev, g, n * 4, "gate")?;
    need(dev, u, n * 4, "up")?;
    dev.launch(&plan, &[Arg::Buf(g), Arg::Buf(u), Arg::I64(n as i64), Arg::F32(limit)])
}

/// DeepSeek V4 Flash's SwiGLU clamp (gate ≤ 10, up in [−10, 10]).
pub const SWIGLU_LIMIT: f32 = 10.0;

/// The file name of a compiled module in the disk cache: device name, compute capability, NVRTC version and the
/// source hash (`cuda_kernels::source_hash`), so a new driver, card or kernel source never loads a stale
/// module. Characters other than ASCII letters, digits, `-`, `_` and `.` in the device name become `_`.
pub fn module_cache_name(device: &str, cc: (i32, i32), nvrtc: (i32, i32), source_hash: u64) -> String {
    let dev: String =
        device.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    format!("ds4-{dev}-sm{}{}-nvrtc{}.{}-{source_hash:016x}.cubin", cc.0, cc.1, nvrtc.0, nvrtc.1)
}

/// One recorded launch: the kernel name, its grid and block, and its arguments.
pub type Launch = (String, [u32; 3], [u32; 3], Vec<Arg>);

/// A device that keeps buffers in host memory and records launches without running them: for testing the host
/// plans' sequencing and checks.
#[derive(Debug, Default)]
pub struct CudaMockDevice {
    pub bufs: Vec<Vec<u8>>,
    /// Every launch: the kernel name, its grid and block, and its arguments.
    pub launches: Vec<Launch>,
}

impl Device for CudaMockDevice {
    fn alloc(&mut self, bytes: usize) -> Result<CudaBufId, DeviceError> {
        self.bufs.push(vec![0; bytes]);
        Ok(CudaBufId(self.bufs.len() as u32 - 1))
    }
    fn upload(&mut self, data: &[u8]) -> Result<CudaBufId, DeviceError> {
        self.bufs.push(data.to_vec());
        Ok(CudaBufId(self.bufs.len() as u32 - 1))
    }
    fn download(&mut self, buf: CudaBufId) -> Result<Vec<u8>, DeviceError> {
        self.bufs.get(buf.0 as usize).cloned().ok_or_else(|| DeviceError::Buffer(format!("unknown {buf:?}")))
    }
    fn write(&mut self, buf: CudaBufId, data: &[u8]) -> Result<(), DeviceError> {
        match self.bufs.get_mut(buf.0 as usize) {
            Some(b) if b.len() >= data.len() => {
                b[..data.len()].copy_from_slice(data);
                Ok(())
            }
            _ => Err(DeviceError::Buffer(format!("write of {} bytes to {buf:?}", data.len()))),
        }
    }
    fn read(&mut self, buf: CudaBufId, out: &mut [u8]) -> Result<(), DeviceError> {
        match self.bufs.get(buf.0 as usize) {
            Some(b) if b.len() >= out.len() => {
                out.copy_from_slice(&b[..out.len()]);
                Ok(())
            }
            _ => Err(DeviceError::Buffer(format!("read of {} bytes from {buf:?}", out.len()))),
        }
    }
    fn free(&mut self, buf: CudaBufId) {
        if let Some(b) = self.bufs.get_mut(buf.0 as usize) {
            *b = Vec::new();
        }
    }
    fn size(&self, buf: CudaBufId) -> Option<usize> {
        self.bufs.get(buf.0 as usize).map(Vec::len)
    }
    fn launch(&mut self, plan: &Plan, args: &[Arg]) -> Result<(), DeviceError> {
        if let Some(Arg::Buf(b)) = args.iter().find(|a| matches!(a, Arg::Buf(b) if self.size(*b).is_none())) {
            return Err(DeviceError::Buffer(format!("launch of {} with unknown {b:?}", plan.kernel)));
        }
        self.launches.push((plan.kernel.to_string(), plan.dims.grid, plan.dims.block, args.to_vec()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(d: &CudaMockDevice) -> Vec<&str> {
        d.launches.iter().map(|l| l.0.as_str()).collect()
    }

    #[test]
    fn matvec_quantizes_once_then_multiplies() {
        let mut d = CudaMockDevice::default();
        let w = Matrix { buf: d.alloc(64 * 2 * 34).unwrap(), ty: CudaWeight::Q8_0, rows: 64, cols: 64 };
        let x = d.alloc(5 * 64 * 4).unwrap();
        let y = d.alloc(5 * 64 * 4).unwrap();
        let acts = ActBufs::new(&mut d, 5 * 64).unwrap();
        matvec(&mut d, &w, x, 5, &acts, y).unwrap();
        assert_eq!(names(&d), ["ds4_quantize_q8_0", "ds4_matvec_q8_0_b4"]);
        assert_eq!(d.launches[1].1, [8, 2, 1], "two groups of up to four rows");
        assert_eq!(d.launches[1].3[3], Arg::Null, "Q8_0 has no block sums");

        let mut d = CudaMockDevice::default();
        let w = Matrix { buf: d.alloc(8 * 64 * 2).unwrap(), ty: CudaWeight::F16, rows: 8, cols: 64 };
        let (x, y) = (d.alloc(64 * 4).unwrap(), d.alloc(8 * 4).unwrap());
        let acts = ActBufs::new(&mut d, 64).unwrap();
        matvec(&mut d, &w, x, 1, &acts, y).unwrap();
        assert_eq!(names(&d), ["ds4_matvec_f16_b1"], "f16 takes f32 activations");
    }

    #[test]
    fn moe_decode_is_four_launches_with_the_weights_where_asked() {
        let (ne, dm, ffn, nu, nt) = (8usize, 512usize, 256usize, 6usize, 2usize);
        let setup = |down_bytes: usize| {
            let mut d = CudaMockDevice::default();
            let ex = CudaExperts {
                gate: d.alloc(ne * ffn * 2 * 66).unwrap(),
                up: d.alloc(ne * ffn * 2 * 66).unwrap(),
                down: d.alloc(down_bytes).unwrap(),
                up_ty: CudaWeight::Iq2Xxs,
                down_ty: CudaWeight::Q2K,
                n_experts: ne,
                d_model: dm,
                ffn,
            };
            // x, ids, rw, h, out
            let b =
                [nt * dm * 4, nt * nu * 4, nt * nu * 4, nt * nu * ffn * 4, nt * dm * 4].map(|n| d.alloc(n).unwrap());
            let acts = ActBufs::new(&mut d, nt * nu * ffn).unwrap();
            (d, ex, b, acts)
        };
        for at in [RouteWeightAt::Sum, RouteWeightAt::SwiGlu] {
            let (mut d, ex, [x, ids, rw, h, out], acts) = setup(ne * dm * 84);
            moe_decode(&mut d, &ex, x, ids, rw, nu, nt, at, &acts, h, out).unwrap();
            assert_eq!(
                names(&d),
                ["ds4_quantize_q8_k", "ds4_moe_gate_up_iq2_xxs", "ds4_quantize_q8_k", "ds4_moe_down_sum_q2_k"]
            );
            assert_eq!(d.launches[1].1, [32, nu as u32, nt as u32]);
            let (up_rw, down_rw) = (d.launches[1].3[8], d.launches[3].3[7]);
            match at {
                RouteWeightAt::Sum => assert_eq!((up_rw, down_rw), (Arg::Null, Arg::Buf(rw))),
                RouteWeightAt::SwiGlu => assert_eq!((up_rw, down_rw), (Arg::Buf(rw), Arg::Null)),
            }
            // A short buffer is an error before anything is launched.
            let (mut d, ex, [x, ids, rw, h, out], acts) = setup(ne * dm * 84 - 1);
            let err = moe_decode(&mut d, &ex, x, ids, rw, nu, nt, at, &acts, h, out).unwrap_err();
            assert!(err.to_string().contains("down experts"), "{err}");
            assert!(d.launches.is_empty());
        }
    }

    #[test]
    fn bad_shapes_and_buffers_are_errors_not_panics() {
        let mut d = CudaMockDevice::default();
        let w = Matrix { buf: d.alloc(100).unwrap(), ty: CudaWeight::Q4K, rows: 4, cols: 256 };
        let (x, y) = (d.alloc(1024).unwrap(), d.alloc(16).unwrap());
        let acts = ActBufs::new(&mut d, 256).unwrap();
        assert!(matvec(&mut d, &w, x, 1, &acts, y).is_err(), "weights too short");
        let w = Matrix { buf: d.alloc(4 * 144).unwrap(), ty: CudaWeight::Q4K, rows: 4, cols: 256 };
        assert!(matvec(&mut d, &w, x, 2, &acts, y).is_err(), "x too short for two rows");
        assert!(matvec(&mut d, &Matrix { cols: 100, ..w }, x, 1, &acts, y).is_err(), "partial block");
        assert!(matvec(&mut d, &Matrix { buf: CudaBufId(99), ..w }, x, 1, &acts, y).is_err(), "unknown buffer");
        matvec(&mut d, &w, x, 1, &acts, y).unwrap();
    }

    #[test]
    fn cache_names_separate_devices_versions_and_sources() {
        let a = module_cache_name("NVIDIA H100 80GB HBM3", (9, 0), (13, 0), 0xabc);
        assert_eq!(a, "ds4-NVIDIA_H100_80GB_HBM3-sm90-nvrtc13.0-0000000000000abc.cubin");
        assert_ne!(a, module_cache_name("NVIDIA H100 80GB HBM3", (9, 0), (13, 0), 0xabd));
        assert_ne!(a, module_cache_name("NVIDIA H100 80GB HBM3", (12, 0), (13, 0), 0xabc));
        assert_ne!(a, module_cache_name("NVIDIA H100 80GB HBM3", (9, 0), (13, 1), 0xabc));
        assert!(!module_cache_name("../x/y", (9, 0), (13, 0), 1).contains('/'));
    }
}
