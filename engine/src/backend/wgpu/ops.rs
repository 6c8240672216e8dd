//! Recorders for the non-matmul kernels of `ds4-shaders-wgsl`: RMSNorm, RoPE, attention with sink (over one key
//! buffer, or [`attention_keyed`] over tagged entries into the batch rows, the window ring, the compressed rows and
//! the indexer's selections of device-resident KV), mHC, compressor pooling and `ape` ([`add_ape`]), indexer
//! scores/top-k, MoE routing/SwiGLU/gather/scatter and the FP8/FP4 activation simulation.
//!
//! Each function validates its geometry, builds the uniform block the WGSL file documents (the `#[repr(C)]`
//! structs below mirror the WGSL `Params` field for field) and records one dispatch. Buffers are f32 unless named
//! otherwise; offsets and strides are in elements. Nothing here submits.

use ds4_shaders_wgsl as sh;
use ds4_shaders_wgsl::params::{
    ActParams, AttnParams, CompressParams, HcParams, IndexerParams, MoeParams, NormParams, RopeParams,
};

use super::context::{backend_err, WgpuContext};
use super::matmul::u32_of;
use crate::error::Result;

use super::context::Enc;
type Buf = wgpu::Buffer;

pub(crate) fn groups(n: usize) -> Result<u32> {
    u32_of(n.div_ceil(64), "workgroups")
}

/// (grid_x, grid_y) for `n` workgroups spread over two dimensions.
pub(super) fn grid2(n: usize) -> (u32, u32) {
    let gx = n.clamp(1, 32768);
    (gx as u32, n.div_ceil(gx) as u32)
}

/// `y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * g` for `rows` rows of `n` values; `g = None` for the unweighted
/// norm. `x` and `y` may be the same buffer (pass it twice). Row r of x starts at `x_off + r * x_stride`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    ctx: &WgpuContext,
    enc: &mut Enc,
    x: (&Buf, usize, usize),
    y: (&Buf, usize, usize),
    g: Option<&Buf>,
    n: usize,
    rows: usize,
    eps: f32,
) -> Result<()> {
    if n == 0 || rows == 0 {
        return Ok(());
    }
    let pl = ctx.pipeline("rms_norm", sh::RMS_NORM)?;
    let (gx, gy) = grid2(rows);
    let p = NormParams {
        n: u32_of(n, "n")?,
        rows: u32_of(rows, "rows")?,
        x_offset: u32_of(x.1, "x offset")?,
        x_stride: u32_of(x.2, "x stride")?,
        y_offset: u32_of(y.1, "y offset")?,
        y_stride: u32_of(y.2, "y stride")?,
        has_weight: g.is_some() as u32,
        grid_x: gx,
        eps,
        heads: 0,
        rope_dim: 0,
        fp8_block: 0,
    };
    let u = ctx.uniform("rms_norm", &p);
    // No weight: binding 2 is read-only, so the context's zeros serve.
    let gb = g.unwrap_or(ctx.zeros());
    if std::ptr::eq(x.0, y.0) {
        // Same buffer: bind it once per binding anyway (both read_write, allowed in one usage scope).
        ctx.dispatch(enc, &pl, &[x.0, x.0, gb, &u], [gx, gy, 1])
    } else {
        ctx.dispatch(enc, &pl, &[x.0, y.0, gb, &u], [gx, gy, 1])
    }
}

/// Geometry of a RoPE application: `heads` heads of `head_dim` per token, rope on the last `rope_dim`.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub n_tok: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub offset: usize,
    pub tok_stride: usize,
    pub head_stride: usize,
}

/// In-place (inverse) RoPE with `cs` = per token, per pair `(cos, sin)` (`n_tok * rope_dim / 2` pairs).
pub fn rope(ctx: &WgpuContext, enc: &mut Enc, x: &Buf, cs: &Buf, s: RopeShape, inverse: bool) -> Result<()> {
    if !s.rope_dim.is_multiple_of(2) || s.rope_dim > s.head_dim {
        return Err(backend_err(format!("rope: rope_dim {} must be even and <= head_dim {}", s.rope_dim, s.head_dim)));
    }
    if s.n_tok == 0 || s.heads == 0 || s.rope_dim == 0 {
        return Ok(());
    }
    let pl = ctx.pipeline("rope", sh::ROPE)?;
    let p = RopeParams {
        n_tok: u32_of(s.n_tok, "n_tok")?,
        heads: u32_of(s.heads, "heads")?,
        head_dim: u32_of(s.head_dim, "head_dim")?,
        rope_dim: u32_of(s.rope_dim, "rope_dim")?,
        offset: u32_of(s.offset, "offset")?,
        tok_stride: u32_of(s.tok_stride, "tok_stride")?,
        head_stride: u32_of(s.head_stride, "head_stride")?,
        inverse: inverse as u32,
    };
    let u = ctx.uniform("rope", &p);
    ctx.dispatch(enc, &pl, &[x, cs, &u], [groups(s.rope_dim / 2 * s.heads)?, u32_of(s.n_tok, "n_tok")?, 1])
}

/// Key lists for [`attention`]: token t attends to rows `rows[start_t .. start_t + count_t]` of the KV buffer.
pub struct KeyLists {
    pub rows: Vec<u32>,
    /// `(start, count)` per query token.
    pub ranges: Vec<(u32, u32)>,
}

impl KeyLists {
    /// The key rows and the flattened `(start, count)` ranges as two storage buffers.
    fn upload(&self, ctx: &WgpuContext) -> (Buf, Buf) {
        let ranges: Vec<u32> = self.ranges.iter().flat_map(|&(s, c)| [s, c]).collect();
        (ctx.storage_u32("attn rows", &self.rows), ctx.storage_u32("attn ranges", &ranges))
    }
}

/// Uniforms for attending over `keys` with queries at `(offset, token stride)` `q` and outputs at `o`; `None`
/// when there is nothing to attend (no query rows or no heads). Fails when a key range points past `keys.rows`
/// or a size does not fit in u32.
fn attn_params_for_keys(
    keys: &KeyLists,
    q: (usize, usize),
    o: (usize, usize),
    heads: usize,
    dim: usize,
    scale: f32,
    topk: usize,
) -> Result<Option<AttnParams>> {
    let n_tok = keys.ranges.len();
    if n_tok == 0 || heads == 0 {
        return Ok(None);
    }
    for &(s, c) in &keys.ranges {
        if s as usize + c as usize > keys.rows.len() {
            return Err(backend_err(format!("attention: key range {s}+{c} exceeds {} rows", keys.rows.len())));
        }
    }
    let max_keys = keys.ranges.iter().map(|r| r.1 as usize).max().unwrap_or(0).max(1);
    Ok(Some(AttnParams {
        n_tok: u32_of(n_tok, "n_tok")?,
        heads: u32_of(heads, "heads")?,
        dim: u32_of(dim, "dim")?,
        max_keys: u32_of(max_keys, "max_keys")?,
        q_offset: u32_of(q.0, "q offset")?,
        q_tok_stride: u32_of(q.1, "q stride")?,
        o_offset: u32_of(o.0, "o offset")?,
        o_tok_stride: u32_of(o.1, "o stride")?,
        scale,
        topk: u32_of(topk, "topk")?,
        page_shift: UNPAGED_SHIFT,
        rope_dim: 0,
        rope_row0: 0,
        _p0: 0,
        _p1: 0,
        _p2: 0,
    }))
}

/// Softmax-with-sink attention, K = V (see `attention.wgsl`). `q`/`o`: `(buffer, offset, token stride)`, heads of
/// `dim` values contiguous per token. `o` may be the same buffer as `q`.
/// The graph runs [`attention_keyed`]; this key-list form is kept as the reference its tests check against.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(test), allow(dead_code))]
pub fn attention(
    ctx: &WgpuContext,
    enc: &mut Enc,
    q: (&Buf, usize, usize),
    kv: &Buf,
    keys: &KeyLists,
    sink: &Buf,
    o: (&Buf, usize, usize),
    heads: usize,
    dim: usize,
    scale: f32,
) -> Result<()> {
    let Some(p) = attn_params_for_keys(keys, (q.1, q.2), (o.1, o.2), heads, dim, scale, 0)? else { return Ok(()) };
    let (n_tok, max_keys) = (p.n_tok as usize, p.max_keys as usize);
    let pl = ctx.pipeline("attention", sh::ATTENTION)?;
    let u = ctx.uniform("attention", &p);
    let (rows, rng) = keys.upload(ctx);
    let scratch = ctx.storage_zeroed("attn scratch", n_tok * heads * max_keys);
    ctx.dispatch(enc, &pl, &[q.0, kv, &rows, &rng, sink, &scratch, o.0, &u], [u32_of(heads, "heads")?, p.n_tok, 1])
}

/// Key-entry tags of [`attention_keyed`] (top two bits of an entry; the low 30 bits are the row or selection index).
pub mod key {
    /// Row of the batch's raw KV rows.
    pub const BATCH: u32 = 0;
    /// Slot of the session's window ring.
    pub const RING: u32 = 1 << 30;
    /// Row of the session's compressed rows.
    pub const COMP: u32 = 2 << 30;
    /// Selection j of the token: compressed row `sel[t * topk + j]`, skipped when `u32::MAX`.
    pub const SEL: u32 = 3 << 30;
    /// Largest index an entry can carry.
    pub const MAX_INDEX: u32 = (1 << 30) - 1;
}

/// Rows read through a page table (`pages.wgsl`'s `page_row`): row `w` at row
/// `table[w >> shift] << shift | (w & mask)` of `rows` (u32 page ids in `table`).
pub struct Paged<'a> {
    pub rows: &'a Buf,
    pub table: &'a Buf,
    pub shift: u32,
}

/// The `shift` that, with [`unpaged_table`], reads a plain row buffer (row `w` at `w`).
pub const UNPAGED_SHIFT: u32 = 31;

/// The one-entry page table (`[0]`) of a plain row buffer (see [`UNPAGED_SHIFT`]).
pub fn unpaged_table(ctx: &WgpuContext) -> Buf {
    ctx.storage_u32("unpaged table", &[0])
}

/// Sources of [`attention_keyed`]: batch rows, ring, paged compressed rows and the selections (`topk` per token).
pub struct KeySources<'a> {
    pub batch: &'a Buf,
    pub ring: &'a Buf,
    pub comp: Paged<'a>,
    pub sel: &'a Buf,
    pub topk: usize,
}

/// Like [`attention`], with key entries tagged by source (see [`key`] and `attention.wgsl`, entry `keyed`). The
/// four source buffers must be distinct from each other and from `q`/`o`. `inverse_rope = Some((cs, rope_dim,
/// row0))` also rotates the last `rope_dim` values of every output head back (the inverse of [`rope`] with the
/// table `cs`, token t at its row `row0 + t`), in the same dispatch.
#[allow(clippy::too_many_arguments)]
pub fn attention_keyed(
    ctx: &WgpuContext,
    enc: &mut Enc,
    q: (&Buf, usize, usize),
    src: &KeySources<'_>,
    keys: &KeyLists,
    sink: &Buf,
    o: (&Buf, usize, usize),
    heads: usize,
    dim: usize,
    scale: f32,
    inverse_rope: Option<(&Buf, usize, usize)>,
) -> Result<()> {
    let Some(mut p) = attn_params_for_keys(keys, (q.1, q.2), (o.1, o.2), heads, dim, scale, src.topk)? else {
        return Ok(());
    };
    p.page_shift = src.comp.shift;
    if let Some((_, rd, row0)) = inverse_rope {
        if rd == 0 || !rd.is_multiple_of(2) || rd > dim {
            return Err(backend_err(format!("attention: rope_dim {rd} of heads of {dim}")));
        }
        p.rope_dim = u32_of(rd, "rope_dim")?;
        p.rope_row0 = u32_of(row0, "rope row")?;
    }
    let cs = inverse_rope.map_or(ctx.zeros(), |r| r.0);
    let (n_tok, max_keys) = (p.n_tok as usize, p.max_keys as usize);
    let pl = ctx.pipeline_entry("attention", sh::ATTENTION, "keyed")?;
    let u = ctx.uniform("attention", &p);
    let (rows, rng) = keys.upload(ctx);
    let scratch = ctx.scratch(n_tok * heads * max_keys);
    let bound = [
        (0, q.0),
        (1, src.batch),
        (2, &rows),
        (3, &rng),
        (4, sink),
        (5, &*scratch),
        (6, o.0),
        (7, &u),
        (8, src.ring),
        (9, src.comp.rows),
        (10, src.sel),
        (11, src.comp.table),
        (12, cs),
    ];
    ctx.dispatch_at(enc, &pl, &bound, [u32_of(heads, "heads")?, p.n_tok, 1])
}

/// mHC constants.
#[derive(Clone, Copy, Debug)]
pub struct HcShape {
    pub n_tok: usize,
    /// Hidden width d.
    pub d: usize,
    /// Streams N (at most 8).
    pub n: usize,
    pub sinkhorn_iters: usize,
    pub norm_eps: f32,
    pub hc_eps: f32,
}

fn hc_params(s: &HcShape, head: bool) -> Result<HcParams> {
    if s.n == 0 || s.n > 8 {
        return Err(backend_err(format!("hc: {} streams (supported: 1..=8)", s.n)));
    }
    Ok(HcParams {
        n_tok: u32_of(s.n_tok, "n_tok")?,
        d: u32_of(s.d, "d")?,
        n: s.n as u32,
        iters: u32_of(s.sinkhorn_iters, "iters")?,
        head: head as u32,
        mix_offset: 0,
        mix_stride: 0,
        u_offset: 0,
        u_stride: 0,
        f_offset: 0,
        f_stride: 0,
        has_weight: 0,
        norm_eps: s.norm_eps,
        hc_eps: s.hc_eps,
        _p1: [0; 2],
    })
}

/// mHC pre: from the raw mixes (`mix`: `(buffer, offset, token stride)`, fn · flatten(X) per token) computes the
/// pre weights (and, unless `head`, post + Sinkhorn comb into `state`, `N + N²` per token) and writes
/// `u[t] = Σ_j pre_j X[t, j]`. `xs` holds X token-major (`N * d` per token). For the output head pass `head = true`
/// (`state` is then untouched but must be bound). The graph runs the split form (`rows::hc_sinkhorn`,
/// `rows::hc_collapse`); this fused one is kept as the reference its tests check against.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(test), allow(dead_code))]
pub fn hc_pre(
    ctx: &WgpuContext,
    enc: &mut Enc,
    s: &HcShape,
    xs: &Buf,
    mix: (&Buf, usize, usize),
    base: &Buf,
    scale: &Buf,
    state: &Buf,
    u: (&Buf, usize, usize),
    head: bool,
) -> Result<()> {
    if s.n_tok == 0 {
        return Ok(());
    }
    let mut p = hc_params(s, head)?;
    p.mix_offset = u32_of(mix.1, "mix offset")?;
    p.mix_stride = u32_of(mix.2, "mix stride")?;
    p.u_offset = u32_of(u.1, "u offset")?;
    p.u_stride = u32_of(u.2, "u stride")?;
    let pl = ctx.pipeline_entry("hc", sh::HC, "pre")?;
    let ub = ctx.uniform("hc pre", &p);
    ctx.dispatch(enc, &pl, &[xs, mix.0, base, scale, state, u.0, &ub], [p.n_tok, 1, 1])
}

/// mHC post: `out[t, k] = post_k f[t] + Σ_j comb[j][k] X[t, j]` with `state` from [`hc_pre`]. `out` ≠ `xs`.
///
/// With `normed`, the unweighted RMSNorm of each new row (`N·d` values, eps `s.norm_eps`) goes there in the same
/// dispatch (`post_norm`; bit for bit the two kernels in turn; `d` a multiple of 64).
#[allow(clippy::too_many_arguments)]
pub fn hc_post(
    ctx: &WgpuContext,
    enc: &mut Enc,
    s: &HcShape,
    xs: &Buf,
    f: (&Buf, usize, usize),
    state: &Buf,
    out: &Buf,
    normed: Option<&Buf>,
) -> Result<()> {
    if s.n_tok == 0 {
        return Ok(());
    }
    if std::ptr::eq(xs, out) || normed.is_some_and(|b| std::ptr::eq(b, out)) {
        return Err(backend_err("hc_post: output must not alias the input streams or the normed output"));
    }
    let mut p = hc_params(s, false)?;
    p.f_offset = u32_of(f.1, "f offset")?;
    p.f_stride = u32_of(f.2, "f stride")?;
    let mut bind = vec![(0, xs), (1, f.0), (4, state), (5, out)];
    let (entry, groups) = match normed {
        Some(nb) => {
            if !s.d.is_multiple_of(64) {
                return Err(backend_err(format!("hc_post with the norm: width {} is not a multiple of 64", s.d)));
            }
            bind.push((7, nb));
            ("post_norm", [p.n_tok, 1, 1])
        }
        None => ("post", [groups(s.d)?, p.n_tok, 1]),
    };
    let pl = ctx.pipeline_entry("hc", sh::HC, entry)?;
    let ub = ctx.uniform("hc post", &p);
    bind.push((6, &ub));
    ctx.dispatch_at(enc, &pl, &bind, groups)
}

/// One input of a pooling window: source token row, feature offset within the row, APE row. `None` = none.
pub type PoolInput = Option<(u32, u32, u32)>;

/// Compressor pooling (see `compress.wgsl`): `slots.len()` must be `n_windows * slots_per_window`.
#[allow(clippy::too_many_arguments)]
pub fn compress_pool(
    ctx: &WgpuContext,
    enc: &mut Enc,
    kv: &Buf,
    gate: &Buf,
    src_stride: usize,
    ape: &Buf,
    ape_stride: usize,
    slots: &[PoolInput],
    slots_per_window: usize,
    dim: usize,
    out: (&Buf, usize, usize),
) -> Result<()> {
    if slots_per_window == 0 || !slots.len().is_multiple_of(slots_per_window) {
        return Err(backend_err(format!("compress: {} slots for windows of {slots_per_window}", slots.len())));
    }
    let n_windows = slots.len() / slots_per_window;
    if n_windows == 0 || dim == 0 {
        return Ok(());
    }
    let flat: Vec<u32> = slots.iter().flat_map(|s| s.map_or([u32::MAX, 0, 0], |(r, o, a)| [r, o, a])).collect();
    let pl = ctx.pipeline("compress", sh::COMPRESS)?;
    let p = CompressParams {
        n_windows: u32_of(n_windows, "windows")?,
        slots: u32_of(slots_per_window, "slots")?,
        dim: u32_of(dim, "dim")?,
        src_stride: u32_of(src_stride, "src stride")?,
        ape_stride: u32_of(ape_stride, "ape stride")?,
        out_offset: u32_of(out.1, "out offset")?,
        out_stride: u32_of(out.2, "out stride")?,
        _p0: 0,
    };
    let sb = ctx.storage_u32("compress slots", &flat);
    let ub = ctx.uniform("compress", &p);
    ctx.dispatch(enc, &pl, &[kv, gate, ape, &sb, out.0, &ub], [groups(dim)?, p.n_windows, 1])
}

/// Indexer scores then top-k (see `indexer.wgsl`). `q`: `[.., heads, dim]`, `keys`: `[n_keys, dim]` (paged),
/// `w`: `[.., heads]` head weights (each multiplied by `w_scale` as it is read), token `t` at row `row0 + t` of
/// both, `limit[t]`: visible key rows of token t, `scale` the scores' scale. Writes `scores` (`n_tok * n_keys`)
/// and `sel` (u32, rows `row0 ..` of `k`: ascending row ids padded with `u32::MAX`).
#[allow(clippy::too_many_arguments)]
pub fn indexer_topk(
    ctx: &WgpuContext,
    enc: &mut Enc,
    q: &Buf,
    keys: &Paged<'_>,
    w: &Buf,
    row0: usize,
    limit: &[u32],
    n_keys: usize,
    heads: usize,
    dim: usize,
    k: usize,
    (w_scale, scale): (f32, f32),
    scores: &Buf,
    sel: &Buf,
) -> Result<()> {
    let n_tok = limit.len();
    if n_tok == 0 || k == 0 {
        return Ok(());
    }
    let p = IndexerParams {
        n_tok: u32_of(n_tok, "n_tok")?,
        n_keys: u32_of(n_keys, "n_keys")?,
        heads: u32_of(heads, "heads")?,
        dim: u32_of(dim, "dim")?,
        k: u32_of(k, "k")?,
        page_shift: keys.shift,
        w_scale,
        scale,
        row0: u32_of(row0, "row0")?,
        _p: [0; 3],
    };
    let lb = ctx.storage_u32("indexer limits", limit);
    let ub = ctx.uniform("indexer", &p);
    if n_keys > 0 {
        let pl = ctx.pipeline_entry("indexer", sh::INDEXER, "scores")?;
        ctx.dispatch_at(
            enc,
            &pl,
            &[(0, q), (1, keys.rows), (2, w), (3, &lb), (4, scores), (6, &ub), (7, keys.table)],
            [groups(n_keys)?, p.n_tok, 1],
        )?;
    }
    let pl = ctx.pipeline_entry("indexer", sh::INDEXER, "topk")?;
    ctx.dispatch_at(enc, &pl, &[(3, &lb), (4, scores), (5, sel), (6, &ub)], [p.n_tok, 1, 1])
}

fn moe_params() -> MoeParams {
    bytemuck::Zeroable::zeroed()
}

/// How experts are selected.
pub enum Routing<'a> {
    /// Learned: top-k of `s + bias`.
    Learned { bias: &'a Buf },
    /// Hash: `tid2eid[token_id]` (u32 `[vocab, k]`), token ids u32 per token.
    Hash { tid2eid: &'a Buf, tokens: &'a Buf },
}

/// MoE routing: `logits` `[n_tok, n_exp]` → `sel` (u32 `[n_tok, k]`) and weights `rw` (`[n_tok, k]`,
/// renormalised to sum 1 when `renorm`, × `route_scale`).
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    ctx: &WgpuContext,
    enc: &mut Enc,
    logits: &Buf,
    routing: Routing<'_>,
    n_tok: usize,
    n_exp: usize,
    k: usize,
    route_scale: f32,
    renorm: bool,
    sel: &Buf,
    rw: &Buf,
) -> Result<()> {
    if k == 0 || k > n_exp {
        return Err(backend_err(format!("moe route: top-{k} of {n_exp} experts")));
    }
    if n_tok == 0 {
        return Ok(());
    }
    let mut p = moe_params();
    p.n_tok = u32_of(n_tok, "n_tok")?;
    p.n_exp = u32_of(n_exp, "n_exp")?;
    p.k = k as u32;
    p.route_scale = route_scale;
    p.renorm = renorm as u32;
    let pl = ctx.pipeline_entry("moe", sh::MOE, "route")?;
    let dummy_f = ctx.storage_zeroed("moe dummy", 1);
    let dummy_u = ctx.storage_u32("moe dummy", &[0]);
    let (b, ia, ib) = match routing {
        Routing::Learned { bias } => (bias, &dummy_u, &dummy_u),
        Routing::Hash { tid2eid, tokens } => {
            p.hash = 1;
            (&dummy_f, tokens, tid2eid)
        }
    };
    let ub = ctx.uniform("moe route", &p);
    ctx.dispatch_at(
        enc,
        &pl,
        &[(0, logits), (1, b), (2, ia), (3, ib), (4, sel), (5, rw), (6, &ub)],
        [groups(n_tok)?, 1, 1],
    )
}

/// Clamped SwiGLU: `h[r, c] = silu(min(g, L)) * clamp(u, −L, L) * rw[widx[r]]` over `rows` rows of `n`, where row r
/// of `gu` holds gate at `r * gu_stride + c` and up at `r * gu_stride + up_offset + c`. `weights = None` skips the
/// routing weight. `shared = Some((buf, m))` adds, in the same dispatch, the SwiGLU of `m` rows of `buf` (the shared
/// expert's gate|up rows, same strides) written over their gate halves, without a routing weight.
#[allow(clippy::too_many_arguments)]
pub fn swiglu(
    ctx: &WgpuContext,
    enc: &mut Enc,
    gu: &Buf,
    gu_stride: usize,
    up_offset: usize,
    h: (&Buf, usize, usize),
    n: usize,
    rows: usize,
    limit: f32,
    weights: Option<(&Buf, &[u32])>,
    shared: Option<(&Buf, usize)>,
) -> Result<()> {
    let rows2 = shared.map_or(0, |s| s.1);
    if n == 0 || rows + rows2 == 0 {
        return Ok(());
    }
    let mut p = moe_params();
    p.n = u32_of(n, "n")?;
    p.rows = u32_of(rows, "rows")?;
    p.gu_stride = u32_of(gu_stride, "gu stride")?;
    p.up_offset = u32_of(up_offset, "up offset")?;
    p.h_offset = u32_of(h.1, "h offset")?;
    p.h_stride = u32_of(h.2, "h stride")?;
    p.limit = limit;
    p.rows2 = u32_of(rows2, "shared rows")?;
    let dummy_f;
    let (rw, idx) = match weights {
        Some((rw, idx)) => {
            if idx.len() != rows {
                return Err(backend_err(format!("swiglu: {} weight indices for {rows} rows", idx.len())));
            }
            p.use_w = 1;
            (rw, ctx.storage_u32("swiglu widx", idx))
        }
        None => {
            dummy_f = ctx.storage_zeroed("swiglu dummy", 1);
            (&dummy_f, ctx.storage_u32("swiglu widx", &[0]))
        }
    };
    let ub = ctx.uniform("swiglu", &p);
    let bind = [(0, gu), (1, h.0), (2, &idx), (5, rw), (6, &ub)];
    match shared {
        Some((sb, _)) => {
            let pl = ctx.pipeline_entry("moe", sh::MOE, "swiglu_shared")?;
            let mut bind = bind.to_vec();
            bind.push((7, sb));
            ctx.dispatch_at(enc, &pl, &bind, [groups(n)?, p.rows + p.rows2, 1])
        }
        None => {
            let pl = ctx.pipeline_entry("moe", sh::MOE, "swiglu")?;
            ctx.dispatch_at(enc, &pl, &bind, [groups(n)?, p.rows, 1])
        }
    }
}

/// `dst[r] = src[rows[r]]` (rows of `n`; source row stride `stride`, destination packed).
pub fn gather_rows(
    ctx: &WgpuContext,
    enc: &mut Enc,
    src: &Buf,
    dst: &Buf,
    rows: &[u32],
    n: usize,
    stride: usize,
) -> Result<()> {
    if rows.is_empty() || n == 0 {
        return Ok(());
    }
    let mut p = moe_params();
    p.n = u32_of(n, "n")?;
    p.rows = u32_of(rows.len(), "rows")?;
    p.stride = u32_of(stride, "stride")?;
    let pl = ctx.pipeline_entry("moe", sh::MOE, "gather")?;
    let ib = ctx.storage_u32("moe rows", rows);
    let ub = ctx.uniform("moe gather", &p);
    ctx.dispatch_at(enc, &pl, &[(0, src), (1, dst), (2, &ib), (6, &ub)], [groups(n)?, p.rows, 1])
}

/// Which activation round trip [`act_sim`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActSim {
    /// FP8 e4m3, power-of-two block scales (KV rows; blocks of 64).
    Fp8,
    /// FP4 e2m1, power-of-two block scales (indexer; blocks of 32).
    Fp4,
    /// Orthonormal Walsh-Hadamard rotation of the first `n` values (power of two ≤ 1024).
    Hadamard,
}

/// Applies `kind` in place to the first `n` values of `rows` rows (row stride `stride`), blocks of `block`.
#[allow(clippy::too_many_arguments)]
pub fn act_sim(
    ctx: &WgpuContext,
    enc: &mut Enc,
    x: &Buf,
    kind: ActSim,
    rows: usize,
    n: usize,
    stride: usize,
    block: usize,
) -> Result<()> {
    if rows == 0 || n == 0 {
        return Ok(());
    }
    if kind == ActSim::Hadamard && (!n.is_power_of_two() || n > 1024) {
        return Err(backend_err(format!("hadamard: size {n} must be a power of two <= 1024")));
    }
    if kind != ActSim::Hadamard && block == 0 {
        return Err(backend_err("act_sim: block size 0"));
    }
    let p = ActParams {
        rows: u32_of(rows, "rows")?,
        n: u32_of(n, "n")?,
        stride: u32_of(stride, "stride")?,
        block: u32_of(block.max(1), "block")?,
        heads: 0,
        rope_dim: 0,
        _p0: 0,
        _p1: 0,
    };
    let ub = ctx.uniform("act", &p);
    let (entry, g) = match kind {
        ActSim::Fp8 => ("fp8", [groups(n.div_ceil(block))?, p.rows, 1]),
        ActSim::Fp4 => ("fp4", [groups(n.div_ceil(block))?, p.rows, 1]),
        ActSim::Hadamard => ("hadamard", [p.rows, 1, 1]),
    };
    let pl = ctx.pipeline_entry("act", sh::ACT, entry)?;
    ctx.dispatch(enc, &pl, &[x, &ub], g)
}
