//! `ds4-bench kernels`: GB/s of weights streamed by the quant matvec (decode) and batched matmul (prefill) kernels,
//! on all cores, as a fraction of the memory bandwidth measured over the same buffer in the same run.
//!
//! Each [`Case`] is one real Flash weight shape (routed expert gate/up/down, attention and shared-expert projections,
//! F16 indexer/compressor/router). Enough copies of the matrix are stacked to fill the working set (≥ 1 GiB by
//! default and at least 2× the last-level cache), so every pass streams from DRAM, as decoding through 43 layers of
//! experts does. Rows of the stacked matrix are split into one contiguous range per thread; a thread calls the
//! kernel one matrix (or partial matrix) at a time. Bandwidth and kernel passes are both "best of N within a time
//! budget" on the same buffer and thread count. The batched matmul is compute-bound, so each of its passes covers
//! a window of matrices sized to the budget, moved through the buffer pass by pass (its `bytes` column says how
//! much one pass read).
//!
//! The kernels are reached through the [`Kernels`] trait so the harness can be tested with a trivial kernel; the
//! engine binding is `crate::engine_api::EngineKernels`. Besides the bench's own row split (`matvec`, `matmul`), the
//! `engine-matvec` line runs the engine's CPU decode matmul (its worker pool, one call per matrix) on the same
//! buffer: the rate decode actually gets; `engine-matmul` the engine's CPU prefill matmul on `--batch` rows (its
//! worker pool, one call per matrix, every matrix of the buffer per pass) with the weights as a loaded model holds
//! them — Q8_0 packed once (`quant::PackedMat`), the rest as stored: the rate prefill and many-session decode get.
//! The `engine-moe` line ([`run_moe`]) runs the engine's grouped MoE
//! dispatch on Flash's routed experts (IQ2_XXS gate/up, Q2_K down), six experts per token cycling through ≥ 1 GiB
//! of stacked experts: the rate the routed experts of a decoded token get, dispatch and activation work included.
//!
//! Output: CSV on stdout (header [`CSV_HEADER`]), one line per (case, kernel); shortfalls against the issue's
//! targets are repeated as `#` comment lines at the end.

use std::time::Duration;

use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use ds4_engine::quant::GgmlType;
use indicatif::ProgressBar;

use crate::blocks::{self, SplitMix64};
use crate::{membw, par};

/// The CSV header of the kernels report.
pub const CSV_HEADER: &str =
    "case,type,rows,cols,matrices,bytes,threads,kernel,batch,weights_gbs,gflops,mem_gbs,fraction,target,verdict";

/// The quant kernels under test.
pub trait Kernels: Sync {
    /// `y[r] = W[r] · x` for `rows` rows of `cols` values of type `ty` packed in `w`.
    fn matvec(&self, ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) -> Result<()>;
    /// The engine's own decode path, which does its own threading: `y = W · x` over a whole stacked matrix of
    /// `matrices` matrices of `rows × cols`, one call per matrix. `Ok(false)` when not available.
    fn pooled_matvec(
        &self,
        _ty: GgmlType,
        _w: &[u8],
        _rows: usize,
        _cols: usize,
        _x: &[f32],
        _y: &mut [f32],
    ) -> Result<bool> {
        Ok(false)
    }
    /// The engine's MoE decode dispatch for one token (its worker pool; gate+up of every selected expert in one
    /// dispatch, SwiGLU, every down in one): `y = Σ_e down_e(silu(gate_e·x) · up_e·x)` over the experts in `sel`.
    /// `Ok(false)` when not available.
    fn pooled_moe(&self, _w: &MoeWeights<'_>, _sel: &[usize], _x: &[f32], _y: &mut [f32]) -> Result<bool> {
        Ok(false)
    }
    /// The engine's own prefill path, which does its own threading: prepares the stacked weights `w` (`matrices`
    /// matrices of `rows × cols`) in the layout the engine multiplies them in (a loaded model's dense Q8_0 matrices
    /// are packed once) and returns a runner for one pass: `ys = W · xs` for every matrix, one call per matrix,
    /// `batch` activation rows in `xs`, `ys[m·rows·batch + b·rows + r]` (the engine's batch-major layout).
    /// `Ok(None)` when not available.
    fn pooled_matmul<'a>(
        &'a self,
        _ty: GgmlType,
        _w: &'a [u8],
        _rows: usize,
        _cols: usize,
        _matrices: usize,
    ) -> Result<Option<PooledMatmul<'a>>> {
        Ok(None)
    }
    /// The batched form: `xs` holds `batch` activation rows of `cols` values; `ys[r * batch + b] = W[r] · xs[b]`.
    /// (Flat arguments on purpose: they mirror `quant::matvec` so the two are easy to compare.)
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        xs: &[f32],
        batch: usize,
        ys: &mut [f32],
    ) -> Result<()>;
}

/// One pass of [`Kernels::pooled_matmul`]: `(xs, batch, ys)`.
pub type PooledMatmul<'a> = Box<dyn FnMut(&[f32], usize, &mut [f32]) -> Result<()> + 'a>;

/// Stacked routed-expert weights for [`Kernels::pooled_moe`]: expert `e` is rows `e·ffn..(e+1)·ffn` of `gate` and
/// `up` (rows of `d` values of `gate_ty`) and rows `e·d..(e+1)·d` of `down` (rows of `ffn` values of `down_ty`).
#[derive(Clone, Copy, Debug)]
pub struct MoeWeights<'a> {
    pub gate_ty: GgmlType,
    pub down_ty: GgmlType,
    pub d: usize,
    pub ffn: usize,
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
}

/// One benchmarked weight shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Case {
    /// Which Flash tensor this shape is (`expert.gate_up`, `attn.q_b`, ...).
    pub name: &'static str,
    /// Quant type.
    pub ty: GgmlType,
    /// Input width (GGUF `ne0`, values per row).
    pub cols: usize,
    /// Output rows per matrix.
    pub rows: usize,
    /// The matvec target as a fraction of measured bandwidth, if it sets one.
    pub target: Option<f64>,
    /// Whether the case runs without `--all-shapes`.
    pub default: bool,
}

const fn case(name: &'static str, ty: GgmlType, cols: usize, rows: usize, target: Option<f64>, default: bool) -> Case {
    Case { name, ty, cols, rows, target, default }
}

/// The Flash shapes, from `shared/spec/gguf-ds4.md` (GGUF dims `[in, out]`).
pub const CASES: &[Case] = &[
    case("expert.gate_up", GgmlType::Iq2Xxs, 4096, 2048, Some(0.70), true),
    case("expert.down", GgmlType::Q2K, 2048, 4096, Some(0.70), true),
    case("expert.gate_up", GgmlType::Q4K, 4096, 2048, Some(0.70), true),
    case("expert.down", GgmlType::Q4K, 2048, 4096, Some(0.70), true),
    case("attn.q_b", GgmlType::Q8_0, 1024, 32768, Some(0.60), true),
    case("attn.out_b", GgmlType::Q8_0, 8192, 4096, Some(0.60), true),
    case("attn.q_a", GgmlType::Q8_0, 4096, 1024, Some(0.60), false),
    case("attn.out_a", GgmlType::Q8_0, 4096, 8192, Some(0.60), false),
    case("attn.kv", GgmlType::Q8_0, 4096, 512, Some(0.60), false),
    case("shexp.gate_up", GgmlType::Q8_0, 4096, 2048, Some(0.60), false),
    case("shexp.down", GgmlType::Q8_0, 2048, 4096, Some(0.60), false),
    case("indexer.q_b", GgmlType::F16, 1024, 8192, None, true),
    case("compressor.kv", GgmlType::F16, 4096, 1024, None, false),
    case("router", GgmlType::F16, 4096, 256, None, false),
];

/// The MoE decode line (`engine-moe`): Flash's routed experts (IQ2_XXS gate/up 4096→2048, Q2_K down 2048→4096),
/// [`MOE_USED`] of them per token. Its `type` column names the gate/up type; `rows`/`cols` are the gate's.
pub const MOE_CASE: Case = case("expert.moe", GgmlType::Iq2Xxs, 4096, 2048, Some(0.70), true);
/// Experts per token in the `engine-moe` line (Flash's `n_experts_used`).
pub const MOE_USED: usize = 6;
/// The down projections' type in the `engine-moe` line.
pub const MOE_DOWN: GgmlType = GgmlType::Q2K;

/// Options of a kernels run.
#[derive(Clone, Debug)]
pub struct KernelOptions {
    /// Threads (all cores by default).
    pub threads: usize,
    /// Bytes of weights per case; rounded up to whole matrices.
    pub working_set: u64,
    /// Batch size of the matmul (prefill) kernel; 0 skips it.
    pub batch: usize,
    /// Time budget per measurement (bandwidth, matvec, matmul each).
    pub budget: Duration,
    /// Minimum passes per measurement.
    pub min_passes: usize,
    /// Type filter (empty: all).
    pub types: Vec<GgmlType>,
    /// Run the non-default shapes too.
    pub all_shapes: bool,
}

/// One line of the report.
#[derive(Clone, Debug)]
pub struct KernelRow {
    pub case: Case,
    pub matrices: usize,
    pub bytes: u64,
    pub threads: usize,
    pub kernel: &'static str,
    pub batch: usize,
    pub weights_gbs: f64,
    pub gflops: f64,
    pub mem_gbs: f64,
}

impl KernelRow {
    /// Kernel weight rate over measured bandwidth.
    pub fn fraction(&self) -> f64 {
        self.weights_gbs / self.mem_gbs
    }

    /// The target applies to the decode (matvec) kernels only.
    pub fn target(&self) -> Option<f64> {
        if self.kernel.ends_with("matvec") || self.kernel == "engine-moe" {
            self.case.target
        } else {
            None
        }
    }

    /// `ok`, `short` or `-` (no target).
    pub fn verdict(&self) -> &'static str {
        match self.target() {
            Some(t) if self.fraction() >= t => "ok",
            Some(_) => "short",
            None => "-",
        }
    }

    /// The CSV line matching [`CSV_HEADER`].
    pub fn csv(&self) -> String {
        let c = &self.case;
        let target = self.target().map(|t| format!("{t:.2}")).unwrap_or_else(|| "-".into());
        format!(
            "{},{},{},{},{},{},{},{},{},{:.2},{:.2},{:.2},{:.3},{},{}",
            c.name,
            c.ty,
            c.rows,
            c.cols,
            self.matrices,
            self.bytes,
            self.threads,
            self.kernel,
            self.batch,
            self.weights_gbs,
            self.gflops,
            self.mem_gbs,
            self.fraction(),
            target,
            self.verdict()
        )
    }
}

/// The cases selected by `opts`.
pub fn selected(opts: &KernelOptions) -> Vec<Case> {
    CASES
        .iter()
        .filter(|c| opts.all_shapes || c.default)
        .filter(|c| opts.types.is_empty() || opts.types.contains(&c.ty))
        .copied()
        .collect()
}

/// The working set to use by default: 1 GiB, and at least twice the last-level cache.
pub fn default_working_set(llc: Option<u64>) -> u64 {
    (1u64 << 30).max(llc.unwrap_or(0) * 2)
}

/// Parses a quant type name as the CLI accepts it (`q8_0`, `q2_k`, `q4_k`, `iq2_xxs`, `f16`, `f32`).
pub fn parse_type(s: &str) -> Result<GgmlType> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "q8_0" => GgmlType::Q8_0,
        "q2_k" => GgmlType::Q2K,
        "q4_k" => GgmlType::Q4K,
        "iq2_xxs" => GgmlType::Iq2Xxs,
        "f16" => GgmlType::F16,
        "f32" => GgmlType::F32,
        _ => bail!("unknown quant type {s:?} (expected q8_0, q2_k, q4_k, iq2_xxs, f16 or f32)"),
    })
}

/// Cuts `buf` into one mutable slice per range, `range.start * scale .. range.end * scale`, each behind its own
/// (uncontended) mutex so scoped threads can take theirs. The ranges must be sorted and disjoint.
fn split_mut<'a, T>(mut buf: &'a mut [T], ranges: &[std::ops::Range<usize>], scale: usize) -> Vec<Mutex<&'a mut [T]>> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut pos = 0usize;
    for r in ranges {
        let (_, rest) = std::mem::take(&mut buf).split_at_mut(r.start * scale - pos);
        let (mine, rest) = rest.split_at_mut(r.len() * scale);
        out.push(Mutex::new(mine));
        buf = rest;
        pos = r.end * scale;
    }
    out
}

/// Calls `f(a, b)` for the pieces of `r` cut at multiples of `rows` (one matrix at a time), stopping at an error.
fn for_matrix_chunks(
    r: std::ops::Range<usize>,
    rows: usize,
    mut f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<()> {
    let mut a = r.start;
    while a < r.end {
        let b = ((a / rows + 1) * rows).min(r.end);
        f(a, b)?;
        a = b;
    }
    Ok(())
}

/// Runs `pass(range, out_slice)` on every thread's range, `best_of` style, and returns the timing or the first
/// error any thread hit.
fn timed_passes<T: Send>(
    ranges: &[std::ops::Range<usize>],
    out: &mut [T],
    scale: usize,
    opts: &KernelOptions,
    pb: &ProgressBar,
    pass: impl Fn(std::ops::Range<usize>, &mut [T]) -> Result<()> + Sync,
) -> Result<par::Timing> {
    timed_passes_with(ranges, out, scale, opts, pb, &std::sync::atomic::AtomicUsize::new(0), pass)
}

/// [`timed_passes`] that also counts finished passes in `pass_no` (read by `pass` to move its window).
fn timed_passes_with<T: Send>(
    ranges: &[std::ops::Range<usize>],
    out: &mut [T],
    scale: usize,
    opts: &KernelOptions,
    pb: &ProgressBar,
    pass_no: &std::sync::atomic::AtomicUsize,
    pass: impl Fn(std::ops::Range<usize>, &mut [T]) -> Result<()> + Sync,
) -> Result<par::Timing> {
    let parts = split_mut(out, ranges, scale);
    let first_err: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let timing = par::best_of(
        opts.min_passes,
        50,
        opts.budget,
        || {
            par::for_each_range(ranges, |i, r| {
                let mut slot = parts[i].lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = pass(r, &mut slot) {
                    first_err.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                }
            })
        },
        || {
            pass_no.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            pb.inc(1)
        },
    );
    match first_err.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(timing),
    }
}

/// `par::best_of` (the options' passes and budget, `pb` advanced per pass) over a pass that may fail: passes
/// stop at the first error, which is returned.
fn best_of_checked(
    opts: &KernelOptions,
    pb: &ProgressBar,
    mut pass: impl FnMut() -> Result<()>,
) -> Result<par::Timing> {
    let mut err = None;
    let t = par::best_of(
        opts.min_passes,
        50,
        opts.budget,
        || {
            if err.is_none() {
                err = pass().err();
            }
        },
        || pb.inc(1),
    );
    err.map_or(Ok(t), Err)
}

/// Runs one case: fills the stacked weights, measures bandwidth, then the matvec and (if `opts.batch > 0`) the
/// matmul kernel. `pb` advances once per pass.
pub fn run_case(k: &dyn Kernels, case: &Case, opts: &KernelOptions, pb: &ProgressBar) -> Result<Vec<KernelRow>> {
    let row_bytes = case.ty.row_bytes(case.cols as u64).context("case width is not whole blocks")? as usize;
    let matrix_bytes = row_bytes * case.rows;
    let matrices = (opts.working_set as usize).div_ceil(matrix_bytes).max(1);
    let total_rows = matrices * case.rows;
    let bytes = matrices * matrix_bytes;
    let label = format!("{} {}", case.name, case.ty);
    pb.set_message(format!("{label}: filling {} MiB", bytes >> 20));
    let mut w = vec![0u8; bytes];
    blocks::fill_par(case.ty, &mut w, 1.0, 0x5eed ^ case.ty.id() as u64, opts.threads);
    let w = &w[..];
    let mut rng = SplitMix64::new(99);

    pb.set_message(format!("{label}: memory bandwidth"));
    let bw = membw::measure(w, opts.threads, opts.min_passes, opts.budget, || pb.inc(1));
    let ranges = par::split(total_rows, opts.threads, 1);
    let row = |kernel, batch, t: par::Timing| KernelRow {
        case: *case,
        matrices,
        bytes: bytes as u64,
        threads: ranges.len(),
        kernel,
        batch,
        weights_gbs: par::gbs(bytes as u64, t.best),
        gflops: 2.0 * (total_rows * case.cols * batch) as f64 / t.best.as_secs_f64().max(1e-12) / 1e9,
        mem_gbs: bw.gbs,
    };
    let mut out = Vec::new();

    // Decode: one activation vector against every row.
    pb.set_message(format!("{label}: matvec"));
    let x: Vec<f32> = (0..case.cols).map(|_| rng.next_sym()).collect();
    let mut y = vec![0f32; total_rows];
    let t = timed_passes(&ranges, &mut y, 1, opts, pb, |r, y| {
        let base = r.start;
        for_matrix_chunks(r, case.rows, |a, b| {
            k.matvec(case.ty, &w[a * row_bytes..b * row_bytes], b - a, case.cols, &x, &mut y[a - base..b - base])
        })
    })
    .with_context(|| format!("{label}: matvec"))?;
    check_finite(&y).with_context(|| format!("{label}: matvec"))?;
    out.push(row("matvec", 1, t));

    // The engine's decode matmul (its worker pool, one call per matrix), if the kernels offer it.
    if k.pooled_matvec(case.ty, &w[..matrix_bytes], case.rows, case.cols, &x, &mut y[..case.rows])? {
        pb.set_message(format!("{label}: engine matvec"));
        let t = best_of_checked(opts, pb, || {
            for (m, ym) in y.chunks_exact_mut(case.rows).enumerate() {
                let wm = &w[m * matrix_bytes..(m + 1) * matrix_bytes];
                k.pooled_matvec(case.ty, wm, case.rows, case.cols, &x, ym)?;
            }
            Ok(())
        })
        .with_context(|| format!("{label}: engine matvec"))?;
        check_finite(&y).with_context(|| format!("{label}: engine matvec"))?;
        out.push(KernelRow { threads: opts.threads, ..row("engine-matvec", 1, t) });
    }

    // Prefill: `batch` activation rows against every weight row. The batched kernel is compute-bound, so a pass
    // covers a window of `k` matrices sized to the time budget (calibrated on one matrix); the window moves through
    // the buffer pass by pass so every pass still reads weights that are not in cache.
    if opts.batch > 0 {
        pb.set_message(format!("{label}: matmul x{}", opts.batch));
        let nb = opts.batch;
        let xs: Vec<f32> = (0..case.cols * nb).map(|_| rng.next_sym()).collect();
        let mut probe = vec![0f32; case.rows * nb];
        let t0 = std::time::Instant::now();
        k.matmul(case.ty, &w[..matrix_bytes], case.rows, case.cols, &xs, nb, &mut probe)
            .with_context(|| format!("{label}: matmul"))?;
        let one = t0.elapsed().as_secs_f64() / opts.threads.max(1) as f64;
        let per_pass = opts.budget.as_secs_f64() / opts.min_passes.max(1) as f64;
        let kmat = ((per_pass / one.max(1e-9)) as usize).clamp(1, matrices);
        let window_rows = kmat * case.rows;
        let mranges = par::split(window_rows, opts.threads, 1);
        let mut ys = vec![0f32; window_rows * nb];
        let pass_no = std::sync::atomic::AtomicUsize::new(0);
        let t = timed_passes_with(&mranges, &mut ys, nb, opts, pb, &pass_no, |r, ys| {
            let p = pass_no.load(std::sync::atomic::Ordering::Relaxed);
            let base = (p * kmat) % (matrices - kmat + 1) * case.rows;
            let start = r.start;
            for_matrix_chunks(r, case.rows, |a, b| {
                let w = &w[(base + a) * row_bytes..(base + b) * row_bytes];
                k.matmul(case.ty, w, b - a, case.cols, &xs, nb, &mut ys[(a - start) * nb..(b - start) * nb])
            })
        })
        .with_context(|| format!("{label}: matmul"))?;
        check_finite(&ys).with_context(|| format!("{label}: matmul"))?;
        let wbytes = (kmat * matrix_bytes) as u64;
        out.push(KernelRow {
            matrices: kmat,
            bytes: wbytes,
            weights_gbs: par::gbs(wbytes, t.best),
            gflops: 2.0 * (window_rows * case.cols * nb) as f64 / t.best.as_secs_f64().max(1e-12) / 1e9,
            ..row("matmul", nb, t)
        });
    }

    // The engine's prefill matmul (its worker pool, one call per matrix, the weights in the engine's layout: Q8_0
    // packed once, as a loaded model's dense matrices are); a pass is every matrix of the buffer.
    if opts.batch > 0 {
        pb.set_message(format!("{label}: engine matmul x{}", opts.batch));
        if let Some(mut run) = k.pooled_matmul(case.ty, w, case.rows, case.cols, matrices)? {
            let nb = opts.batch;
            let xs: Vec<f32> = (0..case.cols * nb).map(|_| rng.next_sym()).collect();
            let mut ys = vec![0f32; total_rows * nb];
            let t = best_of_checked(opts, pb, || run(&xs, nb, &mut ys))
                .with_context(|| format!("{label}: engine matmul"))?;
            check_finite(&ys).with_context(|| format!("{label}: engine matmul"))?;
            out.push(KernelRow { threads: opts.threads, ..row("engine-matmul", nb, t) });
        }
    }
    Ok(out)
}

/// Runs the `engine-moe` line if the kernels offer it and the type filter keeps both expert types: enough experts
/// stacked to fill the working set, one pass = consecutive tokens whose [`MOE_USED`] experts cycle through all of
/// them (each expert's weights read once per pass, from DRAM), best of N passes.
pub fn run_moe(k: &dyn Kernels, opts: &KernelOptions, pb: &ProgressBar) -> Result<Option<KernelRow>> {
    let c = MOE_CASE;
    let wanted = |t: GgmlType| opts.types.is_empty() || opts.types.contains(&t);
    if !(wanted(c.ty) && wanted(MOE_DOWN)) {
        return Ok(None);
    }
    let (d, ffn) = (c.cols, c.rows);
    let grb = c.ty.row_bytes(d as u64).context("moe gate width")? as usize;
    let drb = MOE_DOWN.row_bytes(ffn as u64).context("moe down width")? as usize;
    let (gate_bytes, down_bytes) = (ffn * grb, d * drb);
    let per_expert = 2 * gate_bytes + down_bytes;
    let experts = (opts.working_set as usize).div_ceil(per_expert).max(MOE_USED).div_ceil(MOE_USED) * MOE_USED;
    let label = "expert.moe iq2_xxs+q2_K";
    pb.set_message(format!("{label}: filling {} MiB", (experts * per_expert) >> 20));
    let mut buf = vec![0u8; experts * per_expert];
    {
        let (gu, down) = buf.split_at_mut(2 * experts * gate_bytes);
        blocks::fill_par(c.ty, gu, 1.0, 0x6a7e, opts.threads);
        blocks::fill_par(MOE_DOWN, down, 1.0, 0xd0e5, opts.threads);
    }
    let (gu, down) = buf.split_at(2 * experts * gate_bytes);
    let (gate, up) = gu.split_at(experts * gate_bytes);
    let w = MoeWeights { gate_ty: c.ty, down_ty: MOE_DOWN, d, ffn, gate, up, down };
    let mut rng = SplitMix64::new(7);
    let x: Vec<f32> = (0..d).map(|_| rng.next_sym() * 0.1).collect();
    let mut y = vec![0f32; d];
    let sel = |t: usize| std::array::from_fn::<usize, MOE_USED, _>(|j| t * MOE_USED + j);
    if !k.pooled_moe(&w, &sel(0), &x, &mut y)? {
        return Ok(None);
    }
    pb.set_message(format!("{label}: memory bandwidth"));
    let bw = membw::measure(&buf, opts.threads, opts.min_passes, opts.budget, || pb.inc(1));
    pb.set_message(format!("{label}: engine moe"));
    let t = best_of_checked(opts, pb, || {
        for tok in 0..experts / MOE_USED {
            k.pooled_moe(&w, &sel(tok), &x, &mut y)?;
        }
        Ok(())
    })
    .with_context(|| format!("{label}: engine moe"))?;
    check_finite(&y).with_context(|| format!("{label}: engine moe"))?;
    let bytes = (experts * per_expert) as u64;
    Ok(Some(KernelRow {
        case: c,
        matrices: experts,
        bytes,
        threads: opts.threads,
        kernel: "engine-moe",
        batch: 1,
        weights_gbs: par::gbs(bytes, t.best),
        gflops: 2.0 * (experts * 3 * ffn * d) as f64 / t.best.as_secs_f64().max(1e-12) / 1e9,
        mem_gbs: bw.gbs,
    }))
}

/// Random valid weights times bounded activations must give finite results; anything else is a kernel bug.
fn check_finite(y: &[f32]) -> Result<()> {
    match y.iter().position(|v| !v.is_finite()) {
        Some(i) => bail!("output {i} is {} (kernel produced a non-finite value)", y[i]),
        None => Ok(()),
    }
}

/// Passes the progress bar needs per case.
pub fn passes_hint(opts: &KernelOptions) -> u64 {
    let per = opts.min_passes.max(1) as u64;
    per * if opts.batch > 0 { 5 } else { 3 }
}

/// Runs every selected case, printing the CSV to `out` as it goes; returns all rows.
pub fn run(
    k: &dyn Kernels,
    opts: &KernelOptions,
    out: &mut dyn std::io::Write,
    pb: &ProgressBar,
) -> Result<Vec<KernelRow>> {
    let cases = selected(opts);
    if cases.is_empty() {
        bail!("no kernel case matches the type filter");
    }
    pb.set_length(cases.len() as u64 * passes_hint(opts));
    writeln!(out, "{CSV_HEADER}")?;
    let mut rows = Vec::new();
    for case in &cases {
        for r in run_case(k, case, opts, pb)? {
            writeln!(out, "{}", r.csv())?;
            rows.push(r);
        }
    }
    if let Some(r) = run_moe(k, opts, pb)? {
        writeln!(out, "{}", r.csv())?;
        rows.push(r);
    }
    for r in rows.iter().filter(|r| r.verdict() == "short") {
        let t = r.target().unwrap_or(0.0);
        writeln!(
            out,
            "# SHORT: {} {} {} at {:.0}% of measured bandwidth, target {:.0}% ({:.2} of {:.2} GB/s, needs {:.2})",
            r.case.name,
            r.case.ty,
            r.kernel,
            100.0 * r.fraction(),
            100.0 * t,
            r.weights_gbs,
            r.mem_gbs,
            t * r.mem_gbs
        )?;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in kernel that touches every weight byte: y = (sum of bytes of the row) * x[0].
    struct ByteSum;

    impl Kernels for ByteSum {
        fn matvec(&self, ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            assert_eq!(w.len(), rows * rb);
            assert_eq!(y.len(), rows);
            for (row, out) in w.chunks_exact(rb).zip(y.iter_mut()) {
                *out = row.iter().map(|&b| b as f32).sum::<f32>() * x[0];
            }
            Ok(())
        }

        fn matmul(
            &self,
            ty: GgmlType,
            w: &[u8],
            rows: usize,
            cols: usize,
            xs: &[f32],
            nb: usize,
            ys: &mut [f32],
        ) -> Result<()> {
            assert_eq!(xs.len(), nb * cols);
            assert_eq!(ys.len(), rows * nb);
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            for (r, row) in w.chunks_exact(rb).enumerate() {
                let s: f32 = row.iter().map(|&b| b as f32).sum();
                for b in 0..nb {
                    ys[r * nb + b] = s * xs[b * cols];
                }
            }
            Ok(())
        }
    }

    /// [`ByteSum`] plus a MoE that touches every byte of the selected experts.
    struct WithMoe;

    impl Kernels for WithMoe {
        fn matvec(&self, ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
            ByteSum.matvec(ty, w, rows, cols, x, y)
        }
        fn matmul(
            &self,
            t: GgmlType,
            w: &[u8],
            r: usize,
            c: usize,
            xs: &[f32],
            nb: usize,
            ys: &mut [f32],
        ) -> Result<()> {
            ByteSum.matmul(t, w, r, c, xs, nb, ys)
        }
        fn pooled_moe(&self, w: &MoeWeights<'_>, sel: &[usize], x: &[f32], y: &mut [f32]) -> Result<bool> {
            let g = w.ffn * w.gate_ty.row_bytes(w.d as u64).unwrap() as usize;
            let dn = w.d * w.down_ty.row_bytes(w.ffn as u64).unwrap() as usize;
            let mut s = 0f32;
            for &e in sel {
                let bytes = [&w.gate[e * g..(e + 1) * g], &w.up[e * g..(e + 1) * g], &w.down[e * dn..(e + 1) * dn]];
                s += bytes.iter().flat_map(|b| b.iter()).map(|&b| b as f32).sum::<f32>();
            }
            y.fill(s * x[0]);
            Ok(true)
        }
    }

    #[test]
    fn moe_line_appears_when_offered() {
        let opts =
            KernelOptions { types: vec![GgmlType::Iq2Xxs, GgmlType::Q2K], batch: 0, working_set: 40 << 20, ..quick() };
        let rows = run(&WithMoe, &opts, &mut Vec::new(), &ProgressBar::hidden()).unwrap();
        let moe: Vec<&KernelRow> = rows.iter().filter(|r| r.kernel == "engine-moe").collect();
        assert_eq!(moe.len(), 1);
        let r = moe[0];
        assert!(r.weights_gbs > 0.0 && r.mem_gbs > 0.0 && r.target() == Some(0.70), "{}", r.csv());
        assert_eq!(r.matrices % MOE_USED, 0);
        assert!(r.bytes >= 40 << 20);
        // Kernels without a MoE, or a type filter without both expert types: no line.
        assert!(run(&ByteSum, &opts, &mut Vec::new(), &ProgressBar::hidden())
            .unwrap()
            .iter()
            .all(|r| r.kernel != "engine-moe"));
        let q2_only = KernelOptions { types: vec![GgmlType::Q2K], ..opts };
        assert!(run(&WithMoe, &q2_only, &mut Vec::new(), &ProgressBar::hidden())
            .unwrap()
            .iter()
            .all(|r| r.kernel != "engine-moe"));
    }

    struct Failing;

    impl Kernels for Failing {
        fn matvec(&self, _: GgmlType, _: &[u8], _: usize, _: usize, _: &[f32], _: &mut [f32]) -> Result<()> {
            bail!("boom")
        }
        fn matmul(&self, _: GgmlType, _: &[u8], _: usize, _: usize, _: &[f32], _: usize, _: &mut [f32]) -> Result<()> {
            bail!("boom")
        }
    }

    fn quick() -> KernelOptions {
        KernelOptions {
            threads: 2,
            working_set: 3 << 20,
            batch: 4,
            budget: Duration::ZERO,
            min_passes: 1,
            types: vec![GgmlType::Q2K, GgmlType::F16],
            all_shapes: false,
        }
    }

    #[test]
    fn report_has_header_and_parseable_rows() {
        let mut out = Vec::new();
        let rows = run(&ByteSum, &quick(), &mut out, &ProgressBar::hidden()).unwrap();
        let text = String::from_utf8(out).unwrap();
        let mut lines = text.lines().filter(|l| !l.starts_with('#'));
        assert_eq!(lines.next(), Some(CSV_HEADER));
        let body: Vec<&str> = lines.collect();
        // q2_K expert.down and f16 indexer.q_b, matvec + matmul each.
        assert_eq!(body.len(), 4);
        assert_eq!(rows.len(), 4);
        let ncol = CSV_HEADER.split(',').count();
        for l in body {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), ncol, "{l}");
            let bytes: u64 = f[5].parse().unwrap();
            if f[7] == "matvec" {
                assert!(bytes >= 3 << 20, "working set honoured: {l}");
            } else {
                assert_eq!(f[7], "matmul");
                assert!(bytes > 0 && f[8] == "4", "{l}");
            }
            for i in [9, 10, 11, 12] {
                let v: f64 = f[i].parse().unwrap();
                assert!(v.is_finite() && v > 0.0, "{l}");
            }
            assert!(["ok", "short", "-"].contains(&f[14]));
        }
    }

    #[test]
    fn kernel_errors_are_reported() {
        let e = run(&Failing, &quick(), &mut Vec::new(), &ProgressBar::hidden()).unwrap_err();
        assert!(format!("{e:#}").contains("boom"), "{e:#}");
    }

    #[test]
    fn matrix_chunks_cut_at_matrix_boundaries() {
        let mut seen = Vec::new();
        for_matrix_chunks(3..11, 4, |a, b| {
            seen.push((a, b));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![(3, 4), (4, 8), (8, 11)]);
    }

    #[test]
    fn split_mut_gives_disjoint_scaled_slices() {
        let mut buf: Vec<u32> = (0..20).collect();
        let ranges = par::split(10, 3, 1);
        let parts = split_mut(&mut buf, &ranges, 2);
        let lens: Vec<usize> = parts.iter().map(|p| p.lock().unwrap().len()).collect();
        assert_eq!(lens, vec![8, 6, 6]);
        assert_eq!(parts[1].lock().unwrap()[0], 8);
    }

    #[test]
    fn verdicts_follow_targets() {
        let r = KernelRow {
            case: CASES[0],
            matrices: 1,
            bytes: 1,
            threads: 1,
            kernel: "matvec",
            batch: 1,
            weights_gbs: 6.0,
            gflops: 1.0,
            mem_gbs: 10.0,
        };
        assert_eq!(r.verdict(), "short");
        assert_eq!(KernelRow { weights_gbs: 7.5, ..r.clone() }.verdict(), "ok");
        assert_eq!(KernelRow { kernel: "matmul", ..r }.verdict(), "-");
    }

    #[test]
    fn type_names_parse() {
        assert_eq!(parse_type("IQ2_XXS").unwrap(), GgmlType::Iq2Xxs);
        assert_eq!(parse_type("q4_k").unwrap(), GgmlType::Q4K);
        assert!(parse_type("q5_k").is_err());
        assert!(default_working_set(Some(480 << 20)) >= 1 << 30);
        assert_eq!(default_working_set(Some(1 << 30)), 2 << 30);
    }
}
