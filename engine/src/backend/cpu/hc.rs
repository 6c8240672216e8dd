//! mHC (manifold-constrained hyper-connections) per token: the pre-mix that collapses `hc` streams into a sublayer
//! input, the post-mix that writes the sublayer output back, and the head collapse.
//!
//! Reference order (the golden data follows it): `v` = flattened streams, unweighted-RMSNormed with the model's
//! RMS eps; `mix = fn · v`; `pre = σ(mix·s0 + b) + hc_eps`; `post = 2σ(mix·s1 + b)`;
//! `comb = softmax_rows(mix·s2 + b) + hc_eps`, then column-normalise, then `iters − 1` rounds of
//! (row-normalise, column-normalise), each with `+ hc_eps` in the denominator. Post-mix:
//! `X'_k = post_k · f + Σ_j comb[j][k] · X_j`.

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[allow(clippy::too_many_arguments)]
/// Computes `pre`, `post` and `comb` from one row's `mix` (`(2+hc)·hc` values); `comb` is `[j][k]` row-major.
pub fn hc_weights(
    mix: &[f32],
    base: &[f32],
    scale: &[f32],
    hc: usize,
    eps: f32,
    iters: usize,
    pre: &mut [f32],
    post: &mut [f32],
    comb: &mut [f32],
) {
    for j in 0..hc {
        pre[j] = sigmoid(mix[j] * scale[0] + base[j]) + eps;
        post[j] = 2.0 * sigmoid(mix[hc + j] * scale[1] + base[hc + j]);
    }
    for j in 0..hc {
        let row = &mut comb[j * hc..(j + 1) * hc];
        for k in 0..hc {
            row[k] = mix[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
        }
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut s = 0f32;
        for v in row.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        for v in row.iter_mut() {
            *v = *v / s + eps;
        }
    }
    let col_norm = |comb: &mut [f32]| {
        for k in 0..hc {
            let s: f32 = (0..hc).map(|j| comb[j * hc + k]).sum();
            for j in 0..hc {
                comb[j * hc + k] /= s + eps;
            }
        }
    };
    col_norm(comb);
    for _ in 1..iters {
        for j in 0..hc {
            let row = &mut comb[j * hc..(j + 1) * hc];
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= s + eps);
        }
        col_norm(comb);
    }
}

/// `u = Σ_j pre_j · X_j` for one row (`x` = `hc` streams of `d`).
pub fn collapse(x: &[f32], pre: &[f32], d: usize, u: &mut [f32]) {
    u.fill(0.0);
    for (j, &p) in pre.iter().enumerate() {
        for (o, &v) in u.iter_mut().zip(&x[j * d..(j + 1) * d]) {
            *o += p * v;
        }
    }
}

/// Post-mix of one row, in place: `X'_k = post_k · f + Σ_j comb[j][k] · X_j`. `tmp` holds `hc·d` values.
pub fn post_mix(x: &mut [f32], f: &[f32], post: &[f32], comb: &[f32], hc: usize, d: usize, tmp: &mut [f32]) {
    tmp[..hc * d].copy_from_slice(&x[..hc * d]);
    for k in 0..hc {
        // `s_i = Σ_j comb[j][k] · tmp_j[i]` (from 0, in `j` order) accumulated in `out` across `i` (vectorizable),
        // then `out_i = post_k · f_i + s_i`: the same operations in the same order per element as one loop per `i`.
        let out = &mut x[k * d..(k + 1) * d];
        out.fill(0.0);
        for j in 0..hc {
            let c = comb[j * hc + k];
            for (o, &t) in out.iter_mut().zip(&tmp[j * d..(j + 1) * d]) {
                *o += c * t;
            }
        }
        for (o, &fi) in out.iter_mut().zip(&f[..d]) {
            *o += post[k] * fi; // `post_k · f_i + s_i` (addition commutes exactly)
        }
    }
}

/// Writes, for each of `rows` rows of `hc` streams of `d` (`streams`), the mean of its streams into block `tap` of
/// the row in `out` (rows of `out.len() / rows` values, whole blocks of `d`): [`crate::graph::Op::TapStreams`].
pub fn tap_means(streams: &[f32], rows: usize, hc: usize, d: usize, tap: usize, out: &mut [f32]) {
    let width = out.len().checked_div(rows).unwrap_or(0);
    for r in 0..rows {
        let o = &mut out[r * width + tap * d..r * width + (tap + 1) * d];
        o.fill(0.0);
        for j in 0..hc {
            for (a, &v) in o.iter_mut().zip(&streams[(r * hc + j) * d..(r * hc + j + 1) * d]) {
                *a += v;
            }
        }
        o.iter_mut().for_each(|a| *a /= hc as f32);
    }
}

/// Head weights: `pre_j = σ(mix_j · scale + base_j) + eps`.
pub fn head_weights(mix: &[f32], base: &[f32], scale: f32, eps: f32, pre: &mut [f32]) {
    for (j, p) in pre.iter_mut().enumerate() {
        *p = sigmoid(mix[j] * scale + base[j]) + eps;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comb_is_doubly_stochastic() {
        let hc = 4;
        let mix: Vec<f32> = (0..24).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let base = vec![0.1f32; 24];
        let (mut pre, mut post, mut comb) = (vec![0f32; 4], vec![0f32; 4], vec![0f32; 16]);
        hc_weights(&mix, &base, &[1.0, 1.0, 1.0], hc, 1e-6, 20, &mut pre, &mut post, &mut comb);
        for j in 0..hc {
            let r: f32 = comb[j * hc..(j + 1) * hc].iter().sum();
            let c: f32 = (0..hc).map(|i| comb[i * hc + j]).sum();
            assert!((r - 1.0).abs() < 1e-3 && (c - 1.0).abs() < 1e-4, "row {r} col {c}");
        }
        assert!(pre.iter().all(|&p| p > 0.0 && p < 1.0 + 1e-5));
        assert!(post.iter().all(|&p| p > 0.0 && p < 2.0));
    }

    #[test]
    fn post_mix_uses_transposed_comb() {
        let (hc, d) = (2, 1);
        let mut x = vec![1.0f32, 10.0];
        let comb = [0.0f32, 1.0, 0.0, 0.0]; // comb[0][1] = 1: stream 1 receives X_0
        let mut tmp = vec![0f32; 2];
        post_mix(&mut x, &[0.5], &[2.0, 4.0], &comb, hc, d, &mut tmp);
        assert_eq!(x, vec![1.0, 2.0 + 1.0]);
    }

    #[test]
    fn post_mix_matches_the_per_element_sum_bit_for_bit() {
        let (hc, d) = (4, 37);
        let val = |i: usize, m: usize| ((i * m % 29) as f32 - 14.0) * 0.173;
        let x0: Vec<f32> = (0..hc * d).map(|i| val(i, 7)).collect();
        let f: Vec<f32> = (0..d).map(|i| val(i, 11)).collect();
        let post: Vec<f32> = (0..hc).map(|i| val(i, 5) * 0.1).collect();
        let comb: Vec<f32> = (0..hc * hc).map(|i| val(i, 13) * 0.05).collect();
        let mut want = x0.clone();
        for k in 0..hc {
            for i in 0..d {
                let mut s = 0f32;
                for j in 0..hc {
                    s += comb[j * hc + k] * x0[j * d + i];
                }
                want[k * d + i] = post[k] * f[i] + s;
            }
        }
        let (mut x, mut tmp) = (x0.clone(), vec![0f32; hc * d]);
        post_mix(&mut x, &f, &post, &comb, hc, d, &mut tmp);
        assert_eq!(
            x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
