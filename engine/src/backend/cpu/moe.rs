//! The MoE FFN op of one layer, for every row of the batch.
//!
//! `x = RMSNorm(u)·ffn_norm`; router scores `s = sqrt(softplus(gate·x))`; selection `topk(s + bias)` (ties to the
//! lower expert id) or, on hash layers, `tid2eid[token]`; weights `s[sel]` renormalised (`/ (Σ + 1e-20)`) when
//! the model says so, times the routed scale. Expert `e`: `w2( silu(min(w1·x, L)) · clamp(w3·x, −L, L) )`.
//! Rows are grouped by expert so each expert's weights are read once per batch; contributions are added in
//! ascending expert order, then the shared expert (same clamped SwiGLU, weight 1).

use super::matmul::{matmul, matmul_gather};
use super::norm::rms_norm_rows;
use super::{CpuBackend, Scratch};
use crate::backend::StepCtx;
use crate::Result;

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `h1 ← silu(min(h1, L)) · clamp(h3, −L, L)`.
fn swiglu(h1: &mut [f32], h3: &[f32], limit: f32) {
    for (a, &b) in h1.iter_mut().zip(h3) {
        *a = silu(a.min(limit)) * b.clamp(-limit, limit);
    }
}

/// Runs [`crate::graph::Op::Moe`] for `layer`.
#[allow(clippy::needless_range_loop)]
pub fn moe(be: &CpuBackend, sc: &mut Scratch, cx: &mut StepCtx<'_>, layer: usize) -> Result<()> {
    let pool = &be.pool;
    let model = cx.model;
    let c = &model.config;
    let lw = &model.layers[layer];
    let rows = &cx.batch.rows;
    let n = rows.len();
    let (d, ne, k, ffn) = (c.d_model, c.n_experts, c.n_experts_used, c.expert_ffn);
    let limit = c.swiglu_limit[layer];

    rms_norm_rows(&cx.act.collapsed, model.dense(lw.ffn_norm), c.rms_eps, n, &mut sc.xn);
    matmul(pool, model.mat(lw.gate), &sc.xn, n, &mut sc.router)?;

    // Selection and weights per row.
    let bias = lw.gate_bias.map(|b| model.dense(b));
    for e in sc.expert_rows.iter_mut() {
        e.clear();
    }
    if sc.expert_rows.len() < ne {
        sc.expert_rows.resize_with(ne, Vec::new);
    }
    for r in 0..n {
        let logits = &mut sc.router[r * ne..(r + 1) * ne];
        for v in logits.iter_mut() {
            *v = softplus(*v).sqrt();
        }
        let sel = &mut sc.sel_e[r * k..(r + 1) * k];
        match &lw.tid2eid {
            Some(t) => {
                let tok = rows[r].token as usize;
                for (j, s) in sel.iter_mut().enumerate() {
                    *s = t[tok * k + j];
                }
            }
            None => {
                // Top-k of s + bias, ties to the lower id: insertion into a sorted list of k.
                let mut n_in = 0usize;
                let biased = |e: usize| logits[e] + bias.map_or(0.0, |b| b[e]);
                for e in 0..ne {
                    let v = biased(e);
                    let mut at = n_in;
                    while at > 0 && biased(sel[at - 1] as usize) < v {
                        at -= 1;
                    }
                    if at < k {
                        let end = n_in.min(k - 1);
                        for i in (at..end).rev() {
                            sel[i + 1] = sel[i];
                        }
                        sel[at] = e as u32;
                        n_in = (n_in + 1).min(k);
                    }
                }
            }
        }
        let w = &mut sc.w_e[r * k..(r + 1) * k];
        let mut sum = 0f32;
        for (wj, &e) in w.iter_mut().zip(sel.iter()) {
            *wj = logits[e as usize];
            sum += *wj;
        }
        for wj in w.iter_mut() {
            if c.weights_norm {
                *wj /= sum + 1e-20;
            }
            *wj *= c.routed_scale;
        }
        for (j, &e) in sel.iter().enumerate() {
            sc.expert_rows[e as usize].push((r, j));
        }
    }

    // Routed experts, ascending id.
    let out = &mut cx.act.sub_out[..n * d];
    out.fill(0.0);
    let (gate_m, up_m, down_m) = (model.mat(lw.gate_exps), model.mat(lw.up_exps), model.mat(lw.down_exps));
    for e in 0..ne {
        let list = std::mem::take(&mut sc.expert_rows[e]);
        if !list.is_empty() {
            let m = list.len();
            sc.idx.clear();
            sc.idx.extend(list.iter().map(|&(r, _)| r));
            matmul_gather(pool, gate_m.rows_slice(e * ffn, ffn), &sc.xn, &sc.idx, &mut sc.h1)?;
            matmul_gather(pool, up_m.rows_slice(e * ffn, ffn), &sc.xn, &sc.idx, &mut sc.h3)?;
            swiglu(&mut sc.h1[..m * ffn], &sc.h3[..m * ffn], limit);
            matmul(pool, down_m.rows_slice(e * d, d), &sc.h1, m, &mut sc.eo)?;
            for (i, &(r, j)) in list.iter().enumerate() {
                let w = sc.w_e[r * k + j];
                for (o, &v) in out[r * d..(r + 1) * d].iter_mut().zip(&sc.eo[i * d..(i + 1) * d]) {
                    *o += w * v;
                }
            }
        }
        sc.expert_rows[e] = list;
    }

    // Shared expert.
    if let (Some(g), Some(u), Some(dn)) = (lw.gate_sh, lw.up_sh, lw.down_sh) {
        matmul(pool, model.mat(g), &sc.xn, n, &mut sc.h1)?;
        matmul(pool, model.mat(u), &sc.xn, n, &mut sc.h3)?;
        swiglu(&mut sc.h1[..n * ffn], &sc.h3[..n * ffn], limit);
        matmul(pool, model.mat(dn), &sc.h1, n, &mut sc.eo)?;
        for (o, &v) in out.iter_mut().zip(&sc.eo[..n * d]) {
            *o += v;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations() {
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        let mut h1 = [20.0f32, -1.0];
        swiglu(&mut h1, &[5.0, -0.5], 1.5);
        assert!((h1[0] - silu(1.5) * 1.5).abs() < 1e-6);
        assert!((h1[1] - silu(-1.0) * -0.5).abs() < 1e-6);
    }
}
