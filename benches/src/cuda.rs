//! `ds4-bench cuda` (feature `cuda`): the CUDA kernels on a real GPU, each checked against the CPU and timed.
//!
//! 1. Copy bandwidth: device-to-device copies of a large buffer (read + write bytes per second, best of several):
//!    the roofline every kernel figure is divided by.
//! 2. Every product kernel on a tiny shape and on Flash's shapes (dense Q8_0 / F16 matvecs, the decode MoE with
//!    IQ2_XXS gate/up and Q2_K down, Q4_K experts of the 4-bit file) with random weights: results compared with
//!    the engine's CPU dot products on sampled rows (the same activation quants: the quantizers are exact), then
//!    timed: µs per call, bytes moved per call (weights + activations), GB/s and the fraction of the copy
//!    bandwidth. RMSNorm, RoPE and SwiGLU are timed at Flash's sizes.
//!
//! Exit status: non-zero when a kernel disagrees with the CPU beyond its tolerance, or the device cannot be
//! opened (no GPU: a clear error, never a panic).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_engine::quant::{act_type, dot_f32_kernel_scalar, dot_q_kernel_scalar, quantize_acts, GgmlType};
use ds4_kernels_native::cuda::{preload_nvrtc, CudaDevice};
use ds4_kernels_native::cuda_host::{self, ActBufs, CudaExperts, Device, Matrix, RouteWeightAt};
use ds4_kernels_native::cuda_kernels::{CudaWeight, Plan};

/// Options of `ds4-bench cuda`.
#[derive(clap::Args, Debug)]
pub struct CudaArgs {
    /// Run the agreement checks and the timings (the default does the same; kept for scripts).
    #[arg(long)]
    pub check: bool,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Folder of the nvidia-cuda-nvrtc wheel's `nvidia/cu13` (loads libnvrtc from there; default: the
    /// DS4_CUDA_WHEELS environment variable, else the library search path).
    #[arg(long)]
    pub nvrtc_dir: Option<PathBuf>,
    /// Compiled-module cache folder (default: ~/.cache/ds4/cuda).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Timed calls per kernel (after two warm-up calls).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Skip the Flash shapes (tiny shapes only).
    #[arg(long)]
    pub tiny_only: bool,
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn ggml(ty: CudaWeight) -> GgmlType {
    match ty {
        CudaWeight::Q8_0 => GgmlType::Q8_0,
        CudaWeight::F16 => GgmlType::F16,
        CudaWeight::Iq2Xxs => GgmlType::Iq2Xxs,
        CudaWeight::Q2K => GgmlType::Q2K,
        CudaWeight::Q4K => GgmlType::Q4K,
    }
}

/// Random weight blocks with sane f16 scales (see the host-shim test).
fn random_weights(rng: &mut Rng, ty: CudaWeight, rows: usize, cols: usize) -> Vec<u8> {
    let bytes = rows * ty.row_bytes(cols).unwrap_or(0);
    let mut w = vec![0u8; bytes];
    for c in w.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    let scale_at: &[usize] = match ty {
        CudaWeight::Q8_0 | CudaWeight::Iq2Xxs => &[0],
        CudaWeight::Q2K => &[80, 82],
        CudaWeight::Q4K => &[0, 2],
        CudaWeight::F16 => &[0, 2, 4, 6],
    };
    for blk in w.chunks_exact_mut(ty.block_bytes()) {
        for &o in scale_at {
            let bits = 0x1800u16 + (rng.next() % 0x0f00) as u16;
            blk[o..o + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    w
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// CPU dot of one weight row with one f32 activation row, as the CPU backend computes it.
fn cpu_dot(ty: CudaWeight, w: &[u8], x: &[f32]) -> Result<(f32, f32)> {
    let mut wf = vec![0f32; x.len()];
    ds4_engine::quant::dequantize_row(ggml(ty), w, &mut wf)?;
    let mass: f32 = wf.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
    if ty == CudaWeight::F16 {
        return Ok((dot_f32_kernel_scalar(GgmlType::F16)?(w, x), mass));
    }
    let mut a = Vec::new();
    quantize_acts(act_type(ggml(ty)), x, &mut a)?;
    Ok((dot_q_kernel_scalar(ggml(ty))?(w, &a), mass))
}

struct Timing {
    us: f64,
}

/// Best-of timing: `iters` calls of `f` between two synchronisations, two warm-up calls first.
fn time(dev: &mut CudaDevice, iters: usize, mut f: impl FnMut(&mut CudaDevice) -> Result<()>) -> Result<Timing> {
    for _ in 0..2 {
        f(dev)?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters.max(1) {
        f(dev)?;
    }
    dev.synchronize()?;
    Ok(Timing { us: t.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64 })
}

struct Report {
    copy_gbs: f64,
    failures: Vec<String>,
}

impl Report {
    fn row(&self, name: &str, shape: &str, t: &Timing, bytes: f64, max_err: f32) {
        let gbs = bytes / (t.us * 1e-6) / 1e9;
        println!(
            "{name},{shape},{:.2},{:.0},{:.1},{:.3},{:.2e}",
            t.us,
            bytes,
            gbs,
            if self.copy_gbs > 0.0 { gbs / self.copy_gbs } else { 0.0 },
            max_err
        );
    }
}

/// Device copy bandwidth (read + write), best of 10 copies of `bytes`.
fn copy_bandwidth(dev: &mut CudaDevice, bytes: usize) -> Result<f64> {
    let a = dev.alloc(bytes)?;
    let b = dev.alloc(bytes)?;
    let mut best = 0f64;
    for i in 0..12 {
        dev.synchronize()?;
        let t = Instant::now();
        dev.copy(a, b, bytes)?;
        dev.synchronize()?;
        let s = t.elapsed().as_secs_f64();
        if i >= 2 {
            best = best.max(2.0 * bytes as f64 / s / 1e9);
        }
    }
    dev.free(a);
    dev.free(b);
    Ok(best)
}

#[allow(clippy::too_many_arguments)]
fn check_matvec(
    dev: &mut CudaDevice,
    rep: &mut Report,
    rng: &mut Rng,
    ty: CudaWeight,
    rows: usize,
    cols: usize,
    ntok: usize,
    iters: usize,
    label: &str,
) -> Result<()> {
    let w = random_weights(rng, ty, rows, cols);
    let x: Vec<f32> = (0..ntok * cols).map(|_| rng.f()).collect();
    let m = Matrix { buf: dev.upload(&w)?, ty, rows, cols };
    let xb = dev.upload(&f32s(&x))?;
    let yb = dev.alloc(ntok * rows * 4)?;
    let acts = ActBufs::new(dev, ntok * cols)?;
    cuda_host::matvec(dev, &m, xb, ntok, &acts, yb)?;
    let y = from_bytes(&dev.download(yb)?);
    let rb = ty.row_bytes(cols).unwrap_or(0);
    let mut max_err = 0f32;
    let step = (rows / 64).max(1);
    for t in 0..ntok {
        for r in (0..rows).step_by(step) {
            let (want, mass) = cpu_dot(ty, &w[r * rb..(r + 1) * rb], &x[t * cols..(t + 1) * cols])?;
            let err = (y[t * rows + r] - want).abs() / mass.max(1e-30);
            max_err = max_err.max(err);
        }
    }
    if max_err.is_nan() || max_err > 1e-5 {
        rep.failures.push(format!("{label}: relative error {max_err:e} > 1e-5"));
    }
    let timing = time(dev, iters, |d| Ok(cuda_host::matvec(d, &m, xb, ntok, &acts, yb)?))?;
    let bytes = (w.len() + ntok * cols * 4 + ntok * rows * 4) as f64;
    rep.row(&format!("matvec_{}", ty.suffix()), &format!("{label} {rows}x{cols} x{ntok}"), &timing, bytes, max_err);
    for b in [m.buf, xb, yb, acts.q, acts.d, acts.bs] {
        dev.free(b);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn check_moe(
    dev: &mut CudaDevice,
    rep: &mut Report,
    rng: &mut Rng,
    (up_ty, down_ty): (CudaWeight, CudaWeight),
    (n_experts, d_model, ffn, n_used): (usize, usize, usize, usize),
    iters: usize,
    label: &str,
) -> Result<()> {
    let gate = random_weights(rng, up_ty, n_experts * ffn, d_model);
    let up = random_weights(rng, up_ty, n_experts * ffn, d_model);
    let down = random_weights(rng, down_ty, n_experts * d_model, ffn);
    let x: Vec<f32> = (0..d_model).map(|_| rng.f()).collect();
    let mut ids: Vec<i32> = Vec::new();
    while ids.len() < n_used {
        let e = (rng.next() % n_experts as u64) as i32;
        if !ids.contains(&e) {
            ids.push(e);
        }
    }
    let rw: Vec<f32> = (0..n_used).map(|_| 0.1 + rng.f().abs()).collect();
    let ex = CudaExperts {
        gate: dev.upload(&gate)?,
        up: dev.upload(&up)?,
        down: dev.upload(&down)?,
        up_ty,
        down_ty,
        n_experts,
        d_model,
        ffn,
    };
    let xb = dev.upload(&f32s(&x))?;
    let idb = dev.upload(&ids.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let rwb = dev.upload(&f32s(&rw))?;
    let h = dev.alloc(n_used * ffn * 4)?;
    let out = dev.alloc(d_model * 4)?;
    let acts = ActBufs::new(dev, (n_used * ffn).max(d_model))?;
    let run =
        |d: &mut CudaDevice| cuda_host::moe_decode(d, &ex, xb, idb, rwb, n_used, 1, RouteWeightAt::Sum, &acts, h, out);
    run(dev)?;
    let got = from_bytes(&dev.download(out)?);
    // CPU reference: per expert gate/up dots, the clamped SwiGLU, down dots, the weighted sum in slot order.
    let (gr, dr) = (up_ty.row_bytes(d_model).unwrap_or(0), down_ty.row_bytes(ffn).unwrap_or(0));
    let mut want = vec![0f32; d_model];
    let mut mass = vec![0f32; d_model];
    for (j, &e) in ids.iter().enumerate() {
        let e = e as usize;
        let mut hv = vec![0f32; ffn];
        for (r, hr) in hv.iter_mut().enumerate() {
            let o = (e * ffn + r) * gr;
            let (g, _) = cpu_dot(up_ty, &gate[o..o + gr], &x)?;
            let (u, _) = cpu_dot(up_ty, &up[o..o + gr], &x)?;
            let gg = g.min(cuda_host::SWIGLU_LIMIT);
            *hr = gg / (1.0 + (-gg).exp()) * u.clamp(-cuda_host::SWIGLU_LIMIT, cuda_host::SWIGLU_LIMIT);
        }
        for r in 0..d_model {
            let o = (e * d_model + r) * dr;
            let (v, m) = cpu_dot(down_ty, &down[o..o + dr], &hv)?;
            want[r] += rw[j] * v;
            mass[r] += rw[j] * m;
        }
    }
    let mut max_err = 0f32;
    for r in 0..d_model {
        max_err = max_err.max((got[r] - want[r]).abs() / mass[r].max(1e-30));
    }
    // h is re-quantized from device values that differ from the CPU's in the last bits: a looser bound.
    if max_err.is_nan() || max_err > 2e-3 {
        rep.failures.push(format!("{label}: relative error {max_err:e} > 2e-3"));
    }
    let timing = time(dev, iters, |d| Ok(run(d)?))?;
    let bytes = (n_used * (2 * ffn * gr + d_model * dr)) as f64;
    rep.row(
        &format!("moe_decode_{}_{}", up_ty.suffix(), down_ty.suffix()),
        &format!("{label} {n_experts}x({ffn}x{d_model}) top{n_used}"),
        &timing,
        bytes,
        max_err,
    );
    for b in [ex.gate, ex.up, ex.down, xb, idb, rwb, h, out, acts.q, acts.d, acts.bs] {
        dev.free(b);
    }
    Ok(())
}

fn time_rowops(dev: &mut CudaDevice, rep: &Report, iters: usize) -> Result<()> {
    let (rows, width) = (1usize, 4096usize);
    let x = dev.alloc(rows * width * 4)?;
    let w = dev.alloc(width * 4)?;
    let y = dev.alloc(rows * width * 4)?;
    let p = Plan::rms_norm(rows, width)?;
    let t = time(dev, iters, |d| {
        use cuda_host::Arg::*;
        Ok(d.launch(&p, &[Buf(x), Buf(w), Buf(y), I32(width as i32), F32(1e-6)])?)
    })?;
    rep.row("rms_norm", "1x4096", &t, (3 * width * 4) as f64, 0.0);
    let (nvec, hw, half) = (64usize, 512usize, 32usize);
    let q = dev.alloc(nvec * hw * 4)?;
    let f = dev.alloc(half * 4)?;
    let pos = dev.alloc(4)?;
    let p = Plan::rope(nvec, hw, half)?;
    let t = time(dev, iters, |d| {
        use cuda_host::Arg::*;
        Ok(d.launch(
            &p,
            &[Buf(q), Buf(f), Buf(pos), I32(hw as i32), I32(nvec as i32), I32(half as i32), I32(0), I32(nvec as i32)],
        )?)
    })?;
    rep.row("rope", "64 heads x 512 (rope 64)", &t, (2 * nvec * 2 * half * 4) as f64, 0.0);
    let n = 6 * 2048usize;
    let g = dev.alloc(n * 4)?;
    let u = dev.alloc(n * 4)?;
    let p = Plan::swiglu(n)?;
    let t = time(dev, iters, |d| {
        use cuda_host::Arg::*;
        Ok(d.launch(&p, &[Buf(g), Buf(u), I64(n as i64), F32(10.0)])?)
    })?;
    rep.row("swiglu", "6x2048", &t, (3 * n * 4) as f64, 0.0);
    for b in [x, w, y, q, f, pos, g, u] {
        dev.free(b);
    }
    Ok(())
}

/// Runs `ds4-bench cuda`.
pub fn run(a: &CudaArgs) -> Result<()> {
    let nvrtc_dir = a.nvrtc_dir.clone().or_else(|| std::env::var_os("DS4_CUDA_WHEELS").map(PathBuf::from));
    if let Some(dir) = &nvrtc_dir {
        preload_nvrtc(dir).with_context(|| format!("loading NVRTC from {}", dir.display()))?;
    }
    let cache = a.cache.clone().or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ds4/cuda")));
    let t0 = Instant::now();
    let mut dev = CudaDevice::open(a.device, cache.as_deref()).context("opening the CUDA device")?;
    let info = dev.info.clone();
    println!(
        "# device: {} (sm_{}{}, {:.1} GiB), NVRTC {}.{}, kernels from {} in {:.2} s",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.total_mem as f64 / (1u64 << 30) as f64,
        info.nvrtc.0,
        info.nvrtc.1,
        info.module_from,
        t0.elapsed().as_secs_f64()
    );
    let copy_bytes = (info.total_mem / 16).clamp(64 << 20, 1 << 30);
    let copy_gbs = copy_bandwidth(&mut dev, copy_bytes)?;
    println!("# copy bandwidth: {copy_gbs:.1} GB/s (device-to-device, read + write, {} MiB)", copy_bytes >> 20);
    let mut rep = Report { copy_gbs, failures: Vec::new() };
    println!("kernel,shape,us_per_call,bytes_per_call,gb_s,fraction_of_copy_bw,max_rel_err");
    let mut rng = Rng(0x5eed);
    let it = a.iters;
    use CudaWeight::*;
    for ty in [Q8_0, F16, Iq2Xxs, Q2K, Q4K] {
        for ntok in [1usize, 3, 8] {
            check_matvec(&mut dev, &mut rep, &mut rng, ty, 96, 512, ntok, it, "tiny")?;
        }
    }
    check_moe(&mut dev, &mut rep, &mut rng, (Iq2Xxs, Q2K), (8, 512, 512, 3), it, "tiny")?;
    check_moe(&mut dev, &mut rep, &mut rng, (Q4K, Q4K), (8, 512, 512, 3), it, "tiny")?;
    if !a.tiny_only {
        // Flash: d 4096, q LoRA 1024, 64 heads × 512, output groups 8 × 1024, vocab 129280, experts 256 × 2048.
        for (rows, cols, what) in [(1024, 4096, "attn.q_a"), (32768, 1024, "attn.q_b"), (4096, 8192, "attn.out_b")] {
            for ntok in [1usize, 8] {
                check_matvec(&mut dev, &mut rep, &mut rng, Q8_0, rows, cols, ntok, it, &format!("flash {what}"))?;
            }
        }
        check_matvec(&mut dev, &mut rep, &mut rng, Q8_0, 129_280, 4096, 1, it, "flash head")?;
        check_matvec(&mut dev, &mut rep, &mut rng, F16, 4096, 4096, 1, it, "f16 square")?;
        check_moe(&mut dev, &mut rep, &mut rng, (Iq2Xxs, Q2K), (256, 4096, 2048, 6), it, "flash 2-bit")?;
        check_moe(&mut dev, &mut rep, &mut rng, (Q4K, Q4K), (256, 4096, 2048, 6), it, "flash 4-bit")?;
    }
    time_rowops(&mut dev, &rep, it)?;
    println!("# total {:.1} s", t0.elapsed().as_secs_f64());
    if !rep.failures.is_empty() {
        for f in &rep.failures {
            eprintln!("DISAGREES: {f}");
        }
        bail!("{} kernel(s) disagree with the CPU", rep.failures.len());
    }
    Ok(())
}
