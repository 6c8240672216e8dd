//! The CUDA kernels run on the CPU under the host shim (`kernels-native/cuda/host/shim.h`, built by this crate's
//! build.rs) on tiny shapes, with the launch geometry of `ds4_kernels_native::cuda_kernels::Plan`, and compared
//! with the engine's CPU code (`ds4_engine::quant`, the CPU backend's formulas):
//! - activation quantizers: the same quants, scales and block sums as the CPU's Q8_0 / Q8_K rows (exact);
//! - block dot products: each block's term equal to the CPU scalar kernel's one-block dot product (bit-exact);
//! - products, the decode MoE, RMSNorm, RoPE, SwiGLU: within the tolerances of `docs/cuda.md` (the kernels sum
//!   blocks, lanes and experts in other orders than the CPU, and use the device's expf/sincosf).

use ds4_engine::quant::{
    act_type, dequantize_acts, dequantize_row, dot_f32_kernel_scalar, dot_q_kernel_scalar, quantize_acts, ActType,
    GgmlType,
};
use ds4_kernels_native::cpu::swiglu::swiglu_x8;
use ds4_kernels_native::cuda_kernels::{ActFormat, CudaWeight, Plan};

mod shim;

use shim::*;

/// Deterministic pseudo-random numbers (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
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

const QUANT_TYPES: [CudaWeight; 4] = [CudaWeight::Q8_0, CudaWeight::Iq2Xxs, CudaWeight::Q2K, CudaWeight::Q4K];

/// `rows` random weight rows of `cols` values as raw blocks (every byte random, so every grid point, sign
/// pattern, scale and nibble occurs), with the f16 scale fields set to normal values in about [0.002, 0.03].
fn random_weights(rng: &mut Rng, ty: CudaWeight, rows: usize, cols: usize) -> Vec<u8> {
    let bytes = rows * ty.row_bytes(cols).expect("whole blocks");
    let mut w: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
    let scale_at: &[usize] = match ty {
        CudaWeight::Q8_0 | CudaWeight::Iq2Xxs => &[0],
        CudaWeight::Q2K => &[80, 82],
        CudaWeight::Q4K => &[0, 2],
        CudaWeight::F16 => &[0, 2, 4, 6],
    };
    for blk in w.chunks_exact_mut(ty.block_bytes()) {
        for &o in scale_at {
            let bits = 0x1800u16 + (rng.next() % 0x0f00) as u16;
            let bits = if ty == CudaWeight::F16 && rng.next().is_multiple_of(2) { bits | 0x8000 } else { bits };
            blk[o..o + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    w
}

fn f16_to_f32(b: [u8; 2]) -> f32 {
    let h = u16::from_le_bytes(b) as u32;
    let (sign, exp, man) = ((h >> 15) << 31, (h >> 10) & 31, h & 1023);
    let bits = match exp {
        0 => return if sign != 0 { -(man as f32) * 2f32.powi(-24) } else { man as f32 * 2f32.powi(-24) },
        31 => sign | 0x7f80_0000 | (man << 13),
        e => sign | ((e + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Activations in the kernels' dq layout (`cuda/blocks.cuh`).
#[derive(Clone, Debug, PartialEq)]
struct Dq {
    q: Vec<i8>,
    d: Vec<f32>,
    bs: Vec<i32>,
}

/// The CPU's plain Q8_0 / Q8_K activation bytes in the dq layout.
fn dq_from_cpu(act: ActFormat, bytes: &[u8]) -> Dq {
    let mut dq = Dq { q: Vec::new(), d: Vec::new(), bs: Vec::new() };
    match act {
        ActFormat::Q8_0 => {
            for b in bytes.chunks_exact(34) {
                dq.d.push(f16_to_f32([b[0], b[1]]));
                dq.q.extend(b[2..].iter().map(|&v| v as i8));
            }
        }
        ActFormat::Q8K => {
            for b in bytes.chunks_exact(292) {
                dq.d.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                dq.q.extend(b[4..260].iter().map(|&v| v as i8));
                dq.bs.extend(b[260..].chunks_exact(2).map(|p| i16::from_le_bytes([p[0], p[1]]) as i32));
            }
        }
        ActFormat::F32 => panic!("f32 activations have no dq layout"),
    }
    dq
}

/// The CPU's activation bytes for `x` as the CPU's kernels of `ty` read them, and as plain blocks.
fn cpu_acts(ty: CudaWeight, x: &[f32]) -> (ActType, Vec<u8>, Vec<u8>) {
    let act = act_type(ggml(ty));
    let plain = if ty == CudaWeight::Q8_0 { ActType::Q8_0 } else { ActType::Q8K };
    let (mut a, mut p) = (Vec::new(), Vec::new());
    quantize_acts(act, x, &mut a).expect("cpu quantize");
    quantize_acts(plain, x, &mut p).expect("cpu quantize");
    (act, a, p)
}

/// Runs the device quantizer on `x` (whole rows one after another).
fn dq_device(act: ActFormat, x: &[f32]) -> Dq {
    let p = Plan::quantize(act, x.len()).expect("plan");
    let (g, b) = dims(&p);
    let v = act.block_values();
    let nb = x.len() / v;
    let mut dq = Dq { q: vec![0; x.len()], d: vec![0.0; nb], bs: vec![0; x.len() / 16] };
    match act {
        // SAFETY: the buffers hold the plan's nb blocks: x.len() values in and quants out, nb scales, and
        // x.len() / 16 block sums; the shim runs the launch to completion before returning.
        ActFormat::Q8_0 => unsafe {
            shim_ds4_quantize_q8_0(&g, &b, x.as_ptr(), dq.q.as_mut_ptr(), dq.d.as_mut_ptr(), nb as i32)
        },
        // SAFETY: as above.
        ActFormat::Q8K => unsafe {
            shim_ds4_quantize_q8_k(
                &g,
                &b,
                x.as_ptr(),
                dq.q.as_mut_ptr(),
                dq.d.as_mut_ptr(),
                dq.bs.as_mut_ptr(),
                nb as i32,
            )
        },
        ActFormat::F32 => unreachable!(),
    }
    if act == ActFormat::Q8_0 {
        dq.bs.clear();
    }
    dq
}

fn bs_ptr(dq: &Dq) -> *const i32 {
    if dq.bs.is_empty() {
        std::ptr::null()
    } else {
        dq.bs.as_ptr()
    }
}

/// Runs the product `W (rows × cols) · x_t` for every activation row t of `dq`.
fn matvec_device(ty: CudaWeight, w: &[u8], rows: usize, cols: usize, dq: &Dq) -> Vec<f32> {
    let ntok = dq.q.len() / cols;
    assert_eq!(w.len(), rows * ty.row_bytes(cols).unwrap());
    let p = Plan::matvec(ty, rows, cols, ntok).expect("plan");
    let (g, b) = dims(&p);
    let mut y = vec![f32::NAN; ntok * rows];
    // SAFETY: w holds rows × cols weights of ty, dq holds ntok rows of cols values in ty's activation format,
    // y holds ntok × rows outputs; the plan's grid covers exactly these.
    unsafe {
        matvec_fn(p.kernel)(
            &g,
            &b,
            w.as_ptr(),
            dq.q.as_ptr(),
            dq.d.as_ptr(),
            bs_ptr(dq),
            y.as_mut_ptr(),
            rows as i32,
            cols as i32,
            ntok as i32,
        )
    };
    y
}

/// Σ |w_i · a_i| of one row: the scale of the rounding differences a reordered sum may show.
fn mass(ty: CudaWeight, w_row: &[u8], a: &[f32]) -> f32 {
    let mut wf = vec![0f32; a.len()];
    dequantize_row(ggml(ty), w_row, &mut wf).expect("dequantize");
    wf.iter().zip(a).map(|(p, q)| (p * q).abs()).sum()
}

#[test]
fn quantizers_match_the_cpu_bytes() {
    let mut rng = Rng(7);
    for (act, plain) in [(ActFormat::Q8_0, ActType::Q8_0), (ActFormat::Q8K, ActType::Q8K)] {
        let mut x = rng.vec(4 * 256, 3.0);
        x[256..512].fill(0.0); // an all-zero block
        x[600] = 1e-30; // a tiny value next to ordinary ones
        for v in x[768..800].iter_mut() {
            *v = (*v * 8.0).round() / 8.0 * 127.0; // exact ties of round(x / d)
        }
        let mut cpu = Vec::new();
        quantize_acts(plain, &x, &mut cpu).unwrap();
        assert_eq!(dq_device(act, &x), dq_from_cpu(act, &cpu), "{act:?}");
    }
}

#[test]
fn block_terms_equal_the_cpu_one_block_dot_products() {
    let mut rng = Rng(11);
    for ty in QUANT_TYPES {
        let nb = 9; // more than one warp pass for every type
        let cols = nb * ty.block_values();
        let w = random_weights(&mut rng, ty, 1, cols);
        let x = rng.vec(cols, 2.0);
        let (act, _, plain) = cpu_acts(ty, &x);
        let dq = dq_from_cpu(ty.act(), &plain);
        let p = Plan::block_terms(ty).unwrap();
        let (g, b) = dims(&p);
        let mut terms = vec![f32::NAN; nb];
        // SAFETY: w holds nb weight blocks, dq nb activation blocks (and their sums), terms nb outputs.
        unsafe {
            terms_fn(p.kernel)(
                &g,
                &b,
                w.as_ptr(),
                nb as i32,
                dq.q.as_ptr(),
                dq.d.as_ptr(),
                bs_ptr(&dq),
                terms.as_mut_ptr(),
            )
        };
        let dot = dot_q_kernel_scalar(ggml(ty)).unwrap();
        let (wb, ab) = (ty.block_bytes(), act.block_bytes() * ty.block_values() / act.block_values());
        for (i, &t) in terms.iter().enumerate() {
            // One block: the CPU's accumulator is 0 + term, i.e. the term itself. (A lone block is plain Q8_K
            // in every Q8_K layout, so the plain bytes serve all kernels.)
            let want = dot(&w[i * wb..(i + 1) * wb], &plain[i * ab..(i + 1) * ab]);
            assert!(t == want, "{ty:?} block {i}: device {t:e} vs cpu {want:e}");
        }
    }
}

#[test]
fn products_agree_with_the_cpu() {
    let mut rng = Rng(13);
    for ty in QUANT_TYPES {
        let (rows, cols) = (11, 3 * 256);
        let w = random_weights(&mut rng, ty, rows, cols);
        let wr = ty.row_bytes(cols).unwrap();
        let dot = dot_q_kernel_scalar(ggml(ty)).unwrap();
        for ntok in [1usize, 3, 9] {
            let x = rng.vec(ntok * cols, 1.5);
            let dq = dq_device(ty.act(), &x);
            let y = matvec_device(ty, &w, rows, cols, &dq);
            for t in 0..ntok {
                let (act, a, _) = cpu_acts(ty, &x[t * cols..(t + 1) * cols]);
                let mut af = vec![0f32; cols];
                dequantize_acts(act, &a, &mut af).unwrap();
                for r in 0..rows {
                    let want = dot(&w[r * wr..(r + 1) * wr], &a);
                    let tol = 2e-6 * mass(ty, &w[r * wr..(r + 1) * wr], &af) + 1e-30;
                    let got = y[t * rows + r];
                    assert!((got - want).abs() <= tol, "{ty:?} ntok {ntok} t {t} r {r}: {got} vs {want} (tol {tol})");
                }
            }
        }
    }
}

#[test]
fn f16_products_agree_with_the_cpu() {
    let mut rng = Rng(17);
    let (rows, cols) = (11, 200);
    let w = random_weights(&mut rng, CudaWeight::F16, rows, cols);
    let w16: Vec<u16> = w.chunks_exact(2).map(|p| u16::from_le_bytes([p[0], p[1]])).collect();
    let dot = dot_f32_kernel_scalar(GgmlType::F16).unwrap();
    for ntok in [1usize, 6] {
        let x = rng.vec(ntok * cols, 1.0);
        let p = Plan::matvec(CudaWeight::F16, rows, cols, ntok).unwrap();
        let (g, b) = dims(&p);
        let mut y = vec![f32::NAN; ntok * rows];
        // SAFETY: w16 holds rows × cols f16 weights, x ntok rows of cols, y ntok × rows.
        unsafe {
            f16_fn(p.kernel)(&g, &b, w16.as_ptr(), x.as_ptr(), y.as_mut_ptr(), rows as i32, cols as i32, ntok as i32)
        };
        for t in 0..ntok {
            let xt = &x[t * cols..(t + 1) * cols];
            for r in 0..rows {
                let wrow = &w[r * cols * 2..(r + 1) * cols * 2];
                let want = dot(wrow, xt);
                let tol = 2e-6 * mass(CudaWeight::F16, wrow, xt);
                let got = y[t * rows + r];
                assert!((got - want).abs() <= tol, "f16 ntok {ntok} t {t} r {r}: {got} vs {want}");
            }
        }
    }
}

/// The decode MoE (gate + up + SwiGLU over the selected experts, then down + the weighted sum) against the CPU's
/// recipe: Q8_K activations, per-expert products, the clamped SwiGLU, h quantized again, the routed sum in slot
/// order.
#[test]
fn decode_moe_agrees_with_the_cpu() {
    let mut rng = Rng(19);
    let (d_model, ffn, n_experts, n_used, ntok, limit) = (256usize, 256usize, 5usize, 2usize, 2usize, 0.6f32);
    for ty in [CudaWeight::Iq2Xxs, CudaWeight::Q2K, CudaWeight::Q4K] {
        let gate = random_weights(&mut rng, ty, n_experts * ffn, d_model);
        let up = random_weights(&mut rng, ty, n_experts * ffn, d_model);
        let down = random_weights(&mut rng, ty, n_experts * d_model, ffn);
        let (gr, dr) = (ty.row_bytes(d_model).unwrap(), ty.row_bytes(ffn).unwrap());
        let x = rng.vec(ntok * d_model, 1.0);
        let ids: Vec<i32> = vec![4, 0, 2, 3];
        let rw: Vec<f32> = (0..ntok * n_used).map(|_| 0.2 + rng.f().abs()).collect();
        let dot = dot_q_kernel_scalar(ggml(ty)).unwrap();
        let (gate_up, down_sum) = moe_fns(ty);

        // CPU reference.
        let mut h_cpu = vec![0f32; ntok * n_used * ffn];
        let mut out_cpu = vec![0f32; ntok * d_model];
        for t in 0..ntok {
            let (_, a, _) = cpu_acts(ty, &x[t * d_model..(t + 1) * d_model]);
            for j in 0..n_used {
                let e = ids[t * n_used + j] as usize;
                let h = &mut h_cpu[(t * n_used + j) * ffn..(t * n_used + j + 1) * ffn];
                let mut u = vec![0f32; ffn];
                for r in 0..ffn {
                    let row = (e * ffn + r) * gr;
                    h[r] = dot(&gate[row..row + gr], &a);
                    u[r] = dot(&up[row..row + gr], &a);
                }
                swiglu_x8(h, &u, limit);
                let (_, hq, _) = cpu_acts(ty, h);
                for r in 0..d_model {
                    let row = (e * d_model + r) * dr;
                    out_cpu[t * d_model + r] += rw[t * n_used + j] * dot(&down[row..row + dr], &hq);
                }
            }
        }

        // Device: quantize x, gate+up+SwiGLU, quantize h, down + sum (route weight at the sum, as the CPU does).
        let xq = dq_device(ActFormat::Q8K, &x);
        let p = Plan::moe_gate_up(ty, ffn, d_model, n_used, ntok).unwrap();
        let (g, b) = dims(&p);
        let mut h = vec![f32::NAN; ntok * n_used * ffn];
        // SAFETY: gate/up hold n_experts stacked ffn × d_model matrices of gr bytes per row, xq ntok Q8_K rows,
        // ids and rw ntok × n_used entries (ids in range), h ntok × n_used × ffn outputs.
        unsafe {
            gate_up(
                &g,
                &b,
                gate.as_ptr(),
                up.as_ptr(),
                (ffn * gr) as i64,
                n_experts as i32,
                xq.q.as_ptr(),
                xq.d.as_ptr(),
                xq.bs.as_ptr(),
                ids.as_ptr(),
                std::ptr::null(),
                h.as_mut_ptr(),
                ffn as i32,
                d_model as i32,
                n_used as i32,
                limit,
            )
        };
        for (i, (&got, &want)) in h.iter().zip(&h_cpu).enumerate() {
            assert!((got - want).abs() <= 1e-4 * want.abs().max(0.05), "{ty:?} h[{i}]: {got} vs {want}");
        }
        let hq = dq_device(ActFormat::Q8K, &h);
        let p = Plan::moe_down_sum(ty, d_model, ffn, ntok).unwrap();
        let (g, b) = dims(&p);
        let mut out = vec![f32::NAN; ntok * d_model];
        let run_down = |ids: &[i32], out: &mut [f32]| {
            // SAFETY: down holds n_experts stacked d_model × ffn matrices, hq ntok × n_used Q8_K rows of ffn,
            // ids and rw ntok × n_used entries, out ntok × d_model outputs.
            unsafe {
                down_sum(
                    &g,
                    &b,
                    down.as_ptr(),
                    (d_model * dr) as i64,
                    n_experts as i32,
                    hq.q.as_ptr(),
                    hq.d.as_ptr(),
                    hq.bs.as_ptr(),
                    ids.as_ptr(),
                    rw.as_ptr(),
                    out.as_mut_ptr(),
                    d_model as i32,
                    ffn as i32,
                    n_used as i32,
                )
            }
        };
        run_down(&ids, &mut out);
        // h may round to a neighbouring quant where the device's h differs from the CPU's in the last bits:
        // compare against the size of the sum's terms.
        let scale = out_cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (&got, &want)) in out.iter().zip(&out_cpu).enumerate() {
            assert!((got - want).abs() <= 2e-3 * scale, "{ty:?} out[{i}]: {got} vs {want} (scale {scale})");
        }
        // A bad expert id poisons its token's outputs (NaN), never reads out of bounds.
        let mut bad_ids = ids.clone();
        bad_ids[1] = n_experts as i32;
        run_down(&bad_ids, &mut out);
        assert!(out[..d_model].iter().all(|v| v.is_nan()), "{ty:?}: bad id not flagged");
        assert!(out[d_model..].iter().all(|v| v.is_finite()), "{ty:?}: other token touched");
    }
}

#[test]
fn rms_norm_rope_and_swiglu_agree_with_the_cpu() {
    let mut rng = Rng(23);
    // RMSNorm: the CPU's formula (engine backend/cpu/norm.rs): f64 sum of squares, s = 1/sqrt(mean + eps),
    // y = w · (x · s).
    let (rows, width, eps) = (3usize, 1000usize, 1e-6f32);
    let x = rng.vec(rows * width, 2.0);
    let w = rng.vec(width, 1.0);
    let p = Plan::rms_norm(rows, width).unwrap();
    let (g, b) = dims(&p);
    for weighted in [true, false] {
        let mut y = vec![f32::NAN; rows * width];
        let wp = if weighted { w.as_ptr() } else { std::ptr::null() };
        // SAFETY: x and y hold rows × width values, w width values (or null).
        unsafe { shim_ds4_rms_norm(&g, &b, x.as_ptr(), wp, y.as_mut_ptr(), width as i32, eps) };
        for r in 0..rows {
            let xr = &x[r * width..(r + 1) * width];
            let ss: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum();
            let s = 1.0 / ((ss / width as f64) as f32 + eps).sqrt();
            for i in 0..width {
                let want = if weighted { w[i] * (xr[i] * s) } else { xr[i] * s };
                let got = y[r * width + i];
                assert!((got - want).abs() <= 1e-6 * want.abs().max(1e-3), "rms {r} {i}: {got} vs {want}");
            }
        }
    }

    // RoPE (engine model/rope.rs): pair i of the last 2·half values rotated by pos · inv_freq[i].
    let (nrow, heads, width, half) = (2usize, 3usize, 20usize, 4usize);
    let inv_freq: Vec<f32> = (0..half).map(|i| 10000f32.powf(-(2.0 * i as f32) / (2 * half) as f32)).collect();
    let pos = [5i32, 70_000];
    for inverse in [0, 1] {
        let x0 = rng.vec(nrow * heads * width, 1.0);
        let mut x = x0.clone();
        let p = Plan::rope(nrow * heads, width, half).unwrap();
        let (g, b) = dims(&p);
        // SAFETY: x holds nrow × heads vectors of width values, inv_freq half values, pos nrow positions.
        unsafe {
            shim_ds4_rope(
                &g,
                &b,
                x.as_mut_ptr(),
                inv_freq.as_ptr(),
                pos.as_ptr(),
                width as i32,
                heads as i32,
                half as i32,
                inverse,
                (nrow * heads) as i32,
            )
        };
        for v in 0..nrow * heads {
            let base = v * width;
            assert_eq!(x[base..base + width - 2 * half], x0[base..base + width - 2 * half], "untouched part");
            for (i, &f) in inv_freq.iter().enumerate() {
                let (s, c) = (pos[v / heads] as f32 * f).sin_cos();
                let s = if inverse == 1 { -s } else { s };
                let at = base + width - 2 * half + 2 * i;
                let (a, bb) = (x0[at], x0[at + 1]);
                let want = [a * c - bb * s, bb * c + a * s];
                for k in 0..2 {
                    assert!((x[at + k] - want[k]).abs() <= 1e-5, "rope v {v} pair {i}: {} vs {}", x[at + k], want[k]);
                }
            }
        }
    }

    // SwiGLU against the CPU's kernel (kernels-native cpu::swiglu, bit-identical to the engine's).
    let n = 1000usize;
    let g0 = rng.vec(n, 15.0);
    let u = rng.vec(n, 15.0);
    let (mut gd, mut gc) = (g0.clone(), g0.clone());
    let p = Plan::swiglu(n).unwrap();
    let (gg, bb) = dims(&p);
    // SAFETY: gd and u hold n values.
    unsafe { shim_ds4_swiglu(&gg, &bb, gd.as_mut_ptr(), u.as_ptr(), n as i64, 10.0) };
    swiglu_x8(&mut gc, &u, 10.0);
    for i in 0..n {
        assert!((gd[i] - gc[i]).abs() <= 1e-6 * gc[i].abs().max(1e-3), "swiglu {i}: {} vs {}", gd[i], gc[i]);
    }
}

/// The routing kernel against the CPU's routing rule: learned routing (scores + bias, top k, ties to the lower id:
/// the logits are coarse so ties occur) and hash routing (the token's fixed experts); ids equal, weights bit for bit
/// (the shim's expf/log1pf are the host's, as the CPU's).
#[test]
fn moe_route_matches_the_cpu_routing() {
    use ds4_engine::backend::cpu::routing::{router_scores, routing_weights, top_k_biased};
    let mut rng = Rng(91);
    let (n, ne, k, vocab) = (37usize, 64usize, 6usize, 50usize);
    let logits: Vec<f32> = (0..n * ne).map(|_| (rng.f() * 8.0).round() / 4.0).collect();
    let bias: Vec<f32> = (0..ne).map(|_| (rng.f() * 4.0).round() / 8.0).collect();
    let table: Vec<i32> = (0..vocab * k).map(|_| (rng.next() % ne as u64) as i32).collect();
    let tokens: Vec<i32> = (0..n).map(|_| (rng.next() % vocab as u64) as i32).collect();
    for (hash, with_bias, norm, scale) in
        [(false, true, true, 1.5f32), (false, false, false, 1.0), (true, false, true, 2.5)]
    {
        let p = Plan::moe_route(n, ne, k).unwrap();
        let (g, b) = dims(&p);
        let (mut ids, mut rw) = (vec![-1i32; n * k], vec![f32::NAN; n * k]);
        let bias_p = if with_bias { bias.as_ptr() } else { std::ptr::null() };
        let (table_p, tokens_p) =
            if hash { (table.as_ptr(), tokens.as_ptr()) } else { (std::ptr::null(), std::ptr::null()) };
        // SAFETY: logits n × ne, bias ne, table vocab × k, tokens n, ids and rw n × k.
        unsafe {
            shim_ds4_moe_route(
                &g,
                &b,
                logits.as_ptr(),
                bias_p,
                table_p,
                tokens_p,
                ids.as_mut_ptr(),
                rw.as_mut_ptr(),
                n as i32,
                ne as i32,
                k as i32,
                i32::from(norm),
                scale,
            )
        };
        let mut ties = 0;
        for r in 0..n {
            let mut scores = logits[r * ne..(r + 1) * ne].to_vec();
            router_scores(&mut scores);
            let mut sel = vec![0u32; k];
            if hash {
                let t = tokens[r] as usize;
                sel.iter_mut().zip(&table[t * k..(t + 1) * k]).for_each(|(s, &e)| *s = e as u32);
            } else {
                top_k_biased(&scores, with_bias.then_some(&bias[..]), &mut sel);
                let biased = |e: u32| scores[e as usize] + if with_bias { bias[e as usize] } else { 0.0 };
                ties += (0..ne as u32).filter(|e| !sel.contains(e) && biased(*e) == biased(sel[k - 1])).count();
            }
            let mut w = vec![0f32; k];
            routing_weights(&scores, &sel, norm, scale, &mut w);
            let got: Vec<u32> = ids[r * k..(r + 1) * k].iter().map(|&e| e as u32).collect();
            assert_eq!(got, sel, "hash {hash} row {r}: ids");
            let gw: Vec<u32> = rw[r * k..(r + 1) * k].iter().map(|v| v.to_bits()).collect();
            assert_eq!(gw, w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "hash {hash} row {r}: weights");
        }
        assert!(hash || ties > 0, "the coarse logits make ties at the k-th place, which the lower id wins");
    }
}

/// The head's candidate selection against the sampler's: coarse values (many ties, broken by the lower id), NaN,
/// −∞, +∞, −0 next to +0, and rows with fewer eligible values than k (the list ends with `u32::MAX`, −∞).
#[test]
fn top_candidates_match_the_sampler() {
    use ds4_engine::sampler::top_candidates;
    let mut rng = Rng(7);
    let vocab = 700usize;
    let mut rows: Vec<Vec<f32>> = (0..4).map(|_| (0..vocab).map(|_| (rng.f() * 6.0).round() / 2.0).collect()).collect();
    for (i, v) in rows[1].iter_mut().enumerate() {
        *v = match i % 7 {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            2 => -0.0,
            3 => 0.0,
            _ => *v,
        };
    }
    rows[1][650] = f32::INFINITY;
    rows[2].iter_mut().enumerate().for_each(|(i, v)| *v = if i % 100 == 9 { i as f32 * -0.5 } else { f32::NAN });
    rows[3].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
    let x: Vec<f32> = rows.concat();
    for k in [1usize, 5, 64] {
        let n = rows.len();
        let p = Plan::top_candidates(n, vocab, k).unwrap();
        let (g, b) = dims(&p);
        let (mut ids, mut vals) = (vec![0u32; n * k], vec![0f32; n * k]);
        // SAFETY: x holds n rows of vocab, ids and vals n × k.
        unsafe {
            shim_ds4_top_candidates(&g, &b, x.as_ptr(), vocab as i32, k as i32, ids.as_mut_ptr(), vals.as_mut_ptr())
        };
        for (r, row) in rows.iter().enumerate() {
            let (mut wi, mut wv) = (vec![0u32; k], vec![0f32; k]);
            top_candidates(row, &mut wi, &mut wv);
            assert_eq!(&ids[r * k..(r + 1) * k], &wi[..], "k {k} row {r}: ids");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&vals[r * k..(r + 1) * k]), bits(&wv), "k {k} row {r}: values");
        }
    }
}
